"""The record bytes of produce requests a gateway holds at once (Kafka's broker setting
``queued.max.request.bytes``).

Each produce request the gateway has read stays in its memory until every partition's
leader has answered: the request as received, its batches as forwarded, gRPC's buffers
for both. Per-stream and per-request limits bound what one client takes, but not what
many take together, so without this a burst from many producers grows the gateway until
its pod's memory limit kills it. A request that does not fit waits here before its stream
is read further: gRPC's flow control then holds the client's next requests back in its
own buffer, which its ``buffer_bytes`` bounds, and the client sees latency, not errors.

Invariants: ``in_use_bytes`` never exceeds ``limit_bytes``, except that one request larger
than the whole budget is let through when nothing else is held (it passed
``--max-request-bytes`` already; refusing it would fail it forever). Every ``acquire``
that returns True is matched by one ``release`` of the same size.
"""

from __future__ import annotations

import threading
import time


class ByteBudget:
    """A pool of ``limit_bytes``; thread-safe. Waiters are not ordered: a small request
    may pass a large one that waits for room (Kafka's memory pool is not fair either)."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 1:
            raise ValueError(f"a byte budget must be >= 1 byte, not {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._in_use_bytes = 0
        self._room = threading.Condition()

    @property
    def in_use_bytes(self) -> int:
        with self._room:
            return self._in_use_bytes

    def acquire(self, size_bytes: int, deadline_s: float) -> bool:
        """Take ``size_bytes``, waiting for room until ``deadline_s`` (``time.monotonic``
        based); False if the deadline passed first (nothing taken)."""
        with self._room:
            while not self._fits(size_bytes):
                remaining_s = deadline_s - time.monotonic()
                if remaining_s <= 0:
                    return False
                self._room.wait(remaining_s)
            self._in_use_bytes += size_bytes
            return True

    def release(self, size_bytes: int) -> None:
        with self._room:
            self._in_use_bytes -= size_bytes
            assert self._in_use_bytes >= 0, "released more than was acquired"
            self._room.notify_all()

    def _fits(self, size_bytes: int) -> bool:
        return self._in_use_bytes == 0 or self._in_use_bytes + size_bytes <= self.limit_bytes
