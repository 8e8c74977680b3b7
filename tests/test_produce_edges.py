"""Gateway produce edges on a one-broker cluster: a stream's answer order under budget
refusals, and acks=0 requests with little time left. Each test failed on the code before
its fix (found by an audit)."""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Iterator

import pytest

from tests.support.cluster import TestCluster, running_cluster, wait_for
from tidelog.client import GatewayConnection
from tidelog.errors import ErrorCode
from tidelog.records import encode_batch
from tidelog.v1 import common_pb2, gateway_pb2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    with running_cluster(tmp_path_factory.mktemp("produce-produce"), brokers=1) as c:
        yield c


def _create(cluster: TestCluster, topic: str) -> None:
    """Once the broker is live again: a test before stops it (SIGSTOP) past its session,
    and it registers again only after (a CI rerun: "0 live brokers")."""
    wait_for(lambda: cluster.create_topic(topic, 1, 1) is not None, 30, f"{topic} created")


def _latest(address: str, topic: str, partition: int) -> int:
    bounds = GatewayConnection.get(address).bounds([(topic, partition)])
    return bounds[(topic, partition)].latest


def test_stream_budget_refusal_is_not_answered_before_an_earlier_request_of_its_partition(
    cluster: TestCluster,
) -> None:
    """ProduceStream answers a request only after the earlier requests it shares a
    partition with (produce.py's stream docstring; Kafka answers in request order). A
    request refused for lack of room in the byte budget is put on the answer queue
    directly, passing an earlier request of the same partition still in flight."""
    gateway = cluster.start_gateway(["--queued-max-request-bytes", str(1024 * 1024)])
    topic = "produce-order"
    cluster.create_topic(topic, 1, 1)
    batch = encode_batch([b"x" * 1000] * 700)  # ~700 KB: two do not fit in 1 MiB
    requests: queue.SimpleQueue = queue.SimpleQueue()

    def gen() -> Iterator[gateway_pb2.ProduceRequest]:
        while True:
            item = requests.get()
            if item is None:
                return
            yield item

    def request(correlation_id: int, timeout_ms: int) -> gateway_pb2.ProduceRequest:
        return gateway_pb2.ProduceRequest(
            correlation_id=correlation_id,
            acks=common_pb2.LEADER,
            timeout_ms=timeout_ms,
            partitions=[gateway_pb2.ProducePartitionData(topic=topic, partition=0, records=batch)],
        )

    broker = cluster.brokers[0]
    answers: list[tuple[int, int]] = []
    os.kill(broker.pid, signal.SIGSTOP)
    try:
        stream = gateway.stub.ProduceStream(gen(), timeout=30)
        requests.put(request(1, 3_000))  # held: its leader does not answer
        time.sleep(0.3)
        requests.put(request(2, 500))  # waits for budget room, refused at 0.5 s
        for response in stream:
            answers.append((response.correlation_id, response.partitions[0].error.code))
            if len(answers) == 2:
                requests.put(None)
    finally:
        os.kill(broker.pid, signal.SIGCONT)
    print("answers (correlation id, error code):", answers)
    assert [c for c, _ in answers] == [1, 2], (
        f"answers came as {answers}: request 2 (same partition, sent after 1) answered first"
    )


def test_acks0_request_with_a_short_timeout_is_written(cluster: TestCluster) -> None:
    """An acks=0 request is answered "accepted" at once; Kafka writes it whatever its
    timeout (the timeout only bounds an acks=all wait). The gateway's background append
    gets the request's timeout_ms as its deadline, and with timeout_ms <= 50 the router
    gives up before calling the leader: accepted, never written, no error anywhere but a
    gateway log line."""
    gateway = cluster.gateways[0] if cluster.gateways else cluster.start_gateway()
    topic = "produce-acks0-timeout"
    _create(cluster, topic)
    for _ in range(5):
        response = gateway.stub.Produce(
            gateway_pb2.ProduceRequest(
                acks=common_pb2.NONE_ACKS,
                timeout_ms=40,
                partitions=[
                    gateway_pb2.ProducePartitionData(
                        topic=topic, partition=0, records=encode_batch([b"v"])
                    )
                ],
            ),
            timeout=10,
        )
        assert ErrorCode(response.partitions[0].error.code) == ErrorCode.NONE
    time.sleep(1.0)
    written = _latest(gateway.address, topic, 0)
    assert written == 5, f"5 acks=0 records answered accepted; {written} written"


def test_sdk_acks0_producer_with_a_short_request_timeout_writes_its_records(
    cluster: TestCluster,
) -> None:
    """The same through the SDK: Producer(acks=0, request_timeout_ms=40) (accepted by its
    config checks) sends, flushes and closes without an error, and nothing is written."""
    import tidelog

    gateway = cluster.gateways[0] if cluster.gateways else cluster.start_gateway()
    topic = "produce-acks0-sdk"
    _create(cluster, topic)
    with tidelog.Producer(
        gateway.address, acks=0, enable_idempotence=False, request_timeout_ms=40, linger_ms=0
    ) as producer:
        futures = [producer.send(topic, b"v%d" % i, partition=0) for i in range(10)]
        producer.flush(timeout_s=10)
    errors = [f.exception() for f in futures if f.exception() is not None]
    assert not errors, errors[:1]
    time.sleep(1.0)
    written = _latest(gateway.address, topic, 0)
    assert written == 10, f"10 records sent with acks=0, no error; {written} written"
