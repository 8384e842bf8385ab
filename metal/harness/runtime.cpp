// runtime.cpp: runs a compiled kernel wrapper over a Metal-style grid on the CPU.
//
// Every thread of a threadgroup is a fiber (its own stack); all fibers of one threadgroup run
// on one OS worker thread and switch only at collective operations (threadgroup_barrier,
// simdgroup_barrier, simd_*), which gives barrier and SIMD-exchange semantics without
// locks. Threadgroups are spread over a few worker threads. Buffers come from mshim_alloc,
// which puts an inaccessible page right after (and before) each buffer, so an out-of-bounds
// access is reported with the buffer's name instead of reading neighbouring memory.
// A kernel that deadlocks, uses a collective from diverging threads, faults, or runs past
// the timeout makes mshim_run return non-zero with a message.

// Fiber switch: a few instructions on x86-64 (the CI machine); ucontext elsewhere, or when
// built with -DMSHIM_USE_UCONTEXT.
#if defined(__x86_64__) && !defined(MSHIM_USE_UCONTEXT)
#define MSHIM_ASM_SWITCH 1
#else
#define MSHIM_ASM_SWITCH 0
#define _XOPEN_SOURCE 700
#if defined(__APPLE__)
#define _DARWIN_C_SOURCE 1
#endif
#include <ucontext.h>
#endif

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "mshim_abi.h"

#define MSHIM_API extern "C" __attribute__((visibility("default")))

