"""Leader-side replication state: follower LEOs, the high watermark, ISR decisions."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from services.storage.log import Log
from services.storage.partition import Partition, PartitionState
from services.storage.replica_rules import (
    fetch_divergence,
    follower_high_watermark,
    follower_truncation,
)
from services.storage.replication import JOINER_FETCH_WINDOW_MS, LeaderReplicationState
from tidelog.clock import ManualClock
from tidelog.errors import NotLeaderOrFollowerError
from tidelog.records import encode_batch

LAG_MS = 1_000


def leader(
    *,
    isr: tuple[int, ...] = (1, 2, 3),
    leo: int = 0,
    hw: int = 0,
    epoch_start: int = 0,
    replicas: tuple[int, ...] = (1, 2, 3),
) -> LeaderReplicationState:
    return LeaderReplicationState(
        local_broker_id=1,
        replicas=replicas,
        isr=isr,
        leader_epoch=4,
        partition_epoch=9,
        high_watermark=hw,
        log_end_offset=leo,
        leader_epoch_start_offset=epoch_start,
        now_ms=0,
    )


def test_high_watermark_is_min_leo_over_isr_and_monotonic() -> None:
    state = leader()
    assert not state.on_leader_append(10)
    assert state.high_watermark == 0
    assert not state.on_follower_fetch(2, 10, now_ms=1)
    assert state.on_follower_fetch(3, 7, now_ms=1)
    assert state.high_watermark == 7
    # A follower refetching an older offset (it truncated) never lowers the HW.
    state.on_follower_fetch(3, 5, now_ms=2)
    assert state.high_watermark == 7
    assert state.on_follower_fetch(3, 10, now_ms=3)
    assert state.high_watermark == 10


def test_single_replica_isr_commits_on_append() -> None:
    state = leader(isr=(1,))
    assert state.on_leader_append(5)
    assert state.high_watermark == 5


def test_new_leader_does_not_claim_offsets_it_lacks() -> None:
    assert leader(leo=3, hw=8).high_watermark == 3


def test_lagging_follower_is_proposed_for_removal_after_lag_limit() -> None:
    state = leader(isr=(1, 2, 3))
    state.on_leader_append(100)
    state.on_follower_fetch(2, 100, now_ms=10)
    state.on_follower_fetch(3, 50, now_ms=10)  # behind, but it started as caught up at 0
    assert state.propose_isr_change(now_ms=900, replica_lag_time_max_ms=LAG_MS) is None
    state.on_follower_fetch(2, 100, now_ms=1_500)
    proposal = state.propose_isr_change(now_ms=1_500, replica_lag_time_max_ms=LAG_MS)
    assert proposal is not None
    assert proposal.new_isr == (1, 2)
    assert (proposal.leader_epoch, proposal.partition_epoch) == (4, 9)
    # One proposal at a time.
    assert state.propose_isr_change(now_ms=1_600, replica_lag_time_max_ms=LAG_MS) is None


def test_follower_catching_up_to_the_previous_leo_counts_as_caught_up() -> None:
    state = leader()
    state.on_leader_append(100)
    state.on_follower_fetch(2, 50, now_ms=500)  # leader LEO at this fetch: 100
    state.on_leader_append(200)
    state.on_follower_fetch(2, 100, now_ms=1_400)  # reached the LEO of its previous fetch
    assert state.followers[2].last_caught_up_ms == 500
    assert 2 not in state.out_of_sync(now_ms=1_400, replica_lag_time_max_ms=LAG_MS)


def test_pending_shrink_keeps_hw_behind_the_member_being_removed() -> None:
    state = leader()
    state.on_leader_append(100)
    state.on_follower_fetch(2, 100, now_ms=1_200)
    proposal = state.propose_isr_change(now_ms=1_200, replica_lag_time_max_ms=LAG_MS)
    assert proposal is not None and proposal.new_isr == (1, 2)
    # Until the controller commits the shrink, broker 3 (LEO unknown) still holds the HW.
    assert state.high_watermark == 0
    assert state.on_isr_committed((1, 2), partition_epoch=10)
    assert state.high_watermark == 100


def test_expansion_needs_hw_and_epoch_start() -> None:
    state = leader(isr=(1, 2), leo=100, hw=0, epoch_start=80)
    state.on_follower_fetch(2, 100, now_ms=1)
    assert state.high_watermark == 100
    state.on_follower_fetch(3, 90, now_ms=1)
    assert state.ready_to_join() == []  # below the HW
    state.on_follower_fetch(3, 100, now_ms=2)
    proposal = state.propose_isr_change(now_ms=2, replica_lag_time_max_ms=LAG_MS)
    assert proposal is not None and proposal.new_isr == (1, 2, 3)
    state.on_isr_rejected()
    assert state.pending is None


def test_expansion_waits_for_the_epoch_start_above_the_hw() -> None:
    """A new leader's HW may be below the start of its epoch (its own earlier records
    were never committed): a joiner must also hold the epoch start, or it could join
    without the records the new leader's epoch begins with (Kafka's KIP-101 rule)."""
    state = leader(isr=(1, 2), leo=100, hw=0, epoch_start=80)
    state.on_follower_fetch(2, 60, now_ms=1)
    assert state.high_watermark == 60
    state.on_follower_fetch(3, 70, now_ms=1)  # above the HW, below the epoch start
    assert state.ready_to_join() == []
    state.on_follower_fetch(3, 80, now_ms=2)
    assert state.ready_to_join() == [3]


def test_pending_expansion_already_waits_for_the_joiner() -> None:
    state = leader(isr=(1,), leo=10, hw=10)
    state.on_follower_fetch(2, 10, now_ms=1)
    assert state.propose_isr_change(now_ms=1, replica_lag_time_max_ms=LAG_MS) is not None
    state.on_leader_append(20)
    assert state.high_watermark == 10  # maximal ISR {1, 2}: broker 2 is at 10
    state.on_follower_fetch(2, 20, now_ms=2)
    assert state.high_watermark == 20


def test_unknown_follower_is_rejected() -> None:
    with pytest.raises(KeyError):
        leader().on_follower_fetch(7, 0, now_ms=0)


@pytest.mark.parametrize("seed", range(30))
def test_random_progress_keeps_invariants(seed: int) -> None:
    rng = random.Random(seed)
    state = leader(isr=(1, 2, 3))
    leo = 0
    follower_leo = {2: 0, 3: 0}
    now = 0
    previous_hw = 0
    for _ in range(300):
        now += rng.randint(0, 400)
        action = rng.random()
        if action < 0.3:
            leo += rng.randint(1, 50)
            state.on_leader_append(leo)
        elif action < 0.8:
            b = rng.choice((2, 3))
            follower_leo[b] = rng.randint(follower_leo[b], leo)
            state.on_follower_fetch(b, follower_leo[b], now_ms=now)
        else:
            proposal = state.propose_isr_change(now_ms=now, replica_lag_time_max_ms=LAG_MS)
            if proposal is not None:
                assert 1 in proposal.new_isr
                if rng.random() < 0.8:
                    state.on_isr_committed(proposal.new_isr, state.partition_epoch + 1)
                else:
                    state.on_isr_rejected()
        assert previous_hw <= state.high_watermark <= leo
        for b in state.maximal_isr:
            if b != 1:
                assert state.high_watermark <= max(follower_leo[b], 0)
        previous_hw = state.high_watermark


def test_follower_drops_an_empty_epoch_it_led_so_it_can_fetch_again(tmp_path: Path) -> None:
    """Regression (found by tests/sim, seed 0): a replica that led epoch 1 without appending,
    then follows a leader that never had epoch 1, must drop that epoch when it reconciles.

    Before the fix ``Partition.follower_truncate`` skipped ``Log.truncate_to`` when the
    target was its log end, so epoch 1 stayed the latest in its cache; every fetch named
    it as the last fetched epoch, the leader answered "diverging" (KIP-320), the follower
    truncated to the same offset again, and it never replicated another record.
    """
    source = Log.open(tmp_path / "source")
    source.append(encode_batch([b"a", b"b", b"c"]), leader_epoch=0)
    batches = source.read(0, 1 << 20)
    follower = Partition("t", 0, Log.open(tmp_path / "t-0"), broker_id=2)
    follower.apply_state(PartitionState("t", 0, 1, 0, (1, 2), (1, 2), 0))
    follower.follower_append(0, batches, 3)
    follower.apply_state(PartitionState("t", 0, 2, 1, (1, 2), (1, 2), 1))  # leads, no data
    follower.apply_state(PartitionState("t", 0, 1, 2, (1, 2), (1, 2), 2))
    assert follower.follower_state(2) == (3, 1)

    # The new leader's log: epoch 0 up to 3, then its own epoch 2.
    leader_log = Log.open(tmp_path / "leader")
    leader_log.append(batches, assign_offsets=False)
    leader_log.assign_epoch_start_offset(2)
    leo, epoch = follower.follower_state(2)
    assert fetch_divergence(
        last_fetched_epoch=epoch,
        fetch_offset=leo,
        leader_end_offset_for=leader_log.end_offset_for_epoch,
    ) == (0, 3)
    answer_epoch, answer_end = leader_log.end_offset_for_epoch(epoch)
    step = follower_truncation(
        log_end_offset=leo,
        high_watermark=follower.high_watermark,
        leader_epoch=answer_epoch,
        leader_end_offset=answer_end,
        own_end_offset_for=lambda e: follower.follower_end_offset_for_epoch(2, e),
    )
    assert step == (3, True)
    assert follower.follower_truncate(2, step.target) == 3
    # Epoch 1 is gone: the next fetch does not diverge, and no data was lost.
    leo, epoch = follower.follower_state(2)
    assert (leo, epoch) == (3, 0)
    assert (
        fetch_divergence(
            last_fetched_epoch=epoch,
            fetch_offset=leo,
            leader_end_offset_for=leader_log.end_offset_for_epoch,
        )
        is None
    )


def test_leader_keeps_its_pending_isr_expansion_when_the_same_state_is_resent(
    tmp_path: Path,
) -> None:
    """Regression (found by tests/sim, seed 84): a LeaderAndIsr resent with the partition
    epoch the leader already has must not count as "the ISR in force".

    Before the fix ``Partition.apply_state`` took it (``>=``), which forgot the pending
    expansion: the HW then ran over the old ISR {0, 2} while the controller had already
    committed {0, 1, 2}, and an acks=all write was acknowledged that broker 1 - electable
    at once - did not hold.
    """
    leader = Partition("t", 0, Log.open(tmp_path / "t-0"), broker_id=2)
    state = PartitionState("t", 0, 2, 1, (2, 0), (1, 2, 0), 1, {"min.insync.replicas": "2"})
    leader.apply_state(state)
    leader.append(encode_batch([b"a"] * 5), acks_all=True)
    leader.read(5, 1 << 20, replica_id=0, current_leader_epoch=1)
    leader.read(5, 1 << 20, replica_id=1, current_leader_epoch=1)
    assert leader.high_watermark == 5
    proposal = leader.propose_isr_change()
    assert proposal is not None and proposal.new_isr == (1, 2, 0)

    result = leader.append(encode_batch([b"b"] * 5), acks_all=True)
    assert result.waiter is not None
    leader.read(10, 1 << 20, replica_id=0, current_leader_epoch=1)
    leader.apply_state(state)  # the controller's retry of what the leader already has
    # Broker 1 (at 5) is in the maximal ISR: nothing past 5 is committed or acknowledged.
    assert leader.high_watermark == 5
    assert not result.waiter.done.is_set()
    leader.on_isr_result(proposal, (1, 2, 0), 2)
    assert leader.high_watermark == 5
    leader.read(10, 1 << 20, replica_id=1, current_leader_epoch=1)
    assert leader.high_watermark == 10
    assert result.waiter.done.is_set() and result.waiter.error is None


def test_failed_expansion_keeps_holding_the_high_watermark_until_a_committed_state() -> None:
    """Regression (found by tests/sim, seed 578): an AlterPartition whose reply was lost
    (the leader cut off from the controller, a timeout) may have been applied. Before the
    fix the leader forgot the joining replica at once and advanced the HW without it, while
    the controller's ISR already held it: records were acknowledged that an electable ISR
    member lacked."""
    state = leader(isr=(1, 2))
    state.on_leader_append(10)
    state.on_follower_fetch(2, 10, now_ms=1)
    state.on_follower_fetch(3, 10, now_ms=1)
    proposal = state.propose_isr_change(now_ms=2, replica_lag_time_max_ms=LAG_MS)
    assert proposal is not None and proposal.new_isr == (1, 2, 3)
    state.on_isr_rejected()  # the reply never came
    assert 3 in state.maximal_isr
    state.on_leader_append(20)
    state.on_follower_fetch(2, 20, now_ms=3)
    assert state.high_watermark == 10  # broker 3 may be in the ISR: wait for it
    # A retry may be proposed; the next committed state settles it either way.
    assert state.propose_isr_change(now_ms=4, replica_lag_time_max_ms=LAG_MS) == proposal
    state.on_isr_rejected()
    assert not state.on_isr_committed((1, 2, 3), 10)
    state.on_follower_fetch(3, 20, now_ms=5)
    assert state.high_watermark == 20
    # A committed state without it releases the HW from broker 3.
    other = leader(isr=(1, 2))
    other.on_leader_append(10)
    other.on_follower_fetch(2, 10, now_ms=1)
    other.on_follower_fetch(3, 10, now_ms=1)
    assert other.propose_isr_change(now_ms=2, replica_lag_time_max_ms=LAG_MS) is not None
    other.on_isr_rejected()
    other.on_leader_append(20)
    # Broker 3 fetches no more (a live one fetching would hold the HW as a joiner).
    other.on_follower_fetch(2, 20, now_ms=3 + JOINER_FETCH_WINDOW_MS)
    assert other.high_watermark == 10
    assert other.on_isr_committed((1, 2), 10)
    assert other.high_watermark == 20


def test_long_polls_wake_only_on_what_their_fetch_can_answer_with(tmp_path: Path) -> None:
    """Kafka's DelayedFetch rules: a follower's fetch wakes on new data (it reads up to the
    log end), a consumer's on a moved high watermark (it reads below it), both on a role
    change. Before, every append and every HW move woke every waiting fetch of the
    partition: on RF=3 the consumer's long poll woke for data it could not read yet, and
    the first follower's for the HW the second follower's fetch moved."""
    leader = Partition("t", 0, Log.open(tmp_path / "t-0"), broker_id=0)
    leader.apply_state(PartitionState("t", 0, 0, 1, (0, 1, 2), (0, 1, 2), 1))
    follower_fetch, consumer_fetch = threading.Event(), threading.Event()
    leader.watch(follower_fetch, replica=True)
    leader.watch(consumer_fetch, replica=False)

    leader.append(encode_batch([b"a"] * 3))  # new data; the HW waits for the followers
    assert follower_fetch.is_set() and not consumer_fetch.is_set()
    follower_fetch.clear()

    leader.read(3, 1 << 20, replica_id=1, current_leader_epoch=1)  # one follower has it
    assert not follower_fetch.is_set() and not consumer_fetch.is_set()
    leader.read(3, 1 << 20, replica_id=2, current_leader_epoch=1)  # HW 0 -> 3
    assert leader.high_watermark == 3
    assert consumer_fetch.is_set() and not follower_fetch.is_set()
    consumer_fetch.clear()

    leader.apply_state(PartitionState("t", 0, 1, 2, (0, 1, 2), (0, 1, 2), 2))  # deposed
    assert follower_fetch.is_set() and consumer_fetch.is_set()

    # Unwatched fetches are not woken any more, whichever set they were in.
    follower_fetch.clear()
    consumer_fetch.clear()
    leader.unwatch(follower_fetch, replica=True)
    leader.unwatch(consumer_fetch, replica=False)
    leader.apply_state(PartitionState("t", 0, 0, 3, (0, 1, 2), (0, 1, 2), 3))
    assert not follower_fetch.is_set() and not consumer_fetch.is_set()


def test_a_watch_since_a_count_wakes_for_changes_after_that_count(tmp_path: Path) -> None:
    """A waiting fetch reads each partition once, noting ``changes`` before the read, and
    registers with that count: a change between its read and its registration must wake
    it at once (it used to read every partition a second time to find out), and only a
    change of the kind its fetch answers with counts."""
    leader = Partition("t", 0, Log.open(tmp_path / "t-0"), broker_id=0)
    leader.apply_state(PartitionState("t", 0, 0, 1, (0, 1, 2), (0, 1, 2), 1))
    follower_seen = leader.changes(replica=True)
    consumer_seen = leader.changes(replica=False)
    leader.append(encode_batch([b"a"]))  # new data; the HW waits for the followers

    follower_fetch, consumer_fetch = threading.Event(), threading.Event()
    leader.watch(follower_fetch, replica=True, since=follower_seen)
    leader.watch(consumer_fetch, replica=False, since=consumer_seen)
    assert follower_fetch.is_set()  # the data arrived after its read
    assert not consumer_fetch.is_set()  # the HW did not move: nothing to answer with

    # Nothing changed since the counts noted now: no wake-up until something does.
    quiet = threading.Event()
    leader.unwatch(follower_fetch, replica=True)
    leader.watch(quiet, replica=True, since=leader.changes(replica=True))
    assert not quiet.is_set()
    leader.append(encode_batch([b"b"]))
    assert quiet.is_set()


def test_a_session_fetch_that_leaves_a_partition_out_still_counts_as_progress(
    tmp_path: Path,
) -> None:
    """A follower's fetch session names a partition only when its position moves; the
    leader counts every fetch of the session as its progress report on the others
    (``follower_fetched``), so an idle follower is not dropped from the ISR after the
    lag limit, while one that stopped fetching is."""
    clock = ManualClock(start_ms=1_000_000)
    leader = Partition("t", 0, Log.open(tmp_path / "t-0"), broker_id=0, clock=clock)
    leader.apply_state(PartitionState("t", 0, 0, 1, (0, 1, 2), (0, 1, 2), 1))
    leader.append(encode_batch([b"a"]))
    for follower in (1, 2):
        leader.read(1, 1 << 20, replica_id=follower, current_leader_epoch=1)
    assert leader.high_watermark == 1
    for _ in range(4):
        clock.advance(10_000)
        leader.follower_fetched(
            1, replica_id=1, current_leader_epoch=1, written_offset=None, broker_epoch=-1
        )
    proposal = leader.propose_isr_change(30_000)
    assert proposal is not None and proposal.new_isr == (0, 1)  # broker 2 went quiet
    with pytest.raises(NotLeaderOrFollowerError):
        leader.follower_fetched(
            1, replica_id=5, current_leader_epoch=1, written_offset=None, broker_epoch=-1
        )


def test_an_append_that_commits_at_once_wakes_consumers(tmp_path: Path) -> None:
    """With the leader alone in the ISR an append moves the HW itself: consumers wake."""
    leader = Partition("t", 0, Log.open(tmp_path / "t-0"), broker_id=0)
    leader.apply_state(PartitionState("t", 0, 0, 1, (0,), (0,), 1))
    consumer_fetch = threading.Event()
    leader.watch(consumer_fetch, replica=False)
    leader.append(encode_batch([b"a"]))
    assert leader.high_watermark == 1 and consumer_fetch.is_set()


def test_a_follower_hw_is_the_leaders_capped_by_its_leo_and_never_goes_back() -> None:
    assert follower_high_watermark(10, leader_high_watermark=40, log_end_offset=100) == 40
    assert follower_high_watermark(10, leader_high_watermark=40, log_end_offset=30) == 30
    # A new leader reporting a lower HW for a while does not take back what was learned.
    assert follower_high_watermark(50, leader_high_watermark=40, log_end_offset=100) == 50


def test_a_refused_expansion_does_not_hold_the_hw_but_a_lost_reply_does() -> None:
    """An error answer means the controller applied nothing: the proposed member does not
    count. No answer may hide an applied expansion: the member counts until the
    controller's next committed state (KIP-497's reasoning)."""
    for refused in (True, False):
        state = leader(isr=(1, 2), leo=10, hw=0)
        state.on_follower_fetch(2, 10, now_ms=1)
        state.on_follower_fetch(3, 10, now_ms=1)
        proposal = state.propose_isr_change(now_ms=1, replica_lag_time_max_ms=LAG_MS)
        assert proposal is not None and proposal.new_isr == (1, 2, 3)
        if refused:
            state.on_isr_refused()
        else:
            state.on_isr_rejected()
        assert state.pending is None
        state.on_leader_append(20)
        state.on_follower_fetch(2, 20, now_ms=2)
        assert state.high_watermark == (20 if refused else 10)


def test_a_follower_that_left_the_isr_is_not_proposed_again_until_it_fetches() -> None:
    """A dead follower's frozen log end (at or above the HW) used to make it "ready to
    join" on every pass; its progress starts over when it leaves the ISR."""
    state = leader(isr=(1, 2, 3), leo=10, hw=0)
    state.on_follower_fetch(2, 10, now_ms=1)
    state.on_follower_fetch(3, 10, now_ms=1)
    assert state.high_watermark == 10
    state.on_isr_committed((1, 2), partition_epoch=10)  # the controller evicted broker 3
    assert state.ready_to_join() == []
    assert state.propose_isr_change(now_ms=2, replica_lag_time_max_ms=LAG_MS) is None
    state.on_follower_fetch(3, 10, now_ms=3)  # it is back
    assert state.ready_to_join() == [3]


