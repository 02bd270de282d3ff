// prefill_wgmma.cuh: prefill attention on Hopper's warpgroup tensor-core instruction (wgmma,
// sm_90a) for f16 / bf16 caches at head dims up to 128. Same arguments (PrefillArgs) and
// semantics as prefill_mma.cuh (pagedkv.h, the CPU oracle src/attn/cpu.rs), 64 rows per
// warpgroup (warp w rows 16w .. 16w + 15) and one or two warpgroups per thread block (64 or 128
// rows sharing each K / V tile: Cfg's WG), key tiles of 64 or 128 keys (Cfg::BC; double-
// buffered cp.async copies with the K row addresses a tile ahead), same logit transform
// and online softmax. What changes is how the products read K and V: wgmma takes B straight from
// shared memory through a descriptor, so the ldmatrix loads that bound prefill_mma's tensor pipe
// (ncu: warps waiting on shared-memory loads, tensor pipe 37%) are gone:
//   S = Q K^T   per k16 step of the head dim, one m64nBCk16 (A: the warp's Q fragments in
//               registers, B: the tile's K rows, K-major)
//   O += P V    per 16 keys, one m64nDk16 (A: P packed from the S accumulators, B: the tile's V
//               rows, MN-major)
// Both read the tile in a swizzled layout of wgmma.cuh (Cfg::SW: 128 bytes at d64 / d128):
// K [BC keys][D] and V likewise, stored as column blocks of SW / 2 dims, each BC key rows of SW
// bytes whose 16-byte chunks are XOR-permuted by the row, so the tensor core's reads of 8 rows'
// same chunk hit 8 bank groups (the no-swizzle core-matrix layout this replaced put them all in
// one: ncu on an H100, 57% of the shared wavefronts excess, 130-248 TFLOP/s against 300 for the
// mma.sync kernel), and a warp's copies read whole K / V rows (the old layout's eight 64-byte
// pieces per copy instruction cost twice the L2 requests per byte). The instruction is
// warpgroup-wide: every warp takes part in every tile of its block (no per-warp skip of tiles
// its rows cannot see; the mask zeroes them).
//
// Two schedules (Cfg's OVL):
// - in order: per tile, S (the next tile's copies and row addresses queued while it runs);
//   wait; softmax; P V; wait. The tensor cores idle while a warpgroup runs its softmax unless
//   another warpgroup fills them.
// - overlapped: tile j issues S(j) and then P(j - 1) V(j - 1) and waits for S(j) only, so the
//   softmax of tile j runs while P V of tile j - 1 is on the tensor cores; O is rescaled once
//   that product is in (O = alpha_j (O + P(j-1) V(j-1)), the same sum). K and V of a tile are
//   then copied one iteration apart (K(j + 1) and V(j) at the top of iteration j: the stage that
//   V(j) overwrites was last read by P V of tile j - 2, waited for in iteration j - 1), with the
//   same two stages, and the row addresses kept for three tiles.
//
// Shared memory (T elements, from the first 1024-byte boundary): stage s (s = 0, 1): K [BC * D],
// V [BC * D] (the swizzled layout); Q is staged in stage 1 in rows of D + 8 (ldmatrix, before
// its first use; after the stages where it does not fit); then the key validity flags [2][BC]
// int and the K row addresses [KROWS][BC]. At the end each warp stages its 16 output rows in
// the stage the last tile left free (or Q's own region) for whole 16-byte stores.
#pragma once

#include "prefill_mma.cuh"
#include "wgmma.cuh"

