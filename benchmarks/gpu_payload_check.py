"""``gpu_payload.py --check-cpu``: the dry run that makes the first GPU call safe.

1. A venv (cached in ``CACHE/venv-check-<key>``, keyed by the interpreter and the package set)
   holding only packages of the GPU image's list (``gpu_image_packages.txt``) at its versions:
   ``IMAGE_CLOSURE`` (the image packages SGLang's server imports) with their dependencies, then
   anything installed that the image's list lacks removed again (``removed`` in the JSON).
   torch 2.11.0 from PyPI runs on a CPU.
2. The payload installed exactly as the GPU call installs it (``gpu_payload.INSTALL``: no
   index, no dependencies, ``--target``), and only it on ``PYTHONPATH``.
3. In that venv (``child``): real CPU SGLang servers in both modes (HiCache mode with
   ``--hicache-storage-backend flatcake``, the linker), each serving a prompt, then after
   ``/flush_cache`` the same prompt restored from flatcake: the same greedy tokens.

Prints one JSON line: ``payload_mib``, ``missing`` (modules a server or import lacked),
``hicache_restored_tokens``, ``linker_restored_tokens``, ``same_tokens``, ``seconds``, ``ok``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
IMAGE_LIST = HERE / "gpu_image_packages.txt"
# image packages in the import closure of SGLang's CPU server, both modes (PYTHONPROFILEIMPORTTIME)
IMAGE_CLOSURE = (
    "aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi charset-normalizer "
    "click cuda-bindings cuda-core cuda-pathfinder einops filelock frozenlist fsspec h11 "
    "httpcore httpx huggingface-hub idna jinja2 llvmlite markupsafe ml-dtypes mpmath multidict "
    "networkx numba numpy nvidia-ml-py packaging pillow propcache psutil pygments pyyaml regex "
    "requests rich safetensors scipy sentencepiece setuptools sympy tiktoken timm tokenizers "
    "torch torchaudio torchvision tqdm transformers triton typing-extensions urllib3 uvloop "
    "xxhash yarl").split()
# what the GPU call sets too (gpu_server.py says why)
SERVER_ENV = {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",
              "SGLANG_IS_FLASHINFER_AVAILABLE": "false",
              "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1"}
PROMPT_TOKENS = 200
# modules some closure modules import that the image lacks by design: SGLang imports the
# modules needing them under try (the CPU servers here had them, so they were recorded)
OPTIONAL = {"cutlass": "nvidia-cutlass-dsl (CuTe DSL kernels, FA4); SGLang falls back without "
                       "it, and --attention-backend triton does not use them",
            "sglang.private": "SGLang's private-extension hook, imported under try"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = IMAGE_LIST) -> dict[str, str | None]:
    """``{normalized name: version or None}`` from the image's package list."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            out[norm(name)] = version or None
    return out


def pinned_closure(image: dict[str, str | None]) -> list[str]:
    """``IMAGE_CLOSURE`` as requirements, pinned where the image's list has a version."""
    reqs = []
    for n in IMAGE_CLOSURE:
        if norm(n) not in image:
            raise ValueError(f"{n} is in IMAGE_CLOSURE but not in {IMAGE_LIST.name}")
        v = image[norm(n)]
        reqs.append(f"{n}=={v}" if v else n)
    return reqs


def clean_env(**extra: str) -> dict:
    """This environment without the caller's Python paths (nothing of the clone or of another
    venv leaks into the check), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **extra}


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    kw.setdefault("env", clean_env())
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode:
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"{' '.join(cmd[:4])}... exited {r.returncode}: {tail}")
    return r


def check_venv(cache: Path, python: str) -> tuple[Path, list[str]]:
    """The check venv (built when missing); its python and the packages removed from it
    because the image's list lacks them."""
    image = image_packages()
    reqs = pinned_closure(image)
    ver = _run([python, "-c", "import sys; print(sys.version.split()[0])"]).stdout.strip()
    key = hashlib.sha256(json.dumps([ver, reqs]).encode()).hexdigest()[:16]
    venv = cache / f"venv-check-{key}"
    py = venv / "bin" / "python"
    done = venv / ".complete"
    if done.exists():
        return py, json.loads(done.read_text())["removed"]
    if venv.exists():
        shutil.rmtree(venv)
    _run([python, "-m", "venv", str(venv)])
    links = cache / "image312"
    _run([str(py), "-m", "pip", "install", "-q", "--only-binary=:all:",
          *(["--find-links", str(links)] if links.exists() else []), *reqs])
    listed = json.loads(_run([str(py), "-m", "pip", "list", "--format", "json"]).stdout)
    removed = sorted(p["name"] for p in listed
                     if norm(p["name"]) not in image and norm(p["name"]) not in ("pip",))
    if removed:
        _run([str(py), "-m", "pip", "uninstall", "-y", "-q", *removed])
    done.write_text(json.dumps({"python": ver, "requirements": reqs, "removed": removed}))
    return py, removed


