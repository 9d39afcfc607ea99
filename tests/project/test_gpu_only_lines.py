"""The read path's lines that only a GPU runs are the listed ones, and at most 40.

Runs the read-path tests under pytest-cov in a subprocess (a fresh numba cache, so the
host twin's code generation runs too) and compares the lines of ``READ_PATH`` that no
CPU test executed with ``tests/project/gpu_only_lines.txt`` (``file: source line``, matched by
text so edits elsewhere do not shift it).  A new unexecuted line fails (cover it, or
it is GPU-only and goes in the list, which may not pass 40 lines); a listed line that
now runs fails too (take it out).  ``python -m tests.project.test_gpu_only_lines`` prints the
current list.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOW = Path(__file__).with_name("gpu_only_lines.txt")
MAX_LINES = 40
READ_PATH = ["sglang_flatcake/read/window.py", "sglang_flatcake/read/window_run.py",
             "sglang_flatcake/read/emulated.py", "sglang_flatcake/read/device_base.py",
             "sglang_flatcake/read/fills.py",
             "sglang_flatcake/read/to_slots.py", "sglang_flatcake/read/slot_restore.py",
             "sglang_flatcake/read/slot_copy.py",
             "sglang_flatcake/read/scatter.py", "sglang_flatcake/read/checksum.py",
             "sglang_flatcake/read/device.py", "sglang_flatcake/read/read_lease.py",
             "sglang_flatcake/sglang/hicache/direct.py", "sglang_flatcake/sglang/device_pool.py"]
TESTS = ["tests/read/test_window.py", "tests/read/test_scatter.py", "tests/read/test_checksum.py",
         "tests/read/test_device_emulation.py", "tests/read/test_real_cuda_modules.py",
         "tests/read/test_device_path.py", "tests/read/test_device_edges.py",
         "tests/sglang/hicache/test_flow_cut.py", "tests/sglang/hicache/test_scheduling.py",
         "tests/read/test_slot_restore.py",
         "tests/sglang/linker/test_linker.py",      # the layer-by-layer restore (slot_restore.py)
         "tests/sglang/test_device_pool.py"]


def unexecuted() -> list[str]:
    """``file: stripped source`` of every read-path line the CPU tests did not run."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "cov.json"
        env = {**os.environ, "NUMBA_CACHE_DIR": str(Path(tmp) / "numba"),
               "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", "-p", "no:cacheprovider",
               f"--rootdir={ROOT}", "--cov=sglang_flatcake",
               f"--cov-report=json:{report}", *[str(ROOT / t) for t in TESTS]]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if r.returncode != 0 or not report.exists():
            raise AssertionError(f"the coverage run failed:\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}")
        files = json.loads(report.read_text())["files"]
    out = []
    for rel in READ_PATH:
        entry = next((v for k, v in files.items() if Path(k).resolve() == (ROOT / rel)), None)
        if entry is None:
            raise AssertionError(f"{rel} was never imported by the coverage run")
        src = (ROOT / rel).read_text().splitlines()
        out += [f"{rel}: {src[n - 1].strip()}" for n in entry["missing_lines"]]
    return out


def allowed() -> list[str]:
    return [ln for ln in ALLOW.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def test_allow_list_is_short():
    assert len(allowed()) <= MAX_LINES, f"{ALLOW.name} lists {len(allowed())} lines (max {MAX_LINES})"


@pytest.mark.slow
def test_only_the_listed_lines_need_a_gpu():
    pytest.importorskip("pytest_cov")
    pytest.importorskip("cupy")          # the list assumes the real CuPy and kvikio (CI has both)
    pytest.importorskip("kvikio")
    got, want = Counter(unexecuted()), Counter(allowed())
    new, stale = got - want, want - got
    assert not new, ("read-path lines no CPU test runs, not in tests/project/gpu_only_lines.txt:\n"
                     + "\n".join(sorted(new.elements())))
    assert not stale, ("listed as GPU-only but run on the CPU now (remove them):\n"
                       + "\n".join(sorted(stale.elements())))


if __name__ == "__main__":
    print("\n".join(unexecuted()))
