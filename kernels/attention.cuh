// attention.cuh: the paged attention kernel templates (decode, split-K reduce, prefill).
// Instantiated per element type T and head dim D by the launchers in paged_attention.cu.
//
// Decode (flash-decoding style, GQA-aware):
//   grid (num_kv_heads * head_chunks, num_seqs, num_splits), DEC_THREADS threads. One thread
//   block reads the K and V of ONE KV head of one sequence (over one partition of its context)
//   and serves up to GT query heads of that KV head's group with it, so each K/V byte is read
//   once per KV head, not once per query head as in vLLM's kernel. Pass 1 computes the GT
//   logits of every token of the partition into shared memory (T_PER_TOK lanes per token, each
//   with 16-byte loads, a shuffle reduction per token); pass 2 takes the max and the exp-sum
//   per head; pass 3 accumulates p * V with the same lane layout and reduces across lanes and
//   warps. With one split the output is normalized and written directly; with several, each
//   split writes its unnormalized accumulator, max and sum to the workspace and
//   decode_reduce_kernel merges them (log-sum-exp rescaling).
//
// THE DECODE CONTRACT (pkv_decode_plan in pagedkv.h; every decode kernel body obeys it, so a
// plan made once serves every launch of a captured CUDA graph):
//   * The host fixes, per plan: num_splits (grid z), the grid (num_kv_heads * head_chunks,
//     num_seqs, num_splits) with head_chunks = ceil(group / GT) and blockIdx.x = kh *
//     head_chunks + chunk, the dynamic shared memory (from DecodeArgs::part_cap, the most
//     tokens any partition can hold), the workspace layout and the reduce grid (num_heads,
//     num_seqs). Nothing of it depends on device memory or on per-step host values.
//   * The device derives each sequence's partitions (decode_seq_ctx, decode_part_len below):
//       ctx  = clamp(context_lens[s], 0, ctx_clamp)     ctx_clamp = min(max_context_capacity,
//                                                        max_blocks_per_seq * block_size)
//       part = round_up(ceil(max(ctx, 1) / num_splits), PKV_DECODE_PART_ALIGN)
//       split z covers tokens [z * part, min(ctx, (z + 1) * part)); keys below ctx - window
//       are masked. part <= part_cap whenever ctx <= max_context_capacity.
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
//   * Workspace (f32, rows = num_seqs_capacity * num_heads): tmp_out [rows][num_splits][D] at
//     byte 0, tmp_max [rows][num_splits] at the next 256-byte boundary, tmp_sum [rows]
//     [num_splits] at the one after (decode_workspace_layout in paged_attention.cu).
//   * decode_reduce_kernel merges all num_splits partials of a row, skipping tmp_max == -inf
//     (so it never reads an unwritten tmp_out), and writes zeros when the total weight is 0.
//   * The split policy lives in one place, decode_plan (paged_attention.cu). Its floor on
//     num_splits (decode_min_splits) is this body's: a partition's logits must fit its shared
//     memory. A body that keeps no per-token logits (an online softmax) can drop that floor
//     there; the launcher re-checks any plan against decode_min_splits.
//
// Prefill (flash-attention style, f32 on CUDA cores):
//   grid (num_kv_heads, row_tiles, num_seqs), PF_THREADS threads. A row is one (query token,
//   query head of this KV head's group) pair; a thread block takes PF_ROWS rows, streams the
//   keys/values 0 ..= its last row's position through shared memory in tiles of PF_KEYS tokens,
//   and keeps an online softmax per row. Warp w owns rows w, w + 4, ...: it computes their
//   logits (lane = key), their running max/sum, and their accumulators (lane = dimension), so
//   a row's probabilities never leave the warp.
#pragma once

#include "common.cuh"

