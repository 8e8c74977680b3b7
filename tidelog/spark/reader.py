"""Reading offset ranges into Arrow in the Kafka source's schema, and resolving plans.

``read_range`` is what every Spark read task runs: fetch [start, end) of one partition
through the gateway, or with ``direct=true`` from its leader (``tidelog.spark.direct``),
in whole batches, long-polling where the range is not yet below the high watermark of a
newly elected leader; decode each batch to Arrow with no Python per record
(``RecordBatch.to_arrow``), slice off records outside the range and add the constant
columns. ``resolve_*`` run on the driver: topic discovery and offset bounds.

The output schema is Spark's Kafka source schema: key, value (binary), topic (string),
partition (int), offset (long), timestamp (timestamp), timestampType (int: 0 create
time, 1 log-append time), and with ``includeHeaders`` headers (array of key/value).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, Literal

from tidelog.client import GatewayConnection, raise_for
from tidelog.errors import (
    ConfigError,
    CorruptBatchError,
    InconsistentTopicIdError,
    InvalidRecordError,
    OffsetOutOfRangeError,
    RequestTimedOutError,
    TidelogError,
    UnknownTopicOrPartitionError,
)
from tidelog.formats import ATTR_TIMESTAMP_LOG_APPEND
from tidelog.logging import get_logger
from tidelog.records import InvalidBatch, decode_valid_batches
from tidelog.spark.options import ReadOptions
from tidelog.spark.planning import (
    Bounds,
    DataLoss,
    OffsetRange,
    TopicPartition,
    deleted_before_read,
    raise_for_data_loss,
)
from tidelog.v1 import common_pb2, storage_pb2

SCHEMA_DDL: Final = (
    "key binary, value binary, topic string, partition int, offset long, "
    "timestamp timestamp, timestampType int"
)
HEADERS_DDL: Final = ", headers array<struct<key: string, value: binary>>"

MAX_SPARK_TIMESTAMP_MS: Final = (2**63 - 1) // 1000
"""The latest record timestamp a Spark timestamp (microseconds in an int64) holds."""
FETCH_RETRY_BACKOFF_S: Final = 0.1
"""Pause between two fetches through the gateway after a retriable failure."""

READ_STALL_TIMEOUT_S: Final = 120.0
"""How long a task waits for offsets it was promised (below the planned end) to become
readable, e.g. while a new leader's high watermark catches up, before failing."""


def warn_data_loss(losses: Sequence[DataLoss]) -> None:
    """Log what failOnDataLoss=false let a read skip, one warning per partition (Spark's
    Kafka source logs these too): the only trace of records the query will never see."""
    for loss in losses:
        get_logger(topic=loss.topic, partition=loss.partition).warning(
            "spark_data_loss", detail=loss.message(fail_on_data_loss=False)
        )


def schema_ddl(include_headers: bool) -> str:
    """The DDL of the source's schema."""
    return SCHEMA_DDL + (HEADERS_DDL if include_headers else "")


def schema_simple_string(include_headers: bool) -> str:
    """The source's schema as Spark's ``StructType.simpleString()`` writes it (what a
    schema handed to the reader is compared with, without a JVM to parse the DDL)."""
    headers = ",headers:array<struct<key:string,value:binary>>" if include_headers else ""
    return (
        "struct<key:binary,value:binary,topic:string,partition:int,offset:bigint,"
        f"timestamp:timestamp,timestampType:int{headers}>"
    )


