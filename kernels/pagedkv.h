/*
 * pagedkv.h: the C ABI of every CUDA launcher in kernels/ -- the one source of truth that
 * build.rs feeds to bindgen (src/cuda_raw/ffi.rs) and that every .cu file implements.
 *
 * Plain C, no CUDA headers, so bindgen needs nothing but libclang.
 *
 * Conventions
 * - Every launcher returns a status: PKV_OK (0), a cudaError_t value (1 .. 9999) from the
 *   CUDA runtime (launch or copy failure), or one of the PKV_ERR_* argument errors below
 *   (>= 10000), detected before anything is launched.
 * - Launchers are asynchronous on `stream` (a cudaStream_t == CUstream; NULL is the legacy
 *   default stream) and never synchronize. They use the CUDA context current on the calling
 *   thread; src/cuda makes the device's primary context current first (the same context cudarc
 *   retains), so a stream and memory from cudarc are valid here.
 * - Every pointer argument states its memory space and shape. "device" pointers must be device
 *   memory of the current context (or managed memory); "host" pointers are read during the call
 *   only and may be freed when it returns.
 * - Element types: `dtype` is one of PKV_DTYPE_*; arithmetic is f32 whatever the storage type.
 *
 * KV cache layout (src/kv/layout.rs is the authoritative description): a model's cache is a
 * view of a byte arena of num_blocks pages, one block per page. `cache` arguments point at the
 * arena's base (page 0); page b starts geom->block_stride elements after page b - 1, and its
 * first num_layers * 2 * block_size * num_kv_heads * head_dim elements are the block:
 *     page b: [num_layers][2 (K then V)][block_size][num_kv_heads][head_dim], then padding
 * The padding (block_stride minus the block's own elements) is never read or written by any
 * launcher, so the same pages can hold another model's blocks of another geometry once freed.
 * A dense cache is the special case block_stride == the block's own elements.
 * A token at position p of a sequence lives in block block_table[p / block_size], row
 * p % block_size; its slot is block * block_size + p % block_size.
 *
 * Attention semantics (identical to src/attn/cpu.rs, the oracle), for query head qh (KV head
 * kh = qh / (num_heads / num_kv_heads)) at position qp and a key at position kp <= qp:
 *     s = scale * dot(q, k)
 *     if softcap > 0:            s = softcap * tanh(s / softcap)
 *     if alibi_slopes != NULL:   s += alibi_slopes[qh] * (kp - qp)
 *     the key is masked (excluded) if sliding_window > 0 and qp - kp >= sliding_window
 *     out = sum_k softmax(s)_k * v_k        (f32 softmax with the max subtracted)
 * A sequence with context_len <= 0 produces an all-zero output.
 */
#ifndef PAGEDKV_H
#define PAGEDKV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status codes (values 1 .. 9999 are cudaError_t codes) ---- */
#define PKV_OK 0
/** `dtype` is not one of PKV_DTYPE_*. */
#define PKV_ERR_DTYPE 10001
/** head_dim is not one of 64, 80, 96, 112, 128, 256. */
#define PKV_ERR_HEAD_DIM 10002
/** block_size (tokens per block) is not a power of two from 8 to 256. */
#define PKV_ERR_BLOCK_SIZE 10003
/** A size, index or count argument is out of range (negative, zero where not allowed, a
 *  layer >= num_layers, num_heads not a multiple of num_kv_heads, ...). */
#define PKV_ERR_INVALID_ARG 10004
/** The workspace passed to pkv_paged_attention_decode is missing, misaligned or smaller than
 *  its plan's workspace_bytes. */
#define PKV_ERR_WORKSPACE 10005
/** A required pointer is NULL. */
#define PKV_ERR_NULL_POINTER 10006
/** The page stride is smaller than one block: geom->block_stride < num_layers * 2 *
 *  block_size * num_kv_heads * head_dim elements (or, for pkv_swap_blocks, a page size below
 *  block_bytes), or the view's num_blocks pages overflow a 64-bit byte size. */
#define PKV_ERR_PAGE_STRIDE 10007
/** The page stride is not a whole number of 16-byte units, so pages (and the 16-byte vector
 *  loads of the kernels) would fall off the 16-byte grid. */
#define PKV_ERR_PAGE_ALIGN 10008
/** A query or out view of decode/prefill is off the 16-byte grid (its pointer, or its token
 *  stride in bytes, not a multiple of 16) or its token stride is smaller than a row
 *  (num_heads * head_dim elements), so rows would overlap. */
