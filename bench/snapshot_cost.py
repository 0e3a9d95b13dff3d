"""What a pool snapshot costs the engine thread (target: <= 0.5 ms at 16k blocks, 64 sequences).

No model: a real ``BlockAllocator`` of 16,384 blocks holds 64 sequences the way a busy engine
does (32 chats sharing a system prompt through the prefix cache, every other chat with two
forked samples, partial last blocks, the token in flight of each sequence as a PENDING slot,
finished chats' blocks cached), and a real ``Telemetry`` builds the snapshot the app polls.
Reported: the build's median and spread (min, quartiles, max) over repeats, and the per-token
and per-step telemetry calls the engine makes on its hot path.

    source scripts/env.sh; .venv/bin/python bench/snapshot_cost.py [--repeats 300] [--blocks 16384]

Runs against whatever ``engine`` is first on the path, so the code before a change can be
measured with the same script: ``PYTHONPATH=/path/to/old/checkout .venv/bin/python ...``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

if not any(Path(p, "engine", "telemetry.py").exists() for p in sys.path[1:] if p):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import SamplingParams  # noqa: E402
from engine.events import SequenceState  # noqa: E402
from engine.kv.block_table import PENDING, BlockTable  # noqa: E402
from engine.kv.blocks import BlockAllocator  # noqa: E402
from engine.runner.telemetry import StepTimes, Telemetry  # noqa: E402
from engine.sched.scheduler import Scheduler  # noqa: E402
from engine.sched.sequence import Request, Sequence  # noqa: E402

BLOCK_SIZE = 16


def busy_pool(num_blocks: int, sequences: int, seed: int = 0):
    """An allocator, a scheduler and the live requests of ``sequences`` decoding sequences
    filling about 85% of the pool, with a shared prefix, forks, cached blocks and PENDING
    slots. Returns (alloc, scheduler, requests)."""
    rng = random.Random(seed)
    alloc = BlockAllocator(num_blocks, BLOCK_SIZE)
    scheduler = Scheduler(alloc, max_batch=sequences, prefill_chunk=512)
    system = [rng.randrange(1, 30000) for _ in range(20 * BLOCK_SIZE)]
    # finished chats leave their blocks cached (refcount 0, named)
    for i in range(8):
        t = BlockTable(owner=f"old-{i}")
        prompt = system + [rng.randrange(1, 30000) for _ in range(40 * BLOCK_SIZE)]
        alloc.reuse_prefix(t, prompt)
        alloc.append(t, prompt[t.num_tokens:])
        alloc.mark_computed(t)
        alloc.free(t)
    chats = sequences // 2 + sequences // 4  # every other chat runs two samples
    per_seq = int(num_blocks * 0.85 / sequences) * BLOCK_SIZE - len(system)
    requests: list[Request] = []
    made = 0
    for c in range(chats):
        if made == sequences:
            break
        n = 2 if c % 2 == 0 and made + 2 <= sequences else 1
        sid = f"chat-{c}"
        params = SamplingParams(n=n, max_tokens=100_000)
        prompt = system + [rng.randrange(1, 30000) for _ in range(per_seq // 2)]
        request = Request(f"req-{c}", sid, params, list(prompt), handle=None)
        table = BlockTable(owner=sid)
        alloc.reuse_prefix(table, prompt)
        alloc.append(table, prompt[table.num_tokens:])
        alloc.mark_computed(table)
        tables = [table] + [alloc.fork(table) for _ in range(n - 1)]
        request.forked = n > 1
        for index, t in enumerate(tables):
            reply = [rng.randrange(1, 30000) for _ in range(per_seq // 2 - rng.randrange(16))]
            alloc.append(t, reply)
            alloc.mark_computed(t)
            alloc.append(t, [PENDING])  # the overlapped step's token, still on the device
            seq = Sequence(request, index, list(prompt) + reply, len(prompt), key=None,
                           detokenizer=None, table=t, state=SequenceState.DECODING,
                           inflight=True)
            request.sequences.append(seq)
            scheduler.running[seq.seq_id] = seq
            made += 1
        requests.append(request)
    return alloc, scheduler, requests


def spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4)
    return (f"median {statistics.median(values):.3f} ms (min {min(values):.3f}, "
            f"q1 {q[0]:.3f}, q3 {q[2]:.3f}, max {max(values):.3f}; n={len(values)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--blocks", type=int, default=16384)
    ap.add_argument("--sequences", type=int, default=64)
    args = ap.parse_args()
    alloc, scheduler, requests = busy_pool(args.blocks, args.sequences)
    telemetry = Telemetry()
    now = time.perf_counter()
    for i in range(2000):  # two seconds of tokens, as the rates would have seen them
        seq = list(scheduler.running.values())[i % len(scheduler.running)]
        telemetry.token(seq.session_id, now - 2.0 + i / 1000)
    used = sum(1 for r in alloc.block_state()[1] if r)
    print(f"engine from {Path(sys.modules['engine.runner.telemetry'].__file__).parent.parent}")
    print(f"pool: {alloc.num_blocks} blocks, {used} held, {len(scheduler.running)} sequences "
          f"in {len(requests)} chats")

    def build() -> float:
        t0 = time.perf_counter()
        telemetry.maybe_snapshot(alloc, scheduler, [r for r in requests], 737_280, "bench",
                                 force=True)
        return (time.perf_counter() - t0) * 1000

    for _ in range(20):
        build()
    builds = [build() for _ in range(args.repeats)]
    print(f"snapshot build: {spread(builds)}")
    snap = telemetry.snapshot
    assert snap is not None and len(snap.sessions) >= len(requests)

    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        telemetry.token("chat-0", t0)
    per_token = (time.perf_counter() - t0) / n * 1e9
    times = StepTimes(0.001, 0.001, 0.001, 0.001, 0.001)
    t0 = time.perf_counter()
    for _ in range(n // 10):
        telemetry.step(64, 0.01, times)
    per_step = (time.perf_counter() - t0) / (n // 10) * 1e6
    print(f"hot path: Telemetry.token {per_token:.0f} ns per token, "
          f"Telemetry.step {per_step:.2f} us per step")


if __name__ == "__main__":
    main()