namespace {

constexpr size_t kFiberStack = 64 * 1024;
constexpr size_t kAltStack = 64 * 1024;
constexpr unsigned kMaxThreadsPerGroup = 1024;

size_t page_size() {
  static size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

// ------------------------------------------------------------------------------------------
// Context switching.
#if MSHIM_ASM_SWITCH
extern "C" void mshim_ctx_switch(void** save_sp, void* new_sp);
extern "C" void mshim_ctx_trampoline();
asm(R"(
  .text
  .globl mshim_ctx_switch
  .hidden mshim_ctx_switch
  .type mshim_ctx_switch,@function
mshim_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size mshim_ctx_switch, .-mshim_ctx_switch

  .globl mshim_ctx_trampoline
  .hidden mshim_ctx_trampoline
  .type mshim_ctx_trampoline,@function
mshim_ctx_trampoline:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size mshim_ctx_trampoline, .-mshim_ctx_trampoline
  .section .note.GNU-stack,"",@progbits
  .text
)");
#endif

enum FiberState { kReady = 0, kBlocked = 1, kDone = 2 };

struct Barrier {
  unsigned expected = 0;
  unsigned count = 0;
  unsigned gen = 0;
  int kind = 0;
  unsigned line = 0;
  unsigned column = 0;
};

struct Fiber {
  void* sp = nullptr;
#if !MSHIM_ASM_SWITCH
  ucontext_t uc;
#endif
  char* stack_lo = nullptr;
  mshim_attrs attrs;
  int state = kReady;
  Barrier* wait = nullptr;
  unsigned wait_gen = 0;
  unsigned sg = 0;
  unsigned lane = 0;
};

struct SimdGroup {
  Barrier bar;
  alignas(16) unsigned char buf[2][MSHIM_SIMD_WIDTH][MSHIM_SLOT_BYTES];
};

struct Run;

struct Worker {
  Run* run = nullptr;
  std::vector<Fiber> fibers;
  char* stacks = nullptr;
  size_t stacks_bytes = 0;
  void* sched_sp = nullptr;
#if !MSHIM_ASM_SWITCH
  ucontext_t sched_uc;
#endif
  Barrier tg_bar;
  std::vector<SimdGroup> simd;
  Fiber* cur = nullptr;
  bool failed = false;
  char msg[768] = {0};
  mshim_uint3 group = {0, 0, 0};
  sigjmp_buf jmp;
  volatile sig_atomic_t jmp_active = 0;
  pthread_t tid;
  bool finished = false;
};

struct Run {
  void* const* buffers = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned tg[3] = {1, 1, 1};
  unsigned ngroups[3] = {1, 1, 1};
  uint64_t total_groups = 0;
  std::atomic<uint64_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::condition_variable cv;
  int finished_workers = 0;
  bool has_error = false;
  char error[1024] = {0};
};

thread_local Worker* tl_worker = nullptr;

// ------------------------------------------------------------------------------------------
// Guarded allocations.
struct Alloc {
  char* base;
  size_t total;
  char* data;
  size_t nbytes;
  char label[64];
};

std::mutex g_alloc_mu;
std::vector<Alloc> g_allocs;

struct StackRegion {
  char* lo;
  char* hi;
};
std::mutex g_stack_mu;
std::vector<StackRegion> g_stack_guards;

void set_error(Run* run, const char* text) {
  std::lock_guard<std::mutex> lock(run->mu);
  if (!run->has_error) {
    run->has_error = true;
    snprintf(run->error, sizeof(run->error), "%s", text);
  }
  run->stop.store(true);
}

// ------------------------------------------------------------------------------------------
// Fibers.
void fiber_main(void* arg);

#if !MSHIM_ASM_SWITCH
void fiber_main_uc() { fiber_main(tl_worker->cur); }
#endif

void prepare_fiber(Worker* w, Fiber* f) {
#if MSHIM_ASM_SWITCH
  char* top = f->stack_lo + kFiberStack;
  uint64_t* sp = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(top - 64) & ~uintptr_t(15));
  // Layout popped by mshim_ctx_switch: [mxcsr|fpucw] r15 r14 r13 r12 rbx rbp ret.
  *--sp = reinterpret_cast<uint64_t>(&mshim_ctx_trampoline);  // ret
  *--sp = 0;                                                   // rbp
  *--sp = 0;                                                   // rbx
  *--sp = reinterpret_cast<uint64_t>(f);                       // r12 -> first argument
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);             // r13 -> function
  *--sp = 0;                                                   // r14
  *--sp = 0;                                                   // r15
  *--sp = 0x0000037F00001F80ull;                               // fpu control word | mxcsr
  f->sp = sp;
  (void)w;
#else
  getcontext(&f->uc);
  f->uc.uc_stack.ss_sp = f->stack_lo;
  f->uc.uc_stack.ss_size = kFiberStack;
  f->uc.uc_link = nullptr;
  makecontext(&f->uc, fiber_main_uc, 0);
  (void)w;
#endif
}

inline void switch_to_fiber(Worker* w, Fiber* f) {
  w->cur = f;
#if MSHIM_ASM_SWITCH
  mshim_ctx_switch(&w->sched_sp, f->sp);
#else
  swapcontext(&w->sched_uc, &f->uc);
#endif
  w->cur = nullptr;
}

inline void switch_to_scheduler(Worker* w, Fiber* f) {
#if MSHIM_ASM_SWITCH
  mshim_ctx_switch(&f->sp, w->sched_sp);
#else
  swapcontext(&f->uc, &w->sched_uc);
#endif
}

void fiber_main(void* arg) {
  Fiber* f = static_cast<Fiber*>(arg);
  Worker* w = tl_worker;
  mshim_kernel_entry(w->run->buffers, &f->attrs);
  f->state = kDone;
  switch_to_scheduler(w, f);
  __builtin_trap();  // a finished fiber is never resumed
}

