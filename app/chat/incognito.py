"""Incognito chats: never saved, never shared, never on disk (issue #27).

An incognito chat lives only in memory: its session writes through a store that keeps
nothing (:class:`IncognitoStore`), so it never reaches the library, the search or an export;
its requests are submitted with ``incognito=True``, so the engine never shares its KV blocks
with another chat, never writes them to the disk tier, and zeroes them when they are
released (docs/ARCHITECTURE.md §3.14); the app never asks the model to title it. Closing its
pane (or showing another chat there) ends it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from app.core.records import ChatSettings, Conversation

#: The title an incognito chat shows in its pane: it says so, and that nothing is kept.
INCOGNITO_TITLE = "Incognito chat (not saved)"


class IncognitoStore:
    """The part of app.core.store.Store a chat session writes through, keeping nothing: the
    session's own message tree is the only copy of the chat."""

    def __init__(self) -> None:
        self.conversation: Conversation | None = None

    def create_conversation(self, title: str = INCOGNITO_TITLE,
                            settings: ChatSettings | None = None,
                            folder_id: str | None = None) -> Conversation:
        now = time.time()
        self.conversation = Conversation(f"incognito-{uuid.uuid4().hex}", title, now, now,
                                         settings or ChatSettings())
        return self.conversation

    def get_conversation(self, conversation_id: str) -> Conversation | None:
        conv = self.conversation
        return conv if conv is not None and conv.id == conversation_id else None

    def load_messages(self, conversation_id: str) -> list:
        return []

    def list_conversations(self) -> list:
        return []

    def get_folder(self, folder_id: str) -> None:
        return None

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        """Every write: nothing is kept."""

    add_message = add_messages = update_message = set_active_child = _nothing
    set_active_leaf = touch_conversation = rename_conversation = _nothing
    save_chat_settings = set_chat_model = delete_conversation = _nothing
