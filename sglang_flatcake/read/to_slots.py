"""Store to paged KV slots: one read lease, memory blocks and SSD blocks, one window.

``restore_through_window`` is what ``FlatCakeStore.restore_to_slots`` and the direct
restore in ``sglang.direct`` run.  Host pools (numpy or CPU torch) take the host
branch: memory blocks are scattered straight from the host arena, SSD blocks through a
host window.  Device pools (CUDA, or the emulated device) take the device branch:
memory blocks are uploaded from the arena to the device in chunks and scattered there,
SSD blocks land in a device window and are verified there by the checksum kernel.
Both branches count the same way, through the lease (``read_lease.ReadLease``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import device as dv
from ..errors import IOEngineError
from .read_lease import open_lease
from ..tiers.memory import pinned_or_plain
from .scatter import scatter_layer, warm_up
from .window import LayerWindow, RestoreStats

MEMORY_CHUNK_BYTES = 64 << 20      # host arena -> device upload, per chunk
STAGING_BUFFERS = 2                # chunks in flight (staging memory held: two chunks)


@dataclass(frozen=True)
class WindowRestore:
    """``hits`` leading blocks are in their slots and verified; the rest are misses."""

    hits: int
    from_memory: int
    from_ssd: int
    corrupt: int
    error: str | None
    stats: RestoreStats | None


def check_slots(lay, keys, dest_k, dest_v, slot_indices) -> tuple[list, np.ndarray]:
    """The destinations (one list per part) and each page's first token slot; ``ValueError``
    for a layer count, slot count or page that is not one contiguous run."""
    if (dest_v is None) != (lay.parts == 1):
        raise ValueError(f"a {lay.kind} layout needs {'no dest_v' if lay.parts == 1 else 'dest_v'}")
    dests = [dest_k] if dest_v is None else [dest_k, dest_v]
    for name, d in zip(("dest_k", "dest_v"), dests):
        if len(d) != lay.layers:
            raise ValueError(f"{name} has {len(d)} layers; the layout has {lay.layers}")
    pt = lay.page_tokens
    slots = np.asarray(slot_indices, dtype=np.int64).reshape(-1)
    if slots.size != len(keys) * pt:
        raise ValueError(f"{slots.size} slot indices for {len(keys)} pages of {pt} tokens")
    pages = slots.reshape(-1, pt)
    bad = np.nonzero((pages != pages[:, :1] + np.arange(pt)).any(axis=1))[0]
    if len(bad):
        raise ValueError(f"page {bad[0]}: slots {pages[bad[0]].tolist()[:8]} are not one "
                         f"contiguous run of {pt}")
    return dests, pages[:, 0]


def _memory_to_slots(lease, lay, dests, first_slot, dev, stream) -> list:
    """Scatter the lease's memory blocks from the host arena (see ``blocks_to_slots``)."""
    if not lease.memory:
        return []
    return blocks_to_slots(lease.arena_buf, lease.memory_slots, lease.memory_dest, lay, dests,
                           first_slot, dev, stream)


