"""Full-text search over chat titles, messages and attached files: SQLite FTS5, ranked, with
snippets (docs/ARCHITECTURE.md §6.5).

Two FTS5 indexes (schema version 3, app/core/schema.py) mirror `conversations.title` and
`messages.content` as external-content tables kept current by triggers, so every write path
(the store, the retry thread, salvage) indexes without knowing it. The `unicode61` tokenizer
folds case in every script (Cyrillic, Greek...) and removes Latin diacritics; each word
typed is matched as a prefix, since people search while they type. FTS5 cannot see inside a
token: the middle of a word, a run of CJK characters without spaces (one token to unicode61),
symbols. So hits FTS5 does not find but a plain substring does follow the ranked ones, with a
snippet cut around the substring here. Ranking is FTS5's bm25: title hits first, then
messages, then attached files' text (schema v5), best first. Pure logic over a connection: no Qt.
"""

from __future__ import annotations

import contextlib
import sqlite3
from dataclasses import dataclass

MARK_START = "\x02"  # around each matched term in a snippet (text never holds these)
MARK_END = "\x03"
ELLIPSIS = "…"
SNIPPET_TOKENS = 12  # words of context in an FTS5 snippet
SNIPPET_CHARS = 40  # characters of context either side of a substring hit
TOKENIZER = "unicode61 remove_diacritics 2"
ATTACHMENT_ROLE = "attachment"  # a Hit's role when the text of an attached file matched
TOOL_CALL_ROLE = "tool call"  # a Hit's role when a tool call's name or arguments matched


@dataclass(frozen=True)
class Hit:
    conversation_id: str
    message_id: str | None  # None: the chat's title matched
    title: str
    snippet: str  # with MARK_START / MARK_END around what matched
    role: str = ""  # the message's role ("" for a title)
    score: float = 0.0  # bm25: lower is better; substring-only hits come after all of them


def fts_query(text: str) -> str:
    """The user's words as an FTS5 query: each a quoted prefix, all required. Quoting makes
    every input valid syntax (no operators: a search box is not a query language)."""
    return " ".join('"' + word.replace('"', '""') + '"*' for word in text.split())


