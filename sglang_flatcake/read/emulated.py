"""The emulated device: the ``Device`` contract on host memory, with the CUDA rules that
ordering bugs live in (docs/device.md), and the emulated kvikio that reads into it."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from .device_base import Device

_tls = threading.local()      # the emulated machine's per-thread state: .index, .streams
GARBAGE = 0xA5                # what uninitialised emulated memory holds


def _current_emu() -> int:
    return getattr(_tls, "index", 0)


class EmuArray(np.ndarray):
    """Host memory standing for device memory of emulated device ``emu_index`` (slices
    and views stay ``EmuArray`` on the same device)."""

    def __array_finalize__(self, obj) -> None:
        self.emu_index = getattr(obj, "emu_index", 0)


def _emu_array(host: np.ndarray, index: int) -> EmuArray:
    out = host.view(EmuArray)
    out.emu_index = index
    return out


def _root(a: np.ndarray) -> np.ndarray:
    """The array that owns ``a``'s memory (hazards are tracked per allocation)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class Hazard(RuntimeError):
    """Emulated memory used on one stream while another stream's work on it is still
    pending and nothing orders the two (a missing ``wait``)."""


class EmuStream:
    """One worker thread: work runs in submission order, as on a CUDA stream.

    ``non_blocking=False`` streams and the ``legacy`` default stream order against each
    other as CUDA's legacy stream does; non-blocking streams order with nothing but the
    events they ``wait`` for.  With the device's ``delay_s`` > 0 every operation waits
    that long before it runs unless something waits for it (an event's ``synchronize``,
    a ``download``, another stream's ``wait``): unordered work stays pending, so a missing
    wait shows as a ``Hazard`` or as wrong bytes."""

    def __init__(self, device: "EmulatedDevice", non_blocking: bool = True,
                 legacy: bool = False) -> None:
        self.device, self.index = device, device.index
        self.non_blocking, self.legacy = non_blocking and not legacy, legacy
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flatcake-emu-stream")
        self._cv = threading.Condition()
        self.seq = self._released = 0
        self.pending: list[Future] = []     # work since the last event (its errors surface there)
        self.last: Future | None = None
        self.after: dict[int, int] = {}     # id(stream) -> its last op this stream waited for

    def submit(self, fn: Callable, *args) -> Future:
        with self._cv:
            self.seq += 1
            seq, due = self.seq, time.monotonic() + self.device.delay_s

        def run():
            with self._cv:
                self._cv.wait_for(lambda: self._released >= seq or time.monotonic() >= due,
                                  timeout=max(0.0, due - time.monotonic()))
            return fn(*args)
        self.last = self._pool.submit(run)
        return self.last

    def release(self) -> None:
        """Someone waits for this stream: run what it holds now."""
        with self._cv:
            self._released = self.seq
            self._cv.notify_all()

    def synchronize(self) -> None:
        fut = self.submit(lambda: None)
        self.release()
        fut.result()

    def close(self) -> None:
        """Wait for the work submitted, then stop the thread."""
        self.release()
        self._pool.shutdown(wait=True)


class EmuEvent:
    """A marker on an ``EmuStream``: done once everything submitted before it ran."""

    def __init__(self, stream: EmuStream, future: Future, before: list[Future]) -> None:
        self.stream, self.seq = stream, stream.seq
        self._future, self._before = future, before

    @property
    def done(self) -> bool:
        return self._future.done()

    def synchronize(self) -> None:
        self.stream.release()
        self._future.result()
        for f in self._before:          # an error of the work before the event
            f.result()


_twins: dict[tuple[str, str], Callable] = {}


def register_twin(kernel: str, prefix: str, fn: Callable) -> None:
    """The host twin run by an emulated launch of any function of ``kernel`` whose name
    starts with ``prefix``; ``fn(name, *args)`` takes the kernel's own arguments."""
    _twins[(kernel, prefix)] = fn


class _EmuModule:
    def __init__(self, kernel: str) -> None:
        self.kernel = kernel

    def get_function(self, name: str) -> Callable:
        twin = next((f for (k, p), f in _twins.items() if k == self.kernel
                     and name.startswith(p)), None)
        if twin is None:
            raise RuntimeError(f"no host twin for {self.kernel}:{name} (register_twin)")
        return twin


