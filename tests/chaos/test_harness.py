"""The chaos run fails the ways it claims to when the cluster, not the data, is wrong: a
fault that injected nothing is not counted, a node that crashes by itself and a cluster
that never heals fail the run (found by an audit: each passed). Tiny runs of one or two
faults with a replaced schedule; slow (``make chaos``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import tests.chaos.run as chaos_run
from tests.chaos.nemesis import Fault, Nemesis, NemesisLog

pytestmark = pytest.mark.slow

KILL_CONTROLLER = Fault("kill_controller", partition=0, broker=0, duration_s=0.5, number=20)


def test_a_disk_error_that_never_fired_is_not_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO from the 60,000th segment write on is never reached while the nemesis waits:
    it was counted as injected all the same."""
    faults = [
        Fault("disk_error", partition=0, broker=1, duration_s=0.5, number=60_000),
        Fault("disk_error", partition=0, broker=2, duration_s=0.5, number=20),
    ]
    monkeypatch.setattr(chaos_run, "schedule", lambda *a, **k: faults)
    report = chaos_run.run_chaos(tmp_path, 1, rounds=1, kinds=("disk_error",))
    assert report.ok, report.describe()
    assert (report.faults["disk_error"], report.skipped["disk_error"]) == (1, 1), report.describe()


def test_a_broker_that_crashes_by_itself_fails_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A storage node dying on its own (SIGSEGV here, standing for any crash) was
    restarted by heal() without a word, and the run passed."""

    class CrashingFirst(Nemesis):
        def run(self, faults: list[Fault]) -> NemesisLog:
            node = self.cluster.brokers[2]
            os.kill(node.pid, signal.SIGSEGV)  # not the nemesis's doing: "the product"
            assert node.process is not None
            node.process.proc.wait(10)
            return super().run(faults)

    monkeypatch.setattr(chaos_run, "schedule", lambda *a, **k: [KILL_CONTROLLER])
    monkeypatch.setattr(chaos_run, "Nemesis", CrashingFirst)
    report = chaos_run.run_chaos(tmp_path, 1, rounds=1, kinds=("kill_controller",))
    assert report.verdict.ok and not report.ok, report.describe()
    assert report.unexpected_exits == [f"broker 2 exited by itself (status {-signal.SIGSEGV})"]


def test_a_cluster_that_never_heals_fails_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica that never rejoins its ISR (broker 2 stopped for good after the faults)
    was counted as "not healed" and the run passed."""

    class StuckAfter(Nemesis):
        def run(self, faults: list[Fault]) -> NemesisLog:
            log = super().run(faults)
            self.cluster.brokers[2].pause()
            time.sleep(6)  # past its session and the lag limit: out of every ISR
            return log

    monkeypatch.setattr(chaos_run, "schedule", lambda *a, **k: [KILL_CONTROLLER])
    monkeypatch.setattr(chaos_run, "Nemesis", StuckAfter)
    report = chaos_run.run_chaos(tmp_path, 1, rounds=1, kinds=("kill_controller",))
    # (Its data may differ too: a replica stopped as leader keeps a tail it never got to
    # truncate.) The run fails on the healing alone.
    assert not report.healed and not report.ok, report.describe()
