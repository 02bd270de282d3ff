// decode_v2.cuh: the decode attention kernels' shared parts (partitioning, per-block setup, the
// cross-warp merge) and the CUDA-core body. The tensor-core body for GQA is decode_mma.cuh.
//
// Both bodies are single-pass online softmax (flash-decoding): grid (num_kv_heads *
// head_chunks, num_seqs, num_splits), DEC_THREADS threads; a block reads the K and V of one KV
// head of one sequence over one partition of its context, once, for up to GT query heads of
// that KV head's group. Its warps take fixed-size tiles of tokens in turn (warp w: tiles w,
// w + DEC_WARPS, ...), each warp keeping a running max, sum and f32 accumulator per head; the
// next tile's K and V loads are issued before the current tile's are used, so every lane has
// loads in flight while it computes. Nothing in shared memory grows with the context: at the end
// the warps' states are merged through DEC_WARPS x GT x (D + 2) floats (log-sum-exp rescaling).
// With one split the block writes the normalized output; with several it writes its unnormalized
// accumulator, max and sum to the workspace, and the group's last block to finish merges the
// splits (decode_finish_split here, decode_finish_split_weighted for the tensor-core body; the
// contract in attention.cuh).
//
// Partitions follow the decode contract (attention.cuh): derived on the device from each
// sequence's own context and the plan's num_splits, in multiples of PKV_DECODE_PART_ALIGN
// tokens (a whole number of the tensor-core body's 16-token tiles). A split past the context,
// or wholly before a sliding window, is empty and writes max = -inf, sum = 0.
#pragma once

#include "attention.cuh"
#include "decode_resident.cuh"

namespace pkv {

static_assert(PKV_DECODE_PART_ALIGN % 16 == 0, "partitions are whole 16-token tiles");

// What one thread block of either body works on.
struct DecodeBlock {
  int kh;       // KV head
  int g0;       // first query head of the group served here
  int ng;       // heads served here, 1 ..= GT
  int seq, split;
  int ctx;      // context length, clamped to what the block table row can name
  int qpos;     // the query's position, ctx - 1
  int begin;    // first token read: the partition's start or the window's, whichever is later
  int end;      // one past the last token read; begin >= end: nothing to attend
  int64_t row0; // workspace row of head g0: seq * num_heads + its head index
  int64_t q0;   // element offset of head g0's query row (the query view's token stride)
  int64_t o0;   // element offset of head g0's output row (the out view's token stride)

