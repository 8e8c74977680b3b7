"""Scale benchmark: a three-broker cluster with many partitions.

Starts a real cluster on this machine, the way the process-level tests do
(``tests.support.cluster.TestCluster``): a private etcd, one controller, three storage nodes
and one gateway, each its own ``python -m tidelog`` process on 127.0.0.1; the benchmark
client is one more process, and all of them share the machine's cores. The storage nodes
and the controller run with the product's session TTL (``--session-ttl-s``, 10 s), so the
failover below includes the wait for a dead broker's lease to expire.

``--partitions`` partitions (default 3,000) are spread over ``--topics`` topics (default 3,
so 3 x 1,000), replication factor ``--rf`` (default 3): with three brokers and RF=3 each
broker hosts a replica of every partition and leads about a third of them. Measured:

1. **Topic creation**: the ``CreateTopics`` calls (one per topic, each waiting up to 60 s
   for the brokers to acknowledge), and the time from the first call until every
   partition is ready: the controller's metadata gives it a leader and a full ISR, every
   broker lists its replicas in ``DescribeLogDirs`` and the leader reports ``is_leader``,
   and the gateway's ``Metadata`` names the same leaders. Then ``--small-topics`` (100)
   single-partition topics are created one by one, each until its leader answers as
   leader (ms per topic, while the big topics exist).
2. **Idle CPU**: CPU seconds of each process (``/proc/PID/stat``) over ``--idle-s`` seconds
   without traffic, as % of one core: once right after the cluster starts (no topics) and
   once with every partition created and its ISR full; with the resident memory, threads
   and open file descriptors of each process at the end of the idle period.
3. **acks=all produce to every partition**: one 100-byte record to each partition with
   ``tidelog.producer.Producer`` (``acks="all"``, idempotent, the SDK's defaults
   otherwise), from the first ``send`` until ``flush`` returns; each future is checked
   (an offset, no error). Two rounds through the gateway, then two in direct mode
   (``direct=True``: appends go to the leaders, the gateway still gives metadata). The
   first round of each mode also opens the streams and, in direct mode, learns the
   leaders; the partition counts are looked up before the clock starts.
4. **Recovery**: broker ``--victim`` is killed with SIGKILL; timed from the kill until the
   controller shows no partition led by it (failover) and none with it in the ISR. It is
   then restarted on the same data directory; timed from the restart until it prints its
   listening line (logs loaded, registered in etcd), until its health check answers
   SERVING, until the controller lists it as live, and until it is back in the ISR of
   every partition it hosts. Leadership does not move back (no preferred election within
   the run). Then one acks=all record to every partition through the gateway again.

Every wait has a deadline (``--timeout-s``); a section that fails is reported as such and
the rest still run; the cluster is always shut down.

Run: ``PYTHONPATH=. python -m bench.scale [--partitions N] [--rf 3] [--idle-s 20]
[--write-docs]`` (``--skip-small-topics``, ``--skip-idle``, ``--skip-produce``,
``--skip-direct``, ``--skip-recovery`` leave sections out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import grpc

from bench.gateway import DOCS_PATH, write_docs
from bench.replication import CpuMeter, machine_lines, percentile
from tests.support.cluster import GatewayProcess, TestCluster
from tests.support.process import wait_healthy
from tidelog.errors import ErrorCode, TidelogError
from tidelog.producer import Producer, RecordMetadata
from tidelog.v1 import common_pb2, controller_pb2, controller_pb2_grpc, storage_pb2

T = TypeVar("T")
TopicPartition = tuple[str, int]
States = dict[TopicPartition, common_pb2.PartitionState]

SECTION_TITLE = "## Scale: many partitions"
BROKERS = (1, 2, 3)
SESSION_TTL_S = 10  # the product's default (tidelog storage/controller --session-ttl-s)
RPC_TIMEOUT_S = 60.0
CREATE_WAIT_MS = 60_000  # CreateTopics: wait this long for the brokers (the controller's max)
RECORD = b"x" * 100
BIG_PREFIX = "scale-"
SMALL_PREFIX = "scale-single-"
PROGRESS_EVERY_S = 5.0


def default_workdir() -> Path:
    work_tmp = Path("/work/tmp")
    return work_tmp if work_tmp.is_dir() else Path(tempfile.gettempdir())


# --- results -------------------------------------------------------------------------------------


@dataclass
class CreationResult:
    topics: dict[str, int]  # name -> partitions
    replication_factor: int
    calls_s: list[float]  # each CreateTopics call
    ready_s: float  # from the first call until every partition was ready


@dataclass
class SmallTopicsResult:
    call_ms: list[float]  # each CreateTopics call
    ready_ms: list[float]  # each call plus the wait until the leader answered as leader


@dataclass
class ProcessSnapshot:
    cpu_s: float
    rss_mib: float
    threads: int
    fds: int


@dataclass
class IdleResult:
    label: str
    seconds: float
    processes: dict[str, ProcessSnapshot]
    other_cpu_s: float  # the rest of the machine (other jobs)

    def percent(self, name: str) -> float:
        return self.processes[name].cpu_s / self.seconds * 100


@dataclass
class ProduceRound:
    mode: str
    round: int
    partitions: int
    seconds: float
    acked: int
    errors: Counter[str]
    flush_timed_out: bool

    @property
    def ok(self) -> bool:
        return self.acked == self.partitions and not self.errors and not self.flush_timed_out


@dataclass
class RecoveryResult:
    victim: int
    led: int  # partitions the victim led before the kill
    hosted: int  # partitions with a replica on the victim
    failover_s: float  # kill -> the controller shows no partition led by the victim
    isr_shrunk_s: float  # kill -> the victim in no ISR
    listening_s: float  # restart -> the listening line (logs loaded, registered)
    healthy_s: float  # restart -> health SERVING
    registered_s: float  # restart -> the controller lists it as live
    isr_s: float  # restart -> back in the ISR of every partition it hosts
    cpu_s: dict[str, float] = field(default_factory=dict)  # restart -> ISR, per process
    after: ProduceRound | None = None


@dataclass
class Results:
    creation: CreationResult | None = None
    small: SmallTopicsResult | None = None
    idle: list[IdleResult] = field(default_factory=list)
    produce: list[ProduceRound] = field(default_factory=list)
    recovery: RecoveryResult | None = None
    failures: dict[str, str] = field(default_factory=dict)  # section -> error
    log_levels: dict[str, Counter[str]] = field(default_factory=dict)  # process -> counts
    log_events: Counter[str] = field(default_factory=Counter)  # "level event" at warning+


# --- polling -------------------------------------------------------------------------------------


def until(
    check: Callable[[], tuple[bool, str]],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = 0.1,
) -> float:
    """Seconds until ``check()`` returns (True, _), polled every ``interval_s``.

    ``check`` returns (done, a short status); the status is printed every few seconds
    while waiting and is in the ``TimeoutError`` raised once ``timeout_s`` passed. An RPC
    error or a lookup failure counts as "not yet" (a process may be restarting).
    """
    start = time.perf_counter()
    last_print = start
    status = "not checked yet"
    while True:
        try:
            done, status = check()
        except (grpc.RpcError, LookupError) as exc:
            done, status = False, f"{type(exc).__name__}: {str(exc).strip()[:200]}"
        now = time.perf_counter()
        if done:
            return now - start
        if now - start > timeout_s:
            raise TimeoutError(f"{what}: not reached in {timeout_s:.0f} s; last status: {status}")
        if now - last_print >= PROGRESS_EVERY_S:
            print(f"  ... {now - start:5.1f} s waiting for {what}: {status}", flush=True)
            last_print = now
        time.sleep(interval_s)


# --- /proc ---------------------------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, str]:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


# --- the benchmark -------------------------------------------------------------------------------


class Bench:
    def __init__(self, cluster: TestCluster, gateway: GatewayProcess, timeout_s: float) -> None:
        self.cluster = cluster
        self.gateway = gateway
        self.timeout_s = timeout_s
        self.topics: dict[str, int] = {}  # every topic created: name -> partitions
        self.replication_factor = 0

    @property
    def controller(self) -> controller_pb2_grpc.ControllerStub:
        return self.cluster.active_controller().stub

    def process_pids(self) -> dict[str, int]:
        pids: dict[str, int] = {}
        for broker_id, broker in sorted(self.cluster.brokers.items()):
            pids[f"broker-{broker_id}"] = broker.pid
        for controller_id, controller in sorted(self.cluster.controllers.items()):
            pids[f"controller-{controller_id}"] = controller.pid
        for index, gateway in enumerate(self.cluster.gateways):
            pids["gateway" if index == 0 else f"gateway-{index}"] = gateway.pid
        pids["etcd"] = self.cluster.etcd.pid or 0
        pids["client"] = os.getpid()
        return pids

    def check_alive(self) -> None:
        """Raise if a process of the cluster has exited (crashed)."""
        for name, process in (
            *((f"broker-{b}", p) for b, p in self.cluster.brokers.items()),
            *((f"controller-{c}", p) for c, p in self.cluster.controllers.items()),
            *((f"gateway-{i}", p) for i, p in enumerate(self.cluster.gateways)),
        ):
            status = process.proc.poll()
            if status is not None:
                raise RuntimeError(f"{name} exited with status {status}:\n{process.log_tail(20)}")

    # --- views of the cluster -------------------------------------------------------------

    def controller_states(
        self, topics: Sequence[str], stub: controller_pb2_grpc.ControllerStub | None = None
    ) -> States:
        response = (stub or self.controller).Metadata(
            controller_pb2.MetadataRequest(topics=list(topics)), timeout=RPC_TIMEOUT_S
        )
        states: States = {}
        for topic in response.topics:
            if int(topic.error.code) != ErrorCode.NONE:
                raise LookupError(f"topic {topic.name}: {topic.error}")
            for state in topic.partitions:
                states[(topic.name, state.partition)] = state
        return states

    def broker_logs(
        self, broker_id: int, partitions: Sequence[TopicPartition] = ()
    ) -> dict[TopicPartition, storage_pb2.LogDescription]:
        """What the broker hosts (``partitions``; all when empty), from DescribeLogDirs."""
        response = self.cluster.brokers[broker_id].stub.DescribeLogDirs(
            storage_pb2.DescribeLogDirsRequest(
                partitions=[common_pb2.TopicPartition(topic=t, partition=p) for t, p in partitions]
            ),
            timeout=RPC_TIMEOUT_S,
        )
        return {
            (log.topic, log.partition): log
            for log_dir in response.log_dirs
            for log in log_dir.partitions
        }

    def gateway_leaders(self, topics: Sequence[str]) -> dict[TopicPartition, int]:
        response = self.gateway.stub.Metadata(
            controller_pb2.MetadataRequest(topics=list(topics)), timeout=RPC_TIMEOUT_S
        )
        return {
            (topic.name, state.partition): state.leader
            for topic in response.topics
            for state in topic.partitions
        }

    def readiness(self, topics: dict[str, int], rf: int) -> tuple[bool, str]:
        """Is every partition of ``topics`` led, with a full ISR, in the brokers' and the
        gateway's views too? (done, what is missing)"""
        expected = sum(topics.values())
        states = self.controller_states(list(topics))
        no_leader = sum(1 for s in states.values() if s.leader < 0)
        short_isr = sum(1 for s in states.values() if len(s.isr) < rf)
        if len(states) < expected or no_leader or short_isr:
            return False, (
                f"controller: {len(states)}/{expected} partitions, {no_leader} without a "
                f"leader, {short_isr} with an ISR short of {rf}"
            )
        for broker_id in sorted(self.cluster.brokers):
            logs = self.broker_logs(broker_id)
            hosted = [tp for tp, s in states.items() if broker_id in s.replicas]
            missing = sum(1 for tp in hosted if tp not in logs)
            not_leading = sum(
                1
                for tp, s in states.items()
                if s.leader == broker_id and not (tp in logs and logs[tp].is_leader)
            )
            if missing or not_leading:
                return False, (
                    f"broker-{broker_id}: {len(hosted) - missing}/{len(hosted)} replicas "
                    f"present, {not_leading} partitions it should lead not yet led"
                )
        leaders = self.gateway_leaders(list(topics))
        stale = sum(1 for tp, s in states.items() if leaders.get(tp) != s.leader)
        if stale:
            return False, f"gateway: {stale}/{expected} leaders differ from the controller's"
        return True, "ready"

    # --- 1. topic creation ----------------------------------------------------------------

    def create_topic(
        self,
        name: str,
        partitions: int,
        rf: int,
        stub: controller_pb2_grpc.ControllerStub | None = None,
    ) -> None:
        response = (stub or self.controller).CreateTopics(
            controller_pb2.CreateTopicsRequest(
                topics=[
                    controller_pb2.CreatableTopic(
                        name=name, num_partitions=partitions, replication_factor=rf
                    )
                ],
                timeout_ms=CREATE_WAIT_MS,
            ),
            timeout=CREATE_WAIT_MS / 1000 + RPC_TIMEOUT_S,
        )
        (result,) = response.topics
        if int(result.error.code) != ErrorCode.NONE:
            raise RuntimeError(f"CreateTopics {name}: {result.error}")
        self.topics[name] = partitions
        self.replication_factor = max(self.replication_factor, rf)

    def create_big(self, partitions: int, topic_count: int, rf: int) -> CreationResult:
        topic_count = max(1, min(topic_count, partitions))
        sizes = [
            partitions // topic_count + (1 if i < partitions % topic_count else 0)
            for i in range(topic_count)
        ]
        topics = {f"{BIG_PREFIX}{i}": n for i, n in enumerate(sizes)}
        calls: list[float] = []
        start = time.perf_counter()
        for name, n in topics.items():
            t0 = time.perf_counter()
            self.create_topic(name, n, rf)
            calls.append(time.perf_counter() - t0)
            print(
                f"  CreateTopics {name} ({n:,} partitions, RF={rf}): {calls[-1]:.2f} s", flush=True
            )
        until(
            lambda: self.readiness(topics, rf),
            self.timeout_s,
            "every partition ready",
            interval_s=0.2,
        )
        ready = time.perf_counter() - start
        result = CreationResult(topics, rf, calls, ready)
        print(
            f"creation: {sum(topics.values()):,} partitions in {topic_count} topics, RF={rf}: "
            f"CreateTopics calls {sum(calls):.2f} s, all ready {ready:.2f} s after the first call",
            flush=True,
        )
        return result

    def create_small(self, count: int, rf: int) -> SmallTopicsResult:
        stub = self.controller
        call_ms: list[float] = []
        ready_ms: list[float] = []

        for i in range(count):
            name = f"{SMALL_PREFIX}{i}"
            t0 = time.perf_counter()
            self.create_topic(name, 1, rf, stub)
            call_ms.append((time.perf_counter() - t0) * 1000)

            def led(name: str = name) -> tuple[bool, str]:
                (state,) = self.controller_states([name], stub).values()
                if state.leader < 0 or len(state.isr) < rf:
                    return False, f"leader {state.leader}, ISR {list(state.isr)}"
                logs = self.broker_logs(state.leader, [(name, 0)])
                log = logs.get((name, 0))
                return (log is not None and log.is_leader), f"leader {state.leader} not leading"

            until(led, self.timeout_s, f"topic {name} led", interval_s=0.005)
            ready_ms.append((time.perf_counter() - t0) * 1000)
        result = SmallTopicsResult(call_ms, ready_ms)
        print(
            f"{count} single-partition topics one by one: CreateTopics "
            f"{sum(call_ms) / count:.1f} ms mean, until led {sum(ready_ms) / count:.1f} ms mean "
            f"(p50 {percentile(sorted(ready_ms), 0.5):.1f}, max {max(ready_ms):.1f})",
            flush=True,
        )
        return result

    # --- 2. idle CPU ----------------------------------------------------------------------

    def idle(self, seconds: float, label: str) -> IdleResult:
        if self.topics:
            # Everything replicated before the clock starts (ISR full everywhere).
            until(
                lambda: self.readiness(self.topics, self.replication_factor),
                self.timeout_s,
                "every partition ready before the idle period",
                interval_s=0.5,
            )
        pids = self.process_pids()
        del pids["client"]  # asleep, by construction
        meter = CpuMeter(pids)
        meter.start()
        t0 = time.perf_counter()
        time.sleep(seconds)
        used = meter.stop()
        elapsed = time.perf_counter() - t0
        processes = {}
        for name, pid in pids.items():
            status = proc_status(pid)
            rss_kib = int(status.get("VmRSS", "0 kB").split()[0])
            processes[name] = ProcessSnapshot(
                cpu_s=used[name],
                rss_mib=rss_kib / 1024,
                threads=int(status.get("Threads", "0")),
                fds=open_fds(pid),
            )
        result = IdleResult(label, elapsed, processes, used.get("other", 0.0))
        print(
            f"idle ({label}), {elapsed:.1f} s: "
            + ", ".join(
                f"{n} {result.percent(n):.1f}% CPU {p.rss_mib:,.0f} MiB {p.threads} threads "
                f"{p.fds} fds"
                for n, p in processes.items()
            ),
            flush=True,
        )
        return result

    # --- 3. produce -----------------------------------------------------------------------

    def produce_rounds(
        self, topics: dict[str, int], *, direct: bool, rounds: int
    ) -> list[ProduceRound]:
        mode = "direct" if direct else "gateway"
        producer = Producer(
            self.gateway.address,
            acks="all",
            direct=direct,
            client_id=f"scale-bench-{mode}",
        )
        results: list[ProduceRound] = []
        try:
            for topic in topics:
                producer.partitions_for(topic)  # partition counts known before the clock
            for index in range(1, rounds + 1):
                results.append(self.produce_round(producer, topics, mode, index))
        finally:
            producer.close(timeout_s=30.0)
        return results

    def produce_round(
        self, producer: Producer, topics: dict[str, int], mode: str, index: int
    ) -> ProduceRound:
        futures: list[tuple[str, int, Future[RecordMetadata]]] = []
        timed_out = False
        t0 = time.perf_counter()
        for topic, count in topics.items():
            for partition in range(count):
                futures.append(
                    (topic, partition, producer.send(topic, RECORD, partition=partition))
                )
        try:
            producer.flush(timeout_s=self.timeout_s)
        except TidelogError as exc:  # RequestTimedOutError
            timed_out = True
            print(f"  flush: {exc}", flush=True)
        elapsed = time.perf_counter() - t0
        errors: Counter[str] = Counter()
        acked = 0
        for topic, partition, future in futures:
            if not future.done():
                errors["not completed"] += 1
                continue
            failure = future.exception()
            if failure is not None:
                errors[f"{type(failure).__name__}: {str(failure)[:120]}"] += 1
                continue
            metadata = future.result()
            if metadata.topic != topic or metadata.partition != partition or metadata.offset < 0:
                errors[f"bad metadata {metadata}"] += 1
                continue
            acked += 1
        result = ProduceRound(mode, index, len(futures), elapsed, acked, errors, timed_out)
        print(
            f"produce acks=all to every partition, {mode} round {index}: {acked:,}/"
            f"{len(futures):,} acknowledged in {elapsed:.2f} s"
            + (f"; errors: {dict(errors.most_common(5))}" if errors else "")
            + ("; flush timed out" if timed_out else ""),
            flush=True,
        )
        return result

    # --- 4. recovery ----------------------------------------------------------------------

    def recovery(self, victim: int, *, produce_after: bool) -> RecoveryResult:
        topics = list(self.topics)
        states = self.controller_states(topics)
        led = sum(1 for s in states.values() if s.leader == victim)
        hosted = [tp for tp, s in states.items() if victim in s.replicas]
        survivors = [b for b in self.cluster.brokers if b != victim]
        print(
            f"recovery: broker-{victim} leads {led:,} and hosts {len(hosted):,} partitions; "
            "kill -9",
            flush=True,
        )

        t_kill = time.perf_counter()
        self.cluster.kill(self.cluster.brokers[victim])

        def failed_over() -> tuple[bool, str]:
            now = self.controller_states(topics)
            still = sum(1 for s in now.values() if s.leader == victim)
            leaderless = sum(1 for s in now.values() if s.leader < 0)
            return (still == 0 and leaderless == 0), (
                f"{still} partitions still led by broker-{victim}, {leaderless} without a leader"
            )

        failover_s = until(failed_over, self.timeout_s, "leaders moved off the killed broker")

        def isr_shrunk() -> tuple[bool, str]:
            now = self.controller_states(topics)
            still = sum(1 for s in now.values() if victim in s.isr)
            return still == 0, f"broker-{victim} still in {still} ISRs"

        until(isr_shrunk, self.timeout_s, "the killed broker out of every ISR")
        isr_shrunk_s = time.perf_counter() - t_kill
        print(
            f"  failover {failover_s:.2f} s after the kill, out of every ISR {isr_shrunk_s:.2f} s",
            flush=True,
        )
        self.cluster.wait_brokers(survivors, timeout_s=self.timeout_s)

        t_start = time.perf_counter()
        node = self.cluster.start_broker(victim, wait=False)
        meter = CpuMeter(self.process_pids())
        meter.start()
        node.wait_listening(self.timeout_s)
        listening_s = time.perf_counter() - t_start
        wait_healthy(node.address, "tidelog.v1.Storage", self.timeout_s)
        healthy_s = time.perf_counter() - t_start

        def registered() -> tuple[bool, str]:
            live = [b.broker_id for b in self.cluster.describe_cluster().brokers]
            return victim in live, f"live brokers {sorted(live)}"

        until(
            registered, self.timeout_s, f"the controller to list broker-{victim}", interval_s=0.02
        )
        registered_s = time.perf_counter() - t_start

        def back_in_isr() -> tuple[bool, str]:
            now = self.controller_states(topics)
            missing = sum(1 for tp in hosted if victim not in now[tp].isr)
            return missing == 0, f"broker-{victim} missing from {missing}/{len(hosted)} ISRs"

        until(back_in_isr, self.timeout_s, f"broker-{victim} back in every ISR", interval_s=0.1)
        isr_s = time.perf_counter() - t_start
        cpu = meter.stop()
        result = RecoveryResult(
            victim=victim,
            led=led,
            hosted=len(hosted),
            failover_s=failover_s,
            isr_shrunk_s=isr_shrunk_s,
            listening_s=listening_s,
            healthy_s=healthy_s,
            registered_s=registered_s,
            isr_s=isr_s,
            cpu_s=cpu,
        )
        print(
            f"  restart: listening {listening_s:.2f} s, healthy {healthy_s:.2f} s, registered "
            f"{registered_s:.2f} s, back in every ISR {isr_s:.2f} s; CPU s "
            + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()),
            flush=True,
        )
        if produce_after:
            (result.after,) = self.produce_rounds(self.topics, direct=False, rounds=1)
        return result


