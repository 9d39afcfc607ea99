"""Build a CUDA kernel's real ``.cu`` source for the CPU: a C++ harness that emulates the
CUDA built-ins includes it, g++ compiles it to a shared library, ctypes loads it."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest


def compile_harness(tmp_path_factory, harness: str, include_dir: Path, what: str) -> ctypes.CDLL:
    """Compile ``harness`` (C++ source) with ``include_dir`` on the include path; skips
    when g++ is missing, fails the test with g++'s message when it does not compile."""
    if shutil.which("g++") is None:
        pytest.skip(f"g++ not found: cannot compile {what} for the CPU")
    d = tmp_path_factory.mktemp("cu")
    (d / "harness.cpp").write_text(harness)
    lib = d / "harness.so"
    r = subprocess.run(["g++", "-O1", "-std=c++14", "-shared", "-fPIC", "-pthread",
                        f"-I{include_dir}", "-o", str(lib), str(d / "harness.cpp")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return ctypes.CDLL(str(lib))
