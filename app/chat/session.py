"""One conversation's behaviour: send, stream, stop, regenerate, edit, switch alternatives.

A ChatSession lives as long as its chat is open *or* still generating, independently of any
pane: a chat keeps streaming while the user works elsewhere, and a pane is just a view on it.
The session owns the conversation's MessageTree, writes every change to the Store, and saves
a reply being streamed about once a second (`SAVE_INTERVAL_MS`), so a killed app loses at most
about a second of text. Engine events arrive from the EngineBridge through the SessionManager,
which routes them by session id and drops any event whose request this chat did not make.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

from app.core.attachments import Attachment, from_meta, to_meta
from app.core.mcp import McpError, McpTool
from app.core.records import ChatSettings, Conversation, Message, Status, new_id
from app.core.session_logic import (
    DEFAULT_TITLE,
    branch_copies,
    copy_settings,
    prompt_messages,
    prompt_with_calls,
    reply_params,
    status_for,
    title_from,
    unique_title,
    usage_dict,
)
from app.core.tool_calls import CallSplitter, ToolUse, call_constraint, chat_prompt
from app.core.tree import MessageTree
from app.ui import colors

SAVE_INTERVAL_MS = 1000
#: meta["refused"] of a reply whose prompt the model refused as longer than its context
REFUSED_TOO_LONG = "context"
#: a key of ChatSession._requests while the chat works on tools (preparing a prompt with
#: tools, asking the user about a call, running it): the chat is busy, no engine request
TOOL_WORK = "tool:"
MAX_TOOL_ROUNDS = 4  # calls in a row after one user message; then the model must answer
DENIED = "The user denied this tool call."
STOPPED_CALL = "The user stopped this tool call."


class ChatSession(QObject):
    """The live state and actions of one conversation."""

    pathChanged = Signal()  # the visible path (rows) changed
    messageChanged = Signal(str)  # a message's text grew (streaming): re-render is throttled
    messageFinished = Signal(str)  # a message reached a final status
    busyChanged = Signal(bool)
    titleChanged = Signal(str)
    settingsChanged = Signal()
    contextChanged = Signal()  # context_tokens or last_usage changed
    notice = Signal(str)  # a message for the user (refused input, engine errors)
    modelChanged = Signal(str)  # the chat's model ("" = the local engine)
    toolAsk = Signal(str)  # the tool message waiting for Allow / Deny ("": none any more)

    def __init__(self, conversation: Conversation, store: Any, bridge: Any) -> None:
        super().__init__()
        self.manager: Any = None  # the SessionManager that made it (new-chat defaults)
        #: An incognito chat (app/chat/incognito.py): kept nowhere, its KV never shared nor
        #: written to disk, zeroed when released.
        self.incognito = False
        self.conversation = conversation
        self.store = store
        self.bridge = bridge
        self.tree = MessageTree(store.load_messages(conversation.id), conversation.active_leaf)
        self._requests: dict[str, list[str]] = {}  # request_id -> message id per sample index
        self._dirty: set[str] = set()  # streaming messages with unsaved text
        self._quitting = False
        self.context_tokens: int | None = None
        self.last_usage: dict[str, Any] = {}
        self._auto_title: str | None = None  # the title the app gave it, until a user's rename
        self.sent_at = 0.0  # time.time() of the last request sent (the monitor's "waiting")
        self._count_task: asyncio.Future | None = None
        # a reply of a chat with tools: reply id -> (its splitter, its tools by chat name)
        self._splitters: dict[str, tuple[CallSplitter, dict[str, McpTool]]] = {}
        self._tool_maps: dict[str, dict[str, McpTool]] = {}  # tool message id -> tools
        self._tool_tasks: dict[str, asyncio.Future] = {}  # TOOL_WORK key -> its task
        self.awaiting_tool: str | None = None  # the tool message waiting for the user
        self._save_timer = QTimer(self)
        self._save_timer.setInterval(SAVE_INTERVAL_MS)
        self._save_timer.timeout.connect(self.flush)
        colors.register(conversation.id, conversation.color_index)
        for m in reversed(self.tree.active_path()):
            if m.role == "assistant" and m.meta.get("usage"):
                self.last_usage = dict(m.meta["usage"])
                break

    # ---- properties ----------------------------------------------------------------------

    @property
    def id(self) -> str:
        return self.conversation.id

    @property
    def title(self) -> str:
        return self.conversation.title

    @property
    def settings(self) -> ChatSettings:
        return self.conversation.settings

    @property
    def model_ref(self) -> str:
        """"" for the local engine's model, else "<provider id>:<model>" (core.providers)."""
        return self.conversation.model

    @property
    def remote(self) -> Any:
        """The RemoteBridge for remote chats (None when the app has none)."""
        return getattr(self.manager, "remote", None)

    @property
    def is_remote(self) -> bool:
        return bool(self.conversation.model)

    def set_model(self, ref: str) -> bool:
        """Talk to another model from the next reply on (refused while answering)."""
        if ref == self.conversation.model:
            return True
        if self.busy:
            self.notice.emit("This chat is still answering; stop it before changing its model.")
            return False
        self.conversation.model = ref
        self.store.set_chat_model(self.id, ref)
        self.modelChanged.emit(ref)
        self._refresh_context()
        return True

    @property
    def busy(self) -> bool:
        return bool(self._requests)

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    def live_samples(self) -> int:
        """Replies still being generated (an n>1 request streams several)."""
        return sum(1 for ids in self._requests.values() for i in ids if i is not None)

    def active_path(self) -> list[Message]:
        return self.tree.active_path()

    # ---- actions -------------------------------------------------------------------------

    def send(self, text: str, attachments: Sequence[Attachment] = ()) -> bool:
        """Append a user message (with the files attached to it) to the visible path and ask
        for a reply."""
        if not text.strip() and not attachments:
            self.notice.emit("Type a message first.")
            return False
        if self.busy:
            self.notice.emit("This chat is still answering; stop it first.")
            return False
        parent = self.send_parent()
        meta = {"attachments": to_meta(attachments)} if attachments else None
        user = self._new_message(parent, "user", text, Status.COMPLETE, meta)
        self._reply(user.id, n=1)
        if self.title == DEFAULT_TITLE:  # after the reply is on the path: the chat has begun
            title = title_from(text or attachments[0].name)
            if self.manager is not None:
                title = self.manager.unique_title(title, self.id)
            self.rename(title, by_user=False)
        return True

    def send_parent(self) -> str | None:
        """Where the next message goes: below the path shown, except below a message the
        model refused as longer than its context. That one and its error stay, as a branch
        the switcher reaches, and the chat goes on from before it; otherwise every later
        message would carry it and be refused too (issue 25)."""
        leaf = self.tree.active_leaf
        if leaf is None:
            return None
        reply = self.tree.get(leaf)
        if reply.meta.get("refused") == REFUSED_TOO_LONG and reply.parent_id is not None:
            return self.tree.get(reply.parent_id).parent_id
        return leaf

    def draft_prompt(self, text: str, attachments: Sequence[Attachment] = ()) -> list[dict]:
        """The whole prompt sending `text` now would give the model (the draft meter counts
        it against the context limit before anything is sent)."""
        draft = Message(id="draft", conversation_id=self.id, parent_id=None, role="user",
                        content=text, status=Status.COMPLETE,
                        meta={"attachments": to_meta(attachments)} if attachments else {})
        parent = self.send_parent()
        path = self.tree.path_to(parent) if parent is not None else []
        return prompt_messages(self.settings.system_prompt, [*path, draft])

    def regenerate(self, message_id: str | None = None, n: int = 1) -> bool:
        """New reply alternative(s) for an assistant message (or a reply to a user message).

        The old reply stays as an alternative (‹ 1/2 ›). n > 1 asks the engine for n samples
        sharing the prompt's KV blocks.
        """
        if self.busy:
            self.notice.emit("This chat is still answering; stop it first.")
            return False
        if message_id is None:
            path = self.active_path()
            if not path:
                self.notice.emit("Nothing to regenerate yet.")
                return False
            message_id = path[-1].id
        msg = self.tree.get(message_id)
        parent = msg.parent_id if msg.role == "assistant" else msg.id
        if parent is None:
            self.notice.emit("Nothing to regenerate yet.")
            return False
        return self._reply(parent, n=max(1, min(8, n)))

    def edit_and_resend(self, message_id: str, text: str) -> bool:
        """A new version of a user message (a sibling: the old one stays), then a reply."""
        if not text.strip():
            self.notice.emit("The edited message is empty.")
            return False
        if self.busy:
            self.notice.emit("This chat is still answering; stop it first.")
            return False
        old = self.tree.get(message_id)
        files = from_meta(old.meta)  # the edited version keeps the files of the old one
        meta = {"attachments": to_meta(files)} if files else None
        user = self._new_message(old.parent_id, "user", text, Status.COMPLETE, meta)
        self._reply(user.id, n=1)  # on failure the reply shows the error; the text is kept
        return True

    def switch_alternative(self, message_id: str, delta: int) -> bool:
        new, changes = self.tree.switch(message_id, delta)
        if new is None:
            return False
        self._persist_choices(changes)
        self.pathChanged.emit()
        self._refresh_context()
        return True

    def show_branch(self, message_id: str) -> bool:
        """Make the branch through `message_id` the one shown (a search hit may sit on an
        alternative that is not); False when the message is not in this chat."""
        if message_id not in self.tree:
            return False
        if message_id not in {m.id for m in self.active_path()}:
            self._activate(message_id)
        return True

    def stop(self) -> None:
        """Cancel the running request(s); the partial replies stay, marked as stopped. Tool
        work stops too: a call not answered yet is recorded as stopped."""
        for rid in list(self._requests):
            if rid.startswith(TOOL_WORK):
                self._end_tool_work(rid, Status.STOPPED)
            else:
                self._cancel(rid)
        if not self._requests:
            self._settle()

    def _cancel(self, request_id: str) -> None:
        if self.remote is not None and self.remote.owns(request_id):
            self.remote.cancel(request_id)  # closes the HTTP stream
        else:
            self.bridge.cancel(request_id)

    @property
    def title_is_automatic(self) -> bool:
        """The title is still the one the app gave it (the first message's, or the model's
        name for the chat): a generated title may replace it, never a user's rename."""
        return self._auto_title is not None and self._auto_title == self.title

    def rename(self, title: str, by_user: bool = True) -> None:
        title = title.strip() or DEFAULT_TITLE
        self._auto_title = None if by_user else title
        self.conversation.title = title
        self.store.rename_conversation(self.id, title)
        self.titleChanged.emit(title)

    def set_settings(self, settings: ChatSettings) -> None:
        self.conversation.settings = settings
        self.store.save_chat_settings(self.id, settings)
        self.settingsChanged.emit()
        self._refresh_context()

    def prompt_messages(self, upto: str | None) -> list[dict[str, str]]:
        """What the engine sees for a reply below `upto`: system prompt + that path."""
        return prompt_messages(self.settings.system_prompt, self.tree.path_to(upto))

    # ---- internals -----------------------------------------------------------------------

    def _new_message(
        self,
        parent_id: str | None,
        role: str,
        content: str,
        status: str,
        meta: dict[str, Any] | None = None,
    ) -> Message:
        msg = Message(
            id=new_id(),
            conversation_id=self.id,
            parent_id=parent_id,
            role=role,
            content=content,
            status=status,
            meta=meta or {},
        )
        self.store.add_message(msg)
        self.tree.add(msg)
        return msg

    def _reply(self, parent_id: str, n: int) -> bool:
        prompt = self.prompt_messages(parent_id)
        replies = [self._new_message(parent_id, "assistant", "", Status.PENDING) for _ in range(n)]
        self._activate(replies[0].id)
        self.store.touch_conversation(self.id)
        if self._uses_tools(n):
            work = TOOL_WORK + replies[0].id
            self._requests[work] = []
            self.sent_at = time.time()
            self._save_timer.start()
            self.busyChanged.emit(True)
            self._tool_tasks[work] = asyncio.ensure_future(
                self._submit_with_tools(work, replies[0], parent_id))
            return True
        try:
            params = reply_params(self.settings.sampling, n)
            if self.is_remote:
                if self.remote is None:
                    raise RuntimeError("Remote providers are not available here.")
                rid = self.remote.submit(self.model_ref, prompt, params, self.id)
            else:
                rid = self.bridge.submit(prompt, params, self.id, incognito=self.incognito)
        except (ValueError, RuntimeError) as exc:
            for r in replies:
                self._finish(r, Status.ERROR, "", {"error": str(exc)})
            self.notice.emit(str(exc))
            return False
        self._requests[rid] = [r.id for r in replies]
        self.sent_at = time.time()
        self._save_timer.start()
        self.busyChanged.emit(True)
        return True

    def _activate(self, message_id: str) -> None:
        self._persist_choices(self.tree.activate(message_id))
        self.pathChanged.emit()

    def _persist_choices(self, changes: list[tuple[str, str]]) -> None:
        for parent, child in changes:
            self.store.set_active_child(parent, child)
        self.store.set_active_leaf(self.id, self.tree.active_leaf)
        self.conversation.active_leaf = self.tree.active_leaf

    def _finish(self, msg: Message, status: str, text: str | None, meta: dict[str, Any]) -> None:
        if text is not None:
            msg.content = text
        msg.status = status
        msg.meta.update(meta)
        self._dirty.discard(msg.id)
        self.store.update_message(msg.id, content=msg.content, status=status, meta=msg.meta)
        self.messageFinished.emit(msg.id)

    # ---- engine events (routed here by the SessionManager) -------------------------------

    def on_token(self, request_id: str, index: int, text: str) -> None:
        ids = self._requests.get(request_id)
        if ids is None or not 0 <= index < len(ids) or ids[index] is None:
            return  # not ours (or already finished): never write into the wrong message
        msg = self.tree.get(ids[index])
        split = self._splitters.get(msg.id)
        if split is not None:  # a chat with tools: a call's text is not the reply's
            text, _calls = split[0].feed(text)
        msg.content += text
        if msg.status != Status.STREAMING:
            msg.status = Status.STREAMING
            self.store.update_message(msg.id, content=msg.content, status=Status.STREAMING)
        else:
            self._dirty.add(msg.id)
        self.messageChanged.emit(msg.id)

    def on_final(self, request_id: str, index: int, event: Any) -> None:
        ids = self._requests.get(request_id)
        if ids is None or not 0 <= index < len(ids) or ids[index] is None:
            return
        msg = self.tree.get(ids[index])
        ids[index] = None  # type: ignore[call-overload]
        status = status_for(event.finish_reason, self._quitting)
        text = event.text if (event.text or status != Status.ERROR) else None
        meta: dict[str, Any] = {"finish_reason": str(event.finish_reason)}
        split = self._splitters.pop(msg.id, None)
        calls: list[dict] = []
        if split is not None:
            rest, _calls = split[0].feed("", final=True)
            msg.content += rest
            text = None  # the text shown (the calls are kept apart, in meta)
            calls = split[0].calls if status in (Status.COMPLETE, Status.LENGTH) else []
            if calls:
                meta["tool_calls"] = calls
        usage = usage_dict(event.usage)
        if usage:
            meta["usage"] = usage
            if index == 0:
                self.last_usage = usage
        if event.error:
            meta["error"] = event.error
            limit = getattr(self.bridge, "max_context", None)
            if limit and usage.get("prompt_tokens", 0) >= limit and not self.is_remote:
                meta["refused"] = REFUSED_TOO_LONG  # the next message starts before it
        self._finish(msg, status, text, meta)
        if calls:
            self._start_tool_calls(msg, calls, split[1])  # busy until they are answered
        # an engine error is shown once, in the reply it ended (not also as a notice)
        if all(i is None for i in ids):
            del self._requests[request_id]
            if not self._requests:
                self._settle()

    def _settle(self) -> None:
        """Nothing runs any more: save, say so, recount the context."""
        self._save_timer.stop()
        self.flush()
        self.busyChanged.emit(False)
        self.store.touch_conversation(self.id)
        self._refresh_context()

    def flush(self) -> None:
        """Write the text of replies being streamed (called about once a second)."""
        for mid in list(self._dirty):
            if mid in self.tree:
                self.store.update_message(mid, content=self.tree.get(mid).content)
        self._dirty.clear()

    def interrupt(self) -> None:
        """The app is quitting: cancel, and keep every partial reply marked interrupted."""
        self._quitting = True
        was_busy = self.busy
        for rid, ids in list(self._requests.items()):
            self._cancel(rid)
            for mid in ids:
                if mid is not None:
                    msg = self.tree.get(mid)
                    self._finish(msg, Status.INTERRUPTED, None, {"finish_reason": "interrupted"})
        for rid in [r for r in self._requests if r.startswith(TOOL_WORK)]:
            self._end_tool_work(rid, Status.INTERRUPTED)
        self._requests.clear()
        self._save_timer.stop()
        self.flush()
        self._quitting = False
        if was_busy:
            self.busyChanged.emit(False)

    def close(self) -> None:
        """The chat is being deleted: cancel its requests and forget them."""
        self.stop()
        self._requests.clear()
        self._dirty.clear()
        self._save_timer.stop()

    # ---- MCP tools (app/core/mcp.py; docs/ARCHITECTURE.md §6.6) ---------------------------

    @property
    def tool_hub(self) -> Any:
        """The app's McpHub (None: no tools in this app)."""
        return getattr(self.manager, "tools", None)

    def _uses_tools(self, n: int) -> bool:
        return (self.settings.tools and not self.is_remote and n == 1
                and self.tool_hub is not None and self.bridge.engine is not None)

    def _tool_rounds(self, parent_id: str) -> int:
        """Tool results since the last user message (a model that keeps calling is stopped
        at MAX_TOOL_ROUNDS: it must answer)."""
        rounds = 0
        for m in reversed(self.tree.path_to(parent_id)):
            if m.role == "user":
                break
            rounds += m.role == "tool"
        return rounds

    async def _submit_with_tools(self, work: str, reply: Message, parent_id: str) -> None:
        """Build the prompt with the chat's tools (as the server does) and submit it; the
        reply is then split into its text and its calls (on_token / on_final)."""
        try:
            tools, errors = await self.tool_hub.chat_tools()
            for error in errors:
                self.notice.emit(f"A tool server is not available: {error}")
            use = None
            if tools and self._tool_rounds(parent_id) < MAX_TOOL_ROUNDS:
                forced = (self.settings.tool_choice == "required"
                          and self.tree.get(parent_id).role == "user")
                use = ToolUse(tuple(t.spec(name) for name, t in tools.items()),
                              "required" if forced else "auto", parallel=False)
            messages, raw = prompt_with_calls(self.settings.system_prompt,
                                              self.tree.path_to(parent_id))
            engine = self.bridge.engine
            if engine is None:
                raise RuntimeError("No model is loaded.")
            prompt = await asyncio.to_thread(chat_prompt, engine, messages, raw, use)
            params = dataclasses.replace(self.settings.sampling, n=1)
            if use is not None and use.forced and prompt.syntax is not None:
                # a reply held to a call's grammar cannot be a beam search: greedy, one beam
                params = dataclasses.replace(params, beam_width=1, constraint=call_constraint(
                    use, prompt.syntax.start, prompt.syntax.end))
            if work not in self._requests:
                return  # stopped meanwhile
            rid = await self.bridge.submit_prompt(prompt.tokens, params, self.id,
                                                  incognito=self.incognito)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # no model, a refused prompt: the reply says why
            if work in self._requests:
                del self._requests[work]
                self._tool_tasks.pop(work, None)
                self._finish(reply, Status.ERROR, "", {"error": str(exc)})
                if not self._requests:
                    self._settle()
            return
        self._tool_tasks.pop(work, None)
        if work not in self._requests:
            self.bridge.cancel(rid)  # stopped while it was being submitted
            return
        del self._requests[work]
        self._requests[rid] = [reply.id]
        if prompt.syntax is not None and use is not None:
            self._splitters[reply.id] = (CallSplitter(prompt.syntax, list(use.tools)), tools)

    def _start_tool_calls(self, reply: Message, calls: list[dict],
                          tools: dict[str, McpTool]) -> None:
        """One tool message per call below the reply (the results go in them), then ask
        about the first."""
        parent = reply.id
        for call in calls:
            function = call["function"]
            tool = tools.get(function["name"])
            meta = {"tool_call": {"id": call["id"], "name": function["name"],
                                  "arguments": function["arguments"]},
                    "server": tool.server_name if tool else "",
                    "tool": tool.name if tool else function["name"], "state": "asking"}
            message = self._new_message(parent, "tool", "", Status.PENDING, meta)
            self._tool_maps[message.id] = tools
            parent = message.id
        self._activate(parent)
        self._requests[TOOL_WORK + reply.id] = []
        self._next_tool_call(TOOL_WORK + reply.id)

    def _tool_chain(self, work: str) -> list[Message]:
        """The tool messages below the reply of ``work``, in order (one per call)."""
        reply_id = work[len(TOOL_WORK):]
        out, current = [], self.tree.get(reply_id) if reply_id in self.tree else None
        while current is not None:
            children = [m for m in self.tree.children(current.id) if m.role == "tool"]
            current = children[-1] if children else None
            if current is not None:
                out.append(current)
        return out

    def _open_tool_calls(self, work: str) -> list[Message]:
        """The calls of ``work`` not answered yet."""
        return [m for m in self._tool_chain(work) if m.status == Status.PENDING]

    def _next_tool_call(self, work: str) -> None:
        """Ask about the next call (or run it, when its tool is always allowed); when all
        are answered, the reply goes on with the results."""
        if work not in self._requests:
            return
        pending = [m for m in self._open_tool_calls(work) if m.meta.get("state") == "asking"]
        if pending:
            message = pending[0]
            tool = self._tool_maps.get(message.id, {}).get(message.meta["tool_call"]["name"])
            if tool is None:
                self._tool_result(message, "no such tool: "
                                  f"{message.meta['tool_call']['name']}", error=True)
                self._next_tool_call(work)
            elif self.tool_hub.always_allowed(tool):
                self._run_tool(work, message, tool)
            else:
                self.awaiting_tool = message.id
                self.toolAsk.emit(message.id)
            return
        if self._open_tool_calls(work):
            return  # one is running
        chain = self._tool_chain(work)
        # busy throughout: the reply's work is in before this one leaves
        self._reply(chain[-1].id if chain else work[len(TOOL_WORK):], n=1)
        self._requests.pop(work, None)
        self._tool_tasks.pop(work, None)
        if not self._requests:
            self._settle()  # the reply could not even be submitted (it says why)

    def answer_tool(self, message_id: str, decision: str) -> None:
        """The user's answer about a call: "once", "always" (this tool, from now on) or
        "deny" (the model is told so and goes on)."""
        if message_id != self.awaiting_tool or message_id not in self.tree:
            return
        self.awaiting_tool = None
        self.toolAsk.emit("")
        message = self.tree.get(message_id)
        work = next((w for w in self._requests if w.startswith(TOOL_WORK)
                     and message in self._open_tool_calls(w)), None)
        if work is None:
            return
        if decision == "deny":
            message.meta["state"] = "denied"
            self._tool_result(message, DENIED, error=False)
            self._next_tool_call(work)
            return
        tool = self._tool_maps[message_id][message.meta["tool_call"]["name"]]
        if decision == "always":
            self.tool_hub.allow_always(tool)
        self._run_tool(work, message, tool)

    def _run_tool(self, work: str, message: Message, tool: McpTool) -> None:
        message.meta["state"] = "running"
        self.messageChanged.emit(message.id)

        async def run() -> None:
            try:
                arguments = json.loads(message.meta["tool_call"]["arguments"] or "{}")
                if not isinstance(arguments, dict):
                    raise ValueError("the arguments are not a JSON object")
                result = await self.tool_hub.call(tool, arguments)
                text, error = result.text, result.is_error
            except asyncio.CancelledError:
                raise
            except McpError as exc:
                text, error = str(exc), True
            except Exception as exc:  # bad arguments, anything else: the model hears it
                text, error = f"{tool.server_name}: {type(exc).__name__}: {exc}", True
            if work in self._requests and message.status == Status.PENDING:
                self._tool_result(message, text, error)
                self._next_tool_call(work)

        self._tool_tasks[work] = asyncio.ensure_future(run())

    def _tool_result(self, message: Message, text: str, error: bool) -> None:
        """The call's result (or error) into its tool message: shown, stored, and sent to
        the model with the rest of the chat."""
        state = message.meta.get("state")
        meta = {"state": "denied" if state == "denied" else ("error" if error else "done"),
                "is_error": error}
        if error and not text.lower().startswith("error"):
            text = f"Error: {text}"  # the model (and the user) read it as the call's failure
        self._finish(message, Status.COMPLETE, text, meta)

    def _end_tool_work(self, work: str, status: str) -> None:
        """Stop ``work`` (the user pressed stop, the app quits): calls not answered are
        recorded as stopped, a prompt being prepared is dropped."""
        task = self._tool_tasks.pop(work, None)
        if task is not None and not task.done():
            task.cancel()
        for message in self._open_tool_calls(work):
            message.meta["state"] = "stopped"
            self._finish(message, status, STOPPED_CALL, {})
        reply_id = work[len(TOOL_WORK):]
        if reply_id in self.tree and self.tree.get(reply_id).status in Status.LIVE:
            self._finish(self.tree.get(reply_id), status, None, {"finish_reason": "stopped"})
        if self.awaiting_tool is not None:
            self.awaiting_tool = None
            self.toolAsk.emit("")
        self._requests.pop(work, None)

    # ---- context footer ------------------------------------------------------------------

    def _refresh_context(self) -> None:
        """Recount the visible path's prompt tokens off the GUI thread."""
        if self._count_task is not None and not self._count_task.done():
            self._count_task.cancel()
        messages = self.prompt_messages(self.tree.active_leaf)
        if not messages:
            self.context_tokens = 0
            self.contextChanged.emit()
            return
        if self.is_remote:  # another tokenizer: only the server's own count is right
            u = self.last_usage
            self.context_tokens = (u.get("prompt_tokens", 0) + u.get("generated_tokens", 0)
                                   if u.get("prompt_tokens") else None)
            self.contextChanged.emit()
            return

        async def count() -> None:
            n = await self.bridge.count_tokens(messages)
            if n is not None:
                self.context_tokens = n
                self.contextChanged.emit()

        with contextlib.suppress(RuntimeError):  # no event loop (pure unit use)
            self._count_task = asyncio.ensure_future(count())

    def refresh_context(self) -> None:
        self._refresh_context()