  template <int D> __device__ static DecodeBlock of(const DecodeArgs &a, int gt) {
    DecodeBlock b;
    b.kh = blockIdx.x / a.head_chunks;
    b.g0 = (blockIdx.x % a.head_chunks) * gt;
    b.ng = min(gt, a.group - b.g0);
    b.seq = blockIdx.y;
    b.split = blockIdx.z;
    b.ctx = decode_seq_ctx(a.context_lens, b.seq, a.ctx_clamp);  // memory safety: clamped
    b.qpos = b.ctx - 1;
    // The contract's partition [split * part, min(ctx, (split + 1) * part)), in 64 bits.
    const int64_t part = decode_part_len(b.ctx, a.num_splits);
    const int64_t start = (int64_t)b.split * part, stop = start + part;
    const int wstart = a.window > 0 ? max(0, b.ctx - a.window) : 0;
    b.begin = max(start < b.ctx ? (int)start : b.ctx, wstart);
    b.end = stop < b.ctx ? (int)stop : b.ctx;
    const int64_t h0 = (int64_t)b.kh * a.group + b.g0;
    b.row0 = (int64_t)b.seq * a.num_heads + h0;
    b.q0 = (int64_t)b.seq * a.q_stride + h0 * D;
    b.o0 = (int64_t)b.seq * a.out_stride + h0 * D;
    return b;
  }
};

// The outputs of a block with nothing to attend: an empty split (max -inf, sum 0: the split
// merge gives it no weight) or, unsplit, a zero row (an empty or padding sequence).
template <typename T, int D>
__device__ void decode_store_empty(const DecodeArgs &a, const DecodeBlock &b) {
  if (a.num_splits > 1) {
    for (int g = threadIdx.x; g < b.ng; g += DEC_THREADS) {
      const int64_t r = (b.row0 + g) * a.num_splits + b.split;
      a.tmp_max[r] = -INFINITY;
      a.tmp_sum[r] = 0.f;
    }
  } else {
    T *out = reinterpret_cast<T *>(a.out) + b.o0;  // the ng heads' rows are contiguous
    for (int i = threadIdx.x; i < b.ng * D; i += DEC_THREADS) out[i] = Elem<T>::from_f32(0.f);
  }
}

// The per-warp states in shared memory: max [DEC_WARPS][GT], sum [DEC_WARPS][GT], accumulator
// [DEC_WARPS][GT][D] (unnormalized, relative to that warp's max).
template <int GT, int D> struct DecodeMerge {
  static constexpr size_t FLOATS = (size_t)DEC_WARPS * GT * (2 + D);
  __device__ static float *max_of(float *s, int w) { return s + w * GT; }
  __device__ static float *sum_of(float *s, int w) { return s + DEC_WARPS * GT + w * GT; }
  __device__ static float *acc_of(float *s, int w, int g) {
    return s + 2 * DEC_WARPS * GT + (w * GT + g) * D;
  }
};

// After a __syncthreads that follows every warp's DecodeMerge writes: merges the warps
// (weights e^(m_w - M)) and stores the block's result for its ng heads.
template <typename T, int D, int GT>
__device__ void decode_merge_and_store(const DecodeArgs &a, const DecodeBlock &b, float *s) {
  using Mg = DecodeMerge<GT, D>;
  for (int i = threadIdx.x; i < b.ng * D; i += DEC_THREADS) {
    const int g = i / D, d = i % D;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < DEC_WARPS; ++w) m = fmaxf(m, Mg::max_of(s, w)[g]);
    float l = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < DEC_WARPS; ++w) {
      // A warp with max -inf adds only its sum: 0 when it had no unmasked token, NaN when its
      // only unmasked logits were NaN (fmaxf skips them), which then poisons the row.
      const float mw = Mg::max_of(s, w)[g];
      if (mw == -INFINITY) {
        l += Mg::sum_of(s, w)[g];
        continue;
      }
      const float wt = __expf(mw - m);
      l = fmaf(Mg::sum_of(s, w)[g], wt, l);
      o = fmaf(Mg::acc_of(s, w, g)[d], wt, o);
    }
    if (a.num_splits > 1) {
      const int64_t r = (b.row0 + g) * a.num_splits + b.split;
      a.tmp_out[r * D + d] = o;
      if (d == 0) {
        a.tmp_max[r] = m;
        a.tmp_sum[r] = l;
      }
    } else {
      reinterpret_cast<T *>(a.out)[b.o0 + g * D + d] = Elem<T>::from_f32(l == 0.f ? 0.f : o / l);
    }
  }
}

// (m, l, v) += split (mz, lz, x): the running (max, sum, weighted row) of one output piece
// over the splits it has read, relative to its own max m; a split with max -inf adds only its
// sum: 0 when it attended nothing (its row never written), NaN when its only unmasked logits
// were NaN (fmaxf skips them), which then poisons the output as the formula does.
__device__ __forceinline__ void split_add(float &m, float &l, float4 &v, float mz, float lz,
                                          const float4 &x) {
  if (mz == -INFINITY) {
    l += lz;
    return;
  }
  if (mz > m) {
    const float c = m == -INFINITY ? 0.f : __expf(m - mz);  // v and l are 0 while m is -inf
    l = fmaf(l, c, lz);
    v = make_float4(fmaf(v.x, c, x.x), fmaf(v.y, c, x.y), fmaf(v.z, c, x.z), fmaf(v.w, c, x.w));
    m = mz;
  } else {
    const float w = __expf(mz - m);
    l = fmaf(lz, w, l);
    v = make_float4(fmaf(x.x, w, v.x), fmaf(x.y, w, v.y), fmaf(x.z, w, v.z), fmaf(x.w, w, v.w));
  }
}

