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


# -- absurd values: one line each, naming the value -------------------------------------------

PIB = 1 << 50


@pytest.mark.parametrize("field,value,needle", [
    ("memory_bytes", PIB, "256TiB"),
    ("ssd_bytes", PIB, "48-bit"),
    ("merge_gap_bytes", PIB, "0..64MiB"),
    ("alignment", 1 << 30, "512..1MiB"),
    ("window_layers", 10**6, "2..256"),
    ("high_watermark", True, "a number, not a bool"),
    ("low_watermark", False, "a number, not a bool"),
    ("queue_aging", True, "a number, not a bool"),
    ("remote_timeout_s", True, "a number, not a bool"),
    ("io_threads", True, "an integer, not a bool"),
    ("memory_bytes", 4.0 * (1 << 30), "an integer"),
    ("ssd_path", ["/dev/nvme0n1"], "a string, not list"),
    ("store_dir", b"/srv/flatcake", "a string, not bytes"),
    ("io_engine", ("posix",), "a string, not tuple"),
    ("queue_aging", float("inf"), "a number >= 0"),
])
def test_absurd_values_are_refused_in_one_line(field, value, needle):
    with pytest.raises(ConfigError) as e:
        FlatCakeConfig(**{field: value})
    msg = str(e.value)
    assert msg.startswith(f"{field}={value!r} is not allowed: expected ") and needle in msg
    assert "\n" not in msg


