// Lane-sequential products for steps of many tokens (prefill): compute-bound tiles of 32 rows x
// 16 tokens whose every output is still the canonical 256-lane reduction of
// docs/EXACTNESS.md section 4 (tarfa-cuda/src/ops.rs `matmul`, `gate_up_tile`, `down_tile`).
//
// Why a second family beside tile.cu: there a warp holds all 8 of its lanes of every output at
// once (thread p: lanes 8p..8p+7), so 4 x 4 outputs fill 128 registers and each weight or
// activation a thread loads serves at most 4 FMAs: the product is bound by loads, not by the FMA
// units. Here the lanes of an output are split by residue over the block's 16 warps, and each
// thread walks its 16 lanes ONE AFTER ANOTHER, folding them into the fixed tree as it goes:
//
//   lane v = w + 16 m   (w = warp 0..15, m = leaf 0..15), terms n = v, v+256, v+512, ... < K
//   tree levels 128, 64, 32, 16 pair leaves m and m+8, m+4, m+2, m+1: inside the thread;
//   levels 8, 4, 2, 1 pair warps w and w+8, w+4, w+2, w+1: across warps, through shared memory.
//
// A thread visits its leaves in bit-reversed order (m = 0, 8, 4, 12, 2, ...), so each completed
// pair is added at once and only a binary counter's worth of partial sums stays live (a stack
// of 4 sets of 4 x 4 outputs, plus the leaf being accumulated: 80 registers). All 32 threads of
// a warp work on the same lane at the same time, each on its own 4 rows x 4 tokens, so a warp's
// shared-memory reads of a weight or an activation are broadcasts: 2 wavefronts per 16 FMAs.
//
// Each leaf's chain (lane v over the chunks c = 0, 1, ... in increasing order) is fed from
// shared memory in c-blocks of LS_CB chunks; a stage holds, for one leaf and one c-block, the
// 16 columns 256c + 16m + [0, 16) of the block's 32 weight rows (widened to f32, stored
// column-major so a thread's 4 rows are one 16-byte load) and of its 16 token rows. Stages are
// double-buffered: the next stage's global loads are in flight while this one computes.
//
// What must not change does not: every output's lanes are accumulated term by term in
// increasing n with one fmaf each (lane v's chain stops at its last term < K: nothing is added
// past the end, as in common.cuh's warp_acc), and the tree adds exactly the pairs a[v] + a[v+h],
// h = 128 .. 1, level by level. Rows or tokens past the end are computed on the last valid
// one and never written. So each output has the bits of matvec.cu's, gate_up's and down_mix's.
#include "common.cuh"

#define LS_THREADS 512
#define LS_BR 32  // rows per block
#define LS_BT 16  // tokens (routed pairs, query rows) per block
#define LS_CB 8   // 256-element chunks per stage
#define LS_XP 20  // floats per X stage row: 16 tokens + 4 (conflict-free transposed stores)
#define LS_WS (LS_CB * 16 * LS_BR)
#define LS_XS (LS_CB * 16 * LS_XP)
#define LS_STAGE (LS_WS + LS_XS)  // floats per stage buffer (26,624 bytes)
// dynamic shared memory: two stage buffers; the cross-warp partials (16 x 512 floats) reuse them
#define LS_SMEM_BYTES (2 * LS_STAGE * 4)

__device__ __forceinline__ int ls_bitrev4(int s) {
    return ((s & 1) << 3) | ((s & 2) << 1) | ((s & 4) >> 1) | ((s & 8) >> 3);
}

// Registers in flight for the next stage: one 16-byte weight load (8 BF16, or the first 4 of 8
// F32 with a second load) and one 16-byte activation load per thread (LS_CB = 8: 64 * LS_CB =
// 512 of each per block).
template <typename W>
struct LsRegs;

template <>
struct LsRegs<u16> {
    uint4 w;
    float4 x;
    bool wv, xv;
};

template <>
struct LsRegs<float> {
    uint4 w0, w1;
    float4 x;
    bool wv, xv;
};

// Which rows a block's 32 stage rows are, and where each of its 16 token rows starts.
// kind 0: rows r0 .. r0+31 of one matrix (clamped to the last row).
// kind 1: SwiGLU: rows i0 .. i0+15 of `w` (gate) then the same rows of `w2` (up).
struct LsRows {
    const void* w;
    const void* w2;
    long row0;  // first row (expert offset included)
    int rows;   // valid rows of the matrix (for clamping), counted from the expert's first
    int r0;     // the block's first row
    int kind;
};

template <typename W>
__device__ __forceinline__ const W* ls_row_ptr(const LsRows& rs, int r, int cols) {
    const W* base;
    int local;
    if (rs.kind == 0) {
        base = reinterpret_cast<const W*>(rs.w);
        local = rs.r0 + r;
    } else {
        base = reinterpret_cast<const W*>(r < 16 ? rs.w : rs.w2);
        local = rs.r0 + (r & 15);
    }
    local = min(local, rs.rows - 1);
    return base + (rs.row0 + local) * (long)cols;
}

// What a thread loads of every stage, fixed for the whole reduction: thread i = (c, h, r) loads
// row r's h-th 8 of the stage's 16 columns of chunk c, and i = (c, q, t) token t's q-th 4.
// Stage (leaf m, c-block b) adds 256 * LS_CB * b + 16 m to both columns.
template <typename W>
struct LsLoads {
    const W* wrow;    // the thread's weight row
    const float* xrow;  // the thread's token row
    int wcol, xcol;   // the columns within a stage: 256 c + 8 h, and 256 c + 4 q
};

