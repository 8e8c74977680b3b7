"""The benchmark harness (bench/, `tidelog bench`) measures what its tables say: the
report's machine line and figures, the fixed-rate latency counted from when each send was
due, the consume case reading exactly what was produced, and topics made as labelled.
Found by an audit where it did not."""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import stat
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench import ceilings, latency, peers, storage_engine, suite, workloads
from bench import gateway as gateway_bench
from bench import spark as spark_bench
from bench.gateway import write_docs
from bench.workloads import Result
from tests.support.cluster import TestCluster, running_cluster
from tidelog.admin import Admin
from tidelog.consumer import Consumer


@pytest.fixture(scope="module")
def bench_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    with running_cluster(tmp_path_factory.mktemp("bench-cluster")) as cluster:
        yield cluster


def _results(
    e2e: tuple[int, list[float]] = (500, [1.0, 2.0]),
    half_rate: tuple[int, list[float]] = (250, [3.0]),
) -> dict[str, Any]:
    """Fixed figures for ``suite.report``: ``e2e`` and ``half_rate`` are (records,
    latencies) of the two end-to-end cases."""
    t = {
        "produce, no replication": Result("p", 3_000, 100, 1.0),
        "produce, RF=3 acks=1 (async)": Result("p", 2_000, 100, 1.0),
        "produce, RF=3 acks=all (sync)": Result("p", 1_000, 100, 1.0),
        "consume, one consumer": Result("c", 4_000, 100, 1.0),
        suite.E2E: Result("end-to-end latency at 500/s", e2e[0], 100, 1.0, e2e[1]),
        suite.HALF_RATE_E2E: Result(
            "end-to-end latency at 250/s asked, send_batch every 5 ms",
            half_rate[0],
            100,
            1.0,
            half_rate[1],
        ),
    }
    return {
        "tidelog": t,
        "peers": {"NATS JetStream R3 (file), nats-py async publish": 100.0},
        "ceilings": {suite.GRPC_CEILING: 1_000.0},
        "disk": "/dev/x (ext4, mounted on /)",
    }


def test_report_states_the_machines_core_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine line says how many cores the run had (as bench/storage_engine.py's
    ``machine_lines`` does with ``os.cpu_count()``), not a constant: a run on an 8-core
    machine must not publish "2 cores" / "this 2-core machine"."""
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    text = suite.report(_results(), quick=True)
    cpu_line = next(line for line in text.splitlines() if line.startswith("- CPU:"))
    assert "8 cores" in cpu_line, cpu_line
    assert "2-core" not in text and "2 cores" not in text


def test_write_docs_keeps_the_hand_written_sections(tmp_path: Path) -> None:
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(
        "# Benchmarks\n\n## Versus peers\n\nold table\n\n"
        "## Versus peers: where the time goes (profile notes, written by hand)\n\nnotes\n\n"
        "## Scale: many partitions\n\nscale\n"
    )
    section = suite.report(_results(), quick=True)
    write_docs(section, doc, title=suite.SECTION_TITLE)
    once = doc.read_text()
    write_docs(section, doc, title=suite.SECTION_TITLE)
    assert doc.read_text() == once  # idempotent
    assert "old table" not in once
    assert "## Versus peers: where the time goes (profile notes, written by hand)\n\nnotes" in once
    assert "## Scale: many partitions\n\nscale\n" in once
    assert once.count("## Versus peers\n") == 1


@pytest.mark.parametrize(
    ("fraction", "want"), [(0.5, 0.5), (0.99, 0.99), (0.999, 0.999), (0.0, 0.0), (1.0, 1.0)]
)
def test_percentiles_of_the_quantile_list(fraction: float, want: float) -> None:
    """The batched end-to-end case hands Result 10,001 evenly spaced quantiles."""
    quantiles = [i / 10_000 for i in range(10_001)]
    assert Result("x", 1, 100, 1.0, quantiles).percentile_ms(fraction) == pytest.approx(want)


def test_rates() -> None:
    r = Result("x", 3_000_000, 100, 2.0)
    assert r.records_s == 1_500_000
    assert r.mb_s == pytest.approx(150.0)  # 10^6 bytes of values per second


RATE = 2_000
SECONDS = 3.0
STALL_S = 0.3


def test_fixed_rate_latency_counts_a_stall_of_the_sender(
    bench_cluster: TestCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Coordinated omission: latency counted from the actual send left out the wait of the
    records due during a stall of the sending loop (a 300 ms stall at 2,000/s left the p95
    at 15 ms). Counted from when each send was due, ~10% of the records show it."""
    calls = [0]
    original = workloads._time_ack

    def stalling_time_ack(future: Any, ack_latencies_ms: Any) -> None:
        # Called once per measured send, just after it: the 2,000th stalls the loop.
        original(future, ack_latencies_ms)
        calls[0] += 1
        if calls[0] == 2_000:
            time.sleep(STALL_S)

    monkeypatch.setattr(workloads, "_time_ack", stalling_time_ack)
    gw = bench_cluster.start_gateway().address
    workloads.create_topic(gw, "e2e", 6, 3)
    workloads.settle(gw)
    result = workloads.end_to_end_latency(
        gw, "e2e", rate_per_s=RATE, seconds=SECONDS, size=100, warmup_s=0.5
    )
    assert calls[0] >= 2_000
    p95 = result.percentile_ms(0.95)
    p99 = result.percentile_ms(0.99)
    assert p95 is not None and p99 is not None
    # ~10% of the records were due during the 300 ms stall: from their intended send
    # time, p95 >= ~150 ms and p99 >= ~270 ms.
    assert p95 >= 100, (
        f"a {STALL_S * 1000:.0f} ms stall of the sending loop delayed ~{RATE * STALL_S:.0f} "
        f"of {result.records} records, yet p95 {p95:.1f} ms, p99 {p99:.1f} ms"
    )


