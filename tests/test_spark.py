"""The tidelog data source in a real Spark ``local[2]`` session against a real cluster
(etcd, controller, 3 storage nodes, gateway as processes). One Spark session for the
module: it costs ~1 GiB and several seconds to start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tidelog
from tests.support.cluster import GatewayProcess, TestCluster, running_cluster
from tidelog.partitioner import partition_for_key

pyspark = pytest.importorskip("pyspark")
from pyspark.sql import functions as F  # noqa: E402, N812

from tidelog.spark import local_session  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    with running_cluster(tmp_path_factory.mktemp("spark-cluster")) as c:
        yield c


@pytest.fixture(scope="module")
def gateway(cluster: TestCluster) -> GatewayProcess:
    return cluster.start_gateway()


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    session = local_session("tidelog-tests", tmp_path_factory.mktemp("spark-local"))
    try:
        yield session
    finally:
        session.stop()


def test_batch_write_then_batch_read_is_identical(spark: Any, gateway: GatewayProcess) -> None:
    tidelog.Admin(gateway.address).create_topic("spark-rt", partitions=4, replication_factor=2)
    rows = 10_000
    df = spark.range(rows).select(
        F.when(F.col("id") % 7 == 0, F.lit(None))
        .otherwise(F.concat(F.lit("k"), (F.col("id") % 50).cast("string")))
        .cast("binary")
        .alias("key"),
        F.concat(F.lit("value-"), F.col("id").cast("string")).cast("binary").alias("value"),
        F.when(
            F.col("id") % 3 == 0,
            F.array(
                F.struct(
                    F.lit("h").alias("key"),
                    F.col("id").cast("string").cast("binary").alias("value"),
                )
            ),
        ).alias("headers"),
    )
    df.write.format("tidelog").option("gateway", gateway.address).option("topic", "spark-rt").mode(
        "append"
    ).save()
    read = (
        spark.read.format("tidelog")
        .option("gateway", gateway.address)
        .option("subscribe", "spark-rt")
        .option("includeHeaders", "true")
        .load()
    )
    got = {
        r["value"]: (r["key"], [(h["key"], h["value"]) for h in (r["headers"] or [])])
        for r in read.select("key", "value", "headers").collect()
    }
    assert len(got) == rows
    for i in range(rows):
        key = None if i % 7 == 0 else f"k{i % 50}".encode()
        headers = [("h", str(i).encode())] if i % 3 == 0 else []
        assert got[f"value-{i}".encode()] == (key, headers), i
    # Keys land where Kafka's partitioner puts them.
    placed = read.select("key", "partition").where("key is not null").distinct().collect()
    for row in placed:
        assert row["partition"] == partition_for_key(bytes(row["key"]), 4)
    schema = {f.name: f.dataType.simpleString() for f in read.schema.fields}
    assert schema == {
        "key": "binary",
        "value": "binary",
        "topic": "string",
        "partition": "int",
        "offset": "bigint",
        "timestamp": "timestamp",
        "timestampType": "int",
        "headers": "array<struct<key:string,value:binary>>",
    }


def test_streaming_read_with_max_offsets_per_trigger_available_now(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    tidelog.Admin(gateway.address).create_topic("spark-stream", partitions=2, replication_factor=3)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch("spark-stream", [f"s{i}".encode() for i in range(1_000)]).result(60)
    stream = (
        spark.readStream.format("tidelog")
        .option("gateway", gateway.address)
        .option("subscribe", "spark-stream")
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", "300")
        .option("groupId", "spark-job")
        .load()
    )
    query = (
        stream.selectExpr("CAST(value AS STRING) AS v", "partition", "offset")
        .writeStream.format("memory")
        .queryName("streamed")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    batches = [p for p in query.recentProgress if p["numInputRows"] > 0]
    assert len(batches) >= 2
    assert all(p["numInputRows"] <= 300 for p in batches)
    values = [r["v"] for r in spark.sql("SELECT v FROM streamed").collect()]
    assert sorted(values) == sorted(f"s{i}" for i in range(1_000))
    # The committed offsets reached the consumer group: lag 0.
    described = tidelog.Admin(gateway.address).describe_group("spark-job")
    assert sum(p.committed_offset for p in described) == 1_000
    assert all(p.lag == 0 for p in described)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "subscribe"),
        ({"subscribe": "a", "assign": '{"a":[0]}'}, "exactly one"),
        ({"assign": "{not json"}, "assign"),
        (
            {"subscribe": "spark-rt", "startingOffsets": '{"spark-rt": {"0": "x"}}'},
            "startingOffsets",
        ),
        ({"subscribe": "no-such-topic"}, "no-such-topic"),
    ],
)
def test_bad_read_options_are_clear(
    spark: Any, gateway: GatewayProcess, options: dict[str, str], message: str
) -> None:
    reader = spark.read.format("tidelog").option("gateway", gateway.address)
    for name, value in options.items():
        reader = reader.option(name, value)
    with pytest.raises(Exception, match=message):
        reader.load().collect()


def test_unreachable_gateway_and_missing_topic_option(spark: Any) -> None:
    with pytest.raises(Exception, match="unreachable"):
        spark.read.format("tidelog").option("gateway", "127.0.0.1:1").option(
            "subscribe", "x"
        ).load().collect()
    df = spark.range(3).select(F.col("id").cast("string").cast("binary").alias("value"))
    with pytest.raises(Exception, match="topic"):
        df.write.format("tidelog").option("gateway", "127.0.0.1:1").mode("append").save()


def _run_copy(
    spark: Any, gateway: str, source: str, target: str, checkpoint: Path, *, guarantee: str
) -> None:
    query = (
        spark.readStream.format("tidelog")
        .option("gateway", gateway)
        .option("subscribe", source)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", "400")
        .load()
        .select("key", "value")
        .writeStream.format("tidelog")
        .option("gateway", gateway)
        .option("topic", target)
        .option("deliveryGuarantee", guarantee)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(180)
    assert query.exception() is None, query.exception()


def _forget_last_commit(checkpoint: Path) -> int:
    """What a crash between the sink's writes and the checkpoint's commit leaves: the
    last micro-batch planned (offsets log) but not committed, so a restart replays it."""
    commits = sorted(
        (checkpoint / "commits").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1
    )
    last = [p for p in commits if p.name.isdigit()][-1]
    last.unlink()
    crc = checkpoint / "commits" / f".{last.name}.crc"
    if crc.exists():
        crc.unlink()
    return int(last.name)


def _values(spark: Any, gateway: str, topic: str) -> list[bytes]:
    rows = spark.read.format("tidelog").option("gateway", gateway).option("subscribe", topic).load()
    return [bytes(r["value"]) for r in rows.select("value").collect()]


@pytest.mark.parametrize("guarantee", ["exactly-once", "at-least-once"])
def test_stream_write_replayed_after_a_failure(
    spark: Any, gateway: GatewayProcess, tmp_path: Path, guarantee: str
) -> None:
    """exactly-once: replaying the last micro-batch from the checkpoint adds nothing;
    at-least-once (the negative control) writes that micro-batch twice."""
    admin = tidelog.Admin(gateway.address)
    source, target = f"eo-in-{guarantee}", f"eo-out-{guarantee}"
    admin.create_topic(source, partitions=3, replication_factor=2)
    admin.create_topic(target, partitions=3, replication_factor=2)
    sent = [f"row-{i}".encode() for i in range(1_000)]
    keys = [None if i % 4 == 0 else f"k{i % 9}".encode() for i in range(1_000)]
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(source, sent, keys=keys).result(60)
    checkpoint = tmp_path / "checkpoint"
    _run_copy(spark, gateway.address, source, target, checkpoint, guarantee=guarantee)
    assert sorted(_values(spark, gateway.address, target)) == sorted(sent)
    _forget_last_commit(checkpoint)
    _run_copy(spark, gateway.address, source, target, checkpoint, guarantee=guarantee)
    written = _values(spark, gateway.address, target)
    if guarantee == "exactly-once":
        assert sorted(written) == sorted(sent)
    else:
        assert len(written) > len(sent)  # the replayed micro-batch landed twice
        assert set(written) == set(sent)


def test_batch_read_by_assign_timestamps_ending_offsets_and_min_partitions(
    spark: Any, gateway: GatewayProcess
) -> None:
    tidelog.Admin(gateway.address).create_topic("spark-ts", partitions=2, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        for p in range(2):
            producer.send_batch(
                "spark-ts",
                [f"old-{p}-{i}".encode() for i in range(100)],
                partition=p,
                timestamp_ms=1_000_000,
            ).result(30)
            producer.send_batch(
                "spark-ts",
                [f"new-{p}-{i}".encode() for i in range(100)],
                partition=p,
                timestamp_ms=2_000_000,
            ).result(30)

    def read(**options: str) -> Any:
        reader = spark.read.format("tidelog").option("gateway", gateway.address)
        for name, value in options.items():
            reader = reader.option(name, value)
        return reader.load()

    # Everything at or after a timestamp, on both partitions.
    recent = read(subscribe="spark-ts", startingTimestamp="1500000")
    assert sorted(bytes(r["value"]) for r in recent.collect()) == sorted(
        f"new-{p}-{i}".encode() for p in range(2) for i in range(100)
    )
    # One partition, an explicit window [50, 150), split into at least 4 Spark partitions.
    window = read(
        assign='{"spark-ts": [1]}',
        startingOffsets='{"spark-ts": {"1": 50}}',
        endingOffsets='{"spark-ts": {"1": 150}}',
        minPartitions="4",
    )
    assert window.rdd.getNumPartitions() >= 4
    rows = window.select("partition", "offset").collect()
    assert sorted(r["offset"] for r in rows) == list(range(50, 150))
    assert {r["partition"] for r in rows} == {1}
    # Per-partition timestamps: partition 0 from its start, partition 1 from "new".
    mixed = read(
        subscribe="spark-ts",
        startingOffsetsByTimestamp='{"spark-ts": {"0": 0, "1": 1500000}}',
    )
    assert mixed.where("partition = 0").count() == 200
    assert mixed.where("partition = 1").count() == 100
