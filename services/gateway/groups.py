"""Consumer-group committed offsets, kept in etcd under ``groups/<group>/<topic>/<p>``.

The layout and value format are in ``docs/METADATA.md`` (section 1.7): one key per
partition, ``{offset, metadata, leader_epoch, topic_id}``, the group id percent-encoded so
any string is a safe key. Commits are last-writer-wins per partition among those the
group lets commit: while it has members, only they, in its current generation (the
``guard``, ``group_coordinator.GroupCoordinator.commit_guard``); one commit request is
written in as few transactions as etcd allows (``OPS_PER_TXN`` partitions each), so a
small commit lands whole or not at all. When a transaction after the first fails, the
partitions it and the later ones carried answer with its error and the earlier ones with
none: they are written.

An offset belongs to one incarnation of its topic: it carries the ``topic_id`` the topic
had when it was committed, and a fetch drops offsets of a topic that is gone or was
deleted and created again (Kafka deletes a deleted topic's offsets). Without that, a
group reading a re-created topic would resume at an offset of the old one and skip the
new records below it. Tagging makes this hold without a compare on the topic key: a
commit racing the deletion writes the old id, which no fetch will return. A commit that
names the incarnation its offset was read in (``topic_id``, as the SDK's does) and finds
another answers INCONSISTENT_TOPIC_ID: a consumer that had not yet noticed a re-creation
committed its old position into the new topic, and the group skipped the new records
below it (found by an audit).

Every gateway reads and writes the same keys, so commits through one gateway are seen by
FetchOffsets through any other.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final
from urllib.parse import quote, unquote

from services.cluster_metadata import GROUPS_PREFIX
from services.gateway.metadata_cache import MetadataCache, MetadataView
from services.metastore import (
    Compare,
    DeleteOp,
    DeleteResult,
    KeyValue,
    MetaStore,
    MetaStoreError,
    PutOp,
)
from tidelog.errors import (
    GroupIdNotFoundError,
    InconsistentTopicIdError,
    InvalidGroupIdError,
    InvalidRequestError,
    InvalidTopicError,
    OffsetMetadataTooLargeError,
    RebalanceInProgressError,
    RequestTimedOutError,
    TidelogError,
)
from tidelog.formats import MAX_PARTITIONS_PER_REQUEST
from tidelog.logging import get_logger
from tidelog.topics import validate_topic_name

_log = get_logger(component="gateway.groups")

MAX_GROUP_ID_CHARS: Final = 255
MAX_METADATA_BYTES: Final = 4096
"""Kafka's offset.metadata.max.bytes."""
"""Partitions one CommitOffsets or FetchOffsets may name (as Fetch and ListOffsets)."""


def check_partition_count(count: int, what: str) -> None:
    if count > MAX_PARTITIONS_PER_REQUEST:
        raise InvalidRequestError(
            f"{count} partitions in one {what}; the limit is {MAX_PARTITIONS_PER_REQUEST}"
        )


OPS_PER_TXN: Final = 100
"""etcd's default --max-txn-ops is 128; stay below it for etcds configured by others."""
BYTES_PER_TXN: Final = 512 * 1024
"""A third of etcd's default 1.5 MiB request limit: 100 commits of 4 KiB metadata under
long percent-encoded group ids exceeded it, and the commit failed for good."""
MAX_GROUPS_LISTED: Final = 100_000


@dataclass(frozen=True, slots=True)
class Committed:
    """One partition's committed position (``offset`` = the next record to consume)."""

    topic: str
    partition: int
    offset: int
    metadata: str = ""
    leader_epoch: int = -1
    error: TidelogError | None = None  # why this partition has no answer (a bad name)
    topic_id: str = ""  # a commit's: the incarnation the offset is in ("": the current)


@dataclass(frozen=True, slots=True)
class CommitOutcome:
    topic: str
    partition: int
    error: TidelogError | None


def group_prefix(group_id: str) -> str:
    return f"{GROUPS_PREFIX}{quote(group_id, safe='')}/"


def offset_key(group_id: str, topic: str, partition: int) -> str:
    return f"{group_prefix(group_id)}{topic}/{partition}"


GUARD_ATTEMPTS: Final = 10


def _txn_ranges(writes: list[PutOp]) -> list[tuple[int, int]]:
    """``[start, end)`` slices of ``writes`` within OPS_PER_TXN and BYTES_PER_TXN each."""
    ranges: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, op in enumerate(writes):
        cost = len(op.key) + len(op.value)
        if i > start and (i - start >= OPS_PER_TXN or size + cost > BYTES_PER_TXN):
            ranges.append((start, i))
            start, size = i, 0
        size += cost
    if start < len(writes):
        ranges.append((start, len(writes)))
    return ranges


class GroupFencedError(Exception):
    """The committer may not commit (not a member, an old generation): ``error`` says why."""

    def __init__(self, error: TidelogError) -> None:
        super().__init__(str(error))
        self.error = error


