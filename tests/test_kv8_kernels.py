"""The 8-bit variants of both paged-attention kernels (issue #26): ``paged_decode_q8``
(shaders/paged_attention.metal) and ``paged_attention_q8`` (shaders/paged_attention.cu), the
16-bit bodies compiled with ``PC_KV8`` (int8 pools, one fp16 scale per slot and KV head).

Checked as the 16-bit kernels are (tests/test_kernel_emulation.py, tests/test_cuda_kernel.py):
the CPU emulator runs the very source text over the shape matrix (GQA 1-8, head dims
64/80/96/128, block sizes 8/16/32, fp32/fp16/bf16 queries, ragged lengths 1..4k, one and
several partitions, prefill chunks on CUDA) against a float64 oracle over the dequantized
values (``q * s`` in float64) and against ``reference_decode`` / ``reference_prefill`` on the
same 8-bit pool; planted bugs in the dequantization (a scale of the wrong KV head or of the
block's first slot, int8 read as unsigned, like a missing zero point, the V scale dropped,
K's scale used for V) compile and are caught. The write path's rounding bugs are planted in
tests/test_kv8.py. The CUDA tensor-core decode's compile-time switches (``PC_TC_PREFETCH``,
``PC_TC_LO_ROWS``) run the same checks away from their defaults, and the code a switch turns
on has its own planted bugs. ``-m cuda``: the same on an NVIDIA GPU (scripts/gpu/check.sh
runs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import numpy as np
import pytest

from engine.attention import cuda as cuda_kernels
from engine.attention import dispatch as attention
from engine.attention import metal as metal_kernels
from engine.attention.dispatch import reference_decode, reference_prefill
from tests.kernel_emulation import cuda_generator as cgen
from tests.kernel_emulation import generator as gen
from tests.test_cuda_kernel import PrefillCase, prefill_queries
from tests.test_kernel_emulation import REFERENCE_TOL, TRUTH_TOL, Case, assert_close, make_inputs
from tests.test_kv8 import oracle_dequantize, oracle_quantize

_EMULATION, _WHY_NOT = gen.emulation_available()
needs_gxx = pytest.mark.skipif(not _EMULATION, reason=_WHY_NOT)
needs_cuda = pytest.mark.skipif(
    not cuda_kernels.available(), reason="needs MLX's CUDA backend (an NVIDIA GPU)"
)

# A covering design: every GQA ratio 1/3/4/7/8, head dim 64/80/96/128, block size 8/16/32,
# query dtype, single pass and split-K, several simdgroups/warps, small batches (constant
# address space on Metal) and a 4k context beside short ones.
DECODE_CASES = [
    Case(1, 2, 64, 16, mx.float32, split=False),
    Case(3, 2, 64, 16, mx.float16, split=False, simdgroups=2),
    Case(4, 2, 128, 8, mx.bfloat16, split=True),
    Case(7, 1, 128, 16, mx.float32, split=True),
    Case(8, 1, 64, 32, mx.float16, split=False),
    Case(3, 1, 80, 16, mx.float16, split=True),
    Case(4, 1, 96, 32, mx.float32, split=False, simdgroups=2),
    Case(3, 2, 128, 8, mx.float16, split=False, lens=(20,)),
    Case(4, 2, 128, 16, mx.bfloat16, split=True, lens=(4096, 1, 333)),
    # more than 8 query heads per KV head: the tensor-core path's rows g + 8 (CUDA)
    Case(12, 1, 128, 16, mx.bfloat16, split=False),
    Case(16, 1, 64, 32, mx.float32, split=True),
]
PREFILL_CASES = [
    PrefillCase(4, 2, 64, 16, mx.float32, context=300, chunk=64),
    PrefillCase(1, 2, 128, 8, mx.float16, context=77, chunk=13),
    PrefillCase(3, 1, 80, 32, mx.bfloat16, context=200, chunk=37, warps=1),
    # G = 8 prefills one query token per thread block: CUDA runs it on the tensor cores
    PrefillCase(8, 1, 128, 16, mx.float16, context=150, chunk=11),
]


@dataclass
class Inputs8:
    q: mx.array
    kq: mx.array
    vq: mx.array
    ks: mx.array
    vs: mx.array
    block_tables: mx.array
    context_lens: mx.array
    scale: float
    tables_np: np.ndarray
    blocks_per_seq: list[int]


@cache
def inputs8(case: Case) -> Inputs8:
    """The 16-bit tests' scrambled pool (spare blocks scaled up, so reading one shows),
    quantized by the numpy oracle of the scheme, independently of the engine."""
    inp = make_inputs(case)
    kq, ks = oracle_quantize(np.array(inp.k_pool.astype(mx.float32)))
    vq, vs = oracle_quantize(np.array(inp.v_pool.astype(mx.float32)))
    return Inputs8(inp.q, mx.array(kq), mx.array(vq), mx.array(ks), mx.array(vs),
                   inp.block_tables, inp.context_lens, inp.scale, inp.tables_np,
                   inp.blocks_per_seq)


def _f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def oracle(case: Case, part_tokens: int = 0, chunk: int = 1, q_override=None):
    """float64 attention over the dequantized pool, per partition of ``part_tokens`` (0: one);
    returns (out [B, H, L * P, D] as the kernel lays it out for L = 1, lse [B, H, P])."""
    inp = inputs8(case)
    q = _f64(q_override if q_override is not None else inp.q)
    k = oracle_dequantize(np.array(inp.kq), np.array(inp.ks))
    v = oracle_dequantize(np.array(inp.vq), np.array(inp.vs))
    b_count, heads, _, d = q.shape
    kvh, g = case.kv_heads, case.group
    span = part_tokens or max(case.lens)
    parts = -(-max(case.lens) // span)
    out = np.full((b_count, heads, chunk, parts, d), np.nan)
    lse = np.full((b_count, heads, chunk, parts), np.nan)
    for b, ctx in enumerate(case.lens):
        blocks = inp.tables_np[b, : inp.blocks_per_seq[b]]
        kb = k[blocks].reshape(-1, kvh, d)[:ctx]
        vb = v[blocks].reshape(-1, kvh, d)[:ctx]
        for h in range(heads):
            for i in range(chunk):
                n = ctx - chunk + 1 + i
                scores = kb[:n, h // g] @ q[b, h, i] * inp.scale
                for p in range(parts):
                    lo, hi = p * span, min(n, (p + 1) * span)
                    if lo >= n:
                        break
                    w = np.exp(scores[lo:hi] - scores[lo:hi].max())
                    out[b, h, i, p] = w @ vb[lo:hi, h // g] / w.sum()
                    lse[b, h, i, p] = scores[lo:hi].max() + np.log(w.sum())
    return out, lse


def check_decode(case: Case, plan: list, results: list[list[mx.array]]) -> None:
    inp = inputs8(case)
    template = dict(plan[0].template)
    assert plan[0].kernel.name.endswith("_q8")
    assert (len(plan) == 2) == case.split, "split-K must be used exactly when asked for"
    out = _f64(results[-1][0])
    assert out.shape == (len(case.lens), case.group * case.kv_heads, 1, case.head_dim)
    truth, _ = oracle(case)
    assert_close(out, truth[:, :, 0, :1].reshape(out.shape), TRUTH_TOL[case.dtype],
                 "output vs float64 oracle")
    ref = _f64(reference_decode(inp.q, inp.kq, inp.vq, inp.block_tables, inp.context_lens,
                                inp.scale, k_scales=inp.ks, v_scales=inp.vs))
    assert_close(out, ref, REFERENCE_TOL[case.dtype], "output vs reference_decode (8-bit)")
    p_out, p_lse = oracle(case, template["PART"])
    p_out, p_lse = p_out[:, :, 0], p_lse[:, :, 0]
    parts = p_lse.shape[2]
    stats = _f64(results[0][1])[:, :, :parts]
    valid = ~np.isnan(p_lse)
    lse = stats[..., 0][valid] + np.log(stats[..., 1][valid])
    assert_close(lse, p_lse[valid], (1e-5, 1e-4), "softmax statistics")
    if case.split:
        partial = _f64(results[0][0])[:, :, :parts]
        assert_close(partial[valid], p_out[valid], (1e-5, 1e-5), "split-K partials")


# ---- Metal ----------------------------------------------------------------------------------


def plan_metal(case: Case, sources=None) -> list:
    inp = inputs8(case)
    return metal_kernels.plan_decode(
        inp.q, inp.kq, inp.vq, inp.block_tables, inp.context_lens, inp.scale,
        split=case.split, simdgroups=case.simdgroups, sources=sources,
        k_scales=inp.ks, v_scales=inp.vs)


# ---- CUDA -----------------------------------------------------------------------------------


def plan_cuda(case, sources=None) -> list:
    if isinstance(case, PrefillCase):
        inp = inputs8(case.pool_case)
        return cuda_kernels.plan_attention(
            prefill_queries(case), inp.kq, inp.vq, inp.block_tables, inp.context_lens,
            inp.scale, warps=case.warps, sources=sources, k_scales=inp.ks, v_scales=inp.vs)
    inp = inputs8(case)
    return cuda_kernels.plan_attention(
        inp.q, inp.kq, inp.vq, inp.block_tables, inp.context_lens, inp.scale,
        split=case.split, warps=case.simdgroups, sources=sources, k_scales=inp.ks,
        v_scales=inp.vs)


def check_prefill(case: PrefillCase, plan: list, results: list[list[mx.array]]) -> None:
    pc = case.pool_case
    inp = inputs8(pc)
    q = prefill_queries(case)
    assert len(plan) == 1 and plan[0].kernel.name == "paged_attention_q8"
    out = _f64(results[-1][0])
    truth, _ = oracle(pc, 0, case.chunk, q)
    assert_close(out, truth[:, :, :, 0], TRUTH_TOL[case.dtype], "prefill vs float64 oracle")
    ref = _f64(reference_prefill(q, inp.kq, inp.vq, inp.block_tables[0], case.context,
                                 inp.scale, k_scales=inp.ks, v_scales=inp.vs))
    tol = (5e-3, 5e-3) if case.dtype == mx.float32 and cuda_kernels.available() else (
        REFERENCE_TOL[case.dtype])  # MLX's fp32 causal SDPA runs in TF32 on the H200
    assert_close(out, ref, tol, "prefill vs reference_prefill (8-bit)")


def check_cuda(case, plan, results) -> None:
    if isinstance(case, PrefillCase):
        check_prefill(case, plan, results)
    else:
        check_decode(case, plan, results)


# ---- planted bugs ---------------------------------------------------------------------------

MUTANT_CASE = Case(3, 2, 64, 16, mx.float32, split=True, simdgroups=2)  # KVH > 1, both kernels
# CUDA decodes MUTANT_CASE on the tensor cores (pc_tc_warp); its SIMT body's 8-bit loads are
# planted in a head dim the tensor-core path does not take.
MUTANT_SIMT = Case(3, 2, 80, 16, mx.float32, split=True, simdgroups=2)
MUTANT_TC_BF16 = Case(12, 1, 128, 16, mx.bfloat16, split=False)  # rows g + 8, fp16-exact q
MUTANT_PREFILL = PrefillCase(4, 2, 64, 16, mx.float32, context=100, chunk=20, warps=2)
KERNEL_MARKER = "// ==== kernel: paged_attention ===="
LO_ROWS = "#define PC_TC_LO_ROWS 1"  # the tensor-core decode's low parts in spare MMA rows

CUDA_MUTANTS = {
    # the scale of KV head 0 for every head
    "scale_of_head_0": ("return (size_t(phys) * BS + t) * KVH + kvh;",
                        "return (size_t(phys) * BS + t) * KVH;", MUTANT_SIMT),
    # the block's first slot's scale for every token of the block (a per-block scale)
    "scale_of_the_blocks_first_slot": (
        "return (size_t(phys) * BS + t) * KVH + kvh;",
        "return size_t(phys) * BS * KVH + kvh;", MUTANT_SIMT),
    # int8 read as unsigned: values offset by 256 below zero, as a missing zero point would
    "int8_read_as_unsigned": (
        "__byte_perm(w ^ 0x80808080u, 0x4B000000u, 0x7540 + i % 4)) - 8388736.0f",
        "__byte_perm(w, 0x4B000000u, 0x7540 + i % 4)) - 8388608.0f", MUTANT_SIMT),
    # the V scale never applied
    "v_scale_dropped": (
        "        p *= vsc[jt];  // v = q8 * scale: the scale folds into the weight\n", "",
        MUTANT_SIMT),
    # the K scale never applied
    "k_scale_dropped": (
        "        s[r][jt] *= ksc[jt];  // k = q8 * scale: the scale factors out of the dot"
        " product\n", "", MUTANT_SIMT),
    # K's scale used for V
    "k_scale_for_v": ("pc_f32(v_scales[scale_slot(phys, t)])",
                      "pc_f32(k_scales[scale_slot(phys, t)])", MUTANT_SIMT),
    # the prefill chunk reads the scales of head 0 (prefill shares the load path)
    "prefill_scale_of_head_0": ("return (size_t(phys) * BS + t) * KVH + kvh;",
                                "return (size_t(phys) * BS + t) * KVH;",
                                MUTANT_PREFILL),
    # ---- the tensor-core decode (pc_tc_warp) ----
    # the scales of KV head 0 for every head
    "tc_scales_of_head_0": ("const size_t sbase = (size_t(phys) * BS + slot0) * KVH + kvh;",
                            "const size_t sbase = (size_t(phys) * BS + slot0) * KVH;",
                            MUTANT_CASE),
    # int8 read as unsigned (no re-centring by 128 before the fp16 exponent trick)
    "tc_int8_read_as_unsigned": (
        "const uint32_t biased = ((x ^ 0x64806480u) & 0x00FF00FFu) | 0x64006400u;",
        "const uint32_t biased = (x & 0x00FF00FFu) | 0x64006400u;", MUTANT_CASE),
    # the V scale never applied to the weights
    "tc_v_scale_dropped": ("pw[hf][i] = p * vs[v] * to_fp16;", "pw[hf][i] = p * to_fp16;",
                           MUTANT_CASE),
    # the K scale never applied to the scores
    "tc_k_scale_dropped": ("s[hf][i] * row_sc[h] * ks[v] : NEG;", "s[hf][i] * row_sc[h] : NEG;",
                           MUTANT_CASE),
    # the weights' low fp16 parts dropped (p rounded to fp16 once)
    "tc_low_weight_part_dropped": ("        pc_mma(acc[j], pa_lo, b);\n", "", MUTANT_CASE),
    # ---- the same with PC_TC_LO_ROWS 1: the low parts in the A fragment's rows g + 8 ----
    # the weights' low parts dropped: rows g + 8 of P left empty
    "lo_rows_low_weight_part_dropped": (
        "      pa[1] = pa_lo[0];\n      pa[3] = pa_lo[2];\n",
        "      pa[1] = 0u;\n      pa[3] = 0u;\n", MUTANT_CASE, LO_ROWS),
    # the low products (rows g + 8) never added to their row
    "lo_rows_not_added": ("        o0 += acc[j][2];\n        o1 += acc[j][3];\n", "",
                          MUTANT_CASE, LO_ROWS),
    # the low products not rescaled when the row's max or the tile's exponent moves
    "lo_rows_not_rescaled": (
        "        acc[j][2] *= rescale[0];\n        acc[j][3] *= rescale[0];\n", "", MUTANT_CASE,
        LO_ROWS),
    # fp32 queries: the low part of q (rows g + 8 of Q) dropped
    "lo_rows_query_low_part_dropped": (
        "        qa[kk][2 * half + 1] = qa_lo[kk][2 * half];\n", "", MUTANT_CASE, LO_ROWS),
    # fp32 queries: the low scores (rows g + 8 of S) never added to the row's score
    "lo_rows_low_scores_not_added": (
        "        s[hf][0] += s[hf][2];\n        s[hf][1] += s[hf][3];\n", "", MUTANT_CASE,
        LO_ROWS),
    # the accumulator's power of two not carried from tile to tile
    "tc_exponent_not_carried": ("rescale[h] = alpha * pc_exp2i(new_exp - acc_exp);",
                                "rescale[h] = alpha;", MUTANT_CASE),
    # K's two column pairs swapped: q.k pairs head-dim elements that differ
    "tc_k_columns_swapped": ("pc_i8x2_h2(__byte_perm(w, 0u, 0x0100)),",
                             "pc_i8x2_h2(__byte_perm(w, 0u, 0x0302)),", MUTANT_CASE),
    # each lane of a quad keeps its own running max (the row's max is not shared)
    "tc_row_max_not_shared": (
        "      m_tile[0] = fmaxf(m_tile[0], __shfl_xor_sync(0xffffffffu, m_tile[0], o));\n",
        "", MUTANT_CASE),
    # rows g + 8 (heads 8..15 of the group) never rescaled when their max grows
    "tc_high_rows_not_rescaled": ("        acc[j][2] *= rescale[1];\n", "", MUTANT_TC_BF16),
}

METAL_MUTANTS = {
    "scale_of_head_0": (
        "const float ks = float(k_scales[(size_t(phys) * BS + t) * KVH + kvh]);",
        "const float ks = float(k_scales[(size_t(phys) * BS + t) * KVH]);"),
    "scale_of_the_blocks_first_slot": (
        "const float vs = float(v_scales[(size_t(phys) * BS + t) * KVH + kvh]);",
        "const float vs = float(v_scales[size_t(phys) * BS * KVH + kvh]);"),
    "int8_read_as_unsigned": (
        "float(kb[t * tok_stride + i]) : 0.0f;",
        "float(uchar(kb[t * tok_stride + i])) : 0.0f;"),
    "v_scale_dropped": ("          vr[i] *= vs;\n", ""),
    "k_scale_not_applied": ("          qk *= ks;\n", ""),
}


def _replaced_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"mutation site {old!r} not found exactly once"
    return text.replace(old, new)


def mutated(path, kernels, old: str, new: str) -> dict:
    return kernels.KERNELS.parse(_replaced_once(path.read_text(), old, new))


# The tensor-core decode's compile-time switches, each away from its default (scripts/gpu/
# kv8_attention.py --define times them): its load pipeline 0 or 2 tiles ahead (default 1), the
# low parts in the spare MMA rows: short, ragged and long contexts, fp32 and bf16 queries.
SWITCHES = ["#define PC_TC_PREFETCH 0", "#define PC_TC_PREFETCH 2", LO_ROWS]
SWITCH_CASES = [MUTANT_CASE, Case(4, 2, 128, 16, mx.bfloat16, split=False, lens=(4096, 1, 33))]


def cuda_source(text: str, defines: str = "") -> dict:
    """The kernels of ``text`` with ``defines`` at the top of the attention body."""
    assert text.count(KERNEL_MARKER) == 1
    if defines:
        text = text.replace(KERNEL_MARKER, f"{KERNEL_MARKER}\n{defines}")
    return cuda_kernels.KERNELS.parse(text)


def metal_mutant(name: str) -> dict:
    return mutated(metal_kernels.SHADER_PATH, metal_kernels, *METAL_MUTANTS[name])


def _cuda_text() -> str:
    return cuda_kernels.CUDA_SHADER_PATH.read_text()


def cuda_mutant(name: str) -> dict:
    """A planted bug (old -> new) in the CUDA source, with the entry's defines if it has
    them (a bug in code a compile-time switch turns on)."""
    old, new, _, *defines = CUDA_MUTANTS[name]
    return cuda_source(_replaced_once(_cuda_text(), old, new), *defines)


@pytest.fixture(scope="module")
def prebuilt():
    """Compile every program this module needs, in parallel (cached across runs)."""
    if not _EMULATION:
        pytest.skip(_WHY_NOT)
    sources = []
    for case in [*DECODE_CASES, MUTANT_CASE]:
        sources += gen.plan_sources(plan_metal(case))
        sources += cgen.plan_sources(plan_cuda(case))
    for case in [*PREFILL_CASES, MUTANT_PREFILL, MUTANT_SIMT, MUTANT_TC_BF16]:
        sources += cgen.plan_sources(plan_cuda(case))
    for name in METAL_MUTANTS:
        sources += gen.plan_sources(plan_metal(MUTANT_CASE, metal_mutant(name)))
    for name, (_, _, case, *_) in CUDA_MUTANTS.items():
        sources += cgen.plan_sources(plan_cuda(case, cuda_mutant(name)))
    for switch in SWITCHES:
        for case in SWITCH_CASES:
            sources += cgen.plan_sources(plan_cuda(case, cuda_source(_cuda_text(), switch)))
    gen.prebuild(sources)


@needs_gxx
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.id)
def test_emulated_metal_q8_decode(prebuilt, case):
    plan = plan_metal(case)
    check_decode(case, plan, gen.run_plan(plan))


@needs_gxx
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.id)
def test_emulated_cuda_q8_decode(prebuilt, case):
    plan = plan_cuda(case)
    check_decode(case, plan, cgen.run_plan(plan))


@needs_gxx
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: c.id)
def test_emulated_cuda_q8_prefill(prebuilt, case):
    plan = plan_cuda(case)
    check_prefill(case, plan, cgen.run_plan(plan))


@needs_gxx
def test_mutant_cases_pass_unmutated(prebuilt):
    check_decode(MUTANT_CASE, plan_metal(MUTANT_CASE), gen.run_plan(plan_metal(MUTANT_CASE)))
    for case in (MUTANT_CASE, MUTANT_SIMT, MUTANT_TC_BF16, MUTANT_PREFILL):
        plan = plan_cuda(case)
        check_cuda(case, plan, cgen.run_plan(plan))


@needs_gxx
@pytest.mark.parametrize("switch", SWITCHES)
@pytest.mark.parametrize("case", SWITCH_CASES, ids=lambda c: c.id)
def test_emulated_cuda_q8_tensor_core_switches(prebuilt, case, switch):
    plan = plan_cuda(case, cuda_source(_cuda_text(), switch))
    check_decode(case, plan, cgen.run_plan(plan))


@needs_gxx
@pytest.mark.parametrize("name", list(METAL_MUTANTS))
def test_metal_q8_planted_bug_is_caught(prebuilt, name):
    plan = plan_metal(MUTANT_CASE, metal_mutant(name))
    results = gen.run_plan(plan)  # EmulatorError here fails the test: not "caught"
    with pytest.raises(AssertionError):
        check_decode(MUTANT_CASE, plan, results)


@needs_gxx
@pytest.mark.parametrize("name", list(CUDA_MUTANTS))
def test_cuda_q8_planted_bug_is_caught(prebuilt, name):
    case = CUDA_MUTANTS[name][2]
    plan = plan_cuda(case, cuda_mutant(name))
    results = cgen.run_plan(plan)
    with pytest.raises(AssertionError):
        check_cuda(case, plan, results)


def test_q8_variants_share_the_16_bit_body():
    for kernels, attend in ((metal_kernels, "paged_decode"), (cuda_kernels, "paged_attention")):
        src = kernels.KERNELS.sources()
        q8 = src[attend + "_q8"]
        assert q8.source == "#define PC_KV8 1\n" + src[attend].source
        assert q8.input_names[3:5] == ("k_scales", "v_scales")


def test_plans_refuse_mismatched_8bit_arrays():
    inp = inputs8(DECODE_CASES[0])
    args = (inp.q, inp.kq, inp.vq, inp.block_tables, inp.context_lens, inp.scale)
    with pytest.raises(ValueError, match="both k_scales and v_scales"):
        metal_kernels.plan_decode(*args, k_scales=inp.ks)
    with pytest.raises(ValueError, match="8-bit pool is int8"):
        cuda_kernels.plan_attention(inp.q, inp.kq.astype(mx.float32), inp.vq, *args[3:],
                                    k_scales=inp.ks, v_scales=inp.vs)
    with pytest.raises(ValueError, match="scales must be"):
        cuda_kernels.plan_attention(*args, k_scales=inp.ks.astype(mx.float32), v_scales=inp.vs)


# ---- the real GPU ---------------------------------------------------------------------------


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("case", [*DECODE_CASES, *PREFILL_CASES], ids=lambda c: c.id)
def test_cuda_q8_kernel_matches_reference(case):
    plan = plan_cuda(case)
    results = cuda_kernels.KERNELS.run(plan)
    mx.eval(results)
    check_cuda(case, plan, results)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", list(CUDA_MUTANTS))
def test_cuda_q8_planted_bug_is_caught_on_the_gpu(name):
    case = CUDA_MUTANTS[name][2]
    plan = plan_cuda(case, cuda_mutant(name))
    results = cuda_kernels.KERNELS.run(plan)
    mx.eval(results)
    with pytest.raises(AssertionError):
        check_cuda(case, plan, results)


@pytest.mark.cuda
@needs_cuda
def test_cuda_q8_dispatch_through_attention():
    case = DECODE_CASES[2]
    inp = inputs8(case)
    args = (inp.q, inp.kq, inp.vq, inp.block_tables, inp.context_lens, inp.scale)
    sc = {"k_scales": inp.ks, "v_scales": inp.vs}
    out = attention.paged_decode(*args, use_kernel=True, **sc)
    ref = attention.paged_decode(*args, use_kernel=False, **sc)
    assert_close(_f64(out), _f64(ref), REFERENCE_TOL[case.dtype], "paged_decode q8 kernel path")
