// prefill_wgmma_persist.cuh: the two-warpgroup wgmma prefill kernel (prefill_wgmma.cuh, in-
// order schedule) as a persistent grid: a few thread blocks (the SMs times the blocks per SM
// its registers allow), each running a stream of work items (a row tile of one KV head of one
// sequence, the plain grid's thread block) back to back, with the next item's first key tile,
// its Q rows and its key row addresses copied while the current item's last tiles compute.
//
// Why: at one thread block per SM (d > 64: 243 registers x 256 threads) nothing hides a block's
// prologue (context and table reads, then Q and the first K / V tile) nor its epilogue; fitted
// over the H100 grid of BENCHMARKS.md, every block cost ~9 us beyond its key tiles (~3.5
// tiles' time), which is what kept chunks over no cached tokens (1-16 tiles per block) at
// 57-63% of dense SDPA while long contexts ran 115-134%. Same arguments (PrefillArgs) and
// semantics as the other prefill kernels.
//
// The stream: tile g of a block's stream is key tile j of its item n. Stage g & 1 holds its K
// and V, row-address and flag slot g & 1 its addresses and flags, Q buffer n & 1 its item's
// rows; stream[g & 3] (shared memory) describes it. In tile g (after the barrier that
// publishes tile g's copies), while its S product runs: tile g + 1's copies are queued (and
// its item's Q where it is the item's first tile), the row addresses of tile g + 2 computed,
// and warp 0 writes the description of tile g + 3 (a new item's context and table reads
// happen there, one warp, once per item). Every slot written at tile g was last read before
// that barrier: stage and flags (g + 1) & 1 by tile g - 1, addresses g & 1 by tile g's copies
// (queued in tile g - 1), Q buffer (n + 1) & 1 by item n - 1 (its Q fragments at its first
// tile, its output staged there at its last), stream[(g + 3) & 3] in tile g - 1.
//
// Items: item i of a launch is the row tile of rank i / (hkv num_seqs) counted from the last
// (the causal mask gives the last rows the most keys: items run longest first, as the plain
// grid's blocks do), of sequence (i / hkv) % num_seqs and KV head i % hkv. Block c of G takes
// in round k item k G + c for even k and k G + G - 1 - c for odd k (a snake: the block that
// took one of a round's longest items takes one of the next round's shortest). An item with
// no rows (past its sequence's chunk) is skipped; one with rows but no visible key takes one
// all-masked tile, so that its zeros are stored like any result.
#pragma once

#include "prefill_wgmma.cuh"

