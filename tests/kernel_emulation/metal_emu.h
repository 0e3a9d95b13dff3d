// metal_emu.h: run Metal compute-kernel source, exactly as mx.fast.metal_kernel generates it,
// on the CPU with g++ (C++20). Used by tests/kernel_emulation/generator.py.
//
// The generated translation unit is:
//     #include "metal_emu.h"                  (takes the place of MLX's metal::utils() preamble)
//     <header= text> <generated signature> { <kernel body> } <explicit instantiation>
//     <a lane-entry function + main() calling metal_emu::run_main>
// and is linked with the runtime object (metal_emu_runtime.cpp, compiled once per version).
//
// EXECUTION MODEL
// * Threadgroups run one at a time, in grid order (x fastest). Inside a threadgroup every
//   simdgroup is a real OS thread (std::thread); threadgroup_barrier is a real std::barrier
//   across those threads.
// * The 32 lanes of a simdgroup are fibers (own stacks, x86-64 assembly context switch, or
//   ucontext elsewhere) on their simdgroup's thread. A simd function (simd_sum, simd_shuffle...)
//   writes the lane's value to a per-simdgroup scratch slot, then waits at a per-simdgroup
//   barrier (a rendezvous of the lane fibers); after it, every lane reads the others' slots.
//   Measured on a 2-core machine: one simd op costs ~213 us with 32 OS threads per simdgroup
//   and a std::barrier; with fibers ~3 us (64 context switches), which is what makes a test
//   matrix over thousands of tokens possible.
// * Lanes run one after another between two synchronisation points (simd op, barrier, exit),
//   in lane order. Code that relies on implicit SIMD lockstep for threadgroup memory without a
//   simdgroup_barrier therefore fails here (Metal does not promise it either).
//
// RACE EXPOSURE (deterministic)
// * Threadgroup memory is poisoned (every byte 0xFF: NaN for float/half/bfloat, -1 for ints)
//   before each threadgroup. The poisoned range comes from a linker script (tg.ld) that gathers
//   the kernel's function-local statics (= its threadgroup arrays; kernels are compiled with
//   -fdata-sections so each has its own section) between two symbols; its size is checked
//   against the 32 KiB limit. (g++ may drop a threadgroup array that is never read across a
//   barrier: it cannot be shared then anyway.)
// * Ordered mode (default): between two threadgroup barriers, simdgroups run one at a time in
//   a fixed order, ascending on even threadgroups and descending on odd ones (a turnstile on
//   top of the real barrier). A read of another simdgroup's threadgroup-memory write that is not
//   separated from it by a threadgroup_barrier therefore sees poison (or the stale value) on
//   every run, in at least one of the two orders (so launch at least two threadgroups): a
//   missing barrier is caught deterministically. WAR races (overwriting before the others have
//   read) are exposed the same way.
// * Free mode: simdgroup threads run truly concurrently (for a probabilistic second opinion).
// * Output buffers are poisoned (0xFF) before the launch: elements a kernel forgets to write
//   read back as NaN. Input buffers are mapped read-only: writing one faults. Every device
//   buffer ends at a PROT_NONE guard page: reading past its end faults (reported with the
//   buffer's index); reads before the start are only caught when they leave the page.
//
// CHECKED (the run fails with "metal_emu: error: ..." on stderr and exit code 3)
// * the running lanes of a simdgroup reaching different simd functions or barriers (by source
//   location), and simdgroups waiting at different threadgroup_barrier calls. For barriers that
//   is undefined behaviour in Metal; for simd functions inside divergent branches Metal defines
//   the result over the active lanes, which this emulator does NOT model (it reports it):
//   kernels must call simd functions in simdgroup-uniform control flow (lanes that returned
//   are fine: they are inactive);
// * a threadgroup_barrier reached after some threads of the threadgroup returned;
// * more than 32 KiB of threadgroup memory, more than 1024 threads per threadgroup.
//
// MODELLED
// * address spaces: device and thread (empty qualifiers); constant = `volatile`, so that, as
//   on Metal, a constant-space pointer does not convert to a device (or thread) pointer: code
//   that stores a small input (MLX passes inputs of fewer than 8 elements in `constant`) in a
//   `const device T*` fails to compile here too. Program-scope `constexpr constant` variables
//   are not supported (write `constexpr`). threadgroup: function-scope arrays only
//   (`threadgroup float buf[N];` becomes a static array shared by the threads of the running
//   threadgroup); `threadgroup T*` pointers and threadgroup kernel arguments are NOT supported
//   (they do not compile here).
// * types: half / float16_t (_Float16), bfloat / bfloat16_t (round-to-nearest-even), uint,
//   ushort, uchar, vector types {float,half,int,uint,short,ushort}{2,3,4} with .x .y .z .w,
//   elementwise arithmetic.
// * all attributes MLX can pass (thread_position_in_grid, threadgroup_position_in_grid,
//   thread_index_in_simdgroup, simdgroup_index_in_threadgroup, threads_per_threadgroup, ...),
//   including non-uniform edge threadgroups of dispatchThreads.
// * simd_sum, simd_product, simd_max, simd_min, simd_and, simd_or, simd_xor,
//   simd_prefix_inclusive_sum, simd_prefix_exclusive_sum, simd_shuffle, simd_broadcast,
//   simd_shuffle_up, simd_shuffle_down, simd_shuffle_xor, simd_broadcast_first, simd_all,
//   simd_any, simd_is_first; over the lanes still running (lanes that returned are inactive).
//   Reading an inactive lane (simd_shuffle from it) returns poison.
// * threadgroup_barrier, simdgroup_barrier; metal:: math (exp, exp2, log, sqrt, rsqrt, max, min,
//   fma, clamp, abs, select, ...), metal::fast:: and metal::precise:: (all computed precisely).
//
// NOT MODELLED
// * the device -> constant direction of address-space mismatches, and threadgroup/thread
//   mismatches, compile here but not on Metal: only the Metal compiler (a Mac) checks them
//   (declare pointers derived from kernel arguments `auto`);
// * memory-flag scopes (every barrier orders all memory), atomics, textures, quad-group and
//   simdgroup-matrix functions (using them does not compile here), function constants;
// * races between threadgroups (they run one at a time), device-memory coherence, GPU timing;
// * fast-math behaviour (MLX may compile with relaxed math): exp/log are precise here;
// * half arithmetic precision: expressions on half may be evaluated in float by g++.
// Performance and occupancy can only be measured on a Mac.

