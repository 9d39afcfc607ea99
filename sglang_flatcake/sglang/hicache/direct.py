"""Store to device KV slots without SGLang's host pool: one ``Flow`` per request.

With ``--hicache-storage-backend flatcake`` the scheduler does not run SGLang's
storage prefetch (storage -> host pool -> device).  Instead, for each request:

1. ``lookup`` (scheduler thread, at arrival): the page hashes of the request's
   reusable prefix are computed from the root exactly as SGLang names stored
   pages (``get_storage_hash_str``); the leading stored run past the device
   match (``sglang.stored_run``) is the flow's span, its SSD bytes the queue
   policy's KV size.  In a cluster the span goes on
   with the run other nodes hold (one directory lookup; ``cluster/to_slots.py``
   restores that tail after the local run, a failure being a miss from there on).
2. ``start`` (scheduler thread, when the queue policy says so): device KV slots
   are allocated (evicting from the radix tree if needed; when none can be had
   the flow keeps waiting, it is never cancelled), the device prefix it extends
   is locked, and a worker thread restores the span with
   ``store.restore_to_slots``: SSD blocks through the two-layer window and the
   scatter kernel, memory blocks from the host arena, straight into the slots.
3. ``finish`` (scheduler thread, once every rank is done): the restored pages
   are inserted into the radix tree as device nodes (the insert frees slots a
   concurrent insert already covered), slots past a miss or a checksum failure
   are freed, the lock is released, and SGLang's storage-hit accounting is set
   so ``cached_tokens_details.storage`` reports the span.

SGLang's host pool is never touched by a flatcake read; ``counters`` proves it
(``host_pool_gets`` counts the backend's ``batch_get_v1`` calls, which stay 0).

A CUDA pool takes the device branch (a kvikio window in device memory, checksums and
scatter on the device), as an emulated one does (``sglang.device_pool``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ...read.slot_restore import SlotRestorer
from ..device_pool import DevicePool, kv_parts
from ..stored_run import stored_run

log = logging.getLogger("sglang_flatcake")

WINDOW_BYTES = 64 << 20          # one window buffer on a GPU; larger layers are read in pieces


@dataclass
class Flow:
    rid: str
    handle: Any                      # SGLang's CacheRequestHandle
    key: Any                         # RadixKey of [0, end) tokens, page aligned
    keys: list[str]                  # page hashes of the span [start, end)
    start: int                       # tokens already on device when looked up
    ssd_bytes: int
    memory_bytes: int
    state: str = "waiting"           # waiting | running | done
    slots: Any = None                # torch int64 device slots of the span
    anchor: Any = None               # node id of the locked device prefix
    anchor_lock: Any = None
    prefix_start: int = 0            # device prefix length when started
    future: Optional[Future] = None
    started_at: float = 0.0
    result: Any = None
    chain: list = field(default_factory=list)   # page hashes of [0, end), for a restart
    remote: Any = None               # ``cluster.span.RemoteSpan``: the tail other nodes hold
    lead_memory: int = 0             # pages of the span before its first SSD (or remote) page
    io_s: float = 0.0                # seconds the worker spent on the restore (this rank)

    @property
    def tokens(self) -> int:
        return len(self.key) - self.start

    def cut(self, pages: int, page: int) -> None:
        """Keep the span's first ``pages`` pages (a shorter prefix of stored KV is still
        exactly that KV); the caller sets ``ssd_bytes`` for what is left."""
        if self.remote is not None:          # the remote tail keeps only what is left of it
            self.remote = self.remote.first(pages - (len(self.keys) - len(self.remote.keys)))
        self.keys = self.keys[:pages]
        self.key = self.key[: self.start + pages * page]


@dataclass
class DirectRestorer:
    """Runs flows for one scheduler; every method but the worker runs on the scheduler thread."""

    scheduler: Any
    backend: Any
    counters: dict = field(default_factory=lambda: {
        "flows": 0, "restored_tokens": 0, "bytes_from_ssd": 0, "bytes_from_memory": 0,
        "failed": 0, "waits_for_slots": 0, "tokens_skipped_on_device": 0})

    def __post_init__(self) -> None:
        self.tree = self.scheduler.tree_cache
        self.allocator = self.scheduler.token_to_kv_pool_allocator
        self.page = int(self.scheduler.page_size)
        self.pool = DevicePool(self.allocator.get_kvcache(), self.page)   # the linker's view too
        self.device = self.pool.device
        # on a device SSD bytes land in the restorer's window (kvikio), are verified and
        # scattered there (a host pool gets a window per restore, sized to it); its one
        # worker makes the pool's device current (SGLang sets the device per process, and
        # a new thread starts on device 0)
        self.slots = SlotRestorer(self.pool.dest_k, self.pool.dest_v, self.device,
                                  self.backend.config,
                                  WINDOW_BYTES if self.device is not None else 0)
        log.info("flatcake: direct restores into %s memory",
                 "host" if self.device is None else self.device.name)
        self.slots.submit(lambda: None)        # the worker up, the CPU scatter compiled

    def forward_fence(self):
        """An event after everything SGLang's forward pass has enqueued so far (on CUDA its
        model runner's forward stream, as SGLang's own loader fences; emulated: the
        scheduler thread's current stream); ``None`` for a host pool."""
        if self.device is None:
            return None
        if self.device.name == "cuda":
            return self.device.forward_event(self.scheduler.tp_worker.model_runner.forward_stream)
        return self.device.forward_event()

    @staticmethod
    def supported(scheduler) -> str | None:
        """Why the direct path cannot serve this scheduler, or None when it can."""
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        tree = scheduler.tree_cache
        if not isinstance(tree, UnifiedRadixCache):
            return f"the tree cache is {type(tree).__name__}, not UnifiedRadixCache"
        if len(tree.tree_components) > 1 or tree.is_swa_enabled:
            return "the tree has components besides full attention (SWA or Mamba)"
        mode = getattr(scheduler, "disaggregation_mode", None)
        if mode is not None and getattr(mode, "name", str(mode)).upper() != "NULL":
            return f"disaggregation mode {mode} (only colocated serving restores directly)"
        if tree.buffer_pipeline is not None:
            return "--hicache-mem-layout buffer_only stages by design"
        kv = scheduler.token_to_kv_pool_allocator.get_kvcache()
        why = DevicePool.refusal(kv)
        if why is not None:
            return why
        if kv_parts(kv)[1][0][0].is_cuda:
            from ...io.kvikio_engine import kvikio_usable
            ok, why = kvikio_usable()
            if not ok:
                return f"device KV is on CUDA but kvikio cannot read into it ({why})"
        return None

    # -- 1. lookup --------------------------------------------------------------------
    def lookup(self, req) -> Flow | None:
        """The stored span that would extend ``req``'s device match, or None."""
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        store = self.backend.store
        if store is None:
            return None
        req.init_next_round_input(self.tree, cow_mamba=False)
        ids = req.full_untruncated_fill_ids
        end = req._compute_max_prefix_len(len(ids)) // self.page * self.page
        start = int(req.prefix_len)
        if end - start < self.page:
            return None
        key = RadixKey(ids[:end], extra_key=req.extra_key, cache_salt=req.cache_salt,
                       is_bigram=self.tree.tree_core.is_eagle).page_aligned(self.page)
        hashes = get_storage_hash_str(key, None, page_size=self.page)
        limit = max(self.page, self.allocator.size // 2 // self.page * self.page)
        span = hashes[start // self.page:][: limit // self.page]
        run = stored_run(store, span)               # one index probe per page
        n = run.pages
        cluster = self.backend.cluster               # then one directory lookup for the rest
        remote = cluster.lookup(req.cache_salt or "", span[n:]) if cluster else None
        m = len(remote.keys) if remote else 0
        if n + m == 0:
            return None
        bb = store.layout.block_bytes
        end = start + (n + m) * self.page            # remote bytes queue as SSD bytes do
        return Flow(req.rid, req.cache_request_handle, key[:end], span[:n + m], start,
                    (len(run.ssd) + m) * bb, (n - len(run.ssd)) * bb,
                    chain=hashes[: end // self.page], remote=remote, lead_memory=run.lead_memory)

    # -- 2. start ---------------------------------------------------------------------
    def allocate(self, flow: Flow) -> bool:
        """Lock the device prefix and allocate slots; False (nothing held) when none are free."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams

        last = len(flow.key) - self.page             # at least one page is left to restore
        match = self.tree.match_prefix(MatchPrefixParams(key=flow.key[:last]))
        have = match.device_prefix_len // self.page * self.page
        if have < flow.start or (have > flow.start and flow.remote is None):
            # the device prefix was evicted while queued, or another request's restore or
            # prefill put more of the span on device: restore from where it now ends (a
            # restore of what is on device would be read only to be freed by the insert)
            if have > flow.start:
                self.counters["tokens_skipped_on_device"] += have - flow.start
            self._restart_from(flow, have)
            match = self.tree.match_prefix(MatchPrefixParams(key=flow.key[: flow.start]))
        # lock the prefix first: the eviction below must not take the very nodes we extend
        anchor = match.last_device_node
        lock = self.tree.inc_lock_ref(anchor).to_dec_params()
        n = flow.tokens
        if self.allocator.available_size() < n:
            self.tree.evict(EvictParams(num_tokens=n))
        slots = self.allocator.alloc(n) if self.allocator.available_size() >= n else None
        if slots is None:
            self.tree.dec_lock_ref(anchor, lock)
            self.counters["waits_for_slots"] += 1
            return False
        flow.slots, flow.anchor, flow.anchor_lock = slots, anchor, lock
        flow.prefix_start = flow.start
        return True

    def release(self, flow: Flow) -> None:
        """Undo ``allocate``: free the flow's slots and unlock its device prefix, leaving it
        to wait again.  A no-op when the flow holds no slots."""
        if flow.slots is None:
            return
        self.allocator.free(flow.slots)
        self.tree.dec_lock_ref(flow.anchor, flow.anchor_lock)
        flow.slots = flow.anchor = flow.anchor_lock = None

    def slot_room(self) -> int:
        """Device slots a restore could take now: free ones plus evictable ones."""
        return self.allocator.available_size() + int(self.tree.evictable_size())

    def _restart_from(self, flow: Flow, start: int) -> None:
        flow.keys = flow.chain[start // self.page: len(flow.key) // self.page]
        flow.start = start

    def submit(self, flow: Flow) -> None:
        """Start the restore of an allocated flow on the worker thread (logged: tests and
        operators order on this line)."""
        flow.state = "running"
        flow.started_at = time.monotonic()
        log.info("flatcake: restoring %s: %d tokens from %d (%.1f MiB from SSD)", flow.rid,
                 flow.tokens, flow.start, flow.ssd_bytes / (1 << 20))
        store = self.backend.store
        slots = flow.slots.cpu().numpy() if hasattr(flow.slots, "cpu") else np.asarray(flow.slots)
        delay = self.slots.ssd_delay * flow.ssd_bytes / (1 << 20)   # a test hook
        fence = self.forward_fence()     # slots just allocated may still be written by it
        pool = self.pool

        def work():
            t0 = time.monotonic()
            if delay:
                time.sleep(delay)
            try:
                if fence is not None:
                    self.slots.after(fence)             # fence: SGLang's forward stream
                if flow.remote is not None:
                    from ...cluster.to_slots import restore_with_remote
                    return restore_with_remote(store, self.backend.cluster, flow.keys,
                                               flow.remote, pool.dest_k, pool.dest_v, slots,
                                               window=self.slots.window)
                return store.restore_to_slots(flow.keys, pool.dest_k, pool.dest_v, slots,
                                              window=self.slots.window)
            finally:
                flow.io_s = time.monotonic() - t0

        flow.future = self.slots.submit(work)

    @staticmethod
    def wait(flows: list[Flow], timeout_s: float) -> None:
        """Block until every submitted restore of ``flows`` ended or ``timeout_s`` passed."""
        futures = [f.future for f in flows if f.future is not None]
        if futures:
            wait_futures(futures, timeout=timeout_s)

    # -- 3. finish --------------------------------------------------------------------
    def local_result(self, flow: Flow) -> tuple[bool, int]:
        """(done, restored pages) as this rank sees it; a failed restore counts 0 pages."""
        if flow.future is None or not flow.future.done():
            return False, 0
        try:
            res = flow.future.result()
        except Exception as e:      # an I/O engine error fails this flow, never the server
            log.error("flatcake: restore of %s failed: %s", flow.rid, e)
            return True, 0
        if res.error:
            log.error("flatcake: restore of %s failed: %s", flow.rid, res.error)
        flow.result = res
        return True, int(res.hits if not res.error else 0)

    def finish(self, flow: Flow, pages: int, hold: bool = False) -> tuple[int, int, Any]:
        """Publish the first ``pages`` restored pages into the tree; free everything else.
        Returns (tokens published, of them already on device, the hold): with ``hold`` the
        published span is locked in the tree until ``unhold`` gets the hold back."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        import torch

        flow.state = "done"
        tokens = pages * self.page
        duplicate, held = 0, None
        try:
            if tokens < flow.tokens:
                self.allocator.free(flow.slots[tokens:])
                self.counters["failed"] += 1
            if tokens > 0:
                end = flow.prefix_start + tokens
                prefix = self.tree.path_device_indices(flow.anchor)[: flow.prefix_start]
                value = torch.cat([prefix.to(torch.int64), flow.slots[:tokens].to(torch.int64)])
                got = self.tree.insert(InsertParams(key=flow.key[:end], value=value,
                                                    prev_prefix_len=flow.prefix_start,
                                                    inserted_len=end))
                duplicate = max(0, min(int(got.prefix_len), end) - flow.prefix_start)
                if hold:
                    held = self._hold(flow.key[:end])
                self.tree.prefetch_loaded_tokens_by_reqid[flow.handle] = tokens
                self.tree.prefetch_loaded_storage_start_by_reqid[flow.handle] = flow.prefix_start
                res = flow.result
                bb = self.backend.store.layout.block_bytes
                self.counters["restored_tokens"] += tokens
                self.counters["bytes_from_ssd"] += (res.from_ssd if res else 0) * bb
                self.counters["bytes_from_memory"] += (res.from_memory if res else 0) * bb
            self.counters["flows"] += 1
        finally:
            self.tree.dec_lock_ref(flow.anchor, flow.anchor_lock)
            flow.anchor = flow.anchor_lock = flow.slots = None
        log.info("flatcake: restored %s: %d of %d tokens from %d (%.1f MiB from SSD) in %.3fs "
                 "(worker %.3fs), host-pool gets %d; %d were on device already", flow.rid, tokens,
                 len(flow.key) - flow.prefix_start, flow.prefix_start, flow.ssd_bytes / (1 << 20),
                 time.monotonic() - flow.started_at, flow.io_s, self.backend.host_pool_gets,
                 duplicate)
        return tokens, duplicate, held

    def _hold(self, key) -> Any:
        """Lock the device path ending at ``key``.  The hold remembers the tree's generation:
        ``reset`` (``/flush_cache``) gives the tree a new ``prefetch_loaded_tokens_by_reqid``
        dict, and a lock from before it is void."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        node = self.tree.match_prefix(MatchPrefixParams(key=key)).last_device_node
        return node, self.tree.inc_lock_ref(node).to_dec_params(), \
            self.tree.prefetch_loaded_tokens_by_reqid

    def unhold(self, held: Any) -> None:
        """Release a hold ``finish`` returned (nothing when the tree was reset since)."""
        node, params, generation = held
        if generation is self.tree.prefetch_loaded_tokens_by_reqid:
            self.tree.dec_lock_ref(node, params)

    def close(self) -> None:
        self.slots.close()
