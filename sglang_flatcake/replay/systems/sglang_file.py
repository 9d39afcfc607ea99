"""SGLang's own ``HiCacheFile`` as the SSD tier of a tiered system (needs sglang)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .base import DataPool, SystemContext
from .ssd_tiers import ReadJob, SsdTier
from .tiered import TieredSystem


def unavailable_reason() -> str | None:
    """Why sglang-file cannot run here, or None when it can."""
    try:
        import torch  # noqa: F401
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig  # noqa: F401
    except Exception as e:  # sglang (or torch) is an optional dependency
        return f"sglang is not importable here ({type(e).__name__}: {e})"
    return None


class _Done:
    def wait(self) -> None:
        return None


class HiCacheFileTier(SsdTier):
    """One ``.bin`` file per block, written and read by SGLang's ``HiCacheFile`` (buffered
    Python I/O, not the PosixEngine), bounded by its own LRU evictor (``max_size``)."""

    def __init__(self, ctx: SystemContext, pool: DataPool) -> None:
        super().__init__(None, ctx.sizing.block_bytes, pool)
        import torch
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
        self.torch = torch
        cfg = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
            model_name="flatcake-replay", extra_config={"max_size": int(ctx.ssd_bytes)})
        path = ctx.root / "hicache"
        path.mkdir(parents=True, exist_ok=True)
        self.hc = HiCacheFile(cfg, file_path=str(path))

    def has(self, key: str) -> bool:
        return self.hc.exists(key)

    def store(self, keys: Sequence[str]) -> tuple[int, int]:
        data = self.pool.blocks(len(keys))
        vals = [self.torch.from_numpy(np.ascontiguousarray(row)) for row in data]
        self.hc.batch_set(list(keys), vals)
        return len(keys) * self.block_bytes, len(keys)

    def read(self, keys: Sequence[str], targets: Sequence[np.ndarray]) -> ReadJob:
        """Synchronous, as SGLang's single prefetch thread calls it."""
        got = self.hc.batch_get(list(keys), [self.torch.from_numpy(t) for t in targets])
        missing = sum(1 for g in got if g is None)
        if missing:
            raise RuntimeError(f"HiCacheFile lost {missing} of {len(keys)} pages it reported stored")
        return ReadJob([_Done()], len(keys) * self.block_bytes, len(keys))


class SglangFile(TieredSystem):
    """sglang-file: SGLang's ``HiCacheFile`` as the SSD tier.

    Rules: as tiered-lru in memory (LRU, demotion in eviction order, staging,
    cancellation when staging is full); a demoted block becomes one ``.bin`` file
    written by ``HiCacheFile.batch_set``, read back one file per block by
    ``batch_get`` (buffered reads, one batch at a time, as SGLang's prefetch
    thread does), and evicted by HiCacheFile's own LRU evictor when its
    ``max_size`` (the SSD budget) is reached.
    """

    name = "sglang-file"

    def make_tier(self, ctx: SystemContext, pool: DataPool) -> SsdTier:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        return HiCacheFileTier(ctx, pool)
