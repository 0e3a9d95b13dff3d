"""What constrained decoding costs per step, by grammar library, and in the engine.

Part 1, the libraries (the choice in engine/runner/constraints.py): for one JSON schema (a
nested object with enums, an array and bounded strings) and the default model's tokenizer,
the time to compile it once, and then, over 40 steps of 64 rows, the time per step to fill
the 64 rows' next-token masks and advance each row by a random allowed token. llguidance
always; outlines-core when it is installed (it is not a dependency: ``pip install
outlines-core`` to compare); xgrammar needs PyTorch and Triton and is not measured.

Part 2, the engine: 64 chats decoding 48 tokens each on the CPU, every row constrained (a
regex that never ends early, so both sides generate the same number of tokens) against the
same chats free, interleaved A B A B: generated tokens per second of wall time per side
(prompts included, the same on both sides) and the constraints' share.

    source scripts/env.sh; .venv/bin/python -m bench.grammar_cost [--repeats 2] [--rows 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from engine import Constraint, Engine, EngineConfig, SamplingParams
from engine.models.resolve import load_model
from engine.runner.constraints import grammars_for

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "colour": {"enum": ["black", "white", "ginger", "grey"]},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "colour", "toys"],
    "additionalProperties": False,
}


def llguidance_cost(tokenizer, rows: int, steps: int) -> dict:
    grammars = grammars_for(tokenizer)
    t0 = time.perf_counter()
    grammar = grammars.check(Constraint("json_schema", SCHEMA))
    matchers = [grammars.matcher(grammar) for _ in range(rows)]
    compile_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps):  # timed: the masks and the advances, not the bench's own draw
        t = time.perf_counter()
        masks = grammars.bitmasks(matchers)
        spent = time.perf_counter() - t
        bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")
        picks = [int(rng.choice(np.flatnonzero(bits[row, :grammars.vocab_size])))
                 for row in range(rows)]
        t = time.perf_counter()
        for m, token in zip(matchers, picks):
            if m.is_stopped():
                m.reset()
            else:
                m.consume_token(token)
        times.append(spent + time.perf_counter() - t)
    return {"compile_ms": 1e3 * compile_s, "step_ms": 1e3 * statistics.median(times)}


def outlines_cost(tokenizer, rows: int, steps: int) -> dict | None:
    try:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        return None
    import json

    hf = tokenizer._tokenizer
    eos = tokenizer.eos_token_id
    vocab: dict[str, list[int]] = {}
    for token, tid in hf.get_vocab().items():
        if tid == eos:
            continue
        vocab.setdefault(hf.convert_tokens_to_string([token]), []).append(tid)
    t0 = time.perf_counter()
    index = outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA)),
                                outlines_core.Vocabulary(eos, vocab))
    guides = [outlines_core.Guide(index) for _ in range(rows)]
    compile_s = time.perf_counter() - t0
    size = max(hf.vocab_size, len(hf))
    mask = np.zeros((rows, (size + 31) // 32), dtype=np.int32)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps):  # timed: the masks and the advances, not the bench's own draw
        t = time.perf_counter()
        for row, g in enumerate(guides):
            if g.is_finished():
                g.reset()
            g.write_mask_into(mask[row].ctypes.data, mask.shape[1], 4)
        spent = time.perf_counter() - t
        bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")
        picks = [int(rng.choice(np.flatnonzero(bits[row, :size]))) for row in range(rows)]
        t = time.perf_counter()
        for g, token in zip(guides, picks):
            g.advance(token, return_tokens=False)
        times.append(spent + time.perf_counter() - t)
    return {"compile_ms": 1e3 * compile_s, "step_ms": 1e3 * statistics.median(times)}


def engine_cost(rows: int, tokens: int, repeats: int) -> dict:
    eng = Engine(EngineConfig(kv_memory_mib=512.0, max_batch=rows))
    eng.start()
    assert eng.wait_ready(900), eng.load_error
    never_ends = Constraint("regex", f"[a-z ,.]{{{tokens + 8},}}")
    sides: dict[str, list[float]] = {"free": [], "constrained": []}
    try:
        for r in range(repeats + 1):  # the first round warms up
            for side in sides:
                params = SamplingParams(temperature=0.0, max_tokens=tokens,
                                        constraint=never_ends if side != "free" else None)
                t0 = time.perf_counter()
                handles = [eng.submit(messages=[{"role": "user", "content":
                                                  f"({r}.{i}) Write about the sea."}],
                                      params=params) for i in range(rows)]
                finals = [h.result()[0] for h in handles]
                # every reply is max_tokens long on both sides (the regex never ends early)
                rate = sum(f.usage.generated_tokens for f in finals) / (time.perf_counter() - t0)
                if r:
                    sides[side].append(rate)
    finally:
        eng.stop()
    free, cons = statistics.median(sides["free"]), statistics.median(sides["constrained"])
    return {"free_tok_s": sides["free"], "constrained_tok_s": sides["constrained"],
            "ratio": cons / free, "share_of_step": 1.0 - cons / free}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args(argv)
    tokenizer = load_model("default").tokenizer
    print(f"part 1: one JSON schema, {args.rows} rows, 40 steps (mask + advance per step)")
    for name, fn in (("llguidance", llguidance_cost), ("outlines-core", outlines_cost)):
        result = fn(tokenizer, args.rows, 40)
        if result is None:
            print(f"  {name}: not installed")
            continue
        print(f"  {name}: compile {result['compile_ms']:.1f} ms, "
              f"{result['step_ms']:.2f} ms per step")
    if args.skip_engine:
        return
    print(f"part 2: {args.rows} chats x 48 tokens, greedy, free vs every row constrained")
    result = engine_cost(args.rows, 48, args.repeats)
    free = ", ".join(f"{v:.0f}" for v in result["free_tok_s"])
    constrained = ", ".join(f"{v:.0f}" for v in result["constrained_tok_s"])
    print(f"  free [{free}] tok/s, constrained [{constrained}] tok/s: "
          f"{result['ratio']:.2f}x, the constraints' share of a step "
          f"{100 * result['share_of_step']:.1f}%")


if __name__ == "__main__":
    main()
