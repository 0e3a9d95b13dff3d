"""What bucketed shapes cost or save (engine/runner/step_batch.py ``BUCKET_SHAPES``).

On a GPU, bucketing lets MLX's CUDA backend reuse its graphs and the kernels their plans;
on the CPU it only adds padding rows (at most 1.5x the decode rows) and table columns. This
runs the same greedy chats on one engine per side, interleaved A B A B, and reports decode
tokens/s per side (median, min-max) and the ratio. ``--chats 5`` pads every decode step
(5 rows -> 6); ``--chats 8`` pads none, so only the tables' widths differ.

    source scripts/env.sh; .venv/bin/python bench/bucket_cost.py [--chats 5] [--tokens 128]
        [--repeats 3] [--model default]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine.runner.step_batch as step_batch  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402

QUESTION = "Tell me about the history of the number {i} in a long, detailed answer."


def run(engine: Engine, chats: int, tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    t0 = time.perf_counter()
    handles = [engine.submit(messages=[{"role": "user", "content": QUESTION.format(i=i)}],
                             params=params, session_id=f"b{i}") for i in range(chats)]
    generated = sum(h.result(600)[0].usage.generated_tokens for h in handles)
    return generated / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=args.model, kv_memory_mib=256))
    engine.start()
    assert engine.wait_ready(600), engine.load_error
    results: dict[bool, list[float]] = {True: [], False: []}
    try:
        run(engine, args.chats, 8)  # warm up
        for _ in range(args.repeats):
            for side in (True, False):
                step_batch.BUCKET_SHAPES = side
                results[side].append(run(engine, args.chats, args.tokens))
    finally:
        engine.stop()
    for side, values in results.items():
        print(f"bucketed={side}: {statistics.median(values):.1f} tok/s "
              f"(min {min(values):.1f}, max {max(values):.1f}, n={len(values)})")
    ratios = [a / b for a, b in zip(results[True], results[False])]
    print(f"bucketed / exact: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
