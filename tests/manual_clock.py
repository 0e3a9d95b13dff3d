"""A controlled clock for code paced by QTimer: tests advance time by hand, so a timing claim
("renders at most 30 times a second", "saves about once a second") is checked exactly and
without the wall clock. Install it by monkeypatching the module's ``QTimer`` name:

    clock = ManualClock()
    monkeypatch.setattr(app.chat.throttle, "QTimer", clock.timer_class())
"""

from __future__ import annotations

from collections.abc import Callable


class ManualClock:
    def __init__(self) -> None:
        self.now = 0  # milliseconds
        self.timers: list[ManualTimer] = []

    def timer_class(self) -> type[ManualTimer]:
        clock = self

        class BoundTimer(ManualTimer):
            def __init__(self, parent: object = None) -> None:
                super().__init__(clock, parent)

        return BoundTimer

    def advance(self, ms: int) -> None:
        """Move time forward one millisecond at a time, firing each timer that falls due."""
        for _ in range(ms):
            self.now += 1
            for timer in list(self.timers):
                if timer.due is not None and timer.due <= self.now:
                    timer.due = None if timer.single_shot else self.now + timer.interval
                    for slot in list(timer.slots):
                        slot()

    def active(self) -> list[ManualTimer]:
        return [t for t in self.timers if t.due is not None]


class ManualTimer:
    """The part of QTimer's interface the app's pacing code uses."""

    def __init__(self, clock: ManualClock, parent: object = None) -> None:
        self.clock = clock
        self.parent = parent
        self.slots: list[Callable[[], object]] = []
        self.due: int | None = None
        self.interval = 0
        self.single_shot = False
        self.timeout = self  # timeout.connect(slot)
        clock.timers.append(self)

    def connect(self, slot: Callable[[], object]) -> None:
        self.slots.append(slot)

    def setSingleShot(self, single: bool) -> None:
        self.single_shot = single

    def setInterval(self, ms: int) -> None:
        self.interval = ms

    def isActive(self) -> bool:
        return self.due is not None

    def start(self, ms: int | None = None) -> None:
        if ms is not None:
            self.interval = ms
        self.due = self.clock.now + self.interval

    def stop(self) -> None:
        self.due = None