class EmulatedDevice(Device):
    """Emulated device ``index`` of an emulated machine (``EMULATED_DEVICES``), with CUDA's
    rules: allocations land on the calling thread's current device, a stream belongs to
    the device current when it was made and is refused under another, memory of another
    device cannot be launched on, ``zeros`` is a memset on a stream, and memory with
    pending work on one stream used on another without a ``wait`` raises ``Hazard``
    (``hazards`` counts them).  ``ops`` counts uploads, launches and events."""

    name = "emulated"

    def __init__(self, index: int = 0, delay_s: float = 0.0) -> None:
        self.index, self.delay_s = index, delay_s
        self._lock = threading.Lock()
        self._modules: dict = {}
        self.blocking_streams: list[EmuStream] = []     # non_blocking=False: legacy waits on them
        self._last: dict[int, tuple] = {}        # id(root array) -> (root, stream, seq, future)
        self.ops = {"upload": 0, "launch": 0, "event": 0, "memset": 0, "alloc_bytes": 0}
        self.hazards = 0
        self.legacy = EmuStream(self, legacy=True)

    @property
    def tracked(self) -> int:
        """Allocations whose last stream operation the hazard check remembers and that
        has not finished yet (finished entries are forgotten here too)."""
        with self._lock:
            self._last = {k: v for k, v in self._last.items() if not v[3].done()}
            return len(self._last)

    def activate(self):
        _tls.index = self.index

    def current_index(self):
        return _current_emu()

    def _build(self, kernel, source):
        return _EmuModule(kernel)

    def current_stream(self) -> EmuStream:
        """The calling thread's current stream on the current device (``use_stream``)."""
        cur = EMULATED_DEVICES[_current_emu()]
        return getattr(_tls, "streams", {}).get(cur.index) or cur.legacy

    @contextlib.contextmanager
    def use_stream(self, stream: EmuStream):
        """Make ``stream`` the calling thread's current stream (``with cupy_stream:``)."""
        if not hasattr(_tls, "streams"):
            _tls.streams = {}
        old = _tls.streams.get(stream.index)
        _tls.streams[stream.index] = stream
        try:
            yield stream
        finally:
            _tls.streams[stream.index] = old

    def _ordered(self, s: EmuStream, t: EmuStream, seq: int) -> bool:
        """Whether work on ``s`` submitted now runs after op ``seq`` of stream ``t``."""
        return (s is t or s.after.get(id(t), 0) >= seq
                or (s.legacy and not t.non_blocking) or (t.legacy and not s.non_blocking))

    def _touch(self, s: EmuStream, arrays, fut: Future | None) -> None:
        """Check ``arrays`` for a pending op of another stream not ordered before ``s``'s
        next op (raises ``Hazard``); with ``fut``, record it as their last op."""
        for a in arrays:
            if not isinstance(a, EmuArray):
                continue
            r = _root(a)
            with self._lock:
                last = self._last.get(id(r))
            if last is not None and last[0] is r and not last[3].done() \
                    and not self._ordered(s, last[1], last[2]):
                self.hazards += 1
                raise Hazard(f"emulated memory of {a.nbytes} bytes used on a stream while "
                             "another stream's work on it is pending, with no wait between")
            if fut is not None:
                with self._lock:
                    self._last[id(r)] = (r, s, s.seq, fut)
                    if len(self._last) > 1024:      # forget finished work (keeps no memory alive)
                        self._last = {k: v for k, v in self._last.items() if not v[3].done()}

    def _submit(self, stream, fn, *args, touches=()) -> Future:
        s = stream or self.current_stream()
        cur = _current_emu()
        if s.index != cur:
            raise RuntimeError(f"a stream of emulated device {s.index} is used while device "
                               f"{cur} is current (CUDA refuses this; activate the device)")
        self._touch(s, touches, None)
        dev = s.device
        deps = ([b.last for b in dev.blocking_streams if b.last is not None] if s.legacy else
                [] if s.non_blocking or dev.legacy.last is None else [dev.legacy.last])
        if deps:
            s.submit(lambda: [f.result() for f in deps])
        fut = s.submit(fn, *args)
        self._touch(s, touches, fut)
        with self._lock:
            s.pending.append(fut)
        return fut

    def stream(self, non_blocking: bool = True):
        s = EmuStream(EMULATED_DEVICES[_current_emu()], non_blocking)
        if not non_blocking:
            s.device.blocking_streams.append(s)
        return s

    def empty(self, nbytes, dtype=np.uint8):
        self.ops["alloc_bytes"] += nbytes
        return _emu_array(np.full(nbytes, GARBAGE, np.uint8).view(dtype), _current_emu())

    def zeros(self, n, dtype, stream=None):
        out = self.empty(n * np.dtype(dtype).itemsize, dtype)
        self.ops["memset"] += 1
        self._submit(stream, out.fill, 0, touches=(out,))
        return out

    def upload(self, host, stream=None):
        host = np.array(host)                  # a pageable copy: the caller may reuse ``host``
        out = _emu_array(np.empty_like(host), _current_emu())
        self.ops["upload"] += 1
        self.ops["alloc_bytes"] += host.nbytes
        self._submit(stream, np.copyto, out, host, touches=(out,))
        return out

    def upload_into(self, dst, host, stream=None):
        self._check_owner([dst])
        self.ops["upload"] += 1
        self._submit(stream, np.copyto, dst, np.asarray(host).reshape(dst.shape), touches=(dst,))

    def download(self, arr, stream=None):
        s = stream or self.current_stream()
        self.record(s).synchronize()
        self._touch(s, [arr], None)
        return np.array(arr.view(np.ndarray))

    def record(self, stream=None):
        s = stream or self.current_stream()
        self.ops["event"] += 1
        fut = self._submit(s, lambda: None)
        with self._lock:
            before, s.pending = s.pending, []
        return EmuEvent(s, fut, before)

    def wait(self, stream, event):
        s = stream or self.current_stream()
        self._submit(s, event.synchronize)
        s.after[id(event.stream)] = max(s.after.get(id(event.stream), 0), event.seq)

    def forward_event(self, stream=None):
        return self.record(stream or self.current_stream())

    def _check_owner(self, arrays) -> None:
        cur = _current_emu()
        for a in arrays:
            if isinstance(a, EmuArray) and a.emu_index != cur:
                raise RuntimeError(f"memory of emulated device {a.emu_index} used by a launch "
                                   f"on device {cur}")

    def launch(self, kernel, name, grid, block, args, stream=None):
        fn = self.module(kernel).get_function(name)
        self._check_owner(args)
        self.ops["launch"] += 1
        self._submit(stream, fn, name, *args, touches=args)

    def free_cache(self):
        self.ops["free_cache"] = self.ops.get("free_cache", 0) + 1

    def asarray(self, x):
        return x

    def address(self, arr):
        return arr.ctypes.data


