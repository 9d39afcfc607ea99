"""The per-request timeline (``sglang/timeline.py``): the writer, the ``timeline`` mode's hooks
on stand-in scheduler objects, and that nothing of it runs when the flag is off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from types import SimpleNamespace as NS

from sglang_flatcake.sglang import hook_table, timeline
from tests.support import ROOT


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_marks_are_whole_json_lines_from_many_threads(tmp_path):
    t = iter(range(10 ** 6))
    w = timeline.Timeline(str(tmp_path / "t.jsonl"), clock=lambda: float(next(t)))

    def burst(k):
        for i in range(200):
            w.mark(f"r{k}", "lookup", i=i, pad="x" * 300)
    threads = [threading.Thread(target=burst, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    w.close()
    got = lines(tmp_path / "t.jsonl")
    assert len(got) == 800
    assert {e["rid"] for e in got} == {"r0", "r1", "r2", "r3"}
    assert all(e["ev"] == "lookup" and e["pid"] == os.getpid() for e in got)
    assert sorted(e["i"] for e in got if e["rid"] == "r2") == list(range(200))


def test_prompt_hash_depends_on_the_ids_only():
    assert timeline.prompt_hash([1, 2, 3]) == timeline.prompt_hash((1, 2, 3))
    assert timeline.prompt_hash([1, 2, 3]) != timeline.prompt_hash([1, 2, 4])
    assert timeline.prompt_hash([12, 3]) != timeline.prompt_hash([1, 23])


def _extend(reqs, tokens=64):
    return NS(reqs=reqs, forward_mode=NS(is_extend=lambda: True), extend_num_tokens=tokens)


def test_hooks_mark_arrival_first_forward_and_first_token_once(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    monkeypatch.setattr(timeline, "_writer", timeline.Timeline(str(path)))
    sched = NS(waiting_queue=[1, 2])
    timeline._arrival_before(sched, NS(rid="a", input_ids=[5, 6, 7]))
    req = NS(rid="a", prefix_len=16, output_ids=[])
    batch = _extend([req])
    timeline._run_batch_before(sched, batch, None)
    timeline._result_after("R", sched, batch, None)        # a chunk: no token yet
    timeline._run_batch_before(sched, batch, None)         # its next chunk: not a first forward
    req.output_ids = [9]
    assert timeline._result_after("R", sched, batch, None) == "R"
    decode = NS(reqs=[req], forward_mode=NS(is_extend=lambda: False))
    timeline._run_batch_before(sched, decode, None)
    timeline._result_after("R", sched, decode, None)
    got = lines(path)
    assert [e["ev"] for e in got] == ["arrival", "forward", "first_token"]
    assert got[0]["prompt"] == timeline.prompt_hash([5, 6, 7]) and got[0]["tokens"] == 3
    assert got[0]["waiting"] == 2
    assert got[1]["prefix"] == 16 and got[1]["batch"] == 1 and got[1]["batch_tokens"] == 64
    assert got[0]["t"] <= got[1]["t"] <= got[2]["t"]


def test_a_decision_carries_its_prices_and_inputs(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    monkeypatch.setattr(timeline, "_writer", timeline.Timeline(str(path)))
    decider = NS(prefill=NS(value=5000.0), restore=NS(value=2e8, latency=0.004),
                 slip=NS(value=1.2), marginal=NS(per_token=lambda: 9e-6))
    choice = NS(restore_s=0.05, recompute_s=0.02)
    timeline.decision("a", choice, decider, "arrival", False, gpu_backlog_tokens=300)
    (e,) = lines(path)
    assert e["ev"] == "decision" and e["at"] == "arrival" and e["restore"] is False
    assert e["prefill_tokens_per_s"] == 5000.0 and e["restore_bytes_per_s"] == 2e8
    assert e["restore_latency_s"] == 0.004 and e["restore_slip"] == 1.2
    assert e["prefill_marginal_s_per_token"] == 9e-6
    assert e["restore_s"] == 0.05 and e["recompute_s"] == 0.02 and e["gpu_backlog_tokens"] == 300


def test_off_by_default_no_hook_and_no_file(tmp_path):
    """Without the flag no mode registers a timeline hook and ``ON`` is False."""
    assert all(h.mode == "timeline" for h in hook_table.HOOKS if "timeline:" in h.handler)
    assert not [h for h in hook_table.hooks_of(("cli", "hicache", "linker", "cpu"))
                if "timeline:" in h.handler]
    env = {k: v for k, v in os.environ.items() if k != timeline.TIMELINE_ENV}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", "from sglang_flatcake.sglang import timeline;"
                          "print(timeline.ON, timeline._writer)"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "None"] and not list(tmp_path.iterdir())


def test_the_flag_turns_it_on_for_the_processes_started_after(tmp_path, monkeypatch):
    monkeypatch.delenv(timeline.TIMELINE_ENV, raising=False)
    monkeypatch.setattr(timeline, "ON", False)
    timeline.enable(str(tmp_path / "t.jsonl"))
    assert timeline.ON and os.environ[timeline.TIMELINE_ENV] == str(tmp_path / "t.jsonl")
    out = subprocess.run([sys.executable, "-c", "from sglang_flatcake.sglang import timeline;"
                          "print(timeline.ON)"], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "True"
