// emu.h: a CPU emulation of the slice of CUDA that kernels/ uses, so the kernels and their
// launchers run unchanged (after build.rs's two mechanical rewrites, see build/emu.rs) on a
// machine without a GPU, under feature `cuda-emu`.
//
// Why: no GPU is lent to most sessions of this project, and kernels that never ran are kernels
// with unknown bugs. Compiled here, the very same index arithmetic, lane layouts, shuffles,
// barriers, split-K partitioning and launch configurations run against the CPU oracle.
//
// Model:
// - A launch runs its thread blocks one after another on the calling OS thread. Each CUDA
//   thread of a block is a fiber (own stack, cooperative switch); a fiber runs until it reaches
//   a barrier (__syncthreads, __syncwarp, or either half of a shuffle) or returns.
// - Barriers count live threads only: a thread that returned no longer takes part (as on
//   sm_70+). A barrier no live thread can pass (a __syncthreads under divergent control flow)
//   is reported as a deadlock and fails the launch.
// - Warp shuffles exchange through a per-warp slot array between two warp barriers; reading a
//   lane that has returned is an error.
// - The fiber order of every scheduling pass is a policy (forward, reverse, seeded random):
//   a kernel free of shared-memory races gives bit-identical results under all of them.
// - __shared__ variables are block-scope thread_locals (the fibers of a block share the OS
//   thread; blocks run one at a time), poisoned with 0xFF bytes (NaN as f32) at the start of
//   every block like the dynamic shared memory, which is a guarded allocation.
// - Faults a GPU would raise are checked where the emulation can see them: loads and stores
//   through the cache-hint intrinsics at less than their natural alignment, launch
//   configurations the hardware refuses (block > 1024 threads, grid y/z > 65535, > 48 KiB of
//   dynamic shared memory without the opt-in attribute), accesses past a guarded allocation
//   (pkv_emu_alloc) or the dynamic shared memory (SIGSEGV, reported and aborted), writes into
//   the slack the guard pages miss (before the data in its page, and the rounding of its
//   length to 16 bytes: poisoned, checked after every launch and copy), ldmatrix / cp.async /
//   wgmma operands outside shared memory, lanes of a warp meeting at different warp-level
//   operations (a full-mask shuffle some lanes skip), and wgmma without its whole warpgroup or
//   with different descriptors across it. kernels/emu/selftest.cu has a wrong kernel for each.
// - Errors are sticky per OS thread and read through cudaGetLastError(), as launch errors are:
//   as on a GPU, a failed runtime call (cudaFuncSetAttribute, cudaMemcpyAsync, a launch) leaves
//   its error there until it is read, while the call itself returns its own status. The
//   opt-in shared memory limit follows the compute capability set for the thread (227 KiB on
//   9.0, 163 KiB on 8.0, 99 KiB on 8.6 / 8.9).
//
// Not modelled: timing, memory coalescing, the L1/L2 hierarchy, real concurrency between
// blocks (a kernel whose blocks wait for each other would deadlock here), streams (everything is
// synchronous), concurrent atomics (blocks run one at a time: the decode split merge's arrival
// counter is exercised in every block order, not under contention). Not caught: lost updates of
// a non-atomic read-modify-write by several threads (each thread runs alone between barriers),
// __ldg of data written earlier in the same launch (the non-coherent path reads what is there),
// missing fences (__threadfence, fence.proxy.async, wgmma fences do nothing here), plain
// pointer dereferences at less than natural alignment; racecheck on a GPU is for those.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Block-scope thread_local is static storage per OS thread: one instance per running block.
#define __shared__ thread_local

// ---- vector and index types ---------------------------------------------------------------

struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  return uint4{x, y, z, w};
}
inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }

// ---- the CUDA runtime types and calls the launchers use -----------------------------------

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorHostMemoryAlreadyRegistered = 712,
  cudaErrorHostMemoryNotRegistered = 713,
  cudaErrorMisalignedAddress = 716,
  cudaErrorLaunchFailure = 719,
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};
struct cudaFuncAttributes {
  size_t sharedSizeBytes;
  int maxThreadsPerBlock;
};
struct CUstream_st;
typedef CUstream_st *cudaStream_t;

