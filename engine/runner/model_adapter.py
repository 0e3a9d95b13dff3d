"""Run unmodified mlx-lm models on the paged pool.

A step's work (decode tokens of many sequences plus prefill chunks) is flattened into one
batch of shape ``[T, 1]``: each token is its own batch row. Everything in a transformer except
attention is per token, so the model runs unchanged; the rows only meet in attention, where
the per-layer cache view knows which sequence each row belongs to.

Hooks into mlx-lm, all by its own extension points:

* ``cache.offset`` is an ``mx.array`` of per-row positions (``mx.fast.rope`` takes one offset
  per batch row);
* ``cache.update_and_fetch`` scatters the rows' K/V into the pool;
* ``cache.make_mask`` returns None: masking is the paged attention's job;
* ``scaled_dot_product_attention``, imported by name into each model module, is rebound to a
  function that routes our cache views to ``paged_attention`` and delegates everything else;
* the final norm is wrapped so only the rows whose logits are needed reach the LM head (a
  prefill chunk needs one row of logits, not one per token).

Shapes are bucketed (``BUCKET_SHAPES``): the decode rows are padded to ``bucket(n)`` rows, the
block tables to ``bucket(width)`` columns and the LM head's rows to ``bucket(rows)``, so a
steady decode repeats the same shapes from step to step and MLX's CUDA backend reuses its
graphs (it keys them by topology) and the kernels reuse their plans, instead of paying
graph instantiation again whenever the batch or the longest table (every ``block_size``
tokens) changed. A padding row is inert: it feeds token 0 at position 0, writes its K/V to
the pool's scratch block (``kv_pool.SCRATCH_BLOCK``, which no table names), attends to one
slot, and its output is dropped.

Which architectures may use these hooks, and the check at load for the others, live in
engine/runner/architecture.py.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.attention import dispatch as attention
from engine.kv.pool import SCRATCH_BLOCK, KVPool
from engine.sched.work import SequenceWork

#: Pad the step's shapes to buckets (see the module docstring). Off only to compare
#: against the exact shapes (tests).
BUCKET_SHAPES = True


def bucket(n: int) -> int:
    """``n`` rounded up to the next of 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ... (the powers of
    two and 1.5 times them): at most 1.5x the work, and about two buckets per doubling, so
    a batch or a table growing to ``n`` passes through O(log n) shapes."""
    if n <= 2:
        return n
    up = 1 << (n - 1).bit_length()
    return up * 3 // 4 if n <= up * 3 // 4 else up


@dataclass(frozen=True)
class PrefillChunk:
    row_start: int
    length: int
    block_table: mx.array  # int32 [nb]: the sequence's blocks, padded to a bucket with 0s
    context_len: int
    #: The same table as [1, nb] and the context length as int32 [1], built once per step
    #: for the kernel instead of once per layer.
    block_tables: mx.array | None = None
    context_lens: mx.array | None = None


@dataclass(frozen=True)
class StepBatch:
    """Per-step metadata, built once and shared by every layer."""

    tokens: mx.array  # [T, 1]
    positions: mx.array  # [T]
    write_blocks: mx.array  # [T]
    write_offsets: mx.array  # [T]
    num_decode: int  # rows [0, num_decode) are one-token decodes (padding rows included)
    decode_tables: mx.array | None  # [num_decode, max_blocks]
    decode_lens: mx.array | None  # [num_decode]
    prefills: tuple[PrefillChunk, ...]
    #: Rows that reach the LM head, in layout order (None: none): the rows whose logits are
    #: returned, then repeats of the last of them up to a bucket (dropped after the head).
    logit_rows: mx.array | None
    logit_owners: tuple[int, ...]  # index into the work list for each returned logit row
    work_rows: tuple[int, ...] = ()  # the first row of each work, in work order
    padding: int = 0  # padding rows, after the real decode rows

    @property
    def num_logits(self) -> int:
        """Rows of logits ``PagedModel.forward`` returns (one per ``logit_owners``)."""
        return len(self.logit_owners)


def build_step_batch(work: Sequence[SequenceWork], bucketed: bool | None = None) -> StepBatch:
    """Lay out a step: one-token works first (one batched decode attention), padding rows up
    to a bucket, then chunks. ``bucketed`` (default ``BUCKET_SHAPES``) pads the shapes."""
    fit = bucket if (BUCKET_SHAPES if bucketed is None else bucketed) else _exact
    decodes = [i for i, w in enumerate(work) if len(w.tokens) == 1]
    chunks = [i for i, w in enumerate(work) if len(w.tokens) != 1]
    tokens: list[int] = []
    positions: list[int] = []
    blocks: list[int] = []
    offsets: list[int] = []
    prefills: list[PrefillChunk] = []
    logit_rows: list[int] = []
    logit_owners: list[int] = []
    work_rows = [0] * len(work)

    def place(i: int) -> int:
        w = work[i]
        if len(w.slots) != len(w.tokens):
            raise ValueError("every fed token needs a slot")
        row = work_rows[i] = len(tokens)
        tokens.extend(w.tokens)
        positions.extend(range(w.start, w.start + len(w.tokens)))
        for b, o in w.slots:
            blocks.append(b)
            offsets.append(o)
        if w.want_logits:
            logit_rows.append(row + len(w.tokens) - 1)
            logit_owners.append(i)
        return row

    for i in decodes:
        place(i)
    padding = fit(len(decodes)) - len(decodes)
    tokens.extend([0] * padding)  # token 0 at position 0, its K/V to the scratch block
    positions.extend([0] * padding)
    blocks.extend([SCRATCH_BLOCK] * padding)
    offsets.extend([0] * padding)
    for i in chunks:
        w = work[i]
        row = place(i)
        width = fit(len(w.blocks))
        table = mx.array(list(w.blocks) + [0] * (width - len(w.blocks)), dtype=mx.int32)
        context_len = w.start + len(w.tokens)
        prefills.append(PrefillChunk(
            row_start=row, length=len(w.tokens), block_table=table, context_len=context_len,
            block_tables=table.reshape(1, width),
            context_lens=mx.array([context_len], dtype=mx.int32),
        ))
    decode_tables = decode_lens = None
    if decodes:
        width = fit(max(len(work[i].blocks) for i in decodes))
        table = [list(work[i].blocks) + [0] * (width - len(work[i].blocks)) for i in decodes]
        lens = [work[i].start + 1 for i in decodes]
        # Padding rows read one slot of block 0 (their output is dropped): in bounds for
        # every kernel, which the scratch block's negative id would not be.
        table.extend([[0] * width] * padding)
        lens.extend([1] * padding)
        decode_tables = mx.array(table, dtype=mx.int32)
        decode_lens = mx.array(lens, dtype=mx.int32)
    if logit_rows:  # the LM head on a bucket of rows; the repeats are dropped after it
        logit_rows.extend([logit_rows[-1]] * (fit(len(logit_rows)) - len(logit_rows)))
    return StepBatch(
        tokens=mx.array(tokens, dtype=mx.int32)[:, None],
        positions=mx.array(positions, dtype=mx.int32),
        write_blocks=mx.array(blocks, dtype=mx.int32),
        write_offsets=mx.array(offsets, dtype=mx.int32),
        num_decode=len(decodes) + padding,
        decode_tables=decode_tables,
        decode_lens=decode_lens,
        prefills=tuple(prefills),
        # No empty arrays: MLX's CUDA graphs fail on a zero-sized launch (docs/GPU.md).
        logit_rows=mx.array(logit_rows, dtype=mx.int32) if logit_rows else None,
        logit_owners=tuple(logit_owners),
        work_rows=tuple(work_rows),
        padding=padding,
    )


def _exact(n: int) -> int:
    return n


class PagedLayerCache:
    """The cache object one attention layer sees during a paged step.

    Deliberately has no ``bits`` attribute: mlx-lm would take its quantized-cache path.
    """

    def __init__(self, pool: KVPool, layer: int, use_kernel: bool) -> None:
        self.pool = pool
        self.layer = layer
        self.use_kernel = use_kernel
        self._kernel_ok: bool | None = None
        self.batch: StepBatch | None = None

    @property
    def offset(self) -> mx.array:
        return self.batch.positions

    def make_mask(self, *args, **kwargs) -> None:
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        b = self.batch
        # [T, kv_heads, 1, head_dim] -> [T, kv_heads, head_dim]
        self.pool.write(self.layer, b.write_blocks, b.write_offsets, keys[:, :, 0], values[:, :, 0])
        return keys, values

    def _kernel_fits(self, num_heads: int) -> bool:
        """The backend's kernel when enabled and it handles this attention shape, else the
        reference path (decided once: shapes do not change)."""
        if self._kernel_ok is None:
            self._kernel_ok = False
            if self.use_kernel:
                from engine.attention.plans import supports

                shape = self.pool.shape
                self._kernel_ok = supports(
                    num_heads, shape.num_kv_heads, shape.head_dim, self.pool.block_size,
                    shape.dtype,
                )
        return self._kernel_ok

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        """queries: [T, heads, 1, head_dim] -> [T, heads, 1, head_dim]."""
        b = self.batch
        k_pool = self.pool.keys[self.layer]
        v_pool = self.pool.values[self.layer]
        parts = []
        if b.num_decode:
            parts.append(
                attention.paged_decode(
                    queries[: b.num_decode], k_pool, v_pool, b.decode_tables, b.decode_lens,
                    scale, use_kernel=self._kernel_fits(queries.shape[1]),
                )
            )
        for chunk in b.prefills:
            q = queries[chunk.row_start : chunk.row_start + chunk.length]
            q = mx.swapaxes(q, 0, 2)  # [1, heads, L, head_dim]
            out = attention.paged_prefill(
                q, k_pool, v_pool, chunk.block_table, chunk.context_len, scale,
                use_kernel=self._kernel_fits(queries.shape[1]),
                block_tables=chunk.block_tables, context_lens=chunk.context_lens,
            )
            parts.append(mx.swapaxes(out, 0, 2))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


def _paged_sdpa_router(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, PagedLayerCache):
            if sinks is not None:
                raise NotImplementedError("attention sinks are not supported on the paged path")
            return cache.attend(queries, scale)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.paged_router = True
    return scaled_dot_product_attention


def _install_attention_router(model: nn.Module) -> None:
    """Rebind ``scaled_dot_product_attention`` in every module that defines the model."""
    module_names = {type(m).__module__ for _, m in model.named_modules()}
    module_names.add(type(model).__module__)
    for name in module_names:
        module = sys.modules.get(name)
        fn = getattr(module, "scaled_dot_product_attention", None)
        if fn is not None and not getattr(fn, "paged_router", False):
            module.scaled_dot_product_attention = _paged_sdpa_router(fn)


class _RowSelectingNorm(nn.Module):
    """Wraps the final norm so that, during a paged step, only the needed rows go on to the
    LM head; outside a paged step it is transparent."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.inner = norm
        self.rows: mx.array | None = None

    def __call__(self, x: mx.array) -> mx.array:
        if self.rows is not None:
            x = x[self.rows]
        return self.inner(x)


