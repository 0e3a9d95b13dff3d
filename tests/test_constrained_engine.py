"""Constrained decoding through the engine's public API (engine/runner/constraints.py).

References: mlx-lm's own generation with a logits processor that applies the same grammar
through a separate llguidance matcher (the engine's greedy constrained reply must equal it
token for token), ``jsonschema`` for every sampled reply, and mlx-lm's plain greedy reply
for the unconstrained chat that shares the batch.
"""

from __future__ import annotations

import json
import re

import jsonschema
import mlx.core as mx
import pytest
from mlx_lm import stream_generate

from engine import Constraint, Engine, EngineConfig, FinishReason, SamplingParams
from engine.runner.constraints import apply_bitmask, grammars_for
from tests.reference import chat_prompt, collect, greedy_reference, reference_model

pytestmark = pytest.mark.model

CAT = {
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
ASK = [{"role": "user", "content": "Describe a cat as JSON: its name, age, colour and toys."}]


def constrained_reference(prompt: list[int], constraint: Constraint, max_tokens: int
                          ) -> list[int]:
    """mlx-lm's greedy generation with the grammar applied as its own logits processor."""
    ref = reference_model()
    grammars = grammars_for(ref.tokenizer)
    matcher = grammars.matcher(grammars.check(constraint))
    consumed = [len(prompt)]  # mlx-lm may ask for the next logits before yielding a token

    def catch_up(tokens: list[int]) -> None:
        for t in tokens[consumed[0]:]:
            assert matcher.consume_token(t), matcher.get_error()
        consumed[0] = max(consumed[0], len(tokens))

    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        catch_up(tokens.tolist())
        return apply_bitmask(logits, None, mx.array(grammars.bitmasks([matcher])))

    out = []
    for r in stream_generate(ref.model, ref.tokenizer, prompt, max_tokens=max_tokens,
                             logits_processors=[processor]):
        out.append(r.token)
        catch_up(prompt + out)
        if r.finish_reason is not None or matcher.is_stopped():
            break
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["synchronous", "overlapped"])
def engine(request):
    eng = Engine(EngineConfig(kv_memory_mib=64, max_batch=8, overlap=request.param))
    eng.start()
    assert eng.wait_ready(600), eng.load_error
    yield eng
    eng.stop()


def test_a_greedy_constrained_reply_equals_mlx_lm_with_the_same_grammar(engine):
    constraint = Constraint("json_schema", CAT)
    prompt = chat_prompt(ASK)
    expected = constrained_reference(prompt, constraint, 120)
    free_prompt = chat_prompt([{"role": "user", "content": "Name three rivers."}])
    free = engine.submit(prompt_tokens=free_prompt,
                         params=SamplingParams(temperature=0.0, max_tokens=40))
    handle = engine.submit(prompt_tokens=prompt, params=SamplingParams(
        temperature=0.0, max_tokens=120, constraint=constraint))
    tokens, finals = collect(handle)
    assert finals[0].finish_reason is FinishReason.STOP, finals[0].error
    assert tokens[0] == expected
    jsonschema.validate(json.loads(_text(tokens[0])), CAT)
    # the unconstrained chat in the same batch is untouched
    free_tokens, _ = collect(free)
    assert free_tokens[0] == greedy_reference(free_prompt, 40)


def _text(tokens: list[int]) -> str:
    tok = reference_model().tokenizer
    return tok.decode([t for t in tokens if t not in tok.eos_token_ids])


def test_sampled_siblings_each_keep_to_the_grammar(engine):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=160, n=3, seed=5,
                            repetition_penalty=1.15, constraint=Constraint("json_schema", CAT))
    tokens, finals = collect(engine.submit(messages=ASK, params=params))
    assert len(finals) == 3
    for i in range(3):
        assert finals[i].finish_reason is FinishReason.STOP, finals[i].error
        jsonschema.validate(json.loads(_text(tokens[i])), CAT)
    assert len({tuple(t) for t in tokens.values()}) > 1, "the samples did not diverge"


def test_a_regex_reply_matches_and_ends_where_the_pattern_does(engine):
    params = SamplingParams(temperature=0.0, max_tokens=40,
                            constraint=Constraint("regex", r"(Yes|No)\. [A-Z][a-z ]{3,30}\."))
    tokens, finals = collect(engine.submit(
        messages=[{"role": "user", "content": "Is the sea salty? Answer and explain."}],
        params=params))
    assert finals[0].finish_reason is FinishReason.STOP
    assert re.fullmatch(r"(Yes|No)\. [A-Z][a-z ]{3,30}\.", _text(tokens[0]))


def test_a_bad_grammar_is_refused_at_submit_and_the_engine_goes_on(engine):
    with pytest.raises(ValueError, match="the regex constraint is not valid"):
        engine.submit(messages=ASK, params=SamplingParams(constraint=Constraint("regex", "(a")))
    prompt = chat_prompt([{"role": "user", "content": "Say hello."}])
    tokens, _ = collect(engine.submit(prompt_tokens=prompt,
                                      params=SamplingParams(temperature=0.0, max_tokens=12)))
    assert tokens[0] == greedy_reference(prompt, 12)


def test_preempted_constrained_replies_resume_in_their_grammar():
    """A pool too small for four JSON replies at once: the latest admitted are preempted
    (blocks freed, tokens kept, recomputed later) and their matchers must stay where the
    reply is; each reply still equals mlx-lm's greedy under the same grammar."""
    constraint = Constraint("json_schema", CAT)
    asks = [f"Describe cat number {i} as JSON: its name, age, colour and toys." for i in
            range(4)]
    prompts = [chat_prompt([{"role": "user", "content": a}]) for a in asks]
    expected = [constrained_reference(p, constraint, 120) for p in prompts]
    # 720 KiB per 16-token block (test_engine's arithmetic): 10 blocks, while the four
    # replies (47-token prompts, about 22-token replies) need 20 at their longest.
    small = Engine(EngineConfig(kv_memory_mib=10 * 0.703125, block_size=16, max_batch=8))
    small.start()
    try:
        assert small.wait_ready(600), small.load_error
        handles = [small.submit(prompt_tokens=p, session_id=f"cat-{i}", params=SamplingParams(
            temperature=0.0, max_tokens=120, constraint=constraint))
            for i, p in enumerate(prompts)]
        results = [collect(h) for h in handles]
        preemptions = small.snapshot().counters.preemptions
    finally:
        small.stop()
    assert preemptions > 0
    for i, (tokens, finals) in enumerate(results):
        assert finals[0].finish_reason is FinishReason.STOP, finals[0].error
        assert tokens[0] == expected[i], f"reply {i} changed after preemption"
        jsonschema.validate(json.loads(_text(tokens[0])), CAT)
