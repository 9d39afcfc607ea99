"""``FlatCakeLinker``: flatcake as SGLang 0.5.23's direct external linker (no host tier).

Selected with SGLang's own flags::

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "FlatCakeLinker",
        "linker_module_path": "sglang_flatcake.sglang.linker",
        "linker_extra_config": {"store_dir": "/path", "memory_bytes": "8GiB"}}'

SGLang constructs one per scheduler (rank) and calls it on the scheduler thread; the
contract is ``unified_cache_linker.UnifiedCacheLinker``.  Each call's stage lives in its
own module: settings (``config``), the device pool (``sglang.device_pool``, shared with HiCache
mode), ``lookup``
(``lookup``), ``load``/``start_layer_wise_loading`` (``load``), ``offload``
(``offload``, ``signals``).  Each rank opens its own store under
``store_dir`` (``rank_store.rank_dir``), as in HiCache mode.  What is not supported is
refused at start, by name: components other than full attention, pools without
per-layer KV buffers, MLA with more than one TP rank.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Optional

import torch

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter, UnifiedCacheLinker)

from ...errors import ConfigError
from .. import timeline
from . import marks
from .admission import LinkerAdmission
from .config import linker_config
from .load import Batch, LayerLoader, Load
from .lookup import Lookup
from .prefill import PrefillClock
from ..disk_probe import DiskProbe
from .offload import Offloader
from ..quiet import SchedulerQuiet
from .signals import SlotKeys, live_rows
from ..counters import Counters
from ..device_pool import DevicePool
from ..metrics import MetricsExporter
from ..ranks import RankAgreement
from ..rank_store import open_rank_store, place_rank

log = logging.getLogger("sglang_flatcake")
RECOMPUTE_ENTRIES = 4096   # rids remembered between lookup and load (a request that never loads ages out)


def _rank(params) -> tuple[int, int]:
    group = params.attn_tp_cache_group or params.tp_cache_group
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)
    return 0, 1


def _event():
    """An event recorded now on the current stream (CPU servers: SGLang's CPU stand-in)."""
    from sglang.srt.utils import get_device_module
    ev = get_device_module().Event()
    ev.record()
    return ev


class FlatCakeLinker(UnifiedCacheLinker):
    """One rank's store, linked straight to its device KV pool."""

    def __init__(self, server_args, params, *, components=None, extra_config=None,
                 forward_stream=None) -> None:
        self.forward_stream = forward_stream
        self.config = linker_config(extra_config or {})
        names = sorted(c.name for c in (components or ()) if c.name != "FULL")
        if names:
            raise ConfigError(f"flatcake linker: tree components {', '.join(names)} are not "
                              f"supported (full attention only)")
        kv = params.token_to_kv_pool_allocator.get_kvcache()
        self.pool = DevicePool(kv, params.page_size)
        tp_rank, tp_size = _rank(params)
        if self.pool.kind == "mla" and tp_size > 1:
            raise ConfigError("flatcake linker: MLA models with --tp-size > 1 are not supported "
                              "(each rank owns its own store); use --tp-size 1")
        where = SimpleNamespace(model_name=server_args.served_model_name
                                or server_args.model_path,
                                tp_rank=tp_rank, tp_size=tp_size,
                                pp_rank=params.pp_rank, pp_size=params.pp_size,
                                attn_cp_rank=params.attn_cp_rank,
                                attn_cp_size=params.attn_cp_size,
                                dp_rank=0)
        folder, cfg = place_rank(self.config, {}, where)
        self.store = open_rank_store(folder, self.pool.layout, cfg, server_args.model_path,
                                     server_args.revision)
        self.pools = {PoolName.KV: kv}
        self.layer_done_counter = LayerWiseLoadCounter(len(self.pool.k))
        self.loader = LayerLoader(self.store, self.pool, self.layer_done_counter,
                                  cfg.verify_reads)
        self.finder = Lookup(self.store, self.loader.damaged, cfg.recompute_when_faster,
                             DiskProbe(self.store, self.loader.slots.submit,
                                       self.loader.slots.ssd_delay))
        self.loader.restore_rate = self.finder.decider.restore
        self.admission = LinkerAdmission(      # the ready / SSD-preparing split of batches
            cfg.queue_aging, not cfg.single_queue, self.finder.decider.restore.seconds_for,
            RankAgreement(params.attn_tp_cache_group or params.tp_cache_group),
            prefill=PrefillClock(self.finder.decider.prefill,
                                 marginal=self.finder.decider.marginal))
        self.slot_keys = SlotKeys()
        rows_pool = params.req_to_token_pool
        self.quiet = SchedulerQuiet() if cfg.writer_quiet else None   # steps: num_completed_offloads
        self.offloader = Offloader(self.store, self.pool, rows_pool.req_to_token,
                                   self.slot_keys, nice=cfg.writer_nice,
                                   max_backlog_bytes=cfg.offload_backlog_bytes,
                                   live_rows=lambda: live_rows(rows_pool), quiet=self.quiet)
        self.queued: dict[str, Load] = {}
        self.running: dict[int, Batch] = {}
        self.recompute_tokens: dict[str, int] = {}     # rid -> tail tokens past its restore
        self.counters = Counters("lookups", "lookup_hit_pages", "loads_refused",
                                 "loads_cancelled", "load_tokens_cancelled")   # queued, never read
        # the store's flatcake_* gauges in /metrics (--enable-metrics), at most once a second
        self.metrics = MetricsExporter(bool(server_args.enable_metrics), str(self.store.root))
        self.metrics_at = 0.0
        log.info("flatcake linker: store %s opened (%s, %d B per page, %s memory, %s)",
                 self.store.root, self.pool.layout.kind, self.pool.layout.block_bytes,
                 "host" if self.pool.device is None else self.pool.device.name,
                 self.store.recovery_report or "new")

    # -- lookup ------------------------------------------------------------------------
    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        """Every restorable length in pages: 1 .. the run ``Lookup.find`` allows."""
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if kv is None or not kv.keys:
            return []
        ahead = [*self.queued.values(), *(ld for b in self.running.values() for ld in b.loads)]
        found = self.finder.find(list(kv.keys), self._disk_backlog(),
                                 sum(1 for ld in ahead if ld.ssd_bytes),
                                 sum(self.recompute_tokens.get(ld.rid, 0) for ld in ahead))
        self.counters.add("lookups")
        if timeline.ON:
            marks.looked_up(self, rid, found, ahead)
        self.counters.add("lookup_hit_pages", found.pages)
        self.recompute_tokens.pop(rid, None)             # newest last: the oldest go first
        self.recompute_tokens[rid] = (found.tail - found.pages) * self.pool.page
        while len(self.recompute_tokens) > RECOMPUTE_ENTRIES:   # looked up, never loaded
            del self.recompute_tokens[next(iter(self.recompute_tokens))]
        self.admission.note(rid, found.ssd_pages * self.store.layout.block_bytes)
        return list(range(1, found.pages + 1))

    def _disk_backlog(self) -> float:
        return float(sum(ld.ssd_bytes for ld in self.queued.values())
                     + sum(ld.ssd_bytes for b in self.running.values() for ld in b.loads))

    # -- load --------------------------------------------------------------------------
    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        """Pin the pages and queue the load; False (SGLang recomputes) when the store no
        longer holds every page, or a transfer is not the KV pool's."""
        if any(t.name != PoolName.KV for t in transfers) or len(transfers) != 1:
            return False
        t = transfers[0]
        keys = list(t.keys)
        if rid in self.queued:
            raise RuntimeError(f"flatcake linker: a load for {rid} is already queued")
        if any(k in self.loader.damaged for k in keys):
            self.counters.add("loads_refused")
            return False
        lease = self.store.read_lease(keys)
        if lease.n < len(keys):
            lease.release()
            self.counters.add("loads_refused")
            return False
        slots = t.device_indices.to("cpu", torch.int64).numpy()
        bb = self.store.layout.block_bytes
        self.queued[rid] = Load(rid, keys, slots, lease, len(lease.ssd) * bb)
        self.slot_keys.note(t.device_indices.cpu(), keys, self.pool.page)
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        ld = self.queued.pop(rid, None)
        self.recompute_tokens.pop(rid, None)
        if ld is None:
            return False
        ld.lease.release()
        self.counters.add("loads_cancelled")
        self.counters.add("load_tokens_cancelled", len(ld.keys) * self.pool.page)
        return True

    def start_layer_wise_loading(self) -> int:
        """Start every queued load as one batch; its counter index (-1: nothing queued)."""
        if not self.queued:
            return -1
        loads, self.queued = list(self.queued.values()), {}
        if timeline.ON:
            marks.started(loads)
        self.admission.prefill.loading()             # this step's time is not prefill alone
        index = self.layer_done_counter.update_producer()
        batch = Batch(index, loads, _event())
        self.running[index] = batch
        self.loader.submit(batch)
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        """Wait until the batch stops writing device memory; True when every layer landed."""
        batch = self.running.pop(counter_index, None)
        if batch is not None and batch.future is not None:
            batch.future.result()
        landed = self.layer_done_counter.finish(counter_index)
        if timeline.ON and batch is not None:
            marks.finished(batch.loads, landed)
        if batch is not None:
            for ld in batch.loads:
                self.recompute_tokens.pop(ld.rid, None)
        return landed

    # -- offload -----------------------------------------------------------------------
    def offload(self, transfers: list[PoolTransfer], session_id: Optional[str] = None) -> bool:
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if kv is None or not kv.keys or kv.device_indices is None:
            return False
        self.offloader.submit(list(kv.keys), kv.device_indices, self.record_offload_ready(),
                              session_id)
        return True

    def num_completed_offloads(self) -> int:
        """Called by SGLang once at the start of every scheduler step (also the prefill
        clock's step, and the offload worker's: it writes between forwards)."""
        self.admission.prefill.step()
        if self.quiet is not None:
            self.quiet.step()
        if self.metrics.enabled and time.monotonic() - self.metrics_at >= 1.0:
            self.metrics_at = time.monotonic()
            self.metrics.export({**self.store.stats(), "linker": self.stats()})
        return self.offloader.num_completed()

    def pop_completed_offload(self) -> bool:
        return self.offloader.pop_completed()

    # -- lifecycle ---------------------------------------------------------------------
    def reset(self) -> None:
        """``/flush_cache``: finish what runs, drop what is queued; the store keeps its data."""
        for rid in list(self.queued):
            self.cancel_queued_load(rid)
        for index in list(self.running):
            self.finish_layer_wise_loading(index)
        self.offloader.drain()
        self.offloader.drop_results()
        self.layer_done_counter.reset()
        self.slot_keys.clear()
        self.recompute_tokens.clear()
        self.admission.clear()
        self.metrics_at = 0.0                           # the next step exports the gauges

    def close(self) -> None:
        self.reset()
        self.offloader.close()
        self.loader.close()
        log.info("flatcake linker: closing; %s", self.stats())
        self.store.close()

    def stats(self) -> dict:
        return {**self.counters.snapshot(), "load": self.loader.counters.snapshot(),
                "offload": self.offloader.counters.snapshot(), "decision": self.finder.stats(),
                "damaged_pages": len(self.loader.damaged),
                "quiet": self.quiet.counters.snapshot() if self.quiet is not None else {},
                "admission": self.admission.counters.snapshot()}
