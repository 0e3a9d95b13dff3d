"""Code highlighting with Pygments, shared by the chat view and the HTML export.

Both must show every code block whatever its fence says: an unknown language falls back to
plain text, and a lexer that fails (Pygments has had such bugs) gives None, so the caller
shows the code escaped instead of losing it. Qt-free, so the exporter in app/core can use it.
"""

from __future__ import annotations

from pygments import highlight
from pygments.formatter import Formatter
from pygments.lexers import get_lexer_by_name
from pygments.lexers.special import TextLexer
from pygments.util import ClassNotFound


def highlighted(code: str, lang: str, formatter: Formatter) -> str | None:
    """``code`` highlighted as ``lang`` (plain text when unknown), or None if Pygments fails."""
    try:
        lexer = get_lexer_by_name(lang, stripnl=False) if lang else TextLexer(stripnl=False)
    except ClassNotFound:
        lexer = TextLexer(stripnl=False)
    try:
        return highlight(code, lexer, formatter)
    except Exception:  # a lexer bug must never lose the text
        return None
