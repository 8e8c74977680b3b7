"""tidelog workloads for the peer comparison, through one gateway with the Python SDK.

Modelled on Kafka's 2014 benchmark ("2 million writes per second on three cheap
machines"): 100-byte records, 6 partitions, one producer - without replication, with
RF=3 acks=1, with RF=3 acks=all -, one consumer, producer and consumer together, and
end-to-end latency at a fixed moderate rate. And an OpenMessaging-style case: 1 topic,
100 partitions, 1 KiB records, the highest rate with acks=all and RF=3.

The producer uses ``send_batch`` (the SDK's vectorized path) with an Arrow column of
values and several calls in flight, as Kafka's benchmark used its producer's batching;
latency percentiles are of whole ``send_batch`` calls (chunk) for the throughput cases,
and per record for the latency cases (consume time minus the record's create timestamp,
same clock): one ``send`` per record at a moderate rate, and ``send_batch`` every 5 ms at
half the maximum rate (the issue's latency target, out of reach of a ``send`` loop).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final

from bench.storage_engine import percentile
from tidelog.admin import Admin
from tidelog.consumer import Consumer
from tidelog.producer import BatchMetadata, Producer

INTERRUPTED_CLOSE_S: Final = 1.0
"""How long a producer closed by an exception (Ctrl-C) waits for what it holds."""


@contextlib.contextmanager
def producing(producer: Producer) -> Iterator[Producer]:
    """``producer``, closed when the block ends: as ``with`` does after the block ran, but
    within ``INTERRUPTED_CLOSE_S`` when an exception (Ctrl-C) ends it. A terminal's Ctrl-C
    reaches the cluster's processes as well (one process group), so a close that waits
    for what is queued waited out the delivery timeout, two minutes, before the bench
    stopped (found by an audit)."""
    try:
        yield producer
    except BaseException:
        producer.close(INTERRUPTED_CLOSE_S)
        raise
    producer.close()


Progress = Callable[[int], None]


@dataclass
class Result:
    name: str
    records: int
    record_bytes: int
    seconds: float
    latencies_ms: list[float] = field(default_factory=list)
    note: str = ""
    # From the clients' metrics (tidelog.metrics): the producer's mean record batch
    # (batch-size-avg) and the consumer's mean fetch answer (fetch-size-avg), in bytes.
    batch_bytes: float = 0.0
    fetch_bytes: float = 0.0

    @property
    def records_s(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0

    @property
    def mb_s(self) -> float:
        return self.records * self.record_bytes / self.seconds / 1e6 if self.seconds else 0.0

    def percentile_ms(self, fraction: float) -> float | None:
        """The nearest-rank percentile (``bench.storage_engine.percentile``), None when
        nothing was measured. ``ordered[int(fraction * n)]`` was one rank high whenever
        ``fraction * n`` is whole: p50 of 1..100 was 51, p99 the maximum (found by an
        audit)."""
        if not self.latencies_ms:
            return None
        return percentile(sorted(self.latencies_ms), fraction)


class _AckTimes:
    """Milliseconds from each watched call to its future's completion, taken in a done
    callback, when the future completes: not when the caller gets round to ``result()``
    after its later calls, which charged the harness's own ``send_batch`` calls to the
    cluster (found by an audit)."""

    def __init__(self) -> None:
        self.ms: list[float] = []
        self._changed = threading.Condition()

    def watch(self, sent_at: float, future: Future[Any]) -> None:
        """Time ``future`` from ``sent_at`` (``time.perf_counter()`` before the call)."""
        future.add_done_callback(lambda _: self._done(sent_at))

    def _done(self, sent_at: float) -> None:
        elapsed_ms = (time.perf_counter() - sent_at) * 1000
        with self._changed:
            self.ms.append(elapsed_ms)
            self._changed.notify_all()

    def wait(self, count: int, timeout_s: float = 10.0) -> list[float]:
        """The times, once ``count`` are in: a future's ``result()`` can return before
        its callbacks have run."""
        with self._changed:
            self._changed.wait_for(lambda: len(self.ms) >= count, timeout_s)
            return list(self.ms)


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
    direct: bool = False,
) -> Result:
    values: Any = [b"x" * size] * chunk
    if arrow:
        import pyarrow as pa

        # An Arrow column, as a data pipeline holds its records: encoded without Python
        # work per record.
        values = pa.array(values, pa.binary())
    acked = _AckTimes()  # latency per send_batch: the call to its acknowledgement
    calls = 0
    with producing(
        Producer(gateway, acks=acks, enable_idempotence=acks == "all", linger_ms=2, direct=direct)
    ) as producer:
        pending: list[Future[BatchMetadata]] = []
        started = time.perf_counter()
        sent = 0
        while sent < records:
            n = min(chunk, records - sent)
            part = values if n == chunk else values[:n]
            t0 = time.perf_counter()
            future = producer.send_batch(topic, part)
            acked.watch(t0, future)
            pending.append(future)
            calls += 1
            sent += n
            if len(pending) >= in_flight:
                pending.pop(0).result(120)
                if progress:
                    progress(chunk)
        for future in pending:
            future.result(120)
            if progress:
                progress(chunk)
        elapsed = time.perf_counter() - started
        batch_bytes = producer.metrics()["batch-size-avg"]
    return Result(
        f"produce acks={acks}",
        records,
        size,
        elapsed,
        acked.wait(calls),
        "per send_batch",
        batch_bytes=batch_bytes,
    )


def consume(
    gateway: str,
    topic: str,
    *,
    records: int,
    size: int,
    progress: Progress | None = None,
    arrow: bool = False,
    direct: bool = False,
) -> Result:
    """Read ``records`` from the beginning: with ``poll`` (a Python object per record) or,
    with ``arrow``, ``poll_arrow`` (Arrow tables, no Python per record)."""
    with Consumer(
        gateway, auto_offset_reset="earliest", max_partition_fetch_bytes=8 << 20, direct=direct
    ) as c:
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
        fetch_bytes = c.metrics()["fetch-size-avg"]
    _check_read(seen, records, "consume")
    return Result(
        "consume (poll_arrow)" if arrow else "consume (poll)",
        seen,
        size,
        elapsed,
        fetch_bytes=fetch_bytes,
    )


def _check_read(seen: int, records: int, case: str) -> None:
    """Raise unless the consumer read the ``records`` it was asked to: a consumer that
    stalled half-way published a rate over part of the data, its wait included, with no
    error (found by an audit)."""
    if seen < records:
        raise RuntimeError(
            f"{case}: read {seen:,} of the {records:,} records before a poll came back empty"
        )


def produce_and_consume(
    gateway: str, topic: str, *, records: int, size: int, acks: str, direct: bool = False
) -> tuple[Result, Result]:
    """A producer and a consumer on the same topic at once (each in its own thread).
    Raises when the consumer read fewer than ``records`` (``_check_read``)."""
    consumed: list[Result] = []
    failed: list[BaseException] = []
    start_gate = threading.Event()

    def reader() -> None:
        try:
            read()
        except BaseException as exc:  # raised again in the caller's thread
            failed.append(exc)
            start_gate.set()

    def read() -> None:
        with Consumer(gateway, auto_offset_reset="latest", direct=direct) as c:
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
            elapsed = time.perf_counter() - started
            _check_read(seen, records, "consume (concurrent)")
            consumed.append(
                Result(
                    "consume (concurrent)",
                    seen,
                    size,
                    elapsed,
                    fetch_bytes=c.metrics()["fetch-size-avg"],
                )
            )

    thread = threading.Thread(target=reader)
    thread.start()
    start_gate.wait(30)
    produced = produce(gateway, topic, records=records, size=size, acks=acks, direct=direct)
    thread.join()
    if failed:
        raise failed[0]
    return produced, consumed[0]


def _send_paced(
    interval_s: float,
    warmup_s: float,
    seconds: float,
    send: Callable[[bool, int], None],
    start_measuring: Callable[[int], None],
) -> float:
    """Call ``send(measuring, due_ms)`` every ``interval_s`` for ``warmup_s + seconds``;
    ``due_ms`` is the wall-clock time (whole ms) the call was due, which the sends stamp
    on their records: latency then counts from when a record was meant to go, so a stall
    of this loop (the records due meanwhile go late, in a burst) shows in it rather than
    being left out (coordinated omission: with the time of the actual send, a 300 ms stall
    left the p99 at 18 ms; found by an audit). When the warm-up ends, ``start_measuring``
    gets the first measured record's due ms: every earlier record's is below it. Returns
    the seconds measured.

    Measured ticks are counted from ``from_ms`` in whole nanoseconds: the k-th is due
    ``from_ms + k * interval`` exactly, and stamped with that ms (rounded down). Taken
    from the float ``next_at + wall_offset_s`` (~1.7e9 s), a tick due on a whole ms could
    land a hair below it and be stamped 1 ms early, its records' latency overstated by
    1 ms (found by an audit)."""
    started = time.perf_counter()
    wall_offset_s = time.time() - started  # perf_counter -> wall clock
    next_at = started
    measured_started: float | None = None
    interval_ns = max(1, round(interval_s * 1e9))
    from_ns = 0  # from_ms in ns, once measuring
    measured_at = 0.0  # next_at of the first measured tick
    ticks = 0  # measured ticks sent
    while time.perf_counter() - started < warmup_s + seconds:
        if measured_started is None and time.perf_counter() - started >= warmup_s:
            from_ms = int((next_at + wall_offset_s) * 1000) + 1
            from_ns = from_ms * 1_000_000
            next_at = measured_at = from_ms / 1000 - wall_offset_s
            while time.perf_counter() < next_at:
                time.sleep(0.0001)
            start_measuring(from_ms)
            measured_started = time.perf_counter()
        if measured_started is None:
            # Warm-up: not measured, every stamp below from_ms.
            send(False, max(0, int((next_at + wall_offset_s) * 1000)))
            next_at += interval_s
        else:
            send(True, (from_ns + ticks * interval_ns) // 1_000_000)
            ticks += 1
            next_at = measured_at + ticks * interval_ns / 1e9
        delay = next_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    return time.perf_counter() - (measured_started or started)


def _time_ack(future: Future[Any], ack_latencies_ms: list[float] | None) -> None:
    if ack_latencies_ms is not None:
        sent_at = time.perf_counter()
        future.add_done_callback(
            lambda _: ack_latencies_ms.append((time.perf_counter() - sent_at) * 1000)
        )


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
    consumer; latency = consume time - the record's timestamp, the time its send was due
    (``_send_paced``). With
    ``ack_latencies_ms``, each send's time until its acknowledgement is appended there.
    Raises when a send failed: ``flush`` does not, and the failed records never reach the
    consumer, which reported the survivors' latency with no error (found by an audit).

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
    sent = [0]
    # Every send's future until it is done and checked: a deque of those in flight, not a
    # callback per record or a list of them all, for little work and garbage-collector
    # load per record.
    unchecked: deque[Future[Any]] = deque()
    failures: list[BaseException] = []

    def check_done() -> None:
        while unchecked and unchecked[0].done():
            error = unchecked.popleft().exception()
            if error is not None:
                failures.append(error)

    if freeze_gc:
        gc.collect()
        gc.freeze()
    try:
        with producing(Producer(gateway, acks="all", linger_ms=0)) as producer:

            def send(measuring: bool, due_ms: int) -> None:
                future = producer.send(topic, payload, timestamp_ms=due_ms)
                unchecked.append(future)
                check_done()
                if measuring:
                    _time_ack(future, ack_latencies_ms)
                    sent[0] += 1

            _send_paced(
                1.0 / rate_per_s,
                warmup_s,
                seconds,
                send,
                lambda ms: measured_from_ms.__setitem__(0, ms),
            )
            producer.flush()
            for future in unchecked:
                error = future.exception(120)
                if error is not None:
                    failures.append(error)
            if failures:
                raise RuntimeError(
                    f"end-to-end latency at {rate_per_s:,}/s: {len(failures):,} sends failed, "
                    f"the first with {failures[0]!r}"
                )
            batch_bytes = producer.metrics()["batch-size-avg"]
        give_up[0] = time.monotonic() + 10  # before expected: the reader stops either way
        expected[0] = sent[0]
        done.set()
        thread.join()
    finally:
        done.set()  # with expected still 0 after a failure: the reader stops at once
        thread.join(30)
        if freeze_gc:
            gc.unfreeze()
    return Result(
        f"end-to-end latency at {rate_per_s:,}/s",
        len(latencies),
        size,
        seconds,
        latencies,
        batch_bytes=batch_bytes,
    )


LATENCY_QUANTILES = 10_001
"""How many evenly spaced quantiles stand for the millions of per-record latencies of the
batched end-to-end case (``Result.percentile_ms`` then reads p50/p99/p99.9 off them)."""


def _batched_latency_reader(
    gateway: str,
    topic: str,
    *,
    measured_from_ms: Any,
    expected: Any,
    ready: Any,
    done: Any,
    results: Any,
    direct: bool = False,
) -> None:
    """The consumer of ``end_to_end_latency_batched``, in a process of its own: puts
    (records measured, ``LATENCY_QUANTILES`` quantiles of their latency in ms)."""
    import numpy as np

    chunks: list[Any] = []
    seen = 0
    with Consumer(
        gateway,
        auto_offset_reset="latest",
        fetch_max_wait_ms=100,
        max_partition_fetch_bytes=8 << 20,
        direct=direct,
    ) as c:
        c.subscribe([topic])
        c.poll_arrow(max_records=1, timeout_ms=100)
        ready.set()
        give_up = float("inf")
        while seen < expected.value or not done.is_set():
            table = c.poll_arrow(max_records=1_000_000, timeout_ms=200)
            now_ms = time.time() * 1000
            if table.num_rows:
                stamps = table.column("timestamp_ms").to_numpy()
                stamps = stamps[stamps >= measured_from_ms.value]
                chunks.append(now_ms - stamps)
                seen += len(stamps)
            if done.is_set():
                give_up = min(give_up, time.monotonic() + 30)
                if time.monotonic() > give_up:
                    break
    latencies = np.concatenate(chunks) if chunks else np.empty(0)
    quantiles = (
        np.quantile(latencies, np.linspace(0, 1, LATENCY_QUANTILES)).tolist()
        if len(latencies)
        else []
    )
    results.put((len(latencies), quantiles))


def end_to_end_latency_batched(
    gateway: str,
    topic: str,
    *,
    rate_per_s: int,
    seconds: float,
    size: int,
    tick_s: float = 0.005,
    max_in_flight: int = 64,
    warmup_s: float = 1.0,
    ack_latencies_ms: list[float] | None = None,
    direct: bool = False,
) -> Result:
    """End-to-end latency at a rate one ``send`` per record cannot reach from Python: every
    ``tick_s`` a ``send_batch`` of ``rate_per_s * tick_s`` records (an Arrow column, acks=all,
    idempotent), as a pipeline writes its micro-batches; a ``poll_arrow`` consumer takes
    consume time - record timestamp for every record (one timestamp per ``send_batch``,
    the time the call was due: ``_send_paced``).

    The consumer runs in a process of its own, as a consuming application would: in this
    process its decoding and the producer's encoding would take turns on one GIL, a delay
    of the benchmark's making, not the log's. Nothing waits for acknowledgements except to
    keep at most ``max_in_flight`` calls unanswered: when the cluster falls behind, the rate
    reached (records/s of the result) is below the one asked for, and the latency shows the
    queue. The first ``warmup_s`` is not measured (as in ``end_to_end_latency``). With
    ``ack_latencies_ms``, each measured call's time until its acknowledgement is appended
    there."""
    import multiprocessing

    import pyarrow as pa

    spawn = multiprocessing.get_context("spawn")  # no fork of this process's gRPC state
    measured_from_ms = spawn.Value("d", float("inf"))
    expected = spawn.Value("q", 2**62)
    ready, done = spawn.Event(), spawn.Event()
    results: Any = spawn.Queue()
    reader = spawn.Process(
        target=_batched_latency_reader,
        args=(gateway, topic),
        kwargs={
            "measured_from_ms": measured_from_ms,
            "expected": expected,
            "ready": ready,
            "done": done,
            "results": results,
            "direct": direct,
        },
        daemon=True,
    )
    reader.start()
    per_tick = max(1, int(rate_per_s * tick_s))
    values = pa.array([b"x" * size] * per_tick, pa.binary())
    sent = [0]
    try:
        if not ready.wait(60):
            raise RuntimeError("the latency consumer process did not start")
        with producing(Producer(gateway, acks="all", linger_ms=0, direct=direct)) as producer:
            pending: list[Future[BatchMetadata]] = []

            def send(measuring: bool, due_ms: int) -> None:
                future = producer.send_batch(topic, values, timestamp_ms=due_ms)
                pending.append(future)
                if measuring:
                    _time_ack(future, ack_latencies_ms)
                    sent[0] += per_tick
                while len(pending) > max_in_flight or (pending and pending[0].done()):
                    pending.pop(0).result(120)

            def start_measuring(from_ms: int) -> None:
                measured_from_ms.value = from_ms

            measured_s = _send_paced(tick_s, warmup_s, seconds, send, start_measuring)
            for future in pending:
                future.result(120)
            batch_bytes = producer.metrics()["batch-size-avg"]
        expected.value = sent[0]
        done.set()
        count, quantiles = results.get(timeout=120)
        reader.join(30)
    finally:
        done.set()
        if reader.is_alive():
            reader.kill()
    return Result(
        f"end-to-end latency at {rate_per_s:,}/s asked, send_batch every {tick_s * 1000:g} ms",
        count,
        size,
        measured_s,
        quantiles,
        batch_bytes=batch_bytes,
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


def settle(gateway: str) -> None:
    """Start a case from a quiet machine: the followers caught up (``wait_replicated``) and
    the page cache written back (``sync``). The cases before leave up to ~1.5 GB of dirty
    page cache, which the kernel writes back in bursts of a second or two; inside a
    latency case's ten seconds such a burst is the p99 (BENCHMARKS.md). What a case writes
    itself is written back during it as usual."""
    wait_replicated(gateway)
    os.sync()


def create_topic(gateway: str, name: str, partitions: int, replication_factor: int) -> None:
    Admin(gateway).create_topic(
        name,
        partitions,
        replication_factor,
        {"min.insync.replicas": str(min(2, replication_factor))},
    )


def delete_topic(gateway: str, name: str) -> None:
    Admin(gateway).delete_topic(name)