def resolve_partitions(connection: GatewayConnection, options: ReadOptions) -> list[TopicPartition]:
    """The partitions a read covers, checked against the cluster's metadata.

    Raises UnknownTopicOrPartitionError for a named topic (subscribe) or partition
    (assign) that does not exist. A pattern matching nothing yields no partitions.
    """
    if options.topics is not None:
        counts = connection.partition_counts(options.topics)
        return [(t, p) for t in options.topics for p in range(counts[t])]
    if options.pattern is not None:
        counts = connection.partition_counts()
        pattern = options.pattern
        return [(t, p) for t in sorted(counts) if pattern.fullmatch(t) for p in range(counts[t])]
    assert options.assigned is not None
    counts = connection.partition_counts(sorted({t for t, _ in options.assigned}))
    for topic, partition in options.assigned:
        if partition >= counts[topic]:
            raise UnknownTopicOrPartitionError(
                f"assign: topic {topic!r} has {counts[topic]} partitions; there is no "
                f"partition {partition}"
            )
    return list(options.assigned)


def resolve_bounds(
    connection: GatewayConnection,
    partitions: Sequence[TopicPartition],
    *,
    retry_unknown_topic: bool = True,
) -> dict[TopicPartition, Bounds]:
    """[earliest, high watermark) of each partition; ``retry_unknown_topic`` False: a
    partition gone since it was listed raises UnknownTopicOrPartitionError at once."""
    raw = connection.bounds(partitions, retry_unknown_topic=retry_unknown_topic)
    return {tp: Bounds(b.earliest, b.latest) for tp, b in raw.items()}


def resolve_timestamps(
    connection: GatewayConnection,
    options: ReadOptions,
    bounds: dict[TopicPartition, Bounds],
) -> dict[TopicPartition, int]:
    """Start offsets from ``startingOffsetsByTimestamp`` / ``startingTimestamp``."""
    spec = options.starting_timestamp
    assert spec is not None
    wanted: dict[TopicPartition, int] = {}
    if spec.per_partition is not None:
        unknown = sorted(set(spec.per_partition) - set(bounds))
        if unknown:
            raise ConfigError(
                "startingOffsetsByTimestamp names partitions that are not being read: "
                + ", ".join(f"{t}-{p}" for t, p in unknown)
            )
        missing = sorted(set(bounds) - set(spec.per_partition))
        if missing and spec.all_partitions_ms is None:
            raise ConfigError(
                "startingOffsetsByTimestamp must give a timestamp for every partition read; "
                "missing: " + ", ".join(f"{t}-{p}" for t, p in missing)
            )
        wanted.update(spec.per_partition)
    for tp in bounds:
        if tp not in wanted:
            assert spec.all_partitions_ms is not None
            wanted[tp] = spec.all_partitions_ms
    result: dict[TopicPartition, int] = {}
    for timestamp_ms in sorted(set(wanted.values())):
        group = [tp for tp, ts in wanted.items() if ts == timestamp_ms]
        found = connection.list_offsets(group, common_pb2.BY_TIMESTAMP, timestamp_ms)
        for tp in group:
            offset = found[tp][0]
            if offset < 0:
                if spec.strategy == "error":
                    raise OffsetOutOfRangeError(
                        f"{tp[0]}-{tp[1]} has no record with timestamp >= {timestamp_ms}; "
                        "set startingOffsetsByTimestampStrategy=latest to start at the end"
                    )
                offset = bounds[tp].latest
            result[tp] = offset
    return result


FetchFunction = Callable[[int, int], storage_pb2.FetchPartitionResult]
"""``fetch(offset, max_bytes)``: one long-poll fetch of a range's partition, errors raised.
UNKNOWN_TOPIC_OR_PARTITION is retried while the metadata lists the partition, raised at
once when it does not (``partition_gone``)."""

PlannedPartitionState = Literal["listed", "deleted", "recreated"]


def planned_partition_state(
    connection: GatewayConnection, topic: str, partition: int, topic_id: str
) -> PlannedPartitionState:
    """Whether the partition a range was planned in still exists, as the gateway's
    metadata has it now: ``"recreated"`` when it names another id than ``topic_id`` (the
    incarnation planned; "" checks nothing), ``"deleted"`` when it lists no such topic or
    partition. A fetch's UNKNOWN_TOPIC_OR_PARTITION alone does not tell: a leader that has
    not heard of its new role yet answers it too, and that passes."""
    (found,) = connection.metadata([topic]).topics
    if found.error.code == common_pb2.UNKNOWN_TOPIC_OR_PARTITION:
        return "deleted"
    raise_for(found.error, f"metadata of topic {topic!r}")
    if topic_id and found.topic_id and found.topic_id != topic_id:
        return "recreated"
    return "listed" if partition < len(found.partitions) else "deleted"


