"""commands.interrupts: a Ctrl-C that Python dropped in a finalizer, or that came while a
process was being launched, still stops the command, and stops the process it launched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from sglang_flatcake.commands import cli, demo, demo_cluster, interrupts
from sglang_flatcake.commands import server as srv
from sglang_flatcake.commands.processes import wait_until


@pytest.fixture(autouse=True)
def sigint_as_python_starts_it():
    """Each test starts with Python's own SIGINT handler, whatever pytest inherited: started
    as ``cmd &`` from a script, it inherits SIGINT ignored, and then ``caught()`` rightly
    installs nothing (``test_an_ignored_sigint_stays_ignored``)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def ctrl_c_here() -> None:
    """SIGINT to this process, taken before this function returns (the loop's backward jump
    is where Python runs a pending handler, if ``os.kill`` itself did not)."""
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(3):
        pass


class CtrlCInDel:
    """Its finalizer takes a Ctrl-C: Python prints "Exception ignored in" and drops it."""

    def __del__(self):
        ctrl_c_here()


def test_a_ctrl_c_that_a_finalizer_swallowed_still_stops_the_wait(monkeypatch):
    rounds, dropped = [], []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)   # "Exception ignored in"

    def cond():
        rounds.append(1)
        if len(rounds) == 1:
            CtrlCInDel()                  # collected at once; its __del__ gets the SIGINT
        return len(rounds) >= 3
    with interrupts.caught():
        with pytest.raises(KeyboardInterrupt):
            wait_until(cond, 10, "three rounds", every=0.01)
    assert [d.exc_type for d in dropped] == [KeyboardInterrupt]     # Python dropped it ...
    assert rounds == [1], "the wait went on after the Ctrl-C"     # ... and the wait stopped


def test_a_command_that_ran_on_past_a_swallowed_ctrl_c_exits_130(monkeypatch, capsys):
    monkeypatch.setattr(sys, "unraisablehook", lambda what: None)

    def runs_to_the_end(args):
        CtrlCInDel()
        return 0
    monkeypatch.setattr(demo, "run", runs_to_the_end)
    assert cli.main(["demo"]) == 130
    err = capsys.readouterr().err
    assert err.endswith("flatcake demo: interrupted; the servers it started are stopped\n")


def test_a_ctrl_c_inside_held_comes_on_leaving_it():
    done = []
    with interrupts.caught():
        with pytest.raises(KeyboardInterrupt):
            with interrupts.held():
                ctrl_c_here()
                done.append("after the signal")
            done.append("after the block")
    assert done == ["after the signal"]


def test_an_ignored_sigint_stays_ignored():
    """``cmd &`` in a non-interactive shell starts ``cmd`` with SIGINT ignored; so be it."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupts.caught():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)


class Launches:
    """``subprocess.Popen`` launching ``sleep 60`` (with the caller's session settings) in
    place of the server; ``ctrl_c``: a SIGINT comes before it returns the pid."""

    def __init__(self, real):
        self.real, self.procs, self.ctrl_c = real, [], False

    def __call__(self, args, **kw):
        p = self.real(["sleep", "60"], **kw)
        self.procs.append(p)
        if self.ctrl_c:
            ctrl_c_here()
        return p


@pytest.fixture
def launches(monkeypatch):
    """The ``Launches`` in place; what it launched is killed after the test if still running."""
    fake = Launches(subprocess.Popen)
    monkeypatch.setattr(srv.subprocess, "Popen", fake)
    yield fake
    for p in fake.procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_ctrl_c_as_the_server_is_launched_stops_that_server(tmp_path, launches):
    launches.ctrl_c = True
    s = srv.ServerProcess(["--model-path", "m"], log_path=str(tmp_path / "s.log"))
    with interrupts.caught(), pytest.raises(KeyboardInterrupt):
        s.start(timeout=30)
    assert len(launches.procs) == 1 and s.proc is launches.procs[0]
    assert launches.procs[0].poll() is not None, "the server launched was left running"


class QuickStart(srv.ServerProcess):
    def start(self, timeout: float = 5, tries: int = 1, progress=None):
        return super().start(timeout, tries, progress)


@pytest.mark.parametrize("after_s", [0.0, 0.5])     # as the threads start; as they wait
def test_a_ctrl_c_while_servers_start_side_by_side_stops_every_one(tmp_path, launches, after_s):
    """The cluster demo starts its nodes in threads; the Ctrl-C reaches the main thread only."""
    servers = [QuickStart(["--model-path", "m"], log_path=str(tmp_path / f"s{i}.log"))
               for i in range(2)]
    timer = threading.Timer(after_s, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    with interrupts.caught(), pytest.raises(KeyboardInterrupt):
        timer.start()
        demo_cluster._start_all(servers)
    took = time.monotonic() - t0
    assert len(launches.procs) <= 2
    assert all(p.poll() is not None for p in launches.procs), "a server was left running"
    assert took < 4, f"stopping took {took:.1f}s, past the start's own 5 s timeout"