N = 120_000


@pytest.mark.parametrize("direct", [False, True])
def test_consume_counts_the_records_produced_once(bench_cluster: TestCluster, direct: bool) -> None:
    topic = f"counted-{direct}"
    gw = bench_cluster.start_gateway().address
    workloads.create_topic(gw, topic, 6, 3)
    produced = workloads.produce(gw, topic, records=N, size=100, acks="all", direct=direct)
    assert produced.records == N
    consumed = workloads.consume(gw, topic, records=N, size=100, arrow=True, direct=direct)
    assert consumed.records == N
    # What poll_arrow hands out, distinct (partition, offset) pairs.
    seen: set[tuple[int, int]] = set()
    rows = 0
    with Consumer(gw, auto_offset_reset="earliest", direct=direct) as c:
        c.subscribe([topic])
        while rows < N:
            table = c.poll_arrow(max_records=1_000_000, timeout_ms=10_000)
            if not table.num_rows:
                break
            rows += table.num_rows
            seen.update(
                zip(
                    table.column("partition").to_pylist(),
                    table.column("offset").to_pylist(),
                    strict=True,
                )
            )
    assert rows == N
    assert len(seen) == N


def test_topics_are_created_as_the_table_labels_them(bench_cluster: TestCluster) -> None:
    """6 partitions RF=1 / RF=3 (min.insync.replicas 2) and the OMB case's 100 x RF=3."""
    gw = bench_cluster.start_gateway().address
    for name, partitions, rf in (("rf1", 6, 1), ("rf3", 6, 3), ("omb", 100, 3)):
        workloads.create_topic(gw, name, partitions, rf)
        topic = Admin(gw).describe_topic(name)
        assert len(topic.partitions) == partitions
        assert topic.replication_factor == rf
        assert all(len(p.replicas) == rf for p in topic.partitions)
        assert topic.configs.get("min.insync.replicas") == str(min(2, rf))


# --- Measurement and docs bugs found by an audit, on controlled inputs: fake clocks, fake
# SDK objects and fixed figures, no cluster. ---------------------------------------------


class _FakeClock:
    """perf_counter/time/sleep/monotonic of ``bench.workloads`` under test control:
    ``time()`` is ``perf_counter() + offset`` exactly, and ``sleep`` advances exactly."""

    def __init__(self, start: float, wall_offset: float) -> None:
        self.t = start
        self.offset = wall_offset

    def perf_counter(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        return self.t + self.offset

    def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)


