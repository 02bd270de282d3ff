/*
 * pagedkv_emu.h: the controls of the CPU emulation of the CUDA kernels (feature `cuda-emu`,
 * kernels/emu/emu.h). With that feature the launchers of pagedkv.h run on the CPU, and their
 * "device" pointers are ordinary host pointers; these calls let a test allocate guarded
 * buffers, choose the thread scheduling order and see what was launched.
 *
 * All settings and counters are per OS thread (the thread that calls the launchers), so tests
 * running in parallel do not see each other's.
 */
#ifndef PAGEDKV_EMU_H
#define PAGEDKV_EMU_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Fiber order of every scheduling pass: thread 0 first. */
#define PKV_EMU_SCHEDULE_FORWARD 0
/** Fiber order of every scheduling pass: the last thread first. */
#define PKV_EMU_SCHEDULE_REVERSE 1
/** A fresh pseudo-random fiber order every pass, from the seed. */
#define PKV_EMU_SCHEDULE_RANDOM 2
/** Warp by warp: each warp runs alone until all its threads wait at __syncthreads (or have
 *  returned) before the next warp starts, warps in order (seed 0), in reverse (seed 1) or in a
 *  fresh pseudo-random order every pass (other seeds). One warp then runs as far ahead of the
 *  others as a barrier allows, which shows a warp writing shared memory that another has yet
 *  to read before the next barrier. */
#define PKV_EMU_SCHEDULE_WARP_BY_WARP 3

/** What the emulation did on this thread since the last pkv_emu_take_stats. */
typedef struct pkv_emu_stats {
  /** Kernel launches that ran (a refused launch is not counted). */
  uint64_t launches;
  /** Thread blocks run. */
  uint64_t blocks;
  /** Threads (fibers) run. */
  uint64_t threads;
  /** Largest dynamic shared memory of a launch, bytes. */
  uint64_t max_dynamic_smem;
} pkv_emu_stats;

/**
 * A "device" allocation of `bytes` (0 counts as 1), 16-byte aligned, whose end lies within 16
 * bytes of an inaccessible guard page (and a second guard page precedes it), so a kernel
 * reading or writing past it faults at once; the emulation reports such a fault with the
 * launch's coordinates and aborts the process. NULL when the memory cannot be mapped.
 */
void *pkv_emu_alloc(size_t bytes);

/** Frees a pkv_emu_alloc allocation; NULL and unknown pointers are ignored. */
void pkv_emu_free(void *ptr);

/** The SM count cudaDeviceGetAttribute reports on this thread (default 132, an H100 SXM). */
void pkv_emu_set_sm_count(int32_t sms);

/**
 * The compute capability cudaDeviceGetAttribute reports on this thread (default 9.0, an H100:
 * the emulated wgmma kernels run; another makes the launchers choose as they would there),
 * and the opt-in shared memory a block may use there (cudaFuncSetAttribute refuses more:
 * 227 KiB on 9.x, 163 KiB on 8.0 / 8.7, 99 KiB on 8.6 / 8.9 and 12.x).
 */
void pkv_emu_set_compute_capability(int32_t major, int32_t minor);
/** Where this OS thread's emulated cp.async copies land: 0 (the default) at the
 *  cp.async.wait_group that covers them, nonzero at their issue. A kernel correct on the GPU
 *  gives the same results either way: the first exposes a read before its wait, the second a
 *  copy queued into shared memory that another warp still reads. */
void pkv_emu_set_copies_at_issue(int32_t at_issue);

/** Whether this thread's later cudaHostRegister calls fail (nonzero: with
 *  cudaErrorInvalidValue, as a GPU over its locked-memory limit would), for the callers'
 *  fallback to pageable memory. */
void pkv_emu_set_host_register_fails(int32_t fails);

/** Bytes this thread registered by cudaHostRegister at exactly `ptr` and nobody unregistered
 *  since (0: none). The registrations are process-wide, as on a GPU; the answer is per thread
 *  so that tests running in parallel do not see each other's. */
size_t pkv_emu_host_registered(const void *ptr);

/** The scheduling policy (PKV_EMU_SCHEDULE_*) and seed of this thread's later launches. */
void pkv_emu_set_schedule(int32_t policy, uint64_t seed);

/** Returns this thread's counters and resets them. */
pkv_emu_stats pkv_emu_take_stats(void);

/**
 * Copies the message of this thread's last emulated device fault (NUL-terminated, truncated
 * to `len`) into `buf`; returns its full length, 0 when there was none.
 */
size_t pkv_emu_last_fault(char *buf, size_t len);

/* ---- self-test kernels of the emulation (kernels/emu/selftest.cu) ----
 * Each launches one small kernel and returns cudaGetLastError() after it (0 on success). */

