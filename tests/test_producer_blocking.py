"""How long a send() may block, and that it never leaves a record no one will send: a
one-broker cluster whose broker (or gateway) is stopped to fill the producer's buffer."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

import tidelog
from tests.support.cluster import GatewayProcess, TestCluster, running_cluster, wait_for
from tidelog.errors import InvalidReplicationFactorError, RequestTimedOutError, TidelogError

MAX_BLOCK_MS = 3000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    with running_cluster(tmp_path_factory.mktemp("producer-blocking"), brokers=1) as c:
        yield c


@pytest.fixture(scope="module")
def gateway(cluster: TestCluster) -> GatewayProcess:
    return cluster.start_gateway()


def test_send_blocks_at_most_max_block_ms_in_all(
    cluster: TestCluster, gateway: GatewayProcess
) -> None:
    """Kafka's max.block.ms bounds the metadata wait and the wait for buffer room
    together; each had a whole one, and send() blocked nearly twice as long (found by an
    audit)."""
    cluster.create_topic("block-a", 1, 1)
    cluster.create_topic("block-b", 1, 1)
    broker, gw = cluster.brokers[0], gateway
    producer = tidelog.Producer(
        gateway.address,
        buffer_bytes=1024 * 1024,
        max_block_ms=MAX_BLOCK_MS,
        request_timeout_ms=1000,
        linger_ms=0,
    )
    stopped = []
    try:
        producer.partitions_for("block-a")
        # The buffer fills with records that cannot be written (their broker is stopped).
        os.kill(broker.proc.pid, signal.SIGSTOP)
        stopped.append(broker)
        for _ in range(10):
            producer.send("block-a", b"a" * 100_000, partition=0)
        # The gateway stops too: the first send to topic b waits for its partition count,
        # which comes when the gateway goes on, 80% of max_block_ms later.
        os.kill(gw.proc.pid, signal.SIGSTOP)
        stopped.append(gw)
        resume = threading.Timer(
            MAX_BLOCK_MS / 1000 * 0.8, lambda: os.kill(gw.proc.pid, signal.SIGCONT)
        )
        resume.start()
        started = time.monotonic()
        with pytest.raises(RequestTimedOutError):
            producer.send("block-b", b"b" * 100_000, partition=0)
        blocked_s = time.monotonic() - started
        resume.join()
    finally:
        for process in stopped:
            os.kill(process.proc.pid, signal.SIGCONT)
        producer.close(timeout_s=0)
    assert blocked_s < MAX_BLOCK_MS / 1000 + 0.5, (
        f"send() blocked {blocked_s:.1f} s with max_block_ms={MAX_BLOCK_MS}"
    )


def test_a_send_waiting_for_room_when_the_sender_fails_does_not_hang(
    cluster: TestCluster, gateway: GatewayProcess
) -> None:
    """A send() waiting for buffer room when the sender thread failed took the room the
    failure freed and queued its record for no sender: its future never completed, and
    flush() waited for ever (found by an audit). The sender's failure is injected
    (``_expire`` raises once): no real one (MemoryError, no thread left) can be caused on
    demand."""
    topic = "broken-wait"
    wait_for(lambda: _created(gateway, topic), 30, "the topic created")
    broker = cluster.brokers[0]
    producer = tidelog.Producer(
        gateway.address, buffer_bytes=1024 * 1024, linger_ms=0, max_block_ms=20_000
    )
    producer.partitions_for(topic)
    waiting: list[Future[Any] | BaseException] = []
    os.kill(broker.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(10):
            producer.send(topic, b"a" * 100_000, partition=0)

        def blocked_send() -> None:
            try:
                waiting.append(producer.send(topic, b"b" * 100_000, partition=0))
            except BaseException as exc:
                waiting.append(exc)

        sender = threading.Thread(target=blocked_send)
        sender.start()
        time.sleep(0.5)  # waiting for room
        assert not waiting

        original = producer._expire

        def fail_once(now: float) -> Any:
            producer._expire = original  # type: ignore[method-assign]
            raise MemoryError("injected: the sender thread fails")

        producer._expire = fail_once  # type: ignore[method-assign]
        with producer._lock:
            producer._lock.notify_all()
        sender.join(10)
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
    (outcome,) = waiting
    if isinstance(outcome, TidelogError):
        return  # raised at the call: fine
    assert isinstance(outcome, Future)
    try:
        outcome.exception(timeout=5)
    except TimeoutError:
        pytest.fail("send() returned a future that never completes after the sender failed")
    finally:
        with contextlib.suppress(RequestTimedOutError):
            producer.flush(timeout_s=2)
        producer.close(timeout_s=0)


def test_a_callback_raising_system_exit_does_not_hang_the_producer(
    cluster: TestCluster, gateway: GatewayProcess
) -> None:
    """concurrent.futures catches a callback's Exception but not SystemExit: a sys.exit()
    in a done-callback killed the thread completing the producer's sends, and every later
    send and flush() hung (found by an audit)."""
    topic = "callback-exit"
    wait_for(lambda: _created(gateway, topic), 30, "the topic created")
    producer = tidelog.Producer(gateway.address, linger_ms=100, request_timeout_ms=2000)
    try:
        first = producer.send(topic, b"first", partition=0)
        first.add_done_callback(lambda _: sys.exit(1))
        first.result(30)
        later = producer.send(topic, b"later", partition=0)
        producer.flush(timeout_s=10)
        assert later.result(1).offset == 1
    finally:
        producer.close(timeout_s=1)


def _created(gateway: GatewayProcess, topic: str) -> bool | None:
    # (A test before may have stopped the broker past its session: it may be registering.)
    with contextlib.suppress(InvalidReplicationFactorError):
        tidelog.Admin(gateway.address).create_topic(topic, partitions=1, replication_factor=1)
        return True
    return None
