"""The controller's partition state machine: pure decisions about leaders and ISRs.

Like etcd's raft package, this module does no I/O, starts no threads and never sleeps: it
holds the cluster state as plain data and turns events (a broker registered or expired, a
leader asked to change its ISR, a broker shutting down, an election requested) into
``PartitionChange`` lists. The controller service persists each change to etcd with a
compare-and-swap and pushes LeaderAndIsr / UpdateMetadata to the brokers; only then does
it ``apply`` the change here. That split is what lets the simulation tests drive this code
deterministically.

Rules (Kafka's, DESIGN §4):

- A partition's leader is chosen from its ISR, in assignment order, among live brokers.
  Only a topic with ``unclean.leader.election.enable=true`` may elect a live replica
  outside the ISR (and that may lose acknowledged data, which is why it is off).
- Every leader change increments ``leader_epoch``; every change of any kind increments
  ``partition_epoch`` (the version AlterPartition requests are checked against).
- A dead broker leaves the ISR, except that the ISR never becomes empty: when the last
  in-sync replica dies the partition goes offline (leader -1) keeping that replica in the
  ISR, so that the replica that holds every acknowledged record is the one elected when
  it returns.
- The ISR always contains the leader (when there is one) and only assigned replicas.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tidelog.errors import (
    BrokerNotAvailableError,
    ElectionNotNeededError,
    EligibleLeadersNotAvailableError,
    FencedLeaderEpochError,
    InvalidRequestError,
    InvalidUpdateVersionError,
    NotControllerError,
    NotLeaderOrFollowerError,
    PreferredLeaderNotAvailableError,
    StaleBrokerEpochError,
    TidelogError,
    UnknownTopicOrPartitionError,
)

NO_LEADER = -1

LEADER_IMBALANCE_PERCENTAGE = 10
"""Kafka's leader.imbalance.per.broker.percentage: rebalance once more than this share of
a broker's preferred partitions are led by someone else."""

TopicPartition = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Broker:
    """A live, registered broker."""

    broker_id: int
    host: str
    port: int
    rack: str = ""
    epoch: int = 0  # registration epoch (etcd create revision of its key)


@dataclass(frozen=True, slots=True)
class Topic:
    """A topic's static description; ``assignment[p]`` lists partition p's replicas."""

    name: str
    topic_id: str
    assignment: tuple[tuple[int, ...], ...]
    configs: Mapping[str, str] = field(default_factory=dict)

    @property
    def partition_count(self) -> int:
        return len(self.assignment)

    @property
    def replication_factor(self) -> int:
        return len(self.assignment[0]) if self.assignment else 0

    @property
    def unclean_leader_election(self) -> bool:
        return self.configs.get("unclean.leader.election.enable", "false").lower() == "true"

    @property
    def min_insync_replicas(self) -> int:
        return int(self.configs.get("min.insync.replicas", "1"))


@dataclass(frozen=True, slots=True)
class PartitionRecord:
    """What etcd holds under ``partitions/<topic>/<p>``.

    ``isr_epochs``: the broker epoch of each ISR member (same order) as the controller
    knew it when it wrote the record (-1: not registered then; empty: written before
    they were kept). Not part of the record's identity (``compare=False``): decisions
    compare the rest. It tells a member that restarted unseen (``evict_restarted``) even
    when the record was written after the restart.
    """

    leader: int
    leader_epoch: int
    isr: tuple[int, ...]
    partition_epoch: int
    isr_epochs: tuple[int, ...] = field(default=(), compare=False)

    def stamped(self, brokers: Mapping[int, Broker]) -> PartitionRecord:
        """This record with ``isr_epochs`` taken from ``brokers`` (the registrations)."""
        epochs = tuple(brokers[b].epoch if b in brokers else -1 for b in self.isr)
        return dataclasses.replace(self, isr_epochs=epochs)

    def epoch_of(self, broker_id: int) -> int:
        """The broker epoch ``broker_id`` had when this record was written; -1: unknown."""
        if len(self.isr_epochs) == len(self.isr) and broker_id in self.isr:
            return self.isr_epochs[self.isr.index(broker_id)]
        return -1

    def is_online(self) -> bool:
        return self.leader != NO_LEADER


