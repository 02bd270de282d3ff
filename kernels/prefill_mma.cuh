// prefill_mma.cuh: prefill attention on tensor cores for f16 / bf16 caches (FlashAttention-2
// style); f32 keeps the CUDA-core prefill_kernel of attention.cuh. Same arguments (PrefillArgs)
// and semantics (pagedkv.h, the CPU oracle src/attn/cpu.rs).
//
// Layout of the work:
//   grid (num_kv_heads, row_tiles, num_seqs), 4 warps. A row is one (query token, query head of
//   this KV head's group) pair, rows of one token adjacent (r -> token r / group, head r %
//   group), so every head of a GQA group shares the K/V tiles the thread block stages: each
//   K/V byte is read once per 64 rows, whatever the group size. A thread block takes 64 rows,
//   warp w rows 16w .. 16w + 15 (one m16 tile). Row tiles run last-first (blockIdx.y reversed):
//   under the causal mask the last rows see the most keys, so the longest blocks start first.
//   Keys are streamed through shared memory in tiles of BC tokens (64; 32 at head dim 256),
//   double-buffered: tile j + 1 is copied (cp.async on the GPU, plain 16-byte copies in the
//   emulation) while tile j is computed. Per tile and warp:
//     S = Q K^T      mma.m16n8k16, f32 accumulators; Q fragments in registers (head dim <=
//                    128) or re-read from shared memory (256); K fragments by ldmatrix
//     s -> the oracle's transform (scale, soft-cap, ALiBi, causal + window + invalid-block
//                    mask), in log2 units
//     online softmax per row: running max m and sum l; O rescaled by 2^(m_old - m_new)
//     O += P V       P rounded to T from the S accumulators in registers (the accumulator
//                    layout of two n8 tiles is the A fragment of one k16 step), V fragments
//                    by ldmatrix.trans
//   The row sums l are kept per lane and reduced over the 4 lanes of a row once, at the end.
//   A warp skips the tiles none of its rows can see (past its last row under the causal mask,
//   before its first row's window): the diagonal tiles cost only the warps that need them.
//   The block setup, Q staging, logit transform, online softmax and epilogue are functions
//   (PrefillBlock, TableAhead, stage_q, tile_kind, causal_tile, mask_tile, softmax_tile,
//   rescale_tile, store_tile, store_tile_staged) that the wgmma kernels (prefill_wgmma.cuh,
//   prefill_wgmma_persist.cuh) share.
//
// Shared memory (T elements, rows padded by 8 elements = 16 bytes so that the 8 row addresses
// of an ldmatrix fall in 8 different 4-bank groups at every supported head dim):
//   stage s (s = 0, 1): K [BC][LD], V [BC][LD];  then Q [64][LD] (head dim 256 only; below, Q
//   is staged in stage 1 before its first use and lives in registers after);  then the key
//   validity flags [2][BC] int and the K row addresses [2][BC] (key_rows).
#pragma once

#include "attention.cuh"
#include "mma.cuh"

