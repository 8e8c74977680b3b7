"""Appends waiting for their partition to have a leader, holding no worker thread.

A partition with no leader (every replica down, or between two leaders for the moment the
controller takes to elect one) had its appends wait on a worker of one shared pool for up
to their whole timeout: appends to offline partitions filled that pool, and an append to a
partition merely between leaders queued behind them, was answered after its own deadline,
and failed although its new leader was known at once (found by an audit). Here they wait
in a list; one thread looks at them again at each metadata change (and every
``SWEEP_INTERVAL_S``), hands each to its leader's pool as soon as the metadata names one,
and answers the others at their deadline.

Invariants: every waiting append is answered exactly once (started on a pool, answered
at its deadline, or failed at ``close``), and its ``refused`` callback runs when it never
started (the acks=0 slot it holds is given back). At most ``limit`` wait at once; beyond
that ``wait`` declines and the caller keeps the old way (a worker of the leaderless pool).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Final

from services.gateway.metadata_cache import MetadataCache
from services.status import to_error_proto
from tidelog.errors import LeaderNotAvailableError, TidelogError, UnknownServerError
from tidelog.logging import get_logger
from tidelog.v1 import gateway_pb2

_log = get_logger(component="gateway.leader_waits")

SWEEP_INTERVAL_S: Final = 0.1
"""Longest wait between two looks at the waiting appends (a deadline is kept that well)."""
MAX_WAITING: Final = 10_000
"""Appends waiting for a leader at once, by default (their bytes are in the byte budget)."""

Result = gateway_pb2.ProducePartitionResult


def failed_result(data: gateway_pb2.ProducePartitionData, error: TidelogError) -> Result:
    return Result(
        topic=data.topic,
        partition=data.partition,
        error=to_error_proto(error),
        base_offset=-1,
        last_offset=-1,
        log_append_time_ms=-1,
        log_start_offset=-1,
    )


@dataclass(eq=False)
class _Waiting:
    data: gateway_pb2.ProducePartitionData
    deadline: float
    start: Callable[[], Future[Result] | None]  # on the leader's pool now; None: stopping
    refused: Callable[[], None] | None
    future: Future[Result]


class LeaderWaits:
    """The waiting appends and the thread that looks at them. Thread-safe."""

    def __init__(self, cache: MetadataCache, limit: int = MAX_WAITING) -> None:
        self._cache = cache
        self._limit = limit
        self._lock = threading.Lock()
        self._waiting: dict[_Waiting, None] = {}  # in arrival order; by identity
        self._thread: threading.Thread | None = None
        self._closed = False

    def wait(
        self,
        data: gateway_pb2.ProducePartitionData,
        deadline: float,
        start: Callable[[], Future[Result] | None],
        refused: Callable[[], None] | None,
    ) -> Future[Result] | None:
        """The future of an append started by ``start`` once the partition has a leader,
        or answered at ``deadline``; None when too many wait already (or closed)."""
        waiting = _Waiting(data, deadline, start, refused, Future())
        with self._lock:
            if self._closed or len(self._waiting) >= self._limit:
                return None
            self._waiting[waiting] = None
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="gateway-leader-waits", daemon=True
                )
                self._thread.start()
        self._sweep_one(waiting, time.monotonic())  # a leader named meanwhile: go now
        return waiting.future

    def waiting(self) -> int:
        """How many appends wait now (observability and tests)."""
        with self._lock:
            return len(self._waiting)

    def close(self) -> None:
        """Fail every waiting append (the gateway is stopping); no more are taken."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting), {}
        stopping = UnknownServerError("the gateway is stopping; nothing was written")
        for item in waiting:
            self._answer(item, failed_result(item.data, stopping))

    def _run(self) -> None:
        version = self._cache.version
        while True:
            with self._lock:
                if self._closed or not self._waiting:
                    self._thread = None
                    return
                soonest = min(item.deadline for item in self._waiting)
            now = time.monotonic()
            version = self._cache.wait_for_change(
                version, min(SWEEP_INTERVAL_S, max(0.0, soonest - now))
            )
            with self._lock:
                items = list(self._waiting)
            now = time.monotonic()
            for item in items:
                try:
                    self._sweep_one(item, now)
                except Exception:  # a bug: the others still get their answers
                    _log.exception("leader_wait_failed", topic=item.data.topic)
                    self._take(item)
                    self._answer(item, failed_result(item.data, UnknownServerError("bug")))

    def _sweep_one(self, item: _Waiting, now: float) -> None:
        """Start ``item`` if its partition has a leader now; answer it if its deadline
        passed (or its topic is gone); else leave it waiting."""
        try:
            self._cache.leader(item.data.topic, item.data.partition)
        except TidelogError as exc:
            # No leader yet: wait on. No such topic (any more) is final at once.
            if now < item.deadline and isinstance(exc, LeaderNotAvailableError):
                return
            if self._take(item):
                self._answer(item, failed_result(item.data, exc))
            return
        if not self._take(item):
            return  # another sweep took it
        inner = item.start()
        if inner is None:
            stopping = UnknownServerError("the gateway is stopping; nothing was written")
            self._answer(item, failed_result(item.data, stopping))
            return

        def passed_on(done: Future[Result]) -> None:
            if done.cancelled():  # the pool was shut down before it ran
                stopping = UnknownServerError("the gateway is stopping; nothing was written")
                self._answer(item, failed_result(item.data, stopping))
            else:
                item.future.set_result(done.result())

        inner.add_done_callback(passed_on)

    def _take(self, item: _Waiting) -> bool:
        """Remove ``item`` from the waiting list; False if it was not there any more."""
        with self._lock:
            return self._waiting.pop(item, False) is None

    @staticmethod
    def _answer(item: _Waiting, result: Result) -> None:
        """Answer an append that never started: its ``refused`` first (its slot back)."""
        if item.refused is not None:
            item.refused()
        item.future.set_result(result)
