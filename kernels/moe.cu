// The MoE block on the device (cpu/forward.rs `route` and `moe_block`, contract sections 2 and 6.4):
// the router's softmax and top-k, then the chosen experts read their ids from device memory.
#include "common.cuh"

// Router of one token per block of 256 threads. logits [T][E] -> for each token:
//   p = softmax(logits) (max, exp, canonical sum, divide)
//   selection: the k largest p in descending total order, the lower expert id first among equals
//   weights: p_j / canonical_sum(selected p in selection order) when `renorm`, else p_j
// Outputs, each [T][k] at this layer's record: ids, probs, weights, and `by_id` (the selection
// slots in ascending expert id: the mixing order); [T]: kth (p of the last selected) and next
// (p of the (k+1)-th, NaN when E == k). Dynamic shared memory: 2*E floats.
extern "C" __global__ void __launch_bounds__(256) route_topk(
    const float* __restrict__ logits, int e_count, int k, int renorm, u32* __restrict__ ids,
    float* __restrict__ probs, float* __restrict__ weights, u32* __restrict__ by_id,
    float* __restrict__ kth, float* __restrict__ next) {
    TARFA_DYN_SMEM(float, dyn);
    __shared__ float red[TARFA_LANES];
    __shared__ int sel[1024];
    const int t = blockIdx.x;
    route_block(logits + (long)t * e_count, e_count, k, renorm, t, ids, probs, weights, by_id, kth,
                next, dyn, dyn + e_count, sel, red);
}

// Group-limited router of one token per block of 256 threads (cpu/forward.rs
// `route_sigmoid_grouped` when `sigmoid`, else `route_softmax_grouped`; EXACTNESS.md's
// "Sigmoid group-limited routing" and "Softmax group-limited routing"). logits [T][E]:
//   sigmoid: s_e = sigmoid(l_e), c_e = s_e + bias_e; a group (G = E / n_group experts in id order)
//            scores a + b, its two largest c (descending total order, lower id first)
//   softmax: s = c = softmax(l); a group scores its largest c (fmaxf from -inf)
//   the `topk_group` best groups are kept (descending total order, lower group first); experts
//   outside them compete with +0.0; the top-k of that choice (route_select_block)
//   probs: s_e; weights: sigmoid: (s_e / (canonical_sum(s over the selection) + 1e-20)) * scale
//   when `renorm`, else s_e * scale; softmax: s_e * scale; kth / next: the choice values.
// Outputs as route_topk's. Dynamic shared memory: 2*E + 2*k + n_group floats.
extern "C" __global__ void __launch_bounds__(256) route_grouped(
    const float* __restrict__ logits, const float* __restrict__ bias, int e_count, int k,
    int n_group, int topk_group, int sigmoid, int renorm, float scale, u32* __restrict__ ids,
    float* __restrict__ probs, float* __restrict__ weights, u32* __restrict__ by_id,
    float* __restrict__ kth, float* __restrict__ next) {
    TARFA_DYN_SMEM(float, dyn);
    __shared__ float red[TARFA_LANES];
    __shared__ int sel[1024];
    float* s = dyn;                // [E] the unbiased scores
    float* c = dyn + e_count;      // [E] the choice values
    float* sp = c + e_count;       // [k] the selection's scores
    float* wt = sp + k;            // [k] their weights
    float* gs = wt + k;            // [n_group] the group scores, then 1 (kept) or 0
    const int t = blockIdx.x;
    const int v = threadIdx.x;
    const float* l = logits + (long)t * e_count;
    if (sigmoid) {
        for (int i = v; i < e_count; i += TARFA_LANES) {
            s[i] = det_sigmoid(l[i]);
            c[i] = __fadd_rn(s[i], bias[i]);
        }
        __syncthreads();
    } else {
        softmax_block(l, e_count, s, red);
        for (int i = v; i < e_count; i += TARFA_LANES) c[i] = s[i];
        __syncthreads();
    }
    const int size = e_count / n_group;
    for (int g = v; g < n_group; g += TARFA_LANES) {
        const float* grp = c + (long)g * size;
        if (sigmoid) {
            // the first and second of the group in (descending total order, lower id first)
            int a = 0, b = -1;
            for (int i = 1; i < size; i++) {
                const int ki = total_order_key(grp[i]);
                if (ki > total_order_key(grp[a])) {
                    b = a;
                    a = i;
                } else if (b < 0 || ki > total_order_key(grp[b])) {
                    b = i;
                }
            }
            gs[g] = __fadd_rn(grp[a], grp[b]);
        } else {
            float m = f32_bits(0xff800000u);
            for (int i = 0; i < size; i++) m = fmaxf(m, grp[i]);
            gs[g] = m;
        }
    }
    __syncthreads();
    // each group's rank among the groups; its flag read by every expert after the barrier
    float kept = 0.0f;
    if (v < n_group) {
        const int kg = total_order_key(gs[v]);
        int rank = 0;
        for (int h = 0; h < n_group; h++) {
            const int kh = total_order_key(gs[h]);
            rank += (kh > kg || (kh == kg && h < v)) ? 1 : 0;
        }
        kept = rank < topk_group ? 1.0f : 0.0f;
    }
    __syncthreads();
    if (v < n_group) gs[v] = kept;
    __syncthreads();
    for (int i = v; i < e_count; i += TARFA_LANES) {
        if (gs[i / size] == 0.0f) c[i] = 0.0f;
    }
    __syncthreads();
    route_select_block(c, e_count, k, t, sel, next);
    for (int j = v; j < k; j += TARFA_LANES) sp[j] = s[sel[j]];
    __syncthreads();
    float denom = 1.0f;
    if (sigmoid && renorm) denom = __fadd_rn(block_sum_256(sp, k, red), 1e-20f);
    for (int j = v; j < k; j += TARFA_LANES) {
        wt[j] = (sigmoid && renorm) ? __fmul_rn(__fdiv_rn(sp[j], denom), scale)
                                    : __fmul_rn(sp[j], scale);
    }
    __syncthreads();
    route_write_block(sel, sp, wt, k, t, c[sel[k - 1]], ids, probs, weights, by_id, kth);
}

