"""OpenAI request bodies -> what the engine takes: messages or token ids, and SamplingParams.

The engine's own ``SamplingParams`` is the one validator of sampling values (its ValueError
names the field); this module only checks JSON types, maps the OpenAI field names onto it and
turns its messages into 400 errors naming the request's parameter. Fields it does not know
are ignored, as OpenAI-compatible servers do; fields it knows but cannot honour are refused
with a message, never silently dropped.

Beam search (docs/ARCHITECTURE.md §6.4): ``best_of`` above 1 is the beam width, and the ``n``
best beams are the choices (OpenAI's ``best_of`` ranks its candidates the same way, by
log-probability); vLLM's ``use_beam_search: true`` asks for it explicitly (its width is
``best_of``, else ``n``), with its ``length_penalty`` and ``early_stopping``. There is no
sampled best-of: ``use_beam_search: false`` with ``best_of`` above 1 is refused. A beam
search is greedy (a missing temperature means 0, any other is refused) and cannot stream.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from app.server.errors import APIError
from app.server.tools import ToolUse, parse_tools
from engine import DEFAULT_REPETITION_CONTEXT, MAX_BEAM_WIDTH, Constraint, SamplingParams

MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI's
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs, as OpenAI's
ROLES = ("system", "developer", "user", "assistant", "tool")

_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


@dataclass(frozen=True)
class ParsedRequest:
    """One validated request: exactly one of ``messages`` / ``prompt_text`` / ``prompt_tokens``."""

    params: SamplingParams
    stream: bool
    include_usage: bool
    user: str | None
    model: str | None
    max_tokens_given: bool
    messages: list[dict] | None = None
    prompt_text: str | None = None
    prompt_tokens: list[int] | None = None
    #: chat only: the messages as sent (their tool calls and results) and the tools
    raw_messages: list | None = None
    tool_use: ToolUse | None = None


def parse_chat(body: Any) -> ParsedRequest:
    body = _object(body)
    messages = _messages(body.get("messages"))
    return _common(body, logprobs=_chat_logprobs(body), messages=messages,
                   raw_messages=body["messages"], tool_use=parse_tools(body))


def parse_completion(body: Any) -> ParsedRequest:
    body = _object(body)
    for name in ("echo",):
        if body.get(name):
            raise _unsupported(name)
    if body.get("suffix"):
        raise _unsupported("suffix")
    if body.get("tools"):
        raise _unsupported("tools")  # a chat feature: /v1/chat/completions takes them
    text, tokens = _prompt(body.get("prompt"))
    logprobs = _integer(body, "logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise APIError(400, f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}], "
                       f"got {logprobs}", param="logprobs", code="invalid_value")
    return _common(body, logprobs=logprobs, prompt_text=text, prompt_tokens=tokens)


def _chat_logprobs(body: dict) -> int | None:
    """Chat's ``logprobs`` (true/false) and ``top_logprobs`` (0-20, needs logprobs)."""
    wanted = _boolean(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None)
    if top is not None and not wanted:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs",
                       code="invalid_value")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                       f"got {top}", param="top_logprobs", code="invalid_value")
    return (top or 0) if wanted else None


def _common(body: dict, logprobs: int | None = None, **prompt: Any) -> ParsedRequest:
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, 0.0)
        if value != 0.0:
            raise APIError(
                400,
                f"{name} is not supported by PagedChat's engine; send 0 (or leave it out) and "
                "use repetition_penalty (a multiplicative penalty, 1.0 = off) instead",
                param=name,
                code="unsupported_parameter",
            )
    if body.get("logit_bias"):
        raise _unsupported("logit_bias")
    constraint = _response_format(body.get("response_format"))

    stream = _boolean(body, "stream", False)
    beam = _beam_search(body, stream)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options")
    include_usage = bool(options and _boolean(options, "include_usage", False, "stream_options"))

    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else (
        "max_tokens"
    )
    max_tokens = _integer(body, max_name, None)
    values: dict[str, Any] = {
        # a beam search is greedy: without a temperature, 0 (any other is refused by name)
        "temperature": _number(body, "temperature", 0.0 if beam else 1.0),
        "top_p": _number(body, "top_p", 1.0),
        "top_k": _integer(body, "top_k", 0),
        "min_p": _number(body, "min_p", 0.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0),
        "repetition_context_size": _integer(body, "repetition_context_size",
                                            DEFAULT_REPETITION_CONTEXT),
        "n": _integer(body, "n", 1),
        "seed": _integer(body, "seed", None),
        "stop": _stop(body.get("stop")),
        # A placeholder until the prompt's length is known (see with_max_tokens).
        "max_tokens": max_tokens if max_tokens is not None else 1,
        "constraint": constraint,
        "logprobs": logprobs,
        **beam,
    }
    try:
        params = SamplingParams(**values)
    except (ValueError, TypeError) as exc:
        param = _param_of(str(exc), max_name)
        message = str(exc).replace("beam_width", "best_of")  # the API's name for the width
        raise APIError(400, message, param=param, code="invalid_value") from exc
    user = body.get("user")
    model = body.get("model")
    return ParsedRequest(
        params=params,
        stream=stream,
        include_usage=include_usage,
        user=user if isinstance(user, str) and user.strip() else None,
        model=model if isinstance(model, str) else None,
        max_tokens_given=max_tokens is not None,
        **prompt,
    )


