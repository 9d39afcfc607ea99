"""Scatter one layer's pieces from a read window into paged, token-major KV buffers.

The window holds the bytes of one or more read commands of one layer.  Piece
``i`` (one block-layer: ``K | V`` for MHA, one latent part for MLA, each part
``page_tokens`` token rows, token-major) starts at byte ``src_offsets[i]`` of the
window and fills the token slots ``dst_slots[i] .. dst_slots[i] + page_tokens - 1``
of each destination buffer.  Destinations are SGLang 0.5.23's device-pool
buffers of one layer: ``[num_slots, heads, head_dim]`` K and V (MHA) or one
``[num_slots, 1, kv_lora_rank + qk_rope_head_dim]`` buffer (MLA), any dtype.

Implementations, all with the same semantics:
- ``kernels/scatter.cu`` launched on a ``device.Device`` (cupy arrays or CUDA torch
  tensors on CUDA; ``EmuArray`` on the emulated device, whose launch runs
  ``_kernel_twin`` with the kernel's own word arguments);
- a numba ``@njit`` twin on the host (numpy arrays or CPU torch tensors);
- ``scatter_reference``: torch (numpy without torch) gathers; it defines correct.

``scatter_layer`` checks shapes, dtypes, contiguity and bounds before any copy
and raises ``ValueError``/``TypeError`` naming the bad value; nothing is
written when it raises.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import device as dv
from ..layout import KVLayout

KERNEL = "scatter.cu"
KERNEL_PATH = dv.kernel_path(KERNEL)
WORD_SIZES = (16, 8, 4, 2, 1)
log = logging.getLogger("sglang_flatcake")


# ---------------------------------------------------------------- checks
def _flat_bytes(x, what: str):
    """(device, ``None`` for host memory; flat uint8 view sharing memory; original shape)."""
    if type(x).__module__.split(".")[0] == "torch":
        import torch
        if not x.is_contiguous():
            raise ValueError(f"{what}: tensor with strides {tuple(x.stride())} is not contiguous")
        if x.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{what}: device {x.device} is not supported (cpu or cuda)")
        u8 = x.reshape(-1).view(torch.uint8)
        dev = dv.device_of(x)
        return dev, (u8.numpy() if dev is None else dev.asarray(u8)), tuple(x.shape)
    dev = dv.device_of(x)
    if dev is not None:
        a = dev.asarray(x)
        if not a.flags.c_contiguous:
            raise ValueError(f"{what}: array with strides {a.strides} is not C-contiguous")
        return dev, a.reshape(-1).view(np.uint8), tuple(a.shape)
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ValueError(f"{what}: array with strides {x.strides} is not C-contiguous")
        return None, x.reshape(-1).view(np.uint8), x.shape
    raise TypeError(f"{what}: {type(x).__name__} is not a numpy/cupy array or torch tensor")


@dataclass(frozen=True)
class Launch:
    """A checked scatter: flat byte views plus host-side int64 offsets (bytes, token slots)."""

    device: dv.Device | None  # where window and dests live; None: host memory
    window: object            # flat uint8
    dests: tuple              # flat uint8 views, one per part
    src: np.ndarray           # byte offset of each piece in the window
    dst: np.ndarray           # first token slot of each piece
    parts: int
    part_bytes: int
    row_bytes: int
    word: int                 # widest copy width dividing every offset, size and address

    @property
    def kind(self) -> str:
        return "host" if self.device is None else self.device.name


def prepare(window, src_offsets, dst_slots, dests: Sequence, layout: KVLayout,
            max_word: int = 16) -> Launch:
    """Check one scatter's arguments; raises naming the first bad value."""
    dests = list(dests)
    if len(dests) != layout.parts:
        raise ValueError(f"a {layout.kind} layout has {layout.parts} part(s) per block-layer; "
                         f"got {len(dests)} destination buffer(s)")
    kind, win, _ = _flat_bytes(window, "window")
    views, shape0 = [], None
    for i, d in enumerate(dests):
        k, v, shape = _flat_bytes(d, f"dest[{i}]")
        if k is not kind:
            raise TypeError(f"window is in {_where(kind)} memory but dest[{i}] is in "
                            f"{_where(k)} memory")
        if d.dtype != dests[0].dtype or d.dtype.itemsize != layout.itemsize:
            raise TypeError(f"dest[{i}] has dtype {d.dtype} ({d.dtype.itemsize}-byte elements); "
                            f"the layout stores {layout.dtype} ({layout.itemsize} bytes) and "
                            f"dest[0] is {dests[0].dtype}")
        if len(shape) != 3:
            raise ValueError(f"dest[{i}] has shape {shape}: expected [num_slots, heads, head_dim] "
                             "(SGLang's token-major device pool)")
        if shape0 is not None and (shape != shape0 or v.nbytes != views[0].nbytes):
            raise ValueError(f"dest[{i}] has shape {shape}, dest[0] has {shape0}: "
                             "K and V must match")
        shape0 = shape
        views.append(v)
    num_slots = shape0[0]
    row_bytes = views[0].nbytes // num_slots if num_slots else 0
    if row_bytes * layout.page_tokens != layout.part_bytes:
        raise ValueError(f"dest rows of {row_bytes} bytes x {layout.page_tokens} page tokens != "
                         f"the layout's part of {layout.part_bytes} bytes (dest shape {shape0})")
    src = np.ascontiguousarray(src_offsets, dtype=np.int64).reshape(-1)
    dst = np.ascontiguousarray(dst_slots, dtype=np.int64).reshape(-1)
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source offsets for {len(dst)} destination slots")
    piece = layout.parts * layout.part_bytes
    bad = np.nonzero((src < 0) | (src + piece > win.nbytes))[0]
    if len(bad):
        raise ValueError(f"piece {bad[0]} at window offset {src[bad[0]]} (+{piece} bytes) is "
                         f"outside the window of {win.nbytes} bytes")
    bad = np.nonzero((dst < 0) | (dst + layout.page_tokens > num_slots))[0]
    if len(bad):
        last = dst[bad[0]] + layout.page_tokens - 1
        raise ValueError(f"piece {bad[0]} writes slots {dst[bad[0]]}..{last}, outside the "
                         f"{num_slots} slots of the destination")
    order = np.argsort(dst, kind="stable")
    clash = np.nonzero(np.diff(dst[order]) < layout.page_tokens)[0]
    if len(clash):
        i, j = order[clash[0]], order[clash[0] + 1]
        raise ValueError(f"pieces {i} and {j} write overlapping slots (first slots {dst[i]} and "
                         f"{dst[j]}, {layout.page_tokens} tokens each)")
    addrs = [a.ctypes.data for a in [win] + views] if kind is None else [
        kind.address(a) for a in [win] + views]
    word = next(w for w in WORD_SIZES if w <= max_word and row_bytes % w == 0
                and all(a % w == 0 for a in addrs) and not np.any(src % w))
    return Launch(kind, win, tuple(views), src, dst, layout.parts, layout.part_bytes,
                  row_bytes, word)


