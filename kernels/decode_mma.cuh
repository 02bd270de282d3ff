// decode_mma.cuh: the tensor-core decode body for GQA with f16 / bf16 storage (the shared
// partitioning, setup and merge are decode_v2.cuh's; the mma primitive is mma.cuh's).
//
// Why: on CUDA cores every K/V element costs GT FMAs per pass (one per query head served), so
// at GT = 4..8 the group's arithmetic, not memory, set the pace (issue 15). Here a warp's work
// per 16-token tile is D/16 * 2 mma for S = Q K^T plus D/16 for O += P V, whatever the group,
// and the loads go straight from global memory into the mma operand registers.
//
// One warp, one tile of 16 consecutive tokens (16-aligned), lane l with g = l / 4, q = l % 4:
//
// S = Q K^T, m16n8k16 per 8 tokens (n) x 16 dims (k): A = the query heads as rows (head g in
//   row g; rows 8..15 hold heads 8..15 when a block serves 16, else zero), B = K^T, the 8
//   tokens' K rows as columns. The k (dimension) order inside the mma is free as long as A and
//   B use the same one; it is chosen so that each lane reads 16 contiguous bytes of its token's
//   K row per 32 dims: dims 32G + 8q .. 32G + 8q + 7 feed k-steps 2G (words 0, 1) and 2G + 1
//   (words 2, 3) as b[0], b[1]; Q takes the same order in a[0], a[2] (rows g) and a[1], a[3]
//   (rows g + 8), staged once per block in shared memory as ready-made A quads. A 16-dim tail
//   (D = 80, 112) uses 8 bytes at 32G + 4q. Lane (g, q) ends with S[head g][tokens 2q, 2q+1] of each 8-token half.
//
// Online softmax per head g over the lanes q of group g (two shuffles), then
// O^T = V^T P^T, m16n8k16 per 16 dims (m) x 8 heads (n) x the 16 tokens (k): B = P^T, whose
//   fragment (head g; tokens 2q, 2q+1, 2q+8, 2q+9) is exactly what this lane holds of S, packed
//   to T; A = V^T: lane (g, q) needs dims "g" and "g + 8" of each m-tile for tokens 2q, 2q+1,
//   2q+8, 2q+9. The dim order of the output is free too: m-tile i of a 64-dim segment maps row
//   g to dim 8g + 2i and row g + 8 to 8g + 2i + 1, so a lane reads 16 contiguous bytes of each
//   of its 4 tokens' V rows per 64 dims and packs word i of two tokens (pack_lo16 / pack_hi16).
//   Segments of 32 and 16 dims (8- and 4-byte reads) cover D = 80, 96, 112.
//   The accumulator fragment holds O[heads 2q, 2q+1][those dims]: D/4 f32 per lane, no padding
//   (8 heads = the mma's n), rescaled by the max of heads 2q, 2q+1 (two indexed shuffles).
//
// Heads: GT = 8 per block (groups of 2..8 in one block), or 16 for larger groups up to head dim
// 128 (ceil(group / 16) blocks, each K/V byte read half as often as with 8): the A rows 8..15
// that are zero otherwise carry heads 8..15 into S at no extra mma, and P V runs once per
// 8-head half (a second accumulator). Rows past the group are zero queries whose results are
// never stored.
// Pipelining: for D <= 128 the next tile's K is issued right after S and its V right after PV,
// so each lane keeps a tile's worth of loads (256 bytes) in flight through the compute; at
// D = 256 that would need ~230 registers, so a tile issues its K, computes S, issues its V, and
// the other warps (2 blocks per SM) cover the latency.
#pragma once

#include "decode_merge_weighted.cuh"
#include "decode_v2.cuh"
#include "mma.cuh"

