"""Chats out of and into PagedChat: Markdown, self-contained HTML and JSON (docs/ARCHITECTURE.md
§6.5).

JSON is the lossless format: the whole message tree (branches, alternatives, which child each
node shows), the system prompt and sampling, the colour, the model and every timestamp, so an
export imported again gives the same tree. Markdown and HTML are for reading: the branch shown,
or the whole tree with its alternatives. An import is checked completely before anything is
written (a malformed file gets an `ExchangeError` naming what is wrong and imports nothing),
gets fresh ids (importing the same file twice gives two chats, never a clash), and is written
as one transaction. Pure logic: no Qt.
"""

from __future__ import annotations

import html
import json
import math
import re
import time
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from markdown_it import MarkdownIt
from pygments.formatters import HtmlFormatter

from app.core.highlighting import highlighted
from app.core.records import ChatSettings, Conversation, Folder, Message, Status, new_id
from app.core.tree import MessageTree

FORMAT = "pagedchat.chats"
VERSION = 1
FORMATS = ("markdown", "html", "json")
SUFFIX = {"markdown": ".md", "html": ".html", "json": ".json"}
ROLES = ("user", "assistant", "system", "tool")  # tool: an MCP call and its result
STATUSES = (
    Status.COMPLETE,
    Status.LENGTH,
    Status.STREAMING,
    Status.PENDING,
    Status.STOPPED,
    Status.INTERRUPTED,
    Status.ERROR,
)
MAX_IMPORT_BYTES = 256 * 1024 * 1024  # a larger "export" is not one of ours


class ExchangeError(ValueError):
    """A file that cannot be imported; the message says what is wrong, for the user."""


@dataclass
class Chat:
    """One conversation with all its messages (parents before children, siblings in order)."""

    conversation: Conversation
    messages: list[Message]
    folder: str | None = None  # the name of its folder (ids are not kept across stores)

    @property
    def tree(self) -> MessageTree:
        return MessageTree(self.messages, self.conversation.active_leaf)


# ---- JSON ----------------------------------------------------------------------------------


def chat_to_dict(chat: Chat) -> dict[str, Any]:
    c = chat.conversation
    return {
        "id": c.id,
        "title": c.title,
        "created": c.created,
        "updated": c.updated,
        "settings": c.settings.to_dict(),
        "active_leaf": c.active_leaf,
        "color_index": c.color_index,
        "model": c.model,
        "folder": chat.folder,
        "messages": [
            {
                "id": m.id,
                "parent_id": m.parent_id,
                "role": m.role,
                "content": m.content,
                "status": m.status,
                "created": m.created,
                "active_child": m.active_child,
                "meta": m.meta,
            }
            for m in chat.messages
        ],
    }


def to_json_text(chats: Sequence[Chat]) -> str:
    """The JSON export of `chats` (one or many: the same format)."""
    doc = {"format": FORMAT, "version": VERSION, "chats": [chat_to_dict(c) for c in chats]}
    return json.dumps(doc, ensure_ascii=False, indent=1)


def _where(i: int, j: int | None = None) -> str:
    return f"chat {i + 1}" + (f", message {j + 1}" if j is not None else "")


def _text(obj: dict, key: str, where: str, optional: bool = False) -> Any:
    value = obj.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ExchangeError(f"{where}: “{key}” must be text, not {_kind(value)}.")
    return value


def _number(obj: dict, key: str, where: str) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ExchangeError(f"{where}: “{key}” must be a number (a timestamp), not {_kind(value)}.")
    return float(value)


def _kind(value: Any) -> str:
    if value is None:
        return "missing"
    return {dict: "an object", list: "a list", str: "text", bool: "true/false"}.get(
        type(value), f"the {type(value).__name__} {value!r}"
    )