template <typename W>
__device__ __forceinline__ LsLoads<W> ls_loads(const LsRows& rs, int cols,
                                               const float* const* x_rows) {
    const int i = threadIdx.x;
    LsLoads<W> l;
    l.wrow = ls_row_ptr<W>(rs, i & 31, cols);
    l.wcol = 256 * (i >> 6) + 8 * ((i >> 5) & 1);
    l.xrow = x_rows[i & 15];
    l.xcol = 256 * (i >> 6) + 4 * ((i >> 4) & 3);
    return l;
}

// Issues the global loads of stage (leaf m, c-block b) into registers.
template <typename W>
__device__ __forceinline__ void ls_load(LsRegs<W>& g, const LsLoads<W>& l, int cols, int m,
                                        int b) {
    const int at = 256 * LS_CB * b + 16 * m;
    const int wc = at + l.wcol, xc = at + l.xcol;
    g.wv = wc < cols;
    if (g.wv) {
        const W* p = l.wrow + wc;
        if constexpr (sizeof(W) == 2) {
            g.w = __ldg(reinterpret_cast<const uint4*>(p));
        } else {
            g.w0 = __ldg(reinterpret_cast<const uint4*>(p));
            g.w1 = __ldg(reinterpret_cast<const uint4*>(p) + 1);
        }
    }
    g.xv = xc < cols;
    if (g.xv) g.x = __ldg(reinterpret_cast<const float4*>(l.xrow + xc));
}

// Stores the registers of a stage into a buffer, transposed: Ws[c][col][row], Xs[c][col][token].
template <typename W>
__device__ __forceinline__ void ls_store(const LsRegs<W>& g, float* buf) {
    const int i = threadIdx.x;
    if (g.wv) {
        const int r = i & 31, h = (i >> 5) & 1, c = i >> 6;
        float* ws = buf + (c * 16 + 8 * h) * LS_BR + r;
        if constexpr (sizeof(W) == 2) {
            ws[0 * LS_BR] = bf16_lo(g.w.x);
            ws[1 * LS_BR] = bf16_hi(g.w.x);
            ws[2 * LS_BR] = bf16_lo(g.w.y);
            ws[3 * LS_BR] = bf16_hi(g.w.y);
            ws[4 * LS_BR] = bf16_lo(g.w.z);
            ws[5 * LS_BR] = bf16_hi(g.w.z);
            ws[6 * LS_BR] = bf16_lo(g.w.w);
            ws[7 * LS_BR] = bf16_hi(g.w.w);
        } else {
            ws[0 * LS_BR] = __uint_as_float(g.w0.x);
            ws[1 * LS_BR] = __uint_as_float(g.w0.y);
            ws[2 * LS_BR] = __uint_as_float(g.w0.z);
            ws[3 * LS_BR] = __uint_as_float(g.w0.w);
            ws[4 * LS_BR] = __uint_as_float(g.w1.x);
            ws[5 * LS_BR] = __uint_as_float(g.w1.y);
            ws[6 * LS_BR] = __uint_as_float(g.w1.z);
            ws[7 * LS_BR] = __uint_as_float(g.w1.w);
        }
    }
    if (g.xv) {
        const int t = i & 15, q = (i >> 4) & 3, c = i >> 6;
        float* xs = buf + LS_WS + (c * 16 + 4 * q) * LS_XP + t;
        xs[0 * LS_XP] = g.x.x;
        xs[1 * LS_XP] = g.x.y;
        xs[2 * LS_XP] = g.x.z;
        xs[3 * LS_XP] = g.x.w;
    }
}

// leaf[i][j] += terms of chunks [0, nc) of the buffer for this thread's lane (column w of each
// chunk), rows 4rg+i, tokens 4tg+j: one fmaf per term, chunks in increasing order.
__device__ __forceinline__ void ls_chunk(float (&leaf)[4][4], const float* wp, const float* xp) {
    const float4 wv = *reinterpret_cast<const float4*>(wp);
    const float4 xv = *reinterpret_cast<const float4*>(xp);
    const float wa[4] = {wv.x, wv.y, wv.z, wv.w};
    const float xa[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) leaf[i][j] = fmaf(wa[i], xa[j], leaf[i][j]);
}

__device__ __forceinline__ void ls_compute(float (&leaf)[4][4], const float* buf, int nc, int w,
                                           int rg, int tg) {
    const float* wp = buf + w * LS_BR + 4 * rg;
    const float* xp = buf + LS_WS + w * LS_XP + 4 * tg;
    if (nc == LS_CB) {  // a whole stage: no loop
#pragma unroll
        for (int c = 0; c < LS_CB; c++) ls_chunk(leaf, wp + c * 16 * LS_BR, xp + c * 16 * LS_XP);
        return;
    }
    for (int c = 0; c < nc; c++) {
        const float4 wv = *reinterpret_cast<const float4*>(wp + c * 16 * LS_BR);
        const float4 xv = *reinterpret_cast<const float4*>(xp + c * 16 * LS_XP);
        const float wa[4] = {wv.x, wv.y, wv.z, wv.w};
        const float xa[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) leaf[i][j] = fmaf(wa[i], xa[j], leaf[i][j]);
    }
}

__device__ __forceinline__ void ls_add(float (&dst)[4][4], const float (&a)[4][4]) {
    // dst = a + dst: a is the earlier (lower-lane) subtree; addition commutes, the pairs are fixed
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) dst[i][j] = __fadd_rn(a[i][j], dst[i][j]);
}

__device__ __forceinline__ void ls_copy(float (&dst)[4][4], const float (&a)[4][4]) {
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) dst[i][j] = a[i][j];
}

