"""Talking to an OpenAI-compatible server through the official `openai` async client.

A remote reply is streamed as the engine's own events (TokenEvent / FinalEvent carrying the
chat's session id and the request id), so ChatSession handles a remote chat exactly as a
local one: the same display, stop, regenerate with n, error statuses. Every failure becomes
one FinalEvent per unfinished sample with a message for the user and the text received so
far (never lost); the API key is scrubbed out of any text that could reach the user.

n > 1 is asked of the server in one request; a server that ignores n (it streams only
choice 0) or refuses it (400) gets the missing samples one by one. The client's own retry
honours `Retry-After` on 429 and 5xx (up to its 60 s cap); when retries run out, the error
says how long the server asked to wait.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from typing import Any

import openai

from app.core.providers.records import Provider
from engine import (
    DEFAULT_REPETITION_CONTEXT,
    FinalEvent,
    FinishReason,
    SamplingParams,
    TokenEvent,
    Usage,
)

MAX_RETRIES = 2
Emit = Callable[[Any], None]


def make_client(provider: Provider, key: str | None, max_retries: int = MAX_RETRIES
                ) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=provider.base_url,
        api_key=key or "none",  # servers without auth ignore it; the client insists on one
        timeout=provider.timeout_s,
        max_retries=max_retries,
    )


def scrub(text: str, key: str | None) -> str:
    return text.replace(key, "•••") if key else text


def _chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _server_message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        err = body.get("error", body)
        msg = err.get("message") if isinstance(err, dict) else err
        if isinstance(msg, str) and msg.strip():
            return msg.strip()
        if isinstance(body.get("detail"), str):
            return body["detail"]
    text = getattr(exc.response, "text", "") or ""
    return text.strip()[:200] or exc.response.reason_phrase or ""


def describe_error(exc: BaseException, provider: Provider, model: str = "",
                   key: str | None = None) -> str:
    """One sentence for the user about a failed request (no key, no traceback)."""
    where = f"{provider.name} ({provider.base_url})"
    if isinstance(exc, openai.APITimeoutError):
        msg = f"{where} did not answer within {provider.timeout_s:g} s (timeout)."
    elif isinstance(exc, openai.APIConnectionError):
        causes = _chain(exc)
        if any(isinstance(c, ssl.SSLError) for c in causes):
            detail = next(str(c) for c in causes if isinstance(c, ssl.SSLError))
            msg = f"TLS failure talking to {where}: {detail}"
        else:
            detail = next((str(c) for c in causes[1:] if str(c)), "connection failed")
            msg = f"Cannot reach {where}: {detail}."
    elif isinstance(exc, openai.AuthenticationError):
        msg = (f"{where} refused the API key (401). Check the key in Settings ▸ Providers."
               f" {_server_message(exc)}")
    elif isinstance(exc, openai.PermissionDeniedError):
        msg = f"{where} denied access (403): {_server_message(exc)}"
    elif isinstance(exc, openai.NotFoundError):
        name = f"“{model}”" if model else "that model"
        msg = (f"{where} does not know the model {name} (404). Refresh its model list in"
               f" Settings ▸ Providers. {_server_message(exc)}")
    elif isinstance(exc, openai.RateLimitError):
        wait = exc.response.headers.get("retry-after")
        after = f" It asked to wait {wait} s before retrying." if wait else ""
        msg = f"{where} is rate-limiting requests (429), still after retrying.{after}"
    elif isinstance(exc, openai.APIStatusError):
        code = exc.status_code
        kind = "failed" if code >= 500 else "refused the request"
        msg = f"{where} {kind} ({code}): {_server_message(exc)}"
    elif isinstance(exc, openai.APIError):
        msg = f"{where} reported an error: {exc.message}"
    elif isinstance(exc, ValueError):  # json.JSONDecodeError and the like
        msg = f"{where} sent an answer that is not valid JSON; is it an OpenAI-compatible server?"
    else:
        # the exception's words, never its class name ("ConnectError" is jargon)
        msg = f"Talking to {where} failed: {str(exc).strip() or 'an unexpected error'}"
    return scrub(msg.strip(), key)


async def list_models(provider: Provider, key: str | None) -> list[str]:
    """The model ids the server lists at /v1/models (raises the client's errors)."""
    async with make_client(provider, key, max_retries=0) as client:
        page = await client.models.list()
        return sorted(m.id for m in page.data)


async def check_connection(provider: Provider, key: str | None) -> tuple[bool, str, list[str]]:
    """(ok, a sentence for the user, the models) for the Settings connection test."""
    start = time.perf_counter()
    try:
        models = await list_models(provider, key)
    except Exception as exc:
        return False, describe_error(exc, provider, key=key), []
    ms = (time.perf_counter() - start) * 1000
    if not models:
        return True, f"Connected in {ms:.0f} ms, but the server lists no models.", []
    shown = ", ".join(models[:3]) + (", …" if len(models) > 3 else "")
    return True, f"Connected in {ms:.0f} ms: {len(models)} model(s) ({shown}).", models


def request_body(messages: list[dict[str, str]], model: str, params: SamplingParams,
                 n: int) -> dict[str, Any]:
    """The chat's system prompt and sampling as OpenAI chat-completion arguments.

    top_k, min_p, repetition_penalty and repetition_context_size are not OpenAI parameters;
    servers built on vLLM or mlx-lm read them from the body, so they go as extra fields, and
    only when not neutral (a strict hosted API then never sees them).
    """
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_tokens,
    }
    if n > 1:
        body["n"] = n
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    extra = {}
    if params.top_k:
        extra["top_k"] = params.top_k
    if params.min_p:
        extra["min_p"] = params.min_p
    if params.repetition_penalty != 1.0:
        extra["repetition_penalty"] = params.repetition_penalty
        if params.repetition_context_size != DEFAULT_REPETITION_CONTEXT:
            extra["repetition_context_size"] = params.repetition_context_size
    if extra:
        body["extra_body"] = extra
    return body