// Gate and up projections of the chosen experts with the SwiGLU, a warp per (row i, slot j, token t):
//   g = dot(W_gate[e][i], xn[t]), u = dot(W_up[e][i], xn[t]), act[t][j][i] = silu(g) * u
// with e = ids[t*k + j] read from device memory (ids == null: a dense MLP, e = 0, k = 1).
// Expert matrices of one layer are stacked: gate/up [E][rows][cols]. grid (ceil(rows/8), k, T).
template <typename W>
__device__ __forceinline__ float gu_dot(const W* w, const float* x, int n, int p);
template <>
__device__ __forceinline__ float gu_dot<u16>(const u16* w, const float* x, int n, int p) {
    return warp_dot_bf16(w, x, n, p);
}
template <>
__device__ __forceinline__ float gu_dot<float>(const float* w, const float* x, int n, int p) {
    return warp_dot_f32(w, x, n, p);
}

template <typename W>
__device__ __forceinline__ void gate_up_body(const W* __restrict__ gate, const W* __restrict__ up,
                                             int rows, int cols, const u32* __restrict__ ids, int k,
                                             const float* __restrict__ xn, float* __restrict__ act) {
    const int p = threadIdx.x & 31;
    const int i = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int j = blockIdx.y;
    const int t = blockIdx.z;
    if (i >= rows) return;
    const long e = ids != nullptr ? (long)ids[(long)t * k + j] : 0;
    const long row = (e * rows + i) * (long)cols;
    const float* x = xn + (long)t * cols;
    float g = gu_dot<W>(gate + row, x, cols, p);
    float u = gu_dot<W>(up + row, x, cols, p);
    if (p == 0) act[((long)t * k + j) * rows + i] = __fmul_rn(det_silu(g), u);
}

extern "C" __global__ void __launch_bounds__(256) gate_up_bf16(
    const u16* __restrict__ gate, const u16* __restrict__ up, int rows, int cols,
    const u32* __restrict__ ids, int k, const float* __restrict__ xn, float* __restrict__ act) {
    gate_up_body<u16>(gate, up, rows, cols, ids, k, xn, act);
}

extern "C" __global__ void __launch_bounds__(256) gate_up_f32(
    const float* __restrict__ gate, const float* __restrict__ up, int rows, int cols,
    const u32* __restrict__ ids, int k, const float* __restrict__ xn, float* __restrict__ act) {
    gate_up_body<float>(gate, up, rows, cols, ids, k, xn, act);
}

// The shared expert's term of the mix (cpu/forward.rs `moe_block`): Qwen2-MoE's gated one,
// acc + sigmoid(s_sh[t]) * y; with s_sh null, DeepSeek's / GLM-4.5's ungated ones, acc + y.
__device__ __forceinline__ float add_shared(float acc, float y, const float* __restrict__ s_sh,
                                            int t) {
    return s_sh != nullptr ? __fadd_rn(acc, __fmul_rn(det_sigmoid(s_sh[t]), y))
                           : __fadd_rn(acc, y);
}

// Down projections of the chosen experts, mixed, added to the residual: a warp per (row r, token t):
//   acc = +0; for the slots in ascending expert id: acc = acc + w_e * dot(W_down[e][r], act[t][slot])
//   (shared expert, when y_sh is not null: add_shared)
//   h[t][r] = h[t][r] + acc
// W_down of one layer is stacked [E][hidden][width]. grid (ceil(hidden/8), T).
extern "C" __global__ void __launch_bounds__(256) down_mix(
    const u16* __restrict__ down, int hidden, int width, const u32* __restrict__ ids,
    const float* __restrict__ weights, const u32* __restrict__ by_id, int k,
    const float* __restrict__ act, const float* __restrict__ y_sh, const float* __restrict__ s_sh,
    float* __restrict__ h) {
    const int p = threadIdx.x & 31;
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int t = blockIdx.y;
    if (r >= hidden) return;
    float acc = 0.0f;
    for (int jj = 0; jj < k; jj++) {
        const int j = (int)by_id[(long)t * k + jj];
        const long e = (long)ids[(long)t * k + j];
        const float y = warp_dot_bf16(down + (e * hidden + r) * (long)width,
                                      act + ((long)t * k + j) * width, width, p);
        if (p == 0) acc = __fadd_rn(acc, __fmul_rn(weights[(long)t * k + j], y));
    }
    if (p == 0) {
        if (y_sh != nullptr) acc = add_shared(acc, y_sh[(long)t * hidden + r], s_sh, t);
        h[(long)t * hidden + r] = __fadd_rn(h[(long)t * hidden + r], acc);
    }
}

