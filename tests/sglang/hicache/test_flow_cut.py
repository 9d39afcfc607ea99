"""A restore flow cut to fewer pages (the restore-or-recompute decision, or the ranks agreeing
on a shorter span) keeps exactly the leading part of its remote tail, or none of it."""

from sglang_flatcake.cluster.span import RemoteSpan
from sglang_flatcake.sglang.hicache.direct import Flow


def flow_with_remote(local: int, remote: RemoteSpan, page: int = 4) -> Flow:
    keys = [f"l{i}" for i in range(local)] + list(remote.keys)
    return Flow("r", None, list(range(len(keys) * page)), keys, 0, 0, 0, remote=remote)


def test_first_clips_runs_to_the_kept_keys():
    span = RemoteSpan("t", ("a", "b", "c", "d", "e"), (("n1", 0, 2), ("n2", 2, 3)))
    assert span.first(5) is span and span.first(9) is span
    assert span.first(0) is None and span.first(-1) is None
    assert span.first(1) == RemoteSpan("t", ("a",), (("n1", 0, 1),))
    assert span.first(3) == RemoteSpan("t", ("a", "b", "c"), (("n1", 0, 2), ("n2", 2, 1)))


def test_cut_into_the_remote_tail_keeps_its_head():
    f = flow_with_remote(2, RemoteSpan("t", ("a", "b", "c"), (("n1", 0, 3),)))
    f.cut(4, 4)
    assert f.keys == ["l0", "l1", "a", "b"] and len(f.key) == 16
    assert f.remote == RemoteSpan("t", ("a", "b"), (("n1", 0, 2),))
    assert tuple(f.keys[len(f.keys) - len(f.remote.keys):]) == f.remote.keys


def test_cut_to_the_local_run_drops_the_remote_tail():
    f = flow_with_remote(2, RemoteSpan("t", ("a", "b"), (("n1", 0, 2),)))
    f.cut(2, 4)
    assert f.keys == ["l0", "l1"] and f.remote is None
    g = flow_with_remote(0, RemoteSpan("t", ("a",), (("n1", 0, 1),)))
    g.cut(0, 4)
    assert g.keys == [] and g.remote is None
