// Causal attention of one (token, query head) per block of 256 threads (cpu/forward.rs
// `gqa_block`): the query at position P = pos0 + t sees positions start..=P of its KV head, where
// start is 0, or P + 1 - window on a sliding layer (transformers' mask: key j seen when P - j < w),
// raised to P's chunk start (P / C) * C on a chunked layer (Llama 4).
//   s_j = dot(q, k_j) * scale                       (canonical dot over D, a warp per position)
//   gpt-oss's sink: one more score after the keys, sinks[qh] (its probability is dropped)
//   m = max_j s_j; e_j = exp(s_j - m); S = canonical_sum_j(e_j); p_j = e_j / S
//   o[d] = canonical dot over j of (p_j, v_j[d])    (lanes over positions j - start)
// Scores live in `scratch` ([T][Hq][n_stride] floats; n_stride >= the positions + 1 with sinks).
// grid (Hq, T), block 256.
#include "common.cuh"

#define ATT_TILE 32

// The first position a query at `pos` sees (see above); window, chunk 0: none.
__device__ __forceinline__ int attn_start(int pos, int window, int chunk) {
    int start = (window > 0 && pos + 1 > window) ? pos + 1 - window : 0;
    if (chunk > 0 && pos / chunk * chunk > start) start = pos / chunk * chunk;
    return start;
}

// One (token, query head): the query qv at a position that sees n positions of KV head kvh's
// paged cache rows (tables kt, vt; positions start .. start + n - 1); scores in sc[0..n), and the
// sink's in sc[n] when `sink` is not null. Every thread of the block calls it.
__device__ __forceinline__ void attend_one(const float* __restrict__ qv,
                                           const u64* __restrict__ kt,
                                           const u64* __restrict__ vt, int kvh, long start,
                                           int n, int d, float scale, const float* sink,
                                           float* sc, float* __restrict__ ov) {
    __shared__ float red[TARFA_LANES];
    __shared__ float tile[TARFA_LANES][ATT_TILE + 1];
    const int v = threadIdx.x;
    const int p = v & 31;
    const int warp = v >> 5;

    for (int j = warp; j < n; j += 8) {
        float s = warp_dot_f32(qv, kv_row(kt, kvh, start + j, d), d, p);
        if (p == 0) sc[j] = __fmul_rn(s, scale);
    }
    if (sink != nullptr && v == 0) sc[n] = *sink;
    const int ns = sink != nullptr ? n + 1 : n;  // the softmax's terms
    __syncthreads();
    const float m = block_max_256(sc, ns, red);
    // thread v writes e_j for j = v, v+256, ...: exactly the terms its lane then sums
    for (int j = v; j < ns; j += TARFA_LANES) sc[j] = det_exp(__fsub_rn(sc[j], m));
    const float total = block_sum_256(sc, ns, red);
    for (int j = v; j < n; j += TARFA_LANES) sc[j] = __fdiv_rn(sc[j], total);
    // the lane loop below reads only j = v, v+256, ...: the p_j this thread wrote

    for (int d0 = 0; d0 < d; d0 += ATT_TILE) {
        float acc[ATT_TILE];
#pragma unroll
        for (int i = 0; i < ATT_TILE; i++) acc[i] = 0.0f;
        for (int j = v; j < n; j += TARFA_LANES) {
            const float pj = sc[j];
            const float* vr = kv_row(vt, kvh, start + j, d) + d0;
#pragma unroll
            for (int i = 0; i < ATT_TILE; i++) {
                if (d0 + i < d) acc[i] = fmaf(pj, vr[i], acc[i]);
            }
        }
        __syncthreads();  // the previous tile's results have been read
#pragma unroll
        for (int i = 0; i < ATT_TILE; i++) tile[v][i] = acc[i];
        for (int h = 128; h >= 1; h >>= 1) {
            __syncthreads();
            for (int idx = v; idx < h * ATT_TILE; idx += TARFA_LANES) {
                const int lane = idx / ATT_TILE, i = idx % ATT_TILE;
                tile[lane][i] = __fadd_rn(tile[lane][i], tile[lane + h][i]);
            }
        }
        __syncthreads();
        if (v < ATT_TILE && d0 + v < d) ov[d0 + v] = tile[0][v];
    }
}

// sinks: [Hq] or null; window, chunk: the layer's (0: none).
extern "C" __global__ void __launch_bounds__(256) attention(
    const float* __restrict__ q, int hq, int hkv, int d, const u64* __restrict__ k_cache,
    const u64* __restrict__ v_cache, int cap, int pos0, float scale, float* scratch, int n_stride,
    float* __restrict__ o, const float* __restrict__ sinks, int window, int chunk) {
    const int qh = blockIdx.x;
    const int t = blockIdx.y;
    const int kvh = qh / (hq / hkv);
    const int pos = pos0 + t;
    const long start = attn_start(pos, window, chunk);
    attend_one(q + ((long)t * hq + qh) * d, k_cache, v_cache, kvh, start, pos + 1 - (int)start,
               d, scale, sinks != nullptr ? sinks + qh : nullptr,
               scratch + ((long)t * hq + qh) * n_stride, o + ((long)t * hq + qh) * d);
}

// The same for a step over several sequences: token t's own cache and position come from
// tok[4t..4t+4) = (RoPE cos row, RoPE sin row, position, capacity) and kv[2t..2t+2) = this layer's
// (keys, values) tables of its sequence (tarfa-cuda/src/model.rs `SeqTables`). grid (Hq, T), block 256.
extern "C" __global__ void __launch_bounds__(256) attention_seqs(
    const float* __restrict__ q, int hq, int hkv, int d, const u64* __restrict__ tok,
    const u64* __restrict__ kv, float scale, float* scratch, int n_stride, float* __restrict__ o,
    const float* __restrict__ sinks, int window, int chunk) {
    const int qh = blockIdx.x;
    const int t = blockIdx.y;
    const int kvh = qh / (hq / hkv);
    const int pos = (int)tok[4 * t + 2];
    const u64* k_cache = reinterpret_cast<const u64*>(kv[2 * t]);
    const u64* v_cache = reinterpret_cast<const u64*>(kv[2 * t + 1]);
    const long start = attn_start(pos, window, chunk);
    attend_one(q + ((long)t * hq + qh) * d, k_cache, v_cache, kvh, start, pos + 1 - (int)start,
               d, scale, sinks != nullptr ? sinks + qh : nullptr,
               scratch + ((long)t * hq + qh) * n_stride, o + ((long)t * hq + qh) * d);
}
