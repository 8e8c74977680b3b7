"""The producer under faults: exactly-once and per-partition order of sends from many
threads across a gateway kill -9 (gateway mode) and leader kills (direct mode,
pipelined), and splits for max.message.bytes. Written by an audit; the two tests whose
docstrings say "found by an audit" failed on the code before their fixes."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future

import pytest

import tidelog
from tests.support.cluster import GatewayProcess, TestCluster, wait_for
from tests.support.tcp_proxy import TcpProxy
from tidelog.errors import InvalidReplicationFactorError


def _create(admin: tidelog.Admin, topic: str, partitions: int, config: dict | None = None) -> None:
    def create() -> bool | None:
        try:
            admin.create_topic(
                topic,
                partitions=partitions,
                replication_factor=3,
                config={"min.insync.replicas": "2", **(config or {})},
            )
        except InvalidReplicationFactorError:
            return None
        return True

    wait_for(create, 30, f"create {topic}")


def _read_all(address: str, topic: str, partitions: int, expected: int) -> list:
    records: list = []
    with tidelog.Consumer(address, auto_offset_reset="earliest") as c:
        c.assign([(topic, p) for p in range(partitions)])
        deadline = time.monotonic() + 60
        while len(records) < expected and time.monotonic() < deadline:
            records.extend(c.poll(max_records=100_000, timeout_ms=500))
        records.extend(c.poll(max_records=100_000, timeout_ms=1000))
    return records


def _run_threads(
    producer: tidelog.Producer,
    topic: str,
    *,
    threads: int,
    per_thread: int,
    fault: Callable[[], None],
) -> tuple[dict, dict]:
    """Each thread sends its own key; the records of a key must land in order."""
    callbacks: dict[int, list[int]] = defaultdict(list)  # partition -> offsets in callback order
    cb_lock = threading.Lock()
    futures: dict[bytes, list[tuple[bytes, Future]]] = defaultdict(list)
    done_counts: dict[int, int] = defaultdict(int)
    fault_at = threading.Event()  # a third of the way through the first thread's sends

    def on_done(f: Future) -> None:
        if f.exception() is None:
            md = f.result()
            with cb_lock:
                callbacks[md.partition].append(md.offset)
                done_counts[id(f)] += 1

    def work(t: int) -> None:
        key = f"key-{t}".encode()
        for i in range(per_thread):
            value = f"{t}:{i}".encode()
            f = producer.send(topic, value, key=key)
            f.add_done_callback(on_done)
            futures[key].append((value, f))
            if t == 0 and i == per_thread // 3:
                fault_at.set()
            if i % 50 == 0:
                time.sleep(0.01)

    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in ts:
        th.start()
    fault_at.wait(30)
    fault()
    for th in ts:
        th.join(120)
    producer.flush(120)
    assert all(c == 1 for c in done_counts.values())
    return futures, callbacks


def _check(records: list, futures: dict, callbacks: dict) -> None:
    errors = [f.exception() for fs in futures.values() for _, f in fs if f.exception()]
    assert not errors, f"{len(errors)} sends failed, first: {errors[0]!r}"
    for partition, offsets in callbacks.items():
        assert offsets == sorted(offsets), f"callbacks of partition {partition} out of order"
    values = [r.value for r in records]
    dupes = {v for v in values if values.count(v) > 1}
    assert not dupes, f"{len(dupes)} values written twice, e.g. {sorted(dupes)[:3]}"
    by_key: dict[bytes, list[bytes]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        by_key[r.key].append(r.value)
    for key, fs in futures.items():
        assert by_key[key] == [v for v, _ in fs], f"records of {key!r} lost or misordered"
    for fs in futures.values():
        for _, f in fs:
            assert f.result().offset >= 0


def test_gateway_kill_during_multithreaded_sends_is_exactly_once_in_order(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    topic = "faults-gw-kill"
    _create(admin, topic, 3)
    own = cluster.start_gateway()
    proxy = TcpProxy(own.address)
    state = {}

    def fault() -> None:
        cluster.kill(own)
        time.sleep(0.5)
        second = cluster.start_gateway()
        state["g"] = second
        proxy.retarget(second.address)

    try:
        with tidelog.Producer(
            proxy.address, linger_ms=2, delivery_timeout_ms=90_000, request_timeout_ms=10_000
        ) as producer:
            futures, callbacks = _run_threads(
                producer, topic, threads=4, per_thread=600, fault=fault
            )
        records = _read_all(gateway.address, topic, 3, 4 * 600)
        _check(records, futures, callbacks)
    finally:
        proxy.down()


def test_direct_leader_kill_during_multithreaded_sends_is_exactly_once_in_order(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    topic = "faults-direct-kill"
    _create(admin, topic, 3)
    killed = {}

    def fault() -> None:
        leader = admin.describe_topic(topic).partitions[0].leader
        killed["b"] = leader
        cluster.kill(cluster.brokers[leader])

    with tidelog.Producer(
        gateway.address,
        direct=True,
        linger_ms=1,
        delivery_timeout_ms=90_000,
        request_timeout_ms=10_000,
    ) as producer:
        futures, callbacks = _run_threads(producer, topic, threads=4, per_thread=600, fault=fault)
    cluster.start_broker(killed["b"])
    records = _read_all(gateway.address, topic, 3, 4 * 600)
    _check(records, futures, callbacks)
    wait_for(
        lambda: all(len(p.isr) == 3 for p in admin.describe_topic(topic).partitions),
        60,
        "ISR back",
    )


def _bytes_accepted(producer: tidelog.Producer, topic: str) -> int:
    """send() 100-byte records to partition 0 until one blocks past max_block_ms; the
    record bytes accepted (they wait in an open batch: linger is a minute)."""
    accepted = 0
    for _ in range(1000):
        try:
            producer.send(topic, b"v" * 100, partition=0)
        except tidelog.errors.RequestTimedOutError:
            return accepted
        accepted += 100
    return accepted


def test_buffer_bytes_still_bounds_sends_after_a_send_batch_was_split(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A send_batch batch larger than buffer_bytes reserves buffer_bytes; refused by the
    topic's max.message.bytes it is split in halves, and each half gives back its own
    size: the producer's count of buffered bytes went below zero and buffer_bytes no
    longer bounded what send() queues (found by an audit)."""
    topic = "faults-split-buffer"
    _create(admin, topic, 1, {"max.message.bytes": "2000"})
    options = dict(buffer_bytes=3000, linger_ms=60_000, max_block_ms=300)
    with tidelog.Producer(gateway.address, **options) as fresh:
        baseline = _bytes_accepted(fresh, topic)
        fresh.close(0)
    assert baseline <= 3000
    with tidelog.Producer(gateway.address, **options) as producer:
        # ~7 KB of records in one batch (batch_bytes 1 MiB), over max.message.bytes.
        result = producer.send_batch(topic, [b"x" * 100] * 60, partition=0).result(30)
        assert len(result) == 60
        accepted = _bytes_accepted(producer, topic)
        producer.close(0)
    assert accepted <= 3000, (
        f"buffer_bytes=3000 but {accepted} bytes were queued without blocking "
        f"(a fresh producer took {baseline})"
    )


