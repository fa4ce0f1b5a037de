// Issue 25 (research, not the product): the hardware side of the MMA model's check, and the
// prototype tensor-core GEMM under the candidate contract v2. Compiled by NVRTC with the
// product's options (--fmad=false, --ftz=false, compute_90).

typedef unsigned short u16;
typedef unsigned int u32;

__device__ __forceinline__ void mma_bf16(float d[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 pack(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }

// One MMA per warp. Tile t: a[t][16 rows][16 k], b[t][8 cols][16 k] (B column-major), c and d
// [t][16 rows][8 cols] as f32 bits. Fragment layouts of PTX ISA "mma.m16n8k16" for .bf16:
// group g = lane / 4, thread-in-group q = lane % 4;
//   A: a0 = (row g, k 2q..2q+1), a1 = (row g+8, k 2q..), a2 = (row g, k 2q+8..), a3 = (row g+8, k 2q+8..)
//   B: b0 = (k 2q..2q+1, col g), b1 = (k 2q+8.., col g)
//   C/D: c0,c1 = (row g, cols 2q, 2q+1), c2,c3 = (row g+8, cols 2q, 2q+1)
extern "C" __global__ void mma_verify(const u16* __restrict__ a, const u16* __restrict__ b,
                                      const u32* __restrict__ c, u32* __restrict__ d,
                                      unsigned long long tiles) {
    unsigned long long t = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (t >= tiles) return;
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const u16* A = a + t * 256;
    const u16* B = b + t * 128;
    const u32* C = c + t * 128;
    u32 a0 = pack(A[g * 16 + 2 * q], A[g * 16 + 2 * q + 1]);
    u32 a1 = pack(A[(g + 8) * 16 + 2 * q], A[(g + 8) * 16 + 2 * q + 1]);
    u32 a2 = pack(A[g * 16 + 2 * q + 8], A[g * 16 + 2 * q + 9]);
    u32 a3 = pack(A[(g + 8) * 16 + 2 * q + 8], A[(g + 8) * 16 + 2 * q + 9]);
    u32 b0 = pack(B[g * 16 + 2 * q], B[g * 16 + 2 * q + 1]);
    u32 b1 = pack(B[g * 16 + 2 * q + 8], B[g * 16 + 2 * q + 9]);
    float acc[4];
    acc[0] = __uint_as_float(C[g * 8 + 2 * q]);
    acc[1] = __uint_as_float(C[g * 8 + 2 * q + 1]);
    acc[2] = __uint_as_float(C[(g + 8) * 8 + 2 * q]);
    acc[3] = __uint_as_float(C[(g + 8) * 8 + 2 * q + 1]);
    mma_bf16(acc, a0, a1, a2, a3, b0, b1);
    u32* D = d + t * 128;
    D[g * 8 + 2 * q] = __float_as_uint(acc[0]);
    D[g * 8 + 2 * q + 1] = __float_as_uint(acc[1]);
    D[(g + 8) * 8 + 2 * q] = __float_as_uint(acc[2]);
    D[(g + 8) * 8 + 2 * q + 1] = __float_as_uint(acc[3]);
}

// The exact 3-way split x = x1 + x2 + x3 (each a BF16 truncation of what is left), as the CPU
// model's split3. x: n f32; out: 3 planes of n BF16.
extern "C" __global__ void split3(const float* __restrict__ x, u16* __restrict__ x1,
                                  u16* __restrict__ x2, u16* __restrict__ x3,
                                  unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    u32 bits = __float_as_uint(v);
    if ((bits & 0x7F800000u) == 0x7F800000u) {
        u16 hi = (u16)(bits >> 16);
        if (bits & 0x007FFFFFu) hi |= 0x0040;
        x1[i] = hi;
        x2[i] = 0;
        x3[i] = 0;
        return;
    }
    u32 h = bits & 0xFFFF0000u;
    float r1 = __fsub_rn(v, __uint_as_float(h));
    u32 m = __float_as_uint(r1) & 0xFFFF0000u;
    float r2 = __fsub_rn(r1, __uint_as_float(m));
    x1[i] = (u16)(h >> 16);
    x2[i] = (u16)(m >> 16);
    x3[i] = (u16)(__float_as_uint(r2) >> 16);
}

// The prototype GEMM: out[n][m] = dot_v2(w row m, x row n), w: M x K BF16 row-major, x split
// into xs = 3 planes of N x K BF16 (token-major). Each output's accumulator starts at +0 and,
// for each 16-chunk of k in increasing order, takes mma(w, x1), mma(w, x2), mma(w, x3): one
// thread owns it for the whole K (no split-K). Block tile 64 (M) x 64 (N), BK = 64, 4 warps in
// 2 x 2, each 32 x 32 (2 x 4 MMA tiles). Requires M, N, K multiples of 64.
#define BM 64
#define BN 64
#define BK 64
#define LDS (BK + 8)
extern "C" __global__ void __launch_bounds__(128)
    gemm_v2(const u16* __restrict__ w, const u16* __restrict__ xs, float* __restrict__ out, int M,
            int N, int K) {
    __shared__ __align__(16) u16 sw[BM * LDS];
    __shared__ __align__(16) u16 sx[3][BN * LDS];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int g = lane >> 2, q = lane & 3;
    int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    int wm = (warp & 1) * 32, wn = (warp >> 1) * 32;
    size_t plane = (size_t)N * K;
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += BK) {
        // 64 rows x 64 BF16 = 512 uint4 per tile; 128 threads x 4
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int idx = tid + i * 128, r = idx >> 3, cc = (idx & 7) * 8;
            *(uint4*)&sw[r * LDS + cc] = *(const uint4*)&w[(size_t)(m0 + r) * K + k0 + cc];
#pragma unroll
            for (int s = 0; s < 3; s++)
                *(uint4*)&sx[s][r * LDS + cc] =
                    *(const uint4*)&xs[s * plane + (size_t)(n0 + r) * K + k0 + cc];
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            u32 af[2][4];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const u16* base = &sw[(wm + i * 16) * LDS + kk];
                af[i][0] = *(const u32*)&base[g * LDS + 2 * q];
                af[i][1] = *(const u32*)&base[(g + 8) * LDS + 2 * q];
                af[i][2] = *(const u32*)&base[g * LDS + 2 * q + 8];
                af[i][3] = *(const u32*)&base[(g + 8) * LDS + 2 * q + 8];
            }
#pragma unroll
            for (int s = 0; s < 3; s++) {
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const u16* base = &sx[s][(wn + j * 8) * LDS + kk];
                    u32 b0 = *(const u32*)&base[g * LDS + 2 * q];
                    u32 b1 = *(const u32*)&base[g * LDS + 2 * q + 8];
#pragma unroll
                    for (int i = 0; i < 2; i++)
                        mma_bf16(acc[i][j], af[i][0], af[i][1], af[i][2], af[i][3], b0, b1);
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int row = m0 + wm + i * 16 + g, col = n0 + wn + j * 8 + 2 * q;
            out[(size_t)col * M + row] = acc[i][j][0];
            out[(size_t)(col + 1) * M + row] = acc[i][j][1];
            out[(size_t)col * M + row + 8] = acc[i][j][2];
            out[(size_t)(col + 1) * M + row + 8] = acc[i][j][3];
        }
}
