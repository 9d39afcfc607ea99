"""The scatter: every implementation against the reference over a sweep of sizes.

- the numba host twin (always), and its pure-Python fallback;
- ``kernels/scatter.cu`` itself, compiled for the CPU by g++ with the CUDA
  built-ins emulated (every block and thread run in turn), so the CUDA source's
  indexing is checked without a GPU (skipped without g++);
- a numba.cuda copy of the kernel under the CUDA simulator, in a subprocess;
- the CuPy launcher on a GPU (``gpu`` marker, skipped without one).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from sglang_flatcake.layout import KVLayout
from sglang_flatcake.read import scatter as sc
from tests.support import ROOT
from tests.support.cuda_harness import compile_harness
from tests.support.scatter_cases import SWEEP, check, expected, make_case


@pytest.mark.parametrize("case", SWEEP, ids=[f"{c[0]}-{c[4]}-{c[3]}-n{c[5]}" for c in SWEEP])
def test_host_twin_matches_reference(case):
    kind, heads, dim, dtype, pt, n, shift = case
    lay, window, src, dst, dests = make_case(kind, heads, dim, dtype, pt, n, shift)
    want = expected(lay, window, src, dst, dests)
    assert sc.scatter_layer(window, src, dst, dests, lay) is None
    check(dests, want)
    if n:   # the reference really moved bytes, and untouched slots stay zero
        assert any(w.view(np.uint8).any() for w in want)
        touched = np.zeros(dests[0].shape[0], bool)
        for s in dst:
            touched[s:s + pt] = True
        assert not dests[0][~touched].view(np.uint8).any()


def test_reference_places_bytes_where_the_layout_says():
    """Hand check, independent of every implementation: K rows, then V rows, per page."""
    lay = KVLayout.mha(1, 1, 2, "float8_e4m3fn", 2)      # part = 2 tokens x 2 bytes
    window = np.arange(16, dtype=np.uint8)                # pieces of 8 bytes: K(4) | V(4)
    k, v = np.zeros((6, 1, 2), np.uint8), np.zeros((6, 1, 2), np.uint8)
    sc.scatter_reference(window, [8, 0], [4, 0], [k, v], lay)
    assert k.reshape(-1).tolist() == [0, 1, 2, 3, 0, 0, 0, 0, 8, 9, 10, 11]
    assert v.reshape(-1).tolist() == [4, 5, 6, 7, 0, 0, 0, 0, 12, 13, 14, 15]


@pytest.mark.parametrize("case", SWEEP[:3], ids=["bf16", "fp16-shift", "bytes"])
def test_python_fallback_matches_reference(case, monkeypatch):
    monkeypatch.setattr(sc, "_scatter_host", sc._scatter_host_py)
    lay, window, src, dst, dests = make_case(*case, seed=1)
    want = expected(lay, window, src, dst, dests)
    sc.scatter_layer(window, src, dst, dests, lay)
    check(dests, want)


@pytest.mark.parametrize("skew", [0, 2, 16])
def test_host_twin_with_skewed_destinations(skew):
    """Streaming stores need 16-byte aligned destinations; others take the memcpy path."""
    lay, window, src, dst, _ = make_case("mha", 8, 128, "bfloat16", 16, 9, 0, seed=5)
    shape = ((9 + 3) * 16, 8, 128)
    raw = [np.zeros(np.prod(shape) * 2 + 64, np.uint8) for _ in range(2)]
    dests = [r[(-r.ctypes.data) % 32 + skew:][:np.prod(shape) * 2].view(np.uint16).reshape(shape)
             for r in raw]
    want = expected(lay, window, src, dst, [np.zeros(shape, np.uint16) for _ in range(2)])
    sc.scatter_layer(window, src, dst, dests, lay)
    check(dests, want)


def test_word_width_follows_alignment():
    lay, window, src, dst, dests = make_case("mha", 8, 128, "bfloat16", 16, 3, 0)
    assert sc.prepare(window, src, dst, dests, lay).word in (8, 16)
    lay, window, src, dst, dests = make_case("mha", 8, 128, "bfloat16", 16, 3, 2)
    assert sc.prepare(window, src, dst, dests, lay).word == 2
    lay, window, src, dst, dests = make_case("mha", 1, 3, "float8_e4m3fn", 4, 3, 0)
    assert sc.prepare(window, src, dst, dests, lay).word == 1


def test_torch_tensors_on_cpu():
    torch = pytest.importorskip("torch")
    lay, window, src, dst, dests = make_case("mha", 8, 128, "bfloat16", 16, 6, 0)
    want = expected(lay, window, src, dst, dests)
    k, v = (torch.zeros(d.shape, dtype=torch.bfloat16) for d in dests)
    sc.scatter_layer(torch.from_numpy(window), src, dst, [k, v], lay)
    check([k.view(torch.uint16).numpy(), v.view(torch.uint16).numpy()], want)


# ---------------------------------------------------------------- checks
def bad_calls():
    lay, window, src, dst, dests = make_case("mha", 2, 16, "bfloat16", 4, 3, 0)
    k, v = dests
    yield "part", lambda: sc.scatter_layer(window, src, dst, [k], lay), "2 part"
    yield "shape", lambda: sc.scatter_layer(window, src, dst, [k[None], v[None]], lay), "num_slots"
    yield "strides", lambda: sc.scatter_layer(window, src, dst, [k[:, :, ::2], v], lay), "contiguous"
    narrow = [np.zeros((k.shape[0], 1, 16), np.uint16) for _ in range(2)]
    yield "rows", lambda: sc.scatter_layer(window, src, dst, narrow, lay), "page tokens"
    yield "kv", lambda: sc.scatter_layer(window, src, dst, [k, v[:-4]], lay), "must match"
    wide = [np.zeros((k.shape[0], 2, 8), np.float32) for _ in range(2)]   # same row bytes
    yield "dtype", lambda: sc.scatter_layer(window, src, dst, wide, lay), "4-byte elements"
    yield ("src", lambda: sc.scatter_layer(window, src + window.size, dst, [k, v], lay),
           "outside the window")
    yield "neg", lambda: sc.scatter_layer(window, src, dst - 1000, [k, v], lay), "outside the"
    yield "slot", lambda: sc.scatter_layer(window, src, dst + k.shape[0], [k, v], lay), "outside the"
    yield "overlap", lambda: sc.scatter_layer(window, src, [0, 2, 8], [k, v], lay), "overlapping"
    yield "len", lambda: sc.scatter_layer(window, src, dst[:2], [k, v], lay), "source offsets"
    yield "type", lambda: sc.scatter_layer(list(window), src, dst, [k, v], lay), "list"


@pytest.mark.parametrize("name,call,msg", list(bad_calls()), ids=[b[0] for b in bad_calls()])
def test_bad_arguments_are_refused_before_any_copy(name, call, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        call()


def test_refused_call_writes_nothing():
    lay, window, src, dst, dests = make_case("mha", 2, 16, "bfloat16", 4, 3, 0)
    dst[-1] = dests[0].shape[0]     # last piece out of range: the others must not land either
    with pytest.raises(ValueError, match="outside"):
        sc.scatter_layer(window, src, dst, dests, lay)
    assert not any(d.any() for d in dests)


def test_launch_geometry_covers_small_and_huge():
    assert sc.launch_geometry(1, 1) == ((1, 1, 1), (32, 1, 1))
    (gx, gy, _), (b, _, _) = sc.launch_geometry(300_000, 8192)
    assert b == 256 and gx * b * 4 >= 8192 and gy == 65535


# ---------------------------------------------------------------- the .cu source on the CPU
HARNESS = r"""
struct uint4 { unsigned int x, y, z, w; };
struct flatcake_dim3 { unsigned int x, y, z; };
static flatcake_dim3 blockIdx, blockDim, gridDim, threadIdx;
#define __global__
#define __restrict__
#include "scatter.cu"
#define CALL(W, T) case W: flatcake_scatter_w##W((const T*)win, src, dst, (T*)d0, (T*)d1, \
                                                  units, parts, pw, rw, ok); break;
