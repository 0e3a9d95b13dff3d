// Paged attention on the CPU: the Metal and CUDA kernels' design (shaders/README.md) as plain
// C++, for MLX's CPU backend (engine/attention/cpu_kernel.py builds it with the system's C++
// compiler and calls it through ctypes).
//
// One pass over each item's blocks, straight from the pool through its block table: the
// scores of a block, an online softmax (one rescale per block, not per token) and P.V, with
// no gathered copy of K/V, no score matrix in memory and the exp vectorized. An item is a run
// of consecutive query positions of one sequence: a decode row (one query) or a prompt chunk
// (L queries, causal among themselves); its queries of one KV head (G = heads / kv_heads of
// them per position) share every K and V row read. The reference path's MLX formulation
// (engine/attention/cpu_sdpa.py) gathers the context, writes a score matrix and passes over
// it several times: at 3,600 tokens of context an 8-token chunk costs it several times this.
//
// Pools: [num_blocks, block_size, kv_heads, head_dim] of float32, bfloat16 or float16, or int8
// with float16 scales [num_blocks, block_size, kv_heads] (engine/kv/int8.py: value = q * s).
// Queries and output: float32 [rows, heads, head_dim].

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__SSE4_1__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// The running maxima start here: finite, since -ffast-math assumes no infinities, and far
// below any score, so exp(kNoScore - m) is exactly 0.
constexpr float kNoScore = -1e30f;

struct Args {
  const float* q;
  const void* k_pool;
  const void* v_pool;
  const _Float16* k_scales;  // null unless int8
  const _Float16* v_scales;
  const int32_t* tables;  // [items, width]
  int width;
  const int32_t* q_row;  // each item's first query row
  const int32_t* q_len;  // its query positions
  const int32_t* context;  // tokens its last query attends to (its own included)
  int heads, kv_heads, head_dim, block_size;
  float scale;
  float* out;
};

// Four lanes of floats in one register (GCC's and Clang's vector extensions: SSE on x86,
// NEON on Arm), so that the accumulators below stay in registers, which plain arrays under
// ``omp simd`` did not (the first version reached 3-5 GFMA/s).
typedef float v4 __attribute__((vector_size(16)));
inline v4 splat(float x) { return v4{x, x, x, x}; }
inline v4 ld(const float* p) { v4 r; std::memcpy(&r, p, sizeof r); return r; }
inline void st(float* p, v4 v) { std::memcpy(p, &v, sizeof v); }

// Eight lanes: the scores' and P.V's multiply-adds on float tiles. One AVX2 register on x86
// (two FMA pipes of eight lanes: the four-lane form used half of each), two NEON registers
// on Arm, where the compiler splits each operation in two at no loss. Lane for lane the
// same arithmetic in the same order as four lanes: only the instructions are wider.
typedef float v8 __attribute__((vector_size(32)));
inline v8 splat8(float x) { return v8{x, x, x, x, x, x, x, x}; }
inline v8 ld8(const float* p) { v8 r; std::memcpy(&r, p, sizeof r); return r; }
inline void st8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

// Four elements of a pool row widened to floats in registers. GCC turns the vector
// extensions' int8 and float16 conversions into four scalar ones, so x86 says what it means
// (SSE4.1, F16C); elsewhere the generic form (Clang lowers it to NEON's widening moves).
inline v4 ld4(const float* p) { return ld(p); }
inline v4 ld4(const uint16_t* p) {  // bfloat16: each lane moves into a float32's high half
  typedef uint32_t u32x4 __attribute__((vector_size(16)));
#if defined(__SSE4_1__)
  const u32x4 wide = reinterpret_cast<u32x4>(
      _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  typedef uint16_t u16x4 __attribute__((vector_size(8)));
  u16x4 h;
  std::memcpy(&h, p, sizeof h);
  const u32x4 wide = __builtin_convertvector(h, u32x4);
#endif
  const u32x4 bits = wide << 16;
  v4 r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}
inline v4 ld4(const _Float16* p) {
#if defined(__F16C__)
  return reinterpret_cast<v4>(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  typedef _Float16 f16x4 __attribute__((vector_size(8)));
  f16x4 h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, v4);
#endif
}
inline v4 ld4(const int8_t* p) {
#if defined(__SSE4_1__)
  int32_t bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  return reinterpret_cast<v4>(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(bytes))));
