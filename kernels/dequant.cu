// dequant.cu: ggml blocks (F32, F16, BF16, Q4_0, Q8_0, Q4_K, Q6_K) to f16 or bf16 on the
// device, bit-identical to src/gguf/dequant.rs (dequantize_into_f16 / dequantize_into_bf16):
// each value is computed in f32 with the CPU dequantizer's operations in its order, one rounding
// per operation, then rounded to nearest even; every NaN becomes the one quiet NaN of the output
// type (see the contract in pagedkv.h).
//
// Work split: a warp produces 256 consecutive outputs per step (one tile), lane l the 8 outputs
// [8l, 8l + 8) of it, written as one 16-byte store: a warp's stores cover 512 contiguous bytes.
// 256 outputs are one K-quant block (Q4_K, Q6_K), 8 blocks of Q8_0 / Q4_0 (4 lanes per block),
// or 256 plain elements (F32 / F16 / BF16, one or two 16-byte loads per lane). Every lane reads
// only the bytes its own outputs need (8 quants, the block's scales), straight from global
// memory through the read-only path: neighbouring lanes read neighbouring bytes, so a warp's
// loads fall in a few 32-byte sectors, and there is no shared memory and no barrier. Warps
// stride over the tiles (grid-stride), so one launch covers any size.
#include "common.cuh"

#include <string.h>

namespace pkv {
namespace {

constexpr int DQ_THREADS = 256;
constexpr int DQ_TILE = 256;         // outputs per warp per step
// Thread blocks per SM in a launch: 8 x 256 threads fill an SM (2048 threads on sm_80/sm_90);
// a larger tensor is covered by the warps looping, not by more waves of blocks.
constexpr int DQ_BLOCKS_PER_SM = 8;

// ggml type ids (ggml.h's enum ggml_type, the values GGUF files store).
constexpr int T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14,
              T_BF16 = 30;

// ---- bits and f32 operations -----------------------------------------------------------------

__device__ __forceinline__ float f32_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
__device__ __forceinline__ uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

// Products and differences rounded on their own. nvcc contracts `a * b - c` into one FMA (one
// rounding) by default, the CPU never does: the explicit-rounding intrinsics keep each
// operation separate. The emulation (plain C++) stores through a volatile, so that no C++
// compiler can contract either.
#ifdef PKV_CUDA_EMU
inline float mul_rn(float a, float b) {
  volatile float p = a * b;
  return p;
}
inline float sub_rn(float a, float b) {
  volatile float d = a - b;
  return d;
}
#else
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
#endif

// f16 bits to f32, exact (as half::f16::to_f32); a NaN stays a NaN (its payload is irrelevant:
// every NaN output is canonical).
__device__ __forceinline__ float f16_to_f32(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1fu) return f32_of(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return f32_of(sign | ((exp + 112u) << 23) | (man << 13));
  // Zero or subnormal: man * 2^-24, both factors and the product exact in f32.
  return f32_of(sign | bits_of((float)man * 5.9604644775390625e-8f));
}

// The canonical NaNs the contract writes for every NaN.
constexpr uint16_t F16_NAN = 0x7e00u, BF16_NAN = 0x7fc0u;

// f32 to the output type's bits: round to nearest even, NaN canonical.
template <int OUT> __device__ __forceinline__ uint16_t round_out(float x);
template <> __device__ __forceinline__ uint16_t round_out<PKV_DTYPE_F16>(float x) {
  if (isnan(x)) return F16_NAN;
  const __half h = __float2half_rn(x);
  uint16_t b;
  memcpy(&b, &h, sizeof b);
  return b;
}
template <> __device__ __forceinline__ uint16_t round_out<PKV_DTYPE_BF16>(float x) {
  if (isnan(x)) return BF16_NAN;
  const __nv_bfloat16 h = __float2bfloat16_rn(x);
  uint16_t b;
  memcpy(&b, &h, sizeof b);
  return b;
}

// ---- loads (read-only path; the alignment of each is argued at its call) ----------------------

__device__ __forceinline__ uint32_t ld_u8(const uint8_t *p) { return __ldg(p); }
__device__ __forceinline__ uint32_t ld_u16(const uint8_t *p) {
  return __ldg(reinterpret_cast<const unsigned short *>(p));
}
__device__ __forceinline__ uint32_t ld_u32(const uint8_t *p) {
  return __ldg(reinterpret_cast<const unsigned int *>(p));
}
__device__ __forceinline__ unsigned long long ld_u64(const uint8_t *p) {
  return __ldg(reinterpret_cast<const unsigned long long *>(p));
}
// 8 bytes at a 2-byte aligned address, byte i of the result = p[i].
__device__ __forceinline__ void ld8_a2(const uint8_t *p, uint8_t (&b)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t w = ld_u16(p + 2 * i);
    b[2 * i] = (uint8_t)(w & 0xffu);
    b[2 * i + 1] = (uint8_t)(w >> 8);
  }
}

// ---- the 8 outputs of one lane, per source type ---------------------------------------------
// `src` is the tensor's first block (16-byte aligned, the launcher checks it); `e` is the first
// of the 8 outputs, a multiple of 8; all 8 lie inside the tensor (`n` elements) unless stated.
// Each writes the 8 outputs' bits to `o`.

// Q8_0: 34-byte blocks of 32 (f16 d, 32 x i8): y = q * d.
template <int OUT> __device__ __forceinline__ void eight_q8_0(const uint8_t *src, int64_t e,
                                                             uint16_t (&o)[8]) {
  const uint8_t *blk = src + (e >> 5) * 34;  // even: 2-byte aligned
  const float d = f16_to_f32(ld_u16(blk));
  uint8_t q[8];
  ld8_a2(blk + 2 + (e & 31), q);  // 2 + a multiple of 8: even
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = round_out<OUT>(mul_rn((float)(int8_t)q[i], d));
}

// Q4_0: 18-byte blocks of 32 (f16 d, 16 bytes of nibbles; element j < 16 is the low nibble of
// byte j, element j >= 16 the high nibble of byte j - 16): y = (q - 8) * d.
template <int OUT> __device__ __forceinline__ void eight_q4_0(const uint8_t *src, int64_t e,
                                                             uint16_t (&o)[8]) {
  const uint8_t *blk = src + (e >> 5) * 18;  // even
  const float d = f16_to_f32(ld_u16(blk));
  const int j = (int)(e & 31);
  uint8_t q[8];
  ld8_a2(blk + 2 + (j & 15), q);  // 2 + 0 or 8: even
  const int shift = j >= 16 ? 4 : 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int v = (int)((q[i] >> shift) & 0xfu) - 8;
    o[i] = round_out<OUT>(mul_rn((float)v, d));
  }
}

