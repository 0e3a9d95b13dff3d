"""The KV-block memory monitor."""
