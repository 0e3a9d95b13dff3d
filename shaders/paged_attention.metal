// Paged decode attention for PagedChat, in the form mx.fast.metal_kernel takes: kernel BODIES
// (MLX generates each signature from the input/output names and template parameters).
// engine/kernels.py splits this file at the "// ==== kernel: NAME ====" lines; the text before
// the first marker (this comment) is not compiled. The same text is compiled on the CPU by the
// emulation harness in tests/kernel_emulation/ (see shaders/README.md).
//
// Pool layout: k_pool, v_pool [num_blocks, BS, num_kv_heads, D], head_dim contiguous.
// 8-bit pools (issue #26): engine/attention/plans.py builds paged_decode_q8 from the same body
// with "#define PC_KV8 1" in front: k_pool / v_pool are int8_t and two more inputs, k_scales /
// v_scales [num_blocks, BS, num_kv_heads] half, hold one scale per (slot, KV head); an element
// is q * s (symmetric, no zero point: engine/kv/int8.py). The K scale multiplies the score
// after the simd_sum, the V scale each V element as it is read.
// Pointers derived from kernel arguments are declared `auto`: small inputs (fewer than 8
// elements) arrive in the `constant` address space, larger ones in `device`.

// ==== kernel: paged_decode ====
// One query token per sequence; K/V read straight from the pool through the block table.
//   inputs:  q [B, H, 1, D] T; k_pool, v_pool [NB, BS, KVH, D] T; block_tables int32 [B, MB];
//            context_lens int32 [B]; scale float32 (0-d)
//   outputs: out [B, H, P, D] O (P = partitions; O = T when PART == 0, float for partials)
//            stats [B, H, P, 2] float: (max score, softmax denominator) per row
//   template: T, O, D (head dim), BS (block size), G (query heads per KV head),
//             NSG (simdgroups per threadgroup), PART (tokens per partition; 0 = whole sequence)
//   paged_decode_q8 (PC_KV8): k_pool, v_pool int8_t; k_scales, v_scales [NB, BS, KVH] half
//   after v_pool.
//   grid (32 * NSG * P, KVH, B), threadgroup (32 * NSG, 1, 1): one threadgroup per
//   (sequence, KV head, partition) serves all G query heads of that KV head, so every K/V byte
//   is read once. Lanes split head_dim (lane holds the contiguous elements lane * EPL + i, so
//   its loads can be merged into wide ones), and q.k is one simd_sum.
//   Simdgroups take the partition's blocks round-robin, keep an fp32 online softmax per head,
//   and are merged through threadgroup memory at the end.
constexpr int SIMD = 32;
constexpr int EPL = (D + SIMD - 1) / SIMD;  // head-dim elements per lane
constexpr bool FULL_LANES = D == EPL * SIMD;  // no lane holds elements past D
constexpr float NEG = -1.0e30f;  // finite "minus infinity": no inf arithmetic under fast math
static_assert(BS >= 1 && BS <= SIMD, "block size: at most one token per lane");
static_assert(PART % BS == 0, "a partition holds whole blocks");
static_assert(NSG >= 1 && NSG * SIMD <= 1024, "threadgroup size");

threadgroup float tg_ml[NSG > 1 ? NSG * G * 2 : 1];   // per (simdgroup, head): max, sum
threadgroup float tg_acc[NSG > 1 ? NSG * G * D : 1];  // per (simdgroup, head): unnormalised out

