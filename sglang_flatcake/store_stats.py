"""``FlatCakeStore.stats()``: one flat dict of what the store holds and has done."""

from __future__ import annotations

from .placement import Rule
from .results import COUNTERS
from .store_core import StoreCore


def store_stats(core: StoreCore, engine) -> dict:
    """One consistent view, taken under the core's lock; ``engine``: the store's I/O engine."""
    with core.locked() as table:
        return _stats(core, table, engine)


def _stats(st: StoreCore, table, engine) -> dict:
    sessions = table.sessions.values()
    ssd_blocks = sum(sum(g.n_blocks for g in s.segments) for s in sessions)
    mem_blocks = sum(len(s.memory_slots) for s in sessions)
    out = {
        "sessions": len(table.sessions),
        "blocks_memory": mem_blocks,
        "blocks_ssd": ssd_blocks,
        "bytes_memory": mem_blocks * st.layout.block_bytes,
        "bytes_ssd_data": ssd_blocks * st.layout.block_bytes,
        "bytes_ssd_allocated": st.ssd.used_bytes,
        "memory_capacity": st.arena.capacity_bytes,
        "ssd_capacity": st.ssd.capacity_bytes,
        "ssd_usage": st.ssd.used_bytes / st.ssd.capacity_bytes,
        "memory_usage": (st.arena.used_bytes / st.arena.capacity_bytes
                         if st.arena.capacity_bytes else 0.0),
        "memory_pinned": st.arena.pinned,
        "index_entries": len(st.index),
        "index_bytes": st.index.nbytes,
    }
    out.update({name: 0 for name in COUNTERS})
    out.update({f"placement_{r.value}": 0 for r in Rule})
    out.update(st.counts())
    out["io"] = engine.stats()
    return out
