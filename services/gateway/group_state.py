"""A consumer group's membership: who is in it, in which generation, who reads what.

Kafka's classic group protocol with its eager rebalance, the assignment made by the
coordinator (as KIP-848 moved it there) with Kafka's range assignor. This module is the
pure core: values and transitions, no etcd, threads or clocks; ``group_coordinator``
keeps the state in etcd and calls these with the time and the members still alive.

Phases (Kafka's group states)::

    empty ──join──▶ preparing ──every member joined, or the deadline──▶ stable
      ▲                ▲                                                  │
      └─last leaves────┴──── a member joins, changes topics, leaves or ───┘
                             dies; a subscribed topic's partition count changes

Invariants:

- ``generation`` counts completed rebalances; it moves only when one completes, so a
  member revoking its partitions in ``preparing`` still commits with the generation it
  read them in (Kafka accepts those commits, and the next owner must see them).
- In ``stable`` every member has an assignment and no partition is in two of them.
- In ``preparing``, ``joined`` holds the members that asked to join since it began; the
  rebalance completes when every member has, or without the others once its deadline
  passed (a member that does not rejoin in its rebalance timeout is out, as in Kafka).
  The deadline is timed outside (``deadline_passed``): the coordinator uses an etcd lease
  of ``rebalance_timeout_ms()``, so gateways' wall clocks never decide it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

from tidelog.errors import (
    FencedInstanceIdError,
    IllegalGenerationError,
    RebalanceInProgressError,
    TidelogError,
    UnknownMemberIdError,
)

Phase = Literal["empty", "preparing", "stable"]
TopicPartition = tuple[str, int]

FORMAT_VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class Member:
    member_id: str
    client_id: str
    topics: tuple[str, ...]  # sorted, no duplicates
    session_timeout_ms: int
    rebalance_timeout_ms: int
    lease_id: int  # the etcd lease whose key says the member is alive
    # group.instance.id (KIP-345): a static member keeps its partitions across restarts;
    # "" for a dynamic member.
    instance_id: str = ""


@dataclass(frozen=True, slots=True)
class GroupState:
    generation: int = 0
    phase: Phase = "empty"
    members: Mapping[str, Member] = field(default_factory=dict)
    # The generation's assignment (stable), kept through ``preparing`` for describing.
    assignment: Mapping[str, tuple[TopicPartition, ...]] = field(default_factory=dict)
    # Partition counts of the subscribed topics when the assignment was made.
    partition_counts: Mapping[str, int] = field(default_factory=dict)
    joined: frozenset[str] = frozenset()

    def rebalance_timeout_ms(self) -> int:
        """How long ``preparing`` waits for its members: the largest of their timeouts."""
        return max((m.rebalance_timeout_ms for m in self.members.values()), default=0)

    def topics(self) -> set[str]:
        return {t for m in self.members.values() for t in m.topics}

    def static_member(self, instance_id: str) -> Member | None:
        """The member holding the static ``instance_id`` now, if any."""
        if not instance_id:
            return None
        return next((m for m in self.members.values() if m.instance_id == instance_id), None)


# ----------------------------------------------------------------------- transitions


def begin_rebalance(state: GroupState) -> GroupState:
    """Start (or keep) ``preparing``: every member must join again."""
    if not state.members:
        return replace(state, phase="empty", joined=frozenset())
    if state.phase == "preparing":
        return state
    return replace(state, phase="preparing", joined=frozenset())


def expire(state: GroupState, alive: Iterable[str]) -> GroupState:
    """Drop members whose session ended; the others rebalance without them."""
    alive_ids = set(alive)
    dead = [m for m in state.members if m not in alive_ids]
    if not dead:
        return state
    return _without(state, dead)


def join(
    state: GroupState,
    member: Member,
    partition_counts: Mapping[str, int],
    *,
    deadline_passed: bool = False,
    may_take_over: bool = True,
) -> GroupState:
    """``member`` asks to join (new, or a member rejoining). A stable member rejoining
    with the same topics changes nothing (it gets the generation's assignment again).

    A static member (``instance_id``) joining under a new member id while its instance
    is in the group is the same consumer restarted (KIP-345): it takes over the old
    member's place and partitions, without a rebalance when its topics are the same;
    the old member id is fenced from then on (``check_instance``). Only a member joining
    for the first time (``may_take_over``) may do that: a member that was in the group
    and whose instance another member id holds now was replaced, and is fenced, rather
    than take the place back (two processes with one instance id would otherwise pass
    it back and forth)."""
    holder = state.static_member(member.instance_id)
    if holder is not None and holder.member_id != member.member_id:
        if not may_take_over:
            check_instance(state, member.member_id, member.instance_id)  # raises Fenced
        state = _replace_member(state, holder.member_id, member)
        if holder.topics != member.topics:
            state = begin_rebalance(state)
        elif state.phase == "stable":
            return state
    known = state.members.get(member.member_id)
    if known is not None and known.topics == member.topics and state.phase == "stable":
        return state
    members = dict(state.members)
    members[member.member_id] = member
    state = begin_rebalance(replace(state, members=members))
    state = replace(state, joined=state.joined | {member.member_id})
    return maybe_complete(state, partition_counts, deadline_passed=deadline_passed)


def _replace_member(state: GroupState, old_id: str, member: Member) -> GroupState:
    members = {k: v for k, v in state.members.items() if k != old_id}
    members[member.member_id] = member
    assignment = {k: v for k, v in state.assignment.items() if k != old_id}
    if old_id in state.assignment:
        assignment[member.member_id] = state.assignment[old_id]
    joined = state.joined - {old_id}
    if old_id in state.joined:
        joined |= {member.member_id}
    return replace(state, members=members, assignment=assignment, joined=joined)


def check_instance(state: GroupState, member_id: str, instance_id: str) -> None:
    """A request from a static member whose instance another member id holds now: a
    newer process with the same group.instance.id replaced it (Kafka's FENCED_INSTANCE_ID;
    the old one must stop, not join again and take the place back)."""
    holder = state.static_member(instance_id)
    if holder is not None and holder.member_id != member_id:
        raise FencedInstanceIdError(
            f"group.instance.id {instance_id!r} is held by member {holder.member_id!r} now: "
            "another consumer with the same instance id replaced this one"
        )


def maybe_complete(
    state: GroupState, partition_counts: Mapping[str, int], *, deadline_passed: bool
) -> GroupState:
    """Complete ``preparing`` when every member joined or the deadline passed."""
    if state.phase != "preparing":
        return state
    missing = [m for m in state.members if m not in state.joined]
    if missing and not deadline_passed:
        return state
    members = {k: v for k, v in state.members.items() if k not in missing}
    if not members:
        return replace(state, phase="empty", members={}, assignment={}, joined=frozenset())
    counts = {
        t: partition_counts[t]
        for t in sorted({t for m in members.values() for t in m.topics})
        if t in partition_counts
    }
    return GroupState(
        generation=state.generation + 1,
        phase="stable",
        members=members,
        assignment=range_assign(members.values(), counts),
        partition_counts=counts,
    )


def leave(state: GroupState, member_id: str, instance_id: str = "") -> GroupState:
    check_instance(state, member_id, instance_id)
    if member_id not in state.members:
        raise UnknownMemberIdError(f"member {member_id!r} is not in the group")
    return _without(state, [member_id])


def _without(state: GroupState, gone: Iterable[str]) -> GroupState:
    gone_ids = set(gone)
    members = {k: v for k, v in state.members.items() if k not in gone_ids}
    state = replace(
        state,
        members=members,
        joined=state.joined - gone_ids,
        assignment={k: v for k, v in state.assignment.items() if k not in gone_ids},
    )
    if not members:
        return replace(state, phase="empty", assignment={}, joined=frozenset())
    return begin_rebalance(state)


def heartbeat(
    state: GroupState,
    member_id: str,
    generation: int,
    partition_counts: Mapping[str, int],
    *,
    deadline_passed: bool = False,
    instance_id: str = "",
) -> tuple[GroupState, TidelogError | None]:
    """A member's heartbeat: the state (a rebalance begins when the subscribed topics'
    partition counts changed) and the error the member must act on, or None."""
    try:
        check_instance(state, member_id, instance_id)
    except FencedInstanceIdError as exc:
        return state, exc
    if member_id not in state.members:
        return state, UnknownMemberIdError(
            f"member {member_id!r} is not in the group (its session ended or it left): join again"
        )
    if state.phase == "stable" and _counts_changed(state, partition_counts):
        state = begin_rebalance(state)
    if state.phase == "preparing":
        state = maybe_complete(state, partition_counts, deadline_passed=deadline_passed)
        if member_id not in state.members:
            # Completed without it (it did not join again in time): it must join anew.
            return state, UnknownMemberIdError(
                f"member {member_id!r} did not join the rebalance in time: join again"
            )
        return state, RebalanceInProgressError("the group is rebalancing: join again")
    if generation != state.generation:
        return state, IllegalGenerationError(
            f"generation {generation} is not the group's current one ({state.generation})"
        )
    return state, None


def _counts_changed(state: GroupState, partition_counts: Mapping[str, int]) -> bool:
    now = {t: partition_counts[t] for t in state.topics() if t in partition_counts}
    return now != dict(state.partition_counts)


def check_commit(state: GroupState, member_id: str, generation: int, instance_id: str = "") -> None:
    """Kafka's rule for OffsetCommit: a commit by no member (empty ``member_id``) is
    allowed only while the group has no members (offsets stored for a consumer that
    assigns itself);
    a member commits in its generation, also while a rebalance is being prepared (it
    commits what it read before giving up its partitions)."""
    check_instance(state, member_id, instance_id)
    if not member_id:
        if state.members:
            raise UnknownMemberIdError(
                "the group has active members: only its members may commit (join it, or "
                "use another group id to store offsets for assigned partitions)"
            )
        return
    if member_id not in state.members:
        raise UnknownMemberIdError(f"member {member_id!r} is not in the group: join again")
    if generation != state.generation:
        raise IllegalGenerationError(
            f"generation {generation} is not the group's current one ({state.generation}): "
            "the partitions were reassigned; join again"
        )


# ------------------------------------------------------------------------ assignment


def range_assign(
    members: Iterable[Member], partition_counts: Mapping[str, int]
) -> dict[str, tuple[TopicPartition, ...]]:
    """Kafka's RangeAssignor: per topic, its subscribers in order take contiguous ranges
    of its partitions, the first ``count % subscribers`` one more.

    The order is Kafka's (AbstractPartitionAssignor.MemberInfo.compareTo): static members
    first, by instance id, then dynamic ones by member id. A static member restarted gets
    a new random member id; sorted by member id, its ranges moved at the next rebalance,
    against KIP-345's promise that a restart moves no partition."""
    ordered = sorted(
        members,
        key=lambda m: (0, m.instance_id, m.member_id) if m.instance_id else (1, "", m.member_id),
    )
    out: dict[str, list[TopicPartition]] = {m.member_id: [] for m in ordered}
    for topic in sorted(partition_counts):
        subscribers = [m.member_id for m in ordered if topic in m.topics]
        if not subscribers:
            continue
        count = partition_counts[topic]
        share, extra = divmod(count, len(subscribers))
        start = 0
        for i, member_id in enumerate(subscribers):
            n = share + (1 if i < extra else 0)
            out[member_id].extend((topic, p) for p in range(start, start + n))
            start += n
    return {k: tuple(v) for k, v in out.items()}


