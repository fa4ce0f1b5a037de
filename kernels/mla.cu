// Multi-head latent attention on the device (cpu/forward.rs `mla_block`, docs/EXACTNESS.md
// "Multi-head latent attention"), in the absorbed form the CPU defines as canonical. r =
// kv_lora_rank, dn / dr / dv = the nope, rope and value head widths, dq = dn + dr, w = r + dr.
// The cache holds one latent row of w floats per position and layer: [RMSNorm(c) (r) | rope(k)].
// Before these kernels, per token: q [Hq][dq] (q_proj, or the LoRA with its norm) and
// kva = W_kva xn [w] with its first r values normalised in place (norm_rope.cu `rmsnorm`).
#include "common.cuh"

#define MLA_TILE 32
#define MLA_MAX_W 1024  // the largest latent row (r + dr) these kernels hold in shared memory
#define MLA_MAX_DR 512  // the largest rope part

// RoPE on a rope part x (dr values, in place): read as pairs (x0, x1), (x2, x3), ... and
// de-interleaved first when `interleave` (x'_i = x_2i, x'_(dr/2+i) = x_(2i+1)), then the
// rotate-half rotation with the table rows c, s (norm_rope.cu's products and sums). The result
// stays de-interleaved (cpu/forward.rs `rope_part`). buf: dr floats of shared memory. Every
// thread of the block calls it; it starts and ends with a barrier.
__device__ __forceinline__ void mla_rope_part(const float* x, float* out, int dr, int interleave,
                                              const float* __restrict__ c,
                                              const float* __restrict__ s, float* buf) {
    const int half = dr / 2;
    __syncthreads();
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        buf[i] = interleave ? x[2 * i] : x[i];
        buf[half + i] = interleave ? x[2 * i + 1] : x[half + i];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float a = buf[i], b = buf[half + i];
        out[i] = __fsub_rn(__fmul_rn(a, c[i]), __fmul_rn(b, s[i]));
        out[half + i] = __fadd_rn(__fmul_rn(b, c[i]), __fmul_rn(a, s[i]));
    }
    __syncthreads();
}

// One token: RoPE on every query head's rope part (in place; blocks 0..Hq-1), and (block Hq)
// the latent row [kva[0..r) | rope(kva[r..w))] written at position pos of this layer's paged
// cache (one "head": common.cuh `kv_row(cache, 0, pos, w)`).
__device__ __forceinline__ void mla_rope_append_one(float* q, const float* __restrict__ kva,
                                                    int t, int hq, int dn, int dr, int r,
                                                    int interleave, const float* __restrict__ c,
                                                    const float* __restrict__ s, int pos,
                                                    const u64* __restrict__ cache) {
    __shared__ float buf[MLA_MAX_DR];
    const int head = blockIdx.x;
    const int dq = dn + dr;
    const int w = r + dr;
    if (head < hq) {
        float* x = q + ((long)t * hq + head) * dq + dn;
        mla_rope_part(x, x, dr, interleave, c, s, buf);
    } else {
        const float* kv = kva + (long)t * w;
        float* row = kv_row(cache, 0, pos, w);
        for (int i = threadIdx.x; i < r; i += blockDim.x) row[i] = kv[i];
        mla_rope_part(kv + r, row + r, dr, interleave, c, s, buf);
    }
}

// grid (Hq + 1, T), block 64: the step's tokens at positions pos0 + t of one cache.
extern "C" __global__ void __launch_bounds__(64) mla_rope_append(
    float* q, const float* __restrict__ kva, int hq, int dn, int dr, int r, int interleave,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, int pos0,
    const u64* __restrict__ cache) {
    const int t = blockIdx.y;
    const int pos = pos0 + t;
    const long row = (long)pos * (dr / 2);
    mla_rope_append_one(q, kva, t, hq, dn, dr, r, interleave, cos_t + row, sin_t + row, pos, cache);
}

// The same for a step over several sequences: token t's RoPE rows and position are tok[4t..4t+3),
// its sequence's latent cache of this layer kv[2t] (attention.cu `attention_seqs`'s tables).
extern "C" __global__ void __launch_bounds__(64) mla_rope_append_seqs(
    float* q, const float* __restrict__ kva, int hq, int dn, int dr, int r, int interleave,
    const u64* __restrict__ tok, const u64* __restrict__ kv) {
    const int t = blockIdx.y;
    mla_rope_append_one(q, kva, t, hq, dn, dr, r, interleave,
                        reinterpret_cast<const float*>(tok[4 * t]),
                        reinterpret_cast<const float*>(tok[4 * t + 1]), (int)tok[4 * t + 2],
                        reinterpret_cast<const u64*>(kv[2 * t]));
}