namespace pkv {
namespace pfwg {

using pfmma::cp_async16;
using pfmma::cp_async_commit;
using pfmma::cp_async_wait;
using pfmma::LOG2E;
using pfmma::causal_tile;
using pfmma::mask_tile;
using pfmma::p_fragment;
using pfmma::plain_logits;
using pfmma::PrefillBlock;
using pfmma::rescale_tile;
using pfmma::pack_p;
using pfmma::softmax_tile;
using pfmma::softmax_tile_f32;
using pfmma::stage_q;
using pfmma::store_tile_staged;
using pfmma::tile_kind;
using pfmma::TileKind;
using pfmma::TILE_CAUSAL;
using pfmma::TILE_SCALE;

// WG warpgroups per thread block (1 or 2), each its own 64 rows, all sharing the K / V tiles:
// at 2, every tile copied from L2 serves 128 rows instead of 64. OVL: the overlapped schedule.
template <int D, int WG, bool OVL = false> struct Cfg {
  static_assert(D % 16 == 0 && D >= 64 && D <= 128, "wgmma widths: n = 64 (S) and n = D (O)");
  static_assert(WG == 1 || WG == 2, "one or two warpgroups");
  static constexpr int NT = 128 * WG;             // threads
  static constexpr int ROWS = 64 * WG;            // one m64 tile per warpgroup
  // Keys per tile (the S wgmma's n): 128 with two warpgroups above head dim 64 (a tile's
  // products, barriers, copy waits and row reductions serve twice the keys: H100, bf16, 1.08-
  // 1.24x faster at every chunk over cached tokens at d80 / d96 / d128, BENCHMARKS.md); 64
  // with one (which keeps 2-3 blocks per SM) and at d64, where two warpgroups fit 2 blocks
  // per SM with 64-key tiles (125 registers) but one with 128 (178): 2048-token chunks ran
  // 0.68-0.86x as fast so.
  static constexpr int BC = WG == 2 && D > 64 ? 128 : 64;
  static constexpr int CH = D / 8;                // 16-byte chunks per row
  static constexpr int LDQ = D + 8;               // Q staging row stride (ldmatrix)
  static constexpr int KSTEPS = D / 16;           // k16 steps of Q K^T
  static constexpr int NT_S = BC / 8;             // n8 tiles of S
  static constexpr int NT_O = D / 8;              // n8 tiles of O
  static constexpr int STAGE = 2 * BC * D;        // elements of one stage (K then V)
  // The swizzle: the widest whose atom rows (SW bytes, SW / 2 dims) tile the head dim (d64 /
  // d128: 128 bytes; d96: 64; d80 / d112: 32). A tile is ATOMS column blocks of SW / 2 dims,
  // each BC key rows of SW bytes (wgmma.cuh's swizzled layouts, K-major and MN-major alike).
  static constexpr int SW = D % 64 == 0 ? 128 : D % 32 == 0 ? 64 : 32;
  static constexpr int ATOM = SW / 2;             // dims per atom row
  static constexpr int ATOMS = D / ATOM;          // column blocks of a tile
  static constexpr uint32_t ATOM_BYTES = BC * SW; // one column block: LBO of P V's V
  static constexpr int ROW_CHUNKS = SW / 16;      // 16-byte chunks per atom row
  static_assert(D % ATOM == 0 && (2 * BC * D) % 1024 == 0, "tiles start on the pattern");
  static constexpr int KROWS = OVL ? 3 : 2;       // tiles whose K row addresses are kept
  // Thread blocks per SM the registers must allow. One warpgroup: 3 (<= 168 per thread) up to
  // head dim 96 (the body takes 128-165 in order, 146-168 overlapped; d96 overlapped spills
  // 12 bytes); 2 above (d128: 197 / 213; 3 would spill). Two warpgroups: 2 at d64 (64-key
  // tiles, 125 / 128 registers: see BC), else 1 (128-key tiles, d128: 243 / 255).
  static constexpr int MIN_BLOCKS = WG == 2 ? (D <= 64 ? 2 : 1) : D <= 96 ? 3 : 2;
  // Q is staged in stage 1 (before tile 1 is copied there) where it fits, else after the
  // stages.
  static constexpr int Q_ELEMS = ROWS * LDQ <= STAGE ? 0 : ROWS * LDQ;
  // The stages, Q, the flags and row addresses, and 1024 bytes to align the stages to the
  // swizzle's pattern (shared_align1024).
  static constexpr size_t smem_bytes = 2 * ((size_t)2 * STAGE + (size_t)Q_ELEMS) +
                                       2 * BC * sizeof(int) + KROWS * BC * sizeof(void *) + 1024;
  static constexpr int COPIES = (BC * CH + NT - 1) / NT;  // 16-byte pieces per thread, tensor
  static_assert(BC <= NT, "one thread per key writes the row addresses");
};

// Queues the copy of the keys whose K rows krow holds into the swizzled layout: with K_, K
// into sk and the keys' validity into kvalid; with V_, V into sv. An invalid key (nullptr) is
// zero-filled (and flagged). Piece i (= thread + k NT) is key i / CH, chunk i % CH: a warp
// reads whole rows (two 256-byte K rows at d128, as prefill_mma's copy), and the 8 lanes of a
// shared-memory phase write one key's 8 chunks of an atom row, which the swizzle spreads over
// the 32 banks.
template <typename T, int D, int WG, bool K_, bool V_>
__device__ __forceinline__ void load_tile(const PrefillArgs &a, const T *const *krow, T *sk,
                                          T *sv, int *kvalid) {
  using C = Cfg<D, WG>;  // the copy's shape does not depend on the schedule
  const int64_t kv = a.st.kv;
#pragma unroll
  for (int k = 0; k < C::COPIES; ++k) {
    const int i = (int)threadIdx.x + k * C::NT;
    if ((C::BC * C::CH) % C::NT != 0 && i >= C::BC * C::CH) break;
    const int j = i / C::CH, c = i % C::CH;
    const uint32_t at = swizzled<C::SW>((uint32_t)(c / C::ROW_CHUNKS) * C::ATOM_BYTES +
                                        (uint32_t)j * C::SW +
                                        (uint32_t)(c % C::ROW_CHUNKS) * 16);
    T *dk = sk + at / sizeof(T), *dv = sv + at / sizeof(T);
    const T *p = krow[j];
    if (p != nullptr) {
      if (K_) cp_async16(dk, p + c * 8);
      if (V_) cp_async16(dv, p + kv + c * 8);
    } else {
      if (K_) *reinterpret_cast<uint4 *>(dk) = make_uint4(0, 0, 0, 0);
      if (V_) *reinterpret_cast<uint4 *>(dv) = make_uint4(0, 0, 0, 0);
    }
    if (K_ && c == 0) kvalid[j] = p != nullptr ? 1 : 0;
  }
}

// Accumulator (or P) registers a wgmma reads or writes: their writes happen before the fence
// and their reads after the wait (the pins order them), as the protocol asks.
template <int N> __device__ __forceinline__ void pin_all(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) wgmma_pin(r[i]);
}
template <int N> __device__ __forceinline__ void pin_all(uint32_t (&r)[N][2]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    wgmma_pin(r[i][0]);
    wgmma_pin(r[i][1]);
  }
}

