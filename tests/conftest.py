"""Shared fixtures: small layouts, chain keys and deterministic block contents."""

from __future__ import annotations

import hashlib
import subprocess

import numpy as np
import pytest

from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.layout import KVLayout


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


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout.mha(layers=4, kv_heads=2, head_dim=64, dtype="bfloat16", page_tokens=16)


@pytest.fixture
def config() -> FlatCakeConfig:
    return FlatCakeConfig(memory_bytes=4 << 20, ssd_bytes=256 << 20, extent_bytes=1 << 20,
                          io_threads=2)


def mount_small_fs(mnt, size: str = "3m") -> None:
    """Mount a small private tmpfs at ``mnt`` (a real full disk); skip where mounting is not
    allowed (no root)."""
    mnt.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                        str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a small filesystem here: " + r.stderr.decode().strip())


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    mount_small_fs(mnt)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])