def partition_gone(
    connection: GatewayConnection, topic: str, partition: int, topic_id: str
) -> bool:
    """For a fetcher's retry loop after UNKNOWN_TOPIC_OR_PARTITION: whether to stop
    retrying (``planned_partition_state``); a metadata question that failed is no answer,
    so the fetch is retried as after any retriable failure."""
    try:
        return planned_partition_state(connection, topic, partition, topic_id) != "listed"
    except TidelogError:
        return False


def _fetch_through_gateway(
    connection: GatewayConnection,
    topic: str,
    partition: int,
    offset: int,
    max_bytes: int,
    *,
    topic_id: str,
) -> storage_pb2.FetchPartitionResult:
    """One fetch through the gateway, retried after a retriable failure (a leader that
    died or moved, the gateway busy) for up to the request timeout from the first one, as
    direct mode's ``PartitionFetcher`` does: the gateway answers a leader's failure as it
    comes, and a task that failed on it failed the query (Spark's own task retries came
    too soon to find the new leader). OFFSET_OUT_OF_RANGE and other final errors are
    raised at once, and so is UNKNOWN_TOPIC_OR_PARTITION once the metadata confirms it
    (``partition_gone``): waiting for a deleted topic used to fail the query after the
    request timeout, failOnDataLoss=false or not."""
    give_up_at: float | None = None
    while True:
        try:
            return connection.fetch(topic, partition, offset, max_bytes, topic_id=topic_id)
        except TidelogError as exc:
            if not exc.retriable:
                raise
            if isinstance(exc, UnknownTopicOrPartitionError) and partition_gone(
                connection, topic, partition, topic_id
            ):
                raise
            now = time.monotonic()
            give_up_at = give_up_at or now + connection.timeout_s
            if now >= give_up_at:
                raise
        time.sleep(FETCH_RETRY_BACKOFF_S)


