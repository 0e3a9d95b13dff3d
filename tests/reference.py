"""Independent references for engine tests: mlx-lm's own generation on its own cache.

The reference model is a separate instance from the engine's, and references are computed
while the engine is idle, so only one thread runs MLX work at a time.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm import stream_generate
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from engine import Engine, FinalEvent, TokenEvent
from engine.config import SamplingParams
from engine.models.folder import LoadedModel
from engine.models.resolve import load_model


@functools.lru_cache(maxsize=1)
def reference_model() -> LoadedModel:
    return load_model("default")


def chat_prompt(messages: list[dict]) -> list[int]:
    tokenizer = reference_model().tokenizer
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def greedy_reference(prompt: list[int], max_tokens: int) -> list[int]:
    """Token ids mlx-lm's own greedy generation produces (it stops at EOS, like ours)."""
    ref = reference_model()
    out = []
    for response in stream_generate(ref.model, ref.tokenizer, prompt, max_tokens=max_tokens):
        out.append(response.token)
        if response.finish_reason is not None:
            break
    return out


def oracle_distribution(logits: Sequence[float] | np.ndarray, params: SamplingParams,
                        history: Sequence[int] = ()) -> np.ndarray:
    """The distribution a draw must follow, computed in float64 numpy from the definitions
    (independent of engine.runner.sampling and of mlx-lm's filter code):

    repetition penalty on the last repetition_context_size tokens (a seen token's logit is
    divided by the penalty when positive, multiplied when negative); then the kept set, chosen
    on the untempered softmax: top-p = the most likely tokens until their mass reaches top_p,
    min-p = tokens with p >= min_p * p_max, top-k = the k most likely; then softmax(logits / T)
    restricted to the kept set. Temperature 0 is a point mass on the argmax.
    """
    x = np.asarray(logits, dtype=np.float64).copy()
    if params.repetition_penalty != 1.0:
        penalty = params.repetition_penalty
        for t in set(history[-params.repetition_context_size:]):
            x[t] = x[t] * penalty if x[t] < 0 else x[t] / penalty
    if params.greedy:
        out = np.zeros_like(x)
        out[int(np.argmax(x))] = 1.0
        return out
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = np.ones(x.shape, dtype=bool)
    order = np.argsort(-p, kind="stable")
    if 0.0 < params.top_p < 1.0:
        mass_before = np.cumsum(p[order]) - p[order]  # mass of the strictly more likely tokens
        keep[order[mass_before >= params.top_p]] = False
    if params.min_p > 0.0:
        keep &= p >= params.min_p * p.max()
    if params.top_k > 0:
        keep[order[params.top_k:]] = False
    z = np.where(keep, x / params.temperature, -np.inf)
    q = np.exp(z - z[keep].max())
    return q / q.sum()


def key_stream(seed: int, index: int):
    """The PRNG keys of sample ``index`` of a seeded request, as the engine documents them:
    sample i starts from split(key(seed), i + 1)[i]; each draw splits (next key, draw key)."""
    key = mx.random.split(mx.random.key(seed), index + 1)[index]
    while True:
        key, draw = mx.random.split(key)
        yield draw


def oracle_draw(distribution: np.ndarray, draw_key: mx.array) -> int:
    """A draw from ``distribution`` with MLX's Gumbel-max categorical under ``draw_key``: the
    same key picks the same token for any logits with the same kept set and softmax."""
    with np.errstate(divide="ignore"):
        logp = np.log(distribution).astype(np.float32)
    return mx.random.categorical(mx.array(logp)[None], key=draw_key)[0].item()


def sampled_reference(prompt: list[int], params: SamplingParams, index: int,
                      tokens: list[int]) -> list[int]:
    """Replays a sampled reply on mlx-lm's cache with the numpy oracle and the documented key
    stream: returns the tokens that should have been drawn, given the tokens actually drawn
    before each one (so one divergence does not cascade)."""
    ref = reference_model()
    cache = make_prompt_cache(ref.model)
    keys = key_stream(params.seed, index)
    logits = ref.model(mx.array([prompt]), cache=cache)[0, -1]
    history = list(prompt)
    expected = []
    for token in tokens:
        dist = oracle_distribution(np.array(logits.astype(mx.float32)), params, history)
        expected.append(oracle_draw(dist, next(keys)))
        history.append(token)
        logits = ref.model(mx.array([[token]]), cache=cache)[0, -1]
    return expected


def _copied(cache: list[KVCache]) -> list[KVCache]:
    """A beam's own cache: every layer's keys and values up to its offset, as new arrays."""
    out = []
    for layer in cache:
        copy = KVCache()
        copy.keys = layer.keys[..., : layer.offset, :]
        copy.values = layer.values[..., : layer.offset, :]
        copy.offset = layer.offset
        out.append(copy)
    return out


