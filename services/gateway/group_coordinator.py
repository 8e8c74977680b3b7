"""Consumer group membership kept in etcd: the adapter around ``group_state``.

Kafka has one coordinator broker per group holding the group in memory. Here any gateway
serves any group, so the group lives in etcd (docs/METADATA.md, consumer group
membership) and every change is a compare-and-swap on its state key:

- ``group-states/<group>``: the ``GroupState`` (phase, generation, members, assignment).
- ``group-sessions/<group>/<member>``: bound to the member's own etcd lease, whose TTL is
  its session timeout. A heartbeat refreshes the lease; when it expires, etcd deletes the
  key, and the next operation on the group (the survivors' heartbeats) drops the member
  and starts a rebalance. Sessions are timed by etcd's clock, whichever gateway a member
  talks to.

The state key is read before the session keys: a member is written into the state only
after its session key exists, so a reader never takes a member it just read for dead.

Rebalances complete without a timer thread: members joining call ``join`` again until it
answers (each call waits up to ``JOIN_WAIT_S``, woken by ``group_changes`` when the group's
keys change), and each call (and each heartbeat) completes the rebalance once everyone
joined or its deadline passed. The deadline is
etcd's too: ``group-rebalances/<group>``, written with the state when a rebalance begins,
is bound to a lease whose TTL is the rebalance timeout; the deadline has passed when the
key is gone. No gateway's wall clock decides it (a gateway whose clock ran ahead used to
complete rebalances at once and evict every member still rejoining).
"""

from __future__ import annotations

import contextlib
import math
import random
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final
from urllib.parse import quote, unquote

from services.cluster_metadata import (
    GROUP_SESSIONS_PREFIX,
    GROUP_STATES_PREFIX,
    group_emptied_key,
    group_fence_key,
    group_state_key,
    group_timer_key,
)
from services.gateway import group_state
from services.gateway.group_changes import GroupChanges
from services.gateway.group_state import GroupState, Member, TopicPartition
from services.gateway.groups import check_group_id
from services.gateway.metadata_cache import MetadataCache, MetadataView
from services.metastore import (
    Compare,
    DeleteOp,
    KeyValue,
    LeaseLostError,
    MetaStore,
    PutOp,
    TxnOp,
)
from tidelog.errors import (
    FencedInstanceIdError,
    GroupMaxSizeReachedError,
    InvalidRequestError,
    InvalidSessionTimeoutError,
    MemberIdRequiredError,
    NonEmptyGroupError,
    RebalanceInProgressError,
    StorageError,
    TidelogError,
    UnknownMemberIdError,
)
from tidelog.formats import INT32_MAX, MAX_CLIENT_ID_CHARS
from tidelog.logging import get_logger
from tidelog.topics import validate_topic_name

_log = get_logger(component="gateway.group_coordinator")

MIN_SESSION_TIMEOUT_MS: Final = 1_000
"""Kafka's group.min.session.timeout.ms is 6 s; etcd's lease minimum (2 s with its default
timing) is the real floor here, and short sessions are what tests of failover need."""
MAX_SESSION_TIMEOUT_MS: Final = 1_800_000
"""Kafka's group.max.session.timeout.ms (30 minutes)."""
MAX_REBALANCE_TIMEOUT_MS: Final = INT32_MAX
"""Kafka bounds it by its int32 only: a consumer's max_poll_interval_ms (the rebalance
timeout it sends) of hours is common for slow batch work, and a cap of one hour here left
such a consumer refused at every join (found by an audit). It only sets the TTL of the
group's rebalance timer lease (at most ~25 days; etcd takes far longer)."""
MAX_GROUP_MEMBERS: Final = 500
"""Kafka's group.max.size, bounded so a group's state stays well inside one etcd value."""
MAX_PENDING_MEMBERS: Final = MAX_GROUP_MEMBERS
"""Member ids handed out by first joins (KIP-394) whose members have not joined yet."""
MAX_TOPICS_PER_MEMBER: Final = 1_000
MAX_MEMBER_ID_CHARS: Final = MAX_CLIENT_ID_CHARS + 1 + 36
"""The longest member id this gateway hands out: ``<client id>-<uuid4>``. A longer one
cannot be a member; refused before it reaches etcd (as a key) or an error message."""
JOIN_WAIT_S: Final = 3.0
"""The longest one JoinGroup call waits for the others to join (then the member asks
again): shorter than a client's request timeout, and a handler thread is not held long."""
JOIN_POLL_S: Final = 0.1
"""How often a waiting join looks again when no ``GroupChanges`` wakes it."""
CAS_ATTEMPTS: Final = 20
CAS_BACKOFF_S: Final = 0.005
"""Times the attempt number, with jitter: members joining at once spread their writes."""
MAX_STATE_BYTES: Final = 1_000_000
"""A group's encoded state stays below this, under etcd's default 1.5 MiB request limit."""
MAX_GROUPS_LISTED: Final = 100_000


