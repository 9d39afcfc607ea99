"""``--flatcake-*`` flags for the replay's FlatCake systems (``flatcake replay``, ``flatcake tune``).

Every ``FlatCakeConfig`` setting is a flag, as in the server.  ``overrides(args)``
returns the settings the user set, validated by ``FlatCakeConfig.from_mapping``
(a bad value raises ``ConfigError`` naming the flag) and typed.  In the replay the
byte budgets are full size, like ``--memory-gb``: ``memory_bytes``, ``ssd_bytes``
and ``extent_bytes`` are scaled with the blocks, ``prefetch_budget_bytes``
replaces ``--prefetch-budget-gb``, ``queue_aging`` sets the two-queue policy and
``single_queue`` makes head-only the FlatCake systems' own policy.  ``store_dir``
and ``ssd_path`` are refused: each replay writes a fresh store under ``--dir``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ..config import FlatCakeConfig, ModelledServerConfig
from ..errors import ConfigError

REFUSED = {"store_dir": "each replay writes a fresh store; use --dir",
           "ssd_path": "each replay writes a fresh store of session files; use --dir"}
SCALED = ("memory_bytes", "ssd_bytes", "extent_bytes")


def flag(name: str) -> str:
    return "--flatcake-" + name.replace("_", "-")


def add_flatcake_flags(parser) -> None:
    """One ``--flatcake-NAME`` per ``FlatCakeConfig`` field (default: not set)."""
    g = parser.add_argument_group("FlatCake settings for the flatcake systems (the server's "
                                  "--flatcake-* flags; byte sizes full size)")
    defaults = FlatCakeConfig()
    for f in fields(FlatCakeConfig):
        d = getattr(defaults, f.name)
        switch = {"nargs": "?", "const": "true"} if isinstance(d, bool) else {}
        g.add_argument(flag(f.name), dest="flatcake_" + f.name, default=None, metavar="V",
                       help=f"{f.metadata.get('help', '')} (default: {d!r})", **switch)


def overrides(args) -> dict[str, Any]:
    """The ``--flatcake-*`` settings given, typed; ``ConfigError`` for a bad or refused one."""
    given = {f.name: getattr(args, "flatcake_" + f.name) for f in fields(FlatCakeConfig)
             if getattr(args, "flatcake_" + f.name, None) is not None}
    for k in given:
        if k in REFUSED:
            raise ConfigError(f"{flag(k)}={given[k]!r} is not allowed in a replay: {REFUSED[k]}")
    cfg = ModelledServerConfig.from_mapping(given, prefix="--flatcake-")   # full-size sizes
    return {k: getattr(cfg, k) for k in given}


def format_value(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) \
        else str(v)


def as_flags(settings: dict[str, Any]) -> list[str]:
    """``{"shared_refcount": 3}`` -> ``["--flatcake-shared-refcount=3"]`` (in the given order)."""
    return [f"{flag(k)}={format_value(v)}" for k, v in settings.items()]
