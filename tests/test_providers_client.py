"""The Qt-free provider layer against real HTTP servers on loopback: the fault server for every
failure the issue names, and mlx-lm's own `mlx_lm.server` (a server nobody here wrote) and
`pagedchat serve` for real streaming, stop and n. Every reply must keep the text that arrived
and say what went wrong; the API key must never reach the database, settings or any text."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import openai
import pytest

from app.core.providers import ProviderRegistry
from app.core.providers.client import check_connection, list_models, stream_chat
from app.core.providers.records import Provider
from app.core.store import DB_NAME, Store
from engine import FinalEvent, FinishReason, SamplingParams, TokenEvent
from engine.models.default_model import converted_folder
from tests.provider_servers import FaultServer, free_port, mlx_lm_server, pagedchat_serve

KEY = "sk-test-Zq8vN3-secret-key"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture
def faults():
    with FaultServer(api_key=KEY) as server:
        yield server


def provider(url: str, timeout_s: float = 20.0) -> Provider:
    return Provider(id="p1", name="Test server", base_url=url, timeout_s=timeout_s)


def run(coro_fn, *args, stop_at_first_token=False):
    """Stream one reply; with stop_at_first_token, cancel it (the user's stop) once the
    first piece of text has arrived."""
    events: list = []
    first = threading.Event()

    def emit(event):
        events.append(event)
        if isinstance(event, TokenEvent):
            first.set()

    async def main():
        task = asyncio.ensure_future(coro_fn(*args, emit))
        if stop_at_first_token:
            await asyncio.to_thread(first.wait, 300)
            task.cancel()
        await asyncio.wait_for(task, 120)

    asyncio.run(main())
    return events


def finals(events) -> dict[int, FinalEvent]:
    out = {e.index: e for e in events if isinstance(e, FinalEvent)}
    assert len(out) == len([e for e in events if isinstance(e, FinalEvent)]), "one final each"
    return out


def chat(p: Provider, model: str, text: str, params=GREEDY, key=KEY, stop=False,
         system: str = ""):
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]
    return run(stream_chat, p, key, model, messages, params, "chat-1", "req-1",
               stop_at_first_token=stop)


# ---- the fault server ------------------------------------------------------------------------

def test_streams_tokens_then_one_final_with_usage_and_maps_sampling(faults):
    params = SamplingParams(temperature=0.5, top_p=0.8, max_tokens=33, seed=7, stop=("END",),
                            repetition_penalty=1.2, repetition_context_size=96)
    events = chat(provider(faults.url), "echo", "one two three", params, system="Be brief.")
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert "".join(t.text for t in tokens) == "one two three"
    assert all((t.session_id, t.request_id) == ("chat-1", "req-1") for t in tokens)
    [final] = finals(events).values()
    assert events[-1] is final and final.finish_reason == FinishReason.STOP
    assert final.text == "one two three" and final.error is None
    assert (final.usage.prompt_tokens, final.usage.cached_prompt_tokens,
            final.usage.generated_tokens) == (7, 3, 3)
    body = faults.requests[-1]
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"],
            body["stop"], body["repetition_penalty"], body["repetition_context_size"]) == (
        0.5, 0.8, 33, 7, ["END"], 1.2, 96)
    assert body["stream"] is True and "n" not in body
    assert faults.auth_headers[-1] == f"Bearer {KEY}"


def test_n_in_one_request_where_the_server_honours_it(faults):
    events = chat(provider(faults.url), "echo", "a b", SamplingParams(n=3))
    done = finals(events)
    assert {i: f.text for i, f in done.items()} == {k: f"a#{k} b#{k}" for k in range(3)}
    assert len(faults.requests) == 1 and faults.requests[0]["n"] == 3


def test_n_one_by_one_where_the_server_ignores_it():
    with FaultServer(honour_n=False) as server:
        events = chat(provider(server.url), "echo", "a b", SamplingParams(n=3), key=None)
        assert {i: f.text for i, f in finals(events).items()} == {k: "a b" for k in range(3)}
        assert [r.get("n") for r in server.requests] == [3, None, None]


def test_401_says_the_key_was_refused_and_never_shows_it(faults):
    [final] = finals(chat(provider(faults.url), "echo", "hi", key="sk-wrong-key-123")).values()
    assert final.finish_reason == FinishReason.ERROR and final.text == ""
    assert "401" in final.error and "key" in final.error
    assert "sk-wrong-key-123" not in final.error


def test_403_404_and_500_are_named(faults):
    p = provider(faults.url)
    forbidden = finals(chat(p, "forbidden", "hi"))[0].error
    missing = finals(chat(p, "no-such-model", "hi"))[0].error
    broken = finals(chat(p, "broken", "hi"))[0].error
    assert "403" in forbidden and "may not use" in forbidden
    assert "404" in missing and "no-such-model" in missing
    assert "500" in broken and "crashed" in broken


def test_429_waits_as_retry_after_asks_then_answers(faults):
    start = time.perf_counter()
    [final] = finals(chat(provider(faults.url), "limited-once", "fine now")).values()
    assert final.text == "fine now" and final.finish_reason == FinishReason.STOP
    assert time.perf_counter() - start >= 1.0  # Retry-After: 1
    assert len(faults.requests) == 2


def test_429_for_good_says_how_long_the_server_asked_to_wait(faults):
    [final] = finals(chat(provider(faults.url), "limited", "hi")).values()
    assert final.finish_reason == FinishReason.ERROR
    assert "429" in final.error and "1 s" in final.error
    assert len(faults.requests) == 3  # the first try and two retries


def test_a_stream_cut_mid_reply_keeps_the_text_and_says_so(faults):
    events = chat(provider(faults.url), "cut", "alpha beta gamma delta")
    [final] = finals(events).values()
    assert final.finish_reason == FinishReason.ERROR
    assert final.text == "alpha beta"  # what arrived before the cut
    assert "mid-reply" in final.error and "kept" in final.error


def test_a_server_that_never_answers_times_out(faults):
    [final] = finals(chat(provider(faults.url, timeout_s=0.5), "hang", "hi")).values()
    assert final.finish_reason == FinishReason.ERROR and "timeout" in final.error


def test_an_unreachable_host_and_a_tls_failure_are_named(faults):
    closed = finals(chat(provider(f"http://127.0.0.1:{free_port()}/v1"), "echo", "hi"))[0]
    assert closed.finish_reason == FinishReason.ERROR and "Cannot reach" in closed.error
    tls = finals(chat(provider(faults.url.replace("http://", "https://")), "echo", "hi"))[0]
    assert tls.finish_reason == FinishReason.ERROR and "TLS" in tls.error


def test_stop_closes_the_stream_and_keeps_the_partial_text(faults):
    events = chat(provider(faults.url), "held", "first second third", stop=True)
    [final] = finals(events).values()
    assert final.finish_reason == FinishReason.CANCELLED and final.text == "first"
    assert faults.held_closed.wait(10), "the server never saw the stream close"


def test_models_list_and_connection_test(faults):
    p = provider(faults.url)
    assert asyncio.run(list_models(p, KEY)) == sorted(
        ["echo", "limited-once", "limited", "broken", "forbidden", "cut", "hang", "held"])
    ok, text, models = asyncio.run(check_connection(p, KEY))
    assert ok and "8 model(s)" in text and "echo" in models
    ok, text, models = asyncio.run(check_connection(p, "sk-bad"))
    assert not ok and "401" in text and models == []


def test_the_key_is_only_in_the_keychain(app_env, faults, caplog):
    import keyring

    caplog.set_level(logging.DEBUG)
    store = Store(app_env)
    registry = ProviderRegistry(store)
    p = registry.add("Team vLLM", faults.url.removesuffix("/v1"), key=KEY)
    assert p.base_url == faults.url
    assert keyring.get_password("PagedChat", p.key_user) == KEY
    assert registry.key(p) == KEY
    errors = [finals(chat(p, m, "hi", key=registry.key(p)))[0].error
              for m in ("broken", "no-such-model")]
    errors.append(finals(chat(p, "echo", "hi", key=KEY + "x"))[0].error)
    registry.set_models(p.id, asyncio.run(list_models(p, registry.key(p))))
    store.close()
    again = ProviderRegistry(Store(app_env))
    assert again.get(p.id).models and again.key(again.get(p.id)) == KEY
    blob = b"".join(f.read_bytes() for f in app_env.rglob("*") if f.is_file())
    assert (app_env / DB_NAME).exists() and KEY.encode() not in blob
    assert KEY not in caplog.text and all(KEY not in e for e in errors)
    again.remove(p.id)
    assert keyring.get_password("PagedChat", p.key_user) is None


def test_bad_provider_input_gets_a_message(app_env):
    registry = ProviderRegistry(Store(app_env))
    for name, url, words in [("", "http://x", "name"), ("A", "ftp://x", "http"),
                             ("A", "http://", "host"), ("A", "http://h:99999", "port")]:
        with pytest.raises(ValueError, match=words):
            registry.add(name, url)
    assert registry.providers() == []


# ---- real servers ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlx_server(tmp_path_factory):
    child, url = mlx_lm_server(converted_folder(quantized=False),
                               tmp_path_factory.mktemp("hf") / "hub")
    with child:
        yield url


@pytest.fixture(scope="module")
def pagedchat_server():
    child, url = pagedchat_serve(KEY)
    with child:
        yield url


def reference_reply(url: str, key: str | None, model: str, text: str) -> str:
    """The server's own non-streamed greedy reply, through the plain sync client."""
    client = openai.OpenAI(base_url=url, api_key=key or "none", max_retries=0, timeout=300)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], temperature=0.0,
        max_tokens=GREEDY.max_tokens)
    return reply.choices[0].message.content


