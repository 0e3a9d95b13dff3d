"""Files attached to a message: read as text, refused with a reason when they are not
(docs/ARCHITECTURE.md §6.5).

A file is accepted by its content, not its name: any UTF-8 text (prose, Markdown, code of any
language) up to `MAX_BYTES`, or a PDF whose text layer a maintained library (pypdf) can read.
Binary data, other encodings, empty files and scanned PDFs without text are refused with a
message saying which. An attachment is stored with its message (`meta["attachments"]`: name,
kind, text), so it survives restarts, export/import and branching, and is indexed for search
(schema v5); its text goes into the prompt after the typed text, each file fenced and named.
Pure logic: no Qt.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MAX_BYTES = 4 * 2**20  # a larger file would not fit a local model's context anyway
SNIFF_BYTES = 8192


class AttachmentError(ValueError):
    """A file that cannot be attached; the message says why, for the user."""


@dataclass(frozen=True)
class Attachment:
    name: str
    kind: str  # "text" or "pdf"
    text: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def read_attachment(path: str | Path) -> Attachment:
    path = Path(path)
    try:
        size = path.stat().st_size
        if path.is_dir():
            raise AttachmentError(f"{path.name} is a folder, not a file.")
        if size > MAX_BYTES:
            raise AttachmentError(
                f"{path.name} is {size / 2**20:.1f} MiB; files up to {MAX_BYTES // 2**20} MiB "
                "can be attached."
            )
        data = path.read_bytes()
    except OSError as exc:
        raise AttachmentError(f"{path.name} cannot be read: {exc.strerror or exc}.") from exc
    if data.startswith(b"%PDF-"):
        text = _pdf_text(path)
        kind = "pdf"
    else:
        text = _plain_text(path.name, data)
        kind = "text"
    if not text.strip():
        raise AttachmentError(
            f"{path.name} has no text to read"
            + (" (a scanned PDF is pictures of text)." if kind == "pdf" else ".")
        )
    return Attachment(path.name, kind, text)


def _plain_text(name: str, data: bytes) -> str:
    if b"\x00" in data[:SNIFF_BYTES]:
        raise AttachmentError(f"{name} is a binary file; only text files and PDFs can be attached.")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise AttachmentError(
            f"{name} is not UTF-8 text (byte {exc.start} cannot be read); save it as UTF-8 "
            "to attach it."
        ) from exc


def _pdf_text(path: Path) -> str:
    import pypdf  # imported here: only a PDF attachment needs it

    try:
        reader = pypdf.PdfReader(str(path))
        return "\n\n".join((page.extract_text() or "") for page in reader.pages)
    except Exception as exc:  # pypdf raises many kinds for damaged files
        raise AttachmentError(f"{path.name} is a damaged or encrypted PDF: {exc}.") from exc


def from_meta(meta: dict[str, Any]) -> list[Attachment]:
    """The attachments stored with a message (malformed entries are skipped)."""
    out = []
    raw = meta.get("attachments")
    for item in raw if isinstance(raw, list) else []:
        if isinstance(item, dict) and all(isinstance(item.get(k), str) for k in
                                          ("name", "kind", "text")):
            out.append(Attachment(item["name"], item["kind"], item["text"]))
    return out


def to_meta(attachments: Iterable[Attachment]) -> list[dict[str, str]]:
    return [a.to_dict() for a in attachments]


def prompt_content(text: str, attachments: Sequence[Attachment]) -> str:
    """The message as the model reads it: the typed text, then each file, named and fenced
    (a fence longer than any backtick run in the file, so the file cannot close it)."""
    parts = [text]
    for a in attachments:
        longest = max((len(run) for run in _backtick_runs(a.text)), default=0)
        fence = "`" * max(3, longest + 1)
        parts.append(f"Attached file: {a.name}\n{fence}\n{a.text.rstrip()}\n{fence}")
    return "\n\n".join(p for p in parts if p)


def _backtick_runs(text: str) -> Iterable[str]:
    run = ""
    for ch in text:
        if ch == "`":
            run += ch
        elif run:
            yield run
            run = ""
    if run:
        yield run
