"""The sampler alone: one step's draw for 64 rows of a SmolLM2-sized vocabulary.

Six mixes: greedy; the app's default sampling (temperature 0.3, top-p 0.9, repetition
penalty 1.15 over 128 tokens), unseeded and seeded; a mix of greedy, default and other
filters, half of the sampled rows seeded; and temperature 0.3 alone, unseeded and seeded
(the draw itself, without top-p's sort, which dominates a CPU step). For each it prints,
in milliseconds per step:

- ``build``: the host's time to build the step's sampling graph (what the engine thread
  spends before it can launch the step; the device works meanwhile when steps overlap);
- ``step``: build and evaluate, the sampler's whole cost where nothing overlaps.

Two ways to draw: ``sample_rows`` (rows seen once: their windows and keys built from the
host's lists, what every step did before the state was carried; it runs on older code too,
so the same script measures a checkout before this change: ``PYTHONPATH=<old checkout>``),
and ``carried`` (the engine's steady decode: the layout built once, the windows and keys
carried on the device from the previous step).

    source scripts/env.sh
    .venv/bin/python -m bench.sampler_bench [--rows 64] [--repeats 30] [--spread 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from engine.config import SamplingParams
from engine.runner import sampling
from engine.runner.sampling import SamplingRow, new_key, sample_rows

VOCAB = 49152
APP = dict(temperature=0.3, top_p=0.9, repetition_penalty=1.15, repetition_context_size=128)


def mixes(rows: int) -> dict[str, list[SamplingParams]]:
    seeded = [SamplingParams(**APP, seed=i) for i in range(rows)]
    mixed = []
    for i in range(rows):
        kind = i % 4
        if kind == 0:
            mixed.append(SamplingParams(temperature=0.0))
        elif kind == 1:
            mixed.append(SamplingParams(**APP))
        elif kind == 2:
            mixed.append(SamplingParams(**APP, seed=i))
        else:
            mixed.append(SamplingParams(temperature=0.8, top_k=40, min_p=0.05, seed=i))
    return {
        "greedy": [SamplingParams(temperature=0.0)] * rows,
        "default": [SamplingParams(**APP)] * rows,
        "default-seeded": seeded,
        "mixed": mixed,
        # the draw without top-p's sort (which dominates a CPU step): temperature only
        "temperature": [SamplingParams(temperature=0.3)] * rows,
        "temperature-seeded": [SamplingParams(temperature=0.3, seed=i) for i in range(rows)],
    }


def key(params: SamplingParams, index: int) -> mx.array | None:
    """A row's own key as admission gives it: seeded rows only (before the batched draw,
    every sampled row had one, from fresh entropy when unseeded)."""
    if params.greedy or (params.seed is None and hasattr(sampling, "Layout")):
        return None
    return new_key(params.seed, index)


def timed(fn, repeats: int) -> tuple[float, float]:
    """Median build and build+eval times (ms) of ``fn`` (returns the arrays to evaluate)."""
    for _ in range(2):
        mx.eval(fn())
    build, total = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        build.append((t1 - t0) * 1e3)
        total.append((t2 - t0) * 1e3)
    return statistics.median(build), statistics.median(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--spread", type=float, default=3.0,
                        help="standard deviation of the random logits: 3 gives a top-p 0.9 "
                             "nucleus of 1,500-2,200 tokens (wider than the CPU's candidates), 5 "
                             "one of 30-60 (the default model's chat replies: 15 at the median, "
                             "467 at p99)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(0, args.spread, size=(args.rows, VOCAB)).astype(np.float32))
    histories = [rng.integers(0, VOCAB, size=300).tolist() for _ in range(args.rows)]
    print(f"{args.rows} rows, vocabulary {VOCAB}, {mx.default_device()}; median ms per step")
    print(f"{'mix':16} {'path':12} {'build':>8} {'step':>8}")
    for name, params in mixes(args.rows).items():
        rows = [SamplingRow(p, h, key(p, i)) for i, (p, h) in enumerate(zip(params, histories))]

        def once(rows=rows):
            tokens, keys = sample_rows(logits, rows)
            return [tokens] + [k for k in keys if k is not None]

        b, t = timed(once, args.repeats)
        print(f"{name:16} {'sample_rows':12} {b:8.3f} {t:8.3f}", flush=True)
        if not hasattr(sampling, "Layout"):
            continue  # a checkout before the carried state
        layout = sampling.Layout(rows)
        state = [layout.initial_state(rows)]

        def carried(layout=layout, state=state):
            tokens, state[0] = sampling.draw(layout, logits, state[0])
            return [tokens] + [a for a in (state[0].windows, state[0].keys) if a is not None]

        b, t = timed(carried, args.repeats)
        print(f"{name:16} {'carried':12} {b:8.3f} {t:8.3f}", flush=True)


if __name__ == "__main__":
    main()
