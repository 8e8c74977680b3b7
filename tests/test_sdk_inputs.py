"""What the SDK accepts, writes through a real cluster, and reads back: the edges of the
codec as users reach them (buffers, memoryviews, Arrow view types, timestamps, headers).
Each test failed on the code an audit found its bug in (the docstring says how)."""

from __future__ import annotations

import array
import json
import subprocess
import sys

import pytest

import tidelog
import tidelog.errors
from tests.support.cluster import GatewayProcess
from tests.support.process import REPO_ROOT, tidelog_env
from tidelog.client import GatewayConnection

pa = pytest.importorskip("pyarrow")


def _consume(gateway: GatewayProcess, topic: str, count: int) -> list[tidelog.ConsumerRecord]:
    got: list[tidelog.ConsumerRecord] = []
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.assign([(topic, 0)])
        for _ in range(100):
            got += consumer.poll(timeout_ms=200)
            if len(got) >= count:
                break
    return got


def test_a_header_of_any_buffer_send_accepts_is_written_as_its_bytes(
    admin: tidelog.Admin, gateway: GatewayProcess
) -> None:
    """``check_headers`` (which ``send`` calls so that a bad header is refused at the call)
    took any memoryview as a header value, but the encoder refused one whose items are
    wider than a byte (``len`` is not its byte count): the record was queued, and when
    the sender encoded its batch the whole batch failed with ConfigError, a correct
    record another call sent before it too (found by an audit). Header values are now
    copied to bytes at the call, as values and keys are: the buffer's bytes are written."""
    topic = "sdk-inputs-header-mv"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    wide = memoryview(array.array("i", [1, 2]))  # 2 items, 8 bytes
    with tidelog.Producer(gateway.address, linger_ms=300) as producer:
        good = producer.send(topic, b"innocent", partition=0)
        odd = producer.send(topic, b"v", partition=0, headers=[("h", wide)])
        assert good.result(30).offset + 1 == odd.result(30).offset
    read = _consume(gateway, topic, 2)
    assert [(r.value, r.headers) for r in read] == [
        (b"innocent", ()),
        (b"v", (("h", wide.tobytes()),)),
    ]


def test_spark_read_of_a_large_timestamp_is_not_silently_wrapped(
    admin: tidelog.Admin, gateway: GatewayProcess
) -> None:
    """The producer accepts any non-negative int64 timestamp (Kafka's rule) and a consumer
    reads it back, but the Spark reader turns milliseconds into microseconds with an
    unchecked Arrow multiply (``_to_source_schema``): 2**62 ms wrapped to a wrong
    microsecond count with no error (found by an audit). Kafka's Spark source converts
    with Math.multiplyExact and fails the task instead of reading a wrong timestamp."""
    pytest.importorskip("pyspark")
    from tidelog.spark.planning import OffsetRange
    from tidelog.spark.reader import read_range

    topic = "sdk-inputs-big-ts"
    # Kafka's default before 4.0 (Long.MAX_VALUE): future timestamps are taken.
    admin.create_topic(
        topic,
        partitions=1,
        replication_factor=1,
        config={"message.timestamp.after.max.ms": str(2**63 - 1)},
    )
    stamp = 2**62
    with tidelog.Producer(gateway.address) as producer:
        producer.send(topic, b"far", partition=0, timestamp_ms=stamp).result(30)
    [record] = _consume(gateway, topic, 1)
    assert record.timestamp_ms == stamp  # the consumer reads it right

    connection = GatewayConnection.get(gateway.address)
    try:
        batches = list(
            read_range(
                connection,
                OffsetRange(topic, 0, 0, 1),
                include_headers=False,
                fail_on_data_loss=True,
                fetch_max_bytes=1 << 20,
            )
        )
    except tidelog.errors.InvalidRecordError as exc:
        assert f"offset 0: timestamp {stamp} ms is beyond Spark's timestamps" in str(exc)
        return  # refused, as Kafka's source does
    [value] = pa.Table.from_batches(batches).column("timestamp").cast(pa.int64()).to_pylist()
    # stamp * 1000 does not fit an int64: no value is right, only an error is.
    pytest.fail(f"Spark reads {value} us (1970 + {value / 3.156e13:.0f} years) for {stamp} ms")


def test_send_batch_takes_the_binary_view_arrays_the_codec_takes(
    admin: tidelog.Admin, gateway: GatewayProcess
) -> None:
    """``encode_batch_arrow`` documents binary_view input and encodes it; ``send_batch``
    of such an array (what Polars and DuckDB hand out) raises pyarrow's
    ArrowNotImplementedError from ``arrow_record_bytes`` (``binary_length`` has no view
    kernel) instead of sending it (found by an audit)."""
    topic = "sdk-inputs-view"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    values = pa.array([b"a", None, b"ccc"], pa.binary_view())
    with tidelog.Producer(gateway.address) as producer:
        meta = producer.send_batch(topic, values, partition=0).result(30)
        texts = pa.array(["d", "ee"], pa.string_view())
        assert list(producer.send_batch(topic, texts, partition=0).result(30).offsets) == [3, 4]
    got = _consume(gateway, topic, 5)
    assert [r.value for r in got] == [b"a", None, b"ccc", b"d", b"ee"]
    assert len(meta) == 3