// split_add over N splits read together: one max over them and the running max, then their
// weights e^(mz - M) all at once, so the exponents are independent of each other and only the
// sums are a chain (split_add one split at a time made every split wait for the previous
// one's compare and exponent: ~N x the exponent's latency). Splits with max -inf add only
// their sums, as in split_add (their rows may never have been written).
template <int N>
__device__ __forceinline__ void split_add_n(float &m, float &l, float4 &v, const float (&mz)[N],
                                            const float (&lz)[N], const float4 (&x)[N]) {
  float mx[N];
#pragma unroll
  for (int u = 0; u < N; ++u) mx[u] = mz[u];
#pragma unroll
  for (int w = 1; w < N; w *= 2)  // a tree: log2(N) dependent steps, not N
#pragma unroll
    for (int u = 0; u + w < N; u += 2 * w) mx[u] = fmaxf(mx[u], mx[u + w]);
  const float M = fmaxf(m, mx[0]);  // -inf: every split adds only its sum below
  if (m != M) {  // v and l are 0 while m is -inf
    const float c = m == -INFINITY ? 0.f : __expf(m - M);
    l *= c;
    v = make_float4(v.x * c, v.y * c, v.z * c, v.w * c);
    m = M;
  }
#pragma unroll
  for (int u = 0; u < N; ++u) {
    if (mz[u] == -INFINITY) {
      l += lz[u];
      continue;
    }
    const float w = __expf(mz[u] - M);
    l = fmaf(lz[u], w, l);
    v = make_float4(fmaf(x[u].x, w, v.x), fmaf(x[u].y, w, v.y), fmaf(x[u].z, w, v.z),
                    fmaf(x[u].w, w, v.w));
  }
}

// Shared memory floats the split merge needs: a running (sum vector, max, sum), 6 floats, per
// thread or per 16-byte piece of the GT heads' outputs, whichever are more.
template <int GT, int D> constexpr int split_merge_floats() {
  return 6 * (DEC_THREADS > GT * D / 4 ? DEC_THREADS : GT * D / 4);
}

// The CUDA-core bodies' split merge (f32 caches, f16 / bf16 MHA). With several splits, once
// this block's threads have written its partials to the workspace: counts the block in, and if
// it is the last of its (sequence, head chunk) group, merges the group's num_splits partials
// into the normalized output of its ng heads (the contract's split merge, attention.cuh).
// Called by every thread of the block; `scratch` is
// split_merge_floats<GT, D>() (or more) floats of 16-byte aligned shared memory the block no
// longer needs.
//
// The merge is the tail of a split launch (only after every split of the group has arrived can
// it start; at batch 1 it is on the critical path of every layer), and its time is rounds of
// dependent L2 reads, so it keeps those rounds few:
//  * no round of its own for the weights: a thread reads each split's max and sum with its
//    partial row and keeps a running (max, sum, row sum) relative to its own max, as the
//    decode body does over tokens (e^(m_z - M) needs the max of all splits only at the end);
//  * every thread reads partial rows: each 16-byte piece of the ng x D output is summed by R
//    threads (R = threads / pieces, at most the splits), thread r taking splits r, r + R, ...
//    in split order, ZU splits' loads issued together per step and added together
//    (split_add_n: their exponents independent of each other); the R running sums are
//    combined in r order at the end.
// H100, bf16 d128, MHA 32:32 at 1 x 512: 10.6 -> 9.5 us against the weights-first merge
// (BENCHMARKS.md, session 14); where one thread sums each piece (the tensor-core GQA body)
// that merge measured faster, and that body keeps it (decode_merge_weighted.cuh).
// Every output is summed in the same order whichever block merges, so the result does not
// depend on the order in which blocks finish.
//
// Each kernel calls it from one place, after its body (decode_*_attend) or an empty split's
// store, so the inlined merge runs when the body's registers are free.
// The arrival of a block of a split launch, once its threads have written its partials: counts
// it in; true in every thread of the group's last block, which then merges and finally calls
// decode_split_reset. The arrival publishes the block's partials (the pattern of a grid-wide
// barrier): the barrier orders every thread's writes before thread 0's fence, whose
// cumulativity orders them before the atomic on the device; the last block's thread 0 fences
// after its atomic and the second barrier hands that order to the threads that read.
__device__ __forceinline__ bool decode_split_arrive(const DecodeArgs &a, const DecodeBlock &b) {
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned before = atomicAdd(a.counters + (int64_t)b.seq * gridDim.x + blockIdx.x, 1u);
    s_last = before + 1 == (unsigned)a.num_splits;
    if (s_last) __threadfence();
  }
  __syncthreads();
  return s_last != 0;
}
// After the merge: every block of the group has arrived, nothing adds to the counter again in
// this launch, and the next launch (stream-ordered after this one) finds it zero. (Reset here,
// not between the arrival's atomic and its fence, where the fence waited for its round trip.)
__device__ __forceinline__ void decode_split_reset(const DecodeArgs &a, const DecodeBlock &b) {
  if (threadIdx.x == 0) atomicExch(a.counters + (int64_t)b.seq * gridDim.x + blockIdx.x, 0u);
}

