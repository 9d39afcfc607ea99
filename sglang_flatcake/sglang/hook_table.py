"""The one table of what flatcake changes and reads in SGLang, by mode (``MODES``).

``HOOKS`` (runtime hooks), ``READS`` (SGLang members read), ``PRIVATE`` (private names of
others touched), ``WRITES`` and ``KEPT_DEFAULTS``: the single source for ``plugin`` (what each
mode registers), ``hooks.check`` (what each mode checks at its start), ``flatcake patch`` and
``docs/sglang-hooks.md`` (``hooks_doc.render_doc``; a test fails when the page drifts).
Rows are tuples, never dict keys, so no row can replace another (``repeated`` names one given
twice; a test keeps it empty).
"""

from __future__ import annotations

from dataclasses import dataclass

SGLANG_VERSION = "0.5.23"           # the release the table was written against


# What a server runs flatcake as; each mode checks and hooks only its own rows, at its start.
#   cli:     every process that loads the plugin: the flags that select flatcake at all
#   hicache: `--hicache-storage-backend flatcake`
#   linker:  `FlatCakeLinker` as SGLang's external linker
#   cpu:     HiCache (any backend) on a server without an accelerator
#   timeline: `--flatcake-timeline PATH`, with or without flatcake (``timeline.py``)
MODES: tuple[str, ...] = ("cli", "hicache", "linker", "cpu", "timeline")


@dataclass(frozen=True)
class Hook:
    """One runtime hook: ``handler`` (``"module:function"`` in ``sglang_flatcake.sglang``) runs
    ``kind`` (before | after | around) ``target``, whose parameters must be ``params``;
    registered (and checked) only when ``mode`` is one the server runs."""
    target: str
    kind: str
    handler: str
    params: tuple[str, ...]
    why: str
    mode: str

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"Hook({self.target}).mode={self.mode!r}: expected one of {MODES}")

    @property
    def short(self) -> str:
        """``Class.method`` (or ``function``): the target without its module."""
        parts = self.target.split(".")
        return ".".join(parts[-2:]) if parts[-2][:1].isupper() else parts[-1]


_SA = "sglang.srt.server_args.ServerArgs."
_CC = "sglang.srt.managers.cache_controller.HiCacheController."
_URC = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache."
_SCH = "sglang.srt.managers.scheduler.Scheduler."
_SP = "sglang.srt.managers.schedule_policy."

