"""Every threshold of the design, validated once.

``FlatCakeConfig`` is the one config the ``--flatcake-*`` flags (and the flatcake keys of
``--hicache-storage-backend-extra-config``) fill: frozen, flat (``cfg.high_watermark``), and
composed of one part per consumer (``config_groups``), each also given whole as
``cfg.placement``, ``cfg.media``, ``cfg.io``, ``cfg.sched`` and ``cfg.cluster``.  Build it
with keyword arguments or with ``FlatCakeConfig.from_mapping`` (strings such as ``4GiB`` and
``off`` accepted).  A bad value raises ``ConfigError``, one line naming the setting, the value
and what is allowed; so does a size beyond this machine or the 48-bit block address.

``python -m sglang_flatcake.config_doc --markdown`` prints docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, fields
from typing import Any, Mapping

from .config_check import (check_directory_url, check_ip, format_bytes,  # noqa: F401 - API
                           machine_memory_bytes, parse_bool, parse_bytes, parse_value, refuse)
from .config_groups import (GROUPS, IO_ENGINES, ON_MISMATCH, ClusterConfig,  # noqa: F401 - API
                            IOConfig, MediaConfig, PlacementConfig, SchedConfig)
from .errors import ConfigError


def default_store_dir() -> str:
    """Where a store lives when no directory is given: the user's cache directory
    (``$XDG_CACHE_HOME`` or ``~/.cache``), not a predictable name others can create first."""
    import os
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sglang-flatcake")


def setting_name(key: Any) -> str:
    """The setting a key names: ``-`` read as ``_``, a ``flatcake_`` prefix dropped."""
    key = str(key).replace("-", "_")
    return key[len("flatcake_"):] if key.startswith("flatcake_") else key


def _names_are_disjoint(groups: Mapping[str, type]) -> None:
    """``TypeError`` if two parts declare one setting (the flat config would keep only one)."""
    seen: dict[str, str] = {}
    for group, cls in groups.items():
        for f in fields(cls):
            if f.name in seen:
                raise TypeError(f"setting {f.name!r} is in both {seen[f.name]} and {group}")
            seen[f.name] = group


_names_are_disjoint(GROUPS)


# Bases are listed last group first: a dataclass takes its bases' fields in reverse order, so
# the fields (and the flags, and the docs) come in GROUPS order: placement, media, io, ...
@dataclass(frozen=True)
class FlatCakeConfig(ClusterConfig, SchedConfig, IOConfig, MediaConfig, PlacementConfig):
    """The store's settings, every consumer's part in one flat frozen config; each field's
    ``help`` metadata is its flag help.  It is an instance of each part's class, so a
    consumer that takes a ``PlacementConfig`` also takes the whole config."""

    def __post_init__(self) -> None:
        self.check()
        self.check_machine()

    def check(self) -> None:
        """Each part's checks (``GROUPS`` order), then the rules between parts; ``ConfigError``."""
        for cls in GROUPS.values():
            cls.check(self)
        self.check_across()

    def check_across(self) -> None:
        """Rules between parts: an extent is a whole number of aligned I/O units."""
        if self.extent_bytes % self.alignment:
            raise refuse("extent_bytes", self.extent_bytes,
                         f"a multiple of alignment ({self.alignment})")

    def check_machine(self) -> None:
        """Sizes this machine can hold: the arena (allocated at start) fits in its memory."""
        have = machine_memory_bytes()
        if have is not None and self.memory_bytes > have:
            raise refuse("memory_bytes", self.memory_bytes,
                         f"at most this machine's memory ({have / (1 << 30):.1f}GiB): "
                         "the arena is allocated at start")

    @functools.cached_property
    def placement(self) -> PlacementConfig:
        return _part(PlacementConfig, self)

    @functools.cached_property
    def media(self) -> MediaConfig:
        return _part(MediaConfig, self)

    @functools.cached_property
    def io(self) -> IOConfig:
        return _part(IOConfig, self)

    @functools.cached_property
    def sched(self) -> SchedConfig:
        return _part(SchedConfig, self)

    @functools.cached_property
    def cluster(self) -> ClusterConfig:
        return _part(ClusterConfig, self)

    @classmethod
    def from_parts(cls, *parts: Any, **overrides: Any) -> "FlatCakeConfig":
        """Compose parts (e.g. ``PlacementConfig(...)``, ``IOConfig(...)``); the parts not
        given take their defaults; ``overrides`` win."""
        values: dict[str, Any] = {}
        for p in parts:
            if type(p) not in GROUPS.values():
                raise ConfigError(f"part={p!r} is not allowed: expected one of "
                                  f"{', '.join(c.__name__ for c in GROUPS.values())}")
            values.update(dataclasses.asdict(p))
        return cls(**{**values, **overrides})

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], prefix: str = "") -> "FlatCakeConfig":
        """Build from a mapping of strings or typed values.

        Unknown keys raise ``ConfigError`` listing the known ones; ``prefix`` is
        prepended to names in messages (e.g. ``--flatcake-``).
        """
        if not isinstance(values, Mapping):
            raise ConfigError(f"settings={values!r} is not allowed: expected a mapping of "
                              "setting names to values")
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for raw_key, value in values.items():
            key = setting_name(raw_key)
            if key not in known:
                raise ConfigError(
                    f"unknown setting {raw_key!r}; known: {', '.join(sorted(known))}")
            label = prefix + key.replace("_", "-") if prefix else key
            kwargs[key] = parse_value(known[key], value, label)
        try:
            return cls(**kwargs)
        except ConfigError as e:
            name, eq, rest = str(e).partition("=")
            if prefix and eq:                   # "name=value is not allowed: ..."
                raise ConfigError(prefix + name.replace("_", "-") + "=" + rest) from None
            raise

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ModelledServerConfig(FlatCakeConfig):
    """The settings of a server that is modelled, not run here (``flatcake replay`` and
    ``tune``, whose sizes are full size and scaled later): every check but this machine's
    memory."""

    def check_machine(self) -> None:
        """No check: the modelled server's memory is not this machine's."""


def _part(cls: type, whole: FlatCakeConfig) -> Any:
    return cls(**{f.name: getattr(whole, f.name) for f in fields(cls)})