namespace pkv {

template <typename T, int D, int GT_ = 8> struct MmaDecode {
  static constexpr int GT = GT_;              // heads per block: 8 (the mma's n) or 16
  static constexpr int NH = GT / 8;           // 8-head halves: rows g and g + 8 of S
  static_assert(GT == 8 || (GT == 16 && D <= 128), "16 heads fit shared memory up to d128");
  static constexpr int TILE = 16;             // tokens per warp tile: the PV mma's k
  static constexpr int KG = D / 32;           // 32-dim K groups: one 16-byte read per lane
  static constexpr bool KTAIL = D % 32 != 0;  // a last 16-dim k-step: one 8-byte read
  static constexpr int VS4 = D / 64;          // 64-dim V segments (4 m-tiles): 16-byte reads
  static constexpr bool VS2 = D % 64 >= 32;   // a 32-dim segment (2 m-tiles): 8-byte reads
  static constexpr bool VS1 = D % 32 != 0;    // a 16-dim segment (1 m-tile): 4-byte reads
  static constexpr int MT = D / 16;           // m-tiles of O^T
  static constexpr bool PIPE = D <= 128;      // prefetch the next tile (see the top)
  // K loads whose masked tokens give unspecified values (ld_cs_masked) rather than zeros: the
  // zeroed form made ptxas copy one loaded register right after its load in the pipelined
  // bodies (the first tile's K before the queries are staged, the next tile's K before this
  // tile's softmax), so each warp waited out the load's latency there instead of computing
  // under it. Not at d112 (its 8-head body went from 128 to 158 registers, 4 -> 3 blocks per
  // SM; held to 128 it spilled) nor d256 (not pipelined; 166 -> 232 registers).
  static constexpr bool MASKED_K = PIPE && D != 112;
  static_assert(D % 16 == 0 && MT == 4 * VS4 + 2 * VS2 + VS1, "head dim must be 16-dim steps");
  // The queries, staged as the S mma's A fragments: NQ quads per lane (two per 32-dim group,
  // one for a 16-dim tail), each the 4 registers of one k-step, so one 16-byte shared load
  // feeds an mma with no register shuffling (the zero rows included).
  static constexpr int NQ = 2 * KG + (KTAIL ? 1 : 0);
  static constexpr size_t q_bytes() { return (size_t)NQ * 32 * sizeof(uint4); }
  static constexpr size_t smem_bytes() {
    return q_bytes() + DecodeMerge<GT, D>::FLOATS * sizeof(float);
  }
  static constexpr int SMEM_FLOATS = (int)(smem_bytes() / sizeof(float));  // the merge's scratch
};

// One tile's K operands of this lane: tokens g (n-tile 0) and 8 + g (n-tile 1).
template <typename T, int D> struct MmaK {
  using P = MmaDecode<T, D>;
  uint4 full[2][P::KG > 0 ? P::KG : 1];
  uint2 tail[2];
};
// One tile's V operands of this lane: tokens 2q, 2q+1, 2q+8, 2q+9 (j = 0..3).
template <typename T, int D> struct MmaV {
  using P = MmaDecode<T, D>;
  uint4 s4[P::VS4 > 0 ? P::VS4 : 1][4];
  uint2 s2[4];
  uint32_t s1[4];
};

// A block with tokens to attend: its partition, then the merge of its warps (the body).
template <typename T, int D, int GT_>
__device__ __forceinline__ void decode_mma_attend(const DecodeArgs &a, const DecodeBlock &b,
                                                  float *smem) {
  using P = MmaDecode<T, D, GT_>;
  using Mg = DecodeMerge<P::GT, D>;
  constexpr int GT = P::GT, NH = P::NH, TILE = P::TILE, KG = P::KG, VS4 = P::VS4, MT = P::MT;
  uint4 *qa = reinterpret_cast<uint4 *>(smem);                   // [NQ][32 lanes]
  float *sm = smem + P::q_bytes() / sizeof(float);               // DecodeMerge
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;

  const T *cache = reinterpret_cast<const T *>(a.cache);
  const int32_t *btab = a.block_tables + (int64_t)b.seq * a.max_blocks_per_seq;
  using Tile = DecodeTile<TILE>;
  // K of tokens g (n-tile 0) and 8 + g (n-tile 1), and V of tokens 2q + (j & 1) + 8 (j >> 1):
  // a masked token's loads are predicated off (no traffic). Its V gives zeros (its weight is 0,
  // but 0 x NaN is not; fresh registers: keeping the old values instead would keep them live
  // across the tile, ~25-80 registers); its K gives zeros or, with MASKED_K, whatever the
  // registers held, since its logit is replaced by -inf below.
  auto load_k = [&](const Tile &x, MmaK<T, D> &k) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const T *p = cache + x.at(a, nt, g);
      const bool ok = x.ok(b, nt, g);
#pragma unroll
      for (int G = 0; G < KG; ++G)
        k.full[nt][G] = P::MASKED_K ? ld_cs_masked<uint4>(p + 32 * G + 8 * q, ok)
                                    : ld_cs_or_zero<uint4>(p + 32 * G + 8 * q, ok);
      if constexpr (P::KTAIL)
        k.tail[nt] = P::MASKED_K ? ld_cs_masked<uint2>(p + 32 * KG + 4 * q, ok)
                                 : ld_cs_or_zero<uint2>(p + 32 * KG + 4 * q, ok);
    }
  };
  auto load_v = [&](const Tile &x, MmaV<T, D> &v) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int h = j >> 1, r = 2 * q + (j & 1);
      const T *p = cache + x.at(a, h, r) + a.st.kv;
      const bool ok = x.ok(b, h, r);
