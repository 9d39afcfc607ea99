"""Device memory, streams, events and kernel launches: CUDA, or the same on the host.

The device branch of the read path (``window``, ``scatter``, ``checksum``,
``sglang.direct``) calls only the methods of ``Device``.  Two implementations:

- ``CudaDevice``: each method is one call into CuPy (the only lines of the read
  path that need a GPU; ``tests/gpu_only_lines.txt`` lists them);
- ``EmulatedDevice``: the same contract on host memory, so the device branch
  runs on a CPU machine: device arrays are ``EmuArray`` (an ``ndarray`` subclass,
  so an array's kind is visible from its type), each stream is one worker thread
  that runs its copies and launches in order, an event is a marker on that
  thread, and a launch runs the kernel's registered host twin (``register_twin``)
  with the kernel's own arguments (words, device offsets, output arrays).

Contracts: ``upload`` and ``launch`` are asynchronous on ``stream`` (``None``: the
device's default stream) and keep what they read alive until they ran;
``download`` returns when the bytes are on the host; ``record(stream)`` returns an
event with ``done`` (a property) and ``synchronize()``, which re-raises an error of
the work before it (emulated).  ``device_of(x)`` is the device an array lives on,
``None`` for host memory.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

EMULATE_ENV = "FLATCAKE_EMULATE_DEVICE"   # "1": SGLang's CPU pools are served as a device
NULL = np.uint64(0)        # a null pointer kernel argument (CuPy takes no None); twins see it too


def is_null(arg) -> bool:
    return arg is None or (isinstance(arg, np.integer) and int(arg) == 0)
KERNEL_DIRS = (Path(__file__).resolve().parents[2] / "kernels",   # a source checkout
               Path(__file__).resolve().parents[1] / "kernels")    # an installed wheel


def kernel_path(name: str) -> Path:
    """Where kernel source ``name`` (e.g. ``scatter.cu``) is: the checkout's top-level
    ``kernels/``, or the copy the wheel installs inside the package."""
    for d in KERNEL_DIRS:
        if (d / name).is_file():
            return d / name
    return KERNEL_DIRS[0] / name


def kernel_source(name: str) -> str:
    p = kernel_path(name)
    try:
        return p.read_text()
    except OSError as e:
        raise RuntimeError(f"CUDA source {p} is missing: {e.strerror}") from None


class Device:
    """The interface; see the module docstring for each method's contract."""

    name = "device"

    def empty(self, nbytes: int, dtype=np.uint8): ...
    def upload(self, host: np.ndarray, stream=None): ...
    def download(self, arr, stream=None) -> np.ndarray: ...
    def stream(self): ...
    def record(self, stream=None): ...
    def launch(self, kernel: str, name: str, grid, block, args, stream=None) -> None: ...
    def asarray(self, x): ...
    def address(self, arr) -> int: ...


# ---------------------------------------------------------------- CUDA (CuPy)
def _cp():
    import cupy
    return cupy


