"""The user's providers, kept in the app database (names, addresses, model lists) with each
API key in the OS keychain only (app.core.secrets), so no file PagedChat writes holds a key."""

from __future__ import annotations

from typing import Any

from app.core import secrets
from app.core.providers.records import Provider, check_base_url, normalise_base_url, split_ref
from app.core.records import new_id

SETTINGS_KEY = "providers"
KEEP = object()  # update(): leave the stored key as it is


class ProviderRegistry:
    """Add, edit, remove and look up providers; listeners hear of every change."""

    def __init__(self, store: Any) -> None:
        self.store = store
        raw = store.get_value(SETTINGS_KEY) or []
        self._providers: dict[str, Provider] = {}
        for item in raw if isinstance(raw, list) else []:
            try:
                p = Provider.from_dict(item)
            except (KeyError, TypeError, AttributeError):
                continue  # a damaged entry is dropped, not a crash
            self._providers[p.id] = p
        self._listeners: list[Any] = []

    def add_listener(self, fn: Any) -> None:
        self._listeners.append(fn)

    def remove_listener(self, fn: Any) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def providers(self) -> list[Provider]:
        return list(self._providers.values())

    def get(self, provider_id: str) -> Provider | None:
        return self._providers.get(provider_id)

    def resolve(self, ref: str) -> tuple[Provider, str] | None:
        """The provider and model id a chat's model string names (None: local or unknown)."""
        parts = split_ref(ref)
        if parts is None:
            return None
        provider = self._providers.get(parts[0])
        return (provider, parts[1]) if provider is not None else None

    def label(self, ref: str, local_name: str = "Local") -> str:
        """A chat's model as the sidebar and the pane header show it."""
        parts = split_ref(ref)
        if parts is None:
            return local_name
        provider = self._providers.get(parts[0])
        return f"{parts[1]} @ {provider.name}" if provider else f"{parts[1]} (provider removed)"

    def key(self, provider: Provider) -> str | None:
        return secrets.get_secret(provider.key_user)

    def add(self, name: str, base_url: str, key: str | None = None) -> Provider:
        """A new provider; raises ValueError with a message for the user on bad input."""
        name, url = self._checked(name, base_url)
        provider = Provider(id=new_id(), name=name, base_url=url)
        if key:
            secrets.set_secret(provider.key_user, key)
        self._providers[provider.id] = provider
        self._save()
        return provider

    def update(self, provider_id: str, name: str, base_url: str, key: Any = KEEP) -> Provider:
        provider = self._providers[provider_id]
        name, url = self._checked(name, base_url)
        if url != provider.base_url:
            provider.models = []  # another server: its list must be fetched again
        provider.name, provider.base_url = name, url
        if key is not KEEP:
            secrets.set_secret(provider.key_user, key or "")
        self._save()
        return provider

    def set_models(self, provider_id: str, models: list[str]) -> None:
        if provider_id in self._providers:
            self._providers[provider_id].models = list(models)
            self._save()

    def remove(self, provider_id: str) -> None:
        provider = self._providers.pop(provider_id, None)
        if provider is not None:
            secrets.set_secret(provider.key_user, None)
            self._save()

    @staticmethod
    def _checked(name: str, base_url: str) -> tuple[str, str]:
        name = " ".join(name.split())
        if not name:
            raise ValueError("Give the provider a name.")
        problem = check_base_url(base_url)
        if problem:
            raise ValueError(problem)
        return name, normalise_base_url(base_url)

    def _save(self) -> None:
        self.store.set_value(SETTINGS_KEY, [p.to_dict() for p in self._providers.values()])
        for fn in list(self._listeners):
            fn()
