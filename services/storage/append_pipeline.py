"""``AppendPipeline``: an AppendStream's requests that were appended and not yet answered.

A stream's reader thread appends each request as it arrives and puts it here; the
answering thread takes them out in the same order and answers each once it is
acknowledged. The pipeline is what bounds how far the reader runs ahead of the answers:

* at most ``max_items`` requests, and
* at most ``max_bytes`` of their record bytes, except that an empty pipeline always takes
  one request, however large (else a request above the bound would never be read).

A reader that finds no room waits (and reads nothing more from the stream, so gRPC's flow
control holds the client back), looking every ``poll_s`` whether the stream is over.

Why both bounds: a producer in direct mode keeps up to five small requests of every
partition in flight on its one stream to a broker, one partition each. Thousands of
partitions' acks=all appends must overlap there as they do in one multi-partition
request, which a small count bound prevented (each waited for a follower round of its
own); the byte bound keeps what a stream holds in memory to what a few large requests do.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Final, Generic, TypeVar

T = TypeVar("T")

DEFAULT_POLL_S: Final = 0.5
"""How often a reader blocked on a full pipeline looks whether the stream is over."""


class AppendPipeline(Generic[T]):
    """A FIFO bounded by item count and bytes. Thread-safe; one reader puts, one answerer
    takes. ``None`` is the end marker a reader puts last; it is never refused."""

    def __init__(self, max_items: int, max_bytes: int, poll_s: float = DEFAULT_POLL_S) -> None:
        if max_items < 1 or max_bytes < 1:
            raise ValueError(f"max_items ({max_items}) and max_bytes ({max_bytes}) must be >= 1")
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._poll_s = poll_s
        self._cond = threading.Condition()
        # Invariant: _bytes is the sum of the sizes of the entries in _items.
        self._items: deque[tuple[T | None, int]] = deque()
        self._bytes = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def size_bytes(self) -> int:
        with self._cond:
            return self._bytes

    def _has_room(self, size_bytes: int) -> bool:
        if not self._items:
            return True
        return len(self._items) < self._max_items and self._bytes + size_bytes <= self._max_bytes

    def put_unless(self, item: T | None, size_bytes: int, over: threading.Event) -> bool:
        """Put ``item`` once there is room for it; False if ``over`` is set first (nobody
        takes any more). The end marker (``None``) takes no room."""
        with self._cond:
            while item is not None and not self._has_room(size_bytes):
                if over.is_set():
                    return False
                self._cond.wait(self._poll_s)
            if over.is_set():
                return False
            self._items.append((item, size_bytes if item is not None else 0))
            self._bytes += size_bytes if item is not None else 0
            self._cond.notify_all()
            return True

    def get(self) -> T | None:
        """The oldest item, waiting for one; ``None`` once the reader has ended."""
        with self._cond:
            while not self._items:
                self._cond.wait()
            item, size_bytes = self._items.popleft()
            self._bytes -= size_bytes
            self._cond.notify_all()
            return item

    def drain(self) -> list[T]:
        """Take every item left (end markers dropped), without waiting."""
        with self._cond:
            items = [item for item, _ in self._items if item is not None]
            self._items.clear()
            self._bytes = 0
            self._cond.notify_all()
            return items
