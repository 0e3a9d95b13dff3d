"""What a prompt chunk adds to a step of decodes, through the whole model (issue #24's CPU
profile): four chats decoding at 150-300 tokens of context, alone and with a chunk of n
prompt tokens at a given context, and the chunk alone. A chunk at context 0 shows what its
tokens cost of their own (the MLP's matmuls); the same chunk at 3,200 tokens shows what
re-reading the context adds. Each step is timed on both CPU attention paths, interleaved:
the MLX formulation (engine/attention/cpu_sdpa.py) and the compiled kernel
(engine/attention/cpu_kernel.py).

    source scripts/env.sh; .venv/bin/python -m bench.chunk_step_cost [--model default]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from engine.attention import cpu_kernel
from engine.kv.pool import KVPool
from engine.models.resolve import load_model
from engine.runner.architecture import probe_kv_shape
from engine.runner.model_adapter import PagedModel
from engine.runner.step_batch import build_step_batch
from engine.sched.work import SequenceWork

BLOCK = 16
CHUNKS = ((0, 14), (0, 64), (1000, 14), (2400, 8), (3200, 14), (3200, 64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model = load_model(args.model).model
    shape = probe_kv_shape(model)
    pool = KVPool(shape, 2048, BLOCK)
    for layer in range(shape.num_layers):  # K/V of some scale, as a real pool holds
        pool.keys[layer] = mx.random.normal(pool.keys[layer].shape).astype(shape.dtype)
        pool.values[layer] = mx.random.normal(pool.values[layer].shape).astype(shape.dtype)
    mx.eval(pool.keys, pool.values)
    if not cpu_kernel.ready():
        raise SystemExit("the CPU kernel does not build here (see the log)")
    paths = {"mlx": PagedModel(model, pool, use_kernel=False),
             "kernel": PagedModel(model, pool, use_kernel=False, cpu_kernel=True)}
    next_block = [0]

    def table(tokens: int) -> list[int]:
        nb = -(-tokens // BLOCK)
        blocks = list(range(next_block[0], next_block[0] + nb))
        next_block[0] += nb
        return blocks

    decodes = []
    for ctx in (150, 220, 300, 180):
        t, last = table(ctx), ctx - 1
        decodes.append(SequenceWork([1], last, t, [(t[last // BLOCK], last % BLOCK)]))

    def chunk(ctx: int, n: int) -> SequenceWork:
        t = table(ctx + n)
        return SequenceWork([5] * n, ctx, t,
                            [(t[p // BLOCK], p % BLOCK) for p in range(ctx, ctx + n)],
                            want_logits=False)

    def median_ms(works: list[SequenceWork]) -> dict[str, float]:
        """Median step time (ms) on each path, the paths alternating repeat by repeat."""
        times: dict[str, list[float]] = {name: [] for name in paths}
        for paged in paths.values():  # warm up (compiles, plans)
            mx.eval(paged.forward(build_step_batch(works)), pool.keys, pool.values)
        for _ in range(args.repeats):
            for name, paged in paths.items():
                batch = build_step_batch(works)
                t0 = time.perf_counter()
                out = paged.forward(batch)
                mx.eval(*([] if out is None else [out]), pool.keys, pool.values)
                times[name].append(time.perf_counter() - t0)
        return {name: 1e3 * statistics.median(t) for name, t in times.items()}

    base = median_ms(decodes)
    print("| step | MLX formulation, ms | over its 4 decodes | kernel, ms | over its 4 decodes |"
          " kernel / MLX |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")

    def row(label: str, t: dict[str, float]) -> None:
        print(f"| {label} | {t['mlx']:.0f} | {t['mlx'] / base['mlx']:.2f}x | {t['kernel']:.0f} | "
              f"{t['kernel'] / base['kernel']:.2f}x | {t['kernel'] / t['mlx']:.2f}x |", flush=True)

    row("4 decodes (contexts 150-300)", base)
    for ctx, n in CHUNKS:
        c = chunk(ctx, n)
        row(f"+ {n} prompt tokens at context {ctx:,}", median_ms([*decodes, c]))
        row(f"{n} prompt tokens at context {ctx:,} alone", median_ms([c]))

if __name__ == "__main__":
    main()
