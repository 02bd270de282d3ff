// cache_ops.cu: kernels and launchers that write or move KV cache bytes: reshape_and_cache
// (new tokens into their slots), copy_blocks (copy-on-write, every layer, one launch) and
// swap_blocks (device <-> pinned host, coalesced runs).
#include "common.cuh"

namespace pkv {
namespace {

constexpr int RC_THREADS = 128;

// One thread block per token; threads stride over the token's num_kv_heads * head_dim elements
// in 16-byte vectors (VECTOR) or one element at a time (a key/value row not 16-byte aligned).
// The cache row of a token holds its heads contiguously ([H][D]), as do the inputs, so both
// reads and writes are dense.
template <typename T, bool VECTOR>
__global__ void __launch_bounds__(RC_THREADS) reshape_and_cache_kernel(
    T *cache,                    // device, the arena's base (page stride st.block)
    const T *key,                // device, row t at key + t * key_stride
    const T *value,              // device, row t at value + t * value_stride
    const int64_t *slot_mapping, // device [num_tokens]
    int64_t key_stride, int64_t value_stride, Strides st, int64_t layer_offset,
    int64_t num_slots, int block_size) {
  grid_dependency_entry();  // lets a programmatic attention launch start early
  const int t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0 || slot >= num_slots) return;  // -1: padding
  const int64_t block = slot / block_size, row = slot % block_size;
  T *kdst = cache + block * st.block + layer_offset + row * st.token;
  T *vdst = kdst + st.kv;
  const T *ksrc = key + (int64_t)t * key_stride;
  const T *vsrc = value + (int64_t)t * value_stride;
  const int n = (int)st.token;  // H*D elements
  if (VECTOR) {
    constexpr int V = Elem<T>::VEC;
    for (int i = threadIdx.x; i < n / V; i += RC_THREADS) {
      reinterpret_cast<uint4 *>(kdst)[i] = ld_vec(ksrc + i * V);
      reinterpret_cast<uint4 *>(vdst)[i] = ld_vec(vsrc + i * V);
    }
  } else {
    for (int i = threadIdx.x; i < n; i += RC_THREADS) {
      kdst[i] = ksrc[i];
      vdst[i] = vsrc[i];
    }
  }
}

constexpr int CB_THREADS = 256;
constexpr int CB_UNROLL = 4;

// grid (num_pairs, y): block y of pair p copies vectors y*CB_THREADS*CB_UNROLL + ... of the
// pair's block, striding by gridDim.y * CB_THREADS * CB_UNROLL. A block (all layers, K and V) is
// one contiguous run of `vecs` 16-byte vectors at the start of its page, pages `page_vecs`
// vectors apart; the rest of each page is not touched.
__global__ void __launch_bounds__(CB_THREADS) copy_blocks_kernel(
    uint4 *cache,            // device, the arena's base as 16-byte vectors
    const int32_t *pairs,    // device [num_pairs][2] (src, dst)
    int64_t vecs,            // 16-byte vectors per block (<= page_vecs)
    int64_t page_vecs,       // 16-byte vectors per page (the page stride)
    int32_t num_blocks) {
  grid_dependency_entry();  // lets a programmatic attention launch start early
  const int32_t src = pairs[2 * blockIdx.x], dst = pairs[2 * blockIdx.x + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks || src == dst) return;
  const uint4 *s = cache + (int64_t)src * page_vecs;
  uint4 *d = cache + (int64_t)dst * page_vecs;
  const int64_t step = (int64_t)gridDim.y * CB_THREADS * CB_UNROLL;
  for (int64_t base = (int64_t)blockIdx.y * CB_THREADS * CB_UNROLL + threadIdx.x; base < vecs;
       base += step) {
    uint4 v[CB_UNROLL];
#pragma unroll
    for (int u = 0; u < CB_UNROLL; ++u) {
      const int64_t i = base + u * CB_THREADS;
      if (i < vecs) v[u] = __ldcs(s + i);
    }
#pragma unroll
    for (int u = 0; u < CB_UNROLL; ++u) {
      const int64_t i = base + u * CB_THREADS;
      if (i < vecs) __stcs(d + i, v[u]);
    }
  }
}

}  // namespace
}  // namespace pkv

using namespace pkv;

extern "C" int pkv_reshape_and_cache(void *cache, const pkv_cache_geometry *geom, int32_t layer,
                                     const void *key, const void *value,
                                     int64_t key_token_stride, int64_t value_token_stride,
                                     const int64_t *slot_mapping, int32_t num_tokens,
                                     void *stream) {
  const int g = check_geometry(geom, layer);
  if (g != PKV_OK) return g;
  if (num_tokens < 0) return PKV_ERR_INVALID_ARG;
  if (num_tokens == 0) return PKV_OK;
  if (cache == nullptr || key == nullptr || value == nullptr || slot_mapping == nullptr)
    return PKV_ERR_NULL_POINTER;
  const Strides st = Strides::of(*geom);
  if (key_token_stride < st.token || value_token_stride < st.token) return PKV_ERR_INVALID_ARG;
  if ((reinterpret_cast<uintptr_t>(cache) & 15u) != 0) return PKV_ERR_INVALID_ARG;
  const int es = dtype_size(geom->dtype);
  const bool vec = ((reinterpret_cast<uintptr_t>(key) | reinterpret_cast<uintptr_t>(value)) & 15u) == 0 &&
                   ((uint64_t)key_token_stride * es) % 16 == 0 &&
                   ((uint64_t)value_token_stride * es) % 16 == 0;  // unsigned: no overflow
  const int64_t slots = (int64_t)geom->num_blocks * geom->block_size;
  const int64_t lo = (int64_t)layer * st.layer;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // Through launch_kernel, whose status is the launch's own: cudaGetLastError after a
  // triple-chevron launch also returns an earlier runtime call's unread error (a refused
  // prefill's shared-memory opt-in, a failed swap copy), reporting this write as failed after
  // it ran.
  PKV_DISPATCH_DTYPE(geom->dtype, {
    T *c = static_cast<T *>(cache);
    const T *k = static_cast<const T *>(key);
    const T *v = static_cast<const T *>(value);
    if (vec)
      return launch_kernel(reshape_and_cache_kernel<T, true>, dim3(num_tokens), dim3(RC_THREADS),
                           0, s, 0, c, k, v, slot_mapping, key_token_stride,
                           value_token_stride, st, lo, slots, (int)geom->block_size);
    return launch_kernel(reshape_and_cache_kernel<T, false>, dim3(num_tokens), dim3(RC_THREADS),
                         0, s, 0, c, k, v, slot_mapping, key_token_stride, value_token_stride,
                         st, lo, slots, (int)geom->block_size);
  });
  return PKV_ERR_DTYPE;
}

