import pytest

from sglang_flatcake.config import FlatCakeConfig, parse_bytes
from sglang_flatcake.errors import ConfigError


def test_defaults_follow_the_design():
    c = FlatCakeConfig()
    assert c.merge_gap_bytes == 64 << 10
    assert c.alignment == 4096
    assert c.window_layers == 2
    assert c.low_watermark < c.high_watermark


@pytest.mark.parametrize("field,value,needle", [
    ("high_watermark", 1.5, "high_watermark"),
    ("low_watermark", 0.95, "low_watermark"),
    ("alignment", 3000, "power of two"),
    ("io_engine", "spdk", "one of auto"),
    ("window_layers", 1, "window_layers"),
    ("node_id", 4096, "0..4095"),
    ("shared_refcount", 1, "shared_refcount"),
    ("extent_bytes", 5000, "multiple of alignment"),
    ("on_layout_mismatch", "ignore", "refuse, reset"),
    ("short_reply_tokens", -1, "short_reply_tokens"),
    ("cluster_directory", "http://h:1", "redis://HOST:PORT"),
    ("cluster_directory", "redis://h", "redis://HOST:PORT"),
    ("cluster_directory", "redis://h:1/x", "redis://HOST:PORT/DB"),
    ("cluster_bind", "0.0.0.0", "not 0.0.0.0"),
    ("cluster_bind", "node1.local", "IP address"),
    ("remote_timeout_s", 0, "0 < seconds <= 60"),
    ("remote_timeout_s", float("nan"), "0 < seconds <= 60"),
])
def test_bad_values_are_refused_by_name(field, value, needle):
    with pytest.raises(ConfigError) as e:
        FlatCakeConfig(**{field: value})
    assert field in str(e.value) and needle in str(e.value)


def test_from_mapping_parses_strings_and_sizes():
    c = FlatCakeConfig.from_mapping({"memory-bytes": "2GiB", "flatcake_high_watermark": "0.95",
                                     "durable": "false", "io_threads": "8"})
    assert c.memory_bytes == 2 << 30 and c.high_watermark == 0.95
    assert c.durable is False and c.io_threads == 8


def test_from_mapping_names_the_flag():
    with pytest.raises(ConfigError, match="--flatcake-high-watermark"):
        FlatCakeConfig.from_mapping({"high_watermark": "2"}, prefix="--flatcake-")
    with pytest.raises(ConfigError, match="unknown setting 'bogus'"):
        FlatCakeConfig.from_mapping({"bogus": 1})
    with pytest.raises(ConfigError, match="memory-bytes"):
        FlatCakeConfig.from_mapping({"memory_bytes": "lots"}, prefix="--flatcake-")


def test_cluster_is_off_by_default_and_its_flags_parse():
    c = FlatCakeConfig()
    assert c.cluster_directory == "" and c.cluster_bind == "127.0.0.1" and c.remote_timeout_s == 1.0
    c = FlatCakeConfig.from_mapping({"cluster-directory": "redis://10.0.0.5:6379/2",
                                     "cluster-bind": "10.0.0.7", "remote-timeout-s": "0.25"})
    assert c.cluster_directory == "redis://10.0.0.5:6379/2" and c.remote_timeout_s == 0.25
    with pytest.raises(ConfigError, match="--flatcake-cluster-directory='redis:/h:1'"):
        FlatCakeConfig.from_mapping({"cluster_directory": "redis:/h:1"}, prefix="--flatcake-")
    with pytest.raises(ConfigError, match="--flatcake-remote-timeout-s='soon'"):
        FlatCakeConfig.from_mapping({"remote_timeout_s": "soon"}, prefix="--flatcake-")


def test_parse_bytes():
    assert parse_bytes("64KiB") == 65536
    assert parse_bytes("1.5GiB") == 3 << 29
    assert parse_bytes(10) == 10
    with pytest.raises(ConfigError):
        parse_bytes("12 parsecs")
