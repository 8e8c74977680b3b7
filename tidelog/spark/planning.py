"""Offset planning for the Spark data source: pure functions, no I/O, no Spark.

Given what the cluster reported (each partition's [earliest, latest) bounds, timestamp
lookups) and the checked options, these decide which offset range every Spark task
reads. The rules are those of Spark's Kafka source so results match users' experience:

- ``resolve_offsets`` turns an ``OffsetSpec`` into one offset per partition (-2 earliest,
  -1 latest); a JSON spec must name every partition read, whatever the selector.
- ``check_start_offsets`` checks the offsets a query was asked to start at: past the
  latest offset is an error, below the earliest (removed by retention) is data loss.
- ``resume_offsets`` checks where a streaming query resumes (its checkpoint) against what
  the partitions hold now: offsets deleted by retention, a latest offset below the
  checkpoint (log truncated), a topic deleted and created again since the checkpoint (its
  topic id changed: Spark's Kafka source cannot see this when the new topic has grown
  past the checkpoint's offsets, and reads on from there) or a partition gone are data
  loss.
- Data loss (``DataLoss``) follows Spark's Kafka source: with ``failOnDataLoss`` (the
  default) the query fails with a message saying data may have been lost; without, the
  losses are returned for the caller to log and reading goes on from the earliest
  (retention) or latest (log shorter than the checkpoint) offset still there.
- ``rate_limit`` splits ``maxOffsetsPerTrigger`` across partitions in proportion to
  their backlog (Kafka source's ``rateLimit``), always letting every lagging partition
  progress by at least one offset.
- ``split_ranges`` cuts large ranges so that there are at least ``minPartitions`` tasks.

Offsets here are dicts keyed by ``(topic, partition)``; ``to_json_offsets`` /
``from_json_offsets`` convert to the ``{"topic": {"0": 23}}`` form Spark checkpoints,
plus entries whose key starts with ``$`` (in no topic name, see ``tidelog.topics``):

- ``"$topicIds": {"topic": "<id>"}`` names the incarnation of each topic the offsets
  belong to (checkpoints written without it are not checked);
- ``"$initial": true`` marks the offsets ``initialOffset`` gave, the start of micro-batch
  0. Spark never checkpoints a start, only each micro-batch's end, and on a restart it
  asks ``initialOffset`` again for the start of a batch 0 it replays;
- ``"$start": {offsets}`` in the end of micro-batch 0 (``end_offsets``) records the
  offsets it was planned from, so that a replay of it plans the same range
  (``planned_start``) whatever ``startingOffsets`` resolve to by then (``latest`` has
  moved on). No later end records one (batch 0's end is handed back unchanged while
  nothing moves, ``end_offsets``). An end of batch 0 written without it (before it
  existed) is read from ``initialOffset`` as it was;
- ``"$minPartitions": n`` in every end records the ``minPartitions`` its micro-batch is
  planned with (0: none), so that a replay after a restart splits its ranges into the
  same tasks whatever the option says by then (``min_partitions_of``): an exactly-once
  write's producer ids are its task ids, and a replay split otherwise wrote its rows
  twice, or failed for good (found by an audit). An end without it (written before) is
  split by the option.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from tidelog.errors import ConfigError, OffsetOutOfRangeError
from tidelog.spark.options import EARLIEST, LATEST, OffsetSpec

TopicPartition = tuple[str, int]

TOPIC_IDS_KEY: Final = "$topicIds"
"""The checkpoint's entry naming each topic's incarnation (no topic name has a ``$``)."""

INITIAL_KEY: Final = "$initial"
"""Marks ``initialOffset``'s offsets: the start of micro-batch 0 (never checkpointed)."""

START_KEY: Final = "$start"
"""In the end of micro-batch 0 (checkpointed): the offsets that micro-batch starts at."""

