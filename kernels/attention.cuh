// attention.cuh: the paged attention kernel templates (decode arguments and contract, prefill).
// Instantiated per element type T and head dim D by the launchers in paged_attention.cu.
//
// Decode: the argument block lives here; the kernel bodies are decode_v2.cuh (partitions,
//   CUDA-core body, cross-warp merge, split merge) and decode_mma.cuh (the tensor-core body for
//   f16 / bf16 GQA). grid (num_kv_heads * head_chunks, num_seqs, num_splits): one block reads
//   the K and V of one KV head of one sequence over one partition of its context, once, for up
//   to 8 query heads of the group (16 in the tensor-core body for groups past 8 up to head dim
//   128). With one split the output is normalized and written
//   directly; with several, each split writes its unnormalized accumulator, max and sum to the
//   workspace, and the last block of the group to finish merges them (log-sum-exp rescaling)
//   in the same launch: one kernel per decode call whatever the split.
//
// THE DECODE CONTRACT (pkv_decode_plan in pagedkv.h; every decode kernel body obeys it, so a
// plan made once serves every launch of a captured CUDA graph):
//   * The host fixes, per plan: num_splits (grid z), the grid (num_kv_heads * head_chunks,
//     num_seqs, num_splits) with head_chunks = ceil(group / GT) and blockIdx.x = kh *
//     head_chunks + chunk, the dynamic shared memory (fixed per kernel instance: the bodies
//     keep nothing per token in shared memory) and the workspace layout. Nothing of it depends
//     on device memory or on per-step host values.
//   * The device derives each sequence's partitions (decode_seq_ctx, decode_part_len below):
//       ctx  = clamp(context_lens[s], 0, ctx_clamp)     ctx_clamp = min(max_context_capacity,
//                                                        max_blocks_per_seq * block_size)
//       part = round_up(ceil(max(ctx, 1) / num_splits), PKV_DECODE_PART_ALIGN)
//       split z covers tokens [z * part, min(ctx, (z + 1) * part)); keys below ctx - window
//       are masked. Any part fits any body: no partition length is limited.
//   * Query row of (sequence s, head h): query + s * q_stride + h * D elements; out likewise
//     with out_stride. Both strides are multiples of 16 bytes, so 16-byte vector access works.
//   * num_splits == 1: the block writes the normalized output of its heads (zeros when it has
//     nothing to attend: an empty or padding sequence, ctx 0).
//   * num_splits > 1: block (.., s, z) writes, for each of its heads h (row = s * num_heads +
//     h), tmp_out[row][z][0..D) = sum_t e^(logit_t - m) v_t (unnormalized), tmp_max[row][z] =
//     m and tmp_sum[row][z] = sum_t e^(logit_t - m); a partition with nothing to attend
//     (empty, or masked whole) writes tmp_max = -inf and tmp_sum = 0 and may leave tmp_out
//     unwritten. Every (row, z) of every launched sequence is written each launch, so stale
//     partials of an earlier replay are never read.
//   * Workspace (rows = num_seqs_capacity * num_heads, groups = num_seqs_capacity *
//     num_kv_heads * head_chunks): arrival counters u32 [groups] at byte 0 (plan
//     counter_bytes), tmp_out f32 [rows][num_splits][D] at the next 256-byte boundary, tmp_max
//     f32 [rows][num_splits] at the one after, tmp_sum likewise (decode_workspace_layout in
//     paged_attention.cu). The counters must be zero before a launch; every launch leaves them
//     zero (the caller zeroes them once, when the workspace is new or last served another
//     plan).
//   * Split merge (decode_split_arrive, then decode_finish_split[_weighted]): after a
//     barrier, thread 0 fences (publishing the block's partials) and adds one to the group's
//     counter (blockIdx.x of sequence s); the
//     block that brings it to num_splits is the last of the group: it fences, merges all
//     num_splits partials of each of its rows in a fixed order (a result independent of which
//     block finished last), skipping tmp_max == -inf (so it never reads an unwritten tmp_out)
//     and writing zeros when the total weight is 0, and resets the counter. Partials are read
//     through L2 (__ldcg): another SM wrote them in this launch.
//   * The split policy lives in one place, decode_plan (paged_attention.cu). Neither body
//     keeps per-token logits (both are online softmax), so no partition length is too long
//     and the plan has no floor on num_splits.
//
// Prefill (flash-attention style, f32 on CUDA cores):
//   grid (num_kv_heads, row_tiles, num_seqs), PF_THREADS threads. A row is one (query token,
//   query head of this KV head's group) pair; a thread block takes PF_ROWS rows, streams the
//   keys/values 0 ..= its last row's position through shared memory in tiles of PF_KEYS tokens,
//   and keeps an online softmax per row. Warp w owns rows w, w + 4, ...: it computes their
//   logits (lane = key), their running max/sum, and their accumulators (lane = dimension), so
//   a row's probabilities never leave the warp.
#pragma once

