"""Run unmodified mlx-lm models on the paged pool.

A step's work (decode tokens of many sequences plus prefill chunks) is flattened into one
batch of shape ``[T, 1]``: each token is its own batch row. Everything in a transformer except
attention is per token, so the model runs unchanged; the rows only meet in attention, where
the per-layer cache view knows which sequence each row belongs to.

Hooks into mlx-lm, all by its own extension points:

* ``cache.offset`` is an ``mx.array`` of per-row positions (``mx.fast.rope`` takes one offset
  per batch row);
* ``cache.update_and_fetch`` scatters the rows' K/V into the pool (on the CPU kernel's path
  and CUDA's kernel path it hands them to ``attend``, which writes them with the layer's call);
* ``cache.make_mask`` returns None: masking is the paged attention's job;
* ``scaled_dot_product_attention``, imported by name into each model module, is rebound to a
  function that routes our cache views to ``paged_attention`` and delegates everything else;
* the final norm is wrapped so only the rows whose logits are needed reach the LM head (a
  prefill chunk needs one row of logits, not one per token).

The step's layout (rows, bucketed shapes, padding rows, decode groups) is
engine/runner/step_batch.py.

Which architectures may use these hooks, and the check at load for the others, live in
engine/runner/architecture.py.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn

from engine.attention import cpu_kernel, kv_write
from engine.attention import dispatch as attention
from engine.kv.pool import KVPool
from engine.runner.step_batch import StepBatch, blas_rows

#: CUDA's kernel path writes K/V with one in-place launch a layer (engine/attention/kv_write.py)
#: instead of MLX's scatters. A switch for measuring the two (bench/gpu_bench.py --kv-write).
STORE_IN_PLACE = True
#: On CUDA's kernel path, a prefill chunk of at least this many tokens attends over its
#: gathered blocks with MLX's fused attention at padded shapes (``dispatch.gathered_prefill``,
#: each shape built at load by ``warm_gathered_prefill``) instead of the paged kernel, and
#: that step's layers write by scatters (a gather is not ordered after an in-place write).
#: The paged prefill kernel serves ``cuda.PREFILL_TOKENS_PER_BLOCK`` query tokens x the
#: group's heads per thread block (two tokens for a group of 4) and each block reads the
#: whole context, so a long chunk reads its context hundreds of times;
#: scripts/gpu/prefill_attention.py times them. None: the kernel for every chunk, the default
#: until a GPU A/B and the GPU check have run with it (bench/gpu_bench.py --gathered-prefill
#: N turns it on for a run).
GATHERED_PREFILL_FROM: int | None = None


def gathers_prefill(chunk_tokens: int) -> bool:
    """Whether a prefill chunk this long attends over its gathered blocks
    (``dispatch.gathered_prefill``) on CUDA's kernel path (``GATHERED_PREFILL_FROM``)."""
    return GATHERED_PREFILL_FROM is not None and chunk_tokens >= GATHERED_PREFILL_FROM


