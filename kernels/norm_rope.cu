// Embedding lookup, RMSNorm, RoPE with the KV-cache append, and the BF16 validation arm.
#include "common.cuh"

// h[t][i] = widen(embed[tokens[t]][i]). grid (T), block 256.
extern "C" __global__ void __launch_bounds__(256) embed_bf16(
    const u16* __restrict__ embed, const u32* __restrict__ tokens, int hidden, float* __restrict__ h) {
    const int t = blockIdx.x;
    const u16* row = embed + (long)tokens[t] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) h[(long)t * hidden + i] = bf16_widen(row[i]);
}

extern "C" __global__ void __launch_bounds__(256) embed_f32(
    const float* __restrict__ embed, const u32* __restrict__ tokens, int hidden, float* __restrict__ h) {
    const int t = blockIdx.x;
    const float* row = embed + (long)tokens[t] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) h[(long)t * hidden + i] = row[i];
}

// RMSNorm of `count` segments of n values, a warp per segment (cpu/forward.rs `rms_norm`):
// ss = canonical dot(x, x); m = ss / f32(n); r = rsqrt(m + eps); y_i = w_i * (x_i * r).
// Segment i reads x + i*x_stride and writes y + i*y_stride; y may be x (in place: every lane has
// read its part of x before the shuffles that precede the writes). grid (ceil(count/8)), block 256.
extern "C" __global__ void __launch_bounds__(256) rmsnorm(
    const float* x, long x_stride, float* y, long y_stride, const float* __restrict__ w, int n,
    int count, float eps) {
    const int p = threadIdx.x & 31;
    const int seg = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (seg >= count) return;
    const float* xs = x + (long)seg * x_stride;
    float* ys = y + (long)seg * y_stride;
    float ss = warp_dot_f32(xs, xs, n, p);
    float r = 0.0f;
    if (p == 0) {
        float m = __fdiv_rn(ss, (float)n);
        r = det_rsqrt(__fadd_rn(m, eps));
    }
    r = __shfl_sync(TARFA_FULL_MASK, r, 0);
    for (int i = p; i < n; i += 32) ys[i] = __fmul_rn(w[i], __fmul_rn(xs[i], r));
}

// RoPE at positions pos0 + t on every query head (in place) and key head, then the key and value
// of every KV head appended to the cache of this layer (cpu/kv_cache.rs layout per head:
// [position][D], here in blocks of TARFA_KV_BLOCK positions, common.cuh `kv_row`).
// The rotation covers each head's leading rd values (rd = D unless partial_rotary_factor; the rest
// pass through unchanged): for i < rd/2, j = i + rd/2: x'_i = x_i*cos_i - x_j*sin_i,
// x'_j = x_j*cos_i + x_i*sin_i (each product rounded, then the sum; no fma). cos/sin rows come
// from the host table: [position][rd/2].
// Llama 4's attention (cpu/forward.rs `gqa_block`), per layer:
//   form ROPE_HALF: the rotate-half rotation above; ROPE_PAIRS: the complex form, for i < rd/2
//   the pair (a, b) = (x_2i, x_2i+1) becomes (a*cos_i - b*sin_i, a*sin_i + b*cos_i); ROPE_NONE:
//   no rotation (a NoPE layer);
//   l2 != 0: after the rotation each query and key head x becomes x_i * r, r = rsqrt(ss / f32(D) +
//   eps), ss the canonical dot(x, x) (rmsnorm's arithmetic without the weight);
//   qscale != null: each query head times qscale[t] (the NoPE layers' attention temperature, from
//   the host: it needs a logarithm).
#define ROPE_HALF 0
#define ROPE_PAIRS 1
#define ROPE_NONE 2

struct RopeForm {
    int form;
    int l2;
    float eps;
    const float* qscale;
};

// x[0..rd) rotated by form into y (y may be x); the rest of the head copied when y is not x.
__device__ __forceinline__ void rope_head(const float* x, float* y, int d, int rd, int form,
                                          const float* __restrict__ c,
                                          const float* __restrict__ s) {
    const int half = rd / 2;
    if (form == ROPE_HALF) {
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            float a = x[i], b = x[i + half];
            y[i] = __fsub_rn(__fmul_rn(a, c[i]), __fmul_rn(b, s[i]));
            y[i + half] = __fadd_rn(__fmul_rn(b, c[i]), __fmul_rn(a, s[i]));
        }
    } else if (form == ROPE_PAIRS) {
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            float a = x[2 * i], b = x[2 * i + 1];
            y[2 * i] = __fsub_rn(__fmul_rn(a, c[i]), __fmul_rn(b, s[i]));
            y[2 * i + 1] = __fadd_rn(__fmul_rn(a, s[i]), __fmul_rn(b, c[i]));
        }
    }
    const int from = form == ROPE_NONE ? 0 : rd;
    if (y != x) {
        for (int i = from + threadIdx.x; i < d; i += blockDim.x) y[i] = x[i];
    }
}

