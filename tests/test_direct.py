"""Direct mode of the SDK (``tidelog.leaders``): producers append to and consumers fetch
from partition leaders themselves, the gateway giving only metadata, producer ids and
offsets. Real etcd, 3 storage nodes, a controller and a gateway as processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import tidelog
from tests.support.cluster import GatewayProcess, TestCluster, running_cluster, wait_for
from tidelog.client import GatewayConnection
from tidelog.errors import (
    InvalidReplicationFactorError,
    MessageTooLargeError,
    RequestTimedOutError,
    UnknownTopicOrPartitionError,
)
from tidelog.leaders import LeaderDirectory
from tidelog.records import BATCH_OVERHEAD_BYTES, RECORD_OVERHEAD_BYTES, encode_batch
from tidelog.v1 import common_pb2, controller_pb2, gateway_pb2, storage_pb2


def _create(admin: tidelog.Admin, topic: str, partitions: int) -> None:
    def create() -> bool | None:
        try:
            admin.create_topic(
                topic,
                partitions=partitions,
                replication_factor=3,
                config={"min.insync.replicas": "2"},
            )
        except InvalidReplicationFactorError:
            return None  # a broker the last test stopped is still registering again
        return True

    wait_for(create, 30, f"three live brokers to create {topic}")


def _read(consumer: tidelog.Consumer, expected: int, timeout_s: float = 60) -> list:
    records: list = []
    deadline = time.monotonic() + timeout_s
    while len(records) < expected and time.monotonic() < deadline:
        records.extend(consumer.poll(max_records=100_000, timeout_ms=500))
    return records


def test_direct_data_path_does_not_go_through_the_gateway(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """With the gateway stopped (SIGSTOP) once metadata and a producer id are in hand,
    direct producers still get every acknowledgement and direct consumers still read
    every record: Append and Fetch go to the leaders. Through the gateway the same calls
    would wait for it until their deadline."""
    _create(admin, "direct-bypass", 3)
    with (
        tidelog.Producer(gateway.address, direct=True, linger_ms=1) as producer,
        tidelog.Consumer(gateway.address, direct=True) as consumer,
    ):
        consumer.assign([("direct-bypass", p) for p in range(3)])
        for p in range(3):
            consumer.seek(("direct-bypass", p), 0)
            producer.send("direct-bypass", b"warm-up", partition=p).result(30)
        assert len(_read(consumer, 3, 30)) == 3  # leaders and addresses are known now
        os.kill(gateway.pid, signal.SIGSTOP)
        try:
            keyed = [
                producer.send("direct-bypass", f"v{i}".encode(), key=f"k{i % 7}".encode())
                for i in range(300)
            ]
            batch = producer.send_batch(
                "direct-bypass", pa.array([b"b" * 50] * 20_000, pa.binary()), partition=1
            )
            acked: dict[tuple[int, int], bytes] = {}
            for i, future in enumerate(keyed):
                meta = future.result(20)
                assert meta.topic == "direct-bypass"
                acked[(meta.partition, meta.offset)] = f"v{i}".encode()
            offsets = batch.result(20).offsets
            records = _read(consumer, 300 + 20_000, 30)
        finally:
            os.kill(gateway.pid, signal.SIGCONT)
    assert len(acked) == 300
    assert list(offsets) == list(range(offsets[0], offsets[0] + 20_000))
    got = {(r.partition, r.offset): r for r in records}
    assert len(got) == len(records) == 300 + 20_000
    for key, value in acked.items():
        assert got[key].value == value
    assert all(got[(1, o)].value == b"b" * 50 for o in offsets)


def test_direct_partitions_with_known_leaders_do_not_wait_for_a_stopped_gateway(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """One partition's leader dies while the gateway is stopped: its records wait (their
    new leader can only come from the gateway), but the other partitions' leaders are
    known and their sends are acknowledged. A stale directory used to make every lookup
    ask the gateway first, on the sender's one thread, so every partition waited for the
    stopped gateway, one request timeout after another."""
    _create(admin, "direct-known-leaders", 3)
    partitions = admin.describe_topic("direct-known-leaders").partitions
    victim = partitions[0].leader
    assert victim not in (partitions[1].leader, partitions[2].leader), partitions
    with tidelog.Producer(
        gateway.address, direct=True, linger_ms=1, request_timeout_ms=20_000
    ) as producer:
        for p in range(3):
            producer.send("direct-known-leaders", b"warm-up", partition=p).result(30)
        os.kill(gateway.pid, signal.SIGSTOP)
        try:
            cluster.kill(cluster.brokers[victim])
            moved = producer.send("direct-known-leaders", b"moved", partition=0)
            wait_for(
                lambda: producer.metrics()["record-retry-total"] > 0 or None,
                30,
                "the send to the dead leader to fail once (the directory is stale now)",
            )
            known = [producer.send("direct-known-leaders", b"known", partition=p) for p in (1, 2)]
            assert [f.result(15).offset for f in known] == [1, 1]
        finally:
            os.kill(gateway.pid, signal.SIGCONT)
            cluster.start_broker(victim)  # the next tests need three brokers
        assert moved.result(60).offset == 1


def test_leader_directory_stays_stale_until_every_topic_is_asked_again(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A directory invalidated because topic B's leader moved, then refreshed about topic A
    alone (a lookup of A), must still ask again about B: it used to count as fresh and
    kept answering B's dead leader."""
    _create(admin, "stale-a", 1)
    _create(admin, "stale-b", 1)
    directory = LeaderDirectory(GatewayConnection(gateway.address))
    directory.refresh(["stale-a", "stale-b"])
    old = directory.leader(("stale-b", 0))
    assert old is not None
    cluster.kill(cluster.brokers[old.broker_id])
    try:
        wait_for(
            lambda: (
                admin.describe_topic("stale-b").partitions[0].leader not in (old.broker_id, -1)
                or None
            ),
            30,
            "a new leader of stale-b",
        )
        directory.invalidate()
        directory.refresh(["stale-a"])
        wait_for(
            lambda: (
                (
                    (leader := directory.leader(("stale-b", 0))) is not None
                    and leader.broker_id != old.broker_id
                )
                or None
            ),
            10,
            "the directory to learn stale-b's new leader",
        )
    finally:
        cluster.start_broker(old.broker_id)  # the next tests need three brokers


