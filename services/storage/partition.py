"""One partition replica on this broker: its Log, its role, its high watermark, its waiters.

Layering (DESIGN §7): ``Log`` knows bytes and offsets; ``Partition`` adds what a replica
needs on top - who leads, at which leader epoch, what is committed (the high watermark) -
and the locking that makes the single-threaded Log usable from gRPC's thread pool. It
speaks plain Python (no protobuf); ``services.storage.server`` translates.

As leader a partition owns a ``LeaderReplicationState`` (the pure follower-progress / HW /
ISR core): the high watermark is the smallest log end offset over the (maximal) ISR.
Appends with acks=all wait in a per-partition purgatory (``AckWaiter``s in a heap keyed
by the offset the high watermark must reach), completed under the partition lock by
whatever moves the high watermark, failed by ISR shrinks below ``min.insync.replicas``,
role changes and closing. As follower it takes replicated batches from the replica
fetcher and keeps HW = min(leader HW, own LEO).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from services.storage.log import Log
from services.storage.replica_rules import (
    ack_is_due,
    clamp_high_watermark,
    fetch_divergence,
    follower_high_watermark,
    has_min_insync_replicas,
    leader_and_isr_supersedes,
)
from services.storage.replication import IsrProposal, LeaderReplicationState
from tidelog import tracing
from tidelog.clock import SYSTEM_CLOCK, Clock
from tidelog.errors import (
    FencedLeaderEpochError,
    InconsistentTopicIdError,
    InvalidRequestError,
    InvalidTimestampError,
    NotEnoughReplicasAfterAppendError,
    NotEnoughReplicasError,
    NotLeaderOrFollowerError,
    OffsetNotAvailableError,
    OffsetOutOfRangeError,
    RequestTimedOutError,
    StorageError,
    TidelogError,
    UnknownLeaderEpochError,
    UnknownTopicOrPartitionError,
)

NO_EPOCH = -1
"""A leader epoch of -1 on a request means "do not check"; on a partition, "never led"."""

CONSUMER_REPLICA_ID = -1
"""The replica id of ordinary consumers: they read only below the high watermark."""


DEFAULT_MIN_INSYNC_REPLICAS = 1
DEFAULT_REPLICA_LAG_TIME_MAX_MS = 30_000


def _int_config(configs: dict[str, str], name: str, default: int) -> int:
    try:
        return int(configs.get(name, default))
    except ValueError:
        return default


class Watcher(Protocol):
    """What ``Partition.watch`` wakes on a change: a ``threading.Event``, or anything whose
    ``set`` is as cheap and never blocks (it runs under the partition lock)."""

    def set(self) -> None: ...


class AckWaiter:
    """One acks=all append waiting for the high watermark to reach ``required_offset``.

    Completed exactly once, under the partition lock: ``error`` None means committed.
    The waiting gRPC handler thread blocks on ``done``; no other thread is involved.
    """

    __slots__ = ("done", "error", "required_offset")

    def __init__(self, required_offset: int) -> None:
        self.required_offset = required_offset
        self.done = threading.Event()
        self.error: TidelogError | None = None

    def complete(self, error: TidelogError | None) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


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
    topic_id: str = ""  # the topic incarnation's UUID ("" when the sender named none)


@dataclass(frozen=True, slots=True)
class AppendResult:
    base_offset: int
    last_offset: int
    log_append_time_ms: int
    log_start_offset: int
    high_watermark: int
    duplicate: bool = False
    # acks=all: completed once the HW passes last_offset (None when already committed).
    waiter: AckWaiter | None = None


@dataclass(frozen=True, slots=True)
class ReadResult:
    records: bytes  # whole batches; b"" when nothing is visible at the fetch offset
    high_watermark: int
    log_start_offset: int
    log_end_offset: int
    leader_epoch: int
    # KIP-320: the follower's last fetched epoch does not match this log; it should
    # truncate to (diverging_epoch, diverging_end_offset). -1 when no divergence.
    diverging_epoch: int = -1
    diverging_end_offset: int = -1
    # Set by the server when a fetch response's byte budget left this read's data out
    # (for the next fetch): data is there, and waiting cannot make room for it.
    left_out: bool = False


@dataclass(frozen=True, slots=True)
class OffsetAndTimestamp:
    offset: int  # -1 when nothing matches
    timestamp_ms: int  # -1 when not known
    # The epoch a consumer positioned here holds (Kafka's ListOffsets leaderEpoch): of the
    # found record, or, at the high watermark, of the last record before it. A consumer
    # checks it against the leader after a failover (KIP-320); -1 when unknown.
    leader_epoch: int = -1


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
    lock, whenever the partition changes in a way their long-polling fetch cares about
    (Kafka's DelayedFetch rules): a follower's fetch reads up to the log end, so new data
    wakes it; a consumer's reads below the high watermark, so a moved HW wakes it; a role
    change or closing wakes both. Lock order: the replica manager's lock before any
    partition lock; never two partition locks at once.
    """

    def __init__(
        self, topic: str, partition: int, log: Log, *, broker_id: int, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.broker_id = broker_id
        # The topic incarnation this partition belongs to, from LeaderAndIsr ("": not
        # told yet). Appends that name another are refused (check_topic_id).
        self.topic_id = ""
        # Whether the log runs its topic's settings (a LeaderAndIsr brought them), not just
        # the broker's defaults it was loaded with: retention waits for them.
        self.config_known = False
        self._log = log
        self._clock = clock
        self._lock = threading.Lock()
        self._role = Role.NONE
        self._leader = -1
        self._leader_epoch = NO_EPOCH
        # No ISR or replica list here: only a leader acts on them, and its
        # LeaderReplicationState holds them, guarded by the partition epoch (a follower's
        # copy would only be overwritten by a late LeaderAndIsr and never read).
        self._high_watermark = log.log_start_offset
        self._closed_error: TidelogError | None = None
        # Long-polling fetches: followers' (woken by new data) and consumers' (by the HW).
        self._log_end_watchers: set[Watcher] = set()
        self._high_watermark_watchers: set[Watcher] = set()
        # How many times each kind of watcher has been woken (``changes``): a fetch notes
        # the count before its read and hands it to ``watch``, which tells it whether
        # anything changed in between, instead of the fetch reading every partition again.
        self._log_end_changes = 0
        self._high_watermark_changes = 0
        self._configs: dict[str, str] = {}
        self._replica_lag_time_max_ms = DEFAULT_REPLICA_LAG_TIME_MAX_MS
        # Leader only: follower progress, HW and ISR decisions (pure, see replication.py).
        self._replication: LeaderReplicationState | None = None
        # acks=all purgatory: (required offset, sequence, waiter), smallest offset first.
        # A withdrawn waiter stays in it, done, until the HW passes it or withdrawals reach
        # half the heap (then it is rebuilt): removing each at once cost O(waiters), and a
        # stream's thousands of appends withdrawn together held the lock for O(n^2).
        self._ack_waiters: list[tuple[int, int, AckWaiter]] = []
        self._ack_withdrawn = 0  # withdrawals since the heap was last rebuilt
        self._ack_sequence = itertools.count()

    def restore_high_watermark(self, high_watermark: int) -> None:
        """Startup: the checkpointed HW (replication-offset-checkpoint), clamped to the log."""
        with self._lock:
            self._high_watermark = max(
                self._log.log_start_offset, min(high_watermark, self._log.log_end_offset)
            )

    @property
    def high_watermark(self) -> int:
        return self._high_watermark

    @property
    def leader(self) -> int:
        return self._leader

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

    def check_topic_id(self, topic_id: str) -> None:
        """Refuse a request meant for another incarnation of this topic: deleted and
        created again since the sender learned its id (KIP-516's topic ids). Without it
        a producer's retry of a batch queued before the deletion landed in the new topic.
        An empty id on either side (an older sender; not told yet) checks nothing."""
        if topic_id and self.topic_id and topic_id != self.topic_id:
            raise InconsistentTopicIdError(
                f"{self.topic}-{self.partition}: the request is for topic id {topic_id}, but "
                f"the topic was deleted and created again (now {self.topic_id})"
            )

    def apply_state(
        self, state: PartitionState, configure: Callable[[], None] | None = None
    ) -> bool:
        """Become leader or follower as ``state`` says. Returns True if anything changed.

        An older leader epoch than the current one is refused (FENCED_LEADER_EPOCH): a
        delayed request from a deposed controller must not undo a newer decision. The same
        epoch is accepted and updates ISR/replicas (a controller may resend a request).

        ``configure`` applies the topic's configuration to the log: called under this
        partition's lock once the request is known not to be stale, before the role
        changes. Applied after it (the lock released in between), a log loaded at start-up
        led for a moment with the broker's defaults: appends in that gap were validated
        and stamped without the topic's max.message.bytes, timestamp type or flush
        settings (found by an audit).
        """
        with self._lock:
            self._check_open()
            if state.leader_epoch < self._leader_epoch:
                raise FencedLeaderEpochError(
                    f"{self.topic}-{self.partition}: leader epoch {state.leader_epoch} is older "
                    f"than the current {self._leader_epoch}"
                )
            if configure is not None:
                configure()
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
            self._configs = dict(state.configs)
            # Parsed once: the ISR pass asks for it four times a second per partition.
            self._replica_lag_time_max_ms = _int_config(
                self._configs, "replica.lag.time.max.ms", DEFAULT_REPLICA_LAG_TIME_MAX_MS
            )
            if state.topic_id:
                self.topic_id = state.topic_id
            if role is Role.LEADER:
                if changed or self._replication is None:
                    # Every time it becomes leader (Kafka's maybeAssignEpochStartOffset):
                    # OffsetForLeaderEpoch for the previous epoch then ends here.
                    self._log.assign_epoch_start_offset(state.leader_epoch)
                    self._fail_ack_waiters(self._not_leader_error())
                    self._replication = LeaderReplicationState(
                        local_broker_id=self.broker_id,
                        # An ISR member missing from replicas (a reassignment in flight)
                        # is still tracked, so the HW rule can always find its LEO.
                        replicas=tuple(
                            dict.fromkeys((*state.replicas, *state.isr, self.broker_id))
                        ),
                        isr=state.isr or (self.broker_id,),
                        leader_epoch=state.leader_epoch,
                        partition_epoch=state.partition_epoch,
                        high_watermark=self._high_watermark,
                        log_end_offset=self._log.log_end_offset,
                        leader_epoch_start_offset=self._log.log_end_offset,
                        now_ms=self._clock.now_ms(),
                    )
                elif leader_and_isr_supersedes(
                    state.partition_epoch, self._replication.partition_epoch
                ):
                    self._replication.on_isr_committed(state.isr, state.partition_epoch)
                self._check_min_isr_for_waiters()
                self._advance_high_watermark()
            else:
                self._replication = None
                self._fail_ack_waiters(self._not_leader_error())
                if role is Role.FOLLOWER:
                    self._high_watermark = clamp_high_watermark(
                        self._high_watermark, self._log.log_end_offset
                    )
            self._wake_watchers()
            return changed

    def make_offline(self) -> None:
        """Stop serving (StopReplica without deletion); the log stays on disk."""
        with self._lock:
            self._check_open()
            self._role = Role.NONE
            self._leader = -1
            self._replication = None
            self._fail_ack_waiters(self._not_leader_error())
            self._wake_watchers()

    def close(self, error: TidelogError) -> Log:
        """Stop using the Log for good; later calls raise ``error``. Returns the Log.

        Idempotent. The caller (the replica manager) deletes or closes the returned Log.
        """
        with self._lock:
            if self._closed_error is None:
                self._closed_error = error
                self._role = Role.NONE
                self._replication = None
                self._fail_ack_waiters(error)
                self._wake_watchers()
            return self._log

    def maintenance_due(self) -> bool:
        """``Log.maintenance_due`` of an open partition, read without the lock."""
        return self._closed_error is None and self._log.maintenance_due()

    @contextmanager
    def locked(self) -> Iterator[Log | None]:
        """Hold this partition's lock; yields its Log, or None once closed."""
        with self._lock:
            yield self._log if self._closed_error is None else None

    # --- data path ----------------------------------------------------------------------

    def append(
        self, records: bytes, current_leader_epoch: int = NO_EPOCH, *, acks_all: bool = False
    ) -> AppendResult:
        """Append producer batches (validated and stamped by the Log) as the leader.

        Raises NotLeaderOrFollowerError unless leading, Fenced/UnknownLeaderEpochError on
        an epoch mismatch, and whatever the Log raises for bad batches (nothing is written
        then). ``records`` may hold several concatenated batches.

        ``acks_all``: refused up front with NOT_ENOUGH_REPLICAS when the ISR is smaller
        than ``min.insync.replicas``; otherwise, unless already committed, the result
        carries a ``waiter`` the caller waits on (``wait_for_ack``). Duplicates of
        idempotent batches wait the same way for their original offsets.
        """
        if not records:
            raise InvalidRequestError("the request carries no record batches")
        with self._lock:
            self._check_leader(current_leader_epoch)
            if acks_all:
                self._check_min_isr(NotEnoughReplicasError)
            try:
                info = self._log.append(records, leader_epoch=self._leader_epoch)
            except OSError as exc:
                raise StorageError(f"{self.topic}-{self.partition}: append failed: {exc}") from exc
            if not info.duplicate:
                high_watermark = self._high_watermark
                self._advance_high_watermark()
                self._wake_watchers(high_watermark_moved=self._high_watermark > high_watermark)
            waiter = None
            if acks_all and not ack_is_due(self._high_watermark, info.last_offset + 1):
                waiter = AckWaiter(info.last_offset + 1)
                heapq.heappush(
                    self._ack_waiters, (waiter.required_offset, next(self._ack_sequence), waiter)
                )
            return AppendResult(
                base_offset=info.first_offset,
                last_offset=info.last_offset,
                log_append_time_ms=info.log_append_time_ms,
                log_start_offset=self._log.log_start_offset,
                high_watermark=self._high_watermark,
                duplicate=info.duplicate,
                waiter=waiter,
            )

    def wait_for_ack(self, waiter: AckWaiter, timeout_s: float) -> int:
        """Block until ``waiter`` completes; the HW then. Raises its error, or
        REQUEST_TIMED_OUT after ``timeout_s`` (the waiter is then withdrawn)."""
        if not waiter.done.wait(timeout_s):
            self.withdraw_ack(
                waiter,
                RequestTimedOutError(
                    f"{self.topic}-{self.partition}: offset {waiter.required_offset - 1} "
                    f"not replicated to the ISR within {timeout_s * 1000:.0f} ms"
                ),
            )
        if waiter.error is not None:
            raise waiter.error
        return self._high_watermark

    def withdraw_ack(self, waiter: AckWaiter, error: TidelogError) -> None:
        """Complete ``waiter`` with ``error`` unless it is done, and forget it: its time ran
        out, or its client went away (the thread waiting on it is then freed at once)."""
        with self._lock:
            if not waiter.done.is_set():
                waiter.complete(error)
                self._ack_withdrawn += 1
                if self._ack_withdrawn * 2 >= len(self._ack_waiters):
                    self._ack_waiters = [e for e in self._ack_waiters if not e[2].done.is_set()]
                    heapq.heapify(self._ack_waiters)
                    self._ack_withdrawn = 0

    def fail_ack_waiters(self, error: TidelogError) -> None:
        """Answer every acks=all append waiting here with ``error`` (the broker stops)."""
        with self._lock:
            self._fail_ack_waiters(error)

    # --- replication: leader side -------------------------------------------------------

    def offset_for_leader_epoch(
        self, leader_epoch: int, current_leader_epoch: int = NO_EPOCH
    ) -> tuple[int, int]:
        """As leader: ``(largest epoch <= leader_epoch, its end offset)`` (KIP-101/279)."""
        with self._lock:
            self._check_leader(current_leader_epoch)
            return self._log.end_offset_for_epoch(leader_epoch)

    def propose_isr_change(self, replica_lag_time_max_ms: int | None = None) -> IsrProposal | None:
        """As leader: the AlterPartition to send now, if any (at most one pending)."""
        if self._replication is None:
            # Not leading (read without the lock: a plain reference, replaced whole). The
            # ISR pass asks every partition four times a second; most are followers.
            return None
        with self._lock:
            if self._closed_error is not None or self._replication is None:
                return None
            lag_ms = replica_lag_time_max_ms
            if lag_ms is None:
                lag_ms = self._replica_lag_time_max_ms
            return self._replication.propose_isr_change(self._clock.now_ms(), lag_ms)

    def on_isr_result(
        self,
        proposal: IsrProposal,
        isr: tuple[int, ...] | None,
        partition_epoch: int,
        *,
        refused: bool = False,
    ) -> None:
        """The controller's answer to ``proposal``: the ISR in force and its partition
        epoch; ``refused`` when the controller answered with an error (nothing applied;
        ``partition_epoch`` is then that of its state, -1 when it sent none); ``isr``
        None otherwise when no answer came (the outcome is unknown)."""
        with self._lock:
            state = self._replication
            if state is None or state.pending is not proposal:
                return  # leadership changed meanwhile; LeaderAndIsr carries the truth
            if refused:
                state.on_isr_refused(partition_epoch)
            elif isr is None:
                state.on_isr_rejected()
            else:
                state.on_isr_committed(isr, partition_epoch)
            self._check_min_isr_for_waiters()
            self._advance_high_watermark()
            self._wake_watchers()

    # --- replication: follower side -----------------------------------------------------

    def follower_state(self, leader_epoch: int) -> tuple[int, int]:
        """As follower at ``leader_epoch``: ``(log end offset, latest epoch in the log)``."""
        with self._lock:
            self._check_follower(leader_epoch)
            return self._log.log_end_offset, self._log.latest_epoch

    def follower_end_offset_for_epoch(self, leader_epoch: int, epoch: int) -> tuple[int, int]:
        with self._lock:
            self._check_follower(leader_epoch)
            return self._log.end_offset_for_epoch(epoch)

    def follower_truncate(self, leader_epoch: int, offset: int) -> int:
        """Truncate to ``offset`` (never above the LEO); returns the new log end offset.

        Called even when no data goes (``offset`` at or past the LEO): ``Log.truncate_to``
        then still drops a leader epoch this replica assigned at its log end when it led
        without appending. Left in place, that epoch is sent as the last fetched epoch, the
        new leader (which never had it) answers "diverging" to every fetch, and the
        follower truncates to the same offset forever without replicating anything.
        """
        with self._lock:
            self._check_follower(leader_epoch)
            # Below the log start too, as Kafka's truncateTo: the log then restarts empty
            # at ``offset`` (``Log.truncate_to``). Held up at the log start, a follower
            # past an unclean leader's end kept its own history there, never got the
            # leader's records in between, and counted them committed (found by an
            # audit).
            self._log.truncate_to(min(offset, self._log.log_end_offset))
            self._high_watermark = clamp_high_watermark(
                self._high_watermark, self._log.log_end_offset
            )
            return self._log.log_end_offset

    def follower_start_at(self, leader_epoch: int, offset: int) -> None:
        """The leader's log now starts past ours (retention): drop everything, restart
        empty at ``offset`` (Kafka's truncateFullyAndStartAt). Only if we are behind it."""
        with self._lock:
            self._check_follower(leader_epoch)
            if self._log.log_end_offset < offset:
                self._log.truncate_fully_and_start_at(offset)
                self._high_watermark = offset

    def follower_append(
        self, leader_epoch: int, records: bytes, leader_high_watermark: int
    ) -> tuple[int, int]:
        """Append replicated batches (leader's offsets and epochs); returns what
        ``follower_state`` would now: the new LEO and the latest epoch in the log.

        Follower HW = min(leader HW, own LEO), never backwards.
        """
        with self._lock:
            self._check_follower(leader_epoch)
            if records:
                try:
                    self._log.append(records, assign_offsets=False)
                except OSError as exc:
                    raise StorageError(
                        f"{self.topic}-{self.partition}: replicated append failed: {exc}"
                    ) from exc
            self._high_watermark = follower_high_watermark(
                self._high_watermark, leader_high_watermark, self._log.log_end_offset
            )
            return self._log.log_end_offset, self._log.latest_epoch

    def read(
        self,
        fetch_offset: int,
        max_bytes: int,
        *,
        replica_id: int = CONSUMER_REPLICA_ID,
        current_leader_epoch: int = NO_EPOCH,
        last_fetched_epoch: int = NO_EPOCH,
        written_offset: int | None = None,
        broker_epoch: int = -1,
    ) -> ReadResult:
        """Whole batches from ``fetch_offset``, at most about ``max_bytes`` (at least one).
        ``broker_epoch``: the registration epoch a follower's fetch carries.

        A follower that names its ``last_fetched_epoch`` learns of a divergence (KIP-320):
        when that epoch ends here before ``fetch_offset`` (or is not in this log), the
        result carries no data and the epoch and end offset it should truncate to; its
        fetch offset then does not count as its LEO. A consumer naming it learns the same
        way that the records it read before ``fetch_offset`` are not in this log (an
        unclean election truncated them): its position must go back to that end offset.
        A follower's ``written_offset`` (pipelined fetches, ``fetcher.py``) counts as its
        LEO instead of ``fetch_offset``.

        Consumers (``replica_id`` < 0) see only offsets below the high watermark; follower
        replicas read up to the log end offset. Raises OffsetOutOfRangeError when
        ``fetch_offset`` is below the log start or above the log end offset.
        ``max_bytes=0`` reads no data, only the offsets (a fetch whose byte budget other
        partitions used up still reports this partition's high watermark).
        """
        with self._lock:
            self._check_leader(current_leader_epoch)
            if last_fetched_epoch > self._leader_epoch:
                # The fetcher read records of a later leader epoch than this leader's: a
                # successor exists that this broker has not heard of yet. Answered as a
                # divergence (the epoch is unknown here), a consumer routed by stale
                # metadata moved its position back and read records twice (found by an
                # audit); Kafka's current-leader-epoch check refuses such a fetch first.
                raise UnknownLeaderEpochError(
                    f"{self.topic}-{self.partition}: the fetcher holds records of leader "
                    f"epoch {last_fetched_epoch}, later than this leader's "
                    f"{self._leader_epoch}: a newer leader exists"
                )
            if last_fetched_epoch >= 0:
                diverging = fetch_divergence(
                    last_fetched_epoch=last_fetched_epoch,
                    fetch_offset=fetch_offset,
                    leader_end_offset_for=self._log.end_offset_for_epoch,
                )
                if diverging is not None:
                    epoch, end_offset = diverging
                    return ReadResult(
                        records=b"",
                        high_watermark=self._high_watermark,
                        log_start_offset=self._log.log_start_offset,
                        log_end_offset=self._log.log_end_offset,
                        leader_epoch=self._leader_epoch,
                        diverging_epoch=epoch,
                        diverging_end_offset=end_offset,
                    )
            if replica_id >= 0:
                # A pipelining follower has written only up to ``written_offset``: count
                # that, so the HW (and an acks=all answer) never runs ahead of its log.
                self._on_follower_fetch(replica_id, fetch_offset, written_offset, broker_epoch)
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

    def follower_fetched(
        self,
        fetch_offset: int,
        *,
        replica_id: int,
        current_leader_epoch: int,
        written_offset: int | None,
        broker_epoch: int,
    ) -> None:
        """A follower's fetch session (``fetch_session.py``) left this partition out: its
        position is still ``fetch_offset`` and nothing changed here since it was last
        read. Count the fetch as the follower's progress report, as ``read`` would, so an
        idle follower stays caught up; raises what ``read`` would for a changed role."""
        with self._lock:
            self._check_leader(current_leader_epoch)
            self._on_follower_fetch(replica_id, fetch_offset, written_offset, broker_epoch)

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
            log = self._log
            if spec is OffsetSpec.EARLIEST:
                start = log.log_start_offset
                return OffsetAndTimestamp(start, -1, log.epoch_for_offset(start))
            replication = self._replication
            if (
                replica_id < 0
                and replication is not None
                and self._high_watermark < replication.leader_epoch_start_offset
            ):
                # A new leader's HW can lag the old leader's until its followers fetch in
                # the new epoch: answering now could give a consumer an end below what it
                # was already told (Kafka's KIP-207). Retriable: ask again shortly.
                raise OffsetNotAvailableError(
                    f"{self.topic}-{self.partition}: the new leader's high watermark "
                    f"{self._high_watermark} is below its epoch's start "
                    f"{replication.leader_epoch_start_offset}; retry"
                )
            if spec is OffsetSpec.LATEST:
                last = max(visible_end - 1, log.log_start_offset)
                return OffsetAndTimestamp(visible_end, -1, log.epoch_for_offset(last))
            if spec is OffsetSpec.BY_TIMESTAMP:
                if timestamp_ms < 0:
                    raise InvalidTimestampError(
                        f"timestamp_ms {timestamp_ms} is negative; use EARLIEST or LATEST"
                    )
                found = self._log.offset_for_timestamp(timestamp_ms, max_offset=visible_end)
                if found is None:
                    return OffsetAndTimestamp(-1, -1)
                return OffsetAndTimestamp(found[0], found[1], log.epoch_for_offset(found[0]))
            if spec is OffsetSpec.MAX_TIMESTAMP:
                best = self._log.max_timestamp()
                # The record with the largest timestamp may not be committed yet; consumers
                # must not learn of offsets they cannot read.
                if best is None or best[1] >= visible_end:
                    return OffsetAndTimestamp(-1, -1)
                return OffsetAndTimestamp(best[1], best[0], log.epoch_for_offset(best[1]))
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

    def changes(self, *, replica: bool) -> int:
        """A count that grows with every change ``watch`` would wake a ``replica`` (or
        consumer) fetch for. Read without the lock: a plain int, only ever replaced."""
        return self._log_end_changes if replica else self._high_watermark_changes

    def watch(self, waiter: Watcher, *, replica: bool, since: int | None = None) -> None:
        """Set ``waiter`` on every change of this partition that a fetch may answer with:
        for a follower's fetch (``replica``) new data or a new log end, for a consumer's a
        moved high watermark, for both a role change or closing. Kafka completes a
        DelayedFetch by the same rules: a follower is not woken by a HW that moved under
        data it already has (it learns the HW with its next answer), nor a consumer by
        data it may not read yet - on an RF=3 partition each of those was a wasted wake-up
        per append (BENCHMARKS.md).

        Register *before* checking for data, then wait: a change between the check and
        the wait has already set the event, so no wake-up is lost. Or check first, noting
        ``changes`` before the check, and pass that count as ``since``: the waiter is set
        at once if anything changed after it, which is as good as checking again. Stays
        registered until ``unwatch``; the waiter clears the event itself before each
        re-check.
        """
        with self._lock:
            if self._closed_error is not None:
                waiter.set()
                return
            self._watchers_for(replica=replica).add(waiter)
            if since is not None and since != self.changes(replica=replica):
                waiter.set()

    def unwatch(self, waiter: Watcher, *, replica: bool) -> None:
        with self._lock:
            self._watchers_for(replica=replica).discard(waiter)

    # --- internals (call with the lock held) --------------------------------------------

    def _watchers_for(self, *, replica: bool) -> set[Watcher]:
        return self._log_end_watchers if replica else self._high_watermark_watchers

    def _wake_watchers(
        self, *, log_end_moved: bool = True, high_watermark_moved: bool = True
    ) -> None:
        """Wake the fetches a change concerns; with no arguments (a role change, closing,
        an ISR change) every one."""
        # Waiters stay registered until their fetch ends (``unwatch`` in a finally), so the
        # sets hold at most the fetches currently waiting on this partition - a number the
        # server bounds.
        if log_end_moved:
            self._log_end_changes += 1
            for waiter in self._log_end_watchers:
                waiter.set()
        if high_watermark_moved:
            self._high_watermark_changes += 1
            for waiter in self._high_watermark_watchers:
                waiter.set()

    def _on_follower_fetch(
        self, replica_id: int, fetch_offset: int, written_offset: int | None, broker_epoch: int
    ) -> None:
        state = self._replication
        if state is None or replica_id not in state.followers:
            raise NotLeaderOrFollowerError(
                f"broker {replica_id} is not a follower of {self.topic}-{self.partition}"
            )
        if not self._log.log_start_offset <= fetch_offset <= self._log.log_end_offset:
            return  # the read below raises OFFSET_OUT_OF_RANGE; not a valid LEO report
        now_ms = self._clock.now_ms()
        if state.on_follower_fetch(
            replica_id, fetch_offset, now_ms, broker_epoch, written_offset=written_offset
        ):
            self._advance_high_watermark()
            self._wake_watchers(log_end_moved=False)

    def _advance_high_watermark(self) -> None:
        # Leader: HW = min LEO over the maximal ISR (LeaderReplicationState), monotone.
        # Completes the acks=all waiters it passes.
        state = self._replication
        if state is None:
            return
        state.on_leader_append(self._log.log_end_offset, self._clock.now_ms())
        if tracing.ENABLED and state.high_watermark > self._high_watermark:
            tracing.event("hw", self.partition, state.high_watermark)
        self._high_watermark = max(self._high_watermark, state.high_watermark)
        if not self._ack_waiters or not ack_is_due(self._high_watermark, self._ack_waiters[0][0]):
            return
        # Kafka's rule: committed with an ISR below min.insync.replicas is not the
        # durability acks=all asked for (the HW may have moved *because* the ISR shrank).
        outcome: TidelogError | None = None
        if not has_min_insync_replicas(len(state.isr), self._min_insync_replicas()):
            outcome = NotEnoughReplicasAfterAppendError(
                f"{self.topic}-{self.partition}: ISR shrank to {len(state.isr)} replicas, "
                f"below min.insync.replicas {self._min_insync_replicas()}"
            )
        while self._ack_waiters and ack_is_due(self._high_watermark, self._ack_waiters[0][0]):
            waiter = heapq.heappop(self._ack_waiters)[2]
            if waiter.done.is_set():
                # Withdrawn earlier, left in the heap until now: no longer counted, or
                # the count would call for rebuilds of a heap without withdrawn waiters.
                self._ack_withdrawn = max(0, self._ack_withdrawn - 1)
            else:
                waiter.complete(outcome)

    def _min_insync_replicas(self) -> int:
        return _int_config(self._configs, "min.insync.replicas", DEFAULT_MIN_INSYNC_REPLICAS)

    def _check_min_isr(self, error: type[TidelogError]) -> None:
        state = self._replication
        isr_size = len(state.isr) if state is not None else 0
        minimum = self._min_insync_replicas()
        if not has_min_insync_replicas(isr_size, minimum):
            raise error(
                f"{self.topic}-{self.partition}: ISR has {isr_size} replicas, "
                f"min.insync.replicas is {minimum}"
            )

    def _check_min_isr_for_waiters(self) -> None:
        if not self._ack_waiters:
            return
        try:
            self._check_min_isr(NotEnoughReplicasAfterAppendError)
        except TidelogError as exc:
            self._fail_ack_waiters(exc)

    def _fail_ack_waiters(self, error: TidelogError) -> None:
        waiters, self._ack_waiters = self._ack_waiters, []
        self._ack_withdrawn = 0
        for _, _, waiter in waiters:
            waiter.complete(error)

    def _not_leader_error(self) -> NotLeaderOrFollowerError:
        return NotLeaderOrFollowerError(
            f"broker {self.broker_id} is no longer the leader of {self.topic}-{self.partition}"
        )

    def _check_follower(self, leader_epoch: int) -> None:
        self._check_open()
        if self._role is not Role.FOLLOWER or self._leader_epoch != leader_epoch:
            raise NotLeaderOrFollowerError(
                f"{self.topic}-{self.partition}: no longer a follower at epoch {leader_epoch}"
            )

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
