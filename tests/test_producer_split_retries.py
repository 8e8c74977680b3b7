"""An idempotent producer's retried batch that the leader already wrote is not written
again (found by an audit). A retry request may be larger than the requests first sent
(the sender puts every ready partition's retry in one ProduceRequest); a gateway whose
--max-request-bytes refuses it (RECORD_LIST_TOO_LARGE) made the producer split its
batches into halves as if new, under a new producer id, and the records already written
went into the log a second time. Real processes: etcd, controller, two storage nodes, a
gateway behind a TCP proxy that cuts the producer's connection while its acks=all answers
are pending. And the leader answers a retry of a batch it wrote with its offsets even
after the topic's max.message.bytes was lowered below it (it refused it as too large, and
the producer split it)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import tidelog
from tests.support.cluster import running_cluster, wait_for
from tests.support.tcp_proxy import TcpProxy
from tidelog.v1 import common_pb2, controller_pb2

TOPIC = "split-after-write"
RECORDS = 60
VALUE_BYTES = 10_000  # 60 x 10 KB = ~600 KB a batch: one fits 1,000,000 bytes, two do not


def _in_flight(producer: tidelog.Producer) -> int:
    with producer._lock:
        return sum(len(picked) for picked in producer._in_flight.values())


def test_a_retry_refused_as_too_large_does_not_write_a_written_batch_twice(
    tmp_path: Path,
) -> None:
    with running_cluster(tmp_path, brokers=2) as cluster:
        gateway = cluster.start_gateway(["--max-request-bytes", "1000000"])
        created = gateway.stub.CreateTopics(
            controller_pb2.CreateTopicsRequest(
                topics=[
                    controller_pb2.CreatableTopic(
                        name=TOPIC,
                        assignments=[
                            controller_pb2.ReplicaAssignment(partition=p, broker_ids=[0, 1])
                            for p in range(2)
                        ],
                        configs=[common_pb2.ConfigEntry(name="min.insync.replicas", value="1")],
                    )
                ],
                timeout_ms=20_000,
            ),
            timeout=30,
        )
        assert [t.error.code for t in created.topics] == [0], created
        admin = tidelog.Admin(gateway.address)
        wait_for(
            lambda: all(
                p.leader == 0 and len(p.isr) == 2 for p in admin.describe_topic(TOPIC).partitions
            ),
            30,
            "broker 0 leading both partitions, ISR of two",
        )
        proxy = TcpProxy(gateway.address)
        follower = cluster.brokers[1]
        futures = []
        try:
            with tidelog.Producer(
                proxy.address, linger_ms=0, request_timeout_ms=20_000, delivery_timeout_ms=60_000
            ) as producer:
                producer.send_batch(TOPIC, [b"warm-up"], partition=0).result(30)
                os.kill(follower.pid, signal.SIGSTOP)  # acks=all answers now wait
                for p in range(2):
                    values = [b"%d-%03d-" % (p, i) + b"x" * VALUE_BYTES for i in range(RECORDS)]
                    futures.append(producer.send_batch(TOPIC, values, partition=p))
                    # Each in a request of its own (each fits the gateway's limit).
                    wait_for(lambda p=p: _in_flight(producer) == p + 1, 10, "the request in flight")
                time.sleep(1.0)  # both appended by the leader, their answers pending
                proxy.retarget(gateway.address, cut=True)  # the answers are lost
                time.sleep(0.5)
                os.kill(follower.pid, signal.SIGCONT)
                follower = None
                results = [f.result(60) for f in futures]
        finally:
            if follower is not None:
                os.kill(follower.pid, signal.SIGCONT)
            proxy.down()
        assert [len(r) for r in results] == [RECORDS, RECORDS]
        with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
            consumer.assign([(TOPIC, 0), (TOPIC, 1)])
            records: list = []
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                got = consumer.poll(max_records=10_000, timeout_ms=500)
                records += got
                if not got and len(records) >= 2 * RECORDS + 1:
                    break
        values = [r.value[:7] for r in records if r.value != b"warm-up"]
        twice = sorted({v for v in values if values.count(v) > 1})
        assert not twice, (
            f"{len(values)} records in the log for {2 * RECORDS} sent; "
            f"{len(twice)} written twice, e.g. {twice[:3]}"
        )
        assert len(values) == 2 * RECORDS


def test_a_retry_refused_by_a_lowered_max_message_bytes_does_not_write_a_written_batch_twice(
    tmp_path: Path,
) -> None:
    """The same through the leader: a batch written but not acknowledged (its follower
    stopped: the ISR shrinks below min.insync.replicas, the producer retries), then the
    topic's max.message.bytes lowered below the batch's size. Once the ISR is back, the
    leader checks the retry's size before it looks for a duplicate, answers
    MESSAGE_TOO_LARGE, and the producer sends the batch's records again as two new
    halves under a new producer id. (Kafka splits keeping the producer id and sequences,
    which the leader refuses as out of order: nothing is written twice.)"""
    topic = "split-after-write-leader"
    with running_cluster(tmp_path, brokers=2) as cluster:
        gateway = cluster.start_gateway()
        created = gateway.stub.CreateTopics(
            controller_pb2.CreateTopicsRequest(
                topics=[
                    controller_pb2.CreatableTopic(
                        name=topic,
                        assignments=[
                            controller_pb2.ReplicaAssignment(partition=0, broker_ids=[0, 1])
                        ],
                        configs=[common_pb2.ConfigEntry(name="min.insync.replicas", value="2")],
                    )
                ],
                timeout_ms=20_000,
            ),
            timeout=30,
        )
        assert [t.error.code for t in created.topics] == [0], created
        admin = tidelog.Admin(gateway.address)

        def isr() -> list[int]:
            return list(admin.describe_topic(topic).partitions[0].isr)

        wait_for(lambda: sorted(isr()) == [0, 1], 30, "ISR of two")
        follower = cluster.brokers[1]
        try:
            with tidelog.Producer(
                gateway.address, linger_ms=0, request_timeout_ms=3_000, delivery_timeout_ms=90_000
            ) as producer:
                producer.send_batch(topic, [b"warm-up"], partition=0).result(30)
                os.kill(follower.pid, signal.SIGSTOP)  # acks=all answers now wait
                values = [b"0-%03d-" % i + b"x" * VALUE_BYTES for i in range(RECORDS)]
                future = producer.send_batch(topic, values, partition=0)
                wait_for(
                    lambda: producer.metrics()["record-retry-total"] > 0 and isr() == [0],
                    60,
                    "the ISR shrunk to the leader and the batch retried",
                )
                admin.alter_topic_config(topic, {"max.message.bytes": "400000"})
                time.sleep(1.0)  # the leader applies it
                os.kill(follower.pid, signal.SIGCONT)
                follower = None
                result = future.result(90)
        finally:
            if follower is not None:
                os.kill(follower.pid, signal.SIGCONT)
        assert len(result) == RECORDS
        with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
            consumer.assign([(topic, 0)])
            records: list = []
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                got = consumer.poll(max_records=10_000, timeout_ms=500)
                records += got
                if not got and len(records) >= RECORDS + 1:
                    break
        values_read = [r.value[:6] for r in records if r.value != b"warm-up"]
        twice = sorted({v for v in values_read if values_read.count(v) > 1})
        assert not twice, (
            f"{len(values_read)} records in the log for {RECORDS} sent; "
            f"{len(twice)} written twice, e.g. {twice[:3]}"
        )
