"""``FlatCakeLinker`` over SGLang's own MLA token pool (``MLATokenToKVPool``, built on the CPU),
and the TP shapes it serves or refuses, without a server.

The MLA pool keeps one ``kv_buffer[l]`` shaped ``[slots, 1, kv_lora_rank + rope_dim]`` per
layer; pages offloaded from it come back bit-exactly into other, poisoned slots through the
tree's calls.  With two TP ranks (two real processes in one gloo group) each rank opens its
own store for an MHA pool, and an MLA pool is refused at start, by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.unified_cache.unified_cache_linker")

from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402

from sglang_flatcake.commands.server import free_port  # noqa: E402
from sglang_flatcake.sglang.linker import FlatCakeLinker  # noqa: E402
from tests.support import chain  # noqa: E402
from tests.support.request_rows import held_rows  # noqa: E402

PAGE, LAYERS, LORA, ROPE, SLOTS = 4, 3, 32, 16, 256
ARGS = SimpleNamespace(model_path="tiny-mla", served_model_name=None, revision=None,
                       enable_metrics=False)


def mla_pool() -> MLATokenToKVPool:
    return MLATokenToKVPool(size=SLOTS, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=LORA,
                            qk_rope_head_dim=ROPE, layer_num=LAYERS, device="cpu",
                            enable_memory_saver=False)


def linker_over(pool, store_dir, row_pool) -> FlatCakeLinker:
    params = CacheInitParams(disable=False, page_size=PAGE,
                             token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
                             req_to_token_pool=row_pool)
    cfg = {"store_dir": str(store_dir), "durable": False, "io_engine": "posix",
           "memory_bytes": 0, "ssd_bytes": "64MiB", "extent_bytes": "64KiB"}
    return FlatCakeLinker(ARGS, params, components={ComponentType.FULL}, extra_config=cfg)


def slots(first_page: int, pages: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)


def kv(pool, idx) -> torch.Tensor:
    return torch.stack([b[idx] for b in pool.kv_buffer])


@pytest.mark.parametrize("device", ["host", "emulated"])
def test_mla_pages_come_back_bit_exactly_into_poisoned_slots(tmp_path, monkeypatch, device):
    """``emulated``: the CPU pool served as device memory, so the load takes the GPU branch."""
    monkeypatch.setenv("FLATCAKE_EMULATE_DEVICE", "1" if device == "emulated" else "0")
    pool, row_pool = mla_pool(), held_rows(4, 128)
    rows = row_pool.req_to_token
    linker = linker_over(pool, tmp_path / "store", row_pool)
    try:
        assert linker.pool.kind == "mla" and linker.store.layout.kind == "mla"
        keys, src = chain(6, "mla"), slots(1, 6)
        g = torch.Generator().manual_seed(7)
        for b in pool.kv_buffer:
            b[src] = torch.randn(len(src), 1, LORA + ROPE, generator=g).to(torch.bfloat16)
        rows[0, :len(src)] = src.to(torch.int32)
        want = kv(pool, src).clone()
        assert linker.offload([PoolTransfer(PoolName.KV, device_indices=src, keys=keys)])
        deadline = time.monotonic() + 30
        while linker.num_completed_offloads() == 0:
            assert time.monotonic() < deadline, "offload did not complete"
            time.sleep(0.01)
        assert linker.pop_completed_offload() is True
        assert linker.stats()["offload"]["pages_written"] == 6
        dst = slots(20, 6)
        for b in pool.kv_buffer:                 # poisoned destination, the source wiped
            b[dst] = float("nan")
            b[src] = 0
        assert linker.lookup("r", [PoolTransfer(PoolName.KV, keys=keys)]) == list(range(1, 7))
        assert linker.load("r", [PoolTransfer(PoolName.KV, device_indices=dst, keys=keys)])
        index = linker.start_layer_wise_loading()
        linker.layer_done_counter.set_consumer(index)
        for layer in range(LAYERS):
            linker.layer_done_counter.wait_until(layer)
        assert linker.finish_layer_wise_loading(index)
        got = kv(pool, dst)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))    # bit-exact
    finally:
        linker.close()


# Run as one of two ranks of a gloo group: build a linker over an MHA pool, then over an
# MLA pool; print what each did as one JSON line.
TWO_RANKS = r"""
import json, sys, torch
from types import SimpleNamespace
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang_flatcake.errors import ConfigError
from sglang_flatcake.sglang.linker import FlatCakeLinker
torch.distributed.init_process_group("gloo")
store = sys.argv[1]
mha = SimpleNamespace(k_buffer=[torch.zeros(64, 2, 8) for _ in range(2)],
                      v_buffer=[torch.zeros(64, 2, 8) for _ in range(2)])
mla = MLATokenToKVPool(size=64, page_size=4, dtype=torch.bfloat16, kv_lora_rank=32,
                       qk_rope_head_dim=16, layer_num=2, device="cpu", enable_memory_saver=False)
out = {}
for name, pool in (("mha", mha), ("mla", mla)):
    params = CacheInitParams(disable=False, page_size=4,
                             token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
                             req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros((2, 64))))
    try:
        lk = FlatCakeLinker(SimpleNamespace(model_path="m", served_model_name=None, revision=None,
                                            enable_metrics=False), params,
                            components={ComponentType.FULL},
                            extra_config={"store_dir": store, "durable": False,
                                          "io_engine": "posix", "memory_bytes": 0})
        out[name] = {"store": str(lk.store.root)}
        lk.close()
    except ConfigError as e:
        out[name] = {"refused": str(e)}
print("RESULT " + json.dumps(out), flush=True)
torch.distributed.destroy_process_group()
"""


def test_two_tp_ranks_each_open_a_store_and_mla_is_refused_by_name(tmp_path):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(tmp_path / "store")],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    results = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        (line,) = [x for x in out.splitlines() if x.startswith("RESULT ")]
        results.append(json.loads(line[len("RESULT "):]))
    stores = [r["mha"]["store"] for r in results]
    assert len(set(stores)) == 2 and all(f"tp{i}of2" in s for i, s in enumerate(stores)), stores
    for r in results:
        assert r["mla"]["refused"].startswith("flatcake linker: MLA models with --tp-size > 1 "
                                              "are not supported"), r
