"""The long paste on the CPU with the default model (the interactive-first issue's bench).

    python -m bench.paste_bench [--quick] [--repeats N] [--json F] [--out F]

(prints the report; ``--out`` writes it to a file too).

Four chats stream (the app's default sampling) when a user pastes a ~3,600-token report and
asks about it; 0.2 s later a short question arrives in another pane. Reported, over
interleaved repeats with and without the paste: the streaming chats' inter-token gaps before
and during the paste (p50, p99, max), the short chat's first token and decode speed against
the same scenario without the paste, and the paste's own time to first token against alone
on the idle engine. The engine runs with the app's defaults (256-token prefill chunks, the
adaptive prefill budget, the backend's overlap setting). The same scenario runs on the H200
with an 8k-token paste (``bench/gpu_bench.py --parts paste``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.gpu_bench import CPU_PASTE_TARGETS, paste_report, paste_scenario
from bench.mixed_bench import SHORT_QUESTIONS, document
from engine import Engine, EngineConfig

RESULT = Path(__file__).parent / "results" / "paste.md"
STREAM_QUESTIONS = [
    "Tell me a long story about a lighthouse keeper and a storm.",
    "Explain how a steam engine works, step by step, in detail.",
    "Describe a walk through a busy market in a coastal town.",
    "Write a long letter to a friend about learning to play the piano.",
]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short paste (smoke run)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None,
                        help="write the report there too (it is printed either way); not "
                             f"{RESULT.relative_to(RESULT.parents[2])}, which holds every "
                             "earlier run: a new section is added to it by hand")
    parser.add_argument("--peak-over-target", type=float, default=None, metavar="X",
                        help="run with the prefill budget's PEAK_OVER_TARGET set to X (an "
                             "A/B of the constant; bench/results/paste.md, session 22)")
    parser.add_argument("--prefill-target", type=float, default=None, metavar="X",
                        help="EngineConfig.prefill_target (default: the engine's, 2.0)")
    args = parser.parse_args(argv)
    if args.peak_over_target is not None:
        from engine.sched import prefill_budget

        prefill_budget.PEAK_OVER_TARGET = args.peak_over_target  # read at each budget()
    paste_tokens, streams = (400, 2) if args.quick else (3600, 4)
    target = {} if args.prefill_target is None else {"prefill_target": args.prefill_target}
    eng = Engine(EngineConfig(model="default", kv_memory_mib=256.0, max_batch=8, **target))
    eng.start()
    if not eng.wait_ready(900):
        raise SystemExit(f"the default model did not load: {eng.load_error}")

    def count(text: str) -> int:
        return len(eng.encode(text))

    report_text = document(paste_tokens, count)

    def prompts(kind: str, run: int):
        """Fresh prompts per run (a different first line each): no prefix-cache hits."""
        if kind == "streams":
            return [eng.encode_chat([{"role": "user", "content": f"(chat {run}.{i}) {q}"}])
                    for i, q in enumerate(STREAM_QUESTIONS[:streams])]
        if kind == "short":
            question = SHORT_QUESTIONS[run % len(SHORT_QUESTIONS)]
            return eng.encode_chat([{"role": "user", "content": f"({run}) {question}"}])
        paste = f"Report {kind} {run}:\n{report_text}\n\nSummarise this report in one paragraph."
        return eng.encode_chat([{"role": "user", "content": paste}])

    t0 = time.perf_counter()
    try:
        eng.submit(prompt_tokens=prompts("short", 99), params=None).result()  # warm-up
        result = paste_scenario(eng, prompts, args.repeats, short_tokens=32)
    finally:
        eng.stop()
    result["elapsed_s"] = time.perf_counter() - t0
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    lines = ["# The long paste on the CPU (default model, the app's engine defaults)", "",
             "`source scripts/env.sh; .venv/bin/python -m bench.paste_bench` "
             f"({args.repeats} repeats with and without the paste, interleaved; "
             f"{result['elapsed_s']:.0f} s).", ""]
    lines += paste_report(result, CPU_PASTE_TARGETS)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
