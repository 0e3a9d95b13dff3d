// cuda_emu.h: run CUDA kernel source, exactly as mx.fast.cuda_kernel generates it, on the CPU
// with g++ (C++20). The CUDA front end of the emulator in metal_emu.h: it reuses that
// runtime's execution model unchanged (see metal_emu.h), with CUDA's names for it:
//
//   thread block = threadgroup, warp = simdgroup (32 lanes, the fibers of one OS thread),
//   threadIdx / blockIdx / blockDim / gridDim = thread_position_in_threadgroup /
//   threadgroup_position_in_grid / threads_per_threadgroup / threadgroups_per_grid,
//   __syncthreads() = threadgroup_barrier (a real barrier over the block's warps; warps run
//   one at a time between barriers, ascending on even blocks and descending on odd ones, so a
//   missing __syncthreads is caught on every run), __shared__ = function-local statics that the
//   runtime poisons (0xFF: NaN) before every block, __shfl_*_sync = the simd shuffles (a lane
//   that returned reads as poison; lanes reaching different shuffles are reported).
//
// The generated translation unit is:
//     #include "cuda_emu.h"            (in place of MLX's default header: utils.cuh, cg)
//     <header= text> namespace mlx::core::cu { __global__ void custom_kernel_...(...) {
//       constexpr template values; <body> } }
//     <a lane-entry function + main() calling metal_emu::run_main>
// MLX launches ceil(grid / block) blocks of full size (no non-uniform edge blocks as on
// Metal): the generator rounds the grid up the same way.
//
// NOT MODELLED (beyond metal_emu.h's list): the shuffle mask (every call must be made by the
// whole warp in uniform control flow, which is what the kernels here do); warp-synchronous
// programming without __syncwarp; atomics, cooperative-groups objects; the precision of
// __expf and other fast intrinsics (computed precisely); occupancy and timing. Tensor cores:
// only mma.sync m16n8k16 with fp16 inputs and fp32 accumulation, as
// cuda_emu_mma_m16n8k16_f32_f16 (the kernel's inline PTX has no host form): one collective of
// the warp with the PTX ISA's fragment layout; products exact, each output's sum of 16
// products plus its accumulator computed in double and rounded once (the hardware's
// accumulation order and truncation are not modelled).
#ifndef CUDA_EMU_H
#define CUDA_EMU_H

#include "metal_emu.h"

// metal_emu.h's address-space keywords are Metal's, not CUDA's.
#undef device
#undef constant
#undef thread
#undef threadgroup

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <unistd.h>
#include <source_location>

#define CUDA_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __shared__ static
#define __grid_constant__
#define __restrict__ __restrict
#define __launch_bounds__(...)

typedef _Float16 __half;
typedef bfloat __nv_bfloat16;

namespace cooperative_groups {}

namespace mlx::core::cu {
// MLX: cuda::std::array<int32_t, MAX_NDIM> / <int64_t, MAX_NDIM> passed by value; here the
// runtime's shape and stride buffers (indexing is the same).
typedef const int32_t* Shape;
typedef const int64_t* Strides;
}  // namespace mlx::core::cu

namespace cuda_emu {
inline const metal_emu::LaneAttrs& attrs() {
  return *static_cast<const metal_emu::LaneAttrs*>(metal_emu::tls_lane->user);
}
}  // namespace cuda_emu

#define threadIdx (::cuda_emu::attrs().thread_position_in_threadgroup)
#define blockIdx (::cuda_emu::attrs().threadgroup_position_in_grid)
#define blockDim (::cuda_emu::attrs().threads_per_threadgroup)
#define gridDim (::cuda_emu::attrs().threadgroups_per_grid)
#define warpSize 32

#define CUDA_EMU_LOC std::source_location loc = std::source_location::current()

inline void __syncthreads(CUDA_EMU_LOC) {
  metal_emu::barrier_park(metal_emu::Op::threadgroup_barrier, loc);
}
inline void __syncwarp(unsigned = 0xffffffffu, CUDA_EMU_LOC) {
  metal_emu::barrier_park(metal_emu::Op::simdgroup_barrier, loc);
}

template <typename T>
T __shfl_sync(unsigned, T v, int src_lane, int width = 32, CUDA_EMU_LOC) {
  static_assert(sizeof(T) <= metal_emu::kSlotBytes);
  (void)width;
  return metal::simd_shuffle(v, ushort(src_lane & 31), loc);
}
template <typename T>
T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32, CUDA_EMU_LOC) {
  (void)width;
  return metal::simd_shuffle_xor(v, ushort(lane_mask & 31), loc);
}
template <typename T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32, CUDA_EMU_LOC) {
  (void)width;
  return metal::simd_shuffle_down(v, ushort(delta), loc);
}
template <typename T>
T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32, CUDA_EMU_LOC) {
  (void)width;
  return metal::simd_shuffle_up(v, ushort(delta), loc);
}
#undef CUDA_EMU_LOC