/** Shared-memory tree sum per block: grid (grid_x, grid_y), block (block_x, block_y) with
 *  block_x * block_y a power of two; in has one int per thread, out one per block. */
int pkv_emu_selftest_block_sum(const int *in, int *out, int grid_x, int grid_y, int block_x,
                               int block_y);
/** out[t * 5 + k] = the value (t ^ (1 << k)) * 10 shuffled from lane t ^ (1 << k). */
int pkv_emu_selftest_shuffle(int *out, int threads);
/** Half a warp at __syncthreads, the other half at __syncwarp: must fail as a deadlock. */
int pkv_emu_selftest_divergent_barrier(void);
/** Lane 31 returns, lane 30 shuffles from it: must fail. out: 32 ints. */
int pkv_emu_selftest_shuffle_from_returned_lane(int *out);
/** A 16-byte vector load from p into out[0]: must fail unless p is 16-byte aligned. */
int pkv_emu_selftest_vector_load(const void *p, int *out);
/** n floats of dynamic shared memory (opt-in attribute first when opt_in_bytes > 0): writes
 *  out[i] = n - 1 - i and out[n] = what buf[n-1] held before any write (the poison). */
int pkv_emu_selftest_smem(float *out, int n, int opt_in_bytes);
/** out[2b], out[2b+1] = what two unwritten static __shared__ floats held in block b (which
 *  each block then writes): the poison, NaN, in every block. */
int pkv_emu_selftest_static_shared(float *out, int blocks);
/** 4 KiB of static and `dynamic_bytes` of dynamic shared memory; out: 32 floats. Fails when
 *  the sum exceeds 48 KiB. */
int pkv_emu_selftest_static_plus_dynamic(float *out, int dynamic_bytes);
/** An empty kernel with grid (grid_x, grid_y) and block_x threads. */
int pkv_emu_selftest_config(unsigned grid_x, unsigned grid_y, unsigned block_x);
/** p[i] = i for i < n (one block of 64 threads). */
int pkv_emu_selftest_write(int *p, int n);
/** 64 threads: out[t] = (the lane (t * 7 + 3) % 32 of t's segment of `width` lanes) * 10,
 *  through __shfl_sync. */
int pkv_emu_selftest_shuffle_idx(int *out, int width);
/** 96 threads (warp 2's lane 31 returns first): out[t] = __any_sync | __all_sync << 1,
 *  out[96 + t] a __ballot_sync, out[192 + t] its __ffs (selftest.cu's vote_kernel). */
int pkv_emu_selftest_vote(int *out);
/** 64 threads: out[0] = what warp 1 reads of a shared flag warp 0 sets with no barrier between
 *  (0 where warp 1 ran first, 1 where warp 0 did). */
int pkv_emu_selftest_warp_ahead(int *out);
/** 128 threads; src: 256 16-byte vectors. Thread t queues two cp.async groups (src[t] into a
 *  shared vector that held 1s, then src[128 + t] into one that held 2s) and records the first
 *  word of its destinations: out[4t] before any wait, out[4t + 1] and out[4t + 2] after
 *  cp.async.wait_group 1, out[4t + 3] after wait_group 0. */
int pkv_emu_selftest_cp_async(const void *src, int *out);
/** `warps` warps each run mma_m16n8k16 (kernels/mma.cuh) for dtype PKV_DTYPE_F16 or _BF16 on
 *  their own operands: a [warps][16][16] (A row-major), b [warps][16][8] (B[k][n]), c and d
 *  [warps][16][8], all f32 (a and b rounded to dtype). d = c + A B, accumulated in place `reps`
 *  times. */
int pkv_emu_selftest_mma(int dtype, const float *a, const float *b, const float *c, float *d,
                         int warps, int reps);
/** An mma in a warp whose lane 31 has returned: must fail. d: 32 floats. */
int pkv_emu_selftest_mma_partial_warp(float *d);
/** ldmatrix<n, trans> (n = 1, 2, 4) over four 8x8 matrices m [4][8][8] of 16-bit values staged
 *  in shared memory; out [32][n]: each lane's registers. */
int pkv_emu_selftest_ldmatrix(const uint16_t *m, uint32_t *out, int n, int trans);

/* ---- deliberately wrong kernels the emulation must refuse (selftest.cu) ---- */
int pkv_emu_wrong_ld8(const void *p, int *out);
int pkv_emu_wrong_smem_past_end(float *out, int n);
int pkv_emu_wrong_shfl_vs_syncwarp(int *out);
int pkv_emu_wrong_shfl_vs_syncwarp2(int *out);
int pkv_emu_wrong_ldmatrix_global(const uint16_t *g, uint32_t *out);
int pkv_emu_wrong_wgmma(float *out, int threads, int per_warp_desc);

#ifdef __cplusplus
}
#endif

#endif /* PAGEDKV_EMU_H */