#else
  typedef int8_t i8x4 __attribute__((vector_size(4)));
  i8x4 b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, v4);
#endif
}

// Scores of R query rows (qs, stride d_len) against one block's transposed K tile kt[D][BS].
template <int BS, int R>
inline void tile_scores(const float* qs, int d_len, const float* kt, float* s) {
  constexpr int NV = BS / 8;
  v8 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) acc[r][n] = splat8(0.f);
  for (int i = 0; i < d_len; ++i) {
    v8 kv[NV];
    for (int n = 0; n < NV; ++n) kv[n] = ld8(kt + i * BS + 8 * n);
    for (int r = 0; r < R; ++r) {
      const v8 a = splat8(qs[r * d_len + i]);
      for (int n = 0; n < NV; ++n) acc[r][n] += a * kv[n];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) st8(s + r * BS + 8 * n, acc[r][n]);
}

// One block's K for one KV head, widened (int8: times each token's scale) and transposed
// into kt[D][BS], four tokens by four dims at a time: four rows loaded, transposed in
// registers, four stores. Token o's row is at k + o * stride; tokens from ``in_block`` on are
// zeros, never read.
template <typename T, int BS>
inline void widen_k(const T* k, size_t stride, int in_block, const float* k_scale, int d_len,
                    float* kt) {
  for (int o0 = 0; o0 < BS; o0 += 4) {
    for (int i0 = 0; i0 < d_len; i0 += 4) {
      v4 r[4];
      for (int t = 0; t < 4; ++t)
        r[t] = o0 + t < in_block ? ld4(k + (o0 + t) * stride + i0) * splat(k_scale[o0 + t])
                                 : splat(0.f);
      const v4 t0 = __builtin_shufflevector(r[0], r[1], 0, 4, 1, 5);
      const v4 t1 = __builtin_shufflevector(r[0], r[1], 2, 6, 3, 7);
      const v4 t2 = __builtin_shufflevector(r[2], r[3], 0, 4, 1, 5);
      const v4 t3 = __builtin_shufflevector(r[2], r[3], 2, 6, 3, 7);
      st(kt + (i0 + 0) * BS + o0, __builtin_shufflevector(t0, t2, 0, 1, 4, 5));
      st(kt + (i0 + 1) * BS + o0, __builtin_shufflevector(t0, t2, 2, 3, 6, 7));
      st(kt + (i0 + 2) * BS + o0, __builtin_shufflevector(t1, t3, 0, 1, 4, 5));
      st(kt + (i0 + 3) * BS + o0, __builtin_shufflevector(t1, t3, 2, 3, 6, 7));
    }
  }
}

// One block's V for one KV head widened (int8: times each token's scale) into vb[BS][D].
template <typename T, int BS>
inline void widen_v(const T* v, size_t stride, int in_block, const float* v_scale, int d_len,
                    float* vb) {
  for (int o = 0; o < BS; ++o)
    for (int i = 0; i < d_len; i += 4)
      st(vb + o * d_len + i, o < in_block ? ld4(v + o * stride + i) * splat(v_scale[o]) : splat(0.f));
}

