"""The controller's partition state machine, driven directly (it is pure: no I/O, no time)."""

from __future__ import annotations

import itertools
import random

import pytest

from services.controller.state import (
    NO_LEADER,
    Broker,
    ClusterState,
    ElectionType,
    PartitionChange,
    PartitionRecord,
    Topic,
)
from tidelog.errors import (
    ElectionNotNeededError,
    FencedLeaderEpochError,
    InvalidRequestError,
    InvalidUpdateVersionError,
    NotControllerError,
    NotLeaderOrFollowerError,
    PreferredLeaderNotAvailableError,
    StaleBrokerEpochError,
)

UNCLEAN_KEY = "unclean.leader.election.enable"


def cluster(brokers: int = 3, *, unclean: bool = False) -> ClusterState:
    state = ClusterState()
    for b in range(brokers):
        state.on_broker_up(Broker(b, "127.0.0.1", 9000 + b, epoch=100 + b))
    configs = {UNCLEAN_KEY: "true"} if unclean else {}
    topic = Topic("t", "id-t", ((0, 1, 2), (1, 2, 0), (2, 0, 1)), configs)
    state.add_topic(topic)
    state.apply(state.new_topic_partitions(topic))
    return state


def step(state: ClusterState, changes: list[PartitionChange]) -> list[PartitionChange]:
    state.apply(changes)
    return changes


def test_new_partitions_lead_with_preferred_replica_and_full_isr() -> None:
    state = cluster()
    assert state.partitions[("t", 0)] == PartitionRecord(0, 0, (0, 1, 2), 0)
    assert state.partitions[("t", 1)].leader == 1
    assert state.partitions[("t", 2)].leader == 2


def test_new_partitions_skip_dead_brokers() -> None:
    state = ClusterState()
    state.on_broker_up(Broker(1, "h", 1, epoch=1))
    topic = Topic("x", "id", ((0, 1),), {})
    state.add_topic(topic)
    (change,) = state.new_topic_partitions(topic)
    assert change.new.leader == 1
    assert change.new.isr == (1,)


def test_leader_death_elects_first_live_isr_member_with_higher_epoch() -> None:
    state = cluster()
    changes = step(state, state.on_broker_down(0))
    by_key = {c.key: c.new for c in changes}
    assert by_key[("t", 0)] == PartitionRecord(1, 1, (1, 2), 1)
    # Partitions it followed keep their leader and epoch, but lose it from the ISR.
    assert by_key[("t", 1)].leader == 1 and by_key[("t", 1)].leader_epoch == 0
    assert 0 not in by_key[("t", 1)].isr
    assert by_key[("t", 1)].partition_epoch == 1


def test_a_replica_that_registered_again_after_its_isr_was_decided_leaves_it() -> None:
    """A broker that died and came back while no controller was active (a registration
    epoch newer than the partition's last write) is taken out of that partition's ISR,
    and out of its leadership, by the controller taking office: it may have returned
    with an empty disk. An ISR whose members all restarted keeps its members, and its
    restarted leader leads a new epoch (a follower ahead at the old one must see the
    divergence)."""
    state = cluster()  # brokers' epochs 100-102; t-0 led by 0, t-1 by 1, t-2 by 2
    state.on_broker_up(Broker(1, "127.0.0.1", 9001, epoch=500))  # 1 restarted unseen
    decided = {("t", 0): 300, ("t", 1): 300, ("t", 2): 600}  # t-2 written after it
    changes = {c.key: c.new for c in step(state, state.evict_restarted(decided))}
    assert set(changes) == {("t", 0), ("t", 1)}
    assert changes[("t", 0)].leader == 0 and changes[("t", 0)].isr == (0, 2)
    assert changes[("t", 1)].leader == 2 and 1 not in changes[("t", 1)].isr  # re-elected
    assert changes[("t", 1)].leader_epoch == 1
    # Written now (revisions past its registration): nothing more to do.
    assert state.evict_restarted({("t", 0): 700, ("t", 1): 700, ("t", 2): 600}) == []
    everyone = ClusterState()
    for b in range(3):
        everyone.on_broker_up(Broker(b, "h", 9000 + b, epoch=100 + b))
    topic = Topic("u", "id-u", ((0, 1, 2),), {})
    everyone.add_topic(topic)
    everyone.apply(everyone.new_topic_partitions(topic))
    for b in range(3):
        everyone.on_broker_up(Broker(b, "h", 9000 + b, epoch=900 + b))
    before = everyone.partitions[("u", 0)]
    (bumped,) = step(everyone, everyone.evict_restarted({("u", 0): 300}))
    assert bumped.new.leader == before.leader and bumped.new.isr == before.isr
    assert bumped.new.leader_epoch == before.leader_epoch + 1
    assert everyone.evict_restarted({("u", 0): 1000}) == []  # written since: done


