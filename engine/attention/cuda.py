"""CUDA paged-attention kernels (``shaders/paged_attention.cu``) through ``mx.fast.cuda_kernel``.

The Metal kernel's design on NVIDIA GPUs (details in ``shaders/README.md``): one thread block
per (sequence, KV head, partition) serves every query head of that KV head, so each K/V byte
is read once; lanes split head_dim and q.k is one warp reduction; fp32 online softmax; split-K
with a reduce kernel when the batch would leave the GPU under-filled. The same kernel also
runs prefill chunks (several query tokens of one sequence, causal) straight from the pool,
so neither decode nor prefill gathers the blocks into a contiguous copy.

As in ``engine.attention.metal``, a call is a *launch plan*; the CPU emulation harness
(``tests/kernel_emulation/cuda_generator.py``) executes the very same plans, so the geometry
chosen here is what CI verifies.
"""

from __future__ import annotations

import math
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

CUDA_SHADER_PATH = shaders_root() / "shaders" / "paged_attention.cu"

MAX_ROWS = 8  # prefill rows (query tokens x heads of a group) per block: registers (q, output)
MAX_WARPS = 4  # warps per thread block
SHARED_BUDGET = 32768  # bytes of static shared memory for the cross-warp merge (limit 48 KiB)
SPLIT_BELOW_BLOCKS = 264  # fewer (sequence, KV head) blocks than 2 per SM of an H100/H200
PREFILL_TOKENS_PER_BLOCK = 8  # most query tokens one block serves in a prefill chunk

#: The CUDA kernels (``mx.fast.cuda_kernel``, compiled by NVRTC) of the .cu file, whose
#: ``// ==== header ====`` section is every kernel's header.
KERNELS = KernelSet("cuda_kernel", CUDA_SHADER_PATH, "paged_attention", "paged_attention_reduce",
                    "CUDA source")


def available() -> bool:
    """True where MLX's CUDA backend is present (an NVIDIA GPU)."""
    return bool(mx.cuda.is_available())


@dataclass(frozen=True)
class Geometry:
    warps: int  # per thread block
    partitions: int  # 1: single pass, no reduce
    partition_tokens: int  # 0 when partitions == 1
    query_tokens: int  # query tokens per block (1 for decode)