#ifndef METAL_EMU_H
#define METAL_EMU_H

#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <source_location>
#include <type_traits>

#define METAL_FUNC inline
#define METAL_EMU 1

// ---------------------------------------------------------------------------------------------
// Scalar types
// ---------------------------------------------------------------------------------------------
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef _Float16 half;
typedef half float16_t;

struct bfloat {
  uint16_t bits_;
  bfloat() = default;
  template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
  bfloat(T v) : bits_(from_float(static_cast<float>(v))) {}
  bfloat(half v) : bits_(from_float(static_cast<float>(v))) {}
  operator float() const {
    uint32_t u = uint32_t(bits_) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  operator float() const volatile {  // a bfloat in `constant` memory (see below)
    uint32_t u = uint32_t(bits_) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);                    // round to nearest even
    return uint16_t(u >> 16);
  }
};
typedef bfloat bfloat16_t;

inline bfloat operator-(bfloat a) { return bfloat(-float(a)); }
#define METAL_EMU_BF_OP(op)                                                               \
  inline bfloat operator op(bfloat a, bfloat b) { return bfloat(float(a) op float(b)); } \
  template <typename U, typename = std::enable_if_t<std::is_arithmetic_v<U>>>            \
  inline float operator op(bfloat a, U b) { return float(a) op float(b); }               \
  template <typename U, typename = std::enable_if_t<std::is_arithmetic_v<U>>>            \
  inline float operator op(U a, bfloat b) { return float(a) op float(b); }               \
  inline bfloat& operator op##=(bfloat & a, bfloat b) { return a = a op b; }
