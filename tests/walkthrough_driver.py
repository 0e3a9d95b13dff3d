"""Drives the real PagedChat app (app.main.main, on a real X display) through a user's first
session, saving a screenshot of the screen after every step. Run by tests/test_walkthrough.py.

    python -m tests.walkthrough_driver first|relaunch SHOTS_DIR DATA_DIR

The driver makes the QApplication, queues itself, then calls the app's own `main()`, which
reuses that QApplication, opens the window and starts the engine exactly as a user's launch
does. Keys and clicks go through QTest (real events into the real widgets). A failed step
prints `STEP FAILED: ...` and exits 1; each finished step prints `STEP OK: name`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from PySide6.QtCore import QPoint, Qt, QTimer
from PySide6.QtGui import QCursor
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QAbstractButton, QApplication, QLineEdit, QMessageBox, QToolTip

STEP_TIMEOUT_S = 420.0
LONG_PROMPT = "Write a long story about a dragon who learns to read, with many chapters."
CTRL = Qt.KeyboardModifier.ControlModifier


class StepFailed(Exception):
    pass


class Driver:
    def __init__(self, phase: str, shots: Path) -> None:
        self.phase = phase
        self.shots = shots
        self.n = 0 if phase == "first" else 50
        self.window: Any = None

    # ---- helpers ---------------------------------------------------------------------------

    async def until(
        self, what: str, cond: Any, timeout: float = STEP_TIMEOUT_S, seen: Any = None
    ) -> None:
        """Wait (the event loop keeps running) until cond() is true; `seen()` says what there
        was instead when it never is."""
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                extra = f" (got {seen()})" if seen is not None else ""
                raise StepFailed(f"timed out waiting for {what}{extra}")
            await asyncio.sleep(0.05)

    async def settle(self) -> None:
        await asyncio.sleep(0.3)  # the event loop runs meanwhile (repaints, layouts)

    async def act(self, fn: Any) -> Any:
        """Run a user action from the event loop itself, not inside this task: clicks and
        modal dialogs spin nested event loops, which must not re-enter a running task."""
        future = asyncio.get_event_loop().create_future()

        def run() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:  # reported by the awaiting step
                future.set_exception(exc)

        QTimer.singleShot(0, run)
        result = await future
        await asyncio.sleep(0.05)
        return result

    def overlapping_rows(self) -> list[str]:
        """Rows whose painted parts leave their rectangle or run into the next row (item 3)."""
        bad = []
        for i, pane in enumerate(self.window.panes):
            view = pane.view
            model = view.model()
            if model is None:
                continue
            rects = [view.visualRect(model.index(r, 0)) for r in range(model.rowCount())]
            for r, rect in enumerate(rects):
                geo = view.row_geometry(r)
                parts = [geo.body, *geo.actions.values()]
                parts += [x for x in (geo.bubble, geo.counter) if x is not None and not x.isNull()]
                bottom = max(x.bottom() for x in parts)
                if bottom > rect.bottom():
                    bad.append(f"pane {i + 1} row {r}: painted to {bottom}, ends {rect.bottom()}")
            for r, (a, b) in enumerate(zip(rects, rects[1:])):
                if a.bottom() >= b.top():
                    bad.append(f"pane {i + 1} rows {r}/{r + 1} intersect")
        return bad

    async def shot(self, name: str) -> None:
        await self.settle()
        bad = self.overlapping_rows()
        if bad:
            raise StepFailed(f"before the {name} screenshot, message rows overlap: {bad}")
        self.n += 1
        path = self.shots / f"{self.n:02d}-{name}.png"
        screen = QApplication.primaryScreen()
        geo = self.window.frameGeometry()
        pixmap = screen.grabWindow(0, geo.x(), geo.y(), geo.width(), geo.height())
        if pixmap.isNull() or not pixmap.save(str(path)):
            raise StepFailed(f"could not save the screenshot {path}")
        print(f"STEP OK: {name} -> {path}", flush=True)

    async def type_into(self, widget: Any, text: str) -> None:
        def go() -> None:
            widget.setFocus()
            QTest.keyClicks(widget, text)

        await self.act(go)

    async def key(
        self, widget: Any, key: Qt.Key, mods: Any = Qt.KeyboardModifier.NoModifier
    ) -> None:
        await self.act(lambda: QTest.keyClick(widget, key, mods))

    async def click(self, widget: Any, pos: Any = None) -> None:
        if pos is None:
            await self.act(lambda: QTest.mouseClick(widget, Qt.MouseButton.LeftButton))
        else:
            await self.act(lambda: QTest.mouseClick(widget, Qt.MouseButton.LeftButton, pos=pos))

    def click_in_next_dialog(self, button_text: str) -> list[str]:
        seen: list[str] = []

        def check() -> None:
            box = QApplication.activeModalWidget()
            if isinstance(box, QMessageBox) and box.isVisible():
                seen.append(box.text())
                for b in box.findChildren(QAbstractButton):
                    if b.text().replace("&", "") == button_text:
                        QTest.mouseClick(b, Qt.MouseButton.LeftButton)
                        return
                seen.append(f"no {button_text} button")
                box.reject()
                return
            QTimer.singleShot(50, check)

        QTimer.singleShot(0, check)
        return seen

    async def activate(self) -> None:
        """Make the window the active one, as a user's click on it does. Xvfb runs no window
        manager, so nothing gives the focus back after a dialog closes, and a window that
        is not active gets no window shortcuts (Ctrl+Q did nothing)."""
        w = self.window
        await self.act(lambda: (w.raise_(), w.activateWindow()))
        await self.until("the window to be active", lambda: QApplication.activeWindow() is w, 10)

    async def quit_soon(self) -> None:
        """Ctrl+Q, the way a user quits, once this step has reported its success; a quit
        that does not happen within a minute fails the phase."""
        await self.activate()
        w = self.window

        def never_quit() -> None:
            print("STEP FAILED: Ctrl+Q did not quit within 60 s", flush=True)
            QApplication.exit(1)

        QTimer.singleShot(100, lambda: QTest.keyClick(w, Qt.Key.Key_Q, CTRL))
        QTimer.singleShot(60_000, never_quit)

    def pane(self, i: int) -> Any:
        return self.window.panes[i]

    def reply(self, pane: Any) -> Any:
        return pane.session.active_path()[-1]

    async def send(self, pane: Any, text: str, settings_tokens: int | None = None) -> None:
        await self.type_into(pane.input, text)
        await self.key(pane.input, Qt.Key.Key_Return)
        await self.until(
            "the reply to start", lambda: pane.session.busy or self.reply(pane).content
        )

    async def idle(self, *panes: Any) -> None:
        await self.until("the replies to finish", lambda: not any(p.session.busy for p in panes))

    # ---- the walk-through --------------------------------------------------------------------

    async def run(self) -> int:
        try:
            await self.until("the main window", self._find_window, 60)
            if self.phase == "first":
                await self.first_session()
            else:
                await self.relaunched()
            return 0
        except StepFailed as exc:
            print(f"STEP FAILED: {exc}", flush=True)
            return 1
        except Exception:
            print("STEP FAILED: an exception in the driver", flush=True)
            traceback.print_exc()
            return 1

    def _find_window(self) -> bool:
        from app.window.main_window import MainWindow

        for w in QApplication.topLevelWidgets():
            if isinstance(w, MainWindow) and w.isVisible():
                self.window = w
                return True
        return False

    async def first_session(self) -> None:
        w = self.window
        await self.shot("launched-loading")
        await self.until("the model", lambda: w.bridge.status == "ready")
        await self.shot("model-ready")

        await self.key(w, Qt.Key.Key_N, CTRL)
        p1 = w.focused_pane
        if p1.session.tree.by_id:
            raise StepFailed("Ctrl+N did not give an empty chat")
        await self.shot("new-chat")

        await self.send(p1, "Say hello in five words.")
        await self.idle(p1)
        if not self.reply(p1).content:
            raise StepFailed("no reply text")
        await self.shot("sent-and-answered")

        split = w.toolbar.widgetForAction(w.act_new_pane)
        for _ in range(3):
            await self.click(split)  # the toolbar's Split button
        if len(w.panes) != 4:
            raise StepFailed(f"{len(w.panes)} panes, not 4")
        screen = w.screen().availableGeometry()
        if w.frameGeometry().width() > screen.width():
            raise StepFailed("four panes made the window wider than the screen")
        await self.shot("four-panes")
        await self.four_panes_at_1280()

        width = w.width()
        send_all = w.toolbar.widgetForAction(w.act_send_all)
        await self.click(send_all)
        if not w.compare_bar.isVisible():
            raise StepFailed("the Send to All button did not open its bar")
        await self.type_into(w.compare_bar.input, "Name one colour and one fruit.")
        await self.key(w.compare_bar.input, Qt.Key.Key_Return)
        await self.until("all four to answer", lambda: all(p.session.busy for p in w.panes), 30)

        def all_hold_blocks() -> bool:
            snap = w.bridge.latest_snapshot
            sessions = snap.sessions if snap is not None else {}
            return all(
                p.session.id in sessions and sessions[p.session.id].blocks_held > 0
                for p in w.panes
            )

        await self.until("the monitor to show all four chats' blocks", all_hold_blocks, 60)
        await self.shot("send-to-all-streaming")
        await self.idle(*w.panes)
        if w.width() != width:
            raise StepFailed(f"streaming changed the window width {width} -> {w.width()}")
        await self.shot("send-to-all-done")
        await self.click(send_all)  # the bar closes again
        await self.input_that_cannot_hurt(p1, send_all)

        await self.click(p1.input)
        await self.send(p1, LONG_PROMPT)
        await self.until("streamed text", lambda: len(self.reply(p1).content) > 20)
        await self.key(p1.input, Qt.Key.Key_Escape)  # Esc stops
        await self.idle(p1)
        if self.reply(p1).status != "stopped":
            raise StepFailed(f"after Esc the reply is {self.reply(p1).status}")
        await self.shot("stopped")

        await self.act(w.act_regen.trigger)  # Chat ▸ Regenerate
        await self.until("regenerating", lambda: p1.session.busy, 30)
        await self.until("streamed text", lambda: len(self.reply(p1).content) > 20)
        await self.click(p1.send_button)  # the stop button
        await self.idle(p1)
        _pos, count = p1.session.tree.sibling_position(self.reply(p1).id)
        if count != 2:
            raise StepFailed(f"regenerate left {count} alternatives, not 2")
        await self.shot("regenerated")

        view = p1.view
        rows = view.model().rowCount()
        user_row = rows - 2
        await self.act(view.scrollToBottom)
        await self.settle()
        geo = view.row_geometry(user_row)
        edit = geo.actions.get("edit")
        if edit is None:
            raise StepFailed("no edit action on the user message")
        await self.act(lambda: QTest.mouseMove(view.viewport(), edit.center()))
        await self.settle()
        await self.click(view.viewport(), edit.center())
        await self.settle()
        if not p1.edit_banner.isVisible():
            raise StepFailed("clicking edit did not start editing")
        await self.act(p1.input.selectAll)
        await self.type_into(p1.input, "Write two sentences about a dragon.")
        await self.key(p1.input, Qt.Key.Key_Return)
        await self.until("the edited reply", lambda: p1.session.busy, 30)
        await self.idle(p1)
        user = p1.session.active_path()[-2]
        if user.content != "Write two sentences about a dragon.":
            raise StepFailed(f"the edited message reads {user.content!r}")
        await self.shot("edited")
        await self.hover_readouts(p1)

        before = {p.session.id for p in w.panes}
        await self.act(w.act_branch.trigger)  # Chat ▸ Branch From Last Message
        await self.settle()
        branch = w.focused_pane.session
        if branch.id in before or not branch.title.startswith("Branch of"):
            raise StepFailed(f"no branch opened (focused: {branch.title})")
        await self.shot("branched")

        doomed = self.pane(1)
        await self.click(doomed.input)
        await self.send(doomed, LONG_PROMPT)
        await self.until("streamed text", lambda: len(self.reply(doomed).content) > 20)
        await self.shot("streaming-before-delete")
        sid = doomed.session.id
        seen = self.click_in_next_dialog("Delete")
        await self.act(w.act_delete.trigger)
        if not seen or "no Delete button" in seen:
            raise StepFailed(f"the delete dialog did not work: {seen}")
        await self.until("the request to end", lambda: not w.bridge.active_requests(sid), 60)
        if w.store.get_conversation(sid) is not None or w.pane_for(sid) is not None:
            raise StepFailed("the deleted chat is still there")
        await self.shot("deleted-streaming-chat")

        def size() -> str:
            return f"{w.width()}x{w.height()}, minimum {w.minimumSizeHint().toTuple()}"

        await self.act(lambda: w.resize(1280, 800))
        await self.until("1280x800", lambda: (w.width(), w.height()) == (1280, 800), 20, size)
        sizes_before = await self.side_sizes()
        # through a size where the monitor is capped to a share of the window (it came back
        # from there at the capped width) and one where it steps aside
        await self.act(lambda: w.resize(1100, 700))
        await self.until("1100x700", lambda: (w.width(), w.height()) == (1100, 700), 20, size)
        await self.settled_geometries()
        await self.act(lambda: w.resize(800, 600))
        await self.until("800x600", lambda: (w.width(), w.height()) == (800, 600), 20, size)
        await self.until("the monitor to step aside", lambda: not w.monitor_dock.isVisible(), 20)
        await self.settle()
        if any(p.width() < 140 for p in w.panes):
            raise StepFailed(f"panes too narrow at 800 px: {[p.width() for p in w.panes]}")
        await self.shot("small-800x600")
        await self.act(lambda: w.resize(1500, 900))
        await self.until("1500x900", lambda: (w.width(), w.height()) == (1500, 900), 20, size)
        await self.until("the monitor to come back", lambda: w.monitor_dock.isVisible(), 20)
        await self.shot("back-to-1500x900")
        await self.act(lambda: w.resize(1280, 800))  # and back where it was: the same widths
        await self.until("1280x800", lambda: (w.width(), w.height()) == (1280, 800), 20, size)
        sizes_after = await self.side_sizes()
        if sizes_after != sizes_before:
            raise StepFailed(f"resized and restored, the layout changed: {sizes_before} -> "
                             f"{sizes_after} (monitor, sidebar, panes)")
        await self.shot("restored-1280x800")
        await self.act(lambda: w.resize(1500, 900))
        await self.until("1500x900", lambda: (w.width(), w.height()) == (1500, 900), 20, size)
        await self.settled_geometries()

        await self.mcp_tool_call()
        await self.theme_switches()

        state = {
            "panes": [p.session.id for p in w.panes],
            "chats": sorted(c.id for c in w.store.list_conversations()),
        }
        (self.shots / "state.json").write_text(json.dumps(state))
        await self.quit_soon()

    async def input_that_cannot_hurt(self, p1: Any, send_all: Any) -> None:
        """Issue 25 item 3 the way a user meets it: Send to All with a draft already typed,
        a double click on Send, and Esc from the message list."""
        w = self.window
        await self.click(p1.input)
        await self.type_into(p1.input, "Name a river.")
        await self.click(send_all)
        await self.until("the typed draft to go out", lambda: not p1.input.toPlainText(), 30)
        if p1.input.toPlainText() or w.compare_bar.isVisible():
            raise StepFailed("Send to All left the draft behind or opened an empty bar")
        await self.idle(*w.panes)
        if [p.session.active_path()[-2].content for p in w.panes] != ["Name a river."] * 4:
            raise StepFailed("the draft did not reach all four panes")
        await self.shot("send-to-all-the-draft")

        await self.type_into(p1.input, "Say hello.")
        button = p1.send_button
        pos = button.mapTo(w, button.rect().center())
        # a double click as the window system delivers it: the second click lands on Stop
        await self.act(lambda: QTest.mouseDClick(w.windowHandle(), Qt.MouseButton.LeftButton,
                                                 Qt.KeyboardModifier.NoModifier, pos))
        await self.until("the reply to start", lambda: p1.session.busy or self.reply(p1).content)
        await self.idle(p1)
        if self.reply(p1).status == "stopped" or not self.reply(p1).content:
            raise StepFailed(f"a double click on Send left the reply {self.reply(p1).status}")
        await self.shot("double-click-on-send")

        await self.send(p1, LONG_PROMPT)
        await self.until("streamed text", lambda: len(self.reply(p1).content) > 20)
        view = p1.view
        await self.activate()  # no window manager under Xvfb: activate as a user's click does
        await self.click(view.viewport(), view.viewport().rect().center())  # on the messages
        await self.until("the message list to take the focus", view.hasFocus, 10)
        await self.key(view, Qt.Key.Key_Escape)
        await self.idle(p1)
        if self.reply(p1).status != "stopped":
            raise StepFailed(f"Esc in the message list left the reply {self.reply(p1).status}")
        await self.shot("esc-from-the-message-list")

    async def hover_readouts(self, pane: Any) -> None:
        """Item 7 on a real X server: a message action's tooltip stays while the pointer
        stays on the button (it vanished within 1.4 s), and the 60 s timeline reads out the
        sample under the pointer."""
        from app.chat.delegate import ACTION_TIPS

        view, vp = pane.view, pane.view.viewport()
        await self.act(view.scrollToBottom)
        await self.settle()
        copy = view.row_geometry(view.model().rowCount() - 1).actions.get("copy")
        if copy is None:
            raise StepFailed("no copy action on the reply")
        tip = ACTION_TIPS["copy"]

        def showing() -> bool:
            return QToolTip.isVisible() and QToolTip.text() == tip

        # the real X pointer (a warp makes the X server send motion and enter/leave events,
        # tooltip windows included, as a mouse does), not events posted into Qt
        def point_at(p: QPoint) -> None:
            QCursor.setPos(vp.mapToGlobal(p))

        await self.act(lambda: point_at(copy.center()))
        await self.until("the copy button's tooltip", showing, 10)
        gone = []
        for i in range(25):  # 2.5 s of small moves on the button, as a resting hand makes
            await self.act(lambda i=i: point_at(copy.center() + QPoint(i % 3 - 1, 0)))
            await asyncio.sleep(0.1)  # pacing the moves, not waiting for a state
            if not showing():
                gone.append(i)
        if gone:
            raise StepFailed(f"the tooltip vanished while hovered (after moves {gone})")
        await self.shot("tooltip-while-hovered")

        panel = self.window.monitor_dock.widget()
        tl = panel.timeline
        await self.act(lambda: panel.scroll.ensureWidgetVisible(tl))
        await self.act(lambda: QCursor.setPos(tl.mapToGlobal(QPoint(tl.width() // 3, 60))))
        await self.until(
            "the timeline's readout", lambda: tl.hover_text and QToolTip.isVisible(), 10
        )
        text = tl.hover_text
        if not ("blocks used" in text and "tok/s" in text and ("s ago" in text or "now" in text)):
            raise StepFailed(f"the timeline's readout reads {text!r}")
        if QToolTip.text() != text:
            raise StepFailed(f"the tooltip {QToolTip.text()!r} is not the readout {text!r}")
        await self.shot("timeline-readout")
        # park the pointer off the window (the screen's corner; the window is never that
        # large): over a pane it would highlight that chat in the block map, fading the
        # others, in every later screenshot
        corner = self.window.screen().geometry().bottomRight() - QPoint(2, 2)
        await self.act(lambda: QCursor.setPos(corner))

    # ---- issue 25: a layout that holds (item 4), finish (6), keyboard and a11y (7) ---------

    async def settled_geometries(self) -> dict[str, tuple]:
        """Every widget's place once the layout has stopped moving (two looks agree)."""
        from tests.ui_checks import geometries

        last = None
        for _ in range(50):
            await self.settle()
            now = geometries(self.window)
            if now == last:
                return now
            last = now
        raise StepFailed("the layout never settled")

    async def side_sizes(self) -> tuple:
        w = self.window
        await self.settled_geometries()
        return (w.monitor_dock.width() if w.monitor_dock.isVisible() else 0,
                w.sidebar.width() if w.sidebar.isVisible() else 0,
                [p.width() for p in w.panes])

    async def four_panes_at_1280(self) -> None:
        """Four panes and the monitor at 1280 x 800: the sidebar steps aside and no pane
        header cuts its title or model (they read "What i…" and "Local")."""
        from tests.ui_checks import header_cuts

        w = self.window
        await self.act(lambda: w.resize(1280, 800))
        await self.until("1280x800", lambda: (w.width(), w.height()) == (1280, 800), 20)
        await self.until("the sidebar to step aside", lambda: not w.sidebar.isVisible(), 20)
        if not w.monitor_dock.isVisible():
            raise StepFailed("the monitor is not shown beside four panes at 1280 px")
        await self.settled_geometries()
        cuts = [c for p in w.panes for c in header_cuts(p)]
        if cuts:
            raise StepFailed(f"pane headers cut text at 1280 px: {cuts}")
        await self.shot("four-panes-1280x800")

    async def theme_switches(self) -> None:
        """Dark and back to light: no widget moves or changes size, the menu bar follows."""
        w = self.window
        light = await self.settled_geometries()
        for theme in ("dark", "light"):
            await self.act(w.theme_actions[theme].trigger)
            now = await self.settled_geometries()
            moved = {k.rsplit("/", 1)[-1]: (v, now.get(k)) for k, v in light.items()
                     if now.get(k) != v}
            if moved:
                raise StepFailed(f"switching to the {theme} theme moved widgets: {moved}")
            bar = w.menuBar()
            last = bar.actionGeometry(bar.actions()[-1])
            image = bar.grab().toImage()
            x = (last.right() + bar.width()) // 2 * image.width() // max(1, bar.width())
            lightness = image.pixelColor(x, image.height() // 2).lightness()
            if (lightness < 80) != (theme == "dark"):
                raise StepFailed(f"the menu bar's lightness is {lightness} in the {theme} theme")
            await self.shot(f"{theme}-theme")

    async def screen_reader_walk(self) -> None:
        """The real window as a screen reader reaches it: every control named, the monitor's
        counters read with their values."""
        from tests.ui_checks import accessible_nodes, unnamed_interactive

        w = self.window
        unnamed = unnamed_interactive(w)
        if unnamed:
            raise StepFailed(f"controls a screen reader cannot name: {unnamed}")
        names = [name for _role, name, _cls, _obj in accessible_nodes(w)]
        counters = w.monitor_dock.widget().counters
        used = counters.values["used"]
        if f"Used: {used.text()}" not in names or used.text() == "–":
            raise StepFailed(f"the Used counter reads {used.accessibleName()!r}")
        messages = [n for n in names if n.startswith(("You: ", "Assistant: "))]
        if not messages:
            raise StepFailed("no message is named for a screen reader")
        await self.shot("screen-reader-walk")

    async def press(self, key: Qt.Key, mods: Any = Qt.KeyboardModifier.NoModifier) -> None:
        """A key to whatever has the keyboard focus, as a keyboard does."""
        await self.act(lambda: QTest.keyClick(QApplication.focusWidget() or self.window,
                                              key, mods))

    async def type_here(self, text: str) -> None:
        await self.act(lambda: QTest.keyClicks(QApplication.focusWidget(), text))

    def in_next_dialog(self, kind: type, name: str, key: Qt.Key) -> list[str]:
        """Once a modal `kind` shows: save a screenshot of the screen as step `name`, then
        press `key` in it (a keyboard user's answer)."""
        seen: list[str] = []

        def check() -> None:
            box = QApplication.activeModalWidget()
            if isinstance(box, kind) and box.isVisible():
                self.n += 1
                path = self.shots / f"{self.n:02d}-{name}.png"
                geo = box.frameGeometry().united(self.window.frameGeometry())
                QApplication.primaryScreen().grabWindow(
                    0, geo.x(), geo.y(), geo.width(), geo.height()).save(str(path))
                print(f"STEP OK: {name} -> {path}", flush=True)
                seen.append(name)
                QTest.keyClick(QApplication.focusWidget() or box, key)
                return
            QTimer.singleShot(50, check)

        QTimer.singleShot(0, check)
        return seen

    def drive_next_dialog(self, kind: type, name: str, steps: Any) -> list[str]:
        """Once a modal ``kind`` shows, call ``steps(box, shot)`` every 50 ms until it returns
        True (it has closed the box); ``shot()`` saves a screenshot of the dialog over the
        window as step ``name``. Errors are returned in the list, prefixed with "error"."""
        seen: list[str] = []

        def shot(box: Any) -> None:
            self.n += 1
            path = self.shots / f"{self.n:02d}-{name}.png"
            geo = box.frameGeometry().united(self.window.frameGeometry())
            QApplication.primaryScreen().grabWindow(
                0, geo.x(), geo.y(), geo.width(), geo.height()).save(str(path))
            print(f"STEP OK: {name} -> {path}", flush=True)
            seen.append(name)

        def poll() -> None:
            box = QApplication.activeModalWidget()
            if isinstance(box, kind) and box.isVisible():
                try:
                    if steps(box, lambda: shot(box)):
                        return
                except Exception as exc:  # reported by the awaiting step
                    seen.append(f"error {exc!r}")
                    box.reject()
                    return
            QTimer.singleShot(50, poll)

        QTimer.singleShot(0, poll)
        return seen

    async def mcp_tool_call(self) -> None:
        """Issue 29 item 3 the way a user meets it: an MCP server (written with the official
        SDK, over stdio) added in Settings ▸ Tools, a chat with tools on and "Call a tool
        first", the pane's question, Allow once, the result in its block and the answer."""
        import tempfile

        from PySide6.QtWidgets import QDialogButtonBox

        from app.chat.chat_settings_dialog import ChatSettingsDialog
        from app.settings.dialog import SettingsDialog
        from tests.mcp_servers import write_single_server

        w = self.window
        script = write_single_server(Path(tempfile.mkdtemp(prefix="walk-mcp-")), "ok")
        state = {"added": False}

        def add_server(box: Any, shot: Any) -> bool:
            page = box.tools_page
            if not state["added"]:
                box.tabs.setCurrentWidget(page)
                QTest.keyClicks(page.name_edit, "Weather")
                QTest.keyClicks(page.command_edit, sys.executable)
                QTest.keyClicks(page.args_edit, str(script))
                QTest.mouseClick(page.add_button, Qt.MouseButton.LeftButton)
                state["added"] = True
                return False
            if "1 tool(s)" not in page.tools_label.text():
                return False  # the server is starting and listing its tools
            shot()
            QTest.mouseClick(box.buttons.button(QDialogButtonBox.StandardButton.Cancel),
                             Qt.MouseButton.LeftButton)
            return True

        await self.activate()
        seen = self.drive_next_dialog(SettingsDialog, "settings-tools-server-added", add_server)
        await self.act(lambda: w.act_settings.trigger())
        await self.until("Settings ▸ Tools to list the server's tool", lambda: seen
                         and QApplication.activeModalWidget() is None, 90, lambda: seen)
        if seen != ["settings-tools-server-added"]:
            raise StepFailed(f"Settings ▸ Tools: {seen}")
        if [s.name for s in w.tools.servers.servers()] != ["Weather"]:
            raise StepFailed("the added server is not in the app's tools")

        pane = w.focused_pane

        def tools_on(box: Any, shot: Any) -> bool:
            box.form.tools_check.setChecked(True)
            box.form.tools_first.setChecked(True)
            QTest.mouseClick(box.buttons.button(QDialogButtonBox.StandardButton.Ok),
                             Qt.MouseButton.LeftButton)
            return True

        seen = self.drive_next_dialog(ChatSettingsDialog, "chat-settings-tools", tools_on)
        await self.click(pane.settings_button)
        await self.until("the chat settings to close", lambda: QApplication.activeModalWidget()
                         is None, 30)
        if not pane.session.settings.tools or pane.session.settings.tool_choice != "required":
            raise StepFailed(f"chat settings did not turn tools on: {seen}")
        await self.send(pane, "What is the weather in Lisbon?")
        await self.until("the pane to ask about the call", lambda: pane.tool_bar.isVisible()
                         or not pane.session.busy)
        if not pane.tool_bar.isVisible():
            raise StepFailed("the reply ended without a tool call: "
                             f"{[(m.role, m.content[:40]) for m in pane.session.active_path()]}")
        if "weather" not in pane.tool_label.text():
            raise StepFailed(f"the question does not name the tool: {pane.tool_label.text()!r}")
        shown = pane.model.waiting_text(pane.session.active_path()[-1])
        if not shown.startswith("Waiting for your answer: call weather"):
            raise StepFailed(f"while asking, the tool's row says {shown!r}")
        await self.shot("tool-call-asked")
        await self.click(pane.allow_once_button)
        await self.idle(pane)
        roles = [m.role for m in pane.session.active_path()[-4:]]
        if roles != ["user", "assistant", "tool", "assistant"] or not self.reply(pane).content:
            raise StepFailed(f"after Allow once the chat is {roles}")
        result = pane.session.active_path()[-2]
        if "sunny and 31 degrees" not in result.content:
            raise StepFailed(f"the tool's result is {result.content!r}")
        await self.shot("tool-call-answered")

    async def keyboard_only(self) -> None:
        """A session with the keyboard alone: every key goes to the focused widget."""
        from app.window.shortcuts_dialog import ShortcutsDialog

        w = self.window
        shift = Qt.KeyboardModifier.ShiftModifier
        await self.activate()
        await self.press(Qt.Key.Key_N, CTRL)  # File ▸ New Chat
        pane = w.focused_pane
        await self.until("the new chat's message box to have the focus",
                         lambda: QApplication.focusWidget() is pane.input, 10)
        await self.type_here(LONG_PROMPT)
        await self.press(Qt.Key.Key_Return)
        await self.until("streamed text", lambda: len(self.reply(pane).content) > 5)
        await self.press(Qt.Key.Key_Escape)  # Esc stops it (the focus is in its box)
        await self.idle(pane)
        if self.reply(pane).status != "stopped":
            raise StepFailed(f"after Esc the reply is {self.reply(pane).status}")
        # Help ▸ Keyboard Shortcuts is modal: a poll from the event loop photographs it and
        # closes it with Esc
        seen = self.in_next_dialog(ShortcutsDialog, "keyboard-shortcuts", Qt.Key.Key_Escape)
        await self.press(Qt.Key.Key_Slash, CTRL)
        await self.until("the shortcuts to open and close", lambda: seen
                         and QApplication.activeModalWidget() is None, 10)
        if seen != ["keyboard-shortcuts"]:
            raise StepFailed(f"Ctrl+/ did not show the shortcuts and close on Esc: {seen}")
        await self.activate()
        await self.press(Qt.Key.Key_F2)  # Edit ▸ Rename Chat
        await self.until("the title's editor", lambda: isinstance(QApplication.focusWidget(),
                                                                  QLineEdit)
                         and QApplication.focusWidget() is not w.sidebar.search, 10)
        await self.act(lambda: QApplication.focusWidget().selectAll())
        await self.type_here("Keyboard chat")
        await self.press(Qt.Key.Key_Return)
        await self.until("the new title", lambda: pane.session.title == "Keyboard chat", 10)
        await self.press(Qt.Key.Key_F, CTRL)  # Edit ▸ Find Chats
        await self.until("the search field", lambda: QApplication.focusWidget()
                         is w.sidebar.search, 10)
        await self.type_here("Keyboard")
        await self.press(Qt.Key.Key_Return)  # opens the first hit
        await self.until("the hit's chat", lambda: w.focused_pane is not None
                         and w.focused_pane.session.id == pane.session.id, 10)
        # Tab goes round every control of the window, each named for a screen reader
        await self.act(w.focused_pane.focus_input)
        start, seen = QApplication.focusWidget(), []
        for _ in range(80):
            await self.press(Qt.Key.Key_Tab)
            now = QApplication.focusWidget()
            if now is start:
                break
            seen.append(now)
        else:
            raise StepFailed("Tab never came back to the message box")
        unnamed = [f"{x.metaObject().className()} {x.objectName()}" for x in seen
                   if not (x.accessibleName() or getattr(x, "text", lambda: "")())]
        reached = {x.objectName() for x in seen}
        # (the sidebar shows the search's hits while the search is typed, else the chats)
        lists = {"conversationList", "searchResults"}
        for must in ("sendButton", "modelSelector", "messageList", "searchField"):
            if must not in reached:
                raise StepFailed(f"Tab never reaches {must}: {sorted(reached)}")
        if not reached & lists:
            raise StepFailed(f"Tab never reaches the sidebar's list: {sorted(reached)}")
        if unnamed:
            raise StepFailed(f"Tab reaches unnamed controls: {unnamed}")
        await self.press(Qt.Key.Key_Tab, shift)  # back: Shift+Tab
        await self.until("Shift+Tab back", lambda: QApplication.focusWidget() is seen[-1], 5)
        await self.press(Qt.Key.Key_M, CTRL | shift)  # View ▸ Show KV Monitor: off, on
        await self.until("the monitor to hide", lambda: not w.monitor_dock.isVisible(), 5)
        await self.press(Qt.Key.Key_M, CTRL | shift)
        await self.until("the monitor to show", w.monitor_dock.isVisible, 5)
        await self.press(Qt.Key.Key_1, CTRL)  # View ▸ Focus Pane 1
        await self.until("pane 1's box", lambda: QApplication.focusWidget()
                         is w.panes[0].input, 5)
        await self.shot("keyboard-only")

    async def relaunched(self) -> None:
        w = self.window
        state = json.loads((self.shots / "state.json").read_text())
        await self.until("the model", lambda: w.bridge.status == "ready")
        panes = [p.session.id for p in w.panes]
        if panes != state["panes"]:
            raise StepFailed(f"relaunch restored panes {panes}, not {state['panes']}")
        chats = sorted(c.id for c in w.store.list_conversations())
        if chats != state["chats"]:
            raise StepFailed("relaunch lost or added chats")
        await self.shot("relaunched")
        p = self.pane(0)
        await self.send(p, "Thank you!")
        await self.idle(p)
        await self.shot("relaunched-and-answered")
        await self.screen_reader_walk()
        await self.keyboard_only()
        await self.quit_soon()


def main() -> int:
    phase, shots, data = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    shots.mkdir(parents=True, exist_ok=True)
    QApplication.instance() or QApplication(sys.argv[:1])
    driver = Driver(phase, shots)
    result: dict[str, int] = {}

    def start() -> None:
        async def go() -> None:
            result["code"] = await driver.run()
            if result["code"]:
                QApplication.exit(result["code"])

        asyncio.ensure_future(go())

    QTimer.singleShot(0, start)
    from app.main import main as app_main

    code = app_main(["--data-dir", data, "--kv-memory-mib", "128", "--theme", "light"])
    return result.get("code", 1) or code  # 1 also when the driver never finished


if __name__ == "__main__":
    sys.exit(main())