namespace pkv {

constexpr int DEC_THREADS = 128;
constexpr int DEC_WARPS = DEC_THREADS / 32;

// Lane layout of one head row of D elements of T, shared by the decode passes.
template <typename T, int D> struct RowLayout {
  static constexpr int VEC = Elem<T>::VEC;            // elements per 16-byte chunk
  static constexpr int CHUNKS = D / VEC;              // 16-byte chunks per row
  static_assert(D % VEC == 0, "head_dim must be whole 16-byte vectors");
  // Lanes per token: the smallest of 8/16/32 that holds every chunk in <= 2 rounds.
  static constexpr int T_PER_TOK = CHUNKS <= 8 ? 8 : (CHUNKS <= 16 ? 16 : 32);
  static constexpr int NV = (CHUNKS + T_PER_TOK - 1) / T_PER_TOK;  // chunks per lane
  static constexpr int TOK_PER_WARP = 32 / T_PER_TOK;
  // Tokens a thread loads before using any: keeps ~64 bytes in flight per thread.
  static constexpr int UNROLL = NV == 1 ? 4 : 2;
  static constexpr int TOK_PER_ITER = DEC_WARPS * TOK_PER_WARP * UNROLL;
};

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
  Strides st;                    // st.block: the page stride
  int64_t layer_offset;          // layer * st.layer
  int64_t q_stride;              // elements between sequences' query rows (16-byte multiple)
  int64_t out_stride;            // elements between sequences' out rows (16-byte multiple)
  int32_t num_blocks;
  int32_t block_size;
  int32_t max_blocks_per_seq;
  int32_t ctx_clamp;             // min(plan max_context_capacity, max_blocks_per_seq * block_size)
  int32_t num_heads;
  int32_t group;                 // num_heads / num_kv_heads
  int32_t head_chunks;           // ceil(group / GT)
  int32_t part_cap;              // most tokens of one partition (logits row stride in smem)
  int32_t num_splits;
  float scale;
  float softcap;
  int32_t window;
};

// The contract's per-sequence context: context_lens[s] clamped to [0, ctx_clamp].
__device__ __forceinline__ int decode_seq_ctx(const int32_t *context_lens, int seq, int clamp) {
  return min(max(context_lens[seq], 0), clamp);
}

// The contract's partition length of a sequence of ctx tokens over num_splits splits.
__host__ __device__ __forceinline__ int decode_part_len(int ctx, int num_splits) {
  const int per = ceil_div(ctx > 0 ? ctx : 1, num_splits);
  return ceil_div(per, PKV_DECODE_PART_ALIGN) * PKV_DECODE_PART_ALIGN;
}

// The most tokens one partition holds over contexts up to `cap` (sizes the logits buffer).
__host__ __device__ __forceinline__ int decode_part_cap(int cap, int num_splits) {
  const int p = decode_part_len(cap, num_splits);
  const int c = cap > 0 ? cap : 1;
  return p < c ? p : c;
}

// Dynamic shared memory of decode_kernel: the logits [GT][part_cap], reused after pass 3 for
// the cross-warp accumulator reduction [DEC_WARPS][GT][D].
template <int GT, int D> inline size_t decode_smem_bytes(int part_cap) {
  size_t logits = (size_t)GT * (size_t)part_cap * sizeof(float);
  size_t red = (size_t)DEC_WARPS * GT * D * sizeof(float);
  return logits > red ? logits : red;
}

// Static shared memory of decode_kernel (s_max and s_sum below): it counts against the same
// 48 KiB as the dynamic part.
constexpr size_t decode_static_smem_bytes(int gt) { return 2 * (size_t)gt * sizeof(float); }

