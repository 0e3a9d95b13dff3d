"""The Models window on the user's path (offscreen Qt): opened from its toolbar action, it
lists what is installed, downloads with progress from a loopback Hugging Face hub, cancels and
resumes, removes through its confirmation dialog and loads a model by the settings path.

Figures in the table are checked against independent sources: parameter counts against the
loaded mlx-lm model's own arrays, sizes against the files on disk.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from huggingface_hub import constants
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox

from app.core import downloads
from app.settings.models_window import PROGRESS_STEPS, ModelsWindow, human_bytes, human_count
from engine import Engine, EngineConfig
from tests.app_helpers import WAIT_MS, open_window
from tests.gui_helpers import click_button, when_modal
from tests.hf_server import LoopbackHub
from tests.reference import reference_model
from tests.tiny_model import make_tiny_model

REPO = "mlx-community/tiny-llama-window"
CACHED_REPO = "mlx-community/tiny-llama-cached"
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models-window") / "tiny",
                           reference_model().path)


@pytest.fixture
def hub(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    with LoopbackHub() as server:
        server.add(REPO, tiny)
        server.add(CACHED_REPO, tiny)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


@pytest.fixture
def window(qtbot, qasync_loop, app_env, tiny, hub):
    engine = Engine(EngineConfig(model=str(tiny), kv_memory_mib=1, block_size=8))
    engine.start()
    assert engine.wait_ready(120), engine.load_error
    h = open_window(qtbot, app_env, engine)
    yield h
    if h.window.models_window is not None and h.window.models_window.task is not None:
        h.window.models_window.task.cancel()
    h.close()
    engine.stop()


def open_models(h) -> ModelsWindow:
    """Through the toolbar button, as a user does."""
    from PySide6.QtWidgets import QToolButton

    button = h.window.toolbar.widgetForAction(h.window.act_models)
    assert isinstance(button, QToolButton) and button.isVisible()
    button.click()
    w = h.window.models_window
    assert w is not None and w.isVisible()
    return w


def row_of(w: ModelsWindow, name: str) -> dict[str, str] | None:
    t = w.installed
    for r in range(t.rowCount()):
        cells = {t.COLUMNS[c]: t.data(t.index(r, c)) for c in range(t.columnCount())}
        if cells["Name"] == name:
            return cells
    return None


def parameters_of(folder: Path) -> int:
    from mlx.utils import tree_flatten
    from mlx_lm import load

    model, _ = load(str(folder))
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def test_listing_shows_built_in_hf_cache_and_downloaded_models(window, tiny, hub, qtbot):
    from huggingface_hub import snapshot_download

    # A real HF cache entry, as mlx_lm or `hf download` make one.
    snapshot_download(CACHED_REPO, endpoint=hub.url, cache_dir=os.environ["HF_HUB_CACHE"])
    from engine import cache_dir

    shutil.copytree(tiny, downloads.folder_for(cache_dir() / "downloads", "someone/tiny-copy"))
    w = open_models(window)
    built_in = row_of(w, "SmolLM2-135M-Instruct")
    assert built_in is not None and built_in["Source"] == "built in"
    assert built_in["Architecture"] == "llama" and built_in["Paged"] == "yes"
    cached = row_of(w, CACHED_REPO)
    assert cached is not None, [m.name for m in w.installed.models]
    assert cached["Source"] == "Hugging Face cache"
    expected = {"Architecture": "llama", "Parameters": human_count(parameters_of(tiny)),
                "Quantization": "fp32", "Context": "512", "Paged": "yes",
                "Size on disk": human_bytes(sum(p.stat().st_size for p in tiny.iterdir()))}
    assert {k: cached[k] for k in expected} == expected
    downloaded = row_of(w, "someone/tiny-copy")
    assert downloaded is not None and downloaded["Source"] == "downloaded"
    assert downloaded["Parameters"] == expected["Parameters"]
    # A folder of the user's joins the list (and is only forgotten on removal).
    assert w.add_user_folder(tiny)
    assert row_of(w, "tiny") is not None and row_of(w, "tiny")["Source"] == "your folder"


def test_download_shows_progress_cancels_and_resumes(window, tiny, hub, qtbot):
    w = open_models(window)
    assert not w.progress.isVisible()  # no idle "0%" bar (issue 25 item 6)
    held = threading.Event()
    hub.state.hold[WEIGHTS] = held
    values: list[int] = []
    w.progress.valueChanged.connect(values.append)
    qtbot.keyClicks(w.repo_edit, REPO)
    qtbot.mouseClick(w.download_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: WEIGHTS in w.status.text() and w.progress.value() > 0,
                    timeout=WAIT_MS)
    assert " of " in w.status.text() and "/s" in w.status.text() and w.progress.isVisible()
    assert not w.download_button.isEnabled() and w.cancel_button.isEnabled()
    qtbot.mouseClick(w.cancel_button, Qt.MouseButton.LeftButton)
    held.set()  # the server sends the rest: the next chunk finds the cancel
    qtbot.waitUntil(lambda: "Download cancelled" in w.status.text(), timeout=WAIT_MS)
    folder = downloads.folder_for(w.downloads_root, REPO)
    part = folder / (WEIGHTS + downloads.PART_SUFFIX)
    assert part.is_file() and downloads.is_partial(folder)
    had = part.stat().st_size
    assert values == sorted(values) and 0 < values[-1] < PROGRESS_STEPS
    assert row_of(w, REPO) is None  # a partial download is not an installed model

    # A new Models window (as after a quit) offers the unfinished download.
    w.close()
    window.window.models_window = None
    w = open_models(window)
    assert w.repo_edit.text() == REPO and "Unfinished download" in w.status.text()
    values.clear()
    w.progress.valueChanged.connect(values.append)
    qtbot.mouseClick(w.download_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: w.status.text().startswith("Downloaded"), timeout=WAIT_MS)
    assert w.progress.value() == PROGRESS_STEPS and values == sorted(values)
    resumed = hub.state.gets(WEIGHTS)[-1]
    assert resumed.range == f"bytes={had}-"
    assert (folder / WEIGHTS).read_bytes() == (tiny / WEIGHTS).read_bytes()
    assert row_of(w, REPO) is not None and w.selected().name == REPO


def test_download_errors_show_in_the_window(window, hub, qtbot):
    w = open_models(window)
    qtbot.keyClicks(w.repo_edit, "mlx-community/no-such-model")
    qtbot.keyClick(w.repo_edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: "No model 'mlx-community/no-such-model'" in w.status.text(),
                    timeout=WAIT_MS)
    assert w.download_button.isEnabled()


def test_remove_asks_first_then_frees_the_disk(window, tiny, hub, qtbot):
    from huggingface_hub import snapshot_download

    snapshot = Path(snapshot_download(CACHED_REPO, endpoint=hub.url,
                                      cache_dir=os.environ["HF_HUB_CACHE"]))
    w = open_models(window)
    assert w.select_spec(str(snapshot)), [m.spec for m in w.installed.models]
    # Cancel first: nothing happens.
    seen = when_modal(lambda box: click_button(box, "Cancel"), QMessageBox)
    qtbot.mouseClick(w.remove_button, Qt.MouseButton.LeftButton)
    assert seen and snapshot.is_dir() and row_of(w, CACHED_REPO) is not None
    seen = when_modal(lambda box: click_button(box, "Remove"), QMessageBox)
    qtbot.mouseClick(w.remove_button, Qt.MouseButton.LeftButton)
    assert seen and "cannot be undone" in seen[0].text()
    assert not snapshot.exists() and row_of(w, CACHED_REPO) is None
    assert "freed" in w.status.text()


def test_load_switches_the_engine_and_chats_stay(window, tiny, hub, qtbot):
    w = open_models(window)
    chats_before = len(window.window.panes)
    assert w.add_user_folder(tiny)
    qtbot.mouseClick(w.load_button, Qt.MouseButton.LeftButton)
    assert window.window.settings.model_spec() == str(tiny)
    qtbot.waitUntil(lambda: window.bridge.status == "ready" and window.bridge.model_info
                    is not None and window.bridge.model_info.path == str(tiny)
                    and window.bridge.engine is not None and window.bridge.engine.config.model
                    == str(tiny), timeout=WAIT_MS)
    assert len(window.window.panes) == chats_before
    # The loaded model cannot be removed from under the engine.
    w.select_spec(str(tiny))
    qtbot.mouseClick(w.remove_button, Qt.MouseButton.LeftButton)
    assert "is the loaded model" in w.status.text()


def test_a_gated_download_uses_the_token_from_the_keychain(window, tiny, hub, qtbot):
    from app.core import secrets
    from tests.hf_server import GOOD_TOKEN

    hub.add("meta-llama/gated-window", tiny, gated=True)
    w = open_models(window)
    qtbot.keyClicks(w.repo_edit, "meta-llama/gated-window")
    qtbot.mouseClick(w.download_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "gated model" in w.status.text(), timeout=WAIT_MS)
    assert "add your Hugging Face token in Settings" in w.status.text()
    secrets.set_hf_token(GOOD_TOKEN)  # as Settings stores it
    try:
        qtbot.mouseClick(w.download_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: w.status.text().startswith("Downloaded"), timeout=WAIT_MS)
    finally:
        secrets.set_hf_token(None)
    assert row_of(w, "meta-llama/gated-window") is not None


def test_show_in_files_opens_the_models_folder(window, tiny, hub, qtbot, monkeypatch):
    """The file manager itself is not started in a test: the URL handed to Qt's desktop
    services is recorded instead."""
    from PySide6.QtGui import QDesktopServices

    opened = []
    monkeypatch.setattr(QDesktopServices, "openUrl", staticmethod(opened.append))
    w = open_models(window)
    assert w.add_user_folder(tiny)
    qtbot.mouseClick(w.reveal_button, Qt.MouseButton.LeftButton)
    assert [u.toLocalFile() for u in opened] == [str(tiny)]


def test_the_suggested_models_say_which_call_tools(window, hub, qtbot):
    """The Models window's suggested list marks the models that call tools in their own
    format, with a tooltip saying what that means, and includes at least one."""
    w = open_models(window)
    t = w.curated
    column = t.COLUMNS.index("Tools")
    marked = [t.models[r].repo_id for r in range(t.rowCount())
              if t.data(t.index(r, column)) == "calls tools"]
    assert marked and all("Qwen" in repo for repo in marked)
    first = next(r for r in range(t.rowCount()) if t.models[r].tools)
    tip = t.data(t.index(first, column), Qt.ItemDataRole.ToolTipRole)
    assert "chat template knows tools" in tip
    other = next(r for r in range(t.rowCount()) if not t.models[r].tools)
    assert "not trained on them" in t.data(t.index(other, column), Qt.ItemDataRole.ToolTipRole)
