"""Should OpenBLAS's OpenMP threads spin or sleep between matmuls? (docs/FACTS.md)

Debian's openmp OpenBLAS, which MLX's CPU matmuls use on Linux (app/core/openblas.py), runs
its GEMMs on libgomp threads; by default they spin for a while after each one, on the same 2
cores that the Python threads and the CPU attention kernel (engine/attention/cpu_kernel.py)
need. Each measurement is a fresh process with OpenBLAS preloaded and ``OMP_WAIT_POLICY`` set
before it starts (libgomp reads it when it loads); the two policies alternate, repeat by
repeat. Measured in each process:

- mlx-lm alone: one sequence decoding through its own cache (ms per token, median of 3
  runs of 32 tokens), and a 256-token prefill (ms, median of 3);
- the engine's step on the compiled CPU kernel: four decode rows at contexts 150-300 beside
  a prompt chunk (14 tokens at 3,200 of context), the kernel split over the cores or kept on
  one thread (median of 5 steps each).

    source scripts/env.sh; .venv/bin/python -m bench.blas_wait_policy [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from app.core.openblas import OPENBLAS_OPENMP

POLICIES = ("ACTIVE", "PASSIVE")


def child() -> None:
    """One process's measurements, printed as one JSON line."""
    import time

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine.attention import cpu_kernel
    from engine.kv.pool import KVPool
    from engine.models.resolve import load_model
    from engine.runner.architecture import probe_kv_shape
    from engine.runner.model_adapter import PagedModel
    from engine.runner.step_batch import build_step_batch
    from engine.sched.work import SequenceWork

    model = load_model("default").model

    def decode_ms(tokens: int = 32) -> float:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[1] * 20]), cache=cache))
        token = mx.array([[5]])
        start = time.perf_counter()
        for _ in range(tokens):
            mx.eval(model(token, cache=cache))
        return 1e3 * (time.perf_counter() - start) / tokens

    def prefill_ms(tokens: int = 256) -> float:
        cache = make_prompt_cache(model)
        start = time.perf_counter()
        mx.eval(model(mx.array([[1] * tokens]), cache=cache))
        return 1e3 * (time.perf_counter() - start)

    decode_ms(4)
    result = {"decode_ms": statistics.median(decode_ms() for _ in range(3)),
              "prefill256_ms": statistics.median(prefill_ms() for _ in range(3))}

    block = 16
    shape = probe_kv_shape(model)
    pool = KVPool(shape, 1024, block)
    for layer in range(shape.num_layers):
        pool.keys[layer] = mx.random.normal(pool.keys[layer].shape).astype(shape.dtype)
        pool.values[layer] = mx.random.normal(pool.values[layer].shape).astype(shape.dtype)
    mx.eval(pool.keys, pool.values)
    if not cpu_kernel.ready():
        raise SystemExit("the CPU kernel does not build here (see the log)")
    paged = PagedModel(model, pool, use_kernel=False, cpu_kernel=True)
    next_block = [0]

    def table(tokens: int) -> list[int]:
        count = -(-tokens // block)
        blocks = list(range(next_block[0], next_block[0] + count))
        next_block[0] += count
        return blocks

    works = []
    for ctx in (150, 220, 300, 180):
        t, last = table(ctx), ctx - 1
        works.append(SequenceWork([1], last, t, [(t[last // block], last % block)]))
    t = table(3200 + 14)
    works.append(SequenceWork([5] * 14, 3200, t, [(t[p // block], p % block)
                                                  for p in range(3200, 3214)],
                              want_logits=False))
    for name, min_cost in (("step_one_thread_ms", 10**12), ("step_threads_ms", 0)):
        cpu_kernel.THREAD_MIN_COST = min_cost
        times = []
        for _ in range(6):
            batch = build_step_batch(works)
            start = time.perf_counter()
            out = paged.forward(batch)
            mx.eval(*([] if out is None else [out]), pool.keys, pool.values)
            times.append(1e3 * (time.perf_counter() - start))
        result[name] = statistics.median(times[1:])
    print(json.dumps(result))


def measure(policy: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    env["OMP_WAIT_POLICY"] = policy
    run = subprocess.run([sys.executable, "-m", "bench.blas_wait_policy", "--child"],
                         capture_output=True, text=True, env=env, timeout=1800, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child()
        return
    if "openblas" not in os.environ.get("LD_PRELOAD", ""):
        raise SystemExit(f"preload OpenBLAS first (source scripts/env.sh): {OPENBLAS_OPENMP}")
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    for repeat in range(args.repeats):
        for policy in POLICIES if repeat % 2 == 0 else POLICIES[::-1]:
            runs[policy].append(measure(policy))
            print(policy, runs[policy][-1], flush=True)
    print("\n| measure | ACTIVE (spin) | PASSIVE (sleep) | passive / active |")
    print("| --- | ---: | ---: | ---: |")
    for key in runs[POLICIES[0]][0]:
        spin = [r[key] for r in runs["ACTIVE"]]
        sleep = [r[key] for r in runs["PASSIVE"]]
        print(f"| {key} | {statistics.median(spin):.1f} ({min(spin):.1f}-{max(spin):.1f}) | "
              f"{statistics.median(sleep):.1f} ({min(sleep):.1f}-{max(sleep):.1f}) | "
              f"{statistics.median(sleep) / statistics.median(spin):.2f}x |")


if __name__ == "__main__":
    main()
