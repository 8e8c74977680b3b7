"""The PySpark data source classes: ``format("tidelog")`` for reads and writes.

These are thin: option checking lives in ``options``, offset rules in ``planning``, the
I/O of a read task in ``reader`` and of a write task in ``writer``. Spark pickles the
reader and writer objects to its Python workers, so they hold only options and plans,
never a channel (``GatewayConnection.get`` makes one per process on first use). With
``direct=true`` a range also carries the leader its partition had when the query was
planned (``tidelog.spark.direct``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from tidelog.client import GatewayConnection
from tidelog.errors import ConfigError, TidelogError, UnknownTopicOrPartitionError
from tidelog.leaders import Leader
from tidelog.logging import get_logger
from tidelog.spark import direct, planning, reader
from tidelog.spark.options import ReadOptions, parse_read_options
from tidelog.spark.planning import OffsetRange, TopicPartition
from tidelog.spark.retries import retrying

T = TypeVar("T")


class RangePartition(InputPartition):
    """One Spark task's work: an offset range of one partition (picklable), the id of the
    topic incarnation it was planned in ("": not known, nothing checked), and with
    ``direct=true`` where to fetch it first (None: ask the gateway)."""

    def __init__(
        self, offset_range: OffsetRange, leader: Leader | None = None, topic_id: str = ""
    ) -> None:
        super().__init__(offset_range)
        self.offset_range = offset_range
        self.leader = leader
        self.topic_id = topic_id


def _range_partitions(
    connection: GatewayConnection,
    options: ReadOptions,
    ranges: Sequence[OffsetRange],
    topic_ids: Mapping[str, str],
) -> list[RangePartition]:
    leaders: Mapping[TopicPartition, Leader | None] = {}
    if options.direct:
        leaders = direct.leader_hints(connection, sorted({(r.topic, r.partition) for r in ranges}))
    return [
        RangePartition(r, leaders.get((r.topic, r.partition)), topic_ids.get(r.topic, ""))
        for r in ranges
    ]


LIST_ATTEMPTS = 3
"""Times the partitions are listed again when one vanished before its bounds came."""


def _topic_ids(connection: GatewayConnection, topics: Iterable[str]) -> dict[str, str]:
    """The current id of each of ``topics`` (the incarnation offsets read now belong to);
    a topic gone meanwhile has none."""
    names = sorted(set(topics))
    if not names:
        return {}
    response = connection.metadata(names)
    return {t.name: t.topic_id for t in response.topics if t.error.code == 0 and t.topic_id}


def _env_gateway() -> str | None:
    return os.environ.get("TIDELOG_GATEWAY")


def _check_schema(schema: StructType, include_headers: bool) -> None:
    """The source's schema is fixed, as Spark's Kafka source's: a ``.schema(...)`` given to
    the read is refused before any task runs. It was ignored: an empty topic answered no
    rows in the user's schema, and with data every task failed on Spark's generic schema
    mismatch (found by an audit)."""
    if schema.simpleString() != reader.schema_simple_string(include_headers):
        raise ConfigError(
            "the tidelog source has a fixed schema and takes no .schema(...): it is "
            f"{reader.schema_ddl(include_headers)}"
        )


class TidelogDataSource(DataSource):
    """``spark.read.format("tidelog")`` / ``readStream`` / ``write`` / ``writeStream``."""

    @classmethod
    def name(cls) -> str:
        return "tidelog"

    def schema(self) -> str:
        include = str(self.options.get("includeHeaders", "false")).strip().lower() == "true"
        return reader.schema_ddl(include)

    def reader(self, schema: StructType) -> DataSourceReader:
        options = parse_read_options(self.options, streaming=False, env_gateway=_env_gateway())
        _check_schema(schema, options.include_headers)
        return TidelogBatchReader(options)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        options = parse_read_options(self.options, streaming=True, env_gateway=_env_gateway())
        _check_schema(schema, options.include_headers)
        return TidelogStreamReader(options)

    def writer(self, schema: StructType, overwrite: bool) -> Any:
        from tidelog.spark.writer import TidelogBatchWriter  # noqa: PLC0415

        if overwrite:
            # Spark's Kafka sink refuses it too: nothing in a log can be replaced.
            raise ConfigError(
                "save mode 'overwrite' is not supported: a tidelog topic is only appended "
                "to; use mode('append')"
            )
        return TidelogBatchWriter(self.options, schema, env_gateway=_env_gateway())

    def streamWriter(self, schema: StructType, overwrite: bool) -> Any:
        from tidelog.spark.writer import TidelogStreamWriter  # noqa: PLC0415

        return TidelogStreamWriter(self.options, schema, env_gateway=_env_gateway())


def _read(options: ReadOptions, partition: InputPartition) -> Iterator[Any]:
    if not isinstance(partition, RangePartition):
        # A plan of no ranges (nothing to read) still runs one task: PySpark turns an
        # empty partition list into [InputPartition(None)].
        assert partition.value is None, partition
        return iter(())
    connection = GatewayConnection.get(options.gateway, options.request_timeout_ms)
    offset_range = partition.offset_range
    fetcher = (
        direct.PartitionFetcher(
            connection,
            (offset_range.topic, offset_range.partition),
            partition.leader,
            options.request_timeout_ms,
            partition.topic_id,
        )
        if options.direct
        else None
    )
    return reader.read_range(
        connection,
        offset_range,
        include_headers=options.include_headers,
        fail_on_data_loss=options.fail_on_data_loss,
        fetch_max_bytes=options.fetch_max_bytes,
        fetch=None if fetcher is None else fetcher.fetch,
        topic_id=partition.topic_id,
    )


class TidelogBatchReader(DataSourceReader):
    """A batch read: [startingOffsets, endingOffsets) fixed when the plan is made."""

    def __init__(self, options: ReadOptions) -> None:
        self.options = options

    def partitions(self) -> Sequence[InputPartition]:
        return retrying(self._plan, self.options.request_timeout_ms / 1000)

    def _plan(self) -> list[RangePartition]:
        options = self.options
        connection = GatewayConnection.get(options.gateway, options.request_timeout_ms)
        tps = reader.resolve_partitions(connection, options)
        # Before the bounds: a topic created again after this look-up is refused by the
        # tasks' fetches rather than read in place of the one whose bounds were planned.
        topic_ids = _topic_ids(connection, (t for t, _ in tps))
        bounds = reader.resolve_bounds(connection, tps)
        if options.starting_timestamp is not None:
            starts = reader.resolve_timestamps(connection, options, bounds)
        else:
            starts = planning.resolve_offsets(options.starting, bounds, option="startingOffsets")
        starts, losses = planning.check_start_offsets(
            starts, bounds, fail_on_data_loss=options.fail_on_data_loss
        )
        reader.warn_data_loss(losses)
        # Every partition read needs an end (Spark's rule, assign mode too): one left out
        # would end at earliest and be read not at all.
        ends = planning.resolve_offsets(options.ending, bounds, option="endingOffsets")
        for tp, end in ends.items():
            if end > bounds[tp].latest:
                # Not there yet: the read would wait for it and time out.
                raise ConfigError(
                    f"{tp[0]}-{tp[1]}: the ending offset {end} is past the latest offset "
                    f"{bounds[tp].latest}"
                )
            if end < starts[tp]:
                raise ConfigError(
                    f"{tp[0]}-{tp[1]}: the ending offset {end} is before the starting offset "
                    f"{starts[tp]}"
                )
        ranges = planning.split_ranges(
            planning.ranges_between(starts, ends), options.min_partitions
        )
        return _range_partitions(connection, options, ranges, topic_ids)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(self.options, partition)


class TidelogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A streaming read; offsets are ``{"topic": {"partition": next offset}}``.

    The initial offsets (``startingOffsets``) are resolved once per query run: Spark asks
    for them each time it needs micro-batch 0's start, and ``latest`` would give a later
    answer each time, leaving the records in between to no micro-batch. Batch 0's end
    records the start it was computed from, which a replay of that batch after a restart
    reads from (``planning.end_offsets``, ``planning.planned_start``): Spark checkpoints
    no start, as Kafka's source writes its initial offsets to the checkpoint itself.

    Admission control: ``maxOffsetsPerTrigger`` becomes the default read limit and
    ``latestOffset(start, limit)`` shares it among partitions by backlog. With
    ``Trigger.AvailableNow`` the high watermarks seen when the query starts are the
    target: no micro-batch goes past them. New partitions of subscribed topics are
    picked up at each micro-batch and read from their beginning. Each micro-batch's plan
    checks the checkpointed offsets against the partitions' bounds (``failOnDataLoss``,
    ``planning.resume_offsets``).
    """

    def __init__(self, options: ReadOptions) -> None:
        self.options = options
        self._target: dict[TopicPartition, int] | None = None
        # initialOffset's answer, resolved at its first call (see the class docstring).
        self._initial: dict[str, Any] | None = None
        self._committed: dict[TopicPartition, int] = {}
        # Spark may plan from the same start more than once: each loss is logged once.
        self._reported: set[planning.DataLoss] = set()
        # Partitions whose checkpointed offset (first) retention deleted, and where the
        # last plan resumed them (second) with failOnDataLoss=false.
        self._skipped: dict[TopicPartition, tuple[int, int]] = {}

    def _connection(self) -> GatewayConnection:
        return GatewayConnection.get(self.options.gateway, self.options.request_timeout_ms)

    def _retrying(self, call: Callable[[], T]) -> T:
        """``call`` through failures that pass (``retries``), for up to requestTimeoutMs."""
        return retrying(call, self.options.request_timeout_ms / 1000)

    def _bounds(self) -> dict[TopicPartition, planning.Bounds]:
        return self._listed(self._connection(), with_ids=False)[1]

    def _listed(
        self, connection: GatewayConnection, *, with_ids: bool = True
    ) -> tuple[dict[str, str], dict[TopicPartition, planning.Bounds]]:
        """The partitions to read with their bounds (and their topics' ids, taken before
        the bounds: see latestOffset). A topic deleted between the listing and the bounds
        (a subscribePattern topic, polled every few ms by an idle query) was asked for
        until the request timeout and failed the query; it is listed again instead, so it
        drops out (a loss ``resume_offsets`` reports as the options say), and only a
        subscribed or assigned topic that is gone fails, as an unknown topic (found by an
        audit)."""
        for attempt in range(LIST_ATTEMPTS):
            tps = reader.resolve_partitions(connection, self.options)
            topic_ids = _topic_ids(connection, (t for t, _ in tps)) if with_ids else {}
            try:
                bounds = reader.resolve_bounds(connection, tps, retry_unknown_topic=False)
            except UnknownTopicOrPartitionError:
                if attempt == LIST_ATTEMPTS - 1:
                    raise
                continue
            return topic_ids, bounds
        raise AssertionError("unreachable")

    def _latest(self) -> dict[TopicPartition, int]:
        return {tp: b.latest for tp, b in self._bounds().items()}

    def initialOffset(self) -> dict[str, Any]:
        if self._initial is None:
            self._initial = planning.mark_initial(self._retrying(self._resolve_initial))
        return copy.deepcopy(self._initial)  # what a caller does to it must not change it

    def _resolve_initial(self) -> dict[str, Any]:
        options = self.options
        connection = self._connection()
        # Ids before bounds, as in latestOffset: bounds of a topic deleted and created
        # again in between would otherwise carry the new topic's id, and the next plan
        # would take the old topic's offsets for the new one's.
        topic_ids, bounds = self._listed(connection)
        if options.starting_timestamp is not None:
            starts = reader.resolve_timestamps(connection, options, bounds)
        else:
            starts = planning.resolve_offsets(options.starting, bounds, option="startingOffsets")
        starts, losses = planning.check_start_offsets(
            starts, bounds, fail_on_data_loss=options.fail_on_data_loss
        )
        reader.warn_data_loss(losses)
        return planning.to_json_offsets(starts, topic_ids)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.max_offsets_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.options.max_offsets_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._retrying(self._latest)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        return self._retrying(lambda: self._latest_offset(start, limit))

    def _latest_offset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        connection = self._connection()
        # Ids before bounds, as the batch reader does: bounds looked up first could be the
        # old incarnation's and be labelled with the id of a topic created again between.
        topic_ids, bounds = self._listed(connection)
        # ``start`` is where the checkpoint says the query got to; what was lost since
        # (retention, a re-created topic) fails the query here, before any task runs, or
        # with failOnDataLoss=false moves the start to what is still there.
        checkpointed = planning.from_json_offsets(start)
        starts, losses = planning.resume_offsets(
            checkpointed,
            bounds,
            fail_on_data_loss=self.options.fail_on_data_loss,
            checkpoint_ids=planning.topic_ids_of(start),
            topic_ids=topic_ids,
        )
        reader.warn_data_loss([loss for loss in losses if loss not in self._reported])
        self._reported.update(losses)
        # Where reading resumes elsewhere than the checkpoint says: past deleted offsets,
        # or at the start of a topic created again since (below the checkpoint's offset).
        self._skipped = {
            tp: (checkpointed.get(tp, 0), offset)
            for tp, offset in starts.items()
            if offset != checkpointed.get(tp, 0)
        }
        # Spark plans the next micro-batch only after the previous one completed, so
        # ``start`` is processed data: the group sees it now rather than when Spark gets
        # round to commit() (a batch later, and never for the last AvailableNow batch).
        self._commit_group(starts, topic_ids)
        latest = {tp: b.latest for tp, b in bounds.items()}
        if self._target is not None:
            # AvailableNow: no further than the high watermarks seen when the query
            # started; partitions that appeared since wait for the next query.
            latest = {
                tp: min(end, self._target[tp]) for tp, end in latest.items() if tp in self._target
            }
        # No end below where a partition resumes. Where that is below ``start`` (its log
        # is now shorter than the checkpoint, failOnDataLoss=false) the micro-batch reads
        # nothing of it and ends there, so the next one starts there, as Kafka's does.
        ends = {tp: max(latest.get(tp, offset), offset) for tp, offset in starts.items()}
        if isinstance(limit, ReadMaxRows):
            ends = planning.rate_limit(starts, ends, limit.max_rows)
        # From initialOffset's offsets, the end carries them into the checkpoint.
        end = planning.to_json_offsets(ends, topic_ids)
        return planning.end_offsets(
            start, planning.with_min_partitions(end, self.options.min_partitions)
        )

    def reportLatestOffset(self) -> dict[str, dict[str, int]] | None:
        # Only a progress metric: a failed look-up must not fail the query.
        try:
            return planning.to_json_offsets(self._latest())
        except TidelogError:
            return None

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        # Batch 0 reads from the start its end was computed from (recorded in the end),
        # not from whatever initialOffset answers now, on a replay after a restart too.
        start = dict(planning.planned_start(start, end))
        checkpointed = planning.from_json_offsets(start)
        starts = dict(checkpointed)
        # A topic whose id differs between the two ends was created again in between:
        # the end's offsets are the new topic's, read from its beginning.
        start_ids, end_ids = planning.topic_ids_of(start), planning.topic_ids_of(end)
        for tp in starts:
            old, new = start_ids.get(tp[0]), end_ids.get(tp[0])
            if old and new and old != new:
                starts[tp] = 0
        # Where the plan of this micro-batch skipped deleted offsets (or a re-created
        # topic's), its tasks start at what is left rather than fetch the deleted ones
        # (out of range) first. A replay after a restart has no such plan: its tasks
        # find the deletion themselves.
        for tp, (at, resumed) in self._skipped.items():
            if checkpointed.get(tp, 0) == at:
                starts[tp] = resumed
        ranges = planning.split_ranges(
            planning.ranges_between(starts, planning.from_json_offsets(end)),
            # As the end recorded it: a replay splits into the same tasks (planning).
            planning.min_partitions_of(end, self.options.min_partitions),
        )
        return self._retrying(
            # The end offsets' incarnation (end_ids): the ranges are read in it.
            lambda: _range_partitions(self._connection(), self.options, ranges, end_ids)
        )

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(self.options, partition)

    def commit(self, end: dict[str, Any]) -> None:
        self._commit_group(planning.from_json_offsets(end), planning.topic_ids_of(end))

    def _commit_group(
        self, offsets: dict[TopicPartition, int], topic_ids: Mapping[str, str]
    ) -> None:
        """The group's copy of where the query got to (for lag monitoring; the checkpoint
        is what the query resumes from), each topic in its incarnation. A partition whose
        topic is gone, or was created again, is left out with a warning: Spark commits
        the previous micro-batch's end, which still names a topic deleted since, and
        its refusal failed a query that failOnDataLoss=false kept reading (found by an
        audit)."""
        group_id = self.options.group_id
        if group_id is None or not offsets or offsets == self._committed:
            return
        skipped = self._retrying(
            lambda: self._connection().commit_offsets(
                group_id, offsets, topic_ids=topic_ids, skip_gone=True
            )
        )
        for error in skipped:
            get_logger(group=group_id).warning("spark_group_commit_skipped", error=str(error))
        self._committed = dict(offsets)

    def stop(self) -> None:
        pass
