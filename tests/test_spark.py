"""The tidelog data source in a real Spark ``local[2]`` session against a real cluster
(etcd, controller, 3 storage nodes, gateway as processes). One Spark session for the
module: it costs ~1 GiB and several seconds to start."""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tidelog
from tests.support.cluster import (
    GatewayProcess,
    TestCluster,
    poll_records,
    running_cluster,
    wait_for,
)
from tests.test_consumer_api import write_valid_invalid_valid
from tidelog.client import GatewayConnection
from tidelog.errors import (
    ConfigError,
    CorruptBatchError,
    NetworkError,
    OffsetOutOfRangeError,
    RequestTimedOutError,
    UnknownTopicOrPartitionError,
)
from tidelog.partitioner import partition_for_key

pyspark = pytest.importorskip("pyspark")
from pyspark.sql import functions as F  # noqa: E402, N812
from pyspark.sql.streaming.datasource import ReadAllAvailable  # noqa: E402
from pyspark.sql.types import BinaryType, StructField, StructType  # noqa: E402

from tidelog.leaders import Leader, directory_for  # noqa: E402
from tidelog.spark import activate, direct, local_session  # noqa: E402
from tidelog.spark.options import parse_read_options  # noqa: E402
from tidelog.spark.planning import OffsetRange, from_json_offsets  # noqa: E402
from tidelog.spark.reader import (  # noqa: E402
    planned_partition_state,
    read_range,
    schema_ddl,
    schema_simple_string,
)
from tidelog.spark.source import (  # noqa: E402
    RangePartition,
    TidelogBatchReader,
    TidelogStreamReader,
)
from tidelog.spark.writer import TidelogBatchWriter, TidelogStreamWriter  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    with running_cluster(tmp_path_factory.mktemp("spark-cluster")) as c:
        yield c


@pytest.fixture(scope="module")
def gateway(cluster: TestCluster) -> GatewayProcess:
    return cluster.start_gateway()


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # The JVM was started with this heap (tests/conftest.py): 1g once ran out at a
    # streaming query's start.
    session = local_session(
        "tidelog-tests", tmp_path_factory.mktemp("spark-local"), driver_memory="2g"
    )
    try:
        yield session
    finally:
        session.stop()


def test_batch_write_then_batch_read_is_identical(spark: Any, gateway: GatewayProcess) -> None:
    tidelog.Admin(gateway.address).create_topic("spark-rt", partitions=4, replication_factor=2)
    rows = 10_000
    df = _keyed_rows(spark, rows)
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
        r["value"]: (
            r["key"],
            None if r["headers"] is None else [(h["key"], h["value"]) for h in r["headers"]],
        )
        for r in read.select("key", "value", "headers").collect()
    }
    assert len(got) == rows
    for i in range(rows):
        key = None if i % 7 == 0 else f"k{i % 50}".encode()
        # No headers reads as null, as in Spark's Kafka source (not an empty array).
        headers = [("h", str(i).encode())] if i % 3 == 0 else None
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