const int lane = int(thread_index_in_simdgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const int part = int(threadgroup_position_in_grid.x);
const int kvh = int(threadgroup_position_in_grid.y);
const int b = int(threadgroup_position_in_grid.z);
const int num_parts = int(threadgroups_per_grid.x);
const int KVH = k_pool_shape[2];
const int H = KVH * G;
const int MB = block_tables_shape[1];
const int ctx = context_lens[b];

const int tok_begin = part * PART;
if (tok_begin >= ctx) {
  return;  // the whole threadgroup: this partition lies past the end of sequence b
}
const int tok_end = PART > 0 ? min(ctx, tok_begin + PART) : ctx;
const int blk_begin = tok_begin / BS;
const int blk_end = (tok_end + BS - 1) / BS;

// q of the G heads, scaled, in fp32 registers.
float qv[G][EPL];
for (int g = 0; g < G; ++g) {
  auto qh = q + (size_t(b) * H + size_t(kvh) * G + g) * D;
  for (int i = 0; i < EPL; ++i) {
    const int d = lane * EPL + i;
    qv[g][i] = (FULL_LANES || d < D) ? float(qh[d]) * scale : 0.0f;
  }
}

float m[G];
float l[G];
float acc[G][EPL];
for (int g = 0; g < G; ++g) {
  m[g] = NEG;
  l[g] = 0.0f;
  for (int i = 0; i < EPL; ++i) {
    acc[g][i] = 0.0f;
  }
}

const size_t tok_stride = size_t(KVH) * D;  // elements between two slots of a block
const size_t blk_stride = size_t(BS) * tok_stride;
auto k_head = k_pool + size_t(kvh) * D + lane * EPL;
auto v_head = v_pool + size_t(kvh) * D + lane * EPL;
auto table = block_tables + size_t(b) * MB;

for (int base = blk_begin + sg; base < blk_end; base += SIMD * NSG) {
  // This simdgroup's next blocks are base, base + NSG, ...: lane j reads the table entry of the
  // j-th (one coalesced read, each entry read once) and simd_shuffle hands it out.
  const int my_blk = base + lane * NSG;
  const int my_entry = my_blk < blk_end ? table[my_blk] : 0;
  const int nblk = min(SIMD, (blk_end - base + NSG - 1) / NSG);
  for (int j = 0; j < nblk; ++j) {
    const int blk = base + j * NSG;
    const int phys = simd_shuffle(my_entry, ushort(j));
    const int ntok = min(BS, tok_end - blk * BS);
    auto kb = k_head + size_t(phys) * blk_stride;
    auto vb = v_head + size_t(phys) * blk_stride;

    // Scores: lane t keeps the score of token t of the block, per head.
    float s[G];
    for (int g = 0; g < G; ++g) {
      s[g] = NEG;
    }
    // Constant trip count (unrollable: the loads of a block can be in flight together); the
    // guard is uniform over the simdgroup.
    for (int t = 0; t < BS; ++t) {
      if (t < ntok) {
        float kr[EPL];
        for (int i = 0; i < EPL; ++i) {
          kr[i] = (FULL_LANES || lane * EPL + i < D) ? float(kb[t * tok_stride + i]) : 0.0f;
        }
#if PC_KV8
        const float ks = float(k_scales[(size_t(phys) * BS + t) * KVH + kvh]);  // token t's
#endif
        for (int g = 0; g < G; ++g) {
          float qk = 0.0f;
          for (int i = 0; i < EPL; ++i) {
            qk += qv[g][i] * kr[i];
          }
          qk = simd_sum(qk);
#if PC_KV8
          qk *= ks;
#endif
          s[g] = lane == t ? qk : s[g];
        }
      }
    }

    // Online softmax, once per block: new max, rescale, probabilities (lane t: token t).
    for (int g = 0; g < G; ++g) {
      const float m_new = max(m[g], simd_max(s[g]));
      const float alpha = metal::exp(m[g] - m_new);
      const float p = lane < ntok ? metal::exp(s[g] - m_new) : 0.0f;
      l[g] = l[g] * alpha + simd_sum(p);
      m[g] = m_new;
      for (int i = 0; i < EPL; ++i) {
        acc[g][i] *= alpha;
      }
      s[g] = p;
    }

    for (int t = 0; t < BS; ++t) {
      if (t < ntok) {
        float vr[EPL];
        for (int i = 0; i < EPL; ++i) {
          vr[i] = (FULL_LANES || lane * EPL + i < D) ? float(vb[t * tok_stride + i]) : 0.0f;
        }
#if PC_KV8
        const float vs = float(v_scales[(size_t(phys) * BS + t) * KVH + kvh]);
        for (int i = 0; i < EPL; ++i) {
          vr[i] *= vs;
        }
#endif
        for (int g = 0; g < G; ++g) {
          const float pt = simd_shuffle(s[g], ushort(t));
          for (int i = 0; i < EPL; ++i) {
            acc[g][i] += pt * vr[i];
          }
        }
      }
    }
  }
}

// Output rows: (b, h, part) with h = kvh * G + g.
const size_t row0 = (size_t(b) * H + size_t(kvh) * G) * num_parts + part;
if (NSG == 1) {
  for (int g = 0; g < G; ++g) {
    const size_t row = row0 + size_t(g) * num_parts;
    const float inv = 1.0f / l[g];
    for (int i = 0; i < EPL; ++i) {
      const int d = lane * EPL + i;
      if (FULL_LANES || d < D) {
        out[row * D + d] = static_cast<O>(acc[g][i] * inv);
      }
    }
    if (lane == 0) {
      stats[row * 2] = m[g];
      stats[row * 2 + 1] = l[g];
    }
  }
  return;
}

// Merge the simdgroups' partial softmax states through threadgroup memory.
for (int g = 0; g < G; ++g) {
  if (lane == 0) {
    tg_ml[(sg * G + g) * 2] = m[g];
    tg_ml[(sg * G + g) * 2 + 1] = l[g];
  }
  for (int i = 0; i < EPL; ++i) {
    const int d = lane * EPL + i;
    if (FULL_LANES || d < D) {
      tg_acc[(sg * G + g) * D + d] = acc[g][i];
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

for (int idx = sg * SIMD + lane; idx < G * D; idx += NSG * SIMD) {
  const int g = idx / D;
  const int d = idx - g * D;
  float M = NEG;
  for (int r = 0; r < NSG; ++r) {
    M = max(M, tg_ml[(r * G + g) * 2]);
  }
  float L = 0.0f;
  float o = 0.0f;
  for (int r = 0; r < NSG; ++r) {
    const float lr = tg_ml[(r * G + g) * 2 + 1];
    const float w = lr > 0.0f ? metal::exp(tg_ml[(r * G + g) * 2] - M) : 0.0f;
    L += w * lr;
    o += w * tg_acc[(r * G + g) * D + d];
  }
  const size_t row = row0 + size_t(g) * num_parts;
  out[row * D + d] = static_cast<O>(o / L);
  if (d == 0) {
    stats[row * 2] = M;
    stats[row * 2 + 1] = L;
  }
}

// ==== kernel: paged_decode_reduce ====
// Split-K reduce: merges the partitions written by paged_decode (PART > 0).
//   inputs:  part_out [B, H, P, D] float (each row normalised by its own sum);
//            part_stats [B, H, P, 2] float (max score, sum); context_lens int32 [B]
//   outputs: out [B, H, 1, D] T
//   template: T, D, PART
//   grid (32, H, B), threadgroup (32, 1, 1): one simdgroup per (sequence, head); lanes split D.
constexpr float NEG = -1.0e30f;
const int lane = int(thread_index_in_simdgroup);
const int h = int(threadgroup_position_in_grid.y);
const int b = int(threadgroup_position_in_grid.z);
const int H = part_out_shape[1];
const int P = part_out_shape[2];
const int np = min(P, (context_lens[b] + PART - 1) / PART);  // partitions holding tokens of b
const size_t row0 = (size_t(b) * H + h) * P;

float M = NEG;
for (int p = 0; p < np; ++p) {
  M = max(M, part_stats[(row0 + p) * 2]);
}
float L = 0.0f;
for (int p = 0; p < np; ++p) {
  L += metal::exp(part_stats[(row0 + p) * 2] - M) * part_stats[(row0 + p) * 2 + 1];
}
const float inv = 1.0f / L;
for (int d = lane; d < D; d += 32) {
  float o = 0.0f;
  for (int p = 0; p < np; ++p) {
    const float w = metal::exp(part_stats[(row0 + p) * 2] - M) * part_stats[(row0 + p) * 2 + 1];
    o += w * part_out[(row0 + p) * D + d];
  }
  out[(size_t(b) * H + h) * D + d] = static_cast<T>(o * inv);
}
