"""Export and import (app/core/exchange.py): the JSON round trip keeps the whole tree; a
malformed file imports nothing; Markdown and HTML show the branch shown or every branch."""

from __future__ import annotations

import json
import sqlite3
import zipfile
from pathlib import Path

import pytest

from app.core import exchange
from app.core.exchange import ExchangeError
from app.core.records import Folder
from app.core.store import Store
from tests.library_helpers import build_chat, canonical


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "a")
    yield s
    s.close()


@pytest.fixture
def other(tmp_path):
    s = Store(tmp_path / "b")
    yield s
    s.close()


def test_json_round_trip_keeps_the_whole_tree(store, other, tmp_path):
    ids = build_chat(store)
    path = exchange.export_chat(store, ids["conv"], tmp_path / "chat.json", "json")
    imported = exchange.import_file(other, path)
    assert len(imported) == 1
    new_id_ = imported[0].id
    assert new_id_ != ids["conv"]  # fresh ids...
    assert canonical(other, new_id_) == canonical(store, ids["conv"])  # ...same tree
    assert canonical(other, new_id_)["shown"][-1] == "answer to the follow-up"
    # importing into the same store again gives a second, separate chat
    exchange.import_file(store, path)
    assert len(store.list_conversations()) == 2
    again = [c.id for c in store.list_conversations() if c.id != ids["conv"]][0]
    assert canonical(store, again) == canonical(store, ids["conv"])
    assert not {m.id for m in store.load_messages(again)} & set(ids.values())


def test_export_all_to_a_zip_and_back(store, other, tmp_path):
    first = build_chat(store, "one")["conv"]
    second = build_chat(store, "one")["conv"]  # the same title: two distinct file names
    dest, n = exchange.export_all(store, tmp_path / "all.zip", "json", as_zip=True)
    assert n == 2
    with zipfile.ZipFile(dest) as z:
        assert sorted(z.namelist()) == ["one (2).json", "one.json"]
    imported = exchange.import_file(other, dest)
    got = sorted(json.dumps(canonical(other, c.id), sort_keys=True) for c in imported)
    want = sorted(json.dumps(canonical(store, c), sort_keys=True) for c in (first, second))
    assert got == want


def test_chats_keep_their_folder_by_name(store, other, tmp_path):
    ids = build_chat(store, "filed")
    build_chat(store, "loose")
    work = store.create_folder("Work")
    store.move_to_folder([ids["conv"]], work.id)
    dest, _ = exchange.export_all(store, tmp_path / "all.zip", "json", as_zip=True)
    exchange.import_file(other, dest)
    [folder] = other.list_folders()  # made by the import
    assert folder.name == "Work" and folder.id != work.id
    by_title = {c.title: c.folder_id for c in other.list_conversations()}
    assert by_title == {"filed": folder.id, "loose": None}
    exchange.import_file(other, dest)  # again: into the same folder, not a second one
    assert [f.name for f in other.list_folders()] == ["Work"]
    assert sum(c.folder_id == folder.id for c in other.list_conversations()) == 2


def test_export_all_to_a_folder_in_each_format(store, tmp_path):
    build_chat(store, "alpha")
    build_chat(store, "beta/gamma")
    for fmt in exchange.FORMATS:
        dest, n = exchange.export_all(store, tmp_path / fmt, fmt)
        names = sorted(p.name for p in dest.iterdir())
        suffix = exchange.SUFFIX[fmt]
        assert n == 2 and names == [f"alpha{suffix}", f"betagamma{suffix}"]