def test_misspelt_options_are_refused_and_sparks_own_options_pass(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """A misspelt option name used to be ignored (``startingOffset`` read from the
    default offsets): it fails with the name meant. What Spark adds to the options itself
    (``path`` from load(path) / start(path), ``checkpointLocation``, ``queryName``) does
    not."""
    admin = tidelog.Admin(gateway.address)
    source, target = "spark-options-in", "spark-options-out"
    admin.create_topic(source, partitions=1, replication_factor=1)
    admin.create_topic(target, partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(source, [f"o{i}".encode() for i in range(20)]).result(30)

    def read() -> Any:  # a new reader each time: option() changes the reader it is called on
        return spark.read.format("tidelog").option("gateway", gateway.address)

    # Spark hands the names over lower-cased.
    with pytest.raises(
        Exception,
        match=r"unknown option 'startingoffset' for a tidelog read; did you mean "
        r"'startingOffsets'\?",
    ):
        read().option("subscribe", source).option(
            "startingOffset", '{"spark-options-in": {"0": 15}}'
        ).load().collect()
    values = read().option("subscribe", source).load().select("value")
    with pytest.raises(Exception, match=r"did you mean 'deliveryGuarantee'\?"):
        values.write.format("tidelog").option("gateway", gateway.address).option(
            "topic", target
        ).option("deliveryGuarantees", "at-least-once").mode("append").save()
    assert read().option("subscribe", source).load("ignored/path").count() == 20
    query = (
        spark.readStream.format("tidelog")
        .option("gateway", gateway.address)
        .option("subscribe", source)
        .option("startingOffsets", "earliest")
        .load("ignored/path")
        .select("value")
        .writeStream.format("tidelog")
        .option("gateway", gateway.address)
        .option("topic", target)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .queryName("options_copy")
        .trigger(availableNow=True)
        .start("ignored/path")
    )
    assert query.awaitTermination(120)
    assert sorted(_values(spark, gateway.address, target)) == sorted(
        f"o{i}".encode() for i in range(20)
    )


def test_a_write_to_an_unknown_topic_fails_on_the_driver(gateway: GatewayProcess) -> None:
    """The `topic` option's topic is looked up when the write is planned, so the query
    fails before any task runs, as SPARK.md says (each task failed on it, and Spark
    retried each; found by an audit)."""
    schema = StructType([StructField("value", BinaryType())])
    options = {"gateway": gateway.address, "topic": "spark-never-created"}
    with pytest.raises(UnknownTopicOrPartitionError, match="spark-never-created"):
        TidelogBatchWriter(options, schema, env_gateway=None)
    with pytest.raises(UnknownTopicOrPartitionError, match="spark-never-created"):
        TidelogStreamWriter(options, schema, env_gateway=None)


def test_unreachable_gateway_and_missing_topic_option(spark: Any) -> None:
    with pytest.raises(Exception, match="unreachable"):
        # (Retried for requestTimeoutMs first: a gateway restarting comes back.)
        spark.read.format("tidelog").option("gateway", "127.0.0.1:1").option(
            "subscribe", "x"
        ).option("requestTimeoutMs", "500").load().collect()
    df = spark.range(3).select(F.col("id").cast("string").cast("binary").alias("value"))
    with pytest.raises(Exception, match="topic"):
        df.write.format("tidelog").option("gateway", "127.0.0.1:1").mode("append").save()


def test_the_topic_option_overrides_a_topic_column(spark: Any, gateway: GatewayProcess) -> None:
    """A copy of a whole read (which always has a `topic` column) written with the
    `topic` option goes to that topic, as in Spark's Kafka sink; the column used to win,
    and the rows went back into the topic they were read from (found by an audit). The
    `partition` column is kept, as Kafka's sink keeps it."""
    admin = tidelog.Admin(gateway.address)
    source, target = "spark-override-in", "spark-override-out"
    for name in (source, target):
        admin.create_topic(name, partitions=2, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        for p in (0, 1):
            producer.send_batch(source, [f"{p}-{i}".encode() for i in range(5)], partition=p)
        producer.flush()
    read = spark.read.format("tidelog").option("gateway", gateway.address)
    read.option("subscribe", source).load().write.format("tidelog").option(
        "gateway", gateway.address
    ).option("topic", target).mode("append").save()
    copied = read.option("subscribe", target).load().collect()
    assert sorted((r["partition"], bytes(r["value"])) for r in copied) == sorted(
        (p, f"{p}-{i}".encode()) for p in (0, 1) for i in range(5)
    )
    assert read.option("subscribe", source).load().count() == 10  # nothing written back
    with pytest.raises(Exception, match="save mode 'overwrite' is not supported"):
        read.option("subscribe", source).load().write.format("tidelog").option(
            "gateway", gateway.address
        ).option("topic", target).mode("overwrite").save()
    assert read.option("subscribe", target).load().count() == 10  # it appended nothing


def _run_copy(
    spark: Any,
    gateway: str,
    source: str,
    target: str,
    checkpoint: Path,
    *,
    guarantee: str,
    direct: str = "false",
    batch_bytes: int = 1024 * 1024,
    min_partitions: int | None = None,
) -> None:
    read = (
        spark.readStream.format("tidelog")
        .option("gateway", gateway)
        .option("subscribe", source)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", "400")
        .option("direct", direct)
    )
    if min_partitions is not None:
        read = read.option("minPartitions", str(min_partitions))
    query = (
        read.load()
        .select("key", "value")
        .writeStream.format("tidelog")
        .option("gateway", gateway)
        .option("topic", target)
        .option("deliveryGuarantee", guarantee)
        .option("direct", direct)
        .option("batchBytes", str(batch_bytes))
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


@pytest.mark.parametrize(("first", "replay"), [(None, 4), (4, None)], ids=["more", "fewer"])
def test_an_exactly_once_replay_splits_as_its_first_attempt_whatever_min_partitions_says(
    spark: Any, gateway: GatewayProcess, tmp_path: Path, first: int | None, replay: int | None
) -> None:
    """A copy without a shuffle writes from the source's tasks, whose number comes from
    minPartitions, and an exactly-once write's producer ids are its task ids. Restarted
    after a crash between write and commit with another minPartitions, the replay was
    split otherwise: with more tasks every row was written a second time; with fewer,
    task 0 sent other rows under its old producer id and failed OUT_OF_ORDER_SEQUENCE on
    every attempt (found by an audit). Each end records the split it was planned with."""
    admin = tidelog.Admin(gateway.address)
    name = "more" if replay else "fewer"
    source, target = f"eo-split-in-{name}", f"eo-split-out-{name}"
    admin.create_topic(source, partitions=1, replication_factor=2)
    admin.create_topic(target, partitions=2, replication_factor=2)
    sent = [f"row-{i:04d}".encode() for i in range(1_000)]
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(source, sent).result(60)
    checkpoint = tmp_path / "checkpoint"
    for min_partitions in (first, replay):
        _run_copy(
            spark, gateway.address, source, target, checkpoint,
            guarantee="exactly-once", batch_bytes=1024, min_partitions=min_partitions,
        )  # fmt: skip
        if min_partitions == first:
            _forget_last_commit(checkpoint)  # a crash between the writes and the commit
    got = _values(spark, gateway.address, target)
    assert sorted(got) == sorted(sent), f"{len(got) - len(sent)} more rows than sent"


@pytest.mark.parametrize(
    ("guarantee", "direct"),
    [("exactly-once", "false"), ("at-least-once", "false"), ("exactly-once", "true")],
    ids=["exactly-once", "at-least-once", "exactly-once-direct"],
)
def test_stream_write_replayed_after_a_failure(
    spark: Any, gateway: GatewayProcess, tmp_path: Path, guarantee: str, direct: str
) -> None:
    """exactly-once: replaying the last micro-batch from the checkpoint adds nothing,
    through the gateway or with the query reading and writing directly (direct=true: the
    replay's appends reach the leaders with the same producer ids and sequences);
    at-least-once (the negative control) writes that micro-batch twice."""
    admin = tidelog.Admin(gateway.address)
    suffix = f"{guarantee}-direct" if direct == "true" else guarantee
    source, target = f"eo-in-{suffix}", f"eo-out-{suffix}"
    admin.create_topic(source, partitions=3, replication_factor=2)
    admin.create_topic(target, partitions=3, replication_factor=2)
    sent = [f"row-{i}".encode() for i in range(1_000)]
    keys = [None if i % 4 == 0 else f"k{i % 9}".encode() for i in range(1_000)]
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(source, sent, keys=keys).result(60)
    checkpoint = tmp_path / "checkpoint"

    def copy() -> None:
        _run_copy(
            spark, gateway.address, source, target, checkpoint, guarantee=guarantee, direct=direct
        )

    copy()
    assert sorted(_values(spark, gateway.address, target)) == sorted(sent)
    _forget_last_commit(checkpoint)
    copy()
    written = _values(spark, gateway.address, target)
    if guarantee == "exactly-once":
        assert sorted(written) == sorted(sent)
    else:
        assert len(written) > len(sent)  # the replayed micro-batch landed twice
        assert set(written) == set(sent)


def test_exactly_once_replay_of_more_batches_than_a_leader_remembers(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """A replayed micro-batch of ~70 small batches to one partition: the leader remembers
    a producer's last 5, so the replay's first ~65 are older than those. They are answered
    as written (at unknown offsets, once replicated) and nothing is written twice."""
    admin = tidelog.Admin(gateway.address)
    source, target = "eo-many-in", "eo-many-out"
    admin.create_topic(source, partitions=1, replication_factor=2)
    admin.create_topic(target, partitions=1, replication_factor=2)
    sent = [f"{i:04d}".encode() * 75 for i in range(1_000)]  # 300 bytes: 3 in a batch
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(source, sent).result(60)
    checkpoint = tmp_path / "checkpoint"

    def copy() -> None:
        _run_copy(
            spark,
            gateway.address,
            source,
            target,
            checkpoint,
            guarantee="exactly-once",
            batch_bytes=1024,
        )

    copy()
    _forget_last_commit(checkpoint)
    copy()  # the last micro-batch (200 rows, ~70 batches) again
    written = _values(spark, gateway.address, target)
    assert sorted(written) == sorted(sent)


def test_exactly_once_tasks_keep_one_producer_id_across_micro_batches(
    gateway: GatewayProcess,
) -> None:
    """A streaming task's micro-batches share its producer id, the batch id being the
    epoch, so a partition remembers one producer per task of a query instead of one per
    task of every micro-batch for a day (found unmeasured in an earlier note: ~86,000 a
    day per task at a micro-batch a second). Each micro-batch starts a new epoch at
    sequence 0 and is written; a replay of the latest is recognised as written; a
    straggler of an earlier one is fenced and writes nothing. Before, every micro-batch
    had an id of its own (epoch 0), so the straggler was written again."""
    import pyarrow as pa

    from tidelog.errors import InvalidProducerEpochError
    from tidelog.spark.options import parse_write_options
    from tidelog.spark.writer import (
        EXACTLY_ONCE_EPOCHS,
        TaskIdentity,
        _TaskWriter,
        exactly_once_producer,
    )

    first, _ = exactly_once_producer(TaskIdentity("q", 7, 0))
    assert exactly_once_producer(TaskIdentity("q", 8, 0)) == (first, 8)
    assert exactly_once_producer(TaskIdentity("q", 7, 1))[0] != first
    assert exactly_once_producer(TaskIdentity("q", 7 + EXACTLY_ONCE_EPOCHS, 0)) != (first, 7)

    topic = "eo-epochs"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=1, replication_factor=2)
    options = parse_write_options(
        {"gateway": gateway.address, "topic": topic, "deliveryGuarantee": "exactly-once"},
        streaming=True,
    )

    def rows(tag: str) -> Any:
        return pa.record_batch([pa.array([f"{tag}-{i}".encode() for i in range(50)])], ["value"])

    def write(batch_id: int, tag: str) -> None:
        _TaskWriter(options, None, identity=TaskIdentity("q", batch_id, 0)).write(iter([rows(tag)]))

    write(7, "seven")
    write(8, "eight")
    write(8, "eight")  # the replay of micro-batch 8
    with pytest.raises(InvalidProducerEpochError):
        write(7, "seven")  # a zombie task of micro-batch 7
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.assign([(topic, 0)])
        got: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(got) < 100 and time.monotonic() < deadline:
            got += [r.value for r in consumer.poll(timeout_ms=500)]
        assert not consumer.poll(timeout_ms=500)
    assert sorted(got) == sorted(
        [f"seven-{i}".encode() for i in range(50)] + [f"eight-{i}".encode() for i in range(50)]
    )


def test_batch_read_by_assign_timestamps_ending_offsets_and_min_partitions(
    spark: Any, gateway: GatewayProcess
) -> None:
    # Records of 1970 (timestamps 1,000,000 and 2,000,000 ms): kept only without time
    # retention, which would delete them all, the active segment included (Kafka's rule).
    tidelog.Admin(gateway.address).create_topic(
        "spark-ts", partitions=2, replication_factor=1, config={"retention.ms": "-1"}
    )
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
    # Every partition read needs an end, assign mode too: one left out used to end at
    # earliest and be read not at all. An end past the latest offset fails at once
    # (it used to wait 120 s for records that were not there).
    with pytest.raises(Exception, match="missing: spark-ts-0"):
        read(assign='{"spark-ts": [0, 1]}', endingOffsets='{"spark-ts": {"1": 150}}').count()
    with pytest.raises(Exception, match="ending offset 250 is past the latest offset 200"):
        read(assign='{"spark-ts": [1]}', endingOffsets='{"spark-ts": {"1": 250}}').count()
    # A start past the latest offset fails likewise (it used to be moved down to it).
    with pytest.raises(Exception, match="starting offset 250 is past the latest offset 200"):
        read(assign='{"spark-ts": [1]}', startingOffsets='{"spark-ts": {"1": 250}}').count()
    # Per-partition timestamps: partition 0 from its start, partition 1 from "new".
    mixed = read(
        subscribe="spark-ts",
        startingOffsetsByTimestamp='{"spark-ts": {"0": 0, "1": 1500000}}',
    )
    assert mixed.where("partition = 0").count() == 200
    assert mixed.where("partition = 1").count() == 100


def test_assign_refuses_starting_offsets_that_leave_out_a_partition(
    gateway: GatewayProcess,
) -> None:
    """Found by an audit: with ``assign``, startingOffsets JSON naming only some of the
    partitions was accepted and the others started at earliest, reading what a
    streaming query (default latest) meant to skip. Spark's Kafka source refuses it for
    assign as for subscribe; so does this one, batch and streaming, before any read."""
    topic = "spark-assign-partial"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=2, replication_factor=1)
    options = {
        "gateway": gateway.address,
        "assign": f'{{"{topic}": [0, 1]}}',
        "startingOffsets": f'{{"{topic}": {{"0": 0}}}}',
    }
    missing = rf"startingOffsets must give an offset for every partition read; missing: {topic}-1"
    with pytest.raises(ConfigError, match=missing):
        TidelogBatchReader(parse_read_options(options, streaming=False)).partitions()
    with pytest.raises(ConfigError, match=missing):
        TidelogStreamReader(parse_read_options(options, streaming=True)).initialOffset()


def _stream_plan(
    reader: TidelogStreamReader, start: dict[str, Any], end: dict[str, Any]
) -> list[tuple[int, int, int]]:
    """The (partition, start, end) ranges the stream reader plans for a micro-batch."""
    return [
        (p.offset_range.partition, p.offset_range.start, p.offset_range.end)
        for p in reader.partitions(start, end)
        if isinstance(p, RangePartition)
    ]


def _checkpointed(offsets: dict[str, Any]) -> dict[str, Any]:
    """``offsets`` as Spark hands them back from its offsets log: through JSON."""
    return dict(json.loads(json.dumps(offsets)))


def test_a_streams_first_micro_batch_reads_from_the_start_its_end_was_computed_from(
    gateway: GatewayProcess,
) -> None:
    """Found by an audit: the stream reader resolved startingOffsets again at every
    initialOffset() call, and Spark calls it twice for micro-batch 0: for the start
    given to latestOffset(start, limit) (constructNextBatch) and for the start given to
    partitions(start, end) (runBatch). With ``latest``, the streaming default, the second
    answer was the high watermark by then, so batch 0 was planned from past the records
    that arrived in between, and batch 1 started at batch 0's end: no micro-batch read
    them, silently, failOnDataLoss or not. Now they are resolved once per reader."""
    topic = "spark-initial-latest"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [f"old-{i}".encode() for i in range(100)]).result(30)
    options = parse_read_options({"gateway": gateway.address, "subscribe": topic}, streaming=True)
    reader = TidelogStreamReader(options)
    start = reader.initialOffset()  # constructNextBatch: the start for latestOffset
    assert from_json_offsets(start) == {(topic, 0): 100}
    # Records arrive after the query started: a 'latest' query reads them.
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [f"new-{i}".encode() for i in range(50)]).result(30)
    end = reader.latestOffset(start, ReadAllAvailable())
    assert from_json_offsets(end) == {(topic, 0): 150}
    start_again = reader.initialOffset()  # runBatch: the start for partitions
    assert start_again == start
    assert _stream_plan(reader, start_again, end) == [(0, 100, 150)]


def test_a_replayed_first_micro_batch_reads_what_its_first_attempt_planned(
    gateway: GatewayProcess,
) -> None:
    """Found by an audit: Spark checkpoints each micro-batch's end, never its start, and
    a query restarted after a crash in micro-batch 0 (planned, not committed) asks
    initialOffset() again for the start of its replay. With ``latest`` that was the high
    watermark by then: the replay planned [latest now, batch 0's end), usually nothing,
    so batch 0's records were never delivered and an exactly-once sink got other rows
    than the first attempt wrote. Batch 0's end now records its start (``$start``), and
    the replay plans from it; later ends do not carry it. Here in Spark's call order,
    the restarted query being a new reader."""
    topic = "spark-initial-replay"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=2, replication_factor=1)

    def send(tag: str, count: int) -> None:
        with tidelog.Producer(gateway.address) as producer:
            for partition in (0, 1):
                values = [f"{tag}-{i}".encode() for i in range(count)]
                producer.send_batch(topic, values, partition=partition).result(30)

    send("old", 100)
    options = parse_read_options({"gateway": gateway.address, "subscribe": topic}, streaming=True)
    first = TidelogStreamReader(options)
    start = first.initialOffset()
    send("new", 50)
    end = _checkpointed(first.latestOffset(start, ReadAllAvailable()))  # offsets log, batch 0
    planned = _stream_plan(first, first.initialOffset(), end)
    assert planned == [(0, 100, 150), (1, 100, 150)]
    # The query dies before batch 0 is committed; more records arrive; the restarted
    # query replays batch 0 from the checkpoint, its initialOffset() now 180.
    send("newer", 30)
    restarted = TidelogStreamReader(options)
    assert from_json_offsets(restarted.initialOffset()) == {(topic, 0): 180, (topic, 1): 180}
    assert _stream_plan(restarted, restarted.initialOffset(), end) == planned
    # Batch 1 goes on from batch 0's end; its end records no start (nothing grows).
    end_1 = _checkpointed(restarted.latestOffset(end, ReadAllAvailable()))
    assert "$start" not in end_1
    assert from_json_offsets(end_1) == {(topic, 0): 180, (topic, 1): 180}
    assert _stream_plan(restarted, end, end_1) == [(0, 150, 180), (1, 150, 180)]
    # A batch 0 checkpointed before its end recorded a start is replayed as it was.
    legacy = {k: v for k, v in end.items() if k != "$start"}
    assert _stream_plan(restarted, restarted.initialOffset(), legacy) == []


