"""Issue #26's agreement target against other K/V perturbations, on mlx-lm alone.

The 8-bit pool's greedy replies equal the fp32 pool's in 7 of 20 (bench/results/kv8.md).
Is that the scheme, or does any K/V perturbation of this size flip the default model's
greedy paths? The same 20 prompts, 64 greedy tokens, through mlx-lm's ``generate_step``
(one prompt at a time, its own cache, no engine code) with:

* the fp32 cache (the reference);
* mlx-lm's own 8-bit cache (``kv_bits=8``: affine, groups of 64, from the first token);
* mlx-lm's 4-bit cache (the same, 4 bits), for scale;
* K/V rounded to bf16 as they are stored (what a bf16 pool would hold; attention in fp32);
* PagedChat's 8-bit scheme (engine/kv/int8.py: symmetric, one fp16 scale per token and KV
  head), K/V quantized and dequantized as they are stored: the pool's numbers without the
  engine's batching.

    source scripts/env.sh; .venv/bin/python -m bench.kv8_reference_agreement
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

from bench.kv8_quality import PROMPTS
from engine.kv import int8
from engine.models.resolve import load_model

MAX_TOKENS = 64


class Bf16KVCache(KVCache):
    """mlx-lm's KVCache, its K/V rounded to bf16 on the way in and read back in fp32."""

    def update_and_fetch(self, keys, values):
        rounded = (keys.astype(mx.bfloat16).astype(keys.dtype),
                   values.astype(mx.bfloat16).astype(values.dtype))
        return super().update_and_fetch(*rounded)


class PagedInt8KVCache(KVCache):
    """mlx-lm's KVCache holding what the 8-bit pool holds: K/V through int8.quantize and back
    (``[B, kv_heads, T, head_dim]``: one scale per token and head, over head_dim)."""

    def update_and_fetch(self, keys, values):
        def through_int8(x):
            q, scales = int8.quantize(x)
            return int8.dequantize(q, scales, x.dtype)

        return super().update_and_fetch(through_int8(keys), through_int8(values))


def greedy(model, prompt: list[int], **kwargs) -> list[int]:
    tokens = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS,
                                  sampler=lambda x: mx.argmax(x, axis=-1), **kwargs):
        tokens.append(int(token))
        if int(token) in EOS:
            break
    return tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    t0 = time.perf_counter()
    loaded = load_model("default")
    model, tok = loaded.model, loaded.tokenizer
    EOS = set(tok.eos_token_ids)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}],
                                       add_generation_prompt=True) for p in PROMPTS]
    variants = {
        "mlx-lm 8-bit cache (affine, group 64)": dict(kv_bits=8, quantized_kv_start=0),
        "mlx-lm 4-bit cache (affine, group 64)": dict(kv_bits=4, quantized_kv_start=0),
        "K/V rounded to bf16": Bf16KVCache,
        "PagedChat's 8-bit scheme (symmetric, per token and head)": PagedInt8KVCache,
    }
    reference = [greedy(model, p) for p in prompts]
    print(f"# Greedy agreement with the fp32 cache, mlx-lm only ({len(prompts)} prompts, "
          f"{MAX_TOKENS} tokens; {loaded.name})\n")
    print("| K/V | replies identical | mean common prefix | per prompt |")
    print("| --- | --- | --- | --- |")
    for name, kwargs in variants.items():
        replies = []
        for p in prompts:
            if isinstance(kwargs, type):
                cache = [kwargs() for _ in make_prompt_cache(model)]
                replies.append(greedy(model, p, prompt_cache=cache))
            else:
                replies.append(greedy(model, p, **kwargs))
        prefixes = [common_prefix(a, b) for a, b in zip(reference, replies, strict=True)]
        same = sum(a == b for a, b in zip(reference, replies, strict=True))
        print(f"| {name} | {same}/{len(prompts)} | {sum(prefixes) / len(prefixes):.1f} | "
              f"{prefixes} |", flush=True)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