@dataclass(frozen=True, slots=True)
class PartitionChange:
    """A decided transition of one partition, from ``old`` (None: new partition) to ``new``."""

    topic: str
    partition: int
    old: PartitionRecord | None
    new: PartitionRecord

    @property
    def key(self) -> TopicPartition:
        return self.topic, self.partition

    @property
    def leader_changed(self) -> bool:
        return self.old is None or self.old.leader != self.new.leader


class ElectionType(enum.Enum):
    PREFERRED = "preferred"
    UNCLEAN = "unclean"


def _next(old: PartitionRecord, leader: int, isr: Sequence[int]) -> PartitionRecord:
    """The successor record: epochs bumped as the rules say."""
    return PartitionRecord(
        leader=leader,
        leader_epoch=old.leader_epoch + (1 if leader != old.leader else 0),
        isr=tuple(isr),
        partition_epoch=old.partition_epoch + 1,
    )


@dataclass
class ClusterState:
    """Brokers, topics and partition records as the active controller knows them.

    Invariants: every partition record belongs to a known topic; a record's ISR is a
    non-empty subset of the partition's replicas and contains its leader when online.
    Thread-safety: none; the controller service owns one instance behind its lock.
    """

    brokers: dict[int, Broker] = field(default_factory=dict)
    topics: dict[str, Topic] = field(default_factory=dict)
    partitions: dict[TopicPartition, PartitionRecord] = field(default_factory=dict)
    # Brokers in controlled shutdown: alive, but never chosen as leaders.
    shutting_down: set[int] = field(default_factory=set)

    # --- queries ----------------------------------------------------------------------

    @property
    def live_broker_ids(self) -> list[int]:
        return sorted(self.brokers)

    def replicas(self, topic: str, partition: int) -> tuple[int, ...]:
        return self.topics[topic].assignment[partition]

    def record(self, topic: str, partition: int) -> PartitionRecord:
        try:
            return self.partitions[(topic, partition)]
        except KeyError:
            raise UnknownTopicOrPartitionError(
                f"partition {topic}-{partition} does not exist"
            ) from None

    def partitions_of(self, topic: str) -> list[TopicPartition]:
        return [(topic, p) for p in range(self.topics[topic].partition_count)]

    def partitions_hosted_by(self, broker_id: int) -> list[TopicPartition]:
        return [
            (name, p)
            for name, topic in sorted(self.topics.items())
            for p, replicas in enumerate(topic.assignment)
            if broker_id in replicas
        ]

    def _eligible(self, broker_id: int) -> bool:
        return broker_id in self.brokers and broker_id not in self.shutting_down

    # --- the election rule ----------------------------------------------------------------

    def _elect(
        self, topic: Topic, partition: int, isr: Sequence[int], *, allow_unclean: bool
    ) -> tuple[int, tuple[int, ...]]:
        """(leader, isr) after an election among ``isr``; NO_LEADER when nobody qualifies.

        The first eligible ISR member in assignment order wins, which makes the preferred
        replica the leader whenever it is in sync. Unclean: the first eligible replica,
        whose ISR then restarts as just itself.
        """
        replicas = topic.assignment[partition]
        for broker_id in replicas:
            if broker_id in isr and self._eligible(broker_id):
                return broker_id, tuple(isr)
        if allow_unclean:
            for broker_id in replicas:
                if self._eligible(broker_id):
                    return broker_id, (broker_id,)
        return NO_LEADER, tuple(isr)

    # --- topics -------------------------------------------------------------------------

    def new_topic_partitions(self, topic: Topic, first_partition: int = 0) -> list[PartitionChange]:
        """Initial records for partitions ``[first_partition, count)`` of ``topic``.

        The ISR starts as the live replicas (an empty new log is trivially in sync); the
        leader is the first live one, normally the preferred replica.
        """
        changes = []
        for p in range(first_partition, topic.partition_count):
            replicas = topic.assignment[p]
            live = tuple(b for b in replicas if b in self.brokers)
            isr = live or replicas[:1]
            leader = next((b for b in replicas if self._eligible(b)), NO_LEADER)
            record = PartitionRecord(
                leader=leader if leader in isr else NO_LEADER,
                leader_epoch=0,
                isr=isr,
                partition_epoch=0,
            )
            changes.append(PartitionChange(topic.name, p, None, record))
        return changes

    # --- broker membership --------------------------------------------------------------

    def replace_brokers(self, brokers: dict[int, Broker]) -> None:
        """The registrations as re-read after a watch outage. A broker in controlled
        shutdown stays so only as the same incarnation: one that stopped and registered
        again unseen is a new broker, which would otherwise never lead or rejoin an ISR
        for the rest of this controller's term."""
        old = self.brokers
        self.shutting_down = {
            b
            for b in self.shutting_down
            if b in brokers and b in old and brokers[b].epoch == old[b].epoch
        }
        self.brokers = brokers

    def on_broker_down(self, broker_id: int) -> list[PartitionChange]:
        """The broker's lease expired: move its leaderships, drop it from every ISR."""
        self.shutting_down.discard(broker_id)
        self.brokers.pop(broker_id, None)
        return self._evict(broker_id)

    def _evict(self, broker_id: int) -> list[PartitionChange]:
        changes = []
        for name, p in self.partitions_hosted_by(broker_id):
            old = self.partitions.get((name, p))
            if old is None or (broker_id not in old.isr and old.leader != broker_id):
                continue
            topic = self.topics[name]
            remaining = [b for b in old.isr if b != broker_id]
            if not remaining:
                # Never empty the ISR: the last in-sync replica is the only safe leader.
                remaining = [broker_id]
            if old.leader in (broker_id, NO_LEADER):
                leader, isr = self._elect(
                    topic, p, remaining, allow_unclean=topic.unclean_leader_election
                )
            else:
                leader, isr = old.leader, tuple(remaining)
            new = _next(old, leader, isr)
            if new.leader != old.leader or new.isr != old.isr:
                changes.append(PartitionChange(name, p, old, new))
        return changes

    def evict_restarted(self, decided_at: Mapping[TopicPartition, int]) -> list[PartitionChange]:
        """Take replicas registered anew since their partition's state was written (a
        broker epoch other than the record's ``isr_epochs`` says; for a record without
        them, a registration after ``decided_at``, the partition key's etcd mod
        revision) out of its ISR and leadership: they restarted while no controller was
        active, or while this one's broker watch was down, so nobody ran
        ``on_broker_down`` for the old incarnation, and the new one may have come back
        with less (an empty disk). Kafka's controller fences a re-registered incarnation
        the same way. They rejoin through their leader once caught up. An ISR whose
        members all restarted keeps its members (nothing says which one holds more), but
        a restarted leader leads a new epoch: its new incarnation may hold less than it
        did, and a follower ahead of it at the old epoch must find that divergence
        (KIP-320) rather than keep records the leader then writes over at the same
        offsets.

        The revision alone missed a restart followed by a write of the record (a leader's
        AlterPartition keeping the member, decided while the controller did not know of
        the restart): the new incarnation, perhaps with an empty disk, stayed in the ISR
        and could be elected (found by an audit)."""
        changes = []
        for (name, p), old in sorted(self.partitions.items()):
            revision = decided_at.get((name, p))
            topic = self.topics.get(name)
            if topic is None:
                continue
            restarted = {b for b in (*old.isr, old.leader) if self._restarted(old, b, revision)}
            remaining = [b for b in old.isr if b not in restarted]
            if not restarted:
                continue
            if not remaining:
                if old.leader in restarted:
                    bumped = PartitionRecord(
                        leader=old.leader,
                        leader_epoch=old.leader_epoch + 1,
                        isr=old.isr,
                        partition_epoch=old.partition_epoch + 1,
                    )
                    changes.append(PartitionChange(name, p, old, bumped))
                continue
            if old.leader in restarted:
                leader, isr = self._elect(
                    topic, p, remaining, allow_unclean=topic.unclean_leader_election
                )
            else:
                leader, isr = old.leader, tuple(remaining)
            changes.append(PartitionChange(name, p, old, _next(old, leader, isr)))
        return changes

    def _restarted(self, record: PartitionRecord, broker_id: int, revision: int | None) -> bool:
        """Whether ``broker_id`` registered anew since ``record`` was written."""
        broker = self.brokers.get(broker_id)
        if broker is None:
            return False
        known = record.epoch_of(broker_id)
        if known > 0:
            return broker.epoch != known
        return revision is not None and broker.epoch > revision

    def on_broker_up(self, broker: Broker) -> list[PartitionChange]:
        """A broker (re)registered: elect it where a partition waits for exactly it.

        It does not take back leaderships it held before: it rejoins as follower and its
        leader re-admits it to the ISR once it catches up (AlterPartition). Offline
        partitions whose ISR holds it (or, for unclean topics, any offline partition it
        replicates) get it as leader.
        """
        self.brokers[broker.broker_id] = broker
        self.shutting_down.discard(broker.broker_id)
        changes = []
        for name, p in self.partitions_hosted_by(broker.broker_id):
            old = self.partitions.get((name, p))
            if old is None or old.is_online():
                continue
            topic = self.topics[name]
            leader, isr = self._elect(
                topic, p, old.isr, allow_unclean=topic.unclean_leader_election
            )
            if leader != NO_LEADER:
                changes.append(PartitionChange(name, p, old, _next(old, leader, isr)))
        return changes

    def elect_offline_partitions(self) -> list[PartitionChange]:
        """Leaders for offline partitions that now have an eligible replica.

        What a controller taking office runs after evicting dead brokers: a broker may
        have registered while no controller was active, so nobody ran ``on_broker_up``
        for it. The rule is the usual one (ISR first, unclean only where the topic allows).
        """
        changes = []
        for name in sorted(self.topics):
            changes.extend(self.elect_offline_partitions_of(self.topics[name]))
        return changes

    def elect_offline_partitions_of(self, topic: Topic) -> list[PartitionChange]:
        """``elect_offline_partitions`` for one topic, under ``topic``'s configs (which
        may be about to replace the ones held: turning unclean election on elects at
        once, as Kafka does, rather than at the next broker registration)."""
        changes = []
        for p in range(topic.partition_count):
            old = self.partitions.get((topic.name, p))
            if old is None or old.is_online():
                continue
            leader, isr = self._elect(
                topic, p, old.isr, allow_unclean=topic.unclean_leader_election
            )
            if leader != NO_LEADER:
                changes.append(PartitionChange(topic.name, p, old, _next(old, leader, isr)))
        return changes

    def dead_replicas(self) -> list[int]:
        """Brokers that are not live but lead or are in the ISR of some partition.

        A controller taking office evicts each (``on_broker_down``): they died while no
        controller was active, or before this controller's first read.
        """
        dead: set[int] = set()
        for record in self.partitions.values():
            dead.update(b for b in record.isr if b not in self.brokers)
            if record.leader != NO_LEADER and record.leader not in self.brokers:
                dead.add(record.leader)
        return sorted(dead)

    def controlled_shutdown(
        self, broker_id: int, broker_epoch: int
    ) -> tuple[list[PartitionChange], list[TopicPartition]]:
        """Move leadership off a broker about to stop, and take it out of every ISR.

        Returns the changes and the replicated partitions it still leads because no other
        in-sync replica is alive. Partitions of one replica are not among them, as in
        Kafka: their leadership can move nowhere, and the broker would wait its whole
        controlled-shutdown timeout for them to.
        """
        broker = self.brokers.get(broker_id)
        if broker is None:  # Kafka's answer to an unknown broker's ControlledShutdown
            raise BrokerNotAvailableError(f"broker {broker_id} is not registered")
        if broker_epoch >= 0 and broker_epoch != broker.epoch:
            raise StaleBrokerEpochError(
                f"broker {broker_id} is registered with epoch {broker.epoch}, not {broker_epoch}"
            )
        self.shutting_down.add(broker_id)
        changes = []
        remaining = []
        for name, p in self.partitions_hosted_by(broker_id):
            old = self.partitions.get((name, p))
            if old is None:
                continue
            topic = self.topics[name]
            others = [b for b in old.isr if b != broker_id]
            if old.leader == broker_id:
                leader, isr = self._elect(topic, p, others, allow_unclean=False)
                if leader == NO_LEADER:
                    if len(topic.assignment[p]) > 1:
                        remaining.append((name, p))
                    continue
                changes.append(PartitionChange(name, p, old, _next(old, leader, isr)))
            elif broker_id in old.isr and others:
                changes.append(PartitionChange(name, p, old, _next(old, old.leader, others)))
        return changes, remaining

    # --- ISR changes requested by leaders -------------------------------------------------

    def alter_partition(
        self,
        *,
        broker_id: int,
        broker_epoch: int,
        topic: str,
        partition: int,
        leader_epoch: int,
        new_isr: Sequence[int],
        partition_epoch: int,
        joining: Mapping[int, int] | None = None,
    ) -> PartitionChange:
        """Validate a leader's ISR proposal (Kafka's AlterPartition) and decide it.

        Fenced by the leader epoch (an older leader), the partition epoch (a proposal
        based on a state that has since changed) and the broker epoch (an older
        incarnation of the broker). New members must be live, assigned replicas, and the
        incarnation the leader saw catch up: ``joining`` maps each to the broker epoch of
        its fetches (KIP-841). A member that restarted since - perhaps with an empty
        disk - has a new epoch, and letting it in on its old self's progress would make
        it electable without the records the ISR is trusted to hold.
        """
        old = self.record(topic, partition)
        broker = self.brokers.get(broker_id)
        if broker is None or (broker_epoch >= 0 and broker.epoch != broker_epoch):
            raise StaleBrokerEpochError(
                f"broker {broker_id} with epoch {broker_epoch} is not the registered incarnation"
            )
        if old.leader != broker_id:
            raise NotLeaderOrFollowerError(
                f"broker {broker_id} does not lead {topic}-{partition} (leader is {old.leader})"
            )
        if leader_epoch < old.leader_epoch:
            raise FencedLeaderEpochError(
                f"{topic}-{partition}: leader epoch {leader_epoch} is older than {old.leader_epoch}"
            )
        if leader_epoch > old.leader_epoch:
            # Only a controller behind the one that made that epoch sees this (KRaft
            # answers the same): the leader should find the current controller.
            raise NotControllerError(
                f"{topic}-{partition}: leader epoch {leader_epoch} is newer than this "
                f"controller's {old.leader_epoch}"
            )
        if partition_epoch != old.partition_epoch:
            raise InvalidUpdateVersionError(
                f"{topic}-{partition}: partition epoch {partition_epoch} is not the current "
                f"{old.partition_epoch}"
            )
        replicas = self.replicas(topic, partition)
        isr = tuple(b for b in replicas if b in set(new_isr))  # canonical: assignment order
        if len(isr) != len(new_isr) or broker_id not in isr:
            raise InvalidRequestError(
                f"{topic}-{partition}: proposed ISR {list(new_isr)} must contain the leader "
                f"and only replicas {list(replicas)}, each once"
            )
        joining = joining or {}
        for member in isr:
            if member in old.isr:
                continue
            if not self._eligible(member):
                raise InvalidRequestError(
                    f"{topic}-{partition}: broker {member} cannot join the ISR: it is not "
                    "live (or is shutting down)"
                )
            seen_epoch = joining.get(member, -1)
            if self.brokers[member].epoch != seen_epoch:
                raise InvalidRequestError(
                    f"{topic}-{partition}: broker {member} cannot join the ISR: the leader "
                    f"saw incarnation {seen_epoch} catch up, and {self.brokers[member].epoch} "
                    "is registered"
                )
        return PartitionChange(topic, partition, old, _next(old, old.leader, isr))

    # --- elections on demand ----------------------------------------------------------------

    def elect(
        self, election: ElectionType, partitions: Iterable[TopicPartition]
    ) -> tuple[list[PartitionChange], dict[TopicPartition, TidelogError]]:
        """Preferred or unclean elections for ``partitions``; per-partition errors."""
        changes: list[PartitionChange] = []
        errors: dict[TopicPartition, TidelogError] = {}
        for name, p in partitions:
            try:
                old = self.record(name, p)
                topic = self.topics[name]
                if election is ElectionType.PREFERRED:
                    preferred = topic.assignment[p][0]
                    if old.leader == preferred:
                        raise ElectionNotNeededError(
                            f"{name}-{p}: the preferred replica {preferred} already leads"
                        )
                    if preferred not in old.isr or not self._eligible(preferred):
                        raise PreferredLeaderNotAvailableError(
                            f"{name}-{p}: preferred replica {preferred} is not live and in sync"
                        )
                    changes.append(PartitionChange(name, p, old, _next(old, preferred, old.isr)))
                else:
                    if old.is_online():
                        raise ElectionNotNeededError(f"{name}-{p} already has leader {old.leader}")
                    leader, isr = self._elect(topic, p, old.isr, allow_unclean=True)
                    if leader == NO_LEADER:
                        raise EligibleLeadersNotAvailableError(
                            f"{name}-{p}: no replica of {list(topic.assignment[p])} is live"
                        )
                    changes.append(PartitionChange(name, p, old, _next(old, leader, isr)))
            except TidelogError as exc:
                errors[(name, p)] = exc
        return changes, errors

    def imbalanced_partitions(
        self, threshold_percent: int = LEADER_IMBALANCE_PERCENTAGE
    ) -> list[TopicPartition]:
        """Partitions to hand back to their preferred leader (Kafka's auto rebalance).

        For each live broker, the share of the partitions it is preferred for that someone
        else leads; where that share exceeds the threshold, every such partition whose
        preferred replica is in sync is returned. The share counts them in sync or not, as
        Kafka's: counting only those in sync kept the caught-up ones away from their
        preferred leader while others had not caught up (found by an audit).
        """
        preferred_of: dict[int, list[TopicPartition]] = {}
        for name, topic in self.topics.items():
            for p, replicas in enumerate(topic.assignment):
                preferred_of.setdefault(replicas[0], []).append((name, p))
        chosen: list[TopicPartition] = []
        for broker_id, owned in sorted(preferred_of.items()):
            if not self._eligible(broker_id):
                continue
            partitions = self.partitions
            misplaced = [
                tp for tp in owned if tp in partitions and partitions[tp].leader != broker_id
            ]
            if len(misplaced) * 100 > threshold_percent * len(owned):
                chosen.extend(tp for tp in misplaced if broker_id in partitions[tp].isr)
        return chosen

    # --- applying decided (and persisted) changes -----------------------------------------

    def apply(self, changes: Iterable[PartitionChange]) -> None:
        for change in changes:
            self.partitions[change.key] = change.new

    def add_topic(self, topic: Topic) -> None:
        self.topics[topic.name] = topic

    def remove_topic(self, name: str) -> None:
        topic = self.topics.pop(name, None)
        if topic is None:
            return
        for p in range(topic.partition_count):
            self.partitions.pop((name, p), None)

    def replace_topic(self, topic: Topic) -> None:
        """A topic grew partitions (CreatePartitions): same id, longer assignment."""
        self.topics[topic.name] = dataclasses.replace(topic)