def test_an_isr_join_names_the_incarnation_that_caught_up_and_a_refusal_forgets_it() -> None:
    """KIP-841: the proposal carries the broker epoch each joiner's fetches carried, so the
    controller can refuse a join by a later incarnation (restarted, perhaps empty). A
    refused joiner's log end is forgotten until it fetches again: kept, it was proposed
    again every pass on the old incarnation's progress."""
    state = leader(isr=(1, 2), leo=10, hw=10)
    state.on_follower_fetch(2, 10, now_ms=1, broker_epoch=70)
    state.on_follower_fetch(3, 10, now_ms=1, broker_epoch=80)
    proposal = state.propose_isr_change(now_ms=1, replica_lag_time_max_ms=LAG_MS)
    assert proposal is not None and proposal.new_isr == (1, 2, 3)
    assert proposal.joining == ((3, 80),)
    state.on_isr_refused()  # broker 3 registered again meanwhile (epoch 90)
    assert state.ready_to_join() == []
    assert state.propose_isr_change(now_ms=2, replica_lag_time_max_ms=LAG_MS) is None
    state.on_follower_fetch(3, 10, now_ms=3, broker_epoch=90)  # the new incarnation
    proposal = state.propose_isr_change(now_ms=3, replica_lag_time_max_ms=LAG_MS)
    assert proposal is not None and proposal.joining == ((3, 90),)


