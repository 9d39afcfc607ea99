"""sglang_flatcake.commands.processes: pausing, resuming and stopping a real process group."""

import os
import signal
import subprocess
import sys
import time

import pytest

from sglang_flatcake.commands.processes import Managed, running_in_group, stop_group, wait_until

# a parent and a child (same group) that each append a tick to a file every 20 ms; like an
# SGLang server, they handle SIGTERM themselves (a stopped process runs no handler)
CODE = r"""
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
path, role = sys.argv[1], sys.argv[2]
if role == "parent":
    subprocess.Popen([sys.executable, "-c", sys.argv[3], path, "child", sys.argv[3]])
while True:
    with open(path + "." + role, "a") as f:
        f.write("x")
    time.sleep(0.02)
"""


class Ticker(Managed):
    grace = 10.0

    def __init__(self, path):
        self.path = str(path)

    def start(self):
        self.proc = subprocess.Popen([sys.executable, "-c", CODE, self.path, "parent", CODE],
                                     start_new_session=True)
        return self

    def ticks(self, role):
        try:
            with open(self.path + "." + role) as f:
                return len(f.read())
        except FileNotFoundError:
            return 0


def test_pause_stops_the_whole_group_and_resume_continues_it(tmp_path):
    with Ticker(tmp_path / "t") as t:
        wait_until(lambda: t.ticks("parent") > 3 and t.ticks("child") > 3, 30, "both to tick")
        t.pause()
        time.sleep(0.2)                      # a tick in flight lands before the stop
        paused = (t.ticks("parent"), t.ticks("child"))
        time.sleep(0.5)
        assert (t.ticks("parent"), t.ticks("child")) == paused
        t.resume()
        wait_until(lambda: t.ticks("parent") > paused[0] and t.ticks("child") > paused[1], 30,
                   "both to tick again")


def test_a_paused_group_stops_on_sigterm_without_waiting_for_the_kill(tmp_path):
    t = Ticker(tmp_path / "t").start()
    wait_until(lambda: t.ticks("parent") > 3, 30, "the parent to tick")
    t.pause()
    t0 = time.monotonic()
    t.stop()
    assert t.proc.returncode == 3           # its SIGTERM handler ran; not the SIGKILL
    assert time.monotonic() - t0 < t.grace


def test_pausing_a_process_that_is_not_running_is_an_error_naming_it(tmp_path):
    t = Ticker(tmp_path / "t")
    with pytest.raises(RuntimeError, match="cannot send SIGSTOP: the process is not running"):
        t.pause()
    t.start()
    t.stop()
    with pytest.raises(RuntimeError, match="cannot send SIGCONT"):
        t.resume()


# a leader that exits at once on SIGTERM and a child (same group) that takes a second to,
# as an SGLang server's scheduler does after the server process has gone
SLOW_CHILD = r"""
import signal, subprocess, sys, time
if sys.argv[1] == "parent":
    subprocess.Popen([sys.executable, "-c", sys.argv[2], "child", sys.argv[2]])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
else:
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.0), sys.exit(0)))
print(sys.argv[1], flush=True)
while True:
    time.sleep(0.05)
"""


def test_stop_returns_once_no_process_of_the_group_runs():
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CHILD, "parent", SLOW_CHILD],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert sorted(proc.stdout.readline().strip() for _ in range(2)) == ["child", "parent"]
        assert len(running_in_group(proc.pid)) == 2
        stop_group(proc, grace=30)
        assert proc.returncode == 0 and running_in_group(proc.pid) == []
    finally:
        if running_in_group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
