"""The disk tier under the KV pool (issue #27, docs/ARCHITECTURE.md §3.14).

* the block file format: a round trip, and every kind of damage or foreign file refused;
* the fingerprint changes with everything a stored block depends on;
* the tier's budget (least recently used deleted first) and its startup scan (half-written
  and wrong-sized files deleted); a write error reported once, the folder given up;
* the allocator's side (adopting a block read back, private incognito tables) keeps its
  invariants;
* the engine on the default model: greedy output after a restart that reads the prompt's
  blocks back equals mlx-lm's own greedy output with a full prefill, token for token, and
  the usage proves the blocks came from disk; the same after a kill -9 in the middle of a
  write, with damaged, truncated and foreign files (recomputed), with a disk that is full
  or a folder that cannot be written (the chat goes on, the error is reported once), and
  on an 8-bit pool; an incognito chat writes nothing and leaves zeros behind.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine import Engine, EngineConfig, FinalEvent, SamplingParams, TokenEvent
from engine.kv import disk_format
from engine.kv.block_table import BlockTable, chain_hash
from engine.kv.blocks import BlockAllocator
from engine.kv.disk_format import BadBlockFile, BlockLayout
from engine.kv.disk_tier import DiskTier, WriteBatch
from engine.kv.invariants import check_invariants
from engine.runner import disk_sync
from tests.reference import chat_prompt, greedy_reference, wait_until

ROOT = Path(__file__).resolve().parents[1]
BS = 16
NEW_TOKENS = 16
LAYOUT = BlockLayout(2, 8, 2, 4, np.dtype(np.float32), False)
FP = b"F" * 16


# ---------------------------------------------------------------------------------------------
# The file format, the fingerprint, the tier alone (no model)
# ---------------------------------------------------------------------------------------------


def block_arrays(layout: BlockLayout, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) if dtype.kind == "f"
            else rng.integers(-127, 128, shape).astype(dtype) for shape, dtype in layout.parts()]


def test_block_file_round_trips_and_refuses_every_damage() -> None:
    layout = BlockLayout(2, 8, 2, 4, np.dtype(np.int8), True)
    tokens = list(range(100, 108))
    arrays = block_arrays(layout, 0)
    data = disk_format.encode(FP, 7, tokens, [a.tobytes() for a in arrays])
    assert len(data) == layout.file_bytes
    for got, want in zip(disk_format.decode(data, FP, 7, tokens, layout), arrays, strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    flipped = bytearray(data)
    flipped[-5] ^= 0x10  # one bit of the payload
    bad = {
        "damaged": bytes(flipped),
        "truncated": data[:-3],
        "empty": b"",
        "another model": disk_format.encode(b"G" * 16, 7, tokens, [a.tobytes() for a in arrays]),
        "another version": data[:8] + (disk_format.FORMAT_VERSION + 1).to_bytes(2, "little")
        + data[10:],
    }
    for what, blob in bad.items():
        with pytest.raises(BadBlockFile):
            disk_format.decode(blob, FP, 7, tokens, layout)
            pytest.fail(f"a file {what} was accepted")
    with pytest.raises(BadBlockFile, match="another block"):
        disk_format.decode(data, FP, 8, tokens, layout)
    with pytest.raises(BadBlockFile, match="other tokens"):
        disk_format.decode(data, FP, 7, [1] * 8, layout)


def test_fingerprint_changes_with_everything_a_block_depends_on(tmp_path: Path) -> None:
    weights = tmp_path / "model"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"w" * 10)
    base = disk_format.fingerprint(weights, "float32", LAYOUT, "tmpl", "float32")
    assert base == disk_format.fingerprint(weights, "float32", LAYOUT, "tmpl", "float32")
    variants = {
        "dtype": disk_format.fingerprint(weights, "bfloat16", LAYOUT, "tmpl", "float32"),
        "kv precision": disk_format.fingerprint(
            weights, "float32", replace(LAYOUT, storage=np.dtype(np.int8), quantized=True),
            "tmpl", "int8"),
        "kv dtype name": disk_format.fingerprint(weights, "float32", LAYOUT, "tmpl", "int8"),
        "block size": disk_format.fingerprint(weights, "float32", replace(LAYOUT, block_size=16),
                                              "tmpl", "float32"),
        "chat template": disk_format.fingerprint(weights, "float32", LAYOUT, "other", "float32"),
    }
    os.utime(weights / "model.safetensors", ns=(1, 1))  # the weights replaced
    variants["weights"] = disk_format.fingerprint(weights, "float32", LAYOUT, "tmpl", "float32")
    for what, fp in variants.items():
        assert fp != base, f"the fingerprint ignores the {what}"


def write_blocks(tier: DiskTier, hashes: list[int]) -> None:
    arrays = [np.stack([a] * len(hashes), axis=1) for a in block_arrays(LAYOUT, 1)]
    tier.write(WriteBatch(arrays, [(j, h, tuple(range(8))) for j, h in enumerate(hashes)],
                          sum(a.nbytes for a in arrays)))


def test_budget_keeps_the_most_recently_used_and_the_scan_trusts_no_half_file(
        tmp_path: Path) -> None:
    budget = 3 * LAYOUT.file_bytes
    tier = DiskTier(tmp_path, FP, LAYOUT, budget)
    write_blocks(tier, [1, 2, 3])
    tier.close()
    assert tier.stats().files == 3 and tier.stats().bytes == budget
    # A restart: block 1 is read (most recent now), then two more written: 2 and 3 go.
    tier = DiskTier(tmp_path, FP, LAYOUT, budget)
    tier.read(0, [1], [tuple(range(8))])
    tier.close()  # the reader answers before it ends
    assert tier.take_read().hashes == [1]
    tier = DiskTier(tmp_path, FP, LAYOUT, budget)
    write_blocks(tier, [4, 5])
    tier.close()
    assert [tier.has(h) for h in (1, 2, 3, 4, 5)] == [True, False, False, True, True]
    assert tier.stats().bytes <= budget
    # A killed write (a temporary file) and a wrong-sized file are deleted at the scan.
    folder = tier.folder
    (folder / (disk_format.file_name(6) + ".123.tmp")).write_bytes(b"half")
    (folder / disk_format.file_name(7)).write_bytes(b"short")
    (folder / ("not-a-hash" + disk_format.SUFFIX)).write_bytes(b"x" * LAYOUT.file_bytes)
    tier = DiskTier(tmp_path, FP, LAYOUT, budget)
    tier.close()
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        disk_format.file_name(h) for h in (1, 4, 5))
    assert not tier.has(7) and tier.stats().discarded == 2


def test_a_write_error_is_reported_once_and_an_unwritable_folder_given_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_format, "write_atomically", disk_full)
    tier = DiskTier(tmp_path, FP, LAYOUT, 10 * LAYOUT.file_bytes)
    write_blocks(tier, [1, 2])
    tier.close()
    stats = tier.stats()
    assert stats.errors == 2 and stats.writes == 0 and not tier.has(1)
    assert "No space left" in stats.error and stats.error.count("No space") == 1
    assert stats.writable  # a full disk may free up: writes go on
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder")
    tier = DiskTier(blocker / "kv", FP, LAYOUT, 10 * LAYOUT.file_bytes)
    write_blocks(tier, [1])
    tier.close()
    assert not tier.stats().writable and tier.stats().error and not tier.has(1)


def test_the_server_takes_a_disk_cache_folder() -> None:
    """``pagedchat serve`` / ``batch``: the tier is off unless asked (API requests take the
    same path as chats once it is on)."""
    import argparse

    from app.server.engine_args import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config(parser.parse_args(["--kv-disk-cache", "/tmp/kv",
                                           "--kv-disk-budget-mib", "512"]))
    assert (cfg.disk_cache_dir, cfg.disk_budget_mib) == ("/tmp/kv", 512)
    assert engine_config(parser.parse_args([])).disk_cache_dir is None
    with pytest.raises(ValueError, match="disk_budget_mib"):
        engine_config(parser.parse_args(["--kv-disk-budget-mib", "-1"]))


def test_adopted_and_private_blocks_keep_the_allocators_invariants() -> None:
    alloc = BlockAllocator(4, 2)
    alloc.disk_log = True
    shared = BlockTable("a")
    alloc.append(shared, [1, 2, 3, 4, 5])
    alloc.mark_computed(shared)
    assert [h for _, h in alloc.named_log] == shared.hashes
    h = chain_hash(shared.hashes[-1], [9, 9])
    block = alloc.adopt(h, [9, 9])  # read back from disk: cached, evictable
    assert block is not None and alloc.adopt(h, [9, 9]) is None  # once
    check_invariants(alloc, [shared])
    reader = BlockTable("b")
    assert alloc.reuse_prefix(reader, [1, 2, 3, 4, 9, 9, 0]) == 6
    check_invariants(alloc, [shared, reader])
    alloc.free(reader)
    alloc.free(shared)
    secret = BlockTable("c", private=True)
    alloc.append(secret, [1, 2, 3, 4])  # the same tokens: not shared, not named
    alloc.mark_computed(secret)
    assert not any(alloc.is_cached(b) for b in secret.blocks)
    check_invariants(alloc, [secret])
    held = list(secret.blocks)
    alloc.free(secret)
    assert sorted(alloc.to_zero) == sorted(held)
    assert len(alloc.named_log) == 2  # nothing of the private table was offered
    check_invariants(alloc, [])


def test_a_pinned_chat_is_evicted_last() -> None:
    alloc = BlockAllocator(4, 2)
    for owner, tokens in (("a", [1, 2, 3, 4]), ("c", [5, 6, 7, 8])):  # a first: older
        table = BlockTable(owner)
        alloc.append(table, tokens)
        alloc.mark_computed(table)
        alloc.free(table)
    kept = [chain_hash(None, [1, 2]), chain_hash(chain_hash(None, [1, 2]), [3, 4])]
    alloc.pin("chat-a", kept)
    newcomer = BlockTable("b")
    alloc.append(newcomer, [9, 9, 9, 9])  # needs two blocks: the pool holds four cached
    assert all(alloc.prefix_index.block_for(h) is not None for h in kept)  # a stayed
    assert alloc.prefix_index.block_for(chain_hash(None, [5, 6])) is None  # c went
    check_invariants(alloc, [newcomer])
    alloc.append(newcomer, [8, 8, 8, 8])  # only pinned blocks left: evicted anyway
    assert alloc.prefix_index.block_for(kept[0]) is None
    alloc.pin("chat-a", None)
    assert not alloc.pinned
    check_invariants(alloc, [newcomer])


def test_a_chat_put_to_sleep_while_a_request_holds_its_blocks_leaves_when_released() -> None:
    """Sleep and delete come from the app at any moment: while the chat's own last step still
    holds its table, or while a request sharing its prefix runs (the app's title request is
    the chat's first exchange plus a question). Those blocks leave the pool as soon as the
    last holder releases them; a prompt that takes one first keeps it cached."""
    alloc = BlockAllocator(8, 2)
    chat = [1, 2, 3, 4, 5]
    table = BlockTable("chat")
    alloc.append(table, chat)
    alloc.mark_computed(table)
    alloc.free(table)
    title = BlockTable("title")
    assert alloc.reuse_prefix(title, [*chat[:4], 7, 7, 7]) == 4  # holds both cached blocks
    disk_sync.put_to_sleep(None, alloc, chat)
    assert disk_sync.residency(alloc, None, chat).in_memory == 2  # held: not yet
    check_invariants(alloc, [title])
    alloc.free(title)
    assert disk_sync.residency(alloc, None, chat).in_memory == 0
    assert not alloc.drop_when_released
    check_invariants(alloc, [])

    table = BlockTable("chat")
    alloc.append(table, chat)
    alloc.mark_computed(table)
    disk_sync.forget(None, alloc, chat)  # deleted while its step still holds it
    woken = BlockTable("chat-again")
    assert alloc.reuse_prefix(woken, chat) == 4  # ... and a prompt takes it first: it stays
    alloc.free(table)
    check_invariants(alloc, [woken])
    alloc.free(woken)
    assert disk_sync.residency(alloc, None, chat).in_memory == 2
    check_invariants(alloc, [])


# ---------------------------------------------------------------------------------------------
# The engine on the default model
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    tokens = chat_prompt([{"role": "user", "content": (
        "Here is my plan for the garden: tomatoes along the south fence, beans on the trellis, "
        "herbs by the kitchen door and a small pond for the frogs. What should I plant first?")}])
    assert len(tokens) > 4 * BS + 1
    return tokens


@pytest.fixture(scope="module")
def expected(prompt) -> list[int]:
    """mlx-lm's own greedy reply, with a full prefill of the prompt."""
    return greedy_reference(prompt, NEW_TOKENS)


def config(folder: Path | None, **kw) -> EngineConfig:
    return EngineConfig(kv_memory_mib=32, block_size=BS, max_batch=4,
                        disk_cache_dir=None if folder is None else str(folder), **kw)


def generate(engine: Engine, prompt: list[int], **kw) -> tuple[list[int], FinalEvent]:
    handle = engine.submit(prompt_tokens=prompt,
                           params=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), **kw)
    tokens, final = [], None
    for event in handle:
        if isinstance(event, TokenEvent):
            tokens.extend(event.token_ids)
        else:
            final = event
    assert final is not None and final.error is None, final
    return tokens, final


