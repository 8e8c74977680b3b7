"""``tidelog.Consumer``: read partitions through a gateway, optionally as a consumer group.

A consumer owns a position per assigned partition (the next offset to read). ``poll``
returns records in offset order per partition; positions advance past what was returned.
Records come from below the high watermark only, so nothing a consumer sees can later
disappear.

Fetching (Kafka's ``Fetcher``): the assigned partitions are grouped by their leader (from
the gateway's metadata), and each group has its own long-poll Fetch in flight through the
gateway, so data one leader has is never held back by a round with another. A fetch that
answers is decoded into the buffer and its group fetched again at once - while ``poll``
hands records out - unless ``fetch_max_bytes`` are already buffered. Each partition is in
at most one fetch, which asks from the offset after what the buffer holds of it; a seek, a
reset or a change of assignment drops the partition's buffered data and cancels the fetch
it is in. The grouping only saves rounds: the gateway routes every partition to its
current leader whatever the group, and a leader change noticed in a fetch answer (a
retriable error) refreshes the grouping.

Direct mode (``direct=True``, ``tidelog.leaders``): each group's fetch goes to its leader's
``Storage.Fetch`` itself, as Kafka's consumer fetches, instead of through the gateway (one
gRPC hop less per fetch; offsets and metadata still come from the gateway). The request
and the answer are the same messages the gateway forwards. A broker that cannot be
reached counts as a leader change: the grouping is refreshed after the back-off.

Where a partition starts: the group's committed offset when ``group_id`` is set and the
group committed one; else ``auto_offset_reset`` ("latest", Kafka's default, or
"earliest"; "none" raises ``OffsetOutOfRangeError``). An offset that falls out of range
(retention deleted it) is reset the same way, once the records fetched before it are
handed out: a fetch that reads ahead of the position and finds its offset gone stops the
partition's fetching until the position reaches that offset, and only a fetch at the
position itself resets it (Kafka resets only then too).

Log truncation (KIP-320): a fetch names the leader epoch of the last batch fetched before
its offset, and the leader answers "diverging" when its log does not hold that batch's
history (an unclean election elected a replica that never had it). The records fetched
past the divergence are dropped; a position past it moves back to the leader's end offset
for that epoch, so the records the new leader wrote there are read rather than skipped
(or, with "none", ``OffsetOutOfRangeError`` says so). Commits carry the epoch of the
record before the committed offset, and a position taken from a commit names it, so a
consumer that starts after the truncation detects it too. A position from a reset,
``seek_to_beginning`` or ``seek_to_end`` names the epoch ListOffsets answered with (of
the record before it), and ``pause`` keeps the epoch with the position; only ``seek`` to
a given offset starts without one, as in Kafka.

Invalid batches (Kafka's CorruptRecordException): brokers check only a batch's header and
checksums, so a hostile or buggy producer can write a batch whose body breaks what a decoder
checks (docs/FORMAT.md section 2.4). A fetched batch is decoded one at a time: the valid
batches before a bad one are buffered and handed out as usual, and when the partition's
position reaches the bad batch, ``poll`` (``poll_arrow``, the iterator) raises
``CorruptBatchError`` naming the topic, the partition, the batch's offsets and what is
wrong. The position stays at the bad batch and the partition is not fetched further, so
the next poll raises again: nothing is skipped unless the application seeks past the
batch (the message says to which offset); ``pause`` on the partition stops the errors
meanwhile. Other partitions are not held back (see ``_raise_invalid``).

Group offsets are committed with ``commit()`` (the positions, or given offsets) and, with
``enable_auto_commit``, every ``auto_commit_interval_ms`` during ``poll`` and on
``close``. ``commit()`` and ``committed()`` retry while the gateway cannot answer (a
restart, an outage) for up to ``default_api_timeout_ms`` (60 s, Kafka's
default.api.timeout.ms), then raise its last error; so do the auto-commits of ``close``
and before a rebalance or a new assignment. The auto-commit inside a poll is one attempt
within the poll's timeout (Kafka's is asynchronous: it never holds a poll up); a failed
one is logged and tried again an interval later. ``subscribe`` with a ``group_id``
makes the consumer a member of its group, which shares the topics' partitions among its
members and moves them as members come and go (``tidelog.membership``); commits then name
the member's generation, and a member whose partitions were moved on cannot commit over
their next owner. ``assign`` takes partitions outside group membership (its commits are
refused while the group has members). ``subscribe`` without a ``group_id`` reads every
partition of the topics (partitions added later are picked up on the next metadata
refresh).

``metrics()`` reports Kafka's fetch-manager metrics (``tidelog.metrics``): ``fetch-total``
(fetch answers), ``fetch-size-avg`` and ``-max`` (record bytes an answer brought),
``records-per-request-avg`` and ``-max`` (records it brought), ``records-consumed-total``
(records ``poll`` returned) and ``bytes-consumed-total`` (bytes of the batches ``poll``
finished handing out).

Threads (Kafka's KafkaConsumer rule): one thread at a time. Every public call except
``wakeup()`` and ``metrics()`` notes the thread making it for its duration (the iterator:
while it works out its next record, not while the loop body runs), and a call from another
thread meanwhile raises ``ConcurrentAccessError`` (a ConfigError: "not safe for
multi-threaded access", Kafka's ConcurrentModificationException) at once, changing
nothing: two threads polling one consumer used to hand some records out twice. A call
from the owning thread inside another (a rebalance callback calling ``commit`` or
``close``) is fine. To stop a consumer blocked in another thread, call ``wakeup()``
there, which makes its blocking call raise ``WakeupError``; then ``close()`` in the
thread that polls. ``close()`` from another thread during a poll raises the same
ConcurrentAccessError (as Kafka's does) and closes nothing.
Once closed, every call but ``close()`` (which does nothing again), ``wakeup()`` and
``metrics()`` raises ``ConfigError`` ("the consumer is closed"), as Kafka's
IllegalStateException.

Processes: a consumer made before ``os.fork()`` cannot be used in the child (its fetches,
heartbeat thread and channels are the parent's): every call there raises ``ConfigError``
at once (``tidelog.client.check_same_process``), where a poll used to return nothing for
ever. ``close()`` in the child only marks that copy closed: the group member is the
parent's, which goes on owning it and leaves the group with its own ``close()``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Concatenate, Final, NamedTuple, NoReturn, ParamSpec, TypeVar

import grpc

from tidelog import tracing
from tidelog.client import (
    GatewayConnection,
    check_same_process,
    current_pid,
    error_from_rpc,
    leaders_by_topic,
    raise_for,
)
from tidelog.errors import (
    ConcurrentAccessError,
    ConfigError,
    CorruptBatchError,
    ErrorCode,
    OffsetOutOfRangeError,
    TidelogError,
    UnknownTopicOrPartitionError,
    WakeupError,
    error_for_code,
)
from tidelog.formats import INT32_MAX, INT64_MAX
from tidelog.leaders import LeaderDirectory, directory_for
from tidelog.membership import GroupMembership
from tidelog.metrics import ClientMetrics
from tidelog.records import Header, InvalidBatch, RecordBatch, arrow_schema, decode_valid_batches
from tidelog.topics import validate_topic_name
from tidelog.v1 import common_pb2, gateway_pb2, storage_pb2, storage_pb2_grpc

_log = logging.getLogger(__name__)

TopicPartition = tuple[str, int]

AUTO_OFFSET_RESETS: Final = ("latest", "earliest", "none")
METADATA_REFRESH_S: Final = 30.0
"""How often ``subscribe`` looks for partitions added to its topics (Kafka's
metadata.max.age.ms is 5 minutes; topics here grow rarely but users expect it sooner)."""
RETRY_BACKOFF_S: Final = 0.1
MAX_RETRY_BACKOFF_S: Final = 1.0
"""The longest pause between two attempts of a group call (Kafka's retry.backoff.max.ms)."""
ITERATOR_POLL_TIMEOUT_MS: Final = 1000
"""How long one wait of ``iter(consumer)`` for records lasts before it looks again; also
the bound of an auto-commit the iterator makes between records."""
MIN_AUTO_COMMIT_TIMEOUT_MS: Final = 200
"""The least time an auto-commit made in a poll gets, whatever is left of the poll's
timeout: a commit given a few ms (``poll(timeout_ms=0)``) never reached the gateway's
store, so a loop of short polls never committed. Bounded, and a failure waits an
interval, so a short poll waits at most this long once per ``auto_commit_interval_ms``."""
MAX_FETCHES_IN_FLIGHT: Final = 16
"""Fetches in flight at once, one per leader group: beyond that many leaders, leaders
share a group (by broker id modulo this)."""


class ConsumerRecord(NamedTuple):
    """One record as a consumer sees it."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[Header, ...]


class _Fetch:
    """A Fetch in flight for one leader group: the offset it asked of each partition."""

    __slots__ = ("future", "group", "offsets")

    def __init__(self, group: int, offsets: dict[TopicPartition, int], future: Any) -> None:
        self.group = group
        self.offsets = offsets
        self.future = future


class _Chunk:
    """One fetched batch of one partition, decoded lazily: to records for ``poll``, to
    Arrow for ``poll_arrow``. ``skip`` records at its start were read before; of the
    records after them, the first ``taken`` were handed out (a partial take)."""

    __slots__ = ("_records", "batch", "size_bytes", "skip", "taken", "tp")

    def __init__(self, tp: TopicPartition, batch: RecordBatch, skip: int) -> None:
        self.tp = tp
        self.batch = batch
        self.size_bytes = batch.header.size_bytes
        self.skip = skip
        self.taken = 0
        self._records: list[ConsumerRecord] | None = None

    def records(self) -> list[ConsumerRecord]:
        """Every record after ``skip``, handed out or not."""
        if self._records is None:
            records = self.batch.records_as(ConsumerRecord, self.tp[0], self.tp[1])
            self._records = records[self.skip :] if self.skip else records
        return self._records

    def rest(self) -> list[ConsumerRecord]:
        """The records not handed out yet."""
        records = self.records()
        return records[self.taken :] if self.taken else records

    def arrow(self, pa: Any) -> Any:
        if self._records is not None:
            rows = self.rest()
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


class _Invalid:
    """Stands in the buffer for a partition's invalid batch, after that partition's valid
    records fetched before it (module docstring: invalid batches)."""

    __slots__ = ("message", "tp")

    size_bytes: Final = 0  # nothing of it is buffered or handed out

    def __init__(self, tp: TopicPartition, bad: InvalidBatch, start: int) -> None:
        self.tp = tp
        topic, partition = tp
        if bad.header is None:
            where = (
                f"the record batch at offset {start} is invalid ({bad.reason}); its header "
                "is damaged, so where it ends is unknown"
            )
            skip = f"consumer.seek(({topic!r}, {partition}), <an offset past it>)"
        else:
            last = bad.header.last_offset
            where = (
                f"the record batch at offsets {bad.header.base_offset}..{last} is invalid "
                f"({bad.reason})"
            )
            skip = f"consumer.seek(({topic!r}, {partition}), {last + 1})"
        self.message = (
            f"topic {topic!r} partition {partition}: {where}. The position stays at "
            f"{start} and polling raises this again; to skip the batch and lose its "
            f"records, {skip}"
        )


_Buffered = _Chunk | _Invalid


def _consumer_schema(pa: Any) -> Any:
    """``poll_arrow``'s schema: topic and partition, then ``records.arrow_schema()``."""
    return pa.schema(
        [
            pa.field("topic", pa.string(), nullable=False),
            pa.field("partition", pa.int32(), nullable=False),
            *arrow_schema(),
        ]
    )


RebalanceCallback = Callable[[list[TopicPartition]], None]


class OffsetAndTimestamp(NamedTuple):
    offset: int
    timestamp_ms: int


def _offset_int(offset: object, where: str) -> int:
    """``offset`` as an int: any integer type (numpy's, pandas'), not a bool or float."""
    if isinstance(offset, bool):
        raise ConfigError(f"offset for {where} must be an int, not bool")
    try:
        return operator.index(offset)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(
            f"offset for {where} must be an int, not {type(offset).__name__}"
        ) from None


class _PendingCommitted(NamedTuple):
    """A poll's ask for the group's committed offsets, answered or not yet."""

    partitions: frozenset[TopicPartition]
    # (member id, generation) when asked, as Kafka's Generation: a generation number
    # alone comes round again once a group empties ("" and -1 without a membership).
    member: tuple[str, int]
    future: Any  # grpc's call future of FetchOffsets


class GroupMetadata(NamedTuple):
    group_id: str
    member_id: str
    generation_id: int


_WAKE: Final = _Fetch(-1, {}, None)
"""Put on the answer queue to end a poll's wait (the heartbeat thread: join again)."""

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _one_thread(
    method: Callable[Concatenate[Consumer, _P], _R],
) -> Callable[Concatenate[Consumer, _P], _R]:
    """A public Consumer call: refused in a child made by ``os.fork()`` and while another
    thread is in a call (``Consumer._acquire``)."""

    @functools.wraps(method)
    def guarded(self: Consumer, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        self._acquire()
        try:
            if self._closed:
                # Kafka's IllegalStateException: a closed consumer answers nothing (its
                # group member is gone, its positions are no longer tracked).
                raise ConfigError("the consumer is closed")
            return method(self, *args, **kwargs)
        finally:
            self._release()

    return guarded


class Consumer:
    """See the module docstring.

    Thread-safety (Kafka's): not safe for multi-threaded access. The thread in a call
    owns the consumer until the call returns; a call from any other thread meanwhile
    raises ``ConfigError`` at once and changes nothing (checked, not locked: no lock is
    held across a poll). ``wakeup()`` (any thread, or a signal handler) and ``metrics()``
    are the exceptions. To stop a poll from another thread: ``wakeup()`` there, then
    ``close()`` in the polling thread once its poll raised ``WakeupError``; a
    ``close()`` from another thread during a poll raises ConfigError, as Kafka's
    ConcurrentModificationException, and the consumer goes on working in its thread.

    Invariants: once ``close()`` returns (or a rebalance callback closed the consumer
    inside a poll) no fetch is in flight or buffered, the group was left (unless static)
    and no heartbeat thread runs; a poll in progress ends without joining again. Made
    before ``os.fork()``, every call in the child raises ConfigError and ``close()``
    there only marks the copy closed (module docstring)."""

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
        default_api_timeout_ms: int = 60_000,
        direct: bool = False,
        client_id: str = "tidelog-consumer",
        session_timeout_ms: int = 45_000,
        heartbeat_interval_ms: int = 3_000,
        max_poll_interval_ms: int = 300_000,
        group_instance_id: str | None = None,
    ) -> None:
        # Its fetches, heartbeat thread and channels exist in this process only.
        self._pid = current_pid()
        # The thread in a call (Kafka's currentThread, an AtomicLong there), how deeply
        # (a rebalance callback may call in again), and its name for the error message.
        self._owner_lock = threading.Lock()
        self._owner: int | None = None
        self._owner_depth = 0
        self._owner_name = ""
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
            ("session_timeout_ms", session_timeout_ms),
            ("heartbeat_interval_ms", heartbeat_interval_ms),
            ("max_poll_interval_ms", max_poll_interval_ms),
            ("default_api_timeout_ms", default_api_timeout_ms),
            # As the producer checks it: 0 gave every call a deadline of 0 s.
            ("request_timeout_ms", request_timeout_ms),
        ):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, not {value}")
        for name, value in (
            ("fetch_min_bytes", fetch_min_bytes),
            ("fetch_max_wait_ms", fetch_max_wait_ms),
            ("fetch_max_bytes", fetch_max_bytes),
            ("max_partition_fetch_bytes", max_partition_fetch_bytes),
        ):
            # Sent as int32 fields: a larger value would fail every poll, not here.
            if not 0 <= value <= INT32_MAX:
                raise ConfigError(f"{name} {value} is outside 0..{INT32_MAX}")
        if heartbeat_interval_ms >= session_timeout_ms:
            # Kafka's rule: a session must outlive a few heartbeats.
            raise ConfigError(
                f"heartbeat_interval_ms ({heartbeat_interval_ms}) must be lower than "
                f"session_timeout_ms ({session_timeout_ms})"
            )
        for name, value in (
            ("session_timeout_ms", session_timeout_ms),
            ("max_poll_interval_ms", max_poll_interval_ms),
        ):
            if value > INT32_MAX:
                raise ConfigError(f"{name} {value} is outside 1..{INT32_MAX}")
        self._conn = GatewayConnection.get(gateway, request_timeout_ms)
        self._api_timeout_s = default_api_timeout_ms / 1000
        # Direct mode (module docstring): fetches go to the leaders, found through here.
        self._directory: LeaderDirectory | None = directory_for(self._conn) if direct else None
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
        self._paused_tps: set[TopicPartition] = set()  # pause(): not fetched, not handed out
        self._rotation = 0  # where _send_fetches starts in the assignment (it rotates)
        self._subscription: list[str] = []
        self._positions: dict[TopicPartition, int] = {}
        self._needs_position: set[TopicPartition] = set()
        # Of those, the ones a seek_to_beginning/end asked to reset (Kafka's lazy seek):
        # their next position comes from this spec, not from commits or auto_offset_reset.
        self._reset_specs: dict[TopicPartition, common_pb2.OffsetSpec] = {}
        # When poll may ask again for positions a reset could not find (no leader).
        self._reset_retry_at = 0.0
        # The group's committed offsets asked for by a poll and not yet answered: kept
        # across polls (Kafka's pendingCommittedOffsetRequest), for the same partitions
        # and generation.
        self._pending_committed: _PendingCommitted | None = None
        self._buffer: deque[_Buffered] = deque()
        # Partitions with an invalid batch in the buffer: not fetched until a seek or a
        # pause drops it (module docstring: invalid batches).
        self._invalid: set[TopicPartition] = set()
        self._last_commit = time.monotonic()
        self._last_refresh = 0.0
        self._committed_positions: dict[TopicPartition, int] = {}
        # Fetching (module docstring): the leader of each assigned partition, the fetches
        # in flight by group, the answers waiting to be decoded, and per partition with
        # buffered data the offset after it (where its next fetch starts).
        self._leaders: dict[TopicPartition, int] = {}
        self._leaders_stale = False
        self._fetches: dict[int, _Fetch] = {}
        self._answered: queue.SimpleQueue[_Fetch] = queue.SimpleQueue()
        self._next_fetch: dict[TopicPartition, int] = {}
        self._buffered_bytes = 0
        # Partitions whose read-ahead fetch found its offset out of range: not fetched
        # again until their buffered records are handed out (module docstring).
        self._drain_first: set[TopicPartition] = set()
        # The leader epoch of the batch that ends where a partition's next fetch starts
        # (module docstring: log truncation); absent when unknown.
        self._fetched_epoch: dict[TopicPartition, int] = {}
        # The leader epoch of the record before each position (the last handed out), as
        # Kafka's OffsetAndMetadata.leaderEpoch: commits carry it, and a position taken
        # from a commit names it in its first fetch, so a consumer that starts after an
        # unclean election detects the truncation too.
        self._position_epoch: dict[TopicPartition, int] = {}
        # Topic -> the id of the incarnation the positions belong to (fetches name it).
        self._topic_ids: dict[str, str] = {}
        # When stale leaders may be asked for again (RETRY_BACKOFF_S after the first
        # failure that made them stale).
        self._refresh_after = 0.0
        # Groups not to be fetched from before a time: the last answer carried a
        # throttle_time_ms (the server had no place to hold the long poll, so it answered
        # at once), or the fetch failed (back-off). Other groups go on meanwhile.
        self._paused_until: dict[int, float] = {}
        self._closed = False
        self._closing = False  # inside close(): wake-ups are ignored, as in Kafka's
        # wakeup() requests not yet raised as WakeupError: a list append, which a signal
        # handler may do (a lock could deadlock it, see tidelog.stop_flag).
        self._wakeups: list[int] = []
        # Group membership (tidelog.membership): set by subscribe with a group_id.
        self._client_id = client_id
        self._session_timeout_ms = session_timeout_ms
        self._heartbeat_interval_ms = heartbeat_interval_ms
        self._max_poll_interval_ms = max_poll_interval_ms
        self._membership: GroupMembership | None = None
        if group_instance_id is not None and (group_id is None or not group_instance_id):
            raise ConfigError("group_instance_id needs a group_id and must not be empty")
        self._instance_id = group_instance_id or ""
        self._on_revoked: RebalanceCallback | None = None
        self._revoking = False  # inside the revocation (or lost) callback
        self._on_assigned: RebalanceCallback | None = None
        self._on_lost: RebalanceCallback | None = None
        self._metrics = ClientMetrics(
            counters=("fetch-total", "records-consumed-total", "bytes-consumed-total"),
            sensors=("fetch-size", "records-per-request"),
        )

    # --- one thread at a time (class docstring) --------------------------------------------

    def _acquire(self) -> None:
        """Enter a public call: ConfigError in a forked child, or when another thread is
        in a call (Kafka's acquire()); re-entrant for the owning thread."""
        # First, and without the lock: a parent's thread may have held it at the fork.
        check_same_process(self._pid, "Consumer")
        me = threading.get_ident()
        with self._owner_lock:
            if self._owner is not None and self._owner != me:
                raise ConcurrentAccessError(
                    "this Consumer is not safe for multi-threaded access: thread "
                    f"{self._owner_name!r} is in a call on it (Kafka's "
                    "ConcurrentModificationException). Use one consumer per thread; to stop "
                    "a poll from another thread, call wakeup() there, then close() in the "
                    "polling thread"
                )
            if self._owner is None:
                self._owner = me
                self._owner_name = threading.current_thread().name
            self._owner_depth += 1

    def _release(self) -> None:
        with self._owner_lock:
            self._owner_depth -= 1
            if self._owner_depth == 0:
                self._owner = None

    # --- assignment -----------------------------------------------------------------------

    @_one_thread
    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """Read exactly these partitions (replaces any earlier assignment/subscription)."""
        wanted = list(dict.fromkeys((str(t), int(p)) for t, p in partitions))
        leaders = self._partition_leaders(sorted({t for t, _ in wanted}))
        for topic, partition in wanted:
            if not 0 <= partition < len(leaders[topic]):
                raise error_for_code(
                    ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
                    f"topic {topic!r} has {len(leaders[topic])} partitions; partition "
                    f"{partition} does not exist",
                )
        self._commit_before_reassigning()
        try:
            self._revoke_group_partitions(committed=True)
        finally:
            # Even when the revocation callback raised: it stopped here before, still a
            # member (heartbeating, holding the partitions in the group) reading nothing.
            self._leave_group()
            self._subscription = []
            self._set_assignment(wanted, leaders)

    @_one_thread
    def subscribe(
        self,
        topics: Sequence[str],
        *,
        on_partitions_revoked: RebalanceCallback | None = None,
        on_partitions_assigned: RebalanceCallback | None = None,
        on_partitions_lost: RebalanceCallback | None = None,
    ) -> None:
        """Read the partitions of ``topics``.

        With a ``group_id``, as a member of the group (module docstring of
        ``tidelog.membership``): the group's members share the partitions, and ``poll``
        joins the group first. ``on_partitions_revoked`` is called with the partitions
        this consumer gives up, before it gives them up (after the auto-commit, if on),
        and ``on_partitions_assigned`` with the ones it gets, as Kafka's
        ConsumerRebalanceListener; both on the thread that polls. Partitions that may be
        another member's already (this member was evicted: its session ended, it missed
        ``max_poll_interval_ms``, a commit was refused as from an old generation) are told
        to ``on_partitions_lost`` instead (Kafka's onPartitionsLost, KIP-429), whose
        listener must not commit them; without one, to ``on_partitions_revoked``, as
        Kafka's default does.

        Without a ``group_id``, every partition of the topics (they must exist), picking
        up partitions added later at the next metadata refresh."""
        if isinstance(topics, str):
            raise ConfigError("subscribe takes a list of topic names, not one string")
        wanted = list(dict.fromkeys(topics))
        if not wanted:
            self.unsubscribe()  # Kafka's rule for an empty subscription
            return
        if self.group_id is not None:
            for topic in wanted:
                # Said here, not at the first poll's join (a group may wait for topics
                # that do not exist yet, but never for a name no topic can have); and
                # before anything changes, so a bad name leaves the subscription as it was.
                validate_topic_name(topic)
            if self._membership is not None and set(wanted) == set(self._subscription):
                # The subscription it has: nothing changes but the callbacks, as Kafka's
                # subscribe rejoins only for a new subscription. It revoked everything,
                # made the whole group rebalance and took positions afresh from the
                # commits: without auto-commit, what was read since was handed out again
                # (found by an audit).
                self._on_revoked = on_partitions_revoked
                self._on_assigned = on_partitions_assigned
                self._on_lost = on_partitions_lost
                return
        self._commit_before_reassigning()
        try:
            self._revoke_group_partitions(committed=True)  # (told to the callbacks given with them)
        finally:
            # The change is made even when the revocation callback raised (which is then
            # re-raised), as Kafka's subscribe only records it: stopping there left the
            # membership joined with the old partitions and topics, and no poll joined
            # again (found by an audit).
            self._on_revoked = on_partitions_revoked
            self._on_assigned = on_partitions_assigned
            self._on_lost = on_partitions_lost
            if self.group_id is not None:
                self._subscribe_group(wanted)
        if self.group_id is None:
            before = self._subscription
            self._subscription = wanted
            try:
                self._refresh_subscription()
            except BaseException:
                # A topic that does not exist changes nothing: subscription() named the
                # new topics while poll() went on reading the old (found by an audit).
                self._subscription = before
                raise

    def _subscribe_group(self, wanted: list[str]) -> None:
        """Make the group membership (once) and have the next poll join with ``wanted``."""
        assert self.group_id is not None
        if self._membership is None:
            self._membership = GroupMembership(
                self._conn,
                self.group_id,
                client_id=self._client_id,
                session_timeout_ms=self._session_timeout_ms,
                rebalance_timeout_ms=self._max_poll_interval_ms,
                heartbeat_interval_ms=self._heartbeat_interval_ms,
                max_poll_interval_ms=self._max_poll_interval_ms,
                wake=lambda: self._answered.put(_WAKE),
                instance_id=self._instance_id,
            )
        self._subscription = wanted
        self._set_assignment([], {})
        self._membership.request_rejoin()  # the next poll joins with these topics

    def _revoke_group_partitions(self, *, committed: bool = False) -> None:
        """A group member gives up its partitions (Kafka's onPartitionsRevoked, or
        onPartitionsLost): their positions committed first (auto-commit) unless they may
        already be another member's, then ``on_partitions_revoked``, then its buffered
        records are dropped. ``committed``: the caller's ``_commit_before_reassigning``
        has just tried; a second try (close, unsubscribe, assign, subscribe) doubled the
        time a close took with the gateway down, past default_api_timeout_ms (found by
        an audit)."""
        membership = self._membership
        if membership is None or not self._assignment or self._revoking:
            # (Revoking already: the callback called close, unsubscribe or assign, which
            # give the same partitions up; telling it again would recurse.)
            return
        revoked = list(self._assignment)
        lost = membership.partitions_lost()
        if not lost:
            if not committed:
                self._commit_before_reassigning()
            # A commit the group refused (ILLEGAL_GENERATION, UNKNOWN_MEMBER_ID) shows the
            # partitions were another member's already: lost, not revoked (Kafka's
            # onPartitionsLost), read again after the commit (found by an audit).
            lost = membership.partitions_lost()
        callback = self._on_revoked
        if lost and self._on_lost is not None:
            callback = self._on_lost
        self._revoking = True
        try:
            if callback is not None:
                with membership.in_callback():
                    callback(revoked)
        finally:
            self._revoking = False
            if self._closed or self._membership is membership:
                # (Not when the callback assigned or subscribed anew: that one stands.)
                self._set_assignment([], {})

    @_one_thread
    def group_metadata(self) -> GroupMetadata | None:
        """This consumer's membership (Kafka's groupMetadata): None unless it subscribed
        with a ``group_id``; ``generation_id`` -1 while it is (re)joining."""
        membership = self._membership
        if membership is None:
            return None
        member_id, generation = membership.commit_identity()
        if membership.needs_join():
            generation = -1
        return GroupMetadata(membership.group_id, member_id, generation)

    def _leave_group(self) -> None:
        self._drop_pending_committed()
        if self._membership is not None:
            self._membership.leave()
            self._membership = None

    def _rejoin(self, deadline: float) -> None:
        """Give up every partition and join the group again (Kafka's eager rebalance):
        commit the positions first (auto-commit), so whoever gets a partition next
        resumes where this consumer stopped; then take the new assignment, its positions
        from the group's commits."""
        membership = self._membership
        assert membership is not None
        self._revoke_group_partitions()
        if self._closed or self._membership is not membership:
            # The revocation callback closed the consumer (or unsubscribed, or assigned):
            # joining with the membership it left would make a member nobody polls for,
            # holding partitions (found by an audit: a zombie member).
            return
        assignment = membership.join(self._subscription, deadline, self._raise_if_woken)
        if assignment is None:
            # The poll's time is up (the next poll goes on joining), or the membership
            # was left meanwhile.
            return
        try:
            leaders, complete = self._assigned_leaders(sorted({t for t, _ in assignment}))
        except BaseException:
            # The group holds these partitions for this member now: without the
            # assignment, and with nothing to join again, none of them would be read.
            membership.request_rejoin()
            raise
        self._set_assignment(assignment, leaders)
        if not complete:
            # Some leaders are unknown (their partitions are not fetched until they are
            # found): looked up again after a pause, as after a fetch from a moved leader.
            self._leaders_stale = True
            self._refresh_after = time.monotonic() + RETRY_BACKOFF_S
        # Positions are set afresh from the commits: a partition this consumer had before
        # may have been read and committed further by another member meanwhile.
        self._positions = {}
        self._needs_position = set(assignment)
        self._reset_specs = {}
        self._committed_positions = {}
        if self._on_assigned is not None:
            with membership.in_callback():
                self._on_assigned(list(assignment))

    def _assigned_leaders(self, topics: list[str]) -> tuple[dict[str, list[int]], bool]:
        """The leaders of a new assignment's topics, and whether all were found. A
        retriable failure (the gateway restarting, a timeout) leaves those unknown, as
        Kafka's consumer keeps its assignment and refreshes its metadata: raised, it
        failed the poll after the join, before the assignment was taken, and stranded
        the partitions (found by an audit)."""
        leaders: dict[str, list[int]] = {}
        complete = True
        for topic in topics:  # one by one: a topic deleted meanwhile has no leaders
            try:
                leaders.update(self._partition_leaders([topic]))
            except UnknownTopicOrPartitionError:
                continue  # (its fetches answer with that error, as for any assignment)
            except TidelogError as exc:
                if not exc.retriable:
                    raise
                complete = False
        return leaders, complete

    def _refresh_subscription(self, *, allow_missing: bool = False) -> None:
        """Assign every partition of the subscribed topics. With ``allow_missing``, a
        topic that no longer exists (deleted since ``subscribe``) has no partitions until
        it exists again, as in Kafka, instead of failing the others' reads."""
        try:
            leaders = self._partition_leaders(self._subscription)
        except UnknownTopicOrPartitionError:
            if not allow_missing:
                raise
            leaders = {}
            for topic in self._subscription:  # one by one, to learn which are gone
                with contextlib.suppress(UnknownTopicOrPartitionError):
                    leaders.update(self._partition_leaders([topic]))
        self._set_assignment(
            [(t, p) for t in self._subscription if t in leaders for p in range(len(leaders[t]))],
            leaders,
        )

    def _commit_before_reassigning(self) -> None:
        """With auto-commit on, commit the positions of the current assignment before it
        is replaced, as Kafka's assign and subscribe do: a partition dropped from it
        takes its position along, and whoever reads it next would read again what this
        consumer read since the last auto-commit."""
        if self._auto_commit and not self._group_partitions_lost():
            self._last_commit = 0.0
            self._maybe_auto_commit()

    def _refresh_leaders(self) -> None:
        """Regroup the assigned partitions by leader (and, when subscribed, pick up
        partitions added to the topics)."""
        if self._subscription and self._membership is None:
            self._refresh_subscription(allow_missing=True)
            return
        topics = sorted({t for t, _ in self._assignment})
        try:
            leaders = self._partition_leaders(topics) if topics else {}
        except UnknownTopicOrPartitionError:
            # An assigned topic is gone: its fetches keep answering with that error (as
            # Kafka's consumer does for an assignment); the others are regrouped by what
            # the metadata says of them now. Giving up on all of them left a partition
            # whose leader moved fetching from the old one for good, in direct mode
            # (found by an audit).
            leaders = {}
            for topic in topics:
                with contextlib.suppress(UnknownTopicOrPartitionError):
                    leaders.update(self._partition_leaders([topic]))
        self._set_assignment(self._assignment, leaders)

    def _try_refresh_leaders(self) -> None:
        """``_refresh_leaders`` inside a poll: with the gateway unreachable, fetching goes
        on from the leaders known (direct mode) or retries through the gateway, and the
        look-up is tried again after a pause, as Kafka's poll does, instead of every
        poll raising at once."""
        try:
            self._refresh_leaders()
        except TidelogError as exc:
            if not exc.retriable:
                raise
            now = time.monotonic()
            self._last_refresh = now
            self._leaders_stale = True
            self._refresh_after = now + RETRY_BACKOFF_S

    def _partition_leaders(self, topics: Sequence[str]) -> dict[str, list[int]]:
        """Each topic's partition leaders, noting its id: a topic whose id changed was
        deleted and created again (``_on_recreated``)."""
        if self._directory is not None:
            leaders = self._directory.refresh(topics)  # the brokers' addresses come along
            ids = {topic: self._directory.topic_id(topic) for topic in leaders}
        else:
            response = self._conn.metadata(topics)
            leaders = leaders_by_topic(response)
            ids = {t.name: t.topic_id for t in response.topics}
        recreated = []
        for topic, topic_id in ids.items():
            known = self._topic_ids.get(topic)
            self._topic_ids[topic] = topic_id
            if known and topic_id and known != topic_id:
                recreated.append(topic)
        if recreated:
            self._on_recreated(recreated)
        return leaders

    def _on_recreated(self, topics: list[str]) -> None:
        """``topics`` were deleted and created again since this consumer's positions in
        them were set (a fetch answered INCONSISTENT_TOPIC_ID, or the metadata shows a
        new id): those positions mean nothing in the new topic. They are set again as
        for a partition without one (a group's commit of the new topic, else
        ``auto_offset_reset``; with "none", ``OffsetOutOfRangeError``). Before, the
        position carried over: the new topic's records below it were skipped."""
        gone = {tp for tp in self._assignment if tp[0] in topics}
        self._drop_buffered(gone)
        for tp in gone:
            self._positions.pop(tp, None)
            self._committed_positions.pop(tp, None)
        self._needs_position |= gone
        if gone and self._reset == "none":
            names = ", ".join(sorted(topics))
            raise OffsetOutOfRangeError(
                f"topic {names} was deleted and created again: the positions in it are "
                "gone and auto_offset_reset is 'none'; seek to go on"
            )

    def _set_assignment(
        self, partitions: list[TopicPartition], leaders: dict[str, list[int]]
    ) -> None:
        self._last_refresh = time.monotonic()
        self._leaders_stale = False
        keep = set(partitions)
        if keep != set(self._assignment):
            self._drop_pending_committed()
        self._drop_buffered({tp for tp in self._assignment if tp not in keep})
        self._assignment = partitions
        self._positions = {tp: o for tp, o in self._positions.items() if tp in keep}
        # What this consumer last committed means nothing for a partition it gave up: back
        # later at the same offset, the auto-commit skipped it as unchanged, over what
        # another consumer had committed meanwhile (found by an audit).
        self._committed_positions = {
            tp: o for tp, o in self._committed_positions.items() if tp in keep
        }
        self._needs_position = {tp for tp in partitions if tp not in self._positions}
        self._reset_specs = {tp: s for tp, s in self._reset_specs.items() if tp in keep}
        self._paused_tps &= keep
        self._leaders = {
            (t, p): leaders[t][p] if t in leaders and p < len(leaders[t]) else -1
            for t, p in partitions
        }

    @_one_thread
    def assignment(self) -> list[TopicPartition]:
        return list(self._assignment)

    @_one_thread
    def subscription(self) -> list[str]:
        """The topics ``subscribe`` was given (empty after ``assign`` or ``unsubscribe``)."""
        return list(self._subscription)

    @_one_thread
    def partitions_for(self, topic: str) -> list[int]:
        """The partition ids of ``topic`` (UnknownTopicOrPartitionError if it does not
        exist), as the producer's ``partitions_for``."""
        return list(range(self._conn.partition_counts([topic])[topic]))

    # --- flow control (Kafka's pause / resume) --------------------------------------------

    @_one_thread
    def pause(self, partitions: Iterable[TopicPartition]) -> None:
        """Fetch nothing more for these assigned partitions and hand out none of their
        records until ``resume``; their positions stay where they are. What was already
        fetched for them is dropped (fetched again after ``resume``). A rebalance or a
        new assignment forgets the pause of partitions it takes away."""
        tps = {self._check_assigned(tp) for tp in partitions}
        self._paused_tps |= tps
        # The position stays, and so does its epoch: dropped, a log truncated during the
        # pause went unnoticed after resume, and a commit meanwhile stored no epoch.
        self._drop_buffered(tps, keep_epochs=True)

    @_one_thread
    def resume(self, partitions: Iterable[TopicPartition]) -> None:
        """Fetch these paused partitions again (from their positions)."""
        tps = {self._check_assigned(tp) for tp in partitions}
        self._paused_tps -= tps

    @_one_thread
    def paused(self) -> list[TopicPartition]:
        return sorted(self._paused_tps)

    @_one_thread
    def unsubscribe(self) -> None:
        self._commit_before_reassigning()
        try:
            self._revoke_group_partitions(committed=True)
        finally:
            # Even when the revocation callback raised: the group is left all the same
            # (stopping there kept a member holding partitions that nobody read).
            self._leave_group()
            self._subscription = []
            self._set_assignment([], {})

    # --- positions ------------------------------------------------------------------------

    def _check_assigned(self, tp: TopicPartition) -> TopicPartition:
        tp = (str(tp[0]), int(tp[1]))
        if tp not in self._assignment:
            raise ConfigError(f"partition {tp[0]}-{tp[1]} is not assigned to this consumer")
        return tp

    @_one_thread
    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Read ``tp`` from ``offset`` next."""
        tp = self._check_assigned(tp)
        # An offset no fetch can carry (a float, past int64) was taken, and every poll
        # after it raised protobuf's TypeError or ValueError (found by an audit).
        offset = _offset_int(offset, f"{tp[0]}-{tp[1]}")
        if offset < 0:
            raise ConfigError(f"offset {offset} is negative; use seek_to_beginning/end")
        if offset > INT64_MAX:
            raise ConfigError(f"offset {offset} is past the largest offset, {INT64_MAX}")
        self._positions[tp] = offset
        self._needs_position.discard(tp)
        self._reset_specs.pop(tp, None)
        self._drop_buffered({tp})

    @_one_thread
    def seek_to_beginning(self, tps: Iterable[TopicPartition] | None = None) -> None:
        """The next poll of ``tps`` (None: every assigned partition) starts at its log
        start. Lazy, as Kafka's: the offset is looked up by the next ``poll`` or
        ``position``, each partition on its own."""
        self._seek_to(tps, common_pb2.EARLIEST)

    @_one_thread
    def seek_to_end(self, tps: Iterable[TopicPartition] | None = None) -> None:
        """The next poll of ``tps`` (None: every assigned partition) starts at its HW.
        Lazy, as ``seek_to_beginning``."""
        self._seek_to(tps, common_pb2.LATEST)

    def _seek_to(
        self, partitions: Iterable[TopicPartition] | None, spec: common_pb2.OffsetSpec
    ) -> None:
        """Mark ``partitions`` for a reset to ``spec``. Looking the offsets up here, all
        at once, failed the whole seek when one assigned topic had been deleted, and the
        consumer could not be moved at all until it was unassigned (found by an audit)."""
        tps = (
            list(self._assignment)
            if partitions is None
            else [self._check_assigned(tp) for tp in partitions]
        )
        self._drop_buffered(set(tps))
        for tp in tps:
            self._positions.pop(tp, None)
            self._needs_position.add(tp)
            self._reset_specs[tp] = spec

    def _set_positions(self, found: Mapping[TopicPartition, storage_pb2.ListOffsetsResult]) -> None:
        """Move to offsets ListOffsets found, with the leader epoch each came with: the
        first fetch names it, so a log truncated below the position on a failover is
        found out (KIP-320). Without it a reset or seek_to_end position skipped the
        records a new leader wrote in place of lost ones (found by an audit)."""
        self._drop_buffered(set(found))
        for tp, item in found.items():
            self._positions[tp] = item.offset
            self._needs_position.discard(tp)
            self._reset_specs.pop(tp, None)
            if item.leader_epoch >= 0:
                self._position_epoch[tp] = item.leader_epoch
                self._fetched_epoch[tp] = item.leader_epoch

    @_one_thread
    def end_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """The high watermark of each partition: the offset after the last readable record
        (Kafka's ``endOffsets``)."""
        found = self._conn.list_offsets(self._existing(partitions), common_pb2.LATEST)
        return {tp: offset for tp, (offset, _) in found.items()}

    @_one_thread
    def beginning_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """The first offset still retained in each partition."""
        found = self._conn.list_offsets(self._existing(partitions), common_pb2.EARLIEST)
        return {tp: offset for tp, (offset, _) in found.items()}

    def _existing(self, partitions: Iterable[TopicPartition]) -> list[TopicPartition]:
        """``partitions``, each checked to exist: an unknown topic or partition fails at
        once (ListOffsets would retry it as "not propagated yet" for the whole request
        timeout, then raise REQUEST_TIMED_OUT; found by an audit)."""
        wanted = [(str(topic), int(partition)) for topic, partition in partitions]
        counts = self._conn.partition_counts(sorted({t for t, _ in wanted}))
        for topic, partition in wanted:
            if not 0 <= partition < counts[topic]:
                raise UnknownTopicOrPartitionError(
                    f"topic {topic!r} has {counts[topic]} partitions; partition {partition} "
                    "does not exist"
                )
        return wanted

    @_one_thread
    def offsets_for_times(
        self, timestamps: Mapping[TopicPartition, int]
    ) -> dict[TopicPartition, OffsetAndTimestamp | None]:
        """Per partition, the first offset whose record timestamp is >= the given one
        (ms since the epoch), with that record's timestamp; None where no record is that
        recent (Kafka's ``offsetsForTimes``). The partitions need not be assigned."""
        by_time: dict[int, list[TopicPartition]] = {}
        for (topic, partition), timestamp_ms in timestamps.items():
            if isinstance(timestamp_ms, bool) or not isinstance(timestamp_ms, int):
                raise ConfigError(f"timestamp for {topic}-{partition} must be an int (ms)")
            if not 0 <= timestamp_ms <= INT64_MAX:
                raise ConfigError(
                    f"timestamp {timestamp_ms} for {topic}-{partition} is outside 0..{INT64_MAX}"
                )
            by_time.setdefault(timestamp_ms, []).append((str(topic), int(partition)))
        self._existing([tp for tps in by_time.values() for tp in tps])
        result: dict[TopicPartition, OffsetAndTimestamp | None] = {}
        deadline = time.monotonic() + self._conn.timeout_s  # one timeout for every look-up
        for timestamp_ms, tps in by_time.items():
            found = self._conn.list_offsets(
                tps, common_pb2.BY_TIMESTAMP, timestamp_ms, deadline=deadline
            )
            for tp in tps:
                offset, found_ms = found[tp]
                result[tp] = None if offset < 0 else OffsetAndTimestamp(offset, found_ms)
        return result

    @_one_thread
    def position(self, tp: TopicPartition) -> int:
        """The offset of the next record ``poll`` returns for ``tp``."""
        tp = self._check_assigned(tp)
        self._ensure_positions(only=[tp])  # the others' look-ups are not this call's
        return self._positions[tp]

    def _drop_buffered(self, tps: set[TopicPartition], *, keep_epochs: bool = False) -> None:
        """Forget what was fetched for ``tps`` (their position changed or they left the
        assignment): buffered records, where the next fetch starts, fetches in flight,
        and, unless ``keep_epochs`` (the position stays), the position's leader epoch."""
        if not tps:
            return
        kept: deque[_Buffered] = deque()
        for chunk in self._buffer:
            if chunk.tp in tps:
                self._buffered_bytes -= chunk.size_bytes
            else:
                kept.append(chunk)
        self._buffer = kept
        for tp in tps:
            self._invalid.discard(tp)
            self._next_fetch.pop(tp, None)
            self._drain_first.discard(tp)
            if not keep_epochs:
                self._fetched_epoch.pop(tp, None)
                self._position_epoch.pop(tp, None)
        for group, fetch in list(self._fetches.items()):
            if not tps.isdisjoint(fetch.offsets):
                # Its answer for these partitions would start at the old offsets; the
                # group is fetched again from the new ones.
                del self._fetches[group]
                fetch.future.cancel()

    def _ensure_positions(
        self,
        *,
        only: Sequence[TopicPartition] | None = None,
        one_pass: bool = False,
        poll_deadline: float | None = None,
    ) -> None:
        """Positions for the partitions that need one (``only`` those named): the group's
        commits, else ``auto_offset_reset``. ``one_pass`` (poll's way): partitions whose
        reset failed retriably (no leader right now) keep waiting for a position, asked
        again after a back-off, while the others are fetched, as Kafka resets each
        partition on its own. One partition without a leader used to hold every other
        partition's reset in a retry loop until the request timeout, and fail it: a
        consumer whose broker died read nothing at all (found by an audit).

        The group's commits are asked for within ``poll_deadline`` in one pass (at least
        ``MIN_AUTO_COMMIT_TIMEOUT_MS``), as Kafka's poll refreshes committed offsets within
        its timer; a retriable failure leaves every partition waiting for its position
        (never reset by ``auto_offset_reset``: that would skip or re-read records), asked
        again after a back-off. A poll right after a join used to retry the look-up for
        ``default_api_timeout_ms`` while the gateway was away, and raise (found by an
        audit)."""
        wanted = self._needs_position if only is None else self._needs_position & set(only)
        if not wanted or (one_pass and time.monotonic() < self._reset_retry_at):
            return
        missing = sorted(tp for tp in wanted if tp not in self._reset_specs)
        by_spec: dict[common_pb2.OffsetSpec, list[TopicPartition]] = {}
        for tp in sorted(wanted - set(missing)):
            by_spec.setdefault(self._reset_specs[tp], []).append(tp)
        for spec, tps in by_spec.items():  # seek_to_beginning/end's, before any commit
            self._reset_to(tps, spec, one_pass)
        if missing and self.group_id is not None:
            if one_pass and poll_deadline is not None:
                try:
                    answered = self._committed_across_polls(missing, poll_deadline)
                except TidelogError as exc:
                    if not exc.retriable:
                        raise
                    _log.info("committed offsets not fetched (%s); asking again shortly", exc)
                    self._reset_retry_at = time.monotonic() + RETRY_BACKOFF_S
                    return
                if answered is None:
                    return  # still on its way: a later poll takes the answer
                committed = answered
            else:
                committed = self._committed_entries(missing)
            for tp, (offset, epoch) in committed.items():
                if offset >= 0:
                    self._positions[tp] = offset
                    self._needs_position.discard(tp)
                    if epoch >= 0:
                        self._position_epoch[tp] = epoch
                        self._fetched_epoch[tp] = epoch
        self._reset_positions([tp for tp in missing if tp in self._needs_position], one_pass)

    def _reset_positions(self, tps: list[TopicPartition], one_pass: bool = False) -> None:
        if not tps:
            return
        if self._reset == "none":
            raise OffsetOutOfRangeError(
                f"no valid position for {', '.join(f'{t}-{p}' for t, p in tps)} and "
                "auto_offset_reset is 'none'"
            )
        spec = common_pb2.EARLIEST if self._reset == "earliest" else common_pb2.LATEST
        self._reset_to(tps, spec, one_pass)

    def _reset_to(
        self, tps: list[TopicPartition], spec: common_pb2.OffsetSpec, one_pass: bool
    ) -> None:
        """Positions from ListOffsets ``spec``; ``one_pass``: see ``_ensure_positions``."""
        if not one_pass:
            self._set_positions(self._conn.list_offset_results(tps, spec))
            return
        failed: dict[TopicPartition, TidelogError] = {}
        found = self._conn.list_offset_results(tps, spec, partial=True, failed=failed)
        self._set_positions(found)
        for error in failed.values():
            if not error.retriable:
                raise error
        if failed:
            self._reset_retry_at = time.monotonic() + RETRY_BACKOFF_S

    # --- polling --------------------------------------------------------------------------

    @_one_thread
    def poll(self, max_records: int | None = None, timeout_ms: int = 1000) -> list[ConsumerRecord]:
        """Up to ``max_records`` records (default ``max_poll_records``), waiting at most
        ``timeout_ms`` for some to arrive; an empty list when none did."""
        limit = self._poll_limit(max_records)
        self._wait_for_data(timeout_ms)
        return self._take(limit)

    @_one_thread
    def poll_arrow(self, max_records: int | None = None, timeout_ms: int = 1000) -> Any:
        """Like ``poll``, as a ``pyarrow.Table`` (topic, partition, offset, timestamp_ms,
        key, value, headers) built by Arrow kernels with no Python work per record: the
        way to consume in bulk (data pipelines, DataFrames)."""
        limit = self._poll_limit(max_records)
        self._wait_for_data(timeout_ms)
        return self._take_arrow(limit)

    def _poll_limit(self, max_records: int | None) -> int:
        if max_records is None:
            return self._max_poll_records
        if isinstance(max_records, bool) or not isinstance(max_records, int) or max_records < 1:
            # 0 used to mean the default (500) without a word.
            raise ConfigError(f"max_records must be an int >= 1, got {max_records!r}")
        return max_records

    def wakeup(self) -> None:
        """Make the blocking call in progress (``poll``, ``poll_arrow``, the iterator,
        ``commit``), or the next one if none is, raise ``WakeupError`` (Kafka's
        ``wakeup()``): the way to stop a consumer loop from another thread or a signal
        handler. Safe in both; the consumer stays usable (close it, or poll again). A
        request already sent (a group join, a commit) is answered first: they are bounded
        by the poll's timeout and ``request_timeout_ms``. The consumer's own commits (the
        auto-commit, the commit before a rebalance) are not interrupted and leave the
        wake-up for the next check, between records at the latest.

        The only call another thread may make while one polls (with ``metrics()``): to
        stop a consumer from elsewhere, ``wakeup()`` there, then ``close()`` in the
        thread that polls (a ``close()`` from another thread raises ConfigError)."""
        self._wakeups.append(1)
        self._answered.put(_WAKE)  # SimpleQueue.put is reentrant: safe in a handler

    def _raise_if_woken(self) -> None:
        if self._wakeups and not self._closing:
            # (Closing ignores wake-ups, as Kafka's close disables them: a wake-up meant
            # for a poll must not stop the commit and the leave of the close after it.)
            self._wakeups.clear()
            raise WakeupError("the consumer was woken up (Consumer.wakeup())")

    def metrics(self) -> dict[str, float]:
        """Kafka's consumer fetch metrics by name (module docstring), cumulative."""
        return self._metrics.snapshot()

    def _wait_for_data(self, timeout_ms: int) -> None:
        membership = self._membership
        if membership is None:
            self._wait(timeout_ms)
            return
        with membership.polling():
            self._wait(timeout_ms)

    def _wait(self, timeout_ms: int) -> None:
        if self._closed:
            raise ConfigError("the consumer is closed")
        if not self._assignment and not self._subscription:
            # Kafka's IllegalStateException: there is nothing such a poll could wait for
            # (and `for record in consumer` would spin).
            raise ConfigError(
                "the consumer is not subscribed to any topic or assigned any partition"
            )
        self._raise_if_woken()
        deadline = time.monotonic() + max(timeout_ms, 0) / 1000
        if self._membership is not None:
            self._membership.raise_if_fenced()
            self._membership.polled()
            if self._membership.needs_join():
                self._rejoin(deadline)
        if self._closed:
            return  # a rebalance callback closed the consumer: nothing more to wait for
        self._maybe_auto_commit(deadline)
        now = time.monotonic()
        if (self._leaders_stale and now >= self._refresh_after) or (
            now - self._last_refresh > METADATA_REFRESH_S
        ):
            self._try_refresh_leaders()
        while True:
            self._raise_if_woken()
            self._decode_answered()
            if self._membership is not None and self._membership.needs_join():
                self._membership.raise_if_fenced()
                if self._buffer and not self._membership.partitions_lost():
                    # Still this member's until it joins again: hand these out first (the
                    # next poll commits them and gives the partitions up). Lost ones'
                    # records are dropped: another member may be reading them already.
                    return
                self._rejoin(deadline)
                if self._closed:
                    # A rebalance callback closed the consumer: no join again, no fetch
                    # (they used to go on until the poll's timeout).
                    return
            if self._leaders_stale and time.monotonic() >= self._refresh_after:
                # A leader moved or died while fetches to the others are in flight: regroup
                # now, not when this poll ends (a long poll would otherwise send the moved
                # partitions' fetches to the dead broker until its timeout).
                self._try_refresh_leaders()
            self._ensure_positions(one_pass=True, poll_deadline=deadline)
            self._send_fetches()
            if self._buffer:
                return
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return
            now = time.monotonic()
            # When something is due whatever the fetches in flight answer: a paused
            # group's next fetch, or the stale leaders' look-up (entries already past are
            # dropped by the next _send_fetches).
            due = [t for t in self._paused_until.values() if t > now]
            if self._leaders_stale:
                due.append(self._refresh_after)
            if not self._fetches:
                # Paused or backing off: nothing is in flight, so only a wake-up (wakeup(),
                # the heartbeat thread) can arrive while this waits.
                due.append(now + RETRY_BACKOFF_S)  # (nothing due: never spin)
            if due:
                remaining_s = min(remaining_s, max(0.0, min(due) - now))
            try:
                fetch = self._answered.get(timeout=remaining_s)
            except queue.Empty:
                continue  # the deadline (checked above) or a throttle's end
            self._decode(fetch)

    def _take(self, limit: int) -> list[ConsumerRecord]:
        """Hand out buffered records; each chunk is one partition's run of consecutive
        offsets, so positions advance per chunk, not per record."""
        out: list[ConsumerRecord] = []
        while self._buffer and len(out) < limit:
            chunk = self._buffer[0]
            if isinstance(chunk, _Invalid):
                if out:
                    break  # these first; the next poll raises
                self._raise_invalid()
            records = chunk.rest()
            room = limit - len(out)
            if len(records) <= room:
                taken = records
                self._drop_first_chunk()
            else:
                taken = records[:room]
                chunk.taken += room
            out.extend(taken)
            self._positions[chunk.tp] = taken[-1].offset + 1
            self._position_epoch[chunk.tp] = chunk.batch.header.partition_leader_epoch
        self._metrics.add("records-consumed-total", len(out))
        return out

    def _drop_first_chunk(self) -> None:
        """The buffer's first chunk is all handed out."""
        chunk = self._buffer.popleft()
        self._buffered_bytes -= chunk.size_bytes
        self._metrics.add("bytes-consumed-total", chunk.size_bytes)

    def _raise_invalid(self) -> NoReturn:
        """Raise for the invalid batch first in the buffer, its partition's turn come: the
        records of its partition before it were all handed out, so the position is at it.

        It moves to the back of the buffer and stays there (the partition is not fetched
        again): what other partitions have buffered behind it is handed out by the next
        polls, and the error is raised again when its turn comes round, at once when
        nothing else is buffered. So one bad partition neither stops the others (Kafka's
        consumer stops at a corrupt fetch until the application seeks) nor goes
        unreported while they flow; ``pause`` or ``seek`` on it ends the errors."""
        invalid = self._buffer.popleft()
        assert isinstance(invalid, _Invalid)
        self._buffer.append(invalid)
        raise CorruptBatchError(invalid.message)

    def _take_arrow(self, limit: int) -> Any:
        import pyarrow as pa  # noqa: PLC0415  # only for Arrow consumers

        pieces: list[Any] = []
        taken_total = 0
        while self._buffer and taken_total < limit:
            chunk = self._buffer[0]
            if isinstance(chunk, _Invalid):
                if pieces:
                    break  # these first; the next poll raises
                self._raise_invalid()
            table = chunk.arrow(pa)
            room = limit - taken_total
            if table.num_rows <= room:
                self._drop_first_chunk()
            else:
                chunk.records()  # decoded from now on: the rest is records[taken:]
                chunk.taken += room
                table = table.slice(0, room)
            pieces.append(table)
            taken_total += table.num_rows
            self._positions[chunk.tp] = table.column("offset")[-1].as_py() + 1
            self._position_epoch[chunk.tp] = chunk.batch.header.partition_leader_epoch
        self._metrics.add("records-consumed-total", taken_total)
        if not pieces:
            return _consumer_schema(pa).empty_table()
        return pa.concat_tables(pieces)

    def _fetch_request(
        self, offsets: dict[TopicPartition, int], wait_ms: int
    ) -> storage_pb2.FetchRequest:
        return storage_pb2.FetchRequest(
            replica_id=-1,
            max_wait_ms=wait_ms,
            min_bytes=self._min_bytes,
            max_bytes=self._max_bytes,
            partitions=[
                storage_pb2.FetchPartition(
                    topic=t,
                    partition=p,
                    fetch_offset=o,
                    max_bytes=self._partition_max_bytes,
                    last_fetched_epoch=self._fetched_epoch.get((t, p)),
                    topic_id=self._topic_ids.get(t, ""),
                )
                for (t, p), o in offsets.items()
            ],
        )

    def _send_fetches(self) -> None:
        """Start a long-poll Fetch for every leader group with partitions to fetch and no
        fetch in flight (module docstring)."""
        if self._buffered_bytes >= self._max_bytes:
            return
        busy = {tp for fetch in self._fetches.values() for tp in fetch.offsets}
        now = time.monotonic()
        paused = {g for g, until in self._paused_until.items() if until > now}
        if len(paused) < len(self._paused_until):
            self._paused_until = {g: self._paused_until[g] for g in paused}
        groups: dict[int, dict[TopicPartition, int]] = {}
        leaderless = False
        # Start one partition further each time (Kafka rotates too): with more leaders
        # than fetches in flight, a free place would otherwise always go to the leaders
        # first in the assignment and the last ones would never be read; and within a
        # fetch, partitions late in the list would get only what the early ones leave of
        # max_bytes.
        start = self._rotation % len(self._assignment) if self._assignment else 0
        self._rotation += 1
        for tp in self._assignment[start:] + self._assignment[:start]:
            leader = self._leaders.get(tp, -1)
            if self._directory is None:
                group = leader % MAX_FETCHES_IN_FLIGHT  # the gateway routes within a group
            elif leader >= 0:
                group = leader  # a direct fetch goes to exactly one broker
            else:
                leaderless = True
                continue
            if tp in self._paused_tps or tp in self._invalid:
                # Paused by the application (pause / resume), or stopped at an invalid
                # batch (fetching on would only find it again).
                continue
            position = self._positions.get(tp)
            if group in self._fetches or group in paused or position is None or tp in busy:
                continue  # it joins its group's next fetch
            if tp in self._drain_first:
                if self._next_fetch.get(tp, position) != position:
                    continue  # buffered records first; then the fetch at the position
                self._drain_first.discard(tp)
            if group not in groups and len(self._fetches) + len(groups) >= MAX_FETCHES_IN_FLIGHT:
                continue  # more leaders than fetches allowed: it waits for a free place
            groups.setdefault(group, {})[tp] = self._next_fetch.get(tp, position)
        if leaderless:
            self._retry_later()
        timeout_s = self._conn.timeout_s + self._max_wait_ms / 1000
        for group, offsets in groups.items():
            stub = self._fetch_stub(group)
            if stub is None:
                self._retry_later(group)
                continue
            future = stub.Fetch.future(
                self._fetch_request(offsets, self._max_wait_ms), timeout=timeout_s
            )
            fetch = _Fetch(group, offsets, future)
            self._fetches[group] = fetch
            # Runs on a gRPC thread (or here, if already done): only hands the fetch over.
            future.add_done_callback(lambda _, f=fetch: self._on_answer(f))

    def _on_answer(self, fetch: _Fetch) -> None:
        if tracing.ENABLED:
            asked = ",".join(f"{tp[1]}:{offset}" for tp, offset in fetch.offsets.items())
            tracing.event("k_recv", asked)
        self._answered.put(fetch)

    def _fetch_stub(self, group: int) -> Any:
        """Where a group's fetch goes: the gateway, or (direct mode) the group's leader;
        None when that broker's address is not known (it is not registered)."""
        if self._directory is None:
            return self._conn.stub
        address = self._directory.address(group)
        if address is None:
            return None
        stub: storage_pb2_grpc.StorageStub = self._directory.storage(address)
        return stub

    def _retry_later(self, group: int | None = None) -> None:
        """A leader moved or cannot be reached, or a partition has none: look leaders up
        again after a pause (counted from the first such failure, so failures that keep
        coming cannot put it off), and pause ``group``'s fetches rather than ask the
        same broker again at once. Other groups' fetches go on: one offline partition
        must not slow every leader's (Kafka backs off per node)."""
        now = time.monotonic()
        if not self._leaders_stale:
            self._leaders_stale = True
            self._refresh_after = now + RETRY_BACKOFF_S
        if group is not None:
            self._paused_until[group] = now + RETRY_BACKOFF_S

    def _decode_answered(self) -> None:
        while True:
            try:
                fetch = self._answered.get_nowait()
            except queue.Empty:
                return
            self._decode(fetch)

    def _decode(self, fetch: _Fetch) -> None:
        """Buffer what a fetch brought, if it is still the fetch in flight for its group
        (not cancelled by a seek or a new assignment)."""
        if self._fetches.get(fetch.group) is not fetch:
            return
        del self._fetches[fetch.group]
        try:
            response = fetch.future.result()
        except grpc.FutureCancelledError:
            return
        except grpc.RpcError as exc:
            error = error_from_rpc(exc, "fetch")
            if error.retriable:
                # The leader (direct) or the gateway is down, moved or busy: positions are
                # unchanged, so ask again after a pause, as Kafka's consumer does.
                self._retry_later(fetch.group)
                return
            raise error from None
        retry = False
        reset: list[TopicPartition] = []
        truncated: list[tuple[TopicPartition, int, int]] = []
        recreated: set[str] = set()
        fetched_bytes = fetched_records = 0
        for result in response.partitions:
            tp = (result.topic, result.partition)
            asked = fetch.offsets.get(tp)
            position = self._positions.get(tp)
            if asked is None or position is None or self._next_fetch.get(tp, position) != asked:
                continue  # not asked for, or no longer where this partition reads from
            if result.error.code != common_pb2.NONE:
                error = error_for_code(int(result.error.code), result.error.message)
                if error.code == ErrorCode.INCONSISTENT_TOPIC_ID:
                    recreated.add(tp[0])
                elif error.code == ErrorCode.OFFSET_OUT_OF_RANGE:
                    if asked == position:
                        reset.append(tp)
                    else:
                        # A read-ahead: the records before ``asked`` are buffered and
                        # still to be handed out (with "none", raising now would lose
                        # them; a reset would drop them).
                        self._drain_first.add(tp)
                elif error.retriable:
                    retry = True
                else:
                    raise error
                continue
            if result.diverging_end_offset >= 0:
                truncated.append((tp, result.diverging_epoch, result.diverging_end_offset))
                continue
            if not result.records:
                continue
            fetch_from = asked
            fetched_bytes += len(result.records)
            # One batch at a time: an invalid batch costs only itself and what follows it
            # in this partition, never the valid batches before it nor other partitions
            # (module docstring: invalid batches).
            batches, bad = decode_valid_batches(result.records)
            for batch in batches:
                if batch.next_offset > asked:
                    skip = max(0, asked - batch.base_offset)
                    self._buffer.append(_Chunk(tp, batch, skip))
                    self._buffered_bytes += batch.header.size_bytes
                    fetched_records += batch.record_count - skip
                    fetch_from = batch.next_offset
                    self._fetched_epoch[tp] = batch.header.partition_leader_epoch
            if bad is not None:
                _log.warning(
                    "%s-%d: invalid record batch at offset %d: %s",
                    tp[0],
                    tp[1],
                    fetch_from,
                    bad.reason,
                )
                self._buffer.append(_Invalid(tp, bad, fetch_from))
                self._invalid.add(tp)
            self._next_fetch[tp] = fetch_from
        if response.throttle_time_ms > 0 and not fetched_bytes:
            # An answer with records was worth having, whatever throttle another leader's
            # part of it (a gateway's fan-out) carried.
            self._paused_until[fetch.group] = time.monotonic() + response.throttle_time_ms / 1000
        self._metrics.add("fetch-total")
        self._metrics.record("fetch-size", fetched_bytes)
        self._metrics.record("records-per-request", fetched_records)
        if reset:
            self._reset_positions(reset)
        if retry:
            self._retry_later(fetch.group)
        for tp, epoch, end_offset in truncated:
            self._on_truncation(tp, epoch, end_offset)
        if recreated:
            for topic in recreated:
                self._topic_ids.pop(topic, None)  # learnt again with the leaders
            self._retry_later()
            self._on_recreated(sorted(recreated))

    def _on_truncation(self, tp: TopicPartition, epoch: int, end_offset: int) -> None:
        """The leader's log ends the last fetched batch's epoch at ``end_offset``, before
        the fetch's offset (module docstring: log truncation)."""
        position = self._positions[tp]
        known_epoch = self._fetched_epoch.get(tp)
        position_epoch = self._position_epoch.get(tp)
        self._drop_buffered({tp})  # what was fetched past the divergence is not in the log
        if position <= end_offset:
            # Only records not handed out yet diverged: fetch again from the position,
            # whose record's epoch still stands (a commit goes on naming it).
            if position_epoch is not None:
                self._position_epoch[tp] = position_epoch
            return
        if self._reset == "none":
            # Kafka's LogTruncationException. The check stays armed: the next poll raises
            # again until a seek moves the position.
            self._next_fetch[tp] = position
            if known_epoch is not None:
                self._fetched_epoch[tp] = known_epoch
            if position_epoch is not None:
                # Kept, so a commit made after catching this names it, and a consumer
                # restarted from that commit finds the truncation too (found by an audit).
                self._position_epoch[tp] = position_epoch
            raise OffsetOutOfRangeError(
                f"{tp[0]}-{tp[1]}: the log was truncated at offset {end_offset}, below the "
                f"position {position} (an unclean leader election): records "
                f"{end_offset}..{position - 1} were read from a log no replica has now; "
                "auto_offset_reset is 'none', so seek to go on"
            )
        _log.warning(
            "%s-%d: log truncated at %d below the position %d (epoch %d); reading on from %d",
            tp[0],
            tp[1],
            end_offset,
            position,
            epoch,
            end_offset,
        )
        # Kafka resets to the first offset known to diverge: what the new leader wrote
        # from there on is read, not skipped up to the old position.
        self._positions[tp] = end_offset
        self._next_fetch[tp] = end_offset
        self._fetched_epoch[tp] = epoch
        self._position_epoch[tp] = epoch

    def __iter__(self) -> Iterator[ConsumerRecord]:
        """Records forever (until ``close``), polling as needed.

        The position moves past a record as it is handed out, one record at a time (as
        kafka-python's iterator does), not past a whole poll's worth: a loop left with
        ``break`` or an exception, then ``close()`` or ``commit()``, commits only what
        the loop was given, and the next iteration or poll resumes with the record after
        it.

        The consumer is this thread's while the iterator works out a record, not while
        the loop body runs (class docstring): each ``next()`` is one call."""
        held = False  # this generator is inside _acquire (a GeneratorExit may come at yield)
        try:
            self._acquire()
            held = True
            if self._closed:
                # As every call on a closed consumer (it ended quietly: "nothing to read";
                # found by an audit). A close inside the loop body still ends it quietly.
                raise ConfigError("the consumer is closed")
            while not self._closed:
                self._wait_for_data(ITERATOR_POLL_TIMEOUT_MS)
                membership = self._membership
                while self._buffer and not (
                    # A rebalance: the next wait commits what was handed out and joins
                    # again at once, rather than after the whole buffer (the group waits
                    # for this member); records of partitions that may be another
                    # member's already are never handed out.
                    membership is not None and membership.needs_join()
                ):
                    self._raise_if_woken()  # between records: none is skipped or repeated
                    chunk = self._buffer[0]
                    if isinstance(chunk, _Invalid):
                        self._raise_invalid()
                    records = chunk.records()
                    record = records[chunk.taken]
                    chunk.taken += 1
                    if chunk.taken == len(records):
                        self._drop_first_chunk()
                    self._positions[chunk.tp] = record.offset + 1
                    self._position_epoch[chunk.tp] = chunk.batch.header.partition_leader_epoch
                    self._metrics.add("records-consumed-total", 1)
                    held = False
                    self._release()
                    yield record
                    self._acquire()
                    held = True
                    if self._closed:
                        return  # closed by the loop body: nothing more, not even a commit
                    if membership is not None:
                        membership.polled()  # a loop taking records is not stuck
                    self._maybe_auto_commit(time.monotonic() + ITERATOR_POLL_TIMEOUT_MS / 1000)
        finally:
            if held:
                self._release()

    # --- group offsets --------------------------------------------------------------------

    @_one_thread
    def commit(self, offsets: dict[TopicPartition, int] | None = None) -> None:
        """Commit ``offsets`` (the next offset to read per partition), by default the
        current positions of every assigned partition, retrying while the gateway cannot
        answer for up to ``default_api_timeout_ms`` (module docstring).

        A member of a group (``subscribe``) commits only in a generation, as Kafka's
        ConsumerCoordinator: ``RebalanceInProgressError`` while it joins (poll, then
        commit again), ``UnknownMemberIdError`` when its partitions may be another
        member's (``GroupMembership.generation_for_commit``). With nothing to commit it
        returns at once, as Kafka's commitSync does."""
        if self.group_id is None:
            raise ConfigError("commit needs a consumer with a group_id")
        self._raise_if_woken()
        if offsets is None:
            offsets = {tp: self._positions[tp] for tp in self._assignment if tp in self._positions}
        # Protobuf's TypeError or ValueError escaped (found by an audit); a negative
        # offset is the gateway's INVALID_REQUEST.
        offsets = {tp: _offset_int(o, f"{tp[0]}-{tp[1]}") for tp, o in offsets.items()}
        for (topic, partition), offset in offsets.items():
            if offset > INT64_MAX:
                raise ConfigError(f"offset {offset} for {topic}-{partition} is past {INT64_MAX}")
        self._commit(offsets, time.monotonic() + self._api_timeout_s, retrying=True)

    def _commit(
        self,
        offsets: dict[TopicPartition, int],
        deadline: float,
        *,
        retrying: bool,
        interruptible: bool = True,
    ) -> None:
        """Commit ``offsets`` by ``deadline`` (monotonic): sent again while the gateway
        cannot answer (``retrying``, ``_call_retrying``), or sent once.

        Only ``commit()`` is ``interruptible`` (Kafka's wakeup interrupts the
        application's blocking call): an internal commit (auto-commit, the commit
        before a revocation) leaves a pending ``wakeup()`` for the next check. It used
        to take it, and the auto-commit's error handling swallowed the WakeupError:
        the poll or the iterator never stopped, and the commit was skipped."""
        if not offsets:
            return
        member_id, generation = (
            # Read once, under the membership's lock, with what refuses the commit.
            self._membership.generation_for_commit() if self._membership is not None else ("", -1)
        )

        def epoch_of(tp: TopicPartition, offset: int) -> int:
            # Known only for the position itself (an offset given by the caller may be any).
            if self._positions.get(tp) != offset:
                return -1
            return self._position_epoch.get(tp, -1)

        # (commit() checked it; auto-commit is on only with a group_id.)
        assert self.group_id is not None
        request = gateway_pb2.CommitOffsetsRequest(
            group_id=self.group_id,
            member_id=member_id,
            generation_id=generation,
            group_instance_id=self._instance_id if member_id else "",
            offsets=[
                gateway_pb2.CommitOffset(
                    topic=t,
                    partition=p,
                    offset=o,
                    leader_epoch=epoch_of((t, p), o),
                    # The incarnation the position was read in: a commit made before this
                    # consumer noticed a re-creation is refused, not written into the new
                    # topic (the group would skip its records below the old position).
                    topic_id=self._topic_ids.get(t, ""),
                )
                for (t, p), o in sorted(offsets.items())
            ],
        )
        what = f"commit offsets of group {self.group_id!r}"
        response: gateway_pb2.CommitOffsetsResponse
        if retrying:
            response = self._call_retrying(
                self._conn.stub.CommitOffsets,
                request,
                what,
                deadline=deadline,
                interruptible=interruptible,
            )
        else:
            if interruptible:
                self._raise_if_woken()
            # One attempt. Given up on at its deadline, it cannot land later over a newer
            # commit: the gateway starts no write after the request's deadline.
            response = self._conn.call(
                self._conn.stub.CommitOffsets,
                request,
                what,
                timeout_s=max(0.001, min(self._conn.timeout_s, deadline - time.monotonic())),
            )
        for item in response.partitions:
            try:
                raise_for(item.error, f"commit {item.topic}-{item.partition}")
            except TidelogError as exc:
                if self._membership is not None:
                    self._membership.on_commit_error(exc)
                raise
        self._committed_positions.update(offsets)
        self._last_commit = time.monotonic()

    @_one_thread
    def committed(
        self, partitions: Iterable[TopicPartition] | None = None
    ) -> dict[TopicPartition, int]:
        """The group's committed offsets (-1 where none)."""
        entries = self._committed_entries(partitions)
        return {tp: offset for tp, (offset, _) in entries.items()}

    def _committed_entries(
        self, partitions: Iterable[TopicPartition] | None = None, deadline: float | None = None
    ) -> dict[TopicPartition, tuple[int, int]]:
        """The group's committed (offset, leader epoch) pairs ((-1, -1) where none), asked
        until ``deadline`` (``_call_retrying``'s)."""
        if self.group_id is None:
            raise ConfigError("committed needs a consumer with a group_id")
        tps = list(self._assignment if partitions is None else partitions)
        response: gateway_pb2.FetchOffsetsResponse = self._call_retrying(
            self._conn.stub.FetchOffsets,
            gateway_pb2.FetchOffsetsRequest(
                group_id=self.group_id,
                partitions=[common_pb2.TopicPartition(topic=t, partition=p) for t, p in tps],
            ),
            f"committed offsets of group {self.group_id!r}",
            deadline=deadline,
        )
        return {(o.topic, o.partition): (o.offset, o.leader_epoch) for o in response.offsets}

    def _committed_across_polls(
        self, missing: Sequence[TopicPartition], poll_deadline: float
    ) -> dict[TopicPartition, tuple[int, int]] | None:
        """The group's committed (offset, epoch) of ``missing``, or None while the ask is
        still on its way at ``poll_deadline`` (at least ``MIN_AUTO_COMMIT_TIMEOUT_MS``
        from now). The ask stays in flight for the next poll, as Kafka's consumer keeps
        its OffsetFetch: each poll used to send a new one and drop it at its deadline, so
        behind a round trip longer than the poll's timeout a member never got a position
        and read nothing, ever (found by an audit). Raises the ask's error."""
        assert self.group_id is not None
        wanted = frozenset(missing)
        member = self._membership.commit_identity() if self._membership else ("", -1)
        pending = self._pending_committed
        if pending is None or (pending.partitions, pending.member) != (wanted, member):
            if pending is not None:
                pending.future.cancel()  # another assignment's: its answer is of no use
            request = gateway_pb2.FetchOffsetsRequest(
                group_id=self.group_id,
                partitions=[common_pb2.TopicPartition(topic=t, partition=p) for t, p in wanted],
            )
            future = self._conn.stub.FetchOffsets.future(request, timeout=self._conn.timeout_s)
            pending = self._pending_committed = _PendingCommitted(wanted, member, future)
        wait_s = max(poll_deadline, time.monotonic() + MIN_AUTO_COMMIT_TIMEOUT_MS / 1000)
        try:
            response = pending.future.result(timeout=max(0.0, wait_s - time.monotonic()))
        except grpc.FutureTimeoutError:
            return None
        except grpc.RpcError as exc:
            self._pending_committed = None
            raise error_from_rpc(exc, f"committed offsets of group {self.group_id!r}") from None
        except grpc.FutureCancelledError:
            self._pending_committed = None
            return None
        self._pending_committed = None
        return {(o.topic, o.partition): (o.offset, o.leader_epoch) for o in response.offsets}

    def _drop_pending_committed(self) -> None:
        """Forget the committed offsets asked for and not yet answered: the assignment
        they were asked for changed (or the group was left), and taken later, an answer
        from before a commit put the consumer below it - records read again (found by an
        audit)."""
        pending, self._pending_committed = self._pending_committed, None
        if pending is not None:
            pending.future.cancel()

    def _call_retrying(
        self,
        method: Any,
        request: Any,
        what: str,
        *,
        deadline: float | None = None,
        interruptible: bool = True,
    ) -> Any:
        """A group call sent again while the gateway cannot answer it (unreachable,
        restarting, timed out: retriable errors), with a growing backoff, until
        ``deadline`` (monotonic; by default ``default_api_timeout_ms`` from now) has
        passed (Kafka's commitSync and committed). An answer is final, errors in it
        included. A commit gave up on after a timeout cannot land late over a newer one:
        the gateway starts no write after the request's deadline. It failed at the first
        refused connection: a gateway's rolling restart failed every manual commit made
        meanwhile (found by an audit). ``interruptible``: a ``wakeup()`` raises
        WakeupError before each attempt (not for internal commits, ``_commit``)."""
        if deadline is None:
            deadline = time.monotonic() + self._api_timeout_s
        backoff_s = RETRY_BACKOFF_S
        while True:
            if interruptible:
                self._raise_if_woken()
            remaining_s = deadline - time.monotonic()
            try:
                return self._conn.call(
                    method,
                    request,
                    what,
                    timeout_s=max(0.001, min(self._conn.timeout_s, remaining_s)),
                )
            except TidelogError as exc:
                if not exc.retriable or time.monotonic() + backoff_s >= deadline:
                    raise
                _log.info("%s failed (%s); retrying in %.1f s", what, exc, backoff_s)
            time.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, MAX_RETRY_BACKOFF_S)

    def _group_partitions_lost(self) -> bool:
        """The group may have given this member's partitions to another member (it was
        fenced, dropped, or left for max_poll_interval_ms): its positions must not be
        committed over the new owner's."""
        return self._membership is not None and self._membership.partitions_lost()

    def _maybe_auto_commit(self, poll_deadline: float | None = None) -> None:
        """Commit the positions (a group member's: those that changed), once
        ``auto_commit_interval_ms`` passed since the last commit. Never raises, nor takes
        a pending ``wakeup()``: a failure is logged and tried again an interval later
        (Kafka's auto-commit).

        From a poll or the iterator (``poll_deadline``, monotonic, when that wait ends):
        one attempt, bounded by the poll's remaining time (at least
        ``MIN_AUTO_COMMIT_TIMEOUT_MS``), as Kafka's auto-commit in poll is asynchronous
        and never holds the poll up. It used to retry for ``default_api_timeout_ms``
        while the gateway could not be reached, and, the failure not counting as a
        commit, again at every poll: poll(timeout_ms=500) blocked for a minute each time.
        Without one (before a revocation or a new assignment, on close): retried for
        ``default_api_timeout_ms``, as Kafka's commitSync there."""
        if not self._auto_commit or self._closed or self._group_partitions_lost():
            return
        now = time.monotonic()
        if now - self._last_commit < self._auto_commit_interval_s:
            return
        if self._membership is None:
            # Not a group member (assign): every position, changed or not, as Kafka's
            # auto-commit does. A group without members expires its offsets a retention
            # after its last commit, so a standalone consumer on an idle topic lost its
            # commit while it ran (found by an audit). A member's group keeps its offsets
            # while it has members: only what changed.
            changed = dict(self._positions)
        else:
            changed = {
                tp: o for tp, o in self._positions.items() if self._committed_positions.get(tp) != o
            }
        if changed:
            try:
                if poll_deadline is None:
                    self._commit(
                        changed, now + self._api_timeout_s, retrying=True, interruptible=False
                    )
                else:
                    deadline = max(poll_deadline, now + MIN_AUTO_COMMIT_TIMEOUT_MS / 1000)
                    self._commit(changed, deadline, retrying=False, interruptible=False)
            except TidelogError as exc:
                _log.warning(
                    "auto-commit of group %r failed (%s); trying again in %d ms",
                    self.group_id,
                    exc,
                    int(self._auto_commit_interval_s * 1000),
                )
        # After a failure too: the next attempt waits an interval, not the next poll.
        self._last_commit = time.monotonic()

    # --- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Commit the positions (auto-commit), give the group's partitions up (the
        revocation callback), leave the group and cancel every fetch in flight; once it
        returns nothing of the consumer runs. A second call does nothing.

        From the thread that polls (or a rebalance callback in it): a ``close()`` from
        another thread during a call raises ConfigError and closes nothing, as Kafka's
        ConcurrentModificationException; stop the poll with ``wakeup()`` instead, then
        close in its thread. In a child made by ``os.fork()``: marks this copy closed and
        returns, touching nothing of the parent's (no LeaveGroup: the member is the
        parent's)."""
        if self._pid != current_pid():
            self._closed = True  # (no lock: a parent's thread may have held it at the fork)
            return
        self._acquire()
        try:
            if self._closed or self._closing:
                return  # (a callback of this close closing again)
            self._closing = True
            try:
                self._commit_before_reassigning()
                self._revoke_group_partitions(committed=True)
            finally:
                try:
                    with contextlib.suppress(TidelogError):
                        self._leave_group()
                finally:
                    self._closed = True
                    self._drop_fetched()
        finally:
            self._release()

    def _drop_fetched(self) -> None:
        """Cancel the fetches in flight and forget every answer and buffered record: a
        cancelled fetch's callback only queues it, to a queue nothing reads any more."""
        fetches = list(self._fetches.values())
        self._fetches.clear()
        for fetch in fetches:
            fetch.future.cancel()  # done when it returns: cancelled, or answered before
        self._buffer.clear()
        self._buffered_bytes = 0
        with contextlib.suppress(queue.Empty):
            while True:
                self._answered.get_nowait()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
