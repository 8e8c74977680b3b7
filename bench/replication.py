"""Replication benchmark: produce throughput with RF=3 (acks=all and acks=1) and follower catch-up.

Starts a real cluster on this machine, the way the process-level tests do
(``tests.support.cluster.TestCluster``): a private etcd, one controller and three storage
nodes, each its own ``python -m tidelog`` process on 127.0.0.1. The benchmark client is a
fourth Python process; all of them share the machine's cores.

One 1 MiB batch of 100-byte records is encoded once with ``tidelog.records.encode_batch``
and the same bytes are sent over and over with ``Storage.Append`` to the partition leader
(the leader restamps offsets and epochs of every copy), from ``--threads`` client threads
on one channel, so several appends are in flight at once. Each case uses its own
single-partition topic created through the Controller API:

1. ``rf1-acks1``: RF=1, acks=1 -- gRPC plus the leader's append, no replication (the
   baseline that shows what replication adds);
2. ``rf3-acks1``: RF=3, ``min.insync.replicas=2``, acks=1 -- answered after the leader's
   append while the two followers fetch in the background;
3. ``rf3-all``: RF=3, ``min.insync.replicas=2``, acks=all -- answered once the high
   watermark passes the batch, i.e. after the followers have fetched it.

Each case runs ``--seconds`` after a short warm-up; the figures are MB/s (10^6 bytes of
batch payload per second), records/s, and the latency of each ``Append`` call (p50/p99).
CPU seconds of every process over the case (from ``/proc/PID/stat``) show which process
burns the cores.

Follower catch-up: on a fresh RF=3 topic one follower is stopped with SIGSTOP (its etcd
lease outlives the pause: the nodes run with a long session TTL), ``--catchup-mib`` MiB are
produced with acks=1, the follower is resumed with SIGCONT, and the time until its log end
offset reaches the leader's (``DescribeLogDirs`` on the follower, polled every 10 ms) gives
the catch-up rate.

Guest memory that was never touched is slow to fault in on some VMs (see the storage
engine section of docs/BENCHMARKS.md). The reference VM also has virtio-balloon free page
reporting, and a warm-up does not reliably last: a 12 GiB scratch file written and deleted
three minutes after another one ran at first-touch speed (~400 MB/s) again. So there is no
warm-up by default and the brokers' page-cache writes are measured at whatever that costs;
``--warmup-mib N`` writes and deletes an N MiB scratch file first and reports its speed.

Run: ``PYTHONPATH=. python -m bench.replication [--seconds N] [--write-docs]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.storage_engine import (
    cores,
    cpu_model,
    filesystem_of,
    memory_gib,
    next_offset,
    raw_pwrite_mb_s,
)
from services.storage.fetcher import FETCH_MAX_BYTES, PARTITION_FETCH_MAX_BYTES
from tests.support.cluster import TestCluster, wait_for
from tests.support.process import TidelogProcess
from tidelog.records import encode_batch
from tidelog.v1 import common_pb2, storage_pb2

MIB = 1 << 20
MB = 1_000_000
RECORD_BYTES = 100
DOCS_PATH = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"
SECTION_TITLE = "## Replication"
SESSION_TTL_S = 120  # long enough that a SIGSTOPped broker keeps its registration
APPEND_TIMEOUT_MS = 30_000
RPC_TIMEOUT_S = 60.0
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Targets from the replication issue.
TARGET_ALL_MB_S = 100
TARGET_CATCHUP_MB_S = 200


def build_batch(target_bytes: int) -> tuple[bytes, int]:
    """The largest batch of 100-byte records that fits ``target_bytes``."""
    value = b"x" * RECORD_BYTES
    count = target_bytes // (RECORD_BYTES + 4)
    while True:
        batch = encode_batch([value] * count, base_timestamp_ms=int(time.time() * 1000))
        if len(batch) <= target_bytes:
            return batch, count
        count -= max(1, (len(batch) - target_bytes) // (RECORD_BYTES + 3))


def percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(fraction * (len(sorted_values) - 1))))
    return sorted_values[index]


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of ``pid`` (all its threads) so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def system_busy_seconds() -> float:
    """CPU seconds the whole machine spent not idle (all processes, all cores)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


