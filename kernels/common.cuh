// Shared device code of Tarfa's exact kernels: the contract's functions (docs/EXACTNESS.md
// section 5) and the canonical 256-lane reduction (section 4), written once.
//
// Every function here is a fixed sequence of correctly rounded IEEE-754 binary32 operations with
// subnormals: explicit fmaf where the contract says fma, __fadd_rn/__fmul_rn/__fdiv_rn/__fsqrt_rn
// elsewhere, so that neither the compiler (which also runs with --fmad=false, --ftz=false,
// --prec-div=true, --prec-sqrt=true) nor a later edit can fuse, approximate or reorder them.
// The CPU twins live in tarfa-run/src/numerics (detmath.rs, reduce.rs); the two must never differ.
//
// No #include: NVRTC compiles this with no headers, and the Rust side prepends this file to every
// kernels/*.cu source (which #include it only for standalone tools such as nvcc -Xptxas -v).
#ifndef TARFA_COMMON_CUH
#define TARFA_COMMON_CUH

#define TARFA_FULL_MASK 0xffffffffu
#define TARFA_LANES 256

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

// The KV cache is paged (tarfa-cuda/src/model.rs `CudaCache`, `KV_BLOCK`): a layer's keys (or
// values, or MLA's latent rows) are reached through a table whose entry b points at block b,
// TARFA_KV_BLOCK positions of every KV head, [Hkv][TARFA_KV_BLOCK][w] floats. A cache grows by
// adding blocks and table entries: no row ever moves, so no copy, and a captured graph's table
// pointers stay valid. The rows a kernel reads are the same values in the same order as from one
// contiguous [Hkv][cap][w] buffer: paging changes addresses, never a bit.
#define TARFA_KV_BLOCK 64

// Row `pos` of KV head `head` (w floats) in the paged cache `tbl`.
__device__ __forceinline__ float* kv_row(const u64* tbl, int head, long pos, int w) {
    return reinterpret_cast<float*>(tbl[pos / TARFA_KV_BLOCK]) +
           ((long)head * TARFA_KV_BLOCK + pos % TARFA_KV_BLOCK) * w;
}

#ifndef TARFA_EMU
// Dynamic shared memory of a kernel, 16-byte aligned (the CPU emulator of
// validation/gpu/emu defines its own).
#define TARFA_DYN_SMEM(T, name) extern __shared__ __align__(16) T name[]

// Programmatic dependent launch (Hopper): `grid_dep_wait` blocks until the grids this one depends
// on have completed and their writes are visible; `grid_dep_launch` lets the next grid in the
// stream start launching (its blocks then run up to their own wait). Both are no-ops for a grid
// launched without the programmatic-serialisation attribute. Every kernel launched with that
// attribute calls grid_dep_wait before it touches anything an earlier kernel writes, and
// grid_dep_launch only after that wait (so a grid that starts early may read what the kernel two
// places back wrote, never what the one just before writes).
__device__ __forceinline__ void grid_dep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void grid_dep_launch() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// 16 bytes from global to shared memory without passing through registers (cp.async, sm_80+;
// .cg: cached in L2 only). Nothing is computed: the bytes arrive unchanged. Complete after
// async_copy_wait() in the issuing thread; other threads see them after a barrier that follows.
__device__ __forceinline__ void async_copy16(void* smem, const void* gmem) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}
// 4 bytes the same way (.ca: the only variant for 4-byte copies).
__device__ __forceinline__ void async_copy4(void* smem, const void* gmem) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void async_copy_wait() {
    asm volatile("cp.async.wait_all;" ::: "memory");
}
#endif

__device__ __forceinline__ float f32_bits(u32 b) { return __uint_as_float(b); }

// BF16 (raw bits) widened exactly.
__device__ __forceinline__ float bf16_widen(u16 b) { return __uint_as_float(((u32)b) << 16); }
// The low and high BF16 of a 32-bit word (little-endian: the low half is the lower address).
__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// 2^n for a normal exponent (-126 <= n <= 127).
__device__ __forceinline__ float pow2_f32(int n) { return __uint_as_float(((u32)(n + 127)) << 23); }

