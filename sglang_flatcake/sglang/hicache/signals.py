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

Turn and previous reply come from the store's lineage of the chain (``sglang.lineage``).

A prefix that only becomes popular after its first write is handled by
promotion in the store: a read that finds SSD blocks which ``shared_refcount``
stored sessions build on copies them into memory (``FlatCakeStore.get``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from ..counters import Counters

log = logging.getLogger("sglang_flatcake")


@dataclass(frozen=True)
class Seen:
    """What the tree knew of a page when it was backed up (turn and previous reply come
    from the store's lineage, see the module docstring)."""
    refcount: int = 1                # max(lock_ref, branches leaving the node)
    context_tokens: int = -1         # tokens before the node; -1: unknown
    session_id: str | None = None    # SGLang's session id of the insert, when sent
    tenant: str | None = None        # the node's cache_salt ("" for none); None: unknown


class PerThread(threading.local):
    """What one thread is doing on a board (``SignalBoard.thread``; class attributes: each
    thread's defaults).  The batches of one backup operation share ``op``'s turn."""
    seen: Seen | None = None          # the node being backed up (write_backup_storage)
    op: dict | None = None            # the backup operation in progress (_page_backup)


class SignalBoard:
    """One backend's write-time signals: a bounded map page-hash -> ``Seen`` (the latest post
    wins), the SGLang session of each backed-up node, the signals of the backup in progress
    on each thread, and its counters.  Thread-safe; owned by ``FlatCakeStorage.board``."""

    def __init__(self, capacity: int = 1 << 18, sessions: int = 1 << 16) -> None:
        self.capacity, self.session_capacity = capacity, sessions
        self._seen: OrderedDict[str, Seen] = OrderedDict()
        self._node_session: OrderedDict = OrderedDict()     # node id -> session id
        self._lock = threading.Lock()
        self.thread = PerThread()         # set and read by the hooks on their own thread
        # gets/hit_blocks: host-pool reads; signal_failures: backups whose signals could not
        # be read (warned once, then counted)
        self.counters = Counters("gets", "hit_blocks", "signal_failures")

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

    # the SGLang session of an insert, remembered per node until its backup reads it
    def remember_session(self, node_ids, session_id: str) -> None:
        with self._lock:
            for nid in node_ids:
                self._node_session[nid] = session_id
            while len(self._node_session) > self.session_capacity:
                self._node_session.popitem(last=False)

    def take_session(self, node_id) -> str | None:
        with self._lock:
            return self._node_session.pop(node_id, None)

    def note_read(self, res) -> None:
        self.counters.add("gets")
        self.counters.add("hit_blocks", res.hits)

    def note_failure(self, node_id, e: Exception) -> None:
        """Count a backup whose signals could not be read; warn the first time."""
        n = self.counters.add("signal_failures")
        log.log(logging.WARNING if n == 1 else logging.DEBUG,
                "flatcake: no write-time signals for node %s (%s: %s); placement uses the "
                "store's own lineage (%d such backups so far)", node_id, type(e).__name__, e, n)

    def stats(self) -> dict:
        c = self.counters.snapshot()
        return {"gets": c["gets"], "hit_blocks": c["hit_blocks"],
                "failures": c["signal_failures"]}


# -- hooks ---------------------------------------------------------------------------
# Everything below runs on the scheduler thread but ``_page_backup_around`` (the backup
# thread): write_backup_storage(node) computes the node's signals and calls
# controller.write_storage(..., hash_value, ...) synchronously, which is where the node's
# page keys are known whatever tree core runs.  Each hook acts only for the flatcake backend
# of the controller it is called on, and posts on that backend's board.

def flatcake_backend(controller):
    """``controller``'s storage backend when it is flatcake, else None (another backend, no
    HiCache controller, or no backend attached)."""
    if controller is None or controller.storage_backend_type != "flatcake":
        return None
    backend = controller.storage_backend
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector
    if isinstance(backend, HiCacheStorageFailureInjector):   # SGLang's fault-injection wrapper
        return backend._backend
    return backend


def _execute_backup_around(original, cache, action, *a, **kw):
    """During an insert, remember which SGLang session the backed-up nodes came from."""
    backend = flatcake_backend(cache.cache_controller)
    sid = cache.insert_session_id
    if backend is not None and sid is not None:
        backend.board.remember_session(action.node_ids, str(sid))
    return original(cache, action, *a, **kw)


def _write_backup_storage_around(original, cache, node_id, *a, **kw):
    backend = flatcake_backend(cache.cache_controller)
    if backend is None:
        return original(cache, node_id, *a, **kw)
    board = backend.board
    if backend.store is not None and cache.enable_storage:
        if backend.write_once.skip(cache, node_id, backend.store):
            return None                       # already stored: no second put (write_once.py)
    try:
        seen = node_signals(cache, node_id, board)
    except Exception as e:  # never let signal gathering break a backup: warned, counted
        board.note_failure(node_id, e)
        seen = None
    board.thread.seen = seen
    try:
        return original(cache, node_id, *a, **kw)
    finally:
        board.thread.seen = None


def node_signals(cache, node_id, board: SignalBoard) -> Seen:
    """What ``cache``'s tree knows of node ``node_id`` (the node's session from ``board``)."""
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
    return Seen(refcount=refcount, context_tokens=ctx, session_id=board.take_session(node_id),
                tenant=tenant)


def _write_storage_around(original, controller, host_indices, token_ids, hash_value=None,
                          *a, **kw):
    backend = flatcake_backend(controller)
    seen = backend.board.thread.seen if backend is not None else None
    if seen is not None and hash_value:
        backend.board.record(list(hash_value), seen)
    return original(controller, host_indices, token_ids, hash_value, *a, **kw)


def _page_backup_around(original, controller, operation, *a, **kw):
    backend = flatcake_backend(controller)
    if backend is None:
        return original(controller, operation, *a, **kw)
    backend.board.thread.op = {}
    try:
        return original(controller, operation, *a, **kw)
    finally:
        backend.board.thread.op = None
