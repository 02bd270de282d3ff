// decode_merge_weighted.cuh: the split merge of the f16 / bf16 tensor-core GQA decode body
// (decode_mma.cuh), weights first. The CUDA-core bodies merge with decode_finish_split
// (decode_v2.cuh), a running max per thread.
//
// Why two: the GQA body serves 2-16 heads, so each 16-byte piece of its output is summed by one
// thread over every split. With a running max per thread, each step of splits is a compare and
// an exponent per split on that thread's path; here the (head, split) weights e^(m_z - M) are
// computed once by the lanes of a warp side by side, and the row sums are plain FMAs. H200,
// bf16 d128, 32:8 (BENCHMARKS.md, session 14, one run): 1 x 32768 (49 splits) 42.4 us here
// against 45.3 with the running max, 1 x 4096 (33) 14.5 against 16.5, the same at 16 splits.
// The MHA body sums each piece with four threads, where the running max measured faster.
#pragma once

#include "decode_v2.cuh"

namespace pkv {

// (m, l) += a split's (mo, lo): a running max and sum relative to it; a split with max -inf
// adds only its sum: 0 when empty, NaN when its only unmasked logits were NaN (fmaxf skips
// them), which the sum keeps (NaN x 0 is NaN) and so poisons the output, as the formula does.
__device__ __forceinline__ void lse_add(float &m, float &l, float mo, float lo) {
  if (mo == -INFINITY) {
    l += lo;
    return;
  }
  if (mo > m) {
    l = l * (m == -INFINITY ? 0.f : __expf(m - mo)) + lo;
    m = mo;
  } else {
    l = fmaf(lo, __expf(mo - m), l);
  }
}

// acc += x * w per component; w == 0 (an empty split) adds nothing even where x is not a
// number (its row was never written).
__device__ __forceinline__ void add_weighted(float4 &acc, const float4 &x, float w) {
  if (w != 0.f) {
    acc.x = fmaf(x.x, w, acc.x);
    acc.y = fmaf(x.y, w, acc.y);
    acc.z = fmaf(x.z, w, acc.z);
    acc.w = fmaf(x.w, w, acc.w);
  }
}

// decode_finish_split's contract (decode_v2.cuh) for the GQA tensor-core body: counts the block
// in, and the group's last block merges the num_splits partials into the normalized output of
// its ng heads. `scratch` is `scratch_floats` (>= ng x (D + 1)) floats of 16-byte aligned shared
// memory the block no longer needs.
//
// Rounds of L2 reads, each thread issuing a round's loads before using any: (1) each head's
// max and total over the splits, a warp per head, lanes on splits lane and lane + 32 (up to 64
// splits: the weights written in the same round; more, or more than `scratch` holds, in chunks
// of splits with a round of weights each); (2) each thread sums whole 16-byte pieces of the
// partial rows, ZU splits per step. Every output is summed in split order with the same
// weights, so the result does not depend on which block merges.
template <typename T, int D, int GT>
__device__ __forceinline__ void decode_finish_split_weighted(const DecodeArgs &a,
                                                             const DecodeBlock &b, float *scratch,
                                                             int scratch_floats) {
  static_assert(GT >= 1 && GT <= 16, "s_max and s_total hold 16 heads");
  __shared__ float s_max[16], s_total[16];  // per served head (ng <= 16)
  if (!decode_split_arrive(a, b)) return;

  const int S = a.num_splits;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int PIECES = D / 4, ZU = 8;
  const int pieces = b.ng * PIECES;
  float4 *acc = reinterpret_cast<float4 *>(scratch);  // [pieces]; scratch is 16-byte aligned
  float *wts = scratch + b.ng * D;
  const int zc = (scratch_floats - b.ng * D) / b.ng;  // splits per chunk, >= 1
  const bool fused = S <= 64 && S <= zc;
  for (int g = warp; g < b.ng; g += DEC_WARPS) {  // the head's max and total weight
    const float *mx = a.tmp_max + (b.row0 + g) * S, *sm = a.tmp_sum + (b.row0 + g) * S;
    float m = -INFINITY, l = 0.f, mk[2] = {-INFINITY, -INFINITY};
    if (fused) {
      float lk[2] = {0.f, 0.f};
#pragma unroll
      for (int k = 0; k < 2; ++k)
        if (lane + 32 * k < S) {
          mk[k] = __ldcg(mx + lane + 32 * k);
          lk[k] = __ldcg(sm + lane + 32 * k);
        }
#pragma unroll
      for (int k = 0; k < 2; ++k) lse_add(m, l, mk[k], lk[k]);
    } else {
#pragma unroll 2
      for (int z = lane; z < S; z += 32) lse_add(m, l, __ldcg(mx + z), __ldcg(sm + z));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float mo = __shfl_xor_sync(0xffffffffu, m, o);
      const float lo = __shfl_xor_sync(0xffffffffu, l, o);
      lse_add(m, l, mo, lo);  // every lane ends with the same max; lane 0's sum is stored
    }
    if (lane == 0) {
      s_max[g] = m;
      s_total[g] = l;
    }
    if (fused) {
#pragma unroll
      for (int k = 0; k < 2; ++k)
        if (lane + 32 * k < S)  // 0 for an empty split, whose partial row was never written
          wts[g * S + lane + 32 * k] = mk[k] == -INFINITY ? 0.f : __expf(mk[k] - m);
    }
  }
  // Thread t owns pieces t, t + DEC_THREADS, ...: their f32 sums in `scratch`, the current
  // chunk's (head, split) weights after them.
  for (int p = threadIdx.x; p < pieces; p += DEC_THREADS)
    acc[p] = make_float4(0.f, 0.f, 0.f, 0.f);
  const float4 *rows = reinterpret_cast<const float4 *>(a.tmp_out + b.row0 * S * D);
  for (int z0 = 0; z0 < S; z0 += zc) {
    const int zn = min(zc, S - z0);
    __syncthreads();  // s_max / s_total (and fused weights) written; the last chunk's read
    if (!fused) {
#pragma unroll 4
      for (int i = threadIdx.x; i < b.ng * zn; i += DEC_THREADS) {
        const int g = i / zn, z = z0 + i % zn;
        const float mz = __ldcg(a.tmp_max + (b.row0 + g) * S + z);
        wts[i] = mz == -INFINITY ? 0.f : __expf(mz - s_max[g]);  // 0: skipped below
      }
      __syncthreads();
    }
#pragma unroll 1
    for (int p = threadIdx.x; p < pieces; p += DEC_THREADS) {
      const int g = p / PIECES;
      const float4 *src = rows + (int64_t)g * S * PIECES + p % PIECES + (int64_t)z0 * PIECES;
      const float *w = wts + g * zn;
      float4 v = acc[p];
      int z = 0;
#pragma unroll 1
      for (; z + ZU <= zn; z += ZU) {
        float4 x[ZU];
#pragma unroll
        for (int u = 0; u < ZU; ++u) x[u] = __ldcg(src + (int64_t)(z + u) * PIECES);
#pragma unroll
        for (int u = 0; u < ZU; ++u) add_weighted(v, x[u], w[z + u]);
      }
#pragma unroll 1
      for (; z < zn; ++z) add_weighted(v, __ldcg(src + (int64_t)z * PIECES), w[z]);
      acc[p] = v;
    }
  }
  T *out = reinterpret_cast<T *>(a.out) + b.o0;  // the ng heads' rows are contiguous
#pragma unroll 1
  for (int p = threadIdx.x; p < pieces; p += DEC_THREADS) {
    const int g = p / PIECES, d = (p % PIECES) * 4;
    const float total = s_total[g];
    const float4 v = acc[p];
    const float r[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e)
      out[g * D + d + e] = Elem<T>::from_f32(total == 0.f ? 0.f : r[e] / total);
  }
  decode_split_reset(a, b);
}

}  // namespace pkv