const char* kind_name(int kind) {
  switch (kind) {
    case MSHIM_OP_THREADGROUP_BARRIER: return "threadgroup_barrier";
    case MSHIM_OP_SIMDGROUP_BARRIER: return "simdgroup_barrier";
    case MSHIM_OP_SIMD_SUM: return "simd_sum";
    case MSHIM_OP_SIMD_PRODUCT: return "simd_product";
    case MSHIM_OP_SIMD_MAX: return "simd_max";
    case MSHIM_OP_SIMD_MIN: return "simd_min";
    case MSHIM_OP_SIMD_SHUFFLE: return "simd_shuffle";
    case MSHIM_OP_SIMD_SHUFFLE_XOR: return "simd_shuffle_xor";
    case MSHIM_OP_SIMD_SHUFFLE_UP: return "simd_shuffle_up";
    case MSHIM_OP_SIMD_SHUFFLE_DOWN: return "simd_shuffle_down";
    case MSHIM_OP_SIMD_BROADCAST: return "simd_broadcast";
    case MSHIM_OP_SIMD_BROADCAST_FIRST: return "simd_broadcast_first";
    case MSHIM_OP_SIMD_PREFIX_INCLUSIVE_SUM: return "simd_prefix_inclusive_sum";
    case MSHIM_OP_SIMD_PREFIX_EXCLUSIVE_SUM: return "simd_prefix_exclusive_sum";
    case MSHIM_OP_SIMD_ALL: return "simd_all";
    case MSHIM_OP_SIMD_ANY: return "simd_any";
    case MSHIM_OP_SIMDGROUP_LOAD: return "simdgroup_load";
    case MSHIM_OP_SIMDGROUP_STORE: return "simdgroup_store";
    case MSHIM_OP_SIMDGROUP_MULTIPLY_ACCUMULATE: return "simdgroup_multiply_accumulate";
    default: return "collective";
  }
}

[[noreturn]] void fail_in_fiber(Worker* w, const char* fmt, ...) {
  char text[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof(text), fmt, ap);
  va_end(ap);
  Fiber* f = w->cur;
  snprintf(w->msg, sizeof(w->msg), "%s [thread (%u,%u,%u) of threadgroup (%u,%u,%u)]", text,
           f->attrs.thread_position_in_threadgroup.x, f->attrs.thread_position_in_threadgroup.y,
           f->attrs.thread_position_in_threadgroup.z, w->group.x, w->group.y, w->group.z);
  w->failed = true;
  switch_to_scheduler(w, f);
  __builtin_trap();
}

void barrier_wait(Worker* w, Barrier& b, int kind, unsigned line, unsigned column) {
  Fiber* f = w->cur;
  if (b.count == 0) {
    b.kind = kind;
    b.line = line;
    b.column = column;
  } else if (b.kind != kind || b.line != line || b.column != column) {
    fail_in_fiber(w,
                  "diverging collective: %s at kernel source line %u met %s at line %u; Metal "
                  "needs every participating thread at the same call (divergent or "
                  "inactive-lane collectives are not modelled)",
                  kind_name(kind), line, kind_name(b.kind), b.line);
  }
  const unsigned gen = b.gen;
  if (++b.count == b.expected) {
    b.count = 0;
    ++b.gen;
    return;
  }
  f->state = kBlocked;
  f->wait = &b;
  f->wait_gen = gen;
  switch_to_scheduler(w, f);
}

void describe_deadlock(Worker* w, unsigned n) {
  unsigned done = 0, at_tg = 0, at_simd = 0;
  int simd_kind = 0;
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = w->fibers[i];
    if (f.state == kDone) {
      ++done;
    } else if (f.wait == &w->tg_bar) {
      ++at_tg;
    } else {
      ++at_simd;
      simd_kind = f.wait->kind;
    }
  }
  if (at_tg > 0) {
    snprintf(w->msg, sizeof(w->msg),
             "deadlock in threadgroup (%u,%u,%u): %u of %u threads wait at threadgroup_barrier "
             "while %u returned and %u wait in simdgroup functions; every thread must reach "
             "each threadgroup_barrier",
             w->group.x, w->group.y, w->group.z, at_tg, n, done, at_simd);
  } else {
    snprintf(w->msg, sizeof(w->msg),
             "deadlock in threadgroup (%u,%u,%u): %u threads wait in %s while other lanes of "
             "their simdgroup returned (%u done); simdgroup functions over inactive lanes are "
             "not modelled",
             w->group.x, w->group.y, w->group.z, at_simd, kind_name(simd_kind), done);
  }
  w->failed = true;
}

