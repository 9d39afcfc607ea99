"""The one prepared GPU call: a real SGLang 0.5.23 server with flatcake, both modes.

    python3 benchmarks/gpu_server.py [--payload .gpu_payload] [--site /tmp/site]
        [--parts serve,ttft,bench,environment] [--bound-s 540] [--json $OUT/gpu_server.json]
        [--device cuda|cpu] [--lengths 8192,32768] [--reps 3] [--shape 8b|small]

It installs the payload (``gpu_payload.py``'s ``INSTALL``; skipped when ``--site`` already
holds it), records ``pip list``, then runs the parts in order, each in its own error
handling, writing the JSON after each; at ``--bound-s`` it stops the servers, writes what
it has (``stopped``) and exits 3.

- ``serve``: the tiny model, both modes: ``flatcake verify --allow-flush`` (a prompt,
  ``/flush_cache``, the same prompt restored: same greedy tokens and top logprobs); then a
  byte flipped in each SSD block of a written prompt: a recompute with the same answer; the
  server's own restore count (HiCache mode: its ``flatcake: restored`` log lines; the
  linker: flatcake's block-read gauges) against SGLang's ``cached_tokens``.
- ``ttft``: ``gpu_server_ttft.py`` (recompute, device, memory and SSD hits in both modes,
  SGLang's ``file`` backend as the peer, the raw read of the same bytes).
- ``bench``: SGLang's ``bench_serving`` (a mooncake-format trace built here, two passes with
  a flush between) against no cache and both modes, when time remains.
- ``environment``: versions, the card, the disk's read rate, kvikio's GDS, ``pip list``.

``--device cpu`` (with ``--shape small``) runs the same code on CPU servers: CI's check of
this script (``tests/sglang/test_gpu_server.py``).  See benchmarks/README_gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from gpu_payload import INSTALL  # noqa: E402
from gpu_payload_check import SERVER_ENV  # noqa: E402
from sglang_flatcake.commands import server_calls as sc  # noqa: E402
from sglang_flatcake.commands.server import ServerProcess, cpu_server_args  # noqa: E402
from sglang_flatcake.commands.tiny_model import build_tiny_llama  # noqa: E402

PARTS = ("serve", "ttft", "bench", "environment")
PAGE = 16
# The CUDA server's flags on the GPU machine, each with its reason.
CUDA_FLAGS = [
    (["--attention-backend", "triton"], "flashinfer is not on the machine (and not carried: "
     "hundreds of MiB); triton is, and SGLang's triton backend needs no sgl_kernel attention op"),
    (["--sampling-backend", "pytorch"], "the default sampler is flashinfer's"),
    (["--disable-cuda-graph"], "the first run proves the path; CUDA graphs (production) are a "
     "second run once this one works (capture adds a minute per server)"),
    (["--mem-fraction-static", "0.80"], "weights (16 GB for 8B) + a 128K-token KV pool fit"),
    (["--enable-cache-report", "--enable-metrics"], "cached_tokens_details, flatcake's gauges"),
]
CUDA_ENV_REASONS = {
    "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "the Rust radix-tree core crashed with torch 2.11 "
                                              "(UnknownKind(32)); the Python core is SGLang's own",
    "SGLANG_IS_FLASHINFER_AVAILABLE": "flashinfer is not installed",
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "sglang 0.5.23 asks for sglang-kernel 0.4.10, which "
                                            "does not load with torch 2.11; 0.4.4 is carried",
}
CPU_DROP = {"--device": 1, "--model-impl": 1, "--dtype": 1, "--mem-fraction-static": 1,
            "--disable-cuda-graph": 0, "--enable-cache-report": 0}
# layers, hidden, heads, kv heads, intermediate.  The vocabulary stays the local tokenizer's
# (about 512, not 128256): prefill and KV cost are the layers', the LM head runs for the last
# token only, and no generated id falls outside the tokenizer.
SHAPES = {
    "8b": (32, 4096, 32, 8, 14336),        # Llama-3.1-8B: 128 KiB of bf16 KV a token
    "small": (8, 256, 4, 2, 512),
}


class Run:
    """The JSON being built, its file, the deadline, and the servers to stop at the bound."""

    def __init__(self, a) -> None:
        self.a, self.out = a, {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "device": a.device, "flags": {}, "parts": {}}
        self.path = Path(a.json)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.servers: list[ServerProcess] = []
        self.lock = threading.Lock()
        self.work = Path(a.work or tempfile.mkdtemp(prefix="gpu-server-"))

    def left(self) -> float:
        return self.a.bound_s - (time.monotonic() - self.t0)

    def write(self) -> None:
        with self.lock:
            self.out["elapsed_s"] = round(time.monotonic() - self.t0, 1)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.out, indent=1, default=str))
            os.replace(tmp, self.path)

    def server(self, args: list[str], name: str, env: dict | None = None) -> ServerProcess:
        s = ServerProcess(args, log_path=str(self.work / f"{name}.log"),
                          env={**self.env(), **(env or {})})
        self.servers.append(s)
        return s.start(timeout=max(60.0, min(900.0, self.left())))

    def env(self) -> dict:
        path = [str(ROOT)] + ([self.a.site] if self.a.site else [])
        return {"PYTHONPATH": os.pathsep.join(path), **SERVER_ENV}

    def stop_all(self) -> None:
        for s in self.servers:
            try:
                s.stop()
            except Exception:                                  # noqa: BLE001 (stopping anyway)
                pass


def server_args(run: Run, model: str, store: str, backend: str, extra_config=None,
                extra: list[str] | None = None, max_tokens: int = 16384,
                float32: bool = False) -> list[str]:
    """flatcake's mode flags (``cpu_server_args``) with the device's flags: on CPU as the
    tests run it, on CUDA with ``CUDA_FLAGS`` instead of the CPU ones (``float32`` keeps
    ``--dtype float32``: ``serve`` compares logprobs, and SGLang would run a float32 model
    in half precision)."""
    args = cpu_server_args(model, store, PAGE, backend=backend, max_total_tokens=max_tokens,
                           extra_config=extra_config, extra=extra)
    if run.a.device == "cpu":
        return args + ["--enable-metrics"]
    out, i = [], 0
    while i < len(args):
        if args[i] in CPU_DROP and not (float32 and args[i] == "--dtype"):
            i += 1 + CPU_DROP[args[i]]
            continue
        out.append(args[i])
        i += 1
    for flags, _ in CUDA_FLAGS:
        out += flags
    if not any(Path(model).glob("*.safetensors")):         # shaped_model's: config only
        out += ["--load-format", "dummy"]
    return out


def shaped_model(path: Path, shape: str, with_weights: bool) -> str:
    """A Llama of ``SHAPES[shape]``; on CUDA without weights (``--load-format dummy``)."""
    layers, hidden, heads, kv, inter = SHAPES[shape]
    if with_weights:
        return str(build_tiny_llama(path, layers=layers, hidden=hidden, heads=heads,
                                    kv_heads=kv))
    build_tiny_llama(path, layers=1, hidden=64, heads=4, kv_heads=2)   # the tokenizer
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
               num_key_value_heads=kv, intermediate_size=inter, head_dim=hidden // heads,
               torch_dtype="bfloat16", dtype="bfloat16",
               max_position_embeddings=131072)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / "model.safetensors").unlink()
    return str(path)


def verify(run: Run, url: str) -> dict:
    """``flatcake verify --allow-flush --json`` against ``url``: its exit code and report."""
    r = subprocess.run([sys.executable, "-m", "sglang_flatcake", "verify", "--url", url,
                        "--allow-flush", "--json", "--tokens", "256", "--atol",
                        str(run.a.atol)], capture_output=True,
                       text=True, env={**os.environ, **run.env()}, timeout=600)
    try:
        rep = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        rep = {"error": (r.stderr.strip().splitlines() or ["no output"])[-1]}
    return {"exit": r.returncode, **rep}


RESTORED = re.compile(r"flatcake: restored \S+: (\d+) of \d+ tokens")


def flip_ssd_blocks(store_dir: Path) -> int:
    """Flip one byte in every SSD segment file under ``store_dir`` (its blocks then fail
    their checksums); the number of files flipped."""
    n = 0
    for f in sorted(store_dir.rglob("*")):
        if f.is_file() and f.suffix not in (".json", ".log") and f.stat().st_size > 8192:
            with open(f, "r+b") as fh:
                fh.seek(4096 + 5)
                b = fh.read(1)
                if b:
                    fh.seek(4096 + 5)
                    fh.write(bytes([b[0] ^ 0xFF]))
                    n += 1
    return n


def serve_mode(run: Run, mode: str, model: str) -> dict:
    backend = "flatcake" if mode == "hicache" else "flatcake-linker"
    store = run.work / f"serve-{mode}"
    s = run.server(server_args(run, model, str(store), backend, float32=True),
                   f"serve-{mode}")
    where = "storage" if mode == "hicache" else "host"
    try:
        row = {"verify": verify(run, s.url)}
        run.write()
        ids = sc.prompt_ids(256, 11)
        first = sc.generate(s, ids, 8)
        sc.backup_tokens(s)
        time.sleep(2)
        sc.flush(s)
        g0 = sc.prometheus(s, "flatcake_")
        logged0 = sum(int(x) for x in RESTORED.findall(s.tail(10**7)))
        hit = sc.generate(s, ids, 8)
        time.sleep(1.5)
        g1 = sc.prometheus(s, "flatcake_")
        reads = {k: int(g1.get(f"flatcake_{k}", 0) - g0.get(f"flatcake_{k}", 0))
                 for k in ("memory_blocks_read", "ssd_blocks_read")}
        logged = sum(int(x) for x in RESTORED.findall(s.tail(10**7))) - logged0
        row["hit"] = {"cached_tokens": sc.cached_tokens(hit, where), "blocks_read": reads,
                      "log_restored_tokens": logged if mode == "hicache" else None,
                      "same_tokens": hit["output_ids"] == first["output_ids"]}
        row["hit"]["agree"] = (logged == row["hit"]["cached_tokens"] if mode == "hicache" else
                               sum(reads.values()) * PAGE == row["hit"]["cached_tokens"])
        sc.flush(s)
        row["flipped_files"] = flip_ssd_blocks(store)
        tries = []
        for _ in range(2):            # the linker's load of a damaged block fails (HTTP 503) once
            try:
                again = sc.generate(s, ids, 8)
                tries.append("answered")
                break
            except Exception as e:                              # noqa: BLE001 (recorded)
                tries.append(f"{type(e).__name__}: {e}"[:200])
        else:
            again = None
        row["after_flip"] = {
            "tries": tries, "cached_tokens": sc.cached_tokens(again, where) if again else None,
            "same_tokens": bool(again) and again["output_ids"] == first["output_ids"]}
        row["ok"] = (row["verify"].get("verdict") == "restored" and row["hit"]["same_tokens"]
                     and row["hit"]["agree"] and row["after_flip"]["same_tokens"]
                     and row["after_flip"]["cached_tokens"] == 0)
        return row
    finally:
        s.stop()


def part_serve(run: Run) -> dict:
    model = str(build_tiny_llama(run.work / "tiny-llama"))
    out = {}
    for mode in ("hicache", "linker"):
        try:
            out[mode] = serve_mode(run, mode, model)
        except Exception as e:                                  # noqa: BLE001 (reported)
            out[mode] = {"error": f"{type(e).__name__}: {e}"[:600]}
        run.out["parts"]["serve"] = out
        run.write()
    return out


def part_ttft(run: Run) -> dict:
    from gpu_server_ttft import ttft_table
    return ttft_table(run)


def part_bench(run: Run) -> dict:
    from gpu_server_ttft import bench
    return bench(run)


def pip_list(run: Run) -> list:
    r = subprocess.run([sys.executable, "-m", "pip", "list", "--format", "json"],
                       capture_output=True, text=True, env={**os.environ, **run.env()})
    return json.loads(r.stdout) if r.returncode == 0 else [{"error": r.stderr[-300:]}]


def part_environment(run: Run) -> dict:
    from sglang_flatcake.commands.bench_restore import raw_limit, write_raw_file
    env = {"python": platform.python_version(), "machine": platform.machine()}
    probe = ("import json, torch, triton, transformers, sglang\n"
             "d = {'torch': torch.__version__, 'cuda': torch.version.cuda, 'triton': "
             "triton.__version__, 'transformers': transformers.__version__, 'sglang': "
             "sglang.__version__, 'gpu': torch.cuda.get_device_name(0) if "
             "torch.cuda.is_available() else None}\n"
             "try:\n import sgl_kernel; d['sgl_kernel'] = getattr(sgl_kernel, '__version__', '?')\n"
             "except Exception as e: d['sgl_kernel'] = repr(e)[:200]\n"
             "try:\n import kvikio; d['kvikio'] = kvikio.__version__; "
             "d['kvikio_gds'] = not kvikio.defaults.is_compat_mode_preferred()\n"
             "except Exception as e: d['kvikio'] = repr(e)[:200]\n"
             "print(json.dumps(d))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       env={**os.environ, **run.env()})
    env.update(json.loads(r.stdout) if r.returncode == 0 else {"probe_error": r.stderr[-400:]})
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True) \
        if run.a.device == "cuda" else None
    env["nvidia_smi"] = smi.stdout.strip() if smi and smi.returncode == 0 else None
    f = run.work / "raw-read.bin"
    size = int(run.a.raw_gib * 2**30)
    write_raw_file(str(f), size)
    env["disk_read_gb_s"] = round(raw_limit(str(f), size, 4), 3)
    f.unlink()
    env["pip_list"] = pip_list(run)
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--payload", default=str(ROOT / ".gpu_payload"))
    p.add_argument("--site", default="/tmp/site", help="where the payload is installed")
    p.add_argument("--no-install", action="store_true",
                   help="use this Python as it is (CPU tests: the venv already has sglang)")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--bound-s", type=float, default=540.0, help="stop here (default: a minute "
                   "inside a 10-minute call)")
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "gpu_server.json"))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="the ttft/bench model (default: 8b on cuda, small on cpu)")
    p.add_argument("--lengths", default=None, help="ttft prompt tokens (default 8192,32768 on "
                   "cuda, 512 on cpu)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-file-peer", action="store_true", help="ttft without SGLang's file backend")
    p.add_argument("--atol", type=float, default=1e-3, help="serve: the largest logprob "
                   "difference flatcake verify takes as the same answer")
    p.add_argument("--raw-gib", type=float, default=1.0, help="environment's raw read size")
    p.add_argument("--work", default=None)
    a = p.parse_args(argv)
    parts = a.parts.split(",")
    if bad := [x for x in parts if x not in PARTS]:
        p.error(f"--parts: unknown {bad[0]!r} (known: {','.join(PARTS)})")
    a.shape = a.shape or ("8b" if a.device == "cuda" else "small")
    a.lengths = [int(x) for x in (a.lengths or ("8192,32768" if a.device == "cuda" else "512"))
                 .split(",")]
    if bad := [n for n in a.lengths if n % PAGE or n < 4 * PAGE]:
        p.error(f"--lengths: {bad[0]} is not a multiple of {PAGE} of at least {4 * PAGE}")
    if a.no_install:
        a.site = None
    run = Run(a)
    run.out["flags"] = {"server": [(f, why) for f, why in CUDA_FLAGS] if a.device == "cuda"
                        else "cpu_server_args", "env": {k: [v, CUDA_ENV_REASONS[k]]
                                                        for k, v in SERVER_ENV.items()},
                        "argv": sys.argv[1:]}

    def bound() -> None:
        run.out["stopped"] = f"--bound-s {a.bound_s} reached; parts missing did not finish"
        run.stop_all()
        run.write()
        print(json.dumps({k: v for k, v in run.out.items() if k != "parts"}), flush=True)
        os._exit(3)
    timer = threading.Timer(a.bound_s, bound)
    timer.daemon = True
    timer.start()
    if a.site:
        t = time.monotonic()
        try:
            if not (Path(a.site) / "sglang").exists():
                cmd = INSTALL.format(site=a.site, payload=a.payload).split()
                cmd[0] = sys.executable
                subprocess.run(cmd, check=True, capture_output=True, text=True)
            run.out["install"] = {"seconds": round(time.monotonic() - t, 1), "site": a.site}
        except subprocess.CalledProcessError as e:
            run.out["install"] = {"error": (e.stderr or "")[-600:]}
        run.out["pip_list_at_install"] = pip_list(run)
        run.write()
    for part in parts:
        t = time.monotonic()
        try:
            res = globals()[f"part_{part}"](run)
        except Exception as e:                                  # noqa: BLE001 (reported)
            res = {"error": f"{type(e).__name__}: {e}"[:600],
                   "traceback": traceback.format_exc()[-2000:]}
        if isinstance(res, dict):
            res["seconds"] = round(time.monotonic() - t, 1)
        run.out["parts"][part] = res
        run.write()
    timer.cancel()
    run.stop_all()
    print(json.dumps({k: v for k, v in run.out.items() if not k.startswith("pip_list")}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