cudaError_t cudaGetLastError();
cudaError_t cudaGetDevice(int *dev);
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int dev);
cudaError_t cudaRuntimeGetVersion(int *version);
const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream);
constexpr unsigned int cudaHostRegisterPortable = 1;
cudaError_t cudaHostRegister(void *ptr, size_t bytes, unsigned int flags);
cudaError_t cudaHostUnregister(void *ptr);

namespace emu {

// Dynamic shared memory above this needs cudaFuncAttributeMaxDynamicSharedMemorySize.
constexpr size_t DEFAULT_DYNAMIC_SMEM = 48 * 1024;
// The opt-in ceiling of sm_90 (227 KiB).
constexpr size_t MAX_DYNAMIC_SMEM = 227 * 1024;

cudaError_t func_set_max_dynamic_smem(const void *kernel, int bytes);

// The currently running emulated thread's coordinates (valid inside a kernel only).
struct ThreadCoords {
  uint3 thread, block;
  dim3 block_dim, grid_dim;
};
extern thread_local const ThreadCoords *tl_coords;

// Runs `body` (a kernel call with its arguments bound) for every thread of every block.
// `kernel` identifies the kernel for its attributes. Returns the launch's own status (what
// cudaLaunchKernelEx returns); a failure is also the thread's last error (cudaGetLastError),
// and an earlier unread error stays the last error after a launch that succeeds.
cudaError_t launch_erased(const void *kernel, void (*call)(const void *), const void *body,
                          dim3 grid, dim3 block, size_t smem);

template <typename F>
inline cudaError_t launch(const void *kernel, const F &body, dim3 grid, dim3 block,
                          size_t smem = 0, cudaStream_t stream = nullptr) {
  (void)stream;  // every emulated launch is synchronous
  return launch_erased(
      kernel, [](const void *f) { (*static_cast<const F *>(f))(); }, &body, grid, block, smem);
}

// The block's dynamic shared memory (`extern __shared__ T name[]` is rewritten to this).
void *dynamic_smem_raw();
template <typename T> inline T *dynamic_smem() { return static_cast<T *>(dynamic_smem_raw()); }

// Counts thread blocks run on this OS thread: a block's identity for poison_shared_once.
extern thread_local uint64_t tl_block_serial;

// Adds a static __shared__ variable's size to the running block's total and fails the launch
// when static + dynamic shared memory exceed what the kernel may use (48 KiB without the
// opt-in attribute, 227 KiB with it), as the hardware refuses such a launch.
void account_static_shared(const void *addr, size_t bytes);
// Whether [p, p + bytes) lies inside the running block's shared memory (the dynamic allocation
// or a static __shared__ variable it has declared).
bool in_shared(const void *p, size_t bytes);
// Faults unless [p, p + bytes) lies in shared memory (ldmatrix, cp.async, wgmma operands).
void check_shared(const void *p, size_t bytes, const char *what);

// Fills a static __shared__ variable with 0xFF bytes (NaN as f32) the first time any thread of
// the running block passes its declaration, and counts its size (build/emu.rs inserts the call
// after the declaration, with a fresh lambda as `Tag` so every variable has its own marker).
template <typename V, typename Tag> inline void poison_shared_once(V &v, Tag) {
  static thread_local uint64_t poisoned_in = 0;
  if (poisoned_in != tl_block_serial) {
    poisoned_in = tl_block_serial;
    memset(static_cast<void *>(&v), 0xff, sizeof(V));
    account_static_shared(static_cast<const void *>(&v), sizeof(V));
  }
}

void syncthreads();
void syncwarp(unsigned mask);
uint64_t shfl_xor_bits(unsigned mask, uint64_t bits, int lane_mask, int width);
uint64_t shfl_idx_bits(unsigned mask, uint64_t bits, int src_lane, int width);
// Whether `pred` holds in any lane of the calling warp (a warp barrier, as a shuffle).
bool vote_any(unsigned mask, bool pred);
// The live lanes' predicates, lane l at bit l (__ballot_sync; the full mask only).
unsigned vote_ballot(unsigned mask, bool pred);
// Whether asynchronous copies (cp.async) land when issued instead of at the wait that covers
// them (pkv_emu_set_copies_at_issue): the two ends of the window in which the hardware may
// write, one exposing reads before the wait, the other writes into data still being read.
bool copies_at_issue();
// The calling thread's lane in its warp (its linear index in the block % 32).
int lane_id();
// Most 32-bit words one lane posts to warp_gather (an mma posts 6, an ldmatrix 2).
constexpr int GATHER_WORDS = 8;
// Warp-collective exchange behind the emulated mma and ldmatrix: every lane of the calling warp
// posts `bytes` (a multiple of 4, at most 4 * GATHER_WORDS) from `mine`; once all have, `all`
// ([32][bytes]) receives every lane's post in lane order. All 32 lanes must take part, as the
// .sync.aligned instructions require: a warp with a returned or missing lane fails the launch.
void warp_gather(const void *mine, size_t bytes, void *all);
// Records a device-side fault (the launch fails with `e`) and ends the calling thread's block.
[[noreturn]] void fault(cudaError_t e, const char *what, const void *addr);

inline void check_align16(const void *p, const char *what) {
  if ((reinterpret_cast<uintptr_t>(p) & 15u) != 0) fault(cudaErrorMisalignedAddress, what, p);
}
// Every global access of a power-of-two size must be naturally aligned on a GPU.
template <typename T> inline void check_natural_align(const T *p, const char *what) {
  constexpr size_t a = sizeof(T);
  static_assert((a & (a - 1)) == 0, "a power-of-two access size");
  if ((reinterpret_cast<uintptr_t>(p) & (a - 1)) != 0) fault(cudaErrorMisalignedAddress, what, p);
}

// The calling emulated thread's T, value-initialized for every block: per-thread state of the
// asynchronous instructions (a block's fibers share the OS thread, so one thread_local vector
// per T holds the running block's instances, as for its __shared__ variables).
template <typename T> inline T &per_thread() {
  static thread_local uint64_t block = ~(uint64_t)0;
  static thread_local std::vector<T> all;
  const ThreadCoords &c = *tl_coords;
  if (block != tl_block_serial) {
    block = tl_block_serial;
    all.assign((size_t)c.block_dim.x * c.block_dim.y * c.block_dim.z, T{});
  }
  return all[c.thread.x + (size_t)c.block_dim.x * (c.thread.y + (size_t)c.block_dim.y * c.thread.z)];
}

// One thread's operations of an asynchronous instruction family (cp.async, wgmma) in commit
// groups: the GPU may perform an operation any time between its issue and the wait_group that
// covers its group, so the emulation performs it at that wait (the latest moment). Reading a
// result before its wait, or changing an operand the operation has yet to read, then gives a
// wrong result here, as it may on the GPU, instead of passing because the emulation was eager.
template <typename Op> struct AsyncGroups {
  std::vector<Op> ops;         // issued and not yet performed, in issue order
  std::vector<size_t> groups;  // the end (in ops) of each committed group, oldest first

  void issue(const Op &op) { ops.push_back(op); }
  void commit() { groups.push_back(ops.size()); }
  // wait_group n: performs the oldest committed groups (run(op), in issue order) until at most
  // n are pending. Uncommitted operations stay pending, as on the GPU.
  template <typename Run> void wait(int n, Run run) {
    while ((int)groups.size() > n) {
      const size_t end = groups.front();
      for (size_t i = 0; i < end; ++i) run(ops[i]);
      ops.erase(ops.begin(), ops.begin() + (std::ptrdiff_t)end);
      groups.erase(groups.begin());
      for (size_t &g : groups) g -= end;
    }
  }
};

}  // namespace emu