// The block's whole reduction over a stage policy P (the GEMM's LsGemm, attention's LsPv):
//   P::load(m, b)       issue the global loads of stage (leaf m, c-block b) into registers
//   P::store(buf)       store them into a stage buffer (Ws[c][col][row], Xs[c][col][token])
//   P::compute(leaf, buf, b, v, nc)  lane v's terms of chunks b*LS_CB + [0, nc)
//   P::len              the reduction's length (terms n < len)
// Every thread ends with the level-16 subtree T(w) of its 4 x 4 outputs in `out`. Ends with a
// barrier (the stage buffers are free).
template <class P>
__device__ __forceinline__ void ls_reduce(float (&out)[4][4], P& pol, float* smem) {
    const int w = threadIdx.x >> 5;
    const int chunks = (pol.len + 255) / 256;
    const int nb = (chunks + LS_CB - 1) / LS_CB;
    float st0[4][4], st1[4][4], st2[4][4], st3[4][4], leaf[4][4];
    pol.load(0, 0);
    pol.store(smem);
    __syncthreads();
    int stage = 0;
#pragma unroll
    for (int s = 0; s < 16; s++) {
        const int m = ls_bitrev4(s);
        const int v = w + 16 * m;  // this warp's lane
        // lane v's chain: the chunks c with 256c + v < len
        const int chain = pol.len > v ? (pol.len - v + 255) / 256 : 0;
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) leaf[i][j] = 0.0f;
        for (int b = 0; b < nb; b++, stage++) {
            const bool more = b + 1 < nb || s + 1 < 16;
            if (more) pol.load(b + 1 < nb ? m : ls_bitrev4(s + 1), b + 1 < nb ? b + 1 : 0);
            const int nc = min(LS_CB, chain - b * LS_CB);
            pol.compute(leaf, smem + (stage & 1) * LS_STAGE, b, v, nc);
            if (more) pol.store(smem + ((stage + 1) & 1) * LS_STAGE);
            __syncthreads();
        }
        // fold the leaf into the stack (a binary counter over s; s is a compile-time constant)
        if (s & 1) {
            ls_add(leaf, st0);
            if (s & 2) {
                ls_add(leaf, st1);
                if (s & 4) {
                    ls_add(leaf, st2);
                    if (s & 8) {
                        ls_add(leaf, st3);
                        ls_copy(out, leaf);
                    } else {
                        ls_copy(st3, leaf);
                    }
                } else {
                    ls_copy(st2, leaf);
                }
            } else {
                ls_copy(st1, leaf);
            }
        } else {
            ls_copy(st0, leaf);
        }
    }
}

// The products' stage policy: 32 weight rows (LsRows) x 16 token rows (x_rows), K = len.
template <typename W>
struct LsGemm {
    LsLoads<W> l;
    int len;
    LsRegs<W> g;
    __device__ __forceinline__ LsGemm(const LsRows& rs, int cols, const float* const* x_rows)
        : l(ls_loads<W>(rs, cols, x_rows)), len(cols) {}
    __device__ __forceinline__ void load(int m, int b) { ls_load<W>(g, l, len, m, b); }
    __device__ __forceinline__ void store(float* buf) const { ls_store<W>(g, buf); }
    __device__ __forceinline__ void compute(float (&leaf)[4][4], const float* buf, int, int,
                                            int nc) const {
        const int p = threadIdx.x & 31;
        ls_compute(leaf, buf, nc, threadIdx.x >> 5, p & 7, p >> 3);
    }
};

// Writes this thread's T(w) values to part[w][token][row] (16 x 512 floats over the stage
// buffers, after ls_reduce's last barrier), then barriers.
__device__ __forceinline__ void ls_publish(const float (&t)[4][4], float* part) {
    const int tid = threadIdx.x;
    const int w = tid >> 5, p = tid & 31, rg = p & 7, tg = p >> 3;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float4 v;
        v.x = t[0][j];
        v.y = t[1][j];
        v.z = t[2][j];
        v.w = t[3][j];
        *reinterpret_cast<float4*>(part + w * 512 + (4 * tg + j) * LS_BR + 4 * rg) = v;
    }
    __syncthreads();
}

// Levels 8, 4, 2, 1 of output `o` (= token * 32 + row) from the 16 warps' subtrees.
__device__ __forceinline__ float ls_finish(const float* part, int o) {
    const float* p = part + o;
    // level 8: warps w and w + 8
    const float a0 = __fadd_rn(p[0 * 512], p[8 * 512]), a1 = __fadd_rn(p[1 * 512], p[9 * 512]);
    const float a2 = __fadd_rn(p[2 * 512], p[10 * 512]), a3 = __fadd_rn(p[3 * 512], p[11 * 512]);
    const float a4 = __fadd_rn(p[4 * 512], p[12 * 512]), a5 = __fadd_rn(p[5 * 512], p[13 * 512]);
    const float a6 = __fadd_rn(p[6 * 512], p[14 * 512]), a7 = __fadd_rn(p[7 * 512], p[15 * 512]);
    // levels 4, 2, 1
    const float b0 = __fadd_rn(a0, a4), b1 = __fadd_rn(a1, a5);
    const float b2 = __fadd_rn(a2, a6), b3 = __fadd_rn(a3, a7);
    return __fadd_rn(__fadd_rn(b0, b2), __fadd_rn(b1, b3));
}

