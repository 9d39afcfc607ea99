"""The one device-KV view of both modes (``sglang/device_pool.py``): what it refuses by name,
the store layout it derives, the bytes it gathers, and the emulated device it serves on."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from sglang_flatcake.errors import ConfigError  # noqa: E402
from sglang_flatcake.read import device as dv  # noqa: E402
from sglang_flatcake.sglang.device_pool import TORCH_DTYPES, DevicePool, kv_layout  # noqa: E402


def mha(layers=2, slots=32, heads=2, dim=4, dtype=torch.bfloat16, v_dim=None):
    mk = lambda d: [torch.zeros((slots, heads, d), dtype=dtype) for _ in range(layers)]  # noqa: E731
    return SimpleNamespace(k_buffer=mk(dim), v_buffer=mk(v_dim or dim))


def test_the_refusals_name_what_cannot_be_served():
    assert DevicePool.refusal(mha()) is None
    assert "no per-layer KV buffers" in DevicePool.refusal(SimpleNamespace())
    assert "different shapes" in DevicePool.refusal(mha(v_dim=8))
    assert "KV dtype torch.int32 is not supported" in DevicePool.refusal(mha(dtype=torch.int32))
    flat = SimpleNamespace(kv_buffer=[torch.zeros((32, 8))])
    assert "2-d layer buffers" in DevicePool.refusal(flat)
    with pytest.raises(ConfigError, match="^flatcake: KV dtype"):
        DevicePool(mha(dtype=torch.int32), 4)


def test_the_layout_is_the_stores_for_mha_and_mla():
    assert TORCH_DTYPES[torch.bfloat16] == "bfloat16"
    pool = DevicePool(mha(layers=3, heads=2, dim=4), 8)
    assert pool.kind == "mha" and pool.layout == kv_layout("mha", 3, 2, 4, torch.bfloat16, 8)
    assert pool.layout.block_layer_bytes == 2 * 8 * 2 * 4 * 2          # K|V, page, heads, dim, bf16
    mla = DevicePool(SimpleNamespace(kv_buffer=[torch.zeros((32, 1, 6))] * 2), 4)
    assert mla.kind == "mla" and mla.v is None and mla.layout.block_layer_bytes == 4 * 6 * 4
    with pytest.raises(ConfigError, match="KV dtype torch.int32"):
        kv_layout("mha", 1, 1, 1, torch.int32, 4)


def test_gather_is_k_then_v_per_layer_token_major_and_poison_fills_nan():
    kv = mha(layers=2, slots=16, heads=1, dim=2, dtype=torch.float32)
    for layer in range(2):
        kv.k_buffer[layer][:] = torch.arange(32.).reshape(16, 1, 2) + 100 * layer
        kv.v_buffer[layer][:] = -kv.k_buffer[layer]
    pool = DevicePool(kv, 4)
    got = pool.gather(torch.arange(4, 8)).view("<f4")                  # page 1
    k1 = kv.k_buffer[1][4:8].reshape(-1).numpy()
    assert got.shape == (1, 2, 16) and (got[0, 1, :8] == k1).all() and (got[0, 1, 8:] == -k1).all()
    with pytest.raises(ValueError, match="not whole pages"):
        pool.gather(torch.arange(3))
    pool.poison([5])
    assert torch.isnan(kv.v_buffer[0][5]).all() and not torch.isnan(kv.v_buffer[0][4]).any()


def test_emulation_serves_the_pool_on_the_calling_threads_device(monkeypatch):
    monkeypatch.setenv(dv.EMULATE_ENV, "0")
    assert DevicePool(mha(), 4).device is None
    monkeypatch.setenv(dv.EMULATE_ENV, "1")
    out = {}

    def scheduler_thread():
        dv.EMULATED_DEVICES[1].activate()
        out["pool"] = DevicePool(mha(), 4)
    t = threading.Thread(target=scheduler_thread)
    t.start()
    t.join()
    pool = out["pool"]
    assert pool.device is dv.EMULATED_DEVICES[1]
    assert all(isinstance(x, dv.EmuArray) for x in pool.dest_k + pool.dest_v)
    assert pool.k[0] is not pool.dest_k[0]                   # the view; the pool keeps its own
