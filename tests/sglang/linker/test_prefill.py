"""``PrefillClock`` (``sglang/linker/prefill.py``): the linker's prefill rate, the tokens a
ticked step launched over that step's own seconds (SGLang's step starts from
``num_completed_offloads``, its processed-tokens counter from ``calc_priority``)."""

from __future__ import annotations

from sglang_flatcake.sched.rates import Rate
from sglang_flatcake.sglang.linker.prefill import PrefillClock


def clocked():
    t = [0.0]
    rate = Rate()
    return PrefillClock(rate, clock=lambda: t[0]), rate, t


def steps(pc, t, *at):
    for x in at:
        t[0] = x
        pc.step()


def test_the_launching_step_is_timed_not_the_idle_and_decode_steps_after_it():
    """An idle server: one request arrives, its step ticks and launches 3,000 tokens in 0.06 s;
    decode steps and seconds of idling follow; the next arrival's tick closes the sample.
    (The clock before divided by the 4 s between the ticks: 750 tokens/s.)"""
    pc, rate, t = clocked()
    steps(pc, t, 0.0)
    pc.tick(0, 1)                          # the step that launches the prefill
    steps(pc, t, 0.06, 0.07, 0.08, 0.09)   # decode steps: no calc_priority
    steps(pc, t, 4.0)                      # much later: a new request
    pc.tick(3000, 1)
    assert rate.samples == 1 and abs(rate.value - 3000 / 0.06) < 1e-6


def test_with_overlap_the_longer_of_the_step_and_the_next_counts():
    """SGLang's overlap schedule: a batch's forward ends in the step after its launch."""
    pc, rate, t = clocked()
    steps(pc, t, 0.0)
    pc.tick(0, 1)
    steps(pc, t, 0.01, 0.09)               # launch 10 ms, the next step waits 80 ms for it
    pc.tick(800, 1)
    assert rate.samples == 1 and abs(rate.value - 800 / 0.08) < 1e-6


def test_consecutive_busy_steps_each_give_their_own_sample():
    pc, rate, t = clocked()
    steps(pc, t, 0.0)
    pc.tick(0, 3)
    steps(pc, t, 0.5)
    pc.tick(1000, 2)                       # 1,000 tokens launched in the 0.5 s step
    assert rate.samples == 1 and abs(rate.value - 2000.0) < 1e-6
    steps(pc, t, 0.6)
    pc.tick(1000, 1)                       # that step launched nothing: no sample
    assert rate.samples == 1


def test_a_step_that_started_a_restore_or_a_long_one_is_not_a_sample():
    pc, rate, t = clocked()
    steps(pc, t, 0.0)
    pc.tick(0, 1)
    pc.loading()                           # its batch restores: time not prefill alone
    steps(pc, t, 0.3)
    pc.tick(1000, 1)
    assert rate.samples == 0
    steps(pc, t, 10.0)                     # longer than MAX_GAP_S (2 s)
    pc.tick(2000, 1)
    assert rate.samples == 0 and rate.value is None
    steps(pc, t, 10.1)
    pc.tick(2100, 1)
    assert rate.samples == 1 and abs(rate.value - 1000.0) < 1e-6


def test_before_the_first_tick_nothing_is_sampled_and_steps_stay_bounded():
    pc, rate, t = clocked()
    for i in range(100):
        steps(pc, t, i * 0.01)
    assert len(pc.starts) == 1 and rate.samples == 0
    pc.tick(0, 1)
    for i in range(100):
        steps(pc, t, 1 + i * 0.01)
    assert len(pc.starts) == 3


def test_each_sample_carries_the_cached_tokens_its_requests_joined_with():
    """``joined`` (the admission's ``add_one_req``) adds the prefixes of the ticked step's
    requests: the margin learns new tokens apart from the context they attend to."""
    from sglang_flatcake.sched.rates import Marginal
    t = [0.0]
    m = Marginal()
    pc = PrefillClock(Rate(), clock=lambda: t[0], marginal=m)
    seen = []
    m.observe = lambda new, ctx, s: seen.append((new, ctx, round(s, 6)))
    steps(pc, t, 0.0)
    pc.tick(0, 2)
    pc.joined(4000)                        # a cache hit: 4,000 cached tokens
    pc.joined(0)                           # a first turn
    steps(pc, t, 0.05)
    pc.tick(1000, 0)
    steps(pc, t, 0.1)
    pc.tick(1500, 0)                       # the next step's requests joined with nothing
    assert seen == [(1000.0, 5000.0, 0.05), (500.0, 500.0, 0.05)]
