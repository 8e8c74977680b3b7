"""Produce through the gateway: validate a request, route each partition's batches to its
leader (bytes forwarded unchanged), gather per-partition results.

The gateway never decodes records: the leader validates every batch (CRC, size, producer
sequence). What the gateway checks is the request as a whole — acks, timeout, total
size, duplicate partitions — and that each partition exists; a request that fails those
checks changes nothing anywhere.

Grouping: a request's acks=1/all partitions that share a leader (at least
``min_group_partitions`` of them, each with no append running) go to it in one AppendMany
(Kafka's produce request carries every partition it has for a broker), on one worker
thread; a partition that call cannot settle (its leader moved, the call failed) is then
appended alone, re-routed and retried as a single-partition request always is.

Order: within one ProduceStream, the batches for one partition are appended in the order
the requests arrived (each waits for the previous one of its partition to be answered;
only partitions with none running are grouped); different partitions proceed
concurrently. acks=0 answers at once and appends in the background, bounded by
``max_background_appends`` per leader broker (a full queue makes the request wait, which
is the backpressure an acks=0 client gets; a stopped broker fills only its own) and, for
memory, by the byte budget every request is held in until its appends are over.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final, TypeVar

import grpc
import structlog

from services.gateway.byte_budget import ByteBudget
from services.gateway.leader_waits import LeaderWaits
from services.gateway.leader_waits import failed_result as _failed
from services.gateway.metadata_cache import Leader
from services.gateway.router import DEADLINE_MARGIN_S, Router
from services.status import error_from_proto, to_error_proto
from tidelog import tracing
from tidelog.errors import (
    REROUTE_CODES,
    InvalidRequestError,
    InvalidRequiredAcksError,
    LeaderNotAvailableError,
    NotLeaderOrFollowerError,
    RecordListTooLargeError,
    RequestTimedOutError,
    TidelogError,
    UnknownServerError,
)
from tidelog.formats import MAX_CLIENT_ID_CHARS, MAX_PARTITIONS_PER_REQUEST
from tidelog.v1 import common_pb2, gateway_pb2, storage_pb2, storage_pb2_grpc
from tidelog.wire import append_request_parts, encode_append_many_request

_log = structlog.get_logger("tidelog.gateway.produce")

T = TypeVar("T")

DEFAULT_TIMEOUT_MS: Final = 30_000
"""Kafka's request.timeout.ms: the default end-to-end budget of a produce request."""
MAX_TIMEOUT_MS: Final = 300_000
"""A larger timeout_ms is clamped to this, as the storage nodes clamp an acks=all wait:
refusing it failed every request of a client configured with a long request timeout."""
LEADER_WATCH_S: Final = 0.5
"""How often an append waiting for its leader looks whether the metadata names another."""
MIN_GROUP_PARTITIONS: Final = 4
"""The default of ``ProduceLimits.min_group_partitions``: the fewest partitions of one
leader that ``submit_all`` sends in one AppendMany. Fewer go alone: the calls a small
group saves are few, and its appends run one after another on the broker and answer
together. Measured (BENCHMARKS.md, "Scale: where the time goes"): groups of 2 (the
half-rate latency probe, 6 partitions on 3 leaders) raised its e2e p99 from ~39 to ~45 ms
(three interleaved runs each); 1,000 partitions per leader (bench.scale) were
acknowledged 4x faster."""
NO_LEADER_POOL: Final = -1
"""The worker pool of appends whose partition has no leader known (never dropped)."""
SUBMIT_ATTEMPTS: Final = 8
"""Pools a submit tries before giving up: one is dropped (``retain_brokers``) only when its
broker has left the metadata, and the next lookup then finds another leader's pool or the
no-leader pool, so more than two attempts means the gateway is stopping."""
ACKS_VALUES: Final = frozenset(
    {common_pb2.ACKS_UNSPECIFIED, common_pb2.NONE_ACKS, common_pb2.LEADER, common_pb2.ALL}
)

IN_FLIGHT_WAIT_S: Final = 0.5
"""How often a ProduceStream held at its in-flight limit checks that its client is still there."""


MIN_ACKS0_APPEND_S: Final = 5.0
"""The least time an accepted acks=0 append has to reach its leader (``submit``)."""


MAX_BACKGROUND_APPENDS: Final = 1024
"""acks=0 appends answered but not yet written, per leader broker (``ProduceLimits``)."""


@dataclass(frozen=True, slots=True)
class ProduceLimits:
    """Bounds on what one produce request may ask of the gateway."""

    max_request_bytes: int = 100 * 1024 * 1024  # sum of record bytes in one request
    # acks=0 appends queued but not yet answered, per leader broker (kept with its worker
    # pool): one bound for the gateway let appends waiting on one stopped broker take
    # every slot, and acks=0 to healthy brokers then waited out its timeout and failed.
    # Their memory is bounded for all brokers at once by ``queued_max_request_bytes``.
    max_background_appends: int = MAX_BACKGROUND_APPENDS
    # Threads that wait on one leader broker (acks=all waits hold one each); each broker
    # has a pool of its own, so that a stopped or dead broker can fill only its own.
    workers: int = 64
    # Record bytes of all requests held at once (``byte_budget``); node.py sizes it.
    queued_max_request_bytes: int = 256 * 1024 * 1024
    # Partitions of one leader in one request sent together in an AppendMany (fewer go
    # one Append each); see MIN_GROUP_PARTITIONS.
    min_group_partitions: int = MIN_GROUP_PARTITIONS


