"""One restore through a ``LayerWindow``: five stages over one state object.

    issue    a fill's commands go to the engine, into a free buffer (``issue``)
    land     each command's read is waited for, in order (``land``)
    verify   the pieces' XXH3-64 is checked where they landed (``verify_*``)
    scatter  the pieces go into their KV slots (``scatter_*``)
    release  a buffer is free once its fill's last scatter ended (``release``)

``run`` drives them: ``depth`` fills are issued ahead; each fill is landed, verified and
scattered as its reads end; the fill ``depth`` places later takes its buffer once
released.  A host window verifies and scatters command by command (on ``workers``
threads when the window has them); a device window lands the whole fill, then makes one
checksum launch and one scatter launch per run of one layer on ``window.stream``, and
one event releases the buffer.  On any error ``abort`` waits for every read and
scatter in flight before the error propagates, so no buffer is touched after ``run``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from . import checksum
from .fills import Fill, plan_fills

log = logging.getLogger("sglang_flatcake")
WAIT_THRESHOLD_S = 20e-6   # a read wait longer than this counts in ``read_waits``


@dataclass
class Tally:
    """What ``RestoreStats`` reports, counted while the stages run."""

    read_waits: int = 0
    read_wait_s: float = 0.0
    buffer_waits: int = 0
    buffer_wait_s: float = 0.0
    scatter_s: float = 0.0
    per_layer: dict = field(default_factory=dict)   # layer -> [fills, commands, bytes, wait, scatter]
    corrupt: list = field(default_factory=list)     # arrays of request blocks


class WindowRun:
    def __init__(self, window, plan, scatter_fn, verify: bool, order: str) -> None:
        self.win, self.plan, self.scatter_fn, self.verify = window, plan, scatter_fn, verify
        self.dev, self.stream = window.dev, window.stream
        self.fills: list[Fill] = plan_fills(plan, window.capacity, window.engine.alignment, order)
        self.on_device = verify and self.dev is not None
        self.bases = np.cumsum([0] + [len(f.piece_src) for f in self.fills])
        # the flags' memset runs on the window stream, ordered before the checksum launches
        self.flags = (self.dev.zeros(max(1, int(self.bases[-1])), np.uint8, self.stream)
                      if self.on_device else None)
        self.inflight: deque = deque()    # (fill, buffer, handles): issued, not landed yet
        self.waiting: deque = deque()     # (fill, buffer): waiting for the buffer's release
        self.busy: list = [None] * window.depth   # buffer -> release event of its last fill
        self.landing: list = []           # handles of the fill being landed, not waited yet
        self.scatters: list = []          # its scatter events so far
        self.tally = Tally(per_layer={lay: [0, 0, 0, 0.0, 0.0] for f in self.fills
                                      for lay in f.layers})
        self.lock = threading.Lock()

    def run(self) -> Tally:
        try:
            for k in range(min(self.win.depth, len(self.fills))):
                self.issue(k, k)
            while self.inflight or self.waiting:
                if not self.inflight:
                    self.issue_waiting(block=True)
                    continue
                k, b, handles = self.inflight.popleft()
                self.busy[b] = self.land(k, b, handles)
                if k + self.win.depth < len(self.fills):
                    self.waiting.append((k + self.win.depth, b))
                self.issue_waiting(block=False)
            self.drain()
        except BaseException:
            self.abort()
            raise
        return self.tally

    # ------------------------------------------------------------ 1. issue
    def issue(self, k: int, b: int) -> None:
        """Read fill ``k`` into buffer ``b``, once the scatters out of ``b`` have ended."""
        ev = self.busy[b]
        if ev is not None:
            t = time.perf_counter()
            self.tally.buffer_waits += _done(ev) is not True
            ev.synchronize()                                   # fence: buffer reuse
            self.tally.buffer_wait_s += time.perf_counter() - t
            self.busy[b] = None
        f, buf = self.fills[k], self.win.buffers[b]
        targets = [buf[o:o + c.length] for c, o in zip(f.commands, f.offsets)]
        self.inflight.append((k, b, self.win.engine.submit(f.commands, targets)))

    def issue_waiting(self, block: bool) -> None:
        """Issue waiting fills whose buffer is free; with ``block``, wait for the first.
        An event that cannot be polled (no ``done``) is waited for at once."""
        while self.waiting:
            k, b = self.waiting[0]
            if not block and self.busy[b] is not None and _done(self.busy[b]) is False:
                return
            self.waiting.popleft()
            self.issue(k, b)
            block = False

    # ------------------------------------------------------------ 2. land
    def land(self, k: int, b: int, handles: list):
        """Wait for fill ``k``'s reads in order, verifying and scattering as they land;
        returns the event that releases buffer ``b`` (``None``: free now)."""
        f, buf = self.fills[k], self.win.buffers[b]
        self.landing, self.scatters = list(handles), []
        for i in range(len(handles)):
            self.issue_waiting(block=False)
            t = time.perf_counter()
            self.landing.pop(0).wait()
            waited = time.perf_counter() - t
            self.tally.read_waits += waited > WAIT_THRESHOLD_S
            self.tally.read_wait_s += waited
            lt = self.tally.per_layer[f.layers[i]]
            lt[1], lt[2], lt[3] = lt[1] + 1, lt[2] + f.commands[i].length, lt[3] + waited
            if self.dev is None:
                self.scatters.append(self.host_command(f, buf, i))
        for lay in set(f.layers):
            self.tally.per_layer[lay][0] += 1
        if self.dev is not None:
            return self.device_fill(k, f, buf)
        return self.release([e for e in self.scatters if e is not None])

    # ------------------------------------------------------------ 3 + 4, host: per command
    def host_command(self, f: Fill, buf, i: int):
        """Verify and scatter command ``i`` of ``f`` (on a worker when the window has them)."""
        if self.win.pool is not None:
            return _Job(self.win.pool.submit(self.verify_and_scatter_host, f, buf, i))
        return self.verify_and_scatter_host(f, buf, i)

    def verify_and_scatter_host(self, f: Fill, buf, i: int):
        sel = slice(f.bounds[i], f.bounds[i + 1])
        src, dest = f.piece_src[sel], f.piece_dest[sel]
        if self.verify:
            ok = checksum.verify_host(buf, src, f.piece_checksum[sel], self.plan.piece_bytes)
            if not ok.all():
                with self.lock:
                    self.tally.corrupt.append(dest[~ok])
                src, dest = src[ok], dest[ok]
        return self.scatter(f.layers[i], buf[:f.nbytes], src, dest)

    # ------------------------------------------------------------ 3 + 4, device: per fill
    def device_fill(self, k: int, f: Fill, buf):
        """One checksum launch for the fill, one scatter per run of one layer, all on the
        window stream; returns the last event (the stream runs them in order)."""
        n = len(f.piece_src)
        mask = self.flags[self.bases[k]:self.bases[k] + n] if self.on_device else None
        if self.on_device:
            checksum.verify_on_device(self.dev, buf, f.piece_src, f.piece_checksum,
                                      self.plan.piece_bytes, mask, self.stream)
        ev = None
        for layer, lo, hi in _layer_runs(f):
            sel = slice(f.bounds[lo], f.bounds[hi])
            ev = self.scatter(layer, buf[:f.nbytes], f.piece_src[sel], f.piece_dest[sel],
                              None if mask is None else mask[sel]) or ev
        return ev if ev is not None else self.dev.record(self.stream)

    def scatter(self, layer: int, window, src, dest, mask=None):
        t = time.perf_counter()
        ev = (self.scatter_fn(layer, window, src, dest) if mask is None
              else self.scatter_fn(layer, window, src, dest, mask))
        dt = time.perf_counter() - t
        with self.lock:
            self.tally.per_layer[layer][4] += dt
            self.tally.scatter_s += dt
        return ev

    # ------------------------------------------------------------ 5. release
    @staticmethod
    def release(events: list):
        """The event that frees a buffer once all ``events`` completed (``None``: free)."""
        return _Events(events) if events else None

    def drain(self) -> None:
        """Wait for every buffer's release; then read the device flags (one download)."""
        for b, ev in enumerate(self.busy):
            if ev is not None:
                self.busy[b] = None
                ev.synchronize()
        if self.on_device and self.bases[-1]:
            dests = np.concatenate([f.piece_dest for f in self.fills])
            ok = self.dev.download(self.flags[:self.bases[-1]], self.stream)  # fence: flags
            self.tally.corrupt.append(dests[ok == 0])

    def abort(self) -> None:
        """Never leave a read or a scatter running on our buffers; the first error is the
        one the caller sees, the others are logged."""
        for handles in [self.landing] + [h for _, _, h in self.inflight]:
            for h in handles:
                try:
                    h.wait()
                except Exception as e:
                    log.debug("flatcake: another read in flight failed too: %s", e)
        for ev in [e for e in self.scatters + self.busy if e is not None]:
            try:
                ev.synchronize()
            except Exception as e:
                log.debug("flatcake: another scatter in flight failed too: %s", e)


