// The decode step (one token) as few wide kernels, for batch-1 decode at memory speed
// (tarfa-run/src/cuda/decode.rs builds the launch list and replays it as one CUDA graph).
//
// Every output is still one canonical reduction computed by one warp (or block), in the order
// common.cuh and the legacy kernels use: these kernels change what is fused into one launch and
// how many loads are in flight, never an operation or its order. In particular:
// - a warp computes whole rows; each row's 256 lanes are thread p's 8p..8p+7 of every 256-chunk,
//   accumulated chunk by chunk in increasing order, then warp_tree. Loads are issued in groups
//   of up to 8 chunks (16 bytes each) before any of them is used, and the next group (the next
//   row's, at a row's end) is loaded before the previous row's tree runs;
// - RMSNorm fused in front of a matrix is recomputed by every block, from the same inputs with
//   the same operations, so every block holds the same bits the rmsnorm kernel would write;
// - the router's top-k runs in the last router block to finish (an atomic counter picks that
//   block; it decides who computes, never what is computed or in which order);
// - the position and the token come from a DecodeState in device memory, so one captured graph
//   serves every position; the lm_head kernel's last block writes the greedy token (the lowest
//   index among equal maxima, NaN never chosen over a number: generate.rs `argmax`) and advances
//   the state.
//
// Programmatic dependent launch: every kernel here first loads only what cannot change during
// the step (weights; in moe_down_mix also the router's choices, written two kernels back), then
// grid_dep_wait(), then grid_dep_launch() (common.cuh says why in that order).
#include "common.cuh"

// The step's state in device memory: the input token, its position, and the count of tokens the
// lm_head kernel has written to the token log since the host last reset it.
struct DecodeState {
    u32 token;
    int pos;
    int step;
    int pad;
};

// Eight consecutive weights of type W: one 16-byte load for BF16, two for F32.
template <typename W>
struct Pack8;

template <>
struct Pack8<u16> {
    uint4 v;
    __device__ __forceinline__ void load(const u16* p) { v = __ldg(reinterpret_cast<const uint4*>(p)); }
    __device__ __forceinline__ float at(int s) const {
        const u32 w = (s >> 1) == 0 ? v.x : (s >> 1) == 1 ? v.y : (s >> 1) == 2 ? v.z : v.w;
        return (s & 1) ? bf16_hi(w) : bf16_lo(w);
    }
};

template <>
struct Pack8<float> {
    uint4 v0, v1;
    __device__ __forceinline__ void load(const float* p) {
        v0 = __ldg(reinterpret_cast<const uint4*>(p));
        v1 = __ldg(reinterpret_cast<const uint4*>(p) + 1);
    }
    __device__ __forceinline__ float at(int s) const {
        const uint4& q = s < 4 ? v0 : v1;
        const int i = s & 3;
        return __uint_as_float(i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w);
    }
};

// a[s] = fma(w_s, x_s, a[s]) for the 8 lanes of one chunk; x is 16-byte aligned.
template <typename W>
__device__ __forceinline__ void fma8(float a[8], const Pack8<W>& w, const float* x) {
    const float4 x0 = *reinterpret_cast<const float4*>(x);
    const float4 x1 = *reinterpret_cast<const float4*>(x + 4);
    a[0] = fmaf(w.at(0), x0.x, a[0]);
    a[1] = fmaf(w.at(1), x0.y, a[1]);
    a[2] = fmaf(w.at(2), x0.z, a[2]);
    a[3] = fmaf(w.at(3), x0.w, a[3]);
    a[4] = fmaf(w.at(4), x1.x, a[4]);
    a[5] = fmaf(w.at(5), x1.y, a[5]);
    a[6] = fmaf(w.at(6), x1.z, a[6]);
    a[7] = fmaf(w.at(7), x1.w, a[7]);
}

#define DEC_GROUP 8  // chunks of 256 elements loaded together per row

