// Paged attention for PagedChat on NVIDIA GPUs, in the form mx.fast.cuda_kernel takes: kernel
// BODIES (MLX generates each __global__ signature from the input/output names and turns the
// template arguments into constexpr values / type aliases at the top of the body).
// engine/cuda_kernels.py splits this file at the "// ==== kernel: NAME ====" and
// "// ==== header ====" lines; the text before the first marker (this comment) is not compiled.
// The same text is compiled on the CPU by the emulation harness (tests/kernel_emulation/
// cuda_emu.h, see shaders/README.md), so every CI run executes it.
//
// The design is the Metal kernel's (paged_attention.metal), with warps for simdgroups:
// one thread block per (sequence, KV head, partition) serves every query head of that KV head,
// so each K/V byte is read once; a lane group takes tokens, its lanes split head_dim (16-byte
// loads, a whole step's issued before the first is used) and q.k is a short __shfl_xor_sync
// butterfly; fp32 online softmax, one rescale per step; warps take the blocks
// round-robin and are merged through shared memory; long contexts are split into partitions (split-K) merged by
// paged_attention_reduce. K/V are read straight from the pool through the block table.
//
// Prefill: the same kernel takes L query tokens per sequence (q [B, H, L, D]); a thread block
// then serves QT consecutive query tokens x the G heads of its KV head (R = QT * G rows), each
// row causal: query token l of L attends to the first context_len - L + 1 + l tokens. K/V are
// still read from the pool through the block table (no gathered copy), once per block for all
// R rows.
//
// Pool layout: k_pool, v_pool [num_blocks, BS, num_kv_heads, D], head_dim contiguous.
//
// 8-bit pools (issue #26): engine/attention/plans.py builds paged_attention_q8 from the same
// body with "#define PC_KV8 1" in front: k_pool / v_pool are int8 and two more inputs,
// k_scales / v_scales [num_blocks, BS, num_kv_heads] __half, hold one scale per (slot, KV
// head); a K or V element is q * s (symmetric, no zero point: engine/kv/int8.py), widened in
// registers (8 bytes per lane per row instead of 16), the scales applied to each token's score
// and weight rather than to every element.