// exp(x), the contract's sequence (detmath.rs `exp`).
__device__ __forceinline__ float det_exp(float x) {
    if (x != x) return x;
    if (x >= 89.0f) return f32_bits(0x7f800000u);
    if (x <= -104.0f) return 0.0f;
    const float log2e = f32_bits(0x3FB8AA3Bu);
    const float magic = f32_bits(0x4B400000u);  // 1.5 * 2^23
    float t = __fmul_rn(x, log2e);
    float n = __fsub_rn(__fadd_rn(t, magic), magic);
    float r = fmaf(n, -f32_bits(0x3F318000u), x);
    r = fmaf(n, f32_bits(0x395E8083u), r);
    float p = f32_bits(0x39506967u);
    p = fmaf(p, r, f32_bits(0x3AB743CEu));
    p = fmaf(p, r, f32_bits(0x3C088908u));
    p = fmaf(p, r, f32_bits(0x3D2AA9C1u));
    p = fmaf(p, r, f32_bits(0x3E2AAAAAu));
    p = fmaf(p, r, f32_bits(0x3F000000u));
    float y = __fadd_rn(fmaf(p, __fmul_rn(r, r), r), 1.0f);
    int ni = __float2int_rz(n);  // an integer in [-150, 128]: exact
    int n1 = ni >> 1;            // floor(ni / 2), as Rust's div_euclid(2)
    int n2 = ni - n1;
    return __fmul_rn(__fmul_rn(y, pow2_f32(n1)), pow2_f32(n2));
}

// silu(g) = g / (1 + exp(-g)); sigmoid(z) = 1 / (1 + exp(-z)); rsqrt(v) = 1 / sqrt(v).
__device__ __forceinline__ float det_silu(float g) { return __fdiv_rn(g, __fadd_rn(1.0f, det_exp(-g))); }
__device__ __forceinline__ float det_sigmoid(float z) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, det_exp(-z))); }
__device__ __forceinline__ float det_rsqrt(float v) { return __fdiv_rn(1.0f, __fsqrt_rn(v)); }

// f64 from its bits.
__device__ __forceinline__ double f64_bits(u64 b) { return __longlong_as_double((long long)b); }