template <typename T, int D, int GT>
__device__ __forceinline__ void decode_finish_split(const DecodeArgs &a, const DecodeBlock &b,
                                                    float *scratch) {
  if (!decode_split_arrive(a, b)) return;

  const int S = a.num_splits;
  // ZU: splits per step, within the registers the bodies already hold (ptxas, sm_90: 8 raised
  // the f32 bodies' counts). The f16 / bf16 GQA body merges with decode_finish_split_weighted
  // (decode_merge_weighted.cuh).
  constexpr int PIECES = D / 4;
  constexpr int ZU = sizeof(T) == 4 && GT == 1 ? 2 : 4;
  const int pieces = b.ng * PIECES;
  const int R = max(1, min(DEC_THREADS / pieces, S));
  const int slots = R * pieces;  // slot s: piece s % pieces, splits s / pieces + k R
  float4 *acc = reinterpret_cast<float4 *>(scratch);  // [slots]; 16-byte aligned
  float *smax = scratch + 4 * slots, *ssum = smax + slots;
  const float4 *rows = reinterpret_cast<const float4 *>(a.tmp_out + b.row0 * S * D);
#pragma unroll 1
  for (int s = threadIdx.x; s < slots; s += DEC_THREADS) {  // R > 1: one slot per thread
    const int p = s % pieces, g = p / PIECES;
    const float4 *src = rows + (int64_t)g * S * PIECES + p % PIECES;
    const float *mx = a.tmp_max + (b.row0 + g) * S, *sm = a.tmp_sum + (b.row0 + g) * S;
    float m = -INFINITY, l = 0.f;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
    for (int z = s / pieces; z < S; z += ZU * R) {
      float4 x[ZU];
      float mz[ZU], lz[ZU];
#pragma unroll
      for (int u = 0; u < ZU; ++u) {
        const int zu = z + u * R;
        const bool in = zu < S;
        mz[u] = in ? __ldcg(mx + zu) : -INFINITY;
        lz[u] = in ? __ldcg(sm + zu) : 0.f;
        x[u] = in ? __ldcg(src + (int64_t)zu * PIECES) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      split_add_n<ZU>(m, l, v, mz, lz, x);
    }
    acc[s] = v;
    smax[s] = m;
    ssum[s] = l;
  }
  __syncthreads();  // every slot's running sums written
  T *out = reinterpret_cast<T *>(a.out) + b.o0;  // the ng heads' rows are contiguous
#pragma unroll 1
  for (int p = threadIdx.x; p < pieces; p += DEC_THREADS) {
    float m = -INFINITY, l = 0.f;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
    for (int r = 0; r < R; ++r) {
      const int s = r * pieces + p;
      split_add(m, l, v, smax[s], ssum[s], acc[s]);
    }
    const int g = p / PIECES, d = (p % PIECES) * 4;
    const float o[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) out[g * D + d + e] = Elem<T>::from_f32(l == 0.f ? 0.f : o[e] / l);
  }
  decode_split_reset(a, b);
}

__device__ __forceinline__ bool decode_block_ok(const DecodeArgs &a, int blk) {
  return blk >= 0 && blk < a.num_blocks;
}

// Element offset of token t's K row (this layer, block b's KV head) in cache block blk; its V
// row is st.kv further.
template <int D>
__device__ __forceinline__ int64_t decode_k_row(const DecodeArgs &a, const DecodeBlock &b, int blk,
                                                int t) {
  return (int64_t)blk * a.st.block + (int64_t)(t & (a.block_size - 1)) * a.st.token +
         a.layer_offset + (int64_t)b.kh * D;
}

// A warp's tile: TILE (<= 16) consecutive tokens from a TILE-aligned `base`. Blocks hold a power
// of two >= 8 tokens, so the tokens of each 8-token half of a tile (the whole tile when TILE <=
// 8) lie in one block: a tile reads two table entries, looked up one tile ahead, and keeps
// per half the element offset of its first token's K row. Token (h, r) of the tile (base + 8h
// + r) then sits at off[h] + r * st.token: one multiply-add per token, no division (the block
// size is a shift and a mask). A half whose block id is invalid, or that lies wholly outside
// [begin, end), points at block 0 instead, so every offset is a row inside the cache: a masked
// token's load is predicated off (ld_cs_if), never sent to a wild address.
template <int TILE> struct DecodeTile {
  static_assert(TILE >= 1 && TILE <= 16 && (TILE & (TILE - 1)) == 0, "1..16 tokens, 2^k");
  static constexpr int HALVES = TILE > 8 ? 2 : 1;
  int base;
  bool valid[HALVES];    // the half's block id names a page of the cache
  int64_t off[HALVES];   // K row of token base + 8h, KV head b.kh, this layer (V: + st.kv)

  // Tile `index` of block b's partition; reads the table only for halves it will read.
  template <int D>
  __device__ static DecodeTile of(const DecodeArgs &a, const DecodeBlock &b, const int32_t *btab,
                                  int index) {
    DecodeTile x;
    x.base = index * TILE;
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
      const int t0 = x.base + 8 * h, n = TILE < 8 ? TILE : 8;
      // The half's last token, t0 + n - 1, against begin (not its end t0 + n against it: t0
      // is a multiple of n, so t0 + n - 1 <= INT_MAX, whereas t0 + n passed INT_MAX for a
      // context's last half at 2^31 - 8, wrapped negative on the GPU and masked the context's
      // last tokens, the query's own included). The same add-and-compare as before, so the
      // same registers (ptxas, sm_90). A tile past `last` near 2^31 has a base wrapped
      // negative: its last token is below begin, masked as it must be.
      const int blk =
          (t0 < b.end && t0 + (n - 1) >= b.begin) ? btab[t0 >> a.block_shift] : -1;
      x.valid[h] = decode_block_ok(a, blk);
      x.off[h] = decode_k_row<D>(a, b, x.valid[h] ? blk : 0, t0);
    }
    return x;
  }

  // Token r (< 8, < TILE) of half h (0 when TILE <= 8): its K row's element offset, always
  // inside the cache, and whether it is attended (in [begin, end) and in a valid block).
  __device__ int64_t at(const DecodeArgs &a, int h, int r) const {
    return (h == 0 ? off[0] : off[HALVES - 1]) + (int64_t)r * a.st.token;
  }
  __device__ bool ok(const DecodeBlock &b, int h, int r) const {
    const int t = base + 8 * h + r;
    return (h == 0 ? valid[0] : valid[HALVES - 1]) && t >= b.begin && t < b.end;
  }
};

