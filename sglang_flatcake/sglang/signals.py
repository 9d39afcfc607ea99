"""Write-time signals from SGLang's scheduler to FlatCake's placement.

SGLang hands a storage backend only page hashes, host indices and (when asked)
the prefix keys.  Two hooks, both on the scheduler side, post what the radix
tree knows onto a board keyed by page hash, before the backup thread writes
those pages:

- ``UnifiedRadixCache.write_backup_storage(node_id)``: the node's path
  (``collect_path_info``, backend-neutral: context length before the node and
  how many branches leave it) and, with the Python tree core, the node's
  ``lock_ref`` (how many live requests hold the prefix).  The larger of
  ``lock_ref`` and the number of branches is the reference count.  The page
  keys are taken where SGLang hands them to the controller
  (``HybridCacheController.write_storage``), so this works with either tree core.
- ``UnifiedRadixCache._execute_and_commit_kv_backup`` (inside an insert): the
  insert's ``session_id`` (SGLang's, when the client sent one) for each node.
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
    """What the tree knew of a page when it was backed up (turn and previous reply come
    from the store's lineage, see the module docstring)."""
    refcount: int = 1                # max(lock_ref, branches leaving the node)
    context_tokens: int = -1         # tokens before the node; -1: unknown
    session_id: str | None = None    # SGLang's session id of the insert, when sent
    tenant: str | None = None        # the node's cache_salt ("" for none); None: unknown


class SignalBoard:
    """Thread-safe, bounded map page-hash -> ``Seen``; the latest post wins."""

    def __init__(self, capacity: int = 1 << 18) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[str, Seen] = OrderedDict()
        self._lock = threading.Lock()
        self._op = threading.local()
        self.reads = {"gets": 0, "hit_blocks": 0}
        self.signal_failures = 0     # backups whose signals could not be read (warned once)

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
# Everything below runs on the scheduler thread: write_backup_storage(node) computes
# the node's signals and calls controller.write_storage(..., hash_value, ...) synchronously,
# which is where the node's page keys are known whatever tree core runs.

_pending = threading.local()
_node_session: OrderedDict = OrderedDict()     # node id -> SGLang session_id of its insert


def _execute_backup_around(original, cache, action, *a, **kw):
    """During an insert, remember which SGLang session the backed-up nodes came from."""
    sid = getattr(cache, "insert_session_id", None)
    if sid is not None:
        for nid in getattr(action, "node_ids", ()) or ():
            _node_session[nid] = str(sid)
        while len(_node_session) > (1 << 16):
            _node_session.popitem(last=False)
    return original(cache, action, *a, **kw)


def _write_backup_storage_around(original, cache, node_id, *a, **kw):
    store = _flatcake_store(cache)
    if store is not None and getattr(cache, "enable_storage", False):
        from .write_once import skip_storage_backup
        if skip_storage_backup(cache, node_id, store):
            return None                       # already stored: no second put (write_once.py)
    try:
        _pending.seen = _node_signals(cache, node_id)
    except Exception as e:  # never let signal gathering break a backup: warned, counted
        BOARD.signal_failures += 1
        level = logging.WARNING if BOARD.signal_failures == 1 else logging.DEBUG
        log.log(level, "flatcake: no write-time signals for node %s (%s: %s); placement uses "
                "the store's own lineage (%d such backups so far)", node_id,
                type(e).__name__, e, BOARD.signal_failures)
        _pending.seen = None
    try:
        return original(cache, node_id, *a, **kw)
    finally:
        _pending.seen = None


def _flatcake_store(cache):
    ctrl = getattr(cache, "cache_controller", None)
    if getattr(ctrl, "storage_backend_type", None) != "flatcake":
        return None
    return getattr(getattr(ctrl, "storage_backend", None), "store", None)


def _node_signals(cache, node_id) -> Seen | None:
    if getattr(getattr(cache, "cache_controller", None), "storage_backend_type", None) != "flatcake":
        return None
    core = cache.tree_core
    refcount, ctx = 1, -1
    path = core.collect_path_info([node_id])[0]
    if path:
        last = path[-1]
        ctx = int(last.path_start)
        refcount = max(refcount, int(last.num_children))
    try:
        node = core.node_by_id(node_id)
    except NotImplementedError:                  # the Rust tree core keeps lock refs inside
        node = None
    if node is not None:
        refcount = max(refcount, max(int(cd.lock_ref) for cd in node.component_data))
    tenant = core.prefetch_anchor_info(node_id)[1] or ""     # (extra_key, cache_salt)
    return Seen(refcount=refcount, context_tokens=ctx, session_id=_node_session.pop(node_id, None),
                tenant=tenant)


def _write_storage_around(original, controller, host_indices, token_ids, hash_value=None,
                          *a, **kw):
    seen = getattr(_pending, "seen", None)
    if seen is not None and hash_value:
        BOARD.record(list(hash_value), seen)
    return original(controller, host_indices, token_ids, hash_value, *a, **kw)


def _page_backup_around(original, controller, operation, *a, **kw):
    BOARD.begin_op()
    try:
        return original(controller, operation, *a, **kw)
    finally:
        BOARD.end_op()


def register_signal_hooks(registry, hook_type) -> None:
    base = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache."
    registry.register(base + "write_backup_storage", _write_backup_storage_around, hook_type.AROUND)
    registry.register(base + "_execute_and_commit_kv_backup", _execute_backup_around,
                      hook_type.AROUND)
    registry.register("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller."
                      "HybridCacheController.write_storage", _write_storage_around, hook_type.AROUND)
    registry.register("sglang.srt.managers.cache_controller.HiCacheController._page_backup",
                      _page_backup_around, hook_type.AROUND)
