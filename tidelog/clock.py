"""Time as an injected dependency, so pure cores can run on a virtual clock in tests."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Wall-clock milliseconds since the epoch (what timestamps and retention compare to)."""

    def now_ms(self) -> int: ...


class SystemClock:
    """The real wall clock."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class ManualClock:
    """A clock that moves only when told to; for deterministic tests and simulations."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now_ms = start_ms

    def now_ms(self) -> int:
        return self._now_ms

    def advance(self, delta_ms: int) -> None:
        if delta_ms < 0:
            raise ValueError("a clock never moves backwards")
        self._now_ms += delta_ms


SYSTEM_CLOCK = SystemClock()
