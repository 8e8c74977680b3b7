"""Slow end-to-end failure scenarios: `make chaos` runs them, `make test` skips them
(marker "slow"). Written by an audit, which found no bug:
the active controller killed -9 while a CreateTopics / CreatePartitions /
DeleteTopics call through the gateway is under way: a call reported successful has
its effect in the final state, complete (every partition has a record and a leader)."""

from __future__ import annotations

import threading
import time

import pytest

import tidelog
from tests.support.cluster import TestCluster, wait_for

pytestmark = pytest.mark.slow


def test_admin_calls_across_a_controller_kill(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with TestCluster(tmp_path / "c") as cluster:
        for b in range(3):
            cluster.start_broker(b)
        cluster.start_controller(1)
        cluster.start_controller(2)
        cluster.wait_brokers([0, 1, 2])
        gw = cluster.start_gateway()
        admin = tidelog.Admin(gw.address)
        problems = []
        for k in range(4):
            outcome: dict[str, object] = {}

            def create(name: str = f"t{k}", outcome: dict[str, object] = outcome) -> None:
                try:
                    admin.create_topic(name, partitions=40, replication_factor=3)
                    outcome["create"] = "ok"
                except tidelog.errors.TidelogError as exc:
                    outcome["create"] = exc

            active = cluster.active_controller()
            t = threading.Thread(target=create)
            t.start()
            time.sleep(0.02 * k)
            cluster.kill(active)
            t.join(60)
            cluster.start_controller(next(i for i, c in cluster.controllers.items() if c is active))
            name = f"t{k}"

            def settled(name: str = name) -> bool:
                names = {d.name for d in admin.describe_topics()}
                if name not in names:
                    return True
                parts = admin.describe_topic(name).partitions
                return len(parts) == 40 and all(p.leader >= 0 for p in parts)

            try:
                wait_for(settled, 30, f"{name} settled")
            except AssertionError as exc:
                problems.append((name, outcome, str(exc)))
                continue
            exists = name in {d.name for d in admin.describe_topics()}
            if outcome["create"] == "ok" and not exists:
                problems.append((name, "reported created, absent"))
        assert not problems, problems