namespace pkv {
namespace pfmma {

constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr float LOG2E = 1.4426950408889634f;

// MT: m16 tiles per warp (1 or 2). With 2, every K / V fragment a warp loads from shared memory
// feeds two mma instead of one (ldmatrix bytes per mma: 256 -> 160 at d128, Q re-read per tile),
// for twice the accumulator registers; head dims up to 128 only (d256 would need 256 for O).
template <int D, int MT> struct Cfg {
  static_assert(MT == 1 || (MT == 2 && D <= 128), "two m-tiles per warp up to head dim 128");
  static constexpr int ROWS = 16 * WARPS * MT;     // rows per thread block
  static constexpr int WROWS = 16 * MT;            // rows per warp
  static constexpr int BC = D <= 128 ? 64 : 32;  // keys per tile
  static constexpr int LD = D + 8;                // shared row stride, elements
  static constexpr int CH = D / 8;                // 16-byte chunks per row
  static constexpr int KSTEPS = D / 16;           // k16 steps of Q K^T
  static constexpr int NT_S = BC / 8;             // n8 tiles of S per warp
  static constexpr int NT_O = D / 8;              // n8 tiles of O per warp
  // Q fragments stay in registers while they take at most 32 (else re-read from shared
  // memory per tile: 64 more registers would not fit beside O and S at MT = 2, d128).
  static constexpr bool Q_REGS = D * MT <= 128;
  // Thread blocks per SM the register allocation must allow. MT = 1: 3 (<= 168 registers per
  // thread) up to head dim 96; 2 above, where 3 spill (d128: 48 bytes) and, measured on an H200
  // (bf16 d128), ran 1-4% slower than 2 at every point but 2048 + 0 (BENCHMARKS.md). MT = 2: 2
  // (<= 255 registers: O alone is 128 at d128).
  static constexpr int MIN_BLOCKS = MT == 1 && D <= 96 ? 3 : 2;
  static constexpr int STAGE = 2 * BC * LD;       // elements of one stage (K then V)
  static constexpr int Q_ELEMS = Q_REGS ? 0 : ROWS * LD;
  // T is 2 bytes: the stages, Q (head dim 256), then 2 * BC int flags and 2 * BC K row
  // addresses.
  static constexpr size_t smem_bytes = 2 * ((size_t)2 * STAGE + (size_t)Q_ELEMS) +
                                       2 * BC * sizeof(int) + 2 * BC * sizeof(void *);
  static constexpr int COPIES = BC * CH / THREADS;  // 16-byte chunks per thread and tensor
  static_assert(D % 16 == 0 && NT_S % 2 == 0 && NT_O % 2 == 0, "whole mma tiles, in pairs");
  static_assert(!Q_REGS || ROWS <= 2 * BC, "Q is staged in stage 1 before the first tile");
  static_assert((LD * 2) % 16 == 0, "ldmatrix and 16-byte copies need 16-byte aligned rows");
  static_assert(BC <= THREADS && (BC * CH) % THREADS == 0, "whole copy rounds");
};

// 16 bytes global -> shared, asynchronous on the GPU (completion: commit + wait below). The
// emulation performs the copy at the cp.async.wait_group that covers its group (emu::AsyncGroups),
// so a read of the stage before that wait (and the barrier after it) sees the old bytes; or,
// with pkv_emu_set_copies_at_issue, at its issue, so a copy into bytes another warp has yet to
// read shows.
#ifdef PKV_CUDA_EMU
struct CpAsync16 {
  void *dst;
  const void *src;
};
inline emu::AsyncGroups<CpAsync16> &cp_async_queue() {
  return emu::per_thread<emu::AsyncGroups<CpAsync16>>();
}
#endif
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
#ifdef PKV_CUDA_EMU
  emu::check_align16(smem, "cp.async shared destination");
  emu::check_shared(smem, 16, "cp.async destination outside shared memory");
  emu::check_align16(gmem, "cp.async global source");
  if (emu::copies_at_issue())
    *static_cast<uint4 *>(smem) = ld_vec(gmem);
  else
    cp_async_queue().issue(CpAsync16{smem, gmem});
#else
  const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifndef PKV_CUDA_EMU
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#else
  cp_async_queue().commit();
#endif
}
// Waits until at most N of this thread's committed groups are in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
#ifndef PKV_CUDA_EMU
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#else
  cp_async_queue().wait(N, [](const CpAsync16 &c) { *static_cast<uint4 *>(c.dst) = ld_vec(c.src); });
#endif
}

// 2^x; 0 for x = -inf (the masked logits and the first rescale).
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef PKV_CUDA_EMU
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#endif
}

// a * b rounded to f32 on its own (never contracted into an FMA with a later add).
__device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef PKV_CUDA_EMU
  volatile float p = a * b;
  return p;
#else
  return __fmul_rn(a, b);
#endif
}

// Key t's K row (this layer and KV head) in cache block blk; nullptr where blk names no block.
template <typename T>
__device__ __forceinline__ const T *key_row(const PrefillArgs &a, const T *cache, int blk,
                                            int t, int64_t head_off) {
  return blk >= 0 && blk < a.num_blocks
             ? cache + (int64_t)blk * a.st.block + (int64_t)(t & (a.block_size - 1)) * a.st.token +
                   head_off
             : nullptr;
}

// The K row addresses (this layer and KV head; nullptr for a key past `klast` or in a block
// whose id is out of range) of keys kt .. kt + BC - 1 into krow, one key per thread: the table
// read and 64-bit address arithmetic once per key, not per 16-byte chunk (that was most of the
// copy's instructions at d128). Computed a tile ahead of its copy.
template <typename T, int D, int BC = Cfg<D, 1>::BC>
__device__ __forceinline__ void key_rows(const PrefillArgs &a, const T *cache,
                                         const int32_t *btab, int bs_shift, int64_t head_off,
                                         int kt, int klast, const T **krow) {
  if (threadIdx.x < BC) {
    // Compared as an offset, not as kt + x: a tile ending past klast near 2^31 would wrap
    // negative, pass `<= klast` and read before the table row.
    const int x = (int)threadIdx.x;
    const bool in = x <= klast - kt;  // kt >= 0 and klast >= -1: no overflow
    const int t = in ? kt + x : 0;
    krow[threadIdx.x] = key_row(a, cache, in ? btab[t >> bs_shift] : -1, t, head_off);
  }
}

