"""Block checksums: XXH3-64 of each (layer, block) range, on the host and on a device.

One function everywhere: the write side stores ``xxhash.xxh3_64`` (seed 0) of every
(layer, block) range in the segment header (``segment.block_checksums``); a read checks the bytes where they land:

- host memory: ``verify_host`` (the xxhash C library, GIL released per call);
- device memory: ``kernels/checksum.cu`` (one warp per piece, see its header), launched
  by ``verify_on_device``/``sums_on_device`` on a ``device.Device`` stream.  On the
  emulated device the launch runs ``_kernel_twin``: the kernel's arguments, hashed by
  the host library, so the emulated branch is the CUDA branch line for line.

A piece that fails is reported, never scattered; callers treat it and every block
after it as a miss.
"""

from __future__ import annotations

import numpy as np
import xxhash

from . import device as dv

KERNEL = "checksum.cu"
FUNCTION = "flatcake_xxh3_64"
WARPS_PER_BLOCK = 4


def verify_host(buf: np.ndarray, src: np.ndarray, sums: np.ndarray, pb: int) -> np.ndarray:
    """``ok[i]``: piece ``i`` (``pb`` bytes at ``buf[src[i]:]``) matches ``sums[i]``."""
    h = xxhash.xxh3_64_intdigest
    return np.fromiter((h(buf[o:o + pb]) == int(c) for o, c in zip(src, sums)), dtype=bool,
                       count=len(src))


def launch_geometry(n_pieces: int, max_grid: int = 1 << 16) -> tuple[tuple, tuple]:
    """(grid, block): one warp per piece, ``WARPS_PER_BLOCK`` warps per block."""
    grid = max(1, min(max_grid, -(-n_pieces // WARPS_PER_BLOCK)))
    return (grid, 1, 1), (32 * WARPS_PER_BLOCK, 1, 1)


def _launch(dev: dv.Device, window, src_offsets, piece_bytes: int, expect, sums, ok,
            stream) -> None:
    src = np.ascontiguousarray(src_offsets, np.int64).reshape(-1)
    if piece_bytes <= 0:
        raise ValueError(f"piece_bytes={piece_bytes!r}: expected > 0")
    bad = np.nonzero((src < 0) | (src + piece_bytes > window.nbytes))[0]
    if len(bad):
        raise ValueError(f"piece {bad[0]} at window offset {src[bad[0]]} (+{piece_bytes} bytes) "
                         f"is outside the window of {window.nbytes} bytes")
    if len(src) == 0:
        return
    grid, block = launch_geometry(len(src))
    n = len(src)
    if ok is None:
        dsrc, dexp = dev.upload(src, stream), dv.NULL
    else:               # one upload: offsets, then expected sums
        both = dev.upload(np.concatenate([src, np.ascontiguousarray(expect, np.uint64).reshape(-1)
                                          .view(np.int64)]), stream)
        dsrc, dexp = both[:n], both[n:].view(np.uint64)
    dev.launch(KERNEL, FUNCTION, grid, block,
               (window, dsrc, np.int64(n), np.int64(piece_bytes), dexp,
                dv.NULL if sums is None else sums, dv.NULL if ok is None else ok), stream)


def verify_on_device(dev: dv.Device, window, src_offsets, expect, piece_bytes: int, ok,
                     stream=None) -> None:
    """Launch the check of every piece on ``stream``: ``ok[i]`` (device uint8) becomes 1
    when piece ``i`` matches ``expect[i]``.  Asynchronous; raises ``ValueError`` for a
    piece outside ``window`` before anything is launched."""
    if len(ok) < len(src_offsets):
        raise ValueError(f"ok holds {len(ok)} flags for {len(src_offsets)} pieces")
    _launch(dev, window, src_offsets, piece_bytes, expect, None, ok, stream)


def sums_on_device(dev: dv.Device, window, src_offsets, piece_bytes: int, stream=None):
    """The XXH3-64 of every piece, computed on the device (a device uint64 array)."""
    sums = dev.zeros(len(src_offsets), np.uint64, stream)
    _launch(dev, window, src_offsets, piece_bytes, None, sums, None, stream)
    return sums


def _kernel_twin(name, window, src, n_pieces, piece_bytes, expect, sums, ok) -> None:
    """``flatcake_xxh3_64`` on host memory (the emulated device's launch)."""
    h = xxhash.xxh3_64_intdigest
    w = window.view(np.ndarray)
    for p in range(int(n_pieces)):
        o = int(src[p])
        v = h(w[o:o + int(piece_bytes)])
        if not dv.is_null(sums):
            sums[p] = v
        if not dv.is_null(ok):
            ok[p] = 1 if v == int(expect[p]) else 0


dv.register_twin(KERNEL, FUNCTION, _kernel_twin)