def malformed_variants(good: str) -> dict[str, str]:
    doc = json.loads(good)

    def edit(change) -> str:
        d = json.loads(good)
        change(d)
        return json.dumps(d)

    def set_msg(key, value):
        return lambda d: d["chats"][0]["messages"][2].__setitem__(key, value)

    return {
        "truncated": good[: len(good) // 2],
        "empty file": "",
        "not an export": json.dumps({"hello": "world"}),
        "a newer version": edit(lambda d: d.__setitem__("version", 2)),
        "version as text": edit(lambda d: d.__setitem__("version", "1")),
        "messages not a list": edit(lambda d: d["chats"][0].__setitem__("messages", {})),
        "content a number": edit(set_msg("content", 42)),
        "created as text": edit(set_msg("created", "yesterday")),
        "unknown role": edit(set_msg("role", "wizard")),
        "dangling parent": edit(set_msg("parent_id", "nope")),
        "meta a list": edit(set_msg("meta", [])),
        "duplicate id": edit(
            lambda d: d["chats"][0]["messages"][3].__setitem__(
                "id", d["chats"][0]["messages"][2]["id"]
            )
        ),
        "temperature refused": edit(
            lambda d: d["chats"][0]["settings"]["sampling"].__setitem__("temperature", -1)
        ),
        "title missing": edit(lambda d: d["chats"][0].pop("title")),
        "folder a number": edit(lambda d: d["chats"][0].__setitem__("folder", 5)),
        "colour negative": edit(lambda d: d["chats"][0].__setitem__("color_index", -3)),
        "shown leaf unknown": edit(lambda d: d["chats"][0].__setitem__("active_leaf", "x")),
        # a good first chat and a bad second one: nothing of either is imported
        "second chat bad": edit(
            lambda d: d["chats"].append({**doc["chats"][0], "messages": "oops"})
        ),
    }


def test_malformed_files_get_a_clear_error_and_import_nothing(store, other, tmp_path):
    ids = build_chat(store)
    good = exchange.to_json_text([exchange.load_chat(store, ids["conv"])])
    exchange.parse_json(good)  # the unedited file is accepted (so the edits are what fail)
    for name, text in malformed_variants(good).items():
        path = tmp_path / f"{name}.json"
        path.write_text(text, encoding="utf-8")
        with pytest.raises(ExchangeError) as err:
            exchange.import_file(other, path)
        assert str(err.value).startswith(path.name), name  # names the file...
        assert len(str(err.value)) > len(path.name) + 10, name  # ...and what is wrong
        assert other.list_conversations() == [], name
        assert other._db.execute("SELECT count(*) FROM messages").fetchone()[0] == 0, name


def test_binary_and_damaged_zip_are_refused(other, tmp_path):
    binary = tmp_path / "photo.json"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    with pytest.raises(ExchangeError, match="not UTF-8"):
        exchange.import_file(other, binary)
    empty_zip = tmp_path / "nothing.zip"
    with zipfile.ZipFile(empty_zip, "w") as z:
        z.writestr("readme.txt", "hi")
    with pytest.raises(ExchangeError, match="no .json"):
        exchange.import_file(other, empty_zip)
    with pytest.raises(ExchangeError, match="cannot be read"):
        exchange.import_file(other, tmp_path / "missing.json")
    assert other.list_conversations() == []


def test_insert_chats_is_one_transaction(store):
    """The store writes an import all or nothing: a clash in the last row undoes the rest."""
    ids = build_chat(store)
    chat = exchange.with_fresh_ids(exchange.load_chat(store, ids["conv"]))
    clash = exchange.with_fresh_ids(exchange.load_chat(store, ids["conv"]))
    clash.messages[-1].id = ids["q1"]  # already in the store
    before = len(store.list_conversations())
    with pytest.raises(sqlite3.IntegrityError):
        store.insert_chats([(chat.conversation, chat.messages),
                            (clash.conversation, clash.messages)])
    assert len(store.list_conversations()) == before
    assert store.get_conversation(chat.conversation.id) is None
    # new folders of an import go in the same transaction
    with pytest.raises(sqlite3.IntegrityError):
        store.insert_chats([(clash.conversation, clash.messages)], [Folder("f1", "New", 1.0)])
    assert store.list_folders() == []


def test_markdown_shows_the_branch_or_the_whole_tree(store):
    ids = build_chat(store)
    chat = exchange.load_chat(store, ids["conv"])
    shown = exchange.to_markdown(chat)
    assert shown.startswith("# Trees & <tags>\n")
    assert "> Answer in verse." in shown
    order = [shown.index(t) for t in ("edited question", "reply two", "кириллица", "follow-up")]
    assert order == sorted(order)
    for hidden in ("first question", "old reply", "reply one", "reply three"):
        assert hidden not in shown
    assert "## Assistant (length)" in shown
    whole = exchange.to_markdown(chat, whole_tree=True)
    for text in ("first question", "old reply", "reply one", "reply three", "follow-up"):
        assert text in whole
    assert "alternative 2.2 of 3, shown" in whole  # reply two, under the second prompt
    assert "alternative 2.1 of 3\n" in whole and "alternative 1 of 2\n" in whole


def test_html_is_self_contained_escaped_and_highlighted(store):
    ids = build_chat(store)
    page = exchange.to_html(exchange.load_chat(store, ids["conv"]), whole_tree=True)
    assert page.startswith("<!DOCTYPE html>") and "<style>" in page
    assert "<script" not in page and "&lt;script&gt;" in page  # content is not markup
    assert "<link" not in page and "src=" not in page  # nothing fetched
    assert "Trees &amp; &lt;tags&gt;" in page
    # Pygments highlighted the code block: its keyword span and the style for it
    assert '<span class="k">def</span>' in page and ".hl .k" in page
    assert "Ελληνικά и кириллица 中文" in page


def test_unknown_format_is_refused(store, tmp_path):
    ids = build_chat(store)
    with pytest.raises(ValueError, match="unknown export format"):
        exchange.export_chat(store, ids["conv"], tmp_path / "x.pdf", "pdf")
    assert not Path(tmp_path / "x.pdf").exists()
