"""Issue #26 on the H200: the 8-bit paged decode kernel against the 16-bit one.

    python3 scripts/gpu/kv8_attention.py [--repeats N] [--json PATH]
        [--baseline-source OLD.cu] [--step-tokens 4,8] [--define NAME=VALUE] [--split-variant]
        [--warps 8] [--shapes 8B]

All 32 (8B) or 16 (1B) layers' decode attention of one step, 64 sequences x 2048 tokens, bf16
queries: the CUDA kernel over a bf16 pool and over an int8 pool with fp16 scales (the same
random K/V, quantized by engine/kv/int8.py), interleaved repeats, medians and spread; and the
8-bit kernel's error against the 8-bit reference path. Target: 8-bit <= 0.65x the 16-bit
kernel's time at the 8B shape.

``--baseline-source`` takes another version of shaders/paged_attention.cu (the device has no
git history: write it first, e.g. ``git show 62338cd:shaders/paged_attention.cu > old.cu``);
its kernels run through the same launch plans (``plan_attention(sources=...)``, renamed so MLX
compiles them apart) on the same data, interleaved with the current ones, and the run reports
new8/new16, new16/old16 and new8/old8. ``--step-tokens`` adds variants of the current source
with ``#define PC_NT N`` (tokens per lane per step; the kernel's default is 4 at this shape) to
pick the step size on the device; ``--define NAME=VALUE`` any other compile-time switch
(``PC_TC_PREFETCH=0``: the tensor-core decode without its next-tile prefetch, ``=2``: two
tiles ahead; ``PC_TC_LO_ROWS=1``: the weights' low parts in the MMA's spare rows);
``--split-variant`` the current source launched split-K (``split=True``: 512-token
partitions and a reduce; at 64 x 8 (sequence, KV head) groups the engine does not split);
``--warps N,...`` the current source launched with N warps a thread block (the engine's
choice is at most 4: ``engine/attention/cuda.py``'s ``MAX_WARPS``). Each
variant's time is the GPU time of evaluating all layers'
already-built graphs (graph construction is outside the timed region), with its effective
bandwidth: K/V bytes read (scales included for 8-bit) / time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu_bench import BLOCK_SIZE, SHAPES  # noqa: E402
from engine.attention import cuda as cuda_kernels  # noqa: E402
from engine.attention.dispatch import reference_decode  # noqa: E402
from engine.attention.plans import KernelSource  # noqa: E402
from engine.kv import int8  # noqa: E402

KERNEL_MARKER = "// ==== kernel: paged_attention ===="


def load_sources(text: str, suffix: str, defines: str = "") -> dict[str, KernelSource]:
    """The kernels of a version of paged_attention.cu, each renamed ``NAME + suffix`` (MLX
    builds one kernel object per name) and with ``defines`` at the top of the attention body."""
    if defines:
        if KERNEL_MARKER not in text:
            raise ValueError(f"no {KERNEL_MARKER!r} line to put {defines!r} under")
        text = text.replace(KERNEL_MARKER, KERNEL_MARKER + "\n" + defines.rstrip("\n"), 1)
    src = cuda_kernels.KERNELS.parse(text)
    return {key: replace(k, name=k.name + suffix) if suffix else k for key, k in src.items()}


def variants(args) -> dict[str, dict[str, KernelSource]]:
    """Name -> kernel sources: "new" (the checkout's file), "old" (--baseline-source),
    "ntN" (--step-tokens), "nameVALUE" (--define NAME=VALUE), "split" (--split-variant:
    the checkout's file, launched split-K) and "warpsN" (--warps: launched with N warps)."""
    current = cuda_kernels.CUDA_SHADER_PATH.read_text()
    out = {"new": load_sources(current, "")}
    if args.baseline_source:
        out["old"] = load_sources(Path(args.baseline_source).read_text(), "_baseline")
    for n in args.step_tokens:
        out[f"nt{n}"] = load_sources(current, f"_nt{n}", f"#define PC_NT {n}\n")
    for define in args.define:
        name, _, value = define.partition("=")
        key = f"{name.lower()}{value}"
        out[key] = load_sources(current, f"_{key}", f"#define {name} {value}\n")
    if args.split_variant:
        out["split"] = load_sources(current, "_split")
    for n in args.warps:
        out[f"warps{n}"] = load_sources(current, f"_warps{n}")
    return out


def launch_options(name: str) -> dict:
    """plan_attention's launch arguments for variant ``name`` (the engine's choice: none)."""
    if name == "split":
        return dict(split=True)
    if name.startswith("warps"):
        return dict(warps=int(name[len("warps"):]))
    return {}


def timed(outputs_of) -> float:
    """ms to evaluate the graph ``outputs_of()`` builds (built before the clock starts)."""
    outs = outputs_of()
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - t0) * 1e3


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def case(shape: dict, batch: int, context: int, repeats: int,
         sources: dict[str, dict[str, KernelSource]]) -> dict:
    layers = shape["num_hidden_layers"]
    h, kvh, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    nb = -(-context // BLOCK_SIZE)
    rng = np.random.default_rng(1)
    tables = mx.array(rng.permutation(batch * nb).reshape(batch, nb).astype(np.int32))
    lens = mx.array(np.full(batch, context, np.int32))
    scale = d**-0.5
    full, q8 = [], []
    for _ in range(layers):
        k = mx.random.normal((batch * nb, BLOCK_SIZE, kvh, d)).astype(mx.bfloat16)
        v = mx.random.normal((batch * nb, BLOCK_SIZE, kvh, d)).astype(mx.bfloat16)
        q = mx.random.normal((batch, h, 1, d)).astype(mx.bfloat16)
        kq, ks = int8.quantize(k)
        vq, vs = int8.quantize(v)
        mx.eval(k, v, q, kq, ks, vq, vs)
        full.append((q, k, v))
        q8.append((q, kq, vq, ks, vs))
    bytes16 = layers * batch * context * kvh * d * 2 * 2  # K and V, bf16
    bytes8 = layers * batch * context * kvh * (d + 2) * 2  # int8 rows + fp16 scales

    # Plans built once per (variant, layer): the timed region runs kernels only.
    runs = {}
    for name, src in sources.items():
        launch = launch_options(name)
        p16 = [cuda_kernels.plan_attention(q, k, v, tables, lens, scale, sources=src,
                                           **launch)
               for q, k, v in full]
        p8 = [cuda_kernels.plan_attention(q, k, v, tables, lens, scale, sources=src,
                                          k_scales=ks, v_scales=vs, **launch)
              for q, k, v, ks, vs in q8]
        runs[f"{name}16"] = lambda plans=p16: [cuda_kernels.KERNELS.run(p)[-1][0] for p in plans]
        runs[f"{name}8"] = lambda plans=p8: [cuda_kernels.KERNELS.run(p)[-1][0] for p in plans]

    # Correctness on the device before timing: every variant vs the reference paths.
    q, k, v = full[0]
    _, kq, vq, ks, vs = q8[0]
    ref16 = reference_decode(q, k, v, tables, lens, scale).astype(mx.float32)
    ref8 = reference_decode(q, kq, vq, tables, lens, scale, k_scales=ks,
                            v_scales=vs).astype(mx.float32)
    err = {}
    for key, fn in runs.items():
        plans_out = fn()[0].astype(mx.float32)
        ref = ref8 if key.endswith("8") and not key.endswith("16") else ref16
        err[key] = float(mx.max(mx.abs(plans_out - ref)))

    for _ in range(3):  # warm-up: compiles every kernel
        for fn in runs.values():
            timed(fn)
    times = {key: [] for key in runs}
    for _ in range(repeats):  # interleaved
        for key, fn in runs.items():
            times[key].append(timed(fn))
    row = dict(batch=batch, context=context, layers=layers, max_abs_err_vs_reference=err,
               ms={key: statistics.median(t) for key, t in times.items()},
               ms_lo={key: min(t) for key, t in times.items()},
               ms_hi={key: max(t) for key, t in times.items()})
    row["tb_per_s"] = {key: (bytes8 if key.endswith("8") and not key.endswith("16")
                             else bytes16) / (ms * 1e-3) / 1e12
                       for key, ms in row["ms"].items()}

    def ratio(a: str, b: str) -> dict | None:
        if a not in times or b not in times:
            return None
        rs = [x / y for x, y in zip(times[a], times[b], strict=True)]  # same repeat
        return dict(median=statistics.median(rs), lo=min(rs), hi=max(rs))

    row["ratios"] = {f"{a}/{b}": r for a, b in (
        ("new8", "new16"), ("new16", "old16"), ("new8", "old8"), ("old8", "old16"),
        ("split8", "split16"), ("split16", "new16"), ("split8", "new16"),
        *[(f"nt{n}8", f"nt{n}16") for n in (1, 2, 4, 8)],
        *[(f"nt{n}16", "new16") for n in (1, 2, 4, 8)],
        *[(f"nt{n}8", "new8") for n in (1, 2, 4, 8)],
        *[(f"{k[:-1]}8", "new8") for k in runs if k.endswith("8") and k[:-1] not in
          ("new", "old") and not k.startswith("nt")],
    ) if (r := ratio(a, b)) is not None}
    for key in runs:
        print(f"  {key:>7}: {spread(times[key])} ms, {row['tb_per_s'][key]:.2f} TB/s, "
              f"max abs err vs reference {err[key]:.2e}", flush=True)
    for name, r in row["ratios"].items():
        print(f"  {name}: {r['median']:.3f} ({r['lo']:.3f}-{r['hi']:.3f})", flush=True)
    return row


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json")
    parser.add_argument("--baseline-source", metavar="PATH",
                        help="an older shaders/paged_attention.cu to time against")
    parser.add_argument("--step-tokens", default="",
                        type=lambda s: [int(x) for x in s.split(",") if x],
                        help="comma-separated PC_NT values to time as extra variants")
    parser.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                        help="time the current source with '#define NAME VALUE' in front of "
                             "the attention body as one more variant (repeatable)")
    parser.add_argument("--warps", default="",
                        type=lambda s: [int(x) for x in s.split(",") if x],
                        help="comma-separated warps per thread block to time as extra variants")
    parser.add_argument("--split-variant", action="store_true",
                        help="time the current source launched split-K as one more variant")
    parser.add_argument("--shapes", default="1B,8B",
                        type=lambda s: [x for x in s.split(",") if x])
    parser.add_argument("--check-only", action="store_true",
                        help="parse the arguments and load the sources, then stop (no GPU)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    sources = variants(args)
    print("variants: " + ", ".join(
        f"{name} ({', '.join(sorted(k.name for k in src.values()))})"
        for name, src in sources.items()), flush=True)
    if args.check_only:
        return
    if not cuda_kernels.available():
        raise SystemExit("needs MLX's CUDA backend (an NVIDIA GPU)")
    rows = {}
    for name in args.shapes:
        print(f"{name}:", flush=True)
        rows[name] = case(SHAPES[name], 64, 2048, args.repeats, sources)
    if "8B" in rows:
        r = rows["8B"]["ratios"]["new8/new16"]["median"]
        verdict = "met" if r <= 0.65 else "NOT met"
        print(f"kv8-attention: 8B 8-bit/16-bit {r:.3f} (target <= 0.65: {verdict})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