def _settings(value: Any, where: str) -> ChatSettings:
    """Settings exactly as given: a value the engine's validation refuses is an error here
    (the store forgives old values; an import must not silently change what it was given)."""
    if not isinstance(value, dict):
        raise ExchangeError(f"{where}: “settings” must be an object, not {_kind(value)}.")
    settings = ChatSettings.from_dict(value)
    kept = json.loads(json.dumps(settings.to_dict()))
    for key, given in value.items():
        if key == "sampling" and isinstance(given, dict):
            for name, v in given.items():
                if name in kept["sampling"] and kept["sampling"][name] != v:
                    raise ExchangeError(f"{where}: the sampling value {name}={v!r} is refused.")
        elif key in kept and kept[key] != given:
            raise ExchangeError(f"{where}: the setting {key}={given!r} is refused.")
    return settings


def _message(raw: Any, where: str) -> Message:
    if not isinstance(raw, dict):
        raise ExchangeError(f"{where}: must be an object, not {_kind(raw)}.")
    role = _text(raw, "role", where)
    if role not in ROLES:
        raise ExchangeError(f"{where}: unknown role {role!r} (expected {', '.join(ROLES)}).")
    status = _text(raw, "status", where)
    if status not in STATUSES:
        raise ExchangeError(f"{where}: unknown status {status!r}.")
    meta = raw.get("meta", {})
    if not isinstance(meta, dict):
        raise ExchangeError(f"{where}: “meta” must be an object, not {_kind(meta)}.")
    return Message(
        id=_text(raw, "id", where),
        conversation_id="",
        parent_id=_text(raw, "parent_id", where, optional=True),
        role=role,
        content=_text(raw, "content", where),
        status=status,
        created=_number(raw, "created", where),
        active_child=_text(raw, "active_child", where, optional=True),
        meta=meta,
    )


def _parents_first(messages: list[Message], where: str) -> list[Message]:
    """The messages in an order the store can insert (every parent before its children),
    keeping the file's order otherwise (it is the order of the alternatives)."""
    by_id: dict[str, Message] = {}
    for j, m in enumerate(messages):
        if m.id in by_id:
            raise ExchangeError(f"{_where_msg(where, j)}: the id {m.id!r} appears twice.")
        by_id[m.id] = m
    for j, m in enumerate(messages):
        if m.parent_id is not None and m.parent_id not in by_id:
            raise ExchangeError(
                f"{_where_msg(where, j)}: its parent {m.parent_id!r} is not in the file."
            )
    out: list[Message] = []
    placed: set[str] = set()
    pending = list(messages)
    while pending:
        rest = [m for m in pending if m.parent_id is not None and m.parent_id not in placed]
        ready = [m for m in pending if m not in rest]
        if not ready:
            raise ExchangeError(f"{where}: the messages' parents form a loop.")
        out.extend(ready)
        placed.update(m.id for m in ready)
        pending = rest
    return out


def _where_msg(where: str, j: int) -> str:
    return f"{where}, message {j + 1}"


def _chat(raw: Any, i: int) -> Chat:
    where = _where(i)
    if not isinstance(raw, dict):
        raise ExchangeError(f"{where}: must be an object, not {_kind(raw)}.")
    color = raw.get("color_index", 0)
    if isinstance(color, bool) or not isinstance(color, int) or color < 0:
        raise ExchangeError(f"{where}: “color_index” must be a whole number ≥ 0.")
    raw_messages = raw.get("messages")
    if not isinstance(raw_messages, list):
        raise ExchangeError(f"{where}: “messages” must be a list, not {_kind(raw_messages)}.")
    messages = [_message(m, _where(i, j)) for j, m in enumerate(raw_messages)]
    messages = _parents_first(messages, where)
    ids = {m.id for m in messages}
    for j, m in enumerate(messages):
        kids = {k.id for k in messages if k.parent_id == m.id}
        if m.active_child is not None and m.active_child not in kids:
            raise ExchangeError(
                f"{_where_msg(where, j)}: its shown child {m.active_child!r} is not its child."
            )
    leaf = _text(raw, "active_leaf", where, optional=True)
    if leaf is not None and leaf not in ids:
        raise ExchangeError(f"{where}: the shown message {leaf!r} is not in the file.")
    conv = Conversation(
        id=_text(raw, "id", where, optional=True) or "",
        title=_text(raw, "title", where),
        created=_number(raw, "created", where),
        updated=_number(raw, "updated", where),
        settings=_settings(raw.get("settings", {}), where),
        active_leaf=leaf,
        color_index=color,
        model=_text(raw, "model", where, optional=True) or "",
    )
    return Chat(conv, messages, _text(raw, "folder", where, optional=True))


