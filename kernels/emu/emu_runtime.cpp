// emu_runtime.cpp: the fiber scheduler, barriers, shuffles, launch checks, guarded memory and
// runtime calls behind emu.h (the model is described there).
#include "emu.h"

#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <map>
#include <thread>
#include <mutex>
#include <string>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include "pagedkv_emu.h"

namespace emu {

thread_local const ThreadCoords *tl_coords = nullptr;
thread_local uint64_t tl_block_serial = 0;

namespace {

// ---- per-thread settings, counters and the sticky error -------------------------------------

thread_local cudaError_t tl_error = cudaSuccess;
thread_local std::string tl_fault_message;
thread_local int tl_sm_count = 132;
thread_local int tl_cc_major = 9, tl_cc_minor = 0;
thread_local bool tl_copies_at_issue = false;
thread_local bool tl_host_register_fails = false;
thread_local int tl_policy = PKV_EMU_SCHEDULE_FORWARD;
thread_local uint64_t tl_seed = 0;
thread_local pkv_emu_stats tl_stats = {0, 0, 0, 0};

void set_error(cudaError_t e) {
  if (tl_error == cudaSuccess) tl_error = e;
}

// The most shared memory one block may use with the opt-in attribute on a device of this
// thread's compute capability (cudaDevAttrMaxSharedMemoryPerBlockOptin): 227 KiB on 9.x and
// 10.x, 163 KiB on 8.0 and 8.7, 99 KiB on the other 8.x (8.6, 8.9) and 12.x, 96 KiB on 7.0 /
// 7.2, 64 KiB on 7.5. A launcher asking its device for more fails at cudaFuncSetAttribute.
size_t optin_smem_limit() {
  const int major = tl_cc_major, minor = tl_cc_minor;
  if (major == 8) return minor == 0 || minor == 7 ? 163 * 1024 : 99 * 1024;
  if (major == 12) return 99 * 1024;
  if (major == 7) return minor == 5 ? 64 * 1024 : 96 * 1024;
  return MAX_DYNAMIC_SMEM;
}

// ---- kernel attributes (process-wide, as function attributes are) ------------------------

std::mutex g_attr_mutex;
std::map<const void *, size_t> g_max_dynamic_smem;

// The kernel's shared-memory limits: dynamic (48 KiB, or the opt-in attribute) and static +
// dynamic together (48 KiB without the opt-in, the SM's 227 KiB with it).
struct SmemLimits {
  size_t dynamic, total;
};
SmemLimits smem_limits_of(const void *kernel) {
  const size_t optin = optin_smem_limit();
  std::lock_guard<std::mutex> lock(g_attr_mutex);
  auto it = g_max_dynamic_smem.find(kernel);
  if (it == g_max_dynamic_smem.end()) return {DEFAULT_DYNAMIC_SMEM, DEFAULT_DYNAMIC_SMEM};
  // The attribute is process-wide (set on a thread of another compute capability, maybe):
  // no launch gets more than this thread's device allows.
  return {it->second < optin ? it->second : optin, optin};
}

// ---- guarded memory ------------------------------------------------------------------------

struct Mapping {
  void *base;
  size_t len;
  char *data = nullptr;  // the allocation's first byte
  size_t bytes = 0;      // as requested
};
std::mutex g_alloc_mutex;
std::map<void *, Mapping> g_allocs;
// cudaHostRegister's ranges by base (process-wide, as the driver's), with the registering
// thread (pkv_emu_host_registered answers for the caller's own: tests run in parallel).
struct Pinned {
  size_t bytes;
  std::thread::id owner;
};
std::mutex g_pinned_mutex;
std::map<const char *, Pinned> g_pinned;

size_t page_size() {
  static const size_t p = (size_t)sysconf(_SC_PAGESIZE);
  return p;
}

// `bytes` rounded up to 16, placed so that it ends at the start of a PROT_NONE page, with
// another PROT_NONE page below the first data page.
void *guarded_alloc(size_t bytes, Mapping *m) {
  const size_t pg = page_size();
  const size_t n = ((bytes == 0 ? 1 : bytes) + 15) / 16 * 16;
  const size_t data_pages = (n + pg - 1) / pg;
  const size_t len = (data_pages + 2) * pg;
  void *base = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  char *b = static_cast<char *>(base);
  if (mprotect(b, pg, PROT_NONE) != 0 || mprotect(b + (data_pages + 1) * pg, pg, PROT_NONE) != 0) {
    munmap(base, len);
    return nullptr;
  }
  m->base = base;
  m->len = len;
  m->data = b + (data_pages + 1) * pg - n;
  m->bytes = bytes;
  // The slack between the lower guard page and the data, and the rounding to 16 bytes after
  // it, are poisoned (0xFF: NaN as f32, f16, bf16) so that a read there shows, and checked by
  // slack_intact so that a write there is reported: the guard pages alone catch neither an
  // access before the data nor one inside the last 16 bytes.
  memset(b + pg, 0xff, (size_t)(m->data - (b + pg)));
  memset(m->data + bytes, 0xff, n - bytes);
  return m->data;
}

// Whether the poisoned slack around a guarded allocation is still all 0xFF (else the address
// of the first changed byte in *bad).
bool slack_intact(const Mapping &m, const char **bad) {
  const size_t pg = page_size();
  const char *lo = static_cast<const char *>(m.base) + pg;
  const size_t n = ((m.bytes == 0 ? 1 : m.bytes) + 15) / 16 * 16;
  for (const char *q = lo; q < m.data; ++q)
    if ((unsigned char)*q != 0xff) return *bad = q, false;
  for (const char *q = m.data + m.bytes; q < m.data + n; ++q)
    if ((unsigned char)*q != 0xff) return *bad = q, false;
  return true;
}

// Reports (as the sticky error, cudaErrorIllegalAddress) a write into the poisoned slack of any
// live guarded allocation since the last check, and poisons it again.
void check_global_slack(const char *who) {
  std::lock_guard<std::mutex> lock(g_alloc_mutex);
  for (auto &kv : g_allocs) {
    const char *bad = nullptr;
    if (!slack_intact(kv.second, &bad)) {
      char buf[220];
      snprintf(buf, sizeof buf,
               "%s wrote %td bytes from the start of a %zu-byte guarded allocation (outside "
               "it, inside the guard pages' granularity): a GPU would corrupt memory or raise "
               "an illegal address",
               who, bad - kv.second.data, kv.second.bytes);
      fprintf(stderr, "pagedkv cuda-emu: %s\n", buf);
      tl_fault_message = buf;
      set_error(cudaErrorIllegalAddress);
      const Mapping &m = kv.second;
      char *lo = static_cast<char *>(m.base) + page_size();
      const size_t n = ((m.bytes == 0 ? 1 : m.bytes) + 15) / 16 * 16;
      memset(lo, 0xff, (size_t)(m.data - lo));
      memset(m.data + m.bytes, 0xff, n - m.bytes);
    }
  }
}

// ---- fault reporting from SIGSEGV / SIGBUS ------------------------------------------------

thread_local volatile sig_atomic_t tl_in_kernel = 0;
struct sigaction g_prev_segv, g_prev_bus;

void write_str(const char *s) {
  ssize_t r = write(2, s, strlen(s));
  (void)r;
}
void write_hex(uintptr_t v) {
  char buf[19];
  buf[0] = '0';
  buf[1] = 'x';
  for (int i = 0; i < 16; ++i) buf[2 + i] = "0123456789abcdef"[(v >> (60 - 4 * i)) & 15];
  buf[18] = 0;
  write_str(buf);
}
void write_dec(unsigned v) {
  char buf[12];
  int i = 11;
  buf[i] = 0;
  do {
    buf[--i] = (char)('0' + v % 10);
    v /= 10;
  } while (v != 0 && i > 0);
  write_str(buf + i);
}

void on_fault_signal(int sig, siginfo_t *info, void *uctx) {
  if (tl_in_kernel) {
    write_str("\npagedkv cuda-emu: illegal address ");
    write_hex(reinterpret_cast<uintptr_t>(info->si_addr));
    write_str(" (past a guarded allocation or the dynamic shared memory, or a fiber stack overflow) ");
    if (const ThreadCoords *c = tl_coords) {
      write_str("in block (");
      write_dec(c->block.x);
      write_str(",");
      write_dec(c->block.y);
      write_str(",");
      write_dec(c->block.z);
      write_str(") thread ");
      write_dec(c->thread.x);
    } else {
      write_str("in cudaMemcpyAsync");
    }
    write_str(": a GPU would raise cudaErrorIllegalAddress; aborting\n");
    abort();
  }
  // Not ours: hand over to the previous handler (Rust's stack-overflow guard) or the default.
  const struct sigaction &prev = sig == SIGSEGV ? g_prev_segv : g_prev_bus;
  if ((prev.sa_flags & SA_SIGINFO) && prev.sa_sigaction != nullptr) {
    prev.sa_sigaction(sig, info, uctx);
  } else if (prev.sa_handler != SIG_IGN && prev.sa_handler != SIG_DFL && prev.sa_handler) {
    prev.sa_handler(sig);
  } else {
    signal(sig, SIG_DFL);  // returning re-executes the access, which now kills the process
  }
}

void install_fault_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault_signal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_prev_segv);
    sigaction(SIGBUS, &sa, &g_prev_bus);
  });
}