def _where(dev) -> str:
    return "host" if dev is None else f"{dev.name} device {dev.index}"


def launch_geometry(n_units: int, part_words: int, threads: int = 256,
                    max_grid_x: int = 1 << 20, max_grid_y: int = 65535) -> tuple[tuple, tuple]:
    """(grid, block) for the CUDA kernel: y walks (piece, part) units, x the words of a
    part, four words per thread."""
    block = min(threads, max(32, -(-part_words // 32) * 32))
    gx = max(1, min(max_grid_x, -(-part_words // (4 * block))))
    return (gx, max(1, min(max_grid_y, n_units)), 1), (block, 1, 1)


# ---------------------------------------------------------------- host (numba twin)
def _scatter_host_py(win, src, dst, d0, d1, n_parts, part_bytes, row_bytes):
    """The CUDA kernel's mapping on flat uint8 arrays, one slice copy per part."""
    for i in range(src.shape[0]):
        base = dst[i] * row_bytes
        for p in range(n_parts):
            s = src[i] + p * part_bytes
            (d0 if p == 0 else d1)[base:base + part_bytes] = win[s:s + part_bytes]


def _numba_twin():
    """The same loop in numba.  A part whose destination is 16-byte aligned is copied with
    non-temporal 16-byte stores (the KV pool is not read back soon, and skipping the
    read-for-ownership saves a third of the memory traffic); others with ``llvm.memcpy``."""
    from llvmlite import ir
    from numba import njit, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def memcpy(typingctx, dst, src, nbytes):
        def codegen(context, builder, signature, args):
            p = ir.IntType(8).as_pointer()
            cgutils.raw_memcpy(builder, builder.inttoptr(args[0], p),
                               builder.inttoptr(args[1], p), args[2], 1)
        return types.void(types.intp, types.intp, types.intp), codegen

    @intrinsic
    def stream_copy(typingctx, dst, src, nwords):       # dst 16-aligned; 16-byte words
        def codegen(context, builder, signature, args):
            d, s, n = args
            vp = ir.VectorType(ir.IntType(64), 2).as_pointer()
            nt = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
            with cgutils.for_range(builder, n) as loop:
                off = builder.mul(loop.index, ir.Constant(n.type, 16))
                v = builder.load(builder.inttoptr(builder.add(s, off), vp), align=1)
                st = builder.store(v, builder.inttoptr(builder.add(d, off), vp), align=16)
                st.set_metadata("nontemporal", nt)
        return types.void(types.intp, types.intp, types.intp), codegen

    @intrinsic
    def store_fence(typingctx):                          # orders the streaming stores
        def codegen(context, builder, signature, args):
            if platform.machine() in ("x86_64", "AMD64"):
                fn = builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=ir.FunctionType(
                    ir.VoidType(), []))
                builder.call(fn, [])
            else:                                        # pragma: no cover (not x86)
                builder.fence("seq_cst")
        return types.void(), codegen

    @njit(cache=True, nogil=True)
    def scatter_host(win, src, dst, d0, d1, n_parts, part_bytes,  # pragma: no cover
                     row_bytes):                  # (machine code: coverage cannot trace it)
        w, a0, a1 = win.ctypes.data, d0.ctypes.data, d1.ctypes.data
        for i in range(src.shape[0]):
            base = dst[i] * row_bytes
            for p in range(n_parts):
                d = (a0 if p == 0 else a1) + base
                s = w + src[i] + p * part_bytes
                if d % 16 == 0 and part_bytes % 16 == 0:
                    stream_copy(d, s, part_bytes // 16)
                else:
                    memcpy(d, s, part_bytes)
        store_fence()
    return scatter_host


def _pick_host_twin():
    try:
        return _numba_twin()
    except Exception as e:  # numba missing or too old: the same loop in Python (numpy slices)
        log.warning("flatcake: numba scatter twin unavailable (%s); using the Python loop", e)
        return _scatter_host_py


_scatter_host = _pick_host_twin()


def _run_host(ln: Launch) -> None:
    """Bounds were checked by ``prepare``: the twin copies with raw addresses."""
    global _scatter_host
    args = (ln.window, ln.src, ln.dst, ln.dests[0], ln.dests[-1], ln.parts, ln.part_bytes,
            ln.row_bytes)
    try:
        _scatter_host(*args)
    except Exception as e:  # only a failed compile lands here (no copy has started)
        if _scatter_host is _scatter_host_py:
            raise
        log.warning("flatcake: numba scatter twin failed to compile (%s); using the Python "
                    "loop", e)
        _scatter_host = _scatter_host_py
        _scatter_host(*args)


_warm = False


def warm_up() -> None:
    """Compile (or load from numba's cache) the host twin now, not inside a timed restore."""
    global _warm
    if not _warm:
        lay = KVLayout("mla", 1, 1, 16, 1, "uint8")
        scatter_layer(np.zeros(16, np.uint8), [0], [0], [np.zeros((1, 1, 16), np.uint8)], lay)
        _warm = True


# ---------------------------------------------------------------- device (kernels/scatter.cu)
def kernel_source() -> str:
    return dv.kernel_source(KERNEL)


def device_launcher(ln: Launch, stream=None, mask=None):
    """Upload a checked launch's offsets once, on ``stream`` (``None``: the device's
    default stream); returns ``launch() -> event`` running the kernel on that stream
    (``scatter_layer`` calls it once; a benchmark can time the kernel alone by calling it
    again).  ``mask``: a device uint8 flag per piece; pieces flagged 0 are not copied."""
    dev, w = ln.device, ln.word
    if mask is not None and len(mask) < len(ln.src):
        raise ValueError(f"mask holds {len(mask)} flags for {len(ln.src)} pieces")
    part_words, n_units = ln.part_bytes // w, len(ln.src) * ln.parts
    grid, block = launch_geometry(n_units, part_words)
    both = dev.upload(np.concatenate([ln.src // w, ln.dst]), stream)     # one upload
    src, dst = both[:len(ln.src)], both[len(ln.src):]
    args = (ln.window, src, dst, ln.dests[0], ln.dests[-1], np.int64(n_units),
            np.int32(ln.parts), np.int64(part_words), np.int64(ln.row_bytes // w),
            dv.NULL if mask is None else mask)

    def launch():
        dev.launch(KERNEL, f"flatcake_scatter_w{w}", grid, block, args, stream)
        return dev.record(stream)
    return launch


cuda_launcher = device_launcher      # the name benchmarks/gpu_check.py has used


def _kernel_twin(name, window, src_word, dst_row, d0, d1, n_units, n_parts, part_words,
                 row_words, ok) -> None:
    """``flatcake_scatter_w<W>`` on host memory (the emulated device's launch): the same
    word arguments, copied by the host twin."""
    w = int(name.rsplit("w", 1)[1])
    keep = slice(None) if dv.is_null(ok) else np.asarray(ok[:len(src_word)], bool)
    src = np.ascontiguousarray(np.asarray(src_word)[keep] * w)
    dst = np.ascontiguousarray(np.asarray(dst_row)[keep])
    flat = [a.view(np.ndarray) for a in (window, d0, d1)]
    _scatter_host(flat[0], src, dst, flat[1], flat[2], int(n_parts), int(part_words) * w,
                  int(row_words) * w)


dv.register_twin(KERNEL, "flatcake_scatter_w", _kernel_twin)


def scatter_layer(window, src_offsets, dst_slots, dests: Sequence, layout: KVLayout,
                  stream=None, mask=None):
    """Copy every piece of one layer from ``window`` into ``dests`` (K, V or the MLA buffer).

    Host memory runs the numba twin and returns ``None`` when the copy is done.
    Device memory launches the kernel on ``stream`` (default: the device's default
    stream) and returns an event recorded after it: the window must not be refilled
    before ``event.synchronize()``.  ``mask`` (device memory only) is a device uint8
    flag per piece; pieces flagged 0 are skipped.  Overlapping destination pages raise
    ``ValueError`` (the result would depend on timing).
    """
    ln = prepare(window, src_offsets, dst_slots, dests, layout)
    if mask is not None and ln.device is None:
        raise ValueError("mask is for device memory (host callers drop the pieces instead)")
    if len(ln.src) == 0:
        return None
    if ln.device is None:
        _run_host(ln)
        return None
    return device_launcher(ln, stream, mask)()


# ---------------------------------------------------------------- reference
def scatter_reference(window, src_offsets, dst_slots, dests: Sequence, layout: KVLayout) -> None:
    """The definition of correct: byte gathers in torch (numpy when torch is absent).

    Numpy inputs are wrapped with ``torch.from_numpy`` (shared memory), so the
    result lands in the caller's arrays either way.  No checks: tests only.
    """
    try:
        import torch
    except ImportError:
        torch = None
    pb, pt = layout.part_bytes, layout.page_tokens
    if torch is not None:
        def flat(x):
            t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
            return t.reshape(-1).view(torch.uint8)
        win = flat(window)
        src = torch.as_tensor(np.asarray(src_offsets, np.int64), device=win.device)
        dst = torch.as_tensor(np.asarray(dst_slots, np.int64), device=win.device)
        ar = torch.arange(pb, device=win.device)
    else:
        def flat(x):
            return x.reshape(-1).view(np.uint8)
        win = flat(window)
        src, dst = np.asarray(src_offsets, np.int64), np.asarray(dst_slots, np.int64)
        ar = np.arange(pb)
    for p, d in enumerate(dests):
        df = flat(d)
        row = pb // pt
        df[(dst[:, None] * row + ar[None, :]).reshape(-1)] = win[
            (src[:, None] + p * pb + ar[None, :]).reshape(-1)]