// out[t][r] = (out[t][r] +) dot(W[r], x[t]) (+ bias[r]): matvec.cu's function.
// grid (ceil(tokens / 16), ceil(rows / 32)), block 512, LS_SMEM_BYTES of dynamic shared memory.
// Token tiles are the fast grid dimension: the blocks reading the same rows run together.
template <typename W>
__device__ __forceinline__ void ls_mm_body(const W* __restrict__ w, int rows, int cols,
                                           const float* __restrict__ x, long x_stride, int tokens,
                                           const float* __restrict__ bias, float* out,
                                           long out_stride, int mode) {
    TARFA_DYN_SMEM(float, smem);
    __shared__ const float* x_rows[LS_BT];
    const int t0 = blockIdx.x * LS_BT;
    const int r0 = blockIdx.y * LS_BR;
    if (threadIdx.x < LS_BT) {
        x_rows[threadIdx.x] = x + (long)min(t0 + (int)threadIdx.x, tokens - 1) * x_stride;
    }
    __syncthreads();
    LsGemm<W> pol(LsRows{w, nullptr, 0, rows, r0, 0}, cols, x_rows);
    float t[4][4];
    ls_reduce(t, pol, smem);
    ls_publish(t, smem);
    const int o = threadIdx.x;
    const int r = r0 + (o & 31), tk = t0 + (o >> 5);
    float y = ls_finish(smem, o);
    if (r < rows && tk < tokens) {
        if (bias != nullptr) y = __fadd_rn(y, bias[r]);
        float* d = out + (long)tk * out_stride + r;
        *d = (mode == 1) ? __fadd_rn(*d, y) : y;
    }
}

extern "C" __global__ void __launch_bounds__(LS_THREADS, 1) ls_mm_bf16(
    const u16* __restrict__ w, int rows, int cols, const float* __restrict__ x, long x_stride,
    int tokens, const float* __restrict__ bias, float* out, long out_stride, int mode) {
    ls_mm_body<u16>(w, rows, cols, x, x_stride, tokens, bias, out, out_stride, mode);
}

extern "C" __global__ void __launch_bounds__(LS_THREADS, 1) ls_mm_f32(
    const float* __restrict__ w, int rows, int cols, const float* __restrict__ x, long x_stride,
    int tokens, const float* __restrict__ bias, float* out, long out_stride, int mode) {
    ls_mm_body<float>(w, rows, cols, x, x_stride, tokens, bias, out, out_stride, mode);
}

// The pairs of block column blockIdx.x (tile.cu's tile_pairs for tiles of LS_BT): grouped
// (order != null), tile blockIdx.x of moe_group's list made with tiles of LS_BT (blocks past
// *n_tiles leave); dense (order == null): tokens blockIdx.x*LS_BT.. of n_pairs, expert 0. Fills
// q[] (the tile's pairs, the last repeated past `count`) in shared memory; returns false when
// the block has nothing to do. Every thread calls it; it ends with a barrier.
__device__ __forceinline__ bool ls_tile_pairs(const u32* __restrict__ order,
                                              const u32* __restrict__ tiles,
                                              const u32* __restrict__ n_tiles, int n_pairs,
                                              long& expert, int* q, int& count) {
    int start;
    if (order != nullptr) {
        const u32 b = blockIdx.x;
        if (b >= *n_tiles) return false;
        expert = tiles[3 * b];
        start = (int)tiles[3 * b + 1];
        count = (int)tiles[3 * b + 2];
    } else {
        expert = 0;
        start = blockIdx.x * LS_BT;
        count = min(LS_BT, n_pairs - start);
    }
    if (threadIdx.x < LS_BT) {
        const int i = start + min((int)threadIdx.x, count - 1);
        q[threadIdx.x] = order != nullptr ? (int)order[i] : i;
    }
    __syncthreads();
    return true;
}

// act[q][i] = silu(dot(gate_e[i], xn[q / k])) * dot(up_e[i], xn[q / k]) for the pairs q of a
// tile (gate_up_bf16's function; a dense MLP: order null, k = 1, e = 0). gate/up stacked
// [E][rows][cols]. grid (tiles, ceil(rows / 16)), block 512, LS_SMEM_BYTES.
template <typename W>
__device__ __forceinline__ void ls_gate_up_body(const W* __restrict__ gate,
                                                const W* __restrict__ up, int rows, int cols,
                                                const u32* __restrict__ order,
                                                const u32* __restrict__ tiles,
                                                const u32* __restrict__ n_tiles, int n_pairs,
                                                int k, const float* __restrict__ xn,
                                                float* __restrict__ act) {
    TARFA_DYN_SMEM(float, smem);
    __shared__ const float* x_rows[LS_BT];
    __shared__ int q[LS_BT];
    long e;
    int count;
    if (!ls_tile_pairs(order, tiles, n_tiles, n_pairs, e, q, count)) return;
    if (threadIdx.x < LS_BT) x_rows[threadIdx.x] = xn + (long)(q[threadIdx.x] / k) * cols;
    __syncthreads();
    const int i0 = blockIdx.y * 16;
    LsGemm<W> pol(LsRows{gate, up, e * rows, rows, i0, 1}, cols, x_rows);
    float t[4][4];
    ls_reduce(t, pol, smem);
    ls_publish(t, smem);
    const int o = threadIdx.x;
    if (o < 256) {
        const int il = o & 15, u = o >> 4;  // stage rows il (gate) and 16 + il (up), token u
        const float g = ls_finish(smem, u * LS_BR + il);
        const float uu = ls_finish(smem, u * LS_BR + 16 + il);
        if (i0 + il < rows && u < count) {
            act[(long)q[u] * rows + i0 + il] = __fmul_rn(det_silu(g), uu);
        }
    }
}

extern "C" __global__ void __launch_bounds__(LS_THREADS, 1) ls_gate_up_bf16(
    const u16* __restrict__ gate, const u16* __restrict__ up, int rows, int cols,
    const u32* __restrict__ order, const u32* __restrict__ tiles, const u32* __restrict__ n_tiles,
    int n_pairs, int k, const float* __restrict__ xn, float* __restrict__ act) {
    ls_gate_up_body<u16>(gate, up, rows, cols, order, tiles, n_tiles, n_pairs, k, xn, act);
}

extern "C" __global__ void __launch_bounds__(LS_THREADS, 1) ls_gate_up_f32(
    const float* __restrict__ gate, const float* __restrict__ up, int rows, int cols,
    const u32* __restrict__ order, const u32* __restrict__ tiles, const u32* __restrict__ n_tiles,
    int n_pairs, int k, const float* __restrict__ xn, float* __restrict__ act) {
    ls_gate_up_body<float>(gate, up, rows, cols, order, tiles, n_tiles, n_pairs, k, xn, act);
}