// Queues the copy of the keys whose K rows krow holds (K into sk, V into sv, rows of LD) and
// writes their validity: an invalid key (nullptr) is zero-filled (V must be finite: it is
// multiplied by p = 0) and flagged invalid (masked). Lanes take consecutive 16-byte chunks of a
// row (a warp: whole rows per copy round); a thread keeps one chunk column where THREADS is a
// multiple of the row's chunks, so a round costs a shared load, the two copies and their
// addresses.
template <typename T, int D>
__device__ __forceinline__ void load_kv_tile(const PrefillArgs &a, const T *const *krow, T *sk,
                                             T *sv, int *kvalid) {
  using C = Cfg<D, 1>;  // the copy does not depend on the rows per warp
  const int64_t kv = a.st.kv;
  auto copy = [&](int j, int c) {
    const T *p = krow[j];
    T *dk = sk + j * C::LD + c * 8;
    T *dv = sv + j * C::LD + c * 8;
    if (p != nullptr) {
      cp_async16(dk, p + c * 8);
      cp_async16(dv, p + kv + c * 8);
    } else {
      *reinterpret_cast<uint4 *>(dk) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4 *>(dv) = make_uint4(0, 0, 0, 0);
    }
    if (c == 0) kvalid[j] = p != nullptr ? 1 : 0;
  };
  if constexpr (THREADS % C::CH == 0) {
    constexpr int KEYS = THREADS / C::CH;  // keys per round
    const int j0 = (int)threadIdx.x / C::CH, c = (int)threadIdx.x % C::CH;
#pragma unroll
    for (int k = 0; k < C::COPIES; ++k) copy(j0 + k * KEYS, c);
  } else {
#pragma unroll
    for (int k = 0; k < C::COPIES; ++k) {
      const unsigned i = threadIdx.x + (unsigned)(k * THREADS);
      copy((int)(i / (unsigned)C::CH), (int)(i % (unsigned)C::CH));
    }
  }
}

// ---- what the prefill kernels share (this file's and prefill_wgmma.cuh's) ----

// One thread block's work: `rows` rows (query token, head) of one (sequence, KV head), keys in
// tiles of `bc` from kbegin. Row tiles run last-first (blockIdx.y reversed): under the causal
// mask the last rows see the most keys, so the longest blocks start first.
struct PrefillBlock {
  int kh, seq, q0, qlen, ctx, rbase, nrows, kbegin, klast, ntiles;
  const int32_t *btab;  // this sequence's block table row
  int64_t head_off;     // element offset of this layer's and KV head's K row in a page
  int bs_shift;         // log2 of the block size (a power of two: the launcher's check)

  // Query token i (0-based in this sequence) sits at position ctx - qlen + i; row r of the
  // block is token (rbase + r) / group.
  __device__ int pos(const PrefillArgs &a, int r) const {
    return ctx - qlen + (rbase + r) / a.group;
  }
  // This thread block's rows (kh = blockIdx.x, seq = blockIdx.z, row tile blockIdx.y counted
  // from the last); false: the block has no rows (it returns before any barrier).
  template <int D>
  __device__ bool init(const PrefillArgs &a, int rows, int bc) {
    return init_at<D>(a, blockIdx.x, blockIdx.z,
                      ((int)gridDim.y - 1 - (int)blockIdx.y) * rows, rows, bc);
  }
  // The rows rbase .. rbase + rows - 1 of KV head kh_ of sequence seq_ (a persistent thread
  // block's work item); false: no such rows.
  template <int D>
  __device__ bool init_at(const PrefillArgs &a, int kh_, int seq_, int rbase_, int rows,
                          int bc) {
    kh = kh_;
    seq = seq_;
    q0 = a.query_start_loc[seq];
    qlen = a.query_start_loc[seq + 1] - q0;
    // Clamped to [0, table_tokens], as decode_seq_ctx: a context near INT_MIN made ctx - 1
    // and ctx - qlen wrap to ~2^31 (klast >= -1 below relies on ctx >= 0).
    ctx = min(max(a.context_lens[seq], 0), a.table_tokens);
    rbase = rbase_;
    const int rows_total = qlen * a.group;
    if (qlen <= 0 || rbase >= rows_total) return false;
    nrows = min(rows, rows_total - rbase);
    kbegin = a.window > 0 ? max(0, pos(a, 0) - a.window + 1) : 0;
    klast = min(pos(a, nrows - 1), ctx - 1);
    // In 64 bits: rounding up past INT_MAX (klast near 2^31) wrapped to no tiles at all.
    ntiles = klast >= kbegin ? (int)(((int64_t)klast - kbegin + bc) / bc) : 0;
    btab = a.block_tables + (int64_t)seq * a.max_blocks_per_seq;
    head_off = a.layer_offset + (int64_t)kh * D;
    bs_shift = 0;
    while ((1 << bs_shift) < a.block_size) ++bs_shift;
    return true;
  }
  // Row r's position (-1: a padding row past nrows, which every key is masked for) and ALiBi
  // slope.
  __device__ void row(const PrefillArgs &a, int r, int &qpos, float &slope) const {
    qpos = r < nrows ? pos(a, r) : -1;
    slope = (r < nrows && a.alibi_slopes != nullptr)
                ? a.alibi_slopes[kh * a.group + (rbase + r) % a.group]
                : 0.f;
  }
};

