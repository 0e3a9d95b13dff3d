"""SQLite persistence: conversations, message trees, per-chat settings, app settings, layout.

One file (`pagedchat.sqlite3`) in the app-data folder, in WAL mode with synchronous=NORMAL: each
statement commits on its own, so a killed process loses nothing that was written, and writes
(a few hundred microseconds) are cheap enough to do on the GUI thread. Replies being streamed are
written as they grow (by the chat session, about once a second); at open, a reply still marked
"streaming" can only come from a process that died, so it is marked "interrupted".
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from app.core.records import ChatSettings, Conversation, Message, Status, new_id

DB_NAME = "pagedchat.sqlite3"
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    settings TEXT NOT NULL DEFAULT '{}',
    active_leaf TEXT,
    color_index INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS messages (
    id TEXT PRIMARY KEY,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id TEXT REFERENCES messages(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    status TEXT NOT NULL,
    created REAL NOT NULL,
    active_child TEXT,
    meta TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


def _like_pattern(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


class Store:
    """All reads and writes of the app's durable state. Not thread-safe: GUI thread only."""

    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.data_dir / DB_NAME
        self._db = sqlite3.connect(str(self.path), isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        # A reply still "streaming" or "pending" belongs to a process that is gone.
        self.recovered_interrupted = self._db.execute(
            "UPDATE messages SET status=? WHERE status IN (?, ?)",
            (Status.INTERRUPTED, Status.STREAMING, Status.PENDING),
        ).rowcount

    def close(self) -> None:
        self._db.close()

    # ---- conversations -------------------------------------------------------------------

    def create_conversation(
        self, title: str = "New Chat", settings: ChatSettings | None = None
    ) -> Conversation:
        now = time.time()
        index = int(self.get_value("next_color_index", 0) or 0)
        self.set_value("next_color_index", index + 1)
        conv = Conversation(
            id=new_id(),
            title=title,
            created=now,
            updated=now,
            settings=settings or ChatSettings(),
            color_index=index,
        )
        self._db.execute(
            "INSERT INTO conversations(id, title, created, updated, settings, active_leaf,"
            " color_index) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                conv.id,
                conv.title,
                conv.created,
                conv.updated,
                json.dumps(conv.settings.to_dict()),
                None,
                conv.color_index,
            ),
        )
        return conv

    def _conversation(self, row: sqlite3.Row) -> Conversation:
        try:
            settings = ChatSettings.from_dict(json.loads(row["settings"]))
        except ValueError:
            settings = ChatSettings()
        return Conversation(
            id=row["id"],
            title=row["title"],
            created=row["created"],
            updated=row["updated"],
            settings=settings,
            active_leaf=row["active_leaf"],
            color_index=row["color_index"],
        )

    def list_conversations(self) -> list[Conversation]:
        """All conversations, most recently updated first."""
        rows = self._db.execute("SELECT * FROM conversations ORDER BY updated DESC, rowid DESC")
        return [self._conversation(r) for r in rows]

    def get_conversation(self, conversation_id: str) -> Conversation | None:
        row = self._db.execute(
            "SELECT * FROM conversations WHERE id=?", (conversation_id,)
        ).fetchone()
        return self._conversation(row) if row else None

    def rename_conversation(self, conversation_id: str, title: str) -> None:
        self._db.execute("UPDATE conversations SET title=? WHERE id=?", (title, conversation_id))

    def touch_conversation(self, conversation_id: str) -> None:
        self._db.execute(
            "UPDATE conversations SET updated=? WHERE id=?", (time.time(), conversation_id)
        )

    def delete_conversation(self, conversation_id: str) -> None:
        with self._db:  # one transaction: messages and conversation go together
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM messages WHERE conversation_id=?", (conversation_id,))
            self._db.execute("DELETE FROM conversations WHERE id=?", (conversation_id,))

    def save_chat_settings(self, conversation_id: str, settings: ChatSettings) -> None:
        self._db.execute(
            "UPDATE conversations SET settings=? WHERE id=?",
            (json.dumps(settings.to_dict()), conversation_id),
        )

    def set_active_leaf(self, conversation_id: str, leaf_id: str | None) -> None:
        self._db.execute(
            "UPDATE conversations SET active_leaf=? WHERE id=?", (leaf_id, conversation_id)
        )

    def search(self, text: str) -> set[str]:
        """Ids of conversations whose title or any message contains `text` (case-insensitive)."""
        pattern = _like_pattern(text)
        rows = self._db.execute(
            "SELECT id FROM conversations WHERE title LIKE ? ESCAPE '\\' "
            "UNION SELECT DISTINCT conversation_id FROM messages WHERE content LIKE ? ESCAPE '\\'",
            (pattern, pattern),
        )
        return {r[0] for r in rows}

    # ---- messages ------------------------------------------------------------------------

    def add_message(self, message: Message) -> None:
        self._db.execute(
            "INSERT INTO messages(id, conversation_id, parent_id, role, content, status,"
            " created, active_child, meta) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                message.id,
                message.conversation_id,
                message.parent_id,
                message.role,
                message.content,
                message.status,
                message.created,
                message.active_child,
                json.dumps(message.meta),
            ),
        )

    def add_messages(self, messages: Iterable[Message]) -> None:
        """Insert several messages in one transaction (branching copies a whole path)."""
        with self._db:
            self._db.execute("BEGIN")
            for m in messages:
                self.add_message(m)

    def update_message(
        self,
        message_id: str,
        *,
        content: str | None = None,
        status: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        sets, args = [], []
        if content is not None:
            sets.append("content=?")
            args.append(content)
        if status is not None:
            sets.append("status=?")
            args.append(status)
        if meta is not None:
            sets.append("meta=?")
            args.append(json.dumps(meta))
        if not sets:
            return
        args.append(message_id)
        self._db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id=?", args)

    def set_active_child(self, parent_id: str, child_id: str) -> None:
        self._db.execute("UPDATE messages SET active_child=? WHERE id=?", (child_id, parent_id))

    def load_messages(self, conversation_id: str) -> list[Message]:
        """Every message of a conversation, in insertion order (siblings keep their order)."""
        rows = self._db.execute(
            "SELECT * FROM messages WHERE conversation_id=? ORDER BY rowid", (conversation_id,)
        )
        out = []
        for r in rows:
            try:
                meta = json.loads(r["meta"])
            except ValueError:
                meta = {}
            out.append(
                Message(
                    id=r["id"],
                    conversation_id=r["conversation_id"],
                    parent_id=r["parent_id"],
                    role=r["role"],
                    content=r["content"],
                    status=r["status"],
                    created=r["created"],
                    active_child=r["active_child"],
                    meta=meta if isinstance(meta, dict) else {},
                )
            )
        return out

    def get_message(self, message_id: str) -> Message | None:
        row = self._db.execute("SELECT conversation_id FROM messages WHERE id=?", (message_id,))
        found = row.fetchone()
        if not found:
            return None
        for m in self.load_messages(found[0]):
            if m.id == message_id:
                return m
        return None

    # ---- key/value (app settings, window layout) -----------------------------------------

    def get_value(self, key: str, default: Any = None) -> Any:
        row = self._db.execute("SELECT value FROM kv WHERE key=?", (key,)).fetchone()
        if not row:
            return default
        try:
            return json.loads(row[0])
        except ValueError:
            return default

    def set_value(self, key: str, value: Any) -> None:
        self._db.execute(
            "INSERT INTO kv(key, value) VALUES (?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, json.dumps(value)),
        )
