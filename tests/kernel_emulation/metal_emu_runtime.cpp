// metal_emu_runtime.cpp: the runtime half of metal_emu.h (see the model described there).
// Compiled once per header/runtime version into an object file that every generated kernel
// program links with; it provides main()'s work: reading the launch description, allocating
// guarded buffers, running the threadgroups, writing the outputs.
#include "metal_emu.h"
#undef device
#undef constant
#undef thread
#undef threadgroup

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <barrier>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#if !defined(__x86_64__) || defined(METAL_EMU_FORCE_UCONTEXT)
#define METAL_EMU_USE_UCONTEXT 1
#include <ucontext.h>
#else
#define METAL_EMU_USE_UCONTEXT 0
#endif

// Bounds of the kernel's function-local statics (its threadgroup arrays), defined by tg.ld.
extern "C" char __metal_emu_tg_start[] __attribute__((weak));
extern "C" char __metal_emu_tg_end[] __attribute__((weak));

namespace metal_emu {

thread_local LaneContext* tls_lane = nullptr;

const char* op_name(Op op) {
  switch (op) {
    case Op::none: return "none";
    case Op::sum: return "simd_sum";
    case Op::product: return "simd_product";
    case Op::max: return "simd_max";
    case Op::min: return "simd_min";
    case Op::and_: return "simd_and";
    case Op::or_: return "simd_or";
    case Op::xor_: return "simd_xor";
    case Op::prefix_incl: return "simd_prefix_inclusive_sum";
    case Op::prefix_excl: return "simd_prefix_exclusive_sum";
    case Op::shuffle: return "simd_shuffle";
    case Op::shuffle_up: return "simd_shuffle_up";
    case Op::shuffle_down: return "simd_shuffle_down";
    case Op::shuffle_xor: return "simd_shuffle_xor";
    case Op::broadcast_first: return "simd_broadcast_first";
    case Op::all: return "simd_all";
    case Op::any: return "simd_any";
    case Op::is_first: return "simd_is_first";
    case Op::simdgroup_barrier: return "simdgroup_barrier";
    case Op::threadgroup_barrier: return "threadgroup_barrier";
    case Op::exit: return "return";
  }
  return "?";
}

namespace {

[[noreturn]] void fatal(const char* fmt, ...) {
  std::fprintf(stderr, "metal_emu: error: ");
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fputc('\n', stderr);
  std::fflush(stderr);
  _exit(3);
}

const size_t kPage = size_t(sysconf(_SC_PAGESIZE));
constexpr size_t kStackSize = 256 * 1024;
constexpr size_t kMaxThreadgroupMemory = 32768;  // bytes, Apple GPUs
constexpr unsigned kMaxThreadsPerThreadgroup = 1024;

// ------------------------------------------------------------------------------------------
// Fibers
// ------------------------------------------------------------------------------------------
#if !METAL_EMU_USE_UCONTEXT
extern "C" void metal_emu_switch(void** save_sp, void* new_sp);
asm(R"(
    .text
    .globl metal_emu_switch
    .type metal_emu_switch, @function
metal_emu_switch:
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
    .size metal_emu_switch, .-metal_emu_switch
)");

struct Context {
  void* sp = nullptr;
};

void make_context(Context& c, char* stack_lo, size_t size, void (*entry)()) {
  const uintptr_t top = (reinterpret_cast<uintptr_t>(stack_lo) + size) & ~uintptr_t(15);
  // Frame popped by metal_emu_switch: [mxcsr|fpcw][r15][r14][r13][r12][rbx][rbp][ret], then a
  // fake return address, so that `entry` starts with rsp = 8 (mod 16) like after a call.
  auto* sp = reinterpret_cast<uint64_t*>(top - 72);
  uint32_t mxcsr;
  uint16_t fpcw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpcw));
  std::memset(sp, 0, 72);
  std::memcpy(sp, &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(sp) + 4, &fpcw, 2);
  sp[7] = reinterpret_cast<uint64_t>(entry);
  c.sp = sp;
}

