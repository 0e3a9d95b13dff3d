"""Markdown -> Qt rich-text HTML, with Pygments highlighting and a copy link per code block.

Qt's QTextDocument understands a subset of HTML 4 (tables, spans with inline styles, <pre>), so
code is highlighted with inline styles (no CSS classes) and each fenced block becomes a two-row
table: a header with the language and a `copy:N` link, then the code. `Rendered.code_blocks[N]`
is the exact text a click on that link copies.

Streaming text is often half-written markdown. An unclosed fence is closed for display, and if
anything still goes wrong the text is shown as plain, escaped text rather than failing. For a
growing reply, `StreamingRenderer` renders the finished paragraphs once and re-renders only the
open tail, so the cost of a tick does not grow with the reply's length.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from markdown_it import MarkdownIt
from pygments.formatters import HtmlFormatter

from app.core.highlighting import highlighted

if TYPE_CHECKING:  # the look is the theme's (app/ui/theme.py), handed in by the caller
    from app.ui.theme import MarkdownTheme

COPY_SCHEME = "copy:"


@dataclass(frozen=True)
class Rendered:
    html: str
    code_blocks: tuple[str, ...] = ()


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def _open_fence(text: str) -> str | None:
    """The fence marker left open at the end of `text`, if any."""
    marker: str | None = None
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if not m:
            continue
        found = m.group(1)
        if marker is None:
            marker = found
        elif (
            found[0] == marker[0]
            and len(found) >= len(marker)
            and not line.strip()[len(found) :].strip()
        ):
            marker = None
    return marker


@lru_cache(maxsize=64)
def _formatter(style: str) -> HtmlFormatter:
    return HtmlFormatter(style=style, noclasses=True, nowrap=True)


def _highlight(code: str, lang: str, theme: MarkdownTheme) -> str:
    out = highlighted(code, lang, _formatter(theme.pygments_style))
    if out is None:
        out = html.escape(code)
    return out.rstrip("\n")


class _Renderer:
    """One markdown-it instance per theme, with our fence renderer."""

    def __init__(self, theme: MarkdownTheme) -> None:
        self.theme = theme
        self.md = MarkdownIt("commonmark", {"html": False, "breaks": True, "typographer": False})
        self.md.enable(["table", "strikethrough"])
        # markdown-it binds rules as methods of its renderer: wrap ours in plain functions.
        self.md.add_render_rule("fence", lambda _r, tokens, idx, *_a: self._fence(tokens, idx))
        self.md.add_render_rule("code_block", lambda _r, tokens, idx, *_a: self._fence(tokens, idx))
        self.md.add_render_rule(
            "code_inline", lambda _r, tokens, idx, *_a: self._code_inline(tokens, idx)
        )
        self._blocks: list[str] = []
        self._offset = 0

    def _code_inline(self, tokens: list, idx: int) -> str:
        t = self.theme
        return (
            f'<code style="background-color:{t.inline_code_bg};">'
            f"{html.escape(tokens[idx].content)}</code>"
        )

    def _fence(self, tokens: list, idx: int) -> str:
        tok = tokens[idx]
        code = tok.content
        lang = (tok.info or "").strip().split(" ")[0] if tok.type == "fence" else ""
        n = self._offset + len(self._blocks)
        self._blocks.append(code.rstrip("\n"))
        code = code.expandtabs(4)
        t = self.theme
        label = html.escape(lang) if lang else "code"
        body = _highlight(code, lang, t).replace("\n", "<br/>").replace("  ", "&nbsp; ")
        return (
            f'<table width="100%" cellspacing="0" cellpadding="6" '
            f'style="margin-top:6px; margin-bottom:6px;">'
            f'<tr><td bgcolor="{t.code_header_bg}" style="color:{t.code_header_fg};">'
            f'<span style="font-size:small;">{label}</span></td>'
            f'<td bgcolor="{t.code_header_bg}" align="right">'
            f'<a href="{COPY_SCHEME}{n}" style="color:{t.code_header_fg}; text-decoration:none;'
            f' font-size:small;">Copy</a></td></tr>'
            f'<tr><td colspan="2" bgcolor="{t.code_bg}">'
            f'<span style="font-family:monospace; white-space:pre-wrap;">{body}</span>'
            f"</td></tr></table>"
        )

    def render(self, text: str, code_offset: int = 0) -> Rendered:
        self._blocks = []
        self._offset = code_offset
        out = self.md.render(text)
        # Markdown tables: Qt draws no cell borders unless asked.
        out = out.replace(
            "<table>",
            f'<table border="1" cellspacing="0" cellpadding="4" '
            f'style="border-color:{self.theme.rule}; border-style:solid;">',
        )
        return Rendered(out, tuple(self._blocks))


@lru_cache(maxsize=4)
def _renderer(theme: MarkdownTheme) -> _Renderer:
    return _Renderer(theme)


def plain_html(text: str) -> str:
    """Text shown as is (escaped, line breaks kept): the fallback that never fails."""
    return "<p>" + html.escape(text).replace("\n", "<br/>") + "</p>"


def render_markdown(text: str, theme: MarkdownTheme, code_offset: int = 0) -> Rendered:
    """Render a (possibly half-written) markdown text; never raises."""
    source = text
    marker = _open_fence(text)
    if marker is not None:
        source = text + "\n" + marker
    try:
        return _renderer(theme).render(source, code_offset)
    except Exception:
        return Rendered(plain_html(text))


def stable_split(text: str) -> int:
    """Index where the open tail of a growing reply starts.

    Everything before is finished paragraphs (ending with a blank line outside any code
    fence), which will not change as more tokens arrive.
    """
    pos = 0
    in_fence: str | None = None
    start = 0
    for line in text.splitlines(keepends=True):
        m = _FENCE.match(line)
        if m:
            found = m.group(1)
            if in_fence is None:
                in_fence = found
            elif found[0] == in_fence[0] and len(found) >= len(in_fence):
                in_fence = None
        start += len(line)
        if in_fence is None and line.strip() == "" and line.endswith("\n"):
            pos = start
    return pos


class StreamingRenderer:
    """Renders a growing reply: the finished prefix once, the open tail on every call."""

    def __init__(self, theme: MarkdownTheme) -> None:
        self.theme = theme
        self._prefix_text = ""
        self._prefix: Rendered = Rendered("")
        self.renders = 0  # tail renders done (for tests and benchmarks)

    def render(self, text: str) -> Rendered:
        self.renders += 1
        cut = stable_split(text)
        prefix_text = text[:cut]
        if prefix_text != self._prefix_text:
            self._prefix_text = prefix_text
            self._prefix = render_markdown(prefix_text, self.theme) if prefix_text else Rendered("")
        tail = render_markdown(text[cut:], self.theme, code_offset=len(self._prefix.code_blocks))
        return Rendered(self._prefix.html + tail.html, self._prefix.code_blocks + tail.code_blocks)