// Loads group c0 (chunks c0 .. c0+7) of a row of n elements: thread p's 8 elements of each.
template <typename W>
__device__ __forceinline__ void load_group(Pack8<W> (&w)[DEC_GROUP], const W* __restrict__ row,
                                           int c0, int n, int p) {
#pragma unroll
    for (int i = 0; i < DEC_GROUP; i++) {
        const int e = ((c0 + i) << 8) + 8 * p;
        if (e < n) w[i].load(row + e);
    }
}

// Accumulates group c0 of a row with x (shared or global, 16-byte aligned).
template <typename W>
__device__ __forceinline__ void fma_group(float a[8], const Pack8<W> (&w)[DEC_GROUP],
                                          const float* x, int c0, int n, int p) {
#pragma unroll
    for (int i = 0; i < DEC_GROUP; i++) {
        const int e = ((c0 + i) << 8) + 8 * p;
        if (e < n) fma8<W>(a, w[i], x + e);
    }
}

// The input vector of a matrix-vector kernel into shared memory xs[0..n): x itself, or
// RMSNorm(x) with weights norm_w when norm_w is not null (rmsnorm kernel: ss = canonical
// dot(x, x), m = ss / n, r = rsqrt(m + eps), y_i = w_i * (x_i * r)). Block 0 also writes the
// normalised vector to xn_out when that is not null. Ends with a barrier.
__device__ __forceinline__ void stage_input(float* xs, const float* x, int n,
                                            const float* __restrict__ norm_w, float eps,
                                            float* xn_out) {
    __shared__ float r_s;
    for (int i = threadIdx.x; i < n; i += blockDim.x) xs[i] = x[i];
    __syncthreads();
    if (norm_w == nullptr) return;
    if (threadIdx.x < 32) {
        const float ss = warp_dot_f32(xs, xs, n, threadIdx.x);
        if (threadIdx.x == 0) r_s = det_rsqrt(__fadd_rn(__fdiv_rn(ss, (float)n), eps));
    }
    __syncthreads();
    const float r = r_s;
    for (int i = threadIdx.x; i < n; i += blockDim.x) xs[i] = __fmul_rn(norm_w[i], __fmul_rn(xs[i], r));
    __syncthreads();
    if (xn_out != nullptr && blockIdx.x == 0) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) xn_out[i] = xs[i];
    }
}

// (v1, i1) is the better greedy candidate than (v2, i2): a number beats NaN, a larger number
// wins, and among equal values (or two NaNs) the lower index.
__device__ __forceinline__ bool arg_better(float v1, int i1, float v2, int i2) {
    const bool n1 = v1 != v1, n2 = v2 != v2;
    if (n1 != n2) return n2;
    if (!n1 && v1 != v2) return v1 > v2;
    return i1 < i2;
}

// Is this block the last of its grid to get here? Every thread calls it after its global
// writes; the answer is the same in every thread of the block. The counter is reset by the
// caller's last block (it is zero when a launch starts).
__device__ __forceinline__ bool last_block(u32* counter) {
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    const bool last = is_last != 0;
    if (last) __threadfence();
    return last;
}