inline void switch_context(Context& from, Context& to) { metal_emu_switch(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
};

void make_context(Context& c, char* stack_lo, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack_lo;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}

inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

// ------------------------------------------------------------------------------------------
// Guarded memory
// ------------------------------------------------------------------------------------------
struct Region {
  char* map = nullptr;  // whole mapping
  size_t map_size = 0;
  char* data = nullptr;  // usable bytes, ending right before the trailing guard page
  size_t size = 0;
  const char* what = "";
  int index = -1;
};
std::vector<Region> g_regions;
std::vector<Region> g_stacks;  // one per (simdgroup, lane); threadgroups run one at a time

size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

// [guard page][data, ending at a page boundary][guard page]
Region map_guarded(size_t nbytes, size_t align) {
  Region r;
  const size_t body = round_up(nbytes ? nbytes : 1, kPage);
  r.map_size = body + 2 * kPage;
  void* p = mmap(nullptr, r.map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) fatal("mmap of %zu bytes failed", r.map_size);
  r.map = static_cast<char*>(p);
  mprotect(r.map, kPage, PROT_NONE);
  mprotect(r.map + kPage + body, kPage, PROT_NONE);
  const uintptr_t end = reinterpret_cast<uintptr_t>(r.map + kPage + body);
  r.data = reinterpret_cast<char*>((end - nbytes) & ~uintptr_t(align - 1));
  r.size = nbytes;
  return r;
}

void segv_handler(int sig, siginfo_t* info, void*) {
  const char* addr = static_cast<const char*>(info->si_addr);
  char msg[512];
  int n = std::snprintf(msg, sizeof msg,
                        "metal_emu: error: invalid memory access (%s) at %p", strsignal(sig),
                        static_cast<const void*>(addr));
  for (const Region& r : g_regions) {
    if (addr >= r.map && addr < r.map + r.map_size) {
      const long off = long(addr - r.data);
      n += std::snprintf(msg + n, sizeof msg - n, ": %s %d, byte offset %ld of %zu%s", r.what,
                         r.index, off, r.size,
                         (addr >= r.data && addr < r.data + r.size) ? " (write to an input?)"
                                                                   : " (out of bounds)");
      break;
    }
  }
  for (const Region& r : g_stacks) {
    if (addr >= r.map && addr < r.map + kPage) {
      n += std::snprintf(msg + n, sizeof msg - n, ": lane stack overflow");
      break;
    }
  }
  n += std::snprintf(msg + n, sizeof msg - n, "\n");
  ssize_t ignored = write(2, msg, size_t(n));
  (void)ignored;
  _exit(4);
}

void install_signal_stack() {
  static thread_local std::vector<char> alt(64 * 1024);
  stack_t ss{};
  ss.ss_sp = alt.data();
  ss.ss_size = alt.size();
  sigaltstack(&ss, nullptr);
}

void install_signal_handlers() {
  struct sigaction sa{};
  sa.sa_sigaction = segv_handler;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
  install_signal_stack();
}

// ------------------------------------------------------------------------------------------
// Lanes, simdgroups, threadgroups
// ------------------------------------------------------------------------------------------
struct Lane {
  LaneContext ctx{};
  Context context{};
  LaneAttrs attrs{};
  bool exited = false;
};

struct Threadgroup;

struct Simdgroup {
  unsigned index = 0;
  unsigned nlanes = 0;
  Lane lanes[kSimdWidth];
  SimdShared shared{};
  Context scheduler{};
  Lane* running = nullptr;
};

thread_local Simdgroup* tls_sg = nullptr;
LaneEntry g_entry = nullptr;
std::vector<void*> g_buffers;

void lane_main() {
  Simdgroup* sg = tls_sg;
  Lane* lane = sg->running;
  g_entry(g_buffers.data(), lane->attrs);
  lane->exited = true;
  lane->ctx.op = Op::exit;
  switch_context(lane->context, sg->scheduler);
  fatal("a lane that returned was resumed");
}

struct Site {
  const char* file = "";
  unsigned line = 0;
  unsigned column = 0;
  bool operator==(const Site& o) const {
    return line == o.line && column == o.column && std::strcmp(file, o.file) == 0;
  }
};

struct Threadgroup {
  struct Completion {
    Threadgroup* tg;
    void operator()() noexcept { tg->phase_complete(); }
  };

  unsigned nsg;
  bool ordered;
  std::vector<unsigned> order;
  std::atomic<int> turn{0};
  std::atomic<int> waiting{0};
  std::atomic<int> exited{0};
  std::vector<Site> sites;
  std::vector<char> at_barrier;
  std::barrier<Completion> bar;

  Threadgroup(unsigned n, bool ordered_, bool descending)
      : nsg(n), ordered(ordered_), sites(n), at_barrier(n, 0), bar(n, Completion{this}) {
    for (unsigned i = 0; i < n; ++i) order.push_back(descending ? n - 1 - i : i);
  }

  void wait_turn(unsigned idx) {
    if (!ordered) return;
    for (;;) {
      const int t = turn.load(std::memory_order_acquire);
      if (t < int(nsg) && order[t] == idx) return;
      turn.wait(t, std::memory_order_acquire);
    }
  }

  void pass_turn() {
    if (!ordered) return;
    turn.fetch_add(1, std::memory_order_acq_rel);
    turn.notify_all();
  }

  void phase_complete() {
    const int w = waiting.load();
    if (w > 0 && exited.load() > 0) {
      fatal("threadgroup_barrier (%s:%u) reached by some simdgroups after others returned: "
            "undefined behaviour in Metal",
            first_site().file, first_site().line);
    }
    for (unsigned i = 0; i < nsg; ++i) {
      if (at_barrier[i] && !(sites[i] == first_site())) {
        fatal("simdgroups wait at different threadgroup_barrier calls: %s:%u:%u and %s:%u:%u",
              first_site().file, first_site().line, first_site().column, sites[i].file,
              sites[i].line, sites[i].column);
      }
    }
    std::fill(at_barrier.begin(), at_barrier.end(), 0);
    waiting.store(0);
    turn.store(0, std::memory_order_release);
    turn.notify_all();
  }

  Site first_site() const {
    for (unsigned i = 0; i < nsg; ++i)
      if (at_barrier[i]) return sites[i];
    return Site{};
  }

  void arrive(unsigned idx, const LaneContext& at) {
    sites[idx] = Site{at.file, at.line, at.column};
    at_barrier[idx] = 1;
    waiting.fetch_add(1);
    pass_turn();
    bar.arrive_and_wait();
    wait_turn(idx);
  }

  void leave() {
    exited.fetch_add(1);
    pass_turn();
    bar.arrive_and_drop();
  }
};

void resume(Simdgroup& sg, Lane& lane) {
  sg.running = &lane;
  tls_lane = &lane.ctx;
  switch_context(sg.scheduler, lane.context);
  sg.running = nullptr;
}

bool same_site(const LaneContext& a, const LaneContext& b) {
  return a.op == b.op && a.line == b.line && a.column == b.column && a.ops == b.ops &&
         (a.file == b.file || std::strcmp(a.file, b.file) == 0);
}

void run_simdgroup(Threadgroup& tg, Simdgroup& sg) {
  install_signal_stack();
  tls_sg = &sg;
  for (unsigned i = 0; i < sg.nlanes; ++i) {
    Region& st = g_stacks[sg.index * kSimdWidth + i];
    make_context(sg.lanes[i].context, st.data, st.size, lane_main);
  }
  const uint32_t all = sg.nlanes == 32 ? 0xffffffffu : ((1u << sg.nlanes) - 1u);
  tg.wait_turn(sg.index);
  for (;;) {
    for (unsigned i = 0; i < sg.nlanes; ++i)
      if (!sg.lanes[i].exited) resume(sg, sg.lanes[i]);
    uint32_t live = 0;
    const Lane* first = nullptr;
    for (unsigned i = 0; i < sg.nlanes; ++i) {
      const Lane& l = sg.lanes[i];
      if (l.exited) continue;
      live |= 1u << i;
      if (!first) {
        first = &l;
      } else if (!same_site(first->ctx, l.ctx)) {
        fatal("divergent simdgroup %u: lane %u is at %s (%s:%u:%u) while lane %u is at %s "
              "(%s:%u:%u)",
              sg.index, first->ctx.lane, op_name(first->ctx.op), first->ctx.file,
              first->ctx.line, first->ctx.column, l.ctx.lane, op_name(l.ctx.op), l.ctx.file,
              l.ctx.line, l.ctx.column);
      }
    }
    if (!live) break;
    if (first->ctx.op == Op::threadgroup_barrier) {
      if (live != all) {
        fatal("threadgroup_barrier (%s:%u) reached after some threads of simdgroup %u returned:"
              " undefined behaviour in Metal",
              first->ctx.file, first->ctx.line, sg.index);
      }
      tg.arrive(sg.index, first->ctx);
    } else {
      sg.shared.active_mask = live;
    }
  }
  tg.leave();
}

// ------------------------------------------------------------------------------------------
// Launch description
// ------------------------------------------------------------------------------------------
struct Launch {
  unsigned grid[3] = {1, 1, 1};
  unsigned tg[3] = {1, 1, 1};
  bool ordered = true;
  size_t tg_limit = kMaxThreadgroupMemory;  // "tg_limit N": another target's limit (CUDA)
  struct Buffer {
    bool output;
    bool in_place = false;  // "inout": an input the kernel writes through its pointer
    size_t nbytes;
    std::string path;
  };
  std::vector<Buffer> buffers;
};

Launch read_launch(const char* path) {
  std::ifstream in(path);
  if (!in) fatal("cannot read launch file %s", path);
  Launch L;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string key;
    ls >> key;
    if (key.empty() || key[0] == '#') continue;
    if (key == "grid") {
      ls >> L.grid[0] >> L.grid[1] >> L.grid[2];
    } else if (key == "threadgroup") {
      ls >> L.tg[0] >> L.tg[1] >> L.tg[2];
    } else if (key == "mode") {
      std::string m;
      ls >> m;
      if (m != "ordered" && m != "free") fatal("unknown mode %s", m.c_str());
      L.ordered = m == "ordered";
    } else if (key == "tg_limit") {
      ls >> L.tg_limit;
    } else if (key == "in" || key == "out" || key == "inout") {
      Launch::Buffer b;
      b.output = key == "out";
      b.in_place = key == "inout";
      ls >> b.nbytes;
      ls >> std::ws;
      std::getline(ls, b.path);
      L.buffers.push_back(b);
    } else {
      fatal("bad launch line: %s", line.c_str());
    }
  }
  return L;
}