template <typename W>
__device__ __forceinline__ float mla_load(const W* p, long i);
template <>
__device__ __forceinline__ float mla_load<u16>(const u16* p, long i) {
    return bf16_widen(p[i]);
}
template <>
__device__ __forceinline__ float mla_load<float>(const float* p, long i) {
    return p[i];
}

// out[c] = canonical dot over j < n of (a[j], rows[j][c]) for c < width (reduce.rs
// `weighted_row_sum`): lane v accumulates j = v, v + 256, ... in increasing j with fma from +0.0,
// then the 256-lane tree (pairs v, v + h for h = 128 .. 1), MLA_TILE columns at a time (the
// operations of attention.cu `attend_one`'s output). a: n values any thread may read (thread v
// reads only a[v], a[v + 256], ...); row_of(j): row j's first element. tile: [256][MLA_TILE + 1]
// floats of shared memory. Every thread calls it; out is written by threads < MLA_TILE.
template <typename W, typename Row>
__device__ __forceinline__ void mla_weighted_rows(const float* a, int n, Row row_of, int width,
                                                  float* out, float (*tile)[MLA_TILE + 1]) {
    const int v = threadIdx.x;
    for (int c0 = 0; c0 < width; c0 += MLA_TILE) {
        float acc[MLA_TILE];
#pragma unroll
        for (int i = 0; i < MLA_TILE; i++) acc[i] = 0.0f;
        for (int j = v; j < n; j += TARFA_LANES) {
            const float aj = a[j];
            const W* rj = row_of(j) + c0;
#pragma unroll
            for (int i = 0; i < MLA_TILE; i++) {
                if (c0 + i < width) acc[i] = fmaf(aj, mla_load(rj, i), acc[i]);
            }
        }
        __syncthreads();  // the previous tile's results have been read
#pragma unroll
        for (int i = 0; i < MLA_TILE; i++) tile[v][i] = acc[i];
        for (int h = 128; h >= 1; h >>= 1) {
            __syncthreads();
            for (int idx = v; idx < h * MLA_TILE; idx += TARFA_LANES) {
                const int lane = idx / MLA_TILE, i = idx % MLA_TILE;
                tile[lane][i] = __fadd_rn(tile[lane][i], tile[lane + h][i]);
            }
        }
        __syncthreads();
        if (v < MLA_TILE && c0 + v < width) out[c0 + v] = tile[0][v];
    }
    __syncthreads();
}

// One (token, head) of MLA attention by a block of 256 threads, the query at a position that
// sees n positions of the paged latent cache `lat` (one "head" of w floats per position):
//   qc[0..r) = weighted_row_sum(q_nope, W_kb)  (the head's dn rows of kv_b, widened)
//   qc[r..w) = q_rope (rotated)
//   s_j = dot(qc, L_j) * scale                 (canonical dot over w, a warp per position)
//   p = softmax(s)                             (attend_one's max, exp, canonical sum, divide)
//   u = weighted_row_sum(p, L)[0..r)
//   o[i] = dot(W_vb row i, u) for i < dv       (the head's dv rows of kv_b, canonical dots)
// kv_b: [Hq*(dn+dv)][r]. sc: n floats of global scratch.
template <typename W>
__device__ __forceinline__ void mla_attend_one(const float* __restrict__ qh,
                                               const W* __restrict__ kv_b,
                                               const u64* __restrict__ lat, int n, int head,
                                               int dn, int dr, int dv, int r, float scale,
                                               float* sc, float* __restrict__ ov) {
    __shared__ float red[TARFA_LANES];
    __shared__ float tile[TARFA_LANES][MLA_TILE + 1];
    __shared__ float qc[MLA_MAX_W];
    __shared__ float u[MLA_MAX_W];
    const int v = threadIdx.x;
    const int p = v & 31;
    const int warp = v >> 5;
    const int w = r + dr;
    const W* wkb = kv_b + (long)head * (dn + dv) * r;
    mla_weighted_rows<W>(qh, dn, [&](int j) { return wkb + (long)j * r; }, r, qc, tile);
    for (int i = v; i < dr; i += TARFA_LANES) qc[r + i] = qh[dn + i];
    __syncthreads();

    for (int j = warp; j < n; j += 8) {
        float s = warp_dot_f32(qc, kv_row(lat, 0, j, w), w, p);
        if (p == 0) sc[j] = __fmul_rn(s, scale);
    }
    __syncthreads();
    const float m = block_max_256(sc, n, red);
    for (int j = v; j < n; j += TARFA_LANES) sc[j] = det_exp(__fsub_rn(sc[j], m));
    const float total = block_sum_256(sc, n, red);
    for (int j = v; j < n; j += TARFA_LANES) sc[j] = __fdiv_rn(sc[j], total);
    // mla_weighted_rows reads only j = v, v + 256, ...: the p_j this thread wrote
    const auto lat_row = [&](int j) -> const float* { return kv_row(lat, 0, j, w); };
    mla_weighted_rows<float>(sc, n, lat_row, r, u, tile);

    const W* wvb = wkb + (long)dn * r;
    for (int i = warp; i < dv; i += 8) {
        float o = row_dot<W>(wvb + (long)i * r, u, r, p);
        if (p == 0) ov[i] = o;
    }
}

