"""What the CPU backend's matmuls cost by the number of rows a step feeds (issue #28's
drafting steps, issue #24's chunks beside decodes): one layer's seven projections of the
default model (576 -> 576, 192, 192, 576, 1536, 1536; 1536 -> 576) and its LM head
(576 -> 49,152), times M rows, as MLX runs them with the BLAS ``scripts/env.sh`` preloads.

OpenBLAS's kernels tile rows by 8 and 16: on CI's 2 cores, 16 rows cost about what 8 do and
less than 10-12 (engine/runner/step_batch.py ``blas_rows``, which pads a CPU step's rows to
the counts this bench finds cheapest). Medians of ``--repeats`` calls, the row counts
interleaved round by round so a slow spell of the machine hits every count.

    source scripts/env.sh
    .venv/bin/python -m bench.cpu_matmul_rows [--rows 1,2,4,8,10,12,16,24,32] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

PROJECTIONS = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536),
               (1536, 576)]
VOCAB = 49152
LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,3,4,5,6,8,9,10,12,16,20,24,32,48,64")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    counts = [int(r) for r in args.rows.split(",")]
    weights = [mx.random.normal((n, k)) for k, n in PROJECTIONS]
    head = mx.random.normal((VOCAB, 576))
    inputs = {m: {k: mx.random.normal((m, k)) for k in (576, 1536)} for m in counts}
    mx.eval(weights, head, [list(x.values()) for x in inputs.values()])
    layer: dict[int, list[float]] = {m: [] for m in counts}
    lm: dict[int, list[float]] = {m: [] for m in counts}
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for m in counts:
            x = inputs[m]
            t0 = time.perf_counter()
            mx.eval([x[k] @ w.T for (k, _), w in zip(PROJECTIONS, weights)])
            t1 = time.perf_counter()
            mx.eval(x[576] @ head.T)
            t2 = time.perf_counter()
            layer[m].append(t1 - t0)
            lm[m].append(t2 - t1)
    print(f"{mx.default_device()}; median ms (min-max), {args.repeats} repeats")
    print(f"{'rows':>5} {'one layer':>20} {'x' + str(LAYERS):>8} {'LM head':>20}")
    for m in counts:
        a, b = layer[m][1:], lm[m][1:]
        print(f"{m:5d} {statistics.median(a)*1e3:8.2f} ({min(a)*1e3:.2f}-{max(a)*1e3:.2f})"
              f" {LAYERS*statistics.median(a)*1e3:8.1f} {statistics.median(b)*1e3:8.2f}"
              f" ({min(b)*1e3:.2f}-{max(b)*1e3:.2f})")


if __name__ == "__main__":
    main()
