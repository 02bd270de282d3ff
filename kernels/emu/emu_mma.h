// emu_mma.h: the CPU emulation of the warp-level matrix instructions kernels/mma.cuh wraps
// (mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 and ldmatrix.sync.aligned
// .m8n8{.x1,.x2,.x4}{.trans}.shared.b16), under feature `cuda-emu` (see emu.h for the model).
//
// Each lane posts its fragment registers to its warp (warp_gather: one warp barrier), rebuilds
// the whole operands from all 32 posts, and computes only its own part of the result. The
// fragment layouts are written here straight from the PTX ISA ("Matrix Fragments for
// mma.m16n8k16 with floating point type"; "ldmatrix"), in its own notation, independently of
// the layout helpers in mma.cuh that kernels use: a wrong helper then shows up as a mismatch in
// the self-test (kernels/emu/selftest.cu) instead of being mirrored here.
//
// Arithmetic: each product of two f16 (or two bf16) values is exact in f32; the products are
// added to C in k order with fmaf, in f32. PTX does not specify the order or the intermediate
// rounding of the hardware's sum, so a GPU may differ in the last bits (never in what is
// summed).
#pragma once

#include "emu.h"

namespace emu {

enum class MmaElem { F16, BF16 };

inline float mma_elem_f32(uint32_t reg, int half, MmaElem t) {
  const uint16_t bits = (uint16_t)(reg >> (16 * half));
  return t == MmaElem::F16 ? __half2float(__half{bits}) : __bfloat162float(__nv_bfloat16{bits});
}

// Element (row, col) of the 16 x 16 A operand from lane `laneid`'s 4 A registers (a0..a7, two
// per .f16x2 register, low half first), for every lane: the m16n8k16 A fragment layout, which
// wgmma's register A uses per warp too.
inline void mma_a_from_lanes(MmaElem t, const uint32_t (*regs)[4], float (&A)[16][16]) {
  for (int laneid = 0; laneid < 32; ++laneid) {
    const int groupID = laneid >> 2, threadID_in_group = laneid % 4;
    for (int i = 0; i < 8; ++i) {
      const int row = (i < 2 || (4 <= i && i < 6)) ? groupID : groupID + 8;
      const int col = i < 4 ? threadID_in_group * 2 + (i & 0x1)
                            : threadID_in_group * 2 + (i & 0x1) + 8;
      A[row][col] = mma_elem_f32(regs[laneid][i / 2], i % 2, t);
    }
  }
}

// D = A * B + C for the calling lane's fragments (all 32 lanes of the warp must call it).
inline void mma_m16n8k16(MmaElem t, float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                         const float (&c)[4]) {
  struct Post {
    uint32_t a[4], b[2];
  };
  Post mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
  Post all[32];
  warp_gather(&mine, sizeof mine, all);
  float A[16][16], B[16][8];
  uint32_t a_regs[32][4];
  for (int laneid = 0; laneid < 32; ++laneid)
    for (int r = 0; r < 4; ++r) a_regs[laneid][r] = all[laneid].a[r];
  mma_a_from_lanes(t, a_regs, A);
  for (int laneid = 0; laneid < 32; ++laneid) {
    const int groupID = laneid >> 2, threadID_in_group = laneid % 4;
    // B: b0..b3.
    for (int i = 0; i < 4; ++i) {
      const int row = i < 2 ? threadID_in_group * 2 + (i & 0x1)
                            : threadID_in_group * 2 + (i & 0x1) + 8;
      const int col = groupID;
      B[row][col] = mma_elem_f32(all[laneid].b[i / 2], i % 2, t);
    }
  }
  const int laneid = lane_id();
  const int groupID = laneid >> 2, threadID_in_group = laneid % 4;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    // C / D: c0..c3.
    const int row = i < 2 ? groupID : groupID + 8;
    const int col = threadID_in_group * 2 + (i & 0x1);
    float acc = c[i];
    for (int k = 0; k < 16; ++k) acc = fmaf(A[row][k], B[k][col], acc);
    out[i] = acc;
  }
  for (int i = 0; i < 4; ++i) d[i] = out[i];  // d may alias c
}

