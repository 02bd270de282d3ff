// selftest.cu: small kernels that check the CPU emulation itself (feature `cuda-emu` only):
// that barriers, shuffles and thread coordinates behave as on a GPU, and that every fault the
// emulation promises to report (emu.h) is reported. Written in CUDA syntax and translated by
// build/emu.rs like the real kernels; driven by tests/cuda_emu_selftest.rs.
#include <cuda_runtime.h>

#include "mma.cuh"
#include "pagedkv_emu.h"
#include "prefill_mma.cuh"
#include "wgmma.cuh"

namespace {

// Tree reduction in shared memory over a 2-D block; one sum per block of a 2-D grid.
__global__ void block_sum_kernel(const int *in, int *out) {
  extern __shared__ int part[];
  const int nt = blockDim.x * blockDim.y;
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  const int b = blockIdx.y * gridDim.x + blockIdx.x;
  part[t] = in[b * nt + t];
  __syncthreads();
  for (int half = nt / 2; half > 0; half /= 2) {
    if (t < half) part[t] += part[t + half];
    __syncthreads();
  }
  if (t == 0) out[b] = part[0];
}

// Two warps, no barrier between warp 0's write of `flag` and warp 1's read of it (a race on a
// GPU): which value warp 1 reads tells which warp the schedule ran ahead.
__global__ void warp_ahead_kernel(int *out) {
  __shared__ int flag;
  const int t = threadIdx.x;
  if (t == 0) flag = 0;
  __syncthreads();
  __syncwarp();
  if (t == 0) flag = 1;
  if (t == 32) out[0] = flag;
  __syncthreads();
}

__global__ void shuffle_kernel(int *out) {
  const int t = threadIdx.x;
  for (int k = 0; k < 5; ++k) out[t * 5 + k] = __shfl_xor_sync(0xffffffffu, t * 10, 1 << k);
}

__global__ void divergent_barrier_kernel() {
  // Lanes 0..15 wait for the block, lanes 16..31 for the warp: neither barrier can complete.
  if (threadIdx.x % 32 < 16)
    __syncthreads();
  else
    __syncwarp();
}

__global__ void shuffle_from_returned_lane_kernel(int *out) {
  if (threadIdx.x == 31) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}

__global__ void vector_load_kernel(const void *p, int *out) {
  const uint4 v = __ldg(reinterpret_cast<const uint4 *>(p));
  out[0] = (int)v.x;
}

__global__ void smem_kernel(float *out, int n) {
  extern __shared__ float buf[];
  // Thread 0 reports what a never-written word holds, then everyone writes and reads back.
  if (threadIdx.x == 0) out[n] = buf[n - 1];
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = (float)i;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = buf[n - 1 - i];
}

__global__ void static_shared_kernel(float *out) {
  __shared__ float cell[2], other[3];
  // Every block reports what the never-written cells hold, then leaves values behind that a
  // later block must not see.
  if (threadIdx.x == 0) {
    out[2 * blockIdx.x] = cell[1];
    out[2 * blockIdx.x + 1] = other[2];
  }
  __syncthreads();
  if (threadIdx.x == 0) cell[1] = other[2] = 1.0f;
}

__global__ void static_plus_dynamic_kernel(float *out) {
  extern __shared__ float dyn[];
  __shared__ float fixed[1024];  // 4 KiB
  fixed[threadIdx.x] = dyn[threadIdx.x] = 0.f;
  out[threadIdx.x] = fixed[threadIdx.x] + dyn[threadIdx.x];
}

__global__ void empty_kernel() {}

__global__ void write_kernel(int *p, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] = i;
}

__global__ void shuffle_idx_kernel(int *out, int width) {
  const int t = threadIdx.x;
  out[t] = __shfl_sync(0xffffffffu, t * 10, (t * 7 + 3) % 32, width);
}

// Warp w votes any on "lane == w * 5 % 32" (warp 2: no lane votes yes; its lane 31 has
// returned) and all on "not (warp 1, lane 7)"; out[t] = any | all << 1. Then a ballot of
// "lane % 3 == w" into out[96 + t] and its __ffs into out[192 + t].
__global__ void vote_kernel(int *out) {
  const int t = threadIdx.x, w = t / 32, lane = t % 32;
  if (w == 2 && lane == 31) return;
  const bool yes = w != 2 && lane == (w * 5) % 32;
  const bool all = !(w == 1 && lane == 7);
  out[t] = __any_sync(0xffffffffu, yes) | (__all_sync(0xffffffffu, all) << 1);
  const unsigned bits = __ballot_sync(0xffffffffu, lane % 3 == w);
  out[96 + t] = (int)bits;
  out[192 + t] = __ffs((int)bits);
}

