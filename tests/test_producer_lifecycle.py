"""The clients' lifecycle: a Producer (or Admin) made before ``os.fork()`` refuses calls in
the child at once instead of hanging, ``Producer.close(timeout_s)`` keeps its timeout
(Kafka's ``close(Duration)``: what is left then fails at once), a record queued past its
``delivery_timeout_ms`` fails without being sent, and client-only errors have codes of
their own. Real etcd, storage nodes, a controller and a gateway as processes; a
black-holed gateway is a TCP proxy in the test that stops forwarding, a stopped one a
process sent SIGSTOP."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from typing import Any

import pytest

import tidelog
from tests.support.cluster import GatewayProcess, TestCluster, poll_records, wait_for
from tidelog.errors import (
    ClientErrorCode,
    ConcurrentAccessError,
    ConfigError,
    ErrorCode,
    InvalidReplicationFactorError,
    MessageTooLargeError,
    RequestTimedOutError,
    TidelogError,
    UnknownTopicOrPartitionError,
    WakeupError,
    error_for_code,
)
from tidelog.records import BATCH_OVERHEAD_BYTES, RECORD_OVERHEAD_BYTES

CHILD_ALARM_S = 10
"""A forked child that has not reported by then is killed (SIGALRM): it hung."""


class _BlackHoleProxy:
    """A TCP forwarder to ``target`` that can turn into a black hole: connections stay
    open, nothing more is forwarded either way (a hung gateway, a black-holed network)."""

    def __init__(self, target: str, port: int = 0) -> None:
        host, target_port = target.rsplit(":", 1)
        self._target = (host, int(target_port))
        self._holed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._server = socket.create_server(("127.0.0.1", port))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self._target)
            self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if not self._holed.is_set():
                    sink.sendall(data)
        except OSError:
            pass

    def black_hole(self) -> None:
        self._holed.set()

    def close(self) -> None:
        self._server.close()
        for s in self._sockets:
            s.close()


@pytest.fixture
def proxy(gateway: GatewayProcess) -> Iterator[_BlackHoleProxy]:
    p = _BlackHoleProxy(gateway.address)
    try:
        yield p
    finally:
        p.close()


def _create(admin: tidelog.Admin, topic: str, partitions: int, replication_factor: int) -> None:
    def create() -> bool | None:
        try:
            admin.create_topic(topic, partitions=partitions, replication_factor=replication_factor)
        except InvalidReplicationFactorError:
            return None  # a broker the last test stopped is still registering again
        return True

    wait_for(create, 30, f"live brokers to create {topic}")


def _in_child(body: Callable[[], str]) -> str:
    """Run ``body`` in a child made by os.fork(); returns what it returned (or the name
    of what it raised). The child always ends with os._exit, and is killed after
    CHILD_ALARM_S: a hang reads "hung"."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        status = 1
        try:
            os.close(read_end)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not the parent's handler
            signal.alarm(CHILD_ALARM_S)
            try:
                outcome = body()
            except BaseException as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            os.write(write_end, outcome.encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    try:
        chunks = []
        while chunk := os.read(read_end, 65536):
            chunks.append(chunk)
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"hung (killed by signal {os.WTERMSIG(status)})"
    return b"".join(chunks).decode()


def _timed(call: Callable[[], Any]) -> Callable[[], str]:
    """``call`` for a child: what it returned or raised, and how long it took."""

    def run() -> str:
        start = time.monotonic()
        try:
            result = f"returned {call()!r}"
        except BaseException as exc:
            result = f"{type(exc).__name__}: {exc}"
        return f"{result} after {time.monotonic() - start:.1f} s"

    return run


def test_a_producer_made_before_fork_refuses_calls_in_the_child_at_once(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Found by an audit: a Producer used after os.fork() (a multiprocessing or Spark
    worker) queued the child's records for a sender thread that exists only in the
    parent: send's future never completed and flush() never returned. Every call in the
    child now raises ConfigError at once; close() there returns without touching the
    parent's threads, and the parent's producer works on."""
    _create(admin, "forked", 1, 1)
    producer = tidelog.Producer(gateway.address, linger_ms=0)
    try:
        assert producer.send("forked", b"parent", partition=0).result(30).offset == 0
        calls: dict[str, Callable[[], Any]] = {
            "send": lambda: producer.send("forked", b"child", partition=0).result(5),
            "send_batch": lambda: producer.send_batch("forked", [b"c"], partition=0).result(5),
            "flush": producer.flush,
            "partitions_for": lambda: producer.partitions_for("forked"),
        }
        for name, call in calls.items():
            outcome = _in_child(_timed(call))
            assert outcome.startswith(
                f"ConfigError: INVALID_REQUEST: this Producer was created in process {os.getpid()}"
            ), (name, outcome)
            assert "after os.fork()" in outcome and outcome.endswith("after 0.0 s"), outcome
        assert _in_child(_timed(producer.close)) == "returned None after 0.0 s"
        # The parent's producer is untouched by all of that.
        assert producer.send("forked", b"parent again", partition=0).result(30).offset == 1
    finally:
        producer.close(timeout_s=30)
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        assert consumer.end_offsets([("forked", 0)]) == {("forked", 0): 2}


def test_an_admin_made_before_fork_refuses_calls_in_the_child(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """An Admin made before os.fork() used the parent's channel in the child: a call
    there hung for good whenever another thread of the parent was in a call at the fork
    (found with a thread calling list_topics in a loop). It now raises ConfigError at
    once, whatever the parent did; an Admin made in the child works."""
    _create(admin, "forked-admin", 1, 1)
    made_before = tidelog.Admin(gateway.address)
    assert "forked-admin" in made_before.list_topics()
    outcome = _in_child(_timed(made_before.list_topics))
    assert outcome.startswith("ConfigError: INVALID_REQUEST: this Admin was created"), outcome
    assert outcome.endswith("after 0.0 s"), outcome
    assert made_before.gateway == gateway.address  # not a call: fine anywhere
    assert "forked-admin" in made_before.list_topics()  # still fine in the parent


def _closed_errors(futures: list[Future[Any]]) -> list[str]:
    """Each future's error message; fails unless every one is done and failed as a
    forced close fails them."""
    assert all(f.done() for f in futures), [f.done() for f in futures]
    errors = [f.exception(0) for f in futures]
    assert all(isinstance(e, RequestTimedOutError) for e in errors), errors
    messages = [str(e) for e in errors]
    assert all("the producer was closed before" in m for m in messages), messages
    return messages


def test_close_with_a_black_holed_gateway_keeps_its_timeout(
    proxy: _BlackHoleProxy, admin: tidelog.Admin
) -> None:
    """Found by an audit: close(timeout_s=2) with a black-holed gateway raised after
    12 s (a hard-coded 10 s join of the sender), with no future done and the sender still
    running: the futures completed 47 s later, at the delivery timeout. As Kafka's
    close(Duration), close now waits timeout_s, then fails what is left at once (records
    in flight "may have been written", queued ones were never sent) and returns without
    raising; nothing of the producer runs on to complete a future later."""
    _create(admin, "black-hole", 2, 1)
    producer = tidelog.Producer(
        proxy.address, linger_ms=0, delivery_timeout_ms=60_000, request_timeout_ms=20_000
    )
    assert producer.send("black-hole", b"warm", partition=0).result(30).offset == 0
    proxy.black_hole()
    in_flight = [producer.send("black-hole", b"in flight", partition=0)]
    time.sleep(0.3)  # sent: the partition's one request in flight through a gateway
    queued = [producer.send("black-hole", b"queued %d" % i, partition=i % 2) for i in range(4)]
    start = time.monotonic()
    producer.close(timeout_s=1)
    took = time.monotonic() - start
    assert 1 <= took < 3, took
    (sent,) = _closed_errors(in_flight)
    assert "it was sent, and may have been written" in sent
    assert any("it was never sent" in m for m in _closed_errors(queued))
    assert not producer._sender.is_alive()
    with pytest.raises(ConfigError, match="closed"):
        producer.send("black-hole", b"after", partition=0)
    producer.close(timeout_s=1)  # a second close: nothing left, returns at once
    assert time.monotonic() - start < 4


def _unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_first_send_waits_for_an_unreachable_gateway_up_to_max_block_ms(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A send() whose topic's partition count is not known yet looks it up on the
    caller's thread; with the gateway unreachable (a gateway restarting in a rollout, a
    producer started before it) it raised NetworkError at once, where Kafka's send waits
    up to max.block.ms for the metadata. It now retries until max_block_ms, then raises
    RequestTimedOutError naming it; an unknown topic still raises at once (tidelog
    creates no topic on first use)."""
    _create(admin, "late-gateway", 1, 1)
    port = _unused_port()
    with tidelog.Producer(f"127.0.0.1:{port}", max_block_ms=400) as producer:
        start = time.monotonic()
        with pytest.raises(RequestTimedOutError, match="max_block_ms"):
            producer.send("late-gateway", b"v")
        assert 0.35 <= time.monotonic() - start < 5
    with tidelog.Producer(f"127.0.0.1:{port}", max_block_ms=30_000) as producer:
        proxy: list[_BlackHoleProxy] = []
        opener = threading.Timer(1.0, lambda: proxy.append(_BlackHoleProxy(gateway.address, port)))
        opener.start()
        try:
            assert producer.send("late-gateway", b"v").result(30).offset == 0
            with pytest.raises(UnknownTopicOrPartitionError):
                producer.send("no-such-topic", b"v")
        finally:
            opener.join()
            for p in proxy:
                p.close()


def test_a_normal_close_delivers_everything_queued(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """The other side of the timeout above (a guard for it: the old close did this too):
    a close whose records can be delivered within timeout_s sends them all, without
    waiting for linger_ms, and every future succeeds."""
    _create(admin, "normal-close", 2, 1)
    producer = tidelog.Producer(gateway.address, linger_ms=60_000)
    singles = [producer.send("normal-close", b"one %d" % i, partition=i % 2) for i in range(10)]
    batch = producer.send_batch("normal-close", [b"many"] * 1000, partition=1)
    start = time.monotonic()
    producer.close(timeout_s=30)
    assert time.monotonic() - start < 10  # linger_ms does not hold a close
    assert all(f.done() for f in [*singles, batch])
    assert sorted(f.result(0).offset for f in singles) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert list(batch.result(0).offsets) == list(range(5, 1005))
    assert not producer._sender.is_alive()


@pytest.mark.parametrize("per_partition", [1, 5], ids=["unary", "pipe"])
def test_direct_close_with_a_stopped_leader_keeps_its_timeout(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin, per_partition: int
) -> None:
    """Direct mode, with the partition's leader stopped (SIGSTOP) so that appends go
    unanswered: a unary append on the appenders' pool (one request in flight per
    partition) or the requests on the leader's pipe. close(timeout_s=1) returns in time
    with every future failed; the old close raised after its flush timed out and left the
    sender retrying until the delivery timeout."""
    topic = f"direct-close-{per_partition}"
    _create(admin, topic, 1, 1)
    producer = tidelog.Producer(
        gateway.address,
        direct=True,
        linger_ms=0,
        batch_bytes=200,  # a batch per record: several requests
        max_in_flight_requests_per_partition=per_partition,
        delivery_timeout_ms=60_000,
        request_timeout_ms=20_000,
    )
    assert producer.send(topic, b"warm", partition=0).result(30).offset == 0
    leader = cluster.brokers[admin.describe_topic(topic).partitions[0].leader]
    os.kill(leader.pid, signal.SIGSTOP)
    try:
        futures = [producer.send(topic, b"v" * 100, partition=0) for _ in range(20)]
        time.sleep(0.3)
        start = time.monotonic()
        producer.close(timeout_s=1)
        took = time.monotonic() - start
    finally:
        os.kill(leader.pid, signal.SIGCONT)
    assert 1 <= took < 3, took
    messages = _closed_errors(futures)
    assert any("may have been written" in m for m in messages), messages
    assert any("never sent" in m for m in messages), messages
    assert not producer._sender.is_alive()


@pytest.mark.parametrize(
    ("idempotent", "value_bytes", "count"),
    [(True, 1000, 30), (False, 1024 * 1024, 12)],
    ids=["idempotent-1KB-x30", "acks1-1MB-x12"],
)
def test_queued_batches_fail_by_their_delivery_timeout_without_being_sent(
    gateway: GatewayProcess, admin: tidelog.Admin, idempotent: bool, value_bytes: int, count: int
) -> None:
    """Found by an audit: delivery_timeout_ms was only checked when a request failed, so
    a batch queued behind its partition's request in flight was sent (expired already)
    once that one had failed, and failed one request timeout later: with the gateway
    stopped, 30 one-record batches of a partition failed ~6 request timeouts past their
    delivery timeout (idempotent: five batches per request at most), and twelve 1 MiB
    batches without idempotence (4 MiB of a partition per request) three. As Kafka's
    accumulator does, the sender now fails a queued batch past its delivery timeout
    without sending it; the one in flight fails as its request does, request_timeout_ms
    and the hung-stream grace after it was sent at most."""
    topic = f"delivery-timeout-{int(idempotent)}"
    _create(admin, topic, 1, 1)
    value = b"v" * value_bytes
    producer = tidelog.Producer(
        gateway.address,
        acks="all" if idempotent else "1",
        enable_idempotence=idempotent,
        linger_ms=0,
        batch_bytes=BATCH_OVERHEAD_BYTES + RECORD_OVERHEAD_BYTES + len(value),  # one record
        request_timeout_ms=1_000,
        delivery_timeout_ms=3_000,
    )
    failed_at: list[tuple[float, str]] = []  # (s after the sends, error) as futures fail
    try:
        producer.send(topic, b"warm", partition=0).result(30)
        os.kill(gateway.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            futures = [producer.send(topic, value, partition=0) for _ in range(count)]
            for future in futures:
                future.add_done_callback(
                    lambda f: failed_at.append((time.monotonic() - start, str(f.exception())))
                )
            wait(futures, timeout=60)
        finally:
            os.kill(gateway.pid, signal.SIGCONT)
    finally:
        producer.close(timeout_s=30)
    assert all(isinstance(f.exception(0), TidelogError) for f in futures)
    # In flight: the request timeout and the hung-stream grace (1 s each) past the delivery
    # timeout at most; slack for a busy machine.
    assert max(t for t, _ in failed_at) < 3.0 + 1.0 + 1.0 + 1.5, failed_at
    # Queued: expired at 3 s (the sender wakes for the first deadline), never sent.
    never_sent = [t for t, error in failed_at if "it was never sent" in error]
    assert len(never_sent) >= count // 2, failed_at  # the rest went in a request
    assert max(never_sent) < 3.0 + 1.5, failed_at


def test_a_batch_expired_in_the_queue_leaves_no_sequence_gap(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """The idempotent side of the expiry above: a batch gets its sequence number when it
    is first sent, so one that expired in the queue took none, and the partition's next
    batch follows the one in flight without a gap (refused as OUT_OF_ORDER_SEQUENCE, it
    would have failed for good). The gateway is stopped for longer than the delivery
    timeout but not the request timeout: the request in flight is answered once it runs
    again, the queued records have failed meanwhile, and the next record lands right
    after the one in flight, under the same producer id."""
    topic = "delivery-timeout-no-gap"
    _create(admin, topic, 1, 1)
    producer = tidelog.Producer(
        gateway.address, linger_ms=0, request_timeout_ms=20_000, delivery_timeout_ms=1_500
    )
    try:
        assert producer.send(topic, b"warm", partition=0).result(30).offset == 0
        producer_id = producer._producer_id
        os.kill(gateway.pid, signal.SIGSTOP)
        try:
            in_flight = producer.send(topic, b"in flight", partition=0)
            time.sleep(0.3)  # sent: the partition's one request in flight through a gateway
            queued = [producer.send(topic, b"queued %d" % i, partition=0) for i in range(3)]
            for future in queued:
                with pytest.raises(RequestTimedOutError, match="it was never sent"):
                    future.result(10)
            assert not in_flight.done()
        finally:
            os.kill(gateway.pid, signal.SIGCONT)
        assert in_flight.result(30).offset == 1
        assert producer.send(topic, b"next", partition=0).result(30).offset == 2
        assert producer._producer_id == producer_id  # nothing failed after being sent
    finally:
        producer.close(timeout_s=30)


def test_wakeup_error_has_a_client_code_of_its_own() -> None:
    """WakeupError inherited UNKNOWN_SERVER_ERROR (-1) and read "UNKNOWN_SERVER_ERROR: the
    consumer was woken up". It has a client-only code now, one no wire code can be (the
    wire's are in the protobuf enum, pinned by tests/test_errors.py)."""
    error = WakeupError("the consumer was woken up (Consumer.wakeup())")
    assert error.code is ClientErrorCode.WAKEUP
    assert int(error.code) == -1000  # stable: never renumbered, never reused
    assert str(error) == "WAKEUP: the consumer was woken up (Consumer.wakeup())"
    assert not error.retriable
    assert int(error.code) not in {int(c) for c in ErrorCode}
    # Never on the wire: a server's -1000 would be an unknown code, not a wakeup.
    assert not isinstance(error_for_code(-1000), WakeupError)
    # The consumer's concurrent-use error: a ConfigError with a code of its own.
    concurrent = ConcurrentAccessError("not safe for multi-threaded access")
    assert isinstance(concurrent, ConfigError)
    assert concurrent.code is ClientErrorCode.CONCURRENT_ACCESS and int(concurrent.code) == -1001
    assert str(concurrent) == "CONCURRENT_ACCESS: not safe for multi-threaded access"
    assert not isinstance(error_for_code(-1001), ConcurrentAccessError)


@pytest.mark.parametrize("direct", [False, True])
def test_a_batch_over_max_message_bytes_is_split_and_sent_again(
    gateway: GatewayProcess, admin: tidelog.Admin, direct: bool
) -> None:
    """Records that each fit a topic's max.message.bytes but not together (its limit
    below batch_bytes) all failed MESSAGE_TOO_LARGE with their batch. As Kafka's sender
    does, a refused batch of several records is split in halves and sent again (under a
    new producer id: its sequences were spent), until each fits: every record written
    once, in order; one record over the limit alone still fails. Found by an audit."""
    topic = f"split-{'direct' if direct else 'gateway'}"
    _create(admin, topic, 1, 1)
    admin.alter_topic_config(topic, {"max.message.bytes": "4096"})
    with tidelog.Producer(gateway.address, direct=direct, linger_ms=200) as producer:
        futures = [producer.send(topic, b"%03d" % i + b"v" * 500, partition=0) for i in range(20)]
        offsets = [f.result(30).offset for f in futures]
        grouped = producer.send_batch(topic, [b"w" * 500] * 20, partition=0).result(30)
        with pytest.raises(MessageTooLargeError):
            producer.send(topic, b"x" * 5000, partition=0).result(30)
    assert offsets == list(range(20))
    assert list(grouped.offsets) == list(range(20, 40))
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.assign([(topic, 0)])
        values = [value for _, value in poll_records(consumer, 40)]
    assert values[:20] == [b"%03d" % i + b"v" * 500 for i in range(20)]


@pytest.mark.parametrize("direct", [False, True])
def test_a_split_is_not_a_retry(
    gateway: GatewayProcess, admin: tidelog.Admin, direct: bool
) -> None:
    """Kafka splits a batch refused as too large "regardless of retries": with retries=0
    every record of such a batch failed, though each fits the topic's max.message.bytes
    (found by an audit)."""
    topic = f"split-no-retries-{'direct' if direct else 'gateway'}"
    _create(admin, topic, 1, 1)
    admin.alter_topic_config(topic, {"max.message.bytes": "4096"})
    with tidelog.Producer(
        gateway.address, direct=direct, linger_ms=200, retries=0, enable_idempotence=False, acks=1
    ) as producer:
        futures = [producer.send(topic, b"%03d" % i + b"v" * 500, partition=0) for i in range(20)]
        errors = [f.exception(30) for f in futures]
    assert [e for e in errors if e is not None] == []


def test_a_negative_timestamp_is_refused_at_the_send(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Kafka's rule: a record's timestamp is non-negative. Taken, -2**63 and now in one
    batch overflowed the encoder's int64 deltas in the sender: every batch of the request
    failed, other partitions' too, and their spent sequences made the next batch
    OUT_OF_ORDER_SEQUENCE (found by an audit)."""
    _create(admin, "negative-ts", 2, 1)
    with tidelog.Producer(gateway.address, linger_ms=100) as producer:
        innocent = producer.send("negative-ts", b"v", partition=0)
        with pytest.raises(ConfigError, match="non-negative"):
            producer.send("negative-ts", b"old", partition=1, timestamp_ms=-(2**63) + 5)
        with pytest.raises(ConfigError, match="non-negative"):
            producer.send_batch("negative-ts", [b"old"], partition=1, timestamp_ms=-1)
        assert innocent.result(30).offset == 0
        assert producer.send("negative-ts", b"w", partition=0).result(30).offset == 1


def test_keyed_send_batch_spreads_its_none_keys_and_takes_bytearray_keys(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A keyed send_batch's None-keyed records went to the sticky partition without
    counting towards moving it on (KIP-794): every one of them, in every call, landed on
    one partition. bytearray keys, taken by send(), raised TypeError (unhashable) in
    send_batch. Found by an audit."""
    _create(admin, "none-keys", 4, 1)
    with tidelog.Producer(gateway.address, batch_bytes=1024, linger_ms=0) as producer:
        spread: set[int] = set()
        for _ in range(30):
            meta = producer.send_batch("none-keys", [b"v" * 100] * 20, keys=[None] * 20)
            spread.update(meta.result(30).partitions)
        single = producer.send("none-keys", b"v", key=bytearray(b"k")).result(30)
        grouped = producer.send_batch("none-keys", [b"v"], keys=[bytearray(b"k")]).result(30)
    assert len(spread) > 1, spread
    assert grouped.partitions[0] == single.partition
