"""Work around reference-count bugs of PySide6/shiboken 6.12 on Python < 3.12.

Measured here (tests/test_app_units.py keeps the probes):
- `SignalInstance.emit()` returns `True` without taking a reference, so every emit, ours or
  qasync's (it wakes the loop with a signal for every `call_soon_threadsafe`, i.e. for each
  streamed token), drops one reference to `True`;
- methods returning nothing (`QLabel.setText`, `QWidget.setVisible`, `QTimer.start`, ...) and
  some returning a missing object (`QObject.parent()` without a parent) hand out `None` the
  same way, dropping one reference to `None` per call.
On Python 3.11, where these singletons are not immortal, the counts reach zero within minutes of
use and the interpreter aborts ("bool_dealloc" / "none_dealloc: deallocating None").

`None`, `True` and `False` are static objects that are never freed, so the fix is to give each
a reference budget no process can use up (2**40 calls). Python 3.12+ makes them immortal and
needs nothing.
"""

from __future__ import annotations

import ctypes
import sys

_BUDGET = 1 << 40
_SINGLETONS = (None, True, False)
_applied = False


def leaked_references() -> dict[str, int]:
    """References each singleton loses over 10 emits and 10 void calls (0 = no leak)."""
    from PySide6.QtCore import QObject, QTimer, Signal

    class _Probe(QObject):
        ping = Signal()

    probe = _Probe()
    timer = QTimer()
    before = {repr(s): sys.getrefcount(s) for s in _SINGLETONS}
    for _ in range(10):
        probe.ping.emit()
        timer.setInterval(5)
    return {k: before[k] - sys.getrefcount(eval(k)) for k in before}  # noqa: S307


def apply() -> None:
    """Give None, True and False a huge reference budget (once, and only where needed)."""
    global _applied
    if _applied or sys.version_info >= (3, 12):
        return
    for singleton in _SINGLETONS:
        ctypes.c_ssize_t.from_address(id(singleton)).value += _BUDGET
    _applied = True