def _stream_once(
    spark: Any,
    gateway: str,
    topic: str,
    checkpoint: Path,
    *,
    selector: str = "subscribe",
    **options: str,
) -> list[tuple[int, int, bytes]]:
    """One ``Trigger.AvailableNow`` run of a streaming read of ``topic`` (a pattern with
    ``selector="subscribePattern"``; from earliest on a new checkpoint): the (partition,
    offset, value) rows it read. A failed query raises. (A sink that can restart from a
    checkpoint: the memory sink cannot.)"""
    reader = (
        spark.readStream.format("tidelog")
        .option("gateway", gateway)
        .option(selector, topic)
        .option("startingOffsets", "earliest")
    )
    for option, value in options.items():
        reader = reader.option(option, value)
    rows: list[tuple[int, int, bytes]] = []

    def collect(batch: Any, batch_id: int) -> None:
        rows.extend((r["partition"], r["offset"], bytes(r["value"])) for r in batch.collect())

    query = (
        reader.load()
        .select("partition", "offset", "value")
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert query.awaitTermination(120), "the query did not finish"
    finally:
        query.stop()
    return sorted(rows)


def test_stream_starting_offsets_past_the_latest_offset_fail_when_planned(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """A start past the latest offset used to be moved down to it, so the stream read the
    records from there, which it had asked to skip; now the query fails at its first
    plan, as a batch read with an end past the latest offset does."""
    topic = "spark-start-past"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [f"p{i}".encode() for i in range(100)]).result(30)
    with pytest.raises(
        Exception,
        match=r"spark-start-past-0: the starting offset 500 is past the latest offset 100",
    ):
        _stream_once(
            spark,
            gateway.address,
            topic,
            tmp_path / "checkpoint",
            startingOffsets='{"spark-start-past": {"0": 500}}',
        )


def test_a_stream_restarted_in_its_first_micro_batch_replays_the_same_records(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """Found by an audit: a query restarted after a crash in micro-batch 0 (planned, not
    committed) replayed it from wherever startingOffsets resolved by then, as Spark
    checkpoints no start and asks initialOffset() again. With ``latest`` that had moved
    on: the replay read nothing and batch 0's records were never delivered. Now batch
    0's checkpointed end records its start and the replay reads the first attempt's
    records. ``latest`` moving inside Spark's planning cannot be timed from a test, so
    the restart changes startingOffsets instead: that resolves elsewhere the same way,
    and a query with a checkpoint must not depend on it (Spark ignores it then, as its
    Kafka source does)."""
    topic = "spark-first-batch-replay"
    checkpoint = tmp_path / "checkpoint"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=1, replication_factor=1)

    def send(tag: str, offsets: range) -> list[tuple[int, int, bytes]]:
        values = [f"{tag}-{o}".encode() for o in offsets]
        with tidelog.Producer(gateway.address) as producer:
            producer.send_batch(topic, values).result(30)
        return [(0, o, v) for o, v in zip(offsets, values, strict=True)]

    first_rows = send("first", range(100))
    assert _stream_once(spark, gateway.address, topic, checkpoint) == first_rows  # batch 0
    assert _forget_last_commit(checkpoint) == 0
    later_rows = send("later", range(100, 150))
    rows = _stream_once(spark, gateway.address, topic, checkpoint, startingOffsets="latest")
    assert rows == first_rows + later_rows  # batch 0 again, then batch 1
    # Only batch 0's end records a start.
    assert '"$start"' in (checkpoint / "offsets" / "0").read_text()
    assert '"$start"' not in (checkpoint / "offsets" / "1").read_text()


def test_stream_resumed_on_a_recreated_topic_reports_data_loss(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """The topic was deleted and re-created under a stopped query. The checkpoint names
    the topic's id, so this is seen whatever the new topic's size: grown past the
    checkpoint's offset, the query used to read on from there, silently skipping every
    new record below it (Spark's Kafka source does too). With failOnDataLoss (the
    default) it fails saying data may have been lost; with failOnDataLoss=false it reads
    the new topic from its beginning (none of it was read)."""
    admin = tidelog.Admin(gateway.address)
    topic = "spark-reborn"
    checkpoint = tmp_path / "checkpoint"

    def send(values: list[bytes]) -> None:
        with tidelog.Producer(gateway.address) as producer:
            producer.send_batch(topic, values).result(30)

    def run(**options: str) -> list[tuple[int, int, bytes]]:
        return _stream_once(spark, gateway.address, topic, checkpoint, **options)

    admin.create_topic(topic, partitions=1, replication_factor=1)
    send([f"old-{i}".encode() for i in range(100)])
    assert len(run()) == 100
    admin.delete_topic(topic)
    wait_for(
        lambda: _created(admin, topic),
        30,
        "the topic created again",
    )
    send([f"new-{i}".encode() for i in range(150)])
    with pytest.raises(
        Exception,
        match=r"spark-reborn-0: some data may have been lost: the topic was deleted and "
        r"created again since the checkpoint .*set the option failOnDataLoss=false",
    ):
        run()
    assert run(failOnDataLoss="false") == [(0, i, f"new-{i}".encode()) for i in range(150)]
    # From there on the query follows the new topic.
    send([f"newer-{i}".encode() for i in range(5)])
    assert run() == [(0, 150 + i, f"newer-{i}".encode()) for i in range(5)]


def _created(admin: tidelog.Admin, topic: str) -> bool | None:
    """Create ``topic``; None while its deletion is still completing."""
    try:
        admin.create_topic(topic, partitions=1, replication_factor=1)
    except tidelog.errors.TopicAlreadyExistsError:
        return None
    return True


def test_stream_resumed_below_the_earliest_offset_reports_data_loss(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """Retention deleted records a stopped query had not read yet: the next plan fails
    saying data may have been lost (it used to plan the range and fail in a task, with
    another message); with failOnDataLoss=false the query reads on from the earliest
    offset still there."""
    admin = tidelog.Admin(gateway.address)
    topic = "spark-retained"
    checkpoint = tmp_path / "checkpoint"
    admin.create_topic(
        topic,
        partitions=1,
        replication_factor=1,
        config={"segment.bytes": "2000", "retention.bytes": "2000"},
    )
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [f"r{i}".encode() for i in range(10)]).result(30)
    assert len(_stream_once(spark, gateway.address, topic, checkpoint)) == 10
    with tidelog.Producer(gateway.address) as producer:
        for n in range(30):
            values = [f"r{i}".encode() + b"." * 50 for i in range(10 + 10 * n, 20 + 10 * n)]
            producer.send_batch(topic, values).result(30)
    connection = GatewayConnection.get(gateway.address)
    earliest = wait_for(
        lambda: (e := connection.bounds([(topic, 0)])[(topic, 0)].earliest) > 10 and e,
        30,
        "retention to delete the unread records",
    )
    with pytest.raises(
        Exception,
        match=r"spark-retained-0: some data may have been lost: offsets \[10, \d+\) were "
        r"deleted \(retention\) before they were read",
    ):
        _stream_once(spark, gateway.address, topic, checkpoint)
    rows = _stream_once(spark, gateway.address, topic, checkpoint, failOnDataLoss="false")
    first = rows[0][1]
    assert first >= earliest
    assert [offset for _, offset, _ in rows] == list(range(first, 310))
    assert all(value.startswith(f"r{offset}.".encode()) for _, offset, value in rows)


def test_a_task_whose_range_is_past_the_log_end_reports_data_loss(
    gateway: GatewayProcess,
) -> None:
    """A task can meet a log shorter than its range when the topic was re-created after
    the micro-batch was planned (or replayed from a checkpoint): data loss, failed or,
    with failOnDataLoss=false, skipped, as the planner reports it (it used to fail with
    the bare out-of-range answer)."""
    topic = "spark-short-log"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [b"x"] * 10).result(30)
    connection = GatewayConnection.get(gateway.address)

    def read(fail_on_data_loss: bool, start: int = 50, end: int = 60) -> list[Any]:
        return list(
            read_range(
                connection,
                OffsetRange(topic, 0, start, end),
                include_headers=False,
                fail_on_data_loss=fail_on_data_loss,
                fetch_max_bytes=1 << 20,
            )
        )

    with pytest.raises(
        OffsetOutOfRangeError,
        match=r"spark-short-log-0: some data may have been lost: the log now ends at offset "
        r"10, below the offsets \[50, 60\) planned for this task",
    ):
        read(fail_on_data_loss=True)
    assert read(fail_on_data_loss=False) == []
    # A range the log now ends inside (starting at or below its end) is data loss too: it
    # used to wait for offsets the log will never have and time out after 120 s.
    for start in (10, 4):
        with pytest.raises(
            OffsetOutOfRangeError,
            match=r"some data may have been lost: the log now ends at offset 10, inside the "
            rf"offsets \[{start}, 30\) planned for this task",
        ):
            read(fail_on_data_loss=True, start=start, end=30)
        read_rows = sum(b.num_rows for b in read(fail_on_data_loss=False, start=start, end=30))
        assert read_rows == 10 - start  # what exists is read, the rest skipped


def test_a_task_fails_at_an_invalid_batch_naming_it(gateway: GatewayProcess) -> None:
    """A batch whose checksums are valid but whose body is not (a hostile producer's,
    which brokers take: they check only headers and checksums) fails the task reading
    it with its topic, partition and offsets, after the valid batches before it, as
    Kafka's source fails the query; a range that ends before it or starts after it is
    read. It used to fail any range fetched with it, with "batch at position N"."""
    topic = "spark-invalid-batch"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=1, replication_factor=1)
    write_valid_invalid_valid(gateway, topic)  # 0..4 valid, 5..7 invalid, 8..11 valid
    connection = GatewayConnection.get(gateway.address)

    def offsets(start: int, end: int, got: list[int]) -> list[int]:
        for batch in read_range(
            connection,
            OffsetRange(topic, 0, start, end),
            include_headers=False,
            fail_on_data_loss=True,
            fetch_max_bytes=1 << 20,
        ):
            got += batch.column("offset").to_pylist()
        return got

    got: list[int] = []
    with pytest.raises(
        CorruptBatchError,
        match=r"topic 'spark-invalid-batch' partition 0: the record batch at offsets 5\.\.7 "
        r"is invalid \(max_timestamp .*\); the task reading offsets \[0, 12\) fails",
    ):
        offsets(0, 12, got)
    assert got == list(range(5))  # the valid batch before it came first
    assert offsets(0, 5, []) == list(range(5))
    assert offsets(8, 12, []) == list(range(8, 12))


