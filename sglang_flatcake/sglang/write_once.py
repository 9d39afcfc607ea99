"""Write once: a page flatcake already holds is not put to storage again.

Why flatcake backed up about 1.8x the tokens mooncake did: a direct restore
(``direct.py``) puts stored pages straight into device KV slots and inserts them
into the radix tree as *device* nodes with no host copy.  SGLang's write-through
then treats them as new: the next insert that walks or extends them backs them
up to the host pool (its ``BackupKV`` chain takes every unbacked ancestor), and
each host ack calls ``write_backup_storage``, which sends the whole node to the
backend again.  Mooncake's pages come back through SGLang's own prefetch
(storage -> host -> device) and are inserted host-backed, so they are never
written to storage twice.

``WriteOnce.skip`` is asked by the ``write_backup_storage`` hook
(``signals.py``): when every page of the node is already in this rank's store
(and, with several TP ranks, in every rank's), the storage write is skipped, so
a restored page costs no second put and no gather from the host pool.  The
device -> host copy of the write-through stays: SGLang's tree deletes an
unbacked device node on eviction even when host-backed children hang below it,
so every ancestor of a host-backed node must itself be host-backed (that copy is
the one mooncake makes as its storage -> host transfer).
"""

from __future__ import annotations

import logging

from .counters import Counters

log = logging.getLogger("sglang_flatcake")


class WriteOnce:
    """One backend's write-once decision and its counters (``FlatCakeStorage.write_once``)."""

    def __init__(self) -> None:
        self.counters = Counters("storage_backups_skipped", "tokens_not_rewritten")

    def skip(self, cache, node_id, store) -> bool:
        """True when node ``node_id``'s pages are all in ``store`` already, on every rank
        (the answer is MIN-reduced over TP/PP with the tree's own ``_all_reduce``)."""
        spec = cache.tree_core.build_storage_backup_spec(node_id, False)
        keys = list(spec.hash_value or []) if spec is not None else []
        mine = bool(keys) and store.exists(keys) == len(keys)
        if cache.tp_world_size > 1 or cache.pp_size > 1:
            import torch
            t = torch.tensor([1 if mine else 0], dtype=torch.int)
            cache._all_reduce(t, torch.distributed.ReduceOp.MIN)
            mine = bool(t.item())
        if mine:
            self.counters.add("storage_backups_skipped")
            self.counters.add("tokens_not_rewritten", len(keys) * int(cache.page_size))
        return mine
