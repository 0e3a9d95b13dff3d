"""Full-text search (app/core/search.py): FTS5 ranking, snippets, non-Latin text, the index
kept by triggers, and the migration that indexes chats written before it existed."""

from __future__ import annotations

import sqlite3

import pytest

from app.core.records import Message, new_id
from app.core.search import MARK_END, MARK_START, fts_query
from app.core.store import DB_NAME, Store
from tests.storage_helpers import V1_SCHEMA


def marked(snippet: str) -> list[str]:
    """The marked (matched) parts of a snippet."""
    out, rest = [], snippet
    while MARK_START in rest:
        rest = rest.split(MARK_START, 1)[1]
        word, rest = rest.split(MARK_END, 1)
        out.append(word)
    return out


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path)
    yield s
    s.close()


def chat(store: Store, title: str, *texts: str) -> tuple[str, list[str]]:
    conv = store.create_conversation(title)
    parent, ids = None, []
    for i, text in enumerate(texts):
        m = Message(new_id(), conv.id, parent, ("user", "assistant")[i % 2], text)
        store.add_message(m)
        parent = m.id
        ids.append(m.id)
    return conv.id, ids


FILLER = " ".join(f"word{i}" for i in range(150))


def test_bm25_ranks_denser_matches_first_and_titles_before_messages(store):
    _, (sparse,) = chat(store, "Notes", f"{FILLER} paging {FILLER}")
    _, (dense,) = chat(store, "Other", "paging and more paging: paging everywhere")
    _, (middle,) = chat(store, "Third", f"paging once in a while {FILLER}")
    title_chat, _ = chat(store, "Paging explained", "nothing here")
    hits = store.search_hits("paging")
    assert hits[0].conversation_id == title_chat and hits[0].message_id is None
    assert [h.message_id for h in hits[1:]] == [dense, middle, sparse]
    scores = [h.score for h in hits[1:]]
    assert scores == sorted(scores)  # bm25: lower is better, strictly by rank


def test_snippets_mark_the_words_found_with_context(store):
    _, (mid,) = chat(store, "Long", f"{FILLER} the kernel reads blocks {FILLER}")
    [hit] = store.search_hits("kern blo")  # prefixes of two words, both required
    assert hit.message_id == mid
    assert marked(hit.snippet) == ["kernel", "blocks"]
    assert hit.snippet.startswith("…") and hit.snippet.endswith("…")
    assert len(hit.snippet) < 200  # a snippet, not the whole message
    assert store.search_hits("kernel nosuchword") == []


def test_non_latin_text(store):
    ru, _ = chat(store, "Заметки", "Привет, как дела?")
    el, _ = chat(store, "Σημειώσεις", "Καλημέρα κόσμε")
    zh, (zh_msg,) = chat(store, "笔记", "我们测试中文字符搜索")
    fr, _ = chat(store, "Recettes", "Un café crème")
    assert {h.conversation_id for h in store.search_hits("ПРИВЕТ")} == {ru}  # case, Cyrillic
    assert marked(store.search_hits("ПРИВЕТ")[0].snippet) == ["Привет"]
    assert {h.conversation_id for h in store.search_hits("ΚΑΛΗΜΈΡΑ")} == {el}  # case, Greek
    assert {h.conversation_id for h in store.search_hits("заметки")} == {ru}  # a title
    assert {h.conversation_id for h in store.search_hits("cafe")} == {fr}  # Latin diacritics
    # CJK without spaces is one unicode61 token: the middle of it is found by substring
    [hit] = store.search_hits("中文字符")
    assert (hit.conversation_id, hit.message_id) == (zh, zh_msg)
    assert marked(hit.snippet) == ["中文字符"]
    assert store.search("中文") == {zh}


def test_the_index_follows_edits_renames_and_deletes(store):
    cid, (mid,) = chat(store, "Draft", "the first words")
    store.update_message(mid, content="a streaming reply grew longer")  # as a reply streams
    assert store.search_hits("first") == []
    assert [h.message_id for h in store.search_hits("longer")] == [mid]
    store.rename_conversation(cid, "Holidays")
    assert [h.conversation_id for h in store.search_hits("holi")] == [cid]
    assert store.search_hits("draft") == []
    store.delete_conversation(cid)
    assert store.search_hits("longer") == [] and store.search_hits("holidays") == []


def test_odd_queries_never_raise(store):
    cid, _ = chat(store, "Symbols", 'he said "100%" of it, (a OR b) NEAR c*')
    for q in ['"', "%%", "*", "(", "OR", "NEAR(", "a -b", "'", "\\", "   "]:
        store.search_hits(q)  # FTS5 syntax is never exposed: every word is quoted
    assert store.search('"100%"') == {cid}  # found as a substring
    assert fts_query('say "hi"') == '"say"* """hi"""*'


def test_migration_indexes_chats_written_before_search(tmp_path):
    con = sqlite3.connect(tmp_path / DB_NAME)
    con.executescript(V1_SCHEMA)
    con.execute("ALTER TABLE conversations ADD COLUMN model TEXT NOT NULL DEFAULT ''")
    con.execute("PRAGMA user_version=2")  # a file from before full-text search
    con.execute("INSERT INTO conversations(id, title, created, updated) VALUES"
                " ('c1', 'Old Trip', 1, 2)")
    con.execute("INSERT INTO messages VALUES ('m1', 'c1', NULL, 'user', 'пакуем чемоданы',"
                " 'complete', 1.0, NULL, '{}')")
    con.commit()
    con.close()
    store = Store(tmp_path)
    try:
        [hit] = store.search_hits("чемодан")
        assert (hit.conversation_id, hit.message_id, hit.title) == ("c1", "m1", "Old Trip")
        assert marked(hit.snippet) == ["чемоданы"]
        assert [h.conversation_id for h in store.search_hits("trip")] == ["c1"]
        tables = {r[0] for r in store._db.execute("SELECT name FROM sqlite_master")}
        assert {"message_fts", "title_fts"} <= tables
    finally:
        store.close()


def test_the_sidebar_filter_finds_exactly_the_chats_of_the_hits(store):
    """`search` (ids only, on every keystroke) and `search_hits` (ranked) agree; substring
    hits never repeat a message FTS5 matched, however many there are."""
    chat(store, "Trip to Καλαμάτα", "we packed the tent", "and the stove")
    chat(store, "Tents", *[f"tent number {i}" for i in range(30)])
    chat(store, "中文", "测试中文字符")
    chat(store, "Symbols", "100% done", "a_b")
    for q in ("tent", "ten", "ent", "καλαμ", "字符", "100%", "a_b", "Tents", "nothing", '"'):
        hits = store.search_hits(q, limit=1000)
        assert store.search(q) == {h.conversation_id for h in hits}, q
        ids = [h.message_id for h in hits if h.message_id]
        assert len(ids) == len(set(ids)), q
    assert len([h for h in store.search_hits("ent", limit=1000) if h.message_id]) == 31
