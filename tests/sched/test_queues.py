"""FC-MAS policy core with a fake clock."""

import pytest

from sglang_flatcake.sched.queues import TwoQueuePolicy

GB = 10**9


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_deadline_is_arrival_plus_aging_times_own_restore_time():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=8 * GB, aging=0.5, restore_bytes_per_s=GB)
    c.t = 2.0
    q.arrive("large", 0, 4 * GB)
    q.arrive("small", 1, 1 * GB)
    assert q.deadline("large") == pytest.approx(2.0 + 0.5 * 4)
    assert q.deadline("small") == pytest.approx(2.0 + 0.5 * 1)
    assert q.start_prefetches(limit=1) == ["small"]       # small first: it hurts no one yet


def test_a_small_restore_overtakes_only_within_the_bound():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=100 * GB, aging=0.5, restore_bytes_per_s=GB,
                       depth=None)         # the order alone (the gate: test_queues_share)
    q.arrive("large", 0, 8 * GB)                          # deadline 4
    c.t = 3.0
    q.arrive("early", 1, GB)                              # deadline 3.5 < 4: may go first
    c.t = 3.8
    q.arrive("late", 2, GB)                               # deadline 4.3 > 4: may not
    assert [q.start_prefetches(limit=1)[0] for _ in range(3)] == ["early", "large", "late"]


def test_aging_zero_is_first_come_first_served():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=100 * GB, aging=0.0, depth=None)
    for i, (rid, size) in enumerate([("a", 9), ("b", 1), ("c", 5)]):
        c.t = float(i)
        q.arrive(rid, i, size * GB)
    assert q.start_prefetches() == ["a", "b", "c"]


def test_restore_rate_learns_from_finished_prefetches():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=100 * GB, restore_bytes_per_s=2 * GB)
    assert q.restore_s(4 * GB) == pytest.approx(2.0)
    q.arrive("x", 0, GB)
    q.start_prefetches()
    c.t = 2.0                                             # 1 GB took 2 s
    q.prefetch_done("x")
    assert q.restore_rate == pytest.approx((0.8 * 2 * GB + GB) / (0.8 + 2.0))
    with pytest.raises(KeyError):
        q.prefetch_done("x")                              # nothing in flight any more


def simulate(jobs, aging):
    """One restore stream, 1 GB/s; ``jobs`` = [(rid, arrival_s, bytes)] sorted by arrival.
    Returns ({rid: start_s}, policy)."""
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=10**15, aging=aging, restore_bytes_per_s=GB)
    size = {rid: b for rid, _, b in jobs}
    start, i, busy_until, running = {}, 0, 0.0, None
    while len(start) < len(jobs):
        next_arrival = jobs[i][1] if i < len(jobs) else float("inf")
        if running is not None and busy_until <= next_arrival:
            c.t = busy_until
            q.prefetch_done(running)
            q.pop_ready()
            running = None
        else:
            c.t = next_arrival
            q.arrive(jobs[i][0], i, jobs[i][2])
            i += 1
        if running is None:
            got = q.start_prefetches(limit=1)
            if got:
                running = got[0]
                start[running] = c.t
                busy_until = c.t + size[running] / GB
    return start, q


def long_run(seed=7, n=3000):
    """Overloaded (offered 1.05x the disk): small restores, and one 40 GB restore in the middle."""
    import random
    rng = random.Random(seed)
    jobs, t = [], 0.0
    for k in range(n):
        t += rng.expovariate(1.0)
        b = int(rng.uniform(0.1, 2.0) * GB) if k != n // 3 else 40 * GB
        jobs.append((f"r{k}", t, b))
    return jobs


def test_long_run_nobody_is_overtaken_past_its_bound():
    jobs = long_run()
    start, q = simulate(jobs, aging=0.5)
    arrival = {rid: t for rid, t, _ in jobs}
    size = {rid: b for rid, _, b in jobs}
    order = sorted(start, key=lambda r: (start[r], arrival[r]))
    pos = {rid: k for k, rid in enumerate(order)}
    for rid, t, b in jobs:
        bound = t + 0.5 * b / GB                       # its deadline
        # nobody that arrived after its deadline started before it
        later = [x for x, tx, _ in jobs if tx > bound and pos[x] < pos[rid]]
        assert later == [], (rid, later[:3])
    big = max(size, key=size.get)
    assert q.deadline(big) == pytest.approx(arrival[big] + 20.0)


