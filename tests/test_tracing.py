"""tidelog.tracing: hop timestamps from every process started with TIDELOG_TRACE_DIR
(bench/trace_tick.py reads them), and nothing from a process started without it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import tidelog
from tests.support.cluster import running_cluster
from tests.support.process import REPO_ROOT, tidelog_env
from tidelog.tracing import FLUSH_INTERVAL_S, TRACE_DIR_ENV


def _events(directory: Path) -> dict[str, Counter[str]]:
    """Per trace file (one per process): how many lines of each event."""
    found: dict[str, Counter[str]] = {}
    for path in directory.glob("*.log"):
        lines = [line.split() for line in path.read_text().splitlines()]
        assert all(int(fields[0]) > 0 and int(fields[1]) > 0 for fields in lines)
        found[path.stem] = Counter(fields[2] for fields in lines)
    return found


def test_a_client_process_traces_only_when_told(tmp_path: Path) -> None:
    script = "from tidelog import tracing\ntracing.event('c_call', 'topic')\n"
    untraced = dict(tidelog_env())
    untraced.pop(TRACE_DIR_ENV, None)
    subprocess.run([sys.executable, "-c", script], env=untraced, cwd=REPO_ROOT, check=True)
    assert list(tmp_path.iterdir()) == []
    traced = {**untraced, TRACE_DIR_ENV: str(tmp_path)}
    subprocess.run([sys.executable, "-c", script], env=traced, cwd=REPO_ROOT, check=True)
    # Written at exit although the flush interval had not passed.
    assert list(_events(tmp_path).values()) == [Counter({"c_call": 1})]


def test_storage_nodes_trace_appends_fetches_and_the_high_watermark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    monkeypatch.setenv(TRACE_DIR_ENV, str(traces))  # inherited by the cluster's processes
    with running_cluster(tmp_path / "cluster") as cluster:
        gateway = cluster.start_gateway().address
        tidelog.Admin(gateway).create_topic("traced", partitions=1, replication_factor=3)
        with tidelog.Producer(gateway, acks="all", direct=True) as producer:
            for _ in range(3):
                producer.send_batch("traced", [b"x" * 100] * 10).result(30)
        time.sleep(3 * FLUSH_INTERVAL_S)  # written before the cluster's kill -9
    by_process = _events(traces)
    leaders = [c for c in by_process.values() if c["ap_in"]]
    assert len(leaders) == 1, by_process
    leader = leaders[0]
    assert leader["ap_in"] == leader["ap_done"] == leader["ap_out"] == 3
    assert leader["hw"] >= 3 and leader["f_in"] >= 6 and leader["f_out"] >= 6
    followers = [c for c in by_process.values() if c["fr_app"]]
    assert len(followers) == 2 and all(c["fr_app"] >= 1 and c["fr_recv"] >= 1 for c in followers)


def test_a_gateway_traces_each_produce_request_and_its_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the gateway: the producer's request out and answer back, the gateway's
    request in, its Append to the leader and back, and its answer, once per request."""
    traces = tmp_path / "traces"
    traces.mkdir()
    monkeypatch.setenv(TRACE_DIR_ENV, str(traces))
    with running_cluster(tmp_path / "cluster") as cluster:
        gateway_process = cluster.start_gateway()
        gateway = gateway_process.address
        tidelog.Admin(gateway).create_topic("traced", partitions=1, replication_factor=3)
        script = (
            "import sys, tidelog\n"
            "with tidelog.Producer(sys.argv[1], acks='all') as p:\n"
            "    for _ in range(3):\n"
            "        p.send_batch('traced', [b'x' * 100] * 10).result(30)\n"
        )
        subprocess.run(
            [sys.executable, "-c", script, gateway], env=tidelog_env(), cwd=REPO_ROOT, check=True
        )
        time.sleep(3 * FLUSH_INTERVAL_S)  # written before the cluster's kill -9
    by_process = _events(traces)
    gateway_events = by_process[str(gateway_process.pid)]
    assert all(gateway_events[e] == 3 for e in ("g_in", "g_ap_in", "g_ap_out", "g_out"))
    clients = [c for c in by_process.values() if c["c_call"]]
    assert len(clients) == 1 and clients[0]["c_send"] == clients[0]["c_ack"] == 3


SCRIPT = """
import os, threading, time
from tidelog import tracing
for _ in range(500):
    tracing.event("c_call", "t")
time.sleep(3 * tracing.FLUSH_INTERVAL_S)  # the first write fails: no directory yet
os.mkdir(os.environ["TIDELOG_TRACE_DIR"])  # the directory is there from now on
for _ in range(500):
    tracing.event("c_call", "t")
time.sleep(3 * tracing.FLUSH_INTERVAL_S)
alive = any(t.name == "tidelog-trace" for t in threading.enumerate())
print(alive, len(tracing._lines))
os._exit(0)  # as a process killed: only what the thread wrote counts
"""


def test_the_trace_writer_survives_a_failed_write(tmp_path: Path) -> None:
    """A failed write (the trace directory missing or removed, a full disk) ended the
    writer thread: every event after it stayed in memory for ever, and the lines of the
    failed write were lost (found by an audit). They are written once it can."""
    directory = tmp_path / "traces"  # not there when the process starts
    ran = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**tidelog_env(), TRACE_DIR_ENV: str(directory)},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    alive, buffered = ran.stdout.split()
    written = sum(len(p.read_text().splitlines()) for p in directory.glob("*.log"))
    assert alive == "True" and buffered == "0" and written == 1000, (
        f"writer thread alive: {alive}; lines held in memory: {buffered}; lines written "
        f"after the directory appeared: {written}; stderr: {ran.stderr.strip()[-300:]}"
    )
