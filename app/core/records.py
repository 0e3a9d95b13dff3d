"""Plain data records shared by the store, the chat logic and the views (no Qt, no SQL).

Kept separate so persistence and UI agree on one shape, and so the message-tree logic can be
unit-tested without a database or a window. Sampling is not restated here: a chat keeps the
engine's own SamplingParams, validated by the engine's rules.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from app.core.serial import from_json, to_json
from engine import SamplingParams


def new_id() -> str:
    """A short random id (also used as the engine session id of a chat)."""
    return uuid.uuid4().hex[:16]


class Status:
    """The life-cycle of a message; stored as text."""

    COMPLETE = "complete"  # finished normally (stop token or stop string)
    LENGTH = "length"  # hit max_tokens: complete but cut
    STREAMING = "streaming"  # being generated (if seen at start-up: the app was killed)
    PENDING = "pending"  # submitted, no token yet
    STOPPED = "stopped"  # the user pressed stop
    INTERRUPTED = "interrupted"  # the app quit or crashed mid-reply; can be regenerated
    ERROR = "error"  # the engine refused or failed (meta["error"] says why)

    LIVE = frozenset({STREAMING, PENDING})


@dataclass
class ChatSettings:
    """Per-chat settings: the system prompt and sampling (the engine's own SamplingParams),
    and whether the chat may use the MCP tools of Settings ▸ Tools (``tools``); with
    ``tool_choice`` "required" the first reply to each message is held to a tool call (a
    grammar), so even a small model that never calls on its own uses the tool."""

    system_prompt: str = ""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tools: bool = False
    tool_choice: str = "auto"  # "auto": the model decides; "required": a call comes first

    def to_dict(self) -> dict[str, Any]:
        return to_json(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ChatSettings:
        return from_json(cls, data)


@dataclass
class Conversation:
    id: str
    title: str
    created: float
    updated: float
    settings: ChatSettings = field(default_factory=ChatSettings)
    active_leaf: str | None = None
    color_index: int = 0
    model: str = ""  # "" = the local engine; else "<provider id>:<model id>" (core.providers)
    folder_id: str | None = None  # None: the top level


@dataclass
class Folder:
    """A named group of chats; `settings` (if set) is what its new chats start with."""

    id: str
    name: str
    created: float
    settings: ChatSettings | None = None


@dataclass
class Message:
    """One node of a conversation's message tree.

    parent_id is None for a first message; siblings (same parent) are alternatives: a
    regenerated reply or an edited prompt. active_child remembers which child was last shown,
    so switching an alternative higher up restores the branch below it.
    """

    id: str
    conversation_id: str
    parent_id: str | None
    role: str
    content: str
    status: str = Status.COMPLETE
    created: float = field(default_factory=time.time)
    active_child: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
