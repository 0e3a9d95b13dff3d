"""The disk tier's file format: one file per full KV block, trusted only once checked.

A block file is named by the block's chain hash (engine/kv/block_table.py ``chain_hash``)
inside a folder named by the **model fingerprint** (:func:`fingerprint`): the weights'
identity, their dtype, the pool's K/V storage (dtype, 8-bit or not, layers, heads, head
size), the block size, the chat template and :data:`FORMAT_VERSION`. A block is therefore
only ever found by the same model, storing K/V the same way, for the same tokens.

Layout (little-endian)::

    header   magic "PCKVBLK\\n", version u16, fingerprint 16 bytes, chain hash u64,
             token count u16, payload bytes u64, crc32 u32 (of everything else)
    tokens   int32 x token count (the block's own tokens, checked against the prompt)
    payload  the block's arrays in the pool's own format, one after another:
             K [layers, block_size, kv_heads, head_dim], V (the same), and for an 8-bit
             pool K scales and V scales [layers, block_size, kv_heads] fp16

Nothing here trusts a file: :func:`decode` checks the magic, the version, the fingerprint,
the hash, the tokens, the length and the checksum, and raises :class:`BadBlockFile` on any
difference (the caller deletes the file and recomputes the block). Files are written aside
(:func:`write_atomically`: a temporary name, fsync, rename), so a crash mid-write leaves at
most a temporary file, which the startup scan deletes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"PCKVBLK\n"
#: Bumped whenever the layout above or the meaning of a payload changes: a new version is
#: a new fingerprint, so old files are never read as new ones.
FORMAT_VERSION = 1
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
_HEADER = struct.Struct("<8sH16sQHQI")
_CRC_AT = _HEADER.size - 4


class BadBlockFile(ValueError):
    """A block file that must not be used: damaged, foreign, or of another version."""


@dataclass(frozen=True)
class BlockLayout:
    """The shape of one block's arrays, as the pool stores them. ``storage`` and ``scale``
    are numpy dtypes of the same item size as the pool's (bfloat16 travels as uint16)."""

    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    storage: np.dtype
    quantized: bool
    scale: np.dtype = np.dtype(np.float16)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.block_size, self.kv_heads, self.head_dim)

    @property
    def scale_shape(self) -> tuple[int, int, int]:
        return (self.num_layers, self.block_size, self.kv_heads)

    def parts(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        """(shape, dtype) of each payload array, in file order."""
        kv = [(self.kv_shape, self.storage)] * 2
        return kv + ([(self.scale_shape, self.scale)] * 2 if self.quantized else [])

    @property
    def payload_bytes(self) -> int:
        return sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in self.parts())

    @property
    def file_bytes(self) -> int:
        return _HEADER.size + 4 * self.block_size + self.payload_bytes


def fingerprint(weights: Path, dtype: str, layout: BlockLayout, chat_template: str,
                kv_dtype: str) -> bytes:
    """16 bytes that change whenever a stored block could mean something else: the weights
    (their path, and every weight file's name, size and modification time: re-converted or
    replaced weights are another model), the compute dtype, the pool's K/V dtype and
    layout, the block size, the chat template and the format version."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"v{FORMAT_VERSION}|{os.fspath(weights)}|{dtype}|{kv_dtype}|{layout}".encode())
    files = sorted(weights.glob("*.safetensors")) if weights.is_dir() else [weights]
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        h.update(f"|{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(b"|template|" + (chat_template or "").encode())
    return h.digest()


def file_name(chain_hash: int) -> str:
    return f"{chain_hash:016x}{SUFFIX}"


def encode(fp: bytes, chain_hash: int, tokens: Sequence[int], payload: Sequence[bytes]) -> bytes:
    """A whole block file: header, tokens, payload (the crc covers all but itself)."""
    body_tokens = np.asarray(tokens, dtype="<i4").tobytes()
    size = sum(len(p) for p in payload)
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, fp, chain_hash, len(tokens), size, 0)[:_CRC_AT]
    crc = zlib.crc32(head)
    crc = zlib.crc32(body_tokens, crc)
    for p in payload:
        crc = zlib.crc32(p, crc)
    return b"".join([head, struct.pack("<I", crc), body_tokens, *payload])


def decode(data: bytes, fp: bytes, chain_hash: int, tokens: Sequence[int],
           layout: BlockLayout) -> list[np.ndarray]:
    """The block's arrays (``layout.parts()`` order) if ``data`` is the intact file of this
    block for this model; else :class:`BadBlockFile` saying what is wrong."""
    if len(data) < _HEADER.size:
        raise BadBlockFile("shorter than a header")
    magic, version, file_fp, file_hash, n, size, crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BadBlockFile("not a PagedChat block file")
    if version != FORMAT_VERSION:
        raise BadBlockFile(f"format version {version}, expected {FORMAT_VERSION}")
    if file_fp != fp:
        raise BadBlockFile("written for another model or KV format")
    if file_hash != chain_hash:
        raise BadBlockFile("holds another block")
    if n != layout.block_size or size != layout.payload_bytes:
        raise BadBlockFile("its sizes do not match this model's blocks")
    if len(data) != layout.file_bytes:
        raise BadBlockFile(f"{len(data)} bytes, expected {layout.file_bytes} (truncated?)")
    check = zlib.crc32(memoryview(data)[_HEADER.size :], zlib.crc32(data[:_CRC_AT]))
    if check != crc:
        raise BadBlockFile("checksum mismatch (damaged)")
    start = _HEADER.size
    stored = np.frombuffer(data, dtype="<i4", count=n, offset=start)
    if stored.tolist() != list(tokens):
        raise BadBlockFile("holds other tokens")
    offset = start + 4 * n
    arrays = []
    for shape, dtype in layout.parts():
        count = int(np.prod(shape))
        arrays.append(np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape))
        offset += count * dtype.itemsize
    return arrays


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` holds either nothing or all of it: a
    temporary name beside it, fsync, then rename (a kill mid-write leaves only the
    temporary file, which the startup scan deletes)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