// One m16n8k16 per warp on its own matrices: a [16][16], b [16][8] (B[k][n]), c and d [16][8],
// f32 values rounded to T when packed. The fragments are built with MmaFrag's layout (the
// kernels' helpers), the emulation reads them with the ISA's own formulas: a disagreement shows.
// `reps` accumulates in place (d = c, then d += A B reps times), as a kernel's loop does.
template <typename T>
__global__ void mma_kernel(const float *a, const float *b, const float *c, float *d, int reps) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  a += w * 256;
  b += w * 128;
  c += w * 128;
  d += w * 128;
  uint32_t ra[4], rb[2];
  float acc[4];
  for (int i = 0; i < 4; ++i)
    ra[i] = pkv::pack_f32x2<T>(a[pkv::MmaFrag::a_row(l, 2 * i) * 16 + pkv::MmaFrag::a_col(l, 2 * i)],
                               a[pkv::MmaFrag::a_row(l, 2 * i + 1) * 16 +
                                 pkv::MmaFrag::a_col(l, 2 * i + 1)]);
  for (int i = 0; i < 2; ++i)
    rb[i] = pkv::pack_f32x2<T>(b[pkv::MmaFrag::b_row(l, 2 * i) * 8 + pkv::MmaFrag::b_col(l, 2 * i)],
                               b[pkv::MmaFrag::b_row(l, 2 * i + 1) * 8 +
                                 pkv::MmaFrag::b_col(l, 2 * i + 1)]);
  for (int i = 0; i < 4; ++i) acc[i] = c[pkv::MmaFrag::c_row(l, i) * 8 + pkv::MmaFrag::c_col(l, i)];
  for (int r = 0; r < reps; ++r) pkv::mma_m16n8k16<T>(acc, ra, rb, acc);
  for (int i = 0; i < 4; ++i) d[pkv::MmaFrag::c_row(l, i) * 8 + pkv::MmaFrag::c_col(l, i)] = acc[i];
}

__global__ void mma_partial_warp_kernel(float *d) {
  if (threadIdx.x == 31) return;
  uint32_t a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  pkv::mma_m16n8k16<__half>(acc, a, b, acc);
  d[threadIdx.x] = acc[0];
}

// Four 8x8 matrices of 16-bit values in shared memory, rows `stride` elements apart and the
// matrices in the order 2, 0, 3, 1 (so row addresses are not one arithmetic sequence); lane l
// passes row l % 8 of matrix l / 8. out[l][0..N) = the registers of ldmatrix<N, TRANS>.
template <int N, bool TRANS> __global__ void ldmatrix_kernel(const uint16_t *m, uint32_t *out) {
  constexpr int stride = 24;  // elements: 48 bytes, 16-byte aligned rows with a gap
  extern __shared__ uint16_t sm[];
  for (int i = threadIdx.x; i < 4 * 8 * stride; i += blockDim.x) sm[i] = 0xdead;
  __syncthreads();
  const int place[4] = {1, 3, 0, 2};  // matrix j's rows start at row 8 * place[j]
  for (int i = threadIdx.x; i < 4 * 64; i += blockDim.x) {
    const int j = i / 64, r = i / 8 % 8, c = i % 8;
    sm[(8 * place[j] + r) * stride + c] = m[i];
  }
  __syncthreads();
  const int l = threadIdx.x;
  uint32_t r[N];
  pkv::ldmatrix<N, TRANS>(r, sm + (8 * place[(l / 8) % 4] + l % 8) * stride);
  for (int j = 0; j < N; ++j) out[l * N + j] = r[j];
}

// Two cp.async groups per thread, each copy observed before and after the waits that cover it.
__global__ void cp_async_kernel(const uint4 *src, int *out) {
  __shared__ uint4 first[128], second[128];
  const int t = threadIdx.x;
  first[t] = make_uint4(1, 1, 1, 1);
  second[t] = make_uint4(2, 2, 2, 2);
  pkv::pfmma::cp_async16(&first[t], &src[t]);
  pkv::pfmma::cp_async_commit();
  pkv::pfmma::cp_async16(&second[t], &src[128 + t]);
  pkv::pfmma::cp_async_commit();
  out[4 * t] = (int)first[t].x;
  pkv::pfmma::cp_async_wait<1>();
  out[4 * t + 1] = (int)first[t].x;
  out[4 * t + 2] = (int)second[t].x;
  pkv::pfmma::cp_async_wait<0>();
  out[4 * t + 3] = (int)second[t].x;
}