def state_key(group_id: str) -> str:
    return group_state_key(quote(group_id, safe=""))


def fence_key(group_id: str) -> str:
    return group_fence_key(quote(group_id, safe=""))


def timer_key(group_id: str) -> str:
    return group_timer_key(quote(group_id, safe=""))


def session_prefix(group_id: str) -> str:
    return f"{GROUP_SESSIONS_PREFIX}{quote(group_id, safe='')}/"


def session_key(group_id: str, member_id: str) -> str:
    return f"{session_prefix(group_id)}{quote(member_id, safe='')}"


@dataclass(frozen=True, slots=True)
class JoinOutcome:
    member_id: str
    generation: int
    assignment: tuple[TopicPartition, ...]
    session_timeout_ms: int
    error: TidelogError | None  # RebalanceInProgressError: ask again with member_id


class GroupCoordinator:
    """Join, heartbeat, leave, describe and commit fencing for every group. Thread-safe:
    all state is in etcd, every write a compare-and-swap."""

    def __init__(
        self,
        store: MetaStore,
        cache: MetadataCache,
        *,
        changes: GroupChanges | None = None,
        join_wait_s: float = JOIN_WAIT_S,
    ) -> None:
        self._store = store
        self._cache = cache
        self._changes = changes
        self._join_wait_s = join_wait_s

    # --- reads and compare-and-swap -------------------------------------------------------

    def _read(self, group_id: str) -> tuple[GroupState, int, set[str]]:
        """The state, its mod revision (0: absent) and the members whose session lives."""
        state, revision, alive, _, _ = self._read_all(group_id)
        return state, revision, alive

    def _read_all(self, group_id: str) -> tuple[GroupState, int, set[str], bool, int]:
        """``_read``, whether a ``preparing`` state's deadline has passed (its timer key
        is gone), and the timer's lease (0: none). Read in this order: keys written with
        the state exist by the time the state is read, so a reader never takes a fresh
        member or timer for gone."""
        kv = self._store.get(state_key(group_id))
        state = self._decode(group_id, kv)
        prefix = session_prefix(group_id)
        alive = {unquote(s.key.removeprefix(prefix)) for s in self._store.get_prefix(prefix)}
        timer = self._store.get(timer_key(group_id)) if state.phase == "preparing" else None
        deadline_passed = state.phase == "preparing" and timer is None
        timer_lease = timer.lease_id if timer is not None else 0
        return (
            state,
            (kv.mod_revision if kv is not None else 0),
            alive,
            deadline_passed,
            timer_lease,
        )

    @staticmethod
    def _decode(group_id: str, kv: KeyValue | None) -> GroupState:
        if kv is None:
            return GroupState()
        try:
            return group_state.decode(kv.value)
        except ValueError as exc:
            # Refuse to overwrite what this code cannot read (a newer gateway's format).
            raise StorageError(f"group {group_id!r}: {exc}") from exc

    def _update(
        self, group_id: str, change: Callable[[GroupState, set[str], bool], GroupState]
    ) -> GroupState:
        """Apply ``change(state, alive, deadline_passed)`` with compare-and-swap; write only
        when it changed something. Exceptions from ``change`` propagate, nothing written.

        The fence key is rewritten in the same transaction when the members or the
        generation change (what ``check_commit`` depends on); a rebalance that begins
        writes its timer key (on a new lease of its rebalance timeout); a group left
        without members is deleted (state, fence and timer, and the controller's empty mark,
        so its next expiry pass marks this later time), so abandoned group ids leave no
        keys."""
        for attempt in range(CAS_ATTEMPTS):
            state, revision, alive, deadline_passed, timer_lease = self._read_all(group_id)
            new = change(state, alive, deadline_passed)
            if new == state:
                return state
            ops: list[TxnOp]
            timer: int | None = None  # a lease granted for this attempt's timer key
            if not new.members:
                ops = [
                    DeleteOp(state_key(group_id)),
                    DeleteOp(fence_key(group_id)),
                    DeleteOp(timer_key(group_id)),
                    # Emptied now: the controller's next expiry pass marks this time
                    # (offsets expire a retention after the group emptied, KIP-211).
                    DeleteOp(group_emptied_key(quote(group_id, safe=""))),
                ]
                new = GroupState()
            else:
                encoded = group_state.encode(new)
                if len(encoded) > MAX_STATE_BYTES:
                    raise GroupMaxSizeReachedError(
                        f"group {group_id!r} would take {len(encoded)} bytes of metadata; the "
                        f"limit is {MAX_STATE_BYTES}: fewer members, topics or partitions"
                    )
                ops = [PutOp(state_key(group_id), encoded)]
                if not state.members:
                    # Members again: an empty mark an expiry pass wrote before is void.
                    # Kept, it outlived a member that joined and went without LeaveGroup
                    # between two passes, and the offsets expired a retention after the
                    # old mark: right after the member went (found by an audit).
                    ops.append(DeleteOp(group_emptied_key(quote(group_id, safe=""))))
                if new.generation != state.generation or set(new.members) != set(state.members):
                    ops.append(PutOp(fence_key(group_id), str(new.generation).encode()))
                if new.phase == "preparing" and state.phase != "preparing":
                    lease = self._store.grant_lease(
                        max(1, math.ceil(new.rebalance_timeout_ms() / 1000))
                    )
                    timer = lease.id
                    ops.append(PutOp(timer_key(group_id), b"", lease))
                elif new.phase != "preparing" and state.phase == "preparing":
                    ops.append(DeleteOp(timer_key(group_id)))
            compares = [Compare.mod_revision_is(state_key(group_id), revision)]
            if not self._store.txn(compares, ops).succeeded:
                if timer is not None:
                    with contextlib.suppress(TidelogError):
                        self._store.revoke_lease_id(timer)
            else:
                if timer_lease and any(
                    isinstance(op, DeleteOp) and op.key == timer_key(group_id) for op in ops
                ):
                    # Its key is gone with the rebalance; its lease (the rebalance
                    # timeout, up to days) lived on in etcd, one per rebalance (found by
                    # an audit). Best effort: it expires by itself anyway.
                    with contextlib.suppress(TidelogError):
                        self._store.revoke_lease_id(timer_lease)
                if new.generation != state.generation or new.phase != state.phase:
                    _log.info(
                        "group_changed",
                        group=group_id,
                        phase=new.phase,
                        generation=new.generation,
                        members=len(new.members),
                    )
                return new
            time.sleep(random.uniform(0, CAS_BACKOFF_S * (attempt + 1)))
        raise RebalanceInProgressError(
            f"group {group_id!r} changed {CAS_ATTEMPTS} times while this request updated it"
        )

    def _partition_counts(self, topics: set[str]) -> dict[str, int]:
        def read(view: MetadataView) -> dict[str, int]:
            return {t: view.topics[t].partition_count for t in topics if t in view.topics}

        return self._cache.read(read)

    def _counts_for(self, state: GroupState, extra: Sequence[str] = ()) -> dict[str, int]:
        return self._partition_counts(state.topics() | set(extra))

    # --- membership -----------------------------------------------------------------------

    def join(
        self,
        group_id: str,
        member_id: str,
        *,
        topics: Sequence[str],
        session_timeout_ms: int,
        rebalance_timeout_ms: int,
        client_id: str,
        max_wait_ms: int,
        instance_id: str = "",
    ) -> JoinOutcome:
        check_group_id(group_id)
        check_member_id(member_id)
        wanted = _check_join(topics, session_timeout_ms, rebalance_timeout_ms, client_id)
        _check_instance_id(instance_id)
        ttl_s = max(1, math.ceil(session_timeout_ms / 1000))

        def member(lease_id: int) -> Member:
            return Member(
                member_id=member_id,
                client_id=client_id,
                topics=wanted,
                session_timeout_ms=session_timeout_ms,
                rebalance_timeout_ms=rebalance_timeout_ms,
                lease_id=lease_id,
                instance_id=instance_id,
            )

        if not member_id:
            # KIP-394: the first join only hands out a member id (and starts its session);
            # the member enters the group when it joins naming it. A gateway that dies, or
            # an answer lost, before the client learns its id then leaves no member in the
            # group holding partitions nobody reads until its session ends.
            state, _, alive = self._read(group_id)
            if len(state.members) >= MAX_GROUP_MEMBERS and not state.static_member(instance_id):
                raise GroupMaxSizeReachedError(
                    f"group {group_id!r} has {len(state.members)} members; the limit is "
                    f"{MAX_GROUP_MEMBERS}"
                )
            unjoined = len(alive - set(state.members))
            if unjoined >= MAX_PENDING_MEMBERS:
                # Each id handed out holds an etcd lease and key until its session ends:
                # clients that ask for ids and never join must not pile them up.
                raise GroupMaxSizeReachedError(
                    f"group {group_id!r} has {unjoined} member ids handed out and not yet "
                    f"joined; the limit is {MAX_PENDING_MEMBERS}: retry after "
                    f"{session_timeout_ms} ms, when unused ones expire"
                )
            member_id = f"{client_id or 'consumer'}-{uuid.uuid4()}"
            lease = self._store.grant_lease(ttl_s)
            self._store.put(session_key(group_id, member_id), str(lease.id).encode(), lease)
            if instance_id:
                # A static member joins at once (as in Kafka): a retry after a lost answer
                # names the same instance and takes the place over, so no phantom stays.
                return self._join_loop(
                    group_id, member(lease.id), max_wait_ms, lease.ttl_s, may_take_over=True
                )
            return JoinOutcome(
                member_id,
                -1,
                (),
                lease.ttl_s * 1000,
                MemberIdRequiredError("join again with the member id given"),
            )
        state, _, alive = self._read(group_id)
        group_state.check_instance(state, member_id, instance_id)
        known = state.members.get(member_id)
        pending = None if known is not None else self._store.get(session_key(group_id, member_id))
        if known is not None and member_id in alive:
            lease_id = known.lease_id
        elif pending is not None and pending.value.isdigit():
            lease_id = int(pending.value)  # the id a first join handed out
        else:
            raise UnknownMemberIdError(
                f"member {member_id!r} is not in group {group_id!r} (its session ended "
                "or it left): join with an empty member id"
            )
        granted_s = self._refresh(group_id, member_id, lease_id)
        # A static member takes its instance's place over on its first join only (a
        # pending member id); one that was in the group and lost the place is fenced.
        return self._join_loop(
            group_id, member(lease_id), max_wait_ms, granted_s, may_take_over=known is None
        )

    def _join_loop(
        self,
        group_id: str,
        member: Member,
        max_wait_ms: int,
        granted_s: int,
        *,
        may_take_over: bool,
    ) -> JoinOutcome:
        member_id, lease_id = member.member_id, member.lease_id
        replaced: list[int] = []  # the lease of a static member this one took over
        deadline = time.monotonic() + min(self._join_wait_s, max(0, max_wait_ms) / 1000)
        refresh_every_s = granted_s / 3
        refreshed_at = time.monotonic()
        # Taken before the first read: a change after it wakes the wait below at once.
        ticket = self._changes.ticket(group_id) if self._changes is not None else None
        # Only until a pass has written this member into the group: a static member's
        # first join waits here over several passes, and another process with the same
        # instance id may replace it meanwhile (revoking this session). Left on, the next
        # pass answered UNKNOWN_MEMBER_ID, the client joined anew and took the place
        # back from the newer process; Kafka fences the older one.
        take_over = [may_take_over]
        try:
            while True:

                def change(state: GroupState, alive: set[str], deadline_passed: bool) -> GroupState:
                    if not take_over[0]:
                        # Replaced by a newer process with the same instance id while waiting
                        # here (its takeover revoked this member's session): fenced, not
                        # "unknown", or it would join anew and take the place back.
                        group_state.check_instance(state, member_id, member.instance_id)
                    state = group_state.expire(state, alive)
                    if member_id not in alive:
                        raise UnknownMemberIdError(
                            f"member {member_id!r}'s session ended while it joined: join again"
                        )
                    holder = state.static_member(member.instance_id)
                    replaced[:] = (
                        [holder.lease_id] if holder and holder.member_id != member_id else []
                    )
                    if (
                        member_id not in state.members
                        and holder is None
                        and len(state.members) >= MAX_GROUP_MEMBERS
                    ):
                        raise GroupMaxSizeReachedError(
                            f"group {group_id!r} has {len(state.members)} members; the limit is "
                            f"{MAX_GROUP_MEMBERS}"
                        )
                    counts = self._counts_for(state, member.topics)
                    state = group_state.join(
                        state,
                        member,
                        counts,
                        deadline_passed=deadline_passed,
                        may_take_over=take_over[0],
                    )
                    return group_state.maybe_complete(
                        state, counts, deadline_passed=deadline_passed
                    )

                state = self._update(group_id, change)
                if member_id in state.members:
                    take_over[0] = False
                for old_lease in replaced:
                    # The restarted static member's previous incarnation: its session ends
                    # now (its key would otherwise linger until its TTL, harmlessly).
                    with contextlib.suppress(TidelogError):
                        self._store.revoke_lease_id(old_lease)
                replaced.clear()
                if state.phase == "stable" and member_id in state.members:
                    return JoinOutcome(
                        member_id,
                        state.generation,
                        state.assignment[member_id],
                        granted_s * 1000,
                        None,
                    )
                if time.monotonic() - refreshed_at > refresh_every_s:
                    # A member waiting here sends no heartbeats: waiting keeps it alive.
                    self._refresh(group_id, member_id, lease_id)
                    refreshed_at = time.monotonic()
                now = time.monotonic()
                if now >= deadline:
                    missing = len(state.members) - len(state.joined)
                    return JoinOutcome(
                        member_id,
                        state.generation,
                        (),
                        granted_s * 1000,
                        RebalanceInProgressError(
                            f"group {group_id!r} is waiting for {missing} member(s) to "
                            "join: call again"
                        ),
                    )
                wake_s = min(deadline, refreshed_at + refresh_every_s) - now
                if self._changes is not None and ticket is not None:
                    self._changes.wait(ticket, wake_s)
                else:
                    time.sleep(max(0.0, min(wake_s, JOIN_POLL_S)))
        finally:
            if self._changes is not None and ticket is not None:
                self._changes.done(ticket)

    def _refresh(self, group_id: str, member_id: str, lease_id: int) -> int:
        try:
            return self._store.refresh_lease_id(lease_id)
        except LeaseLostError as exc:
            raise UnknownMemberIdError(
                f"member {member_id!r}'s session in group {group_id!r} ended: join again"
            ) from exc

    def heartbeat(
        self, group_id: str, member_id: str, generation: int, instance_id: str = ""
    ) -> TidelogError | None:
        check_group_id(group_id)
        check_member_id(member_id)
        state, _, alive = self._read(group_id)
        try:
            group_state.check_instance(state, member_id, instance_id)
        except FencedInstanceIdError as exc:
            return exc
        known = state.members.get(member_id)
        if known is None or member_id not in alive:
            # Let the group go on without it now, rather than at the next other heartbeat.
            self._update(group_id, lambda s, alive, _: group_state.expire(s, alive))
            return UnknownMemberIdError(
                f"member {member_id!r} is not in group {group_id!r} (its session ended or "
                "it left): join again"
            )
        try:
            self._refresh(group_id, member_id, known.lease_id)
        except UnknownMemberIdError as exc:
            return exc
        outcome: list[TidelogError | None] = [None]

        def change(state: GroupState, alive: set[str], deadline_passed: bool) -> GroupState:
            state = group_state.expire(state, alive)
            state, outcome[0] = group_state.heartbeat(
                state,
                member_id,
                generation,
                self._counts_for(state),
                deadline_passed=deadline_passed,
                instance_id=instance_id,
            )
            return state

        self._update(group_id, change)
        return outcome[0]

    def leave(self, group_id: str, member_id: str, instance_id: str = "") -> None:
        check_group_id(group_id)
        check_member_id(member_id)
        if member_id and not instance_id:
            state, _, _ = self._read(group_id)
            if member_id not in state.members:
                pending = self._store.get(session_key(group_id, member_id))
                if pending is not None and pending.value.isdigit():
                    # A member id handed out by a first join and never used to join (KIP-394):
                    # Kafka removes such a pending member on LeaveGroup. Its session key and
                    # lease lived on, counting against the group's pending ids until the
                    # session ended (found by an audit).
                    self._store.revoke_lease_id(int(pending.value))
                    return
        lease_id: list[int] = []

        def change(state: GroupState, alive: set[str], _deadline_passed: bool) -> GroupState:
            group_state.check_instance(state, member_id, instance_id)
            known = state.members.get(member_id)
            if known is None:
                raise UnknownMemberIdError(f"member {member_id!r} is not in group {group_id!r}")
            lease_id[:] = [known.lease_id]
            return group_state.leave(
                group_state.expire(state, alive | {member_id}), member_id, instance_id
            )

        self._update(group_id, change)
        self._store.revoke_lease_id(lease_id[0])

    def describe(self, group_id: str) -> GroupState:
        """The group as it is now (members whose session ended are dropped first)."""
        check_group_id(group_id)
        return self._update(group_id, lambda s, alive, _: group_state.expire(s, alive))

    def has_sessions(self, group_id: str) -> bool:
        """Whether any member's session lives, pending members' (KIP-394) included."""
        check_group_id(group_id)
        return bool(self._store.get_prefix(session_prefix(group_id)))

    def list_groups(self) -> list[str]:
        """Groups with members (a group without any has no state key)."""
        kvs = self._store.get_prefix(GROUP_STATES_PREFIX)[:MAX_GROUPS_LISTED]
        return sorted(unquote(kv.key.removeprefix(GROUP_STATES_PREFIX)) for kv in kvs)

    # --- commit fencing -------------------------------------------------------------------

    def inactive_guard(self, group_id: str) -> list[Compare]:
        """For operations that need the group without members (deleting its offsets):
        NonEmptyGroupError if it has some (whose session lives), else the compare that
        keeps it so (its state key absent: a group has one exactly while it has members)."""
        state, revision, alive = self._read(group_id)
        state = group_state.expire(state, alive)
        if state.members:
            raise NonEmptyGroupError(
                f"group {group_id!r} has {len(state.members)} member(s): stop its consumers first"
            )
        if revision:
            # Members whose sessions just ended: write that down, then compare on absence.
            self._update(group_id, lambda s, alive, _: group_state.expire(s, alive))
        return [Compare.absent(state_key(group_id))]

    def commit_guard(
        self, group_id: str, member_id: str, generation: int, instance_id: str = ""
    ) -> list[Compare]:
        """Check that this member may commit now (``group_state.check_commit``) and return
        the compares that keep it true in the commit's transaction: the state unchanged,
        and the member's session alive. Raises the group error otherwise."""
        check_member_id(member_id)
        # The fence first: a membership change after this read moves it, and the
        # transaction's compare then fails even if the state read below is newer.
        fence = self._store.get(fence_key(group_id))
        state, _, alive = self._read(group_id)
        state = group_state.expire(state, alive)
        group_state.check_commit(state, member_id, generation, instance_id)
        compares = [
            Compare.mod_revision_is(fence_key(group_id), fence.mod_revision if fence else 0)
        ]
        if member_id:
            compares.append(Compare.exists(session_key(group_id, member_id)))
        return compares


