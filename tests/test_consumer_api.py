"""Kafka consumer calls beyond poll and commit: pause / resume, offsets_for_times,
partitions_for, subscription, wakeup, invalid batches (a real cluster)."""

from __future__ import annotations

import re
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import tidelog
from tests.support.cluster import GatewayProcess, poll_records, running_cluster, wait_for
from tests.support.tcp_proxy import TcpProxy
from tidelog import formats as f
from tidelog.batch import crc32c, header_crc_of
from tidelog.errors import (
    ConfigError,
    CorruptBatchError,
    TidelogError,
    UnknownTopicOrPartitionError,
    WakeupError,
)
from tidelog.records import encode_batch
from tidelog.v1 import common_pb2, gateway_pb2


def invalid_batch(values: list[bytes]) -> bytes:
    """A batch as a hostile producer writes it: both checksums valid, but its
    max_timestamp is below its largest record timestamp (docs/FORMAT.md section 2.4), so
    brokers (which check only headers and checksums) take it and decoders refuse it."""
    base_ms = int(time.time() * 1000)
    buf = bytearray(encode_batch(values, timestamps_ms=[base_ms + i for i in range(len(values))]))
    f.I64.pack_into(buf, f.MAX_TIMESTAMP_OFFSET, base_ms)
    f.U32.pack_into(buf, f.CRC_OFFSET, crc32c(buf[f.BODY_CRC_START :]))
    f.U32.pack_into(buf, f.HEADER_CRC_OFFSET, header_crc_of(buf))
    return bytes(buf)


def produce_raw(gateway: GatewayProcess, topic: str, partition: int, records: bytes) -> int:
    """Append ``records`` (whole batches, sent as they are) through the gateway; the
    offset of the first record."""
    response = gateway.stub.Produce(
        gateway_pb2.ProduceRequest(
            acks=common_pb2.ALL,
            partitions=[
                gateway_pb2.ProducePartitionData(topic=topic, partition=partition, records=records)
            ],
        ),
        timeout=30,
    )
    [result] = response.partitions
    assert result.error.code == common_pb2.NONE, result.error.message
    return int(result.base_offset)