class CudaDevice(Device):
    """CuPy on the current CUDA device; modules compiled once per (kernel, device).
    Every method body is a leaf call into CuPy: these are the lines only a GPU runs."""

    name = "cuda"

    def __init__(self) -> None:
        self._modules: dict = {}
        self._lock = threading.Lock()

    def empty(self, nbytes, dtype=np.uint8):
        return _cp().zeros(nbytes // np.dtype(dtype).itemsize, dtype)

    def upload(self, host, stream=None):
        with stream or _cp().cuda.get_current_stream():
            return _cp().asarray(host)

    def download(self, arr, stream=None):
        return _cp().asnumpy(arr, stream=stream, blocking=True)

    def stream(self):
        return _cp().cuda.Stream(non_blocking=True)

    def record(self, stream=None):
        ev = _cp().cuda.Event(disable_timing=True)
        ev.record(stream)
        return ev

    def launch(self, kernel, name, grid, block, args, stream=None):
        key = (kernel, _cp().cuda.Device().id)
        with self._lock:
            if key not in self._modules:
                self._modules[key] = _cp().RawModule(code=kernel_source(kernel),
                                                     options=("--std=c++14",))
        with stream or _cp().cuda.get_current_stream():     # RawKernel takes no stream=
            self._modules[key].get_function(name)(grid, block, args)

    def asarray(self, x):
        return _cp().asarray(x)

    def address(self, arr):
        return arr.data.ptr


# ---------------------------------------------------------------- emulated
class EmuArray(np.ndarray):
    """Host memory standing for device memory (slices and views stay ``EmuArray``)."""


class EmuStream:
    """One worker thread: work runs in submission order, as on a CUDA stream."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flatcake-emu-stream")
        self.pending: list[Future] = []     # work since the last event (its errors surface there)

    def submit(self, fn: Callable, *args) -> Future:
        return self._pool.submit(fn, *args)

    def synchronize(self) -> None:
        self.submit(lambda: None).result()

    def close(self) -> None:
        """Wait for the work submitted, then stop the thread."""
        self._pool.shutdown(wait=True)


class EmuEvent:
    """A marker on an ``EmuStream``: done once everything submitted before it ran."""

    def __init__(self, future: Future, before: list[Future]) -> None:
        self._future, self._before = future, before

    @property
    def done(self) -> bool:
        return self._future.done()

    def synchronize(self) -> None:
        self._future.result()
        for f in self._before:          # an error of the work before the event
            f.result()


_twins: dict[tuple[str, str], Callable] = {}


def register_twin(kernel: str, prefix: str, fn: Callable) -> None:
    """The host twin run by an emulated launch of any function of ``kernel`` whose name
    starts with ``prefix``; ``fn(name, *args)`` takes the kernel's own arguments."""
    _twins[(kernel, prefix)] = fn


class EmulatedDevice(Device):
    name = "emulated"

    def __init__(self) -> None:
        self._default = EmuStream()
        self._lock = threading.Lock()

    def empty(self, nbytes, dtype=np.uint8):
        return np.zeros(nbytes // np.dtype(dtype).itemsize, dtype).view(EmuArray)

    def _submit(self, stream, fn, *args) -> Future:
        s = stream or self._default
        fut = s.submit(fn, *args)
        with self._lock:
            s.pending.append(fut)
        return fut

    def upload(self, host, stream=None):
        host = np.ascontiguousarray(host)
        out = np.empty_like(host).view(EmuArray)
        self._submit(stream, np.copyto, out, host)
        return out

    def download(self, arr, stream=None):
        self.record(stream).synchronize()
        return np.array(arr.view(np.ndarray))

    def stream(self):
        return EmuStream()

    def record(self, stream=None):
        s = stream or self._default
        with self._lock:
            before, s.pending = s.pending, []
        return EmuEvent(s.submit(lambda: None), before)

    def launch(self, kernel, name, grid, block, args, stream=None):
        twin = next((f for (k, p), f in _twins.items() if k == kernel and name.startswith(p)),
                    None)
        if twin is None:
            raise RuntimeError(f"no host twin for {kernel}:{name} (register_twin)")
        kernel_path(kernel)           # the source must exist, as a CUDA launch compiles it
        self._submit(stream, twin, name, *args)

    def asarray(self, x):
        return x

    def address(self, arr):
        return arr.ctypes.data


CUDA = CudaDevice()
EMULATED = EmulatedDevice()


def device_of(x) -> Device | None:
    """The device ``x`` lives on (torch tensors, cupy arrays, ``EmuArray``), or ``None``."""
    if isinstance(x, EmuArray):
        return EMULATED
    if type(x).__module__.split(".")[0] == "torch":
        return CUDA if x.device.type == "cuda" else None
    return CUDA if hasattr(x, "__cuda_array_interface__") else None


def emulated_view(t):
    """A CPU tensor or array as emulated device memory (same bytes, shape and item size)."""
    if isinstance(t, np.ndarray):
        return t.view(EmuArray)
    import torch
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()]).numpy().view(EmuArray)


def emulation_wanted() -> bool:
    return os.environ.get(EMULATE_ENV, "") not in ("", "0")


class EmuXP:
    """The two pieces of CuPy's namespace ``KvikioEngine.alloc`` uses, on ``EmuArray``."""

    uint8 = np.uint8

    @staticmethod
    def empty(n, dtype=np.uint8):
        return np.zeros(n, dtype).view(EmuArray)


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


def window_engine(device: Device, alignment: int, threads: int):
    """The engine that reads files straight into ``device`` memory (kvikio)."""
    from ..io.kvikio_engine import KvikioEngine
    if device is EMULATED:
        return KvikioEngine(alignment=alignment, threads=threads, kvikio_module=EmuKvikio,
                            array_module=EmuXP)
    return KvikioEngine(alignment=alignment, threads=threads)
