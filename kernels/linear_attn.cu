// The hybrid decoders' layers (Qwen3-Next, Qwen3.5 MoE; cpu/forward.rs `linear_block`,
// `linear_inputs` and the gated lines of `gqa_block`): the gated DeltaNet layer's permutation,
// causal convolution, q/k L2 norm, recurrence and output gate, and gated attention's split of
// q_proj and its sigmoid gate. Every value is the CPU's operation in the CPU's order: the
// reductions are the canonical warp dot (common.cuh), products and sums separately rounded.
#include "common.cuh"

// Qwen3-Next's fused projections into head-major inputs (a pure copy: transformers'
// fix_query_key_value_ordering). Per key head g, qkvz holds q_g | k_g | v_g | z_g (Dk, Dk, r Dv,
// r Dv; r = Hv / Hk) and ba holds b_g | a_g (r, r). Writes qkv [T][2 Hk Dk + Hv Dv] (q | k | v),
// z [T][Hv Dv], b and a [T][Hv]. grid (T), block 256.
extern "C" __global__ void __launch_bounds__(256) linear_unpack(
    const float* __restrict__ qkvz, const float* __restrict__ ba, int hk, int dk, int r, int dv,
    float* __restrict__ qkv, float* __restrict__ z, float* __restrict__ b, float* __restrict__ a) {
    const long t = blockIdx.x;
    const int kw = hk * dk, rv = r * dv, hv = hk * r;
    const int group = 2 * dk + 2 * rv;
    const int c = 2 * kw + hk * rv;
    const float* src = qkvz + t * (long)(hk * group);
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        int from;
        if (i < kw) {
            from = (i / dk) * group + i % dk;
        } else if (i < 2 * kw) {
            const int u = i - kw;
            from = (u / dk) * group + dk + u % dk;
        } else {
            const int u = i - 2 * kw;
            from = (u / rv) * group + 2 * dk + u % rv;
        }
        qkv[t * c + i] = src[from];
    }
    for (int i = threadIdx.x; i < hk * rv; i += blockDim.x) {
        z[t * (hk * rv) + i] = src[(i / rv) * group + 2 * dk + rv + i % rv];
    }
    const float* bat = ba + t * (long)(2 * hv);
    for (int i = threadIdx.x; i < hv; i += blockDim.x) {
        const int g = i / r, u = i % r;
        b[t * hv + i] = bat[2 * g * r + u];
        a[t * hv + i] = bat[(2 * g + 1) * r + u];
    }
}

// The causal depthwise convolution of one sequence's T tokens, in position order, a thread per
// channel: with the state's last K - 1 inputs (oldest first) and the token's x,
//   acc = w_0 x_0; acc = acc + w_j x_j (j ascending, each product rounded; no fma); y = silu(acc)
// and the state shifts to keep the inputs (before the convolution). The state before the step is
// src [K-1][C] (null: zeros, the state at position 0), the state after it is written to dst
// (src == dst allowed); y may be x. grid (ceil(C / 256)), block 256.
extern "C" __global__ void __launch_bounds__(256) linear_conv(
    const float* x, long x_stride, int tokens, int channels, int taps, const float* __restrict__ w,
    const float* src, float* dst, float* y, long y_stride) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= channels) return;
    const float* wc = w + (long)ch * taps;
    for (int j = 0; j + 1 < taps; j++) {
        dst[(long)j * channels + ch] = src ? src[(long)j * channels + ch] : 0.0f;
    }
    for (int t = 0; t < tokens; t++) {
        const float xt = x[(long)t * x_stride + ch];
        float acc = __fmul_rn(wc[0], taps == 1 ? xt : dst[ch]);
        for (int j = 1; j < taps; j++) {
            const float xj = j + 1 == taps ? xt : dst[(long)j * channels + ch];
            acc = __fadd_rn(acc, __fmul_rn(wc[j], xj));
        }
        if (taps > 1) {
            for (int j = 0; j + 2 < taps; j++) dst[(long)j * channels + ch] = dst[(long)(j + 1) * channels + ch];
            dst[(long)(taps - 2) * channels + ch] = xt;
        }
        y[(long)t * y_stride + ch] = det_silu(acc);
    }
}

// The L2 norm of every query and key head (Dk values; heads 0..Hk-1 of a token are q's, Hk..2Hk-1
// k's), in place: x = x * rsqrt(dot(x, x) + eps) (the canonical dot), then the query heads
// x = x * scale. Token t's heads start at x + t*stride. A warp per (token, head): grid
// (ceil(T * 2 Hk / 8)), block 256.
extern "C" __global__ void __launch_bounds__(256) linear_qk_norm(
    float* x, long stride, int tokens, int hk, int dk, float eps, float scale) {
    const int p = threadIdx.x & 31;
    const int seg = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (seg >= tokens * 2 * hk) return;
    const int t = seg / (2 * hk), head = seg % (2 * hk);
    float* xs = x + (long)t * stride + (long)head * dk;
    const float ss = warp_dot_f32(xs, xs, dk, p);
    float inv = 0.0f;
    if (p == 0) inv = det_rsqrt(__fadd_rn(ss, eps));
    inv = __shfl_sync(TARFA_FULL_MASK, inv, 0);
    // every lane read its part of the head before the shuffles above: in place is safe
    for (int i = p; i < dk; i += 32) {
        float v = __fmul_rn(xs[i], inv);
        if (head < hk) v = __fmul_rn(v, scale);
        xs[i] = v;
    }
}