def _layer_runs(f: Fill):
    """(layer, first command, end command) of each run of consecutive commands of one layer."""
    lo = 0
    for i in range(1, len(f.layers) + 1):
        if i == len(f.layers) or f.layers[i] != f.layers[lo]:
            yield f.layers[lo], lo, i
            lo = i


def _done(ev) -> bool | None:
    """Whether ``ev`` has completed; ``None`` when it cannot be polled."""
    d = getattr(ev, "done", None)
    if d is None:
        return None
    r = d() if callable(d) else d                  # futures: a method; cupy events: a property
    return None if r is None else bool(r)


class _Job:
    """A check-and-scatter job on a worker, as an event: ``synchronize`` waits, re-raises."""

    def __init__(self, future) -> None:
        self.future = future

    def done(self) -> bool | None:
        if not self.future.done():
            return False
        ev = self.future.result() if self.future.exception() is None else None
        return True if ev is None else _done(ev)

    def synchronize(self) -> None:
        ev = self.future.result()        # a job's own event (a device scatter), if any
        if ev is not None:
            ev.synchronize()


class _Events:
    """The scatter events of one fill: the buffer is free when all have completed."""

    def __init__(self, events: list) -> None:
        self.events = events

    def done(self) -> bool | None:
        states = [_done(e) for e in self.events]
        return None if None in states else all(states)

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()