// ---- deliberately wrong kernels: each must be refused (tests/cuda_emu_selftest.rs) --------

// An 8-byte vector load at p (the caller passes a 4-byte aligned address).
__global__ void wrong_ld8_kernel(const void *p, int *out) {
  const uint2 v = __ldcs(reinterpret_cast<const uint2 *>(p));
  out[0] = (int)v.x;
  out[1] = (int)__ldg(reinterpret_cast<const unsigned int *>(static_cast<const char *>(p) + 2));
}

// n floats of dynamic shared memory; thread 0 reads and writes buf[n], one past the end.
__global__ void wrong_smem_past_end_kernel(float *out, int n) {
  extern __shared__ float buf[];
  if (threadIdx.x == 0) {
    out[0] = buf[n];
    buf[n] = 7.f;
    out[1] = buf[n];
  }
}

// Lanes 0..15 shuffle from lanes 16..31, which are at a __syncwarp instead (they never
// execute the shuffle the full mask names them in).
__global__ void wrong_shfl_vs_syncwarp_kernel(int *out) {
  const int lane = threadIdx.x;
  const int x = lane * 10;
  const int warm = __shfl_xor_sync(0xffffffffu, x, 0);  // every lane posts its x once
  int v = -1 + 0 * warm;
  if (lane < 16) v = __shfl_sync(0xffffffffu, x, lane + 16);
  __syncwarp();
  out[lane] = v;
}

// As above, but every lane then takes part in one more shuffle (no lane returns early).
__global__ void wrong_shfl_vs_syncwarp2_kernel(int *out) {
  const int lane = threadIdx.x;
  const int x = lane * 10;
  const int warm = __shfl_xor_sync(0xffffffffu, x, 0);
  int v = -1 + 0 * warm;
  if (lane < 16) v = __shfl_sync(0xffffffffu, x, lane + 16);
  __syncwarp();
  v += 0 * __shfl_xor_sync(0xffffffffu, v, 1);
  out[lane] = v;
}

// ldmatrix from global memory (ldmatrix reads the shared state space only).
__global__ void wrong_ldmatrix_global_kernel(const uint16_t *g, uint32_t *out) {
  uint32_t r[1];
  pkv::ldmatrix<1, false>(r, g + (threadIdx.x % 8) * 8);
  out[threadIdx.x] = r[0];
}

// m64n64k16 bf16 wgmma, B (16 x 64, K-major, no swizzle, all ones; a second copy of twos 2048
// bytes on) in shared memory, A all ones. per_warp_desc: warp w points its descriptor at copy
// w % 2 (the descriptor must be the same across the warpgroup). out[t] = d[0] of thread t.
__global__ void wrong_wgmma_kernel(float *out, int per_warp_desc) {
  extern __shared__ uint4 rw_smem[];
  uint16_t *sb = reinterpret_cast<uint16_t *>(rw_smem);
  for (int i = threadIdx.x; i < 2048; i += blockDim.x) sb[i] = i < 1024 ? 0x3F80 : 0x4000;
  __syncthreads();
  const int warp = threadIdx.x / 32;
  const char *b = reinterpret_cast<const char *>(sb) + (per_warp_desc ? (warp % 2) * 2048 : 0);
  const uint64_t desc = pkv::smem_desc(b, sb, 128, 256, 0);
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  const uint32_t a[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
  pkv::wgmma_fence();
  pkv::wgmma_rs<__nv_bfloat16, 64, 0>(d, a, desc, sb);
  pkv::wgmma_commit();
  pkv::wgmma_wait<0>();
  out[threadIdx.x] = d[0];
}

}  // namespace

