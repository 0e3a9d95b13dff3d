"""Paint time of the KV monitor's block map (target: under 5 ms a frame at 4,096 blocks).

Offscreen, no engine: a synthetic pool that behaves like the real allocator (chats with shared
system-prompt prefixes, forked samples, partial last blocks, cached prefix blocks, churn as
chats finish and start) produces a new snapshot every frame. Each frame is what the GUI does
10 times a second: `BlockMap.set_snapshot(new)` (numpy derivation + cell plan), then
`widget.render(QImage)` (which rasterises the visible rows and draws the image, flashes and
hover). An idle frame (the same snapshot again) is measured too.

    source scripts/env.sh; .venv/bin/python bench/monitor_paint.py [--frames 200] [--scale 2]

`--scale 2` emulates a Retina screen (QT_SCALE_FACTOR=2: four times the pixels).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.events import Counters, PoolSnapshot, SequenceState, SessionStats  # noqa: E402

SIZES = (64, 1024, 4096, 16384)
BYTES_PER_BLOCK = 737_280  # SmolLM2-135M, fp32, 16 slots: 30 layers x K,V x 3 heads x 64


@dataclass
class _Seq:
    session: str
    blocks: list[int] = field(default_factory=list)
    tokens: int = 0
    state: SequenceState = SequenceState.DECODING


class SyntheticPool:
    """A small model of the engine's allocator, enough to make realistic snapshots.

    Chats come in groups sharing a system prompt (their first blocks are shared, refcount =
    group size, owners = several chats); some chats run two forked samples (refcount 2, one
    owner); every sequence's last block is partly filled; finished chats leave their full
    blocks cached (refcount 0, hashed) until evicted; `step()` appends a token to every
    running sequence and now and then finishes one chat and starts another.
    """

    def __init__(self, num_blocks: int, seed: int = 0, block_size: int = 16) -> None:
        self.rng = random.Random(seed)
        self.n = num_blocks
        self.bs = block_size
        self.refs = [0] * num_blocks
        self.fill = [0] * num_blocks
        self.hashed = [False] * num_blocks
        self.holders: list[dict[str, int]] = [{} for _ in range(num_blocks)]
        self.tokens: list[tuple[int, ...]] = [()] * num_blocks
        runs = [list(range(i, min(i + 8, num_blocks))) for i in range(0, num_blocks, 8)]
        self.rng.shuffle(runs)
        self.free = [b for run in runs for b in run][::-1]  # pop() from the end
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.n_sessions = max(3, min(12, num_blocks // 200))
        self.sessions = [f"chat-{i}" for i in range(self.n_sessions)]
        self.seqs: list[_Seq] = []
        self.preemptions = 0
        self.steps = 0
        self.started: dict[str, float] = {}
        target = int(0.58 * num_blocks)
        prompt = max(2, min(200, num_blocks // (self.n_sessions * 4)))
        while self._used() < target and self._can_take(prompt + 1):
            sid = self.sessions[len(self.seqs) % self.n_sessions]
            self.start(sid, prompt_blocks=self.rng.randint(max(2, prompt // 2), prompt))
            if len(self.seqs) >= self.n_sessions * 8:
                break
        # finish a few to leave cached prefix blocks behind, then start them again
        for seq in self.seqs[: max(1, len(self.seqs) // 4)]:
            self.finish(seq)
        for sid in {s.session for s in self.seqs}:
            if not any(s.session == sid for s in self.seqs) and self._can_take(prompt):
                self.start(sid, prompt_blocks=max(2, prompt // 2))

    # ---- allocator -------------------------------------------------------------------------

    def _used(self) -> int:
        return sum(1 for r in self.refs if r)

    def _can_take(self, k: int) -> bool:
        return len(self.free) + len(self.evictable) >= k

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        block, _ = self.evictable.popitem(last=False)
        self.hashed[block] = False
        return block

    def _hold(self, block: int, sid: str) -> None:
        self.refs[block] += 1
        self.holders[block][sid] = self.holders[block].get(sid, 0) + 1
        self.evictable.pop(block, None)

    def _release(self, block: int, sid: str) -> None:
        self.refs[block] -= 1
        h = self.holders[block]
        h[sid] -= 1
        if not h[sid]:
            del h[sid]
        if self.refs[block] == 0:
            if self.hashed[block]:
                self.evictable[block] = None
            else:
                self.fill[block] = 0
                self.tokens[block] = ()
                self.free.append(block)

    def _new_block(self, sid: str, fill: int) -> int:
        b = self._take()
        self._hold(b, sid)
        self.fill[b] = fill
        self.tokens[b] = tuple(self.rng.randrange(1000) for _ in range(fill))
        self.hashed[b] = fill == self.bs
        return b

    # ---- sequences -------------------------------------------------------------------------

    def start(self, sid: str, prompt_blocks: int) -> None:
        group = [s for s in self.seqs if self.sessions.index(s.session) // 3
                 == self.sessions.index(sid) // 3 and len(s.blocks) > 4]
        seq = _Seq(sid)
        if group and self.rng.random() < 0.8:  # same system prompt: share its first blocks
            for b in group[0].blocks[: min(4, len(group[0].blocks) - 1)]:
                self._hold(b, sid)
                seq.blocks.append(b)
        for _ in range(prompt_blocks - 1):
            if not self._can_take(1):
                break
            seq.blocks.append(self._new_block(sid, self.bs))
        if self._can_take(1):
            seq.blocks.append(self._new_block(sid, self.rng.randint(1, self.bs - 1)))
        seq.tokens = sum(self.fill[b] for b in seq.blocks)
        self.seqs.append(seq)
        if self.rng.random() < 0.25 and self._can_take(1):  # n=2: a forked sample
            fork = _Seq(sid, tokens=seq.tokens)
            for b in seq.blocks[:-1]:
                self._hold(b, sid)
                fork.blocks.append(b)
            fork.blocks.append(self._new_block(sid, self.fill[seq.blocks[-1]]))
            self.seqs.append(fork)

    def finish(self, seq: _Seq) -> None:
        for b in seq.blocks:
            self._release(b, seq.session)
        self.seqs.remove(seq)

    def step(self) -> None:
        """One engine step: a token for every sequence; sometimes a chat ends, one starts."""
        self.steps += 1
        for seq in list(self.seqs):
            last = seq.blocks[-1]
            if self.fill[last] >= self.bs or self.refs[last] > 1:
                if not self._can_take(1):
                    self.preemptions += 1
                    self.finish(seq)
                    continue
                seq.blocks.append(self._new_block(seq.session, 1))
            else:
                self.fill[last] += 1
                self.tokens[last] = (*self.tokens[last], self.rng.randrange(1000))
                self.hashed[last] = self.fill[last] == self.bs
            seq.tokens += 1
        if self.seqs and self.rng.random() < 0.05:
            victim = self.rng.choice(self.seqs)
            self.finish(victim)
            if self._can_take(8):
                self.start(victim.session, prompt_blocks=self.rng.randint(2, 8))

    # ---- snapshot --------------------------------------------------------------------------

    def snapshot(self) -> PoolSnapshot:
        sessions = {}
        for sid in self.sessions:
            mine = [s for s in self.seqs if s.session == sid]
            held = {b for s in mine for b in s.blocks}
            sessions[sid] = SessionStats(
                session_id=sid,
                state=SequenceState.DECODING if mine else SequenceState.FINISHED,
                blocks_held=len(held),
                blocks_shared=sum(1 for b in held if self.refs[b] > 1),
                tokens_in_context=sum(s.tokens for s in mine),
                wasted_slots=sum(self.bs - self.fill[b] for b in held),
                tokens_per_s=12.5 * len(mine),
                requests=1 if mine else 0,
            )
        counters = Counters(
            steps=self.steps,
            batch_size=len(self.seqs),
            step_time_ms=80.0,
            schedule_time_ms=1.0,
            preemptions=self.preemptions,
            prefix_cache_hits=7,
            prefix_cache_queries=10,
            tokens_per_s=12.5 * len(self.seqs),
            generated_tokens=self.steps * len(self.seqs),
        )
        return PoolSnapshot(
            time=time.time(),
            block_size=self.bs,
            num_blocks=self.n,
            bytes_per_block=BYTES_PER_BLOCK,
            owners=tuple(tuple(h) for h in self.holders),
            refcounts=tuple(self.refs),
            fills=tuple(self.fill),
            cached=tuple(self.hashed),
            block_tokens=tuple(self.tokens),
            sessions=sessions,
            counters=counters,
            model_name="synthetic",
        )


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def measure(num_blocks: int, frames: int, width: int, height: int) -> dict[str, float]:
    from PySide6.QtGui import QImage

    from app.monitor.block_map import BlockMap

    pool = SyntheticPool(num_blocks, seed=num_blocks)
    snaps = []
    for _ in range(frames + 5):
        pool.step()
        snaps.append(pool.snapshot())  # built ahead: the engine thread builds them, not the GUI
    widget = BlockMap()
    widget.resize(width, height)
    widget.set_viewport_size(widget.size())
    widget.show()
    dpr = widget.devicePixelRatioF()
    fmt = QImage.Format.Format_ARGB32_Premultiplied
    image = QImage(round(width * dpr), round(height * dpr), fmt)
    image.setDevicePixelRatio(dpr)
    update_ms, render_ms, total_ms, idle_ms, cpu_ms = [], [], [], [], []
    for i, snap in enumerate(snaps):
        c0 = time.thread_time()
        t0 = time.perf_counter()
        widget.set_snapshot(snap)
        t1 = time.perf_counter()
        widget.render(image)
        t2 = time.perf_counter()
        c2 = time.thread_time()
        widget.render(image)  # the same snapshot again: an idle frame (cached image)
        t3 = time.perf_counter()
        if i >= 5:  # warm-up
            update_ms.append((t1 - t0) * 1000)
            render_ms.append((t2 - t1) * 1000)
            total_ms.append((t2 - t0) * 1000)
            cpu_ms.append((c2 - c0) * 1000)
            idle_ms.append((t3 - t2) * 1000)
    grid = widget.grid
    assert grid is not None
    widget.close()
    return {
        "blocks": num_blocks,
        "per_cell": grid.per_cell,
        "cells": grid.cells,
        "cell_px": grid.cell_size / dpr,
        "update_mean": statistics.fmean(update_ms),
        "render_mean": statistics.fmean(render_ms),
        "mean": statistics.fmean(total_ms),
        "p95": percentile(total_ms, 0.95),
        "cpu_mean": statistics.fmean(cpu_ms),
        "cpu_p95": percentile(cpu_ms, 0.95),
        "idle_mean": statistics.fmean(idle_ms),
    }


def measure_panel(num_blocks: int, frames: int) -> dict[str, float]:
    """The whole panel (map, key, legend, counters, timeline), 384 x 760 px, as in the app:
    the bridge emits a snapshot, then the event loop repaints what changed."""
    from PySide6.QtCore import QObject, Signal
    from PySide6.QtWidgets import QApplication

    from app.monitor import create_monitor

    class Bridge(QObject):
        snapshotUpdated = Signal(object)
        latest_snapshot = None
        engine = None

    pool = SyntheticPool(num_blocks, seed=num_blocks)
    snaps = []
    for _ in range(frames + 5):
        pool.step()
        snaps.append(pool.snapshot())
    bridge = Bridge()
    panel = create_monitor(bridge)
    panel.resize(384, 760)
    panel.show()
    QApplication.processEvents()
    wall, cpu = [], []
    for i, snap in enumerate(snaps):
        c0, t0 = time.thread_time(), time.perf_counter()
        bridge.snapshotUpdated.emit(snap)
        QApplication.processEvents()  # paints what the snapshot changed, as the app loop does
        if i >= 5:
            wall.append((time.perf_counter() - t0) * 1000)
            cpu.append((time.thread_time() - c0) * 1000)
    panel.close()
    return {"mean": statistics.fmean(wall), "p95": percentile(wall, 0.95),
            "cpu_mean": statistics.fmean(cpu), "cpu_p95": percentile(cpu, 0.95)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=200)
    p.add_argument("--width", type=int, default=420, help="map width, logical px")
    p.add_argument("--height", type=int, default=360, help="map height, logical px")
    p.add_argument("--scale", type=float, default=1.0, help="device pixel ratio to emulate")
    p.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    args = p.parse_args()
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    if args.scale != 1.0:
        os.environ["QT_SCALE_FACTOR"] = str(args.scale)
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication(sys.argv[:1])
    print(
        f"block map {args.width}x{args.height} px at scale {args.scale:g}, "
        f"{args.frames} frames, a new snapshot every frame"
    )
    print(
        f"{'blocks':>7} {'per cell':>8} {'cells':>6} {'cell px':>7} {'update':>7} "
        f"{'render':>7} {'frame mean':>10} {'frame p95':>9} {'cpu mean':>8} {'cpu p95':>7} "
        f"{'idle':>6}   (ms)"
    )
    ok = True
    for n in args.sizes:
        r = measure(n, args.frames, args.width, args.height)
        print(
            f"{r['blocks']:>7,} {r['per_cell']:>8} {r['cells']:>6,} {r['cell_px']:>7.1f} "
            f"{r['update_mean']:>7.2f} {r['render_mean']:>7.2f} {r['mean']:>10.2f} "
            f"{r['p95']:>9.2f} {r['cpu_mean']:>8.2f} {r['cpu_p95']:>7.2f} {r['idle_mean']:>6.2f}"
        )
        if n == 4096 and r["mean"] >= 5.0:
            ok = False
    print("whole panel (block map + key + legend + counters + timeline), 384x760 px:")
    for n in args.sizes:
        r = measure_panel(n, args.frames)
        print(
            f"{n:>7,} blocks: frame mean {r['mean']:.2f} ms, p95 {r['p95']:.2f} ms; "
            f"cpu mean {r['cpu_mean']:.2f} ms, p95 {r['cpu_p95']:.2f} ms"
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average {load:.1f} on {os.cpu_count()} cores (wall times grow with load; "
          "cpu = this thread's CPU time)")
    print("target: frame mean < 5 ms at 4,096 blocks:", "met" if ok else "NOT met")
    del app
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
