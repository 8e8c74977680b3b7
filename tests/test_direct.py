"""Direct mode of the SDK (``tidelog.leaders``): producers append to and consumers fetch
from partition leaders themselves, the gateway giving only metadata, producer ids and
offsets. Real etcd, 3 storage nodes, a controller and a gateway as processes."""

from __future__ import annotations

import os
import signal
import time

import pyarrow as pa
import pytest

import tidelog
from tests.support.cluster import GatewayProcess, TestCluster, wait_for
from tidelog.errors import MessageTooLargeError, UnknownTopicOrPartitionError


def _create(admin: tidelog.Admin, topic: str, partitions: int) -> None:
    admin.create_topic(
        topic,
        partitions=partitions,
        replication_factor=3,
        config={"min.insync.replicas": "2"},
    )


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
                acked[(p, future.result(60).offset)] = value
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