def warm_gathered_prefill(pool: KVPool, heads: int | None, max_chunk: int,
                          max_context: int) -> int:
    """Build, at load, every shape the gathered prefill can attend at in this engine
    (``dispatch.gathered_shapes``: chunks of ``GATHERED_PREFILL_FROM`` to ``max_chunk``
    tokens, tables up to ``max_context`` or the pool's whole size, whichever is smaller), so
    that on CUDA no step beside streaming chats
    pays a cuDNN graph (80-90 ms each on an H100). Returns how many shapes it ran: 0 when the
    path is off, no chunk reaches it, or the model's query heads are not known (``heads``;
    then the first use of each shape builds it)."""
    if GATHERED_PREFILL_FROM is None or max_chunk < GATHERED_PREFILL_FROM or not heads:
        return 0
    shapes = attention.gathered_shapes(GATHERED_PREFILL_FROM, max_chunk,
                                       min(-(-max_context // pool.block_size),
                                           pool.num_blocks), pool.block_size)
    k_scales, v_scales = pool.scales(0)
    attention.warm_gathered_prefill(heads, pool.keys[0], pool.values[0], shapes,
                                    pool.shape.dtype, k_scales, v_scales)
    return len(shapes)


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
        #: The step's items on the host when the CPU kernel attends (engine/attention/
        #: cpu_kernel.py), set with ``batch``; None: the MLX paths.
        self.host_layout: cpu_kernel.HostLayout | None = None
        #: Under the CPU kernel, and on CUDA's kernel path: the layer's K/V rows, from
        #: ``update_and_fetch`` until ``attend`` writes them into the pool.
        self.pending_kv: tuple[mx.array, mx.array] | None = None
        #: Whether this layer runs on MLX's CUDA backend with the kernels (decided at the
        #: first write, on the engine's thread): None until then.
        self._on_cuda: bool | None = None
        #: The step's in-place write of this layer on CUDA (the scale it passed on), for
        #: ``PagedModel.written``; None where MLX's scatters wrote.
        self.written: mx.array | None = None
        self._scale: tuple[float, mx.array] | None = None

    @property
    def offset(self) -> mx.array:
        return self.batch.positions

    def make_mask(self, *args, **kwargs) -> None:
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # [T, kv_heads, 1, head_dim] -> [T, kv_heads, head_dim]
        keys_rows, values_rows = keys[:, :, 0], values[:, :, 0]
        if self._on_cuda is None:
            self._on_cuda = self.use_kernel and kv_write.cuda_kernels_run()
        if self.host_layout is not None or (self._on_cuda and STORE_IN_PLACE):
            self.pending_kv = (keys_rows, values_rows)  # ``attend`` writes them
        else:
            self._scatter(keys_rows, values_rows)
        return keys, values

    def _scatter(self, keys_rows: mx.array, values_rows: mx.array) -> None:
        """The rows into the pool by MLX's scatters (an 8-bit pool's quantized by one kernel
        launch on CUDA)."""
        b = self.batch
        if self.pool.quantized:
            self.pool.write_quantized(self.layer, b.write_blocks, b.write_offsets,
                                      *kv_write.quantize_kv(keys_rows, values_rows,
                                                            bool(self._on_cuda)))
        else:
            self.pool.write(self.layer, b.write_blocks, b.write_offsets, keys_rows, values_rows)

    def _store(self, keys_rows: mx.array, values_rows: mx.array, scale: float) -> mx.array:
        """The rows into the pool by one in-place CUDA launch; returns the scale it passes on,
        which the layer's attention kernels read (engine/attention/kv_write.py)."""
        if self._scale is None or self._scale[0] != scale:
            self._scale = (scale, mx.array([scale], dtype=mx.float32))
        pool, b = self.pool, self.batch
        if not pool.quantized and keys_rows.dtype != pool.shape.dtype:
            keys_rows = keys_rows.astype(pool.shape.dtype)
            values_rows = values_rows.astype(pool.shape.dtype)
        k_scales, v_scales = pool.scales(self.layer)
        self.written = kv_write.store_kv(
            keys_rows, values_rows, b.write_blocks, b.write_offsets, pool.keys[self.layer],
            pool.values[self.layer], self._scale[1], k_scales, v_scales)
        return self.written

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
        scale_array = None
        kernel = self._kernel_fits(queries.shape[1])
        gathered = bool(kernel and self._on_cuda and gathers_prefill(b.longest_prefill))
        if self.host_layout is None and self.pending_kv is not None:  # CUDA's kernel path
            new_kv, self.pending_kv = self.pending_kv, None
            if kernel and not gathered:
                scale_array = self._store(*new_kv, scale)
            else:  # the reference path's gathers are not ordered after an in-place write
                self._scatter(*new_kv)
        # read after the write: a scatter rebinds the pool's arrays
        k_pool = self.pool.keys[self.layer]
        v_pool = self.pool.values[self.layer]
        k_scales, v_scales = self.pool.scales(self.layer)  # None, None unless 8-bit
        sc = {"k_scales": k_scales, "v_scales": v_scales}
        if self.host_layout is not None:  # the CPU kernel: every row of the step in one call
            new_kv, self.pending_kv = self.pending_kv, None
            if new_kv is None:
                raise RuntimeError("the paged cache attended before its rows' K/V were given")
            return cpu_kernel.attend(queries, k_pool, v_pool, k_scales, v_scales,
                                     self.host_layout, scale, new_kv=new_kv)
        kernel_sc = {**sc, "scale_array": scale_array}
        parts = []
        if b.num_decode:
            q = queries[: b.num_decode]
            if kernel:
                parts.append(attention.paged_decode(
                    q, k_pool, v_pool, b.decode_tables, b.decode_lens, scale, use_kernel=True,
                    **kernel_sc))
            elif len(b.decode_groups) == 1:
                parts.append(attention.reference_decode(
                    q, k_pool, v_pool, b.decode_tables, b.decode_lens, scale, **sc))
            else:  # each group of rows over its own tables' width, not the longest one's
                for g in b.decode_groups:
                    parts.append(attention.reference_decode(
                        q[g.start:g.stop], k_pool, v_pool,
                        b.decode_tables[g.start:g.stop, :g.width], b.decode_lens[g.start:g.stop],
                        scale, **sc))
        for chunk in b.prefills:
            q = queries[chunk.row_start : chunk.row_start + chunk.length]
            q = mx.swapaxes(q, 0, 2)  # [1, heads, L, head_dim]
            if gathered and gathers_prefill(chunk.length):
                out = attention.gathered_prefill(q, k_pool, v_pool, chunk.block_table,
                                                 chunk.context_len, scale, **sc)
            else:
                out = attention.paged_prefill(
                    q, k_pool, v_pool, chunk.block_table, chunk.context_len, scale,
                    use_kernel=kernel, block_tables=chunk.block_tables,
                    context_lens=chunk.context_lens, **kernel_sc,
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

    def __init__(self, model: nn.Module, pool: KVPool, use_kernel: bool = False,
                 cpu_kernel: bool = False) -> None:
        """use_kernel: the GPU backend's attention kernels; cpu_kernel: the compiled CPU
        kernel (engine/attention/cpu_kernel.py), where no GPU kernel runs."""
        self.model = model
        self.pool = pool
        _install_attention_router(model)
        self.caches = [PagedLayerCache(pool, i, use_kernel) for i in range(len(model.layers))]
        self.use_kernel = use_kernel
        self.cpu_kernel = cpu_kernel and not use_kernel
        #: How a step's rows are padded for the matmuls (engine/runner/step_batch.py): the
        #: CPU backend's BLAS is fastest at some row counts; a GPU keeps the buckets only.
        self.row_fit = blas_rows if mx.default_device() == mx.cpu else None
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
        layout = cpu_kernel.HostLayout.of(batch) if self.cpu_kernel else None
        for cache in self.caches:
            cache.batch = batch
            cache.host_layout = layout
            cache.written = None
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

    @property
    def decode_kernel(self) -> bool:
        """True once a step has run the decode attention on the backend's kernel (False
        before the first step, or where the kernel does not handle the model's shapes)."""
        return bool(self.use_kernel and self.caches and self.caches[0]._kernel_ok)

    def written(self) -> list[mx.array]:
        """What a step wrote (lazy until evaluated): evaluating it runs a step that wants no
        logits. The pool arrays, which MLX's scatters rebind; on CUDA's kernel path also each
        layer's in-place write (its passed-on scale), which leaves them as they were."""
        return [*(c.written for c in self.caches if c.written is not None), *self.pool.arrays()]
