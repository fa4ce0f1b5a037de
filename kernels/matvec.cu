// Matrix-vector products, a warp per (output row, token): out[t][r] = dot(W[r], x[t]) (+ bias[r]),
// each one canonical reduction (common.cuh). Blocks of 256 threads = 8 rows; grid (ceil(rows/8), T).
//
// mode 0: out[t*out_stride + r] = y
// mode 1: out[t*out_stride + r] = out[t*out_stride + r] + y      (residual: h = h + W x)
// where y = dot (+ bias[r] when bias is not null), as cpu/forward.rs `apply` + `add_bias` +
// `add_rows` compute it.
#include "common.cuh"


template <typename W>
__device__ __forceinline__ void matvec_body(const W* __restrict__ w, int rows, int cols,
                                            const float* __restrict__ x, long x_stride,
                                            const float* __restrict__ bias, float* out,
                                            long out_stride, int mode) {
    const int p = threadIdx.x & 31;
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int t = blockIdx.y;
    if (r >= rows) return;  // a whole warp leaves together
    float y = row_dot<W>(w + (long)r * cols, x + (long)t * x_stride, cols, p);
    if (p == 0) {
        if (bias != nullptr) y = __fadd_rn(y, bias[r]);
        float* o = out + (long)t * out_stride + r;
        *o = (mode == 1) ? __fadd_rn(*o, y) : y;
    }
}

extern "C" __global__ void __launch_bounds__(256) matvec_bf16(
    const u16* __restrict__ w, int rows, int cols, const float* __restrict__ x, long x_stride,
    const float* __restrict__ bias, float* out, long out_stride, int mode) {
    matvec_body<u16>(w, rows, cols, x, x_stride, bias, out, out_stride, mode);
}

extern "C" __global__ void __launch_bounds__(256) matvec_f32(
    const float* __restrict__ w, int rows, int cols, const float* __restrict__ x, long x_stride,
    const float* __restrict__ bias, float* out, long out_stride, int mode) {
    matvec_body<float>(w, rows, cols, x, x_stride, bias, out, out_stride, mode);
}
