"""The wheel ships every CUDA kernel: build it, install it into a clean venv away from
the source tree, and load each ``kernels/*.cu`` there through ``device.kernel_source``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import json, sys
import sglang_flatcake, sglang_flatcake.read.device as dv, sglang_flatcake.read.scatter as sc
names = sys.argv[1:]
print(json.dumps({"package": sglang_flatcake.__file__,
                  "sources": {n: len(dv.kernel_source(n)) for n in names},
                  "paths": {n: str(dv.kernel_path(n)) for n in names},
                  "scatter": len(sc.kernel_source())}))
"""


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, **kw)
    assert r.returncode == 0, f"{cmd[:3]} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.mark.slow
def test_wheel_installs_every_kernel_and_loads_it_away_from_the_source(tmp_path):
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    kernels = sorted(p.name for p in (ROOT / "kernels").glob("*.cu"))
    assert {"scatter.cu", "checksum.cu"} <= set(kernels)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(ROOT)])
    (whl,) = (tmp_path / "dist").glob("sglang_flatcake-*.whl")
    inside = set(zipfile.ZipFile(whl).namelist())
    assert {f"sglang_flatcake/kernels/{k}" for k in kernels} <= inside

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
         "--no-index", str(whl)], env=env, cwd=tmp_path)
    # numpy and xxhash from this interpreter's site-packages, appended after the clean
    # venv's own (a path in a .pth file: its own .pth files, e.g. an editable install
    # of this checkout, are not processed)
    site = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    env=env).strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    away = tmp_path / "elsewhere"
    away.mkdir()
    out = run([str(py), "-c", CHECK, *kernels], cwd=away, env=env)
    import json
    got = json.loads(out.strip().splitlines()[-1])
    assert Path(got["package"]).resolve().is_relative_to(venv.resolve())
    for k in kernels:
        assert got["sources"][k] == len((ROOT / "kernels" / k).read_text())
        assert Path(got["paths"][k]).resolve().is_relative_to(venv.resolve())
    assert got["scatter"] > 0
    shutil.rmtree(venv)
