"""``Directory`` on a Redis server.

Layout of the Redis key space (``ns`` prefix, default ``fc``; ``tenant`` is ``tenant_tag``):

- ``{ns}:n:{node}``                      -> ``"{incarnation}|{endpoint}"``, a lease (PX ttl)
- ``{ns}:t:{tenant}:p:{key}``            -> ``"{node}|{incarnation}"``  (last writer wins)
- ``{ns}:t:{tenant}:s:{node}:{session}`` -> set of the session's keys (for removal)
- ``{ns}:ns:{node}``                     -> set of this node's session keys (for leave)

A page entry counts only while its node's lease is held by the *same incarnation*: a node
that leaves, dies (lease expires) or restarts (new incarnation) loses its entries at lookup
time, with no sweep.  ``lookup`` is one Lua script call (EVALSHA; the very first call on a
server also loads the script): every page key and the owners'
leases are read server-side in a single round trip.
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

from ..errors import ConfigError
from .directory import Directory, DirectoryError, Lookup, tenant_tag
from .redis_lua import LOOKUP, REMOVE


class RedisDirectory(Directory):
    """``Directory`` on a Redis server (``redis://host:port/db``).

    ``lease_ms`` is how long a silent node keeps its entries; the heartbeat refreshes the
    lease every third of it.  ``timeout_s`` bounds every call (a partitioned directory is a
    ``DirectoryError``, which callers treat as a miss)."""

    def __init__(self, url: str, lease_ms: int = 3000, timeout_s: float = 0.5,
                 namespace: str = "fc") -> None:
        import redis
        if lease_ms < 30:
            raise ConfigError(f"lease_ms={lease_ms!r} is not allowed: expected >= 30")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s={timeout_s!r} is not allowed: expected > 0")
        if not namespace or "|" in namespace or ":" in namespace:
            raise ConfigError(f"namespace={namespace!r} is not allowed: non-empty, no ':' or '|'")
        self.lease_ms, self.ns = lease_ms, namespace
        self._r = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                       socket_connect_timeout=timeout_s, decode_responses=True)
        self._redis_errors = (redis.RedisError, OSError)
        self._lookup = self._r.register_script(LOOKUP)
        self._remove = self._r.register_script(REMOVE)
        self.node: int | None = None
        self._lease_value = ""
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ keys
    def _lease_key(self, node: int) -> str:
        return f"{self.ns}:n:{node}"

    def _page_prefix(self, tenant: str) -> str:
        return f"{self.ns}:t:{tenant_tag(tenant)}:p:"

    def _session_key(self, tenant: str, session: str) -> str:
        return f"{self.ns}:t:{tenant_tag(tenant)}:s:{self.node}:{session}"

    def _call(self, what: str, fn, *a, **kw):
        try:
            return fn(*a, **kw)
        except self._redis_errors as e:
            raise DirectoryError(f"directory {what} failed: {e}") from e

    # ------------------------------------------------------------------ lease
    def join(self, node: int, endpoint: str, exclusive: bool = False) -> None:
        """``Directory.join``; with ``exclusive``, a node id whose lease another live process
        holds is refused (``ConfigError``) instead of taken over."""
        if not isinstance(node, int) or not 0 <= node <= 4095:
            raise ConfigError(f"node={node!r} is not allowed: expected 0..4095 (12 bits)")
        if "|" in endpoint or not endpoint:
            raise ConfigError(f"endpoint={endpoint!r} is not allowed: non-empty, no '|'")
        if self.node is not None:
            raise DirectoryError(f"already joined as node {self.node}")
        inc = os.urandom(8).hex()
        self._lease_value = f"{inc}|{endpoint}"
        self._entry = f"{node}|{inc}"
        if not self._call("join", self._r.set, self._lease_key(node), self._lease_value,
                          px=self.lease_ms, nx=exclusive):
            held = self._call("join", self._r.get, self._lease_key(node)) or "|?"
            raise ConfigError(f"node={node!r} is already in the cluster (its lease is held by "
                              f"{held.split('|', 1)[1]}): give each server its own node id")
        self.node = node
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name=f"fc-lease-{node}", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        """Refresh the lease every third of its life; a failed refresh is retried on the next
        beat (the lease may lapse meanwhile: entries read as misses until it is back)."""
        while not self._stop.wait(self.lease_ms / 3000):
            try:
                self._r.set(self._lease_key(self.node), self._lease_value, px=self.lease_ms)
            except self._redis_errors:
                continue

    def _stop_beat(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None

    def leave(self) -> None:
        if self.node is None:
            return
        self._stop_beat()
        node_sessions = f"{self.ns}:ns:{self.node}"
        for sk in self._call("leave", self._r.smembers, node_sessions):
            prefix = sk.split(":s:")[0] + ":p:"
            self._call("leave", self._remove, keys=[sk, node_sessions], args=[self._entry, prefix])
        self._call("leave", self._r.delete, self._lease_key(self.node), node_sessions)
        self.node = None

    # ------------------------------------------------------------------ entries
    def publish(self, tenant: str, session: str, keys: Sequence[str]) -> None:
        if self.node is None:
            raise DirectoryError("publish before join")
        if not keys:
            return
        pre, sk = self._page_prefix(tenant), self._session_key(tenant, session)
        p = self._r.pipeline(transaction=True)
        p.mset({pre + k: self._entry for k in keys})
        p.sadd(sk, *keys)
        p.sadd(f"{self.ns}:ns:{self.node}", sk)
        self._call("publish", p.execute)

    def remove_session(self, tenant: str, session: str) -> int:
        if self.node is None:
            return 0
        return int(self._call("remove", self._remove,
                              keys=[self._session_key(tenant, session), f"{self.ns}:ns:{self.node}"],
                              args=[self._entry, self._page_prefix(tenant)]))

    def lookup(self, tenant: str, keys: Sequence[str]) -> Lookup:
        if not keys:
            return Lookup(0, (), {})
        pre = self._page_prefix(tenant)
        owners, eps = self._call("lookup", self._lookup, keys=[pre + k for k in keys],
                                 args=[f"{self.ns}:n:"])
        endpoints = {int(eps[i]): eps[i + 1] for i in range(0, len(eps), 2)}
        return Lookup(len(owners), tuple(int(o) for o in owners), endpoints)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.leave()
        finally:
            self._stop_beat()
            self._r.close()