template <typename K> inline cudaError_t cudaFuncSetAttribute(K *kernel, cudaFuncAttribute attr,
                                                              int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  return emu::func_set_max_dynamic_smem(reinterpret_cast<const void *>(kernel), value);
}
template <typename K> inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *attr,
                                                               K *kernel) {
  if (attr == nullptr || kernel == nullptr) return cudaErrorInvalidValue;
  attr->sharedSizeBytes = 0;
  attr->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}

// ---- thread coordinates -------------------------------------------------------------------

#define threadIdx (::emu::tl_coords->thread)
#define blockIdx (::emu::tl_coords->block)
#define blockDim (::emu::tl_coords->block_dim)
#define gridDim (::emu::tl_coords->grid_dim)

// ---- synchronization and warp shuffles ------------------------------------------------------

inline void __syncthreads() { emu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::syncwarp(mask); }

template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a scalar");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  bits = emu::shfl_xor_bits(mask, bits, lane_mask, width);
  T r;
  memcpy(&r, &bits, sizeof(T));
  return r;
}

template <typename T> inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a scalar");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  bits = emu::shfl_idx_bits(mask, bits, src_lane, width);
  T r;
  memcpy(&r, &bits, sizeof(T));
  return r;
}

inline int __any_sync(unsigned mask, int pred) { return emu::vote_any(mask, pred != 0) ? 1 : 0; }
// All lanes vote yes exactly when none votes no.
inline int __all_sync(unsigned mask, int pred) { return emu::vote_any(mask, pred == 0) ? 0 : 1; }
inline unsigned __ballot_sync(unsigned mask, int pred) { return emu::vote_ballot(mask, pred != 0); }
// 1 + the index of the least significant set bit, 0 for none.
inline int __ffs(int x) { return x == 0 ? 0 : __builtin_ctz((unsigned)x) + 1; }