// Issues S = Q K^T of the K tile at sk as one commit group (s zeroed first): k-step ks reads
// dims 16 ks .. 16 ks + 15 of every key, 32 bytes inside the atom row of column block
// 16 ks / ATOM (the start address steps inside the row; key octets 8 SW bytes apart: the
// stride offset).
template <typename T, typename C>
__device__ __forceinline__ void issue_s(float (&s)[C::NT_S][4],
                                        const uint32_t (&qf)[C::KSTEPS][4], const T *sk,
                                        const T *smem) {
#pragma unroll
  for (int t = 0; t < C::NT_S; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[t][e] = 0.f;
  float(&sf)[C::BC / 2] = reinterpret_cast<float(&)[C::BC / 2]>(s);
  pin_all(sf);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < C::KSTEPS; ++ks) {
    const int at = (16 * ks / C::ATOM) * (int)C::ATOM_BYTES + (16 * ks % C::ATOM) * 2;
    wgmma_rs<T, C::BC, 0>(
        sf, qf[ks],
        smem_desc(reinterpret_cast<const char *>(sk) + at, smem, 16, 8 * C::SW, C::SW), smem);
  }
  wgmma_commit();
}

// Issues O += P V of the V tile at sv as one commit group: k-step kk reads keys 16 kk ..
// 16 kk + 15 (16 atom rows further each step; 8-key groups 8 SW bytes apart: the stride
// offset), every dim (column blocks ATOM_BYTES apart: the leading offset).
template <typename T, typename C>
__device__ __forceinline__ void issue_pv(float (&o)[C::NT_O][4], uint32_t (&p)[C::NT_S][2],
                                         const T *sv, const T *smem) {
  float(&of)[C::NT_O * 4] = reinterpret_cast<float(&)[C::NT_O * 4]>(o);
  pin_all(of);
  pin_all(p);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < C::BC / 16; ++kk) {
    uint32_t pa[4];
    p_fragment(p, kk, pa);
    wgmma_rs<T, C::NT_O * 8, 1>(
        of, pa,
        smem_desc(reinterpret_cast<const char *>(sv) + kk * 16 * C::SW, smem, C::ATOM_BYTES,
                  8 * C::SW, C::SW),
        smem);
  }
  wgmma_commit();
}

