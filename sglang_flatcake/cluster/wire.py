"""The owner/requester wire protocol: sealed JSON messages over a ZeroMQ REQ/REP pair, and
the per-block records a grant carries.

Every message is ``AUTH || kind || sender node id || JSON``, authenticated by the sender's
own keys (``identity``), which no other member holds: requests are Ed25519-signed (``seal``),
replies MAC'd under the X25519 key of the sender and the requester (``seal_to``).
``unseal_from`` checks the size (``MAX_MESSAGE``) and the signature or MAC *before* parsing,
then that the JSON's ``from`` is the node that signed it, then the shape, so a peer outside
the roster gets nothing parsed, and a malformed message is an error answer, never a stopped
service.  A request names the endpoint it is for (``to``) so it cannot be replayed to
another owner.  Requests carry a fresh ``nonce`` that the reply
echoes (``re``), so an old reply cannot stand in for a new one, and ``ts``, the sender's
clock (``MAX_SKEW_S`` apart at most), so a captured request cannot be replayed later; within
that window the owner remembers every nonce it admitted (``NonceRecord``), so it cannot be
replayed sooner either.

- ``fetch {tag, keys, from, to, proof}`` -> ``{hits, lease, peer, bytes, segments, records, ...}``:
  ``proof`` (``tenant_proof``) shows the sender knows the tenant's key, not just its tag; the
  owner stages the leading published run of ``keys`` for tenant ``tag`` in a staging slot
  registered with the Transfer Engine for this grant only (``segments``: ``[first block,
  address, bytes]``), and holds it for requester ``from`` until its ack or ``lease_s``.
  ``records`` are the writing node's publish-time records of those blocks (``block_record``),
  not anything computed at serve time.  ``hits == 0`` is a miss (with a ``reason``).
- ``ack {lease, from, to}`` -> ``{valid}``: unregisters and frees the slot; only the requester the
  lease was granted to can ack it; ``valid`` only when the run was stored throughout.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import secrets
import time

import numpy as np

from .identity import SIG_BYTES
from .secret import ClusterSecret

MAX_MESSAGE = 1 << 20          # bytes a message may have (checked before parsing)
MAX_SKEW_S = 30.0              # a request's ``ts`` this far from the owner's clock is refused
MAX_KEY_CHARS = 256
MAX_KEYS = 4096                # keys one request may name
MAX_SENDER = 128               # bytes of a sender's name (its Transfer Engine session)
MIN_NONCE_CHARS, MAX_NONCE_CHARS = 16, 64
NONCES_KEPT = 1 << 16          # the owner's record of seen nonces (bounded memory)
SIGNED, PAIRED = 1, 2          # a message's kind: Ed25519-signed, or MAC'd for one peer


class WireError(ValueError):
    """A message that is too large, unauthenticated, or malformed (its text says which)."""


def _body(msg: dict, kind: int, sender: int) -> bytes:
    return bytes([kind]) + sender.to_bytes(2, "little") + json.dumps(
        msg, separators=(",", ":")).encode()


def seal(secret: ClusterSecret, msg: dict) -> bytes:
    """``msg`` signed by this node (``secret.identity``): its Ed25519 signature, then
    ``SIGNED``, its node id (2 bytes), the JSON.  Any node can check it against the roster:
    what requests are (the requester need not know the owner's id)."""
    me = secret.identity
    body = _body(msg, SIGNED, me.node)
    return me.sign(b"msg", body) + body


def seal_to(secret: ClusterSecret, msg: dict, peer: int) -> bytes:
    """``msg`` for node ``peer`` alone: a 16-byte MAC under the pair's X25519 key
    (``NodeIdentity.pair_mac``), zero-padded to a signature's length, then ``PAIRED``, this
    node's id, the JSON.  What replies are: cheaper than a signature, and only ``peer`` (and
    this node) can make or check it."""
    me = secret.identity
    body = _body(msg, PAIRED, me.node)
    return me.pair_mac(peer, b"msg", body).ljust(SIG_BYTES, b"\0") + body


def unseal_from(secret: ClusterSecret, raw: bytes,
                limit: int = MAX_MESSAGE) -> tuple[int, dict]:
    """``(sender, message)`` of ``raw`` when it is at most ``limit`` bytes, authenticated as
    coming from the node it names (its signature per the roster, or its MAC under this
    node's pair key with it; checked before parsing), a JSON object, and its ``from`` (if
    any) is that node; else ``WireError``."""
    if len(raw) > limit:
        raise WireError(f"message of {len(raw)} bytes: over the {limit}-byte limit")
    me, at = secret.identity, SIG_BYTES + 3
    sender = int.from_bytes(raw[SIG_BYTES + 1:at], "little") if len(raw) > at else -1
    kind = raw[SIG_BYTES] if len(raw) > at else -1
    if kind == SIGNED:
        ok = me.verify(sender, raw[:SIG_BYTES], b"msg", raw[SIG_BYTES:])
    else:
        ok = kind == PAIRED and not any(raw[16:SIG_BYTES]) \
            and me.pair_check(sender, raw[:16], b"msg", raw[SIG_BYTES:])
    if not ok:
        raise WireError("message not authenticated by a node of the roster")
    try:
        msg = json.loads(raw[at:])
    except (ValueError, RecursionError) as e:
        raise WireError(f"message is not JSON: {type(e).__name__}") from e
    if not isinstance(msg, dict):
        raise WireError(f"message is a {type(msg).__name__}, not an object")
    if msg.get("from", sender) != sender:
        raise WireError("message names another sender than the node that signed it")
    return sender, msg


def unseal(secret: ClusterSecret, raw: bytes, limit: int = MAX_MESSAGE) -> dict:
    """``unseal_from``'s message alone."""
    return unseal_from(secret, raw, limit)[1]


def need(msg: dict, name: str, kind: type | tuple):
    """``msg[name]`` when it is a ``kind`` (never a bool); else ``WireError``."""
    v = msg.get(name)
    if not isinstance(v, kind) or isinstance(v, bool):
        names = "/".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise WireError(f"field {name!r}={str(v)[:40]!r}: expected {names}")
    return v


def fresh(msg: dict) -> float:
    """``msg['ts']`` when it is within ``MAX_SKEW_S`` of this node's clock; else
    ``WireError``."""
    ts = need(msg, "ts", (int, float))
    if not abs(time.time() - ts) <= MAX_SKEW_S:
        raise WireError(f"request ts={ts!r} is stale or from the future")
    return float(ts)


def nonce_of(msg: dict) -> str:
    """The request's ``nonce``: a string of ``MIN_NONCE_CHARS..MAX_NONCE_CHARS``; else
    ``WireError``."""
    nonce = need(msg, "nonce", str)
    if not MIN_NONCE_CHARS <= len(nonce) <= MAX_NONCE_CHARS:
        raise WireError(f"nonce of {len(nonce)} chars: expected {MIN_NONCE_CHARS}.."
                        f"{MAX_NONCE_CHARS}")
    return nonce


class NonceRecord:
    """The nonces of the requests an owner admitted within the freshness window, so a
    captured request sent again is refused.  Holds at most ``capacity``: when full, the
    entry with the oldest ``ts`` is dropped and every request that old or older is refused
    from then on (it could be a replay of what was dropped).  Entries older than the window
    (``MAX_SKEW_S``) are dropped as requests arrive.  Not thread-safe: the owner's one
    serving thread owns it."""

    def __init__(self, capacity: int = NONCES_KEPT) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity!r} is not allowed: expected >= 1")
        self.capacity = capacity
        self._seen: set[str] = set()
        self._by_ts: list[tuple[float, str]] = []     # heap: oldest ts first
        self._floor = float("-inf")                   # requests this old are refused

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, nonce: str, ts: float, now: float) -> bool:
        """True (and remembered) for a nonce not seen before and newer than what was
        dropped to stay within ``capacity``; False for a replay."""
        while self._by_ts and self._by_ts[0][0] < now - MAX_SKEW_S:
            self._seen.discard(heapq.heappop(self._by_ts)[1])
        if nonce in self._seen or ts <= self._floor:
            return False
        if len(self._seen) >= self.capacity:
            old_ts, old = heapq.heappop(self._by_ts)
            self._seen.discard(old)
            self._floor = max(self._floor, old_ts)
            if ts <= self._floor:
                return False
        self._seen.add(nonce)
        heapq.heappush(self._by_ts, (ts, nonce))
        return True


