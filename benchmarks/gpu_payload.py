"""What one GPU call takes along so that a CUDA SGLang 0.5.23 server with flatcake runs there.

    python benchmarks/gpu_payload.py [--out .gpu_payload] [--cache DIR] [--limit-mib 56]
    python benchmarks/gpu_payload.py --check-cpu [--python python3.12]

The GPU machine (``benchmarks/gpu_image_packages.txt``: its image's packages) has Python 3.12,
torch 2.11.0+cu130 and most of what SGLang imports, but no sglang, no sglang-kernel, no kvikio,
no network, and a call carries at most 64 MiB in 8 paths.  The build writes ONE path,
``.gpu_payload/`` (git-ignored), holding ``wheels/`` (every wheel, ``requirements.txt`` naming
them) and ``manifest.json`` (what, version, why, size), and prints the total.  It fails,
naming the largest package, when the total passes ``--limit-mib``.

- ``MISSING``: the packages of SGLang's import closure for a Llama server (both modes, found
  by ``PYTHONPROFILEIMPORTTIME`` over real CPU servers, then by ``--check-cpu``) that the
  image lacks, at the versions SGLang 0.5.23 resolves to; wheels for Python 3.12 (the GPU's).
- ``sglang-kernel`` 0.4.4 (0.4.10, which sglang 0.5.23 asks for, does not load with torch
  2.11), trimmed to its Python files and the sm90 library (H100 and H200 are sm90).
- ``sglang`` 0.5.23, trimmed (``SGLANG_DROP``: tests, the diffusion server, other hardware,
  Rust extensions a Llama server does not load).
- this project as a wheel (the plugin's entry point needs its dist-info), kvikio if it fits.

Install, here and on the GPU alike (``INSTALL``): ``pip install --no-index --no-deps --target
/tmp/site --find-links .gpu_payload/wheels -r .gpu_payload/wheels/requirements.txt``, then
``PYTHONPATH=/tmp/site``.  ``--check-cpu`` proves it: ``gpu_payload_check.py``.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".gpu_payload"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sglang-flatcake-gpu"
LIMIT_MIB = 56           # the device call carries 64 MiB; 8 are left for the project to grow
CALL_LIMIT_MIB = 64      # what one call takes along: the working tree and the carried paths
PY = "3.12"              # the GPU machine's Python (3.12.3)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_34_x86_64", "manylinux_2_27_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64")
INSTALL = ("python3 -m pip install -q --no-index --no-deps --target {site} "
           "--find-links {payload}/wheels -r {payload}/wheels/requirements.txt")

# (name, version, why): what SGLang's server imports that the image lacks
MISSING = [
    ("fastapi", "0.165.0", "the HTTP server (http_server.py)"),
    ("starlette", "1.10.0", "fastapi"),
    ("opentelemetry-api", "1.45.3", "fastapi (a required dependency)"),
    ("pydantic", "2.14.4", "the OpenAI protocol and io structs"),
    ("pydantic-core", "2.50.5", "pydantic"),
    ("annotated-types", "0.8.0", "pydantic"),
    ("typing-inspection", "0.4.5", "pydantic"),
    ("uvicorn", "0.55.0", "the HTTP server"),
    ("python-multipart", "0.0.34", "fastapi's form parsing (http_server.py)"),
    ("msgspec", "0.23.0", "server args and io structs"),
    ("orjson", "3.13.0", "HTTP responses"),
    ("pyzmq", "27.3.0", "the tokenizer/scheduler/detokenizer IPC"),
    ("setproctitle", "1.3.8", "process names of the scheduler and detokenizer"),
    ("pybase64", "1.5.1", "imported by the server's multimodal utils"),
    ("partial-json-parser", "0.2.1.1.post7", "function-call parsers (imported by serving_chat)"),
    ("sniffio", "1.3.1", "openai"),
    ("distro", "1.9.0", "openai"),
    ("dill", "0.4.1", "custom logit processors (sampling params)"),
    ("openai", "2.8.0", "the OpenAI-compatible protocol module"),
    ("jiter", "0.19.0", "openai"),
    ("openai-harmony", "0.0.4", "harmony_utils, imported by the OpenAI entrypoints"),
    ("xgrammar", "0.2.7", "the grammar backend and function-call detectors"),
    ("apache-tvm-ffi", "0.1.11", "xgrammar"),
    ("compressed-tensors", "0.18.0", "the quantization registry imports it"),
    ("loguru", "0.7.3", "compressed-tensors"),
    ("gguf", "0.19.0", "the model loader imports it"),
    ("ipython", "9.19.1", "sglang/utils.py imports IPython.display at the top (that import "
     "needs traitlets alone of ipython's dependencies)"),
    ("traitlets", "5.16.1", "ipython"),
    ("jsonschema", "4.26.0", "serving_chat.py (the HTTP server imports it) validates tools"),
    ("referencing", "0.37.0", "jsonschema"),
    ("jsonschema-specifications", "2025.9.1", "jsonschema"),
    ("rpds-py", "2026.9.1", "referencing"),
    ("zstandard", "0.25.0", "HTTP request decompression (http_server.py)"),
    ("watchfiles", "1.3.0", "ssl_utils, imported by the HTTP server"),
    ("soundfile", "0.13.1", "the OpenAI audio entrypoints"),
    ("cffi", "2.1.1", "soundfile"),
    ("pycparser", "3.12", "cffi"),
]
KVIKIO = [("kvikio-cu13", "26.10.0", "flatcake's SSD reads into device memory (GDS or its "
           "compatibility mode)"), ("libkvikio-cu13", "26.10.0", "kvikio-cu13"),
          ("rapids-logger", "0.3.0", "libkvikio")]
SGLANG = ("sglang", "0.5.23")
KERNEL = ("sglang-kernel", "0.4.4")
KERNEL_KEEP_LIB = "sgl_kernel/sm90/"
# parts of sglang's wheel a CUDA Llama server (triton attention, torch sampling) never loads
# (none of ``CLOSURE``'s modules: ``build`` checks)
SGLANG_DROP = ("sglang/test/", "sglang/multimodal_gen/", "sglang/srt/rust_extensions/")
CLOSURE = Path(__file__).resolve().parent / "gpu_sglang_closure.txt"


class PayloadError(Exception):
    """The payload cannot be built or does not fit; the message names what."""


def _pip(*args: str, python: str | None = None) -> None:
    cmd = [python or sys.executable, "-m", "pip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise PayloadError(f"{' '.join(cmd[3:6])}... failed: {' | '.join(tail)}")


def download(name: str, version: str, dest: Path) -> Path:
    """The wheel of ``name==version`` for the GPU's Python, from the cache, else PyPI."""
    dest.mkdir(parents=True, exist_ok=True)
    found = _find(dest, name, version)
    if found:
        return found
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    _pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", PY,
         *plats, "-d", str(dest), f"{name}=={version}")
    found = _find(dest, name, version)
    if not found:
        raise PayloadError(f"{name}=={version}: no wheel for Python {PY} was downloaded")
    return found