@pytest.mark.parametrize("mode", ["gateway", "direct"])
def test_a_task_planned_before_its_topic_was_recreated_reports_data_loss(
    gateway: GatewayProcess, mode: str
) -> None:
    """A batch planned in one incarnation of a topic whose tasks run after it was deleted
    and created again: the tasks' fetches name the planned topic id, so the new topic's
    records are not read in place of the planned ones (they used to be whenever the new
    log reached the planned offsets). Data loss: failed, or skipped with
    failOnDataLoss=false. The plan is made and its tasks read by the source's own
    classes, without Spark between them, to place the re-creation there."""
    admin = tidelog.Admin(gateway.address)
    topic = f"spark-replanned-{mode}"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [f"old-{i}".encode() for i in range(20)]).result(30)

    def plan(**extra: str) -> tuple[TidelogBatchReader, list[Any]]:
        options = {"gateway": gateway.address, "subscribe": topic}
        options["direct"] = "true" if mode == "direct" else "false"
        batch = TidelogBatchReader(parse_read_options(options | extra, streaming=False))
        return batch, list(batch.partitions())

    strict, strict_tasks = plan()
    lenient, lenient_tasks = plan(failOnDataLoss="false")
    assert [t.offset_range for t in strict_tasks] == [OffsetRange(topic, 0, 0, 20)]
    admin.delete_topic(topic)
    wait_for(lambda: _created(admin, topic), 30, "the topic created again")
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [f"new-{i}".encode() for i in range(30)]).result(30)

    with pytest.raises(
        OffsetOutOfRangeError,
        match=rf"{topic}-0: some data may have been lost: the topic was deleted and created "
        r"again since this batch was planned \(topic id [0-9a-f]+\): offsets \[0, 20\) of "
        r"the topic planned were not read; set the option failOnDataLoss=false",
    ):
        list(strict.read(strict_tasks[0]))
    assert list(lenient.read(lenient_tasks[0])) == []
    # A plan made now reads the new topic.
    fresh, fresh_tasks = plan()
    rows = [row for task in fresh_tasks for b in fresh.read(task) for row in b.to_pylist()]
    assert [row["value"] for row in rows] == [f"new-{i}".encode() for i in range(30)]


