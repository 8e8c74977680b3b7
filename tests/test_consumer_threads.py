"""The consumer's thread and process rules (Kafka's KafkaConsumer): one thread at a time,
``wakeup()`` from any thread, ``close()`` in the polling thread, and no use in a child made
by ``os.fork()``; a closed consumer leaves no member, heartbeat or fetch behind (a real
cluster). Each test failed before the rules were enforced (found by a thread audit)."""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
import pytest

import tidelog
from tests.support.cluster import GatewayProcess, poll_records, wait_for
from tidelog.client import GatewayConnection
from tidelog.errors import ConcurrentAccessError, ConfigError, WakeupError
from tidelog.membership import GroupMembership
from tidelog.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

FAST = {"session_timeout_ms": 2_000, "heartbeat_interval_ms": 300}
"""Short sessions (etcd's lease minimum is 2 s) so a member that died shows in seconds."""
CONCURRENT = "not safe for multi-threaded access"


def _member(address: str, group_id: str, **options: Any) -> tidelog.Consumer:
    settings: dict[str, Any] = {"auto_offset_reset": "earliest", **FAST, **options}
    return tidelog.Consumer(address, group_id=group_id, **settings)


def _owning(consumer: tidelog.Consumer, partitions: int, timeout_s: float = 30) -> float:
    """Poll until ``consumer`` owns ``partitions`` partitions; the seconds it took."""
    started = time.monotonic()

    def owns() -> bool | None:
        consumer.poll(timeout_ms=100)
        return len(consumer.assignment()) == partitions or None

    wait_for(owns, timeout_s, f"a member owning {partitions} partition(s)")
    return time.monotonic() - started


def _produce(address: str, topic: str, partitions: int, per_partition: int) -> set[bytes]:
    values: set[bytes] = set()
    with tidelog.Producer(address) as producer:
        for p in range(partitions):
            batch = [f"{topic}-{p}-{i}".encode() for i in range(per_partition)]
            producer.send_batch(topic, batch, partition=p).result(30)
            values.update(batch)
    return values


def _heartbeat_threads(group_id: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"tidelog-heartbeat-{group_id}"]


def _refused_in_child(name: str, call: Callable[[], object]) -> str:
    """``name:ok`` when ``call`` raised the fork ConfigError within a second."""
    started = time.monotonic()
    try:
        call()
    except ConfigError as exc:
        if "os.fork()" not in str(exc):
            return f"{name}:other ConfigError {exc}"
    except Exception as exc:  # reported to the parent, which fails
        return f"{name}:{type(exc).__name__} {exc}"
    else:
        return f"{name}:returned"
    took = time.monotonic() - started
    return f"{name}:ok" if took < 1 else f"{name}:raised after {took:.1f} s"