def keys_of(msg: dict, most: int = MAX_KEYS) -> list[str]:
    """The request's ``keys``: a list of at most ``most`` short strings; else ``WireError``."""
    keys = need(msg, "keys", list)
    if len(keys) > most or not all(isinstance(k, str) and 0 < len(k) <= MAX_KEY_CHARS
                                   for k in keys):
        raise WireError(f"keys: expected at most {most} strings of 1..{MAX_KEY_CHARS} chars")
    return keys


def _request(op: str, sender: int, **fields) -> dict:
    return {"op": op, "from": sender, "nonce": secrets.token_hex(16), "ts": time.time(), **fields}


def tenant_proof(tenant_key: bytes, nonce: str) -> str:
    """Proof, bound to one request's ``nonce``, that its sender knows the tenant's key
    (``ClusterSecret.tenant_key``), hex."""
    return hashlib.blake2b(nonce.encode(), key=tenant_key, digest_size=16,
                           person=b"tenant-proof").hexdigest()


def fetch_request(tag: str, keys: list[str], sender: int, tenant_key: bytes) -> dict:
    """Ask for the leading published run of ``keys`` of tenant ``tag`` (``ClusterSecret.tag``),
    with proof of the tenant's key."""
    msg = _request("fetch", sender, tag=tag, keys=keys)
    msg["proof"] = tenant_proof(tenant_key, msg["nonce"])
    return msg