def record_bytes(request: gateway_pb2.ProduceRequest) -> int:
    """The record bytes a request carries (what ``max_request_bytes`` and the budget
    count)."""
    return sum(len(data.records) for data in request.partitions)


def check_client_id(client_id: str) -> None:
    """Refuse a client id longer than MAX_CLIENT_ID_CHARS (one of 4 million characters was
    taken, and InitProducerId wrote it to the log; found by an audit)."""
    if len(client_id) > MAX_CLIENT_ID_CHARS:
        raise InvalidRequestError(
            f"client id of {len(client_id)} characters; the limit is {MAX_CLIENT_ID_CHARS}"
        )


def validate(request: gateway_pb2.ProduceRequest, limits: ProduceLimits) -> float:
    """Check the request as a whole; returns its deadline (time.monotonic based)."""
    if request.acks not in ACKS_VALUES:
        raise InvalidRequiredAcksError(
            f"acks value {request.acks} is not one of NONE_ACKS (0), LEADER (1) or ALL"
        )
    if request.timeout_ms < 0:
        raise InvalidRequestError(f"timeout_ms {request.timeout_ms} is negative (0 = default)")
    check_client_id(request.client_id)
    if len(request.partitions) > MAX_PARTITIONS_PER_REQUEST:
        raise InvalidRequestError(
            f"{len(request.partitions)} partitions in one request; the limit is "
            f"{MAX_PARTITIONS_PER_REQUEST}"
        )
    seen: set[tuple[str, int]] = set()
    for data in request.partitions:
        key = (data.topic, data.partition)
        if key in seen:
            raise InvalidRequestError(
                f"partition {data.topic}-{data.partition} appears twice in one request; "
                "put all its batches in one entry"
            )
        seen.add(key)
    total = record_bytes(request)
    if total > limits.max_request_bytes:
        raise RecordListTooLargeError(
            f"the request carries {total} bytes of records; this gateway accepts at most "
            f"{limits.max_request_bytes} (--max-request-bytes)"
        )
    timeout_ms = min(request.timeout_ms or DEFAULT_TIMEOUT_MS, MAX_TIMEOUT_MS)
    return time.monotonic() + timeout_ms / 1000


def _stopping(data: gateway_pb2.ProducePartitionData) -> gateway_pb2.ProducePartitionResult:
    return _failed(data, UnknownServerError("the gateway is stopping; nothing was written"))


def _appended(
    data: gateway_pb2.ProducePartitionData, response: storage_pb2.AppendResponse
) -> gateway_pb2.ProducePartitionResult:
    return gateway_pb2.ProducePartitionResult(
        topic=data.topic,
        partition=data.partition,
        error=to_error_proto(None),
        base_offset=response.base_offset,
        last_offset=response.last_offset,
        log_append_time_ms=response.log_append_time_ms,
        log_start_offset=response.log_start_offset,
    )


def _append_parts(
    data: gateway_pb2.ProducePartitionData, leader: Leader, acks: int, wait_ms: int
) -> list[bytes | bytearray | memoryview]:
    """The encoded ``AppendRequest`` (``tidelog.wire`` parts) of ``data`` for ``leader``."""
    return append_request_parts(
        topic=data.topic,
        partition=data.partition,
        batches=(data.records,),
        acks=acks,
        timeout_ms=wait_ms,
        current_leader_epoch=leader.leader_epoch,
        topic_id=data.topic_id,
    )


def _pass_on(
    future: Future[gateway_pb2.ProducePartitionResult],
    data: gateway_pb2.ProducePartitionData,
    inner: Future[gateway_pb2.ProducePartitionResult],
) -> None:
    """Complete ``future`` with ``inner``'s result (a stopping failure if cancelled)."""
    future.set_result(_stopping(data) if inner.cancelled() else inner.result())


@dataclass(frozen=True, slots=True)
class _Pool:
    """What the appends to one leader broker share: its worker threads and its bound on
    acks=0 appends (``ProduceLimits.max_background_appends``)."""

    broker_id: int  # NO_LEADER_POOL: partitions with no leader known
    executor: ThreadPoolExecutor
    background: threading.BoundedSemaphore


