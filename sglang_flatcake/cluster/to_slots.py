"""A request's stored span into KV slots when its tail lives on other nodes: the local
leading run through the store's own read path (``FlatCakeStore.restore_to_slots``), then the
remote run from its owners (``ClusterNode.fetch``: checksums verified) scattered into the
slots after it by the same scatter (``read.to_slots.blocks_to_slots``).

The result reads like a local one (``WindowRestore``): ``hits`` counts the leading pages now
in their slots, local then remote; a remote shortfall is a miss for that page and every
later one, so SGLang recomputes them.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ..read import device as dv
from ..read.to_slots import WindowRestore, blocks_to_slots, check_slots


def restore_with_remote(store, cluster, keys: Sequence[str], span, dest_k, dest_v,
                        slot_indices, window=None) -> WindowRestore:
    """Restore ``keys`` (the local run, then ``span.keys``, the remote tail) into
    ``slot_indices`` (``page_tokens`` token slots per key, as ``restore_to_slots``).  The
    remote tail is asked for only when every local page was restored."""
    lay = store.layout
    local = len(keys) - len(span.keys)
    if local < 0 or tuple(keys[local:]) != tuple(span.keys):
        raise ValueError(f"the remote span ({len(span.keys)} keys) is not the tail of the "
                         f"{len(keys)} keys to restore")
    slots = np.asarray(slot_indices, dtype=np.int64).reshape(-1)
    pt = lay.page_tokens
    res = (store.restore_to_slots(keys[:local], dest_k, dest_v, slots[:local * pt],
                                  window=window) if local
           else WindowRestore(0, 0, 0, 0, None, None))
    if res.error or res.hits < local:
        return res
    tail = slots[local * pt:]
    dests, first = check_slots(lay, span.keys, dest_k, dest_v, tail)
    dev = dv.device_of(dests[0][0])
    stream = window.stream if window is not None and dev is not None else None

    def sink(start: int, blocks: np.ndarray) -> None:
        n = len(blocks)
        keep = blocks_to_slots(blocks, np.arange(n), np.arange(start, start + n), lay,
                               dests, first, dev, stream)
        if dev is not None:
            dev.record(stream).synchronize()      # the uploads may go once scattered
        keep.clear()

    got = cluster.fetch(span, sink)
    return dataclasses.replace(res, hits=local + got)