// ---- fibers ----------------------------------------------------------------------------------

// Room for the kernels' register arrays even in unoptimized builds; mapped lazily.
constexpr size_t STACK_BYTES = 256 * 1024;

#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores the stack pointer in *save,
// switches to `load` and restores the registers saved there (System V x86-64).
extern "C" void pkv_emu_switch(void **save, void *load);
asm(R"(
  .pushsection .text
  .globl pkv_emu_switch
  .type pkv_emu_switch,@function
pkv_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size pkv_emu_switch,.-pkv_emu_switch
  .popsection
)");
struct Context {
  void *sp = nullptr;
};
#else
struct Context {
  ucontext_t uc;
};
#endif

enum class State { Ready, WaitBlock, WaitWarp, Done };

struct Fiber {
  int warp_op = 0;  // what the fiber waits for at its warp barrier (WarpOp)
  Context ctx;
  char *stack = nullptr;  // lowest usable byte (a guard page lies below)
  State state = State::Ready;
  uint32_t wait_gen = 0;
  uint32_t gathers = 0;  // warp_gather calls made: selects the bank of the next one
  int warp = 0, lane = 0;
  ThreadCoords coords{};
};

struct Barrier {
  int alive = 0, arrived = 0;
  uint32_t gen = 0;
};

// Which warp-level operation a lane waits in: the lanes a warp barrier releases together must
// all be in the same one (shfl.sync, bar.warp.sync, vote, mma/ldmatrix are distinct
// instructions: a full-mask shuffle some lanes of which are at a __syncwarp is undefined).
enum WarpOp {
  OP_SYNCWARP = 1,
  OP_SHFL_XOR_POST,
  OP_SHFL_XOR_READ,
  OP_SHFL_IDX_POST,
  OP_SHFL_IDX_READ,
  OP_VOTE_POST,
  OP_VOTE_READ,
  OP_GATHER,
};

