"""``FlatCakeStorage``: the FlatCake store as an SGLang HiCache storage backend (zero-copy v1).

SGLang calls ``batch_exists``, ``batch_get_v1`` and ``batch_set_v1`` with page
hashes and host-pool token indices; pages move between the host pool and the
store through ``pages.HostPages``.  Each TP/PP rank opens its own store (``rank_store``).
Placement gets its signals from ``signals.SignalBoard`` (filled by scheduler hooks) and from the
chain: the context is ``len(prefix_keys) * page_size``, turn and previous reply its lineage's
(``sglang.lineage``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, List, Optional


from ...config import FlatCakeConfig, setting_name
from ...config_check import redact_url
from ...errors import ConfigError
from ...placement import WriteSignals
from ...store import FlatCakeStore
from ...store_checks import label_for
from ..counters import Counters
from ..lineage import continues
from ..metrics import MetricsExporter
from ..quiet import SchedulerQuiet
from ..device_pool import kv_parts
from .pages import HostPages
from ..rank_store import open_rank_store, place_rank
from .signals import SignalBoard
from ..write_once import WriteOnce
from ..writer_priority import lower_this_thread

log = logging.getLogger("sglang_flatcake")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig


def metrics_type() -> type:
    """SGLang's ``StorageMetrics`` (its collector asserts the type) plus a ``flatcake`` dict.
    Raises ``ImportError`` when SGLang has no ``StorageMetrics``: checked at start
    (``hooks.MEMBERS``), never replaced by a look-alike."""
    from sglang.srt.observability.metrics_collector import StorageMetrics

    @dataclass
    class FlatCakeMetrics(StorageMetrics):
        flatcake: dict = field(default_factory=dict)

    return FlatCakeMetrics


# keys SGLang itself puts into extra_config, which are not flatcake settings
_SGLANG_KEYS = {"file_storage_path", "backend_name", "module_path", "class_name", "interface_v1",
                "tp_lcm_size"}
# keys the launcher adds (``plugin.merged_extra_config``): the model the store caches KV for
MODEL_KEYS = ("model_path", "model_revision")


def config_from_extra(extra: dict | None) -> tuple[FlatCakeConfig, dict]:
    """Split SGLang's extra_config into a validated ``FlatCakeConfig`` and the rest."""
    extra = dict(extra or {})
    ours, rest = {}, {}
    names = set(FlatCakeConfig.__dataclass_fields__)
    for k, v in extra.items():
        key = setting_name(k)
        (ours if key in names else rest)[key if key in names else k] = v
    unknown = set(rest) - _SGLANG_KEYS - set(MODEL_KEYS)
    if unknown:
        log.warning("flatcake: ignoring unknown extra-config keys %s", sorted(unknown))
    return FlatCakeConfig.from_mapping(ours, prefix="--flatcake-"), rest


