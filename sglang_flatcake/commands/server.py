"""Start and stop a real ``sglang.launch_server`` with flatcake, for the demo, benchmarks and tests.

``ServerProcess`` launches the server in its own process group, waits for
``/health_generate`` (telling a ``progress(elapsed_s, stage)`` callback, once a second,
what the start is waiting for: ``startup_stage`` reads it from the server's log), and
kills the whole group on ``stop()``; a start that fails or is interrupted (Ctrl-C, at any
point of it) stops the server it launched before the exception goes on.  A CPU server runs with
``--device cpu --model-impl transformers`` and a capped ``--max-total-tokens``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from . import interrupts
from .processes import Managed, wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_server_args(model: str, store_dir: str, page_size: int = 16, backend: str = "flatcake",
                    max_total_tokens: int = 8192, hicache_ratio: float = 2.0,
                    extra: list[str] | None = None, extra_config: dict | None = None) -> list[str]:
    """Arguments for a CPU server with ``backend`` as the storage tier.

    ``none``: no cache beyond the device. ``flatcake-linker``: flatcake as SGLang's direct
    external linker (no host tier; ``extra_config`` goes into ``linker_extra_config`` beside
    ``store_dir``). Any other backend is a HiCache storage backend; ``extra_config`` is its
    ``--hicache-storage-backend-extra-config`` (``mooncake`` needs one:
    ``peers.backend_extra_config``)."""
    args = ["--model-path", model, "--device", "cpu", "--model-impl", "transformers",
            "--max-total-tokens", str(max_total_tokens), "--page-size", str(page_size),
            "--enable-cache-report", "--disable-cuda-graph", "--dtype", "float32",
            "--mem-fraction-static", "0.5"]
    if backend == "flatcake-linker":
        config = {"linker": "FlatCakeLinker", "linker_module_path": "sglang_flatcake.sglang.linker",
                  "linker_extra_config": {"store_dir": store_dir, **(extra_config or {})}}
        args += ["--enable-unified-cache-external-linker",
                 "--unified-cache-external-linker-backend", "dynamic",
                 "--unified-cache-external-linker-config", json.dumps(config)]
    elif backend != "none":
        args += ["--enable-hierarchical-cache", "--hicache-ratio", str(hicache_ratio),
                 "--hicache-storage-backend", backend,
                 "--hicache-storage-prefetch-policy", "wait_complete"]
        if backend == "flatcake":
            args += ["--flatcake-store-dir", store_dir]
        elif backend == "file" and extra_config is None:
            extra_config = {"file_storage_path": store_dir}
        if extra_config is not None:
            args += ["--hicache-storage-backend-extra-config", json.dumps(extra_config)]
    return args + list(extra or [])


BIND_FAILED = "error while attempting to bind on address"

# What SGLang logs as it starts, in order, and what the start waits for once it has.
STAGES = (
    ("server_args=", "the scheduler process to start (it imports SGLang again)"),
    ("Init parallel begin", "the model code to import"),
    ("Load weight begin", "the model weights to load"),
    ("Load weight end", "the KV cache to be allocated"),
    ("KV Cache is allocated", "the host pool and the storage backend"),
    ("Tree cache initialized", "the HTTP server to start"),
    ("Uvicorn running on", "the first request (warm-up)"),
    ("The server is fired up", "/health_generate to answer"),
)


def startup_stage(log: str) -> str:
    """What a starting server waits for, from its log so far (the latest ``STAGES`` marker)."""
    best, at = "Python to import SGLang", -1
    for marker, stage in STAGES:
        i = log.rfind(marker)
        if i > at:
            best, at = stage, i
    return best


class PortTaken(Exception):
    """Another process bound the server's port between ``free_port()`` and the bind."""


class ServerProcess(Managed):
    def __init__(self, args: list[str], port: int | None = None, log_path: str | None = None,
                 env: dict | None = None) -> None:
        self.base_args, self.fixed_port = list(args), port
        self._use_port(port or free_port())
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def _use_port(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = self.base_args + ["--host", "127.0.0.1", "--port", str(self.port)]

    def start(self, timeout: float = 600, tries: int = 3, progress=None) -> "ServerProcess":
        """Start and wait for ``/health_generate``.  A free port taken by another process
        before the server bound it (``address already in use`` in its log) is retried on a
        new port, ``tries`` times in all, unless the caller fixed the port.  ``progress``,
        if given, is called about once a second with (seconds since the start, what the
        start waits for now).  Raises ``RuntimeError`` while this server already runs (a
        second start would leave the first process running with nobody to stop it)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"the server at {self.url} is already running (pid {self.proc.pid})")
        t0 = time.monotonic()
        for attempt in range(tries):
            try:
                return self._start_once(timeout, progress, t0)
            except PortTaken:
                self.stop()
                if self.fixed_port or attempt == tries - 1:
                    raise RuntimeError(f"port {self.port} already in use (log: {self.log_path})") from None
                self._use_port(free_port())
        raise AssertionError("unreachable")

    def _port_taken(self, log: str | None = None) -> bool:
        log = self.tail(20000) if log is None else log
        return BIND_FAILED in log and f"'127.0.0.1', {self.port})" in log

    def _start_once(self, timeout: float, progress=None, t0: float = 0.0) -> "ServerProcess":
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL

        def healthy() -> bool:
            log = self.tail(64000)
            if self._port_taken(log):
                raise PortTaken(self.port)
            if progress is not None:
                progress(time.monotonic() - t0, startup_stage(log))
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} while starting: "
                                   f"{self.failure_line()} (log: {self.log_path})")
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=30) as r:
                    return r.status == 200
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                return False             # not listening yet
        try:
            with interrupts.held():      # a Ctrl-C comes once self.proc names the server
                self.proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server",
                                              *self.args], stdout=out, stderr=subprocess.STDOUT,
                                             env=self.env, start_new_session=True)
            wait_until(healthy, timeout, "the server to answer /health_generate", every=1.0)
        except TimeoutError:
            self.stop()
            raise TimeoutError(f"server not healthy after {timeout}s: {self.failure_line()} "
                               f"(log: {self.log_path})") from None
        except BaseException:            # Ctrl-C, a port taken, an exit: no server left behind
            self.stop()
            raise
        return self

    def tail(self, n: int = 4000) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        return Path(self.log_path).read_bytes()[-n:].decode(errors="replace")

    def failure_line(self) -> str:
        """The server's own one-line reason for stopping: its last ``error:`` line, else the
        last exception line of its log, else the last line."""
        lines = [x.strip() for x in self.tail(20000).splitlines() if x.strip()]
        for x in reversed(lines):
            if x.startswith("error:") or x.startswith("flatcake: error:"):
                return x
        for x in reversed(lines):
            head = x.split(":", 1)[0]
            if head.endswith(("Error", "Exception")) and " " not in head:
                return x
        return lines[-1] if lines else "no output"

    def post(self, path: str, body: dict, timeout: float = 600) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"{}")

    def get(self, path: str, timeout: float = 60) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read().decode()
