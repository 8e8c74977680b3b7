"""The gateway stopping while a produce request waits for a partition with no leader: it
exits promptly (it spun a core until the request's timeout: found by an audit). One
broker, killed."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from tests.support.cluster import TestCluster, running_cluster, wait_for
from tidelog.records import encode_batch
from tidelog.v1 import common_pb2, gateway_pb2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    with running_cluster(tmp_path_factory.mktemp("produce-produce-stop"), brokers=1) as c:
        yield c


def test_gateway_stops_promptly_with_a_produce_waiting_for_a_leader(cluster: TestCluster) -> None:
    """SIGTERM: the gateway stops its server (5 s grace), then its parts. A unary
    single-partition Produce waiting for a leader (acks=1, the default 30 s timeout) runs
    in the router's loop on a gRPC server thread; once the metadata cache is stopped,
    ``wait_for_change`` returns at once, and the loop spins until the request's timeout.
    The process does not exit before that thread ends."""
    gateway = cluster.start_gateway()
    topic = "produce-stop"
    cluster.create_topic(topic, 1, 1)
    cluster.kill(cluster.brokers[0])
    stub = gateway.stub
    wait_for(
        lambda: cluster.partitions(topic)[0].leader < 0 or None,
        20,
        "the partition to lose its leader",
    )
    outcome: list[object] = []

    def produce() -> None:
        try:
            outcome.append(
                stub.Produce(
                    gateway_pb2.ProduceRequest(
                        acks=common_pb2.LEADER,
                        timeout_ms=30_000,
                        partitions=[
                            gateway_pb2.ProducePartitionData(
                                topic=topic, partition=0, records=encode_batch([b"v"])
                            )
                        ],
                    ),
                    timeout=40,
                )
            )
        except grpc.RpcError as exc:
            outcome.append(exc.code())

    caller = threading.Thread(target=produce, daemon=True)
    caller.start()
    time.sleep(1.0)
    gateway.proc.send_signal(signal.SIGTERM)
    try:
        gateway.wait(timeout_s=15)  # its 5 s grace, then its parts stop
    except RuntimeError:
        pytest.fail("the gateway did not exit within 15 s of SIGTERM (it spun until 30 s)")
