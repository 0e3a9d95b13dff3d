"""Secrets go only to a secure keychain; without one, to memory for this run, and Settings
says so. The environment is the one the app really meets here: keyrings.alt installed (so
keyring itself would pick PlaintextKeyring), no Secret Service, no test override."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import keyring
import keyring.core
import pytest
from keyring.backends import SecretService, chainer, fail, macOS, null
from PySide6.QtCore import Qt

from app.core import secrets
from app.core.app_settings import AppSettings

TOKEN = "hf_plaintext_canary_4242"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def app_alone(tmp_path, monkeypatch):
    """keyring as the app meets it: no backend chosen by the environment, nothing allowed
    for tests; HOME and the XDG folders are throw-away so any file written is seen."""
    for var in ("PYTHON_KEYRING_BACKEND", secrets.TEST_BACKEND_ENV):
        monkeypatch.delenv(var, raising=False)
    for var, sub in (("HOME", "home"), ("XDG_DATA_HOME", "data"), ("XDG_CONFIG_HOME", "cfg")):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setattr(secrets, "_memory", {})
    keyring.core.init_backend()
    yield tmp_path
    keyring.core.init_backend()


def _files_holding(root: Path, needle: str) -> list[Path]:
    encoded = (needle.encode(), base64.b64encode(needle.encode()))
    return [
        p for p in root.rglob("*")
        if p.is_file() and any(e in p.read_bytes() for e in encoded)
    ]


def test_without_a_keychain_the_token_stays_in_memory_and_settings_says_so(app_alone, qtbot):
    from app.settings.dialog import SettingsDialog

    assert type(keyring.get_keyring()).__module__.startswith("keyrings.alt")  # the trap
    dialog = SettingsDialog(AppSettings())
    qtbot.addWidget(dialog)
    dialog.show()
    assert dialog.token_note.text() == (
        "No system keychain: the token is kept in memory for this run only."
    )
    dialog.token_edit.setFocus()
    qtbot.keyClicks(dialog.token_edit, TOKEN)
    qtbot.keyClick(dialog.token_edit, Qt.Key.Key_Return)  # the user presses Enter: OK
    assert dialog.result() == dialog.DialogCode.Accepted and dialog.token_changed
    assert secrets.get_hf_token() == TOKEN  # usable for this run
    assert _files_holding(app_alone, TOKEN) == []  # and written nowhere
    assert not list(app_alone.rglob("keyring_pass.cfg"))
    again = SettingsDialog(AppSettings())
    qtbot.addWidget(again)
    assert again.token_edit.text() == TOKEN


def test_a_token_set_in_one_run_is_gone_in_the_next(app_alone):
    env = {
        k: v for k, v in os.environ.items()
        if k not in ("PYTHON_KEYRING_BACKEND", secrets.TEST_BACKEND_ENV)
    }
    code = (
        "import sys; from app.core import secrets; "
        "secrets.set_hf_token(sys.argv[1]) if len(sys.argv) > 1 else None; "
        "print(secrets.get_hf_token())"
    )
    first = subprocess.run(
        [sys.executable, "-c", code, TOKEN], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=120,
    )
    second = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )
    assert first.stdout.strip() == TOKEN and second.stdout.strip() == "None", (
        first.stderr + second.stderr
    )
    assert _files_holding(app_alone, TOKEN) == []


@pytest.mark.parametrize(
    "backend",
    [
        lambda: fail.Keyring(),
        lambda: chainer.ChainerBackend(),
        lambda: null.Keyring(),
    ],
    ids=["fail", "chainer-with-plaintext", "null"],
)
def test_insecure_or_failing_backends_are_refused(app_alone, backend):
    made = backend()
    if isinstance(made, chainer.ChainerBackend):
        assert any(type(b).__module__.startswith("keyrings.alt") for b in made.backends)
    keyring.set_keyring(made)
    assert secrets.secure_backend() is None
    secrets.set_hf_token(TOKEN)  # no exception, nothing written
    assert secrets.get_hf_token() == TOKEN
    assert _files_holding(app_alone, TOKEN) == []
    secrets.set_hf_token("")
    assert secrets.get_hf_token() is None


def test_real_keychains_are_accepted_by_class(app_alone):
    assert secrets._acceptable(macOS.Keyring()) == "macOS Keychain"
    assert secrets._acceptable(SecretService.Keyring()) == "Secret Service"


def test_the_tests_own_backend_is_accepted_only_when_named(app_alone, monkeypatch):
    from keyrings.alt.file import PlaintextKeyring

    keyring.set_keyring(PlaintextKeyring())
    assert secrets.secure_backend() is None
    monkeypatch.setenv(secrets.TEST_BACKEND_ENV, "keyrings.alt.file.PlaintextKeyring")
    assert secrets.secure_backend() == "PlaintextKeyring (tests only)"
