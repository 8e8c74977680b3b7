"""A producer's requests on a stream whose gateway refuses something of the stream as a
whole (a pipeline deeper than its in-flight limit, one request over its message limit):
the other requests in flight are neither failed for good nor split (found by an audit:
records written were reported failed, or written twice). A one-broker cluster."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import wait

import pytest

import tidelog
from tests.support.cluster import TestCluster, running_cluster, wait_for
from tidelog.client import GatewayConnection

PARTITIONS = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    with running_cluster(tmp_path_factory.mktemp("stream-refusals"), brokers=1) as c:
        yield c


def test_requests_beyond_the_gateways_stream_limit_are_not_failed_for_good(
    cluster: TestCluster,
) -> None:
    """A producer whose pipeline is deeper than the gateway's --max-in-flight-per-stream
    (2 here; the producer's default is 16): the gateway ended the whole stream with
    INVALID_REQUEST, and the producer failed every request in flight on it for good,
    records the gateway went on writing among them. The gateway holds the stream back
    now, and nothing fails (found by an audit)."""
    gateway = cluster.start_gateway(extra_args=["--max-in-flight-per-stream", "2"])
    topic = "stream-limit"
    cluster.create_topic(topic, PARTITIONS, 1)
    producer = tidelog.Producer(gateway.address, linger_ms=0, batch_bytes=16 * 1024)
    futures = []
    stop = time.monotonic() + 2.0
    value = b"x" * 2000
    try:
        # Several threads keep every partition busy: a request per sender pass, several
        # unanswered at once.
        def flood(base: int) -> None:
            i = base
            while time.monotonic() < stop:
                futures.append(producer.send(topic, value, partition=i % PARTITIONS))
                i += 1

        threads = [threading.Thread(target=flood, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        producer.flush(timeout_s=60)
    finally:
        producer.close(timeout_s=10)
    wait(futures, timeout=5)
    failed = [f.exception() for f in futures if f.exception() is not None]
    bounds = GatewayConnection.get(gateway.address).bounds([(topic, p) for p in range(PARTITIONS)])
    written = sum(b.latest for b in bounds.values())
    acked = len(futures) - len(failed)
    print(f"sent {len(futures)} acked {acked} failed {len(failed)} written {written}")
    assert not failed, (
        f"{len(failed)} of {len(futures)} records failed for good "
        f"({sorted({type(e).__name__ for e in failed})}: {failed[0]}); "
        f"{written - acked} of them were written nevertheless"
    )


def test_an_oversized_request_does_not_split_or_fail_the_others_in_flight(
    cluster: TestCluster,
) -> None:
    """One request over the gateway's gRPC message limit (max(--max-request-bytes,
    --max-fetch-bytes) + 4 MiB: 5 MiB here) ends the whole stream with RESOURCE_EXHAUSTED,
    which the producer took for RECORD_LIST_TOO_LARGE of every request in flight: an
    innocent batch of two records was split and written twice, a record of one byte
    failed for good though written. Only the oversized request takes that error now; the
    others are sent again (found by an audit). Deterministic: the broker is stopped while
    the innocent requests are in flight."""
    gateway = cluster.start_gateway(
        extra_args=["--max-request-bytes", "1048576", "--max-fetch-bytes", "1048576"]
    )
    topic = "oversized-request"
    cluster.create_topic(topic, 3, 1)
    broker = cluster.brokers[0]
    producer = tidelog.Producer(gateway.address, linger_ms=0, batch_bytes=8 * 1024 * 1024)
    try:
        producer.send(topic, b"warm-up", partition=0).result(30)
        os.kill(broker.proc.pid, signal.SIGSTOP)
        try:
            pair = producer.send_batch(topic, [b"a", b"b"], partition=0)  # one batch
            single = producer.send(topic, b"c", partition=2)
            time.sleep(0.5)  # both are in flight, the gateway waiting for the broker
            big = producer.send(topic, b"x" * (6 * 1024 * 1024), partition=1)
            time.sleep(2.0)
        finally:
            os.kill(broker.proc.pid, signal.SIGCONT)
        pair_error = pair.exception(60)
        single_error = single.exception(60)
        big.exception(60)
    finally:
        producer.close(timeout_s=10)
    conn = GatewayConnection.get(gateway.address)

    def settled() -> dict | None:
        bounds = conn.bounds([(topic, 0), (topic, 2)])
        return bounds if bounds[(topic, 0)].latest >= 3 else None

    bounds = wait_for(settled, 15, "the records to be written")
    time.sleep(1.0)
    bounds = conn.bounds([(topic, 0), (topic, 2)])
    p0, p2 = bounds[(topic, 0)].latest, bounds[(topic, 2)].latest
    print(f"pair: {pair_error!r}\nsingle: {single_error!r}\np0 {p0} p2 {p2}")
    assert single_error is None, f"an innocent 1-byte record failed: {single_error} (written: {p2})"
    assert pair_error is None, f"an innocent batch failed: {pair_error}"
    assert p0 == 3, f"partition 0 holds {p0} records: 1 + 2 sent (written twice)"