// ln(x) in f64 for finite x > 0 (detmath.rs `ln_f64`, fdlibm's __ieee754_log), operation by
// operation with correctly rounded f64 intrinsics (no contraction whatever the options); NaN for
// x <= 0, NaN or infinity, as the CPU's.
__device__ __forceinline__ double det_ln_f64(double x) {
    const double two54 = f64_bits(0x4350000000000000ull);
    const double lg1 = f64_bits(0x3fe5555555555593ull);
    const double lg2 = f64_bits(0x3fd999999997fa04ull);
    const double lg3 = f64_bits(0x3fd2492494229359ull);
    const double lg4 = f64_bits(0x3fcc71c51d8e78afull);
    const double lg5 = f64_bits(0x3fc7466496cb03deull);
    const double lg6 = f64_bits(0x3fc39a09d078c69full);
    const double lg7 = f64_bits(0x3fc2f112df3e5244ull);
    const double ln2_hi = f64_bits(0x3fe62e42fee00000ull);
    const double ln2_lo = f64_bits(0x3dea39ef35793c76ull);
    const double third = f64_bits(0x3fd5555555555555ull);
    if (x != x || x <= 0.0 || x == f64_bits(0x7ff0000000000000ull)) return f64_bits(0x7ff8000000000000ull);
    int k = 0;
    if (x < f64_bits(0x0010000000000000ull)) {  // subnormal: scale into the normal range
        k -= 54;
        x = __dmul_rn(x, two54);
    }
    const u64 bits = (u64)__double_as_longlong(x);
    int hx = (int)(bits >> 32);
    const u32 lx = (u32)bits;
    k += (hx >> 20) - 1023;
    hx &= 0x000fffff;
    int i = (hx + 0x95f64) & 0x100000;
    const u32 hi = (u32)(hx | (i ^ 0x3ff00000));  // x or x/2 into [sqrt(2)/2, sqrt(2))
    x = f64_bits(((u64)hi << 32) | (u64)lx);
    k += i >> 20;
    const double f = __dsub_rn(x, 1.0);
    const double dk = (double)k;  // exact
    if ((0x000fffff & (2 + hx)) < 3) {  // |f| < 2^-20
        if (f == 0.0) return k == 0 ? 0.0 : __dadd_rn(__dmul_rn(dk, ln2_hi), __dmul_rn(dk, ln2_lo));
        const double r = __dmul_rn(__dmul_rn(f, f), __dsub_rn(0.5, __dmul_rn(third, f)));
        return k == 0 ? __dsub_rn(f, r)
                      : __dsub_rn(__dmul_rn(dk, ln2_hi), __dsub_rn(__dsub_rn(r, __dmul_rn(dk, ln2_lo)), f));
    }
    const double s = __ddiv_rn(f, __dadd_rn(2.0, f));
    const double z = __dmul_rn(s, s);
    i = hx - 0x6147a;
    const double w = __dmul_rn(z, z);
    const int j = 0x6b851 - hx;
    const double t1 = __dmul_rn(w, __dadd_rn(lg2, __dmul_rn(w, __dadd_rn(lg4, __dmul_rn(w, lg6)))));
    const double t2 =
        __dmul_rn(z, __dadd_rn(lg1, __dmul_rn(w, __dadd_rn(lg3, __dmul_rn(w, __dadd_rn(lg5, __dmul_rn(w, lg7)))))));
    i |= j;
    const double r = __dadd_rn(t2, t1);
    if (i > 0) {
        const double hfsq = __dmul_rn(__dmul_rn(0.5, f), f);
        const double sr = __dmul_rn(s, __dadd_rn(hfsq, r));
        if (k == 0) return __dsub_rn(f, __dsub_rn(hfsq, sr));
        return __dsub_rn(__dmul_rn(dk, ln2_hi),
                         __dsub_rn(__dsub_rn(hfsq, __dadd_rn(sr, __dmul_rn(dk, ln2_lo))), f));
    }
    const double sfr = __dmul_rn(s, __dsub_rn(f, r));
    if (k == 0) return __dsub_rn(f, sfr);
    return __dsub_rn(__dmul_rn(dk, ln2_hi), __dsub_rn(__dsub_rn(sfr, __dmul_rn(dk, ln2_lo)), f));
}

// softplus(x) = ln(1 + exp(x)), torch's threshold 20 (detmath.rs `softplus`): e = exp(x) in f32,
// then in f64 ln(1 + e) (1 + e exact for e >= 2^-20), below that e - e*e/2; rounded once to f32.
__device__ __forceinline__ float det_softplus(float x) {
    if (x != x || x > 20.0f) return x;
    const double e = (double)det_exp(x);  // exact widening
    const double tiny = f64_bits(0x3EB0000000000000ull);  // 2^-20
    const double r = e < tiny ? __dsub_rn(e, __dmul_rn(__dmul_rn(e, e), 0.5)) : det_ln_f64(__dadd_rn(1.0, e));
    return __double2float_rn(r);
}

// Rounds to BF16 (ties to even) and widens back: the deliberately inexact validation arm only
// (reduce.rs `f32_to_bf16_rne`).
__device__ __forceinline__ float bf16_round_trip(float x) {
    u32 b = __float_as_uint(x);
    u32 h;
    if (x != x) {
        h = (b >> 16) | 0x40u;
    } else {
        h = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    }
    return __uint_as_float((h & 0xffffu) << 16);
}

// Rust's f32::total_cmp key: comparing keys as signed integers is the IEEE total order.
__device__ __forceinline__ int total_order_key(float x) {
    int b = __float_as_int(x);
    return b ^ (int)(((u32)(b >> 31)) >> 1);
}

