// paged_attention.cu: the decode plan and the extern "C" launchers of the decode and prefill
// attention kernels (templates in attention.cuh, decode_v2.cuh, decode_mma.cuh, and the f16 /
// bf16 prefill on tensor cores in prefill_mma.cuh). Each launcher validates its arguments, picks
// the template instance for (dtype, head_dim, group size), launches on the caller's stream and
// returns the launch status; none synchronizes. The decode split policy lives in decode_plan
// (the only place that chooses num_splits; the kernels derive partitions on the device).
#include <cmath>
#include <type_traits>

#include "attention.cuh"
#include "decode_mma.cuh"
#include "decode_resident.cuh"
#include "prefill_mma.cuh"

namespace pkv {
namespace {

// Query heads one decode thread block of the CUDA-core body serves: 1 (MHA), 4 (GQA ratio
// 2..4) or 8 (5..8, and groups of 8 for larger ratios). The plan sizes the split merge's
// counters and estimates its thread blocks with it, whatever the body: the tensor-core body
// serves 8 (the same chunk count) or, past 8 up to head dim 128, 16 (fewer chunks).
inline int decode_gt(int group) { return group == 1 ? 1 : (group <= 4 ? 4 : 8); }

// Query heads one tensor-core decode block serves: 16 for groups past 8 up to head dim 128
// (MmaDecode's shared memory fits 16 heads there), else 8. The dispatch and the plan's
// thread-block estimate both follow it.
inline int decode_mma_gt(int group, int head_dim) {
  return group > 8 && head_dim <= 128 ? 16 : 8;
}

inline bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The Auto policy's wave rule: with more thread blocks than one wave of resident ones, the
// split count among want .. want + 3 with the fewest waves per split (a partial last wave
// leaves SMs idle while the launch finishes), moving off `want` only for a 10% gain (more
// splits cost the merge). H200, bf16 d128, 64 x 4096 / 64 x 32768: GQA 32:8 1 split 323 /
// 2488 us, 3 splits 277 / 2009 us; MHA 1 split 1099 / 8760 us, 2 splits 986 / 7806 us
// (BENCHMARKS.md).
inline int64_t decode_wave_splits(int64_t ctas, int64_t want, int64_t slots, int64_t by_len) {
  if (ctas * want <= slots) return want;  // one wave
  int64_t best = want;
  double best_cost = (double)ceil_div64(ctas * want, slots) / (double)want;
  for (int64_t s = want + 1; s <= want + 3 && s <= by_len; ++s) {
    const double cost = (double)ceil_div64(ctas * s, slots) / (double)s;
    if (cost < 0.9 * best_cost) {
      best = s;
      best_cost = cost;
    }
  }
  return best;
}

// The decode workspace (the contract in attention.cuh): the arrival counters of `groups`
// (sequence, head chunk) groups at byte 0, then tmp_out, tmp_max, tmp_sum of `rows` rows x
// `splits` splits, each section on a 256-byte boundary.
struct WorkspaceLayout {
  size_t counter_bytes, out_off, max_off, sum_off, total;
};
inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
// False when the sizes overflow 64 bits.
inline bool decode_workspace_layout(int64_t rows, int64_t groups, int head_dim, int splits,
                                    WorkspaceLayout *w) {
  int64_t n = 0, out_bytes = 0;
  if (!mul_i64(rows, splits, &n) || !mul_i64(n, (int64_t)head_dim * (int64_t)sizeof(float),
                                               &out_bytes))
    return false;
  if (out_bytes > (INT64_MAX >> 2) || groups > (INT64_MAX >> 4)) return false;  // sums stay small
  w->counter_bytes = (size_t)groups * sizeof(unsigned);
  w->out_off = align_up(w->counter_bytes, 256);
  w->max_off = w->out_off + align_up((size_t)out_bytes, 256);
  w->sum_off = w->max_off + align_up((size_t)n * sizeof(float), 256);
  w->total = w->sum_off + align_up((size_t)n * sizeof(float), 256);
  return true;
}

// A query/out view: 16-byte aligned pointer and stride, stride >= one row. (The byte stride
// in unsigned arithmetic: a stride past 2^61 elements overflowed the signed product; modulo
// 2^64 the remainder by 16 is the same.)
inline bool rows_ok(const void *p, int64_t stride, int64_t row, int elem) {
  return aligned16(p) && stride >= row && ((uint64_t)stride * (uint64_t)elem) % 16 == 0;
}

int common_attn_checks(const void *out, int64_t out_stride, const void *query, int64_t q_stride,
                       const void *cache, const pkv_cache_geometry *geom, int32_t layer,
                       const int32_t *block_tables, int32_t max_blocks_per_seq,
                       const int32_t *context_lens, const pkv_attn_params *params,
                       int32_t allowed_flags) {
  const int g = check_geometry(geom, layer);
  if (g != PKV_OK) return g;
  if (params == nullptr || out == nullptr || query == nullptr || cache == nullptr ||
      block_tables == nullptr || context_lens == nullptr)
    return PKV_ERR_NULL_POINTER;
  // Every page starts on the 16-byte grid (check_geometry) only if the base does.
  if (!aligned16(cache)) return PKV_ERR_INVALID_ARG;
  if (params->num_heads <= 0 || params->num_heads % geom->num_kv_heads != 0)
    return PKV_ERR_INVALID_ARG;
  if (max_blocks_per_seq <= 0) return PKV_ERR_INVALID_ARG;
  // NaN or infinite: the CPU oracle and the Rust API refuse them (a soft-cap of +inf made
  // every logit inf * tanh(s / inf) = NaN).
  if (!std::isfinite(params->scale) || !std::isfinite(params->softcap))
    return PKV_ERR_INVALID_ARG;
  if ((params->launch_flags & ~allowed_flags) != 0) return PKV_ERR_INVALID_ARG;
  const int64_t row = (int64_t)params->num_heads * geom->head_dim;
  const int es = dtype_size(geom->dtype);
  if (!rows_ok(query, q_stride, row, es) || !rows_ok(out, out_stride, row, es))
    return PKV_ERR_ROW_STRIDE;
  return PKV_OK;
}

// pkv_decode_plan_init_dtype without the output write; with PKV_DECODE_FIXED, `sm_count` is
// the caller's number of splits (pkv_decode_plan_init_splits).
int decode_plan(int32_t mode, int32_t dtype, int32_t num_seqs, int32_t num_heads,
                int32_t num_kv_heads, int32_t head_dim, int32_t cap, int32_t sm_count,
                pkv_decode_plan *plan) {
  if (num_seqs <= 0 || num_seqs > 65535 || num_heads <= 0 || num_kv_heads <= 0 || cap <= 0 ||
      num_heads % num_kv_heads != 0)
    return PKV_ERR_INVALID_ARG;
  if (dtype != PKV_DTYPE_F32 && dtype != PKV_DTYPE_F16 && dtype != PKV_DTYPE_BF16)
    return PKV_ERR_DTYPE;
  const bool f32 = dtype == PKV_DTYPE_F32;
  if (!supported_head_dim(head_dim)) return PKV_ERR_HEAD_DIM;
  const int group = num_heads / num_kv_heads;
  const int gt = decode_gt(group);
  int64_t splits = 1;  // any partition length fits the kernels (nothing per token in smem)
  switch (mode) {
    case PKV_DECODE_SINGLE:
      break;
    case PKV_DECODE_FIXED:
      if (sm_count < 1) return PKV_ERR_INVALID_ARG;  // > PKV_DECODE_MAX_SPLITS: below
      splits = sm_count;
      break;
    case PKV_DECODE_SPLIT: {
      const int64_t by_len = ceil_div64(cap, PKV_DECODE_PARTITION);
      splits = by_len > 2 ? by_len : 2;
      break;
    }
    case PKV_DECODE_AUTO: {
      if (sm_count <= 0) {
        const int st = current_sm_count(&sm_count);
        if (st != PKV_OK) return st;
      }
      // Thread blocks of one split; enough splits to give every SM PKV_DECODE_CTAS_PER_SM of
      // them (PKV_DECODE_CTAS_PER_SM_MHA for one head per KV head), no partition (at
      // capacity) shorter than PKV_DECODE_MIN_PART tokens (_MHA); then the wave rule
      // (decode_wave_splits). Groups past 8 count the 16-head tensor-core blocks of f16 /
      // bf16 (up to d128), f32 its 8-head CUDA-core ones.
      const int est_gt = group > 8 && !f32 ? decode_mma_gt(group, head_dim) : gt;
      const int64_t ctas = (int64_t)num_seqs * num_kv_heads * ceil_div(group, est_gt);
      const int per_sm = group == 1 ? PKV_DECODE_CTAS_PER_SM_MHA : PKV_DECODE_CTAS_PER_SM;
      const int64_t target = (int64_t)per_sm * sm_count;
      // MHA's one-head blocks do little per token: its partitions stay twice as long (H200,
      // bf16 d128, 32:32 / 1 x 512: 8 splits 9.9 us, 16 splits 10.5).
      const int64_t by_len =
          ceil_div64(cap, group == 1 ? PKV_DECODE_MIN_PART_MHA : PKV_DECODE_MIN_PART);
      int64_t want = ctas >= target ? 1 : ceil_div64(target, ctas);
      want = want < by_len ? want : by_len;
      const int body_gt = group == 1 || f32 ? gt : decode_mma_gt(group, head_dim);
      const int64_t slots =
          (int64_t)(f32 ? decode_resident_f32(body_gt, head_dim) : decode_resident(body_gt, head_dim)) *
          sm_count;
      // GQA with long partitions fills every resident slot in one wave (floor(slots / ctas)
      // splits) while each partition keeps PKV_DECODE_FILL_PART tokens. H200, bf16 d128, 32:8,
      // graph us, 2 -> 3 blocks per SM: 1 x 32768 47.3 -> 43.6 (33 -> 49 splits), 2 x 16384
      // 47.2 -> 42.5 (24), 4 x 8192 46.1 -> 42.6 (12), 8 x 4096 43.9 -> 42.9 (6); but 1 x 4096
      // at 49 splits (84 tokens) 16.2 against 14.8 at 33 (BENCHMARKS.md). MHA's body got slower
      // with more splits at batch 1 (1 x 32768: 134 us at 16, 176 at 33): not for it.
      if (group > 1 && ctas < slots) {
        const int64_t fill = slots / ctas;
        if (fill > want && fill <= by_len && cap / fill >= PKV_DECODE_FILL_PART) want = fill;
      }
      splits = decode_wave_splits(ctas, want, slots, by_len);
      break;
    }
    default:
      return PKV_ERR_INVALID_ARG;
  }
  if (splits > PKV_DECODE_MAX_SPLITS) return PKV_ERR_INVALID_ARG;
  uint64_t ws = 0, counters = 0;
  if (splits > 1) {
    WorkspaceLayout w;
    if (!decode_workspace_layout((int64_t)num_seqs * num_heads,
                                 (int64_t)num_seqs * num_kv_heads * ceil_div(group, gt), head_dim,
                                 (int)splits, &w))
      return PKV_ERR_INVALID_ARG;
    ws = w.total;
    counters = w.counter_bytes;
  }
  plan->mode = mode;
  plan->num_seqs_capacity = num_seqs;
  plan->num_heads = num_heads;
  plan->num_kv_heads = num_kv_heads;
  plan->head_dim = head_dim;
  plan->max_context_capacity = cap;
  plan->num_splits = (int32_t)splits;
  plan->workspace_bytes = ws;
  plan->counter_bytes = counters;
  return PKV_OK;
}

// Groups of at least this many query heads per KV head run the tensor-core body when the cache
// is f16 / bf16: its cost per token does not grow with the heads served, while the CUDA-core
// body pays one FMA per head per K/V element in each product (a group of 2 or 3 already costs
// it what 4 heads do, since it serves 4). MHA (one head) stays on CUDA cores: an mma would
// waste 15 of its 16 rows.
constexpr int DECODE_MMA_MIN_GROUP = 2;

template <typename T, int D, int GT>
int launch_decode(DecodeArgs a, int num_kv_heads, int num_seqs, cudaStream_t stream) {
  constexpr size_t smem = SimtDecode<T, D, GT>::smem_bytes();
  static_assert(smem <= 48 * 1024, "the merge buffer fits without the opt-in");
  a.head_chunks = ceil_div(a.group, GT);
  const dim3 grid(num_kv_heads * a.head_chunks, num_seqs, a.num_splits);
  return launch_kernel(decode_simt_kernel<T, D, GT>, grid, dim3(DEC_THREADS), smem, stream,
                       a.launch_flags, a);
}

template <typename T, int D, int GT>
int launch_decode_mma(DecodeArgs a, int num_kv_heads, int num_seqs, cudaStream_t stream) {
  constexpr size_t smem = MmaDecode<T, D, GT>::smem_bytes();
  static_assert(smem <= 48 * 1024, "queries and merge buffer fit without the opt-in");
  a.head_chunks = ceil_div(a.group, GT);
  const dim3 grid(num_kv_heads * a.head_chunks, num_seqs, a.num_splits);
  return launch_kernel(decode_mma_kernel<T, D, GT>, grid, dim3(DEC_THREADS), smem, stream,
                       a.launch_flags, a);
}

template <typename T, int D>
int dispatch_decode_gt(int gt, DecodeArgs a, int hkv, int ns, cudaStream_t s) {
  if constexpr (!std::is_same<T, float>::value) {
    // f16 / bf16: tensor cores for GQA, the one-head CUDA-core body for MHA (no other
    // instance is built).
    if constexpr (D <= 128) {  // the only dims with a 16-head instance
      if (decode_mma_gt(a.group, D) == 16) return launch_decode_mma<T, D, 16>(a, hkv, ns, s);
    }
    if (a.group >= DECODE_MMA_MIN_GROUP) return launch_decode_mma<T, D, 8>(a, hkv, ns, s);
    return launch_decode<T, D, 1>(a, hkv, ns, s);
  } else {
    switch (gt) {
      case 1: return launch_decode<T, D, 1>(a, hkv, ns, s);
      case 4: return launch_decode<T, D, 4>(a, hkv, ns, s);
      default: return launch_decode<T, D, 8>(a, hkv, ns, s);
    }
  }
}

}  // namespace
}  // namespace pkv