// ---- loads and stores with cache hints (the hints mean nothing here) -----------------------

template <typename T> inline T __ldg(const T *p) {
  emu::check_natural_align(p, "__ldg of a misaligned address");
  return *p;
}
template <typename T> inline T __ldcs(const T *p) {
  emu::check_natural_align(p, "__ldcs of a misaligned address");
  return *p;
}
template <typename T> inline T __ldcg(const T *p) {
  emu::check_natural_align(p, "__ldcg of a misaligned address");
  return *p;
}
template <typename T> inline void __stcs(T *p, const T &v) {
  emu::check_natural_align(p, "__stcs of a misaligned address");
  *p = v;
}

// ---- atomics and fences ---------------------------------------------------------------------
// Blocks run one at a time and a block's fibers switch only at barriers, so a read-modify-write
// is atomic as written, and every write is visible to the next block: a fence has nothing to
// order. What the emulation does check is the protocol's logic under every block order (the
// launch's schedule policy decides which block of a group arrives last).

inline unsigned atomicAdd(unsigned *p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
inline unsigned atomicExch(unsigned *p, unsigned v) {
  const unsigned old = *p;
  *p = v;
  return old;
}
inline void __threadfence() {}

// ---- math ------------------------------------------------------------------------------------

// The GPU's __expf is ex2.approx(x * log2(e)): a few ulp off expf. Computing it the same way
// keeps tolerance problems visible here.
inline float __expf(float x) { return exp2f(x * 1.4426950408889634f); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

// ---- half and bfloat16 storage types (conversions round to nearest even) -------------------

struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};

namespace emu {
inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
}  // namespace emu

inline float __half2float(__half h) {
  const uint32_t sign = (uint32_t)(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t man = h.bits & 0x3ffu;
  if (exp == 0x1f) return emu::f32_from_bits(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp != 0) return emu::f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
  if (man == 0) return emu::f32_from_bits(sign);
  // Subnormal: normalize the mantissa.
  int e = 113;
  while ((man & 0x400u) == 0) {
    man <<= 1;
    --e;
  }
  return emu::f32_from_bits(sign | ((uint32_t)e << 23) | ((man & 0x3ffu) << 13));
}

inline __half __float2half_rn(float f) {
  const uint32_t x = emu::f32_bits(f);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  const uint32_t exp = (x >> 23) & 0xffu;
  uint32_t man = x & 0x7fffffu;
  if (exp == 0xff) return __half{(uint16_t)(sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0))};
  const int e = (int)exp - 127 + 15;
  if (e >= 0x1f) return __half{(uint16_t)(sign | 0x7c00u)};  // overflow: infinity
  if (e <= 0) {
    if (e < -10) return __half{sign};  // below half the smallest subnormal: zero
    man |= 0x800000u;
    const int shift = 14 - e;
    uint32_t m = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (m & 1u))) ++m;
    return __half{(uint16_t)(sign | m)};
  }
  uint32_t h = (uint32_t)sign | ((uint32_t)e << 10) | (man >> 13);
  const uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry rounds up into infinity
  return __half{(uint16_t)h};
}

inline float __bfloat162float(__nv_bfloat16 b) {
  return emu::f32_from_bits((uint32_t)b.bits << 16);
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const uint32_t x = emu::f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(uint16_t)((x >> 16) | 0x40u)};
  return __nv_bfloat16{(uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16)};
}
