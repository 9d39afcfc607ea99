"""The device KV pool as the linker sees it: per-layer buffers, the block layout, page gathers.

SGLang 0.5.23's MHA pool keeps ``k_buffer[l]``/``v_buffer[l]`` shaped ``[slots, heads,
head_dim]``; its MLA pool one ``kv_buffer[l]`` shaped ``[slots, 1, latent]``.  A store
block is one page of every layer, ``K | V`` (or the latent part) per layer, token-major
inside a part: the same bytes ``pages.HostPages`` makes from a host pool, so a store
written in HiCache mode has the same layout.  ``DevicePool.refusal`` says, by name, what
cannot be served (checked at start).  With ``FLATCAKE_EMULATE_DEVICE=1`` a CPU pool is
served as emulated device memory (``read.device``), so CI runs the GPU branch.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigError
from ..layout import KVLayout
from ..read import device as dv
from .pages import _TORCH_DTYPES


class DevicePool:
    """A view of SGLang's device KV pool; owns nothing (the pool owns its buffers)."""

    def __init__(self, kvcache, page_size: int) -> None:
        why = self.refusal(kvcache)
        if why:
            raise ConfigError(f"flatcake linker: {why}")
        self.kind = "mha" if hasattr(kvcache, "k_buffer") else "mla"
        self.k = list(kvcache.k_buffer if self.kind == "mha" else kvcache.kv_buffer)
        self.v = list(kvcache.v_buffer) if self.kind == "mha" else None
        self.page = int(page_size)
        b = self.k[0]
        heads, dim, name = int(b.shape[-2]), int(b.shape[-1]), _TORCH_DTYPES[b.dtype]
        self.layout = (KVLayout.mha(len(self.k), heads, dim, name, self.page) if self.kind == "mha"
                       else KVLayout.mla(len(self.k), heads * dim, name, self.page))
        self.device = dv.device_of(self.k[0])     # None: host memory (a CPU server)
        self.dest_k, self.dest_v = self.k, self.v
        if self.device is None and dv.emulation_wanted():
            self.device = dv.EMULATED
            self.dest_k = [dv.emulated_view(t) for t in self.k]
            self.dest_v = None if self.v is None else [dv.emulated_view(t) for t in self.v]

    @staticmethod
    def refusal(kvcache) -> str | None:
        """Why this pool cannot be linked, or None."""
        name = type(kvcache).__name__
        if hasattr(kvcache, "k_buffer") and hasattr(kvcache, "v_buffer"):
            bufs = [kvcache.k_buffer, kvcache.v_buffer]
        elif hasattr(kvcache, "kv_buffer"):
            bufs = [kvcache.kv_buffer]
        else:
            return f"the device pool {name} has no per-layer KV buffers (k_buffer/v_buffer or " \
                   f"kv_buffer); supported: MHA and MLA token pools"
        first = bufs[0][0]
        if any(len(b) != len(bufs[0]) for b in bufs) or \
                any(tuple(b[0].shape[-2:]) != tuple(first.shape[-2:]) for b in bufs):
            return f"the device pool {name} has K and V buffers of different shapes " \
                   f"({[tuple(b[0].shape) for b in bufs]})"
        if first.dtype not in _TORCH_DTYPES:
            return f"KV dtype {first.dtype} is not supported"
        if first.dim() != 3:
            return f"the device pool {name} has {first.dim()}-d layer buffers; expected " \
                   f"[slots, heads, head_dim]"
        return None

    @property
    def parts(self) -> list:
        return [self.k] if self.v is None else [self.k, self.v]

    def gather(self, slots: torch.Tensor) -> np.ndarray:
        """Canonical ``(n, layers, block_layer_bytes)`` uint8 host copy of the pages whose
        token slots are ``slots`` (page aligned, ``page`` per page, in order)."""
        idx = slots.to(self.k[0].device, torch.int64)
        if idx.numel() % self.page:
            raise ValueError(f"{idx.numel()} slots is not whole pages of {self.page}")
        n = idx.numel() // self.page
        per_layer = [torch.cat([p[layer][idx].reshape(n, -1) for p in self.parts], dim=1)
                     for layer in range(len(self.k))]
        blocks = torch.stack(per_layer, dim=1).contiguous().cpu()
        return blocks.view(torch.uint8).reshape(n, len(self.k), -1).numpy()

    def poison(self, slots) -> None:
        """Fill ``slots`` of every layer with NaN (a test hook: see ``linker_load``)."""
        idx = torch.as_tensor(slots, dtype=torch.int64).to(self.k[0].device)
        for part in self.parts:
            for buf in part:
                buf[idx] = float("nan") if buf.dtype.is_floating_point else 0xFF
