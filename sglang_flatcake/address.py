"""The 64-bit block address: medium (4 bits) | node (12 bits) | offset (48 bits).

Blocks never move, so the address is the location.  For ``MEMORY`` the offset
is a byte offset into the host arena; for ``SSD`` it is a byte offset into the
flat SSD space (extents of session files, or a raw region).
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

MEDIUM_BITS, NODE_BITS, OFFSET_BITS = 4, 12, 48
MAX_NODE = (1 << NODE_BITS) - 1
MAX_OFFSET = (1 << OFFSET_BITS) - 1
OFFSET_MASK = MAX_OFFSET
NODE_SHIFT = OFFSET_BITS
MEDIUM_SHIFT = OFFSET_BITS + NODE_BITS


class Medium(IntEnum):
    MEMORY = 0
    SSD = 1


class Address(NamedTuple):
    medium: Medium
    node: int
    offset: int


def encode(medium: int, node: int, offset: int) -> int:
    """Pack an address; raises ``ValueError`` naming the field out of range."""
    if not 0 <= int(medium) < (1 << MEDIUM_BITS):
        raise ValueError(f"medium={medium!r} out of range 0..{(1 << MEDIUM_BITS) - 1}")
    if not 0 <= node <= MAX_NODE:
        raise ValueError(f"node={node!r} out of range 0..{MAX_NODE}")
    if not 0 <= offset <= MAX_OFFSET:
        raise ValueError(f"offset={offset!r} out of range 0..{MAX_OFFSET} (48 bits)")
    return (int(medium) << MEDIUM_SHIFT) | (node << NODE_SHIFT) | offset


def decode(address: int) -> Address:
    """Unpack an address; raises ``ValueError`` for a value outside 64 bits or an unknown medium."""
    if not 0 <= address < (1 << 64):
        raise ValueError(f"address={address!r} is not a 64-bit unsigned value")
    medium = address >> MEDIUM_SHIFT
    try:
        m = Medium(medium)
    except ValueError:
        raise ValueError(f"address {address:#018x} has unknown medium {medium}") from None
    return Address(m, (address >> NODE_SHIFT) & MAX_NODE, address & OFFSET_MASK)
