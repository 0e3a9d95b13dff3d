"""Where the GPU paste's slow steps come from (issue #24): the GPU bench's paste scenario
(bench/gpu_bench.py ``paste``, 1B shape, one repeat) under process settings, with every
garbage collection's pause recorded and matched against the engine's slow steps.

    source scripts/gpu/setup.sh .whl/b; python3 scripts/gpu/paste_spikes.py base switch gc

Variants: ``base`` (the interpreter's GIL switch interval, 5 ms: how the bench ran until
session 14), ``app`` (the app's, 1 ms: ``app.main.share_the_gil``), ``switch`` (0.5 ms),
``gc`` (5 ms, and ``gc.freeze()`` after the warm-up: the model's and tokenizer's objects
leave the collector's generations). A slow step is one over 1.5x the decode step the budget
held; the collector's pauses are reported by count and duration beside the slow steps'
excess (not matched step by step).
"""

from __future__ import annotations

import gc
import json
import sys
import time

import bench.gpu_bench as gb

QUICK = "--quick" in sys.argv

PAUSES: list[tuple[float, float, int]] = []  # (start, seconds, generation)
_started: dict[int, float] = {}


def on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _started[info["generation"]] = time.perf_counter()
    else:
        t0 = _started.pop(info["generation"], None)
        if t0 is not None:
            PAUSES.append((t0, time.perf_counter() - t0, info["generation"]))


def main(variants: list[str]) -> None:
    gc.callbacks.append(on_gc)
    real_scenario = gb.paste_scenario
    out = {}
    for variant in variants:
        sys.setswitchinterval({"switch": 5e-4, "app": 1e-3}.get(variant, 5e-3))

        def scenario(eng, prompts, repeats, short_tokens, variant=variant):
            if variant == "gc":
                gc.collect()
                gc.freeze()
            PAUSES.clear()
            t_zero = time.perf_counter()
            result = real_scenario(eng, prompts, repeats, short_tokens)
            result["t_zero"] = t_zero
            result["pauses"] = list(PAUSES)
            gc.unfreeze()
            return result

        gb.paste_scenario = scenario
        if QUICK:  # a smoke run on the CPU: the bench's --quick sizes
            small = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64)
            p = gb.paste(small, 2, 32, 600, 16, 8, 1000, 64.0, 1)
        else:
            p = gb.paste(gb.SHAPES["1B"], 4, 128, 8000, 64, 64, gb.VOCAB, 8192.0, 1)
        runs = p["runs"]
        w, wo = runs["with"][0], runs["without"][0]
        steps = [e for e in runs["trace"] if e[0] == "step" and e[1] >= 0]
        slow = [e for e in steps if e[8] and e[2] > 1.5 * e[8]]
        # the trace keeps times relative to the paste's arrival, the pauses absolute ones:
        # compared by duration (pauses over 1 ms, their total, the slow steps' excess)
        big = [pz for pz in p["pauses"] if pz[1] > 1e-3]
        out[variant] = dict(
            gap_ratio=w["during_p99"] / w["before_p50"], before_p50=w["before_p50"],
            during_p99=w["during_p99"], during_max=w["during_max"],
            paste_ratio=w["paste_s"] / runs["paste_alone_s"][0],
            ttft_ratio=w["short_ttft_ms"] / wo["short_ttft_ms"],
            decode_ratio=w["short_decode_tps"] / wo["short_decode_tps"],
            steps=len(steps), slow_steps=len(slow),
            slow_excess_ms=sum(1e3 * (e[2] - e[8]) for e in slow),
            gc_pauses=len(p["pauses"]), gc_over_1ms=len(big),
            gc_over_1ms_total_ms=1e3 * sum(pz[1] for pz in big),
            gc_max_ms=1e3 * max((pz[1] for pz in p["pauses"]), default=0.0),
            gc_by_gen={g: sum(1 for pz in p["pauses"] if pz[2] == g) for g in (0, 1, 2)},
            slow=[(round(e[1], 3), round(1e3 * e[2], 1), e[3], e[4], round(e[5]))
                  for e in slow])
        print(variant, json.dumps(out[variant]), flush=True)
    gb.paste_scenario = real_scenario
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if a != "--quick"] or ["base", "app"])