// y[q][r] = dot(down_e[r], act[q]) for the pairs q of a tile of moe_group's list made with tiles
// of LS_BT (down_slots' function, unmixed; moe_mix then mixes). down stacked [E][hidden][width]
// (BF16). grid (tiles, ceil(hidden / 32)), block 512, LS_SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(LS_THREADS, 1) ls_down_bf16(
    const u16* __restrict__ down, int hidden, int width, const u32* __restrict__ order,
    const u32* __restrict__ tiles, const u32* __restrict__ n_tiles, const float* __restrict__ act,
    float* __restrict__ y) {
    TARFA_DYN_SMEM(float, smem);
    __shared__ const float* x_rows[LS_BT];
    __shared__ int q[LS_BT];
    long e;
    int count;
    if (!ls_tile_pairs(order, tiles, n_tiles, 0, e, q, count)) return;
    if (threadIdx.x < LS_BT) x_rows[threadIdx.x] = act + (long)q[threadIdx.x] * width;
    __syncthreads();
    const int r0 = blockIdx.y * LS_BR;
    LsGemm<u16> pol(LsRows{down, nullptr, e * hidden, hidden, r0, 0}, width, x_rows);
    float t[4][4];
    ls_reduce(t, pol, smem);
    ls_publish(t, smem);
    const int o = threadIdx.x;
    const int r = r0 + (o & 31), u = o >> 5;
    const float v = ls_finish(smem, o);
    if (r < hidden && u < count) y[(long)q[u] * hidden + r] = v;
}

// ---------------------------------------------------------------------------------------------
// Prefill attention: attention.cu's function (cpu/forward.rs `gqa_block`) for layers whose
// queries see every position 0..=P of their sequence (no window, no chunk), over query tiles of
// AT_ROWS rows that share a KV head: QT = AT_ROWS / G consecutive tokens of one sequence x the G
// query heads of the group. Three kernels, each with the reference's order:
//   attn_scores_dX  s_j = dot(q, k_j) * scale for every row and key j <= P, into
//                   scratch[(tile, kv head)][j][row], and each row's maximum m (NaN ignored)
//   attn_softmax    per row: e_j = exp(s_j - m) (gpt-oss's sink one more term, index n),
//                   S = canonical_sum(e), p_j = e_j / S in place
//   attn_pv         o[d] = canonical dot over j of (p_j, v_j[d]): the lane-sequential product
//                   above with V's rows as the weights and the tile's p rows as the tokens
// A tile's keys and values are read once for its G heads and QT positions (the per-(token,
// head) kernel read them once per row). The scores' dot is over D <= 128 lanes: the canonical
// tree's level 128 adds +0.0 to every lane, which changes nothing but a zero's sign, so the
// tree is computed over the D lanes and +0.0 added once to its result (EXACTNESS section 4,
// "Pruning").
#define AT_ROWS 64  // query rows per tile
#define AT_KT 16    // keys per stage of the scores
#define AT_QS 72    // floats per Qs row (64 rows + 8: conflict-free quad reads)
#define AT_KS 20    // floats per Ks row (16 keys + 4: conflict-free transposed stores)

// Token t's cache and position: from the step's per-token tables (tok: cos, sin, position,
// capacity; kv: this layer's keys, values tables per token) when `tok` is set, else one
// sequence's. kc, vc: the layer's paged keys and values (common.cuh `kv_row`). The kernels'
// `cap` argument (and the tables' capacity) bounds nothing here since the cache is paged: the
// reference (tarfa-cuda/src/mock.rs) checks positions against it.
struct AttnTok {
    const u64* kc;
    const u64* vc;
    int pos;
};

__device__ __forceinline__ AttnTok attn_tok(const u64* tok, const u64* kv, const u64* kc,
                                            const u64* vc, int pos0, int t) {
    if (tok != nullptr) {
        return {reinterpret_cast<const u64*>(kv[2 * t]),
                reinterpret_cast<const u64*>(kv[2 * t + 1]), (int)tok[4 * t + 2]};
    }
    return {kc, vc, pos0 + t};
}

// A tile of query rows: its tokens t_first .. t_first+count-1 (one sequence, consecutive
// positions), and row r's token and position (-1 past the tile's tokens).
struct AttnTile {
    int t_first, count, hg;
    AttnTok src;   // the tile's sequence (its first token's)
    int p_last;    // the last token's position
};

__device__ __forceinline__ AttnTile attn_tile(const u32* qtiles, int hq, int hkv, const u64* tok,
                                              const u64* kv, const u64* kc, const u64* vc,
                                              int pos0, int b) {
    AttnTile a;
    a.t_first = (int)qtiles[2 * b];
    a.count = (int)qtiles[2 * b + 1];
    a.hg = hq / hkv;
    a.src = attn_tok(tok, kv, kc, vc, pos0, a.t_first);
    a.p_last = attn_tok(tok, kv, kc, vc, pos0, a.t_first + a.count - 1).pos;
    return a;
}

__device__ __forceinline__ int attn_row_pos(const AttnTile& a, const u64* tok, const u64* kv,
                                            const u64* kc, const u64* vc, int pos0, int r) {
    const int tl = r / a.hg;
    return tl < a.count ? attn_tok(tok, kv, kc, vc, pos0, a.t_first + tl).pos : -1;
}

template <int L>
__device__ __forceinline__ int bitrev_n(int s) {
    int r = 0;
#pragma unroll
    for (int b = 1; b < L; b <<= 1) {
        r = (r << 1) | (s & 1);
        s >>= 1;
    }
    return r;
}

