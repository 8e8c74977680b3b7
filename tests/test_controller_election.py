"""Controller election (``ControllerElection``) across etcd kill -9 and restart, and a
clean hand-over, with real etcd. Checked by an audit: regression tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.cluster_metadata import CONTROLLER_KEY
from services.controller.election import ControllerElection
from services.metastore import MetaStore
from tidelog.etcd_launcher import EtcdProcess

pytestmark = pytest.mark.timeout(90)

TTL_S = 2


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    process = EtcdProcess(tmp_path / "etcd").start()
    try:
        yield process
    finally:
        process.kill()


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


class Candidate:
    """One controller's election, recording when it was elected and resigned."""

    def __init__(self, endpoint: str, cid: int) -> None:
        self.store = MetaStore(endpoint, cluster="el", timeout_s=1.0)
        self.active: int | None = None
        self.log: list[tuple[float, str, int | None]] = []
        self.lock = threading.Lock()
        self.election = ControllerElection(
            self.store,
            controller_id=cid,
            address=f"127.0.0.1:{cid}",
            ttl_s=TTL_S,
            on_elected=self._elected,
            on_resigned=self._resigned,
        )

    def _elected(self, epoch: int) -> None:
        with self.lock:
            self.active = epoch
            self.log.append((time.monotonic(), "elected", epoch))

    def _resigned(self) -> None:
        with self.lock:
            self.log.append((time.monotonic(), "resigned", self.active))
            self.active = None

    def close(self) -> None:
        self.election.stop(5)
        self.store.close()


def _active_and_standby(endpoint: str) -> tuple[Candidate, Candidate]:
    """Candidate 1 elected, then candidate 2 campaigning behind it."""
    first = Candidate(endpoint, 1)
    first.election.start()
    wait_for(lambda: first.active is not None, 10, "the first candidate elected")
    second = Candidate(endpoint, 2)
    second.election.start()
    time.sleep(0.5)
    return first, second


@pytest.mark.parametrize("outage_s", [0.5, TTL_S + 1.5])
def test_one_controller_after_etcd_kill_9(etcd: EtcdProcess, outage_s: float) -> None:
    """An outage shorter than the TTL keeps the active term; a longer one ends with
    exactly one controller active, whose epoch is the controller key's create revision."""
    first, second = _active_and_standby(etcd.endpoint)
    try:
        assert second.active is None
        etcd.kill()
        time.sleep(outage_s)
        etcd.start()
        wait_for(
            lambda: (first.active is None) != (second.active is None), 15, "one active controller"
        )
        time.sleep(3 * TTL_S)
        actives = [c for c in (first, second) if c.active is not None]
        assert len(actives) == 1, (first.log, second.log)
        with MetaStore(etcd.endpoint, cluster="el", timeout_s=2.0) as meta:
            kv = meta.get(CONTROLLER_KEY)
            assert kv is not None and kv.create_revision == actives[0].active
        if outage_s < TTL_S:
            # The term survived the short outage.
            assert [e for e in first.log if e[1] == "resigned"] == [], first.log
    finally:
        first.close()
        second.close()


def test_a_stopped_controller_hands_over_without_waiting_for_its_ttl(etcd: EtcdProcess) -> None:
    """A stopped controller resigns: the standby takes office well within the TTL."""
    first, second = _active_and_standby(etcd.endpoint)
    try:
        started = time.monotonic()
        first.election.stop(5)
        wait_for(lambda: second.active is not None, 10, "the second candidate elected")
        assert time.monotonic() - started < TTL_S, "the standby waited out the lease"
        assert first.active is None
    finally:
        first.close()
        second.close()
