"""Opening the chat database so that damage never locks the user out.

At open the file is checked (`PRAGMA quick_check`, then the schema's migrations and columns).
A damaged file (a garbled page, a truncation, an empty file, a folder in its place, tables that
are not ours) is moved aside under a timestamped name, never deleted, and what can still be
read from it is copied row by row into a fresh database, so the app starts with every readable
chat and the user is told where the damaged copy is. Python's sqlite3 has no `.recover`, so
salvage reads each table by rowid, skipping rows whose pages cannot be read. Faults that are
not damage (a read-only folder, a file from a newer PagedChat) raise `StoreOpenError` with a
message for the user and leave the file alone.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.core import schema

# SQLite primary result codes that mean "cannot get at the file", not "the file is damaged".
_ACCESS_CODES = {
    3: "permission denied",  # SQLITE_PERM
    5: "the database is locked by another program",  # SQLITE_BUSY
    6: "the database is locked by another program",  # SQLITE_LOCKED
    8: "the data folder is read-only",  # SQLITE_READONLY
    10: "a disk read or write failed",  # SQLITE_IOERR
    13: "disk full",  # SQLITE_FULL
    14: "the file cannot be opened",  # SQLITE_CANTOPEN
}


class StoreOpenError(RuntimeError):
    """The database cannot be opened; str() is a complete sentence for the user."""


def folder_problem(folder: Path) -> str | None:
    """Why nothing can be written in `folder` (read-only mount, no permission), if so."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return "the data folder is on a read-only disk"
    except OSError:
        pass
    if not os.access(folder, os.W_OK):
        return "the data folder is read-only for this user"
    return None


def describe_error(exc: BaseException) -> str | None:
    """A short user-facing cause for an SQLite error that is about access, not damage."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is None:
        return None
    return _ACCESS_CODES.get(code & 0xFF)


@dataclass
class Recovery:
    """What happened to a damaged database at open (shown in the app and on stderr)."""

    reason: str
    moved_to: Path
    counts: dict[str, int] = field(default_factory=dict)
    unreadable: bool = False

    def message(self) -> str:
        conv, msgs = self.counts.get("conversations", 0), self.counts.get("messages", 0)
        if conv or msgs:
            got = f"Recovered {conv} chat(s) and {msgs} message(s) into a fresh database"
            got += "; some damaged rows could not be read." if self.unreadable else "."
        else:
            got = "Nothing could be read from it; PagedChat started with an empty database."
        return (
            f"The chat database was damaged ({self.reason}). The damaged copy was kept as "
            f"{self.moved_to}. {got}"
        )


def connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    db.row_factory = sqlite3.Row
    return db


def _integrity_problem(db: sqlite3.Connection) -> str | None:
    rows = [r[0] for r in db.execute("PRAGMA quick_check")]
    return None if rows == ["ok"] else "; ".join(str(r) for r in rows[:3])


def _precheck(path: Path) -> str | None:
    """A reason the file cannot be a database at all, without opening it."""
    if not (path.exists() or path.is_symlink()):
        return None
    if path.is_dir():
        return "a folder is in its place"
    if not path.is_file():
        return "it is not a regular file"
    wal = Path(f"{path}-wal")
    if path.stat().st_size == 0 and not (wal.is_file() and wal.stat().st_size > 0):
        return "the file is empty (0 bytes)"
    return None


def open_checked(path: Path) -> tuple[sqlite3.Connection, Recovery | None]:
    """An open, migrated connection to `path`, recovering a damaged file first."""
    reason = _precheck(path)
    if reason is None:
        db = None
        try:
            db = connect(path)
            problem = _integrity_problem(db)
            if problem is None:
                schema.migrate(db)
                return db, None
            reason = f"integrity check: {problem}"
        except schema.NewerSchemaError as exc:
            raise StoreOpenError(
                f"The chat database {path} cannot be used: {exc}. Run the newer PagedChat, "
                "or move the file away to start with an empty one."
            ) from exc
        except schema.MigrationError as exc:
            raise StoreOpenError(
                f"The chat database {path} could not be upgraded ({exc}); it was left "
                "unchanged. Please report this."
            ) from exc
        except schema.SchemaError as exc:
            reason = f"its tables are not PagedChat's: {exc}"
        except sqlite3.DatabaseError as exc:
            cause = describe_error(exc)
            if cause is not None:
                cause = folder_problem(path.parent) or cause
                raise StoreOpenError(
                    f"The chat database {path} cannot be opened: {cause} ({exc})."
                ) from exc
            reason = str(exc)
        if db is not None:
            db.close()
    try:
        aside = move_aside(path)
    except OSError as exc:
        raise StoreOpenError(
            f"The chat database {path} is damaged ({reason}) and could not be moved aside: "
            f"{exc.strerror or exc}."
        ) from exc
    try:
        db = connect(path)
        schema.migrate(db)
    except sqlite3.DatabaseError as exc:
        raise StoreOpenError(
            f"The chat database {path} was damaged ({reason}) and kept as {aside}, but a "
            f"fresh one cannot be created: {describe_error(exc) or exc}."
        ) from exc
    recovery = Recovery(reason=reason, moved_to=aside)
    if aside.is_file():
        recovery.counts, recovery.unreadable = salvage(aside, db)
    return db, recovery


def move_aside(path: Path) -> Path:
    """Rename the damaged file (and its WAL) to `<name>.damaged-<time>`; drop its -shm."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    os.replace(path, aside)
    for suffix in ("-wal", "-journal"):
        extra = Path(f"{path}{suffix}")
        if extra.exists():
            os.replace(extra, Path(f"{aside}{suffix}"))
    Path(f"{path}-shm").unlink(missing_ok=True)  # derived from the WAL: rebuilt by SQLite
    return aside


