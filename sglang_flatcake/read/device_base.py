"""The device interface the read path calls, and where the kernels' sources are.

``Device`` (implemented by ``device.CudaDevice`` and ``emulated.EmulatedDevice``); see
``device.py`` for the contracts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

EMULATE_ENV = "FLATCAKE_EMULATE_DEVICE"   # "1": SGLang's CPU pools are served as a device
KERNELS = ("checksum.cu", "scatter.cu")   # compiled at start (``Device.compile``)
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
    """The interface; see the module docstring for the contracts.  ``stream=None`` is the
    calling thread's current stream (the legacy default stream unless one was made current)."""

    name = "device"
    index = 0

    def activate(self) -> None: ...                  # the calling thread's current device
    def stream(self): ...                            # a new non-blocking stream, current device
    def empty(self, nbytes: int, dtype=np.uint8): ...      # uninitialised, current device
    def zeros(self, n: int, dtype, stream=None): ...       # memset on ``stream``
    def upload(self, host: np.ndarray, stream=None): ...
    def upload_into(self, dst, host: np.ndarray, stream=None) -> None: ...
    def download(self, arr, stream=None) -> np.ndarray: ...
    def record(self, stream=None): ...
    def wait(self, stream, event) -> None: ...       # ``stream`` waits for ``event`` (device side)
    def forward_event(self, torch_stream=None): ...  # on that stream (the thread's current)
    def launch(self, kernel: str, name: str, grid, block, args, stream=None) -> None: ...
    def free_cache(self) -> None: ...                # give cached, unused memory back
    def asarray(self, x): ...
    def address(self, arr) -> int: ...

    def compile(self, kernels=KERNELS) -> None:
        """Compile (or load) every kernel for the current device now, not inside a restore."""
        for k in kernels:
            self.module(k)

    @property
    def compiled(self) -> set:
        """(kernel, device index) of every module built so far."""
        with self._lock:
            return set(self._modules)

    def module(self, kernel: str):
        """The compiled module of ``kernel`` for the current device, built once."""
        key = (kernel, self.current_index())
        with self._lock:
            if key not in self._modules:
                self._modules[key] = self._build(kernel, kernel_source(kernel))
            return self._modules[key]