// ==== header ====
#ifndef CUDA_EMU  // MLX's default header includes them already; the emulator defines the types
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif
// Conversions through the CUDA intrinsics (independent of __CUDA_NO_HALF_CONVERSIONS__).
__device__ __forceinline__ float pc_f32(float x) { return x; }
__device__ __forceinline__ float pc_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float pc_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename O>
__device__ __forceinline__ O pc_cast(float x);
template <>
__device__ __forceinline__ float pc_cast<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half pc_cast<__half>(float x) { return __float2half(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 pc_cast<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// Raw bits of VEC consecutive head-dim elements of one K or V row: one 16-byte load for fp16
// and bf16, two for fp32, one 8-byte load for int8 (rows start at multiples of 8 elements: D is
// a multiple of 8). The kernel issues a whole step's loads into these registers first and
// converts them (pc_unpack) only when it uses them, so many loads are in flight per lane.
constexpr int PC_VEC = 8;
template <typename E>
struct PcRaw {
  static constexpr int N = PC_VEC * int(sizeof(E)) / 4;  // 32-bit words: 2, 4 or 8
  uint32_t w[N];
};
template <typename E>
__device__ __forceinline__ void pc_load_raw(const E* p, PcRaw<E>& r) {
  if constexpr (sizeof(E) == 1) {
    const uint2 a = *reinterpret_cast<const uint2*>(p);
    r.w[0] = a.x;
    r.w[1] = a.y;
  } else {
#pragma unroll
    for (int c = 0; c < PcRaw<E>::N / 4; ++c) {
      const uint4 a = reinterpret_cast<const uint4*>(p)[c];
      r.w[4 * c] = a.x;
      r.w[4 * c + 1] = a.y;
      r.w[4 * c + 2] = a.z;
      r.w[4 * c + 3] = a.w;
    }
  }
}
template <typename E>
__device__ __forceinline__ void pc_zero_raw(PcRaw<E>& r) {
#pragma unroll
  for (int i = 0; i < PcRaw<E>::N; ++i) {
    r.w[i] = 0u;
  }
}

// The VEC elements as fp32 (fp16 / bf16 / fp32 rows).
template <typename E>
__device__ __forceinline__ void pc_unpack(const PcRaw<E>& r, float (&o)[PC_VEC]) {
  E h[PC_VEC];
  memcpy(h, r.w, sizeof(h));
#pragma unroll
  for (int i = 0; i < PC_VEC; ++i) {
    o[i] = pc_f32(h[i]);
  }
}

// An 8-bit pool's VEC int8 values as fp32 (unscaled), without I2F (a quarter-rate conversion):
// byte x ^ 0x80 is x + 128 as an unsigned byte; one byte permute puts it under the exponent of
// 2^23, so the float is 2^23 + x + 128, exactly; one add subtracts 2^23 + 128.
__device__ __forceinline__ void pc_unpack(const PcRaw<int8_t>& r, float (&o)[PC_VEC]) {
#pragma unroll
  for (int i = 0; i < PC_VEC; ++i) {
    const uint32_t w = r.w[i / 4];
    o[i] = __uint_as_float(__byte_perm(w ^ 0x80808080u, 0x4B000000u, 0x7540 + i % 4)) - 8388736.0f;
  }
}


// ---- Tensor-core decode over an 8-bit pool (issue #26; sm_80 and later) ----
// The SIMT body above widens every int8 element and spends R FMAs on it per row: issue-bound,
// so an 8-bit pool was no faster than a 16-bit one. Here a warp takes one 16-token tile of a
// KV block at a time and runs q.k and p.v on the tensor cores (mma.sync m16n8k16, fp16 in,
// fp32 accumulate), rows = the G query heads of a KV head padded to 16:
//   S [16 rows x 16 tokens] = Q [16 x D] . K^T, as D / 16 k-steps x 2 token halves;
//   O [16 rows x D] += P [16 x 16 tokens] . V [16 tokens x D], as D / 8 column tiles.
// Fragments follow the PTX ISA's layout (lane = 4 g + t): A rows g and g + 8, B column g, C
// rows g and g + 8, columns 2t and 2t + 1; an MMA's C layout (S) is the next one's A layout (P),
// as in FlashAttention-2. The head dimension is permuted freely (a dot product does not see
// the order): in k-step kk lane t's q.k columns {2t, 2t+1} / {2t+8, 2t+9} are head-dim elements
// DT t + 4 kk + {0, 1} / {2, 3} (DT = D / 4), so a lane reads DT contiguous bytes of each of its
// K rows; output column n of tile j is element DV n + j (DV = D / 8), so a lane reads DV
// contiguous bytes of each V row and holds 2 DV contiguous output elements.
// int8 -> fp16 is exact: a byte permute or LOP3 puts x ^ 0x80 under the exponent of 1024 and one
// HSUB2 subtracts 1152 (two elements per instruction). Scales: the K scale multiplies each
// token's fp32 score; the V scale multiplies the weight p before it is rounded to fp16, with a
// power of two per tile (2^(13 - e), e the exponent of the tile's largest V scale) so that small
// weights stay normal fp16 numbers; the accumulator keeps that power in a running exponent.
// q rows are scaled by a power of two to ~2^14 before rounding to fp16 (no overflow, no
// subnormals). The weights are split into an fp16 high and low part and p.v runs twice, so
// they keep ~22 bits (one fp16 rounding of p alone moved outputs by 1e-3 relative); fp32
// queries are split the same way (q.k twice); fp16 and bf16 queries are exact in fp16.
// With at most 8 heads a KV head (G <= 8: the A fragment's rows g + 8 would be padding), the
// low parts ride in rows g + 8 instead of a second MMA: row g + 8 of P holds row g's low
// weights (of q, row g's low query part), so C rows g + 8 accumulate the low products and are
// added to rows g at the end. p.v (and fp32 q.k) then costs one MMA a tile, not two. Behind
// PC_TC_LO_ROWS (default 0) until it is timed on the GPU: scripts/gpu/kv8_attention.py
// --define PC_TC_LO_ROWS=1.
#if defined(CUDA_EMU) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define PC_TC_ARCH 1
#else
#define PC_TC_ARCH 0  // before Ampere: no m16n8k16 MMA, the SIMT body runs
#endif
template <int D, int BS, int G, int QT>
constexpr bool pc_tc_shape() {
  return PC_TC_ARCH && QT == 1 && (D == 64 || D == 128) && BS % 16 == 0 && G <= 16;
}

__device__ __forceinline__ uint32_t pc_h2_bits(__half2 h) {
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}
__device__ __forceinline__ __half2 pc_bits_h2(uint32_t u) {
  __half2 h;
  memcpy(&h, &u, 4);
  return h;
}
// Two int8 in bytes 0 and 2 of x (bytes 1 and 3 ignored) as fp16x2, exactly.
__device__ __forceinline__ uint32_t pc_i8x2_h2(uint32_t x) {
  const uint32_t biased = ((x ^ 0x64806480u) & 0x00FF00FFu) | 0x64006400u;  // 1024 + x + 128
  return pc_h2_bits(__hsub2(pc_bits_h2(biased), pc_bits_h2(0x64806480u)));  // - 1152
}
// (lo, hi) rounded to fp16x2, lo in the low half.
__device__ __forceinline__ uint32_t pc_f2_h2(float lo, float hi) {
  return pc_h2_bits(__floats2half2_rn(lo, hi));
}
// x - fp16(x): the part of x an fp16 rounding drops.
__device__ __forceinline__ float pc_h_rest(float x) { return x - __half2float(__float2half(x)); }

// d += a . b: one m16n8k16 MMA of the warp, fp16 in, fp32 accumulate.
__device__ __forceinline__ void pc_mma(float (&d)[4], const uint32_t (&a)[4],
                                       const uint32_t (&b)[2]) {
#if defined(CUDA_EMU)
  cuda_emu_mma_m16n8k16_f32_f16(d, a, b);
#elif PC_TC_ARCH
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();  // never called: pc_tc_shape is false before sm_80
#endif
}

// 2^e as a float, e clamped to the normal range.
__device__ __forceinline__ float pc_exp2i(int e) {
  e = e < -126 ? -126 : (e > 127 ? 127 : e);
  return __uint_as_float(uint32_t(e + 127) << 23);
}
// The binary exponent of x > 0 (of the smallest normal float for 0 and subnormals).
__device__ __forceinline__ int pc_ilogb(float x) {
  const int e = int((__float_as_uint(x) >> 23) & 0xFFu);
  return (e == 0 ? 1 : e) - 127;
}

// One 16-token tile's raw K / V words and scales in a lane's registers (pc_tc_warp).
template <int KW, int VW>
struct PcTcTile {
  uint32_t kw[2][KW];
  uint32_t vw[4][VW];
  float ks[4];
  float vs[4];
  int tok0;
};

// One warp's share of a decode row block on the tensor cores: KV blocks blk_begin + warp +
// NW n of this partition, tokens [tok_begin, tok_end). Writes the warp's (max, sum) per row
// (base-2 units) to sm_ml and its unnormalised output rows to sm_acc, as the SIMT body does
// before the cross-warp merge. q_row: the first of the G rows of this (sequence, KV head, query
// token), q_stride apart; sc: the softmax scale times log2 e. PREFETCH (0, 1 or 2): how many
// tiles ahead the loads are issued before this tile's MMAs (more registers, fewer warps
// waiting on memory). LO_ROWS_IF_FREE: the low parts in rows g + 8 when G <= 8 (above).
template <typename T, typename KV, int D, int BS, int G, int NW, int PREFETCH,
          bool LO_ROWS_IF_FREE>
__device__ __forceinline__ void pc_tc_warp(
    const T* q_row, size_t q_stride, const KV* k_pool, const KV* v_pool, const __half* k_scales,
    const __half* v_scales, const int* table, int KVH, int kvh, int blk_begin, int blk_end,
    int tok_end, float sc, float* sm_ml, float* sm_acc) {
  constexpr int R = G;  // rows (one query token)
  constexpr int DT = D / 4;  // contiguous K bytes per lane and token
  constexpr int KW = DT / 4;  // their words: one per k-step
  constexpr int KSTEPS = D / 16;
  constexpr int DV = D / 8;  // contiguous V bytes per lane and token
  constexpr int VW = DV / 4;
  constexpr int TILES = D / 8;  // p.v column tiles
  constexpr bool SPLIT = sizeof(T) == 4;  // fp32 q: a high and a low fp16 part
  constexpr bool HIGH = R > 8;  // rows g + 8 hold heads
  constexpr bool LO_ROWS = LO_ROWS_IF_FREE && !HIGH;  // rows g + 8: row g's low parts
  constexpr float NEG = -1.0e30f;
  const int lane = int(threadIdx.x) & 31;
  const int warp = int(threadIdx.x) >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;

  // q as A fragments (rows g, g + 8), scaled per row by a power of two to ~2^14.
  float qf[2][DT];
  float row_sc[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    float mx = 0.0f;
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      const float x = r < R ? pc_f32(q_row[size_t(r) * q_stride + DT * t + i]) : 0.0f;
      qf[h][i] = x;
      mx = fmaxf(mx, fabsf(x));
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const int e = mx > 0.0f ? 14 - pc_ilogb(mx) : 0;
    const float f = pc_exp2i(e);
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      qf[h][i] *= f;
    }
    row_sc[h] = sc * pc_exp2i(-e);
  }
  uint32_t qa[KSTEPS][4];
  uint32_t qa_lo[SPLIT ? KSTEPS : 1][4];
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // columns {2t, 2t+1} / {2t+8, 2t+9}
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // row g / g + 8
        const float x0 = qf[h][4 * kk + 2 * half];
        const float x1 = qf[h][4 * kk + 2 * half + 1];
        qa[kk][2 * half + h] = pc_f2_h2(x0, x1);
        if constexpr (SPLIT) {
          qa_lo[kk][2 * half + h] = pc_f2_h2(pc_h_rest(x0), pc_h_rest(x1));
        }
      }
      if constexpr (SPLIT && LO_ROWS) {  // row g + 8: row g's low part
        qa[kk][2 * half + 1] = qa_lo[kk][2 * half];
      }
    }
  }

  float m[2] = {NEG, NEG};  // running max per row (g, g + 8), base-2 units
  float l[2] = {0.0f, 0.0f};  // this lane's share of the row's sum of p
  float acc[TILES][4];  // output tile j: rows g, g + 8 x elements DV (2t) + j, DV (2t + 1) + j
