"""The rules of a chat that need no Qt: titles, prompts, finish statuses, branch copies.

ChatSession (app/chat/session.py) is the Qt object that streams and signals; the decisions it
takes about messages live here, so they are tested without an event loop and shared by any
front end.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from app.core.attachments import from_meta, prompt_content
from app.core.records import ChatSettings, Message, Status, new_id
from engine import FinishReason, Usage

TITLE_LENGTH = 48
DEFAULT_TITLE = "New Chat"


def title_from(text: str) -> str:
    """A chat title from its first message: one line, cut at TITLE_LENGTH."""
    line = " ".join(text.strip().split())
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1].rstrip() + "…"


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
    """What the engine sees for a reply below a path: system prompt + that path."""
    out: list[dict[str, str]] = []
    if system_prompt.strip():
        out.append({"role": "system", "content": system_prompt})
    for m in path:
        if m.role == "assistant" and (m.status == Status.ERROR or not m.content):
            continue  # a failed or empty reply carries nothing for the model
        out.append({"role": m.role, "content": prompt_content(m.content, from_meta(m.meta))})
    return out


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