// Runs one threadgroup to completion; false (with w->msg) on failure.
bool run_group(Worker* w, uint64_t linear) {
  Run* run = w->run;
  const unsigned gx = static_cast<unsigned>(linear % run->ngroups[0]);
  const unsigned gy = static_cast<unsigned>((linear / run->ngroups[0]) % run->ngroups[1]);
  const unsigned gz = static_cast<unsigned>(linear / (uint64_t(run->ngroups[0]) * run->ngroups[1]));
  w->group = {gx, gy, gz};
  // dispatchThreads: edge threadgroups are cut to the grid (non-uniform threadgroups).
  const unsigned ax = std::min(run->tg[0], run->grid[0] - gx * run->tg[0]);
  const unsigned ay = std::min(run->tg[1], run->grid[1] - gy * run->tg[1]);
  const unsigned az = std::min(run->tg[2], run->grid[2] - gz * run->tg[2]);
  const unsigned n = ax * ay * az;
  const unsigned nominal = run->tg[0] * run->tg[1] * run->tg[2];
  const unsigned nsg = (n + MSHIM_SIMD_WIDTH - 1) / MSHIM_SIMD_WIDTH;
  w->tg_bar = Barrier();
  w->tg_bar.expected = n;
  for (unsigned s = 0; s < nsg; ++s) {
    w->simd[s].bar = Barrier();
    w->simd[s].bar.expected = std::min<unsigned>(MSHIM_SIMD_WIDTH, n - s * MSHIM_SIMD_WIDTH);
  }
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = w->fibers[i];
    const unsigned lx = i % ax, ly = (i / ax) % ay, lz = i / (ax * ay);
    mshim_attrs& a = f.attrs;
    a.thread_position_in_threadgroup = {lx, ly, lz};
    a.threadgroup_position_in_grid = {gx, gy, gz};
    a.thread_position_in_grid = {gx * run->tg[0] + lx, gy * run->tg[1] + ly, gz * run->tg[2] + lz};
    a.threadgroups_per_grid = {run->ngroups[0], run->ngroups[1], run->ngroups[2]};
    a.threads_per_grid = {run->grid[0], run->grid[1], run->grid[2]};
    a.grid_size = a.threads_per_grid;
    a.grid_origin = {0, 0, 0};
    a.threads_per_threadgroup = {ax, ay, az};
    a.dispatch_threads_per_threadgroup = {run->tg[0], run->tg[1], run->tg[2]};
    a.thread_index_in_threadgroup = i;
    a.thread_index_in_simdgroup = i % MSHIM_SIMD_WIDTH;
    a.simdgroup_index_in_threadgroup = i / MSHIM_SIMD_WIDTH;
    a.simdgroups_per_threadgroup = nsg;
    a.dispatch_simdgroups_per_threadgroup = (nominal + MSHIM_SIMD_WIDTH - 1) / MSHIM_SIMD_WIDTH;
    a.threads_per_simdgroup = MSHIM_SIMD_WIDTH;
    a.thread_execution_width = MSHIM_SIMD_WIDTH;
    a.thread_index_in_quadgroup = i % 4;
    a.quadgroup_index_in_threadgroup = i / 4;
    a.quadgroups_per_threadgroup = (n + 3) / 4;
    a.dispatch_quadgroups_per_threadgroup = (nominal + 3) / 4;
    f.state = kReady;
    f.wait = nullptr;
    f.sg = i / MSHIM_SIMD_WIDTH;
    f.lane = i % MSHIM_SIMD_WIDTH;
    prepare_fiber(w, &f);
  }
  // Odd threadgroups run their threads in reverse order, so a missing barrier shows up
  // whichever direction the data flows between threads.
  const bool reverse = (linear & 1u) != 0;
  unsigned done = 0;
  for (;;) {
    bool progressed = false;
    for (unsigned k = 0; k < n; ++k) {
      Fiber& f = w->fibers[reverse ? n - 1 - k : k];
      if (f.state == kDone) continue;
      if (f.state == kBlocked) {
        if (f.wait->gen == f.wait_gen) continue;
        f.state = kReady;
        f.wait = nullptr;
      }
      switch_to_fiber(w, &f);
      progressed = true;
      if (w->failed) return false;
      if (f.state == kDone) ++done;
    }
    if (done == n) return true;
    if (!progressed) {
      describe_deadlock(w, n);
      return false;
    }
    if (run->stop.load(std::memory_order_relaxed)) {
      snprintf(w->msg, sizeof(w->msg), "stopped");
      w->failed = true;
      return false;
    }
  }
}

