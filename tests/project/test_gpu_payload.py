"""``benchmarks/gpu_payload.py``'s pieces that need no download: a trimmed wheel installs with
a RECORD that matches it, the fit check names the package, the image list parses."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests.support import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_payload as gp  # noqa: E402
import gpu_payload_check as gc  # noqa: E402


def make_wheel(path):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("demo_pkg/__init__.py", "X = 1\n")
        z.writestr("demo_pkg/sm90/lib.so", b"\0" * 100)
        z.writestr("demo_pkg/sm100/lib.so", b"\0" * 100)
        z.writestr("demo_pkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo-pkg\n"
                   "Version: 1.0\n")
        z.writestr("demo_pkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr("demo_pkg-1.0.dist-info/RECORD", "stale\n")


def test_trimmed_wheel_keeps_what_is_asked_and_installs(tmp_path):
    src = tmp_path / "src" / "demo_pkg-1.0-py3-none-any.whl"
    src.parent.mkdir()
    make_wheel(src)
    out = gp.trimmed_wheel(src, tmp_path / "out", lambda n: "sm100" not in n)
    names = zipfile.ZipFile(out).namelist()
    assert "demo_pkg/sm90/lib.so" in names and "demo_pkg/sm100/lib.so" not in names
    record = zipfile.ZipFile(out).read("demo_pkg-1.0.dist-info/RECORD").decode()
    assert "demo_pkg/__init__.py,sha256=" in record and "sm100" not in record
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--target", str(site), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (site / "demo_pkg" / "sm90" / "lib.so").exists()
    assert not (site / "demo_pkg" / "sm100").exists()


def test_kernel_keeps_only_the_sm90_library():
    assert gp.keep_kernel("sgl_kernel/sm90/common_ops.abi3.so")
    assert not gp.keep_kernel("sgl_kernel/sm100/common_ops.abi3.so")
    assert not gp.keep_kernel("sgl_kernel/flash_ops.abi3.so")
    assert gp.keep_kernel("sgl_kernel/elementwise.py")


def test_over_the_limit_names_the_largest_package():
    entries = [{"what": "a", "version": "1", "bytes": 30 << 20},
               {"what": "big", "version": "2.0", "bytes": 40 << 20}]
    assert gp.check_fits(entries[:1], 56) == 30 << 20
    with pytest.raises(gp.PayloadError, match=r"70\.0 MiB, over 56 MiB; largest: big 2\.0 "
                                              r"40\.0 MiB"):
        gp.check_fits(entries, 56)


def test_image_list_pins_and_closure():
    image = gc.image_packages()
    assert image["torch"] == "2.11.0" and image["triton"] == "3.6.0"
    reqs = gc.pinned_closure(image)
    assert "torch==2.11.0" in reqs and "transformers==5.17.0" in reqs
    assert not {gc.norm(n) for n, _, _ in gp.MISSING} & set(image), "carried but in the image"
