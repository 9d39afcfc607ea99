"""Slot checks and host blocks into paged KV slots (the memory-tier half of a restore).

``check_slots`` validates a restore's destinations; ``blocks_to_slots`` scatters whole host
blocks into pages of the KV view, on a device through rotating staging buffers.  Used by
``slot_restore.SlotRestorer`` and by ``cluster/to_slots.py`` (blocks fetched from a peer).
"""

from __future__ import annotations

import numpy as np

from ..tiers.memory import pinned_or_plain
from .scatter import scatter_layer

MEMORY_CHUNK_BYTES = 64 << 20      # host arena -> device upload, per chunk
STAGING_BUFFERS = 2                # chunks in flight (staging memory held: two chunks)


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
