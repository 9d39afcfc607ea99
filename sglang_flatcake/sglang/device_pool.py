"""SGLang's device KV pool as both modes see it (one view), and the KV dtypes a store holds.

MHA pools keep ``k_buffer[l]``/``v_buffer[l]`` shaped ``[slots, heads, head_dim]``, MLA pools
one ``kv_buffer[l]`` shaped ``[slots, 1, latent]``.  A store block is one page of every layer,
``K | V`` (or the latent part) per layer, token-major inside a part, as ``hicache.pages`` makes
from a host pool.  With ``FLATCAKE_EMULATE_DEVICE=1`` a CPU pool is served as memory of the
calling thread's emulated device (``read.device``), so CI runs the GPU branch.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigError
from ..layout import KVLayout
from ..read import device as dv

TORCH_DTYPES = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.int8: "int8", torch.uint8: "uint8", torch.float64: "float64",
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        TORCH_DTYPES[getattr(torch, _name)] = _name


def kv_parts(pool) -> tuple[str, list]:
    """``("mha", [k_buffer, v_buffer])``, ``("mla", [kv_buffer])`` or ``("", [])`` for a device
    or host pool without per-layer K/V buffers."""
    if hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
        return "mha", [pool.k_buffer, pool.v_buffer]
    return ("mla", [pool.kv_buffer]) if hasattr(pool, "kv_buffer") else ("", [])


def kv_layout(kind: str, layers: int, heads: int, dim: int, dtype, page: int) -> KVLayout:
    """The store's block layout of a pool (``kind`` mha | mla) of torch ``dtype``;
    ``ConfigError`` naming the dtype when the store cannot hold it."""
    name = TORCH_DTYPES.get(dtype)
    if name is None:
        raise ConfigError(f"flatcake: KV dtype {dtype} is not supported")
    if kind == "mha":
        return KVLayout.mha(int(layers), int(heads), int(dim), name, int(page))
    return KVLayout.mla(int(layers), int(heads) * int(dim), name, int(page))


class DevicePool:
    """A view of SGLang's device KV pool; owns nothing (the pool owns its buffers).
    ``dest_k``/``dest_v`` are what a restore writes (emulated views under emulation)."""

    def __init__(self, kvcache, page_size: int) -> None:
        why = self.refusal(kvcache)
        if why:
            raise ConfigError(f"flatcake: {why}")
        self.kind, parts = kv_parts(kvcache)
        self.k, self.v = list(parts[0]), (list(parts[1]) if len(parts) > 1 else None)
        self.page = int(page_size)
        b = self.k[0]
        self.layout = kv_layout(self.kind, len(self.k), b.shape[-2], b.shape[-1], b.dtype,
                                self.page)
        self.device = dv.device_of(b)     # None: host memory (a CPU server)
        self.dest_k, self.dest_v = self.k, self.v
        if self.device is None and dv.emulation_wanted():
            # the CPU pool, served as memory of this (scheduler) thread's emulated device
            self.device = dv.EMULATED_DEVICES[dv.EMULATED.current_index()]
            i = self.device.index
            self.dest_k = [dv.emulated_view(t, i) for t in self.k]
            self.dest_v = None if self.v is None else [dv.emulated_view(t, i) for t in self.v]

    @staticmethod
    def refusal(kvcache) -> str | None:
        """Why this pool cannot be served, or None."""
        name = type(kvcache).__name__
        kind, bufs = kv_parts(kvcache)
        if not kind:
            return f"the device pool {name} has no per-layer KV buffers (k_buffer/v_buffer or " \
                   f"kv_buffer); supported: MHA and MLA token pools"
        first = bufs[0][0]
        if any(len(b) != len(bufs[0]) for b in bufs) or \
                any(tuple(b[0].shape[-2:]) != tuple(first.shape[-2:]) for b in bufs):
            return f"the device pool {name} has K and V buffers of different shapes " \
                   f"({[tuple(b[0].shape) for b in bufs]})"
        if first.dtype not in TORCH_DTYPES:
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
        """Fill ``slots`` of every layer with NaN (a test hook: see ``linker.load``)."""
        idx = torch.as_tensor(slots, dtype=torch.int64).to(self.k[0].device)
        for part in self.parts:
            for buf in part:
                buf[idx] = float("nan") if buf.dtype.is_floating_point else 0xFF
