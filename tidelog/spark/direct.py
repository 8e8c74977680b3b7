"""The ``direct`` option: Spark tasks fetch from and append to partition leaders themselves.

Through the gateway (the default), every byte a task reads or writes takes one more Python
gRPC hop. With ``direct=true`` a task sends its ``Fetch`` and ``Append`` calls to the
leader's ``tidelog.v1.Storage`` service, as ``Consumer(direct=True)`` and
``Producer(direct=True)`` do (``tidelog.leaders``); the gateway still plans the query
(partition lists, offset bounds, timestamps), gives partition counts to writers and, when a
leader moved, the new leader. The executors must reach the brokers' registered addresses.

- Reads: the driver puts each range's leader, as the gateway's metadata had it when the
  query was planned, in the range's Spark partition (``leader_hints``), so a task whose
  leader did not move never talks to the gateway. ``PartitionFetcher`` fetches with that
  leader's epoch; a retriable answer or a broker that cannot be reached (the leader moved
  or died) makes it ask the gateway for the leader again (``LeaderDirectory``) and retry
  after ``RETRY_BACKOFF_S``, as the consumer's direct mode does, for up to the request
  timeout from the first failed attempt; then the last error fails the task. A partition
  the gateway's metadata no longer lists in the planned incarnation
  (``reader.partition_gone``) is not waited for: the task reports it as data loss.
- Writes: ``Appender`` sends each partition of a writer's request as one ``Append`` to its
  leader, on a few threads, and answers with the gateway's ``ProducePartitionResult``s so
  the writer checks them as it checks the gateway's. It re-routes exactly what the
  gateway's router re-routes (``REROUTE_CODES``), with the same bytes (so the same
  producer id and sequences: exactly-once replays are recognised as before), until the
  request timeout; any other error is returned at once, as the gateway returns it.

Thread-safety: ``PartitionFetcher`` is used by one task; ``Appender.append_async`` may be
called from any thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final

import grpc

from tidelog.client import GatewayConnection, error_from_rpc, one_partition_fetch
from tidelog.errors import (
    REROUTE_CODES,
    LeaderNotAvailableError,
    RequestTimedOutError,
    TidelogError,
    UnknownTopicOrPartitionError,
    error_for_code,
)
from tidelog.leaders import Leader, LeaderDirectory, directory_for
from tidelog.spark.reader import partition_gone
from tidelog.v1 import common_pb2, gateway_pb2, storage_pb2
from tidelog.wire import append_request_parts

TopicPartition = tuple[str, int]

RETRY_BACKOFF_S: Final = 0.1
"""Pause before retrying on another (or the same) leader: a new leader needs a moment to be
elected and to reach the gateway's metadata (the consumer's and producer's back-off)."""
LEADER_WAIT_MARGIN_MS: Final = 100
"""An acks=all append asks the leader to wait this much less than the call may take, so
the leader's precise REQUEST_TIMED_OUT arrives rather than a bare deadline (as the gateway
and ``Producer(direct=True)`` ask)."""
FETCH_WAIT_MS: Final = 500
"""Long-poll wait of a fetch at the end of what is readable (the gateway path's)."""
APPEND_THREADS: Final = 8
"""Appends of one writer in flight at once (one thread each: a blocking call, retried)."""


def leader_hints(
    connection: GatewayConnection, partitions: Sequence[TopicPartition]
) -> dict[TopicPartition, Leader | None]:
    """Each partition's leader as the gateway's metadata has it now (driver side); None for
    a partition without a live leader (its tasks ask again)."""
    directory = directory_for(connection)
    if partitions:
        directory.refresh(sorted({topic for topic, _ in partitions}))
    return {tp: directory.leader(tp) for tp in partitions}


class PartitionFetcher:
    """Fetches of one partition from its leader; see the module docstring."""

    def __init__(
        self,
        connection: GatewayConnection,
        tp: TopicPartition,
        leader: Leader | None,
        request_timeout_ms: int,
        topic_id: str = "",
    ) -> None:
        self._connection = connection
        self._directory: LeaderDirectory = directory_for(connection)
        self._tp = tp
        self._topic_id = topic_id  # the incarnation planned for; empty checks nothing
        self._leader = leader  # None: ask the directory (the gateway) first
        self._timeout_s = request_timeout_ms / 1000

    def fetch(self, offset: int, max_bytes: int) -> storage_pb2.FetchPartitionResult:
        """One long-poll fetch from ``offset``, as ``GatewayConnection.fetch`` (errors raised,
        OFFSET_OUT_OF_RANGE among them), retried on another leader as needed."""
        topic, partition = self._tp
        what = f"fetch {topic}-{partition} at offset {offset}"
        give_up_at: float | None = None
        while True:
            try:
                leader = self._current_leader(what)
            except UnknownTopicOrPartitionError:
                raise  # the gateway says the topic or partition does not exist: final
            except TidelogError as exc:
                if not exc.retriable:
                    raise
                error = exc
            else:
                try:
                    return self._fetch_from(leader, offset, max_bytes, what)
                except TidelogError as exc:
                    # The broker's own UNKNOWN_TOPIC_OR_PARTITION is retriable: it may not
                    # have heard of its new role yet. Unless the topic is gone, which only
                    # the gateway's metadata tells.
                    if not exc.retriable:
                        raise
                    if isinstance(exc, UnknownTopicOrPartitionError) and partition_gone(
                        self._connection, topic, partition, self._topic_id
                    ):
                        raise
                    error = exc
            # The leader moved or died, or the gateway could not say who leads now.
            self._leader = None
            self._directory.invalidate()
            now = time.monotonic()
            # A leader that fails over takes seconds; the gateway path's router waits for
            # it up to the request's deadline, so this waits as long.
            give_up_at = give_up_at or now + self._timeout_s
            if now >= give_up_at:
                raise error
            time.sleep(RETRY_BACKOFF_S)

    def _current_leader(self, what: str) -> Leader:
        if self._leader is None:
            self._leader = self._directory.leader(self._tp)
            if self._leader is None:
                raise LeaderNotAvailableError(f"{what}: no live leader right now")
        return self._leader

    def _fetch_from(
        self, leader: Leader, offset: int, max_bytes: int, what: str
    ) -> storage_pb2.FetchPartitionResult:
        topic, partition = self._tp
        request = one_partition_fetch(
            topic,
            partition,
            offset,
            max_bytes,
            max_wait_ms=FETCH_WAIT_MS,
            current_leader_epoch=leader.leader_epoch,
            topic_id=self._topic_id,
        )
        where = f"{what} from broker {leader.broker_id} ({leader.address})"
        try:
            response: storage_pb2.FetchResponse = self._directory.storage(leader.address).Fetch(
                request, timeout=self._timeout_s + FETCH_WAIT_MS / 1000
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, where) from None
        (result,) = response.partitions
        if result.error.code != common_pb2.NONE:
            raise error_for_code(int(result.error.code), f"{where}: {result.error.message}")
        return result


