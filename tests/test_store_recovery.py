"""The store at open and with odd text: damaged files, schema versions, lone surrogates.

Each damaged file is made from a real database by overwriting or cutting its bytes, and the
test demands back every message whose bytes it did not touch (read with plain sqlite3).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from app.core import schema
from app.core.records import Message
from app.core.store import DB_NAME, SCHEMA_VERSION, Store, StoreOpenError
from tests.storage_helpers import (
    INDEX_LEAF,
    TABLE_LEAF,
    V1_SCHEMA,
    garble_page,
    markers_in,
    page_type,
    pages,
    populate,
    read_messages,
)


def _msg(conv_id: str, mid: str, text: str, parent: str | None = None) -> Message:
    return Message(
        id=mid, conversation_id=conv_id, parent_id=parent, role="user", content=text,
        status="complete",
    )


# ---- item 13: lone surrogates -----------------------------------------------------------------


def test_lone_surrogate_is_stored_with_a_visible_replacement(tmp_path):
    store = Store(tmp_path)
    conv = store.create_conversation("paste \udcff here")
    store.add_message(_msg(conv.id, "a", "broken \udcff paste"))
    store.add_message(_msg(conv.id, "b", "pair \ud83d\ude00 joined", parent="a"))
    store.update_message("b", content="grew \ud800 too", meta={"note": "x\udfff"})
    store.rename_conversation(conv.id, "title \udc80")
    store.set_value("draft", "typed \udcff")
    assert store.search("\udcff") == {conv.id}  # a query with one is cleaned alike, no raise
    store.close()
    con = sqlite3.connect(tmp_path / DB_NAME)
    rows = dict(con.execute("SELECT id, content FROM messages"))
    assert rows == {"a": "broken \ufffd paste", "b": "grew \ufffd too"}
    assert con.execute("SELECT title FROM conversations").fetchone()[0] == "title \ufffd"
    con.close()
    again = Store(tmp_path)
    assert again.load_messages(conv.id)[1].meta == {"note": "x\ufffd"}
    assert again.get_value("draft") == "typed \ufffd"
    assert again.search("broken \ufffd") == {conv.id}
    again.close()


def test_a_valid_pair_written_as_two_code_points_becomes_its_character(tmp_path):
    store = Store(tmp_path)
    conv = store.create_conversation()
    m = _msg(conv.id, "a", "smile \ud83d\ude00")
    store.add_message(m)
    assert m.content == "smile \U0001f600"  # what the chat shows is what was stored
    assert store.load_messages(conv.id)[0].content == "smile \U0001f600"
    store.close()


# ---- item 14: damage at open ------------------------------------------------------------------


def _damaged_copy(tmp_path: Path) -> Path:
    [aside] = [p for p in tmp_path.iterdir() if ".damaged-" in p.name]
    return aside


def _check_recovered(data_dir: Path, expected: dict, lost: set[str]) -> dict:
    got = read_messages(data_dir)
    for mid, (conv, parent, text) in expected.items():
        if mid in lost:
            continue
        assert mid in got, f"readable message {mid} was not recovered"
        assert got[mid][0] == conv and got[mid][2] == text
        if parent is not None and parent in got:
            assert got[mid][1] == parent  # the tree survives where both ends did
    return got


def test_a_garbled_table_page_loses_only_its_own_rows(tmp_path):
    expected = populate(tmp_path)
    db = tmp_path / DB_NAME
    all_pages = pages(db)
    leaves = [n for n, p in enumerate(all_pages, 1) if page_type(p, n) == TABLE_LEAF]
    victim = next(n for n in leaves if markers_in(all_pages[n - 1], expected))
    lost = markers_in(all_pages[victim - 1], expected)
    garble_page(db, victim)
    damaged_bytes = db.read_bytes()

    store = Store(tmp_path)
    assert store.recovery is not None
    aside = store.recovery.moved_to
    assert aside.read_bytes() == damaged_bytes  # the damaged copy is kept as it was
    assert aside == _damaged_copy(tmp_path)
    text = store.recovery.message()
    assert str(aside) in text and "damaged" in text
    got = _check_recovered(tmp_path, expected, lost)
    assert not lost & set(got)  # nothing invented for the rows that were destroyed
    # the app works on the fresh database: every chat opens, a new one can be written
    assert len(store.list_conversations()) == 3
    for conv in store.list_conversations():
        assert store.load_messages(conv.id)
    store.add_message(_msg(store.create_conversation().id, "new", "after recovery"))
    store.close()
    assert Store(tmp_path).recovery is None  # the fresh database is healthy


def test_a_garbled_index_page_loses_nothing(tmp_path):
    expected = populate(tmp_path)
    db = tmp_path / DB_NAME
    all_pages = pages(db)
    victim = next(n for n, p in enumerate(all_pages, 1) if page_type(p, n) == INDEX_LEAF)
    garble_page(db, victim)
    store = Store(tmp_path)
    assert store.recovery is not None and "integrity" in store.recovery.reason
    store.close()
    assert set(_check_recovered(tmp_path, expected, set())) == set(expected)


def test_a_garbled_header_is_repaired_for_salvage(tmp_path):
    expected = populate(tmp_path, chats=2, per_chat=20)
    db = tmp_path / DB_NAME
    with open(db, "r+b") as f:
        f.write(b"\xff" * 16)
    store = Store(tmp_path)
    assert store.recovery is not None and "not a database" in store.recovery.reason
    store.close()
    assert set(_check_recovered(tmp_path, expected, set())) == set(expected)


def test_a_truncated_file_keeps_the_rows_before_the_cut(tmp_path):
    expected = populate(tmp_path)
    db = tmp_path / DB_NAME
    data = db.read_bytes()
    cut = int(len(data) * 0.6)
    db.write_bytes(data[:cut])
    kept_pages = pages(db)[:-1]  # the last page may be cut in the middle
    readable = set().union(*(markers_in(p, expected) for p in kept_pages))
    store = Store(tmp_path)
    assert store.recovery is not None
    assert _damaged_copy(tmp_path).stat().st_size == cut
    store.close()
    got = _check_recovered(tmp_path, expected, set(expected) - readable)
    assert readable and readable <= set(got)


def test_a_zero_byte_file_is_kept_and_the_app_starts(tmp_path):
    (tmp_path / DB_NAME).write_bytes(b"")
    store = Store(tmp_path)
    assert store.recovery is not None and "0 bytes" in store.recovery.message()
    assert _damaged_copy(tmp_path).stat().st_size == 0
    conv = store.create_conversation("works")
    store.close()
    assert [c.id for c in Store(tmp_path).list_conversations()] == [conv.id]


def test_a_folder_in_the_databases_place_is_moved_aside_whole(tmp_path):
    (tmp_path / DB_NAME).mkdir()
    (tmp_path / DB_NAME / "precious.txt").write_text("keep me")
    store = Store(tmp_path)
    assert store.recovery is not None and "folder" in store.recovery.reason
    aside = _damaged_copy(tmp_path)
    assert (aside / "precious.txt").read_text() == "keep me"
    assert (tmp_path / DB_NAME).is_file()
    store.close()


def test_tables_from_an_unversioned_old_layout_are_salvaged_by_column_name(tmp_path):
    con = sqlite3.connect(tmp_path / DB_NAME)
    con.executescript(
        "CREATE TABLE conversations (id TEXT PRIMARY KEY, title TEXT);"
        "CREATE TABLE messages (id TEXT PRIMARY KEY, conversation_id TEXT, role TEXT,"
        " content TEXT);"
        "INSERT INTO conversations VALUES ('c1', 'Old chat');"
        "INSERT INTO messages VALUES ('m1', 'c1', 'user', 'hello from the past');"
    )
    con.commit()
    con.close()
    store = Store(tmp_path)
    assert store.recovery is not None and "not PagedChat's" in store.recovery.reason
    [conv] = store.list_conversations()
    assert conv.title == "Old chat"
    [m] = store.load_messages("c1")
    assert (m.role, m.content) == ("user", "hello from the past")
    store.close()


def test_a_file_from_a_newer_version_is_refused_and_left_alone(tmp_path):
    populate(tmp_path, chats=1, per_chat=2)
    db = tmp_path / DB_NAME
    con = sqlite3.connect(db)
    con.execute(f"PRAGMA user_version={SCHEMA_VERSION + 5}")
    con.close()
    before = db.read_bytes()
    with pytest.raises(StoreOpenError, match="newer PagedChat"):
        Store(tmp_path)
    assert db.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if ".damaged-" in p.name] == []


# ---- item 14: versioned migrations --------------------------------------------------------


def _build_v0(path: Path) -> dict:
    con = sqlite3.connect(path)  # a valid database with no tables yet (version 0)
    con.execute("CREATE TABLE scratch (x)")
    con.execute("DROP TABLE scratch")
    con.close()
    return {}


def _build_v1(path: Path) -> dict:
    con = sqlite3.connect(path)
    con.executescript(V1_SCHEMA)
    con.execute("PRAGMA user_version=1")
    con.execute(
        "INSERT INTO conversations(id, title, created, updated, settings, active_leaf,"
        " color_index) VALUES ('c1', 'Made by v1', 1.0, 2.0, '{}', 'm2', 3)"
    )
    con.execute(
        "INSERT INTO messages VALUES ('m1', 'c1', NULL, 'user', 'hi', 'complete', 1.0, 'm2',"
        " '{}')"
    )
    con.execute(
        "INSERT INTO messages VALUES ('m2', 'c1', 'm1', 'assistant', 'hello', 'streaming',"
        " 1.5, NULL, '{\"usage\": {\"prompt_tokens\": 4}}')"
    )
    con.execute("INSERT INTO kv VALUES ('app_settings', '{\"theme\": \"dark\"}')")
    con.commit()
    con.close()
    return {"m1": "hi", "m2": "hello"}


def _build_v2(path: Path) -> dict:
    """Version 2 (a chat's model), as PagedChat wrote it before full-text search (v3)."""
    expected = _build_v1(path)
    con = sqlite3.connect(path)
    con.execute("ALTER TABLE conversations ADD COLUMN model TEXT NOT NULL DEFAULT ''")
    con.execute("PRAGMA user_version=2")
    con.commit()
    con.close()
    return expected


def _build_by_shipped_step(version: int, doc: str):
    """A file of `version`: the one before it, then the migration step as shipped."""

    def build(path: Path) -> dict:
        expected = BUILDERS[version - 1](path)
        con = sqlite3.connect(path)
        schema.MIGRATIONS[version - 1](con)
        con.execute(f"PRAGMA user_version={version}")
        con.commit()
        con.close()
        return expected

    build.__doc__ = doc
    return build


BUILDERS = {0: _build_v0, 1: _build_v1, 2: _build_v2}
BUILDERS[3] = _build_by_shipped_step(3, "full-text search, before folders (v4)")
BUILDERS[4] = _build_by_shipped_step(4, "folders, before search in attachments (v5)")
BUILDERS[5] = _build_by_shipped_step(5, "search in attachments, before search in tool calls (v6)")


def test_there_is_a_builder_for_every_earlier_schema():
    assert set(range(SCHEMA_VERSION)) <= set(BUILDERS)


@pytest.mark.parametrize("version", sorted(BUILDERS))
def test_migrates_from_every_earlier_schema(tmp_path, version):
    expected = BUILDERS[version](tmp_path / DB_NAME)
    store = Store(tmp_path)
    assert store.recovery is None
    con = sqlite3.connect(tmp_path / DB_NAME)
    assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    con.close()
    got = {m.id: m.content for c in store.list_conversations() for m in store.load_messages(c.id)}
    assert got == expected
    if version >= 1:
        [conv] = store.list_conversations()
        assert (conv.title, conv.active_leaf, conv.color_index) == ("Made by v1", "m2", 3)
        assert conv.model == ""  # v2: chats made before providers talk to the local engine
        assert conv.folder_id is None  # v4: chats made before folders are at the top level
        assert store.search("hello") == {"c1"}  # v3: chats made before search are indexed
        assert store.get_value("app_settings") == {"theme": "dark"}
        reply = store.get_message("m2")
        assert reply.status == "interrupted" and reply.meta["usage"]["prompt_tokens"] == 4
    store.close()


def test_adding_a_migration_is_one_function(tmp_path, monkeypatch):
    _build_v1(tmp_path / DB_NAME)
    ran = []

    def add_tags(db):  # (folders are a real migration now: the example is another table)
        ran.append(True)
        db.execute("CREATE TABLE tags (id TEXT PRIMARY KEY, name TEXT NOT NULL)")

    monkeypatch.setattr(schema, "MIGRATIONS", [*schema.MIGRATIONS, add_tags])
    store = Store(tmp_path)
    assert store.recovery is None and ran == [True]
    assert [m.id for m in store.load_messages("c1")] == ["m1", "m2"]
    store.close()
    Store(tmp_path).close()
    assert ran == [True]  # applied once
    con = sqlite3.connect(tmp_path / DB_NAME)
    assert con.execute("PRAGMA user_version").fetchone()[0] == len(schema.MIGRATIONS)
    con.close()


def test_a_failing_migration_leaves_the_file_unchanged(tmp_path, monkeypatch):
    _build_v1(tmp_path / DB_NAME)
    before = read_messages(tmp_path)

    def broken(db):
        db.execute("CREATE TABLE tags (id TEXT PRIMARY KEY)")
        db.execute("INSERT INTO no_such_table VALUES (1)")

    monkeypatch.setattr(schema, "MIGRATIONS", [*schema.MIGRATIONS, broken])
    with pytest.raises(StoreOpenError, match="could not be upgraded.*left unchanged"):
        Store(tmp_path)
    con = sqlite3.connect(tmp_path / DB_NAME)
    assert con.execute("PRAGMA user_version").fetchone()[0] == 1
    for table in ("tags", "folders", "message_fts"):  # nothing of any step is left
        found = con.execute("SELECT name FROM sqlite_master WHERE name=?", (table,))
        assert found.fetchone() is None
    con.close()
    assert read_messages(tmp_path) == before