#define PKV_ERR_ROW_STRIDE 10009
/** The decode plan does not fit the launch: num_heads, num_kv_heads or head_dim differ from
 *  the plan's, num_seqs exceeds its capacity, or the plan itself is not one
 *  pkv_decode_plan_init could have made (num_splits out of range). */
#define PKV_ERR_PLAN 10010
/** Bytes every page stride must be a multiple of. */
#define PKV_PAGE_ALIGN 16

/* ---- element types ---- */
#define PKV_DTYPE_F32 0
#define PKV_DTYPE_F16 1
#define PKV_DTYPE_BF16 2

/* ---- decode partitioning (pkv_decode_plan_init's `mode`) ---- */
/** Choose the number of splits from the batch capacity and the SM count (the default): one
 *  split when num_seqs_capacity * num_kv_heads * head_chunks thread blocks already give every
 *  SM PKV_DECODE_CTAS_PER_SM of them (PKV_DECODE_CTAS_PER_SM_MHA for MHA), else enough splits
 *  to reach that many (partitions no shorter than PKV_DECODE_MIN_PART tokens, _MHA for MHA);
 *  for groups of
 *  2 and more, as many splits as fill every SM's resident thread blocks in one wave where the
 *  partitions stay at least PKV_DECODE_FILL_PART tokens; then, when that is more than one
 *  wave of resident thread blocks, up to 3 more splits where they leave a fuller last wave.
 *  head_chunks: ceil(group / 16) for groups past 8
 *  at head_dim <= 128 (the 16-head tensor-core blocks), else ceil(group / 8), and 1 for
 *  groups up to 4. */
#define PKV_DECODE_AUTO 0
/** Force one split (one pass per sequence and KV head, no split merge, no workspace), whatever
 *  the context capacity: the kernels keep nothing per token in shared memory. */
#define PKV_DECODE_SINGLE 1
/** Force split-K: max(2, ceil(max_context_capacity / PKV_DECODE_PARTITION)) splits, merged by
 *  the last block of each (sequence, head chunk) group in the same launch. */
#define PKV_DECODE_SPLIT 2
/** Exactly the caller's number of splits (pkv_decode_plan_init_splits): for a caller that
 *  tunes the partitioning itself, or measures it. */
#define PKV_DECODE_FIXED 3
/** Tokens per partition of PKV_DECODE_SPLIT at the context capacity. */
#define PKV_DECODE_PARTITION 512
/** Partition lengths are multiples of this many tokens (see pkv_decode_plan). */
#define PKV_DECODE_PART_ALIGN 16
/** PKV_DECODE_AUTO splits no further than partitions of this many tokens at capacity. */
#define PKV_DECODE_MIN_PART 32
/** The same for one query head per KV head (MHA). */
#define PKV_DECODE_MIN_PART_MHA 64
/** PKV_DECODE_AUTO fills every resident block slot (groups of 2 and more) only while the
 *  partitions at capacity are at least this many tokens. */
#define PKV_DECODE_FILL_PART 256
/** PKV_DECODE_AUTO's target: thread blocks per SM over all splits (groups of 2 and more). */
#define PKV_DECODE_CTAS_PER_SM 2
/** The same for one query head per KV head (MHA), whose blocks are lighter. */
#define PKV_DECODE_CTAS_PER_SM_MHA 4
/** Most splits of a plan (grid z). */
#define PKV_DECODE_MAX_SPLITS 4096

/** The geometry of one model's view of a paged KV arena (mirrors kv::KvCacheConfig). */
typedef struct pkv_cache_geometry {
  int32_t num_blocks;   /* pages the view spans from the `cache` base pointer */
  int32_t num_layers;
  int32_t block_size;   /* tokens per block: 8, 16, 32, 64, 128 or 256 */
  int32_t num_kv_heads;
  int32_t head_dim;     /* 64, 80, 96, 112, 128 or 256 */
  int32_t dtype;        /* PKV_DTYPE_* */
  /** Elements of `dtype` from one block to the next: the arena's page size / dtype size
   *  (kv::KvCacheConfig::block_stride). At least num_layers * 2 * block_size * num_kv_heads *
   *  head_dim (else PKV_ERR_PAGE_STRIDE), and block_stride * dtype size a multiple of
   *  PKV_PAGE_ALIGN bytes (else PKV_ERR_PAGE_ALIGN). */
  int64_t block_stride;
} pkv_cache_geometry;

