"""The controller's requests to brokers: Kafka's ControllerChannelManager.

One ``_BrokerSender`` per live broker: a thread, a gRPC channel, and a mailbox of what
that broker still has to hear - LeaderAndIsr entries, StopReplica entries, and one
UpdateMetadata. The sender delivers the mailbox in that order (a follower must know its
role before it reads the cluster view; a deleted replica's stop comes after any role change
for it), retrying with exponential backoff until the broker acknowledges or the broker is
removed or replaced by a new incarnation.

Bounded by construction: the mailbox is keyed by partition, so a newer entry for a
partition replaces the older one (only the latest decision matters - the broker would
apply both in order and end in the same state), and a newer UpdateMetadata replaces the
pending one (it is always the full view). A mailbox therefore never holds more than one
entry per partition and kind plus one UpdateMetadata, however long the broker is
unreachable. Requests carry at most ``max_partitions_per_request`` partitions.

Every request is stamped with the controller id, the controller epoch (brokers reject
older ones: a deposed controller cannot undo its successor's decisions) and the target's
broker epoch (a request meant for an earlier incarnation is rejected, KIP-380), and sent
with a deadline. A broker answering STALE_CONTROLLER_EPOCH proves this controller was
deposed: ``on_stale_controller`` is called and the manager stops sending.

Thread-safety: every public method may be called from any thread and never blocks on the
network (they only fill mailboxes). ``on_stale_controller`` and ``on_stop_acked`` run on
sender threads and must not block for long.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import grpc
import structlog

from services.controller.state import Broker, PartitionRecord, TopicPartition
from services.status import error_from_proto, error_from_rpc_error
from tidelog.addresses import format_host_port
from tidelog.errors import (
    BrokerNotAvailableError,
    ErrorCode,
    StaleBrokerEpochError,
    StaleControllerEpochError,
    TidelogError,
)
from tidelog.v1 import common_pb2, storage_pb2, storage_pb2_grpc

_log = structlog.get_logger("tidelog.controller.channel")

DEFAULT_RPC_TIMEOUT_S: Final = 5.0
DEFAULT_MAX_PARTITIONS_PER_REQUEST: Final = 5_000
"""Below the storage node's max_partitions_per_request (10,000), so chunks are accepted."""
PER_PARTITION_TIMEOUT_S: Final = 0.01
"""Added to a LeaderAndIsr / StopReplica deadline per partition it names: a broker
creating 1,000 partitions' log directories (each fsynced) took longer than the base
deadline, and every retry was answered too late again (an audit saw 15 in a row)."""
INITIAL_BACKOFF_S: Final = 0.05
MAX_BACKOFF_S: Final = 2.0
_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
# A dead broker's channel retries its connection; cap gRPC's reconnect backoff so a
# returning broker is reached within a second (gRPC's default grows to 120 s).
_CHANNEL_OPTIONS: Final = [
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


# --- what the controller asks for -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PartitionAssignmentState:
    """One partition as brokers are told about it: the decided record plus its replicas."""

    topic: str
    partition: int
    record: PartitionRecord
    replicas: tuple[int, ...]
    topic_id: str = ""
    configs: Mapping[str, str] | None = None
    is_new: bool = False

    @property
    def key(self) -> TopicPartition:
        return self.topic, self.partition

    def state_proto(self) -> common_pb2.PartitionState:
        return common_pb2.PartitionState(
            topic=self.topic,
            partition=self.partition,
            leader=self.record.leader,
            leader_epoch=self.record.leader_epoch,
            isr=list(self.record.isr),
            replicas=list(self.replicas),
            partition_epoch=self.record.partition_epoch,
        )


def broker_info(broker: Broker) -> common_pb2.BrokerInfo:
    return common_pb2.BrokerInfo(
        broker_id=broker.broker_id,
        host=broker.host,
        port=broker.port,
        rack=broker.rack,
        broker_epoch=broker.epoch,
    )


class Completion:
    """Counts entries still to be acknowledged; ``wait`` returns once all are resolved.

    An entry is resolved when its broker acknowledged it, when a newer entry for the same
    partition replaced it (the newer one carries the completion on), or when it was given
    up (broker removed, permanent error: recorded in ``errors``).
    Thread-safety: all methods from any thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outstanding = 0
        self._done = threading.Event()
        self._done.set()
        self.errors: list[TidelogError] = []

    def _add(self, count: int = 1) -> None:
        with self._lock:
            self._outstanding += count
            if self._outstanding > 0:
                self._done.clear()

    def _resolve(self, error: TidelogError | None = None) -> None:
        with self._lock:
            if error is not None:
                self.errors.append(error)
            self._outstanding -= 1
            if self._outstanding <= 0:
                self._done.set()

    def wait(self, timeout_s: float) -> bool:
        """True if everything was resolved within ``timeout_s``."""
        return self._done.wait(max(0.0, timeout_s))


@dataclass(slots=True)
class _Entry:
    """A mailbox entry: one partition's request part plus who waits for it."""

    message: storage_pb2.LeaderAndIsrPartition | storage_pb2.StopReplicaPartition
    completions: list[Completion]


def _resolve_all(completions: Iterable[Completion], error: TidelogError | None = None) -> None:
    for completion in completions:
        completion._resolve(error)


MAX_WAITERS_PER_ENTRY: Final = 64
"""Completions one mailbox entry carries. Each newer entry for a partition (and each
UpdateMetadata) carries on the waiters of the one it replaces, so while a registered broker
cannot be reached the list grew with every change; the oldest beyond this are given up
(their callers stopped waiting long before)."""


def _capped(waiters: list[Completion]) -> list[Completion]:
    """``waiters`` without its oldest beyond MAX_WAITERS_PER_ENTRY, which are resolved
    as failed."""
    excess = len(waiters) - MAX_WAITERS_PER_ENTRY
    if excess <= 0:
        return waiters
    _resolve_all(
        waiters[:excess],
        BrokerNotAvailableError("the broker has not answered through many newer changes"),
    )
    return waiters[excess:]


# --- the manager ---------------------------------------------------------------------------------


class ControllerChannelManager:
    """Senders to every live broker for one controller term (epoch); see module docstring.

    Invariants: one sender per broker id, stamped with the broker epoch it was created
    for; after ``shutdown`` (or a STALE_CONTROLLER_EPOCH answer) nothing more is sent.
    A manager serves one term: a new controller term makes a new manager.
    """

    def __init__(
        self,
        controller_id: int,
        controller_epoch: int,
        *,
        on_stale_controller: Callable[[TidelogError], None],
        on_stop_acked: Callable[[int, list[TopicPartition]], None] | None = None,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        max_partitions_per_request: int = DEFAULT_MAX_PARTITIONS_PER_REQUEST,
    ) -> None:
        self.controller_id = controller_id
        self.controller_epoch = controller_epoch
        self.rpc_timeout_s = rpc_timeout_s
        self.max_partitions_per_request = max_partitions_per_request
        self._on_stale_controller = on_stale_controller
        self._on_stop_acked = on_stop_acked
        self._lock = threading.Lock()
        self._senders: dict[int, _BrokerSender] = {}
        self._closed = False
        # Stamped on each UpdateMetadata view, so a broker can tell a late request from
        # the newer view it already holds.
        self._metadata_version = 0
        # LeaderAndIsr requests are numbered as they are sent (request_version): the
        # mailbox holds each partition's newest state, so a later request carries a state
        # at least as new for every partition it names as any earlier one did.
        self._leader_and_isr_version = 0

    # --- membership ---------------------------------------------------------------------

    def set_brokers(self, brokers: Iterable[Broker]) -> None:
        """Make the senders match ``brokers`` exactly (add, replace, remove)."""
        wanted = {broker.broker_id: broker for broker in brokers}
        for broker_id in self.broker_ids():
            if broker_id not in wanted:
                self.remove_broker(broker_id)
        for broker in wanted.values():
            self.add_broker(broker)

    def add_broker(self, broker: Broker) -> None:
        """Start sending to ``broker``; a new incarnation (epoch) replaces the old sender.

        The old sender's mailbox is dropped: it described state for an incarnation that
        is gone, and the controller sends the new one its full state.
        """
        with self._lock:
            if self._closed:
                return
            current = self._senders.get(broker.broker_id)
            if current is not None and current.broker == broker:
                return
            sender = _BrokerSender(self, broker)
            self._senders[broker.broker_id] = sender
        if current is not None:
            current.close(BrokerNotAvailableError(f"broker {broker.broker_id} re-registered"))
        sender.start()

    def remove_broker(self, broker_id: int) -> None:
        with self._lock:
            sender = self._senders.pop(broker_id, None)
        if sender is not None:
            sender.close(BrokerNotAvailableError(f"broker {broker_id} is no longer registered"))

    def broker_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._senders)

    def broker(self, broker_id: int) -> Broker | None:
        with self._lock:
            sender = self._senders.get(broker_id)
        return sender.broker if sender is not None else None

    def shutdown(self) -> None:
        """Stop every sender now (no joins: an RPC in flight is cancelled). Idempotent."""
        with self._lock:
            self._closed = True
            senders = list(self._senders.values())
            self._senders.clear()
        for sender in senders:
            sender.close(BrokerNotAvailableError("the controller resigned"))

    # --- requests -------------------------------------------------------------------------

    def _sender(self, broker_id: int) -> _BrokerSender | None:
        with self._lock:
            return self._senders.get(broker_id)

    def send_leader_and_isr(
        self,
        broker_id: int,
        states: Sequence[PartitionAssignmentState],
        completion: Completion | None = None,
    ) -> None:
        """Queue LeaderAndIsr entries for ``broker_id`` (ignored if it has no sender)."""
        sender = self._sender(broker_id)
        if sender is None or not states:
            return
        entries = {
            state.key: storage_pb2.LeaderAndIsrPartition(
                state=state.state_proto(),
                configs=[
                    common_pb2.ConfigEntry(name=name, value=value)
                    for name, value in sorted((state.configs or {}).items())
                ],
                is_new=state.is_new,
                topic_id=state.topic_id,
            )
            for state in states
        }
        sender.enqueue("leader_and_isr", entries, completion)

    def send_stop_replica(
        self,
        broker_id: int,
        partitions: Sequence[TopicPartition],
        *,
        delete: bool,
        topic_id: str = "",
        completion: Completion | None = None,
    ) -> None:
        """Queue StopReplica entries (leader epoch -1: not fenced, as for a deletion).

        ``topic_id``: the incarnation meant (a topic deletion names it, so a broker never
        deletes the log of a topic created since under the same name); "" = any."""
        sender = self._sender(broker_id)
        if sender is None or not partitions:
            return
        entries = {
            (topic, partition): storage_pb2.StopReplicaPartition(
                topic=topic,
                partition=partition,
                leader_epoch=-1,
                delete_partition=delete,
                topic_id=topic_id,
            )
            for topic, partition in partitions
        }
        sender.enqueue("stop_replica", entries, completion)

    def send_update_metadata(
        self,
        brokers: Sequence[Broker],
        completion: Completion | None = None,
        topic_ids: Mapping[str, str] | None = None,
    ) -> None:
        """Queue the cluster view (live brokers, every topic's id) for every broker with
        a sender. Partitions are not in it: a broker learns those it hosts from
        LeaderAndIsr, and nothing else of them is its business.

        ``topic_ids``: every topic's id (name -> id), from which a broker finds its stray
        logs of deleted topics; None sends none (then the broker judges no log stray)."""
        template = storage_pb2.UpdateMetadataRequest(
            controller_id=self.controller_id,
            controller_epoch=self.controller_epoch,
            brokers=[broker_info(broker) for broker in brokers],
            topic_ids=dict(topic_ids or {}),
            topic_ids_complete=topic_ids is not None,
        )
        with self._lock:
            self._metadata_version += 1
            template.metadata_version = self._metadata_version
            senders = list(self._senders.values())
        for sender in senders:
            sender.enqueue_update_metadata(template, completion)

    def _next_leader_and_isr_version(self) -> int:
        with self._lock:
            self._leader_and_isr_version += 1
            return self._leader_and_isr_version

    # --- callbacks from senders -----------------------------------------------------------

    def _stale_controller(self, error: TidelogError) -> None:
        with self._lock:
            if self._closed:
                return
        _log.warning("controller_deposed", epoch=self.controller_epoch, error=str(error))
        self.shutdown()
        try:
            self._on_stale_controller(error)
        except Exception:
            _log.exception("stale_controller_callback_failed")

    def _stop_acked(self, broker_id: int, partitions: list[TopicPartition]) -> None:
        if self._on_stop_acked is None or not partitions:
            return
        try:
            self._on_stop_acked(broker_id, partitions)
        except Exception:
            _log.exception("stop_acked_callback_failed", broker_id=broker_id)


