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


# ---- faults made by real second processes and real full disks -----------------------------

import contextlib  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

_HOLD_WRITE_LOCK = """
import sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN IMMEDIATE")  # the write lock, held until told (or the parent is gone)
print("locked", flush=True)
sys.stdin.readline()
con.execute("ROLLBACK")
"""


@contextlib.contextmanager
def locked_by_another_process(db: Path) -> Iterator[subprocess.Popen]:
    """A second process holding SQLite's write lock on `db` for the duration."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD_WRITE_LOCK, str(db)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        if proc.stdin is not None:
            proc.stdin.close()  # its readline returns: it rolls back and exits
        proc.wait(timeout=60)


class TinyDisk:
    """A data folder on a disk that can be filled up and emptied again.

    A 16 MiB tmpfs when this process may mount one (root on Linux): filling it makes writes
    fail with ENOSPC, SQLite's "database or disk is full". Elsewhere the process's own file
    size limit (RLIMIT_FSIZE) is lowered to the current size of the files, which makes any
    file growth fail (EFBIG, SQLite's I/O error); raising it again is the disk freeing up.
    """

    def __init__(self, base: Path) -> None:
        self.path = base / "tiny"
        self.path.mkdir()
        self.mounted = False
        self._limit: tuple[int, int] | None = None
        if sys.platform.startswith("linux") and os.geteuid() == 0 and shutil.which("mount"):
            run = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(self.path)],
                capture_output=True,
            )
            self.mounted = run.returncode == 0
        self.data = self.path / "data"
        self.data.mkdir()

    def fill(self) -> None:
        if self.mounted:
            fd = os.open(self.path / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                for chunk in (1 << 16, 1 << 12, 1 << 9, 1):  # until not one byte more fits
                    with contextlib.suppress(OSError):
                        while True:
                            os.write(fd, b"\0" * chunk)
            finally:
                os.close(fd)
        else:
            self._limit = resource.getrlimit(resource.RLIMIT_FSIZE)
            biggest = max((p.stat().st_size for p in self.data.iterdir()), default=0)
            resource.setrlimit(resource.RLIMIT_FSIZE, (biggest + 4096, self._limit[1]))

    def free(self) -> None:
        if self.mounted:
            (self.path / "filler").unlink(missing_ok=True)
        elif self._limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, self._limit)
            self._limit = None

    def close(self) -> None:
        self.free()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


@contextlib.contextmanager
def read_only_folder(base: Path) -> Iterator[Path]:
    """A folder nothing can be written to: a read-only tmpfs as root, else chmod 555."""
    folder = base / "ro"
    folder.mkdir()
    mounted = False
    if sys.platform.startswith("linux") and os.geteuid() == 0 and shutil.which("mount"):
        mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(folder)],
                capture_output=True,
            ).returncode
            == 0
        )
    data = folder / "data"
    data.mkdir()
    populate(data, chats=2, per_chat=4)

    def protect() -> None:
        if mounted:
            subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        else:
            data.chmod(0o555)

    try:
        protect()
        yield data
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)
        else:
            data.chmod(0o755)


class LatenessProbe:
    """How late the GUI thread runs a 10 ms timer: the stall a user would feel, in ms."""

    def __init__(self, interval_ms: int = 10) -> None:
        from PySide6.QtCore import Qt, QTimer

        self.interval_ms = interval_ms
        self.timer = QTimer()
        self.timer.setTimerType(Qt.TimerType.PreciseTimer)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self._tick)
        self.worst_ms = 0.0
        self.ticks = 0
        self._last: float | None = None

    def _tick(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.worst_ms = max(self.worst_ms, (now - self._last) * 1000 - self.interval_ms)
        self._last = now
        self.ticks += 1

    def __enter__(self) -> LatenessProbe:
        self._last = time.perf_counter()  # a stall before the first tick counts too
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.stop()
