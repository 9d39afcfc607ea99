"""Write once: a page flatcake already holds is not put to storage again.

A direct restore (``hicache.direct``) inserts stored pages into the radix tree as device nodes
with no host copy, so SGLang's write-through backs them up again at the next insert that walks
them, and each host ack sends the whole node to the backend (``write_backup_storage``).
``WriteOnce.skip``, asked by that hook (``hicache.signals``), skips the storage write when every
page of the node is stored (``stored_run``) on every rank; linker mode's offload skips stored
pages the same way.  The device -> host copy stays: SGLang deletes an unbacked device node on
eviction even with host-backed children below it.  Effect measured: docs/results.md.
"""

from __future__ import annotations

import logging

from .counters import Counters
from .stored_run import stored_run

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
        mine = bool(keys) and stored_run(store, keys).pages == len(keys)
        if cache.tp_world_size > 1 or cache.pp_size > 1:
            import torch
            t = torch.tensor([1 if mine else 0], dtype=torch.int)
            cache._all_reduce(t, torch.distributed.ReduceOp.MIN)
            mine = bool(t.item())
        if mine:
            self.counters.add("storage_backups_skipped")
            self.counters.add("tokens_not_rewritten", len(keys) * int(cache.page_size))
        return mine