// ---------------------------------------------------------------------------------------------
// CUDA-core body: f32 storage (any group) and f16 / bf16 MHA.
//
// Lane layout as RowLayout: T_PER_TOK lanes per token with 16-byte chunks, TOK_PER_WARP tokens
// side by side per warp; a warp's tile is TOK_PER_WARP * U consecutive tokens (lane slot tg
// takes tokens tg, tg + TOK_PER_WARP, ...). Each lane slot keeps its own running max and sum per
// head (identical in the slot's lanes) and an accumulator for its lane's chunks; the slots of a
// warp are merged by shuffles at the end.

// Lane layout of one head row of D elements of T in the CUDA-core body.
template <typename T, int D> struct RowLayout {
  static constexpr int VEC = Elem<T>::VEC;            // elements per 16-byte chunk
  static constexpr int CHUNKS = D / VEC;              // 16-byte chunks per row
  static_assert(D % VEC == 0, "head_dim must be whole 16-byte vectors");
  // Lanes per token: the smallest of 8/16/32 that holds every chunk in <= 2 rounds.
  static constexpr int T_PER_TOK = CHUNKS <= 8 ? 8 : (CHUNKS <= 16 ? 16 : 32);
  static constexpr int NV = (CHUNKS + T_PER_TOK - 1) / T_PER_TOK;  // chunks per lane
  static constexpr int TOK_PER_WARP = 32 / T_PER_TOK;
  // Tokens a lane slot takes per tile: 4 (2 with two chunks per lane), so that a tile's K and
  // V are 128 bytes of loads per lane.
  static constexpr int UNROLL = NV == 1 ? 4 : 2;
};

