"""Helpers the tests share: SGLang-style chain keys, block contents derived from the key,
a small real filesystem, a free port.  More specific helpers live in the submodules:
``engines`` (the I/O engine contract), ``window`` (session files and stores for the read
window), ``scatter_cases`` (the scatter kernel's case sweep), ``cuda_harness`` (a ``.cu``
source compiled for the CPU), ``servers`` (real SGLang servers), ``redis_server`` (the
``redis_url`` fixture's server), ``crash_writer`` (the child ``test_crash`` kills).  The
SGLang scheduler stand-in is ``sglang_flatcake.sglang.standin`` (benchmarks use it too).

Tests import from here (``from tests.support import chain``), never from another test module
or from ``benchmarks/``; fixtures are in ``tests/conftest.py``."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sglang_flatcake.commands.server import free_port
from sglang_flatcake.layout import KVLayout

ROOT = Path(__file__).resolve().parents[2]   # the repository

__all__ = ["ROOT", "chain", "extend", "blocks_for", "mount_small_fs", "free_port", "repo_env",
           "run_benchmark"]


def repo_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH`` (a child
    process imports ``sglang_flatcake`` from here), plus ``extra``."""
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            **extra}


def run_benchmark(script: str, *args: str, timeout: float = 600,
                  **env: str) -> subprocess.CompletedProcess:
    """``python benchmarks/<script> args...`` as a user runs it, ``env`` added to the
    environment (output captured as text)."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=timeout, env=repo_env(**env))


def chain(n: int, seed: str = "a", start: bytes | None = None) -> list[str]:
    """SGLang-style keys: hex SHA-256 chain."""
    h = start or hashlib.sha256(seed.encode()).digest()
    out = []
    for i in range(n):
        h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
        out.append(h.hex())
    return out


def extend(keys: list[str], n: int, seed: str = "x") -> list[str]:
    """Keys that continue the chain ``keys`` (a branch when ``seed`` differs)."""
    return chain(n, seed, start=bytes.fromhex(keys[-1]) + seed.encode())


def blocks_for(layout: KVLayout, keys: list[str]) -> np.ndarray:
    """Contents derived from each key, so any mix-up shows."""
    out = np.empty((len(keys), layout.block_bytes), np.uint8)
    for i, k in enumerate(keys):
        rng = np.random.default_rng(int(k[:15], 16))
        out[i] = rng.integers(0, 256, layout.block_bytes, dtype=np.uint8)
    return out


def mount_small_fs(mnt, size: str = "3m") -> None:
    """Mount a small private tmpfs at ``mnt`` (a real full disk); skip where mounting is not
    allowed (no root)."""
    mnt.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                        str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a small filesystem here: " + r.stderr.decode().strip())
