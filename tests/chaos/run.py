"""One chaos run: start the cluster, run the workload under a seeded fault schedule, heal,
read everything back and check it. Used by ``test_chaos.py`` (short schedules in
``make test``) and ``python -m tests.chaos`` (``make chaos``: many seeds, long schedules,
figures into ``docs/RELIABILITY.md``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.chaos.checker import ReplicaBatches, Verdict, check
from tests.chaos.cluster import BROKER_IDS, ChaosCluster
from tests.chaos.disk import replica_batches
from tests.chaos.nemesis import FAULT_KINDS, Nemesis, schedule
from tests.chaos.workload import Workload, read_all
from tidelog.consumer import Consumer

TOPIC = "chaos"
PARTITIONS = 3

STORAGE_CONFIGS = {"page.cache.window.bytes": str(128 << 10), "segment.bytes": str(512 << 10)}
"""A 128 KiB page-cache window and 512 KiB segments, so that under every fault the brokers
also write back and drop pages (``page_cache``) and roll and retire segments: the default
64 MiB window and 1 GiB segments are never reached by a round's ~1 MB per partition."""

SAFE_CONFIGS = {
    "min.insync.replicas": "2",
    "unclean.leader.election.enable": "false",
    **STORAGE_CONFIGS,
}
"""What the run must survive: RF=3, acks=all, two in-sync copies before an ack."""

NEGATIVE_CONTROL_CONFIGS = {
    "min.insync.replicas": "1",
    "unclean.leader.election.enable": "true",
    **STORAGE_CONFIGS,
}
"""The negative control: a leader may acknowledge alone and an out-of-sync replica may be
elected, so ``lose_leader`` must make the checker report a loss."""

MIN_ACKED = 1000
"""A run acknowledges at least this many values (two writers at 200 values/s for the
minutes a schedule takes make tens of thousands): fewer means the writers were stopped
or every send failed, and a checker that finds nothing wrong with nothing proves
nothing."""

MAY_SKIP = frozenset({"partition_broker", "disk_error"})
"""Fault kinds a run may skip: partitions need network namespaces, disk errors strace (and
an EIO that never came is not counted). Every other fault of the schedule must be
applied, and at least one fault in all."""


@dataclass
class RunReport:
    seed: int
    rounds: int
    negative_control: bool
    verdict: Verdict
    faults: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    unhealed: int = 0
    seconds: float = 0.0
    nemesis_lines: list[str] = field(default_factory=list)
    # Whether every partition's full ISR was back at the end (a replica that never rejoins
    # is a failure even when nothing was lost; found by an audit), and the nodes that
    # stopped without a fault stopping them.
    healed: bool = True
    unexpected_exits: list[str] = field(default_factory=list)
    # The floors of a run that tested something: at least ``MIN_ACKED`` values
    # acknowledged and ``min_faults`` faults applied (``run_chaos``: those of the
    # schedule not in ``MAY_SKIP``). ``make chaos`` passed a seed that acknowledged
    # nothing and injected nothing (found by an audit); only test_chaos.py checked.
    min_faults: int = 1
    # Consumers that had not read up to the end offsets when the run stopped waiting.
    stalled_consumers: list[str] = field(default_factory=list)

    @property
    def applied(self) -> int:
        return sum(self.faults.values())

    @property
    def ok(self) -> bool:
        """Nothing lost or wrong in the data, the cluster whole again, no node crashed,
        every consumer at the end, and enough acknowledged and injected to mean that."""
        return (
            self.verdict.ok
            and self.healed
            and not self.unexpected_exits
            and not self.stalled_consumers
            and self.verdict.acked >= MIN_ACKED
            and self.applied >= max(1, self.min_faults)
        )

    def describe(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.faults.items()))
        skipped = ", ".join(f"{k} {n}" for k, n in sorted(self.skipped.items())) or "none"
        return (
            f"seed {self.seed} ({'negative control' if self.negative_control else 'safe'}), "
            f"{self.seconds:.0f} s: faults {kinds}; skipped {skipped}; not healed in time "
            f"{self.unhealed}{'' if self.healed else ' (nor at the end)'}; exited by "
            f"themselves: {', '.join(self.unexpected_exits) or 'none'}; applied "
            f"{self.applied} faults (at least {max(1, self.min_faults)}), acknowledged "
            f"{self.verdict.acked} (at least {MIN_ACKED}); consumers short of the end: "
            f"{', '.join(self.stalled_consumers) or 'none'}\n"
            f"{self.verdict.summary()}\nnemesis:\n  " + "\n  ".join(self.nemesis_lines)
        )


