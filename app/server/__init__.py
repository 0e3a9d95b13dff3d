"""A local OpenAI-compatible HTTP server on PagedChat's own engine (no Qt on this path).

API requests are engine requests like a pane's: they join the same continuous batch, share
prefix blocks with the chats and show up in the KV monitor as sessions of their own.
"""

from app.server.routes import ServerOptions, create_app
from app.server.runner import ServerThread

__all__ = ["ServerOptions", "ServerThread", "create_app"]
