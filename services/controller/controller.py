"""The controller service's core: one ClusterState, persisted to etcd, pushed to brokers.

``ClusterState`` (``state.py``) decides; this adapter does the I/O around each decision,
always in the same order:

1. **decide** on the in-memory state (pure; nothing is applied yet);
2. **persist** the decision as one etcd transaction that compares the ``mod_revision`` of
   every key it changes (tracked from the last read or write) and carries
   ``Guard("controller", create_revision=epoch)``;
3. only after the transaction succeeded, **apply** it to the state, then **push**
   LeaderAndIsr to the replicas of the changed partitions and UpdateMetadata to every
   broker (``ControllerChannelManager``; asynchronous, retried until acknowledged).

A failed guard means this controller was deposed: it resigns at once and the error goes to
the caller. A failed revision comparison means the keys changed behind its back: it
re-reads topics, partitions, deletions and producer_ids and decides once more; a second
conflict is an error. A write whose outcome is unknown (etcd unreachable) marks the term for a
**resync**: re-read everything, reconcile, push the full state to every broker.

Taking office (``on_elected``) is a resync: read brokers, topics, partitions and pending
deletions (``get_prefix_with_revision``), watch ``brokers/`` from the next revision,
evict brokers that died unseen, elect leaders for offline partitions whose ISR has a live
member, then send every live broker the full LeaderAndIsr for its partitions and
UpdateMetadata, and resume pending topic deletions. Broker watch events drive
``on_broker_up`` / ``on_broker_down``; a watch failure triggers a resync.

Thread-safety: one lock (``_lock``) guards the current term - its state, tracked revisions
and deletions - and is held across each decide/persist/apply sequence, so decisions are
serialized like Kafka's single controller event thread. Callers are gRPC pool threads,
the etcd watch thread, the election thread, sender threads (acknowledgements) and the
housekeeping thread (resync, deletion clean-up, automatic preferred elections). Never
done with the lock held: cancelling a watch (it waits for a callback that may be waiting
for the lock), waiting for brokers' acknowledgements, calling into the election
synchronously.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, TypeVar
from urllib.parse import unquote

import structlog

from services.cluster_metadata import (
    BROKERS_PREFIX,
    CLUSTER_ID_KEY,
    CONTROLLER_KEY,
    DELETIONS_PREFIX,
    GROUP_EMPTIED_PREFIX,
    GROUP_SESSIONS_PREFIX,
    GROUP_STATES_PREFIX,
    GROUPS_PREFIX,
    PARTITIONS_PREFIX,
    PRODUCER_IDS_KEY,
    TOPICS_PREFIX,
    ControllerInfo,
    PendingDeletion,
    committed_offset_owner,
    committed_offset_time_ms,
    decode_broker,
    decode_cluster_id,
    decode_controller,
    decode_deletion,
    decode_partition,
    decode_producer_ids,
    decode_topic,
    deletion_key,
    encode_cluster_id,
    encode_deletion,
    encode_partition,
    encode_producer_ids,
    encode_topic,
    group_emptied_key,
    group_fence_key,
    group_of_offset_key,
    group_of_session_key,
    group_state_key,
    group_timer_key,
    partition_key,
    partitions_prefix,
    topic_key,
)
from services.controller.assignment import (
    assign_replicas,
    extend_assignment,
    validate_assignment,
)
from services.controller.channel import (
    DEFAULT_RPC_TIMEOUT_S,
    Completion,
    ControllerChannelManager,
    PartitionAssignmentState,
)
from services.controller.election import ControllerElection
from services.controller.offset_expiry import (
    OFFSETS_RETENTION_CHECK_INTERVAL_S,
    OFFSETS_RETENTION_MS,
    StoredOffset,
    decide_expiry,
)
from services.controller.state import (
    LEADER_IMBALANCE_PERCENTAGE,
    Broker,
    ClusterState,
    ElectionType,
    PartitionChange,
    PartitionRecord,
    Topic,
    TopicPartition,
)
from services.controller.topic_config import (
    MAX_CONFIG_ENTRIES,
    TOPIC_CONFIG_DEFAULTS,
    effective_configs,
    validate_topic_configs,
)
from services.metastore import (
    Compare,
    DeleteOp,
    GetOp,
    GetResult,
    Guard,
    KeyValue,
    MetaStore,
    MetaStoreError,
    MetaStoreRequestTooLargeError,
    PutOp,
    TxnOp,
    WatchEvent,
)
from tidelog.errors import (
    ElectionNotNeededError,
    InvalidConfigError,
    InvalidPartitionsError,
    InvalidReplicaAssignmentError,
    InvalidReplicationFactorError,
    InvalidRequestError,
    InvalidTopicError,
    InvalidUpdateVersionError,
    NotControllerError,
    RequestTimedOutError,
    StaleBrokerEpochError,
    TidelogError,
    TopicAlreadyExistsError,
    UnknownServerError,
    UnknownTopicOrPartitionError,
)
from tidelog.topics import MAX_PARTITION, validate_topic_name

_log = structlog.get_logger("tidelog.controller")

MAX_PARTITIONS_PER_TOPIC: Final = 4_000
"""Creating a topic writes one etcd key per partition (in transactions of at most a
thousand: docs/METADATA.md, section 3); this bounds one decision's size and the push that
follows it. The same bound applies to the total after CreatePartitions."""

MIN_LOCK_WAIT_S: Final = 0.05
"""The least an admin change waits for the controller's lock, whatever its timeout."""
PRODUCER_ID_BLOCK_SIZE: Final = 1_000
EXPIRY_KEYS_PER_TXN: Final = 50
"""Offsets deleted per transaction: a compare and a delete each, under etcd's default
--max-txn-ops of 128."""
"""Producer ids per AllocateProducerIds answer (Kafka's block size, KIP-730)."""

MAX_PRODUCER_ID: Final = 2**63 - 1
"""Producer ids are int64 in the batch header; -1 means "no producer"."""


# --- configuration -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """How one controller process behaves. Durations in the unit their name ends with."""

    controller_id: int
    # host:port brokers and clients reach this controller at (in the election key).
    advertised_address: str
    # Lease TTL of the election key: a silent active controller is replaced after this.
    session_ttl_s: int = 10
    # Kafka's leader.imbalance.check.interval.seconds and
    # leader.imbalance.per.broker.percentage: how often, and past which share of a
    # broker's preferred partitions led elsewhere, preferred leaders are restored.
    imbalance_check_interval_s: float = 300.0
    leader_imbalance_percentage: int = LEADER_IMBALANCE_PERCENTAGE
    # Deadline of each LeaderAndIsr / UpdateMetadata / StopReplica call to a broker.
    broker_rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S
    # How long admin calls wait for brokers to acknowledge when the request says 0, and
    # the most any request may ask for.
    default_wait_ms: int = 5_000
    max_wait_ms: int = 60_000
    # Request limits: topics per CreateTopics/DeleteTopics/CreatePartitions/Metadata,
    # partitions per topic (see MAX_PARTITIONS_PER_TOPIC), partitions per AlterPartition /
    # ElectLeaders request, and new partitions per CreateTopics / CreatePartitions request
    # (all topics together: placing them runs under the controller's lock, which broker
    # failures wait for; 1,000 topics of 4,000 partitions held it for 40 s).
    max_topics_per_request: int = 1_000
    max_partitions_per_topic: int = MAX_PARTITIONS_PER_TOPIC
    max_partitions_per_request: int = 10_000
    # Period of the housekeeping pass (resync after failures, deletion clean-up, the
    # imbalance check's clock).
    housekeeping_interval_s: float = 0.25
    # Kafka's offsets.retention.minutes and offsets.retention.check.interval.ms: a group
    # without members loses its committed offsets this long after its last commit
    # (offset_expiry.py), checked this often.
    offsets_retention_ms: int = OFFSETS_RETENTION_MS
    offsets_retention_check_interval_s: float = OFFSETS_RETENTION_CHECK_INTERVAL_S

    def __post_init__(self) -> None:
        if self.controller_id < 0:
            raise ValueError(f"controller id must be >= 0, got {self.controller_id}")
        if self.session_ttl_s < 1:
            raise ValueError("session_ttl_s must be >= 1")
        if (
            self.imbalance_check_interval_s <= 0
            or self.housekeeping_interval_s <= 0
            or self.offsets_retention_check_interval_s <= 0
        ):
            raise ValueError("intervals must be positive")
        if self.offsets_retention_ms < 1:
            raise ValueError("offsets_retention_ms must be >= 1")
        if not 0 <= self.leader_imbalance_percentage <= 100:
            raise ValueError("leader_imbalance_percentage must be within 0..100")
        if not 1 <= self.max_partitions_per_topic <= MAX_PARTITIONS_PER_TOPIC:
            raise ValueError(f"max_partitions_per_topic must be 1..{MAX_PARTITIONS_PER_TOPIC}")


# --- the API's dataclasses (server.py translates them to and from protobuf) ------------------


