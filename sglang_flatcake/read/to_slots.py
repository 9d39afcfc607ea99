"""Store to paged KV slots for one request: ``FlatCakeStore.restore_to_slots``.

``restore_through_window`` opens one read lease on ``keys`` and restores it through a
``slot_restore.SlotRestorer`` (the one restore routine of both modes): host pools (numpy or
CPU torch) scatter memory blocks straight from the host arena and SSD blocks through a host
window; device pools (CUDA, or the emulated device) upload memory blocks in chunks and
verify SSD blocks in a device window.  ``check_slots`` and ``blocks_to_slots`` live in
``slot_copy`` (imported here too, for ``cluster/to_slots.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import device as dv
from .read_lease import open_lease
from .slot_copy import blocks_to_slots, check_slots  # noqa: F401  (cluster/to_slots.py)
from .slot_restore import SlotRestorer
from .window import LayerWindow, RestoreStats


@dataclass(frozen=True)
class WindowRestore:
    """``hits`` leading blocks are in their slots and verified; the rest are misses."""

    hits: int
    from_memory: int
    from_ssd: int
    corrupt: int
    error: str | None
    stats: RestoreStats | None


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
    lay = store.layout
    dests, _ = check_slots(lay, keys, dest_k, dest_v, slot_indices)
    dev = dv.device_of(dests[0][0])
    verify = store.config.verify_reads if verify is None else verify
    with open_lease(store.core, keys) as lease:
        plan = lease.plan()
        cap = 0
        if plan.commands and window is None:
            per_layer = np.bincount(plan.command_layer, weights=[c.length for c in plan.commands])
            cap = int(min(per_layer.max(), max_window_bytes))
        restorer = SlotRestorer(dest_k, dest_v, dev, store.config, cap, host_engine=store.engine,
                                workers=workers, window=window)
        try:
            res = restorer.restore(store, [lease], slot_indices, verify, order=order)
        finally:
            restorer.close()
    if res.error is not None:
        return WindowRestore(0, 0, 0, 0, res.error, None)
    ((hits, mem),) = res.leases
    return WindowRestore(hits, mem, hits - mem, len(res.corrupt), None, res.stats)
