"""Attachments (app/core/attachments.py): what is accepted and what is refused (and why), the
prompt the model reads, storage with the message, search in attached text, and the v5
migration that indexes files attached before it."""

from __future__ import annotations

import sqlite3

import pytest

from app.core import attachments
from app.core.attachments import Attachment, AttachmentError, prompt_content, read_attachment
from app.core.records import Message, new_id
from app.core.search import ATTACHMENT_ROLE, MARK_START
from app.core.session_logic import prompt_messages
from app.core.store import DB_NAME, Store


def minimal_pdf(text: str) -> bytes:
    """A valid one-page PDF whose text layer holds `text` (Helvetica, one line), with a
    correct cross-reference table."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R"
        b" /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1, xref)
    return bytes(out)


def test_text_markdown_and_code_are_read(tmp_path):
    files = {
        "notes.txt": "plain words\n",
        "README.md": "# Title\n\n- item\n",
        "kernel.cu": "__global__ void k() {}\n",  # any text, whatever the extension
        "bom.py": "\ufeffprint('hi')\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        a = read_attachment(tmp_path / name)
        assert (a.name, a.kind, a.text) == (name, "text", text.lstrip("\ufeff"))


@pytest.mark.parametrize(
    "name, data, reason",
    [
        ("photo.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary file"),
        ("latin1.txt", "café crème".encode("latin-1"), "not UTF-8 text"),
        ("empty.md", b"   \n", "no text"),
    ],
)
def test_binary_and_unreadable_files_are_refused_with_a_reason(tmp_path, name, data, reason):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(AttachmentError, match=reason) as err:
        read_attachment(tmp_path / name)
    assert str(err.value).startswith(name)


def test_folders_missing_and_huge_files_are_refused(tmp_path, monkeypatch):
    with pytest.raises(AttachmentError, match="folder"):
        read_attachment(tmp_path)
    with pytest.raises(AttachmentError, match="cannot be read"):
        read_attachment(tmp_path / "gone.txt")
    monkeypatch.setattr(attachments, "MAX_BYTES", 10)
    (tmp_path / "big.txt").write_text("x" * 11)
    with pytest.raises(AttachmentError, match="up to"):
        read_attachment(tmp_path / "big.txt")


def test_a_real_pdf(tmp_path):
    path = tmp_path / "paper.pdf"
    path.write_bytes(minimal_pdf("Paged attention shares blocks"))
    a = read_attachment(path)
    assert a.kind == "pdf" and "Paged attention shares blocks" in a.text
    # a damaged one (its text stream cut off) is refused with a reason
    (tmp_path / "cut.pdf").write_bytes(path.read_bytes()[:40])
    with pytest.raises(AttachmentError, match="cut.pdf"):
        read_attachment(tmp_path / "cut.pdf")


def test_the_prompt_carries_each_file_fenced_and_named():
    files = [Attachment("a.md", "text", "# A\nuse ```code``` here"),
             Attachment("b.py", "text", "x = 1\n")]
    content = prompt_content("Compare these.", files)
    assert content.startswith("Compare these.\n\nAttached file: a.md\n````\n# A\n")
    assert "\n````\n\nAttached file: b.py\n```\nx = 1\n```" in content  # a longer fence
    path = [Message("u", "c", None, "user", "Compare these.",
                    meta={"attachments": attachments.to_meta(files)})]
    assert prompt_messages("", path) == [{"role": "user", "content": content}]


def test_stored_with_the_message_and_searchable(tmp_path):
    store = Store(tmp_path)
    conv = store.create_conversation("Docs")
    files = [Attachment("spec.md", "text", "The квота of blocks per sequence")]
    m = Message(new_id(), conv.id, None, "user", "see the file",
                meta={"attachments": attachments.to_meta(files)})
    store.add_message(m)
    store.close()
    store = Store(tmp_path)
    [again] = store.load_messages(conv.id)
    assert attachments.from_meta(again.meta) == files
    [hit] = store.search_hits("КВОТА")
    assert (hit.message_id, hit.role) == (m.id, ATTACHMENT_ROLE)
    assert MARK_START + "квота" in hit.snippet
    store.update_message(m.id, meta={})  # the attachment removed: no longer found
    assert store.search_hits("квота") == []
    store.close()


def test_migration_indexes_files_attached_before_search_in_them(tmp_path):
    store = Store(tmp_path)
    conv = store.create_conversation("Old")
    store.add_message(Message("m1", conv.id, None, "user", "hi", meta={
        "attachments": [{"name": "x.txt", "kind": "text", "text": "zebrafish genome"}]}))
    store.close()
    con = sqlite3.connect(tmp_path / DB_NAME)  # back to version 4: no attachment index
    for index in ("attachment_fts", "tool_call_fts"):  # (v5's, and v6's, made after it)
        for suffix in ("ai", "ad", "au"):
            con.execute(f"DROP TRIGGER {index}_{suffix}")
        con.execute(f"DROP TABLE {index}")
    con.execute("PRAGMA user_version=4")
    con.commit()
    con.close()
    store = Store(tmp_path)
    try:
        assert [h.message_id for h in store.search_hits("zebrafish")] == ["m1"]
    finally:
        store.close()
