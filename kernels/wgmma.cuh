// wgmma.cuh: the Hopper warpgroup matrix multiply (wgmma.mma_async, sm_90a) for the prefill
// kernel of prefill_wgmma.cuh: A from registers (each warp's 16 rows in the m16n8k16 A fragment
// layout of mma.cuh), B from shared memory through a matrix descriptor, f32 accumulators. Under
// `cuda-emu` each call runs the emulation of kernels/emu/emu_mma.h synchronously.
//
// Interface:
//   smem_desc(p, base, lbo, sbo, sw)  descriptor of the B operand at shared address p (base:
//                                    the block's dynamic shared memory, which the emulation's
//                                    addresses are relative to) in swizzle mode sw: 0 (none)
//                                    or the 128-, 64- or 32-byte swizzle
//   swizzled<SW>(u)                  where a swizzled layout stores the 16 bytes whose
//                                    canonical (unswizzled) offset is u
//   shared_align1024<T>(p)           p rounded up to the swizzle pattern's 1024 bytes
//   wgmma_rs<T, N, TRANS_B>(d, a, desc, base)   d[N/2] += A (64 x 16) B (16 x N), N = 64, 80,
//                                    96, 112 or 128 (the prefill kernel's widths)
//   wgmma_fence(), wgmma_commit(), wgmma_wait<K>()   the instruction's ordering protocol
//
// Layouts (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate", its shared
// memory layouts and matrix descriptor). B is built of core matrices of 8 rows x 16 bytes.
// - No swizzle: the leading offset `lbo` is the step between core matrices adjacent in k and
//   the stride offset `sbo` the step between those adjacent in n, for both majors (canonical
//   K-major ((8,m),(T,2k)):((1T,SBO),(1,LBO)), MN-major ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)),
//   and the ISA's worked MN-major bf16 example, LBO 256 bytes along k, SBO 128 along n;
//   measured on an H100 by pkv_wgmma_layout_probe). K-major B (TRANS_B = 0; k contiguous, as
//   the keys' rows of K for Q K^T): element (k, n) at (k / 8) lbo + (n / 8) sbo + (n % 8) 16 +
//   (k % 8) 2. MN-major B (TRANS_B = 1; n contiguous, as V's rows for P V): element (k, n) at
//   (k / 8) lbo + (n / 8) sbo + (k % 8) 16 + (n % 8) 2.
// - Swizzled, SW = 128, 64 or 32 bytes (an "atom" row of SW contiguous bytes, SW / 2 elements):
//   the canonical offset is computed as below, added to the start address, and the 16-byte
//   chunk bits of that address (4 .. 4 + b - 1, b = log2(SW / 16)) are XORed with bits 7 ..
//   7 + b - 1: the row inside the 8-row pattern, so the 8 rows' same chunk lands in 8
//   different banks. The pattern repeats every 2^(7 + b) bytes, so an operand's atoms must sit
//   at multiples of that in the shared window (shared_align1024). K-major ((8,m),(T,2k)):((SW/16 T,SBO),(1,T)): row n at (n / 8) sbo + (n % 8) SW,
//   the instruction's 16 k elements (32 bytes) inside one row; successive k steps advance the
//   start address inside the row (lbo unused). MN-major ((T,SW/16,m),(8,k)):((1,T,LBO),(SW/16
//   T,SBO)): element (k, n) at (n / (SW / 2)) lbo + (n % (SW / 2)) 2 + (k / 8) sbo + (k % 8) SW:
//   an SW-byte row of n per k, atoms of SW / 2 n lbo apart, 8-k groups sbo apart.
// The accumulator: warp w of the warpgroup holds rows 16 w .. 16 w + 15; for each 8 columns i,
// d[4 i + e] is row g + 8 (e / 2), column 8 i + 2 q + (e % 2) (g = lane / 4, q = lane % 4),
// the mma.m16n8k16 C layout per n8 tile.
#pragma once

#include "mma.cuh"

#ifdef PKV_CUDA_EMU
#include "emu_mma.h"
#endif

namespace pkv {

// The descriptor's layout type (bits 62-63) of a swizzle of SW bytes (0: none).
__host__ __device__ constexpr uint64_t swizzle_mode(int sw) {
  return sw == 128 ? 1 : sw == 64 ? 2 : sw == 32 ? 3 : 0;
}

// Where the SW-byte swizzle stores the 16 bytes whose canonical offset is u (from a base
// aligned to the pattern's 2^(7 + b) bytes): chunk bits 4 .. 3 + b XOR row bits 7 .. 6 + b.
template <int SW> __host__ __device__ constexpr uint32_t swizzled(uint32_t u) {
  static_assert(SW == 128 || SW == 64 || SW == 32, "the 128-, 64- and 32-byte swizzles");
  constexpr uint32_t mask = SW / 16 - 1;  // b bits
  return u ^ (((u >> 7) & mask) << 4);
}

// p (shared memory) rounded up to the next multiple of 1024 bytes of the shared window, the
// 128-byte swizzle's period (callers allocate 1024 bytes more). The emulation's descriptor
// offsets are taken from the pointer this returns, so rounding its host address is the same.
template <typename T> __device__ __forceinline__ T *shared_align1024(void *p) {
#ifdef PKV_CUDA_EMU
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<T *>((a + 1023) & ~static_cast<uintptr_t>(1023));
#else
  const uint32_t s = (uint32_t)__cvta_generic_to_shared(p);
  return reinterpret_cast<T *>(static_cast<char *>(p) + (((s + 1023u) & ~1023u) - s));
#endif
}

// The 64-bit shared-memory matrix descriptor: start address, leading and stride byte offsets
// (each >> 4, 14 bits), base offset 0, layout type swizzle_mode(sw).
__device__ __forceinline__ uint64_t smem_desc(const void *p, const void *base, uint32_t lbo,
                                              uint32_t sbo, int sw = 0) {
#ifdef PKV_CUDA_EMU
  const uint32_t addr = (uint32_t)(static_cast<const char *>(p) - static_cast<const char *>(base));
#else
  (void)base;
  const uint32_t addr = (uint32_t)__cvta_generic_to_shared(p);
#endif
  return (uint64_t)((addr >> 4) & 0x3FFFu) | (uint64_t)((lbo >> 4) & 0x3FFFu) << 16 |
         (uint64_t)((sbo >> 4) & 0x3FFFu) << 32 | swizzle_mode(sw) << 62;
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