def _wait_consumers(workload: Workload, ends: dict[int, int], timeout_s: float) -> list[str]:
    """Until every consumer has read up to ``ends``, or the time is up: the consumers
    that had not, none when all did. One short of the end fails the run (the checker
    counts it as ``stalled`` too); it was waited for quietly (found by an audit)."""
    deadline = time.monotonic() + timeout_s
    while True:
        behind = []
        for name, reads in list(workload.history.reads.items()):
            last: dict[int, int] = {}
            for partition, offset, _ in list(reads):
                last[partition] = offset
            if any(last.get(p, -1) + 1 < end for p, end in ends.items()):
                behind.append(name)
        if not behind or time.monotonic() >= deadline:
            return behind
        time.sleep(0.2)


def run_chaos(
    base_dir: Path,
    seed: int,
    rounds: int = 1,
    *,
    negative_control: bool = False,
    kinds: Sequence[str] = FAULT_KINDS,
) -> RunReport:
    """``rounds`` of every fault kind in ``kinds`` (shuffled per round), then the checker."""
    started = time.monotonic()
    configs = NEGATIVE_CONTROL_CONFIGS if negative_control else SAFE_CONFIGS
    with ChaosCluster(base_dir) as cluster:
        cluster.start()
        cluster.create_topic(TOPIC, PARTITIONS, configs)
        cluster.wait_healthy(TOPIC, 30.0)
        workload = Workload(cluster.gateway_address, TOPIC, PARTITIONS).start()
        time.sleep(1.0)  # some traffic before the first fault
        nemesis = Nemesis(cluster, TOPIC, seed)
        faults = schedule(seed, rounds, PARTITIONS, kinds)
        log = nemesis.run(faults)
        healed = cluster.wait_healthy(TOPIC, 60.0)
        if not healed:
            log.unhealed += 1
        workload.stop_writers(flush_timeout_s=30.0)
        probe = Consumer(cluster.gateway_address, request_timeout_ms=10_000)
        try:
            tps = [(TOPIC, p) for p in range(PARTITIONS)]
            ends = {tp[1]: end for tp, end in probe.end_offsets(tps).items()}
        finally:
            probe.close()
        stalled = _wait_consumers(workload, ends, 30.0)
        workload.stop_readers()
        final = read_all(cluster.gateway_address, TOPIC, PARTITIONS, timeout_s=60.0)
        replicas: dict[int, dict[int, ReplicaBatches]] = {
            p: {b: replica_batches(cluster.data_dir(b), TOPIC, p) for b in BROKER_IDS}
            for p in range(PARTITIONS)
        }
        # Healed, every replica is in its ISR: each must hold all that is below the HW.
        verdict = check(workload.history, final, replicas, ends, in_sync=healed)
        # A node that crashed after the last fault's heal: nothing restarts it now.
        nemesis.find_exits(restart=False)
    return RunReport(
        seed=seed,
        rounds=rounds,
        negative_control=negative_control,
        verdict=verdict,
        faults=log.applied,
        skipped=log.skipped,
        unhealed=log.unhealed,
        seconds=time.monotonic() - started,
        nemesis_lines=log.lines,
        healed=healed,
        unexpected_exits=log.unexpected_exits,
        min_faults=sum(1 for fault in faults if fault.kind not in MAY_SKIP),
        stalled_consumers=stalled,
    )