// Eight consecutive weights of type W (16-byte aligned): one 16-byte load for BF16, two for
// F32 (decode.cu, tile.cu).
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

// ---------------------------------------------------------------------------------------------
// The canonical reduction with a warp: thread p (0..31) holds virtual lanes 8p..8p+7 of every
// 256-element chunk in a[0..7]; chunks are visited in increasing order, so lane v accumulates
// terms v, v+256, ... in increasing n. Elements past the end are skipped, which equals the CPU's
// zero padding (a lane accumulator is never -0.0, so a + 0 = a).

// Accumulates the dot of a BF16 row and an f32 vector of n elements into a[].
__device__ __forceinline__ void warp_acc_bf16(float a[8], const u16* __restrict__ w,
                                              const float* __restrict__ x, int n, int p) {
    if ((n & 7) == 0 && ((((u64)w) & 15) == 0) && ((((u64)x) & 15) == 0)) {
        for (int base = 8 * p; base < n; base += TARFA_LANES) {
            uint4 q = *reinterpret_cast<const uint4*>(w + base);  // 8 BF16: one 16-byte load
            float4 x0 = *reinterpret_cast<const float4*>(x + base);
            float4 x1 = *reinterpret_cast<const float4*>(x + base + 4);
            a[0] = fmaf(bf16_lo(q.x), x0.x, a[0]);
            a[1] = fmaf(bf16_hi(q.x), x0.y, a[1]);
            a[2] = fmaf(bf16_lo(q.y), x0.z, a[2]);
            a[3] = fmaf(bf16_hi(q.y), x0.w, a[3]);
            a[4] = fmaf(bf16_lo(q.z), x1.x, a[4]);
            a[5] = fmaf(bf16_hi(q.z), x1.y, a[5]);
            a[6] = fmaf(bf16_lo(q.w), x1.z, a[6]);
            a[7] = fmaf(bf16_hi(q.w), x1.w, a[7]);
        }
    } else {
        for (int base = 8 * p; base < n; base += TARFA_LANES) {
#pragma unroll
            for (int s = 0; s < 8; s++) {
                if (base + s < n) a[s] = fmaf(bf16_widen(w[base + s]), x[base + s], a[s]);
            }
        }
    }
}

// Accumulates the dot of two f32 vectors of n elements into a[].
__device__ __forceinline__ void warp_acc_f32(float a[8], const float* __restrict__ w,
                                             const float* __restrict__ x, int n, int p) {
    if ((n & 7) == 0 && ((((u64)w) & 15) == 0) && ((((u64)x) & 15) == 0)) {
        for (int base = 8 * p; base < n; base += TARFA_LANES) {
            float4 w0 = *reinterpret_cast<const float4*>(w + base);
            float4 w1 = *reinterpret_cast<const float4*>(w + base + 4);
            float4 x0 = *reinterpret_cast<const float4*>(x + base);
            float4 x1 = *reinterpret_cast<const float4*>(x + base + 4);
            a[0] = fmaf(w0.x, x0.x, a[0]);
            a[1] = fmaf(w0.y, x0.y, a[1]);
            a[2] = fmaf(w0.z, x0.z, a[2]);
            a[3] = fmaf(w0.w, x0.w, a[3]);
            a[4] = fmaf(w1.x, x1.x, a[4]);
            a[5] = fmaf(w1.y, x1.y, a[5]);
            a[6] = fmaf(w1.z, x1.z, a[6]);
            a[7] = fmaf(w1.w, x1.w, a[7]);
        }
    } else {
        for (int base = 8 * p; base < n; base += TARFA_LANES) {
#pragma unroll
            for (int s = 0; s < 8; s++) {
                if (base + s < n) a[s] = fmaf(w[base + s], x[base + s], a[s]);
            }
        }
    }
}

