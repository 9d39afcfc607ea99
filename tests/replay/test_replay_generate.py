"""The seeded agent-trace generator: same seed same trace, loadable as one conversation a session."""

from __future__ import annotations

import pytest

from sglang_flatcake.replay.generate import AgentSpec, generate, main, write
from sglang_flatcake.replay.loaders import load_trace


def test_same_seed_same_records_other_seed_other_records():
    a, b, c = (generate(AgentSpec(sessions=4, seed=s)) for s in (3, 3, 4))
    assert a == b and a != c


def test_the_loader_links_each_session_into_one_growing_conversation(tmp_path):
    spec = AgentSpec(sessions=5, seed=1, max_turns=12)
    rows = generate(spec)
    path = tmp_path / "agent.jsonl"
    write(rows, path)
    tr = load_trace(path, "mooncake", spec.block_tokens)
    assert len(tr.requests) == len(rows) and tr.n_sessions <= 5
    assert [r.t for r in tr.requests] == sorted(r.t for r in tr.requests)
    by_conv: dict = {}
    for r in tr.requests:
        by_conv.setdefault(r.conv, []).append(r)
    assert len(by_conv) == tr.n_sessions
    for turns in by_conv.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for a, b in zip(turns, turns[1:]):
            assert b.input_tokens > a.input_tokens + a.output_tokens - 1   # context only grows
            assert b.parent == a.rid and b.prev_out == a.output_tokens
            full = a.input_tokens // spec.block_tokens
            assert b.hash_ids[:full] == a.hash_ids[:full]
        assert all(r.input_tokens <= spec.max_context for r in turns)
    # every session opens with the same shared prefix blocks
    shared = spec.shared_prefix_tokens // spec.block_tokens
    heads = {r.hash_ids[:shared] for r in tr.requests if r.turn == 0}
    assert len(heads) == 1


@pytest.mark.parametrize("kw", [{"sessions": 0}, {"block_tokens": 0}, {"session_gap_s": 0.0}])
def test_a_bad_spec_names_the_value(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        AgentSpec(**kw)


def test_the_cli_prints_one_json_line_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["--sessions", "2", "--seed", "5", "--out", str(out)]) == 0
    assert out.read_text().count("\n") == len(generate(AgentSpec(sessions=2, seed=5)))
    assert '"requests"' in capsys.readouterr().out
    assert main(["--sessions", "0", "--out", str(out)]) == 2
    assert "sessions=0" in capsys.readouterr().err