// The table entries of the keys of a thread block's first two tiles, read at its entry: where
// the keys start at 0 (no window) they do not depend on the block's context, so this read and
// the context's overlap instead of following each other (one dependent round trip less before
// the first K / V copy). Thread x < BC reads keys x and BC + x (-1 past the table row).
template <int BC> struct TableAhead {
  int id[2];
  __device__ void read(const PrefillArgs &a, int seq) {
    id[0] = id[1] = -1;
    if (a.window > 0 || threadIdx.x >= BC) return;
    const int32_t *btab = a.block_tables + (int64_t)seq * a.max_blocks_per_seq;
    const int shift = __ffs(a.block_size) - 1;  // a power of two (the launcher's check)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int t = i * BC + (int)threadIdx.x;
      if (t < a.table_tokens) id[i] = btab[t >> shift];
    }
  }
  // Tiles 0 and 1's row addresses into krow[0 .. 2 BC), as key_rows writes them.
  template <typename T, int D>
  __device__ void rows(const PrefillArgs &a, const T *cache, const PrefillBlock &b,
                       const T **krow) const {
    if (a.window > 0) {
      key_rows<T, D, BC>(a, cache, b.btab, b.bs_shift, b.head_off, b.kbegin, b.klast, krow);
      if (b.ntiles > 1)  // (tile 1's start, past klast, could pass INT_MAX)
        key_rows<T, D, BC>(a, cache, b.btab, b.bs_shift, b.head_off, b.kbegin + BC, b.klast,
                           krow + BC);
    } else if (threadIdx.x < BC) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {  // kbegin is 0
        const int t = i * BC + (int)threadIdx.x;
        krow[i * BC + threadIdx.x] = key_row(a, cache, t <= b.klast ? id[i] : -1, t, b.head_off);
      }
    }
  }
};

// No soft-cap, no ALiBi and a positive finite scale: tile_kind's scale-only and causal tiles
// keep the raw dot products and fold the scale into the exponent (softmax_tile's mul).
__device__ __forceinline__ bool plain_logits(const PrefillArgs &a) {
  return !(a.softcap > 0.f) && a.alibi_slopes == nullptr && a.scale > 0.f && a.scale < INFINITY;
}

// The block's query rows into sq (rows of ld elements; zeros past nrows), queued as cp.async
// by the block's NT threads.
template <typename T, int D, int NT = THREADS>
__device__ __forceinline__ void stage_q(const PrefillArgs &a, const PrefillBlock &b, T *sq,
                                        int ld, int rows) {
  constexpr int CH = D / 8;
  const T *qg = reinterpret_cast<const T *>(a.query);
  for (int i = threadIdx.x; i < rows * CH; i += NT) {
    const int r = i / CH, c = i % CH;
    T *dst = sq + r * ld + c * 8;
    if (r < b.nrows) {
      const int row = b.rbase + r;
      const T *src = qg + (int64_t)(b.q0 + row / a.group) * a.q_stride +
                     (int64_t)(b.kh * a.group + row % a.group) * D + c * 8;
      cp_async16(dst, src);
    } else {
      *reinterpret_cast<uint4 *>(dst) = make_uint4(0, 0, 0, 0);
    }
  }
}

// The logit transform and mask (attn_logit's order) of one m16 tile's S accumulators (NT n8
// tiles of keys kt ..), in log2 units: rows g (h = 0) and g + 8 (h = 1) at positions qpos[h].
template <int NT>
__device__ __forceinline__ void mask_tile(const PrefillArgs &a, float (&s)[NT][4],
                                          const int *kv_ok, int kt, int qd,
                                          const int (&qpos)[2], const float (&slope)[2]) {
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = e / 2, jj = t * 8 + qd * 2 + (e % 2), key = kt + jj;
      float x = s[t][e] * a.scale;
      if (a.softcap > 0.f) x = a.softcap * tanhf(x / a.softcap);
      x += slope[h] * (float)(key - qpos[h]);
      const bool visible =
          kv_ok[jj] != 0 && key <= qpos[h] && !(a.window > 0 && qpos[h] - key >= a.window);
      s[t][e] = visible ? x * LOG2E : -INFINITY;
    }
}

