"""Scheduler policies inside the replayer: FC-MAS two queues against one FCFS queue.

A fake system with scripted restore sizes keeps timing exact: a restore of b
bytes takes b / 1 GB/s, a prefill takes input_tokens / 1000 s.
"""

from __future__ import annotations

import pytest

from sglang_flatcake.replay.clock import EventLoop
from sglang_flatcake.replay.policy import FCFS, POLICIES, TwoQueue, make_policy
from sglang_flatcake.replay.replayer import Replayer
from sglang_flatcake.replay.sizes import GpuPreset
from sglang_flatcake.replay.systems import SYSTEMS
from sglang_flatcake.replay.systems.base import System
from sglang_flatcake.replay.traces import Request, Trace

GB = 1e9
GPU = GpuPreset("test", 1000.0, 1.0, "1000 tokens/s")


class Scripted(System):
    """Request i needs ``ssd_gb[i]`` GB from SSD (0: all in memory); reads at 1 GB/s."""

    name = "scripted"

    def __init__(self, ssd_gb: dict[int, float], slots: int | None = None) -> None:
        super().__init__()
        self.ssd_gb, self.restore_slots = ssd_gb, slots
        self.started: list[int] = []

    def lookup(self, rs) -> None:
        rs.restore_bytes = self.ssd_gb.get(rs.req.rid, 0.0) * GB
        rs.needs_restore = rs.restore_bytes > 0

    def start_restore(self, rs, done) -> None:
        loop = self.loop
        rs.prefetch_start = loop.now
        self.started.append(rs.req.rid)

        def end() -> None:
            rs.prefetch_end = loop.now
            done(rs)
        loop.after(rs.restore_bytes / GB, end)

    def begin_prefill(self, rs) -> None:
        rs.delivered = 0

    def write(self, rs, signals) -> None:
        pass


def run(policy, ssd_gb, times, tokens, slots=None):
    """Replay independent one-turn requests at ``times``; returns (states, system)."""
    reqs = tuple(Request(i, i, i, "s", t, tokens[i], 1, (i,), 0, 0, None, "t:1")
                 for i, t in enumerate(times))
    trace = Trace("scripted", "weka", 64, reqs, len(reqs))
    loop, system = EventLoop(), Scripted(ssd_gb, slots)
    system.loop = loop                     # the fake system needs only the clock
    states = Replayer(trace, list(times), system, policy, GPU, loop).run()
    return states, system


def order(states):
    return [s.req.rid for s in sorted(states, key=lambda s: s.prefill_start)]


@pytest.mark.parametrize("policy", ["fcfs", "two-queue"])
def test_memory_hit_behind_a_large_restore(policy):
    # 0 reads 4 GB (4 s); 1 arrives 0.1 s later with everything in memory
    st, _ = run(make_policy(policy), {0: 4.0}, [0.0, 0.1], [100, 100])
    if policy == "two-queue":
        assert order(st) == [1, 0]
        assert st[1].prefill_start == pytest.approx(0.1)           # at once: not behind 0
        assert st[1].first_token - st[1].arrival == pytest.approx(0.1)
    else:
        assert order(st) == [0, 1]
        assert st[1].prefill_start == pytest.approx(st[0].first_token)   # head-of-line blocked
        assert st[1].first_token - st[1].arrival > 3.9


def test_restored_request_reenters_at_its_arrival_position():
    # 0 keeps the GPU busy until 5 s; 1 (SSD, 2 s) is ready at 3 s, after 2 and 3 arrived
    st, _ = run(TwoQueue(), {1: 2.0}, [0.0, 1.0, 1.5, 2.0], [5000, 100, 100, 100])
    assert st[1].ready_at == pytest.approx(3.0) and st[2].ready_at < st[1].ready_at
    assert order(st) == [0, 1, 2, 3]                               # not [0, 2, 3, 1]


@pytest.mark.parametrize("policy,first", [("two-queue", 2), ("fcfs", 1)])
def test_smaller_restore_starts_first_when_a_stream_frees(policy, first):
    # one stream, busy with 0 until 1 s; 1 (4 GB) and 2 (1 GB) wait since 0.1 s and 0.2 s
    _, sys_ = run(make_policy(policy), {0: 1.0, 1: 4.0, 2: 1.0}, [0.0, 0.1, 0.2], [10] * 3, slots=1)
    assert sys_.started[:2] == [0, first]