def test_a_restart_is_told_by_the_records_broker_epochs_whenever_it_was_written() -> None:
    """A record stamped with its ISR members' broker epochs shows a member that restarted
    unseen even when the record was written after the restart (the controller stamped
    the epoch it knew: the old one); the revision test alone missed it (found by an
    audit). A stamp equal to the registration is no restart, whatever the revision."""
    state = cluster()  # brokers' epochs 100-102
    stamped = {key: record.stamped(state.brokers) for key, record in state.partitions.items()}
    state.partitions.update(stamped)
    assert state.partitions[("t", 0)].isr_epochs == (100, 101, 102)
    assert state.partitions[("t", 0)] == PartitionRecord(0, 0, (0, 1, 2), 0)  # not compared
    state.brokers[1] = Broker(1, "127.0.0.1", 9001, epoch=500)  # restarted unseen
    written_after = {key: 600 for key in state.partitions}  # every key rewritten since
    changes = {c.key: c.new for c in step(state, state.evict_restarted(written_after))}
    assert set(changes) == {("t", 0), ("t", 1), ("t", 2)}
    assert all(1 not in record.isr for record in changes.values())
    assert changes[("t", 1)].leader != 1
    restamped = {key: record.stamped(state.brokers) for key, record in state.partitions.items()}
    state.partitions.update(restamped)
    assert state.evict_restarted({key: 1 for key in state.partitions}) == []


def test_last_isr_member_death_takes_partition_offline_and_keeps_it_in_isr() -> None:
    state = cluster()
    step(state, state.on_broker_down(1))
    step(state, state.on_broker_down(2))
    step(state, state.on_broker_down(0))
    record = state.partitions[("t", 0)]
    assert record.leader == NO_LEADER
    assert record.isr == (0,)  # the last in-sync replica, the only safe future leader
    # Broker 1 returns: it is not in the ISR, so with unclean election off nothing happens.
    assert state.on_broker_up(Broker(1, "h", 1, epoch=7)) == []
    # Broker 0 returns: it is the ISR, so it leads again with a new epoch.
    changes = step(state, state.on_broker_up(Broker(0, "h", 1, epoch=8)))
    assert {c.key: c.new.leader for c in changes}[("t", 0)] == 0
    assert state.partitions[("t", 0)].leader_epoch > record.leader_epoch


def test_unclean_topic_elects_out_of_sync_replica() -> None:
    state = cluster(unclean=True)
    step(state, state.on_broker_down(1))
    step(state, state.on_broker_down(2))
    step(state, state.on_broker_down(0))
    changes = step(state, state.on_broker_up(Broker(1, "h", 1, epoch=9)))
    record = {c.key: c.new for c in changes}[("t", 0)]
    assert record.leader == 1
    assert record.isr == (1,)


def test_takeover_evicts_brokers_that_died_unseen() -> None:
    # What a new controller reads: broker 0 died while no controller was active; it still
    # leads t-0 and sits in every ISR.
    state = cluster()
    del state.brokers[0]
    assert state.dead_replicas() == [0]
    changes = step(state, state.on_broker_down(0))
    assert {c.key: c.new.leader for c in changes}[("t", 0)] == 1
    assert state.dead_replicas() == []
    assert all(0 not in record.isr for record in state.partitions.values())


