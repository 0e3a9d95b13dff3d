"""PagedChat inference engine: a paged KV pool shared by many chats (no Qt here)."""