class SessionManager(QObject):
    """Creates, finds and deletes ChatSessions and routes engine events to them."""

    sessionCreated = Signal(str)
    sessionDeleted = Signal(str)
    conversationsChanged = Signal()  # titles, order or membership changed (sidebar refresh)
    busyChanged = Signal(str, bool)  # session id, busy

    def __init__(self, store: Any, bridge: Any, parent: QObject | None = None,
                 remote: Any = None) -> None:
        super().__init__(parent)
        self.store = store
        self.bridge = bridge
        self.remote = remote  # RemoteBridge: remote chats' replies, the same signals
        self.sessions: dict[str, ChatSession] = {}
        self.tools: Any = None  # the McpHub behind chats with tools (app/core/mcp.py)
        for source in (bridge, remote) if remote is not None else (bridge,):
            source.tokenReceived.connect(self._on_token)
            source.finalReceived.connect(self._on_final)
        bridge.modelReady.connect(self._on_ready)
        self.default_settings = ChatSettings()
        self.default_source = ""  # where default_settings' sampling comes from (for the UI)

    def get(self, conversation_id: str) -> ChatSession | None:
        """The session of a conversation, loading it from the store if needed."""
        session = self.sessions.get(conversation_id)
        if session is None:
            conv = self.store.get_conversation(conversation_id)
            if conv is None:
                return None
            session = self._adopt(conv)
        return session

    def create(
        self,
        title: str = DEFAULT_TITLE,
        settings: ChatSettings | None = None,
        folder_id: str | None = None,
    ) -> ChatSession:
        """A new chat (in a folder: with the folder's settings, when it carries some)."""
        folder = self.store.get_folder(folder_id) if folder_id else None
        if settings is None and folder is not None and folder.settings is not None:
            settings = copy_settings(folder.settings)
        settings = settings or copy_settings(self.default_settings)
        conv = self.store.create_conversation(
            title, settings, folder.id if folder is not None else None
        )
        session = self._adopt(conv)
        self.conversationsChanged.emit()
        return session

    def create_incognito(self) -> ChatSession:
        """A new incognito chat (app/chat/incognito.py): in no folder, in no store."""
        from app.chat.incognito import INCOGNITO_TITLE, IncognitoStore

        store = IncognitoStore()
        conv = store.create_conversation(INCOGNITO_TITLE, copy_settings(self.default_settings))
        session = self._adopt(conv, store)
        session.incognito = True
        return session

    def _adopt(self, conv: Conversation, store: Any = None) -> ChatSession:
        session = ChatSession(conv, self.store if store is None else store, self.bridge)
        session.manager = self
        self.sessions[conv.id] = session
        session.titleChanged.connect(lambda _t: self.conversationsChanged.emit())
        session.busyChanged.connect(lambda b, sid=conv.id: self._busy(sid, b))
        session.modelChanged.connect(lambda _m: self.conversationsChanged.emit())
        self.sessionCreated.emit(conv.id)
        session.refresh_context()
        return session

    def _busy(self, session_id: str, busy: bool) -> None:
        self.busyChanged.emit(session_id, busy)
        self.conversationsChanged.emit()  # "updated" order changed, or a first message


    def rename(self, conversation_id: str, title: str) -> None:
        session = self.sessions.get(conversation_id)
        if session is not None:
            session.rename(title)
        else:
            self.store.rename_conversation(conversation_id, title.strip() or DEFAULT_TITLE)
            self.conversationsChanged.emit()

    def unique_title(self, title: str, session_id: str) -> str:
        """`title`, numbered when another chat has it already (app/core/session_logic.py)."""
        taken = (c.title for c in self.store.list_conversations() if c.id != session_id)
        return unique_title(title, taken)

    def latest_or_new(self) -> ChatSession | None:
        """The most recently updated chat, or a new one when there is none."""
        convs = self.store.list_conversations()
        return self.get(convs[0].id) if convs else self.create()

    def prune_empty(self, keep: set[str]) -> None:
        """Drop untouched "New Chat"s left from earlier runs (those in `keep` are shown)."""
        for conv in self.store.list_conversations():
            if conv.id not in keep and not self.store.load_messages(conv.id):
                self.store.delete_conversation(conv.id)

    def discard_if_unused(self, session: ChatSession) -> None:
        """A "New Chat" never written in disappears when no pane shows it any more; an
        incognito chat always does (its reply, if one runs, is stopped)."""
        if session.incognito or (not session.tree.by_id and not session.busy):
            self.delete(session.id)

    def delete(self, conversation_id: str) -> None:
        session = self.sessions.pop(conversation_id, None)
        if session is not None:
            session.close()
        self.bridge.cancel_session(conversation_id)
        if self.remote is not None:
            self.remote.cancel_session(conversation_id)
        (session.store if session is not None else self.store).delete_conversation(
            conversation_id)
        colors.forget(conversation_id)
        self.sessionDeleted.emit(conversation_id)
        self.conversationsChanged.emit()

    def branch(self, session: ChatSession, message_id: str) -> ChatSession:
        """A new chat holding a copy of the path up to `message_id` (inclusive)."""
        path = session.tree.path_to(message_id)
        conv = self.store.create_conversation(
            title_from(f"Branch of {session.title}"), copy_settings(session.settings)
        )
        if session.model_ref:  # a branch talks to the same model
            conv.model = session.model_ref
            self.store.set_chat_model(conv.id, conv.model)
        copies = branch_copies(path, conv.id, session.id, message_id)
        self.store.add_messages(copies)
        leaf = copies[-1].id if copies else None
        self.store.set_active_leaf(conv.id, leaf)
        conv.active_leaf = leaf
        new = self._adopt(conv)
        self.conversationsChanged.emit()
        return new

    def interrupt_all(self) -> None:
        for s in self.sessions.values():
            s.interrupt()

    def busy_sessions(self) -> list[str]:
        return [sid for sid, s in self.sessions.items() if s.busy]

    # ---- routing -------------------------------------------------------------------------

    def _on_token(self, session_id: str, request_id: str, index: int, text: str) -> None:
        session = self.sessions.get(session_id)
        if session is not None:
            session.on_token(request_id, index, text)

    def _on_final(self, session_id: str, request_id: str, index: int, event: Any) -> None:
        session = self.sessions.get(session_id)
        if session is not None:
            session.on_final(request_id, index, event)

    def _on_ready(self, _info: Any) -> None:
        for s in self.sessions.values():
            s.refresh_context()