// One launch in progress on this OS thread.
struct Runner {
  void (*call)(const void *) = nullptr;
  const void *body = nullptr;
  std::vector<Fiber> fibers;
  std::vector<int> order;
  Barrier block_bar;
  std::vector<Barrier> warp_bars;
  std::vector<std::array<uint64_t, 32>> slots;
  // Per warp, two banks of GATHER_WORDS words per lane for warp_gather (mma, ldmatrix). A lane
  // posts into bank (its gather count % 2): it can only post its next-but-one gather after
  // every lane has passed the barrier of the next one, so after every lane has read this one;
  // one barrier per gather suffices.
  std::vector<std::array<std::array<uint32_t, 32 * GATHER_WORDS>, 2>> gather;
  Context sched;
  Fiber *cur = nullptr;
  bool failed = false;
  void *smem = nullptr;
  size_t smem_bytes = 0;
  Mapping smem_map{};
  std::vector<std::pair<const char *, size_t>> static_ranges;  // the block's static __shared__
  size_t static_smem = 0;       // static __shared__ bytes seen in the running block
  size_t smem_total_limit = 0;  // static + dynamic allowed for this kernel
  uint64_t rng = 0;
};
thread_local Runner *tl_run = nullptr;

// Stacks are reused by every later launch on the same OS thread.
struct StackPool {
  std::vector<Mapping> stacks;
  ~StackPool() {
    for (auto &m : stacks) munmap(m.base, m.len);
  }
  char *get(size_t i) {
    while (stacks.size() <= i) {
      Mapping m{};
      const size_t pg = page_size();
      m.len = STACK_BYTES + pg;
      m.base = mmap(nullptr, m.len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m.base == MAP_FAILED) return nullptr;
      mprotect(m.base, pg, PROT_NONE);  // overflow guard
      stacks.push_back(m);
    }
    return static_cast<char *>(stacks[i].base) + page_size();
  }
};
thread_local StackPool tl_stacks;

