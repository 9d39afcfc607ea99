"""Block checksums: ``kernels/checksum.cu`` and the host twin against the xxhash library.

- the .cu source compiled for the CPU by g++: every lane of a warp is a thread, the
  warp shuffles are emulated with a per-warp barrier, so the kernel's own indexing,
  lane split and XXH3 arithmetic run here (skipped without g++);
- the launcher on the emulated device (the CUDA branch of ``checksum.py``);
- the CuPy kernel on a GPU (``gpu`` marker).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import xxhash
from tests.support.cuda_harness import compile_harness

from sglang_flatcake.read import checksum as ck
from sglang_flatcake.read import device as dv

# every XXH3 size class and its edges: 0, 1-3, 4-8, 9-16, 17-128, 129-240, > 240 (long:
# partial stripes, whole 1024-byte blocks, block + 1, and a real 64-token bf16 page part)
LENGTHS = [0, 1, 3, 4, 8, 9, 16, 17, 32, 33, 64, 65, 96, 97, 128, 129, 200, 240, 241, 255,
           256, 1023, 1024, 1025, 2048, 4000, 5 * 1024 + 64, 65536]

HARNESS = r"""
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>
struct flatcake_dim3 { unsigned int x, y, z; };
static thread_local flatcake_dim3 threadIdx, blockIdx;
static flatcake_dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __constant__ static
#define __forceinline__ inline
#define __restrict__
struct alignas(16) ulonglong2 { unsigned long long x, y; };
static unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
struct Warp {                       // the 32 lanes meet here at every shuffle
    std::mutex m; std::condition_variable cv; int waiting = 0; long gen = 0;
    unsigned long long slot[32];
    void barrier() {
        std::unique_lock<std::mutex> l(m);
        long g = gen;
        if (++waiting == 32) { waiting = 0; ++gen; cv.notify_all(); }
        else cv.wait(l, [&] { return gen != g; });
    }
};
static std::vector<Warp>* warps;
static unsigned long long exchange(unsigned long long v, int from) {
    Warp& w = (*warps)[threadIdx.x / 32];
    w.slot[threadIdx.x % 32] = v; w.barrier();
    unsigned long long r = w.slot[from]; w.barrier();
    return r;
}
static unsigned long long __shfl_xor_sync(unsigned, unsigned long long v, int m) {
    return exchange(v, (threadIdx.x % 32) ^ m);
}
static unsigned long long __shfl_sync(unsigned, unsigned long long v, int src) {
    return exchange(v, src);
}
#include "checksum.cu"
extern "C" int run(unsigned gx, unsigned bx, const unsigned char* win, const long long* src,
                   long long n, long long len, const unsigned long long* expect,
                   unsigned long long* sums, unsigned char* ok) {
    if (bx % 32) return 1;
    gridDim = {gx, 1, 1}; blockDim = {bx, 1, 1};
    for (unsigned b = 0; b < gx; ++b) {
        std::vector<Warp> ws(bx / 32); warps = &ws;
        std::vector<std::thread> lanes;
        for (unsigned t = 0; t < bx; ++t)
            lanes.emplace_back([=] { blockIdx = {b, 0, 0}; threadIdx = {t, 0, 0};
                                     flatcake_xxh3_64(win, src, n, len, expect, sums, ok); });
        for (auto& l : lanes) l.join();
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def cu_on_cpu(tmp_path_factory):
    return compile_harness(tmp_path_factory, HARNESS, dv.kernel_path(ck.KERNEL).parent,
                           "kernels/checksum.cu")


def window_with_pieces(length: int, n: int, shift: int, seed: int = 0, stride=None):
    rng = np.random.default_rng(seed + length)
    stride = stride or length + 8
    window = rng.integers(0, 256, shift + n * stride + 8, dtype=np.uint8)
    src = (shift + rng.permutation(n) * stride).astype(np.int64)
    want = np.array([xxhash.xxh3_64_intdigest(window[o:o + length]) for o in src], np.uint64)
    return window, src, want


def run_cu(lib, window, src, length, expect=None, grid=(2, 64)):
    n = len(src)
    sums = np.zeros(n, np.uint64)
    ok = np.full(n, 7, np.uint8)
    p = ctypes.c_void_p
    exp = np.zeros(n, np.uint64) if expect is None else expect
    rc = lib.run(ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), p(window.ctypes.data),
                 p(src.ctypes.data), ctypes.c_longlong(n), ctypes.c_longlong(length),
                 p(exp.ctypes.data), p(sums.ctypes.data), p(ok.ctypes.data))
    assert rc == 0
    return sums, ok


@pytest.mark.parametrize("aligned", [False, True], ids=["any-alignment", "16-byte-aligned"])
@pytest.mark.parametrize("length", LENGTHS)
def test_cuda_source_computes_xxh3_64_on_cpu(cu_on_cpu, length, aligned):
    """Both long paths: bytes at any alignment, and 16-byte loads for aligned pieces."""
    n = 5 if length <= 4096 else 2
    if aligned:   # the harness's window is 16-byte aligned (numpy allocations are)
        window, src, want = window_with_pieces(length, n, 0, stride=-(-length // 16) * 16 + 16)
        assert window.ctypes.data % 16 == 0 and not (src % 16).any()
    else:
        window, src, want = window_with_pieces(length, n, shift=3)
    sums, ok = run_cu(cu_on_cpu, window, src, length, want)
    assert sums.tolist() == want.tolist()
    assert ok.tolist() == [1] * n


def test_cuda_source_flags_a_flipped_byte_and_strides_over_pieces(cu_on_cpu):
    window, src, want = window_with_pieces(3000, 9, shift=0, seed=4)
    window[src[4] + 2999] ^= 0x80                       # the last byte of piece 4
    sums, ok = run_cu(cu_on_cpu, window, src, 3000, want, grid=(1, 32))   # 1 warp, 9 pieces
    assert ok.tolist() == [1, 1, 1, 1, 0, 1, 1, 1, 1]
    assert int(sums[4]) == xxhash.xxh3_64_intdigest(window[src[4]:src[4] + 3000])


def test_host_checksums_are_the_write_sides():
    from sglang_flatcake.segment import block_checksums
    sec = np.random.default_rng(1).integers(0, 256, (3, 4, 100), dtype=np.uint8)
    sums = block_checksums(sec)
    assert sums.shape == (3, 4)
    assert int(sums[2, 1]) == xxhash.xxh3_64_intdigest(sec[2, 1].tobytes())
    ok = ck.verify_host(sec.reshape(-1), np.arange(12) * 100, sums.reshape(-1), 100)
    assert ok.all()
    sec[1, 3, 50] ^= 1
    ok = ck.verify_host(sec.reshape(-1), np.arange(12) * 100, sums.reshape(-1), 100)
    assert np.nonzero(~ok)[0].tolist() == [7]


def test_emulated_device_launch_verifies_and_sums():
    dev = dv.EMULATED
    window, src, want = window_with_pieces(1500, 6, shift=5)
    window[src[2]] ^= 1
    s = dev.stream()
    dwin = dev.upload(window, s)        # on the launches' stream: the legacy stream would race
    ok = dev.empty(6)
    ck.verify_on_device(dev, dwin, src, want, 1500, ok, s)
    sums = ck.sums_on_device(dev, dwin, src, 1500, s)
    assert isinstance(ok, dv.EmuArray)
    assert dev.download(ok, s).tolist() == [1, 1, 0, 1, 1, 1]
    got = dev.download(sums, s)
    assert got[0] == want[0] and got[2] != want[2]


def test_launcher_refuses_pieces_outside_the_window():
    dev = dv.EMULATED
    dwin = dev.empty(100)
    with pytest.raises(ValueError, match="outside the window"):
        ck.verify_on_device(dev, dwin, [90], [0], 20, dev.empty(1))
    with pytest.raises(ValueError, match="flags for"):
        ck.verify_on_device(dev, dwin, [0, 20], [0, 0], 20, dev.empty(1))
    with pytest.raises(ValueError, match="piece_bytes"):
        ck.sums_on_device(dev, dwin, [0], 0)


def _cuda_ok() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ok(), reason="needs cupy and a CUDA device")
@pytest.mark.parametrize("length", LENGTHS)
def test_cupy_kernel_computes_xxh3_64(length):
    window, src, want = window_with_pieces(length, 7, shift=1)
    dev = dv.CUDA
    got = dev.download(ck.sums_on_device(dev, dev.upload(window), src, length))
    assert got.tolist() == want.tolist()


def test_cuda_source_matches_xxhash_over_a_sweep_of_aligned_long_sizes(cu_on_cpu):
    """The 16-byte path against the library over random sizes (partial blocks, partial
    stripes, a last stripe straddling 16-byte words)."""
    for length in np.random.default_rng(11).integers(241, 9000, 10).tolist():
        window, src, want = window_with_pieces(length, 3, 0, stride=-(-length // 16) * 16 + 32)
        sums, ok = run_cu(cu_on_cpu, window, src, length, want, grid=(1, 32))
        assert sums.tolist() == want.tolist(), length
