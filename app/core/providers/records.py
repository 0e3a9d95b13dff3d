"""What a provider is, and how a chat names its model (no Qt, no HTTP).

A chat's model is one string kept in its database row: "" for the local engine's model, or
"<provider id>:<model id>" for a model of a remote OpenAI-compatible provider. The provider
id is ours (hex, no colon), so the model id after the first colon may hold anything a server
names its models with ("org/name:tag").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlparse

LOCAL = ""  # the chat talks to the app's own engine


@dataclass
class Provider:
    """An OpenAI-compatible endpoint. Its API key is never a field: it lives in the keychain
    (app.core.secrets) under `key_user`."""

    id: str
    name: str
    base_url: str
    models: list[str] = field(default_factory=list)  # the last list fetched from /v1/models
    timeout_s: float = 60.0  # no byte from the server for this long: the request failed

    @property
    def key_user(self) -> str:
        return f"provider-key:{self.id}"

    def to_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "base_url": self.base_url,
                "models": list(self.models), "timeout_s": self.timeout_s}

    @classmethod
    def from_dict(cls, data: dict) -> Provider:
        models = data.get("models") or []
        return cls(id=str(data["id"]), name=str(data.get("name") or "Provider"),
                   base_url=str(data.get("base_url") or ""),
                   models=[str(m) for m in models if isinstance(m, str | int)],
                timeout_s=float(data.get("timeout_s") or 60.0))


def model_ref(provider_id: str, model: str) -> str:
    return f"{provider_id}:{model}"


def split_ref(ref: str) -> tuple[str, str] | None:
    """(provider id, model id) of a remote chat's model, or None for the local engine."""
    if not ref or ":" not in ref:
        return None
    provider_id, model = ref.split(":", 1)
    return (provider_id, model) if provider_id and model else None


def normalise_base_url(url: str) -> str:
    """The base URL the client is given: ".../v1" without a trailing slash.

    Users paste "http://host:8000", "http://host:8000/" or "http://host:8000/v1/": all mean
    the same server; the OpenAI client wants the one ending in /v1.
    """
    url = url.strip().rstrip("/")
    if url and not url.endswith("/v1"):
        url += "/v1"
    return url


def check_base_url(url: str) -> str | None:
    """Why `url` cannot be a provider's address, or None when it can."""
    parsed = urlparse(url.strip())
    if parsed.scheme not in ("http", "https"):
        return "The address must start with http:// or https://."
    if not parsed.hostname:
        return "The address has no host name."
    try:
        parsed.port  # noqa: B018 - raises on a bad port
    except ValueError:
        return "The address has an invalid port."
    return None
