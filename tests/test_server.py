"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP.

One real engine and one server (uvicorn in its own thread, 127.0.0.1, a free port) per module.
Replies are checked against mlx-lm's own generation or against the same requests sent one
by one; blocks against the engine's snapshots. Every client call has a timeout, and the
server stops itself when the module ends.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.error
import urllib.request

import openai
import pytest

from app.server import ServerOptions, ServerThread, create_app
from tests.reference import greedy_reference, reference_model, session_blocks, wait_until
from tests.server_helpers import (
    KEY,
    TIMEOUT_S,
    model_id,
    openai_client,
    running_engine,
    running_server,
    user,
)

pytestmark = pytest.mark.model

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain what a KV cache is in one sentence.",
    "Give me a short tip for learning to cook.",
    "What is 12 times 12?",
    "Say hello in Spanish and in German.",
]


@pytest.fixture(scope="module")
def engine():
    with running_engine() as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


def mlx_lm_text(tokens: list[int]) -> str:
    """The text mlx-lm's own streaming detokenizer makes of generated ``tokens`` (EOS
    excluded; like mlx_lm.server, it drops the first token's leading space)."""
    tokenizer = reference_model().tokenizer
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in tokens:
        if token in tokenizer.eos_token_ids:
            break
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def chat(client, engine, text: str, **kw):
    return client.chat.completions.create(model=model_id(engine), messages=user(text), **kw)


def stream_text(client, engine, messages, **kw) -> tuple[str, str | None]:
    """The streamed reply's text and finish reason (the stream must end with [DONE])."""
    parts, finish = [], None
    stream = client.chat.completions.create(
        model=model_id(engine), messages=messages, stream=True, **kw)
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(parts), finish


