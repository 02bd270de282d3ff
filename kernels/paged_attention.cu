// paged_attention.cu: the extern "C" launchers of the decode and prefill attention kernels
// (templates in attention.cuh; the f16 / bf16 prefill on tensor cores in prefill_mma.cuh). Each launcher validates its arguments, picks the template
// instance for (dtype, head_dim, group size), launches on the caller's stream and returns the
// launch status; none synchronizes.
#include "attention.cuh"
#include "prefill_mma.cuh"

namespace pkv {
namespace {

// Query heads one decode thread block serves: 1 (MHA), 4 (GQA ratio 2..4) or 8 (5..8, and
// groups of 8 for larger ratios, read once per 8 query heads).
inline int decode_gt(int group) { return group == 1 ? 1 : (group <= 4 ? 4 : 8); }

// Shared-memory budget of the single-pass logits buffer: what every GPU gives without opt-in.
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

template <typename T, int D, int GT>
int launch_decode(DecodeArgs a, int num_kv_heads, int num_seqs, cudaStream_t stream) {
  const size_t smem = decode_smem_bytes<GT, D>(a.part_tokens);
  // Static and dynamic shared memory share the budget; callers keep below it (see below).
  if (smem + decode_static_smem_bytes(GT) > SINGLE_PASS_SMEM) return PKV_ERR_INVALID_ARG;
  const dim3 grid(num_kv_heads * a.head_chunks, num_seqs, a.num_splits);
  decode_kernel<T, D, GT><<<grid, DEC_THREADS, smem, stream>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || a.num_splits == 1) return status_of(e);
  const dim3 rgrid(a.num_heads, num_seqs);
  decode_reduce_kernel<T><<<rgrid, 128, a.num_splits * sizeof(float), stream>>>(
      a.out, a.tmp_out, a.tmp_max, a.tmp_sum, a.context_lens, a.table_tokens, a.num_heads, D,
      a.num_splits, a.part_tokens);
  return status_of(cudaGetLastError());
}

template <typename T, int D>
int dispatch_decode_gt(int gt, DecodeArgs a, int hkv, int ns, cudaStream_t s) {
  switch (gt) {
    case 1: return launch_decode<T, D, 1>(a, hkv, ns, s);
    case 4: return launch_decode<T, D, 4>(a, hkv, ns, s);
    default: return launch_decode<T, D, 8>(a, hkv, ns, s);
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
  const int gt = decode_gt(group);
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

  // Single pass: the whole context's logits fit the shared-memory budget. Split-K: partitions
  // of PKV_DECODE_PARTITION tokens, then the reduce kernel.
  const int single_tokens = max_ctx > 0 ? max_ctx : 1;
  const bool single_fits =
      (size_t)gt * single_tokens * sizeof(float) + decode_static_smem_bytes(gt) <= SINGLE_PASS_SMEM;
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
    const int64_t ctas = (int64_t)num_seqs * hkv * a.head_chunks;
    single = single_fits && (max_ctx <= PKV_DECODE_PARTITION || ctas >= 4 * (int64_t)sms);
  }

  if (single) {
    a.part_tokens = single_tokens;
    a.num_splits = 1;
  } else {
    a.part_tokens = PKV_DECODE_PARTITION;
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

// f16 / bf16: the tensor-core kernel, 64 rows per thread block.
template <typename T, int D>
int launch_prefill_mma(const PrefillArgs &a, int hkv, int row_tiles, int num_seqs,
                       cudaStream_t s) {
  constexpr size_t smem = pfmma::Cfg<D>::smem_bytes;
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(pfmma::prefill_mma_kernel<T, D>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return status_of(e);
  }
  const dim3 grid(hkv, row_tiles, num_seqs);
  pfmma::prefill_mma_kernel<T, D><<<grid, pfmma::THREADS, smem, s>>>(a);
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
  const bool mma = geom->dtype == PKV_DTYPE_F16 || geom->dtype == PKV_DTYPE_BF16;
  const int rows_per_tile = mma ? pfmma::ROWS : PF_ROWS;
  const int64_t row_tiles = ((int64_t)max_query_len * group + rows_per_tile - 1) / rows_per_tile;
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
  const int hkv = geom->num_kv_heads, tiles = (int)row_tiles;
  switch (geom->dtype) {
    case PKV_DTYPE_F32:
      PKV_DISPATCH_HEAD_DIM(geom->head_dim,
                            { return launch_prefill<float, D>(a, hkv, tiles, num_seqs, s); });
      break;
    case PKV_DTYPE_F16:
      PKV_DISPATCH_HEAD_DIM(geom->head_dim,
                            { return launch_prefill_mma<__half, D>(a, hkv, tiles, num_seqs, s); });
      break;
    case PKV_DTYPE_BF16:
      PKV_DISPATCH_HEAD_DIM(geom->head_dim, {
        return launch_prefill_mma<__nv_bfloat16, D>(a, hkv, tiles, num_seqs, s);
      });
      break;
    default:
      break;
  }
  return PKV_ERR_DTYPE;
}
