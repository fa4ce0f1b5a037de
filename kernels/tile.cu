// Token-tiled products for steps of many tokens (prefill, batched decode, a draft's verification):
// each weight row is loaded once for a tile of tokens (or routed token-slot pairs), and each
// activation once for a tile of rows (tarfa-cuda/src/ops.rs `matmul`, `experts_grouped`).
//
// Every output is still one canonical reduction (common.cuh, docs/EXACTNESS.md section 4) computed
// by one warp: thread p holds lanes 8p..8p+7 of every 256-element chunk, chunks in increasing
// order, one fmaf per term, then warp_tree_fast (warp_tree's pairs). A warp holds R rows x TT tokens
// of such outputs at once; which outputs share a warp, a block or a launch changes which loads
// serve them, never an operation or its order, so an output has the bits of matvec.cu's, gate_up's
// and down_mix's, whatever else is in its tile (docs/EXACTNESS.md section 9).
//
// The experts run expert-major: moe_group lists, per expert in ascending id, the (token, slot)
// pairs that chose it, cut into tiles of at most TILE_TOKENS pairs; gate_up_tile and down_tile then
// read each expert's rows once per tile, and moe_mix (moe.cu) mixes the down products per token in
// ascending expert id, exactly as down_mix adds them.
#include "common.cuh"

#define TILE_ROWS 4    // rows per warp (mm_tile, down_tile)
#define GU_ROWS 2      // rows per warp in gate_up_tile (gate and up: twice the accumulators)
#define TILE_TOKENS 4  // tokens, or routed pairs, per block

__device__ __forceinline__ void load_x8(float xv[8], const float* p) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w;
    xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
}

// acc[r][t][s] accumulates lane 8p+s of dot(w[r], x[t]) over n elements (n a multiple of 8, every
// row and vector 16-byte aligned: the host checks): term 8p+s+256c for c = 0, 1, ... in order.
template <typename W, int R, int T>
__device__ __forceinline__ void tile_dots(float (&acc)[R][T][8], const W* const (&w)[R],
                                          const float* const (&x)[T], int n, int p) {
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < T; t++) zero8(acc[r][t]);
    // the next chunk's weights are loaded before this chunk's FMAs (loads in flight; the same
    // terms in the same order)
    Pack8<W> wv[R];
    if (8 * p < n) {
#pragma unroll
        for (int r = 0; r < R; r++) wv[r].load(w[r] + 8 * p);
    }
    for (int base = 8 * p; base < n; base += TARFA_LANES) {
        Pack8<W> nx[R];
        if (base + TARFA_LANES < n) {
#pragma unroll
            for (int r = 0; r < R; r++) nx[r].load(w[r] + base + TARFA_LANES);
        }
#pragma unroll
        for (int t = 0; t < T; t++) {
            float xv[8];
            load_x8(xv, x[t] + base);
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int s = 0; s < 8; s++) acc[r][t][s] = fmaf(wv[r].at(s), xv[s], acc[r][t][s]);
        }
#pragma unroll
        for (int r = 0; r < R; r++) wv[r] = nx[r];
    }
}