# --- logs ----------------------------------------------------------------------------------------


def scan_logs(directory: Path, results: Results) -> None:
    """Count the services' JSON log lines by level, and warning+ events by name."""
    for path in sorted(directory.glob("*.stderr.log")):
        name = path.name.removesuffix(".stderr.log")
        levels: Counter[str] = Counter()
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                levels["(not JSON)"] += 1
                continue
            if not isinstance(entry, dict):
                continue
            level = str(entry.get("level", "?"))
            levels[level] += 1
            if level in ("warning", "error", "critical"):
                results.log_events[f"{level} {entry.get('event', '?')} ({name})"] += 1
        results.log_levels[name] = levels


# --- report --------------------------------------------------------------------------------------


def scale_machine_lines(directory: Path, load_before: str) -> list[str]:
    """``bench.replication.machine_lines``, naming this benchmark's processes and dirs."""
    return [
        line.replace("tidelog-repl-bench-*", "tidelog-scale-bench-*").replace(
            "(etcd, controller, 3 storage nodes, the client)",
            "(etcd, controller, gateway, 3 storage nodes, the client)",
        )
        for line in machine_lines(directory, load_before)
    ]


def stats_ms(values: list[float]) -> str:
    ordered = sorted(values)
    return (
        f"{sum(values) / len(values):,.1f} ms mean (p50 {percentile(ordered, 0.5):,.1f}, "
        f"p99 {percentile(ordered, 0.99):,.1f}, max {ordered[-1]:,.1f})"
    )


