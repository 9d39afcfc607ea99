"""The ``sglang.srt.plugins`` entry point: registers, per mode, the hooks ``hook_table`` lists.

Registered in ``pyproject.toml`` as ``flatcake = "sglang_flatcake.sglang.plugin:register"``;
SGLang's ``load_plugins()`` runs it in the launcher and in every scheduler process.  It
starts only the ``cli`` mode (the flags that select flatcake); the launcher's parsed flags
(``ServerArgs.from_cli_args``) pick the other modes (``modes_of``), which start there and,
through ``MODES_ENV``, in every process the launcher starts.  Before a mode's hooks are
registered, ``hooks.start`` compares exactly its targets and the SGLang members it reads with
the installed SGLang and stops on a mismatch.  The table of hooks, with why each exists, is
``docs/sglang-hooks.md`` (generated from ``hook_table``).  This module holds the hooks on the command line (``ServerArgs``), the
backend factory and the controller's attach; ``hicache/signals.py``, ``hicache/scheduling.py`` and ``cpu.py``
hold the others.
"""

from __future__ import annotations

import json
import logging
import os
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
    parser.error = _one_line_for_flatcake_typos(parser.error)
    return result


def closest_flag(given: str) -> str | None:
    """The ``--flatcake-*`` flag closest to ``given`` (``difflib``), or None when none is close."""
    import difflib
    prefix = "--flatcake-"
    name = given.split("=", 1)[0]
    name = name[len(prefix):] if name.startswith(prefix) else name.lstrip("-")
    # compared without the shared prefix, which would make every flag look close
    hits = difflib.get_close_matches(name, [_flag(f.name)[len(prefix):] for f in _FIELDS],
                                     n=1, cutoff=0.6)
    return prefix + hits[0] if hits else None


def _one_line_for_flatcake_typos(error):
    """Wrap ``parser.error``: an unrecognized ``--flatcake-*`` flag gets one line naming the
    closest flag instead of SGLang's full usage; every other error is the parser's own."""
    def flatcake_error(message: str):
        unknown = [w for w in message.split() if w.startswith("--flatcake")] \
            if message.startswith("unrecognized arguments:") else []
        if not unknown:
            return error(message)
        bad = unknown[0].split("=", 1)[0]
        near = closest_flag(bad)
        hint = f"; did you mean {near}?" if near else "; see --help for the --flatcake-* flags"
        print(f"error: unrecognized argument {bad}{hint}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    return flatcake_error


def flatcake_settings(args) -> dict:
    """The ``--flatcake-*`` flags the user set, by setting name."""
    out = {}
    for f in _FIELDS:
        # absent when ``args`` came from a parser without our flags: then none was given
        v = getattr(args, "flatcake_" + f.name, None)
        if v is not None:
            out[f.name] = v
    return out


def merged_extra_config(backend: str | None, extra_json: str | None, flags: dict,
                        model: tuple[str | None, str | None] = (None, None)) -> str | None:
    """Validate flatcake settings and return the extra-config JSON SGLang should see, with
    ``model`` (path, revision: what the store caches KV for) under ``backend.MODEL_KEYS``."""
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
    from .hicache.backend import config_from_extra
    from .rank_store import check_writable, store_root
    merged = {**extra, **flags}
    cfg, rest = config_from_extra(merged)       # raises ConfigError naming the flag
    check_writable(store_root(cfg, rest))       # stop the launch now, not in the cache factory
    merged["hicache_storage_pass_prefix_keys"] = True
    from .hicache.backend import MODEL_KEYS
    merged.update({k: v for k, v in zip(MODEL_KEYS, model) if v})
    return json.dumps(merged)


def modes_of(args) -> tuple[str, ...]:
    """The flatcake modes parsed server ``args`` run (``hook_table.MODES``): ``hicache`` for
    ``--hicache-storage-backend flatcake``, ``linker`` for ``FlatCakeLinker``, ``cpu`` for
    HiCache without an accelerator; ``cli`` always.  ``AcceleratorProbeError`` when the
    probe for the last cannot answer."""
    from .cpu import accelerator_present
    from .linker.config import runs_flatcake_linker
    modes = ["cli"]
    if args.hicache_storage_backend == BACKEND:
        modes.append("hicache")
    if runs_flatcake_linker(args):
        modes.append("linker")
    if args.enable_hierarchical_cache and not accelerator_present():
        modes.append("cpu")
    return tuple(modes)


def _from_cli_args_around(original, cls, args, *a, **kw):
    from .cpu import AcceleratorProbeError
    try:
        from .linker.config import take_linker_flags      # linker mode: the flags are its own
        modes = modes_of(args)
        flags = flatcake_settings(args)
        if flags.get("timeline"):           # any server, flatcake or not: not a store setting
            from . import timeline
            timeline.enable(flags.pop("timeline"))
            modes += ("timeline",)
        args.hicache_storage_backend_extra_config = merged_extra_config(
            args.hicache_storage_backend, args.hicache_storage_backend_extra_config,
            take_linker_flags(args, flags), (args.model_path, args.revision))
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except AcceleratorProbeError as e:
        print(f"flatcake: refusing to start: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    start(modes)                      # here, and (through MODES_ENV) in every child process
    return original(cls, args, *a, **kw)


def _create_builtin_around(original, cls, backend_name, backend_class, storage_config,
                           mem_pool_host, *a, **kw):
    if backend_name == BACKEND:
        return backend_class(storage_config, mem_pool_host)
    return original(cls, backend_name, backend_class, storage_config, mem_pool_host, *a, **kw)


def _attach_after(result, controller, *a, **kw):
    if controller.storage_backend_type == BACKEND and controller.storage_backend is not None:
        controller.page_get_func = controller._page_get_zero_copy
        controller.page_set_func = controller._page_set_zero_copy
    return result


MODES_ENV = "SGLANG_FLATCAKE_MODES"    # set by the launcher, read by the processes it starts
_started: set[str] = set()            # hook targets registered in this process


def start(modes: tuple[str, ...]) -> None:
    """Start ``modes`` in this process: check exactly their hooks and SGLang members (a
    mismatch stops it with one line), register their hooks and apply them; the backend name
    is registered with SGLang's factory only in HiCache mode.  Records ``modes`` in
    ``MODES_ENV`` for the processes started from this one."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import hooks
    hooks.start(tuple(modes), HookRegistry, HookType, _started)
    if "hicache" in modes:
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
        StorageBackendFactory.register_backend(BACKEND, "sglang_flatcake.sglang.hicache.backend",
                                               "FlatCakeStorage")
    os.environ[MODES_ENV] = ",".join(modes)
    HookRegistry.apply_hooks()         # idempotent: targets patched already are skipped


def modes_from_env() -> tuple[str, ...]:
    """``cli`` and the modes the launcher recorded in ``MODES_ENV`` (none in a launcher)."""
    extra = [m for m in os.environ.get(MODES_ENV, "").split(",") if m and m != "cli"]
    return ("cli", *extra)


def register() -> None:
    """Entry point (``load_plugins``, in the launcher and in every process it starts): start
    the ``cli`` hooks that make flatcake selectable and the modes the launcher chose; a server
    that selects no flatcake mode gets nothing else checked or hooked."""
    start(modes_from_env())