def test_paced_ticks_due_on_a_whole_ms_are_stamped_with_that_ms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: ``_send_paced`` aligns the first measured tick to a whole ms so
    that, at a 5 ms tick, every measured tick is due ``from_ms + 5 k`` ms, and stamps its
    records with that due ms. Taken as ``int((next_at + wall_offset_s) * 1000)``, a float
    sum near 1.7e9 s that lands a hair below the whole ms was floored to the ms before:
    those ticks were stamped 1 ms early and their records' latency overstated by 1 ms."""
    clock = _FakeClock(start=5000.0, wall_offset=1_764_000_000.7)
    monkeypatch.setattr(workloads, "time", clock)
    stamps: list[int] = []
    from_ms: list[int] = []

    def send(measuring: bool, due_ms: int) -> None:
        if measuring:
            stamps.append(due_ms)
        else:
            assert not from_ms  # the warm-up comes first

    workloads._send_paced(0.005, 0.05, 0.5, send, from_ms.append)
    (first,) = from_ms
    assert len(stamps) >= 95
    wrong = [
        (k, stamp - (first + 5 * k)) for k, stamp in enumerate(stamps) if stamp != first + 5 * k
    ]
    assert not wrong, (
        f"{len(wrong)} of {len(stamps)} ticks due at a whole ms were stamped with another ms "
        f"(tick, error ms): {wrong[:6]}"
    )


def test_result_percentile_is_the_nearest_rank() -> None:
    """Found by an audit: ``Result.percentile_ms`` (every latency cell of the suite's
    table, and the floors) read ``ordered[int(q * n)]``, one rank above the nearest-rank
    percentile whenever ``q * n`` is whole: p50 of 1..100 was 51 and p99 the maximum."""
    samples = [float(v) for v in range(1, 101)]
    result = Result("x", len(samples), 100, 1.0, samples)
    want = {0.5: 50.0, 0.99: 99.0}
    assert {q: storage_engine.percentile(sorted(samples), q) for q in want} == want
    assert {q: result.percentile_ms(q) for q in want} == want


def test_latency_tables_percentile_is_the_nearest_rank() -> None:
    """Found by an audit: ``bench.latency``'s tables had the same ``ordered[int(q * n)]``,
    one rank high."""
    samples = [float(v) for v in range(100, 0, -1)]
    assert {q: latency._percentile(samples, q) for q in (0.5, 0.99)} == {0.5: 50.0, 0.99: 99.0}


class _SlowSendBatchProducer:
    """``send_batch`` takes ``CALL_S`` of the caller's time and returns a future that is
    already acknowledged: every chunk's true latency (call to acknowledgement) is
    ``CALL_S``."""

    CALL_S = 0.02

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def send_batch(self, topic: str, values: Any, **kwargs: Any) -> Future[Any]:
        time.sleep(self.CALL_S)
        future: Future[Any] = Future()
        future.set_result(SimpleNamespace(topic=topic))
        return future

    def metrics(self) -> dict[str, float]:
        return {"batch-size-avg": 0.0}

    def close(self, timeout_s: float | None = None) -> None:
        pass