def test_a_consumer_used_after_fork_raises_in_the_child_and_its_close_leaves_the_group_alone(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A consumer made (and polled: a fetch in flight) before os.fork(): in the child
    every call raises ConfigError at once, where poll returned [] for ever (or a cryptic
    NetworkError); close() there returns at once and sends no LeaveGroup, so the
    parent's member keeps its partitions and reads on."""
    topic, group = "forked", "forked-group"
    admin.create_topic(topic, partitions=2, replication_factor=1)
    consumer = _member(gateway.address, group)
    try:
        consumer.subscribe([topic])
        _owning(consumer, 2)
        consumer.poll(timeout_ms=100)  # fetches in flight at the fork
        [member] = admin.describe_group_members(group).members
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report through the pipe, always leave with os._exit
            status = 1
            try:
                os.close(read_fd)
                tp = (topic, 0)
                checks = [
                    _refused_in_child("poll", lambda: consumer.poll(timeout_ms=3_000)),
                    _refused_in_child("poll_arrow", lambda: consumer.poll_arrow(timeout_ms=500)),
                    _refused_in_child("iter", lambda: next(iter(consumer))),
                    _refused_in_child("commit", consumer.commit),
                    _refused_in_child("committed", consumer.committed),
                    _refused_in_child("position", lambda: consumer.position(tp)),
                    _refused_in_child("seek", lambda: consumer.seek(tp, 0)),
                    _refused_in_child("seek_to_end", consumer.seek_to_end),
                    _refused_in_child("pause", lambda: consumer.pause([tp])),
                    _refused_in_child("assignment", consumer.assignment),
                    _refused_in_child("end_offsets", lambda: consumer.end_offsets([tp])),
                    _refused_in_child("subscribe", lambda: consumer.subscribe([topic])),
                    _refused_in_child("assign", lambda: consumer.assign([tp])),
                ]
                started = time.monotonic()
                consumer.close()
                consumer.close()
                took = time.monotonic() - started
                checks.append("close:ok" if took < 1 else f"close:took {took:.1f} s")
                os.write(write_fd, "\n".join(checks).encode())
                status = 0
            finally:
                os._exit(status)
        os.close(write_fd)
        report = b""
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                ready, _, _ = select.select([read_fd], [], [], 0.5)
                if ready:
                    chunk = os.read(read_fd, 65536)
                    if not chunk:
                        break
                    report += chunk
            else:
                os.kill(pid, signal.SIGKILL)
        finally:
            os.close(read_fd)
            _, status = os.waitpid(pid, 0)
        checks = report.decode().splitlines()
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, checks)
        assert checks and all(c.endswith(":ok") for c in checks), checks
        # The parent's member is untouched by the child's close: same member, same
        # partitions, and it reads what is written after the fork.
        assert [m.member_id for m in admin.describe_group_members(group).members] == [
            member.member_id
        ]
        written = _produce(gateway.address, topic, 2, 5)
        got = {v for _, v in poll_records(consumer, 10)}
        assert got == written
        assert len(consumer.assignment()) == 2
    finally:
        consumer.close()
    assert admin.describe_group_members(group).members == ()