// ---- conversions and math intrinsics (computed precisely) ----
inline float __half2float(__half x) { return float(x); }
inline __half __float2half(float x) { return __half(x); }
inline float __bfloat162float(__nv_bfloat16 x) { return float(x); }
inline __nv_bfloat16 __float2bfloat16(float x) { return __nv_bfloat16(x); }  // nearest even
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __fdiv_rn(float a, float b) { return a / b; }  // IEEE division
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// Bit casts and PRMT: result byte n = byte ((s >> 4n) & 7) of the 8 bytes {y, x} (x low).
inline float __uint_as_float(unsigned x) {
  float f;
  std::memcpy(&f, &x, sizeof(f));
  return f;
}
inline float __int_as_float(int x) { return __uint_as_float(unsigned(x)); }
inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t bytes = (uint64_t(y) << 32) | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) {
    r |= unsigned((bytes >> (8 * ((s >> (4 * n)) & 7u))) & 0xFFu) << (8 * n);
  }
  return r;
}


// ---- fp16 pairs (__half2: .x in the low 16 bits, as in cuda_fp16.h) ----
struct __half2 {
  __half x, y;
};
inline __half2 __floats2half2_rn(float lo, float hi) { return {__half(lo), __half(hi)}; }
inline __half2 __hsub2(__half2 a, __half2 b) { return {__half(a.x - b.x), __half(a.y - b.y)}; }

// ---- mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: d = A B + d over the warp ----
// Lane 4 g + t holds (fp16 pairs, low half first): a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1],
// a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9]; b[0] = B[2t, 2t+1][g], b[1] =
// B[2t+8, 2t+9][g]; d[0], d[1] = D[g][2t, 2t+1], d[2], d[3] = D[g+8][2t, 2t+1].
struct CudaEmuMmaFragments {
  uint32_t a[4];
  uint32_t b[2];
};
inline float cuda_emu_half_of(uint32_t pair, int hi) {
  const uint16_t bits = uint16_t(hi ? pair >> 16 : pair & 0xFFFFu);
  __half h;
  std::memcpy(&h, &bits, sizeof(h));
  return float(h);
}
inline void cuda_emu_mma_m16n8k16_f32_f16(float (&d)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2],
                                          std::source_location loc =
                                              std::source_location::current()) {
  CudaEmuMmaFragments mine;
  std::memcpy(mine.a, a, sizeof(mine.a));
  std::memcpy(mine.b, b, sizeof(mine.b));
  struct Out {
    float d[4];
    uint32_t pad[2];
  };
  static_assert(sizeof(Out) == sizeof(CudaEmuMmaFragments));
  const CudaEmuMmaFragments got = metal_emu::collective(
      mine, metal_emu::Op::shuffle, loc,
      [&d, &loc](auto s, uint32_t mask, unsigned lane) {
        if (mask != 0xFFFFFFFFu) {
          std::fprintf(stderr, "metal_emu: error: mma.sync at %s:%u with inactive lanes (the "
                       "whole warp must take part)\n", loc.file_name(), unsigned(loc.line()));
          std::fflush(stderr);
          _exit(3);
        }
        auto frag = [&](unsigned src) {
          return metal_emu::slot_value<CudaEmuMmaFragments>(s, src);
        };
        // A[row][k] and B[k][col] from the lanes holding them.
        auto A = [&](int row, int k) {
          const int gl = row & 7, reg = (row >> 3) + 2 * (k >> 3), tl = (k & 7) >> 1;
          return cuda_emu_half_of(frag(unsigned(4 * gl + tl)).a[reg], k & 1);
        };
        auto B = [&](int k, int col) {
          const int reg = k >> 3, tl = (k & 7) >> 1;
          return cuda_emu_half_of(frag(unsigned(4 * col + tl)).b[reg], k & 1);
        };
        const int g = int(lane >> 2), t = int(lane & 3);
        Out o{};
        for (int i = 0; i < 4; ++i) {
          const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
          double acc = d[i];
          for (int k = 0; k < 16; ++k) {
            acc += double(A(row, k)) * double(B(k, col));
          }
          o.d[i] = float(acc);
        }
        CudaEmuMmaFragments r;
        std::memcpy(&r, &o, sizeof(r));
        return r;
      });
  std::memcpy(d, &got, sizeof(d));
}

#endif  // CUDA_EMU_H