void read_file(const std::string& path, char* dst, size_t n) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) fatal("cannot open %s", path.c_str());
  if (n && std::fread(dst, 1, n, f) != n) fatal("short read from %s", path.c_str());
  std::fclose(f);
}

void write_file(const std::string& path, const char* src, size_t n) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) fatal("cannot write %s", path.c_str());
  if (n && std::fwrite(src, 1, n, f) != n) fatal("short write to %s", path.c_str());
  std::fclose(f);
}

}  // namespace

void park(LaneContext*) {
  Simdgroup* sg = tls_sg;
  switch_context(sg->running->context, sg->scheduler);
}

int run_main(int argc, char** argv, LaneEntry entry, int num_buffers) {
  if (argc != 2) fatal("usage: %s LAUNCH_FILE", argv[0]);
  install_signal_handlers();
  const Launch L = read_launch(argv[1]);
  if (int(L.buffers.size()) != num_buffers) {
    fatal("the kernel takes %d buffers, the launch file gives %zu", num_buffers,
          L.buffers.size());
  }

  // Device buffers: guarded; inputs read-only but those written in place; outputs poisoned.
  g_regions.reserve(L.buffers.size());
  for (size_t i = 0; i < L.buffers.size(); ++i) {
    const auto& b = L.buffers[i];
    Region r = map_guarded(b.nbytes, 16);
    r.what = b.output ? "output buffer" : "input buffer";
    r.index = int(i);
    if (b.output) {
      std::memset(r.data, 0xFF, b.nbytes);
    } else {
      read_file(b.path, r.data, b.nbytes);
      if (!b.in_place) mprotect(r.map + kPage, r.map_size - 2 * kPage, PROT_READ);
    }
    g_regions.push_back(r);
    g_buffers.push_back(r.data);
  }

  char* tg_lo = __metal_emu_tg_start;
  char* tg_hi = __metal_emu_tg_end;
  const size_t tg_bytes = (tg_lo && tg_hi) ? size_t(tg_hi - tg_lo) : 0;
  if (tg_bytes > L.tg_limit) {
    fatal("the kernel declares %zu bytes of threadgroup memory; %s allow %zu", tg_bytes,
          L.tg_limit == kMaxThreadgroupMemory ? "Apple GPUs" : "the target's static limits",
          L.tg_limit);
  }

  // MLX: MTL::Size group_dims(min(tx, gx), min(ty, gy), min(tz, gz)); dispatchThreads(grid, ...)
  unsigned t[3], ng[3];
  for (int d = 0; d < 3; ++d) {
    if (L.grid[d] == 0 || L.tg[d] == 0) fatal("empty grid or threadgroup");
    t[d] = std::min(L.tg[d], L.grid[d]);
    ng[d] = (L.grid[d] + t[d] - 1) / t[d];
  }
  const unsigned req_threads = t[0] * t[1] * t[2];
  if (req_threads > kMaxThreadsPerThreadgroup) {
    fatal("%u threads per threadgroup; Metal allows at most %u", req_threads,
          kMaxThreadsPerThreadgroup);
  }
  const unsigned max_sg = (req_threads + kSimdWidth - 1) / kSimdWidth;
  for (unsigned i = g_stacks.size(); i < max_sg * kSimdWidth; ++i) {
    g_stacks.push_back(map_guarded(kStackSize, 16));
  }
  g_entry = entry;

  std::vector<std::unique_ptr<Simdgroup>> sgs;
  for (unsigned i = 0; i < max_sg; ++i) sgs.push_back(std::make_unique<Simdgroup>());

  unsigned long long group_id = 0;
  for (unsigned gz = 0; gz < ng[2]; ++gz) {
    for (unsigned gy = 0; gy < ng[1]; ++gy) {
      for (unsigned gx = 0; gx < ng[0]; ++gx, ++group_id) {
        const unsigned pos[3] = {gx, gy, gz};
        unsigned a[3];  // actual (non-uniform at the grid's edge) threadgroup size
        for (int d = 0; d < 3; ++d) a[d] = std::min(t[d], L.grid[d] - pos[d] * t[d]);
        const unsigned nthreads = a[0] * a[1] * a[2];
        const unsigned nsg = (nthreads + kSimdWidth - 1) / kSimdWidth;
        if (tg_bytes) std::memset(tg_lo, 0xFF, tg_bytes);

        for (unsigned s = 0; s < nsg; ++s) {
          Simdgroup& sg = *sgs[s];
          sg.index = s;
          sg.nlanes = std::min(kSimdWidth, int(nthreads - s * kSimdWidth));
          std::memset(&sg.shared, 0xFF, sizeof sg.shared);
        }
        for (unsigned tid = 0; tid < nthreads; ++tid) {
          const unsigned lx = tid % a[0], ly = (tid / a[0]) % a[1], lz = tid / (a[0] * a[1]);
          Simdgroup& sg = *sgs[tid / kSimdWidth];
          Lane& lane = sg.lanes[tid % kSimdWidth];
          lane = Lane{};
          lane.ctx.lane = tid % kSimdWidth;
          lane.ctx.shared = &sg.shared;
          LaneAttrs& at = lane.attrs;
          at.dispatch_quadgroups_per_threadgroup = (req_threads + 3) / 4;
          at.dispatch_simdgroups_per_threadgroup = max_sg;
          at.dispatch_threads_per_threadgroup = uint3(t[0], t[1], t[2]);
          at.grid_origin = uint3(0u);
          at.grid_size = uint3(L.grid[0], L.grid[1], L.grid[2]);
          at.quadgroup_index_in_threadgroup = tid / 4;
          at.quadgroups_per_threadgroup = (nthreads + 3) / 4;
          at.simdgroup_index_in_threadgroup = tid / kSimdWidth;
          at.simdgroups_per_threadgroup = nsg;
          at.thread_execution_width = kSimdWidth;
          at.thread_index_in_quadgroup = tid % 4;
          at.thread_index_in_simdgroup = tid % kSimdWidth;
          at.thread_index_in_threadgroup = tid;
          at.thread_position_in_grid =
              uint3(gx * t[0] + lx, gy * t[1] + ly, gz * t[2] + lz);
          at.thread_position_in_threadgroup = uint3(lx, ly, lz);
          at.threadgroup_position_in_grid = uint3(gx, gy, gz);
          at.threadgroups_per_grid = uint3(ng[0], ng[1], ng[2]);
          at.threads_per_grid = uint3(L.grid[0], L.grid[1], L.grid[2]);
          at.threads_per_simdgroup = kSimdWidth;
          at.threads_per_threadgroup = uint3(a[0], a[1], a[2]);
        }

        Threadgroup tg(nsg, L.ordered, (group_id & 1) != 0);
        std::vector<std::thread> threads;
        threads.reserve(nsg);
        for (unsigned s = 0; s < nsg; ++s) {
          threads.emplace_back([&tg, &sgs, s] { run_simdgroup(tg, *sgs[s]); });
        }
        for (auto& th : threads) th.join();
      }
    }
  }

  for (size_t i = 0; i < L.buffers.size(); ++i) {
    if (L.buffers[i].output || L.buffers[i].in_place) {
      write_file(L.buffers[i].path, g_regions[i].data, g_regions[i].size);
    }
  }
  return 0;
}

}  // namespace metal_emu
