"""The line under the message box: what the draft costs in tokens, flagged when too long.

A user learned that a message was too long only after sending it, from an error in the
reply (issue 25). The meter counts, off the GUI thread with the engine's own tokenizer (the
bridge's `count_tokens`), the whole prompt sending the draft now would give the model, a
moment after typing stops, and shows what the draft adds and how full the context would be.
At or over the model's limit (where the engine refuses, engine/requests/admission.py) it
turns into a warning and `too_long(text)` tells the pane to keep the draft instead of sending it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QLabel, QWidget

COUNT_DELAY_MS = 250  # count once typing pauses, not on every key


class DraftMeter(QLabel):
    changed = Signal()  # a new count was shown

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("draftMeter")
        self.setAccessibleName("Message length")
        self.setWordWrap(True)
        self.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        # wired by the pane: the text to count, the prompt it would make, the counter, the limit
        self.draft: Callable[[], str] = lambda: ""
        self.prompt_for: Callable[[str], list[dict]] = lambda text: []
        self.count_tokens: Callable[[list[dict]], Awaitable[int | None]] | None = None
        self.limit: Callable[[], int | None] = lambda: None
        self.context_used: Callable[[], int | None] = lambda: None
        self.counted: str | None = None  # the draft the shown numbers are for
        self.prompt_tokens: int | None = None
        self.over = False
        self._task: asyncio.Future | None = None
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(COUNT_DELAY_MS)
        self._timer.timeout.connect(self._count)
        self.hide()

    def schedule(self) -> None:
        """The draft (or what it is sent after) changed: count again once typing pauses."""
        self._timer.start()

    def too_long(self, text: str) -> bool:
        """The last count of exactly this draft reached the model's context limit."""
        return self.over and text == self.counted

    def _count(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        text = self.draft()
        if not text.strip() or self.count_tokens is None:
            self._show(None, None)
            return
        messages = self.prompt_for(text)

        async def count() -> None:
            n = await self.count_tokens(messages)
            if n is not None and text == self.draft():
                self._show(text, n)

        with contextlib.suppress(RuntimeError):  # no event loop (pure unit use)
            self._task = asyncio.ensure_future(count())

    def _show(self, text: str | None, prompt_tokens: int | None) -> None:
        self.counted, self.prompt_tokens = text, prompt_tokens
        limit = self.limit()
        self.over = bool(prompt_tokens is not None and limit and prompt_tokens >= limit)
        if prompt_tokens is None:
            self.clear()
            self.hide()
        else:
            used = self.context_used() or 0
            adds = max(0, prompt_tokens - used)
            of = f" of {limit:,}" if limit else ""
            if self.over:
                self.setText(f"Too long: {adds:,} tokens make the prompt {prompt_tokens:,}"
                             f"{of}, more than the model can read. Shorten it, or start a "
                             "new chat.")
            else:
                self.setText(f"{adds:,} tokens · {prompt_tokens:,}{of} in context")
            self.show()
        self.setProperty("warning", self.over)
        self.style().unpolish(self)
        self.style().polish(self)
        self.changed.emit()