/** Attention parameters shared by decode and prefill. */
typedef struct pkv_attn_params {
  /** Query heads; a positive multiple of num_kv_heads. */
  int32_t num_heads;
  /** Multiplies q.k (typically 1/sqrt(head_dim)); finite (else PKV_ERR_INVALID_ARG). */
  float scale;
  /** Logit soft-cap; <= 0 turns it off; finite (else PKV_ERR_INVALID_ARG). */
  float softcap;
  /** Sliding window in tokens; <= 0 turns it off. */
  int32_t sliding_window;
  /** device [num_heads] f32, or NULL for no ALiBi. */
  const float *alibi_slopes;
  /** PKV_LAUNCH_* bits (0: a plain launch); other bits are refused (PKV_ERR_INVALID_ARG). */
  int32_t launch_flags;
} pkv_attn_params;

/**
 * Programmatic dependent launch (compute capability 9.0 and later; elsewhere the bit changes
 * nothing): the attention launch may be scheduled while the kernel before it on the stream
 * still runs, so its launch and block dispatch overlap that kernel's tail instead of following
 * it. Every thread block waits at entry (griddepcontrol.wait) until that kernel has completed
 * and its memory is visible, before any read: the results are those of a plain launch. The
 * attention kernels and the cache ops (reshape_and_cache, copy_blocks) let their own dependents
 * launch as soon as all their blocks have started (griddepcontrol.launch_dependents at entry),
 * so reshape_and_cache followed by attention with this bit hides the attention launch behind
 * the cache write. Works inside stream capture
 * (the graph keeps a programmatic edge).
 */
#define PKV_LAUNCH_PROGRAMMATIC 1

/* The flag value 2 was PKV_LAUNCH_DECODE_L2_PREFETCH, an L2 prefetch in the decode bodies that
 * measured slower on an H100 (BENCHMARKS.md, session 14): removed; launches refuse it. */

/**
 * A decode plan: the partitioning of every decode launch made with it, fixed for a batch
 * capacity so that a captured decode step (a CUDA graph) replays with the same grid, shared
 * memory and workspace whatever the per-step context lengths are. Made by pkv_decode_plan_init;
 * plain data (copy it, keep it beside the captured graph).
 *
 * What the plan fixes and what the kernels derive on the device (the contract every decode
 * kernel body obeys; kernels/attention.cuh describes it in full):
 * - one kernel, grid (num_kv_heads * head_chunks, num_seqs, num_splits) (with several splits,
 *   the last block of each (sequence, head chunk) to finish merges its group's splits); num_seqs
 *   is the launch's (<= num_seqs_capacity), so a graph captured with num_seqs = capacity
 *   replays the same grid.
 * - sequence s's partitions come from context_lens[s] on the device: with ctx = context_lens[s]
 *   (clamped to [0, min(max_context_capacity, max_blocks_per_seq * block_size)]),
 *   part = round_up(ceil(max(ctx, 1) / num_splits), PKV_DECODE_PART_ALIGN) and split z covers
 *   tokens [z * part, min(ctx, (z + 1) * part)). An empty partition (or one the sliding window
 *   masks whole) contributes nothing; a sequence with ctx 0 (padding) gets an all-zero output.
 */
typedef struct pkv_decode_plan {
  /** PKV_DECODE_* the plan was made for. */
  int32_t mode;
  /** Most sequences of a launch (grid y); 1 .. 65535. */
  int32_t num_seqs_capacity;
  /** Query heads, KV heads and head dim every launch with the plan must have. */
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  /** Longest context of a launch: longer context_lens are clamped to it on the device (a wrong
   *  result, never an access outside the buffers). 1 .. 2^31 - 1. */
  int32_t max_context_capacity;
  /** Splits per sequence (grid z), 1 .. PKV_DECODE_MAX_SPLITS. */
  int32_t num_splits;
  /** Device workspace a launch needs, bytes (0 when num_splits == 1). */
  uint64_t workspace_bytes;
  /** The workspace's first counter_bytes (0 when num_splits == 1) are the split merge's
   *  arrival counters: zero them (cudaMemsetAsync) before the first launch with this plan, and
   *  again whenever the workspace last served another plan; every launch leaves them zero. */
  uint64_t counter_bytes;
} pkv_decode_plan;

/**
 * Makes a decode plan for launches of at most `num_seqs_capacity` sequences whose contexts are
 * at most `max_context_capacity` tokens, with `mode` (PKV_DECODE_*) and, for PKV_DECODE_AUTO,
 * the device's `sm_count` (<= 0: ask the device current on this thread), for f16 / bf16 caches
 * (pkv_decode_plan_init_dtype: any). Host only: no launch,
 * no allocation (the SM query excepted); cheap enough to call per launch (what an eager caller
 * does).
 *
 * plan     host, written on success only
 * Returns PKV_ERR_INVALID_ARG for a non-positive size, num_heads not a multiple of
 * num_kv_heads, num_seqs_capacity above 65535, a capacity needing more than
 * PKV_DECODE_MAX_SPLITS splits, or mode PKV_DECODE_FIXED (pkv_decode_plan_init_splits makes
 * those); PKV_ERR_HEAD_DIM for an unsupported head_dim; a cudaError_t if the SM query fails.
 */