def _find(d: Path, name: str, version: str) -> Path | None:
    stem = name.replace("-", "_").lower()
    for w in sorted(d.glob("*.whl")):
        n, v = w.name.split("-")[:2]
        if n.lower().replace(".", "_") == stem and v == version:
            return w
    return None


def trimmed_wheel(src: Path, dest: Path, keep) -> Path:
    """A copy of wheel ``src`` in ``dest`` holding the members ``keep(name)`` accepts, with a
    RECORD rewritten to match (pip installs it like the original)."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / src.name
    with zipfile.ZipFile(src) as zin, \
            zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zo:
        record_name, rows = None, []
        for info in zin.infolist():
            if info.filename.endswith(".dist-info/RECORD"):
                record_name = info.filename
                continue
            if not keep(info.filename):
                continue
            data = zin.read(info)
            zo.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append([info.filename, f"sha256={digest}", len(data)])
        rows.append([record_name, "", ""])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)   # names may hold commas
        zo.writestr(record_name, buf.getvalue())
    return out


def keep_kernel(name: str) -> bool:
    if name.endswith(".so"):
        return name.startswith(KERNEL_KEEP_LIB)
    return True


def keep_sglang(name: str) -> bool:
    return not name.startswith(SGLANG_DROP)


def closure_modules() -> list[str]:
    """The sglang modules a CPU server imported (``gpu_sglang_closure.txt``)."""
    lines = (x.strip() for x in CLOSURE.read_text().splitlines())
    return [x for x in lines if x and not x.startswith("#")]


def check_drops_keep_closure() -> None:
    """``PayloadError`` naming a module of the closure that ``SGLANG_DROP`` would cut."""
    for m in closure_modules():
        path = m.replace(".", "/")
        if not keep_sglang(path + "/") or not keep_sglang(path + ".py"):
            raise PayloadError(f"SGLANG_DROP cuts {m}, which the server imports")


# wheels carried trimmed: name -> (what is dropped, the test for a member to keep)
TRIM = {"zstandard": ("the cffi backend's library (the C backend is the one imported)",
                      lambda n: not n.startswith("zstandard/_cffi"))}


def project_wheel(dest: Path) -> Path:
    """This project as a wheel (built from the working tree)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("sglang_flatcake-*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp, str(ROOT))
        built = next(Path(tmp).glob("sglang_flatcake-*.whl"))
        return Path(shutil.copy2(built, dest / built.name))


def check_fits(entries: list[dict], limit_mib: float) -> int:
    """The total bytes of ``entries``; ``PayloadError`` naming the largest when over the limit."""
    total = sum(e["bytes"] for e in entries)
    if total > limit_mib * 2**20:
        big = max(entries, key=lambda e: e["bytes"])
        raise PayloadError(f"the payload is {total / 2**20:.1f} MiB, over {limit_mib} MiB; "
                           f"largest: {big['what']} {big['version']} "
                           f"{big['bytes'] / 2**20:.1f} MiB")
    return total


def build(out: Path = OUT, cache: Path = CACHE, limit_mib: float = LIMIT_MIB,
          with_kvikio: bool = True) -> dict:
    """Build the payload into ``out``; the manifest.  ``PayloadError`` when it does not fit."""
    wheels = out / "wheels"
    if out.exists():
        shutil.rmtree(out)
    wheels.mkdir(parents=True)
    dl, entries = cache / "wheels312", []

    def add(path: Path, name: str, version: str, why: str) -> None:
        entries.append({"what": name, "version": version, "why": why, "file": path.name,
                        "bytes": path.stat().st_size})

    for name, version, why in MISSING:
        src = download(name, version, dl)
        if name in TRIM:
            add(trimmed_wheel(src, wheels, TRIM[name][1]), name, version,
                f"{why}; trimmed: {TRIM[name][0]}")
        else:
            add(Path(shutil.copy2(src, wheels)), name, version, why)
    k = trimmed_wheel(download(*KERNEL, dl), wheels, keep_kernel)
    add(k, *KERNEL, "sgl_kernel ops on the CUDA path; 0.4.4 pins torch 2.11 (0.4.10 does not "
        "load with it); Python files + the sm90 library only")
    check_drops_keep_closure()
    s = trimmed_wheel(download(*SGLANG, dl), wheels, keep_sglang)
    add(s, *SGLANG, "the server; trimmed: " + ", ".join(SGLANG_DROP))
    add(project_wheel(wheels), "sglang-flatcake", _project_version(), "this project (the "
        "plugin's entry point needs its dist-info)")
    total = check_fits(entries, limit_mib)
    skipped = []
    if with_kvikio:
        kv = [(n, v, w, download(n, v, dl)) for n, v, w in KVIKIO]
        extra = sum(p.stat().st_size for *_, p in kv)
        if total + extra <= limit_mib * 2**20:
            for n, v, w, p in kv:
                add(Path(shutil.copy2(p, wheels)), n, v, w)
        else:
            skipped.append(f"kvikio ({extra / 2**20:.1f} MiB) does not fit")
    total, tree = sum(e["bytes"] for e in entries), tree_bytes()
    if total + tree > CALL_LIMIT_MIB * 2**20:
        raise PayloadError(f"the payload ({total / 2**20:.1f} MiB) and the working tree "
                           f"({tree / 2**20:.1f} MiB) pass the call's {CALL_LIMIT_MIB} MiB")
    reqs = [f"{e['what']}=={e['version']}" for e in entries]
    (wheels / "requirements.txt").write_text("\n".join(reqs) + "\n")
    manifest = {"python": PY, "total_bytes": total, "total_mib": round(total / 2**20, 2),
                "limit_mib": limit_mib, "tree_mib": round(tree / 2**20, 2),
                "paths": [out.name], "skipped": skipped,
                "install": INSTALL.format(site="/tmp/site", payload=out.name),
                "packages": entries}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def tree_bytes() -> int:
    """Bytes of the files git tracks here (the working tree that travels with the call)."""
    r = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True)
    names = [n for n in r.stdout.decode().split("\0") if n] if r.returncode == 0 else []
    return sum((ROOT / n).stat().st_size for n in names if (ROOT / n).is_file())


