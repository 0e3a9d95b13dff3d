# ruff: noqa: F811  (test functions take the imported fixtures by name)
"""``logprobs`` through ``pagedchat serve`` with the official ``openai`` client, chat and
completions, streamed and not.

Reference: mlx-lm's own forward over the prompt and the reply (tests/test_logprobs.py), the
log-softmax in float64: every reported log-probability matches it.
"""

from __future__ import annotations

import openai
import pytest

from tests.reference import chat_prompt, reference_model
from tests.test_logprobs import LOGIT_TOL, reference_logprobs

# The server fixtures of tests/test_server.py (one engine and server for these tests too).
from tests.test_server import client, engine, model_id, server, user  # noqa: F401

pytestmark = pytest.mark.model

QUESTION = "Name a large city in Japan."


def test_chat_logprobs_match_the_model_streamed_and_not(client, engine):
    reply = client.chat.completions.create(
        model=model_id(engine), messages=user(QUESTION), temperature=0, max_tokens=12,
        logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    tok = reference_model().tokenizer
    ids = [tok.encode(c.token, add_special_tokens=False) for c in content]
    assert "".join(c.token for c in content).lstrip() == reply.choices[0].message.content
    prompt = chat_prompt(user(QUESTION))
    reply_ids = [i[0] for i in ids]
    want = reference_logprobs(prompt, reply_ids)
    for k, entry in enumerate(content):
        assert entry.logprob == pytest.approx(want[k, reply_ids[k]], abs=LOGIT_TOL)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.bytes == list(entry.token.encode("utf-8"))
    chunks = client.chat.completions.create(
        model=model_id(engine), messages=user(QUESTION), temperature=0, max_tokens=12,
        logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    # the same tokens; the second run reads the prompt from the prefix cache (only its tail
    # computed), so its logits may differ in the last bits
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content],
                                                          abs=1e-4)


def test_completion_logprobs_have_tokens_offsets_and_alternatives(client, engine):
    reply = client.completions.create(model=model_id(engine), prompt="The capital of France is",
                                      temperature=0, max_tokens=6, logprobs=2)
    lp = reply.choices[0].logprobs
    # the reply's text drops the first token's leading space (the detokenizer's rule)
    assert "".join(lp.tokens).lstrip() == reply.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v, abs=1e-6)
               for top, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_no_logprobs_unless_asked(client, engine):
    reply = client.chat.completions.create(model=model_id(engine), messages=user(QUESTION),
                                           temperature=0, max_tokens=4)
    assert reply.choices[0].logprobs is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
])
def test_bad_logprobs_get_400_naming_them(client, engine, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_id(engine), messages=user("hi"), **fields)
    assert caught.value.body["param"] == param


def test_bad_completion_logprobs_get_400(client, engine):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model_id(engine), prompt="x", logprobs=6)
    assert caught.value.body["param"] == "logprobs"
