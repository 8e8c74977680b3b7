"""A steady produce load for end-to-end failure tests, and what to check after it.

``SteadyLoad`` sends ``"<partition>:<sequence>"`` values round-robin over a topic's
partitions from a thread until stopped, keeping every future; ``acknowledged`` then says
which record each acknowledged send is at. ``read_everything`` reads a topic back (a
little past the expected count, so that duplicates show) and ``commit_some`` commits a
group's position after reading a few hundred records.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import tidelog
from tidelog.errors import TidelogError
from tidelog.producer import RecordMetadata


class SteadyLoad:
    """Records to every partition of ``topic`` through ``producer``, from a thread."""

    def __init__(self, producer: tidelog.Producer, topic: str, partitions: int) -> None:
        self.producer = producer
        self.topic = topic
        self.partitions = partitions
        self.sent: list[tuple[int, bytes, Future[RecordMetadata]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send, daemon=True)

    def start(self) -> SteadyLoad:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def done(self, since: int = 0) -> int:
        """Sends completed (acknowledged or failed) among those after the ``since``-th."""
        return sum(future.done() for _, _, future in self.sent[since:])

    def acknowledged(self) -> dict[tuple[int, int], bytes]:
        """(partition, offset) -> value of every send acknowledged (after ``stop``). Two
        sends acknowledged at one offset (one of them by a fenced leader: that record is
        lost) fail here: kept as one entry, the loss was invisible (found by an audit)."""
        acked: dict[tuple[int, int], bytes] = {}
        for partition, value, future in self.sent:
            try:
                metadata = future.result(0)
            except Exception:  # failed or not answered: not acknowledged
                continue
            key = (partition, metadata.offset)
            assert key not in acked, f"{acked[key]!r} and {value!r} both acknowledged at {key}"
            acked[key] = value
        return acked

    def _send(self) -> None:
        i = 0
        while not self._stop.is_set():
            partition = i % self.partitions
            value = f"{partition}:{i // self.partitions:08d}".encode()
            try:
                future = self.producer.send(self.topic, value, partition=partition)
                self.sent.append((partition, value, future))
            except TidelogError:
                time.sleep(0.05)  # the buffer is full or the producer is failing: slower
            i += 1
            if i % 32 == 0:
                time.sleep(0.005)


def read_everything(address: str, topic: str, expected: int) -> list[Any]:
    """Every record of ``topic`` (waiting up to a minute for ``expected`` of them, then two
    seconds more so that duplicates beyond the count show)."""
    with tidelog.Consumer(address, auto_offset_reset="earliest") as consumer:
        consumer.subscribe([topic])
        got: list[Any] = []
        deadline = time.monotonic() + 60
        while len(got) < expected and time.monotonic() < deadline:
            got += consumer.poll(max_records=10_000, timeout_ms=500)
        end = time.monotonic() + 2
        while time.monotonic() < end:
            got += consumer.poll(max_records=10_000, timeout_ms=200)
        return got


def commit_some(address: str, topic: str, group: str, records: int) -> None:
    """A member of ``group`` reads about ``records`` records of ``topic`` and commits."""
    with tidelog.Consumer(
        address, group_id=group, auto_offset_reset="earliest", enable_auto_commit=False
    ) as consumer:
        consumer.subscribe([topic])
        n = 0
        deadline = time.monotonic() + 30
        while n < records and time.monotonic() < deadline:
            n += len(consumer.poll(max_records=500, timeout_ms=500))
        consumer.commit()
