"""The main window's commands as data: one row per action (text, shortcut, icon, slot, menu
place, toolbar place), turned into QActions, menus and the toolbar by `build_actions`.

Adding a command is adding a row; where it shows (menu, group, toolbar) is read off the table
rather than spread over imperative calls, as napari's `qactions` do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import QEvent, Qt
from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import QApplication, QMainWindow, QMenu, QSizePolicy, QToolBar, QWidget

from app.ui import icons
from app.window.pane_deck import MAX_PANES

Key = QKeySequence.StandardKey | str

THEMES = (("system", "&System"), ("light", "&Light"), ("dark", "&Dark"))


@dataclass(frozen=True)
class ActionSpec:
    """One command. `slot` names a window method ("focused_pane.stop": a method of what a
    window attribute holds when triggered; nothing happens while it is None), called with
    `args` and `kwargs`, never with the checked flag.

    `shortcut`: the first key sequence this platform has. `menu`: a menu path ("&View/&Theme")
    and a group number (a separator between groups). `adopt`: a window method, by the same kind
    of path, returning an existing QAction to dress (a dock's toggle) instead of a new one.
    `exclusive`: the name of the action group of radio-like choices.
    """

    key: str
    text: str
    slot: str | None = None
    args: tuple[Any, ...] = ()
    shortcut: Sequence[Key] = ()
    icon: str | None = None
    tip: str | None = None
    menu: tuple[str, int] | None = None
    icon_text: str | None = None  # the label beside the icon on the toolbar
    checkable: bool = False
    checked: bool = False
    role: QAction.MenuRole | None = None
    adopt: str | None = None
    exclusive: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


SK = QKeySequence.StandardKey
Role = QAction.MenuRole

ACTIONS: tuple[ActionSpec, ...] = (
    ActionSpec("new_chat", "&New Chat", "new_chat", shortcut=(SK.New,), icon="new-chat",
               tip="New chat (in the focused pane)", menu=("&File", 0), icon_text="New Chat"),
    ActionSpec("new_pane", "New &Pane", "new_chat", kwargs={"new_pane": True},
               shortcut=("Ctrl+Shift+N",), icon="split", tip="Split: a new chat in a new pane",
               menu=("&File", 0), icon_text="Split"),
    ActionSpec("new_incognito", "New &Incognito Chat", "new_incognito_chat",
               shortcut=("Ctrl+Shift+Y",),
               tip="A chat kept nowhere: not saved, its memory never shared or written to disk",
               menu=("&File", 0)),
    ActionSpec("close_pane", "&Close Pane", "close_focused_pane", shortcut=(SK.Close,),
               menu=("&File", 1)),
    ActionSpec("export_chat", "&Export Chat…", "library_flow.export_focused_chat",
               shortcut=("Ctrl+Shift+E",),
               tip="Save the focused chat as Markdown, HTML or JSON", menu=("&File", 2)),
    ActionSpec("export_all", "Export &All Chats…", "library_flow.export_all_chats",
               tip="Save every chat, one file each, into a zip or a folder", menu=("&File", 2)),
    ActionSpec("import_chats", "&Import Chats…", "library_flow.import_chats",
               shortcut=("Ctrl+Shift+I",),
               tip="Add the chats of a PagedChat JSON export (or a zip of them)",
               menu=("&File", 2)),
    ActionSpec("run_batch", "Run &Batch…", "batch_panel.run_batch",
               tip="Run an OpenAI batch file (JSONL) on this model, in the background",
               menu=("&File", 2)),
    ActionSpec("quit", "&Quit PagedChat", "quit", shortcut=(SK.Quit,), menu=("&File", 3),
               role=Role.QuitRole),
    ActionSpec("find", "&Find Chats", "focus_search", shortcut=(SK.Find,), menu=("&Edit", 0)),
    ActionSpec("rename", "&Rename Chat…", "rename_focused_chat", shortcut=("F2",),
               menu=("&Edit", 0)),
    ActionSpec("delete", "&Delete Chat…", "delete_focused_chat", menu=("&Edit", 0)),
    ActionSpec("models", "&Models…", "settings_flow.open_models", shortcut=("Ctrl+Shift+L",),
               icon="models", tip="Installed models: load, remove, download", menu=("&Edit", 1),
               icon_text="Models"),
    ActionSpec("settings", "&Settings…", "settings_flow.open", shortcut=(SK.Preferences, "Ctrl+,"),
               icon="settings", menu=("&Edit", 1), icon_text="Settings",
               role=Role.PreferencesRole),
    ActionSpec("providers", "&Providers…", "settings_flow.open", kwargs={"tab": "providers"},
               tip="Remote OpenAI-compatible servers a chat can talk to", menu=("&Edit", 1)),
    ActionSpec("send_all", "Send to &All Panes", "toggle_compare",
               shortcut=("Ctrl+Shift+Return",), icon="send-all",
               tip="Send one message to every open pane", menu=("&Chat", 0),
               icon_text="Send to All", checkable=True),
    ActionSpec("stop", "S&top", "focused_pane.stop", shortcut=("Ctrl+.",), menu=("&Chat", 0)),
    ActionSpec("stop_all", "Stop &All", "stop_all", shortcut=("Ctrl+Shift+.",),
               menu=("&Chat", 0)),
    ActionSpec("regen", "&Regenerate", "focused_pane.regenerate", args=(None, 1),
               shortcut=("Ctrl+R",), menu=("&Chat", 1)),
    ActionSpec("regen3", "Regenerate &3 Alternatives", "focused_pane.regenerate", args=(None, 3),
               shortcut=("Ctrl+Shift+R",), menu=("&Chat", 1)),
    ActionSpec("branch", "&Branch From Last Message", "branch_focused",
               shortcut=("Ctrl+Shift+B",), menu=("&Chat", 1)),
    ActionSpec("chat_settings", "Chat &Settings…", "focused_pane.open_settings",
               shortcut=("Ctrl+Shift+,",), menu=("&Chat", 2)),
    *(
        ActionSpec(f"focus_{i}", f"Focus Pane &{i + 1}", "focus_pane", args=(i,),
                   shortcut=(f"Ctrl+{i + 1}",), menu=("&View", 0))
        for i in range(MAX_PANES)
    ),
    ActionSpec("sidebar", "Show &Sidebar", "toggle_sidebar", shortcut=("Ctrl+Shift+S",),
               menu=("&View", 1), checkable=True, checked=True),
    ActionSpec("monitor", "Show &KV Monitor", adopt="monitor_dock.toggleViewAction",
               shortcut=("Ctrl+Shift+M",), icon="monitor", menu=("&View", 1),
               icon_text="Monitor"),
    *(
        ActionSpec(f"theme_{value}", label, "settings_flow.set_theme", args=(value,),
                   menu=("&View/&Theme", 0), checkable=True, exclusive="theme")
        for value, label in THEMES
    ),
    ActionSpec("shortcuts", "&Keyboard Shortcuts", "show_shortcuts", shortcut=("Ctrl+/",),
               tip="Every keyboard shortcut, by menu", menu=("&Help", 0)),
    ActionSpec("about", "&About PagedChat", "about", menu=("&Help", 0), role=Role.AboutRole),
)

# Keys that belong to a widget rather than to a window command (so they are no QAction):
# listed in Help ▸ Keyboard Shortcuts after the commands. (where, what, keys)
KEYS_IN_PLACE: tuple[tuple[str, str, str], ...] = (
    ("Message box", "Send", "Enter"),
    ("Message box", "New line", "Shift+Enter"),
    ("Message box", "Stop the reply, or cancel an edit", "Esc"),
    ("Everywhere", "Next / previous control", "Tab / Shift+Tab"),
    ("Chat list", "Open the chat / rename it", "Enter / F2"),
    ("Search", "Open the first hit / move into the hits / clear", "Enter / Down / Esc"),
    ("KV monitor", "Zoom the block map", "Ctrl+wheel, + / −"),
)

# The toolbar after the model button, left to right; None is the stretch between the sides.
TOOLBAR: tuple[str | None, ...] = ("new_chat", "new_pane", "send_all", None, "models", "monitor",
                                   "settings")


def _shortcut(keys: Sequence[Key]) -> QKeySequence | None:
    for key in keys:
        seq = QKeySequence(key)
        if not seq.isEmpty():
            return seq
    return None


def _method(window: QMainWindow, path: str) -> Callable[..., Any] | None:
    """The method a dotted path names, looked up now (None while a step on the way is None)."""
    *steps, name = path.split(".")
    target: Any = window
    for attr in steps:
        target = getattr(target, attr)
        if target is None:
            return None
    return getattr(target, name)


def _slot(window: QMainWindow, spec: ActionSpec) -> Callable[..., None]:
    def run(_checked: bool = False) -> None:
        method = _method(window, spec.slot or "")  # when triggered: the focused pane changes
        if method is not None:
            method(*spec.args, **spec.kwargs)

    return run


def build_actions(window: QMainWindow, specs: Sequence[ActionSpec] = ACTIONS) -> dict[str, QAction]:
    """The QActions of `specs`, each added to the window (its shortcut works with the menu bar
    hidden) and to its menu, by key; also set as `window.act_<key>`."""
    actions: dict[str, QAction] = {}
    groups: dict[str, QActionGroup] = {}
    for spec in specs:
        a = _method(window, spec.adopt)() if spec.adopt else QAction(spec.text, window)
        a.setText(spec.text)
        seq = _shortcut(spec.shortcut)
        if seq is not None:
            a.setShortcut(seq)
        if spec.icon:
            a.setIcon(icons.icon(spec.icon))
            a.setProperty("icon_name", spec.icon)  # re-coloured on a theme change
        if not spec.adopt:
            a.setToolTip(spec.tip or spec.text.replace("&", "").rstrip("…"))
            a.setCheckable(spec.checkable)
            a.setChecked(spec.checked)
            a.triggered.connect(_slot(window, spec))
            window.addAction(a)
        if spec.role is not None:
            a.setMenuRole(spec.role)
        if spec.exclusive:
            groups.setdefault(spec.exclusive, QActionGroup(window)).addAction(a)
        if spec.icon_text:
            a.setIconText(spec.icon_text)
        actions[spec.key] = a
        setattr(window, f"act_{spec.key}", a)
    _build_menus(window, specs, actions)
    return actions


def _build_menus(window: QMainWindow, specs: Sequence[ActionSpec], actions: dict[str, QAction]):
    menus: dict[str, QMenu] = {}
    last_group: dict[str, int] = {}
    for spec in specs:
        if spec.menu is None:
            continue
        path, group = spec.menu
        menu = _menu(window, menus, path)
        if path in last_group and last_group[path] != group:
            menu.addSeparator()
        last_group[path] = group
        menu.addAction(actions[spec.key])


def _menu(window: QMainWindow, menus: dict[str, QMenu], path: str) -> QMenu:
    if path not in menus:
        parent, _, name = path.rpartition("/")
        menus[path] = (_menu(window, menus, parent) if parent else window.menuBar()).addMenu(name)
    return menus[path]


def shortcut_rows(actions: dict[str, QAction],
                  specs: Sequence[ActionSpec] = ACTIONS) -> list[tuple[str, str, str]]:
    """(menu, command, keys) for every action that has keys, in menu order, with the keys
    the action really has now (as this platform writes them); then KEYS_IN_PLACE."""
    rows = []
    for spec in specs:
        a = actions[spec.key]
        keys = ", ".join(s.toString(QKeySequence.SequenceFormat.NativeText)
                         for s in a.shortcuts())
        if not keys:
            continue
        menu = (spec.menu[0] if spec.menu else "Window").replace("&", "").replace("/", " ▸ ")
        rows.append((menu, a.text().replace("&", ""), keys))
    return rows + [(f"In place: {where}", what, keys) for where, what, keys in KEYS_IN_PLACE]


def refresh_icons(actions: dict[str, QAction]) -> None:
    """Draw the actions' icons again in the theme's colours."""
    for a in actions.values():
        name = a.property("icon_name")
        if name:
            a.setIcon(icons.icon(name))


def build_toolbar(window: QMainWindow, actions: dict[str, QAction], lead: QWidget) -> QToolBar:
    """The window's toolbar: `lead` (the model button), then the TOOLBAR actions; screen
    readers get each button's icon text as its name."""
    tb = QToolBar("Toolbar", window)
    tb.setObjectName("mainToolbar")
    tb.setAccessibleName("Toolbar")
    tb.setMovable(False)
    tb.setIconSize(icons.icon_size(18))
    tb.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
    tb.addWidget(lead)
    tb.addSeparator()
    for key in TOOLBAR:
        if key is None:
            spacer = QWidget()
            spacer.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
            tb.addWidget(spacer)
            continue
        tb.addAction(actions[key])
        w = tb.widgetForAction(actions[key])
        if w is not None:
            w.setAccessibleName(actions[key].iconText())
    window.addToolBar(Qt.ToolBarArea.TopToolBarArea, tb)
    # QToolBar takes its margins from the style while it is made, before it has the name the
    # stylesheet's padding is keyed on (and the style caches the rules it matched then); the
    # first theme switch recomputed them and everything below the toolbar moved down 12 px.
    # Match the rules again under the name and recompute the margins, as a style change does.
    tb.style().unpolish(tb)
    tb.style().polish(tb)
    QApplication.sendEvent(tb, QEvent(QEvent.Type.StyleChange))
    return tb
