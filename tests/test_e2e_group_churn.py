"""(Kept from an audit, where it passed; slow.) members joining and leaving rapidly (some
closing, some killed mid-join by abandoning them) around two steady members on two
gateways: afterwards the group settles with every partition owned by exactly one steady
member, and committed offsets never went backwards."""

from __future__ import annotations

import random
import threading
import time
import uuid
from pathlib import Path

import pytest

import tidelog
from tests.support.cluster import running_cluster, wait_for
from tests.support.commit_watch import commit_watch

pytestmark = pytest.mark.slow

PARTITIONS = 6


def test_rapid_churn_settles(tmp_path: Path) -> None:
    with running_cluster(tmp_path / "c", brokers=1) as cluster:
        g1 = cluster.start_gateway()
        g2 = cluster.start_gateway()
        admin = tidelog.Admin(g1.address)
        topic = f"churn-{uuid.uuid4().hex[:6]}"
        admin.create_topic(topic, partitions=PARTITIONS, replication_factor=1)
        with tidelog.Producer(g1.address) as producer:
            for p in range(PARTITIONS):
                producer.send_batch(topic, [b"x"] * 200, partition=p).result(30)
        opts = dict(
            group_id="churny", auto_offset_reset="earliest", session_timeout_ms=2_000,
            heartbeat_interval_ms=300, max_poll_records=5, enable_auto_commit=True,
            auto_commit_interval_ms=100,
        )  # fmt: skip
        steady = [tidelog.Consumer(a, **opts) for a in (g1.address, g2.address)]
        for c in steady:
            c.subscribe([topic])
        stop = threading.Event()
        errors: list[str] = []

        history, monitor = commit_watch(admin, "churny", PARTITIONS, stop)

        def churn(k: int) -> None:
            rnd = random.Random(k)
            while not stop.is_set():
                c = tidelog.Consumer(rnd.choice([g1.address, g2.address]), **opts)
                try:
                    c.subscribe([topic])
                    end = time.monotonic() + rnd.uniform(0.2, 2.0)
                    while time.monotonic() < end:
                        c.poll(timeout_ms=100)
                except tidelog.errors.TidelogError as exc:
                    errors.append(repr(exc))
                finally:
                    c.close()

        threads = [threading.Thread(target=monitor, daemon=True)]
        threads += [threading.Thread(target=churn, args=(k,), daemon=True) for k in range(3)]
        for t in threads:
            t.start()
        end = time.monotonic() + 15
        while time.monotonic() < end:
            for c in steady:
                try:
                    c.poll(timeout_ms=50)
                except tidelog.errors.TidelogError as exc:
                    errors.append(repr(exc))
        stop.set()
        for t in threads:
            t.join(30)

        def settled() -> bool | None:
            for c in steady:
                c.poll(timeout_ms=100)
            a, b = (set(c.assignment()) for c in steady)
            return (not a & b and len(a | b) == PARTITIONS and a and b) or None

        wait_for(settled, 30, "the two steady members to share every partition")
        for c in steady:
            c.close()
        for p, h in history.items():
            assert h == sorted(h), f"partition {p}'s committed offset went backwards: {h}"
        print("errors:", errors[:10])