METAL_EMU_BF_OP(+)
METAL_EMU_BF_OP(-)
METAL_EMU_BF_OP(*)
METAL_EMU_BF_OP(/)
#undef METAL_EMU_BF_OP
#define METAL_EMU_BF_CMP(op) \
  inline bool operator op(bfloat a, bfloat b) { return float(a) op float(b); }
METAL_EMU_BF_CMP(<)
METAL_EMU_BF_CMP(>)
METAL_EMU_BF_CMP(<=)
METAL_EMU_BF_CMP(>=)
METAL_EMU_BF_CMP(==)
METAL_EMU_BF_CMP(!=)
#undef METAL_EMU_BF_CMP

// ---------------------------------------------------------------------------------------------
// Vector types
// ---------------------------------------------------------------------------------------------
namespace metal_emu {
template <typename T, int N>
struct vec;

#define METAL_EMU_VEC_COMMON(N)                                                              \
  T& operator[](int i) { return (&x)[i]; }                                                  \
  const T& operator[](int i) const { return (&x)[i]; }                                      \
  template <typename U>                                                                     \
  explicit vec(const vec<U, N>& o) {                                                        \
    for (int i = 0; i < N; ++i) (*this)[i] = static_cast<T>(o[i]);                          \
  }
template <typename T>
struct vec<T, 2> {
  T x, y;
  vec() = default;
  vec(T s) : x(s), y(s) {}
  vec(T a, T b) : x(a), y(b) {}
  METAL_EMU_VEC_COMMON(2)
};
template <typename T>
struct vec<T, 3> {
  T x, y, z;
  vec() = default;
  vec(T s) : x(s), y(s), z(s) {}
  vec(T a, T b, T c) : x(a), y(b), z(c) {}
  METAL_EMU_VEC_COMMON(3)
};
template <typename T>
struct vec<T, 4> {
  T x, y, z, w;
  vec() = default;
  vec(T s) : x(s), y(s), z(s), w(s) {}
  vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  METAL_EMU_VEC_COMMON(4)
};
#undef METAL_EMU_VEC_COMMON

#define METAL_EMU_VEC_OP(op)                                                      \
  template <typename T, int N>                                                    \
  vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {                 \
    vec<T, N> r;                                                                  \
    for (int i = 0; i < N; ++i) r[i] = a[i] op b[i];                              \
    return r;                                                                     \
  }                                                                               \
  template <typename T, int N>                                                    \
  vec<T, N> operator op(const vec<T, N>& a, T b) {                                \
    return a op vec<T, N>(b);                                                     \
  }                                                                               \
  template <typename T, int N>                                                    \
  vec<T, N> operator op(T a, const vec<T, N>& b) {                                \
    return vec<T, N>(a) op b;                                                     \
  }                                                                               \
  template <typename T, int N>                                                    \
  vec<T, N>& operator op##=(vec<T, N>& a, const vec<T, N>& b) {                   \
    return a = a op b;                                                            \
  }
METAL_EMU_VEC_OP(+)
METAL_EMU_VEC_OP(-)
METAL_EMU_VEC_OP(*)
METAL_EMU_VEC_OP(/)
#undef METAL_EMU_VEC_OP
}  // namespace metal_emu

#define METAL_EMU_VEC_TYPES(base, T) \
  typedef metal_emu::vec<T, 2> base##2;  \
  typedef metal_emu::vec<T, 3> base##3;  \
  typedef metal_emu::vec<T, 4> base##4;
METAL_EMU_VEC_TYPES(float, float)
METAL_EMU_VEC_TYPES(half, half)
METAL_EMU_VEC_TYPES(int, int)
METAL_EMU_VEC_TYPES(uint, uint)
METAL_EMU_VEC_TYPES(short, short)
METAL_EMU_VEC_TYPES(ushort, ushort)
#undef METAL_EMU_VEC_TYPES