@dataclass
class CpuMeter:
    """CPU seconds per named process between ``start()`` and ``stop()``."""

    pids: dict[str, int]
    before: dict[str, float] = field(default_factory=dict)
    used: dict[str, float] = field(default_factory=dict)

    def start(self) -> None:
        self.before = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        self.before["(system)"] = system_busy_seconds()

    def stop(self) -> dict[str, float]:
        """CPU seconds per process, plus ``other``: the rest of the machine (other jobs)."""
        self.used = {name: cpu_seconds(pid) - self.before[name] for name, pid in self.pids.items()}
        system = system_busy_seconds() - self.before["(system)"]
        self.used["other"] = max(0.0, system - sum(self.used.values()))
        return self.used


@dataclass
class ProduceResult:
    label: str
    description: str
    acks: str
    batch_bytes: int
    records_per_batch: int
    appends: int
    elapsed_s: float
    latencies_ms: list[float]
    cpu_s: dict[str, float]
    leos: dict[str, int]
    leader: int
    drain_s: float  # after the case, until every follower had the leader's LEO

    @property
    def max_lag_records(self) -> int:
        return max(self.leos.values()) - min(self.leos.values())

    @property
    def leader_name(self) -> str:
        return f"broker-{self.leader}"

    @property
    def mb_s(self) -> float:
        return self.appends * self.batch_bytes / self.elapsed_s / MB

    @property
    def records_s(self) -> float:
        return self.appends * self.records_per_batch / self.elapsed_s

    @property
    def p50_ms(self) -> float:
        return percentile(sorted(self.latencies_ms), 0.50)

    @property
    def p99_ms(self) -> float:
        return percentile(sorted(self.latencies_ms), 0.99)

    def cpu_per_mb_ms(self, name: str) -> float:
        total_mb = self.appends * self.batch_bytes / MB
        return self.cpu_s.get(name, float("nan")) * 1000 / total_mb


@dataclass
class CatchupResult:
    behind_bytes: int
    behind_records: int
    produce_mb_s: float
    elapsed_s: float
    cpu_s: dict[str, float]
    fetch_replay_s: float  # the same range read by the client with sequential Fetch calls
    fetch_replay_cpu_s: dict[str, float]

    @property
    def mb_s(self) -> float:
        return self.behind_bytes / self.elapsed_s / MB

    @property
    def fetch_replay_mb_s(self) -> float:
        return self.behind_bytes / self.fetch_replay_s / MB

    @property
    def records_s(self) -> float:
        return self.behind_records / self.elapsed_s