@pytest.mark.parametrize("mode", ["gateway", "direct"])
def test_a_task_whose_topic_was_deleted_reports_data_loss_at_once(
    gateway: GatewayProcess, mode: str
) -> None:
    """Found by an audit: a task whose topic was deleted after its batch was planned (or
    replayed from a checkpoint after) retried UNKNOWN_TOPIC_OR_PARTITION for the whole
    request timeout (30 s), then failed the query, failOnDataLoss=false or not. Once the
    gateway's metadata no longer lists the topic, or lists another incarnation of it
    without the partition, the task reports data loss at once: failed, or skipped with
    failOnDataLoss=false."""
    admin = tidelog.Admin(gateway.address)
    topic = f"spark-deleted-{mode}"
    admin.create_topic(topic, partitions=2, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        for p in range(2):
            producer.send_batch(topic, [b"x"] * 10, partition=p).result(30)

    def plan(**extra: str) -> tuple[TidelogBatchReader, list[Any]]:
        options = {"gateway": gateway.address, "subscribe": topic, "requestTimeoutMs": "30000"}
        options["direct"] = "true" if mode == "direct" else "false"
        batch = TidelogBatchReader(parse_read_options(options | extra, streaming=False))
        return batch, list(batch.partitions())

    strict, strict_tasks = plan()
    lenient, lenient_tasks = plan(failOnDataLoss="false")
    assert [t.offset_range.partition for t in strict_tasks] == [0, 1]
    connection = GatewayConnection.get(gateway.address)
    planned_id = strict_tasks[0].topic_id
    assert planned_partition_state(connection, topic, 0, planned_id) == "listed"
    admin.delete_topic(topic)
    wait_for(
        lambda: planned_partition_state(connection, topic, 0, planned_id) == "deleted",
        30,
        "the metadata to drop the topic",
    )
    started = time.monotonic()
    with pytest.raises(
        OffsetOutOfRangeError,
        match=rf"{topic}-0: some data may have been lost: the partition no longer exists "
        r"\(topic deleted since this batch was planned\): offsets \[0, 10\) were not read; "
        r"set the option failOnDataLoss=false to go on without it$",
    ):
        list(strict.read(strict_tasks[0]))
    assert [b for task in lenient_tasks for b in lenient.read(task)] == []
    assert time.monotonic() - started < 10  # not the request timeout's 30 s per task
    # Created again with one partition: the planned partition 1 is gone with the topic
    # it was planned in (the metadata names another topic id).
    wait_for(lambda: _created(admin, topic), 30, "the topic created again")
    started = time.monotonic()
    with pytest.raises(
        OffsetOutOfRangeError,
        match=rf"{topic}-1: some data may have been lost: .*created again since this batch "
        "was planned",
    ):
        list(strict.read(strict_tasks[1]))
    assert list(lenient.read(lenient_tasks[1])) == []
    assert time.monotonic() - started < 10


def test_a_direct_fetch_retries_a_broker_that_does_not_know_the_partition(
    gateway: GatewayProcess,
) -> None:
    """A broker's UNKNOWN_TOPIC_OR_PARTITION is not taken for a deleted topic while the
    gateway's metadata still lists it: a leader that has not heard of its new role yet
    answers it too. A task told to fetch from a broker that does not host its partition
    (a stale leader hint) finds the real leader and reads the whole range."""
    admin = tidelog.Admin(gateway.address)
    topic = "spark-direct-stale-hint"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    values = [f"v{i}".encode() for i in range(20)]
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, values).result(30)
    connection = GatewayConnection.get(gateway.address)
    directory = directory_for(connection)
    leader = direct.leader_hints(connection, [(topic, 0)])[(topic, 0)]
    assert leader is not None
    other = next(
        broker_id
        for broker_id in (1, 2, 3)
        if broker_id != leader.broker_id and directory.address(broker_id)
    )
    stale = Leader(other, leader.leader_epoch, directory.address(other) or "")
    topic_id = directory.topic_id(topic)
    fetcher = direct.PartitionFetcher(connection, (topic, 0), stale, 30_000, topic_id)
    batches = read_range(
        connection,
        OffsetRange(topic, 0, 0, 20),
        include_headers=False,
        fail_on_data_loss=True,
        fetch_max_bytes=1 << 20,
        fetch=fetcher.fetch,
        topic_id=topic_id,
    )
    assert [v for b in batches for v in b.column("value").to_pylist()] == values


def test_a_stream_replayed_after_its_topic_was_deleted_reports_data_loss(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """Found by an audit: a subscribePattern query restarted from its checkpoint after
    one of its topics was deleted replays its last micro-batch (not committed before the
    crash), whose task met the deleted topic and failed the query after 30 s, even with
    failOnDataLoss=false. Now the replay fails at once saying data may have been lost,
    or with failOnDataLoss=false reads the other topic's records and goes on."""
    admin = tidelog.Admin(gateway.address)
    checkpoint = tmp_path / "checkpoint"
    for topic in ("spark-replay-keep", "spark-replay-gone"):
        admin.create_topic(topic, partitions=1, replication_factor=1)
        with tidelog.Producer(gateway.address) as producer:
            producer.send_batch(topic, [f"{topic}-{i}".encode() for i in range(5)]).result(30)

    def run(**options: str) -> list[bytes]:
        rows = _stream_once(
            spark,
            gateway.address,
            "spark-replay-(keep|gone)",
            checkpoint,
            selector="subscribePattern",
            **options,
        )
        return sorted(value for _, _, value in rows)

    assert len(run()) == 10
    _forget_last_commit(checkpoint)
    admin.delete_topic("spark-replay-gone")
    with pytest.raises(
        Exception, match=r"spark-replay-gone-0: some data may have been lost: the partition "
    ):
        run()
    started = time.monotonic()
    assert run(failOnDataLoss="false") == [f"spark-replay-keep-{i}".encode() for i in range(5)]
    assert time.monotonic() - started < 30  # the request timeout the task used to wait


def test_default_batch_bytes_make_batches_the_broker_accepts(
    spark: Any, gateway: GatewayProcess
) -> None:
    """With the default batchBytes (1 MiB, as Kafka's max.message.bytes), batches of small
    rows with keys and headers stay under the topic's max.message.bytes: the writer counts
    each record's framing and headers, not only the value and key bytes."""
    topic = "spark-default-batches"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=1, replication_factor=1)
    rows = 40_000
    df = (
        spark.range(rows)
        .repartition(1)
        .select(
            F.col("id").cast("string").cast("binary").alias("key"),
            F.concat(F.lit("v" * 180), F.col("id").cast("string")).cast("binary").alias("value"),
            F.array(
                F.struct(F.lit("h").alias("key"), F.lit(b"x").cast("binary").alias("value"))
            ).alias("headers"),
            F.lit(0).cast("int").alias("partition"),
        )
    )
    df.write.format("tidelog").option("gateway", gateway.address).option("topic", topic).mode(
        "append"
    ).save()
    read = spark.read.format("tidelog").option("gateway", gateway.address)
    assert read.option("subscribe", topic).load().count() == rows


def test_the_format_is_found_from_another_thread_once_activated_there(
    spark: Any, gateway: GatewayProcess
) -> None:
    """Spark finds a session's Python data source through the calling thread's active
    session: from a new Python thread the format is unknown until ``activate``."""
    topic = "spark-threads"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=1, replication_factor=1)
    df = spark.range(100).selectExpr("cast(cast(id as string) as binary) as value")
    outcomes: list[str] = []

    def write(activated: bool) -> None:
        try:
            if activated:
                activate(spark)
            df.write.format("tidelog").option("gateway", gateway.address).option(
                "topic", topic
            ).mode("append").save()
            outcomes.append("written")
        except Exception as exc:
            outcomes.append(
                "DATA_SOURCE_NOT_FOUND" if "DATA_SOURCE_NOT_FOUND" in str(exc) else repr(exc)
            )

    for activated in (False, True):
        thread = threading.Thread(target=write, args=(activated,))
        thread.start()
        thread.join(120)
    assert outcomes == ["DATA_SOURCE_NOT_FOUND", "written"]
    read = spark.read.format("tidelog").option("gateway", gateway.address)
    assert read.option("subscribe", topic).load().count() == 100


