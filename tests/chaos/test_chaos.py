"""The short chaos schedule of ``make test``, and its negative control.

One round of every fault kind against real processes, then the history checker. The
same seed with ``min.insync.replicas=1`` and unclean leader election must make the
checker report a loss (``lose_leader`` lets a lone leader acknowledge and then elects a
replica without those writes): that is what shows the safe run's "nothing lost" means
something. ``TIDELOG_CHAOS_SEED`` picks another seed; ``make chaos`` runs many seeds and
longer schedules (``python -m tests.chaos``).
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.chaos.run import run_chaos

SEED = int(os.environ.get("TIDELOG_CHAOS_SEED", "11"))


def test_short_schedule_loses_nothing(tmp_path: Path) -> None:
    report = run_chaos(tmp_path, SEED, rounds=1)
    print(report.describe())
    assert report.verdict.ok, report.describe()
    assert report.verdict.acked > 1000, report.describe()
    assert sum(report.faults.values()) >= 8, report.describe()


def test_negative_control_reports_a_loss(tmp_path: Path) -> None:
    report = run_chaos(tmp_path, SEED, rounds=1, negative_control=True)
    print(report.describe())
    assert report.verdict.lost > 0, report.describe()