def test_direct_consumer_reads_on_while_the_gateway_is_down(
    cluster: TestCluster, admin: tidelog.Admin
) -> None:
    """The gateway dies, then a leader: the direct consumer cannot learn the new leader,
    but it goes on reading the partitions whose leaders it knows. Every poll used to
    raise the failed metadata look-up at once, delivering nothing."""
    own = cluster.start_gateway()  # killed below; the module's gateway stays up
    _create(admin, "direct-no-gateway", 3)
    partitions = admin.describe_topic("direct-no-gateway").partitions
    victim = partitions[0].leader
    assert victim not in (partitions[1].leader, partitions[2].leader), partitions
    with (
        tidelog.Producer(own.address, direct=True, linger_ms=1) as producer,
        tidelog.Consumer(own.address, direct=True, auto_offset_reset="earliest") as consumer,
    ):
        consumer.assign([("direct-no-gateway", p) for p in range(3)])
        for p in range(3):
            producer.send("direct-no-gateway", b"warm-up", partition=p).result(30)
        assert len(_read(consumer, 3, 30)) == 3
        cluster.kill(own)
        cluster.kill(cluster.brokers[victim])
        try:
            # The fetch to the dead leader fails; looking up its successor fails too.
            assert consumer.poll(timeout_ms=1_000) == []
            for p in (1, 2):
                producer.send("direct-no-gateway", b"later", partition=p).result(30)
            later = _read(consumer, 2, 30)
            assert sorted((r.partition, r.value) for r in later) == [(1, b"later"), (2, b"later")]
        finally:
            cluster.start_broker(victim)  # the next tests need three brokers


