"""``tidelog.Consumer``: read partitions through a gateway, optionally as a consumer group.

A consumer owns a position per assigned partition (the next offset to read). ``poll``
fetches from every assigned partition in one long-poll request, decodes the batches and
returns records in offset order per partition; positions advance past what was returned.
Records come from below the high watermark only, so nothing a consumer sees can later
disappear.

Where a partition starts: the group's committed offset when ``group_id`` is set and the
group committed one; else ``auto_offset_reset`` ("latest", Kafka's default, or
"earliest"; "none" raises ``OffsetOutOfRangeError``). An offset that falls out of range
(retention deleted it) is reset the same way.

Group offsets are committed with ``commit()`` (the positions, or given offsets) and, with
``enable_auto_commit``, every ``auto_commit_interval_ms`` during ``poll`` and on
``close``. There is no group membership protocol: ``subscribe`` assigns every partition
of the topics to this consumer (partitions added later are picked up on the next
metadata refresh); split work between consumers with ``assign``.

Not thread-safe, like Kafka's consumer: use one per thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, Final, NamedTuple

import grpc

from tidelog.batch import next_offset_after
from tidelog.client import GatewayConnection, error_from_rpc, raise_for
from tidelog.errors import (
    ConfigError,
    ErrorCode,
    OffsetOutOfRangeError,
    TidelogError,
    error_for_code,
)
from tidelog.records import Header, RecordBatch, arrow_schema, decode_batches
from tidelog.v1 import common_pb2, gateway_pb2, storage_pb2

TopicPartition = tuple[str, int]

AUTO_OFFSET_RESETS: Final = ("latest", "earliest", "none")
METADATA_REFRESH_S: Final = 30.0
"""How often ``subscribe`` looks for partitions added to its topics (Kafka's
metadata.max.age.ms is 5 minutes; topics here grow rarely but users expect it sooner)."""
RETRY_BACKOFF_S: Final = 0.1


class ConsumerRecord(NamedTuple):
    """One record as a consumer sees it."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[Header, ...]


class _Chunk:
    """One fetched batch of one partition, decoded lazily: to records for ``poll``, to
    Arrow for ``poll_arrow``. ``skip`` records at its start were read before."""

    __slots__ = ("_records", "batch", "skip", "tp")

    def __init__(self, tp: TopicPartition, batch: RecordBatch, skip: int) -> None:
        self.tp = tp
        self.batch = batch
        self.skip = skip
        self._records: list[ConsumerRecord] | None = None

    def records(self) -> list[ConsumerRecord]:
        if self._records is None:
            records = self.batch.records_as(ConsumerRecord, self.tp[0], self.tp[1])
            self._records = records[self.skip :] if self.skip else records
        return self._records

    def keep_records(self, rest: list[ConsumerRecord]) -> None:
        """What is left after a partial take (as records from now on)."""
        self._records = rest

    def arrow(self, pa: Any) -> Any:
        if self._records is not None:
            rows = self._records
            return pa.Table.from_pydict(
                {
                    "topic": pa.array([r.topic for r in rows], pa.string()),
                    "partition": pa.array([r.partition for r in rows], pa.int32()),
                    "offset": pa.array([r.offset for r in rows], pa.int64()),
                    "timestamp_ms": pa.array([r.timestamp_ms for r in rows], pa.int64()),
                    "key": pa.array([r.key for r in rows], pa.binary()),
                    "value": pa.array([r.value for r in rows], pa.binary()),
                    "headers": pa.array(
                        [[{"key": k, "value": v} for k, v in r.headers] for r in rows],
                        arrow_schema().field("headers").type,
                    ),
                },
                schema=_consumer_schema(pa),
            )
        batch = self.batch.to_arrow()
        if self.skip:
            batch = batch.slice(self.skip)
        n = batch.num_rows
        table = pa.Table.from_batches([batch])
        schema = _consumer_schema(pa)
        table = table.add_column(
            0, schema.field("partition"), pa.repeat(pa.scalar(self.tp[1], pa.int32()), n)
        )
        return table.add_column(
            0, schema.field("topic"), pa.repeat(pa.scalar(self.tp[0], pa.string()), n)
        )