def _project_version() -> str:
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        if line.startswith("version"):
            return line.split("=", 1)[1].strip().strip('"')
    raise PayloadError("pyproject.toml has no version line")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(OUT), help="the payload folder (git-ignored)")
    p.add_argument("--cache", default=str(CACHE), help="downloads and the check's venvs")
    p.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    p.add_argument("--no-kvikio", action="store_true", help="leave kvikio out")
    p.add_argument("--check-cpu", action="store_true",
                   help="then prove it on CPU: a fresh venv of the image's packages, the payload "
                        "installed as on the GPU, real CPU servers in both modes")
    p.add_argument("--python", default=None,
                   help="the check venv's interpreter (default: a Python 3.12, the GPU's)")
    a = p.parse_args(argv)
    try:
        m = build(Path(a.out), Path(a.cache), a.limit_mib, not a.no_kvikio)
    except PayloadError as e:
        print(f"gpu_payload: error: {e}", file=sys.stderr)
        return 2
    print(f"payload: {m['total_mib']} MiB in {a.out} ({len(m['packages'])} wheels; limit "
          f"{a.limit_mib} MiB){'; ' + '; '.join(m['skipped']) if m['skipped'] else ''}",
          file=sys.stderr)
    if not a.check_cpu:
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_payload_check import check_cpu
    return check_cpu(Path(a.out), Path(a.cache), a.python or python312(), m)


def python312() -> str:
    """A Python 3.12 interpreter here (``python3.12`` on the PATH, else pyenv's)."""
    cands = [shutil.which("python3.12")] + sorted(
        str(p) for p in Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
        .glob("versions/3.12*/bin/python3.12"))
    for c in filter(None, cands):
        if subprocess.run([c, "-V"], capture_output=True).returncode == 0:
            return c
    raise SystemExit("gpu_payload: error: no Python 3.12 here (the GPU's wheels are cp312); "
                     "pass --python")


if __name__ == "__main__":
    sys.exit(main())