// ldmatrix.m8n8.xN{.trans}.b16: lanes 8j .. 8j + 7 give the row addresses of matrix j; without
// .trans, lane l receives in r[j] row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix j;
// with .trans the same positions of matrix j's transpose. Rows must be 16-byte aligned.
template <int N, bool TRANS> inline void ldmatrix(uint32_t (&r)[N], const void *row) {
  static_assert(N == 1 || N == 2 || N == 4, "ldmatrix takes 1, 2 or 4 matrices");
  const void *rows[32];
  warp_gather(&row, sizeof row, rows);
  for (int i = 0; i < 8 * N; ++i) {
    check_align16(rows[i], "ldmatrix row address");
    check_shared(rows[i], 16, "ldmatrix row address outside shared memory");
  }
  const int l = lane_id();
  for (int j = 0; j < N; ++j) {
    uint16_t e[2];
    for (int h = 0; h < 2; ++h) {
      const int rr = TRANS ? 2 * (l % 4) + h : l / 4;  // row of matrix j
      const int cc = TRANS ? l / 4 : 2 * (l % 4) + h;  // column of matrix j
      memcpy(&e[h], static_cast<const char *>(rows[8 * j + rr]) + 2 * cc, 2);
    }
    r[j] = (uint32_t)e[0] | (uint32_t)e[1] << 16;
  }
}

// ---- wgmma (wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16}, A in registers) --
// On the GPU a wgmma runs at some point between its issue and the wgmma.wait_group that covers
// its commit group: until then its accumulators are undefined and its shared-memory B may be
// read at any time. The emulation defers each product to that wait (a group's products in
// issue order), so a kernel that reads or rescales the accumulators before the wait, or
// overwrites B while a product is pending, gets a wrong result here instead of passing by
// luck. A is copied at issue (PTX forbids changing its registers before the wait; ptxas keeps
// that on the GPU). wgmma.fence has nothing to order here.
struct WgmmaOp {
  MmaElem t;
  int n;           // N of m64nNk16
  float *d;        // the issuing thread's N / 2 accumulators
  uint32_t a[4];   // its A registers at issue
  uint64_t desc;   // B's descriptor
  const void *base;
  bool trans_b;
};
// The calling thread's wgmma queue.
inline AsyncGroups<WgmmaOp> &wgmma_queue() { return per_thread<AsyncGroups<WgmmaOp>>(); }

// Runs one issued product: warp w of the warpgroup owns rows 16 w .. 16 w + 15 of A and D, so
// each warp computes its rows alone: its lanes post their A registers (the mma.m16n8k16 A
// layout), B is read through the descriptor, D is the m16n8 C layout per 8 columns. The
// descriptor's start address is relative to `base` (the block's dynamic shared memory) here;
// its layout rules are written from the PTX ISA ("Shared Memory Matrix Layout", "Matrix
// Descriptor", "Canonical Layouts"; wgmma.cuh says them in full): core matrices of 8 rows x 16
// bytes. No swizzle: LBO the step along k and SBO the step along n for both majors; K-major
// (trans_b false): element (k, n) at (k/8) LBO + (n/8) SBO + (n%8) 16 + (k%8) 2; MN-major: (k/8)
// LBO + (n/8) SBO + (k%8) 16 + (n%8) 2. Swizzled (SW = 128, 64, 32 bytes): K-major (n/8) SBO +
// (n%8) SW + 2k; MN-major (n/(SW/2)) LBO + (n%(SW/2)) 2 + (k/8) SBO + (k%8) SW; then, on the
// whole offset from `base` (which the kernels align to the pattern), the 16-byte chunk bits
// 4 .. 3+b are XORed with bits 7 .. 6+b (b = log2(SW/16)).
// All 32 lanes of the warp run it together (warp_gather).
inline void wgmma_run(const WgmmaOp &op) {
  const int mode = (int)(op.desc >> 62);
  if (((op.desc >> 49) & 0x7) != 0)
    fault(cudaErrorInvalidValue, "wgmma: a descriptor base offset other than 0", nullptr);
  const size_t start = (size_t)((op.desc & 0x3FFF) << 4);
  const size_t lbo = ((op.desc >> 16) & 0x3FFF) << 4, sbo = ((op.desc >> 32) & 0x3FFF) << 4;
  const size_t sw = mode == 0 ? 0 : (size_t)(256 >> mode);  // 1: 128, 2: 64, 3: 32 bytes
  const char *base = static_cast<const char *>(op.base);
  check_align16(base + start, "wgmma B start address");
  uint32_t all[32][4];
  warp_gather(op.a, sizeof op.a, all);
  float A[16][16];
  mma_a_from_lanes(op.t, all, A);
  auto b_at = [&](int k, int n) {
    size_t off;
    if (sw == 0) {
      off = start + (size_t)(k / 8) * lbo + (size_t)(n / 8) * sbo +
            (op.trans_b ? (size_t)(k % 8) * 16 + (size_t)(n % 8) * 2
                        : (size_t)(n % 8) * 16 + (size_t)(k % 8) * 2);
    } else {
      const size_t half = sw / 2;  // elements per atom row
      off = start + (op.trans_b ? (size_t)n / half * lbo + (size_t)n % half * 2 +
                                      (size_t)(k / 8) * sbo + (size_t)(k % 8) * sw
                                : (size_t)(n / 8) * sbo + (size_t)(n % 8) * sw + (size_t)k * 2);
      const size_t mask = sw / 16 - 1;
      off ^= ((off >> 7) & mask) << 4;
    }
    uint16_t bits;
    check_shared(base + off, 2, "wgmma B element outside shared memory");
    memcpy(&bits, base + off, 2);
    return mma_elem_f32(bits, 0, op.t);
  };
  const int laneid = lane_id();
  const int groupID = laneid >> 2, threadID_in_group = laneid % 4;
  for (int i = 0; i < op.n / 8; ++i) {
    float Bc[16][2];
    for (int k = 0; k < 16; ++k)
      for (int c = 0; c < 2; ++c) Bc[k][c] = b_at(k, 8 * i + threadID_in_group * 2 + c);
    for (int e = 0; e < 4; ++e) {
      const int row = e < 2 ? groupID : groupID + 8;
      float acc = op.d[4 * i + e];
      for (int k = 0; k < 16; ++k) acc = fmaf(A[row][k], Bc[k][e & 0x1], acc);
      op.d[4 * i + e] = acc;
    }
  }
}

