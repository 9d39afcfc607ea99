"""The layer window: read layer l+1 while layer l is scattered into paged KV slots.

``LayerWindow`` owns ``depth`` buffers of ``layer_capacity_bytes`` each, from
``engine.alloc``: device memory with the kvikio engine (CUDA, or the emulated
device of ``device.py``), aligned host memory with the POSIX engine.  ``restore(plan, scatter_fn)`` walks the plan's layers
in order.  Each layer's commands (``plan.commands_for_layer(l)``) become one or
more *fills*: consecutive commands packed into one buffer; a command longer
than a buffer is split between pieces (never inside one).  Fills are read
``depth`` ahead; when every buffer is busy the next read waits until the
scatters out of the oldest buffer have ended.  Nothing is cancelled: after an
error every read and scatter in flight is still waited for before ``restore``
raises, so no buffer is touched after it returns.  ``order="file"`` packs the
commands in file order instead (a restore nothing consumes layer by layer).

Each command is checked and scattered as soon as it lands, so the scatter of a
layer overlaps its own later reads as well as the next layer's.  Buffer
ownership: the window's; lent to the engine from ``submit`` until the
command's handle is waited for, then to ``scatter_fn`` until it returns (host),
until its job ends (``workers``), or until the event it returns has completed
(device).  On a device window the checksum kernel and the scatter run on
``window.stream`` (a device ``scatter_fn`` must launch there), so a buffer is
free once the last event of its fill has completed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from . import checksum
from . import device as dv
from ..io.base import IOEngine
from ..layout import align_up
from .fills import plan_fills
from .planner import ReadPlan

ScatterFn = Callable[..., object]
"""``scatter_fn(layer, window, src_offsets, dest_blocks[, mask]) -> None | event``: copy
every piece (byte offset ``src_offsets[i]`` of ``window``) into request block
``dest_blocks[i]`` of ``layer``; an event return (``.synchronize()``) means the copy may
still be running.  A verified device window passes ``mask``: a device uint8 flag per
piece, 0 for a piece whose checksum failed (not to be copied)."""

log = logging.getLogger("sglang_flatcake")
WAIT_THRESHOLD_S = 20e-6   # a read wait longer than this counts in ``read_waits``


@dataclass(frozen=True)
class LayerTiming:
    layer: int
    fills: int                        # fills holding commands of this layer
    commands: int
    bytes: int
    read_wait_s: float                # time the pipeline blocked on this layer's reads
    scatter_s: float                  # host time in scatter_fn (launch time on a device)


@dataclass(frozen=True)
class RestoreStats:
    layers: int
    fills: int
    commands: int                     # read commands issued (after splitting)
    bytes_read: int
    pieces: int
    read_waits: int                   # commands not landed when the pipeline wanted them
    read_wait_s: float
    buffer_waits: int                 # reads that waited for a scatter to free a buffer
    buffer_wait_s: float
    scatter_s: float
    total_s: float
    verified: bool
    corrupt: tuple[int, ...]          # request blocks whose checksum failed (not scattered)
    per_layer: tuple[LayerTiming, ...]

    @property
    def gib_s(self) -> float:
        return self.bytes_read / self.total_s / (1 << 30) if self.total_s > 0 else 0.0


class LayerWindow:
    def __init__(self, engine: IOEngine, layer_capacity_bytes: int, depth: int = 2,
                 device: str = "cpu", workers: int = 0) -> None:
        """Allocate ``depth`` buffers; ``device`` ("cpu", "cuda" or "emulated") must match
        what ``engine.alloc`` returns.

        ``workers`` > 0 (host windows only) runs each landed command's checksum and
        scatter as one job on that many threads (xxhash and the numba twin release the
        GIL), so several commands are checked and copied at once while their bytes are
        still in cache.  Host buffers are touched here, so no restore page-faults on them.
        """
        if depth < 2:
            raise ValueError(f"depth={depth!r} is not allowed: expected >= 2 (a double buffer)")
        if layer_capacity_bytes <= 0:
            raise ValueError(f"layer_capacity_bytes={layer_capacity_bytes!r}: expected > 0")
        if device not in ("cpu", "cuda", "emulated"):
            raise ValueError(f"device={device!r} is not allowed: cpu, cuda or emulated")
        if workers < 0 or (workers and device != "cpu"):
            raise ValueError(f"workers={workers!r} is not allowed: >= 0, and 0 on a device")
        self.engine, self.device, self.depth = engine, device, depth
        self.capacity = align_up(layer_capacity_bytes, engine.alignment)
        self.buffers = [engine.alloc(self.capacity) for _ in range(depth)]
        self.dev = dv.device_of(self.buffers[0])
        got = "cpu" if self.dev is None else self.dev.name
        if got != device:
            raise ValueError(f"engine {engine.name!r} allocates {got} buffers but "
                             f"device={device!r} (a device window needs the kvikio engine)")
        if self.dev is None:
            for b in self.buffers:
                b[:] = 0
        self.stream = None if self.dev is None else self.dev.stream()
        self.pool = ThreadPoolExecutor(workers, "flatcake-scatter") if workers else None

    def close(self) -> None:
        """Stop the worker threads and the device stream (the buffers go with the window)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        close = getattr(self.stream, "close", None)    # an emulated stream's thread
        if close is not None:
            close()

    def restore(self, plan: ReadPlan, scatter_fn: ScatterFn, verify: bool = False,
                order: str = "layer") -> RestoreStats:
        """Read ``plan`` through the window, scattering each command as it lands.

        ``order`` (see ``plan_fills``): "layer" reads layer by layer, layer l+1 while
        layer l is scattered; "file" reads in file order (faster on a disk, for
        restores that nothing consumes layer by layer).

        With ``verify`` every piece's XXH3-64 is checked where it landed before its
        scatter: by the host library in a host window, by ``kernels/checksum.cu`` on
        ``self.stream`` in a device window (the scatter then gets the flags as its
        ``mask``); a piece that fails is not scattered and its block is listed in
        ``corrupt``.  An I/O error or an exception from ``scatter_fn`` propagates
        after all reads and scatters end.
        """
        fills = plan_fills(plan, self.capacity, self.engine.alignment, order)
        dev, on_device = self.dev, verify and self.dev is not None
        bases = np.cumsum([0] + [len(f.piece_src) for f in fills])
        flags = dev.empty(max(1, int(bases[-1]))) if on_device else None
        t_start = time.perf_counter()
        inflight: deque = deque()                      # (fill index, buffer, handles)
        events: list = [None] * self.depth
        acc = {"rw": 0, "rws": 0.0, "bw": 0, "bws": 0.0, "sc": 0.0}
        per_layer = {lay: [0, 0, 0, 0.0, 0.0] for f in fills for lay in f.layers}
        corrupt: list[np.ndarray] = []
        lock = threading.Lock()

        def land(k: int, buf, i: int):
            """Check and scatter the pieces of command ``i`` of fill ``k`` (any thread)."""
            f = fills[k]
            sel = slice(f.bounds[i], f.bounds[i + 1])
            src, dest = f.piece_src[sel], f.piece_dest[sel]
            t = time.perf_counter()
            if on_device:
                mask = flags[bases[k] + sel.start:bases[k] + sel.stop]
                checksum.verify_on_device(dev, buf, src, f.piece_checksum[sel],
                                          plan.piece_bytes, mask, self.stream)
                checked = dev.record(self.stream)
                ev = scatter_fn(f.layers[i], buf[:f.nbytes], src, dest, mask)
                ev = checked if ev is None else ev
            else:
                if verify:
                    ok = checksum.verify_host(buf, src, f.piece_checksum[sel], plan.piece_bytes)
                    if not ok.all():
                        corrupt.append(dest[~ok])
                        src, dest = src[ok], dest[ok]
                t = time.perf_counter()
                ev = scatter_fn(f.layers[i], buf[:f.nbytes], src, dest)
            dt = time.perf_counter() - t
            with lock:
                per_layer[f.layers[i]][4] += dt
                acc["sc"] += dt
            return ev

        def issue(k: int, b: int) -> None:
            ev = events[b]
            if ev is not None:                     # the scatters that used buffer b must end
                t = time.perf_counter()
                if _done(ev) is not True:
                    acc["bw"] += 1
                ev.synchronize()
                acc["bws"] += time.perf_counter() - t
                events[b] = None
            f, buf = fills[k], self.buffers[b]
            targets = [buf[o:o + c.length] for c, o in zip(f.commands, f.offsets)]
            inflight.append((k, b, self.engine.submit(f.commands, targets)))

        pending: deque = deque()        # (fill, buffer): fills waiting for their buffer

        def pump(block: bool) -> None:
            """Issue waiting fills whose buffer is free; with ``block``, wait for the first.
            An event that cannot be polled (no ``done``) is waited for at once."""
            while pending:
                k, b = pending[0]
                if not block and events[b] is not None and _done(events[b]) is False:
                    return
                pending.popleft()
                issue(k, b)
                block = False

        cur: list = []          # the fill being landed: handles not yet waited for, events
        try:
            for k in range(min(self.depth, len(fills))):
                issue(k, k)
            while inflight or pending:
                if not inflight:
                    pump(block=True)
                    continue
                k, b, handles = inflight.popleft()
                f, buf = fills[k], self.buffers[b]
                cur = [list(handles), []]
                for i in range(len(handles)):
                    pump(block=False)
                    t = time.perf_counter()
                    cur[0].pop(0).wait()
                    waited = time.perf_counter() - t
                    acc["rw"] += waited > WAIT_THRESHOLD_S
                    acc["rws"] += waited
                    lt = per_layer[f.layers[i]]
                    lt[1] += 1
                    lt[2] += f.commands[i].length
                    lt[3] += waited
                    ev = (_Done(self.pool.submit(land, k, buf, i)) if self.pool is not None
                          else land(k, buf, i))
                    if ev is not None:
                        cur[1].append(ev)
                events[b] = _Events(cur[1]) if cur[1] else None
                cur = []
                for lay in set(f.layers):
                    per_layer[lay][0] += 1
                if k + self.depth < len(fills):
                    pending.append((k + self.depth, b))
                pump(block=False)
            for b, ev in enumerate(events):
                if ev is not None:
                    events[b] = None
                    ev.synchronize()
            if on_device and bases[-1]:
                dests = np.concatenate([f.piece_dest for f in fills])
                corrupt.append(dests[dev.download(flags[:bases[-1]], self.stream) == 0])
        except BaseException:
            # never leave a read or a scatter running on our buffers; the first error is raised
            for handles in ([cur[0]] if cur else []) + [h for _, _, h in inflight]:
                try:
                    _wait_all(handles)
                except Exception as e:      # the first error is the one raised
                    log.debug("flatcake: another read in flight failed too: %s", e)
            for ev in (cur[1] if cur else []) + [e for e in events if e is not None]:
                try:
                    ev.synchronize()
                except Exception as e:
                    log.debug("flatcake: another scatter in flight failed too: %s", e)
            raise
        return RestoreStats(
            layers=len(per_layer), fills=len(fills), commands=sum(len(f.commands) for f in fills),
            bytes_read=sum(c.length for f in fills for c in f.commands),
            pieces=sum(len(f.piece_src) for f in fills), read_waits=acc["rw"],
            read_wait_s=acc["rws"], buffer_waits=acc["bw"], buffer_wait_s=acc["bws"],
            scatter_s=acc["sc"], total_s=time.perf_counter() - t_start, verified=verify,
            corrupt=tuple(sorted({int(x) for c in corrupt for x in c})),
            per_layer=tuple(LayerTiming(lay, *v) for lay, v in sorted(per_layer.items())))


def _wait_all(handles: Sequence) -> None:
    """Wait for every handle, then raise the first error (buffers stay ours until all end)."""
    first = None
    for h in handles:
        try:
            h.wait()
        except Exception as e:
            first = first or e
    if first is not None:
        raise first


def _done(ev) -> bool | None:
    """Whether ``ev`` has completed; ``None`` when it cannot be polled."""
    d = getattr(ev, "done", None)
    if d is None:
        return None
    r = d() if callable(d) else d                  # futures: a method; cupy events: a property
    return None if r is None else bool(r)


class _Done:
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

