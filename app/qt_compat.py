"""Work around a reference-count bug in PySide6 6.12's Signal.emit on Python < 3.12.

`SignalInstance.emit()` returns `True` without taking a reference, so every emit, ours or
qasync's (it wakes the loop with a signal for each `call_soon_threadsafe`, i.e. per streamed
token), drops one reference to the `True` singleton. On Python 3.11, where `True` is not
immortal, a few thousand emits bring its count to zero and the interpreter aborts with
"bool_dealloc: deallocating True or False". (tests/test_app_qt_compat.py shows the leak.)

`True` and `False` are static singletons that are never freed, so the fix is to give them a
reference budget no process can exhaust (2**40 emits). Python 3.12+ makes them immortal and
needs nothing.
"""

from __future__ import annotations

import ctypes
import sys

_BUDGET = 1 << 40
_applied = False


def emit_leaks_true() -> bool:
    """Whether this PySide6 drops a reference to True on each emit (measured, not assumed)."""
    from PySide6.QtCore import QObject, Signal

    class _Probe(QObject):
        ping = Signal()

    probe = _Probe()
    before = sys.getrefcount(True)
    for _ in range(10):
        probe.ping.emit()
    return sys.getrefcount(True) < before


def apply() -> None:
    """Give True and False a large reference budget (once, and only where needed)."""
    global _applied
    if _applied or sys.version_info >= (3, 12):
        return
    for singleton in (True, False):
        ctypes.c_ssize_t.from_address(id(singleton)).value += _BUDGET
    _applied = True