def test_a_refusal_at_the_same_partition_epoch_resolves_members_of_lost_replies() -> None:
    """Found by an audit: broker 3's join got no answer (no controller), so it counted
    toward the HW as possibly in the ISR; then it died. The controller, back, refused the
    retried join (broker 3 is not live) with its state at this leader's partition epoch:
    its ISR is the one held here, so broker 3 is not in it and the HW moves on over
    {1, 2}. Before, broker 3 stayed counted and the HW froze at its last log end for good
    (no ISR change was ever pushed to settle it). A refusal with another epoch's state
    proves nothing and settles nothing."""
    for answer_epoch, released in ((9, True), (10, False), (-1, False)):
        state = leader(isr=(1, 2), leo=10, hw=0)
        state.on_follower_fetch(2, 10, now_ms=1)
        state.on_follower_fetch(3, 10, now_ms=1)
        assert state.propose_isr_change(now_ms=1, replica_lag_time_max_ms=LAG_MS) is not None
        state.on_isr_rejected()  # the reply never came
        state.on_leader_append(20)
        state.on_follower_fetch(2, 20, now_ms=2)
        assert state.high_watermark == 10  # broker 3 may be a member
        retry = state.propose_isr_change(now_ms=3, replica_lag_time_max_ms=LAG_MS)
        assert retry is not None and retry.new_isr == (1, 2, 3)
        assert state.on_isr_refused(answer_epoch) is released
        assert state.high_watermark == (20 if released else 10)
        assert (3 in state.maximal_isr) is not released


