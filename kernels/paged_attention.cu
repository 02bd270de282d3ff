// paged_attention.cu: the extern "C" launchers of the decode and prefill attention kernels
// (templates in attention.cuh). Each launcher validates its arguments, picks the template
// instance for (dtype, head_dim, group size), launches on the caller's stream and returns the
// launch status; none synchronizes.
#include <type_traits>

#include "attention.cuh"
#include "decode_mma.cuh"

namespace pkv {
namespace {

// Query heads one decode thread block serves: 1 (MHA), 4 (GQA ratio 2..4) or 8 (5..8, and
// groups of 8 for larger ratios, read once per 8 query heads).
inline int decode_gt(int group) { return group == 1 ? 1 : (group <= 4 ? 4 : 8); }

// Shared memory every GPU gives a kernel without opt-in (the reduce kernel's weights, and the
// documented PKV_DECODE_SINGLE limit below).
constexpr size_t SINGLE_PASS_SMEM = 48 * 1024;

inline bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

struct WorkspaceLayout {
  size_t out_off, max_off, sum_off, total;
};
inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
inline WorkspaceLayout workspace_layout(int64_t rows, int head_dim, int splits) {
  WorkspaceLayout w;
  const size_t n = (size_t)rows * (size_t)splits;
  w.out_off = 0;
  w.max_off = align_up(n * (size_t)head_dim * sizeof(float), 256);
  w.sum_off = w.max_off + align_up(n * sizeof(float), 256);
  w.total = w.sum_off + align_up(n * sizeof(float), 256);
  return w;
}

// Groups of at least this many query heads per KV head run the tensor-core body when the cache
// is f16 / bf16: its cost per token does not grow with the heads served, while the CUDA-core
// body pays one FMA per head per K/V element in each pass (a group of 2 or 3 already costs it
// what 4 heads do, since it serves 4). MHA (one head) stays on CUDA cores: an mma would waste 15
// of its 16 rows.
constexpr int DECODE_MMA_MIN_GROUP = 2;
inline bool decode_uses_mma(int dtype, int group) {
  return dtype != PKV_DTYPE_F32 && group >= DECODE_MMA_MIN_GROUP;
}

// The reduce kernel after a split launch (nothing to do unsplit).
template <typename T>
int launch_decode_reduce(const DecodeArgs &a, int num_seqs, int head_dim, cudaStream_t stream) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || a.num_splits == 1) return status_of(e);
  const dim3 rgrid(a.num_heads, num_seqs);
  decode_reduce_kernel<T><<<rgrid, 128, a.num_splits * sizeof(float), stream>>>(
      a.out, a.tmp_out, a.tmp_max, a.tmp_sum, a.context_lens, a.table_tokens, a.num_heads,
      head_dim, a.num_splits, a.part_tokens);
  return status_of(cudaGetLastError());
}

template <typename T, int D, int GT>
int launch_decode(DecodeArgs a, int num_kv_heads, int num_seqs, cudaStream_t stream) {
  constexpr size_t smem = SimtDecode<T, D, GT>::smem_bytes();
  static_assert(smem <= 48 * 1024, "the merge buffer fits without the opt-in");
  const dim3 grid(num_kv_heads * a.head_chunks, num_seqs, a.num_splits);
  decode_simt_kernel<T, D, GT><<<grid, DEC_THREADS, smem, stream>>>(a);
  return launch_decode_reduce<T>(a, num_seqs, D, stream);
}

template <typename T, int D>
int launch_decode_mma(DecodeArgs a, int num_kv_heads, int num_seqs, cudaStream_t stream) {
  constexpr size_t smem = MmaDecode<T, D>::smem_bytes();
  static_assert(smem <= 48 * 1024, "queries and merge buffer fit without the opt-in");
  const dim3 grid(num_kv_heads * a.head_chunks, num_seqs, a.num_splits);
  decode_mma_kernel<T, D><<<grid, DEC_THREADS, smem, stream>>>(a);
  return launch_decode_reduce<T>(a, num_seqs, D, stream);
}

template <typename T, int D>
int dispatch_decode_gt(int gt, DecodeArgs a, int hkv, int ns, cudaStream_t s) {
  if constexpr (!std::is_same<T, float>::value) {
    // f16 / bf16: tensor cores for GQA, the one-head CUDA-core body for MHA (no other
    // instance is built).
    if (a.group >= DECODE_MMA_MIN_GROUP) return launch_decode_mma<T, D>(a, hkv, ns, s);
    return launch_decode<T, D, 1>(a, hkv, ns, s);
  } else {
    switch (gt) {
      case 1: return launch_decode<T, D, 1>(a, hkv, ns, s);
      case 4: return launch_decode<T, D, 4>(a, hkv, ns, s);
      default: return launch_decode<T, D, 8>(a, hkv, ns, s);
    }
  }
}

