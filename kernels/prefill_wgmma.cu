// prefill_wgmma.cu: the sm_90a unit: the wgmma prefill kernel (prefill_wgmma.cuh) and its
// launcher, which paged_attention.cu calls for PKV_PREFILL_TILING_WGMMA on a device of compute
// capability 9.0. Built only for sm_90a (arch-specific instructions: no PTX for later GPUs), in
// its own library (build/cuda.rs), and always under cuda-emu.
#include "prefill_wgmma.cuh"

namespace pkv {
namespace {
template <typename T, int D>
int launch(const PrefillArgs &a, int hkv, int row_tiles, int num_seqs, cudaStream_t s) {
  constexpr size_t smem = pfwg::Cfg<D>::smem_bytes;
  cudaError_t e = cudaFuncSetAttribute(pfwg::prefill_wgmma_kernel<T, D>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e != cudaSuccess) return status_of(e);
  const dim3 grid(hkv, row_tiles, num_seqs);
  pfwg::prefill_wgmma_kernel<T, D><<<grid, pfwg::THREADS, smem, s>>>(a);
  return status_of(cudaGetLastError());
}
}  // namespace

// dtype f16 / bf16, head_dim up to 128 (the caller's checks); row_tiles of 64 rows.
int launch_prefill_wgmma(const PrefillArgs &a, int dtype, int head_dim, int hkv, int row_tiles,
                         int num_seqs, cudaStream_t s) {
  if (head_dim > 128) return PKV_ERR_HEAD_DIM;
  if (dtype == PKV_DTYPE_BF16) {
    PKV_DISPATCH_HEAD_DIM(head_dim, {
      if constexpr (D <= 128) return launch<__nv_bfloat16, D>(a, hkv, row_tiles, num_seqs, s);
    });
  } else {
    PKV_DISPATCH_HEAD_DIM(head_dim, {
      if constexpr (D <= 128) return launch<__half, D>(a, hkv, row_tiles, num_seqs, s);
    });
  }
  return PKV_ERR_HEAD_DIM;
}
}  // namespace pkv