def _beam_search(body: dict, stream: bool) -> dict[str, Any]:
    """The beam search fields of SamplingParams the request asks for ({} for none): see the
    module's docstring for how ``best_of`` and ``use_beam_search`` read."""
    n = _integer(body, "n", 1)
    best_of = _integer(body, "best_of", None)
    wanted = body.get("use_beam_search")
    if wanted is not None and not isinstance(wanted, bool):
        raise APIError(400, f"use_beam_search must be true or false, got {wanted!r}",
                       param="use_beam_search", code="invalid_type")
    if best_of is not None and not 1 <= best_of <= MAX_BEAM_WIDTH:
        raise APIError(400, f"best_of must be an integer in [1, {MAX_BEAM_WIDTH}] (the beam "
                       f"search's width; 1 turns it off), got {best_of}", param="best_of",
                       code="invalid_value")
    if best_of is not None and n is not None and best_of < n:
        raise APIError(400, f"best_of must be at least n: the {n} choices are the best of "
                       f"best_of beams, got best_of={best_of}", param="best_of",
                       code="invalid_value")
    if wanted is False and best_of is not None and best_of > 1:
        raise APIError(400, "best_of above 1 runs beam search on this server (there is no "
                       "sampled best-of): leave use_beam_search out or send true",
                       param="best_of", code="unsupported_value")
    width = best_of if best_of is not None else (n or 1) if wanted else 1
    if wanted and width < 2:
        raise APIError(400, "use_beam_search needs best_of (or n) of 2 or more: the beam "
                       "search's width", param="best_of", code="invalid_value")
    if width < 2:
        return {}
    if stream:
        raise APIError(400, "best_of (beam search) cannot be streamed: the choices are known "
                       "only when the search ends; send stream false", param="stream",
                       code="unsupported_value")
    out: dict[str, Any] = {"beam_width": width}
    length_penalty = _number(body, "length_penalty", None)
    if length_penalty is not None:
        out["length_penalty"] = length_penalty
    early = body.get("early_stopping")
    if early is not None:
        if not (isinstance(early, bool) or early == "never"):
            raise APIError(400, f"early_stopping must be true, false or \"never\", got "
                           f"{early!r}", param="early_stopping", code="invalid_value")
        out["early_stopping"] = early
    return out


def with_max_tokens(request: ParsedRequest, prompt_len: int, max_context: int) -> SamplingParams:
    """The request's params with max_tokens filled in: without one, up to the context limit."""
    if request.max_tokens_given:
        return request.params
    return dataclasses.replace(request.params, max_tokens=max(1, max_context - prompt_len))


def _param_of(message: str, max_name: str) -> str | None:
    """Which request parameter a SamplingParams error is about (its first field name)."""
    found = [(m.start(), f) for f in _FIELDS if (m := re.search(rf"\b{f}\b", message))]
    if not found:
        return "stop" if "stop" in message else None
    field = min(found)[1]
    return {"max_tokens": max_name, "beam_width": "best_of"}.get(field, field)


def _response_format(value: Any) -> Constraint | None:
    """OpenAI's ``response_format``: text (no constraint), ``json_object`` (any JSON object)
    or ``json_schema`` ({name, schema, strict}); the engine holds the reply to it. Whether
    the schema compiles is the engine's to say, at submit (routes.py turns its refusal
    into a 400 naming this parameter)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError(400, "response_format must be an object with a type",
                       param="response_format", code="invalid_type")
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind != "json_schema":
        raise APIError(400, "response_format.type must be text, json_object or json_schema, "
                       f"got {kind!r}", param="response_format.type", code="invalid_value")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, "response_format.json_schema must be an object with a name and a "
                       "schema", param="response_format.json_schema", code="invalid_type")
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise APIError(400, "response_format.json_schema.name must be 1-64 letters, digits, "
                       f"underscores or dashes, got {name!r}",
                       param="response_format.json_schema.name", code="invalid_value")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise APIError(400, "response_format.json_schema.schema must be a JSON Schema object",
                       param="response_format.json_schema.schema", code="invalid_type")
    return Constraint("json_schema", schema)


def _unsupported(name: str) -> APIError:
    return APIError(
        400, f"{name} is not supported by this server", param=name, code="unsupported_parameter"
    )


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _number(body: dict, name: str, default: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise APIError(400, f"{name} must be a number, got {value!r}", param=name,
                       code="invalid_type")
    return float(value)


def _integer(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"{name} must be an integer, got {value!r}", param=name,
                       code="invalid_type")
    return value


def _boolean(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false, got {value!r}",
                       param=param or name, code="invalid_type")
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, "stop must be a string or a list of strings", param="stop",
                       code="invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop takes at most {MAX_STOP_STRINGS} strings", param="stop",
                       code="invalid_value")
    return tuple(stops)


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects",
                       param="messages", code="invalid_value")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(400, f"{where} must be an object", param=where, code="invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                           param=f"{where}.role", code="invalid_value")
        content = _content(message.get("content"), f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if not any(m["content"].strip() for m in out):
        raise APIError(400, "messages hold no text", param="messages", code="invalid_value")
    return out


def _content(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                part.get("text"), str
            ):
                raise APIError(400, f"{where}: only text parts are supported",
                               param=where, code="unsupported_content")
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(400, f"{where} must be a string or a list of text parts", param=where,
                   code="invalid_type")


def _prompt(value: Any) -> tuple[str | None, list[int] | None]:
    """A completion prompt: text, token ids, or a one-element list of either."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
        return value, None
    if isinstance(value, list) and value and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        return None, list(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
        raise APIError(400, "several prompts in one request are not supported: send one "
                       "request per prompt (they are batched together anyway)",
                       param="prompt", code="unsupported_value")
    raise APIError(400, "prompt must be a string or a list of token ids", param="prompt",
                   code="invalid_type")