def test_a_second_thread_using_a_polling_consumer_is_refused_and_nothing_is_read_twice(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Kafka's ConcurrentModificationException: a call from a second thread while one
    polls raises at once (ConfigError) and changes nothing; wakeup() stays callable from
    anywhere. Four threads polling one consumer used to hand some records out twice."""
    admin.create_topic("idle-shared", partitions=1, replication_factor=1)
    idle = tidelog.Consumer(gateway.address, auto_offset_reset="earliest")
    idle.assign([("idle-shared", 0)])
    outcome: list[str] = []

    def long_poll() -> None:
        try:
            idle.poll(timeout_ms=20_000)
            outcome.append("returned")
        except WakeupError:
            outcome.append("woken")

    poller = threading.Thread(target=long_poll, name="long-poller")
    poller.start()
    try:
        time.sleep(1)  # the poll waits for records that do not come
        for name, call in (
            ("poll", lambda: idle.poll(timeout_ms=100)),
            ("seek", lambda: idle.seek(("idle-shared", 0), 0)),
            ("assignment", idle.assignment),
            ("close", idle.close),  # (no group: it used to leave a fetch in flight)
        ):
            with pytest.raises(ConcurrentAccessError, match=f"{CONCURRENT}: thread 'long-poller'"):
                call()
            assert poller.is_alive(), f"{name} ended the poll"
        started = time.monotonic()
        idle.wakeup()  # the way to stop it from another thread
        poller.join(10)
        assert outcome == ["woken"] and time.monotonic() - started < 5
        # Nothing was changed by the refused calls: the poller's thread gone, this one
        # may use it, and closing it here ends its fetches.
        assert idle.assignment() == [("idle-shared", 0)]
        assert idle.poll(timeout_ms=100) == []
    finally:
        idle.wakeup()
        poller.join(30)
        idle.close()
    assert not idle._fetches  # nothing in flight after close

    admin.create_topic("busy-shared", partitions=3, replication_factor=1)
    written = _produce(gateway.address, "busy-shared", 3, 2_000)
    consumer = tidelog.Consumer(gateway.address, auto_offset_reset="earliest")
    consumer.assign([("busy-shared", p) for p in range(3)])
    seen: Counter[bytes] = Counter()
    refused = Counter[str]()
    unexpected: list[BaseException] = []

    def poller_loop() -> None:
        deadline = time.monotonic() + 30
        while sum(seen.values()) < len(written) and time.monotonic() < deadline:
            try:
                for record in consumer.poll(max_records=7, timeout_ms=200):
                    assert record.value is not None
                    seen[record.value] += 1
            except ConfigError as exc:
                if CONCURRENT not in str(exc):
                    unexpected.append(exc)
                    return
                refused[threading.current_thread().name] += 1
            except BaseException as exc:  # reported below
                unexpected.append(exc)
                return

    try:
        threads = [threading.Thread(target=poller_loop, name=f"poller-{i}") for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not unexpected, unexpected
        assert sum(refused.values()) > 0  # they did overlap
        for _, value in poll_records(consumer, len(written) - sum(seen.values()), 30):
            seen[value] += 1
        assert [v for v, n in seen.items() if n > 1] == []
        assert set(seen) == written
    finally:
        consumer.close()


def test_wakeup_stops_a_group_poll_and_close_from_another_thread_is_refused(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """The documented way to stop a member polling in another thread: wakeup() there,
    close() in the polling thread. A close() from the other thread during the poll raises
    (Kafka's ConcurrentModificationException) and the member keeps working; it used to
    take 30 s, let the poll run on, and leave a member holding a partition with its
    heartbeats running (a new member got nothing for a minute)."""
    topic, group = "woken-group", "woken-group"
    admin.create_topic(topic, partitions=2, replication_factor=1)
    consumer = _member(gateway.address, group)
    result: dict[str, str] = {}

    def other_thread() -> None:
        time.sleep(1)
        try:
            consumer.close()
            result["close"] = "closed"
        except ConfigError as exc:
            result["close"] = str(exc)
        consumer.wakeup()

    try:
        consumer.subscribe([topic])
        _owning(consumer, 2)
        other = threading.Thread(target=other_thread, name="closer")
        other.start()
        started = time.monotonic()
        with pytest.raises(WakeupError):
            consumer.poll(timeout_ms=20_000)
        assert time.monotonic() - started < 10
        other.join(30)
        assert CONCURRENT in result["close"], result
        # Still a working member: its partitions, its reads.
        assert sorted(consumer.assignment()) == [(topic, 0), (topic, 1)]
        written = _produce(gateway.address, topic, 2, 5)
        assert {v for _, v in poll_records(consumer, 10)} == written
        assert len(admin.describe_group_members(group).members) == 1
    finally:
        consumer.close()  # here, in its own thread: leaves the group
    assert not _heartbeat_threads(group)
    newcomer = _member(gateway.address, group)
    try:
        newcomer.subscribe([topic])
        assert _owning(newcomer, 2) < 5
        assert len(admin.describe_group_members(group).members) == 1
    finally:
        newcomer.close()


def test_closing_in_a_rebalance_callback_leaves_no_member_behind(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """close() in the polling thread during a rebalance (its revocation callback) leaves
    the group for good: the poll used to join again with the membership just left,
    restarting its heartbeats, a member nobody polled for holding partitions. close() in
    the assignment callback ends the poll at once (it used to wait its whole timeout)."""
    topic, group = "closing-in-rebalance", "closing-in-rebalance"
    admin.create_topic(topic, partitions=2, replication_factor=1)
    revoked: list[list[tuple[str, int]]] = []
    first = _member(gateway.address, group, max_poll_interval_ms=10_000)

    def close_first(partitions: list[tuple[str, int]]) -> None:
        revoked.append(partitions)
        first.close()

    second = _member(gateway.address, group)
    try:
        first.subscribe([topic], on_partitions_revoked=close_first)
        _owning(first, 2)
        second.subscribe([topic])

        last_poll_s: list[float] = []

        def first_closed() -> bool | None:
            second.poll(timeout_ms=100)  # joining: the group rebalances
            if not revoked:
                started = time.monotonic()
                polled = first.poll(timeout_ms=5_000)
                last_poll_s.append(time.monotonic() - started)
                assert polled == []
            return bool(revoked) or None

        wait_for(first_closed, 30, "the first member closing in its revocation callback")
        assert revoked == [[(topic, 0), (topic, 1)]]  # told once
        assert last_poll_s[-1] < 2  # the poll ended with the close
        assert _owning(second, 2) < 10
        assert len(admin.describe_group_members(group).members) == 1
        assert len(_heartbeat_threads(group)) == 1  # the second's
        with pytest.raises(ConfigError, match="closed"):
            first.poll(timeout_ms=100)
    finally:
        first.close()
        second.close()
    assert admin.describe_group_members(group).members == ()

    third = _member(gateway.address, group)
    third.subscribe([topic], on_partitions_assigned=lambda _: third.close())
    try:
        started = time.monotonic()
        assert third.poll(timeout_ms=10_000) == []
        assert time.monotonic() - started < 5
        assert not third._fetches  # nothing fetched after the close
        assert admin.describe_group_members(group).members == ()
        assert not _heartbeat_threads(group)
    finally:
        third.close()


def test_a_membership_left_never_joins_or_heartbeats_again(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """After leave(), join() returns None and no heartbeat thread starts: a join after
    the leave (a poll racing a close) used to clear the stop flag, restart the
    heartbeats and put the member back in the group, holding its partitions."""
    topic = group = "left-for-good"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    membership = GroupMembership(
        GatewayConnection.get(gateway.address),
        group,
        client_id="left-for-good",
        session_timeout_ms=2_000,
        rebalance_timeout_ms=5_000,
        heartbeat_interval_ms=300,
        max_poll_interval_ms=5_000,
        wake=lambda: None,
    )
    assert membership.join([topic], time.monotonic() + 30) == [(topic, 0)]
    assert len(_heartbeat_threads(group)) == 1
    membership.leave()
    assert not _heartbeat_threads(group)
    assert admin.describe_group_members(group).members == ()
    assert membership.join([topic], time.monotonic() + 5) is None
    assert not _heartbeat_threads(group)
    assert admin.describe_group_members(group).members == ()
    assert membership.member_id == ""


class _GatewayAnsweringANewCode(gateway_pb2_grpc.GatewayServicer):  # type: ignore[misc]
    """A gateway that joins anyone and answers heartbeats with an error code this client
    does not know (as a newer gateway might)."""

    def JoinGroup(  # noqa: N802 - gRPC's method name
        self, request: gateway_pb2.JoinGroupRequest, context: Any
    ) -> gateway_pb2.JoinGroupResponse:
        return gateway_pb2.JoinGroupResponse(member_id="m-1", generation_id=1)

    def Heartbeat(  # noqa: N802 - gRPC's method name
        self, request: gateway_pb2.HeartbeatRequest, context: Any
    ) -> gateway_pb2.HeartbeatResponse:
        return gateway_pb2.HeartbeatResponse(
            error=common_pb2.Error(code=9_999, message="a code from the future")
        )


def test_a_heartbeat_answered_with_an_unknown_code_keeps_the_heartbeat_thread() -> None:
    """Found by an audit: ErrorCode(code) raised ValueError on a code the client does not
    know, which ended the heartbeat thread silently: the session expired while the
    consumer went on handing out records of partitions already another member's. Such a
    code is an unknown server error: the member joins again, the thread goes on."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    gateway_pb2_grpc.add_GatewayServicer_to_server(_GatewayAnsweringANewCode(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    membership = GroupMembership(
        GatewayConnection.get(f"127.0.0.1:{port}"),
        "future-codes",
        client_id="future-codes",
        session_timeout_ms=2_000,
        rebalance_timeout_ms=5_000,
        heartbeat_interval_ms=50,
        max_poll_interval_ms=60_000,
        wake=lambda: None,
    )
    try:
        assert membership.join(["t"], time.monotonic() + 10) == []
        wait_for(membership.needs_join, 10, "the heartbeat's answer taken as a rejoin")
        assert membership.partitions_lost()
        assert len(_heartbeat_threads("future-codes")) == 1
    finally:
        membership.leave()
        server.stop(None)
