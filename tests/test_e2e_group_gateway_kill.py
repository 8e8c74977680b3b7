"""(Kept from an audit, where it passed; slow.) a gateway killed -9 while members of one
group use it during a rebalance; a load balancer (TcpProxy) moves its clients to the
other gateway. The group settles (every partition owned by exactly one member), every
record is read, committed offsets never go backwards."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from pathlib import Path

import pytest

import tidelog
from tests.support.cluster import running_cluster, wait_for
from tests.support.commit_watch import commit_watch
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.slow

PARTITIONS = 4


def test_gateway_killed_during_a_rebalance(tmp_path: Path) -> None:
    with running_cluster(tmp_path / "c", brokers=1) as cluster:
        g1 = cluster.start_gateway()
        g2 = cluster.start_gateway()
        admin = tidelog.Admin(g2.address)
        topic = f"gwk-{uuid.uuid4().hex[:6]}"
        admin.create_topic(topic, partitions=PARTITIONS, replication_factor=1)
        proxy = TcpProxy(g1.address)
        opts = dict(
            group_id="gk", auto_offset_reset="earliest", session_timeout_ms=3_000,
            heartbeat_interval_ms=300, max_poll_records=10, enable_auto_commit=True,
            auto_commit_interval_ms=100, request_timeout_ms=3_000,
        )  # fmt: skip
        m1 = tidelog.Consumer(proxy.address, **opts)
        m2 = tidelog.Consumer(g2.address, **opts)
        seen: Counter[tuple[int, int]] = Counter()
        stop = threading.Event()

        history, monitor = commit_watch(admin, "gk", PARTITIONS, stop)

        mon = threading.Thread(target=monitor, daemon=True)
        mon.start()
        members = [m1, m2]

        def poll_all() -> None:
            for c in members:
                try:
                    for r in c.poll(timeout_ms=50):
                        seen[(r.partition, r.offset)] += 1
                except tidelog.errors.TidelogError:
                    pass

        try:
            for c in members:
                c.subscribe([topic])
            with tidelog.Producer(g2.address) as producer:
                for p in range(PARTITIONS):
                    producer.send_batch(topic, [b"a"] * 300, partition=p).result(30)
            wait_for(
                lambda: (poll_all(), all(c.assignment() for c in members))[1] or None,
                60,
                "both members holding partitions",
            )
            m3 = tidelog.Consumer(proxy.address, **opts)
            m3.subscribe([topic])
            members.append(m3)
            for _ in range(3):
                poll_all()
            cluster.kill(g1)  # kill -9 amid the rebalance m3 started
            proxy.retarget(g2.address)
            with tidelog.Producer(g2.address) as producer:
                for p in range(PARTITIONS):
                    producer.send_batch(topic, [b"b"] * 100, partition=p).result(30)

            def settled() -> bool | None:
                poll_all()
                sets = [set(c.assignment()) for c in members]
                union = set().union(*sets)
                disjoint = sum(len(s) for s in sets) == len(union)
                return (
                    disjoint and len(union) == PARTITIONS and len(seen) == PARTITIONS * 400
                ) or None

            wait_for(settled, 90, "the group to settle and read every record")
        finally:
            stop.set()
            mon.join(5)
            for c in members:
                c.close()
            proxy.close()
        for p, h in history.items():
            assert h == sorted(h), f"partition {p}'s committed offset went backwards: {h}"
