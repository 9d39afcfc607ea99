"""``CudaDevice`` and the kvikio engine against the real CuPy and kvikio wheels, without a GPU.

Both import on a CPU machine; a call that needs the driver raises CuPy's
``CUDARuntimeError`` (or torch's no-driver ``RuntimeError``).  Each ``CudaDevice``
method is called: reaching the driver proves the names, signatures and arguments it
passes exist in the real modules (an ``AttributeError`` or ``TypeError`` would be a bug
a GPU would meet first).  Skipped when the wheels are not installed (the ``test`` extra
installs them).
"""

from __future__ import annotations

import numpy as np
import pytest

from sglang_flatcake.read import device as dv

cupy = pytest.importorskip("cupy")
kvikio = pytest.importorskip("kvikio")
from cupy_backends.cuda.api.runtime import CUDARuntimeError  # noqa: E402


def no_driver(e: BaseException) -> bool:
    return isinstance(e, CUDARuntimeError) or "NVIDIA driver" in str(e)


@pytest.fixture(scope="module")
def gpu_absent():
    try:
        cupy.cuda.runtime.getDeviceCount()
    except CUDARuntimeError:
        return
    pytest.skip("a CUDA device answers: the GPU tests run these calls for real")


class Recorder:
    """A destination array that records the ``set`` CuPy would run."""

    def __init__(self):
        self.calls = []

    def set(self, arr, stream=None):
        self.calls.append((arr, stream))


CALLS = {
    "activate": lambda d: d.activate(),
    "current_index": lambda d: d.current_index(),
    "stream": lambda d: d.stream(),
    "empty": lambda d: d.empty(64, np.uint64),
    "zeros": lambda d: d.zeros(8, np.uint8),
    "upload": lambda d: d.upload(np.zeros(4)),
    "download": lambda d: d.download(None),
    "record": lambda d: d.record(),
    "wait": lambda d: d.wait(None, None),
    "forward_event": lambda d: d.forward_event(),
    "launch": lambda d: d.launch("scatter.cu", "flatcake_scatter_w1", (1,), (32,), ()),
    "compile": lambda d: d.compile(),
    "free_cache": lambda d: d.free_cache(),
    "asarray": lambda d: d.asarray(np.zeros(3)),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_each_cuda_device_call_reaches_the_driver(gpu_absent, name):
    with pytest.raises(Exception) as e:
        CALLS[name](dv.CudaDevice(1))
    assert no_driver(e.value), f"{name}: {type(e.value).__name__}: {e.value}"


def test_upload_into_passes_the_stream_to_cupys_set(gpu_absent):
    dst, host, s = Recorder(), np.arange(4, dtype=np.uint8), cupy.cuda.Stream.null
    dv.CudaDevice(0).upload_into(dst, host, s)
    assert dst.calls == [(host, s)]
    assert "stream" in cupy.ndarray.set.__doc__


def test_address_is_cupys_pointer():
    class A:
        class data:
            ptr = 4096
    assert dv.CUDA.address(A()) == 4096


def test_cuda_devices_are_one_per_index():
    assert dv.cuda_device(0) is dv.CUDA and dv.cuda_device(3) is dv.cuda_device(3)
    assert dv.cuda_device(3).index == 3


def test_the_window_engine_for_cuda_is_the_kvikio_engine_on_the_real_module(gpu_absent):
    eng = dv.window_engine(dv.CUDA, 4096, 3)
    import kvikio.defaults
    assert eng.name == "kvikio" and kvikio.defaults.get("num_threads") == 3
    assert isinstance(eng.stats()["gds"], bool)
    with pytest.raises(Exception) as e:                  # device memory needs the driver
        eng.alloc(4096)
    assert no_driver(e.value)
    eng.close()
