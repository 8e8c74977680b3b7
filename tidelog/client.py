"""The SDK's link to a gateway: one channel per process and address, made on first use.

Every client (Producer, Consumer, Admin, the CLI, the Spark data source) talks to a
gateway through ``GatewayConnection``: typed calls with a deadline whose failures are
``tidelog.errors`` exceptions (the ``tidelog-error-code`` trailer the services set, or a
code derived from the bare gRPC status).
In direct mode (``tidelog.leaders``) producers and consumers also open channels to the
storage nodes (``client_channel``) for their appends and fetches; metadata, producer ids
and group offsets still come from the gateway.

Spark forks Python workers and pickles reader and writer objects into them, and a gRPC
channel made before ``fork`` is unusable after it, so connections are never pickled:
``GatewayConnection.get(address)`` returns this process's connection (keyed by pid and
address), creating it lazily.

The gateway address is an argument everywhere; ``resolve_gateway(None)`` falls back to
the ``TIDELOG_GATEWAY`` environment variable, then to ``127.0.0.1:9094``.

A Producer, Consumer or Admin made before ``fork`` is not usable in the child either (its
threads stay in the parent): ``check_same_process`` makes each call there raise
ConfigError at once instead of waiting for ever.

Thread-safety: a connection may be shared by threads (gRPC stubs are thread-safe); the
per-process registry is guarded by a lock.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import grpc

from tidelog.addresses import check_connectable
from tidelog.errors import (
    BrokerNotAvailableError,
    ConfigError,
    ErrorCode,
    InvalidRequestError,
    NetworkError,
    RecordListTooLargeError,
    RequestTimedOutError,
    TidelogError,
    UnknownServerError,
    error_for_code,
)
from tidelog.formats import MAX_PARTITIONS_PER_REQUEST
from tidelog.v1 import common_pb2, controller_pb2, gateway_pb2, gateway_pb2_grpc, storage_pb2

MAX_MESSAGE_BYTES: Final = 128 * 1024 * 1024
"""gRPC message cap both ways; the gateway's own limits are below it."""
LIST_OFFSETS_RETRY_S: Final = 0.05
"""Pause before asking again for offsets answered with a retriable error."""
DEFAULT_GATEWAY: Final = "127.0.0.1:9094"
GATEWAY_ENV: Final = "TIDELOG_GATEWAY"


def resolve_gateway(address: str | None) -> str:
    """``address``, else (None) ``$TIDELOG_GATEWAY`` (unset or empty: the local default),
    either checked as ``--gateway`` is: ConfigError for a value no connection can use.
    A given address was taken as it was: gRPC wrapped port 99999 round to 34463 and
    connected there, and "" meant the default (found by an audit)."""
    if address is not None:
        try:
            return check_connectable(address)
        except ValueError as exc:
            raise ConfigError(f"gateway address {address!r}: {exc}") from None
    from_env = os.environ.get(GATEWAY_ENV)
    if not from_env:
        return DEFAULT_GATEWAY
    try:
        return check_connectable(from_env)
    except ValueError as exc:
        raise ConfigError(f"${GATEWAY_ENV}: {exc}") from None


_current_pid = os.getpid()
"""This process's id, set again in a child by os.fork() (below): the per-call fork checks
compare against it, as an os.getpid() system call on every send costs ~0.2 us."""


def _forked() -> None:
    global _current_pid  # noqa: PLW0603 - the one process-wide value fork changes
    _current_pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def current_pid() -> int:
    """This process's id (cached; kept right across ``os.fork()``)."""
    return _current_pid


def check_same_process(created_pid: int, what: str) -> None:
    """Raise ConfigError when called in a process other than ``created_pid``, the one the
    client ``what`` (e.g. "Producer") was created in: a child made by ``os.fork()``. The
    client's threads do not exist in a child and its gRPC channels are the parent's, so a
    call there would wait for ever; as with Kafka's clients, create one after forking."""
    if created_pid != _current_pid:
        raise ConfigError(
            f"this {what} was created in process {created_pid} and cannot be used in process "
            f"{_current_pid} after os.fork() (its threads and connections are the parent's); "
            f"create the {what} after forking, in the process that uses it"
        )


