"""Plain data records shared by the store, the chat logic and the views (no Qt, no SQL).

Kept separate so persistence and UI agree on one shape, and so the message-tree logic can be
unit-tested without a database or a window.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any


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
class SamplingSettings:
    """The sampling part of a chat's settings (mirrors engine.SamplingParams)."""

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 512
    seed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SamplingSettings:
        """Build from stored JSON, ignoring unknown keys and keeping defaults for bad values."""
        out = cls()
        if not isinstance(data, dict):
            return out
        for f in fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            default = getattr(out, f.name)
            try:
                if f.name == "seed":
                    value = None if value in (None, "") else int(value)
                elif isinstance(default, bool):
                    value = bool(value)
                elif isinstance(default, int):
                    value = int(value)
                elif isinstance(default, float):
                    value = float(value)
            except (TypeError, ValueError):
                continue
            setattr(out, f.name, value)
        return out


@dataclass
class ChatSettings:
    """Per-chat settings: the system prompt and sampling."""

    system_prompt: str = ""
    sampling: SamplingSettings = field(default_factory=SamplingSettings)

    def to_dict(self) -> dict[str, Any]:
        return {"system_prompt": self.system_prompt, "sampling": self.sampling.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ChatSettings:
        if not isinstance(data, dict):
            return cls()
        prompt = data.get("system_prompt", "")
        return cls(
            system_prompt=prompt if isinstance(prompt, str) else "",
            sampling=SamplingSettings.from_dict(data.get("sampling")),
        )


@dataclass
class Conversation:
    id: str
    title: str
    created: float
    updated: float
    settings: ChatSettings = field(default_factory=ChatSettings)
    active_leaf: str | None = None
    color_index: int = 0


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
