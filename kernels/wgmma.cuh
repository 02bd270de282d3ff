// wgmma.cuh: the Hopper warpgroup matrix multiply (wgmma.mma_async, sm_90a) for the prefill
// kernel of prefill_wgmma.cuh: A from registers (each warp's 16 rows in the m16n8k16 A fragment
// layout of mma.cuh), B from shared memory through a matrix descriptor, f32 accumulators. Under
// `cuda-emu` each call runs the emulation of kernels/emu/emu_mma.h synchronously.
//
// Interface:
//   smem_desc(p, base, lbo, sbo)     descriptor of the no-swizzle B operand at shared address p
//                                    (base: the block's dynamic shared memory, which the
//                                    emulation's addresses are relative to)
//   wgmma_rs<T, N, TRANS_B>(d, a, desc, base)   d[N/2] += A (64 x 16) B (16 x N), N = 64, 80,
//                                    96, 112 or 128 (the prefill kernel's widths)
//   wgmma_fence(), wgmma_commit(), wgmma_wait<K>()   the instruction's ordering protocol
//
// Layouts (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"; no swizzle):
// shared memory holds B as 8 x 8 core matrices, each 8 rows of 16 contiguous bytes (128 bytes).
// Without swizzle the leading offset `lbo` is the step between core matrices adjacent in k and
// the stride offset `sbo` the step between those adjacent in n, for both majors (the ISA's
// canonical layouts, K-major ((8,m),(T,2k)):((1T,SBO),(1,LBO)) and MN-major
// ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)), and its worked MN-major bf16 example, LBO 256 bytes
// along k, SBO 128 along n). Only the inside of a core matrix differs. K-major B (TRANS_B = 0;
// k contiguous, as the keys' rows of K for Q K^T): element (k, n) at (k / 8) lbo + (n / 8) sbo +
// (n % 8) 16 + (k % 8) 2. MN-major B (TRANS_B = 1; n contiguous, as V's rows for P V): element
// (k, n) at (k / 8) lbo + (n / 8) sbo + (k % 8) 16 + (n % 8) 2. The accumulator: warp w of the
// warpgroup holds rows 16 w .. 16 w + 15; for each 8 columns i, d[4 i + e] is row g + 8 (e / 2),
// column 8 i + 2 q + (e % 2) (g = lane / 4, q = lane % 4), the mma.m16n8k16 C layout per n8
// tile.
#pragma once

#include "mma.cuh"

#ifdef PKV_CUDA_EMU
#include "emu_mma.h"
#endif

namespace pkv {

// The 64-bit shared-memory matrix descriptor: start address, leading and stride byte offsets
// (each >> 4, 14 bits), base offset 0, no swizzle (bits 62-63 = 0).
__device__ __forceinline__ uint64_t smem_desc(const void *p, const void *base, uint32_t lbo,
                                              uint32_t sbo) {
#ifdef PKV_CUDA_EMU
  const uint32_t addr = (uint32_t)(static_cast<const char *>(p) - static_cast<const char *>(base));
#else
  (void)base;
  const uint32_t addr = (uint32_t)__cvta_generic_to_shared(p);
#endif
  return (uint64_t)((addr >> 4) & 0x3FFFu) | (uint64_t)((lbo >> 4) & 0x3FFFu) << 16 |
         (uint64_t)((sbo >> 4) & 0x3FFFu) << 32;
}

// Orders this thread's register and shared-memory accesses before the wgmma that follow.
__device__ __forceinline__ void wgmma_fence() {
#ifndef PKV_CUDA_EMU
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifndef PKV_CUDA_EMU
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  emu::wgmma_commit_group();
#endif
}
// Waits until at most K committed wgmma groups are pending.
template <int K> __device__ __forceinline__ void wgmma_wait() {
#ifndef PKV_CUDA_EMU
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(K) : "memory");
#else
  emu::wgmma_wait_group(K);
#endif
}
// Keeps the compiler from moving accesses of r across the wgmma protocol (an empty asm that
// reads and writes it).
__device__ __forceinline__ void wgmma_pin(float &r) {
#ifndef PKV_CUDA_EMU
  asm volatile("" : "+f"(r)::"memory");
#else
  (void)r;
#endif
}
__device__ __forceinline__ void wgmma_pin(uint32_t &r) {
#ifndef PKV_CUDA_EMU
  asm volatile("" : "+r"(r)::"memory");
#else
  (void)r;
#endif
}
// Shared-memory writes of the generic proxy (cp.async, st.shared) made visible to the async
// proxy that wgmma reads B through; before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async_shared() {
#ifndef PKV_CUDA_EMU
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

#ifndef PKV_CUDA_EMU
#define PKV_WGMMA_RS_N64(TY)                                                          \
  asm volatile(                                                                       \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                    \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {"                    \
      "%0, %1, %2, %3, %4, %5, %6, %7, "                                              \
      "%8, %9, %10, %11, %12, %13, %14, %15, "                                        \
      "%16, %17, %18, %19, %20, %21, %22, %23, "                                      \
      "%24, %25, %26, %27, %28, %29, %30, %31"                                        \
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                              \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),       \
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),     \
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
        "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
        "+f"(d[30]), "+f"(d[31])                                                      \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TRANS_B))

