"""Does starting PagedChat the way the `pagedchat` entry point does give MLX the fast BLAS?

Each run is a fresh process started like `.venv/bin/pagedchat`, without `LD_PRELOAD`: it calls
what `app.main.main()` calls first (`app.core.openblas.load()`), then imports MLX and times a
1024x1024 fp32 matmul on the CPU (median of 7 after a warm-up). Three ways, interleaved:

- `entry point`: the ctypes load (what `pagedchat` and `pagedchat serve` do now);
- `opted out`: `PAGEDCHAT_NO_OPENBLAS=1` (what the entry point did before: MLX's bundled BLAS);
- `LD_PRELOAD`: the variable set before the process starts (`run.sh`, the bundle's re-exec).

    source scripts/env.sh; .venv/bin/python -m bench.blas_startup [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from app.core.openblas import OPENBLAS_OPENMP

CHILD = r"""
import time
from app.core import openblas
state = openblas.load()
import mlx.core as mx
mx.set_default_device(mx.cpu)
a = mx.random.normal((1024, 1024)); b = mx.random.normal((1024, 1024)); mx.eval(a, b)
mx.eval(a @ b)
times = []
for _ in range(7):
    t = time.perf_counter(); mx.eval(a @ b); times.append(time.perf_counter() - t)
times.sort()
print(times[3], state.label)
"""


def run(variant: str) -> tuple[float, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PAGEDCHAT_NO_OPENBLAS")}
    if variant == "opted out":
        env["PAGEDCHAT_NO_OPENBLAS"] = "1"
    elif variant == "LD_PRELOAD":
        env["LD_PRELOAD"] = next(p for p in OPENBLAS_OPENMP if os.path.isfile(p))
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, check=True, timeout=300).stdout.split(maxsplit=1)
    return float(out[0]), out[1].strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    variants = ("entry point", "opted out", "LD_PRELOAD")
    rows: dict[str, list[float]] = {v: [] for v in variants}
    labels: dict[str, str] = {}
    for _ in range(args.repeats):  # A B C A B C ...
        for v in variants:
            seconds, labels[v] = run(v)
            rows[v].append(seconds)
    print("| start | BLAS MLX used | 1024x1024 fp32 matmul, median ms (min-max) | GFLOP/s |")
    print("|---|---|---|---|")
    for v in variants:
        med = statistics.median(rows[v])
        print(f"| {v} | {labels[v]} | {med * 1e3:.1f} ({min(rows[v]) * 1e3:.1f}-"
              f"{max(rows[v]) * 1e3:.1f}) | {2 * 1024**3 / med / 1e9:.0f} |")


if __name__ == "__main__":
    main()