int pkv_decode_plan_init(pkv_decode_plan *plan, int32_t mode, int32_t num_seqs_capacity,
                         int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                         int32_t max_context_capacity, int32_t sm_count);

/**
 * pkv_decode_plan_init for caches of `dtype` (PKV_DTYPE_*, else PKV_ERR_DTYPE): Auto sizes its
 * splits by the resident thread blocks of the kernel body that dtype runs (f32 caches run
 * CUDA-core bodies that fit fewer blocks per SM than the f16 / bf16 tensor-core ones
 * pkv_decode_plan_init assumes). A plan made for one dtype is valid for a launch of another
 * (only its speed may suffer).
 */
int pkv_decode_plan_init_dtype(pkv_decode_plan *plan, int32_t mode, int32_t dtype,
                               int32_t num_seqs_capacity, int32_t num_heads, int32_t num_kv_heads,
                               int32_t head_dim, int32_t max_context_capacity, int32_t sm_count);

/**
 * As pkv_decode_plan_init, with exactly `num_splits` splits (mode PKV_DECODE_FIXED): host only,
 * no device query. Returns PKV_ERR_INVALID_ARG for num_splits outside 1 ..=
 * PKV_DECODE_MAX_SPLITS and for what pkv_decode_plan_init refuses.
 */
int pkv_decode_plan_init_splits(pkv_decode_plan *plan, int32_t num_splits,
                                int32_t num_seqs_capacity, int32_t num_heads,
                                int32_t num_kv_heads, int32_t head_dim,
                                int32_t max_context_capacity);

/**
 * Decode attention: one new query token per sequence, attending to its whole context
 * (context_lens[s] tokens, the new one included, already written to the cache by
 * pkv_reshape_and_cache), partitioned as `plan` says. GQA-aware: one thread block serves the
 * query heads of one KV head (up to 8 of them; up to 16 for f16 / bf16 with head_dim <= 128),
 * so each K/V byte is read once per KV head (once per 8 or 16 query heads of larger groups).
 * The grid, the shared memory and the workspace used depend on `plan` and `num_seqs` only,
 * never on the contents of device memory: the launch can be captured in a CUDA graph and
 * replayed after context_lens / block_tables / query change in place.
 *
 * out           device, row s ([num_heads][head_dim], geom->dtype) at out + s * out_token_stride
 *               elements, s < num_seqs; every element of those rows written
 * out_token_stride    elements between two sequences' out rows: >= num_heads * head_dim, and
 *               a multiple of 16 bytes (as `out` itself)
 * query         device, row s ([num_heads][head_dim], geom->dtype) at query + s *
 *               query_token_stride elements: a dense [num_seqs][num_heads][head_dim] tensor, or
 *               the q part of a fused QKV projection ([q heads | k heads | v heads] per token)
 * query_token_stride  elements between two sequences' query rows: >= num_heads * head_dim, a
 *               multiple of 16 bytes (as `query` itself); rows may not overlap `out`
 * cache         device, the arena's base (layout above: geom->num_blocks pages of
 *               geom->block_stride elements), geom->dtype, 16-byte aligned
 * geom          host
 * layer         0 <= layer < geom->num_layers
 * block_tables  device [num_seqs][max_blocks_per_seq] i32 physical block ids; entries past a
 *               sequence's ceil(context_len / block_size) are not read; an id outside
 *               0 .. num_blocks - 1 masks its tokens (never read)
 * context_lens  device [num_seqs] i32; each at most plan->max_context_capacity and
 *               max_blocks_per_seq * block_size (longer ones are clamped); <= 0 is an empty
 *               sequence (zero output)
 * num_seqs      0 .. plan->num_seqs_capacity (0: nothing launched; above: PKV_ERR_PLAN)
 * plan          host, from pkv_decode_plan_init with num_heads == params->num_heads,
 *               num_kv_heads == geom->num_kv_heads and head_dim == geom->head_dim (else
 *               PKV_ERR_PLAN)
 * params        host
 * workspace     device scratch of workspace_bytes >= plan->workspace_bytes, 16-byte aligned
 *               (may be NULL when that is 0; else PKV_ERR_WORKSPACE). Its first
 *               plan->counter_bytes must be zero (see pkv_decode_plan) and are left zero; the
 *               rest needs no initialization and is left undefined
 */
