"""``Directory`` on a Redis server.

Layout of the Redis key space (``ns`` prefix, default ``fc``; ``tenant`` is ``tenant_tag``):

- ``{ns}:n:{node}``                      -> ``"{incarnation}|{endpoint}|{mac}"``, a lease (PX ttl)
- ``{ns}:t:{tenant}:p:{name}``           -> ``"{node}|{incarnation}|{mac}"``  (last writer wins)
- ``{ns}:t:{tenant}:s:{node}:{session}`` -> set of the session's page names (for removal)

``name`` is a page key's keyed name (``redis_entries.page_name``): Redis never holds a page
key, which anyone could compute from token ids, in the clear.
- ``{ns}:ns:{node}``                     -> set of this node's session keys (for leave)

A page entry counts only while its node's lease is held by the *same incarnation*: a node
that leaves, dies (lease expires) or restarts (new incarnation) loses its entries at lookup
time, with no sweep.  ``lookup`` is one Lua script call (EVALSHA; the very first call on a
server also loads the script): every page key and the owners'
leases are read server-side in a single round trip.

Every lease and entry is signed (Ed25519) by the node it names (``identity``; public keys
from the operator's roster) over what it says (node, incarnation, endpoint; tenant tag, key);
``lookup`` ends the run at the first one that fails or does not parse (a miss, logged once:
``redis_entries`` parses strictly), so a Redis writer -- another member included -- can
delete entries (a miss) but never point a node at an owner or a page in another node's
name, nor make a lookup raise.  A value whose signature checked is remembered (bounded), so
a lookup pays one check per entry once.  The lease is refreshed and dropped by
compare-and-set: it is lost only to a *valid* lease of this node id with another incarnation
(a node id taken over is never written back); junk on the lease key is overwritten, and the
heartbeat thread survives any failure.  ``join`` purges what dead incarnations of its node
id left behind.  The password can come from ``FLATCAKE_REDIS_PASSWORD`` instead of the URL;
``redis_url_for_logs`` hides it.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Sequence

from ..config_check import redact_url
from ..errors import ConfigError
from .directory import Directory, DirectoryError, Lookup
from .redis_entries import (entry_sig, lease_value, page_name, parse_entry, parse_node,
                            valid_entry, valid_lease)
from .redis_lua import BEAT, LEAVE, LOOKUP, PURGE, REMOVE
from .secret import ClusterSecret

log = logging.getLogger("sglang_flatcake")
SEEN_KEPT = 1 << 16          # verified entries and leases remembered (an Ed25519 check each)


def redis_url_for_logs(url: str) -> str:
    """``url`` with any password replaced by ``***`` (``config_check.redact_url``)."""
    return redact_url(url)


class RedisDirectory(Directory):
    """``Directory`` on a Redis server (``redis://host:port/db``).

    ``lease_ms`` is how long a silent node keeps its entries; the heartbeat refreshes the
    lease every third of it.  ``timeout_s`` bounds every call (a partitioned directory is a
    ``DirectoryError``, which callers treat as a miss)."""

    def __init__(self, url: str, secret: ClusterSecret, lease_ms: int = 3000,
                 timeout_s: float = 0.5, namespace: str = "fc") -> None:
        import redis
        if lease_ms < 30:
            raise ConfigError(f"lease_ms={lease_ms!r} is not allowed: expected >= 30")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s={timeout_s!r} is not allowed: expected > 0")
        if not namespace or "|" in namespace or ":" in namespace:
            raise ConfigError(f"namespace={namespace!r} is not allowed: non-empty, no ':' or '|'")
        self.lease_ms, self.ns, self.secret = lease_ms, namespace, secret
        pw = os.environ.get("FLATCAKE_REDIS_PASSWORD")
        self._r = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                       socket_connect_timeout=timeout_s, decode_responses=False,
                                       **({"password": pw} if pw else {}))
        self._redis_errors = (redis.RedisError, OSError)
        self._lookup = self._r.register_script(LOOKUP)
        self._remove = self._r.register_script(REMOVE)
        self._beat_cas = self._r.register_script(BEAT)
        self._leave_cas = self._r.register_script(LEAVE)
        self._purge = self._r.register_script(PURGE)
        self.lost = False            # set when another process took this node id's lease
        self.purged = 0              # entries of dead incarnations removed at join
        self.forged = 0              # entries/leases malformed or failing their MAC at lookup
        self.overwritten = 0         # junk found on this node's lease key and replaced
        self._logged: set[str] = set()    # what was logged once already
        self._seen: dict = {}        # values whose signature checked (bounded: SEEN_KEPT)
        self.node: int | None = None
        self._lease_value = ""
        self._held = None            # what _take last found on the lease key, if not ours
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ keys
    def _lease_key(self, node: int) -> str:
        return f"{self.ns}:n:{node}"

    def _page_prefix(self, tenant: str) -> str:
        return f"{self.ns}:t:{self.secret.tag(tenant)}:p:"

    def _once(self, what: str, msg: str, *args) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(msg + " (logged once)", *args)

    def _session_key(self, tenant: str, session: str) -> str:
        return f"{self.ns}:t:{self.secret.tag(tenant)}:s:{self.node}:{session}"

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
        self._lease_value = lease_value(self.secret, node, inc, endpoint)
        self._inc, self._entry = inc, f"{node}|{inc}|"
        if not exclusive:
            self._call("join", self._r.set, self._lease_key(node), self._lease_value,
                       px=self.lease_ms)
        elif not self._call("join", self._take, node):
            held = valid_lease(self.secret, node, self._held)
            raise ConfigError(f"node={node!r} is already in the cluster (its lease is held by "
                              f"{held.endpoint if held else '?'}): give each server its own "
                              f"node id")
        self.purged = int(self._call("join", self._purge, keys=[f"{self.ns}:ns:{node}"],
                                     args=[f"{node}|", self._entry]))
        self.node, self.lost = node, False
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name=f"fc-lease-{node}", daemon=True)
        self._beat.start()

    def _take(self, node: int) -> bool:
        """Set or refresh this lease by compare-and-set: True when it is ours now; False
        when a *valid* lease of ``node`` (another incarnation) holds the key (kept in
        ``_held``).  Junk on the key (not a valid lease) is overwritten, if still there."""
        key = self._lease_key(node)
        held = self._beat_cas(keys=[key], args=[self._lease_value, self.lease_ms, "0", ""])
        if held == 1:
            return True
        self._held = held
        if valid_lease(self.secret, node, held) is not None:
            return False
        self.overwritten += 1
        self._once("lease-junk", "flatcake: node %d's lease key held junk (not a lease of this "
                   "node id): overwritten", node)
        return self._beat_cas(keys=[key], args=[self._lease_value, self.lease_ms, "1", held]) == 1

    def _heartbeat(self) -> None:
        """Refresh the lease every third of its life; a failed refresh is retried on the next
        beat (the lease may lapse meanwhile: entries read as misses until it is back).  Ends
        only at ``leave`` or when a valid lease of this node id with another incarnation
        holds the key; any other failure is logged once and the next beat tries again."""
        while not self._stop.wait(self.lease_ms / 3000):
            try:
                if self._take(self.node):
                    continue
            except self._redis_errors:
                continue
            except Exception:                      # never dies: logged, beat again
                if "beat" not in self._logged:
                    self._logged.add("beat")
                    log.exception("flatcake: node %d's lease refresh failed (logged once; "
                                  "retried every beat)", self.node)
                continue
            self.lost = True               # another process holds this node id now: stop
            log.error("flatcake: node %d's lease was taken by another process; this node "
                      "no longer refreshes it (its entries read as misses)", self.node)
            return

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
        for raw in self._call("leave", self._r.smembers, node_sessions):
            sk = raw.decode("ascii", "replace")
            prefix = sk.split(":s:")[0] + ":p:"
            self._call("leave", self._remove, keys=[sk, node_sessions], args=[self._entry, prefix])
        self._call("leave", self._leave_cas, keys=[self._lease_key(self.node)],
                   args=[self._lease_value])
        if not self.lost:
            self._call("leave", self._r.delete, node_sessions)
        self.node = None

    # ------------------------------------------------------------------ entries
    def publish(self, tenant: str, session: str, keys: Sequence[str]) -> None:
        if self.node is None:
            raise DirectoryError("publish before join")
        if not keys:
            return
        pre, sk = self._page_prefix(tenant), self._session_key(tenant, session)
        p = self._r.pipeline(transaction=True)
        tag = pre.split(":t:", 1)[1][:-3]
        names = [page_name(self.secret, tag, k) for k in keys]
        p.mset({pre + name: self._entry + entry_sig(self.secret, tag, k, self._inc)
                for name, k in zip(names, keys)})
        p.sadd(sk, *names)
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
        tag = pre.split(":t:", 1)[1][:-3]
        _, eps, entries, stop = self._call("lookup", self._lookup,
                                     keys=[pre + page_name(self.secret, tag, k) for k in keys],
                                     args=[f"{self.ns}:n:"])
        leases = {parse_node(eps[i]): eps[i + 1] for i in range(0, len(eps) - 1, 2)}
        endpoints: dict[int, str] = {}
        owners: list[int] = []
        for key, raw in zip(keys, entries):
            e = parse_entry(raw)
            lease = None if e is None else self._lease(e.node, leases.get(e.node))
            if e is None or lease is None or lease.inc != e.inc \
                    or not self._entry_ok(tag, key, raw, e):
                self._forged()
                break
            endpoints[e.node] = lease.endpoint
            owners.append(e.node)
        else:
            if stop and parse_entry(stop[0]) is None:     # not an entry at all: planted
                self._forged()
        return Lookup(len(owners), tuple(owners), endpoints)

    def _lease(self, node: int, raw):
        """``valid_lease``, its signature checked once per value (``_seen``)."""
        seen = self._seen.get(("lease", node, raw))
        if seen is None:
            seen = valid_lease(self.secret, node, raw)
            if seen is not None:
                self._remember(("lease", node, raw), seen)
        return seen

    def _entry_ok(self, tag: str, key: str, raw, e) -> bool:
        """``valid_entry``, its signature checked once per value (``_seen``)."""
        if (tag, key, raw) in self._seen:
            return True
        ok = valid_entry(self.secret, tag, key, e)
        if ok:
            self._remember((tag, key, raw), True)
        return ok

    def _remember(self, what, value) -> None:
        if len(self._seen) >= SEEN_KEPT:
            self._seen.clear()
        self._seen[what] = value

    def _forged(self) -> None:
        self.forged += 1
        self._once("entry", "flatcake: a malformed or forged directory entry or lease (a miss "
                   "there; forged_entries counts them)")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.leave()
        finally:
            self._stop_beat()
            self._r.close()
