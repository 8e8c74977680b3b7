"""Slow end-to-end failure scenarios: `make chaos` runs them, `make test` skips them
(marker "slow"). Written by an audit, which found no bug:
the whole cluster stopped with SIGTERM (brokers concurrently, as a
service manager stops a machine's units, or one after the other) while a producer runs,
then started again: every acknowledged record is there once, group offsets are kept,
and leaders go back to their preferred replicas."""

from __future__ import annotations

import threading

import pytest

import tidelog
from tests.support.cluster import TestCluster, wait_for
from tests.support.load import SteadyLoad, commit_some, read_everything

pytestmark = pytest.mark.slow

PARTITIONS = 6


@pytest.mark.parametrize("order", ["concurrent", "sequential"])
def test_whole_cluster_sigterm_and_restart(tmp_path, order: str) -> None:  # type: ignore[no-untyped-def]
    topic = "whole"
    with TestCluster(tmp_path / "c", imbalance_check_interval_s=1.0) as cluster:
        for b in range(3):
            cluster.start_broker(b)
        cluster.start_controller(1)
        cluster.start_controller(2)
        cluster.wait_brokers([0, 1, 2])
        gw = cluster.start_gateway()
        admin = tidelog.Admin(gw.address)
        admin.create_topic(
            topic, partitions=PARTITIONS, replication_factor=3,
            config={"min.insync.replicas": "2"},
        )  # fmt: skip
        preferred = {p.partition: p.replicas[0] for p in admin.describe_topic(topic).partitions}
        producer = tidelog.Producer(
            gw.address, linger_ms=2, delivery_timeout_ms=5_000, request_timeout_ms=2_000
        )
        load = SteadyLoad(producer, topic, PARTITIONS).start()
        wait_for(lambda: load.done() > 1_000 or None, 60, "1000 acks")
        commit_some(gw.address, topic, "g", 300)  # a group commits part of what it read
        committed_before = {
            (o.topic, o.partition): o.committed_offset for o in admin.describe_group("g")
        }
        assert committed_before

        brokers = [cluster.brokers[b] for b in range(3)]
        if order == "concurrent":
            threads = [threading.Thread(target=b.terminate, args=(60,)) for b in brokers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for b in brokers:
                assert b.terminate(60) == 0, b.log_tail()
        statuses = [b.proc.returncode for b in brokers]
        load.stop()
        producer.flush(60)
        producer.close()
        for c in list(cluster.controllers.values()):
            c.terminate(30)
        gw.terminate(30)
        cluster.etcd.restart()

        for b in range(3):
            cluster.start_broker(b)
        cluster.start_controller(1)
        cluster.start_controller(2)
        cluster.wait_brokers([0, 1, 2], timeout_s=30)
        gw2 = cluster.start_gateway()
        admin2 = tidelog.Admin(gw2.address)

        acked = load.acknowledged()
        records = read_everything(gw2.address, topic, len(acked))
        log: dict[tuple[int, int], bytes] = {}
        for r in records:
            assert (r.partition, r.offset) not in log
            log[(r.partition, r.offset)] = r.value
        values = [r.value for r in records]
        lost = [k for k, v in acked.items() if log.get(k) != v]
        assert statuses == [0, 0, 0], (statuses, cluster.logs())
        assert not lost, f"{len(lost)} of {len(acked)} acknowledged lost, e.g. {lost[:5]}"
        assert len(values) == len(set(values)), "duplicates"
        committed_after = {
            (o.topic, o.partition): o.committed_offset for o in admin2.describe_group("g")
        }
        assert committed_after == committed_before

        def balanced() -> bool:
            parts = admin2.describe_topic(topic).partitions
            return all(p.leader == preferred[p.partition] and len(p.isr) == 3 for p in parts)

        try:
            wait_for(balanced, 30, "preferred leaders and full ISRs back")
        except AssertionError:
            parts = admin2.describe_topic(topic).partitions
            raise AssertionError(
                f"not balanced: {[(p.partition, p.leader, list(p.isr)) for p in parts]} "
                f"preferred {preferred}"
            ) from None