void switch_to(Context &from, Context &to) {
#if defined(__x86_64__)
  pkv_emu_switch(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
}

void drop(Barrier &b) {
  --b.alive;
  if (b.alive > 0 && b.arrived == b.alive) {
    b.arrived = 0;
    ++b.gen;
  }
}

void fail_launch(Runner &r, cudaError_t e, const std::string &msg);

// Called as warp w's barrier completes generation `gen`: every lane it releases must wait in
// the same operation. Returns false (and fails the launch) otherwise.
bool warp_ops_agree(Runner &r, int w, uint32_t gen) {
  int op = 0;
  const int n = (int)r.fibers.size();
  for (int i = w * 32; i < n && i < w * 32 + 32; ++i) {
    const Fiber &f = r.fibers[i];
    if (f.state != State::WaitWarp || f.wait_gen != gen) continue;
    if (op == 0) op = f.warp_op;
    else if (f.warp_op != op) {
      char buf[200];
      snprintf(buf, sizeof buf,
               "warp %d: lanes meet at different warp-level operations (kinds %d and %d: "
               "__syncwarp, shuffle, vote, mma/ldmatrix): a full-mask warp operation not "
               "executed by every live lane",
               w, op, f.warp_op);
      fail_launch(r, cudaErrorLaunchFailure, buf);
      return false;
    }
  }
  return true;
}

[[noreturn]] void fiber_exit(Runner *r) {
  Fiber *f = r->cur;
  f->state = State::Done;
  drop(r->block_bar);
  {
    Barrier &wb = r->warp_bars[f->warp];
    const uint32_t gen = wb.gen;
    drop(wb);
    if (wb.gen != gen && !r->failed) warp_ops_agree(*r, f->warp, gen);
  }
  switch_to(f->ctx, r->sched);
  abort();  // never resumed
}

void fiber_main() {
  Runner *r = tl_run;
  r->call(r->body);
  fiber_exit(r);
}

bool init_fiber(Fiber &f, char *stack) {
  f.stack = stack;
#if defined(__x86_64__)
  // Top of stack: the entry address where `ret` finds it, 16-byte aligned so that fiber_main
  // starts with rsp = 8 mod 16 as after a call; below it the six zeroed saved registers.
  uintptr_t top = reinterpret_cast<uintptr_t>(stack + STACK_BYTES) & ~uintptr_t(15);
  void **slot = reinterpret_cast<void **>(top - 16);
  slot[0] = reinterpret_cast<void *>(&fiber_main);
  slot[1] = nullptr;
  for (int i = 1; i <= 6; ++i) slot[-i] = nullptr;
  f.ctx.sp = slot - 6;
  return true;
#else
  if (getcontext(&f.ctx.uc) != 0) return false;
  f.ctx.uc.uc_stack.ss_sp = stack;
  f.ctx.uc.uc_stack.ss_size = STACK_BYTES;
  f.ctx.uc.uc_link = nullptr;
  makecontext(&f.ctx.uc, fiber_main, 0);
  return true;
#endif
}

bool runnable(const Runner &r, const Fiber &f) {
  switch (f.state) {
    case State::Ready: return true;
    case State::WaitBlock: return r.block_bar.gen != f.wait_gen;
    case State::WaitWarp: return r.warp_bars[f.warp].gen != f.wait_gen;
    case State::Done: return false;
  }
  return false;
}

uint64_t next_random(uint64_t &s) {
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return s;
}

void fail_launch(Runner &r, cudaError_t e, const std::string &msg) {
  r.failed = true;
  set_error(e);
  tl_fault_message = msg;
  fprintf(stderr, "pagedkv cuda-emu: %s\n", msg.c_str());
}

std::string where(const ThreadCoords &c) {
  char buf[160];
  snprintf(buf, sizeof buf, "block (%u,%u,%u) of grid (%u,%u,%u), thread %u", c.block.x,
           c.block.y, c.block.z, c.grid_dim.x, c.grid_dim.y, c.grid_dim.z, c.thread.x);
  return buf;
}

// Runs one thread block to completion (or to a fault / deadlock). Returns false on failure.
bool run_block(Runner &r, uint3 block, dim3 grid, dim3 bdim) {
  const int n = (int)(bdim.x * bdim.y * bdim.z);
  const int nwarps = (n + 31) / 32;
  r.fibers.assign(n, Fiber{});
  r.block_bar = Barrier{n, 0, 0};
  r.warp_bars.assign(nwarps, Barrier{});
  r.slots.assign(nwarps, {});
  r.gather.resize(nwarps);  // contents need no reset: every gather writes before it reads
  for (int i = 0; i < n; ++i) {
    Fiber &f = r.fibers[i];
    char *stack = tl_stacks.get(i);
    if (stack == nullptr || !init_fiber(f, stack)) {
      fail_launch(r, cudaErrorLaunchOutOfResources, "cannot map fiber stacks");
      return false;
    }
    f.warp = i / 32;
    f.lane = i % 32;
    r.warp_bars[f.warp].alive++;
    f.coords.thread = uint3{(unsigned)i % bdim.x, ((unsigned)i / bdim.x) % bdim.y,
                            (unsigned)i / (bdim.x * bdim.y)};
    f.coords.block = block;
    f.coords.block_dim = bdim;
    f.coords.grid_dim = grid;
  }
  if (r.smem_bytes > 0) {
    // NaN: unwritten reads show. The slack of the guarded allocation too (a read past the end
    // inside the rounding to 16 bytes, or before the start inside the page).
    const size_t pg = page_size();
    char *lo = static_cast<char *>(r.smem_map.base) + pg;
    const size_t n = (r.smem_bytes + 15) / 16 * 16;
    memset(lo, 0xff, (size_t)(r.smem_map.data + n - lo));
  }
  r.static_ranges.clear();
  ++tl_block_serial;  // static __shared__ variables are poisoned afresh (poison_shared_once)
  r.static_smem = 0;
  r.order.resize(n);
  for (int i = 0; i < n; ++i) r.order[i] = tl_policy == PKV_EMU_SCHEDULE_REVERSE ? n - 1 - i : i;

  const bool by_warp = tl_policy == PKV_EMU_SCHEDULE_WARP_BY_WARP;
  std::vector<int> warps(nwarps);
  for (int w = 0; w < nwarps; ++w) warps[w] = by_warp && tl_seed == 1 ? nwarps - 1 - w : w;
  for (;;) {
    if (tl_policy == PKV_EMU_SCHEDULE_RANDOM)
      for (int i = n - 1; i > 0; --i) std::swap(r.order[i], r.order[next_random(r.rng) % (i + 1)]);
    if (by_warp && tl_seed > 1)
      for (int i = nwarps - 1; i > 0; --i)
        std::swap(warps[i], warps[next_random(r.rng) % (i + 1)]);
    bool progressed = false, all_done = true;
    // Warp by warp, a block barrier completed during this pass releases its waiters in the
    // next one (in warp order), not the warp that completed it at once.
    const uint32_t pass_gen = r.block_bar.gen;
    // Runs fiber idx if it can go on; false if the launch failed.
    auto step = [&](int idx, bool &ran) {
      Fiber &f = r.fibers[idx];
      if (f.state == State::Done) return true;
      all_done = false;
      if (!runnable(r, f)) return true;
      if (by_warp && f.state == State::WaitBlock && f.wait_gen == pass_gen) return true;
      f.state = State::Ready;
      r.cur = &f;
      tl_coords = &f.coords;
      switch_to(r.sched, f.ctx);
      tl_coords = nullptr;
      progressed = ran = true;
      return !r.failed;
    };
    if (by_warp) {
      // A warp's lanes run (in order) until none can go on: each waits at the block barrier
      // or has returned. Then the next warp.
      for (int w : warps)
        for (bool ran = true; ran;) {
          ran = false;
          for (int idx = w * 32; idx < n && idx < w * 32 + 32; ++idx)
            if (!step(idx, ran)) return false;
        }
    } else {
      bool ran = false;
      for (int idx : r.order)
        if (!step(idx, ran)) return false;
    }
    if (all_done) {
      const char *bad = nullptr;
      if (r.smem_bytes > 0 && !slack_intact(r.smem_map, &bad)) {
        char buf[200];
        snprintf(buf, sizeof buf,
                 "block (%u,%u,%u) wrote shared memory outside its %zu dynamic bytes (at offset "
                 "%td): a GPU would raise an illegal address or corrupt another block",
                 block.x, block.y, block.z, r.smem_bytes, bad - r.smem_map.data);
        fail_launch(r, cudaErrorIllegalAddress, buf);
        return false;
      }
      return true;
    }
    if (!progressed) {
      int at_block = 0, at_warp = 0, done = 0;
      for (auto &f : r.fibers) {
        at_block += f.state == State::WaitBlock;
        at_warp += f.state == State::WaitWarp;
        done += f.state == State::Done;
      }
      char buf[256];
      snprintf(buf, sizeof buf,
               "deadlock in block (%u,%u,%u): %d threads wait at __syncthreads, %d at a warp "
               "barrier (__syncwarp or a shuffle), %d returned: a barrier under divergent "
               "control flow",
               block.x, block.y, block.z, at_block, at_warp, done);
      fail_launch(r, cudaErrorLaunchFailure, buf);
      return false;
    }
  }
}

// Arrives at `b` and parks the calling fiber until every live thread of its scope arrived.
void arrive(Barrier &b, State wait_state, int op = 0) {
  Runner *r = tl_run;
  Fiber *f = r->cur;
  f->wait_gen = b.gen;
  f->state = wait_state;
  f->warp_op = op;
  if (++b.arrived == b.alive) {
    if (wait_state == State::WaitWarp && !warp_ops_agree(*r, f->warp, b.gen)) fiber_exit(r);
    b.arrived = 0;
    ++b.gen;  // every waiter, this one included, may go on (in the policy's order)
  }
  switch_to(f->ctx, r->sched);
}

Runner *require_runner(const char *what) {
  if (tl_run == nullptr || tl_run->cur == nullptr) {
    fprintf(stderr, "pagedkv cuda-emu: %s called outside a kernel\n", what);
    abort();
  }
  return tl_run;
}

}  // namespace