def parse_json(text: str) -> list[Chat]:
    """The chats of a JSON export, fully checked, with their ids as in the file."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ExchangeError(
            f"This is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            "the file may be cut short."
        ) from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ExchangeError(
            f"This is not a PagedChat export (its “format” is not “{FORMAT}”)."
        )
    version = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ExchangeError("The export has no valid “version”.")
    if version > VERSION:
        raise ExchangeError(
            f"The export is version {version}, written by a newer PagedChat; this one reads "
            f"up to version {VERSION}."
        )
    if version < 1:
        raise ExchangeError(f"The export version {version} is not one PagedChat ever wrote.")
    chats = doc.get("chats")
    if not isinstance(chats, list):
        raise ExchangeError(f"“chats” must be a list, not {_kind(chats)}.")
    if not chats:
        raise ExchangeError("The export holds no chats.")
    return [_chat(raw, i) for i, raw in enumerate(chats)]


def with_fresh_ids(chat: Chat) -> Chat:
    """The same chat under new ids, so an import never clashes with what is there."""
    cid = new_id()
    ids = {m.id: new_id() for m in chat.messages}
    messages = [
        replace(
            m,
            id=ids[m.id],
            conversation_id=cid,
            parent_id=ids.get(m.parent_id) if m.parent_id else None,
            active_child=ids.get(m.active_child) if m.active_child else None,
            meta=dict(m.meta),
        )
        for m in chat.messages
    ]
    conv = replace(
        chat.conversation,
        id=cid,
        active_leaf=ids.get(chat.conversation.active_leaf or ""),
    )
    return Chat(conv, messages, chat.folder)


def read_import(path: str | Path) -> list[Chat]:
    """The chats in a JSON export, or in every .json of a zip of them; fresh ids."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_IMPORT_BYTES:
            raise ExchangeError(f"{path.name} is {size // 2**20} MiB: too large for an export.")
        zipped = zipfile.is_zipfile(path)
        texts = _zip_texts(path) if zipped else [(path.name, path.read_bytes())]
    except OSError as exc:
        raise ExchangeError(f"{path.name} cannot be read: {exc.strerror or exc}.") from exc
    chats: list[Chat] = []
    for name, data in texts:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ExchangeError(f"{name} is not UTF-8 text: not a PagedChat export.") from exc
        try:
            chats.extend(parse_json(text))
        except ExchangeError as exc:
            raise ExchangeError(f"{name}: {exc}") from exc
    return [with_fresh_ids(c) for c in chats]


def _zip_texts(path: Path) -> list[tuple[str, bytes]]:
    try:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.lower().endswith(".json")]
            if not names:
                raise ExchangeError(f"{path.name} holds no .json export.")
            if sum(z.getinfo(n).file_size for n in names) > MAX_IMPORT_BYTES:
                raise ExchangeError(f"{path.name} unpacks to too much data for an export.")
            return [(n, z.read(n)) for n in sorted(names)]
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as exc:
        raise ExchangeError(f"{path.name} is a damaged zip file: {exc}.") from exc


def import_file(store: Any, path: str | Path) -> list[Conversation]:
    """Import a JSON export (or a zip of them) into `store`, all chats in one transaction."""
    chats = read_import(path)
    folders = {f.name: f for f in store.list_folders()}
    new_folders = []
    for c in chats:  # into the folder of that name, made (in the same transaction) if new
        if c.folder:
            if c.folder not in folders:
                folders[c.folder] = Folder(new_id(), c.folder, time.time())
                new_folders.append(folders[c.folder])
            c.conversation.folder_id = folders[c.folder].id
    store.insert_chats([(c.conversation, c.messages) for c in chats], new_folders)
    return [c.conversation for c in chats]


# ---- reading formats ------------------------------------------------------------------------

ROLE_LABEL = {"user": "You", "assistant": "Assistant", "system": "System", "tool": "Tool"}