@pytest.mark.model
@pytest.mark.parametrize("which", ["mlx_lm", "pagedchat"])
def test_real_servers_stream_stop_and_n(which, request):
    url = request.getfixturevalue("mlx_server" if which == "mlx_lm" else "pagedchat_server")
    key = KEY if which == "pagedchat" else None
    p = provider(url, timeout_s=300)
    [model] = asyncio.run(list_models(p, key))[:1]
    question = "What is the capital of France?"
    events = chat(p, model, question, key=key)
    [final] = finals(events).values()
    assert final.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), final.error
    assert final.text == "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert final.text == reference_reply(url, key, model, question)
    assert "Paris" in final.text
    assert final.usage.generated_tokens > 0
    # n = 2 (pagedchat honours it; mlx_lm.server streams one, the second comes alone)
    two = finals(chat(p, model, question, SamplingParams(temperature=0.0, max_tokens=8, n=2),
                      key=key))
    assert sorted(two) == [0, 1] and two[0].text and two[0].text == two[1].text  # greedy
    # stop mid-reply: the stream closes and the text so far is kept
    events_stop = chat(p, model, "Count from one to fifty.",
                       SamplingParams(temperature=0.0, max_tokens=64), key=key, stop=True)
    [stopped] = finals(events_stop).values()
    assert stopped.finish_reason == FinishReason.CANCELLED and stopped.text
    assert stopped.text == "".join(e.text for e in events_stop if isinstance(e, TokenEvent))