using namespace pkv;

extern "C" int pkv_decode_plan_init_dtype(pkv_decode_plan *plan, int32_t mode, int32_t dtype,
                                          int32_t num_seqs_capacity, int32_t num_heads,
                                          int32_t num_kv_heads, int32_t head_dim,
                                          int32_t max_context_capacity, int32_t sm_count) {
  if (plan == nullptr) return PKV_ERR_NULL_POINTER;
  // The fixed mode's split count is pkv_decode_plan_init_splits' argument: here `sm_count`
  // would be taken for it.
  if (mode == PKV_DECODE_FIXED) return PKV_ERR_INVALID_ARG;
  pkv_decode_plan p{};
  const int st = decode_plan(mode, dtype, num_seqs_capacity, num_heads, num_kv_heads, head_dim,
                             max_context_capacity, sm_count, &p);
  if (st == PKV_OK) *plan = p;
  return st;
}

extern "C" int pkv_decode_plan_init(pkv_decode_plan *plan, int32_t mode,
                                    int32_t num_seqs_capacity, int32_t num_heads,
                                    int32_t num_kv_heads, int32_t head_dim,
                                    int32_t max_context_capacity, int32_t sm_count) {
  return pkv_decode_plan_init_dtype(plan, mode, PKV_DTYPE_BF16, num_seqs_capacity, num_heads,
                                    num_kv_heads, head_dim, max_context_capacity, sm_count);
}