int common_attn_checks(const void *out, const void *query, const void *cache,
                       const pkv_cache_geometry *geom, int32_t layer, const int32_t *block_tables,
                       int32_t max_blocks_per_seq, const int32_t *context_lens,
                       const pkv_attn_params *params) {
  const int g = check_geometry(geom, layer);
  if (g != PKV_OK) return g;
  if (params == nullptr || out == nullptr || query == nullptr || cache == nullptr ||
      block_tables == nullptr || context_lens == nullptr)
    return PKV_ERR_NULL_POINTER;
  // Every page starts on the 16-byte grid (check_geometry) only if the base does.
  if (!aligned16(query) || !aligned16(cache)) return PKV_ERR_INVALID_ARG;
  if (params->num_heads <= 0 || params->num_heads % geom->num_kv_heads != 0)
    return PKV_ERR_INVALID_ARG;
  if (max_blocks_per_seq <= 0) return PKV_ERR_INVALID_ARG;
  if (!(params->scale == params->scale) || !(params->softcap == params->softcap))
    return PKV_ERR_INVALID_ARG;  // NaN
  return PKV_OK;
}

}  // namespace
}  // namespace pkv

using namespace pkv;

extern "C" size_t pkv_decode_workspace_bytes(int32_t num_seqs, int32_t num_heads,
                                             int32_t head_dim, int32_t max_context_len) {
  if (num_seqs <= 0 || num_heads <= 0 || head_dim <= 0 || max_context_len <= PKV_DECODE_PARTITION)
    return 0;
  const int splits = ceil_div(max_context_len, PKV_DECODE_PARTITION);
  return workspace_layout((int64_t)num_seqs * num_heads, head_dim, splits).total;
}

extern "C" int pkv_paged_attention_decode(void *out, const void *query, const void *cache,
                                          const pkv_cache_geometry *geom, int32_t layer,
                                          const int32_t *block_tables, int32_t max_blocks_per_seq,
                                          const int32_t *context_lens, int32_t num_seqs,
                                          int32_t max_context_len, const pkv_attn_params *params,
                                          void *workspace, size_t workspace_bytes, void *stream) {
  const int chk = common_attn_checks(out, query, cache, geom, layer, block_tables,
                                     max_blocks_per_seq, context_lens, params);
  if (chk != PKV_OK) return chk;
  if (num_seqs < 0 || num_seqs > 65535 || max_context_len < 0) return PKV_ERR_INVALID_ARG;
  if (num_seqs == 0) return PKV_OK;
  if (params->decode_mode < PKV_DECODE_AUTO || params->decode_mode > PKV_DECODE_SPLIT)
    return PKV_ERR_INVALID_ARG;

  const int hkv = geom->num_kv_heads;
  const int group = params->num_heads / hkv;
  // Heads per block: the tensor-core body serves 8, the CUDA-core body 1, 4 or 8.
  const int gt = decode_uses_mma(geom->dtype, group) ? MmaDecode<__half, 64>::GT : decode_gt(group);
  // The context a kernel can see is clamped to what the block table row can name.
  const int64_t table_tokens = (int64_t)max_blocks_per_seq * geom->block_size;
  const int max_ctx = (int)(max_context_len < table_tokens ? max_context_len : table_tokens);

  DecodeArgs a{};
  a.out = out;
  a.query = query;
  a.cache = cache;
  a.block_tables = block_tables;
  a.context_lens = context_lens;
  a.alibi_slopes = params->alibi_slopes;
  a.st = Strides::of(*geom);
  a.layer_offset = (int64_t)layer * a.st.layer;
  a.num_blocks = geom->num_blocks;
  a.block_size = geom->block_size;
  a.max_blocks_per_seq = max_blocks_per_seq;
  a.table_tokens = table_tokens_i32(max_blocks_per_seq, geom->block_size);
  a.num_heads = params->num_heads;
  a.group = group;
  a.head_chunks = ceil_div(group, gt);
  a.scale = params->scale;
  a.softcap = params->softcap;
  a.window = params->sliding_window;

  // Single pass: one block per (sequence, KV head, head chunk) over the whole context.
  // Split-K: num_splits blocks each, then the reduce kernel.
  const int single_tokens = max_ctx > 0 ? max_ctx : 1;
  // A forced single pass keeps the limit pagedkv.h documents (the old body's logits buffer, in
  // its heads per block), though the v2 bodies have no such buffer: the ABI's owner lifts it.
  const int doc_gt = decode_gt(group);
  const bool single_fits =
      (size_t)doc_gt * ((size_t)single_tokens + 2) * sizeof(float) <= SINGLE_PASS_SMEM;
  bool single;
  if (params->decode_mode == PKV_DECODE_SINGLE) {
    if (!single_fits) return PKV_ERR_INVALID_ARG;
    single = true;
  } else if (params->decode_mode == PKV_DECODE_SPLIT) {
    single = false;  // partitions of PKV_DECODE_PARTITION even if there is only one
  } else {
    // Auto: short contexts are one pass. Longer ones are split unless the batch alone gives
    // every SM several thread blocks (then a split only adds the reduce's traffic).
    int dev = 0, sms = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) return status_of(e);
    // (The single pass of the v2 bodies needs no context-sized buffer: any length fits.)
    const int64_t ctas = (int64_t)num_seqs * hkv * a.head_chunks;
    single = max_ctx <= PKV_DECODE_PARTITION || ctas >= 4 * (int64_t)sms;
  }

  if (single) {
    a.part_tokens = single_tokens;
    a.num_splits = 1;
  } else {
    // Forced split: fixed partitions of PKV_DECODE_PARTITION tokens. Auto: as many splits, but
    // each sequence's partitions derived on the device from its own context (decode_v2.cuh),
    // so a short sequence in a long batch is spread over every split too.
    a.part_tokens = params->decode_mode == PKV_DECODE_SPLIT ? PKV_DECODE_PARTITION : 0;
    a.num_splits = ceil_div(max_ctx > 0 ? max_ctx : 1, PKV_DECODE_PARTITION);
    // The reduce kernel keeps one weight per split (plus its static total) in shared memory.
    if ((size_t)a.num_splits * sizeof(float) + sizeof(float) > SINGLE_PASS_SMEM)
      return PKV_ERR_INVALID_ARG;
  }
  if (a.num_splits > 1) {
    const WorkspaceLayout w =
        workspace_layout((int64_t)num_seqs * params->num_heads, geom->head_dim, a.num_splits);
    if (workspace == nullptr || workspace_bytes < w.total || !aligned16(workspace))
      return PKV_ERR_WORKSPACE;
    char *ws = static_cast<char *>(workspace);
    a.tmp_out = reinterpret_cast<float *>(ws + w.out_off);
    a.tmp_max = reinterpret_cast<float *>(ws + w.max_off);
    a.tmp_sum = reinterpret_cast<float *>(ws + w.sum_off);
  }

  cudaStream_t s = static_cast<cudaStream_t>(stream);
  PKV_DISPATCH_DTYPE(geom->dtype, PKV_DISPATCH_HEAD_DIM(geom->head_dim, {
    return dispatch_decode_gt<T, D>(gt, a, hkv, num_seqs, s);
  }));
  return PKV_ERR_DTYPE;
}