// Online softmax of one m16 tile (s * mul is each logit in log2 units, mul > 0): the running
// max m and this lane's share of the sum l per row, the rescale factors alpha of O; each pair
// of probabilities (S accumulators 2h, 2h + 1 of n8 tile t) goes to emit(t, h, p0, p1) as it is
// made. Maxima and sums run as 4 independent partials (chains of 4 dependent operations
// instead of 16: a warp has few peers to hide latency behind). Returns whether some row's max
// grew. Row h reads only accumulators 2h, 2h + 1, so emit may overwrite those of rows done; a
// row of huge logits has its accumulators replaced by the rounded logits (see below).
template <int NT, typename Emit>
__device__ __forceinline__ bool softmax_rows(float (&s)[NT][4], float mul, float (&m)[2],
                                             float (&l)[2], float (&alpha)[2], Emit emit) {
  bool grew = false;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mp[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
    for (int t = 0; t < NT; ++t) mp[t % 4] = fmaxf(mp[t % 4], fmaxf(s[t][2 * h], s[t][2 * h + 1]));
    float mx = fmaxf(fmaxf(mp[0], mp[1]), fmaxf(mp[2], mp[3]));
    // The 4 lanes of a quad hold the row's columns.
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // mul > 0: the largest product is the product of the largest (and -inf stays -inf).
    const float m_new = fmaxf(m[h], mx * mul);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet
    alpha[h] = fast_exp2(m[h] - m_use);
    m[h] = m_new;
    // fmaf below subtracts m_use, a rounded product, from the exact product s * mul: the
    // exponent of the row's largest p is that rounding error, up to half an ulp of m_use. Below
    // 2^24 that is at most 1/2; past it 2^(ulp / 2) overflows (16 from 2^28: inf in f16; 128
    // from 2^31: inf in f32, then inf / inf) or underflows (P zero: a zero row). There the row's
    // logits are rounded first, as the oracle's are, so that every exponent is <= 0 and the
    // largest 0 (rounding is monotonic: no rounded logit passes m_use). Such logits are far
    // outside any model's range: the branch is not taken in practice, and the common path
    // keeps its one FFMA per logit.
    float mul_h = mul;
    if (!(fabsf(m_use) < 0x1p24f) && mul != 1.f) {
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        s[t][2 * h] = mul_rn(s[t][2 * h], mul);
        s[t][2 * h + 1] = mul_rn(s[t][2 * h + 1], mul);
      }
      mul_h = 1.f;
    }
    float sp[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      // mul_h = 1 (general tiles, huge logits): s - m_use exactly as a subtraction.
      const float p0 = fast_exp2(fmaf(s[t][2 * h], mul_h, -m_use));
      const float p1 = fast_exp2(fmaf(s[t][2 * h + 1], mul_h, -m_use));
      sp[t % 4] += p0;
      sp[t % 4] += p1;
      emit(t, h, p0, p1);
    }
    l[h] = l[h] * alpha[h] + ((sp[0] + sp[1]) + (sp[2] + sp[3]));
    grew = grew || alpha[h] != 1.f;
  }
  return grew;
}

// softmax_rows with P rounded to T and packed as it is made (p[t][h]: the pair 2h, 2h + 1 of
// tile t; half the registers of the f32 values).
template <typename T, int NT>
__device__ __forceinline__ bool softmax_tile(float (&s)[NT][4], float mul, float (&m)[2],
                                             float (&l)[2], float (&alpha)[2],
                                             uint32_t (&p)[NT][2]) {
  return softmax_rows(s, mul, m, l, alpha,
                      [&](int t, int h, float p0, float p1) { p[t][h] = pack_f32x2<T>(p0, p1); });
}

// softmax_rows leaving P in f32 in place of the logits (pack_p rounds and packs it later).
template <int NT>
__device__ __forceinline__ bool softmax_tile_f32(float (&s)[NT][4], float mul, float (&m)[2],
                                                 float (&l)[2], float (&alpha)[2]) {
  return softmax_rows(s, mul, m, l, alpha, [&](int t, int h, float p0, float p1) {
    s[t][2 * h] = p0;
    s[t][2 * h + 1] = p1;
  });
}

// softmax_tile_f32's P rounded to T and packed as softmax_tile packs it.
template <typename T, int NT>
__device__ __forceinline__ void pack_p(const float (&x)[NT][4], uint32_t (&p)[NT][2]) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    p[t][0] = pack_f32x2<T>(x[t][0], x[t][1]);
    p[t][1] = pack_f32x2<T>(x[t][2], x[t][3]);
  }
}

