"""The Storage gRPC service: protobuf in, ``Partition`` calls, protobuf out.

Two classes:

* ``ReplicaManager`` - the partitions this broker hosts, over the ``LogManager`` that owns
  their files. It creates partitions for LeaderAndIsr, deletes them for StopReplica,
  deletes stray logs of deleted topic incarnations (``strays.py``), runs the periodic
  maintenance pass, and shuts everything down cleanly.
* ``StorageServicer`` - the adapter: validates requests, translates protobuf to plain
  values and back, maps errors to statuses (``services.status``), and implements the
  long-poll of Fetch.

The servicer does O(1) Python work per request and per partition, never per batch or per
record: batch bytes go to the Log (which checks them with checksums in C) and come back
untouched.

Limits: every request's partition count, each Fetch's bytes, each Fetch's wait, the number
of concurrently waiting fetches and of open append streams. The last two matter because
gRPC's synchronous server gives every in-progress call a pool thread; capping the calls
that may hold a thread for long keeps threads free for Append.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

import grpc
import structlog

from services.status import (
    NamedPartition,
    abort,
    partition_results,
    to_error_proto,
    unary_errors,
)
from services.storage.append_pipeline import AppendPipeline
from services.storage.fetch_session import (
    FINAL_EPOCH,
    INITIAL_EPOCH,
    FetchSession,
    FetchSessionCache,
    Key,
    worth_answering,
)
from services.storage.fetcher import AddressResolver, ReplicaFetcherManager
from services.storage.log import LogConfig
from services.storage.log.partition_metadata import valid_topic_id
from services.storage.log_manager import LogManager
from services.storage.partition import (
    NO_EPOCH,
    AckWaiter,
    AppendResult,
    OffsetSpec,
    Partition,
    PartitionInfo,
    PartitionState,
    ReadResult,
    Role,
    deleted_error,
)
from services.storage.replication import IsrProposal
from services.storage.strays import (
    TopicIdVerdict,
    leader_and_isr_verdict,
    stop_replica_deletes,
    strays_in_view,
)
from tidelog import tracing
from tidelog.addresses import format_host_port
from tidelog.batch import next_offset_after
from tidelog.clock import SYSTEM_CLOCK, Clock
from tidelog.errors import (
    BrokerNotAvailableError,
    FencedLeaderEpochError,
    InconsistentTopicIdError,
    InvalidFetchSessionEpochError,
    InvalidFetchSizeError,
    InvalidRequestError,
    InvalidRequiredAcksError,
    NotLeaderOrFollowerError,
    RequestTimedOutError,
    StaleBrokerEpochError,
    StaleControllerEpochError,
    StorageError,
    TidelogError,
    UnknownServerError,
    UnknownTopicOrPartitionError,
)
from tidelog.topics import validate_partition, validate_topic_name
from tidelog.v1 import common_pb2, storage_pb2, storage_pb2_grpc
from tidelog.wire import encode_fetch_partition_result, encode_fetch_response

_log = structlog.get_logger("tidelog.storage.server")


_T = TypeVar("_T", bound=NamedPartition)
_K = TypeVar("_K")

# Fetch defaults are Kafka's consumer defaults (fetch.max.wait.ms, fetch.min.bytes,
# fetch.max.bytes, max.partition.fetch.bytes), as documented in storage.proto.
DEFAULT_MAX_WAIT_MS: Final = 500
DEFAULT_MIN_BYTES: Final = 1
DEFAULT_FETCH_MAX_BYTES: Final = 50 * 1024 * 1024
DEFAULT_PARTITION_MAX_BYTES: Final = 1024 * 1024
# acks=all wait when the request says timeout_ms = 0 (Kafka's request.timeout.ms).
DEFAULT_ACKS_TIMEOUT_MS: Final = 30_000


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Bounds on what one request, and all requests together, may ask of the server."""

    # Partitions in one Fetch / ListOffsets / LeaderAndIsr / StopReplica / DescribeLogDirs.
    max_partitions_per_request: int = 10_000
    # Longest long-poll; a larger max_wait_ms is clamped (not refused), as Kafka clamps.
    max_wait_ms_limit: int = 30_000
    # Record bytes in one Fetch response; below the gRPC send limit so the response fits.
    max_fetch_response_bytes: int = 60 * 1024 * 1024
    # Fetches that may wait at once (each holds a pool thread while it waits); beyond
    # this a fetch answers at once with what there is, and a throttle_time_ms of its
    # max_wait so that the client does not ask again at once (it would spin).
    max_waiting_fetches: int = 32
    # Of those, places only followers' fetches may take: consumers' long polls, however
    # many, never make replication poll (and acks=all wait) behind them.
    replica_fetch_reserve: int = 8
    # Open AppendStream calls (each holds a pool thread, and a reader thread, for its
    # lifetime).
    max_append_streams: int = 16
    # Requests of one AppendStream appended and not yet answered, and their record bytes;
    # beyond either the stream is read no further (gRPC's flow control then holds the
    # client back). The count is high because a direct-mode producer sends one request
    # per partition: a thousand partitions' acks=all appends must overlap on one stream
    # (append_pipeline.py). The bytes bound what a stream holds in memory.
    append_stream_depth: int = 4096
    append_stream_bytes: int = 64 * 1024 * 1024
    # Longest an acks=all append waits for the ISR; a larger timeout_ms is clamped, as
    # max_wait_ms is (each waiting append holds a pool thread).
    max_acks_timeout_ms: int = 300_000

    def __post_init__(self) -> None:
        for name in (
            "max_partitions_per_request",
            "max_wait_ms_limit",
            "max_fetch_response_bytes",
            "max_waiting_fetches",
            "max_append_streams",
            "append_stream_depth",
            "append_stream_bytes",
            "max_acks_timeout_ms",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 <= self.replica_fetch_reserve < self.max_waiting_fetches:
            raise ValueError(
                f"replica_fetch_reserve {self.replica_fetch_reserve} must be >= 0 and below "
                f"max_waiting_fetches {self.max_waiting_fetches}"
            )


@dataclass(frozen=True, slots=True)
class StopReplicaItem:
    topic: str
    partition: int
    leader_epoch: int  # -1 (or any negative) skips the fencing check
    delete: bool
    topic_id: str = ""  # the incarnation meant; "" = whichever the log is


@dataclass(frozen=True, slots=True)
class BrokerAddress:
    """A live broker as UpdateMetadata describes it."""

    broker_id: int
    host: str
    port: int
    rack: str
    broker_epoch: int


@dataclass(frozen=True, slots=True)
class ClusterMetadata:
    """The metadata cache: what the controller last told this broker about the cluster.

    Followers find their leaders' addresses here (replication); immutable, replaced whole.
    """

    brokers: dict[int, BrokerAddress] = field(default_factory=dict)
    controller_epoch: int = -1
    metadata_version: int = 0  # the controller's count of views it sent; 0 = unversioned
    # Every topic's id (name -> id); None when the controller sent none (an older one).
    topic_ids: dict[str, str] | None = None


IsrOutcomeView = tuple[TidelogError | None, tuple[int, ...] | None, int]
"""One AlterPartition outcome: error, the ISR in force (if reported), its partition epoch."""

AlterPartitionSender = Callable[
    [int, Sequence[tuple[str, int, IsrProposal]]], Sequence[IsrOutcomeView]
]
"""(broker epoch, [(topic, partition, proposal)]) -> one outcome each; raises on RPC failure."""


class ReplicaManager:
    """The partitions hosted by this broker, and the LogManager that owns their logs.

    Invariants: every Log the LogManager holds belongs to exactly one Partition in
    ``_partitions`` (created at startup for logs found on disk, in role NONE until a
    LeaderAndIsr arrives); a closed Partition is never in ``_partitions``.

    Thread-safety: all methods may be called from any thread. ``_lock`` serializes every
    use of the LogManager and every change to the partition map and controller epoch.
    The map is replaced, never mutated (copy-on-write), so the data path looks partitions
    up without taking ``_lock``. Lock order: ``_lock`` before partition locks.
    """

    def __init__(
        self,
        log_manager: LogManager,
        *,
        broker_id: int,
        clock: Clock = SYSTEM_CLOCK,
        resolve: AddressResolver | None = None,
        alter_partition: AlterPartitionSender | None = None,
        replica_lag_time_max_ms: int | None = None,
        requires_registration: bool = False,
    ) -> None:
        self.broker_id = broker_id
        # In a cluster (etcd): controller requests are taken only once this incarnation
        # is registered and only for its broker epoch (``_check_controller_request``).
        self._requires_registration = requires_registration
        self._log_manager = log_manager
        # Sends ISR proposals to the active controller; None: standalone, no ISR changes.
        self._alter_partition = alter_partition
        # Overrides every topic's replica.lag.time.max.ms (tests use small values).
        self._replica_lag_time_max_ms = replica_lag_time_max_ms
        self._fetchers = ReplicaFetcherManager(
            local_broker_id=broker_id,
            broker_epoch=lambda: self._broker_epoch,
            resolve=resolve or self._address_from_metadata,
        )
        self._clock = clock
        self._lock = threading.Lock()
        self._partitions: dict[tuple[str, int], Partition] = {}
        self._controller_epoch = -1
        # This incarnation's registration epoch in etcd; -1 when running without etcd.
        self._broker_epoch = -1
        # The cluster as the controller last described it (UpdateMetadata): live brokers
        # and partition states. Replaced whole, never mutated, so readers need no lock.
        self._metadata: ClusterMetadata = ClusterMetadata()
        # Partitions a controller request addressed to this broker epoch has named with a
        # topic id the log matches (or adopted, or was created with): see strays.py. A new
        # broker epoch starts empty. Replaced, never mutated; changed under _lock.
        self._confirmed: frozenset[tuple[str, int]] = frozenset()
        # (controller epoch, request_version) of the LeaderAndIsr each hosted partition's
        # state was last applied from (apply_leader_and_isr). Changed under _lock.
        self._applied_versions: dict[tuple[str, int], tuple[int, int]] = {}
        self._closed = False

    @property
    def data_dir(self) -> str:
        return str(self._log_manager.data_dir)

    def startup(self) -> None:
        """Load (and recover) the logs on disk; each becomes a partition with no role."""
        with self._lock:
            self._log_manager.startup()
            self._partitions = {
                key: Partition(key[0], key[1], log, broker_id=self.broker_id, clock=self._clock)
                for key, log in self._log_manager.all_logs().items()
            }
            # Each log's incarnation as its disk says: until a LeaderAndIsr names the
            # partition, a request for another incarnation is refused, not served.
            for key, topic_id in self._log_manager.all_topic_ids().items():
                self._partitions[key].topic_id = topic_id
            # The HW each partition had (replication-offset-checkpoint): a restarted
            # leader or follower serves what was committed, not just what it recovered.
            for key, high_watermark in self._log_manager.read_high_watermarks().items():
                found = self._partitions.get(key)
                if found is not None:
                    found.restore_high_watermark(high_watermark)
        # One line for all at info: a line each made 3,000 lines (~75 ms) of every start
        # with the scale bench's 3,000 partitions per broker. Each one at debug.
        for topic, partition in sorted(self._partitions):
            _log.debug("partition_loaded", topic=topic, partition=partition)
        _log.info(
            "partitions_loaded",
            partitions=len(self._partitions),
            topics=len({topic for topic, _ in self._partitions}),
        )

    def get_partition(self, topic: str, partition: int) -> Partition:
        """The hosted partition; InvalidTopic/InvalidRequest/UnknownTopicOrPartition else."""
        validate_topic_name(topic)
        validate_partition(partition)
        found = self._partitions.get((topic, partition))  # copy-on-write map: no lock
        if found is None:
            raise UnknownTopicOrPartitionError(
                f"broker {self.broker_id} does not host partition {topic}-{partition}"
            )
        return found

    def partitions(self) -> list[Partition]:
        return list(self._partitions.values())

    def partition_count(self) -> int:
        return len(self._partitions)  # copy-on-write map: no lock

    def set_broker_epoch(self, broker_epoch: int) -> None:
        """Called when this broker (re)registers in etcd and learns its new epoch."""
        with self._lock:
            if broker_epoch != self._broker_epoch:
                # Requests for the new incarnation are built from a controller state at
                # least as new as its registration: their topic ids are authoritative
                # again for every log (strays.py).
                self._confirmed = frozenset()
            self._broker_epoch = broker_epoch

    @property
    def broker_epoch(self) -> int:
        return self._broker_epoch

    @property
    def metadata(self) -> ClusterMetadata:
        return self._metadata

    @property
    def requires_registration(self) -> bool:
        """In a cluster (etcd), as opposed to a standalone node."""
        return self._requires_registration

    def _address_from_metadata(self, broker_id: int) -> str | None:
        found = self._metadata.brokers.get(broker_id)
        if found is None:
            return None
        return format_host_port(found.host, found.port)

    def _check_controller_request(self, controller_epoch: int, broker_epoch: int) -> None:
        # Called with _lock held. A request from a deposed controller must not undo the
        # decisions of its successor; one addressed to an earlier incarnation of this
        # broker describes state this incarnation never had (Kafka's KIP-380).
        if controller_epoch < self._controller_epoch:
            raise StaleControllerEpochError(
                f"controller epoch {controller_epoch} is older than {self._controller_epoch}"
            )
        # Once registered, the epoch is required, not merely checked when present: the
        # controller always sends it, and without it any client could raise the controller
        # epoch (fencing the real controller out) or stop and delete partitions (issue 9).
        # Before a clustered node has registered, nothing is taken (Kafka serves no
        # controller request before its registration, KIP-380): a node restarted after a
        # kill -9 waits up to a TTL for its previous incarnation's lease, serving gRPC on
        # the same address meanwhile, and the controller's sender for that incarnation
        # kept delivering its mailbox: a role meant for the old log (a leadership, with
        # the followers truncating to the new, shorter one) was taken, and acknowledged
        # records were lost (found by an audit). The controller sends again once the new
        # incarnation registers.
        if self._requires_registration and self._broker_epoch <= 0:
            raise StaleBrokerEpochError(
                f"broker {self.broker_id} has not registered this incarnation yet; "
                f"a request for broker epoch {broker_epoch} is not for it"
            )
        if self._broker_epoch > 0 and broker_epoch != self._broker_epoch:
            raise StaleBrokerEpochError(
                f"request for broker epoch {broker_epoch}; broker {self.broker_id} is "
                f"registered with epoch {self._broker_epoch}"
            )
        self._controller_epoch = controller_epoch

    def update_metadata(
        self, controller_epoch: int, broker_epoch: int, metadata: ClusterMetadata
    ) -> None:
        """Replace the metadata cache (UpdateMetadata). Fenced like LeaderAndIsr, and
        kept when the same controller sent a newer view already: a request that reached
        this broker late (the controller gave up on it and sent the next one) would bring
        back broker epochs and addresses the controller has since replaced."""
        with self._lock:
            self._check_open()
            self._check_controller_request(controller_epoch, broker_epoch)
            known = self._metadata
            if (
                metadata.controller_epoch == known.controller_epoch
                and 0 < metadata.metadata_version <= known.metadata_version
            ):
                _log.info(
                    "stale_metadata_ignored",
                    version=metadata.metadata_version,
                    known_version=known.metadata_version,
                )
                return
            self._metadata = metadata
            if metadata.topic_ids is not None:
                self._delete_strays_in_view(metadata.topic_ids)
        self._fetchers.join_retired()  # of strays deleted (see _each_partition)

    def _delete_strays_in_view(self, topic_ids: dict[str, str]) -> None:
        # Lock held. A complete view built after this incarnation registered: logs it
        # shows to be of deleted incarnations go (strays.py says why that is safe).
        for key in strays_in_view(self._log_manager.all_topic_ids(), self._confirmed, topic_ids):
            try:
                self._delete_stray(key, named=topic_ids.get(key[0], ""))
            except OSError:
                # Retried with the next view; the log stays unserved meanwhile (role NONE).
                _log.exception("stray_log_delete_failed", topic=key[0], partition=key[1])

    def apply_leader_and_isr(
        self,
        controller_epoch: int,
        states: Sequence[PartitionState],
        broker_epoch: int = -1,
        request_version: int = 0,
    ) -> list[TidelogError | None]:
        """Create logs as needed and take the roles ``states`` assign; one result each.

        Raises StaleControllerEpochError / StaleBrokerEpochError (changing nothing) for a
        request from a deposed controller or for an earlier incarnation of this broker.
        Per partition: bad names, bad epochs or bad configs fail that partition only, and
        leave it as it was. A partition whose state came from a later request of the same
        controller epoch (``request_version``, 0 = unversioned) is skipped and answered as
        applied: the controller gave up on this request and sent that one (the broker was
        busy past its timeout), and applied now it would bring back what that one
        replaced. A topic's configuration changes with no epoch moving, so the epochs
        alone could not tell: an old retention.ms could come back.
        """

        def apply(state: PartitionState) -> None:
            key = (state.topic, state.partition)
            applied = self._applied_versions.get(key)
            if (
                request_version > 0
                and applied is not None
                and applied[0] == controller_epoch
                and request_version < applied[1]
            ):
                _log.info(
                    "leader_and_isr_superseded",
                    topic=state.topic,
                    partition=state.partition,
                    request_version=request_version,
                    applied_version=applied[1],
                )
                return
            self._apply_state(state)
            if key in self._partitions:
                self._applied_versions[key] = (controller_epoch, request_version)

        return self._each_partition(
            controller_epoch, broker_epoch, states, apply, "leader_and_isr_failed"
        )

    def _apply_state(self, state: PartitionState) -> None:
        validate_topic_name(state.topic)
        validate_partition(state.partition)
        if state.leader_epoch < 0:
            raise InvalidRequestError(f"leader_epoch {state.leader_epoch} is negative")
        if state.topic_id and not valid_topic_id(state.topic_id):
            raise InvalidRequestError(f"topic_id {state.topic_id!r} is not a topic id")
        # Parse the config first: a bad value must fail before anything changes.
        config = LogConfig.from_topic_config(state.configs, base=self._log_manager.default_config)
        key = (state.topic, state.partition)
        partition = self._partitions.get(key)
        if partition is not None:
            on_disk = self._log_manager.topic_id(state.topic, state.partition)
            verdict = leader_and_isr_verdict(
                on_disk=on_disk, named=state.topic_id, confirmed=key in self._confirmed
            )
            if verdict is TopicIdVerdict.REFUSE:
                raise InconsistentTopicIdError(
                    f"{state.topic}-{state.partition}: the request names topic id "
                    f"{state.topic_id}, but this broker holds the log of {on_disk}, as named "
                    "by an earlier request of this controller (this one is out of date)"
                )
            if verdict is TopicIdVerdict.STRAY:
                self._delete_stray(key, named=state.topic_id)
                partition = None
            elif verdict is TopicIdVerdict.ADOPT:
                # A log from before topic ids were kept on disk: it becomes this
                # incarnation's (as Kafka adopts the id for pre-KIP-516 logs).
                self._log_manager.set_topic_id(state.topic, state.partition, state.topic_id)
                partition.topic_id = state.topic_id
                _log.info(
                    "topic_id_adopted",
                    topic=state.topic,
                    partition=state.partition,
                    topic_id=state.topic_id,
                )
        if state.topic_id:
            self._confirmed = self._confirmed | {key}
        if partition is None:
            log = self._log_manager.get_or_create_log(
                state.topic, state.partition, config, state.topic_id
            )
            partition = Partition(
                state.topic, state.partition, log, broker_id=self.broker_id, clock=self._clock
            )
            partition.apply_state(state)
            partition.config_known = True
            self._partitions = {**self._partitions, key: partition}
            created = True
            self._update_fetcher(partition, state)
        else:
            existing = partition

            def configure() -> None:
                # The LogManager applies a changed config to the existing Log; under the
                # partition lock (apply_state's) because it mutates the Log.
                self._log_manager.get_or_create_log(state.topic, state.partition, config)
                existing.config_known = True

            # Raises FENCED_LEADER_EPOCH when stale, configuring nothing.
            changed = partition.apply_state(state, configure)
            created = False
            if not changed:
                return
            self._update_fetcher(partition, state)
        _log.info(
            "partition_state_applied",
            topic=state.topic,
            partition=state.partition,
            role=partition.role.value,
            leader=state.leader,
            epoch=state.leader_epoch,
            isr=list(state.isr),
            created=created,
        )

    def _update_fetcher(self, partition: Partition, state: PartitionState) -> None:
        if partition.role is Role.FOLLOWER:
            self._fetchers.add(partition, state.leader, state.leader_epoch)
        else:
            self._fetchers.remove((state.topic, state.partition))

    def stop_replicas(
        self, controller_epoch: int, items: Sequence[StopReplicaItem], broker_epoch: int = -1
    ) -> list[TidelogError | None]:
        """Stop serving partitions, deleting their logs where asked; one result each.

        Like Kafka, stopping a partition this broker does not host succeeds (and removes a
        leftover log if deletion was asked): a controller retrying must not see errors.
        """
        return self._each_partition(
            controller_epoch, broker_epoch, items, self._stop_replica, "stop_replica_failed"
        )

    def _each_partition(
        self,
        controller_epoch: int,
        broker_epoch: int,
        items: Sequence[_T],
        apply: Callable[[_T], None],
        failed_event: str,
    ) -> list[TidelogError | None]:
        """A controller request's per-partition loop: the request as a whole is fenced by
        the epochs first; then each item fails alone (a TidelogError as it is, a disk
        error as STORAGE_ERROR) and leaves the others applied."""
        results: list[TidelogError | None] = []
        with self._lock:
            self._check_open()
            self._check_controller_request(controller_epoch, broker_epoch)
            for item in items:
                try:
                    apply(item)
                    results.append(None)
                except TidelogError as exc:
                    results.append(exc)
                except OSError as exc:
                    _log.exception(failed_event, topic=item.topic)
                    results.append(StorageError(f"{item.topic}-{item.partition}: {exc}"))
        # Fetcher threads left with no partition were stopped above; joined out here, not
        # under _lock, which a controller request must not hold while a thread finishes.
        self._fetchers.join_retired()
        return results

    def _stop_replica(self, item: StopReplicaItem) -> None:
        validate_topic_name(item.topic)
        validate_partition(item.partition)
        key = (item.topic, item.partition)
        on_disk = self._log_manager.topic_id(item.topic, item.partition)
        if not stop_replica_deletes(on_disk=on_disk, named=item.topic_id):
            # The log is of a topic created since under this name: the request is about
            # one already gone from here (deleted, or found stray). Done, as Kafka does.
            _log.info(
                "stop_replica_other_incarnation",
                topic=item.topic,
                partition=item.partition,
                topic_id=item.topic_id,
                log_topic_id=on_disk,
            )
            return
        partition = self._partitions.get(key)
        if partition is not None and 0 <= item.leader_epoch < partition.leader_epoch:
            raise FencedLeaderEpochError(
                f"{item.topic}-{item.partition}: leader epoch {item.leader_epoch} is older "
                f"than the current {partition.leader_epoch}"
            )
        self._fetchers.remove(key)
        if not item.delete:
            if partition is not None:
                partition.make_offline()
                _log.info("partition_stopped", topic=item.topic, partition=item.partition)
            return
        self._remove_log(key)
        _log.info("partition_deleted", topic=item.topic, partition=item.partition)

    def _remove_log(self, key: tuple[str, int]) -> None:
        # Lock held. Close first: any call in progress finishes, later ones fail; then no
        # thread can touch the Log the LogManager is about to delete.
        self._fetchers.remove(key)
        partition = self._partitions.get(key)
        if partition is not None:
            partition.close(deleted_error(*key))
            self._partitions = {k: p for k, p in self._partitions.items() if k != key}
        self._log_manager.delete_log(*key)
        self._confirmed = self._confirmed - {key}
        self._applied_versions.pop(key, None)
        # The HW checkpoint names logs by topic and partition only: left naming the deleted
        # log until the next periodic write, a crash meanwhile gave a log created again
        # under the same name (the topic re-created) the old HW, and records no follower
        # had were served as committed (found by an audit). delete_log rewrote the
        # recovery points already.
        self._write_high_watermarks()

    def _delete_stray(self, key: tuple[str, int], *, named: str) -> None:
        """Delete a log of a deleted topic incarnation (lock held).

        Kafka renames a stray to ``-stray`` and deletes it later; here it goes the way a
        deleted topic's log goes (``LogManager.delete_log``): renamed to ``*-delete`` in one
        atomic step, then removed. A crash before the rename leaves the stray as it was
        (its id on disk still differs: found again by the same rule); a crash after it
        leaves a ``*-delete`` directory that start-up removes and never opens. So the old
        data is never served under the new incarnation, whatever the moment of the crash.
        """
        old = self._log_manager.topic_id(*key)
        self._remove_log(key)
        _log.warning(
            "stray_log_deleted",
            topic=key[0],
            partition=key[1],
            topic_id=old,
            current_topic_id=named or None,
        )

    def maintenance(
        self, *, checkpoint: bool, retention: bool = True, expire_producers: bool = True
    ) -> None:
        """One pass of flush.ms flushes and file removal; retention and producer expiry
        when asked (each has its own, slower interval: ``StorageNodeConfig``); maybe a
        checkpoint.

        Each partition is locked only while its own log is maintained, so the pass never
        stalls appends to other partitions; without retention or producer expiry, only
        the logs that have flushing or file removal to do (``Log.maintenance_due``) are
        locked at all. The checkpoint only reads recovery points (plain ints that only a
        flush raises), so it needs no partition lock.
        """
        every_log = retention or expire_producers
        with self._lock:
            if self._closed:
                return
            for (topic, partition_id), partition in list(self._partitions.items()):
                if not every_log and not partition.maintenance_due():
                    continue
                with partition.locked() as current_log:
                    if current_log is None:  # deleted since the snapshot
                        continue
                    try:
                        LogManager.maintain_log(
                            topic,
                            partition_id,
                            current_log,
                            high_watermark=partition.high_watermark,
                            # A log loaded from disk runs the broker's defaults until a
                            # LeaderAndIsr brings its topic's settings: retention by
                            # those defaults deleted what the topic keeps (7 days against
                            # retention.ms=-1) after every restart, as Kafka never does.
                            retention=retention and partition.config_known,
                            expire_producers=expire_producers,
                        )
                    except Exception:
                        # One log's failure (a disk failure has halted the node by now)
                        # must not keep every log after it from flushes and retention,
                        # nor the checkpoint below from being written.
                        _log.exception(
                            "log_maintenance_failed", topic=topic, partition=partition_id
                        )
            if checkpoint:
                self._log_manager.checkpoint()
                self._write_high_watermarks()

    def _write_high_watermarks(self) -> None:
        # Reads plain ints (each HW is only ever replaced whole), so no partition locks.
        self._log_manager.write_high_watermarks(
            {key: p.high_watermark for key, p in self._partitions.items()}
        )

    def isr_pass(self) -> None:
        """Leaders propose ISR changes (shrink laggards, add caught-up followers) to the
        controller in AlterPartition requests of at most ``ALTER_PARTITION_BATCH``, and
        apply their answers. Called periodically.

        In one request, more changes than the controller takes in one (10,000) were
        refused whole on every pass, for ever: no ISR of that leader changed again, a
        silent follower held every acks=all append to its timeout (found by an audit).
        Each request's outcome is its own partitions' only."""
        if self._alter_partition is None or self._broker_epoch <= 0:
            return
        proposals: list[tuple[Partition, IsrProposal]] = []
        for partition in list(self._partitions.values()):
            proposal = partition.propose_isr_change(self._replica_lag_time_max_ms)
            if proposal is not None:
                proposals.append((partition, proposal))
        for start in range(0, len(proposals), ALTER_PARTITION_BATCH):
            self._alter_partitions(proposals[start : start + ALTER_PARTITION_BATCH])

    def _alter_partitions(self, proposals: list[tuple[Partition, IsrProposal]]) -> None:
        assert self._alter_partition is not None
        items = [(p.topic, p.partition, proposal) for p, proposal in proposals]
        try:
            outcomes = self._alter_partition(self._broker_epoch, items)
        except Exception as exc:  # unreachable controller: forget the proposals, retry
            _log.info("alter_partition_failed", error=str(exc))
            for partition, proposal in proposals:
                partition.on_isr_result(proposal, None, -1)
            return
        for (partition, proposal), (error, isr, partition_epoch) in zip(
            proposals, outcomes, strict=True
        ):
            if error is None and isr is not None:
                partition.on_isr_result(proposal, isr, partition_epoch)
            elif error is not None:
                partition.on_isr_result(proposal, None, partition_epoch, refused=True)
            else:
                partition.on_isr_result(proposal, None, -1)
            _log.info(
                "isr_change",
                topic=partition.topic,
                partition=partition.partition,
                epoch=proposal.leader_epoch,
                proposed=list(proposal.new_isr),
                isr=list(isr) if isr is not None else None,
                error=str(error) if error is not None else None,
            )

    def pipelined_fetches(self) -> int:
        """Replica fetches sent before the previous answer was appended (fetcher.py)."""
        return self._fetchers.pipelined_fetches()

    def describe(self, keys: Iterable[tuple[str, int]] | None = None) -> list[PartitionInfo]:
        """Snapshots of the hosted partitions (all, or those in ``keys`` that exist)."""
        snapshot = self._partitions
        chosen = list(snapshot) if keys is None else [key for key in keys if key in snapshot]
        infos = []
        for key in sorted(set(chosen)):
            try:
                infos.append(snapshot[key].info())
            except TidelogError:
                continue  # deleted (or shut down) since the snapshot was taken
        return infos

    def stop_leading(self) -> list[tuple[str, int]]:
        """Stop leading every partition led here, at once (a stopping broker): appends,
        reads and follower fetches are answered NOT_LEADER_OR_FOLLOWER from now on and
        acks=all appends waiting are answered so; the logs stay. The partitions it led.

        The controller has moved these leaderships already (controlled shutdown) or will
        once this broker's session ends; the LeaderAndIsr telling this broker so races
        its server stopping and is often never delivered. Until then it went on taking
        appends as leader on the streams still open in the grace period: acks=1 appends
        acknowledged there were lost when it truncated to the new leader, and acks=all
        ones waited out the grace period (found by an audit)."""
        with self._lock:
            partitions = list(self._partitions.values())
        resigned = []
        for partition in partitions:
            if partition.role is Role.LEADER:
                with contextlib.suppress(TidelogError):  # deleted or closed meanwhile
                    partition.make_offline()
                    resigned.append((partition.topic, partition.partition))
        return resigned

    def fail_ack_waiters(self, error: TidelogError) -> None:
        """Answer every acks=all append waiting on any partition with ``error``."""
        with self._lock:
            partitions = list(self._partitions.values())
        for partition in partitions:
            partition.fail_ack_waiters(error)

    def shutdown(self) -> None:
        """Close every partition (waking long-polls), then flush and checkpoint all logs.

        Idempotent. Calls in progress finish first (they hold their partition's lock);
        later calls fail with NOT_LEADER_OR_FOLLOWER, which clients retry elsewhere.
        """
        self._fetchers.shutdown()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._write_high_watermarks()
            except OSError:
                _log.exception("high_watermark_checkpoint_failed")
            for partition in self._partitions.values():
                partition.close(
                    NotLeaderOrFollowerError(f"broker {self.broker_id} is shutting down")
                )
            self._partitions = {}
            self._log_manager.shutdown()
        _log.info("logs_shut_down")

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerNotAvailableError(f"broker {self.broker_id} is shutting down")


# --- the gRPC adapter -----------------------------------------------------------------------

_ACKS_VALUES: Final = frozenset(
    {common_pb2.ACKS_UNSPECIFIED, common_pb2.NONE_ACKS, common_pb2.LEADER, common_pb2.ALL}
)
# Fetch results for one partition: what was read, or why not.
_PartitionRead = ReadResult | TidelogError


@dataclass(frozen=True, slots=True)
class _FetchParams:
    replica_id: int
    max_wait_s: float
    min_bytes: int
    max_bytes: int
    broker_epoch: int = -1  # a follower's registration epoch (its fetches carry it)


ANSWER_MARGIN_S: Final = 0.05
"""What an append's answer leaves of its caller's deadline, for the answer's way back."""


def _answer_by(context: grpc.ServicerContext) -> float | None:
    """When an Append or AppendMany must answer for its caller to hear it (monotonic): its
    acknowledgement waits end by then. An AppendMany whose entries took a while to receive
    and append answered after the gateway's deadline, and the gateway took every
    partition of it, written and committed ones included, for timed out (a non-idempotent
    producer then wrote them twice); each entry is answered on its own now, the waiting
    ones REQUEST_TIMED_OUT (found by an audit)."""
    remaining_s = context.time_remaining()
    if remaining_s is None:
        return None
    return time.monotonic() + max(0.0, remaining_s - ANSWER_MARGIN_S)


@dataclass(frozen=True, slots=True)
class _StartedAppend:
    """An AppendStream or AppendMany request after its append: the partition and result to
    wait on, or the error that is its answer. Its acknowledgement timeout counts from
    ``started_at``, the end of its append: a stream's answers are awaited one after
    another, and counted from when the answering thread reached each, every request
    behind a stuck HW waited a whole timeout more than the one before it."""

    request: storage_pb2.AppendRequest
    partition: Partition | None
    result: AppendResult | None
    error: Exception | None = None
    started_at: float = field(default_factory=time.monotonic)


ALTER_PARTITION_BATCH: Final = 1_000
"""ISR changes per AlterPartition request (the controller takes up to 10,000 in one)."""

SESSION_PROGRESS_INTERVAL_S: Final = 0.25
"""How often a fetch session's fetch also counts as its follower's progress on the
partitions it leaves out (``_report_unchanged``): a pass over every partition of the
session, too much for every round of a follower fetching under load (a round every few
ms). Their positions did not change, so what it keeps fresh is only the follower's
caught-up time (against replica.lag.time.max.ms, 30 s) and the HW it was told."""


def _within_budget(
    read: _PartitionRead, remaining: int, total: int
) -> tuple[_PartitionRead, int, int]:
    """One partition's read counted against a fetch response's byte budget: ``(read,
    bytes left, bytes taken)``. Like Kafka, only the first data may exceed the budget (a
    batch larger than max_bytes still makes progress); later data that would overflow
    is dropped from this answer, left for the next fetch."""
    if isinstance(read, TidelogError):
        return read, remaining, total
    size = len(read.records)
    if size > remaining and total > 0:
        return dataclasses.replace(read, records=b"", left_out=True), remaining, total
    return read, max(remaining - size, 0), total + size


def _client_gone() -> RequestTimedOutError:
    return RequestTimedOutError("the client went away before the acknowledgement")


def _withdraw_when_gone(
    context: grpc.ServicerContext, partition: Partition, waiter: AckWaiter
) -> None:
    """Withdraw ``waiter`` when the call ends (a no-op once it is answered)."""

    def gone() -> None:
        partition.withdraw_ack(waiter, _client_gone())

    if not context.add_callback(gone):
        gone()  # the call has already ended


def _withdraw_waiters(items: Iterable[_StartedAppend]) -> None:
    """The stream ended with appends unanswered (the client went away): take their
    acknowledgement waiters off their partitions rather than leave them for the HW."""
    for item in items:
        if item.partition is None or item.result is None:
            continue
        if item.result.waiter is not None:
            with contextlib.suppress(TidelogError):
                item.partition.wait_for_ack(item.result.waiter, 0)


def requested_epoch(message: Any) -> int:
    """The ``current_leader_epoch`` a request carries, NO_EPOCH (skip the check) if unset.

    The field is proto3 ``optional`` because 0 is a real epoch: a client that does not know
    the epoch must not be fenced by a default.
    """
    if message.HasField("current_leader_epoch"):
        return int(message.current_leader_epoch)
    return NO_EPOCH


def _view_topic_ids(request: storage_pb2.UpdateMetadataRequest) -> dict[str, str] | None:
    """The view's topic ids, None unless complete; a malformed one fails the request (a
    view that garbles an id would make that topic's logs look stray)."""
    if not request.topic_ids_complete:
        return None
    topic_ids = dict(request.topic_ids)
    for name, topic_id in topic_ids.items():
        if topic_id and not valid_topic_id(topic_id):
            raise InvalidRequestError(f"topic {name!r}: {topic_id!r} is not a topic id")
    return topic_ids


def partition_state_from_proto(
    state: common_pb2.PartitionState, configs: dict[str, str] | None = None, topic_id: str = ""
) -> PartitionState:
    """The controller's decision about one partition, as plain data (one place)."""
    return PartitionState(
        topic_id=topic_id,
        topic=state.topic,
        partition=state.partition,
        leader=state.leader,
        leader_epoch=state.leader_epoch,
        isr=tuple(state.isr),
        replicas=tuple(state.replicas),
        partition_epoch=state.partition_epoch,
        configs=configs or {},
    )


class _ChangeWatcher(Generic[_K]):
    """What a fetch registers with each of its partitions (``Partition.watch``): a
    change notes which partition (its place in the request, or a session's key), then
    wakes the fetch, so only the partitions that changed are read again. A session's
    watchers stay registered between its fetches: what changed meanwhile is read by the
    next one. ``set`` runs under the partition's lock: a set insertion and an event,
    nothing that blocks."""

    __slots__ = ("_changed", "_event", "_noted")

    def __init__(self, event: threading.Event, changed: set[_K], noted: _K) -> None:
        self._event = event
        self._changed = changed
        self._noted = noted

    def set(self) -> None:
        self._changed.add(self._noted)
        self._event.set()


class _LiveSession:
    """The long-poll side of a fetch session on the leader (its bookkeeping is
    ``fetch_session.FetchSession``): the partitions it watches between fetches and the
    keys that changed since they were last read.

    Invariant: every partition object in ``watched`` has its watcher registered, until
    ``forget``/``forget_all`` unregisters it, and none is registered after ``forget_all``
    (the session was dropped, perhaps while a fetch of it still runs: ``_lock`` orders
    the two; it is taken before a partition's lock, never after); ``busy`` is held by
    the one fetch of the session running (a second one is refused)."""

    def __init__(self, session: FetchSession[storage_pb2.FetchPartition]) -> None:
        self.session = session
        self.event = threading.Event()
        self.changed: set[Key] = set()
        self.watched: dict[Key, tuple[Partition, _ChangeWatcher[Key]]] = {}
        self.busy = threading.Lock()
        self.reported_s = 0.0  # when unchanged partitions last counted as progress
        self._lock = threading.Lock()
        self._dropped = False

    def drain_changed(self) -> set[Key]:
        keys: set[Key] = set()
        while self.changed:
            keys.add(self.changed.pop())
        return keys

    def watch(self, key: Key, partition: Partition) -> None:
        """Watch ``partition`` for ``key`` (replacing another object's watch, e.g. a
        log deleted and created again)."""
        with self._lock:
            held = self.watched.get(key)
            if self._dropped or (held is not None and held[0] is partition):
                return
            self._forget_locked([key])
            watcher = _ChangeWatcher(self.event, self.changed, key)
            partition.watch(watcher, replica=True)
            self.watched[key] = (partition, watcher)

    def forget(self, keys: Iterable[Key]) -> None:
        with self._lock:
            self._forget_locked(keys)

    def forget_all(self) -> None:
        """The session is dropped: unwatch everything, and watch nothing from now on."""
        with self._lock:
            self._dropped = True
            self._forget_locked(list(self.watched))

    def _forget_locked(self, keys: Iterable[Key]) -> None:
        for key in keys:
            held = self.watched.pop(key, None)
            if held is not None:
                held[0].unwatch(held[1], replica=True)


class StorageServicer(storage_pb2_grpc.StorageServicer):  # type: ignore[misc]
    """tidelog.v1.Storage. Thread-safe: state lives in ReplicaManager and Partition."""

    def __init__(
        self,
        replicas: ReplicaManager,
        *,
        limits: ServerLimits | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._replicas = replicas
        self._limits = limits or ServerLimits()
        self._clock = clock
        self._waiting_fetch_slots = threading.BoundedSemaphore(self._limits.max_waiting_fetches)
        # A consumer's fetch takes one of these as well as a waiting slot.
        self._consumer_fetch_slots = threading.BoundedSemaphore(
            self._limits.max_waiting_fetches - self._limits.replica_fetch_reserve
        )
        self._append_stream_slots = threading.BoundedSemaphore(self._limits.max_append_streams)
        # Events of the fetches waiting right now, so shutdown can end their waits.
        self._waiters_lock = threading.Lock()
        self._waiters: set[threading.Event] = set()
        self._shutting_down = False
        # Followers' incremental fetch sessions (KIP-227, fetch_session.py).
        self._sessions_lock = threading.Lock()
        self._session_cache: FetchSessionCache[storage_pb2.FetchPartition] = FetchSessionCache(
            max_partitions=self._limits.max_partitions_per_request
        )
        self._live_sessions: dict[int, _LiveSession] = {}

    def begin_shutdown(self) -> None:
        """End every long-poll now (each answers with what it has); no new waits start.
        Appends waiting for acks=all are answered NOT_LEADER_OR_FOLLOWER (clients retry
        at the next leader): the server no longer takes the followers' fetches that would
        move the HW, so they would otherwise wait out the grace period."""
        with self._waiters_lock:
            self._shutting_down = True
            for waiter in self._waiters:
                waiter.set()
        self._replicas.fail_ack_waiters(
            NotLeaderOrFollowerError(f"broker {self._replicas.broker_id} is shutting down")
        )

    # --- Append -------------------------------------------------------------------------

    @unary_errors
    def Append(  # noqa: N802 - gRPC's method name
        self, request: storage_pb2.AppendRequest, context: grpc.ServicerContext
    ) -> storage_pb2.AppendResponse:
        answer_by = _answer_by(context)
        partition, result = self._start_append(request)
        if result.waiter is not None:
            # A client that goes away (cancelled, deadline passed) frees this thread at
            # once instead of when timeout_ms runs out.
            _withdraw_when_gone(context, partition, result.waiter)
        return self._finish_append(request, partition, result, answer_by=answer_by)

    @unary_errors
    def AppendMany(  # noqa: N802 - gRPC's method name
        self, request: storage_pb2.AppendManyRequest, context: grpc.ServicerContext
    ) -> storage_pb2.AppendManyResponse:
        """Kafka's multi-partition produce: every entry is appended first, then each
        acknowledgement awaited in turn. The waits overlap (each counts from its
        append), so the call takes about as long as its slowest partition and holds one
        thread, where one Append per partition held one each."""
        self._check_partition_count(len(request.appends))
        seen: set[Key] = set()
        for entry in request.appends:
            key = (entry.topic, entry.partition)
            if key in seen:
                raise InvalidRequestError(
                    f"partition {entry.topic}-{entry.partition} appears twice in one "
                    "AppendMany; put all its batches in one entry"
                )
            seen.add(key)
        answer_by = _answer_by(context)
        started = [self._start_append_answering_errors(entry) for entry in request.appends]
        for item in started:
            if item.partition is not None and item.result is not None and item.result.waiter:
                _withdraw_when_gone(context, item.partition, item.result.waiter)
        return storage_pb2.AppendManyResponse(
            responses=[self._finish_append_answering_errors(item, answer_by) for item in started]
        )

    def AppendStream(  # noqa: N802 - gRPC's method name
        self, request_iterator: Iterator[storage_pb2.AppendRequest], context: grpc.ServicerContext
    ) -> Iterator[storage_pb2.AppendResponse]:
        if not self._append_stream_slots.acquire(blocking=False):
            abort(
                context,
                BrokerNotAvailableError(
                    f"too many open append streams (limit {self._limits.max_append_streams}); "
                    "retry later or use unary Append"
                ),
            )
        try:
            yield from self._pipelined_appends(request_iterator, context)
        finally:
            self._append_stream_slots.release()

    def _pipelined_appends(
        self, requests: Iterator[storage_pb2.AppendRequest], context: grpc.ServicerContext
    ) -> Iterator[storage_pb2.AppendResponse]:
        """An AppendStream's answers. A reader thread appends each request as it arrives,
        without waiting for the ones before it to be acknowledged (Kafka lets an
        idempotent producer keep five requests of a partition in flight); this thread
        answers them in request order, each once acknowledged. Appending in arrival order
        keeps a producer's sequences in order. A failed request gets an error answer in its
        place and the stream goes on, so one bad batch does not cost the client its
        pipeline. At most ``append_stream_depth`` requests, and ``append_stream_bytes`` of
        their records, wait for their answer (``AppendPipeline``)."""
        started: AppendPipeline[_StartedAppend] = AppendPipeline(
            self._limits.append_stream_depth, self._limits.append_stream_bytes
        )
        over = threading.Event()  # the answering side is gone: the reader stops

        def read() -> None:
            try:
                for request in requests:
                    item = self._start_append_answering_errors(request)
                    if not started.put_unless(item, len(request.records), over):
                        _withdraw_waiters([item])  # nobody will answer it
                        return
            except Exception as exc:  # the client went away, or its deadline passed
                _log.debug("append_stream_read_ended", error=str(exc))
            finally:
                started.put_unless(None, 0, over)

        answering: list[_StartedAppend] = []  # the one whose acknowledgement is awaited
        client_gone = threading.Event()

        def gone() -> None:
            # The call ended (its client went away; a no-op after a normal end): stop
            # waiting for the acknowledgement in hand. gRPC sends nothing more, so the
            # loop ends at its next answer and the finally withdraws the rest.
            client_gone.set()
            for item in list(answering):
                if item.partition is not None and item.result and item.result.waiter:
                    item.partition.withdraw_ack(item.result.waiter, _client_gone())

        context.add_callback(gone)
        threading.Thread(target=read, name="append-stream-reader", daemon=True).start()
        try:
            while (item := started.get()) is not None:
                answering[:] = [item]
                if client_gone.is_set():
                    gone()  # ended before this item was in hand
                yield self._finish_append_answering_errors(item)
        finally:
            over.set()
            _withdraw_waiters(started.drain())

    def _start_append_answering_errors(self, request: storage_pb2.AppendRequest) -> _StartedAppend:
        try:
            return _StartedAppend(request, *self._start_append(request))
        except Exception as exc:
            return _StartedAppend(request, None, None, exc)

    def _finish_append_answering_errors(
        self, item: _StartedAppend, answer_by: float | None = None
    ) -> storage_pb2.AppendResponse:
        error = item.error
        if error is None and item.partition is not None and item.result is not None:
            try:
                return self._finish_append(
                    item.request, item.partition, item.result, item.started_at, answer_by
                )
            except Exception as exc:
                error = exc
        if not isinstance(error, TidelogError):
            _log.error("append_stream_failed", topic=item.request.topic, error=repr(error))
        return storage_pb2.AppendResponse(
            error=to_error_proto(error or UnknownServerError("no answer")),
            base_offset=-1,
            last_offset=-1,
            log_append_time_ms=-1,
            log_start_offset=-1,
            high_watermark=-1,
            correlation_id=item.request.correlation_id,
        )

    def _start_append(self, request: storage_pb2.AppendRequest) -> tuple[Partition, AppendResult]:
        """Validate and append (as the leader); the acknowledgement is ``_finish_append``'s."""
        if request.acks not in _ACKS_VALUES:
            raise InvalidRequiredAcksError(f"acks value {request.acks} is not a known Acks")
        if request.timeout_ms < 0:
            raise InvalidRequestError(f"timeout_ms {request.timeout_ms} is negative")
        partition = self._replicas.get_partition(request.topic, request.partition)
        partition.check_topic_id(request.topic_id)
        acks_all = request.acks in (common_pb2.ALL, common_pb2.ACKS_UNSPECIFIED)
        if tracing.ENABLED:
            tracing.event("ap_in", request.partition)
        result = partition.append(request.records, requested_epoch(request), acks_all=acks_all)
        if tracing.ENABLED:
            tracing.event("ap_done", request.partition, result.base_offset, result.last_offset)
        return partition, result

    def _finish_append(
        self,
        request: storage_pb2.AppendRequest,
        partition: Partition,
        result: AppendResult,
        started_at: float | None = None,
        answer_by: float | None = None,
    ) -> storage_pb2.AppendResponse:
        """Wait for the acknowledgement ``request.acks`` asks for, then answer. The wait's
        timeout counts from ``started_at`` when given (a stream's or an AppendMany's
        entries are awaited one after another, and each may wait only what is left of its
        own), and ends by ``answer_by`` (monotonic; ``_answer_by``) at the latest."""
        high_watermark = result.high_watermark
        if result.waiter is not None:
            # The purgatory: this handler thread sleeps on the waiter's event, which the
            # thread that moves the HW (a follower's fetch) sets under the partition lock.
            timeout_ms = min(
                request.timeout_ms or DEFAULT_ACKS_TIMEOUT_MS, self._limits.max_acks_timeout_ms
            )
            timeout_s = timeout_ms / 1000
            if started_at is not None:
                timeout_s = max(0.0, timeout_s - (time.monotonic() - started_at))
            if answer_by is not None:
                timeout_s = min(timeout_s, max(0.0, answer_by - time.monotonic()))
            high_watermark = partition.wait_for_ack(result.waiter, timeout_s)
        no_acks = request.acks == common_pb2.NONE_ACKS
        if tracing.ENABLED:
            tracing.event("ap_out", request.partition, result.base_offset, result.last_offset)
        return storage_pb2.AppendResponse(
            base_offset=-1 if no_acks else result.base_offset,
            last_offset=-1 if no_acks else result.last_offset,
            log_append_time_ms=result.log_append_time_ms,
            log_start_offset=result.log_start_offset,
            high_watermark=high_watermark,
            correlation_id=request.correlation_id,
        )

    # --- Fetch --------------------------------------------------------------------------

    @unary_errors
    def Fetch(  # noqa: N802 - gRPC's method name
        self, request: storage_pb2.FetchRequest, context: grpc.ServicerContext
    ) -> bytes:
        """Answers the encoded ``FetchResponse`` (tidelog.wire); StorageNode registers it
        with a response serializer that passes the bytes through."""
        if not tracing.ENABLED:
            return self._fetch(request, context)
        asked = ",".join(f"{fp.partition}:{fp.fetch_offset}" for fp in request.partitions)
        tracing.event("f_in", request.replica_id, asked)
        answer = self._fetch(request, context)
        tracing.event("f_out", request.replica_id, asked, len(answer))
        return answer

    def _fetch(self, request: storage_pb2.FetchRequest, context: grpc.ServicerContext) -> bytes:
        params = self._fetch_params(request, context)
        if request.replica_id >= 0:
            self._check_follower_broker_epoch(request.replica_id, request.broker_epoch)
            if request.HasField("session_epoch"):
                return self._session_fetch(request, context, params)
        # Consumers' fetches (through gateways) have no sessions: they name few partitions.
        return self._fetch_named(request, context, params)

    def _fetch_named(
        self,
        request: storage_pb2.FetchRequest,
        context: grpc.ServicerContext,
        params: _FetchParams,
    ) -> bytes:
        """A fetch without a session: every partition named, every one answered."""
        partitions = self._resolve(request.partitions)
        replica = params.replica_id >= 0
        # Noted before the read, so that registering the watchers below tells which
        # partitions changed since (``Partition.watch``'s ``since``).
        seen = [p.changes(replica=replica) if isinstance(p, Partition) else 0 for p in partitions]
        reads = self._read_all(request, partitions, params)
        throttle_time_ms = 0
        if self._should_wait(reads, params):
            event = threading.Event()
            changed: set[int] = set()  # places in the request of partitions that changed
            watched = [
                (p, _ChangeWatcher(event, changed, i), seen[i])
                for i, p in enumerate(partitions)
                if isinstance(p, Partition)
            ]

            def register() -> None:
                # A partition that changed since its read above is noted in ``changed``
                # as it is registered, and anything later sets the event; only the
                # partitions that changed are read again. A follower's fetch named every
                # partition it follows, and reading them all again (after registering,
                # then on each wake-up) multiplied the leader's per-partition work when
                # idle (BENCHMARKS.md, idle partitions and scale).
                for partition, watcher, since in watched:
                    partition.watch(watcher, replica=replica, since=since)

            def unregister() -> None:
                for partition, watcher, _ in watched:
                    partition.unwatch(watcher, replica=replica)

            def reread(places: set[int]) -> None:
                nonlocal reads
                reads = self._read_all(request, partitions, params, places, reads)

            if not self._wait_for_data(
                params,
                context,
                event,
                changed,
                still_waiting=lambda: self._should_wait(reads, params),
                reread=reread,
                register=register,
                unregister=unregister,
            ):
                throttle_time_ms = max(1, int(params.max_wait_s * 1000))
        return self._fetch_response(
            zip(request.partitions, reads, strict=True), throttle_time_ms=throttle_time_ms
        )

    def _wait_for_data(
        self,
        params: _FetchParams,
        context: grpc.ServicerContext,
        event: threading.Event,
        changed: set[_K],
        *,
        still_waiting: Callable[[], bool],
        reread: Callable[[set[_K]], None],
        register: Callable[[], None] | None = None,
        unregister: Callable[[], None] | None = None,
    ) -> bool:
        """The long poll: until ``still_waiting()`` is False or ``params.max_wait_s``
        passes, sleep on ``event``, which a change sets after noting its partition in
        ``changed``; ``reread`` those. False, without waiting, when no waiting slot is
        free: the caller answers now and tells the client to wait what it would have
        waited here before it asks again (answered at once, it would poll in a loop)."""
        if not self._take_waiting_slot(params.replica_id >= 0):
            return False
        deadline = time.monotonic() + params.max_wait_s
        with self._waiters_lock:
            self._waiters.add(event)
            if self._shutting_down:
                event.set()
        try:
            context.add_callback(event.set)  # the client went away: stop waiting
            if register is not None:
                register()
            while True:
                remaining_s = deadline - time.monotonic()
                if not still_waiting() or remaining_s <= 0:
                    break
                if self._shutting_down or not context.is_active():
                    break
                event.wait(remaining_s)
                event.clear()
                # Drained after the clear: a change noted later sets the event again.
                again = set()
                while changed:
                    again.add(changed.pop())
                if again:
                    reread(again)
        finally:
            if unregister is not None:
                unregister()
            with self._waiters_lock:
                self._waiters.discard(event)
            self._waiting_fetch_slots.release()
            if params.replica_id < 0:
                self._consumer_fetch_slots.release()
        return True

    # --- fetch sessions (KIP-227, fetch_session.py) ----------------------------------------

    def _session_fetch(
        self,
        request: storage_pb2.FetchRequest,
        context: grpc.ServicerContext,
        params: _FetchParams,
    ) -> bytes:
        """A follower's fetch in a session: open one (epoch 0) or go on with one. Reads
        the partitions named, those whose watchers fired since the last fetch, those
        whose data the last answer had no room for and those whose high watermark moved;
        the others only count as the follower's progress report
        (``Partition.follower_fetched``). Answers what is new."""
        epoch = request.session_epoch
        if epoch == FINAL_EPOCH:
            self._close_session(request.session_id)
            return self._fetch_named(request, context, params)
        if epoch < FINAL_EPOCH:
            raise InvalidRequestError(f"session_epoch {epoch} is not -1, 0 or positive")
        named = [((fp.topic, fp.partition), fp) for fp in request.partitions]
        live, joined, left = self._begin_session_fetch(request, epoch, named)
        if not live.busy.acquire(blocking=False):
            raise InvalidFetchSessionEpochError(
                f"fetch session {live.session.session_id} has another fetch in progress"
            )
        try:
            live.forget(left)
            live.event.clear()
            must_read = (
                {key for key, _ in named}
                | set(joined)
                | live.session.unread  # left out of the last answer for want of room
                | live.drain_changed()
            )
            now_s = time.monotonic()
            if now_s - live.reported_s >= SESSION_PROGRESS_INTERVAL_S:
                live.reported_s = now_s
                self._report_unchanged(live, must_read, params)
            reads: dict[Key, _PartitionRead] = {}
            self._read_session(live, must_read, params, reads)
            throttle_time_ms = 0
            if self._should_wait(list(reads.values()), params) and not self._wait_for_data(
                params,
                context,
                live.event,
                live.changed,
                still_waiting=lambda: self._should_wait(list(reads.values()), params),
                reread=lambda keys: self._read_session(live, keys, params, reads),
            ):
                throttle_time_ms = max(1, int(params.max_wait_s * 1000))
            return self._session_response(live.session, reads, throttle_time_ms)
        finally:
            live.busy.release()

    def _begin_session_fetch(
        self,
        request: storage_pb2.FetchRequest,
        epoch: int,
        named: list[tuple[Key, storage_pb2.FetchPartition]],
    ) -> tuple[_LiveSession, list[Key], list[Key]]:
        """The session a fetch opens or resumes, with the keys that joined and left it."""
        now_s = time.monotonic()
        gone: list[_LiveSession] = []
        try:
            with self._sessions_lock:
                if epoch == INITIAL_EPOCH:
                    if request.session_id != 0 or request.forgotten:
                        raise InvalidRequestError(
                            "a fetch opening a session (session_epoch 0) carries "
                            "session_id 0 and no forgotten partitions"
                        )
                    session, displaced = self._session_cache.open(request.replica_id, named, now_s)
                    for old in displaced:
                        dropped = self._live_sessions.pop(old.session_id, None)
                        if dropped is not None:
                            gone.append(dropped)
                    live = self._live_sessions[session.session_id] = _LiveSession(session)
                    return live, list(session.partitions), []
                try:
                    session = self._session_cache.resume(
                        request.session_id, epoch, request.replica_id, now_s
                    )
                except InvalidFetchSessionEpochError:
                    self._session_cache.close(request.session_id)
                    dropped = self._live_sessions.pop(request.session_id, None)
                    if dropped is not None:
                        gone.append(dropped)
                    raise
                live = self._live_sessions[session.session_id]
                self._session_cache.check_size(
                    session,
                    (key for key, _ in named),
                    ((tp.topic, tp.partition) for tp in request.forgotten),
                    max_partitions=self._partition_limit(request.replica_id),
                )
                joined, left = session.update(
                    named, [(tp.topic, tp.partition) for tp in request.forgotten]
                )
                return live, joined, left
        finally:
            for dropped in gone:
                dropped.forget_all()

    def _close_session(self, session_id: int) -> None:
        with self._sessions_lock:
            self._session_cache.close(session_id)
            live = self._live_sessions.pop(session_id, None)
        if live is not None:
            live.forget_all()

    def expire_fetch_sessions(self) -> int:
        """Drop fetch sessions unused for a while (``FetchSessionCache.expire``) and
        their watchers; returns how many. The storage node's maintenance pass calls it."""
        with self._sessions_lock:
            expired = self._session_cache.expire(time.monotonic())
            gone = [self._live_sessions.pop(s.session_id, None) for s in expired]
        for live in gone:
            if live is not None:
                live.forget_all()
        return len(expired)

    def fetch_sessions(self) -> int:
        """Fetch sessions held (observability and tests)."""
        with self._sessions_lock:
            return len(self._session_cache)

    def _report_unchanged(
        self, live: _LiveSession, must_read: set[Key], params: _FetchParams
    ) -> None:
        """Count the fetch as the follower's progress on every partition not to be read
        (its position unchanged, nothing new noted); adds to ``must_read`` those whose
        high watermark moved since the last answer, or that refuse the report (a role
        changed: the read answers why)."""
        replica_id = params.replica_id
        for key, entry in live.session.partitions.items():
            if key in must_read:
                continue
            held = live.watched.get(key)
            if held is None:
                must_read.add(key)
                continue
            partition = held[0]
            fp = entry.position
            try:
                partition.follower_fetched(
                    fp.fetch_offset,
                    replica_id=replica_id,
                    current_leader_epoch=requested_epoch(fp),
                    written_offset=fp.written_offset if fp.HasField("written_offset") else None,
                    broker_epoch=params.broker_epoch,
                )
            except TidelogError:
                must_read.add(key)
                continue
            if partition.high_watermark != entry.high_watermark:
                must_read.add(key)

    def _read_session(
        self,
        live: _LiveSession,
        keys: set[Key],
        params: _FetchParams,
        reads: dict[Key, _PartitionRead],
    ) -> None:
        """Read ``keys`` of the session into ``reads``, in the session's turns, within
        what is left of the response's byte budget (the first data may exceed it, as in
        ``_read_all``). A key read again (a wake-up of the long poll) replaces its
        previous read, which therefore no longer counts against the budget."""
        total = sum(
            len(r.records)
            for key, r in reads.items()
            if key not in keys and not isinstance(r, TidelogError)
        )
        remaining = max(params.max_bytes - total, 0)
        partitions = live.session.partitions
        for key in live.session.in_turn(keys):
            entry = partitions[key]
            partition: Partition | TidelogError
            try:
                partition = self._replicas.get_partition(*key)
                live.watch(key, partition)  # before the read: no change goes unseen
            except TidelogError as exc:
                partition = exc
            read = self._read_one(entry.position, partition, remaining, params)
            reads[key], remaining, total = _within_budget(read, remaining, total)

    @staticmethod
    def _session_response(
        session: FetchSession[storage_pb2.FetchPartition],
        reads: dict[Key, _PartitionRead],
        throttle_time_ms: int,
    ) -> bytes:
        """The answer to a session's fetch: the reads with something new. Notes in the
        session which partitions' data it carries (their turn is over) and which had
        data it has no room for (the next fetch reads them again)."""
        answered: list[tuple[storage_pb2.FetchPartition, _PartitionRead]] = []
        served: list[Key] = []
        unread: list[Key] = []
        for key, read in reads.items():
            entry = session.partitions.get(key)
            if entry is None:
                continue
            if isinstance(read, TidelogError):
                worth = worth_answering(
                    entry, high_watermark=-1, log_start_offset=-1, has_news=True
                )
            else:
                diverged = read.diverging_end_offset >= 0
                if read.records:
                    served.append(key)
                elif not diverged and entry.position.fetch_offset < read.log_end_offset:
                    # Data there, none read: the budget was used up (read with 0 bytes,
                    # or its data dropped by ``_within_budget``).
                    unread.append(key)
                worth = worth_answering(
                    entry,
                    high_watermark=read.high_watermark,
                    log_start_offset=read.log_start_offset,
                    has_news=bool(read.records) or diverged,
                )
            if worth:
                answered.append((entry.position, read))
        session.answered(served, unread)
        return StorageServicer._fetch_response(
            answered, throttle_time_ms=throttle_time_ms, session_id=session.session_id
        )

    def _take_waiting_slot(self, replica: bool) -> bool:
        """A place for a fetch to wait in, if one is free; a consumer's must leave the
        followers' reserve."""
        if replica:
            return self._waiting_fetch_slots.acquire(blocking=False)
        if not self._consumer_fetch_slots.acquire(blocking=False):
            return False
        if self._waiting_fetch_slots.acquire(blocking=False):
            return True
        self._consumer_fetch_slots.release()
        return False

    def _check_follower_broker_epoch(self, replica_id: int, broker_epoch: int) -> None:
        # A fetch from an earlier incarnation of a follower must not count as its progress
        # (KIP-380). Once the metadata gives the broker a registration epoch, a fetch in its
        # name must carry exactly that epoch: one without an epoch (0 or negative) is
        # refused too, or anyone could claim a follower's id, report its log end offset
        # and move the high watermark over records no follower holds (issue 9).
        brokers = self._replicas.metadata.brokers
        known = brokers.get(replica_id)
        if known is None and (brokers or self._replicas.requires_registration):
            # Not registered as far as this leader knows: a follower whose session ended
            # (a zombie of KIP-380) or a made-up id. Its epoch cannot be checked, so its
            # fetch cannot count; a real broker retries once the metadata lists it again.
            # That includes every follower of a clustered node that has no broker list
            # yet: the controller sends a (re)started broker its LeaderAndIsr before its
            # UpdateMetadata, and in between anyone naming a follower's id moved the HW
            # over records no follower held (found by an audit).
            raise StaleBrokerEpochError(
                f"fetch from broker {replica_id}, which the cluster metadata on broker "
                f"{self._replicas.broker_id} does not list"
                + ("" if brokers else " (it has received no broker list yet)")
            )
        if known is not None and known.broker_epoch > 0 and broker_epoch != known.broker_epoch:
            raise StaleBrokerEpochError(
                f"fetch from broker {replica_id} epoch {broker_epoch}; registered epoch is "
                f"{known.broker_epoch}"
            )

    # --- OffsetForLeaderEpoch -------------------------------------------------------------

    @unary_errors
    def OffsetForLeaderEpoch(  # noqa: N802 - gRPC's method name
        self, request: storage_pb2.OffsetForLeaderEpochRequest, context: grpc.ServicerContext
    ) -> storage_pb2.OffsetForLeaderEpochResponse:
        self._check_partition_count(len(request.partitions), request.replica_id)
        results = []
        for op in request.partitions:
            try:
                partition = self._replicas.get_partition(op.topic, op.partition)
                epoch, end_offset = partition.offset_for_leader_epoch(
                    op.leader_epoch, requested_epoch(op)
                )
                results.append(
                    storage_pb2.OffsetForLeaderEpochResult(
                        topic=op.topic,
                        partition=op.partition,
                        error=to_error_proto(None),
                        leader_epoch=epoch,
                        end_offset=end_offset,
                    )
                )
            except TidelogError as exc:
                results.append(
                    storage_pb2.OffsetForLeaderEpochResult(
                        topic=op.topic,
                        partition=op.partition,
                        error=to_error_proto(exc),
                        leader_epoch=-1,
                        end_offset=-1,
                    )
                )
        return storage_pb2.OffsetForLeaderEpochResponse(partitions=results)

    def _fetch_params(
        self, request: storage_pb2.FetchRequest, context: grpc.ServicerContext
    ) -> _FetchParams:
        self._check_partition_count(len(request.partitions), request.replica_id)
        max_wait_ms = request.max_wait_ms if request.HasField("max_wait_ms") else None
        if max_wait_ms is not None and max_wait_ms < 0:
            raise InvalidRequestError(f"max_wait_ms {max_wait_ms} is negative")
        min_bytes = request.min_bytes if request.HasField("min_bytes") else DEFAULT_MIN_BYTES
        if min_bytes < 0:
            raise InvalidRequestError(f"min_bytes {min_bytes} is negative")
        max_bytes = request.max_bytes if request.HasField("max_bytes") else DEFAULT_FETCH_MAX_BYTES
        if max_bytes <= 0:
            raise InvalidFetchSizeError(f"max_bytes {max_bytes} must be positive")
        wait_ms = min(
            DEFAULT_MAX_WAIT_MS if max_wait_ms is None else max_wait_ms,
            self._limits.max_wait_ms_limit,
        )
        wait_s = wait_ms / 1000
        if request.replica_id >= 0 and any(
            fp.HasField("written_offset") and fp.written_offset < fp.fetch_offset
            for fp in request.partitions
        ):
            # A pipelined follower fetch: answer now, so the follower's next fetch, sent
            # once it has written, reports that progress (and moves the HW) without
            # waiting out a long poll (see FetchPartition.written_offset).
            wait_s = 0.0
        # Answer before the caller's own deadline, leaving time for the response to travel.
        time_remaining_s = context.time_remaining()
        if time_remaining_s is not None:
            wait_s = max(0.0, min(wait_s, time_remaining_s - 0.05))
        max_bytes = min(max_bytes, self._limits.max_fetch_response_bytes)
        return _FetchParams(
            replica_id=request.replica_id,
            broker_epoch=request.broker_epoch if request.replica_id >= 0 else -1,
            max_wait_s=wait_s,
            # An answer holds at most max_bytes, so more could never be reached and the
            # fetch would sleep out its wait with data there (Kafka clamps the same way).
            min_bytes=min(min_bytes, max_bytes),
            max_bytes=max_bytes,
        )

    def _resolve(
        self, requested: Iterable[storage_pb2.FetchPartition]
    ) -> list[Partition | TidelogError]:
        resolved: list[Partition | TidelogError] = []
        for fp in requested:
            try:
                resolved.append(self._replicas.get_partition(fp.topic, fp.partition))
            except TidelogError as exc:
                resolved.append(exc)
        return resolved

    def _read_all(
        self,
        request: storage_pb2.FetchRequest,
        partitions: Sequence[Partition | TidelogError],
        params: _FetchParams,
        only: set[int] | None = None,
        previous: Sequence[_PartitionRead] = (),
    ) -> list[_PartitionRead]:
        """One read of every requested partition within the response's byte budget; with
        ``only``, just the partitions at those places, the others keeping their
        ``previous`` read (which still counts against the budget).

        Like Kafka, only the first partition that returns data may exceed the budget
        (so a batch larger than max_bytes still makes progress); later data that would
        overflow is left for the next fetch.
        """
        reads: list[_PartitionRead] = []
        remaining = params.max_bytes
        total = 0
        for index, (fp, partition) in enumerate(zip(request.partitions, partitions, strict=True)):
            if only is not None and index not in only:
                read = previous[index]
            else:
                read = self._read_one(fp, partition, remaining, params)
            read, remaining, total = _within_budget(read, remaining, total)
            reads.append(read)
        return reads

    @staticmethod
    def _read_one(
        fp: storage_pb2.FetchPartition,
        partition: Partition | TidelogError,
        remaining: int,
        params: _FetchParams,
    ) -> _PartitionRead:
        if isinstance(partition, TidelogError):
            return partition
        limit = fp.max_bytes if fp.HasField("max_bytes") else DEFAULT_PARTITION_MAX_BYTES
        if limit <= 0:
            return InvalidFetchSizeError(f"partition max_bytes {limit} must be positive")
        try:
            partition.check_topic_id(fp.topic_id)
            return partition.read(
                fp.fetch_offset,
                min(limit, remaining),
                replica_id=params.replica_id,
                current_leader_epoch=requested_epoch(fp),
                last_fetched_epoch=(
                    fp.last_fetched_epoch if fp.HasField("last_fetched_epoch") else NO_EPOCH
                ),
                written_offset=fp.written_offset if fp.HasField("written_offset") else None,
                broker_epoch=params.broker_epoch,
            )
        except TidelogError as exc:
            return exc
        except Exception as exc:
            _log.exception("fetch_read_failed", topic=fp.topic, partition=fp.partition)
            return UnknownServerError(f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _should_wait(reads: Sequence[_PartitionRead], params: _FetchParams) -> bool:
        # Kafka answers at once when any partition has an error or a divergence (KIP-320),
        # so the client can act on it (refresh metadata, reset its offset, truncate its
        # log) instead of waiting for nothing: neither changes by waiting.
        if params.max_wait_s <= 0:
            return False
        total = 0
        for read in reads:
            if isinstance(read, TidelogError) or read.diverging_end_offset >= 0:
                return False
            if read.left_out:
                # The response is full: waiting cannot make room for this data (Kafka
                # counts it towards min_bytes and answers at once; found by an audit).
                return False
            total += len(read.records)
        if total >= params.min_bytes:
            return False
        # Below min_bytes, yet a read a byte limit cut short (more was readable than it
        # could hold) cannot grow by waiting: answer now. Kafka counts the bytes there,
        # not those sent. Only here are batch headers walked: with min_bytes 1 (every
        # client of this project) any data answers above.
        follower = params.replica_id >= 0
        return not any(
            read.records
            and next_offset_after(read.records, 0)
            < (read.log_end_offset if follower else read.high_watermark)
            for read in reads
            if not isinstance(read, TidelogError)
        )

    @staticmethod
    def _fetch_response(
        answered: Iterable[tuple[storage_pb2.FetchPartition, _PartitionRead]],
        throttle_time_ms: int = 0,
        session_id: int = 0,
    ) -> bytes:
        results = []
        for fp, read in answered:
            if isinstance(read, TidelogError):
                error = to_error_proto(read)
                results.append(
                    encode_fetch_partition_result(
                        topic=fp.topic,
                        partition=fp.partition,
                        error_code=error.code,
                        error_message=error.message,
                        high_watermark=-1,
                        log_start_offset=-1,
                        log_end_offset=-1,
                        records=b"",
                        leader_epoch=-1,
                        diverging_epoch=-1,
                        diverging_end_offset=-1,
                    )
                )
                continue
            results.append(
                encode_fetch_partition_result(
                    topic=fp.topic,
                    partition=fp.partition,
                    error_code=common_pb2.NONE,
                    error_message="",
                    high_watermark=read.high_watermark,
                    log_start_offset=read.log_start_offset,
                    log_end_offset=read.log_end_offset,
                    records=read.records,
                    leader_epoch=read.leader_epoch,
                    diverging_epoch=read.diverging_epoch,
                    diverging_end_offset=read.diverging_end_offset,
                )
            )
        return encode_fetch_response(results, throttle_time_ms, session_id)

    # --- ListOffsets --------------------------------------------------------------------

    @unary_errors
    def ListOffsets(  # noqa: N802 - gRPC's method name
        self, request: storage_pb2.ListOffsetsRequest, context: grpc.ServicerContext
    ) -> storage_pb2.ListOffsetsResponse:
        self._check_partition_count(len(request.partitions))
        results = []
        for lp in request.partitions:
            try:
                try:
                    spec = OffsetSpec(lp.spec)
                except ValueError:
                    raise InvalidRequestError(
                        f"offset spec {lp.spec} is not EARLIEST, LATEST, BY_TIMESTAMP or "
                        "MAX_TIMESTAMP"
                    ) from None
                partition = self._replicas.get_partition(lp.topic, lp.partition)
                found = partition.list_offset(
                    spec,
                    lp.timestamp_ms,
                    replica_id=request.replica_id,
                    current_leader_epoch=requested_epoch(lp),
                )
                results.append(
                    storage_pb2.ListOffsetsResult(
                        topic=lp.topic,
                        partition=lp.partition,
                        error=to_error_proto(None),
                        offset=found.offset,
                        timestamp_ms=found.timestamp_ms,
                        leader_epoch=found.leader_epoch,
                    )
                )
            except TidelogError as exc:
                results.append(
                    storage_pb2.ListOffsetsResult(
                        topic=lp.topic,
                        partition=lp.partition,
                        error=to_error_proto(exc),
                        offset=-1,
                        timestamp_ms=-1,
                        leader_epoch=-1,
                    )
                )
        return storage_pb2.ListOffsetsResponse(partitions=results)

    # --- control plane ------------------------------------------------------------------

    @unary_errors
    def LeaderAndIsr(  # noqa: N802 - gRPC's method name
        self, request: storage_pb2.LeaderAndIsrRequest, context: grpc.ServicerContext
    ) -> storage_pb2.LeaderAndIsrResponse:
        self._check_partition_count(len(request.partitions))
        states = [
            partition_state_from_proto(
                lp.state, {entry.name: entry.value for entry in lp.configs}, lp.topic_id
            )
            for lp in request.partitions
        ]
        # Stale controller or broker epochs abort the call (a gRPC status, see common.proto).
        outcomes = self._replicas.apply_leader_and_isr(
            request.controller_epoch, states, request.broker_epoch, request.request_version
        )
        return storage_pb2.LeaderAndIsrResponse(
            error=to_error_proto(None), partitions=partition_results(states, outcomes)
        )

    @unary_errors
    def UpdateMetadata(  # noqa: N802 - gRPC's method name
        self, request: storage_pb2.UpdateMetadataRequest, context: grpc.ServicerContext
    ) -> storage_pb2.UpdateMetadataResponse:
        # The whole cluster's view in one request (a view in parts would replace the
        # cache with a part): every topic's id, bounded by the message size. Only the
        # controller sends it, fenced by its epoch.
        metadata = ClusterMetadata(
            brokers={
                b.broker_id: BrokerAddress(b.broker_id, b.host, b.port, b.rack, b.broker_epoch)
                for b in request.brokers
            },
            controller_epoch=request.controller_epoch,
            metadata_version=request.metadata_version,
            topic_ids=_view_topic_ids(request),
        )
        self._replicas.update_metadata(request.controller_epoch, request.broker_epoch, metadata)
        return storage_pb2.UpdateMetadataResponse(error=to_error_proto(None))

    @unary_errors
    def StopReplica(  # noqa: N802 - gRPC's method name
        self, request: storage_pb2.StopReplicaRequest, context: grpc.ServicerContext
    ) -> storage_pb2.StopReplicaResponse:
        self._check_partition_count(len(request.partitions))
        items = [
            StopReplicaItem(
                sp.topic, sp.partition, sp.leader_epoch, sp.delete_partition, sp.topic_id
            )
            for sp in request.partitions
        ]
        outcomes = self._replicas.stop_replicas(
            request.controller_epoch, items, request.broker_epoch
        )
        return storage_pb2.StopReplicaResponse(
            error=to_error_proto(None), partitions=partition_results(items, outcomes)
        )

    @unary_errors
    def DescribeLogDirs(  # noqa: N802 - gRPC's method name
        self, request: storage_pb2.DescribeLogDirsRequest, context: grpc.ServicerContext
    ) -> storage_pb2.DescribeLogDirsResponse:
        self._check_partition_count(len(request.partitions))
        keys = [(tp.topic, tp.partition) for tp in request.partitions] or None
        infos = self._replicas.describe(keys)
        error = to_error_proto(None)
        total_bytes = usable_bytes = -1
        try:
            usage = shutil.disk_usage(self._replicas.data_dir)
            total_bytes, usable_bytes = usage.total, usage.free
        except OSError as exc:
            error = to_error_proto(StorageError(f"cannot stat {self._replicas.data_dir}: {exc}"))
        return storage_pb2.DescribeLogDirsResponse(
            log_dirs=[
                storage_pb2.LogDirDescription(
                    path=self._replicas.data_dir,
                    error=error,
                    total_bytes=total_bytes,
                    usable_bytes=usable_bytes,
                    partitions=[
                        storage_pb2.LogDescription(
                            topic=info.topic,
                            partition=info.partition,
                            size_bytes=info.size_bytes,
                            log_start_offset=info.log_start_offset,
                            log_end_offset=info.log_end_offset,
                            high_watermark=info.high_watermark,
                            recovery_point=info.recovery_point,
                            segment_count=info.segment_count,
                            leader_epoch=info.leader_epoch,
                            is_leader=info.role is Role.LEADER,
                        )
                        for info in infos
                    ],
                )
            ]
        )

    def _check_partition_count(self, count: int, replica_id: int = -1) -> None:
        limit = self._partition_limit(replica_id)
        if count > limit:
            raise InvalidRequestError(f"{count} partitions in one request; the limit is {limit}")

    def _partition_limit(self, replica_id: int) -> int:
        """The partitions one request may name: ``max_partitions_per_request``, or for a
        follower (whose full fetch and epoch look-ups name every partition it follows from
        this leader) as many as this node hosts, if more. Past 10,000 partitions from one
        leader a follower was refused every request and replicated nothing from it (found
        by an audit); Kafka has no such bound."""
        limit = self._limits.max_partitions_per_request
        if replica_id >= 0:
            limit = max(limit, self._replicas.partition_count())
        return limit


__all__ = [
    "ReplicaManager",
    "ServerLimits",
    "StopReplicaItem",
    "StorageServicer",
]