def test_takeover_elects_offline_partitions_whose_isr_member_returned_unseen() -> None:
    state = cluster()
    for broker_id in (0, 1, 2):  # 2 dies last: the last ISR member of everything
        step(state, state.on_broker_down(broker_id))
    assert all(r.leader == NO_LEADER and r.isr == (2,) for r in state.partitions.values())
    assert state.elect_offline_partitions() == []  # nobody eligible yet
    # Broker 2 re-registered while no controller was active: on_broker_up never ran.
    state.brokers[2] = Broker(2, "h", 2, epoch=300)
    before = dict(state.partitions)
    elected = step(state, state.elect_offline_partitions())
    assert {c.key for c in elected} == set(before)
    for change in elected:
        assert change.new.leader == 2
        assert change.new.leader_epoch == before[change.key].leader_epoch + 1
    assert state.elect_offline_partitions() == []  # idempotent once applied


def test_returning_broker_does_not_take_back_leadership() -> None:
    state = cluster()
    step(state, state.on_broker_down(0))
    assert state.on_broker_up(Broker(0, "h", 1, epoch=200)) == []
    assert state.partitions[("t", 0)].leader == 1


def test_alter_partition_expand_then_preferred_election() -> None:
    state = cluster()
    step(state, state.on_broker_down(0))
    state.on_broker_up(Broker(0, "h", 1, epoch=200))
    old = state.partitions[("t", 0)]
    change = state.alter_partition(
        broker_id=1,
        broker_epoch=101,
        topic="t",
        partition=0,
        leader_epoch=old.leader_epoch,
        new_isr=[1, 2, 0],
        partition_epoch=old.partition_epoch,
        joining={0: 200},
    )
    assert change.new.isr == (0, 1, 2)  # canonical order: assignment order
    assert change.new.leader_epoch == old.leader_epoch
    state.apply([change])
    assert ("t", 0) in state.imbalanced_partitions()
    changes, errors = state.elect(ElectionType.PREFERRED, [("t", 0), ("t", 1)])
    assert [c.key for c in changes] == [("t", 0)]
    assert changes[0].new.leader == 0
    assert isinstance(errors[("t", 1)], ElectionNotNeededError)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"broker_id": 1}, NotLeaderOrFollowerError),
        ({"leader_epoch": -1}, FencedLeaderEpochError),
        ({"leader_epoch": 5}, NotControllerError),  # newer: a stale controller
        ({"partition_epoch": 7}, InvalidUpdateVersionError),
        ({"broker_epoch": 999}, StaleBrokerEpochError),
        ({"new_isr": [1, 2]}, InvalidRequestError),  # leader missing
        ({"new_isr": [0, 0, 1]}, InvalidRequestError),  # duplicate
        ({"new_isr": [0, 5]}, InvalidRequestError),  # not a replica
    ],
)
def test_alter_partition_rejections_change_nothing(
    overrides: dict[str, object], error: type[Exception]
) -> None:
    state = cluster()
    before = dict(state.partitions)
    args: dict[str, object] = {
        "broker_id": 0,
        "broker_epoch": 100,
        "topic": "t",
        "partition": 0,
        "leader_epoch": 0,
        "new_isr": [0, 1],
        "partition_epoch": 0,
    }
    args.update(overrides)
    if overrides.get("broker_id") == 1:
        args["broker_epoch"] = 101
    with pytest.raises(error):
        state.alter_partition(**args)  # type: ignore[arg-type]
    assert state.partitions == before


def test_alter_partition_cannot_add_a_dead_broker() -> None:
    state = cluster()
    step(state, state.on_broker_down(2))
    old = state.partitions[("t", 0)]
    with pytest.raises(InvalidRequestError, match="not live"):
        state.alter_partition(
            broker_id=0,
            broker_epoch=100,
            topic="t",
            partition=0,
            leader_epoch=old.leader_epoch,
            new_isr=[0, 1, 2],
            partition_epoch=old.partition_epoch,
        )


