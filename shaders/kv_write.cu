// The 8-bit pool's write on NVIDIA GPUs (issue #26), in the form mx.fast.cuda_kernel takes (a
// kernel BODY under its "// ==== kernel: NAME ====" line; engine/attention/kv_quantize.py
// splits the file as engine/attention/plans.py does the attention kernels'). The text before
// the first marker is not compiled. The CPU emulation harness (tests/kernel_emulation/
// cuda_emu.h) compiles the same text, so every CI run executes it.
//
// Why a kernel: engine/kv/int8.py's quantizer is a dozen MLX ops for K and again for V, each a
// kernel launch in every layer of every step; measured on an H100 (scripts/gpu/kv_write_cost.py,
// 8B shape, 64 rows, 32 layers) a step's 8-bit writes cost 5.2 ms against 0.67 ms for a bf16
// pool's two scatters. This kernel quantizes a step's K and V rows of one layer in one launch;
// the four scatters into the pool stay MLX's (in place).
//
// The arithmetic is engine/kv/int8.py's, operation for operation: s = min(max|x| / 127, 65504)
// in fp32 (IEEE division, __fdiv_rn, whatever the compiler's fast-math setting), rounded to
// fp16 (nearest even); q = rint(x / s) (IEEE division, half to even) clipped to [-127, 127];
// s == 0 stores zeros. One difference, on input the engine never writes: a NaN element is
// skipped by fmaxf where MLX's max propagates it.

// ==== header ====
#ifndef CUDA_EMU  // MLX's default header includes them already; the emulator defines the types
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif
__device__ __forceinline__ float kq_f32(float x) { return x; }
__device__ __forceinline__ float kq_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float kq_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

// ==== kernel: kv_quantize ====
// keys, values [rows, kv_heads, D] of type T (row-major) -> k_q, v_q int8 [rows, kv_heads, D]
// and k_scales, v_scales __half [rows, kv_heads]. One warp per (row, KV head) of K, then one
// per (row, KV head) of V: lane l holds elements l, l + 32, ... of the head; max|x| is a
// __shfl_xor_sync butterfly. The grid is 32 threads per warp-item (rounded up to whole blocks
// by MLX); warps past the last item return whole.
constexpr int PER_LANE = (D + 31) / 32;
const uint32_t lane = threadIdx.x & 31u;
const uint32_t item = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
const uint32_t head_rows = uint32_t(keys_shape[0]) * uint32_t(keys_shape[1]);
if (item >= 2u * head_rows) {
  return;
}
const bool is_v = item >= head_rows;
const uint32_t r = is_v ? item - head_rows : item;
const T* src = (is_v ? values : keys) + size_t(r) * D;
float x[PER_LANE];
float amax = 0.0f;
#pragma unroll
for (int j = 0; j < PER_LANE; ++j) {
  const int i = int(lane) + 32 * j;
  x[j] = i < D ? kq_f32(src[i]) : 0.0f;
  amax = fmaxf(amax, fabsf(x[j]));
}
#pragma unroll
for (int m = 16; m > 0; m >>= 1) {
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
}
const __half s16 = __float2half(fminf(__fdiv_rn(amax, 127.0f), 65504.0f));
const float s = __half2float(s16);
const float d = s > 0.0f ? s : 1.0f;
int8_t* q = (is_v ? v_q : k_q) + size_t(r) * D;
#pragma unroll
for (int j = 0; j < PER_LANE; ++j) {
  const int i = int(lane) + 32 * j;
  if (i < D) {
    q[i] = int8_t(fminf(fmaxf(rintf(__fdiv_rn(x[j], d)), -127.0f), 127.0f));
  }
}
if (lane == 0) {
  (is_v ? v_scales : k_scales)[r] = s16;
}