// out[t][r] = (out[t][r] +) dot(W[r], x[t]) (+ bias[r]): matvec.cu's function, a warp per
// TILE_ROWS rows x TILE_TOKENS tokens. Rows and tokens past the end are computed on the last
// row / token (valid memory) and not written, so every thread of a warp reaches the trees.
// grid (ceil(tokens / TILE_TOKENS), ceil(rows / (8 * TILE_ROWS))), block 256: the token tiles
// are the fast grid dimension, so the blocks that read the same rows run together and all but
// the first find them in L2 (a step reads each weight from HBM about once, whatever its tokens).
template <typename W>
__device__ __forceinline__ void mm_tile_body(const W* __restrict__ w, int rows, int cols,
                                             const float* __restrict__ x, long x_stride,
                                             int tokens, const float* __restrict__ bias,
                                             float* out, long out_stride, int mode) {
    const int p = threadIdx.x & 31;
    const int r0 = (blockIdx.y * 8 + (threadIdx.x >> 5)) * TILE_ROWS;
    const int t0 = blockIdx.x * TILE_TOKENS;
    if (r0 >= rows) return;  // a whole warp leaves together
    const W* wr[TILE_ROWS];
    const float* xr[TILE_TOKENS];
#pragma unroll
    for (int r = 0; r < TILE_ROWS; r++) wr[r] = w + (long)min(r0 + r, rows - 1) * cols;
#pragma unroll
    for (int t = 0; t < TILE_TOKENS; t++) xr[t] = x + (long)min(t0 + t, tokens - 1) * x_stride;
    float acc[TILE_ROWS][TILE_TOKENS][8];
    tile_dots<W, TILE_ROWS, TILE_TOKENS>(acc, wr, xr, cols, p);
#pragma unroll
    for (int r = 0; r < TILE_ROWS; r++) {
#pragma unroll
        for (int t = 0; t < TILE_TOKENS; t++) {
            float y = warp_tree_fast(acc[r][t]);
            if (p == 0 && r0 + r < rows && t0 + t < tokens) {
                if (bias != nullptr) y = __fadd_rn(y, bias[r0 + r]);
                float* o = out + (long)(t0 + t) * out_stride + r0 + r;
                *o = (mode == 1) ? __fadd_rn(*o, y) : y;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) mm_tile_bf16(
    const u16* __restrict__ w, int rows, int cols, const float* __restrict__ x, long x_stride,
    int tokens, const float* __restrict__ bias, float* out, long out_stride, int mode) {
    mm_tile_body<u16>(w, rows, cols, x, x_stride, tokens, bias, out, out_stride, mode);
}

extern "C" __global__ void __launch_bounds__(256) mm_tile_f32(
    const float* __restrict__ w, int rows, int cols, const float* __restrict__ x, long x_stride,
    int tokens, const float* __restrict__ bias, float* out, long out_stride, int mode) {
    mm_tile_body<float>(w, rows, cols, x, x_stride, tokens, bias, out, out_stride, mode);
}

// The routed pairs q = t*k + j of one MoE layer (ids[q]: the expert slot j of token t chose),
// grouped by expert: order[] lists them expert by expert in ascending id, ascending q within an
// expert; tiles[3i..3i+3) = (expert, first index into order, count <= tile), experts in
// ascending id; *n_tiles their number. `tile`: the consumer's pairs per block (TILE_TOKENS for
// the kernels below, LS_BT for prefill.cu's). Integer bookkeeping only: it decides which pairs
// share a tile, never an operation on a value. One block of 256 threads; dynamic shared memory
// 3*E u32.
extern "C" __global__ void __launch_bounds__(256) moe_group(const u32* __restrict__ ids,
                                                           int n_pairs, int e_count, int tile,
                                                           u32* __restrict__ order,
                                                           u32* __restrict__ tiles,
                                                           u32* __restrict__ n_tiles) {
    TARFA_DYN_SMEM(u32, sm);  // [0, E) counts, [E, 2E) next place in order, [2E, 3E) first tile
    __shared__ u32 win[256];
    const int v = threadIdx.x;
    u32* count = sm;
    u32* place = sm + e_count;
    u32* first = sm + 2 * e_count;
    for (int e = v; e < e_count; e += blockDim.x) count[e] = 0;
    // thread e counts its expert's pairs, a window of ids at a time
    for (int base = 0; base < n_pairs; base += 256) {
        const int n = min(256, n_pairs - base);
        __syncthreads();
        if (v < n) win[v] = ids[base + v];
        __syncthreads();
        for (int e = v; e < e_count; e += blockDim.x) {
            u32 c = 0;
            for (int i = 0; i < n; i++) c += (win[i] == (u32)e) ? 1u : 0u;
            count[e] += c;
        }
    }
    __syncthreads();
    if (v == 0) {
        u32 at = 0, nt = 0;
        for (int e = 0; e < e_count; e++) {
            place[e] = at;
            first[e] = nt;
            at += count[e];
            nt += (count[e] + (u32)tile - 1) / (u32)tile;
        }
        *n_tiles = nt;
    }
    __syncthreads();
    for (int e = v; e < e_count; e += blockDim.x) {
        const u32 c = count[e];
        for (u32 j = 0; j * (u32)tile < c; j++) {
            const u32 i = first[e] + j;
            tiles[3 * i] = (u32)e;
            tiles[3 * i + 1] = place[e] + j * (u32)tile;
            tiles[3 * i + 2] = min((u32)tile, c - j * (u32)tile);
        }
    }
    // thread e appends its expert's pairs in ascending q
    for (int base = 0; base < n_pairs; base += 256) {
        const int n = min(256, n_pairs - base);
        __syncthreads();
        if (v < n) win[v] = ids[base + v];
        __syncthreads();
        for (int e = v; e < e_count; e += blockDim.x) {
            u32 at = place[e];
            for (int i = 0; i < n; i++) {
                if (win[i] == (u32)e) order[at++] = (u32)(base + i);
            }
            place[e] = at;
        }
    }
}

// The pairs of block column blockIdx.x: grouped (order != null), tile blockIdx.x of moe_group's
// list (blocks past *n_tiles leave); dense (order == null), pairs = tokens blockIdx.x*TILE_TOKENS..
// of n_pairs, expert 0. Returns false when the block has nothing to do.
__device__ __forceinline__ bool tile_pairs(const u32* __restrict__ order,
                                           const u32* __restrict__ tiles,
                                           const u32* __restrict__ n_tiles, int n_pairs,
                                           long& expert, int (&q)[TILE_TOKENS], int& count) {
    int start;
    if (order != nullptr) {
        const u32 b = blockIdx.x;
        if (b >= *n_tiles) return false;
        expert = tiles[3 * b];
        start = (int)tiles[3 * b + 1];
        count = (int)tiles[3 * b + 2];
    } else {
        expert = 0;
        start = blockIdx.x * TILE_TOKENS;
        count = min(TILE_TOKENS, n_pairs - start);
    }
#pragma unroll
    for (int u = 0; u < TILE_TOKENS; u++) {
        const int i = start + min(u, count - 1);
        q[u] = order != nullptr ? (int)order[i] : i;
    }
    return true;
}

// act[q][i] = silu(dot(gate_e[i], xn[q / k])) * dot(up_e[i], xn[q / k]) for the pairs q of a
// tile (gate_up_bf16's function; a dense MLP: k = 1, e = 0). gate/up stacked [E][rows][cols].
// grid (tiles, ceil(rows / (8 * GU_ROWS))), block 256 (tiles fast, as mm_tile).
template <typename W>
__device__ __forceinline__ void gate_up_tile_body(const W* __restrict__ gate,
                                                  const W* __restrict__ up, int rows, int cols,
                                                  const u32* __restrict__ order,
                                                  const u32* __restrict__ tiles,
                                                  const u32* __restrict__ n_tiles, int n_pairs,
                                                  int k, const float* __restrict__ xn,
                                                  float* __restrict__ act) {
    const int p = threadIdx.x & 31;
    const int i0 = (blockIdx.y * 8 + (threadIdx.x >> 5)) * GU_ROWS;
    long e;
    int q[TILE_TOKENS];
    int count;
    if (!tile_pairs(order, tiles, n_tiles, n_pairs, e, q, count) || i0 >= rows) return;
    const W* wg[GU_ROWS];
    const W* wu[GU_ROWS];
#pragma unroll
    for (int r = 0; r < GU_ROWS; r++) {
        const long row = (e * rows + min(i0 + r, rows - 1)) * (long)cols;
        wg[r] = gate + row;
        wu[r] = up + row;
    }
    const float* xr[TILE_TOKENS];
#pragma unroll
    for (int u = 0; u < TILE_TOKENS; u++) xr[u] = xn + (long)(q[u] / k) * cols;
    float ag[GU_ROWS][TILE_TOKENS][8];
    float au[GU_ROWS][TILE_TOKENS][8];
#pragma unroll
    for (int r = 0; r < GU_ROWS; r++)
#pragma unroll
        for (int u = 0; u < TILE_TOKENS; u++) {
            zero8(ag[r][u]);
            zero8(au[r][u]);
        }
    Pack8<W> g8[GU_ROWS], u8[GU_ROWS];
    if (8 * p < cols) {
#pragma unroll
        for (int r = 0; r < GU_ROWS; r++) {
            g8[r].load(wg[r] + 8 * p);
            u8[r].load(wu[r] + 8 * p);
        }
    }
    for (int base = 8 * p; base < cols; base += TARFA_LANES) {
        Pack8<W> gn[GU_ROWS], un[GU_ROWS];
        if (base + TARFA_LANES < cols) {
#pragma unroll
            for (int r = 0; r < GU_ROWS; r++) {
                gn[r].load(wg[r] + base + TARFA_LANES);
                un[r].load(wu[r] + base + TARFA_LANES);
            }
        }
#pragma unroll
        for (int u = 0; u < TILE_TOKENS; u++) {
            float xv[8];
            load_x8(xv, xr[u] + base);
#pragma unroll
            for (int r = 0; r < GU_ROWS; r++)
#pragma unroll
                for (int s = 0; s < 8; s++) {
                    ag[r][u][s] = fmaf(g8[r].at(s), xv[s], ag[r][u][s]);
                    au[r][u][s] = fmaf(u8[r].at(s), xv[s], au[r][u][s]);
                }
        }
#pragma unroll
        for (int r = 0; r < GU_ROWS; r++) {
            g8[r] = gn[r];
            u8[r] = un[r];
        }
    }
#pragma unroll
    for (int r = 0; r < GU_ROWS; r++) {
#pragma unroll
        for (int u = 0; u < TILE_TOKENS; u++) {
            const float g = warp_tree_fast(ag[r][u]);
            const float uu = warp_tree_fast(au[r][u]);
            if (p == 0 && i0 + r < rows && u < count) {
                act[(long)q[u] * rows + i0 + r] = __fmul_rn(det_silu(g), uu);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) gate_up_tile_bf16(
    const u16* __restrict__ gate, const u16* __restrict__ up, int rows, int cols,
    const u32* __restrict__ order, const u32* __restrict__ tiles, const u32* __restrict__ n_tiles,
    int n_pairs, int k, const float* __restrict__ xn, float* __restrict__ act) {
    gate_up_tile_body<u16>(gate, up, rows, cols, order, tiles, n_tiles, n_pairs, k, xn, act);
}

extern "C" __global__ void __launch_bounds__(256) gate_up_tile_f32(
    const float* __restrict__ gate, const float* __restrict__ up, int rows, int cols,
    const u32* __restrict__ order, const u32* __restrict__ tiles, const u32* __restrict__ n_tiles,
    int n_pairs, int k, const float* __restrict__ xn, float* __restrict__ act) {
    gate_up_tile_body<float>(gate, up, rows, cols, order, tiles, n_tiles, n_pairs, k, xn, act);
}

// y[q][r] = dot(down_e[r], act[q]) for the pairs q of a tile of moe_group's list (down_slots'
// function, unmixed; moe_mix then mixes). down stacked [E][hidden][width] (BF16).
// grid (tiles, ceil(hidden / (8 * TILE_ROWS))), block 256.
extern "C" __global__ void __launch_bounds__(256) down_tile(
    const u16* __restrict__ down, int hidden, int width, const u32* __restrict__ order,
    const u32* __restrict__ tiles, const u32* __restrict__ n_tiles, const float* __restrict__ act,
    float* __restrict__ y) {
    const int p = threadIdx.x & 31;
    const int r0 = (blockIdx.y * 8 + (threadIdx.x >> 5)) * TILE_ROWS;
    long e;
    int q[TILE_TOKENS];
    int count;
    if (!tile_pairs(order, tiles, n_tiles, 0, e, q, count) || r0 >= hidden) return;
    const u16* wr[TILE_ROWS];
#pragma unroll
    for (int r = 0; r < TILE_ROWS; r++) {
        wr[r] = down + (e * hidden + min(r0 + r, hidden - 1)) * (long)width;
    }
    const float* xr[TILE_TOKENS];
#pragma unroll
    for (int u = 0; u < TILE_TOKENS; u++) xr[u] = act + (long)q[u] * width;
    float acc[TILE_ROWS][TILE_TOKENS][8];
    tile_dots<u16, TILE_ROWS, TILE_TOKENS>(acc, wr, xr, width, p);
#pragma unroll
    for (int r = 0; r < TILE_ROWS; r++) {
#pragma unroll
        for (int u = 0; u < TILE_TOKENS; u++) {
            const float v = warp_tree_fast(acc[r][u]);
            if (p == 0 && r0 + r < hidden && u < count) y[(long)q[u] * hidden + r0 + r] = v;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The experts of a step with few pairs per expert (batched decode, a draft's verification): most
// of moe_group's tiles then hold 1 or 2 pairs, and the token-tiled kernels above, which compute
// all TILE_TOKENS columns of a tile and keep one chunk of loads in flight, do up to 4x the
// multiply-adds and wait on memory. These kernels take the same tiles (moe_group with
// TILE_TOKENS) and compute only the tile's own pairs: each block chooses T = 1, 2 or 4 columns
// by its tile's count (a column past the count, only when count = 3, repeats the last pair and
// is not written), and each warp keeps FEW_GROUP chunks of every row it holds in flight, as the
// decode kernels do (decode.cu load_group). Every output is still one canonical reduction: lane
// 8p+s accumulates terms 8p+s+256c in increasing c, one fmaf each, then warp_tree_fast; the
// grouping of the loads changes which loads are in flight, never an operation or its order.

#define FEW_GROUP 8       // chunks of 256 elements loaded together per gate/up row
#define FEW_DOWN_GROUP 4  // chunks loaded together per down row
#define FEW_DOWN_ROWS 4   // down rows per warp

// acc[r][t][s] += lane 8p+s of chunks c0 .. c0+G-1 of dot(w[r], x[t]) (chunks past n skipped:
// n a multiple of 8, every row and vector 16-byte aligned).
template <int R, int T, int G>
__device__ __forceinline__ void few_group(float (&acc)[R][T][8], const u16* const (&w)[R],
                                          const float* const (&x)[T], int c0, int n, int p) {
    Pack8<u16> wv[R][G];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int i = 0; i < G; i++) {
            const int e = ((c0 + i) << 8) + 8 * p;
            if (e < n) wv[r][i].load(w[r] + e);
        }
#pragma unroll
    for (int i = 0; i < G; i++) {
        const int e = ((c0 + i) << 8) + 8 * p;
        if (e < n) {
#pragma unroll
            for (int t = 0; t < T; t++) {
                float xv[8];
                load_x8(xv, x[t] + e);
#pragma unroll
                for (int r = 0; r < R; r++)
#pragma unroll
                    for (int s = 0; s < 8; s++) acc[r][t][s] = fmaf(wv[r][i].at(s), xv[s], acc[r][t][s]);
            }
        }
    }
}

// act[q][i] = silu(dot(gate_e[i], xn[q / k])) * dot(up_e[i], xn[q / k]) for the T pairs q of
// the tile, row i: gate and up are one accumulator set each (R = 2: gate, up).
template <int T>
__device__ __forceinline__ void gate_up_few_row(const u16* __restrict__ gate,
                                                const u16* __restrict__ up, long e, int i,
                                                int rows, int cols, const int (&q)[TILE_TOKENS],
                                                int count, int k, const float* __restrict__ xn,
                                                float* __restrict__ act, int p) {
    const long row = (e * rows + i) * (long)cols;
    const u16* w[2] = {gate + row, up + row};
    const float* x[T];
#pragma unroll
    for (int t = 0; t < T; t++) x[t] = xn + (long)(q[t] / k) * cols;
    float acc[2][T][8];
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int t = 0; t < T; t++) zero8(acc[r][t]);
    for (int c0 = 0; (c0 << 8) < cols; c0 += FEW_GROUP) few_group<2, T, FEW_GROUP>(acc, w, x, c0, cols, p);
#pragma unroll
    for (int t = 0; t < T; t++) {
        const float g = warp_tree_fast(acc[0][t]);
        const float u = warp_tree_fast(acc[1][t]);
        if (p == 0 && t < count) act[(long)q[t] * rows + i] = __fmul_rn(det_silu(g), u);
    }
}

// gate_up_tile_bf16's function for moe_group's tiles of few pairs. grid (tiles, ceil(rows / 8)),
// block 256: warp w of block (x, y) computes row 8y + w of tile x's pairs.
extern "C" __global__ void __launch_bounds__(256) gate_up_few_bf16(
    const u16* __restrict__ gate, const u16* __restrict__ up, int rows, int cols,
    const u32* __restrict__ order, const u32* __restrict__ tiles, const u32* __restrict__ n_tiles,
    int n_pairs, int k, const float* __restrict__ xn, float* __restrict__ act) {
    const int p = threadIdx.x & 31;
    const int i = blockIdx.y * 8 + (threadIdx.x >> 5);
    long e;
    int q[TILE_TOKENS];
    int count;
    if (!tile_pairs(order, tiles, n_tiles, n_pairs, e, q, count) || i >= rows) return;
    if (count == 1) {
        gate_up_few_row<1>(gate, up, e, i, rows, cols, q, count, k, xn, act, p);
    } else if (count == 2) {
        gate_up_few_row<2>(gate, up, e, i, rows, cols, q, count, k, xn, act, p);
    } else {
        gate_up_few_row<4>(gate, up, e, i, rows, cols, q, count, k, xn, act, p);
    }
}

// y[q][r] = dot(down_e[r], act[q]) for rows r0 .. r0+R-1 (those below hidden) and the T pairs q.
template <int R, int T>
__device__ __forceinline__ void down_few_rows(const u16* __restrict__ down, long e, int r0,
                                              int hidden, int width, const int (&q)[TILE_TOKENS],
                                              int count, const float* __restrict__ act,
                                              float* __restrict__ y, int p) {
    const u16* w[R];
#pragma unroll
    for (int r = 0; r < R; r++) w[r] = down + (e * hidden + min(r0 + r, hidden - 1)) * (long)width;
    const float* x[T];
#pragma unroll
    for (int t = 0; t < T; t++) x[t] = act + (long)q[t] * width;
    float acc[R][T][8];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < T; t++) zero8(acc[r][t]);
    for (int c0 = 0; (c0 << 8) < width; c0 += FEW_DOWN_GROUP) {
        few_group<R, T, FEW_DOWN_GROUP>(acc, w, x, c0, width, p);
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < T; t++) {
            const float v = warp_tree_fast(acc[r][t]);
            if (p == 0 && r0 + r < hidden && t < count) y[(long)q[t] * hidden + r0 + r] = v;
        }
}

// down_tile's function for moe_group's tiles of few pairs (unmixed; moe_mix mixes).
// grid (tiles, ceil(hidden / (8 * FEW_DOWN_ROWS))), block 256: warp w of block (x, y) computes
// rows (8y + w) * FEW_DOWN_ROWS .. + FEW_DOWN_ROWS - 1 of tile x's pairs (with 4 pairs, in two
// halves of 2 rows: the accumulators of 4 x 4 outputs would not stay in registers).
extern "C" __global__ void __launch_bounds__(256) down_few(
    const u16* __restrict__ down, int hidden, int width, const u32* __restrict__ order,
    const u32* __restrict__ tiles, const u32* __restrict__ n_tiles, const float* __restrict__ act,
    float* __restrict__ y) {
    const int p = threadIdx.x & 31;
    const int r0 = (blockIdx.y * 8 + (threadIdx.x >> 5)) * FEW_DOWN_ROWS;
    long e;
    int q[TILE_TOKENS];
    int count;
    if (!tile_pairs(order, tiles, n_tiles, 0, e, q, count) || r0 >= hidden) return;
    if (count == 1) {
        down_few_rows<FEW_DOWN_ROWS, 1>(down, e, r0, hidden, width, q, count, act, y, p);
    } else if (count == 2) {
        down_few_rows<FEW_DOWN_ROWS, 2>(down, e, r0, hidden, width, q, count, act, y, p);
    } else {
        down_few_rows<FEW_DOWN_ROWS / 2, 4>(down, e, r0, hidden, width, q, count, act, y, p);
        down_few_rows<FEW_DOWN_ROWS / 2, 4>(down, e, r0 + FEW_DOWN_ROWS / 2, hidden, width, q,
                                             count, act, y, p);
    }
}

// matvec.cu's function for a step of 2 to 8 tokens (the dense products of batched decode and of
// a draft's verification), under --cuda-many few: mm_tile's 4 x 4 tiles with one chunk in
// flight become a warp per row holding all T >= tokens columns (T = 2, 4 or 8; columns past
// `tokens` repeat the last token and are not written) with FEW_GROUP chunks of the row in
// flight. out[t][r] = (out[t][r] +) dot(W[r], x[t]) (+ bias[r]), the same operations as
// mm_tile_body in the same order. grid (1, ceil(rows / 8)), block 256.
template <int T>
__device__ __forceinline__ void mm_few_row(const u16* __restrict__ w, int r, int cols,
                                           const float* __restrict__ x, long x_stride, int tokens,
                                           const float* __restrict__ bias, float* out,
                                           long out_stride, int mode, int p) {
    const u16* wr[1] = {w + (long)r * cols};
    const float* xr[T];
#pragma unroll
    for (int t = 0; t < T; t++) xr[t] = x + (long)min(t, tokens - 1) * x_stride;
    float acc[1][T][8];
#pragma unroll
    for (int t = 0; t < T; t++) zero8(acc[0][t]);
    for (int c0 = 0; (c0 << 8) < cols; c0 += FEW_GROUP) few_group<1, T, FEW_GROUP>(acc, wr, xr, c0, cols, p);
#pragma unroll
    for (int t = 0; t < T; t++) {
        float y = warp_tree_fast(acc[0][t]);
        if (p == 0 && t < tokens) {
            if (bias != nullptr) y = __fadd_rn(y, bias[r]);
            float* o = out + (long)t * out_stride + r;
            *o = (mode == 1) ? __fadd_rn(*o, y) : y;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) mm_few_bf16(
    const u16* __restrict__ w, int rows, int cols, const float* __restrict__ x, long x_stride,
    int tokens, const float* __restrict__ bias, float* out, long out_stride, int mode) {
    const int p = threadIdx.x & 31;
    const int r = blockIdx.y * 8 + (threadIdx.x >> 5);
    if (r >= rows) return;  // a whole warp leaves together
    if (tokens <= 2) {
        mm_few_row<2>(w, r, cols, x, x_stride, tokens, bias, out, out_stride, mode, p);
    } else if (tokens <= 4) {
        mm_few_row<4>(w, r, cols, x, x_stride, tokens, bias, out, out_stride, mode, p);
    } else {
        mm_few_row<8>(w, r, cols, x, x_stride, tokens, bias, out, out_stride, mode, p);
    }
}