def test_a_pipelining_follower_one_answer_behind_stays_in_sync() -> None:
    """Found by an audit: a follower that pipelines (it asks for the next range while
    writing the previous answer, fetcher.py) reports how far it has written, one answer
    behind its fetch offset. That written offset counts for the HW, but being caught up
    is about what it fetched: judged by the written offset, it never reached the leader's
    LEO of its previous fetch under steady load and left the ISR after the lag limit
    though it kept pace (and acks=all with min.insync.replicas=2 then failed)."""
    state = leader(isr=(1, 2, 3))
    leo = 0
    answer = {2: (0, 0), 3: (0, 0)}  # (start, end) of the answer each is writing
    for step in range(1, 301):  # 10 ms rounds, 3 s: three lag limits
        now_ms = step * 10
        leo += 1_000
        state.on_leader_append(leo)
        for b in (2, 3):
            start, end = answer[b]
            state.on_follower_fetch(b, end, now_ms, written_offset=start)
            answer[b] = (end, leo)
        # Only what both have written is committed: the answer of two rounds ago.
        assert state.high_watermark == max(0, (step - 2) * 1_000)
    assert state.out_of_sync(now_ms, LAG_MS) == []
    assert state.propose_isr_change(now_ms, LAG_MS) is None
    # A follower that stops fetching does leave (its lag is bounded by one answer).
    for step in range(301, 420):
        now_ms = step * 10
        leo += 1_000
        state.on_leader_append(leo)
        start, end = answer[2]
        state.on_follower_fetch(2, end, now_ms, written_offset=start)
        answer[2] = (end, leo)
    assert state.out_of_sync(now_ms, LAG_MS) == [3]