def test_reading_an_empty_topic_gives_no_rows(spark: Any, gateway: GatewayProcess) -> None:
    """A batch read with nothing to read plans no ranges; Spark still runs one task (with
    a stand-in partition), which must give no rows rather than fail."""
    topic = "spark-empty"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=2, replication_factor=1)
    read = spark.read.format("tidelog").option("gateway", gateway.address)
    assert read.option("subscribe", topic).load().count() == 0


def test_the_format_is_found_without_registering(spark: Any, gateway: GatewayProcess) -> None:
    """Spark 4 registers the ``DefaultSource`` of each top-level ``pyspark_*`` package on
    its Python path (``pyspark_tidelog``): a session in which nobody called
    ``tidelog.spark.register`` (a new one) writes and reads the format."""
    topic = "spark-static"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=1, replication_factor=1)
    fresh = spark.newSession()
    df = fresh.range(50).selectExpr("cast(cast(id as string) as binary) as value")
    df.write.format("tidelog").option("gateway", gateway.address).option("topic", topic).mode(
        "append"
    ).save()
    read = fresh.read.format("tidelog").option("gateway", gateway.address)
    assert read.option("subscribe", topic).load().count() == 50


# --- direct=true: tasks fetch from and append to the partition leaders -----------------------


def _keyed_rows(spark: Any, rows: int) -> Any:
    """Rows with keys (some null) and headers (some), as the round-trip test above."""
    return spark.range(rows).select(
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


def _planned(df: Any) -> Any:
    """``df`` with its plan made now, down to its RDD: the source's ``partitions()`` ran
    (on the driver, asking the gateway), and an action on ``df`` later only runs the
    tasks."""
    df._jdf.queryExecution().toRdd()
    return df


def test_direct_write_and_read_bypass_the_gateway(spark: Any, cluster: TestCluster) -> None:
    """direct=true moves the data path off the gateway, observably:

    - writes: this gateway refuses produce requests over 64 KiB, so the same write through
      it fails (and writes nothing), while the direct write's appends go to the leaders;
    - reads: with the gateway stopped (SIGSTOP) once the read is planned, so that it
      answers no fetch, the direct read's tasks still fetch every record from the
      leaders the plan named.
    Every record comes back with its key, value, headers and Kafka partition."""
    gateway = cluster.start_gateway(["--max-request-bytes", str(64 * 1024)])
    topic, rows = "spark-direct", 10_000
    tidelog.Admin(gateway.address).create_topic(topic, partitions=3, replication_factor=2)
    df = _keyed_rows(spark, rows)

    def write(direct: str) -> None:
        df.write.format("tidelog").option("gateway", gateway.address).option("topic", topic).option(
            "direct", direct
        ).mode("append").save()

    with pytest.raises(Exception, match="RECORD_LIST_TOO_LARGE"):
        write("false")
    bounds = tidelog.Admin(gateway.address).describe_topic(topic).partitions
    assert all(p.high_watermark == 0 for p in bounds), bounds
    write("TRUE")

    direct_read = _planned(
        spark.read.format("tidelog")
        .option("gateway", gateway.address)
        .option("subscribe", topic)
        .option("includeHeaders", "true")
        .option("direct", "true")
        .load()
        .select("key", "value", "headers", "partition")
    )
    os.kill(gateway.pid, signal.SIGSTOP)
    try:
        # The control: the stopped gateway answers no fetch (a channel of its own, so no
        # executor's connection is involved).
        with pytest.raises((RequestTimedOutError, NetworkError)):
            GatewayConnection(gateway.address, timeout_ms=500).fetch(topic, 0, 0, 1024, 0)
        collected = direct_read.collect()
    finally:
        os.kill(gateway.pid, signal.SIGCONT)
    cluster.kill(gateway)
    got = {
        bytes(r["value"]): (
            r["key"],
            [(h["key"], h["value"]) for h in (r["headers"] or [])],
            r["partition"],
        )
        for r in collected
    }
    assert len(collected) == len(got) == rows
    for i in range(rows):
        key = None if i % 7 == 0 else f"k{i % 50}".encode()
        headers = [("h", str(i).encode())] if i % 3 == 0 else []
        key_got, headers_got, partition = got[f"value-{i}".encode()]
        assert (key_got, headers_got) == (key, headers), i
        if key is not None:
            assert partition == partition_for_key(key, 3), i


def _leader(admin: tidelog.Admin, topic: str, partition: int) -> int:
    return admin.describe_topic(topic).partitions[partition].leader


def _restart(cluster: TestCluster, admin: tidelog.Admin, broker_id: int, topic: str) -> None:
    """Bring a killed broker back and wait until it follows ``topic`` again, so the tests
    after this one find the cluster whole."""
    cluster.start_broker(broker_id)
    wait_for(
        lambda: all(len(p.isr) == 3 for p in admin.describe_topic(topic).partitions),
        60,
        f"broker {broker_id} to rejoin the ISR of {topic}",
    )


def test_direct_read_rides_through_a_leader_kill(
    spark: Any, cluster: TestCluster, gateway: GatewayProcess
) -> None:
    """The read is planned while a partition's leader lives (its tasks are told to fetch
    from it), then that leader is killed with SIGKILL: the task finds the new leader
    through the gateway and reads every record."""
    admin = tidelog.Admin(gateway.address)
    topic = "spark-direct-read-kill"
    admin.create_topic(
        topic, partitions=2, replication_factor=3, config={"min.insync.replicas": "2"}
    )
    sent = {p: [f"{p}-{i}".encode() for i in range(5_000)] for p in range(2)}
    with tidelog.Producer(gateway.address) as producer:
        for p, values in sent.items():
            producer.send_batch(topic, values, partition=p).result(60)
    df = _planned(
        spark.read.format("tidelog")
        .option("gateway", gateway.address)
        .option("subscribe", topic)
        .option("direct", "true")
        .load()
        .select("partition", "offset", "value")
    )
    victim = _leader(admin, topic, 0)
    cluster.kill(cluster.brokers[victim])
    rows = df.collect()
    assert _leader(admin, topic, 0) != victim
    got = sorted((r["partition"], r["offset"], bytes(r["value"])) for r in rows)
    assert got == [(p, i, v) for p in range(2) for i, v in enumerate(sent[p])]
    _restart(cluster, admin, victim, topic)


def test_a_task_reading_through_the_gateway_rides_through_a_leader_kill(
    cluster: TestCluster, gateway: GatewayProcess
) -> None:
    """Found by an audit: a task reading through the gateway (direct=false, the default)
    failed on the first fetch after its leader died, and so did the query (Spark's task
    retries came before a new leader was elected). Its fetches are now retried for up to
    the request timeout, as direct mode's are; the range is read whole."""
    admin = tidelog.Admin(gateway.address)
    topic = "spark-gateway-read-kill"
    admin.create_topic(
        topic, partitions=1, replication_factor=3, config={"min.insync.replicas": "2"}
    )
    sent = [b"%04d" % i * 25 for i in range(2_000)]
    with tidelog.Producer(gateway.address) as producer:
        for start in range(0, 2_000, 100):  # 20 batches of 10 KB: a fetch each
            producer.send_batch(topic, sent[start : start + 100], partition=0).result(60)
    batches = read_range(
        GatewayConnection.get(gateway.address),
        OffsetRange(topic, 0, 0, 2_000),
        include_headers=False,
        fail_on_data_loss=True,
        fetch_max_bytes=1024,  # a fetch per batch or so: many after the kill
    )
    values = next(batches).column("value").to_pylist()
    victim = _leader(admin, topic, 0)
    cluster.kill(cluster.brokers[victim])
    for batch in batches:
        values += batch.column("value").to_pylist()
    assert values == sent
    _restart(cluster, admin, victim, topic)


def test_direct_write_rides_through_a_leader_kill(
    spark: Any, cluster: TestCluster, gateway: GatewayProcess
) -> None:
    """SIGKILL the leader of the partition a direct batch write is appending to, once
    some of it is acknowledged and before all of it is: the tasks append to the new
    leader and the job completes; every row is there (at-least-once: an append whose
    answer died with the leader may be there twice)."""
    admin = tidelog.Admin(gateway.address)
    topic, rows = "spark-direct-write-kill", 150_000
    admin.create_topic(
        topic, partitions=1, replication_factor=3, config={"min.insync.replicas": "2"}
    )
    victim = _leader(admin, topic, 0)
    df = spark.range(rows).select(
        F.col("id").cast("string").cast("binary").alias("key"),
        F.concat(F.col("id").cast("string"), F.lit("-"), F.lit("v" * 200))
        .cast("binary")
        .alias("value"),
        F.lit(0).cast("int").alias("partition"),
    )
    connection = GatewayConnection.get(gateway.address)
    killed_at: list[int] = []  # the high watermark when the leader was killed
    written = threading.Event()

    def kill_once_writing() -> None:
        """On a thread of its own: the write runs on the test's thread (a data source
        registered in the session is not found from another Python thread before
        ``tidelog.spark.activate``)."""
        while not written.is_set():
            high_watermark = connection.bounds([(topic, 0)])[(topic, 0)].latest
            if high_watermark > 0:
                cluster.kill(cluster.brokers[victim])
                killed_at.append(high_watermark)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_once_writing)
    killer.start()
    try:
        (
            df.write.format("tidelog")
            .option("gateway", gateway.address)
            .option("topic", topic)
            .option("direct", "true")
            .option("batchBytes", str(256 * 1024))
            .mode("append")
            .save()
        )
    finally:
        written.set()
        killer.join(30)
    assert killed_at, "the leader was not killed"
    assert killed_at[0] < rows, "the write was complete before the leader was killed"
    assert _leader(admin, topic, 0) != victim
    read = (
        spark.read.format("tidelog")
        .option("gateway", gateway.address)
        .option("subscribe", topic)
        .load()
    )
    keys = [bytes(r["key"]) for r in read.select("key").collect()]
    assert len(keys) >= rows
    assert set(keys) == {str(i).encode() for i in range(rows)}
    wrong = read.where(
        F.col("value")
        != F.concat(F.col("key").cast("string"), F.lit("-" + "v" * 200)).cast("binary")
    )
    assert wrong.count() == 0
    _restart(cluster, admin, victim, topic)


