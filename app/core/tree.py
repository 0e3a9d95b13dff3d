"""The message tree of one conversation: alternatives, branches and the active path.

Nothing is ever deleted by regenerate or edit: a regenerated reply is a new sibling of the old
one, an edited prompt is a new sibling of the old prompt. The visible conversation is the path
from a root to the active leaf; every node remembers its active child, so switching an
alternative high up restores whatever was last shown below it. Pure logic, no Qt or SQL.
"""

from __future__ import annotations

from collections.abc import Iterable

from app.core.records import Message


class MessageTree:
    def __init__(self, messages: Iterable[Message] = (), active_leaf: str | None = None) -> None:
        self.by_id: dict[str, Message] = {}
        self._children: dict[str | None, list[str]] = {}
        for m in messages:
            self.add(m)
        self.active_leaf: str | None = None
        if active_leaf in self.by_id:
            self.active_leaf = active_leaf
        elif self.by_id:
            # No (or a dangling) remembered leaf: follow the latest roots/children.
            self.active_leaf = self.descend(self._children.get(None, [None])[-1])

    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, message_id: object) -> bool:
        return message_id in self.by_id

    def get(self, message_id: str) -> Message:
        return self.by_id[message_id]

    def add(self, message: Message) -> None:
        """Insert a node (its parent, if any, must already be in the tree)."""
        self.by_id[message.id] = message
        self._children.setdefault(message.parent_id, []).append(message.id)

    def children(self, parent_id: str | None) -> list[Message]:
        return [self.by_id[i] for i in self._children.get(parent_id, [])]

    def siblings(self, message_id: str) -> list[Message]:
        """The alternatives at this message's position, itself included, oldest first."""
        return self.children(self.by_id[message_id].parent_id)

    def sibling_position(self, message_id: str) -> tuple[int, int]:
        """(0-based index among its siblings, number of siblings)."""
        sib = self._children.get(self.by_id[message_id].parent_id, [])
        return sib.index(message_id), len(sib)

    def path_to(self, message_id: str | None) -> list[Message]:
        """Root..message, inclusive."""
        out: list[Message] = []
        seen: set[str] = set()
        while message_id is not None and message_id in self.by_id and message_id not in seen:
            seen.add(message_id)
            m = self.by_id[message_id]
            out.append(m)
            message_id = m.parent_id
        out.reverse()
        return out

    def active_path(self) -> list[Message]:
        return self.path_to(self.active_leaf)

    def descend(self, message_id: str | None) -> str | None:
        """The leaf reached from a node by following remembered (else latest) children."""
        seen: set[str] = set()
        while message_id is not None and message_id not in seen:
            seen.add(message_id)
            kids = self._children.get(message_id)
            if not kids:
                return message_id
            remembered = self.by_id[message_id].active_child
            message_id = remembered if remembered in kids else kids[-1]
        return message_id

    def activate(self, message_id: str) -> list[tuple[str, str]]:
        """Show the branch through `message_id`; returns the (parent, child) choices it made.

        The caller persists the returned pairs (active_child of each parent on the path).
        """
        self.active_leaf = self.descend(message_id)
        changed = []
        for m in self.path_to(self.active_leaf):
            if m.parent_id is not None:
                parent = self.by_id[m.parent_id]
                if parent.active_child != m.id:
                    parent.active_child = m.id
                    changed.append((parent.id, m.id))
        return changed

    def switch(self, message_id: str, delta: int) -> tuple[str | None, list[tuple[str, str]]]:
        """Move to the previous/next alternative of a message; returns (new sibling, choices)."""
        sib = self._children.get(self.by_id[message_id].parent_id, [])
        i = sib.index(message_id) + delta
        if not 0 <= i < len(sib):
            return None, []
        return sib[i], self.activate(sib[i])