extern "C" int pkv_copy_blocks(void *cache, const pkv_cache_geometry *geom, const int32_t *pairs,
                               int32_t num_pairs, void *stream) {
  const int g = check_geometry(geom, 0);
  if (g != PKV_OK) return g;
  if (num_pairs < 0) return PKV_ERR_INVALID_ARG;
  if (num_pairs == 0) return PKV_OK;
  if (cache == nullptr || pairs == nullptr) return PKV_ERR_NULL_POINTER;
  if ((reinterpret_cast<uintptr_t>(cache) & 15u) != 0) return PKV_ERR_INVALID_ARG;
  const Strides st = Strides::of(*geom);
  const int es = dtype_size(geom->dtype);
  // head_dim is a multiple of 8 and page strides of 16 bytes (check_geometry): blocks and
  // pages are whole vectors.
  const int64_t vecs = st.block_elems(geom->num_layers) * es / 16;
  const int64_t page_vecs = st.block * es / 16;
  // Enough thread blocks per pair to fill the GPU even for a single pair (a block of a large
  // model is megabytes), but not more than its vectors need.
  const int64_t per_cta = (int64_t)CB_THREADS * CB_UNROLL;
  int64_t y = (vecs + per_cta - 1) / per_cta;
  const int64_t want = (1024 + (int64_t)num_pairs - 1) / num_pairs;
  if (y > want) y = want < 1 ? 1 : want;
  if (y > 65535) y = 65535;
  const dim3 grid(num_pairs, (unsigned)y);
  // The launch's own status (see pkv_reshape_and_cache).
  return launch_kernel(copy_blocks_kernel, grid, dim3(CB_THREADS), 0,
                       static_cast<cudaStream_t>(stream), 0, static_cast<uint4 *>(cache), pairs,
                       vecs, page_vecs, (int32_t)geom->num_blocks);
}

extern "C" int pkv_swap_blocks(void *dst, size_t dst_page_bytes, const void *src,
                               size_t src_page_bytes, size_t block_bytes, const int64_t *pairs,
                               int32_t num_pairs, int32_t to_host, void *stream) {
  if (num_pairs < 0 || block_bytes == 0) return PKV_ERR_INVALID_ARG;
  if (dst_page_bytes < block_bytes || src_page_bytes < block_bytes) return PKV_ERR_PAGE_STRIDE;
  if (dst_page_bytes % PKV_PAGE_ALIGN != 0 || src_page_bytes % PKV_PAGE_ALIGN != 0)
    return PKV_ERR_PAGE_ALIGN;
  if (num_pairs == 0) return PKV_OK;
  if (dst == nullptr || src == nullptr || pairs == nullptr) return PKV_ERR_NULL_POINTER;
  // Every pair checked before the first copy is queued: an argument error queues nothing.
  for (int32_t i = 0; i < 2 * num_pairs; ++i)
    if (pairs[i] < 0) return PKV_ERR_INVALID_ARG;
  const cudaMemcpyKind kind = to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // Runs of pairs that continue consecutively on both sides are one copy when both sides step
  // by the same page size: the copy then spans the run's pages whole but the last one's
  // padding. With different page sizes the blocks of a run are not equally spaced on the two
  // sides, so each is copied on its own.
  const bool merge = dst_page_bytes == src_page_bytes;
  int32_t i = 0;
  while (i < num_pairs) {
    const int64_t s0 = pairs[2 * i], d0 = pairs[2 * i + 1];
    int32_t n = 1;
    while (merge && i + n < num_pairs && pairs[2 * (i + n)] == s0 + n &&
           pairs[2 * (i + n) + 1] == d0 + n)
      ++n;
    const size_t bytes = (size_t)(n - 1) * src_page_bytes + block_bytes;
    cudaError_t e = cudaMemcpyAsync(static_cast<char *>(dst) + (size_t)d0 * dst_page_bytes,
                                    static_cast<const char *>(src) + (size_t)s0 * src_page_bytes,
                                    bytes, kind, s);
    if (e != cudaSuccess) return status_of(e);
    i += n;
  }
  return PKV_OK;
}

extern "C" int pkv_host_register(void *ptr, size_t bytes) {
  if (ptr == nullptr) return PKV_ERR_NULL_POINTER;
  if (bytes == 0) return PKV_ERR_INVALID_ARG;
  const cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
  // The caller goes on with pageable memory: the failure must not read as the next launch's.
  if (e != cudaSuccess) (void)cudaGetLastError();
  return status_of(e);
}

extern "C" int pkv_host_unregister(void *ptr) {
  if (ptr == nullptr) return PKV_ERR_NULL_POINTER;
  const cudaError_t e = cudaHostUnregister(ptr);
  if (e != cudaSuccess) (void)cudaGetLastError();
  return status_of(e);
}