class _BrokerSender:
    """The mailbox and sending thread for one broker incarnation.

    Invariants: at most one entry per partition across the LeaderAndIsr and StopReplica
    mailboxes (a newer entry of either kind replaces an older one) and at most one pending
    UpdateMetadata. Thread-safety: ``enqueue*`` and ``close`` from any thread; the mailbox
    is guarded by ``_cond``.
    """

    def __init__(self, manager: ControllerChannelManager, broker: Broker) -> None:
        self._manager = manager
        self.broker = broker
        self._cond = threading.Condition()
        self._leader_and_isr: dict[TopicPartition, _Entry] = {}
        self._stop_replica: dict[TopicPartition, _Entry] = {}
        self._update_metadata: tuple[storage_pb2.UpdateMetadataRequest, list[Completion]] | None = (
            None
        )
        self._closed = False
        self._retry_at = 0.0
        self._backoff_s = INITIAL_BACKOFF_S
        # The kind of the last batch that failed: it goes last at the next take, after the
        # other kinds' pending batches (see ``_take``).
        self._failed_kind: str | None = None
        self._channel = grpc.insecure_channel(
            format_host_port(broker.host, broker.port), _CHANNEL_OPTIONS
        )
        self._stub = storage_pb2_grpc.StorageStub(self._channel)
        self._thread = threading.Thread(
            target=self._run, name=f"controller-to-broker-{broker.broker_id}", daemon=True
        )
        self._log = _log.bind(broker_id=broker.broker_id, broker_epoch=broker.epoch)

    def start(self) -> None:
        self._thread.start()

    def close(self, reason: TidelogError) -> None:
        """Drop the mailbox (its waiters resolve with ``reason``) and end the thread."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            dropped = [*self._leader_and_isr.values(), *self._stop_replica.values()]
            self._leader_and_isr.clear()
            self._stop_replica.clear()
            pending_metadata = self._update_metadata
            self._update_metadata = None
            self._cond.notify_all()
        for entry in dropped:
            _resolve_all(entry.completions, reason)
        if pending_metadata is not None:
            _resolve_all(pending_metadata[1], reason)
        # Cancels an RPC in flight; the thread sees _closed and ends.
        self._channel.close()

    # --- mailbox ----------------------------------------------------------------------------

    def enqueue(
        self,
        kind: str,
        entries: Mapping[
            TopicPartition, storage_pb2.LeaderAndIsrPartition | storage_pb2.StopReplicaPartition
        ],
        completion: Completion | None,
    ) -> None:
        target, other = (
            (self._leader_and_isr, self._stop_replica)
            if kind == "leader_and_isr"
            else (self._stop_replica, self._leader_and_isr)
        )
        superseded: list[Completion] = []
        with self._cond:
            if self._closed:
                if completion is not None:
                    completion._add(len(entries))
                    for _ in entries:
                        completion._resolve(BrokerNotAvailableError("broker removed"))
                return
            for key, message in entries.items():
                waiters = [completion] if completion is not None else []
                if completion is not None:
                    completion._add()
                for mailbox in (target, other):
                    old = mailbox.pop(key, None)
                    if old is not None:
                        # The newer entry supersedes the older: the broker ends in the
                        # newer state either way. Waiters of the same kind wait on.
                        if mailbox is target:
                            waiters = [*old.completions, *waiters]
                        else:
                            superseded.extend(old.completions)
                target[key] = _Entry(message, _capped(waiters))
            self._cond.notify_all()
        _resolve_all(superseded)

    def enqueue_update_metadata(
        self, template: storage_pb2.UpdateMetadataRequest, completion: Completion | None
    ) -> None:
        with self._cond:
            if self._closed:
                return
            waiters = self._update_metadata[1] if self._update_metadata is not None else []
            if completion is not None:
                completion._add()
                waiters.append(completion)
            if (
                self._update_metadata is not None
                and self._update_metadata[0].metadata_version > template.metadata_version
            ):
                # Two threads' views crossed on the way here: the newer one stays.
                template = self._update_metadata[0]
            self._update_metadata = (template, _capped(waiters))
            self._cond.notify_all()

    def _take(
        self,
    ) -> (
        tuple[str, dict[TopicPartition, _Entry]]
        | tuple[str, tuple[storage_pb2.UpdateMetadataRequest, list[Completion]]]
        | None
    ):
        """The next batch to send (removed from the mailbox), or None once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                has_work = bool(self._leader_and_isr or self._stop_replica or self._update_metadata)
                now = time.monotonic()
                if has_work and now >= self._retry_at:
                    break
                self._cond.wait(None if not has_work else self._retry_at - now)
            limit = self._manager.max_partitions_per_request
            # LeaderAndIsr first, then StopReplica, then UpdateMetadata; after a failed
            # batch its kind goes last. Partitions a broker keeps failing (STORAGE_ERROR
            # is retried: a full disk) must not hold back the other kinds: only
            # UpdateMetadata used to get a turn, and every StopReplica(delete) for that
            # broker waited for good, the deletion that would free its disk with them
            # (found by an audit).
            order = ["leader_and_isr", "stop_replica", "update_metadata"]
            if self._failed_kind in order:
                cut = order.index(self._failed_kind) + 1
                order = order[cut:] + order[:cut]
            self._failed_kind = None
            for kind in order:
                if kind == "update_metadata":
                    if self._update_metadata is not None:
                        pending_metadata = self._update_metadata
                        self._update_metadata = None
                        return kind, pending_metadata
                    continue
                mailbox = self._leader_and_isr if kind == "leader_and_isr" else self._stop_replica
                if mailbox:
                    keys = sorted(mailbox)[:limit]
                    return kind, {key: mailbox.pop(key) for key in keys}
            raise AssertionError("has_work but every mailbox is empty")

    def _requeue(
        self,
        kind: str,
        batch: dict[TopicPartition, _Entry]
        | tuple[storage_pb2.UpdateMetadataRequest, list[Completion]],
    ) -> None:
        """Put a failed batch back, unless newer entries arrived meanwhile."""
        with self._cond:
            if self._closed:
                closed = True
            else:
                closed = False
                # The failed batch's waiters are older than a newer entry's: they go
                # first, so the cap gives up the oldest whichever batch held them.
                if isinstance(batch, tuple):
                    if self._update_metadata is None:
                        self._update_metadata = batch
                    else:  # a newer view is pending: its send satisfies these waiters too
                        template, waiters = self._update_metadata
                        self._update_metadata = (template, _capped(batch[1] + waiters))
                else:
                    mailbox = (
                        self._leader_and_isr if kind == "leader_and_isr" else self._stop_replica
                    )
                    for key, entry in batch.items():
                        newer = self._leader_and_isr.get(key) or self._stop_replica.get(key)
                        if newer is None:
                            mailbox[key] = entry
                        elif (key in mailbox) and newer is mailbox[key]:
                            newer.completions[:] = _capped(entry.completions + newer.completions)
                        else:
                            _resolve_all(entry.completions)
        if closed:
            _resolve_all(_waiters_of(batch), BrokerNotAvailableError("broker removed"))

    # --- the sending thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            kind, batch = taken
            try:
                if kind == "update_metadata":
                    assert isinstance(batch, tuple)
                    self._send_update_metadata(batch)
                else:
                    assert isinstance(batch, dict)
                    self._send_partitions(kind, batch)
            except _RetryError as retry:
                self._log.info(
                    "broker_request_retry",
                    request=kind,
                    error=str(retry.error),
                    backoff_ms=round(self._backoff_s * 1000),
                )
                with self._cond:
                    self._retry_at = time.monotonic() + self._backoff_s
                    self._backoff_s = min(self._backoff_s * 2, MAX_BACKOFF_S)
                    # Partitions a broker keeps failing must not hold back its metadata
                    # (admin calls wait for it) nor its StopReplicas: the others go next.
                    self._failed_kind = kind
                self._requeue(kind, batch if retry.requeue is None else retry.requeue)
            except _DeposedError as deposed:
                _resolve_all(_waiters_of(batch), deposed.error)
                self._manager._stale_controller(deposed.error)
                return
            except Exception:
                self._log.exception("broker_request_failed", request=kind)
                self._requeue(kind, batch)
                with self._cond:
                    self._retry_at = time.monotonic() + MAX_BACKOFF_S
            else:
                self._backoff_s = INITIAL_BACKOFF_S

    def _call(self, method: Callable[..., object], request: object, partitions: int = 0) -> object:
        """One RPC with the deadline, longer by PER_PARTITION_TIMEOUT_S for each partition
        the request names (a broker creates or deletes a log directory for each);
        failures become _RetryError, _DeposedError, _GiveUpError."""
        timeout_s = self._manager.rpc_timeout_s + PER_PARTITION_TIMEOUT_S * partitions
        try:
            response = method(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise _GiveUpError(error_from_rpc_error(exc)) from None
            self._classify(error_from_rpc_error(exc))
            raise AssertionError("unreachable") from None  # pragma: no cover
        error = error_from_proto(response.error)  # type: ignore[attr-defined]
        if error is not None:
            self._classify(error)
        return response

    def _classify(self, error: TidelogError) -> None:
        if isinstance(error, StaleControllerEpochError):
            raise _DeposedError(error)
        # STALE_BROKER_EPOCH: this sender's broker epoch is old (the broker re-registered);
        # the watch will deliver the new registration, which replaces this sender.
        if error.retriable or isinstance(error, StaleBrokerEpochError):
            raise _RetryError(error)
        raise _GiveUpError(error)

    def _send_partitions(self, kind: str, batch: dict[TopicPartition, _Entry]) -> None:
        manager = self._manager
        try:
            if kind == "leader_and_isr":
                messages = [entry.message for entry in batch.values()]
                leaders = {
                    m.state.leader
                    for m in messages
                    if isinstance(m, storage_pb2.LeaderAndIsrPartition) and m.state.leader >= 0
                }
                live_leaders = [
                    broker_info(found)
                    for leader in sorted(leaders)
                    if (found := manager.broker(leader)) is not None
                ]
                response: object = self._call(
                    self._stub.LeaderAndIsr,
                    storage_pb2.LeaderAndIsrRequest(
                        controller_id=manager.controller_id,
                        controller_epoch=manager.controller_epoch,
                        broker_epoch=self.broker.epoch,
                        partitions=messages,  # type: ignore[arg-type]
                        live_leaders=live_leaders,
                        request_version=manager._next_leader_and_isr_version(),
                    ),
                    len(messages),
                )
                assert isinstance(response, storage_pb2.LeaderAndIsrResponse)
            else:
                response = self._call(
                    self._stub.StopReplica,
                    storage_pb2.StopReplicaRequest(
                        controller_id=manager.controller_id,
                        controller_epoch=manager.controller_epoch,
                        broker_epoch=self.broker.epoch,
                        partitions=[entry.message for entry in batch.values()],  # type: ignore[misc]
                    ),
                    len(batch),
                )
                assert isinstance(response, storage_pb2.StopReplicaResponse)
        except _GiveUpError as give_up:
            self._log.error("broker_request_rejected", request=kind, error=str(give_up.error))
            for entry in batch.values():
                _resolve_all(entry.completions, give_up.error)
            return
        results = {(r.topic, r.partition): error_from_proto(r.error) for r in response.partitions}
        retry: dict[TopicPartition, _Entry] = {}
        acked: list[TopicPartition] = []
        for key, entry in batch.items():
            error = results.get(key)
            if error is None:
                acked.append(key)
                _resolve_all(entry.completions)
            elif error.retriable and (
                kind == "stop_replica" or error.code is ErrorCode.STORAGE_ERROR
            ):
                # A storage error (a full disk, too many open files, a stray file where
                # the log goes) may clear: until the broker takes the role, a leader it
                # was told to be serves nothing while the controller believes it does.
                retry[key] = entry
            else:
                # A partition the broker refused (bad config, fenced epoch): resending the
                # same entry cannot help; the next decision for it will be sent anew.
                self._log.warning(
                    "partition_request_rejected",
                    request=kind,
                    topic=key[0],
                    partition=key[1],
                    error=str(error),
                )
                _resolve_all(entry.completions, error)
        if kind == "stop_replica":
            manager._stop_acked(self.broker.broker_id, acked)
        if retry:
            raise _RetryError(
                BrokerNotAvailableError(f"{len(retry)} partitions failed ({kind}); retrying"),
                requeue=retry,
            )

    def _send_update_metadata(
        self, batch: tuple[storage_pb2.UpdateMetadataRequest, list[Completion]]
    ) -> None:
        template, waiters = batch
        request = storage_pb2.UpdateMetadataRequest()
        request.CopyFrom(template)
        request.broker_epoch = self.broker.epoch
        try:
            self._call(self._stub.UpdateMetadata, request)
        except _GiveUpError as give_up:
            self._log.error(
                "broker_request_rejected", request="update_metadata", error=str(give_up.error)
            )
            _resolve_all(waiters, give_up.error)
            return
        _resolve_all(waiters)


def _waiters_of(
    batch: dict[TopicPartition, _Entry]
    | tuple[storage_pb2.UpdateMetadataRequest, list[Completion]],
) -> list[Completion]:
    if isinstance(batch, tuple):
        return batch[1]
    return [completion for entry in batch.values() for completion in entry.completions]


class _RetryError(Exception):
    """Send the batch (or just ``requeue``) again after a backoff."""

    def __init__(
        self, error: TidelogError, requeue: dict[TopicPartition, _Entry] | None = None
    ) -> None:
        super().__init__(str(error))
        self.error = error
        self.requeue = requeue


class _GiveUpError(Exception):
    def __init__(self, error: TidelogError) -> None:
        super().__init__(str(error))
        self.error = error


class _DeposedError(Exception):
    def __init__(self, error: TidelogError) -> None:
        super().__init__(str(error))
        self.error = error


__all__ = [
    "DEFAULT_RPC_TIMEOUT_S",
    "Completion",
    "ControllerChannelManager",
    "PartitionAssignmentState",
    "broker_info",
]
