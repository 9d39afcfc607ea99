"""The scatter kernel's case sweep: windows of pieces at shuffled offsets, pages in shuffled
slots, the reference result (``scatter_reference``) and the byte-exact comparison.  Shared by
``tests/read/test_scatter.py`` and the numba.cuda simulator child it starts."""

from __future__ import annotations

import numpy as np

from sglang_flatcake.layout import KVLayout
from sglang_flatcake.read import scatter as sc

ITEM_DTYPE = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32,
              "float8_e4m3fn": np.uint8}

# (kind, heads, head_dim or latent dim, dtype, page_tokens, pieces, window shift)
SWEEP = [
    ("mha", 8, 128, "bfloat16", 64, 12, 0),
    ("mha", 2, 64, "float16", 16, 5, 8),        # shifted window: 8-byte words
    ("mha", 1, 3, "float8_e4m3fn", 4, 7, 1),    # 3-byte rows: byte copies
    ("mha", 4, 32, "float32", 1, 9, 4),
    ("mha", 2, 8, "bfloat16", 2, 0, 0),         # no pieces: a no-op
    ("mla", 1, 576, "bfloat16", 64, 6, 0),      # DeepSeek: kv_lora_rank 512 + rope 64
    ("mla", 1, 72, "float8_e4m3fn", 16, 4, 2),
]


def make_layout(kind, heads, dim, dtype, pt) -> KVLayout:
    if kind == "mla":
        return KVLayout.mla(1, dim, dtype, pt)
    return KVLayout.mha(1, heads, dim, dtype, pt)


def make_case(kind, heads, dim, dtype, pt, n, shift, seed=0):
    """A window with ``n`` pieces at shuffled offsets and pages in shuffled slots."""
    lay = make_layout(kind, heads, dim, dtype, pt)
    rng = np.random.default_rng(seed)
    pieces = lay.parts * lay.part_bytes
    slots_n = (n + 3) * pt
    order = rng.permutation(n + 2)[:n]
    src = (shift + order * pieces).astype(np.int64)
    dst = (rng.permutation(n + 3)[:n] * pt).astype(np.int64)
    window = rng.integers(0, 256, shift + (n + 2) * pieces, dtype=np.uint8)
    shape = (slots_n, 1 if kind == "mla" else heads, dim)
    dests = [np.zeros(shape, ITEM_DTYPE[dtype]) for _ in range(lay.parts)]
    return lay, window, src, dst, dests


def expected(lay, window, src, dst, dests):
    want = [d.copy() for d in dests]
    sc.scatter_reference(window, src, dst, want, lay)
    return want


def check(got, want):
    for g, w in zip(got, want):
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8))
