"""Restore or recompute (``sched.recompute``, ``sched.rates``) with a fake clock.

Sizes are the replay's presets: DeepSeek-V3 keeps 70,272 KV bytes a token, V4-Flash
3,922; the b200x8 preset prefills 60,000 tokens/s; the local disk model reads
1.2 GiB/s, the nvme-gen5 model 5 GiB/s.
"""

import pytest

from sglang_flatcake.sched.rates import Backlog, Rate
from sglang_flatcake.sched.recompute import RestoreOrRecompute

GIB = 1 << 30
V3, FLASH = 70_272, 3_922                 # KV bytes per token
PREFILL = 60_000.0                        # tokens per second


def decider(disk_bytes_per_s, enabled=True):
    return RestoreOrRecompute(Rate(disk_bytes_per_s), Rate(PREFILL), enabled)


def test_does_nothing_when_restores_are_faster():
    d = decider(1.2 * GIB)                # V4-Flash: 3.0 us a token to restore, 16.7 to recompute
    for tokens, disk, gpu in [(512, 0, 0), (100_000, 0, 0), (20_000, 0.2e9, 0), (20_000, 0, 1e6)]:
        c = d.choose(tokens * FLASH, tokens, disk, gpu)
        assert c.restore and c.restore_s <= c.recompute_s
    assert d.counts == {"restored_requests": 4, "recomputed_requests": 0, "recomputed_tokens": 0,
                        "ssd_bytes_not_read": 0, "reconsidered_requests": 0}


def test_recomputes_when_the_local_disk_is_slower_than_the_gpu():
    d = decider(1.2 * GIB)                # V3: 54.5 us a token to restore, 16.7 to recompute
    c = d.choose(10_000 * V3, 10_000, 0, 0)
    assert not c.restore
    assert c.restore_s == pytest.approx(10_000 * V3 / (1.2 * GIB))
    assert c.recompute_s == pytest.approx(10_000 / PREFILL)
    assert d.counts["recomputed_requests"] == 1 and d.counts["recomputed_tokens"] == 10_000
    assert d.counts["ssd_bytes_not_read"] == 10_000 * V3


def test_the_queues_ahead_decide_on_a_fast_disk():
    d = decider(5 * GIB)                  # V3 on nvme-gen5: 13.1 us a token, faster than the GPU
    assert d.choose(10_000 * V3, 10_000, 0, 0).restore
    busy_disk = d.choose(10_000 * V3, 10_000, 20e9, 0)          # 3.7 s of restores ahead
    assert not busy_disk.restore
    busy_both = d.choose(10_000 * V3, 10_000, 20e9, 300_000)    # and 5 s of prefill ahead
    assert busy_both.restore
    assert busy_both.restore_s == pytest.approx(busy_disk.restore_s)
    assert d.counts["restored_requests"] == 2 and d.counts["recomputed_requests"] == 1


def test_off_unknown_rates_and_nothing_on_ssd_always_restore():
    off = decider(1.2 * GIB, enabled=False)
    assert off.choose(10_000 * V3, 10_000, 0, 0).restore
    assert off.counts["restored_requests"] == off.counts["recomputed_requests"] == 0
    unknown = RestoreOrRecompute(Rate(), Rate(PREFILL))   # no restore measured yet
    c = unknown.choose(10_000 * V3, 10_000, 0, 0)
    assert c.restore and c.restore_s is None
    on = decider(1.2 * GIB)
    assert on.choose(0, 10_000, 0, 0).restore and on.choose(V3, 0, 0, 0).restore
    assert on.stats()["restore_bytes_per_s"] == pytest.approx(1.2 * GIB)
    assert on.stats()["prefill_tokens_per_s"] == PREFILL


def test_rate_is_a_moving_sum_of_measurements():
    r = Rate(2.0)
    assert r.value == 2.0 and r.samples == 0
    r.observe(10.0, 1.0)
    assert r.value == pytest.approx((0.8 * 2 + 10) / (0.8 + 1))
    for amount, seconds in [(0.0, 5.0), (5.0, 0.0), (5.0, -1.0)]:
        r.observe(amount, seconds)        # nothing done, or no time: ignored
    assert r.samples == 1 and r.value == pytest.approx((0.8 * 2 + 10) / (0.8 + 1))
    empty = Rate()
    assert empty.value is None
    empty.observe(3.0, 2.0)
    assert empty.value == pytest.approx(1.5) and empty.samples == 1
    with pytest.raises(ValueError, match="first=0"):
        Rate(0)


def test_backlog_counts_queued_work_whole_and_running_work_less_its_progress():
    b = Backlog()
    b.add("a", 10.0)
    b.add("b", 10.0)
    assert b.remaining(0.0, 2.0) == 20.0 and b.queued() == 20.0
    b.start("a", 1.0)
    assert b.queued() == 10.0
    assert b.remaining(3.0, 2.0) == pytest.approx(6.0 + 10.0)     # a served 2 s at 2/s
    assert b.remaining(30.0, 2.0) == pytest.approx(10.0)          # never below zero
    assert b.remaining(3.0, None) == 20.0                          # no rate: counted whole
    b.start("b", 3.0)                     # two in flight share the rate
    assert b.remaining(4.0, 2.0) == pytest.approx((10.0 - 3.0) + (10.0 - 1.0))
    b.done("a")
    b.done("nobody")
    b.start("nobody", 0.0)
    assert b.remaining(3.0, 2.0) == 10.0