#include <climits>

#include "common.cuh"

namespace pkv {

constexpr int DEC_THREADS = 128;
constexpr int DEC_WARPS = DEC_THREADS / 32;

struct DecodeArgs {
  void *out;                     // device, row (s, h) at s * out_stride + h * D, T
  const void *query;             // device, row (s, h) at s * q_stride + h * D, T
  const void *cache;             // device, whole cache
  const int32_t *block_tables;   // device [num_seqs][max_blocks_per_seq]
  const int32_t *context_lens;   // device [num_seqs]
  const float *alibi_slopes;     // device [num_heads] or nullptr
  float *tmp_out;                // device [rows][num_splits][D] f32 (split; see the contract)
  float *tmp_max;                // device [rows][num_splits] f32 (split)
  float *tmp_sum;                // device [rows][num_splits] f32 (split)
  unsigned *counters;            // device [num_seqs_capacity][gridDim.x] u32 (split), zero
  Strides st;                    // st.block: the page stride
  int64_t layer_offset;          // layer * st.layer
  int64_t q_stride;              // elements between sequences' query rows (16-byte multiple)
  int64_t out_stride;            // elements between sequences' out rows (16-byte multiple)
  int32_t num_blocks;
  int32_t block_size;
  int32_t block_shift;           // log2(block_size): block sizes are powers of two
  int32_t max_blocks_per_seq;
  int32_t ctx_clamp;             // min(plan max_context_capacity, max_blocks_per_seq * block_size)
  int32_t num_heads;
  int32_t group;                 // num_heads / num_kv_heads
  int32_t head_chunks;           // ceil(group / GT)
  int32_t num_splits;
  float scale;
  float softcap;
  int32_t window;
  int32_t launch_flags;          // PKV_LAUNCH_* of the launch
};

// The contract's per-sequence context: context_lens[s] clamped to [0, ctx_clamp].
__device__ __forceinline__ int decode_seq_ctx(const int32_t *context_lens, int seq, int clamp) {
  return min(max(context_lens[seq], 0), clamp);
}

// The contract's partition length of a sequence of ctx tokens over num_splits splits, in 64
// bits: rounding a context near 2^31 up to the alignment passes INT_MAX (in int it wrapped
// negative, every split empty).
__host__ __device__ __forceinline__ int64_t decode_part_len(int ctx, int num_splits) {
  // In 32 bits wherever the sum cannot overflow (any context short of 2^31 - num_splits): a
  // 64-bit division is a long software routine on the GPU, on each block's way to its first load.
  const int c = ctx > 0 ? ctx : 1;
  const int64_t per = c <= INT_MAX - num_splits ? (c + num_splits - 1) / num_splits
                                                : ((int64_t)c + num_splits - 1) / num_splits;
  return (per + PKV_DECODE_PART_ALIGN - 1) / PKV_DECODE_PART_ALIGN * PKV_DECODE_PART_ALIGN;
}

// ---------------------------------------------------------------------------------------------
// Prefill.

constexpr int PF_THREADS = 128;
constexpr int PF_WARPS = PF_THREADS / 32;
constexpr int PF_ROWS = 32;  // (query token, head) rows per thread block
constexpr int PF_KEYS = 32;  // keys per shared-memory tile (== warp size: lane = key)
constexpr int PF_ROWS_PER_WARP = PF_ROWS / PF_WARPS;

struct PrefillArgs {
  void *out;                        // device, row (t, h) at t * out_stride + h * D, T
  const void *query;                // device, row (t, h) at t * q_stride + h * D, T
  const void *cache;                // device, whole cache
  const int32_t *block_tables;      // device [num_seqs][max_blocks_per_seq]
  const int32_t *context_lens;      // device [num_seqs]
  const int32_t *query_start_loc;   // device [num_seqs + 1]
  const float *alibi_slopes;        // device [num_heads] or nullptr
  Strides st;                       // st.block: the page stride
  int64_t layer_offset;
  int64_t q_stride;                 // elements between tokens' query rows (16-byte multiple)
  int64_t out_stride;               // elements between tokens' out rows (16-byte multiple)
  int32_t num_blocks;
  int32_t block_size;
  int32_t max_blocks_per_seq;
  int32_t table_tokens;             // table_tokens_i32(max_blocks_per_seq, block_size)
  int32_t num_heads;
  int32_t group;
  float scale;
  float softcap;
  int32_t window;
  int32_t launch_flags;          // PKV_LAUNCH_* of the launch (host side; kernels ignore it)
};

// Shared memory of prefill_kernel in floats: Q [ROWS][D], K [KEYS][D+1] (padded: lanes read
// one column of different rows), V [KEYS][D], P [ROWS][KEYS].
template <int D> constexpr size_t prefill_smem_bytes() {
  return sizeof(float) *
         ((size_t)PF_ROWS * D + (size_t)PF_KEYS * (D + 1) + (size_t)PF_KEYS * D + PF_ROWS * PF_KEYS);
}

template <typename T, int D>
__global__ void __launch_bounds__(PF_THREADS) prefill_kernel(const PrefillArgs a) {
  grid_dependency_entry();  // PKV_LAUNCH_PROGRAMMATIC: before any read
  constexpr int VEC = Elem<T>::VEC, CHUNKS = D / VEC;
  constexpr int DPL = (D + 31) / 32;  // dims per lane in the accumulator
  extern __shared__ float smem[];
  float *sq = smem;                            // [PF_ROWS][D]
  float *sk = sq + PF_ROWS * D;                // [PF_KEYS][D + 1]
  float *sv = sk + PF_KEYS * (D + 1);          // [PF_KEYS][D]
  float *sp = sv + PF_KEYS * D;                // [PF_ROWS][PF_KEYS]

  const int kh = blockIdx.x, tile = blockIdx.y, seq = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int q0 = a.query_start_loc[seq];
  const int qlen = a.query_start_loc[seq + 1] - q0;
  // Clamped to [0, table_tokens] (decode_seq_ctx's rule): a context near INT_MIN made
  // ctx - 1 and ctx - qlen wrap to ~2^31, walking the table row far past its end.
  const int ctx = min(max(a.context_lens[seq], 0), a.table_tokens);
  const int rows_total = qlen * a.group;
  const int rbase = tile * PF_ROWS;
  if (qlen <= 0 || rbase >= rows_total) return;
  const int nrows = min(PF_ROWS, rows_total - rbase);
  // Query token i (0-based in this sequence) sits at position ctx - qlen + i.
  const int first_pos = ctx - qlen + rbase / a.group;
  const int last_pos = ctx - qlen + (rbase + nrows - 1) / a.group;

  // Load Q rows (f32). Rows past nrows are zero and never written.
  const T *qg = reinterpret_cast<const T *>(a.query);
  for (int i = threadIdx.x; i < PF_ROWS * CHUNKS; i += PF_THREADS) {
    const int r = i / CHUNKS, c = i % CHUNKS;
    float f[VEC];
    if (r < nrows) {
      const int row = rbase + r;
      const int64_t qoff = (int64_t)(q0 + row / a.group) * a.q_stride +
                           (int64_t)(kh * a.group + row % a.group) * D;
      vec_to_f32<T>(ld_vec(qg + qoff + c * VEC), f);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) f[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) sq[r * D + c * VEC + e] = f[e];
  }

  // Per-row state of the rows this warp owns: r = warp + PF_WARPS * i.
  float m_run[PF_ROWS_PER_WARP], l_run[PF_ROWS_PER_WARP], slope[PF_ROWS_PER_WARP];
  int qpos[PF_ROWS_PER_WARP];
  float acc[PF_ROWS_PER_WARP][DPL];
#pragma unroll
  for (int i = 0; i < PF_ROWS_PER_WARP; ++i) {
    const int r = warp + PF_WARPS * i;
    const int row = rbase + r;
    m_run[i] = -INFINITY;
    l_run[i] = 0.f;
    qpos[i] = r < nrows ? ctx - qlen + row / a.group : -1;
    slope[i] = (r < nrows && a.alibi_slopes != nullptr)
                   ? a.alibi_slopes[kh * a.group + row % a.group] : 0.f;
#pragma unroll
    for (int k = 0; k < DPL; ++k) acc[i][k] = 0.f;
  }

  const T *cache = reinterpret_cast<const T *>(a.cache);
  const int32_t *btab = a.block_tables + (int64_t)seq * a.max_blocks_per_seq;
  const int64_t head_off = a.layer_offset + (int64_t)kh * D;
  const int kfirst = a.window > 0 ? max(0, first_pos - a.window + 1) : 0;
  const int klast = min(last_pos, ctx - 1);

  // Key positions compared as offsets from kt (j <= klast - kt): with klast near 2^31, kt + j
  // and kt + PF_KEYS would wrap negative, pass `<= klast` and read before the table row.
  for (int kt = kfirst; kt <= klast; kt = klast - kt < PF_KEYS ? klast + 1 : kt + PF_KEYS) {
    __syncthreads();  // the previous tile's K/V (and, first time, nothing) are consumed
    for (int i = threadIdx.x; i < PF_KEYS * CHUNKS; i += PF_THREADS) {
      const int j = i / CHUNKS, c = i % CHUNKS;
      const bool in = j <= klast - kt;
      const int t = in ? kt + j : 0;
      float kf[VEC], vf[VEC];
      int b = -1;
      if (in) b = btab[t / a.block_size];
      if (b >= 0 && b < a.num_blocks) {
        const T *p = cache + (int64_t)b * a.st.block + (int64_t)(t % a.block_size) * a.st.token +
                     head_off + c * VEC;
        vec_to_f32<T>(ld_vec(p), kf);
        vec_to_f32<T>(ld_vec(p + a.st.kv), vf);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) kf[e] = vf[e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        sk[j * (D + 1) + c * VEC + e] = kf[e];
        sv[j * D + c * VEC + e] = vf[e];
      }
    }
    __syncthreads();

    // Key of this lane for the logits.
    bool key_ok = lane <= klast - kt;
    const int t = key_ok ? kt + lane : 0;
    if (key_ok) {
      const int b = btab[t / a.block_size];
      key_ok = b >= 0 && b < a.num_blocks;
    }
#pragma unroll
    for (int i = 0; i < PF_ROWS_PER_WARP; ++i) {
      const int r = warp + PF_WARPS * i;
      float s = -INFINITY;
      if (qpos[i] >= 0 && key_ok) {
        float dot = 0.f;
#pragma unroll 8
        for (int d = 0; d < D; ++d) dot = fmaf(sq[r * D + d], sk[lane * (D + 1) + d], dot);
        s = attn_logit(dot, a.scale, a.softcap, slope[i], t, qpos[i], a.window);
      }
      const float m_new = fmaxf(m_run[i], warp_max(s));
      const float p = safe_exp(s, m_new);
      const float alpha = (m_run[i] == -INFINITY) ? 0.f : expf(m_run[i] - m_new);
      l_run[i] = l_run[i] * alpha + warp_sum(p);
      m_run[i] = m_new;
      sp[r * PF_KEYS + lane] = p;
#pragma unroll
      for (int k = 0; k < DPL; ++k) acc[i][k] *= alpha;
    }
    __syncwarp();  // this warp's P rows are written (and only this warp reads them)
#pragma unroll
    for (int i = 0; i < PF_ROWS_PER_WARP; ++i) {
      const int r = warp + PF_WARPS * i;
      if (qpos[i] < 0) continue;
#pragma unroll 4
      for (int j = 0; j < PF_KEYS; ++j) {
        const float p = sp[r * PF_KEYS + j];
#pragma unroll
        for (int k = 0; k < DPL; ++k) {
          const int d = lane + 32 * k;
          if (d < D) acc[i][k] = fmaf(p, sv[j * D + d], acc[i][k]);
        }
      }
    }
    __syncwarp();
  }

  T *og = reinterpret_cast<T *>(a.out);
#pragma unroll
  for (int i = 0; i < PF_ROWS_PER_WARP; ++i) {
    const int r = warp + PF_WARPS * i;
    if (r >= nrows) continue;
    const int row = rbase + r;
    const int64_t ooff = (int64_t)(q0 + row / a.group) * a.out_stride +
                         (int64_t)(kh * a.group + row % a.group) * D;
    const float inv = l_run[i] > 0.f ? 1.f / l_run[i] : 0.f;
#pragma unroll
    for (int k = 0; k < DPL; ++k) {
      const int d = lane + 32 * k;
      if (d < D) og[ooff + d] = Elem<T>::from_f32(acc[i][k] * inv);
    }
  }
}

}  // namespace pkv
