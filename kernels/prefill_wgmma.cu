// prefill_wgmma.cu: the sm_90a unit: the wgmma prefill kernels (prefill_wgmma.cuh, its
// persistent grid prefill_wgmma_persist.cuh) and their launcher, which paged_attention.cu
// calls for the PKV_PREFILL_TILING_WGMMA* tilings on a device of compute capability 9.0. Built
// only for sm_90a (arch-specific instructions: no PTX for later GPUs), in its own library
// (build/cuda.rs), and always under cuda-emu.
#include "prefill_wgmma_persist.cuh"

namespace pkv {
namespace {
template <typename T, int D, int WG, bool OVL>
int launch(const PrefillArgs &a, int hkv, int row_tiles, int num_seqs, cudaStream_t s) {
  using C = pfwg::Cfg<D, WG, OVL>;
  constexpr size_t smem = C::smem_bytes;
  cudaError_t e = cudaFuncSetAttribute(pfwg::prefill_wgmma_kernel<T, D, WG, OVL>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e != cudaSuccess) return status_of(e);
  const dim3 grid(hkv, row_tiles, num_seqs);
  return launch_kernel(pfwg::prefill_wgmma_kernel<T, D, WG, OVL>, grid, dim3(C::NT), smem, s,
                       a.launch_flags, a);
}

// The persistent grid (two warpgroups, in order): one block per resident slot, fewer where
// there are fewer work items. A launch of 2^31 items or more (32-bit item arithmetic in the
// kernel) runs the plain grid: the same results. Head dims above 64 only (the caller's
// choice, prefill_tiling_run): at d64 the loop would spill at the 128 registers of two blocks
// per SM.
template <typename T, int D>
int launch_persistent(const PrefillArgs &a, int hkv, int row_tiles, int num_seqs,
                      cudaStream_t s) {
  static_assert(D > 64, "d64 runs the plain grid");
  using C = pfwg::Cfg<D, 2, false>;
  constexpr size_t smem = pfwg::PersistCfg<D, 2>::smem_bytes;
  const int64_t items = (int64_t)hkv * row_tiles * num_seqs;
  if (items > INT32_MAX) return launch<T, D, 2, false>(a, hkv, row_tiles, num_seqs, s);
  int sms = 0;
  const int st = current_sm_count(&sms);
  if (st != PKV_OK) return st;
  const pfwg::PersistGrid w{(int32_t)items, hkv, num_seqs, row_tiles};
  const int64_t slots = (int64_t)sms * C::MIN_BLOCKS;
  const int64_t blocks = items < slots ? items : slots;
  cudaError_t e = cudaFuncSetAttribute(pfwg::prefill_wgmma_persistent_kernel<T, D, 2>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e != cudaSuccess) return status_of(e);
  return launch_kernel(pfwg::prefill_wgmma_persistent_kernel<T, D, 2>, dim3((unsigned)blocks),
                       dim3(C::NT), smem, s, a.launch_flags, a, w);
}

template <typename T, int D>
int launch_wg(const PrefillArgs &a, int wg, bool ovl, bool persist, int hkv, int row_tiles,
              int num_seqs, cudaStream_t s) {
  if constexpr (D > 64) {
    if (persist) return launch_persistent<T, D>(a, hkv, row_tiles, num_seqs, s);
  }
  if (ovl)
    return wg == 2 ? launch<T, D, 2, true>(a, hkv, row_tiles, num_seqs, s)
                   : launch<T, D, 1, true>(a, hkv, row_tiles, num_seqs, s);
  return wg == 2 ? launch<T, D, 2, false>(a, hkv, row_tiles, num_seqs, s)
                 : launch<T, D, 1, false>(a, hkv, row_tiles, num_seqs, s);
}
}  // namespace

// dtype f16 / bf16, head_dim up to 128 (the caller's checks); wg warpgroups per block (1 or
// 2), row_tiles of 64 wg rows; ovl: the overlapped schedule; persist: the persistent grid
// (wg 2).
int launch_prefill_wgmma(const PrefillArgs &a, int dtype, int head_dim, int wg, bool ovl,
                         bool persist, int hkv, int row_tiles, int num_seqs, cudaStream_t s) {
  if (head_dim > 128) return PKV_ERR_HEAD_DIM;
  if (dtype == PKV_DTYPE_BF16) {
    PKV_DISPATCH_HEAD_DIM(head_dim, {
      if constexpr (D <= 128)
        return launch_wg<__nv_bfloat16, D>(a, wg, ovl, persist, hkv, row_tiles, num_seqs,
                                                s);
    });
  } else {
    PKV_DISPATCH_HEAD_DIM(head_dim, {
      if constexpr (D <= 128)
        return launch_wg<__half, D>(a, wg, ovl, persist, hkv, row_tiles, num_seqs, s);
    });
  }
  return PKV_ERR_HEAD_DIM;
}
// ---- the layout probe (pkv_wgmma_layout_probe) ----
namespace {
__device__ __forceinline__ float probe_a(int r, int k) { return (float)((r * 5 + k) % 7 - 3); }
__device__ __forceinline__ float probe_b(int k, int n) { return (float)((k * 7 + n * 3) % 9 - 4); }

// One m64n64k16 of this warpgroup's A (the m16n8k16 fragments a) and B through `desc`; adds the
// accumulator elements that differ from the exact product (small integers: exact in bf16 and
// in f32 sums) to *count.
template <int TRANS_B>
__device__ void probe_product(const uint32_t (&a)[4], uint64_t desc, const void *base,
                              unsigned *count) {
  float d[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    d[i] = 0.f;
    wgmma_pin(d[i]);
  }
  wgmma_fence();
  wgmma_rs<__nv_bfloat16, 64, TRANS_B>(d, a, desc, base);
  wgmma_commit();
  wgmma_wait<0>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  unsigned bad = 0;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    wgmma_pin(d[i]);
    const int row = 16 * warp + g + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * q + i % 2;
    float want = 0.f;
    for (int k = 0; k < 16; ++k) want += probe_a(row, k) * probe_b(k, col);
    bad += d[i] != want ? 1u : 0u;
  }
  atomicAdd(count, bad);
}

// No swizzle: B stored K-major (core matrices 128 bytes apart along k, 256 along n) or
// MN-major (128 along n, 1024 along k), read with the descriptor's two offsets as wgmma.cuh
// reads them (SWAP = 0) or exchanged (1): counts[2 TRANS_B + SWAP].
template <int TRANS_B, int SWAP>
__device__ void probe_plain(const uint32_t (&a)[4], const void *b, const void *base,
                            unsigned *counts) {
  const uint32_t along_k = TRANS_B ? 1024 : 128, along_n = TRANS_B ? 128 : 256;
  const uint32_t lbo = along_k, sbo = along_n;  // wgmma.cuh: lbo along k, sbo along n
  probe_product<TRANS_B>(a, smem_desc(b, base, SWAP ? sbo : lbo, SWAP ? lbo : sbo), base,
                         &counts[2 * TRANS_B + SWAP]);
}

// The SW-byte swizzle as the kernel stores and reads it (wgmma.cuh): K-major, key n's row of
// SW bytes at n SW; MN-major, an SW-byte row of n per k, atoms of SW / 2 n 16 SW bytes apart.
// The canonical offset of (k, n) before the swizzle:
template <int SW, int TRANS_B> __device__ __forceinline__ uint32_t probe_swizzle_at(int k, int n) {
  return TRANS_B ? (uint32_t)(n / (SW / 2)) * 16 * SW + (uint32_t)(n % (SW / 2)) * 2 +
                       (uint32_t)k * SW
                 : (uint32_t)n * SW + (uint32_t)k * 2;
}
template <int SW, int TRANS_B>
__device__ void probe_swizzle(const uint32_t (&a)[4], __nv_bfloat16 *b, const void *base,
                              unsigned *count) {
  for (int e = threadIdx.x; e < 16 * 64; e += 128) {
    const int k = e / 64, n = e % 64;
    const uint32_t at = probe_swizzle_at<SW, TRANS_B>(k, n);
    b[swizzled<SW>(at) / 2] = __float2bfloat16_rn(probe_b(k, n));
  }
  fence_proxy_async_shared();
  __syncthreads();
  probe_product<TRANS_B>(a, smem_desc(b, base, TRANS_B ? 16 * SW : 16, 8 * SW, SW), base, count);
}

// Shared memory: the no-swizzle B twice (K-major at 0, MN-major at 2 KB; every variant's reads
// stay inside 16 KB, MN-major exchanged reaching 2 KB + 7.3 KB), then one 8 KB region for the
// swizzled ones in turn, all from a 1024-byte boundary (shared_align1024).
constexpr int PROBE_SMEM = 16384 + 8192 + 1024;

__global__ void __launch_bounds__(128) wgmma_probe_kernel(int32_t *mismatches) {
  __shared__ uint4 probe_raw[PROBE_SMEM / 16];
  __shared__ unsigned counts[PKV_WGMMA_PROBE_COUNTS];
  uint4 *probe_smem = shared_align1024<uint4>(probe_raw);
  if (threadIdx.x < PKV_WGMMA_PROBE_COUNTS) counts[threadIdx.x] = 0;
  __nv_bfloat16 *kmaj = reinterpret_cast<__nv_bfloat16 *>(probe_smem);
  __nv_bfloat16 *mnmaj = kmaj + 16 * 64;
  __nv_bfloat16 *swz = kmaj + 16384 / 2;
  for (int e = threadIdx.x; e < 16 * 64; e += 128) {
    const int k = e / 64, n = e % 64;
    const __nv_bfloat16 v = __float2bfloat16_rn(probe_b(k, n));
    kmaj[((k / 8) * 128 + (n / 8) * 256 + (n % 8) * 16 + (k % 8) * 2) / 2] = v;
    mnmaj[((k / 8) * 1024 + (n / 8) * 128 + (k % 8) * 16 + (n % 8) * 2) / 2] = v;
  }
  fence_proxy_async_shared();
  __syncthreads();
  // This warp's rows of A in the m16n8k16 A fragment layout (mma.cuh).
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  uint32_t a[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int row = 16 * warp + g + 8 * (r % 2), col = 2 * q + 8 * (r / 2);
    a[r] = pack_f32x2<__nv_bfloat16>(probe_a(row, col), probe_a(row, col + 1));
  }
  probe_plain<0, 0>(a, kmaj, probe_smem, counts);
  probe_plain<0, 1>(a, kmaj, probe_smem, counts);
  probe_plain<1, 0>(a, mnmaj, probe_smem, counts);
  probe_plain<1, 1>(a, mnmaj, probe_smem, counts);
  // Each swizzled layout rewrites the region after every warp's previous product is done (its
  // wait, then the barrier inside probe_swizzle before the next product reads).
  __syncthreads();
  probe_swizzle<128, 0>(a, swz, probe_smem, &counts[4]);
  __syncthreads();
  probe_swizzle<128, 1>(a, swz, probe_smem, &counts[5]);
  __syncthreads();
  probe_swizzle<64, 0>(a, swz, probe_smem, &counts[6]);
  __syncthreads();
  probe_swizzle<64, 1>(a, swz, probe_smem, &counts[7]);
  __syncthreads();
  probe_swizzle<32, 0>(a, swz, probe_smem, &counts[8]);
  __syncthreads();
  probe_swizzle<32, 1>(a, swz, probe_smem, &counts[9]);
  __syncthreads();
  if (threadIdx.x < PKV_WGMMA_PROBE_COUNTS)
    mismatches[threadIdx.x] = (int32_t)counts[threadIdx.x];
}
}  // namespace
}  // namespace pkv

extern "C" int pkv_wgmma_layout_probe(int32_t *mismatches, void *stream) {
  if (mismatches == nullptr) return PKV_ERR_NULL_POINTER;
  // The launch's own status (see pkv_reshape_and_cache).
  return pkv::launch_kernel(pkv::wgmma_probe_kernel, dim3(1), dim3(128), 0,
                            static_cast<cudaStream_t>(stream), 0, mismatches);
}