namespace pkv {
namespace {
template <typename T, int D>
int launch_prefill(const PrefillArgs &a, int hkv, int row_tiles, int num_seqs, cudaStream_t s) {
  constexpr size_t smem = prefill_smem_bytes<D>();
  if (smem > 48 * 1024) {
    // Above 48 KiB a kernel must opt in (sm_80: up to 163 KiB, sm_90: 227 KiB).
    cudaError_t e = cudaFuncSetAttribute(prefill_kernel<T, D>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return status_of(e);
  }
  const dim3 grid(hkv, row_tiles, num_seqs);
  prefill_kernel<T, D><<<grid, PF_THREADS, smem, s>>>(a);
  return status_of(cudaGetLastError());
}
}  // namespace
}  // namespace pkv

extern "C" int pkv_paged_attention_prefill(void *out, const void *query, const void *cache,
                                           const pkv_cache_geometry *geom, int32_t layer,
                                           const int32_t *block_tables,
                                           int32_t max_blocks_per_seq,
                                           const int32_t *context_lens,
                                           const int32_t *query_start_loc, int32_t num_seqs,
                                           int32_t max_query_len, const pkv_attn_params *params,
                                           void *stream) {
  const int chk = common_attn_checks(out, query, cache, geom, layer, block_tables,
                                     max_blocks_per_seq, context_lens, params);
  if (chk != PKV_OK) return chk;
  if (query_start_loc == nullptr) return PKV_ERR_NULL_POINTER;
  if (num_seqs < 0 || num_seqs > 65535 || max_query_len < 0) return PKV_ERR_INVALID_ARG;
  if (num_seqs == 0 || max_query_len == 0) return PKV_OK;
  const int group = params->num_heads / geom->num_kv_heads;
  const int64_t row_tiles = ((int64_t)max_query_len * group + PF_ROWS - 1) / PF_ROWS;
  if (row_tiles > 65535) return PKV_ERR_INVALID_ARG;

  PrefillArgs a{};
  a.out = out;
  a.query = query;
  a.cache = cache;
  a.block_tables = block_tables;
  a.context_lens = context_lens;
  a.query_start_loc = query_start_loc;
  a.alibi_slopes = params->alibi_slopes;
  a.st = Strides::of(*geom);
  a.layer_offset = (int64_t)layer * a.st.layer;
  a.num_blocks = geom->num_blocks;
  a.block_size = geom->block_size;
  a.max_blocks_per_seq = max_blocks_per_seq;
  a.table_tokens = table_tokens_i32(max_blocks_per_seq, geom->block_size);
  a.num_heads = params->num_heads;
  a.group = group;
  a.scale = params->scale;
  a.softcap = params->softcap;
  a.window = params->sliding_window;

  cudaStream_t s = static_cast<cudaStream_t>(stream);
  PKV_DISPATCH_DTYPE(geom->dtype, PKV_DISPATCH_HEAD_DIM(geom->head_dim, {
    return launch_prefill<T, D>(a, geom->num_kv_heads, (int)row_tiles, num_seqs, s);
  }));
  return PKV_ERR_DTYPE;
}