def check_group_id(group_id: str) -> None:
    if not group_id:
        raise InvalidGroupIdError("the group id is empty")
    if len(group_id) > MAX_GROUP_ID_CHARS:
        raise InvalidGroupIdError(
            f"the group id is {len(group_id)} characters; the limit is {MAX_GROUP_ID_CHARS}"
        )


def _decode(group_id: str, kv: KeyValue) -> tuple[Committed, str | None] | None:
    """The committed offset and the topic id it was committed for (None: written before
    offsets carried one), or None for an unreadable value."""
    rest = kv.key.removeprefix(group_prefix(group_id))
    topic, _, partition = rest.rpartition("/")
    try:
        value = json.loads(kv.value)
        committed = Committed(
            topic=topic,
            partition=int(partition),
            offset=int(value["offset"]),
            metadata=str(value.get("metadata", "")),
            leader_epoch=int(value.get("leader_epoch", -1)),
        )
        topic_id = value.get("topic_id")
        return committed, None if topic_id is None else str(topic_id)
    except (ValueError, KeyError, TypeError) as exc:
        _log.error("bad_offset_key", key=kv.key, error=str(exc))
        return None


def _nothing_committed(topic: str, partition: int) -> Committed:
    """Offset -1 for a partition without a commit; INVALID_TOPIC for a name no topic can
    have, as every other call naming a topic answers (rather than "nothing committed")."""
    try:
        validate_topic_name(topic)
    except InvalidTopicError as exc:
        return Committed(topic, partition, -1, error=exc)
    return Committed(topic, partition, -1)