def test_alter_partition_admits_only_the_incarnation_that_caught_up() -> None:
    """KIP-841: broker 0 caught up as epoch 200, then restarted (perhaps with an empty
    disk) as epoch 300 before the leader's proposal reached the controller. Letting it in
    on its old self's progress would make it electable without the ISR's records."""
    state = cluster()
    step(state, state.on_broker_down(0))
    state.on_broker_up(Broker(0, "h", 1, epoch=200))
    step(state, state.on_broker_down(0))
    state.on_broker_up(Broker(0, "h", 1, epoch=300))
    old = state.partitions[("t", 0)]
    before = dict(state.partitions)
    args: dict[str, object] = {
        "broker_id": 1,
        "broker_epoch": 101,
        "topic": "t",
        "partition": 0,
        "leader_epoch": old.leader_epoch,
        "new_isr": [0, 1, 2],
        "partition_epoch": old.partition_epoch,
    }
    for joining in ({0: 200}, {}, {0: -1}):
        with pytest.raises(InvalidRequestError, match="incarnation"):
            state.alter_partition(**args, joining=joining)  # type: ignore[arg-type]
    assert state.partitions == before
    change = state.alter_partition(**args, joining={0: 300})  # type: ignore[arg-type]
    assert change.new.isr == (0, 1, 2)


def test_controlled_shutdown_moves_leaders_and_reports_stuck_partitions() -> None:
    state = cluster()
    single = Topic("solo", "id-s", ((0,),), {})
    state.add_topic(single)
    state.apply(state.new_topic_partitions(single))
    changes, remaining = state.controlled_shutdown(0, 100)
    state.apply(changes)
    # Kafka's rule: a partition of one replica can move nowhere, and is not reported
    # (the stopping broker used to wait its whole controlled-shutdown timeout for it).
    assert remaining == []
    assert state.partitions[("solo", 0)].leader == 0
    assert state.partitions[("t", 0)].leader == 1
    assert all(0 not in state.partitions[("t", p)].isr for p in range(3))
    # A broker in controlled shutdown is never elected.
    step(state, state.on_broker_down(1))
    assert state.partitions[("t", 0)].leader == 2
    with pytest.raises(StaleBrokerEpochError):
        state.controlled_shutdown(2, 1)


def test_controlled_shutdown_reports_a_replicated_partition_with_no_other_replica_in_sync() -> None:
    state = cluster()
    pair = Topic("pair", "id-p", ((0, 1),), {})
    state.add_topic(pair)
    state.apply(state.new_topic_partitions(pair))
    step(state, state.on_broker_down(1))
    state.on_broker_up(Broker(1, "127.0.0.1", 9001, epoch=201))  # back, not in sync yet
    assert state.partitions[("pair", 0)].isr == (0,)
    changes, remaining = state.controlled_shutdown(0, 100)
    state.apply(changes)
    assert remaining == [("pair", 0)]
    assert state.partitions[("pair", 0)].leader == 0


def test_a_broker_in_controlled_shutdown_cannot_join_an_isr() -> None:
    """A stopping broker taken back into an ISR would be elected again, leaderships
    bouncing onto a broker about to stop (a mutation doing so went unseen)."""
    state = cluster()
    changes, _ = state.controlled_shutdown(0, 100)
    state.apply(changes)
    old = state.partitions[("t", 0)]
    with pytest.raises(InvalidRequestError, match="shutting down"):
        state.alter_partition(
            broker_id=old.leader,
            broker_epoch=101,
            topic="t",
            partition=0,
            leader_epoch=old.leader_epoch,
            new_isr=[*old.isr, 0],
            partition_epoch=old.partition_epoch,
            joining={0: 100},
        )
    assert state.partitions[("t", 0)] == old


