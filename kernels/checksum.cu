// XXH3-64 (seed 0, default secret) of each piece of a read window, one warp per piece.
//
// The same function as the write side (xxhash.xxh3_64 of each (layer, block) range,
// sglang_flatcake/read/checksum.py), so a block read into a device window is verified where
// it landed.  Compiled with NVRTC through CuPy; no headers.  tests/test_checksum.py runs
// this file on the CPU (g++, every lane a thread, warp shuffles emulated) against the
// xxhash library over a sweep of lengths (every XXH3 size class) and alignments.
//
// Contract:
//   window       bytes of one or more read commands
//   src[i]       byte offset of piece i in the window (any alignment)
//   n_pieces     pieces; every piece is piece_bytes long
//   expect[i]    the stored checksum of piece i (ok != 0 only)
//   sums[i]      written with the XXH3-64 of piece i (when sums != 0)
//   ok[i]        written with 1 when it equals expect[i], else 0 (when ok != 0)
// blockDim.x is a multiple of 32; warps stride over pieces, so any grid covers any count.
//
// Inputs of more than 240 bytes take XXH3's long path: stripes of 64 bytes feed 8
// accumulator lanes, and the accumulators are scrambled after every 1024-byte block.
// Within a block each lane's sum is a plain 64-bit sum over the 16 stripes, so the 32
// threads split it: thread t owns lane t & 7 and stripes (t >> 3) + 4k, and the four
// partial sums of a lane meet by shuffle before the scramble.  Shorter inputs are
// hashed by lane 0 alone.

#define FC_P32_1 0x9E3779B1ULL
#define FC_P32_2 0x85EBCA77ULL
#define FC_P32_3 0xC2B2AE3DULL
#define FC_P64_1 0x9E3779B185EBCA87ULL
#define FC_P64_2 0xC2B2AE3D27D4EB4FULL
#define FC_P64_3 0x165667B19E3779F9ULL
#define FC_P64_4 0x85EBCA77C2B2AE63ULL
#define FC_P64_5 0x27D4EB2F165667C5ULL
#define FC_MX1 0x165667919E3779F9ULL
#define FC_MX2 0x9FB21C651E98DF25ULL
#define FC_FULL 0xffffffffu

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char u8;

__constant__ u8 fc_secret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

__device__ __forceinline__ u64 fc_bytes64(const u8* p) {
    u64 v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}
__device__ __forceinline__ u64 fc_read64(const u8* p) {    // little endian, any alignment
    return ((unsigned long long)p & 7) == 0 ? *(const u64*)p : fc_bytes64(p);
}
__device__ __forceinline__ u32 fc_read32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}
__device__ __forceinline__ u64 fc_rotl(u64 x, int r) { return (x << r) | (x >> (64 - r)); }
__device__ __forceinline__ u64 fc_swap64(u64 x) {
    u64 r = 0;
    for (int i = 0; i < 8; ++i) r = (r << 8) | ((x >> (8 * i)) & 0xff);
    return r;
}
__device__ __forceinline__ u64 fc_fold(u64 a, u64 b) { return (a * b) ^ __umul64hi(a, b); }
__device__ __forceinline__ u64 fc_avalanche(u64 h) {
    h ^= h >> 37; h *= FC_MX1; return h ^ (h >> 32);
}
__device__ __forceinline__ u64 fc_xxh64_avalanche(u64 h) {
    h ^= h >> 33; h *= FC_P64_2; h ^= h >> 29; h *= FC_P64_3; return h ^ (h >> 32);
}
__device__ __forceinline__ u64 fc_mix16(const u8* in, int s) {
    return fc_fold(fc_read64(in) ^ fc_bytes64(fc_secret + s),
                   fc_read64(in + 8) ^ fc_bytes64(fc_secret + s + 8));
}

