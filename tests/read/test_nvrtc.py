"""Both kernels through NVIDIA's own compiler, without a GPU: NVRTC (from PyPI, loaded by
CuPy) compiles ``kernels/checksum.cu`` and ``kernels/scatter.cu`` for sm_90 (H100/H200)
and sm_100 (B200) with the options CuPy's ``RawModule`` passes, and any error or warning
fails.  The g++ harnesses (``test_checksum.py``, ``test_scatter.py``) run the same
sources on the CPU."""

from __future__ import annotations

import inspect

import pytest

from sglang_flatcake.read import device as dv

pytest.importorskip("cupy")
nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
from cupy.cuda import compiler  # noqa: E402

ARCHS = (90, 100)


def cupy_options(cc: int) -> tuple:
    """What CuPy 14 hands NVRTC for ``RawModule(code, options=dv.NVRTC_OPTIONS)``."""
    return dv.NVRTC_OPTIONS + ("-ftz=true", f"-arch=sm_{cc}", "--device-as-default-execution-space")


def compile_log(source: str, name: str, options: tuple) -> tuple[bool, str, int]:
    """(compiled, NVRTC's log, cubin bytes)."""
    try:
        prog = nvrtc.createProgram(source, name, (), ())
    except Exception as e:           # NVRTC missing: the test extra installs it
        pytest.skip(f"NVRTC unavailable: {e}")
    try:
        try:
            nvrtc.compileProgram(prog, options)
            ok = True
        except nvrtc.NVRTCError:
            ok = False
        log = nvrtc.getProgramLog(prog)
        return ok, log, len(nvrtc.getCUBIN(prog)) if ok else 0
    finally:
        nvrtc.destroyProgram(prog)


def test_cupy_still_passes_these_options():
    src = inspect.getsource(compiler)
    for opt in ("'-ftz=true'", "'--device-as-default-execution-space'", "f'-arch=sm_{arch}'"):
        assert opt in src, f"CuPy no longer passes {opt}: update cupy_options"


@pytest.mark.parametrize("cc", ARCHS)
@pytest.mark.parametrize("kernel", dv.KERNELS)
def test_kernel_compiles_without_errors_or_warnings(kernel, cc):
    ok, log, cubin = compile_log(dv.kernel_source(kernel), kernel, cupy_options(cc))
    assert ok, f"{kernel} sm_{cc} does not compile:\n{log}"
    assert log.strip() == "", f"{kernel} sm_{cc} compiles with warnings:\n{log}"
    assert cubin > 1000


def test_a_warning_would_fail_the_check():
    """The check can fail: a kernel with an unused variable makes NVRTC write a warning."""
    src = 'extern "C" __global__ void k(int* p) { int unused = 3; p[0] = 1; }'
    ok, log, _ = compile_log(src, "warn.cu", cupy_options(90))
    assert ok and "unused" in log
