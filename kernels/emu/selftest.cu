// selftest.cu: small kernels that check the CPU emulation itself (feature `cuda-emu` only):
// that barriers, shuffles and thread coordinates behave as on a GPU, and that every fault the
// emulation promises to report (emu.h) is reported. Written in CUDA syntax and translated by
// build/emu.rs like the real kernels; driven by tests/cuda_emu_selftest.rs.
#include <cuda_runtime.h>

#include "pagedkv_emu.h"

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

}  // namespace

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
