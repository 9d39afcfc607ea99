"""What ``RedisDirectory`` writes into Redis and how it reads it back: lease and page-entry
values (each signed by the node it names: ``identity``), parsed strictly (anything a Redis writer planted -- not ASCII, odd node ids such as
``'²'`` or 5,000 digits, missing or extra fields -- parses as ``None``, a miss), and the keyed
names of pages (a MAC of the tenant tag and page key under the cluster secret, so Redis never
holds a page key, which SGLang computes from token ids, in the clear)."""

from __future__ import annotations

from typing import NamedTuple

from ..errors import ConfigError
from .identity import SIG_BYTES
from .secret import ClusterSecret

MAX_NODE = 4095
_HEX = frozenset("0123456789abcdef")


class Entry(NamedTuple):
    node: int
    inc: str
    mac: str               # the node's Ed25519 signature, hex


class Lease(NamedTuple):
    inc: str
    endpoint: str
    mac: str               # the node's Ed25519 signature, hex


def _ascii(raw) -> str | None:
    if isinstance(raw, str):
        return raw if raw.isascii() else None
    try:
        return bytes(raw).decode("ascii")
    except (UnicodeDecodeError, TypeError, ValueError):
        return None


def _hex(s: str, most: int) -> bool:
    return 0 < len(s) <= most and set(s) <= _HEX


def parse_node(raw) -> int | None:
    """A node id as Redis holds it: 1-4 ASCII digits, at most ``MAX_NODE``; else None."""
    s = _ascii(raw)
    if s is None or not 0 < len(s) <= 4 or not all("0" <= c <= "9" for c in s):
        return None
    n = int(s)
    return n if n <= MAX_NODE else None


def parse_entry(raw) -> Entry | None:
    """``node|incarnation|mac`` well formed (the MAC is not checked here); else None."""
    s = _ascii(raw)
    parts = s.split("|") if s is not None else ()
    if len(parts) != 3 or not _hex(parts[1], 32) or not _hex(parts[2], 2 * SIG_BYTES):
        return None
    node = parse_node(parts[0])
    return None if node is None else Entry(node, parts[1], parts[2])


def parse_lease(raw) -> Lease | None:
    """``incarnation|endpoint|mac`` well formed (the MAC is not checked here); else None."""
    s = _ascii(raw)
    parts = s.split("|") if s is not None else ()
    if len(parts) != 3 or not _hex(parts[0], 32) or not parts[1] \
            or not _hex(parts[2], 2 * SIG_BYTES):
        return None
    return Lease(*parts)


def _signed_by(secret: ClusterSecret, node: int, sig: str, purpose: bytes, *parts) -> bool:
    try:
        raw = bytes.fromhex(sig)
    except ValueError:
        return False
    return secret.identity.verify(node, raw, purpose, *parts)


def valid_lease(secret: ClusterSecret, node: int, raw) -> Lease | None:
    """The lease in ``raw`` when it is well formed and signed by ``node`` itself (its key in
    the roster: no other member can make one); else None."""
    lease = parse_lease(raw)
    if lease is None or not _signed_by(secret, node, lease.mac, b"lease", node, lease.inc,
                                       lease.endpoint):
        return None
    return lease


def lease_value(secret: ClusterSecret, node: int, inc: str, endpoint: str) -> str:
    """This node's lease (``secret.identity`` must be ``node``: ``ConfigError`` else)."""
    me = secret.identity
    if me.node != node:
        raise ConfigError(f"node {me.node} cannot sign a lease for node {node}")
    return f"{inc}|{endpoint}|{me.sign(b'lease', node, inc, endpoint).hex()}"


def entry_sig(secret: ClusterSecret, tag: str, key: str, inc: str) -> str:
    """This node's signature of its entry for ``key`` of tenant ``tag`` (hex)."""
    me = secret.identity
    return me.sign(b"entry", tag, key, me.node, inc).hex()


def valid_entry(secret: ClusterSecret, tag: str, key: str, e: Entry) -> bool:
    """Did node ``e.node`` sign this entry (per the roster)?"""
    return _signed_by(secret, e.node, e.mac, b"entry", tag, key, e.node, e.inc)


def page_name(secret: ClusterSecret, tag: str, key: str) -> str:
    """The Redis name of ``key``'s entry under tenant ``tag``: keyed, so it reveals nothing."""
    return secret.mac(b"page", tag, key).hex()