class OffsetStore:
    """Commit, fetch and list consumer-group offsets. Thread-safe (etcd does the work)."""

    def __init__(self, store: MetaStore, cache: MetadataCache) -> None:
        self._store = store
        self._cache = cache

    def commit(
        self,
        group_id: str,
        offsets: Sequence[Committed],
        guard: Callable[[], list[Compare]] | None = None,
        deadline: float | None = None,
    ) -> list[CommitOutcome]:
        """Validate each partition, write the valid ones; one outcome per input.

        ``guard`` (group membership fencing, ``GroupCoordinator.commit_guard``) raises the
        group's error when the committer may not commit, else returns compares that keep
        that true; each transaction carries them, and when they no longer hold the guard
        is asked again (the group changed meanwhile: it may now refuse).

        ``deadline`` (monotonic): no transaction starts after it (the caller's deadline).
        A commit the client gave up on must not land late, after a newer one of the same
        member: its older offsets would overwrite the newer ones."""
        check_group_id(group_id)
        check_partition_count(len(offsets), "commit")
        outcomes: list[CommitOutcome] = []
        # By key: a partition named twice is written once, with its last valid offset (etcd
        # refuses a transaction that writes a key twice, and that refusal looked like a
        # retriable outage).
        puts: dict[str, PutOp] = {}

        now_ms = int(time.time() * 1000)

        def check(view: MetadataView) -> None:
            for item in offsets:
                error: TidelogError | None = None
                topic_id = ""
                try:
                    topic_id = view.check_partition(item.topic, item.partition).topic_id
                    if item.topic_id and item.topic_id != topic_id:
                        raise InconsistentTopicIdError(
                            f"offset {item.offset} for {item.topic}-{item.partition} is a "
                            f"position in topic id {item.topic_id}, but the topic's id is now "
                            f"{topic_id!r}: it was deleted and created again, and the offset "
                            "is not committed"
                        )
                    if item.offset < 0:
                        raise InvalidRequestError(
                            f"offset {item.offset} for {item.topic}-{item.partition} is negative"
                        )
                    size = len(item.metadata.encode())
                    if size > MAX_METADATA_BYTES:
                        raise OffsetMetadataTooLargeError(
                            f"metadata of {size} bytes for {item.topic}-{item.partition}; the "
                            f"limit is {MAX_METADATA_BYTES}"
                        )
                except TidelogError as exc:
                    error = exc
                outcomes.append(CommitOutcome(item.topic, item.partition, error))
                if error is None:
                    value = json.dumps(
                        {
                            "offset": item.offset,
                            "metadata": item.metadata,
                            "leader_epoch": item.leader_epoch,
                            "topic_id": topic_id,
                            # For offset expiry (services/controller/offset_expiry.py).
                            "commit_time_ms": now_ms,
                        },
                        separators=(",", ":"),
                        sort_keys=True,
                        # UTF-8 as the limit counts it: escaped, control characters took
                        # six bytes each, 24 KiB for 4 KiB of metadata.
                        ensure_ascii=False,
                    ).encode()
                    key = offset_key(group_id, item.topic, item.partition)
                    puts.pop(key, None)  # the last one goes last, in order
                    puts[key] = PutOp(key, value)

        self._cache.read(check)
        writes = list(puts.values())
        for start, end in _txn_ranges(writes):
            try:
                self._write_guarded(writes[start:end], guard, deadline)
            except (MetaStoreError, GroupFencedError) as exc:
                error: TidelogError = exc.error if isinstance(exc, GroupFencedError) else exc
                if start == 0 and isinstance(exc, MetaStoreError):
                    raise  # nothing was written: the whole commit failed
                # Earlier transactions are written (or, fenced by the group, none is):
                # the partitions from here on failed, and the answer says so partition
                # by partition (a whole-call error would claim written ones failed too;
                # a fenced commit answers each partition, as Kafka's OffsetCommit does).
                _log.warning("commit_not_written", group=group_id, start=start, error=str(exc))
                failed = {op.key for op in writes[start:]}
                return [
                    CommitOutcome(o.topic, o.partition, error)
                    if o.error is None and offset_key(group_id, o.topic, o.partition) in failed
                    else o
                    for o in outcomes
                ]
        return outcomes

    def _write_guarded(
        self,
        ops: list[PutOp],
        guard: Callable[[], list[Compare]] | None,
        deadline: float | None = None,
    ) -> None:
        if deadline is not None and time.monotonic() >= deadline:
            raise GroupFencedError(
                RequestTimedOutError("the commit's deadline passed before it was written")
            )
        if guard is None:
            self._store.txn([], ops)
            return
        for _ in range(GUARD_ATTEMPTS):
            try:
                compares = guard()
            except TidelogError as exc:
                raise GroupFencedError(exc) from exc
            # Checked again after the guard's reads, and the transaction given only the
            # time left: a commit whose guard ran slow (etcd stalling) was written long
            # after its client gave up, over the member's newer commit (found by an
            # audit). Not watertight: etcd times a request from when it reads it, and
            # two gateways' commits of one member are not ordered (RELIABILITY.md).
            remaining_s = None if deadline is None else deadline - time.monotonic()
            if remaining_s is not None and remaining_s <= 0:
                raise GroupFencedError(
                    RequestTimedOutError("the commit's deadline passed before it was written")
                )
            if self._store.txn(compares, ops, timeout_s=remaining_s).succeeded:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise GroupFencedError(
                    RequestTimedOutError("the commit's deadline passed before it was written")
                )
        raise GroupFencedError(
            RebalanceInProgressError("the group kept changing while the offsets were committed")
        )

    def fetch(self, group_id: str, partitions: Sequence[tuple[str, int]]) -> list[Committed]:
        """Committed offsets; for ``partitions`` given, one entry each (offset -1 when none),
        else everything the group committed."""
        check_group_id(group_id)
        check_partition_count(len(partitions), "offset fetch")
        kvs = self._store.get_prefix(group_prefix(group_id))
        # Read after the offsets: a topic re-created in between then shows its new id.
        topic_ids = self._cache.read(lambda view: {n: t.topic_id for n, t in view.topics.items()})
        committed: dict[tuple[str, int], Committed] = {}
        for kv in kvs:
            decoded = _decode(group_id, kv)
            if decoded is None:
                continue
            c, topic_id = decoded
            if c.topic in topic_ids and topic_id in (None, topic_ids[c.topic]):
                committed[(c.topic, c.partition)] = c
        if not partitions:
            return sorted(committed.values(), key=lambda c: (c.topic, c.partition))
        return [committed.get((t, p)) or _nothing_committed(t, p) for t, p in partitions]

    def delete_group(self, group_id: str, guard: Callable[[], list[Compare]]) -> int:
        """Delete every committed offset of the group (Kafka's DeleteGroups); how many.

        ``guard`` (``GroupCoordinator.inactive_guard``) raises NonEmptyGroupError while
        the group has members and gives the compare that keeps it memberless. One
        transaction deletes the group's whole key range: all or nothing, however many
        offsets (50 per transaction deleted a part, then answered NON_EMPTY_GROUP when a
        member joined in between). A commit racing the call lands before the delete (and
        goes with it) or after it (and stays), as with Kafka's coordinator."""
        check_group_id(group_id)
        result = self._store.txn(guard(), [DeleteOp(group_prefix(group_id), prefix=True)])
        if not result.succeeded:
            guard()  # the group got members: say so
            raise RebalanceInProgressError(
                f"group {group_id!r} changed while it was deleted (nothing deleted): try again"
            )
        deleted = sum(r.deleted for r in result.responses if isinstance(r, DeleteResult))
        if not deleted:
            raise GroupIdNotFoundError(f"group {group_id!r} has no committed offsets")
        _log.info("group_deleted", group=group_id, offsets=deleted)
        return deleted

    def list_groups(self) -> list[str]:
        groups: set[str] = set()
        for kv in self._store.get_prefix(GROUPS_PREFIX):
            groups.add(unquote(kv.key.removeprefix(GROUPS_PREFIX).split("/", 1)[0]))
            if len(groups) >= MAX_GROUPS_LISTED:
                break
        return sorted(groups)
