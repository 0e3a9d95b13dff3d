"""File > Run Batch…: an OpenAI batch input file (JSONL) run on the app's own engine, with
its progress in a dock (done / total, tokens/s, time left) and a Cancel button.

The job (app/server/batch.py) runs on the GUI's asyncio loop (qasync) without blocking it:
reading and validating the file, tokenising and every write happen in worker threads, the
engine runs in its own. Its requests are BACKGROUND priority under the session
"batch:<id>", so they show in the KV monitor as "Batch <file>" and never slow the chats in
front of the user. The output goes next to the input, ``<name>.output.jsonl``; running the
same file again finishes an interrupted batch without computing its finished lines again.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QDockWidget,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.server.batch import (
    BatchInputError,
    BatchJob,
    BatchLine,
    LineError,
    OutputFile,
    Progress,
    read_input,
)

FOLDER_KEY = "batch_folder"  # the folder the last batch file came from
SESSION_PREFIX = "batch:"
MAX_ERRORS_SHOWN = 12
DEFAULT_CONCURRENCY = 16


async def _answered(box: QMessageBox) -> None:
    """Show ``box`` (window-modal) and wait for the user's answer on the loop: no nested
    event loop inside a coroutine."""
    answered = asyncio.get_running_loop().create_future()
    box.finished.connect(lambda _result: answered.done() or answered.set_result(None))
    box.open()
    await answered


def output_path(path: Path) -> Path:
    return path.with_name(path.stem + ".output.jsonl")


class BatchPanel(QDockWidget):
    """The dock that runs and shows one batch at a time."""

    def __init__(self, window: QMainWindow, store: Any, bridge: Any) -> None:
        super().__init__("Batch", window)
        self.setObjectName("batchDock")
        self.setAccessibleName("Batch job")
        self.window_ = window
        self.store = store
        self.bridge = bridge
        self.job: BatchJob | None = None
        self.task: asyncio.Future | None = None
        self.source: Path | None = None
        self.output: Path | None = None
        self.session_id: str | None = None
        body = QWidget()
        layout = QVBoxLayout(body)
        self.title = QLabel()
        self.title.setObjectName("batchTitle")
        self.title.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.bar = QProgressBar()
        self.bar.setObjectName("batchProgress")
        self.bar.setAccessibleName("Batch progress")
        self.status = QLabel()
        self.status.setObjectName("batchStatus")
        self.status.setWordWrap(True)
        row = QHBoxLayout()
        self.cancel_button = QPushButton("Cancel Batch")
        self.cancel_button.setObjectName("batchCancel")
        self.cancel_button.setToolTip("Stop the batch; the lines finished so far are kept and "
                                      "running the file again finishes the rest")
        self.cancel_button.clicked.connect(self.cancel)
        row.addStretch(1)
        row.addWidget(self.cancel_button)
        layout.addWidget(self.title)
        layout.addWidget(self.bar)
        layout.addWidget(self.status)
        layout.addLayout(row)
        layout.addStretch(1)
        self.setWidget(body)

    def install(self) -> None:
        self.window_.addDockWidget(Qt.DockWidgetArea.BottomDockWidgetArea, self)
        self.hide()

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def title_for(self, session_id: str) -> str | None:
        """The monitor's name for this panel's requests."""
        if session_id == self.session_id and self.source is not None:
            return f"Batch {self.source.name}"
        return None

    # ---- the user's path ------------------------------------------------------------------

    def run_batch(self) -> None:
        """File > Run Batch…: choose the file; the rest runs on the loop."""
        if self.running:
            QMessageBox.information(self.window_, "Run Batch",
                                    "A batch is running: cancel it or wait for it to finish "
                                    "before starting another.")
            self.show()
            return
        path = self._choose()
        if path is not None:
            self.task = asyncio.ensure_future(self.start(path))

    def _choose(self) -> Path | None:
        folder = self.store.get_value(FOLDER_KEY)
        if not isinstance(folder, str) or not Path(folder).is_dir():
            folder = str(Path.home())
        dialog = QFileDialog(self.window_, "Run Batch", folder)
        dialog.setObjectName("batchFileDialog")
        dialog.setOption(QFileDialog.Option.DontUseNativeDialog, True)
        dialog.setNameFilters(["OpenAI batch input (*.jsonl)", "All files (*)"])
        dialog.setAcceptMode(QFileDialog.AcceptMode.AcceptOpen)
        dialog.setFileMode(QFileDialog.FileMode.ExistingFile)
        if not dialog.exec() or not dialog.selectedFiles():
            return None
        path = Path(dialog.selectedFiles()[0])
        self.store.set_value(FOLDER_KEY, str(path.parent))
        return path

    async def start(self, path: Path) -> Progress | None:
        """Validate ``path`` (asking whether to skip bad lines), then run it to its end."""
        output = OutputFile(output_path(path))
        try:
            lines, errors = await asyncio.to_thread(read_input, path)
            await asyncio.to_thread(output.load, {line.custom_id for line in lines})
        except BatchInputError as exc:
            await self._tell(str(exc))
            return None
        if errors and not await self._skip_bad_lines(path, lines, errors):
            return None
        if not lines:
            await self._tell(f"{path.name} has no valid line.")
            return None
        return await self._run(path, lines, output)

    async def _tell(self, text: str) -> None:
        box = QMessageBox(QMessageBox.Icon.Warning, "Run Batch", text, parent=self.window_)
        box.setObjectName("batchProblem")
        await _answered(box)

    async def _skip_bad_lines(self, path: Path, lines: list[BatchLine],
                              errors: list[LineError]) -> bool:
        shown = "\n".join(str(e) for e in errors[:MAX_ERRORS_SHOWN])
        more = len(errors) - MAX_ERRORS_SHOWN
        box = QMessageBox(QMessageBox.Icon.Warning, "Run Batch",
                          f"{path.name}: {len(errors)} invalid line(s); nothing has run.",
                          parent=self.window_)
        box.setObjectName("batchErrors")
        box.setInformativeText(shown + (f"\n… and {more} more" if more > 0 else ""))
        skip = box.addButton(f"Run the {len(lines)} Valid Lines",
                             QMessageBox.ButtonRole.AcceptRole)
        box.addButton(QMessageBox.StandardButton.Cancel)
        skip.setEnabled(bool(lines))
        await _answered(box)
        return box.clickedButton() is skip

    async def _run(self, path: Path, lines: list[BatchLine], output: OutputFile) -> Progress:
        self.source, self.output = path, output.path
        self.session_id = SESSION_PREFIX + uuid.uuid4().hex[:8]
        config = self.bridge.config
        concurrency = 2 * config.max_batch if config is not None else DEFAULT_CONCURRENCY
        self.job = BatchJob(lines, output, lambda: self.bridge.engine, self.session_id,
                            concurrency=concurrency, on_progress=self.show_progress)
        self.title.setText(f"{path.name} → {output.path.name}")
        self.bar.setRange(0, len(lines))
        self.bar.setValue(0)
        self.status.setText("Starting…")
        self.cancel_button.setEnabled(True)
        self.show()
        self.raise_()
        try:
            progress = await self.job.run()
        finally:
            self.cancel_button.setEnabled(False)
        self.show_progress(progress, ended=True)
        return progress

    def show_progress(self, progress: Progress, ended: bool = False) -> None:
        self.bar.setValue(progress.done)
        text = progress.describe()
        if ended and self.job is not None:
            if self.job.complete:
                text = (f"Done: {progress.total} lines in {self.output} ({self.job.computed} "
                        f"computed, {progress.resumed} from an earlier run"
                        + (f", {progress.failed} failed" if progress.failed else "") + ").")
            else:
                text = (f"Cancelled with {progress.done} of {progress.total} lines in "
                        f"{self.output}; run the same file again to finish.")
        self.status.setText(text)

    def cancel(self) -> None:
        if self.job is not None and self.running:
            self.job.cancel()

    def shutdown(self) -> None:
        """The app quits: stop the job (its finished lines are on disk)."""
        self.cancel()
