"""The pure core of consumer group membership (services/gateway/group_state.py)."""

from __future__ import annotations

import pytest

from services.gateway import group_state
from services.gateway.group_state import GroupState, Member
from tidelog.errors import (
    FencedInstanceIdError,
    IllegalGenerationError,
    RebalanceInProgressError,
    UnknownMemberIdError,
)


def member(member_id: str, *topics: str, rebalance_timeout_ms: int = 10_000) -> Member:
    return Member(
        member_id=member_id,
        client_id="c",
        topics=tuple(sorted(topics or ("t",))),
        session_timeout_ms=10_000,
        rebalance_timeout_ms=rebalance_timeout_ms,
        lease_id=1,
    )


COUNTS = {"t": 6, "u": 3}


def test_range_assignor_matches_kafkas() -> None:
    members = [member("b", "t", "u"), member("a", "t", "u"), member("c", "t")]
    got = group_state.range_assign(members, {"t": 7, "u": 3})
    # t: 7 partitions over a, b, c -> 3, 2, 2; u: 3 over a, b -> 2, 1.
    assert got == {
        "a": (("t", 0), ("t", 1), ("t", 2), ("u", 0), ("u", 1)),
        "b": (("t", 3), ("t", 4), ("u", 2)),
        "c": (("t", 5), ("t", 6)),
    }


def test_first_member_completes_alone_and_a_second_waits_for_the_first() -> None:
    state = group_state.join(GroupState(), member("a"), COUNTS)
    assert (state.phase, state.generation) == ("stable", 1)
    assert state.assignment["a"] == tuple(("t", p) for p in range(6))

    state = group_state.join(state, member("b"), COUNTS)
    assert (state.phase, state.generation) == ("preparing", 1)
    # a's heartbeat says: join again. Its commits in generation 1 are still accepted.
    state, error = group_state.heartbeat(state, "a", 1, COUNTS)
    assert isinstance(error, RebalanceInProgressError)
    group_state.check_commit(state, "a", 1)

    state = group_state.join(state, member("a"), COUNTS)
    assert (state.phase, state.generation) == ("stable", 2)
    assert state.assignment == {
        "a": (("t", 0), ("t", 1), ("t", 2)),
        "b": (("t", 3), ("t", 4), ("t", 5)),
    }
    with pytest.raises(IllegalGenerationError):
        group_state.check_commit(state, "a", 1)
    group_state.check_commit(state, "a", 2)


def test_a_member_that_does_not_rejoin_in_time_is_dropped() -> None:
    state = group_state.join(GroupState(), member("a", rebalance_timeout_ms=1_000), COUNTS)
    state = group_state.join(state, member("b", rebalance_timeout_ms=1_000), COUNTS)
    assert state.phase == "preparing"
    assert group_state.maybe_complete(state, COUNTS, deadline_passed=False).phase == "preparing"
    # The deadline passing is what the coordinator's etcd timer says, not a clock here.
    after = group_state.maybe_complete(state, COUNTS, deadline_passed=True)
    # A heartbeat that finds the deadline passed completes it too, and tells a member it
    # left out to join anew.
    _, dropped = group_state.heartbeat(state, "a", 1, COUNTS, deadline_passed=True)
    assert isinstance(dropped, UnknownMemberIdError)
    state = after
    assert (state.phase, state.generation, list(state.members)) == ("stable", 2, ["b"])
    state, error = group_state.heartbeat(state, "a", 1, COUNTS)
    assert isinstance(error, UnknownMemberIdError)


def test_dead_members_are_expired_and_the_rest_rebalance() -> None:
    state = group_state.join(GroupState(), member("a"), COUNTS)
    state = group_state.join(state, member("b"), COUNTS)
    state = group_state.join(state, member("a"), COUNTS)
    assert state.phase == "stable"
    state = group_state.expire(state, {"b"})
    assert (state.phase, list(state.members)) == ("preparing", ["b"])
    state = group_state.join(state, member("b"), COUNTS)
    assert state.assignment == {"b": tuple(("t", p) for p in range(6))}
    assert group_state.expire(state, set()).phase == "empty"


