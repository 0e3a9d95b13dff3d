"""The database schema as a list of versioned migrations (`PRAGMA user_version`).

`MIGRATIONS[i]` takes a database from schema version i to i + 1, so adding a schema change
(a new table, a new column...) is one function appended to the list and nothing else: a
database of any earlier version is brought forward step by step, each run of steps in one
transaction, so a failed migration leaves the file exactly as it was. Version 0 is "nothing
yet"; version 1 is the schema PagedChat shipped first (app/store.py at commit 047710a).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from app.core import search

Migration = Callable[[sqlite3.Connection], None]


class SchemaError(RuntimeError):
    """The file holds tables that are not (or no longer) PagedChat's: salvage, don't trust."""


class MigrationError(RuntimeError):
    """A migration step failed; the transaction was rolled back, the file is as it was."""


class NewerSchemaError(RuntimeError):
    """The file was written by a newer PagedChat; this version must not touch it."""


def _v1(db: sqlite3.Connection) -> None:
    """The first schema: conversations, message trees, key/value settings."""
    db.execute(
        """CREATE TABLE IF NOT EXISTS conversations (
            id TEXT PRIMARY KEY,
            title TEXT NOT NULL,
            created REAL NOT NULL,
            updated REAL NOT NULL,
            settings TEXT NOT NULL DEFAULT '{}',
            active_leaf TEXT,
            color_index INTEGER NOT NULL DEFAULT 0
        )"""
    )
    db.execute(
        """CREATE TABLE IF NOT EXISTS messages (
            id TEXT PRIMARY KEY,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            parent_id TEXT REFERENCES messages(id) ON DELETE CASCADE,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            status TEXT NOT NULL,
            created REAL NOT NULL,
            active_child TEXT,
            meta TEXT NOT NULL DEFAULT '{}'
        )"""
    )
    db.execute("CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id)")
    db.execute("CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL)")


def _v2(db: sqlite3.Connection) -> None:
    """Each chat names its model: "" is the local engine's, "<provider id>:<model>" a remote
    provider's (app/core/providers)."""
    db.execute("ALTER TABLE conversations ADD COLUMN model TEXT NOT NULL DEFAULT ''")


def _need(db: sqlite3.Connection, table: str, *columns: str) -> None:
    """A step that reads existing columns first checks they are there: tables of the same
    name from something else are salvaged (SchemaError), not a failed upgrade."""
    missing = [c for c in columns if c not in table_columns(db, table)]
    if missing:
        raise SchemaError(f"table {table!r} lacks column(s) {', '.join(missing)}")


def _v3(db: sqlite3.Connection) -> None:
    """Full-text search (app/core/search): FTS5 indexes of titles and messages, kept by
    triggers, filled from the chats already there."""
    _need(db, "messages", "content")
    _need(db, "conversations", "title")
    for statement in search.index_sql():
        db.execute(statement)


def _v4(db: sqlite3.Connection) -> None:
    """Folders: a chat may sit in one (NULL: the top level). A folder may carry the settings
    its new chats start with (NULL: the app's defaults). Deleting a folder moves its chats to
    the top level (ON DELETE SET NULL), never deletes them."""
    db.execute(
        """CREATE TABLE folders (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            created REAL NOT NULL,
            settings TEXT
        )"""
    )
    db.execute(
        "ALTER TABLE conversations ADD COLUMN folder_id TEXT"
        " REFERENCES folders(id) ON DELETE SET NULL"
    )


def _v5(db: sqlite3.Connection) -> None:
    """Search in attached files: an FTS5 index of `meta["attachments"]` texts, filled from
    the messages already there."""
    _need(db, "messages", "meta")
    for statement in search.attachment_index_sql():
        db.execute(statement)


def _v6(db: sqlite3.Connection) -> None:
    """Search in tool calls (MCP tools in chats): an FTS5 index of the name and arguments
    of the call each `tool` message answers, filled from the messages already there."""
    _need(db, "messages", "meta")
    for statement in search.tool_call_index_sql():
        db.execute(statement)


MIGRATIONS: list[Migration] = [_v1, _v2, _v3, _v4, _v5, _v6]

# The columns each table must have once migrated (checked after every open: a table of the
# same name from something else, or a half-applied old schema, is caught here).
REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "conversations": (
        "id",
        "title",
        "created",
        "updated",
        "settings",
        "active_leaf",
        "color_index",
        "model",
        "folder_id",
    ),
    "messages": (
        "id",
        "conversation_id",
        "parent_id",
        "role",
        "content",
        "status",
        "created",
        "active_child",
        "meta",
    ),
    "kv": ("key", "value"),
    "folders": ("id", "name", "created", "settings"),
}


def schema_version() -> int:
    return len(MIGRATIONS)


def user_version(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def table_columns(db: sqlite3.Connection, table: str) -> list[str]:
    return [r[1] for r in db.execute(f"PRAGMA table_info({table})")]


def check_columns(db: sqlite3.Connection) -> None:
    for table, wanted in REQUIRED_COLUMNS.items():
        have = set(table_columns(db, table))
        missing = [c for c in wanted if c not in have]
        if missing:
            raise SchemaError(f"table {table!r} lacks column(s) {', '.join(missing)}")


def migrate(db: sqlite3.Connection) -> int:
    """Bring `db` (autocommit connection) to the current version; returns the version found.

    Raises NewerSchemaError for a file from a newer app, MigrationError when a step fails
    (nothing changed), SchemaError when the tables do not match what their version promises.
    """
    found = user_version(db)
    target = schema_version()
    if found > target:
        raise NewerSchemaError(
            f"it was written by a newer PagedChat (schema version {found}; this version "
            f"reads up to {target})"
        )
    if found == target:
        check_columns(db)
        return found
    db.execute("BEGIN IMMEDIATE")
    try:
        for version, step in enumerate(MIGRATIONS[found:], start=found):
            try:
                step(db)
            except sqlite3.Error as exc:
                raise MigrationError(
                    f"the step from schema version {version} to {version + 1} failed: {exc}"
                ) from exc
        check_columns(db)
        db.execute(f"PRAGMA user_version={target}")
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    return found