def install_payload(py: Path, payload: Path, site: Path) -> None:
    """The payload into ``site`` exactly as the GPU call installs it."""
    from gpu_payload import INSTALL
    cmd = INSTALL.format(site=site, payload=payload).split()
    cmd[0] = str(py)
    _run(cmd)


def check_cpu(payload: Path, cache: Path, python: str, manifest: dict) -> int:
    t0 = time.monotonic()
    out = {"payload_mib": manifest["total_mib"], "missing": [], "python": None,
           "hicache_restored_tokens": 0, "linker_restored_tokens": 0, "ok": False}
    try:
        py, removed = check_venv(cache, python)
        out["python"] = _run([str(py), "-V"]).stdout.strip()
        out["removed_not_in_image"] = removed
        out["venv_s"] = round(time.monotonic() - t0, 1)
        with tempfile.TemporaryDirectory(prefix="gpu-payload-check-") as tmp:
            site = Path(tmp) / "site"
            install_payload(py, payload, site)
            env = clean_env(PYTHONPATH=str(site), **SERVER_ENV)
            r = subprocess.run([str(py), str(HERE / "gpu_payload_check.py"), "child", tmp],
                               capture_output=True, text=True, env=env, cwd=tmp, timeout=1800)
            try:
                out.update(json.loads(r.stdout.strip().splitlines()[-1]))
            except (IndexError, ValueError):
                out["missing"] += _missing_modules(r.stderr)
                out["error"] = (r.stderr.strip().splitlines() or ["no output"])[-1]
    except Exception as e:                                     # noqa: BLE001 (reported)
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = round(time.monotonic() - t0, 1)
    out["ok"] = bool(not out["missing"] and not out.get("error")
                     and out["hicache_restored_tokens"] > 0 and out["linker_restored_tokens"] > 0
                     and all(out.get("same_tokens", {}).values())
                     and set(out.get("same_tokens", {})) == {"hicache", "linker"})
    print(json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


def _missing_modules(text: str) -> list[str]:
    return sorted(set(re.findall(r"No module named '([^']+)'", text)))


def probe_imports(missing: list[str]) -> dict:
    """Import every module of the recorded closure (``gpu_sglang_closure.txt``) and flatcake's
    SGLang side; names a module lacked go to ``missing``; counts and the first other errors."""
    import importlib
    from gpu_payload import closure_modules
    mods = closure_modules() + ["sglang_flatcake.sglang.plugin", "sglang_flatcake.sglang.linker"]
    other, optional = {}, {}
    for m in mods:
        try:
            importlib.import_module(m)
        except ModuleNotFoundError as e:
            name = e.name or str(e)
            if name.split(".")[0] in OPTIONAL or name in OPTIONAL:
                optional[name] = OPTIONAL.get(name) or OPTIONAL[name.split(".")[0]]
            else:
                missing.append(name)
        except Exception as e:                                 # noqa: BLE001 (reported)
            other[m] = f"{type(e).__name__}: {e}"[:200]
    return {"modules": len(mods), "optional_absent": optional, "other_errors": len(other),
            "first_errors": dict(list(other.items())[:5])}


def child(work: Path) -> int:
    """In the check venv, the payload on ``PYTHONPATH``: both modes' servers, one restored hit
    each; one JSON line."""
    from sglang_flatcake.commands import server_calls as sc
    from sglang_flatcake.commands.server import ServerProcess, cpu_server_args
    from sglang_flatcake.commands.tiny_model import build_tiny_llama
    model = str(build_tiny_llama(work / "tiny-llama"))
    res = {"missing": [], "same_tokens": {}, "server_start_s": {}}
    res["closure_imports"] = probe_imports(res["missing"])
    for mode, backend, where in (("hicache", "flatcake", "storage"),
                                 ("linker", "flatcake-linker", "host")):
        log = work / f"{mode}.log"
        s = ServerProcess(cpu_server_args(model, str(work / f"store-{mode}"), backend=backend),
                          log_path=str(log))
        t = time.monotonic()
        try:
            s.start(timeout=900)
            res["server_start_s"][mode] = round(time.monotonic() - t, 1)
            ids = sc.prompt_ids(PROMPT_TOKENS, 7)
            first = sc.generate(s, ids)
            sc.backup_tokens(s)
            time.sleep(2)                       # the linker's offload completes after the answer
            sc.flush(s)
            again = sc.generate(s, ids)
            res[f"{mode}_restored_tokens"] = sc.cached_tokens(again, where)
            res["same_tokens"][mode] = first["output_ids"] == again["output_ids"]
        except Exception as e:                                 # noqa: BLE001 (reported)
            text = log.read_text(errors="replace") if log.exists() else ""
            res["missing"] += _missing_modules(text)
            res.setdefault("errors", {})[mode] = f"{type(e).__name__}: {e}"[:400]
        finally:
            s.stop()
    res["missing"] = sorted(set(res["missing"]))
    if res.get("errors"):
        res["error"] = "; ".join(f"{k}: {v}" for k, v in res["errors"].items())
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "child":
        sys.exit(child(Path(sys.argv[2])))
    sys.exit("usage: gpu_payload.py --check-cpu (this module is its helper)")