def run(cfg: EngineConfig, prompt: list[int], **kw):
    """One chat turn on a fresh engine (a restart), stopped after it; the allocator's
    invariants are checked on the idle engine. Returns the engine's runtime too: a stopped
    engine drops it (engine/engine.py), and a test reading the pool after the stop keeps
    it alive through this reference."""
    engine = Engine(cfg)
    engine.start()
    assert engine.wait_ready(120), engine.load_error
    runtime = engine.runtime
    try:
        tokens, final = generate(engine, prompt, **kw)
    finally:
        engine.stop()
    check_invariants(runtime.alloc, [])
    return tokens, final, engine, runtime


def full_blocks(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BS


@pytest.fixture(scope="module")
def warm(tmp_path_factory, prompt, expected) -> Path:
    """A cache folder holding the prompt's blocks, written by an engine that prefilled the
    whole prompt (and wrote its blocks before it stopped)."""
    folder = tmp_path_factory.mktemp("warm")
    tokens, final, engine, _ = run(config(folder), prompt)
    assert tokens == expected
    assert final.usage.cached_prompt_tokens == 0
    assert engine.snapshot().disk.writes >= full_blocks(prompt)
    return folder


def copy_of(warm: Path, tmp_path: Path) -> Path:
    shutil.copytree(warm, tmp_path / "kv")
    return tmp_path / "kv"


def model_folder(root: Path) -> Path:
    (folder,) = [p for p in root.iterdir() if p.is_dir()]
    return folder


def block_file(root: Path, prompt: list[int], index: int) -> Path:
    parent = None
    for i in range(index + 1):
        parent = chain_hash(parent, prompt[i * BS : (i + 1) * BS])
    return model_folder(root) / disk_format.file_name(parent)


def test_a_restarted_engine_reads_the_prompt_back_and_replies_the_same(
        warm, prompt, expected, tmp_path) -> None:
    tokens, final, engine, _ = run(config(copy_of(warm, tmp_path)), prompt)
    assert tokens == expected
    restored = full_blocks(prompt) * BS
    assert final.usage.disk_prompt_tokens == final.usage.cached_prompt_tokens == restored
    stats = engine.snapshot().disk
    assert stats.hits == full_blocks(prompt) and stats.reads == 1 and stats.discarded == 0


def test_a_read_back_beside_a_streaming_chat_is_written_a_few_blocks_a_step(
        warm, prompt, expected, tmp_path, monkeypatch) -> None:
    """While another chat decodes, a long chat's read-back must not stall it for the whole
    restore: its blocks go into the pool over several steps (here one a step), and the reply
    is still the full-prefill one."""
    monkeypatch.setattr(disk_sync, "STEP_RESTORE_BYTES", 1)  # one block a step
    engine = Engine(config(copy_of(warm, tmp_path)))
    engine.start()
    assert engine.wait_ready(120), engine.load_error
    runtime = engine.runtime
    try:
        pool = runtime.pool
        written: list[int] = []
        write_blocks = pool.write_blocks

        def counted(blocks, parts):
            written.append(len(blocks))
            return write_blocks(blocks, parts)

        pool.write_blocks = counted
        other_prompt = chat_prompt([{"role": "user", "content": "Count from one to a hundred."}])
        other = engine.submit(prompt_tokens=other_prompt,
                              params=SamplingParams(temperature=0.0, max_tokens=400))
        first = next(iter(other))
        assert isinstance(first, TokenEvent)  # the other chat is decoding
        tokens, final = generate(engine, prompt)
        assert not other.done  # it streamed all along
        other.cancel()
        other.result(60)
    finally:
        engine.stop()
    assert tokens == expected
    # The chat template's opening block is the other chat's too: read back for it.
    shared = next(i for i in range(full_blocks(prompt))
                  if prompt[i * BS:(i + 1) * BS] != other_prompt[i * BS:(i + 1) * BS])
    assert final.usage.cached_prompt_tokens == full_blocks(prompt) * BS
    assert final.usage.disk_prompt_tokens == (full_blocks(prompt) - shared) * BS > 0
    # Every block came from disk, one a step: the shared opening one(s) for the other chat
    # (it found them on disk too), the rest for this one.
    assert written == [1] * full_blocks(prompt)
    check_invariants(runtime.alloc, [])


def test_damaged_truncated_and_foreign_files_are_recomputed_never_used(
        warm, prompt, expected, tmp_path) -> None:
    root = copy_of(warm, tmp_path)
    damaged = block_file(root, prompt, 1)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one K value
    damaged.write_bytes(bytes(data))
    truncated = block_file(root, prompt, 3)
    truncated.write_bytes(truncated.read_bytes()[:-100])
    tokens, final, engine, _ = run(config(root), prompt)
    assert tokens == expected
    assert final.usage.disk_prompt_tokens == BS  # block 0 only: block 1 failed its check
    assert engine.snapshot().disk.discarded == 2
    # A file written for another model, under the right name: refused too.
    root = copy_of(warm, tmp_path / "foreign")
    first = block_file(root, prompt, 0)
    blob = bytearray(first.read_bytes())
    blob[10:26] = b"another model..."  # the fingerprint in its header
    first.write_bytes(bytes(blob))
    tokens, final, engine, _ = run(config(root), prompt)
    assert tokens == expected
    assert final.usage.disk_prompt_tokens == 0 and engine.snapshot().disk.discarded == 1


KILLED_WRITER = """
import os, signal, sys
sys.path.insert(0, {root!r})
from engine.kv import disk_format
written = []
def dying(path, data):
    # the third block: half of it written aside, then kill -9 (a crash mid-write)
    if len(written) == 2:
        tmp = path.with_name(path.name + f".{{os.getpid()}}" + disk_format.TMP_SUFFIX)
        with open(tmp, "wb") as f:
            f.write(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, data)
    written.append(path)
real, disk_format.write_atomically = disk_format.write_atomically, dying
from engine import Engine, EngineConfig, SamplingParams
engine = Engine(EngineConfig(kv_memory_mib=32, block_size={bs}, max_batch=4,
                             disk_cache_dir={folder!r}))
engine.start()
engine.wait_ready(120)
for _ in engine.submit(prompt_tokens={prompt!r},
                       params=SamplingParams(temperature=0.0, max_tokens=4)):
    pass
engine.stop()
"""


def test_a_kill_during_spilling_leaves_nothing_half_read(prompt, expected, tmp_path) -> None:
    root = tmp_path / "kv"
    script = KILLED_WRITER.format(root=str(ROOT), bs=BS, folder=str(root), prompt=prompt)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    names = [p.name for p in model_folder(root).iterdir()]
    assert sum(n.endswith(disk_format.TMP_SUFFIX) for n in names) == 1  # killed mid-write
    assert sum(n.endswith(disk_format.SUFFIX) for n in names) == 2
    tokens, final, engine, _ = run(config(root), prompt)
    assert tokens == expected
    assert final.usage.disk_prompt_tokens == 2 * BS
    assert not any(p.name.endswith(disk_format.TMP_SUFFIX)
                   for p in model_folder(root).iterdir())


def test_a_full_disk_or_an_unwritable_folder_only_costs_a_recompute(
        prompt, expected, tmp_path, monkeypatch) -> None:
    def disk_full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(disk_format, "write_atomically", disk_full)
        tokens, _, engine, _ = run(config(tmp_path / "full"), prompt)
    assert tokens == expected
    stats = engine.snapshot().disk
    assert stats.errors >= full_blocks(prompt) and stats.writes == 0
    assert stats.error.count("No space left") == 1  # one message, however many errors
    blocker = tmp_path / "a file"
    blocker.write_text("the cache folder's parent is a file")
    tokens, _, engine, _ = run(config(blocker / "kv"), prompt)
    assert tokens == expected
    stats = engine.snapshot().disk
    assert stats.error and not stats.writable and stats.errors == 1


def test_a_full_writer_queue_delays_blocks_never_drops_them(prompt, expected, tmp_path,
                                                            monkeypatch) -> None:
    """With room for one batch at a time in the writer's queue, every block still reaches
    the disk by the time the engine stops (they wait in the log, the writer wakes the
    engine when it has room), and a restart reads the whole prompt back."""
    from engine.kv import disk_tier

    monkeypatch.setattr(disk_tier, "MAX_QUEUED_BYTES", 1)
    _, _, engine, _ = run(config(tmp_path / "kv"), prompt)
    assert engine.snapshot().disk.writes >= full_blocks(prompt)
    tokens, final, _, _ = run(config(tmp_path / "kv"), prompt)
    assert tokens == expected
    assert final.usage.disk_prompt_tokens == full_blocks(prompt) * BS


def test_int8_blocks_round_trip_through_the_disk(prompt, tmp_path) -> None:
    cfg = config(tmp_path / "kv8", kv_precision="int8")
    first, final, _, _ = run(cfg, prompt)
    assert final.usage.cached_prompt_tokens == 0
    again, final, engine, _ = run(cfg, prompt)
    assert engine.model_info.kv_dtype == "int8"
    assert final.usage.disk_prompt_tokens == full_blocks(prompt) * BS
    assert again == first  # the very bytes the first engine quantized


def test_an_incognito_chat_writes_nothing_and_leaves_zeros(prompt, expected, tmp_path) -> None:
    root = tmp_path / "kv"
    tokens, final, engine, runtime = run(config(root), prompt, incognito=True)
    assert tokens == expected
    stats = engine.snapshot().disk
    assert stats.writes == 0 and not list(model_folder(root).iterdir())
    assert not any(engine.snapshot().cached)
    assert engine.snapshot().sessions["default"].incognito  # the monitor can mark it
    pool = runtime.pool  # kept alive by this reference: the stopped engine let go of it
    # every block zeroed (the scratch block, last, takes padding rows' writes: not a chat's)
    assert all(not mx.any(a[:-1]).item() for a in pool.arrays())


def test_a_chats_context_is_shown_put_to_sleep_and_forgotten(warm, prompt, expected,
                                                             tmp_path) -> None:
    root = copy_of(warm, tmp_path)
    engine = Engine(config(root))
    engine.start()
    assert engine.wait_ready(120), engine.load_error
    alloc = engine.runtime.alloc  # a stopped engine drops its runtime (engine/engine.py)
    try:
        n = full_blocks(prompt)
        where = lambda: engine.context_residency(prompt)  # noqa: E731
        assert (where().state, where().on_disk, where().blocks) == ("disk", n, n)
        tokens, _ = generate(engine, prompt)
        assert tokens == expected
        wait_until(lambda: where().in_memory == n)
        assert where().state == "memory"
        engine.sleep_context(prompt)  # out of the pool, still on disk
        wait_until(lambda: where().in_memory == 0)
        assert where().state == "disk"
        # put to sleep while a request sharing its prefix runs: out when that one ends
        handle = engine.submit(prompt_tokens=[*prompt, *expected[:3]],
                               params=SamplingParams(temperature=0.0, max_tokens=48))
        events = iter(handle)
        assert isinstance(next(events), TokenEvent)
        assert where().in_memory == n  # read back for it
        engine.sleep_context(prompt)
        assert isinstance(list(events)[-1], FinalEvent)
        wait_until(lambda: where().in_memory == 0)
        assert where().state == "disk"
        other = prompt[: 2 * BS + 1]  # another chat sharing the first two blocks
        engine.forget_context(prompt, keep=[other])
        wait_until(lambda: where().on_disk == 2)
        assert where().state == "recompute"
        assert engine.context_residency(other).state == "disk"
        tokens, final = generate(engine, prompt)  # still answers: read back, then computed
        assert tokens == expected and final.usage.disk_prompt_tokens == 2 * BS
    finally:
        engine.stop()
    check_invariants(alloc, [])


def test_a_chat_that_just_answered_is_in_memory(prompt) -> None:
    """The reply's last token is sampled, never read by the model: when it closes a full
    block, that block is never cached, yet the chat continues at once (the next turn reads
    its tokens with the new message). The sidebar used to say "needs reading again"."""
    opening = prompt[: 4 * BS]  # the reply's 16th token is the 5th block's last
    engine = Engine(config(None))
    engine.start()
    assert engine.wait_ready(120), engine.load_error
    try:
        reply, final = generate(engine, opening)
        assert final.finish_reason.value == "length" and len(reply) == NEW_TOKENS
        conversation = [*opening, *reply, reply[-1]]  # and what the template adds after it
        wait_until(lambda: engine.context_residency(conversation).in_memory == 4)
        where = engine.context_residency(conversation)
        assert (where.blocks, where.in_memory) == (5, 4)  # the 5th was never read whole
        assert where.state == "memory"
        other = [*opening[:BS], *reversed(opening[BS:])]  # 3 of its 4 blocks never seen
        assert engine.context_residency([*other, 0]).state == "recompute"
    finally:
        engine.stop()