# ---- salvage ----------------------------------------------------------------------------

_PROBE_BEYOND = 10_000  # rowids probed past the last readable one when max(rowid) fails


def _read_table(db: sqlite3.Connection, table: str) -> tuple[dict[int, dict[str, Any]], bool]:
    """{rowid: row} of every readable row, and whether some could not be read."""
    rows: dict[int, dict[str, Any]] = {}
    try:
        names = [r[1] for r in db.execute(f"PRAGMA table_info({table})")]
    except sqlite3.DatabaseError:
        return rows, True  # the schema itself is unreadable
    if not names:
        return rows, False  # no such table in this file
    select = f"SELECT rowid, {', '.join(names)} FROM {table}"
    try:
        for r in db.execute(select):
            rows[r[0]] = dict(zip(names, tuple(r)[1:], strict=True))
        return rows, False
    except sqlite3.DatabaseError:
        pass
    # A damaged page stopped the scan: fetch the rest one rowid at a time.
    try:
        hi = db.execute(f"SELECT max(rowid) FROM {table}").fetchone()[0]
    except sqlite3.DatabaseError:
        hi = None
    limit = hi if isinstance(hi, int) else max(rows, default=0) + _PROBE_BEYOND
    for rid in range(1, limit + 1):
        if rid in rows:
            continue
        try:
            found = db.execute(f"{select} WHERE rowid=?", (rid,)).fetchone()
        except sqlite3.DatabaseError:
            continue
        if found is not None:
            rows[rid] = dict(zip(names, tuple(found)[1:], strict=True))
    return rows, True


def _fill(table: str, row: dict[str, Any], now: float) -> dict[str, Any] | None:
    """The row restricted to today's columns with NOT NULL gaps filled; None if unusable."""
    cols = schema.REQUIRED_COLUMNS[table]
    out = {c: row.get(c) for c in cols}
    if table == "conversations":
        if not isinstance(out["id"], str):
            return None
        out["title"] = out["title"] if isinstance(out["title"], str) else "Recovered chat"
        out["created"] = out["created"] if out["created"] is not None else now
        out["updated"] = out["updated"] if out["updated"] is not None else out["created"]
        out["settings"] = out["settings"] if isinstance(out["settings"], str) else "{}"
        out["color_index"] = out["color_index"] if isinstance(out["color_index"], int) else 0
        out["model"] = out["model"] if isinstance(out["model"], str) else ""
    elif table == "messages":
        if not all(isinstance(out[c], str) for c in ("id", "conversation_id", "role")):
            return None
        out["content"] = out["content"] if isinstance(out["content"], str) else ""
        out["status"] = out["status"] if isinstance(out["status"], str) else "interrupted"
        out["created"] = out["created"] if out["created"] is not None else now
        out["meta"] = out["meta"] if isinstance(out["meta"], str) else "{}"
    elif table == "kv" and (not isinstance(out["key"], str) or out["value"] is None):
        return None
    elif table == "folders":
        if not isinstance(out["id"], str):
            return None
        out["name"] = out["name"] if isinstance(out["name"], str) else "Recovered folder"
        out["created"] = out["created"] if out["created"] is not None else now
        out["settings"] = out["settings"] if isinstance(out["settings"], str) else None
    return out


