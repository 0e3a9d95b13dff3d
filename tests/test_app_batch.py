"""File > Run Batch… on the user's path, on the real engine (offscreen Qt).

The menu item, the real (non-native) file dialog typed into, the invalid-lines dialog
answered with its button; then the batch panel's progress to the end, the batch's requests
in the KV monitor under "Batch <file>" at background priority, and an output equal to the
same requests run through the server's code path one at a time. A screenshot of the window
with the panel is saved where PAGEDCHAT_SCREENSHOT says.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication, QFileDialog, QMessageBox

from app.server.answer import answer, submit_parsed
from app.server.batch import parse_line
from app.window import batch_panel
from engine import Priority
from tests.app_helpers import WAIT_MS, open_window
from tests.test_library_gui import file_menu_action, fill_file_dialog
from tests.user_path import answer_modal

pytestmark = pytest.mark.model


@pytest.fixture
def harness(qtbot, qasync_loop, app_env, app_engine):
    h = open_window(qtbot, app_env, app_engine)
    yield h
    h.close()


def rows(n: int) -> list[dict]:
    return [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"temperature": 0, "max_tokens": 24,
                      "messages": [{"role": "user",
                                    "content": f"Tell me about the year {1900 + i}."}]}}
            for i in range(n)]


def comparable(body: dict) -> dict:
    body = json.loads(json.dumps(body))
    body.pop("id"), body.pop("created")
    body["usage"].pop("prompt_tokens_details", None)
    return body


async def one_at_a_time(engine, lines: list[dict]) -> list[dict]:
    """Each request alone through the endpoints' code path, the next after the last ended."""
    bodies = []
    for number, row in enumerate(lines, start=1):
        line = parse_line(number, json.dumps(row))
        submitted = await submit_parsed(engine, line.parsed, line.chat, "reference")
        bodies.append(await answer(submitted))
    return bodies


def test_run_batch_from_the_file_menu(harness, qtbot, tmp_path, app_engine) -> None:
    w, store = harness.window, harness.store
    good = rows(10)
    source = tmp_path / "questions.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in good[:3]) + "{oops\n"
                      + "".join(json.dumps(r) + "\n" for r in good[3:]))
    store.set_value(batch_panel.FOLDER_KEY, str(tmp_path))  # the folder used last time
    action = file_menu_action(w, "Run Batch…")
    assert action.isEnabled() and not w.batch_panel.isVisible()

    dialogs = answer_modal(qtbot, action.trigger,
                           lambda d: fill_file_dialog(qtbot, d, source), kind=QFileDialog)
    assert dialogs[0].objectName() == "batchFileDialog"

    # the bad line, by number; nothing runs until the user says to run the others
    qtbot.waitUntil(lambda: isinstance(QApplication.activeModalWidget(), QMessageBox),
                    timeout=WAIT_MS)
    box = QApplication.activeModalWidget()
    assert box.objectName() == "batchErrors" and "line 4: not valid JSON" in \
        box.informativeText()
    assert not (tmp_path / "questions.output.jsonl").exists()
    run = next(b for b in box.buttons() if b.text() == "Run the 10 Valid Lines")
    qtbot.mouseClick(run, Qt.MouseButton.LeftButton)

    panel = w.batch_panel
    qtbot.waitUntil(lambda: panel.isVisible() and panel.session_id is not None, timeout=WAIT_MS)
    session = panel.session_id
    assert session.startswith("batch:")
    # the monitor lists the batch's requests under the file's name, at background priority
    w.monitor_dock.show()
    legend = w.monitor_dock.widget().legend_model
    qtbot.waitUntil(lambda: (row := legend.row_data(session)) is not None
                    and row.state in ("waiting", "prefilling", "decoding"), timeout=WAIT_MS)
    row = legend.row_data(session)
    assert row.name == "Batch questions.jsonl" and row.priority == Priority.BACKGROUND
    shot = os.environ.get("PAGEDCHAT_SCREENSHOT")
    if shot:
        w.grab().save(shot)
    qtbot.waitUntil(lambda: not panel.running, timeout=WAIT_MS)
    assert panel.bar.value() == panel.bar.maximum() == 10
    assert panel.status.text().startswith("Done: 10 lines") and "10 computed" in \
        panel.status.text()
    assert not panel.cancel_button.isEnabled()

    records = [json.loads(r) for r in
               (tmp_path / "questions.output.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in records] == [r["custom_id"] for r in good]
    task = asyncio.ensure_future(one_at_a_time(app_engine, good))
    qtbot.waitUntil(task.done, timeout=WAIT_MS)
    for record, body in zip(records, task.result()):
        assert record["response"]["status_code"] == 200
        assert comparable(record["response"]["body"]) == comparable(body)