int pkv_paged_attention_decode(void *out, int64_t out_token_stride, const void *query,
                               int64_t query_token_stride, const void *cache,
                               const pkv_cache_geometry *geom, int32_t layer,
                               const int32_t *block_tables, int32_t max_blocks_per_seq,
                               const int32_t *context_lens, int32_t num_seqs,
                               const pkv_decode_plan *plan, const pkv_attn_params *params,
                               void *workspace, size_t workspace_bytes, void *stream);

/**
 * Prefill (chunked) attention, varlen and causal: sequence s has q_len = query_start_loc[s+1]
 * - query_start_loc[s] new query tokens, which are the LAST q_len of its context_lens[s]
 * tokens (their K/V already in the cache). Query token i of s sits at position
 * context_lens[s] - q_len + i and attends to cached positions 0 ..= that position.
 *
 * out              device, row t ([num_heads][head_dim], geom->dtype) at out + t *
 *                  out_token_stride elements, t < num_tokens = query_start_loc[num_seqs];
 *                  every row of a listed sequence written
 * out_token_stride    elements between two tokens' out rows: >= num_heads * head_dim and a
 *                  multiple of 16 bytes (as `out` itself)
 * query            device, row t ([num_heads][head_dim], geom->dtype) at query + t *
 *                  query_token_stride elements (dense, or the q part of a fused QKV row)
 * query_token_stride  elements between two tokens' query rows: >= num_heads * head_dim and a
 *                  multiple of 16 bytes (as `query` itself); rows may not overlap `out`
 * cache            device, the arena's base (layout above), geom->dtype, 16-byte aligned
 * geom             host
 * layer            0 <= layer < geom->num_layers
 * block_tables     device [num_seqs][max_blocks_per_seq] i32
 * context_lens     device [num_seqs] i32, each >= its q_len
 * query_start_loc  device [num_seqs + 1] i32, non-decreasing, starting at 0
 * num_seqs         host, 0 .. 65535 (grid z)
 * max_query_len    host: an upper bound of every q_len (sizes the grid); the launch's row
 *                  tiles, ceil(max_query_len * (num_heads / num_kv_heads) / rows) with rows
 *                  64 or 128 (f16 / bf16, per tiling) or 32 (f32), at most 65535 (grid y),
 *                  else PKV_ERR_INVALID_ARG
 * params           host
 */
int pkv_paged_attention_prefill(void *out, int64_t out_token_stride, const void *query,
                                int64_t query_token_stride, const void *cache,
                                const pkv_cache_geometry *geom, int32_t layer,
                                const int32_t *block_tables, int32_t max_blocks_per_seq,
                                const int32_t *context_lens, const int32_t *query_start_loc,
                                int32_t num_seqs, int32_t max_query_len,
                                const pkv_attn_params *params, void *stream);

/* ---- prefill tilings (pkv_paged_attention_prefill_tiled's `tiling`) of the f16 / bf16
 * kernel; f32 has one kernel and runs it whatever is asked ---- */
/** The library's choice (pkv_prefill_tiling_choice says which): on compute capability 9.0,
 *  PKV_PREFILL_TILING_WGMMA128 where its thread blocks cover half the SMs, else _WGMMA; off
 *  it, PKV_PREFILL_TILING_WARP32 where its blocks fill the device, else _WARP16. */
#define PKV_PREFILL_TILING_AUTO 0
/** One m16 tile per warp (mma.sync), 64 rows per thread block; every head dim. */
#define PKV_PREFILL_TILING_WARP16 16
/** Two m16 tiles per warp (mma.sync), 128 rows per thread block: each K / V fragment loaded
 *  from shared memory feeds two tensor-core instructions. Head dims up to 128; 256 runs
 *  PKV_PREFILL_TILING_WARP16, and so does head dim 128 on a device whose blocks may not opt in
 *  to its 105,984 bytes of shared memory (99 KiB: compute capability 8.6, 8.9, 12.x). */
#define PKV_PREFILL_TILING_WARP32 32
/** Hopper's warpgroup instruction (wgmma, reading K and V straight from shared memory), one
 *  warpgroup of 64 rows per thread block: on a device of compute capability 9.0 in a build
 *  with sm_90 among its targets, at head dims up to 128; anywhere else
 *  PKV_PREFILL_TILING_WARP16. */
#define PKV_PREFILL_TILING_WGMMA 64
/** The same with two warpgroups (128 rows) per thread block sharing each K / V tile copied
 *  from L2 (half the copies per query row). */