@pytest.mark.parametrize("replicas", [(1, 2, 3), (1, 2)])
def test_a_follower_back_under_steady_load_rejoins_because_the_hw_waits_for_it(
    replicas: tuple[int, ...],
) -> None:
    """(With two replicas too: then no follower but the joiner is outside the ISR, a
    boundary a mutation got past.) Found by an audit: with the ISR down to the leader,
    the HW is the leader's LEO, and under steady load a returning follower's LEO (one
    round behind, more when it pipelines) never reached it, so it could not rejoin until
    producers paused. Once its fetches show it caught up it is a joiner the HW waits for
    (Kafka's shouldWaitForReplicaToJoinIsr): its LEO reaches the HW and it is proposed. A
    joiner that stops fetching holds the HW no longer than JOINER_FETCH_WINDOW_MS."""
    state = leader(isr=(1, 3) if 3 in replicas else (1,), replicas=replicas)
    state.on_isr_committed((1,), partition_epoch=10)  # the leader alone
    leo, start, end = 0, 0, 0  # broker 2 fetches from 0: the answer it is writing
    joined_at = None
    for step in range(1, 200):
        now_ms = step * 10
        leo += 1_000
        state.on_leader_append(leo, now_ms)
        state.on_follower_fetch(2, end, now_ms, written_offset=start)
        start, end = end, leo
        proposal = state.propose_isr_change(now_ms, LAG_MS)
        if proposal is not None:
            assert proposal.new_isr == (1, 2)
            state.on_isr_committed(proposal.new_isr, partition_epoch=11)
            joined_at = step
            break
    assert joined_at is not None and joined_at < 10
    # Out of the ISR again (the HW moves to the leader's LEO), it fetches caught up: a
    # joiner, so the next append does not move the HW past it.
    state.on_isr_committed((1,), partition_epoch=12)
    hw = state.high_watermark
    assert hw == leo
    state.on_follower_fetch(2, end, now_ms + 10, written_offset=start)
    state.on_leader_append(leo + 1_000, now_ms + 20)
    assert state.joiners() == [2] and state.high_watermark == hw
    # It dies: after the window the HW goes on without it.
    state.on_leader_append(leo + 2_000, now_ms + 20 + JOINER_FETCH_WINDOW_MS + 1)
    assert state.joiners() == [] and state.high_watermark == leo + 2_000 > hw