// ---------------------------------------------------------------------------------------------
// Runtime interface used by the inline functions below (implemented further down, compiled
// once into the runtime object).
// ---------------------------------------------------------------------------------------------
namespace metal_emu {

enum class Op : int {
  none = 0,
  sum, product, max, min, and_, or_, xor_, prefix_incl, prefix_excl,
  shuffle, shuffle_up, shuffle_down, shuffle_xor, broadcast_first, all, any, is_first,
  simdgroup_barrier, threadgroup_barrier, exit,
};
const char* op_name(Op op);

constexpr int kSimdWidth = 32;
constexpr int kSlotBytes = 32;

struct SimdShared {
  alignas(16) unsigned char slot[2][kSimdWidth][kSlotBytes];  // double-buffered lane values
  alignas(16) unsigned char result[2][kSlotBytes];  // a uniform result, computed once per op
  unsigned long long result_op[2];                  // which op `result` belongs to (+1)
  uint32_t active_mask;  // lanes taking part in the collective just completed
};

struct LaneContext {
  unsigned lane;
  unsigned long long ops;  // collectives done by this lane (selects the scratch buffer)
  SimdShared* shared;
  Op op;                   // what the lane is parked at
  const char* file;
  unsigned line;
  unsigned column;
  const void* user;        // front-end data of the lane (cuda_emu.h: its LaneAttrs)
};

extern thread_local LaneContext* tls_lane;
void park(LaneContext* lane);  // switch to the simdgroup scheduler until the collective completes

struct LaneAttrs {
  uint dispatch_quadgroups_per_threadgroup;
  uint dispatch_simdgroups_per_threadgroup;
  uint3 dispatch_threads_per_threadgroup;
  uint3 grid_origin;
  uint3 grid_size;
  uint quadgroup_index_in_threadgroup;
  uint quadgroups_per_threadgroup;
  uint simdgroup_index_in_threadgroup;
  uint simdgroups_per_threadgroup;
  uint thread_execution_width;
  uint thread_index_in_quadgroup;
  uint thread_index_in_simdgroup;
  uint thread_index_in_threadgroup;
  uint3 thread_position_in_grid;
  uint3 thread_position_in_threadgroup;
  uint3 threadgroup_position_in_grid;
  uint3 threadgroups_per_grid;
  uint3 threads_per_grid;
  uint threads_per_simdgroup;
  uint3 threads_per_threadgroup;
};

using LaneEntry = void (*)(void* const* buffers, const LaneAttrs& attrs);
int run_main(int argc, char** argv, LaneEntry entry, int num_buffers);

inline void compiler_fence() {
#if defined(__GNUC__)
  asm volatile("" ::: "memory");
#endif
}

// One collective: publish this lane's value, wait for the simdgroup, then `finish` reads the
// published values of the active lanes (same order on every lane: identical results).
template <typename T, typename F>
inline T collective(const T& x, Op op, const std::source_location& loc, F&& finish) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= kSlotBytes,
                "simd function on an unsupported type");
  LaneContext* L = tls_lane;
  const unsigned buf = unsigned(L->ops & 1);
  std::memcpy(L->shared->slot[buf][L->lane], &x, sizeof(T));
  L->op = op;
  L->file = loc.file_name();
  L->line = loc.line();
  L->column = loc.column();
  compiler_fence();
  park(L);
  compiler_fence();
  const unsigned long long op_index = L->ops++;
  if constexpr (std::is_invocable_v<F, const unsigned char (*)[kSlotBytes], uint32_t>) {
    // Uniform result (a reduction): the first lane to resume computes it for all.
    SimdShared& sh = *L->shared;
    T r;
    if (sh.result_op[buf] == op_index + 1) {
      std::memcpy(static_cast<void*>(&r), sh.result[buf], sizeof(T));
    } else {
      r = finish(sh.slot[buf], sh.active_mask);
      std::memcpy(sh.result[buf], &r, sizeof(T));
      sh.result_op[buf] = op_index + 1;
    }
    return r;
  } else {
    return finish(L->shared->slot[buf], L->shared->active_mask, L->lane);
  }
}