ERROR_CODE_METADATA_KEY: Final = "tidelog-error-code"
"""Trailing metadata key servers use to carry the tidelog error code of a failed call."""


ERROR_FOR_BARE_STATUS: Final[dict[grpc.StatusCode, type[TidelogError]]] = {
    grpc.StatusCode.DEADLINE_EXCEEDED: RequestTimedOutError,
    grpc.StatusCode.UNAVAILABLE: NetworkError,
    # A call reset on the way (a proxy, a load balancer): nothing says it was refused.
    grpc.StatusCode.CANCELLED: NetworkError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.UNIMPLEMENTED: InvalidRequestError,
    # A server's maximum_concurrent_rpcs limit: busy now, fine later (retriable); gRPC's
    # own message size limit also says RESOURCE_EXHAUSTED, see bare_status_error.
    grpc.StatusCode.RESOURCE_EXHAUSTED: BrokerNotAvailableError,
}
"""The error a failed call stands for when it carries no tidelog code: statuses made by
gRPC itself (deadline, connection, message size, concurrency limit) or by a server
outside tidelog's conventions. Shared by the SDK and the services' own calls."""


def bare_status_error(status: grpc.StatusCode, message: str, details: str) -> TidelogError:
    """``ERROR_FOR_BARE_STATUS`` applied: the error for ``status`` with ``message``."""
    # gRPC's own size limit ("Received message larger than max") is a request-size problem.
    if status == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        return RecordListTooLargeError(message)
    return ERROR_FOR_BARE_STATUS.get(status, UnknownServerError)(message)


def error_from_rpc(exc: grpc.RpcError, what: str) -> TidelogError:
    """The tidelog error a failed call stands for, with ``what`` for context."""
    status = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else ""
    trailers: Any = (
        exc.trailing_metadata() if callable(getattr(exc, "trailing_metadata", None)) else ()
    )
    for item in trailers or ():
        key, value = item[0], item[1]
        if key == ERROR_CODE_METADATA_KEY:
            name = value.decode() if isinstance(value, bytes) else str(value)
            code = ErrorCode.__members__.get(name, ErrorCode.UNKNOWN_SERVER_ERROR)
            return error_for_code(code, f"{what}: {details}")
    if status == grpc.StatusCode.UNAVAILABLE:
        return NetworkError(f"{what}: unreachable ({details})")
    if status == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RequestTimedOutError(f"{what}: no answer before the deadline")
    if status == grpc.StatusCode.UNIMPLEMENTED:
        # Every tidelog server implements its whole service: this is another server (or
        # another tidelog service) at the address, or one much older than this client.
        return InvalidRequestError(
            f"{what}: the server does not implement this call ({details}): is the address "
            "a tidelog server of the right kind and version?"
        )
    return bare_status_error(status, f"{what}: {status.name}: {details}", details or "")


def leaders_by_topic(response: controller_pb2.MetadataResponse) -> dict[str, list[int]]:
    """Per topic of a metadata answer, the leader of each partition (-1: none); raises the
    first per-topic error (e.g. UnknownTopicOrPartitionError)."""
    leaders: dict[str, list[int]] = {}
    for topic in response.topics:
        raise_for(topic.error, f"topic {topic.name!r}")
        by_index = sorted(topic.partitions, key=lambda p: p.partition)
        leaders[topic.name] = [p.leader for p in by_index]
    return leaders


GONE_CODES: Final = frozenset(
    {ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, ErrorCode.INCONSISTENT_TOPIC_ID}
)
"""A partition's topic is gone, or is another incarnation of it now."""


