// A step's new K/V rows written into the pool on the CPU, beside the layer's attention call
// (engine/attention/cpu_kernel.py links it into the same library as paged_attention_cpu.cpp).
//
// Why: as MLX ops a layer's write is two scatters, and in an 8-bit pool also the quantizer's
// dozen element-wise ops per tensor and two more scatters for the scales. On the CPU backend
// each op costs its dispatch, whatever its size: for 16 rows of the default model, 30
// layers, 4.3-4.9 ms a step in a float32 pool and 9.9-14.5 ms in an int8 one, 5-15% of a
// decode step at 8 chats. Here a layer's write is one loop over its rows.
//
// Compiled WITHOUT -ffast-math, unlike the attention kernel: an int8 pool's values must be
// the ones engine/kv/int8.py's ``quantize`` writes with MLX ops on every other path, bit for
// bit (the reference attention and the GPU kernels read what either wrote), and -ffast-math
// would let the compiler turn x / s into x * (1 / s), which rounds differently near .5
// (measured: built with it, 1 value in 2.5 million differed from MLX's; without, none).
//
// Pools: [num_blocks + 1, block_size, kv_heads, head_dim] (the last block is the padding
// rows' scratch, block -1), scales [num_blocks + 1, block_size, kv_heads] of float16.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr float kQmax = 127.0f;  // engine/kv/int8.py: QMAX
constexpr float kF16Max = 65504.0f;

// engine/kv/int8.py's quantize for one head's ``head_dim`` values: s = fp16(min(max|x| / 127,
// 65504)); q = clip(round_half_even(x / s), -127, 127), x / 1 where s is 0.
void quantize_head(const float* x, int head_dim, int8_t* q, _Float16* scale) {
  float amax = 0.0f;
  for (int d = 0; d < head_dim; ++d) amax = std::fmax(amax, std::fabs(x[d]));
  const _Float16 s16 = static_cast<_Float16>(std::fmin(amax / kQmax, kF16Max));
  const float s = static_cast<float>(s16);
  const float div = s > 0.0f ? s : 1.0f;
  for (int d = 0; d < head_dim; ++d) {
    float r = std::nearbyint(x[d] / div);  // the default rounding mode: half to even
    r = std::fmin(std::fmax(r, -kQmax), kQmax);
    q[d] = static_cast<int8_t>(r == r ? r : 0.0f);  // a NaN input stores 0, not UB
  }
  *scale = s16;
}

}  // namespace

extern "C" {

// Row t of ``keys``/``values`` ([tokens, kv_heads, head_dim], contiguous) goes to slot
// (blocks[t], offsets[t]); a negative block counts from the end (the scratch block).
// ``elem_size``: bytes of one pool element, copied as they are (the rows already in the
// pool's dtype); 0: an int8 pool, the rows float32, quantized into the pool and ``*_scales``.
// Returns 0, or -1 if a slot is outside the pool (then nothing is written).
int paged_write_cpu(int elem_size, const void* keys, const void* values, int tokens,
                    const int32_t* blocks, const int32_t* offsets, int total_blocks,
                    int block_size, int kv_heads, int head_dim, void* k_pool, void* v_pool,
                    void* k_scales, void* v_scales) {
  auto block_of = [&](int t) -> int64_t {
    return blocks[t] < 0 ? static_cast<int64_t>(blocks[t]) + total_blocks : blocks[t];
  };
  for (int t = 0; t < tokens; ++t)
    if (block_of(t) < 0 || block_of(t) >= total_blocks || offsets[t] < 0 ||
        offsets[t] >= block_size)
      return -1;
  const int64_t row = static_cast<int64_t>(kv_heads) * head_dim;  // elements of one slot
  for (int t = 0; t < tokens; ++t) {
    const int64_t slot = block_of(t) * block_size + offsets[t];
    if (elem_size > 0) {
      const size_t bytes = static_cast<size_t>(row) * elem_size;
      std::memcpy(static_cast<char*>(k_pool) + slot * bytes,
                  static_cast<const char*>(keys) + t * bytes, bytes);
      std::memcpy(static_cast<char*>(v_pool) + slot * bytes,
                  static_cast<const char*>(values) + t * bytes, bytes);
      continue;
    }
    for (int h = 0; h < kv_heads; ++h) {
      const int64_t src = t * row + static_cast<int64_t>(h) * head_dim;
      const int64_t dst = slot * row + static_cast<int64_t>(h) * head_dim;
      const int64_t s = slot * kv_heads + h;
      quantize_head(static_cast<const float*>(keys) + src, head_dim,
                    static_cast<int8_t*>(k_pool) + dst, static_cast<_Float16*>(k_scales) + s);
      quantize_head(static_cast<const float*>(values) + src, head_dim,
                    static_cast<int8_t*>(v_pool) + dst, static_cast<_Float16*>(v_scales) + s);
    }
  }
  return 0;
}

}  // extern "C"