// ------------------------------------------------------------------------------------------
// Signals: out-of-bounds accesses (SIGSEGV/SIGBUS) and the watchdog (SIGUSR1).
struct sigaction g_old_segv, g_old_bus, g_old_usr1;

void describe_fault(Worker* w, void* addr, void* uctx) {
  char* a = static_cast<char*>(addr);
  const char* access = "access";
#if defined(__x86_64__) && defined(__linux__) && defined(REG_ERR)
  if (uctx) {
    const ucontext_t* uc = static_cast<const ucontext_t*>(uctx);
    access = (uc->uc_mcontext.gregs[REG_ERR] & 2) ? "write" : "read";
  }
#else
  (void)uctx;
#endif
  Fiber* f = w->cur;
  char where[160] = "";
  if (f) {
    snprintf(where, sizeof(where), " [thread (%u,%u,%u) of threadgroup (%u,%u,%u)]",
             f->attrs.thread_position_in_threadgroup.x, f->attrs.thread_position_in_threadgroup.y,
             f->attrs.thread_position_in_threadgroup.z, w->group.x, w->group.y, w->group.z);
  }
  for (const Alloc& al : g_allocs) {
    if (a >= al.base && a < al.base + al.total) {
      if (a >= al.data + al.nbytes) {
        snprintf(w->msg, sizeof(w->msg),
                 "out-of-bounds %s on buffer '%s': byte %zu past its end (%zu bytes)%s", access,
                 al.label, static_cast<size_t>(a - (al.data + al.nbytes)), al.nbytes, where);
      } else {
        snprintf(w->msg, sizeof(w->msg),
                 "out-of-bounds %s on buffer '%s': %zu bytes before its start%s", access,
                 al.label, static_cast<size_t>(al.data - a), where);
      }
      return;
    }
  }
  for (const StackRegion& s : g_stack_guards) {
    if (a >= s.lo && a < s.hi) {
      snprintf(w->msg, sizeof(w->msg), "fiber stack overflow (%zu KiB per thread)%s",
               kFiberStack / 1024, where);
      return;
    }
  }
  snprintf(w->msg, sizeof(w->msg), "invalid memory %s at %p (wild pointer)%s", access, addr, where);
}

void on_signal(int sig, siginfo_t* si, void* uctx) {
  Worker* w = tl_worker;
  if (w != nullptr && w->jmp_active) {
    w->jmp_active = 0;
    if (sig == SIGUSR1) {
      snprintf(w->msg, sizeof(w->msg),
               "kernel ran past the timeout (endless loop?) in threadgroup (%u,%u,%u)",
               w->group.x, w->group.y, w->group.z);
    } else {
      describe_fault(w, si->si_addr, uctx);
    }
    w->failed = true;
    siglongjmp(w->jmp, 1);
  }
  if (sig == SIGUSR1) return;
  // Not a kernel fault: fall back to the previous handler and let the access fault again.
  sigaction(sig, sig == SIGSEGV ? &g_old_segv : &g_old_bus, nullptr);
}

void install_handlers() {
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_old_segv);
  sigaction(SIGBUS, &sa, &g_old_bus);
  sigaction(SIGUSR1, &sa, &g_old_usr1);
}