#pragma unroll
  for (int j = 0; j < TILES; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[j][i] = 0.0f;
    }
  }
  int acc_exp = 0;  // acc holds (output) x 2^-acc_exp

  const size_t tok_stride = size_t(KVH) * D;
  const size_t blk_stride = size_t(BS) * tok_stride;
  const int nblk = blk_end - blk_begin > warp ? (blk_end - blk_begin - warp + NW - 1) / NW : 0;
  constexpr int TPB = BS / 16;  // tiles per KV block
  const int ntiles = nblk * TPB;
  // Lane j holds the table entry of the warp's block 32 c + j; __shfl_sync hands it out.
  int my_entry = 0;
  // Issues tile it's loads: K rows g and g + 8 (DT bytes at DT t), V rows 2t, 2t+1, 2t+8,
  // 2t+9 (DV bytes at DV g) and the scales of this lane's four token columns 2t, 2t+1 (S half
  // 0), 2t+8, 2t+9 (S half 1). Warp-uniform (a table shuffle).
  auto load_tile = [&](int it, PcTcTile<KW, VW>& tile) {
    const int n = it / TPB;
    const int c = it - n * TPB;
    if (c == 0 && (n & 31) == 0) {
      const int mine = n + lane;
      my_entry = mine < nblk ? table[blk_begin + warp + mine * NW] : 0;
    }
    const int phys = __shfl_sync(0xffffffffu, my_entry, n & 31);
    const int slot0 = 16 * c;
    const int tok0 = (blk_begin + warp + n * NW) * BS + slot0;  // the tile's first position
    tile.tok0 = tok0;
    const size_t base = size_t(phys) * blk_stride + size_t(slot0) * tok_stride + size_t(kvh) * D;
    const size_t sbase = (size_t(phys) * BS + slot0) * KVH + kvh;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int tk = g + 8 * h;
      const bool ok = tok0 + tk < tok_end;
      const uint4* src = reinterpret_cast<const uint4*>(k_pool + base + tk * tok_stride + DT * t);
#pragma unroll
      for (int w = 0; w < KW; w += 4) {
        const uint4 x = ok ? src[w / 4] : uint4{0u, 0u, 0u, 0u};
        tile.kw[h][w] = x.x;
        tile.kw[h][w + 1] = x.y;
        tile.kw[h][w + 2] = x.z;
        tile.kw[h][w + 3] = x.w;
      }
    }
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int tk = 2 * t + (v & 1) + 8 * (v >> 1);
      const bool ok = tok0 + tk < tok_end;
      const KV* src = v_pool + base + tk * tok_stride + DV * g;
      if constexpr (VW == 4) {
        const uint4 x = ok ? *reinterpret_cast<const uint4*>(src) : uint4{0u, 0u, 0u, 0u};
        tile.vw[v][0] = x.x;
        tile.vw[v][1] = x.y;
        tile.vw[v][2] = x.z;
        tile.vw[v][3] = x.w;
      } else {
        const uint2 x = ok ? *reinterpret_cast<const uint2*>(src) : uint2{0u, 0u};
        tile.vw[v][0] = x.x;
        tile.vw[v][1] = x.y;
      }
      tile.ks[v] = ok ? __half2float(k_scales[sbase + size_t(tk) * KVH]) : 0.0f;
      tile.vs[v] = ok ? __half2float(v_scales[sbase + size_t(tk) * KVH]) : 0.0f;
    }
  };

  static_assert(PREFETCH >= 0 && PREFETCH <= 2, "PC_TC_PREFETCH: 0, 1 or 2 tiles ahead");
  PcTcTile<KW, VW> tile;
  PcTcTile<KW, VW> next;   // tile it + 1 (PREFETCH >= 1)
  PcTcTile<KW, VW> after;  // tile it + 2 (PREFETCH == 2)
  if (PREFETCH >= 1 && ntiles > 0) {
    load_tile(0, next);
  }
  if (PREFETCH >= 2 && ntiles > 1) {
    load_tile(1, after);
  }
  for (int it = 0; it < ntiles; ++it) {
    if constexpr (PREFETCH == 2) {
      tile = next;
      next = after;
      if (it + 2 < ntiles) {
        load_tile(it + 2, after);  // in flight while this tile and the next compute
      }
    } else if constexpr (PREFETCH == 1) {
      tile = next;
      if (it + 1 < ntiles) {
        load_tile(it + 1, next);  // in flight while this tile computes
      }
    } else {
      load_tile(it, tile);
    }
    const auto& kw = tile.kw;
    const auto& vw = tile.vw;
    const auto& ks = tile.ks;
    const auto& vs = tile.vs;
    bool valid[4];
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      valid[v] = tile.tok0 + 2 * t + (v & 1) + 8 * (v >> 1) < tok_end;
    }

    // S = Q K^T: half hf covers tokens 8 hf .. 8 hf + 7 (B column g = token g + 8 hf).
    float s[2][4];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[hf][i] = 0.0f;
      }
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        const uint32_t w = kw[hf][kk];
        const uint32_t b[2] = {pc_i8x2_h2(__byte_perm(w, 0u, 0x0100)),
                               pc_i8x2_h2(__byte_perm(w, 0u, 0x0302))};
        pc_mma(s[hf], qa[kk], b);
        if constexpr (SPLIT && !LO_ROWS) {
          pc_mma(s[hf], qa_lo[kk], b);
        }
      }
      if constexpr (SPLIT && LO_ROWS) {  // row g's score: its high part plus its low part
        s[hf][0] += s[hf][2];
        s[hf][1] += s[hf][3];
      }
    }
    // Scores in base-2 units; s[hf][0..1]: row g, tokens 8 hf + 2t + {0, 1}; [2..3]: row g + 8.
    float m_tile[2] = {m[0], m[1]};
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int v = 2 * hf + (i & 1);
        const int h = i >> 1;
        s[hf][i] = valid[v] ? s[hf][i] * row_sc[h] * ks[v] : NEG;
        m_tile[h] = fmaxf(m_tile[h], s[hf][i]);
      }
    }
    float vmax = fmaxf(fmaxf(vs[0], vs[1]), fmaxf(vs[2], vs[3]));
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      m_tile[0] = fmaxf(m_tile[0], __shfl_xor_sync(0xffffffffu, m_tile[0], o));
      m_tile[1] = fmaxf(m_tile[1], __shfl_xor_sync(0xffffffffu, m_tile[1], o));
      vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, o));
    }
    // The tile's weights go into fp16 as p v_scale 2^(13 - e): below 2^14, normal unless tiny.
    // (A tile past the end keeps the exponent: its weights are all 0.)
    const int new_exp = vmax > 0.0f ? 13 - max(pc_ilogb(vmax), -40) : acc_exp;
    const float to_fp16 = pc_exp2i(new_exp);
    float rescale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float alpha = exp2f(m[h] - m_tile[h]);  // 1 when the max did not move
      m[h] = m_tile[h];
      l[h] *= alpha;
      rescale[h] = alpha * pc_exp2i(new_exp - acc_exp);
    }
    acc_exp = new_exp;
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
      acc[j][0] *= rescale[0];
      acc[j][1] *= rescale[0];
      if constexpr (HIGH) {
        acc[j][2] *= rescale[1];
        acc[j][3] *= rescale[1];
      } else if constexpr (LO_ROWS) {  // row g's low products
        acc[j][2] *= rescale[0];
        acc[j][3] *= rescale[0];
      }
    }
    float pw[2][4];  // weights times the V scale, scaled for fp16
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int v = 2 * hf + (i & 1);
        const int h = i >> 1;
        const float p = valid[v] && (HIGH || h == 0) ? exp2f(s[hf][i] - m[h]) : 0.0f;
        l[h] += p;
        pw[hf][i] = p * vs[v] * to_fp16;
      }
    }
    // P as the A fragment: {rows g, g + 8} x {tokens 2t.., 2t+8..}. The weights' low parts
    // (p keeps ~22 bits, as fp32 p would in effect) go in rows g + 8 (LO_ROWS) or in a second
    // fragment.
    uint32_t pa[4];
    uint32_t pa_lo[4];
    pa[0] = pc_f2_h2(pw[0][0], pw[0][1]);
    pa[2] = pc_f2_h2(pw[1][0], pw[1][1]);
    pa_lo[0] = pc_f2_h2(pc_h_rest(pw[0][0]), pc_h_rest(pw[0][1]));
    pa_lo[2] = pc_f2_h2(pc_h_rest(pw[1][0]), pc_h_rest(pw[1][1]));
    if constexpr (LO_ROWS) {
      pa[1] = pa_lo[0];
      pa[3] = pa_lo[2];
    } else {
      pa[1] = pc_f2_h2(pw[0][2], pw[0][3]);
      pa[3] = pc_f2_h2(pw[1][2], pw[1][3]);
      pa_lo[1] = pc_f2_h2(pc_h_rest(pw[0][2]), pc_h_rest(pw[0][3]));
      pa_lo[3] = pc_f2_h2(pc_h_rest(pw[1][2]), pc_h_rest(pw[1][3]));
    }
    // O += P V: tile j's B column g is V element DV g + j of tokens 2t, 2t+1 / 2t+8, 2t+9.
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
      const int w = j >> 2;
      const uint32_t sel = uint32_t(j & 3) | (uint32_t(4 + (j & 3)) << 8);
      const uint32_t b[2] = {pc_i8x2_h2(__byte_perm(vw[0][w], vw[1][w], sel)),
                             pc_i8x2_h2(__byte_perm(vw[2][w], vw[3][w], sel))};
      pc_mma(acc[j], pa, b);
      if constexpr (!LO_ROWS) {
        pc_mma(acc[j], pa_lo, b);
      }
    }
  }

  // The row sums over the lane quad; the warp's rows out to shared memory.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
  const float unscale = pc_exp2i(-acc_exp);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    if (r >= R) {
      continue;
    }
    if (t == 0) {
      sm_ml[(warp * R + r) * 2] = m[h];
      sm_ml[(warp * R + r) * 2 + 1] = l[h];
    }
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
      float o0 = acc[j][2 * h];
      float o1 = acc[j][2 * h + 1];
      if constexpr (LO_ROWS) {  // plus row g's low products (rows g + 8)
        o0 += acc[j][2];
        o1 += acc[j][3];
      }
      sm_acc[(warp * R + r) * D + DV * (2 * t) + j] = o0 * unscale;
      sm_acc[(warp * R + r) * D + DV * (2 * t + 1) + j] = o1 * unscale;
    }
  }
}

