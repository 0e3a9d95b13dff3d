"""Attention over the paged KV pool.

Two implementations behind one entry point, chosen at run time:

* the **reference** path gathers the blocks named by the block tables into a contiguous,
  masked K/V and calls ``mx.fast.scaled_dot_product_attention`` (on the CPU backend, where
  that is unfused and its exp a scalar loop, ``engine.attention.cpu_sdpa``'s formulation of the
  same attention). It runs on every backend and is the oracle every kernel is tested against;
* the **kernel** paths read K/V straight from the pool through the block tables: the Metal
  decode kernel (``engine.attention.metal``) where the Metal backend is available, the CUDA
  decode and prefill kernel (``engine.attention.cuda``) where MLX's CUDA backend is.

Pool layout (per layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``. An 8-bit pool
(engine/kv/int8.py) passes its int8 K/V with ``k_scales`` / ``v_scales``
(``[num_blocks, block_size, num_kv_heads]``, fp16): the reference path dequantizes the blocks
it gathers, the kernels dequantize as they read.
"""

from __future__ import annotations

import os

import mlx.core as mx

from engine.attention.cpu_sdpa import grouped_attention
from engine.kv import int8


def gather_blocks(pool: mx.array, block_table: mx.array,
                  dtype: mx.Dtype | None = None) -> mx.array:
    """K or V of the blocks in ``block_table`` ([..., nb]) as [..., kv_heads, nb*bs, head_dim],
    contiguous, converted to ``dtype`` when given (in the same copy)."""
    blocks = pool[block_table]  # [..., nb, bs, kvh, d]
    *lead, nb, bs, kvh, d = blocks.shape
    heads_first = mx.swapaxes(blocks.reshape(*lead, nb * bs, kvh, d), -2, -3)
    if dtype is not None and dtype != pool.dtype:
        return heads_first.astype(dtype)  # one strided read, one contiguous write
    # SDPA on a strided view is ~2x slower than copying it to contiguous first (CPU backend).
    return mx.contiguous(heads_first)


def gather_kv(pool: mx.array, scales: mx.array | None, block_table: mx.array,
              dtype: mx.Dtype) -> mx.array:
    """``gather_blocks``, dequantized to ``dtype`` when the pool is 8-bit (``scales`` given):
    the int8 bytes and their scales are gathered, then ``q * s`` (engine/kv/int8.py)."""
    if scales is None:
        return gather_blocks(pool, block_table)
    q = gather_blocks(pool, block_table)  # int8 [..., kvh, T, D]: a quarter of fp32's bytes
    return int8.dequantize(q, gather_scales(scales, block_table), dtype)


def gather_scales(scales: mx.array, block_table: mx.array) -> mx.array:
    """An 8-bit pool's scales ([num_blocks, bs, kvh]) of the blocks in ``block_table``
    ([..., nb]) as [..., kvh, nb*bs], the layout of ``gather_blocks``' tokens."""
    s = scales[block_table]  # [..., nb, bs, kvh]
    *lead, nb, bs, kvh = s.shape
    return mx.swapaxes(s.reshape(*lead, nb * bs, kvh), -1, -2)


def on_cpu() -> bool:
    """True where MLX computes on the CPU backend (then the reference path takes
    ``engine.attention.cpu_sdpa``'s formulation)."""
    return mx.default_device().type == mx.DeviceType.cpu


def _cpu_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, block_tables: mx.array,
                   context_len: int | None, mask: mx.array, scale: float,
                   k_scales: mx.array | None, v_scales: mx.array | None) -> mx.array:
    """The reference attention on the CPU backend: K/V gathered (an 8-bit pool's widened to
    float32 in the gathering copy, its scales kept apart), ``grouped_attention``. Only the
    first ``context_len`` tokens are gathered when given."""
    wide = None if k_scales is None else mx.float32
    k = gather_blocks(k_pool, block_tables, wide)
    v = gather_blocks(v_pool, block_tables, wide)
    ks = None if k_scales is None else gather_scales(k_scales, block_tables)
    vs = None if v_scales is None else gather_scales(v_scales, block_tables)
    if context_len is not None:
        k, v = k[:, :, :context_len], v[:, :, :context_len]
        if ks is not None:
            ks, vs = ks[:, :, :context_len], vs[:, :, :context_len]
    return grouped_attention(q, k, v, scale, mask, ks, vs)