def test_memory_beyond_this_machine_is_refused_but_a_modelled_server_may_have_it():
    from sglang_flatcake.config import ModelledServerConfig
    from sglang_flatcake.config_check import machine_memory_bytes
    have = machine_memory_bytes()
    assert have is not None and have > 0                       # Linux: /proc-backed sysconf
    too_much = (have // 4096 + 1) * 4096
    with pytest.raises(ConfigError, match=rf"memory_bytes={too_much} is not allowed: expected "
                                          r"at most this machine's memory"):
        FlatCakeConfig(memory_bytes=too_much)
    assert FlatCakeConfig(memory_bytes=min(have, 1 << 30)).memory_bytes == min(have, 1 << 30)
    assert ModelledServerConfig(memory_bytes=too_much).memory_bytes == too_much
    with pytest.raises(ConfigError, match="256TiB"):          # the address still bounds it
        ModelledServerConfig(memory_bytes=PIB)
    with pytest.raises(ConfigError, match=r"--flatcake-memory-bytes=1125899906842624 is not"):
        FlatCakeConfig.from_mapping({"memory_bytes": "1PiB"}, prefix="--flatcake-")


def test_from_mapping_refuses_json_types_that_do_not_fit():
    # JSON true for a number was float(True) == 1.0: a watermark of 100 %
    for key, value in (("high_watermark", True), ("io_threads", True), ("ssd_path", True)):
        with pytest.raises(ConfigError, match=rf"--flatcake-{key.replace('_', '-')}=True is "
                                              "not allowed"):
            FlatCakeConfig.from_mapping({key: value}, prefix="--flatcake-")
    with pytest.raises(ConfigError, match=r"--flatcake-ssd-path=\['/dev/a', '/dev/b'\] is not "
                                          r"allowed: expected a string, not list"):
        FlatCakeConfig.from_mapping({"ssd_path": ["/dev/a", "/dev/b"]}, prefix="--flatcake-")
    with pytest.raises(ConfigError, match="cluster_bind=\\['10.0.0.1'\\]"):
        FlatCakeConfig.from_mapping({"cluster_bind": ["10.0.0.1"]})
    with pytest.raises(ConfigError, match="expected a mapping"):
        FlatCakeConfig.from_mapping("high_watermark=0.9")
    with pytest.raises(ConfigError, match="--flatcake-io-threads='many'"):
        FlatCakeConfig.from_mapping({"io_threads": "many"}, prefix="--flatcake-")
    with pytest.raises(ConfigError, match="whole number of bytes"):
        FlatCakeConfig.from_mapping({"merge_gap_bytes": "0.5"})
    from pathlib import Path
    assert FlatCakeConfig.from_mapping({"store_dir": Path("/srv/fc")}).store_dir == "/srv/fc"
    assert FlatCakeConfig.from_mapping({"high_watermark": 1}).high_watermark == 1


# -- one part per consumer, composed into the one flat config ---------------------------------

OLD_FLAT_NAMES = (
    "short_reply_tokens agent_context_tokens shared_refcount memory_bytes ssd_bytes "
    "high_watermark low_watermark merge_gap_bytes alignment window_layers io_engine io_threads "
    "extent_bytes node_id durable verify_reads on_layout_mismatch single_queue "
    "prefetch_budget_bytes queue_aging recompute_when_faster ssd_path ssd_force start_empty "
    "checkpoint_interval store_dir cluster_directory cluster_bind remote_timeout_s").split()


def test_every_flat_setting_is_in_exactly_one_part_and_reads_the_same():
    from dataclasses import fields
    from sglang_flatcake.config_groups import GROUPS
    cfg = FlatCakeConfig(short_reply_tokens=7, memory_bytes=1 << 20, merge_gap_bytes=8192,
                         queue_aging=0.25, node_id=9)
    flat = [f.name for f in fields(FlatCakeConfig)]
    parts = [f.name for cls in GROUPS.values() for f in fields(cls)]
    assert flat == parts                                        # in GROUPS order, no duplicates
    assert set(OLD_FLAT_NAMES) <= set(flat)                     # no consumer has to change
    for name, cls in GROUPS.items():
        part = getattr(cfg, name)
        assert type(part) is cls and isinstance(cfg, cls)
        for f in fields(cls):
            assert getattr(part, f.name) == getattr(cfg, f.name)
    assert cfg.placement.short_reply_tokens == 7 and cfg.media.memory_bytes == 1 << 20
    assert cfg.io.merge_gap_bytes == 8192 and cfg.sched.queue_aging == 0.25
    assert cfg.cluster.node_id == 9 and cfg.io is cfg.io     # built once
    assert FlatCakeConfig.from_parts(cfg.placement, cfg.media, cfg.io, cfg.sched,
                                     cfg.cluster) == cfg


def test_parts_validate_alone_and_compose():
    from sglang_flatcake.config import IOConfig, MediaConfig, PlacementConfig, SchedConfig
    with pytest.raises(ConfigError, match="shared_refcount=1"):
        PlacementConfig(shared_refcount=1)
    with pytest.raises(ConfigError, match="low_watermark=0.5.*high_watermark=0.4"):
        MediaConfig(high_watermark=0.4, low_watermark=0.5)
    with pytest.raises(ConfigError, match="prefetch_budget_bytes=0"):
        SchedConfig(prefetch_budget_bytes=0)
    cfg = FlatCakeConfig.from_parts(PlacementConfig(shared_refcount=3), IOConfig(io_threads=2),
                                    durable=False)
    assert (cfg.shared_refcount, cfg.io_threads, cfg.durable) == (3, 2, False)
    assert cfg.ssd_bytes == FlatCakeConfig().ssd_bytes
    # a rule between parts is the composite's: each part alone accepts its side
    assert MediaConfig(extent_bytes=6 << 10).extent_bytes == 6 << 10
    with pytest.raises(ConfigError, match="extent_bytes=6144.*multiple of alignment"):
        FlatCakeConfig.from_parts(MediaConfig(extent_bytes=6 << 10), IOConfig(alignment=4096))
    with pytest.raises(ConfigError, match="part="):
        FlatCakeConfig.from_parts(cfg)
    with pytest.raises(AttributeError):
        cfg.io.io_threads = 8                                   # frozen


def test_two_parts_cannot_declare_the_same_setting():
    from dataclasses import dataclass
    from sglang_flatcake import config as config_mod
    from sglang_flatcake.config_check import setting

    @dataclass(frozen=True)
    class Secrets:
        node_id: int = setting(1, "clashes with ClusterConfig.node_id")

    with pytest.raises(TypeError, match="'node_id' is in both cluster and secrets"):
        config_mod._names_are_disjoint({**config_mod.GROUPS, "secrets": Secrets})


def test_the_replay_models_a_server_bigger_than_this_machine():
    from types import SimpleNamespace

    from sglang_flatcake.config_check import machine_memory_bytes
    from sglang_flatcake.replay.flags import overrides
    big = 4 * machine_memory_bytes()
    assert overrides(SimpleNamespace(flatcake_memory_bytes=str(big))) == {"memory_bytes": big}
    with pytest.raises(ConfigError, match="--flatcake-memory-bytes=1125899906842624 is not"):
        overrides(SimpleNamespace(flatcake_memory_bytes="1PiB"))
    with pytest.raises(ConfigError, match="this machine's memory"):
        FlatCakeConfig.from_mapping({"memory_bytes": str(big)})
