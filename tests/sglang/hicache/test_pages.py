"""Host-pool pages <-> canonical blocks, for every host layout SGLang 0.5.23 has."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sglang_flatcake.errors import ConfigError  # noqa: E402
from sglang_flatcake.sglang.hicache.pages import HostPages  # noqa: E402

L, H, D, PS, PAGES = 3, 2, 4, 4, 6


def make_buffers(layout: str, parts: int, dtype=torch.bfloat16):
    size = PAGES * PS
    shape = {"layer_first": (L, size, H, D), "page_first": (size, L, H, D),
             "page_first_direct": (PAGES, L, PS, H, D), "page_head": (PAGES, H, PS, L, D)}[layout]
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(parts)]


def value(buf, layout, token, layer):
    """The (H, D) vector of ``token`` at ``layer`` in a buffer of ``layout``."""
    p, o = divmod(token, PS)
    if layout == "layer_first":
        return buf[layer, token]
    if layout == "page_first":
        return buf[token, layer]
    if layout == "page_first_direct":
        return buf[p, layer, o]
    return buf[p, :, o, layer]


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize("parts,kind", [(2, "mha"), (1, "mla")])
def test_gather_is_canonical_and_scatter_inverts_it(layout, parts, kind):
    src = make_buffers(layout, parts)
    pages = [4, 1, 3]
    idx = torch.tensor([p * PS + o for p in pages for o in range(PS)])
    hp = HostPages(src, layout, PS, L, kind)
    blocks = hp.gather(idx)
    assert blocks.shape == (3, L, hp.kv_layout.block_layer_bytes) and blocks.dtype == np.uint8
    # canonical: block b, layer l = part 0 tokens 0..ps-1, then part 1 ...
    t = torch.from_numpy(blocks.copy()).view(torch.bfloat16).reshape(3, L, parts, PS, H, D)
    for b, p in enumerate(pages):
        for layer in range(L):
            for part in range(parts):
                for o in range(PS):
                    assert torch.equal(t[b, layer, part, o], value(src[part], layout, p * PS + o, layer))
    dst = [torch.zeros_like(x) for x in src]
    hp2 = HostPages(dst, layout, PS, L, kind)
    target = torch.tensor([p * PS + o for p in [0, 5, 2] for o in range(PS)])
    hp2.scatter(target, blocks, count=2)           # only the first two blocks
    for b, (p_src, p_dst) in enumerate(zip(pages, [0, 5, 2])):
        for layer in range(L):
            for part in range(parts):
                for o in range(PS):
                    got = value(dst[part], layout, p_dst * PS + o, layer)
                    want = value(src[part], layout, p_src * PS + o, layer) if b < 2 else torch.zeros_like(got)
                    assert torch.equal(got, want)


def test_unsupported_layout_is_refused():
    with pytest.raises(ConfigError, match="page_unified"):
        HostPages(make_buffers("page_first", 2), "page_unified", PS, L, "mha")


def test_partial_pages_refused():
    hp = HostPages(make_buffers("page_first_direct", 2), "page_first_direct", PS, L, "mha")
    with pytest.raises(ValueError, match="whole pages"):
        hp.gather(torch.arange(PS + 1))