template <typename T>
inline T slot_value(const unsigned char (*slots)[kSlotBytes], unsigned lane) {
  T v;
  std::memcpy(&v, slots[lane], sizeof(T));
  return v;
}

template <typename T>
inline T poison_value() {
  T v;
  std::memset(static_cast<void*>(&v), 0xFF, sizeof(T));
  return v;
}

template <typename T, typename Combine>
inline T reduce_active(const unsigned char (*slots)[kSlotBytes], uint32_t mask, unsigned upto,
                       Combine&& combine) {
  T acc{};
  bool first = true;
  for (unsigned i = 0; i < upto; ++i) {
    if (!(mask >> i & 1u)) continue;
    T v = slot_value<T>(slots, i);
    acc = first ? v : combine(acc, v);
    first = false;
  }
  return acc;
}

inline void barrier_park(Op op, const std::source_location& loc) {
  LaneContext* L = tls_lane;
  L->op = op;
  L->file = loc.file_name();
  L->line = loc.line();
  L->column = loc.column();
  compiler_fence();
  park(L);
  compiler_fence();
}

}  // namespace metal_emu

// ---------------------------------------------------------------------------------------------
// The metal namespace (MLX's preamble does `using namespace metal;`)
// ---------------------------------------------------------------------------------------------
namespace metal {

template <typename T>
using numeric_limits = std::numeric_limits<T>;

enum class mem_flags : int {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

inline void threadgroup_barrier(mem_flags, std::source_location loc =
                                               std::source_location::current()) {
  metal_emu::barrier_park(metal_emu::Op::threadgroup_barrier, loc);
}
inline void simdgroup_barrier(mem_flags, std::source_location loc =
                                             std::source_location::current()) {
  metal_emu::barrier_park(metal_emu::Op::simdgroup_barrier, loc);
}

template <typename T>
T as_type_impl(const void* p) {
  T r;
  std::memcpy(static_cast<void*>(&r), p, sizeof(T));
  return r;
}
template <typename T, typename U>
T as_type(const U& u) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs equal sizes");
  return as_type_impl<T>(&u);
}

// ---- math (float computations; half and bfloat go through float) ----
#define METAL_EMU_UNARY(name, expr)                                              \
  inline float name(float x) { return expr; }                                    \
  inline half name(half h) {                                                     \
    float x = float(h);                                                          \
    return half(expr);                                                           \
  }                                                                              \
  inline bfloat name(bfloat b) {                                                 \
    float x = float(b);                                                          \
    return bfloat(expr);                                                         \
  }
METAL_EMU_UNARY(exp, std::exp(x))
METAL_EMU_UNARY(exp2, std::exp2(x))
METAL_EMU_UNARY(log, std::log(x))
METAL_EMU_UNARY(log2, std::log2(x))
METAL_EMU_UNARY(sqrt, std::sqrt(x))
METAL_EMU_UNARY(rsqrt, 1.0f / std::sqrt(x))
METAL_EMU_UNARY(fabs, std::fabs(x))
METAL_EMU_UNARY(floor, std::floor(x))
METAL_EMU_UNARY(ceil, std::ceil(x))
METAL_EMU_UNARY(round, std::round(x))
METAL_EMU_UNARY(trunc, std::trunc(x))
METAL_EMU_UNARY(tanh, std::tanh(x))
METAL_EMU_UNARY(sin, std::sin(x))
METAL_EMU_UNARY(cos, std::cos(x))
#undef METAL_EMU_UNARY
inline float pow(float a, float b) { return std::pow(a, b); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isfinite(float x) { return std::isfinite(x); }

template <typename T>
inline T max(T a, T b) {
  return a > b ? a : b;
}
template <typename T>
inline T min(T a, T b) {
  return a < b ? a : b;
}
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
template <typename T>
inline T abs(T a) {
  return a < T(0) ? T(-a) : a;
}
template <typename T>
inline T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
template <typename T>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}
template <typename T, int N>
inline metal_emu::vec<T, N> max(const metal_emu::vec<T, N>& a, const metal_emu::vec<T, N>& b) {
  metal_emu::vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = max(a[i], b[i]);
  return r;
}
template <typename T, int N>
inline metal_emu::vec<T, N> min(const metal_emu::vec<T, N>& a, const metal_emu::vec<T, N>& b) {
  metal_emu::vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = min(a[i], b[i]);
  return r;
}
template <typename T, int N>
inline T dot(const metal_emu::vec<T, N>& a, const metal_emu::vec<T, N>& b) {
  T r = a[0] * b[0];
  for (int i = 1; i < N; ++i) r += a[i] * b[i];
  return r;
}

namespace fast {
using metal::cos;
using metal::exp;
using metal::exp2;
using metal::log;
using metal::log2;
using metal::max;
using metal::min;
using metal::pow;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
using metal::tanh;
}  // namespace fast
namespace precise {
using metal::cos;
using metal::exp;
using metal::exp2;
using metal::log;
using metal::log2;
using metal::max;
using metal::min;
using metal::pow;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
using metal::tanh;
}  // namespace precise

// ---- simdgroup functions ----
#define METAL_EMU_LOC std::source_location loc = std::source_location::current()

template <typename T>
T simd_sum(T x, METAL_EMU_LOC) {
  return metal_emu::collective(x, metal_emu::Op::sum, loc, [](auto s, uint32_t m) {
    return metal_emu::reduce_active<T>(s, m, 32, [](T a, T b) { return T(a + b); });
  });
}
template <typename T>
T simd_product(T x, METAL_EMU_LOC) {
  return metal_emu::collective(x, metal_emu::Op::product, loc, [](auto s, uint32_t m) {
    return metal_emu::reduce_active<T>(s, m, 32, [](T a, T b) { return T(a * b); });
  });
}
template <typename T>
T simd_max(T x, METAL_EMU_LOC) {
  return metal_emu::collective(x, metal_emu::Op::max, loc, [](auto s, uint32_t m) {
    return metal_emu::reduce_active<T>(s, m, 32, [](T a, T b) { return metal::max(a, b); });
  });
}
template <typename T>
T simd_min(T x, METAL_EMU_LOC) {
  return metal_emu::collective(x, metal_emu::Op::min, loc, [](auto s, uint32_t m) {
    return metal_emu::reduce_active<T>(s, m, 32, [](T a, T b) { return metal::min(a, b); });
  });
}
template <typename T>
T simd_and(T x, METAL_EMU_LOC) {
  return metal_emu::collective(x, metal_emu::Op::and_, loc, [](auto s, uint32_t m) {
    return metal_emu::reduce_active<T>(s, m, 32, [](T a, T b) { return T(a & b); });
  });
}
template <typename T>
T simd_or(T x, METAL_EMU_LOC) {
  return metal_emu::collective(x, metal_emu::Op::or_, loc, [](auto s, uint32_t m) {
    return metal_emu::reduce_active<T>(s, m, 32, [](T a, T b) { return T(a | b); });
  });
}
template <typename T>
T simd_xor(T x, METAL_EMU_LOC) {
  return metal_emu::collective(x, metal_emu::Op::xor_, loc, [](auto s, uint32_t m) {
    return metal_emu::reduce_active<T>(s, m, 32, [](T a, T b) { return T(a ^ b); });
  });
}
template <typename T>
T simd_prefix_inclusive_sum(T x, METAL_EMU_LOC) {
  return metal_emu::collective(x, metal_emu::Op::prefix_incl, loc,
                               [](auto s, uint32_t m, unsigned lane) {
    return metal_emu::reduce_active<T>(s, m, lane + 1, [](T a, T b) { return T(a + b); });
  });
}
template <typename T>
T simd_prefix_exclusive_sum(T x, METAL_EMU_LOC) {
  return metal_emu::collective(x, metal_emu::Op::prefix_excl, loc,
                               [](auto s, uint32_t m, unsigned lane) {
    return metal_emu::reduce_active<T>(s, m, lane, [](T a, T b) { return T(a + b); });
  });
}

namespace detail {
template <typename T>
T read_lane(const unsigned char (*s)[metal_emu::kSlotBytes], uint32_t mask, unsigned src) {
  if (src >= 32 || !(mask >> src & 1u)) return metal_emu::poison_value<T>();
  return metal_emu::slot_value<T>(s, src);
}
}  // namespace detail

template <typename T>
T simd_shuffle(T x, ushort src_lane, METAL_EMU_LOC) {
  return metal_emu::collective(x, metal_emu::Op::shuffle, loc,
                               [src_lane](auto s, uint32_t m, unsigned) {
    return detail::read_lane<T>(s, m, src_lane);
  });
}
template <typename T>
T simd_broadcast(T x, ushort src_lane, METAL_EMU_LOC) {
  return simd_shuffle(x, src_lane, loc);
}
template <typename T>
T simd_shuffle_down(T x, ushort delta, METAL_EMU_LOC) {
  return metal_emu::collective(x, metal_emu::Op::shuffle_down, loc,
                               [delta](auto s, uint32_t m, unsigned lane) {
    const unsigned src = lane + delta;
    return src >= 32 ? metal_emu::slot_value<T>(s, lane) : detail::read_lane<T>(s, m, src);
  });
}
template <typename T>
T simd_shuffle_up(T x, ushort delta, METAL_EMU_LOC) {
  return metal_emu::collective(x, metal_emu::Op::shuffle_up, loc,
                               [delta](auto s, uint32_t m, unsigned lane) {
    return lane < delta ? metal_emu::slot_value<T>(s, lane)
                        : detail::read_lane<T>(s, m, lane - delta);
  });
}
template <typename T>
T simd_shuffle_xor(T x, ushort mask_bits, METAL_EMU_LOC) {
  return metal_emu::collective(x, metal_emu::Op::shuffle_xor, loc,
                               [mask_bits](auto s, uint32_t m, unsigned lane) {
    return detail::read_lane<T>(s, m, lane ^ mask_bits);
  });
}
template <typename T>
T simd_broadcast_first(T x, METAL_EMU_LOC) {
  return metal_emu::collective(x, metal_emu::Op::broadcast_first, loc,
                               [](auto s, uint32_t m) {
    return detail::read_lane<T>(s, m, unsigned(__builtin_ctz(m)));
  });
}
inline bool simd_all(bool x, METAL_EMU_LOC) {
  return metal_emu::collective(x, metal_emu::Op::all, loc, [](auto s, uint32_t m) {
    return metal_emu::reduce_active<bool>(s, m, 32, [](bool a, bool b) { return a && b; });
  });
}
inline bool simd_any(bool x, METAL_EMU_LOC) {
  return metal_emu::collective(x, metal_emu::Op::any, loc, [](auto s, uint32_t m) {
    return metal_emu::reduce_active<bool>(s, m, 32, [](bool a, bool b) { return a || b; });
  });
}
inline bool simd_is_first(METAL_EMU_LOC) {
  return metal_emu::collective(true, metal_emu::Op::is_first, loc,
                               [](auto, uint32_t m, unsigned lane) {
    return lane == unsigned(__builtin_ctz(m));
  });
}
#undef METAL_EMU_LOC

}  // namespace metal

using namespace metal;

// ---------------------------------------------------------------------------------------------
// Metal address-space keywords. Last, so that nothing above (nor the runtime) sees them.
// ---------------------------------------------------------------------------------------------
#define device
#define constant volatile
#define thread
#define threadgroup static

#endif  // METAL_EMU_H