# ---------------------------------------------------------------------------- format


def encode(state: GroupState) -> bytes:
    """The etcd value (docs/METADATA.md, consumer group membership)."""
    doc = {
        "version": FORMAT_VERSION,
        "generation": state.generation,
        "phase": state.phase,
        "members": {
            m.member_id: {
                "client_id": m.client_id,
                "topics": list(m.topics),
                "session_timeout_ms": m.session_timeout_ms,
                "rebalance_timeout_ms": m.rebalance_timeout_ms,
                "lease_id": m.lease_id,
                "instance_id": m.instance_id,
            }
            for m in state.members.values()
        },
        # Per member, per topic its partitions: a topic's name once per member, not once
        # per partition (a member of a 100,000-partition topic stays well inside etcd's
        # 1.5 MiB request limit).
        "assignment": {k: _by_topic(v) for k, v in state.assignment.items()},
        "partition_counts": dict(state.partition_counts),
        "joined": sorted(state.joined),
    }
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def _by_topic(partitions: Iterable[TopicPartition]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for topic, partition in partitions:
        out.setdefault(topic, []).append(partition)
    return out


def decode(value: bytes) -> GroupState:
    """Raises ValueError for a value this code cannot read."""
    try:
        doc: dict[str, Any] = json.loads(value)
        if doc.get("version") != FORMAT_VERSION:
            raise ValueError(f"group state version {doc.get('version')!r} is not {FORMAT_VERSION}")
        phase = doc["phase"]
        if phase not in ("empty", "preparing", "stable"):
            raise ValueError(f"unknown group phase {phase!r}")
        members = {
            member_id: Member(
                member_id=member_id,
                client_id=str(m["client_id"]),
                topics=tuple(str(t) for t in m["topics"]),
                session_timeout_ms=int(m["session_timeout_ms"]),
                rebalance_timeout_ms=int(m["rebalance_timeout_ms"]),
                lease_id=int(m["lease_id"]),
                instance_id=str(m.get("instance_id", "")),
            )
            for member_id, m in doc["members"].items()
        }
        return GroupState(
            generation=int(doc["generation"]),
            phase=phase,
            members=members,
            assignment={
                k: tuple((str(t), int(p)) for t, ps in v.items() for p in ps)
                for k, v in doc["assignment"].items()
            },
            partition_counts={str(k): int(v) for k, v in doc["partition_counts"].items()},
            joined=frozenset(str(j) for j in doc["joined"]),
        )
    except (KeyError, TypeError, AttributeError, OverflowError) as exc:  # (cluster_metadata)
        raise ValueError(f"unreadable group state: {exc!r}") from exc