// The fixed tree over the 256 lanes: h = 128, 64, 32, 16, 8 pair thread p with p + 16, 8, 4, 2, 1
// (shfl_down), then h = 4, 2, 1 inside thread 0. The result is valid in thread 0 only. Every
// thread of the warp must call it.
__device__ __forceinline__ float warp_tree(float a[8]) {
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) {
#pragma unroll
        for (int s = 0; s < 8; s++) a[s] = __fadd_rn(a[s], __shfl_down_sync(TARFA_FULL_MASK, a[s], off));
    }
    a[0] = __fadd_rn(a[0], a[4]);
    a[1] = __fadd_rn(a[1], a[5]);
    a[2] = __fadd_rn(a[2], a[6]);
    a[3] = __fadd_rn(a[3], a[7]);
    a[0] = __fadd_rn(a[0], a[2]);
    a[1] = __fadd_rn(a[1], a[3]);
    return __fadd_rn(a[0], a[1]);
}

// warp_tree's result (the same pairs a[v] + a[v+h], level by level, each sum with the lower
// lane's value first) with 12 shuffles instead of 40: the first three levels split the work
// between the two threads that hold a pair's operands (recursive halving), so after them every
// thread holds one partial sum instead of shuffling all 8 at every level. Thread t = (b4..b0):
// - h = 128: threads t and t^16 hold lanes 8p+s and 8p+s+128 (p = t & 15) for every s; the
//   lower keeps s = 0..3, the upper s = 4..7, each receiving the 4 operands it lacks;
// - h = 64 (partner t^8) and h = 32 (t^4) halve again: thread t then holds lane
//   v = 8 (t & 3) + 4 b4 + 2 b3 + b2 of the 32 lanes left;
// - h = 16, 8 (partners t^2, t^1), then h = 4, 2, 1 (lanes 4 b4 + 2 b3 + b2 left: partners t^16,
//   t^8, t^4), the lower thread adding its own value first.
// The result is valid in thread 0 only. Every thread of the warp must call it.
__device__ __forceinline__ float warp_tree_fast(const float a[8]) {
    const int t = threadIdx.x & 31;
    float b[4], c[2];
    const bool lo4 = (t & 16) == 0;
#pragma unroll
    for (int s = 0; s < 4; s++) {
        const float r = __shfl_xor_sync(TARFA_FULL_MASK, lo4 ? a[s + 4] : a[s], 16);
        b[s] = lo4 ? __fadd_rn(a[s], r) : __fadd_rn(r, a[s + 4]);
    }
    const bool lo3 = (t & 8) == 0;
#pragma unroll
    for (int s = 0; s < 2; s++) {
        const float r = __shfl_xor_sync(TARFA_FULL_MASK, lo3 ? b[s + 2] : b[s], 8);
        c[s] = lo3 ? __fadd_rn(b[s], r) : __fadd_rn(r, b[s + 2]);
    }
    const bool lo2 = (t & 4) == 0;
    float d;
    {
        const float r = __shfl_xor_sync(TARFA_FULL_MASK, lo2 ? c[1] : c[0], 4);
        d = lo2 ? __fadd_rn(c[0], r) : __fadd_rn(r, c[1]);
    }
    // h = 16, 8, then 4, 2, 1: one value per thread, the lower thread of each pair adds
    d = __fadd_rn(d, __shfl_xor_sync(TARFA_FULL_MASK, d, 2));
    d = __fadd_rn(d, __shfl_xor_sync(TARFA_FULL_MASK, d, 1));
    d = __fadd_rn(d, __shfl_xor_sync(TARFA_FULL_MASK, d, 16));
    d = __fadd_rn(d, __shfl_xor_sync(TARFA_FULL_MASK, d, 8));
    d = __fadd_rn(d, __shfl_xor_sync(TARFA_FULL_MASK, d, 4));
    return d;
}

__device__ __forceinline__ void zero8(float a[8]) {
#pragma unroll
    for (int s = 0; s < 8; s++) a[s] = 0.0f;
}