// ---- the calls emu.h declares ---------------------------------------------------------------

void syncthreads() {
  Runner *r = require_runner("__syncthreads");
  arrive(r->block_bar, State::WaitBlock);
}

void syncwarp(unsigned mask) {
  Runner *r = require_runner("__syncwarp");
  if (mask != 0xffffffffu) fault(cudaErrorLaunchFailure, "__syncwarp with a partial mask", nullptr);
  arrive(r->warp_bars[r->cur->warp], State::WaitWarp, OP_SYNCWARP);
}

namespace {

// The source lane `src` of the calling lane's shuffle, which must exist and not have returned
// (reading a returned lane is undefined on a GPU; here it is an error).
void check_source_lane(Runner *r, int w, int src) {
  const int src_tid = w * 32 + src;
  if (src_tid >= (int)r->fibers.size() || r->fibers[src_tid].state == State::Done) {
    char buf[96];
    snprintf(buf, sizeof buf, "shuffle reads lane %d, which does not exist or has returned", src);
    fault(cudaErrorLaunchFailure, buf, nullptr);
  }
}

// Posts `bits` in the lane's slot, waits for the warp, reads lane `src(lane)`, waits again.
template <typename Src>
uint64_t shuffle(const char *what, int op, unsigned mask, uint64_t bits, int width, Src src_of) {
  Runner *r = require_runner(what);
  if (mask != 0xffffffffu) fault(cudaErrorLaunchFailure, "shuffle with a partial mask", nullptr);
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0)
    fault(cudaErrorLaunchFailure, "shuffle width not a power of two <= 32", nullptr);
  Fiber *f = r->cur;
  const int w = f->warp, lane = f->lane;
  r->slots[w][lane] = bits;
  arrive(r->warp_bars[w], State::WaitWarp, op);  // every lane has published its value
  const int src = src_of(lane);
  check_source_lane(r, w, src);
  const uint64_t v = r->slots[w][src];
  arrive(r->warp_bars[w], State::WaitWarp, op + 1);  // every lane has read before slots are reused
  return v;
}

}  // namespace

uint64_t shfl_xor_bits(unsigned mask, uint64_t bits, int lane_mask, int width) {
  return shuffle("__shfl_xor_sync", OP_SHFL_XOR_POST, mask, bits, width, [&](int lane) {
    const int src = lane ^ lane_mask;
    return src >= (lane / width + 1) * width ? lane : src;  // later segment: own value (CUDA rule)
  });
}