def test_direct_leader_kill_and_restart_during_sends_is_exactly_once_in_order(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    topic = "faults-direct-bounce"
    _create(admin, topic, 2)

    def fault() -> None:
        for _ in range(2):
            leader = admin.describe_topic(topic).partitions[0].leader
            cluster.kill(cluster.brokers[leader])
            time.sleep(0.3)
            cluster.start_broker(leader)
            time.sleep(0.5)

    with tidelog.Producer(
        gateway.address,
        direct=True,
        linger_ms=0,
        delivery_timeout_ms=90_000,
        request_timeout_ms=8_000,
    ) as producer:
        futures, callbacks = _run_threads(producer, topic, threads=3, per_thread=1500, fault=fault)
    records = _read_all(gateway.address, topic, 2, 3 * 1500)
    _check(records, futures, callbacks)


@pytest.mark.parametrize("direct", [True, False])
def test_records_too_large_between_small_ones_fail_alone(
    gateway: GatewayProcess, admin: tidelog.Admin, direct: bool
) -> None:
    """Single records over max.message.bytes between small ones (a topic whose
    max.message.bytes is below batch_bytes): each large one fails with
    MessageTooLargeError, every small one is written once and in send order.

    Failed in direct mode (pipelining; found by an audit): a refused batch is split in
    halves and the producer takes a new producer id (``_halves``); the halves' first
    request under it was refused again while the next batch, pipelined behind it under
    the same new id, was accepted (the leader takes any sequence from a producer id it
    does not know) and written first. A partition pipelines under a producer id only once
    the leader has acknowledged a batch of it (``Producer._may_send``)."""
    topic = f"faults-too-large-{int(direct)}"
    _create(admin, topic, 1, {"max.message.bytes": "2000"})
    small: list[tuple[bytes, Future]] = []
    large: list[Future] = []
    order: list[int] = []
    with tidelog.Producer(gateway.address, direct=direct, linger_ms=0) as producer:
        for i in range(400):
            if i % 25 == 7:
                large.append(producer.send(topic, b"L" * 3000, partition=0))
            f = producer.send(topic, f"s{i}".encode(), partition=0)
            f.add_done_callback(
                lambda f: order.append(f.result().offset) if not f.exception() else None
            )
            small.append((f"s{i}".encode(), f))
        producer.flush(60)
    for f in large:
        assert isinstance(f.exception(), tidelog.errors.MessageTooLargeError), f.exception()
    errors = [f.exception() for _, f in small if f.exception()]
    assert not errors, f"{len(errors)} small records failed: {errors[0]!r}"
    assert order == sorted(order)
    records = _read_all(gateway.address, topic, 1, len(small))
    assert [r.value for r in records] == [v for v, _ in small]


@pytest.mark.parametrize("direct", [False, True])
def test_mixed_send_and_send_batch_from_threads_keep_each_keys_order(
    gateway: GatewayProcess, admin: tidelog.Admin, direct: bool
) -> None:
    topic = f"faults-mixed-{int(direct)}"
    _create(admin, topic, 4)
    sent: dict[bytes, list[bytes]] = defaultdict(list)
    futures: list[Future] = []
    lock = threading.Lock()

    def work(t: int) -> None:
        key = f"k{t}".encode()
        n = 0
        for round_ in range(60):
            if round_ % 3 == 0:
                values = [f"{t}:{n + j}".encode() for j in range(50)]
                f = producer.send_batch(topic, values, keys=[key] * 50)
                n += 50
            else:
                values = [f"{t}:{n}".encode()]
                f = producer.send(topic, values[0], key=key)
                n += 1
            sent[key].extend(values)
            with lock:
                futures.append(f)

    with tidelog.Producer(gateway.address, direct=direct, linger_ms=1, batch_bytes=600) as producer:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        producer.flush(60)
    assert not [f.exception() for f in futures if f.exception()]
    total = sum(len(v) for v in sent.values())
    records = _read_all(gateway.address, topic, 4, total)
    by_key: dict[bytes, list[bytes]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        by_key[r.key].append(r.value)
    assert len(records) == total
    for key, values in sent.items():
        assert by_key[key] == values


def test_stopped_gateway_resumed_after_the_stream_timed_out_is_exactly_once_in_order(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    import os
    import signal

    topic = "faults-gw-stop"
    _create(admin, topic, 2)
    own = cluster.start_gateway()

    def fault() -> None:
        os.kill(own.pid, signal.SIGSTOP)
        time.sleep(4.5)  # past request_timeout_ms + the stream grace
        os.kill(own.pid, signal.SIGCONT)

    try:
        with tidelog.Producer(
            own.address, linger_ms=2, delivery_timeout_ms=60_000, request_timeout_ms=2_000
        ) as producer:
            futures, callbacks = _run_threads(
                producer, topic, threads=3, per_thread=400, fault=fault
            )
        records = _read_all(gateway.address, topic, 2, 3 * 400)
        _check(records, futures, callbacks)
    finally:
        os.kill(own.pid, signal.SIGCONT)