HOOKS: tuple[Hook, ...] = (
    Hook(_SA + "add_cli_args", "after", "plugin:_add_cli_args_after", ("parser",),
         "adds the `flatcake` choice and the `--flatcake-*` flags to the parser SGLang builds; "
         "a mistyped `--flatcake-*` flag gets one line naming the closest one", "cli"),
    Hook(_SA + "from_cli_args", "around", "plugin:_from_cli_args_around", ("cls", "args"),
         "validates the flags, merges them into the extra config, turns on prefix keys", "cli"),
    Hook("sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory."
         "_create_builtin_backend", "around", "plugin:_create_builtin_around",
         ("cls", "backend_name", "backend_class", "storage_config", "mem_pool_host"),
         "constructs `FlatCakeStorage(config, host_pool)` (the factory raises for names it "
         "does not know)", "hicache"),
    Hook(_CC + "attach_storage_backend", "after", "plugin:_attach_after",
         ("self", "storage_backend", "prefetch_threshold", "model_name",
          "storage_backend_extra_config"),
         "selects the zero-copy v1 calls (SGLang's v1 list is hard-coded)", "hicache"),
    Hook(_CC + "_page_backup", "around", "hicache.signals:_page_backup_around", ("self", "operation"),
         "marks the batches of one backup operation (one turn)", "hicache"),
    Hook(_URC + "write_backup_storage", "around", "hicache.signals:_write_backup_storage_around",
         ("self", "node_id"),
         "posts the radix node's path and reference count for placement; skips a node "
         "whose pages are all stored already (write once)", "hicache"),
    Hook(_URC + "_execute_and_commit_kv_backup", "around", "hicache.signals:_execute_backup_around",
         ("self", "action", "write_back"),
         "remembers the SGLang session of the insert that backs the nodes up", "hicache"),
    Hook("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController."
         "write_storage", "around", "hicache.signals:_write_storage_around",
         ("self", "host_indices", "token_ids", "hash_value", "prefix_keys", "extra_pools"),
         "where the node's page keys are known: files the posted signals under them",
         "hicache"),
    Hook(_SCH + "_prefetch_kvcache", "around", "hicache.scheduling:_prefetch_around",
         ("self", "req", "storage_hit_end"),
         "at arrival, looks up the stored span and classifies the request (ready or "
         "SSD-preparing) instead of SGLang's storage -> host-pool prefetch", "hicache"),
    Hook(_SCH + "_get_new_batch_prefill_raw", "before", "hicache.scheduling:_prefill_before",
         ("self", "prefill_delayer_single_pass", "running_batch"),
         "once per step: marks the step's start for the writers (`quiet`), starts prefetches "
         "in priority order (direct restore into device KV slots), publishes finished ones "
         "into the radix tree", "hicache"),
    Hook(_URC + "check_prefetch_progress", "around", "hicache.scheduling:_progress_around",
         ("self", "request"),
         "the admission gate: an unpublished restore (or, with `--flatcake-single-queue`, an "
         "earlier unready arrival) keeps the request waiting in place", "hicache"),
    Hook(_SP + "SchedulePolicy.calc_priority", "after", "linker.admission:_calc_priority_after",
         ("self", "waiting_queue", "running_batch", "processed_tokens"),
         "linker mode (`FlatCakeLinker` only): ready requests and aged SSD requests first, "
         "SSD requests not yet at their deadline after them (no-op otherwise)", "linker"),
    Hook(_SP + "PrefillAdder.add_one_req", "around", "linker.admission:_add_one_req_around",
         ("self", "req", "has_chunked_req", "truncation_align_size"),
         "linker mode (`FlatCakeLinker` only): a batch holds ready or SSD-restoring requests, "
         "never both; a new SSD request is held briefly so ready ones sent with it go first "
         "(`AddReqResult.CONTINUE`: it keeps waiting in place; no-op otherwise)", "linker"),
    Hook("sglang.srt.mem_cache.pool_host.base.HostKVCache.__init__", "before",
         "cpu:_no_pin_before_init",
         ("self", "dtype", "device_capacity_tokens", "size_per_token", "start_layer",
          "end_layer", "host_to_device_ratio", "host_size", "page_size", "layout", "pin_memory",
          "device", "allocator_type", "dcp_size", "dcp_rank", "pool_label", "is_dummy",
          "host_token_capacity"),
         "no page pinning without CUDA; binds torch-native transfer ops", "cpu"),
    Hook("sglang.srt.arg_groups.hicache_hook.resolve_layout_io_compatibility", "around",
         "cpu:_resolve_io_around", ("server_args",),
         "`--device cpu` resolves the HiCache I/O backend to `direct`", "cpu"),
    Hook(_SCH + "handle_generate_request", "before", "timeline:_arrival_before",
         ("self", "recv_req", "mm_input_error"),
         "`--flatcake-timeline`: marks the request's arrival (prompt hash, size)", "timeline"),
    Hook(_SCH + "run_batch", "before", "timeline:_run_batch_before",
         ("self", "batch", "pp_proxy_tensors"),
         "`--flatcake-timeline`: marks each request's first prefill forward", "timeline"),
    Hook(_SCH + "process_batch_result", "after", "timeline:_result_after",
         ("self", "batch", "result"),
         "`--flatcake-timeline`: marks each request's first token", "timeline"),
)

@dataclass(frozen=True)
class Reads:
    """SGLang members (attributes set in ``__init__``, methods, fields) of ``owner`` that
    ``mode`` reads, each as a plain attribute, so a rename shows at start, not as a default."""
    owner: str
    names: tuple[str, ...]
    mode: str

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"Reads({self.owner}).mode={self.mode!r}: expected one of {MODES}")


_URC_ = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
_SA_ = "sglang.srt.server_args.ServerArgs"
_REQ_ = "sglang.srt.managers.schedule_batch.Req"

