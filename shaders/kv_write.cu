// The pool's K/V writes on NVIDIA GPUs, in the form mx.fast.cuda_kernel takes (a kernel BODY
// under its "// ==== kernel: NAME ====" line; engine/attention/kv_write.py splits the file as
// engine/attention/plans.py does the attention kernels'). The text before the first marker is
// not compiled. The CPU emulation harness (tests/kernel_emulation/cuda_emu.h) compiles the same
// text, so every CI run executes it.
//
// Two kinds of kernel:
// * kv_store / kv_store_q8 (the engine's write on CUDA's kernel path): a layer's K and V rows
//   go straight into their slots of the pool, IN PLACE, in one launch; the 8-bit variant
//   quantizes them on the way. MLX's kernels cannot name an output that aliases an input, so
//   these write through the pointers of their pool inputs (const_cast), as the CPU kernel does
//   through ctypes (engine/attention/cpu_kernel.py). What keeps that sound is in
//   engine/attention/kv_write.py: every pool array is row-contiguous (so MLX hands the
//   kernel the pool's own buffer, never a copy), and the layer's attention kernels read the
//   softmax scale this kernel passes on (attend_scale), so MLX's CUDA graph, which orders
//   launches by the buffers they exchange, runs them after the write.
//   Why: a bf16 pool's write was two MLX scatters a layer and an 8-bit pool's a quantizing
//   launch and four scatters; on an H100 (scripts/gpu/kv_write_cost.py, 8B shape, 64 rows, 32
//   layers) a step's writes took 0.55 ms and 1.55 ms, each launch a few microseconds of a
//   launch-bound GPU.
// * kv_quantize: the 8-bit rows only, for MLX's scatters (the fallback where the attention
//   kernels do not serve a layer, and the measured stages of scripts/gpu/kv_write_cost.py).
//
// The 8-bit arithmetic is engine/kv/int8.py's, operation for operation: s = min(max|x| / 127,
// 65504) in fp32 (IEEE division, __fdiv_rn, whatever the compiler's fast-math setting), rounded
// to fp16 (nearest even); q = rint(x / s) (IEEE division, half to even) clipped to [-127, 127];
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

// One warp quantizes one head of D values at src into q (lane l holds elements l, l + 32, ...;
// max|x| is a __shfl_xor_sync butterfly) and returns its fp16 scale.
template <int D, typename T>
__device__ __forceinline__ __half kq_quantize_head(const T* src, int8_t* q, uint32_t lane) {
  constexpr int PER_LANE = (D + 31) / 32;
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
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    const int i = int(lane) + 32 * j;
    if (i < D) {
      q[i] = int8_t(fminf(fmaxf(rintf(__fdiv_rn(x[j], d)), -127.0f), 127.0f));
    }
  }
  return s16;
}

// The pool index of (row, head): its slot (blocks[row], offsets[row]) in a pool of num_blocks
// blocks of block_size slots of kv_heads heads. A block id of -1 names the pool's last block
// (engine/kv/pool.py's SCRATCH_BLOCK, where a step's padding rows write).
__device__ __forceinline__ size_t kv_slot_head(const int32_t* blocks, const int32_t* offsets,
                                               uint32_t row, uint32_t head, int num_blocks,
                                               int block_size, uint32_t kv_heads) {
  int b = blocks[row];
  if (b < 0) {
    b += num_blocks;
  }
  return (size_t(b) * size_t(block_size) + size_t(offsets[row])) * kv_heads + head;
}

