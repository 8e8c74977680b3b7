"""Convergence after outages, with real processes (kept from an audit of the processes'
lifecycle, where they passed): etcd killed -9 and restarted past every session TTL, the
only replica paused past its TTL, every process stopping while etcd hangs. Slow."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import tidelog
from services.cluster_metadata import BROKERS_PREFIX
from tests.support.cluster import TestCluster, wait_for

pytestmark = pytest.mark.slow


def _produce(address: str, tag: bytes, n: int, partitions: int) -> None:
    with tidelog.Producer(address, delivery_timeout_ms=30_000) as producer:
        for i in range(n):
            producer.send("t", tag + b"%d" % i, partition=i % partitions)
        producer.flush(30)


def _consume_all(address: str, partitions: int, n: int) -> list[bytes]:
    with tidelog.Consumer(address, auto_offset_reset="earliest") as consumer:
        consumer.assign([("t", p) for p in range(partitions)])
        got: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(got) < n and time.monotonic() < deadline:
            got += [r.value for r in consumer.poll(timeout_ms=500)]
    return got


def _registrations(c: TestCluster) -> dict[int, int]:
    return {
        int(kv.key.removeprefix(BROKERS_PREFIX)): kv.create_revision
        for kv in c.store.get_prefix(BROKERS_PREFIX)
    }


def test_etcd_kill_9_then_pauses_past_the_ttl_converge(tmp_path: Path) -> None:
    c = TestCluster(tmp_path / "c")
    try:
        for b in range(3):
            c.start_broker(b)
        c.start_controller(1)
        c.start_controller(2)
        c.wait_brokers([0, 1, 2])
        gw = c.start_gateway()
        tidelog.Admin(gw.address).create_topic("t", partitions=3, replication_factor=3)
        _produce(gw.address, b"a", 30, 3)
        before = _registrations(c)
        c.etcd.kill()
        time.sleep(2 * c.session_ttl_s + 1)  # every keeper gives its lease up
        c.etcd.start()
        # etcd restores the leases: the registrations are kept, same epochs, none twice.
        wait_for(lambda: _registrations(c) == before, 20, f"registrations {before} kept")
        c.wait_brokers([0, 1, 2])
        # A broker paused past its TTL comes back as a new incarnation.
        os.kill(c.brokers[0].pid, signal.SIGSTOP)
        time.sleep(2 * c.session_ttl_s + 1)
        os.kill(c.brokers[0].pid, signal.SIGCONT)
        wait_for(
            lambda: _registrations(c).get(0, 0) > before[0] and len(_registrations(c)) == 3,
            20,
            "broker 0 registered again",
        )
        wait_for(
            lambda: all(sorted(p.isr) == [0, 1, 2] for p in c.partitions("t")),
            30,
            "broker 0 back in every ISR",
        )
        # The active controller paused past its TTL: the standby takes over, the old one
        # stands by once resumed.
        active = c.active_controller()
        os.kill(active.pid, signal.SIGSTOP)
        time.sleep(2 * c.session_ttl_s + 1)
        os.kill(active.pid, signal.SIGCONT)
        c.wait_brokers([0, 1, 2])
        _produce(gw.address, b"b", 30, 3)
        assert len(_consume_all(gw.address, 3, 60)) == 60
        for process in list(c._all):
            assert process.terminate(60) == 0, process.log_tail()
    finally:
        c.close()


def test_the_only_replica_paused_past_its_ttl_leads_again_under_a_new_epoch(
    tmp_path: Path,
) -> None:
    c = TestCluster(tmp_path / "c")
    try:
        for b in range(2):
            c.start_broker(b)
        c.start_controller(1)
        c.wait_brokers([0, 1])
        gw = c.start_gateway()
        tidelog.Admin(gw.address).create_topic("t", partitions=2, replication_factor=1)
        _produce(gw.address, b"a", 20, 2)
        epochs = {p.partition: (p.leader, p.leader_epoch) for p in c.partitions("t")}
        paused = 0
        os.kill(c.brokers[paused].pid, signal.SIGSTOP)
        wait_for(lambda: paused not in _registrations(c), 3 * c.session_ttl_s + 5, "expiry")
        os.kill(c.brokers[paused].pid, signal.SIGCONT)
        wait_for(lambda: all(p.leader >= 0 for p in c.partitions("t")), 20, "leaders back")
        for p in c.partitions("t"):
            leader, epoch = epochs[p.partition]
            assert p.leader == leader
            if leader == paused:
                assert p.leader_epoch > epoch
        _produce(gw.address, b"b", 20, 2)
        assert len(_consume_all(gw.address, 2, 40)) == 40
    finally:
        c.close()


def test_every_process_stops_with_status_0_while_etcd_hangs(tmp_path: Path) -> None:
    c = TestCluster(tmp_path / "c", storage_args=["--controlled-shutdown-timeout-s", "2"])
    try:
        c.start_broker(0)
        c.start_controller(1)
        c.start_controller(2)
        c.wait_brokers([0])
        c.start_gateway()
        c.etcd.pause()
        for process in list(c._all):
            started = time.monotonic()
            assert process.terminate(40) == 0, process.log_tail()
            assert time.monotonic() - started < 30
    finally:
        c.etcd.resume()
        c.close()