def test_long_run_the_largest_finishes_within_its_bound():
    """The largest restore starts no later than first-come first-served would start it had it
    arrived at its deadline, so it finishes within that time plus its own restore."""
    jobs = long_run()
    size = {rid: b for rid, _, b in jobs}
    big = max(size, key=size.get)
    start, q = simulate(jobs, aging=0.5)
    due = q.deadline(big)
    shifted = sorted([(r, due if r == big else t, b) for r, t, b in jobs], key=lambda j: j[1])
    fcfs_start, _ = simulate(shifted, aging=0.0)
    assert start[big] <= fcfs_start[big] + 1e-6
    arrived = dict((r, t) for r, t, _ in jobs)[big]
    waited = start[big] - arrived
    fcfs_waited = simulate(jobs, aging=0.0)[0][big] - arrived
    assert waited > fcfs_waited            # it did give way to smaller ones (small first)


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


def test_bad_settings_refused():
    with pytest.raises(ValueError, match="budget_bytes"):
        TwoQueuePolicy(Clock(), budget_bytes=0)
    with pytest.raises(ValueError, match="aging=-1"):
        TwoQueuePolicy(Clock(), budget_bytes=GB, aging=-1)
    with pytest.raises(ValueError, match="restore_bytes_per_s"):
        TwoQueuePolicy(Clock(), budget_bytes=GB, restore_bytes_per_s=0)


def test_leaving_while_preparing_frees_the_place():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=10 * GB)
    q.arrive("a", 0, GB)
    q.arrive("b", 1, GB)
    q.leave("a")
    assert q.waiting()["preparing"] == 1 and q.start_prefetches() == ["b"]


def test_limit_caps_how_many_start_at_once():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=10 * GB, depth=None)
    for i, rid in enumerate("abc"):
        q.arrive(rid, i, GB)
    assert q.start_prefetches(limit=0) == []
    assert q.start_prefetches(limit=2) == ["a", "b"]       # ties: earlier arrival first
    assert q.requests["c"].state == "preparing"
    assert q.start_prefetches() == ["c"]


# -- one prefetch at a time (``TwoQueuePolicy.depth`` 1): a second restore beside one in
#    flight would only split the disk's bandwidth
def test_a_second_restore_waits_for_the_one_in_flight():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=100 * GB, restore_bytes_per_s=GB)
    q.arrive("a", 0, 4 * GB)
    q.arrive("b", 1, 4 * GB)
    assert q.start_prefetches() == ["a"]                # b would halve a's bandwidth
    c.t = 1.0
    assert q.start_prefetches() == []
    assert q.waiting() == {"ready": 0, "preparing": 1, "prefetching": 1}
    c.t = 4.0
    q.prefetch_done("a")
    assert q.start_prefetches() == ["b"]


def test_depth_two_hands_the_next_prefetch_over_while_one_runs_and_no_more():
    """The server's one worker runs its restores in turn: the second waits there, so the
    policy may hand it over early; the third stays open to overtaking."""
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=100 * GB, restore_bytes_per_s=GB, depth=2)
    for i, rid in enumerate("abc"):
        q.arrive(rid, i, 4 * GB)
    assert q.start_prefetches() == ["a", "b"]
    c.t = 0.5
    q.arrive("small", 3, GB)                            # deadline 1.0 s: overtakes c
    assert q.start_prefetches() == []
    q.prefetch_done("a")
    assert q.start_prefetches() == ["small"]
    q.prefetch_done("b")
    assert q.start_prefetches() == ["c"]


@pytest.mark.parametrize("depth", [0, -1, 1.5])
def test_a_bad_depth_is_refused_by_name(depth):
    with pytest.raises(ValueError, match=f"depth={depth!r} is not allowed"):
        TwoQueuePolicy(Clock(), budget_bytes=GB, depth=depth)


def test_a_declined_prefetch_frees_the_disk_for_the_next():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=100 * GB, restore_bytes_per_s=GB)
    q.arrive("big", 0, 8 * GB)
    q.arrive("small", 1, GB)                            # deadline 1.5 s < 4 s: goes first
    assert q.start_prefetches() == ["small"]
    q.declined("small")
    assert q.start_prefetches() == ["big"]


def test_off_restores_share_the_disk_whenever_budget_allows():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=100 * GB, restore_bytes_per_s=GB, depth=None)
    q.arrive("a", 0, 4 * GB)
    q.arrive("b", 1, 4 * GB)
    assert q.start_prefetches() == ["a", "b"]