# A tuple, not a dict: two rows for one owner both count (a dict's second key replaced the
# first).  ``repeated`` names a (mode, owner) row or an (owner, name) read given twice.
READS: tuple[Reads, ...] = (
    Reads(_SA_, ("hicache_storage_backend", "hicache_storage_backend_extra_config",
                 "model_path", "revision",
                 "enable_hierarchical_cache", "enable_unified_cache_external_linker",
                 "unified_cache_external_linker_config",
                 "unified_cache_external_linker_backend"), "cli"),
    Reads("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController",
          ("parse_storage_backend_extra_config",), "cli"),
    Reads(_URC_, ("cache_controller", "enable_storage", "insert_session_id", "tree_core",
                  "tp_world_size", "pp_size", "page_size", "_all_reduce", "tree_components",
                  "is_swa_enabled", "buffer_pipeline", "prefetch_loaded_tokens_by_reqid",
                  "prefetch_loaded_storage_start_by_reqid"), "hicache"),
    Reads("sglang.srt.managers.cache_controller.HiCacheController",
          ("storage_backend", "storage_backend_type", "page_get_func", "page_set_func",
           "_page_get_zero_copy", "_page_set_zero_copy"), "hicache"),
    Reads("sglang.srt.managers.scheduler.Scheduler",
          ("tree_cache", "tp_size", "tp_cpu_group", "running_batch", "last_batch",
           "waiting_queue", "forward_ct", "chunked_req", "page_size", "disaggregation_mode",
           "token_to_kv_pool_allocator"), "hicache"),
    Reads("sglang.srt.managers.schedule_batch.ScheduleBatch",
          ("reqs", "forward_mode", "extend_num_tokens", "prefix_lens"), "hicache"),
    Reads(_REQ_, ("origin_input_ids", "output_ids", "prefix_len", "rid", "sampling_params",
                  "host_hit_length"), "hicache"),
    Reads("sglang.srt.mem_cache.unified_cache.cache_action.BackupKV", ("node_ids",), "hicache"),
    Reads("sglang.srt.mem_cache.hicache_storage.HiCacheStorageConfig",
          ("tp_rank", "tp_size", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size",
           "dp_rank", "model_name", "extra_config", "is_mla_model", "enable_storage_metrics"),
          "hicache"),
    Reads("sglang.srt.mem_cache.hicache_storage.HiCacheStorageExtraInfo", ("prefix_keys",),
          "hicache"),
    Reads("sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost",
          ("layout", "page_size", "layer_num", "k_buffer", "v_buffer"), "hicache"),
    Reads("sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost",
          ("layout", "page_size", "layer_num", "kv_buffer"), "hicache"),
    Reads("sglang.srt.observability.metrics_collector.StorageMetrics",
          ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth"), "hicache"),
    Reads("sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory",
          ("register_backend",), "hicache"),
    # the direct external linker (linker/) and its admission (linker/admission.py)
    Reads(_URC_, ("linker",), "linker"),
    Reads(_REQ_, ("rid", "host_hit_length", "prefix_len"), "linker"),
    Reads("sglang.srt.managers.schedule_policy.PrefillAdder", ("tree_cache", "can_run_list"),
          "linker"),
    Reads("sglang.srt.managers.schedule_policy.SchedulePolicy", ("tree_cache",), "linker"),
    Reads("sglang.srt.managers.schedule_policy.AddReqResult", ("CONTINUE",), "linker"),
    Reads("sglang.srt.mem_cache.unified_cache.unified_cache_linker.UnifiedCacheLinkerWrapper",
          ("cache_linker",), "linker"),
    Reads("sglang.srt.mem_cache.cache_init_params.CacheInitParams",
          ("token_to_kv_pool_allocator", "page_size", "req_to_token_pool",
           "attn_tp_cache_group", "tp_cache_group", "pp_rank", "pp_size", "attn_cp_rank",
           "attn_cp_size"), "linker"),
    Reads("sglang.srt.mem_cache.memory_pool.ReqToTokenPool", ("req_to_token", "free_slots"),
          "linker"),
    Reads(_SA_, ("served_model_name", "model_path", "revision", "enable_metrics"), "linker"),
    # HiCache on a CPU server (cpu.py)
    Reads(_SA_, ("device", "hicache_io_backend", "hicache_mem_layout"), "cpu"),
    Reads("sglang.srt.arg_groups.hicache_hook", ("declare_resolution", "resolving_view"), "cpu"),
    # the per-request timeline (timeline.py)
    Reads(_REQ_, ("rid", "output_ids", "prefix_len"), "timeline"),
    Reads("sglang.srt.managers.io_struct.TokenizedGenerateReqInput", ("rid", "input_ids"),
          "timeline"),
    Reads("sglang.srt.managers.schedule_batch.ScheduleBatch",
          ("reqs", "forward_mode", "extend_num_tokens"), "timeline"),
    Reads("sglang.srt.managers.scheduler.Scheduler", ("waiting_queue",), "timeline"),
)


def repeated(reads: tuple[Reads, ...] = READS) -> list[str]:
    """One line per (mode, owner) row or (mode, owner, name) read that appears twice."""
    rows, seen, out = set(), set(), []
    for r in reads:
        if (r.mode, r.owner) in rows:
            out.append(f"{r.mode}: {r.owner} has two rows")
        rows.add((r.mode, r.owner))
        for n in r.names:
            if (r.mode, r.owner, n) in seen:
                out.append(f"{r.mode}: {r.owner}.{n} is listed twice")
            seen.add((r.mode, r.owner, n))
    return out


def members_of(modes=MODES, reads: tuple[Reads, ...] = READS) -> dict[str, tuple[str, ...]]:
    """The members ``modes`` read, by owner: every row's names kept (none replaces another),
    each name once."""
    out: dict[str, tuple[str, ...]] = {}
    for r in reads:
        if r.mode in modes:
            have = out.get(r.owner, ())
            out[r.owner] = have + tuple(n for n in r.names if n not in have)
    return out


def hooks_of(modes=MODES) -> tuple[Hook, ...]:
    """The rows of ``HOOKS`` that ``modes`` register, in table order."""
    return tuple(h for h in HOOKS if h.mode in modes)


MEMBERS: dict[str, tuple[str, ...]] = members_of()  # all modes (``flatcake patch``, the doc)


@dataclass(frozen=True)
class Reach:
    """A private SGLang name the adapter touches: ``name`` (as written in the code), where
    (``module:function``) and why no public way exists."""
    name: str
    where: str
    why: str


PRIVATE: tuple[Reach, ...] = (
    Reach("_create_builtin_backend", "hook_table:HOOKS",
          "the factory builds unknown names nowhere else (hook target)"),
    Reach("_page_backup", "hook_table:HOOKS", "the only place one backup operation is visible "
          "(hook target)"),
    Reach("_execute_and_commit_kv_backup", "hook_table:HOOKS",
          "the only place the insert's session id meets its node ids (hook target)"),
    Reach("_prefetch_kvcache", "hook_table:HOOKS", "the request's arrival (hook target)"),
    Reach("_get_new_batch_prefill_raw", "hook_table:HOOKS", "once per scheduler step (hook target)"),
    Reach("_page_get_zero_copy", "plugin:_attach_after",
          "SGLang selects the v1 calls from a hard-coded name list"),
    Reach("_page_set_zero_copy", "plugin:_attach_after", "as above"),
    Reach("_backend", "hicache.signals:flatcake_backend",
          "SGLang's HiCacheStorageFailureInjector wraps the backend and exposes no accessor"),
    Reach("_all_reduce", "write_once:WriteOnce.skip",
          "the tree's own TP/PP reduction, so every rank skips the same nodes"),
    Reach("_compute_max_prefix_len", "hicache.direct:DirectRestorer.lookup",
          "the longest prefix a request may reuse (owned by direct.py)"),
    Reach("_actions", "plugin:_add_cli_args_after",
          "argparse's, not SGLang's: a parser has no public list of its actions"),
)

# SGLang state the adapter writes (public names, SGLang's objects): (where, what, why).
WRITES: tuple[tuple[str, str, str], ...] = (
    ("plugin:_add_cli_args_after", "the `--hicache-storage-backend` action's choices and help; "
     "`parser.error`", "the `flatcake` choice; one line for a mistyped `--flatcake-*` flag"),
    ("plugin:_from_cli_args_around", "`args.hicache_storage_backend_extra_config`",
     "the validated, merged extra config"),
    ("plugin:_attach_after", "`controller.page_get_func`, `controller.page_set_func`",
     "the zero-copy v1 calls"),
    ("cpu:bind_cpu_transfer_ops", "`transfer_kv_*` globals of `pool_host.mha`/`pool_host.mla`",
     "torch-native ops where SGLang binds none (CPU only)"),
    ("hicache.direct:DirectRestorer.finish", "`tree.prefetch_loaded_tokens_by_reqid`, "
     "`tree.prefetch_loaded_storage_start_by_reqid`",
     "SGLang's storage-hit accounting (`cached_tokens_details.storage`)"),
)


# ``getattr(sglang_object, name, default)`` reads kept on purpose: (module:function, the read,
# why the default is harmless).  A test keeps this equal to what the code has.
KEPT_DEFAULTS: tuple[tuple[str, str, str], ...] = (
    ("plugin:flatcake_settings", "getattr(args, 'flatcake_' + f.name, None)",
     "`args` parsed without the flatcake flags (SGLang built the parser without the plugin): "
     "then no `--flatcake-*` flag was given, which is what None says"),
    ("hicache.direct:DirectRestorer.supported", "getattr(scheduler, 'disaggregation_mode', None)",
     "in direct.py (owned elsewhere; its test fakes omit the member); a rename stops the "
     "launch first (`Scheduler.disaggregation_mode` in MEMBERS)"),
    ("hicache.direct:DirectRestorer.supported", "getattr(mode, 'name', str(mode))",
     "the mode is SGLang's `DisaggregationMode` enum, which always has a name"),
    ("linker.admission:admission_of", "getattr(tree_cache.linker.cache_linker, 'admission', None)",
     "another linker (SGLang's mooncake or mori, or a user's) has no `admission`; None says "
     "the admission hooks leave it alone; a FlatCakeLinker's is checked by its type"),
)

