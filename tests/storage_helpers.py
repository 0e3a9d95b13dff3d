"""Building and damaging real chat databases for the storage tests.

Damage is done to the bytes of a closed database file (SQLite's own format: a 100-byte header,
then fixed-size pages whose first byte says what they hold), so each test knows exactly which
rows it destroyed and can demand that every other row comes back.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from app.core.records import Message
from app.core.store import DB_NAME, Store

# Schema version 1, verbatim from app/store.py at commit 047710a (the first release): the
# migrations must bring a file made by that code forward, so the test keeps its own copy.
V1_SCHEMA = """
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

TABLE_LEAF, INDEX_LEAF = 0x0D, 0x0A


def marker(conv: int, i: int) -> str:
    return f"<<MARK c{conv} m{i:04d}>>"


def populate(data_dir: Path, chats: int = 3, per_chat: int = 120, body: int = 300) -> dict:
    """A database written by the real Store: {message id: (conversation id, parent, content)}."""
    store = Store(data_dir)
    expected: dict[str, tuple[str, str | None, str]] = {}
    for c in range(chats):
        conv = store.create_conversation(f"Chat {c}")
        parent = None
        for i in range(per_chat):
            text = marker(c, i) + " " + ("lorem ipsum " * (body // 12))
            m = Message(
                id=f"m-{c}-{i:04d}",
                conversation_id=conv.id,
                parent_id=parent,
                role="user" if i % 2 == 0 else "assistant",
                content=text,
                status="complete",
                created=time.time(),
            )
            store.add_message(m)
            expected[m.id] = (conv.id, parent, text)
            parent = m.id
        store.set_active_leaf(conv.id, parent)
    store.close()  # the last connection checkpoints and removes the WAL
    assert not Path(f"{data_dir / DB_NAME}-wal").exists()
    return expected


def page_size(path: Path) -> int:
    raw = int.from_bytes(path.read_bytes()[16:18], "big")
    return 65536 if raw == 1 else raw


def pages(path: Path) -> list[bytes]:
    data = path.read_bytes()
    size = page_size(path)
    return [data[i : i + size] for i in range(0, len(data), size)]


def page_type(page: bytes, number: int) -> int:
    return page[100 if number == 1 else 0]


def garble_page(path: Path, number: int) -> None:
    """Overwrite page `number` (1-based) with bytes that are no valid b-tree page."""
    size = page_size(path)
    with open(path, "r+b") as f:
        f.seek((number - 1) * size)
        f.write(bytes((i * 7 + 13) % 256 for i in range(size)))


def markers_in(data: bytes, expected: dict) -> set[str]:
    """Ids of the messages whose marker text lies in `data`."""
    found = set()
    for mid, (_conv, _parent, text) in expected.items():
        if text[:20].encode() in data:
            found.add(mid)
    return found


def read_messages(data_dir: Path) -> dict[str, tuple[str, str | None, str]]:
    """Every message in the database, read with plain sqlite3 (not the code under test)."""
    con = sqlite3.connect(data_dir / DB_NAME)
    try:
        rows = con.execute("SELECT id, conversation_id, parent_id, content FROM messages")
        return {r[0]: (r[1], r[2], r[3]) for r in rows}
    finally:
        con.close()