def values(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def write_valid_invalid_valid(gateway: GatewayProcess, topic: str, partition: int = 0) -> None:
    """Offsets 0..4 valid, 5..7 one invalid batch, 8..11 valid: one append, so a fetch
    from 0 brings all three batches in one answer."""
    batches = encode_batch(values("a", 5)) + invalid_batch(values("b", 3))
    assert produce_raw(gateway, topic, partition, batches + encode_batch(values("c", 4))) == 0


def poll_until_error(
    consumer: tidelog.Consumer, timeout_s: float = 30
) -> tuple[list[Any], CorruptBatchError]:
    """Records ``poll`` returns until it raises CorruptBatchError (which is returned)."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got += consumer.poll(timeout_ms=500)
        except CorruptBatchError as exc:
            return got, exc
    raise AssertionError(f"no CorruptBatchError within {timeout_s} s; polled {got}")


INVALID_AT_5 = (
    r"topic '{topic}' partition 0: the record batch at offsets 5\.\.7 is invalid "
    r"\(max_timestamp .*\)\. The position stays at 5 and polling raises this again; to "
    r"skip the batch and lose its records, consumer\.seek\(\('{topic}', 0\), 8\)"
)


def test_paused_partitions_are_not_read_until_resumed(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    admin.create_topic("pausing", partitions=2, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        for p in range(2):
            producer.send_batch("pausing", [f"{p}-{i}".encode() for i in range(20)], partition=p)
        producer.flush()
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.assign([("pausing", 0), ("pausing", 1)])
        consumer.pause([("pausing", 1)])
        assert consumer.paused() == [("pausing", 1)]
        got = poll_records(consumer, 20, timeout_s=20)
        deadline = time.monotonic() + 1.5  # nothing of the paused partition comes
        while time.monotonic() < deadline:
            got += [(r.offset, r.value) for r in consumer.poll(timeout_ms=200)]
        assert sorted(v for _, v in got) == sorted(f"0-{i}".encode() for i in range(20))
        assert consumer.position(("pausing", 1)) == 0
        consumer.resume([("pausing", 1)])
        assert consumer.paused() == []
        rest = poll_records(consumer, 20, timeout_s=20)
        assert sorted(v for _, v in rest) == sorted(f"1-{i}".encode() for i in range(20))
        with pytest.raises(ConfigError, match="not assigned"):
            consumer.pause([("pausing", 7)])
        consumer.pause([("pausing", 0)])
        consumer.assign([("pausing", 1)])  # a new assignment forgets the pause
        assert consumer.paused() == []


def test_a_partition_assigned_again_is_auto_committed_even_at_its_old_offset(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """The auto-commit skips positions equal to what this consumer last committed. That
    memory outlived an assignment: a partition given up and assigned again, its
    position back at the offset this consumer had committed, was skipped as unchanged
    over what another consumer had committed meanwhile (Kafka's auto-commit commits every
    consumed position). Found by an audit."""
    admin.create_topic("reassigned", partitions=2, replication_factor=1)
    tp = ("reassigned", 0)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch("reassigned", [b"v%d" % i for i in range(10)], partition=0)
        producer.flush()
    with (
        tidelog.Consumer(
            gateway.address, group_id="reassigned", auto_commit_interval_ms=1
        ) as consumer,
        tidelog.Consumer(gateway.address, group_id="reassigned") as other,
    ):
        consumer.assign([tp])
        consumer.seek(tp, 5)
        consumer.commit()
        consumer.assign([("reassigned", 1)])  # gives tp up
        other.assign([tp])
        other.commit({tp: 9})
        consumer.assign([tp])
        consumer.seek(tp, 5)
        time.sleep(0.01)  # past the auto-commit interval since assign's own commit
        consumer.poll(timeout_ms=50)  # the auto-commit is due: position 5 is consumed
        assert other.committed([tp]) == {tp: 5}


def test_offsets_for_times_partitions_for_and_subscription(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    admin.create_topic("timed", partitions=2, replication_factor=1)
    base_ms = int(time.time() * 1000) - 60_000
    with tidelog.Producer(gateway.address) as producer:
        for i in range(10):
            producer.send("timed", f"v{i}".encode(), partition=0, timestamp_ms=base_ms + i * 1000)
        producer.flush()
    with tidelog.Consumer(gateway.address) as consumer:
        found = consumer.offsets_for_times({("timed", 0): base_ms + 4_500, ("timed", 1): base_ms})
        assert found[("timed", 0)] == (5, base_ms + 5_000)
        assert found[("timed", 1)] is None  # nothing there that recent
        assert consumer.offsets_for_times({("timed", 0): base_ms + 60_000}) == {("timed", 0): None}
        with pytest.raises(ConfigError, match="outside"):
            consumer.offsets_for_times({("timed", 0): -1})
        started = time.monotonic()
        with pytest.raises(UnknownTopicOrPartitionError):
            consumer.offsets_for_times({("no-such-topic", 0): base_ms})
        with pytest.raises(UnknownTopicOrPartitionError, match="partition 9"):
            consumer.offsets_for_times({("timed", 9): base_ms})
        assert time.monotonic() - started < 10  # at once, not after the request timeout
        assert consumer.partitions_for("timed") == [0, 1]
        with pytest.raises(UnknownTopicOrPartitionError):
            consumer.partitions_for("no-such-topic")
        consumer.subscribe(["timed"])
        assert consumer.subscription() == ["timed"]
        consumer.assign([("timed", 1)])
        assert consumer.subscription() == []


def test_wakeup_interrupts_a_blocked_poll_from_a_thread_or_a_signal_handler(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    admin.create_topic("woken", partitions=1, replication_factor=1)
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.assign([("woken", 0)])
        # From another thread, while a long poll waits for records that never come.
        timer = threading.Timer(0.5, consumer.wakeup)
        timer.start()
        started = time.monotonic()
        with pytest.raises(WakeupError):
            consumer.poll(timeout_ms=60_000)
        assert time.monotonic() - started < 30  # not the poll's whole minute
        timer.join()
        # One wakeup, one WakeupError: the consumer stays usable.
        assert consumer.poll(timeout_ms=200) == []
        # Before the call: the next blocking call raises at once.
        consumer.wakeup()
        with pytest.raises(WakeupError):
            consumer.poll_arrow(timeout_ms=60_000)
        # From a signal handler (a lock there could deadlock; wakeup takes none).
        previous = signal.signal(signal.SIGALRM, lambda *_: consumer.wakeup())
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            with pytest.raises(WakeupError):
                consumer.poll(timeout_ms=60_000)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        # The iterator stops between records: what it yielded is the position, nothing
        # is skipped or repeated after it.
        with tidelog.Producer(gateway.address) as producer:
            producer.send_batch("woken", [f"r{i}".encode() for i in range(10)], partition=0)
            producer.flush()
        seen: list[int] = []
        with pytest.raises(WakeupError):
            for record in consumer:
                seen.append(record.offset)
                if len(seen) == 3:
                    consumer.wakeup()
        assert seen == [0, 1, 2]
        assert consumer.position(("woken", 0)) == 3
        assert [offset for offset, _ in poll_records(consumer, 7)] == list(range(3, 10))


def test_a_wakeup_in_the_loop_body_is_not_taken_by_the_auto_commit_after_it(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """wakeup() from the loop body (or a signal handler while it runs) makes the iterator
    raise WakeupError before the next record, and the auto-commit due meanwhile still
    commits. The auto-commit went through commit(), which took the wake-up and raised
    WakeupError; the auto-commit counted that as a failed commit: the wake-up was lost
    (the loop never stopped) and so was the commit (found by an audit)."""
    admin.create_topic("woken-committing", partitions=1, replication_factor=1)
    tp = ("woken-committing", 0)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(tp[0], values("r", 10), partition=0)
        producer.flush()
    with tidelog.Consumer(
        gateway.address,
        group_id="woken-committers",
        auto_offset_reset="earliest",
        enable_auto_commit=True,
        auto_commit_interval_ms=1,
    ) as consumer:
        consumer.assign([tp])
        seen: list[int] = []
        with pytest.raises(WakeupError):
            for record in consumer:
                seen.append(record.offset)
                time.sleep(0.01)  # the loop body's work: an auto-commit is due after it
                if len(seen) == 3:
                    consumer.wakeup()
                if len(seen) == 10:
                    break
        assert seen == [0, 1, 2]
        assert consumer.committed([tp]) == {tp: 3}  # the commit after the wake-up


def test_a_closed_consumer_refuses_every_call_but_close_wakeup_and_metrics(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Kafka's IllegalStateException("This consumer has already been closed."): calls on
    a closed consumer answered from its stale state (a position, a commit) as if open."""
    admin.create_topic("closed-calls", partitions=1, replication_factor=1)
    consumer = tidelog.Consumer(gateway.address, group_id="closed-calls")
    consumer.assign([("closed-calls", 0)])
    consumer.close()
    calls = {
        "poll": lambda: consumer.poll(timeout_ms=0),
        "commit": lambda: consumer.commit({("closed-calls", 0): 1}),
        "committed": lambda: consumer.committed([("closed-calls", 0)]),
        "position": lambda: consumer.position(("closed-calls", 0)),
        "assignment": consumer.assignment,
        "seek": lambda: consumer.seek(("closed-calls", 0), 0),
        "subscribe": lambda: consumer.subscribe(["closed-calls"]),
    }
    for name, call in calls.items():
        try:
            call()
        except ConfigError as exc:
            assert "the consumer is closed" in str(exc), name
        else:
            pytest.fail(f"{name} on a closed consumer did not raise")
    consumer.close()  # again: nothing
    consumer.wakeup()
    assert isinstance(consumer.metrics(), dict)


def test_commit_and_committed_ride_out_a_gateway_restart(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Kafka's commitSync: a commit the gateway cannot answer (it is restarting) is sent
    again until default_api_timeout_ms. It failed at the first refused connection, so a
    gateway's rolling restart failed every manual commit made meanwhile (found by an
    audit)."""
    admin.create_topic("restarting", partitions=1, replication_factor=1)
    tp = ("restarting", 0)
    proxy = TcpProxy(gateway.address)
    consumer = tidelog.Consumer(proxy.address, group_id="restarting", request_timeout_ms=2_000)
    try:
        consumer.assign([tp])
        consumer.commit({tp: 3})
        proxy.down()
        back = threading.Timer(1.5, proxy.up)
        back.start()
        started = time.monotonic()
        consumer.commit({tp: 5})
        assert time.monotonic() - started >= 1.0  # it did wait for the gateway
        assert consumer.committed([tp]) == {tp: 5}
        back.join()
        proxy.down()  # and for good: the error comes once default_api_timeout_ms passed
        short = tidelog.Consumer(proxy.address, group_id="restarting", default_api_timeout_ms=1_500)
        try:
            with pytest.raises(TidelogError) as raised:
                short.committed([tp])
            assert raised.value.retriable
        finally:
            short.close()
    finally:
        consumer.close()
        proxy.close()


def test_an_auto_commit_in_poll_keeps_to_the_poll_timeout_while_the_gateway_is_down(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """poll(timeout_ms) waits at most about timeout_ms even when an auto-commit is due and
    the gateway cannot be reached (Kafka's auto-commit in poll is asynchronous). It was
    commit()'s, retried for default_api_timeout_ms, and its failure did not count as a
    commit, so every poll after it blocked that long again (found by an audit). The
    failed auto-commit is tried again an interval later and lands once the gateway is
    back."""
    admin.create_topic("commit-blocked", partitions=1, replication_factor=1)
    tp = ("commit-blocked", 0)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(tp[0], [b"a", b"b", b"c"], partition=0)
        producer.flush()
    proxy = TcpProxy(gateway.address)
    consumer = tidelog.Consumer(
        proxy.address,
        group_id="commit-blocked",
        auto_offset_reset="earliest",
        auto_commit_interval_ms=100,
        request_timeout_ms=1_000,
        default_api_timeout_ms=8_000,
    )
    try:
        consumer.assign([tp])
        assert [offset for offset, _ in poll_records(consumer, 3)] == [0, 1, 2]
        proxy.down()
        for _ in range(3):  # each one with an auto-commit of position 3 due
            time.sleep(0.3)
            started = time.monotonic()
            assert consumer.poll(timeout_ms=500) == []
            elapsed = time.monotonic() - started
            assert elapsed < 3.0, f"poll(timeout_ms=500) took {elapsed:.1f} s"
        proxy.up()
        deadline = time.monotonic() + 30
        while consumer.committed([tp]) != {tp: 3} and time.monotonic() < deadline:
            consumer.poll(timeout_ms=200)
        assert consumer.committed([tp]) == {tp: 3}
    finally:
        proxy.up()
        consumer.close()
        proxy.close()


def test_an_invalid_batch_is_raised_after_the_valid_records_before_it_until_a_seek(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Kafka's "Record batch for partition X at offset Y is invalid": the valid records
    fetched with the bad batch are handed out, then poll raises naming the topic, the
    partition and the batch's offsets, again at every poll, until a seek skips it. It
    used to raise "batch at position N: ..." at once, losing the records before it."""
    topic = "invalid-batch"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    write_valid_invalid_valid(gateway, topic)
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.assign([(topic, 0)])
        got, error = poll_until_error(consumer)
        assert [(r.offset, r.value) for r in got] == list(enumerate(values("a", 5)))
        pattern = INVALID_AT_5.format(topic=topic)
        assert re.search(pattern, str(error)), str(error)
        for _ in range(2):  # the position stays at the bad batch: it is met again
            with pytest.raises(CorruptBatchError, match=pattern):
                consumer.poll(timeout_ms=5_000)
        assert consumer.position((topic, 0)) == 5  # nothing skipped unasked
        consumer.seek((topic, 0), 8)
        assert poll_records(consumer, 4) == list(enumerate(values("c", 4), start=8))


def test_an_invalid_batch_does_not_hold_back_other_partitions(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """The error is the bad partition's alone: the other partition's records, fetched
    with it and after it, keep coming between the errors, and pausing the bad partition
    stops the errors until it is resumed. It used to raise at once, at every poll that
    decoded the bad partition's answer, without naming it, and never handed out the
    bad partition's valid records."""
    # Its own topic name per run: a rerun (pytest --reruns) shares the module's cluster.
    topic = f"invalid-batch-two-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, partitions=2, replication_factor=1)
    write_valid_invalid_valid(gateway, topic, partition=0)
    produce_raw(gateway, topic, 1, encode_batch(values("p1-", 10)))
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.assign([(topic, 0), (topic, 1)])

        def poll_partition_1(n: int, of_partition_0: int = 0) -> tuple[list[Any], int]:
            """Poll until ``n`` records of partition 1 (and ``of_partition_0`` of partition
            0) came; the others and the errors. The partitions may have different leaders,
            whose answers come in either order."""
            got: list[Any] = []
            errors = 0
            deadline = time.monotonic() + 30
            while (
                sum(r.partition == 1 for r in got) < n
                or sum(r.partition == 0 for r in got) < of_partition_0
            ) and time.monotonic() < deadline:
                try:
                    got += consumer.poll(timeout_ms=500)
                except CorruptBatchError:
                    errors += 1
            return got, errors

        got, errors = poll_partition_1(10, of_partition_0=5)
        assert [r.value for r in got if r.partition == 1] == values("p1-", 10)
        assert [r.value for r in got if r.partition == 0] == values("a", 5)
        # Nothing else is buffered now: every poll raises, at once.
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(CorruptBatchError, match=INVALID_AT_5.format(topic=topic)):
                consumer.poll(timeout_ms=10_000)
            assert time.monotonic() - started < 5
        # Records written to the other partition after the error still come, between
        # the errors (each poll either hands some out or raises).
        produce_raw(gateway, topic, 1, encode_batch(values("later-", 5)))
        got, errors = poll_partition_1(5)
        assert [r.value for r in got] == values("later-", 5)
        assert errors >= 1
        assert consumer.position((topic, 0)) == 5
        # Paused, the bad partition raises no more; resumed, it does again.
        consumer.pause([(topic, 0)])
        produce_raw(gateway, topic, 1, encode_batch(values("paused-", 3)))
        assert [v for _, v in poll_records(consumer, 3)] == values("paused-", 3)
        assert consumer.poll(timeout_ms=300) == []
        consumer.resume([(topic, 0)])
        poll_until_error(consumer)
        consumer.seek((topic, 0), 8)
        assert poll_records(consumer, 4) == list(enumerate(values("c", 4), start=8))


def test_poll_arrow_and_the_iterator_stop_at_an_invalid_batch_too(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """``poll_arrow`` and ``iter(consumer)`` hand out the valid records first and raise
    the same error at the bad batch (they used to raise at once, without its place)."""
    topic = "invalid-batch-arrow"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    write_valid_invalid_valid(gateway, topic)
    pattern = INVALID_AT_5.format(topic=topic)
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.assign([(topic, 0)])
        offsets: list[int] = []
        deadline = time.monotonic() + 30
        with pytest.raises(CorruptBatchError, match=pattern):
            while time.monotonic() < deadline:
                offsets += consumer.poll_arrow(timeout_ms=500).column("offset").to_pylist()
        assert offsets == list(range(5))
        with pytest.raises(CorruptBatchError, match=pattern):
            consumer.poll_arrow(timeout_ms=5_000)
        consumer.seek((topic, 0), 8)
        table = consumer.poll_arrow(timeout_ms=10_000)
        assert table.column("offset").to_pylist() == list(range(8, 12))
        assert table.column("value").to_pylist() == values("c", 4)
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.assign([(topic, 0)])
        seen: list[int] = []
        with pytest.raises(CorruptBatchError, match=pattern):
            for record in consumer:
                seen.append(record.offset)
        assert seen == list(range(5))
        assert consumer.position((topic, 0)) == 5


def test_a_consumer_refuses_a_request_timeout_below_one_ms() -> None:
    """Found by an audit: request_timeout_ms=0 was taken, and every call then had a 0 s
    deadline (the producer refused it already)."""
    with pytest.raises(ConfigError, match="request_timeout_ms must be >= 1"):
        tidelog.Consumer("127.0.0.1:1", request_timeout_ms=0)


def test_an_offline_partition_does_not_stop_the_reset_of_the_others(tmp_path: Path) -> None:
    """Positions to reset (auto_offset_reset) were looked up together, in a retry loop
    until the request timeout: one partition without a leader (its RF=1 broker dead)
    failed every poll after 30 s, and the partition whose leader was alive was never
    read. As Kafka does, each partition is reset on its own now; the leaderless one is
    asked again after a back-off while the others are read. Found by an audit."""
    with running_cluster(tmp_path, brokers=2) as cluster:
        gateway = cluster.start_gateway()
        admin = tidelog.Admin(gateway.address)
        admin.create_topic("offl", partitions=2, replication_factor=1)
        with tidelog.Producer(gateway.address) as producer:
            for p in range(2):
                producer.send_batch("offl", [f"{p}-{i}".encode() for i in range(10)], partition=p)
            producer.flush()
        leaders = {s.partition: s.leader for s in cluster.partitions("offl")}
        assert leaders[0] != leaders[1], leaders  # one partition per broker
        cluster.kill(cluster.brokers[leaders[1]])
        wait_for(
            lambda: {s.partition: s.leader for s in cluster.partitions("offl")}[1] < 0,
            30,
            "partition 1 offline",
        )
        with tidelog.Consumer(
            gateway.address, auto_offset_reset="earliest", request_timeout_ms=5000
        ) as consumer:
            consumer.assign([("offl", 0), ("offl", 1)])
            got: list[bytes] = []
            errors: list[str] = []
            deadline = time.monotonic() + 20
            while len(got) < 10 and time.monotonic() < deadline:
                try:
                    got += [r.value for r in consumer.poll(timeout_ms=500)]
                except TidelogError as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
            assert sorted(got) == sorted(f"0-{i}".encode() for i in range(10)), (
                f"partition 0 (its leader alive) was not read; poll raised {len(errors)} "
                f"times: {errors[:2]}"
            )


@pytest.mark.parametrize("offset", [2.0, True, 2**63], ids=["float", "bool", "past-int64"])
def test_seek_and_commit_refuse_an_offset_no_fetch_can_carry(
    gateway: GatewayProcess, admin: tidelog.Admin, offset: object
) -> None:
    """seek() checked only offset < 0: a float (``end / 2``) or an offset past int64 was
    taken, and every poll after it raised protobuf's TypeError or ValueError (found by an
    audit); commit() let them escape the same way."""
    topic = f"seek-typed-{uuid.uuid4().hex[:6]}"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    with tidelog.Consumer(gateway.address, "seek-typed", auto_offset_reset="earliest") as c:
        c.assign([(topic, 0)])
        with pytest.raises(ConfigError, match="offset"):
            c.seek((topic, 0), offset)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="offset"):
            c.commit({(topic, 0): offset})  # type: ignore[dict-item]
        assert c.poll(timeout_ms=200) == []


def test_a_failed_subscribe_changes_nothing(gateway: GatewayProcess, admin: tidelog.Admin) -> None:
    """subscribe() without a group_id to a topic that does not exist raised, but had
    already made subscription() name it while poll() went on reading the old topic
    (found by an audit)."""
    old = f"subscribed-{uuid.uuid4().hex[:6]}"
    admin.create_topic(old, partitions=1, replication_factor=1)
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.subscribe([old])
        with pytest.raises(UnknownTopicOrPartitionError):
            consumer.subscribe([old, "no-such-topic-here"])
        assert consumer.subscription() == [old]
        assert consumer.assignment() == [(old, 0)]


@pytest.mark.parametrize("call", ["end_offsets", "beginning_offsets"])
def test_offsets_of_a_partition_that_does_not_exist_fail_at_once_as_unknown(
    gateway: GatewayProcess, admin: tidelog.Admin, call: str
) -> None:
    """end_offsets and beginning_offsets of a partition past the topic's count waited
    out the request timeout and raised REQUEST_TIMED_OUT, which reads as a cluster
    problem; offsets_for_times said UNKNOWN_TOPIC_OR_PARTITION at once (found by an
    audit). All three check the metadata first now."""
    topic = f"counted-{uuid.uuid4().hex[:6]}"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    with tidelog.Consumer(gateway.address, request_timeout_ms=20_000) as consumer:
        started = time.monotonic()
        for asked in ([(topic, 7)], [("no-such-topic-at-all", 0)]):
            with pytest.raises(UnknownTopicOrPartitionError):
                getattr(consumer, call)(asked)
        assert time.monotonic() - started < 15, "it waited out the request timeout"
        assert getattr(consumer, call)([(topic, 0)]) == {(topic, 0): 0}


def test_seek_and_commit_take_integer_offsets_of_numpy(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """An offset computed with numpy or pandas (np.int64 has __index__; protobuf takes
    it) was refused by the first type check ("must be an int, not int64"; found by an
    audit): any integer type is taken, floats and bools are not."""
    np = pytest.importorskip("numpy")
    topic = f"np-offsets-{uuid.uuid4().hex[:6]}"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    with tidelog.Consumer(gateway.address, "np-group", enable_auto_commit=False) as consumer:
        tp = (topic, 0)
        consumer.assign([tp])
        consumer.seek(tp, np.int64(0))
        assert consumer.position(tp) == 0 and type(consumer.position(tp)) is int
        consumer.commit({tp: np.int64(0)})
        assert consumer.committed([tp]) == {tp: 0}