extern "C" int run(int word, unsigned gx, unsigned gy, unsigned bx, const void* win,
                   const long long* src, const long long* dst, void* d0, void* d1,
                   long long units, int parts, long long pw, long long rw,
                   const unsigned char* ok) {
    gridDim = {gx, gy, 1}; blockDim = {bx, 1, 1};
    for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x)
        for (unsigned t = 0; t < bx; ++t) {
            blockIdx = {x, y, 0}; threadIdx = {t, 0, 0};
            switch (word) { CALL(16, uint4) CALL(8, unsigned long long) CALL(4, unsigned int)
                            CALL(2, unsigned short) CALL(1, unsigned char) default: return 1; }
        }
    return 0;
}
"""


@pytest.fixture(scope="module")
def cu_on_cpu(tmp_path_factory):
    return compile_harness(tmp_path_factory, HARNESS, sc.KERNEL_PATH.parent, "kernels/scatter.cu")


@pytest.mark.parametrize("case", SWEEP, ids=[f"{c[0]}-{c[4]}-{c[3]}-n{c[5]}" for c in SWEEP])
@pytest.mark.parametrize("caps", [(1 << 20, 65535), (1, 2)], ids=["full-grid", "strided-grid"])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
def test_cuda_source_indexing_on_cpu(cu_on_cpu, case, caps, masked):
    kind, heads, dim, dtype, pt, n, shift = case
    lay, window, src, dst, dests = make_case(kind, heads, dim, dtype, pt, n, shift, seed=2)
    ok = (np.arange(n) % 3 != 1).astype(np.uint8)          # every third piece failed its check
    keep = ok.astype(bool) if masked else np.ones(n, bool)
    want = expected(lay, window, src[keep], dst[keep], dests)
    ln = sc.prepare(window, src, dst, dests, lay)
    if n:
        w = ln.word
        pw, units = ln.part_bytes // w, n * ln.parts
        (gx, gy, _), (bx, _, _) = sc.launch_geometry(units, pw, 64, *caps)
        ptr = ctypes.c_void_p
        sw, dr = np.ascontiguousarray(ln.src // w), np.ascontiguousarray(ln.dst)
        rc = cu_on_cpu.run(ctypes.c_int(w), ctypes.c_uint(gx), ctypes.c_uint(gy), ctypes.c_uint(bx),
                           ptr(ln.window.ctypes.data), ptr(sw.ctypes.data), ptr(dr.ctypes.data),
                           ptr(ln.dests[0].ctypes.data), ptr(ln.dests[-1].ctypes.data),
                           ctypes.c_longlong(units), ctypes.c_int(ln.parts), ctypes.c_longlong(pw),
                           ctypes.c_longlong(ln.row_bytes // w),
                           ptr(ok.ctypes.data) if masked else ptr(None))
        assert rc == 0
    check(dests, want)


def test_cuda_source_defines_every_word_kernel():
    src = sc.kernel_source()
    for w in sc.WORD_SIZES:
        assert f"FLATCAKE_SCATTER(flatcake_scatter_w{w}," in src


# ---------------------------------------------------------------- numba.cuda simulator
SIM = textwrap.dedent("""
    import sys
    import numpy as np
    from numba import cuda          # NUMBA_ENABLE_CUDASIM=1 is set: this is the simulator
    sys.path.insert(0, {root!r})
    from tests.support.scatter_cases import make_case, expected, check
    from sglang_flatcake.read import scatter as sc

    @cuda.jit
    def scatter(window, src_word, dst_row, dst0, dst1, n_units, n_parts, part_words, row_words,
                ok):
        # kernels/scatter.cu, line for line
        step = cuda.gridDim.x * cuda.blockDim.x
        u = cuda.blockIdx.y
        while u < n_units:
            piece = u if n_parts == 1 else u >> 1
            if ok[piece] == 0:
                u += cuda.gridDim.y
                continue
            part = u - piece * n_parts
            s = src_word[piece] + part * part_words
            d = dst_row[piece] * row_words
            out = dst0 if part == 0 else dst1
            w = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
            while w + 3 * step < part_words:
                a, b = window[s + w], window[s + w + step]
                c, e = window[s + w + 2 * step], window[s + w + 3 * step]
                out[d + w], out[d + w + step] = a, b
                out[d + w + 2 * step], out[d + w + 3 * step] = c, e
                w += 4 * step
            while w < part_words:
                out[d + w] = window[s + w]
                w += step
            u += cuda.gridDim.y

    WORDS = {{8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}}
    for case in [("mha", 1, 8, "bfloat16", 2, 3, 0), ("mha", 1, 3, "float8_e4m3fn", 2, 2, 1),
                 ("mla", 1, 6, "float16", 2, 3, 4)]:
        for caps in [(1 << 20, 65535), (1, 2)]:
            lay, window, src, dst, dests = make_case(*case, seed=3)
            want = expected(lay, window, src, dst, dests)
            ln = sc.prepare(window, src, dst, dests, lay, max_word=8)   # the launcher's checks
            w, dt = ln.word, WORDS[ln.word]
            pw, units = ln.part_bytes // w, len(ln.src) * ln.parts
            grid, block = sc.launch_geometry(units, pw, 32, *caps)
            dev = [cuda.to_device(v.view(dt)) for v in ln.dests]   # one copy each, even MLA
            scatter[grid[:2], block[0]](cuda.to_device(ln.window.view(dt)),
                                        cuda.to_device(ln.src // w), cuda.to_device(ln.dst),
                                        dev[0], dev[-1], units, ln.parts, pw, ln.row_bytes // w,
                                        cuda.to_device(np.ones(len(ln.src), np.uint8)))
            for d, v in zip(dev, ln.dests):
                d.copy_to_host(v.view(dt))
            check(dests, want)
    print("SIM-OK")
""")


def test_numba_cuda_copy_of_the_kernel_under_the_simulator():
    pytest.importorskip("numba")
    if importlib.util.find_spec("numba.cuda") is None:
        pytest.skip("this numba has no numba.cuda (its simulator ships with numba-cuda)")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    code = SIM.format(root=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert "SIM-OK" in r.stdout, r.stderr[-3000:]


# ---------------------------------------------------------------- the GPU
def _cuda_ok() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ok(), reason="needs cupy and a CUDA device")
@pytest.mark.parametrize("case", SWEEP, ids=[f"{c[0]}-{c[4]}-{c[3]}-n{c[5]}" for c in SWEEP])
def test_cupy_kernel_matches_reference(case):
    import cupy
    lay, window, src, dst, dests = make_case(*case, seed=4)
    want = expected(lay, window, src, dst, dests)
    gdests = [cupy.asarray(d) for d in dests]
    ev = sc.scatter_layer(cupy.asarray(window), src, dst, gdests, lay)
    if ev is not None:
        ev.synchronize()
    check([cupy.asnumpy(g) for g in gdests], want)
