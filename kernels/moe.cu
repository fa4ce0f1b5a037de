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

// The routers that choose by logit (cpu/forward.rs `route_topk_then_softmax`,
// `route_sigmoid_scales_input`), one token per block of 256 threads. logits [T][E] (gpt-oss's
// already hold the router's bias):
//   selection: the k largest logits in descending total order, the lower expert id first
//   sigmoid == 0 (gpt-oss): probs = weights = softmax over the k chosen logits, selection order
//   sigmoid == 1 (Llama 4): probs = weights = sigmoid(logit) (the weight scales the input)
//   kth / next: the k-th and (k+1)-th logits (NaN when E == k)
// Outputs as route_topk's. Dynamic shared memory: E + 2*k floats.
extern "C" __global__ void __launch_bounds__(256) route_topk_first(
    const float* __restrict__ logits, int e_count, int k, int sigmoid, u32* __restrict__ ids,
    float* __restrict__ probs, float* __restrict__ weights, u32* __restrict__ by_id,
    float* __restrict__ kth, float* __restrict__ next) {
    TARFA_DYN_SMEM(float, dyn);
    __shared__ float red[TARFA_LANES];
    __shared__ int sel[1024];
    float* c = dyn;               // [E] the logits
    float* sp = dyn + e_count;    // [k] the chosen logits
    float* wt = sp + k;           // [k] their weights
    const int t = blockIdx.x;
    const int v = threadIdx.x;
    const float* l = logits + (long)t * e_count;
    for (int i = v; i < e_count; i += TARFA_LANES) c[i] = l[i];
    __syncthreads();
    route_select_block(c, e_count, k, t, sel, next);
    for (int j = v; j < k; j += TARFA_LANES) sp[j] = c[sel[j]];
    __syncthreads();
    if (sigmoid) {
        for (int j = v; j < k; j += TARFA_LANES) wt[j] = det_sigmoid(sp[j]);
        __syncthreads();
    } else {
        softmax_block(sp, k, wt, red);
    }
    route_write_block(sel, wt, wt, k, t, sp[k - 1], ids, probs, weights, by_id, kth);
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

// The experts' function beyond the SwiGLU (tarfa-cuda/src/ops.rs `ExpertMath`), one struct per
// launch: gpt-oss's biases (bg, bu: [E][rows] after the gate and up dots; bd: [E][hidden] after the
// down dot, before the weight; null: none) and clamped SwiGLU (clamped != 0:
// g' = min(g, limit), u' = max(min(u, limit), -limit), a = (u' + 1) * (g' * sigmoid(g' * alpha)));
// Llama 4's input scaling (x_per_slot != 0: slot (t, j) reads its own input row t*k + j, the
// normalised input times its weight; unweighted != 0: the mix adds y, not w * y).
struct ExpertMath {
    const float* bg;
    const float* bu;
    const float* bd;
    float alpha;
    float limit;
    int clamped;
    int x_per_slot;
    int unweighted;
};

// The kernels take ExpertMath's fields as plain arguments (a launch passes scalars and pointers
// only): the gate/up kernels the activation's, the mixing kernels the down bias and `unweighted`.
#define EXPERT_ACT_PARAMS                                                                      \
    const float *__restrict__ bg, const float *__restrict__ bu, float alpha, float limit,     \
        int clamped, int x_per_slot
#define EXPERT_ACT_MATH ExpertMath{bg, bu, nullptr, alpha, limit, clamped, x_per_slot, 0}

// a = act(g + bg, u + bu) for row i of expert e (cpu/forward.rs `expert_products`).
__device__ __forceinline__ float expert_act(const ExpertMath& m, long e, int rows, int i, float g,
                                            float u) {
    if (m.bg != nullptr) {
        g = __fadd_rn(g, m.bg[e * rows + i]);
        u = __fadd_rn(u, m.bu[e * rows + i]);
    }
    if (!m.clamped) return __fmul_rn(det_silu(g), u);
    const float gc = fminf(g, m.limit);
    const float uc = fmaxf(fminf(u, m.limit), -m.limit);
    return __fmul_rn(__fadd_rn(uc, 1.0f), __fmul_rn(gc, det_sigmoid(__fmul_rn(gc, m.alpha))));
}

// acc + w * (y + bd) (or acc + y when unweighted) for row r of expert e: the mix's term.
__device__ __forceinline__ float expert_mix(const ExpertMath& m, float acc, float w, float y,
                                            long e, int hidden, int r) {
    if (m.bd != nullptr) y = __fadd_rn(y, m.bd[e * hidden + r]);
    return m.unweighted ? __fadd_rn(acc, y) : __fadd_rn(acc, __fmul_rn(w, y));
}

// Llama 4's expert inputs (cpu/forward.rs `expert_products`): xs[t*k + j][c] = xn[t][c] * w[t*k + j],
// each product rounded once; the gate/up kernels then read them with x_per_slot. grid (k, T).
extern "C" __global__ void __launch_bounds__(256) scale_slots(const float* __restrict__ xn,
                                                              const float* __restrict__ weights,
                                                              int hidden, int k,
                                                              float* __restrict__ xs) {
    const long slot = (long)blockIdx.y * k + blockIdx.x;
    const float w = weights[slot];
    const float* x = xn + (long)blockIdx.y * hidden;
    for (int c = threadIdx.x; c < hidden; c += TARFA_LANES) xs[slot * hidden + c] = __fmul_rn(x[c], w);
}

// Gate and up projections of the chosen experts with the SwiGLU, a warp per (row i, slot j, token t):
//   g = dot(W_gate[e][i], x), u = dot(W_up[e][i], x), act[t][j][i] = expert_act(g, u)
// with e = ids[t*k + j] read from device memory (ids == null: a dense MLP, e = 0, k = 1) and
// x = xn[t] (xn[t*k + j] when m.x_per_slot).
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
                                             const float* __restrict__ xn, float* __restrict__ act,
                                             const ExpertMath& m) {
    const int p = threadIdx.x & 31;
    const int i = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int j = blockIdx.y;
    const int t = blockIdx.z;
    if (i >= rows) return;
    const long e = ids != nullptr ? (long)ids[(long)t * k + j] : 0;
    const long row = (e * rows + i) * (long)cols;
    const float* x = xn + (m.x_per_slot ? (long)t * k + j : (long)t) * cols;
    float g = gu_dot<W>(gate + row, x, cols, p);
    float u = gu_dot<W>(up + row, x, cols, p);
    if (p == 0) act[((long)t * k + j) * rows + i] = expert_act(m, e, rows, i, g, u);
}

