"""Slow end-to-end failure scenarios: `make chaos` runs them, `make test` skips them
(marker "slow"). Written by an audit, which found no bug:
etcd killed -9 as a third member joins a consumer group (a rebalance in
progress), down longer than the members' session timeout, then restarted on its data:
the group is whole again (every partition assigned, every member with a share), every
acknowledged record is processed, and no committed offset ever moved backwards."""

from __future__ import annotations

import threading
import time

import pytest

import tidelog
from tests.support.cluster import running_cluster, wait_for
from tests.support.commit_watch import commit_watch

pytestmark = pytest.mark.slow

PARTITIONS = 6
TOPIC = "etcd-rebalance"


def test_etcd_killed_during_a_rebalance(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with running_cluster(tmp_path / "c") as cluster:
        gw = cluster.start_gateway()
        admin = tidelog.Admin(gw.address)
        admin.create_topic(TOPIC, partitions=PARTITIONS, replication_factor=3,
                           config={"min.insync.replicas": "2"})  # fmt: skip
        acked: set[tuple[int, int]] = set()

        def produce(n: int, tag: str) -> None:
            with tidelog.Producer(gw.address, linger_ms=2, delivery_timeout_ms=60_000) as pr:
                futures = [pr.send(TOPIC, f"{tag}{i}".encode(), partition=i % PARTITIONS)
                           for i in range(n)]  # fmt: skip
                for f in futures:
                    md = f.result(60)
                    acked.add((md.partition, md.offset))

        produce(3000, "a")
        processed: set[tuple[int, int]] = set()
        assignments: dict[int, list] = {}
        errors: list[str] = []
        stop = threading.Event()
        lock = threading.Lock()

        def member(k: int) -> None:
            with tidelog.Consumer(
                gw.address, group_id="g", auto_offset_reset="earliest",
                enable_auto_commit=False, session_timeout_ms=3_000,
                heartbeat_interval_ms=500, max_poll_records=200,
            ) as consumer:  # fmt: skip
                consumer.subscribe([TOPIC])
                while not stop.is_set():
                    try:
                        records = consumer.poll(timeout_ms=200)
                        with lock:
                            processed.update((r.partition, r.offset) for r in records)
                        if records:
                            consumer.commit()
                        assignments[k] = sorted(consumer.assignment())
                    except tidelog.errors.TidelogError as exc:
                        errors.append(f"{k}: {exc!r}")
                        time.sleep(0.1)

        history, monitor = commit_watch(admin, "g", PARTITIONS, stop)

        threads = [threading.Thread(target=member, args=(k,), daemon=True) for k in (1, 2)]
        threads.append(threading.Thread(target=monitor, daemon=True))
        for t in threads:
            t.start()
        wait_for(lambda: len(processed) > 500, 30, "the first members to process")
        third = threading.Thread(target=member, args=(3,), daemon=True)
        third.start()
        threads.append(third)
        time.sleep(0.3)  # the join is under way
        cluster.etcd.kill()
        time.sleep(6)  # past the members' session timeout
        cluster.etcd.start()
        produce(3000, "b")
        try:
            wait_for(lambda: acked <= processed, 60, "every acknowledged record processed")

            def whole() -> bool:
                parts = [tp for k in (1, 2, 3) for tp in assignments.get(k, [])]
                return sorted(p for _, p in parts) == list(range(PARTITIONS)) and all(
                    assignments.get(k) for k in (1, 2, 3)
                )

            wait_for(whole, 60, f"the group whole again: {assignments}")
            ends = {p.partition: p.high_watermark for p in admin.describe_group("g")}
            wait_for(
                lambda: all(history[p] and history[p][-1] == ends[p] for p in range(PARTITIONS)),
                30, "final commits at the log ends",
            )  # fmt: skip
        finally:
            stop.set()
            for t in threads:
                t.join(15)
        backwards = {p: h for p, h in history.items() if h != sorted(h)}
        assert not backwards, f"committed offsets moved backwards: {backwards}"