def test_a_direct_write_with_the_smallest_request_timeout_sends(gateway: GatewayProcess) -> None:
    """requestTimeoutMs accepts 100, the margin a direct append leaves the leader to
    answer its own timeout: the first attempt found no time left past the margin, and
    every task failed REQUEST_TIMED_OUT with nothing sent (through the gateway the same
    options wrote). The first attempt now always goes. Found by an audit."""
    import pyarrow as pa

    from tidelog.spark.options import parse_write_options
    from tidelog.spark.writer import _TaskWriter

    topic = "direct-short-timeout"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=1, replication_factor=1)
    options = parse_write_options(
        {
            "gateway": gateway.address,
            "topic": topic,
            "direct": "true",
            "requestTimeoutMs": "100",
            "acks": "1",
        },
        streaming=False,
    )
    _TaskWriter(options, sticky_seed=1).write(
        iter([pa.record_batch([pa.array([b"a", b"b"])], ["value"])])
    )
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.assign([(topic, 0)])
        assert [value for _, value in poll_records(consumer, 2)] == [b"a", b"b"]


def test_with_the_topic_option_a_topic_column_of_any_type_is_ignored() -> None:
    """Spark's Kafka sink takes the ``topic`` option as the topic and never reads a
    ``topic`` column then; tidelog refused a non-string one (found by an audit)."""
    from pyspark.sql.types import LongType

    from tidelog.spark.options import parse_write_options
    from tidelog.spark.writer import check_schema

    schema = StructType([StructField("value", BinaryType()), StructField("topic", LongType())])
    check_schema(schema, parse_write_options({"topic": "t"}, streaming=False))
    with pytest.raises(ConfigError, match="column 'topic' must be a string"):
        check_schema(schema, parse_write_options({}, streaming=False))


def test_a_pattern_query_polling_while_one_of_its_topics_is_deleted_goes_on(
    gateway: GatewayProcess,
) -> None:
    """With subscribePattern a deleted topic is data loss, and failOnDataLoss=false goes
    on without it (docs/SPARK.md). The driver's latestOffset and reportLatestOffset, which
    Spark calls every few ms while a query idles, listed the partitions, then asked for
    their bounds: a deletion in between was asked for until the request timeout and
    failed the query. The partitions are listed again now. Found by an audit."""
    admin = tidelog.Admin(gateway.address)
    for topic in ("pdel-keep", "pdel-gone"):
        admin.create_topic(topic, partitions=2, replication_factor=1)
    options = parse_read_options(
        {
            "gateway": gateway.address,
            "subscribepattern": "pdel-.*",
            "startingoffsets": "earliest",
            "failondataloss": "false",
            "requesttimeoutms": "2000",
        },
        streaming=True,
    )
    source = TidelogStreamReader(options)
    start: dict[str, Any] = source.latestOffset(source.initialOffset(), ReadAllAvailable())
    errors: list[BaseException] = []
    stop = threading.Event()

    def poll() -> None:
        nonlocal start
        while not stop.is_set():
            try:
                start = source.latestOffset(start, ReadAllAvailable())
                source.reportLatestOffset()
            except Exception as exc:  # what failed the query, whatever it is
                errors.append(exc)
                return

    polling = threading.Thread(target=poll)
    polling.start()
    try:
        for _ in range(3):
            admin.delete_topic("pdel-gone")
            time.sleep(2.5)  # past the 2 s request timeout
            if errors:
                break
            admin.create_topic("pdel-gone", partitions=2, replication_factor=1)
            time.sleep(0.3)
    finally:
        stop.set()
        polling.join(30)
    assert not errors, repr(errors[0])


# --- riding through failures that pass (found by an audit) -----------------------------------


def _count_rows(spark: Any, sql: str) -> int:
    return int(spark.sql(sql).collect()[0][0])


def _wait_rows(spark: Any, query: Any, sql: str, want: int, timeout_s: float) -> int:
    """What ``sql`` counts once it reaches ``want``, the query died or time ran out."""
    deadline = time.monotonic() + timeout_s
    n = 0
    while time.monotonic() < deadline and query.isActive:
        n = _count_rows(spark, sql)
        if n >= want:
            return n
        time.sleep(0.5)
    return n


def test_a_streaming_query_rides_through_its_gateway_restarting(
    spark: Any, cluster: TestCluster, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """The gateway a query plans through restarts on its port (a rolling upgrade): the
    driver's planning calls (metadata, bounds, group commits) did not retry at all, and
    the query died at its next trigger with NETWORK_EXCEPTION. Spark's Kafka source rides
    through a broker bounce; planning calls retry within requestTimeoutMs now."""
    topic = "spark-gateway-restart"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=1, replication_factor=1)
    own = cluster.start_gateway()
    port = own.address.rsplit(":", 1)[1]
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [f"a{i}".encode() for i in range(10)]).result(30)
    query = (
        spark.readStream.format("tidelog")
        .option("gateway", own.address)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("groupId", "spark-gateway-restart")
        .load()
        .selectExpr("offset")
        .writeStream.format("memory")
        .queryName("gateway_restart")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    replacement = None
    try:
        query.processAllAvailable()
        own.terminate()
        replacement = cluster.start_gateway(extra_args=["--listen", f"127.0.0.1:{port}"])
        with tidelog.Producer(gateway.address) as producer:
            producer.send_batch(topic, [f"b{i}".encode() for i in range(10)]).result(30)
        n = _wait_rows(spark, query, "select count(*) from gateway_restart", 20, 60)
        assert query.exception() is None, str(query.exception())[-700:]
        assert n == 20
    finally:
        query.stop()
        if replacement is not None:
            replacement.terminate()


def test_a_write_rides_through_a_short_gateway_outage(
    spark: Any, cluster: TestCluster, gateway: GatewayProcess
) -> None:
    """A write task did not retry a retriable failure (the gateway unreachable here;
    NOT_ENOUGH_REPLICAS or REQUEST_TIMED_OUT alike): the job failed though the gateway
    was back 5 s later, well within requestTimeoutMs. Its requests are sent again now,
    as Kafka's producer retries within its delivery timeout."""
    topic = "spark-gateway-outage"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=1, replication_factor=1)
    own = cluster.start_gateway()
    port = own.address.rsplit(":", 1)[1]
    rows = spark.range(10).select(
        F.lit(topic).alias("topic"), F.col("id").cast("string").cast("binary").alias("value")
    )
    own.terminate()
    replacement: list[GatewayProcess] = []

    def restart() -> None:
        time.sleep(5.0)  # a Python worker takes a second or two to start its task
        replacement.append(cluster.start_gateway(extra_args=["--listen", f"127.0.0.1:{port}"]))

    restarting = threading.Thread(target=restart)
    restarting.start()
    try:
        rows.write.format("tidelog").option("gateway", own.address).option(
            "requestTimeoutMs", "20000"
        ).mode("append").save()
    finally:
        restarting.join(60)
        for process in replacement:
            process.terminate()
    assert sorted(_values(spark, gateway.address, topic)) == sorted(
        str(i).encode() for i in range(10)
    )