_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH,
            "tool_calls": FinishReason.STOP, "content_filter": FinishReason.STOP}


class _Sample:
    def __init__(self) -> None:
        self.text = ""
        self.chunks = 0
        self.first: float | None = None
        self.finish: FinishReason | None = None


async def stream_chat(
    provider: Provider,
    key: str | None,
    model: str,
    messages: list[dict[str, str]],
    params: SamplingParams,
    session_id: str,
    request_id: str,
    emit: Emit,
) -> None:
    """Stream one reply (params.n samples) as engine events through `emit`.

    Returns when every sample has had its FinalEvent. Cancelling the task closes the HTTP
    stream and ends the unfinished samples as CANCELLED with their partial text.
    """
    n = params.n
    samples = {i: _Sample() for i in range(n)}
    start = time.perf_counter()
    usage: dict[str, int] = {}
    done: set[int] = set()  # samples whose FinalEvent went out

    def final(i: int, reason: FinishReason, error: str | None = None) -> None:
        s = samples[i]
        s.finish = reason
        done.add(i)
        now = time.perf_counter()
        ttft = (s.first - start) if s.first is not None else None
        generated = usage.get("completion_tokens", s.chunks) if n == 1 else s.chunks
        decode_s = now - (s.first if s.first is not None else now)
        emit(FinalEvent(
            request_id=request_id, session_id=session_id, index=i, finish_reason=reason,
            text=s.text,
            usage=Usage(
                prompt_tokens=usage.get("prompt_tokens", 0),
                cached_prompt_tokens=usage.get("cached_tokens", 0),
                generated_tokens=generated,
                time_to_first_token_s=ttft,
                total_time_s=now - start,
                decode_tokens_per_s=(max(generated - 1, 0) / decode_s) if decode_s > 0 else 0.0,
            ),
            error=error,
        ))

    async def one_stream(client: openai.AsyncOpenAI, indices: list[int]) -> None:
        """One request serving `indices` (all of them when the server honours n)."""
        body = request_body(messages, model, params, len(indices))
        stream = await client.chat.completions.create(**body)
        try:
            async for chunk in stream:
                if chunk.usage is not None:
                    usage["prompt_tokens"] = chunk.usage.prompt_tokens or 0
                    usage["completion_tokens"] = chunk.usage.completion_tokens or 0
                    details = getattr(chunk.usage, "prompt_tokens_details", None)
                    cached = getattr(details, "cached_tokens", None) if details else None
                    usage["cached_tokens"] = cached or 0
                for choice in chunk.choices:
                    if not 0 <= choice.index < len(indices):
                        continue
                    s = samples[indices[choice.index]]
                    piece = choice.delta.content if choice.delta else None
                    if piece:
                        if s.first is None:
                            s.first = time.perf_counter()
                        s.text += piece
                        s.chunks += 1
                        emit(TokenEvent(request_id=request_id, session_id=session_id,
                                        index=indices[choice.index], text=piece, token_ids=()))
                    if choice.finish_reason:
                        s.finish = _REASONS.get(choice.finish_reason, FinishReason.STOP)
        finally:
            await stream.close()

    def unfinished(error: str | None, reason: FinishReason) -> None:
        for i, s in samples.items():
            if i in done:
                continue
            if s.finish is not None and reason != FinishReason.CANCELLED:
                final(i, s.finish)  # the server finished this one before the failure
            elif reason == FinishReason.CANCELLED:
                final(i, reason)
            elif s.text:
                final(i, reason, f"The connection to {provider.name} broke mid-reply"
                      f" ({error}): the text so far is kept.")
            else:
                final(i, reason, error)

    client = make_client(provider, key)
    try:
        try:
            await one_stream(client, list(range(n)))
        except openai.BadRequestError:
            if n == 1 or any(s.chunks for s in samples.values()):
                raise
        # a server that ignored (or refused) n: the samples it did not send, one by one
        for i in range(1, n):
            if samples[i].chunks == 0 and samples[i].finish is None:
                await one_stream(client, [i])
        for i, s in samples.items():
            if s.finish is not None:
                final(i, s.finish)
            else:
                final(i, FinishReason.ERROR, (
                    f"The stream from {provider.name} ended before the reply was finished:"
                    " the text so far is kept." if s.text else
                    f"{provider.name} sent no reply."))
    except asyncio.CancelledError:
        unfinished(None, FinishReason.CANCELLED)
    except Exception as exc:
        unfinished(describe_error(exc, provider, model, key), FinishReason.ERROR)
    finally:
        await client.close()
