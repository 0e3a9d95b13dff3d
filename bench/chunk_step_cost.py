"""What a prompt chunk adds to a step of decodes, through the whole model (issue #24's CPU
profile): four chats decoding at 150-300 tokens of context, alone and with a chunk of n
prompt tokens at a given context, and the chunk alone. A chunk at context 0 shows what its
tokens cost of their own (the MLP's matmuls); the same chunk at 3,200 tokens shows what
re-reading the context adds.

    source scripts/env.sh; .venv/bin/python -m bench.chunk_step_cost [--model default]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

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
    paged = PagedModel(model, pool, use_kernel=False)
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

    def median_ms(works: list[SequenceWork]) -> float:
        mx.eval(paged.forward(build_step_batch(works)))  # warm up (compiles, plans)
        times = []
        for _ in range(args.repeats):
            batch = build_step_batch(works)
            t0 = time.perf_counter()
            mx.eval(paged.forward(batch), pool.keys, pool.values)
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    base = median_ms(decodes)
    print(f"4 decodes: {base:.0f} ms")
    for ctx, n in CHUNKS:
        c = chunk(ctx, n)
        mixed, alone = median_ms([*decodes, c]), median_ms([c])
        print(f"4 decodes + {n} prompt tokens at context {ctx}: {mixed:.0f} ms "
              f"({mixed / base:.2f}x); the chunk alone {alone:.0f} ms")


if __name__ == "__main__":
    main()
