"""The rules of a chat that need no Qt: titles, prompts, finish statuses, branch copies.

ChatSession (app/chat/session.py) is the Qt object that streams and signals; the decisions it
takes about messages live here, so they are tested without an event loop and shared by any
front end.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterable
from typing import Any

from app.core.attachments import from_meta, prompt_content
from app.core.records import ChatSettings, Message, Status, new_id
from app.core.tool_calls import tool_messages
from engine import FinishReason, SamplingParams, Usage

TITLE_LENGTH = 48
DEFAULT_TITLE = "New Chat"


def title_from(text: str) -> str:
    """A chat title from its first message: one line, cut at TITLE_LENGTH."""
    line = " ".join(text.strip().split())
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1].rstrip() + "…"


TITLE_REQUEST = ("Give this conversation a short title of 2 to 5 words. Reply with the "
                 "title only.")
_LIST_MARK = re.compile(r"^(\d+[.)]|[-*#>•]+)\s*")
_LABEL = re.compile(r"^(title|chat title|conversation title)\s*:\s*", re.IGNORECASE)


def title_prompt(user_text: str, reply_text: str) -> list[dict[str, str]]:
    """What the model is asked to name a chat with: its first exchange, then the request (a
    135M model follows this shape better than a description of the chat in one message)."""
    return [{"role": "user", "content": user_text[:1500]},
            {"role": "assistant", "content": reply_text[:1500]},
            {"role": "user", "content": TITLE_REQUEST}]


def clean_title(text: str) -> str | None:
    """A title from a model's answer (its first line, without a list mark, a "Title:" label,
    quotes or a final full stop), or None when nothing usable is left.

    An answer longer than a title's ``TITLE_LENGTH`` is refused, not cut: asked for 2 to 5
    words, the default 135M model answers about half of 20 first exchanges with a sentence
    ("The answer to this question is a spider's legs…", "A KV cache is a type of cache that
    stores and r…"), and a cut sentence names a chat worse than its first message does."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    line = _LABEL.sub("", _LIST_MARK.sub("", line))
    line = line.strip(" \"'`*_“”‘’").rstrip(" .,:;!").strip(" \"'`*_“”‘’")
    line = " ".join(line.split())
    if not line or len(line) > TITLE_LENGTH:
        return None
    return line


def unique_title(title: str, taken: Iterable[str]) -> str:
    """`title`, or `title 2`, `title 3`, ... when another chat already has it, so chats with
    the same first message are told apart in the sidebar."""
    taken = set(taken)
    n = 2
    candidate = title
    while candidate in taken:
        candidate, n = f"{title} {n}", n + 1
    return candidate


_STATUS_OF = {FinishReason.STOP: Status.COMPLETE, FinishReason.LENGTH: Status.LENGTH}


def status_for(reason: FinishReason, quitting: bool) -> str:
    """The message status a finish reason leaves (a cancel while quitting is an interruption)."""
    if reason == FinishReason.CANCELLED:
        return Status.INTERRUPTED if quitting else Status.STOPPED
    return _STATUS_OF.get(reason, Status.ERROR)


def usage_dict(usage: Usage | None) -> dict[str, Any]:
    """The engine's Usage as the JSON kept in a reply's meta."""
    return dataclasses.asdict(usage) if usage is not None else {}


def prompt_messages(system_prompt: str, path: list[Message]) -> list[dict[str, str]]:
    """What the engine sees for a reply below a path: system prompt + that path. Tool calls
    and results (MCP tools) are written as plain turns in the common format, so a chat whose
    tools were switched off still shows the model what happened."""
    messages, raw = prompt_with_calls(system_prompt, path)
    return tool_messages(messages, raw, native=False)


def prompt_with_calls(system_prompt: str, path: list[Message]) -> tuple[list[dict], list[dict]]:
    """The path as chat messages, and the same in OpenAI's shape (an assistant's
    ``tool_calls``, a tool result's ``tool_call_id``) for app/core/tool_calls.py."""
    out: list[dict] = []
    raw: list[dict] = []
    if system_prompt.strip():
        out.append({"role": "system", "content": system_prompt})
        raw.append({})
    for m in path:
        calls = m.meta.get("tool_calls") if m.role == "assistant" else None
        if m.role == "assistant" and (m.status == Status.ERROR or not (m.content or calls)):
            continue  # a failed or empty reply carries nothing for the model
        if m.role == "tool":
            if m.status in Status.LIVE:
                continue  # not answered yet
            out.append({"role": "tool", "content": m.content})
            raw.append({"tool_call_id": m.meta.get("tool_call", {}).get("id")})
            continue
        out.append({"role": m.role, "content": prompt_content(m.content, from_meta(m.meta))})
        raw.append({"tool_calls": calls} if calls else {})
    return out, raw


def branch_copies(
    path: list[Message], conversation_id: str, source_id: str, message_id: str
) -> list[Message]:
    """Fresh copies of `path` for a new chat, linked parent to child, the last one marked as a
    branch of (source_id, message_id); live replies become interrupted ones."""
    mapping: dict[str, str] = {}
    copies = []
    for m in path:
        nid = new_id()
        copies.append(
            Message(
                id=nid,
                conversation_id=conversation_id,
                parent_id=mapping.get(m.parent_id) if m.parent_id else None,
                role=m.role,
                content=m.content,
                status=Status.INTERRUPTED if m.status in Status.LIVE else m.status,
                created=time.time(),
                meta={k: v for k, v in m.meta.items() if k != "branch_of"},
            )
        )
        mapping[m.id] = nid
    if copies:
        copies[-1].meta["branch_of"] = {"conversation": source_id, "message": message_id}
        for parent, child in zip(copies, copies[1:], strict=False):
            parent.active_child = child.id
    return copies


def copy_settings(settings: ChatSettings) -> ChatSettings:
    """An independent copy (a new chat must not share its defaults' objects)."""
    return ChatSettings.from_dict(settings.to_dict())


def reply_params(sampling: SamplingParams, n: int) -> SamplingParams:
    """A chat's sampling for a reply with ``n`` alternatives. With "Best of k (beam search)"
    on, the alternatives are the best ``n`` beams: a search narrower than ``n`` is widened
    to ``n`` (the engine refuses n above beam_width), and one reply is the best beam."""
    if sampling.beam_search and n > sampling.beam_width:
        return dataclasses.replace(sampling, n=n, beam_width=n)
    return dataclasses.replace(sampling, n=n)  # validates