def test_partition_count_change_starts_a_rebalance() -> None:
    state = group_state.join(GroupState(), member("a"), COUNTS)
    same, error = group_state.heartbeat(state, "a", 1, COUNTS)
    assert error is None and same == state
    grown, error = group_state.heartbeat(state, "a", 1, {"t": 8})
    assert isinstance(error, RebalanceInProgressError)
    state = group_state.join(grown, member("a"), {"t": 8})
    assert len(state.assignment["a"]) == 8


def test_leave_and_commit_rules() -> None:
    state = group_state.join(GroupState(), member("a"), COUNTS)
    with pytest.raises(UnknownMemberIdError):
        group_state.check_commit(state, "", -1)  # an outsider while the group has members
    with pytest.raises(UnknownMemberIdError):
        group_state.check_commit(state, "zzz", 1)
    with pytest.raises(UnknownMemberIdError):
        group_state.leave(state, "zzz")
    state = group_state.leave(state, "a")
    assert state.phase == "empty" and not state.members
    group_state.check_commit(state, "", -1)  # no members: offsets for anyone


def test_state_round_trips_and_refuses_what_it_cannot_read() -> None:
    state = group_state.join(GroupState(), member("a", "t", "u"), COUNTS)
    state = group_state.join(state, member("b"), COUNTS)
    assert group_state.decode(group_state.encode(state)) == state
    overflowing = group_state.encode(state).replace(b'"generation":1,', b'"generation":1e400,')
    assert overflowing != group_state.encode(state)
    for bad in (b"{", b'{"version": 9}', b'{"version": 1, "phase": "x"}', b"[]", overflowing):
        with pytest.raises(ValueError):
            group_state.decode(bad)


def static(member_id: str, instance_id: str, *topics: str) -> Member:
    return Member(
        member_id=member_id,
        client_id="c",
        topics=tuple(sorted(topics or ("t",))),
        session_timeout_ms=10_000,
        rebalance_timeout_ms=10_000,
        lease_id=1,
        instance_id=instance_id,
    )


def test_a_restarted_static_member_takes_its_place_back_without_a_rebalance() -> None:
    state = group_state.join(GroupState(), static("a1", "a"), COUNTS)
    state = group_state.join(state, static("b1", "b"), COUNTS)
    state = group_state.join(state, static("a1", "a"), COUNTS)
    assert (state.phase, state.generation) == ("stable", 2)
    before = state.assignment["a1"]

    restarted = group_state.join(state, static("a2", "a"), COUNTS)
    assert (restarted.phase, restarted.generation) == ("stable", 2)  # no rebalance
    assert restarted.assignment["a2"] == before and "a1" not in restarted.members
    assert restarted.assignment["b1"] == state.assignment["b1"]
    # The old incarnation is fenced everywhere; the others carry on.
    _, error = group_state.heartbeat(restarted, "a1", 2, COUNTS, instance_id="a")
    assert isinstance(error, FencedInstanceIdError)
    with pytest.raises(FencedInstanceIdError):
        group_state.check_commit(restarted, "a1", 2, "a")
    with pytest.raises(FencedInstanceIdError):
        group_state.leave(restarted, "a1", "a")
    assert group_state.heartbeat(restarted, "b1", 2, COUNTS, instance_id="b")[1] is None
    assert group_state.decode(group_state.encode(restarted)) == restarted

    # Restarted with other topics: it takes the place, and the group rebalances.
    moved = group_state.join(state, static("a3", "a", "u"), COUNTS)
    assert moved.phase == "preparing" and "a3" in moved.joined and "a1" not in moved.members