template <typename T, int D, int GT> struct SimtDecode {
  using L = RowLayout<T, D>;
  // Tokens per lane slot per tile. K and V of one tile are 2 * U * NV 16-byte loads per lane,
  // in flight while the previous tile is computed. Eight f32 heads of 256 dims keep 128
  // registers of query and accumulator live, so they take one token per tile.
  static constexpr int U = (GT == 8 && L::NV == 2) ? 1 : L::UNROLL;
  static constexpr int TILE = L::TOK_PER_WARP * U;
  static constexpr size_t smem_bytes() {  // the warps' states, or the split merge's scratch
    return (DecodeMerge<GT, D>::FLOATS > (size_t)split_merge_floats<GT, D>()
                ? DecodeMerge<GT, D>::FLOATS : (size_t)split_merge_floats<GT, D>()) * sizeof(float);
  }
  static constexpr int SMEM_FLOATS = (int)(smem_bytes() / sizeof(float));  // the merge's scratch
  // The one-head 16-bit body (MHA) held to the blocks per SM the plan counts on
  // (decode_resident): left alone, ptxas gave d80 - d112 80 registers (6 blocks) once the split
  // merge changed, though 72 fit without spilling. 0: no bound (ptxas's own choice; bounding
  // the f32 bodies so spilled 8-24 bytes).
  static constexpr int MIN_BLOCKS = GT == 1 && sizeof(T) == 2 ? decode_resident(1, D) : 0;
};

// A block with tokens to attend: its partition, then the merge of its warps (the body).
template <typename T, int D, int GT>
__device__ __forceinline__ void decode_simt_attend(const DecodeArgs &a, const DecodeBlock &b,
                                                   float *smem) {
  using P = SimtDecode<T, D, GT>;
  using L = typename P::L;
  using Mg = DecodeMerge<GT, D>;
  constexpr int VEC = L::VEC, NV = L::NV, TPT = L::T_PER_TOK, TPW = L::TOK_PER_WARP;
  constexpr int U = P::U, TILE = P::TILE;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tg = lane / TPT;  // token slot of this lane inside its warp
  const int li = lane % TPT;  // lane inside the token's lane group

  // Query chunks of this lane, f32, per served head (zero past ng).
  float q[GT][NV][VEC];
  float slope[GT];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    slope[g] = (a.alibi_slopes != nullptr && g < b.ng)
                   ? a.alibi_slopes[b.kh * a.group + b.g0 + g] : 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = li + k * TPT;
      if (g < b.ng && c < L::CHUNKS) {
        const T *qp = reinterpret_cast<const T *>(a.query) + b.q0 + g * D + c * VEC;
        vec_to_f32<T>(ld_vec(qp), q[g][k]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) q[g][k][e] = 0.f;
      }
    }
  }

  const T *cache = reinterpret_cast<const T *>(a.cache);
  const int32_t *btab = a.block_tables + (int64_t)b.seq * a.max_blocks_per_seq;
  using Tile = DecodeTile<TILE>;
  // Slot tg's token of step u: half (u * TPW) >> 3, index r in it (TPW divides 8, so a step's
  // TPW tokens share a half).
  static_assert(8 % TPW == 0, "a step's tokens share a tile half");
  auto half_of = [](int u) { return (u * TPW) >> 3; };
  auto idx_of = [&](int u) { return ((u * TPW) & 7) + tg; };
  // This lane's chunks of the K (plus = 0) or V (plus = st.kv) rows of its slot's tokens of
  // tile x, predicated: zero for masked tokens and chunks past the row (not read, never
  // weighted; a chunk past the row meets a zero query).
  auto load = [&](const Tile &x, int64_t plus, uint4 (&r)[U][NV]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const T *p = cache + x.at(a, half_of(u), idx_of(u)) + plus;
      const bool ok = x.ok(b, half_of(u), idx_of(u));
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int c = li + k * TPT;
        r[u][k] = ld_cs_or_zero<uint4>(p + (c < L::CHUNKS ? c : 0) * VEC, ok && c < L::CHUNKS);
      }
    }
  };

  float m[GT], l[GT], acc[GT][NV][VEC];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[g][k][e] = 0.f;
  }

  const int first = b.begin / TILE, last = (b.end - 1) / TILE;
  uint4 kr[U][NV], vr[U][NV];
  Tile cur = Tile::template of<D>(a, b, btab, first + warp);  // past `last`: all masked
  load(cur, 0, kr);
  load(cur, a.st.kv, vr);
  for (int tile = first + warp; tile <= last; tile += DEC_WARPS) {
    const Tile nxt = Tile::template of<D>(a, b, btab, tile + DEC_WARPS);  // table reads ahead

    // Logits of this tile (every lane of a token's group ends with the same values).
    float s[U][GT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float dot[GT];
#pragma unroll
      for (int g = 0; g < GT; ++g) dot[g] = 0.f;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        float kf[VEC];
        vec_to_f32<T>(kr[u][k], kf);
#pragma unroll
        for (int g = 0; g < GT; ++g)
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot[g] = fmaf(q[g][k][e], kf[e], dot[g]);
      }
      const int i = u * TPW + tg;
      const bool ok = cur.ok(b, half_of(u), idx_of(u));
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        dot[g] = group_sum<TPT>(dot[g]);
        s[u][g] = ok ? attn_logit(dot[g], a.scale, a.softcap, slope[g], cur.base + i, b.qpos,
                                  a.window)
                     : -INFINITY;
      }
    }
    load(nxt, 0, kr);  // the next tile's K, in flight from here

    // Online softmax: rescale by e^(m_old - m_new) when the max grows.
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float mt = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) mt = fmaxf(mt, s[u][g]);
      const float alpha = m[g] == -INFINITY ? 0.f : __expf(m[g] - mt);
      m[g] = mt;
      l[g] *= alpha;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        s[u][g] = safe_exp(s[u][g], mt);  // now p
        l[g] += s[u][g];
      }