template <typename T, int D, int GT>
__global__ void __launch_bounds__(DEC_THREADS) decode_kernel(const DecodeArgs a) {
  using L = RowLayout<T, D>;
  constexpr int VEC = L::VEC, NV = L::NV, TPT = L::T_PER_TOK, U = L::UNROLL;
  extern __shared__ float smem[];
  __shared__ float s_max[GT], s_sum[GT];

  const int kh = blockIdx.x / a.head_chunks;
  const int g0 = (blockIdx.x % a.head_chunks) * GT;  // first head of the group served here
  const int ng = min(GT, a.group - g0);               // heads served here (>= 1)
  const int seq = blockIdx.y;
  const int split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tg = lane / TPT;  // token slot of this lane inside its warp
  const int li = lane % TPT;  // lane inside the token's lane group

  // The contract's device-derived partition (a context beyond the plan's capacity or the
  // block table row is clamped: memory safety).
  const int ctx = decode_seq_ctx(a.context_lens, seq, a.ctx_clamp);
  const int part = decode_part_len(ctx, a.num_splits);
  const int qpos = ctx - 1;
  const int start = split * part;
  const int end = min(ctx, start + part);
  const int wstart = a.window > 0 ? max(0, ctx - a.window) : 0;
  const int begin = max(start, wstart);  // tokens [begin, end) are read; others are masked
  const int h0 = kh * a.group + g0;                            // first head served here
  const int64_t row0 = (int64_t)seq * a.num_heads + h0;        // its workspace row
  // Its output row (single split), computed where used: keeping it live through the passes
  // costs registers.
  auto out_row = [&]() {
    return reinterpret_cast<T *>(a.out) + (int64_t)seq * a.out_stride + (int64_t)h0 * D;
  };
  const bool split_mode = a.num_splits > 1;

  if (begin >= end) {
    // Nothing to attend in this partition (or an empty / padding sequence).
    if (split_mode) {
      for (int g = threadIdx.x; g < ng; g += DEC_THREADS) {
        const int64_t r = (row0 + g) * a.num_splits + split;
        a.tmp_max[r] = -INFINITY;
        a.tmp_sum[r] = 0.f;
      }
    } else {
      T *const o = out_row();
      for (int i = threadIdx.x; i < ng * D; i += DEC_THREADS) o[i] = Elem<T>::from_f32(0.f);
    }
    return;
  }

  // Query chunks of this lane, f32, for each served head (zero for heads past ng).
  float q[GT][NV][VEC];
  float slope[GT];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    slope[g] = (a.alibi_slopes != nullptr && g < ng) ? a.alibi_slopes[kh * a.group + g0 + g] : 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = li + k * TPT;
      if (g < ng && c < L::CHUNKS) {
        const T *qp = reinterpret_cast<const T *>(a.query) + (int64_t)seq * a.q_stride +
                      (int64_t)(h0 + g) * D + c * VEC;
        vec_to_f32<T>(ld_vec(qp), q[g][k]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) q[g][k][e] = 0.f;
      }
    }
  }

  const T *cache = reinterpret_cast<const T *>(a.cache);
  const int32_t *btab = a.block_tables + (int64_t)seq * a.max_blocks_per_seq;
  const int64_t head_off = a.layer_offset + (int64_t)kh * D;
  // Element offset of the K row of token t (V is st.kv further), or -1 if its block id is
  // invalid (such a token is masked, never read).
  auto row_offset = [&](int t) -> int64_t {
    const int b = btab[t / a.block_size];
    if (b < 0 || b >= a.num_blocks) return -1;
    return (int64_t)b * a.st.block + (int64_t)(t % a.block_size) * a.st.token + head_off;
  };
  float *logits = smem;  // [GT][part_cap], index t - start

  // ---- pass 1: logits ----
  for (int base = begin + warp * L::TOK_PER_WARP; base < end; base += L::TOK_PER_ITER) {
    uint4 kv[U][NV];
    int64_t off[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = base + tg + u * DEC_WARPS * L::TOK_PER_WARP;
      off[u] = t < end ? row_offset(t) : -1;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int c = li + k * TPT;
        kv[u][k] = (off[u] >= 0 && c < L::CHUNKS) ? ld_stream(cache + off[u] + c * VEC)
                                                  : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = base + tg + u * DEC_WARPS * L::TOK_PER_WARP;
      float dot[GT];
#pragma unroll
      for (int g = 0; g < GT; ++g) dot[g] = 0.f;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        float kf[VEC];
        vec_to_f32<T>(kv[u][k], kf);
#pragma unroll
        for (int g = 0; g < GT; ++g)
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot[g] = fmaf(q[g][k][e], kf[e], dot[g]);
      }
#pragma unroll
      for (int g = 0; g < GT; ++g) dot[g] = group_sum<TPT>(dot[g]);
      if (li == 0 && t < end) {
#pragma unroll
        for (int g = 0; g < GT; ++g)
          if (g < ng)
            logits[g * a.part_cap + (t - start)] =
                off[u] >= 0 ? attn_logit(dot[g], a.scale, a.softcap, slope[g], t, qpos, a.window)
                            : -INFINITY;
      }
    }
  }
  __syncthreads();

  // ---- pass 2: max and exp-sum per head (warp w takes heads w, w + DEC_WARPS, ...) ----
  for (int g = warp; g < ng; g += DEC_WARPS) {
    float *lg = logits + g * a.part_cap;  // index t - start
    float m = -INFINITY;
    for (int t = begin + lane; t < end; t += 32) m = fmaxf(m, lg[t - start]);
    m = warp_max(m);
    float s = 0.f;
    for (int t = begin + lane; t < end; t += 32) {
      const float p = safe_exp(lg[t - start], m);
      lg[t - start] = p;
      s += p;
    }
    s = warp_sum(s);
    if (lane == 0) {
      s_max[g] = m;
      s_sum[g] = s;
    }
  }
  __syncthreads();

  // ---- pass 3: acc[g] = sum_t p[g][t] * V[t] ----
  float acc[GT][NV][VEC];