def test_follower_truncation_stops_where_the_common_epoch_ends_on_either_side() -> None:
    """The follower holds epochs [(1, 0), (3, 5)] up to 10; its leader holds [(1, 0),
    (4, 8)] and answers epoch 1 ending at 8. Offsets 5-7 are epoch 3's on the follower
    and epoch 1's on the leader: the logs agree only below 5, where epoch 1 ends on the
    follower. Truncating to 8 kept divergent records, and every fetch after found the
    same divergence again (a mutation doing so went unseen). Also the fallback: a leader
    that knows no such epoch leaves what is committed, min(HW, LEO)."""
    own_epochs = {1: (1, 5), 3: (3, 10)}  # epoch -> (epoch found, its end on the follower)

    def own_end_offset_for(epoch: int) -> tuple[int, int]:
        found = max((e for e in own_epochs if e <= epoch), default=None)
        return own_epochs[found] if found is not None else (-1, -1)

    step = follower_truncation(
        log_end_offset=10,
        high_watermark=4,
        leader_epoch=1,
        leader_end_offset=8,
        own_end_offset_for=own_end_offset_for,
    )
    assert step == (5, True)
    fallback = follower_truncation(
        log_end_offset=10,
        high_watermark=4,
        leader_epoch=-1,
        leader_end_offset=-1,
        own_end_offset_for=own_end_offset_for,
    )
    assert fallback == (4, True)


