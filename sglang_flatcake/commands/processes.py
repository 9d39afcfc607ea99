"""Waiting on the helper processes the demo starts (an SGLang server, a Mooncake master).

``wait_until(cond, timeout, what)`` polls ``cond()`` until it returns something true (and
returns that), or raises ``TimeoutError`` naming ``what``; a ``cond`` that raises stops
the wait with its error, and so does a Ctrl-C recorded by ``interrupts`` (checked each round,
in any thread).  ``stop_group(proc, grace)`` ends a process started with
``start_new_session=True``: SIGTERM to its group, SIGKILL after ``grace`` seconds (or at
once if a Ctrl-C interrupts the wait; the ``KeyboardInterrupt`` then goes on); it returns
once no process of the group runs (an SGLang server's scheduler and detokenizer exit after
it); a no-op when it has exited; a paused group is continued so that it can handle the
SIGTERM.  ``running_in_group(pgid)``: the group's processes that have not exited (zombies
left for init to reap do not count), from ``/proc``.
``pause_group``/``resume_group`` stop and continue the whole group (SIGSTOP/SIGCONT: a
paused server uses no CPU, so servers kept up side by side do not load each other).
``Managed`` gives a helper process class (``start`` returning itself, ``proc``,
``grace``) its ``stop``, ``pause``, ``resume`` and the ``with`` protocol.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from . import interrupts


def wait_until(cond, timeout: float, what: str, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        interrupts.check()
        got = cond()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


def stop_group(proc: subprocess.Popen | None, grace: float) -> None:
    if proc is None or proc.poll() is not None:
        return                           # (its pid may name another group by now)
    deadline = time.monotonic() + grace
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        os.killpg(proc.pid, signal.SIGCONT)      # a paused group handles it only when continued
        proc.wait(timeout=grace)
        while running_in_group(proc.pid):        # the leader's children, still exiting
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(proc.args, grace)
            time.sleep(0.05)
    except subprocess.TimeoutExpired:
        _kill(proc)
    except KeyboardInterrupt:            # a second Ctrl-C while it shuts down: do not wait
        _kill(proc)
        raise
    except ProcessLookupError:
        return                           # it ended before the first one


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return                           # it ended between the two signals
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while running_in_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def running_in_group(pgid: int) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()   # after "pid (comm)"
            except (OSError, IndexError):
                continue                 # it ended while we looked
            if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
                out.append(int(entry.name))
    return out


def pause_group(proc: subprocess.Popen | None) -> None:
    _signal_group(proc, signal.SIGSTOP)


def resume_group(proc: subprocess.Popen | None) -> None:
    _signal_group(proc, signal.SIGCONT)


def _signal_group(proc: subprocess.Popen | None, sig: int) -> None:
    if proc is None or proc.poll() is not None:
        raise RuntimeError(f"cannot send {signal.Signals(sig).name}: the process is not running")
    os.killpg(proc.pid, sig)


class Managed:
    proc: subprocess.Popen | None = None
    grace: float = 60.0

    def start(self):
        raise NotImplementedError

    def stop(self) -> None:
        stop_group(self.proc, self.grace)

    def pause(self) -> None:
        pause_group(self.proc)

    def resume(self) -> None:
        resume_group(self.proc)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
