"""The cluster directory: which node holds a stored page, one round trip per lookup.

Granularity is the page (one store key).  Layout of the Redis key space (``ns`` prefix,
default ``fc``); tenants (``cache_salt``) live under their own hashed prefix, so one
tenant's lookup can never name another's page:

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

import abc
import os
import threading
from dataclasses import dataclass
from typing import Sequence

import xxhash

from ..errors import ConfigError, FlatCakeError


class DirectoryError(FlatCakeError):
    """The directory service could not be reached or refused a call; nothing was changed
    by a failed ``publish``/``remove_session`` beyond what the service had applied."""


@dataclass(frozen=True)
class Owner:
    node: int
    endpoint: str                # the owner's request-service address (``tcp://host:port``)


@dataclass(frozen=True)
class Lookup:
    """The leading run of a request's keys that live nodes hold.

    ``owners[i]`` is the node holding key ``i`` for ``i < hits``; ``endpoints`` maps each
    of those nodes to its service address.  ``hits == 0`` is a miss."""

    hits: int
    owners: tuple[int, ...]
    endpoints: dict[int, str]

    def runs(self) -> list[tuple[int, int, int]]:
        """``(node, start, count)`` for each stretch of the hit run held by one node."""
        out: list[tuple[int, int, int]] = []
        for i, n in enumerate(self.owners):
            if out and out[-1][0] == n:
                out[-1] = (n, out[-1][1], out[-1][2] + 1)
            else:
                out.append((n, i, 1))
        return out


class Directory(abc.ABC):
    """Contract every directory implementation meets (tests/test_cluster_directory.py)."""

    @abc.abstractmethod
    def join(self, node: int, endpoint: str) -> None:
        """Take this node's lease (refreshed until ``leave``/``close``).  Raises
        ``ConfigError`` for a node outside 0..4095 or an endpoint with ``|`` in it."""

    @abc.abstractmethod
    def leave(self) -> None:
        """Drop the lease and every entry this node published; a no-op when not joined."""

    @abc.abstractmethod
    def publish(self, tenant: str, session: str, keys: Sequence[str]) -> None:
        """Record that this node holds ``keys`` of ``session`` for ``tenant``.  Raises
        ``DirectoryError`` when not joined."""

    @abc.abstractmethod
    def remove_session(self, tenant: str, session: str) -> int:
        """Drop ``session``'s entries that still name this node (a page another node has
        since published stays theirs); returns how many went.  Unknown session: 0."""

    @abc.abstractmethod
    def lookup(self, tenant: str, keys: Sequence[str]) -> Lookup:
        """The leading run of ``keys`` held by live nodes, in one round trip."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the heartbeat and leave; a second call does nothing."""


_LOOKUP = """
local lease_prefix = ARGV[1]
local owners, eps, seen = {}, {}, {}
for i = 1, #KEYS do
  local e = redis.call('GET', KEYS[i])
  if not e then break end
  local bar = string.find(e, '|', 1, true)
  if not bar then break end
  local node, inc = string.sub(e, 1, bar - 1), string.sub(e, bar + 1)
  local lease = seen[node]
  if lease == nil then
    lease = redis.call('GET', lease_prefix .. node) or false
    seen[node] = lease
    if lease then
      local lb = string.find(lease, '|', 1, true)
      if lb and string.sub(lease, 1, lb - 1) == inc then
        table.insert(eps, node); table.insert(eps, string.sub(lease, lb + 1))
      else
        seen[node] = false
        lease = false
      end
    end
  end
  if not lease then break end
  if string.sub(lease, 1, string.find(lease, '|', 1, true) - 1) ~= inc then break end
  table.insert(owners, node)
end
return {owners, eps}
"""

_REMOVE = """
local mine, n = ARGV[1], 0
for _, k in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('GET', ARGV[2] .. k) == mine then redis.call('DEL', ARGV[2] .. k); n = n + 1 end
end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], KEYS[1])
return n
"""


def tenant_tag(tenant: str) -> str:
    """The tenant's key-space prefix: a hash, so no tenant string can reach another's keys."""
    if not isinstance(tenant, str):
        raise ConfigError(f"tenant={tenant!r} is not a string (cache_salt)")
    return xxhash.xxh3_128_hexdigest(tenant.encode())


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
        self._lookup = self._r.register_script(_LOOKUP)
        self._remove = self._r.register_script(_REMOVE)
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
    def join(self, node: int, endpoint: str) -> None:
        if not isinstance(node, int) or not 0 <= node <= 4095:
            raise ConfigError(f"node={node!r} is not allowed: expected 0..4095 (12 bits)")
        if "|" in endpoint or not endpoint:
            raise ConfigError(f"endpoint={endpoint!r} is not allowed: non-empty, no '|'")
        if self.node is not None:
            raise DirectoryError(f"already joined as node {self.node}")
        inc = os.urandom(8).hex()
        self._lease_value = f"{inc}|{endpoint}"
        self._entry = f"{node}|{inc}"
        self._call("join", self._r.set, self._lease_key(node), self._lease_value, px=self.lease_ms)
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
