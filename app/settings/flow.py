"""App settings, from the Settings dialog to what runs: saved, applied, the engine restarted.

One flow with one owner: the dialog returns a value; a valid one is saved, its theme and its
defaults for new chats applied, and the engine restarted only when the model, the pool or
the Hugging Face token it loads with changed (open chats survive a restart: they are
interrupted, not closed). The engine's status shown in the banner and the model button is
here too, since a settings change is what moves it. Kept out of the main window, which only
lays out the widgets this flow talks to.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Protocol

from PySide6.QtWidgets import QDialog, QMessageBox

from app.core import secrets
from app.core.app_settings import AppSettings
from app.core.generation_defaults import model_defaults
from app.core.records import ChatSettings
from app.settings.dialog import SettingsDialog
from app.settings.models_window import ModelsWindow
from app.ui.theme import theme_manager
from engine import SamplingParams, cache_dir


class SettingsWindow(Protocol):
    """What the flow needs of the main window (a QWidget: the dialogs' parent). Named here,
    not imported: the window stands a layer above."""

    settings: AppSettings
    store: Any
    registry: Any
    manager: Any  # app.chat.session.SessionManager
    bridge: Any  # app.bridges.engine_bridge.EngineBridge
    banner: Any  # app.window.banners.EngineBanner
    model_button: Any  # app.window.banners.ModelButton
    theme_actions: dict[str, Any]  # theme -> its checkable QAction
    models_window: Any  # app.settings.models_window.ModelsWindow, made on first use


class SettingsFlow:
    def __init__(self, window: SettingsWindow) -> None:
        self.window = window

    def open(self, tab: str | None = None) -> None:
        """Show the Settings dialog (on the Providers tab for ``tab="providers"``)."""
        w = self.window
        bridge = getattr(w, "bridge", None)
        snapshot = getattr(bridge, "latest_snapshot", None)
        engine = getattr(bridge, "engine", None)
        dialog = SettingsDialog(w.settings, w, registry=w.registry,
                                tools=getattr(w, "tools", None),
                                new_chat_defaults=self.new_chat_sampling(),
                                model_info=getattr(bridge, "model_info", None),
                                disk_stats=getattr(snapshot, "disk", None),
                                clear_disk=getattr(engine, "clear_disk_cache", None))
        if tab == "providers" and dialog.providers_page is not None:
            dialog.tabs.setCurrentWidget(dialog.providers_page)
        if tab == "tools" and dialog.tools_page is not None:
            dialog.tabs.setCurrentWidget(dialog.tools_page)
        if dialog.exec() == QDialog.DialogCode.Accepted:
            self.apply(dialog.value(), token_changed=dialog.token_changed)

    def open_models(self) -> None:
        """The Models window (one per main window; a download goes on while it is hidden)."""
        w = self.window
        if w.models_window is None:
            w.models_window = ModelsWindow(
                w.store, cache_dir() / "downloads", self.switch_model,
                lambda: w.settings.model_spec(), secrets.get_hf_token, w,
                loaded_info=lambda: w.bridge.model_info)
        w.models_window.refresh()
        w.models_window.show()
        w.models_window.raise_()
        w.models_window.activateWindow()

    def switch_model(self, spec: str) -> bool:
        """Load another model by the settings path: the engine restarts, chats stay."""
        new = dataclasses.replace(self.window.settings)
        new.set_model_spec(spec)
        return self.apply(new)

    def apply(self, new: AppSettings, token_changed: bool = False) -> bool:
        """Save settings; restart the engine if the model or pool changed. False if invalid."""
        w = self.window
        problem = new.validate()
        if problem:
            QMessageBox.warning(w, "Settings", problem)
            return False
        old_key = w.settings.engine_key()
        w.settings = new
        new.save(w.store)
        self.apply_default_chat_settings()
        theme_manager().apply(new.theme)
        w.theme_actions[new.theme].setChecked(True)
        if new.engine_key() != old_key or (token_changed and new.model_kind == "hf"):
            self.restart_engine()
        return True

    def new_chat_sampling(self) -> tuple[SamplingParams, str]:
        """(what new chats sample with, where it comes from): the user's defaults from
        Settings, else the loaded model's (SamplingParams() stored means "never changed").
        Both settings dialogs show this one value (they disagreed, issue 25)."""
        w = self.window
        sampling = w.settings.default_sampling
        if sampling != SamplingParams():
            return sampling, "your defaults (Settings)"
        info = w.bridge.model_info
        return model_defaults(getattr(info, "path", "") if info else "")

    def apply_default_chat_settings(self, *_args: object) -> None:
        """New chats sample as the user set in Settings, else as the loaded model asks."""
        w = self.window
        sampling, source = self.new_chat_sampling()
        manager = w.manager
        previous = manager.default_settings.sampling
        manager.default_settings = ChatSettings(
            system_prompt=w.settings.default_system_prompt, sampling=sampling
        )
        manager.default_source = source
        for session in manager.sessions.values():  # empty chats made before the model
            if not session.tree.by_id and session.settings.sampling == previous != sampling:
                session.set_settings(dataclasses.replace(session.settings, sampling=sampling))

    def set_theme(self, theme: str) -> None:
        """Apply and save a theme (alone: not this run's --model/--kv overrides)."""
        w = self.window
        w.settings.theme = theme
        saved = AppSettings.load(w.store)
        saved.theme = theme
        saved.save(w.store)
        theme_manager().apply(theme)
        w.theme_actions[theme].setChecked(True)

    def restart_engine(self) -> None:
        """Stop the engine and start one for the current settings; chats stay open."""
        w = self.window
        w.manager.interrupt_all()
        secrets.export_hf_token()
        try:
            config = w.settings.engine_config()
        except ValueError as exc:
            w.banner.show_error(str(exc))
            return
        w.banner.show_loading(w.settings.model_label())
        asyncio.ensure_future(w.bridge.restart(config))

    def show_status(self, status: str) -> None:
        """The engine's status in the banner and on the model button."""
        w = self.window
        name = w.settings.model_label()
        w.banner.show_status(status, name, w.bridge.load_error)
        w.model_button.show_status(status, name, w.bridge.model_info)