extern "C" int pkv_decode_plan_init_splits(pkv_decode_plan *plan, int32_t num_splits,
                                           int32_t num_seqs_capacity, int32_t num_heads,
                                           int32_t num_kv_heads, int32_t head_dim,
                                           int32_t max_context_capacity) {
  if (plan == nullptr) return PKV_ERR_NULL_POINTER;
  pkv_decode_plan p{};
  const int st = decode_plan(PKV_DECODE_FIXED, PKV_DTYPE_BF16, num_seqs_capacity, num_heads,
                             num_kv_heads, head_dim, max_context_capacity, num_splits, &p);
  if (st == PKV_OK) *plan = p;
  return st;
}

extern "C" int pkv_paged_attention_decode(void *out, int64_t out_token_stride, const void *query,
                                          int64_t query_token_stride, const void *cache,
                                          const pkv_cache_geometry *geom, int32_t layer,
                                          const int32_t *block_tables, int32_t max_blocks_per_seq,
                                          const int32_t *context_lens, int32_t num_seqs,
                                          const pkv_decode_plan *plan,
                                          const pkv_attn_params *params, void *workspace,
                                          size_t workspace_bytes, void *stream) {
  const int chk = common_attn_checks(out, out_token_stride, query, query_token_stride, cache,
                                     geom, layer, block_tables, max_blocks_per_seq, context_lens,
                                     params, PKV_LAUNCH_PROGRAMMATIC);
  if (chk != PKV_OK) return chk;
  if (plan == nullptr) return PKV_ERR_NULL_POINTER;
  if (num_seqs < 0) return PKV_ERR_INVALID_ARG;
  // The plan must describe this launch, and be one decode_plan could have made (a plan is
  // plain data a caller may have built by hand: nothing in it is trusted).
  if (plan->num_heads != params->num_heads || plan->num_kv_heads != geom->num_kv_heads ||
      plan->head_dim != geom->head_dim || num_seqs > plan->num_seqs_capacity ||
      plan->num_seqs_capacity > 65535 || plan->max_context_capacity <= 0 ||
      plan->num_splits < 1 || plan->num_splits > PKV_DECODE_MAX_SPLITS)
    return PKV_ERR_PLAN;
  const int hkv = geom->num_kv_heads;
  const int group = params->num_heads / hkv;
  // The plan's head chunks (decode_gt); each launch_decode* sets the chunks of its own body.
  const int gt = decode_gt(group);
  if (num_seqs == 0) return PKV_OK;

  DecodeArgs a{};
  a.out = out;
  a.query = query;
  a.cache = cache;
  a.block_tables = block_tables;
  a.context_lens = context_lens;
  a.alibi_slopes = params->alibi_slopes;
  a.st = Strides::of(*geom);
  a.layer_offset = (int64_t)layer * a.st.layer;
  a.q_stride = query_token_stride;
  a.out_stride = out_token_stride;
  a.num_blocks = geom->num_blocks;
  a.block_size = geom->block_size;
  a.block_shift = 0;
  while ((1 << a.block_shift) < a.block_size) ++a.block_shift;  // a power of two (checked)
  a.max_blocks_per_seq = max_blocks_per_seq;
  const int32_t table_tokens = table_tokens_i32(max_blocks_per_seq, geom->block_size);
  a.ctx_clamp = plan->max_context_capacity < table_tokens ? plan->max_context_capacity
                                                          : table_tokens;
  a.num_heads = params->num_heads;
  a.group = group;
  a.num_splits = plan->num_splits;
  a.scale = params->scale;
  a.softcap = params->softcap;
  a.window = params->sliding_window;
  a.launch_flags = params->launch_flags;

  if (a.num_splits > 1) {
    // Sized for the plan's capacity (not num_seqs): the layout's row stride is fixed per plan.
    // Counters for ceil(group / decode_gt(group)) head chunks, as the plan sized them: the
    // most any body launches (the 16-head tensor-core body launches fewer).
    WorkspaceLayout w;
    if (!decode_workspace_layout((int64_t)plan->num_seqs_capacity * params->num_heads,
                                 (int64_t)plan->num_seqs_capacity * hkv * ceil_div(group, gt),
                                 geom->head_dim, a.num_splits, &w))
      return PKV_ERR_PLAN;
    if (plan->counter_bytes != w.counter_bytes) return PKV_ERR_PLAN;  // the caller zeroes those
    if (workspace == nullptr || workspace_bytes < w.total || !aligned16(workspace))
      return PKV_ERR_WORKSPACE;
    char *ws = static_cast<char *>(workspace);
    a.counters = reinterpret_cast<unsigned *>(ws);
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
#ifdef PKV_HAVE_WGMMA
// kernels/prefill_wgmma.cu (the sm_90a unit).
int launch_prefill_wgmma(const PrefillArgs &a, int dtype, int head_dim, int wg, bool ovl,
                         bool persist, int hkv, int row_tiles, int num_seqs, cudaStream_t s);
#endif
namespace {
// Whether PKV_PREFILL_TILING_WGMMA runs the wgmma kernel: the build has it (a target of sm_90
// adds the sm_90a unit), the head dim has an instance, and the current device is compute
// capability 9.0 exactly (sm_90a code runs nowhere else; the emulation's device reports 9.0
// unless a test sets another).
bool wgmma_prefill_available(int head_dim) {
#ifndef PKV_HAVE_WGMMA
  (void)head_dim;
  return false;
#else
  if (head_dim > 128) return false;  // head dims are checked before: 64 .. 128 have instances
  int dev = 0, major = 0, minor = 0;
  return cudaGetDevice(&dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
         major == 9 && minor == 0;
#endif
}

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
  return launch_kernel(prefill_kernel<T, D>, grid, dim3(PF_THREADS), smem, s, a.launch_flags, a);
}

// f16 / bf16: the tensor-core kernel, MT m16 tiles per warp (Cfg<D, MT>::ROWS rows per thread
// block).
template <typename T, int D, int MT>
int launch_prefill_mma(const PrefillArgs &a, int hkv, int row_tiles, int num_seqs,
                       cudaStream_t s) {
  constexpr size_t smem = pfmma::Cfg<D, MT>::smem_bytes;
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(pfmma::prefill_mma_kernel<T, D, MT>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return status_of(e);
  }
  const dim3 grid(hkv, row_tiles, num_seqs);
  return launch_kernel(pfmma::prefill_mma_kernel<T, D, MT>, grid, dim3(pfmma::THREADS), smem, s,
                       a.launch_flags, a);
}

template <typename T, int D>
int launch_prefill_mma_rows(const PrefillArgs &a, int hkv, int row_tiles, int num_seqs, int mt,
                            cudaStream_t s) {
  if constexpr (D <= 128) {
    if (mt == 2) return launch_prefill_mma<T, D, 2>(a, hkv, row_tiles, num_seqs, s);
  }
  return launch_prefill_mma<T, D, 1>(a, hkv, row_tiles, num_seqs, s);
}

// Warpgroups per block of a wgmma tiling (1 or 2; 0: not a wgmma tiling), and whether a
// tiling is an overlapped wgmma schedule, or the persistent grid.
int wgmma_warpgroups(int32_t t) {
  return t == PKV_PREFILL_TILING_WGMMA || t == PKV_PREFILL_TILING_WGMMA_OVERLAP ? 1
         : t == PKV_PREFILL_TILING_WGMMA128 || t == PKV_PREFILL_TILING_WGMMA128_OVERLAP ||
                 t == PKV_PREFILL_TILING_WGMMA128_PERSISTENT
             ? 2
             : 0;
}
bool wgmma_overlapped(int32_t t) {
  return t == PKV_PREFILL_TILING_WGMMA_OVERLAP || t == PKV_PREFILL_TILING_WGMMA128_OVERLAP;
}
bool wgmma_persistent(int32_t t) { return t == PKV_PREFILL_TILING_WGMMA128_PERSISTENT; }

// The dynamic shared memory of the 128-row mma.sync kernel (WARP32) at `head_dim` (0: no
// instance, above 128).
size_t warp32_smem(int head_dim) {
  switch (head_dim) {
    case 64: return pfmma::Cfg<64, 2>::smem_bytes;
    case 80: return pfmma::Cfg<80, 2>::smem_bytes;
    case 96: return pfmma::Cfg<96, 2>::smem_bytes;
    case 112: return pfmma::Cfg<112, 2>::smem_bytes;
    case 128: return pfmma::Cfg<128, 2>::smem_bytes;
    default: return 0;
  }
}

// Whether WARP32 fits the shared memory one block may opt in to on the current device: head
// dim 128 asks 105,984 bytes, more than the 99 KiB of compute capability 8.6 / 8.9 / 12.x
// (which run the sm_80 SASS or JIT the PTX), where cudaFuncSetAttribute refused it and the
// prefill failed. The device is asked only for a kernel above those 99 KiB; a failed query
// answers yes (the launch then reports the device's own refusal).
bool warp32_fits(int head_dim) {
  const size_t smem = warp32_smem(head_dim);
  if (smem <= 99 * 1024) return true;
  int dev = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
          cudaSuccess)
    return true;
  return smem <= (size_t)optin;
}

bool known_prefill_tiling(int32_t t) {
  return t == PKV_PREFILL_TILING_AUTO || t == PKV_PREFILL_TILING_WARP16 ||
         t == PKV_PREFILL_TILING_WARP32 || wgmma_warpgroups(t) > 0;
}

// The tiling a launch runs (pkv_prefill_tiling_choice's contract; arguments already checked:
// a known tiling, a supported head dim, a cache dtype, positive heads, num_seqs and
// max_query_len >= 0). The SM count is asked only for Auto's decision.
int prefill_tiling_run(int32_t tiling, int32_t dtype, int group, int hkv, int head_dim,
                       int num_seqs, int max_query_len, int sm_count, int32_t *run) {
  if (dtype == PKV_DTYPE_F32) {
    *run = PKV_PREFILL_TILING_AUTO;  // the f32 kernel has no tilings
    return PKV_OK;
  }
  if (wgmma_warpgroups(tiling) > 0) {
    // The persistent grid has no d64 instance (prefill_wgmma.cu): the plain one runs there.
    const int32_t t = wgmma_persistent(tiling) && head_dim <= 64
                          ? PKV_PREFILL_TILING_WGMMA128
                          : tiling;
    *run = wgmma_prefill_available(head_dim) ? t : PKV_PREFILL_TILING_WARP16;
    return PKV_OK;
  }
  if (head_dim > 128 || tiling == PKV_PREFILL_TILING_WARP16) {
    *run = PKV_PREFILL_TILING_WARP16;  // WARP32 has no instance above head dim 128
    return PKV_OK;
  }
  if (tiling == PKV_PREFILL_TILING_WARP32) {
    *run = warp32_fits(head_dim) ? PKV_PREFILL_TILING_WARP32 : PKV_PREFILL_TILING_WARP16;
    return PKV_OK;
  }
  // Auto. The device is asked for its SM count (both rules need it).
  if (sm_count <= 0) {
    const int st = current_sm_count(&sm_count);
    if (st != PKV_OK) return st;
  }
  // Blocks of 128 rows (WARP32's and WGMMA128's), saturating: any count past the slots
  // decides the same way. (max_query_len x group < 2^62 cannot overflow.)
  const int64_t rows = pfmma::Cfg<64, 2>::ROWS;
  int64_t blocks = 0;
  if (!mul_i64((int64_t)hkv, ((int64_t)max_query_len * group + rows - 1) / rows, &blocks) ||
      !mul_i64(blocks, (int64_t)num_seqs, &blocks))
    blocks = INT64_MAX;
  if (wgmma_prefill_available(head_dim)) {
    // Hopper: two warpgroups sharing each K / V tile, the fastest tiling at every point of the
    // H100 grid with cached tokens at d64 / d96 / d128 and within 2% at d80 (BENCHMARKS.md:
    // 115-134% of SDPA at d128); over no cached tokens within 2% of the fastest at d128, up
    // to 19% behind at d80 (the 32-row kernel at 2048 + 0). One block of them per SM
    // (two at d64): where their blocks cover fewer than half the SMs, one warpgroup per block
    // doubles the blocks on idle SMs instead.
    *run = blocks >= (sm_count + 1) / 2 ? PKV_PREFILL_TILING_WGMMA128 : PKV_PREFILL_TILING_WGMMA;
    return PKV_OK;
  }
  // mma.sync: 128 rows per block once their blocks cover every resident slot; before that, 64
  // rows put twice the blocks on the SMs (the +0 and 512-token chunks of BENCHMARKS.md's H100
  // grid are 1.10-1.43x faster so; 2048-token chunks 1.29-1.33x slower).
  static_assert(pfmma::Cfg<64, 2>::MIN_BLOCKS == 2 && pfmma::Cfg<128, 2>::MIN_BLOCKS == 2,
                "WARP32's launch bounds promise 2 blocks per SM at every head dim it has");
  constexpr int64_t per_sm = 2;
  *run = blocks >= per_sm * sm_count && warp32_fits(head_dim) ? PKV_PREFILL_TILING_WARP32
                                                                : PKV_PREFILL_TILING_WARP16;
  return PKV_OK;
}
}  // namespace
}  // namespace pkv

