"""FC-MAS policy core with a fake clock."""

import pytest

from sglang_flatcake.queues import TwoQueuePolicy

GB = 10**9


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_seed_example_priorities():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=8 * GB)
    q.arrive("small", 0, 1 * GB)
    q.arrive("large", 1, 4 * GB)
    c.t = 2.0
    assert q.priority("small") == pytest.approx(3.0)
    assert q.priority("large") == pytest.approx(1.5)


def test_memory_hits_are_ready_at_once_and_ssd_requests_prepare():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=GB)
    assert q.arrive("ssd", 0, 5 * GB) == "preparing"
    assert q.arrive("mem", 1, 0) == "ready"
    assert q.pop_ready() == "mem"          # not stuck behind the SSD restore
    assert q.pop_ready() is None


def test_single_queue_makes_the_memory_hit_wait():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=GB, single_queue=True)
    q.arrive("ssd", 0, 5 * GB)
    q.arrive("mem", 1, 0)
    assert q.pop_ready() is None           # head of line is still preparing
    assert q.start_prefetches() == ["ssd"]
    q.prefetch_done("ssd")
    assert [q.pop_ready(), q.pop_ready()] == ["ssd", "mem"]


def test_reentry_at_original_arrival_position():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=10 * GB)
    q.arrive("a", 0, 2 * GB)
    q.arrive("b", 1, 0)
    q.arrive("c", 2, 0)
    assert q.start_prefetches() == ["a"]
    q.prefetch_done("a")
    assert [q.pop_ready() for _ in range(3)] == ["a", "b", "c"]   # a goes first: it came first


def test_full_window_waits_instead_of_cancelling():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=3 * GB)
    q.arrive("x", 0, 2 * GB)
    q.arrive("y", 1, 2 * GB)
    assert q.start_prefetches() == ["x"]
    assert q.start_prefetches() == []                # y does not fit: it waits ...
    assert q.requests["y"].state == "preparing"      # ... and is not cancelled
    assert q.requests["x"].state == "prefetching"
    q.prefetch_done("x")
    assert q.start_prefetches() == ["y"]


def test_a_request_larger_than_the_budget_still_runs_alone():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=GB)
    q.arrive("huge", 0, 50 * GB)
    assert q.start_prefetches() == ["huge"]


def test_no_starvation_of_a_large_request():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=4 * GB)
    q.arrive("blocker", 0, 4 * GB)
    assert q.start_prefetches() == ["blocker"]
    q.arrive("large", 1, 4 * GB)
    seq, started_at = 2, None
    q.arrive("s2", 2, GB)
    seq, started_at = 3, None
    for step in range(1, 50):                  # every second: the window frees, a small arrives
        c.t = float(step)
        for rid in list(q._inflight):
            q.prefetch_done(rid)
            q.pop_ready()
        if "large" in q.start_prefetches():
            started_at = step
            break
        q.arrive(f"s{seq}", seq, GB)
        seq += 1
    assert started_at is not None, "the large request must not starve"
    # a small request that waited 1 s (priority 2) goes first while the large one's
    # priority 1 + t/4 is lower; at t = 4 they tie and the earlier arrival (large) wins
    assert started_at == 4


def test_bad_budget_refused():
    with pytest.raises(ValueError, match="budget_bytes"):
        TwoQueuePolicy(Clock(), budget_bytes=0)


def test_limit_caps_how_many_start_at_once():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=10 * GB)
    for i, rid in enumerate("abc"):
        q.arrive(rid, i, GB)
    assert q.start_prefetches(limit=0) == []
    assert q.start_prefetches(limit=2) == ["a", "b"]       # ties: earlier arrival first
    assert q.requests["c"].state == "preparing"
    assert q.start_prefetches() == ["c"]