MIN_PARTITIONS_KEY: Final = "$minPartitions"
"""In every end (checkpointed): the ``minPartitions`` its micro-batch is planned with."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """A partition as a consumer sees it: offsets [earliest, latest) are readable."""

    earliest: int
    latest: int


@dataclass(frozen=True, slots=True)
class OffsetRange:
    """Offsets [start, end) of one partition: the unit of work of one Spark task."""

    topic: str
    partition: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def resolve_offsets(
    spec: OffsetSpec,
    bounds: Mapping[TopicPartition, Bounds],
    *,
    option: str,
) -> dict[TopicPartition, int]:
    """One offset per partition in ``bounds`` from ``spec``.

    A JSON spec must name exactly the partitions in ``bounds``, as Spark's Kafka source
    requires for every selector: ``assign`` used to start the partitions it left out at
    earliest, reading records the user may have meant to skip.
    """
    if spec.kind == "earliest":
        return {tp: b.earliest for tp, b in bounds.items()}
    if spec.kind == "latest":
        return {tp: b.latest for tp, b in bounds.items()}
    assert spec.per_partition is not None
    unknown = sorted(set(spec.per_partition) - set(bounds))
    if unknown:
        raise ConfigError(f"{option} names partitions that are not being read: {_names(unknown)}")
    missing = sorted(set(bounds) - set(spec.per_partition))
    if missing:
        raise ConfigError(
            f"{option} must give an offset for every partition read; missing: {_names(missing)}"
        )
    result: dict[TopicPartition, int] = {}
    for tp, b in bounds.items():
        wanted = spec.per_partition[tp]
        result[tp] = b.earliest if wanted == EARLIEST else b.latest if wanted == LATEST else wanted
    return result


@dataclass(frozen=True, slots=True)
class DataLoss:
    """Records a read should have had that are gone: ``what`` happened to the partition,
    and the offset reading goes on from (None: the partition itself is gone)."""

    topic: str
    partition: int
    what: str
    resume_at: int | None

    def message(self, *, fail_on_data_loss: bool) -> str:
        """One line for the error (``fail_on_data_loss``) or for the warning."""
        head = f"{self.topic}-{self.partition}: some data may have been lost: {self.what}"
        if fail_on_data_loss:
            return f"{head}; set the option failOnDataLoss=false to go on without it"
        if self.resume_at is None:
            return f"{head}; failOnDataLoss=false: reading goes on without this partition"
        return f"{head}; failOnDataLoss=false: reading goes on from offset {self.resume_at}"


def raise_for_data_loss(losses: Sequence[DataLoss], *, fail_on_data_loss: bool) -> None:
    """OffsetOutOfRangeError naming the first loss when ``fail_on_data_loss``."""
    if losses and fail_on_data_loss:
        more = f" (and {len(losses) - 1} more partitions)" if len(losses) > 1 else ""
        raise OffsetOutOfRangeError(losses[0].message(fail_on_data_loss=True) + more)


def deleted_before_read(topic: str, partition: int, start: int, earliest: int) -> DataLoss:
    """Retention removed [start, earliest) before the query read it."""
    return DataLoss(
        topic,
        partition,
        f"offsets [{start}, {earliest}) were deleted (retention) before they were read",
        earliest,
    )


def check_start_offsets(
    starts: Mapping[TopicPartition, int],
    bounds: Mapping[TopicPartition, Bounds],
    *,
    fail_on_data_loss: bool,
) -> tuple[dict[TopicPartition, int], list[DataLoss]]:
    """The offsets a query was asked to start at, checked against what exists.

    A start beyond ``latest`` is a ConfigError, as an ending offset past it is: those
    offsets do not exist yet, and moving the start down to ``latest`` would read records
    the query asked to skip. A start below ``earliest`` means retention removed records
    the query should have read: data loss (raised with ``fail_on_data_loss``, Spark's
    default; else the start moves up to ``earliest`` and the loss is returned).
    """
    result: dict[TopicPartition, int] = {}
    losses: list[DataLoss] = []
    for tp, wanted in sorted(starts.items()):
        b = bounds[tp]
        if wanted > b.latest:
            raise ConfigError(
                f"{tp[0]}-{tp[1]}: the starting offset {wanted} is past the latest offset "
                f"{b.latest}"
            )
        if wanted < b.earliest:
            losses.append(deleted_before_read(tp[0], tp[1], wanted, b.earliest))
        result[tp] = max(wanted, b.earliest)
    raise_for_data_loss(losses, fail_on_data_loss=fail_on_data_loss)
    return result, losses


def resume_offsets(
    starts: Mapping[TopicPartition, int],
    bounds: Mapping[TopicPartition, Bounds],
    *,
    fail_on_data_loss: bool,
    checkpoint_ids: Mapping[str, str] | None = None,
    topic_ids: Mapping[str, str] | None = None,
) -> tuple[dict[TopicPartition, int], list[DataLoss]]:
    """Where a streaming query goes on reading each partition in ``bounds``, from the
    offsets it reached (``starts``, its checkpoint), and the data lost on the way.

    A partition missing from ``starts`` is new and starts at 0 (Kafka's source reads new
    partitions from their beginning). Losses, as Kafka's source reports them: the start
    is below ``earliest`` (retention deleted unread records: resume at ``earliest``);
    ``latest`` is below the start (the topic was deleted and re-created or its log
    truncated, so the offsets no longer name the records read: resume at ``latest``, as
    Kafka's source does); a partition of ``starts`` is no longer there (dropped). With
    ``fail_on_data_loss`` any loss raises OffsetOutOfRangeError instead.

    A topic whose id (``topic_ids``, now) is not the one the checkpoint names
    (``checkpoint_ids``) was deleted and created again: the checkpoint's offsets name
    records of the old topic, whatever the new one's bounds. What the old one held past
    them is lost; the new one is read from its earliest offset (none of it was read).
    """
    result: dict[TopicPartition, int] = {}
    losses: list[DataLoss] = []
    old, new = checkpoint_ids or {}, topic_ids or {}
    reborn = {t for t, i in old.items() if i and new.get(t) and new[t] != i}
    for tp in sorted(set(starts) - set(bounds)):
        losses.append(
            DataLoss(tp[0], tp[1], "the partition no longer exists (topic deleted?)", None)
        )
    for tp, b in sorted(bounds.items()):
        start = starts.get(tp, 0)
        if tp[0] in reborn:
            losses.append(
                DataLoss(
                    tp[0],
                    tp[1],
                    "the topic was deleted and created again since the checkpoint (topic id "
                    f"{old[tp[0]]} is now {new[tp[0]]}): what the old topic held past offset "
                    f"{start} was not read",
                    b.earliest,
                )
            )
            result[tp] = b.earliest
            continue
        if start > b.latest:
            losses.append(
                DataLoss(
                    tp[0],
                    tp[1],
                    f"its latest offset {b.latest} is below the offset {start} already "
                    "reached (topic deleted and re-created, or log truncated?)",
                    b.latest,
                )
            )
            start = b.latest
        elif start < b.earliest:
            losses.append(deleted_before_read(tp[0], tp[1], start, b.earliest))
            start = b.earliest
        result[tp] = start
    losses.sort(key=lambda loss: (loss.topic, loss.partition))
    raise_for_data_loss(losses, fail_on_data_loss=fail_on_data_loss)
    return result, losses


def ranges_between(
    starts: Mapping[TopicPartition, int], ends: Mapping[TopicPartition, int]
) -> list[OffsetRange]:
    """Non-empty ranges, in (topic, partition) order; a partition missing in ``starts``
    (new since the last batch) starts at 0, as Kafka's source starts new partitions at
    earliest."""
    result: list[OffsetRange] = []
    for tp in sorted(ends):
        start = starts.get(tp, 0)
        if ends[tp] > start:
            result.append(OffsetRange(tp[0], tp[1], start, ends[tp]))
    return result


def rate_limit(
    starts: Mapping[TopicPartition, int],
    latest: Mapping[TopicPartition, int],
    max_offsets: int,
) -> dict[TopicPartition, int]:
    """End offsets reading at most about ``max_offsets`` in total, shared by backlog.

    Each partition gets ``max_offsets * backlog / total_backlog`` offsets, rounded down
    but at least one when it has any backlog (so no partition starves); the total may
    thus exceed ``max_offsets`` by at most the number of partitions.
    """
    backlog = {tp: max(0, end - starts.get(tp, 0)) for tp, end in latest.items()}
    total = sum(backlog.values())
    if total <= max_offsets:
        return dict(latest)
    result: dict[TopicPartition, int] = {}
    for tp, end in latest.items():
        share = max_offsets * backlog[tp] / total
        take = math.ceil(share) if share < 1 else math.floor(share)
        result[tp] = min(end, starts.get(tp, 0) + take)
    return result


def split_ranges(ranges: Sequence[OffsetRange], min_partitions: int | None) -> list[OffsetRange]:
    """Cut ranges so there are at least ``min_partitions`` of them (when possible).

    Like Spark's KafkaOffsetRangeCalculator: a range gets ``ceil(size / total *
    min_partitions)`` pieces of near-equal size; ranges already numerous enough are kept.
    """
    if min_partitions is None or len(ranges) >= min_partitions:
        return list(ranges)
    total = sum(r.size for r in ranges)
    result: list[OffsetRange] = []
    for r in ranges:
        pieces = max(1, min(r.size, math.ceil(r.size / total * min_partitions)))
        for i in range(pieces):
            start = r.start + r.size * i // pieces
            end = r.start + r.size * (i + 1) // pieces
            result.append(OffsetRange(r.topic, r.partition, start, end))
    return result


def to_json_offsets(
    offsets: Mapping[TopicPartition, int], topic_ids: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``{(t, p): o}`` -> ``{"t": {"p": o}}`` (what Spark writes to its checkpoint), with
    ``{"$topicIds": {"t": id}}`` for the topics whose id is given."""
    result: dict[str, Any] = {}
    for (topic, partition), offset in sorted(offsets.items()):
        result.setdefault(topic, {})[str(partition)] = offset
    ids = {t: i for t, i in sorted((topic_ids or {}).items()) if t in result and i}
    if ids:
        result[TOPIC_IDS_KEY] = ids
    return result


