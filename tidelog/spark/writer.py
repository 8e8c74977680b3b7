"""Spark writes to tidelog: batch (``df.write``) and streaming (``df.writeStream``).

Each Spark task gets Arrow record batches of its rows with the columns Spark's Kafka
sink knows: ``value`` (required; binary or string), ``key``, ``topic``, ``partition``,
``headers``; other columns are ignored. A row goes to its ``partition`` value if set,
else to the partition Kafka's default partitioner picks for its key (murmur2), else to
the task's sticky partition. Rows are grouped per destination with Arrow kernels,
encoded with ``encode_batch_arrow`` (no Python per record except key hashing) and sent
in produce requests of several partitions each; two requests may be in flight, never two
with the same partition, so the records of a partition keep their order. With
``direct=true`` each partition of a request goes in an ``Append`` to its leader instead
(``tidelog.spark.direct``): same batches, same order rule, same answers to check.

Delivery guarantees (stated precisely in docs/SPARK.md):

- at-least-once (default): a task answers success only after every batch was
  acknowledged at the requested ``acks``; a failed task is retried by Spark and may
  write some records twice.
- exactly-once (streaming, ``deliveryGuarantee=exactly-once``): every task of a
  micro-batch writes as an idempotent producer fixed by (query id, batch id, task),
  records of each partition in a canonical order, so a replayed micro-batch resends
  identical batches with identical sequence numbers and the brokers drop them as
  duplicates. The producer id is the task's across ``EXACTLY_ONCE_EPOCHS`` consecutive
  micro-batches and the batch id picks the producer epoch, so each partition remembers
  one producer per task of a query (a new epoch replaces the old one's state) instead
  of one per task of every micro-batch for ``producer.id.expiration.ms``: at a
  micro-batch a second, that was ~86,000 producers a day per task in every partition's
  memory and snapshots. A straggler of an earlier micro-batch is fenced (older epoch).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import BinaryType, IntegerType, StringType, StructType

from tidelog import formats
from tidelog.client import GatewayConnection, raise_for
from tidelog.errors import ConfigError, InvalidRequestError, error_for_code
from tidelog.partitioner import murmur2_partitions
from tidelog.records import arrow_record_bytes, batch_cuts, encode_batch_arrow
from tidelog.spark.direct import Appender
from tidelog.spark.options import WriteOptions, parse_write_options
from tidelog.spark.retries import retrying
from tidelog.v1 import common_pb2

REQUEST_BYTES: Final = 8 * 1024 * 1024
"""Batches are sent once this many bytes are pending: big requests amortize the hops."""
MAX_REQUESTS_IN_FLIGHT: Final = 2

_ACKS: Final = {"0": common_pb2.NONE_ACKS, "1": common_pb2.LEADER, "all": common_pb2.ALL}


@dataclass(frozen=True)
class WriteSummary(WriterCommitMessage):
    """What one task wrote: rows and batches (reported to the driver's commit)."""

    rows: int
    batches: int


def check_topic_option(options: WriteOptions) -> None:
    """On the driver, before any task runs: the gateway answers and knows the `topic`
    option's topic (else every task would fail on it, each retried by Spark). Topics named
    only by a `topic` column are checked by the tasks that meet them."""
    if options.topic is None:
        return
    connection = GatewayConnection.get(options.gateway, options.request_timeout_ms)
    (topic,) = retrying(
        lambda: connection.metadata([options.topic or ""]).topics,
        options.request_timeout_ms / 1000,
    )
    raise_for(topic.error, f"topic {options.topic!r}")


def batch_limit_bytes(batch_bytes: int, topic: Any) -> int:
    """How large a batch to ``topic`` (its metadata) is cut: ``batchBytes``, or less where
    the topic's max.message.bytes is smaller, as a Kafka producer's batches never outgrow
    what the topic takes. Cut at batchBytes whatever the topic, small records to a topic
    with a lowered limit failed the write with MESSAGE_TOO_LARGE (found by an audit). (A
    limit changed between an exactly-once batch and its replay cuts the replay
    differently; its sequence numbers then do not match what was written.)"""
    configs = {c.name: c.value for c in topic.configs}
    limit = int(configs.get("max.message.bytes", formats.DEFAULT_MAX_MESSAGE_BYTES))
    return min(batch_bytes, limit)


def check_schema(schema: StructType, options: WriteOptions) -> None:
    """Reject a schema the sink cannot write, before any task runs."""
    fields = {field.name.lower(): field for field in schema.fields}
    if "value" not in fields:
        raise ConfigError("the data to write needs a 'value' column (binary or string)")
    for name in ("key", "value"):
        if name in fields and not isinstance(fields[name].dataType, BinaryType | StringType):
            raise ConfigError(
                f"column {name!r} must be binary or string, "
                f"not {fields[name].dataType.simpleString()}"
            )
    if (
        "topic" in fields
        and options.topic is None
        and not isinstance(fields["topic"].dataType, StringType)
    ):
        # With the option set the column is not read (Spark's Kafka sink does the same).
        raise ConfigError("column 'topic' must be a string")
    if "topic" not in fields and options.topic is None:
        raise ConfigError("set the 'topic' option or give the data a 'topic' column")
    if "partition" in fields and not isinstance(fields["partition"].dataType, IntegerType):
        raise ConfigError("column 'partition' must be an int")
    if "headers" in fields:
        text = fields["headers"].dataType.simpleString()
        if text != "array<struct<key:string,value:binary>>":
            raise ConfigError(
                f"column 'headers' must be array<struct<key:string,value:binary>>, not {text}"
            )


class _TaskWriter:
    """Writes one task's rows; see the module docstring. Not thread-safe (one per task)."""

    def __init__(
        self,
        options: WriteOptions,
        sticky_seed: int | None,
        identity: TaskIdentity | None = None,
    ) -> None:
        self.options = options
        # Exactly-once: the task's identity (query id, batch id, partition) fixes the
        # producer id and epoch; sequences count the task's records per partition from 0.
        self.identity = identity
        self.producer_id, self.producer_epoch = (
            (-1, -1) if identity is None else exactly_once_producer(identity)
        )
        self.sequences: dict[tuple[str, int], int] = {}
        if identity is not None:
            seed = str(identity).encode()
            sticky_seed = int.from_bytes(hashlib.sha256(seed).digest()[8:16])
        self.connection = GatewayConnection.get(options.gateway, options.request_timeout_ms)
        # direct=true: requests go to the leaders (closed when the task's write ends).
        self.appender = Appender(self.connection) if options.direct else None
        self.partition_counts: dict[str, int] = {}
        self.batch_limits: dict[str, int] = {}  # per topic: batch_limit_bytes
        self.sticky: dict[str, int] = {}
        self.random = random.Random(sticky_seed)
        self.pending: list[tuple[str, int, bytes]] = []
        self.pending_bytes = 0
        # Requests sent: how to wait for each one's answer, its partitions, its batches.
        self.in_flight: list[
            tuple[Callable[[], list[Any]], set[tuple[str, int]], list[tuple[str, int, bytes]]]
        ] = []
        self.timeout_s = options.request_timeout_ms / 1000
        self.rows = 0
        self.batches = 0

    def partitions_of(self, topic: str) -> int:
        count = self.partition_counts.get(topic)
        if count is None:
            (found,) = retrying(lambda: self.connection.metadata([topic]).topics, self.timeout_s)
            raise_for(found.error, f"topic {topic!r}")
            count = self.partition_counts[topic] = len(found.partitions)
            self.batch_limits[topic] = batch_limit_bytes(self.options.batch_bytes, found)
        return count

    def write(self, batches: Iterator[Any]) -> WriteSummary:
        try:
            return self._write(batches)
        finally:
            if self.appender is not None:
                self.appender.close()

    def _write(self, batches: Iterator[Any]) -> WriteSummary:
        if self.identity is not None:
            # A replay must cut the same batches from the same rows, whatever order Spark
            # delivers them in this time: collect the task's rows, then sort them.
            import pyarrow as pa  # noqa: PLC0415  # executors only

            collected = [b for b in batches if b.num_rows]
            if collected:
                table = pa.Table.from_batches(collected)
                for batch in _canonical(table).to_batches(max_chunksize=table.num_rows):
                    self._write_batch(batch)
        else:
            for batch in batches:
                if batch.num_rows:
                    self._write_batch(batch)
        self._drain()
        return WriteSummary(self.rows, self.batches)

    def _write_batch(self, batch: Any) -> None:
        import pyarrow as pa  # noqa: PLC0415  # executors only
        import pyarrow.compute as pc  # noqa: PLC0415

        columns = {name.lower(): batch.column(i) for i, name in enumerate(batch.schema.names)}
        n = batch.num_rows
        topics = columns.get("topic")
        if self.options.topic is not None:
            # The option overrides a topic column, as in Spark's Kafka sink: a copy of a
            # tidelog (or Kafka) read, which always has that column, goes to the option's
            # topic, not back into the topics it was read from.
            topics = pa.repeat(pa.scalar(self.options.topic, pa.string()), n)
        elif topics is None:
            raise InvalidRequestError("no 'topic' column and no 'topic' option")  # check_schema
        elif topics.null_count:
            raise InvalidRequestError("a row has a null 'topic' and no 'topic' option is set")
        for topic_scalar in pc.unique(topics).to_pylist():
            topic = str(topic_scalar)
            rows = batch if len(pc.unique(topics)) == 1 else batch.filter(pc.equal(topics, topic))
            self._write_topic(pa, pc, topic, rows)

    def _write_topic(self, pa: Any, pc: Any, topic: str, batch: Any) -> None:
        count = self.partitions_of(topic)
        names = {name.lower(): i for i, name in enumerate(batch.schema.names)}
        n = batch.num_rows
        keys = batch.column(names["key"]).cast(pa.binary()) if "key" in names else None
        explicit = batch.column(names["partition"]) if "partition" in names else None
        if explicit is None and (keys is None or keys.null_count == n):
            destinations = None  # every row goes to the sticky partition
        else:
            destinations = self._destinations(pa, pc, topic, count, keys, explicit, n)
        values = batch.column(names["value"]).cast(pa.binary())
        headers = batch.column(names["headers"]) if "headers" in names else None
        if destinations is None:
            self._write_partition(topic, self._sticky(topic, count), values, keys, headers)
            return
        for partition in pc.unique(destinations).to_pylist():
            mask = pc.equal(destinations, partition)
            self._write_partition(
                topic,
                int(partition),
                values.filter(mask),
                None if keys is None else keys.filter(mask),
                None if headers is None else headers.filter(mask),
            )

    def _destinations(  # noqa: PLR0917 - private helper, named at its one call site
        self, pa: Any, pc: Any, topic: str, count: int, keys: Any, explicit: Any, n: int
    ) -> Any:
        sticky = self._sticky(topic, count)
        by_key = (
            pa.array(murmur2_partitions(keys.to_pylist(), count, default=sticky), pa.int32())
            if keys is not None
            else pa.repeat(pa.scalar(sticky, pa.int32()), n)
        )
        if explicit is None:
            return by_key
        if pc.any(pc.or_(pc.less(explicit, 0), pc.greater_equal(explicit, count))).as_py():
            raise InvalidRequestError(
                f"a row's 'partition' is outside topic {topic!r}'s partitions 0..{count - 1}"
            )
        return pc.coalesce(explicit, by_key)

    def _sticky(self, topic: str, count: int) -> int:
        partition = self.sticky.get(topic)
        if partition is None:
            partition = self.random.randrange(count)
            self.sticky[topic] = partition
        return partition

    def _write_partition(
        self, topic: str, partition: int, values: Any, keys: Any, headers: Any
    ) -> None:
        n = len(values)
        # Cut by the running total of each row's upper-bound size (framing and headers
        # included): counting only value and key bytes, or cutting at the average size,
        # made batches past batchBytes, and past the topic's max.message.bytes (1 MiB + 12
        # by default, batchBytes' default + 12).
        self.partitions_of(topic)  # (its batch limit)
        cuts = batch_cuts(arrow_record_bytes(values, keys, headers), self.batch_limits[topic])
        for start, stop, _ in cuts:
            sequence = -1
            if self.identity is not None:
                sequence = self.sequences.get((topic, partition), 0)
                self.sequences[(topic, partition)] = sequence + (stop - start)
                if any(t == topic and p == partition for t, p, _ in self.pending):
                    # One batch per partition per request: a replay's batch is then
                    # answered as a duplicate on its own, never refused for being
                    # mixed with batches the earlier attempt did not write.
                    self._send()
            records = encode_batch_arrow(
                values.slice(start, stop - start),
                None if keys is None else keys.slice(start, stop - start),
                None if headers is None else headers.slice(start, stop - start),
                compression=self.options.compression,
                producer_id=self.producer_id,
                producer_epoch=self.producer_epoch,
                base_sequence=sequence,
            )
            self.pending.append((topic, partition, records))
            self.pending_bytes += len(records)
            self.rows += stop - start
            self.batches += 1
            if self.pending_bytes >= REQUEST_BYTES:
                self._send()
        # Like Kafka's sticky partitioner: move on once a partition got a batch's worth
        # (exactly-once keeps one partition per task and topic: replays must agree).
        if topic in self.sticky and n and self.identity is None:
            self.sticky[topic] = self.random.randrange(self.partitions_of(topic))

    def _send(self) -> None:
        """Start a request with the pending batches. Up to two requests are in flight (the
        next one is encoded while the previous travels), but never two holding the same
        partition, whose records would then race; exactly-once sends one at a time."""
        if not self.pending:
            return
        pending, self.pending, self.pending_bytes = self.pending, [], 0
        # One entry per partition (the gateway refuses a partition twice in a request);
        # its batches stay in the order they were cut.
        merged: dict[tuple[str, int], list[bytes]] = {}
        for topic, partition, records in pending:
            merged.setdefault((topic, partition), []).append(records)
        items = [(t, p, b"".join(chunks)) for (t, p), chunks in merged.items()]
        partitions = set(merged)
        while self.in_flight and (
            self.identity is not None
            or len(self.in_flight) >= MAX_REQUESTS_IN_FLIGHT
            or any(partitions & tps for _, tps, _ in self.in_flight)
        ):
            self._finish(*self.in_flight.pop(0))
        self.in_flight.append((self._start(items), partitions, items))

    def _start(self, items: list[tuple[str, int, bytes]]) -> Callable[[], list[Any]]:
        produce_async = (
            self.connection.produce_async if self.appender is None else self.appender.append_async
        )
        return produce_async(items, _ACKS[self.options.acks], self.options.request_timeout_ms)

    def _drain(self) -> None:
        self._send()
        while self.in_flight:
            self._finish(*self.in_flight.pop(0))

    def _finish(
        self,
        wait: Callable[[], list[Any]],
        partitions: set[tuple[str, int]],
        items: list[tuple[str, int, bytes]],
    ) -> None:
        """Wait for a request's answer; the batches refused with a retriable error (the
        gateway restarting, a leader moving, too few in-sync replicas) are sent again,
        the same bytes, for up to requestTimeoutMs, as Kafka's producer retries within
        its delivery timeout: a task failed at the first refused connection, and with it
        the job (found by an audit). No other request of these partitions is in flight
        meanwhile (``_send``), so their order holds; exactly-once writes resend the same
        sequence numbers, which the leader answers as duplicates once written. At least
        once, a batch whose answer was lost may be written twice."""
        del partitions  # (the request's; what is resent is what failed)
        pending: Callable[[], list[Any]] | None = wait

        def attempt() -> None:
            nonlocal pending, items
            if pending is None:
                pending = self._start(items)
            try:
                results = pending()
            finally:
                pending = None  # answered or failed: the next attempt sends again
            failed = {
                (r.topic, r.partition): error_for_code(
                    int(r.error.code), f"writing to {r.topic}-{r.partition}: {r.error.message}"
                )
                for r in results
                if r.error.code != common_pb2.NONE
            }
            if not failed:
                return
            final = next((e for e in failed.values() if not e.retriable), None)
            if final is not None:
                raise final
            items = [item for item in items if (item[0], item[1]) in failed]
            raise next(iter(failed.values()))

        retrying(attempt, self.timeout_s)


EXACTLY_ONCE_PRODUCER_IDS: Final = 2**62
"""Producer ids at and above this are derived from task identities (below it, the
controller hands ids out in blocks from 0, and never gets near 2^62)."""


EXACTLY_ONCE_EPOCHS: Final = 32_767
"""Micro-batches that share a task's producer id, their batch ids modulo this being its
epochs (a producer epoch is an int16; Kafka's are too)."""


class TaskIdentity(NamedTuple):
    """A streaming write task: the same in every attempt and after a restart from the
    checkpoint (Spark replays a micro-batch with the same batch id and task partitions)."""

    query_id: str
    batch_id: int
    partition: int

    def __str__(self) -> str:
        return f"{self.query_id}/{self.batch_id}/{self.partition}"


def exactly_once_producer(identity: TaskIdentity) -> tuple[int, int]:
    """(producer id, producer epoch) of a streaming task. The id is a hash of (query id,
    task partition, batch id // ``EXACTLY_ONCE_EPOCHS``) into the upper quarter of the id
    space, and the epoch the batch id modulo ``EXACTLY_ONCE_EPOCHS``: every attempt of a
    task gets the same pair, and the task's next micro-batch the next epoch of the same
    id (module docstring)."""
    era, epoch = divmod(identity.batch_id, EXACTLY_ONCE_EPOCHS)
    key = f"{identity.query_id}/{identity.partition}/{era}".encode()
    digest = hashlib.sha256(key).digest()
    producer_id = EXACTLY_ONCE_PRODUCER_IDS + int.from_bytes(digest[:8]) % EXACTLY_ONCE_PRODUCER_IDS
    return producer_id, epoch


def task_identity() -> TaskIdentity:
    """The running streaming write task's (query id, batch id, partition id)."""
    from pyspark import TaskContext  # noqa: PLC0415  # executors only

    context = TaskContext.get()
    query_id = context.getLocalProperty("sql.streaming.queryId") if context else None
    batch_id = context.getLocalProperty("streaming.sql.batchId") if context else None
    if context is None or not query_id or batch_id is None:
        raise InvalidRequestError(
            "deliveryGuarantee=exactly-once needs a streaming query's task context "
            "(query id and batch id); it is not available here"
        )
    return TaskIdentity(query_id, int(batch_id), context.partitionId())


def _canonical(table: Any) -> Any:
    """The rows in an order that depends only on their content (topic, partition, key,
    value), so every attempt cuts identical batches."""
    names = {name.lower(): name for name in table.column_names}
    order = [(names[c], "ascending") for c in ("topic", "partition", "key", "value") if c in names]
    return table.sort_by(order)


class TidelogBatchWriter(DataSourceArrowWriter):
    """``df.write.format("tidelog")``: at-least-once, see the module docstring."""

    def __init__(
        self, options: Mapping[str, str], schema: StructType, *, env_gateway: str | None
    ) -> None:
        self.options = parse_write_options(options, streaming=False, env_gateway=env_gateway)
        check_schema(schema, self.options)
        check_topic_option(self.options)

    def write(self, iterator: Iterator[Any]) -> WriteSummary:
        return _TaskWriter(self.options, sticky_seed=None).write(iterator)


class TidelogStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("tidelog")``."""

    def __init__(
        self, options: Mapping[str, str], schema: StructType, *, env_gateway: str | None
    ) -> None:
        self.options = parse_write_options(options, streaming=True, env_gateway=env_gateway)
        check_schema(schema, self.options)
        check_topic_option(self.options)

    def write(self, iterator: Iterator[Any]) -> WriteSummary:
        identity = task_identity() if self.options.exactly_once else None
        return _TaskWriter(self.options, sticky_seed=None, identity=identity).write(iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        pass

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        pass
