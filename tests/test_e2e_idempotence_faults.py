"""(Kept from an audit, where it passed; slow.) exactly-once per partition, in send order,
across leader kill -9 (before and after producer-state snapshots), restarts from
snapshots, failovers to followers, and client connections cut so that the producer
retries batches the broker already appended. Real processes only."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path

import pytest

import tidelog
from tests.support.cluster import running_cluster, wait_for
from tests.support.tcp_proxy import TcpProxy
from tidelog.errors import InvalidReplicationFactorError

pytestmark = pytest.mark.slow

PARTITIONS = 2


def _create(admin: tidelog.Admin, topic: str, config: dict[str, str]) -> None:
    def create() -> bool | None:
        try:
            admin.create_topic(
                topic,
                partitions=PARTITIONS,
                replication_factor=3,
                config={"min.insync.replicas": "2", **config},
            )
        except InvalidReplicationFactorError:
            return None
        return True

    wait_for(create, 30, f"create {topic}")


def _read_all(address: str, topic: str, expected: int) -> list:
    records: list = []
    with tidelog.Consumer(address, auto_offset_reset="earliest") as c:
        c.assign([(topic, p) for p in range(PARTITIONS)])
        deadline = time.monotonic() + 60
        while len(records) < expected and time.monotonic() < deadline:
            records.extend(c.poll(max_records=100_000, timeout_ms=500))
        records.extend(c.poll(max_records=100_000, timeout_ms=1000))
    return records


def _sending(  # noqa: PLR0917 - _send_loop's arguments and where its outcome goes
    producer: tidelog.Producer,
    topic: str,
    count: int,
    progress: list[int],
    stop: threading.Event,
    result: dict[str, object],
) -> threading.Thread:
    """``_send_loop`` on a thread of its own, started; its count or error in ``result``."""

    def run() -> None:
        try:
            result["sent"] = _send_loop(producer, topic, count, progress, stop)
        except BaseException as exc:
            result["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    return worker


def _leader(admin: tidelog.Admin, topic: str, partition: int) -> int:
    def elected() -> tuple[int] | None:
        leader = admin.describe_topic(topic).partitions[partition].leader
        return (leader,) if leader >= 0 else None

    (leader,) = wait_for(elected, 30, "a leader")
    return leader


def _isr_full(admin: tidelog.Admin, topic: str) -> None:
    wait_for(
        lambda: all(len(p.isr) == 3 for p in admin.describe_topic(topic).partitions),
        60,
        "full ISR",
    )


def _send_loop(
    producer: tidelog.Producer, topic: str, n: int, progress: list[int], stop: threading.Event
) -> dict[int, list[tuple[bytes, Future]]]:
    sent: dict[int, list[tuple[bytes, Future]]] = defaultdict(list)
    for i in range(n):
        if stop.is_set():
            break
        p = i % PARTITIONS
        value = f"{p}:{i}".encode()
        sent[p].append((value, producer.send(topic, value, partition=p)))
        progress[0] = i
        if i % 20 == 0:
            time.sleep(0.005)
    return sent


def _check(records: list, sent: dict[int, list[tuple[bytes, Future]]]) -> None:
    failed = [f.exception() for fs in sent.values() for _, f in fs if f.exception()]
    by_partition: dict[int, list[bytes]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        by_partition[r.partition].append(r.value)
    for p, fs in sent.items():
        acked = [v for v, f in fs if f.exception() is None]
        log = by_partition[p]
        dupes = sorted({v for v in log if log.count(v) > 1})
        assert not dupes, f"partition {p}: {len(dupes)} values written twice, e.g. {dupes[:3]}"
        # Every acknowledged record is there, in send order (unacknowledged ones may be).
        acked_set = set(acked)
        in_log_acked = [v for v in log if v in acked_set]
        assert in_log_acked == acked, (
            f"partition {p}: acknowledged records lost or misordered: "
            f"{len(acked)} acked, {len(in_log_acked)} in the log"
        )
        order = [v for v, _ in fs]
        position = {v: i for i, v in enumerate(order)}
        assert [position[v] for v in log] == sorted(position[v] for v in log), (
            f"partition {p}: log not in send order"
        )
    assert not failed, f"{len(failed)} sends failed, first: {failed[0]!r}"


def _wait_progress(progress: list[int], at_least: int, timeout_s: float = 60) -> None:
    wait_for(lambda: progress[0] >= at_least, timeout_s, f"{at_least} sends")


@pytest.mark.parametrize("direct", [False, True])
def test_leader_kills_restarts_and_cut_answers_are_exactly_once_in_order(
    tmp_path: Path, direct: bool
) -> None:
    topic = "audit-idem"
    with running_cluster(tmp_path) as cluster:
        gateway = cluster.start_gateway()
        proxy = TcpProxy(gateway.address)
        admin = tidelog.Admin(gateway.address)
        # Small segments: rolls (and so producer snapshots) every few hundred records.
        _create(admin, topic, {"segment.bytes": "16384"})
        progress = [0]
        stop = threading.Event()
        result: dict[str, object] = {}
        with tidelog.Producer(
            proxy.address,
            direct=direct,
            linger_ms=1,
            delivery_timeout_ms=120_000,
            request_timeout_ms=6_000,
        ) as producer:
            worker = _sending(producer, topic, 6000, progress, stop, result)
            try:
                _wait_progress(progress, 600)
                for _ in range(3):  # answers lost: the producer retries what was written
                    proxy.retarget(gateway.address, cut=True)
                    time.sleep(0.15)
                # kill -9 the leader of p0 (a snapshot likely exists: several rolls)
                victim = _leader(admin, topic, 0)
                cluster.kill(cluster.brokers[victim])
                _wait_progress(progress, 1800)
                proxy.retarget(gateway.address, cut=True)
                cluster.start_broker(victim)
                _isr_full(admin, topic)
                _wait_progress(progress, 2600)
                # kill -9 the leader of p1 right after a restart-driven failover
                victim = _leader(admin, topic, 1)
                cluster.kill(cluster.brokers[victim])
                proxy.retarget(gateway.address, cut=True)
                time.sleep(0.3)
                cluster.start_broker(victim)
                _wait_progress(progress, 4000)
                victim = _leader(admin, topic, 0)
                cluster.kill(cluster.brokers[victim])
                time.sleep(0.2)
                cluster.start_broker(victim)
            finally:
                worker.join(180)
                stop.set()
                producer.flush(150)
        assert "error" not in result, result.get("error")
        sent = result["sent"]
        assert isinstance(sent, dict)
        total = sum(len(v) for v in sent.values())
        records = _read_all(gateway.address, topic, total)
        proxy.down()
        _check(records, sent)


def test_gateway_groups_with_a_stopped_then_resumed_leader_are_exactly_once_in_order(
    tmp_path: Path,
) -> None:
    """Through a gateway that groups every leader's partitions (AppendMany), the leader
    of p0 is SIGSTOPped past its session (the gateway gives up its calls and re-routes),
    then resumed (a zombie still holding requests), while connections are cut."""
    import os
    import signal

    topic = "audit-idem-groups"
    with running_cluster(tmp_path) as cluster:
        gateway = cluster.start_gateway(["--produce-group-min-partitions", "1"])
        proxy = TcpProxy(gateway.address)
        admin = tidelog.Admin(gateway.address)
        _create(admin, topic, {"segment.bytes": "16384"})
        progress = [0]
        stop = threading.Event()
        result: dict[str, object] = {}
        with tidelog.Producer(
            proxy.address, linger_ms=2, delivery_timeout_ms=120_000, request_timeout_ms=6_000
        ) as producer:
            worker = _sending(producer, topic, 5000, progress, stop, result)
            stopped = None
            try:
                _wait_progress(progress, 500)
                victim = _leader(admin, topic, 0)
                stopped = cluster.brokers[victim]
                os.kill(stopped.pid, signal.SIGSTOP)
                wait_for(lambda: _leader(admin, topic, 0) != victim, 30, "a new leader")
                proxy.retarget(gateway.address, cut=True)
                time.sleep(1.0)
                os.kill(stopped.pid, signal.SIGCONT)
                stopped = None
                _wait_progress(progress, 2500)
                proxy.retarget(gateway.address, cut=True)
                victim = _leader(admin, topic, 1)
                cluster.kill(cluster.brokers[victim])
                time.sleep(0.3)
                cluster.start_broker(victim)
            finally:
                if stopped is not None:
                    os.kill(stopped.pid, signal.SIGCONT)
                worker.join(180)
                stop.set()
                producer.flush(150)
        assert "error" not in result, result.get("error")
        sent = result["sent"]
        assert isinstance(sent, dict)
        total = sum(len(v) for v in sent.values())
        records = _read_all(gateway.address, topic, total)
        proxy.down()
        _check(records, sent)
