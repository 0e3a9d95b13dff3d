"""The disk tier under the KV pool: full blocks kept on disk, across evictions and restarts.

The pool's prefix cache (engine/kv/blocks.py) forgets a block when it reuses its slots for
other content, and everything when the app quits. This tier keeps those blocks as files
(engine/kv/disk_format.py) so that a chat reopened after a restart, or after its cache was
evicted, reads its K/V back instead of prefilling it again (docs/ARCHITECTURE.md §3.14).

Threads (§3.8): the engine thread never touches a file. It copies blocks to host memory
(numpy) and hands them to **one writer thread** (:meth:`DiskTier.write`), and asks **one
reader thread** for a prompt's blocks (:meth:`DiskTier.read`), whose result it collects
between steps (:meth:`DiskTier.take_read`). Neither thread runs MLX. The index (which
chain hashes are on disk, and every file's size in least-recently-used order, for the
budget) is shared under one lock; :meth:`has` is a set lookup.

Nothing on disk is trusted: the startup scan deletes temporary files (a write that was
killed) and files of the wrong size, and every block read back is checked in full
(disk_format.decode) before use; a damaged or foreign file is deleted and counted, and the
block is recomputed. A write that fails (disk full, a read-only or vanished folder) drops
that block; its first error is kept for the user (``DiskStats.error``), writes stop after a
permission error, and the chat goes on as if the tier were empty.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.events import DiskStats
from engine.kv import disk_format
from engine.kv.block_table import chain_hash
from engine.kv.disk_format import BadBlockFile, BlockLayout

logger = logging.getLogger(__name__)

#: Bytes of blocks handed to the writer and not yet written, at most: beyond it the engine
#: keeps blocks in memory only (a slow disk must never make the engine hold copies).
MAX_QUEUED_BYTES = 64 * 2**20
_STOP = object()


@dataclass(frozen=True)
class WriteBatch:
    """Blocks copied off the pool in one gather: ``arrays`` in ``layout.parts()`` order,
    each ``[layers, n, ...]``; entry ``(j, chain hash, tokens)`` is column j."""

    arrays: list[np.ndarray]
    entries: list[tuple[int, int, tuple[int, ...]]]
    nbytes: int


@dataclass(frozen=True)
class ReadResult:
    """A prompt's blocks read back: the leading ``hashes`` that were intact on disk, with
    their tokens and their arrays stacked ``[layers, n, ...]`` (empty when none was)."""

    key: int
    hashes: list[int]
    tokens: list[tuple[int, ...]]
    arrays: list[np.ndarray]


class DiskTier:
    def __init__(self, root: Path, fp: bytes, layout: BlockLayout, budget_bytes: int,
                 wake: Callable[[], None] | None = None) -> None:
        self.root = Path(root)
        self.fp = fp
        self.folder = self.root / fp.hex()
        self.layout = layout
        self.budget = int(budget_bytes)
        #: Wakes the engine thread: a read is answered, or the writer's queue has room again
        #: after the engine found it full.
        self.wake = wake
        self._starved = False
        self._lock = threading.Lock()
        self._lru: OrderedDict[Path, int] = OrderedDict()  # every block file, oldest first
        self._ours: set[int] = set()  # chain hashes with a file in our folder
        self._queued: set[int] = set()  # handed to the writer, not written yet
        self._queued_bytes = 0
        self._bytes = 0
        self._newest_ns = 0  # the newest file time seen: a read makes its file newer still
        self.hits = self.reads = self.writes = self.discarded = self.errors = 0
        self.error = ""
        self.writable = True
        self._writes: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        self._done: deque[ReadResult] = deque()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as e:
            self._failed(e, "could not be opened")
        self._writer = threading.Thread(target=self._write_loop, name="pagedchat-kv-writer",
                                        daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="pagedchat-kv-reader",
                                        daemon=True)
        self._writer.start()
        self._reader.start()

    # ---- the engine thread's side -------------------------------------------------------

    def has(self, chain_hash: int) -> bool:
        """The block is on disk (or being written): a set lookup, any thread."""
        return chain_hash in self._ours or chain_hash in self._queued

    def run_on_disk(self, cached: Sequence[int], tokens: Sequence[int], block_size: int
                    ) -> tuple[list[int], list[Sequence[int]]]:
        """The full blocks of a prompt (``tokens``, its last token excluded: it is always
        computed) that follow its ``cached`` leading blocks' hashes and are on disk, up to
        the first that is not: their hashes and tokens."""
        parent = cached[-1] if cached else None
        hashes: list[int] = []
        chunks: list[Sequence[int]] = []
        for i in range(len(cached), (len(tokens) - 1) // block_size):
            chunk = tokens[i * block_size : (i + 1) * block_size]
            parent = chain_hash(parent, chunk)
            if not self.has(parent):
                break
            hashes.append(parent)
            chunks.append(chunk)
        return hashes, chunks

    def wants(self, chain_hash: int) -> bool:
        """Worth copying off the pool: writable, not on disk, not queued."""
        return (self.writable and chain_hash not in self._ours
                and chain_hash not in self._queued)

    @property
    def has_room(self) -> bool:
        """The writer's queue is under ``MAX_QUEUED_BYTES``: more copies may be handed over
        (when it is not, the writer wakes the engine once the queue is half empty)."""
        room = self._queued_bytes < MAX_QUEUED_BYTES
        if not room:
            self._starved = True
        return room

    def write(self, batch: WriteBatch) -> None:
        """Queue blocks for the writer thread (returns at once)."""
        with self._lock:
            for _, h, _ in batch.entries:
                self._queued.add(h)
            self._queued_bytes += batch.nbytes
        self._writes.put(batch)

    def read(self, key: int, hashes: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        """Ask the reader thread for these consecutive blocks of one prompt; the result
        comes back through :meth:`take_read` (and ``wake`` is called)."""
        self._reads.put((key, list(hashes), [tuple(t) for t in tokens]))

    def take_read(self) -> ReadResult | None:
        try:
            return self._done.popleft()
        except IndexError:
            return None

    def count_hits(self, blocks: int) -> None:
        with self._lock:
            self.hits += blocks

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(folder=str(self.folder), budget_bytes=self.budget,
                             bytes=self._bytes, files=len(self._lru), blocks=len(self._ours),
                             hits=self.hits, reads=self.reads, writes=self.writes,
                             discarded=self.discarded, errors=self.errors, error=self.error,
                             writable=self.writable)

    def clear(self) -> None:
        """Delete every block file of every model under the root (Settings' Clear)."""
        self._writes.put(("clear", None))

    def delete(self, hashes: Sequence[int]) -> None:
        """Delete these blocks' files of the loaded model (a deleted chat's), in the writer
        thread, after the writes queued before."""
        self._writes.put(("delete", list(hashes)))

    def close(self, timeout: float | None = 60.0) -> None:
        """Finish the queued writes, then end both threads."""
        self._writes.put(_STOP)
        self._reads.put(_STOP)
        self._writer.join(timeout)
        self._reader.join(timeout)

    # ---- the index ------------------------------------------------------------------------

    def _scan(self) -> None:
        """Learn every block file under the root (every model's: the budget is one), oldest
        first; delete temporary files (writes that were killed) and, in our folder, files
        whose size is not a block's. Contents are checked when read, not here."""
        found: list[tuple[float, Path, int]] = []
        for path in self.root.glob(f"*/*{disk_format.SUFFIX}*"):
            try:
                if path.name.endswith(disk_format.TMP_SUFFIX):
                    path.unlink()
                    continue
                st = path.stat()
            except OSError:
                continue
            if path.parent == self.folder and (st.st_size != self.layout.file_bytes
                                               or _block_hash(path) is None):
                self._delete(path)
                continue
            if _block_hash(path) is None:  # another model's folder: not ours to judge
                continue
            found.append((st.st_mtime_ns, path, st.st_size))
            self._newest_ns = max(self._newest_ns, st.st_mtime_ns)
        for _, path, size in sorted(found):
            self._add(path, size)

    def _add(self, path: Path, size: int) -> None:
        """Record a file (lock held, or before the threads start)."""
        self._lru[path] = size
        self._bytes += size
        if path.parent == self.folder:
            self._ours.add(_block_hash(path))

    def _forget(self, path: Path) -> None:
        size = self._lru.pop(path, None)
        if size is not None:
            self._bytes -= size
        if path.parent == self.folder:
            self._ours.discard(_block_hash(path))

    def _delete(self, path: Path) -> None:
        self.discarded += 1
        with contextlib.suppress(OSError):
            path.unlink()

    def _failed(self, e: OSError, what: str) -> None:
        """Count an error; keep the first for the user; stop writing when the folder cannot
        be written at all (retrying each block would only repeat the error)."""
        self.errors += 1
        if not self.error:
            self.error = (f"The KV disk cache in {self.root} {what} ({e.strerror or e}): "
                          "chats are recomputed instead of read back.")
            logger.warning("%s", self.error)
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ENOENT):
            self.writable = False

    # ---- the writer thread ------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is _STOP:
                return
            if isinstance(item, tuple):
                _, hashes = item
                self._clear(hashes)
                continue
            try:
                self._write_batch(item)
            except Exception:  # a bug must not end the thread: the blocks are dropped
                logger.exception("the KV disk writer failed")
            finally:
                with self._lock:
                    for _, h, _ in item.entries:
                        self._queued.discard(h)
                    self._queued_bytes -= item.nbytes
                    drained = self._starved and self._queued_bytes < MAX_QUEUED_BYTES // 2
                    if drained:
                        self._starved = False
                if drained and self.wake is not None:
                    self.wake()

    def _write_batch(self, batch: WriteBatch) -> None:
        size = self.layout.file_bytes
        for j, h, tokens in batch.entries:
            if not self.writable or h in self._ours or size > self.budget:
                continue
            payload = [np.ascontiguousarray(a[:, j]).tobytes() for a in batch.arrays]
            data = disk_format.encode(self.fp, h, tokens, payload)
            path = self.folder / disk_format.file_name(h)
            try:
                self._make_room(size)
                disk_format.write_atomically(path, data)
            except OSError as e:
                with self._lock:
                    self._failed(e, "could not be written")
                continue
            with self._lock:
                self._add(path, size)
                self.writes += 1
            with contextlib.suppress(OSError):
                self._newest_ns = max(self._newest_ns, path.stat().st_mtime_ns)

    def _make_room(self, size: int) -> None:
        """Delete the least recently used files until ``size`` more bytes fit the budget."""
        while True:
            with self._lock:
                if self._bytes + size <= self.budget or not self._lru:
                    return
                path = next(iter(self._lru))
                self._forget(path)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _clear(self, hashes: list[int] | None) -> None:
        """Delete every file (None), or these blocks' files of the loaded model."""
        with self._lock:
            if hashes is None:
                paths = list(self._lru)
            else:
                paths = [self.folder / disk_format.file_name(h) for h in hashes]
            for p in paths:
                self._forget(p)
        for p in paths:
            with contextlib.suppress(OSError):
                p.unlink()

    # ---- the reader thread ------------------------------------------------------------------

    def _read_loop(self) -> None:
        while True:
            item = self._reads.get()
            if item is _STOP:
                return
            key, hashes, tokens = item
            try:
                result = self._read_blocks(key, hashes, tokens)
            except Exception:  # a bug: the prompt is recomputed
                logger.exception("the KV disk reader failed")
                result = ReadResult(key, [], [], [])
            self._done.append(result)
            if self.wake is not None:
                self.wake()

    def _read_blocks(self, key: int, hashes: list[int], tokens: list[tuple[int, ...]]
                     ) -> ReadResult:
        """The leading blocks that are intact; stops at the first missing or bad one (a
        bad one is deleted: it is recomputed, and written again, later)."""
        with self._lock:
            self.reads += 1
        got: list[list[np.ndarray]] = []
        for h, t in zip(hashes, tokens, strict=True):
            path = self.folder / disk_format.file_name(h)
            try:
                data = path.read_bytes()
                got.append(disk_format.decode(data, self.fp, h, t, self.layout))
            except FileNotFoundError:
                with self._lock:
                    self._forget(path)
                break
            except (BadBlockFile, OSError) as e:
                logger.warning("KV block file %s not used: %s", path.name, e)
                with self._lock:
                    self._forget(path)
                    self._delete(path)
                break
            with self._lock:
                if path in self._lru:
                    self._lru.move_to_end(path)
            # The LRU order survives a restart: newer than any file seen (file times can be
            # coarser than the gap between two writes).
            now = self._newest_ns = max(time.time_ns(), self._newest_ns + 1000)
            with contextlib.suppress(OSError):
                os.utime(path, ns=(now, now))
        n = len(got)
        arrays = [np.stack([g[i] for g in got], axis=1) for i in range(len(got[0]))] if n else []
        return ReadResult(key, hashes[:n], tokens[:n], arrays)


def _block_hash(path: Path) -> int | None:
    """The chain hash a block file is named by, or None for a name that is not one."""
    name = path.name
    if not name.endswith(disk_format.SUFFIX):
        return None
    try:
        return int(name.removesuffix(disk_format.SUFFIX), 16)
    except ValueError:
        return None