def raise_for(error: common_pb2.Error, what: str) -> None:
    """Raise the exception a per-item ``Error`` stands for, if it is not NONE."""
    if error.code != common_pb2.NONE:
        raise error_for_code(int(error.code), f"{what}: {error.message}")


@dataclass(frozen=True, slots=True)
class PartitionOffsets:
    """A partition's bounds as a consumer sees them: [log start, high watermark)."""

    earliest: int
    latest: int


def _produce_request(
    items: Sequence[tuple[str, int, bytes]], acks: common_pb2.Acks, timeout_ms: int
) -> gateway_pb2.ProduceRequest:
    return gateway_pb2.ProduceRequest(
        acks=acks,
        timeout_ms=timeout_ms,
        partitions=[
            gateway_pb2.ProducePartitionData(topic=t, partition=p, records=r) for t, p, r in items
        ],
        client_id="tidelog-spark",
    )


def client_channel(address: str) -> grpc.Channel:
    """A channel from the SDK to a gateway or (direct mode) a storage node."""
    return grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2_000),
        ],
    )


def one_partition_fetch(
    topic: str,
    partition: int,
    offset: int,
    max_bytes: int,
    *,
    max_wait_ms: int,
    current_leader_epoch: int | None = None,
    topic_id: str = "",
) -> storage_pb2.FetchRequest:
    """A consumer's long-poll fetch of one partition from ``offset``; with
    ``current_leader_epoch``, one a leader refuses if its epoch differs (direct reads);
    with ``topic_id``, one refused (INCONSISTENT_TOPIC_ID) by another incarnation of the
    topic."""
    part = storage_pb2.FetchPartition(
        topic=topic,
        partition=partition,
        fetch_offset=offset,
        max_bytes=max_bytes,
        topic_id=topic_id,
    )
    if current_leader_epoch is not None:
        part.current_leader_epoch = current_leader_epoch
    return storage_pb2.FetchRequest(
        replica_id=-1,
        max_wait_ms=max_wait_ms,
        min_bytes=1,
        max_bytes=max_bytes,
        partitions=[part],
    )


