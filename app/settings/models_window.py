"""The Models window: what is installed, load or switch, remove, reveal, and downloads.

Two Qt table models over plain data: the installed models (app/core/model_catalog.py) and a
short curated list of small mlx-community instruct models. Loading goes through the main
window's own model switch (the settings path: the engine restarts, open chats stay).
A download runs ``app.core.downloads.Download`` on a worker thread; its progress reaches the
GUI thread as queued signals, so the window never waits on the network.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QObject, Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QFileDialog,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from app.core import model_catalog
from app.core.downloads import (
    Download,
    DownloadCancelled,
    DownloadError,
    Progress,
    is_partial,
)
from app.core.model_catalog import CURATED, SOURCE_LABELS, CuratedModel, InstalledModel
from app.core.model_names import model_id, weights
from app.ui.confirm import confirm_destructive

PROGRESS_STEPS = 1000


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB") else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_count(n: int | None) -> str:
    if n is None:
        return "?"
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n:,}"


def human_time(seconds: float | None) -> str:
    if seconds is None:
        return "time left unknown"
    if seconds < 60:
        return f"{seconds:.0f} s left"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min left"
    return f"{seconds / 3600:.1f} h left"


def describe_progress(p: Progress) -> str:
    return (f"{p.file or p.repo_id}: {human_bytes(p.done)} of {human_bytes(p.total)} · "
            f"{human_bytes(p.speed)}/s · {human_time(p.eta_s)}")


def unfinished_downloads(root: Path) -> list[str]:
    """Repo ids of the downloads below ``root`` that were started and not finished."""
    if not root.is_dir():
        return []
    return sorted(f.name.replace("--", "/", 1) for f in root.iterdir()
                  if f.is_dir() and is_partial(f))


class _RowsTable(QAbstractTableModel):
    """A read-only table of ``rows``, one tuple of display strings per row (``cells``)."""

    COLUMNS: tuple[str, ...] = ()

    def __init__(self, rows: list | tuple = (), parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.models = list(rows)

    def cells(self, row: Any) -> tuple[str, ...]:
        raise NotImplementedError

    def rowCount(self, parent: QModelIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self.models)

    def columnCount(self, parent: QModelIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self.COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation,
                   role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return self.COLUMNS[section]
        return None

    def data(self, index: QModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        if role == Qt.ItemDataRole.DisplayRole:
            return self.cells(self.models[index.row()])[index.column()]
        if role == Qt.ItemDataRole.ToolTipRole:
            return self.tooltip(self.models[index.row()])
        return None

    def tooltip(self, row: Any) -> str | None:
        return None


class InstalledTable(_RowsTable):
    COLUMNS = ("Name", "Source", "Architecture", "Parameters", "Quantization", "Size on disk",
               "Context", "Paged")

    def set_models(self, models: list[InstalledModel]) -> None:
        self.beginResetModel()
        self.models = list(models)
        self.endResetModel()

    def cells(self, m: InstalledModel) -> tuple[str, ...]:
        return (model_id(m.name), SOURCE_LABELS[m.source], m.architecture,
                human_count(m.parameters), m.quantization, human_bytes(m.size_bytes),
                f"{m.context:,}" if m.context else "?", m.paged)

    def tooltip(self, m: InstalledModel) -> str:
        return str(m.path)


class CuratedTable(_RowsTable):
    COLUMNS = ("Model", "Parameters", "Download", "Tools", "Note")

    def cells(self, m: CuratedModel) -> tuple[str, ...]:
        return (m.repo_id, m.parameters, f"about {m.size_gb:.1f} GB",
                "calls tools" if m.tools else "", m.note)

    def tooltip(self, m: CuratedModel) -> str | None:
        if m.tools:
            return ("Calls tools in its own format: its chat template knows tools and "
                    "mlx-lm reads its calls (the API server's function calling)")
        return ("Tools still work through the API server (described to the model, and a "
                "required call is held to its schema), but this model was not trained on them")


class DownloadTask(QObject):
    """One Download on a worker thread; its outcome arrives as signals on the GUI thread."""

    progressed = Signal(object)  # Progress
    finished = Signal(str)  # the model folder
    failed = Signal(str)  # one sentence
    cancelled = Signal()

    def __init__(self, download: Download, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.download = download
        download.on_progress = self.progressed.emit
        self._thread = threading.Thread(target=self._run, name="pagedchat-download",
                                        daemon=True)  # a quit leaves .part files to resume

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        self.download.cancel()

    def is_running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            folder = self.download.run()
        except DownloadCancelled:
            self.cancelled.emit()
        except DownloadError as e:
            self.failed.emit(str(e))
        except Exception as e:  # a bug must still end the download visibly
            self.failed.emit(f"The download of {self.download.repo_id} failed: "
                             f"{type(e).__name__}: {e}")
        else:
            self.finished.emit(str(folder))


def _table(model: QAbstractTableModel, name: str) -> QTableView:
    view = QTableView()
    view.setModel(model)
    view.setAccessibleName(name)
    view.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    view.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
    view.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    view.verticalHeader().hide()
    view.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    view.horizontalHeader().setStretchLastSection(True)
    return view


class ModelsWindow(QDialog):
    """See the module docstring. ``switch_model(spec)`` is the main window's model switch;
    ``current_spec()`` names the loaded model (it cannot be removed while loaded)."""

    def __init__(self, store: Any, downloads_root: Path, switch_model: Callable[[str], Any],
                 current_spec: Callable[[], str], token: Callable[[], str | None],
                 parent: QWidget | None = None,
                 loaded_info: Callable[[], Any] | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("modelsWindow")
        self.setWindowTitle("Models")
        self.store = store
        self.downloads_root = downloads_root
        self.switch_model = switch_model
        self.current_spec = current_spec
        self.token = token
        self.loaded_info = loaded_info
        self.task: DownloadTask | None = None
        self.installed = InstalledTable(parent=self)
        self.curated = CuratedTable(CURATED, self)
        self._build()
        self.refresh()

    # ---- construction ----------------------------------------------------------------------

    def _button(self, text: str, slot: Callable[[], None], name: str) -> QPushButton:
        b = QPushButton(text)
        b.setAccessibleName(name)
        b.clicked.connect(slot)
        return b

    def _build(self) -> None:
        v = QVBoxLayout(self)
        box = QGroupBox("Installed")
        inner = QVBoxLayout(box)
        self.installed_view = _table(self.installed, "Installed models")
        inner.addWidget(self.installed_view)
        row = QHBoxLayout()
        self.load_button = self._button("&Load", self.load_selected, "Load the selected model")
        self.remove_button = self._button("&Remove…", self.remove_selected,
                                          "Remove the selected model")
        self.reveal_button = self._button("Show in &Files", self.reveal_selected,
                                          "Show the selected model's folder")
        self.add_button = self._button("&Add Folder…", self.add_folder, "Add a model folder")
        for b in (self.load_button, self.remove_button, self.reveal_button):
            row.addWidget(b)
        row.addStretch(1)
        row.addWidget(self.add_button)
        inner.addLayout(row)
        v.addWidget(box, 1)

        box = QGroupBox("Download from Hugging Face")
        inner = QVBoxLayout(box)
        inner.addWidget(QLabel("Small instruct models that answer better than the built-in "
                               "one (4-bit MLX conversions):"))
        self.curated_view = _table(self.curated, "Suggested models")
        self.curated_view.selectionModel().currentRowChanged.connect(self._curated_chosen)
        inner.addWidget(self.curated_view)
        row = QHBoxLayout()
        self.repo_edit = QLineEdit()
        self.repo_edit.setPlaceholderText("owner/name, e.g. mlx-community/Qwen3-0.6B-4bit")
        self.repo_edit.setAccessibleName("Hugging Face repo id")
        self.repo_edit.returnPressed.connect(self.start_download)
        row.addWidget(self.repo_edit, 1)
        self.download_button = self._button("&Download", self.start_download, "Download")
        self.cancel_button = self._button("&Cancel Download", self.cancel_download,
                                          "Cancel the download")
        self.cancel_button.setEnabled(False)
        row.addWidget(self.download_button)
        row.addWidget(self.cancel_button)
        inner.addLayout(row)
        self.progress = QProgressBar()
        self.progress.setRange(0, PROGRESS_STEPS)
        self.progress.setValue(0)
        self.progress.setAccessibleName("Download progress")
        # shown only while it has something to say (an idle "0%" read as a stuck download);
        # its room is kept, so the window does not jump when a download starts
        keep = self.progress.sizePolicy()
        keep.setRetainSizeWhenHidden(True)
        self.progress.setSizePolicy(keep)
        self.progress.hide()
        inner.addWidget(self.progress)
        self.status = QLabel("")
        self.status.setObjectName("modelsStatus")
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        inner.addWidget(self.status)
        v.addWidget(box, 1)
        self.installed_view.selectionModel().selectionChanged.connect(self._update_buttons)
        self.resize(920, 720)

    # ---- the installed list ----------------------------------------------------------------

    def refresh(self) -> None:
        keep = self.selected()
        models = model_catalog.scan(self.downloads_root,
                                    model_catalog.load_user_folders(self.store))
        info = self.loaded_info() if self.loaded_info is not None else None
        held = weights(getattr(info, "name", "")) if info is not None else ""
        if held:  # how the loaded one holds its weights, in the toolbar tooltip's words
            models = [dataclasses.replace(m, quantization=f"{m.quantization}, runs as {held}")
                      if m.spec == self.current_spec() else m for m in models]
        kv = getattr(info, "kv_dtype", "") if info is not None else ""
        if kv and getattr(info, "paged", True):  # which KV precision it runs with (issue #26)
            kv = "8-bit (int8)" if kv == "int8" else kv
            models = [dataclasses.replace(m, quantization=f"{m.quantization}, K/V {kv}")
                      if m.spec == self.current_spec() else m for m in models]
        if info is not None and not getattr(info, "paged", True):
            # What the loaded model turned out to be beats "checked at load".
            models = [dataclasses.replace(m, paged="no (mlx-lm's cache)")
                      if m.spec == self.current_spec() else m for m in models]
        self.installed.set_models(models)
        if keep is not None:
            self.select_spec(keep.spec)
        self._update_buttons()
        self._offer_unfinished()

    def _offer_unfinished(self) -> None:
        """After a cancel or a quit, say which download can be resumed, and prefill it."""
        if self.task is not None and self.task.is_running():
            return
        unfinished = unfinished_downloads(self.downloads_root)
        if unfinished and not self.repo_edit.text().strip():
            self.repo_edit.setText(unfinished[0])
            self.status.setText(f"Unfinished download: {unfinished[0]}. Click Download to "
                                "resume it where it stopped.")

    def selected(self) -> InstalledModel | None:
        rows = self.installed_view.selectionModel().selectedRows()
        return self.installed.models[rows[0].row()] if rows else None

    def select_spec(self, spec: str) -> bool:
        for i, m in enumerate(self.installed.models):
            if m.spec == spec:
                self.installed_view.selectRow(i)
                return True
        return False

    def _update_buttons(self, *_args: object) -> None:
        m = self.selected()
        self.load_button.setEnabled(m is not None)
        self.remove_button.setEnabled(m is not None and m.removable)
        self.reveal_button.setEnabled(m is not None)

    def load_selected(self) -> None:
        m = self.selected()
        if m is None:
            return
        self.switch_model(m.spec)
        self.status.setText(f"Loading {m.name}… open chats stay open.")

    def remove_selected(self) -> None:
        m = self.selected()
        if m is None or not m.removable:
            return
        if m.spec == self.current_spec():
            self.status.setText(f"{m.name} is the loaded model: load another one first, "
                                "then remove it.")
            return
        if m.source == model_catalog.FOLDER:
            text = (f"Forget the folder {m.path}?\n\nPagedChat did not make it, so its files "
                    "stay on disk.")
        else:
            text = (f"Remove {m.name}?\n\nThis deletes {human_bytes(m.size_bytes)} from "
                    f"{m.path} and cannot be undone.")
        if not confirm_destructive(self, "Remove Model", text, action="Remove"):
            return
        try:
            if m.source == model_catalog.FOLDER:
                folders = model_catalog.load_user_folders(self.store)
                model_catalog.save_user_folders(
                    self.store, [f for f in folders if Path(f).expanduser() != m.path])
            message = model_catalog.remove(m)
        except OSError as e:
            message = f"{m.name} could not be removed: {e}"
        self.status.setText(message)
        self.refresh()

    def reveal_selected(self) -> None:
        m = self.selected()
        if m is not None:
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(m.path)))

    def add_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Add a Model Folder")
        if folder:
            self.add_user_folder(Path(folder))

    def add_user_folder(self, folder: Path) -> bool:
        if model_catalog.describe_folder(folder, model_catalog.FOLDER) is None:
            self.status.setText(f"{folder} is not an mlx-lm model folder: it needs a "
                                "config.json with a model_type and model*.safetensors weights.")
            return False
        folders = model_catalog.load_user_folders(self.store)
        model_catalog.save_user_folders(self.store, [*folders, str(folder)])
        self.refresh()
        self.select_spec(str(folder))
        self.status.setText(f"Added {folder}.")
        return True

    # ---- downloads -------------------------------------------------------------------------

    def _curated_chosen(self, current: QModelIndex, _previous: QModelIndex) -> None:
        if current.isValid():
            self.repo_edit.setText(self.curated.models[current.row()].repo_id)

    def start_download(self) -> None:
        if self.task is not None and self.task.is_running():
            return
        repo = self.repo_edit.text().strip()
        if not repo:
            self.status.setText("Type a repo id (owner/name) or choose a suggested model.")
            return
        task = DownloadTask(Download(repo, self.downloads_root, token=self.token()), self)
        task.progressed.connect(self._on_progress)
        task.finished.connect(self._on_finished)
        task.failed.connect(self._on_failed)
        task.cancelled.connect(self._on_cancelled)
        self.task = task
        self.progress.setValue(0)
        self.status.setText(f"Looking up {repo}…")
        self._downloading(True)
        task.start()

    def cancel_download(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.status.setText("Cancelling…")

    def _downloading(self, busy: bool) -> None:
        self.progress.setVisible(busy or self.progress.value() > 0)
        self.download_button.setEnabled(not busy)
        self.cancel_button.setEnabled(busy)
        self.repo_edit.setReadOnly(busy)

    def _on_progress(self, p: Progress) -> None:
        self.last_progress = p
        self.progress.setValue(round(p.fraction * PROGRESS_STEPS))
        if not (self.task and self.task.download.cancelled):
            self.status.setText(describe_progress(p))

    def _on_finished(self, folder: str) -> None:
        self.progress.setValue(PROGRESS_STEPS)
        self._downloading(False)
        repo = self.task.download.repo_id if self.task else folder
        self.status.setText(f"Downloaded {repo}: select it above and click Load.")
        self.refresh()
        self.select_spec(folder)

    def _on_failed(self, message: str) -> None:
        self._downloading(False)
        self.status.setText(message)

    def _on_cancelled(self) -> None:
        self._downloading(False)
        p = self.task.download.progress() if self.task else None
        kept = f"{human_bytes(p.done)} kept" if p else "what was fetched is kept"
        self.status.setText(f"Download cancelled ({kept}): click Download to resume.")
