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
  engine's batching;
* schemes the pool does not use, to see what would reach the target (the open block is
  the last, partly filled block of BLOCK tokens, which a pool could keep in full precision
  until it fills, as KIVI keeps its residual):
  - the pool's scheme on filled blocks, the open block in full precision;
  - K quantized per channel over each filled block (one scale per head-dim element, as KIVI
    does for K, whose outliers sit in channels), V per token, the open block in full
    precision;
  - K per channel over each filled block, requantized from its per-token values when the
    block fills (what a pool could do without a full-precision open block), V and the open
    block per token;
  - K and V both per channel over each filled block, the open block in full precision;
  - K per channel, V per token, the open block and the filled block before it in full
    precision (16-31 tokens: a larger residual).
  - the first block (the attention sink: the chat template's first tokens, which every
    query attends to heavily; in a pool, the system prompt's block, shared by the chats
    that share it) and the open block in full precision, with the pool's scheme or with K
    per channel in between; with K per channel, also the filled block before the open one,
    or the first two blocks, in full precision; and the first, the open and the one before
    rounded to bf16 instead (what an fp32 model's pool could hold them as).

    source scripts/env.sh; .venv/bin/python -m bench.kv8_reference_agreement [--only TEXT[|TEXT...]]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

from bench.kv8_quality import PROMPTS
from engine.kv import int8
from engine.models.resolve import load_model

MAX_TOKENS = 64
BLOCK = 16  # the pool's default block size


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


def _filled_blocks(x: mx.array, quantized, full_blocks: int = 0,
                   sink_blocks: int = 0, kept=lambda y: y) -> mx.array:
    """x [B, heads, T, D] with its first BLOCK * (T // BLOCK) tokens through ``quantized``
    (a function of [B, heads, blocks, BLOCK, D]) and the open block as it is; with
    ``full_blocks``, that many filled blocks before the open one as they are too; with
    ``sink_blocks``, that many first blocks as they are (the attention sink: the first
    tokens take a large share of every query's attention); ``kept``: what the tokens kept
    out of 8 bits go through (as they are by default)."""
    b, h, t, d = x.shape
    n = max(t // BLOCK - full_blocks, 0) * BLOCK
    first = min(sink_blocks * BLOCK, n)
    if n - first <= 0:
        return kept(x)
    middle = x[:, :, first:n].reshape(b, h, (n - first) // BLOCK, BLOCK, d)
    parts = [kept(x[:, :, :first]), quantized(middle).reshape(b, h, n - first, d),
             kept(x[:, :, n:])]
    return mx.concatenate([p for p in parts if p.shape[2]], axis=2)


def _bf16(x: mx.array) -> mx.array:
    return x.astype(mx.bfloat16).astype(x.dtype)


def _per_token(blocks: mx.array) -> mx.array:
    q, scales = int8.quantize(blocks)
    return int8.dequantize(q, scales, blocks.dtype)


def _per_channel(blocks: mx.array) -> mx.array:
    """Symmetric int8 with one scale per (block, head, channel): the max over the block's
    tokens / 127 (kept in fp32 here; a pool would store it as fp16)."""
    scale = mx.maximum(mx.max(mx.abs(blocks), axis=-2, keepdims=True), 1e-8) / 127.0
    return (mx.clip(mx.round(blocks / scale), -127, 127) * scale).astype(blocks.dtype)


class OpenBlockFullCache(KVCache):
    """The pool's scheme on filled blocks; the open block in full precision. mlx-lm's cache
    keeps the exact K/V; what attention reads is quantized per filled block on the way out."""

    k_scheme = staticmethod(_per_token)
    v_scheme = staticmethod(_per_token)
    full_blocks = 0  # filled blocks before the open one also kept in full precision
    sink_blocks = 0  # first blocks kept in full precision

    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys, values)
        return (_filled_blocks(k, self.k_scheme, self.full_blocks, self.sink_blocks),
                _filled_blocks(v, self.v_scheme, self.full_blocks, self.sink_blocks))


class PerChannelKeysCache(OpenBlockFullCache):
    """K per channel over each filled block, V per token, the open block in full precision."""

    k_scheme = staticmethod(_per_channel)


def _open_block(x: mx.array, filled, open_) -> mx.array:
    """As ``_filled_blocks`` with the open block through ``open_`` (per token) too."""
    b, h, t, d = x.shape
    n = t // BLOCK * BLOCK
    head = _filled_blocks(x[:, :, :n], filled) if n else x[:, :, :0]
    if n == t:
        return head
    return mx.concatenate([head, _per_token(x[:, :, n:][:, :, None])[:, :, 0]], axis=2)


class RequantizedKeysCache(KVCache):
    """K per channel over each filled block, from the per-token values the open block held;
    V and the open block per token."""

    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys, values)
        return (_open_block(k, lambda blk: _per_channel(_per_token(blk)), _per_token),
                _open_block(v, _per_token, _per_token))


class PerChannelKeysTwoBlocksCache(PerChannelKeysCache):
    """As PerChannelKeysCache, with the last filled block in full precision too (16-31 tokens
    in full precision, as a larger KIVI residual)."""

    full_blocks = 1


class SinkOpenBlockFullCache(OpenBlockFullCache):
    """The pool's scheme (per token), the first block and the open block in full precision."""

    sink_blocks = 1


class PerChannelKeysSinkCache(PerChannelKeysCache):
    """K per channel, V per token, the first block and the open block in full precision (a
    chat's first block is its system prompt's, shared by the chats that share it)."""

    sink_blocks = 1


class PerChannelKeysSinkTwoBlocksCache(PerChannelKeysSinkCache):
    """As PerChannelKeysSinkCache, with the last filled block in full precision too."""

    full_blocks = 1


class PerChannelKeysSinkTwoBlocksBf16Cache(PerChannelKeysSinkTwoBlocksCache):
    """As PerChannelKeysSinkTwoBlocksCache, the blocks kept out of 8 bits held in bf16 (what
    a pool of an fp32 model could store them as: 2 bytes a value, not 4)."""

    def update_and_fetch(self, keys, values):
        k, v = KVCache.update_and_fetch(self, keys, values)
        return (_filled_blocks(k, self.k_scheme, self.full_blocks, self.sink_blocks, _bf16),
                _filled_blocks(v, self.v_scheme, self.full_blocks, self.sink_blocks, _bf16))


class PerChannelKeysTwoSinksCache(PerChannelKeysCache):
    """K per channel, V per token, the first two blocks and the open block in full precision."""

    sink_blocks = 2


class PerChannelBothCache(OpenBlockFullCache):
    """K and V per channel over each filled block, the open block in full precision."""

    k_scheme = staticmethod(_per_channel)
    v_scheme = staticmethod(_per_channel)


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="",
                        help="run the variants whose name holds TEXT (alternatives: A|B)")
    args = parser.parse_args()
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
        "PagedChat's scheme, the open block in full precision": OpenBlockFullCache,
        "K per channel a block, V per token, the open block in full precision":
            PerChannelKeysCache,
        "K per channel a block requantized from per token, V per token, nothing full":
            RequantizedKeysCache,
        "K and V per channel a block, the open block in full precision": PerChannelBothCache,
        "K per channel a block, V per token, the open block and the one before in full":
            PerChannelKeysTwoBlocksCache,
        "PagedChat's scheme, the first block (sink) and the open block in full":
            SinkOpenBlockFullCache,
        "K per channel a block, V per token, the first block (sink) and the open block in full":
            PerChannelKeysSinkCache,
        "K per channel a block, V per token, the first block (sink), the open one and the one "
        "before in full": PerChannelKeysSinkTwoBlocksCache,
        "K per channel a block, V per token, the first two blocks (sink) and the open block in "
        "full": PerChannelKeysTwoSinksCache,
        "K per channel a block, V per token, the first block (sink), the open one and the one "
        "before in bf16": PerChannelKeysSinkTwoBlocksBf16Cache,
    }
    variants = {name: v for name, v in variants.items()
                if any(text in name for text in args.only.split("|"))}
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
