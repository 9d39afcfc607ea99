"""Shared fixtures: small layouts, chain keys and deterministic block contents."""

from __future__ import annotations

import hashlib

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
