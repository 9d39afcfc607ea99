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

The stages of one restore (issue, land, verify, scatter, release) are in
``window_run.py``.  In a host window each command is checked and scattered as soon as
it lands, so the scatter of a layer overlaps its own later reads as well as the next
layer's; a device window checks a whole fill with one launch and scatters it with one
launch per layer run.  Buffer
ownership: the window's; lent to the engine from ``submit`` until the
command's handle is waited for, then to ``scatter_fn`` until it returns (host),
until its job ends (``workers``), or until the event it returns has completed
(device).  On a device window the checksum kernel and the scatter run on
``window.stream`` (a device ``scatter_fn`` must launch there), so a buffer is
free once the last event of its fill has completed.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from . import device as dv
from ..io.base import IOEngine
from ..layout import align_up
from .fills import plan_fills
from .planner import ReadPlan
from .window_run import WindowRun

__all__ = ["LayerWindow", "LayerTiming", "RestoreStats", "ScatterFn", "plan_fills"]

ScatterFn = Callable[..., object]
"""``scatter_fn(layer, window, src_offsets, dest_blocks[, mask]) -> None | event``: copy
every piece (byte offset ``src_offsets[i]`` of ``window``) into request block
``dest_blocks[i]`` of ``layer``; an event return (``.synchronize()``) means the copy may
still be running.  A verified device window passes ``mask``: a device uint8 flag per
piece, 0 for a piece whose checksum failed (not to be copied)."""



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
        if self.dev is not None:
            self.dev.compile()          # both kernels now, not inside the first restore
        self.pool = ThreadPoolExecutor(workers, "flatcake-scatter") if workers else None

    def after(self, event) -> None:
        """The window's later device work (uploads, checksums, scatters) waits for ``event``
        (e.g. SGLang's forward pass, still writing slots a restore is about to fill);
        the host does not wait."""
        if self.dev is None:
            raise ValueError("a host window has no stream to order")
        self.dev.wait(self.stream, event)

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
        t_start = time.perf_counter()
        run = WindowRun(self, plan, scatter_fn, verify, order)
        tally = run.run()
        fills = run.fills
        return RestoreStats(
            layers=len(tally.per_layer), fills=len(fills),
            commands=sum(len(f.commands) for f in fills),
            bytes_read=sum(c.length for f in fills for c in f.commands),
            pieces=sum(len(f.piece_src) for f in fills), read_waits=tally.read_waits,
            read_wait_s=tally.read_wait_s, buffer_waits=tally.buffer_waits,
            buffer_wait_s=tally.buffer_wait_s, scatter_s=tally.scatter_s,
            total_s=time.perf_counter() - t_start, verified=verify,
            corrupt=tuple(sorted({int(x) for c in tally.corrupt for x in c})),
            per_layer=tuple(LayerTiming(lay, *v) for lay, v in sorted(tally.per_layer.items())))