// wgmma is warpgroup-collective: the 4 warps 4 g .. 4 g + 3 must all exist, and every thread's
// k-th wgmma must have the same descriptor, N and B layout across the warpgroup.
struct WgmmaIssue {
  uint64_t desc;
  int n;
  bool trans_b;
};
inline void wgmma_check_warpgroup(uint64_t desc, int n, bool trans_b) {
  const ThreadCoords &c = *tl_coords;
  const size_t threads = (size_t)c.block_dim.x * c.block_dim.y * c.block_dim.z;
  const size_t tid = c.thread.x + (size_t)c.block_dim.x * (c.thread.y + (size_t)c.block_dim.y * c.thread.z);
  const size_t group = tid / 128;
  if ((group + 1) * 128 > threads)
    fault(cudaErrorLaunchFailure, "wgmma in a block without the whole warpgroup (4 warps)", nullptr);
  int &count = per_thread<int>();
  static thread_local uint64_t block = ~(uint64_t)0;
  static thread_local std::vector<std::vector<WgmmaIssue>> seen;  // [warpgroup][k]
  if (block != tl_block_serial) {
    block = tl_block_serial;
    seen.assign(threads / 128, {});
  }
  auto &log = seen[group];
  const size_t k = (size_t)count++;
  if (k == log.size()) {
    log.push_back(WgmmaIssue{desc, n, trans_b});
  } else if (log[k].desc != desc || log[k].n != n || log[k].trans_b != trans_b) {
    fault(cudaErrorLaunchFailure,
          "wgmma whose descriptor, N or B layout differs across the warpgroup", nullptr);
  }
}

// Issue: queued until a wait covers its commit group.
template <int N>
inline void wgmma_m64nNk16(MmaElem t, float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc,
                           const void *base, bool trans_b) {
  static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma n is a multiple of 8 up to 256");
  wgmma_check_warpgroup(desc, N, trans_b);
  wgmma_queue().issue(WgmmaOp{t, N, d, {a[0], a[1], a[2], a[3]}, desc, base, trans_b});
}

// wgmma.commit_group: the products issued since the last commit become one group.
inline void wgmma_commit_group() { wgmma_queue().commit(); }

// wgmma.wait_group k: runs the oldest committed groups until at most k are pending.
inline void wgmma_wait_group(int k) { wgmma_queue().wait(k, wgmma_run); }

}  // namespace emu
