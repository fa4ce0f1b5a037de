// The decode step (one token) as few wide kernels, for batch-1 decode at memory speed
// (tarfa-cuda/src/decode.rs builds the launch list and replays it as one CUDA graph).
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
// - the router's top-k is computed by every block of the experts' kernels from the router's
//   logits, with the same operations in the same order (route_select), so every block holds the
//   same choice;
// - the position and the token come from a DecodeState in device memory, so one captured graph
//   serves every position; the lm_head kernel's last block writes the greedy token (the lowest
//   index among equal maxima, NaN never chosen over a number: generate.rs `argmax`) and advances
//   the state.
//
// Programmatic dependent launch: every kernel here calls grid_dep_wait(), then grid_dep_launch()
// (common.cuh says why in that order); the `e` forms and moe_down_route2f8e first load what
// cannot change during the step (weights, the residuals' slots), the others load nothing before.
// (The first versions of these kernels and the rejected experiments are in git history, indexed
// by validation/kernels/README.md.)
#include "common.cuh"

// The step's state in device memory: the input token, its position, and the count of tokens the
// lm_head kernel has written to the token log since the host last reset it.
struct DecodeState {
    u32 token;
    int pos;
    int step;
    int pad;
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
#define DEC_ROUTE_MAX_K 8  // the decode kernels take top-k <= 8 (decode.rs)

// Loads group c0 (chunks c0 .. c0+7) of a row of n elements: thread p's 8 elements of each.
// FULL (the `f` entry points): n is a multiple of 256 * G, so every chunk
// of every group exists and the per-chunk guards (a branch and a reconvergence point around
// each chunk's 8 FMAs) go away; the same loads and FMAs in the same order.
template <typename W, int G = DEC_GROUP, bool FULL = false>
__device__ __forceinline__ void load_group(Pack8<W> (&w)[G], const W* __restrict__ row, int c0,
                                           int n, int p) {
#pragma unroll
    for (int i = 0; i < G; i++) {
        const int e = ((c0 + i) << 8) + 8 * p;
        if (FULL || e < n) w[i].load(row + e);
    }
}

// Accumulates group c0 of a row with x (shared or global, 16-byte aligned).
template <typename W, int G = DEC_GROUP, bool FULL = false>
__device__ __forceinline__ void fma_group(float a[8], const Pack8<W> (&w)[G], const float* x,
                                          int c0, int n, int p) {
#pragma unroll
    for (int i = 0; i < G; i++) {
        const int e = ((c0 + i) << 8) + 8 * p;
        if (FULL || e < n) fma8<W>(a, w[i], x + e);
    }
}

// fma_group for two rows over the same x (gate and up): each 16-byte x load serves both.
template <typename W, bool FULL = false>
__device__ __forceinline__ void fma_group_pair(float a[8], float b[8],
                                               const Pack8<W> (&wa)[DEC_GROUP],
                                               const Pack8<W> (&wb)[DEC_GROUP], const float* x,
                                               int c0, int n, int p) {
#pragma unroll
    for (int i = 0; i < DEC_GROUP; i++) {
        const int e = ((c0 + i) << 8) + 8 * p;
        if (FULL || e < n) {
            const float4 x0 = *reinterpret_cast<const float4*>(x + e);
            const float4 x1 = *reinterpret_cast<const float4*>(x + e + 4);
            const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
            for (int t = 0; t < 8; t++) {
                a[t] = fmaf(wa[i].at(t), xv[t], a[t]);
                b[t] = fmaf(wb[i].at(t), xv[t], b[t]);
            }
        }
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

// The row kernels (dmv2, lmhead2, gate_up_dec2, gate_up_route2, moe_down_dec2 and their
// unguarded and early forms) stage their input the same way, in two halves around the first weight loads:
// - stage_issue: async 16-byte copies (cp.async, no registers) of x into xs[0..n) and of the
//   RMSNorm weights into xs[n..2n), issued before any weight load, so these few kilobytes are
//   not queued behind the kernel's megabytes of weights (the first version loaded x, then
//   norm_w, in two dependent round trips behind them: ~4 us per kernel on the H200, ncu);
// - stage_finish: wait, one barrier; with a norm, the lanes of the sum of squares (the canonical
//   dot of stage_input's warp 0) by 64 threads, the tree and rsqrt by warp 0, the normalised
//   elements y_i = w_i * (x_i * r) written over w_i by every thread, 4 at a time (a first try
//   had every warp compute the whole sum: 32 warps x 8 KB of shared reads per multiprocessor
//   made q|k|v 10% slower; the kernels are bound by issue slots). Returns the
//   vector the rows use: the same bits stage_input leaves in xs (block 0 also writes it to
//   xn_out). Needs 2n floats of dynamic shared memory with a norm, n without; n % 4 == 0 and
//   16-byte aligned x and norm_w, else stage_finish falls back to stage_input.
__device__ __forceinline__ bool stage_issue(float* xs, const float* x, int n,
                                            const float* __restrict__ norm_w) {
    const bool fast = (n & 3) == 0 && ((((u64)x) | ((u64)norm_w)) & 15) == 0;
    if (fast) {
        float* ws = xs + n;
        for (int i = 4 * (int)threadIdx.x; i < n; i += 4 * (int)blockDim.x) {
            async_copy16(xs + i, x + i);
            if (norm_w != nullptr) async_copy16(ws + i, norm_w + i);
        }
    }
    return fast;
}

__device__ __forceinline__ const float* stage_finish(float* xs, const float* x, int n,
                                                     const float* __restrict__ norm_w, float eps,
                                                     float* xn_out, bool fast) {
    if (!fast) {
        stage_input(xs, x, n, norm_w, eps, xn_out);
        return xs;
    }
    async_copy_wait();
    __syncthreads();
    if (norm_w == nullptr) return xs;
    float* ws = xs + n;
    // the sum of squares: thread t < 64 accumulates lanes 4t..4t+3 of the canonical dot (x_v^2,
    // x_{v+256}^2, ... in increasing order; one 16-byte shared load per 256-chunk), then warp 0
    // runs the tree over the 256 lanes (thread p holding lanes 8p..8p+7, warp_tree_fast) and the
    // rsqrt, and every thread scales four elements at a time: the issue slots this takes are a
    // quarter of the per-warp version's (the q|k|v kernel's 4 blocks per multiprocessor each
    // stage the same vector, so this cost adds up)
    __shared__ __align__(16) float lanes[TARFA_LANES];
    __shared__ float r_s;
    const int tid = threadIdx.x;
    if (tid < TARFA_LANES / 4) {
        float4 l;
        l.x = l.y = l.z = l.w = 0.0f;
        for (int i = 4 * tid; i < n; i += TARFA_LANES) {
            const float4 v = *reinterpret_cast<const float4*>(xs + i);
            l.x = fmaf(v.x, v.x, l.x);
            l.y = fmaf(v.y, v.y, l.y);
            l.z = fmaf(v.z, v.z, l.z);
            l.w = fmaf(v.w, v.w, l.w);
        }
        *reinterpret_cast<float4*>(lanes + 4 * tid) = l;
    }
    __syncthreads();
    if (tid < 32) {
        const float4 l0 = *reinterpret_cast<const float4*>(lanes + 8 * tid);
        const float4 l1 = *reinterpret_cast<const float4*>(lanes + 8 * tid + 4);
        const float a[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
        const float ss = warp_tree_fast(a);
        if (tid == 0) r_s = det_rsqrt(__fadd_rn(__fdiv_rn(ss, (float)n), eps));
    }
    __syncthreads();
    const float r = r_s;
    for (int i = 4 * tid; i < n; i += 4 * (int)blockDim.x) {
        const float4 x4 = *reinterpret_cast<const float4*>(xs + i);
        float4 w4 = *reinterpret_cast<const float4*>(ws + i);
        w4.x = __fmul_rn(w4.x, __fmul_rn(x4.x, r));
        w4.y = __fmul_rn(w4.y, __fmul_rn(x4.y, r));
        w4.z = __fmul_rn(w4.z, __fmul_rn(x4.z, r));
        w4.w = __fmul_rn(w4.w, __fmul_rn(x4.w, r));
        *reinterpret_cast<float4*>(ws + i) = w4;
    }
    __syncthreads();
    if (xn_out != nullptr && blockIdx.x == 0) {
        for (int i = 4 * tid; i < n; i += 4 * (int)blockDim.x) {
            *reinterpret_cast<float4*>(xn_out + i) = *reinterpret_cast<const float4*>(ws + i);
        }
    }
    return ws;
}

// The renormalising canonical sum over the selection in rank order (lane r = +0 + p of rank r,
// route_block's block_sum_256 of sp), by one warp (every lane calls it; every lane gets it).
__device__ __forceinline__ float route_renorm_sum(const float* pe, const int* sel, int k) {
    const int p = threadIdx.x & 31;
    float a[8];
    zero8(a);
    for (int base = 8 * p; base < k; base += TARFA_LANES) {
#pragma unroll
        for (int t = 0; t < 8; t++) {
            if (base + t < k) a[t] = __fadd_rn(a[t], pe[sel[base + t]]);
        }
    }
    return __shfl_sync(TARFA_FULL_MASK, warp_tree_fast(a), 0);
}

// The router's records from the selection (sel: the k chosen experts in rank order, pe: the
// probabilities, both in shared memory), by one warp: the renormalising canonical sum over the
// selection in rank order (lane r = +0 + p of rank r, route_block's block_sum_256 of sp), then
// ids, probs, weights, by_id (ascending id) and kth, as route_block writes them for token 0.
__device__ __forceinline__ void route_records_warp(const float* pe, const int* sel, int k,
                                                   int renorm, u32* __restrict__ ids,
                                                   float* __restrict__ probs,
                                                   float* __restrict__ weights,
                                                   u32* __restrict__ by_id,
                                                   float* __restrict__ kth) {
    const int p = threadIdx.x & 31;
    const float s = renorm ? route_renorm_sum(pe, sel, k) : 1.0f;
    for (int j = p; j < k; j += 32) {
        const int e = sel[j];
        const float pj = pe[e];
        ids[j] = (u32)e;
        probs[j] = pj;
        weights[j] = renorm ? __fdiv_rn(pj, s) : pj;
        int at = 0;  // the slot's place in ascending expert id (ids are distinct)
        for (int jj = 0; jj < k; jj++) at += (sel[jj] < e) ? 1 : 0;
        by_id[at] = (u32)j;
    }
    if (p == 0) kth[0] = pe[sel[k - 1]];
}

// The router's selection, shared by gate_up_route2 and moe_down_route2f8e (route_block's
// operations in the same order, common.cuh): the logits into l (shared), the
// probabilities p_i into pe, their total-order keys into key (3 x E floats of shared memory at
// sm, in that order), and sel[r] = the expert of rank r (r < k); `next` (when not null) gets the
// probability of rank k (NaN when E = k). Every thread of the 256-thread block calls it; it ends
// with a barrier. The rank loop reads the keys 4 at a time when E % 4 == 0 (a count: any order
// of the comparisons gives the same rank).
__device__ __forceinline__ void route_select(const float* logits, int e_count, int k, float* sm,
                                             int* sel, float* __restrict__ next) {
    __shared__ __align__(16) float lanes[TARFA_LANES];
    __shared__ float total_s;
    const int v = threadIdx.x;
    const int p = v & 31;
    const int warp = v >> 5;
    float* l = sm;
    float* pe = sm + e_count;
    int* key = reinterpret_cast<int*>(sm + 2 * e_count);
    for (int i = v; i < e_count; i += TARFA_LANES) l[i] = __ldcg(logits + i);
    __syncthreads();
    float m = f32_bits(0xff800000u);
    for (int i = p; i < e_count; i += 32) m = fmaxf(m, l[i]);
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) m = fmaxf(m, __shfl_xor_sync(TARFA_FULL_MASK, m, off));
    float a = 0.0f;
    for (int i = v; i < e_count; i += TARFA_LANES) {
        const float e = det_exp(__fsub_rn(l[i], m));
        pe[i] = e;
        a = __fadd_rn(a, e);
    }
    lanes[v] = a;
    __syncthreads();
    if (warp == 0) {
        const float4 l0 = *reinterpret_cast<const float4*>(lanes + 8 * p);
        const float4 l1 = *reinterpret_cast<const float4*>(lanes + 8 * p + 4);
        const float t8[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
        const float total = warp_tree_fast(t8);
        if (p == 0) total_s = total;
    }
    __syncthreads();
    const float total = total_s;
    for (int i = v; i < e_count; i += TARFA_LANES) {
        const float pi = __fdiv_rn(pe[i], total);
        pe[i] = pi;
        key[i] = total_order_key(pi);
    }
    __syncthreads();
    const bool quad = (e_count & 3) == 0 && (((u64)key) & 15) == 0;
    for (int i = v; i < e_count; i += TARFA_LANES) {
        const int ki = key[i];
        int rank = 0;
        if (quad) {
#pragma unroll 4
            for (int j = 0; j < e_count; j += 4) {
                const int4 kj = *reinterpret_cast<const int4*>(key + j);
                rank += (kj.x > ki || (kj.x == ki && j < i)) ? 1 : 0;
                rank += (kj.y > ki || (kj.y == ki && j + 1 < i)) ? 1 : 0;
                rank += (kj.z > ki || (kj.z == ki && j + 2 < i)) ? 1 : 0;
                rank += (kj.w > ki || (kj.w == ki && j + 3 < i)) ? 1 : 0;
            }
        } else {
            for (int j = 0; j < e_count; j++) {
                const int kj = key[j];
                rank += (kj > ki || (kj == ki && j < i)) ? 1 : 0;
            }
        }
        if (rank < k) sel[rank] = i;
        if (next != nullptr && rank == k) next[0] = pe[i];
    }
    if (next != nullptr && v == 0 && e_count == k) next[0] = f32_bits(0x7fc00000u);
    __syncthreads();
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
// KIND 2 (lm_head): no bias; the last block writes the greedy token of out[0..rows) to st->token
// and tok_log[st->step], then advances st (pos + 1, step + 1).
// The input is staged by stage_issue/stage_finish (issued before the weights, see there) and
// each row's lanes reduced by warp_tree_fast. Block 256 threads; dynamic shared memory: cols
// floats, 2 * cols with a norm.
// G: the chunks of a row in flight per warp (16 for rows wider than 2,048: a whole 4,096-wide
// row in one round trip). FULL (the `f` entry points): cols is a multiple of 256 * G, so there
// are no per-chunk guards. EW (the `e` entry points, for steps with programmatic launch): each
// warp's first weights loaded before grid_dep_wait, so a block that starts while the previous
// kernel drains fetches its weights during that kernel's tail; the input is staged after the
// wait, behind them. Every form makes the same loads and operations: the same bits.
template <typename W, int KIND, int G = DEC_GROUP, bool FULL = false, bool EW = false>
__device__ __forceinline__ void dmv_body(
    const W* __restrict__ w, int rows, int cols, const float* x, const float* __restrict__ norm_w,
    float eps, const float* __restrict__ bias0, const float* __restrict__ bias1,
    const float* __restrict__ bias2, int split1, int split2, float* out, int mode, float* xn_out,
    // KIND 2
    u32* counter, float* __restrict__ part_v, int* __restrict__ part_i, DecodeState* st,
    u32* __restrict__ tok_log) {
    TARFA_DYN_SMEM(float, xs);
    __shared__ float red[TARFA_LANES];
    __shared__ int redi[TARFA_LANES];
    const int p = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nw = gridDim.x * 8;
    int r = blockIdx.x * 8 + warp;
    int c0 = 0;
    Pack8<W> wv[G];
    // the input first, then the weights (stage_issue says why); EW: the weights first
    if (EW && r < rows) load_group<W, G, FULL>(wv, w + (long)r * cols, 0, cols, p);
    grid_dep_wait();
    grid_dep_launch();
    const bool fast = stage_issue(xs, x, cols, norm_w);
    if (!EW && r < rows) load_group<W, G, FULL>(wv, w + (long)r * cols, 0, cols, p);
    const float* xin = stage_finish(xs, x, cols, norm_w, eps, xn_out, fast);

    float best_v = f32_bits(0x7fc00000u);
    int best_i = 0x7fffffff;
    float a[8];
    zero8(a);
    // the row's residual copied to shared memory with the row's first weights (cp.async: no
    // register held; one more live register spills at the 64 that 4 blocks per multiprocessor
    // allow), so the epilogue does not wait for it; nothing else writes out[r] during the
    // kernel. A bias stays a load in the epilogue.
    __shared__ float pre_o[8];
    auto prefetch_epilogue = [&](int rr) {
        if (KIND != 2 && mode == 1 && p == 0 && rr < rows) async_copy4(pre_o + warp, out + rr);
    };
    prefetch_epilogue(r);
    while (r < rows) {
        fma_group<W, G, FULL>(a, wv, xin, c0, cols, p);
        int r2 = r, c2 = c0 + G;
        if ((c2 << 8) >= cols) {
            c2 = 0;
            r2 = r + nw;
        }
        if (r2 < rows) load_group<W, G, FULL>(wv, w + (long)r2 * cols, c2, cols, p);
        if (c2 == 0) {
            float y = warp_tree_fast(a);
            if (KIND != 2) {
                if (p == 0) {
                    const float* b = r < split1 ? (bias0 ? bias0 + r : nullptr)
                                   : r < split2 ? (bias1 ? bias1 + (r - split1) : nullptr)
                                                : (bias2 ? bias2 + (r - split2) : nullptr);
                    if (b != nullptr) y = __fadd_rn(y, *b);
                    if (mode == 1) {
                        async_copy_wait();
                        y = __fadd_rn(pre_o[warp], y);
                    }
                    out[r] = y;
                }
                prefetch_epilogue(r2);  // after this row's read of pre_o
            } else if (p == 0) {
                float* o = out + r;
                *o = (mode == 1) ? __fadd_rn(*o, y) : y;
                if (arg_better(y, r, best_v, best_i)) {
                    best_v = y;
                    best_i = r;
                }
            }
            zero8(a);
        }
        r = r2;
        c0 = c2;
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
#define DMV_CALL                                                                                \
    (w, rows, cols, x, norm_w, eps, bias0, bias1, bias2, split1, split2, out, mode, xn_out,     \
     nullptr, nullptr, nullptr, nullptr, nullptr)

// The matrix-vector kernels (q|k|v, o_proj, the router's logits, dense and shared-expert down
// projections). The `w` forms keep 16 chunks of a row in flight (rows wider than 2,048: 128
// registers, 2 blocks per multiprocessor); `f`: rows of whole groups (cols a multiple of 2,048,
// or 4,096 for `w`), no guards; `e`: first weights before the wait.
extern "C" __global__ void __launch_bounds__(256, 4) dmv2_bf16(DMV_ARGS(u16)) {
    dmv_body<u16, 0> DMV_CALL;
}

extern "C" __global__ void __launch_bounds__(256) dmv2_f32(DMV_ARGS(float)) {
    dmv_body<float, 0> DMV_CALL;
}

extern "C" __global__ void __launch_bounds__(256, 2) dmv2w_bf16(DMV_ARGS(u16)) {
    dmv_body<u16, 0, 16> DMV_CALL;
}

extern "C" __global__ void __launch_bounds__(256, 4) dmv2f_bf16(DMV_ARGS(u16)) {
    dmv_body<u16, 0, DEC_GROUP, true> DMV_CALL;
}

extern "C" __global__ void __launch_bounds__(256, 2) dmv2wf_bf16(DMV_ARGS(u16)) {
    dmv_body<u16, 0, 16, true> DMV_CALL;
}

extern "C" __global__ void __launch_bounds__(256, 4) dmv2fe_bf16(DMV_ARGS(u16)) {
    dmv_body<u16, 0, DEC_GROUP, true, true> DMV_CALL;
}

extern "C" __global__ void __launch_bounds__(256, 2) dmv2wfe_bf16(DMV_ARGS(u16)) {
    dmv_body<u16, 0, 16, true, true> DMV_CALL;
}

#define LMHEAD_ARGS(W)                                                                          \
    const W* __restrict__ w, int rows, int cols, const float* x,                                \
        const float* __restrict__ norm_w, float eps, float* logits, u32* counter,               \
        float* __restrict__ part_v, int* __restrict__ part_i, DecodeState* st,                  \
        u32* __restrict__ tok_log
#define LMHEAD_CALL                                                                             \
    (w, rows, cols, x, norm_w, eps, nullptr, nullptr, nullptr, rows, rows, logits, 0, nullptr,  \
     counter, part_v, part_i, st, tok_log)

// logits = W_lm RMSNorm(x), then the greedy token into the state and the token log (`f`, `e`:
// as for dmv2).
extern "C" __global__ void __launch_bounds__(256, 4) lmhead2_bf16(LMHEAD_ARGS(u16)) {
    dmv_body<u16, 2> LMHEAD_CALL;
}

extern "C" __global__ void __launch_bounds__(256, 4) lmhead2f_bf16(LMHEAD_ARGS(u16)) {
    dmv_body<u16, 2, DEC_GROUP, true> LMHEAD_CALL;
}

extern "C" __global__ void __launch_bounds__(256, 4) lmhead2fe_bf16(LMHEAD_ARGS(u16)) {
    dmv_body<u16, 2, DEC_GROUP, true, true> LMHEAD_CALL;
}

extern "C" __global__ void __launch_bounds__(256) lmhead2_f32(LMHEAD_ARGS(float)) {
    dmv_body<float, 2> LMHEAD_CALL;
}

// ---------------------------------------------------------------------------------------------
// Gate and up projections with the SwiGLU for one token (moe.cu gate_up_*):
//   act[j*rows + i] = silu(dot(W_gate[e][i], xs)) * dot(W_up[e][i], xs),  e = ids[j] (0 if null)
// with xs = x or RMSNorm(x) (norm_w not null: a dense layer normalising h itself). Grid (G, k):
// slot j = blockIdx.y; rows i = blockIdx.x*8 + warp, + 8*G, ... Dynamic shared memory: cols floats.
//
// The input is staged by stage_issue/stage_finish, issued before the ids and the weights; the
// trees by warp_tree_fast. FULL: cols a multiple of 2,048, no per-chunk guards.
// ROUTE (gate_up_route2/2f): the router's top-k folded in. Every block computes the selection
// itself from the router's logits (route_select: every block holds the same sel[]) and takes
// e = sel[j]; block (0, 0) also writes the router's records (ids, probs, weights, by_id, kth,
// next) while its first weights load. Saves a launch and the round trip for ids (PHASE_LOG P16). Dynamic shared memory: cols + 3E
// floats (no norm: the experts read the router kernel's normalised vector).
struct RouteOut {
    const float* logits;
    int e_count, k, renorm;
    u32* ids;
    float* probs;
    float* weights;
    u32* by_id;
    float* kth;
    float* next;
};

template <typename W, bool FULL = false, bool ROUTE = false>
__device__ __forceinline__ void gate_up_dec_body(const W* __restrict__ gate,
                                                 const W* __restrict__ up, int rows, int cols,
                                                 const u32* ids, const float* x,
                                                 const float* __restrict__ norm_w, float eps,
                                                 float* __restrict__ act, RouteOut ro = {}) {
    TARFA_DYN_SMEM(float, xs);
    const int p = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int j = blockIdx.y;
    const int nw = gridDim.x * 8;
    grid_dep_wait();
    grid_dep_launch();
    // the input's copy is issued before the ids and the weights (stage_issue)
    const bool fast = stage_issue(xs, x, cols, norm_w);
    __shared__ int sel[ROUTE ? DEC_ROUTE_MAX_K : 1];
    const bool records = ROUTE && blockIdx.x == 0 && blockIdx.y == 0;
    if constexpr (ROUTE) route_select(ro.logits, ro.e_count, ro.k, xs + cols, sel, records ? ro.next : nullptr);
    const long e = ROUTE ? (long)sel[j] : ids != nullptr ? (long)ids[j] : 0;
    const W* gbase = gate + e * rows * (long)cols;
    const W* ubase = up + e * rows * (long)cols;
    int i = blockIdx.x * 8 + warp;
    int c0 = 0;
    Pack8<W> wg[DEC_GROUP], wu[DEC_GROUP];
    if (i < rows) {
        load_group<W, DEC_GROUP, FULL>(wg, gbase + (long)i * cols, 0, cols, p);
        load_group<W, DEC_GROUP, FULL>(wu, ubase + (long)i * cols, 0, cols, p);
    }
    if (records && warp == 0)
        route_records_warp(xs + cols + ro.e_count, sel, ro.k, ro.renorm, ro.ids, ro.probs,
                           ro.weights, ro.by_id, ro.kth);
    const float* xin = stage_finish(xs, x, cols, norm_w, eps, nullptr, fast);
    float ag[8], au[8];
    zero8(ag);
    zero8(au);
    while (i < rows) {
        fma_group_pair<W, FULL>(ag, au, wg, wu, xin, c0, cols, p);
        int i2 = i, c2 = c0 + DEC_GROUP;
        if ((c2 << 8) >= cols) {
            c2 = 0;
            i2 = i + nw;
        }
        if (i2 < rows) {
            load_group<W, DEC_GROUP, FULL>(wg, gbase + (long)i2 * cols, c2, cols, p);
            load_group<W, DEC_GROUP, FULL>(wu, ubase + (long)i2 * cols, c2, cols, p);
        }
        if (c2 == 0) {
            const float g = warp_tree_fast(ag);
            const float u = warp_tree_fast(au);
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

// A dense MLP's or a shared expert's gate/up (one slot, ids null), or experts chosen by ids.
// Dynamic shared memory: 2 * cols floats with a norm, cols without.
extern "C" __global__ void __launch_bounds__(256) gate_up_dec2_bf16(GATE_UP_DEC_ARGS(u16)) {
    gate_up_dec_body<u16>(gate, up, rows, cols, ids, x, norm_w, eps, act);
}

extern "C" __global__ void __launch_bounds__(256) gate_up_dec2_f32(GATE_UP_DEC_ARGS(float)) {
    gate_up_dec_body<float>(gate, up, rows, cols, ids, x, norm_w, eps, act);
}

// gate_up_dec2_bf16 for rows of whole groups (cols a multiple of 2,048).
extern "C" __global__ void __launch_bounds__(256) gate_up_dec2f_bf16(GATE_UP_DEC_ARGS(u16)) {
    gate_up_dec_body<u16, true>(gate, up, rows, cols, ids, x, norm_w, eps, act);
}

// gate_up_dec2_bf16 / gate_up_dec2f_bf16 with the router's top-k folded in (ROUTE above; no
// norm).
#define GATE_UP_ROUTE_ARGS                                                                      \
    const u16* __restrict__ gate, const u16* __restrict__ up, int rows, int cols, const float* x, \
        float* __restrict__ act, const float* logits, int e_count, int k, int renorm,            \
        u32* __restrict__ ids, float* __restrict__ probs, float* __restrict__ weights,            \
        u32* __restrict__ by_id, float* __restrict__ kth, float* __restrict__ next
#define GATE_UP_ROUTE_KERNEL(NAME, FULL)                                                        \
    extern "C" __global__ void __launch_bounds__(256) NAME(GATE_UP_ROUTE_ARGS) {               \
        gate_up_dec_body<u16, FULL, true>(                                                      \
            gate, up, rows, cols, nullptr, x, nullptr, 0.0f, act,                               \
            RouteOut{logits, e_count, k, renorm, ids, probs, weights, by_id, kth, next});      \
    }
GATE_UP_ROUTE_KERNEL(gate_up_route2_bf16, false)
GATE_UP_ROUTE_KERNEL(gate_up_route2f_bf16, true)

// ---------------------------------------------------------------------------------------------
// Down projections of the chosen experts for one token, mixed and added to the residual
// (moe.cu down_mix): a warp per output row r, all k experts' dots at once:
//   y_s = dot(W_down[e_s][r], act[j_s]) for the slots s in ascending expert id (j_s = by_id[s],
//   e_s = ids[j_s]); acc = +0; acc = acc + w[j_s] * y_s in that order;
//   (y_sh: acc = acc + sigmoid(s_sh[0]) * y_sh[r]); h[r] = h[r] + acc.
// k <= 8. Grid G blocks of 256; rows r = blockIdx.x*8 + warp, + 8*G, ...
// Dynamic shared memory: k*width floats (the activations).
#define DOWN_MAX_K 8
// The k slots of the experts' down kernel, by threads 0 .. k-1 (the caller's barrier follows):
// jslot[s] = by_id[s] (slot s in ascending expert id), ebase[s] the chosen expert's offset in the
// stacked down matrices and wslot[s] its mixing weight. Called after the wait: the router's
// choices are written by the kernel just before (gate_up_route2); read from L2.
__device__ __forceinline__ void down_slots(const u32* by_id, const u32* ids, const float* weights,
                                           int k, int hidden, int width, int* jslot, long* ebase,
                                           float* wslot) {
    if (threadIdx.x < k) {
        const int j = (int)__ldcg(by_id + threadIdx.x);
        jslot[threadIdx.x] = j;
        ebase[threadIdx.x] = (long)__ldcg(ids + j) * hidden * (long)width;
        wslot[threadIdx.x] = __ldcg(weights + j);
    }
}

// The activations' copy (stage_issue) is issued before the ids and the weights; the trees by
// warp_tree_fast; each row's residual (and shared expert output) loaded with its first weights.
// KF = 8 (moe_down_dec2f8 and moe_down_route2f8e): k = 8 and the width a multiple of 256, so the
// per-slot and per-chunk guards go away (load_group's FULL); the same loads and operations.
// ROUTE (moe_down_route2f8e, for steps with programmatic launch): the slots, the residuals and
// the first weights before grid_dep_wait, the activations (written by the kernel just before)
// after it; the router's choices, which that kernel writes too, are recomputed from the router's
// logits (route_select, then warp 0 the renormalising sum and each slot's weight and place in
// ascending id, as route_records_warp computes them); dynamic shared memory then k * width + 3E
// floats.
template <int KF = 0, bool ROUTE = false>
__device__ __forceinline__ void moe_down_dec_body(
    const u16* __restrict__ down, int hidden, int width, const u32* ids,
    const float* weights, const u32* by_id, int k, const float* act, const float* y_sh,
    const float* s_sh, float* h, const float* logits = nullptr, int e_count = 0,
    int renorm = 0) {
    TARFA_DYN_SMEM(float, as);
    __shared__ long ebase[DOWN_MAX_K];
    __shared__ int jslot[DOWN_MAX_K];
    const int p = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nw = gridDim.x * 8;
    bool fast = false;
    if (!ROUTE) {
        grid_dep_wait();
        grid_dep_launch();
        fast = stage_issue(as, act, k * width, nullptr);
    }
    __shared__ float wslot[DOWN_MAX_K];  // the mixing weights, read once per block
    if constexpr (ROUTE) {
        __shared__ int sel[DEC_ROUTE_MAX_K];
        float* rs = as + k * width;
        route_select(logits, e_count, k, rs, sel, nullptr);
        if (warp == 0) {
            const float* pe = rs + e_count;
            const float s = renorm ? route_renorm_sum(pe, sel, k) : 1.0f;
            if (p < k) {
                const int e = sel[p];
                const float pj = pe[e];
                int at = 0;  // the slot's place in ascending expert id (ids are distinct)
                for (int jj = 0; jj < k; jj++) at += (sel[jj] < e) ? 1 : 0;
                jslot[at] = p;
                ebase[at] = (long)e * hidden * (long)width;
                wslot[at] = renorm ? __fdiv_rn(pj, s) : pj;
            }
        }
    } else {
        down_slots(by_id, ids, weights, k, hidden, width, jslot, ebase, wslot);
    }
    __syncthreads();
    int r = blockIdx.x * 8 + warp;
    int c = 0;
    // the row's residual (and shared expert output) loaded with its first weights, so the
    // epilogue waits for nothing (nothing else writes h[r] during the kernel)
    float pre_h = 0.0f, pre_sh = 0.0f;
    if (p == 0 && r < hidden) {
        pre_h = h[r];
        if (y_sh != nullptr) pre_sh = y_sh[r];
    }
    Pack8<u16> wv[DOWN_MAX_K];
#pragma unroll
    for (int s = 0; s < DOWN_MAX_K; s++) {
        const int e = 8 * p;
        if ((KF || s < k) && r < hidden && (KF || e < width))
            wv[s].load(down + ebase[s] + (long)r * width + e);
    }
    if (ROUTE) {
        grid_dep_wait();
        grid_dep_launch();
        fast = stage_issue(as, act, k * width, nullptr);
    }
    stage_finish(as, act, k * width, nullptr, 0.0f, nullptr, fast);
    float acc[DOWN_MAX_K][8];
#pragma unroll
    for (int s = 0; s < DOWN_MAX_K; s++) zero8(acc[s]);
    while (r < hidden) {
        const int e = (c << 8) + 8 * p;
#pragma unroll
        for (int s = 0; s < DOWN_MAX_K; s++) {
            if ((KF || s < k) && (KF || e < width))
                fma8<u16>(acc[s], wv[s], as + jslot[s] * width + e);
        }
        int r2 = r, c2 = c + 1;
        if ((c2 << 8) >= width) {
            c2 = 0;
            r2 = r + nw;
        }
        const int e2 = (c2 << 8) + 8 * p;
#pragma unroll
        for (int s = 0; s < DOWN_MAX_K; s++) {
            if ((KF || s < k) && r2 < hidden && (KF || e2 < width))
                wv[s].load(down + ebase[s] + (long)r2 * width + e2);
        }
        if (c2 == 0) {
            float y[DOWN_MAX_K];
#pragma unroll
            for (int s = 0; s < DOWN_MAX_K; s++) {
                y[s] = (KF || s < k) ? warp_tree_fast(acc[s]) : 0.0f;
            }
            const float h_r = pre_h, sh_r = pre_sh;
            if (p == 0 && r2 < hidden) {
                pre_h = h[r2];
                if (y_sh != nullptr) pre_sh = y_sh[r2];
            }
            if (p == 0) {
                float mix = 0.0f;
#pragma unroll
                for (int s = 0; s < DOWN_MAX_K; s++) {
                    if (KF || s < k) mix = __fadd_rn(mix, __fmul_rn(wslot[s], y[s]));
                }
                // the shared expert: gated (Qwen2-MoE), or ungated without a gate logit
                // (DeepSeek, GLM-4.5), as moe.cu's add_shared
                if (y_sh != nullptr) {
                    mix = s_sh != nullptr ? __fadd_rn(mix, __fmul_rn(det_sigmoid(s_sh[0]), sh_r))
                                          : __fadd_rn(mix, sh_r);
                }
                h[r] = __fadd_rn(h_r, mix);
            }
#pragma unroll
            for (int s = 0; s < DOWN_MAX_K; s++) zero8(acc[s]);
        }
        r = r2;
        c = c2;
    }
}

#define MOE_DOWN_DEC_ARGS                                                                       \
    const u16* __restrict__ down, int hidden, int width, const u32* ids, const float* weights, \
        const u32* by_id, int k, const float* act, const float* y_sh, const float* s_sh,       \
        float* h

extern "C" __global__ void __launch_bounds__(256) moe_down_dec2(MOE_DOWN_DEC_ARGS) {
    moe_down_dec_body(down, hidden, width, ids, weights, by_id, k, act, y_sh, s_sh, h);
}

// moe_down_dec2 for k = 8 and expert widths of whole chunks, without the guards.
extern "C" __global__ void __launch_bounds__(256) moe_down_dec2f8(MOE_DOWN_DEC_ARGS) {
    moe_down_dec_body<8>(down, hidden, width, ids, weights, by_id, k, act, y_sh, s_sh, h);
}

// moe_down_dec2f8 with the slots and first weights before the wait and the router's choices
// recomputed from its logits (ROUTE above).
extern "C" __global__ void __launch_bounds__(256) moe_down_route2f8e(
    MOE_DOWN_DEC_ARGS, const float* logits, int e_count, int renorm) {
    moe_down_dec_body<8, true>(down, hidden, width, ids, weights, by_id, k, act, y_sh, s_sh, h,
                               logits, e_count, renorm);
}

// ---------------------------------------------------------------------------------------------
// Attention of one token at position P = st->pos (norm_rope.cu rope_append_kv + attention.cu,
// T = 1), a block per (query head, 32-wide slice of the head dimension):
//   q = the head's raw projection, k, v = its KV head's; with q_norm/k_norm (per-head RMSNorm,
//   both or neither): q = RMSNorm(q), k = RMSNorm(k) (rmsnorm over D); RoPE at P on q and k;
//   the block of slice 0 of the group's first query head appends k, v to the cache at P;
//   s_j = dot(q, k_j) * scale for j <= P (k_P from shared memory: the bits just appended),
//   softmax as attention.cu, o[d] = canonical dot over j of (p_j, v_j[d]) for the slice's d.
// The values and their order are the first attention kernels' (PHASE_LOG P4, P6, P10, P15:
// attn_decode, then attn_decode2, attn_decode3; git history): every score a canonical dot over
// 256 lanes with warp_tree's pairs, the softmax as attention.cu, every output a canonical dot
// over positions. attn_decode4 below computes each with different threads, never in another
// order.
#define ATT_TILE 32

// x[i] with the per-head RMSNorm applied (nw not null: w_i * (x_i * r)).
__device__ __forceinline__ float att_normed(const float* x, const float* __restrict__ nw, float r,
                                            int i) {
    return nw != nullptr ? __fmul_rn(nw[i], __fmul_rn(x[i], r)) : x[i];
}

// Element e of RMSNorm-then-RoPE of x (the RoPE pair update, seen from either element).
__device__ __forceinline__ float att_rope(const float* x, const float* __restrict__ nw, float r,
                                          const float* c, const float* s, int half, int e) {
    if (e < half) {
        const float a = att_normed(x, nw, r, e), b = att_normed(x, nw, r, e + half);
        return __fsub_rn(__fmul_rn(a, c[e]), __fmul_rn(b, s[e]));
    }
    const int i = e - half;
    const float a = att_normed(x, nw, r, i), b = att_normed(x, nw, r, e);
    return __fadd_rn(__fmul_rn(b, c[i]), __fmul_rn(a, s[i]));
}

// ---------------------------------------------------------------------------------------------
// attn_decode4_d32/_d64/_d128/_d256: attention of one token with far fewer instructions per warp
// than the first kernels (attn_decode3, PHASE_LOG P10) and the prologue's loads issued together
// (P15, P16: EARLY below). The kernel named _dX takes head
// dimensions D <= X (even; decode.rs picks the smallest X >= D); registers and instructions
// scale with X. Grid (query head, 32-wide slice of D); blocks of 512 threads (16 warps) and 2 x n_stride floats of scores (dynamic shared memory, or
// scratch row pair (qh*gridDim.y + slice) of 2 x n_stride floats when scratch is not null):
// sc[] (scores, then e_j) and pr[] (p_j). Four barriers:
// - every warp loads its first keys (before grid_dep_wait: the cache rows below P and the state
//   were written before this step began). The last warp (it has the fewest score steps) does the
//   prologue, thread p holding elements p + 32i (i < X/32, "layout A"): raw q and k, the
//   per-head RMSNorm's sum of squares as a canonical dot with these lanes (the tree levels 128,
//   64, 32 in-thread: slot i with i+4, i+2, i+1; 16..1 shfl_down; the levels a thread's slots do
//   not reach pair a lane with lanes >= X >= D, which hold +0.0: pruned, since a lane
//   accumulator is never -0.0), then RMSNorm-then-RoPE per element (att_rope's operations;
//   when D = X the RoPE partner e +- D/2 is in the same thread, or thread p ^ 16 for X = 32); in
//   one block per KV head it appends k_P and v_P; it scores position P in layout A and writes q
//   to shared memory. Barrier.
// - scores of positions j < P ("layout B"): T = X/16 threads per position, thread t of a group
//   holds the 16 lanes t + T*k of one position (k < 16), so a warp scores 32/T positions per
//   step, two steps per iteration (the next two steps' keys are loaded before this pair's
//   tree). The tree: levels h = X/2 .. T in-thread (slot k with k + h/T), h = T/2 .. 1 by
//   shfl_down inside the group of T threads (thread t < h takes lane t + h of its own group);
//   levels h >= X are pruned as above. Warp w takes the steps w, w + 16, ...; each warp keeps
//   the maximum of its scores (order-free, NaN ignored, as fmaxf from -inf: block_max_256's
//   value). The values of each warp's output columns at positions < 256 are loaded. Barrier.
// - m = max of the 16 warp maxima; thread v (of 512) turns sc[j] into e_j = exp(s_j - m) for
//   j = v, v + 512, ... (in place: no other thread touches sc[j] in this phase). Barrier.
// - every warp: S = canonical sum of e_j, thread p holding lanes p + 32i (i < 8; lane v sums
//   j = v, v + 256, ... in increasing order), the tree as in the prologue; thread v writes
//   pr[j] = e_j / S for j = v, v + 512, .... Barrier.
// - warp w: the outputs d0 + 2w, d0 + 2w + 1 of the slice (D even: both or neither exist), lanes
//   p + 32i over positions j = p + 32i + 256c (c increasing): acc = fma(p_j, v_j[d], acc), then
//   the same tree.
// Every value is computed by the operations the first kernels used, in the same order, and every
// reduction has their lanes and tree pairs; only the thread that computes it changes.
// Each kernel runs a copy of the body specialised for D == X (no per-lane bounds checks).
// Registers (ptx_report.py): 119-122 of at most 128 (__launch_bounds__(512, 1)), no spills.
#define ATT3_WARPS 16
#define ATT3_THREADS 512  // 32 * ATT3_WARPS (a literal: validation/gpu/emu/gen.py reads it)
#define ATT3_K 16  // score lanes per thread (layout B)
#define ATT3_U 2   // warp-steps per iteration of the score loop

// The canonical tree over lanes p + 32i (i < NI): valid in thread 0. Slots i >= NI are lanes
// >= 32*NI, which hold +0.0 (pruned).
template <int NI>
__device__ __forceinline__ float att3_tree_a(float (&a)[NI]) {
    if constexpr (NI > 4) {
#pragma unroll
        for (int i = 0; i < 4; i++) a[i] = __fadd_rn(a[i], a[i + 4]);
    }
    if constexpr (NI > 2) {
#pragma unroll
        for (int i = 0; i < 2; i++) a[i] = __fadd_rn(a[i], a[i + 2]);
    }
    if constexpr (NI > 1) a[0] = __fadd_rn(a[0], a[1]);
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1)
        a[0] = __fadd_rn(a[0], __shfl_down_sync(TARFA_FULL_MASK, a[0], off));
    return a[0];
}

// The canonical tree over lanes t + T*k (k < ATT3_K) of the T threads of a group (t = p % T):
// valid in thread t = 0 of each group. Lanes >= T*ATT3_K hold +0.0 (pruned).
template <int T>
__device__ __forceinline__ float att3_tree_b(float (&a)[ATT3_K]) {
    static_assert(ATT3_K == 16, "the in-thread levels below are written for 16 slots");
#pragma unroll
    for (int k = 0; k < 8; k++) a[k] = __fadd_rn(a[k], a[k + 8]);  // h = 8T
#pragma unroll
    for (int k = 0; k < 4; k++) a[k] = __fadd_rn(a[k], a[k + 4]);  // h = 4T
#pragma unroll
    for (int k = 0; k < 2; k++) a[k] = __fadd_rn(a[k], a[k + 2]);  // h = 2T
    a[0] = __fadd_rn(a[0], a[1]);                                     // h = T
#pragma unroll
    for (int off = T / 2; off >= 1; off >>= 1)  // h = off
        a[0] = __fadd_rn(a[0], __shfl_down_sync(TARFA_FULL_MASK, a[0], off));
    return a[0];
}

// Keys of this thread's layout-B lanes for the ATT3_U steps s0, s0 + ATT3_WARPS, ... (positions
// j = (32/T)*s + g; 0 at lanes >= D). A position j >= pos reads row min(j, pos - 1) (row 0 when
// pos = 0; the cache has at least one row): its score is never stored, and the loads need no
// predicate.
template <int T, bool EXACT>
__device__ __forceinline__ void att3_load_keys(float (&kb)[ATT3_U][ATT3_K], const u64* keys,
                                               int kvh, int s0, int pos, int d, int t, int g) {
#pragma unroll
    for (int u = 0; u < ATT3_U; u++) {
        int j = (32 / T) * (s0 + ATT3_WARPS * u) + g;
        j = j < pos - 1 ? j : pos - 1;
        j = j > 0 ? j : 0;
        const float* kr = kv_row(keys, kvh, j, d) + t;
#pragma unroll
        for (int k = 0; k < ATT3_K; k++) kb[u][k] = (EXACT || t + T * k < d) ? kr[T * k] : 0.0f;
    }
}

// One iteration of the score loop: the ATT3_U steps s0, s0 + ATT3_WARPS, ... with the keys in
// kb, while the next iteration's keys are loaded into kn. Thread t = 0 of each group stores
// s_j = tree * scale for j < pos and keeps the maximum.
template <int T, bool EXACT>
__device__ __forceinline__ void att3_score_iter(float (&kb)[ATT3_U][ATT3_K],
                                                float (&kn)[ATT3_U][ATT3_K],
                                                const float (&qb)[ATT3_K], const u64* keys,
                                                int kvh, int s0, int pos, int d, int t, int g,
                                                float scale,
                                                float* sc, float& mx) {
    float a[ATT3_U][ATT3_K];
#pragma unroll
    for (int u = 0; u < ATT3_U; u++) {
#pragma unroll
        for (int k = 0; k < ATT3_K; k++) a[u][k] = fmaf(qb[k], kb[u][k], 0.0f);
    }
    att3_load_keys<T, EXACT>(kn, keys, kvh, s0 + ATT3_WARPS * ATT3_U, pos, d, t, g);
#pragma unroll
    for (int u = 0; u < ATT3_U; u++) {
        const float r = att3_tree_b<T>(a[u]);
        const int j = (32 / T) * (s0 + ATT3_WARPS * u) + g;
        if (t == 0 && j < pos) {
            const float s = __fmul_rn(r, scale);
            sc[j] = s;
            mx = fmaxf(mx, s);
        }
    }
}

// PARTIAL (attn_decode4p, the bounds-checked body only): RoPE on the leading rd values of each
// head (pairs e, e + rd/2; table rows of rd/2), the rest normalised and passed through
// (norm_rope.cu's partial rotary).
template <int X, bool EXACT, bool EARLY = false, bool PARTIAL = false>
__device__ __forceinline__ void att3_body(
    float* sm, const float* q_raw, const float* k_raw, const float* v_raw, int hq, int hkv,
    int d, const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, const DecodeState* st,
    const u64* k_cache, const u64* v_cache, int cap, float scale, float* scratch, int n_stride,
    float* __restrict__ o, int rd = 0) {
    static_assert(!(PARTIAL && EXACT), "partial rotary takes the bounds-checked body");
    constexpr int NI = X / 32;  // layout A slots
    constexpr int T = X / 16;   // layout B threads per position
    constexpr int G = 32 / T;   // positions per warp-step
    __shared__ float wmax[ATT3_WARPS];
    __shared__ float qs[X];  // q, normalised and rotated (0 at elements >= D)
    const int tid = threadIdx.x;
    const int p = tid & 31;
    const int warp = tid >> 5;
    const int t = p % T;
    const int g = p / T;
    const int qh = blockIdx.x;
    const int slice = blockIdx.y;
    const int group = hq / hkv;
    const int kvh = qh / group;
    const int pos = st->pos;
    const int n = pos + 1;
    const int dd = EXACT ? X : d;
    const float* qg = q_raw + (long)qh * dd;
    const float* kg = k_raw + (long)kvh * dd;
    const float* vg = v_raw + (long)kvh * dd;
    const u64* keys = k_cache;  // paged (common.cuh `kv_row`): rows of head kvh
    const u64* vals = v_cache;
    float* sc = scratch != nullptr ? scratch + (long)(qh * gridDim.y + slice) * 2 * n_stride : sm;
    float* pr = sc + n_stride;

    // the first keys this warp scores: loaded now, used after the dependent steps below. The
    // cache rows below P and the state were written before this step began (the step's first
    // kernel is launched without programmatic serialisation), so they are read before the wait.
    float kb[ATT3_U][ATT3_K];
    att3_load_keys<T, EXACT>(kb, keys, kvh, warp, pos, dd, t, g);
    // EARLY (attn_decode4), D = X: the prologue's constants -- the norm weights and the RoPE
    // factors of position P -- are loaded before the wait too (the last warp; the table rows
    // and the state were written before this step began)
    constexpr int HR = NI > 1 ? NI / 2 : 1;  // RoPE factors per thread
    float wq[NI], wk[NI], rc[HR], rs[HR];
    if constexpr (EXACT && EARLY) {
        if (warp == ATT3_WARPS - 1) {
#pragma unroll
            for (int i = 0; i < NI; i++) {
                const int e = p + 32 * i;
                wq[i] = q_norm != nullptr ? q_norm[e] : 0.0f;
                wk[i] = k_norm != nullptr ? k_norm[e] : 0.0f;
            }
            const float* cr0 = cos_t + (long)pos * (dd / 2);
            const float* sr0 = sin_t + (long)pos * (dd / 2);
#pragma unroll
            for (int i = 0; i < HR; i++) {
                const int e = NI == 1 ? (p & 15) : p + 32 * i;
                rc[i] = cr0[e];
                rs[i] = sr0[e];
            }
        }
    }
    grid_dep_wait();
    grid_dep_launch();

    // the prologue (the last warp, which has the fewest score steps; the others wait with their
    // first keys loading): q and k in layout A, the KV append, the score of P, q to shared memory
    float mx = f32_bits(0xff800000u);  // this thread's maximum of the scores it wrote
    if (warp == ATT3_WARPS - 1) {
        // prologue, layout A: q and k normalised and rotated (zero at lanes >= D)
        float xq[NI], xk[NI];  // raw q and k
        // EARLY (attn_decode4 at D = X): v_P is loaded with q and k (and the
        // norm weights and RoPE factors were loaded before the wait), so the prologue waits for
        // one round trip instead of three (the compiler does not move these loads above the
        // norm's shuffles); the same values, the same operations
        float xv[NI];
#pragma unroll
        for (int i = 0; i < NI; i++) {
            const int e = p + 32 * i;
            xq[i] = (EXACT || e < dd) ? qg[e] : 0.0f;
            xk[i] = (EXACT || e < dd) ? kg[e] : 0.0f;
            if constexpr (EXACT && EARLY) xv[i] = vg[e];
        }
        float rq = 1.0f, rk = 1.0f;
        if (q_norm != nullptr) {
            float sq[NI], sk[NI];
#pragma unroll
            for (int i = 0; i < NI; i++) {
                sq[i] = fmaf(xq[i], xq[i], 0.0f);
                sk[i] = fmaf(xk[i], xk[i], 0.0f);
            }
            const float ssq = __shfl_sync(TARFA_FULL_MASK, att3_tree_a<NI>(sq), 0);
            const float ssk = __shfl_sync(TARFA_FULL_MASK, att3_tree_a<NI>(sk), 0);
            rq = det_rsqrt(__fadd_rn(__fdiv_rn(ssq, (float)dd), eps));
            rk = det_rsqrt(__fadd_rn(__fdiv_rn(ssk, (float)dd), eps));
        }
        const int half = PARTIAL ? rd / 2 : dd / 2;
        const float* cr = cos_t + (long)pos * half;
        const float* sr = sin_t + (long)pos * half;
        float qa[NI], ka[NI];
        if constexpr (EXACT) {
            // D = X: the RoPE partner of element e = p + 32i is e +- D/2, slot i +- NI/2 of this
            // thread (NI >= 2) or slot 0 of thread p ^ 16 (NI = 1): att_rope's pair update on
            // the same normalised values (att_normed's operations), taken from registers
            float qn[NI], kn[NI];
#pragma unroll
            for (int i = 0; i < NI; i++) {
                const int e = p + 32 * i;
                if constexpr (EARLY) {
                    qn[i] = q_norm != nullptr ? __fmul_rn(wq[i], __fmul_rn(xq[i], rq)) : xq[i];
                    kn[i] = k_norm != nullptr ? __fmul_rn(wk[i], __fmul_rn(xk[i], rk)) : xk[i];
                } else {
                    qn[i] = q_norm != nullptr ? __fmul_rn(q_norm[e], __fmul_rn(xq[i], rq)) : xq[i];
                    kn[i] = k_norm != nullptr ? __fmul_rn(k_norm[e], __fmul_rn(xk[i], rk)) : xk[i];
                }
            }
            if constexpr (NI == 1) {
                const float qo = __shfl_xor_sync(TARFA_FULL_MASK, qn[0], 16);
                const float ko = __shfl_xor_sync(TARFA_FULL_MASK, kn[0], 16);
                const float c = EARLY ? rc[0] : cr[p & 15], s = EARLY ? rs[0] : sr[p & 15];
                if (p < 16) {  // e < half: own value a, partner b
                    qa[0] = __fsub_rn(__fmul_rn(qn[0], c), __fmul_rn(qo, s));
                    ka[0] = __fsub_rn(__fmul_rn(kn[0], c), __fmul_rn(ko, s));
                } else {  // e >= half: own value b, partner a
                    qa[0] = __fadd_rn(__fmul_rn(qn[0], c), __fmul_rn(qo, s));
                    ka[0] = __fadd_rn(__fmul_rn(kn[0], c), __fmul_rn(ko, s));
                }
            } else {
                constexpr int H = NI / 2;
#pragma unroll
                for (int i = 0; i < H; i++) {
                    const float c = EARLY ? rc[i] : cr[p + 32 * i];
                    const float s = EARLY ? rs[i] : sr[p + 32 * i];
                    qa[i] = __fsub_rn(__fmul_rn(qn[i], c), __fmul_rn(qn[i + H], s));
                    qa[i + H] = __fadd_rn(__fmul_rn(qn[i + H], c), __fmul_rn(qn[i], s));
                    ka[i] = __fsub_rn(__fmul_rn(kn[i], c), __fmul_rn(kn[i + H], s));
                    ka[i + H] = __fadd_rn(__fmul_rn(kn[i + H], c), __fmul_rn(kn[i], s));
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < NI; i++) {
                const int e = p + 32 * i;
                const bool in = e < dd;
                if (PARTIAL && e >= rd) {  // past the rotated part: normalised, unrotated
                    qa[i] = in ? att_normed(qg, q_norm, rq, e) : 0.0f;
                    ka[i] = in ? att_normed(kg, k_norm, rk, e) : 0.0f;
                } else {
                    qa[i] = in ? att_rope(qg, q_norm, rq, cr, sr, half, e) : 0.0f;
                    ka[i] = in ? att_rope(kg, k_norm, rk, cr, sr, half, e) : 0.0f;
                }
            }
        }
        if (qh % group == 0 && slice == 0) {
#pragma unroll
            for (int i = 0; i < NI; i++) {
                const int e = p + 32 * i;
                if (EXACT || e < dd) {
                    kv_row(k_cache, kvh, pos, dd)[e] = ka[i];
                    kv_row(v_cache, kvh, pos, dd)[e] = (EXACT && EARLY) ? xv[i] : vg[e];
                }
            }
        }
        {
            // position P (k_P from registers): the score in layout A
            float a[NI];
#pragma unroll
            for (int i = 0; i < NI; i++) a[i] = fmaf(qa[i], ka[i], 0.0f);
            const float s = att3_tree_a<NI>(a);
            if (p == 0) {
                mx = __fmul_rn(s, scale);
                sc[pos] = mx;
            }
        }
#pragma unroll
        for (int i = 0; i < NI; i++) qs[p + 32 * i] = qa[i];
    }
    __syncthreads();  // q is in qs[]
    // q in layout B: element t + T*k
    float qb[ATT3_K];
#pragma unroll
    for (int k = 0; k < ATT3_K; k++) qb[k] = qs[t + T * k];

    // scores of positions j < P, layout B: steps s = warp + ATT3_WARPS * (ATT3_U*r + u); two
    // key buffers in turn (the next iteration's keys are loaded into the other one before this
    // iteration's trees)
    float kb2[ATT3_U][ATT3_K];
    for (int s0 = warp; G * s0 < pos;) {
        att3_score_iter<T, EXACT>(kb, kb2, qb, keys, kvh, s0, pos, dd, t, g, scale, sc, mx);
        s0 += ATT3_WARPS * ATT3_U;
        if (G * s0 >= pos) break;
        att3_score_iter<T, EXACT>(kb2, kb, qb, keys, kvh, s0, pos, dd, t, g, scale, sc, mx);
        s0 += ATT3_WARPS * ATT3_U;
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(TARFA_FULL_MASK, mx, off));
    if (p == 0) wmax[warp] = mx;

    // the values of this warp's two output columns at positions p + 32i (v_P is v_raw itself)
    const int dc = slice * ATT_TILE + 2 * warp;
    const bool cols = dc < dd;  // D even, dc even: dc + 1 < D too
    // (vpre of a position j > P is never used)
    float vp0 = 0.0f, vp1 = 0.0f, vpre[8][2];
    if (cols) {
        vp0 = vg[dc];
        vp1 = vg[dc + 1];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const bool below = p + 32 * i < pos;
            const float* vb = kv_row(vals, kvh, below ? p + 32 * i : 0, dd) + dc;  // row p + 32i
            vpre[i][0] = below ? vb[0] : vp0;
            vpre[i][1] = below ? vb[1] : vp1;
        }
    }
    __syncthreads();  // every score and warp maximum is written

    // e_j in place (the maximum: any order gives the same value)
    float m = f32_bits(0xff800000u);
#pragma unroll
    for (int w = 0; w < ATT3_WARPS; w++) m = fmaxf(m, wmax[w]);
    for (int j = tid; j < n; j += ATT3_THREADS) sc[j] = det_exp(__fsub_rn(sc[j], m));
    __syncthreads();  // every e_j is written

    // S = canonical sum of e_j (every warp), then p_j
    float sa[8];
    zero8(sa);
    for (int base = p; base < n; base += TARFA_LANES) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int j = base + 32 * i;
            if (j < n) sa[i] = __fadd_rn(sa[i], sc[j]);
        }
    }
    const float total = __shfl_sync(TARFA_FULL_MASK, att3_tree_a<8>(sa), 0);
    for (int j = tid; j < n; j += ATT3_THREADS) pr[j] = __fdiv_rn(sc[j], total);
    __syncthreads();  // every p_j is written

    // the outputs dc, dc + 1: lane p + 32i over positions j = p + 32i + 256c, c increasing
    float a0[8], a1[8];
    zero8(a0);
    zero8(a1);
    if (cols) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int j = p + 32 * i;
            if (j < n) {
                const float pj = pr[j];
                a0[i] = fmaf(pj, vpre[i][0], a0[i]);
                a1[i] = fmaf(pj, vpre[i][1], a1[i]);
            }
        }
        for (int base = p + TARFA_LANES; base < n; base += TARFA_LANES) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int j = base + 32 * i;
                if (j < n) {
                    const float pj = pr[j];
                    const bool below = j < pos;
                    const float* vb = kv_row(vals, kvh, below ? j : 0, dd) + dc;  // row j
                    const float v0 = below ? vb[0] : vp0;
                    const float v1 = below ? vb[1] : vp1;
                    a0[i] = fmaf(pj, v0, a0[i]);
                    a1[i] = fmaf(pj, v1, a1[i]);
                }
            }
        }
    }
    const float o0 = att3_tree_a<8>(a0);
    const float o1 = att3_tree_a<8>(a1);
    if (p == 0 && cols) {
        o[(long)qh * dd + dc] = o0;
        o[(long)qh * dd + dc + 1] = o1;
    }
}

#define ATT3_PARAMS                                                                              \
    const float *q_raw, const float *k_raw, const float *v_raw, int hq, int hkv, int d,          \
        const float *__restrict__ q_norm, const float *__restrict__ k_norm, float eps,           \
        const float *__restrict__ cos_t, const float *__restrict__ sin_t, const DecodeState *st, \
        const u64 *k_cache, const u64 *v_cache, int cap, float scale, float *scratch, int n_stride, \
        float *__restrict__ o
#define ATT3_ARGS                                                                              \
    q_raw, k_raw, v_raw, hq, hkv, d, q_norm, k_norm, eps, cos_t, sin_t, st, k_cache, v_cache, \
        cap, scale, scratch, n_stride, o
// attn_decode4_dX: the prologue's loads issued together at D = X (att3_body's EARLY), the
// bounds-checked body for smaller D
#define ATT3_KERNEL(X)                                                                 \
    extern "C" __global__ void __launch_bounds__(ATT3_THREADS, 1) attn_decode4_d##X(   \
        ATT3_PARAMS) {                                                                 \
        TARFA_DYN_SMEM(float, sm);                                                     \
        if (d == X)                                                                    \
            att3_body<X, true, true>(sm, ATT3_ARGS);                                   \
        else                                                                           \
            att3_body<X, false>(sm, ATT3_ARGS);                                        \
    }
ATT3_KERNEL(32)
ATT3_KERNEL(64)
ATT3_KERNEL(128)
ATT3_KERNEL(256)
// attn_decode4p_dX: partial rotary (GLM-4.5), RoPE on the leading rd values (att3_body's
// PARTIAL), the bounds-checked body
#define ATT3P_KERNEL(X)                                                                \
    extern "C" __global__ void __launch_bounds__(ATT3_THREADS, 1) attn_decode4p_d##X(  \
        ATT3_PARAMS, int rd) {                                                         \
        TARFA_DYN_SMEM(float, sm);                                                     \
        att3_body<X, false, false, true>(sm, ATT3_ARGS, rd);                           \
    }
ATT3P_KERNEL(32)
ATT3P_KERNEL(64)
ATT3P_KERNEL(128)
ATT3P_KERNEL(256)