extern "C" int pkv_prefill_tiling_choice(int32_t *chosen, int32_t tiling, int32_t dtype,
                                         int32_t num_heads, int32_t num_kv_heads,
                                         int32_t head_dim, int32_t num_seqs,
                                         int32_t max_query_len, int32_t sm_count) {
  if (chosen == nullptr) return PKV_ERR_NULL_POINTER;
  if (!known_prefill_tiling(tiling) || num_heads <= 0 || num_kv_heads <= 0 ||
      num_heads % num_kv_heads != 0 || num_seqs < 0 || max_query_len < 0)
    return PKV_ERR_INVALID_ARG;
  if (!supported_head_dim(head_dim)) return PKV_ERR_HEAD_DIM;
  if (dtype != PKV_DTYPE_F32 && dtype != PKV_DTYPE_F16 && dtype != PKV_DTYPE_BF16)
    return PKV_ERR_DTYPE;
  int32_t run = 0;
  const int st = prefill_tiling_run(tiling, dtype, num_heads / num_kv_heads, num_kv_heads,
                                    head_dim, num_seqs, max_query_len, sm_count, &run);
  if (st == PKV_OK) *chosen = run;
  return st;
}

#ifndef PKV_HAVE_WGMMA
// A build without the sm_90a unit (no sm_90 target) has no wgmma kernel to probe.
extern "C" int pkv_wgmma_layout_probe(int32_t *mismatches, void *stream) {
  (void)mismatches;
  (void)stream;
  return status_of(cudaErrorNoKernelImageForDevice);
}
#endif