@pytest.mark.parametrize("policy", ["fcfs", "two-queue"])
def test_full_budget_makes_a_restore_wait_not_drop(policy):
    # budget 3 GB: 1 (2 GB) waits for 0 (2 GB) to finish though streams are free
    st, sys_ = run(make_policy(policy, budget_bytes=3 * GB), {0: 2.0, 1: 2.0}, [0.0, 0.1], [10, 10])
    assert st[1].prefetch_start == pytest.approx(2.0)
    assert sys_.started == [0, 1] and all(s.first_token is not None for s in st)


def test_a_restore_over_the_whole_budget_runs_alone():
    st, _ = run(make_policy("fcfs", budget_bytes=GB), {0: 3.0, 1: 1.0}, [0.0, 0.1], [10, 10])
    assert st[0].prefetch_start == 0.0 and st[1].prefetch_start == pytest.approx(3.0)


def test_systems_pick_their_policy_and_bad_names_are_refused():
    assert SYSTEMS["flatcake"].policy == "two-queue"
    assert SYSTEMS["flatcake-single-queue"].policy == "head-only"
    assert all(SYSTEMS[s].policy == "fcfs" for s in ("tiered-lru", "mooncake-fifo", "memory-only"))
    assert set(POLICIES) == {"fcfs", "two-queue", "head-only"}
    assert isinstance(make_policy("fcfs"), FCFS)
    with pytest.raises(ValueError, match="valid: fcfs, two-queue, head-only"):
        make_policy("lifo")


@pytest.mark.parametrize("policy,start", [("fcfs", 0.1), ("head-only", 2.0)])
def test_head_only_restores_nothing_in_the_background(policy, start):
    # 1 (1 GB) arrives while 0 (2 GB) restores: FCFS reads it at once, head-only once 0 has left
    st, _ = run(make_policy(policy), {0: 2.0, 1: 1.0, 2: 0.0}, [0.0, 0.1, 0.2], [100] * 3)
    assert st[1].prefetch_start == pytest.approx(start)
    assert order(st) == [0, 1, 2]                      # both keep arrival order for prefills


# -- restore or recompute (replay.recompute over sched.recompute) ----------------------------
class Declinable(Scripted):
    """``Scripted`` whose requests are all on SSD (those ``ssd_gb`` names) in blocks of 64
    tokens; restores really take bytes / 1 GB/s, the decision assumes ``rate`` (None: no
    decision) over the restores in flight plus its own; a request that was not restored
    recomputes every token."""

    def __init__(self, ssd_gb, rate, slots=None):
        super().__init__(ssd_gb, slots)
        self.rate = rate
        self.declined: list[int] = []
        self.in_flight = 0.0

    def lookup(self, rs) -> None:
        super().lookup(rs)
        rs.n_found = len(rs.req.hash_ids) if rs.needs_restore else 0
        rs.lead_memory = 0 if rs.needs_restore else None

    def start_restore(self, rs, done) -> None:
        self.in_flight += rs.restore_bytes

        def end(rs):
            self.in_flight -= rs.restore_bytes
            done(rs)
        super().start_restore(rs, end)

    def restore_rate(self):
        return self.rate

    def restore_end_s(self, full_bytes):
        return (self.in_flight + full_bytes) / self.rate

    def decline_restore(self, rs) -> None:
        rs.needs_restore, rs.restore_bytes = False, 0.0
        self.declined.append(rs.req.rid)

    def begin_prefill(self, rs) -> None:
        rs.delivered = rs.n_found if rs.prefetch_end is not None else 0


def blocks_run(policy, ssd_gb, times, blocks, rate, slots=None, extra=0):
    """Like ``run``, request i holding ``blocks[i]`` blocks of 64 tokens and ``extra`` more
    tokens to prefill; returns (states, system, the replayer's decision)."""
    reqs = tuple(Request(i, i, i, "s", t, 64 * b + extra, 1, tuple(range(100 * i, 100 * i + b)),
                         0, 0, None, "t:1") for i, (t, b) in enumerate(zip(times, blocks)))
    trace = Trace("scripted", "weka", 64, reqs, len(reqs))
    loop, system = EventLoop(), Declinable(ssd_gb, rate, slots)
    system.loop = loop
    rp = Replayer(trace, list(times), system, make_policy(policy), GPU, loop)
    return rp.run(), system, rp.decision


