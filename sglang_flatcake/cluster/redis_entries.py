"""What ``RedisDirectory`` writes into Redis and how it reads it back: lease and page-entry
values, parsed strictly (anything a Redis writer planted -- not ASCII, odd node ids such as
``'²'`` or 5,000 digits, missing or extra fields -- parses as ``None``, a miss), and the keyed
names of pages (a MAC of the tenant tag and page key under the cluster secret, so Redis never
holds a page key, which SGLang computes from token ids, in the clear)."""

from __future__ import annotations

from typing import NamedTuple

from .secret import ClusterSecret

MAX_NODE = 4095
_HEX = frozenset("0123456789abcdef")


class Entry(NamedTuple):
    node: int
    inc: str
    mac: str


class Lease(NamedTuple):
    inc: str
    endpoint: str
    mac: str


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
    if len(parts) != 3 or not _hex(parts[1], 32) or not _hex(parts[2], 64):
        return None
    node = parse_node(parts[0])
    return None if node is None else Entry(node, parts[1], parts[2])


def parse_lease(raw) -> Lease | None:
    """``incarnation|endpoint|mac`` well formed (the MAC is not checked here); else None."""
    s = _ascii(raw)
    parts = s.split("|") if s is not None else ()
    if len(parts) != 3 or not _hex(parts[0], 32) or not parts[1] or not _hex(parts[2], 64):
        return None
    return Lease(*parts)


def valid_lease(secret: ClusterSecret, node: int, raw) -> Lease | None:
    """The lease in ``raw`` when it is well formed and its MAC (made by a holder of the
    cluster secret for ``node``) checks; else None."""
    lease = parse_lease(raw)
    if lease is None or not secret.check(lease.mac, b"lease", node, lease.inc, lease.endpoint):
        return None
    return lease


def lease_value(secret: ClusterSecret, node: int, inc: str, endpoint: str) -> str:
    return f"{inc}|{endpoint}|{secret.mac(b'lease', node, inc, endpoint).hex()}"


def page_name(secret: ClusterSecret, tag: str, key: str) -> str:
    """The Redis name of ``key``'s entry under tenant ``tag``: keyed, so it reveals nothing."""
    return secret.mac(b"page", tag, key).hex()