// The L2 norm of the head y in place (rope_head's output, written by the whole block).
__device__ __forceinline__ void l2_head(float* y, int d, float eps) {
    __shared__ float r_sh;
    __syncthreads();  // the block's writes of y are visible
    if (threadIdx.x < 32) {
        const float ss = warp_dot_f32(y, y, d, threadIdx.x);
        if (threadIdx.x == 0) r_sh = det_rsqrt(__fadd_rn(__fdiv_rn(ss, (float)d), eps));
    }
    __syncthreads();
    const float r = r_sh;
    for (int i = threadIdx.x; i < d; i += blockDim.x) y[i] = __fmul_rn(y[i], r);
}

// One token: RoPE with the table rows c, s on its query heads (in place) and key heads, its key and
// value appended at position pos of this layer's paged cache (common.cuh `kv_row`). head:
// blockIdx.x.
__device__ __forceinline__ void rope_append_one(float* q, const float* __restrict__ k,
                                                const float* __restrict__ v, int t, int hq,
                                                int hkv, int d, int rd,
                                                const float* __restrict__ c,
                                                const float* __restrict__ s, int pos,
                                                const u64* __restrict__ k_cache,
                                                const u64* __restrict__ v_cache,
                                                const RopeForm& f) {
    const int head = blockIdx.x;
    if (head < hq) {
        float* x = q + ((long)t * hq + head) * d;
        rope_head(x, x, d, rd, f.form, c, s);
        if (f.l2) l2_head(x, d, f.eps);
        if (f.qscale != nullptr) {
            const float qs = f.qscale[t];
            __syncthreads();  // the rotation's writes (other threads' values) are visible
            for (int i = threadIdx.x; i < d; i += blockDim.x) x[i] = __fmul_rn(x[i], qs);
        }
    } else {
        const int kh = head - hq;
        const float* x = k + ((long)t * hkv + kh) * d;
        float* kc = kv_row(k_cache, kh, pos, d);
        rope_head(x, kc, d, rd, f.form, c, s);
        if (f.l2) l2_head(kc, d, f.eps);
        const float* vs = v + ((long)t * hkv + kh) * d;
        float* vc = kv_row(v_cache, kh, pos, d);
        for (int i = threadIdx.x; i < d; i += blockDim.x) vc[i] = vs[i];
    }
}

#define ROPE_FORM_PARAMS int form, int l2, float eps, const float *__restrict__ qscale
#define ROPE_FORM RopeForm{form, l2, eps, qscale}

// grid (Hq + Hkv, T), block 64.
extern "C" __global__ void __launch_bounds__(64) rope_append_kv(
    float* q, const float* __restrict__ k, const float* __restrict__ v, int hq, int hkv, int d,
    int rd, const float* __restrict__ cos_t, const float* __restrict__ sin_t, int pos0,
    const u64* __restrict__ k_cache, const u64* __restrict__ v_cache, int cap, ROPE_FORM_PARAMS) {
    const int t = blockIdx.y;
    const int pos = pos0 + t;
    const long row = (long)pos * (rd / 2);
    rope_append_one(q, k, v, t, hq, hkv, d, rd, cos_t + row, sin_t + row, pos, k_cache, v_cache,
                    ROPE_FORM);
}

// The same for a step over several sequences: token t's RoPE rows, position and capacity are
// tok[4t..4t+4), its sequence's cache of this layer kv[2t..2t+2) (attention.cu `attention_seqs`).
// grid (Hq + Hkv, T), block 64.
extern "C" __global__ void __launch_bounds__(64) rope_append_kv_seqs(
    float* q, const float* __restrict__ k, const float* __restrict__ v, int hq, int hkv, int d,
    int rd, const u64* __restrict__ tok, const u64* __restrict__ kv, ROPE_FORM_PARAMS) {
    const int t = blockIdx.y;
    rope_append_one(q, k, v, t, hq, hkv, d, rd, reinterpret_cast<const float*>(tok[4 * t]),
                    reinterpret_cast<const float*>(tok[4 * t + 1]), (int)tok[4 * t + 2],
                    reinterpret_cast<const u64*>(kv[2 * t]),
                    reinterpret_cast<const u64*>(kv[2 * t + 1]), ROPE_FORM);
}

// OLMoE's clip_qkv (cpu/forward.rs `gqa_block`): x_i = max(min(x_i, c), -c) on n values, after
// the q/k norm and before RoPE. fminf/fmaxf return the other operand for a NaN, as Rust's
// f32::min/max do (the CPU's clamp). grid (ceil(n/256)), block 256.
extern "C" __global__ void __launch_bounds__(256) clip_abs(float* x, long n, float c) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = fmaxf(fminf(x[i], c), -c);
}

// The INVALID validation arm (cpu::FinalHidden::InvalidBf16BeforeLmHead): x = widen(bf16(x)).
extern "C" __global__ void __launch_bounds__(256) round_to_bf16(float* x, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = bf16_round_trip(x[i]);
}
