"""``SchedulerQuiet``: between forwards or not, from the scheduler's step starts (a test clock)."""

from __future__ import annotations

import threading

import pytest

from sglang_flatcake.sglang.quiet import SchedulerQuiet


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@pytest.fixture(autouse=True)
def _fine_polls(monkeypatch):
    """The test clock's sleeps stand for the loop's steps: 0.5 ms apart (a spinning loop),
    as ``wait`` would be woken by them."""
    from sglang_flatcake.sglang import quiet as quiet_mod
    monkeypatch.setattr(quiet_mod, "POLL_S", 0.0005)


def quiet_on(clock: Clock, **kw) -> SchedulerQuiet:
    return SchedulerQuiet(gap_s=0.002, asleep_s=0.25, max_wait_s=1.0, clock=clock,
                          sleep=clock.sleep, **kw)


def steps(q: SchedulerQuiet, clock: Clock, n: int, apart_s: float) -> None:
    for _ in range(n):
        clock.now += apart_s
        q.step()


def off_main(fn):
    """``fn()`` on a thread of its own, as the writers call ``wait``; its answer."""
    got = []
    t = threading.Thread(target=lambda: got.append(fn()))
    t.start()
    t.join(30)
    assert got, "the wait did not return"
    return got[0]


def test_a_spinning_loop_is_quiet_and_a_step_that_runs_a_forward_is_not():
    clock = Clock()
    q = quiet_on(clock)
    assert q.quiet()                         # no step yet: nothing runs
    steps(q, clock, 3, 0.0001)               # SGLang's idle loop: steps microseconds apart
    assert q.quiet()
    clock.now += 0.003                       # this step has run 3 ms: a forward
    assert not q.quiet()
    steps(q, clock, 1, 0.0)                  # the step after a 3 ms one: still not quiet
    assert not q.quiet()
    steps(q, clock, 1, 0.0005)               # the loop spins again
    assert q.quiet()


def test_decode_steps_are_not_quiet_and_a_sleeping_loop_is():
    clock = Clock()
    q = quiet_on(clock)
    steps(q, clock, 5, 0.010)                # 10 ms decode steps back to back
    assert not q.quiet()
    clock.now += 0.3                         # --sleep-on-idle: no step for 0.3 s
    assert q.quiet()


def test_wait_returns_at_once_when_quiet_and_when_stopped_and_runs_out_otherwise():
    clock = Clock()
    q = quiet_on(clock)
    assert off_main(q.wait) == 0.0
    steps(q, clock, 3, 0.010)
    start = clock.now
    waited = off_main(lambda: q.wait(stop=lambda: clock.now - start >= 0.1))
    assert 0.1 <= waited < 0.11
    q.asleep_s = 10.0                        # a forward that never ends, for this test
    assert q.wait() == 0.0                   # the main thread (the scheduler's) never waits
    waited = off_main(q.wait)
    assert waited < 0 and clock.now - q.quiet_at >= 1.0   # busy 1 s: ran out, write anyway
    assert off_main(q.wait) == -0.0          # still busy: the next write waits no more
    c = q.counters.snapshot()
    assert c["waits"] == 1 and 100 <= c["wait_ms"] <= 110 and c["waits_run_out"] == 2


def test_a_forward_ending_lets_the_wait_return():
    clock = Clock()
    q = quiet_on(clock)
    steps(q, clock, 2, 0.0001)
    clock.now += 0.050                       # inside a 50 ms forward
    ends_at = clock.now + 0.020

    def sleep(s: float) -> None:             # the scheduler's loop, seen from the worker
        clock.now += s
        if clock.now >= ends_at:
            q.step()                         # steps again, microseconds apart
    q.sleep = sleep
    waited = off_main(q.wait)
    assert 0.020 <= waited < 0.030 and q.quiet()


def test_a_busy_spell_is_timed_from_the_last_spinning_step_not_from_each_wait():
    """Under steady load (decode steps back to back) every write waits out the same spell,
    not ``max_wait_s`` each, so a server that never idles still writes at its full rate; the
    loop spinning again starts a new spell."""
    clock = Clock()
    q = quiet_on(clock)
    steps(q, clock, 3, 0.0001)                # spinning: quiet_at is now
    spun = q.quiet_at
    assert spun == clock.now
    steps(q, clock, 30, 0.010)               # 0.3 s of 10 ms decode steps
    assert q.quiet_at == spun and not q.quiet()
    q.sleep = lambda s: (setattr(clock, "now", clock.now + s), q.step())  # steps every poll
    q.gap_s = 0.0001                         # ... too far apart to read as spinning
    first = off_main(q.wait)
    assert first < 0 and clock.now - spun >= 1.0 and -first < 0.75   # waited the rest only
    assert off_main(q.wait) == -0.0 and off_main(q.wait) == -0.0     # then none


def test_a_gap_not_below_the_sleep_threshold_is_refused():
    with pytest.raises(ValueError, match="gap_s=0.5"):
        SchedulerQuiet(gap_s=0.5, asleep_s=0.25)


def test_a_waiting_writer_sleeps_until_the_loop_spins_again(monkeypatch):
    """Real time: the writer does not poll during a forward (each wake would take the GIL
    from it); the first steps of the loop spinning again wake it, long before its sleep's
    limit."""
    import time
    from sglang_flatcake.sglang import quiet as quiet_mod
    monkeypatch.setattr(quiet_mod, "POLL_S", 30.0)
    q = SchedulerQuiet(gap_s=0.002, asleep_s=60.0, max_wait_s=60.0)
    q.step()
    time.sleep(0.01)
    q.step()                                 # this step runs a forward
    assert not q.quiet()
    woke = []
    t = threading.Thread(target=lambda: woke.append(q.wait()))
    t.start()
    time.sleep(0.2)
    assert t.is_alive() and not woke         # asleep through the forward
    t0 = time.monotonic()
    while t.is_alive() and time.monotonic() - t0 < 5:   # the loop spins again
        q.step()
        time.sleep(0.0001)
    t.join(1)
    assert woke and woke[0] > 0.15 and time.monotonic() - t0 < 5
    assert q.counters.snapshot()["waits"] == 1