// ==== kernel: paged_attention ====
//   inputs:  q [B, H, L, D] T; k_pool, v_pool [NB, BS, KVH, D] T; block_tables int32 [B, MB];
//            context_lens int32 [B] (tokens the LAST query token of each row attends to, its own
//            included); scale float32 [1]
//   outputs: out [B, H, L * P, D] O (row ((b * H + h) * L + l) * P + p; P = partitions,
//            O = T when PART == 0, float for split-K partials, each normalised by its own sum)
//            stats [B, H, L * P, 2] float: (max scaled score, softmax denominator) per row
//   template: T, O, D (head dim), BS (block size), G (query heads per KV head), QT (query tokens
//             per thread block), NW (warps per block), PART (tokens per partition; 0 = all)
//   grid (32 * NW * P, KVH, B * ceil(L / QT)) threads, block (32 * NW, 1, 1)
//   paged_attention_q8 (PC_KV8): k_pool, v_pool int8; k_scales, v_scales [NB, BS, KVH] __half
//   after v_pool.
// Work split: a warp is TPW lane groups of TPT lanes; its lane `sub` holds head-dim elements
// [sub * VEC, sub * VEC + VEC) of a row (16-byte loads, 8-byte for int8: a row read by the group
// in one coalesced access). The warp walks its KV blocks in steps of STEP = TPW * NT tokens (a
// whole block at the 8B shape); in a step a group takes NT tokens (grp, grp + TPW, ...), and
// every lane issues all of the step's K and V loads before it needs the first, into raw
// registers (PcRaw), converted only when used. Software pipeline: V of step i is loaded while
// the scores of step i are computed from K (loaded during step i - 1), K of step i + 1 while
// the softmax and p.v of step i run. q.k is a log2(TPT)-step xor reduction inside the group.
// Each group keeps its own fp32 online softmax (max, sum, output) per row over its tokens, with
// ONE max / rescale per step and row (not per token); the groups of a warp are merged with
// shuffles at the end, the warps through shared memory.
#if PC_KV8
using KV = int8_t;  // an 8-bit pool: the element is q * (its slot's, its KV head's) scale
#else
using KV = T;
#endif
constexpr int WARP = 32;
constexpr unsigned FULL = 0xffffffffu;
constexpr int VEC = PC_VEC;  // head-dim elements per lane
constexpr int USED = D / VEC;  // lanes of a group holding elements (8, 10, 12, 16)
constexpr int TPT = USED <= 8 ? 8 : 16;  // lanes per token (a power of two)
constexpr int TPW = WARP / TPT;  // tokens a warp works on at once
constexpr int R = QT * G;  // rows of this block: row r = query token r / G, head r % G
// Tokens per lane per step: registers hold NT raw K and V rows (<= 32 words each) and R * NT
// scores (<= 32), and a step stays inside one KV block.
// At the 8B shape (R = 4, bf16 or int8, BS 16): NT = 4, a step is half a block. Measured on the
// H200 (bench/results/kv8.md, 64 x 2048 tokens): NT = 4 takes 0.89x NT = 8's time in 16 bits and
// 0.84x in 8 bits: NT = 8 (~250 registers, 2 blocks of 4 warps per SM) loses more occupancy than
// its deeper pipeline buys.
#ifdef PC_NT
constexpr int NT_MAX = PC_NT;  // a power of two; scripts/gpu/kv8_attention.py --step-tokens
#else
constexpr int NT_RAW = sizeof(KV) == 4 ? 4 : 8;
constexpr int NT_ROWS = R <= 8 ? 4 : 2;
constexpr int NT_MAX = NT_RAW < NT_ROWS ? NT_RAW : NT_ROWS;
#endif
constexpr int NT = BS / TPW < NT_MAX ? BS / TPW : NT_MAX;
constexpr int STEP = TPW * NT;  // tokens per step of a warp (divides BS)
constexpr int SPB = BS / STEP;  // steps per KV block
constexpr float NEG = -1.0e30f;  // finite "minus infinity": no inf arithmetic under fast math
static_assert(D % VEC == 0 && USED <= 16, "head dim: a multiple of 8, at most 128");
static_assert(BS % TPW == 0 && BS <= WARP, "block size");
static_assert(BS % STEP == 0 && NT >= 1, "a step lies inside one KV block");
static_assert(PART % BS == 0, "a partition holds whole blocks");
static_assert(NW >= 1 && NW * WARP <= 1024, "block size");
static_assert(QT >= 1 && (QT == 1 || PART == 0), "prefill rows are never split");