extern "C" __global__ void __launch_bounds__(256) gate_up_bf16(
    const u16* __restrict__ gate, const u16* __restrict__ up, int rows, int cols,
    const u32* __restrict__ ids, int k, const float* __restrict__ xn, float* __restrict__ act,
    EXPERT_ACT_PARAMS) {
    gate_up_body<u16>(gate, up, rows, cols, ids, k, xn, act, EXPERT_ACT_MATH);
}

extern "C" __global__ void __launch_bounds__(256) gate_up_f32(
    const float* __restrict__ gate, const float* __restrict__ up, int rows, int cols,
    const u32* __restrict__ ids, int k, const float* __restrict__ xn, float* __restrict__ act,
    EXPERT_ACT_PARAMS) {
    gate_up_body<float>(gate, up, rows, cols, ids, k, xn, act, EXPERT_ACT_MATH);
}

// The shared expert's term of the mix (cpu/forward.rs `moe_block`): Qwen2-MoE's gated one,
// acc + sigmoid(s_sh[t]) * y; with s_sh null, DeepSeek's / GLM-4.5's ungated ones, acc + y.
__device__ __forceinline__ float add_shared(float acc, float y, const float* __restrict__ s_sh,
                                            int t) {
    return s_sh != nullptr ? __fadd_rn(acc, __fmul_rn(det_sigmoid(s_sh[t]), y))
                           : __fadd_rn(acc, y);
}