def blocks_to_slots(buf, src_blocks, dest_pages, lay, dests, first_slot, dev, stream) -> list:
    """Scatter host blocks ``buf`` (flat uint8, whole blocks) numbers ``src_blocks`` into the
    pages ``first_slot[dest_pages]`` of ``dests``.

    On a device the blocks go up in chunks of ``MEMORY_CHUNK_BYTES`` through
    ``STAGING_BUFFERS`` rotating staging buffers (pinned host memory on CUDA, then device
    memory), so device memory held is two chunks, not the restore's memory-tier bytes; a
    staging buffer is refilled only once the upload and scatters out of it ended.  Returns
    the staging buffers: keep them until ``stream`` is synchronised."""
    s_i, d_i = np.asarray(src_blocks, np.int64), np.asarray(dest_pages, np.int64)
    if dev is None:
        for layer in range(lay.layers):
            scatter_layer(buf, s_i * lay.block_bytes + layer * lay.block_layer_bytes,
                          first_slot[d_i], [d[layer] for d in dests], lay)
        return []
    bb = lay.block_bytes
    per = max(1, min(len(d_i), MEMORY_CHUNK_BYTES // bb))
    chunks = range(0, len(d_i), per)
    n = min(STAGING_BUFFERS, len(chunks))
    host = [pinned_or_plain(per * bb, cuda=dev.name == "cuda")[:2] for _ in range(n)]
    up = [dev.empty(per * bb) for _ in range(n)]
    free: list = [None] * n                # the event after each staging buffer's last use
    for c, a in enumerate(chunks):
        j, rows = c % n, s_i[a:a + per]
        if free[j] is not None:
            free[j].synchronize()          # fence: staging reuse
        stage = host[j][0][:len(rows) * bb].reshape(len(rows), bb)
        np.take(buf.reshape(-1, bb), rows, axis=0, out=stage)
        dev.upload_into(up[j][:stage.size], stage.reshape(-1), stream)
        src = np.arange(len(rows), dtype=np.int64) * bb
        for layer in range(lay.layers):
            scatter_layer(up[j][:stage.size], src + layer * lay.block_layer_bytes,
                          first_slot[d_i[a:a + per]], [d[layer] for d in dests], lay,
                          stream=stream)
        free[j] = dev.record(stream)
    return [host, up]


def restore_through_window(store, keys: Sequence[str], dest_k, dest_v, slot_indices,
                           window: LayerWindow | None = None, verify: bool | None = None,
                           max_window_bytes: int = 256 << 20, workers: int = 2,
                           order: str = "layer") -> WindowRestore:
    """Restore the leading stored run of ``keys`` from a ``FlatCakeStore`` into KV slots.

    ``dest_k[l]``/``dest_v[l]`` are layer ``l``'s ``[num_slots, heads, head_dim]`` buffers
    (SGLang's MHA pool; ``dest_v=None`` and ``dest_k[l]`` the one buffer for MLA): host
    memory, CUDA memory or emulated device memory.  ``slot_indices`` are token slots,
    ``page_tokens`` per key, each page one contiguous run.  SSD blocks go through
    ``window`` (default: a new one, ``store.config.window_layers`` deep, sized to the
    largest layer up to ``max_window_bytes``: on ``store.engine`` with ``workers``
    scatter threads for host pools, on the device's kvikio engine for device pools), in
    ``order`` (see ``window.plan_fills``).  Sessions stay pinned until the last copy
    ends.  Like ``store.get``: a failed checksum makes its block and all after it
    misses; an I/O error makes the whole call a miss (``error`` says why).
    """
    warm_up()
    lay = store.layout
    dests, first_slot = check_slots(lay, keys, dest_k, dest_v, slot_indices)
    dev = dv.device_of(dests[0][0])
    if window is not None and window.dev is not dev:
        raise ValueError(f"the window is in {window.device} memory but the KV pool is in "
                         f"{'cpu' if dev is None else dev.name} memory")
    verify = store.config.verify_reads if verify is None else verify
    own = None
    with open_lease(store.core, keys) as lease:
        plan = lease.plan()
        if plan.commands and window is None:
            per_layer = np.bincount(plan.command_layer, weights=[c.length for c in plan.commands])
            cap = int(min(per_layer.max(), max_window_bytes))
            if dev is None:
                own = window = LayerWindow(store.engine, cap, store.config.window_layers,
                                           workers=workers)
            else:
                engine = dv.window_engine(dev, store.config.alignment, store.config.io_threads)
                own = window = LayerWindow(engine, cap, store.config.window_layers,
                                           device=dev.name)
        stream = window.stream if window is not None else None   # memory only: default stream
        keep: list = []
        try:
            keep = _memory_to_slots(lease, lay, dests, first_slot, dev, stream)
            stats = None
            if plan.commands:
                def scatter_fn(layer, buf, src, dest, mask=None):
                    return scatter_layer(buf, src, first_slot[dest], [d[layer] for d in dests],
                                         lay, stream=stream, mask=mask)
                try:
                    stats = window.restore(plan, scatter_fn, verify=verify, order=order)
                except IOEngineError as e:
                    lease.record(plan, 0, read_error=True)
                    return WindowRestore(0, 0, 0, 0, str(e), None)
        finally:
            if dev is not None:
                dev.record(stream).synchronize()      # fence: every upload and scatter ended
            keep.clear()                              # staging may be freed now
            if dev is not None:
                dev.free_cache()                      # and goes back to the device
            if own is not None:
                own.close()
                if dev is not None:
                    own.engine.close()
    corrupt = stats.corrupt if stats else ()
    hits = min([lease.n] + list(corrupt))
    lease.record(plan, hits, len(corrupt))
    mem = lease.memory_hits(hits)
    return WindowRestore(hits, mem, hits - mem, len(corrupt), None, stats)