def raw(server, path: str, body: dict | bytes | None = None, key: str | None = KEY,
        method: str | None = None) -> tuple[int, dict]:
    """A plain HTTP request (for what the SDK will not send: no key, a huge body)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url.removesuffix("/v1") + path, data=data,
                                     method=method)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ---- endpoints ----------------------------------------------------------------------------


def test_lists_the_engines_model(client, engine) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [model_id(engine)]
    # the embedded model's id is its name as the Models window and the toolbar show it,
    # typed as is: no spaces, no "(fp32)" (issue 25)
    assert model_id(engine) == "SmolLM2-135M-Instruct" != engine.model_info.name


def test_chat_reply_equals_mlx_lm_greedy_generation(client, engine) -> None:
    question = QUESTIONS[0]
    prompt = engine.encode_chat(user(question))
    expected = mlx_lm_text(greedy_reference(prompt, 24))
    reply = chat(client, engine, question, temperature=0, max_tokens=24)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(prompt)


def test_streamed_reply_equals_the_whole_reply(client, engine) -> None:
    whole = chat(client, engine, QUESTIONS[1], temperature=0, max_tokens=20)
    text, finish = stream_text(client, engine, user(QUESTIONS[1]), temperature=0, max_tokens=20)
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason


def test_n_samples_are_distinct_and_a_seed_reproduces_them(client, engine) -> None:
    kw = dict(temperature=1.2, max_tokens=20, n=2, seed=4242)
    # What a seed reproduces is the same request on the same prefix-cache state
    # (docs/ARCHITECTURE.md §3.7): a prompt computed fresh and the same prompt read back from
    # the cache differ in the last bits, which a temperature of 1.2 can turn into another
    # token. So the prompt's full blocks are put in the cache first, as any earlier request
    # with this prompt would have left them.
    chat(client, engine, "Invent a name for a dragon.", max_tokens=1)
    first = chat(client, engine, "Invent a name for a dragon.", **kw)
    again = chat(client, engine, "Invent a name for a dragon.", **kw)
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1]
    assert texts == [c.message.content for c in sorted(again.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1], "n=2 returned the same sample twice"
    other = chat(client, engine, "Invent a name for a dragon.", **{**kw, "seed": 99})
    assert [c.message.content for c in other.choices] != texts
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(
            model=model_id(engine), messages=user("Invent a name for a dragon."),
            stream=True, **kw):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert [streamed[0], streamed[1]] == texts


def test_stop_string_ends_the_reply_before_it(client, engine) -> None:
    full = chat(client, engine, QUESTIONS[0], temperature=0, max_tokens=24)
    text = full.choices[0].message.content
    assert " is " in text, text
    stopped = chat(client, engine, QUESTIONS[0], temperature=0, max_tokens=24, stop=[" is "])
    assert stopped.choices[0].message.content == text.split(" is ")[0]
    assert stopped.choices[0].finish_reason == "stop"
    streamed, finish = stream_text(client, engine, user(QUESTIONS[0]), temperature=0,
                                   max_tokens=24, stop=" is ")
    assert (streamed, finish) == (text.split(" is ")[0], "stop")


def test_usage_counts_tokens_and_prefix_cache_hits(client, engine) -> None:
    text = "Summarise in one line: " + "the quick brown fox jumps over the lazy dog. " * 6
    prompt = engine.encode_chat(user(text))
    bs = engine.model_info.block_size
    first = chat(client, engine, text, temperature=0, max_tokens=5)
    assert first.usage.prompt_tokens == len(prompt)
    assert first.usage.completion_tokens == 5 and first.choices[0].finish_reason == "length"
    assert first.usage.total_tokens == len(prompt) + 5
    stream = client.chat.completions.create(
        model=model_id(engine), messages=user(text), temperature=0, max_tokens=5, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == 5
    # The second time, every whole block of the prompt comes from the prefix cache.
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached > first.usage.prompt_tokens_details.cached_tokens
    assert cached % bs == 0 and cached >= (len(prompt) - 1) // bs * bs


def test_text_completion_from_text_and_from_token_ids(client, engine) -> None:
    prompt = "The three primary colours are"
    by_text = client.completions.create(model=model_id(engine), prompt=prompt, temperature=0,
                                        max_tokens=12)
    ids = engine.encode(prompt)
    by_ids = client.completions.create(model=model_id(engine), prompt=ids, temperature=0,
                                       max_tokens=12)
    expected = mlx_lm_text(greedy_reference(ids, 12))
    assert by_text.choices[0].text == by_ids.choices[0].text == expected
    assert by_ids.usage.prompt_tokens == len(ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_id(engine), prompt=prompt, temperature=0, max_tokens=12, stream=True))
    assert streamed == expected


def test_eight_concurrent_streams_equal_the_same_requests_one_by_one(server, engine) -> None:
    async def one(aclient, question: str) -> str:
        parts = []
        stream = await aclient.chat.completions.create(
            model=model_id(engine), messages=user(question), temperature=0, max_tokens=32,
            stream=True, user="concurrency")
        async for chunk in stream:
            parts.extend(c.delta.content or "" for c in chunk.choices)
        return "".join(parts)

    async def run(concurrent: bool) -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url, api_key=KEY, timeout=TIMEOUT_S,
                                      max_retries=0) as aclient:
            if concurrent:
                return list(await asyncio.gather(*(one(aclient, q) for q in QUESTIONS)))
            return [await one(aclient, q) for q in QUESTIONS]

    alone = asyncio.run(run(concurrent=False))
    together = asyncio.run(run(concurrent=True))
    assert together == alone
    assert all(alone)


def test_a_client_leaving_mid_stream_cancels_its_request_and_frees_its_blocks(
        client, engine) -> None:
    session = "API · leaver"
    stream = client.chat.completions.create(
        model=model_id(engine), messages=user("Write a very long story about a lighthouse."),
        temperature=0, max_tokens=2000, stream=True, user="leaver")
    received = 0
    for chunk in stream:
        received += sum(1 for c in chunk.choices if c.delta.content)
        if received >= 3:
            break
    wait_until(lambda: session_blocks(engine, session) > 0, timeout=30)
    stream.close()  # the client hangs up, 1997 tokens early
    wait_until(lambda: session_blocks(engine, session) == 0
               and engine.snapshot().sessions[session].requests == 0, timeout=60)
    snap = engine.snapshot()
    assert not any(session in owners for owners in snap.owners)


def test_api_users_are_sessions_of_their_own(client, engine) -> None:
    stream = client.chat.completions.create(
        model=model_id(engine), messages=user(QUESTIONS[2]), temperature=0, max_tokens=40,
        stream=True, user="alice")
    seen = set()
    for chunk in stream:
        seen.update(s for s in engine.snapshot().sessions if s.startswith("API"))
        del chunk
    assert "API · alice" in seen
    chat(client, engine, QUESTIONS[3], temperature=0, max_tokens=4)
    assert "API" in engine.snapshot().sessions


# ---- errors -------------------------------------------------------------------------------


def test_a_missing_or_wrong_key_gets_401(server, engine) -> None:
    status, body = raw(server, "/v1/models", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.url, api_key=KEY + "x", timeout=TIMEOUT_S,
                        max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        chat(bad, engine, "hi", max_tokens=2)
    status, _ = raw(server, "/v1/chat/completions", {"messages": user("hi")}, key="")
    assert status == 401


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 50}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
        ({"seed": "x"}, "seed"),
        ({"extra_body": {"repetition_context_size": 0}}, "repetition_context_size"),
        ({"stream": "yes"}, "stream"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ],
)
def test_bad_parameters_get_400_naming_the_parameter(client, engine, fields, param) -> None:
    body = {"model": model_id(engine), "messages": user("hi"), **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**body)
    error = caught.value.body
    assert error["param"] == param, error
    assert error["message"] and error["type"] == "invalid_request_error"


def test_unknown_fields_are_ignored(client, engine) -> None:
    reply = chat(client, engine, QUESTIONS[3], temperature=0, max_tokens=6,
                 extra_body={"some_future_field": {"x": 1}, "top_k": 0})
    assert reply.choices[0].message.content


def test_unknown_model_and_path_get_404(client, server) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-9", messages=user("hi"))
    assert caught.value.body["param"] == "model"
    status, body = raw(server, "/v1/embeddings", {"input": "x"})
    assert status == 404 and "error" in body


def test_an_over_long_prompt_gets_400_and_the_others_go_on(client, engine) -> None:
    expected = chat(client, engine, QUESTIONS[4], temperature=0, max_tokens=24)
    stream = client.chat.completions.create(
        model=model_id(engine), messages=user(QUESTIONS[4]), temperature=0, max_tokens=24,
        stream=True)
    chunks = iter(stream)
    first = next(chunks)
    huge = "lorem ipsum " * engine.model_info.max_context
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, engine, huge, max_tokens=4)
    assert caught.value.body["param"] == "messages"
    assert caught.value.body["code"] == "context_length_exceeded"
    text = "".join(c.delta.content or "" for chunk in [first, *chunks] for c in chunk.choices)
    assert text == expected.choices[0].message.content


def test_a_body_over_the_size_limit_gets_413(server) -> None:
    body = json.dumps({"messages": user("x" * (ServerOptions(KEY).max_request_bytes + 10))})
    status, error = raw(server, "/v1/chat/completions", body.encode())
    assert status == 413 and error["error"]["code"] == "request_too_large"


def test_requests_beyond_the_concurrency_limit_get_429(engine) -> None:
    with running_server(engine, max_concurrent=1) as thread:
        client = openai_client(thread)
        stream = client.chat.completions.create(
            model=model_id(engine), messages=user(QUESTIONS[5]), temperature=0,
            max_tokens=400, stream=True)
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as caught:
            chat(client, engine, "hi", max_tokens=2)
        assert caught.value.response.headers.get("retry-after")
        stream.close()
        wait_until(lambda: thread.app.state.pagedchat.in_flight == 0, timeout=60)
        assert chat(client, engine, "hi", temperature=0, max_tokens=2).choices


def test_an_engine_that_is_not_ready_gets_503() -> None:
    thread = ServerThread(create_app(lambda: None, ServerOptions(api_key=KEY)))
    thread.start()
    try:
        status, body = raw(thread, "/v1/models")
        assert status == 503 and body["error"]["code"] == "engine_unavailable"
        status, body = raw(thread, "/health", key=None)
        assert status == 503 and body["status"] == "stopped"
    finally:
        thread.stop()


def test_health_needs_no_key_and_reports_the_model(server, engine) -> None:
    status, body = raw(server, "/health", key=None)
    assert (status, body) == (200, {"status": "ok", "model": model_id(engine)})


# ---- the network ---------------------------------------------------------------------------


def _non_loopback_address() -> str | None:
    """This machine's address on its default route (no packet is sent), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_by_default_nothing_listens_beyond_loopback(server) -> None:
    assert server.host == "127.0.0.1"
    assert server.url.startswith("http://127.0.0.1:")
    address = _non_loopback_address()
    if address is not None:
        with pytest.raises(OSError), socket.create_connection((address, server.port), 5):
            pass
    with socket.create_connection(("127.0.0.1", server.port), 5):
        pass


def test_stopping_the_server_ends_an_open_stream_with_a_final_chunk(engine) -> None:
    """The in-app stop (and the app quitting): the stream ends cleanly, then the port closes."""
    stopper = None
    with running_server(engine) as thread:
        client = openai_client(thread)
        stream = client.chat.completions.create(
            model=model_id(engine), messages=user("Write a very long story about a comet."),
            temperature=0, max_tokens=2000, stream=True, user="stopped")
        finishes = []
        for chunk in stream:
            finishes.extend(c.finish_reason for c in chunk.choices)
            if len(finishes) == 3:
                stopper = threading.Thread(target=thread.stop)
                stopper.start()
        assert finishes[-1] == "cancelled" and not any(finishes[:-1])
        stopper.join(60)
        assert not thread.running
        with pytest.raises(openai.APIConnectionError):
            client.models.list()
        wait_until(lambda: session_blocks(engine, "API · stopped") == 0, timeout=30)