def _inner_model(model: nn.Module) -> nn.Module | None:
    inner = getattr(model, "model", None)
    if inner is None:
        inner = getattr(getattr(model, "language_model", None), "model", None)
    return inner


class PagedModel:
    """An mlx-lm model bound to a KV pool: one ``forward`` per engine step."""

    def __init__(self, model: nn.Module, pool: KVPool, use_kernel: bool = False) -> None:
        self.model = model
        self.pool = pool
        _install_attention_router(model)
        self.caches = [PagedLayerCache(pool, i, use_kernel) for i in range(len(model.layers))]
        inner = _inner_model(model)
        self._row_norm: _RowSelectingNorm | None = None
        if inner is not None and isinstance(getattr(inner, "norm", None), nn.Module):
            if not isinstance(inner.norm, _RowSelectingNorm):
                inner.norm = _RowSelectingNorm(inner.norm)
            self._row_norm = inner.norm

    def forward(self, batch: StepBatch) -> mx.array | None:
        """Run the step; returns logits [batch.num_logits, vocab] (lazy), or None when
        no row wants logits (a prompt chunk that is not its prompt's last).

        Without logits the caller evaluates :meth:`written` instead: the pool writes are
        what such a step is for. The final norm then selects one row, so no array with a
        zero-sized dimension enters the graph (MLX's CUDA backend fails such a launch with
        ``cudaGraphAddKernelNode ... invalid argument``), and the LM head, not being
        evaluated, costs nothing.
        """
        for cache in self.caches:
            cache.batch = batch
        rows = batch.logit_rows
        if self._row_norm is not None:
            last = batch.tokens.shape[0] - 1
            self._row_norm.rows = rows if rows is not None else mx.array([last], dtype=mx.int32)
        try:
            logits = self.model(batch.tokens, cache=self.caches)
        finally:
            if self._row_norm is not None:
                self._row_norm.rows = None
        if rows is None:
            return None
        if self._row_norm is None:
            logits = logits[rows]
        if rows.shape[0] != batch.num_logits:  # drop the bucket's repeated rows
            logits = logits[: batch.num_logits]
        return logits[:, -1, :]

    def written(self) -> list[mx.array]:
        """The pool arrays a step wrote (lazy until evaluated): evaluating them runs a step
        that wants no logits."""
        return [*self.pool.keys, *self.pool.values]