_MAGIC = b"SQLite format 3\x00"


def _restore_magic(path: Path) -> None:
    """A garbled first 16 bytes make SQLite refuse the whole file; they are a constant."""
    with open(path, "r+b") as f:
        head = f.read(len(_MAGIC))
        if len(head) == len(_MAGIC) and head != _MAGIC:
            f.seek(0)
            f.write(_MAGIC)


def salvage(source: Path, fresh: sqlite3.Connection) -> tuple[dict[str, int], bool]:
    """Copy every readable row of `source` into `fresh`; the kept copy is never modified."""
    with tempfile.TemporaryDirectory(prefix="pagedchat-salvage-") as tmp:
        copy = Path(tmp) / "damaged.sqlite3"
        shutil.copyfile(source, copy)
        if Path(f"{source}-wal").is_file():
            shutil.copyfile(f"{source}-wal", f"{copy}-wal")
        _restore_magic(copy)
        src = sqlite3.connect(str(copy), isolation_level=None)
        # A truncated file is shorter than its header says: SQLite refuses it unless the
        # schema is "writable", then reads what is there (only this scratch copy is opened).
        src.execute("PRAGMA writable_schema=ON")
        src.execute("PRAGMA cell_size_check=ON")
        try:
            return _salvage_into(src, fresh)
        finally:
            src.close()


def _salvage_into(
    src: sqlite3.Connection, fresh: sqlite3.Connection
) -> tuple[dict[str, int], bool]:
    now = time.time()
    counts: dict[str, int] = {}
    unreadable = False
    fresh.execute("PRAGMA foreign_keys=OFF")
    fresh.execute("BEGIN")
    try:
        for table in schema.REQUIRED_COLUMNS:
            rows, damaged = _read_table(src, table)
            unreadable |= damaged
            cols = schema.REQUIRED_COLUMNS[table]
            sql = (
                f"INSERT OR IGNORE INTO {table}(rowid, {', '.join(cols)}) "
                f"VALUES (?, {', '.join('?' for _ in cols)})"
            )
            n = 0
            for rid in sorted(rows):
                filled = _fill(table, rows[rid], now)
                if filled is None:
                    unreadable = True
                    continue
                n += fresh.execute(sql, (rid, *filled.values())).rowcount
            counts[table] = n
        # Mend references into rows that were lost, so every kept message can be shown.
        orphans = fresh.execute(
            "SELECT DISTINCT conversation_id FROM messages "
            "WHERE conversation_id NOT IN (SELECT id FROM conversations)"
        ).fetchall()
        for (cid,) in orphans:
            fresh.execute(
                "INSERT INTO conversations(id, title, created, updated) VALUES (?, ?, ?, ?)",
                (cid, "Recovered chat", now, now),
            )
        counts["conversations"] = counts.get("conversations", 0) + len(orphans)
        fresh.execute(
            "UPDATE messages SET parent_id=NULL WHERE parent_id IS NOT NULL "
            "AND parent_id NOT IN (SELECT id FROM messages)"
        )
        fresh.execute(
            "UPDATE messages SET active_child=NULL WHERE active_child IS NOT NULL "
            "AND active_child NOT IN (SELECT id FROM messages)"
        )
        fresh.execute(
            "UPDATE conversations SET folder_id=NULL WHERE folder_id IS NOT NULL "
            "AND folder_id NOT IN (SELECT id FROM folders)"
        )
        fresh.execute(
            "UPDATE conversations SET active_leaf=NULL WHERE active_leaf IS NOT NULL "
            "AND active_leaf NOT IN (SELECT id FROM messages)"
        )
        fresh.execute("COMMIT")
    except BaseException:
        fresh.execute("ROLLBACK")
        raise
    finally:
        fresh.execute("PRAGMA foreign_keys=ON")
    return counts, unreadable
