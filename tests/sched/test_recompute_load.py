"""Restore or recompute under load: restores priced as latency + bytes / bandwidth.

The logged case (issue 21): under load the first restores took 0.78 s for 0.5 MiB; the
server read that as 0.67 MB/s and priced restores of 0.1-0.2 MiB behind 1.7 MiB of others
at 3.0 s, against 1.8 s of recompute, and recomputed them into a prefill queue that grew to
149K tokens.  Deterministic: fixed samples or a seeded generator, no server.
"""

import random
from types import SimpleNamespace

import pytest

from sglang_flatcake.sched import rates, recompute
from sglang_flatcake.sched.rates import Cost, Rate
from sglang_flatcake.sched.recompute import MARGIN, SLIP_MAX, RestoreOrRecompute
from sglang_flatcake.sglang.hicache.recompute import ServerEstimates

MIB = 1 << 20
PAGE = 16


def logged_server(backlog_tokens=1000):
    """A scheduler as logged: one 1.72 MiB restore queued, ``backlog_tokens`` prefill tokens
    waiting, three restores of 0.5 MiB measured at 0.78 s (under load), prefill at 1,080
    tokens/s; and the logged request: 944 tokens from SSD in 0.2 MiB."""
    waiting = SimpleNamespace(rid="w", origin_input_ids=[0] * backlog_tokens, output_ids=[],
                              prefix_len=0)
    sched = SimpleNamespace(waiting_queue=[waiting], chunked_req=None)
    est = ServerEstimates(sched, enabled=True, clock=lambda: 100.0)
    est.restoring(SimpleNamespace(rid="ahead", ssd_bytes=1_806_105))
    for seconds in (0.78, 0.76, 0.80):
        est.finished(SimpleNamespace(rid="old", ssd_bytes=MIB // 2, io_s=seconds))
    est.decider.prefill.observe(1080.6 * 100, 100.0)
    flow = SimpleNamespace(rid="r", keys=list(range(944 // PAGE)), lead_memory=0,
                           ssd_bytes=int(0.2 * MIB))
    return est, flow


def test_the_logged_mispricing_is_reproduced_by_a_plain_rate():
    """The old model (a moving-sum rate) with the logged inputs gives the logged line:
    restore 2.999 s > recompute 1.799 s, so it recomputes."""
    d = RestoreOrRecompute(Rate(), Rate())
    for seconds in (0.78, 0.78, 0.78):
        d.restore.observe(MIB // 2, seconds)
    d.prefill.observe(1080.6 * 100, 100.0)
    c = d.estimate(int(0.2 * MIB), 944, 1_806_105, 1000)
    assert c.restore_s == pytest.approx(2.999, abs=0.005)
    assert c.recompute_s == pytest.approx(1.799, abs=0.005)
    assert not c.restore


def test_the_server_restores_in_the_logged_case():
    """Fails on the old model: the server priced the restore from the 0.67 MB/s 'rate'.
    Now 0.5 MiB in 0.78 s is read as latency: the request waits for one restore ahead and
    its own, about 1.56 s, and restores."""
    est, flow = logged_server()
    c = est.estimate(flow, PAGE, {})
    assert c.restore
    lat = est.decider.restore.latency
    assert lat == pytest.approx(0.78, abs=0.01)
    assert c.restore_s == pytest.approx(2 * lat, abs=0.01)     # two restores' latency
    assert c.recompute_s == pytest.approx(1.799, abs=0.005)
    assert est.stats()["restore_latency_s"] == pytest.approx(lat)


def test_small_restores_are_priced_by_latency_large_ones_by_bandwidth():
    """Restores of 64 KiB .. 64 MiB at 50 ms + bytes / 200 MB/s, +-10% noise: the fit finds
    both; a plain rate over the same samples misprices one end by more than 3x."""
    lat, bw = 0.05, 200e6
    gen = random.Random(1)
    cost, rate = Cost(), Rate()
    for i in range(40):
        nbytes = (64 << 10) << (i % 11)                      # 64 KiB .. 64 MiB
        s = (lat + nbytes / bw) * gen.uniform(0.9, 1.1)
        cost.observe(nbytes, s)
        rate.observe(nbytes, s)
    assert cost.latency == pytest.approx(lat, rel=0.15)
    assert cost.value == pytest.approx(bw, rel=0.15)
    small, large = 64 << 10, 1 << 30
    assert cost.seconds_for(small) == pytest.approx(lat + small / bw, rel=0.15)
    assert cost.seconds_for(small) < 1.02 * cost.latency + 1e-3   # latency, nearly all
    assert cost.seconds_for(large) == pytest.approx(lat + large / bw, rel=0.15)
    assert cost.seconds_for(large) > 50 * cost.latency             # bandwidth, nearly all
    assert cost.seconds_for(0, count=3) == pytest.approx(3 * cost.latency)
    errors = [n / rate.value / (lat + n / bw) for n in (small, 64 * MIB)]
    assert min(errors) < 1 / 3 or max(errors) > 3                  # what a rate cannot do


def test_nothing_is_priced_from_fewer_than_min_samples_and_one_outlier_moves_little():
    c = Cost()
    assert c.seconds_for(MIB) is None and c.value is None and c.latency is None
    for _ in range(rates.MIN_SAMPLES - 1):
        c.observe(MIB, 5.0)                               # slow first restores decide nothing
    assert c.seconds_for(MIB) is None
    d = RestoreOrRecompute(c, Rate(1000.0))
    assert d.choose(MIB, 100, 0, 0).restore and d.counts["restored_requests"] == 1
    steady = Cost()
    for i in range(12):
        steady.observe(MIB * (1 + i % 4), 0.01 + 0.001 * (1 + i % 4))
    before = steady.seconds_for(2 * MIB)
    steady.observe(MIB, 20.0)                             # one stall, 2,000x the usual
    assert steady.seconds_for(2 * MIB) == pytest.approx(before, rel=0.2)
    d = RestoreOrRecompute(Cost(1e9), Rate(1e4))
    d.restored(d.choose(MIB, 1000, 0, 0), 50.0)           # a chosen restore took 50,000x
    c2 = d.estimate(MIB, 1000, 0, 0)
    assert c2.restore_s == pytest.approx(SLIP_MAX * c2.modelled_s)   # at most SLIP_MAX


def test_growth_of_the_prefill_backlog_it_joins_flips_to_restore():
    """A slow restore (1 s) against 200 tokens at 1,000/s: recomputed while the GPU is idle,
    restored once the tokens the request would join behind cost more than the disk."""
    d = RestoreOrRecompute(Cost(1e6, latency=0.5), Rate(1000.0))
    flips = []
    for backlog in range(0, 3000, 100):
        flips.append(d.choose(500_000, 200, 0, backlog).restore)
    assert flips[0] is False
    first = flips.index(True)
    assert all(flips[first:])                             # and it stays restored
    # restore: 1 s + 1 s once more; recompute: (backlog + 200) / 1000 + 0.2 s
    assert 100 * first == pytest.approx(2000 - 400, abs=100)
    # on the server: the waiting queue is the backlog (the logged request, 149K tokens ahead)
    est, flow = logged_server(backlog_tokens=149_000)
    est.decider.restoring = False                        # even after a recompute
    c = est.estimate(flow, PAGE, {})
    assert c.restore and c.recompute_s > 100


def flips(decider, noise=0.25):
    """Answer changes over 300 requests of 1 MiB / 600 tokens, each decided after one more
    restore of 1-3 MiB measured at (0.2 s + bytes / 50 MB/s) x (1 +- ``noise``), seeded."""
    gen = random.Random(7)
    answers = []
    for i in range(300):
        nbytes = MIB * (1 + i % 3)
        decider.restore.observe(nbytes, (0.2 + nbytes / 50e6) * gen.uniform(1 - noise, 1 + noise))
        answers.append(decider.choose(MIB, 600, 0, 0).restore)
    return sum(a != b for a, b in zip(answers, answers[1:]))


@pytest.mark.parametrize("tokens_per_s", [2700, 2800, 2900, 3000])
def test_no_flapping_under_noisy_samples(tokens_per_s):
    """The fitted cost of 1 MiB is 0.221 s: 600 tokens at 2,700-3,000 tokens/s (0.2-0.22 s)
    sit at the break-even point, where +-25% noise must not make one size alternate."""
    assert flips(RestoreOrRecompute(Cost(), Rate(float(tokens_per_s)))) <= 3


def test_the_old_model_flapped_at_its_break_even(monkeypatch):
    """The same stream through the old decision (moving-sum rate, no margin) alternates: at
    its break-even (the rate reads 1 MiB as 0.12 s, 600 tokens at 5,000/s) it changed its
    answer for the same request size more than 100 times in 300."""
    monkeypatch.setattr(recompute, "MARGIN", 0.0)
    assert flips(RestoreOrRecompute(Rate(), Rate(5000.0))) > 100
    monkeypatch.setattr(recompute, "MARGIN", MARGIN)
    assert flips(RestoreOrRecompute(Cost(), Rate(5000.0))) <= 3


def test_the_band_follows_the_agreed_answer_on_every_rank():
    """TP: ranks measure apart and agree by MIN; each counts the agreed answer, so the band
    (the last decision) is the same on every rank and the next request is decided alike."""
    fast, slow = (RestoreOrRecompute(Cost(bw), Rate(1000.0)) for bw in (10e6, 0.5e6))
    mine = [d.estimate(1_000_000, 1000, 0, 0).restore for d in (fast, slow)]
    assert mine == [True, False]
    agreed = min(mine)                                    # the all-reduce MIN of "restore"
    for d in (fast, slow):
        d.count(agreed, 1000, 1_000_000)
    assert fast.restoring is slow.restoring is False
    assert fast.counts == slow.counts and fast.counts["recomputed_requests"] == 1


def test_bad_cost_parameters_are_refused_by_name():
    with pytest.raises(ValueError, match="bandwidth=0"):
        Cost(0)
    with pytest.raises(ValueError, match="latency=-1"):
        Cost(1e9, latency=-1)
    with pytest.raises(ValueError, match="bandwidth_prior=0"):
        Cost(bandwidth_prior=0)
    given = Cost(1e9, latency=0.01)
    given.observe(MIB, 100.0)                             # a given model is not refitted
    assert given.seconds_for(1e9) == pytest.approx(1.01) and given.samples == 0


def test_the_backlog_counts_restores_ahead_for_their_latency():
    b = rates.Backlog()
    b.add("a", 10.0)
    b.add("b", 5.0)
    b.start("a", 0.0)
    assert (b.count(), b.count(started=True), b.count(started=False)) == (2, 1, 1)
    d = RestoreOrRecompute(Cost(1e6, latency=0.5), Rate(1000.0))
    alone, behind = d.estimate(1e6, 10_000, 0, 0), d.estimate(1e6, 10_000, 2e6, 0, 2)
    assert alone.restore_s == pytest.approx(1.5)
    assert behind.restore_s == pytest.approx(1.5 + 2 * 0.5 + 2.0)   # two latencies, 2 MB
