"""One parsed request -> one engine request -> one OpenAI response body, without HTTP.

The one code path from a chat-completions / completions body to the engine and back: the
HTTP endpoints (routes.py) and batch jobs (batch.py) both go through ``submit_parsed``, so a
batch line's response body is exactly what the endpoint would have answered (the same
prompt, the same SamplingParams, the same ``Reply``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from dataclasses import dataclass

from app.core.model_names import model_id
from app.core.tool_calls import ToolPrompt, chat_prompt
from app.server.errors import APIError
from app.server.params import ParsedRequest, with_max_tokens
from app.server.streaming import Reply
from app.server.tools import CallSplitter, call_constraint
from engine import Engine, FinalEvent, FinishReason, Priority, RequestHandle

_Prompt = ToolPrompt  # the prompt and how its reply writes calls (app/core/tool_calls.py)


@dataclass
class Submitted:
    """A request handed to the engine: its handle, the Reply that turns its events into
    OpenAI objects, and the request parameter its prompt errors name."""

    handle: RequestHandle
    reply: Reply
    param: str


def check_model(engine: Engine, aliases: tuple[str, ...], requested: str | None) -> None:
    """A 404 unless ``requested`` (a request's ``model``) names the served model."""
    if requested is None:
        return
    # its id, and the engine's own name (what the server answered to before)
    known = (model_id(engine.model_info.name), engine.model_info.name, *aliases)
    if requested not in known:
        raise APIError(404, f"the model {requested!r} does not exist on this server; it "
                       f"serves {model_id(engine.model_info.name)!r}", param="model",
                       code="model_not_found")


def _chat_prompt(engine: Engine, parsed: ParsedRequest) -> _Prompt:
    """The chat's prompt, with its tools (shared with the app's chats)."""
    return chat_prompt(engine, parsed.messages, parsed.raw_messages or [], parsed.tool_use)


async def _prompt_tokens(engine: Engine, parsed: ParsedRequest) -> _Prompt:
    if parsed.prompt_tokens is not None:
        return _Prompt(parsed.prompt_tokens)
    try:
        if parsed.messages is not None:
            return await asyncio.to_thread(_chat_prompt, engine, parsed)
        return _Prompt(await asyncio.to_thread(engine.encode, parsed.prompt_text))
    except Exception as exc:
        param = "messages" if parsed.messages is not None else "prompt"
        raise APIError(400, f"the {param} could not be tokenised for this model: {exc}",
                       param=param, code="invalid_value") from exc


async def submit_parsed(engine: Engine, parsed: ParsedRequest, chat: bool, session_id: str,
                        priority: Priority = Priority.BACKGROUND) -> Submitted:
    """Tokenise, check the context limit, fill in max_tokens and submit; APIError when the
    request cannot run (the message says why, the param says where)."""
    prompt = await _prompt_tokens(engine, parsed)
    tokens = prompt.tokens
    limit = engine.model_info.max_context
    param = "messages" if chat else "prompt"
    if len(tokens) >= limit:
        raise APIError(400, f"the prompt is {len(tokens)} tokens but this model's context "
                       f"limit is {limit}: shorten it", param=param,
                       code="context_length_exceeded")
    params = with_max_tokens(parsed, len(tokens), limit)
    use = parsed.tool_use
    if use is not None and use.forced:
        if params.constraint is not None:
            raise APIError(400, "response_format cannot be combined with a required tool call",
                           param="response_format", code="invalid_value")
        params = dataclasses.replace(params, constraint=call_constraint(
            use, prompt.syntax.start, prompt.syntax.end))
    submit = functools.partial(engine.submit, prompt_tokens=tokens, params=params,
                               session_id=session_id, priority=priority)
    if params.constraint is None:
        handle = submit()
    else:  # compiling a grammar takes a moment (the first one builds the tokenizer's side)
        try:
            handle = await asyncio.to_thread(submit)
        except ValueError as exc:
            param = "tools" if use is not None and use.forced else "response_format"
            raise APIError(400, str(exc), param=param, code="invalid_value") from exc
    reply = Reply(chat=chat, model=model_id(engine.model_info.name), n=params.n,
                  token_text=lambda token: engine.decode([token]),
                  splitter=(None if prompt.syntax is None else
                            functools.partial(CallSplitter, prompt.syntax, list(use.tools))),
                  include_usage=parsed.include_usage)
    return Submitted(handle, reply, param)


def check_first(first: object, param: str) -> None:
    """A request the engine refused before generating anything: its APIError."""
    if isinstance(first, FinalEvent) and first.finish_reason == FinishReason.ERROR \
            and first.usage.generated_tokens == 0:
        raise engine_error(first, param)


async def collect(reply: Reply, first, events) -> None:
    reply.event_chunks(first)
    async for event in events:
        reply.event_chunks(event)


def body_of(reply: Reply) -> dict:
    """The whole response body, or the APIError of a sample that failed."""
    error = reply.error()
    if error is not None:
        raise APIError(500, error, code="generation_failed")
    return reply.body()


async def answer(submitted: Submitted) -> dict:
    """Read a submitted request to its end: its response body (a non-streaming request's)."""
    events = submitted.handle.stream()
    try:
        first = await events.__anext__()
        check_first(first, submitted.param)
        await collect(submitted.reply, first, events)
        return body_of(submitted.reply)
    finally:
        if not submitted.handle.done:
            submitted.handle.cancel()
        await events.aclose()


def engine_error(final: FinalEvent, param: str) -> APIError:
    message = final.error or "the request failed"
    if message.startswith(("generation failed", "engine error")):
        return APIError(500, message, code="generation_failed")
    if "context limit" in message:
        return APIError(400, message, param=param, code="context_length_exceeded")
    return APIError(400, message, param=param, code="invalid_value")