void restore_handlers() {
  sigaction(SIGSEGV, &g_old_segv, nullptr);
  sigaction(SIGBUS, &g_old_bus, nullptr);
  sigaction(SIGUSR1, &g_old_usr1, nullptr);
}

// ------------------------------------------------------------------------------------------
// Workers.
void worker_main(Worker* w) {
  tl_worker = w;
  Run* run = w->run;
  stack_t alt;
  alt.ss_sp = mmap(nullptr, kAltStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  alt.ss_size = kAltStack;
  alt.ss_flags = 0;
  stack_t old_alt;
  sigaltstack(&alt, &old_alt);

  if (sigsetjmp(w->jmp, 1) == 0) {
    w->jmp_active = 1;
    while (!run->stop.load()) {
      const uint64_t g = run->next.fetch_add(1);
      if (g >= run->total_groups) break;
      if (!run_group(w, g)) break;
    }
    w->jmp_active = 0;
  }
  if (w->failed && strcmp(w->msg, "stopped") != 0) set_error(run, w->msg);

  sigaltstack(&old_alt, nullptr);
  munmap(alt.ss_sp, kAltStack);
  tl_worker = nullptr;
  std::lock_guard<std::mutex> lock(run->mu);
  w->finished = true;
  run->finished_workers++;
  run->cv.notify_all();
}

std::mutex g_run_mu;

}  // namespace

extern "C" [[noreturn]] void mshim_fail(const char* message) {
  fail_in_fiber(tl_worker, "%s", message);
}

extern "C" void mshim_threadgroup_barrier(int kind, unsigned line, unsigned column) {
  Worker* w = tl_worker;
  barrier_wait(w, w->tg_bar, kind, line, column);
}

extern "C" void mshim_simd_exchange(int kind, unsigned line, unsigned column, const void* mine,
                                    unsigned size, void* all, unsigned* lane, unsigned* width) {
  Worker* w = tl_worker;
  Fiber* f = w->cur;
  SimdGroup& sg = w->simd[f->sg];
  // Two slots alternate by generation: a lane that runs ahead writes the other slot, and it
  // cannot run two collectives ahead because the next rendezvous waits for everyone.
  const unsigned parity = sg.bar.gen & 1u;
  memcpy(sg.buf[parity][f->lane], mine, size);
  barrier_wait(w, sg.bar, kind, line, column);
  memcpy(all, sg.buf[parity], sizeof(sg.buf[parity]));
  *lane = f->lane;
  *width = sg.bar.expected;
}

MSHIM_API int mshim_abi_version() { return MSHIM_ABI_VERSION; }

// A buffer whose last byte sits just before an inaccessible page (and with one before it).
MSHIM_API void* mshim_alloc(size_t nbytes, const char* label) {
  const size_t page = page_size();
  const size_t body = (nbytes + page - 1) / page * page;
  const size_t total = body + 2 * page;
  char* base = static_cast<char*>(
      mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) return nullptr;
  mprotect(base, page, PROT_NONE);
  mprotect(base + page + body, page, PROT_NONE);
  Alloc al;
  al.base = base;
  al.total = total;
  al.data = base + page + body - nbytes;
  al.nbytes = nbytes;
  snprintf(al.label, sizeof(al.label), "%s", label ? label : "?");
  std::lock_guard<std::mutex> lock(g_alloc_mu);
  g_allocs.push_back(al);
  return al.data;
}

MSHIM_API void mshim_free(void* p) {
  std::lock_guard<std::mutex> lock(g_alloc_mu);
  for (size_t i = 0; i < g_allocs.size(); ++i) {
    if (g_allocs[i].data == p) {
      munmap(g_allocs[i].base, g_allocs[i].total);
      g_allocs.erase(g_allocs.begin() + static_cast<long>(i));
      return;
    }
  }
}