#pragma unroll
  for (int g = 0; g < GT; ++g)
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[g][k][e] = 0.f;

  for (int base = begin + warp * L::TOK_PER_WARP; base < end; base += L::TOK_PER_ITER) {
    uint4 vv[U][NV];
    int64_t off[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = base + tg + u * DEC_WARPS * L::TOK_PER_WARP;
      off[u] = t < end ? row_offset(t) : -1;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int c = li + k * TPT;
        vv[u][k] = (off[u] >= 0 && c < L::CHUNKS) ? ld_stream(cache + off[u] + a.st.kv + c * VEC)
                                                  : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = base + tg + u * DEC_WARPS * L::TOK_PER_WARP;
      if (off[u] < 0) continue;  // t >= end or invalid block: contributes nothing
      float p[GT];
#pragma unroll
      for (int g = 0; g < GT; ++g) p[g] = g < ng ? logits[g * a.part_cap + (t - start)] : 0.f;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        float vf[VEC];
        vec_to_f32<T>(vv[u][k], vf);
#pragma unroll
        for (int g = 0; g < GT; ++g)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g][k][e] = fmaf(p[g], vf[e], acc[g][k][e]);
      }
    }
  }

  // Reduce over the token slots of a warp (lanes li, li + TPT, ...).
#pragma unroll
  for (int o = TPT; o < 32; o <<= 1)
#pragma unroll
    for (int g = 0; g < GT; ++g)
#pragma unroll
      for (int k = 0; k < NV; ++k)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][k][e] += __shfl_xor_sync(0xffffffffu, acc[g][k][e], o);

  __syncthreads();  // every warp is done reading the logits: reuse smem
  float *red = smem;  // [DEC_WARPS][GT][D]
  if (tg == 0) {
#pragma unroll
    for (int g = 0; g < GT; ++g)
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int c = li + k * TPT;
        if (g < ng && c < L::CHUNKS)
#pragma unroll
          for (int e = 0; e < VEC; ++e) red[(warp * GT + g) * D + c * VEC + e] = acc[g][k][e];
      }
  }
  __syncthreads();

  for (int i = threadIdx.x; i < ng * D; i += DEC_THREADS) {
    const int g = i / D, d = i % D;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < DEC_WARPS; ++w) v += red[(w * GT + g) * D + d];
    if (split_mode) {
      const int64_t r = (row0 + g) * a.num_splits + split;
      a.tmp_out[r * D + d] = v;
      if (d == 0) {
        a.tmp_max[r] = s_max[g];
        a.tmp_sum[r] = s_sum[g];
      }
    } else {
      const float l = s_sum[g];
      out_row()[g * D + d] = Elem<T>::from_f32(l > 0.f ? v / l : 0.f);
    }
  }
}