class GatewayConnection:
    """Typed calls to one gateway over one channel (see module docstring)."""

    _registry: ClassVar[dict[tuple[int, str, int], GatewayConnection]] = {}
    _registry_lock: ClassVar = threading.Lock()

    def __init__(self, address: str, timeout_ms: int = 30_000) -> None:
        self.address = address
        self.timeout_s = timeout_ms / 1000.0
        self._channel = client_channel(address)
        self.stub = gateway_pb2_grpc.GatewayStub(self._channel)
        # ProduceStream taking requests already encoded (tidelog.wire): protobuf's own
        # building and encoding of a request full of batches costs ~2 ms per MB.
        self.produce_stream_encoded = self._channel.stream_stream(
            "/tidelog.v1.Gateway/ProduceStream",
            request_serializer=None,
            response_deserializer=gateway_pb2.ProduceResponse.FromString,
        )

    @classmethod
    def get(cls, address: str | None = None, timeout_ms: int = 30_000) -> GatewayConnection:
        """This process's connection to ``address`` with calls bounded by ``timeout_ms``
        (made on first use, after any fork). One per timeout, so a caller's timeout is
        never replaced by the one an earlier caller asked for."""
        address = resolve_gateway(address)
        key = (os.getpid(), address, timeout_ms)
        with cls._registry_lock:
            connection = cls._registry.get(key)
            if connection is None:
                connection = cls(address, timeout_ms)
                cls._registry[key] = connection
            return connection

    def call(self, method: Any, request: Any, what: str, timeout_s: float | None = None) -> Any:
        """``method(request)`` with the deadline, errors mapped to tidelog errors."""
        try:
            return method(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, what) from None

    # --- metadata ---------------------------------------------------------------------------

    def partition_counts(self, topics: Sequence[str] = ()) -> dict[str, int]:
        """Partition count per topic (all topics when ``topics`` is empty).

        Raises UnknownTopicOrPartitionError when a named topic does not exist.
        """
        return {name: len(leaders) for name, leaders in self.partition_leaders(topics).items()}

    def partition_counts_and_ids(
        self, topics: Sequence[str], timeout_s: float | None = None
    ) -> dict[str, tuple[int, str]]:
        """Per named topic, its partition count and topic id (the incarnation's UUID).

        Raises UnknownTopicOrPartitionError when a named topic does not exist.
        """
        response = self.metadata(topics, timeout_s)
        found: dict[str, tuple[int, str]] = {}
        for topic in response.topics:
            raise_for(topic.error, f"topic {topic.name!r}")
            found[topic.name] = (len(topic.partitions), topic.topic_id)
        return found

    def metadata(
        self, topics: Sequence[str] = (), timeout_s: float | None = None
    ) -> controller_pb2.MetadataResponse:
        """The gateway's metadata: live brokers and the named topics' partition states
        (all topics when ``topics`` is empty); per-topic errors are left in the answer."""
        response: controller_pb2.MetadataResponse = self.call(
            self.stub.Metadata,
            controller_pb2.MetadataRequest(topics=list(topics)),
            f"metadata from gateway {self.address}",
            timeout_s,
        )
        return response

    def partition_leaders(self, topics: Sequence[str] = ()) -> dict[str, list[int]]:
        """Per topic, the leader's broker id of each partition (-1: none), as the gateway's
        metadata has it (all topics when ``topics`` is empty).

        Raises UnknownTopicOrPartitionError when a named topic does not exist.
        """
        return leaders_by_topic(self.metadata(topics))

    def list_offsets(
        self,
        partitions: Iterable[tuple[str, int]],
        spec: common_pb2.OffsetSpec,
        timestamp_ms: int = -1,
        *,
        partial: bool = False,
        deadline: float | None = None,
        retry_unknown_topic: bool = True,
    ) -> dict[tuple[str, int], tuple[int, int]]:
        """``spec`` (a ``common_pb2.OffsetSpec``) resolved per partition: (offset, ts).

        The offset is -1 when nothing matches (a timestamp after all data). With
        ``partial``, one pass: partitions that failed (no leader, say) are left out
        instead of retried until the timeout and then raised for all. ``deadline``
        (monotonic; default: the request timeout from now) bounds the whole call.
        ``retry_unknown_topic`` False: UNKNOWN_TOPIC_OR_PARTITION raises at once (Kafka's
        Admin.listOffsets, KAFKA-12879) instead of being asked again until the deadline.
        """
        found = self.list_offset_results(
            partitions,
            spec,
            timestamp_ms,
            partial=partial,
            deadline=deadline,
            retry_unknown_topic=retry_unknown_topic,
        )
        return {tp: (item.offset, item.timestamp_ms) for tp, item in found.items()}

    def list_offset_results(
        self,
        partitions: Iterable[tuple[str, int]],
        spec: common_pb2.OffsetSpec,
        timestamp_ms: int = -1,
        *,
        partial: bool = False,
        deadline: float | None = None,
        retry_unknown_topic: bool = True,
        failed: dict[tuple[str, int], TidelogError] | None = None,
    ) -> dict[tuple[str, int], storage_pb2.ListOffsetsResult]:
        """``list_offsets`` with each partition's whole answer (its leader epoch too).
        With ``partial``, the errors of the partitions left out go into ``failed``.
        More partitions than a request takes are asked in several (a Spark read over
        more than 10,000 partitions could not be planned; found by an audit)."""
        partitions = list(partitions)
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        if len(partitions) > MAX_PARTITIONS_PER_REQUEST:
            merged: dict[tuple[str, int], storage_pb2.ListOffsetsResult] = {}
            for start in range(0, len(partitions), MAX_PARTITIONS_PER_REQUEST):
                merged.update(
                    self.list_offset_results(
                        partitions[start : start + MAX_PARTITIONS_PER_REQUEST],
                        spec,
                        timestamp_ms,
                        partial=partial,
                        deadline=deadline,
                        retry_unknown_topic=retry_unknown_topic,
                        failed=failed,
                    )
                )
            return merged
        request = storage_pb2.ListOffsetsRequest(
            replica_id=-1,
            partitions=[
                storage_pb2.ListOffsetsPartition(
                    topic=topic, partition=partition, spec=spec, timestamp_ms=timestamp_ms
                )
                for topic, partition in partitions
            ],
        )
        if not request.partitions:
            return {}
        # Partitions answered with a retriable error (a new leader not ready to answer,
        # a leader moving) are asked again after a pause, within the request timeout. Each
        # attempt gets what is left of it: a full timeout each let a retry begun just
        # before the deadline double the call (found by an audit).
        result: dict[tuple[str, int], storage_pb2.ListOffsetsResult] = {}
        last: common_pb2.Error | None = None  # a partition's last error, while retried
        while True:
            try:
                response: storage_pb2.ListOffsetsResponse = self.call(
                    self.stub.ListOffsets,
                    request,
                    "list offsets",
                    timeout_s=max(0.001, deadline - time.monotonic()),
                )
            except RequestTimedOutError:
                if last is None:
                    raise
                # The retry ran out of time: the error it was retried for says more than
                # "no answer before the deadline" (found by an audit).
                raise_for(last, "list offsets (retried until the timeout)")
                raise
            again = []
            for item in response.partitions:
                if partial and item.error.code != common_pb2.NONE:
                    if failed is not None:
                        failed[(item.topic, item.partition)] = error_for_code(
                            int(item.error.code),
                            f"offsets of {item.topic}-{item.partition}: {item.error.message}",
                        )
                    continue
                error = error_for_code(int(item.error.code), item.error.message)
                retriable = error.retriable and (
                    retry_unknown_topic or error.code != ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
                )
                if item.error.code != common_pb2.NONE and not (
                    retriable and time.monotonic() + LIST_OFFSETS_RETRY_S < deadline
                ):
                    raise_for(item.error, f"offsets of {item.topic}-{item.partition}")
                if item.error.code != common_pb2.NONE:
                    last = item.error
                    again.append(item)
                    continue
                result[(item.topic, item.partition)] = item
            if not again:
                return result
            asked = {(p.topic, p.partition): p for p in request.partitions}
            del request.partitions[:]
            request.partitions.extend(asked[(item.topic, item.partition)] for item in again)
            time.sleep(LIST_OFFSETS_RETRY_S)

    def bounds(
        self, partitions: Sequence[tuple[str, int]], *, retry_unknown_topic: bool = True
    ) -> dict[tuple[str, int], PartitionOffsets]:
        """[earliest, latest) of each partition, latest being the high watermark, both
        within one request timeout (``retry_unknown_topic`` as ``list_offsets``')."""
        deadline = time.monotonic() + self.timeout_s
        earliest = self.list_offsets(
            partitions,
            common_pb2.EARLIEST,
            deadline=deadline,
            retry_unknown_topic=retry_unknown_topic,
        )
        latest = self.list_offsets(
            partitions,
            common_pb2.LATEST,
            deadline=deadline,
            retry_unknown_topic=retry_unknown_topic,
        )
        return {tp: PartitionOffsets(earliest[tp][0], latest[tp][0]) for tp in partitions}

    # --- data ---------------------------------------------------------------------------------

    def fetch(
        self,
        topic: str,
        partition: int,
        offset: int,
        max_bytes: int,
        max_wait_ms: int = 500,
        *,
        topic_id: str = "",
    ) -> storage_pb2.FetchPartitionResult:
        """One long-poll fetch of one partition from ``offset`` (errors raised); with
        ``topic_id``, of that incarnation of the topic only."""
        request = one_partition_fetch(
            topic, partition, offset, max_bytes, max_wait_ms=max_wait_ms, topic_id=topic_id
        )
        response: storage_pb2.FetchResponse = self.call(
            self.stub.Fetch,
            request,
            f"fetch {topic}-{partition} at {offset}",
            timeout_s=self.timeout_s + max_wait_ms / 1000.0,
        )
        (result,) = response.partitions
        raise_for(result.error, f"fetch {topic}-{partition} at offset {offset}")
        if not result.records and response.throttle_time_ms > 0:
            # Answered at once because the server could not hold the long poll: wait here
            # instead, or a caller's fetch loop would spin.
            time.sleep(min(response.throttle_time_ms, max_wait_ms) / 1000)
        return result

    def produce(
        self,
        items: Sequence[tuple[str, int, bytes]],
        acks: common_pb2.Acks,
        timeout_ms: int,
    ) -> list[gateway_pb2.ProducePartitionResult]:
        """Send batches (topic, partition, records) in one request; per-item results."""
        request = _produce_request(items, acks, timeout_ms)
        response: gateway_pb2.ProduceResponse = self.call(
            self.stub.Produce, request, "produce", timeout_s=timeout_ms / 1000.0 + 5.0
        )
        return list(response.partitions)

    def produce_async(
        self,
        items: Sequence[tuple[str, int, bytes]],
        acks: common_pb2.Acks,
        timeout_ms: int,
    ) -> Callable[[], list[gateway_pb2.ProducePartitionResult]]:
        """Start ``produce`` and return a function that waits for its per-item results
        (errors raised as tidelog errors), so the caller can prepare the next request
        meanwhile."""
        request = _produce_request(items, acks, timeout_ms)
        future = self.stub.Produce.future(request, timeout=timeout_ms / 1000.0 + 5.0)

        def wait() -> list[gateway_pb2.ProducePartitionResult]:
            try:
                response: gateway_pb2.ProduceResponse = future.result()
            except grpc.RpcError as exc:
                raise error_from_rpc(exc, "produce") from None
            return list(response.partitions)

        return wait

    def commit_offsets(
        self,
        group_id: str,
        offsets: dict[tuple[str, int], int],
        *,
        topic_ids: Mapping[str, str] | None = None,
        skip_gone: bool = False,
    ) -> list[TidelogError]:
        """Store ``offsets`` (the next offset to read per partition) for ``group_id``;
        each of a topic named in ``topic_ids`` only in that incarnation. ``skip_gone``:
        partitions whose topic is gone (or is another incarnation now) are left out and
        their errors returned, rather than raised."""
        ids = topic_ids or {}
        if len(offsets) > MAX_PARTITIONS_PER_REQUEST:
            items = sorted(offsets.items())
            skipped_all: list[TidelogError] = []
            for start in range(0, len(items), MAX_PARTITIONS_PER_REQUEST):
                chunk = dict(items[start : start + MAX_PARTITIONS_PER_REQUEST])
                skipped_all += self.commit_offsets(
                    group_id, chunk, topic_ids=ids, skip_gone=skip_gone
                )
            return skipped_all
        request = gateway_pb2.CommitOffsetsRequest(
            group_id=group_id,
            offsets=[
                gateway_pb2.CommitOffset(
                    topic=t, partition=p, offset=o, leader_epoch=-1, topic_id=ids.get(t, "")
                )
                for (t, p), o in sorted(offsets.items())
            ],
        )
        response: gateway_pb2.CommitOffsetsResponse = self.call(
            self.stub.CommitOffsets, request, f"commit offsets of group {group_id!r}"
        )
        skipped: list[TidelogError] = []
        for item in response.partitions:
            if item.error.code == common_pb2.NONE:
                continue
            error = error_for_code(
                int(item.error.code),
                f"commit {item.topic}-{item.partition} for {group_id!r}: {item.error.message}",
            )
            if skip_gone and error.code in GONE_CODES:
                skipped.append(error)
                continue
            raise error
        return skipped