// Scores of a tile. grid (tiles, Hkv), block 256, dynamic shared memory
// (D * AT_QS + 2 * D * AT_KS) floats. Thread: quad = tid / 4 holds rows 4rg..4rg+3 (rg = quad
// / 4) x keys 4kg..4kg+3 (kg = quad % 4) of each key stage; its 4 threads split the lanes d by
// residue (d = qq + 4i): tree levels D/2 .. 4 inside the thread (leaves in bit-reversed order),
// levels 2 and 1 across the quad (shuffles, recursive halving: thread qq keeps row 4rg + qq).
template <int D>
__device__ __forceinline__ void attn_scores_body(const float* __restrict__ q, int hq, int hkv,
                                                 const u32* __restrict__ qtiles,
                                                 const u64* __restrict__ tok,
                                                 const u64* __restrict__ kv,
                                                 const u64* __restrict__ kc,
                                                 const u64* __restrict__ vc, int pos0,
                                                 float scale, float* __restrict__ sc,
                                                 int n_stride, float* __restrict__ mbuf) {
    constexpr int L = D / 4;  // leaves per thread
    TARFA_DYN_SMEM(float, smem);
    float* qs = smem;                  // [D][AT_QS]: Q rows transposed
    float* ks = smem + D * AT_QS;      // 2 x [D][AT_KS]: a stage of 16 keys, transposed
    __shared__ float mx[4][AT_ROWS];
    __shared__ int rpos[AT_ROWS];
    const int tid = threadIdx.x;
    const int b = blockIdx.x, g = blockIdx.y;
    const AttnTile a = attn_tile(qtiles, hq, hkv, tok, kv, kc, vc, pos0, b);
    if (tid < AT_ROWS) rpos[tid] = attn_row_pos(a, tok, kv, kc, vc, pos0, tid);
    for (int i = tid; i < AT_ROWS * L; i += 256) {
        const int r = i % AT_ROWS, d4 = i / AT_ROWS;
        const int tl = min(r / a.hg, a.count - 1), hl = r % a.hg;
        const float4 v = *reinterpret_cast<const float4*>(
            q + ((long)(a.t_first + tl) * hq + g * a.hg + hl) * D + 4 * d4);
        qs[(4 * d4 + 0) * AT_QS + r] = v.x;
        qs[(4 * d4 + 1) * AT_QS + r] = v.y;
        qs[(4 * d4 + 2) * AT_QS + r] = v.z;
        qs[(4 * d4 + 3) * AT_QS + r] = v.w;
    }
    const int n_keys = a.p_last + 1;
    const u64* ktab = a.src.kc;
    // key stage loads: i = (d4, key), D / 4 x 16 float4, D / 16 per thread (at least one)
    constexpr int KL = (L * AT_KT + 255) / 256;
    float4 kr[KL];
    auto kload = [&](int j0) {
#pragma unroll
        for (int u = 0; u < KL; u++) {
            const int i = tid + 256 * u;
            if (i < L * AT_KT) {
                const int key = i % AT_KT, d4 = i / AT_KT;
                const int j = min(j0 + key, n_keys - 1);
                kr[u] = *reinterpret_cast<const float4*>(kv_row(ktab, g, j, D) + 4 * d4);
            }
        }
    };
    auto kstore = [&](float* kb) {
#pragma unroll
        for (int u = 0; u < KL; u++) {
            const int i = tid + 256 * u;
            if (i < L * AT_KT) {
                const int key = i % AT_KT, d4 = i / AT_KT;
                kb[(4 * d4 + 0) * AT_KS + key] = kr[u].x;
                kb[(4 * d4 + 1) * AT_KS + key] = kr[u].y;
                kb[(4 * d4 + 2) * AT_KS + key] = kr[u].z;
                kb[(4 * d4 + 3) * AT_KS + key] = kr[u].w;
            }
        }
    };
    const int quad = tid >> 2, qq = tid & 3, rg = quad >> 2, kg = quad & 3;
    const int row = 4 * rg + qq;  // the row this thread finishes
    float* out = sc + (long)(b * hkv + g) * n_stride * AT_ROWS;
    float m = f32_bits(0xff800000u);
    kload(0);
    kstore(ks);
    __syncthreads();
    const int my_pos = rpos[row];
    const int n_stages = (n_keys + AT_KT - 1) / AT_KT;
    for (int st = 0; st < n_stages; st++) {
        if (st + 1 < n_stages) kload((st + 1) * AT_KT);
        const float* kb = ks + (st & 1) * D * AT_KS;
        float stk[5][4][4], leaf[4][4];
#pragma unroll
        for (int s = 0; s < L; s++) {
            const int d = qq + 4 * bitrev_n<L>(s);
            const float4 qv = *reinterpret_cast<const float4*>(qs + d * AT_QS + 4 * rg);
            const float4 kv4 = *reinterpret_cast<const float4*>(kb + d * AT_KS + 4 * kg);
            const float qa[4] = {qv.x, qv.y, qv.z, qv.w};
            const float ka[4] = {kv4.x, kv4.y, kv4.z, kv4.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) leaf[i][j] = fmaf(qa[i], ka[j], 0.0f);
            // binary counter over s (compile-time): stk[k] holds a pending subtree of 2^k leaves
#pragma unroll
            for (int k = 0; k < 5; k++) {
                if ((1 << k) >= L) break;
                if (s & (1 << k)) {
                    ls_add(leaf, stk[k]);
                } else {
                    ls_copy(stk[k], leaf);
                    break;
                }
            }
        }
        // now leaf = the subtree over d = qq (mod 4) for rows 4rg.., keys 4kg..
        // level 2 (partner qq ^ 2): the lower keeps rows 0, 1, the upper rows 2, 3
        float h2[2][4];
        const bool lo2 = (qq & 2) == 0;
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float send = lo2 ? leaf[2 + i][j] : leaf[i][j];
                const float got = __shfl_xor_sync(TARFA_FULL_MASK, send, 2);
                h2[i][j] = __fadd_rn(lo2 ? leaf[i][j] : leaf[2 + i][j], got);
            }
        // level 1 (partner qq ^ 1): the lower keeps the first of its two rows
        const bool lo1 = (qq & 1) == 0;
        float s4[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float send = lo1 ? h2[1][j] : h2[0][j];
            const float got = __shfl_xor_sync(TARFA_FULL_MASK, send, 1);
            s4[j] = __fadd_rn(lo1 ? h2[0][j] : h2[1][j], got);
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int key = st * AT_KT + 4 * kg + j;
            if (key <= my_pos) {
                const float s = __fmul_rn(__fadd_rn(s4[j], 0.0f), scale);
                out[(long)key * AT_ROWS + row] = s;
                m = fmaxf(m, s);
            }
        }
        if (st + 1 < n_stages) kstore(ks + ((st + 1) & 1) * D * AT_KS);
        __syncthreads();
    }
    mx[kg][row] = m;
    __syncthreads();
    if (tid < AT_ROWS) {
        const float r = fmaxf(fmaxf(mx[0][tid], mx[1][tid]), fmaxf(mx[2][tid], mx[3][tid]));
        mbuf[(long)(b * hkv + g) * AT_ROWS + tid] = r;
    }
}