// Q4_K: 144-byte blocks of 256 (f16 d, f16 dmin, 12 bytes of eight 6-bit (scale, min) pairs,
// 128 bytes of nibbles). Group g = element / 32 uses pair g; its quants are the low (g even) or
// high (g odd) nibbles of bytes 32 * (g / 2) .. + 32. y = (d * sc) * q - (dmin * mn).
template <int OUT> __device__ __forceinline__ void eight_q4_k(const uint8_t *src, int64_t e,
                                                             uint16_t (&o)[8]) {
  const uint8_t *blk = src + (e >> 8) * 144;  // 144 = 9 * 16: 16-byte aligned
  const uint32_t dd = ld_u32(blk);            // d (low half), dmin (high half)
  const float d = f16_to_f32(dd & 0xffffu), dmin = f16_to_f32(dd >> 16);
  const int f = (int)(e & 255), g = f >> 5;
  // The 12 scale bytes s[0..12] at blk + 4, three aligned words.
  const uint32_t w0 = ld_u32(blk + 4), w1 = ld_u32(blk + 8), w2 = ld_u32(blk + 12);
  auto s = [&](int i) -> uint32_t {
    const uint32_t w = i < 4 ? w0 : i < 8 ? w1 : w2;
    return (w >> (8 * (i & 3))) & 0xffu;
  };
  uint32_t sc, mn;
  if (g < 4) {
    sc = s(g) & 63u;
    mn = s(g + 4) & 63u;
  } else {
    sc = (s(g + 4) & 0xfu) | ((s(g - 4) >> 2) & 0x30u);
    mn = (s(g + 4) >> 4) | ((s(g) >> 2) & 0x30u);
  }
  const float d1 = mul_rn(d, (float)sc), m1 = mul_rn(dmin, (float)mn);
  // Bytes 16 + 32 * (g / 2) + (f & 31) .. + 8: a multiple of 8 from an aligned block.
  const unsigned long long qs = ld_u64(blk + 16 + 32 * (g >> 1) + (f & 31));
  const int shift = 4 * (g & 1);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t q = (uint32_t)(qs >> (8 * i + shift)) & 0xfu;
    o[i] = round_out<OUT>(sub_rn(mul_rn(d1, (float)q), m1));
  }
}