def test_a_pattern_query_with_a_group_id_reads_on_past_a_deleted_topic(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """With subscribePattern and failOnDataLoss=false a deleted topic is skipped, but with
    a groupId the query died: Spark commits the previous micro-batch's end, which still
    names the deleted topic, and the gateway's refusal of that commit was raised. Such
    partitions are left out of the group's commit now, with a warning."""
    admin = tidelog.Admin(gateway.address)
    keep, gone = "spark-gdel-keep", "spark-gdel-gone"
    for topic in (keep, gone):
        admin.create_topic(topic, partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        for topic in (keep, gone):
            producer.send_batch(topic, [f"{topic}-{i}".encode() for i in range(5)]).result(30)
    query = (
        spark.readStream.format("tidelog")
        .option("gateway", gateway.address)
        .option("subscribePattern", "spark-gdel-.*")
        .option("startingOffsets", "earliest")
        .option("failOnDataLoss", "false")
        .option("groupId", "spark-gdel")
        .load()
        .selectExpr("topic", "offset")
        .writeStream.format("memory")
        .queryName("gdel")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        query.processAllAvailable()
        admin.delete_topic(gone)
        time.sleep(2)
        with tidelog.Producer(gateway.address) as producer:
            producer.send_batch(keep, [f"more-{i}".encode() for i in range(5)]).result(30)
        sql = f"select count(*) from gdel where topic = '{keep}'"
        n = _wait_rows(spark, query, sql, 10, 30)
        time.sleep(1)
        assert query.exception() is None, str(query.exception())[-700:]
        assert n == 10
    finally:
        query.stop()


def test_batches_to_a_topic_with_a_smaller_max_message_bytes_are_cut_to_fit(
    spark: Any, gateway: GatewayProcess
) -> None:
    """Rows of 100 bytes to topics whose max.message.bytes is 64 KiB (named by the `topic`
    column, and by the option with a larger batchBytes): batches were cut at batchBytes
    whatever the topic took, and the write failed with MESSAGE_TOO_LARGE (the option's
    case was refused on the driver). They are cut at the topic's limit now, as a Kafka
    producer's batches never outgrow it."""
    admin = tidelog.Admin(gateway.address)
    for topic in ("spark-small-limit-column", "spark-small-limit-option"):
        admin.create_topic(topic, 1, 1, config={"max.message.bytes": "65536"})
    rows = spark.range(2000).select(
        F.lit("spark-small-limit-column").alias("topic"),
        F.expr("cast(repeat('x', 100) as binary)").alias("value"),
    )
    rows.coalesce(1).write.format("tidelog").option("gateway", gateway.address).mode(
        "append"
    ).save()
    rows.coalesce(1).write.format("tidelog").option("gateway", gateway.address).option(
        "topic", "spark-small-limit-option"
    ).option("batchBytes", "200000").mode("append").save()
    for topic in ("spark-small-limit-column", "spark-small-limit-option"):
        assert len(_values(spark, gateway.address, topic)) == 2000


def test_the_example_stamps_its_lines_in_utc_whatever_the_sessions_time_zone(
    spark: Any, gateway: GatewayProcess
) -> None:
    """The example's lines said "+0000" but carried the session's (the machine's) wall
    time, and the stats job printed minutes shifted twice by the zone's offset: `make run`
    off UTC printed the wrong day."""
    from examples.nginx_pipeline import generator

    topic = "spark-nginx-tz"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=1, replication_factor=1)
    before = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        generator.generate(spark, gateway.address, topic, lines=10)
    finally:
        spark.conf.set("spark.sql.session.timeZone", before)
    lines = [v.decode() for v in _values(spark, gateway.address, topic)]
    # Line 0 is at START_EPOCH_S: 2026-11-23 00:00:00 UTC.
    assert any("[23/Nov/2026:00:00:00 +0000]" in line for line in lines), sorted(lines)[:2]


def test_a_read_with_a_user_schema_is_refused_before_any_task_runs(
    spark: Any, gateway: GatewayProcess
) -> None:
    """Spark's Kafka source has a fixed schema and refuses a user-specified one at load().
    tidelog's reader ignored the schema Spark handed it: a read of an empty topic with
    .schema(...) answered no rows in the user's schema instead of an error, and with data
    every task failed on Spark's generic DATA_SOURCE_RETURN_SCHEMA_MISMATCH (found by an
    audit). The source's own schema, as Spark parses its DDL, passes the same check."""
    for include in (False, True):
        parsed = spark.createDataFrame([], schema_ddl(include)).schema
        assert parsed.simpleString() == schema_simple_string(include)
    topic = "user-schema"
    tidelog.Admin(gateway.address).create_topic(topic, partitions=1, replication_factor=1)
    df = (
        spark.read.format("tidelog")
        .schema("value string, offset long")
        .option("gateway", gateway.address)
        .option("subscribe", topic)
        .load()
    )
    with pytest.raises(Exception, match="fixed schema and takes no"):
        df.collect()


# --- the example pipeline (examples/nginx_pipeline, what `make run` runs) ----------------

_GOOD_LINE = (
    '10.0.3.7 - - [23/Nov/2026:00:00:03 +0000] "GET /api/cart HTTP/1.1" 200 5120 "-" '
    '"curl/8.5" rt=0.043 svc=checkout'
)


def _pipeline_topics(gateway: GatewayProcess, name: str) -> dict[str, str]:
    """Topics and a group of the pipeline's own for one test (the cluster is shared)."""
    admin = tidelog.Admin(gateway.address)
    names = {"source": f"{name}-lines", "target": f"{name}-stats", "group": f"{name}-job"}
    admin.create_topic(names["source"], partitions=4, replication_factor=1)
    admin.create_topic(names["target"], partitions=2, replication_factor=1)
    return names


def test_the_pipeline_on_an_empty_topic_ends_well(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """`--lines 0` or nothing new: no stats, status 0. The report's table crashed on
    no rows with a TypeError traceback (found by an audit)."""
    from examples.nginx_pipeline import job

    topics = _pipeline_topics(gateway, "pipeline-empty")
    status = job.run_pipeline(
        spark, gateway.address, lines=0, checkpoint=tmp_path / "checkpoint", max_offsets=700,
        **topics,
    )  # fmt: skip
    assert status == 0


def test_a_line_the_casts_refuse_does_not_stop_the_stream_job_for_good(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """A line matching the expression with a value Spark's ANSI casts refuse (rt=1.2.3,
    a 31st of November) failed its micro-batch, and every restart replayed it from the
    checkpoint: the job could never pass it (found by an audit). Such lines are dropped
    as unmatched ones are."""
    from examples.nginx_pipeline import report, stream_job

    topics = _pipeline_topics(gateway, "pipeline-poison")
    with tidelog.Producer(gateway.address) as producer:
        for line in (
            _GOOD_LINE,
            _GOOD_LINE.replace("rt=0.043", "rt=1.2.3"),
            _GOOD_LINE.replace("23/Nov", "31/Nov"),
            _GOOD_LINE,
        ):
            producer.send(topics["source"], line.encode(), partition=0)
        producer.flush()
    stream_job.run(
        spark, gateway.address, topics["source"], topics["target"],
        checkpoint=tmp_path / "checkpoint", max_offsets=500, group=topics["group"],
    )  # fmt: skip
    stats = report.latest_stats(spark, gateway.address, topics["target"])
    assert [s["requests"] for s in stats] == [2]


def test_the_pipeline_checks_out_with_another_writer_on_its_topic(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """Another producer appending to the source topic while the job runs: the stats were
    right, but the job's check expected only its own lines and exited 1 (found by an
    audit; on Kubernetes the Job would be retried, writing its lines again)."""
    from examples.nginx_pipeline import job

    topics = _pipeline_topics(gateway, "pipeline-shared")
    stop = threading.Event()

    def produce() -> None:
        with tidelog.Producer(gateway.address) as producer:
            while not stop.is_set():
                producer.send(topics["source"], _GOOD_LINE.encode()).result(30)
                time.sleep(0.02)

    writer = threading.Thread(target=produce, daemon=True)
    writer.start()
    try:
        status = job.run_pipeline(
            spark, gateway.address, lines=1000, checkpoint=tmp_path / "checkpoint",
            max_offsets=700, **topics,
        )  # fmt: skip
    finally:
        stop.set()
        writer.join(30)
    assert status == 0


def test_the_report_is_right_after_partitions_were_added_to_the_stats_topic(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """The report took a key's value at the highest offset; partitions added to the
    stats topic move keys to partitions where their new values sit at lower offsets, and
    the report showed the old ones (found by an audit)."""
    from examples.nginx_pipeline import job

    topics = _pipeline_topics(gateway, "pipeline-grown")
    checkpoint = tmp_path / "checkpoint"
    run = functools.partial(
        job.run_pipeline, spark, gateway.address, lines=1200, checkpoint=checkpoint,
        max_offsets=700, **topics,
    )  # fmt: skip
    assert run() == 0
    tidelog.Admin(gateway.address).create_partitions(topics["target"], 9)
    assert run() == 0
