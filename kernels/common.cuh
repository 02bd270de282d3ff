// common.cuh: element-type traits, 16-byte vector load/convert helpers, reductions and the
// dispatch macros shared by every kernel file. Device code only; no host state.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "pagedkv.h"

namespace pkv {

// ---- element types -------------------------------------------------------------------------
// Every kernel is a template over the storage type T (float, __half, __nv_bfloat16). Loads move
// 16 bytes (uint4) at a time: ELEMS_PER_VEC<T> elements, converted to f32 in registers.

template <typename T> struct Elem;
template <> struct Elem<float> {
  static constexpr int VEC = 4;
  __device__ __forceinline__ static float to_f32(float x) { return x; }
  __device__ __forceinline__ static float from_f32(float x) { return x; }
};
template <> struct Elem<__half> {
  static constexpr int VEC = 8;
  __device__ __forceinline__ static float to_f32(__half x) { return __half2float(x); }
  // Round to nearest even, as half::f16::from_f32 on the CPU.
  __device__ __forceinline__ static __half from_f32(float x) { return __float2half_rn(x); }
};
template <> struct Elem<__nv_bfloat16> {
  static constexpr int VEC = 8;
  __device__ __forceinline__ static float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ __forceinline__ static __nv_bfloat16 from_f32(float x) {
    return __float2bfloat16_rn(x);
  }
};

// Converts one 16-byte vector of T (already loaded) into VEC floats.
template <typename T>
__device__ __forceinline__ void vec_to_f32(const uint4 &v, float (&f)[Elem<T>::VEC]) {
  const T *e = reinterpret_cast<const T *>(&v);
#pragma unroll
  for (int i = 0; i < Elem<T>::VEC; ++i) f[i] = Elem<T>::to_f32(e[i]);
}

// Packs VEC floats into one 16-byte vector of T (round to nearest even).
template <typename T>
__device__ __forceinline__ uint4 f32_to_vec(const float (&f)[Elem<T>::VEC]) {
  uint4 v;
  T *e = reinterpret_cast<T *>(&v);
#pragma unroll
  for (int i = 0; i < Elem<T>::VEC; ++i) e[i] = Elem<T>::from_f32(f[i]);
  return v;
}

// 16-byte load that bypasses L1 allocation for streaming data read once (K/V in decode).
__device__ __forceinline__ uint4 ld_stream(const void *p) {
  return __ldcs(reinterpret_cast<const uint4 *>(p));
}
__device__ __forceinline__ uint4 ld_vec(const void *p) {
  return __ldg(reinterpret_cast<const uint4 *>(p));
}

// Streaming loads of 16, 8 or 4 bytes under a predicate, without a branch: when `ok` is false
// nothing is read (no memory traffic, no divergence around the load) and `r` is left as it was
// (ld_cs_if) or zeroed (the _or_zero forms). `p` must be a valid, aligned address either way
// (the decode bodies pass a real row of the cache for a masked token).
#ifdef PKV_CUDA_EMU
__device__ __forceinline__ void ld_cs_if(const void *p, bool ok, uint4 &r) {
  if (ok) r = __ldcs(reinterpret_cast<const uint4 *>(p));
}
__device__ __forceinline__ void ld_cs_if(const void *p, bool ok, uint2 &r) {
  if (ok) r = __ldcs(reinterpret_cast<const uint2 *>(p));
}
__device__ __forceinline__ void ld_cs_if(const void *p, bool ok, uint32_t &r) {
  if (ok) r = __ldcs(reinterpret_cast<const uint32_t *>(p));
}
#else
__device__ __forceinline__ void ld_cs_if(const void *p, bool ok, uint4 &r) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %4, 0;\n"
      " @p ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%5];\n}\n"
      : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w)
      : "r"((int)ok), "l"(p));
}
__device__ __forceinline__ void ld_cs_if(const void *p, bool ok, uint2 &r) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n"
      " @p ld.global.cs.v2.u32 {%0, %1}, [%3];\n}\n"
      : "+r"(r.x), "+r"(r.y)
      : "r"((int)ok), "l"(p));
}
__device__ __forceinline__ void ld_cs_if(const void *p, bool ok, uint32_t &r) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %1, 0;\n"
      " @p ld.global.cs.u32 %0, [%2];\n}\n"
      : "+r"(r)
      : "r"((int)ok), "l"(p));
}
#endif

