"""The server's bearer key: where it comes from, and a constant-time check of each request.

Priority: an explicit key (``--api-key``), then ``PAGEDCHAT_API_KEY`` (headless machines
without a keychain), then the OS keychain, where a fresh random key is stored on first run.
The key is never written to a settings file or the database of ours.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets

import keyring

log = logging.getLogger(__name__)

ENV_VAR = "PAGEDCHAT_API_KEY"
KEYCHAIN_SERVICE = "PagedChat"
KEYCHAIN_USER = "api-server-key"
KEY_PREFIX = "pc-"


class KeyUnavailable(RuntimeError):
    """No key could be found or stored; the message tells the user what to do."""


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def stored_key(create: bool = True) -> str | None:
    """The key kept in the OS keychain, generated and stored there on first use."""
    try:
        key = keyring.get_password(KEYCHAIN_SERVICE, KEYCHAIN_USER)
        if key or not create:
            return key or None
        key = generate_key()
        keyring.set_password(KEYCHAIN_SERVICE, KEYCHAIN_USER, key)
        log.info("generated a new API server key and stored it in the keychain")
        return key
    except Exception as exc:  # no backend on a headless machine, a locked keychain, ...
        raise KeyUnavailable(
            f"the OS keychain is not available ({exc}); give the server a key with "
            f"--api-key KEY or the {ENV_VAR} environment variable"
        ) from exc


def resolve_key(explicit: str | None = None) -> tuple[str, str]:
    """The key to require and where it came from ("--api-key", the variable, "keychain")."""
    if explicit is not None:
        if not explicit.strip():
            raise KeyUnavailable("--api-key must not be empty")
        return explicit.strip(), "--api-key"
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return env, ENV_VAR
    return stored_key(create=True), "keychain"


def bearer_matches(header: str | None, key: str) -> bool:
    """Whether an Authorization header carries ``key``; constant time in the key's content."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), key.encode())