#define ATTN_SCORES(D)                                                                         \
    extern "C" __global__ void __launch_bounds__(256) attn_scores_d##D(                        \
        const float* __restrict__ q, int hq, int hkv, const u32* __restrict__ qtiles,          \
        const u64* __restrict__ tok, const u64* __restrict__ kv, const u64* __restrict__ kc, \
        const u64* __restrict__ vc, int cap, int pos0, float scale, float* __restrict__ sc,  \
        int n_stride, float* __restrict__ mbuf) {                                              \
        attn_scores_body<D>(q, hq, hkv, qtiles, tok, kv, kc, vc, pos0, scale, sc,              \
                            n_stride, mbuf);                                                   \
    }
ATTN_SCORES(8)
ATTN_SCORES(16)
ATTN_SCORES(32)
ATTN_SCORES(64)
ATTN_SCORES(128)

// Softmax of a tile's rows in place: grid (tiles, Hkv), block AT_ROWS (a thread per row).
// e_j = exp(s_j - m) with m the row's maximum over its scores and the sink (sinks: [Hq] or
// null; its score is the term after the last key), S = the canonical sum of the e_j (lane u =
// j mod 256 adds its terms in increasing j; the thread walks the lanes one after another in
// bit-reversed order and folds each into the tree), p_j = e_j / S.
extern "C" __global__ void __launch_bounds__(AT_ROWS) attn_softmax(
    int hq, int hkv, const u32* __restrict__ qtiles, const u64* __restrict__ tok,
    const u64* __restrict__ kv, const u64* __restrict__ kc, const u64* __restrict__ vc,
    int cap, int pos0, float* __restrict__ sc, int n_stride, const float* __restrict__ mbuf,
    const float* __restrict__ sinks) {
    const int b = blockIdx.x, g = blockIdx.y, r = threadIdx.x;
    const AttnTile a = attn_tile(qtiles, hq, hkv, tok, kv, kc, vc, pos0, b);
    const int pos = attn_row_pos(a, tok, kv, kc, vc, pos0, r);
    if (pos < 0) return;
    const int n = pos + 1;
    const int head = g * a.hg + r % a.hg;
    float m = mbuf[(long)(b * hkv + g) * AT_ROWS + r];
    const bool sink = sinks != nullptr;
    const float s_sink = sink ? sinks[head] : 0.0f;
    if (sink) m = fmaxf(m, s_sink);
    const int ns = sink ? n + 1 : n;
    float* col = sc + (long)(b * hkv + g) * n_stride * AT_ROWS + r;
    float o0 = 0.0f, o1 = 0.0f, o2 = 0.0f, o3 = 0.0f, total = 0.0f;
    for (int sh = 0; sh < 16; sh++) {
        float st[4];
        float v = 0.0f;
#pragma unroll
        for (int sl = 0; sl < 16; sl++) {
            const int u = 16 * ls_bitrev4(sl) + ls_bitrev4(sh);  // lane bitrev8(16 sh + sl)
            float acc = 0.0f;
            for (int j = u; j < ns; j += TARFA_LANES) {
                float e;
                if (j < n) {
                    e = det_exp(__fsub_rn(col[(long)j * AT_ROWS], m));
                    col[(long)j * AT_ROWS] = e;
                } else {
                    e = det_exp(__fsub_rn(s_sink, m));
                }
                acc = __fadd_rn(acc, e);
            }
            v = acc;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                if (sl & (1 << k)) {
                    v = __fadd_rn(st[k], v);
                } else {
                    st[k] = v;
                    break;
                }
            }
        }
        // v: the subtree of the lanes = bitrev4(sh) (mod 16); fold over sh (levels 8 .. 1)
        if (sh & 1) {
            v = __fadd_rn(o0, v);
            if (sh & 2) {
                v = __fadd_rn(o1, v);
                if (sh & 4) {
                    v = __fadd_rn(o2, v);
                    if (sh & 8) {
                        total = __fadd_rn(o3, v);
                    } else {
                        o3 = v;
                    }
                } else {
                    o2 = v;
                }
            } else {
                o1 = v;
            }
        } else {
            o0 = v;
        }
    }
    for (int j = 0; j < n; j++) col[(long)j * AT_ROWS] = __fdiv_rn(col[(long)j * AT_ROWS], total);
}

