"""The composer's attachments: an Attach button, a chip per file (✕ removes it), and how many
prompt tokens the files add, with a warning when that is more than the context has left
(docs/ARCHITECTURE.md §6.5).

Files come from the button's file dialog or are dropped on the message input
(`accept_drops_on`). Reading and refusing is app/core/attachments.py's job; refusals reach the
user through `notice`. Tokens are counted by the engine's own tokenizer, off the GUI thread
(the bridge's `count_tokens`); until a model is loaded the bar says so instead of guessing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import QEvent, QObject, Qt, Signal
from PySide6.QtGui import QGuiApplication, QPalette
from PySide6.QtWidgets import QFileDialog, QHBoxLayout, QLabel, QToolButton, QWidget

from app.core.attachments import Attachment, AttachmentError, prompt_content, read_attachment
from app.ui import icons


def chips_html(attachments: list[Attachment], background: str) -> str:
    """The chips shown on a sent message (rich text for its rendered document). The paperclip
    is drawn (icons.py), as on the composer's Attach button: the emoji it was showed a box
    in fonts without one, as on most Linux desktops."""
    color = QGuiApplication.palette().color(QPalette.ColorRole.Text).name()
    clip = f'<img src="{icons.data_uri("paperclip", color, 12)}" width="12" height="12">'
    chips = " ".join(
        f'<span style="background-color:{background};">&nbsp;{clip}&nbsp;{_esc(a.name)}'
        "&nbsp;</span>"
        for a in attachments
    )
    return f"<p>{chips}</p>" if chips else ""


def _esc(text: str) -> str:
    import html

    return html.escape(text)


class AttachmentBar(QWidget):
    changed = Signal()
    notice = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("attachmentBar")
        self.pending: list[Attachment] = []
        self.tokens: int | None = None
        self.over_context = False
        # (files' prompt messages) -> awaitable token count; and the tokens the context has left
        self.count_tokens: Callable[[list[dict[str, str]]], Any] | None = None
        self.context_left: Callable[[], int | None] = lambda: None
        self._task: asyncio.Future | None = None
        row = QHBoxLayout(self)
        row.setContentsMargins(12, 0, 12, 0)
        row.setSpacing(4)
        self.attach_button = QToolButton(self)
        # A drawn icon, not an emoji: fonts without one (most Linux desktops) showed a box.
        self.attach_button.setText("Attach…")
        self.attach_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.refresh_icon()
        self.attach_button.setAccessibleName("Attach files")
        self.attach_button.setToolTip("Attach text, Markdown, code or PDF files (or drop them)")
        self.attach_button.setAutoRaise(True)
        self.attach_button.clicked.connect(self.pick)
        row.addWidget(self.attach_button)
        self.chips = QHBoxLayout()
        self.chips.setSpacing(4)
        row.addLayout(self.chips)
        self.status = QLabel()
        self.status.setObjectName("attachmentStatus")
        self.status.setAccessibleName("Attachment size")
        self.status.setWordWrap(True)
        row.addWidget(self.status, 1)

    def refresh_icon(self) -> None:
        """The paperclip in the current palette's text colour (again after a theme change)."""
        self.attach_button.setIcon(icons.icon("paperclip", size=14))
        self.attach_button.setIconSize(icons.icon_size(14))

    # ---- adding and removing -------------------------------------------------------------

    def pick(self) -> None:
        dialog = QFileDialog(self, "Attach Files")
        dialog.setObjectName("attachDialog")
        dialog.setOption(QFileDialog.Option.DontUseNativeDialog, True)
        dialog.setFileMode(QFileDialog.FileMode.ExistingFiles)
        dialog.setNameFilters(["Text, Markdown, code or PDF (*)"])
        if dialog.exec():
            self.add_paths(dialog.selectedFiles())

    def add_paths(self, paths: list[str] | list[Path]) -> int:
        """Attach what can be read; say why the rest cannot. Returns how many were added."""
        added, refused = 0, []
        for p in paths:
            try:
                self.pending.append(read_attachment(p))
                added += 1
            except AttachmentError as exc:
                refused.append(str(exc))
        if refused:
            self.notice.emit(" ".join(refused))
        if added:
            self._update()
        return added

    def remove(self, index: int) -> None:
        del self.pending[index]
        self._update()

    def take(self) -> list[Attachment]:
        """The files to send with a message; the bar is emptied."""
        out, self.pending = self.pending, []
        self._update()
        return out

    # ---- drops on the input --------------------------------------------------------------

    def accept_drops_on(self, widget: QWidget) -> None:
        """Files dropped on `widget` (the input's viewport) are attached, not pasted."""
        widget.setAcceptDrops(True)
        widget.installEventFilter(self)

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        kind = event.type()
        if kind in (QEvent.Type.DragEnter, QEvent.Type.DragMove, QEvent.Type.Drop):
            files = [u.toLocalFile() for u in event.mimeData().urls() if u.isLocalFile()]
            if files:
                event.acceptProposedAction()
                if kind == QEvent.Type.Drop:
                    self.add_paths(files)
                return True
        return super().eventFilter(obj, event)

    # ---- chips and the token count -------------------------------------------------------

    def _update(self) -> None:
        while self.chips.count():
            w = self.chips.takeAt(0).widget()
            if w is not None:
                w.deleteLater()
        for i, a in enumerate(self.pending):
            chip = QToolButton(self)
            chip.setObjectName("attachmentChip")
            chip.setText(f"{a.name}  {icons.drawable('✕', 'x', chip.font())}")
            chip.setAccessibleName(f"Remove {a.name}")
            chip.setToolTip(f"{a.name}: {len(a.text):,} characters ({a.kind}). Click to remove.")
            chip.clicked.connect(lambda _c=False, i=i: self.remove(i))
            self.chips.addWidget(chip)
        self.tokens = None
        self.over_context = False
        self._show_status()
        self._count()
        self.changed.emit()

    def _count(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if not self.pending or self.count_tokens is None:
            return
        messages = [{"role": "user", "content": prompt_content("", self.pending)}]

        async def count() -> None:
            n = await self.count_tokens(messages)
            if n is not None:
                self.tokens = n
                left = self.context_left()
                self.over_context = left is not None and n > left
                self._show_status()
                self.changed.emit()

        with contextlib.suppress(RuntimeError):  # no event loop (pure unit use)
            self._task = asyncio.ensure_future(count())

    def _show_status(self) -> None:
        n = len(self.pending)
        if not n:
            self.status.clear()
            return
        files = f"{n} file{'s' if n > 1 else ''}"
        if self.tokens is None:
            chars = sum(len(a.text) for a in self.pending)
            self.status.setText(f"{files} · {chars:,} characters (tokens counted once the "
                                "model is loaded)")
        elif self.over_context:
            left = self.context_left()
            self.status.setText(f"⚠ {files} · {self.tokens:,} tokens: more than the {left:,} "
                                "left in this chat's context; the model will not see it all.")
        else:
            self.status.setText(f"{files} · {self.tokens:,} tokens")
        self.status.setProperty("warning", self.over_context)
        self.status.style().unpolish(self.status)
        self.status.style().polish(self.status)
