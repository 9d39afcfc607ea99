// Scatter one layer's pieces from a read window into SGLang's paged device KV buffers.
//
// Compiled with NVRTC through CuPy (sglang_flatcake/read/scatter.py caches the module per
// device); no headers are needed.  Copying is dtype-agnostic: every kernel moves words of
// one width (16, 8, 4, 2 or 1 bytes); the launcher picks the widest width that divides
// every offset, size and base address, so any KV dtype works.
//
// Contract (all counts in words of type T; the launcher checks every bound):
//   window      one layer's window: the bytes of one or more read commands of that layer
//   src_word[i] where piece i (one block-layer: n_parts parts of part_words each,
//               K then V for MHA, one latent part for MLA) starts inside the window
//   dst_row[i]  first token slot of piece i's page in the destination buffers
//   dst0, dst1  token-major [num_slots, heads, dim] buffers of this layer (K and V;
//               MLA passes its one buffer twice and n_parts = 1)
//   part_words  = page_tokens * row_words; row_words = words of one token slot
//   ok          null, or one flag per piece: a piece whose flag is 0 is not copied (its
//               checksum failed on the device, kernels/checksum.cu)
// Part p of piece i goes to dst_p[dst_row[i] * row_words .. + part_words), i.e. the
// page's token slots dst_row[i] .. dst_row[i] + page_tokens - 1.
//
// Grid: blockIdx.y walks (piece, part) units, blockIdx.x and threadIdx.x walk the words
// of one part, four words per thread per round (the launcher sizes grid.x for that);
// both loops stride, so any grid covers any size.  tests/test_scatter.py runs
// this file on the CPU (g++, built-ins emulated) and a numba.cuda copy of it under the
// CUDA simulator.

#define FLATCAKE_SCATTER(NAME, T)                                                        \
extern "C" __global__ void NAME(const T* __restrict__ window,                          \
                                const long long* __restrict__ src_word,                \
                                const long long* __restrict__ dst_row,                 \
                                T* dst0, T* dst1,                                      \
                                long long n_units, int n_parts,                        \
                                long long part_words, long long row_words,             \
                                const unsigned char* __restrict__ ok)                  \
{                                                                                        \
    const long long step = (long long)gridDim.x * blockDim.x;                           \
    for (long long u = blockIdx.y; u < n_units; u += gridDim.y) {                       \
        const long long piece = n_parts == 1 ? u : (u >> 1);   /* n_parts is 1 or 2 */  \
        if (ok && !ok[piece]) continue;                                                  \
        const int part = (int)(u - piece * n_parts);                                     \
        const T* s = window + src_word[piece] + part * part_words;                       \
        T* d = (part == 0 ? dst0 : dst1) + dst_row[piece] * row_words;                   \
        long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x;                 \
        for (; w + 3 * step < part_words; w += 4 * step) {   /* 4 loads in flight */    \
            const T a = s[w], b = s[w + step], c = s[w + 2 * step], e = s[w + 3 * step]; \
            d[w] = a; d[w + step] = b; d[w + 2 * step] = c; d[w + 3 * step] = e;        \
        }                                                                                \
        for (; w < part_words; w += step) {                                              \
            d[w] = s[w];                                                                 \
        }                                                                                \
    }                                                                                    \
}

FLATCAKE_SCATTER(flatcake_scatter_w16, uint4)
FLATCAKE_SCATTER(flatcake_scatter_w8, unsigned long long)
FLATCAKE_SCATTER(flatcake_scatter_w4, unsigned int)
FLATCAKE_SCATTER(flatcake_scatter_w2, unsigned short)
FLATCAKE_SCATTER(flatcake_scatter_w1, unsigned char)
