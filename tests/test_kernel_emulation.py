"""The Metal paged-decode kernels (shaders/paged_attention.metal), checked two ways:

* here, on the CPU: the same source text, wrapped in the signature mx.fast.metal_kernel
  generates, is compiled with g++ against tests/kernel_emulation/metal_emu.h and run over a
  matrix of shapes; its output is compared with
  ``engine.attention.dispatch.reference_decode`` and with an independent float64 numpy oracle;
* on a Mac (``-m mac``): the same launch plans run on the GPU, compared the same way.

Planted bugs (mutated copies of the shader) must make the comparison fail.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import numpy as np
import pytest

from engine.attention import dispatch as attention
from engine.attention import metal as kernels
from engine.attention import plans as kernel_plans
from engine.attention.dispatch import reference_decode
from tests.kernel_emulation import generator as gen

CONTEXT_LENS = (1, 15, 16, 17, 511, 512, 513, 2049)  # one ragged batch
SPARE_BLOCKS = 9  # pool blocks no sequence owns; unused table entries point at them too

_EMULATION, _WHY_NOT = gen.emulation_available()
needs_gxx = pytest.mark.skipif(not _EMULATION, reason=_WHY_NOT)
needs_metal = pytest.mark.skipif(
    not attention.kernel_available(), reason="needs the Metal backend (a Mac)"
)


@dataclass(frozen=True)
class Case:
    group: int  # query heads per KV head
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: mx.Dtype
    split: bool  # multi-partition (split-K + reduce) or single pass
    simdgroups: int | None = None  # None: engine.attention.metal chooses
    lens: tuple[int, ...] = CONTEXT_LENS  # context length of each sequence

    @property
    def id(self) -> str:
        dt = {mx.float32: "f32", mx.float16: "f16", mx.bfloat16: "bf16"}[self.dtype]
        nsg = f"-sg{self.simdgroups}" if self.simdgroups else ""
        mode = "split" if self.split else "single"
        if self.lens != CONTEXT_LENS:
            mode += "-b" + "_".join(map(str, self.lens))
        return (
            f"g{self.group}-kv{self.kv_heads}-d{self.head_dim}-bs{self.block_size}-{dt}-{mode}{nsg}"
        )


# A covering design over the axes (full cross product would be 180 builds): every GQA ratio,
# head dim, block size, dtype, single/multi-partition and 1/2/4/8 simdgroups appears; each GQA
# ratio meets both head dims 64/128 and both modes, each block size and dtype both modes.
CASES = [
    Case(1, 2, 64, 16, mx.float32, split=False),
    Case(3, 1, 128, 8, mx.float16, split=True),
    Case(4, 2, 64, 32, mx.float16, split=False),
    Case(7, 1, 128, 16, mx.float32, split=True),
    Case(8, 1, 64, 8, mx.float32, split=True),
    Case(8, 1, 128, 32, mx.bfloat16, split=False),
    Case(4, 1, 128, 16, mx.bfloat16, split=True),
    Case(1, 1, 128, 32, mx.float32, split=True, simdgroups=1),
    Case(3, 2, 64, 16, mx.float16, split=False, simdgroups=2),
    Case(7, 1, 64, 8, mx.float16, split=False, simdgroups=1),
    Case(3, 1, 80, 16, mx.float16, split=True),  # head dim not a multiple of 32
    Case(4, 1, 96, 32, mx.float32, split=False, simdgroups=2),
    Case(4, 1, 64, 16, mx.float16, split=True, simdgroups=8),  # widest threadgroup (256)
    # Batches under 8: MLX passes context_lens (and here a 3-entry block table) in the
    # `constant` address space.
    Case(3, 2, 128, 8, mx.float16, split=False, lens=(20,)),
    Case(8, 1, 64, 16, mx.bfloat16, split=True, lens=(3, 700)),
]

# The planted-bug case: split (both kernels) with 2 simdgroups (threadgroup merge).
MUTANT_CASE = Case(4, 1, 64, 16, mx.float32, split=True, simdgroups=2)

# |kernel - truth| <= atol + rtol * |truth|. The kernel accumulates in fp32 and rounds once.
TRUTH_TOL = {mx.float32: (1e-5, 1e-5), mx.float16: (1e-3, 1e-3), mx.bfloat16: (4e-3, 8e-3)}
# MLX's reference rounds intermediates to the input dtype: a looser band around it.
REFERENCE_TOL = {mx.float32: (1e-4, 2e-5), mx.float16: (5e-3, 5e-3), mx.bfloat16: (3e-2, 3e-2)}


@dataclass
class Inputs:
    q: mx.array
    k_pool: mx.array
    v_pool: mx.array
    block_tables: mx.array
    context_lens: mx.array
    scale: float
    tables_np: np.ndarray
    blocks_per_seq: list[int]


@cache
def make_inputs(case: Case, seed: int = 0) -> Inputs:
    rng = np.random.default_rng(seed)
    bs, d, kvh = case.block_size, case.head_dim, case.kv_heads
    heads = case.group * kvh
    nblocks = [-(-c // bs) for c in case.lens]
    max_blocks = max(nblocks)
    num_blocks = sum(nblocks) + SPARE_BLOCKS
    # Scrambled tables: a random permutation of the pool handed out in order, so each
    # sequence's blocks are non-contiguous and non-monotonic; unused entries hold random ids.
    ids = rng.permutation(num_blocks)
    tables = rng.integers(0, num_blocks, size=(len(case.lens), max_blocks), dtype=np.int32)
    start = 0
    for row, n in enumerate(nblocks):
        tables[row, :n] = ids[start : start + n]
        start += n
    # Peaky scores (q scaled up) so that online-softmax rescaling matters.
    q = rng.standard_normal((len(case.lens), heads, 1, d)).astype(np.float32) * 2.0
    k = rng.standard_normal((num_blocks, bs, kvh, d)).astype(np.float32)
    v = rng.standard_normal((num_blocks, bs, kvh, d)).astype(np.float32)
    spare = ids[start:]
    k[spare] *= 4.0  # reading a block no sequence owns shows
    v[spare] += 8.0
    return Inputs(
        q=mx.array(q).astype(case.dtype),
        k_pool=mx.array(k).astype(case.dtype),
        v_pool=mx.array(v).astype(case.dtype),
        block_tables=mx.array(tables),
        context_lens=mx.array(np.asarray(case.lens, dtype=np.int32)),
        scale=d**-0.5,
        tables_np=tables,
        blocks_per_seq=nblocks,
    )


def _f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


@cache
def oracle(case: Case, part_tokens: int = 0):
    """float64 attention straight from the definition (numpy, no MLX kernels), on the very
    values the kernel reads. Returns (out [B,H,P,D], logsumexp [B,H,P]) per partition of
    ``part_tokens`` tokens (0: the whole context; rows past a sequence's end are NaN)."""
    inp = make_inputs(case)
    q, k, v = _f64(inp.q), _f64(inp.k_pool), _f64(inp.v_pool)
    b_count, heads, _, d = q.shape
    kvh, g = case.kv_heads, case.group
    span = part_tokens or max(case.lens)
    parts = -(-max(case.lens) // span)
    out = np.full((b_count, heads, parts, d), np.nan)
    lse = np.full((b_count, heads, parts), np.nan)
    for b, ctx in enumerate(case.lens):
        blocks = inp.tables_np[b, : inp.blocks_per_seq[b]]
        kb = k[blocks].reshape(-1, kvh, d)[:ctx]
        vb = v[blocks].reshape(-1, kvh, d)[:ctx]
        for h in range(heads):
            scores = kb[:, h // g] @ q[b, h, 0] * inp.scale
            for p in range(parts):
                lo, hi = p * span, min(ctx, (p + 1) * span)
                if lo >= ctx:
                    break
                s = scores[lo:hi]
                m = s.max()
                w = np.exp(s - m)
                out[b, h, p] = w @ vb[lo:hi, h // g] / w.sum()
                lse[b, h, p] = m + np.log(w.sum())
    return out, lse


def assert_close(actual: np.ndarray, expected: np.ndarray, tol, what: str) -> None:
    rtol, atol = tol
    err = np.abs(actual - expected)
    bad = ~(err <= atol + rtol * np.abs(expected))  # NaN counts as bad
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements differ; first at {idx}: "
            f"{actual[idx]!r} vs {expected[idx]!r} (max error {np.nanmax(err):.3g}, "
            f"NaN {int(np.isnan(actual).sum())})"
        )


def plan_for(case: Case, sources=None) -> list[kernel_plans.Launch]:
    inp = make_inputs(case)
    return kernels.plan_decode(
        inp.q,
        inp.k_pool,
        inp.v_pool,
        inp.block_tables,
        inp.context_lens,
        inp.scale,
        split=case.split,
        simdgroups=case.simdgroups,
        sources=sources,
    )


def check_results(case: Case, plan: list[kernel_plans.Launch],
                  results: list[list[mx.array]]) -> None:
    """Compare a plan's outputs with reference_decode and the float64 oracle (final output,
    per-partition partials and softmax statistics)."""
    inp = make_inputs(case)
    decode = plan[0]
    template = dict(decode.template)
    assert template["NSG"] == (case.simdgroups or template["NSG"])
    assert (len(plan) == 2) == case.split, "split-K must be used exactly when asked for"

    out = _f64(results[-1][0])
    assert out.shape == (len(case.lens), case.group * case.kv_heads, 1, case.head_dim)
    truth, truth_lse = oracle(case)
    assert_close(out, truth, TRUTH_TOL[case.dtype], "output vs float64 oracle")
    ref = _f64(
        reference_decode(
            inp.q, inp.k_pool, inp.v_pool, inp.block_tables, inp.context_lens, inp.scale
        )
    )
    assert_close(out, ref, REFERENCE_TOL[case.dtype], "output vs reference_decode")

    # Per-row statistics: logsumexp of the scaled scores = max + log(sum).
    part_tokens = template["PART"]
    p_out, p_lse = oracle(case, part_tokens)
    parts = p_lse.shape[2]  # partitions holding tokens; the plan may allocate more
    stats = _f64(results[0][1])
    assert stats.shape[2] >= parts
    stats = stats[:, :, :parts]
    valid = ~np.isnan(p_lse)
    lse = stats[..., 0] + np.log(stats[..., 1])
    assert_close(lse[valid], p_lse[valid], (1e-5, 1e-4), "softmax statistics")
    if case.split:
        partial = _f64(results[0][0])[:, :, :parts]  # fp32, each normalised by its own sum
        assert_close(partial[valid], p_out[valid], (1e-5, 1e-5), "split-K partials")


# ---------------------------------------------------------------------------------------------
# Emulation
# ---------------------------------------------------------------------------------------------

# Cases that expose what MUTANT_CASE (fp32, one KV head) cannot: several KV heads with several
# query heads each (the GQA head mapping), and fp16 / bf16 inputs (rounding to the storage type).
GQA_CASES = (
    Case(3, 2, 64, 16, mx.float16, split=False, simdgroups=2),
    Case(4, 2, 64, 32, mx.float16, split=False),
)
LOW_PRECISION_CASES = (
    Case(4, 1, 128, 16, mx.bfloat16, split=True),
    Case(7, 1, 64, 8, mx.float16, split=False, simdgroups=1),
)
assert all(c in CASES for c in GQA_CASES + LOW_PRECISION_CASES)  # each passes unmutated
assert all(c.kv_heads > 1 and c.group > 1 for c in GQA_CASES)


@dataclass(frozen=True)
class Mutant:
    old: str
    new: str
    cases: tuple[Case, ...] = (MUTANT_CASE,)


MUTANTS = {
    # logical block j of the simdgroup gets the table entry of block j + 1
    "table_entry_off_by_one": Mutant(
        "const int phys = simd_shuffle(my_entry, ushort(j));",
        "const int phys = simd_shuffle(my_entry, ushort(j + 1));",
    ),
    # the last, partially filled block of each partition is skipped
    "last_partial_block_dropped": Mutant(
        "const int blk_end = (tok_end + BS - 1) / BS;",
        "const int blk_end = tok_end / BS;",
    ),
    # simdgroups read each other's softmax state before it is written
    "missing_barrier": Mutant("threadgroup_barrier(mem_flags::mem_threadgroup);", ""),
    # the running output is not rescaled when the running max grows
    "missing_rescale": Mutant("acc[g][i] *= alpha;", ""),
    # the reduce merges partitions past the end of short sequences (never written)
    "reduce_ignores_context": Mutant(
        "const int np = min(P, (context_lens[b] + PART - 1) / PART);",
        "const int np = P;",
    ),
    # GQA: query head h served by KV head h % KVH (interleaved) instead of h // G
    "gqa_heads_interleaved": Mutant(
        "auto qh = q + (size_t(b) * H + size_t(kvh) * G + g) * D;",
        "auto qh = q + (size_t(b) * H + size_t(g) * KVH + kvh) * D;",
        GQA_CASES,
    ),
    # GQA: every threadgroup reads the keys of KV head 0
    "gqa_keys_of_head_0": Mutant(
        "auto k_head = k_pool + size_t(kvh) * D + lane * EPL;",
        "auto k_head = k_pool + lane * EPL;",
        GQA_CASES,
    ),
    # fp16/bf16: the softmax sum rounded to the storage type after every block
    "sum_in_storage_type": Mutant(
        "l[g] = l[g] * alpha + simd_sum(p);",
        "l[g] = float(T(l[g] * alpha + simd_sum(p)));",
        LOW_PRECISION_CASES,
    ),
    # fp16/bf16: the output accumulated in the storage type, token by token
    "output_accumulated_in_storage_type": Mutant(
        "acc[g][i] += pt * vr[i];",
        "acc[g][i] = float(T(acc[g][i] + pt * vr[i]));",
        LOW_PRECISION_CASES,
    ),
}
MUTANT_RUNS = [(name, case) for name, m in MUTANTS.items() for case in m.cases]


def mutated_sources(mutant: str) -> dict[str, kernel_plans.KernelSource]:
    m = MUTANTS[mutant]
    text = kernels.SHADER_PATH.read_text()
    assert text.count(m.old) == 1, f"mutation site of {mutant!r} not found exactly once"
    return kernels.KERNELS.parse(text.replace(m.old, m.new))


@pytest.fixture(scope="module")
def prebuilt():
    """Compile every program this module needs, in parallel (cached across runs)."""
    if not _EMULATION:
        pytest.skip(_WHY_NOT)
    sources = []
    for case in [*CASES, MUTANT_CASE]:
        sources += gen.plan_sources(plan_for(case))
    for mutant, case in MUTANT_RUNS:
        sources += gen.plan_sources(plan_for(case, mutated_sources(mutant)))
    with contextlib.suppress(gen.EmulatorError):  # a test needing a failed build reports it
        gen.prebuild(sources)


@needs_gxx
def test_block_tables_are_scrambled():
    inp = make_inputs(CASES[0])
    for row, n in enumerate(inp.blocks_per_seq):
        ids = inp.tables_np[row, :n]
        if n >= 3:
            steps = np.diff(ids)
            assert (steps != 1).any() and (steps < 0).any() and (steps > 0).any()
    used = np.concatenate([inp.tables_np[r, :n] for r, n in enumerate(inp.blocks_per_seq)])
    assert len(np.unique(used)) == len(used)  # no block shared by accident


@needs_gxx
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_emulated_kernel_matches_reference(prebuilt, case):
    plan = plan_for(case)
    check_results(case, plan, gen.run_plan(plan))


@needs_gxx
def test_emulated_kernel_with_free_running_threads(prebuilt):
    """Simdgroups as concurrently running threads (no turnstile): same results."""
    case = CASES[3]
    plan = plan_for(case)
    check_results(case, plan, gen.run_plan(plan, mode="free"))


@needs_gxx
def test_mutant_case_passes_unmutated(prebuilt):
    plan = plan_for(MUTANT_CASE)
    check_results(MUTANT_CASE, plan, gen.run_plan(plan))


@needs_gxx
@pytest.mark.parametrize("mutant,case", MUTANT_RUNS, ids=lambda x: getattr(x, "id", x))
def test_planted_bug_is_caught(prebuilt, mutant, case):
    """The mutant must compile and run (a build failure or a crash proves nothing about the
    comparison), and its numbers must fail the comparison."""
    plan = plan_for(case, mutated_sources(mutant))
    runs = 2 if mutant == "missing_barrier" else 1  # deterministic: caught on every run
    for _ in range(runs):
        results = gen.run_plan(plan)  # EmulatorError here fails the test: not "caught"
        with pytest.raises(AssertionError):
            check_results(case, plan, results)


# ---- the emulator's own primitives, against numpy ----

SIMD_OPS_SOURCE = """
    const uint tid = thread_index_in_threadgroup;
    const uint lane = thread_index_in_simdgroup;
    const float x = inp[thread_position_in_grid.x];
    threadgroup float tg_sum[64];
    tg_sum[tid] = x;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    for (uint i = 0; i < threads_per_threadgroup.x; ++i) total += tg_sum[i];
    device float* o = out + thread_position_in_grid.x * 12;
    o[0] = simd_sum(x);
    o[1] = simd_max(x);
    o[2] = simd_min(x);
    o[3] = simd_prefix_inclusive_sum(x);
    o[4] = simd_prefix_exclusive_sum(x);
    o[5] = simd_shuffle(x, ushort(lane ^ 3));
    o[6] = simd_shuffle_down(x, ushort(5));
    o[7] = simd_shuffle_up(x, ushort(2));
    o[8] = simd_broadcast_first(x);
    o[9] = total;
    o[10] = float(simdgroups_per_threadgroup * 1000 + threads_per_threadgroup.x);
    o[11] = float(threadgroup_position_in_grid.x * 1000 + simdgroup_index_in_threadgroup);
"""


def simd_ops_expected(x: np.ndarray, tg: int) -> tuple[np.ndarray, np.ndarray]:
    """Expected outputs and a mask of the entries Metal defines (reading lanes that do not
    exist is undefined)."""
    n = len(x)
    exp = np.zeros((n, 12))
    defined = np.ones((n, 12), dtype=bool)
    for g0 in range(0, n, tg):
        tg_x = x[g0 : g0 + tg]
        for s0 in range(0, len(tg_x), 32):
            sx = tg_x[s0 : s0 + 32]
            width = len(sx)
            for lane in range(width):
                row = g0 + s0 + lane
                e = exp[row]
                e[0], e[1], e[2] = sx.sum(), sx.max(), sx.min()
                e[3], e[4] = sx[: lane + 1].sum(), sx[:lane].sum()
                src = lane ^ 3
                e[5] = sx[src] if src < width else np.nan
                defined[row, 5] = src < width
                src = lane + 5
                e[6] = sx[lane] if src >= 32 else (sx[src] if src < width else np.nan)
                defined[row, 6] = src >= 32 or src < width
                e[7] = sx[lane] if lane < 2 else sx[lane - 2]
                e[8] = sx[0]
                e[9] = tg_x.sum()
                e[10] = (-(-len(tg_x) // 32)) * 1000 + len(tg_x)
                e[11] = (g0 // tg) * 1000 + s0 // 32
    return exp, defined


@needs_gxx
@pytest.mark.parametrize("fibers", ["asm", "ucontext"])
def test_emulator_simd_primitives(fibers):
    kernel = kernel_plans.KernelSource("emu_simd_ops", ("inp",), ("out",), SIMD_OPS_SOURCE)
    n, tg = 120, 64  # two threadgroups, the second non-uniform (56 threads: 32 + 24 lanes)
    x = np.random.default_rng(3).integers(-50, 50, size=n).astype(np.float32)
    launch = kernel_plans.Launch(
        kernel, (mx.array(x),), (), (n, 1, 1), (tg, 1, 1), ((n * 12,),), (mx.float32,)
    )
    flags = ("-DMETAL_EMU_FORCE_UCONTEXT",) if fibers == "ucontext" else ()
    out = np.array(gen.run_launch(launch, [mx.array(x)], extra_flags=flags).outputs[0])
    expected, defined = simd_ops_expected(x.astype(np.float64), tg)
    np.testing.assert_array_equal(out.reshape(n, 12)[defined], expected[defined])


@needs_gxx
@pytest.mark.parametrize(
    ("name", "body", "message"),
    [
        # a barrier in divergent control flow (undefined in Metal)
        (
            "emu_divergent",
            "float v = inp[thread_position_in_grid.x];\n"
            "if (thread_index_in_simdgroup < 16) {\n"
            "  threadgroup_barrier(mem_flags::mem_threadgroup);\n"
            "} else {\n"
            "  threadgroup_barrier(mem_flags::mem_threadgroup);\n"
            "}\n"
            "out[thread_position_in_grid.x] = v;",
            "divergent simdgroup",
        ),
        (
            "emu_tg_overflow",
            "threadgroup float big[9000];\n"
            "const uint i = thread_position_in_grid.x;\n"
            "big[i * 100] = inp[i];\n"
            "threadgroup_barrier(mem_flags::mem_threadgroup);\n"
            "out[i] = big[(i + 1) % 64 * 100];",
            "bytes of threadgroup memory",
        ),
        (
            "emu_out_of_bounds",
            "out[thread_position_in_grid.x] = inp[thread_position_in_grid.x + 64];",
            "out of bounds",
        ),
    ],
)
def test_emulator_reports_metal_errors(name, body, message):
    kernel = kernel_plans.KernelSource(name, ("inp",), ("out",), body)
    x = mx.arange(64, dtype=mx.float32)
    launch = kernel_plans.Launch(kernel, (x,), (), (64, 1, 1), (64, 1, 1), ((64,),), (mx.float32,))
    with pytest.raises(gen.EmulatorError, match=message):
        gen.run_launch(launch, [x])


@needs_gxx
def test_emulator_keeps_constant_and_device_apart():
    """MLX passes inputs of fewer than 8 elements in `constant`; Metal has no conversion to a
    device pointer, and neither has the emulator. Declared `auto`, the same code is fine."""
    x = mx.arange(4, dtype=mx.float32)

    def launch(body):
        kernel = kernel_plans.KernelSource("emu_address_space", ("inp",), ("out",), body)
        return kernel_plans.Launch(kernel, (x,), (), (4, 1, 1), (4, 1, 1), ((4,),), (mx.float32,))

    read = "out[thread_position_in_grid.x] = p[thread_position_in_grid.x];"
    with pytest.raises(gen.EmulatorError, match="build failed"):
        gen.run_launch(launch("const device float* p = inp;\n" + read), [x])
    out = gen.run_launch(launch("auto p = inp;\n" + read), [x]).outputs[0]
    np.testing.assert_array_equal(np.array(out), np.arange(4))


# ---- plan / geometry (no compiler needed) ----


def test_geometry_splits_only_when_the_gpu_is_underfilled():
    long_ctx = 4096 // 16
    g = kernels.decode_geometry(1, 8, 4, 128, 16, long_ctx)
    assert g.partitions == 8 and g.partition_tokens == kernel_plans.PARTITION_TOKENS
    g = kernels.decode_geometry(64, 8, 4, 128, 16, long_ctx)  # 512 threadgroups: no split
    assert g.partitions == 1 and g.partition_tokens == 0
    g = kernels.decode_geometry(1, 8, 4, 128, 16, 512 // 16, split=True)  # one partition
    assert g.partitions == 1 and g.partition_tokens == 0
    # threadgroup memory of the merge stays within budget
    g = kernels.decode_geometry(1, 1, 16, 128, 16, long_ctx)
    assert g.simdgroups * 16 * 128 * 4 <= kernels.TG_MEMORY_BUDGET
    # short contexts do not get idle simdgroups
    assert kernels.decode_geometry(4, 2, 1, 64, 16, 1).simdgroups == 1


def test_supports_matches_the_template_set():
    assert kernel_plans.supports(32, 8, 128, 16, mx.float16)
    assert kernel_plans.supports(9, 3, 64, 16, mx.bfloat16)  # SmolLM2-135M
    assert not kernel_plans.supports(32, 8, 256, 16, mx.float16)  # head dim
    assert not kernel_plans.supports(32, 8, 128, 64, mx.float16)  # block size
    assert not kernel_plans.supports(12, 8, 128, 16, mx.float16)  # not a whole group
    assert not kernel_plans.supports(64, 2, 128, 16, mx.float16)  # group of 32 > MAX_GROUP


def test_plan_single_pass_has_no_reduce_and_split_has_one():
    inp = make_inputs(CASES[0])
    args = (inp.q, inp.k_pool, inp.v_pool, inp.block_tables, inp.context_lens, inp.scale)
    single = kernels.plan_decode(*args, split=False)
    assert [x.kernel.name for x in single] == ["paged_decode"]
    assert single[0].output_shapes[0] == inp.q.shape
    split = kernels.plan_decode(*args, split=True)
    assert [x.kernel.name for x in split] == ["paged_decode", "paged_decode_reduce"]
    assert split[0].inputs[1] is inp.k_pool and split[0].inputs[2] is inp.v_pool  # whole pools


def test_plan_rejects_unsupported_shapes():
    inp = make_inputs(CASES[0])
    with pytest.raises(ValueError, match="head_dim"):
        kernels.plan_decode(
            inp.q[..., :48],
            inp.k_pool[..., :48],
            inp.v_pool[..., :48],
            inp.block_tables,
            inp.context_lens,
            1.0,
        )
    with pytest.raises(ValueError, match="query heads"):
        kernels.plan_decode(
            inp.q[:, :1], inp.k_pool, inp.v_pool, inp.block_tables, inp.context_lens, 1.0
        )


# ---------------------------------------------------------------------------------------------
# The real GPU (Mac only)
# ---------------------------------------------------------------------------------------------


@pytest.mark.mac
@needs_metal
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_metal_kernel_matches_reference(case):
    plan = plan_for(case)
    results = kernels.KERNELS.run(plan)
    mx.eval(results)
    check_results(case, plan, results)


@pytest.mark.mac
@needs_metal
def test_metal_paged_decode_dispatch():
    case = CASES[1]
    inp = make_inputs(case)
    args = (inp.q, inp.k_pool, inp.v_pool, inp.block_tables, inp.context_lens, inp.scale)
    out = attention.paged_decode(*args, use_kernel=True)
    ref = attention.paged_decode(*args, use_kernel=False)
    assert_close(_f64(out), _f64(ref), REFERENCE_TOL[case.dtype], "paged_decode kernel path")


@pytest.mark.mac
@needs_metal
def test_generator_writes_the_source_mlx_generates(capfd):
    """The emulator compiles the text MLX compiles: compare with MLX's verbose output."""
    case = CASES[3]
    plan = plan_for(case)
    launch = plan[0]
    kernels.KERNELS.get(launch.kernel)(
        inputs=list(launch.inputs),
        template=list(launch.template),
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=[list(s) for s in launch.output_shapes],
        output_dtypes=list(launch.output_dtypes),
        verbose=True,
    )
    printed = capfd.readouterr().out
    specs = [gen.ArgSpec(a.dtype, tuple(a.shape)) for a in launch.inputs]
    expected = gen.mlx_source(launch.kernel, specs, launch.output_dtypes, launch.template)
    assert expected.strip() in printed