namespace pkv {
namespace pfwg {

// A launch's work items (above).
struct PersistGrid {
  int32_t items;  // hkv x row_tiles x num_seqs, < 2^31 (the launcher's check)
  int32_t hkv, num_seqs, row_tiles;
};

// One tile of a block's stream.
struct StreamTile {
  PrefillBlock b;  // its item
  int32_t k;       // the item's round
  int32_t j;       // the tile's index in the item
  int32_t n;       // the item's ordinal in the block's stream (its Q buffer: n & 1)
  int32_t valid;   // 0: past the block's last item
};

// Tiles an item takes in the stream: its key tiles, at least one.
__device__ __forceinline__ int stream_tiles(const PrefillBlock &b) { return max(b.ntiles, 1); }

// The first item with rows from this block's round k0 on, as tile 0 of stream ordinal n, into
// *to, or the end of the stream. Warp-collective: 32 rounds per step, a lane each; the lane of
// the first item with rows writes it. The rounds' items increase with k, so a lane past the
// last item means none follows.
// Item indices are below 2^31 and a round's first is at most the item count, so k G
// + G - 1 fits 32 unsigned bits.
template <int D, int ROWS, int BC>
__device__ void next_item(const PrefillArgs &a, const PersistGrid &w, int k0, int n,
                          StreamTile *to) {
  const int lane = threadIdx.x % 32;
  const unsigned G = gridDim.x, c = blockIdx.x, per_rank = (unsigned)(w.hkv * w.num_seqs);
  for (;; k0 += 32) {
    const int k = k0 + lane;
    const unsigned i = (unsigned)k * G + ((k & 1) != 0 ? G - 1 - c : c);
    PrefillBlock b{};
    bool rows = false;
    if (i < (unsigned)w.items) {
      const int y = (int)(i / per_rank), r = (int)(i % per_rank);
      rows = b.template init_at<D>(a, r % w.hkv, r / w.hkv, (w.row_tiles - 1 - y) * ROWS, ROWS,
                                   BC);
    }
    const unsigned found = __ballot_sync(0xffffffffu, rows);
    if (found != 0) {
      if (lane == __ffs((int)found) - 1) {
        to->b = b;
        to->k = k;
        to->j = 0;
        to->n = n;
        to->valid = 1;
      }
      return;
    }
    if (__any_sync(0xffffffffu, i >= (unsigned)w.items)) {
      if (lane == 0) to->valid = 0;
      return;
    }
  }
}

// The stream tile after *from into *to (warp-collective, as next_item).
template <int D, int ROWS, int BC>
__device__ void next_tile(const PrefillArgs &a, const PersistGrid &w, const StreamTile *from,
                          StreamTile *to) {
  const int lane = threadIdx.x % 32;
  if (from->valid == 0) {
    if (lane == 0) to->valid = 0;
  } else if (from->j + 1 < stream_tiles(from->b)) {
    if (lane == 0) {
      *to = *from;
      to->j = from->j + 1;
    }
  } else {
    next_item<D, ROWS, BC>(a, w, from->k + 1, from->n + 1, to);
  }
}

// Shared memory (T elements, from the first 1024-byte boundary): the two stages (K, V: the
// swizzled layout, as prefill_wgmma.cuh), Q [2][ROWS][D + 8], the flags [2][BC] int, the K row
// addresses [2][BC], the stream descriptions [4].
template <int D, int WG> struct PersistCfg {
  using C = Cfg<D, WG, false>;
  static constexpr int Q_BUF = C::ROWS * C::LDQ;  // elements of one Q buffer
  static constexpr size_t smem_bytes = 2 * (2 * (size_t)C::STAGE + 2 * (size_t)Q_BUF) +
                                       2 * C::BC * sizeof(int) + 2 * C::BC * sizeof(void *) +
                                       4 * sizeof(StreamTile) + 1024;
  static_assert((2 * (2 * C::STAGE + 2 * Q_BUF) + 2 * C::BC * sizeof(int)) % 16 == 0,
                "Q rows, the row addresses and the descriptions stay aligned");
};

template <typename T, int D, int WG>
__global__ void __launch_bounds__(Cfg<D, WG, false>::NT, Cfg<D, WG, false>::MIN_BLOCKS)
    prefill_wgmma_persistent_kernel(const PrefillArgs a, const PersistGrid w) {
  grid_dependency_entry();  // PKV_LAUNCH_PROGRAMMATIC: before any read
  using C = Cfg<D, WG, false>;
  using P = PersistCfg<D, WG>;
  extern __shared__ uint4 pp_smem[];
  T *smem = shared_align1024<T>(pp_smem);
  T *sq = smem + 2 * C::STAGE;                                       // [2][ROWS][LDQ]
  int *kvalid = reinterpret_cast<int *>(sq + 2 * P::Q_BUF);          // [2][BC]
  const T **krow = reinterpret_cast<const T **>(kvalid + 2 * C::BC);  // [2][BC]
  StreamTile *stream = reinterpret_cast<StreamTile *>(krow + 2 * C::BC);  // [4]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g8 = lane / 4, qd = lane % 4;
  const bool plain = plain_logits(a);
  const float scale_log2 = a.scale * LOG2E;
  const T *cache = reinterpret_cast<const T *>(a.cache);
  // Row addresses of stream tile t into slot t & 1 (none past the stream's end).
  auto rows_of = [&](unsigned t) {
    const StreamTile &e = stream[t & 3];
    if (e.valid != 0)
      pfmma::key_rows<T, D, C::BC>(a, cache, e.b.btab, e.b.bs_shift, e.b.head_off,
                                   e.b.kbegin + e.j * C::BC, e.b.klast, krow + (t & 1) * C::BC);
  };

  // ---- prologue: stream tiles 0 .. 2, the row addresses of 0 and 1, tile 0's copies ----
  if (warp == 0) {
    next_item<D, C::ROWS, C::BC>(a, w, 0, 0, &stream[0]);
    __syncwarp();
    next_tile<D, C::ROWS, C::BC>(a, w, &stream[0], &stream[1]);
    __syncwarp();
    next_tile<D, C::ROWS, C::BC>(a, w, &stream[1], &stream[2]);
  }
  __syncthreads();
  if (stream[0].valid == 0) return;  // no item: the whole block, before any other barrier
  rows_of(0);
  rows_of(1);
  __syncthreads();
  load_tile<T, D, WG, true, true>(a, krow, smem, smem + C::BC * D, kvalid);
  stage_q<T, D, C::NT>(a, stream[0].b, sq, C::LDQ, C::ROWS);
  cp_async_commit();

  // The current item (its description is every one of its stream tiles', read from shared
  // memory where needed rather than held in registers): its rows' positions and slopes, this
  // warp's position range, its Q fragments, O and the running max and sum.
  WarpRows wr;
  uint32_t qf[C::KSTEPS][4];
  float o[C::NT_O][4];
  float m[2], l[2];
  for (unsigned g = 0;; ++g) {
    cp_async_wait<0>();
    // Tile g's copies visible to wgmma's async proxy and to every warp; every warp done with
    // the slots the copies below overwrite.
    fence_proxy_async_shared();
    __syncthreads();
    const StreamTile &e = stream[g & 3];
    if (e.valid == 0) break;  // block-uniform
    // Beside tile g's S product: tile g + 1's copies (and its item's Q), tile g + 2's row
    // addresses, tile g + 3's description.
    auto copies = [&]() {
      const StreamTile &nx = stream[(g + 1) & 3];
      if (nx.valid != 0) {
        T *nk = smem + ((g + 1) & 1) * C::STAGE;
        load_tile<T, D, WG, true, true>(a, krow + ((g + 1) & 1) * C::BC, nk, nk + C::BC * D,
                                        kvalid + ((g + 1) & 1) * C::BC);
        if (nx.j == 0)
          stage_q<T, D, C::NT>(a, nx.b, sq + (nx.n & 1) * P::Q_BUF, C::LDQ, C::ROWS);
      }
      cp_async_commit();
      rows_of(g + 2);
      if (warp == 0)
        next_tile<D, C::ROWS, C::BC>(a, w, &stream[(g + 2) & 3], &stream[(g + 3) & 3]);
    };

    const int j = e.j;
    if (j == 0) {  // a new item (block-uniform)
      wr.of(a, e.b, warp, g8);
      q_fragments<T, C>(qf, sq + (e.n & 1) * P::Q_BUF, warp, lane);
#pragma unroll
      for (int t = 0; t < C::NT_O; ++t)
#pragma unroll
        for (int x = 0; x < 4; ++x) o[t][x] = 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.f;
      }
    }
    const T *sk = smem + (g & 1) * C::STAGE;
    const int *kv_ok = kvalid + (g & 1) * C::BC;
    const int kt = e.b.kbegin + j * C::BC;
    inorder_tile<T, C>(
        qf, sk, sk + C::BC * D, smem, o, m, l,
        [&](float(&s)[C::NT_S][4]) {
          return tile_logits<C::BC>(a, plain, scale_log2, s, kv_ok, kt, wr.w_first, wr.w_last,
                                    qd, wr.qpos, wr.slope);
        },
        copies);
    // The item's output through its Q buffer: this warp's 16 rows, read only by this warp
    // (its Q fragments, at the item's first tile) until item n + 2's Q is copied there (at
    // item n + 1's last tile, after a barrier).
    if (j == stream_tiles(e.b) - 1)
      store_tile_staged<T, D>(a, e.b, o, l, warp * 16, g8, qd,
                              sq + (e.n & 1) * P::Q_BUF + warp * 16 * C::LDQ);
  }
}

}  // namespace pfwg
}  // namespace pkv