@lru_cache(maxsize=512)
def geometry(
    batch: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    max_blocks: int,
    query_len: int = 1,
    split: bool | None = None,
    warps: int | None = None,
) -> Geometry:
    """Launch geometry for one shape family.

    Decode (``query_len == 1``): split-K when the context can exceed one partition and
    ``batch * num_kv_heads`` blocks would leave the GPU under-filled; ``split`` forces it
    (a context that fits one partition is never split). Prefill: a block serves up to
    ``PREFILL_TOKENS_PER_BLOCK`` query tokens x the group's heads, never split.
    """
    qt = 1
    if query_len > 1:
        qt = max(1, min(PREFILL_TOKENS_PER_BLOCK, MAX_ROWS // group, query_len))
        if split:
            raise ValueError("prefill chunks are not split into partitions")
        split = False
    partitions = partitions_for(batch, num_kv_heads, block_size, max_blocks, split,
                                SPLIT_BELOW_BLOCKS)
    if warps is None:
        warps = workers_for(partitions, MAX_WARPS, qt * group, head_dim, SHARED_BUDGET,
                            block_size, max_blocks)
    return Geometry(warps, partitions, PARTITION_TOKENS if partitions > 1 else 0, qt)


@lru_cache(maxsize=64)
def _scale_array(scale: float) -> mx.array:
    return mx.array([scale], dtype=mx.float32)


def plan_attention(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float | mx.array,
    *,
    split: bool | None = None,
    warps: int | None = None,
    sources: dict[str, KernelSource] | None = None,
    k_scales: mx.array | None = None,
    v_scales: mx.array | None = None,
) -> list[Launch]:
    """The launches computing paged attention (output 0 of the last launch, [B, H, L, D]).
    With ``k_scales`` / ``v_scales`` the pools are 8-bit and ``paged_attention_q8`` runs.

    q [B, H, L, D]: L query tokens per sequence, the last at position ``context_lens - 1``
    (decode: L = 1; prefill chunk: B = 1), causal among themselves; pools
    [num_blocks, block_size, num_kv_heads, head_dim]; block_tables int32 [B, max_blocks];
    context_lens int32 [B], each >= L. The whole pool arrays are passed. ``scale``: a float,
    or the float32 [1] array the kernel reads it from (the layer's K/V write passes one on,
    engine/attention/kv_write.py).
    """
    src = sources or KERNELS.sources()
    shape, block_tables, context_lens = checked_call(q, k_pool, v_pool, block_tables,
                                                     context_lens, k_scales, v_scales)
    batch, num_heads, query_len = shape.batch, shape.num_heads, shape.query_len
    head_dim, block_size, num_kv_heads = shape.head_dim, shape.block_size, shape.num_kv_heads
    group = shape.group
    geo = geometry(
        batch, num_kv_heads, group, head_dim, block_size, block_tables.shape[1], query_len,
        split, warps,
    )
    if geo.warps not in (1, 2, 4, 8) or geo.warps * geo.query_tokens * group * head_dim * 4 > (
        49152
    ):
        raise ValueError(f"{geo.warps} warps do not fit a thread block for this shape")
    parts = geo.partitions
    out_dtype = q.dtype if parts == 1 else mx.float32
    tiles = math.ceil(query_len / geo.query_tokens)
    scale = scale if isinstance(scale, mx.array) else _scale_array(float(scale))
    if k_scales is None:
        kernel = src["paged_attention"]
        inputs = (q, k_pool, v_pool, block_tables, context_lens, scale)
    else:
        kernel = src["paged_attention" + Q8]
        inputs = (q, k_pool, v_pool, k_scales, v_scales, block_tables, context_lens, scale)
    attend = Launch(
        kernel=kernel,
        inputs=inputs,
        template=(
            ("T", q.dtype),
            ("O", out_dtype),
            ("D", head_dim),
            ("BS", block_size),
            ("G", group),
            ("QT", geo.query_tokens),
            ("NW", geo.warps),
            ("PART", geo.partition_tokens),
        ),
        grid=(32 * geo.warps * parts, num_kv_heads, batch * tiles),
        threadgroup=(32 * geo.warps, 1, 1),
        output_shapes=(
            (batch, num_heads, query_len * parts, head_dim),
            (batch, num_heads, query_len * parts, 2),
        ),
        output_dtypes=(out_dtype, mx.float32),
    )
    if parts == 1:
        return [attend]
    reduce = reduce_launch(src["paged_attention_reduce"], shape, context_lens, q.dtype,
                           geo.partition_tokens)
    return [attend, reduce]


#: Plans by shape, bounded (engine/attention/plan_cache.py).
PLANS = PlanCache(KERNELS)


def _attend(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    k_scales: mx.array | None = None,
    v_scales: mx.array | None = None,
    scale_array: mx.array | None = None,
) -> mx.array:
    """Run the plan for these shapes. The plan (validation, geometry, kernel objects) is built
    once per shape family and kept in ``PLANS``; later calls only pass arrays: an engine step
    calls this once per layer, so its Python cost is paid tens of times per token.
    ``scale_array``: ``scale`` as the layer's K/V write passed it on (read in its place, which
    orders this launch after the write: engine/attention/kv_write.py)."""
    if scale_array is None:
        scale_array = _scale_array(float(scale))
    args = (q, k_pool, v_pool, as_int32(block_tables), as_int32(context_lens), scale_array,
            k_scales, v_scales)
    return PLANS.run(plan_key(*args[:5]), args, lambda: plan_attention(
        *args[:6], k_scales=k_scales, v_scales=v_scales))


def paged_decode_cuda(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    k_scales: mx.array | None = None,
    v_scales: mx.array | None = None,
    scale_array: mx.array | None = None,
) -> mx.array:
    """``engine.attention.dispatch.reference_decode`` on the CUDA kernel: [B, H, 1, D]
    (an 8-bit pool's scales in ``k_scales`` / ``v_scales``; ``scale_array``: ``_attend``)."""
    return _attend(q, k_pool, v_pool, block_tables, context_lens, scale, k_scales, v_scales,
                   scale_array)


def paged_prefill_cuda(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_table: mx.array,
    context_len: int,
    scale: float,
    block_tables: mx.array | None = None,
    context_lens: mx.array | None = None,
    k_scales: mx.array | None = None,
    v_scales: mx.array | None = None,
    scale_array: mx.array | None = None,
) -> mx.array:
    """``engine.attention.dispatch.reference_prefill`` on the CUDA kernel: q [1, H, L, D] -> same.

    ``block_tables`` [1, nb] and ``context_lens`` [1] are the table and the length as the
    kernel takes them; the model adapter builds them once per step (else once per layer)."""
    if block_tables is None:
        block_tables = block_table.reshape(1, -1)
    if context_lens is None:
        context_lens = mx.array([context_len], dtype=mx.int32)
    return _attend(q, k_pool, v_pool, block_tables, context_lens, scale, k_scales, v_scales,
                   scale_array)