def test_each_choice_is_charged_its_own_service_time_once_more():
    """The replay's V4-Flash case at 0.5 req/s: recomputing would end 0.07 s sooner for this
    request but takes 0.41 s of GPU from the requests behind it; the restore 0.08 s of disk."""
    d = decider(1.2 * GIB)
    c = d.choose(24_704 * FLASH, 24_704, 0.536e9, 4_280)
    assert c.recompute_s < c.restore_s                 # faster for the request alone ...
    assert c.restore                                   # ... but not once its cost is counted
    slow = d.choose(24_704 * V3, 24_704, 0.536e9, 4_280)
    assert not slow.restore                            # V3 bytes: the disk costs more itself


def test_a_measured_rate_is_not_stretched_past_what_it_has_seen():
    """One small restore (fixed latency, mostly) does not price a restore 40x its size: the
    decision restores until the measured amounts reach half of what it must time."""
    r = Rate()
    r.observe(8192, 0.2)                              # 8 KiB in 0.2 s: 41 KB/s
    assert r.value_for(8192) == pytest.approx(40960) and r.value_for(16384) == r.value
    assert r.value_for(16385) is None and r.value_for(1 << 20) is None
    d = RestoreOrRecompute(r, Rate(PREFILL))
    big = d.estimate(300 * 1024, 600, 0, 0)
    assert big.restore and big.restore_s is None      # unknown for this size: restore
    for _ in range(3):
        r.observe(300 * 1024, 7.0)                    # now measured at this size, and slow
    slow = d.estimate(300 * 1024, 600, 0, 0)
    assert not slow.restore and slow.restore_s > slow.recompute_s
    assert Rate(5.0).value_for(1e12) == 5.0           # a given rate is trusted for any amount


def cpu_steps(marginal, n=24, a=0.004, b=10e-6, c=28e-6, seed=1):
    """Steps of SGLang's CPU attention as measured (run 18): fixed cost, 10 us a new token,
    and a step's time following its whole context; new tokens among context vary."""
    import random
    rnd = random.Random(seed)
    for i in range(n):
        ctx = rnd.randint(2_000, 12_000)
        new = ctx if i % 3 == 0 else rnd.randint(16, ctx // 2)   # first turns and cache hits
        marginal.observe(new, ctx, a + b * new + c * ctx)


def test_the_margin_is_what_a_new_token_adds_at_a_fixed_context():
    from sglang_flatcake.sched.rates import FIT_MIN, Marginal
    m = Marginal()
    cpu_steps(m, n=FIT_MIN - 1)
    assert m.per_token() is None                      # too few steps
    cpu_steps(m, n=24)
    assert m.per_token() == pytest.approx(10e-6, rel=1e-6)
    m.observe(500, 6_000, 5.0)                        # a 5 s garbage-collection pause
    assert m.per_token() == pytest.approx(10e-6, rel=1e-6)
    alike = Marginal()                                # first turns only: new == context
    for ctx in range(1_000, 30_000, 1_000):
        alike.observe(ctx, ctx, 0.004 + 38e-6 * ctx)
    assert alike.per_token() is None                  # new and context cannot be told apart
    m.observe(0, 100, 1.0)
    m.observe(100, 100, 0.0)
    assert m.samples == 24 + FIT_MIN - 1 + 1          # both ignored


def test_own_tokens_are_priced_at_the_margin_where_the_steps_tell_it():
    """Run 18's linker case: 700 tokens, priced 126 ms at the average step rate (5,572 tokens
    a second), cost about 7 ms more at the margin; a restore of 27 ms is then dearer."""
    from sglang_flatcake.sched.rates import Marginal
    avg = RestoreOrRecompute(Rate(27e6 / 0.027), Rate(5_572.0))     # 27 MB in 27 ms
    m = Marginal()
    at_margin = RestoreOrRecompute(Rate(27e6 / 0.027), Rate(5_572.0), marginal=m)
    assert avg.estimate(27e6, 700, 0, 0).restore
    assert at_margin.estimate(27e6, 700, 0, 0).restore     # no margin yet: the average
    cpu_steps(m)
    c = at_margin.estimate(27e6, 700, 0, 0)
    assert not c.restore and c.recompute_s == pytest.approx(700 * 10e-6)
    behind = at_margin.estimate(27e6, 700, 0, 5_572)        # a second of prefill ahead
    assert behind.restore and behind.recompute_s == pytest.approx(1.0 + 700 * 10e-6)
    assert at_margin.stats()["prefill_marginal_s_per_token"] == pytest.approx(10e-6)
    dear = Marginal()                                 # a fit above the average is capped by it
    cpu_steps(dear, b=1e-3)
    assert RestoreOrRecompute(Rate(1.0), Rate(5_572.0), marginal=dear).per_token(5_572.0) == \
        pytest.approx(1 / 5_572.0)


def test_a_noisy_margin_is_priced_at_the_upper_end_of_its_interval():
    """Steps whose time hardly follows new tokens, with noise: b's fit is near zero, its
    price is not (two standard errors above), so the decision does not take recomputing as
    free on a guess; more steps narrow it."""
    import random
    from sglang_flatcake.sched.rates import Marginal
    rnd, m = random.Random(7), Marginal()
    for i in range(16):
        ctx = rnd.randint(2_000, 12_000)
        new = ctx if i % 3 == 0 else rnd.randint(16, ctx // 2)
        m.observe(new, ctx, 0.004 + 1e-6 * new + 30e-6 * ctx + rnd.gauss(0, 0.03))
    price = m.per_token()
    assert 3e-6 < price < 40e-6                      # b is 1 us; 16 noisy steps say less
    clean = Marginal()
    cpu_steps(clean, n=64)
    assert clean.per_token() == pytest.approx(10e-6, rel=1e-6)   # noiseless: b itself