// ---------------------------------------------------------------------------------------------
// Matrix-vector product of one token: y_r = dot(W[r], xs) with xs = x or RMSNorm(x), for rows
// r = global warp, + warps of the grid, ... ; then per row (matvec.cu's epilogue):
//   y = y + bias[r]                   (bias: rows [0, split1) take bias0[r], [split1, split2)
//                                       bias1[r - split1], [split2, rows) bias2[r - split2];
//                                       a null pointer adds nothing)
//   mode 0: out[r] = y;  mode 1: out[r] = out[r] + y
// KIND 1 (router): the last block then runs route_block on out[0..rows) (rows = E).
// KIND 2 (lm_head): no bias; the last block writes the greedy token of out[0..rows) to st->token
// and tok_log[st->step], then advances st (pos + 1, step + 1).
// Block 256 threads; dynamic shared memory: max(cols, KIND 1 ? 2 * rows + k : 0) floats.
template <typename W, int KIND>
__device__ __forceinline__ void dmv_body(
    const W* __restrict__ w, int rows, int cols, const float* x, const float* __restrict__ norm_w,
    float eps, const float* __restrict__ bias0, const float* __restrict__ bias1,
    const float* __restrict__ bias2, int split1, int split2, float* out, int mode, float* xn_out,
    // KIND 1
    u32* counter, int k, int renorm, u32* __restrict__ ids, float* __restrict__ probs,
    float* __restrict__ weights, u32* __restrict__ by_id, float* __restrict__ kth,
    float* __restrict__ next,
    // KIND 2
    float* __restrict__ part_v, int* __restrict__ part_i, DecodeState* st,
    u32* __restrict__ tok_log) {
    TARFA_DYN_SMEM(float, xs);
    __shared__ float red[TARFA_LANES];
    __shared__ int redi[TARFA_LANES];
    const int p = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nw = gridDim.x * 8;
    int r = blockIdx.x * 8 + warp;
    int c0 = 0;
    Pack8<W> wv[DEC_GROUP];
    if (r < rows) load_group<W>(wv, w + (long)r * cols, 0, cols, p);  // weights: before the wait
    grid_dep_wait();
    grid_dep_launch();
    stage_input(xs, x, cols, norm_w, eps, xn_out);

    float best_v = f32_bits(0x7fc00000u);
    int best_i = 0x7fffffff;
    float a[8];
    zero8(a);
    while (r < rows) {
        fma_group<W>(a, wv, xs, c0, cols, p);
        int r2 = r, c2 = c0 + DEC_GROUP;
        if ((c2 << 8) >= cols) {
            c2 = 0;
            r2 = r + nw;
        }
        if (r2 < rows) load_group<W>(wv, w + (long)r2 * cols, c2, cols, p);
        if (c2 == 0) {
            float y = warp_tree(a);
            if (p == 0) {
                if (KIND != 2) {
                    const float* b = r < split1 ? (bias0 ? bias0 + r : nullptr)
                                   : r < split2 ? (bias1 ? bias1 + (r - split1) : nullptr)
                                                : (bias2 ? bias2 + (r - split2) : nullptr);
                    if (b != nullptr) y = __fadd_rn(y, *b);
                }
                float* o = out + r;
                *o = (mode == 1) ? __fadd_rn(*o, y) : y;
                if (KIND == 2 && arg_better(y, r, best_v, best_i)) {
                    best_v = y;
                    best_i = r;
                }
            }
            zero8(a);
        }
        r = r2;
        c0 = c2;
    }

    if (KIND == 1) {
        if (!last_block(counter)) return;
        // the last block: every row's logit is written; route (route_topk's body)
        __shared__ int sel[1024];
        float* l = xs;              // [rows]
        float* pe = xs + rows;      // [rows]
        float* sp = xs + 2 * rows;  // [k]
        for (int i = threadIdx.x; i < rows; i += blockDim.x) l[i] = __ldcg(out + i);
        __syncthreads();
        route_block(l, rows, k, renorm, 0, ids, probs, weights, by_id, kth, next, pe, sp, sel, red);
        if (threadIdx.x == 0) *counter = 0u;
    }
    if (KIND == 2) {
        // the block's best, then the grid's in the last block
        if (p == 0) {
            red[warp] = best_v;
            redi[warp] = best_i;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float bv = red[0];
            int bi = redi[0];
            for (int i = 1; i < 8; i++) {
                if (arg_better(red[i], redi[i], bv, bi)) {
                    bv = red[i];
                    bi = redi[i];
                }
            }
            part_v[blockIdx.x] = bv;
            part_i[blockIdx.x] = bi;
        }
        if (!last_block(counter)) return;
        float bv = f32_bits(0x7fc00000u);
        int bi = 0x7fffffff;
        for (int b = threadIdx.x; b < (int)gridDim.x; b += blockDim.x) {
            const float v = __ldcg(part_v + b);
            const int i = __ldcg(part_i + b);
            if (arg_better(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
        }
        __syncthreads();  // red/redi were last read by thread 0 above
        red[threadIdx.x] = bv;
        redi[threadIdx.x] = bi;
        for (int h = TARFA_LANES / 2; h >= 1; h >>= 1) {
            __syncthreads();
            if ((int)threadIdx.x < h &&
                arg_better(red[threadIdx.x + h], redi[threadIdx.x + h], red[threadIdx.x],
                           redi[threadIdx.x])) {
                red[threadIdx.x] = red[threadIdx.x + h];
                redi[threadIdx.x] = redi[threadIdx.x + h];
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            const u32 tok = (u32)(redi[0] == 0x7fffffff ? 0 : redi[0]);
            st->token = tok;
            tok_log[st->step] = tok;
            st->step = st->step + 1;
            st->pos = st->pos + 1;
            *counter = 0u;
        }
    }
}

#define DMV_ARGS(W)                                                                             \
    const W* __restrict__ w, int rows, int cols, const float* x,                                \
        const float* __restrict__ norm_w, float eps, const float* __restrict__ bias0,           \
        const float* __restrict__ bias1, const float* __restrict__ bias2, int split1,           \
        int split2, float* out, int mode, float* xn_out

extern "C" __global__ void __launch_bounds__(256, 4) dmv_bf16(DMV_ARGS(u16)) {
    dmv_body<u16, 0>(w, rows, cols, x, norm_w, eps, bias0, bias1, bias2, split1, split2, out, mode,
                     xn_out, nullptr, 0, 0, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                     nullptr, nullptr, nullptr, nullptr);
}

extern "C" __global__ void __launch_bounds__(256) dmv_f32(DMV_ARGS(float)) {
    dmv_body<float, 0>(w, rows, cols, x, norm_w, eps, bias0, bias1, bias2, split1, split2, out,
                       mode, xn_out, nullptr, 0, 0, nullptr, nullptr, nullptr, nullptr, nullptr,
                       nullptr, nullptr, nullptr, nullptr, nullptr);
}

#define ROUTER_ARGS(W)                                                                          \
    const W* __restrict__ w, int rows, int cols, const float* x,                                \
        const float* __restrict__ norm_w, float eps, float* logits, float* xn_out,              \
        u32* counter, int k, int renorm, u32* __restrict__ ids, float* __restrict__ probs,      \
        float* __restrict__ weights, u32* __restrict__ by_id, float* __restrict__ kth,          \
        float* __restrict__ next

// The router of one token: logits = W_router RMSNorm(x) (block 0 writes RMSNorm(x) to xn_out
// for the expert kernels), then softmax and top-k in the last block (route_topk's outputs for
// token 0 at the given record pointers).
extern "C" __global__ void __launch_bounds__(256) router_bf16(ROUTER_ARGS(u16)) {
    dmv_body<u16, 1>(w, rows, cols, x, norm_w, eps, nullptr, nullptr, nullptr, rows, rows, logits,
                     0, xn_out, counter, k, renorm, ids, probs, weights, by_id, kth, next, nullptr,
                     nullptr, nullptr, nullptr);
}

extern "C" __global__ void __launch_bounds__(256) router_f32(ROUTER_ARGS(float)) {
    dmv_body<float, 1>(w, rows, cols, x, norm_w, eps, nullptr, nullptr, nullptr, rows, rows,
                       logits, 0, xn_out, counter, k, renorm, ids, probs, weights, by_id, kth,
                       next, nullptr, nullptr, nullptr, nullptr);
}

#define LMHEAD_ARGS(W)                                                                          \
    const W* __restrict__ w, int rows, int cols, const float* x,                                \
        const float* __restrict__ norm_w, float eps, float* logits, u32* counter,               \
        float* __restrict__ part_v, int* __restrict__ part_i, DecodeState* st,                  \
        u32* __restrict__ tok_log

// logits = W_lm RMSNorm(x), then the greedy token into the state and the token log.
extern "C" __global__ void __launch_bounds__(256, 4) lmhead_bf16(LMHEAD_ARGS(u16)) {
    dmv_body<u16, 2>(w, rows, cols, x, norm_w, eps, nullptr, nullptr, nullptr, rows, rows, logits,
                     0, nullptr, counter, 0, 0, nullptr, nullptr, nullptr, nullptr, nullptr,
                     nullptr, part_v, part_i, st, tok_log);
}

extern "C" __global__ void __launch_bounds__(256) lmhead_f32(LMHEAD_ARGS(float)) {
    dmv_body<float, 2>(w, rows, cols, x, norm_w, eps, nullptr, nullptr, nullptr, rows, rows,
                       logits, 0, nullptr, counter, 0, 0, nullptr, nullptr, nullptr, nullptr,
                       nullptr, nullptr, part_v, part_i, st, tok_log);
}

// ---------------------------------------------------------------------------------------------
// Gate and up projections with the SwiGLU for one token (moe.cu gate_up_*):
//   act[j*rows + i] = silu(dot(W_gate[e][i], xs)) * dot(W_up[e][i], xs),  e = ids[j] (0 if null)
// with xs = x or RMSNorm(x) (norm_w not null: a dense layer normalising h itself). Grid (G, k):
// slot j = blockIdx.y; rows i = blockIdx.x*8 + warp, + 8*G, ... Dynamic shared memory: cols floats.
template <typename W>
__device__ __forceinline__ void gate_up_dec_body(const W* __restrict__ gate,
                                                 const W* __restrict__ up, int rows, int cols,
                                                 const u32* ids, const float* x,
                                                 const float* __restrict__ norm_w, float eps,
                                                 float* __restrict__ act) {
    TARFA_DYN_SMEM(float, xs);
    const int p = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int j = blockIdx.y;
    const int nw = gridDim.x * 8;
    grid_dep_wait();
    grid_dep_launch();
    const long e = ids != nullptr ? (long)ids[j] : 0;
    const W* gbase = gate + e * rows * (long)cols;
    const W* ubase = up + e * rows * (long)cols;
    int i = blockIdx.x * 8 + warp;
    int c0 = 0;
    Pack8<W> wg[DEC_GROUP], wu[DEC_GROUP];
    if (i < rows) {
        load_group<W>(wg, gbase + (long)i * cols, 0, cols, p);
        load_group<W>(wu, ubase + (long)i * cols, 0, cols, p);
    }
    stage_input(xs, x, cols, norm_w, eps, nullptr);
    float ag[8], au[8];
    zero8(ag);
    zero8(au);
    while (i < rows) {
        fma_group<W>(ag, wg, xs, c0, cols, p);
        fma_group<W>(au, wu, xs, c0, cols, p);
        int i2 = i, c2 = c0 + DEC_GROUP;
        if ((c2 << 8) >= cols) {
            c2 = 0;
            i2 = i + nw;
        }
        if (i2 < rows) {
            load_group<W>(wg, gbase + (long)i2 * cols, c2, cols, p);
            load_group<W>(wu, ubase + (long)i2 * cols, c2, cols, p);
        }
        if (c2 == 0) {
            const float g = warp_tree(ag);
            const float u = warp_tree(au);
            if (p == 0) act[(long)j * rows + i] = __fmul_rn(det_silu(g), u);
            zero8(ag);
            zero8(au);
        }
        i = i2;
        c0 = c2;
    }
}

#define GATE_UP_DEC_ARGS(W)                                                                     \
    const W* __restrict__ gate, const W* __restrict__ up, int rows, int cols, const u32* ids,   \
        const float* x, const float* __restrict__ norm_w, float eps, float* __restrict__ act

extern "C" __global__ void __launch_bounds__(256) gate_up_dec_bf16(GATE_UP_DEC_ARGS(u16)) {
    gate_up_dec_body<u16>(gate, up, rows, cols, ids, x, norm_w, eps, act);
}

extern "C" __global__ void __launch_bounds__(256) gate_up_dec_f32(GATE_UP_DEC_ARGS(float)) {
    gate_up_dec_body<float>(gate, up, rows, cols, ids, x, norm_w, eps, act);
}

// ---------------------------------------------------------------------------------------------
// Down projections of the chosen experts for one token, mixed and added to the residual
// (moe.cu down_mix): a warp per output row r, all k experts' dots at once:
//   y_s = dot(W_down[e_s][r], act[j_s]) for the slots s in ascending expert id (j_s = by_id[s],
//   e_s = ids[j_s]); acc = +0; acc = acc + w[j_s] * y_s in that order;
//   (y_sh: acc = acc + sigmoid(s_sh[0]) * y_sh[r]); h[r] = h[r] + acc.
// k <= 8. Grid G blocks of 256; rows r = blockIdx.x*8 + warp, + 8*G, ...
// Dynamic shared memory: k*width floats (the activations).
#define DOWN_MAX_K 8
extern "C" __global__ void __launch_bounds__(256) moe_down_dec(
    const u16* __restrict__ down, int hidden, int width, const u32* ids,
    const float* weights, const u32* by_id, int k, const float* act, const float* y_sh,
    const float* s_sh, float* h) {
    TARFA_DYN_SMEM(float, as);
    __shared__ long ebase[DOWN_MAX_K];
    __shared__ int jslot[DOWN_MAX_K];
    const int p = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nw = gridDim.x * 8;
    // The router's choices were written two kernels back (see the file's header): read from L2.
    if (threadIdx.x < k) {
        const int j = (int)__ldcg(by_id + threadIdx.x);
        jslot[threadIdx.x] = j;
        ebase[threadIdx.x] = (long)__ldcg(ids + j) * hidden * (long)width;
    }
    __syncthreads();
    int r = blockIdx.x * 8 + warp;
    int c = 0;
    Pack8<u16> wv[DOWN_MAX_K];
#pragma unroll
    for (int s = 0; s < DOWN_MAX_K; s++) {
        const int e = 8 * p;
        if (s < k && r < hidden && e < width) wv[s].load(down + ebase[s] + (long)r * width + e);
    }
    grid_dep_wait();
    grid_dep_launch();
    for (int i = threadIdx.x; i < k * width; i += blockDim.x) as[i] = act[i];
    __syncthreads();
    float acc[DOWN_MAX_K][8];
#pragma unroll
    for (int s = 0; s < DOWN_MAX_K; s++) zero8(acc[s]);
    while (r < hidden) {
        const int e = (c << 8) + 8 * p;
#pragma unroll
        for (int s = 0; s < DOWN_MAX_K; s++) {
            if (s < k && e < width) fma8<u16>(acc[s], wv[s], as + jslot[s] * width + e);
        }
        int r2 = r, c2 = c + 1;
        if ((c2 << 8) >= width) {
            c2 = 0;
            r2 = r + nw;
        }
        const int e2 = (c2 << 8) + 8 * p;
#pragma unroll
        for (int s = 0; s < DOWN_MAX_K; s++) {
            if (s < k && r2 < hidden && e2 < width)
                wv[s].load(down + ebase[s] + (long)r2 * width + e2);
        }
        if (c2 == 0) {
            float y[DOWN_MAX_K];
#pragma unroll
            for (int s = 0; s < DOWN_MAX_K; s++) y[s] = s < k ? warp_tree(acc[s]) : 0.0f;
            if (p == 0) {
                float mix = 0.0f;
#pragma unroll
                for (int s = 0; s < DOWN_MAX_K; s++) {
                    if (s < k) mix = __fadd_rn(mix, __fmul_rn(weights[jslot[s]], y[s]));
                }
                if (y_sh != nullptr) mix = __fadd_rn(mix, __fmul_rn(det_sigmoid(s_sh[0]), y_sh[r]));
                h[r] = __fadd_rn(h[r], mix);
            }
#pragma unroll
            for (int s = 0; s < DOWN_MAX_K; s++) zero8(acc[s]);
        }
        r = r2;
        c = c2;
    }
}

// ---------------------------------------------------------------------------------------------
// Attention of one token at position P = st->pos (norm_rope.cu rope_append_kv + attention.cu,
// T = 1), a block per (query head, 32-wide slice of the head dimension):
//   q = the head's raw projection, k, v = its KV head's; with q_norm/k_norm (per-head RMSNorm,
//   both or neither): q = RMSNorm(q), k = RMSNorm(k) (rmsnorm over D); RoPE at P on q and k;
//   the block of slice 0 of the group's first query head appends k, v to the cache at P;
//   s_j = dot(q, k_j) * scale for j <= P (k_P from shared memory: the bits just appended),
//   softmax as attention.cu, o[d] = canonical dot over j of (p_j, v_j[d]) for the slice's d.
// The score of one position: a warp, thread p holding lanes p + 32i (i < 8): the tree levels
// 128, 64, 32 are in-thread (slot i with i+4, i+2, i+1), 16..1 are shfl_down; the same pairs
// a[v] + a[v+h] as warp_tree; each warp scores 8 positions at a time. Requires D <= 256. Scores go to scratch row (qh*gridDim.y + slice)
// of n_stride floats. Dynamic shared memory: 3*D floats.
#define ATT_TILE 32
extern "C" __global__ void __launch_bounds__(256) attn_decode(
    const float* q_raw, const float* k_raw, const float* v_raw, int hq, int hkv, int d,
    const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, const DecodeState* st,
    float* k_cache, float* v_cache, int cap, float scale, float* scratch, int n_stride,
    float* __restrict__ o) {
    TARFA_DYN_SMEM(float, sm);
    __shared__ float red[TARFA_LANES];
    __shared__ float tile[TARFA_LANES][ATT_TILE + 1];
    __shared__ float rs[2];
    grid_dep_wait();
    grid_dep_launch();
    const int v = threadIdx.x;
    const int p = v & 31;
    const int warp = v >> 5;
    const int qh = blockIdx.x;
    const int slice = blockIdx.y;
    const int group = hq / hkv;
    const int kvh = qh / group;
    const int pos = st->pos;
    const int n = pos + 1;
    float* qs = sm;
    float* ks = sm + d;
    float* vs = sm + 2 * d;
    for (int i = v; i < d; i += TARFA_LANES) {
        qs[i] = q_raw[(long)qh * d + i];
        ks[i] = k_raw[(long)kvh * d + i];
        vs[i] = v_raw[(long)kvh * d + i];
    }
    __syncthreads();
    if (q_norm != nullptr) {
        if (warp < 2) {
            float* x = warp == 0 ? qs : ks;
            const float ss = warp_dot_f32(x, x, d, p);
            if (p == 0) rs[warp] = det_rsqrt(__fadd_rn(__fdiv_rn(ss, (float)d), eps));
        }
        __syncthreads();
        const float rq = rs[0], rk = rs[1];
        for (int i = v; i < d; i += TARFA_LANES) {
            qs[i] = __fmul_rn(q_norm[i], __fmul_rn(qs[i], rq));
            ks[i] = __fmul_rn(k_norm[i], __fmul_rn(ks[i], rk));
        }
        __syncthreads();
    }
    const int half = d / 2;
    const float* c = cos_t + (long)pos * half;
    const float* s = sin_t + (long)pos * half;
    for (int i = v; i < half; i += TARFA_LANES) {
        float a = qs[i], b = qs[i + half];
        qs[i] = __fsub_rn(__fmul_rn(a, c[i]), __fmul_rn(b, s[i]));
        qs[i + half] = __fadd_rn(__fmul_rn(b, c[i]), __fmul_rn(a, s[i]));
        a = ks[i];
        b = ks[i + half];
        ks[i] = __fsub_rn(__fmul_rn(a, c[i]), __fmul_rn(b, s[i]));
        ks[i + half] = __fadd_rn(__fmul_rn(b, c[i]), __fmul_rn(a, s[i]));
    }
    __syncthreads();
    const float* keys = k_cache + (long)kvh * cap * d;
    const float* vals = v_cache + (long)kvh * cap * d;
    if (qh % group == 0 && slice == 0) {
        for (int i = v; i < d; i += TARFA_LANES) {
            k_cache[((long)kvh * cap + pos) * d + i] = ks[i];
            v_cache[((long)kvh * cap + pos) * d + i] = vs[i];
        }
    }

    // scores: warp w takes positions j = 8w .. 8w+7, then + 64, ...: 8 at a time
    float qv[8];
#pragma unroll
    for (int i = 0; i < 8; i++) qv[i] = (p + 32 * i < d) ? qs[p + 32 * i] : 0.0f;
    float* sc = scratch + (long)(qh * gridDim.y + slice) * n_stride;
#define ATT_U 8
    for (int j0 = ATT_U * warp; j0 < n; j0 += 8 * ATT_U) {
        float a[ATT_U][8];
#pragma unroll
        for (int u = 0; u < ATT_U; u++) {
            const int j = j0 + u;
            const float* kj = j == pos ? ks : keys + (long)j * d;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int e = p + 32 * i;
                a[u][i] = (j < n && e < d) ? fmaf(qv[i], kj[e], 0.0f) : 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < ATT_U; u++) {
#pragma unroll
            for (int i = 0; i < 4; i++) a[u][i] = __fadd_rn(a[u][i], a[u][i + 4]);
#pragma unroll
            for (int i = 0; i < 2; i++) a[u][i] = __fadd_rn(a[u][i], a[u][i + 2]);
            a[u][0] = __fadd_rn(a[u][0], a[u][1]);
        }
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1) {
#pragma unroll
            for (int u = 0; u < ATT_U; u++)
                a[u][0] = __fadd_rn(a[u][0], __shfl_down_sync(TARFA_FULL_MASK, a[u][0], off));
        }
        if (p == 0) {
#pragma unroll
            for (int u = 0; u < ATT_U; u++) {
                if (j0 + u < n) sc[j0 + u] = __fmul_rn(a[u][0], scale);
            }
        }
    }
    __syncthreads();
    const float m = block_max_256(sc, n, red);
    // thread v writes e_j for j = v, v+256, ...: exactly the terms its lane then sums
    for (int j = v; j < n; j += TARFA_LANES) sc[j] = det_exp(__fsub_rn(sc[j], m));
    const float total = block_sum_256(sc, n, red);
    for (int j = v; j < n; j += TARFA_LANES) sc[j] = __fdiv_rn(sc[j], total);

    // the output slice: lane v = thread v over positions j = v, v+256, ... (attention.cu)
    const int d0 = slice * ATT_TILE;
    float acc[ATT_TILE];
#pragma unroll
    for (int i = 0; i < ATT_TILE; i++) acc[i] = 0.0f;
    for (int j = v; j < n; j += TARFA_LANES) {
        const float pj = sc[j];
        const float* vr = (j == pos ? vs : vals + (long)j * d) + d0;
#pragma unroll
        for (int i = 0; i < ATT_TILE; i++) {
            if (d0 + i < d) acc[i] = fmaf(pj, vr[i], acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < ATT_TILE; i++) tile[v][i] = acc[i];
    for (int hh = 128; hh >= 1; hh >>= 1) {
        __syncthreads();
        for (int idx = v; idx < hh * ATT_TILE; idx += TARFA_LANES) {
            const int lane = idx / ATT_TILE, i = idx % ATT_TILE;
            tile[lane][i] = __fadd_rn(tile[lane][i], tile[lane + hh][i]);
        }
    }
    __syncthreads();
    if (v < ATT_TILE && d0 + v < d) o[(long)qh * d + d0 + v] = tile[0][v];
}
