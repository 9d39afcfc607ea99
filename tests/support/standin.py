"""A stand-in SGLang scheduler for ``DirectRestorer``: tree, allocator and device pool.

Just what ``sglang.hicache.direct.DirectRestorer`` calls between ``allocate`` and ``finish``
(``match_prefix``, ``inc_lock_ref``/``dec_lock_ref``, ``evict``, ``insert``,
``path_device_indices``; ``alloc``/``free``/``available_size``/``get_kvcache``), over
torch KV buffers shaped like SGLang 0.5.23's pools (MHA ``k_buffer``/``v_buffer``, MLA
``kv_buffer``) on any torch device.  A test double, never used by a server: it lives in the
package so that both ``benchmarks/gpu_check.py`` (on a machine without SGLang:
``stub_sglang`` installs the three parameter classes it needs) and the tests
(``tests/read/test_device_path.py`` and others, with the real SGLang classes) import it.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace


def module(name: str) -> types.ModuleType:
    """``sys.modules[name]``, created empty (with its parents, each an attribute of the one
    above) when missing; an existing module is returned as it is."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sub not in sys.modules:
            sys.modules[sub] = types.ModuleType(sub)
            if i > 1:
                setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], sys.modules[sub])
    return sys.modules[name]


def stub_sglang() -> bool:
    """Make ``sglang.srt.mem_cache.base_prefix_cache`` importable (True when stubbed)."""
    try:
        import sglang.srt.mem_cache.base_prefix_cache  # noqa: F401
        return False
    except ImportError:
        pass

    @dataclass
    class Params:
        key: object = None
        value: object = None
        num_tokens: int = 0
        prev_prefix_len: int = 0
        inserted_len: int = 0

    m = module("sglang.srt.mem_cache.base_prefix_cache")
    m.EvictParams = m.MatchPrefixParams = m.InsertParams = Params
    return True


class Pool:
    """SGLang's device KV pool: per-layer ``[slots, heads, dim]`` buffers."""

    def __init__(self, torch, kind: str, layers: int, slots: int, heads: int, dim: int,
                 dtype, device: str) -> None:
        mk = lambda: [torch.zeros((slots, heads, dim), dtype=dtype, device=device)  # noqa: E731
                      for _ in range(layers)]
        if kind == "mha":
            self.k_buffer, self.v_buffer = mk(), mk()
        else:
            self.kv_buffer = mk()


class Allocator:
    def __init__(self, torch, pool: Pool, slots: int, page: int, device: str) -> None:
        self.torch, self.pool, self.size, self.device = torch, pool, slots, device
        self.free_slots = list(range(page, slots))     # slot run 0..page-1 is padding
        self.freed = 0

    def get_kvcache(self):
        return self.pool

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int):
        if n > len(self.free_slots):
            return None
        got, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return self.torch.tensor(got, dtype=self.torch.int64, device=self.device)

    def free(self, slots) -> None:
        got = slots.cpu().tolist()
        self.freed += len(got)
        self.free_slots.extend(got)


class Tree:
    """A radix tree that holds one device prefix (``prefix_slots``) and records inserts."""

    def __init__(self, torch, prefix_slots) -> None:
        self.torch, self.prefix = torch, prefix_slots
        self.locks, self.inserts, self.evictions = 0, [], 0
        self.prefetch_loaded_tokens_by_reqid: dict = {}
        self.prefetch_loaded_storage_start_by_reqid: dict = {}

    def match_prefix(self, params):
        n = min(len(params.key), len(self.prefix))
        return SimpleNamespace(device_prefix_len=n, last_device_node="prefix")

    def inc_lock_ref(self, node):
        self.locks += 1
        return SimpleNamespace(to_dec_params=lambda: "dec")

    def dec_lock_ref(self, node, params) -> None:
        self.locks -= 1

    def evict(self, params) -> None:
        self.evictions += 1

    def path_device_indices(self, node):
        return self.prefix

    def insert(self, params):
        self.inserts.append(params)     # like SGLang's InsertResult: nothing was there before
        return SimpleNamespace(prefix_len=params.prev_prefix_len, last_device_node="restored")


def scheduler(torch, kind: str, layers: int, slots: int, heads: int, dim: int, dtype,
              page: int, device: str, prefix_tokens: int = 0):
    """(scheduler, pool, allocator, tree); the tree's device prefix takes the first
    ``prefix_tokens`` free slots."""
    pool = Pool(torch, kind, layers, slots, heads, dim, dtype, device)
    alloc = Allocator(torch, pool, slots, page, device)
    prefix = alloc.alloc(prefix_tokens) if prefix_tokens else torch.zeros(0, dtype=torch.int64)
    tree = Tree(torch, prefix)
    sched = SimpleNamespace(tree_cache=tree, token_to_kv_pool_allocator=alloc, page_size=page)
    return sched, pool, alloc, tree


def backend(store):
    """What ``DirectRestorer`` reads from SGLang's storage backend object."""
    return SimpleNamespace(store=store, config=store.config, host_pool_gets=0,
                           cluster=None)
