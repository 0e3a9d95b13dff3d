"""How efficiently the compiled CPU attention kernel reads a chunk, by its size (issue #24).

A paste beside streaming chats gets small chunks (8-30 tokens a step); alone it gets 256.
Both re-read the whole context, so a small chunk's attention per token costs more wherever
the kernel's per-block work (widening each block's K and V into tiles, once per item and KV
head) is shared by fewer query rows. One layer of the default model's shapes (9 query heads
over 3 KV heads, head dim 64, float32 pool, blocks of 16): four decode rows at contexts
150-300 beside a chunk ending at ~3,400 tokens, timed on one and on two threads (medians of
9 calls of ``engine.attention.cpu_kernel.attend``), as GFLOP/s of the chunk's scores and
P.V.

    source scripts/env.sh; .venv/bin/python -m bench.cpu_kernel_chunk_cost
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np

from engine.attention import cpu_kernel
from engine.runner.step_batch import build_step_batch
from engine.sched.work import SequenceWork

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DECODES = (300, 220, 150, 180)
CHUNKS = (8, 12, 32, 64, 256)
CONTEXT = 3400


def main() -> None:
    if not cpu_kernel.ready():
        raise SystemExit("the CPU kernel does not build here (see the log)")
    rng = np.random.default_rng(0)
    blocks = sum(-(-n // BLOCK) for n in DECODES) + -(-(CONTEXT + max(CHUNKS)) // BLOCK) + 1
    shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_pool = mx.array(rng.standard_normal(shape, dtype=np.float32))
    v_pool = mx.array(rng.standard_normal(shape, dtype=np.float32))
    print("| step (one layer) | 1 thread, ms | 2 threads, ms | chunk GFLOP/s on 2 threads |")
    print("| --- | ---: | ---: | ---: |")
    for chunk in CHUNKS:
        works, at = [], 0
        for n in DECODES:
            table = list(range(at, at + -(-n // BLOCK)))
            at += len(table)
            works.append(SequenceWork([1], n - 1, table, [(table[(n - 1) // BLOCK],
                                                           (n - 1) % BLOCK)]))
        table = list(range(at, at + -(-(CONTEXT + chunk) // BLOCK)))
        works.append(SequenceWork([1] * chunk, CONTEXT, table,
                                  [(table[p // BLOCK], p % BLOCK)
                                   for p in range(CONTEXT, CONTEXT + chunk)],
                                  want_logits=False))
        batch = build_step_batch(works)
        queries = mx.array(rng.standard_normal((batch.tokens.shape[0], HEADS, 1, HEAD_DIM),
                                               dtype=np.float32))
        layout = cpu_kernel.HostLayout.of(batch)
        times = {}
        for threads in (1, 2):
            fixed = cpu_kernel.HostLayout(layout.tables, layout.q_row, layout.q_len,
                                          layout.context, layout.cost, threads=threads)
            runs = []
            for _ in range(10):
                start = time.perf_counter()
                mx.eval(cpu_kernel.attend(queries, k_pool, v_pool, None, None, fixed, 0.125))
                runs.append(time.perf_counter() - start)
            times[threads] = statistics.median(runs[1:])
        flops = chunk * (CONTEXT + chunk / 2) * HEADS * HEAD_DIM * 4
        print(f"| 4 decodes + {chunk} tokens at {CONTEXT:,} | {1e3 * times[1]:.2f} | "
              f"{1e3 * times[2]:.2f} | {flops / times[2] / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
