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
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine import attention
from engine.kv_pool import KVPool, KVShape
from engine.work import SequenceWork

PROVEN_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma")


@dataclass(frozen=True)
class PrefillChunk:
    row_start: int
    length: int
    block_table: mx.array  # int32 [nb]
    context_len: int


@dataclass(frozen=True)
class StepBatch:
    """Per-step metadata, built once and shared by every layer."""

    tokens: mx.array  # [T, 1]
    positions: mx.array  # [T]
    write_blocks: mx.array  # [T]
    write_offsets: mx.array  # [T]
    num_decode: int  # rows [0, num_decode) are one-token decodes
    decode_tables: mx.array | None  # [num_decode, max_blocks]
    decode_lens: mx.array | None  # [num_decode]
    prefills: tuple[PrefillChunk, ...]
    logit_rows: mx.array  # rows whose logits are returned, in work order
    logit_owners: tuple[int, ...]  # index into the work list for each logit row
    work_rows: tuple[int, ...] = ()  # the first row of each work, in work order


def build_step_batch(work: Sequence[SequenceWork]) -> StepBatch:
    """Lay out a step: one-token works first (one batched decode attention), then chunks."""
    order = sorted(range(len(work)), key=lambda i: len(work[i].tokens) != 1)
    tokens: list[int] = []
    positions: list[int] = []
    blocks: list[int] = []
    offsets: list[int] = []
    decode_rows: list[int] = []
    prefills: list[PrefillChunk] = []
    logit_rows: list[int] = []
    logit_owners: list[int] = []
    work_rows = [0] * len(work)
    for i in order:
        w = work[i]
        if len(w.slots) != len(w.tokens):
            raise ValueError("every fed token needs a slot")
        row = len(tokens)
        work_rows[i] = row
        tokens.extend(w.tokens)
        positions.extend(range(w.start, w.start + len(w.tokens)))
        for b, o in w.slots:
            blocks.append(b)
            offsets.append(o)
        if len(w.tokens) == 1:
            decode_rows.append(i)
        else:
            prefills.append(
                PrefillChunk(
                    row_start=row,
                    length=len(w.tokens),
                    block_table=mx.array(list(w.blocks), dtype=mx.int32),
                    context_len=w.start + len(w.tokens),
                )
            )
        if w.want_logits:
            logit_rows.append(row + len(w.tokens) - 1)
            logit_owners.append(i)
    decode_tables = decode_lens = None
    if decode_rows:
        width = max(len(work[i].blocks) for i in decode_rows)
        table = [list(work[i].blocks) + [0] * (width - len(work[i].blocks)) for i in decode_rows]
        decode_tables = mx.array(table, dtype=mx.int32)
        decode_lens = mx.array([work[i].start + 1 for i in decode_rows], dtype=mx.int32)
    return StepBatch(
        tokens=mx.array(tokens, dtype=mx.int32)[:, None],
        positions=mx.array(positions, dtype=mx.int32),
        write_blocks=mx.array(blocks, dtype=mx.int32),
        write_offsets=mx.array(offsets, dtype=mx.int32),
        num_decode=len(decode_rows),
        decode_tables=decode_tables,
        decode_lens=decode_lens,
        prefills=tuple(prefills),
        logit_rows=mx.array(logit_rows, dtype=mx.int32),
        logit_owners=tuple(logit_owners),
        work_rows=tuple(work_rows),
    )


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
                from engine import cuda_kernels, kernels

                shape = self.pool.shape
                supports = cuda_kernels.supports if mx.cuda.is_available() else kernels.supports
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


class _ShapeProbe:
    """A cache that records the K/V shape each layer produces (one token, no pool)."""

    def __init__(self) -> None:
        self.offset = 0
        self.seen: tuple[int, int, mx.Dtype] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.seen = (keys.shape[1], keys.shape[3], keys.dtype)
        return keys, values


def recurrent_caches(model: nn.Module) -> list[str]:
    """Names of the cache types the model asks mlx-lm for that hold a recurrent state
    rather than attention K/V (state-space layers: mamba, hybrids). The paged pool only
    holds K/V, so a model with any is refused at load, by name, before it is run."""
    make_cache = getattr(model, "make_cache", None)
    if make_cache is None:
        return []  # mlx-lm gives it plain KVCaches
    from mlx_lm.models.cache import ArraysCache, CacheList

    return sorted({type(c).__name__ for c in make_cache()
                   if isinstance(c, ArraysCache | CacheList)})


def sliding_windows(model: nn.Module) -> list[int]:
    """The attention windows of the model's sliding-window layers (mlx-lm gives those a
    RotatingKVCache). The pool attends to a sequence's whole past, so such a model is only
    right on it while every sequence is shorter than its smallest window; the load-time
    check, with its short prompt, cannot see the difference."""
    make_cache = getattr(model, "make_cache", None)
    if make_cache is None:
        return []
    from mlx_lm.models.cache import RotatingKVCache

    return sorted({int(c.max_size) for c in make_cache() if isinstance(c, RotatingKVCache)})


def weights_nbytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (for the memory check before the pool exists)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def probe_kv_shape(model: nn.Module) -> KVShape:
    """Run one token through the model to learn its per-layer K/V shape and dtype."""
    layers = model.layers
    probes = [_ShapeProbe() for _ in layers]
    mx.eval(model(mx.array([[0]], dtype=mx.int32), cache=probes))
    shapes = {p.seen for p in probes}
    if None in shapes or len(shapes) != 1:
        raise ValueError("the model's layers do not share one K/V shape; the paged path needs it")
    kv_heads, head_dim, dtype = shapes.pop()
    return KVShape(num_layers=len(layers), num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)


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

    def forward(self, batch: StepBatch) -> mx.array:
        """Run the step; returns logits [len(batch.logit_rows), vocab] (lazy)."""
        for cache in self.caches:
            cache.batch = batch
        if self._row_norm is not None:
            self._row_norm.rows = batch.logit_rows
        try:
            logits = self.model(batch.tokens, cache=self.caches)
        finally:
            if self._row_norm is not None:
                self._row_norm.rows = None
        if self._row_norm is None:
            logits = logits[batch.logit_rows]
        return logits[:, -1, :]


def check_paged_matches(model: nn.Module, shape: KVShape, block_size: int) -> float:
    """Run a short prompt and three decode steps through the paged path and through mlx-lm's
    own cache; return the largest logit difference relative to the logits' scale.

    Used at load time for architectures outside PROVEN_ARCHITECTURES: one that agrees runs
    paged; one that does not is refused with a clear message instead of answering wrongly.
    """
    from mlx_lm.models.cache import make_prompt_cache

    from engine.blocks import BlockAllocator, BlockTable

    prompt = [(7 * i + 3) % 100 + 1 for i in range(2 * block_size + 3)]
    feeds = [prompt, [11], [12], [13]]
    cache = make_prompt_cache(model)
    pool = KVPool(shape, 8, block_size)
    alloc = BlockAllocator(8, block_size)
    paged = PagedModel(model, pool)
    table = BlockTable(owner="check")
    worst = 0.0
    for tokens in feeds:
        expected = model(mx.array([tokens]), cache=cache)[0, -1].astype(mx.float32)
        start = table.num_tokens
        slots = alloc.append(table, tokens).slots
        got = paged.forward(build_step_batch([SequenceWork(tokens, start, table.blocks, slots)]))
        alloc.mark_computed(table)
        diff = mx.abs(got[0].astype(mx.float32) - expected).max()
        scale = mx.maximum(mx.abs(expected).max(), 1.0)
        worst = max(worst, (diff / scale).item())
    return worst