#pragma unroll
      for (int s = 0; s < VS4; ++s) v.s4[s][j] = ld_cs_or_zero<uint4>(p + 64 * s + 8 * g, ok);
      if constexpr (P::VS2) v.s2[j] = ld_cs_or_zero<uint2>(p + 64 * VS4 + 4 * g, ok);
      if constexpr (P::VS1)
        v.s1[j] = ld_cs_or_zero<uint32_t>(p + 64 * VS4 + 32 * P::VS2 + 2 * g, ok);
    }
  };
  const int first = b.begin / TILE, last = (b.end - 1) / TILE;
  MmaK<T, D> kr;
  MmaV<T, D> vr;
  // The first tile's table read and loads go out before the queries are staged, so their
  // latencies overlap instead of adding up (a batch-1 block walks only a few tiles).
  Tile cur = Tile::template of<D>(a, b, btab, first + warp);
  if (P::PIPE) {  // a tile past `last` has every token masked: its loads are predicated off
    load_k(cur, kr);
    load_v(cur, vr);
  }

  // The served heads' queries into shared memory as A fragments (see MmaDecode::NQ): quad
  // (k, lane (g, q)) = words w, w + 1 (2 dims each) of rows g and g + 8 in the mma's register
  // order {row g w, row g+8 w, row g w+1, row g+8 w+1}, with w = 16 G + 4q + 2 half for k-step
  // 2G + half, and w = 16 KG + 2q for the tail; rows past ng (and rows 8..15 of an 8-head
  // block) are zero.
  {
    const uint32_t *qw = reinterpret_cast<const uint32_t *>(reinterpret_cast<const T *>(a.query) +
                                                            b.q0);
    constexpr int ROW_WORDS = D / 2;
    for (int i = threadIdx.x; i < P::NQ * 32; i += DEC_THREADS) {
      const int k = i / 32, l = i % 32, gg = l / 4, qq = l % 4;
      const int w = k < 2 * KG ? 16 * (k / 2) + 4 * qq + 2 * (k % 2) : 16 * KG + 2 * qq;
      const bool lo = gg < b.ng, hi = NH == 2 && gg + 8 < b.ng;
      const uint32_t *r0 = qw + gg * ROW_WORDS + w, *r1 = qw + (gg + 8) * ROW_WORDS + w;
      qa[i] = make_uint4(lo ? r0[0] : 0u, hi ? r1[0] : 0u, lo ? r0[1] : 0u, hi ? r1[1] : 0u);
    }
  }
  __syncthreads();

  float slope[NH];  // heads g and g + 8
