"""Write-time signals from SGLang's scheduler to FlatCake's placement.

SGLang hands a storage backend only page hashes, host indices and (when asked)
the prefix keys.  Two hooks, both on the scheduler side, post what the radix
tree knows onto a board keyed by page hash, before the backup thread writes
those pages:

- ``UnifiedRadixCache.write_backup_storage(node_id)``: the node's path
  (``collect_path_info``, backend-neutral: context length before the node and
  how many branches leave it) and, with the Python tree core, the node's
  ``lock_ref`` (how many live requests hold the prefix).  The larger of
  ``lock_ref`` and the number of branches is the reference count.
- ``HiCacheController._page_backup(operation)``: marks the batches of one
  backup operation so that they share one turn and one starting context (an
  operation is split into batches of 128 pages).

Turn and previous reply come from the hash chain itself: the turn is the
number of earlier write operations in the session lineage the write continues,
and the previous reply is the size of that session's latest write (in a
write-through tree a reply's pages are written as their own operation when the
request finishes, just before the next turn's prompt).

A prefix that only becomes popular after its first write is handled by
promotion in the store: a read that finds SSD blocks which ``shared_refcount``
stored sessions build on copies them into memory (``FlatCakeStore.get``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger("sglang_flatcake")


@dataclass(frozen=True)
class Seen:
    refcount: int = 1
    turn: int = -1
    context_tokens: int = -1
    prev_reply_tokens: int = -1


class SignalBoard:
    """Thread-safe, bounded map page-hash -> ``Seen``; the latest post wins."""

    def __init__(self, capacity: int = 1 << 18) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[str, Seen] = OrderedDict()
        self._lock = threading.Lock()
        self._op = threading.local()
        self.reads = {"gets": 0, "hit_blocks": 0}

    def record(self, keys, seen: Seen) -> None:
        with self._lock:
            for k in keys:
                self._seen[k] = seen
                self._seen.move_to_end(k)
            while len(self._seen) > self.capacity:
                self._seen.popitem(last=False)

    def lookup(self, key: str) -> Seen | None:
        with self._lock:
            return self._seen.get(key)

    # one backup operation = several batches that share a turn
    def begin_op(self) -> None:
        self._op.state = {}

    def end_op(self) -> None:
        self._op.state = None

    def op_state(self) -> dict | None:
        return getattr(self._op, "state", None)

    def note_read(self, res) -> None:
        self.reads["gets"] += 1
        self.reads["hit_blocks"] += res.hits

    def publish(self, stats: dict) -> None:
        """Export the store's counters as Prometheus gauges, when metrics are on."""
        from .metrics import export
        export(stats)


BOARD = SignalBoard()


# -- hooks ---------------------------------------------------------------------------

def _write_backup_storage_around(original, cache, node_id, *a, **kw):
    try:
        _post_node(cache, node_id)
    except Exception as e:  # never let signal gathering break a backup
        log.debug("flatcake: no signals for node %s: %s", node_id, e)
    return original(cache, node_id, *a, **kw)


def _post_node(cache, node_id) -> None:
    if getattr(getattr(cache, "cache_controller", None), "storage_backend_type", None) != "flatcake":
        return
    core = cache.tree_core
    keys = None
    refcount, ctx = 1, -1
    path = core.collect_path_info([node_id])[0]
    if path:
        last = path[-1]
        ctx = int(last.path_start)
        refcount = max(refcount, int(last.num_children))
    node = None
    try:
        node = core.node_by_id(node_id)          # Python tree core only
    except Exception:
        pass
    if node is not None:
        keys = getattr(node, "hash_value", None)
        try:
            refcount = max(refcount, max(int(cd.lock_ref) for cd in node.component_data))
        except Exception:
            pass
    if keys:
        BOARD.record(list(keys), Seen(refcount=refcount, context_tokens=ctx))


def _page_backup_around(original, controller, operation, *a, **kw):
    BOARD.begin_op()
    try:
        return original(controller, operation, *a, **kw)
    finally:
        BOARD.end_op()


def register_signal_hooks(registry, hook_type) -> None:
    registry.register("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.write_backup_storage",
                      _write_backup_storage_around, hook_type.AROUND)
    registry.register("sglang.srt.managers.cache_controller.HiCacheController._page_backup",
                      _page_backup_around, hook_type.AROUND)