// Merges the splits of decode_kernel: out = sum_s acc_s * e^(m_s - M) / sum_s l_s * e^(m_s - M)
// over every split whose m_s is finite (the contract: an empty partition has m_s = -inf and
// an unwritten acc_s). grid (num_heads, num_seqs), 128 threads; dynamic smem: num_splits
// floats (the weights).
template <typename T>
__global__ void __launch_bounds__(128) decode_reduce_kernel(
    void *out,                     // device, row (s, h) at s * out_stride + h * head_dim, T
    int64_t out_stride,            // elements between sequences' out rows
    const float *tmp_out,          // device [rows][num_splits][head_dim]
    const float *tmp_max,          // device [rows][num_splits]
    const float *tmp_sum,          // device [rows][num_splits]
    int num_heads, int head_dim, int num_splits) {
  extern __shared__ float w[];  // [num_splits]
  __shared__ float s_total;
  const int h = blockIdx.x, seq = blockIdx.y;
  const int64_t row = (int64_t)seq * num_heads + h;
  const float *m = tmp_max + row * num_splits;
  const float *l = tmp_sum + row * num_splits;
  if (threadIdx.x == 0) {
    float gm = -INFINITY;
    for (int s = 0; s < num_splits; ++s) gm = fmaxf(gm, m[s]);
    float total = 0.f;
    for (int s = 0; s < num_splits; ++s) {
      const float ws = (m[s] == -INFINITY) ? 0.f : expf(m[s] - gm);
      w[s] = ws;
      total += l[s] * ws;
    }
    s_total = total;
  }
  __syncthreads();
  const float total = s_total;
  T *o = reinterpret_cast<T *>(out) + (int64_t)seq * out_stride + (int64_t)h * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float v = 0.f;
    for (int s = 0; s < num_splits; ++s)
      if (w[s] != 0.f) v = fmaf(tmp_out[(row * num_splits + s) * head_dim + d], w[s], v);
    o[d] = Elem<T>::from_f32(total > 0.f ? v / total : 0.f);
  }
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
};

// Shared memory of prefill_kernel in floats: Q [ROWS][D], K [KEYS][D+1] (padded: lanes read
// one column of different rows), V [KEYS][D], P [ROWS][KEYS].
template <int D> constexpr size_t prefill_smem_bytes() {
  return sizeof(float) *
         ((size_t)PF_ROWS * D + (size_t)PF_KEYS * (D + 1) + (size_t)PF_KEYS * D + PF_ROWS * PF_KEYS);
}

template <typename T, int D>
__global__ void __launch_bounds__(PF_THREADS) prefill_kernel(const PrefillArgs a) {
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
  const int ctx = min(a.context_lens[seq], a.table_tokens);
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

  for (int kt = kfirst; kt <= klast; kt += PF_KEYS) {
    __syncthreads();  // the previous tile's K/V (and, first time, nothing) are consumed
    for (int i = threadIdx.x; i < PF_KEYS * CHUNKS; i += PF_THREADS) {
      const int j = i / CHUNKS, c = i % CHUNKS;
      const int t = kt + j;
      float kf[VEC], vf[VEC];
      int b = -1;
      if (t <= klast) b = btab[t / a.block_size];
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
    const int t = kt + lane;
    bool key_ok = t <= klast;
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
