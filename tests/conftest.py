"""Shared fixtures: a small layout and config, a small real filesystem, a real redis-server,
a tiny Llama for the real-server tests.  Shared helpers are in ``tests/support``."""

from __future__ import annotations

import subprocess

import pytest

from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.layout import KVLayout
from tests.support import mount_small_fs
from tests.support.redis_server import redis_url, secret_file  # noqa: F401  (fixtures)


EMULATED_DELAY_S = 0.05


@pytest.fixture(scope="session", autouse=True)
def emulated_work_stays_pending():
    """Every test runs the emulated devices with a small ``delay_s``: work that nothing
    waited for is still pending when another stream uses its memory, so a missing wait is
    a ``Hazard`` on every run instead of only when the machine is slow (CI stop 27)."""
    from sglang_flatcake.read import emulated
    old = [d.delay_s for d in emulated.EMULATED_DEVICES]
    for d in emulated.EMULATED_DEVICES:
        d.delay_s = EMULATED_DELAY_S
    yield
    for d, o in zip(emulated.EMULATED_DEVICES, old):
        d.delay_s = o


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout.mha(layers=4, kv_heads=2, head_dim=64, dtype="bfloat16", page_tokens=16)


@pytest.fixture
def config() -> FlatCakeConfig:
    return FlatCakeConfig(memory_bytes=4 << 20, ssd_bytes=256 << 20, extent_bytes=1 << 20,
                          io_threads=2)


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    mount_small_fs(mnt)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Llama built at test time (no download), once per module."""
    from sglang_flatcake.commands.tiny_model import build_tiny_llama
    return str(build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))