// XXH3-64 of inputs of 0..240 bytes (one thread)
__device__ u64 fc_xxh3_short(const u8* in, long long n) {
    const u64 len = (u64)n;
    if (n > 128) {
        u64 acc = len * FC_P64_1;
        for (int i = 0; i < 8; ++i) acc += fc_mix16(in + 16 * i, 16 * i);
        acc = fc_avalanche(acc);
        for (int i = 8; i < (int)(n / 16); ++i) acc += fc_mix16(in + 16 * i, 16 * (i - 8) + 3);
        acc += fc_mix16(in + n - 16, 136 - 17);
        return fc_avalanche(acc);
    }
    if (n > 16) {
        u64 acc = len * FC_P64_1;
        if (n > 32) {
            if (n > 64) {
                if (n > 96) { acc += fc_mix16(in + 48, 96); acc += fc_mix16(in + n - 64, 112); }
                acc += fc_mix16(in + 32, 64); acc += fc_mix16(in + n - 48, 80);
            }
            acc += fc_mix16(in + 16, 32); acc += fc_mix16(in + n - 32, 48);
        }
        acc += fc_mix16(in, 0); acc += fc_mix16(in + n - 16, 16);
        return fc_avalanche(acc);
    }
    if (n > 8) {
        const u64 lo = fc_read64(in) ^ (fc_bytes64(fc_secret + 24) ^ fc_bytes64(fc_secret + 32));
        const u64 hi = fc_read64(in + n - 8) ^ (fc_bytes64(fc_secret + 40) ^ fc_bytes64(fc_secret + 48));
        return fc_avalanche(len + fc_swap64(lo) + hi + fc_fold(lo, hi));
    }
    if (n >= 4) {
        const u64 in64 = (u64)fc_read32(in + n - 4) + ((u64)fc_read32(in) << 32);
        u64 h = in64 ^ (fc_bytes64(fc_secret + 8) ^ fc_bytes64(fc_secret + 16));
        h ^= fc_rotl(h, 49) ^ fc_rotl(h, 24);
        h *= FC_MX2; h ^= (h >> 35) + len; h *= FC_MX2;
        return h ^ (h >> 28);
    }
    if (n > 0) {
        const u32 c = ((u32)in[0] << 16) | ((u32)in[n >> 1] << 24) | (u32)in[n - 1] | ((u32)n << 8);
        return fc_xxh64_avalanche((u64)(c ^ (fc_read32(fc_secret) ^ fc_read32(fc_secret + 4))));
    }
    return fc_xxh64_avalanche(fc_bytes64(fc_secret + 56) ^ fc_bytes64(fc_secret + 64));
}

// lane i's share of one stripe: the product term of data word i and data word i ^ 1
__device__ __forceinline__ u64 fc_stripe(const u8* stripe, u64 key, int i) {
    const u64 d = fc_read64(stripe + 8 * i);
    const u64 k = d ^ key;
    return (k & 0xffffffffULL) * (k >> 32) + fc_read64(stripe + 8 * (i ^ 1));
}
__device__ __forceinline__ u64 fc_lane_sum(u64 v) {      // over the 4 threads of a lane
    v += __shfl_xor_sync(FC_FULL, v, 8);
    return v + __shfl_xor_sync(FC_FULL, v, 16);
}

// XXH3-64 of inputs of more than 240 bytes, by a whole warp; the result is in every thread
__device__ u64 fc_xxh3_long(const u8* in, long long n, int t) {
    const int i = t & 7, g = t >> 3;
    const u64 init[8] = {FC_P32_3, FC_P64_1, FC_P64_2, FC_P64_3, FC_P64_4, FC_P32_2, FC_P64_5,
                         FC_P32_1};
    u64 acc = init[i], key[4];
    for (int k = 0; k < 4; ++k) key[k] = fc_bytes64(fc_secret + 8 * (g + 4 * k) + 8 * i);
    const u64 scramble = fc_bytes64(fc_secret + 128 + 8 * i);
    const long long blocks = (n - 1) / 1024;
    for (long long b = 0; b < blocks; ++b) {
        const u8* blk = in + b * 1024;
        u64 part = 0;
        for (int k = 0; k < 4; ++k) part += fc_stripe(blk + 64 * (g + 4 * k), key[k], i);
        acc += fc_lane_sum(part);
        acc ^= acc >> 47; acc ^= scramble; acc *= FC_P32_1;
    }
    const long long stripes = ((n - 1) - 1024 * blocks) / 64;
    const u8* blk = in + blocks * 1024;
    u64 part = 0;
    for (int k = 0; k < 4; ++k)
        if (g + 4 * k < stripes) part += fc_stripe(blk + 64 * (g + 4 * k), key[k], i);
    if (g == 0) part += fc_stripe(in + n - 64, fc_bytes64(fc_secret + 121 + 8 * i), i);
    acc += fc_lane_sum(part);
    u64 a[8];
    for (int k = 0; k < 8; ++k) a[k] = __shfl_sync(FC_FULL, acc, k);
    u64 h = (u64)n * FC_P64_1;
    for (int k = 0; k < 4; ++k)
        h += fc_fold(a[2 * k] ^ fc_bytes64(fc_secret + 11 + 16 * k),
                     a[2 * k + 1] ^ fc_bytes64(fc_secret + 19 + 16 * k));
    return fc_avalanche(h);
}

// The same, bandwidth-bound, for a piece whose start is 16-byte aligned (decided once per
// piece, so warp-uniform): thread t owns the lane pair (2p, 2p+1), p = t & 3, of stripes g and
// g + 8 of every block, g = t >> 2, and reads each as one 16-byte load; the next block's two
// loads are issued before this block's arithmetic (prefetch).  Eight threads share a pair:
// their partial sums meet by three shuffles before the scramble.
__device__ __forceinline__ u64 fc_pair_sum(u64 v) {
    v += __shfl_xor_sync(FC_FULL, v, 4);
    v += __shfl_xor_sync(FC_FULL, v, 8);
    return v + __shfl_xor_sync(FC_FULL, v, 16);
}
__device__ __forceinline__ u64 fc_mul32(u64 k) { return (k & 0xffffffffULL) * (k >> 32); }

