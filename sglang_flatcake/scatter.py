"""Scatter one layer's pieces from a read window into paged, token-major KV buffers.

The window holds the bytes of one or more read commands of one layer.  Piece
``i`` (one block-layer: ``K | V`` for MHA, one latent part for MLA, each part
``page_tokens`` token rows, token-major) starts at byte ``src_offsets[i]`` of the
window and fills the token slots ``dst_slots[i] .. dst_slots[i] + page_tokens - 1``
of each destination buffer.  Destinations are SGLang 0.5.23's device-pool
buffers of one layer: ``[num_slots, heads, head_dim]`` K and V (MHA) or one
``[num_slots, 1, kv_lora_rank + qk_rope_head_dim]`` buffer (MLA), any dtype.

Implementations, all with the same semantics:
- ``kernels/scatter.cu`` through CuPy (cupy arrays or CUDA torch tensors);
- a numba ``@njit`` twin on the host (numpy arrays or CPU torch tensors);
- ``scatter_reference``: torch (numpy without torch) gathers; it defines correct.

``scatter_layer`` checks shapes, dtypes, contiguity and bounds before any copy
and raises ``ValueError``/``TypeError`` naming the bad value; nothing is
written when it raises.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .layout import KVLayout

KERNEL_PATH = Path(__file__).resolve().parents[1] / "kernels" / "scatter.cu"
WORD_SIZES = (16, 8, 4, 2, 1)
log = logging.getLogger("sglang_flatcake")


# ---------------------------------------------------------------- checks
def _flat_bytes(x, what: str):
    """(device kind, flat uint8 view sharing memory, original shape)."""
    if type(x).__module__.split(".")[0] == "torch":
        import torch
        if not x.is_contiguous():
            raise ValueError(f"{what}: tensor with strides {tuple(x.stride())} is not contiguous")
        u8 = x.reshape(-1).view(torch.uint8)
        if x.device.type == "cpu":
            return "host", u8.numpy(), tuple(x.shape)
        if x.device.type == "cuda":
            import cupy
            return "cuda", cupy.asarray(u8), tuple(x.shape)
        raise ValueError(f"{what}: device {x.device} is not supported (cpu or cuda)")
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ValueError(f"{what}: array with strides {x.strides} is not C-contiguous")
        return "host", x.reshape(-1).view(np.uint8), x.shape
    if hasattr(x, "__cuda_array_interface__"):
        import cupy
        a = cupy.asarray(x)
        if not a.flags.c_contiguous:
            raise ValueError(f"{what}: array with strides {a.strides} is not C-contiguous")
        return "cuda", a.reshape(-1).view(cupy.uint8), tuple(a.shape)
    raise TypeError(f"{what}: {type(x).__name__} is not a numpy/cupy array or torch tensor")


def _address(a) -> int:
    return a.data.ptr if hasattr(a, "__cuda_array_interface__") else a.ctypes.data


@dataclass(frozen=True)
class Launch:
    """A checked scatter: flat byte views plus host-side int64 offsets (bytes, token slots)."""

    kind: str                 # "host" or "cuda"
    window: object            # flat uint8
    dests: tuple              # flat uint8 views, one per part
    src: np.ndarray           # byte offset of each piece in the window
    dst: np.ndarray           # first token slot of each piece
    parts: int
    part_bytes: int
    row_bytes: int
    word: int                 # widest copy width dividing every offset, size and address


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
        if k != kind:
            raise TypeError(f"window is in {kind} memory but dest[{i}] is in {k} memory")
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
    addrs = [_address(win)] + [_address(v) for v in views]
    word = next(w for w in WORD_SIZES if w <= max_word and row_bytes % w == 0
                and all(a % w == 0 for a in addrs) and not np.any(src % w))
    return Launch(kind, win, tuple(views), src, dst, layout.parts, layout.part_bytes,
                  row_bytes, word)


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
            else:
                builder.fence("seq_cst")
        return types.void(), codegen

    @njit(cache=True, nogil=True)
    def scatter_host(win, src, dst, d0, d1, n_parts, part_bytes, row_bytes):
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


try:
    _scatter_host = _numba_twin()
except Exception as e:  # numba missing or too old: the same loop in Python (numpy slices)
    log.warning("flatcake: numba scatter twin unavailable (%s); using the Python loop", e)
    _scatter_host = _scatter_host_py


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


# ---------------------------------------------------------------- CUDA (CuPy)
_modules: dict[int, object] = {}
_modules_lock = threading.Lock()


def kernel_source() -> str:
    try:
        return KERNEL_PATH.read_text()
    except OSError as e:
        raise RuntimeError(f"CUDA source {KERNEL_PATH} is missing: {e.strerror}") from None


def cuda_function(word: int):
    """The compiled kernel for ``word``-byte copies on the current device (compiled once)."""
    import cupy
    dev = cupy.cuda.Device().id
    with _modules_lock:
        mod = _modules.get(dev)
        if mod is None:
            mod = cupy.RawModule(code=kernel_source(), options=("--std=c++14",))
            _modules[dev] = mod
    return mod.get_function(f"flatcake_scatter_w{word}")


def cuda_launcher(ln: Launch, stream=None):
    """Upload a checked launch's offsets once, on ``stream`` (default: CuPy's current one);
    returns ``launch() -> Event`` running the kernel on that stream (``scatter_layer`` calls
    it once; a benchmark can time the kernel alone by calling it again)."""
    import cupy
    w = ln.word
    part_words, n_units = ln.part_bytes // w, len(ln.src) * ln.parts
    grid, block = launch_geometry(n_units, part_words)
    fn = cuda_function(w)
    ctx = (lambda: stream) if stream is not None else contextlib.nullcontext
    with ctx():
        src, dst = cupy.asarray(ln.src // w), cupy.asarray(ln.dst)
    args = (ln.window, src, dst, ln.dests[0], ln.dests[-1], np.int64(n_units),
            np.int32(ln.parts), np.int64(part_words), np.int64(ln.row_bytes // w))

    def launch():
        with ctx():
            fn(grid, block, args)
            done = cupy.cuda.Event(disable_timing=True)
            done.record()
        return done
    return launch


def scatter_layer(window, src_offsets, dst_slots, dests: Sequence, layout: KVLayout,
                  stream=None):
    """Copy every piece of one layer from ``window`` into ``dests`` (K, V or the MLA buffer).

    Host memory runs the numba twin and returns ``None`` when the copy is done.
    CUDA memory launches the CuPy kernel on ``stream`` (default: CuPy's current
    stream) and returns a ``cupy.cuda.Event`` recorded after it: the window
    must not be refilled before ``event.synchronize()``.  Overlapping
    destination pages raise ``ValueError`` (the result would depend on timing).
    """
    ln = prepare(window, src_offsets, dst_slots, dests, layout)
    if len(ln.src) == 0:
        return None
    if ln.kind == "host":
        _run_host(ln)
        return None
    return cuda_launcher(ln, stream)()


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