template <typename C> __device__ __forceinline__ void settle_s(float (&s)[C::NT_S][4]) {
  pin_all(reinterpret_cast<float(&)[C::BC / 2]>(s));
}
template <typename C> __device__ __forceinline__ void settle_o(float (&o)[C::NT_O][4]) {
  pin_all(reinterpret_cast<float(&)[C::NT_O * 4]>(o));
}

// A warp's rows as the logit transform needs them: its lane's two rows' positions and ALiBi
// slopes (rows g and g + 8 of the warp's 16), and the warp's position range for tile_kind (a
// warp of padding rows has none: w_first -1, so no tile is scale-only for it and the causal or
// general mask covers it).
struct WarpRows {
  int qpos[2];
  float slope[2];
  int w_first, w_last;
  __device__ void of(const PrefillArgs &a, const PrefillBlock &b, int warp, int g) {
#pragma unroll
    for (int h = 0; h < 2; ++h) b.row(a, warp * 16 + g + 8 * h, qpos[h], slope[h]);
    const int wrows = min(16, b.nrows - warp * 16);
    w_first = wrows > 0 ? b.pos(a, warp * 16) : -1;
    w_last = b.pos(a, warp * 16 + max(wrows, 1) - 1);
  }
};

// The warp's Q fragments (S's A operand, one quad per k16 step) from the staged rows at sq
// (rows of C::LDQ elements), by ldmatrix: lanes 8j .. 8j + 7 name rows 0..7 of matrix j.
template <typename T, typename C>
__device__ __forceinline__ void q_fragments(uint32_t (&qf)[C::KSTEPS][4], const T *sq, int warp,
                                            int lane) {
  const int lrow = lane % 8, lmat = lane / 8;
#pragma unroll
  for (int ks = 0; ks < C::KSTEPS; ++ks)
    ldmatrix<4, false>(qf[ks], sq + (warp * 16 + (lmat % 2) * 8 + lrow) * C::LDQ + ks * 16 +
                                   (lmat / 2) * 8);
}

// The logit transform and mask of a key tile's S (tiles of keys kt .., flags kv_ok; this
// warp's rows at w_first .. w_last, this lane's at qpos with ALiBi slopes slope): the
// exponent's multiplier for the online softmax (the scale itself where tile_kind leaves the
// raw products).
template <int BC, int NT>
__device__ __forceinline__ float tile_logits(const PrefillArgs &a, bool plain, float scale_log2,
                                             float (&s)[NT][4], const int *kv_ok, int kt,
                                             int w_first, int w_last, int qd,
                                             const int (&qpos)[2], const float (&slope)[2]) {
  const TileKind kind = tile_kind<BC>(a, plain, kt, w_first, w_last, kv_ok);
  if (kind == TILE_SCALE) return scale_log2;
  if (kind == TILE_CAUSAL) {
    causal_tile(s, kt, qd, qpos);
    return scale_log2;
  }
  mask_tile(a, s, kv_ok, kt, qd, qpos, slope);
  return 1.f;
}

