"""An acks=0 request that spent its timeout waiting for produce-budget room is still
written once answered "accepted" (it was not: found by an audit)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from tests.support.cluster import TestCluster, running_cluster
from tidelog.client import GatewayConnection
from tidelog.errors import ErrorCode
from tidelog.records import encode_batch
from tidelog.v1 import common_pb2, gateway_pb2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    with running_cluster(tmp_path_factory.mktemp("produce-produce-acks0"), brokers=2) as c:
        yield c


def test_acks0_request_that_waited_for_budget_room_is_written(cluster: TestCluster) -> None:
    """Default request timeouts, a 1 MiB produce budget held by an acks=1 request to a
    stopped broker: an acks=0 request to the other, healthy, broker waits for room, gets
    it when the holder times out (a moment before its own deadline), and is answered
    "accepted" (nothing failed). Kafka writes an acks=0 request it has accepted; here the
    background append inherits the request's deadline, already (almost) past, and the
    router gives up without calling the leader: the records are silently dropped."""
    gateway = cluster.start_gateway(["--queued-max-request-bytes", str(1024 * 1024)])
    topic = "produce-acks0-budget"
    cluster.create_topic(topic, 2, 1)
    leaders = {p.partition: p.leader for p in cluster.partitions(topic)}
    assert leaders[0] != leaders[1], leaders
    stuck, free = 0, 1
    batch = encode_batch([b"x" * 1000] * 700)  # ~700 KB: two do not fit in 1 MiB

    def produce(
        partition: int, acks: common_pb2.Acks, timeout_ms: int
    ) -> gateway_pb2.ProduceResponse:
        return gateway.stub.Produce(
            gateway_pb2.ProduceRequest(
                acks=acks,
                timeout_ms=timeout_ms,
                partitions=[
                    gateway_pb2.ProducePartitionData(
                        topic=topic, partition=partition, records=batch
                    )
                ],
            ),
            timeout=30,
        )

    stopped = cluster.brokers[leaders[stuck]]
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        holder_timeout_ms = 2_000
        started = time.monotonic()
        holder = threading.Thread(
            target=produce, args=(stuck, common_pb2.LEADER, holder_timeout_ms)
        )
        holder.start()
        time.sleep(0.3)
        # Ends 25 ms after the holder: room comes with ~25 ms of this request's timeout left.
        remaining_ms = int((started + holder_timeout_ms / 1000 + 0.025 - time.monotonic()) * 1000)
        answer = produce(free, common_pb2.NONE_ACKS, remaining_ms).partitions[0]
        holder.join(30)
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    print("acks=0 answer:", ErrorCode(answer.error.code), answer.error.message)
    if ErrorCode(answer.error.code) != ErrorCode.NONE:
        pytest.skip(f"timing: the acks=0 request was refused ({answer.error.message})")
    time.sleep(1.0)
    bounds = GatewayConnection.get(gateway.address).bounds([(topic, free)])
    written = bounds[(topic, free)].latest
    assert written == 700, (
        f"acks=0 request answered accepted (NONE); {written} of 700 records written"
    )