def read_range(
    connection: GatewayConnection,
    offset_range: OffsetRange,
    *,
    include_headers: bool,
    fail_on_data_loss: bool,
    fetch_max_bytes: int,
    fetch: FetchFunction | None = None,
    topic_id: str = "",
) -> Iterator[Any]:
    """The records of ``offset_range`` as pyarrow RecordBatches in the source schema.

    ``fetch`` reads the partition (default: through the gateway of ``connection``, which
    also answers the bounds looked up when retention removed offsets of the range).
    ``topic_id`` is the incarnation of the topic the range was planned in: fetches name
    it, and a topic deleted and created again since is data loss (the range's offsets
    name records of the topic that is gone), not the new topic's records read as if they
    were the planned ones. ``fetch`` must name it too, and give up on
    UNKNOWN_TOPIC_OR_PARTITION once ``partition_gone``: data loss as well."""
    import pyarrow as pa  # noqa: PLC0415  # executors only
    import pyarrow.compute as pc  # noqa: PLC0415

    topic, partition = offset_range.topic, offset_range.partition
    position, end = offset_range.start, offset_range.end
    topic_scalar = pa.scalar(topic, pa.string())
    partition_scalar = pa.scalar(partition, pa.int32())
    if fetch is None:

        def fetch(offset: int, max_bytes: int) -> storage_pb2.FetchPartitionResult:
            return _fetch_through_gateway(
                connection, topic, partition, offset, max_bytes, topic_id=topic_id
            )

    stalled_since: float | None = None
    while position < end:
        loss: DataLoss | None = None
        try:
            result = fetch(position, fetch_max_bytes)
        except OffsetOutOfRangeError:
            loss = _lost_range(connection, topic, partition, position, end)
            if loss is None:
                raise
        except UnknownTopicOrPartitionError:
            # Raised once the metadata no longer lists the partition, or when the request
            # timeout ran out on one it still lists (not data loss: raised).
            state = planned_partition_state(connection, topic, partition, topic_id)
            if state == "listed":
                raise
            if state == "recreated":  # and the new topic has no such partition
                loss = _recreated(topic, partition, topic_id, position, end)
            else:
                loss = DataLoss(
                    topic,
                    partition,
                    "the partition no longer exists (topic deleted since this batch was "
                    f"planned): offsets [{position}, {end}) were not read",
                    None,
                )
        except InconsistentTopicIdError:
            loss = _recreated(topic, partition, topic_id, position, end)
        # Handled outside the except block: the loss explains the out-of-range answer, so
        # a failure shows one line, not that answer's traceback too.
        if loss is not None:
            raise_for_data_loss([loss], fail_on_data_loss=fail_on_data_loss)
            warn_data_loss([loss])
            position = end if loss.resume_at is None else loss.resume_at
            continue
        # One batch at a time: a batch whose body breaks what a decoder checks (brokers
        # check only headers and checksums) fails the task naming it, after the valid
        # batches before it, as Kafka's source fails the query on a corrupt record.
        batches, bad = decode_valid_batches(result.records)
        if bad is not None and bad.header is not None and bad.header.base_offset >= end:
            bad = None  # past the range: not this task's to read
        if bad is not None and not batches:
            raise CorruptBatchError(_invalid_batch_message(offset_range, bad, position))
        if not batches and 0 <= result.log_end_offset < end:
            # The leader's log ends inside the planned range, so its rest will never be
            # these records (a leader elected from the ISR holds everything below the high
            # watermark the range was planned against): the topic was re-created or the
            # log truncated. Waiting used to end in a timeout after READ_STALL_TIMEOUT_S.
            loss = DataLoss(
                topic,
                partition,
                f"the log now ends at offset {result.log_end_offset}, inside the offsets "
                f"[{offset_range.start}, {end}) planned for this task (topic deleted and "
                "re-created, or log truncated?)",
                end,
            )
            raise_for_data_loss([loss], fail_on_data_loss=fail_on_data_loss)
            warn_data_loss([loss])
            position = end
            continue
        if not batches:
            # The planned end was below a high watermark; a new leader may not have
            # reached it yet. Wait (the fetch itself long-polls), but not forever.
            now = time.monotonic()
            stalled_since = stalled_since or now
            if now - stalled_since > READ_STALL_TIMEOUT_S:
                raise RequestTimedOutError(
                    f"{topic}-{partition}: offset {position} did not become readable within "
                    f"{READ_STALL_TIMEOUT_S:.0f} s (high watermark {result.high_watermark})"
                )
            continue
        stalled_since = None
        for batch in batches:
            if batch.last_offset < position:
                continue
            if batch.base_offset >= end:
                position = end
                break
            records = batch.to_arrow()
            first = position - batch.base_offset
            count = min(end, batch.last_offset + 1) - position
            records = records.slice(first, count)
            timestamp_type = 1 if batch.header.attributes & ATTR_TIMESTAMP_LOG_APPEND else 0
            yield _to_source_schema(
                pa,
                pc,
                records,
                topic=topic_scalar,
                partition=partition_scalar,
                timestamp_type=timestamp_type,
                include_headers=include_headers,
            )
            position += count
        if bad is not None and position < end:
            raise CorruptBatchError(_invalid_batch_message(offset_range, bad, position))


def _invalid_batch_message(offset_range: OffsetRange, bad: InvalidBatch, start: int) -> str:
    """What fails a task at an invalid batch that starts at ``start`` (when its header
    is known, at ``bad.header.base_offset``)."""
    if bad.header is None:
        where = f"at offset {start} (its header is damaged, so where it ends is unknown)"
    else:
        where = f"at offsets {bad.header.base_offset}..{bad.header.last_offset}"
    return (
        f"topic {offset_range.topic!r} partition {offset_range.partition}: the record batch "
        f"{where} is invalid ({bad.reason}); the task reading offsets "
        f"[{offset_range.start}, {offset_range.end}) fails rather than skip its records "
        "(start the query past it to skip them)"
    )


