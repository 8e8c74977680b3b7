"""Kafka consumer calls beyond poll and commit: pause / resume, offsets_for_times,
partitions_for, subscription, wakeup (a real cluster)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

import tidelog
from tests.support.cluster import GatewayProcess, poll_records
from tidelog.errors import ConfigError, UnknownTopicOrPartitionError, WakeupError


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