// ar[0:d_len] = ar * rescale + sum over the block's first ``seen`` tokens of p[o] * V[o], V[o]
// at vb + o * stride: a widened tile, or a float32 pool's own row.
inline void tile_pv(float* ar, float rescale, const float* p, int seen, const float* vb,
                    size_t stride, int d_len) {
  int c = 0;
  for (; c + 64 <= d_len; c += 64) {  // 64 lanes: eight accumulators in registers
    v8 a[8];
    const v8 sc = splat8(rescale);
    for (int n = 0; n < 8; ++n) a[n] = ld8(ar + c + 8 * n) * sc;
    for (int o = 0; o < seen; ++o) {
      const v8 pv = splat8(p[o]);
      const float* vr = vb + o * stride + c;
      for (int n = 0; n < 8; ++n) a[n] += pv * ld8(vr + 8 * n);
    }
    for (int n = 0; n < 8; ++n) st8(ar + c + 8 * n, a[n]);
  }
  for (; c + 8 <= d_len; c += 8) {  // head dims that are not a multiple of 64
    v8 a = ld8(ar + c) * splat8(rescale);
    for (int o = 0; o < seen; ++o) a += splat8(p[o]) * ld8(vb + o * stride + c);
    st8(ar + c, a);
  }
  for (; c < d_len; c += 4) {  // nor of 8 (a multiple of 4)
    v4 a = ld(ar + c) * splat(rescale);
    for (int o = 0; o < seen; ++o) a += splat(p[o]) * ld(vb + o * stride + c);
    st(ar + c, a);
  }
}

// Rows that an item's queries of one KV head must number before a float32 block's V is worth
// copying into a tile that they share rather than read in place by each row's P.V (measured:
// decode rows read in place save the copy, 96 and more rows read a tile faster). The
// narrower pools always widen V into a tile: widened in registers by every row, it cost more
// than the copy even for decode rows.
constexpr int kWidenRows = 24;

