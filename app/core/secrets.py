"""Secrets (the Hugging Face token) live only in a secure OS keychain, or only in memory.

`keyring` picks whatever backend ranks highest, and with `keyrings.alt` installed that was
PlaintextKeyring: the token went base64-encoded into a file while Settings claimed "system
keychain". So the backend is checked against a list of real keychains (macOS Keychain,
Secret Service, KWallet, Windows Credential Locker); anything else (keyrings.alt's files,
keyring's "fail" and "null" backends, a chainer that includes one of them) is refused, and
the token is then kept in this process's memory for this run only, which Settings says.
Tests need a keychain that works headless: they name keyrings.alt's file backend in
`PAGEDCHAT_TEST_KEYRING` (tests/conftest.py); the app itself never sets that variable.
"""

from __future__ import annotations

import contextlib
import logging
import os

import keyring
from keyring.errors import KeyringError, PasswordDeleteError

log = logging.getLogger(__name__)

SERVICE = "PagedChat"
HF_TOKEN_USER = "huggingface-token"
TEST_BACKEND_ENV = "PAGEDCHAT_TEST_KEYRING"  # tests only: one extra backend class they accept

# Backends that keep secrets encrypted by the OS, by class (module.qualname): their names.
SECURE_BACKENDS = {
    "keyring.backends.macOS.Keyring": "macOS Keychain",
    "keyring.backends.SecretService.Keyring": "Secret Service",
    "keyring.backends.libsecret.Keyring": "Secret Service",
    "keyring.backends.kwallet.DBusKeyring": "KWallet",
    "keyring.backends.kwallet.DBusKeyringKWallet4": "KWallet",
    "keyring.backends.Windows.WinVaultKeyring": "Windows Credential Locker",
}
TESTS_ONLY = " (tests only)"  # ends the name of the backend TEST_BACKEND_ENV names
MEMORY_NOTE = "No system keychain: the token is kept in memory for this run only."

_memory: dict[str, str] = {}  # where secrets go when there is no secure backend


class SecretStoreError(RuntimeError):
    """The keychain could not be used; the message says why, for the user."""


def _qualname(backend: object) -> str:
    cls = type(backend)
    return f"{cls.__module__}.{cls.__qualname__}"


def _acceptable(backend: object) -> str | None:
    """The display name of `backend` if secrets may be written to it, else None."""
    name = _qualname(backend)
    if name in SECURE_BACKENDS:
        return SECURE_BACKENDS[name]
    allowed_for_tests = os.environ.get(TEST_BACKEND_ENV, "")
    if allowed_for_tests and name == allowed_for_tests:
        return f"{type(backend).__name__}{TESTS_ONLY}"
    if name == "keyring.backends.chainer.ChainerBackend":
        inner = list(getattr(backend, "backends", []))
        names = [_acceptable(b) for b in inner]
        if inner and all(names):
            return ", ".join(dict.fromkeys(n for n in names if n))
    return None


def secure_backend() -> str | None:
    """The name of the secure keychain in use, or None when there is none."""
    try:
        return _acceptable(keyring.get_keyring())
    except Exception as exc:  # a broken keyring configuration
        log.warning("keychain unavailable: %s", exc)
        return None


def storage_note() -> str:
    """What Settings tells the user about where the token is kept (the truth)."""
    name = secure_backend()
    if name is None:
        return MEMORY_NOTE
    if name.endswith(TESTS_ONLY):  # keyrings.alt's file: say so, never "system keychain"
        return (f"Stored by {name.removesuffix(TESTS_ONLY)}, a backend allowed for tests "
                "only: not in a system keychain.")
    return f"Stored only in the system keychain ({name})."


def get_hf_token() -> str | None:
    """The stored Hugging Face token, or None."""
    if secure_backend() is None:
        return _memory.get(HF_TOKEN_USER) or None
    try:
        return keyring.get_password(SERVICE, HF_TOKEN_USER) or None
    except Exception as exc:  # locked keychain, ...
        log.warning("keychain unavailable: %s", exc)
        return None


def set_hf_token(token: str | None) -> None:
    """Store (or, for an empty token, delete) the Hugging Face token."""
    token = (token or "").strip()
    if secure_backend() is None:
        if token:
            _memory[HF_TOKEN_USER] = token
        else:
            _memory.pop(HF_TOKEN_USER, None)
        return
    try:
        if token:
            keyring.set_password(SERVICE, HF_TOKEN_USER, token)
        else:
            with contextlib.suppress(PasswordDeleteError):  # nothing stored: already gone
                keyring.delete_password(SERVICE, HF_TOKEN_USER)
    except (KeyringError, RuntimeError, OSError) as exc:
        raise SecretStoreError(f"Could not use the system keychain: {exc}") from exc


def get_secret(user: str) -> str | None:
    """Any secret kept under `user` (a provider's API key, ...), from the same place as the
    token: the secure keychain, else this run's memory."""
    if secure_backend() is None:
        return _memory.get(user) or None
    try:
        return keyring.get_password(SERVICE, user) or None
    except Exception as exc:  # locked keychain, ...
        log.warning("keychain unavailable: %s", type(exc).__name__)
        return None


def set_secret(user: str, value: str | None) -> None:
    """Store (or, for an empty value, delete) the secret kept under `user`."""
    value = (value or "").strip()
    if secure_backend() is None:
        if value:
            _memory[user] = value
        else:
            _memory.pop(user, None)
        return
    try:
        if value:
            keyring.set_password(SERVICE, user, value)
        else:
            with contextlib.suppress(PasswordDeleteError):
                keyring.delete_password(SERVICE, user)
    except (KeyringError, RuntimeError, OSError) as exc:
        raise SecretStoreError(f"Could not use the system keychain: {type(exc).__name__}") from exc


def export_hf_token() -> None:
    """Make the stored token visible to huggingface_hub (in this process only)."""
    token = get_hf_token()
    if token:
        os.environ["HF_TOKEN"] = token


def backend_name() -> str:
    try:
        return type(keyring.get_keyring()).__name__
    except Exception:
        return "none"
