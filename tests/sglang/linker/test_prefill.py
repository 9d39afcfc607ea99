"""``PrefillClock`` (``sglang/linker/prefill.py``): the linker's prefill rate from the
scheduler's processed-tokens counter, sampled only over busy steps."""

from __future__ import annotations

from sglang_flatcake.sched.rates import Rate
from sglang_flatcake.sglang.linker.prefill import PrefillClock


def clocked():
    t = [0.0]
    rate = Rate()
    return PrefillClock(rate, clock=lambda: t[0]), rate, t


def test_tokens_launched_between_busy_steps_are_a_sample():
    pc, rate, t = clocked()
    pc.tick(0, 3)
    t[0] = 0.5
    pc.tick(1000, 2)                      # 1,000 tokens in 0.5 s
    assert rate.samples == 1 and abs(rate.value - 2000.0) < 1e-6
    t[0] = 0.6
    pc.tick(1000, 1)                      # a decode step: nothing launched, no sample
    assert rate.samples == 1


def test_an_idle_gap_or_a_long_one_is_not_a_sample():
    pc, rate, t = clocked()
    pc.tick(0, 0)                         # nothing waited: the scheduler may have idled
    t[0] = 0.5
    pc.tick(1000, 2)
    assert rate.samples == 0
    t[0] = 10.0                           # longer than MAX_GAP_S (2 s)
    pc.tick(2000, 2)
    assert rate.samples == 0 and rate.value is None
    t[0] = 10.1
    pc.tick(2100, 1)
    assert rate.samples == 1 and abs(rate.value - 1000.0) < 1e-6