#pragma unroll
      for (int k = 0; k < NV; ++k)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][k][e] *= alpha;
    }
    // acc += p * V (a masked token has p = 0 and V = 0).
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        float vf[VEC];
        vec_to_f32<T>(vr[u][k], vf);
#pragma unroll
        for (int g = 0; g < GT; ++g)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g][k][e] = fmaf(s[u][g], vf[e], acc[g][k][e]);
      }
    load(nxt, a.st.kv, vr);  // the next tile's V
    cur = nxt;
  }

  // Merge the warp's token slots (lanes li, li + TPT, ...) to the slots' common max.
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    float mw = m[g];
#pragma unroll
    for (int o = TPT; o < 32; o <<= 1) mw = fmaxf(mw, __shfl_xor_sync(0xffffffffu, mw, o));
    const float sc = m[g] == -INFINITY ? 0.f : __expf(m[g] - mw);
    l[g] *= sc;
#pragma unroll
    for (int o = TPT; o < 32; o <<= 1) l[g] += __shfl_xor_sync(0xffffffffu, l[g], o);
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float x = acc[g][k][e] * sc;
#pragma unroll
        for (int o = TPT; o < 32; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
        acc[g][k][e] = x;
      }
    m[g] = mw;
  }
  if (tg == 0) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      if (li == 0) {
        Mg::max_of(smem, warp)[g] = m[g];
        Mg::sum_of(smem, warp)[g] = l[g];
      }
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int c = li + k * TPT;
        if (c < L::CHUNKS)
#pragma unroll
          for (int e = 0; e < VEC; ++e) Mg::acc_of(smem, warp, g)[c * VEC + e] = acc[g][k][e];
      }
    }
  }
  __syncthreads();
  decode_merge_and_store<T, D, GT>(a, b, smem);
}

template <typename T, int D, int GT>
__global__ void __launch_bounds__(DEC_THREADS, SimtDecode<T, D, GT>::MIN_BLOCKS)
    decode_simt_kernel(const DecodeArgs a) {
  grid_dependency_entry();  // PKV_LAUNCH_PROGRAMMATIC: before any read
  using P = SimtDecode<T, D, GT>;
  extern __shared__ float smem[];
  const DecodeBlock b = DecodeBlock::of<D>(a, GT);
  if (b.begin < b.end)
    decode_simt_attend<T, D, GT>(a, b, smem);
  else
    decode_store_empty<T, D>(a, b);
  // One call site: the merge is inlined once per instance (see decode_mma_kernel).
  static_assert(P::SMEM_FLOATS >= split_merge_floats<GT, D>(), "the split merge's scratch");
  if (a.num_splits > 1) decode_finish_split<T, D, GT>(a, b, smem);
}

}  // namespace pkv