def test_a_follower_back_far_behind_is_not_a_joiner_on_its_old_fetch_time() -> None:
    """Found by an audit: leaving the ISR forgot a follower's log end and caught-up time but
    not its last fetch (time, and the leader's LEO then). Back far behind within the lag
    limit, its first fetch reached that old LEO, so it counted as caught up at its previous
    life's last fetch: a joiner, and the HW crawled at its log end while it caught up."""
    lag_ms = 30_000
    state = leader()
    state.propose_isr_change(now_ms=0, replica_lag_time_max_ms=lag_ms)  # the lag limit
    state.on_leader_append(100, now_ms=1_000)
    state.on_follower_fetch(2, 100, now_ms=1_000)
    state.on_follower_fetch(3, 100, now_ms=1_000)  # broker 3's last fetch before it dies
    state.on_isr_committed((1, 2), partition_epoch=10)  # evicted: its lease expired
    leo = 100
    for now_ms in range(1_100, 8_000, 100):
        leo += 70
        state.on_leader_append(leo, now_ms=now_ms)
        state.on_follower_fetch(2, leo, now_ms=now_ms)
    state.on_follower_fetch(3, 100, now_ms=8_000)  # restarted, ~4,800 behind
    state.on_leader_append(leo + 70, now_ms=8_050)
    state.on_follower_fetch(2, leo + 70, now_ms=8_050)
    assert (state.high_watermark, state.joiners()) == (leo + 70, [])