uint64_t shfl_idx_bits(unsigned mask, uint64_t bits, int src_lane, int width) {
  // CUDA: lane srcLane % width of the caller's segment of `width` lanes.
  return shuffle("__shfl_sync", OP_SHFL_IDX_POST, mask, bits, width,
                 [&](int lane) { return (lane / width) * width + (src_lane & (width - 1)); });
}

unsigned vote_ballot(unsigned mask, bool pred) {
  Runner *r = require_runner("a warp vote");
  if (mask != 0xffffffffu) fault(cudaErrorLaunchFailure, "a warp vote with a partial mask", nullptr);
  Fiber *f = r->cur;
  const int w = f->warp;
  r->slots[w][f->lane] = pred ? 1 : 0;
  arrive(r->warp_bars[w], State::WaitWarp, OP_VOTE_POST);  // every lane has published its predicate
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) {
    const int tid = w * 32 + l;
    if (tid < (int)r->fibers.size() && r->fibers[tid].state != State::Done && r->slots[w][l] != 0)
      bits |= 1u << l;
  }
  arrive(r->warp_bars[w], State::WaitWarp, OP_VOTE_READ);  // every lane has read before slots are reused
  return bits;
}

bool vote_any(unsigned mask, bool pred) { return vote_ballot(mask, pred) != 0; }

bool copies_at_issue() { return tl_copies_at_issue; }

int lane_id() { return require_runner("the lane id")->cur->lane; }

void warp_gather(const void *mine, size_t bytes, void *all) {
  Runner *r = require_runner("a warp-collective operation");
  if (bytes == 0 || bytes > 4 * GATHER_WORDS || bytes % 4 != 0)
    fault(cudaErrorLaunchFailure, "warp_gather of an unsupported size", nullptr);
  Fiber *f = r->cur;
  const int w = f->warp, lane = f->lane, words = (int)(bytes / 4);
  auto &bank = r->gather[w][f->gathers++ % 2];
  memcpy(&bank[lane * GATHER_WORDS], mine, bytes);
  const uint32_t mine_count = f->gathers;
  arrive(r->warp_bars[w], State::WaitWarp, OP_GATHER);  // every live lane has posted
  // mma and ldmatrix are .sync.aligned: the whole warp executes them together. A lane that has
  // posted this gather may already have gone on (even returned): its count is at least ours.
  for (int l = 0; l < 32; ++l) {
    const int tid = w * 32 + l;
    if (tid >= (int)r->fibers.size() || r->fibers[tid].gathers < mine_count)
      fault(cudaErrorLaunchFailure,
            "a warp-collective operation (mma / ldmatrix) without all 32 lanes of the warp",
            nullptr);
  }
  char *out = static_cast<char *>(all);
  for (int l = 0; l < 32; ++l) memcpy(out + (size_t)l * bytes, &bank[l * GATHER_WORDS], (size_t)words * 4);
}

void fault(cudaError_t e, const char *what, const void *addr) {
  Runner *r = require_runner("a device fault");
  char buf[128];
  if (addr != nullptr)
    snprintf(buf, sizeof buf, " at %p", addr);
  else
    buf[0] = 0;
  fail_launch(*r, e, std::string(what) + buf + " in " + where(r->cur->coords));
  fiber_exit(r);
}

void *dynamic_smem_raw() {
  Runner *r = require_runner("dynamic shared memory");
  return r->smem;
}

bool in_shared(const void *p, size_t bytes) {
  Runner *r = require_runner("a shared-memory address check");
  const char *q = static_cast<const char *>(p);
  const char *s = static_cast<const char *>(r->smem);
  if (s != nullptr && q >= s && q + bytes <= s + r->smem_bytes) return true;
  for (const auto &rg : r->static_ranges)
    if (q >= rg.first && q + bytes <= rg.first + rg.second) return true;
  return false;
}

void check_shared(const void *p, size_t bytes, const char *what) {
  if (!in_shared(p, bytes)) fault(cudaErrorIllegalAddress, what, p);
}

void account_static_shared(const void *addr, size_t bytes) {
  Runner *r = require_runner("a static __shared__ variable");
  r->static_ranges.emplace_back(static_cast<const char *>(addr), bytes);
  r->static_smem += bytes;
  if (r->static_smem + r->smem_bytes > r->smem_total_limit) {
    char buf[200];
    snprintf(buf, sizeof buf,
             "%zu bytes of static + %zu of dynamic shared memory exceed the kernel's %zu: the "
             "launch would be refused",
             r->static_smem, r->smem_bytes, r->smem_total_limit);
    fault(cudaErrorInvalidValue, buf, nullptr);
  }
}

cudaError_t func_set_max_dynamic_smem(const void *kernel, int bytes) {
  if (kernel == nullptr || bytes < 0 || (size_t)bytes > optin_smem_limit()) {
    set_error(cudaErrorInvalidValue);  // a failed runtime call is the last error too
    return cudaErrorInvalidValue;
  }
  std::lock_guard<std::mutex> lock(g_attr_mutex);
  g_max_dynamic_smem[kernel] = (size_t)bytes;
  return cudaSuccess;
}