class FlatCakeStorage(HiCacheStorage):
    """HiCache storage backend; construct with ``(storage_config, mem_pool_host)``."""

    def __init__(self, storage_config: HiCacheStorageConfig, mem_pool_host: Any = None) -> None:
        self.storage_config = storage_config
        self.config, rest = config_from_extra(storage_config.extra_config)
        if storage_config.is_mla_model and storage_config.tp_size > 1:
            raise ConfigError(
                "flatcake: MLA models with --tp-size > 1 are not supported yet (only one rank "
                "writes MLA pages, and each rank owns its own store); use --tp-size 1")
        self.dir, self.config = place_rank(self.config, rest, storage_config)
        self.model = (rest.get("model_path") or storage_config.model_name,
                      rest.get("model_revision"))
        self.store: Optional[FlatCakeStore] = None
        self.pages: Optional[HostPages] = None
        self.mem_pool_host = None
        # this backend's own state (two backends in one process share none of it)
        self.board = SignalBoard()                 # write-time signals, posted by the hooks
        self.write_once = WriteOnce()              # storage backups skipped (write_once.py)
        self.metrics = MetricsExporter(storage_config.enable_storage_metrics, str(self.dir))
        self._metrics_type = metrics_type()
        # reads that went through SGLang's host pool (0 while the scheduler restores directly)
        self.host_pool = Counters("gets", "bytes_for_ssd_hits")
        # the scheduler's flatcake state (``scheduling.state_of``): None until the first
        # request, False when the direct path cannot serve this scheduler
        self.scheduling = None
        self.cluster = None                        # a ``cluster.node.ClusterNode`` when joined
        # writes wait for a moment between forwards (stepped by the scheduling hooks)
        self.quiet = SchedulerQuiet() if self.config.writer_quiet else None
        if self.config.cluster_directory and storage_config.tp_size * storage_config.pp_size > 1:
            raise ConfigError(f"--flatcake-cluster-directory={redact_url(self.config.cluster_directory)!r}: "
                              f"a cluster node runs with one rank for now (--tp-size 1, "
                              f"--pp-size 1)")
        if mem_pool_host is not None:
            self.register_mem_pool_host(mem_pool_host)

    # -- attach --------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the store with the page geometry of ``mem_pool_host``."""
        if self.store is not None:
            return
        self.mem_pool_host = mem_pool_host
        kind, buffers = kv_parts(mem_pool_host)
        self.pages = HostPages(buffers, mem_pool_host.layout, mem_pool_host.page_size,
                               int(mem_pool_host.layer_num), kind)
        self.store = open_rank_store(self.dir, self.pages.kv_layout, self.config, *self.model)
        if self.config.cluster_directory:
            from ...cluster.node import ClusterNode
            self.cluster = ClusterNode(self.store, self.config)
        log.info("flatcake: store %s opened (%s, %d B per page, %s)", self.dir,
                 self.pages.kv_layout.kind, self.pages.kv_layout.block_bytes,
                 self.store.recovery_report or "new")

    # -- v1 --------------------------------------------------------------------------
    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        return self.store.exists(keys) if keys else 0

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        if not keys:
            return []
        out = self.store.alloc_blocks(len(keys))
        res = self.store.get(keys, out)
        self.host_pool.add("gets")
        self.host_pool.add("bytes_for_ssd_hits", res.from_ssd * self.store.layout.block_bytes)
        self.pages.scatter(host_indices, out, res.hits)
        self.board.note_read(res)
        return [i < res.hits for i in range(len(keys))]

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        if not keys:
            return []
        lower_this_thread(self.config.writer_nice)       # SGLang's storage-backup thread
        if self.quiet is not None:
            self.quiet.wait()                              # between forwards (``quiet``)
        prefix = list(extra_info.prefix_keys or []) if extra_info is not None else []
        blocks = self.pages.gather(host_indices)
        sigs = self._signals(keys, prefix)
        seen = self.board.lookup(keys[0])
        label = label_for(seen.session_id) if seen is not None else ""
        res = self.store.put(keys, blocks, prefix_keys=prefix, signals=sigs, label=label)
        ok = res.stored + res.existing
        if self.cluster is not None and res.session is not None and seen is not None \
                and seen.tenant is not None:
            self.cluster.publisher.note(seen.tenant, str(res.session), keys[:ok])
        return [i < ok for i in range(len(keys))]

    def _signals(self, keys: List[str], prefix: List[str]) -> list[WriteSignals]:
        """Write-time signals per page: what the scheduler hooks posted, else the chain's own.

        The batches of one backup operation share the turn, the previous reply and
        the context that existed before the operation (see ``signals``).
        """
        ps = self.pages.kv_layout.page_tokens
        op = self.board.thread.op
        if op is not None and "turn" in op:
            turn, prev, ctx = op["turn"], op["prev"], op["ctx"]
        else:
            c = continues(self.store, prefix[-1] if prefix else None)
            turn, prev, ctx = c.turn, c.prev_reply_tokens, len(prefix) * ps
            if op is not None:
                op.update(turn=turn, prev=prev, ctx=ctx)
        out = []
        for k in keys:
            seen = self.board.lookup(k)
            ref = seen.refcount if seen is not None else 1
            out.append(WriteSignals(refcount=ref, turn=turn, context_tokens=ctx,
                                    prev_reply_tokens=prev))
        return out

    # -- v0 (SGLang selects v1 for flatcake; these exist because the base declares them) --
    def exists(self, key: str) -> bool:
        return self.store.exists([key]) == 1

    def get(self, key, target_location=None, target_sizes=None):
        raise NotImplementedError("flatcake implements the zero-copy v1 interface (batch_get_v1)")

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        raise NotImplementedError("flatcake implements the zero-copy v1 interface (batch_get_v1)")

    def set(self, key, value=None, target_location=None, target_sizes=None):
        raise NotImplementedError("flatcake implements the zero-copy v1 interface (batch_set_v1)")

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        raise NotImplementedError("flatcake implements the zero-copy v1 interface (batch_set_v1)")

    # -- housekeeping ----------------------------------------------------------------
    def clear(self) -> None:
        """Drop every session (``/flush_cache`` does not call this; ``clear_storage_backend`` does)."""
        if self.store is not None:
            self.store.clear()

    @property
    def host_pool_gets(self) -> int:
        """``batch_get_v1`` calls so far (reads through SGLang's host pool)."""
        return self.host_pool["gets"]

    def get_stats(self):
        """SGLang's ``StorageMetrics`` with everything this backend owns under ``flatcake``;
        also sets the ``flatcake_*`` gauges when storage metrics are on."""
        st = self.store.stats() if self.store is not None else {}
        pool = self.host_pool.snapshot()
        st["host_pool_gets"] = pool["gets"]
        st["host_pool_bytes_for_ssd_hits"] = pool["bytes_for_ssd_hits"]
        st["direct"] = self.scheduling.stats() if self.scheduling else {}
        st["write_once"] = self.write_once.counters.snapshot()
        st["quiet"] = self.quiet.counters.snapshot() if self.quiet is not None else {}
        st["signals"] = self.board.stats()
        if self.cluster is not None:
            st["cluster"] = self.cluster.stats()
        st["metrics"] = self.metrics.state()      # as of the previous export
        self.metrics.export(st)
        return self._metrics_type(flatcake=st)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()                   # leave first: peers stop asking
            self.cluster = None
        if self.store is not None:
            self.store.close()
            self.store = None