// How a warp turns key tile kt .. kt + BC - 1's S accumulators into logits in log2 units
// (warp-uniform), for a warp whose rows sit at positions w_first .. w_last:
//   TILE_SCALE    every key valid, before every row and inside every row's window, plain
//                 logits: the scale alone, which the exponent applies (one FFMA per logit)
//   TILE_CAUSAL   the same but some key past some row (the diagonal tiles): the scale, and
//                 -inf where the key is past the row (causal_tile: a compare and a select per
//                 logit; a padding row, position -1, sees none)
//   TILE_GENERAL  anything else: mask_tile, the oracle's transform in full (a flag load,
//                 position arithmetic, three compares and two products per logit)
enum TileKind : int { TILE_SCALE, TILE_CAUSAL, TILE_GENERAL };
template <int BC>
__device__ __forceinline__ TileKind tile_kind(const PrefillArgs &a, bool plain, int kt,
                                              int w_first, int w_last, const int *kv_ok) {
  static_assert(BC % 32 == 0, "whole warps of keys");
  const int lane = threadIdx.x % 32;
  bool valid = true;
#pragma unroll
  for (int i = lane; i < BC; i += 32) valid = valid && kv_ok[i] != 0;
  if (!(plain && (a.window <= 0 || w_last - kt < a.window) && __all_sync(0xffffffffu, valid)))
    return TILE_GENERAL;
  return kt + BC - 1 <= w_first ? TILE_SCALE : TILE_CAUSAL;
}

// The causal mask alone (tile_kind's TILE_CAUSAL) of one m16 tile's S accumulators (NT n8
// tiles of keys kt ..): rows g (h = 0) and g + 8 (h = 1) at positions qpos[h]. Key
// kt + 8t + 2qd + (e % 2) is past row h when 8t + (e % 2) > qpos[h] - kt - 2qd: a constant
// against one bound per row.
template <int NT>
__device__ __forceinline__ void causal_tile(float (&s)[NT][4], int kt, int qd,
                                            const int (&qpos)[2]) {
  const int bound[2] = {qpos[0] - kt - 2 * qd, qpos[1] - kt - 2 * qd};
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (t * 8 + (e % 2) > bound[e / 2]) s[t][e] = -INFINITY;
}

// The A fragment of P V's k16 step kk (keys 16kk .. 16kk + 15): the packed P of S tiles 2kk and
// 2kk + 1 (the accumulator layout of two n8 tiles is the A layout of one k16 step).
template <int NT>
__device__ __forceinline__ void p_fragment(const uint32_t (&p)[NT][2], int kk,
                                           uint32_t (&pa)[4]) {
  pa[0] = p[2 * kk][0];
  pa[1] = p[2 * kk][1];
  pa[2] = p[2 * kk + 1][0];
  pa[3] = p[2 * kk + 1][1];
}

// O's rows g, g + 8 of one m16 tile times their alpha.
template <int NO>
__device__ __forceinline__ void rescale_tile(float (&o)[NO][4], const float (&alpha)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int n = 0; n < NO; ++n) {
      o[n][2 * h] *= alpha[h];
      o[n][2 * h + 1] *= alpha[h];
    }
}