namespace {
void launch_run(const void *kernel, void (*call)(const void *), const void *body, dim3 grid,
                dim3 block, size_t smem);
}

cudaError_t launch_erased(const void *kernel, void (*call)(const void *), const void *body,
                          dim3 grid, dim3 block, size_t smem) {
  // The launch's own status, as cudaLaunchKernelEx returns it; the thread's last error
  // (cudaGetLastError) becomes it when it failed and stays what it was when it did not, so a
  // triple-chevron launch followed by cudaGetLastError reads an earlier call's unread error,
  // as on a GPU.
  const cudaError_t before = tl_error;
  tl_error = cudaSuccess;
  launch_run(kernel, call, body, grid, block, smem);
  const cudaError_t own = tl_error;
  if (own == cudaSuccess) tl_error = before;
  return own;
}

namespace {
void launch_run(const void *kernel, void (*call)(const void *), const void *body, dim3 grid,
                dim3 block, size_t smem) {
  const uint64_t threads = (uint64_t)block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
      grid.z > 65535 || threads == 0 || threads > 1024 || block.z > 64) {
    fprintf(stderr,
            "pagedkv cuda-emu: launch refused: grid (%u,%u,%u) block (%u,%u,%u) is not a "
            "valid configuration\n",
            grid.x, grid.y, grid.z, block.x, block.y, block.z);
    set_error(cudaErrorInvalidConfiguration);
    return;
  }
  const SmemLimits limits = smem_limits_of(kernel);
  if (smem > limits.dynamic) {
    fprintf(stderr,
            "pagedkv cuda-emu: launch refused: %zu bytes of dynamic shared memory, the kernel "
            "allows %zu\n",
            smem, limits.dynamic);
    set_error(cudaErrorInvalidValue);
    return;
  }
  if (tl_run != nullptr) {
    fprintf(stderr, "pagedkv cuda-emu: a kernel launched a kernel (not supported)\n");
    abort();
  }
  install_fault_handler();

  Runner r;
  r.call = call;
  r.body = body;
  r.smem_total_limit = limits.total;
  tl_fault_message.clear();
  r.rng = tl_seed * 0x9e3779b97f4a7c15ull + tl_stats.launches + 1;
  Mapping &smem_map = r.smem_map;
  if (smem > 0) {
    r.smem = guarded_alloc(smem, &smem_map);
    if (r.smem == nullptr) {
      set_error(cudaErrorLaunchOutOfResources);
      return;
    }
    r.smem_bytes = smem;
  }
  tl_run = &r;
  tl_in_kernel = 1;
  // Blocks run one at a time, in the policy's order too: a result that depends on which block
  // ran first (two blocks writing one output) changes with the order.
  std::vector<uint3> order;
  order.reserve((size_t)grid.x * grid.y * grid.z);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) order.push_back(uint3{x, y, z});
  if (tl_policy == PKV_EMU_SCHEDULE_REVERSE) std::reverse(order.begin(), order.end());
  if (tl_policy == PKV_EMU_SCHEDULE_RANDOM)
    for (size_t i = order.size(); i > 1; --i)
      std::swap(order[i - 1], order[next_random(r.rng) % i]);
  uint64_t blocks = 0;
  for (const uint3 &b : order) {
    if (!run_block(r, b, grid, block)) break;
    ++blocks;
  }
  tl_in_kernel = 0;
  tl_run = nullptr;
  if (smem_map.base != nullptr) munmap(smem_map.base, smem_map.len);
  check_global_slack("the launch");
  tl_stats.launches++;
  tl_stats.blocks += blocks;
  tl_stats.threads += blocks * threads;
  if (smem > tl_stats.max_dynamic_smem) tl_stats.max_dynamic_smem = smem;
}
}  // namespace

}  // namespace emu

// ---- CUDA runtime calls -----------------------------------------------------------------------

cudaError_t cudaGetLastError() {
  const cudaError_t e = emu::tl_error;
  emu::tl_error = cudaSuccess;
  return e;
}

cudaError_t cudaGetDevice(int *dev) {
  if (dev == nullptr) {
    emu::set_error(cudaErrorInvalidValue);
    return cudaErrorInvalidValue;
  }
  *dev = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int dev) {
  if (value != nullptr && dev == 0) {
    switch (attr) {
      case cudaDevAttrMultiProcessorCount: *value = emu::tl_sm_count; return cudaSuccess;
      case cudaDevAttrComputeCapabilityMajor: *value = emu::tl_cc_major; return cudaSuccess;
      case cudaDevAttrComputeCapabilityMinor: *value = emu::tl_cc_minor; return cudaSuccess;
      case cudaDevAttrMaxSharedMemoryPerBlockOptin:
        *value = (int)emu::optin_smem_limit();
        return cudaSuccess;
    }
  }
  emu::set_error(cudaErrorInvalidValue);
  return cudaErrorInvalidValue;
}

cudaError_t cudaRuntimeGetVersion(int *version) {
  if (version == nullptr) return cudaErrorInvalidValue;
  *version = 13000;
  return cudaSuccess;
}

