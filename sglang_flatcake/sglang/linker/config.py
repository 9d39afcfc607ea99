"""The linker's settings: ``linker_extra_config`` plus ``--flatcake-*`` flags (flags win).

SGLang hands ``--unified-cache-external-linker-config``'s ``linker_extra_config`` to the
linker untouched.  Every ``FlatCakeConfig`` setting is accepted there under the same names
as in ``--hicache-storage-backend-extra-config`` (``store_dir``, ``memory_bytes``,
``flatcake_high_watermark``, ``high-watermark`` ...).  Unknown keys are refused (a typo
would silently change nothing).  ``take_linker_flags`` runs in the launcher (the plugin's
``ServerArgs.from_cli_args`` hook): it merges the flags into the linker config, validates
the result and checks the store directory, so a bad value stops the launch with one line
naming it; the scheduler validates the same dict again when it builds the linker.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from ...config import FlatCakeConfig, setting_name
from ...errors import ConfigError

LINKER = "FlatCakeLinker"
MODULE = "sglang_flatcake.sglang.linker"
_NAMES = set(FlatCakeConfig.__dataclass_fields__)


def linker_config(extra: Mapping[str, Any] | None, flags: Mapping[str, Any] | None = None
                  ) -> FlatCakeConfig:
    """The validated ``FlatCakeConfig`` of ``extra`` (``linker_extra_config``) with
    ``flags`` (``--flatcake-*`` values by setting name) on top.  ``ConfigError`` naming the
    key (``linker_extra_config.<key>``) or the flag (``--flatcake-<name>``) and the value."""
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError(f"linker_extra_config={extra!r} is not allowed: expected a JSON object")
    ours = {}
    for k, v in dict(extra or {}).items():
        name = setting_name(k)
        if name not in _NAMES:
            raise ConfigError(f"linker_extra_config.{k}={v!r} is not allowed: unknown setting; "
                              f"known: {', '.join(sorted(_NAMES))}")
        ours[name] = v
    flags = dict(flags or {})
    merged = {**ours, **flags}
    try:
        return FlatCakeConfig.from_mapping(merged)
    except ConfigError as e:
        msg = str(e)
        name = re.match(r"[a-z_]*", msg).group(0)
        if name not in merged:               # not "<setting>=<value> ..." (cannot happen)
            raise
        where = f"--flatcake-{name.replace('_', '-')}" if name in flags \
            else f"linker_extra_config.{name}"
        raise ConfigError(where + msg[len(name):]) from None


def selects_flatcake(config: Any) -> bool:
    """Whether a ``--unified-cache-external-linker-config`` value names ``FlatCakeLinker``."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            return False
    return isinstance(config, dict) and config.get("linker") == LINKER \
        and config.get("linker_module_path") == MODULE


def runs_flatcake_linker(args: Any) -> bool:
    """Whether parsed server ``args`` select ``FlatCakeLinker`` as the external linker."""
    return bool(args.enable_unified_cache_external_linker) \
        and args.unified_cache_external_linker_backend == "dynamic" \
        and selects_flatcake(args.unified_cache_external_linker_config)


def take_linker_flags(args: Any, flags: dict) -> dict:
    """In the launcher: when ``args`` selects ``FlatCakeLinker``, merge ``flags`` into its
    ``linker_extra_config`` (flags win), validate it and check the store directory, and
    return ``{}`` (the flags are used); otherwise return ``flags`` unchanged.
    ``ConfigError`` (one line, naming the value) for a bad setting."""
    if not runs_flatcake_linker(args):
        return flags
    raw = args.unified_cache_external_linker_config
    config = json.loads(raw) if isinstance(raw, str) else dict(raw)
    extra = config.get("linker_extra_config") or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"linker_extra_config={extra!r} is not allowed: expected a JSON object")
    cfg = linker_config(extra, flags)
    from ..rank_store import check_writable, store_root
    check_writable(store_root(cfg, {}))
    merged = {**{setting_name(k): v for k, v in extra.items()}, **flags}
    config["linker_extra_config"] = merged
    args.unified_cache_external_linker_config = json.dumps(config) if isinstance(raw, str) \
        else config
    return {}
