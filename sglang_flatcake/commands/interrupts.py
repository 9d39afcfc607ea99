"""Ctrl-C in the ``flatcake`` commands: recorded once, never lost, never half-way through a start.

Python raises ``KeyboardInterrupt`` for SIGINT wherever the main thread happens to be.  Where
that is a finalizer (a ``__del__`` or weakref callback the garbage collector runs at any
allocation) the exception is printed as "Exception ignored in ..." and dropped, and the command
would carry on; where it is between starting a process and recording its pid, the process is
left running with nobody to stop it.

``caught()`` (``cli.main`` wraps every command in it) routes SIGINT through a handler that
records the interrupt here before raising, and puts the previous handler back (and forgets the
record) on exit.  ``check()`` raises ``KeyboardInterrupt`` for a recorded interrupt: the wait
loops call it each round, from any thread, so one that a finalizer swallowed still stops the
wait, and the threads starting servers side by side stop too; ``cli.main`` calls it once the
command returns, so a command that ran on past a swallowed one still exits 130.
``held()`` covers a few statements that must not be cut in half: inside it (in the main thread)
the handler only records, and the ``KeyboardInterrupt`` comes on leaving it.  A SIGINT that
the process inherited as ignored (``flatcake demo &`` in a non-interactive shell, which sets
SIGINT to ignored for its background jobs) stays ignored: the shell asked for that.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

_seen = threading.Event()      # set by the handler; cleared when a caught() block starts and ends
_held = 0                      # depth of held() blocks in the main thread


def _on_sigint(signum, frame) -> None:
    _seen.set()
    if not _held:
        raise KeyboardInterrupt


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def caught():
    """Record every SIGINT that comes while the block runs (see the module docstring).  Outside
    the main thread, or when SIGINT is ignored or has a handler of someone else's, it installs
    nothing (``check()`` then only sees interrupts recorded by an enclosing block)."""
    ours = _main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if not ours:
        yield
        return
    _seen.clear()
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _seen.clear()


def check() -> None:
    """Raise ``KeyboardInterrupt`` if a SIGINT has been recorded; a no-op otherwise."""
    if _seen.is_set():
        raise KeyboardInterrupt


@contextmanager
def held():
    """Defer a SIGINT's ``KeyboardInterrupt`` to the end of the block (main thread; in another
    thread, where no handler runs, it only checks on leaving).  An exception leaving the block
    goes on as it is."""
    global _held
    main = _main_thread()
    if main:
        _held += 1
    try:
        yield
    finally:
        if main:
            _held -= 1
    check()


class LineEnds:
    """A text stream as it was, remembering whether what was last written ended a line, so a
    Ctrl-C that lands inside ``print`` (between its text and its newline) does not glue the
    command's last words to that half line.  Everything but ``write`` goes to the stream."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.at_line_start = True

    def write(self, text: str) -> int:
        if text:               # set first: an interrupt after it costs a blank line at most
            self.at_line_start = text.endswith("\n")
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextmanager
def line_ends_tracked():
    """``sys.stderr`` wrapped in ``LineEnds`` for the block (put back after it); yields it."""
    import sys
    tracked = LineEnds(sys.stderr)
    sys.stderr = tracked
    try:
        yield tracked
    finally:
        sys.stderr = tracked.stream
