// prefill_wgmma.cuh: prefill attention on Hopper's warpgroup tensor-core instruction (wgmma,
// sm_90a) for f16 / bf16 caches at head dims up to 128. Same arguments (PrefillArgs) and
// semantics as prefill_mma.cuh (pagedkv.h, the CPU oracle src/attn/cpu.rs), 64 rows per
// warpgroup (warp w rows 16w .. 16w + 15) and one or two warpgroups per thread block (64 or 128
// rows sharing each K / V tile: Cfg's WG), the same key tiles (64 keys,
// double-buffered cp.async copies with the K row addresses a tile ahead), same logit transform
// and online softmax. What changes is how the products read K and V: wgmma takes B straight from
// shared memory through a descriptor, so the ldmatrix loads that bound prefill_mma's tensor pipe
// (ncu: warps waiting on shared-memory loads, tensor pipe 37%) are gone:
//   S = Q K^T   per k16 step of the head dim, one m64n64k16 (A: the warp's Q fragments in
//               registers, B: the tile's K rows, K-major)
//   O += P V    per 16 keys, one m64nDk16 (A: P packed from the S accumulators, B: the tile's V
//               rows, MN-major)
// Both read the tile in the no-swizzle core-matrix layout of wgmma.cuh: K [64 keys][D] and V
// likewise, stored as (8-key octet, 16-byte chunk of dims) core matrices of 8 rows x 16 bytes,
// chunk-major inside an octet, so 16-byte piece i of the tile sits at byte 16 i and a warp's
// copies write 512 contiguous bytes. The instruction is warpgroup-wide: every warp takes part in
// every tile of its block (no per-warp skip of tiles its rows cannot see; the mask zeroes them).
//
// Shared memory (T elements): stage s (s = 0, 1): K [BC * D], V [BC * D] (the core-matrix
// layout); Q is staged in stage 1 in rows of D + 8 (ldmatrix, before its first use); then the
// key validity flags [2][BC] int and the K row addresses [2][BC].
#pragma once

#include "prefill_mma.cuh"
#include "wgmma.cuh"