def produce_cell(r: ProduceRound) -> str:
    cell = f"{r.seconds:.2f} s, {r.acked:,}/{r.partitions:,} acknowledged"
    if r.errors:
        cell += "; **errors**: " + "; ".join(f"{n} x {e}" for e, n in r.errors.most_common(3))
    if r.flush_timed_out:
        cell += "; **flush timed out**"
    return cell


def report_markdown(
    results: Results,
    command: str,
    directory: Path,
    *,
    args: argparse.Namespace,
    load_before: str,
    total_s: float,
) -> str:
    creation = results.creation
    partitions = sum(creation.topics.values()) if creation else args.partitions
    rf = creation.replication_factor if creation else args.rf
    lines = [
        SECTION_TITLE,
        "",
        "`bench/scale.py`: a real cluster on one machine -- etcd, one controller, three",
        "storage nodes and one gateway, each its own process, started as the process-level",
        f"tests do, with the product's session TTL ({SESSION_TTL_S} s).",
        f"{partitions:,} partitions in {len(creation.topics) if creation else args.topics} "
        f"topics, RF={rf}: each broker hosts {partitions * rf // len(BROKERS):,} replicas",
        f"and leads about {partitions // len(BROKERS):,} partitions. Wall times as the",
        "benchmark client sees them; waits poll the cluster (every 5 ms to 200 ms), so a",
        "time includes up to one poll interval and the cost of the check itself.",
        "",
        f"Command: `{command}` (whole run {total_s / 60:.1f} min)",
        "",
        *scale_machine_lines(directory, load_before),
        "",
        "| measurement | result | what is timed |",
        "|---|---|---|",
    ]
    if creation is not None:
        topic_desc = " + ".join(f"{n:,}" for n in creation.topics.values())
        lines.append(
            f"| create {len(creation.topics)} topics ({topic_desc} partitions), RF={rf} | "
            f"**{creation.ready_s:.1f} s** until every partition is ready; the "
            f"`CreateTopics` calls {' + '.join(f'{c:.1f}' for c in creation.calls_s)} s | "
            "from the first call (one per topic, each waiting for the brokers) until the "
            "controller gives every partition a leader and a full ISR, every broker lists "
            "its replicas (`DescribeLogDirs`) and reports leading the partitions it leads, "
            "and the gateway's `Metadata` names the same leaders |"
        )
    if results.small is not None:
        small = results.small
        lines.append(
            f"| create {len(small.ready_ms)} single-partition RF={rf} topics one by one, "
            f"with the {partitions:,} partitions above in place | "
            f"**{stats_ms(small.ready_ms)}** per topic; the call alone "
            f"{sum(small.call_ms) / len(small.call_ms):,.1f} ms mean | "
            "each `CreateTopics` call plus the wait until the controller shows a leader and "
            "a full ISR and the leader reports leading it (`DescribeLogDirs`, polled every "
            "5 ms) |"
        )
    idle_full = next((r for r in results.idle if r.label == "full"), None)
    if idle_full is not None:
        brokers = [n for n in idle_full.processes if n.startswith("broker-")]
        lines.append(
            f"| idle CPU with {partitions:,} partitions, ISR full | brokers "
            + " / ".join(f"**{idle_full.percent(n):.1f}%**" for n in brokers)
            + ", controller "
            + " / ".join(
                f"{idle_full.percent(n):.1f}%" for n in idle_full.processes if "controller" in n
            )
            + f", gateway {idle_full.percent('gateway'):.1f}%, etcd "
            f"{idle_full.percent('etcd'):.1f}% of one core | CPU seconds (`/proc/PID/stat`) "
            f"over {idle_full.seconds:.0f} s without traffic (per process below) |"
        )
    for r in results.produce:
        if r.mode == "gateway":
            via = "through the gateway"
            how = "one `ProduceStream` to the gateway, each request naming many partitions"
        else:
            via = "direct mode (`direct=True`)"
            how = (
                "a leader's partitions ready together in one `AppendMany` (four or more, "
                "none in flight), the others one `Append` each on one `AppendStream` per leader"
            )
        if r.round == 1:
            timed = (
                '`Producer(acks="all")` (idempotent, SDK defaults): from the first `send` '
                f"until `flush()` returns, every future checked; {how}; this round also opens "
                "the streams" + (" and learns the leaders" if r.mode == "direct" else "")
            )
        else:
            timed = "the same producer again"
        lines.append(
            f"| acks=all, one 100-byte record to each of the {r.partitions:,} partitions, "
            f"{via}, {'first' if r.round == 1 else 'second'} round | **{produce_cell(r)}** "
            f"| {timed} |"
        )
    recovery = results.recovery
    if recovery is not None:
        v = f"broker-{recovery.victim}"
        lines += [
            f"| failover: kill -9 {v} (leading {recovery.led:,}, hosting {recovery.hosted:,}) | "
            f"**{recovery.failover_s:.1f} s** until no partition is led by it; "
            f"{recovery.isr_shrunk_s:.1f} s until it is in no ISR | from the kill, controller "
            f"`Metadata` (includes waiting for its {SESSION_TTL_S} s session lease to expire) |",
            f"| restart of {v} on its data dir: serving | **{recovery.healthy_s:.1f} s** "
            f"(listening line {recovery.listening_s:.1f} s) | from the restart until its "
            "health check answers SERVING (logs loaded, registered in etcd) |",
            f"| restart of {v}: live for the controller | {recovery.registered_s:.1f} s | "
            "from the restart until `DescribeCluster` lists it |",
            f"| restart of {v}: back in every ISR | **{recovery.isr_s:.1f} s** | from the "
            f"restart until it is in the ISR of all {recovery.hosted:,} partitions it hosts "
            "(the single-partition topics included; controller `Metadata`); leadership does "
            "not move back within the run |",
        ]
        if recovery.after is not None:
            lines.append(
                f"| acks=all, one record to each of the {recovery.after.partitions:,} "
                "partitions after the recovery, through the gateway | "
                f"{produce_cell(recovery.after)} | as the first gateway round, a new producer |"
            )
    for section, error in results.failures.items():
        lines.append(f"| {section} | **failed**: {error.splitlines()[0][:300]} | |")
    lines.append("")
    if results.idle:
        names = list(results.idle[0].processes)
        header = "| process | " + " | ".join(
            f"idle CPU, {'no topics' if r.label == 'baseline' else f'{partitions:,} partitions'}"
            for r in results.idle
        )
        lines += [
            "Idle, per process: % of one core over the idle period; memory, threads and open",
            "file descriptors at its end (from `/proc`).",
            "",
            header + " | RSS MiB | threads | open fds |",
            "|---|" + "---:|" * (len(results.idle) + 3),
        ]
        last = results.idle[-1]
        for name in names:
            snapshot = last.processes[name]
            lines.append(
                f"| {name} | "
                + " | ".join(f"{r.percent(name):.1f}%" for r in results.idle)
                + f" | {snapshot.rss_mib:,.0f} | {snapshot.threads} | {snapshot.fds:,} |"
            )
        lines.append(
            "| other jobs on the machine | "
            + " | ".join(f"{r.other_cpu_s / r.seconds * 100:.1f}%" for r in results.idle)
            + " | | | |"
        )
        lines.append("")
    if recovery is not None and recovery.cpu_s:
        busy = ", ".join(
            f"{k} {v:.1f}" for k, v in recovery.cpu_s.items() if v >= 0.05 and k != "other"
        )
        lines += [f"CPU seconds from the restart until back in every ISR: {busy}.", ""]
    warnings = sum(n for c in results.log_levels.values() for lvl, n in c.items() if lvl != "info")
    if results.log_events:
        top = "; ".join(f"{n} x {e}" for e, n in results.log_events.most_common(8))
        lines += [f"Service log lines at warning or above during the run: {top}.", ""]
    elif results.log_levels:
        lines += [f"Service log lines at warning or above during the run: {warnings}.", ""]
    return "\n".join(lines)


