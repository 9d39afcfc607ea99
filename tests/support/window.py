"""Inputs for the read window's tests: a session file of layer-major segments with the
reads that want every block, an in-memory I/O engine that logs each submit and wait, a store
holding one session, and SGLang-shaped destination pools."""

from __future__ import annotations

import errno

import numpy as np
import xxhash

from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.errors import IOEngineError
from sglang_flatcake.io.base import IOEngine
from sglang_flatcake.layout import KVLayout, SegmentGeometry
from sglang_flatcake.placement import WriteSignals
from sglang_flatcake.read.planner import SegmentRead
from sglang_flatcake.store import FlatCakeStore
from tests.support import blocks_for, chain

A = 4096
LAY = KVLayout.mha(layers=3, kv_heads=1, head_dim=64, dtype="bfloat16", page_tokens=8)  # 2 KiB


def session_file(tmp_path, sizes=(5, 7, 3), seed=0):
    """A file of layer-major segments and the reads wanting every block (dest = position)."""
    geos = [SegmentGeometry(LAY, n, A) for n in sizes]
    data = np.random.default_rng(seed).integers(0, 256, sum(g.total_bytes for g in geos), np.uint8)
    path = str(tmp_path / "s.kv")
    data.tofile(path)
    reads, off, pos = [], 0, 0
    for g in geos:
        idx = np.arange(g.n_blocks)
        sums = np.array([[xxhash.xxh3_64_intdigest(
            data[off + g.block_offset(layer, i):][:LAY.block_layer_bytes]) for i in idx]
            for layer in range(LAY.layers)], np.uint64)
        reads.append(SegmentRead(path, off, g, idx, idx + pos, sums))
        off, pos = off + g.total_bytes, pos + g.n_blocks
    return path, data, reads


class MemEngine(IOEngine):
    """Serves reads from memory and logs every submit and wait (one handle per command)."""

    name = "mem"

    def __init__(self, data, log, fail_fill=None):
        super().__init__(A)
        self.data, self.log, self.fail_fill, self.fills, self.handles = data, log, fail_fill, 0, 0

    def submit(self, commands, targets):
        k = self.fills
        self.fills += 1
        self.log.append(("submit", k))
        eng = self

        class H:
            def __init__(self, c, t):
                self.c, self.t = c, t
                eng.handles += 1

            def wait(self):
                eng.log.append(("wait", k))
                if k == eng.fail_fill:
                    raise IOEngineError(errno.EIO, f"injected failure in fill {k}")
                self.t[:] = eng.data[self.c.offset:self.c.offset + self.c.length]
        return [H(c, t) for c, t in zip(commands, targets)]

    def write(self, *a): ...
    def allocate(self, *a): ...
    def sync(self, *a): ...
    def forget(self, *a): ...
    def stats(self): return {}


def store_with_session(tmp_path, layout, mem_blocks=0):
    cfg = FlatCakeConfig(memory_bytes=8 << 20, ssd_bytes=256 << 20, extent_bytes=1 << 20,
                         io_threads=2)
    st = FlatCakeStore(tmp_path / "store", layout, cfg)
    keys = chain(24)
    data = blocks_for(layout, keys)
    for t, (a, b) in enumerate([(0, 10), (10, 20), (20, 24)]):
        mem = t == 2 and mem_blocks
        sig = WriteSignals(turn=t, prev_reply_tokens=10 if mem else 10_000)
        st.put(keys[a:b], data[a:b], prefix_keys=keys[:a], signals=sig)
    return st, keys, data


def kv_dests(layout, n_pages, heads, dim):
    shape = (n_pages * layout.page_tokens, heads, dim)
    return [np.zeros(shape, np.uint16) for _ in range(layout.layers)]