def _recreated(topic: str, partition: int, topic_id: str, position: int, end: int) -> DataLoss:
    """Final for this range: its offsets name records of an incarnation that is gone; the
    next micro-batch's plan starts the new topic at its beginning."""
    return DataLoss(
        topic,
        partition,
        "the topic was deleted and created again since this batch was planned (topic id "
        f"{topic_id}): offsets [{position}, {end}) of the topic planned were not read",
        end,
    )


def _lost_range(
    connection: GatewayConnection, topic: str, partition: int, position: int, end: int
) -> DataLoss | None:
    """What an out-of-range answer at ``position`` means, None if not data loss.

    The task's range was planned against bounds that no longer hold: retention deleted its
    start since, or the log is now shorter than the range (topic re-created, log
    truncated); the rest of such a range is skipped."""
    bounds = connection.bounds([(topic, partition)])[(topic, partition)]
    if position < bounds.earliest:
        return deleted_before_read(topic, partition, position, bounds.earliest)
    if position > bounds.latest:
        return DataLoss(
            topic,
            partition,
            f"the log now ends at offset {bounds.latest}, below the offsets [{position}, "
            f"{end}) planned for this task (topic deleted and re-created, or log truncated?)",
            end,
        )
    return None


def _to_source_schema(
    pa: Any,
    pc: Any,
    records: Any,
    *,
    topic: Any,
    partition: Any,
    timestamp_type: int,
    include_headers: bool,
) -> Any:
    n = records.num_rows
    timestamps_ms = records.column("timestamp_ms")
    try:
        # Checked, as Kafka's Spark source converts with Math.multiplyExact: a timestamp
        # the log accepts (any int64 ms) past what microseconds hold wrapped silently
        # into a wrong date (found by an audit).
        timestamps_us = pc.multiply_checked(timestamps_ms, 1000)
    except pa.ArrowInvalid:
        too_far = pc.indices_nonzero(pc.greater(pc.abs(timestamps_ms), MAX_SPARK_TIMESTAMP_MS))
        first = too_far[0].as_py()
        raise InvalidRecordError(
            f"{topic}-{partition} offset {records.column('offset')[first].as_py()}: timestamp "
            f"{timestamps_ms[first].as_py()} ms is beyond Spark's timestamps (microseconds "
            f"in an int64: at most {MAX_SPARK_TIMESTAMP_MS} ms)"
        ) from None
    timestamps_us = timestamps_us.cast(pa.timestamp("us", tz="UTC"))
    columns = [
        records.column("key"),
        records.column("value"),
        pa.repeat(topic, n),
        pa.repeat(partition, n),
        records.column("offset"),
        timestamps_us,
        pa.repeat(pa.scalar(timestamp_type, pa.int32()), n),
    ]
    names = ["key", "value", "topic", "partition", "offset", "timestamp", "timestampType"]
    if include_headers:
        columns.append(_null_when_empty(pa, pc, records.column("headers")))
        names.append("headers")
    return pa.RecordBatch.from_arrays(columns, names=names)


def _null_when_empty(pa: Any, pc: Any, headers: Any) -> Any:
    """A record without headers has ``headers = null``, as in Spark's Kafka source (its
    row converter gives null for an empty header list), not an empty array. One Arrow
    kernel per batch: the list's validity is "has at least one header"."""
    if isinstance(headers, pa.ChunkedArray):
        headers = headers.combine_chunks()
    empty = pc.equal(pc.list_value_length(headers), 0)
    offsets = pc.subtract(headers.offsets, headers.offsets[0])  # a slice's own offsets
    return pa.ListArray.from_arrays(offsets, headers.flatten(), mask=empty)
