"""The storage backends flatcake is compared with, as a CPU server runs them.

``none`` (HiCache off), SGLang's ``file`` (one file per page), SGLang's
``mooncake`` against a real Mooncake Store (a ``mooncake_master`` started here,
TCP, 512 MiB segment), ``flatcake`` (HiCache mode: SGLang's host pool in front),
``flatcake-linker`` (SGLang's direct external linker, no host pool) and
``mooncake-linker`` (SGLang's built-in Mooncake direct linker: it cannot serve a
plain Llama-style model in SGLang 0.5.23, and ``mooncake_linker_unsupported`` says
why; the demo shows the row with that reason).  Mooncake is optional (``pip install
'.[peers]'`` plus Debian's ``libibverbs1 librdmacm1 libnuma1``);
``mooncake_missing()`` says why it cannot run, and callers skip it with that line.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
from pathlib import Path

from . import interrupts
from .processes import Managed, wait_until
from .server import free_port

BACKENDS = ("none", "file", "mooncake", "flatcake", "flatcake-linker", "mooncake-linker")
MOONCAKE_SEGMENT_BYTES = 512 << 20


def mooncake_linker_unsupported(sglang_version: str | None = None) -> str | None:
    """Why SGLang's Mooncake direct linker cannot serve the demo's (plain Llama) model, or
    None where this demo does not know it to fail.  In 0.5.23 the built-in linkers build
    their pool view with ``resolve_hybrid_device_pool_group``, whose plain-KV strategy has
    no ``build_direct_linker_pool_group`` (only hybrid, DSA and V4 pools do)."""
    if sglang_version is None:
        from importlib.metadata import version
        sglang_version = version("sglang")
    if sglang_version.startswith("0.5.23"):
        return (f"SGLang {sglang_version}'s Mooncake direct linker cannot serve a plain "
                f"(Llama-style) MHA model: its pool view (resolve_hybrid_device_pool_group) "
                f"has no direct-linker strategy for plain KV pools, only hybrid/DSA/V4 ones")
    return None


def mooncake_missing() -> str | None:
    """Why SGLang's mooncake backend cannot run here, or None when it can."""
    if importlib.util.find_spec("mooncake") is None:
        return "the mooncake package is not installed (pip install 'sglang-flatcake[peers]')"
    if shutil.which("mooncake_master") is None:
        return "mooncake_master is not on PATH (pip install 'sglang-flatcake[peers]')"
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401  (loads libibverbs)
    except (ImportError, OSError) as e:
        return (f"mooncake cannot load ({e}); on Debian: apt-get install libibverbs1 "
                f"librdmacm1 libnuma1")
    return None


def mooncake_extra_config(master_port: int, segment_bytes: int = MOONCAKE_SEGMENT_BYTES) -> dict:
    return {"master_server_address": f"127.0.0.1:{master_port}",
            "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "device_name": "",
            "global_segment_size": segment_bytes, "local_hostname": "127.0.0.1"}


def backend_extra_config(backend: str, store_dir: str, mooncake_port: int | None = None) -> dict | None:
    """``--hicache-storage-backend-extra-config`` for ``backend`` (flatcake takes a flag)."""
    if backend == "file":
        return {"file_storage_path": store_dir}
    if backend == "mooncake":
        if mooncake_port is None:
            raise ValueError("the mooncake backend needs a running mooncake_master (its port)")
        return mooncake_extra_config(mooncake_port)
    return None


class MooncakeMaster(Managed):
    """A ``mooncake_master`` on 127.0.0.1 for one server; stopped on exit."""

    grace = 20

    def __init__(self, log_path: str | Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log_path = str(log_path)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30) -> "MooncakeMaster":
        log = open(self.log_path, "ab")

        def listening() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}; "
                                   f"log: {self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return True
            except OSError:
                return False             # not listening yet
        try:
            # its HTTP metrics/admin server too: on loopback and a free port (its default, 9003
            # on 0.0.0.0, made a second master on one machine exit with "Address already in use")
            with interrupts.held():      # a Ctrl-C comes once self.proc names it
                self.proc = subprocess.Popen(["mooncake_master", "--rpc_address=127.0.0.1",
                                              f"--rpc_port={self.port}",
                                              "--metrics_host=127.0.0.1",
                                              f"--metrics_port={free_port()}"], stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)
            wait_until(listening, timeout, f"mooncake_master to listen on {self.port}", 0.2)
        except BaseException:            # a timeout or a Ctrl-C: not left running
            self.stop()
            raise
        return self



def extra_config_flag(cfg: dict | None) -> list[str]:
    return [] if cfg is None else ["--hicache-storage-backend-extra-config", json.dumps(cfg)]


def linker_flags(store_dir: str, extra_config: dict | None = None) -> list[str]:
    """SGLang's flags that select flatcake as its direct external linker on ``store_dir``."""
    config = {"linker": "FlatCakeLinker", "linker_module_path": "sglang_flatcake.sglang.linker",
              "linker_extra_config": {"store_dir": store_dir, **(extra_config or {})}}
    return ["--enable-unified-cache-external-linker",
            "--unified-cache-external-linker-backend", "dynamic",
            "--unified-cache-external-linker-config", json.dumps(config)]
