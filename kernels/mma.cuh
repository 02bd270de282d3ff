// mma.cuh: warp-level tensor-core primitives for f16 / bf16 kernels (sm_80+): the m16n8k16
// matrix multiply-accumulate with f32 accumulators, the ldmatrix shared-memory fragment load,
// the fragment layouts as functions, and 16-bit pair packing. On the GPU each is one inline-PTX
// instruction; under `cuda-emu` each runs the exact emulation of kernels/emu/emu_mma.h.
//
// Interface (shared by the decode and prefill kernels; keep it stable):
//   mma_m16n8k16<T>(d, a, b, c)       D = A B + C; T = __half or __nv_bfloat16
//   ldmatrix<N, TRANS>(r, smem_row)   N = 1, 2, 4 8x8 matrices of 16-bit elements
//   MmaFrag::{a,b,c}_{row,col}(lane, e)   where element e of a lane's fragment sits
//   pack_f32x2<T>(lo, hi), pack_lo16(x, y), pack_hi16(x, y)
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"): A is 16x16
// row-major (M x K), B 16x8 column-major (K x N), C and D 16x8 f32. Lane l holds, with
// g = l / 4 and q = l % 4 (element e of a 32-bit register pair: low 16 bits first):
//   a[0] = A[g][2q, 2q+1]     a[1] = A[g+8][2q, 2q+1]
//   a[2] = A[g][2q+8, 2q+9]   a[3] = A[g+8][2q+8, 2q+9]
//   b[0] = B[2q, 2q+1][g]     b[1] = B[2q+8, 2q+9][g]
//   c[0], c[1] = C[g][2q], C[g][2q+1]      c[2], c[3] = C[g+8][2q], C[g+8][2q+1]
// Every lane of the warp must execute the call (the instructions are .sync.aligned).
#pragma once

#include <type_traits>

#include "common.cuh"

#ifdef PKV_CUDA_EMU
#include "emu_mma.h"
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "kernels/mma.cuh needs sm_80 or newer (bf16 mma.sync m16n8k16)"
#endif

namespace pkv {

// Where element e of lane `lane`'s fragment sits in its matrix (see the table above). Register
// i of a 16-bit operand holds elements 2i (low half) and 2i + 1.
struct MmaFrag {
  __host__ __device__ static constexpr int a_row(int lane, int e) {
    return lane / 4 + ((e / 2) % 2) * 8;
  }
  __host__ __device__ static constexpr int a_col(int lane, int e) {
    return (lane % 4) * 2 + (e % 2) + (e / 4) * 8;
  }
  __host__ __device__ static constexpr int b_row(int lane, int e) {
    return (lane % 4) * 2 + (e % 2) + (e / 2) * 8;
  }
  __host__ __device__ static constexpr int b_col(int lane, int /*e*/) { return lane / 4; }
  __host__ __device__ static constexpr int c_row(int lane, int e) { return lane / 4 + (e / 2) * 8; }
  __host__ __device__ static constexpr int c_col(int lane, int e) { return (lane % 4) * 2 + (e % 2); }
};

template <typename T> struct MmaElemOf;  // only the two 16-bit float types take an mma
template <> struct MmaElemOf<__half> {
#ifdef PKV_CUDA_EMU
  static constexpr emu::MmaElem kind = emu::MmaElem::F16;
#endif
};
template <> struct MmaElemOf<__nv_bfloat16> {
#ifdef PKV_CUDA_EMU
  static constexpr emu::MmaElem kind = emu::MmaElem::BF16;
#endif
};

// D = A B + C (m16n8k16, f32 accumulate). `d` may be the same array as `c`.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2], const float (&c)[4]);

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                     const uint32_t (&b)[2], const float (&c)[4]) {
#ifdef PKV_CUDA_EMU
  emu::mma_m16n8k16(emu::MmaElem::F16, d, a, b, c);
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
#endif
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                            const uint32_t (&b)[2],
                                                            const float (&c)[4]) {
#ifdef PKV_CUDA_EMU
  emu::mma_m16n8k16(emu::MmaElem::BF16, d, a, b, c);
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
#endif
}

// ldmatrix.sync.aligned.m8n8.xN{.trans}.shared.b16: lanes 8j .. 8j+7 pass the (16-byte aligned,
// shared-memory) addresses of rows 0..7 of matrix j; lane l receives in r[j] row l / 4, columns
// 2 (l % 4) and 2 (l % 4) + 1 of matrix j (of its transpose with TRANS). Lanes whose address
// the instruction does not use (16.. for N = 2, 8.. for N = 1) may pass any valid address.
template <int N, bool TRANS>
__device__ __forceinline__ void ldmatrix(uint32_t (&r)[N], const void *smem_row) {
  static_assert(N == 1 || N == 2 || N == 4, "ldmatrix takes 1, 2 or 4 matrices");
#ifdef PKV_CUDA_EMU
  emu::ldmatrix<N, TRANS>(r, smem_row);
#else
  const uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem_row);
  if constexpr (N == 1 && !TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(addr) : "memory");
  else if constexpr (N == 1 && TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0]) : "r"(addr) : "memory");
  else if constexpr (N == 2 && !TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr) : "memory");
  else if constexpr (N == 2 && TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr) : "memory");
  else if constexpr (N == 4 && !TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
#endif
}

// Two f32 values rounded (to nearest even) to T and packed: lo in bits 0-15, hi in 16-31.
template <typename T> __device__ __forceinline__ uint32_t pack_f32x2(float lo, float hi) {
  (void)sizeof(MmaElemOf<T>);  // f16 / bf16 only
#ifdef PKV_CUDA_EMU
  return (uint32_t)Elem<T>::from_f32(lo).bits | (uint32_t)Elem<T>::from_f32(hi).bits << 16;
#else
  if constexpr (std::is_same<T, __half>::value) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&v);
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&v);
  }
#endif
}

// The low 16 bits of x and of y as one register (x's in the low half): one PRMT.
__device__ __forceinline__ uint32_t pack_lo16(uint32_t x, uint32_t y) {
  return (x & 0xffffu) | (y << 16);
}
// The high 16 bits of x and of y as one register (x's in the low half): one PRMT.
__device__ __forceinline__ uint32_t pack_hi16(uint32_t x, uint32_t y) {
  return (x >> 16) | (y & 0xffff0000u);
}

}  // namespace pkv