// The epilogue of one m16 tile whose row g is the block's row r0 + g: the row sums over the
// quad, then O / l (zeros for a row that saw no key, as the oracle) into `out`; rows past
// nrows are not stored.
template <typename T, int D>
__device__ __forceinline__ void store_tile(const PrefillArgs &a, const PrefillBlock &b,
                                           const float (&o)[D / 8][4], const float (&l)[2],
                                           int r0, int g, int qd) {
  T *og = reinterpret_cast<T *>(a.out);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = l[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int r = r0 + g + 8 * h;
    if (r >= b.nrows) continue;
    const int row = b.rbase + r;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    // Rows start on the 16-byte grid (the launcher checks out and out_stride), so each lane's
    // two adjacent elements are one aligned 4-byte store.
    T *op = og + (int64_t)(b.q0 + row / a.group) * a.out_stride +
            (int64_t)(b.kh * a.group + row % a.group) * D + qd * 2;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<uint32_t *>(op + n * 8) =
          pack_f32x2<T>(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
  }
}

// store_tile through shared memory: the warp's 16 rows go to `rows` ([16][D + 8] elements
// of T that no other warp touches), then out as whole 16-byte pieces, a row's consecutive
// pieces from consecutive lanes (store_tile's 4-byte stores write each 32-byte sector in two
// halves, 8 rows per instruction: 4x the store instructions and twice the L2 requests).
template <typename T, int D>
__device__ __forceinline__ void store_tile_staged(const PrefillArgs &a, const PrefillBlock &b,
                                                  const float (&o)[D / 8][4],
                                                  const float (&l)[2], int r0, int g, int qd,
                                                  T *rows) {
  constexpr int LD = D + 8, CH = D / 8;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = l[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    T *rp = rows + (g + 8 * h) * LD + qd * 2;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<uint32_t *>(rp + n * 8) =
          pack_f32x2<T>(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
  }
  __syncwarp();
  T *og = reinterpret_cast<T *>(a.out);
  for (int i = lane; i < 16 * CH; i += 32) {
    const int r = i / CH, c = i % CH;
    if (r0 + r >= b.nrows) break;  // rows past nrows are not stored (r grows with i)
    const int row = b.rbase + r0 + r;
    T *op = og + (int64_t)(b.q0 + row / a.group) * a.out_stride +
            (int64_t)(b.kh * a.group + row % a.group) * D + c * 8;
    *reinterpret_cast<uint4 *>(op) = *reinterpret_cast<const uint4 *>(rows + r * LD + c * 8);
  }
}

template <typename T, int D, int MT>
__global__ void __launch_bounds__(THREADS, Cfg<D, MT>::MIN_BLOCKS)
    prefill_mma_kernel(const PrefillArgs a) {
  grid_dependency_entry();  // PKV_LAUNCH_PROGRAMMATIC: before any read
  using C = Cfg<D, MT>;
  constexpr int ROWS = C::ROWS, WROWS = C::WROWS;
  extern __shared__ uint4 pf_smem[];
  T *smem = reinterpret_cast<T *>(pf_smem);
  T *sq = C::Q_REGS ? smem + C::STAGE : smem + 2 * C::STAGE;
  int *kvalid = reinterpret_cast<int *>(smem + 2 * C::STAGE + C::Q_ELEMS);  // [2][BC]
  const T **krow = reinterpret_cast<const T **>(kvalid + 2 * C::BC);        // [2][BC]

  TableAhead<C::BC> ahead;
  ahead.read(a, blockIdx.z);
  PrefillBlock b;
  if (!b.template init<D>(a, ROWS, C::BC)) return;  // the whole block, before any barrier
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // The rows of this lane's accumulator fragments: g and g + 8 of each of the warp's m-tiles
  // (index [mt][h]: row warp * WROWS + 16 mt + g + 8 h of the block's).
  const int g = lane / 4, qd = lane % 4;
  int qpos[MT][2];
  float slope[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      b.row(a, warp * WROWS + mt * 16 + g + 8 * h, qpos[mt][h], slope[mt][h]);

  // This warp's rows as a range of positions (warp-uniform): a key tile wholly after its last
  // row, or wholly before its first row's window, is skipped by the warp (a warp of padding
  // rows skips all), which leaves its m, l and O as the all-masked tile would.
  const int wrows = min(WROWS, b.nrows - warp * WROWS);
  const int w_first = b.pos(a, warp * WROWS);
  const int w_last = b.pos(a, warp * WROWS + max(wrows, 1) - 1);
  const bool plain = plain_logits(a);
  const float scale_log2 = a.scale * LOG2E;
  const T *cache = reinterpret_cast<const T *>(a.cache);

  // ---- prologue: Q rows (zero past nrows), key row addresses of tiles 0 and 1, key tile 0 ----
  // Tile n's row addresses live in krow[n % 2], written one loop iteration before its copy is
  // queued (below), so the barrier at the top of each iteration orders every write before its
  // reads and every read of tile n before the write of tile n + 2. Q's copy is queued first:
  // it needs only the block's context, and its region is nobody else's yet.
  stage_q<T, D>(a, b, sq, C::LD, ROWS);
  ahead.template rows<T, D>(a, cache, b, krow);
  __syncthreads();
  if (b.ntiles > 0) load_kv_tile<T, D>(a, krow, smem, smem + C::BC * C::LD, kvalid);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  // ldmatrix row addresses: lanes 8j .. 8j + 7 name rows 0..7 of matrix j. A fragments of
  // m-tile mt: matrices (rows 0-7 | 8-15) x (cols +0 | +8) of the warp's rows 16 mt ...
  const int lrow = lane % 8, lmat = lane / 8;
  const T *qa = sq + (warp * WROWS + (lmat % 2) * 8 + lrow) * C::LD + (lmat / 2) * 8;
  uint32_t qf[C::Q_REGS ? MT : 1][C::Q_REGS ? C::KSTEPS : 1][4];
  if constexpr (C::Q_REGS) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int ks = 0; ks < C::KSTEPS; ++ks)
        ldmatrix<4, false>(qf[mt][ks], qa + mt * 16 * C::LD + ks * 16);
  }

  float o[MT][C::NT_O][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < C::NT_O; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.f;
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m[mt][h] = -INFINITY;
      l[mt][h] = 0.f;
    }

  for (int j = 0; j < b.ntiles; ++j) {
    const int st = j & 1;
    cp_async_wait<0>();  // tile j has landed (this thread's copies) ...
    // ... and everyone's: tile j is visible, and every warp is done with tile j - 1 (and, at
    // j = 0, with the Q staging), whose buffer the next copy overwrites.
    __syncthreads();
    if (j + 1 < b.ntiles) {
      T *nk = smem + (st ^ 1) * C::STAGE;
      load_kv_tile<T, D>(a, krow + (st ^ 1) * C::BC, nk, nk + C::BC * C::LD,
                         kvalid + (st ^ 1) * C::BC);
    }
    cp_async_commit();
    if (j + 2 < b.ntiles)  // into tile j's slot: its copy was queued before this barrier
      key_rows<T, D>(a, cache, b.btab, b.bs_shift, b.head_off, b.kbegin + (j + 2) * C::BC,
                     b.klast, krow + st * C::BC);
    const T *sk = smem + st * C::STAGE;
    const T *sv = sk + C::BC * C::LD;
    const int *kv_ok = kvalid + st * C::BC;
    const int kt = b.kbegin + j * C::BC;
    // The tile ends before the warp's first visible key, compared as a distance (kt + BC - 1
    // passes INT_MAX near 2^31 and wrapped, skipping a visible tile); w_first >= 0 here.
    const int first_visible = w_first - a.window + 1;
    if (wrows <= 0 || kt > w_last ||
        (a.window > 0 && first_visible > kt && first_visible - kt > C::BC - 1))
      continue;  // nothing of this tile is visible to the warp's rows

    // ---- S = Q K^T ----
    float s[MT][C::NT_S][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int t = 0; t < C::NT_S; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][t][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < C::KSTEPS; ++ks) {
      uint32_t af[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (C::Q_REGS) {
#pragma unroll
          for (int e = 0; e < 4; ++e) af[mt][e] = qf[mt][ks][e];
        } else {
          ldmatrix<4, false>(af[mt], qa + mt * 16 * C::LD + ks * 16);
        }
      }
#pragma unroll
      for (int t = 0; t < C::NT_S; t += 2) {
        // B fragments of key tiles t, t + 1: matrices (keys +0 | +8) x (dims +0 | +8), K rows
        // being B's columns (no transpose); one load for every m-tile.
        uint32_t kb[4];
        ldmatrix<4, false>(kb, sk + (t * 8 + (lmat / 2) * 8 + lrow) * C::LD + ks * 16 +
                                   (lmat % 2) * 8);
        const uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_m16n8k16<T>(s[mt][t], af[mt], b0, s[mt][t]);
          mma_m16n8k16<T>(s[mt][t + 1], af[mt], b1, s[mt][t + 1]);
        }
      }
    }

    // ---- the logit transform and mask, in log2 units (tile_kind) ----
    // Padding rows (past nrows) are never stored, so they need no mask on the scale-only path.
    const TileKind kind = tile_kind<C::BC>(a, plain, kt, w_first, w_last, kv_ok);
    float mul = scale_log2;  // s * mul is the logit in log2 units
    if (kind == TILE_CAUSAL) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) causal_tile(s[mt], kt, qd, qpos[mt]);
    } else if (kind == TILE_GENERAL) {
      mul = 1.f;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mask_tile(a, s[mt], kv_ok, kt, qd, qpos[mt], slope[mt]);
    }

    // ---- online softmax per row; P rounded and packed as it is made ----
    float alphas[MT][2];
    uint32_t p[MT][C::NT_S][2];
    bool grew = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      grew = softmax_tile<T>(s[mt], mul, m[mt], l[mt], alphas[mt], p[mt]) || grew;
    // The O rescale, skipped when no row of the warp raised its max in this tile (alpha is 1
    // for every row, and x * 1 = x: bit-identical), which on a long context is most tiles.
    if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) rescale_tile(o[mt], alphas[mt]);
    }

    // ---- O += P V ----
#pragma unroll
    for (int kk = 0; kk < C::BC / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) p_fragment(p[mt], kk, pa[mt]);
#pragma unroll
      for (int n = 0; n < C::NT_O; n += 2) {
        // B fragments of dim tiles n, n + 1: matrices (keys +0 | +8) x (dims +0 | +8) of V,
        // transposed (V rows are B's rows); one load for every m-tile.
        uint32_t vb[4];
        ldmatrix<4, true>(vb, sv + (kk * 16 + (lmat % 2) * 8 + lrow) * C::LD + n * 8 +
                                  (lmat / 2) * 8);
        const uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_m16n8k16<T>(o[mt][n], pa[mt], b0, o[mt][n]);
          mma_m16n8k16<T>(o[mt][n + 1], pa[mt], b1, o[mt][n + 1]);
        }
      }
    }
  }

  // ---- epilogue ----
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    store_tile<T, D>(a, b, o[mt], l[mt], warp * WROWS + mt * 16, g, qd);
}

}  // namespace pfmma
}  // namespace pkv