extern "C" int pkv_emu_selftest_cp_async(const void *src, int *out) {
  cp_async_kernel<<<1, 128>>>(static_cast<const uint4 *>(src), out);
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_selftest_warp_ahead(int *out) {
  warp_ahead_kernel<<<1, 64>>>(out);
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_selftest_vote(int *out) {
  vote_kernel<<<1, 96>>>(out);
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_selftest_shuffle_idx(int *out, int width) {
  shuffle_idx_kernel<<<1, 64>>>(out, width);
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_selftest_mma(int dtype, const float *a, const float *b, const float *c,
                                    float *d, int warps, int reps) {
  if (dtype == PKV_DTYPE_F16)
    mma_kernel<__half><<<1, 32 * warps>>>(a, b, c, d, reps);
  else if (dtype == PKV_DTYPE_BF16)
    mma_kernel<__nv_bfloat16><<<1, 32 * warps>>>(a, b, c, d, reps);
  else
    return PKV_ERR_DTYPE;
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_selftest_mma_partial_warp(float *d) {
  mma_partial_warp_kernel<<<1, 32>>>(d);
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_selftest_ldmatrix(const uint16_t *m, uint32_t *out, int n, int trans) {
  const size_t smem = 4 * 8 * 24 * sizeof(uint16_t);
  if (n == 1 && !trans) ldmatrix_kernel<1, false><<<1, 32, smem>>>(m, out);
  else if (n == 1) ldmatrix_kernel<1, true><<<1, 32, smem>>>(m, out);
  else if (n == 2 && !trans) ldmatrix_kernel<2, false><<<1, 32, smem>>>(m, out);
  else if (n == 2) ldmatrix_kernel<2, true><<<1, 32, smem>>>(m, out);
  else if (n == 4 && !trans) ldmatrix_kernel<4, false><<<1, 32, smem>>>(m, out);
  else if (n == 4) ldmatrix_kernel<4, true><<<1, 32, smem>>>(m, out);
  else return PKV_ERR_INVALID_ARG;
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_selftest_block_sum(const int *in, int *out, int grid_x, int grid_y,
                                          int block_x, int block_y) {
  const size_t smem = (size_t)block_x * block_y * sizeof(int);
  block_sum_kernel<<<dim3(grid_x, grid_y), dim3(block_x, block_y), smem>>>(in, out);
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_selftest_shuffle(int *out, int threads) {
  shuffle_kernel<<<1, threads>>>(out);
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_selftest_divergent_barrier(void) {
  divergent_barrier_kernel<<<1, 64>>>();
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_selftest_shuffle_from_returned_lane(int *out) {
  shuffle_from_returned_lane_kernel<<<1, 32>>>(out);
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_selftest_vector_load(const void *p, int *out) {
  vector_load_kernel<<<1, 1>>>(p, out);
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_selftest_smem(float *out, int n, int opt_in_bytes) {
  if (opt_in_bytes > 0) {
    const cudaError_t e =
        cudaFuncSetAttribute(smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, opt_in_bytes);
    if (e != cudaSuccess) return (int)e;
  }
  smem_kernel<<<1, 96, (size_t)n * sizeof(float)>>>(out, n);
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_selftest_static_shared(float *out, int blocks) {
  static_shared_kernel<<<blocks, 64>>>(out);
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_selftest_static_plus_dynamic(float *out, int dynamic_bytes) {
  static_plus_dynamic_kernel<<<1, 32, (size_t)dynamic_bytes>>>(out);
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_selftest_config(unsigned grid_x, unsigned grid_y, unsigned block_x) {
  empty_kernel<<<dim3(grid_x, grid_y), block_x>>>();
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_selftest_write(int *p, int n) {
  write_kernel<<<1, 64>>>(p, n);
  return (int)cudaGetLastError();
}

extern "C" int pkv_emu_wrong_ld8(const void *p, int *out) {
  wrong_ld8_kernel<<<1, 32>>>(p, out);
  return (int)cudaGetLastError();
}
extern "C" int pkv_emu_wrong_smem_past_end(float *out, int n) {
  wrong_smem_past_end_kernel<<<1, 32, n * sizeof(float)>>>(out, n);
  return (int)cudaGetLastError();
}
extern "C" int pkv_emu_wrong_shfl_vs_syncwarp(int *out) {
  wrong_shfl_vs_syncwarp_kernel<<<1, 32>>>(out);
  return (int)cudaGetLastError();
}
extern "C" int pkv_emu_wrong_ldmatrix_global(const uint16_t *g, uint32_t *out) {
  wrong_ldmatrix_global_kernel<<<1, 32>>>(g, out);
  return (int)cudaGetLastError();
}
extern "C" int pkv_emu_wrong_wgmma(float *out, int threads, int per_warp_desc) {
  wrong_wgmma_kernel<<<1, threads, 4096>>>(out, per_warp_desc);
  return (int)cudaGetLastError();
}
extern "C" int pkv_emu_wrong_shfl_vs_syncwarp2(int *out) {
  wrong_shfl_vs_syncwarp2_kernel<<<1, 32>>>(out);
  return (int)cudaGetLastError();
}
