"""The record bytes a gateway holds at once: produce requests (Kafka's broker setting
``queued.max.request.bytes``) in one budget, fetch answers in another.

Each produce request the gateway has read stays in its memory until every partition's
leader has answered: the request as received, its batches as forwarded, gRPC's buffers
for both. Per-stream and per-request limits bound what one client takes, but not what
many take together, so without this a burst from many producers grows the gateway until
its pod's memory limit kills it. A request that does not fit waits here before its stream
is read further: gRPC's flow control then holds the client's next requests back in its
own buffer, which its ``buffer_bytes`` bounds, and the client sees latency, not errors.

A fetch answer is different: a fetch can ask the leaders for less, so it takes what room
there is (``acquire_up_to``) instead of waiting for all it wanted, and waits only when
there is less than a useful minimum. Leaders may answer a little more than asked (the
first batch is always whole, as in Kafka); ``take`` charges that excess without waiting.

A request waiting for room is in memory already (gRPC read it whole before the handler
ran): each unary call and each stream waiting holds one. So the requests that may wait are
bounded too, by ``max_waiting_bytes`` (the budget's size by default): one that would wait
beyond that is refused at once (the client retries) rather than held until its timeout:
40 requests of 3 MB waiting for a 4 MB budget held 326 MB (found by an audit). What
gRPC has read and not yet handed over is beyond any budget's reach: ``--max-concurrent-rpcs``
times ``--max-request-bytes`` at worst (docs/DEPLOY.md).

Invariants: ``in_use_bytes`` never exceeds ``limit_bytes``, except that one request larger
than the whole budget is let through when nothing else is held (it passed
``--max-request-bytes`` already; refusing it would fail it forever), and except for what
``take`` charges (at most one batch per leader asked, beyond a fetch's grant). Every byte
``acquire``, ``acquire_up_to`` or ``take`` hands out is given back by ``release``.
"""

from __future__ import annotations

import threading
import time


class ByteBudget:
    """A pool of ``limit_bytes``; thread-safe. Waiters are not ordered: a small request
    may pass a large one that waits for room (Kafka's memory pool is not fair either)."""

    def __init__(self, limit_bytes: int, max_waiting_bytes: int | None = None) -> None:
        if limit_bytes < 1:
            raise ValueError(f"a byte budget must be >= 1 byte, not {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.max_waiting_bytes = limit_bytes if max_waiting_bytes is None else max_waiting_bytes
        self._in_use_bytes = 0
        self._waiting_bytes = 0  # of ``acquire`` calls waiting for room
        self._room = threading.Condition()

    @property
    def in_use_bytes(self) -> int:
        with self._room:
            return self._in_use_bytes

    def acquire(self, size_bytes: int, deadline_s: float) -> bool:
        """Take ``size_bytes``, waiting for room until ``deadline_s`` (``time.monotonic``
        based); False if the deadline passed first, or at once if the bytes already
        waiting leave no place for these (``max_waiting_bytes``): nothing taken."""
        with self._room:
            if self._fits(size_bytes):
                self._in_use_bytes += size_bytes
                return True
            if self._waiting_bytes and self._waiting_bytes + size_bytes > self.max_waiting_bytes:
                return False
            self._waiting_bytes += size_bytes
            try:
                while not self._fits(size_bytes):
                    remaining_s = deadline_s - time.monotonic()
                    if remaining_s <= 0:
                        return False
                    self._room.wait(remaining_s)
            finally:
                self._waiting_bytes -= size_bytes
            self._in_use_bytes += size_bytes
            return True

    def acquire_up_to(
        self, wanted_bytes: int, floor_bytes: int, deadline_s: float, *, share: int = 1
    ) -> int:
        """Take up to ``wanted_bytes`` but no more than 1/``share`` of the room left (so
        later callers find room too), once the room is at least ``floor_bytes`` (or
        ``wanted_bytes``, if smaller); waits for room until ``deadline_s``. Returns the
        bytes taken, at least the floor, or 0 if the deadline passed first."""
        floor_bytes = min(floor_bytes, wanted_bytes)
        with self._room:
            while True:
                room = max(self.limit_bytes, floor_bytes) - self._in_use_bytes
                if self._in_use_bytes == 0 or room >= floor_bytes:
                    granted = min(wanted_bytes, max(floor_bytes, room // share))
                    break
                remaining_s = deadline_s - time.monotonic()
                if remaining_s <= 0:
                    return 0
                self._room.wait(remaining_s)
            self._in_use_bytes += granted
            return granted

    def take(self, size_bytes: int) -> None:
        """Charge ``size_bytes`` at once, room or not: bytes already in memory (what a
        leader answered beyond a grant) must be counted until they are released."""
        with self._room:
            self._in_use_bytes += size_bytes

    def release(self, size_bytes: int) -> None:
        with self._room:
            self._in_use_bytes -= size_bytes
            assert self._in_use_bytes >= 0, "released more than was acquired"
            self._room.notify_all()

    def _fits(self, size_bytes: int) -> bool:
        # Nothing to hold always fits: a request without record bytes waited behind one
        # larger than the whole budget (let through alone), or was refused (found by an
        # audit).
        return (
            size_bytes == 0
            or self._in_use_bytes == 0
            or self._in_use_bytes + size_bytes <= self.limit_bytes
        )
