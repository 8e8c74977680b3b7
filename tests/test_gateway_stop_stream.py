"""The gateway stopping with ProduceStream appends still queued on a broker's pool: it exits
(the stream waited for ever on a cancelled future: found by an audit)."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

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
    """close() cancels the appends still queued on a pool; a ProduceStream request with
    one of them never gets its answer (send_ready raises CancelledError in a callback),
    its stream's in_flight stays up, the handler's generator waits on its queue for
    ever, and the gRPC server thread it holds keeps the process from exiting (the
    interpreter's exit joins the server pool's threads). The root cause is a known item
    ("close() cancelling a direct future can leave a stream's in_flight up"); this is
    its consequence: a gateway that never exits on SIGTERM."""
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
        started = time.monotonic()
        gateway.proc.send_signal(signal.SIGTERM)
        time.sleep(8.0)

        def cpu_s() -> float:
            fields = Path(f"/proc/{gateway.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        spun = 0.0
        if gateway.proc.poll() is None:
            before = cpu_s()
            time.sleep(2.0)
            spun = cpu_s() - before
        exited = True
        try:
            gateway.wait(timeout_s=10)
        except RuntimeError:
            exited = False
        took = time.monotonic() - started
    finally:
        os.kill(broker.pid, signal.SIGCONT)
        requests.put(None)
    print(f"exited {exited} after {took:.1f} s; CPU {spun:.2f} s in 2 s; stream saw {answers}")
    assert exited, "the gateway did not exit within 20 s of SIGTERM (5 s grace)"
