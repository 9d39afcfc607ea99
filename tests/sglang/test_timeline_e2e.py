"""A real CPU server with ``--flatcake-timeline``: the file appears and holds each request's
stages in order (arrival, lookup, restore, publish, first forward, first token), and
``benchmarks/timeline_diff.py`` lines the stored and the restored request up by prompt."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("sglang.srt.server_args")
pytest.importorskip("transformers")

from sglang_flatcake.commands.server import ServerProcess, cpu_server_args  # noqa: E402
from sglang_flatcake.commands.server_calls import (backup_tokens, cached_tokens,  # noqa: E402
                                                   flush, generate, prompt_ids)
from sglang_flatcake.commands.tiny_model import build_tiny_llama  # noqa: E402
from tests.support import ROOT  # noqa: E402

pytestmark = pytest.mark.e2e
PAGE = 16


def events(path):
    out: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        e = json.loads(line)
        out.setdefault(e["rid"], []).append(e)
    return out


def test_the_server_writes_each_stage_of_a_restored_request(tmp_path):
    model = str(build_tiny_llama(tmp_path / "tiny-llama"))
    tl = tmp_path / "timeline.jsonl"
    args = cpu_server_args(model, str(tmp_path / "store"), PAGE, max_total_tokens=4096,
                           extra=["--enable-metrics", "--flatcake-timeline", str(tl)])
    ids = prompt_ids(40 * PAGE, seed=3)
    with ServerProcess(args, log_path=str(tmp_path / "s.log")) as s:
        assert tl.exists()                         # the warm-up request was timed already
        generate(s, ids)
        assert backup_tokens(s) > 0
        flush(s)
        before = len(tl.read_text().splitlines())
        second = generate(s, ids)
    assert cached_tokens(second, "storage") > 0
    lines = tl.read_text().splitlines()
    ev = events(tl)
    rid = second["meta_info"]["id"]
    names = [e["ev"] for e in ev[rid]]
    for want in ("arrival", "lookup", "picked", "restore_start", "restore_end", "published",
                 "forward", "first_token"):
        assert want in names, names
    t = {e["ev"]: e["t"] for e in ev[rid]}
    assert t["arrival"] <= t["lookup"] <= t["restore_start"] <= t["published"] <= t["forward"] \
        <= t["first_token"]
    fwd = next(e for e in ev[rid] if e["ev"] == "forward")
    assert fwd["prefix"] >= cached_tokens(second, "storage")
    # the first request of the same prompt (before the flush): no restore, same prompt hash
    first = [r for r, es in ev.items() if r != rid and any(
        e["ev"] == "arrival" and e["tokens"] == len(ids) for e in es)]
    assert len(first) == 1 and "restore_start" not in [e["ev"] for e in ev[first[0]]]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:before]) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join(lines[before:]) + "\n")
    spec = importlib.util.spec_from_file_location("timeline_diff",
                                                  ROOT / "benchmarks" / "timeline_diff.py")
    diff = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diff)
    r = diff.compare(tmp_path / "a.jsonl", tmp_path / "b.jsonl")
    assert r["matched"] == 1
    assert "restore_start->restore_end" in {x["stage"] for x in r["all"]["stages"]}
