"""Beam search through the OpenAI-compatible server (docs/ARCHITECTURE.md §6.4), driven by
the official `openai` client over real HTTP: ``best_of`` (and vLLM's ``use_beam_search``)
on both endpoints, the choices against the reference beam search on mlx-lm's own cache, and
a 400 naming the parameter for every combination that makes no sense.
"""

from __future__ import annotations

import openai
import pytest

from engine import SamplingParams
from tests.reference import chat_prompt, reference_beam_search, reference_model, wait_until
from tests.server_helpers import model_id, openai_client, running_engine, running_server, user

pytestmark = pytest.mark.model

@pytest.fixture(scope="module")
def engine():
    with running_engine() as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    with running_server(engine) as thread:
        yield openai_client(thread)


def text_of(tokens: list[int]) -> str:
    """The reply text the server gives for ``tokens`` (EOS left out)."""
    tokenizer = reference_model().tokenizer
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in tokens:
        if token not in tokenizer.eos_token_ids:
            detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def test_chat_best_of_returns_the_n_best_beams(client, engine) -> None:
    question = "What is the capital of France?"
    reply = client.chat.completions.create(model=model_id(engine), messages=user(question),
                                           n=2, max_tokens=16, extra_body={"best_of": 3})
    expected = reference_beam_search(
        chat_prompt(user(question)),
        SamplingParams(temperature=0.0, beam_width=3, n=2, max_tokens=16))
    assert [c.index for c in reply.choices] == [0, 1]
    for choice, (tokens, _) in zip(reply.choices, expected):
        assert choice.message.content == text_of(tokens)
        ended = tokens[-1] in reference_model().tokenizer.eos_token_ids
        assert choice.finish_reason == ("stop" if ended else "length")
    assert reply.usage.completion_tokens == sum(len(t) for t, _ in expected)
    wait_until(lambda: engine.snapshot().used_blocks == 0)


def test_completion_use_beam_search_takes_its_width_from_n(client, engine) -> None:
    """vLLM's extension: ``use_beam_search`` with ``n`` and no ``best_of`` searches n beams;
    its ``length_penalty`` and ``early_stopping`` reach the engine."""
    prompt = "The three primary colours are"
    reply = client.completions.create(
        model=model_id(engine), prompt=prompt, n=2, max_tokens=8,
        extra_body={"use_beam_search": True, "length_penalty": 0.5, "early_stopping": True})
    expected = reference_beam_search(
        engine.encode(prompt),
        SamplingParams(temperature=0.0, beam_width=2, n=2, max_tokens=8, length_penalty=0.5,
                       early_stopping=True))
    assert [c.text for c in reply.choices] == [text_of(t) for t, _ in expected]


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"n": 3, "best_of": 2}, "best_of", "at least n"),
    ({"best_of": 9}, "best_of", "[1, 8]"),
    ({"best_of": 3, "stream": True}, "stream", "cannot be streamed"),
    ({"best_of": 3, "use_beam_search": False}, "best_of", "no sampled best-of"),
    ({"use_beam_search": True}, "best_of", "2 or more"),
    ({"use_beam_search": "yes"}, "use_beam_search", "true or false"),
    ({"best_of": 3, "temperature": 0.7}, "temperature", "best_of 3"),
    ({"best_of": 3, "seed": 5}, "seed", "beam search"),
    ({"best_of": 3, "stop": ["."]}, "stop", "beam search"),
    ({"best_of": 3, "early_stopping": "sometimes"}, "early_stopping", "never"),
])
def test_beam_search_combinations_that_make_no_sense_get_400(client, engine, fields, param,
                                                            says) -> None:
    body = {"model": model_id(engine), "messages": user("hi"), "max_tokens": 4}
    stream = fields.pop("stream", False)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**body, stream=stream, extra_body=fields)
    error = caught.value.body
    assert error["param"] == param, error
    assert says in error["message"], error["message"]


def test_best_of_one_is_the_usual_reply(client, engine) -> None:
    reply = client.completions.create(model=model_id(engine), prompt="Hello", max_tokens=4,
                                      temperature=0, best_of=1)
    assert len(reply.choices) == 1 and reply.choices[0].text