#if PC_KV8
#ifndef PC_TC_PREFETCH
#define PC_TC_PREFETCH 1  // scripts/gpu/kv8_attention.py --define PC_TC_PREFETCH=0 times without
#endif
#ifndef PC_TC_LO_ROWS
#define PC_TC_LO_ROWS 0  // 1: the low parts in the A fragment's spare rows (pc_tc_warp), untimed
#endif
constexpr bool TC = pc_tc_shape<D, BS, G, QT>();  // decode on the tensor cores (pc_tc_warp)
#else
constexpr bool TC = false;
#endif
__shared__ float sm_ml[NW > 1 || TC ? NW * R * 2 : 1];   // per (warp, row): max, sum
__shared__ float sm_acc[NW > 1 || TC ? NW * R * D : 1];  // per (warp, row): unnormalised output

const int lane = int(threadIdx.x) & (WARP - 1);
const int warp = int(threadIdx.x) / WARP;
const int grp = lane / TPT;  // which token of a step this lane's group takes
const int sub = lane - grp * TPT;  // which VEC elements of the row this lane holds
const bool holds = sub < USED;
const int part = int(blockIdx.x);
const int num_parts = int(gridDim.x);
const int kvh = int(blockIdx.y);
const int L = q_shape[2];
const int tiles = (L + QT - 1) / QT;
const int b = int(blockIdx.z) / tiles;
const int l0 = (int(blockIdx.z) - b * tiles) * QT;
const int KVH = k_pool_shape[2];
const int H = KVH * G;
const int MB = block_tables_shape[1];
const int ctx = context_lens[b];
// Scores in base-2 units (q scaled by log2 e): exp2f is one MUFU instruction; the statistics
// are written back in natural units.
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
const float sc = scale[0] * LOG2E;

