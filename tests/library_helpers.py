"""Chats with branches and alternatives for the library tests, and a comparison of two
chats that ignores ids (what an export/import round trip must keep)."""

from __future__ import annotations

from app.core.records import ChatSettings, Message, Status, new_id
from app.core.store import Store
from app.core.tree import MessageTree
from engine import SamplingParams

CODE = "```python\ndef add(a, b):\n    return a + b\n```"


def _msg(conv_id: str, parent: str | None, role: str, text: str, t: float, **kw) -> Message:
    return Message(new_id(), conv_id, parent, role, text, created=t, **kw)


def build_chat(store: Store, title: str = "Trees & <tags>") -> dict[str, str]:
    """A chat with an edited prompt (two root alternatives), three regenerated replies under
    the second prompt, a follow-up under the second reply, non-default settings and colour.
    Returns the ids by name."""
    settings = ChatSettings(
        system_prompt="Answer in verse.",
        sampling=SamplingParams(temperature=0.3, top_p=0.8, top_k=7, seed=11, stop=("END",)),
    )
    conv = store.create_conversation(title, settings)
    c = conv.id
    ids: dict[str, str] = {}
    q1 = _msg(c, None, "user", "first question", 100.0)
    q2 = _msg(c, None, "user", "edited question: show code", 101.5)
    a1 = _msg(c, q2.id, "assistant", "reply one", 102.0, status=Status.STOPPED)
    a2 = _msg(c, q2.id, "assistant", f"reply two\n\n{CODE}", 103.0, meta={"usage": {"n": 5}})
    a3 = _msg(c, q2.id, "assistant", "<script>alert(1)</script> reply three", 104.0)
    f1 = _msg(c, a2.id, "user", "Ελληνικά и кириллица 中文", 105.0)
    f2 = _msg(c, f1.id, "assistant", "answer to the follow-up", 106.0, status=Status.LENGTH)
    a0 = _msg(c, q1.id, "assistant", "old reply", 100.5)
    store.add_messages([q1, a0, q2, a1, a2, a3, f1, f2])
    # the user went back to the second reply: shown path q2 -> a2 -> f1 -> f2
    store.set_active_child(q2.id, a2.id)
    store.set_active_child(a2.id, f1.id)
    store.set_active_child(f1.id, f2.id)
    store.set_active_leaf(c, f2.id)
    store.set_value("unused", 0)
    store._write("UPDATE conversations SET color_index=5, updated=?, model=? WHERE id=?",
                 (200.25, "prov1:gpt-x", c))
    ids.update(conv=c, q1=q1.id, q2=q2.id, a1=a1.id, a2=a2.id, a3=a3.id, f1=f1.id, f2=f2.id)
    return ids


def canonical(store: Store, conversation_id: str) -> dict:
    """A chat with ids replaced by tree positions: what a round trip must keep."""
    conv = store.get_conversation(conversation_id)
    messages = store.load_messages(conversation_id)
    tree = MessageTree(messages, conv.active_leaf)

    def node(m: Message) -> dict:
        parent = tree.get(m.parent_id) if m.parent_id else None
        return {
            "role": m.role, "content": m.content, "status": m.status, "created": m.created,
            "meta": m.meta,
            "shown_by_parent": parent is not None and parent.active_child == m.id,
            "children": [node(k) for k in tree.children(m.id)],
        }

    return {
        "title": conv.title, "created": conv.created, "updated": conv.updated,
        "settings": conv.settings.to_dict(), "color_index": conv.color_index,
        "model": conv.model, "roots": [node(m) for m in tree.children(None)],
        "shown": [m.content for m in tree.active_path()],
    }