#define PKV_PREFILL_TILING_WGMMA128 128
/** PKV_PREFILL_TILING_WGMMA and _WGMMA128 with the overlapped schedule: a tile's softmax runs
 *  while the previous tile's P V is on the tensor cores (kernels/prefill_wgmma.cuh). */
#define PKV_PREFILL_TILING_WGMMA_OVERLAP 65
#define PKV_PREFILL_TILING_WGMMA128_OVERLAP 129
/** PKV_PREFILL_TILING_WGMMA128 as a persistent grid (kernels/prefill_wgmma_persist.cuh): one
 *  thread block per resident slot (the SMs times the blocks per SM), each running its share of
 *  the 128-row tiles back to back, the next one's Q, first key tile and row addresses copied
 *  while the current one's last tiles compute. Head dims 80-128; at 64, _WGMMA128 (two of its
 *  blocks per SM hide each other's prologues; this kernel would spill at their registers). */
#define PKV_PREFILL_TILING_WGMMA128_PERSISTENT 130

/**
 * pkv_paged_attention_prefill with the f16 / bf16 kernel's tiling chosen: `tiling` is one of
 * PKV_PREFILL_TILING_* (else PKV_ERR_INVALID_ARG). Results agree up to the cache type's
 * rounding (the tensor-core tilings round P to f16 / bf16 before P V, relative to a running
 * maximum that depends on the tiling): where the key tiles start (under a sliding window) and
 * which tiles take the scale-only path depend on the rows a thread block holds, and the
 * instructions' summation order on the tiling.
 */
int pkv_paged_attention_prefill_tiled(void *out, int64_t out_token_stride, const void *query,
                                      int64_t query_token_stride, const void *cache,
                                      const pkv_cache_geometry *geom, int32_t layer,
                                      const int32_t *block_tables, int32_t max_blocks_per_seq,
                                      const int32_t *context_lens,
                                      const int32_t *query_start_loc, int32_t num_seqs,
                                      int32_t max_query_len, const pkv_attn_params *params,
                                      int32_t tiling, void *stream);

/**
 * The tiling a pkv_paged_attention_prefill_tiled launch of this shape runs for `tiling` (one
 * of PKV_PREFILL_TILING_*), written to *chosen: one of PKV_PREFILL_TILING_WARP16, _WARP32,
 * _WGMMA, _WGMMA128, _WGMMA_OVERLAP, _WGMMA128_OVERLAP, _WGMMA128_PERSISTENT, or
 * PKV_PREFILL_TILING_AUTO (0) for an
 * f32 cache, whose one kernel has no tilings. A tiling the launch cannot run is WARP16 (WARP32
 * above head dim 128 or above the current device's opt-in shared memory per block; the wgmma
 * ones without an sm_90 build, off a compute capability 9.0 device, or above head dim 128).
 *
 * Auto counts the 128-row thread blocks a launch has, num_kv_heads x ceil(max_query_len x
 * group / 128) x num_seqs. Where the wgmma kernel runs (f16 / bf16, head dim up to 128,
 * compute capability 9.0): WGMMA128 where they are at least half of sm_count (one such block
 * per SM, two at d64), else WGMMA (H100, bf16 d128: WGMMA128 115-134% of dense SDPA's speed
 * at every chunk over cached tokens, 1.2-1.8x faster than WARP32; over none within 2% of the
 * fastest tiling). Elsewhere: WARP32 where they are at least sm_count x 2 (the blocks per SM its registers allow up to
 * head dim 128), else WARP16 (with fewer blocks than slots, 128 rows per block leave SMs idle
 * that 64 would use; H100: chunks of 2048 run 1.29-1.33x faster at WARP32, chunks of 512
 * 1.10-1.43x slower). BENCHMARKS.md has the grid.
 *
 * sm_count <= 0: the device current on this thread is asked. Where WARP32's shared memory
 * passes 99 KiB (head dim 128), that device is asked whether a block may opt in to it, whatever
 * sm_count (a failed query counts as yes). Host only, no launch.
 * Returns PKV_ERR_NULL_POINTER, PKV_ERR_INVALID_ARG (an unknown tiling, a non-positive size
 * or num_heads not a multiple of num_kv_heads; num_seqs or max_query_len may be 0),
 * PKV_ERR_HEAD_DIM, PKV_ERR_DTYPE, or a cudaError_t if a device query fails; *chosen is
 * written on success only.
 */
int pkv_prefill_tiling_choice(int32_t *chosen, int32_t tiling, int32_t dtype, int32_t num_heads,
                              int32_t num_kv_heads, int32_t head_dim, int32_t num_seqs,
                              int32_t max_query_len, int32_t sm_count);

