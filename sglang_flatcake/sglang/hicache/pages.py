"""Moving whole pages between SGLang's host KV pool and the store's canonical block shape.

The store takes and returns blocks as ``(n, layers, block_layer_bytes)`` bytes
with K|V per layer (MHA) or one latent part (MLA), token-major inside a part.
SGLang's host pool keeps the same numbers in one of four layouts; this module
is the one place that knows them:

=====================  ===================================  ==============================
host layout            K (and V) buffer shape                 a page's view as (n, L, ps, ...)
=====================  ===================================  ==============================
``layer_first``        ``(L, size, heads, dim)``              ``buf[:, tokens]`` reshaped, permuted
``page_first``         ``(size, L, heads, dim)``              ``buf[tokens]`` reshaped, permuted
``page_first_direct``  ``(pages, L, ps, heads, dim)``         ``buf[pages]``
``page_head``          ``(pages, heads, ps, L, dim)``         ``buf[pages]`` permuted
=====================  ===================================  ==============================
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import ConfigError
from ..device_pool import kv_layout

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


class HostPages:
    """Gather pages of a host pool into canonical blocks and scatter them back.

    ``buffers`` are the pool's part tensors (``[k_buffer, v_buffer]`` for MHA,
    ``[kv_buffer]`` for MLA) in ``layout``.  Nothing here allocates pool memory.
    """

    def __init__(self, buffers: list[torch.Tensor], layout: str, page_size: int,
                 layer_num: int, kind: str) -> None:
        if layout not in LAYOUTS:
            raise ConfigError(f"flatcake: host layout {layout!r} is not supported; use one of "
                              f"{', '.join(LAYOUTS)} (--hicache-mem-layout)")
        shapes = {tuple(b.shape[-1:]) for b in buffers}
        if len(shapes) != 1 or len({b.dtype for b in buffers}) != 1:
            raise ConfigError("flatcake: K and V host buffers differ in head dim or dtype "
                              f"({[tuple(b.shape) for b in buffers]}); not supported")
        self.buffers, self.layout, self.ps, self.L = buffers, layout, page_size, layer_num
        b = buffers[0]
        self.dtype = b.dtype
        if layout == "page_head":
            self.heads, self.dim = b.shape[1], b.shape[-1]
        else:
            self.heads, self.dim = b.shape[-2], b.shape[-1]
        self.kv_layout = kv_layout(kind, layer_num, self.heads, self.dim, b.dtype, page_size)

    def _page_view(self, buf: torch.Tensor, tokens: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        n, ps, L = len(pages), self.ps, self.L
        if self.layout == "layer_first":
            return buf[:, tokens].reshape(L, n, ps, self.heads, self.dim).permute(1, 0, 2, 3, 4)
        if self.layout == "page_first":
            return buf[tokens].reshape(n, ps, L, self.heads, self.dim).permute(0, 2, 1, 3, 4)
        if self.layout == "page_first_direct":
            return buf[pages]
        return buf[pages].permute(0, 3, 2, 1, 4)          # page_head -> (n, L, ps, H, D)

    def _indices(self, host_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = host_indices.to("cpu", torch.long)
        if tokens.numel() % self.ps:
            raise ValueError(f"flatcake: {tokens.numel()} host indices is not whole pages of {self.ps}")
        pages = tokens[::self.ps] // self.ps
        return tokens, pages

    def gather(self, host_indices: torch.Tensor) -> np.ndarray:
        """Canonical ``(n, L, block_layer_bytes)`` uint8 copy of the pages at ``host_indices``."""
        tokens, pages = self._indices(host_indices)
        parts = [self._page_view(b, tokens, pages) for b in self.buffers]
        blocks = torch.stack(parts, dim=2).contiguous()            # (n, L, P, ps, H, D)
        return blocks.view(torch.uint8).reshape(len(pages), self.L, -1).numpy()

    def scatter(self, host_indices: torch.Tensor, blocks: np.ndarray, count: int) -> None:
        """Write the first ``count`` canonical blocks into the pages at ``host_indices``."""
        if count <= 0:
            return
        tokens, pages = self._indices(host_indices)
        tokens, pages = tokens[:count * self.ps], pages[:count]
        n, ps, L = count, self.ps, self.L
        t = torch.from_numpy(np.ascontiguousarray(blocks[:count])).view(self.dtype)
        t = t.reshape(n, L, len(self.buffers), ps, self.heads, self.dim)
        for p, buf in enumerate(self.buffers):
            src = t[:, :, p]                                        # (n, L, ps, H, D)
            if self.layout == "page_first_direct":
                buf[pages] = src
            elif self.layout == "page_head":
                buf[pages] = src.permute(0, 3, 2, 1, 4)
            elif self.layout == "page_first":
                buf[tokens] = src.permute(0, 2, 1, 3, 4).reshape(n * ps, L, self.heads, self.dim)
            else:
                buf[:, tokens] = src.permute(1, 0, 2, 3, 4).reshape(L, n * ps, self.heads, self.dim)
