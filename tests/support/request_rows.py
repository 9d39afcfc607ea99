"""SGLang's own ``ReqToTokenPool`` on the CPU, as a linker's ``params.req_to_token_pool``."""

from __future__ import annotations

import torch


def held_rows(n_rows: int, width: int, dtype=torch.int32):
    """A real ``ReqToTokenPool`` whose ``req_to_token`` is ``n_rows`` x ``width`` and whose
    rows are all held (allocated, as if by running requests), so a test may write any row."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    pool = ReqToTokenPool(size=n_rows - 1, max_context_len=width, device="cpu",
                          enable_memory_saver=False)
    assert pool.alloc_rows(n_rows - 1) is not None and pool.available_size() == 0
    if dtype != pool.req_to_token.dtype:
        pool.req_to_token = pool.req_to_token.to(dtype)
    return pool