/** Counts pkv_wgmma_layout_probe writes. */
#define PKV_WGMMA_PROBE_COUNTS 10

/**
 * Checks on the current device the shared-memory and fragment layouts the wgmma prefill kernel
 * (PKV_PREFILL_TILING_WGMMA) is written for, one m64n64k16 per layout. Asynchronous on
 * `stream`; writes PKV_WGMMA_PROBE_COUNTS counts of wrong accumulator elements (of 4096) to
 * device `mismatches`: [0..3] the no-swizzle layouts, [K-major, K-major with the descriptor's
 * two byte offsets exchanged, MN-major, MN-major exchanged] (the reading is right where [0] and
 * [2] are 0 and [1], [3] are not); [4..9] the swizzled layouts the kernel stores K and V in,
 * [K-major, MN-major] for the 128-, 64- and 32-byte swizzles (all 0 where right). A device
 * other than compute capability 9.0, or a build without sm_90, has no image for it
 * (cudaErrorNoKernelImageForDevice).
 */
int pkv_wgmma_layout_probe(int32_t *mismatches, void *stream);

/**
 * Writes the K and V of `num_tokens` new tokens into their cache slots. Slot -1 is padding and
 * skipped; slots must be < num_blocks * block_size and distinct (the kernel does not check:
 * an out-of-range slot is skipped, not written).
 *
 * cache         device, the arena's base (layout above), geom->dtype, 16-byte aligned;
 *               only the block part of each page is written
 * key           device, row t at key + t * key_token_stride elements: [num_kv_heads][head_dim]
 * value         device, row t at value + t * value_token_stride elements, same shape
 * slot_mapping  device [num_tokens] i64
 * key_token_stride, value_token_stride  elements between tokens (>= num_kv_heads * head_dim
 *               for a dense tensor; a multiple of 16 bytes / element size keeps the
 *               vectorized path)
 */
int pkv_reshape_and_cache(void *cache, const pkv_cache_geometry *geom, int32_t layer,
                          const void *key, const void *value, int64_t key_token_stride,
                          int64_t value_token_stride, const int64_t *slot_mapping,
                          int32_t num_tokens, void *stream);

/**
 * Copies whole blocks (every layer, K and V) inside the cache, all pairs in one launch
 * (copy-on-write). Destinations must be distinct and not also sources in the same call. Each
 * copy moves the block's own bytes (num_layers * 2 * block_size * num_kv_heads * head_dim
 * elements) from page src to page dst; the pages' padding is left as it is.
 *
 * cache      device, the arena's base (layout above), 16-byte aligned
 * geom       host
 * pairs      device [num_pairs][2] i32: (src block, dst block); an out-of-range pair is skipped
 */
int pkv_copy_blocks(void *cache, const pkv_cache_geometry *geom, const int32_t *pairs,
                    int32_t num_pairs, void *stream);

/**
 * Swaps blocks between the device arena and a host swap space of the same block shape, in one
 * call. Each block is block_bytes bytes at the start of its page on either side; the pages may
 * have different sizes (a model's view of the arena has the arena's page size, the swap space
 * is usually dense). Pairs continuing a run of consecutive blocks on both sides are merged into
 * one cudaMemcpyAsync of (n - 1) * page + block_bytes bytes when both page sizes are equal (the
 * padding between the run's blocks belongs to pages of the run on both sides); with different
 * page sizes every block is its own copy. Host memory must be pinned (page-locked) for the
 * copies to be asynchronous and at full PCIe bandwidth.
 *
 * dst, src           the destination and source bases (device arena -> host swap space for
 *                    swap-out, the reverse for swap-in; pinned by pkv_host_register, say)
 * dst_page_bytes, src_page_bytes  bytes from one block to the next on each side: at least
 *                    block_bytes (else PKV_ERR_PAGE_STRIDE) and multiples of PKV_PAGE_ALIGN
 *                    (else PKV_ERR_PAGE_ALIGN)
 * block_bytes        bytes per block (kv::KvCacheConfig::bytes_per_block), > 0
 * pairs              host [num_pairs][2] i64 (src block, dst block), validated by the caller
 *                    (in range of each side; a negative index anywhere is PKV_ERR_INVALID_ARG,
 *                    before any copy is queued; a cudaError status may follow queued copies)
 * to_host            1: device -> host (swap out); 0: host -> device (swap in)
 */
int pkv_swap_blocks(void *dst, size_t dst_page_bytes, const void *src, size_t src_page_bytes,
                    size_t block_bytes, const int64_t *pairs, int32_t num_pairs, int32_t to_host,
                    void *stream);

