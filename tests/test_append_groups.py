"""A produce request whose partitions share a leader (one AppendMany) with one partition
stuck on acks=all (its follower frozen, still in the ISR).

The gateway sends a leader's partitions of one produce request in one AppendMany and
asks the leader to give up acks=all waits ``2 * DEADLINE_MARGIN_S`` (100 ms) before its
own gRPC deadline for the call. The leader appends every entry first and counts each
entry's wait from the end of *its* append, so the wait of an entry late in the group ends
later than the gateway expects by the time the leader took to receive and append the
entries before it. When one partition's acks=all cannot complete (a follower in the ISR
that stopped fetching), the leader answers after the gateway's deadline; the gateway
then throws the whole answer away (DEADLINE_EXCEEDED -> "append alone", by then with no
time left), and every partition of the group is answered REQUEST_TIMED_OUT - including
those the leader had written and committed at once. Kafka answers them with their
offsets and only the stuck one with REQUEST_TIMED_OUT; so does the leader now, ending its
waits by its caller's deadline (``services/storage/server.py`` ``_answer_by``). Found by
an audit.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import GatewayProcess, TestCluster, wait_for
from tests.test_gateway import _end_offset
from tidelog.records import encode_batch
from tidelog.v1 import common_pb2, controller_pb2, gateway_pb2


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestCluster, GatewayProcess]]:
    base: Path = tmp_path_factory.mktemp("gwprod-group")
    # A long session: a frozen broker stays registered (and in its ISRs) for the test.
    cluster = TestCluster(base, session_ttl_s=15)
    try:
        cluster.start_broker(0)
        cluster.start_broker(1)
        cluster.start_controller(1)
        cluster.wait_brokers([0, 1])
        gateway = cluster.start_gateway()
        yield cluster, gateway
    finally:
        cluster.close()


def _create(cluster: TestCluster, name: str, assignment: list[list[int]]) -> None:
    response = cluster.api.CreateTopics(
        controller_pb2.CreateTopicsRequest(
            topics=[
                controller_pb2.CreatableTopic(
                    name=name,
                    num_partitions=len(assignment),
                    replication_factor=len(assignment[0]),
                    assignments=[
                        controller_pb2.ReplicaAssignment(partition=p, broker_ids=b)
                        for p, b in enumerate(assignment)
                    ],
                )
            ],
            timeout_ms=10_000,
        ),
        timeout=20,
    )
    assert response.topics[0].error.code == 0, response


@pytest.mark.parametrize("mib_per_partition", [10])
def test_acknowledged_partitions_of_a_group_are_not_reported_timed_out(
    two: tuple[TestCluster, GatewayProcess], mib_per_partition: int
) -> None:
    """Four partitions with RF 1 on broker 0 (committed as soon as written) and one whose
    follower, broker 1, is frozen (SIGSTOP; still registered and in the ISR), all led by
    broker 0, in one acks=all request: the four must be answered with their offsets.
    10 MiB each (a raw client; the gateway takes up to 100 MiB): on this machine the
    bug shows from ~4 MiB a partition, and sooner on a loaded leader."""
    cluster, gateway = two
    fast, slow = f"fast{mib_per_partition}", f"slow{mib_per_partition}"
    _create(cluster, fast, [[0]] * 4)
    _create(cluster, slow, [[0, 1]])
    # ~1 MB batches (max.message.bytes), several per partition, as a producer's request.
    records = b"".join(encode_batch([b"x" * 1000] * 900) for _ in range(mib_per_partition))

    def request(timeout_ms: int, fast_records: bytes) -> gateway_pb2.ProduceRequest:
        return gateway_pb2.ProduceRequest(
            acks=common_pb2.ALL,
            timeout_ms=timeout_ms,
            partitions=[
                *(
                    gateway_pb2.ProducePartitionData(topic=fast, partition=p, records=fast_records)
                    for p in range(4)
                ),
                gateway_pb2.ProducePartitionData(
                    topic=slow, partition=0, records=encode_batch([b"s"])
                ),
            ],
        )

    wait_for(
        lambda: all(
            r.error.code == 0
            for r in gateway.stub.Produce(
                request(10_000, encode_batch([b"w"])), timeout=30
            ).partitions
        ),
        30,
        "both topics writable",
    )
    os.kill(cluster.brokers[1].pid, signal.SIGSTOP)
    try:
        response = gateway.stub.Produce(request(2_000, records), timeout=30)
    finally:
        os.kill(cluster.brokers[1].pid, signal.SIGCONT)
    got = [(r.topic, r.partition, r.error.code, r.base_offset) for r in response.partitions]
    # The stuck one times out, as in Kafka.
    assert got[4][2] == common_pb2.REQUEST_TIMED_OUT, got
    # The four were written (and, RF 1, committed) right away: each holds 1 + 900*n records.
    assert [_end_offset(gateway, fast, p) for p in range(4)] == [1 + 900 * mib_per_partition] * 4
    assert [(c[2], c[3]) for c in got[:4]] == [(common_pb2.NONE, 1)] * 4, (
        got,
        [r.error.message for r in response.partitions],
    )


def _numbered(i: int, *topics: str, timeout_ms: int) -> gateway_pb2.ProduceRequest:
    """An acks=all request, correlation id ``i``, of one record ``i`` to partition 0 of
    each of ``topics``."""
    return gateway_pb2.ProduceRequest(
        acks=common_pb2.ALL,
        timeout_ms=timeout_ms,
        correlation_id=i,
        partitions=[
            gateway_pb2.ProducePartitionData(
                topic=t, partition=0, records=encode_batch([b"%d" % i])
            )
            for t in topics
        ],
    )


def test_a_stream_answers_a_partitions_requests_in_order(
    two: tuple[TestCluster, GatewayProcess],
) -> None:
    """gateway.proto: ProduceStream answers "possibly out of order across partitions, in
    order within a partition". r1 = {ord-fast-0, ord-slow-0 (stuck on acks=all)} and
    r2 = {ord-fast-0}: r2's answer, which carries ord-fast-0's second append, comes
    before r1's, which carries its first (the answers go out as whole requests complete:
    a client completing ord-fast-0's sends as answers come sees them out of order; found
    by an audit)."""
    cluster, gateway = two
    _create(cluster, "ord-fast", [[0]])
    _create(cluster, "ord-slow", [[0, 1]])

    wait_for(
        lambda: all(
            r.error.code == 0
            for r in gateway.stub.Produce(
                _numbered(0, "ord-fast", "ord-slow", timeout_ms=3_000), timeout=30
            ).partitions
        ),
        30,
        "both topics writable",
    )
    os.kill(cluster.brokers[1].pid, signal.SIGSTOP)
    try:
        answers = list(
            gateway.stub.ProduceStream(
                iter(
                    [
                        _numbered(1, "ord-fast", "ord-slow", timeout_ms=3_000),
                        _numbered(2, "ord-fast", timeout_ms=3_000),
                    ]
                ),
                timeout=30,
            )
        )
    finally:
        os.kill(cluster.brokers[1].pid, signal.SIGCONT)
    order = [
        (a.correlation_id, [(r.topic, r.error.code, r.base_offset) for r in a.partitions])
        for a in answers
    ]
    assert [a.correlation_id for a in answers] == [1, 2], order


def test_a_long_chain_of_answers_waiting_for_one_request_is_sent_in_order(
    two: tuple[TestCluster, GatewayProcess],
) -> None:
    """Hundreds of requests of one partition waiting for the answer of a first one stuck
    on another partition: each answer was sent from the callback of the one before, a
    recursion as deep as the chain, whose stack overflow the futures swallow (the stream's
    answers would stop for good; found by an audit, by reading). They go in a loop now."""
    cluster, _ = two
    deep = cluster.start_gateway(["--max-in-flight-per-stream", "1000"])
    _create(cluster, "chain-fast", [[0]])
    _create(cluster, "chain-slow", [[0, 1]])

    wait_for(
        lambda: all(
            r.error.code == 0
            for r in deep.stub.Produce(
                _numbered(0, "chain-fast", "chain-slow", timeout_ms=5_000), timeout=30
            ).partitions
        ),
        30,
        "both topics writable",
    )
    requests = [_numbered(1, "chain-fast", "chain-slow", timeout_ms=5_000)]
    requests += [_numbered(i, "chain-fast", timeout_ms=5_000) for i in range(2, 602)]
    os.kill(cluster.brokers[1].pid, signal.SIGSTOP)
    try:
        answers = list(deep.stub.ProduceStream(iter(requests), timeout=60))
    finally:
        os.kill(cluster.brokers[1].pid, signal.SIGCONT)
    assert [a.correlation_id for a in answers] == list(range(1, 602))
    fast = [a.partitions[0] for a in answers]
    assert [p.base_offset for p in fast] == list(range(1, 602))  # in order, each once