// A streaming load under a predicate whose result is unspecified when `ok` is false: for a
// caller that discards what a masked load gives (the decode body's K: a masked token's logit
// is replaced by -inf). Unlike the _or_zero forms there is no earlier value for the result to
// merge with, so ptxas can load straight into the register its user wants; with the zero,
// it loaded elsewhere and copied, and that copy (right after the load) stalled the warp for
// the load's whole latency before the work meant to hide it. The emulation gives all-ones
// bits (NaN in f32, f16 and bf16), so a caller that used a masked result would fail the tests.
#ifdef PKV_CUDA_EMU
template <typename V> __device__ __forceinline__ V ld_cs_masked(const void *p, bool ok) {
  V r;
  unsigned char *bytes = reinterpret_cast<unsigned char *>(&r);
  for (size_t i = 0; i < sizeof r; ++i) bytes[i] = 0xff;
  ld_cs_if(p, ok, r);
  return r;
}
#else
template <typename V> __device__ __forceinline__ V ld_cs_masked(const void *p, bool ok);
template <> __device__ __forceinline__ uint4 ld_cs_masked<uint4>(const void *p, bool ok) {
  uint4 r;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %4, 0;\n"
      " @p ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%5];\n}\n"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "r"((int)ok), "l"(p));
  return r;
}
template <> __device__ __forceinline__ uint2 ld_cs_masked<uint2>(const void *p, bool ok) {
  uint2 r;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n"
      " @p ld.global.cs.v2.u32 {%0, %1}, [%3];\n}\n"
      : "=r"(r.x), "=r"(r.y)
      : "r"((int)ok), "l"(p));
  return r;
}
#endif

template <typename V> __device__ __forceinline__ V ld_cs_or_zero(const void *p, bool ok) {
  V r{};
  ld_cs_if(p, ok, r);
  return r;
}

// ---- reductions ------------------------------------------------------------------------------

// Sum over groups of WIDTH consecutive lanes (WIDTH a power of two <= 32); every lane of a
// group ends with the group's sum.
template <int WIDTH> __device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) { return group_sum<32>(x); }

// ---- logit transform (the order is part of the ABI: see pagedkv.h) ---------------------------

// `dot` is q.k in f32; returns the transformed logit, or -INFINITY if the key is masked.
__device__ __forceinline__ float attn_logit(float dot, float scale, float softcap, float slope,
                                            int key_pos, int query_pos, int window) {
  float s = dot * scale;
  if (softcap > 0.f) s = softcap * tanhf(s / softcap);
  s += slope * (float)(key_pos - query_pos);
  if (key_pos > query_pos || (window > 0 && query_pos - key_pos >= window)) s = -INFINITY;
  return s;
}

// exp(x - m) that is 0 when x is -inf (masked), including the all-masked case m = -inf.
__device__ __forceinline__ float safe_exp(float x, float m) {
  return (x == -INFINITY) ? 0.f : __expf(x - m);
}

// ---- misc -----------------------------------------------------------------------------------

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

inline int status_of(cudaError_t e) { return e == cudaSuccess ? PKV_OK : (int)e; }

// The SM count of the device current on this thread (at least 1) into *sms, or the runtime's
// error as a status (the launchers that size grids or choose kernels by it).
inline int current_sm_count(int *sms) {
  int dev = 0, n = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return status_of(e);
  *sms = n > 0 ? n : 1;
  return PKV_OK;
}

// ---- programmatic dependent launch (PKV_LAUNCH_PROGRAMMATIC, pagedkv.h) ----------------------