def reference_decode(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    k_scales: mx.array | None = None,
    v_scales: mx.array | None = None,
) -> mx.array:
    """One query token per sequence.

    q: [B, H, 1, D]; block_tables: int32 [B, max_blocks] (unused entries may hold any valid
    block id); context_lens: int32 [B], the tokens each query attends to (its own included);
    ``k_scales`` / ``v_scales``: an 8-bit pool's scales (None for a pool of q's dtype).
    Returns [B, H, 1, D].
    """
    positions = mx.arange(block_tables.shape[-1] * k_pool.shape[1])
    if on_cpu():
        mask = (positions[None, :] < context_lens[:, None])[:, None, None, None, :]
        return _cpu_attention(q, k_pool, v_pool, block_tables, None, mask, scale,
                              k_scales, v_scales)
    k = gather_kv(k_pool, k_scales, block_tables, q.dtype)  # [B, kvh, T, D]
    v = gather_kv(v_pool, v_scales, block_tables, q.dtype)
    mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]  # [B,1,1,T]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def reference_prefill(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_table: mx.array,
    context_len: int,
    scale: float,
    k_scales: mx.array | None = None,
    v_scales: mx.array | None = None,
) -> mx.array:
    """A chunk of L consecutive query tokens of one sequence, the last of them at position
    ``context_len - 1``: causal inside the chunk, full over the sequence's earlier tokens.

    q: [1, H, L, D]; block_table: int32 [nb] covering at least ``context_len`` tokens;
    scales as in ``reference_decode``. Returns [1, H, L, D].
    """
    if on_cpu():
        length = q.shape[2]
        # query i (at position context_len - length + i) sees positions <= its own
        mask = (mx.arange(context_len)[None, :]
                <= mx.arange(context_len - length, context_len)[:, None])[None, None, None]
        return _cpu_attention(q, k_pool, v_pool, block_table[None], context_len, mask, scale,
                              k_scales, v_scales)
    k = gather_kv(k_pool, k_scales, block_table[None], q.dtype)[:, :, :context_len]
    v = gather_kv(v_pool, v_scales, block_table[None], q.dtype)[:, :, :context_len]
    mask = "causal" if q.shape[2] > 1 else None
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


#: Most attention scores (query rows x heads x table slots) one ``gathered_prefill`` call
#: attends at a time: 2**27 is 512 MiB in float32 where the backend's attention materializes
#: them (MLX's unfused path; cuDNN's does not). A chunk past it attends in tiles of query
#: tokens, whose sizes follow (length, heads, width) alone, so they too repeat.
GATHERED_SCORES = 1 << 27