class Appender:
    """A writer's appends to partition leaders; see the module docstring."""

    def __init__(self, connection: GatewayConnection) -> None:
        self._directory = directory_for(connection)
        self._threads = ThreadPoolExecutor(APPEND_THREADS, thread_name_prefix="tidelog-append")

    def close(self) -> None:
        """Stop the threads (appends not yet started are dropped)."""
        self._threads.shutdown(wait=False, cancel_futures=True)

    def append_async(
        self,
        items: Sequence[tuple[str, int, bytes]],
        acks: common_pb2.Acks,
        timeout_ms: int,
    ) -> Callable[[], list[gateway_pb2.ProducePartitionResult]]:
        """Start appending (topic, partition, records) items, each to its leader; returns a
        function that waits for the per-item results, as ``GatewayConnection.produce_async``
        does for a produce request through the gateway."""
        deadline = time.monotonic() + timeout_ms / 1000
        futures = [
            self._threads.submit(self._append, topic, partition, records, acks, deadline)
            for topic, partition, records in items
        ]

        def wait() -> list[gateway_pb2.ProducePartitionResult]:
            return [future.result() for future in futures]

        return wait

    def _append(
        self, topic: str, partition: int, records: bytes, acks: common_pb2.Acks, deadline: float
    ) -> gateway_pb2.ProducePartitionResult:
        """One partition's append, re-routed until ``deadline`` (the gateway router's loop)."""
        what = f"append to {topic}-{partition}"
        last: TidelogError | None = None
        while True:
            remaining_s = deadline - time.monotonic()
            # A retry needs the margin left; the first attempt goes whatever is left: with
            # requestTimeoutMs near the margin (100 is accepted) nothing was ever sent
            # (found by an audit).
            if remaining_s <= (0.0 if last is None else LEADER_WAIT_MARGIN_MS / 1000):
                return _failed(topic, partition, last or RequestTimedOutError(what))
            try:
                leader = self._directory.leader((topic, partition))
            except UnknownTopicOrPartitionError as exc:
                return _failed(topic, partition, exc)  # the gateway says it does not exist
            except TidelogError as exc:  # the gateway could not be asked
                if not exc.retriable:
                    return _failed(topic, partition, exc)
                last = exc
                time.sleep(min(RETRY_BACKOFF_S, remaining_s))
                continue
            if leader is None:
                last = LeaderNotAvailableError(f"{what}: no live leader right now")
                self._directory.invalidate()
                time.sleep(min(RETRY_BACKOFF_S, remaining_s))
                continue
            request = b"".join(
                append_request_parts(
                    topic=topic,
                    partition=partition,
                    batches=(records,),
                    acks=acks,
                    timeout_ms=max(1, int(remaining_s * 1000) - LEADER_WAIT_MARGIN_MS),
                    current_leader_epoch=leader.leader_epoch,
                )
            )
            try:
                response = self._directory.append_encoded(leader.address)(
                    request, timeout=remaining_s
                )
            except grpc.RpcError as exc:
                where = f"{what} on broker {leader.broker_id} ({leader.address})"
                error = error_from_rpc(exc, where)
                if error.code not in REROUTE_CODES:
                    return _failed(topic, partition, error)
                last = error
                self._directory.invalidate()
                time.sleep(min(RETRY_BACKOFF_S, max(0.0, deadline - time.monotonic())))
                continue
            return gateway_pb2.ProducePartitionResult(
                topic=topic,
                partition=partition,
                error=common_pb2.Error(),
                base_offset=response.base_offset,
                last_offset=response.last_offset,
                log_append_time_ms=response.log_append_time_ms,
                log_start_offset=response.log_start_offset,
            )


def _failed(topic: str, partition: int, error: TidelogError) -> gateway_pb2.ProducePartitionResult:
    return gateway_pb2.ProducePartitionResult(
        topic=topic,
        partition=partition,
        error=common_pb2.Error(code=error.code.name, message=error.message),
        base_offset=-1,
        last_offset=-1,
        log_append_time_ms=-1,
        log_start_offset=-1,
    )
