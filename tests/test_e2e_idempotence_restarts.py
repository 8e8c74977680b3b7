"""(Kept from an audit, where it passed; slow.) retries of acknowledged requests, staged
with a producer's own id and sequences past the SDK, answered as duplicates (original
offsets, nothing written) by leaders whose producer state came from a snapshot plus
replay after kill -9 (with and without snapshots), and by followers that took over. Real
processes only."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import tidelog
from tests.support.cluster import GatewayProcess, running_cluster, wait_for
from tidelog.records import encode_batch
from tidelog.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.slow

TOPIC = "staged"


def _produce(gateway: GatewayProcess, batches: list[bytes]) -> gateway_pb2.ProducePartitionResult:
    def attempt() -> tuple[gateway_pb2.ProducePartitionResult] | None:
        answer = gateway.stub.Produce(
            gateway_pb2.ProduceRequest(
                acks=common_pb2.ALL,
                timeout_ms=5_000,
                partitions=[
                    gateway_pb2.ProducePartitionData(
                        topic=TOPIC, partition=0, records=b"".join(batches)
                    )
                ],
            ),
            timeout=10,
        )
        result = answer.partitions[0]
        if result.error.code in (
            common_pb2.NOT_LEADER_OR_FOLLOWER,
            common_pb2.LEADER_NOT_AVAILABLE,
            common_pb2.REQUEST_TIMED_OUT,
            common_pb2.NOT_ENOUGH_REPLICAS,
        ):
            return None
        return (result,)

    (result,) = wait_for(attempt, 40, "an answer")
    return result


def _batch(pid: int, seq: int, n: int = 3) -> bytes:
    return encode_batch(
        [f"{seq + i:06d}".encode() * 40 for i in range(n)],
        producer_id=pid,
        producer_epoch=0,
        base_sequence=seq,
    )


def _leader(admin: tidelog.Admin) -> int:
    def elected() -> tuple[int] | None:
        leader = admin.describe_topic(TOPIC).partitions[0].leader
        return (leader,) if leader >= 0 else None

    (leader,) = wait_for(elected, 30, "a leader")
    return leader


def _isr(admin: tidelog.Admin, n: int) -> None:
    wait_for(lambda: len(admin.describe_topic(TOPIC).partitions[0].isr) == n, 60, f"ISR of {n}")


def _read(address: str, expected: int) -> list[bytes]:
    records: list = []
    with tidelog.Consumer(address, auto_offset_reset="earliest") as c:
        c.assign([(TOPIC, 0)])
        deadline = time.monotonic() + 30
        while len(records) < expected and time.monotonic() < deadline:
            records.extend(c.poll(max_records=100_000, timeout_ms=500))
        records.extend(c.poll(max_records=100_000, timeout_ms=500))
    return [r.value for r in records]


@pytest.mark.parametrize("segment_bytes", ["4096", "104857600"], ids=["snapshots", "replay"])
def test_retries_after_restarts_and_failovers_are_answered_as_duplicates(
    tmp_path: Path, segment_bytes: str
) -> None:
    with running_cluster(tmp_path, brokers=2) as cluster:
        gateway = cluster.start_gateway()
        admin = tidelog.Admin(gateway.address)
        admin.create_topic(
            TOPIC,
            partitions=1,
            replication_factor=2,
            config={"min.insync.replicas": "1", "segment.bytes": segment_bytes},
        )
        pid = gateway.stub.InitProducerId(
            gateway_pb2.InitProducerIdRequest(client_id="audit"), timeout=10
        ).producer_id
        seq = 0
        answers: list[tuple[list[bytes], int, int]] = []
        for _ in range(30):
            batches = [_batch(pid, seq)]
            result = _produce(gateway, batches)
            assert result.error.code == common_pb2.NONE, result
            answers.append((batches, result.base_offset, result.last_offset))
            seq += 3
        last_request = [_batch(pid, seq + 3 * i) for i in range(5)]
        result = _produce(gateway, last_request)
        assert result.error.code == common_pb2.NONE, result
        original = (result.base_offset, result.last_offset)
        seq += 15
        total = seq
        assert original[1] == total - 1

        def check_retries(where: str) -> None:
            again = _produce(gateway, last_request)
            assert again.error.code == common_pb2.NONE, (where, again)
            # (Once a newer batch pushed the request's first out of the five remembered,
            # its offsets are forgotten: first offset -1.)
            assert again.base_offset in (original[0], -1), (where, again)
            assert again.last_offset == original[1], (where, again)
            # An acknowledged single-batch request from long ago: written, offsets forgotten.
            old_batches, _, _old_last = answers[-3]
            old = _produce(gateway, old_batches)
            assert old.error.code == common_pb2.NONE, (where, old)
            assert old.base_offset in (-1, answers[-3][1]), (where, old)

        check_retries("first leader")
        first = _leader(admin)
        other = 1 - first
        # The follower restarts (kill -9: snapshot + replay), catches up, then takes over.
        cluster.kill(cluster.brokers[other])
        cluster.start_broker(other)
        _isr(admin, 2)
        cluster.kill(cluster.brokers[first])
        wait_for(lambda: _leader(admin) == other, 30, "the follower to lead")
        check_retries("restarted follower leading")
        nxt = _produce(gateway, [_batch(pid, seq)])
        assert nxt.error.code == common_pb2.NONE and nxt.base_offset == total, nxt
        seq += 3
        total += 3
        # The old leader comes back from its own files (kill -9), follows, and leads again.
        cluster.start_broker(first)
        _isr(admin, 2)
        cluster.kill(cluster.brokers[other])
        wait_for(lambda: _leader(admin) == first, 30, "the old leader to lead again")
        again = _produce(gateway, [_batch(pid, seq - 3)])
        assert again.error.code == common_pb2.NONE and again.base_offset == total - 3, again
        check_retries("old leader leading again")
        cluster.start_broker(other)
        _isr(admin, 2)
        values = _read(gateway.address, total)
        assert len(values) == total, f"{len(values)} records, expected {total}"
        assert values == [f"{i:06d}".encode() * 40 for i in range(total)]