__device__ u64 fc_xxh3_long16(const u8* in, long long n, int t) {
    const int p = t & 3, g = t >> 2;
    const u64 init[8] = {FC_P32_3, FC_P64_1, FC_P64_2, FC_P64_3, FC_P64_4, FC_P32_2, FC_P64_5,
                         FC_P32_1};
    u64 acc0 = init[2 * p], acc1 = init[2 * p + 1];
    const u64 ka0 = fc_bytes64(fc_secret + 8 * g + 16 * p), ka1 = fc_bytes64(fc_secret + 8 * g + 16 * p + 8);
    const u64 kb0 = fc_bytes64(fc_secret + 8 * (g + 8) + 16 * p);
    const u64 kb1 = fc_bytes64(fc_secret + 8 * (g + 8) + 16 * p + 8);
    const u64 sc0 = fc_bytes64(fc_secret + 128 + 16 * p), sc1 = fc_bytes64(fc_secret + 136 + 16 * p);
    const ulonglong2* v = (const ulonglong2*)in;      // stripe s of block b: v[64 b + 4 s + p]
    const long long blocks = (n - 1) / 1024;
    ulonglong2 x = {0, 0}, y = {0, 0};
    if (blocks > 0) { x = v[4 * g + p]; y = v[4 * (g + 8) + p]; }
    for (long long b = 0; b < blocks; ++b) {
        ulonglong2 nx = {0, 0}, ny = {0, 0};
        if (b + 1 < blocks) { nx = v[64 * (b + 1) + 4 * g + p]; ny = v[64 * (b + 1) + 4 * (g + 8) + p]; }
        const u64 s0 = fc_mul32(x.x ^ ka0) + x.y + fc_mul32(y.x ^ kb0) + y.y;
        const u64 s1 = fc_mul32(x.y ^ ka1) + x.x + fc_mul32(y.y ^ kb1) + y.x;
        acc0 += fc_pair_sum(s0); acc1 += fc_pair_sum(s1);
        acc0 ^= acc0 >> 47; acc0 ^= sc0; acc0 *= FC_P32_1;
        acc1 ^= acc1 >> 47; acc1 ^= sc1; acc1 *= FC_P32_1;
        x = nx; y = ny;
    }
    const long long stripes = ((n - 1) - 1024 * blocks) / 64;
    u64 s0 = 0, s1 = 0;
    if (g < stripes) {
        x = v[64 * blocks + 4 * g + p];
        s0 += fc_mul32(x.x ^ ka0) + x.y; s1 += fc_mul32(x.y ^ ka1) + x.x;
    }
    if (g + 8 < stripes) {
        y = v[64 * blocks + 4 * (g + 8) + p];
        s0 += fc_mul32(y.x ^ kb0) + y.y; s1 += fc_mul32(y.y ^ kb1) + y.x;
    }
    if (g == 0) {                                      // the last stripe: any alignment
        const u8* last = in + n - 64 + 16 * p;
        const u64 d0 = fc_read64(last), d1 = fc_read64(last + 8);
        s0 += fc_mul32(d0 ^ fc_bytes64(fc_secret + 121 + 16 * p)) + d1;
        s1 += fc_mul32(d1 ^ fc_bytes64(fc_secret + 129 + 16 * p)) + d0;
    }
    acc0 += fc_pair_sum(s0); acc1 += fc_pair_sum(s1);
    u64 h = (u64)n * FC_P64_1;
    for (int k = 0; k < 4; ++k) {
        const u64 a0 = __shfl_sync(FC_FULL, acc0, k), a1 = __shfl_sync(FC_FULL, acc1, k);
        h += fc_fold(a0 ^ fc_bytes64(fc_secret + 11 + 16 * k), a1 ^ fc_bytes64(fc_secret + 19 + 16 * k));
    }
    return fc_avalanche(h);
}

extern "C" __global__ void flatcake_xxh3_64(const u8* __restrict__ window,
                                            const long long* __restrict__ src,
                                            long long n_pieces, long long piece_bytes,
                                            const u64* __restrict__ expect, u64* sums, u8* ok)
{
    const int t = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long p = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; p < n_pieces;
         p += warps) {
        const u8* in = window + src[p];
        const bool aligned = ((unsigned long long)in & 15) == 0;     // warp-uniform
        const u64 h = piece_bytes <= 240 ? (t == 0 ? fc_xxh3_short(in, piece_bytes) : 0)
                    : aligned ? fc_xxh3_long16(in, piece_bytes, t)
                              : fc_xxh3_long(in, piece_bytes, t);
        if (t == 0) {
            if (sums) sums[p] = h;
            if (ok) ok[p] = h == expect[p] ? 1 : 0;
        }
    }
}
