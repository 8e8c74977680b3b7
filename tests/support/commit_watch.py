"""A group's committed offsets recorded as they change, to check they never go back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import tidelog


def commit_watch(
    admin: tidelog.Admin,
    group: str,
    partitions: int,
    stop: threading.Event,
    interval_s: float = 0.05,
) -> tuple[dict[int, list[int]], Callable[[], None]]:
    """(history, monitor): run ``monitor`` in a thread until ``stop``; ``history`` holds
    each partition's committed offsets in the order seen, each change once."""
    history: dict[int, list[int]] = {p: [] for p in range(partitions)}

    def monitor() -> None:
        while not stop.is_set():
            try:
                for o in admin.describe_group(group):
                    if o.committed_offset >= 0:
                        seen = history[o.partition]
                        if not seen or seen[-1] != o.committed_offset:
                            seen.append(o.committed_offset)
            except tidelog.errors.TidelogError:
                pass  # a fault under way: looked at again next time
            time.sleep(interval_s)

    return history, monitor
