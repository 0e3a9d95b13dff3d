"""Remote OpenAI-compatible providers (Qt-free): records, the registry, the streaming client."""

from app.core.providers.records import LOCAL, Provider, model_ref, split_ref
from app.core.providers.registry import KEEP, ProviderRegistry

__all__ = ["KEEP", "LOCAL", "Provider", "ProviderRegistry", "model_ref", "split_ref"]
