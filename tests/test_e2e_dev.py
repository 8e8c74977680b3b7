"""Slow end-to-end failure scenarios: `make chaos` runs them, `make test` skips them
(marker "slow"). Written by an audit, which found no bug:
`tidelog dev` killed -9 while a producer writes (its children all get
SIGTERM at once, etcd included), then started again on its data directory: every
acknowledged record and every committed offset is there, every partition led."""

from __future__ import annotations

import time

import pytest

import tidelog
from tests.support.cluster import wait_for
from tests.support.load import SteadyLoad, commit_some, read_everything
from tests.support.process import tidelog_env
from tidelog.dev import DevProcess

pytestmark = pytest.mark.slow

TOPIC = "dev-kill"
PARTITIONS = 4


def test_dev_killed_under_load_keeps_everything_acknowledged(tmp_path) -> None:  # type: ignore[no-untyped-def]
    dev = DevProcess(tmp_path / "data", env=tidelog_env())
    again = None
    try:
        admin = tidelog.Admin(dev.gateway)
        admin.create_topic(TOPIC, partitions=PARTITIONS, replication_factor=3,
                           config={"min.insync.replicas": "2"})  # fmt: skip
        producer = tidelog.Producer(
            dev.gateway, linger_ms=2, delivery_timeout_ms=3_000, request_timeout_ms=1_000
        )
        load = SteadyLoad(producer, TOPIC, PARTITIONS).start()
        wait_for(lambda: load.done() > 3_000 or None, 60, "3000 acks")
        commit_some(dev.gateway, TOPIC, "g", 500)
        committed = {o.partition: o.committed_offset for o in admin.describe_group("g")}
        dev.kill()
        time.sleep(0.5)
        load.stop()
        producer.flush(30)
        producer.close()
        acked = load.acknowledged()

        again = DevProcess(tmp_path / "data", env=tidelog_env(), timeout_s=180)
        admin2 = tidelog.Admin(again.gateway)
        got = read_everything(again.gateway, TOPIC, len(acked))
        log = {(r.partition, r.offset): r.value for r in got}
        lost = [k for k, v in acked.items() if log.get(k) != v]
        assert not lost, f"{len(lost)} of {len(acked)} acknowledged lost, e.g. {sorted(lost)[:5]}"
        values = [r.value for r in got]
        assert len(values) == len(set(values))
        after = {o.partition: o.committed_offset for o in admin2.describe_group("g")}
        assert after == committed
        wait_for(
            lambda: all(
                len(p.isr) == 3 and p.leader >= 0 for p in admin2.describe_topic(TOPIC).partitions
            ),
            30,
            "every partition led with a full ISR",
        )
    finally:
        if again is not None:
            again.stop(60)
        dev.kill()