// ---------------------------------------------------------------------------------------------
// Expert streaming (tarfa-run/src/cuda/hot.rs): the chosen experts live in slots of the hot
// tier, not stacked by id. A slot holds one expert's gate [rows][cols], up [rows][cols] and
// down [cols][rows], one after another, `slot_elems` BF16 values from the next slot. For this
// launch, slot_of[e] is expert e's slot, or -1 when e is not in the group the host made
// resident for it (a later launch computes that expert's rows). The operations and their
// order are gate_up's and down_mix's: a row's dot is the same warp_dot_bf16, and the mix
// (moe_mix) adds the same products in the same ascending-expert-id order, so a streamed step
// has the bits of a resident one.

// act[t][j][i] = silu(dot(gate_e[i], xn[t])) * dot(up_e[i], xn[t]) for the slots j whose expert
// e = ids[t*k + j] has slot_of[e] >= 0. Grid (ceil(rows/8), k, T).
extern "C" __global__ void __launch_bounds__(256) gate_up_slots(
    const u16* __restrict__ pool, long slot_elems, const int* __restrict__ slot_of, int rows,
    int cols, const u32* __restrict__ ids, int k, const float* __restrict__ xn,
    float* __restrict__ act) {
    const int p = threadIdx.x & 31;
    const int i = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int j = blockIdx.y;
    const int t = blockIdx.z;
    if (i >= rows) return;
    const int s = slot_of[ids[(long)t * k + j]];
    if (s < 0) return;
    const u16* gate = pool + (long)s * slot_elems;
    const u16* up = gate + (long)rows * cols;
    const long row = (long)i * cols;
    const float* x = xn + (long)t * cols;
    const float g = warp_dot_bf16(gate + row, x, cols, p);
    const float u = warp_dot_bf16(up + row, x, cols, p);
    if (p == 0) act[((long)t * k + j) * rows + i] = __fmul_rn(det_silu(g), u);
}

// y[t][j][r] = dot(down_e[r], act[t][j]) for the slots j whose expert has slot_of[e] >= 0; the
// down matrix of a slot follows its gate and up ([hidden][width], width = the gate's rows).
// Grid (ceil(hidden/8), k, T).
extern "C" __global__ void __launch_bounds__(256) down_slots(
    const u16* __restrict__ pool, long slot_elems, const int* __restrict__ slot_of, int hidden,
    int width, const u32* __restrict__ ids, int k, const float* __restrict__ act,
    float* __restrict__ y) {
    const int p = threadIdx.x & 31;
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int j = blockIdx.y;
    const int t = blockIdx.z;
    if (r >= hidden) return;
    const int s = slot_of[ids[(long)t * k + j]];
    if (s < 0) return;
    const u16* down = pool + (long)s * slot_elems + 2L * width * hidden;
    const float v = warp_dot_bf16(down + (long)r * width, act + ((long)t * k + j) * width, width, p);
    if (p == 0) y[((long)t * k + j) * hidden + r] = v;
}

// down_mix's epilogue from the products down_slots wrote: a thread per (row r, token t):
//   acc = +0; for the slots in ascending expert id: acc = acc + w_j * y[t][j][r]
//   (shared expert: add_shared); h[t][r] = h[t][r] + acc
// Grid (ceil(hidden/256), T).
extern "C" __global__ void __launch_bounds__(256) moe_mix(
    int hidden, const float* __restrict__ weights, const u32* __restrict__ by_id, int k,
    const float* __restrict__ y, const float* __restrict__ y_sh, const float* __restrict__ s_sh,
    float* __restrict__ h) {
    const int r = blockIdx.x * 256 + threadIdx.x;
    const int t = blockIdx.y;
    if (r >= hidden) return;
    float acc = 0.0f;
    for (int jj = 0; jj < k; jj++) {
        const int j = (int)by_id[(long)t * k + jj];
        acc = __fadd_rn(acc, __fmul_rn(weights[(long)t * k + j], y[((long)t * k + j) * hidden + r]));
    }
    if (y_sh != nullptr) acc = add_shared(acc, y_sh[(long)t * hidden + r], s_sh, t);
    h[(long)t * hidden + r] = __fadd_rn(h[(long)t * hidden + r], acc);
}
