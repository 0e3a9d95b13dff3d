"""SQLite persistence: conversations, message trees, per-chat settings, app settings, layout.

One file (`pagedchat.sqlite3`) in the app-data folder, in WAL mode with synchronous=NORMAL: each
statement commits on its own, so a killed process loses nothing that was written. Writes take a
few hundred microseconds and are tried at once on the GUI thread, never waiting on a lock; when
the disk misbehaves (another program holds the lock, the disk is full, the folder turned
read-only) they are held in memory, in order, and replayed by a retry thread (app/core/db_writer)
while listeners tell the user; nothing is lost unless the app quits before the fault passes.
At open the file is checked and, if damaged, moved aside and salvaged (app/core/db_recovery);
the schema is versioned (app/core/schema). Text is stored with lone surrogates replaced by
U+FFFD. Replies being streamed are written as they grow (by the chat session, about once a
second); at open, a reply still marked "streaming" can only come from a process that died, so
it is marked "interrupted".
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from app.core import schema, search
from app.core.db_recovery import Recovery, StoreOpenError, open_checked
from app.core.db_writer import SaveState, WriteBehind
from app.core.records import ChatSettings, Conversation, Folder, Message, Status, new_id

__all__ = ["DB_NAME", "Recovery", "SaveState", "Store", "StoreOpenError", "clean_text"]

DB_NAME = "pagedchat.sqlite3"
SCHEMA_VERSION = schema.schema_version()
CLOSE_FLUSH_S = 3.0  # how long quitting waits for writes held back by a fault


def _configure(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA foreign_keys=ON")


def clean_text(text: str) -> str:
    """`text` with lone surrogates (a broken paste) replaced by U+FFFD, visibly.

    SQLite stores UTF-8, which cannot encode a lone surrogate; a valid surrogate pair that
    arrived as two code points is joined into its character.
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _clean(args: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(clean_text(a) if isinstance(a, str) else a for a in args)


def _json(value: Any) -> str:
    return clean_text(json.dumps(value, ensure_ascii=False))


class Store:
    """All reads and writes of the app's durable state. Not thread-safe: GUI thread only
    (the retry thread has its own connection and touches only the held-back writes)."""

    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreOpenError(
                f"The data folder {self.data_dir} cannot be created: {exc.strerror or exc}."
            ) from exc
        self.path = self.data_dir / DB_NAME
        self._db, self.recovery = open_checked(self.path)
        self._db.row_factory = sqlite3.Row
        try:
            _configure(self._db)
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise StoreOpenError(f"The chat database {self.path} cannot be opened: {exc}.") from exc
        self.writer = WriteBehind(self.path, self._db, _configure)
        self.unsaved_at_close = 0
        self._kv_written: dict[str, str] = {}
        # A reply still "streaming" or "pending" belongs to a process that is gone.
        self.recovered_interrupted = self._db.execute(
            "SELECT count(*) FROM messages WHERE status IN (?, ?)",
            (Status.STREAMING, Status.PENDING),
        ).fetchone()[0]
        if self.recovered_interrupted:
            self._write(
                "UPDATE messages SET status=? WHERE status IN (?, ?)",
                (Status.INTERRUPTED, Status.STREAMING, Status.PENDING),
            )

    def close(self) -> None:
        """Write what a fault held back (for a few seconds at most), then close."""
        self.unsaved_at_close = self.writer.close(CLOSE_FLUSH_S)
        self._db.close()

    # ---- saving ----------------------------------------------------------------------------

    def _write(self, sql: str, args: Sequence[Any] = ()) -> None:
        self.writer.write([(sql, _clean(args))])

    def _write_many(self, ops: Iterable[tuple[str, Sequence[Any]]]) -> None:
        """Several statements as one transaction (all or nothing)."""
        self.writer.write([(sql, _clean(args)) for sql, args in ops])

    @property
    def save_state(self) -> SaveState:
        """Whether writes reach the disk now, and how many wait in memory."""
        return self.writer.state

    def add_save_listener(self, listener: Callable[[SaveState], None]) -> None:
        """Called (from any thread) when saving stops or starts working again."""
        self.writer.add_listener(listener)

    def retry_saving(self) -> None:
        self.writer.retry_now()

    # ---- conversations -------------------------------------------------------------------

    def create_conversation(
        self,
        title: str = "New Chat",
        settings: ChatSettings | None = None,
        folder_id: str | None = None,
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
            folder_id=folder_id,
        )
        conv.title = clean_text(conv.title)
        self._write(
            "INSERT INTO conversations(id, title, created, updated, settings, active_leaf,"
            " color_index, folder_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                conv.id,
                conv.title,
                conv.created,
                conv.updated,
                _json(conv.settings.to_dict()),
                None,
                conv.color_index,
                conv.folder_id,
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
            model=row["model"] or "",
            folder_id=row["folder_id"],
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
        self._write("UPDATE conversations SET title=? WHERE id=?", (title, conversation_id))

    def touch_conversation(self, conversation_id: str) -> None:
        self._write("UPDATE conversations SET updated=? WHERE id=?", (time.time(), conversation_id))

    def delete_conversation(self, conversation_id: str) -> None:
        self._write_many(  # one transaction: messages and conversation go together
            [
                ("DELETE FROM messages WHERE conversation_id=?", (conversation_id,)),
                ("DELETE FROM conversations WHERE id=?", (conversation_id,)),
            ]
        )

    def save_chat_settings(self, conversation_id: str, settings: ChatSettings) -> None:
        self._write(
            "UPDATE conversations SET settings=? WHERE id=?",
            (_json(settings.to_dict()), conversation_id),
        )

    def set_chat_model(self, conversation_id: str, model: str) -> None:
        """Which model the chat talks to ("" = the local engine)."""
        self._write("UPDATE conversations SET model=? WHERE id=?", (model, conversation_id))

    def set_active_leaf(self, conversation_id: str, leaf_id: str | None) -> None:
        self._write("UPDATE conversations SET active_leaf=? WHERE id=?", (leaf_id, conversation_id))

    # ---- folders -------------------------------------------------------------------------

    def create_folder(self, name: str, settings: ChatSettings | None = None) -> Folder:
        folder = Folder(new_id(), clean_text(name), time.time(), settings)
        self._write(
            "INSERT INTO folders(id, name, created, settings) VALUES (?, ?, ?, ?)",
            (folder.id, folder.name, folder.created, self._folder_settings(settings)),
        )
        return folder

    @staticmethod
    def _folder_settings(settings: ChatSettings | None) -> str | None:
        return None if settings is None else _json(settings.to_dict())

    def list_folders(self) -> list[Folder]:
        """All folders, by name (case-insensitive), then age."""
        rows = self._db.execute("SELECT * FROM folders ORDER BY lower(name), created")
        out = []
        for r in rows:
            settings = None
            if r["settings"]:
                try:
                    settings = ChatSettings.from_dict(json.loads(r["settings"]))
                except ValueError:
                    settings = None
            out.append(Folder(r["id"], r["name"], r["created"], settings))
        return out

    def get_folder(self, folder_id: str) -> Folder | None:
        return next((f for f in self.list_folders() if f.id == folder_id), None)

    def rename_folder(self, folder_id: str, name: str) -> None:
        self._write("UPDATE folders SET name=? WHERE id=?", (name, folder_id))

    def set_folder_settings(self, folder_id: str, settings: ChatSettings | None) -> None:
        """What new chats in the folder start with (None: the app's defaults)."""
        self._write(
            "UPDATE folders SET settings=? WHERE id=?",
            (self._folder_settings(settings), folder_id),
        )

    def delete_folder(self, folder_id: str) -> None:
        """Delete a folder; its chats move to the top level (one transaction)."""
        self._write_many(
            [
                ("UPDATE conversations SET folder_id=NULL WHERE folder_id=?", (folder_id,)),
                ("DELETE FROM folders WHERE id=?", (folder_id,)),
            ]
        )

    def move_to_folder(self, conversation_ids: Iterable[str], folder_id: str | None) -> None:
        """Put chats into a folder (None: the top level), all in one transaction."""
        ops = [
            ("UPDATE conversations SET folder_id=? WHERE id=?", (folder_id, cid))
            for cid in conversation_ids
        ]
        if ops:
            self._write_many(ops)

    def search(self, text: str) -> set[str]:
        """Ids of conversations whose title or any message matches `text` (app/core/search:
        FTS5 words by prefix, or a case-insensitive substring)."""
        return search.matching_chats(self._db, clean_text(text))

    def search_hits(self, text: str, limit: int = 200) -> list[search.Hit]:
        """Ranked hits with highlighted snippets (titles, then messages, best first)."""
        return search.search(self._db, clean_text(text), limit)

    def insert_chats(
        self,
        chats: Iterable[tuple[Conversation, Sequence[Message]]],
        folders: Iterable[Folder] = (),
    ) -> None:
        """Insert whole conversations (an import), and the new folders they go into, as one
        transaction: all of them or none.

        Messages go in the order given (parents first; siblings keep their order)."""
        ops: list[tuple[str, Sequence[Any]]] = [
            (
                "INSERT INTO folders(id, name, created, settings) VALUES (?, ?, ?, ?)",
                (f.id, f.name, f.created, self._folder_settings(f.settings)),
            )
            for f in folders
        ]
        for conv, messages in chats:
            conv.title = clean_text(conv.title)
            ops.append(
                (
                    "INSERT INTO conversations(id, title, created, updated, settings,"
                    " active_leaf, color_index, model, folder_id)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        conv.id,
                        conv.title,
                        conv.created,
                        conv.updated,
                        _json(conv.settings.to_dict()),
                        conv.active_leaf,
                        conv.color_index,
                        conv.model,
                        conv.folder_id,
                    ),
                )
            )
            ops.extend(self._insert_message(m) for m in messages)
        if ops:
            self._write_many(ops)

    # ---- messages ------------------------------------------------------------------------

    @staticmethod
    def _insert_message(message: Message) -> tuple[str, tuple[Any, ...]]:
        message.content = clean_text(message.content)  # what is shown is what is stored
        return (
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
                _json(message.meta),
            ),
        )

    def add_message(self, message: Message) -> None:
        self._write(*self._insert_message(message))

    def add_messages(self, messages: Iterable[Message]) -> None:
        """Insert several messages in one transaction (branching copies a whole path)."""
        ops = [self._insert_message(m) for m in messages]
        if ops:
            self._write_many(ops)

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
            args.append(_json(meta))
        if not sets:
            return
        args.append(message_id)
        self._write(f"UPDATE messages SET {', '.join(sets)} WHERE id=?", args)

    def set_active_child(self, parent_id: str, child_id: str) -> None:
        self._write("UPDATE messages SET active_child=? WHERE id=?", (child_id, parent_id))

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
        text = self._kv_written.get(key)  # this run's value, saved or still held back
        if text is None:
            row = self._db.execute("SELECT value FROM kv WHERE key=?", _clean((key,))).fetchone()
            if not row:
                return default
            text = row[0]
        try:
            return json.loads(text)
        except ValueError:
            return default

    def set_value(self, key: str, value: Any) -> None:
        text = _json(value)
        self._kv_written[key] = text
        self._write(
            "INSERT INTO kv(key, value) VALUES (?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, text),
        )