// Q6_K: 210-byte blocks of 256 (ql[128] low nibbles, qh[64] 2-bit highs, 16 x i8 scales, f16 d).
// Element f = 128 a + 32 s + l: low nibble of ql[64 a + 32 (s % 2) + l] (shifted by 4 for s >= 2),
// high bits (qh[32 a + l] >> 2 s) & 3, q = (low | high << 4) - 32, y = (d * scale[f / 16]) * q.
template <int OUT> __device__ __forceinline__ void eight_q6_k(const uint8_t *src, int64_t e,
                                                             uint16_t (&o)[8]) {
  const uint8_t *blk = src + (e >> 8) * 210;  // even
  const int f = (int)(e & 255), a = f >> 7, s = (f >> 5) & 3, l = f & 31;
  uint8_t ql[8], qh[8];
  ld8_a2(blk + 64 * a + 32 * (s & 1) + l, ql);  // every term even
  ld8_a2(blk + 128 + 32 * a + l, qh);
  const float d = f16_to_f32(ld_u16(blk + 208));
  // The 8 outputs share one scale: f is a multiple of 8, the scale groups are 16 wide.
  const float dl = mul_rn(d, (float)(int8_t)ld_u8(blk + 192 + (f >> 4)));
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int low = (ql[i] >> (4 * (s >> 1))) & 0xf, high = (qh[i] >> (2 * s)) & 3;
    o[i] = round_out<OUT>(mul_rn(dl, (float)((low | (high << 4)) - 32)));
  }
}