# --- main ----------------------------------------------------------------------------------------


def run_section(results: Results, name: str, bench: Bench | None, fn: Callable[[], T]) -> T | None:
    """``fn()``, or None with the failure recorded (and the service logs' tails printed)."""
    print(f"\n== {name}", flush=True)
    try:
        value = fn()
        if bench is not None:
            bench.check_alive()
        return value
    except Exception as exc:
        traceback.print_exc()
        results.failures[name] = f"{type(exc).__name__}: {exc}"
        if bench is not None:
            print(bench.cluster.logs(), file=sys.stderr, flush=True)
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    parser.add_argument("--partitions", type=int, default=3000, help="partitions in total")
    parser.add_argument("--topics", type=int, default=3, help="topics they are spread over")
    parser.add_argument("--rf", type=int, default=3, help="replication factor (<= 3)")
    parser.add_argument("--idle-s", type=float, default=20.0, help="seconds of each idle period")
    parser.add_argument("--small-topics", type=int, default=100, help="topics created one by one")
    parser.add_argument("--victim", type=int, default=2, choices=BROKERS, help="broker to kill")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="deadline of each wait")
    parser.add_argument(
        "--workdir", type=Path, default=default_workdir(), help="parent of the temp dir"
    )
    parser.add_argument("--keep", action="store_true", help="keep the data dirs and logs")
    parser.add_argument("--skip-small-topics", action="store_true")
    parser.add_argument("--skip-idle", action="store_true")
    parser.add_argument("--skip-produce", action="store_true")
    parser.add_argument("--skip-direct", action="store_true", help="no direct-mode rounds")
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--write-docs", action="store_true", help="update docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    if not 1 <= args.rf <= len(BROKERS) or args.partitions < 1:
        parser.error(f"--rf must be 1..{len(BROKERS)} and --partitions >= 1")

    args.workdir.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="tidelog-scale-bench-", dir=args.workdir))
    print(f"dir {directory}", flush=True)
    load_before = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    results = Results()
    started = time.perf_counter()
    try:
        with TestCluster(
            directory,
            cluster="scale",
            session_ttl_s=SESSION_TTL_S,
            # The product's retention check (the test clusters check every 250 ms).
            storage_args=["--log-retention-check-interval-ms", "300000"],
        ) as cluster:
            for broker_id in BROKERS:
                cluster.start_broker(broker_id)
            cluster.start_controller(1)
            cluster.wait_brokers(list(BROKERS), timeout_s=60.0)
            gateway = cluster.start_gateway()
            bench = Bench(cluster, gateway, args.timeout_s)
            if not args.skip_idle:
                idle = run_section(
                    results, "idle, no topics", bench, lambda: bench.idle(args.idle_s, "baseline")
                )
                if idle is not None:
                    results.idle.append(idle)
            results.creation = run_section(
                results,
                "topic creation",
                bench,
                lambda: bench.create_big(args.partitions, args.topics, args.rf),
            )
            if results.creation is not None:
                if not args.skip_small_topics and args.small_topics > 0:
                    results.small = run_section(
                        results,
                        "single-partition topics",
                        bench,
                        lambda: bench.create_small(args.small_topics, args.rf),
                    )
                if not args.skip_idle:
                    idle = run_section(
                        results,
                        "idle, all partitions",
                        bench,
                        lambda: bench.idle(args.idle_s, "full"),
                    )
                    if idle is not None:
                        results.idle.append(idle)
                big = results.creation.topics
                if not args.skip_produce:
                    for direct in (False, True) if not args.skip_direct else (False,):
                        mode = "direct" if direct else "gateway"
                        rounds = run_section(
                            results,
                            f"produce, {mode}",
                            bench,
                            partial(bench.produce_rounds, big, direct=direct, rounds=2),
                        )
                        results.produce += rounds or []
                if not args.skip_recovery:
                    results.recovery = run_section(
                        results,
                        "recovery",
                        bench,
                        lambda: bench.recovery(args.victim, produce_after=not args.skip_produce),
                    )
        scan_logs(directory, results)
    finally:
        if args.keep:
            print(f"kept {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)
    total_s = time.perf_counter() - started

    argv_shown = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"PYTHONPATH=. .venv/bin/python -m bench.scale {argv_shown}".strip()
    section = report_markdown(
        results, command, directory, args=args, load_before=load_before, total_s=total_s
    )
    print()
    print(section)
    for name, levels in results.log_levels.items():
        print(f"log {name}: {dict(levels)}")
    for event, n in results.log_events.most_common(30):
        print(f"  {n:6d} x {event}")
    print(f"whole run: {total_s:.0f} s")
    if args.write_docs:
        write_docs(section, DOCS_PATH, SECTION_TITLE)
        print(f"wrote {DOCS_PATH}")
    return 1 if results.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
