"""Secrets (the Hugging Face token) live only in the OS keychain, through `keyring`.

Never in the settings database or a plain file of ours: other chat apps were criticised for
exactly that. On macOS this is the login Keychain; tests pick keyrings.alt's file backend with
PYTHON_KEYRING_BACKEND. A missing or broken backend degrades to "no token" plus a message,
never a crash.
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


class SecretStoreError(RuntimeError):
    """The keychain could not be used; the message says why, for the user."""


def get_hf_token() -> str | None:
    """The stored Hugging Face token, or None (also when no keychain is available)."""
    try:
        return keyring.get_password(SERVICE, HF_TOKEN_USER) or None
    except Exception as exc:  # no backend, locked keychain, ...
        log.warning("keychain unavailable: %s", exc)
        return None


def set_hf_token(token: str | None) -> None:
    """Store (or, for an empty token, delete) the Hugging Face token in the keychain."""
    token = (token or "").strip()
    try:
        if token:
            keyring.set_password(SERVICE, HF_TOKEN_USER, token)
        else:
            with contextlib.suppress(PasswordDeleteError):  # nothing stored: already gone
                keyring.delete_password(SERVICE, HF_TOKEN_USER)
    except (KeyringError, RuntimeError, OSError) as exc:
        raise SecretStoreError(f"Could not use the system keychain: {exc}") from exc


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
