"""tidelog workloads for the peer comparison, through one gateway with the Python SDK.

Modelled on Kafka's 2014 benchmark ("2 million writes per second on three cheap
machines"): 100-byte records, 6 partitions, one producer - without replication, with
RF=3 acks=1, with RF=3 acks=all -, one consumer, producer and consumer together, and
end-to-end latency at a fixed moderate rate. And an OpenMessaging-style case: 1 topic,
100 partitions, 1 KiB records, the highest rate with acks=all and RF=3.

The producer uses ``send_batch`` (the SDK's vectorized path) with an Arrow column of
values and several calls in flight, as Kafka's benchmark used its producer's batching;
latency percentiles are of whole ``send_batch`` calls (chunk) for the throughput cases,
and per record for the latency case (consume time minus the record's create timestamp,
same clock).
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tidelog.admin import Admin
from tidelog.consumer import Consumer
from tidelog.producer import BatchMetadata, Producer

Progress = Callable[[int], None]


@dataclass
class Result:
    name: str
    records: int
    record_bytes: int
    seconds: float
    latencies_ms: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def records_s(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0

    @property
    def mb_s(self) -> float:
        return self.records * self.record_bytes / self.seconds / 1e6 if self.seconds else 0.0

    def percentile_ms(self, fraction: float) -> float | None:
        if not self.latencies_ms:
            return None
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def produce(
    gateway: str,
    topic: str,
    *,
    records: int,
    size: int,
    acks: str,
    chunk: int = 20_000,
    in_flight: int = 8,
    progress: Progress | None = None,
    arrow: bool = True,
) -> Result:
    values: Any = [b"x" * size] * chunk
    if arrow:
        import pyarrow as pa

        # An Arrow column, as a data pipeline holds its records: encoded without Python
        # work per record.
        values = pa.array(values, pa.binary())
    latencies: list[float] = []
    with Producer(gateway, acks=acks, enable_idempotence=acks == "all", linger_ms=2) as producer:
        pending: list[tuple[float, Future[BatchMetadata]]] = []
        started = time.perf_counter()
        sent = 0
        while sent < records:
            n = min(chunk, records - sent)
            part = values if n == chunk else values[:n]
            pending.append((time.perf_counter(), producer.send_batch(topic, part)))
            sent += n
            if len(pending) >= in_flight:
                t0, future = pending.pop(0)
                future.result(120)
                latencies.append((time.perf_counter() - t0) * 1000)
                if progress:
                    progress(chunk)
        for t0, future in pending:
            future.result(120)
            latencies.append((time.perf_counter() - t0) * 1000)
            if progress:
                progress(chunk)
        elapsed = time.perf_counter() - started
    return Result(f"produce acks={acks}", records, size, elapsed, latencies, "per send_batch")


def consume(
    gateway: str,
    topic: str,
    *,
    records: int,
    size: int,
    progress: Progress | None = None,
    arrow: bool = False,
) -> Result:
    """Read ``records`` from the beginning: with ``poll`` (a Python object per record) or,
    with ``arrow``, ``poll_arrow`` (Arrow tables, no Python per record)."""
    with Consumer(gateway, auto_offset_reset="earliest", max_partition_fetch_bytes=8 << 20) as c:
        c.subscribe([topic])
        # Timed from the first poll: it resolves positions and its fetch brings the
        # first megabytes, which count.
        started = time.perf_counter()
        seen = 0
        while seen < records:
            if arrow:
                got = c.poll_arrow(max_records=1_000_000, timeout_ms=10_000).num_rows
            else:
                got = len(c.poll(max_records=1_000_000, timeout_ms=10_000))
            if not got:
                break
            seen += got
            if progress:
                progress(got)
        elapsed = time.perf_counter() - started
    return Result("consume (poll_arrow)" if arrow else "consume (poll)", seen, size, elapsed)


def produce_and_consume(
    gateway: str, topic: str, *, records: int, size: int, acks: str
) -> tuple[Result, Result]:
    """A producer and a consumer on the same topic at once (each in its own thread)."""
    consumed: list[Result] = []
    start_gate = threading.Event()

    def reader() -> None:
        with Consumer(gateway, auto_offset_reset="latest") as c:
            c.subscribe([topic])
            c.poll(max_records=1, timeout_ms=100)  # positions at the current end
            start_gate.set()
            seen = 0
            started = time.perf_counter()
            idle_since = time.monotonic()
            while seen < records and time.monotonic() - idle_since < 10:
                batch = c.poll(max_records=1_000_000, timeout_ms=500)
                if batch:
                    seen += len(batch)
                    idle_since = time.monotonic()
            consumed.append(
                Result("consume (concurrent)", seen, size, time.perf_counter() - started)
            )

    thread = threading.Thread(target=reader)
    thread.start()
    start_gate.wait(30)
    produced = produce(gateway, topic, records=records, size=size, acks=acks)
    thread.join()
    return produced, consumed[0]


def end_to_end_latency(
    gateway: str,
    topic: str,
    *,
    rate_per_s: int,
    seconds: float,
    size: int,
    ack_latencies_ms: list[float] | None = None,
    warmup_s: float = 1.0,
    freeze_gc: bool = True,
) -> Result:
    """Records sent one by one at ``rate_per_s`` (acks=all), read by a concurrent
    consumer; latency = consume time - the record's create timestamp. With
    ``ack_latencies_ms``, each send's time until its acknowledgement is appended there.

    The first ``warmup_s`` of sending at the rate is not measured: the producer's first
    requests wait for its producer id and the partitions' metadata while records pile up
    behind them, a one-off backlog of up to half a second at 20,000/s that is not the
    steady-state latency this case is about.

    With ``freeze_gc`` the objects that exist before sending starts are moved out of the
    garbage collector's reach (``gc.freeze``), as latency-minded Python services do after
    start-up: every ``send`` makes a Future, and at 20,000 sends/s this process's full
    collections (each scanning everything the benchmark process holds, ~16 ms) came about
    twice a second and set the p99 by themselves (BENCHMARKS.md)."""
    latencies: list[float] = []
    done = threading.Event()
    ready = threading.Event()
    measured_from_ms = [float("inf")]

    def reader() -> None:
        with Consumer(gateway, auto_offset_reset="latest", fetch_max_wait_ms=100) as c:
            c.subscribe([topic])
            c.poll(max_records=1, timeout_ms=100)
            ready.set()
            while not done.is_set() or len(latencies) < expected[0]:
                for record in c.poll(max_records=100_000, timeout_ms=200):
                    if record.timestamp_ms >= measured_from_ms[0]:
                        latencies.append(time.time() * 1000 - record.timestamp_ms)
                if done.is_set() and time.monotonic() > give_up[0]:
                    return

    expected = [0]
    give_up = [float("inf")]
    thread = threading.Thread(target=reader)
    thread.start()
    ready.wait(30)
    payload = b"x" * size
    if freeze_gc:
        gc.collect()
        gc.freeze()
    try:
        with Producer(gateway, acks="all", linger_ms=0) as producer:
            interval = 1.0 / rate_per_s
            started = time.perf_counter()
            next_at = started
            sent = 0
            measuring = False
            while time.perf_counter() - started < warmup_s + seconds:
                if not measuring and time.perf_counter() - started >= warmup_s:
                    measuring = True
                    # Record timestamps are whole milliseconds: the first measured record
                    # is stamped at or after this.
                    measured_from_ms[0] = int(time.time() * 1000) + 1
                    while int(time.time() * 1000) < measured_from_ms[0]:
                        time.sleep(0.0001)
                sent_at = time.perf_counter()
                future = producer.send(topic, payload)
                if measuring:
                    if ack_latencies_ms is not None:
                        future.add_done_callback(
                            lambda _, s=sent_at: ack_latencies_ms.append(
                                (time.perf_counter() - s) * 1000
                            )
                        )
                    sent += 1
                next_at += interval
                delay = next_at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            producer.flush()
        expected[0] = sent
        give_up[0] = time.monotonic() + 10
        done.set()
        thread.join()
    finally:
        done.set()
        if freeze_gc:
            gc.unfreeze()
    return Result(
        f"end-to-end latency at {rate_per_s:,}/s", len(latencies), size, seconds, latencies
    )


def wait_replicated(gateway: str, timeout_s: float = 60.0) -> bool:
    """Wait until every partition's high watermark is its log end offset (the followers
    have caught up), so one case's replication backlog is not charged to the next.
    Returns False if that did not happen within ``timeout_s``."""
    admin = Admin(gateway)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        partitions = [p for t in admin.describe_topics() for p in t.partitions]
        if all(p.high_watermark == p.log_end_offset >= 0 for p in partitions):
            return True
        time.sleep(0.2)
    return False


def create_topic(gateway: str, name: str, partitions: int, replication_factor: int) -> None:
    Admin(gateway).create_topic(
        name,
        partitions,
        replication_factor,
        {"min.insync.replicas": str(min(2, replication_factor))},
    )


def delete_topic(gateway: str, name: str) -> None:
    Admin(gateway).delete_topic(name)