extern "C" int pkv_paged_attention_prefill(void *out, int64_t out_token_stride,
                                           const void *query, int64_t query_token_stride,
                                           const void *cache, const pkv_cache_geometry *geom,
                                           int32_t layer,
                                           const int32_t *block_tables,
                                           int32_t max_blocks_per_seq,
                                           const int32_t *context_lens,
                                           const int32_t *query_start_loc, int32_t num_seqs,
                                           int32_t max_query_len, const pkv_attn_params *params,
                                           void *stream) {
  return pkv_paged_attention_prefill_tiled(out, out_token_stride, query, query_token_stride,
                                           cache, geom, layer, block_tables, max_blocks_per_seq,
                                           context_lens, query_start_loc, num_seqs,
                                           max_query_len, params, PKV_PREFILL_TILING_AUTO,
                                           stream);
}

extern "C" int pkv_paged_attention_prefill_tiled(
    void *out, int64_t out_token_stride, const void *query, int64_t query_token_stride,
    const void *cache, const pkv_cache_geometry *geom, int32_t layer,
    const int32_t *block_tables, int32_t max_blocks_per_seq, const int32_t *context_lens,
    const int32_t *query_start_loc, int32_t num_seqs, int32_t max_query_len,
    const pkv_attn_params *params, int32_t tiling, void *stream) {
  const int chk = common_attn_checks(out, out_token_stride, query, query_token_stride, cache,
                                     geom, layer, block_tables, max_blocks_per_seq, context_lens,
                                     params, PKV_LAUNCH_PROGRAMMATIC);
  if (chk != PKV_OK) return chk;
  if (query_start_loc == nullptr) return PKV_ERR_NULL_POINTER;
  if (num_seqs < 0 || num_seqs > 65535 || max_query_len < 0) return PKV_ERR_INVALID_ARG;
  if (!known_prefill_tiling(tiling)) return PKV_ERR_INVALID_ARG;
  if (num_seqs == 0 || max_query_len == 0) return PKV_OK;
  const int group = params->num_heads / geom->num_kv_heads;
  const bool mma = geom->dtype == PKV_DTYPE_F16 || geom->dtype == PKV_DTYPE_BF16;
  // The f16 / bf16 kernel the tiling runs (pkv_prefill_tiling_choice): wg warpgroups of the
  // wgmma one (0: none), else mt m16 tiles per warp of the mma.sync one; either way 64 rows
  // per warpgroup or per m-tile of its 4 warps.
  int32_t run = PKV_PREFILL_TILING_AUTO;
  const int rst = prefill_tiling_run(tiling, geom->dtype, group, geom->num_kv_heads,
                                     geom->head_dim, num_seqs, max_query_len, 0, &run);
  if (rst != PKV_OK) return rst;
  const bool ovl = wgmma_overlapped(run), persist = wgmma_persistent(run);
  const int wg = wgmma_warpgroups(run);
  const int mt = run == PKV_PREFILL_TILING_WARP32 ? 2 : 1;
  static_assert(pfmma::Cfg<64, 1>::ROWS == 64 && pfmma::Cfg<64, 2>::ROWS == 128,
                "64 rows per m-tile of 4 warps");
  const int rows_per_tile = mma ? 64 * (wg > 0 ? wg : mt) : PF_ROWS;
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
  a.q_stride = query_token_stride;
  a.out_stride = out_token_stride;
  a.num_blocks = geom->num_blocks;
  a.block_size = geom->block_size;
  a.max_blocks_per_seq = max_blocks_per_seq;
  a.table_tokens = table_tokens_i32(max_blocks_per_seq, geom->block_size);
  a.num_heads = params->num_heads;
  a.group = group;
  a.scale = params->scale;
  a.softcap = params->softcap;
  a.window = params->sliding_window;
  a.launch_flags = params->launch_flags;

  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int hkv = geom->num_kv_heads, tiles = (int)row_tiles;
#ifdef PKV_HAVE_WGMMA
  if (wg > 0)
    return launch_prefill_wgmma(a, geom->dtype, geom->head_dim, wg, ovl, persist, hkv, tiles,
                                num_seqs, s);
#endif
  switch (geom->dtype) {
    case PKV_DTYPE_F32:
      PKV_DISPATCH_HEAD_DIM(geom->head_dim,
                            { return launch_prefill<float, D>(a, hkv, tiles, num_seqs, s); });
      break;
    case PKV_DTYPE_F16:
      PKV_DISPATCH_HEAD_DIM(geom->head_dim, {
        return launch_prefill_mma_rows<__half, D>(a, hkv, tiles, num_seqs, mt, s);
      });
      break;
    case PKV_DTYPE_BF16:
      PKV_DISPATCH_HEAD_DIM(geom->head_dim, {
        return launch_prefill_mma_rows<__nv_bfloat16, D>(a, hkv, tiles, num_seqs, mt, s);
      });
      break;
    default:
      break;
  }
  return PKV_ERR_DTYPE;
}
