"""docs/DEPLOY.md's rolling upgrade of storage nodes, done as it says (written by an audit;
slow: ``make chaos``).

    "With replication factor 3 and min.insync.replicas=2, acks=all producers keep going
    while one broker restarts, and every acknowledged record is on at least two brokers.
    [...] Roll storage nodes in stages instead, one pod per stage, waiting for
    `tidelog cluster` to show no under-replicated partitions between stages"

Each broker in turn gets SIGTERM (a controlled shutdown, exit 0), is started again on its
data, and the next waits until ``describe_cluster`` (what ``tidelog cluster`` prints)
shows no under-replicated partition. An idempotent acks=all producer runs throughout.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import tidelog
from tests.support.cluster import TestCluster, wait_for
from tests.support.load import SteadyLoad, read_everything

pytestmark = pytest.mark.slow

PARTITIONS = 3


def test_staged_rolling_restart_keeps_acks_all_producers_going(tmp_path: Path) -> None:
    topic = "rolling"
    with TestCluster(tmp_path / "c") as cluster:
        for b in range(3):
            cluster.start_broker(b)
        cluster.start_controller(1)
        cluster.wait_brokers([0, 1, 2])
        gw = cluster.start_gateway()
        admin = tidelog.Admin(gw.address)
        admin.create_topic(
            topic,
            partitions=PARTITIONS,
            replication_factor=3,
            config={"min.insync.replicas": "2"},
        )
        producer = tidelog.Producer(gw.address, acks="all", linger_ms=2)
        load = SteadyLoad(producer, topic, PARTITIONS).start()
        try:
            wait_for(lambda: load.done() > 500 or None, 60, "500 acks")
            statuses = []
            progress_while_down = []
            for b in range(3):
                before = len(load.sent)
                statuses.append(cluster.brokers[b].terminate(60))
                # The broker is down: acks=all producers keep going (the other two are
                # the ISR, min.insync.replicas=2).
                t0 = time.monotonic()
                wait_for(
                    lambda since=before: load.done(since) > 200 or None,
                    30,
                    f"acks with {b} down",
                )
                progress_while_down.append(round(time.monotonic() - t0, 1))
                cluster.start_broker(b)
                wait_for(
                    lambda: not admin.describe_cluster().under_replicated_partitions,
                    60,
                    f"no under-replicated partition after broker {b} restarted",
                )
        finally:
            load.stop()
        producer.flush(120)
        producer.close()
        failed = []
        for partition, value, future in load.sent:
            exc = future.exception(0)
            if exc is not None:
                failed.append((partition, value, repr(exc)))
        acked = load.acknowledged()
        records = read_everything(gw.address, topic, len(acked))
        log = {(r.partition, r.offset): r.value for r in records}
        lost = [k for k, v in acked.items() if log.get(k) != v]
        values = [r.value for r in records]
        assert statuses == [0, 0, 0], (statuses, cluster.logs())
        assert not failed, f"{len(failed)} of {len(load.sent)} sends failed, e.g. {failed[:3]}"
        assert not lost, f"{len(lost)} of {len(acked)} acknowledged lost, e.g. {lost[:5]}"
        assert len(values) == len(set(values)), "duplicates"
        print("seconds to 200 acks with each broker down:", progress_while_down)
