"""`pagedchat --demo [--screenshot FILE]`: three chats streaming side by side.

Two panes share a system prompt (so their prompt prefixes share KV blocks in the pool), the
third has its own. Replies are short (DEMO_MAX_TOKENS) so the demo finishes quickly even on a
CPU. With --screenshot, the window is saved as an image while all three replies stream and the
pool holds shared blocks (so the monitor shows live ownership and sharing, not only cached
blocks), and the demo exits once every reply is done.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from app.core.records import ChatSettings, Status
from engine import EngineStatus, SamplingParams

DEMO_MAX_TOKENS = 48
DEMO_TIMEOUT_S = 900.0
SHARED_SYSTEM = (
    "You are a friendly, concise assistant running locally on this computer. Answer in a few "
    "short sentences, use plain words, and give one concrete example when it helps the reader "
    "understand."
)  # long enough (40+ tokens) that both chats share whole KV blocks of it
DEMO_CHATS = (
    ("What is a KV cache?", SHARED_SYSTEM, "Explain what a KV cache is in a language model."),
    ("Paged memory haiku", SHARED_SYSTEM, "Write a haiku about sharing memory pages."),
    (
        "Reverse a string",
        "You are a Python expert. Reply with one short code block.",
        "Write a Python function that reverses a string.",
    ),
)


def log(text: str) -> None:
    print(f"pagedchat demo: {text}", file=sys.stderr, flush=True)


async def _wait(predicate: Any, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(step)
    return True


def open_demo_panes(window: Any, max_tokens: int = DEMO_MAX_TOKENS) -> list[Any]:
    """Open the three demo chats in panes (replacing an empty first pane); returns panes."""
    panes = []
    for i, (title, system, _prompt) in enumerate(DEMO_CHATS):
        settings = ChatSettings(
            system_prompt=system,
            sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens),
        )
        session = window.manager.create(title, settings)
        first = i == 0 and len(window.panes) == 1 and not window.panes[0].session.active_path()
        panes.append(window.open_chat(session.id, new_pane=not first))
    return panes


async def run_demo(window: Any, screenshot: str | None, max_tokens: int = DEMO_MAX_TOKENS) -> int:
    """Run the demo; returns the process exit code."""
    window.resize(1680, 1000)
    bridge = window.bridge
    panes = open_demo_panes(window, max_tokens)
    for pane, (_t, _s, prompt) in zip(panes, DEMO_CHATS, strict=True):
        pane.send(prompt)  # queued by the engine while the model loads
    log("waiting for the model and three replies…")
    shot_done = False
    if screenshot:

        def live() -> bool:
            snap = bridge.latest_snapshot
            return bridge.status == "error" or (
                bridge.status == "ready"
                and snap is not None
                and snap.shared_blocks > 0
                and all(
                    p.session.busy and len(p.session.active_path()[-1].content) >= 40
                    for p in panes
                )
            )

        def one_ended() -> bool:  # too late for all three at once: shoot the result later
            return any(
                p.session.active_path() and p.session.active_path()[-1].role == "assistant"
                and p.session.active_path()[-1].status not in Status.LIVE
                for p in panes
            )

        if (await _wait(lambda: live() or one_ended(), DEMO_TIMEOUT_S) and live()
                and bridge.status == "ready"):
            await asyncio.sleep(0.3)  # the monitor and the footers take the next snapshot
            shot_done = _save(window, screenshot)
            if not shot_done:
                return 1
    ok = await _wait(
        lambda: (
            bridge.status == EngineStatus.ERROR
            or (bridge.status == EngineStatus.READY and not any(p.session.busy for p in panes))
        ),
        DEMO_TIMEOUT_S,
    )
    if bridge.status == EngineStatus.ERROR:
        log(f"the model could not be loaded: {bridge.load_error}")
        return 1
    if not ok:
        log("timed out waiting for the replies")
        return 1
    for p in panes:
        p.session.refresh_context()
    await asyncio.sleep(0.6)  # let the footers, throttled renders and snapshot catch up
    if screenshot and not shot_done:
        log("the replies ended before all three streamed at once: screenshot of the result")
        if not _save(window, screenshot):
            return 1
    return 0


def _save(window: Any, screenshot: str) -> bool:
    # No processEvents() here: inside this coroutine it would run the bridge's pump tasks
    # re-entrantly (qasync: "Cannot enter into task"), killing the streams mid-reply. The
    # caller awaits first, so the window has painted the latest snapshot; grab() renders it.
    path = Path(screenshot).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    if not window.grab().save(str(path)):
        log(f"could not write {path}")
        return False
    log(f"screenshot saved to {path}")
    return True