def _consumer_schema(pa: Any) -> Any:
    """``poll_arrow``'s schema: topic and partition, then ``records.arrow_schema()``."""
    return pa.schema(
        [
            pa.field("topic", pa.string(), nullable=False),
            pa.field("partition", pa.int32(), nullable=False),
            *arrow_schema(),
        ]
    )


class Consumer:
    """See the module docstring."""

    def __init__(
        self,
        gateway: str | None = None,
        group_id: str | None = None,
        *,
        auto_offset_reset: str = "latest",
        enable_auto_commit: bool = True,
        auto_commit_interval_ms: int = 5_000,
        fetch_min_bytes: int = 1,
        fetch_max_wait_ms: int = 500,
        fetch_max_bytes: int = 50 * 1024 * 1024,
        max_partition_fetch_bytes: int = 1024 * 1024,
        max_poll_records: int = 500,
        request_timeout_ms: int = 30_000,
    ) -> None:
        if auto_offset_reset not in AUTO_OFFSET_RESETS:
            raise ConfigError(
                f"auto_offset_reset {auto_offset_reset!r} must be one of {AUTO_OFFSET_RESETS}"
            )
        if group_id is not None and not group_id:
            raise ConfigError("group_id must not be empty (None for no group)")
        for name, value in (
            ("fetch_max_wait_ms", fetch_max_wait_ms),
            ("fetch_max_bytes", fetch_max_bytes),
            ("max_partition_fetch_bytes", max_partition_fetch_bytes),
            ("max_poll_records", max_poll_records),
            ("auto_commit_interval_ms", auto_commit_interval_ms),
        ):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, not {value}")
        self._conn = GatewayConnection.get(gateway, request_timeout_ms)
        self.group_id = group_id
        self._reset = auto_offset_reset
        self._auto_commit = enable_auto_commit and group_id is not None
        self._auto_commit_interval_s = auto_commit_interval_ms / 1000
        self._min_bytes = fetch_min_bytes
        self._max_wait_ms = fetch_max_wait_ms
        self._max_bytes = fetch_max_bytes
        self._partition_max_bytes = max_partition_fetch_bytes
        self._max_poll_records = max_poll_records
        self._assignment: list[TopicPartition] = []
        self._subscription: list[str] = []
        self._positions: dict[TopicPartition, int] = {}
        self._needs_position: set[TopicPartition] = set()
        self._buffer: deque[_Chunk] = deque()
        self._last_commit = time.monotonic()
        self._last_refresh = 0.0
        self._committed_positions: dict[TopicPartition, int] = {}
        # A fetch started ahead of need: (the positions it reads from, its future).
        self._prefetch: tuple[dict[TopicPartition, int], Any] | None = None
        self._closed = False

    # --- assignment -----------------------------------------------------------------------

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """Read exactly these partitions (replaces any earlier assignment/subscription)."""
        wanted = list(dict.fromkeys((str(t), int(p)) for t, p in partitions))
        counts = self._conn.partition_counts(sorted({t for t, _ in wanted}))
        for topic, partition in wanted:
            if not 0 <= partition < counts[topic]:
                raise error_for_code(
                    ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
                    f"topic {topic!r} has {counts[topic]} partitions; partition {partition} "
                    "does not exist",
                )
        self._subscription = []
        self._set_assignment(wanted)

    def subscribe(self, topics: Sequence[str]) -> None:
        """Read every partition of ``topics`` (they must exist)."""
        if isinstance(topics, str):
            raise ConfigError("subscribe takes a list of topic names, not one string")
        self._subscription = list(dict.fromkeys(topics))
        self._refresh_subscription()

    def _refresh_subscription(self) -> None:
        counts = self._conn.partition_counts(self._subscription)
        self._last_refresh = time.monotonic()
        self._set_assignment([(t, p) for t in self._subscription for p in range(counts[t])])

    def _set_assignment(self, partitions: list[TopicPartition]) -> None:
        self._assignment = partitions
        keep = set(partitions)
        self._positions = {tp: o for tp, o in self._positions.items() if tp in keep}
        self._needs_position = {tp for tp in partitions if tp not in self._positions}
        self._buffer = deque(c for c in self._buffer if c.tp in keep)

    def assignment(self) -> list[TopicPartition]:
        return list(self._assignment)

    def unsubscribe(self) -> None:
        self._subscription = []
        self._set_assignment([])

    # --- positions ------------------------------------------------------------------------

    def _check_assigned(self, tp: TopicPartition) -> TopicPartition:
        tp = (str(tp[0]), int(tp[1]))
        if tp not in self._assignment:
            raise ConfigError(f"partition {tp[0]}-{tp[1]} is not assigned to this consumer")
        return tp

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Read ``tp`` from ``offset`` next."""
        tp = self._check_assigned(tp)
        if offset < 0:
            raise ConfigError(f"offset {offset} is negative; use seek_to_beginning/end")
        self._positions[tp] = offset
        self._needs_position.discard(tp)
        self._drop_buffered({tp})

    def seek_to_beginning(self, partitions: Iterable[TopicPartition] | None = None) -> None:
        self._seek_to(partitions, common_pb2.EARLIEST)

    def seek_to_end(self, partitions: Iterable[TopicPartition] | None = None) -> None:
        self._seek_to(partitions, common_pb2.LATEST)

    def _seek_to(
        self, partitions: Iterable[TopicPartition] | None, spec: common_pb2.OffsetSpec
    ) -> None:
        tps = (
            list(self._assignment)
            if partitions is None
            else [self._check_assigned(tp) for tp in partitions]
        )
        found = self._conn.list_offsets(tps, spec)
        for tp in tps:
            self._positions[tp] = found[tp][0]
            self._needs_position.discard(tp)
        self._drop_buffered(set(tps))

    def end_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """The high watermark of each partition: the offset after the last readable record
        (Kafka's ``endOffsets``)."""
        found = self._conn.list_offsets(list(partitions), common_pb2.LATEST)
        return {tp: offset for tp, (offset, _) in found.items()}

    def beginning_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """The first offset still retained in each partition."""
        found = self._conn.list_offsets(list(partitions), common_pb2.EARLIEST)
        return {tp: offset for tp, (offset, _) in found.items()}

    def position(self, tp: TopicPartition) -> int:
        """The offset of the next record ``poll`` returns for ``tp``."""
        tp = self._check_assigned(tp)
        self._ensure_positions()
        return self._positions[tp]

    def _drop_buffered(self, tps: set[TopicPartition]) -> None:
        self._buffer = deque(c for c in self._buffer if c.tp not in tps)

    def _ensure_positions(self) -> None:
        if not self._needs_position:
            return
        missing = sorted(self._needs_position)
        if self.group_id is not None:
            for tp, offset in self.committed(missing).items():
                if offset >= 0:
                    self._positions[tp] = offset
                    self._needs_position.discard(tp)
        self._reset_positions(sorted(self._needs_position))

    def _reset_positions(self, tps: list[TopicPartition]) -> None:
        if not tps:
            return
        if self._reset == "none":
            raise OffsetOutOfRangeError(
                f"no valid position for {', '.join(f'{t}-{p}' for t, p in tps)} and "
                "auto_offset_reset is 'none'"
            )
        spec = common_pb2.EARLIEST if self._reset == "earliest" else common_pb2.LATEST
        found = self._conn.list_offsets(tps, spec)
        for tp in tps:
            self._positions[tp] = found[tp][0]
            self._needs_position.discard(tp)

    # --- polling --------------------------------------------------------------------------

    def poll(self, max_records: int | None = None, timeout_ms: int = 1000) -> list[ConsumerRecord]:
        """Up to ``max_records`` records (default ``max_poll_records``), waiting at most
        ``timeout_ms`` for some to arrive; an empty list when none did."""
        self._wait_for_data(timeout_ms)
        return self._take(max_records or self._max_poll_records)

    def poll_arrow(self, max_records: int | None = None, timeout_ms: int = 1000) -> Any:
        """Like ``poll``, as a ``pyarrow.Table`` (topic, partition, offset, timestamp_ms,
        key, value, headers) built by Arrow kernels with no Python work per record: the
        way to consume in bulk (data pipelines, DataFrames)."""
        self._wait_for_data(timeout_ms)
        return self._take_arrow(max_records or self._max_poll_records)

    def _wait_for_data(self, timeout_ms: int) -> None:
        if self._closed:
            raise ConfigError("the consumer is closed")
        deadline = time.monotonic() + max(timeout_ms, 0) / 1000
        self._maybe_auto_commit()
        if self._subscription and time.monotonic() - self._last_refresh > METADATA_REFRESH_S:
            self._refresh_subscription()
        while not self._buffer and self._assignment:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            self._fetch(max(0, min(remaining_ms, self._max_wait_ms)))
            if time.monotonic() >= deadline:
                return

    def _take(self, limit: int) -> list[ConsumerRecord]:
        """Hand out buffered records; each chunk is one partition's run of consecutive
        offsets, so positions advance per chunk, not per record."""
        out: list[ConsumerRecord] = []
        while self._buffer and len(out) < limit:
            chunk = self._buffer[0]
            records = chunk.records()
            room = limit - len(out)
            if len(records) <= room:
                taken = records
                self._buffer.popleft()
            else:
                taken = records[:room]
                chunk.keep_records(records[room:])
            out.extend(taken)
            self._positions[chunk.tp] = taken[-1].offset + 1
        return out

    def _take_arrow(self, limit: int) -> Any:
        import pyarrow as pa  # noqa: PLC0415  # only for Arrow consumers

        pieces: list[Any] = []
        taken_total = 0
        while self._buffer and taken_total < limit:
            chunk = self._buffer[0]
            table = chunk.arrow(pa)
            room = limit - taken_total
            if table.num_rows <= room:
                self._buffer.popleft()
            else:
                chunk.keep_records(chunk.records()[room:])
                table = table.slice(0, room)
            pieces.append(table)
            taken_total += table.num_rows
            self._positions[chunk.tp] = table.column("offset")[-1].as_py() + 1
        if not pieces:
            return _consumer_schema(pa).empty_table()
        return pa.concat_tables(pieces)

    def _fetch_request(
        self, positions: dict[TopicPartition, int], wait_ms: int
    ) -> storage_pb2.FetchRequest:
        return storage_pb2.FetchRequest(
            replica_id=-1,
            max_wait_ms=wait_ms,
            min_bytes=self._min_bytes,
            max_bytes=self._max_bytes,
            partitions=[
                storage_pb2.FetchPartition(
                    topic=t, partition=p, fetch_offset=o, max_bytes=self._partition_max_bytes
                )
                for (t, p), o in positions.items()
            ],
        )

    def _fetch(self, wait_ms: int) -> None:
        self._ensure_positions()
        positions = {tp: self._positions[tp] for tp in self._assignment}
        timeout_s = self._conn.timeout_s + wait_ms / 1000
        response: storage_pb2.FetchResponse | None = None
        if self._prefetch is not None:
            expected, future = self._prefetch
            self._prefetch = None
            if expected == positions:
                try:
                    response = future.result(timeout=timeout_s)
                except grpc.RpcError as exc:
                    raise error_from_rpc(exc, "fetch") from None
            else:
                future.cancel()  # a seek or a new assignment made it useless
        if response is None:
            response = self._conn.call(
                self._conn.stub.Fetch,
                self._fetch_request(positions, wait_ms),
                "fetch",
                timeout_s=timeout_s,
            )
        self._prefetch_after(response, positions)
        retry = False
        reset: list[TopicPartition] = []
        for result in response.partitions:
            tp = (result.topic, result.partition)
            if result.error.code != common_pb2.NONE:
                error = error_for_code(int(result.error.code), result.error.message)
                if error.code == ErrorCode.OFFSET_OUT_OF_RANGE:
                    reset.append(tp)
                elif error.retriable:
                    retry = True
                else:
                    raise error
                continue
            if not result.records:
                continue
            position = self._positions[tp]
            for batch in decode_batches(result.records):
                if batch.next_offset > position:
                    self._buffer.append(_Chunk(tp, batch, max(0, position - batch.base_offset)))
        if reset:
            self._reset_positions(reset)
        if retry and not self._buffer:
            time.sleep(RETRY_BACKOFF_S)

    def _prefetch_after(
        self, response: storage_pb2.FetchResponse, positions: dict[TopicPartition, int]
    ) -> None:
        """While this response is decoded, have the next one fetched: the servers work on
        it on another core. Only when more data is already waiting (some partition's high
        watermark is beyond what this response brought) and nothing went wrong (an error
        needs this consumer's attention first). A consumer at the end of the log would get
        an empty answer from such a fetch and then ask again with a wait: two rounds of
        RPCs per record at moderate rates, for no gain."""
        ends = dict(positions)
        waiting = False
        for result in response.partitions:
            if result.error.code != common_pb2.NONE:
                return
            tp = (result.topic, result.partition)
            if tp not in ends:
                continue
            if result.records:
                ends[tp] = next_offset_after(result.records, ends[tp])
            waiting = waiting or result.high_watermark > ends[tp]
        if waiting:
            self._prefetch = (
                ends,
                self._conn.stub.Fetch.future(
                    self._fetch_request(ends, 0), timeout=self._conn.timeout_s
                ),
            )

    def __iter__(self) -> Iterator[ConsumerRecord]:
        """Records forever (until ``close``), polling as needed."""
        while not self._closed:
            yield from self.poll()

    # --- group offsets --------------------------------------------------------------------

    def commit(self, offsets: dict[TopicPartition, int] | None = None) -> None:
        """Commit ``offsets`` (the next offset to read per partition), by default the
        current positions of every assigned partition."""
        if self.group_id is None:
            raise ConfigError("commit needs a consumer with a group_id")
        if offsets is None:
            offsets = {tp: self._positions[tp] for tp in self._assignment if tp in self._positions}
        if not offsets:
            return
        response: gateway_pb2.CommitOffsetsResponse = self._conn.call(
            self._conn.stub.CommitOffsets,
            gateway_pb2.CommitOffsetsRequest(
                group_id=self.group_id,
                offsets=[
                    gateway_pb2.CommitOffset(topic=t, partition=p, offset=o, leader_epoch=-1)
                    for (t, p), o in sorted(offsets.items())
                ],
            ),
            f"commit offsets of group {self.group_id!r}",
        )
        for item in response.partitions:
            raise_for(item.error, f"commit {item.topic}-{item.partition}")
        self._committed_positions.update(offsets)
        self._last_commit = time.monotonic()

    def committed(
        self, partitions: Iterable[TopicPartition] | None = None
    ) -> dict[TopicPartition, int]:
        """The group's committed offsets (-1 where none)."""
        if self.group_id is None:
            raise ConfigError("committed needs a consumer with a group_id")
        tps = list(self._assignment if partitions is None else partitions)
        response: gateway_pb2.FetchOffsetsResponse = self._conn.call(
            self._conn.stub.FetchOffsets,
            gateway_pb2.FetchOffsetsRequest(
                group_id=self.group_id,
                partitions=[common_pb2.TopicPartition(topic=t, partition=p) for t, p in tps],
            ),
            f"committed offsets of group {self.group_id!r}",
        )
        return {(o.topic, o.partition): o.offset for o in response.offsets}

    def _maybe_auto_commit(self) -> None:
        if not self._auto_commit:
            return
        if time.monotonic() - self._last_commit < self._auto_commit_interval_s:
            return
        changed = {
            tp: o for tp, o in self._positions.items() if self._committed_positions.get(tp) != o
        }
        if changed:
            try:
                self.commit(changed)
            except TidelogError:
                # Kafka's auto-commit failures are logged and retried at the next interval.
                return
        self._last_commit = time.monotonic()

    # --- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._auto_commit:
                self._last_commit = 0.0
                self._maybe_auto_commit()
        finally:
            if self._prefetch is not None:
                self._prefetch[1].cancel()
                self._prefetch = None
            self._closed = True

    def __enter__(self) -> Consumer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
