"""The ``flatcake`` command as a user runs it: inspect (and --verify), bench-restore."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from tests.support import blocks_for, chain, extend
from sglang_flatcake.placement import WriteSignals
from sglang_flatcake.store import FlatCakeStore


def flatcake(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_flatcake", *args],
                          capture_output=True, text=True, timeout=300)


def make_store(path, layout, config):
    a = chain(5, "one")
    b = extend(a[:2], 3, "two")
    with FlatCakeStore(path, layout, config) as st:
        st.put(a, blocks_for(layout, a), signals=WriteSignals(turn=0))
        st.put(b, blocks_for(layout, b), prefix_keys=a[:2], signals=WriteSignals(turn=0))
        sid = st.put(extend(a, 2, "t"), blocks_for(layout, extend(a, 2, "t")), prefix_keys=a,
                     signals=WriteSignals(turn=1, prev_reply_tokens=10**6)).session
        seg = st.sessions[sid].segments[0]
        return st.ssd.path(sid), seg.offset + seg.geometry.block_offset(0, 1)


def test_inspect_reports_sessions_and_verify_finds_damage(tmp_path, layout, config):
    path, pos = make_store(tmp_path, layout, config)
    r = flatcake("inspect", str(tmp_path), "--json", "--verify")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["totals"]["sessions"] == 2 and info["totals"]["segments"] == 3
    assert info["totals"]["blocks_ssd"] == 10
    assert [s["parent"] for s in info["sessions"]] == [None, 1]
    assert info["verify"]["damaged_segments"] == []
    table = flatcake("inspect", str(tmp_path))
    assert table.returncode == 0 and "below low watermark" in table.stdout
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(b"\xde\xad")
    r = flatcake("inspect", str(tmp_path), "--verify")
    assert r.returncode == 1
    assert "DAMAGED: session 1 segment 0" in r.stdout


def test_inspect_on_a_missing_store_is_a_clear_error(tmp_path):
    r = flatcake("inspect", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "cannot read" in r.stderr


def test_bench_restore_prints_the_json_fields(tmp_path):
    out = tmp_path / "r.json"
    r = flatcake("bench-restore", "--size-gib", "0.02", "--layers", "4", "--turns", "3",
                 "--dir", str(tmp_path / "b"), "--json", str(out), "--no-sglang")
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert json.loads(r.stdout.strip().splitlines()[-1]) == res
    for k in ("flatcake_gib_s", "raw_gib_s", "sglang_file_gib_s", "read_commands", "layers",
              "turns", "bytes"):
        assert k in res
    assert res["sglang_file_gib_s"] is None
    assert res["flatcake_gib_s"] > 0 and res["raw_gib_s"] > 0
    assert res["read_commands"] <= res["layers"] * res["turns"]
    assert "wrote turn 3/3" in r.stderr


def test_bench_restore_compares_media_and_engines_in_one_run(tmp_path):
    from sglang_flatcake.io import uring
    engines = "posix" if uring.unavailable_reason() else "posix,io_uring"
    region = tmp_path / "region.bin"
    out = tmp_path / "r.json"
    r = flatcake("bench-restore", "--size-gib", "0.02", "--layers", "4", "--turns", "3",
                 "--repeat", "1", "--io-engine", engines, "--ssd-path", str(region),
                 "--dir", str(tmp_path / "b"), "--json", str(out), "--no-sglang")
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    combos = [(x["medium"], x["io_engine"]) for x in res["runs"]]
    want = [(m, e) for m in ("dir", "region") for e in engines.split(",")]
    assert combos == want
    for x in res["runs"]:
        assert x["flatcake_gib_s"] > 0 and x["raw_gib_s"] > 0 and x["read_commands"] <= 4 * 3
        ratio = x["flatcake_gib_s"] / x["raw_gib_s"]
        assert abs(x["flatcake_vs_raw"] - ratio) < 2e-3 * ratio
    assert not region.exists(), "the region file the benchmark created is removed"


def test_inspect_on_a_store_dir_root_names_and_inspects_each_store(tmp_path, layout, config):
    """``--flatcake-store-dir`` holds ``<model>/<rank>`` stores; given the root, name them."""
    a = tmp_path / "_models_tiny-a" / "tp0of1"
    b = tmp_path / "_models_tiny-b" / "tp0of1"
    make_store(a, layout, config)
    make_store(b, layout, config)
    r = flatcake("inspect", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "cannot read" not in r.stdout + r.stderr
    assert f"{tmp_path} is a --flatcake-store-dir root holding 2 stores" in r.stdout
    assert f"  {a}\n  {b}\n" in r.stdout
    assert r.stdout.count("store ") >= 2 and r.stdout.count("below low watermark") == 2
    j = flatcake("inspect", str(tmp_path), "--json", "--verify")
    assert j.returncode == 0, j.stderr
    doc = json.loads(j.stdout)
    assert [s["root"] for s in doc["stores"]] == [str(a), str(b)]
    assert all(s["totals"]["sessions"] == 2 and s["verify"]["damaged_segments"] == []
               for s in doc["stores"])


def test_inspect_on_a_folder_with_no_store_says_where_stores_would_be(tmp_path):
    (tmp_path / "empty").mkdir()
    r = flatcake("inspect", str(tmp_path / "empty"))
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"flatcake: error: {tmp_path / 'empty'}: no flatcake store here")
    assert "ROOT/<model>/<rank>/flatcake.json" in line


def test_inspect_into_a_closed_pipe_ends_quietly(tmp_path, layout, config):
    """``flatcake inspect DIR | head``: the reader left; no traceback, exit 141 as a shell's."""
    make_store(tmp_path / "s", layout, config)
    code = ("import os, sys\n"
            "r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
            "from sglang_flatcake.commands.cli import main\n"
            f"sys.exit(main(['inspect', {str(tmp_path / 's')!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 141, r.stderr
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