def from_json_offsets(data: Mapping[str, Any]) -> dict[TopicPartition, int]:
    """The inverse of ``to_json_offsets``: the ``$`` entries (topic ids, marks) apart."""
    return {
        (topic, int(partition)): int(offset)
        for topic, partitions in data.items()
        if not topic.startswith("$")
        for partition, offset in partitions.items()
    }


def mark_initial(offsets: Mapping[str, Any]) -> dict[str, Any]:
    """``initialOffset``'s answer: JSON offsets marked as the start of micro-batch 0."""
    return {**offsets, INITIAL_KEY: True}


def is_initial(data: Mapping[str, Any]) -> bool:
    return data.get(INITIAL_KEY) is True


def end_offsets(start: Mapping[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    """What ``latestOffset`` answers for JSON offsets ``end`` computed from ``start``.

    From ``initialOffset``'s offsets (micro-batch 0): ``end`` with ``"$start"``, those
    offsets, so that they reach the checkpoint with it. From batch 0's end, when nothing
    moved since: that end unchanged, because Spark runs a micro-batch whenever the JSON
    differs, and one without ``"$start"`` would make an empty one. Else ``end``: no
    later end records a start of its own, so none grows.
    """
    if is_initial(start):
        return {**end, START_KEY: {k: v for k, v in start.items() if k != INITIAL_KEY}}
    # Nothing moved (a changed minPartitions alone is no new data): the start as it is.
    if _without(start, START_KEY, MIN_PARTITIONS_KEY) == _without(end, MIN_PARTITIONS_KEY):
        return dict(start)
    return end


def _without(data: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in keys}


def with_min_partitions(end: dict[str, Any], min_partitions: int | None) -> dict[str, Any]:
    """``end`` recording the ``minPartitions`` its micro-batch is planned with."""
    return {**end, MIN_PARTITIONS_KEY: min_partitions or 0}


def min_partitions_of(end: Mapping[str, Any], default: int | None) -> int | None:
    """The ``minPartitions`` ``end``'s micro-batch was planned with; ``default`` (the
    option now) for an end written before it was recorded."""
    recorded = end.get(MIN_PARTITIONS_KEY)
    if isinstance(recorded, bool) or not isinstance(recorded, int) or recorded < 0:
        return default
    return recorded or None


def planned_start(start: Mapping[str, Any], end: Mapping[str, Any]) -> Mapping[str, Any]:
    """The JSON offsets the micro-batch from ``start`` to ``end`` reads from.

    Batch 0 (``start`` from ``initialOffset``) reads from the start its end recorded:
    Spark asks ``initialOffset`` again when it plans that batch and on a restart that
    replays it, and those answers may differ from the start its end was computed from
    (``latest`` moves on). An end without one (written before ``"$start"`` existed) is
    read from ``start``, as it was.
    """
    recorded = end.get(START_KEY)
    if is_initial(start) and isinstance(recorded, Mapping):
        return recorded
    return start


def topic_ids_of(data: Mapping[str, Any]) -> dict[str, str]:
    """The topic ids a checkpoint's offsets name (none in those written before)."""
    ids = data.get(TOPIC_IDS_KEY)
    if not isinstance(ids, Mapping):
        return {}
    return {str(t): str(i) for t, i in ids.items()}


def _names(tps: Iterable[TopicPartition]) -> str:
    return ", ".join(f"{t}-{p}" for t, p in tps)