// Query token l0 + qi attends to tokens [0, lim[qi]); tokens past L get none.
int lim[QT];
for (int qi = 0; qi < QT; ++qi) {
  lim[qi] = l0 + qi < L ? ctx - L + 1 + l0 + qi : 0;
}
const int need = lim[min(QT, L - l0) - 1];  // the block's last real query token sees most
const int tok_begin = part * PART;
if (tok_begin >= need) {
  return;  // the whole block: this partition lies past the end of sequence b
}
const int tok_end = PART > 0 ? min(need, tok_begin + PART) : need;
const int blk_begin = tok_begin / BS;
const int blk_end = (tok_end + BS - 1) / BS;

#if PC_KV8
if constexpr (TC) {  // tensor cores: this warp's rows straight to shared memory
  pc_tc_warp<T, KV, TC ? D : 64, TC ? BS : 16, TC ? G : 1, NW, PC_TC_PREFETCH,
             PC_TC_LO_ROWS != 0>(
      q + ((size_t(b) * H + size_t(kvh) * G) * L + l0) * D, size_t(L) * D, k_pool, v_pool,
      k_scales, v_scales, block_tables + size_t(b) * MB, KVH, kvh, blk_begin, blk_end, tok_end,
      sc, sm_ml, sm_acc);
} else
#endif
{  // SIMT
  // q of the R rows (this lane's elements), scaled, in fp32 registers.
  float qv[R][VEC];
  for (int r = 0; r < R; ++r) {
    const int qi = r / G;
    const int g = r - qi * G;
    const int l = min(l0 + qi, L - 1);
    const T* qh = q + ((size_t(b) * H + size_t(kvh) * G + g) * L + l) * D + sub * VEC;
    for (int i = 0; i < VEC; ++i) {
      qv[r][i] = holds ? pc_f32(qh[i]) * sc : 0.0f;
    }
  }

  float m[R];
  float l[R];
  float acc[R][VEC];
  for (int r = 0; r < R; ++r) {
    m[r] = NEG;
    l[r] = 0.0f;
    for (int i = 0; i < VEC; ++i) {
      acc[r][i] = 0.0f;
    }
  }

  const size_t tok_stride = size_t(KVH) * D;  // elements between two slots of a block
  const size_t blk_stride = size_t(BS) * tok_stride;
  const KV* k_head = k_pool + size_t(kvh) * D + sub * VEC;
  const KV* v_head = v_pool + size_t(kvh) * D + sub * VEC;
  const int* table = block_tables + size_t(b) * MB;

  // This warp's KV blocks are blk_begin + warp + NW * n, n < nblk: SPB steps each.
  const int nblk = blk_end - blk_begin > warp ? (blk_end - blk_begin - warp + NW - 1) / NW : 0;
  const int nsteps = nblk * SPB;

  // The step whose K is loaded (or in flight): its physical block, its first token's position in
  // the sequence and its first slot in the block. Lane j holds the table entry of the warp's
  // block 32 * chunk + j (one coalesced read, each entry read once); __shfl_sync hands it out.
  int my_entry = 0;
  int nx_phys = 0;
  int nx_tok = 0;
  int nx_slot0 = 0;
  PcRaw<KV> kw[NT];  // raw K of that step: token grp + TPW * j of the step
#if PC_KV8
  float ksc[NT];  // their K scales
  // The scale slot of token t of physical block phys, for this KV head.
  auto scale_slot = [&](int phys, int t) -> size_t { return (size_t(phys) * BS + t) * KVH + kvh; };
#endif
  // Locates step st and issues its K loads.
  auto fetch_k = [&](int st) {
    const int n = st / SPB;
    const int c = st - n * SPB;
    if (c == 0 && (n & (WARP - 1)) == 0) {  // a new chunk of 32 table entries
      const int mine = n + lane;
      my_entry = mine < nblk ? table[blk_begin + warp + mine * NW] : 0;
    }
    const int j = n & (WARP - 1);
    const int phys = __shfl_sync(FULL, my_entry, j);
    nx_phys = phys;
    nx_slot0 = c * STEP;
    nx_tok = (blk_begin + warp + n * NW) * BS + nx_slot0;
    const KV* kb = k_head + size_t(phys) * blk_stride;
#pragma unroll
    for (int jt = 0; jt < NT; ++jt) {
      const int t = nx_slot0 + grp + TPW * jt;  // slot in the block
      if (holds && nx_tok + grp + TPW * jt < tok_end) {
        pc_load_raw(kb + t * tok_stride, kw[jt]);
      } else {
        pc_zero_raw(kw[jt]);
      }
#if PC_KV8
      ksc[jt] = nx_tok + grp + TPW * jt < tok_end ? pc_f32(k_scales[scale_slot(phys, t)]) : 0.0f;
#endif
    }
  };

  if (nsteps > 0) {
    fetch_k(0);
  }
  for (int st = 0; st < nsteps; ++st) {
    const int phys = nx_phys;
    const int tok = nx_tok;  // position of the step's first token
    const int slot0 = nx_slot0;

    // V of this step: issued before the scores need K.
    PcRaw<KV> vw[NT];
#if PC_KV8
    float vsc[NT];
#endif
    const KV* vb = v_head + size_t(phys) * blk_stride;
#pragma unroll
    for (int jt = 0; jt < NT; ++jt) {
      const int t = slot0 + grp + TPW * jt;
      if (holds && tok + grp + TPW * jt < tok_end) {
        pc_load_raw(vb + t * tok_stride, vw[jt]);
      } else {
        pc_zero_raw(vw[jt]);
      }
#if PC_KV8
      vsc[jt] = tok + grp + TPW * jt < tok_end ? pc_f32(v_scales[scale_slot(phys, t)]) : 0.0f;
#endif
    }

    // Scores of the step's NT tokens (of this group) for every row, reduced in the group.
    float s[R][NT];
#pragma unroll
    for (int jt = 0; jt < NT; ++jt) {
      float kr[VEC];
      pc_unpack(kw[jt], kr);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float d = 0.0f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          d += qv[r][i] * kr[i];
        }
        s[r][jt] = d;
      }
    }