// Canonical dot of a BF16 row and an f32 vector, valid in lane 0 of the calling warp.
__device__ __forceinline__ float warp_dot_bf16(const u16* w, const float* x, int n, int p) {
    float a[8];
    zero8(a);
    warp_acc_bf16(a, w, x, n, p);
    return warp_tree(a);
}

// Canonical dot of two f32 vectors, valid in lane 0 of the calling warp.
__device__ __forceinline__ float warp_dot_f32(const float* w, const float* x, int n, int p) {
    float a[8];
    zero8(a);
    warp_acc_f32(a, w, x, n, p);
    return warp_tree(a);
}

// Canonical dot of a weight row (BF16 widened, or F32) with an f32 vector, valid in lane 0
// (matvec.cu, mla.cu).
template <typename W>
__device__ __forceinline__ float row_dot(const W* w, const float* x, int n, int p);

template <>
__device__ __forceinline__ float row_dot<u16>(const u16* w, const float* x, int n, int p) {
    return warp_dot_bf16(w, x, n, p);
}
template <>
__device__ __forceinline__ float row_dot<float>(const float* w, const float* x, int n, int p) {
    return warp_dot_f32(w, x, n, p);
}

// The same tree with a 256-thread block where thread v holds lane v (s[] has 256 floats of
// shared memory; the caller has stored its lane in s[threadIdx.x]). Returns the result to every
// thread. Starts and ends with a barrier, so s[] may be reused right after.
__device__ __forceinline__ float block_tree_256(float* s) {
    const int v = threadIdx.x;
    for (int h = 128; h >= 1; h >>= 1) {
        __syncthreads();
        if (v < h) s[v] = __fadd_rn(s[v], s[v + h]);
    }
    __syncthreads();
    float r = s[0];
    __syncthreads();
    return r;
}

// Canonical sum of t[0..n) by a 256-thread block (lane v = thread v accumulates t[v], t[v+256],
// ... in increasing order). `s` is 256 floats of shared memory.
__device__ __forceinline__ float block_sum_256(const float* t, int n, float* s) {
    float a = 0.0f;
    for (int i = threadIdx.x; i < n; i += TARFA_LANES) a = __fadd_rn(a, t[i]);
    s[threadIdx.x] = a;
    return block_tree_256(s);
}

// Maximum of t[0..n) by a block of 256 threads, NaN ignored (as f32::max folds from -inf): a
// maximum is the same whatever the order, and the sign of a zero maximum never changes a result
// (x - (+0) and x - (-0) differ only for x = -0, where exp gives 1 either way).
__device__ __forceinline__ float block_max_256(const float* t, int n, float* s) {
    float m = f32_bits(0xff800000u);
    for (int i = threadIdx.x; i < n; i += TARFA_LANES) m = fmaxf(m, t[i]);
    s[threadIdx.x] = m;
    for (int h = 128; h >= 1; h >>= 1) {
        __syncthreads();
        if ((int)threadIdx.x < h) s[threadIdx.x] = fmaxf(s[threadIdx.x], s[threadIdx.x + h]);
    }
    __syncthreads();
    float r = s[0];
    __syncthreads();
    return r;
}


// ---------------------------------------------------------------------------------------------
// The router's selection for one token, by a block of 256 threads (cpu/forward.rs `select`): the
// k experts of largest c[i] in descending total order, the lower expert id first among equals, into
// sel[0..k) (shared); next[t] = the (k+1)-th's c, or NaN when E == k. Ends with a barrier.
__device__ __forceinline__ void route_select_block(const float* c, int e_count, int k, int t,
                                                   int* sel, float* __restrict__ next) {
    const int v = threadIdx.x;
    // rank of expert i in the order (descending total order of c, ascending id among equals)
    for (int i = v; i < e_count; i += TARFA_LANES) {
        const int ki = total_order_key(c[i]);
        int rank = 0;
        for (int j = 0; j < e_count; j++) {
            const int kj = total_order_key(c[j]);
            rank += (kj > ki || (kj == ki && j < i)) ? 1 : 0;
        }
        if (rank < k) sel[rank] = i;
        if (rank == k) next[t] = c[i];
    }
    if (v == 0 && e_count == k) next[t] = f32_bits(0x7fc00000u);
    __syncthreads();
}

