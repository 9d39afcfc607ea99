"""Device memory, streams, events and kernel launches: CUDA, or the same on the host.

The device branch of the read path (``window``, ``scatter``, ``checksum``,
``sglang.hicache.direct``) calls only the methods of ``Device``.  Two implementations:

- ``CudaDevice``: each method is one call into CuPy (the only lines of the read
  path that need a GPU; ``tests/project/gpu_only_lines.txt`` lists them);
- ``EmulatedDevice``: the same contract on host memory, so the device branch
  runs on a CPU machine: device arrays are ``EmuArray`` (an ``ndarray`` subclass,
  so an array's kind is visible from its type), each stream is one worker thread
  that runs its copies and launches in order, an event is a marker on that
  thread, and a launch runs the kernel's registered host twin (``register_twin``)
  with the kernel's own arguments (words, device offsets, output arrays).  It keeps
  the CUDA rules ordering bugs live in (docs/device.md): a legacy default stream
  apart from the non-blocking ones, allocation memsets on a stream, a per-thread
  current device on a machine of two (``EMULATED_DEVICES``), foreign streams (SGLang's
  forward), and ``delay_s``, which holds unwaited work back so a missing wait shows.

Contracts: ``upload``, ``upload_into``, ``zeros``' memset and ``launch`` are
asynchronous on ``stream`` (``None``: the calling thread's current stream, the legacy
default stream unless one was made current) and keep what they read alive until they
ran; ``download`` returns when the bytes are on the host; ``record(stream)`` returns
an event with ``done`` (a property) and ``synchronize()``, which re-raises an error of
the work before it (emulated); ``wait(stream, event)`` orders ``stream``'s later work
after ``event`` without blocking the host.  Allocations and streams belong to the
calling thread's current device (``activate``), as in CUDA.  ``device_of(x)`` is the
device an array lives on, ``None`` for host memory.
"""
from __future__ import annotations

import importlib
import os
import threading

import numpy as np

from .device_base import (EMULATE_ENV, KERNEL_DIRS, KERNELS, NULL, Device, is_null,
                          kernel_path, kernel_source)
from .emulated import (EMULATED, EMULATED_DEVICES, GARBAGE, EmuArray, EmulatedDevice,
                       EmuKvikio, EmuStream, EmuXP, Hazard, emulated_view, register_twin)

__all__ = ["EMULATE_ENV", "KERNEL_DIRS", "KERNELS", "NULL", "Device", "is_null", "kernel_path",
           "kernel_source", "EMULATED", "EMULATED_DEVICES", "GARBAGE", "EmuArray",
           "EmulatedDevice", "EmuKvikio", "EmuStream", "EmuXP", "Hazard", "emulated_view",
           "register_twin", "CudaDevice", "CUDA", "cuda_device", "device_of",
           "emulation_wanted", "window_engine", "NVRTC_OPTIONS"]


# ---------------------------------------------------------------- CUDA (CuPy)
def _cp():
    return importlib.import_module("cupy")


NVRTC_OPTIONS = ("--std=c++14",)      # what CuPy's RawModule gets (tests/read/test_nvrtc.py)


class CudaDevice(Device):
    """CuPy on CUDA device ``index``; modules compiled once per (kernel, device).  Every
    method body is a leaf call into CuPy: these are the lines only a GPU runs to the end
    (``tests/read/test_real_cuda_modules.py`` calls each against the real CuPy without a GPU)."""

    name = "cuda"

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self._modules: dict = {}
        self._lock = threading.Lock()

    def activate(self):
        _cp().cuda.Device(self.index).use()

    def current_index(self):
        return _cp().cuda.Device().id

    def _build(self, kernel, source):
        m = _cp().RawModule(code=source, options=NVRTC_OPTIONS)
        m.compile()                   # now: RawModule alone compiles at the first launch
        return m

    def _on(self, stream):
        return stream or _cp().cuda.get_current_stream()

    def stream(self):
        return _cp().cuda.Stream(non_blocking=True)

    def empty(self, nbytes, dtype=np.uint8):
        return _cp().empty(nbytes // np.dtype(dtype).itemsize, dtype)

    def zeros(self, n, dtype, stream=None):
        with self._on(stream):
            return _cp().zeros(n, dtype)

    def upload(self, host, stream=None):
        with self._on(stream):
            return _cp().asarray(host)

    def upload_into(self, dst, host, stream=None):
        dst.set(host, stream=self._on(stream))

    def download(self, arr, stream=None):
        return _cp().asnumpy(arr, stream=self._on(stream), blocking=True)

    def record(self, stream=None):
        ev = _cp().cuda.Event(disable_timing=True)
        ev.record(self._on(stream))
        return ev

    def wait(self, stream, event):
        self._on(stream).wait_event(event)

    def forward_event(self, torch_stream=None):
        s = torch_stream or importlib.import_module("torch").cuda.current_stream()
        return self.record(_cp().cuda.ExternalStream(s.cuda_stream, s.device_index))

    def launch(self, kernel, name, grid, block, args, stream=None):
        with self._on(stream):                          # RawKernel takes no stream=
            self.module(kernel).get_function(name)(grid, block, args)

    def free_cache(self):
        _cp().get_default_memory_pool().free_all_blocks()

    def asarray(self, x):
        return _cp().asarray(x)

    def address(self, arr):
        return arr.data.ptr


CUDA = CudaDevice(0)
_cuda: dict[int, CudaDevice] = {0: CUDA}


def cuda_device(index: int) -> CudaDevice:
    return _cuda.setdefault(index, CudaDevice(index))


def device_of(x) -> Device | None:
    """The device ``x`` lives on (torch tensors, cupy arrays, ``EmuArray``), or ``None``."""
    if isinstance(x, EmuArray):
        return EMULATED_DEVICES[x.emu_index]
    if type(x).__module__.split(".")[0] == "torch":
        return cuda_device(x.device.index or 0) if x.device.type == "cuda" else None
    return cuda_device(x.device.id) if hasattr(x, "__cuda_array_interface__") else None


def emulation_wanted() -> bool:
    return os.environ.get(EMULATE_ENV, "") not in ("", "0")


def window_engine(device: Device, alignment: int, threads: int):
    """The engine that reads files straight into ``device`` memory (kvikio)."""
    from ..io.kvikio_engine import KvikioEngine
    if isinstance(device, EmulatedDevice):
        return KvikioEngine(alignment=alignment, threads=threads, kvikio_module=EmuKvikio,
                            array_module=EmuXP)
    return KvikioEngine(alignment=alignment, threads=threads)