#pragma unroll
    for (int o = TPT / 2; o > 0; o >>= 1) {  // the whole warp shuffles: uniform
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int jt = 0; jt < NT; ++jt) {
          s[r][jt] += __shfl_xor_sync(FULL, s[r][jt], o);
        }
      }
    }
#if PC_KV8
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int jt = 0; jt < NT; ++jt) {
        s[r][jt] *= ksc[jt];  // k = q8 * scale: the scale factors out of the dot product
      }
    }
#endif

    // K of the next step (kw is free): in flight during this step's softmax and p.v.
    if (st + 1 < nsteps) {
      fetch_k(st + 1);
    }

    // Online softmax, once per step and row: the step's max, one rescale, p = 2^(s - max).
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int lim_r = lim[r / G];
      float m_new = m[r];
#pragma unroll
      for (int jt = 0; jt < NT; ++jt) {
        const int pos = tok + grp + TPW * jt;
        m_new = pos < tok_end && pos < lim_r ? fmaxf(m_new, s[r][jt]) : m_new;
      }
      const float alpha = exp2f(m[r] - m_new);  // 1 when the max did not move
      m[r] = m_new;
      l[r] *= alpha;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        acc[r][i] *= alpha;
      }
#pragma unroll
      for (int jt = 0; jt < NT; ++jt) {
        const int pos = tok + grp + TPW * jt;
        const float p = pos < tok_end && pos < lim_r ? exp2f(s[r][jt] - m_new) : 0.0f;
        l[r] += p;
        s[r][jt] = p;
      }
    }