def ack_request(lease: str, sender: int) -> dict:
    """Give a grant's slot back; the reply says whether the run was valid throughout."""
    return _request("ack", sender, lease=lease)


def block_record(secret: ClusterSecret, tag: str, key: str, sums: np.ndarray) -> str:
    """The writing node's record of one block: a MAC over its tenant, key and per-layer
    xxh3_64 checksums (``sums``), hex.  A requester recomputes the checksums of the bytes it
    received and accepts them only if this record matches."""
    return secret.mac(b"block", tag, key, np.ascontiguousarray(sums, "<u8").tobytes()).hex()


def plan_checksums(plan, n: int, layers: int) -> np.ndarray:
    """``(n, layers)`` uint64: each SSD piece's stored checksum from a read ``plan``, 0 elsewhere."""
    known = np.zeros((n, layers), np.uint64)
    keep = plan.piece_dest < n
    known[plan.piece_dest[keep], plan.piece_layer[keep]] = plan.piece_checksum[keep]
    return known


def grant_fields(grant: dict, asked: int, block_bytes: int):
    """``(n, segments, records, memory)`` of a well-formed grant for at most ``asked`` blocks
    whose segments tile its ``n`` blocks exactly, in order, in whole blocks (``memory``: the
    set of its blocks the owner sealed straight from its host arena, whose records the
    requester need not check: no disk in between); else None."""
    n, segs, recs = grant.get("hits"), grant.get("segments"), grant.get("records")
    mem = grant.get("memory", [])
    if not isinstance(mem, list) or not all(type(i) is int for i in mem):
        return None
    if type(n) is not int or not 0 < n <= asked or grant.get("bytes") != n * block_bytes \
            or not isinstance(segs, list) or not isinstance(recs, list) or len(recs) != n \
            or not all(isinstance(r, str) for r in recs) \
            or not isinstance(grant.get("lease"), str) or not isinstance(grant.get("peer"), str):
        return None
    at = 0
    for seg in segs:
        if not isinstance(seg, list) or len(seg) != 3 or any(type(x) is not int for x in seg):
            return None
        first, _, nbytes = seg
        if first != at or nbytes <= 0 or nbytes % block_bytes:
            return None
        at += nbytes // block_bytes
    return (n, segs, recs, frozenset(mem)) if at == n else None