// One key tile in order (the plain and the persistent kernels): S = Q K^T of the K tile at
// sk, and while the tensor cores run it, beside_s() (the next tiles' copies and row
// addresses: they no longer stand between the tile's barrier and its first product); wait;
// logits(s) (the multiplier) and the online softmax; O += P V of the V tile at sv; wait.
template <typename T, typename C, typename Logits, typename Beside>
__device__ __forceinline__ void inorder_tile(const uint32_t (&qf)[C::KSTEPS][4], const T *sk,
                                             const T *sv, const T *smem, float (&o)[C::NT_O][4],
                                             float (&m)[2], float (&l)[2], Logits logits,
                                             Beside beside_s) {
  float s[C::NT_S][4];
  issue_s<T, C>(s, qf, sk, smem);
  beside_s();
  wgmma_wait<0>();
  settle_s<C>(s);
  const float mul = logits(s);
  uint32_t p[C::NT_S][2];
  float alphas[2];
  if (__any_sync(0xffffffffu, softmax_tile<T>(s, mul, m, l, alphas, p))) rescale_tile(o, alphas);
  issue_pv<T, C>(o, p, sv, smem);
  wgmma_wait<0>();
  settle_o<C>(o);
}

template <typename T, int D, int WG, bool OVL>
__global__ void __launch_bounds__(Cfg<D, WG, OVL>::NT, Cfg<D, WG, OVL>::MIN_BLOCKS)
    prefill_wgmma_kernel(const PrefillArgs a) {
  grid_dependency_entry();  // PKV_LAUNCH_PROGRAMMATIC: before any read
  using C = Cfg<D, WG, OVL>;
  // 1024-byte aligned: the swizzle pattern is read from shared address bits 4-9, and every
  // tile's offset is a multiple of 1024 (Cfg).
  extern __shared__ uint4 pw_smem[];
  T *smem = shared_align1024<T>(pw_smem);
  T *sq = C::Q_ELEMS == 0 ? smem + C::STAGE : smem + 2 * C::STAGE;   // see Cfg::Q_ELEMS
  int *kvalid = reinterpret_cast<int *>(smem + 2 * C::STAGE + C::Q_ELEMS);  // [2][BC]
  const T **krow = reinterpret_cast<const T **>(kvalid + 2 * C::BC);  // [KROWS][BC]

  pfmma::TableAhead<C::BC> ahead;
  ahead.read(a, blockIdx.z);
  PrefillBlock b;
  if (!b.template init<D>(a, C::ROWS, C::BC)) return;  // the whole block, before any barrier
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, qd = lane % 4;
  WarpRows wr;
  wr.of(a, b, warp, g);
  const bool plain = plain_logits(a);
  const float scale_log2 = a.scale * LOG2E;
  const T *cache = reinterpret_cast<const T *>(a.cache);
  // Row addresses of tile t into slot t % KROWS.
  auto rows_of = [&](int t) {
    pfmma::key_rows<T, D, C::BC>(a, cache, b.btab, b.bs_shift, b.head_off, b.kbegin + t * C::BC,
                          b.klast, krow + (t % C::KROWS) * C::BC);
  };

  // ---- prologue, as prefill_mma's: Q, row addresses of tiles 0 and 1 (slots 0 and 1 of
  // rows_of), key tile 0 (K only when overlapped: V(j) follows K(j + 1)) ----
  stage_q<T, D, C::NT>(a, b, sq, C::LDQ, C::ROWS);
  ahead.template rows<T, D>(a, cache, b, krow);
  __syncthreads();
  if (b.ntiles > 0)
    load_tile<T, D, WG, true, !OVL>(a, krow, smem, smem + C::BC * D, kvalid);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  uint32_t qf[C::KSTEPS][4];
  q_fragments<T, C>(qf, sq, warp, lane);

  float o[C::NT_O][4];
#pragma unroll
  for (int n = 0; n < C::NT_O; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  // The top of tile j: its copies landed and published (tile_ready); then the next copies
  // queued (in order: K and V of tile j + 1, while S of tile j runs; overlapped: K of tile
  // j + 1 and V of tile j, whose stage's V last fed P V of tile j - 2, waited for in iteration
  // j - 1), the row addresses of tile j + 2 (tile_copies).
  auto tile_ready = [&]() {
    cp_async_wait<0>();
    // Tile j's generic-proxy writes (cp.async, zero fills) visible to wgmma's async proxy,
    // then to every warp; every warp is done with the stages tile j's copies overwrite (their
    // wgmma waited for).
    fence_proxy_async_shared();
    __syncthreads();
  };
  auto tile_copies = [&](int j) {
    const int st = j & 1;
    T *nk = smem + (st ^ 1) * C::STAGE;
    const T *const *next_rows = krow + ((j + 1) % C::KROWS) * C::BC;
    if (j + 1 < b.ntiles)
      load_tile<T, D, WG, true, !OVL>(a, next_rows, nk, nk + C::BC * D,
                                      kvalid + (st ^ 1) * C::BC);
    if (OVL)
      load_tile<T, D, WG, false, true>(a, krow + (j % C::KROWS) * C::BC, nullptr,
                                       smem + st * C::STAGE + C::BC * D, nullptr);
    cp_async_commit();
    if (j + 2 < b.ntiles) rows_of(j + 2);
  };
  // The logit transform and mask of tile j's S (tile_logits).
  auto logits_of = [&](int j, float(&s)[C::NT_S][4]) {
    return tile_logits<C::BC>(a, plain, scale_log2, s, kvalid + (j & 1) * C::BC,
                              b.kbegin + j * C::BC, wr.w_first, wr.w_last, qd, wr.qpos,
                              wr.slope);
  };
  auto k_of = [&](int j) { return smem + (j & 1) * C::STAGE; };
  auto v_of = [&](int j) { return smem + (j & 1) * C::STAGE + C::BC * D; };

  if constexpr (!OVL) {
    for (int j = 0; j < b.ntiles; ++j) {
      tile_ready();
      inorder_tile<T, C>(
          qf, k_of(j), v_of(j), smem, o, m, l,
          [&](float(&s)[C::NT_S][4]) { return logits_of(j, s); }, [&]() { tile_copies(j); });
    }
  } else if (b.ntiles > 0) {
    uint32_t p[C::NT_S][2];
    float alphas[2];
    // Tile 0 alone (no product to overlap yet; O is zero, nothing to rescale), then each
    // tile's S beside the previous tile's P V.
    tile_ready();
    tile_copies(0);
    {
      float s[C::NT_S][4];
      issue_s<T, C>(s, qf, k_of(0), smem);
      wgmma_wait<0>();
      settle_s<C>(s);
      (void)softmax_tile<T>(s, logits_of(0, s), m, l, alphas, p);
    }
    for (int j = 1; j < b.ntiles; ++j) {
      tile_ready();
      tile_copies(j);
      float s[C::NT_S][4];
      issue_s<T, C>(s, qf, k_of(j), smem);
      issue_pv<T, C>(o, p, v_of(j - 1), smem);
      wgmma_wait<1>();  // S of tile j
      settle_s<C>(s);
      // P stays in f32 (in s) until P V of tile j - 1, which reads p, is done: P packed before
      // that wait gives the register allocator new values to place while the product may
      // still read the old ones, and ptxas then serializes the pipeline (C7513: ptxas 13.0
      // reported it for every overlapped instance until the packing moved here).
      const bool grew =
          __any_sync(0xffffffffu, softmax_tile_f32(s, logits_of(j, s), m, l, alphas));
      wgmma_wait<0>();  // P V of tile j - 1 is in O: now O may be rescaled and P replaced
      settle_o<C>(o);
      if (grew) rescale_tile(o, alphas);
      pack_p<T>(s, p);
    }
    // P V of the last tile: its V copy (queued at the top of the last tile) landed.
    cp_async_wait<0>();
    fence_proxy_async_shared();
    __syncthreads();
    issue_pv<T, C>(o, p, v_of(b.ntiles - 1), smem);
    wgmma_wait<0>();
    settle_o<C>(o);
  }

  // The output is staged in Q's rows where Q has its own region (read into registers before
  // tile 0), else in the stage the last tile did not use, free for every warp (its last
  // reads, tile ntiles - 2's, came before the last tile's barrier; at ntiles 1 it held Q):
  // each warp in its own 16 rows.
  T *out_rows = C::Q_ELEMS != 0 ? sq : smem + (b.ntiles & 1) * C::STAGE;
  store_tile_staged<T, D>(a, b, o, l, warp * 16, g, qd, out_rows + warp * 16 * C::LDQ);
}

}  // namespace pfwg
}  // namespace pkv
