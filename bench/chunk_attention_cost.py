"""What a prompt chunk's attention costs on the reference path, by context and chunk size
(issue #24's CPU profile): every layer of the default model's attention shapes (9 query
heads over 3 KV heads, head dim 64, 30 layers, fp32), the whole reference prefill (gather the
context's blocks, then SDPA) against the gather alone. A chunk re-reads its whole context
each step, so this is the per-chunk part of a mixed step's cost.

    source scripts/env.sh; .venv/bin/python -m bench.chunk_attention_cost
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np

from engine.attention.dispatch import gather_kv, reference_prefill

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
POOL_BLOCKS = 400


def median_ms(fn, repeats: int = 5) -> float:
    for _ in range(2):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    pools = [(mx.random.normal((POOL_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)),
              mx.random.normal((POOL_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM))) for _ in range(LAYERS)]
    mx.eval(pools)
    rng = np.random.default_rng(0)
    print("| context | query tokens | attention (gather + SDPA) ms | the gather alone ms |")
    print("| ---: | ---: | ---: | ---: |")
    for context in (256, 1024, 2600):
        table = mx.array(rng.permutation(POOL_BLOCKS)[:-(-context // BLOCK)].astype(np.int32))
        for tokens in (1, 12, 256):
            q = mx.random.normal((1, HEADS, tokens, HEAD_DIM))

            def whole(q=q, table=table, context=context):
                return [reference_prefill(q, k, v, table, context, HEAD_DIM**-0.5)
                        for k, v in pools]

            def gather(table=table, context=context):
                return [gather_kv(k, None, table[None], mx.float32)[:, :, :context]
                        for k, _ in pools]

            print(f"| {context} | {tokens} | {median_ms(whole):.0f} | {median_ms(gather):.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
