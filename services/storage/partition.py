"""One partition replica on this broker: its Log, its role, its high watermark, its waiters.

Layering (DESIGN §7): ``Log`` knows bytes and offsets; ``Partition`` adds what a replica
needs on top - who leads, at which leader epoch, what is committed (the high watermark) -
and the locking that makes the single-threaded Log usable from gRPC's thread pool. It
speaks plain Python (no protobuf); ``services.storage.server`` translates.

For now every leader is a single-replica leader: the ISR is taken to be ``{self}``, so the
high watermark is the log end offset after every append. The replication issue replaces
``_advance_high_watermark`` with "min LEO over the ISR" and adds follower state here.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from services.storage.log import Log
from tidelog.clock import SYSTEM_CLOCK, Clock
from tidelog.errors import (
    FencedLeaderEpochError,
    InvalidRequestError,
    InvalidTimestampError,
    NotLeaderOrFollowerError,
    OffsetOutOfRangeError,
    StorageError,
    TidelogError,
    UnknownLeaderEpochError,
    UnknownTopicOrPartitionError,
)

NO_EPOCH = -1
"""A leader epoch of -1 on a request means "do not check"; on a partition, "never led"."""

CONSUMER_REPLICA_ID = -1
"""The replica id of ordinary consumers: they read only below the high watermark."""


class Role(enum.Enum):
    """What this broker does for the partition."""

    NONE = "none"  # hosted on disk, but no LeaderAndIsr yet (e.g. just after a restart)
    LEADER = "leader"
    FOLLOWER = "follower"


class OffsetSpec(enum.IntEnum):
    """Which offset ``list_offset`` resolves; numbers match ``tidelog.v1.OffsetSpec``."""

    EARLIEST = 1
    LATEST = 2
    BY_TIMESTAMP = 3
    MAX_TIMESTAMP = 4


@dataclass(frozen=True, slots=True)
class PartitionState:
    """The controller's decision about one partition (LeaderAndIsr), as plain data."""

    topic: str
    partition: int
    leader: int  # broker id, -1 for none
    leader_epoch: int
    isr: tuple[int, ...]
    replicas: tuple[int, ...]
    partition_epoch: int
    configs: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AppendResult:
    base_offset: int
    last_offset: int
    log_append_time_ms: int
    log_start_offset: int
    high_watermark: int


@dataclass(frozen=True, slots=True)
class ReadResult:
    records: bytes  # whole batches; b"" when nothing is visible at the fetch offset
    high_watermark: int
    log_start_offset: int
    log_end_offset: int
    leader_epoch: int


@dataclass(frozen=True, slots=True)
class OffsetAndTimestamp:
    offset: int  # -1 when nothing matches
    timestamp_ms: int  # -1 when not known


@dataclass(frozen=True, slots=True)
class PartitionInfo:
    """A consistent snapshot of one partition, for DescribeLogDirs and logs."""

    topic: str
    partition: int
    role: Role
    leader: int
    leader_epoch: int
    size_bytes: int
    log_start_offset: int
    log_end_offset: int
    high_watermark: int
    recovery_point: int
    segment_count: int