def test_an_odd_header_in_one_partition_does_not_fail_records_of_another(
    admin: tidelog.Admin, gateway: GatewayProcess
) -> None:
    """The same header, sent to partition 1 while partition 0 has a record in the same
    request: the sender encoded partition 0's batch (spending its sequence numbers), then
    failed on partition 1's, and failed the whole request without sending it. Partition
    0's next batch then carried sequences the leader had not seen the ones before of, and
    was refused OUT_OF_ORDER_SEQUENCE (found by an audit). Every record is written now."""
    topic = "sdk-inputs-header-mv-seq"
    admin.create_topic(topic, partitions=2, replication_factor=1)
    wide = memoryview(array.array("i", [1, 2]))
    with tidelog.Producer(gateway.address, linger_ms=300) as producer:
        producer.send(topic, b"first", partition=0).result(30)  # the leader knows the id
        innocent = producer.send(topic, b"same request", partition=0)
        odd = producer.send(topic, b"v", partition=1, headers=[("h", wide)])
        assert innocent.result(30).offset == 1
        assert odd.result(30).offset == 0
        assert producer.send(topic, b"later", partition=0).result(30).offset == 2


def test_a_header_value_is_taken_at_send_as_the_value_and_key_are(
    admin: tidelog.Admin, gateway: GatewayProcess
) -> None:
    """``send`` copies a bytearray value and key (``bytes(value)``) but keeps a header
    value as given until the sender encodes the batch, up to ``linger_ms`` later: an
    application that reuses its buffer after ``send`` returns (Kafka serializes records
    into the batch at send()) got the later content written as the earlier record's
    header, silently (found by an audit)."""
    topic = "sdk-inputs-header-alias"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    buffer = bytearray(b"first")
    with tidelog.Producer(gateway.address, linger_ms=300) as producer:
        future = producer.send(
            topic, bytes(buffer), partition=0, key=buffer, headers=[("h", buffer)]
        )
        buffer[:] = b"SECOND"  # reused for the next record, as the value and key may be
        offset = future.result(30).offset
    [read] = [r for r in _consume(gateway, topic, 1) if r.offset == offset]
    assert (read.key, read.value) == (b"first", b"first")
    assert read.headers == (("h", b"first"),)


def test_send_batch_values_are_taken_at_the_call(
    admin: tidelog.Admin, gateway: GatewayProcess
) -> None:
    """``send_batch`` of a list keeps bytearray items by reference until the sender
    encodes them (``send`` copies them): a buffer reused after the call returned was
    written with its later content (found by an audit)."""
    topic = "sdk-inputs-batch-alias"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    buffer = bytearray(b"first")
    with tidelog.Producer(gateway.address, linger_ms=300) as producer:
        future = producer.send_batch(topic, [buffer], partition=0)
        buffer[:] = b"SECOND"
        offset = future.result(30)[0].offset
    [read] = [r for r in _consume(gateway, topic, 1) if r.offset == offset]
    assert read.value == b"first"


def test_send_batch_takes_a_wide_memoryview_as_its_bytes(
    admin: tidelog.Admin, gateway: GatewayProcess
) -> None:
    """``send_batch``'s item check took any memoryview, the encoder only byte-wide ones:
    the call succeeded and the batch then failed in the sender, with a correct record
    sent by ``send`` to the same partition before it (found by an audit). Items are
    copied to bytes at the call, as ``send`` copies a value."""
    topic = "sdk-inputs-batch-mv"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    wide = memoryview(array.array("i", [1, 2]))
    with tidelog.Producer(gateway.address, linger_ms=300) as producer:
        good = producer.send(topic, b"innocent", partition=0)
        batch = producer.send_batch(topic, [b"x", wide], partition=0)
        assert good.result(30).offset == 0
        assert list(batch.result(30).offsets) == [1, 2]
    assert [r.value for r in _consume(gateway, topic, 3)] == [b"innocent", b"x", wide.tobytes()]