@dataclass(frozen=True, slots=True)
class NewTopic:
    """A topic to create. ``assignments``: explicit ``(partition, replicas)`` placement."""

    name: str
    num_partitions: int
    replication_factor: int
    configs: tuple[tuple[str, str], ...] = ()
    assignments: tuple[tuple[int, tuple[int, ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class CreatedTopic:
    """The outcome for one topic of CreateTopics: ``topic`` on success, else ``error``."""

    name: str
    error: TidelogError | None
    topic: Topic | None = None

    @property
    def effective_configs(self) -> dict[str, str]:
        return effective_configs(self.topic.configs) if self.topic is not None else {}


@dataclass(frozen=True, slots=True)
class NewPartitions:
    """Grow topic ``name`` to ``count`` partitions; optional placement of the new ones."""

    name: str
    count: int
    assignments: tuple[tuple[int, tuple[int, ...]], ...] = ()


def _emptied_at_ms(kv: KeyValue) -> int:
    """A group's empty mark (``group-emptied/<group>``: decimal ms); a mark that cannot be
    read counts as made now, which only delays the expiry."""
    try:
        return int(kv.value)
    except ValueError:
        return int(time.time() * 1000)


_Item = TypeVar("_Item")
_Outcome = TypeVar("_Outcome")


def _duplicated(names: Iterable[str]) -> set[str]:
    """Names a request gives more than once. Every entry of such a name is refused, as
    Kafka does: applying the first would make a request that is wrong change something."""
    return {name for name, count in Counter(names).items() if count > 1}


@dataclass(frozen=True, slots=True)
class TopicOutcome:
    name: str
    error: TidelogError | None


@dataclass(frozen=True, slots=True)
class ConfigChange:
    """Set and remove config overrides of topic ``name`` (Kafka's IncrementalAlterConfigs
    SET and DELETE operations)."""

    name: str
    set: tuple[tuple[str, str], ...] = ()
    delete: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ConfigOutcome:
    name: str
    error: TidelogError | None
    configs: Mapping[str, str] = field(default_factory=dict)  # the overrides after it


@dataclass(frozen=True, slots=True)
class PartitionView:
    topic: str
    partition: int
    record: PartitionRecord
    replicas: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TopicView:
    name: str
    error: TidelogError | None
    topic: Topic | None = None
    partitions: tuple[PartitionView, ...] = ()


@dataclass(frozen=True, slots=True)
class ClusterView:
    cluster_id: str
    controller_id: int
    controller_address: str
    controller_epoch: int
    brokers: tuple[Broker, ...]


@dataclass(frozen=True, slots=True)
class IsrProposal:
    """One item of AlterPartition: the leader's proposed ISR and the epochs it read."""

    topic: str
    partition: int
    leader_epoch: int
    new_isr: tuple[int, ...]
    partition_epoch: int
    # (broker id, broker epoch) of each joining member, as the leader saw it fetch.
    joining: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class IsrOutcome:
    """The result for one proposal: ``view`` is the state in force (when the partition exists)."""

    topic: str
    partition: int
    error: TidelogError | None
    view: PartitionView | None


@dataclass(frozen=True, slots=True)
class ElectionOutcome:
    topic: str
    partition: int
    error: TidelogError | None


@dataclass(frozen=True, slots=True)
class ProducerIdBlock:
    """Producer ids ``[start, start + length)``, handed to one broker or client."""

    start: int
    length: int


class StandbyError(NotControllerError):
    """NOT_CONTROLLER from a standby; ``active`` is the active controller, if one is known."""

    def __init__(self, message: str, active: ControllerInfo | None) -> None:
        super().__init__(message)
        self.active = active


# --- internals -----------------------------------------------------------------------------


class _ConflictError(Exception):
    """A transaction's revision comparison failed: someone changed a key we track."""


@dataclass
class _Plan:
    """One decision as etcd writes and the in-memory updates that follow them."""

    changes: list[PartitionChange] = field(default_factory=list)
    put_topics: list[Topic] = field(default_factory=list)
    removed_topics: list[str] = field(default_factory=list)
    put_deletions: list[PendingDeletion] = field(default_factory=list)
    removed_deletions: list[str] = field(default_factory=list)
    # The new value of ``producer_ids`` (next_block_start), when a block is handed out.
    producer_ids_next: int | None = None

    def empty(self) -> bool:
        return not (
            self.changes
            or self.put_topics
            or self.removed_topics
            or self.put_deletions
            or self.removed_deletions
            or self.producer_ids_next is not None
        )


TXN_CHUNK_OPS: Final = 100
"""Partition changes (or finished deletions) per transaction when a decision is split:
under etcd's own default --max-txn-ops (128), with room for the first transaction's
topic and deletion records. At 1,000 (within the 4096 tidelog's etcd runs with), an etcd
run elsewhere at its defaults refused every failover of a broker leading over ~125
partitions, for good: its partitions stayed led by the dead broker (found by an audit)."""
TXN_CHUNK_BYTES: Final = 512 * 1024
"""Estimated bytes per split transaction: a third of etcd's default 1.5 MiB request
limit, with 249-character topic names in every key (each key goes in twice: its
compare and its put)."""
_PARTITION_VALUE_BYTES: Final = 256
"""An upper estimate of an encoded partition record and of a compare's own fields."""


def _chunks(plan: _Plan) -> list[_Plan]:
    """``plan`` cut into transactions within ``TXN_CHUNK_OPS`` and ``TXN_CHUNK_BYTES``.
    Topic and deletion records and producer ids stay in the first (a topic deletion's
    records must go together); partition changes and finished deletions, each guarded
    on its own, fill it and the next ones in order."""
    first = dataclasses.replace(plan, changes=[], removed_deletions=[])
    chunks = [first]
    ops, size = 0, 0
    items: list[PartitionChange | str] = [*plan.changes, *plan.removed_deletions]
    for item in items:
        key = (
            partition_key(item.topic, item.partition)
            if isinstance(item, PartitionChange)
            else deletion_key(item)
        )
        cost = 2 * len(key) + _PARTITION_VALUE_BYTES
        if ops and (ops + 1 > TXN_CHUNK_OPS or size + cost > TXN_CHUNK_BYTES):
            chunks.append(_Plan())
            ops, size = 0, 0
        if isinstance(item, PartitionChange):
            chunks[-1].changes.append(item)
        else:
            chunks[-1].removed_deletions.append(item)
        ops, size = ops + 1, size + cost
    return [chunk for chunk in chunks if not chunk.empty()] or [plan]


@dataclass(eq=False)
class _Term:
    """Everything that belongs to one period in office (one controller epoch).

    A new term starts from scratch; callbacks from an older term's watch or senders check
    ``controller._term is term`` and are ignored once it ended.
    """

    epoch: int
    channel: ControllerChannelManager
    state: ClusterState = field(default_factory=ClusterState)
    # mod_revision of every controller-owned key (topics/, partitions/, deletions/,
    # producer_ids).
    revisions: dict[str, int] = field(default_factory=dict)
    # ``producer_ids`` as last read or written: the start of the next producer id block.
    next_producer_id: int = 0
    cluster_id: str = ""
    deletions: dict[str, PendingDeletion] = field(default_factory=dict)
    # topic -> broker -> partitions whose StopReplica(delete) is not acknowledged yet.
    deletion_pending: dict[str, dict[int, set[int]]] = field(default_factory=dict)
    cancel_watch: Callable[[], None] | None = None
    watch_generation: int = 0
    # Read-only flags set from other threads without the lock (a bool store is atomic).
    resync_needed: bool = False
    deposed: bool = False
    # False until the first read of etcd completed: requests wait for it (NOT_CONTROLLER).
    ready: bool = False
    next_imbalance_check: float = 0.0
    next_offset_expiry: float = 0.0


def _kv_from_event(event: WatchEvent) -> KeyValue:
    return KeyValue(
        key=event.key,
        value=event.value,
        mod_revision=event.mod_revision,
        create_revision=event.create_revision,
        version=event.version,
        lease_id=0,
    )


# --- the controller --------------------------------------------------------------------------


class Controller:
    """An elected controller (active or standby); see the module docstring.

    Invariants while active: ``_term.state`` equals what etcd holds under topics/ and
    partitions/ as of the last successful write (every change is persisted before it is
    applied); ``_term.revisions`` holds the mod_revision of each of those keys; every live
    broker has a sender in ``_term.channel``.
    """

    def __init__(self, store: MetaStore, config: ControllerConfig) -> None:
        self._store = store
        self.config = config
        self._lock = threading.Lock()
        self._term: _Term | None = None
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._election = ControllerElection(
            store,
            controller_id=config.controller_id,
            address=config.advertised_address,
            ttl_s=config.session_ttl_s,
            on_elected=self._on_elected,
            on_resigned=self._on_resigned,
        )
        self._housekeeper = threading.Thread(
            target=self._housekeeping_loop,
            name=f"controller-housekeeping-{config.controller_id}",
            daemon=True,
        )
        self._log = _log.bind(controller_id=config.controller_id)

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Controller:
        self._housekeeper.start()
        self._election.start()
        return self

    def stop(self) -> None:
        """Resign (a standby takes over at once) and stop every thread. Idempotent."""
        self._stopping.set()
        self._wake.set()
        self._election.stop()
        self._on_resigned()  # in case the election thread could not finish in time
        if self._housekeeper.is_alive():
            self._housekeeper.join(5.0)

    @property
    def epoch(self) -> int | None:
        """The controller epoch while active, else None."""
        term = self._term
        return term.epoch if term is not None and term.ready and not term.deposed else None

    @property
    def is_active(self) -> bool:
        return self.epoch is not None

    def active_controller(self) -> ControllerInfo | None:
        return self._election.known_controller()

    # --- election callbacks -----------------------------------------------------------------

    def _on_elected(self, epoch: int) -> None:
        """Take office: read everything, watch brokers, reconcile, push the full state."""
        term_box: list[_Term] = []
        channel = ControllerChannelManager(
            self.config.controller_id,
            epoch,
            on_stale_controller=lambda error: self._deposed(term_box[0], str(error)),
            on_stop_acked=lambda broker_id, tps: self._stop_acked(term_box[0], broker_id, tps),
            rpc_timeout_s=self.config.broker_rpc_timeout_s,
        )
        term = _Term(epoch=epoch, channel=channel)
        term_box.append(term)
        term.next_imbalance_check = time.monotonic() + self.config.imbalance_check_interval_s
        term.next_offset_expiry = time.monotonic() + self.config.offsets_retention_check_interval_s
        with self._lock:
            self._term = term
        self._log.info("activating", epoch=epoch)
        # Raises on failure; the election then resigns this term and campaigns again.
        self._resync(term)
        self._log.info(
            "active",
            epoch=epoch,
            brokers=term.state.live_broker_ids,
            topics=len(term.state.topics),
            partitions=len(term.state.partitions),
        )

    def _on_resigned(self) -> None:
        with self._lock:
            term = self._term
            self._term = None
            if term is None:
                return
            term.deposed = True
            cancel = term.cancel_watch
            term.cancel_watch = None
            term.channel.shutdown()
        if cancel is not None:
            cancel()  # outside the lock: it waits for a callback that may want the lock
        self._log.info("inactive", epoch=term.epoch)

    def _deposed(self, term: _Term, reason: str) -> None:
        """Proof that a successor exists: stop acting now, let the election resign."""
        if term.deposed:
            return
        term.deposed = True
        self._log.warning("deposed", epoch=term.epoch, reason=reason)
        self._election.resign(term.epoch)

    # --- the active term's guard ------------------------------------------------------------

    def _require_active(self) -> _Term:
        """The current term; raises StandbyError (NOT_CONTROLLER) when there is none.

        Called with the lock held.
        """
        term = self._term
        if term is None or term.deposed or not term.ready:
            raise self._standby_error()
        return term

    def _standby_error(self, holder: ControllerInfo | None = None) -> StandbyError:
        """NOT_CONTROLLER naming the active controller: ``holder`` if known, else the
        election's view, else etcd's (this process may not have noticed its own fall yet)."""
        me = self.config.controller_id
        active = holder or self._election.known_controller()
        if active is None or active.controller_id == me:
            try:
                kv = self._store.get(CONTROLLER_KEY)
                active = decode_controller(kv) if kv is not None else None
            except (MetaStoreError, TidelogError):
                active = None
        if active is None or active.controller_id == me:
            return StandbyError(
                f"controller {self.config.controller_id} is not the active controller and no "
                "controller is active right now; retry shortly",
                None,
            )
        return StandbyError(
            f"controller {self.config.controller_id} is a standby; the active controller is "
            f"{active.controller_id} at {active.address}",
            active,
        )

    # --- persistence ------------------------------------------------------------------------

    def _commit(self, term: _Term, plan: _Plan) -> None:
        """Write ``plan`` in guarded transactions; apply each and track revisions.

        One transaction when it fits etcd's limits (``_chunks``), else several: the first
        holds everything but partition changes and finished deletions, the rest those,
        each independent of the others (its own revision compare). A decision over many
        partitions (a broker failure moving 5,000 leaderships, an AlterPartition of a
        large leader) exceeded etcd's --max-txn-ops or request size, failed every time,
        and wedged the controller. A failure after some chunks committed schedules a
        resync: what is in etcd is then re-read, and a topic whose partition keys were
        not all written is completed from its assignment.

        Raises _ConflictError (a compared revision moved), NotControllerError (the guard
        failed: deposed) or MetaStoreError (outcome unknown: a resync is scheduled).
        """
        # Each record names its ISR members' broker epochs as known now: a member that
        # restarted unseen shows by its epoch later, whenever the record was written
        # (``ClusterState.evict_restarted``).
        brokers = term.state.brokers
        plan = dataclasses.replace(
            plan,
            changes=[dataclasses.replace(c, new=c.new.stamped(brokers)) for c in plan.changes],
        )
        chunks = _chunks(plan)
        for done, chunk in enumerate(chunks):
            try:
                self._commit_one(term, chunk)
            except (_ConflictError, MetaStoreError):
                if done:
                    self._schedule_resync(term)
                raise

    def _commit_one(self, term: _Term, plan: _Plan) -> None:
        """Write ``plan`` in one guarded transaction; then apply it (see ``_commit``)."""
        compares: list[Compare] = []
        ops: list[TxnOp] = []
        revisions = term.revisions

        def expect(key: str) -> None:
            compares.append(Compare.mod_revision_is(key, revisions.get(key, 0)))

        for topic in plan.put_topics:
            expect(topic_key(topic.name))
            if topic.name not in term.state.topics:
                # A new topic: also no pending deletion of an older incarnation (whose
                # StopReplica(delete) would otherwise hit the new topic's logs).
                expect(deletion_key(topic.name))
            ops.append(PutOp(topic_key(topic.name), encode_topic(topic)))
        for change in plan.changes:
            key = partition_key(change.topic, change.partition)
            expect(key)
            ops.append(PutOp(key, encode_partition(change.new)))
        for name in plan.removed_topics:
            expect(topic_key(name))
            ops.append(DeleteOp(topic_key(name)))
            ops.append(DeleteOp(partitions_prefix(name), prefix=True))
        for deletion in plan.put_deletions:
            expect(deletion_key(deletion.topic))
            ops.append(PutOp(deletion_key(deletion.topic), encode_deletion(deletion)))
        for name in plan.removed_deletions:
            expect(deletion_key(name))
            ops.append(DeleteOp(deletion_key(name)))
        if plan.producer_ids_next is not None:
            expect(PRODUCER_IDS_KEY)
            ops.append(PutOp(PRODUCER_IDS_KEY, encode_producer_ids(plan.producer_ids_next)))
        guard = Guard(CONTROLLER_KEY, create_revision=term.epoch)
        compares.extend(guard.compares())
        try:
            result = self._store.txn(compares, ops, [GetOp(CONTROLLER_KEY)])
        except MetaStoreRequestTooLargeError:
            raise  # refused whole, nothing applied: no need to re-read
        except MetaStoreError:
            # The write may or may not have been applied: re-read before deciding again.
            self._schedule_resync(term)
            raise
        if not result.succeeded:
            found = result.responses[0] if result.responses else None
            holder = found.kvs[0] if isinstance(found, GetResult) and found.kvs else None
            if holder is None or holder.create_revision != term.epoch:
                self._deposed(term, "the controller key changed: a write was fenced")
                raise self._standby_error(decode_controller(holder) if holder else None)
            raise _ConflictError()
        self._apply(term, plan, result.revision)

    def _confirm_office(self, term: _Term) -> None:
        """Raise the standby error (deposing ``term``) unless etcd's controller key is still
        this term's: what a guarded write checks, for a push that follows no write."""
        holder = self._store.get(CONTROLLER_KEY)
        if holder is None or holder.create_revision != term.epoch:
            self._deposed(term, "the controller key changed before a push")
            raise self._standby_error(decode_controller(holder) if holder else None)

    def _apply(self, term: _Term, plan: _Plan, revision: int) -> None:
        state = term.state
        for topic in plan.put_topics:
            term.revisions[topic_key(topic.name)] = revision
            if topic.name in state.topics:
                state.replace_topic(topic)
            else:
                state.add_topic(topic)
        for change in plan.changes:
            term.revisions[partition_key(change.topic, change.partition)] = revision
            self._log.info(
                "partition_state_changed",
                topic=change.topic,
                partition=change.partition,
                leader=change.new.leader,
                leader_epoch=change.new.leader_epoch,
                isr=list(change.new.isr),
                partition_epoch=change.new.partition_epoch,
                epoch=term.epoch,
            )
        state.apply(plan.changes)
        for name in plan.removed_topics:
            prefix = partitions_prefix(name)
            for key in [k for k in term.revisions if k.startswith(prefix)]:
                del term.revisions[key]
            term.revisions.pop(topic_key(name), None)
            state.remove_topic(name)
        for deletion in plan.put_deletions:
            term.revisions[deletion_key(deletion.topic)] = revision
            term.deletions[deletion.topic] = deletion
            term.deletion_pending[deletion.topic] = _replicas_by_broker(deletion.assignment)
        for name in plan.removed_deletions:
            term.revisions.pop(deletion_key(name), None)
            term.deletions.pop(name, None)
            term.deletion_pending.pop(name, None)
        if plan.producer_ids_next is not None:
            term.revisions[PRODUCER_IDS_KEY] = revision
            term.next_producer_id = plan.producer_ids_next

    def _decide_and_commit(self, term: _Term, decide: Callable[[], _Plan]) -> _Plan:
        """Decide, persist, apply; on a revision conflict re-read and decide once more."""
        for attempt in range(2):
            plan = decide()
            if plan.empty():
                return plan
            try:
                self._commit(term, plan)
            except _ConflictError:
                self._log.warning("write_conflict", epoch=term.epoch, attempt=attempt)
                self._load_controller_keys(term)
                continue
            return plan
        raise InvalidUpdateVersionError(
            "cluster metadata in etcd changed concurrently twice while deciding; retry"
        )

    def _schedule_resync(self, term: _Term) -> None:
        term.resync_needed = True
        self._wake.set()

    # --- reading etcd -----------------------------------------------------------------------

    def _load_controller_keys(self, term: _Term) -> None:
        """Re-read topics, partitions, deletions and producer_ids into the term (lock held)."""
        topics_kvs = self._store.get_prefix(TOPICS_PREFIX)
        partition_kvs = self._store.get_prefix(PARTITIONS_PREFIX)
        deletion_kvs = self._store.get_prefix(DELETIONS_PREFIX)
        producer_ids_kv = self._store.get(PRODUCER_IDS_KEY)
        revisions: dict[str, int] = {}
        next_producer_id = 0
        if producer_ids_kv is not None:
            next_producer_id = decode_producer_ids(producer_ids_kv)
            revisions[PRODUCER_IDS_KEY] = producer_ids_kv.mod_revision
        topics: dict[str, Topic] = {}
        for kv in topics_kvs:
            topic = decode_topic(kv)
            topics[topic.name] = topic
            revisions[kv.key] = kv.mod_revision
        partitions: dict[TopicPartition, PartitionRecord] = {}
        for kv in partition_kvs:
            name, p, record = decode_partition(kv)
            revisions[kv.key] = kv.mod_revision
            if name in topics and p < topics[name].partition_count:
                partitions[(name, p)] = record
            else:
                self._log.warning("orphan_partition_key", key=kv.key)
        deletions: dict[str, PendingDeletion] = {}
        for kv in deletion_kvs:
            deletion = decode_deletion(kv)
            deletions[deletion.topic] = deletion
            revisions[kv.key] = kv.mod_revision
        term.state.topics = topics
        term.state.partitions = partitions
        term.revisions = revisions
        term.next_producer_id = next_producer_id
        # Keep acknowledgement progress of deletions we already knew; new ones start over.
        pending: dict[str, dict[int, set[int]]] = {}
        for name, deletion in deletions.items():
            known = term.deletions.get(name)
            if known is not None and known.topic_id == deletion.topic_id:
                pending[name] = term.deletion_pending.get(name, {})
            else:
                pending[name] = _replicas_by_broker(deletion.assignment)
        term.deletions = deletions
        term.deletion_pending = pending

    def _load_cluster_id(self, term: _Term) -> None:
        kv = self._store.get(CLUSTER_ID_KEY)
        if kv is None:
            # The first controller of a cluster names it; the guard keeps a deposed one out.
            self._store.create_if_absent(
                CLUSTER_ID_KEY,
                encode_cluster_id(uuid.uuid4().hex),
                guards=[Guard(CONTROLLER_KEY, create_revision=term.epoch)],
            )
            kv = self._store.get(CLUSTER_ID_KEY)
        if kv is None:
            raise NotControllerError("could not create the cluster id: deposed")
        term.cluster_id = decode_cluster_id(kv)

    def _resync(self, term: _Term) -> None:
        """Re-read everything, watch brokers anew, reconcile, push the full state."""
        with self._lock:
            if self._term is not term or term.deposed:
                return
            term.resync_needed = False
            term.watch_generation += 1
            cancel = term.cancel_watch
            term.cancel_watch = None
        if cancel is not None:
            cancel()  # outside the lock (see the module docstring)
        with self._lock:
            if self._term is not term or term.deposed:
                return
            try:
                self._resync_locked(term)
            except (MetaStoreError, TidelogError):
                term.resync_needed = True
                raise

    def _resync_locked(self, term: _Term) -> None:
        broker_kvs, revision = self._store.get_prefix_with_revision(BROKERS_PREFIX)
        brokers: dict[int, Broker] = {}
        for kv in broker_kvs:
            try:
                broker = decode_broker(kv)
            except (ValueError, KeyError, TidelogError) as exc:
                self._log.warning("bad_broker_registration", key=kv.key, error=str(exc))
                continue
            brokers[broker.broker_id] = broker
        self._load_controller_keys(term)
        if not term.cluster_id:
            self._load_cluster_id(term)
        state = term.state
        state.replace_brokers(brokers)
        generation = term.watch_generation
        term.cancel_watch = self._store.watch_prefix(
            BROKERS_PREFIX,
            lambda event: self._on_broker_event(term, generation, event),
            on_error=lambda error: self._on_watch_error(term, generation, error),
            start_revision=revision + 1,
        )
        term.channel.set_brokers(brokers.values())
        # Reconcile. First, brokers that died and registered again unseen leave the ISRs
        # decided before they restarted (before any other write here moves those
        # partitions' revisions past their registration, and before an election could
        # pick them); then brokers that died unseen leave leaderships and ISRs, one
        # persisted decision per broker; then offline partitions with an eligible
        # replica get one.
        self._decide_and_commit(
            term,
            lambda: _Plan(
                state.evict_restarted(
                    {
                        key: revision
                        for key in state.partitions
                        if (revision := term.revisions.get(partition_key(*key))) is not None
                    }
                )
            ),
        )
        for broker_id in state.dead_replicas():

            def evict(dead: int = broker_id) -> _Plan:
                return _Plan(state.on_broker_down(dead))

            self._decide_and_commit(term, evict)
        missing = [
            change
            for topic in state.topics.values()
            for change in state.new_topic_partitions(topic)
            if change.key not in state.partitions
        ]
        if missing:
            self._decide_and_commit(term, lambda: _Plan(changes=missing))
        self._decide_and_commit(term, lambda: _Plan(state.elect_offline_partitions()))
        self._push(term, [], full_to=state.live_broker_ids)
        self._send_pending_deletions(term, state.live_broker_ids)
        term.ready = True

    # --- pushing to brokers -------------------------------------------------------------------

    def _assignment_state(
        self, term: _Term, key: TopicPartition, *, is_new: bool = False
    ) -> PartitionAssignmentState:
        topic = term.state.topics[key[0]]
        return PartitionAssignmentState(
            topic=key[0],
            partition=key[1],
            record=term.state.partitions[key],
            replicas=topic.assignment[key[1]],
            topic_id=topic.topic_id,
            configs=topic.configs,
            is_new=is_new,
        )

    def _push(
        self,
        term: _Term,
        changes: Iterable[PartitionChange],
        *,
        full_to: Iterable[int] = (),
        metadata: bool = True,
    ) -> Completion:
        """LeaderAndIsr for ``changes`` to their live replicas (and everything to
        ``full_to``), then UpdateMetadata to every broker. Lock held; never blocks."""
        state = term.state
        per_broker: dict[int, dict[TopicPartition, PartitionAssignmentState]] = {}
        for change in changes:
            if change.key not in state.partitions:
                continue
            assigned = self._assignment_state(term, change.key, is_new=change.old is None)
            for broker_id in assigned.replicas:
                if broker_id in state.brokers:
                    per_broker.setdefault(broker_id, {})[change.key] = assigned
        for broker_id in full_to:
            mine = per_broker.setdefault(broker_id, {})
            for key in state.partitions_hosted_by(broker_id):
                if key in state.partitions and key not in mine:
                    mine[key] = self._assignment_state(term, key)
        completion = Completion()
        for broker_id, states in sorted(per_broker.items()):
            term.channel.send_leader_and_isr(broker_id, list(states.values()), completion)
        if metadata:
            term.channel.send_update_metadata(
                [state.brokers[b] for b in state.live_broker_ids],
                completion,
                # Every topic (not only those with partition records): a broker deletes a
                # log whose topic this leaves out, so none that exists may be left out.
                topic_ids={name: topic.topic_id for name, topic in state.topics.items()},
            )
        return completion

    def _send_pending_deletions(
        self, term: _Term, broker_ids: Iterable[int], completion: Completion | None = None
    ) -> None:
        """StopReplica(delete) for every unacknowledged replica of a deleted topic, naming
        the deleted incarnation's topic id (a broker keeps a newer incarnation's log)."""
        wanted = set(broker_ids)
        for name, per_broker in sorted(term.deletion_pending.items()):
            deletion = term.deletions.get(name)
            for broker_id, partitions in sorted(per_broker.items()):
                if broker_id in wanted and broker_id in term.state.brokers and partitions:
                    term.channel.send_stop_replica(
                        broker_id,
                        [(name, p) for p in sorted(partitions)],
                        delete=True,
                        topic_id=deletion.topic_id if deletion is not None else "",
                        completion=completion,
                    )

    def _stop_acked(self, term: _Term, broker_id: int, partitions: list[TopicPartition]) -> None:
        """A broker deleted replicas (sender thread): note it, clean up finished deletions."""
        finished = False
        with self._lock:
            if self._term is not term:
                return
            for name, p in partitions:
                per_broker = term.deletion_pending.get(name)
                if per_broker is None or broker_id not in per_broker:
                    continue
                per_broker[broker_id].discard(p)
                if not per_broker[broker_id]:
                    del per_broker[broker_id]
                finished = finished or not per_broker
        if finished:
            self._wake.set()  # the housekeeping pass removes the deletion records

    # --- broker membership (watch thread) ----------------------------------------------------

    def _on_watch_error(self, term: _Term, generation: int, error: MetaStoreError) -> None:
        if term.watch_generation == generation:
            self._log.warning("broker_watch_failed", epoch=term.epoch, error=str(error))
            self._schedule_resync(term)

    def _on_broker_event(self, term: _Term, generation: int, event: WatchEvent) -> None:
        with self._lock:
            if self._term is not term or term.deposed or term.watch_generation != generation:
                return
            try:
                broker_id = int(event.key.removeprefix(BROKERS_PREFIX))
            except ValueError:
                self._log.warning("bad_broker_key", key=event.key)
                return
            try:
                if event.type == "delete":
                    if broker_id in term.state.brokers:
                        self._broker_down(term, broker_id)
                    return
                broker = decode_broker(_kv_from_event(event))
                known = term.state.brokers.get(broker_id)
                if known is not None and known.epoch == broker.epoch:
                    if known != broker:  # the same incarnation updated its value
                        term.state.brokers[broker_id] = broker
                        term.channel.add_broker(broker)
                        self._push(term, [])
                    return
                if known is not None:  # a new incarnation without a delete seen first
                    self._broker_down(term, broker_id)
                self._broker_up(term, broker)
            except (MetaStoreError, TidelogError, ValueError, KeyError) as exc:
                # Nothing was applied; the resync re-reads and reconciles.
                self._log.warning(
                    "broker_event_failed",
                    broker_id=broker_id,
                    event_type=event.type,
                    error=str(exc),
                )
                self._schedule_resync(term)

    def _broker_up(self, term: _Term, broker: Broker) -> None:
        state = term.state
        self._log.info(
            "broker_up", broker_id=broker.broker_id, broker_epoch=broker.epoch, epoch=term.epoch
        )
        plan = self._decide_and_commit(term, lambda: _Plan(state.on_broker_up(broker)))
        if plan.empty():
            # Nothing was written, so no guard was checked: make sure this controller still
            # holds office before a fresh broker (which takes any controller epoch) gets
            # its whole state from it.
            self._confirm_office(term)
        term.channel.add_broker(broker)
        # A (re)registered broker has no roles yet: it gets every partition it hosts.
        self._push(term, plan.changes, full_to=[broker.broker_id])
        self._send_pending_deletions(term, [broker.broker_id])

    def _broker_down(self, term: _Term, broker_id: int) -> None:
        state = term.state
        self._log.info("broker_down", broker_id=broker_id, epoch=term.epoch)
        plan = self._decide_and_commit(term, lambda: _Plan(state.on_broker_down(broker_id)))
        term.channel.remove_broker(broker_id)
        self._push(term, plan.changes)
        if any(broker_id in pending for pending in term.deletion_pending.values()):
            self._wake.set()  # a deletion waiting only for this broker now completes

    # --- housekeeping thread ------------------------------------------------------------------

    def _housekeeping_loop(self) -> None:
        interval_s = self.config.housekeeping_interval_s
        while not self._stopping.is_set():
            self._wake.wait(interval_s)
            self._wake.clear()
            term = self._term
            if term is None or term.deposed or self._stopping.is_set():
                continue
            if term.resync_needed:
                self._log.info("resync", epoch=term.epoch)
                if not self._housekeeping_step("resync", term, self._resync):
                    # The steps below would decide on a stale view. Backed off as below:
                    # the failed step scheduled another resync (it set _wake), and etcd
                    # down made this loop spin a core for the lease's TTL, thousands of
                    # attempts a second (found by an audit).
                    self._stopping.wait(min(1.0, self.config.session_ttl_s / 4))
                    continue
            # Each step on its own: one that fails every time (a deletion whose writes
            # etcd refuses, a bug) must not stop offset expiry or preferred elections.
            failed = not self._housekeeping_step("finish_deletions", term, self._finish_deletions)
            if time.monotonic() >= term.next_offset_expiry:
                term.next_offset_expiry = (
                    time.monotonic() + self.config.offsets_retention_check_interval_s
                )
                failed |= not self._housekeeping_step(
                    "expire_group_offsets", term, self._expire_group_offsets
                )
            if time.monotonic() >= term.next_imbalance_check:
                term.next_imbalance_check = (
                    time.monotonic() + self.config.imbalance_check_interval_s
                )
                failed |= not self._housekeeping_step("auto_rebalance", term, self._auto_rebalance)
            if failed:
                # Not a busy loop against an etcd that is down or a step that always fails.
                self._stopping.wait(min(1.0, self.config.session_ttl_s / 4))

    def _housekeeping_step(self, name: str, term: _Term, step: Callable[[_Term], None]) -> bool:
        """Run one housekeeping step; on failure log it, schedule a resync (the term's
        view may be stale) and return False."""
        try:
            step(term)
        except (MetaStoreError, TidelogError) as exc:
            self._log.warning("housekeeping_failed", step=name, epoch=term.epoch, error=str(exc))
        except Exception:
            self._log.exception("housekeeping_crashed", step=name, epoch=term.epoch)
        else:
            return True
        self._schedule_resync(term)
        return False

    def _finish_deletions(self, term: _Term) -> None:
        """Complete the deletions whose replicas on live brokers are all deleted.

        Replicas on brokers that are not registered are not waited for (Kafka's KRaft
        mode does not wait at all): such a broker may never return, and a deletion that
        waited for it would keep the name and the groups' offsets for ever. When it does
        return, it finds those logs stray (their topic ids are in no topic of the
        UpdateMetadata it is sent, or another incarnation's LeaderAndIsr names them;
        ``services/storage/strays.py``) and deletes them itself.
        """
        with self._lock:
            # Not before the first read of etcd: no broker would look live yet, and every
            # deletion would complete without its live replicas deleted.
            if self._term is not term or term.deposed or not term.ready:
                return
            live = term.state.brokers
            done = [
                term.deletions[name]
                for name, pending in sorted(term.deletion_pending.items())
                if name in term.deletions and not any(b in live for b in pending)
            ]
        if not done:
            return
        # The deleted topics' committed offsets go first, outside the lock (a scan of every
        # group's offsets must not hold up broker failures); the deletion record goes only
        # after, so a controller that dies in between leaves the next one to do it again.
        self._delete_group_offsets(done)
        names = [deletion.topic for deletion in done]
        with self._lock:
            if self._term is not term or term.deposed:
                return
            self._decide_and_commit(term, lambda: _Plan(removed_deletions=names))
            self._log.info("topic_deletion_completed", topics=names, epoch=term.epoch)

    def _delete_group_offsets(self, deletions: Sequence[PendingDeletion]) -> None:
        """Delete the consumer groups' committed offsets of deleted topics, as Kafka does:
        otherwise they stay in etcd for ever and their groups stay listed. Only offsets
        committed for the deleted incarnation (its topic id, or none recorded) go, each
        with a compare on its revision, so a commit for a topic created since under the
        same name is never lost."""
        ids = {deletion.topic: deletion.topic_id for deletion in deletions}
        deleted = 0
        for kv in self._store.get_prefix(GROUPS_PREFIX):
            owner = committed_offset_owner(kv)
            if owner is None or owner[0] not in ids or owner[1] not in (None, ids[owner[0]]):
                continue
            if self._store.compare_and_delete(kv.key, kv.mod_revision):
                deleted += 1
        if deleted:
            self._log.info("group_offsets_deleted", topics=sorted(ids), offsets=deleted)

    def _expire_group_offsets(self, term: _Term) -> None:
        """Delete the committed offsets of groups that have had no members for
        ``offsets_retention_ms`` and committed nothing that long (``offset_expiry``, KIP-211).
        Each group's offsets go in transactions that compare every key's revision (a commit
        since the read keeps them), its empty mark's revision, and that the group has no
        membership state (a member since keeps them).

        First, groups whose members' sessions all ended without anyone touching the group
        since (static members never leave; a killed member does not either) lose their
        membership state, as the gateway would drop them at the group's next request:
        a group's members are those with a live session key. The states are read before
        the sessions (METADATA.md 1.8: a member's session key is written before the member
        enters the state), so a group whose first member joins meanwhile is never taken
        for abandoned: either its session is seen, or its state changed since the read and
        the delete's compare fails."""
        with self._lock:
            if self._term is not term or term.deposed or not term.ready:
                return
        states = self._store.get_prefix(GROUP_STATES_PREFIX)
        live = {
            group_of_session_key(kv.key) for kv in self._store.get_prefix(GROUP_SESSIONS_PREFIX)
        }
        for kv in states:
            group = kv.key.removeprefix(GROUP_STATES_PREFIX)
            if group in live:
                continue
            timer = self._store.get(group_timer_key(group))
            emptied = self._store.txn(
                [Compare.mod_revision_is(kv.key, kv.mod_revision)],
                [
                    DeleteOp(kv.key),
                    DeleteOp(group_fence_key(group)),
                    DeleteOp(group_timer_key(group)),
                ],
            )
            if emptied.succeeded:
                self._log.info("group_sessions_all_ended", group=unquote(group))
                if timer is not None and timer.lease_id:
                    # Gone with the state: its lease (the rebalance timeout, up to days)
                    # is not left to live on in etcd (the gateway does the same).
                    with contextlib.suppress(TidelogError):
                        self._store.revoke_lease_id(timer.lease_id)
        marks = {
            kv.key.removeprefix(GROUP_EMPTIED_PREFIX): kv
            for kv in self._store.get_prefix(GROUP_EMPTIED_PREFIX)
        }
        offsets = [
            StoredOffset(
                key=kv.key,
                group=group_of_offset_key(kv.key),
                commit_time_ms=committed_offset_time_ms(kv),
                mod_revision=kv.mod_revision,
            )
            for kv in self._store.get_prefix(GROUPS_PREFIX)
            if committed_offset_owner(kv) is not None
        ]
        now_ms = int(time.time() * 1000)
        decision = decide_expiry(
            offsets,
            live,
            {g: _emptied_at_ms(kv) for g, kv in marks.items()},
            now_ms,
            self.config.offsets_retention_ms,
        )
        for group in sorted(decision.to_mark):
            # Only while the group is still without a state (no member since the read).
            self._store.txn(
                [Compare.absent(group_state_key(group)), Compare.absent(group_emptied_key(group))],
                [PutOp(group_emptied_key(group), str(now_ms).encode())],
            )
        for group in sorted(decision.stale_marks):
            kv = marks[group]
            self._store.txn([Compare.mod_revision_is(kv.key, kv.mod_revision)], [DeleteOp(kv.key)])
        for group, stored in sorted(decision.expired.items()):
            mark = marks[group]
            deleted = 0
            for start in range(0, len(stored), EXPIRY_KEYS_PER_TXN):
                chunk = stored[start : start + EXPIRY_KEYS_PER_TXN]
                compares = [
                    Compare.absent(group_state_key(group)),
                    Compare.mod_revision_is(mark.key, mark.mod_revision),
                ]
                compares += [Compare.mod_revision_is(o.key, o.mod_revision) for o in chunk]
                if self._store.txn(compares, [DeleteOp(o.key) for o in chunk]).succeeded:
                    deleted += len(chunk)
            if deleted == len(stored):
                self._store.txn(
                    [Compare.mod_revision_is(mark.key, mark.mod_revision)], [DeleteOp(mark.key)]
                )
            if deleted:
                self._log.info("group_offsets_expired", group=unquote(group), offsets=deleted)

    def _auto_rebalance(self, term: _Term) -> None:
        """Kafka's auto.leader.rebalance: preferred elections where a broker is imbalanced."""
        with self._lock:
            if self._term is not term or term.deposed:
                return
            state = term.state
            chosen = state.imbalanced_partitions(self.config.leader_imbalance_percentage)
            if not chosen:
                return
            plan = self._decide_and_commit(
                term, lambda: _Plan(state.elect(ElectionType.PREFERRED, chosen)[0])
            )
            if plan.changes:
                self._log.info(
                    "auto_preferred_election",
                    partitions=[f"{c.topic}-{c.partition}" for c in plan.changes],
                    epoch=term.epoch,
                )
                self._push(term, plan.changes)

    # --- waiting ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked_within(self, wait_s: float) -> Iterator[None]:
        """The controller's lock for an admin change, waited for at most the request's
        timeout: another change holds it while it writes to etcd (up to the store's
        timeout when etcd is slow), and a call waited behind it past its own timeout
        (found by an audit). Nothing is changed when it times out."""
        if not self._lock.acquire(timeout=max(wait_s, MIN_LOCK_WAIT_S)):
            raise RequestTimedOutError(
                "the controller is busy writing another change to etcd; nothing was changed: retry"
            )
        try:
            yield
        finally:
            self._lock.release()

    def _wait_s(self, timeout_ms: int) -> float:
        if timeout_ms < 0:
            raise InvalidRequestError(f"timeout_ms must be >= 0, got {timeout_ms}")
        return min(timeout_ms or self.config.default_wait_ms, self.config.max_wait_ms) / 1000

    def _check_count(self, what: str, count: int, limit: int) -> None:
        if count > limit:
            raise InvalidRequestError(f"{count} {what} in one request; the limit is {limit}")

    def _check_new_partitions(self, per_topic: Iterable[int]) -> None:
        """The request's new partitions against max_partitions_per_request. A topic over
        the per-topic limit counts as that limit: it is refused on its own, unplaced."""
        cap = self.config.max_partitions_per_topic
        self._check_count(
            "new partitions",
            sum(min(max(count, 0), cap) for count in per_topic),
            self.config.max_partitions_per_request,
        )

    # --- CreateTopics -------------------------------------------------------------------------

    def create_topics(
        self, topics: Sequence[NewTopic], *, validate_only: bool = False, timeout_ms: int = 0
    ) -> list[CreatedTopic]:
        """Create each topic in its own transaction; per-topic errors; nothing half-made.

        With ``validate_only`` everything is checked and nothing written. Otherwise waits
        up to the timeout for the replicas to acknowledge their new partitions (a topic
        whose brokers are slow to answer is still created: the answer does not change).
        """

        self._check_new_partitions(max(t.num_partitions, len(t.assignments)) for t in topics)

        def create(term: _Term, request: NewTopic) -> tuple[CreatedTopic, Completion | None]:
            if validate_only:
                return CreatedTopic(request.name, None, self._new_topic(term, request)), None
            made: list[Topic] = []

            def decide() -> _Plan:
                topic = self._new_topic(term, request)
                made[:] = [topic]
                return _Plan(changes=term.state.new_topic_partitions(topic), put_topics=[topic])

            plan = self._decide_and_commit(term, decide)
            self._log.info(
                "topic_created",
                topic=request.name,
                topic_id=made[0].topic_id,
                partitions=made[0].partition_count,
                replication_factor=made[0].replication_factor,
                epoch=term.epoch,
            )
            return CreatedTopic(request.name, None, made[0]), self._push(term, plan.changes)

        return self._each_topic(
            topics, lambda t: t.name, create, CreatedTopic, timeout_ms=timeout_ms
        )

    def _new_topic(self, term: _Term, request: NewTopic) -> Topic:
        """Validate a creation against the current state; the Topic it would create."""
        state = term.state
        validate_topic_name(request.name)
        if request.name in state.topics:
            raise TopicAlreadyExistsError(f"topic {request.name!r} already exists")
        if request.name in term.deletions:
            raise TopicAlreadyExistsError(
                f"topic {request.name!r} is being deleted (a live replica's broker has not "
                "confirmed yet); retry once the deletion completes"
            )
        # Kafka's rule: names equal once '.' is read as '_' collide (metric names, and
        # the tools that build them, cannot tell them apart).
        folded = request.name.replace(".", "_")
        for existing in state.topics:
            if existing.replace(".", "_") == folded:
                raise InvalidTopicError(
                    f"topic {request.name!r} collides with existing topic {existing!r} "
                    "('.' and '_' are the same character in metric names)"
                )
        brokers = [b for b in state.live_broker_ids if b not in state.shutting_down]
        if request.assignments:
            assignment = _explicit_assignment(request.assignments, first=0)
            if request.num_partitions not in (0, -1, len(assignment)):
                raise InvalidReplicaAssignmentError(
                    f"num_partitions is {request.num_partitions} but the explicit assignment "
                    f"places {len(assignment)} partitions"
                )
            replication_factor = len(assignment[0])
            if request.replication_factor not in (0, -1, replication_factor):
                raise InvalidReplicaAssignmentError(
                    f"replication_factor is {request.replication_factor} but the explicit "
                    f"assignment gives {replication_factor} replicas per partition"
                )
            self._check_partition_count(len(assignment))
            validate_assignment(assignment, brokers, replication_factor)
        else:
            if request.num_partitions < 1:
                raise InvalidPartitionsError(
                    f"number of partitions must be at least 1, got {request.num_partitions}"
                )
            self._check_partition_count(request.num_partitions)
            replication_factor = request.replication_factor
            if replication_factor < 1:
                raise InvalidReplicationFactorError(
                    f"replication factor must be at least 1, got {replication_factor}"
                )
            if replication_factor > len(brokers):
                raise InvalidReplicationFactorError(
                    f"replication factor {replication_factor} is larger than the "
                    f"{len(brokers)} live brokers {brokers}"
                )
            assignment = None
        configs = validate_topic_configs(request.configs, replication_factor)
        if assignment is None:
            assignment = assign_replicas(
                brokers,
                request.num_partitions,
                replication_factor,
                racks=_racks(state, brokers),
            )
        return Topic(
            name=request.name,
            topic_id=uuid.uuid4().hex,
            assignment=tuple(tuple(replicas) for replicas in assignment),
            configs=configs,
        )

    def _check_partition_count(self, count: int) -> None:
        if count > self.config.max_partitions_per_topic:
            raise InvalidPartitionsError(
                f"{count} partitions; a topic may have at most "
                f"{self.config.max_partitions_per_topic}"
            )

    # --- DeleteTopics -------------------------------------------------------------------------

    def delete_topics(self, names: Sequence[str], *, timeout_ms: int = 0) -> list[TopicOutcome]:
        """Delete topics (one transaction each) and have their replicas deleted.

        The topic key and its partition keys go, and ``deletions/<t>`` records the
        replicas still to delete, in one transaction. Waits up to the timeout for live
        replicas to confirm; the deletion completes (the name is reusable, the groups'
        offsets are gone) once every replica on a live broker confirmed. Replicas on
        brokers that are down are not waited for: a returning broker deletes them as
        strays (``_finish_deletions``).
        """

        def delete(term: _Term, name: str) -> tuple[TopicOutcome, Completion | None]:
            validate_topic_name(name)

            def decide() -> _Plan:
                topic = term.state.topics.get(name)
                if topic is None:
                    raise UnknownTopicOrPartitionError(f"topic {name!r} does not exist")
                return _Plan(
                    removed_topics=[name],
                    put_deletions=[PendingDeletion(name, topic.topic_id, topic.assignment)],
                )

            self._decide_and_commit(term, decide)
            self._log.info("topic_deleted", topic=name, epoch=term.epoch)
            return TopicOutcome(name, None), None

        def send_deletions(term: _Term, outcomes: list[TopicOutcome]) -> Completion | None:
            # Once for the whole request: the StopReplica requests name every pending
            # deletion, and the brokers learn at once that the topics are gone.
            if all(outcome.error is not None for outcome in outcomes):
                return None
            completion = Completion()
            self._send_pending_deletions(term, term.state.live_broker_ids, completion)
            self._push(term, [], metadata=True)
            return completion

        return self._each_topic(
            names,
            lambda name: name,
            delete,
            TopicOutcome,
            timeout_ms=timeout_ms,
            then=send_deletions,
        )

    # --- CreatePartitions ---------------------------------------------------------------------

    def create_partitions(
        self,
        increases: Sequence[NewPartitions],
        *,
        validate_only: bool = False,
        timeout_ms: int = 0,
    ) -> list[TopicOutcome]:
        """Grow topics' partition counts (never shrink); per-topic errors."""
        self._check_count("topics", len(increases), self.config.max_topics_per_request)
        with self._locked_within(self._wait_s(timeout_ms)):
            topics = self._require_active().state.topics
            current = {
                i.name: topics[i.name].partition_count for i in increases if i.name in topics
            }
        self._check_new_partitions(
            max(i.count - current.get(i.name, 0), len(i.assignments)) for i in increases
        )

        def grow(term: _Term, request: NewPartitions) -> tuple[TopicOutcome, Completion | None]:
            if validate_only:
                self._grown_topic(term, request)
                return TopicOutcome(request.name, None), None

            def decide() -> _Plan:
                old, grown = self._grown_topic(term, request)
                return _Plan(
                    changes=term.state.new_topic_partitions(
                        grown, first_partition=old.partition_count
                    ),
                    put_topics=[grown],
                )

            plan = self._decide_and_commit(term, decide)
            self._log.info(
                "partitions_created", topic=request.name, partitions=request.count, epoch=term.epoch
            )
            return TopicOutcome(request.name, None), self._push(term, plan.changes)

        return self._each_topic(
            increases, lambda i: i.name, grow, TopicOutcome, timeout_ms=timeout_ms
        )

    def alter_topic_configs(
        self,
        changes: Sequence[ConfigChange],
        *,
        validate_only: bool = False,
        timeout_ms: int = 0,
    ) -> list[ConfigOutcome]:
        """Set and remove topics' config overrides; per-topic errors, each topic all or
        nothing. The replicas get the new settings in a LeaderAndIsr at the partitions'
        current epochs (a broker applies a changed config to its logs at once)."""

        def alter(term: _Term, change: ConfigChange) -> tuple[ConfigOutcome, Completion | None]:
            if validate_only:
                return ConfigOutcome(
                    change.name, None, self._altered_topic(term, change).configs
                ), None

            def decide() -> _Plan:
                altered = self._altered_topic(term, change)
                if altered == term.state.topics[change.name]:
                    return _Plan()  # nothing to write (setting what is set)
                elected = []
                if altered.unclean_leader_election:
                    elected = term.state.elect_offline_partitions_of(altered)
                return _Plan(changes=elected, put_topics=[altered])

            plan = self._decide_and_commit(term, decide)
            topic = term.state.topics[change.name]
            outcome = ConfigOutcome(change.name, None, dict(topic.configs))
            if plan.empty():
                return outcome, None
            self._log.info(
                "topic_configs_altered",
                topic=change.name,
                set=dict(change.set),
                deleted=list(change.delete),
                unclean_elections=[c.partition for c in plan.changes],
                epoch=term.epoch,
            )
            unchanged = [
                PartitionChange(change.name, p, record, record)
                for p in range(topic.partition_count)
                if (record := term.state.partitions.get((change.name, p))) is not None
            ]
            return outcome, self._push(term, unchanged)

        return self._each_topic(
            changes, lambda c: c.name, alter, ConfigOutcome, timeout_ms=timeout_ms
        )

    def _each_topic(
        self,
        items: Sequence[_Item],
        name_of: Callable[[_Item], str],
        apply: Callable[[_Term, _Item], tuple[_Outcome, Completion | None]],
        failed: Callable[[str, TidelogError], _Outcome],
        *,
        timeout_ms: int,
        then: Callable[[_Term, list[_Outcome]], Completion | None] | None = None,
    ) -> list[_Outcome]:
        """The frame of the per-topic admin requests: ``apply`` each item under the lock
        (its own transaction), an error outcome per refused item, and a wait of at most
        the timeout for the brokers to acknowledge what the items pushed.

        A topic named twice in the request is refused in every entry (``_duplicated``).
        ``NotControllerError`` ends the whole request: the client asks the new controller,
        and what was committed before stays (each topic is its own transaction). ``then``
        runs under the lock after every item, with the outcomes.
        """
        self._check_count("topics", len(items), self.config.max_topics_per_request)
        wait_s = self._wait_s(timeout_ms)
        outcomes: list[_Outcome] = []
        completions: list[Completion] = []
        duplicated = _duplicated(name_of(item) for item in items)
        with self._locked_within(wait_s):
            term = self._require_active()
            for item in items:
                name = name_of(item)
                try:
                    if name in duplicated:
                        raise InvalidRequestError(
                            f"topic {name!r} appears more than once in the request"
                        )
                    outcome, completion = apply(term, item)
                except NotControllerError:
                    raise
                except TidelogError as exc:  # MetaStoreError included
                    outcomes.append(failed(name, exc))
                    continue
                outcomes.append(outcome)
                if completion is not None:
                    completions.append(completion)
            if then is not None and (completion := then(term, outcomes)) is not None:
                completions.append(completion)
        _wait_all(completions, wait_s)
        return outcomes

    def _altered_topic(self, term: _Term, change: ConfigChange) -> Topic:
        validate_topic_name(change.name)
        old = term.state.topics.get(change.name)
        if old is None or change.name in term.deletions:
            raise UnknownTopicOrPartitionError(f"topic {change.name!r} does not exist")
        names = [name for name, _ in change.set] + list(change.delete)
        if len(names) > MAX_CONFIG_ENTRIES:
            raise InvalidRequestError(
                f"{len(names)} config changes for topic {change.name!r}; the limit is "
                f"{MAX_CONFIG_ENTRIES}"
            )
        repeated = sorted(name for name, count in Counter(names).items() if count > 1)
        if repeated:
            raise InvalidRequestError(
                f"config {repeated[0]!r} is named more than once in the change of topic "
                f"{change.name!r}"
            )
        unknown = sorted(set(change.delete) - set(TOPIC_CONFIG_DEFAULTS))
        if unknown:
            # Refused as in a SET: a typo must not pass as "nothing to remove".
            raise InvalidConfigError(
                f"unknown topic config {unknown[0]!r}; known configs: "
                f"{', '.join(sorted(TOPIC_CONFIG_DEFAULTS))}"
            )
        overrides = {k: v for k, v in old.configs.items() if k not in change.delete}
        overrides.update(change.set)
        configs = validate_topic_configs(overrides, old.replication_factor)
        return dataclasses.replace(old, configs=configs)

    def _grown_topic(self, term: _Term, request: NewPartitions) -> tuple[Topic, Topic]:
        state = term.state
        validate_topic_name(request.name)
        old = state.topics.get(request.name)
        if old is None:
            raise UnknownTopicOrPartitionError(f"topic {request.name!r} does not exist")
        if request.count <= old.partition_count:
            raise InvalidPartitionsError(
                f"topic {request.name!r} has {old.partition_count} partitions; the count can "
                f"only grow (asked for {request.count})"
            )
        self._check_partition_count(request.count)
        brokers = [b for b in state.live_broker_ids if b not in state.shutting_down]
        if request.assignments:
            added = _explicit_assignment(request.assignments, first=old.partition_count)
            if old.partition_count + len(added) != request.count:
                raise InvalidReplicaAssignmentError(
                    f"the assignment places {len(added)} new partitions, but growing "
                    f"{old.partition_count} to {request.count} adds "
                    f"{request.count - old.partition_count}"
                )
            validate_assignment(added, brokers, old.replication_factor)
        else:
            added = extend_assignment(
                old.assignment, brokers, request.count, racks=_racks(state, brokers)
            )
        grown = Topic(
            name=old.name,
            topic_id=old.topic_id,
            assignment=old.assignment + tuple(tuple(replicas) for replicas in added),
            configs=old.configs,
        )
        return old, grown

    # --- reads ------------------------------------------------------------------------------

    def describe_cluster(self) -> ClusterView:
        with self._lock:
            term = self._require_active()
            return self._cluster_view(term)

    def _cluster_view(self, term: _Term) -> ClusterView:
        state = term.state
        return ClusterView(
            cluster_id=term.cluster_id,
            controller_id=self.config.controller_id,
            controller_address=self.config.advertised_address,
            controller_epoch=term.epoch,
            brokers=tuple(state.brokers[b] for b in state.live_broker_ids),
        )

    def metadata(self, topics: Sequence[str] = ()) -> tuple[ClusterView, list[TopicView]]:
        """The cluster and the requested topics (empty: all), from memory."""
        self._check_count("topics", len(topics), self.config.max_topics_per_request)
        with self._lock:
            term = self._require_active()
            state = term.state
            names = list(topics) if topics else sorted(state.topics)
            views = []
            for name in names:
                topic = state.topics.get(name)
                if topic is None:
                    error: TidelogError
                    try:
                        validate_topic_name(name)
                        error = UnknownTopicOrPartitionError(f"topic {name!r} does not exist")
                    except InvalidTopicError as exc:
                        error = exc
                    views.append(TopicView(name, error))
                    continue
                views.append(
                    TopicView(
                        name,
                        None,
                        topic,
                        tuple(
                            PartitionView(name, p, state.partitions[(name, p)], replicas)
                            for p, replicas in enumerate(topic.assignment)
                            if (name, p) in state.partitions
                        ),
                    )
                )
            return self._cluster_view(term), views

    # --- AlterPartition ---------------------------------------------------------------------

    def alter_partition(
        self, broker_id: int, broker_epoch: int, proposals: Sequence[IsrProposal]
    ) -> list[IsrOutcome]:
        """ISR changes asked by a leader, fenced by leader, partition and broker epochs.

        All accepted proposals are written in one transaction. Every outcome carries the
        state in force afterwards, so a leader whose proposal lost learns the current one.
        """
        self._check_count("partitions", len(proposals), self.config.max_partitions_per_request)
        with self._lock:
            term = self._require_active()
            state = term.state
            errors: dict[int, TidelogError] = {}

            # A partition named twice is refused in every entry, as the topic requests
            # refuse a repeated topic (``_duplicated``): applying the first would let a
            # malformed request change the ISR.
            repeated = {
                key
                for key, count in Counter((p.topic, p.partition) for p in proposals).items()
                if count > 1
            }

            def decide() -> _Plan:
                errors.clear()
                changes = []
                for index, item in enumerate(proposals):
                    try:
                        if (item.topic, item.partition) in repeated:
                            raise InvalidRequestError(
                                f"{item.topic}-{item.partition} appears more than once in the "
                                "request"
                            )
                        changes.append(
                            state.alter_partition(
                                broker_id=broker_id,
                                broker_epoch=broker_epoch,
                                topic=item.topic,
                                partition=item.partition,
                                leader_epoch=item.leader_epoch,
                                new_isr=item.new_isr,
                                partition_epoch=item.partition_epoch,
                                joining=dict(item.joining),
                            )
                        )
                    except TidelogError as exc:
                        errors[index] = exc
                return _Plan(changes=changes)

            plan = self._decide_and_commit(term, decide)
            if plan.changes:
                self._push(term, plan.changes)
            outcomes = []
            for index, item in enumerate(proposals):
                key = (item.topic, item.partition)
                view = None
                if key in state.partitions:
                    view = PartitionView(
                        item.topic,
                        item.partition,
                        state.partitions[key],
                        state.topics[item.topic].assignment[item.partition],
                    )
                outcomes.append(IsrOutcome(item.topic, item.partition, errors.get(index), view))
            return outcomes

    # --- ControlledShutdown -------------------------------------------------------------------

    def controlled_shutdown(self, broker_id: int, broker_epoch: int) -> list[TopicPartition]:
        """Move leaderships off a stopping broker; the partitions it still must lead."""
        with self._lock:
            term = self._require_active()
            state = term.state
            remaining: list[TopicPartition] = []

            def decide() -> _Plan:
                changes, stuck = state.controlled_shutdown(broker_id, broker_epoch)
                remaining[:] = stuck
                return _Plan(changes=changes)

            plan = self._decide_and_commit(term, decide)
            self._log.info(
                "controlled_shutdown",
                broker_id=broker_id,
                moved=len(plan.changes),
                remaining=len(remaining),
                epoch=term.epoch,
            )
            if plan.changes:
                self._push(term, plan.changes)
            return list(remaining)

    # --- AllocateProducerIds -----------------------------------------------------------------

    def allocate_producer_ids(self, broker_id: int, broker_epoch: int) -> ProducerIdBlock:
        """A fresh block of producer ids (Kafka's AllocateProducerIds, KIP-730).

        ``broker_id`` -1 is a gateway or client; otherwise the broker must be registered
        with ``broker_epoch`` (StaleBrokerEpochError). The block is handed out only after
        ``producer_ids`` was advanced past it in a guarded compare-and-swap, so no id is
        ever given twice, across controller terms too.
        """
        if broker_id < -1:
            raise InvalidRequestError(f"broker_id {broker_id}: a broker id or -1")
        with self._lock:
            term = self._require_active()
            if broker_id >= 0:
                broker = term.state.brokers.get(broker_id)
                if broker is None or broker.epoch != broker_epoch:
                    raise StaleBrokerEpochError(
                        f"broker {broker_id} with epoch {broker_epoch} is not the registered "
                        "incarnation"
                    )
            block: list[ProducerIdBlock] = []

            def decide() -> _Plan:
                start = term.next_producer_id
                if start > MAX_PRODUCER_ID - PRODUCER_ID_BLOCK_SIZE + 1:
                    raise UnknownServerError("the producer id space is exhausted")
                block[:] = [ProducerIdBlock(start, PRODUCER_ID_BLOCK_SIZE)]
                return _Plan(producer_ids_next=start + PRODUCER_ID_BLOCK_SIZE)

            self._decide_and_commit(term, decide)
            self._log.info(
                "producer_ids_allocated",
                broker_id=broker_id,
                start=block[0].start,
                length=block[0].length,
                epoch=term.epoch,
            )
            return block[0]

    # --- ElectLeaders -------------------------------------------------------------------------

    def elect_leaders(
        self,
        election: ElectionType,
        partitions: Sequence[TopicPartition] = (),
        *,
        timeout_ms: int = 0,
    ) -> list[ElectionOutcome]:
        """Preferred or unclean elections, per partition; ``()`` = every partition
        (preferred elections only).

        For "every partition" only partitions where something happened (or failed for a
        reason other than ELECTION_NOT_NEEDED) are reported. UNCLEAN follows Kafka
        (KIP-460): an explicit request may elect an out-of-sync replica of any topic, but
        only for a partition that has no leader. It must name its partitions: an empty
        list cannot be told from a filter that matched nothing, and an unclean election
        everywhere may lose acknowledged records of topics that never opted in.
        """
        self._check_count("partitions", len(partitions), self.config.max_partitions_per_request)
        if election is ElectionType.UNCLEAN and not partitions:
            raise InvalidRequestError(
                "an unclean election must name its partitions (it may lose acknowledged "
                "records); an empty list means every partition for preferred elections only"
            )
        wait_s = self._wait_s(timeout_ms)
        with self._locked_within(wait_s):
            term = self._require_active()
            state = term.state
            everything = not partitions
            wanted = sorted(state.partitions) if everything else list(partitions)
            invalid: dict[TopicPartition, TidelogError] = {}
            for name, p in wanted:
                try:
                    validate_topic_name(name)
                    if not 0 <= p <= MAX_PARTITION:
                        raise UnknownTopicOrPartitionError(f"partition {p} is out of range")
                except TidelogError as exc:
                    invalid[(name, p)] = exc
            errors: dict[TopicPartition, TidelogError] = {}

            def decide() -> _Plan:
                errors.clear()
                valid = [key for key in dict.fromkeys(wanted) if key not in invalid]
                changes, found = state.elect(election, valid)
                errors.update(found)
                return _Plan(changes=changes)

            plan = self._decide_and_commit(term, decide)
            errors.update(invalid)
            completion = self._push(term, plan.changes) if plan.changes else Completion()
            if plan.changes:
                self._log.info(
                    "leaders_elected",
                    election=election.value,
                    partitions=[f"{c.topic}-{c.partition}" for c in plan.changes],
                    epoch=term.epoch,
                )
        completion.wait(wait_s)
        outcomes = []
        for key in dict.fromkeys(wanted):
            error = errors.get(key)
            if everything and isinstance(error, ElectionNotNeededError):
                continue
            outcomes.append(ElectionOutcome(key[0], key[1], error))
        return outcomes


# --- helpers ---------------------------------------------------------------------------------


def _wait_all(completions: Iterable[Completion], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for completion in completions:
        if not completion.wait(deadline - time.monotonic()):
            return


def _replicas_by_broker(assignment: Sequence[Sequence[int]]) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for p, replicas in enumerate(assignment):
        for broker_id in replicas:
            out.setdefault(broker_id, set()).add(p)
    return out


def _racks(state: ClusterState, brokers: Sequence[int]) -> dict[int, str | None] | None:
    """Rack-aware placement when every broker has a rack; rack-unaware otherwise.

    A mix (some brokers without a rack) falls back to rack-unaware placement rather than
    refusing to create topics: a missing --rack on one broker should not stop the cluster.
    """
    racks = {b: state.brokers[b].rack or None for b in brokers}
    if all(rack is not None for rack in racks.values()):
        return racks
    if any(rack is not None for rack in racks.values()):
        _log.warning("rack_unaware_placement", reason="some brokers have no rack", racks=str(racks))
    return None


def _explicit_assignment(
    assignments: Sequence[tuple[int, tuple[int, ...]]], *, first: int
) -> list[list[int]]:
    """The replica lists of an explicit placement of partitions ``first, first+1, ...``."""
    by_partition: dict[int, list[int]] = {}
    for partition, replicas in assignments:
        if partition in by_partition:
            raise InvalidReplicaAssignmentError(f"partition {partition} is assigned twice")
        by_partition[partition] = list(replicas)
    expected = list(range(first, first + len(by_partition)))
    if sorted(by_partition) != expected:
        raise InvalidReplicaAssignmentError(
            f"the assignment must place partitions {first}..{first + len(by_partition) - 1} "
            f"exactly once, got {sorted(by_partition)}"
        )
    assignment = [by_partition[p] for p in expected]
    if not assignment[0]:
        raise InvalidReplicaAssignmentError(f"partition {first} has no replicas")
    return assignment


__all__ = [
    "ClusterView",
    "Controller",
    "ControllerConfig",
    "CreatedTopic",
    "ElectionOutcome",
    "IsrOutcome",
    "IsrProposal",
    "NewPartitions",
    "NewTopic",
    "PartitionView",
    "StandbyError",
    "TopicOutcome",
    "TopicView",
]
