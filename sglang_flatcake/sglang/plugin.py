"""The ``sglang.srt.plugins`` entry point: every runtime hook flatcake needs, and why.

Registered in ``pyproject.toml`` as ``flatcake = "sglang_flatcake.sglang.plugin:register"``;
SGLang's ``load_plugins()`` runs it in the launcher and in every scheduler process.

Hooks (no source edit needed):

- ``ServerArgs.add_cli_args`` (AFTER): adds ``flatcake`` to ``--hicache-storage-backend``'s
  choices and the ``--flatcake-*`` flags (shown with their defaults in ``--help``).
- ``ServerArgs.from_cli_args`` (AROUND): validates the ``--flatcake-*`` flags together with
  any flatcake keys of ``--hicache-storage-backend-extra-config`` (a bad value stops the
  launch with a message naming the flag; so does a store directory that cannot be
  written), merges them into the extra config, and asks
  SGLang for the prefix keys (``hicache_storage_pass_prefix_keys``) that session lineage needs.
- ``StorageBackendFactory._create_builtin_backend`` (AROUND): builds ``FlatCakeStorage``
  with the host pool; the backend itself is registered with ``register_backend``.
- ``HiCacheController.attach_storage_backend`` (AFTER): selects the zero-copy v1 calls
  (SGLang's list of v1 backends is hard-coded).
- ``cpu.py`` and ``signals.py``: HiCache on a CPU server, and write-time signals
  (``write_backup_storage``, ``_execute_and_commit_kv_backup``, ``write_storage``,
  ``_page_backup``).
- ``scheduling.py``: the two queues and the direct restore (``Scheduler._prefetch_kvcache``,
  ``Scheduler._get_new_batch_prefill_raw``, ``UnifiedRadixCache.check_prefetch_progress``).
"""

from __future__ import annotations

import json
import logging
import sys

from ..config import FlatCakeConfig
from ..errors import ConfigError

log = logging.getLogger("sglang_flatcake")
BACKEND = "flatcake"
_FIELDS = [f for f in FlatCakeConfig.__dataclass_fields__.values()]


def _flag(name: str) -> str:
    return "--flatcake-" + name.replace("_", "-")


def _add_cli_args_after(result, parser, *a, **kw):
    for action in parser._actions:
        if action.dest == "hicache_storage_backend" and action.choices is not None \
                and BACKEND not in action.choices:
            action.choices = list(action.choices) + [BACKEND]
            action.help = (action.help or "") + " flatcake: FlatCake (see --flatcake-* flags)."
    if any(a.dest == "flatcake_high_watermark" for a in parser._actions):
        return result
    group = parser.add_argument_group("FlatCake storage backend (--hicache-storage-backend flatcake)")
    defaults = FlatCakeConfig()
    for f in _FIELDS:
        default = getattr(defaults, f.name)
        switch = {"nargs": "?", "const": "true"} if isinstance(default, bool) else {}
        group.add_argument(_flag(f.name), dest="flatcake_" + f.name, default=None, metavar="V",
                           help=f"{f.metadata.get('help', '')} (default: {default!r})", **switch)
    return result


def flatcake_settings(args) -> dict:
    """The ``--flatcake-*`` flags the user set, by setting name."""
    out = {}
    for f in _FIELDS:
        v = getattr(args, "flatcake_" + f.name, None)
        if v is not None:
            out[f.name] = v
    return out


def merged_extra_config(backend: str | None, extra_json: str | None, flags: dict) -> str | None:
    """Validate flatcake settings and return the extra-config JSON SGLang should see."""
    if backend != BACKEND:
        if flags:
            raise ConfigError(f"{', '.join(_flag(k) for k in flags)} given, but "
                              f"--hicache-storage-backend is {backend!r}, not flatcake")
        return extra_json
    extra: dict = {}
    if extra_json:
        if extra_json.startswith("@"):
            from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
                HybridCacheController)
            parsed = HybridCacheController.parse_storage_backend_extra_config(extra_json)
            extra = dict(parsed[0])
            extra.update(prefetch_threshold=parsed[1], prefetch_timeout_base=parsed[2],
                         prefetch_timeout_per_ki_token=parsed[3])
        else:
            extra = json.loads(extra_json)
    from .backend import check_writable, config_from_extra, store_root
    merged = {**extra, **flags}
    cfg, rest = config_from_extra(merged)       # raises ConfigError naming the flag
    check_writable(store_root(cfg, rest))       # stop the launch now, not in the cache factory
    merged["hicache_storage_pass_prefix_keys"] = True
    return json.dumps(merged)


def _from_cli_args_around(original, cls, args, *a, **kw):
    backend = getattr(args, "hicache_storage_backend", None)
    try:
        from .linker_config import take_linker_flags      # linker mode: the flags are its own
        args.hicache_storage_backend_extra_config = merged_extra_config(
            backend, getattr(args, "hicache_storage_backend_extra_config", None),
            take_linker_flags(args, flatcake_settings(args)))
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return original(cls, args, *a, **kw)


def _create_builtin_around(original, cls, backend_name, backend_class, storage_config,
                           mem_pool_host, *a, **kw):
    if backend_name == BACKEND:
        return backend_class(storage_config, mem_pool_host)
    return original(cls, backend_name, backend_class, storage_config, mem_pool_host, *a, **kw)


def _attach_after(result, controller, *a, **kw):
    if getattr(controller, "storage_backend_type", None) == BACKEND and \
            getattr(controller, "storage_backend", None) is not None:
        controller.page_get_func = controller._page_get_zero_copy
        controller.page_set_func = controller._page_set_zero_copy
    return result


def register() -> None:
    """Entry point: register every hook with SGLang's ``HookRegistry``."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .cpu import register_cpu_hooks
    from .scheduling import register_scheduling_hooks
    from .signals import register_signal_hooks

    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args",
                          _add_cli_args_after, HookType.AFTER)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.from_cli_args",
                          _from_cli_args_around, HookType.AROUND)
    try:
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
        if BACKEND not in StorageBackendFactory._registry:
            StorageBackendFactory.register_backend(BACKEND, "sglang_flatcake.sglang.backend",
                                                   "FlatCakeStorage")
    except Exception as e:
        log.warning("flatcake: cannot register the storage backend: %s", e)
    HookRegistry.register(
        "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory._create_builtin_backend",
        _create_builtin_around, HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.cache_controller.HiCacheController.attach_storage_backend",
                          _attach_after, HookType.AFTER)
    register_cpu_hooks(HookRegistry, HookType)
    register_signal_hooks(HookRegistry, HookType)
    register_scheduling_hooks(HookRegistry, HookType)