// P·V of a tile: o[row][d] for 16 query rows x 32 of the D value columns. The weights' rows are
// the value columns d (V[j][d], a stage row per position), the tokens the rows' p_j.
struct LsPv {
    int len;             // the 16 rows' largest n (positions seen)
    const u64* vtab;     // V of the layer, paged: the tile's KV head's rows (common.cuh `kv_row`)
    int head;            // the tile's KV head
    int d, d0;
    const float* pbase;  // the tile's p rows: [position][AT_ROWS], at the 16 rows' first
    int n4[4];           // this thread's 4 rows' n (0 past the tile)
    float4 vr[2], pr;
    bool vv[2], pv;
    __device__ __forceinline__ void load(int m, int b) {
        const int tid = threadIdx.x;
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int i = tid + 512 * u;
            const int d4 = i & 7, col = (i >> 3) & 15, c = i >> 7;
            const int j = 256 * (b * LS_CB + c) + 16 * m + col;
            vv[u] = j < len && d0 + 4 * d4 < d;
            if (vv[u]) {
                vr[u] = *reinterpret_cast<const float4*>(kv_row(vtab, head, j, d) + d0 + 4 * d4);
            }
        }
        const int q4 = tid & 3, col = (tid >> 2) & 15, c = tid >> 6;
        const int j = 256 * (b * LS_CB + c) + 16 * m + col;
        pv = j < len;
        if (pv) pr = *reinterpret_cast<const float4*>(pbase + (long)j * AT_ROWS + 4 * q4);
    }
    __device__ __forceinline__ void store(float* buf) const {
        const int tid = threadIdx.x;
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int i = tid + 512 * u;
            const int d4 = i & 7, col = (i >> 3) & 15, c = i >> 7;
            if (vv[u]) *reinterpret_cast<float4*>(buf + (c * 16 + col) * LS_BR + 4 * d4) = vr[u];
        }
        const int q4 = tid & 3, col = (tid >> 2) & 15, c = tid >> 6;
        if (pv) *reinterpret_cast<float4*>(buf + LS_WS + (c * 16 + col) * LS_XP + 4 * q4) = pr;
    }
    // lane v's terms of the chunks b*LS_CB + [0, nc): a term j of row t only when j < n of t
    // (the rows' chains end at their own positions: nothing past them is added)
    __device__ __forceinline__ void compute(float (&leaf)[4][4], const float* buf, int b, int v,
                                            int nc) const {
        const int p = threadIdx.x & 31, w = threadIdx.x >> 5, rg = p & 7, tg = p >> 3;
        const float* wp = buf + w * LS_BR + 4 * rg;
        const float* xp = buf + LS_WS + w * LS_XP + 4 * tg;
        const int nmin = min(min(n4[0], n4[1]), min(n4[2], n4[3]));
        for (int c = 0; c < nc; c++) {
            const int j = 256 * (b * LS_CB + c) + v;
            const float4 wv = *reinterpret_cast<const float4*>(wp + c * 16 * LS_BR);
            const float4 xv = *reinterpret_cast<const float4*>(xp + c * 16 * LS_XP);
            const float wa[4] = {wv.x, wv.y, wv.z, wv.w};
            const float xa[4] = {xv.x, xv.y, xv.z, xv.w};
            if (j < nmin) {
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int jj = 0; jj < 4; jj++) leaf[i][jj] = fmaf(wa[i], xa[jj], leaf[i][jj]);
            } else {
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int jj = 0; jj < 4; jj++) {
                        if (j < n4[jj]) leaf[i][jj] = fmaf(wa[i], xa[jj], leaf[i][jj]);
                    }
            }
        }
    }
};

// grid (tiles * Hkv, ceil(D / 32), AT_ROWS / 16), block 512, LS_SMEM_BYTES. o: [token][Hq][D].
extern "C" __global__ void __launch_bounds__(LS_THREADS, 1) attn_pv(
    int hq, int hkv, int d, const u32* __restrict__ qtiles, const u64* __restrict__ tok,
    const u64* __restrict__ kv, const u64* __restrict__ kc, const u64* __restrict__ vc,
    int cap, int pos0, const float* __restrict__ sc, int n_stride, float* __restrict__ o) {
    TARFA_DYN_SMEM(float, smem);
    __shared__ int rpos[16];
    const int b = blockIdx.x / hkv, g = blockIdx.x % hkv;
    const int d0 = blockIdx.y * LS_BR, qr0 = blockIdx.z * 16;
    const AttnTile a = attn_tile(qtiles, hq, hkv, tok, kv, kc, vc, pos0, b);
    if (threadIdx.x < 16) {
        rpos[threadIdx.x] = attn_row_pos(a, tok, kv, kc, vc, pos0, qr0 + threadIdx.x);
    }
    __syncthreads();
    int len = 0;
#pragma unroll
    for (int i = 0; i < 16; i++) len = max(len, rpos[i] + 1);
    if (len == 0) return;  // every row past the tile (a whole block leaves together)
    LsPv pol;
    pol.len = len;
    pol.vtab = a.src.vc;
    pol.head = g;
    pol.d = d;
    pol.d0 = d0;
    pol.pbase = sc + (long)(b * hkv + g) * n_stride * AT_ROWS + qr0;
    const int tg = (threadIdx.x & 31) >> 3;
#pragma unroll
    for (int j = 0; j < 4; j++) pol.n4[j] = rpos[4 * tg + j] + 1;
    float t[4][4];
    ls_reduce(t, pol, smem);
    ls_publish(t, smem);
    const int oi = threadIdx.x;
    const int dd = d0 + (oi & 31), qr = qr0 + (oi >> 5);
    const float y = ls_finish(smem, oi);
    const int tl = qr / a.hg;
    if (dd < d && tl < a.count) {
        const int head = g * a.hg + qr % a.hg;
        o[((long)(a.t_first + tl) * hq + head) * d + dd] = y;
    }
}
