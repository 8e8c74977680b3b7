"""The benchmark harness (bench/, `tidelog bench`) measures what its tables say: the
report's machine line and figures, the fixed-rate latency counted from when each send was
due, the consume case reading exactly what was produced, and topics made as labelled.
Found by an audit where it did not."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import suite, workloads
from bench.gateway import write_docs
from bench.workloads import Result
from tests.support.cluster import TestCluster, running_cluster
from tidelog.admin import Admin
from tidelog.consumer import Consumer


@pytest.fixture(scope="module")
def bench_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    with running_cluster(tmp_path_factory.mktemp("bench-cluster")) as cluster:
        yield cluster


def _results() -> dict[str, Any]:
    t = {
        "produce, no replication": Result("p", 3_000, 100, 1.0),
        "produce, RF=3 acks=1 (async)": Result("p", 2_000, 100, 1.0),
        "produce, RF=3 acks=all (sync)": Result("p", 1_000, 100, 1.0),
        "consume, one consumer": Result("c", 4_000, 100, 1.0),
        suite.E2E: Result("end-to-end latency at 500/s", 500, 100, 1.0, [1.0, 2.0]),
        suite.HALF_RATE_E2E: Result(
            "end-to-end latency at 250/s asked, send_batch every 5 ms", 250, 100, 1.0, [3.0]
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