def test_message_timestamp_before_max_ms_holds_for_every_record_the_sdk_batches(
    admin: tidelog.Admin, gateway: GatewayProcess
) -> None:
    """The broker checks a batch's ``base_timestamp`` and ``max_timestamp`` against
    message.timestamp.before/after.max.ms (it does not read records). The encoder takes
    the *first* record's timestamp as the base, so an older record later in the batch has
    a negative delta and was checked by neither: sent alone it was refused
    INVALID_TIMESTAMP, sent after a fresh record it was written (found by an audit;
    Kafka checks every record). With the smallest timestamp as the base (deltas >= 0),
    the two header fields the broker checks bound every record."""
    topic = "sdk-inputs-before-max"
    admin.create_topic(
        topic,
        partitions=1,
        replication_factor=1,
        config={"message.timestamp.before.max.ms": str(3_600_000)},
    )
    with tidelog.Producer(gateway.address, linger_ms=300) as producer:
        with pytest.raises(tidelog.errors.InvalidTimestampError):
            producer.send(topic, b"stale alone", partition=0, timestamp_ms=0).result(30)
        producer.send(topic, b"fresh", partition=0)  # same batch: refused with it (Kafka)
        stale = producer.send(topic, b"stale after a fresh one", partition=0, timestamp_ms=0)
        with pytest.raises(tidelog.errors.InvalidTimestampError):
            stale.result(30)


def test_send_batch_metadata_gives_the_log_append_time_as_send_does(
    admin: tidelog.Admin, gateway: GatewayProcess
) -> None:
    """On a LogAppendTime topic every record's timestamp is the leader's stamp
    (``max_timestamp``), and ``send``'s RecordMetadata says so (Kafka's rule); the
    RecordMetadata of ``send_batch`` kept the producer's own timestamp, which is not the
    timestamp of any record written (found by an audit)."""
    topic = "sdk-inputs-lat-meta"
    admin.create_topic(
        topic,
        partitions=1,
        replication_factor=1,
        config={"message.timestamp.type": "LogAppendTime"},
    )
    with tidelog.Producer(gateway.address) as producer:
        sent = producer.send(topic, b"one", partition=0, timestamp_ms=1_000).result(30)
        batch = producer.send_batch(topic, [b"two"], partition=0, timestamp_ms=1_000).result(30)
    read = {r.offset: r.timestamp_ms for r in _consume(gateway, topic, 2)}
    assert sent.timestamp_ms == read[sent.offset] != 1_000
    assert batch[0].timestamp_ms == read[batch[0].offset], (batch[0], read)


def test_a_key_goes_to_the_partition_of_the_bytes_written_for_it(
    admin: tidelog.Admin, gateway: GatewayProcess
) -> None:
    """``send`` writes ``bytes(key)`` but hashes the key object as given: a memoryview
    of wider items (``len`` counts items, slicing and indexing are per item) hashes to
    another partition than its bytes, so one key's records were spread over two
    partitions (per-key order lost; found by an audit)."""
    topic = "sdk-inputs-key-mv"
    admin.create_topic(topic, partitions=8, replication_factor=1)
    key = memoryview(array.array("i", [1, 2]))
    with tidelog.Producer(gateway.address) as producer:
        as_view = producer.send(topic, b"a", key=key).result(30)
        as_bytes = producer.send(topic, b"b", key=key.tobytes()).result(30)
    assert as_view.partition == as_bytes.partition, (as_view, as_bytes)


def test_cli_json_output_keeps_every_header_of_a_record(
    admin: tidelog.Admin, gateway: GatewayProcess
) -> None:
    """Headers are a list: one name may repeat (Kafka's Headers; FORMAT.md: "headers in
    the order they were given"), and the consumer returns them all. ``tidelog consume
    --output json`` printed them as a JSON object keyed by name, so all but the last of
    a repeated name were dropped from the output (found by an audit). They are [name,
    value] pairs in order."""
    topic = "sdk-inputs-cli-headers"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    headers = [("trace", b"a"), ("trace", b"b"), ("x", None)]
    with tidelog.Producer(gateway.address) as producer:
        producer.send(topic, b"v", partition=0, headers=headers).result(30)
    ran = subprocess.run(
        [
            sys.executable,
            "-m",
            "tidelog",
            "consume",
            topic,
            "--from-beginning",
            "--max-messages",
            "1",
            "--output",
            "json",
        ],
        capture_output=True,
        cwd=REPO_ROOT,
        env={**tidelog_env(), "TIDELOG_GATEWAY": gateway.address},
        timeout=60,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    printed = json.loads(ran.stdout.splitlines()[0])["headers"]
    assert printed == [["trace", "a"], ["trace", "b"], ["x", None]]


def test_send_batch_takes_a_dictionary_array_and_refuses_a_non_binary_one(
    admin: tidelog.Admin, gateway: GatewayProcess
) -> None:
    """A dictionary-encoded column (as Parquet reads often give) is written as its values;
    an int column is refused at the call with ConfigError. Both raised pyarrow's
    ArrowNotImplementedError from the size count (found by an audit)."""
    topic = "sdk-inputs-dictionary"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        values = pa.array([b"a", b"bb", b"a"]).dictionary_encode()
        assert list(producer.send_batch(topic, values, partition=0).result(30).offsets) == [
            0,
            1,
            2,
        ]
        with pytest.raises(tidelog.errors.ConfigError, match="binary or string array, not int64"):
            producer.send_batch(topic, pa.array([1, 2]), partition=0)
    assert [r.value for r in _consume(gateway, topic, 3)] == [b"a", b"bb", b"a"]