def test_a_live_preferred_replica_out_of_the_isr_is_not_elected() -> None:
    """Preferred election only moves leadership to an in-sync preferred replica: a live
    one that fell behind would lose every record it lacks (acks=all ones included). A
    mutation electing it went unseen."""
    state = cluster()
    step(state, state.on_broker_down(0))
    state.on_broker_up(Broker(0, "h", 1, epoch=200))  # live again, not back in the ISR
    before = state.partitions[("t", 0)]
    assert before.leader == 1 and 0 not in before.isr
    changes, errors = state.elect(ElectionType.PREFERRED, [("t", 0)])
    assert changes == []
    assert isinstance(errors[("t", 0)], PreferredLeaderNotAvailableError)
    assert state.partitions[("t", 0)] == before


def test_a_topic_turning_unclean_elects_its_offline_partitions_out_of_sync() -> None:
    """``elect_offline_partitions_of`` judges under the configs it is given (those about to
    be written), so turning unclean election on elects the live out-of-sync replica."""
    state = cluster()
    for b in (1, 2, 0):
        step(state, state.on_broker_down(b))
    assert state.on_broker_up(Broker(2, "h", 1, epoch=300)) == []  # out of sync: no leader
    topic = state.topics["t"]
    assert state.elect_offline_partitions_of(topic) == []  # the topic has not opted in
    unclean = Topic(topic.name, topic.topic_id, topic.assignment, {UNCLEAN_KEY: "true"})
    changes = state.elect_offline_partitions_of(unclean)
    assert [c.partition for c in changes] == [0, 1, 2]  # broker 2 replicates each
    assert all((c.new.leader, c.new.isr) == (2, (2,)) for c in changes)
    assert all(c.new.leader_epoch == c.old.leader_epoch + 1 for c in changes)


def test_unclean_election_on_demand() -> None:
    state = cluster()
    for b in (1, 2, 0):
        step(state, state.on_broker_down(b))
    state.on_broker_up(Broker(2, "h", 1, epoch=300))
    changes, errors = state.elect(ElectionType.UNCLEAN, [("t", 0)])
    assert not errors
    assert changes[0].new.leader == 2
    _, errors = state.elect(ElectionType.PREFERRED, [("t", 1)])
    assert isinstance(errors[("t", 1)], PreferredLeaderNotAvailableError)