// grid (Hq, T), block 256: one cache, the step's tokens at positions pos0 + t; scores in
// scratch ([T][Hq][n_stride]); o [T][Hq][dv].
#define MLA_ATTENTION(NAME, W)                                                                    \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                       \
        const float* __restrict__ q, const W* __restrict__ kv_b, int hq, int dn, int dr, int dv,  \
        int r, const u64* __restrict__ cache, int pos0, float scale, float* scratch,              \
        int n_stride, float* __restrict__ o) {                                                    \
        const int head = blockIdx.x;                                                              \
        const int t = blockIdx.y;                                                                 \
        mla_attend_one<W>(q + ((long)t * hq + head) * (dn + dr), kv_b, cache, pos0 + t + 1,       \
                          head, dn, dr, dv, r, scale, scratch + ((long)t * hq + head) * n_stride, \
                          o + ((long)t * hq + head) * dv);                                        \
    }
MLA_ATTENTION(mla_attention_bf16, u16)
MLA_ATTENTION(mla_attention_f32, float)

// The same over several sequences' tables (mla_rope_append_seqs).
#define MLA_ATTENTION_SEQS(NAME, W)                                                               \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                       \
        const float* __restrict__ q, const W* __restrict__ kv_b, int hq, int dn, int dr, int dv,  \
        int r, const u64* __restrict__ tok, const u64* __restrict__ kv, float scale,              \
        float* scratch, int n_stride, float* __restrict__ o) {                                    \
        const int head = blockIdx.x;                                                              \
        const int t = blockIdx.y;                                                                 \
        mla_attend_one<W>(q + ((long)t * hq + head) * (dn + dr), kv_b,                            \
                          reinterpret_cast<const u64*>(kv[2 * t]), (int)tok[4 * t + 2] + 1,       \
                          head, dn, dr, dv, r, scale, scratch + ((long)t * hq + head) * n_stride, \
                          o + ((long)t * hq + head) * dv);                                        \
    }
MLA_ATTENTION_SEQS(mla_attention_seqs_bf16, u16)
MLA_ATTENTION_SEQS(mla_attention_seqs_f32, float)

// The decode graph's forms (tarfa-cuda/src/decode.rs): one token at the position the
// device-resident decode state holds (st[1]), so one captured graph serves every position.
extern "C" __global__ void __launch_bounds__(64) mla_rope_append_dec(
    float* q, const float* __restrict__ kva, int hq, int dn, int dr, int r, int interleave,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, const u32* __restrict__ st,
    const u64* __restrict__ cache) {
    const int pos = (int)st[1];
    const long row = (long)pos * (dr / 2);
    mla_rope_append_one(q, kva, 0, hq, dn, dr, r, interleave, cos_t + row, sin_t + row, pos, cache);
}

#define MLA_ATTENTION_DEC(NAME, W)                                                                \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                       \
        const float* __restrict__ q, const W* __restrict__ kv_b, int hq, int dn, int dr, int dv,  \
        int r, const u64* __restrict__ cache, const u32* __restrict__ st, float scale,            \
        float* scratch, int n_stride, float* __restrict__ o) {                                    \
        const int head = blockIdx.x;                                                              \
        mla_attend_one<W>(q + (long)head * (dn + dr), kv_b, cache, (int)st[1] + 1, head, dn, dr,  \
                          dv, r, scale, scratch + (long)head * n_stride, o + (long)head * dv);    \
    }
MLA_ATTENTION_DEC(mla_attention_dec_bf16, u16)
MLA_ATTENTION_DEC(mla_attention_dec_f32, float)