// The gated delta rule over one sequence's T tokens, in position order. Row (h, j) of the state
// [Hv][Dv][Dk] (Dk contiguous) belongs to one warp, whose thread p owns lanes 8p..8p+7 of every
// 256-chunk of the row: the same lanes the canonical dot reads, so the updates between the dots
// need no barrier. Per token, with q, k the token's key head h / (Hv / Hk) (normed), v its value
// j of head h:
//   beta = sigmoid(b_h); g = -exp(A_log_h) * softplus(a_h + dt_bias_h); decay = exp(g)
//   S = S * decay; kv = dot(S, k); delta = (v - kv) * beta; S = S + k * delta; o_hj = dot(S, q)
// qkv: the token's q | k | v at qkv + t*stride; b, a: [T][Hv]; o: [T][Hv Dv]. The state before
// the step is src (null: zeros), after it dst (src == dst allowed). A warp per row: grid
// (ceil(Hv Dv / 8)), block 256.
extern "C" __global__ void __launch_bounds__(256) linear_recur(
    const float* __restrict__ qkv, long stride, const float* __restrict__ b,
    const float* __restrict__ a, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
    int tokens, int hk, int hv, int dk, int dv, const float* src, float* dst, float* __restrict__ o) {
    const int p = threadIdx.x & 31;
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= hv * dv) return;
    const int h = row / dv, j = row % dv;
    const int kh = h / (hv / hk), kw = hk * dk;
    float* s = dst + (long)row * dk;
    const float* s0 = src ? src + (long)row * dk : nullptr;
    for (int base = 8 * p; base < dk; base += TARFA_LANES) {
        for (int e = 0; e < 8; e++) {
            if (base + e < dk) s[base + e] = s0 ? s0[base + e] : 0.0f;
        }
    }
    const float decay_log = -det_exp(a_log[h]);
    for (int t = 0; t < tokens; t++) {
        const float* xt = qkv + (long)t * stride;
        const float* q = xt + (long)kh * dk;
        const float* k = xt + kw + (long)kh * dk;
        const float v = xt[2 * kw + h * dv + j];
        const float beta = det_sigmoid(b[(long)t * hv + h]);
        const float g = __fmul_rn(decay_log, det_softplus(__fadd_rn(a[(long)t * hv + h], dt_bias[h])));
        const float decay = det_exp(g);
        for (int base = 8 * p; base < dk; base += TARFA_LANES) {
            for (int e = 0; e < 8; e++) {
                if (base + e < dk) s[base + e] = __fmul_rn(s[base + e], decay);
            }
        }
        float kv = warp_dot_f32(s, k, dk, p);
        kv = __shfl_sync(TARFA_FULL_MASK, kv, 0);
        const float delta = __fmul_rn(__fsub_rn(v, kv), beta);
        for (int base = 8 * p; base < dk; base += TARFA_LANES) {
            for (int e = 0; e < 8; e++) {
                if (base + e < dk) s[base + e] = __fadd_rn(s[base + e], __fmul_rn(k[base + e], delta));
            }
        }
        const float oj = warp_dot_f32(s, q, dk, p);
        if (p == 0) o[(long)t * hv * dv + row] = oj;
    }
}

// The gated norm's gate, in place: y_i = y_i * silu(z_i) over n values (y the RMSNorm of each
// value head, z in_proj_z's output). grid (ceil(n / 256)), block 256.
extern "C" __global__ void __launch_bounds__(256) silu_gate(float* y, const float* __restrict__ z, long n) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __fmul_rn(y[i], det_silu(z[i]));
}

// Gated attention's q_proj output [T][Hq][2D] (each head's query, then its gate): the queries
// into q [T][Hq][D]. grid (T), block 256.
extern "C" __global__ void __launch_bounds__(256) split_query_gate(
    const float* __restrict__ qg, int hq, int d, float* __restrict__ q) {
    const long t = blockIdx.x;
    for (int i = threadIdx.x; i < hq * d; i += blockDim.x) {
        q[t * hq * d + i] = qg[t * 2 * hq * d + (long)(i / d) * 2 * d + i % d];
    }
}

// Gated attention's output gate, in place: o [T][Hq][D] times sigmoid of each head's gate (the
// second D of its 2D in qg). grid (T), block 256.
extern "C" __global__ void __launch_bounds__(256) sigmoid_gate(
    float* o, const float* __restrict__ qg, int hq, int d) {
    const long t = blockIdx.x;
    for (int i = threadIdx.x; i < hq * d; i += blockDim.x) {
        const float g = qg[t * 2 * hq * d + (long)(i / d) * 2 * d + d + i % d];
        o[t * hq * d + i] = __fmul_rn(o[t * hq * d + i], det_sigmoid(g));
    }
}