#pragma unroll
  for (int hh = 0; hh < NH; ++hh) {
    const int h = g + 8 * hh;
    slope[hh] = (a.alibi_slopes != nullptr && h < b.ng)
                    ? a.alibi_slopes[b.kh * a.group + b.g0 + h] : 0.f;
  }

  // S[head g][tokens 2q, 2q+1 of each half]: s[nt][0..1]; s[nt][2..3]: head g + 8 (16 heads)
  // or the zero rows.
  auto scores = [&](const MmaK<T, D> &k, float (&s)[2][4]) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll
    for (int G = 0; G < KG; ++G) {
      const uint4 f0 = qa[(2 * G) * 32 + lane], f1 = qa[(2 * G + 1) * 32 + lane];
      const uint32_t a0[4] = {f0.x, f0.y, f0.z, f0.w}, a1[4] = {f1.x, f1.y, f1.z, f1.w};
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const uint32_t b0[2] = {k.full[nt][G].x, k.full[nt][G].y};
        const uint32_t b1[2] = {k.full[nt][G].z, k.full[nt][G].w};
        mma_m16n8k16<T>(s[nt], a0, b0, s[nt]);
        mma_m16n8k16<T>(s[nt], a1, b1, s[nt]);
      }
    }
    if constexpr (P::KTAIL) {
      const uint4 ft = qa[(2 * KG) * 32 + lane];
      const uint32_t at[4] = {ft.x, ft.y, ft.z, ft.w};
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const uint32_t bt[2] = {k.tail[nt].x, k.tail[nt].y};
        mma_m16n8k16<T>(s[nt], at, bt, s[nt]);
      }
    }
  };
  // o[mt] += V^T P^T for m-tile mt (A: word i of two tokens' reads, see the top).
  auto pv = [&](const MmaV<T, D> &v, const uint32_t (&bp)[2], float (&o)[MT][4]) {
    auto step = [&](int mt, uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
      const uint32_t av[4] = {pack_lo16(w0, w1), pack_hi16(w0, w1), pack_lo16(w2, w3),
                              pack_hi16(w2, w3)};
      mma_m16n8k16<T>(o[mt], av, bp, o[mt]);
    };
#pragma unroll
    for (int s = 0; s < VS4; ++s) {
      step(4 * s + 0, v.s4[s][0].x, v.s4[s][1].x, v.s4[s][2].x, v.s4[s][3].x);
      step(4 * s + 1, v.s4[s][0].y, v.s4[s][1].y, v.s4[s][2].y, v.s4[s][3].y);
      step(4 * s + 2, v.s4[s][0].z, v.s4[s][1].z, v.s4[s][2].z, v.s4[s][3].z);
      step(4 * s + 3, v.s4[s][0].w, v.s4[s][1].w, v.s4[s][2].w, v.s4[s][3].w);
    }
    if constexpr (P::VS2) {
      step(4 * VS4 + 0, v.s2[0].x, v.s2[1].x, v.s2[2].x, v.s2[3].x);
      step(4 * VS4 + 1, v.s2[0].y, v.s2[1].y, v.s2[2].y, v.s2[3].y);
    }
    if constexpr (P::VS1) step(MT - 1, v.s1[0], v.s1[1], v.s1[2], v.s1[3]);
  };

  // Per 8-head half hh (heads g + 8 hh): the running max, this lane's share of the sum, and the
  // accumulator columns (heads 8 hh + 2q, 8 hh + 2q + 1).
  float m[NH], l[NH], o[NH][MT][4];