// Down projections of the chosen experts, mixed, added to the residual: a warp per (row r, token t):
//   acc = +0; for the slots in ascending expert id: acc = expert_mix(acc, w_e, dot(W_down[e][r],
//   act[t][slot])) (shared expert, when y_sh is not null: add_shared)
//   h[t][r] = h[t][r] + acc
// W_down of one layer is stacked [E][hidden][width]. grid (ceil(hidden/8), T).
extern "C" __global__ void __launch_bounds__(256) down_mix(
    const u16* __restrict__ down, int hidden, int width, const u32* __restrict__ ids,
    const float* __restrict__ weights, const u32* __restrict__ by_id, int k,
    const float* __restrict__ act, const float* __restrict__ y_sh, const float* __restrict__ s_sh,
    float* __restrict__ h, const float* __restrict__ bd, int unweighted) {
    const ExpertMath m{nullptr, nullptr, bd, 0.0f, 0.0f, 0, 0, unweighted};
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
        if (p == 0) acc = expert_mix(m, acc, weights[(long)t * k + j], y, e, hidden, r);
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

// act[t][j][i] = expert_act(dot(gate_e[i], x), dot(up_e[i], x)) for the slots j whose expert
// e = ids[t*k + j] has slot_of[e] >= 0 (x as gate_up's). Grid (ceil(rows/8), k, T).
extern "C" __global__ void __launch_bounds__(256) gate_up_slots(
    const u16* __restrict__ pool, long slot_elems, const int* __restrict__ slot_of, int rows,
    int cols, const u32* __restrict__ ids, int k, const float* __restrict__ xn,
    float* __restrict__ act, EXPERT_ACT_PARAMS) {
    const ExpertMath m = EXPERT_ACT_MATH;
    const int p = threadIdx.x & 31;
    const int i = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int j = blockIdx.y;
    const int t = blockIdx.z;
    if (i >= rows) return;
    const long e = (long)ids[(long)t * k + j];
    const int s = slot_of[e];
    if (s < 0) return;
    const u16* gate = pool + (long)s * slot_elems;
    const u16* up = gate + (long)rows * cols;
    const long row = (long)i * cols;
    const float* x = xn + (m.x_per_slot ? (long)t * k + j : (long)t) * cols;
    const float g = warp_dot_bf16(gate + row, x, cols, p);
    const float u = warp_dot_bf16(up + row, x, cols, p);
    if (p == 0) act[((long)t * k + j) * rows + i] = expert_act(m, e, rows, i, g, u);
}

// y[t][j][r] = dot(down_e[r], act[t][j]) (+ bd[e][r]) for the slots j whose expert has
// slot_of[e] >= 0; the down matrix of a slot follows its gate and up ([hidden][width], width =
// the gate's rows). slot_of == null: every expert resident, the layer's down matrices stacked by
// id from `pool` (expert e's at pool + e * slot_elems, slot_elems = hidden * width): the
// captures' unmixed expert outputs of a step whose down_mix fused them (model.rs, OpSteps).
// Grid (ceil(hidden/8), k, T).
extern "C" __global__ void __launch_bounds__(256) down_slots(
    const u16* __restrict__ pool, long slot_elems, const int* __restrict__ slot_of, int hidden,
    int width, const u32* __restrict__ ids, int k, const float* __restrict__ act,
    float* __restrict__ y, const float* __restrict__ bd) {
    const int p = threadIdx.x & 31;
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int j = blockIdx.y;
    const int t = blockIdx.z;
    if (r >= hidden) return;
    const long e = (long)ids[(long)t * k + j];
    const u16* down;
    if (slot_of != nullptr) {
        const int s = slot_of[e];
        if (s < 0) return;
        down = pool + (long)s * slot_elems + 2L * width * hidden;
    } else {
        down = pool + e * slot_elems;
    }
    float v = warp_dot_bf16(down + (long)r * width, act + ((long)t * k + j) * width, width, p);
    if (bd != nullptr) v = __fadd_rn(v, bd[e * hidden + r]);
    if (p == 0) y[((long)t * k + j) * hidden + r] = v;
}

// down_mix's epilogue from the products down_slots wrote: a thread per (row r, token t):
//   acc = +0; for the slots in ascending expert id: acc = acc + w_j * y[t][j][r] (acc + y[t][j][r]
//   when unweighted: Llama 4) (shared expert: add_shared); h[t][r] = h[t][r] + acc
// Grid (ceil(hidden/256), T).
extern "C" __global__ void __launch_bounds__(256) moe_mix(
    int hidden, const float* __restrict__ weights, const u32* __restrict__ by_id, int k,
    const float* __restrict__ y, const float* __restrict__ y_sh, const float* __restrict__ s_sh,
    float* __restrict__ h, int unweighted) {
    const int r = blockIdx.x * 256 + threadIdx.x;
    const int t = blockIdx.y;
    if (r >= hidden) return;
    float acc = 0.0f;
    for (int jj = 0; jj < k; jj++) {
        const int j = (int)by_id[(long)t * k + jj];
        const float yj = y[((long)t * k + j) * hidden + r];
        acc = unweighted ? __fadd_rn(acc, yj) : __fadd_rn(acc, __fmul_rn(weights[(long)t * k + j], yj));
    }
    if (y_sh != nullptr) acc = add_shared(acc, y_sh[(long)t * hidden + r], s_sh, t);
    h[(long)t * hidden + r] = __fadd_rn(h[(long)t * hidden + r], acc);
}