// First statement of every kernel: waits until the kernel before it on the stream has
// completed and its writes are visible (returns at once after a plain launch, which already
// ordered it), then lets the kernel after it launch early (its blocks then wait here in turn;
// they are scheduled only once every block of this grid has started, so they take no slot this
// grid still needs). sm_90 and later; nothing before (no such launches there) or emulated
// (launches run one after another).
__device__ __forceinline__ void grid_dependency_entry() {
#if !defined(PKV_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Launches kernel k (grid, block, dynamic shared memory smem, stream s) with args; with
// PKV_LAUNCH_PROGRAMMATIC in flags and a device of compute capability 9.0 or later, as a
// programmatic dependent launch. Returns the launch's status.
template <typename... P, typename... A>
int launch_kernel(void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, int flags,
                  A... args) {
#ifdef PKV_CUDA_EMU
  (void)flags;
  // The launch's own status, as cudaLaunchKernelEx returns it (not an earlier call's error).
  return status_of(::emu::launch((const void *)k, [=]() { k(args...); }, grid, block, smem, s));
#else
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = 0;
  int dev = 0, major = 0;
  if ((flags & PKV_LAUNCH_PROGRAMMATIC) != 0 && cudaGetDevice(&dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
      major >= 9) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.numAttrs = 1;
  }
  return status_of(cudaLaunchKernelEx(&cfg, k, args...));
#endif
}

inline bool supported_head_dim(int d) {
  return d == 64 || d == 80 || d == 96 || d == 112 || d == 128 || d == 256;
}
// Tokens per block: every power of two from 8 to 256. Nothing in the kernels depends on the
// block size beyond `t / block_size` and `t % block_size` per token (no warp or tile is tied
// to a block), so the arena's page-size scheme can give a small-KV model up to 256 tokens per
// page.
inline bool supported_block_size(int b) { return b >= 8 && b <= 256 && (b & (b - 1)) == 0; }
inline int dtype_size(int dtype) {
  return dtype == PKV_DTYPE_F32 ? 4 : (dtype == PKV_DTYPE_F16 || dtype == PKV_DTYPE_BF16) ? 2 : 0;
}

// a * b into *out unless it overflows int64 (operands are non-negative).
inline bool mul_i64(int64_t a, int64_t b, int64_t *out) { return !__builtin_mul_overflow(a, b, out); }

// Validates a geometry (and a layer index) the same way for every launcher: sizes positive,
// the page stride at least one block and a whole number of 16-byte units, and the view's
// num_blocks pages addressable in 64-bit bytes.
inline int check_geometry(const pkv_cache_geometry *g, int layer) {
  if (g == nullptr) return PKV_ERR_NULL_POINTER;
  const int es = dtype_size(g->dtype);
  if (es == 0) return PKV_ERR_DTYPE;
  if (!supported_head_dim(g->head_dim)) return PKV_ERR_HEAD_DIM;
  if (!supported_block_size(g->block_size)) return PKV_ERR_BLOCK_SIZE;
  if (g->num_blocks <= 0 || g->num_layers <= 0 || g->num_kv_heads <= 0) return PKV_ERR_INVALID_ARG;
  if (layer < 0 || layer >= g->num_layers) return PKV_ERR_INVALID_ARG;
  // The block's own elements, L*2*BS*H*D; an int64 overflow means no stride can hold it.
  int64_t elems = 2 * (int64_t)g->block_size * g->head_dim;
  if (!mul_i64(elems, g->num_kv_heads, &elems) || !mul_i64(elems, g->num_layers, &elems))
    return PKV_ERR_PAGE_STRIDE;
  if (g->block_stride < elems) return PKV_ERR_PAGE_STRIDE;
  int64_t page_bytes = 0, span = 0;
  if (!mul_i64(g->block_stride, es, &page_bytes) || !mul_i64(page_bytes, g->num_blocks, &span))
    return PKV_ERR_PAGE_STRIDE;
  if (page_bytes % PKV_PAGE_ALIGN != 0) return PKV_ERR_PAGE_ALIGN;
  return PKV_OK;
}

// Element strides of the layout (int64: an arena may exceed 2^31 elements).
struct Strides {
  int64_t token;  // H*D
  int64_t kv;     // BS*H*D
  int64_t layer;  // 2*BS*H*D
  int64_t block;  // the page stride, >= L*2*BS*H*D (check_geometry)
  __host__ __device__ static Strides of(const pkv_cache_geometry &g) {
    Strides s;
    s.token = (int64_t)g.num_kv_heads * g.head_dim;
    s.kv = s.token * g.block_size;
    s.layer = 2 * s.kv;
    s.block = g.block_stride;
    return s;
  }
  // Elements of one block's own data (all layers, K and V): what a block copy moves.
  __host__ __device__ int64_t block_elems(int num_layers) const { return layer * num_layers; }
};

// The longest context a block table row of `max_blocks_per_seq` entries can name, clamped to
// int32 (the kernels compare it with int32 context lengths; the product itself can exceed
// 2^31 with 256-token blocks).
inline int32_t table_tokens_i32(int32_t max_blocks_per_seq, int32_t block_size) {
  const int64_t t = (int64_t)max_blocks_per_seq * block_size;
  return t > INT32_MAX ? INT32_MAX : (int32_t)t;
}

}  // namespace pkv

// Expands BODY with `T` bound to the storage type of `dtype`; returns PKV_ERR_DTYPE otherwise.
#define PKV_DISPATCH_DTYPE(dtype, ...)                   \
  switch (dtype) {                                       \
    case PKV_DTYPE_F32: {                                \
      using T = float;                                   \
      __VA_ARGS__;                                       \
    } break;                                             \
    case PKV_DTYPE_F16: {                                \
      using T = __half;                                  \
      __VA_ARGS__;                                       \
    } break;                                             \
    case PKV_DTYPE_BF16: {                               \
      using T = __nv_bfloat16;                           \
      __VA_ARGS__;                                       \
    } break;                                             \
    default:                                             \
      return PKV_ERR_DTYPE;                              \
  }

// Expands BODY with the constexpr int `D` bound to head_dim; returns PKV_ERR_HEAD_DIM otherwise.
#define PKV_DISPATCH_HEAD_DIM(head_dim, ...)             \
  switch (head_dim) {                                    \
    case 64: { constexpr int D = 64; __VA_ARGS__; } break;   \
    case 80: { constexpr int D = 80; __VA_ARGS__; } break;   \
    case 96: { constexpr int D = 96; __VA_ARGS__; } break;   \
    case 112: { constexpr int D = 112; __VA_ARGS__; } break; \
    case 128: { constexpr int D = 128; __VA_ARGS__; } break; \
    case 256: { constexpr int D = 256; __VA_ARGS__; } break; \
    default:                                             \
      return PKV_ERR_HEAD_DIM;                           \
  }