def test_direct_errors_are_the_leaders_precise_ones(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A batch the leader refuses fails with the leader's error, not a transport one, and
    a topic that does not exist is refused before anything is sent."""
    admin.create_topic(
        "direct-small", partitions=1, replication_factor=1, config={"max.message.bytes": "4096"}
    )
    with tidelog.Producer(gateway.address, direct=True, linger_ms=0) as producer:
        producer.send("direct-small", b"fits", partition=0).result(30)
        with pytest.raises(MessageTooLargeError, match="direct-small-0"):
            producer.send("direct-small", b"x" * 8_000, partition=0).result(30)
        with pytest.raises(UnknownTopicOrPartitionError):
            producer.send("direct-no-such-topic", b"v")
        assert producer.metrics()["record-error-total"] == 1


def test_direct_produce_rides_through_a_leader_kill(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """kill -9 the partition leader during acks=all direct production: the producer finds
    the new leader through the gateway's metadata and retries with the same sequences;
    every acknowledged record is read back exactly once, in offset order."""
    _create(admin, "direct-failover", 1)
    acked: list[tuple[int, bytes]] = []
    with tidelog.Producer(
        gateway.address, direct=True, linger_ms=1, delivery_timeout_ms=60_000
    ) as producer:
        pending = []
        for i in range(600):
            if i == 200:
                leader = admin.describe_topic("direct-failover").partitions[0].leader
                cluster.kill(cluster.brokers[leader])
            value = f"r{i}".encode()
            pending.append((producer.send("direct-failover", value), value))
            if len(pending) >= 20:  # several records in flight when the leader dies
                future, v = pending.pop(0)
                acked.append((future.result(60).offset, v))
        acked.extend((future.result(60).offset, v) for future, v in pending)
    assert admin.describe_topic("direct-failover").partitions[0].leader != leader
    cluster.start_broker(leader)
    with tidelog.Consumer(gateway.address, direct=True, auto_offset_reset="earliest") as c:
        c.assign([("direct-failover", 0)])
        records = _read(c, len(acked))
    assert [(r.offset, r.value) for r in records] == sorted(acked)
    assert [v for _, v in sorted(acked)] == [f"r{i}".encode() for i in range(600)]
    wait_for(
        lambda: len(admin.describe_topic("direct-failover").partitions[0].isr) == 3,
        60,
        "the restarted broker to rejoin the ISR",
    )


def _leaders_of(admin: tidelog.Admin, topic: str) -> dict[int, int]:
    return {p.partition: p.leader for p in admin.describe_topic(topic).partitions}


def test_a_leaders_idle_partitions_go_in_one_append_many(
    gateway: GatewayProcess, admin: tidelog.Admin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kafka sends one produce request per broker for all its partitions: a direct
    producer sends the partitions of a leader that are ready in one pass, with nothing
    else in flight, in one AppendMany (at least GROUP_MIN_PARTITIONS of them, at most
    GROUP_MAX_PARTITIONS), and each partition's answer is its own. Fewer go one Append
    each."""
    _create(admin, "direct-grouped", 12)
    _create(admin, "direct-ungrouped", 3)
    with tidelog.Producer(gateway.address, direct=True, linger_ms=60_000) as producer:
        for topic, count in (("direct-grouped", 12), ("direct-ungrouped", 3)):
            for p in range(count):
                producer.send(topic, b"warm", partition=p)
            producer.flush()  # leaders known, producer id in hand
        leaders = _leaders_of(admin, "direct-grouped")
        per_leader = [list(leaders.values()).count(b) for b in set(leaders.values())]
        assert max(per_leader) >= 4  # four per broker when all three are up
        before = producer.metrics()["request-total"]
        grouped = [
            producer.send("direct-grouped", b"g%d" % p, partition=p, key=b"k") for p in range(12)
        ]
        producer.flush()  # closes every batch in one pass of the sender
        assert producer.metrics()["request-total"] - before == sum(
            1 if n >= 4 else n for n in per_leader
        )
        assert [f.result(30).offset for f in grouped] == [1] * 12
        assert [f.result(30).partition for f in grouped] == list(range(12))

        before = producer.metrics()["request-total"]
        alone = [producer.send("direct-ungrouped", b"u", partition=p) for p in range(3)]
        producer.flush()
        assert producer.metrics()["request-total"] - before == 3
        assert [f.result(30).offset for f in alone] == [1] * 3

        # At most GROUP_MAX_PARTITIONS in one call: four per leader go as three and one.
        monkeypatch.setattr(tidelog.producer, "GROUP_MAX_PARTITIONS", 3)
        before = producer.metrics()["request-total"]
        split = [producer.send("direct-grouped", b"s", partition=p) for p in range(12)]
        producer.flush()
        assert producer.metrics()["request-total"] - before == sum(
            -(-n // 3) if n >= 4 else n for n in per_leader
        )
        assert [f.result(30).offset for f in split] == [2] * 12
    with tidelog.Consumer(gateway.address, direct=True, auto_offset_reset="earliest") as c:
        c.assign([("direct-grouped", p) for p in range(12)])
        records = _read(c, 36)
    assert sorted((r.partition, r.offset, r.value) for r in records) == sorted(
        [(p, 0, b"warm") for p in range(12)]
        + [(p, 1, b"g%d" % p) for p in range(12)]
        + [(p, 2, b"s") for p in range(12)]
    )


def test_grouped_direct_produce_rides_through_a_leader_kill(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """kill -9 a leader while AppendMany calls go to it: its partitions' records are
    retried at the new leaders with the same sequences, the other leaders' partitions go
    on; every acknowledged record is read back exactly once, in each partition's order."""
    topic = "direct-grouped-failover"
    _create(admin, topic, 12)
    acked: dict[int, list[tuple[int, bytes]]] = {p: [] for p in range(12)}
    with tidelog.Producer(
        gateway.address,
        direct=True,
        linger_ms=5,
        delivery_timeout_ms=60_000,
        # One request per partition at a time: each pass finds the partitions idle, so
        # they go in groups (pipelined ones would go alone).
        max_in_flight_requests_per_partition=1,
    ) as producer:
        groups: list[int] = []
        send_group = producer._send_group
        producer._send_group = lambda routed, *rest: (  # type: ignore[method-assign]
            groups.append(len(routed)),
            send_group(routed, *rest),
        )[1]
        pending: list[tuple[Any, int, bytes]] = []
        for i in range(2_400):
            if i == 800:
                killed = admin.describe_topic(topic).partitions[0].leader
                cluster.kill(cluster.brokers[killed])
            partition, value = i % 12, f"r{i}".encode()
            pending.append((producer.send(topic, value, partition=partition), partition, value))
            if len(pending) >= 120:  # ten records of every partition in flight
                future, p, v = pending.pop(0)
                acked[p].append((future.result(60).offset, v))
        for future, p, v in pending:
            acked[p].append((future.result(60).offset, v))
        assert len(groups) >= 10 and min(groups) >= 4, groups
    assert _leaders_of(admin, topic)[0] != killed
    cluster.start_broker(killed)
    with tidelog.Consumer(gateway.address, direct=True, auto_offset_reset="earliest") as c:
        c.assign([(topic, p) for p in range(12)])
        records = _read(c, 2_400)
    for p in range(12):
        mine = [(r.offset, r.value) for r in records if r.partition == p]
        assert mine == sorted(acked[p])
        assert [v for _, v in mine] == [f"r{i}".encode() for i in range(p, 2_400, 12)]


def test_direct_close_whose_timeout_runs_out_completes_every_send(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """close(timeout_s) whose timeout runs out with the queue half sent fails what is left
    at once (Kafka's close(Duration)) and returns with every future done. With unary
    appends (one request in flight per partition), close used to shut down their thread
    pool under the sender, which died on its next append: the rest of the futures never
    completed, not even at the delivery timeout."""
    _create(admin, "direct-close", 1)
    producer = tidelog.Producer(
        gateway.address,
        direct=True,
        linger_ms=0,
        batch_bytes=100,  # a batch per record: the queue takes longer than close waits
        max_in_flight_requests_per_partition=1,
    )
    producer.send("direct-close", b"first", partition=0).result(30)
    futures = [producer.send("direct-close", b"v" * 100, partition=0) for _ in range(3_000)]
    producer.close(timeout_s=0.05)
    assert all(future.done() for future in futures)
    delivered = [f.result(0).offset for f in futures if f.exception(0) is None]
    assert delivered == list(range(1, len(delivered) + 1))  # a prefix, in order
    failed = [f.exception(0) for f in futures if f.exception(0) is not None]
    assert failed
    assert all(isinstance(e, RequestTimedOutError) for e in failed)
    assert all("the producer was closed before" in str(e) for e in failed)
    assert not producer._sender.is_alive()


_CLOSE_AT_EXIT = textwrap.dedent(
    """
    import atexit, sys
    import tidelog

    address, topic, out = sys.argv[1], sys.argv[2], sys.argv[3]
    producer = tidelog.Producer(address, direct=True, linger_ms=200)
    producer.send(topic, b"warm", partition=0).result(30)  # metadata, producer id
    results = []
    def done(f):
        e = f.exception()
        results.append("ok" if e is None else repr(e))
    def close():
        producer.close()
        with open(out, "w") as fh:
            fh.write("\\n".join(results))
    atexit.register(close)  # the usual way to close at exit
    for p in range(12):
        producer.send(topic, b"at exit", partition=p).add_done_callback(done)
    """
)
"""A program whose producer, closed by an atexit handler, still has a record queued for
each of 12 partitions (linger_ms holds them): at least one leader has four, which go in
one AppendMany."""


def test_direct_close_in_an_atexit_handler_delivers_what_is_queued(
    gateway: GatewayProcess, admin: tidelog.Admin, tmp_path: Path
) -> None:
    """Found by an audit: close() called from an atexit handler failed every record with
    UNKNOWN_SERVER_ERROR in direct mode. Unary appends and AppendMany calls went through a
    concurrent.futures pool, which refuses new work once the interpreter exits (its exit
    hook runs, from threading, before atexit handlers): the first one raised RuntimeError
    in the sender, which died. They are made on the producer's own threads now, and
    close() there sends what is queued, as anywhere else."""
    topic = "direct-atexit"
    _create(admin, topic, 12)
    out = tmp_path / "results.txt"
    proc = subprocess.run(
        [sys.executable, "-c", _CLOSE_AT_EXIT, gateway.address, topic, str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_text().splitlines() == ["ok"] * 12, proc.stderr[-3000:]


def test_send_batch_larger_than_the_buffer_is_queued_whole_or_not_at_all(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A send_batch of several buffers' worth, while the leader is stopped: once its first
    batch is queued the call waits for room rather than raise, since a caller would
    retry records already on their way (it used to raise after max_block_ms with part of
    the records queued, and written). One that finds no room for its first batch raises
    with nothing queued."""
    _create(admin, "whole-batches", 1)
    producer = tidelog.Producer(
        gateway.address,
        direct=True,
        linger_ms=1,
        buffer_bytes=1 << 20,
        batch_bytes=256 << 10,
        max_block_ms=500,
        request_timeout_ms=3_000,
    )
    with producer:
        producer.send("whole-batches", b"first", partition=0).result(30)
        leader = cluster.brokers[admin.describe_topic("whole-batches").partitions[0].leader]
        # Nothing drains until the timer below: longer than max_block_ms, shorter than
        # the broker's session (2 s), so that it stays the leader.
        os.kill(leader.pid, signal.SIGSTOP)
        resume = threading.Timer(1.2, os.kill, (leader.pid, signal.SIGCONT))
        resume.start()
        try:
            whole = producer.send_batch("whole-batches", [b"w" * 1000] * 4000, partition=0)
        finally:
            resume.join()
        assert [m.offset for m in whole.result(60)] == list(range(1, 4001))
        leader = cluster.brokers[admin.describe_topic("whole-batches").partitions[0].leader]
        os.kill(leader.pid, signal.SIGSTOP)
        try:
            filling = producer.send_batch("whole-batches", [b"f" * 1000] * 1000, partition=0)
            with pytest.raises(RequestTimedOutError, match="stayed full"):
                producer.send_batch("whole-batches", [b"x" * 1000] * 1000, partition=0)
        finally:
            os.kill(leader.pid, signal.SIGCONT)
        assert [m.offset for m in filling.result(60)] == list(range(4001, 5001))
    with tidelog.Consumer(gateway.address) as consumer:
        assert consumer.end_offsets([("whole-batches", 0)]) == {("whole-batches", 0): 5001}


def test_direct_consumer_finds_a_new_leader_within_one_long_poll(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A leader dies during a direct consumer's poll() while its fetches to the other
    leaders are in flight: the same poll regroups (after the back-off) and returns what
    the new leader has. It used to look leaders up again only when no fetch was in
    flight, so the poll sent the moved partition's fetches to the dead broker until the
    poll's own timeout, and returned nothing."""
    _create(admin, "direct-long-poll", 3)
    partitions = admin.describe_topic("direct-long-poll").partitions
    victim = partitions[0].leader
    assert victim not in (partitions[1].leader, partitions[2].leader), partitions
    with tidelog.Consumer(gateway.address, direct=True, auto_offset_reset="earliest") as consumer:
        consumer.assign([("direct-long-poll", p) for p in range(3)])
        assert consumer.poll(timeout_ms=300) == []  # positions known, long polls going
        polled: list = []
        # One poll, long enough for the old code's to end empty at its timeout.
        poll = threading.Thread(
            target=lambda: polled.extend(consumer.poll(max_records=100, timeout_ms=60_000))
        )
        poll.start()
        try:
            wait_for(lambda: len(consumer._fetches) == 3 or None, 10, "a fetch at every leader")
            cluster.kill(cluster.brokers[victim])
            with tidelog.Producer(gateway.address, linger_ms=1) as producer:
                producer.send("direct-long-poll", b"moved", partition=0).result(60)
            poll.join(90)
            assert [(r.partition, r.value) for r in polled] == [(0, b"moved")]
        finally:
            poll.join(90)
            cluster.start_broker(victim)  # the next tests need three brokers


def test_direct_consumer_regroups_after_a_leader_dies(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """kill -9 the leader a direct consumer is long-polling: its fetch fails, it asks the
    gateway for the new leaders after the back-off, fetches from them, and reads every
    acknowledged record exactly once."""
    _create(admin, "direct-consumer-failover", 3)
    with tidelog.Consumer(gateway.address, direct=True, auto_offset_reset="earliest") as consumer:
        consumer.subscribe(["direct-consumer-failover"])
        consumer.poll(timeout_ms=200)  # long polls in flight at the (empty) log end
        partitions = admin.describe_topic("direct-consumer-failover").partitions
        victim = partitions[0].leader
        cluster.kill(cluster.brokers[victim])
        acked: dict[tuple[int, int], bytes] = {}
        with tidelog.Producer(
            gateway.address, direct=True, linger_ms=1, delivery_timeout_ms=60_000
        ) as producer:
            sent = [(p, f"{p}-{i}".encode()) for i in range(50) for p in range(3)]
            futures = [producer.send("direct-consumer-failover", v, partition=p) for p, v in sent]
            for (p, value), future in zip(sent, futures, strict=True):
                try:
                    offset = future.result(60).offset
                    assert (p, offset) not in acked  # two acknowledged there: one is lost
                    acked[(p, offset)] = value
                except TimeoutError:
                    cluster.start_broker(victim)  # the next tests need three brokers
                    state = admin.describe_topic("direct-consumer-failover")
                    raise AssertionError(
                        f"partition {p} not acknowledged in 60 s; {state}\n{cluster.logs()}"
                    ) from None
        got = [(r.partition, r.offset, r.value) for r in _read(consumer, len(acked))]
        assert sorted(got) == sorted((p, o, v) for (p, o), v in acked.items())
        for p in range(3):
            offsets = [o for q, o, _ in got if q == p]
            assert offsets == sorted(offsets)
        consumer.poll(timeout_ms=0)
        # Every fetch in flight now goes to a live leader, one per leader.
        leaders = {p.leader for p in admin.describe_topic("direct-consumer-failover").partitions}
        assert victim not in leaders
        assert set(consumer._fetches) <= leaders, (consumer._fetches, leaders)
    cluster.start_broker(victim)
    wait_for(
        lambda: all(
            len(p.isr) == 3 for p in admin.describe_topic("direct-consumer-failover").partitions
        ),
        60,
        "the restarted broker to rejoin every ISR",
    )


@pytest.mark.parametrize("direct", [False, True], ids=["gateway", "direct"])
def test_a_retry_resends_its_batches_without_new_ones(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin, direct: bool
) -> None:
    """An acks=all request that times out while both followers are stopped was written by
    the leader; records sent meanwhile wait behind it. Its retry must carry exactly its
    own batches (the leader answers those as duplicates with their first offsets) and
    the new records the next request: a retry mixing them is refused for good with
    DUPLICATE_SEQUENCE_NUMBER, failing every record in it."""
    topic = f"retry-alone-{'direct' if direct else 'gateway'}"
    _create(admin, topic, 1)
    partition = admin.describe_topic(topic).partitions[0]
    followers = [cluster.brokers[b] for b in partition.replicas if b != partition.leader]
    with tidelog.Producer(
        gateway.address, direct=direct, linger_ms=0, request_timeout_ms=1_500
    ) as producer:
        producer.send(topic, b"first").result(30)
        for follower in followers:
            os.kill(follower.pid, signal.SIGSTOP)
        try:
            held = [producer.send(topic, f"held-{i}".encode()) for i in range(5)]
            time.sleep(0.3)  # the held records are in flight, waiting for the followers
            later = []
            for i in range(20):
                later.append(producer.send(topic, f"later-{i}".encode()))
                time.sleep(0.1)  # records keep coming through the timeout and its retry
        finally:
            for follower in followers:
                os.kill(follower.pid, signal.SIGCONT)
        metas = [f.result(60) for f in [*held, *later]]
    assert [m.offset for m in metas] == list(range(1, 26))
    with tidelog.Consumer(gateway.address, direct=direct, auto_offset_reset="earliest") as c:
        c.assign([(topic, 0)])
        values = [r.value for r in _read(c, 26)]
    assert values == [b"first"] + [f"held-{i}".encode() for i in range(5)] + [
        f"later-{i}".encode() for i in range(20)
    ]


@pytest.mark.parametrize("direct", [False, True], ids=["gateway", "direct"])
def test_a_consumer_waits_out_a_throttle_instead_of_spinning(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin, direct: bool
) -> None:
    """A leader holds at most 24 consumer long polls (32 waiting fetches, a quarter kept
    for followers). With 24 others waiting on it, a consumer's fetch is answered at once,
    with a throttle_time_ms of its max_wait (500 ms). The consumer must not fetch again
    before then: it used to ask again at once, hundreds of times a second. Once data
    comes, the waiting fetches and the consumer get it."""
    topic = f"throttled-{'direct' if direct else 'gateway'}"
    _create(admin, topic, 1)
    leader = cluster.brokers[admin.describe_topic(topic).partitions[0].leader]
    held = [
        leader.stub.Fetch.future(
            storage_pb2.FetchRequest(
                replica_id=-1,
                max_wait_ms=20_000,
                partitions=[storage_pb2.FetchPartition(topic=topic, partition=0, fetch_offset=0)],
            ),
            timeout=30,
        )
        for _ in range(24)
    ]
    try:
        time.sleep(0.5)  # they are waiting
        with tidelog.Consumer(gateway.address, direct=direct, auto_offset_reset="earliest") as c:
            c.assign([(topic, 0)])
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                assert c.poll(timeout_ms=200) == []
            # 2 s of polling at one fetch per 500 ms throttle; hundreds when it spun.
            assert c.metrics()["fetch-total"] <= 8, c.metrics()
            with tidelog.Producer(gateway.address, direct=direct) as producer:
                producer.send(topic, b"data").result(30)
            assert [r.value for r in _read(c, 1)] == [b"data"]
        # Each held fetch has the record, but one that found every place taken (a
        # consumer of the test before still leaving) was answered at once, throttled.
        answers = [f.result(30) for f in held]
        assert all(a.partitions[0].records or a.throttle_time_ms > 0 for a in answers)
        assert sum(bool(a.partitions[0].records) for a in answers) >= 20
    finally:
        for future in held:
            future.cancel()


def _in_flight(producer: tidelog.Producer, topic: str) -> int:
    """Requests of ``topic``-0 the producer has sent and not had answered."""
    with producer._lock:
        pq = producer._queues.get((topic, 0))
        return 0 if pq is None else pq.in_flight


def _produce_staged(
    gateway: GatewayProcess, topic: str, records: bytes
) -> gateway_pb2.ProducePartitionResult:
    """Write ``records`` (batches staged with a producer's id and sequences) to
    ``topic``-0 with acks=1, past the SDK."""
    answer = gateway.stub.Produce(
        gateway_pb2.ProduceRequest(
            acks=common_pb2.LEADER,
            timeout_ms=10_000,
            partitions=[
                gateway_pb2.ProducePartitionData(topic=topic, partition=0, records=records)
            ],
        ),
        timeout=15,
    )
    return answer.partitions[0]


def _stop_followers(cluster: TestCluster, admin: tidelog.Admin, topic: str) -> list:
    partition = admin.describe_topic(topic).partitions[0]
    followers = [cluster.brokers[b] for b in partition.replicas if b != partition.leader]
    for follower in followers:
        os.kill(follower.pid, signal.SIGSTOP)
    return followers


def test_direct_producer_keeps_several_requests_of_a_partition_in_flight(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """With the followers stopped, acks=all requests wait at the leader. Each record sent
    meanwhile goes out as its own request down the leader's pipe without waiting for the
    one before (up to max_in_flight_requests_per_partition, 5); a sixth waits in the
    producer. Once the followers resume, all are acknowledged in send order."""
    topic = "direct-pipelined"
    _create(admin, topic, 1)
    with tidelog.Producer(gateway.address, direct=True, linger_ms=0) as producer:
        producer.send(topic, b"first").result(30)
        followers = _stop_followers(cluster, admin, topic)
        try:
            futures = []
            for i in range(5):
                futures.append(producer.send(topic, f"p{i}".encode()))
                wait_for(lambda n=i + 1: _in_flight(producer, topic) == n, 10, f"{i + 1} in flight")
            futures.append(producer.send(topic, b"p5"))
            time.sleep(0.3)
            assert _in_flight(producer, topic) == 5
            assert not any(f.done() for f in futures)
        finally:
            for follower in followers:
                os.kill(follower.pid, signal.SIGCONT)
        assert [f.result(60).offset for f in futures] == list(range(1, 7))


def test_a_leaders_appends_of_one_send_pass_count_as_one_request_in_flight(
    cluster: TestCluster,
    gateway: GatewayProcess,
    admin: tidelog.Admin,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In direct mode a request names one partition, so max_in_flight_requests (16)
    counts the appends one pass of the sender makes to one leader as one request, as they
    would be one produce request in Kafka. With a broker stopped, every acks=all append
    of a 24-partition topic waits; the next record of each partition still goes out,
    pipelined behind the first. Counted one by one, the 24 waiting appends filled the 16
    places and the producer sent nothing more until they were answered (a thousand
    partitions' appends went 16 at a time). Grouping is off here, so that the first
    appends go down the pipes as pipelined partitions' appends do (idle partitions of a
    leader would go in one AppendMany, behind which nothing is pipelined)."""
    monkeypatch.setattr(tidelog.producer, "GROUP_MIN_PARTITIONS", 1_000)
    topic = "direct-wide"
    _create(admin, topic, 24)
    partitions = range(24)

    def in_flight() -> list[int]:
        with producer._lock:
            queues = [producer._queues.get((topic, p)) for p in partitions]
            return [0 if pq is None else pq.in_flight for pq in queues]

    with tidelog.Producer(gateway.address, direct=True, linger_ms=20) as producer:
        for future in [producer.send(topic, b"warm", partition=p) for p in partitions]:
            future.result(30)  # leaders known, a pipe open to each broker
        stopped = cluster.brokers[min(cluster.brokers)]
        os.kill(stopped.pid, signal.SIGSTOP)
        try:
            first = [producer.send(topic, b"a%d" % p, partition=p) for p in partitions]
            wait_for(lambda: in_flight() == [1] * 24, 10, "every partition's first append sent")
            second = [producer.send(topic, b"b%d" % p, partition=p) for p in partitions]
            wait_for(lambda: in_flight() == [2] * 24, 10, "every partition's second append sent")
            assert not any(f.done() for f in first + second)
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        assert [f.result(60).offset for f in first] == [1] * 24
        assert [f.result(60).offset for f in second] == [2] * 24


def test_a_refused_batch_does_not_fail_the_pipelined_ones_behind_it(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Three requests of one partition in flight: the middle one is refused for good
    (MESSAGE_TOO_LARGE, nothing written), so the leader refuses the third as out of
    sequence. The producer fails only the middle record: it takes a new producer id and
    sends the third again under it, and the log holds the first and the third."""
    topic = "direct-pipelined-refusal"
    admin.create_topic(
        topic,
        partitions=1,
        replication_factor=3,
        config={"min.insync.replicas": "2", "max.message.bytes": "4096"},
    )
    with tidelog.Producer(gateway.address, direct=True, linger_ms=0) as producer:
        producer.send(topic, b"first").result(30)
        followers = _stop_followers(cluster, admin, topic)
        try:
            before = producer.send(topic, b"before")
            wait_for(lambda: _in_flight(producer, topic) == 1, 10, "the first request sent")
            too_large = producer.send(topic, b"x" * 8000)
            wait_for(lambda: _in_flight(producer, topic) == 2, 10, "the second request sent")
            after = producer.send(topic, b"after")
            wait_for(lambda: _in_flight(producer, topic) == 3, 10, "the third request sent")
        finally:
            for follower in followers:
                os.kill(follower.pid, signal.SIGCONT)
        assert before.result(60).offset == 1
        with pytest.raises(MessageTooLargeError):
            too_large.result(60)
        assert after.result(60).offset == 2
        assert producer.metrics()["record-error-total"] == 1
        # Four records sent, the third twice: record-send-total counts records sent for
        # the first time (the one encoded again was counted twice; found by an audit).
        assert producer.metrics()["record-send-total"] == 4
    with tidelog.Consumer(gateway.address, direct=True, auto_offset_reset="earliest") as c:
        c.assign([(topic, 0)])
        assert [r.value for r in _read(c, 3)] == [b"first", b"before", b"after"]


def test_direct_producer_leaves_a_stopped_leader(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """SIGSTOP the leader while requests are pipelined to it: its append stream stays
    open and silent, so the producer cancels it once the oldest request is
    request_timeout_ms + the grace old, retries everything that was in flight at the new
    leader in sequence order, and every record is written once, in send order."""
    topic = "direct-stopped-leader"
    _create(admin, topic, 1)
    with tidelog.Producer(
        gateway.address,
        direct=True,
        linger_ms=1,
        request_timeout_ms=1_500,
        delivery_timeout_ms=60_000,
    ) as producer:
        producer.send(topic, b"r0").result(30)
        leader = admin.describe_topic(topic).partitions[0].leader
        stopped = cluster.brokers[leader]
        os.kill(stopped.pid, signal.SIGSTOP)
        try:
            futures = []
            for i in range(1, 200):
                futures.append(producer.send(topic, f"r{i}".encode()))
                if i % 20 == 0:
                    time.sleep(0.01)  # several batches, pipelined to the stopped leader
            offsets = [f.result(60).offset for f in futures]
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
    assert offsets == list(range(1, 200))
    assert admin.describe_topic(topic).partitions[0].leader != leader
    with tidelog.Consumer(gateway.address, direct=True, auto_offset_reset="earliest") as c:
        c.assign([(topic, 0)])
        assert [r.value for r in _read(c, 200)] == [f"r{i}".encode() for i in range(200)]
    wait_for(
        lambda: len(admin.describe_topic(topic).partitions[0].isr) == 3,
        60,
        "the stopped broker to rejoin the ISR",
    )


def test_an_idle_append_stream_is_closed_and_reopened(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A pipe with nothing in flight for connections_max_idle_ms is closed; the next send
    opens a new one."""
    topic = "direct-idle-pipe"
    _create(admin, topic, 1)
    with tidelog.Producer(
        gateway.address, direct=True, linger_ms=0, connections_max_idle_ms=300
    ) as producer:
        assert producer.send(topic, b"a").result(30).offset == 0
        assert producer._pipes
        wait_for(lambda: not producer._pipes, 10, "the idle pipe to close")
        assert producer.send(topic, b"b").result(30).offset == 1
        assert producer._pipes


def test_a_broker_out_of_append_streams_gets_unary_appends(tmp_path) -> None:
    """A broker that has its --max-append-streams open refuses another; that producer
    appends with unary calls instead (one request per partition in flight) and loses
    nothing, while the producer holding the stream keeps it."""
    with running_cluster(tmp_path, 1, storage_args=["--max-append-streams", "1"]) as small:
        gw = small.start_gateway()
        small_admin = tidelog.Admin(gw.address)
        small_admin.create_topic("streams-limited", partitions=2, replication_factor=1)
        with (
            tidelog.Producer(gw.address, direct=True, linger_ms=0) as holder,
            tidelog.Producer(gw.address, direct=True, linger_ms=0) as refused,
        ):
            holder.send("streams-limited", b"h", partition=0).result(30)
            futures = [
                refused.send("streams-limited", f"r{i}".encode(), partition=i % 2)
                for i in range(200)
            ]
            offsets = [f.result(60).offset for f in futures]
            assert refused._pipe_refused_until_s  # it was refused, and went on without
            assert holder._pipes  # the first still has its stream
            assert holder.send("streams-limited", b"h2", partition=0).result(30).offset >= 1
        assert sorted(o for i, o in enumerate(offsets) if i % 2 == 1) == list(range(100))
        # Closing the holder gives the broker's stream back (once the broker has seen
        # the stream end: a producer that asks sooner is refused, so each try is new).

        def successor_gets_the_stream() -> bool:
            with tidelog.Producer(gw.address, direct=True, linger_ms=0) as successor:
                successor.send("streams-limited", b"s", partition=0).result(30)
                return bool(successor._pipes)

        wait_for(successor_gets_the_stream, 10, "a new producer to get the append stream")
        with tidelog.Consumer(gw.address, auto_offset_reset="earliest") as c:
            c.assign([("streams-limited", 1)])
            assert [r.value for r in _read(c, 100)] == [f"r{i}".encode() for i in range(1, 200, 2)]


@pytest.mark.parametrize("direct", [False, True], ids=["gateway", "direct"])
def test_a_retry_older_than_the_remembered_batches_succeeds_once_replicated(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin, direct: bool
) -> None:
    """A leader remembers a producer's last five batches. A retry of an older batch (it
    timed out while five newer ones went in) was written, but its offsets are forgotten.
    Kafka's producer then reports success at an unknown offset; here the leader answers
    so, and only once the HW covers it: with acks=all the record is not acknowledged
    while the followers are stopped, and is once they resume (it used to fail with
    DUPLICATE_SEQUENCE). The newer batches are staged with the producer's own id, epoch
    and sequences, as its later requests would have been."""
    topic = f"old-retry-{'direct' if direct else 'gateway'}"
    _create(admin, topic, 1)
    with tidelog.Producer(
        gateway.address,
        direct=direct,
        linger_ms=0,
        request_timeout_ms=1_500,
        max_in_flight_requests_per_partition=1,
    ) as producer:
        producer.send(topic, b"first").result(30)  # sequence 0
        producer_id, epoch = producer._producer_id, producer._producer_epoch
        followers = _stop_followers(cluster, admin, topic)
        try:
            held = producer.send(topic, b"held")  # sequence 1, waits for the followers
            wait_for(lambda: _in_flight(producer, topic) == 1, 10, "the held request")
            for sequence in range(2, 7):  # five newer batches push sequence 1 out
                staged = encode_batch(
                    [f"newer-{sequence}".encode()],
                    producer_id=producer_id,
                    producer_epoch=epoch,
                    base_sequence=sequence,
                )
                assert _produce_staged(gateway, topic, staged).error.code == common_pb2.NONE
            # The held request times out and is retried, at least once, meanwhile.
            time.sleep(4)
            assert not held.done(), "acknowledged before the followers had it"
        finally:
            for follower in followers:
                os.kill(follower.pid, signal.SIGCONT)
        metadata = held.result(60)
        assert (metadata.topic, metadata.partition, metadata.offset) == (topic, 0, -1)
    with tidelog.Consumer(gateway.address, direct=direct, auto_offset_reset="earliest") as c:
        c.assign([(topic, 0)])
        read = [r.value for r in _read(c, 7)]
    assert read == [b"first", b"held", *[f"newer-{s}".encode() for s in range(2, 7)]]


@pytest.mark.parametrize("direct", [False, True], ids=["gateway", "direct"])
def test_a_request_the_leader_holds_only_in_part_is_resent_batch_by_batch(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin, direct: bool
) -> None:
    """A leader that dies having replicated only the first batches of a multi-batch request
    (a follower's fetch ends on a batch boundary) leaves a new leader holding those and
    not the rest. The retry of the whole request then mixes written and new batches,
    which the leader refuses as DUPLICATE_SEQUENCE, with nothing written. The producer
    must resend each batch alone: the written one is answered with its offsets, the
    rest are appended, and no record fails or repeats (it used to fail them all).

    Staged on one leader: the request's first batch is written beforehand with the
    producer's own id, epoch and sequences, as the new leader would hold it."""
    topic = f"partly-held-{'direct' if direct else 'gateway'}"
    _create(admin, topic, 1)
    values = [bytes([c]) * 600 for c in b"abcd"]
    # Two records a batch: each is estimated at 617 bytes, plus a batch's overhead.
    batch_bytes = 2 * (600 + RECORD_OVERHEAD_BYTES) + BATCH_OVERHEAD_BYTES + 100
    with tidelog.Producer(
        gateway.address,
        direct=direct,
        linger_ms=0,
        batch_bytes=batch_bytes,
        max_in_flight_requests_per_partition=1,
    ) as producer:
        producer.send(topic, b"first").result(30)  # sequence 0
        producer_id, epoch = producer._producer_id, producer._producer_epoch
        followers = _stop_followers(cluster, admin, topic)
        try:
            held = producer.send(topic, b"held")  # sequence 1, waits for the followers
            wait_for(lambda: _in_flight(producer, topic) == 1, 10, "the held request")
            # Queued behind it, then sent in one request: sequences 2-3 and 4-5.
            pair = producer.send_batch(topic, values, partition=0)
            staged = encode_batch(
                values[:2], producer_id=producer_id, producer_epoch=epoch, base_sequence=2
            )
            assert _produce_staged(gateway, topic, staged).base_offset == 2
        finally:
            for follower in followers:
                os.kill(follower.pid, signal.SIGCONT)
        assert held.result(60).offset == 1
        assert list(pair.result(60).offsets) == [2, 3, 4, 5]
    with tidelog.Consumer(gateway.address, direct=direct, auto_offset_reset="earliest") as c:
        c.assign([(topic, 0)])
        read = [r.value for r in _read(c, 6)]
    assert read == [b"first", b"held", *values]


def _metadata_answer(leader: int, epoch: int, port: int) -> controller_pb2.MetadataResponse:
    """A gateway's metadata: brokers 1 and 2 at ``port`` and the next; t-0 led by
    ``leader`` at ``epoch``."""
    return controller_pb2.MetadataResponse(
        brokers=[
            common_pb2.BrokerInfo(broker_id=1, host="127.0.0.1", port=port),
            common_pb2.BrokerInfo(broker_id=2, host="127.0.0.1", port=port + 1),
        ],
        topics=[
            common_pb2.TopicMetadata(
                name="t",
                topic_id="id-1",
                partitions=[
                    common_pb2.PartitionState(
                        topic="t", partition=0, leader=leader, leader_epoch=epoch
                    )
                ],
            )
        ],
    )


class _ScriptedGateway:
    """A GatewayConnection's metadata() answering from a script; the background refresh
    thread's call can be held (it answers what was current when it asked)."""

    def __init__(self) -> None:
        self.answer = _metadata_answer(1, 1, 40001)
        self.hold: threading.Event | None = None

    def metadata(self, topics: Any) -> Any:
        answer = self.answer
        if self.hold is not None and threading.current_thread().name == "tidelog-leaders-refresh":
            self.hold.wait(5)
        return answer


def test_a_late_metadata_answer_does_not_bring_back_an_older_leader_epoch() -> None:
    """Found by an audit: a background refresh asked before an election and answered
    after a foreground refresh had learned of it put the old leader back, and the
    directory counted as fresh. A later epoch of the same topic incarnation is kept
    (Kafka's clients, KIP-320); a re-created topic's epochs start again and are taken."""
    gateway = _ScriptedGateway()
    directory = LeaderDirectory(gateway, min_refresh_interval_s=0.0)  # type: ignore[arg-type]
    directory.refresh(["t"])
    gateway.hold = threading.Event()
    directory.invalidate()
    directory.leader(("t", 0))  # starts the background refresh, held with epoch 1
    wait_for(lambda: directory._refreshing, 5, "the background refresh")
    gateway.answer = _metadata_answer(2, 2, 40001)  # the election
    directory.refresh(["t"])
    gateway.hold.set()
    wait_for(lambda: not directory._refreshing, 5, "the late answer")
    leader = directory.leader(("t", 0))
    assert leader is not None and (leader.broker_id, leader.leader_epoch) == (2, 2)
    recreated = _metadata_answer(1, 0, 40001)
    recreated.topics[0].topic_id = "id-2"
    gateway.answer = recreated
    directory.refresh(["t"])
    leader = directory.leader(("t", 0))
    assert leader is not None and (leader.broker_id, leader.leader_epoch) == (1, 0)


def test_channels_to_addresses_no_broker_has_are_closed_after_a_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: a broker restarted at a new address (a pod's new IP) left its old
    channel in the directory, open, for the life of the process. It is dropped at the
    next metadata answer and closed once a grace has passed (a caller may hold its stub)."""
    import tidelog.leaders as leaders_module

    gateway = _ScriptedGateway()
    directory = LeaderDirectory(gateway, min_refresh_interval_s=0.0)  # type: ignore[arg-type]
    channels = []
    for restart in range(4):  # the leader registers at a new port after each restart
        gateway.answer = _metadata_answer(1, restart + 1, 41000 + 10 * restart)
        directory.refresh(["t"])
        leader = directory.leader(("t", 0))
        assert leader is not None
        directory.storage(leader.address)  # a fetch or an append to it
        channels.append(directory._brokers[leader.address].channel)
    live = {directory.address(1), directory.address(2)}
    assert set(directory._brokers) <= live
    assert len(directory._retired) == 3  # not closed yet: within the grace
    monkeypatch.setattr(leaders_module, "RETIRED_CHANNEL_GRACE_S", 0.0)
    directory.refresh(["t"])
    assert not directory._retired
    with pytest.raises(ValueError, match="closed"):  # grpc's error on a closed channel
        channels[0].unary_unary("/x")(b"", timeout=1)


def test_a_stopped_broker_does_not_stall_appends_to_healthy_leaders(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """max_in_flight_requests counted every leader's requests together: a stopped
    broker's unanswered appends took all 16 places, and nothing went to the healthy
    leaders until they timed out (request_timeout_ms, then again). It bounds each
    leader's now, as Kafka's per connection. Found by an audit."""
    topic = "direct-stopped-one"
    wait_for(lambda: len(cluster.describe_cluster().brokers) == 3 or None, 30, "3 brokers")
    admin.create_topic(topic, partitions=18, replication_factor=1)
    leaders = {p.partition: p.leader for p in admin.describe_topic(topic).partitions}
    stopped_id = leaders[0]
    stuck = [p for p, b in leaders.items() if b == stopped_id]
    healthy = next(p for p, b in leaders.items() if b != stopped_id)
    with tidelog.Producer(
        gateway.address, direct=True, linger_ms=0, request_timeout_ms=20_000
    ) as producer:
        for p in range(18):  # pipes, producer id and leaders known
            producer.send(topic, b"warm", partition=p).result(30)
        pid = cluster.brokers[stopped_id].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            for _ in range(5):  # a few sender passes' worth each, left unanswered
                for p in stuck:
                    producer.send(topic, b"to-stopped", partition=p)
                    time.sleep(0.03)
            started = time.monotonic()
            assert producer.send(topic, b"to-healthy", partition=healthy).result(8).offset == 1
            assert time.monotonic() - started < 3.0
        finally:
            os.kill(pid, signal.SIGCONT)


def _threads_in_until_stop() -> int:
    """Threads of this process blocked in the producer's stream request iterator."""
    count = 0
    for top in sys._current_frames().values():
        frame: Any = top
        while frame is not None:
            code = frame.f_code
            if code.co_name == "_until_stop" and code.co_filename.endswith("producer.py"):
                count += 1
                break
            frame = frame.f_back
    return count


def test_pipes_that_end_leave_no_thread_behind(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """An append stream (pipe) that ended by itself (its broker died, it was cancelled
    as hung, the broker refused it) left gRPC's thread sending its requests waiting for
    ever, one per pipe, close() too: a producer facing restarting brokers piled them up
    until it could start no thread. The reader tells it to stop now, as the gateway
    stream's does. Found by an audit."""
    topic = "direct-pipe-threads"
    _create(admin, topic, 1)
    before = _threads_in_until_stop()
    producer = tidelog.Producer(gateway.address, direct=True, linger_ms=0)
    try:
        producer.send(topic, b"first").result(30)
        leader = admin.describe_topic(topic).partitions[0].leader
        cluster.kill(cluster.brokers[leader])  # its pipe ends; retries find it dead
        futures = []
        for i in range(60):
            futures.append(producer.send(topic, b"r%d" % i))
            time.sleep(0.02)
        for future in futures:
            future.result(60)
    finally:
        producer.close(10)
        cluster.start_broker(leader)
    wait_for(lambda: _threads_in_until_stop() == before or None, 10, "the pipes' threads to end")


def test_direct_consumer_follows_a_moved_leader_after_another_assigned_topic_is_deleted(
    cluster: TestCluster, gateway: GatewayProcess
) -> None:
    """Direct mode sends each fetch to the leader the consumer's grouping names. With one
    assigned topic deleted, every regrouping fails on it (UnknownTopicOrPartitionError for
    the whole metadata look-up) and is given up, marked fresh: a partition of another
    topic whose leader moved was fetched from the old leader (NOT_LEADER_OR_FOLLOWER) for
    ever. Kafka's consumer updates the other topics' metadata; so does this now (found by
    an audit)."""
    admin = tidelog.Admin(gateway.address)
    moving = f"direct-moving-{uuid.uuid4().hex[:6]}"
    doomed = f"direct-doomed-{uuid.uuid4().hex[:6]}"
    admin.create_topic(moving, partitions=1, replication_factor=2)
    admin.create_topic(doomed, partitions=1, replication_factor=1)
    wait_for(lambda: len(admin.describe_topic(moving).partitions[0].isr) == 2 or None, 15, "ISR 2")
    leader = admin.describe_topic(moving).partitions[0].leader
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(moving, [b"a-%d" % i for i in range(5)], partition=0).result(30)
    consumer = tidelog.Consumer(gateway.address, auto_offset_reset="earliest", direct=True)
    try:
        consumer.assign([(moving, 0), (doomed, 0)])
        got: list[int] = []
        deadline = time.monotonic() + 20
        while len(got) < 5 and time.monotonic() < deadline:
            got += [r.offset for r in consumer.poll(timeout_ms=300)]
        assert got == list(range(5))
        admin.delete_topic(doomed)
        wait_for(lambda: doomed not in admin.list_topics() or None, 20, "the deletion")
        cluster.brokers[leader].kill()
        wait_for(
            lambda: admin.describe_topic(moving).partitions[0].leader not in (leader, -1) or None,
            30,
            "a new leader",
        )
        with tidelog.Producer(gateway.address) as producer:
            producer.send_batch(moving, [b"b-%d" % i for i in range(5)], partition=0).result(30)
        deadline = time.monotonic() + 20
        while len(got) < 10 and time.monotonic() < deadline:
            # (The deleted topic's fetches may say so, as Kafka's do.)
            with contextlib.suppress(tidelog.errors.UnknownTopicOrPartitionError):
                got += [r.offset for r in consumer.poll(timeout_ms=300)]
        assert got == list(range(10)), (got, consumer._leaders)
    finally:
        consumer.close()
        cluster.start_broker(leader)
        wait_for(
            lambda: len(admin.describe_topic(moving).partitions[0].isr) == 2 or None, 60, "ISR 2"
        )