@pytest.mark.parametrize("policy", ["fcfs", "two-queue", "head-only"])
def test_recompute_does_nothing_when_restores_are_faster(policy):
    # 1,024 tokens recompute in 1.024 s; their 0.1 GB restores take 0.1 s, three 0.3 s
    args = (policy, {0: 0.1, 1: 0.1, 2: 0.1}, [0.0, 0.05, 0.1], [16, 16, 16])
    on, sys_on, decision = blocks_run(*args, rate=GB)
    off, sys_off, none = blocks_run(*args, rate=None)
    assert none is None and decision.decider.counts["restored_requests"] == 3
    assert sys_on.declined == [] and all(s.recomputed_tokens == 0 for s in on)
    assert sys_on.started == sys_off.started == [0, 1, 2]
    assert [(s.prefetch_end, s.first_token) for s in on] == \
        [(s.prefetch_end, s.first_token) for s in off]


@pytest.mark.parametrize("policy", ["fcfs", "two-queue", "head-only"])
def test_a_restore_slower_than_recomputing_is_declined(policy):
    # 2 GB restore (2 s) against 1,024 tokens recomputed (1.024 s)
    st, sys_, decision = blocks_run(policy, {0: 2.0}, [0.0], [16], rate=GB)
    assert sys_.declined == [0] and sys_.started == []
    assert st[0].recomputed_tokens == 1024 and st[0].prefetch_start is None
    assert st[0].first_token == pytest.approx(1.024)
    assert decision.decider.counts["ssd_bytes_not_read"] == 2 * GB


def test_the_disk_queue_ahead_makes_a_fast_restore_recompute():
    # 0.8 GB restores (0.8 s) against 1.024 s of recompute: the first restores, the second
    # would end behind it (1.6 s) and recomputes; head-only compares their own work only
    st, sys_, _ = blocks_run("two-queue", {0: 0.8, 1: 0.8}, [0.0, 0.0], [16, 16], rate=GB)
    assert sys_.started == [0] and sys_.declined == [1]
    assert st[1].recomputed_tokens == 1024
    _, head, _ = blocks_run("head-only", {0: 0.8, 1: 0.8}, [0.0, 0.0], [16, 16], rate=GB)
    assert head.started == [0, 1] and head.declined == []


def test_a_restore_that_waited_is_checked_again_when_it_starts():
    # one stream; the decision assumes 3 GB/s, the disk gives 1.  A (memory only) prefills
    # 2.048 s; 1 (3 GB) restores; 2 (2 GB, 512 tokens) restores too, as 2.048 s of prefill are
    # ahead.  When the stream frees at 3 s nothing is ahead on the GPU: 2 recomputes instead.
    st, sys_, decision = blocks_run("two-queue", {1: 3.0, 2: 2.0}, [0.0, 0.0, 0.0],
                                    [32, 64, 8], rate=3 * GB, slots=1)
    assert sys_.started == [1] and sys_.declined == [2]
    assert st[2].recomputed_tokens == 512 and st[2].prefill_start == pytest.approx(3.0)
    c = decision.decider.counts
    assert c["reconsidered_requests"] == 1 and c["restored_requests"] == 1
    assert decision.decider.slip.value > 1          # 1's restore took 3x what it modelled


def test_head_only_times_its_slip_from_the_restore_start():
    """Under head-only a request waits to be the head either way: that wait is no slip."""
    # each request: 0.1 GB restore (0.1 s) or 1.024 s of recompute, then 2 s of prefill; the
    # 4th reaches the head at 6.1 s, 6 s after its decision; the 5th decides at 7 s
    times = [0.0, 0.0, 0.0, 0.0, 7.0]
    st, sys_, decision = blocks_run("head-only", {i: 0.1 for i in range(5)}, times, [16] * 5,
                                    rate=GB, extra=2000)
    assert sys_.declined == [] and sys_.started == [0, 1, 2, 3, 4]
    assert decision.decider.slip.value == pytest.approx(1.0)
