"""Trace loaders: Mooncake JSON lines, WEKA session files, the vendored slice, arrivals."""

from __future__ import annotations

import io
import json
import lzma
import tarfile

import pytest

from sglang_flatcake.replay.run import bundled_trace
from sglang_flatcake.replay.loaders import load_trace
from sglang_flatcake.replay.traces import TraceError, arrivals

MOONCAKE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 50, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 700, "output_length": 80, "hash_ids": [0, 7]},
    # continues request 0: its chain (all but the last, partial block) is a prefix
    {"timestamp": 2000, "input_length": 2000, "output_length": 10, "hash_ids": [0, 1, 2, 3]},
    {"timestamp": 3000, "input_length": 600, "output_length": 10, "hash_ids": [0, 9]},
]


def write_lines(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


def session(sid, reqs):
    return {"id": sid, "block_size": 64, "hash_id_scope": "local", "requests": reqs}


def r(t, inp, out, ids):
    return {"t": t, "type": "n", "in": inp, "out": out, "hash_ids": ids}


def test_mooncake_links_conversations_and_keys(tmp_path):
    tr = load_trace(write_lines(tmp_path / "m.jsonl", MOONCAKE))
    assert tr.format == "mooncake" and tr.block_tokens == 512 and tr.n_sessions == 3
    a, b, c, d = tr.requests
    assert (c.parent, c.turn, c.prev_out, c.conv) == (0, 1, 50, a.conv)
    assert b.parent is None and d.parent is None and b.conv != a.conv
    assert [x.t for x in tr.requests] == [0.0, 0.5, 2.0, 3.0]
    assert tr.keys(a)[:3] == tr.keys(c)[:3] and tr.keys(a)[0] == tr.keys(b)[0]
    assert len(set(tr.keys(c))) == 4 and all(len(k) == 64 for k in tr.keys(c))
    assert load_trace(tmp_path / "m.jsonl", block_tokens=256).block_tokens == 256


def test_mooncake_xz_and_arrival_scaling(tmp_path):
    p = tmp_path / "m.jsonl.xz"
    with lzma.open(p, "wt") as f:
        f.write("".join(json.dumps(x) + "\n" for x in MOONCAKE))
    tr = load_trace(p)
    t = arrivals(tr, 2.0)
    assert t[0] == 0 and t[-1] == pytest.approx((len(MOONCAKE) - 1) / 2.0)
    assert t[1] / t[-1] == pytest.approx(0.5 / 3.0)


@pytest.mark.parametrize("bad, expect", [
    ({"timestamp": 1, "input_length": 5, "hash_ids": [1]}, "'output_length'"),
    ({"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": "x"}, "'hash_ids'"),
    ({"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}, "'timestamp'"),
])
def test_mooncake_bad_record_names_file_and_line(tmp_path, bad, expect):
    p = write_lines(tmp_path / "m.jsonl", MOONCAKE[:2] + [bad] + MOONCAKE[2:])
    with pytest.raises(TraceError, match=rf"m\.jsonl:3: .*{expect}"):
        load_trace(p)


def test_mooncake_truncated_line_and_stream(tmp_path):
    p = write_lines(tmp_path / "m.jsonl", MOONCAKE, tail='{"timestamp": 9, "input_le')
    with pytest.raises(TraceError, match=r"m\.jsonl:5: not valid JSON.*truncated"):
        load_trace(p)
    raw = lzma.compress("".join(json.dumps(x) + "\n" for x in MOONCAKE * 200).encode())
    q = tmp_path / "cut.jsonl.xz"
    q.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(TraceError, match=r"cut\.jsonl\.xz:\d+: compressed stream is truncated"):
        load_trace(q)


def weka_folder(tmp_path):
    d = tmp_path / "weka"
    d.mkdir()
    sub = {"t": 30.0, "type": "subagent", "agent_id": "agent_001",
           "requests": [r(0.0, 200, 5, [50, 51]), r(4.0, 300, 5, [50, 51, 52])]}
    (d / "trace_0001.json").write_text(json.dumps(session("trace_0001", [
        r(0.0, 200, 100, [1, 2, 3]), r(20.0, 400, 7, [1, 2, 3, 4, 5]), sub,
        r(40.0, 500, 9, [1, 2, 3, 4, 5, 6])])))
    (d / "trace_0002.json").write_text(json.dumps(session("trace_0002", [
        r(0.0, 150, 3, [1, 2]), r(5.0, 200, 3, [1, 2, 3])])))
    return d


def test_weka_sessions_subagents_and_scopes(tmp_path):
    tr = load_trace(weka_folder(tmp_path))
    assert tr.format == "weka" and tr.block_tokens == 64 and tr.n_sessions == 2
    s1 = [x for x in tr.requests if x.session == 0]
    assert [x.t for x in s1] == [0.0, 20.0, 30.0, 34.0, 40.0]
    main = [x for x in s1 if x.conv == s1[0].conv]
    agent = [x for x in s1 if x.conv != s1[0].conv]
    assert [x.turn for x in main] == [0, 1, 2] and [x.prev_out for x in main] == [0, 100, 7]
    assert [x.turn for x in agent] == [0, 1] and agent[1].parent == agent[0].rid
    s2 = [x for x in tr.requests if x.session == 1]
    # hash id 1 of each file is a different block: ids are local to a session
    assert tr.keys(s1[0])[0] != tr.keys(s2[0])[0]
    assert tr.unique_blocks() == 6 + 3 + 3


def test_weka_tar_xz_and_truncated_archive(tmp_path):
    d = weka_folder(tmp_path)
    p = tmp_path / "w.tar.xz"
    with tarfile.open(p, "w:xz") as tar:
        tar.add(d, arcname="weka")
    assert len(load_trace(p).requests) == 7
    raw = p.read_bytes()
    (tmp_path / "cut.tar.xz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(TraceError, match=r"cut\.tar\.xz:\d+: archive is truncated or corrupt"):
        load_trace(tmp_path / "cut.tar.xz")


def test_weka_bad_record_names_line(tmp_path):
    doc = session("t", [r(0.0, 10, 1, [1]), {"t": 3.0, "type": "n", "out": 1, "hash_ids": [1, 2]}])
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc, indent=2))
    line = json.dumps(doc, indent=2).splitlines().index('    {', 10) + 1
    with pytest.raises(TraceError, match=rf"t\.json:{line}: requests\[1\]: field 'in'"):
        load_trace(p)
    p.write_text(json.dumps(doc, indent=2)[:-30])
    with pytest.raises(TraceError, match=r"t\.json:\d+: not valid JSON"):
        load_trace(p)


def test_vendored_slice_and_attribution():
    p = bundled_trace()
    assert p.stat().st_size < 1 << 20
    attr = (p.parent / "ATTRIBUTION").read_text()
    assert "WEKA kv-cache-tester traces: Copyright WEKA, Apache License 2.0" in attr
    tr = load_trace(p)
    assert tr.format == "weka" and tr.block_tokens == 64 and tr.n_sessions >= 20
    convs_per_session = {}
    for x in tr.requests:
        convs_per_session.setdefault(x.session, set()).add(x.conv)
    assert max(len(c) for c in convs_per_session.values()) > 1      # sub-agents are in
    with tarfile.open(p) as tar:
        names = [m.name.rsplit("/", 1)[-1][:-5] for m in tar.getmembers() if m.isfile()]
    for n in names:
        assert n in attr, f"{n} missing from ATTRIBUTION"


def test_weka_arrivals_stagger_and_compress(tmp_path):
    tr = load_trace(weka_folder(tmp_path))
    slow = arrivals(tr, 0.01)           # 5 requests before session 2: it starts at 500 s
    assert slow[5] == pytest.approx(500.0) and slow[1] == pytest.approx(20.0)
    fast = arrivals(tr, 1.0)            # 7 requests must span 7 s: everything shrinks
    assert max(fast) == pytest.approx(7.0)
    assert fast[1] / fast[4] == pytest.approx(20.0 / 40.0)


def test_select_sessions_is_seeded(tmp_path):
    tr = load_trace(bundled_trace())
    a, b = tr.select_sessions(5, seed=3), tr.select_sessions(5, seed=3)
    assert a.n_sessions == 5 and [x.hash_ids for x in a.requests] == [x.hash_ids for x in b.requests]
    assert {x.session for x in a.requests} == set(range(5))
    assert all(x.parent is None or a.requests[x.parent].conv == x.conv for x in a.requests)
    assert [x.hash_ids for x in tr.select_sessions(5, seed=4).requests] != \
        [x.hash_ids for x in a.requests]
