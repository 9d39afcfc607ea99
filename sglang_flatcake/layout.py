"""Block and segment geometry.

A *block* is one page of KV (``page_tokens`` tokens) across all layers.  In
memory a block is ``(layers, block_layer_bytes)`` bytes, block-major: the
canonical shape every caller of the store hands in and gets back.  For MHA a
block-layer is ``K | V`` (two parts), for MLA one latent part.

A *segment* is one write batch of one session on SSD, laid out layer-major::

    [header][layer 0: block 0 | block 1 | ... | pad][layer 1: ...] ... [layer L-1: ...]

so one layer of one segment is one contiguous range, and any run of adjacent
blocks of one layer is one contiguous range too.  Every layer section starts
aligned, so a whole-layer read needs no bounce buffer.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import xxhash

from .errors import ConfigError

DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1, "float64": 8,
}


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def align_down(n: int, a: int) -> int:
    return n // a * a


@dataclass(frozen=True)
class KVLayout:
    """Shape of one block; fixed for the lifetime of a store."""

    kind: str            # "mha" or "mla"
    layers: int
    parts: int           # 2 (K and V) for MHA, 1 for MLA
    part_bytes: int      # bytes of one part of one block at one layer
    page_tokens: int
    dtype: str

    def __post_init__(self) -> None:
        if self.kind not in ("mha", "mla"):
            raise ConfigError(f"kind={self.kind!r} is not allowed: mha or mla")
        for name in ("layers", "parts", "part_bytes", "page_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{name}={v!r} is not allowed: expected a positive integer")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype={self.dtype!r} is not allowed: one of {', '.join(DTYPE_BYTES)}")

    @classmethod
    def mha(cls, layers: int, kv_heads: int, head_dim: int, dtype: str = "bfloat16",
            page_tokens: int = 64) -> "KVLayout":
        item = DTYPE_BYTES.get(dtype)
        if item is None:
            raise ConfigError(f"dtype={dtype!r} is not allowed: one of {', '.join(DTYPE_BYTES)}")
        return cls("mha", layers, 2, page_tokens * kv_heads * head_dim * item, page_tokens, dtype)

    @classmethod
    def mla(cls, layers: int, latent_dim: int, dtype: str = "bfloat16",
            page_tokens: int = 64) -> "KVLayout":
        item = DTYPE_BYTES.get(dtype)
        if item is None:
            raise ConfigError(f"dtype={dtype!r} is not allowed: one of {', '.join(DTYPE_BYTES)}")
        return cls("mla", layers, 1, page_tokens * latent_dim * item, page_tokens, dtype)

    @property
    def block_layer_bytes(self) -> int:
        return self.parts * self.part_bytes

    @property
    def block_bytes(self) -> int:
        return self.layers * self.block_layer_bytes

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        return cls(**{k: d[k] for k in ("kind", "layers", "parts", "part_bytes", "page_tokens", "dtype")})

    def fingerprint(self) -> int:
        """64-bit hash of the layout, stored in every segment header."""
        return xxhash.xxh3_64_intdigest(json.dumps(self.to_dict(), sort_keys=True).encode())


HEADER_FIXED_BYTES = 128  # see segment.SegmentHeader


def header_bytes(layout: KVLayout, n_blocks: int, alignment: int) -> int:
    """Aligned size of a segment header holding ``n_blocks`` keys and checksums."""
    return align_up(HEADER_FIXED_BYTES + 16 * n_blocks + 8 * layout.layers * n_blocks + 8, alignment)


@dataclass(frozen=True)
class SegmentGeometry:
    """Where each (layer, block) range of one segment sits, relative to its start."""

    layout: KVLayout
    n_blocks: int
    alignment: int

    @property
    def header_bytes(self) -> int:
        return header_bytes(self.layout, self.n_blocks, self.alignment)

    @property
    def layer_bytes(self) -> int:
        """Wanted bytes of one layer (unpadded)."""
        return self.n_blocks * self.layout.block_layer_bytes

    @property
    def layer_stride(self) -> int:
        return align_up(self.layer_bytes, self.alignment)

    @property
    def data_bytes(self) -> int:
        return self.layout.layers * self.layer_stride

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + self.data_bytes

    def layer_offset(self, layer: int) -> int:
        return self.header_bytes + layer * self.layer_stride

    def block_offset(self, layer: int, block: int) -> int:
        """Offset of (layer, block) from the segment start."""
        return self.layer_offset(layer) + block * self.layout.block_layer_bytes