#pragma unroll
    for (int jt = 0; jt < NT; ++jt) {
      float vr[VEC];
      pc_unpack(vw[jt], vr);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float p = s[r][jt];
#if PC_KV8
        p *= vsc[jt];  // v = q8 * scale: the scale folds into the weight
#endif
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          acc[r][i] += p * vr[i];
        }
      }
    }
  }

  // Merge the TPW lane groups of the warp (xor shuffles across groups; every group ends with the
  // warp's state).
  for (int o = TPT; o < WARP; o <<= 1) {
    for (int r = 0; r < R; ++r) {
      const float m_o = __shfl_xor_sync(FULL, m[r], o);
      const float l_o = __shfl_xor_sync(FULL, l[r], o);
      const float mm = fmaxf(m[r], m_o);
      const float a = exp2f(m[r] - mm);
      const float c = exp2f(m_o - mm);
      l[r] = l[r] * a + l_o * c;
      m[r] = mm;
      for (int i = 0; i < VEC; ++i) {
        const float acc_o = __shfl_xor_sync(FULL, acc[r][i], o);
        acc[r][i] = acc[r][i] * a + acc_o * c;
      }
    }
  }

  // Output row of (query token l0 + qi, head kvh * G + g, this partition).
#define PC_ROW(qi, g) \
    (((size_t(b) * H + size_t(kvh) * G + (g)) * L + l0 + (qi)) * num_parts + part)
  if (NW == 1) {
    for (int r = 0; r < R; ++r) {
      const int qi = r / G;
      const int g = r - qi * G;
      if (l0 + qi >= L) {
        continue;
      }
      const size_t row = PC_ROW(qi, g);
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      if (grp == 0 && holds) {
        for (int i = 0; i < VEC; ++i) {
          out[row * D + sub * VEC + i] = pc_cast<O>(acc[r][i] * inv);
        }
      }
      if (lane == 0) {
        stats[row * 2] = m[r] * LN2;
        stats[row * 2 + 1] = l[r];
      }
    }
    return;
  }

  // Merge the warps' partial softmax states through shared memory.
  for (int r = 0; r < R; ++r) {
    if (lane == 0) {
      sm_ml[(warp * R + r) * 2] = m[r];
      sm_ml[(warp * R + r) * 2 + 1] = l[r];
    }
    if (grp == 0 && holds) {
      for (int i = 0; i < VEC; ++i) {
        sm_acc[(warp * R + r) * D + sub * VEC + i] = acc[r][i];
      }
    }
  }
}

__syncthreads();

for (int idx = int(threadIdx.x); idx < R * D; idx += NW * WARP) {
  const int r = idx / D;
  const int d = idx - r * D;
  const int qi = r / G;
  const int g = r - qi * G;
  if (l0 + qi >= L) {
    continue;
  }
  float M = NEG;
  for (int w = 0; w < NW; ++w) {
    M = fmaxf(M, sm_ml[(w * R + r) * 2]);
  }
  float Lsum = 0.0f;
  float o = 0.0f;
  for (int w = 0; w < NW; ++w) {
    const float lw = sm_ml[(w * R + r) * 2 + 1];
    const float wt = lw > 0.0f ? exp2f(sm_ml[(w * R + r) * 2] - M) : 0.0f;
    Lsum += wt * lw;
    o += wt * sm_acc[(w * R + r) * D + d];
  }
  const size_t row = PC_ROW(qi, g);
  out[row * D + d] = pc_cast<O>(Lsum > 0.0f ? o / Lsum : 0.0f);
  if (d == 0) {
    stats[row * 2] = M * LN2;
    stats[row * 2 + 1] = Lsum;
  }
}
#undef PC_ROW

// ==== kernel: paged_attention_reduce ====
// Split-K reduce (decode, one query token per sequence): merges the partitions written by
// paged_attention with PART > 0.
//   inputs:  part_out [B, H, P, D] float (each row normalised by its own sum);
//            part_stats [B, H, P, 2] float (max score, sum); context_lens int32 [B]
//   outputs: out [B, H, 1, D] T
//   template: T, D, PART
//   grid (32, H, B) threads, block (32, 1, 1): one warp per (sequence, head); lanes split D.
constexpr float NEG = -1.0e30f;
const int lane = int(threadIdx.x);
const int h = int(blockIdx.y);
const int b = int(blockIdx.z);
const int H = part_out_shape[1];
const int P = part_out_shape[2];
const int np = min(P, (context_lens[b] + PART - 1) / PART);  // partitions holding tokens of b
const size_t row0 = (size_t(b) * H + h) * P;

float M = NEG;
for (int p = 0; p < np; ++p) {
  M = fmaxf(M, part_stats[(row0 + p) * 2]);
}
float Lsum = 0.0f;
for (int p = 0; p < np; ++p) {
  Lsum += expf(part_stats[(row0 + p) * 2] - M) * part_stats[(row0 + p) * 2 + 1];
}
const float inv = 1.0f / Lsum;
for (int d = lane; d < D; d += 32) {
  float o = 0.0f;
  for (int p = 0; p < np; ++p) {
    const float w = expf(part_stats[(row0 + p) * 2] - M) * part_stats[(row0 + p) * 2 + 1];
    o += w * part_out[(row0 + p) * D + d];
  }
  out[(size_t(b) * H + h) * D + d] = pc_cast<T>(o * inv);
}
