"""What one layer's call of the compiled CPU attention kernel costs, by the rows it carries
(issues #24 and #26), optionally against the kernel of an earlier revision.

A paste beside streaming chats gets small chunks (8-30 tokens a step); alone it gets 256.
Both re-read the whole context, so a small chunk's attention per token costs more wherever
the kernel's per-block work (widening a block's K into a transposed tile, and V into a tile
unless it is read in place) is shared by fewer query rows; decode rows share it with no
one. One layer of the default model's shapes (9 query heads over 3 KV heads, head dim 64,
blocks of 16): eight decode rows at 3,400 and at 300 tokens of context, and four decode rows
at contexts 150-300 beside a chunk ending at ~3,400 tokens; each timed on one and on two
threads (medians of 9 calls of ``engine.attention.cpu_kernel.attend``; the chunk's GFLOP/s
counts its scores and P.V).

``--against REV`` builds ``shaders/paged_attention_cpu.cpp`` as it was at git revision REV
beside the working one and times both on the same inputs, interleaved call by call, and
checks that their outputs are identical (the kernel's rows do their arithmetic in one order
whatever path reads them). ``--dtype`` picks the pool: float32 (the embedded model's),
bfloat16 or int8 (the 8-bit pool).

    source scripts/env.sh
    .venv/bin/python -m bench.cpu_kernel_chunk_cost [--against HEAD~1] [--dtype int8]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.attention import cpu_kernel
from engine.kv import int8
from engine.runner.step_batch import build_step_batch
from engine.sched.work import SequenceWork

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CONTEXT = 3400
CHATS = (300, 220, 150, 180)
#: (label, decode rows' contexts, chunk length ending at CONTEXT + it, or 0)
CASES = (
    ("8 decodes at 3,400", (CONTEXT,) * 8, 0),
    ("8 decodes at 300", (300,) * 8, 0),
    *((f"4 decodes + {n} tokens at 3,400", CHATS, n) for n in (8, 12, 32, 64, 256)),
)
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "int8": mx.int8}
CALLS = 10  # the first of each is a warm-up


def _library_at(revision: str, into: Path):
    """The kernel library built from the source as it was at ``revision``."""
    relative = cpu_kernel.SOURCE_PATH.relative_to(cpu_kernel.SOURCE_PATH.parents[1])
    source = subprocess.run(["git", "show", f"{revision}:{relative.as_posix()}"], check=True,
                            capture_output=True, text=True,
                            cwd=cpu_kernel.SOURCE_PATH.parents[1]).stdout
    path = into / "paged_attention_cpu.cpp"
    path.write_text(source)
    return cpu_kernel.build(path)


def _pools(dtype: mx.Dtype, blocks: int, rng: np.random.Generator):
    shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
    raw = [mx.array(rng.standard_normal(shape, dtype=np.float32)) for _ in range(2)]
    if dtype == mx.int8:
        (k, k_scales), (v, v_scales) = (int8.quantize(x) for x in raw)
    else:
        k, v = (x.astype(dtype) for x in raw)
        k_scales = v_scales = None
    mx.eval(k, v)
    return k, v, k_scales, v_scales


def _step(decodes: tuple[int, ...], chunk: int):
    works, at = [], 0
    for n in decodes:
        table = list(range(at, at + -(-n // BLOCK)))
        at += len(table)
        works.append(SequenceWork([1], n - 1, table, [(table[(n - 1) // BLOCK], (n - 1) % BLOCK)]))
    if chunk:
        table = list(range(at, at + -(-(CONTEXT + chunk) // BLOCK)))
        works.append(SequenceWork([1] * chunk, CONTEXT, table,
                                  [(table[p // BLOCK], p % BLOCK)
                                   for p in range(CONTEXT, CONTEXT + chunk)],
                                  want_logits=False))
    return build_step_batch(works)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", metavar="REV", help="also time the kernel of git revision REV")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args(argv)
    if not cpu_kernel.ready():
        raise SystemExit("the CPU kernel does not build here (see the log)")
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {"working": None}
        if args.against:
            libraries[args.against] = _library_at(args.against, Path(tmp))
        rng = np.random.default_rng(0)
        blocks = 8 * -(-CONTEXT // BLOCK) + -(-(CONTEXT + 256) // BLOCK) + 1
        k, v, k_scales, v_scales = _pools(DTYPES[args.dtype], blocks, rng)
        names = list(libraries)
        print(f"{args.dtype} pool; ms per call on 1 / 2 threads"
              + (f"; ratio = working / {args.against} on 2 threads" if args.against else ""))
        header = "| step (one layer) | " + " | ".join(f"{n}, ms" for n in names)
        header += " | ratio |" if args.against else " | chunk GFLOP/s on 2 threads |"
        print(header + "\n|" + " --- |" + " ---: |" * (len(names) + 1))
        for label, decodes, chunk in CASES:
            batch = _step(decodes, chunk)
            queries = mx.array(rng.standard_normal((batch.tokens.shape[0], HEADS, 1, HEAD_DIM),
                                                   dtype=np.float32))
            layout = cpu_kernel.HostLayout.of(batch)
            medians, outputs = {}, {}
            for threads in (1, 2):
                fixed = cpu_kernel.HostLayout(layout.tables, layout.q_row, layout.q_len,
                                              layout.context, layout.cost, threads=threads)
                runs = {name: [] for name in names}
                for _ in range(CALLS):
                    for name, library in libraries.items():  # interleaved call by call
                        start = time.perf_counter()
                        out = cpu_kernel.attend(queries, k, v, k_scales, v_scales, fixed, 0.125,
                                                library)
                        mx.eval(out)
                        runs[name].append(time.perf_counter() - start)
                        outputs[name, threads] = out
                for name in names:
                    medians[name, threads] = statistics.median(runs[name][1:])
            if args.against:
                for threads in (1, 2):
                    if not np.array_equal(np.array(outputs["working", threads]),
                                          np.array(outputs[args.against, threads])):
                        raise SystemExit(f"{label}: the kernels' outputs differ")
            cells = [f"{1e3 * medians[n, 1]:.2f} / {1e3 * medians[n, 2]:.2f}" for n in names]
            if args.against:
                last = f"{medians['working', 2] / medians[args.against, 2]:.2f}x"
            else:
                flops = chunk * (CONTEXT + chunk / 2) * HEADS * HEAD_DIM * 4
                last = f"{flops / medians['working', 2] / 1e9:.1f}" if chunk else "-"
            print(f"| {label} | " + " | ".join(cells) + f" | {last} |", flush=True)


if __name__ == "__main__":
    main()