// Item ``it``, KV head ``kh``, query positions [jb, je) of the item: their rows for the G
// heads of ``kh``. Per block: K widened into a transposed tile kt[D][BS] (vector loads and an
// in-register transpose) shared by all these rows; their scores as register-blocked FMAs of
// ``ROWS`` rows over the tile; an online softmax per row; P.V 64 lanes of a row at a time
// over the block's tokens, from a float32 pool's V read in place (fewer than kWidenRows rows)
// or from a tile vb[BS][D] widened once (int8: scaled). Both do a row's arithmetic in the
// same order on the same values, so a row's output does not depend on which rows share its
// call or how a call is split.
template <typename T, int BS>
void attend_one(const Args& a, int it, int kh, int jb, int je, std::vector<float>& buf) {
  constexpr int ROWS = BS == 8 ? 8 : BS == 16 ? 4 : 2;  // accumulators: ROWS * BS / 8 = 8
  constexpr bool kFloatPool = std::is_same<T, float>::value;
  const int group = a.heads / a.kv_heads, d_len = a.head_dim;
  const int len = a.q_len[it], ctx = a.context[it], rows = (je - jb) * group;
  const bool v_in_place = kFloatPool && rows < kWidenRows;
  const int before = ctx - len;  // query j sits at position before + j, sees up to it
  const int padded = (rows + ROWS - 1) / ROWS * ROWS;
  buf.resize(static_cast<size_t>(padded) * (2 * d_len + 2 + BS) + 2 * static_cast<size_t>(BS) * d_len
             + 2 * BS);
  float* qs = buf.data();                                    // [padded, D], scaled
  float* acc = qs + static_cast<size_t>(padded) * d_len;     // [padded, D]
  float* row_max = acc + static_cast<size_t>(padded) * d_len;  // [padded]
  float* row_sum = row_max + padded;                         // [padded]
  float* sc = row_sum + padded;                              // [padded, BS]
  float* kt = sc + static_cast<size_t>(padded) * BS;         // [D, BS]
  float* vb = kt + static_cast<size_t>(BS) * d_len;          // [BS, D], unless V is read in place
  float* k_scale = vb + static_cast<size_t>(BS) * d_len;     // [BS]: int8's scales, else 1
  float* v_scale = k_scale + BS;                             // [BS]
  std::fill(qs, qs + static_cast<size_t>(padded) * d_len, 0.f);
  for (int j = jb; j < je; ++j)
    for (int g = 0; g < group; ++g) {
      const float* src = a.q + (static_cast<size_t>(a.q_row[it] + j) * a.heads + kh * group + g) * d_len;
      float* dst = qs + static_cast<size_t>((j - jb) * group + g) * d_len;
      for (int i = 0; i < d_len; ++i) dst[i] = src[i] * a.scale;
    }
  std::fill(acc, acc + static_cast<size_t>(padded) * d_len, 0.f);
  std::fill(row_max, row_max + padded, kNoScore);
  std::fill(row_sum, row_sum + padded, 0.f);
  std::fill(k_scale, k_scale + 2 * BS, 1.f);
  const T* kp = static_cast<const T*>(a.k_pool);
  const T* vp = static_cast<const T*>(a.v_pool);
  const size_t stride = static_cast<size_t>(a.kv_heads) * d_len;  // a pool row's next token
  const int32_t* table = a.tables + static_cast<size_t>(it) * a.width;
  const int blocks = (before + je + BS - 1) / BS;  // what the last of these queries sees
  for (int bi = 0; bi < blocks; ++bi) {
    const size_t first_slot = static_cast<size_t>(table[bi]) * BS * a.kv_heads + kh;
    const int t0 = bi * BS, in_block = std::min(BS, ctx - t0);  // past it: never read
    const T* v_rows = vp + first_slot * d_len;
    if (a.k_scales)
      for (int o = 0; o < in_block; ++o) {
        const size_t slot = first_slot + static_cast<size_t>(o) * a.kv_heads;
        k_scale[o] = static_cast<float>(a.k_scales[slot]);
        v_scale[o] = static_cast<float>(a.v_scales[slot]);
      }
    widen_k<T, BS>(kp + first_slot * d_len, stride, in_block, k_scale, d_len, kt);
    const float* v_src = vb;  // V: the widened tile, or a float32 pool's own rows
    size_t v_stride = d_len;
    if constexpr (kFloatPool) {
      if (v_in_place) {
        v_src = v_rows;
        v_stride = stride;
      }
    }
    if (!v_in_place) widen_v<T, BS>(v_rows, stride, in_block, v_scale, d_len, vb);
    // the first row that sees any of this block: query j sees positions <= before + j
    const int first_row = std::max(0, t0 - before - jb) * group;
    for (int r0 = first_row / ROWS * ROWS; r0 < rows; r0 += ROWS)
      tile_scores<BS, ROWS>(qs + static_cast<size_t>(r0) * d_len, d_len, kt,
                            sc + static_cast<size_t>(r0) * BS);
    for (int r = first_row; r < rows; ++r) {
      const int j = jb + r / group;
      const int seen = std::min(in_block, before + j + 1 - t0);
      float* s = sc + static_cast<size_t>(r) * BS;
      float m = row_max[r];
      for (int o = 0; o < seen; ++o) m = std::max(m, s[o]);
      const float rescale = std::exp(row_max[r] - m);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int o = 0; o < BS; ++o) {
        s[o] = o < seen ? std::exp(s[o] - m) : 0.f;
        sum += s[o];
      }
      row_sum[r] = row_sum[r] * rescale + sum;
      row_max[r] = m;
      float* ar = acc + static_cast<size_t>(r) * d_len;
      tile_pv(ar, rescale, s, seen, v_src, v_stride, d_len);
    }
  }
  for (int j = jb; j < je; ++j)
    for (int g = 0; g < group; ++g) {
      const int r = (j - jb) * group + g;
      float* dst = a.out + (static_cast<size_t>(a.q_row[it] + j) * a.heads + kh * group + g) * d_len;
      const float inv = 1.f / row_sum[r];
      const float* ar = acc + static_cast<size_t>(r) * d_len;
      for (int i = 0; i < d_len; ++i) dst[i] = ar[i] * inv;
    }
}