// Runs the whole grid. grid counts threads (as mx.fast.metal_kernel's grid does) and tg is
// the threadgroup size already clamped to the grid. Returns 0 or 1 with a message in err.
MSHIM_API int mshim_run(void* const* buffers, const unsigned* grid, const unsigned* tg,
                        int n_workers, double timeout_s, char* err, int err_len) {
  std::lock_guard<std::mutex> run_lock(g_run_mu);
  Run run;
  run.buffers = buffers;
  uint64_t tg_size = 1;
  for (int d = 0; d < 3; ++d) {
    run.grid[d] = grid[d];
    run.tg[d] = tg[d];
    if (tg[d] == 0) {
      snprintf(err, static_cast<size_t>(err_len), "threadgroup size must be positive");
      return 1;
    }
    if (grid[d] == 0) return 0;
    run.ngroups[d] = (grid[d] + tg[d] - 1) / tg[d];
    tg_size *= tg[d];
  }
  if (tg_size > kMaxThreadsPerGroup) {
    snprintf(err, static_cast<size_t>(err_len), "threadgroup of %llu threads exceeds %u",
             static_cast<unsigned long long>(tg_size), kMaxThreadsPerGroup);
    return 1;
  }
  run.total_groups = uint64_t(run.ngroups[0]) * run.ngroups[1] * run.ngroups[2];
  const unsigned nw = static_cast<unsigned>(
      std::max<uint64_t>(1, std::min<uint64_t>(static_cast<uint64_t>(std::max(1, n_workers)),
                                               run.total_groups)));

  // Fiber stacks, each with a guard page below it.
  const size_t page = page_size();
  const size_t slot = kFiberStack + page;
  std::vector<Worker> workers(nw);
  {
    std::lock_guard<std::mutex> lock(g_stack_mu);
    for (Worker& w : workers) {
      w.run = &run;
      w.fibers.resize(tg_size);
      w.simd.resize((tg_size + MSHIM_SIMD_WIDTH - 1) / MSHIM_SIMD_WIDTH);
      w.stacks_bytes = slot * tg_size;
      w.stacks = static_cast<char*>(mmap(nullptr, w.stacks_bytes, PROT_READ | PROT_WRITE,
                                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
      if (w.stacks == MAP_FAILED) {
        snprintf(err, static_cast<size_t>(err_len), "cannot map fiber stacks");
        return 1;
      }
      for (uint64_t i = 0; i < tg_size; ++i) {
        char* lo = w.stacks + i * slot;
        mprotect(lo, page, PROT_NONE);
        g_stack_guards.push_back({lo, lo + page});
        w.fibers[i].stack_lo = lo + page;
      }
    }
  }

  install_handlers();
  std::vector<std::thread> threads;
  threads.reserve(nw);
  for (Worker& w : workers) {
    threads.emplace_back(worker_main, &w);
    w.tid = threads.back().native_handle();
  }
  bool timed_out = false;
  {
    std::unique_lock<std::mutex> lock(run.mu);
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (run.finished_workers < static_cast<int>(nw)) {
      if (run.cv.wait_until(lock, deadline) == std::cv_status::timeout) break;
    }
    if (run.finished_workers < static_cast<int>(nw)) {
      timed_out = true;
      run.stop.store(true);
      for (Worker& w : workers) {
        if (!w.finished) pthread_kill(w.tid, SIGUSR1);
      }
    }
  }
  for (std::thread& t : threads) t.join();
  if (timed_out && !run.has_error) {
    run.has_error = true;
    snprintf(run.error, sizeof(run.error), "kernel ran past the %.1f s timeout", timeout_s);
  }
  restore_handlers();

  {
    std::lock_guard<std::mutex> lock(g_stack_mu);
    g_stack_guards.clear();
  }
  for (Worker& w : workers) munmap(w.stacks, w.stacks_bytes);

  if (run.has_error) {
    snprintf(err, static_cast<size_t>(err_len), "%s", run.error);
    return 1;
  }
  return 0;
}