class Partition:
    """A partition replica hosted by this broker.

    Invariants:

    * ``log_start_offset <= high_watermark <= log_end_offset`` at every lock release;
    * the high watermark never moves backwards while this broker stays leader;
    * only a LEADER appends, and every batch it appends carries its ``leader_epoch``;
    * once closed (deleted, or the broker is shutting down), the Log is never touched again
      through this object and every call fails with ``closed_error``.

    Thread-safety: every public method may be called from any thread. One lock per
    partition serializes all use of the (single-threaded) Log and all state changes;
    ``locked()`` hands it to the broker's maintenance pass (flush, retention, checkpoints)
    so that pass never races an append. Waiters (``watch``) are events set, under the same
    lock, whenever the partition changes in a way a long-polling fetch cares about: new
    data, a moved high watermark, a role change, or closing. Lock order: the replica
    manager's lock before any partition lock; never two partition locks at once.
    """

    def __init__(
        self, topic: str, partition: int, log: Log, *, broker_id: int, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.broker_id = broker_id
        self._log = log
        self._clock = clock
        self._lock = threading.Lock()
        self._role = Role.NONE
        self._leader = -1
        self._leader_epoch = NO_EPOCH
        self._partition_epoch = -1
        self._isr: tuple[int, ...] = ()
        self._replicas: tuple[int, ...] = ()
        self._high_watermark = log.log_start_offset
        self._closed_error: TidelogError | None = None
        self._watchers: set[threading.Event] = set()

    def __repr__(self) -> str:
        return (
            f"Partition({self.topic}-{self.partition}, {self._role.value}, "
            f"epoch={self._leader_epoch})"
        )

    # --- role changes (from LeaderAndIsr / StopReplica) ---------------------------------

    @property
    def leader_epoch(self) -> int:
        return self._leader_epoch

    @property
    def role(self) -> Role:
        return self._role

    def apply_state(self, state: PartitionState) -> bool:
        """Become leader or follower as ``state`` says. Returns True if anything changed.

        An older leader epoch than the current one is refused (FENCED_LEADER_EPOCH): a
        delayed request from a deposed controller must not undo a newer decision. The same
        epoch is accepted and updates ISR/replicas (a controller may resend a request).
        """
        with self._lock:
            self._check_open()
            if state.leader_epoch < self._leader_epoch:
                raise FencedLeaderEpochError(
                    f"{self.topic}-{self.partition}: leader epoch {state.leader_epoch} is older "
                    f"than the current {self._leader_epoch}"
                )
            if state.leader == self.broker_id:
                role = Role.LEADER
            elif state.leader >= 0:
                role = Role.FOLLOWER
            else:  # no leader at all (every replica offline): serve nothing
                role = Role.NONE
            changed = (
                role is not self._role
                or state.leader != self._leader
                or state.leader_epoch != self._leader_epoch
            )
            self._role = role
            self._leader = state.leader
            self._leader_epoch = state.leader_epoch
            self._partition_epoch = state.partition_epoch
            self._isr = tuple(state.isr)
            self._replicas = tuple(state.replicas)
            if role is Role.LEADER:
                self._advance_high_watermark()
            self._wake_watchers()
            return changed

    def make_offline(self) -> None:
        """Stop serving (StopReplica without deletion); the log stays on disk."""
        with self._lock:
            self._check_open()
            self._role = Role.NONE
            self._leader = -1
            self._wake_watchers()

    def close(self, error: TidelogError) -> Log:
        """Stop using the Log for good; later calls raise ``error``. Returns the Log.

        Idempotent. The caller (the replica manager) deletes or closes the returned Log.
        """
        with self._lock:
            if self._closed_error is None:
                self._closed_error = error
                self._role = Role.NONE
                self._wake_watchers()
            return self._log

    @contextmanager
    def locked(self) -> Iterator[Log | None]:
        """Hold this partition's lock; yields its Log, or None once closed."""
        with self._lock:
            yield self._log if self._closed_error is None else None

    # --- data path ----------------------------------------------------------------------

    def append(self, records: bytes, current_leader_epoch: int = NO_EPOCH) -> AppendResult:
        """Append producer batches (validated and stamped by the Log) as the leader.

        Raises NotLeaderOrFollowerError unless leading, Fenced/UnknownLeaderEpochError on
        an epoch mismatch, and whatever the Log raises for bad batches (nothing is written
        then). ``records`` may hold several concatenated batches.
        """
        if not records:
            raise InvalidRequestError("the request carries no record batches")
        with self._lock:
            self._check_leader(current_leader_epoch)
            append_time_ms = self._clock.now_ms()
            try:
                info = self._log.append(records, leader_epoch=self._leader_epoch)
            except OSError as exc:
                raise StorageError(f"{self.topic}-{self.partition}: append failed: {exc}") from exc
            self._advance_high_watermark()
            self._wake_watchers()
            return AppendResult(
                base_offset=info.first_offset,
                last_offset=info.last_offset,
                log_append_time_ms=append_time_ms,
                log_start_offset=self._log.log_start_offset,
                high_watermark=self._high_watermark,
            )

    def read(
        self,
        fetch_offset: int,
        max_bytes: int,
        *,
        replica_id: int = CONSUMER_REPLICA_ID,
        current_leader_epoch: int = NO_EPOCH,
    ) -> ReadResult:
        """Whole batches from ``fetch_offset``, at most about ``max_bytes`` (at least one).

        Consumers (``replica_id`` < 0) see only offsets below the high watermark; follower
        replicas read up to the log end offset. Raises OffsetOutOfRangeError when
        ``fetch_offset`` is below the log start or above the log end offset.
        ``max_bytes=0`` reads no data, only the offsets (a fetch whose byte budget other
        partitions used up still reports this partition's high watermark).
        """
        with self._lock:
            self._check_leader(current_leader_epoch)
            max_offset = self._high_watermark if replica_id < 0 else None
            if max_bytes == 0:
                if not self._log.log_start_offset <= fetch_offset <= self._log.log_end_offset:
                    raise OffsetOutOfRangeError(
                        f"offset {fetch_offset} is outside the log's range "
                        f"[{self._log.log_start_offset}, {self._log.log_end_offset}]"
                    )
                data = b""
            else:
                try:
                    data = self._log.read(fetch_offset, max_bytes, max_offset=max_offset)
                except OSError as exc:
                    raise StorageError(
                        f"{self.topic}-{self.partition}: read failed: {exc}"
                    ) from exc
            return ReadResult(
                records=data,
                high_watermark=self._high_watermark,
                log_start_offset=self._log.log_start_offset,
                log_end_offset=self._log.log_end_offset,
                leader_epoch=self._leader_epoch,
            )

    def list_offset(
        self,
        spec: OffsetSpec,
        timestamp_ms: int = -1,
        *,
        replica_id: int = CONSUMER_REPLICA_ID,
        current_leader_epoch: int = NO_EPOCH,
    ) -> OffsetAndTimestamp:
        """Resolve an offset spec as the leader; consumers never get an offset >= HW."""
        with self._lock:
            self._check_leader(current_leader_epoch)
            visible_end = self._high_watermark if replica_id < 0 else self._log.log_end_offset
            if spec is OffsetSpec.EARLIEST:
                return OffsetAndTimestamp(self._log.log_start_offset, -1)
            if spec is OffsetSpec.LATEST:
                return OffsetAndTimestamp(visible_end, -1)
            if spec is OffsetSpec.BY_TIMESTAMP:
                if timestamp_ms < 0:
                    raise InvalidTimestampError(
                        f"timestamp_ms {timestamp_ms} is negative; use EARLIEST or LATEST"
                    )
                found = self._log.offset_for_timestamp(timestamp_ms, max_offset=visible_end)
                if found is None:
                    return OffsetAndTimestamp(-1, -1)
                return OffsetAndTimestamp(found[0], found[1])
            if spec is OffsetSpec.MAX_TIMESTAMP:
                best = self._log.max_timestamp()
                # The record with the largest timestamp may not be committed yet; consumers
                # must not learn of offsets they cannot read.
                if best is None or best[1] >= visible_end:
                    return OffsetAndTimestamp(-1, -1)
                return OffsetAndTimestamp(best[1], best[0])
            raise InvalidRequestError(f"unknown offset spec {spec!r}")

    def info(self) -> PartitionInfo:
        """A consistent snapshot of sizes, offsets and role."""
        with self._lock:
            self._check_open()
            return PartitionInfo(
                topic=self.topic,
                partition=self.partition,
                role=self._role,
                leader=self._leader,
                leader_epoch=self._leader_epoch,
                size_bytes=self._log.size_bytes,
                log_start_offset=self._log.log_start_offset,
                log_end_offset=self._log.log_end_offset,
                high_watermark=self._high_watermark,
                recovery_point=self._log.recovery_point,
                segment_count=self._log.segment_count,
            )

    # --- long-poll support --------------------------------------------------------------

    def watch(self, waiter: threading.Event) -> None:
        """Set ``waiter`` on every change of this partition (data, HW, role, close).

        Register *before* checking for data, then wait: a change between the check and
        the wait has already set the event, so no wake-up is lost. Stays registered until
        ``unwatch``; the waiter clears the event itself before each re-check.
        """
        with self._lock:
            if self._closed_error is not None:
                waiter.set()
                return
            self._watchers.add(waiter)

    def unwatch(self, waiter: threading.Event) -> None:
        with self._lock:
            self._watchers.discard(waiter)

    # --- internals (call with the lock held) --------------------------------------------

    def _wake_watchers(self) -> None:
        # Waiters stay registered until their fetch ends (``unwatch`` in a finally), so the
        # set holds at most the fetches currently waiting on this partition - a number the
        # server bounds.
        for waiter in self._watchers:
            waiter.set()

    def _advance_high_watermark(self) -> None:
        # Single-replica leader: ISR = {self}, so everything appended is committed. Kept
        # monotone so a later "min LEO over ISR" rule can slot in without other changes.
        self._high_watermark = max(self._high_watermark, self._log.log_end_offset)

    def _check_open(self) -> None:
        if self._closed_error is not None:
            raise type(self._closed_error)(self._closed_error.message)

    def _check_leader(self, current_leader_epoch: int) -> None:
        self._check_open()
        if current_leader_epoch != NO_EPOCH:
            if current_leader_epoch < self._leader_epoch:
                raise FencedLeaderEpochError(
                    f"{self.topic}-{self.partition}: request epoch {current_leader_epoch} is "
                    f"older than the leader epoch {self._leader_epoch}"
                )
            if current_leader_epoch > self._leader_epoch:
                raise UnknownLeaderEpochError(
                    f"{self.topic}-{self.partition}: request epoch {current_leader_epoch} is "
                    f"newer than this broker knows ({self._leader_epoch})"
                )
        if self._role is not Role.LEADER:
            leader = f"broker {self._leader}" if self._leader >= 0 else "unknown"
            raise NotLeaderOrFollowerError(
                f"broker {self.broker_id} is not the leader of {self.topic}-{self.partition} "
                f"(leader: {leader})"
            )


def deleted_error(topic: str, partition: int) -> UnknownTopicOrPartitionError:
    """What calls on a partition that was deleted while they ran get."""
    return UnknownTopicOrPartitionError(f"partition {topic}-{partition} was deleted")