#pragma unroll
  for (int hh = 0; hh < NH; ++hh) {
    m[hh] = -INFINITY;
    l[hh] = 0.f;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[hh][mt][e] = 0.f;
  }

  for (int t = first + warp; t <= last; t += DEC_WARPS) {
    const Tile nxt = Tile::template of<D>(a, b, btab, t + DEC_WARPS);  // table reads in flight
    if (!P::PIPE) load_k(cur, kr);
    float s[2][4];
    scores(kr, s);
    if (P::PIPE) {
      load_k(nxt, kr);  // past `last`: predicated off
    } else {
      load_v(cur, vr);
    }

    // Online softmax for heads g (+ 8) over this tile: lane q holds tokens 2q, 2q+1, 8+2q, 9+2q.
#pragma unroll
    for (int hh = 0; hh < NH; ++hh) {
      float x[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int h = j >> 1, r = 2 * q + (j & 1);
        x[j] = cur.ok(b, h, r) ? attn_logit(s[h][2 * hh + (j & 1)], a.scale, a.softcap,
                                            slope[hh], cur.base + 8 * h + r, b.qpos, a.window)
                               : -INFINITY;
      }
      float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      mx = fmaxf(mx, m[hh]);
      const float alpha = m[hh] == -INFINITY ? 0.f : __expf(m[hh] - mx);
      m[hh] = mx;
      float p[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) p[j] = safe_exp(x[j], mx);
      l[hh] = l[hh] * alpha + ((p[0] + p[1]) + (p[2] + p[3]));
      // Rescale only when some head's max grew in this tile (alpha < 1 somewhere in the warp):
      // once the max settles, most tiles skip it, and x * 1 = x, so the result is the same
      // bit for bit. (16-head blocks rescale always: the vote's extra live range made ptxas
      // spill the d64 instance.) The accumulator columns are heads 8 hh + 2q and + 1: their
      // alphas live in lane groups 2q, 2q + 1.
      if (NH == 2 || __any_sync(0xffffffffu, alpha != 1.f)) {
        const float al0 = __shfl_sync(0xffffffffu, alpha, 8 * q);
        const float al1 = __shfl_sync(0xffffffffu, alpha, 8 * q + 4);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          o[hh][i][0] *= al0;
          o[hh][i][1] *= al1;
          o[hh][i][2] *= al0;
          o[hh][i][3] *= al1;
        }
      }
      const uint32_t bp[2] = {pack_f32x2<T>(p[0], p[1]), pack_f32x2<T>(p[2], p[3])};
      pv(vr, bp, o[hh]);
    }
    if (P::PIPE) load_v(nxt, vr);
    cur = nxt;
  }

  // This warp's state into shared memory: heads g (+ 8)'s max and sum (summed over the group's
  // lanes), and the accumulator columns 8 hh + 2q, 8 hh + 2q + 1 at this lane's dims.
#pragma unroll
  for (int hh = 0; hh < NH; ++hh) {
    float lt = l[hh];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    if (q == 0) {
      Mg::max_of(sm, warp)[g + 8 * hh] = m[hh];
      Mg::sum_of(sm, warp)[g + 8 * hh] = lt;
    }
    float *o0 = Mg::acc_of(sm, warp, 8 * hh + 2 * q), *o1 = Mg::acc_of(sm, warp, 8 * hh + 2 * q + 1);
    auto put = [&](int mt, int dim) {  // rows g, g + 8 of m-tile mt are dims dim, dim + 1
      o0[dim] = o[hh][mt][0];
      o1[dim] = o[hh][mt][1];
      o0[dim + 1] = o[hh][mt][2];
      o1[dim + 1] = o[hh][mt][3];
    };
#pragma unroll
    for (int s = 0; s < VS4; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) put(4 * s + i, 64 * s + 8 * g + 2 * i);
    if constexpr (P::VS2) {
      put(4 * VS4 + 0, 64 * VS4 + 4 * g);
      put(4 * VS4 + 1, 64 * VS4 + 4 * g + 2);
    }
    if constexpr (P::VS1) put(MT - 1, 64 * VS4 + 32 * P::VS2 + 2 * g);
  }
  __syncthreads();
  decode_merge_and_store<T, D, GT>(a, b, sm);
}

template <typename T, int D, int GT_>
__global__ void __launch_bounds__(DEC_THREADS) decode_mma_kernel(const DecodeArgs a) {
  grid_dependency_entry();  // PKV_LAUNCH_PROGRAMMATIC: before any read
  using P = MmaDecode<T, D, GT_>;
  extern __shared__ float smem[];
  const DecodeBlock b = DecodeBlock::of<D>(a, P::GT);
  if (b.begin < b.end)
    decode_mma_attend<T, D, GT_>(a, b, smem);
  else
    decode_store_empty<T, D>(a, b);
  // One call site: the merge is inlined once per instance, after the body's registers are
  // free (it adds nothing to the body's register count).
  static_assert(P::SMEM_FLOATS >= P::GT * (D + 1), "the merge's sums and a weight per head");
  if (a.num_splits > 1) decode_finish_split_weighted<T, D, P::GT>(a, b, smem, P::SMEM_FLOATS);
}

}  // namespace pkv
