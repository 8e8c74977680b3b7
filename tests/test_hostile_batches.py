"""A compressed batch that inflates enormously, on the broker (found by an audit).

The broker treats batches as opaque on the data path, but ``Log.offset_for_timestamp``
decodes the one batch that holds the answer of a ListOffsets BY_TIMESTAMP / MAX_TIMESTAMP
(``services/storage/log/log.py``), with the consumer's default inflation bound
(``records.DEFAULT_MAX_UNCOMPRESSED_BYTES``, ~2 GiB). A producer's 16 KiB zstd batch of
zeros, accepted by the leader (its record count is 1), then makes every such ListOffsets
(any client, through a gateway; a Subscribe BY_TIMESTAMP; Spark's startingTimestamp)
inflated it whole in the storage node: 256 MiB here, up to 2 GiB per call, one per
concurrent call. The lookup's decoding is bounded now
(``TIMESTAMP_LOOKUP_MAX_UNCOMPRESSED_BYTES``; beyond it the batch's header answers).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import zstandard

from tests.support.cluster import GatewayProcess, TestCluster
from tidelog import formats
from tidelog.batch import crc32c
from tidelog.v1 import common_pb2, controller_pb2, gateway_pb2, storage_pb2

TOPIC = "inflate"
INFLATED_BYTES = 256 * 1024 * 1024


def _zeros_zstd(size: int) -> bytes:
    compressor = zstandard.ZstdCompressor(level=19).compressobj(size=size)
    chunk = bytes(1 << 20)
    parts = [compressor.compress(chunk) for _ in range(size >> 20)]
    parts.append(compressor.flush())
    return b"".join(parts)


def _bomb(inflated_bytes: int, timestamp_ms: int) -> bytes:
    """One zstd batch of one record whose body declares ``inflated_bytes`` of zeros: valid
    checksums, magic, attributes and counts; the body's structure is not (a decoder finds
    that only after inflating it)."""
    region = _zeros_zstd(inflated_bytes)
    total = formats.BATCH_HEADER_SIZE + len(region)
    batch = bytearray(total)
    formats.BATCH_HEADER.pack_into(
        batch,
        0,
        0,  # base_offset
        total - formats.LOG_OVERHEAD,
        -1,  # partition_leader_epoch
        formats.BATCH_MAGIC,
        0,  # crc, below
        0,  # header_crc, below
        formats.COMPRESSION_ZSTD,
        0,  # last_offset_delta
        timestamp_ms,
        timestamp_ms,
        -1,
        -1,
        -1,
        1,  # record_count
    )
    batch[formats.BATCH_HEADER_SIZE :] = region
    formats.U32.pack_into(
        batch, formats.CRC_OFFSET, crc32c(memoryview(batch)[formats.BODY_CRC_START :])
    )
    formats.U32.pack_into(
        batch, formats.HEADER_CRC_OFFSET, crc32c(memoryview(batch)[: formats.HEADER_CRC_OFFSET])
    )
    return bytes(batch)


def _peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise LookupError(f"no VmHWM for {pid}")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestCluster, GatewayProcess]]:
    base: Path = tmp_path_factory.mktemp("inflate")
    with TestCluster(base, session_ttl_s=10) as cluster:
        cluster.start_broker(0)
        cluster.start_controller(1)
        cluster.wait_brokers([0])
        gateway = cluster.start_gateway()
        yield cluster, gateway


def test_list_offsets_by_timestamp_does_not_inflate_a_hostile_batch_in_the_broker(
    env: tuple[TestCluster, GatewayProcess],
) -> None:
    cluster, gateway = env
    api = gateway.stub
    created = api.CreateTopics(
        controller_pb2.CreateTopicsRequest(
            topics=[
                controller_pb2.CreatableTopic(name=TOPIC, num_partitions=1, replication_factor=1)
            ],
            timeout_ms=20_000,
        ),
        timeout=30,
    )
    assert [t.error.code for t in created.topics] == [0], created
    now_ms = int(time.time() * 1000)
    bomb = _bomb(INFLATED_BYTES, now_ms)
    assert len(bomb) < 64 * 1024  # far below max.message.bytes (1 MiB)
    produced = api.Produce(
        gateway_pb2.ProduceRequest(
            acks=common_pb2.ALL,
            partitions=[gateway_pb2.ProducePartitionData(topic=TOPIC, partition=0, records=bomb)],
        ),
        timeout=10,
    )
    assert [p.error.code for p in produced.partitions] == [0], produced
    broker = cluster.brokers[0]
    before = _peak_rss_bytes(broker.pid)
    for spec, timestamp_ms in ((common_pb2.MAX_TIMESTAMP, -1), (common_pb2.BY_TIMESTAMP, now_ms)):
        # Any answer will do: what matters is what the broker allocated.
        with contextlib.suppress(grpc.RpcError):
            api.ListOffsets(
                storage_pb2.ListOffsetsRequest(
                    replica_id=-1,
                    partitions=[
                        storage_pb2.ListOffsetsPartition(
                            topic=TOPIC, partition=0, spec=spec, timestamp_ms=timestamp_ms
                        )
                    ],
                ),
                timeout=30,
            )
    grown = _peak_rss_bytes(broker.pid) - before
    assert broker.proc.poll() is None, broker.log_tail()
    # A 16 KiB request must not cost the broker hundreds of MiB (up to 2 GiB per call).
    assert grown < 64 * 1024 * 1024, (
        f"a {len(bomb)}-byte batch made the storage node's peak RSS grow by "
        f"{grown >> 20} MiB on ListOffsets"
    )
