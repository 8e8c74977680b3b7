"""Consumer group membership end to end: real etcd, controller, brokers and gateway;
consumers in this process and, to be killed with SIGKILL, in processes of their own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest

import tidelog
from services.gateway.group_coordinator import MAX_PENDING_MEMBERS, timer_key
from services.gateway.groups import Committed, OffsetStore
from services.gateway.metadata_cache import MetadataCache
from services.metastore import Compare, MetaStore
from tests.support.cluster import GatewayProcess, TestCluster, rpc_error_code, wait_for
from tests.support.tcp_proxy import TcpProxy
from tidelog.errors import (
    ErrorCode,
    FencedInstanceIdError,
    IllegalGenerationError,
    NonEmptyGroupError,
    RebalanceInProgressError,
    RequestTimedOutError,
    UnknownMemberIdError,
    WakeupError,
)
from tidelog.v1 import gateway_pb2, gateway_pb2_grpc

FAST = {"session_timeout_ms": 2_000, "heartbeat_interval_ms": 300}
"""Short sessions (etcd's lease minimum is 2 s) so failover tests take seconds."""


def _produce(
    address: str, topic: str, partitions: int, per_partition: int, tag: str = ""
) -> set[bytes]:
    values: set[bytes] = set()
    with tidelog.Producer(address) as producer:
        for p in range(partitions):
            batch = [f"{topic}-{p}-{i}{tag}".encode() for i in range(per_partition)]
            producer.send_batch(topic, batch, partition=p).result(30)
            values.update(batch)
    return values


def _poll_into(
    consumers: list[tidelog.Consumer], seen: Counter[bytes], until: int, timeout_s: float = 60
) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(seen.values()) < until and time.monotonic() < deadline:
        for consumer in consumers:
            for record in consumer.poll(timeout_ms=200):
                assert record.value is not None
                seen[record.value] += 1


def _member(address: str, group_id: str, **options: Any) -> tidelog.Consumer:
    """A group member reading from the earliest offset with FAST sessions (``options``
    override)."""
    settings: dict[str, Any] = {"auto_offset_reset": "earliest", **FAST, **options}
    return tidelog.Consumer(address, group_id=group_id, **settings)


def _join_twice(
    stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.JoinGroupRequest
) -> gateway_pb2.JoinGroupResponse:
    """JoinGroup as a client does it (KIP-394): a first join without a member id only
    hands one out (MEMBER_ID_REQUIRED); the join that names it enters the group."""
    response: gateway_pb2.JoinGroupResponse = stub.JoinGroup(request, timeout=30)
    if request.member_id or response.error.code != ErrorCode.MEMBER_ID_REQUIRED:
        return response
    named = gateway_pb2.JoinGroupRequest()
    named.CopyFrom(request)
    named.member_id = response.member_id
    again: gateway_pb2.JoinGroupResponse = stub.JoinGroup(named, timeout=30)
    return again


def _join(consumer: tidelog.Consumer) -> None:
    """Poll until the consumer has joined its group with some partitions."""
    wait_for(lambda: (consumer.poll(timeout_ms=100), consumer.assignment())[1] or None, 30, "join")


def _stable_assignments(consumers: list[tidelog.Consumer], partitions: int) -> None:
    """Poll every consumer until their assignments split all partitions between them."""

    def split() -> bool | None:
        for consumer in consumers:
            consumer.poll(timeout_ms=100)
        owned = [tp for c in consumers for tp in c.assignment()]
        return (
            len(owned) == partitions
            and len(set(owned)) == partitions
            and all(c.assignment() for c in consumers)
        ) or None

    wait_for(split, 60, f"{len(consumers)} members splitting {partitions} partitions")


def test_members_split_the_partitions_and_read_every_record_once(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    admin.create_topic("shared", partitions=6, replication_factor=3)
    consumers = [_member(gateway.address, "sharers") for _ in range(3)]
    try:
        for consumer in consumers:
            consumer.subscribe(["shared"])
        _stable_assignments(consumers, 6)
        assert sorted(len(c.assignment()) for c in consumers) == [2, 2, 2]
        values = _produce(gateway.address, "shared", 6, 50)
        seen: Counter[bytes] = Counter()
        _poll_into(consumers, seen, len(values))
        assert set(seen) == values
        assert max(seen.values()) == 1  # no partition was read by two members
        with grpc.insecure_channel(gateway.address) as channel:
            described = gateway_pb2_grpc.GatewayStub(channel).DescribeGroup(
                gateway_pb2.DescribeGroupRequest(group_id="sharers"), timeout=10
            )
        assert described.state == "Stable"
        assert len(described.members) == 3
        assert sorted(
            (tp.topic, tp.partition) for m in described.members for tp in m.assignment
        ) == [("shared", p) for p in range(6)]
    finally:
        for consumer in consumers:
            consumer.close()


def test_members_on_two_gateways_and_in_direct_mode_form_one_group(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """The group lives in etcd, not in a gateway: members talking to different gateways
    (one of them fetching from the leaders directly) share the partitions."""
    admin.create_topic("spread", partitions=4, replication_factor=1)
    other = cluster.start_gateway()
    consumers = [
        _member(gateway.address, "spreaders"),
        tidelog.Consumer(
            other.address, group_id="spreaders", auto_offset_reset="earliest", direct=True, **FAST
        ),
    ]
    try:
        for consumer in consumers:
            consumer.subscribe(["spread"])
        _stable_assignments(consumers, 4)
        values = _produce(gateway.address, "spread", 4, 25)
        seen: Counter[bytes] = Counter()
        _poll_into(consumers, seen, len(values))
        assert set(seen) == values and max(seen.values()) == 1
    finally:
        for consumer in consumers:
            consumer.close()


def test_a_member_that_leaves_hands_its_partitions_over_at_once(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """close() commits and leaves: the other member takes the partitions over from the
    committed offsets, without waiting out a session (45 s by default)."""
    admin.create_topic("handover", partitions=4, replication_factor=1)
    stayer = tidelog.Consumer(gateway.address, group_id="handing", auto_offset_reset="earliest")
    leaver = tidelog.Consumer(gateway.address, group_id="handing", auto_offset_reset="earliest")
    try:
        stayer.subscribe(["handover"])
        leaver.subscribe(["handover"])
        _stable_assignments([stayer, leaver], 4)
        values = _produce(gateway.address, "handover", 4, 30)
        seen: Counter[bytes] = Counter()
        _poll_into([leaver], seen, 60)  # everything of its two partitions
        assert len(seen) == 60
        leaver.close()
        started = time.monotonic()
        values |= _produce(gateway.address, "handover", 4, 30, tag="-after")
        _poll_into([stayer], seen, len(values))
        assert time.monotonic() - started < 30
        assert set(seen) == values
        assert max(seen.values()) == 1  # resumed from the leaver's commits
        assert len(stayer.assignment()) == 4
    finally:
        stayer.close()
        leaver.close()


_MEMBER_SCRIPT = textwrap.dedent(
    """
    import sys, tidelog
    address, group, topic, out = sys.argv[1:5]
    consumer = tidelog.Consumer(
        address, group_id=group, auto_offset_reset="earliest",
        session_timeout_ms=2000, heartbeat_interval_ms=300,
    )
    consumer.subscribe([topic])
    with open(out, "a", buffering=1) as sink:
        while True:
            records = consumer.poll(timeout_ms=200)
            for r in records:
                sink.write(r.value.decode() + "\\n")
            if records:
                consumer.commit()
                sink.write("COMMITTED\\n")
    """
)


def test_a_killed_member_is_replaced_after_its_session_and_no_record_is_lost(
    gateway: GatewayProcess, admin: tidelog.Admin, tmp_path: Path
) -> None:
    """kill -9 of a member: no leave, no commit of what it read after its last commit.
    When its session ends the survivor gets its partitions and reads from the committed
    offsets: every record is read, and only what the dead member read after its last
    commit twice."""
    admin.create_topic("orphaned", partitions=4, replication_factor=3)
    out = tmp_path / "member.out"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    member = subprocess.Popen(
        [sys.executable, "-c", _MEMBER_SCRIPT, gateway.address, "orphans", "orphaned", str(out)],
        env=env,
    )
    survivor = _member(gateway.address, "orphans")
    try:
        survivor.subscribe(["orphaned"])

        def split() -> bool | None:
            survivor.poll(timeout_ms=100)
            return len(survivor.assignment()) == 2 or None

        wait_for(split, 60, "the survivor holding half the partitions")
        values = _produce(gateway.address, "orphaned", 4, 40)
        seen: Counter[bytes] = Counter()
        _poll_into([survivor], seen, 80)
        wait_for(
            lambda: (out.exists() and out.read_text().count("COMMITTED") >= 1) or None,
            30,
            "the member to read and commit",
        )
        member.send_signal(signal.SIGKILL)
        member.wait(10)
        lines = out.read_text().split()
        read_by_member = {v.encode() for v in lines if v != "COMMITTED"}
        last_commit = len(lines) - 1 - lines[::-1].index("COMMITTED")
        committed_by_member = {v.encode() for v in lines[:last_commit] if v != "COMMITTED"}
        assert committed_by_member

        # The survivor reads every record the member had not committed: nothing is lost.
        # (What the member read after the last commit the file shows may have been
        # committed too, by an auto-commit or a commit the kill cut short of its line.)
        # Records written after the kill: only the survivor can read those of the dead
        # member's partitions, once its session ended and the group rebalanced.
        after = _produce(gateway.address, "orphaned", 4, 10, tag="-after")
        values |= after

        def rest_read() -> bool | None:
            _poll_into([survivor], seen, sum(seen.values()) + 1, timeout_s=0.5)
            return (after <= set(seen) and set(seen) | read_by_member == values) or None

        wait_for(rest_read, 60, "the survivor to read the rest")
        assert len(survivor.assignment()) == 4
        assert set(seen) | read_by_member == values
        assert not set(seen) & committed_by_member  # resumed from the member's commits
        assert max(seen.values()) == 1
    finally:
        if member.poll() is None:
            member.kill()
        survivor.close()


def test_a_member_past_max_poll_interval_is_fenced_from_committing(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A member that stops polling leaves the group (its heartbeat thread does, as
    Kafka's); its commit afterwards is refused and does not overwrite the next owner's."""
    admin.create_topic("stalled", partitions=2, replication_factor=1)
    _produce(gateway.address, "stalled", 2, 10)
    slow = _member(
        gateway.address, "stallers", enable_auto_commit=False, max_poll_interval_ms=1_500
    )
    other = _member(gateway.address, "stallers")
    try:
        slow.subscribe(["stalled"])
        wait_for(lambda: slow.poll(timeout_ms=100) or None, 30, "the slow member to read")
        generation_records = slow.assignment()
        assert len(generation_records) == 2
        other.subscribe(["stalled"])
        # The slow member does not poll; the other one takes everything over once the
        # slow one's heartbeat thread leaves (max_poll_interval_ms).
        seen: Counter[bytes] = Counter()

        def owns_both() -> bool | None:
            for record in other.poll(timeout_ms=200):
                assert record.value is not None
                seen[record.value] += 1
            return len(other.assignment()) == 2 or None

        wait_for(owns_both, 30, "the other member owning both partitions")
        # Every record, counting those the polls above handed out (they were dropped,
        # and this waited its whole minute for records already read).
        _poll_into([other], seen, 20)
        assert len(seen) == 20
        other.commit()
        committed = other.committed([("stalled", 0), ("stalled", 1)])
        with pytest.raises((UnknownMemberIdError, IllegalGenerationError)):
            slow.commit({("stalled", 0): 1, ("stalled", 1): 1})
        assert other.committed([("stalled", 0), ("stalled", 1)]) == committed
    finally:
        slow.close()
        other.close()


def _subscribe_recording(consumer: tidelog.Consumer, topics: list[str]) -> list[str]:
    """Subscribe with every rebalance callback; the list they append to ("assigned 2",
    "revoked 2", "lost 2": what happened, with how many partitions)."""
    events: list[str] = []
    consumer.subscribe(
        topics,
        on_partitions_revoked=lambda tps: events.append(f"revoked {len(tps)}"),
        on_partitions_assigned=lambda tps: events.append(f"assigned {len(tps)}"),
        on_partitions_lost=lambda tps: events.append(f"lost {len(tps)}"),
    )
    return events


def test_a_long_poll_is_not_a_stalled_member(gateway: GatewayProcess, admin: tidelog.Admin) -> None:
    """Time a poll waits counts as polling (as Kafka's): an idle member in a poll longer
    than max_poll_interval_ms keeps its place and partitions, and so does its group."""
    admin.create_topic("quiet", partitions=2, replication_factor=1)
    waiting = _member(gateway.address, "patient", max_poll_interval_ms=1_000)
    try:
        rebalances = _subscribe_recording(waiting, ["quiet"])
        _join(waiting)
        member = waiting.group_metadata()
        assert waiting.poll(timeout_ms=4_000) == []  # four intervals, nothing to read
        assert waiting.group_metadata() == member
        assert rebalances == ["assigned 2"]
    finally:
        waiting.close()


def test_partitions_of_an_evicted_member_are_told_lost_not_revoked(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Kafka's onPartitionsLost (KIP-429): a member that stopped polling past
    max_poll_interval_ms was evicted, so its partitions may be another's already; a
    listener committing in on_partitions_revoked would fail (the group audit)."""
    admin.create_topic("lost", partitions=2, replication_factor=1)
    member = _member(gateway.address, "losers", max_poll_interval_ms=1_000)
    try:
        events = _subscribe_recording(member, ["lost"])
        _join(member)
        wait_for(
            lambda: member.group_metadata().generation_id == -1 or None,  # type: ignore[union-attr]
            30,
            "the stalled member to leave",
        )
        _join(member)
        assert events == ["assigned 2", "lost 2", "assigned 2"]
        member.unsubscribe()
        assert events[-1] == "revoked 2"  # given up while a member: revoked
    finally:
        member.close()


def test_a_member_stuck_in_a_rebalance_callback_past_max_poll_interval_leaves(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Time in a rebalance callback counts against max_poll_interval_ms, as in Kafka (the
    poll timer is reset when poll starts, not while listeners run). The whole poll,
    callbacks included, counted as polling: a member hung in on_partitions_assigned
    heartbeated on for ever, and nobody read its partitions."""
    admin.create_topic("stuck-cb", partitions=2, replication_factor=1)
    _produce(gateway.address, "stuck-cb", 2, 5)
    healthy = _member(gateway.address, "stuck-cb", max_poll_interval_ms=1_500)
    stuck = _member(gateway.address, "stuck-cb", max_poll_interval_ms=1_500)
    release = threading.Event()
    entered = threading.Event()

    def hang(tps: list[tuple[str, int]]) -> None:
        if tps and not entered.is_set():
            entered.set()
            release.wait(30)

    def run_stuck() -> None:
        stuck.subscribe(["stuck-cb"], on_partitions_assigned=hang)
        while not release.is_set():
            stuck.poll(timeout_ms=200)

    thread = threading.Thread(target=run_stuck, daemon=True)
    try:
        healthy.subscribe(["stuck-cb"])
        _join(healthy)
        thread.start()

        def stuck_in_callback() -> bool | None:
            healthy.poll(timeout_ms=100)
            return entered.is_set() or None

        wait_for(stuck_in_callback, 30, "the stuck member to get partitions and hang")
        # Four max_poll_intervals, the healthy member polling all along.
        end = time.monotonic() + 6.0
        while time.monotonic() < end:
            healthy.poll(timeout_ms=200)
        assert sorted(healthy.assignment()) == [("stuck-cb", 0), ("stuck-cb", 1)]
    finally:
        release.set()
        thread.join(10)
        stuck.close()
        healthy.close()


def test_an_assigned_consumer_cannot_commit_over_an_active_group(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    admin.create_topic("guarded", partitions=1, replication_factor=1)
    member = tidelog.Consumer(gateway.address, group_id="guards", **FAST)
    outsider = tidelog.Consumer(gateway.address, group_id="guards", enable_auto_commit=False)
    try:
        member.subscribe(["guarded"])
        _join(member)
        outsider.assign([("guarded", 0)])
        with pytest.raises(UnknownMemberIdError, match="active members"):
            outsider.commit({("guarded", 0): 5})
        assert outsider.committed([("guarded", 0)]) == {("guarded", 0): -1}
        member.close()  # the group is empty again: offsets may be stored by anyone
        outsider.commit({("guarded", 0): 5})
        assert outsider.committed([("guarded", 0)]) == {("guarded", 0): 5}
    finally:
        member.close()
        outsider.close()


def test_a_join_voids_the_empty_mark_of_an_earlier_expiry_pass(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Offsets expire a retention after their group emptied (KIP-211), counted from the
    mark an expiry pass writes when it sees the group without members. A join did not
    clear it: a member that joined after a mark and went without LeaveGroup (kill -9, a
    static member's close) before the next pass left the old mark, and the offsets
    expired a retention after it: right after the member went. The first join now
    deletes it, in the same transaction. Found by an audit."""
    admin.create_topic("marked", partitions=1, replication_factor=1)
    mark = "group-emptied/marked-group"
    cluster.store.put(mark, str(int(time.time() * 1000)).encode())  # as a pass writes it
    member = tidelog.Consumer(gateway.address, group_id="marked-group", **FAST)
    try:
        member.subscribe(["marked"])
        _join(member)
        assert cluster.store.get(mark) is None
    finally:
        member.close()


def test_a_subscribed_consumer_outside_any_generation_cannot_commit(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Kafka (ConsumerCoordinator.sendOffsetCommitRequest): a consumer with auto-assigned
    partitions commits only in a generation (RebalanceInProgressException while it
    joins). Only a member whose partitions were lost was refused: one with no member id
    (not joined yet, or its join answered UNKNOWN_MEMBER_ID) committed as an outsider
    (member "", generation -1), which the gateway takes whenever the group is empty, and
    the offset the partition's last owner committed went backwards (found by an audit).
    Once joined it commits again."""
    admin.create_topic("outsider", partitions=1, replication_factor=1)
    tp = ("outsider", 0)
    _produce(gateway.address, "outsider", 1, 20)
    late = _member(gateway.address, "outsiders", enable_auto_commit=False)
    late.subscribe(["outsider"])  # a member, not joined yet
    try:
        with _member(gateway.address, "outsiders", enable_auto_commit=False) as owner:
            owner.subscribe(["outsider"])
            _join(owner)
            owner.commit({tp: 10})
        # The owner left: the group is empty. The member that has not joined yet:
        with pytest.raises(RebalanceInProgressError):
            late.commit({tp: 3})
        assert late.committed([tp]) == {tp: 10}
        late.commit()  # nothing of its own to commit yet: nothing to refuse
        _join(late)  # reads on from the owner's commit
        position = late.position(tp)
        assert position >= 10
        late.commit()
        assert late.committed([tp]) == {tp: position}
    finally:
        late.close()


def test_a_pending_wakeup_is_not_taken_by_the_commit_before_a_revocation(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """The consumer's own commit before it gives its group's partitions up (here for
    assign()) went through commit(), which took a pending wakeup() and raised
    WakeupError, swallowed as a failed auto-commit: the wake-up meant for the next poll
    was lost (found by an audit). It stays pending now, and the commit is made."""
    admin.create_topic("woken-revoked", partitions=1, replication_factor=1)
    tp = ("woken-revoked", 0)
    _produce(gateway.address, "woken-revoked", 1, 10)
    member = _member(gateway.address, "woken-revokers", auto_commit_interval_ms=60_000)
    try:
        member.subscribe(["woken-revoked"])
        records = wait_for(lambda: member.poll(max_records=4, timeout_ms=100), 30, "records")
        assert [r.offset for r in records] == [0, 1, 2, 3]
        member.wakeup()
        member.assign([tp])  # commits position 4, revokes, leaves the group
        with pytest.raises(WakeupError):
            member.poll(timeout_ms=200)
        assert member.committed([tp]) == {tp: 4}
        assert [r.offset for r in member.poll(max_records=1, timeout_ms=5_000)] == [4]
    finally:
        member.close()


def test_a_consumer_with_a_max_poll_interval_of_hours_joins_its_group(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """max_poll_interval_ms is sent as the rebalance timeout, which Kafka bounds by its
    int32 only (long intervals are common for slow batch work). The gateway refused more
    than an hour: every poll of such a consumer raised INVALID_REQUEST (found by an
    audit)."""
    admin.create_topic("long-poll-interval", partitions=1, replication_factor=1)
    consumer = _member(gateway.address, "long-poll-interval", max_poll_interval_ms=2**31 - 1)
    try:
        consumer.subscribe(["long-poll-interval"])
        _join(consumer)
    finally:
        consumer.close()


def test_a_poll_right_after_a_join_ends_by_its_timeout_when_the_gateway_goes_away(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Kafka's poll fetches a new assignment's committed offsets within the poll's timer:
    with the gateway gone it returns empty at its timeout and asks again at the next poll.
    Here the look-up was retried for default_api_timeout_ms inside the poll, which then
    raised, and so did every poll after it (found by an audit). The gateway goes away
    right after the JoinGroup answer (the assignment callback is only where the test cuts
    it); no position is taken from auto_offset_reset meanwhile."""
    admin.create_topic("bounded-poll", partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        for i in range(5):
            producer.send("bounded-poll", b"%d" % i, partition=0).result(30)
    committer = _member(gateway.address, "bounded-poll")
    committer.assign([("bounded-poll", 0)])
    committer.commit({("bounded-poll", 0): 3})
    committer.close()
    proxy = TcpProxy(gateway.address)
    consumer = _member(
        proxy.address, "bounded-poll", request_timeout_ms=1_000, default_api_timeout_ms=8_000
    )
    try:
        cuts: list[int] = []

        def cut_once(_: object) -> None:
            # Only at the first assignment: under load the session may end while the
            # gateway is away, and the join after it must not cut it again.
            if not cuts:
                cuts.append(1)
                proxy.down()

        consumer.subscribe(["bounded-poll"], on_partitions_assigned=cut_once)
        started = time.monotonic()
        assert consumer.poll(timeout_ms=2_000) == []
        took_s = time.monotonic() - started
        assert consumer.assignment() == [("bounded-poll", 0)]
        assert took_s < 4.0, f"poll(2000 ms) took {took_s:.1f} s"
        time.sleep(2.5)  # past the session too: the member joins again once it is back
        proxy.up()
        seen: list[bytes | None] = []
        deadline = time.monotonic() + 30
        while len(seen) < 2 and time.monotonic() < deadline:
            seen += [r.value for r in consumer.poll(timeout_ms=200)]
        state = (consumer.assignment(), consumer._positions, consumer._needs_position, cuts)
        assert seen == [b"3", b"4"], state  # from the commit, not from the earliest offset
    finally:
        proxy.up()
        consumer.close()
        proxy.close()


def test_added_partitions_are_assigned_after_a_rebalance(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    admin.create_topic("growing", partitions=2, replication_factor=1)
    consumer = _member(gateway.address, "growers")
    try:
        consumer.subscribe(["growing"])
        _join(consumer)
        admin.create_partitions("growing", 4)
        wait_for(
            lambda: (consumer.poll(timeout_ms=200), len(consumer.assignment()) == 4)[1] or None,
            30,
            "the new partitions assigned",
        )
        values = _produce(gateway.address, "growing", 4, 5)
        seen: Counter[bytes] = Counter()
        _poll_into([consumer], seen, len(values))
        assert set(seen) == values
    finally:
        consumer.close()


def test_a_metadata_failure_right_after_a_join_does_not_strand_the_assignment(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """JoinGroup answered with this member's partitions, then the look-up of their
    leaders failed once (a retriable error: the gateway restarting, a timeout) and the
    poll raised before taking the assignment. Nothing asked to join again: every later
    poll read nothing while the group kept the partitions assigned to this member. As
    Kafka's consumer, it now keeps the assignment and looks the leaders up again."""
    admin.create_topic("strand", partitions=2, replication_factor=1)
    _produce(gateway.address, "strand", 2, 5)
    # A connection of its own (settings no other client shares), to fail one call of.
    consumer = _member(gateway.address, "strand", request_timeout_ms=29_999)
    conn = consumer._conn
    real = conn.metadata
    failed_after_join: list[bool] = []

    def flaky(topics: Any = ()) -> Any:
        if not failed_after_join:
            membership = consumer._membership
            failed_after_join.append(membership is not None and not membership.needs_join())
            raise RequestTimedOutError("metadata from the gateway: deadline exceeded (injected)")
        return real(topics)

    conn.metadata = flaky  # type: ignore[method-assign]
    try:
        consumer.subscribe(["strand"])
        read = 0
        end = time.monotonic() + 10.0
        while time.monotonic() < end and read < 10:
            # (What the poll raised before: an application polls on after it.)
            with contextlib.suppress(RequestTimedOutError):
                read += len(consumer.poll(timeout_ms=200))
        assert failed_after_join == [True]
        assert read == 10, f"read {read} of 10; assignment {consumer.assignment()}"
    finally:
        consumer.close()


def test_group_rpcs_refuse_bad_input_and_change_nothing(gateway: GatewayProcess) -> None:
    with grpc.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def join(**fields: object) -> gateway_pb2.JoinGroupResponse:
            request = dict(
                group_id="bad-input",
                topics=["t"],
                session_timeout_ms=10_000,
                rebalance_timeout_ms=10_000,
            )
            request.update(fields)
            return stub.JoinGroup(gateway_pb2.JoinGroupRequest(**request), timeout=10)

        cases = [
            (
                {"session_timeout_ms": 10},
                ErrorCode.INVALID_SESSION_TIMEOUT,
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            ({"topics": []}, ErrorCode.INVALID_REQUEST, grpc.StatusCode.INVALID_ARGUMENT),
            ({"topics": ["no/slash"]}, ErrorCode.INVALID_TOPIC, grpc.StatusCode.INVALID_ARGUMENT),
            ({"group_id": ""}, ErrorCode.INVALID_GROUP_ID, grpc.StatusCode.INVALID_ARGUMENT),
            (
                {"rebalance_timeout_ms": 0},
                ErrorCode.INVALID_REQUEST,
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
        ]
        for fields, code, status in cases:
            with pytest.raises(grpc.RpcError) as failed:
                join(**fields)
            assert rpc_error_code(failed.value) == code, fields
            assert failed.value.code() == status, fields
        # A member id longer than any the gateway hands out: refused before etcd, and
        # not echoed whole (a 2 MB id came back in a 2 MB message; audit).
        huge = "m" * 100_000
        calls = [
            lambda: join(member_id=huge),
            lambda: stub.Heartbeat(
                gateway_pb2.HeartbeatRequest(group_id="bad-input", member_id=huge), timeout=10
            ),
            lambda: stub.LeaveGroup(
                gateway_pb2.LeaveGroupRequest(group_id="bad-input", member_id=huge), timeout=10
            ),
            lambda: stub.CommitOffsets(
                gateway_pb2.CommitOffsetsRequest(
                    group_id="bad-input",
                    member_id=huge,
                    offsets=[gateway_pb2.CommitOffset(topic="t", partition=0, offset=1)],
                ),
                timeout=10,
            ),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as failed:
                call()
            assert rpc_error_code(failed.value) == ErrorCode.INVALID_REQUEST
            assert "member id of 100000 characters" in failed.value.details()
            assert len(failed.value.details()) < 200
        unknown = join(member_id="nobody")
        assert unknown.error.code == ErrorCode.UNKNOWN_MEMBER_ID
        heartbeat = stub.Heartbeat(
            gateway_pb2.HeartbeatRequest(group_id="bad-input", member_id="nobody", generation_id=1),
            timeout=10,
        )
        assert heartbeat.error.code == ErrorCode.UNKNOWN_MEMBER_ID
        left = stub.LeaveGroup(
            gateway_pb2.LeaveGroupRequest(group_id="bad-input", member_id="nobody"), timeout=10
        )
        assert left.error.code == ErrorCode.UNKNOWN_MEMBER_ID
        described = stub.DescribeGroup(
            gateway_pb2.DescribeGroupRequest(group_id="bad-input"), timeout=10
        )
        # Kafka's answer for a group it does not know (found by an audit: it said Empty,
        # the state of a group without members that has offsets).
        assert (described.state, described.generation_id, len(described.members)) == ("Dead", 0, 0)


def test_revocation_is_told_on_every_way_partitions_are_given_up(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """on_partitions_revoked (Kafka's ConsumerRebalanceListener) hears of every giving
    up: a rebalance, a new subscription, unsubscribe and close; an empty group then
    leaves no membership state behind (generation 0 again)."""
    admin.create_topic("told-a", partitions=2, replication_factor=1)
    admin.create_topic("told-b", partitions=1, replication_factor=1)
    events: list[tuple[str, list[tuple[str, int]]]] = []

    def listen(consumer: tidelog.Consumer, topics: list[str]) -> None:
        consumer.subscribe(
            topics,
            on_partitions_revoked=lambda tps: events.append(("revoked", sorted(tps))),
            on_partitions_assigned=lambda tps: events.append(("assigned", sorted(tps))),
        )

    consumer = tidelog.Consumer(gateway.address, group_id="tellers", **FAST)
    try:
        listen(consumer, ["told-a"])
        _join(consumer)
        listen(consumer, ["told-b"])
        assert events[-1] == ("revoked", [("told-a", 0), ("told-a", 1)])
        _join(consumer)
        assert events[-1] == ("assigned", [("told-b", 0)])
        consumer.unsubscribe()
        assert events[-1] == ("revoked", [("told-b", 0)])
        listen(consumer, ["told-a", "told-b"])
        _join(consumer)
        consumer.close()
        assert events[-1] == ("revoked", [("told-a", 0), ("told-a", 1), ("told-b", 0)])
    finally:
        consumer.close()
    described = tidelog.Admin(gateway.address).describe_group_members("tellers")
    assert (described.state, described.generation, described.members) == ("Empty", 0, ())


def test_a_revocation_callback_raising_in_subscribe_still_joins_with_the_new_topics(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """subscribe() stopped at a revocation callback that raised, after the assignment was
    emptied but before asking to join again: the membership stayed joined with the old
    partitions and topics, no later poll joined, and the group kept the partitions
    assigned to a member reading nothing. Kafka's subscribe only records the change; the
    next poll joins even when the callback threw. The callback's error is still raised."""
    admin.create_topic("cb-sub", partitions=2, replication_factor=1)
    admin.create_topic("cb-sub2", partitions=1, replication_factor=1)
    _produce(gateway.address, "cb-sub", 2, 5)
    consumer = _member(gateway.address, "cb-sub")
    calls = [0]

    def flaky_revoked(tps: list[tuple[str, int]]) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("the application's revocation handler failed once")

    try:
        consumer.subscribe(["cb-sub"], on_partitions_revoked=flaky_revoked)
        _join(consumer)
        with pytest.raises(RuntimeError, match="failed once"):
            consumer.subscribe(["cb-sub", "cb-sub2"])
        assert consumer.subscription() == ["cb-sub", "cb-sub2"]
        wait_for(
            lambda: (consumer.poll(timeout_ms=200), len(consumer.assignment()) == 3)[1] or None,
            30,
            "the member joined again with both topics",
        )
    finally:
        consumer.close()


def test_a_revocation_callback_raising_in_unsubscribe_or_assign_still_leaves_the_group(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """unsubscribe() and assign() stopped at a revocation callback that raised, before
    leaving the group: the member went on heartbeating, holding partitions in the group
    that it no longer read. The change is made; the callback's error is still raised."""
    admin.create_topic("cb-leave", partitions=2, replication_factor=1)
    consumer = _member(gateway.address, "cb-leavers")

    def failing(tps: list[tuple[str, int]]) -> None:
        raise RuntimeError("the application's revocation handler failed")

    try:
        consumer.subscribe(["cb-leave"], on_partitions_revoked=failing)
        _join(consumer)
        with pytest.raises(RuntimeError, match="handler failed"):
            consumer.unsubscribe()
        assert (consumer.subscription(), consumer.assignment()) == ([], [])
        assert admin.describe_group_members("cb-leavers").members == ()

        consumer.subscribe(["cb-leave"], on_partitions_revoked=failing)
        _join(consumer)
        with pytest.raises(RuntimeError, match="handler failed"):
            consumer.assign([("cb-leave", 0)])
        assert (consumer.subscription(), consumer.assignment()) == ([], [("cb-leave", 0)])
        assert admin.describe_group_members("cb-leavers").members == ()
    finally:
        consumer.close()


def test_many_members_joining_at_once_all_get_in(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Concurrent joins contend for the group's state key: they back off and retry (the
    SDK retries a join the gateway could not write) rather than fail."""
    admin.create_topic("crowded", partitions=8, replication_factor=1)
    consumers = [tidelog.Consumer(gateway.address, group_id="crowd", **FAST) for _ in range(8)]
    try:
        for consumer in consumers:
            consumer.subscribe(["crowded"])
        _stable_assignments(consumers, 8)
        assert all(len(c.assignment()) == 1 for c in consumers)
    finally:
        for consumer in consumers:
            consumer.close()


def test_a_group_too_big_for_its_metadata_is_refused_and_changes_nothing(
    gateway: GatewayProcess,
) -> None:
    """Members naming many long topics would make the group's state larger than etcd
    takes in one request; the join is refused (not retried for ever) and the members
    already in are untouched."""
    topics = [f"{i:04d}" + "t" * 245 for i in range(1000)]  # 1000 names of 249 characters
    with grpc.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def join() -> gateway_pb2.JoinGroupResponse:
            request = gateway_pb2.JoinGroupRequest(
                group_id="bloated",
                topics=topics,
                session_timeout_ms=10_000,
                rebalance_timeout_ms=10_000,
                max_wait_ms=0,
            )
            return _join_twice(stub, request)

        joined = 0
        with pytest.raises(grpc.RpcError) as refused:
            for _ in range(10):
                join()
                joined += 1
        assert rpc_error_code(refused.value) == ErrorCode.GROUP_MAX_SIZE_REACHED
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "bytes of metadata" in (refused.value.details() or "")
        assert joined >= 2
        described = stub.DescribeGroup(
            gateway_pb2.DescribeGroupRequest(group_id="bloated"), timeout=10
        )
        assert len(described.members) == joined


def test_cli_consume_with_a_group_stops_when_others_hold_every_partition(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    admin.create_topic("held", partitions=1, replication_factor=1)
    # Member ids start with the client id, and the range assignor gives the only
    # partition to the first member id: "a-holder-..." sorts before the CLI's.
    holder = tidelog.Consumer(gateway.address, group_id="holders", client_id="a-holder", **FAST)
    try:
        holder.subscribe(["held"])
        _join(holder)
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        env["TIDELOG_GATEWAY"] = gateway.address
        ran = subprocess.Popen(
            [sys.executable, "-m", "tidelog", "consume", "held", "--group", "holders"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # The holder keeps polling (its heartbeats answer the CLI member's join).
        deadline = time.monotonic() + 60
        while ran.poll() is None and time.monotonic() < deadline:
            holder.poll(timeout_ms=200)
        assert ran.poll() == 0, "the CLI consumer did not stop"
        assert "hold every partition" in (ran.stderr.read() if ran.stderr else "")
    finally:
        if ran.poll() is None:
            ran.kill()
        holder.close()


def test_a_static_member_restarted_within_its_session_keeps_its_partitions(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """group_instance_id (KIP-345): a restart (close, then a new consumer with the same
    instance id within the session) takes the old place back: same partitions, same
    generation, nothing revoked from the other member; the place's previous holder, if
    still running, is fenced."""
    admin.create_topic("static", partitions=4, replication_factor=1)
    session = {"session_timeout_ms": 6_000, "heartbeat_interval_ms": 300}
    revoked: list[list[tuple[str, int]]] = []

    def static(instance: str) -> tidelog.Consumer:
        return tidelog.Consumer(
            gateway.address,
            group_id="statics",
            group_instance_id=instance,
            auto_offset_reset="earliest",
            **session,
        )

    a, b = static("a"), static("b")
    try:
        a.subscribe(["static"])
        b.subscribe(["static"], on_partitions_revoked=revoked.append)
        _stable_assignments([a, b], 4)
        revoked.clear()
        held, generation = a.assignment(), a.group_metadata()
        assert generation is not None
        a.close()  # a static member does not leave
        a = static("a")
        a.subscribe(["static"])
        _join(a)
        now = a.group_metadata()
        assert now is not None
        assert a.assignment() == held and now.generation_id == generation.generation_id
        for _ in range(5):  # b keeps its partitions: nothing revoked, no rebalance
            b.poll(timeout_ms=200)
        assert revoked == []

        # A second live consumer with instance id "a" takes the place; the running one
        # is fenced (fatal for it) instead of taking it back.
        twin = static("a")
        twin.subscribe(["static"])
        _join(twin)
        assert twin.assignment() == held
        with pytest.raises(FencedInstanceIdError):
            for _ in range(50):
                a.poll(timeout_ms=200)
        twin.close()
    finally:
        a.close()
        b.close()


def test_a_static_member_that_does_not_come_back_loses_its_partitions_after_its_session(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    admin.create_topic("static-gone", partitions=2, replication_factor=1)

    def static(instance: str) -> tidelog.Consumer:
        return tidelog.Consumer(
            gateway.address, group_id="static-gone", group_instance_id=instance, **FAST
        )

    a, b = static("a"), static("b")
    try:
        a.subscribe(["static-gone"])
        b.subscribe(["static-gone"])
        _stable_assignments([a, b], 2)
        a.close()
        started = time.monotonic()
        wait_for(
            lambda: (b.poll(timeout_ms=200), len(b.assignment()) == 2)[1] or None,
            30,
            "b owning both partitions",
        )
        # Not at once (no LeaveGroup), but once the session (2 s) ended.
        assert time.monotonic() - started >= 1.0
    finally:
        a.close()
        b.close()


def test_a_rebalance_completes_without_a_member_that_does_not_rejoin_in_time(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """The rebalance deadline is an etcd lease of the rebalance timeout (no gateway's
    clock): a member that keeps heartbeating but does not join again is left out once
    it passed, and told so."""
    admin.create_topic("late", partitions=2, replication_factor=1)
    with grpc.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def join(member_id: str = "") -> gateway_pb2.JoinGroupResponse:
            request = gateway_pb2.JoinGroupRequest(
                group_id="latecomers",
                member_id=member_id,
                topics=["late"],
                session_timeout_ms=10_000,
                rebalance_timeout_ms=2_000,
                max_wait_ms=3_000,
            )
            return _join_twice(stub, request)

        first = join()
        assert first.error.code == ErrorCode.NONE and len(first.assignment) == 2
        started = time.monotonic()
        second = join()  # waits for the first, which only heartbeats
        while second.error.code == ErrorCode.REBALANCE_IN_PROGRESS:
            beat = stub.Heartbeat(
                gateway_pb2.HeartbeatRequest(
                    group_id="latecomers",
                    member_id=first.member_id,
                    generation_id=first.generation_id,
                ),
                timeout=10,
            )
            assert beat.error.code in (ErrorCode.REBALANCE_IN_PROGRESS, ErrorCode.UNKNOWN_MEMBER_ID)
            second = join(second.member_id)
        waited = time.monotonic() - started
        assert second.error.code == ErrorCode.NONE and len(second.assignment) == 2
        assert 1.5 <= waited < 15, waited
        beat = stub.Heartbeat(
            gateway_pb2.HeartbeatRequest(
                group_id="latecomers",
                member_id=first.member_id,
                generation_id=first.generation_id,
            ),
            timeout=10,
        )
        assert beat.error.code == ErrorCode.UNKNOWN_MEMBER_ID


def test_a_first_join_only_hands_out_a_member_id(gateway: GatewayProcess) -> None:
    """KIP-394: a client that never comes back after its first JoinGroup (its gateway
    died, or the answer was lost) leaves no member in the group holding partitions."""
    with grpc.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        first = stub.JoinGroup(
            gateway_pb2.JoinGroupRequest(
                group_id="first-joins",
                topics=["t"],
                session_timeout_ms=10_000,
                rebalance_timeout_ms=10_000,
            ),
            timeout=30,
        )
        assert first.error.code == ErrorCode.MEMBER_ID_REQUIRED and first.member_id
        described = stub.DescribeGroup(
            gateway_pb2.DescribeGroupRequest(group_id="first-joins"), timeout=10
        )
        assert (described.state, len(described.members)) == ("Empty", 0)


def test_member_ids_handed_out_and_never_used_are_bounded(gateway: GatewayProcess) -> None:
    """Each first join holds an etcd lease and key until its session ends: clients that
    only ever ask for ids are refused past MAX_PENDING_MEMBERS, and a member that joins
    with its id still gets in."""
    request = gateway_pb2.JoinGroupRequest(
        group_id="id-hoarders", topics=["t"], session_timeout_ms=60_000, rebalance_timeout_ms=1_000
    )
    with grpc.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        ids = [stub.JoinGroup(request, timeout=30).member_id for _ in range(MAX_PENDING_MEMBERS)]
        assert len(set(ids)) == MAX_PENDING_MEMBERS
        with pytest.raises(grpc.RpcError) as refused:
            stub.JoinGroup(request, timeout=30)
        assert rpc_error_code(refused.value) == ErrorCode.GROUP_MAX_SIZE_REACHED
        assert "not yet joined" in (refused.value.details() or "")
        request.member_id = ids[0]
        request.max_wait_ms = 5_000
        joined = stub.JoinGroup(request, timeout=30)
        assert (joined.error.code, joined.member_id) == (ErrorCode.NONE, ids[0])
        stub.LeaveGroup(gateway_pb2.LeaveGroupRequest(group_id="id-hoarders", member_id=ids[0]))
        # A pending id that leaves (Kafka removes a pending member on LeaveGroup) gives its
        # place back at once; it used to count until its session ended (found by an audit).
        request.member_id = ""
        request.max_wait_ms = 0
        stub.JoinGroup(request, timeout=30)  # the place ids[0] left: full again
        with pytest.raises(grpc.RpcError):
            stub.JoinGroup(request, timeout=30)
        stub.LeaveGroup(gateway_pb2.LeaveGroupRequest(group_id="id-hoarders", member_id=ids[1]))
        assert stub.JoinGroup(request, timeout=30).member_id not in ids


def test_a_commit_whose_deadline_passed_writes_nothing(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A commit the client gave up on must not land late, after a newer commit of the
    same member, with older offsets (the second group audit's finding): no transaction
    starts once the call's deadline passed, and each partition says so."""
    admin.create_topic("late-commit", partitions=1, replication_factor=1)
    store = MetaStore(cluster.etcd.endpoint, cluster=cluster.cluster)
    cache = MetadataCache(store)
    try:
        cache.start(10)
        offsets = OffsetStore(store, cache)
        outcomes = offsets.commit(
            "late-committers",
            [Committed("late-commit", 0, 5)],
            guard=lambda: [],
            deadline=time.monotonic() - 1,
        )
        assert [type(o.error) for o in outcomes] == [RequestTimedOutError]
        assert offsets.fetch("late-committers", [("late-commit", 0)])[0].offset == -1
        outcomes = offsets.commit(
            "late-committers",
            [Committed("late-commit", 0, 5)],
            guard=lambda: [],
            deadline=time.monotonic() + 10,
        )
        assert [o.error for o in outcomes] == [None]
        assert offsets.fetch("late-committers", [("late-commit", 0)])[0].offset == 5
    finally:
        cache.stop()
        store.close()


def test_deleting_a_group_of_many_offsets_is_all_or_nothing(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """DeleteGroup of more offsets than one etcd transaction took (50) deleted them 50 at
    a time: a member joining in between left the group with a part of its offsets and the
    caller with NON_EMPTY_GROUP, as if nothing had been deleted (found by an audit). The
    member joins here right after the first transaction; the outcome must be all deleted
    or none."""
    admin.create_topic("many-offsets", partitions=60, replication_factor=1)
    committed = {("many-offsets", p): p for p in range(60)}
    admin.alter_group_offsets("wide", committed)
    store = MetaStore(cluster.etcd.endpoint, cluster=cluster.cluster)
    cache = MetadataCache(store)
    joined_key = "test/wide-member-joined"

    class JoinAfterFirstTxn:
        """The real store; a member "joins" (a key the guard compares) after one txn."""

        def __init__(self) -> None:
            self.txns = 0

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def txn(self, *args: Any, **kwargs: Any) -> Any:
            result = store.txn(*args, **kwargs)
            self.txns += 1
            if self.txns == 1:
                store.put(joined_key, b"member")
            return result

    def guard() -> list[Compare]:
        if store.get(joined_key) is not None:
            raise NonEmptyGroupError("group 'wide' has 1 member(s)")
        return [Compare.absent(joined_key)]

    try:
        cache.start(10)
        offsets = OffsetStore(JoinAfterFirstTxn(), cache)  # type: ignore[arg-type]
        try:
            outcome: object = offsets.delete_group("wide", guard)
        except NonEmptyGroupError as refused:
            outcome = refused
        left = {(o.topic, o.partition): o.committed_offset for o in admin.describe_group("wide")}
        all_deleted = outcome == 60 and left == {}
        none_deleted = isinstance(outcome, NonEmptyGroupError) and left == committed
        assert all_deleted or none_deleted, (outcome, len(left))
    finally:
        cache.stop()
        store.close()


def test_an_iterating_member_gives_its_partitions_up_promptly(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """``for record in consumer`` hands records out one by one from a large buffer: a
    rebalance must not wait until the whole buffer is handed out, and a loop taking
    records is not "stuck" for max_poll_interval_ms."""
    admin.create_topic("iterated", partitions=4, replication_factor=1)
    values = _produce(gateway.address, "iterated", 4, 500)
    a = _member(gateway.address, "iterators", max_poll_interval_ms=3_000)
    b = _member(gateway.address, "iterators")
    try:
        a.subscribe(["iterated"])
        records = iter(a)
        seen: Counter[bytes] = Counter()
        for _ in range(10):
            record = next(records)
            assert record.value is not None
            seen[record.value] += 1
        before = a.group_metadata()
        assert before is not None and before.member_id
        b.subscribe(["iterated"])
        started = time.monotonic()
        # a keeps taking records slowly (longer in all than max_poll_interval_ms):
        # it gives two partitions up once b asks, and is never dropped for being stuck.
        while len(a.assignment()) != 2 and time.monotonic() - started < 30:
            record = next(records)
            assert record.value is not None
            seen[record.value] += 1
            b.poll(timeout_ms=0)
            time.sleep(0.005)
        assert len(a.assignment()) == 2, a.assignment()
        assert time.monotonic() - started < 15
        meta = a.group_metadata()
        # The same member, rebalanced: not dropped for max_poll_interval_ms and back.
        assert meta is not None and meta.member_id == before.member_id
        del records
        # Nothing is lost across the rebalance: a committed what it had handed out
        # before giving its partitions up, and the rest is read by whoever owns them.
        rest: Counter[bytes] = Counter()
        deadline = time.monotonic() + 60
        while set(seen) | set(rest) != values and time.monotonic() < deadline:
            _poll_into([a, b], rest, sum(rest.values()) + 1, timeout_s=0.5)
        assert set(seen) | set(rest) == values
    finally:
        a.close()
        b.close()


def _slow_join(
    stub: gateway_pb2_grpc.GatewayStub,
    group: str,
    topic: str,
    *,
    member_id: str,
    instance: str,
    wait_ms: int,
) -> Any:
    """A JoinGroup with a 20 s rebalance timeout (``_join_twice``); its answer, or the
    RpcError it raised (a fenced member's)."""
    request = gateway_pb2.JoinGroupRequest(
        group_id=group,
        member_id=member_id,
        topics=[topic],
        session_timeout_ms=10_000,
        rebalance_timeout_ms=20_000,
        max_wait_ms=wait_ms,
        group_instance_id=instance,
    )
    try:
        return _join_twice(stub, request)
    except grpc.RpcError as exc:
        return exc


def test_a_static_member_replaced_while_it_waits_to_join_is_fenced(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """The third group audit's repro: static member A waits in a rebalance's JoinGroup
    when a newer process B with the same instance id takes the place. A must be told
    FENCED_INSTANCE_ID (it was told UNKNOWN_MEMBER_ID, joined anew and took the place
    back from B, which was then fenced: the wrong process survived)."""
    admin.create_topic("pingpong", partitions=3, replication_factor=1)
    with grpc.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def join(member_id: str = "", instance: str = "", wait_ms: int = 3_000) -> Any:
            return _slow_join(
                stub,
                "pingpongs",
                "pingpong",
                member_id=member_id,
                instance=instance,
                wait_ms=wait_ms,
            )

        a = join(instance="x")
        d = join(wait_ms=300)
        a = join(a.member_id, "x")
        d = join(d.member_id)
        assert a.error.code == d.error.code == ErrorCode.NONE
        join(wait_ms=200)  # a third member: a rebalance begins
        waiting: dict[str, Any] = {}
        rejoin = threading.Thread(
            target=lambda: waiting.setdefault("a", join(a.member_id, "x", 3_000))
        )
        rejoin.start()
        time.sleep(0.7)
        b = join(instance="x", wait_ms=300)
        rejoin.join()
        fenced = waiting["a"]
        assert isinstance(fenced, grpc.RpcError), fenced
        assert rpc_error_code(fenced) == ErrorCode.FENCED_INSTANCE_ID
        # B holds the place: its next join is not fenced.
        again = join(b.member_id, "x", 300)
        assert not isinstance(again, grpc.RpcError), again
        assert again.error.code in (ErrorCode.NONE, ErrorCode.REBALANCE_IN_PROGRESS)


def test_a_static_member_replaced_during_its_first_join_is_fenced(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A static member's first JoinGroup (it joins at once) waits in the rebalance it
    began when a newer process B with the same instance id takes the place. A must be
    told FENCED_INSTANCE_ID. Its first join could take a place over on every pass, so the
    pass after B's takeover (which ended A's session) answered UNKNOWN_MEMBER_ID; the
    client then joined anew, took the place back from B, and B was fenced: the older
    process survived (found by an audit)."""
    admin.create_topic("first-join", partitions=3, replication_factor=1)
    with grpc.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def join(member_id: str = "", instance: str = "", wait_ms: int = 3_000) -> Any:
            return _slow_join(
                stub,
                "first-joins",
                "first-join",
                member_id=member_id,
                instance=instance,
                wait_ms=wait_ms,
            )

        # A dynamic member alone in the group; it does not rejoin, so the rebalance A's
        # join begins waits (its rebalance timeout is 20 s).
        d = join(wait_ms=300)
        assert d.error.code == ErrorCode.NONE, d
        waiting: dict[str, Any] = {}
        first = threading.Thread(target=lambda: waiting.setdefault("a", join(instance="x")))
        first.start()
        time.sleep(0.7)
        b = join(instance="x", wait_ms=300)
        first.join()
        assert not isinstance(b, grpc.RpcError), b
        assert b.error.code in (ErrorCode.NONE, ErrorCode.REBALANCE_IN_PROGRESS), b
        a = waiting["a"]
        code = rpc_error_code(a) if isinstance(a, grpc.RpcError) else ErrorCode(a.error.code)
        assert code == ErrorCode.FENCED_INSTANCE_ID
        # B holds the place: its next join is not fenced.
        again = join(b.member_id, "x", 300)
        assert not isinstance(again, grpc.RpcError), again
        assert again.error.code in (ErrorCode.NONE, ErrorCode.REBALANCE_IN_PROGRESS)


def test_a_member_that_lost_its_partitions_does_not_commit_them_on_close(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """From the third group audit: a member dropped for max_poll_interval_ms committed
    its stale positions on close() with auto-commit, as an outsider (it had no member
    id any more), which the group accepts once empty: the next owner's progress was
    overwritten."""
    admin.create_topic("stale", partitions=1, replication_factor=1)
    _produce(gateway.address, "stale", 1, 30)
    slow = _member(gateway.address, "stale-closers", max_poll_interval_ms=1_500)
    other = _member(gateway.address, "stale-closers")
    reader = tidelog.Consumer(gateway.address, group_id="stale-closers")  # never joins
    try:
        slow.subscribe(["stale"])
        wait_for(lambda: slow.poll(max_records=5, timeout_ms=200) or None, 30, "slow reads")
        other.subscribe(["stale"])
        wait_for(
            lambda: (other.poll(timeout_ms=200), other.assignment())[1] or None,
            30,
            "the other member owning the partition",
        )
        # Wherever the group's committed offset left it, the other member reads to the
        # end (counting 25 records waited out _poll_into's minute whenever the slow
        # member had committed more than 5).
        wait_for(
            lambda: (other.poll(timeout_ms=200), other.position(("stale", 0)) == 30)[1],
            30,
            "the other member at the end of the partition",
        )
        other.close()  # commits its position (30) and leaves: the group is empty
        assert reader.committed([("stale", 0)]) == {("stale", 0): 30}
        with pytest.raises(UnknownMemberIdError):
            slow.commit()
        slow.close()  # auto-commit on: must not write its stale position (5)
        assert reader.committed([("stale", 0)]) == {("stale", 0): 30}
    finally:
        slow.close()
        other.close()
        reader.close()


HOUR_MS = 3_600_000
LEASE_GROUP = "leasers"


def _join_for_an_hour(
    stub: gateway_pb2_grpc.GatewayStub, member_id: str = "", wait_ms: int = 200
) -> gateway_pb2.JoinGroupResponse:
    """JoinGroup (and again with the id given) with a rebalance timeout of an hour."""
    request = gateway_pb2.JoinGroupRequest(
        group_id=LEASE_GROUP,
        member_id=member_id,
        topics=["lease-t"],
        session_timeout_ms=10_000,
        rebalance_timeout_ms=HOUR_MS,  # a consumer's max_poll_interval_ms of an hour
        max_wait_ms=wait_ms,
    )
    response: gateway_pb2.JoinGroupResponse = stub.JoinGroup(request, timeout=30)
    if not member_id and response.error.code == ErrorCode.MEMBER_ID_REQUIRED:
        request.member_id = response.member_id
        response = stub.JoinGroup(request, timeout=30)
    return response


def test_a_completed_rebalance_leaves_no_timer_lease_behind(
    cluster: TestCluster, gateway: GatewayProcess
) -> None:
    """Each rebalance grants an etcd lease of the group's rebalance timeout (up to ~25
    days) for its deadline key. The key was deleted when the rebalance completed, but the
    lease lived on in etcd for the whole timeout, one per rebalance (found by an audit)."""
    cluster.create_topic("lease-t", partitions=2, replication_factor=1)
    store = cluster.store
    timer_leases: list[int] = []
    with grpc.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        a = _join_for_an_hour(stub)
        assert a.error.code == ErrorCode.NONE, a
        for _ in range(3):
            b = _join_for_an_hour(stub)  # a second member: a rebalance begins
            assert b.error.code == ErrorCode.REBALANCE_IN_PROGRESS, b
            timer = store.get(timer_key(LEASE_GROUP))
            assert timer is not None and timer.lease_id
            timer_leases.append(timer.lease_id)
            a = _join_for_an_hour(stub, a.member_id, 3_000)  # every member joined: it completes
            assert a.error.code == ErrorCode.NONE, a
            assert store.get(timer_key(LEASE_GROUP)) is None  # the deadline key is gone...
            left = stub.LeaveGroup(
                gateway_pb2.LeaveGroupRequest(group_id=LEASE_GROUP, member_id=b.member_id),
                timeout=10,
            )
            assert left.error.code == ErrorCode.NONE
            a = _join_for_an_hour(stub, a.member_id, 3_000)  # the leave's rebalance completes too
            assert a.error.code == ErrorCode.NONE, a
    # ...and so should its lease be.
    alive = {hex(lid): store.lease_remaining_s(lid) for lid in timer_leases}
    alive = {lid: ttl for lid, ttl in alive.items() if ttl is not None}
    assert not alive, f"rebalance timer leases still alive after completing (TTL s): {alive}"


def test_describe_group_members_names_a_static_members_instance(
    cluster: TestCluster, gateway: GatewayProcess
) -> None:
    """Kafka's MemberDescription.groupInstanceId: which static instance holds which
    partitions (the gateway sent it; Admin dropped it, found by an audit)."""
    cluster.create_topic("instances-t", partitions=2, replication_factor=1)
    with tidelog.Consumer(
        gateway.address, group_id="instances", group_instance_id="host-7"
    ) as consumer:
        consumer.subscribe(["instances-t"])
        wait_for(lambda: consumer.poll(timeout_ms=200) == [] and consumer.assignment(), 30, "join")
        with tidelog.Admin(gateway.address) as admin:
            (member,) = admin.describe_group_members("instances").members
    assert member.group_instance_id == "host-7"
    assert sorted(member.assignment) == [("instances-t", 0), ("instances-t", 1)]