_INSTANCE_ID = re.compile(r"[a-zA-Z0-9._-]{1,249}")


def check_member_id(member_id: str) -> None:
    if len(member_id) > MAX_MEMBER_ID_CHARS:
        raise InvalidRequestError(
            f"member id of {len(member_id)} characters; the limit is {MAX_MEMBER_ID_CHARS}"
        )


def _check_instance_id(instance_id: str) -> None:
    """Kafka's rule for group.instance.id: a topic name's characters and length."""
    if instance_id and (not _INSTANCE_ID.fullmatch(instance_id) or instance_id in (".", "..")):
        raise InvalidRequestError(
            f"group instance id {instance_id[:64]!r} must be 1-249 characters of "
            "[a-zA-Z0-9._-], not '.' or '..'"
        )


def _check_join(
    topics: Sequence[str], session_timeout_ms: int, rebalance_timeout_ms: int, client_id: str
) -> tuple[str, ...]:
    if not topics:
        raise InvalidRequestError("a member must subscribe to at least one topic")
    wanted = tuple(sorted(set(topics)))
    if len(wanted) > MAX_TOPICS_PER_MEMBER:
        raise InvalidRequestError(
            f"{len(wanted)} topics in one subscription; the limit is {MAX_TOPICS_PER_MEMBER}"
        )
    for topic in wanted:
        validate_topic_name(topic)
    if not MIN_SESSION_TIMEOUT_MS <= session_timeout_ms <= MAX_SESSION_TIMEOUT_MS:
        raise InvalidSessionTimeoutError(
            f"session timeout {session_timeout_ms} ms is outside "
            f"{MIN_SESSION_TIMEOUT_MS}..{MAX_SESSION_TIMEOUT_MS} ms"
        )
    if not 1 <= rebalance_timeout_ms <= MAX_REBALANCE_TIMEOUT_MS:
        raise InvalidRequestError(
            f"rebalance timeout {rebalance_timeout_ms} ms is outside "
            f"1..{MAX_REBALANCE_TIMEOUT_MS} ms"
        )
    if len(client_id) > MAX_CLIENT_ID_CHARS:
        raise InvalidRequestError(
            f"client id of {len(client_id)} characters; the limit is {MAX_CLIENT_ID_CHARS}"
        )
    return wanted


__all__ = ["GroupCoordinator", "JoinOutcome", "check_member_id", "session_key", "state_key"]
