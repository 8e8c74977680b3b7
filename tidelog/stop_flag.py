"""``StopFlag``: a stop request that signal handlers may set.

A signal handler runs in the main thread between two bytecodes, wherever that thread is,
including inside the handler itself when a second signal arrives (a parent's death sends
SIGTERM while another SIGTERM is being handled). A ``threading.Event`` takes a lock in
``set()``: the nested handler then waits for a lock its own interrupted frame holds, and
the process hangs for good instead of stopping. This flag takes no lock: setting it is a
list append, and waiting is short sleeps that let handlers run.
"""

from __future__ import annotations

import time
from typing import Final

POLL_S: Final = 0.1


class StopFlag:
    def __init__(self) -> None:
        self._signals: list[int] = []

    def set(self, signum: int = 0) -> None:
        """Safe in a signal handler (no lock)."""
        self._signals.append(signum)

    def is_set(self) -> bool:
        return bool(self._signals)

    @property
    def first_signal(self) -> int | None:
        return self._signals[0] if self._signals else None

    def wait(self, timeout_s: float) -> bool:
        """Sleep until set or ``timeout_s`` passed; whether it is set."""
        deadline = time.monotonic() + timeout_s
        while not self._signals:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(POLL_S, remaining))
        return True