def test_static_members_keep_their_ranges_across_a_restart_and_the_next_rebalance() -> None:
    """The range assignor ordered every member by member id; Kafka's puts static members
    first, by group.instance.id (AbstractPartitionAssignor.MemberInfo.compareTo). A static
    member restarted gets a new random member id: it took its place back with its ranges
    (KIP-345), then lost them at the next rebalance, sorted after the others."""
    counts = {"t": 4, "u": 1}
    state = group_state.join(GroupState(), static("a-1", "a"), counts)
    state = group_state.join(state, static("b-2", "b"), counts)
    state = group_state.join(state, static("a-1", "a"), counts)
    assert state.phase == "stable" and state.assignment["a-1"] == (("t", 0), ("t", 1))
    # Instance "a" restarts under a member id sorting after "b-2": no rebalance.
    state = group_state.join(state, static("z-3", "a"), counts)
    assert state.phase == "stable" and state.assignment["z-3"] == (("t", 0), ("t", 1))
    # A dynamic member (of another topic) joins: a rebalance, every member rejoins.
    state = group_state.join(state, member("c-4", "u"), counts)
    state = group_state.join(state, static("b-2", "b"), counts)
    state = group_state.join(state, static("z-3", "a"), counts)
    assert state.phase == "stable"
    assert state.assignment["z-3"] == (("t", 0), ("t", 1))  # instance "a" first
    assert state.assignment["b-2"] == (("t", 2), ("t", 3))
    assert state.assignment["c-4"] == (("u", 0),)


def test_range_assignor_puts_static_members_first_by_instance_id() -> None:
    """Kafka's order: static members by instance id, then dynamic ones by member id."""
    members = [member("a", "t"), static("b", "y"), static("c", "x")]
    assert group_state.range_assign(members, {"t": 3}) == {
        "c": (("t", 0),),
        "b": (("t", 1),),
        "a": (("t", 2),),
    }


def test_preparing_waits_for_the_largest_rebalance_timeout_of_its_members() -> None:
    # The coordinator's etcd lease for the rebalance deadline is this long: a member with
    # a long rebalance timeout must not be dropped at a shorter member's deadline.
    state = group_state.join(GroupState(), member("a", rebalance_timeout_ms=1_000), COUNTS)
    state = group_state.join(state, member("b", rebalance_timeout_ms=30_000), COUNTS)
    assert state.rebalance_timeout_ms() == 30_000
    assert GroupState().rebalance_timeout_ms() == 0


def test_a_stable_member_rejoining_with_other_topics_starts_a_rebalance() -> None:
    state = group_state.join(GroupState(), member("a", "t"), COUNTS)
    assert group_state.join(state, member("a", "t"), COUNTS) == state  # same topics: nothing
    moved = group_state.join(state, member("a", "t", "u"), COUNTS)
    assert (moved.phase, moved.generation) == ("stable", 2)
    assert moved.assignment["a"] == tuple(("t", p) for p in range(6)) + tuple(
        ("u", p) for p in range(3)
    )


def test_a_replaced_static_member_is_fenced_rather_than_taking_its_place_back() -> None:
    state = group_state.join(GroupState(), static("a1", "a"), COUNTS)
    restarted = group_state.join(state, static("a2", "a"), COUNTS)
    assert list(restarted.members) == ["a2"]
    # a1 was in the group and a2 holds its instance now: a1 rejoining is fenced.
    with pytest.raises(FencedInstanceIdError):
        group_state.join(restarted, static("a1", "a"), COUNTS, may_take_over=False)


def test_a_heartbeat_in_an_old_generation_gets_illegal_generation() -> None:
    state = group_state.join(GroupState(), member("a"), COUNTS)
    state = group_state.join(state, member("b"), COUNTS)
    state = group_state.join(state, member("a"), COUNTS)
    assert (state.phase, state.generation) == ("stable", 2)
    after, error = group_state.heartbeat(state, "a", 1, COUNTS)
    assert isinstance(error, IllegalGenerationError) and after == state
    assert group_state.heartbeat(state, "a", 2, COUNTS) == (state, None)


def test_expiring_when_every_member_is_alive_changes_nothing() -> None:
    state = group_state.join(GroupState(), member("a"), COUNTS)
    state = group_state.join(state, member("b"), COUNTS)
    state = group_state.join(state, member("a"), COUNTS)
    assert state.phase == "stable"
    # The coordinator passes the live sessions on every change: no rebalance for that.
    assert group_state.expire(state, {"a", "b"}) == state
    assert group_state.expire(state, {"a", "b", "someone-else"}) == state