// F32 / F16 / BF16: element by element; `cnt` (1..8) outputs from `e`, read with 16-byte loads
// when all 8 are there, one by one at the tensor's tail (never past its end).
template <int TY, int OUT> __device__ __forceinline__ void eight_plain(const uint8_t *src,
                                                                      int64_t e, int cnt,
                                                                      uint16_t (&o)[8]) {
  constexpr int ES = TY == T_F32 ? 4 : 2;
  const uint8_t *p = src + e * ES;  // e a multiple of 8: 16-byte aligned
  uint32_t raw[8];
  if (cnt == 8) {
    const uint4 v0 = __ldg(reinterpret_cast<const uint4 *>(p));
    if (ES == 4) {
      const uint4 v1 = __ldg(reinterpret_cast<const uint4 *>(p + 16));
      const uint32_t w[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) raw[i] = w[i];
    } else {
      const uint32_t w[4] = {v0.x, v0.y, v0.z, v0.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        raw[2 * i] = w[i] & 0xffffu;
        raw[2 * i + 1] = w[i] >> 16;
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      raw[i] = i < cnt ? (ES == 4 ? ld_u32(p + 4 * i) : ld_u16(p + 2 * i)) : 0u;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t r = raw[i];
    if constexpr (TY == T_F16 && OUT == PKV_DTYPE_F16) {
      o[i] = (r & 0x7fffu) > 0x7c00u ? F16_NAN : (uint16_t)r;  // exact: only NaNs change
    } else if constexpr (TY == T_BF16 && OUT == PKV_DTYPE_BF16) {
      o[i] = (r & 0x7fffu) > 0x7f80u ? BF16_NAN : (uint16_t)r;
    } else {
      const float x = TY == T_F32 ? f32_of(r) : TY == T_F16 ? f16_to_f32(r) : f32_of(r << 16);
      o[i] = round_out<OUT>(x);
    }
  }
}

template <int TY, int OUT>
__global__ void __launch_bounds__(DQ_THREADS) dequant_kernel(
    const uint8_t *__restrict__ src,  // device, the tensor's blocks, 16-byte aligned
    uint16_t *__restrict__ dst,       // device [n] f16 / bf16 bits, 16-byte aligned
    int64_t n) {                      // elements, a whole number of blocks
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * (DQ_THREADS / 32);
  const int64_t tiles = (n + DQ_TILE - 1) / DQ_TILE;
  for (int64_t t = ((int64_t)blockIdx.x * DQ_THREADS + threadIdx.x) >> 5; t < tiles;
       t += warps) {
    const int64_t e = t * DQ_TILE + lane * 8;
    if (e >= n) continue;  // the last tile of a tensor that is not a multiple of 256
    const int cnt = n - e < 8 ? (int)(n - e) : 8;  // < 8 only for the plain types
    uint16_t o[8];
    if constexpr (TY == T_Q8_0) eight_q8_0<OUT>(src, e, o);
    else if constexpr (TY == T_Q4_0) eight_q4_0<OUT>(src, e, o);
    else if constexpr (TY == T_Q4_K) eight_q4_k<OUT>(src, e, o);
    else if constexpr (TY == T_Q6_K) eight_q6_k<OUT>(src, e, o);
    else eight_plain<TY, OUT>(src, e, cnt, o);
    if (cnt == 8) {
      uint4 v;
      v.x = (uint32_t)o[0] | ((uint32_t)o[1] << 16);
      v.y = (uint32_t)o[2] | ((uint32_t)o[3] << 16);
      v.z = (uint32_t)o[4] | ((uint32_t)o[5] << 16);
      v.w = (uint32_t)o[6] | ((uint32_t)o[7] << 16);
      // Written once, read by a later kernel: stream it past L1/L2 retention.
      __stcs(reinterpret_cast<uint4 *>(dst + e), v);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i)  // unrolled: `o` stays in registers
        if (i < cnt) dst[e + i] = o[i];
    }
  }
}

// Elements per block of a supported type, 0 for any other.
int block_elems(int ty) {
  switch (ty) {
    case T_F32: case T_F16: case T_BF16: return 1;
    case T_Q4_0: case T_Q8_0: return 32;
    case T_Q4_K: case T_Q6_K: return 256;
    default: return 0;
  }
}

template <int OUT>
int launch_out(const uint8_t *src, uint16_t *dst, int ty, int64_t n, cudaStream_t stream) {
  int sms = 1;
  const int st = current_sm_count(&sms);
  if (st != PKV_OK) return st;
  const int64_t tiles = (n + DQ_TILE - 1) / DQ_TILE;
  const int64_t want = (tiles + DQ_THREADS / 32 - 1) / (DQ_THREADS / 32);
  const int64_t cap = (int64_t)sms * DQ_BLOCKS_PER_SM;
  const dim3 grid((unsigned)(want < cap ? want : cap));
  // Through launch_kernel, whose status is the launch's own (cudaGetLastError after a
  // triple-chevron launch also returns an earlier runtime call's unread error).
  const auto go = [&](void (*k)(const uint8_t *, uint16_t *, int64_t)) {
    return launch_kernel(k, grid, dim3(DQ_THREADS), 0, stream, 0, src, dst, n);
  };
  switch (ty) {
    case T_F32: return go(dequant_kernel<T_F32, OUT>);
    case T_F16: return go(dequant_kernel<T_F16, OUT>);
    case T_BF16: return go(dequant_kernel<T_BF16, OUT>);
    case T_Q4_0: return go(dequant_kernel<T_Q4_0, OUT>);
    case T_Q8_0: return go(dequant_kernel<T_Q8_0, OUT>);
    case T_Q4_K: return go(dequant_kernel<T_Q4_K, OUT>);
    case T_Q6_K: return go(dequant_kernel<T_Q6_K, OUT>);
    default: return PKV_ERR_DTYPE;
  }
}

}  // namespace
}  // namespace pkv

extern "C" int pkv_dequant_supported(int32_t ggml_type) {
  return pkv::block_elems(ggml_type) != 0;
}

extern "C" int pkv_dequantize(void *dst, int32_t dst_dtype, const void *src, int32_t ggml_type,
                              int64_t n_elements, void *stream) {
  const int be = pkv::block_elems(ggml_type);
  if (be == 0 || (dst_dtype != PKV_DTYPE_F16 && dst_dtype != PKV_DTYPE_BF16))
    return PKV_ERR_DTYPE;
  if (n_elements < 0 || n_elements % be != 0) return PKV_ERR_INVALID_ARG;
  if (n_elements == 0) return PKV_OK;
  if (dst == nullptr || src == nullptr) return PKV_ERR_NULL_POINTER;
  if ((reinterpret_cast<uintptr_t>(dst) & 15u) != 0 ||
      (reinterpret_cast<uintptr_t>(src) & 15u) != 0)
    return PKV_ERR_INVALID_ARG;
  const uint8_t *s = static_cast<const uint8_t *>(src);
  uint16_t *d = static_cast<uint16_t *>(dst);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return dst_dtype == PKV_DTYPE_F16
             ? pkv::launch_out<PKV_DTYPE_F16>(s, d, ggml_type, n_elements, st)
             : pkv::launch_out<PKV_DTYPE_BF16>(s, d, ggml_type, n_elements, st);
}