def _logprobs(logits: mx.array) -> np.ndarray:
    x = logits.astype(mx.float32)
    return np.array(x - mx.logsumexp(x, axis=-1, keepdims=True))


def reference_beam_search(prompt: list[int], params: SamplingParams, model=None,
                          eos_ids: Sequence[int] | None = None
                          ) -> list[tuple[list[int], float]]:
    """The ``n`` best (tokens, score) of a beam search on mlx-lm's model, written plainly:
    every beam its own copy of mlx-lm's KV cache (nothing shared), following Hugging Face's
    ``_beam_search`` (transformers 5.x): the ``2k`` best continuations of all beams (summed
    log-probabilities), those among the first ``k`` that end (EOS, or ``max_tokens``) kept
    as hypotheses scored ``sum / generated length ** length_penalty``, the ``k`` best that
    do not end going on, and HF's stopping rules (``early_stopping`` True, False, "never").
    ``model`` / ``eos_ids``: another mlx-lm model (the GPU check's), else the default one."""
    if model is None:
        ref = reference_model()
        model, eos_ids = ref.model, ref.tokenizer.eos_token_ids
    eos = set(eos_ids)
    k, lp_exp = params.beam_width, params.length_penalty
    keep = max(2, 1 + len(eos)) * k
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    # live beams, best first: (summed log-probability, generated tokens, cache, next logits)
    live = [(0.0, [], cache, logits)]
    finished: list[tuple[float, list[int]]] = []  # (score, tokens), best first
    for generated in range(1, params.max_tokens + 1):
        candidates = []
        for rank, (total, _, _, logits) in enumerate(live):
            lp = _logprobs(logits)
            for token in np.argsort(-lp, kind="stable")[:keep]:
                candidates.append((total + float(lp[token]), rank, int(token)))
        candidates.sort(key=lambda c: (-c[0], c[1]))
        candidates = candidates[:keep]
        at_limit = generated == params.max_tokens
        for total, rank, token in candidates[:k]:
            if at_limit or token in eos:
                finished.append((total / generated ** lp_exp, live[rank][1] + [token]))
        finished = sorted(finished, key=lambda h: -h[0])[:k]
        going_on = [c for c in candidates if not (at_limit or c[2] in eos)][:k]
        if at_limit:
            break
        longest = (params.max_tokens if params.early_stopping == "never" and lp_exp > 0
                   else generated)
        if len(finished) == k and (going_on[0][0] / longest ** lp_exp <= finished[-1][0]
                                   or params.early_stopping is True):
            break
        next_live = []
        for total, rank, token in going_on:
            own = _copied(live[rank][2])
            logits = model(mx.array([[token]]), cache=own)[0, -1]
            next_live.append((total, live[rank][1] + [token], own, logits))
        live = next_live
    return [(tokens, score) for score, tokens in finished[: params.n]]


def sample_next(
    logits: mx.array, params: SamplingParams, history: list[int], key: mx.array | None
) -> tuple[mx.array, mx.array | None]:
    """The engine's former per-row sampler, kept verbatim as the reference for the batched
    one: next token (a lazy scalar) for one row [vocab], and the key for its next draw."""
    row = logits[None].astype(mx.float32)
    if params.repetition_penalty != 1.0:
        context = mx.array(history, dtype=mx.int32)
        for processor in make_logits_processors(
            repetition_penalty=params.repetition_penalty,
            repetition_context_size=params.repetition_context_size,
        ):
            row = processor(context, row)
    if params.greedy:
        return mx.argmax(row, axis=-1)[0], key
    logprobs = row - mx.logsumexp(row, axis=-1, keepdims=True)
    if 0.0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logprobs.shape[-1]:  # top_k = vocabulary size keeps every token
        logprobs = apply_top_k(logprobs, params.top_k)
    key, draw = mx.random.split(key)
    token = mx.random.categorical(logprobs * (1.0 / params.temperature), key=draw)
    return token[0], key


def collect(handle) -> tuple[dict[int, list[int]], dict[int, FinalEvent]]:
    """Every sample's token ids and final event, by sample index (blocking)."""
    tokens: dict[int, list[int]] = {}
    finals: dict[int, FinalEvent] = {}
    for event in handle:
        if isinstance(event, TokenEvent):
            tokens.setdefault(event.index, []).extend(event.token_ids)
        else:
            finals[event.index] = event
    return tokens, finals


def wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll ``condition`` until true (like qtbot.waitUntil); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(0.01)


def session_blocks(engine: Engine, session_id: str) -> int:
    snap = engine.snapshot()
    stats = snap.sessions.get(session_id) if snap else None
    return stats.blocks_held if stats else 0
