// A CPU emulator for Tarfa's CUDA kernels (test only): kernels/*.cu compiled as C++ with this
// header in front. Every CUDA thread of a block is a fiber (its own stack, switched in user
// space) on the calling OS thread; __syncthreads and the warp shuffles are barriers between the
// fibers, so the kernels' code runs as written, deterministically. Blocks run one after another,
// so a kernel's `__shared__` variables are C++ statics. Arithmetic is the host's IEEE binary32
// with round-to-nearest and subnormals, built with -ffp-contract=off (fmaf is one fused
// operation, nothing else is fused): the operations the kernels ask the GPU for.
//
// It checks the kernels' logic (indices, predicates, reduction order, barriers) against the
// CPU reference through the mock device of tarfa-run/src/cuda/mock.rs; it cannot check what
// only hardware shows (timing, memory ordering between blocks of one grid, resources).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#define TARFA_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3e {
    unsigned x, y, z;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) int4 {
    int x, y, z, w;
};

// The running fiber's view (set by the scheduler before it switches to a fiber).
extern dim3e threadIdx, blockIdx, blockDim, gridDim;
extern unsigned char* emu_dyn;
void emu_block_barrier();
void emu_warp_barrier();
float* emu_warp_buf();
int emu_lane();

#define TARFA_DYN_SMEM(T, name) T* name = reinterpret_cast<T*>(emu_dyn)

inline void grid_dep_wait() {}
inline void grid_dep_launch() {}
// cp.async: the copy happens at once (a fiber runs alone until its next barrier or shuffle).
inline void async_copy16(void* smem, const void* gmem) { std::memcpy(smem, gmem, 16); }
inline void async_copy4(void* smem, const void* gmem) { std::memcpy(smem, gmem, 4); }
inline void async_copy_wait() {}

inline void __syncthreads() { emu_block_barrier(); }
inline float emu_xchg(float v, int src_lane, bool valid) {
    float* buf = emu_warp_buf();
    buf[emu_lane()] = v;
    emu_warp_barrier();
    const float r = valid ? buf[src_lane] : v;
    emu_warp_barrier();
    return r;
}
inline float __shfl_down_sync(unsigned, float v, int off) {
    const int l = emu_lane();
    return emu_xchg(v, l + off, l + off < 32);
}
inline float __shfl_sync(unsigned, float v, int src) { return emu_xchg(v, src & 31, true); }
inline float __shfl_xor_sync(unsigned, float v, int mask) {
    return emu_xchg(v, (emu_lane() ^ mask) & 31, true);
}
// Integer shuffles: the bits travel through the float exchange unchanged (memcpy, no arithmetic).
inline int emu_xchg_int(int v, int src_lane) {
    float f;
    std::memcpy(&f, &v, 4);
    f = emu_xchg(f, src_lane, true);
    int r;
    std::memcpy(&r, &f, 4);
    return r;
}
inline int __shfl_sync(unsigned, int v, int src) { return emu_xchg_int(v, src & 31); }
inline int __shfl_xor_sync(unsigned, int v, int mask) {
    return emu_xchg_int(v, (emu_lane() ^ mask) & 31);
}
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp_barrier(); }

inline void __threadfence() {}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
    const unsigned old = *p;
    *p = old + v;
    return old;
}

template <typename T>
inline T __ldg(const T* p) {
    return *p;
}
template <typename T>
inline T __ldcg(const T* p) {
    return *p;
}

inline float __uint_as_float(unsigned b) {
    float f;
    std::memcpy(&f, &b, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned b;
    std::memcpy(&b, &f, 4);
    return b;
}
inline int __float_as_int(float f) {
    int b;
    std::memcpy(&b, &f, 4);
    return b;
}
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline int __float2int_rz(float a) { return (int)a; }
// f64: x86-64's SSE2 arithmetic is IEEE binary64, round to nearest (no contraction: -ffp-contract=off)
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline float __double2float_rn(double a) { return (float)a; }
inline long long __double_as_longlong(double d) {
    long long b;
    std::memcpy(&b, &d, 8);
    return b;
}
inline double __longlong_as_double(long long b) {
    double d;
    std::memcpy(&d, &b, 8);
    return d;
}
using std::fmaf;
using std::fmaxf;
// CUDA's integer min overloads
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
