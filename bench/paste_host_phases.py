"""The engine's own phase times per step while a long paste is read beside four streams, by
the paste's context: a tiny random-weight model on the CPU, so what grows is host work.

    source scripts/env.sh; .venv/bin/python -m bench.paste_host_phases [--tokenizer naive]

``--tokenizer naive`` gives the streams the word-piece tokenizer gpu_bench used before session
24, for which mlx-lm picks ``NaiveStreamingDetokenizer`` (the whole reply decoded again at
every token): the bookkeeping phase then grows with the streams' length (0.5 to 4.5 ms a step
over one paste on the CI machine), against a flat 0.3 ms with the byte-level tokenizer and
``BPEStreamingDetokenizer`` (bench/results/gpu.md, session 24). On the CPU the build phase
also grows with the context: there it holds the CPU attention kernel's own work. The steps
the prefill budget held (decodes only, mid-paste) get their own row; the rows by context are
the steps that carried a chunk.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import mlx.core as mx

from bench import gpu_bench
from engine import Priority

SHAPE = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64)
VOCAB = 1000
PHASES = ("schedule", "build", "forward", "sample", "bookkeeping")


def naive_tokenizer(vocab: int):
    """gpu_bench's tokenizer before session 24: word-piece, so mlx-lm's naive detokenizer."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", choices=("bytelevel", "naive"), default="bytelevel")
    parser.add_argument("--paste", type=int, default=8000, help="paste tokens")
    args = parser.parse_args(argv)
    tokenizer = (gpu_bench.make_tokenizer(VOCAB) if args.tokenizer == "bytelevel"
                 else naive_tokenizer(VOCAB))
    loaded = gpu_bench.loaded_model(gpu_bench.make_model(SHAPE, mx.float32, VOCAB), tokenizer,
                                    "tiny", mx.float32)
    eng = gpu_bench.start_engine(loaded, max_batch=8, kv_mib=256.0, prefill_chunk=256)
    stepper = eng.runtime.stepper
    # (step s, *phase s, held: the budget kept the prompts under way out of the step,
    #  paste context, prompts under way)
    rows: list[tuple] = []
    real_step = stepper.step

    def step() -> None:
        t0 = time.perf_counter()
        real_step()
        t = stepper._times
        running = stepper.scheduler.running.values()
        rows.append((time.perf_counter() - t0, *(getattr(t, p) for p in PHASES),
                     stepper.prefill.holding, max((s.num_in_table for s in running), default=0),
                     sum(1 for s in running if s.num_to_feed >= 2)))

    stepper.step = step
    rnd = random.Random(0)
    try:
        streams = [eng.submit(prompt_tokens=[rnd.randrange(3, VOCAB) for _ in range(128)],
                              params=gpu_bench.engine_params("app-sampling", 100000),
                              session_id=f"stream-{i}", priority=Priority.BACKGROUND)
                   for i in range(4)]
        while len(rows) < 100:  # the streams decode alone first
            time.sleep(0.05)
        before = len(rows)
        paste = eng.submit(prompt_tokens=[rnd.randrange(3, VOCAB) for _ in range(args.paste)],
                           params=gpu_bench.engine_params("app-sampling", 4),
                           session_id="paste", priority=Priority.INTERACTIVE)
        paste.result(600)
        for handle in streams:
            handle.cancel()
    finally:
        stepper.step = real_step
        eng.stop()

    def show(name: str, picked: list[tuple]) -> None:
        if picked:
            cells = " ".join(f"{p}={statistics.median(r[i + 1] for r in picked) * 1e3:.2f}"
                             for i, p in enumerate(PHASES))
            print(f"{name:>14}: {len(picked):4d} steps, median ms: "
                  f"step={statistics.median(r[0] for r in picked) * 1e3:.2f} {cells}")

    print(f"tokenizer {args.tokenizer} ({type(tokenizer.detokenizer).__name__}), "
          f"paste {args.paste} tokens, {mx.default_device()}")
    show("before", rows[10:before])
    during = [r for r in rows[before:] if r[-1] > 0]
    # A step the budget held is one of decodes only, mid-paste: on an H100 those cost 2 ms
    # more than the decode steps before the paste (bench/results/gpu.md, session 27); the
    # phases say whether that is host work.
    show("held, during", [r for r in during if r[-3]])
    for lo in range(0, args.paste, 1000):
        show(f"ctx {lo}-{lo + 1000}", [r for r in during if lo <= r[-2] < lo + 1000 and not r[-3]])


if __name__ == "__main__":
    main()
