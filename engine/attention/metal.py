"""Metal paged-attention kernels: built once from ``shaders/paged_attention.metal``.

The decode path reads K/V straight from the block pool through the block tables (no gathered
copy). A call is described by a *launch plan* (:func:`plan_decode`): which kernel bodies run,
with which template arguments, grid, threadgroup and output shapes. ``KERNELS.run`` executes
a plan with ``mx.fast.metal_kernel`` on a Mac; the CPU emulation harness in
``tests/kernel_emulation`` executes the very same plan, so the geometry chosen here is what the
tests verify.

Kernel design (details in ``shaders/README.md``): one threadgroup per (sequence, KV head,
partition) serves every query head of that KV head (each K/V byte is read once); lanes split
head_dim so q.k is one ``simd_sum``; fp32 online softmax. When sequences x KV heads would leave
the GPU under-filled, long contexts are split into ~512-token partitions merged by a reduce
kernel (no reduce pass when there is a single partition).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from engine.attention.plan_cache import PlanCache, plan_key
from engine.attention.plans import (
    PARTITION_TOKENS,
    Q8,
    KernelSet,
    KernelSource,
    Launch,
    as_int32,
    checked_call,
    partitions_for,
    reduce_launch,
    shaders_root,
    workers_for,
)

SHADER_PATH = shaders_root() / "shaders" / "paged_attention.metal"

SPLIT_BELOW_THREADGROUPS = 128  # fewer (sequence, KV head) pairs than this: GPU under-filled
MAX_SIMDGROUPS = 4  # simdgroups (of 32 threads) per threadgroup
TG_MEMORY_BUDGET = 16384  # bytes of threadgroup memory for the cross-simdgroup merge

#: The Metal kernels (``mx.fast.metal_kernel``) of the shader file.
KERNELS = KernelSet("metal_kernel", SHADER_PATH, "paged_decode", "paged_decode_reduce", "shader")
#: Plans by shape, bounded (engine/attention/plan_cache.py): planned once per shape,
#: not on every layer of every step.
PLANS = PlanCache(KERNELS)


@dataclass(frozen=True)
class DecodeGeometry:
    simdgroups: int  # per threadgroup
    partitions: int  # 1: single pass, no reduce
    partition_tokens: int  # 0 when partitions == 1


@lru_cache(maxsize=256)
def decode_geometry(
    batch: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    max_blocks: int,
    split: bool | None = None,
    simdgroups: int | None = None,
) -> DecodeGeometry:
    """Launch geometry for one shape family.

    ``split=None`` chooses split-K when the context can exceed one partition and
    ``batch * num_kv_heads`` threadgroups would leave the GPU under-filled; True/False force it
    (a context that fits one partition is never split). ``simdgroups`` overrides the choice.
    """
    partitions = partitions_for(batch, num_kv_heads, block_size, max_blocks, split,
                                SPLIT_BELOW_THREADGROUPS)
    if simdgroups is None:
        simdgroups = workers_for(partitions, MAX_SIMDGROUPS, group, head_dim, TG_MEMORY_BUDGET,
                                 block_size, max_blocks)
    return DecodeGeometry(simdgroups, partitions, PARTITION_TOKENS if partitions > 1 else 0)


@lru_cache(maxsize=64)
def _scale_array(scale: float) -> mx.array:
    return mx.array(scale, dtype=mx.float32)


def plan_decode(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    *,
    split: bool | None = None,
    simdgroups: int | None = None,
    sources: dict[str, KernelSource] | None = None,
    k_scales: mx.array | None = None,
    v_scales: mx.array | None = None,
) -> list[Launch]:
    """The launches computing ``reference_decode``'s result (output 0 of the last launch).
    With ``k_scales`` / ``v_scales`` the pools are 8-bit and ``paged_decode_q8`` runs.

    Shapes as in ``engine.attention.dispatch.reference_decode``: q [B, H, 1, D]; pools
    [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [B, max_blocks];
    context_lens [B] (each >= 1). The whole pool arrays are passed (a sliced view would be
    copied by ``ensure_row_contiguous``).
    """
    src = sources or KERNELS.sources()
    if q.ndim != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be [B, H, 1, D], got {q.shape}")
    shape, block_tables, context_lens = checked_call(q, k_pool, v_pool, block_tables,
                                                     context_lens, k_scales, v_scales)
    batch, num_heads, head_dim = shape.batch, shape.num_heads, shape.head_dim
    block_size, num_kv_heads, group = shape.block_size, shape.num_kv_heads, shape.group
    if simdgroups is not None and (
        simdgroups not in (1, 2, 4, 8) or simdgroups * group * (head_dim + 2) * 4 > 32768
    ):
        raise ValueError(f"{simdgroups} simdgroups do not fit a threadgroup for this shape")
    geo = decode_geometry(
        batch, num_kv_heads, group, head_dim, block_size, block_tables.shape[1], split, simdgroups
    )
    parts = geo.partitions
    out_dtype = q.dtype if parts == 1 else mx.float32
    if k_scales is None:
        kernel = src["paged_decode"]
        inputs = (q, k_pool, v_pool, block_tables, context_lens, _scale_array(float(scale)))
    else:
        kernel = src["paged_decode" + Q8]
        inputs = (q, k_pool, v_pool, k_scales, v_scales, block_tables, context_lens,
                  _scale_array(float(scale)))
    decode = Launch(
        kernel=kernel,
        inputs=inputs,
        template=(
            ("T", q.dtype),
            ("O", out_dtype),
            ("D", head_dim),
            ("BS", block_size),
            ("G", group),
            ("NSG", geo.simdgroups),
            ("PART", geo.partition_tokens),
        ),
        grid=(32 * geo.simdgroups * parts, num_kv_heads, batch),
        threadgroup=(32 * geo.simdgroups, 1, 1),
        output_shapes=((batch, num_heads, parts, head_dim), (batch, num_heads, parts, 2)),
        output_dtypes=(out_dtype, mx.float32),
    )
    if parts == 1:
        return [decode]
    reduce = reduce_launch(src["paged_decode_reduce"], shape, context_lens, q.dtype,
                           geo.partition_tokens)
    return [decode, reduce]


def paged_decode_kernel(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    k_scales: mx.array | None = None,
    v_scales: mx.array | None = None,
) -> mx.array:
    """``engine.attention.dispatch.reference_decode`` on the Metal kernel: [B, H, 1, D]
    (an 8-bit pool's scales in ``k_scales`` / ``v_scales``)."""
    args = (q, k_pool, v_pool, as_int32(block_tables), as_int32(context_lens),
            _scale_array(float(scale)), k_scales, v_scales)
    return PLANS.run(plan_key(*args[:5]), args,
                     lambda: plan_decode(*args[:5], scale, k_scales=k_scales, v_scales=v_scales))
