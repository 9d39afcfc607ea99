"""``flatcake demo``'s host-memory columns and its ``mooncake-linker`` row: what SGLang's log
and flatcake's gauges say becomes bytes, and a backend that cannot run is a row with its
reason, not a gap."""

from __future__ import annotations

import json

import pytest

from sglang_flatcake.commands import cli, demo
from sglang_flatcake.commands.demo_memory import host_pool, memory_fields
from sglang_flatcake.commands.demo_report import closing_sentence, print_table
from sglang_flatcake.commands.peers import BACKENDS, linker_flags, mooncake_linker_unsupported

LOG = ("[x] KV Cache is allocated. dtype: torch.float32, #tokens: 16384, K size: 0.00 GB\n"
       "[x] Allocating kv hierarchical KV host pool: 20496 tokens, 0.01 GB host memory.\n")


def tiny_model_dir(tmp_path, layers=2, kv_heads=2, head_dim=16):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": layers, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_attention_heads": 4, "hidden_size": 64}))
    return str(tmp_path)


def test_host_pool_bytes_come_from_sglangs_log_line_and_the_model_shape(tmp_path):
    model = tiny_model_dir(tmp_path)
    assert host_pool(LOG, model) == {"tokens": 20496, "bytes": 20496 * 2 * 2 * 2 * 16 * 4}
    # no config to read: the GB SGLang logged
    assert host_pool(LOG, str(tmp_path / "absent")) == {"tokens": 20496, "bytes": 10_000_000}
    # linker mode and none: SGLang allocates no host pool
    assert host_pool(LOG.splitlines()[0], model) == {"tokens": 0, "bytes": 0}


def test_row_memory_is_the_host_pool_plus_the_backends_own(tmp_path):
    model = tiny_model_dir(tmp_path)
    gauges = {"flatcake_bytes_memory": 2293760.0, "flatcake_memory_capacity": 4.0 * 2**30,
              "flatcake_memory_pinned": 0.0}
    hicache = memory_fields("flatcake", LOG, model, gauges, 512 << 20)
    assert hicache["host_pool_bytes"] == 20496 * 512
    assert hicache["backend_host_bytes"] == 2293760
    assert hicache["host_memory_bytes"] == 20496 * 512 + 2293760
    assert hicache["backend_host_reserved_bytes"] == 0          # not pinned: not committed
    linker = memory_fields("flatcake-linker", "no pool line", model, gauges, 512 << 20)
    assert linker["host_pool_bytes"] == 0 and linker["host_memory_bytes"] == 2293760
    pinned = memory_fields("flatcake-linker", "", model, {**gauges, "flatcake_memory_pinned": 1.0},
                           0)
    assert pinned["backend_host_reserved_bytes"] == 4 * 2**30
    mooncake = memory_fields("mooncake", LOG, model, {}, 512 << 20)
    assert mooncake["host_memory_bytes"] == 20496 * 512 + (512 << 20)
    assert memory_fields("none", "", model, {}, 512 << 20)["host_memory_bytes"] == 0


def test_the_mooncake_linker_row_says_why_it_cannot_serve_a_llama():
    assert "flatcake-linker" in BACKENDS and "mooncake-linker" in BACKENDS
    why = mooncake_linker_unsupported("0.5.23")
    assert "0.5.23" in why and "Llama-style" in why and "resolve_hybrid_device_pool_group" in why
    assert mooncake_linker_unsupported("0.6.0") is None


def test_linker_flags_select_flatcakes_linker_with_sglangs_own_flags():
    flags = linker_flags("/s", {"memory_bytes": "1GiB"})
    assert flags[:3] == ["--enable-unified-cache-external-linker",
                         "--unified-cache-external-linker-backend", "dynamic"]
    cfg = json.loads(flags[4])
    assert cfg["linker"] == "FlatCakeLinker"
    assert cfg["linker_module_path"] == "sglang_flatcake.sglang.linker"
    assert cfg["linker_extra_config"] == {"store_dir": "/s", "memory_bytes": "1GiB"}


def test_server_args_for_the_linker_has_no_host_pool(tmp_path):
    args = cli._parse(["demo", "--compare"])
    out = demo.server_args_for(args, "flatcake-linker", "m", tmp_path / "s")
    assert "--enable-unified-cache-external-linker" in out
    assert "--enable-hierarchical-cache" not in out and "--hicache-ratio" not in out
    assert "--enable-metrics" in out
    hi = demo.server_args_for(args, "flatcake", "m", tmp_path / "s")
    assert "--enable-hierarchical-cache" in hi and "--enable-unified-cache-external-linker" not in hi


def test_single_demo_backend_flag_is_checked():
    assert cli._parse(["demo"]).backend == demo.DEFAULT_BACKEND
    assert cli._parse(["demo", "--backend", "flatcake-linker"]).backend == "flatcake-linker"
    with pytest.raises(SystemExit):
        cli._parse(["demo", "--backend", "mooncake"])


ROW = {"backend": "flatcake", "requests_sent": 4, "requests_served": 4, "output_tokens": 64,
       "device_tokens": 10, "host_tokens": 20, "storage_tokens": 30, "restored_tokens": 50,
       "backup_tokens": 40, "ttft_s_mean": 0.5, "ttft_s_p99": 0.9, "wall_s": 3.0,
       "host_pool_bytes": 10 << 20, "backend_host_bytes": 1 << 20, "host_memory_bytes": 11 << 20}


def test_table_and_sentence_show_host_memory_and_the_row_not_run(capsys):
    linker = {**ROW, "backend": "flatcake-linker", "host_tokens": 60, "storage_tokens": 0,
              "restored_tokens": 60, "host_pool_bytes": 0, "host_memory_bytes": 1 << 20}
    rows = [ROW, linker, {"backend": "mooncake-linker", "not_run": "cannot, because"}]
    print_table(rows)
    out = capsys.readouterr().out
    assert "host MiB" in out and "11.0" in out and "1.0" in out
    assert "mooncake-linker  not run: cannot, because" in out
    s = closing_sentence(rows, 2, 2, [])
    assert "Each of 2 backends" in s and "flatcake 50, flatcake-linker 60" in s
    assert "host memory: flatcake 11.0 MiB, flatcake-linker 1.0 MiB" in s
    assert s.endswith("mooncake-linker: not run (cannot, because).")
    one = closing_sentence([linker], 2, 2, [])
    assert "60 prompt tokens came back from flatcake (linker, no host pool)" in one