EMULATED_DEVICES = (EmulatedDevice(0), EmulatedDevice(1))    # a machine with two devices
EMULATED = EMULATED_DEVICES[0]


def emulated_view(t, index: int = 0):
    """A CPU tensor or array as memory of emulated device ``index`` (same bytes, shape and
    item size)."""
    if not isinstance(t, np.ndarray):
        import torch
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        t = t.view(ints[t.element_size()]).numpy()
    return _emu_array(t, index)


class EmuXP:
    """The two pieces of CuPy's namespace ``KvikioEngine.alloc`` uses, on ``EmuArray``."""

    uint8 = np.uint8

    @staticmethod
    def empty(n, dtype=np.uint8):
        return EMULATED.empty(n * np.dtype(dtype).itemsize, dtype)


class EmuKvikio:
    """kvikio's file API over ``os.preadv``/``pwrite`` on a thread pool (the emulated
    device's window engine: ``KvikioEngine(kvikio_module=EmuKvikio, array_module=EmuXP)``)."""

    class CompatMode:
        ON, OFF, AUTO = "on", "off", "auto"

    class defaults:
        settings: dict = {}

        @classmethod
        def set(cls, d):
            cls.settings.update(d)

        @staticmethod
        def is_compat_mode_preferred():
            return True

    pool = ThreadPoolExecutor(4, thread_name_prefix="flatcake-emu-kvikio")

    class CuFile:
        def __init__(self, path, flags="r"):
            try:
                self.fd = os.open(path, os.O_RDWR if "+" in flags else os.O_RDONLY)
            except OSError as e:
                raise RuntimeError(f"Unable to open file: {e.strerror}") from None

        def pread(self, buf, size, file_offset):
            return EmuKvikio.Future(EmuKvikio.pool.submit(
                os.preadv, self.fd, [memoryview(buf.view(np.ndarray))[:size]], file_offset))

        def pwrite(self, buf, size, file_offset):
            return EmuKvikio.Future(EmuKvikio.pool.submit(
                os.pwrite, self.fd, memoryview(buf.view(np.ndarray))[:size], file_offset))

        def close(self):
            os.close(self.fd)

    class Future:
        def __init__(self, f):
            self.f = f

        def get(self):
            return self.f.result()

        def done(self):
            return self.f.done()