def _stamp(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def _note(m: Message) -> str:
    return "" if m.status in (Status.COMPLETE,) else f" ({m.status})"


def _walk(tree: MessageTree, whole: bool) -> Iterable[tuple[Message, str]]:
    """(message, label) in reading order: the shown branch, or every branch depth-first with
    each alternative labelled by its position ("2.1 of 3": the first reply under the second
    alternative...)."""
    if not whole:
        for m in tree.active_path():
            yield m, ""
        return
    shown = {m.id for m in tree.active_path()}

    def visit(parent: str | None, prefix: str) -> Iterable[tuple[Message, str]]:
        kids = tree.children(parent)
        for k, m in enumerate(kids, 1):
            label = ""
            if len(kids) > 1:
                tag = f"{prefix}{k}"
                label = f"alternative {tag} of {len(kids)}" + (", shown" if m.id in shown else "")
                yield m, label
                yield from visit(m.id, f"{tag}.")
            else:
                yield m, label
                yield from visit(m.id, prefix)

    yield from visit(None, "")


def to_markdown(chat: Chat, whole_tree: bool = False) -> str:
    c = chat.conversation
    lines = [f"# {c.title}", "", f"*Exported from PagedChat · created {_stamp(c.created)}*", ""]
    if c.settings.system_prompt:
        lines += ["**System prompt:**", "", _quote(c.settings.system_prompt), ""]
    for m, label in _walk(chat.tree, whole_tree):
        head = f"## {ROLE_LABEL.get(m.role, m.role)}{_note(m)}"
        if label:
            head += f" — {label}"
        lines += [head, "", shown_text(m), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def shown_text(m: Message) -> str:
    """A message as Markdown for the readable exports: a tool message is its call (name,
    arguments) and its result; a reply that called tools names them after its text."""
    if m.role == "tool":
        call = m.meta.get("tool_call") or {}
        fence = "````" if "```" in m.content else "```"
        return (f"**Tool call** `{call.get('name', '')}` {_code(call.get('arguments', ''))}"
                + (f" ({m.meta['server']})" if m.meta.get("server") else "")
                + f"\n\n{fence}\n{m.content}\n{fence}")
    calls = m.meta.get("tool_calls") or []
    named = ", ".join(f"`{c.get('function', {}).get('name', '')}`" for c in calls
                      if isinstance(c, dict))
    if named:
        return f"{m.content}\n\n*Called {named}*".strip()
    return m.content


def _code(text: str) -> str:
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _quote(text: str) -> str:
    return "\n".join("> " + line for line in text.split("\n"))


_FORMATTER = HtmlFormatter(style="default", cssclass="hl")


def _highlight(code: str, lang: str, _attrs: Any) -> str:
    out = highlighted(code, lang, _FORMATTER)
    return f"<pre>{html.escape(code)}</pre>" if out is None else out


_MD = MarkdownIt("commonmark", {"html": False, "highlight": _highlight}).enable(
    ["table", "strikethrough"]
)

_CSS = """
body { font: 15px/1.5 system-ui, sans-serif; max-width: 52em; margin: 2em auto; padding: 0 1em;
       color: #1d1d1f; }
.meta { color: #6e6e73; }
.msg { border-left: 4px solid #d0d0d5; padding: .2em 1em; margin: 1em 0; }
.msg.user { border-color: #0a84ff; }
.msg.assistant { border-color: #30d158; }
.role { font-weight: 600; }
.alt { color: #6e6e73; font-weight: normal; }
pre { overflow-x: auto; padding: .6em; background: #f6f8fa; border-radius: 6px; }
code { font-family: ui-monospace, Menlo, monospace; }
blockquote { color: #444; border-left: 3px solid #ccc; margin-left: 0; padding-left: 1em; }
table { border-collapse: collapse; } td, th { border: 1px solid #ccc; padding: .2em .5em; }
"""


def to_html(chat: Chat, whole_tree: bool = False) -> str:
    """One self-contained page (inline CSS, no scripts, nothing fetched): raw HTML in messages
    is escaped, code blocks are highlighted by Pygments."""
    c = chat.conversation
    body = [
        f"<h1>{html.escape(c.title)}</h1>",
        f'<p class="meta">Exported from PagedChat · created {_stamp(c.created)}</p>',
    ]
    if c.settings.system_prompt:
        body.append(
            '<div class="msg system"><div class="role">System prompt</div>'
            f"{_MD.render(c.settings.system_prompt)}</div>"
        )
    for m, label in _walk(chat.tree, whole_tree):
        alt = f' <span class="alt">— {html.escape(label)}</span>' if label else ""
        role = html.escape(ROLE_LABEL.get(m.role, m.role) + _note(m))
        body.append(
            f'<div class="msg {html.escape(m.role)}"><div class="role">{role}{alt}</div>'
            f"{_MD.render(shown_text(m))}</div>"
        )
    css = _CSS + _FORMATTER.get_style_defs(".hl")
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f"<title>{html.escape(c.title)}</title><style>{css}</style></head>"
        f"<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def render(chat: Chat, fmt: str, whole_tree: bool = False) -> str:
    """`chat` as text in `fmt` (one of FORMATS); JSON always holds the whole tree."""
    if fmt == "json":
        return to_json_text([chat])
    if fmt == "markdown":
        return to_markdown(chat, whole_tree)
    if fmt == "html":
        return to_html(chat, whole_tree)
    raise ValueError(f"unknown export format {fmt!r} (expected one of {', '.join(FORMATS)})")


# ---- files ----------------------------------------------------------------------------------


def load_chat(store: Any, conversation_id: str) -> Chat:
    conv = store.get_conversation(conversation_id)
    if conv is None:
        raise ExchangeError("That chat no longer exists.")
    folder = store.get_folder(conv.folder_id) if conv.folder_id else None
    return Chat(conv, store.load_messages(conversation_id), folder.name if folder else None)


def export_chat(
    store: Any, conversation_id: str, path: str | Path, fmt: str, whole_tree: bool = False
) -> Path:
    path = Path(path)
    _write(path, render(load_chat(store, conversation_id), fmt, whole_tree))
    return path


def file_name(chat: Chat, fmt: str, taken: set[str]) -> str:
    """A portable file name from the title, unique within `taken` (which it joins)."""
    stem = re.sub(r"[^\w\- ]+", "", chat.conversation.title, flags=re.UNICODE).strip()
    stem = re.sub(r"\s+", " ", stem)[:60] or "chat"
    name, n = stem + SUFFIX[fmt], 2
    while name.lower() in taken:
        name, n = f"{stem} ({n}){SUFFIX[fmt]}", n + 1
    taken.add(name.lower())
    return name


def export_all(
    store: Any, dest: str | Path, fmt: str, as_zip: bool = False, whole_tree: bool = True
) -> tuple[Path, int]:
    """Every chat, one file each, into the folder `dest` or the zip file `dest`; returns the
    path written and how many chats."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}")
    dest = Path(dest)
    taken: set[str] = set()
    chats = [load_chat(store, c.id) for c in store.list_conversations()]
    files = [(file_name(c, fmt, taken), render(c, fmt, whole_tree)) for c in chats]
    try:
        if as_zip:
            tmp = dest.with_name(dest.name + ".part")
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
                for name, text in files:
                    z.writestr(name, text)
            tmp.replace(dest)
        else:
            dest.mkdir(parents=True, exist_ok=True)
            for name, text in files:
                _write(dest / name, text)
    except OSError as exc:
        raise ExchangeError(f"Cannot write to {dest}: {exc.strerror or exc}.") from exc
    return dest, len(chats)


def _write(path: Path, text: str) -> None:
    """Write via a temporary file, so a failure never leaves half an export behind."""
    tmp = path.with_name(path.name + ".part")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ExchangeError(f"Cannot write {path}: {exc.strerror or exc}.") from exc


__all__ = [
    "FORMATS",
    "Chat",
    "ExchangeError",
    "export_all",
    "export_chat",
    "import_file",
    "parse_json",
    "read_import",
    "render",
    "to_html",
    "to_json_text",
    "to_markdown",
]