const char *cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorMisalignedAddress: return "misaligned address";
    case cudaErrorHostMemoryAlreadyRegistered:
      return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered:
      return "pointer does not correspond to a registered memory region";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  (void)stream;
  if ((int)kind < 0 || (int)kind > 4 || (bytes != 0 && (dst == nullptr || src == nullptr))) {
    emu::set_error(cudaErrorInvalidValue);  // a failed runtime call is the last error too
    return cudaErrorInvalidValue;
  }
  if (bytes == 0) return cudaSuccess;
  // The copy's own status; the last error as after a launch (launch_erased).
  const cudaError_t before = emu::tl_error;
  emu::tl_error = cudaSuccess;
  emu::tl_in_kernel = 1;  // an overrun of a guarded buffer is reported like a kernel's
  memmove(dst, src, bytes);
  emu::tl_in_kernel = 0;
  emu::check_global_slack("cudaMemcpyAsync");
  const cudaError_t own = emu::tl_error;
  if (own == cudaSuccess) emu::tl_error = before;
  return own;
}

// Pinning changes nothing the emulation can see (its copies are memmoves either way); what it
// checks is the calls' contract: no overlapping registrations, unregistering only a base.
cudaError_t cudaHostRegister(void *ptr, size_t bytes, unsigned int flags) {
  if (ptr == nullptr || bytes == 0 || flags > 0xf || emu::tl_host_register_fails) {
    emu::set_error(cudaErrorInvalidValue);
    return cudaErrorInvalidValue;
  }
  const char *lo = static_cast<const char *>(ptr);
  std::lock_guard<std::mutex> lock(emu::g_pinned_mutex);
  auto next = emu::g_pinned.lower_bound(lo);
  const bool overlaps_next = next != emu::g_pinned.end() && next->first < lo + bytes;
  const bool overlaps_prev =
      next != emu::g_pinned.begin() && std::prev(next)->first + std::prev(next)->second.bytes > lo;
  if (overlaps_next || overlaps_prev) {
    emu::set_error(cudaErrorHostMemoryAlreadyRegistered);
    return cudaErrorHostMemoryAlreadyRegistered;
  }
  emu::g_pinned[lo] = emu::Pinned{bytes, std::this_thread::get_id()};
  return cudaSuccess;
}

cudaError_t cudaHostUnregister(void *ptr) {
  std::lock_guard<std::mutex> lock(emu::g_pinned_mutex);
  if (emu::g_pinned.erase(static_cast<const char *>(ptr)) == 0) {
    emu::set_error(cudaErrorHostMemoryNotRegistered);
    return cudaErrorHostMemoryNotRegistered;
  }
  return cudaSuccess;
}

// ---- the controls of pagedkv_emu.h --------------------------------------------------------

extern "C" void *pkv_emu_alloc(size_t bytes) {
  emu::install_fault_handler();  // an overrun in cudaMemcpyAsync is reported too
  emu::Mapping m{};
  void *p = emu::guarded_alloc(bytes, &m);
  if (p == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(emu::g_alloc_mutex);
  emu::g_allocs[p] = m;
  return p;
}

extern "C" void pkv_emu_free(void *ptr) {
  if (ptr == nullptr) return;
  emu::Mapping m{};
  {
    std::lock_guard<std::mutex> lock(emu::g_alloc_mutex);
    auto it = emu::g_allocs.find(ptr);
    if (it == emu::g_allocs.end()) return;
    m = it->second;
    emu::g_allocs.erase(it);
  }
  munmap(m.base, m.len);
}

extern "C" void pkv_emu_set_sm_count(int32_t sms) { emu::tl_sm_count = sms; }

extern "C" void pkv_emu_set_host_register_fails(int32_t fails) {
  emu::tl_host_register_fails = fails != 0;
}

extern "C" size_t pkv_emu_host_registered(const void *ptr) {
  std::lock_guard<std::mutex> lock(emu::g_pinned_mutex);
  auto it = emu::g_pinned.find(static_cast<const char *>(ptr));
  const bool mine = it != emu::g_pinned.end() && it->second.owner == std::this_thread::get_id();
  return mine ? it->second.bytes : 0;
}

extern "C" void pkv_emu_set_copies_at_issue(int32_t at_issue) {
  emu::tl_copies_at_issue = at_issue != 0;
}

extern "C" void pkv_emu_set_compute_capability(int32_t major, int32_t minor) {
  emu::tl_cc_major = major;
  emu::tl_cc_minor = minor;
}

extern "C" void pkv_emu_set_schedule(int32_t policy, uint64_t seed) {
  emu::tl_policy = policy;
  emu::tl_seed = seed;
}

extern "C" pkv_emu_stats pkv_emu_take_stats(void) {
  const pkv_emu_stats s = emu::tl_stats;
  emu::tl_stats = pkv_emu_stats{0, 0, 0, 0};
  return s;
}

extern "C" size_t pkv_emu_last_fault(char *buf, size_t len) {
  const std::string &m = emu::tl_fault_message;
  if (buf != nullptr && len > 0) {
    const size_t n = std::min(len - 1, m.size());
    memcpy(buf, m.data(), n);
    buf[n] = 0;
  }
  return m.size();
}
