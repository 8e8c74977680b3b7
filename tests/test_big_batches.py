"""A batch as large as a leader takes (70 MiB) is replicated, and does not hold up the
other partitions its follower fetches from that leader (found by an audit: a follower's
channel took 64 MiB at most).

``max.message.bytes`` may be set up to 2^31 - 1 (``topic_config.py``) and a storage node
takes requests of ~101 MiB (``services/storage/node.py`` ``DEFAULT_MAX_MESSAGE_BYTES``), so a
producer may append one batch of, say, 70 MiB. A leader always answers a follower's fetch
with the first batch whole, however large (``Log.read``), but the follower's channel
refused answers over 64 MiB (``services/storage/fetcher.py`` ``MAX_MESSAGE_BYTES``): every
fetch fails with RESOURCE_EXHAUSTED (``replica_fetch_failed``, three times a second, each
one a 70 MiB read and send by the leader), the follower never gets the batch, drops out
of the ISR and never comes back. The partition is under-replicated for good (until
retention deletes the batch); with min.insync.replicas=2 no acks=all produce succeeds.
Kafka's followers fetch such a batch (KIP-74: the first batch whole, no message cap).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.support.cluster import GatewayProcess, TestCluster
from tidelog.records import encode_batch
from tidelog.v1 import common_pb2, controller_pb2, gateway_pb2, storage_pb2

TOPIC = "big-batch"
BATCH_VALUE_BYTES = 70 * 1024 * 1024
MAX_MESSAGE_BYTES = 90 * 1024 * 1024


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestCluster, GatewayProcess]]:
    base: Path = tmp_path_factory.mktemp("big-batch")
    with TestCluster(base, session_ttl_s=10) as cluster:
        for broker_id in (0, 1):
            cluster.start_broker(broker_id)
        cluster.start_controller(1)
        cluster.wait_brokers([0, 1])
        gateway = cluster.start_gateway()
        yield cluster, gateway


def _follower_log_end(cluster: TestCluster, follower: int) -> int:
    answer = cluster.brokers[follower].stub.DescribeLogDirs(
        storage_pb2.DescribeLogDirsRequest(
            partitions=[common_pb2.TopicPartition(topic=TOPIC, partition=0)]
        ),
        timeout=10,
    )
    ends = [p.log_end_offset for d in answer.log_dirs for p in d.partitions if p.topic == TOPIC]
    return max(ends, default=-1)


def _produce_the_big_batch(cluster: TestCluster, gateway: GatewayProcess) -> tuple[int, int, int]:
    """Create TOPIC (once) and append the big batch; (leader, follower, batch bytes)."""
    api = gateway.stub
    created = api.CreateTopics(
        controller_pb2.CreateTopicsRequest(
            topics=[
                controller_pb2.CreatableTopic(
                    name=TOPIC,
                    num_partitions=1,
                    replication_factor=2,
                    configs=[
                        common_pb2.ConfigEntry(
                            name="max.message.bytes", value=str(MAX_MESSAGE_BYTES)
                        )
                    ],
                )
            ],
            timeout_ms=20_000,
        ),
        timeout=30,
    )
    assert [t.error.code for t in created.topics] == [0], created
    (state,) = cluster.partitions(TOPIC)
    follower = next(b for b in state.replicas if b != state.leader)
    batch = encode_batch([b"v" * BATCH_VALUE_BYTES])
    assert len(batch) < MAX_MESSAGE_BYTES
    produced = api.Produce(
        gateway_pb2.ProduceRequest(
            acks=common_pb2.LEADER,
            partitions=[gateway_pb2.ProducePartitionData(topic=TOPIC, partition=0, records=batch)],
        ),
        timeout=60,
    )
    assert [p.error.code for p in produced.partitions] == [0], produced
    return int(state.leader), int(follower), len(batch)


def test_a_follower_replicates_a_batch_its_leader_accepted(
    env: tuple[TestCluster, GatewayProcess],
) -> None:
    cluster, gateway = env
    _, follower, size = _produce_the_big_batch(cluster, gateway)
    deadline = time.monotonic() + 20
    end = -1
    while time.monotonic() < deadline:
        end = _follower_log_end(cluster, follower)
        if end >= 1:
            break
        time.sleep(0.5)
    failures = [
        line
        for line in cluster.brokers[follower].log_path.read_text().splitlines()
        if "replica_fetch_failed" in line
    ]
    assert end >= 1, (
        f"the follower's log end is still {end} 20 s after the leader took a "
        f"{size}-byte batch; {len(failures)} failed fetches, the last: "
        f"{failures[-1][:300] if failures else None}"
    )


def test_a_big_batch_does_not_stop_replication_of_other_topics(
    env: tuple[TestCluster, GatewayProcess],
) -> None:
    """The follower's fetch names every partition it follows from that leader; the first
    one with data is answered whole, so each fetch where the big batch comes first fails
    as a whole, and partitions after it in the fetch never get their records: acks=all
    produce to another topic with the same leader and follower times out."""
    cluster, gateway = env
    existing = gateway.stub.Metadata(controller_pb2.MetadataRequest(topics=[TOPIC]), timeout=10)
    if not existing.topics or existing.topics[0].error.code != 0:
        leader, follower, _ = _produce_the_big_batch(cluster, gateway)
    else:
        (state,) = cluster.partitions(TOPIC)
        leader = int(state.leader)
        follower = next(int(b) for b in state.replicas if b != state.leader)
    other = "after-the-big-batch"
    created = gateway.stub.CreateTopics(
        controller_pb2.CreateTopicsRequest(
            topics=[
                controller_pb2.CreatableTopic(
                    name=other,
                    assignments=[
                        controller_pb2.ReplicaAssignment(partition=0, broker_ids=[leader, follower])
                    ],
                )
            ],
            timeout_ms=20_000,
        ),
        timeout=30,
    )
    assert [t.error.code for t in created.topics] == [0], created
    produced = gateway.stub.Produce(
        gateway_pb2.ProduceRequest(
            acks=common_pb2.ALL,
            timeout_ms=8_000,
            partitions=[
                gateway_pb2.ProducePartitionData(
                    topic=other, partition=0, records=encode_batch([b"small"])
                )
            ],
        ),
        timeout=30,
    )
    assert [p.error.code for p in produced.partitions] == [0], produced


TWO_LEADERS_TOPIC = "two-leaders-big"
BATCH_VALUE_BYTES = 60 * 1024 * 1024
MAX_MESSAGE_BYTES = 90 * 1024 * 1024


@pytest.fixture(scope="module")
def two_leaders(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[TestCluster, GatewayProcess]]:
    base: Path = tmp_path_factory.mktemp("sendlimit")
    with TestCluster(base, session_ttl_s=10) as cluster:
        for broker_id in (0, 1):
            cluster.start_broker(broker_id)
        cluster.start_controller(1)
        cluster.wait_brokers([0, 1])
        # A gateway whose fetch limit is lowered (memory-shrunk, or set by the operator).
        gateway = cluster.start_gateway(extra_args=["--max-fetch-bytes", str(1024 * 1024)])
        yield cluster, gateway


def _two_big_batches(
    cluster: TestCluster, gateway: GatewayProcess, topic: str, leaders: set[int]
) -> None:
    """``topic`` of two partitions on two leaders, each holding one 60 MiB batch."""
    created = gateway.stub.CreateTopics(
        controller_pb2.CreateTopicsRequest(
            topics=[
                controller_pb2.CreatableTopic(
                    name=topic, num_partitions=2, replication_factor=1,
                    configs=[common_pb2.ConfigEntry(name="max.message.bytes",
                                                    value=str(MAX_MESSAGE_BYTES))],
                )
            ],
            timeout_ms=20_000,
        ),
        timeout=30,
    )  # fmt: skip
    assert [t.error.code for t in created.topics] == [0], created
    assert {s.leader for s in cluster.partitions(topic)} == leaders
    batch = encode_batch([b"v" * BATCH_VALUE_BYTES])
    for partition in (0, 1):
        produced = gateway.stub.Produce(
            gateway_pb2.ProduceRequest(
                acks=common_pb2.LEADER,
                partitions=[gateway_pb2.ProducePartitionData(
                    topic=topic, partition=partition, records=batch)],
            ),
            timeout=60,
        )  # fmt: skip
        assert [p.error.code for p in produced.partitions] == [0], produced


def test_fetch_across_two_leaders_with_big_first_batches(
    two_leaders: tuple[TestCluster, GatewayProcess],
) -> None:
    """Two partitions led by two brokers, each holding one valid 60 MiB batch (the topic
    takes 90 MiB). A Fetch naming both gets each leader's first batch whole (as Kafka's,
    so a consumer makes progress): ~120 MiB, above the gateway's send limit (~106 MiB
    with --max-fetch-bytes 1 MiB). gRPC refuses to send it: RESOURCE_EXHAUSTED on every
    try, and a client fetching both partitions in one call never got past them (found by
    an audit). One leader's oversized answer goes; the other's waits for the next fetch."""
    cluster, gateway = two_leaders
    _two_big_batches(cluster, gateway, TWO_LEADERS_TOPIC, {0, 1})
    channel = grpc.insecure_channel(
        gateway.address, options=[("grpc.max_receive_message_length", -1)]
    )
    try:
        fetch = channel.unary_unary(
            "/tidelog.v1.Gateway/Fetch",
            request_serializer=storage_pb2.FetchRequest.SerializeToString,
            response_deserializer=storage_pb2.FetchResponse.FromString,
        )
        response = fetch(
            storage_pb2.FetchRequest(
                replica_id=-1, max_wait_ms=0,
                partitions=[
                    storage_pb2.FetchPartition(topic=TWO_LEADERS_TOPIC, partition=p,
                                               fetch_offset=0)
                    for p in (0, 1)
                ],
            ),
            timeout=60,
        )  # fmt: skip
    except grpc.RpcError as exc:
        pytest.fail(f"gateway Fetch across two leaders failed: {exc.code()} {exc.details()}")
    finally:
        channel.close()
    assert sum(bool(r.records) for r in response.partitions) == 1


SDK_TOPIC = "sdk-two-leaders-big"


@pytest.fixture(scope="module")
def env16(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[TestCluster, GatewayProcess]]:
    """Brokers 0 and 16: the SDK consumer (gateway mode) puts leaders whose ids are equal
    modulo MAX_FETCHES_IN_FLIGHT (16) in one Fetch (``Consumer._send_fetches``)."""
    base: Path = tmp_path_factory.mktemp("sendlimit16")
    with TestCluster(base, session_ttl_s=10) as cluster:
        for broker_id in (0, 16):
            cluster.start_broker(broker_id)
        cluster.start_controller(1)
        cluster.wait_brokers([0, 16])
        gateway = cluster.start_gateway(extra_args=["--max-fetch-bytes", str(1024 * 1024)])
        yield cluster, gateway


def test_an_sdk_consumer_of_two_leaders_in_one_fetch_reads_both_big_batches(
    env16: tuple[TestCluster, GatewayProcess],
) -> None:
    """The SDK's consumer itself sends such a Fetch: leaders 0 and 16 share its fetch
    group. With fetch_min_bytes=0 (Kafka's consumer takes 0) the gateway asks both leaders
    without waiting and sends both answers. Each partition holds one valid 60 MiB batch;
    the consumer never reads either
    (every Fetch fails RESOURCE_EXHAUSTED at the gateway's send limit; past it, at the
    SDK's own 128 MiB receive limit; found by an audit)."""
    import tidelog

    cluster, gateway = env16
    _two_big_batches(cluster, gateway, SDK_TOPIC, {0, 16})
    consumer = tidelog.Consumer(
        gateway.address,
        auto_offset_reset="earliest",
        fetch_min_bytes=0,  # Kafka allows 0
    )
    try:
        consumer.assign([(SDK_TOPIC, 0), (SDK_TOPIC, 1)])
        got = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and got < 2:
            got += len(consumer.poll(timeout_ms=1000))
    finally:
        consumer.close()
    failures = sum(
        "Sent message larger than max" in line or "RESOURCE_EXHAUSTED" in line
        for line in gateway.log_path.read_text().splitlines()
    )
    assert got == 2, (
        f"{got} of 2 records read in 30 s ({failures} gateway log lines of the send limit)"
    )