// A kv_store warp's item: which of K (false) or V (true) it writes, its head row r (row *
// kv_heads + head) of that tensor, and r's pool index. Thread 0 passes the softmax scale on
// (the edge that orders the layer's attention after the write). False: the warp is past the
// last item and returns whole.
__device__ __forceinline__ bool kv_store_item(const int32_t* blocks, const int32_t* offsets,
                                              uint32_t rows, uint32_t kv_heads, int num_blocks,
                                              int block_size, const float* scale,
                                              float* attend_scale, uint32_t lane, uint32_t item,
                                              bool& is_v, uint32_t& r, size_t& at) {
  if (item == 0 && lane == 0) {
    attend_scale[0] = scale[0];
  }
  const uint32_t head_rows = rows * kv_heads;
  if (item >= 2u * head_rows) {
    return false;
  }
  is_v = item >= head_rows;
  r = is_v ? item - head_rows : item;
  at = kv_slot_head(blocks, offsets, r / kv_heads, r % kv_heads, num_blocks, block_size,
                    kv_heads);
  return true;
}

// ==== kernel: kv_store ====
// keys, values [rows, kv_heads, D] of T; slot_blocks, slot_offsets int32 [rows]; k_pool,
// v_pool [blocks, block_size, kv_heads, D] of T, written in place; scale float [1] ->
// attend_scale float [1], the same value. One warp per (row, KV head) of K, then of V; the
// grid is 32 threads per warp-item (rounded up to whole blocks by MLX).
const uint32_t lane = threadIdx.x & 31u;
bool is_v;
uint32_t r;
size_t at;
if (!kv_store_item(slot_blocks, slot_offsets, uint32_t(keys_shape[0]), uint32_t(keys_shape[1]),
                   k_pool_shape[0], k_pool_shape[1], scale, attend_scale, lane,
                   (blockIdx.x * blockDim.x + threadIdx.x) >> 5, is_v, r, at)) {
  return;
}
const T* src = (is_v ? values : keys) + size_t(r) * D;
T* dst = const_cast<T*>(is_v ? v_pool : k_pool) + at * D;
for (uint32_t i = lane; i < uint32_t(D); i += 32u) {
  dst[i] = src[i];
}

// ==== kernel: kv_store_q8 ====
// An 8-bit pool's kv_store: keys, values [rows, kv_heads, D] of T; slot_blocks, slot_offsets
// int32 [rows]; k_pool, v_pool int8 [blocks, block_size, kv_heads, D] and k_scales, v_scales
// __half [blocks, block_size, kv_heads], written in place; scale float [1] -> attend_scale.
const uint32_t lane = threadIdx.x & 31u;
bool is_v;
uint32_t r;
size_t at;
if (!kv_store_item(slot_blocks, slot_offsets, uint32_t(keys_shape[0]), uint32_t(keys_shape[1]),
                   k_pool_shape[0], k_pool_shape[1], scale, attend_scale, lane,
                   (blockIdx.x * blockDim.x + threadIdx.x) >> 5, is_v, r, at)) {
  return;
}
const __half s16 = kq_quantize_head<D>((is_v ? values : keys) + size_t(r) * D,
                                       const_cast<int8_t*>(is_v ? v_pool : k_pool) + at * D,
                                       lane);
if (lane == 0) {
  const_cast<__half*>(is_v ? v_scales : k_scales)[at] = s16;
}

// ==== kernel: kv_quantize ====
// keys, values [rows, kv_heads, D] of type T (row-major) -> k_q, v_q int8 [rows, kv_heads, D]
// and k_scales, v_scales __half [rows, kv_heads]. One warp per (row, KV head) of K, then one
// per (row, KV head) of V; warps past the last item return whole.
const uint32_t lane = threadIdx.x & 31u;
const uint32_t item = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
const uint32_t head_rows = uint32_t(keys_shape[0]) * uint32_t(keys_shape[1]);
if (item >= 2u * head_rows) {
  return;
}
const bool is_v = item >= head_rows;
const uint32_t r = is_v ? item - head_rows : item;
const __half s16 = kq_quantize_head<D>((is_v ? values : keys) + size_t(r) * D,
                                       (is_v ? v_q : k_q) + size_t(r) * D, lane);
if (lane == 0) {
  (is_v ? v_scales : k_scales)[r] = s16;
}
