"""What a step's K/V writes cost on the CPU: MLX ops against the CPU kernel's writer.

    python -m bench.kv_write_cost [--repeats 40] [--chats 8] [--context 150]

1. The writes alone: 16 rows into each of the default model's 30 layers, as ``KVPool.write``
   does them (two scatters; in an 8-bit pool the quantizer's ops and two more scatters)
   against ``cpu_kernel.write`` (one call a layer), float32 and int8 pools, interleaved.
2. Whole steps: one decode row per chat at about ``--context`` tokens (padded to the BLAS's
   rows as the engine pads them), forward and logits, on a float32 and an int8 pool, with
   the layers' writes done by the kernel's call (the engine's path) and by MLX scatters
   before it (the path before shaders/kv_write_cpu.cpp), all four interleaved step by step in
   one process. Both write paths must give the same logits.

Medians with p10-p90 over the repeats (the first 3 dropped), and per-pair ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from engine.attention import cpu_kernel
from engine.kv.pool import KVPool, KVShape
from engine.models.default_model import load_default_model
from engine.runner.model_adapter import PagedLayerCache, PagedModel
from engine.runner.step_batch import blas_rows, build_step_batch
from engine.sched.work import SequenceWork

BLOCK = 16


class _ScatterWritesCache(PagedLayerCache):
    """The layer cache as it was before the kernel wrote: ``KVPool.write``'s MLX scatters,
    then the kernel's call reading the pool."""

    def update_and_fetch(self, keys, values):
        b = self.batch
        self.pool.write(self.layer, b.write_blocks, b.write_offsets, keys[:, :, 0],
                        values[:, :, 0])
        return keys, values

    def attend(self, queries, scale):
        k_scales, v_scales = self.pool.scales(self.layer)
        return cpu_kernel.attend(queries, self.pool.keys[self.layer],
                                 self.pool.values[self.layer], k_scales, v_scales,
                                 self.host_layout, scale)


def _spread(samples: list[float]) -> str:
    s = sorted(samples[3:])
    return (f"{1e3 * statistics.median(s):.2f} ms (p10 {1e3 * s[len(s) // 10]:.2f}, "
            f"p90 {1e3 * s[int(0.9 * len(s))]:.2f})")


def _ratio(new: list[float], old: list[float]) -> str:
    r = sorted(b / a for a, b in zip(old[3:], new[3:], strict=True))
    return f"{statistics.median(r):.3f} (p10 {r[len(r) // 10]:.3f}, p90 {r[int(0.9 * len(r))]:.3f})"


def writes_alone(shape: dict, repeats: int) -> None:
    rows = 16
    gen = np.random.default_rng(0)
    blocks = np.arange(rows, dtype=np.int32)
    offsets = np.full(rows, 3, dtype=np.int32)
    x = mx.array(gen.standard_normal((rows, shape["num_kv_heads"], shape["head_dim"]),
                                     dtype=np.float32))
    print(f"\n## The writes alone: {rows} rows x {shape['num_layers']} layers a step\n")
    print("| pool | MLX ops | the kernel's writer | writer / MLX |\n| --- | ---: | ---: | ---: |")
    for quantized in (False, True):
        pools = {way: KVPool(KVShape(**shape, quantized=quantized), 64, BLOCK)
                 for way in ("mlx", "kernel")}
        times: dict[str, list[float]] = {way: [] for way in pools}
        mx_blocks, mx_offsets = mx.array(blocks), mx.array(offsets)
        for _ in range(repeats):
            for way, pool in pools.items():
                start = time.perf_counter()
                for layer in range(shape["num_layers"]):
                    k, v = x * 1.01, x * 0.99  # fresh lazy rows, as a layer's projections are
                    if way == "mlx":
                        pool.write(layer, mx_blocks, mx_offsets, k, v)
                        mx.eval(pool.keys[layer], pool.values[layer],
                                *[a for a in pool.scales(layer) if a is not None])
                    else:
                        cpu_kernel.write(pool.keys[layer], pool.values[layer],
                                         *pool.scales(layer), k, v, blocks, offsets)
                times[way].append(time.perf_counter() - start)
        label = "int8" if quantized else "float32"
        print(f"| {label} | {_spread(times['mlx'])} | {_spread(times['kernel'])} | "
              f"{_ratio(times['kernel'], times['mlx'])} |")


def whole_steps(model, shape: dict, chats: int, context: int, repeats: int) -> None:
    works, at = [], 0
    for i in range(chats):
        n = context + 7 * i
        table = list(range(at, at + -(-n // BLOCK)))
        at += len(table)
        works.append(SequenceWork([1 + i], n - 1, table, [(table[(n - 1) // BLOCK],
                                                           (n - 1) % BLOCK)]))
    batch = build_step_batch(works, row_fit=blas_rows)
    variants = {}
    for quantized in (False, True):
        for writes in ("kernel", "mlx"):
            paged = PagedModel(model, KVPool(KVShape(**shape, quantized=quantized), at + 8,
                                             BLOCK), cpu_kernel=True)
            if writes == "mlx":
                paged.caches = [_ScatterWritesCache(paged.pool, i, False)
                                for i in range(len(paged.caches))]
            variants["int8" if quantized else "float32", writes] = paged
    times: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
    logits = {}
    for _ in range(repeats):
        for key, paged in variants.items():
            start = time.perf_counter()
            out = paged.forward(batch)
            mx.eval(out)
            times[key].append(time.perf_counter() - start)
            logits[key] = out
    print(f"\n## Whole steps: {chats} decode rows at {context}-{context + 7 * (chats - 1)} "
          f"tokens, {batch.tokens.shape[0]} rows, forward and logits\n")
    print("| pool | writes by MLX ops | writes by the kernel's call | kernel / MLX | same logits |")
    print("| --- | ---: | ---: | ---: | --- |")
    for pool in ("float32", "int8"):
        same = bool(mx.array_equal(logits[pool, "kernel"], logits[pool, "mlx"]).item())
        print(f"| {pool} | {_spread(times[pool, 'mlx'])} | {_spread(times[pool, 'kernel'])} | "
              f"{_ratio(times[pool, 'kernel'], times[pool, 'mlx'])} | {same} |")
    for writes in ("mlx", "kernel"):
        print(f"\nint8 / float32 step time, writes by {writes}: "
              f"{_ratio(times['int8', writes], times['float32', writes])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--context", type=int, default=150)
    args = parser.parse_args()
    if not cpu_kernel.ready():
        raise SystemExit("the CPU kernel does not build here (see the log)")
    model = load_default_model().model
    a = model.args
    shape = dict(num_layers=a.num_hidden_layers, num_kv_heads=a.num_key_value_heads,
                 head_dim=a.hidden_size // a.num_attention_heads, dtype=mx.float32)
    print(f"Device {mx.default_device()}; {args.repeats} repeats, interleaved")
    writes_alone(shape, args.repeats)
    whole_steps(model, shape, args.chats, args.context, args.repeats)


if __name__ == "__main__":
    main()