/**
 * Page-locks (pins) the `bytes` of host memory at `ptr` for every device context
 * (cudaHostRegisterPortable), so that pkv_swap_blocks' copies to and from it are asynchronous
 * DMA at full PCIe bandwidth instead of staged, host-blocking copies of pageable memory. Needs a
 * current context (the caller binds its device first). On failure (too much locked memory, say)
 * the memory stays pageable and usable, and the runtime's last error is cleared, so the next
 * launch's status is not this call's.
 *
 * ptr, bytes   host memory the caller allocated (not already registered), bytes > 0
 * Returns PKV_OK, PKV_ERR_NULL_POINTER / PKV_ERR_INVALID_ARG for a null pointer or 0 bytes, or
 * the runtime's cudaError_t.
 */
int pkv_host_register(void *ptr, size_t bytes);

/**
 * Unpins memory pinned by pkv_host_register (before it is freed; no queued copy may still use
 * it). Needs a current context; clears the runtime's last error on failure, as above.
 * Returns PKV_OK, PKV_ERR_NULL_POINTER, or the runtime's cudaError_t (e.g. not registered).
 */
int pkv_host_unregister(void *ptr);

/**
 * Checks that the runtime works on the current device and that this build holds a kernel image
 * for it. Writes the runtime version (e.g. 13000), the device's compute capability (major * 10 +
 * minor) and its SM count. Synchronous, cheap; returns a cudaError_t such as
 * cudaErrorNoKernelImageForDevice (209) when the device is too old for the embedded code.
 *
 * runtime_version, compute_capability, sm_count   host, one int32 each
 */
int pkv_probe(int32_t *runtime_version, int32_t *compute_capability, int32_t *sm_count);

/** The CUDA runtime's name for a status (a static string), or a description of a PKV_ERR_*. */
const char *pkv_status_string(int status);

#ifdef __cplusplus
}
#endif

#endif /* PAGEDKV_H */

/* ==== GGUF device dequantization (kernels/dequant.cu) ========================================
 * A section of its own (own include guard, own extern "C"), after the attention ABI above. */
#ifndef PAGEDKV_DEQUANT_H
#define PAGEDKV_DEQUANT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ggml type ids (GGUF's tensor type field) that pkv_dequantize converts. */
#define PKV_GGML_F32 0
#define PKV_GGML_F16 1
#define PKV_GGML_Q4_0 2
#define PKV_GGML_Q8_0 8
#define PKV_GGML_Q4_K 12
#define PKV_GGML_Q6_K 14
#define PKV_GGML_BF16 30

/** 1 if pkv_dequantize converts ggml type `ggml_type` (one of PKV_GGML_*), else 0. */
int pkv_dequant_supported(int32_t ggml_type);

/**
 * Dequantizes one run of ggml blocks into f16 or bf16, asynchronously on `stream`.
 *
 * Result, bit for bit: src/gguf/dequant.rs's dequantize_into_f16 / dequantize_into_bf16 of the
 * same bytes. That is, each value is computed in f32 exactly as ggml's dequantize_row_* does it
 * (the same operations in the same order, each rounded once: never fused into an FMA), then
 * rounded to nearest even into the output type; every NaN result is written as the canonical
 * quiet NaN, 0x7E00 (f16) or 0x7FC0 (bf16), whatever its sign and payload (IEEE 754 leaves the
 * payload of an operation's NaN to the implementation: a CPU keeps an operand's, a GPU returns
 * its own). Infinities and signed zeros are kept.
 *
 * dst          device [n_elements] of dst_dtype, 16-byte aligned; every element written
 * dst_dtype    PKV_DTYPE_F16 or PKV_DTYPE_BF16 (else PKV_ERR_DTYPE)
 * src          device, the n_elements / block elements blocks of ggml_type, as stored in a GGUF
 *              file, 16-byte aligned
 * ggml_type    PKV_GGML_* (else PKV_ERR_DTYPE)
 * n_elements   >= 0 and a whole number of blocks (32 for Q4_0 / Q8_0, 256 for Q4_K / Q6_K)
 *              (else PKV_ERR_INVALID_ARG); 0 launches nothing
 * Misaligned src or dst: PKV_ERR_INVALID_ARG; NULL with n_elements > 0: PKV_ERR_NULL_POINTER.
 * src and dst must not overlap.
 */
int pkv_dequantize(void *dst, int32_t dst_dtype, const void *src, int32_t ggml_type,
                   int64_t n_elements, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* PAGEDKV_DEQUANT_H */
