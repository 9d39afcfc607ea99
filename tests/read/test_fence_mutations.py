"""Every fence and synchronisation of the device read path is needed: remove one and a
test on the emulated device fails.

Each mutation edits one line of a copy of the package (in a temporary directory) and
runs the test named for it there, in delay mode (``tests/read/test_device_emulation.py``).
The mutant must fail; the unmutated copy must pass (so a failure is the mutation's).
``python tests/read/test_fence_mutations.py`` prints the table that ``docs/device.md`` shows.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
T = "tests/read/test_device_emulation.py::"

# name: (file, line text to find, what replaces it, the test that must then fail)
MUTATIONS = {
    "flags zeroed on the window stream (not the legacy stream)": (
        "sglang_flatcake/read/window_run.py", "np.uint8, self.stream)", "np.uint8, None)",
        T + "test_a_verified_device_restore_in_delay_mode_reports_no_good_piece_corrupt"),
    "a buffer is refilled only after its fill's scatters ended": (
        "sglang_flatcake/read/window_run.py", "ev.synchronize()                                   # fence: buffer reuse",
        "pass", T + "test_a_restore_into_a_pool_on_device_1_runs_from_a_fresh_thread"),
    "final sync of a device restore (memory-only)": (
        "sglang_flatcake/read/slot_restore.py",
        "dev.record(stream).synchronize()      # fence: every upload and scatter ended", "pass",
        T + "test_memory_tier_uploads_hold_two_staging_chunks_and_land_in_delay_mode"),
    "a staging buffer is refilled only after its upload and scatters ended": (
        "sglang_flatcake/read/slot_copy.py", "free[j].synchronize()          # fence: staging reuse",
        "pass", T + "test_memory_tier_uploads_hold_two_staging_chunks_and_land_in_delay_mode"),
    "the restore worker makes the pool's device current": (
        "sglang_flatcake/read/slot_restore.py",
        "self.device.activate()                      # fence: the worker's device", "pass",
        T + "test_the_direct_restore_worker_makes_the_pools_device_current"),
    "the restore waits for SGLang's forward stream": (
        "sglang_flatcake/sglang/hicache/direct.py",
        "self.slots.after(fence)             # fence: SGLang's forward stream", "pass",
        T + "test_the_restore_waits_for_the_forward_stream_still_writing_its_slots"),
}


def run_mutant(tmp: Path, name: str | None) -> tuple[int, str]:
    """Copy the package and the emulation tests to ``tmp``, apply mutation ``name``
    (``None``: none) and run its test; (pytest's exit code, its last lines)."""
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(ROOT / "sglang_flatcake", tmp / "sglang_flatcake",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "kernels", tmp / "kernels")
    shutil.copytree(ROOT / "tests" / "support", tmp / "tests" / "support",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp / "tests" / "read").mkdir()
    for f in ("__init__.py", "conftest.py", "read/__init__.py", "read/test_device_emulation.py"):
        shutil.copy(ROOT / "tests" / f, tmp / "tests" / f)
    tests = sorted({m[3] for m in MUTATIONS.values()})
    if name is not None:
        rel, old, new, test = MUTATIONS[name]
        p = tmp / rel
        src = p.read_text()
        assert src.count(old) == 1, f"{name}: {old!r} is not one line of {rel}"
        p.write_text(src.replace(old, new))
        tests = [test]
    env = {**os.environ, "PYTHONPATH": str(tmp)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        f"--rootdir={tmp}", *tests], cwd=tmp, env=env, capture_output=True,
                       text=True, timeout=600)
    return r.returncode, "\n".join((r.stdout + r.stderr).strip().splitlines()[-3:])


@pytest.mark.slow
def test_the_unmutated_copy_passes(tmp_path):
    code, tail = run_mutant(tmp_path / "copy", None)
    assert code == 0, tail


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_removing_a_fence_fails_its_test(tmp_path, name):
    code, tail = run_mutant(tmp_path / "copy", name)
    assert code == 1, f"the mutant survived ({name}):\n{tail}"


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        for name in MUTATIONS:
            code, tail = run_mutant(Path(d) / "copy", name)
            print(f"| {name} | `{MUTATIONS[name][3].split('::')[1]}` | "
                  f"{'fails (caught)' if code == 1 else 'PASSES (not caught)'} | "
                  f"{tail.splitlines()[-1] if tail else ''} |")
