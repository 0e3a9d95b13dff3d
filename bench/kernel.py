"""Metal paged decode kernel against contiguous ``mx.fast.scaled_dot_product_attention``.

For each (batch, context) the same K/V live once in a contiguous [B, KVH, T, D] cache and once
scattered over a block pool through scrambled block tables. Measured side by side in one run:

* contiguous: ``mx.fast.scaled_dot_product_attention`` on the contiguous cache (the bar);
* paged kernel: ``engine.attention.metal.paged_decode_kernel`` reading the pool directly;
* gather: ``engine.attention.dispatch.reference_decode`` (gathers the blocks, then SDPA).

Prints time ratios against contiguous (target: paged <= 1.1x) and the K/V bandwidth the paged
kernel reaches as a fraction of the chip's peak (``--peak-gbps``, default from a table of Apple
chips by ``mx.metal.device_info()`` name). Needs a Mac: elsewhere it says so and exits 0.

    python bench/kernel.py [--batch 1,4,8] [--context 1024,4096] [--heads 32] [--kv-heads 8]
                           [--head-dim 128] [--block-size 16] [--dtype float16] [--peak-gbps N]
                           [--simdgroups auto,1,2,4,8] [--split auto,on,off]

``--simdgroups`` / ``--split`` sweep the launch geometry (one row each) so that the constants
in ``engine/attention/metal.py`` (MAX_SIMDGROUPS, SPLIT_BELOW_THREADGROUPS) can be tuned on a
real chip.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx

from engine.attention import metal as kernels
from engine.attention.dispatch import kernel_available, reference_decode

# Unified-memory bandwidth (GB/s) of Apple chips, longest names first when matching. Binned Max
# parts are slower (M3 Max 300, M4 Max 410): pass --peak-gbps for those.
PEAK_GBPS = {
    "M1 Ultra": 800.0,
    "M1 Max": 400.0,
    "M1 Pro": 200.0,
    "M1": 68.25,
    "M2 Ultra": 800.0,
    "M2 Max": 400.0,
    "M2 Pro": 200.0,
    "M2": 100.0,
    "M3 Ultra": 819.0,
    "M3 Max": 400.0,
    "M3 Pro": 150.0,
    "M3": 100.0,
    "M4 Max": 546.0,
    "M4 Pro": 273.0,
    "M4": 120.0,
}

TARGET_RATIO = 1.1


def device_name() -> str:
    info_fn = getattr(mx, "device_info", None) or mx.metal.device_info
    info = info_fn()
    return str(info.get("device_name", info.get("architecture", "unknown")))


def peak_for(name: str) -> float | None:
    for chip in sorted(PEAK_GBPS, key=len, reverse=True):
        if chip in name:
            return PEAK_GBPS[chip]
    return None


def timed(fn, iters: int, repeats: int = 7) -> float:
    """Seconds per call: ``iters`` calls evaluated together (one command buffer, so launch
    overhead is amortised as in a model's forward pass); median over ``repeats``."""
    mx.eval(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([fn() for _ in range(iters)])
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def make_case(batch, context, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    key = mx.random.key(seed)
    kq, kk, kv, kp = mx.random.split(key, 4)
    q = mx.random.normal((batch, heads, 1, head_dim), key=kq).astype(dtype)
    k = mx.random.normal((batch, kv_heads, context, head_dim), key=kk).astype(dtype)
    v = mx.random.normal((batch, kv_heads, context, head_dim), key=kv).astype(dtype)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 8
    perm = mx.random.permutation(num_blocks, key=kp).astype(mx.int32)
    tables = perm[: batch * blocks_per_seq].reshape(batch, blocks_per_seq)
    # Scatter the contiguous cache into the pool: [B, KVH, T, D] -> blocks [n, BS, KVH, D].
    pad = blocks_per_seq * block_size - context

    def to_blocks(x):
        x = mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)])
        x = x.reshape(batch, kv_heads, blocks_per_seq, block_size, head_dim)
        return x.transpose(0, 2, 3, 1, 4).reshape(-1, block_size, kv_heads, head_dim)

    k_pool = mx.zeros((num_blocks, block_size, kv_heads, head_dim), dtype=dtype)
    v_pool = mx.zeros_like(k_pool)
    flat = tables.reshape(-1)
    k_pool[flat] = to_blocks(k)
    v_pool[flat] = to_blocks(v)
    lens = mx.full((batch,), context, dtype=mx.int32)
    mx.eval(q, k, v, k_pool, v_pool, tables, lens)
    return q, k, v, k_pool, v_pool, tables, lens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,4,8")
    ap.add_argument("--context", default="1024,4096")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--peak-gbps", type=float, default=None)
    ap.add_argument("--simdgroups", default="auto", help="comma list of auto/1/2/4/8")
    ap.add_argument("--split", default="auto", help="comma list of auto/on/off")
    args = ap.parse_args(argv)
    nsg_options = [None if x == "auto" else int(x) for x in args.simdgroups.split(",")]
    split_options = [{"auto": None, "on": True, "off": False}[x] for x in args.split.split(",")]

    if not kernel_available():
        print(
            "bench/kernel.py: needs a Mac with the Metal backend "
            "(mx.metal.is_available() is False here); nothing measured."
        )
        return 0

    mx.set_default_device(mx.gpu)
    dtype = getattr(mx, args.dtype)
    name = device_name()
    peak = args.peak_gbps or peak_for(name)
    print(
        f"device: {name}; peak {peak or '?'} GB/s"
        f"{'' if args.peak_gbps or peak is None else ' (table; --peak-gbps overrides)'}"
    )
    print(
        f"heads {args.heads}/{args.kv_heads} kv, head_dim {args.head_dim}, block "
        f"{args.block_size}, {args.dtype}; ratios are time / contiguous SDPA time"
    )
    header = (
        f"{'batch':>5} {'ctx':>6} {'geometry':>12} {'contig us':>10} {'paged us':>9} "
        f"{'gather us':>10} {'paged x':>8} {'gather x':>9} {'GB/s':>7} {'% peak':>7}"
    )
    print(header)
    worst = 0.0
    scale = args.head_dim**-0.5
    itemsize = {"float16": 2, "bfloat16": 2, "float32": 4}[args.dtype]
    for batch in (int(x) for x in args.batch.split(",")):
        for context in (int(x) for x in args.context.split(",")):
            q, k, v, k_pool, v_pool, tables, lens = make_case(
                batch, context, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype
            )
            t_contig = timed(
                lambda q=q, k=k, v=v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),
                args.iters,
            )
            t_gather = timed(
                lambda q=q, kp=k_pool, vp=v_pool, t=tables, n=lens: reference_decode(
                    q, kp, vp, t, n, scale
                ),
                args.iters,
            )
            contig = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
            for split in split_options:
                for nsg in nsg_options:
                    plan = kernels.plan_decode(
                        q, k_pool, v_pool, tables, lens, scale, split=split, simdgroups=nsg
                    )
                    paged = kernels.KERNELS.run(plan)[-1][0]
                    err = mx.max(
                        mx.abs(paged.astype(mx.float32) - contig.astype(mx.float32))
                    ).item()
                    if err > 5e-2:
                        print(f"  WARNING: paged and contiguous disagree (max error {err:.3g})")
                    if split is None and nsg is None:  # the public entry point, as used
                        fn = lambda q=q, kp=k_pool, vp=v_pool, t=tables, n=lens: (  # noqa: E731
                            kernels.paged_decode_kernel(q, kp, vp, t, n, scale)
                        )
                    else:
                        fn = lambda plan=plan: kernels.KERNELS.run(plan)[-1][0]  # noqa: E731
                    t_paged = timed(fn, args.iters)
                    template = dict(plan[0].template)
                    geometry = f"sg{template['NSG']} p{plan[0].output_shapes[0][2]}"
                    kv_bytes = 2 * batch * args.kv_heads * context * args.head_dim * itemsize
                    gbps = kv_bytes / t_paged / 1e9
                    ratio = t_paged / t_contig
                    if split is None and nsg is None:
                        worst = max(worst, ratio)
                    print(
                        f"{batch:>5} {context:>6} {geometry:>12} "
                        f"{t_contig * 1e6:>10.1f} {t_paged * 1e6:>9.1f} {t_gather * 1e6:>10.1f} "
                        f"{ratio:>8.2f} {t_gather / t_contig:>9.2f} {gbps:>7.1f} "
                        f"{(100 * gbps / peak if peak else float('nan')):>7.1f}"
                    )
    if worst:
        verdict = "meets" if worst <= TARGET_RATIO else "MISSES"
        print(
            f"worst paged/contiguous ratio (default geometry) {worst:.2f}: "
            f"{verdict} the {TARGET_RATIO}x target"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