def test_produce_latency_per_send_batch_is_call_to_acknowledgement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: ``workloads.produce`` timed a chunk from its ``send_batch`` call
    until the harness got round to ``future.result()`` (after up to 7 later calls), not
    until the future completed, charging the harness's own calls to the cluster. Every
    chunk here is acknowledged when its 20 ms call returns; the column said ~8x that."""
    monkeypatch.setattr(workloads, "Producer", _SlowSendBatchProducer)
    result = workloads.produce(
        "unused:1", "t", records=160, size=100, acks="1", chunk=10, arrow=False
    )
    assert len(result.latencies_ms) == 16  # one per send_batch
    p50 = result.percentile_ms(0.5)
    assert p50 is not None
    true_ms = _SlowSendBatchProducer.CALL_S * 1000
    assert p50 < 2.5 * true_ms, (
        f"every send_batch was acknowledged {true_ms:.0f} ms after its call, "
        f"yet p50 per send_batch {p50:.0f} ms (max {max(result.latencies_ms):.0f} ms)"
    )


def test_end_to_end_latency_fails_on_failed_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by an audit: ``workloads.end_to_end_latency`` (the suite's one-``send``-per-
    record row) never looked at its sends' futures, and ``flush`` does not raise for
    failed records: they never reached the consumer, the reader gave up 10 s later, and
    the survivors' latency and rate were reported with no error. Every second send fails
    here."""
    lock = threading.Lock()
    delivered: list[Any] = []

    class FailingHalfProducer:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.n = 0

        def send(self, topic: str, value: bytes, *, timestamp_ms: int) -> Future[Any]:
            future: Future[Any] = Future()
            self.n += 1
            if self.n % 2:
                future.set_exception(RuntimeError("delivery timed out"))
            else:
                with lock:
                    delivered.append(SimpleNamespace(timestamp_ms=timestamp_ms))
                future.set_result(None)
            return future

        def flush(self, timeout_s: float | None = None) -> None:
            pass

        def metrics(self) -> dict[str, float]:
            return {"batch-size-avg": 0.0}

        def close(self, timeout_s: float | None = None) -> None:
            pass

    class Reader:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.at = 0

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def subscribe(self, topics: list[str]) -> None:
            pass

        def poll(self, max_records: int = 500, timeout_ms: int = 1000) -> list[Any]:
            with lock:
                out = delivered[self.at : self.at + max_records]
                self.at += len(out)
            if not out:
                time.sleep(min(timeout_ms, 50) / 1000)
            return out

    monkeypatch.setattr(workloads, "Producer", FailingHalfProducer)
    monkeypatch.setattr(workloads, "Consumer", Reader)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="sends failed"):
        workloads.end_to_end_latency(
            "unused:1",
            "t",
            rate_per_s=200,
            seconds=0.5,
            size=100,
            warmup_s=0.1,
            freeze_gc=False,
        )
    assert time.monotonic() - started < 5  # not after the reader's 10 s of waiting


class _ShortReader:
    """A consumer that hands out 500 records (250 a poll), then nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.left = [250, 250]

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def subscribe(self, topics: list[str]) -> None:
        pass

    def poll(self, max_records: int = 500, timeout_ms: int = 1000) -> list[Any]:
        return [object()] * (self.left.pop(0) if self.left else 0)

    def metrics(self) -> dict[str, float]:
        return {"fetch-size-avg": 0.0}


def test_consume_fails_on_a_short_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by an audit: ``workloads.consume`` (the "consume, one consumer" rows) stopped
    at the first empty poll and returned ``Result(records=seen)`` unchecked: a consumer
    that stalled half-way published a records/s over half the data, its 10 s of waiting
    included, with no error."""
    monkeypatch.setattr(workloads, "Consumer", _ShortReader)
    with pytest.raises(RuntimeError, match="read 500 of the 1,000 records"):
        workloads.consume("unused:1", "t", records=1_000, size=100)


def test_produce_and_consume_fails_on_a_short_concurrent_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: the concurrent reader of ``workloads.produce_and_consume`` gave
    up after 10 s without records and published its rate over what it had read."""
    ticks = iter(range(0, 10_000, 4))  # monotonic: 4 s on at each look, no real waiting
    fake_time = SimpleNamespace(perf_counter=time.perf_counter, monotonic=lambda: next(ticks))
    monkeypatch.setattr(workloads, "time", fake_time)
    monkeypatch.setattr(workloads, "Consumer", _ShortReader)
    monkeypatch.setattr(workloads, "produce", lambda *args, **kwargs: Result("p", 1_000, 100, 1.0))
    with pytest.raises(RuntimeError, match=r"consume \(concurrent\)"):
        workloads.produce_and_consume("unused:1", "t", records=1_000, size=100, acks="all")


def test_sequential_gateway_produce_rows_fail_on_refused_produces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: ``bench.latency``'s "gateway Produce" rows timed
    ``GatewayStub.Produce`` and never looked at the answer, whose per-partition ``error``
    carries a refusal (the gateway answers errors in the message, not as a gRPC status):
    a run whose every Produce was refused published the refusal's round trip as the
    produce latency."""
    from tidelog.v1 import common_pb2, gateway_pb2, storage_pb2

    monkeypatch.setattr(latency, "SEQUENTIAL_CALLS", 5)
    monkeypatch.setattr(latency, "PAUSE_S", 0.0)

    class Storage:
        def Append(self, request: Any, timeout: float) -> Any:  # noqa: N802
            return storage_pb2.AppendResponse(base_offset=0, last_offset=0)

    class Gateway:
        def Produce(self, request: Any, timeout: float) -> Any:  # noqa: N802
            return gateway_pb2.ProduceResponse(
                partitions=[
                    gateway_pb2.ProducePartitionResult(
                        topic=p.topic,
                        partition=p.partition,
                        error=common_pb2.Error(
                            code=common_pb2.NOT_LEADER_OR_FOLLOWER, message="not the leader"
                        ),
                        base_offset=-1,
                        last_offset=-1,
                    )
                    for p in request.partitions
                ]
            )

    class SdkProducer:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def send(self, *args: Any, **kwargs: Any) -> Future[Any]:
            future: Future[Any] = Future()
            future.set_result(None)
            return future

        def close(self, timeout_s: float | None = None) -> None:
            pass

    monkeypatch.setattr(latency, "Producer", SdkProducer)
    with pytest.raises(RuntimeError, match="NOT_LEADER_OR_FOLLOWER"):
        latency._sequential_layers("unused:1", Gateway(), Storage(), "t", 3)