namespace pkv {
namespace pfwg {

using pfmma::cp_async16;
using pfmma::cp_async_commit;
using pfmma::cp_async_wait;
using pfmma::LOG2E;
using pfmma::interior_tile;
using pfmma::mask_tile;
using pfmma::p_fragment;
using pfmma::plain_logits;
using pfmma::PrefillBlock;
using pfmma::rescale_tile;
using pfmma::softmax_tile;
using pfmma::stage_q;
using pfmma::store_tile;

// WG warpgroups per thread block (1 or 2), each its own 64 rows, all sharing the K / V tiles:
// at 2, every tile copied from L2 serves 128 rows instead of 64.
template <int D, int WG> struct Cfg {
  static_assert(D % 16 == 0 && D >= 64 && D <= 128, "wgmma widths: n = 64 (S) and n = D (O)");
  static_assert(WG == 1 || WG == 2, "one or two warpgroups");
  static constexpr int NT = 128 * WG;             // threads
  static constexpr int ROWS = 64 * WG;            // one m64 tile per warpgroup
  static constexpr int BC = 64;                   // keys per tile (the S wgmma's n)
  static constexpr int CH = D / 8;                // 16-byte chunks per row
  static constexpr int LDQ = D + 8;               // Q staging row stride (ldmatrix)
  static constexpr int KSTEPS = D / 16;           // k16 steps of Q K^T
  static constexpr int NT_S = BC / 8;             // n8 tiles of S
  static constexpr int NT_O = D / 8;              // n8 tiles of O
  static constexpr int STAGE = 2 * BC * D;        // elements of one stage (K then V)
  static constexpr uint32_t OCTET_BYTES = 16 * D; // one 8-key row of core matrices
  // Thread blocks per SM the registers must allow. One warpgroup: 3 (<= 168 per thread) up to
  // head dim 96, where the body takes 132-165 without spilling; 2 above (d128: 197; 3 would
  // spill 92 bytes). Two: 1 (the same body, twice the threads).
  static constexpr int MIN_BLOCKS = WG == 2 ? 1 : D <= 96 ? 3 : 2;
  // Q is staged in stage 1 (before tile 1 is copied there) where it fits, else after the
  // stages.
  static constexpr int Q_ELEMS = ROWS * LDQ <= STAGE ? 0 : ROWS * LDQ;
  static constexpr size_t smem_bytes = 2 * ((size_t)2 * STAGE + (size_t)Q_ELEMS) +
                                       2 * BC * sizeof(int) + 2 * BC * sizeof(void *);
  static constexpr int COPIES = (BC * CH + NT - 1) / NT;  // 16-byte pieces per thread, tensor
  static_assert(BC <= NT, "one thread per key writes the row addresses");
};

// Queues the copy of the keys whose K rows krow holds into the core-matrix layout (K into sk, V
// into sv) and writes their validity; an invalid key (nullptr) is zero-filled and flagged.
// Piece i (= thread + k NT) is key 8 (i / 8CH) + i % 8, chunk (i / 8) % CH: eight
// consecutive threads read eight keys' same 16 bytes and write 128 contiguous shared bytes.
template <typename T, int D, int WG>
__device__ __forceinline__ void load_kv_tile(const PrefillArgs &a, const T *const *krow, T *sk,
                                             T *sv, int *kvalid) {
  using C = Cfg<D, WG>;
  const int64_t kv = a.st.kv;
#pragma unroll
  for (int k = 0; k < C::COPIES; ++k) {
    const int i = (int)threadIdx.x + k * C::NT;
    if ((C::BC * C::CH) % C::NT != 0 && i >= C::BC * C::CH) break;
    const int j = 8 * (i / (8 * C::CH)) + i % 8, c = (i / 8) % C::CH;
    const T *p = krow[j];
    T *dk = sk + 8 * i, *dv = sv + 8 * i;
    if (p != nullptr) {
      cp_async16(dk, p + c * 8);
      cp_async16(dv, p + kv + c * 8);
    } else {
      *reinterpret_cast<uint4 *>(dk) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4 *>(dv) = make_uint4(0, 0, 0, 0);
    }
    if (c == 0) kvalid[j] = p != nullptr ? 1 : 0;
  }
}

template <typename T, int D, int WG>
__global__ void __launch_bounds__(Cfg<D, WG>::NT, Cfg<D, WG>::MIN_BLOCKS)
    prefill_wgmma_kernel(const PrefillArgs a) {
  grid_dependency_entry();  // PKV_LAUNCH_PROGRAMMATIC: before any read
  using C = Cfg<D, WG>;
  extern __shared__ uint4 pw_smem[];
  T *smem = reinterpret_cast<T *>(pw_smem);
  T *sq = C::Q_ELEMS == 0 ? smem + C::STAGE : smem + 2 * C::STAGE;   // see Cfg::Q_ELEMS
  int *kvalid = reinterpret_cast<int *>(smem + 2 * C::STAGE + C::Q_ELEMS);  // [2][BC]
  const T **krow = reinterpret_cast<const T **>(kvalid + 2 * C::BC);  // [2][BC]

  PrefillBlock b;
  if (!b.template init<D>(a, C::ROWS, C::BC)) return;  // the whole block, before any barrier
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, qd = lane % 4;
  int qpos[2];
  float slope[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) b.row(a, warp * 16 + g + 8 * h, qpos[h], slope[h]);
  // This warp's rows as positions, for the interior test (a warp of padding rows has none:
  // w_first -1, so no tile is interior to it and the mask covers it).
  const int wrows = min(16, b.nrows - warp * 16);
  const int w_first = wrows > 0 ? b.pos(a, warp * 16) : -1;
  const int w_last = b.pos(a, warp * 16 + max(wrows, 1) - 1);
  const bool plain = plain_logits(a);
  const float scale_log2 = a.scale * LOG2E;
  const T *cache = reinterpret_cast<const T *>(a.cache);

  // ---- prologue, as prefill_mma's: row addresses of tiles 0 and 1, Q, key tile 0 ----
  pfmma::key_rows<T, D>(a, cache, b.btab, b.bs_shift, b.head_off, b.kbegin, b.klast, krow);
  pfmma::key_rows<T, D>(a, cache, b.btab, b.bs_shift, b.head_off, b.kbegin + C::BC, b.klast,
                        krow + C::BC);
  __syncthreads();
  stage_q<T, D, C::NT>(a, b, sq, C::LDQ, C::ROWS);
  if (b.ntiles > 0) load_kv_tile<T, D, WG>(a, krow, smem, smem + C::BC * D, kvalid);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  const int lrow = lane % 8, lmat = lane / 8;
  uint32_t qf[C::KSTEPS][4];
#pragma unroll
  for (int ks = 0; ks < C::KSTEPS; ++ks)
    ldmatrix<4, false>(qf[ks], sq + (warp * 16 + (lmat % 2) * 8 + lrow) * C::LDQ + ks * 16 +
                                   (lmat / 2) * 8);

  float o[C::NT_O][4];
#pragma unroll
  for (int n = 0; n < C::NT_O; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float(&of)[D / 2] = reinterpret_cast<float(&)[D / 2]>(o);

  for (int j = 0; j < b.ntiles; ++j) {
    const int st = j & 1;
    cp_async_wait<0>();
    // Tile j's generic-proxy writes (cp.async, zero fills) visible to wgmma's async proxy,
    // then to every warp; every warp is done with tile j - 1 (its wgmma waited for).
    fence_proxy_async_shared();
    __syncthreads();
    if (j + 1 < b.ntiles) {
      T *nk = smem + (st ^ 1) * C::STAGE;
      load_kv_tile<T, D, WG>(a, krow + (st ^ 1) * C::BC, nk, nk + C::BC * D,
                             kvalid + (st ^ 1) * C::BC);
    }
    cp_async_commit();
    if (j + 2 < b.ntiles)
      pfmma::key_rows<T, D>(a, cache, b.btab, b.bs_shift, b.head_off,
                            b.kbegin + (j + 2) * C::BC, b.klast, krow + st * C::BC);
    const T *sk = smem + st * C::STAGE;
    const T *sv = sk + C::BC * D;
    const int *kv_ok = kvalid + st * C::BC;
    const int kt = b.kbegin + j * C::BC;

    // ---- S = Q K^T: k-step ks reads chunks 2ks, 2ks + 1 of every key (core matrices 128
    // bytes apart along k, octets OCTET_BYTES apart along n) ----
    float s[C::NT_S][4];
#pragma unroll
    for (int t = 0; t < C::NT_S; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[t][e] = 0.f;
    float(&sf)[C::BC / 2] = reinterpret_cast<float(&)[C::BC / 2]>(s);
    // The accumulators' writes happen before the fence (the pins order them), as the
    // protocol asks of registers a wgmma reads.
#pragma unroll
    for (int i = 0; i < C::BC / 2; ++i) wgmma_pin(sf[i]);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < C::KSTEPS; ++ks)
      wgmma_rs<T, C::BC, 0>(sf, qf[ks], smem_desc(sk + ks * 16 * 8, smem, 128, C::OCTET_BYTES),
                            smem);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < C::BC / 2; ++i) wgmma_pin(sf[i]);

    // ---- the logit transform and mask, the online softmax, the O rescale (prefill_mma's) ----
    const bool interior = interior_tile<C::BC>(a, plain, kt, w_first, w_last, kv_ok);
    float mul = 1.f;
    if (interior)
      mul = scale_log2;
    else
      mask_tile(a, s, kv_ok, kt, qd, qpos, slope);
    float alphas[2];
    uint32_t p[C::NT_S][2];
    const bool grew = softmax_tile<T>(s, mul, m, l, alphas, p);
    if (__any_sync(0xffffffffu, grew)) rescale_tile(o, alphas);

    // ---- O += P V: k-step kk reads key octets 2kk, 2kk + 1 (OCTET_BYTES apart along k: the
    // leading offset), every chunk of dims (128 bytes apart along n: the stride offset) ----
#pragma unroll
    for (int i = 0; i < D / 2; ++i) wgmma_pin(of[i]);
#pragma unroll
    for (int t = 0; t < C::NT_S; ++t) {
      wgmma_pin(p[t][0]);
      wgmma_pin(p[t][1]);
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < C::BC / 16; ++kk) {
      uint32_t pa[4];
      p_fragment(p, kk, pa);
      wgmma_rs<T, D, 1>(of, pa, smem_desc(sv + kk * 2 * 8 * D, smem, C::OCTET_BYTES, 128),
                        smem);
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < D / 2; ++i) wgmma_pin(of[i]);
  }

  store_tile<T, D>(a, b, o, l, warp * 16, g, qd);
}

}  // namespace pfwg
}  // namespace pkv
