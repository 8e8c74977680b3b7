"""The gateway stopping with ProduceStream appends still queued on a broker's pool: it exits
(the stream waited for ever on a cancelled future: found by an audit)."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from tests.support.cluster import TestCluster
from tidelog.records import encode_batch
from tidelog.v1 import common_pb2, gateway_pb2

PARTITIONS = 70  # more than a broker pool's 64 workers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    # A long session: the stopped broker stays registered and the leader (no election,
    # no partition without a leader while the gateway stops).
    with TestCluster(tmp_path_factory.mktemp("produce-produce-stop2"), session_ttl_s=60) as c:
        c.start_broker(0)
        c.start_controller(1)
        c.wait_brokers([0])
        yield c


def test_gateway_exits_after_sigterm_with_stream_appends_queued(cluster: TestCluster) -> None:
    """close() cancels the appends still queued on a pool. A ProduceStream request with
    one of them never got its answer (send_ready raised CancelledError in a callback),
    the handler's generator waited on its queue for ever, and the gRPC server thread it
    held kept the process from exiting (found by an audit). Queued appends complete as
    "the gateway is stopping" now."""
    gateway = cluster.start_gateway(["--produce-group-min-partitions", "100000"])
    topic = "produce-stop-stream"
    cluster.create_topic(topic, PARTITIONS, 1)
    requests: queue.SimpleQueue = queue.SimpleQueue()

    def gen() -> Iterator[gateway_pb2.ProduceRequest]:
        while True:
            item = requests.get()
            if item is None:
                return
            yield item

    answers: list[object] = []

    def consume(stream: Iterator[gateway_pb2.ProduceResponse]) -> None:
        try:
            for response in stream:
                answers.append(response.correlation_id)
        except grpc.RpcError as exc:
            answers.append(exc.code())

    broker = cluster.brokers[0]
    stream = gateway.stub.ProduceStream(gen(), timeout=60)
    reader = threading.Thread(target=consume, args=(stream,), daemon=True)
    reader.start()
    os.kill(broker.pid, signal.SIGSTOP)
    try:
        requests.put(
            gateway_pb2.ProduceRequest(
                correlation_id=1,
                acks=common_pb2.LEADER,
                timeout_ms=60_000,
                partitions=[
                    gateway_pb2.ProducePartitionData(
                        topic=topic, partition=p, records=encode_batch([b"v"])
                    )
                    for p in range(PARTITIONS)
                ],
            )
        )
        time.sleep(1.5)  # 64 appends wait on the stopped broker, 6 are queued
        gateway.proc.send_signal(signal.SIGTERM)
        exited = True
        try:
            gateway.wait(timeout_s=15)  # its 5 s grace, then its parts stop
        except RuntimeError:
            exited = False
    finally:
        os.kill(broker.pid, signal.SIGCONT)
        requests.put(None)
    assert exited, f"the gateway did not exit within 15 s of SIGTERM; the stream saw {answers}"