#define PKV_WGMMA_RS_N80(TY)                                                          \
  asm volatile(                                                                       \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %45, 0;\n"                                    \
      "wgmma.mma_async.sync.aligned.m64n80k16.f32." TY "." TY " {"                    \
      "%0, %1, %2, %3, %4, %5, %6, %7, "                                              \
      "%8, %9, %10, %11, %12, %13, %14, %15, "                                        \
      "%16, %17, %18, %19, %20, %21, %22, %23, "                                      \
      "%24, %25, %26, %27, %28, %29, %30, %31, "                                      \
      "%32, %33, %34, %35, %36, %37, %38, %39"                                        \
      "}, {%40, %41, %42, %43}, %44, p, 1, 1, %46;\n}\n"                              \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),       \
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),     \
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
        "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])                            \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TRANS_B))

#define PKV_WGMMA_RS_N96(TY)                                                          \
  asm volatile(                                                                       \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"                                    \
      "wgmma.mma_async.sync.aligned.m64n96k16.f32." TY "." TY " {"                    \
      "%0, %1, %2, %3, %4, %5, %6, %7, "                                              \
      "%8, %9, %10, %11, %12, %13, %14, %15, "                                        \
      "%16, %17, %18, %19, %20, %21, %22, %23, "                                      \
      "%24, %25, %26, %27, %28, %29, %30, %31, "                                      \
      "%32, %33, %34, %35, %36, %37, %38, %39, "                                      \
      "%40, %41, %42, %43, %44, %45, %46, %47"                                        \
      "}, {%48, %49, %50, %51}, %52, p, 1, 1, %54;\n}\n"                              \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),       \
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),     \
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
        "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])  \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TRANS_B))

#define PKV_WGMMA_RS_N112(TY)                                                         \
  asm volatile(                                                                       \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %61, 0;\n"                                    \
      "wgmma.mma_async.sync.aligned.m64n112k16.f32." TY "." TY " {"                   \
      "%0, %1, %2, %3, %4, %5, %6, %7, "                                              \
      "%8, %9, %10, %11, %12, %13, %14, %15, "                                        \
      "%16, %17, %18, %19, %20, %21, %22, %23, "                                      \
      "%24, %25, %26, %27, %28, %29, %30, %31, "                                      \
      "%32, %33, %34, %35, %36, %37, %38, %39, "                                      \
      "%40, %41, %42, %43, %44, %45, %46, %47, "                                      \
      "%48, %49, %50, %51, %52, %53, %54, %55"                                        \
      "}, {%56, %57, %58, %59}, %60, p, 1, 1, %62;\n}\n"                              \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),       \
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),     \
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
        "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), \
        "+f"(d[54]), "+f"(d[55])                                                      \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TRANS_B))

#define PKV_WGMMA_RS_N128(TY)                                                         \
  asm volatile(                                                                       \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                    \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {"                   \
      "%0, %1, %2, %3, %4, %5, %6, %7, "                                              \
      "%8, %9, %10, %11, %12, %13, %14, %15, "                                        \
      "%16, %17, %18, %19, %20, %21, %22, %23, "                                      \
      "%24, %25, %26, %27, %28, %29, %30, %31, "                                      \
      "%32, %33, %34, %35, %36, %37, %38, %39, "                                      \
      "%40, %41, %42, %43, %44, %45, %46, %47, "                                      \
      "%48, %49, %50, %51, %52, %53, %54, %55, "                                      \
      "%56, %57, %58, %59, %60, %61, %62, %63"                                        \
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"                              \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),       \
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),     \
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
        "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), \
        "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
        "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                            \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TRANS_B))
#endif

// d += A B for this warp's 16 rows (see the top); every thread of the warpgroup must call it
// with the same desc and N.
template <typename T, int N, int TRANS_B>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4],
                                         uint64_t desc, const void *base) {
  static_assert(N >= 64 && N <= 128 && N % 16 == 0, "the prefill kernel's widths");
  (void)sizeof(MmaElemOf<T>);  // f16 / bf16 only
#ifdef PKV_CUDA_EMU
  emu::wgmma_m64nNk16<N>(MmaElemOf<T>::kind, d, a, desc, base, TRANS_B != 0);
#else
  (void)base;
  const uint32_t scale_d = 1;
#define PKV_WGMMA_RS_BY_N(TY)                                  \
  if constexpr (N == 64) PKV_WGMMA_RS_N64(TY);                 \
  else if constexpr (N == 80) PKV_WGMMA_RS_N80(TY);            \
  else if constexpr (N == 96) PKV_WGMMA_RS_N96(TY);            \
  else if constexpr (N == 112) PKV_WGMMA_RS_N112(TY);          \
  else PKV_WGMMA_RS_N128(TY)
  if constexpr (std::is_same<T, __half>::value) {
    PKV_WGMMA_RS_BY_N("f16");
  } else {
    PKV_WGMMA_RS_BY_N("bf16");
  }
#undef PKV_WGMMA_RS_BY_N
#endif
}

}  // namespace pkv
