"""A gateway under a real memory limit (a cgroup, as a pod's) carries the OMB workload's
shape - 100 partitions, RF=3, acks=all, 1 KiB records - and reads it all back, without
being OOM-killed. Before the produce stream stopped keeping answered requests alive
(``services/gateway/produce.py``), this gateway needed ~400 MiB for it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pyarrow as pa
import pytest

import tidelog
from tests.support.cluster import TestCluster
from tests.support.memory_cgroup import MemoryCgroup, memory_cgroup

LIMIT_BYTES = 256 * 1024 * 1024
RECORDS = 150_000
RECORD_BYTES = 1024
CHUNK = 5_000


@pytest.fixture
def cgroup() -> Iterator[MemoryCgroup]:
    made = memory_cgroup(LIMIT_BYTES)
    if made is None:
        pytest.skip("no writable memory cgroup here (needs root and cgroupfs)")
    yield made
    made.remove()


def test_a_gateway_in_a_256_mib_cgroup_carries_100_partitions_of_acks_all(
    cluster: TestCluster, admin: tidelog.Admin, cgroup: MemoryCgroup
) -> None:
    capped = cluster.start_gateway(command_prefix=cgroup.command_prefix)
    topic = f"capped-gateway-{uuid.uuid4().hex[:8]}"  # a rerun shares the module's cluster
    admin.create_topic(topic, partitions=100, replication_factor=3)
    values = pa.array([b"m" * RECORD_BYTES] * CHUNK, pa.binary())
    with tidelog.Producer(capped.address, acks="all", linger_ms=2) as producer:
        futures = [producer.send_batch(topic, values) for _ in range(RECORDS // CHUNK)]
        acknowledged = sum(len(f.result(120)) for f in futures)
    assert acknowledged == RECORDS
    read = 0
    with tidelog.Consumer(capped.address, auto_offset_reset="earliest") as consumer:
        consumer.subscribe([topic])
        for _ in range(600):
            batch = consumer.poll_arrow(timeout_ms=500)
            read += batch.num_rows
            if read >= RECORDS:
                break
    assert read == RECORDS
    assert capped.proc.poll() is None, "the gateway died"
    assert cgroup.oom_kills() == 0
    # Well inside the limit, not just under it.
    assert cgroup.peak_bytes() < LIMIT_BYTES * 0.9
    cluster.kill(capped)