def test_half_rate_target_is_missed_by_a_case_that_measured_nothing() -> None:
    """Found by an audit: ``end_to_end_latency_batched`` returns no quantiles when its
    consumer saw no measured record; the report turned the missing p99 into 0.0 and
    published "p99 0.0 ms at 0 records/s met"."""
    text = suite.report(_results(half_rate=(0, [])), quick=True)
    line = next(row for row in text.splitlines() if "at half the maximum rate" in row)
    assert "p99 not measured at 0 records/s missed" in line, line
    assert " met" not in line.replace("missed", ""), line


def test_report_of_an_end_to_end_case_without_latencies() -> None:
    """Found by an audit: with no latency measured by the one-``send``-per-record case,
    ``report`` formatted None with ``:.1f`` and raised TypeError after the whole run,
    printing and writing no figure."""
    text = suite.report(_results(e2e=(0, [])), quick=True)
    assert "- end-to-end p99 not measured ms at 500/s" in text


def test_a_peer_whose_python_client_is_missing_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: ``peers.available()`` looked only for the servers on PATH. With
    a server installed but not its PyPI client (``nats-py``, ``redis``: the ``bench``
    extra), the peer's ``import`` raised and the whole ``tidelog bench`` run died at the
    peers stage, after every tidelog and Spark case. ``suite.run`` here, with the cluster
    and the tidelog cases stubbed out."""
    monkeypatch.setitem(sys.modules, "nats", None)  # import nats -> ImportError
    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    assert peers.available() == {"nats": False, "redis": False}

    class Cluster:
        def start_gateway(self) -> Any:
            return SimpleNamespace(address="127.0.0.1:1")

    monkeypatch.setattr(suite, "running_cluster", lambda path: contextlib.nullcontext(Cluster()))
    monkeypatch.setattr(ceilings, "grpc_put_mb_s", lambda mib: 1.0)
    monkeypatch.setattr(ceilings, "disk_write_mb_s", lambda *a, **k: 1.0)
    monkeypatch.setattr(ceilings, "loopback_tcp_mb_s", lambda mib: 1.0)
    monkeypatch.setattr(suite, "_kafka_2014", lambda *a, **k: {})
    monkeypatch.setattr(workloads, "create_topic", lambda *a, **k: None)
    monkeypatch.setattr(workloads, "settle", lambda *a, **k: None)
    monkeypatch.setattr(workloads, "produce", lambda *a, **k: Result("p", 1, 1024, 1.0))
    monkeypatch.setattr(suite, "_spark_rates", lambda rows: None)
    results = suite.run(quick=True)
    assert results["peers"] == {
        "NATS JetStream R3 (file), nats-py async publish": None,
        "Redis Streams XADD pipelined (1 node, no replication)": None,
    }


def test_write_docs_without_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by an audit: ``main`` drew the chart (matplotlib, a ``bench``-extra
    dependency) before it wrote docs/BENCHMARKS.md: without matplotlib, ``--write-docs``
    raised ImportError after the whole run and the measured section was not written. It
    is now written, without the (stale) chart."""
    written: list[str] = []
    monkeypatch.setattr(suite, "run", lambda quick: _results())
    monkeypatch.setattr(suite, "write_docs", lambda section, title: written.append(section))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert suite.main(argparse.Namespace(quick=True, write_docs=True)) == 0
    (section,) = written
    assert section.startswith(suite.SECTION_TITLE)
    assert suite.CHART_LINE not in section