// The router's records of one token from its selection sel[0..k) and each slot's probability
// sp[j] and weight wt[j] (shared): at `base` = t*k ids, probs, weights and by_id (the selection
// slots in ascending expert id: the mixing order); kth[t] = kth_value.
__device__ __forceinline__ void route_write_block(const int* sel, const float* sp, const float* wt,
                                                  int k, int t, float kth_value,
                                                  u32* __restrict__ ids, float* __restrict__ probs,
                                                  float* __restrict__ weights,
                                                  u32* __restrict__ by_id, float* __restrict__ kth) {
    const long base = (long)t * k;
    for (int j = threadIdx.x; j < k; j += TARFA_LANES) {
        const int e = sel[j];
        ids[base + j] = (u32)e;
        probs[base + j] = sp[j];
        weights[base + j] = wt[j];
        int pos = 0;  // the slot's place in ascending expert id (ids are distinct)
        for (int jj = 0; jj < k; jj++) pos += (sel[jj] < e) ? 1 : 0;
        by_id[base + pos] = (u32)j;
    }
    if (threadIdx.x == 0) kth[t] = kth_value;
}

// p = softmax(l) into pe[0..E) (max, exp, canonical sum, divide). Ends with a barrier.
__device__ __forceinline__ void softmax_block(const float* l, int e_count, float* pe, float* red) {
    const int v = threadIdx.x;
    const float m = block_max_256(l, e_count, red);
    for (int i = v; i < e_count; i += TARFA_LANES) pe[i] = det_exp(__fsub_rn(l[i], m));
    const float total = block_sum_256(pe, e_count, red);  // ends with a barrier
    for (int i = v; i < e_count; i += TARFA_LANES) pe[i] = __fdiv_rn(pe[i], total);
    __syncthreads();
}

// The router's softmax and top-k for one token, by a block of 256 threads (cpu/forward.rs `route`,
// contract section 2): l = the token's E logits (any memory the block can read);
//   p = softmax(l) (max, exp, canonical sum, divide)
//   selection: the k largest p in descending total order, the lower expert id first among equals
//   weights: p_j / canonical_sum(selected p in selection order) when `renorm`, else p_j
// Outputs at `base` = t*k in ids, probs, weights, by_id (the selection slots in ascending expert
// id: the mixing order), and kth[t], next[t] (NaN when E == k). pe: E floats, sp: k floats, sel:
// k ints, red: 256 floats, all shared. Every thread of the block calls it.
__device__ __forceinline__ void route_block(const float* l, int e_count, int k, int renorm,
                                            int t, u32* __restrict__ ids,
                                            float* __restrict__ probs,
                                            float* __restrict__ weights, u32* __restrict__ by_id,
                                            float* __restrict__ kth, float* __restrict__ next,
                                            float* pe, float* sp, int* sel, float* red) {
    const int v = threadIdx.x;
    softmax_block(l, e_count, pe, red);
    route_select_block(pe, e_count, k, t, sel, next);
    for (int j = v; j < k; j += TARFA_LANES) sp[j] = pe[sel[j]];
    __syncthreads();
    float s = 1.0f;
    if (renorm) s = block_sum_256(sp, k, red);
    const long base = (long)t * k;
    for (int j = v; j < k; j += TARFA_LANES) {
        const int e = sel[j];
        ids[base + j] = (u32)e;
        probs[base + j] = sp[j];
        weights[base + j] = renorm ? __fdiv_rn(sp[j], s) : sp[j];
        int pos = 0;  // the slot's place in ascending expert id (ids are distinct)
        for (int jj = 0; jj < k; jj++) pos += (sel[jj] < e) ? 1 : 0;
        by_id[base + pos] = (u32)j;
    }
    if (v == 0) kth[t] = sp[k - 1];
}

#endif  // TARFA_COMMON_CUH
