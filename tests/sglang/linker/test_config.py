"""The linker's settings: ``linker_extra_config`` names, ``--flatcake-*`` flags on top."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sglang_flatcake.errors import ConfigError
from sglang_flatcake.sglang.linker.config import linker_config, take_linker_flags

SELECT = {"linker": "FlatCakeLinker", "linker_module_path": "sglang_flatcake.sglang.linker"}


def test_every_setting_is_accepted_under_the_hicache_extra_config_names():
    cfg = linker_config({"memory_bytes": "2MiB", "flatcake_high_watermark": "0.95",
                         "low-watermark": 0.5, "durable": "off"})
    assert (cfg.memory_bytes, cfg.high_watermark, cfg.low_watermark, cfg.durable) == \
        (2 << 20, 0.95, 0.5, False)


def test_flags_win_over_the_extra_config():
    cfg = linker_config({"memory_bytes": "1MiB", "high_watermark": 1.7},
                        {"memory_bytes": "3MiB", "high_watermark": "0.95"})
    assert cfg.memory_bytes == 3 << 20 and cfg.high_watermark == 0.95


@pytest.mark.parametrize("extra, flags, start", [
    ({"high_watermark": 1.7}, {}, "linker_extra_config.high_watermark=1.7 is not allowed"),
    ({"memory_bytes": "lots"}, {}, "linker_extra_config.memory_bytes: expected a byte size"),
    ({}, {"high_watermark": "1.7"}, "--flatcake-high-watermark=1.7 is not allowed"),
    ({"store_dri": "/x"}, {}, "linker_extra_config.store_dri='/x' is not allowed: unknown"),
])
def test_a_bad_value_is_one_line_naming_where_it_came_from(extra, flags, start):
    with pytest.raises(ConfigError) as e:
        linker_config(extra, flags)
    assert str(e.value).startswith(start), str(e.value)
    assert "\n" not in str(e.value)


def args(config, enabled=True, backend="dynamic"):
    return SimpleNamespace(enable_unified_cache_external_linker=enabled,
                           unified_cache_external_linker_backend=backend,
                           unified_cache_external_linker_config=config)


def test_the_launcher_merges_the_flags_into_the_linker_config(tmp_path):
    a = args(json.dumps({**SELECT, "linker_extra_config": {"store_dir": str(tmp_path),
                                                           "memory_bytes": "1MiB"}}))
    assert take_linker_flags(a, {"memory_bytes": "5MiB"}) == {}
    extra = json.loads(a.unified_cache_external_linker_config)["linker_extra_config"]
    assert extra == {"store_dir": str(tmp_path), "memory_bytes": "5MiB"}
    # a dict (already parsed JSON) stays a dict
    b = args({**SELECT, "linker_extra_config": {"store_dir": str(tmp_path)}})
    assert take_linker_flags(b, {}) == {} and isinstance(b.unified_cache_external_linker_config,
                                                         dict)


def test_other_linkers_leave_the_flags_to_hicache_mode(tmp_path):
    other = args(json.dumps({"linker": "X", "linker_module_path": "m"}))
    assert take_linker_flags(other, {"memory_bytes": "1"}) == {"memory_bytes": "1"}
    off = args(json.dumps(SELECT), enabled=False)
    assert take_linker_flags(off, {"memory_bytes": "1"}) == {"memory_bytes": "1"}


def test_an_unwritable_store_dir_stops_the_launch(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    a = args(json.dumps({**SELECT, "linker_extra_config": {"store_dir": str(blocker / "s")}}))
    with pytest.raises(ConfigError, match="cannot be written"):
        take_linker_flags(a, {})