// A share of one call's work: query positions [jb, je) of item ``it`` for KV head ``kh``.
struct Unit {
  int it, kh, jb, je;
  int64_t cost;
};

template <typename T>
void attend_units(const Args& a, const Unit* first, const Unit* last) {
  std::vector<float> buf;
  for (const Unit* u = first; u != last; ++u) {
    switch (a.block_size) {  // the block size as a constant: the score tile stays in registers
      case 8: attend_one<T, 8>(a, u->it, u->kh, u->jb, u->je, buf); break;
      case 16: attend_one<T, 16>(a, u->it, u->kh, u->jb, u->je, buf); break;
      default: attend_one<T, 32>(a, u->it, u->kh, u->jb, u->je, buf); break;
    }
  }
}

template <typename T>
void attend(const Args& a, int items, int threads, const int64_t* cost) {
  // Units: every (item, KV head), cut by query positions where one would outweigh a
  // thread's share (a long chunk beside a few decode rows), then runs of about equal cost.
  int64_t total = 0;
  for (int it = 0; it < items; ++it) total += cost[it] * a.kv_heads;
  threads = std::max(threads, 1);
  const int64_t share = std::max<int64_t>(total / threads, 1);
  std::vector<Unit> units;
  for (int it = 0; it < items; ++it)
    for (int kh = 0; kh < a.kv_heads; ++kh) {
      const int len = a.q_len[it];
      const int pieces = threads > 1
          ? static_cast<int>(std::min<int64_t>(len, (2 * cost[it] + share - 1) / share)) : 1;
      for (int p = 0; p < pieces; ++p) {
        const int jb = len * p / pieces, je = len * (p + 1) / pieces;
        if (je > jb) units.push_back({it, kh, jb, je, cost[it] * (je - jb) / len});
      }
    }
  if (threads == 1 || units.size() < 2) {
    attend_units<T>(a, units.data(), units.data() + units.size());
    return;
  }
  std::vector<size_t> cuts{0};
  int64_t run = 0;
  for (size_t u = 0; u < units.size() && static_cast<int>(cuts.size()) < threads; ++u) {
    run += units[u].cost;
    if (run * threads >= total * static_cast<int64_t>(cuts.size())) cuts.push_back(u + 1);
  }
  if (cuts.back() != units.size()) cuts.push_back(units.size());
  std::vector<std::thread> workers;
  for (size_t c = 1; c + 1 < cuts.size(); ++c)
    workers.emplace_back(attend_units<T>, std::cref(a), units.data() + cuts[c],
                         units.data() + cuts[c + 1]);
  attend_units<T>(a, units.data() + cuts[0], units.data() + cuts[1]);
  for (auto& t : workers) t.join();
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16, 2 float16, 3 int8 (with scales). ``cost``: per item, its
// query rows times its context (how the work is split among ``threads``). Returns 0, -1 for
// an unknown dtype, -2 for a block size other than 8, 16 or 32.
int paged_attention_cpu(int dtype, const float* q, const void* k_pool, const void* v_pool,
                        const void* k_scales, const void* v_scales, const int32_t* tables,
                        int width, const int32_t* q_row, const int32_t* q_len,
                        const int32_t* context, const int64_t* cost, int items, int heads,
                        int kv_heads, int head_dim, int block_size, float scale, int threads,
                        float* out) {
  Args a{q, k_pool, v_pool, static_cast<const _Float16*>(k_scales),
         static_cast<const _Float16*>(v_scales), tables, width, q_row, q_len, context,
         heads, kv_heads, head_dim, block_size, scale, out};
  if (block_size != 8 && block_size != 16 && block_size != 32) return -2;
  switch (dtype) {
    case 0: attend<float>(a, items, threads, cost); return 0;
    case 1: attend<uint16_t>(a, items, threads, cost); return 0;
    case 2: attend<_Float16>(a, items, threads, cost); return 0;
    case 3: attend<int8_t>(a, items, threads, cost); return 0;
    default: return -1;
  }
}

}  // extern "C"