class ProduceHandler:
    """Runs produce requests; owns the worker threads. Thread-safe.

    Invariant: ``_pools`` holds a pool only for a broker id the metadata listed when
    it was made (a partition's leader must be registered) or for ``NO_LEADER_POOL``;
    ``retain_brokers`` (the gateway's sweeper) drops the pools of ids no longer listed, so
    retired and replaced broker ids do not each keep up to ``workers`` threads for ever.
    A dropped pool runs what was queued on it to the end; a submit that finds its pool
    dropped after looking it up tries the pool the metadata names now.
    """

    def __init__(self, router: Router, limits: ProduceLimits) -> None:
        self._router = router
        self.limits = limits
        # Worker pools by leader broker id (NO_LEADER_POOL: no leader known), started as
        # needed. One pool for all used to let one stopped broker take every worker with
        # appends waiting out their deadlines there, and requests for partitions on
        # healthy brokers then queued behind them until theirs had passed.
        self._pools: dict[int, _Pool] = {}
        self._pools_lock = threading.Lock()
        self._closed = False
        self.budget = ByteBudget(limits.queued_max_request_bytes)
        # Appends whose partition has no leader wait there, holding no worker.
        self.leader_waits = LeaderWaits(router.cache)
        self._counts_lock = threading.Lock()
        self._append_many_calls = 0  # AppendMany calls made (observability, tests)
        self._group_partitions_alone = 0  # of their partitions, those appended alone after

    def close(self) -> None:
        with self._pools_lock:
            self._closed = True
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            pool.executor.shutdown(wait=False, cancel_futures=True)
        self.leader_waits.close()

    def group_counts(self) -> tuple[int, int]:
        """(AppendMany calls made, partitions of a group that were appended alone after
        it: their leader moved or the call failed)."""
        with self._counts_lock:
            return self._append_many_calls, self._group_partitions_alone

    def pool_broker_ids(self) -> list[int]:
        """The broker ids that have a worker pool now (observability and tests)."""
        with self._pools_lock:
            return sorted(self._pools)

    def retain_brokers(self, broker_ids: Collection[int]) -> list[int]:
        """Drop the worker pools of broker ids not in ``broker_ids``; the ids dropped.

        A dropped pool is shut down without waiting: appends queued or running on it
        finish (each answers, or fails with its deadline or a re-route) and its threads
        end once it is idle. A partition led again by such an id gets a fresh pool.
        """
        with self._pools_lock:
            gone = [b for b in self._pools if b != NO_LEADER_POOL and b not in broker_ids]
            dropped = [self._pools.pop(b) for b in gone]
        for pool in dropped:
            pool.executor.shutdown(wait=False)
        if gone:
            _log.info("produce_pools_dropped", brokers=sorted(gone))
        return gone

    def _pool_for(self, data: gateway_pb2.ProducePartitionData) -> _Pool | None:
        """The pool of the partition's leader as the cache knows it now (None once
        closed). (A leader that moves before the append runs costs nothing but the pool
        choice.)"""
        try:
            broker_id = self._router.cache.leader(data.topic, data.partition).broker.broker_id
        except TidelogError:
            broker_id = NO_LEADER_POOL
        with self._pools_lock:
            if self._closed:
                return None
            pool = self._pools.get(broker_id)
            if pool is None:
                pool = self._pools[broker_id] = _Pool(
                    broker_id=broker_id,
                    executor=ThreadPoolExecutor(
                        max_workers=self.limits.workers,
                        thread_name_prefix=f"gateway-produce-{broker_id}",
                    ),
                    background=threading.BoundedSemaphore(self.limits.max_background_appends),
                )
            return pool

    def _on_leader_pool(
        self, data: gateway_pb2.ProducePartitionData, fn: Callable[[], T]
    ) -> Future[T] | None:
        """``fn`` on the pool of the partition's leader; None when no pool takes it (the
        gateway is stopping)."""
        for _ in range(SUBMIT_ATTEMPTS):
            pool = self._pool_for(data)
            if pool is None:
                break
            try:
                return pool.executor.submit(fn)
            except RuntimeError:
                # Shut down since the lookup: dropped by retain_brokers (its broker left
                # the metadata; the next lookup finds whom the metadata names now), or
                # the gateway is closing (the next lookup says so).
                continue
        return None

    def _start(
        self,
        data: gateway_pb2.ProducePartitionData,
        fn: Callable[[], gateway_pb2.ProducePartitionResult],
        refused: Callable[[], None] | None,
        deadline: float,
    ) -> Future[gateway_pb2.ProducePartitionResult]:
        """``fn`` on the pool of the partition's leader; never raises. When no pool takes
        it (the gateway is stopping), ``refused`` runs and the future holds the failure.
        A partition without a leader now waits for one in ``leader_waits`` (no worker
        held), answered there by ``deadline`` if none comes."""
        if self._leaderless(data):
            waiting = self.leader_waits.wait(
                data, deadline, partial(self._on_leader_pool, data, fn), refused
            )
            if waiting is not None:
                return waiting
        future = self._on_leader_pool(data, fn)
        if future is not None:
            return future
        if refused is not None:
            refused()
        return Submitted.done(_stopping(data)).result

    def _leaderless(self, data: gateway_pb2.ProducePartitionData) -> bool:
        try:
            self._router.cache.leader(data.topic, data.partition)
        except LeaderNotAvailableError:
            return True
        except TidelogError:
            return False  # no such partition: the append says so at once
        return False

    # --- one partition ----------------------------------------------------------------------

    def append(
        self, data: gateway_pb2.ProducePartitionData, acks: common_pb2.Acks, deadline: float
    ) -> gateway_pb2.ProducePartitionResult:
        """Append one partition's batches on its leader; never raises."""

        def call(
            stub: storage_pb2_grpc.StorageStub, leader: Leader, timeout_s: float
        ) -> storage_pb2.AppendResponse:
            # The leader gives up on acks=all waiting a little before our own deadline, so
            # its precise answer (REQUEST_TIMED_OUT) arrives rather than a bare deadline.
            wait_ms = max(1, int((timeout_s - 2 * DEADLINE_MARGIN_S) * 1000))
            del stub  # the request goes out encoded by hand (tidelog.wire)
            append = self._router.channels.storage_append_encoded(leader.broker)
            if tracing.ENABLED:
                tracing.event("g_ap_in", data.partition)
            pending = append.future(
                b"".join(_append_parts(data, leader, acks, wait_ms)), timeout=timeout_s
            )
            response: storage_pb2.AppendResponse = self._answer_unless_moved(pending, data, leader)
            if tracing.ENABLED:
                tracing.event(
                    "g_ap_out", data.partition, response.base_offset, response.last_offset
                )
            return response

        try:
            response = self._router.call_leader(data.topic, data.partition, deadline, call)
        except TidelogError as exc:
            return _failed(data, exc)
        except Exception as exc:  # a bug: answer for this partition, keep the rest going
            _log.exception("append_failed", topic=data.topic, partition=data.partition)
            return _failed(data, UnknownServerError(f"{type(exc).__name__}: {exc}"))
        return _appended(data, response)

    # --- the partitions of one leader ---------------------------------------------------

    def submit_all(
        self,
        partitions: Sequence[gateway_pb2.ProducePartitionData],
        acks: common_pb2.Acks,
        deadline: float,
        afters: Sequence[Future[gateway_pb2.ProducePartitionResult] | None] | None = None,
        *,
        append_deadline: float | None = None,
    ) -> list[Submitted]:
        """``submit`` for each partition, ``afters[i]`` being partition i's; but the
        acks=1/all appends of partitions that share a leader and have no append of theirs
        still running (in ``afters``) go in one AppendMany (Kafka's produce request names
        every partition it has for a broker): one call and one worker thread for the
        group, where one Append each held a thread and paid a call each; at least
        ``limits.min_group_partitions`` of them. A partition with an append running goes alone
        once it is done, as before: a group that waited for the slowest of its
        partitions' previous appends held up the others. A partition the group call
        cannot settle (its leader moved, the call failed) is appended alone, with the
        re-routing and retries of ``append``."""
        wanted = list(afters) if afters is not None else [None] * len(partitions)
        if acks == common_pb2.NONE_ACKS or len(partitions) < 2:
            return [
                self.submit(d, acks, deadline, a, append_deadline=append_deadline)
                for d, a in zip(partitions, wanted, strict=True)
            ]
        submitted: dict[int, Submitted] = {}
        by_leader: dict[int, list[int]] = {}
        for i, data in enumerate(partitions):
            after = wanted[i]
            leader = None
            if after is None or after.done():
                # (Unknown partitions are answered by ``submit``; leaderless ones wait.)
                with contextlib.suppress(TidelogError):
                    leader = self._router.cache.leader(data.topic, data.partition)
            if leader is None:
                submitted[i] = self.submit(data, acks, deadline, after)
            else:
                by_leader.setdefault(leader.broker.broker_id, []).append(i)
        for indexes in by_leader.values():
            if len(indexes) < self.limits.min_group_partitions:
                for i in indexes:
                    submitted[i] = self.submit(partitions[i], acks, deadline, wanted[i])
                continue
            futures = self._submit_group([partitions[i] for i in indexes], acks, deadline)
            for i, future in zip(indexes, futures, strict=True):
                submitted[i] = Submitted(result=future, tail=future)
        return [submitted[i] for i in range(len(partitions))]

    def _submit_group(
        self,
        group: list[gateway_pb2.ProducePartitionData],
        acks: common_pb2.Acks,
        deadline: float,
    ) -> list[Future[gateway_pb2.ProducePartitionResult]]:
        """One future per partition of ``group``, which never fail."""
        futures: list[Future[gateway_pb2.ProducePartitionResult]] = [Future() for _ in group]

        def settle(results: Sequence[gateway_pb2.ProducePartitionResult | None]) -> None:
            with self._counts_lock:
                self._group_partitions_alone += sum(result is None for result in results)
            for data, future, result in zip(group, futures, results, strict=True):
                if result is not None:
                    future.set_result(result)
                    continue
                alone = self._start(
                    data, partial(self.append, data, acks, deadline), None, deadline
                )
                alone.add_done_callback(partial(_pass_on, future, data))

        def run() -> None:
            try:
                results = self._append_group(group, acks, deadline)
            except Exception:  # a bug: each partition alone still gets its answer
                _log.exception("append_group_failed", partitions=len(group))
                results = [None] * len(group)
            settle(results)

        def stopped(task: Future[None]) -> None:
            if task.cancelled():  # close() cancelled it before it ran
                for data, future in zip(group, futures, strict=True):
                    future.set_result(_stopping(data))

        task = self._on_leader_pool(group[0], run)
        if task is None:
            for data, future in zip(group, futures, strict=True):
                future.set_result(_stopping(data))
        else:
            task.add_done_callback(stopped)
        return futures

    def _append_group(
        self,
        group: list[gateway_pb2.ProducePartitionData],
        acks: common_pb2.Acks,
        deadline: float,
    ) -> list[gateway_pb2.ProducePartitionResult | None]:
        """One AppendMany of ``group`` on the leader they share; each partition's result,
        or None for one to append alone (its leader moved: the broker answered it
        NOT_LEADER_OR_FOLLOWER, or every partition moved while it did not answer; or the
        call as a whole failed: the broker unreachable or too old to know AppendMany, the
        deadline passed)."""
        alone: list[gateway_pb2.ProducePartitionResult | None] = [None] * len(group)
        remaining_s = deadline - time.monotonic()
        if remaining_s <= DEADLINE_MARGIN_S:
            return alone  # each then answers its own timeout
        try:
            leaders = [self._router.cache.leader(d.topic, d.partition) for d in group]
        except TidelogError:
            return alone
        broker = leaders[0].broker
        if any(leader.broker.broker_id != broker.broker_id for leader in leaders):
            return alone
        # As in ``append``: the leader gives up a little before our own deadline.
        wait_ms = max(1, int((remaining_s - 2 * DEADLINE_MARGIN_S) * 1000))
        request = encode_append_many_request(
            [
                _append_parts(data, leader, acks, wait_ms)
                for data, leader in zip(group, leaders, strict=True)
            ]
        )
        if tracing.ENABLED:
            for data in group:
                tracing.event("g_ap_in", data.partition)
        with self._counts_lock:
            self._append_many_calls += 1
        try:
            pending = self._router.channels.storage_append_many_encoded(broker).future(
                request, timeout=remaining_s
            )
            response, moved = self._await_unless_moved(
                pending, list(zip(group, leaders, strict=True))
            )
        except grpc.RpcError as exc:
            _log.debug("append_group_call_failed", broker=broker.broker_id, error=str(exc))
            return alone
        if moved is not None or len(response.responses) != len(group):
            return alone
        results: list[gateway_pb2.ProducePartitionResult | None] = []
        for data, answer in zip(group, response.responses, strict=True):
            if tracing.ENABLED:
                tracing.event("g_ap_out", data.partition, answer.base_offset, answer.last_offset)
            error = error_from_proto(answer.error)
            if error is None:
                results.append(_appended(data, answer))
            elif error.code in REROUTE_CODES:
                results.append(None)
            else:
                results.append(_failed(data, error))
        return results

    def _answer_unless_moved(
        self, pending: Any, data: gateway_pb2.ProducePartitionData, leader: Leader
    ) -> storage_pb2.AppendResponse:
        """The leader's answer; but when the metadata names another leader (or epoch) for
        the partition while it has not answered - it was stopped or cut off, and replaced -
        the call is given up and NOT_LEADER_OR_FOLLOWER raised, which the router re-routes
        to the new leader. Waiting out the deadline there used to cost a stuck request its
        whole timeout (30 s by default). As with any retry, an idempotent producer's batch
        is recognised by the new leader if it had been replicated; others get Kafka's
        at-least-once."""
        response, now = self._await_unless_moved(pending, [(data, leader)])
        if now is None:
            assert isinstance(response, storage_pb2.AppendResponse)
            return response
        raise NotLeaderOrFollowerError(
            f"broker {leader.broker.broker_id} did not answer for "
            f"{data.topic}-{data.partition} before broker {now.broker.broker_id} "
            f"became its leader (epoch {now.leader_epoch})"
        )

    def _await_unless_moved(
        self, pending: Any, placed: Sequence[tuple[gateway_pb2.ProducePartitionData, Leader]]
    ) -> tuple[Any, Leader | None]:
        """``(pending's answer, None)``; or, once the metadata names another leader or
        epoch for one of the ``placed`` partitions and leads none of them as placed any
        more while the call has not answered, ``(None, such a new leader)`` with the call
        cancelled.

        While the broker still leads one of them the call is not given up: it is alive
        (or not known dead) and answers each partition, NOT_LEADER_OR_FOLLOWER for one
        that moved (a partition leaving the leader role fails its acks=all waiters so),
        which alone is then re-routed. Cancelling the whole AppendMany when one of its
        partitions moved appended again, alone, the others the old leader had already
        written: a non-idempotent producer's batches landed twice. A partition with no
        leader right now neither moved nor holds the call: its leader may still answer."""
        while True:
            try:
                return pending.result(timeout=LEADER_WATCH_S), None
            except grpc.FutureTimeoutError:
                pass
            moved: list[Leader] = []
            for data, leader in placed:
                try:
                    now = self._router.cache.leader(data.topic, data.partition)
                except TidelogError:
                    continue  # no leader right now: this one may still answer
                if (now.broker.broker_id, now.leader_epoch) == (
                    leader.broker.broker_id,
                    leader.leader_epoch,
                ):
                    moved.clear()
                    break  # one it still leads: the call will be answered
                moved.append(now)
            if moved:
                pending.cancel()
                return None, moved[0]

    def _known(self, data: gateway_pb2.ProducePartitionData) -> TidelogError | None:
        try:
            self._router.cache.read(lambda view: view.check_partition(data.topic, data.partition))
        except TidelogError as exc:
            return exc
        return None

    # --- whole requests ---------------------------------------------------------------------

    def _no_room(self, request: gateway_pb2.ProduceRequest) -> gateway_pb2.ProduceResponse:
        """The answer to a request that found no room in the budget before its deadline
        (or too many bytes waiting for room already): nothing was written, and the
        client's retry may find room."""
        error = RequestTimedOutError(
            f"the gateway holds {self.budget.limit_bytes} bytes of other produce requests "
            "(--queued-max-request-bytes) and as many waiting for room, or held them until "
            "this one's timeout; nothing was written"
        )
        return gateway_pb2.ProduceResponse(
            correlation_id=request.correlation_id,
            partitions=[_failed(data, error) for data in request.partitions],
        )

    def produce(
        self, request: gateway_pb2.ProduceRequest, client_deadline: float | None = None
    ) -> gateway_pb2.ProduceResponse:
        """A unary Produce; raises TidelogError when the request as a whole is bad.

        ``client_deadline`` (monotonic): when the caller stops waiting, if before the
        request's ``timeout_ms``. Its appends end by then: one kept on for ``timeout_ms``
        held a worker, a concurrency slot and its bytes long after the client had gone,
        and could write after the client was told DEADLINE_EXCEEDED, which a retrying
        client then wrote twice (found by an audit)."""
        request_deadline = deadline = validate(request, self.limits)
        if client_deadline is not None:
            deadline = min(deadline, client_deadline)
        size = record_bytes(request)
        if not self.budget.acquire(size, deadline):
            return self._no_room(request)
        try:
            response, submitted = self._produce_held(request, deadline, request_deadline)
        except BaseException:
            self.budget.release(size)
            raise
        self._release_when_appended(size, submitted)
        return response

    def _release_when_appended(self, size: int, submitted: list[Submitted]) -> None:
        """Give ``size`` bytes back to the budget once every append is over: for acks=0,
        after the answer (the records are held until the background append ends; they
        used to be given back at the answer, and acks=0 requests to a stopped leader then
        held gigabytes the budget did not count)."""
        remaining = [len(submitted)]
        lock = threading.Lock()

        def one_over(_: Future[gateway_pb2.ProducePartitionResult]) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            self.budget.release(size)

        if not submitted:
            self.budget.release(size)
        for item in submitted:
            item.tail.add_done_callback(one_over)

    def _produce_held(
        self, request: gateway_pb2.ProduceRequest, deadline: float, request_deadline: float
    ) -> tuple[gateway_pb2.ProduceResponse, list[Submitted]]:
        if len(request.partitions) == 1 and request.acks != common_pb2.NONE_ACKS:
            # The common case needs no hop to a worker thread.
            data = request.partitions[0]
            unknown = self._known(data)
            result = (
                _failed(data, unknown) if unknown else self.append(data, request.acks, deadline)
            )
            response = gateway_pb2.ProduceResponse(
                correlation_id=request.correlation_id, partitions=[result]
            )
            return response, []
        submitted = self.submit_all(
            request.partitions, request.acks, deadline, append_deadline=request_deadline
        )
        response = gateway_pb2.ProduceResponse(
            correlation_id=request.correlation_id,
            partitions=[s.result.result() for s in submitted],
        )
        return response, submitted

    def submit(
        self,
        data: gateway_pb2.ProducePartitionData,
        acks: common_pb2.Acks,
        deadline: float,
        after: Future[gateway_pb2.ProducePartitionResult] | None = None,
        *,
        append_deadline: float | None = None,
    ) -> Submitted:
        """Start one partition's append once ``after`` (the tail of the previous append of
        the same partition on the same stream) is done. The futures never fail.

        ``deadline`` bounds the waits before the answer; an acks=0 append, answered at
        once, runs in the background until ``append_deadline`` (default ``deadline``): the
        request's own timeout, not its client's deadline, which is past once the answer
        is given (records answered "accepted" to a client with a deadline of 100 ms were
        never written; found by an audit)."""
        append_deadline = deadline if append_deadline is None else append_deadline
        unknown = self._known(data)
        if unknown is not None:
            return Submitted.done(_failed(data, unknown))
        if acks != common_pb2.NONE_ACKS:
            future = self._chain(
                data, after, lambda: self.append(data, acks, deadline), deadline=deadline
            )
            return Submitted(result=future, tail=future)
        # acks=0: answer now; the append runs in the background, bounded per leader
        # broker (the one the metadata names now: the slot stays taken if it moves). It
        # has MIN_ACKS0_APPEND_S at least, from when it is accepted and again from when
        # it starts: with what was left of a short or spent timeout (timeout_ms <= 50, or
        # a wait for budget room) the router gave up before calling the leader, and the
        # records answered "accepted" were never written (found by an audit).
        append_deadline = max(append_deadline, time.monotonic() + MIN_ACKS0_APPEND_S)
        pool = self._pool_for(data)
        if pool is None:
            return Submitted.done(_stopping(data))
        background = pool.background
        if not background.acquire(timeout=max(0.0, deadline - time.monotonic())):
            whose = (
                "partitions with no leader"
                if pool.broker_id == NO_LEADER_POOL
                else f"broker {pool.broker_id}"
            )
            return Submitted.done(
                _failed(
                    data,
                    RequestTimedOutError(
                        f"too many acks=0 appends are queued for {whose} (at most "
                        f"{self.limits.max_background_appends} per leader broker) until this "
                        "request's timeout; nothing was written"
                    ),
                )
            )

        def run() -> gateway_pb2.ProducePartitionResult:
            try:
                until = max(append_deadline, time.monotonic() + MIN_ACKS0_APPEND_S)
                result = self.append(data, common_pb2.NONE_ACKS, until)
                if result.error.code != common_pb2.NONE:
                    _log.warning(
                        "acks0_append_failed",
                        topic=data.topic,
                        partition=data.partition,
                        error=result.error.message,
                    )
                return result
            finally:
                background.release()

        tail = self._chain(data, after, run, refused=background.release, deadline=append_deadline)
        accepted = Submitted.done(
            gateway_pb2.ProducePartitionResult(
                topic=data.topic,
                partition=data.partition,
                error=to_error_proto(None),
                base_offset=-1,
                last_offset=-1,
                log_append_time_ms=-1,
                log_start_offset=-1,
            )
        )
        return Submitted(result=accepted.result, tail=tail)

    def _chain(
        self,
        data: gateway_pb2.ProducePartitionData,
        after: Future[gateway_pb2.ProducePartitionResult] | None,
        fn: Callable[[], gateway_pb2.ProducePartitionResult],
        refused: Callable[[], None] | None = None,
        *,
        deadline: float,
    ) -> Future[gateway_pb2.ProducePartitionResult]:
        """``fn`` on a worker once ``after`` is done; the pool is chosen when it starts
        (the one it would have had at submit may have been dropped since). The future
        returned is never cancelled: ``close()`` cancelling a queued pool future made the
        stream's answer wait for ever on its CancelledError, and the gateway never exited
        (found by an audit); it completes as "the gateway is stopping" instead."""
        chained: Future[gateway_pb2.ProducePartitionResult] = Future()

        def finished(inner: Future[gateway_pb2.ProducePartitionResult]) -> None:
            if inner.cancelled():  # close() cancelled it before it ran
                if refused is not None:
                    refused()
                chained.set_result(_stopping(data))
                return
            error = inner.exception()
            if error is not None:  # passed on, not raised in this callback (swallowed)
                chained.set_exception(error)
            else:
                chained.set_result(inner.result())

        def start(_: object) -> None:
            self._start(data, fn, refused, deadline).add_done_callback(finished)

        if after is None:
            start(None)
        else:
            after.add_done_callback(start)
        return chained

    # --- ProduceStream ----------------------------------------------------------------------

    def stream(
        self,
        requests: Iterator[gateway_pb2.ProduceRequest],
        max_in_flight: int,
        is_active: Callable[[], bool] = lambda: True,
    ) -> Iterator[gateway_pb2.ProduceResponse]:
        """Answer a ProduceStream: responses in completion order, matched by
        correlation_id. With ``max_in_flight`` requests of the client unanswered, the
        stream is read no further until one is answered (gRPC's flow control then holds
        the client's next requests back): ending the stream with INVALID_REQUEST failed
        every request in flight on it, records written among them, for a client whose
        pipeline was deeper than this gateway's limit (found by an audit). ``is_active``
        (the call's): a request that waited for budget room while the client cancelled
        is not appended."""
        out: queue.SimpleQueue[gateway_pb2.ProduceResponse | TidelogError | None] = (
            queue.SimpleQueue()
        )
        lock = threading.Lock()
        room = threading.Condition(lock)  # notified whenever a request is answered
        state = {"in_flight": 0, "reading": 1}
        # Each partition's latest append still running, which the next one waits for.
        # Only while running: a done future keeps its callbacks, and through them the
        # whole request it answered, so a stream over 100 partitions that kept every
        # partition's last future held up to 100 requests' records (~350 MiB in the OMB
        # case, BENCHMARKS.md eighth pass).
        tails: dict[tuple[str, int], Future[gateway_pb2.ProducePartitionResult]] = {}

        def forget(key: tuple[str, int], tail: Future[gateway_pb2.ProducePartitionResult]) -> None:
            with lock:
                if tails.get(key) is tail:
                    del tails[key]

        # Each partition's latest request whose answer is not sent yet: a request's answer
        # waits for those of the earlier requests it shares a partition with. Sent when its
        # own appends were over, a request {A, stuck B} was answered after a later {A}, and
        # a raw client saw A's appends acknowledged out of order (found by an audit; the
        # SDK keeps one request per partition in flight, so never saw it).
        unanswered: dict[tuple[str, int], _Unanswered] = {}

        def send_ready(first: _Unanswered) -> None:
            """Send ``first``'s answer, then those of the later requests that waited only
            for it, and so on: in a loop, not each from the one before's callback (a chain
            of hundreds of requests of one partition would overflow the stack, and the
            callbacks' errors are swallowed: the stream's answers would stop)."""
            ready = collections.deque([first])
            while ready:
                node = ready.popleft()
                response = gateway_pb2.ProduceResponse(
                    correlation_id=node.request.correlation_id,
                    partitions=[r.result.result() for r in node.results],
                )
                # Each result future keeps a callback, which keeps the node: a cycle that
                # only the cyclic GC would free, with the request's records in it.
                node.results.clear()
                if tracing.ENABLED:
                    tracing.event("g_out", node.request.correlation_id)
                with lock:
                    # Counted out and queued at once: the answering loop ends when nothing
                    # is in flight or queued, and must not end between the two (the
                    # request's answer was then never sent; a CI run caught it).
                    state["in_flight"] -= 1
                    room.notify_all()
                    out.put(response)
                    for key in node.keys:
                        if unanswered.get(key) is node:
                            del unanswered[key]
                    for later in node.successors:
                        later.remaining -= 1
                        if later.remaining == 0:
                            ready.append(later)
                    node.successors.clear()

        def answer(
            request: gateway_pb2.ProduceRequest, results: list[Submitted], held_bytes: int = 0
        ) -> None:
            node = _Unanswered(
                request, results, [(d.topic, d.partition) for d in request.partitions]
            )
            with lock:
                before = {id(n): n for n in (unanswered.get(k) for k in node.keys) if n is not None}
                for earlier in before.values():
                    earlier.successors.append(node)
                for key in node.keys:
                    unanswered[key] = node
                # Its results, the earlier requests, and one for this call itself (so that
                # it is not sent before every callback is in place).
                node.remaining = len(results) + len(before) + 1
            self._release_when_appended(held_bytes, results)

            def one_done(_: object) -> None:
                with lock:
                    node.remaining -= 1
                    if node.remaining:
                        return
                send_ready(node)

            for submitted in list(results):
                submitted.result.add_done_callback(one_done)
            one_done(None)

        def read() -> None:
            try:
                for request in requests:
                    if tracing.ENABLED:
                        tracing.event("g_in", request.correlation_id)
                    with room:
                        while state["in_flight"] >= max_in_flight:
                            if not is_active():
                                return
                            room.wait(IN_FLIGHT_WAIT_S)
                        state["in_flight"] += 1
                    try:
                        deadline = validate(request, self.limits)
                    except TidelogError as exc:
                        # A bad request fails alone; the stream and its pipeline go on.
                        answer(
                            request, [Submitted.done(_failed(d, exc)) for d in request.partitions]
                        )
                        continue
                    # The stream is read no further until the request fits in the budget.
                    size = record_bytes(request)
                    if not self.budget.acquire(size, deadline):
                        # Answered in its place, after the earlier requests of its
                        # partitions (put straight on the stream, it passed them; found by
                        # an audit).
                        answer(
                            request,
                            [Submitted.done(r) for r in self._no_room(request).partitions],
                        )
                        continue
                    if not is_active():
                        # Cancelled while it waited for room: its client has gone and
                        # will not learn the outcome, so nothing is written (found by an
                        # audit, by reading).
                        self.budget.release(size)
                        with lock:
                            state["in_flight"] -= 1
                        room.notify_all()
                        return
                    try:
                        keys = [(data.topic, data.partition) for data in request.partitions]
                        with lock:
                            afters = [tails.get(key) for key in keys]
                        results = self.submit_all(
                            request.partitions, request.acks, deadline, afters
                        )
                        with lock:
                            for key, submitted in zip(keys, results, strict=True):
                                tails[key] = submitted.tail
                        for key, submitted in zip(keys, results, strict=True):
                            submitted.tail.add_done_callback(partial(forget, key))
                    except BaseException:
                        self.budget.release(size)
                        raise
                    answer(request, results, size)
            except Exception as exc:  # the client went away, or sent garbage
                _log.debug("produce_stream_read_ended", error=str(exc))
            finally:
                with lock:
                    state["reading"] = 0
                out.put(None)

        reader = threading.Thread(target=read, name="gateway-produce-stream", daemon=True)
        reader.start()
        while True:
            item = out.get()
            if isinstance(item, TidelogError):
                raise item
            if item is not None:
                yield item
            with lock:
                if not state["reading"] and state["in_flight"] == 0 and out.empty():
                    return


@dataclass(eq=False, slots=True)
class _Unanswered:
    """A ProduceStream request whose answer is not sent yet: it goes once ``remaining``
    (its partitions' results, the earlier unanswered requests sharing a partition with
    it) is 0; ``successors`` are the later requests waiting for it."""

    request: gateway_pb2.ProduceRequest
    results: list[Submitted]
    keys: list[tuple[str, int]]
    remaining: int = 0
    successors: list[_Unanswered] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Submitted:
    """A partition's place in a produce request: ``result`` is what to answer, ``tail``
    completes when its append is over (for acks=0 they differ: the answer comes first)."""

    result: Future[gateway_pb2.ProducePartitionResult]
    tail: Future[gateway_pb2.ProducePartitionResult]

    @staticmethod
    def done(result: gateway_pb2.ProducePartitionResult) -> Submitted:
        future: Future[gateway_pb2.ProducePartitionResult] = Future()
        future.set_result(result)
        return Submitted(result=future, tail=future)
