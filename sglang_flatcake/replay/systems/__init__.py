"""Replayed systems: one interface (``base.System``), one file per family.

``SYSTEMS`` maps each ``--systems`` name to its class; ``make_system`` builds one.
"""

from __future__ import annotations

from .base import DataPool, IoCounters, RequestState, System, SystemContext
from .flatcake import FlatCake, FlatCakeSingleQueue
from .linker import FlatCakeLinker
from .sglang_file import SglangFile, unavailable_reason
from .tiered import MemoryOnly, MooncakeFIFO, TieredLRU

SYSTEMS: dict[str, type[System]] = {
    "flatcake": FlatCake,
    "flatcake-single-queue": FlatCakeSingleQueue,
    "flatcake-linker": FlatCakeLinker,
    "tiered-lru": TieredLRU,
    "mooncake-fifo": MooncakeFIFO,
    "memory-only": MemoryOnly,
    "sglang-file": SglangFile,
}


def parse_systems(text: str) -> list[str]:
    """``a,b,c`` -> names, in order, without repeats; ``ValueError`` lists the valid ones."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SYSTEMS]
    if bad or not names:
        raise ValueError(f"unknown system(s) {', '.join(bad) or '(none given)'}; "
                         f"valid: {', '.join(SYSTEMS)}")
    return list(dict.fromkeys(names))


def make_system(name: str) -> System:
    return SYSTEMS[name]()


__all__ = ["SYSTEMS", "DataPool", "FlatCake", "FlatCakeLinker", "FlatCakeSingleQueue", "IoCounters", "MemoryOnly",
           "MooncakeFIFO", "RequestState", "SglangFile", "System", "SystemContext", "TieredLRU",
           "make_system", "parse_systems", "unavailable_reason"]