def power_of_two_at_least(n: int) -> int:
    """The smallest power of two not below ``n`` (``n`` >= 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


def gathered_shape(length: int, table_blocks: int) -> tuple[int, int]:
    """The (query tokens, table blocks) ``gathered_prefill`` attends at for a chunk of
    ``length`` tokens over a table of ``table_blocks``: each rounded up to a power of two.

    On CUDA every new shape of MLX's fused attention costs a cuDNN graph (80-90 ms on an
    H100, bench/results/gpu.md, session 26), so the shapes must form a small set the engine
    can build once (``warm_gathered_prefill``): the step's buckets (1.5x apart) would give a
    paste among streaming chats tens of (chunk, width) pairs; powers of two give
    log2(chunk) x log2(context) of them, at most 2x the work of each side."""
    return power_of_two_at_least(length), power_of_two_at_least(table_blocks)


def gathered_prefill(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_table: mx.array,
    context_len: int,
    scale: float,
    k_scales: mx.array | None = None,
    v_scales: mx.array | None = None,
) -> mx.array:
    """``reference_prefill``'s attention on shapes that do not follow the context length.

    The table's blocks are gathered at a padded width (``gathered_shape``; the padding names
    block 0) and the slots past each query's position are masked (a boolean mask array),
    instead of slicing the gathered K/V to ``context_len``: every chunk of a prompt has its
    own context length, and on CUDA MLX's fused attention builds a cuDNN graph for each new
    shape (and strides) it sees. The query is padded alike (rows of zeros that see the whole
    context, sliced off after) and made contiguous, so each (chunk, width) pair is one graph,
    built once. On an H100 (1B shape, 16 layers) a 256-token chunk at 8,192 tokens of
    context attends in 6.5 ms this way against 17.4 ms in the paged prefill kernel and
    15.8 ms with matrix products (bench/results/gpu.md, session 26). q [1, H, L, D] -> same.
    """
    _, heads, length, dim = q.shape
    padded_length, padded_blocks = gathered_shape(length, block_table.shape[0])
    table = block_table
    if padded_blocks > table.shape[0]:
        table = mx.concatenate([table, mx.zeros((padded_blocks - table.shape[0],),
                                                dtype=table.dtype)])
    k = gather_kv(k_pool, k_scales, table[None], q.dtype)  # [1, kvh, T, D]
    v = gather_kv(v_pool, v_scales, table[None], q.dtype)
    width = k.shape[2]
    if padded_length > length:
        q = mx.concatenate([q, mx.zeros((1, heads, padded_length - length, dim), q.dtype)],
                           axis=2)
    else:
        q = mx.contiguous(q)
    # each query's own position; the padding rows see the whole context (finite softmax)
    positions = mx.minimum(context_len - length + mx.arange(padded_length), context_len - 1)
    tile = padded_length
    while tile > 1 and tile * heads * width > GATHERED_SCORES:
        tile = -(-tile // 2)
    slots = mx.arange(width)[None, :]
    outs = []
    for start in range(0, padded_length, tile):
        last = positions[start:start + tile]
        visible = slots <= last[:, None]  # [rows, T]: causal, and nothing past the context
        outs.append(mx.fast.scaled_dot_product_attention(
            q[:, :, start:start + tile], k, v, scale=scale, mask=visible))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    return out[:, :, :length] if padded_length > length else out


def gathered_shapes(from_tokens: int, max_chunk: int, max_blocks: int,
                    block_size: int) -> list[tuple[int, int]]:
    """Every (query tokens, table blocks) pair ``gathered_prefill`` can attend at for chunks
    of ``from_tokens`` to ``max_chunk`` tokens over tables of at most ``max_blocks`` (a
    chunk's table holds at least the chunk: ``from_tokens / block_size`` blocks): what
    ``warm_gathered_prefill`` builds."""
    lengths = []
    n = power_of_two_at_least(from_tokens)
    while n <= power_of_two_at_least(max_chunk):
        lengths.append(n)
        n *= 2
    shapes = []
    for length in lengths:
        width = power_of_two_at_least(-(-from_tokens // block_size))
        while width <= power_of_two_at_least(max_blocks):
            shapes.append((length, width))
            width *= 2
    return shapes


def warm_gathered_prefill(heads: int, k_pool: mx.array, v_pool: mx.array,
                          shapes: list[tuple[int, int]], dtype: mx.Dtype,
                          k_scales: mx.array | None = None,
                          v_scales: mx.array | None = None) -> None:
    """Run ``gathered_prefill`` once at each of ``shapes`` (``gathered_shapes``) over the
    pool's block 0, so that on CUDA each cuDNN graph is built at load time and not in a step
    beside streaming chats (80-90 ms each on an H100). The scale is a tensor of the graph,
    not part of its key: any value builds the same graph. MLX keeps these graphs in an LRU
    whose capacity ``MLX_CUDA_SDPA_CACHE_SIZE`` sets when its first graph is built: unless
    the user set it, it is made room for twice these shapes (the model's own attention
    calls, if any, share it)."""
    os.environ.setdefault("MLX_CUDA_SDPA_CACHE_SIZE", str(max(256, 2 * len(shapes))))
    dim = k_pool.shape[-1]
    for length, blocks in shapes:
        q = mx.zeros((1, heads, length, dim), dtype)
        table = mx.zeros((blocks,), dtype=mx.int32)
        mx.eval(gathered_prefill(q, k_pool, v_pool, table, length, dim ** -0.5,
                                 k_scales, v_scales))


def kernel_path() -> str | None:
    """The paged-attention kernel this backend runs ("cuda-paged", "metal-kernel"), or None
    where only the reference path runs (the CPU backend)."""
    if mx.cuda.is_available():
        return "cuda-paged"
    if mx.metal.is_available():
        return "metal-kernel"
    return None


def kernel_available() -> bool:
    """True where a paged-attention kernel can run (the Metal or the CUDA backend)."""
    return kernel_path() is not None


def paged_decode(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    use_kernel: bool,
    k_scales: mx.array | None = None,
    v_scales: mx.array | None = None,
    scale_array: mx.array | None = None,
) -> mx.array:
    """Decode attention: the backend's kernel when ``use_kernel``, else the reference path
    (``k_scales`` / ``v_scales``: an 8-bit pool's, else None; ``scale_array``: on CUDA, the
    scale as the layer's K/V write passed it on, engine/attention/kv_write.py)."""
    sc = {"k_scales": k_scales, "v_scales": v_scales}
    if use_kernel:
        if mx.cuda.is_available():
            from engine.attention.cuda import paged_decode_cuda

            return paged_decode_cuda(q, k_pool, v_pool, block_tables, context_lens, scale,
                                     scale_array=scale_array, **sc)
        from engine.attention.metal import paged_decode_kernel

        return paged_decode_kernel(q, k_pool, v_pool, block_tables, context_lens, scale, **sc)
    return reference_decode(q, k_pool, v_pool, block_tables, context_lens, scale, **sc)


def paged_prefill(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_table: mx.array,
    context_len: int,
    scale: float,
    use_kernel: bool,
    block_tables: mx.array | None = None,
    context_lens: mx.array | None = None,
    k_scales: mx.array | None = None,
    v_scales: mx.array | None = None,
    scale_array: mx.array | None = None,
) -> mx.array:
    """A prefill chunk (``reference_prefill``'s arguments): the CUDA kernel, reading earlier
    blocks through the block table, when ``use_kernel`` on the CUDA backend; else the
    reference path (Metal has no prefill kernel yet). ``block_tables`` ([1, nb]) and
    ``context_lens`` ([1]) are the kernel's forms of the table and the length, when the
    caller built them once for every layer (engine/runner/step_batch.py); ``k_scales`` /
    ``v_scales`` an 8-bit pool's; ``scale_array`` as for ``paged_decode``."""
    sc = {"k_scales": k_scales, "v_scales": v_scales}
    if use_kernel and mx.cuda.is_available():
        from engine.attention.cuda import paged_prefill_cuda

        return paged_prefill_cuda(q, k_pool, v_pool, block_table, context_len, scale,
                                  block_tables=block_tables, context_lens=context_lens,
                                  scale_array=scale_array, **sc)
    return reference_prefill(q, k_pool, v_pool, block_table, context_len, scale, **sc)
