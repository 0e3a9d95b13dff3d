"""Constrained decoding's masks (engine/runner/constraints.py), with the default model's
tokenizer and no model: any token the mask allows keeps the reply inside the grammar.

References: ``jsonschema`` validates every finished reply against its schema (a random
sampler that draws only allowed tokens, so any hole in a mask shows as an invalid reply);
Python's ``re.fullmatch`` for regex replies; llguidance's own numpy mask application for
the device-side unpacking of the bitmask.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace

from app.core.tool_calls import (
    COMMON_END,
    COMMON_START,
    CallSplitter,
    CallSyntax,
    ToolUse,
    call_constraint,
)
from engine import Constraint, SamplingParams
from engine.runner.constraints import Grammars, apply_bitmask
from tests.reference import reference_model


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    tok = reference_model().tokenizer
    return Grammars(tok._tokenizer, vocab_size=len(tok.vocabulary) if hasattr(tok, "vocabulary")
                    else tok.vocab_size, eos_ids=sorted(tok.eos_token_ids))


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Nested objects, enums, arrays, bounded strings, integer ranges, booleans."""
    kinds = ["string", "integer", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 900)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "a b", "x\"y", "é"], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1),
                "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    props = {f"k{i}_{rng.randint(0, 99)}": random_schema(rng, depth + 1)
             for i in range(rng.randint(1, 4))}
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def constrained_reply(grammars: Grammars, constraint: Constraint, seed: int,
                      limit: int = 400, closing_bonus: float = 0.0) -> str:
    """A reply drawn at random among the tokens each step's mask allows, to its end
    (``closing_bonus`` favours EOS and tokens with a closing brace: a free JSON object
    drawn at random would rarely end)."""
    matcher = grammars.matcher(grammars.check(constraint))
    rng = np.random.default_rng(seed)
    bonus = np.zeros(grammars.vocab_size, dtype=np.float32)
    if closing_bonus:
        for t in range(grammars.vocab_size):
            if t in grammars.eos_ids or "}" in grammars.tokenizer.decode_str([t]):
                bonus[t] = closing_bonus
    tokens = []
    for _ in range(limit):
        if matcher.is_stopped():
            break
        masks = grammars.bitmasks([matcher])
        logits = mx.array(rng.standard_normal((1, grammars.vocab_size)).astype(np.float32)
                          + bonus)
        token = int(mx.argmax(apply_bitmask(logits, None, mx.array(masks)), axis=-1).item())
        assert matcher.consume_token(token), matcher.get_error()
        if token in grammars.eos_ids:
            break
        tokens.append(token)
    else:
        raise AssertionError("the reply never ended")
    return grammars.tokenizer.decode_str(tokens)


@pytest.mark.parametrize("seed", range(20))
def test_replies_under_a_random_schema_validate_against_it(grammars, seed):
    schema = random_schema(random.Random(seed))
    if schema.get("type") != "object":
        schema = {"type": "object", "properties": {"value": schema}, "required": ["value"],
                  "additionalProperties": False}
    reply = constrained_reply(grammars, Constraint("json_schema", schema), seed)
    jsonschema.validate(json.loads(reply), schema)


def test_json_object_replies_are_objects(grammars):
    for seed in range(3):
        value = json.loads(constrained_reply(grammars, Constraint("json_object"), seed,
                                             closing_bonus=6.0))
        assert isinstance(value, dict)


def test_regex_replies_match_the_whole_pattern(grammars):
    pattern = r"(yes|no), because [a-z]{2,8}\."
    for seed in range(5):
        assert re.fullmatch(pattern, constrained_reply(grammars, Constraint("regex", pattern),
                                                       seed))


@pytest.mark.parametrize("constraint, words", [
    (Constraint("json_schema", {"type": "object", "properties": {"a": {"type": "nope"}}}),
     "json_schema"),
    (Constraint("regex", "(unclosed"), "regex"),
    (Constraint("lark", "start: undefined_rule"), "lark"),
])
def test_a_bad_grammar_is_refused_naming_its_kind(grammars, constraint, words):
    with pytest.raises(ValueError, match=f"the {words} constraint is not valid"):
        grammars.check(constraint)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="xml"), "constraint kind must be one of"),
    (dict(kind="json_schema", spec="{not json"), "needs a JSON schema"),
    (dict(kind="json_schema", spec="[1, 2]"), "needs a JSON schema object"),
    (dict(kind="regex", spec=""), "needs its regex as a non-empty string"),
    (dict(kind="json_object", spec="x"), "takes no spec"),
])
def test_a_malformed_constraint_is_refused_at_the_door(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Constraint(**kwargs)
    with pytest.raises(ValueError, match="constraint must be None or a Constraint"):
        SamplingParams(constraint={"type": "json_object"})


def test_the_bitmask_unpacks_on_the_device_as_llguidance_does_on_the_host():
    rng = np.random.default_rng(4)
    vocab = 1000  # not a multiple of 32
    masks = rng.integers(-2**31, 2**31 - 1, size=(3, (vocab + 31) // 32), dtype=np.int64)
    masks = masks.astype(np.int32)
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    rows = [4, 0, 2]  # constrained rows, in any order; rows 1 and 3 are free
    expected = logits.copy()
    picked = expected[rows]
    apply_token_bitmask_inplace(picked, masks)
    expected[rows] = picked
    got = np.array(apply_bitmask(mx.array(logits), mx.array(rows, dtype=mx.int32),
                                 mx.array(masks)))
    np.testing.assert_array_equal(got, expected)


def test_a_tokenizer_llguidance_cannot_read_is_refused_with_a_clear_message(tmp_path):
    """A word-level tokenizer (no byte-level or byte-fallback decoder): asking for a
    constrained reply says the model cannot do it, every time, instead of llguidance's
    internal error."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from engine.runner.constraints import grammars_for

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", eos_token="w63", unk_token="w0")))
    wrapper = load_tokenizer(tmp_path)
    for _ in range(2):
        with pytest.raises(ValueError, match="tokenizer does not support constrained output"):
            grammars_for(wrapper)


def test_a_required_calls_json_has_no_whitespace_but_the_usual_separators(grammars):
    """A forced tool call's JSON is laid out as ``json.dumps`` lays it out. The grammar used
    to admit any whitespace between JSON tokens, and the app's sampled default model once
    wrote tabs until its token budget ended, so the call never closed (CI's walk-through).
    Random draws under the mask would wander into such runs; here every draw closes its call
    within a short budget, and its skeleton, strings emptied, is the canonical one."""
    spec = {"type": "function", "function": {
        "name": "weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                  "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}}
    constraint = call_constraint(ToolUse((spec,), "required", parallel=False),
                                 COMMON_START, COMMON_END)
    for seed in range(12):
        reply = constrained_reply(grammars, constraint, seed, limit=80)
        splitter = CallSplitter(CallSyntax(COMMON_START, COMMON_END, None), [spec])
        shown, calls = splitter.feed(reply, final=True)
        assert shown == "" and len(calls) == 1, reply
        body = reply.removeprefix(COMMON_START + "\n").removesuffix("\n" + COMMON_END)
        skeleton = re.sub(r'"(?:[^"\\]|\\.)*"', '""', body)
        assert skeleton == '{"": "", "": {"": ""}}', reply
