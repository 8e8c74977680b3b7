"""The gateway stopping while a produce request waits for a partition with no leader: it
exits promptly (it spun a core until the request's timeout: found by an audit). One
broker, killed."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

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
    started = time.monotonic()
    gateway.proc.send_signal(15)
    time.sleep(7.0)  # past the 5 s grace: "stopped" is logged by now

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
        gateway.wait(timeout_s=max(0.1, started + 15 - time.monotonic()))
    except RuntimeError:
        exited = False
    took = time.monotonic() - started
    print(
        f"CPU used by the stopped gateway in 2 s: {spun:.2f} s; exited {exited} after {took:.1f} s"
    )
    assert exited, (
        f"the gateway did not exit within 15 s of SIGTERM (its 'stopped' came at ~5 s); "
        f"it used {spun:.2f} s of CPU per 2 s meanwhile"
    )
    assert spun < 0.5, f"the stopped gateway used {spun:.2f} s of CPU in 2 s (spinning)"