def test_a_new_incarnation_is_not_caught_up_on_the_old_ones_fetches() -> None:
    """A follower outside the ISR that restarts (a new broker epoch in its fetches) starts
    over: the old incarnation's last fetch says nothing of the log the new one has."""
    lag_ms = 30_000
    state = leader(isr=(1, 2))
    state.propose_isr_change(now_ms=0, replica_lag_time_max_ms=lag_ms)
    state.on_leader_append(100, now_ms=1_000)
    state.on_follower_fetch(2, 100, now_ms=1_000)
    state.on_follower_fetch(3, 50, now_ms=1_000, broker_epoch=7)  # catching up, then dies
    state.on_leader_append(5_000, now_ms=1_500)
    state.on_follower_fetch(2, 5_000, now_ms=1_500)
    # Incarnation 8 fetches from 100: the LEO the leader had at incarnation 7's fetch.
    state.on_follower_fetch(3, 100, now_ms=2_000, broker_epoch=8)
    state.on_leader_append(5_100, now_ms=2_050)
    state.on_follower_fetch(2, 5_100, now_ms=2_050)
    assert (state.high_watermark, state.joiners()) == (5_100, [])
    # Its own fetches count: caught up to the leader's LEO, it is a joiner again.
    state.on_follower_fetch(3, 5_100, now_ms=2_100, broker_epoch=8)
    assert state.joiners() == [3]
