"""Issue #24 on the GPU: what a prefill chunk's attention costs, the paged kernel against
MLX's own attention over the gathered blocks.

    python3 scripts/gpu/prefill_attention.py [--shapes 1B,8B] [--repeats 9] [--cases L:CTX,..]
                                             [--json F]

One chunk of ``L`` query tokens of one sequence whose last token sits at ``context - 1``
(causal inside the chunk, full over the earlier tokens), every layer of the shape, bf16,
blocks of 16 tokens scattered over the pool. Variants, interleaved repeat by repeat:

* ``kernel``: ``paged_prefill(use_kernel=True)``, shaders/paged_attention.cu reading the pool
  through the block table (a thread block serves ``PREFILL_TOKENS_PER_BLOCK`` query tokens
  times the group's heads, at most ``MAX_ROWS`` rows, and reads the whole context for them);
* ``reference``: ``paged_prefill(use_kernel=False)``, the blocks gathered into a contiguous
  K/V and ``mx.fast.scaled_dot_product_attention`` (causal);
* ``gathered``: ``dispatch.gathered_prefill``, the chunk and the table padded to powers of
  two, the blocks gathered, MLX's fused attention with a boolean mask (the engine's path for
  chunks of ``GATHERED_PREFILL_FROM`` tokens or more on CUDA; before 46076a5 it was matrix
  products with the scores in float32);
* ``sdpa``: MLX's attention alone on K/V already contiguous (what the gather adds is the
  difference).

The time is the host's, from the first layer's graph to the evaluated outputs. Medians with
the spread; the kernel and the reference must agree (max abs error printed). Besides, each
variant's first evaluation at a context length it has not seen (a prompt's every chunk has a
new one): what MLX builds per shape shows there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu_bench import BLOCK_SIZE, SHAPES  # noqa: E402
from engine.attention.dispatch import (  # noqa: E402
    gather_blocks,
    gathered_prefill,
    paged_prefill,
)

CASES = [(64, 1024), (64, 8192), (128, 4096), (128, 8192), (256, 1024), (256, 4096),
         (256, 8192), (1024, 8192), (2048, 2048), (2048, 8192)]


def case(shape: dict, length: int, context: int, repeats: int) -> dict:
    layers = shape["num_hidden_layers"]
    h, kvh, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    nb = -(-context // BLOCK_SIZE)
    pool_blocks = nb + 64
    rng = np.random.default_rng(length + context)
    table = mx.array(rng.permutation(pool_blocks)[:nb].astype(np.int32))
    tables = table.reshape(1, -1)
    # the engine's table: padded with block 0 to a bucket of 1.5x at most
    padded = mx.concatenate([table, mx.zeros((nb // 3,), dtype=mx.int32)])
    scale = d**-0.5
    per_layer = []
    for _ in range(layers):
        kp = mx.random.normal((pool_blocks, BLOCK_SIZE, kvh, d)).astype(mx.bfloat16)
        vp = mx.random.normal((pool_blocks, BLOCK_SIZE, kvh, d)).astype(mx.bfloat16)
        q = mx.random.normal((1, h, length, d)).astype(mx.bfloat16)
        k = gather_blocks(kp, table[None])[:, :, :context]
        v = gather_blocks(vp, table[None])[:, :, :context]
        per_layer.append((q, kp, vp, mx.contiguous(k), mx.contiguous(v)))
    mx.eval(per_layer)

    def paged(use_kernel: bool):
        def run(ctx: int) -> list[mx.array]:
            lens = mx.array([ctx], dtype=mx.int32) if use_kernel else None
            return [paged_prefill(q, kp, vp, table, ctx, scale, use_kernel=use_kernel,
                                  block_tables=tables if use_kernel else None, context_lens=lens)
                    for q, kp, vp, _, _ in per_layer]
        return run

    # each paged variant at a context length given (the sdpa row's K/V are cut to ``context``)
    paged_variants = {
        "kernel": paged(True),
        "reference": paged(False),
        "gathered": lambda ctx: [gathered_prefill(q, kp, vp, padded, ctx, scale)
                                 for q, kp, vp, _, _ in per_layer],
    }
    variants = {name: (lambda run=run: run(context)) for name, run in paged_variants.items()}
    variants["sdpa"] = lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale,
                                                                      mask="causal")
                                for q, _, _, k, v in per_layer]
    ref = variants["reference"]()[0].astype(mx.float32)
    err = {name: float(mx.max(mx.abs(fn()[0].astype(mx.float32) - ref)))
           for name, fn in variants.items() if name != "reference"}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(2):  # warm-up: compiles, plans, graphs
        for fn in variants.values():
            mx.eval(fn())
    mx.synchronize()
    for _ in range(repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            mx.eval(fn())
            mx.synchronize()
            times[name].append((time.perf_counter() - t0) * 1e3)
    # A context length not seen before (every chunk of a prompt has its own): the first
    # evaluation, which pays for whatever MLX builds per shape (graphs, plans).
    first: dict[str, list[float]] = {name: [] for name in paged_variants}
    for i in range(1, 4):
        for name, run in paged_variants.items():
            t0 = time.perf_counter()
            mx.eval(run(context - 3 * i))
            mx.synchronize()
            first[name].append((time.perf_counter() - t0) * 1e3)
    row = dict(length=length, context=context, layers=layers, max_abs_err=err,
               new_context_ms={k: statistics.median(v) for k, v in first.items()})
    for name, values in times.items():
        row[f"{name}_ms"] = statistics.median(values)
        row[f"{name}_spread"] = [min(values), max(values)]
    row["kernel_over_reference"] = row["kernel_ms"] / row["reference_ms"]
    row["kernel_over_gathered"] = row["kernel_ms"] / row["gathered_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1B,8B")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", default=None)
    parser.add_argument("--cases", default=None, metavar="L:CTX,...",
                        help="chunk length:context pairs (default: a fixed list of ten)")
    args = parser.parse_args()
    cases = CASES if args.cases is None else [tuple(int(x) for x in pair.split(":"))
                                              for pair in args.cases.split(",")]
    print(f"device {mx.default_device()}, mlx {mx.__version__}", flush=True)
    rows = []
    for name in args.shapes.split(","):
        for length, context in cases:
            row = dict(shape=name, **case(SHAPES[name], length, context, args.repeats))
            rows.append(row)
            new = row["new_context_ms"]
            print(f"{name} L={length:5d} ctx={context:5d}: kernel {row['kernel_ms']:8.3f} ms, "
                  f"gathered {row['gathered_ms']:7.3f} ms, reference {row['reference_ms']:7.3f}"
                  f" ms, sdpa {row['sdpa_ms']:7.3f} ms, kernel/gathered "
                  f"{row['kernel_over_gathered']:5.2f}x; new context: kernel "
                  f"{new['kernel']:.1f}, gathered {new['gathered']:.1f}, reference "
                  f"{new['reference']:.1f} ms; err {row['max_abs_err']}", flush=True)
            mx.clear_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