def test_spark_docs_name_the_partition_count_that_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by an audit: ``python -m bench.spark --partitions 8 --write-docs`` wrote
    "4 partitions" and a ``Command:`` line without ``--partitions``."""
    seen: dict[str, Any] = {}

    def fake_run(rows: int, partitions: int) -> dict[str, float]:
        seen["partitions"] = partitions
        return {"write": 1.0e6, "read": 2.0e6, "write direct": 1.0e6, "read direct": 2.0e6}

    monkeypatch.setattr(spark_bench, "run", fake_run)
    monkeypatch.setattr(
        spark_bench, "_write_section", lambda section, title: seen.update(doc=section)
    )
    assert spark_bench.main(["--rows", "1000", "--partitions", "8", "--write-docs"]) == 0
    assert seen["partitions"] == 8
    doc = seen["doc"]
    command = next(line for line in doc.splitlines() if line.startswith("Command:"))
    assert "RF=1, 8 partitions" in doc and "4 partitions" not in doc
    assert "--rows 1000 --partitions 8 --write-docs" in command, command


def test_spark_docs_name_the_java_that_ran(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Found by an audit: ``make sysdeps`` installs openjdk-17, "else the release's default
    Java runtime" (Debian 13: 21); ``bench.spark.report`` wrote "Java 17" whatever
    ``java`` was."""
    fake = tmp_path / "java"
    fake.write_text(
        "#!/bin/sh\necho 'openjdk version \"21.0.5\" 2024-10-15' >&2\n"
        "echo 'OpenJDK Runtime Environment (build 21.0.5+11-Debian-1)' >&2\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("JAVA_HOME", raising=False)
    doc = spark_bench.report(
        {"write": 1.0e6, "read": 2.0e6, "write direct": 1.0e6, "read direct": 2.0e6}, 1000
    )
    line = next(row for row in doc.splitlines() if row.startswith("- Python"))
    assert line.endswith(", Java 21.0.5"), line


def test_gateway_docs_command_reproduces_the_chunk_that_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: ``python -m bench.gateway --chunk 10000 --write-docs`` wrote
    "send_batch of 10,000 values per call" but a ``Command:`` line without ``--chunk``,
    which runs the default 50,000."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(
        gateway_bench, "run", lambda records, chunk: {"rf1": 1.0, "rf3": 1.0, "consume": 1.0}
    )
    monkeypatch.setattr(gateway_bench, "write_docs", lambda section: seen.update(doc=section))
    assert gateway_bench.main(["--records", "100000", "--chunk", "10000", "--write-docs"]) == 0
    doc = seen["doc"]
    assert "send_batch` of 10,000 values" in doc
    command = next(line for line in doc.splitlines() if line.startswith("Command:"))
    assert "--records 100000 --chunk 10000 --write-docs" in command, command


def _dying_spark_child(rows: int, answer: Any) -> None:
    """A Spark child that dies without answering (a crash, an OOM kill of its process)."""
    os._exit(3)


def test_a_spark_child_that_died_is_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by an audit: ``suite._spark_rates`` waited for the child's answer with
    ``answer.get(timeout=600)`` and never looked at the child: one that died without
    answering (the OOM killer, a crash in native code) stalled ``tidelog bench`` for ten
    minutes."""
    monkeypatch.setattr(suite, "_spark_child", _dying_spark_child)
    spawn = multiprocessing.get_context("spawn")
    children: list[Any] = []

    def process(**kwargs: Any) -> Any:
        children.append(spawn.Process(**kwargs))
        return children[-1]

    context = SimpleNamespace(Queue=spawn.Queue, Process=process)
    monkeypatch.setattr(suite, "multiprocessing", SimpleNamespace(get_context=lambda _: context))
    outcome: list[Any] = []
    waiter = threading.Thread(target=lambda: outcome.append(suite._spark_rates(10)), daemon=True)
    started = time.monotonic()
    waiter.start()
    waiter.join(30)
    (child,) = children
    assert not waiter.is_alive(), (
        f"the Spark child exited at once (os._exit(3)); _spark_rates still waits "
        f"{time.monotonic() - started:.0f} s later"
    )
    assert child.exitcode == 3  # it did die, at once, without answering
    assert outcome == [None]
