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

from tests.chaos.groups import FAULT_KINDS, run_group_chaos
from tests.chaos.nemesis import FAULT_KINDS as FAULTS
from tests.chaos.run import MAY_SKIP, run_chaos

SEED = int(os.environ.get("TIDELOG_CHAOS_SEED", "11"))


def test_short_schedule_loses_nothing(tmp_path: Path) -> None:
    report = run_chaos(tmp_path, SEED, rounds=1)
    print(report.describe())
    # ``ok`` holds the floors too, as ``make chaos``'s runs need them: at least
    # ``MIN_ACKED`` values acknowledged, and every fault of the round applied but those
    # the machine may lack the tools for (``MAY_SKIP``: 8 of the 10 kinds at least).
    assert report.ok, report.describe()
    assert report.min_faults == len(FAULTS) - len(MAY_SKIP) == 8, report.describe()


def test_negative_control_reports_a_loss(tmp_path: Path) -> None:
    # The one fault that loses acknowledged writes once the topic allows it; the other
    # kinds are the safe run's (and make chaos runs negative controls of every kind).
    report = run_chaos(tmp_path, SEED, rounds=1, negative_control=True, kinds=("lose_leader",))
    print(report.describe())
    assert report.verdict.lost > 0, report.describe()


def test_consumer_group_processes_every_record_through_kills(tmp_path: Path) -> None:
    """A group of 3 member processes, its gateways and etcd killed with SIGKILL while a
    producer writes with acks=all (tests/chaos/groups.py): every acknowledged record is
    processed, no committed offset goes backwards, the group is Stable again each time."""
    report = run_group_chaos(tmp_path, SEED, 20.0, FAULT_KINDS, auto_commit=False)
    print(report.describe())
    # ``ok`` holds the floors of any run (something acknowledged, injected, committed);
    # a run of 20 s must make more.
    assert report.ok, report.describe()
    assert report.acked > 500, report.describe()
    assert sum(report.faults.values()) >= 3, report.describe()
