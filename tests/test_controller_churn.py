"""A random sequence of admin changes, broker kills, pauses and restarts, and controller
failovers; once everything is back, each broker holds exactly the logs of the partitions
assigned to it (with the topic's id), etcd's records are complete and consistent, and no
deletion is left pending. Written by an audit (no bug found: a regression test); slow
(about a minute per seed), so in `make chaos` (``-m slow``)."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import grpc
import pytest

from services.cluster_metadata import (
    DELETIONS_PREFIX,
    PARTITIONS_PREFIX,
    TOPICS_PREFIX,
    decode_partition,
    decode_topic,
)
from tests.support.cluster import RPC_TIMEOUT_S, TestCluster, wait_for
from tidelog.v1 import common_pb2, controller_pb2, storage_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

BROKERS = (1, 2, 3)
OPS = [
    "create",
    "create",
    "delete",
    "delete",
    "grow",
    "config",
    "kill",
    "restart",
    "ctl",
    "pause",
    "pause",
]
SLOW: list | None = None  # set to [] to record slow SIGTERM stops (controlled shutdown)
NAMES = ("a", "b", "c")


def _on_disk(cluster: TestCluster, broker_id: int) -> dict[str, str]:
    out = {}
    for d in cluster.data_dir(broker_id).iterdir():
        if not d.is_dir() or d.name.endswith("-delete") or "-" not in d.name:
            continue
        meta = d / "partition.metadata"
        tid = ""
        if meta.exists():
            for line in meta.read_text().splitlines():
                if line.startswith("topic_id:"):
                    tid = line.split(":", 1)[1].strip()
        out[d.name] = tid
    return out


def _expected(cluster: TestCluster) -> dict[int, dict[str, str]]:
    want: dict[int, dict[str, str]] = {b: {} for b in BROKERS}
    for kv in cluster.store.get_prefix(TOPICS_PREFIX):
        topic = decode_topic(kv)
        for p, replicas in enumerate(topic.assignment):
            for b in replicas:
                want[b][f"{topic.name}-{p}"] = topic.topic_id
    return want


def _try(call, *a, **k):  # type: ignore[no-untyped-def]
    try:
        return call(*a, **k)
    except grpc.RpcError as exc:
        return exc


@pytest.mark.parametrize("seed", [1, 4, 12])
def test_churn_ends_with_each_broker_holding_exactly_its_assigned_logs(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    cluster = TestCluster(tmp_path, session_ttl_s=2)
    log: list[str] = []
    try:
        for b in BROKERS:
            cluster.start_broker(b, wait=False)
        for b in BROKERS:
            cluster.brokers[b].start()
        cluster.start_controller(11)
        cluster.active_controller()
        cluster.start_controller(12)
        cluster.wait_brokers(list(BROKERS))
        down: set[int] = set()
        for step in range(60):
            op = rng.choice(OPS)
            name = rng.choice(NAMES)
            try:
                api = cluster.active_controller(20).stub
            except AssertionError:
                continue
            if op == "create":
                live = len(BROKERS) - len(down)
                r = _try(
                    api.CreateTopics,
                    controller_pb2.CreateTopicsRequest(
                        topics=[
                            controller_pb2.CreatableTopic(
                                name=name,
                                num_partitions=rng.randint(1, 4),
                                replication_factor=rng.randint(1, max(1, live)),
                            )
                        ],
                        timeout_ms=2000,
                    ),
                    timeout=RPC_TIMEOUT_S,
                )
            elif op == "delete":
                r = _try(
                    api.DeleteTopics,
                    controller_pb2.DeleteTopicsRequest(names=[name], timeout_ms=2000),
                    timeout=RPC_TIMEOUT_S,
                )
            elif op == "grow":
                r = _try(
                    api.CreatePartitions,
                    controller_pb2.CreatePartitionsRequest(
                        topics=[
                            controller_pb2.PartitionIncrease(name=name, count=rng.randint(2, 6))
                        ],
                        timeout_ms=2000,
                    ),
                    timeout=RPC_TIMEOUT_S,
                )
            elif op == "config":
                r = _try(
                    api.IncrementalAlterConfigs,
                    controller_pb2.IncrementalAlterConfigsRequest(
                        topics=[
                            controller_pb2.AlterableTopicConfig(
                                name=name,
                                set=[
                                    common_pb2.ConfigEntry(
                                        name="retention.ms", value=str(rng.randint(10**6, 10**8))
                                    )
                                ],
                            )
                        ],
                        timeout_ms=2000,
                    ),
                    timeout=RPC_TIMEOUT_S,
                )
            elif op == "kill":
                up = [b for b in BROKERS if b not in down]
                if len(up) <= 1:
                    continue
                victim = rng.choice(up)
                if rng.random() < 0.5:
                    cluster.kill(cluster.brokers[victim])
                else:
                    before = cluster.api.Metadata(
                        controller_pb2.MetadataRequest(), timeout=RPC_TIMEOUT_S
                    )
                    t0 = time.monotonic()
                    cluster.brokers[victim].terminate(timeout_s=45)
                    took = time.monotonic() - t0
                    if took > 10 and SLOW is not None:
                        SLOW.append(
                            (
                                victim,
                                took,
                                sorted(down),
                                [
                                    (t.name, p.partition, p.leader, list(p.isr), list(p.replicas))
                                    for t in before.topics
                                    for p in t.partitions
                                ],
                            )
                        )
                down.add(victim)
                r = f"broker {victim} down"
            elif op == "restart":
                if not down:
                    continue
                back = rng.choice(sorted(down))
                cluster.start_broker(back)
                down.discard(back)
                r = f"broker {back} up"
            elif op == "pause":
                up = [b for b in BROKERS if b not in down]
                victim = rng.choice(up)
                proc = cluster.brokers[victim].proc
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    time.sleep(2.5 + rng.random() * 2)
                    # while it is away: delete a topic and create it again
                    api = cluster.active_controller(20).stub
                    r1 = _try(
                        api.DeleteTopics,
                        controller_pb2.DeleteTopicsRequest(names=[name], timeout_ms=2000),
                        timeout=RPC_TIMEOUT_S,
                    )
                    time.sleep(0.6)
                    live = len(BROKERS) - len(down) - 1
                    r2 = _try(
                        api.CreateTopics,
                        controller_pb2.CreateTopicsRequest(
                            topics=[
                                controller_pb2.CreatableTopic(
                                    name=name,
                                    num_partitions=rng.randint(1, 4),
                                    replication_factor=rng.randint(1, max(1, live)),
                                )
                            ],
                            timeout_ms=2000,
                        ),
                        timeout=RPC_TIMEOUT_S,
                    )
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
                r = f"broker {victim} paused; delete/create: {str(r1)[:80]!r} {str(r2)[:80]!r}"
            else:
                active = cluster.active_controller(20)
                cid = active.controller_id
                if rng.random() < 0.5:
                    cluster.kill(active)
                else:
                    active.terminate()
                cluster.start_controller(cid)
                r = f"controller {cid} restarted"
            summary = (
                r
                if isinstance(r, str)
                else (
                    f"rpc {r.code()}"
                    if isinstance(r, grpc.RpcError)
                    else str(r).replace("\n", " ")[:200]
                )
            )
            log.append(f"{step} {op} {name}: {summary}")
        for b in sorted(down):
            cluster.start_broker(b)
        cluster.wait_brokers(list(BROKERS), timeout_s=30)

        def roles() -> dict:
            got = {}
            for b in BROKERS:
                resp = cluster.brokers[b].stub.DescribeLogDirs(
                    storage_pb2.DescribeLogDirsRequest(), timeout=RPC_TIMEOUT_S
                )
                for d in resp.log_dirs:
                    for lg in d.partitions:
                        got[(b, lg.topic, lg.partition)] = (lg.is_leader, lg.leader_epoch)
            want = {}
            for kv in cluster.store.get_prefix(PARTITIONS_PREFIX):
                name, p, rec = decode_partition(kv)
                topic = decode_topic(cluster.store.get(TOPICS_PREFIX + name))
                for b in topic.assignment[p]:
                    want[(b, name, p)] = (rec.leader == b, rec.leader_epoch)
            return got, want

        def settled() -> bool:
            if cluster.store.get_prefix(DELETIONS_PREFIX):
                return False
            want = _expected(cluster)
            if not all(_on_disk(cluster, b) == want[b] for b in BROKERS):
                return False
            got, want_roles = roles()
            if got != want_roles:
                return False
            for kv in cluster.store.get_prefix(PARTITIONS_PREFIX):
                name, p, rec = decode_partition(kv)
                topic = decode_topic(cluster.store.get(TOPICS_PREFIX + name))
                if set(rec.isr) != set(topic.assignment[p]) or rec.leader < 0:
                    return False
            return True

        try:
            wait_for(settled, 45, "brokers' logs to match the assignment")
        except AssertionError:
            want = _expected(cluster)
            detail = {b: (_on_disk(cluster, b), want[b]) for b in BROKERS}
            pending = [kv.key for kv in cluster.store.get_prefix(DELETIONS_PREFIX)]
            got, want_roles = roles()
            diff = {
                k: (got.get(k), want_roles.get(k))
                for k in set(got) | set(want_roles)
                if got.get(k) != want_roles.get(k)
            }
            isrs = []
            for kv in cluster.store.get_prefix(PARTITIONS_PREFIX):
                name, p, rec = decode_partition(kv)
                topic = decode_topic(cluster.store.get(TOPICS_PREFIX + name))
                if set(rec.isr) != set(topic.assignment[p]) or rec.leader < 0:
                    isrs.append((name, p, rec, topic.assignment[p]))
            raise AssertionError(
                f"short isrs: {isrs}\n"
                f"roles differing (got, want): {diff}\n"
                f"on disk vs wanted: {detail}\npending deletions: {pending}\n" + "\n".join(log)
            ) from None
        topics = {
            decode_topic(kv).name: decode_topic(kv)
            for kv in cluster.store.get_prefix(TOPICS_PREFIX)
        }
        records = {}
        for kv in cluster.store.get_prefix(PARTITIONS_PREFIX):
            name, p, rec = decode_partition(kv)
            records[(name, p)] = rec
        for name, topic in topics.items():
            for p, replicas in enumerate(topic.assignment):
                rec = records.pop((name, p))
                assert set(rec.isr) <= set(replicas)
                assert rec.leader in (-1, *rec.isr)
        assert records == {}, records
        pass
    finally:
        cluster.close()