def _like(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _fts(db: sqlite3.Connection, sql: str, query: str, limit: int) -> list[sqlite3.Row]:
    if not query:
        return []
    try:
        return db.execute(sql, (query, limit)).fetchall()
    except sqlite3.OperationalError:  # e.g. a query of symbols only: no tokens, no hits
        return []


def substring_snippet(text: str, needle: str) -> str:
    """`text` around the first case-insensitive occurrence of `needle`, marked."""
    i = text.casefold().find(needle.casefold())
    if i < 0:
        return text[: 2 * SNIPPET_CHARS]
    j = i + len(needle)
    start, end = max(0, i - SNIPPET_CHARS), min(len(text), j + SNIPPET_CHARS)
    head = ELLIPSIS if start else ""
    tail = ELLIPSIS if end < len(text) else ""
    return f"{head}{text[start:i]}{MARK_START}{text[i:j]}{MARK_END}{text[j:end]}{tail}"


def search(db: sqlite3.Connection, text: str, limit: int = 200) -> list[Hit]:
    """Hits for `text`: FTS5 title hits, FTS5 message hits (each by bm25), then substring
    hits FTS5 did not find; at most `limit` of each kind."""
    text = text.strip()
    if not text:
        return []
    query = fts_query(text)
    hits: list[Hit] = []
    seen_titles: set[str] = set()
    seen_messages: set[str] = set()
    for r in _fts(
        db,
        f"SELECT c.id, c.title, highlight(title_fts, 0, '{MARK_START}', '{MARK_END}'),"
        " bm25(title_fts) FROM title_fts JOIN conversations c ON c.rowid = title_fts.rowid"
        " WHERE title_fts MATCH ? ORDER BY rank LIMIT ?",
        query,
        limit,
    ):
        seen_titles.add(r[0])
        hits.append(Hit(r[0], None, r[1], r[2], "", r[3]))
    for r in _fts(
        db,
        "SELECT m.conversation_id, m.id, c.title, m.role,"
        f" snippet(message_fts, 0, '{MARK_START}', '{MARK_END}', '{ELLIPSIS}', {SNIPPET_TOKENS}),"
        " bm25(message_fts) FROM message_fts"
        " JOIN messages m ON m.rowid = message_fts.rowid"
        " JOIN conversations c ON c.id = m.conversation_id"
        " WHERE message_fts MATCH ? ORDER BY rank LIMIT ?",
        query,
        limit,
    ):
        seen_messages.add(r[1])
        hits.append(Hit(r[0], r[1], r[2], r[4], r[3], r[5]))
    for r in _fts(
        db,
        "SELECT m.conversation_id, m.id, c.title,"
        f" snippet(attachment_fts, 0, '{MARK_START}', '{MARK_END}', '{ELLIPSIS}',"
        f" {SNIPPET_TOKENS}), bm25(attachment_fts) FROM attachment_fts"
        " JOIN messages m ON m.rowid = attachment_fts.rowid"
        " JOIN conversations c ON c.id = m.conversation_id"
        " WHERE attachment_fts MATCH ? ORDER BY rank LIMIT ?",
        query,
        limit,
    ):
        hits.append(Hit(r[0], r[1], r[2], r[3], ATTACHMENT_ROLE, r[4]))
    for r in _fts(
        db,
        "SELECT m.conversation_id, m.id, c.title,"
        f" snippet(tool_call_fts, 0, '{MARK_START}', '{MARK_END}', '{ELLIPSIS}',"
        f" {SNIPPET_TOKENS}), bm25(tool_call_fts) FROM tool_call_fts"
        " JOIN messages m ON m.rowid = tool_call_fts.rowid"
        " JOIN conversations c ON c.id = m.conversation_id"
        " WHERE tool_call_fts MATCH ? ORDER BY rank LIMIT ?",
        query,
        limit,
    ):
        hits.append(Hit(r[0], r[1], r[2], r[3], TOOL_CALL_ROLE, r[4]))
    # substring hits: only rows FTS5 matched nowhere (not merely outside its first `limit`)
    pattern = _like(text)
    title_rows = _like_rows(
        db,
        "SELECT id, title FROM conversations WHERE title LIKE ? ESCAPE '\\'"
        " AND rowid NOT IN (SELECT rowid FROM title_fts WHERE title_fts MATCH ?) LIMIT ?",
        "SELECT id, title FROM conversations WHERE title LIKE ? ESCAPE '\\' LIMIT ?",
        pattern, query, limit,
    )
    for r in title_rows:
        if r[0] not in seen_titles:
            hits.append(Hit(r[0], None, r[1], substring_snippet(r[1], text), "", float("inf")))
    message_sql = (
        "SELECT m.conversation_id, m.id, c.title, m.role, m.content FROM messages m"
        " JOIN conversations c ON c.id = m.conversation_id"
        " WHERE m.content LIKE ? ESCAPE '\\'{} ORDER BY m.created DESC LIMIT ?"
    )
    message_rows = _like_rows(
        db,
        message_sql.format(
            " AND m.rowid NOT IN (SELECT rowid FROM message_fts WHERE message_fts MATCH ?)"
        ),
        message_sql.format(""),
        pattern, query, limit,
    )
    for r in message_rows:
        if r[1] not in seen_messages:
            snippet = substring_snippet(r[4], text)
            hits.append(Hit(r[0], r[1], r[2], snippet, r[3], float("inf")))
    return hits


def _like_rows(
    db: sqlite3.Connection, sql: str, fallback: str, pattern: str, query: str, limit: int
) -> list[sqlite3.Row]:
    """`sql` (LIKE minus FTS5 matches), or `fallback` (LIKE alone) when the FTS5 query has
    no tokens (symbols only) and SQLite refuses it."""
    if query:
        try:
            return db.execute(sql, (pattern, query, limit)).fetchall()
        except sqlite3.OperationalError:
            pass
    return db.execute(fallback, (pattern, limit)).fetchall()


def matching_chats(db: sqlite3.Connection, text: str) -> set[str]:
    """Ids of the chats with any hit (the sidebar's filter): the same matches as `search`,
    without ranking or snippets (it runs on every keystroke)."""
    text = text.strip()
    if not text:
        return set()
    query = fts_query(text)
    out: set[str] = set()
    for sql in (
        "SELECT c.id FROM title_fts JOIN conversations c ON c.rowid = title_fts.rowid"
        " WHERE title_fts MATCH ?",
        "SELECT DISTINCT m.conversation_id FROM message_fts"
        " JOIN messages m ON m.rowid = message_fts.rowid WHERE message_fts MATCH ?",
        "SELECT DISTINCT m.conversation_id FROM attachment_fts"
        " JOIN messages m ON m.rowid = attachment_fts.rowid WHERE attachment_fts MATCH ?",
        "SELECT DISTINCT m.conversation_id FROM tool_call_fts"
        " JOIN messages m ON m.rowid = tool_call_fts.rowid WHERE tool_call_fts MATCH ?",
    ):
        if query:
            with contextlib.suppress(sqlite3.OperationalError):  # no tokens: no FTS5 hits
                out.update(r[0] for r in db.execute(sql, (query,)))
    pattern = _like(text)
    out.update(r[0] for r in db.execute(
        "SELECT id FROM conversations WHERE title LIKE ? ESCAPE '\\' UNION"
        " SELECT conversation_id FROM messages WHERE content LIKE ? ESCAPE '\\'",
        (pattern, pattern),
    ))
    return out


def attachment_index_sql() -> list[str]:
    """Schema v5: the text of the files attached to messages (`meta["attachments"]`, see
    app/core/attachments.py), in an FTS5 table of its own keyed by the message's rowid."""
    rows = (
        "SELECT {m}.rowid, group_concat(json_extract(value, '$.text'), char(10))"
        " FROM json_each(CASE WHEN json_valid({m}.meta) THEN {m}.meta ELSE '{{}}' END,"
        " '$.attachments') HAVING count(*) > 0"
    )
    return [
        f"CREATE VIRTUAL TABLE attachment_fts USING fts5(text, tokenize='{TOKENIZER}')",
        "CREATE TRIGGER attachment_fts_ai AFTER INSERT ON messages BEGIN"
        f" INSERT INTO attachment_fts(rowid, text) {rows.format(m='new')}; END",
        "CREATE TRIGGER attachment_fts_ad AFTER DELETE ON messages BEGIN"
        " DELETE FROM attachment_fts WHERE rowid = old.rowid; END",
        "CREATE TRIGGER attachment_fts_au AFTER UPDATE OF meta ON messages BEGIN"
        " DELETE FROM attachment_fts WHERE rowid = old.rowid;"
        f" INSERT INTO attachment_fts(rowid, text) {rows.format(m='new')}; END",
        "INSERT INTO attachment_fts(rowid, text)"
        " SELECT m.rowid, group_concat(json_extract(a.value, '$.text'), char(10))"
        " FROM messages m, json_each(CASE WHEN json_valid(m.meta) THEN m.meta ELSE '{}' END,"
        " '$.attachments') a GROUP BY m.rowid",
    ]


def tool_call_index_sql() -> list[str]:
    """Schema v6: the name and arguments of the tool call a `tool` message answers
    (`meta["tool_call"]`, app/chat/session.py), in an FTS5 table keyed by the message's
    rowid; its result is the message's content, in `message_fts` already."""
    text = ("json_extract({m}.meta, '$.tool_call.name') || ' ' ||"
            " coalesce(json_extract({m}.meta, '$.tool_call.arguments'), '')")
    rows = ("SELECT {m}.rowid, " + text + " WHERE json_valid({m}.meta)"
            " AND json_extract({m}.meta, '$.tool_call.name') IS NOT NULL")
    return [
        f"CREATE VIRTUAL TABLE tool_call_fts USING fts5(text, tokenize='{TOKENIZER}')",
        "CREATE TRIGGER tool_call_fts_ai AFTER INSERT ON messages BEGIN"
        f" INSERT INTO tool_call_fts(rowid, text) {rows.format(m='new')}; END",
        "CREATE TRIGGER tool_call_fts_ad AFTER DELETE ON messages BEGIN"
        " DELETE FROM tool_call_fts WHERE rowid = old.rowid; END",
        "CREATE TRIGGER tool_call_fts_au AFTER UPDATE OF meta ON messages BEGIN"
        " DELETE FROM tool_call_fts WHERE rowid = old.rowid;"
        f" INSERT INTO tool_call_fts(rowid, text) {rows.format(m='new')}; END",
        "INSERT INTO tool_call_fts(rowid, text) SELECT m.rowid, "
        + text.format(m="m") + " FROM messages m WHERE json_valid(m.meta)"
        " AND json_extract(m.meta, '$.tool_call.name') IS NOT NULL",
    ]


def index_sql() -> list[str]:
    """The statements that create both indexes, their triggers, and fill them from the rows
    already there (the migration that brings an existing database to full-text search)."""
    out = []
    for table, source, column in (
        ("message_fts", "messages", "content"),
        ("title_fts", "conversations", "title"),
    ):
        delete = (
            f"INSERT INTO {table}({table}, rowid, {column}) VALUES ('delete', old.rowid,"
            f" old.{column});"
        )
        insert = f"INSERT INTO {table}(rowid, {column}) VALUES (new.rowid, new.{column});"
        out += [
            f"CREATE VIRTUAL TABLE {table} USING fts5({column}, content='{source}',"
            f" content_rowid='rowid', tokenize='{TOKENIZER}')",
            f"CREATE TRIGGER {table}_ai AFTER INSERT ON {source} BEGIN {insert} END",
            f"CREATE TRIGGER {table}_ad AFTER DELETE ON {source} BEGIN {delete} END",
            f"CREATE TRIGGER {table}_au AFTER UPDATE OF {column} ON {source} BEGIN"
            f" {delete} {insert} END",
            f"INSERT INTO {table}({table}) VALUES ('rebuild')",
        ]
    return out