class Bench:
    def __init__(self, cluster: TestCluster, batch: bytes, records_per_batch: int) -> None:
        self.cluster = cluster
        self.batch = batch
        self.records_per_batch = records_per_batch
        self.topic_count = 0

    def process_pids(self) -> dict[str, int]:
        pids: dict[str, int] = {"client": os.getpid(), "etcd": self.cluster.etcd.pid or 0}
        for controller_id, controller in self.cluster.controllers.items():
            pids[f"controller-{controller_id}"] = controller.pid
        for broker_id, broker in self.cluster.brokers.items():
            pids[f"broker-{broker_id}"] = broker.pid
        return pids

    def create_topic(self, replication_factor: int) -> tuple[str, common_pb2.PartitionState]:
        self.topic_count += 1
        name = f"bench-rf{replication_factor}-{self.topic_count}"
        configs = {"min.insync.replicas": "2"} if replication_factor >= 2 else {}
        self.cluster.create_topic(name, 1, replication_factor, configs)

        def ready() -> common_pb2.PartitionState | None:
            (state,) = self.cluster.partitions(name)
            if state.leader < 0 or len(state.isr) != replication_factor:
                return None
            # Every replica has the partition and the leader knows it leads.
            for broker_id in state.replicas:
                (log,) = self.describe(broker_id, name)
                if broker_id == state.leader and not log.is_leader:
                    return None
            return state

        return name, wait_for(ready, 30.0, f"topic {name} to have a leader and a full ISR")

    def describe(self, broker_id: int, topic: str) -> list[storage_pb2.LogDescription]:
        response = self.cluster.brokers[broker_id].stub.DescribeLogDirs(
            storage_pb2.DescribeLogDirsRequest(
                partitions=[common_pb2.TopicPartition(topic=topic, partition=0)]
            ),
            timeout=RPC_TIMEOUT_S,
        )
        return [
            log for log_dir in response.log_dirs for log in log_dir.partitions if log.topic == topic
        ]

    def leo(self, broker_id: int, topic: str) -> int:
        logs = self.describe(broker_id, topic)
        return logs[0].log_end_offset if logs else -1

    def produce(
        self,
        leader: int,
        topic: str,
        acks: int,
        *,
        threads: int,
        seconds: float | None = None,
        appends: int | None = None,
    ) -> tuple[int, float, list[float]]:
        """Append the batch from ``threads`` threads for ``seconds`` or ``appends`` calls.

        Returns (appends done, elapsed seconds, per-append latencies in ms).
        """
        stub = self.cluster.brokers[leader].stub
        request = storage_pb2.AppendRequest(
            topic=topic,
            partition=0,
            records=self.batch,
            acks=acks,  # type: ignore[arg-type]
            timeout_ms=APPEND_TIMEOUT_MS,
        )
        lock = threading.Lock()
        latencies: list[float] = []
        errors: list[BaseException] = []
        remaining = [appends if appends is not None else 1 << 62]
        start = time.perf_counter()
        deadline = start + (seconds if seconds is not None else 1e9)

        def worker() -> None:
            local: list[float] = []
            try:
                while True:
                    with lock:
                        if remaining[0] <= 0:
                            break
                        remaining[0] -= 1
                    t0 = time.perf_counter()
                    if t0 >= deadline:
                        break
                    stub.Append(request, timeout=RPC_TIMEOUT_S)
                    local.append((time.perf_counter() - t0) * 1000)
            except BaseException as exc:  # reported by the caller
                errors.append(exc)
            with lock:
                latencies.extend(local)

        workers = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - start
        if errors:
            raise RuntimeError(f"append failed: {errors[0]!r}") from errors[0]
        return len(latencies), elapsed, latencies

    def throughput(
        self,
        label: str,
        description: str,
        replication_factor: int,
        acks: int,
        acks_name: str,
        *,
        seconds: float,
        threads: int,
    ) -> ProduceResult:
        topic, state = self.create_topic(replication_factor)
        self.produce(state.leader, topic, acks, threads=threads, appends=2 * threads)  # warm-up
        meter = CpuMeter(self.process_pids())
        meter.start()
        done, elapsed, latencies = self.produce(
            state.leader, topic, acks, threads=threads, seconds=seconds
        )
        cpu = meter.stop()
        leos = {f"broker-{b}": self.leo(b, topic) for b in state.replicas}
        # Followers still behind (acks=1) would fetch during the next case: wait them out.
        target = self.leo(state.leader, topic)
        t0 = time.perf_counter()
        wait_for(
            lambda: all(self.leo(b, topic) >= target for b in state.replicas),
            120.0,
            f"every replica of {topic} to reach the leader's LEO",
        )
        drain_s = time.perf_counter() - t0
        result = ProduceResult(
            label=label,
            description=description,
            acks=acks_name,
            batch_bytes=len(self.batch),
            records_per_batch=self.records_per_batch,
            appends=done,
            elapsed_s=elapsed,
            latencies_ms=latencies,
            cpu_s=cpu,
            leos=leos,
            leader=state.leader,
            drain_s=drain_s,
        )
        print(
            f"{label}: {result.mb_s:,.1f} MB/s, {result.records_s:,.0f} records/s, "
            f"{done} appends in {elapsed:.1f} s, latency p50 {result.p50_ms:.1f} ms "
            f"p99 {result.p99_ms:.1f} ms; leader {state.leader}, LEOs at the end {leos}, "
            f"all replicas equal {drain_s:.2f} s later; CPU s "
            + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()),
            flush=True,
        )
        return result

    def catchup(self, *, mib: int, threads: int) -> tuple[CatchupResult, int, int]:
        topic, state = self.create_topic(3)
        leader = state.leader
        follower = next(b for b in state.replicas if b != leader)
        self.produce(leader, topic, common_pb2.LEADER, threads=threads, appends=2 * threads)
        wait_for(
            lambda: self.leo(follower, topic) == self.leo(leader, topic),
            30.0,
            "the follower to be in sync before the pause",
        )
        process: TidelogProcess = self.cluster.brokers[follower]
        start_leo = self.leo(follower, topic)
        os.kill(process.pid, signal.SIGSTOP)
        try:
            appends = max(1, mib * MIB // len(self.batch))
            done, produce_s, _ = self.produce(
                leader, topic, common_pb2.LEADER, threads=threads, appends=appends
            )
            target = self.leo(leader, topic)
            # Let the other follower finish too, so only the catch-up runs while timed.
            other = next(b for b in state.replicas if b not in (leader, follower))
            wait_for(lambda: self.leo(other, topic) >= target, 60.0, "the other follower")
            meter = CpuMeter(self.process_pids())
            meter.start()
            t0 = time.perf_counter()
        finally:
            os.kill(process.pid, signal.SIGCONT)
        while self.leo(follower, topic) < target:
            time.sleep(0.01)
        elapsed = time.perf_counter() - t0
        cpu = meter.stop()
        behind_records = target - start_leo
        meter.start()
        replay_s = self.fetch_replay(leader, topic, start_leo, target)
        replay_cpu = meter.stop()
        result = CatchupResult(
            behind_bytes=done * len(self.batch),
            behind_records=behind_records,
            produce_mb_s=done * len(self.batch) / produce_s / MB,
            elapsed_s=elapsed,
            cpu_s=cpu,
            fetch_replay_s=replay_s,
            fetch_replay_cpu_s=replay_cpu,
        )
        print(
            f"catch-up: follower {follower} of leader {leader} was {result.behind_bytes / MIB:,.0f}"
            f" MiB ({behind_records:,} records) behind; caught up in {elapsed:.2f} s = "
            f"{result.mb_s:,.1f} MB/s ({result.records_s:,.0f} records/s); produced at "
            f"{result.produce_mb_s:,.1f} MB/s acks=1 while it was stopped; CPU s "
            + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
            + f"; the same range fetched by the client: {result.fetch_replay_mb_s:,.1f} MB/s "
            f"in {replay_s:.2f} s, CPU s "
            + ", ".join(f"{k} {v:.1f}" for k, v in replay_cpu.items()),
            flush=True,
        )
        return result, leader, follower

    def fetch_replay(self, leader: int, topic: str, start: int, end: int) -> float:
        """Seconds to read ``[start, end)`` from the leader with sequential Fetch calls.

        Same sizes as a replica fetcher (``PARTITION_FETCH_MAX_BYTES`` per partition,
        ``FETCH_MAX_BYTES`` per response), but as a consumer (replica_id -1) that only
        parses the response and computes the next offset, one call at a time: leader read
        + gRPC, without the follower's append and without its pipelining.
        """
        stub = self.cluster.brokers[leader].stub
        offset = start
        t0 = time.perf_counter()
        while offset < end:
            response = stub.Fetch(
                storage_pb2.FetchRequest(
                    replica_id=-1,
                    max_wait_ms=0,
                    min_bytes=1,
                    max_bytes=FETCH_MAX_BYTES,
                    partitions=[
                        storage_pb2.FetchPartition(
                            topic=topic,
                            partition=0,
                            fetch_offset=offset,
                            max_bytes=PARTITION_FETCH_MAX_BYTES,
                        )
                    ],
                ),
                timeout=RPC_TIMEOUT_S,
            )
            (result,) = response.partitions
            if int(result.error.code) != 0 or not result.records:
                raise RuntimeError(f"fetch at {offset} failed: {result.error}")
            offset = next_offset(result.records)
        return time.perf_counter() - t0


# --- report --------------------------------------------------------------------------------------


def machine_lines(directory: Path, load_before: str) -> list[str]:
    return [
        f"- CPU: {cpu_model()}, {cores()} cores, shared by every process of the run "
        "(etcd, controller, 3 storage nodes, the client)",
        f"- Memory: {memory_gib():.1f} GiB",
        f"- Data dirs: `{directory.parent / 'tidelog-repl-bench-*'}` on {filesystem_of(directory)}",
        f"- Python {platform.python_version()} ({platform.python_implementation()}), "
        f"Linux {platform.release()}",
        f"- Load average just before the run (1/5/15 min): {load_before}; the machine is "
        "shared with other jobs (e.g. test runs), which the figures include",
    ]


def ours(cpu_s: dict[str, float]) -> float:
    return sum(v for k, v in cpu_s.items() if k != "other")


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def report_markdown(
    results: list[ProduceResult],
    catchup: CatchupResult,
    command: str,
    directory: Path,
    *,
    seconds: float,
    threads: int,
    warmup_mb_s: tuple[float, int] | None,
    load_before: str,
) -> str:
    batch_bytes = results[0].batch_bytes
    records = results[0].records_per_batch
    lines = [
        SECTION_TITLE,
        "",
        "`bench/replication.py`: a real cluster on one machine -- etcd, one controller and",
        "three storage nodes, each its own process, started as the process-level tests do.",
        f"One batch of {records:,} 100-byte records ({batch_bytes:,} B) is encoded once and",
        "sent over and over with `Storage.Append` to the partition leader from",
        f"{threads} client threads (so {threads} appends are in flight), for {seconds:g} s per",
        "case after a short warm-up, each case on its own single-partition topic; RF=3",
        "topics have `min.insync.replicas=2`. MB/s is 10^6 bytes of batch per second;",
        "latency is per `Append` call, as the client sees it. Appends do not fsync.",
        "",
        f"Command: `{command}`",
        "",
        *machine_lines(directory, load_before),
        "",
        "| case | MB/s | records/s | appends | append latency p50 / p99 ms "
        "| follower lag at the end, records | s until all replicas equal |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.description} | {r.mb_s:,.1f} | {r.records_s:,.0f} | {r.appends:,} | "
            f"{r.p50_ms:.1f} / {r.p99_ms:.1f} | {r.max_lag_records:,} | {r.drain_s:.2f} |"
        )
    lines += [
        "",
        f"Follower catch-up: one follower of an RF=3 topic is paused (SIGSTOP) while "
        f"{catchup.behind_bytes / MIB:,.0f} MiB ({catchup.behind_records:,} records) are "
        f"appended with acks=1 (at {catchup.produce_mb_s:,.1f} MB/s), then resumed "
        "(SIGCONT); timed from the resume until its log end offset equals the leader's "
        "(`DescribeLogDirs` on the follower every 10 ms), with nothing else running.",
        "",
        "| catch-up | MiB behind | seconds | MB/s | records/s |",
        "|---|---:|---:|---:|---:|",
        f"| one follower, RF=3 | {catchup.behind_bytes / MIB:,.0f} | {catchup.elapsed_s:.2f} | "
        f"{catchup.mb_s:,.1f} | {catchup.records_s:,.0f} |",
        f"| the same range read by the client with sequential `Fetch` calls "
        f"({PARTITION_FETCH_MAX_BYTES // MIB} MiB per call, as the fetcher asks; no append, "
        "no pipelining) | "
        f"{catchup.behind_bytes / MIB:,.0f} | {catchup.fetch_replay_s:.2f} | "
        f"{catchup.fetch_replay_mb_s:,.1f} | "
        f"{catchup.behind_records / catchup.fetch_replay_s:,.0f} |",
        "",
    ]
    names = sorted({n for r in results for n in r.cpu_s if n.startswith("broker-")})  # broker-1..3
    lines += [
        "CPU milliseconds per MB produced, by process (from `/proc/PID/stat`; a MB is",
        "stored once per replica). Which broker leads differs per case (marked);",
        f"{cores()} cores give at most {cores() * 1000:,} CPU ms per second of wall time:",
        "",
        f"| case | client | {' | '.join(names)} | etcd + controller "
        "| cores busy, benchmark processes | cores busy, other jobs on the machine |",
        "|---|---:|" + "---:|" * len(names) + "---:|---:|---:|",
    ]
    for r in results:
        other = sum(v for k, v in r.cpu_s.items() if k == "etcd" or k.startswith("controller"))
        total_mb = r.appends * r.batch_bytes / MB
        lines.append(
            f"| {r.description} | {r.cpu_per_mb_ms('client'):.1f} | "
            + " | ".join(
                f"{r.cpu_per_mb_ms(n):.1f}" + (" (leader)" if n == r.leader_name else "")
                for n in names
            )
            + f" | {other * 1000 / total_mb:.1f} | {ours(r.cpu_s) / r.elapsed_s:.2f} | "
            f"{r.cpu_s.get('other', 0.0) / r.elapsed_s:.2f} |"
        )
    catchup_mb = catchup.behind_bytes / MB
    lines += [
        "",
        "During the catch-up: "
        + ", ".join(
            f"{k} {v * 1000 / catchup_mb:.1f}"
            for k, v in catchup.cpu_s.items()
            if v >= 0.05 and k != "other"
        )
        + " CPU ms per MB caught up; "
        f"{ours(catchup.cpu_s) / catchup.elapsed_s:.2f} of {cores()} cores"
        f" busy with the benchmark, {catchup.cpu_s.get('other', 0.0) / catchup.elapsed_s:.2f}"
        " with other jobs.",
        "",
    ]
    by_label = {r.label: r for r in results}
    all_mb_s = by_label["rf3-all"].mb_s
    lines += [
        "Targets (replication issue):",
        "",
        "| target | measured | |",
        "|---|---|---|",
        f"| RF=3 acks=all >= {TARGET_ALL_MB_S} MB/s, 100-byte records in 1 MiB batches | "
        f"{all_mb_s:,.1f} MB/s | {verdict(all_mb_s >= TARGET_ALL_MB_S)} |",
        f"| follower catch-up >= {TARGET_CATCHUP_MB_S} MB/s | {catchup.mb_s:,.1f} MB/s | "
        f"{verdict(catchup.mb_s >= TARGET_CATCHUP_MB_S)} |",
        "",
    ]
    if warmup_mb_s is not None:
        lines += [
            f"First-touch check: a {warmup_mb_s[1]:,} MiB scratch file written with plain pwrite "
            f"and deleted before the runs went at {warmup_mb_s[0]:,.0f} MB/s.",
            "",
        ]
    lines += [
        "Page cache on this VM: never-touched guest memory faults in at ~400 MB/s (see the",
        "storage-engine section) and free page reporting is on, so part of the brokers'",
        "page-cache writes and fresh buffers may pay that price; it is included above.",
        "Figures vary by 20-40% between runs on this shared machine.",
        "",
    ]
    return "\n".join(lines)


def write_docs(section: str, path: Path = DOCS_PATH) -> None:
    """Replace (or add) the "Replication" section of docs/BENCHMARKS.md."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n\n"
    pattern = re.compile(rf"^{re.escape(SECTION_TITLE)}\n.*?(?=^## |\Z)", re.M | re.S)
    block = section.rstrip("\n") + "\n\n"
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text.rstrip("\n") + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replication", description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per produce case")
    parser.add_argument("--threads", type=int, default=4, help="client threads (in-flight appends)")
    parser.add_argument("--catchup-mib", type=int, default=256, help="MiB the follower misses")
    parser.add_argument("--warmup-mib", type=int, default=0, help="first-touch scratch file")
    parser.add_argument("--dir", type=Path, default=None, help="parent of the temp dir")
    parser.add_argument("--keep", action="store_true", help="keep the data dirs and logs")
    parser.add_argument("--write-docs", action="store_true", help="update docs/BENCHMARKS.md")
    args = parser.parse_args(argv)

    directory = Path(tempfile.mkdtemp(prefix="tidelog-repl-bench-", dir=args.dir))
    batch, records = build_batch(MIB)
    print(f"batch: {records:,} records, {len(batch):,} bytes; dir {directory}", flush=True)
    warmup = None
    load_before = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    try:
        if args.warmup_mib > 0:
            warmup = raw_pwrite_mb_s(directory, os.urandom(MIB), args.warmup_mib)
            print(f"first-touch warm-up: {warmup:,.0f} MB/s raw pwrite", flush=True)
        with TestCluster(directory, cluster="bench", session_ttl_s=SESSION_TTL_S) as cluster:
            for broker_id in (1, 2, 3):
                cluster.start_broker(broker_id)
            cluster.start_controller(1)
            cluster.wait_brokers([1, 2, 3], timeout_s=60.0)
            bench = Bench(cluster, batch, records)
            cases = [
                ("rf1-acks1", "RF=1, acks=1 (no replication)", 1, common_pb2.LEADER, "1"),
                ("rf3-acks1", "RF=3, acks=1", 3, common_pb2.LEADER, "1"),
                ("rf3-all", "RF=3, acks=all, min.insync.replicas=2", 3, common_pb2.ALL, "all"),
            ]
            results = [
                bench.throughput(
                    label, desc, rf, acks, acks_name, seconds=args.seconds, threads=args.threads
                )
                for label, desc, rf, acks, acks_name in cases
            ]
            catchup, _, _ = bench.catchup(mib=args.catchup_mib, threads=args.threads)
    finally:
        if args.keep:
            print(f"kept {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)

    argv_shown = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"PYTHONPATH=. .venv/bin/python -m bench.replication {argv_shown}".strip()
    section = report_markdown(
        results,
        catchup,
        command,
        directory,
        seconds=args.seconds,
        threads=args.threads,
        warmup_mb_s=(warmup, args.warmup_mib) if warmup is not None else None,
        load_before=load_before,
    )
    print()
    print(section)
    if args.write_docs:
        write_docs(section)
        print(f"wrote {DOCS_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
