"""The checks ``Engine.submit`` runs at the door, in the caller's thread.

A bad value must raise ``ValueError`` naming the field where the caller can see it, never
reach the engine thread (docs/ARCHITECTURE.md §3.9). Each check returns a *copy* of what it
accepted, so a caller that mutates its list or dict after submitting cannot change a queued
request.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from collections.abc import Sequence as Seq

from engine.config import SamplingParams


def checked_prompt(messages, prompt_tokens) -> tuple[list[dict] | None, list[int] | None]:
    """Copies of the prompt arguments, or a ValueError saying what is wrong with them."""
    if (messages is None) == (prompt_tokens is None):
        raise ValueError("give either messages or prompt_tokens")
    if messages is not None:
        out = checked_messages(messages)
        if not any(m["content"].strip() for m in out):
            raise ValueError("the conversation is empty: write a message first")
        return out, None
    if isinstance(prompt_tokens, str | bytes) or not isinstance(prompt_tokens, Seq):
        raise ValueError("prompt_tokens must be a list of token ids")
    tokens = []
    for t in prompt_tokens:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"prompt_tokens must hold token ids (integers), got {t!r}")
        tokens.append(int(t))
    if not tokens:
        raise ValueError("prompt_tokens is empty")
    return None, tokens


def checked_messages(messages) -> list[dict]:
    """Copies of chat messages, each with a text role and text content, or a ValueError."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Seq):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', "
                             f"got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {i} needs a 'role' (such as 'user'), got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"message {i}'s 'content' must be text, got "
                             f"{type(content).__name__}")
        out.append(dict(m))
    return out


def checked_params(params) -> SamplingParams:
    """``params`` validated again (a frozen dataclass can still be forced into a bad state)."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    return dataclasses.replace(params)


def check_ids(session_id, request_id) -> None:
    """A session id names a chat (required); a request id is optional but never empty."""
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"session_id must be a non-empty string naming the chat, "
                         f"got {session_id!r}")
    if request_id is not None and (not isinstance(request_id, str) or not request_id):
        raise ValueError(f"request_id must be None or a non-empty string, got {request_id!r}")


def vocab_size(tokenizer) -> int:
    """The largest token id space the tokenizer can produce (added tokens included)."""
    return max(tokenizer.vocab_size, len(tokenizer))