@pytest.mark.parametrize("seed", range(40))
def test_random_event_sequences_keep_invariants(seed: int) -> None:
    """A seeded simulation: any sequence of events keeps the state machine's invariants."""
    rng = random.Random(seed)
    brokers = rng.randint(1, 5)
    state = ClusterState()
    epoch = 0
    for b in range(brokers):
        epoch += 1
        state.on_broker_up(Broker(b, "h", b, epoch=epoch))
    for t in range(rng.randint(1, 3)):
        rf = rng.randint(1, brokers)
        assignment = tuple(tuple(rng.sample(range(brokers), rf)) for _ in range(rng.randint(1, 6)))
        topic = Topic(f"t{t}", f"id{t}", assignment, {"unclean.leader.election.enable": "false"})
        state.add_topic(topic)
        state.apply(state.new_topic_partitions(topic))
    history: dict[tuple[str, int], list[PartitionRecord]] = {
        key: [record] for key, record in state.partitions.items()
    }
    for _ in range(200):
        event = rng.choice(["down", "up", "expand", "shrink", "shutdown", "preferred"])
        changes: list[PartitionChange] = []
        if event == "down" and state.brokers:
            changes = state.on_broker_down(rng.choice(state.live_broker_ids))
        elif event == "up":
            dead = [b for b in range(brokers) if b not in state.brokers]
            if dead:
                epoch += 1
                changes = state.on_broker_up(Broker(rng.choice(dead), "h", 0, epoch=epoch))
        elif event in ("expand", "shrink"):
            key = rng.choice(sorted(state.partitions))
            record = state.partitions[key]
            replicas = state.replicas(*key)
            if record.leader != NO_LEADER:
                live = [b for b in replicas if b in state.brokers]
                if event == "expand":
                    proposal = sorted(set(record.isr) | set(live))
                else:
                    proposal = [record.leader]
                try:
                    changes = [
                        state.alter_partition(
                            broker_id=record.leader,
                            broker_epoch=state.brokers[record.leader].epoch,
                            topic=key[0],
                            partition=key[1],
                            leader_epoch=record.leader_epoch,
                            new_isr=proposal,
                            partition_epoch=record.partition_epoch,
                            joining={b: state.brokers[b].epoch for b in proposal},
                        )
                    ]
                except InvalidRequestError:
                    changes = []
        elif event == "shutdown" and state.brokers:
            b = rng.choice(state.live_broker_ids)
            changes, _ = state.controlled_shutdown(b, state.brokers[b].epoch)
        elif event == "preferred":
            changes, _ = state.elect(ElectionType.PREFERRED, state.imbalanced_partitions())
        state.apply(changes)
        for change in changes:
            history[change.key].append(change.new)
        for key, record in state.partitions.items():
            replicas = state.replicas(*key)
            assert record.isr, f"{key}: empty ISR"
            assert set(record.isr) <= set(replicas), f"{key}: ISR outside replicas"
            if record.leader != NO_LEADER:
                assert record.leader in record.isr, f"{key}: leader outside ISR"
                assert record.leader in state.brokers, f"{key}: dead leader"
            records = history[key]
            for before, after in itertools.pairwise(records):
                assert after.partition_epoch == before.partition_epoch + 1
                assert after.leader_epoch >= before.leader_epoch
                if after.leader != before.leader:
                    assert after.leader_epoch == before.leader_epoch + 1
                # Without unclean election, a new leader was in the previous ISR.
                if after.leader not in (NO_LEADER, before.leader):
                    assert after.leader in before.isr, f"{key}: unclean election"


def test_a_broker_that_registered_again_unseen_is_no_longer_shutting_down() -> None:
    """Re-read registrations after a watch outage: broker 0, in controlled shutdown as
    epoch 100, stopped and registered again as 300 meanwhile. The new incarnation must be
    eligible again; broker 1, still shutting down as the same incarnation, stays so."""
    state = cluster()
    state.controlled_shutdown(0, 100)
    state.controlled_shutdown(1, 101)
    assert state.shutting_down == {0, 1}
    state.replace_brokers(
        {0: Broker(0, "h", 1, epoch=300), 1: state.brokers[1], 2: state.brokers[2]}
    )
    assert state.shutting_down == {1}


def test_the_imbalance_ratio_counts_every_partition_led_away_from_its_preferred_broker() -> None:
    """Kafka's auto rebalance: the share of a broker's preferred partitions that others
    lead, in sync or not, decides; only those in sync are then elected. Counting only the
    in-sync ones (found by an audit) kept caught-up partitions away from their preferred
    leader while others had not caught up."""
    state = ClusterState()
    for b in (0, 1):
        state.on_broker_up(Broker(b, "127.0.0.1", 9000 + b, epoch=100 + b))
    topic = Topic("t", "id-t", tuple((0, 1) for _ in range(10)), {})
    state.add_topic(topic)
    state.apply(state.new_topic_partitions(topic))
    # Broker 0, preferred for all 10, restarted: t-0 in sync again but led by 1, t-1..t-5
    # led by 1 with 0 still catching up, t-6..t-9 led by 0 again.
    state.partitions[("t", 0)] = PartitionRecord(1, 1, (0, 1), 2)
    for p in range(1, 6):
        state.partitions[("t", p)] = PartitionRecord(1, 1, (1,), 2)
    # 6 of 10 led elsewhere (60 % > 10 %): the one in sync goes back.
    assert state.imbalanced_partitions(10) == [("t", 0)]
    # 1 of 10 (10 %, not above): nothing moves.
    for p in range(1, 6):
        state.partitions[("t", p)] = PartitionRecord(0, 2, (0, 1), 3)
    assert state.imbalanced_partitions(10) == []
