"""Faults, scheduled from a seed, applied to a ``ChaosCluster`` one at a time.

A schedule is a list of ``Fault``s drawn from ``random.Random(seed)``: each round holds
every kind once, in a shuffled order, with drawn targets and durations, so any seed
exercises every kind and a failing seed replays the same faults (the timing of the
processes themselves is not deterministic; the schedule is).

Kinds (issue 9):

- ``kill_leader`` / ``kill_follower``: kill -9 a partition's leader or one of its followers,
  restart it after a while on the same data directory;
- ``kill_controller``: kill -9 the active controller (the standby takes over), restart it;
- ``pause_broker``: SIGSTOP a broker for longer than its lease TTL, then SIGCONT — it comes
  back believing it still leads, and must be fenced;
- ``partition_broker``: cut a broker off the network (``netns.py``) past its lease TTL;
- ``restart_etcd``: kill -9 etcd, start it again on the same data and ports;
- ``torn_tail``: kill -9 a broker, tear or garble the end of its newest segments, restart;
- ``disk_error``: restart a broker under strace injecting EIO into its segment writes
  (``pwritev``/``pwritev2``, which only appends make) from a drawn count on, so the
  disk fails under a running node that leads and follows; afterwards restart it
  normally;
- ``kill_all_brokers``: kill -9 every storage node at once, restart them all: what they
  wrote is in the page cache, so everything acknowledged must survive (an acks=all
  acknowledgement waits for the followers' writes, not for their fetch requests);
- ``lose_leader``: pause both followers past the TTL (the ISR shrinks to the leader), let
  the leader take writes alone, kill -9 it, resume the followers, then restart it. With
  ``min.insync.replicas=2`` the leader cannot acknowledge alone and the partitions wait
  offline for it; with ``min.insync.replicas=1`` and unclean election (the negative
  control) a follower is elected without those writes and they are lost.

After each fault the nemesis heals everything (processes started, resumed, network
restored) and waits until every partition has its full ISR again, so that faults do not
pile up beyond what RF=3 with ``min.insync.replicas=2`` promises to survive.
"""

from __future__ import annotations

import random
import shutil
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.storage.node import EXIT_DISK_FAILURE
from tests.chaos.cluster import BROKER_IDS, SESSION_TTL_S, ChaosCluster, Node
from tests.chaos.disk import damage_tail

FAULT_KINDS = (
    "kill_leader",
    "kill_follower",
    "kill_controller",
    "pause_broker",
    "partition_broker",
    "restart_etcd",
    "torn_tail",
    "disk_error",
    "lose_leader",
    "kill_all_brokers",
)

HEAL_TIMEOUT_S = 45.0
"""How long after healing a fault the cluster gets to show every partition's full ISR."""

DISK_ERROR_WAIT_S = 20.0
"""How long a broker restarted under an EIO injection gets to reach its drawn segment write
and halt (the count is drawn in 20..400; a follower under the chaos workload makes a few
hundred a second at most): one still running then injected nothing, and is not counted."""


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    partition: int  # which partition's leader/followers a partition-relative fault hits
    broker: int  # the broker a broker-level fault hits
    duration_s: float  # how long the fault lasts beyond what the kind needs
    number: int  # a drawn count (the EIO injection point of disk_error)


def schedule(
    seed: int, rounds: int, partitions: int, kinds_allowed: Sequence[str] = FAULT_KINDS
) -> list[Fault]:
    rng = random.Random(seed)
    faults: list[Fault] = []
    for _ in range(rounds):
        kinds = list(kinds_allowed)
        rng.shuffle(kinds)
        faults.extend(
            Fault(
                kind,
                partition=rng.randrange(partitions),
                broker=rng.choice(BROKER_IDS),
                duration_s=round(rng.uniform(0.5, 3.0), 2),
                number=rng.randint(20, 400),
            )
            for kind in kinds
        )
    return faults


@dataclass
class NemesisLog:
    applied: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    unhealed: int = 0  # faults after which the full ISR did not come back in time
    # Nodes found stopped that no fault stopped (a crash, a wrong exit status): each fails
    # the run. heal() restarted them silently (found by an audit).
    unexpected_exits: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


class Nemesis:
    """Applies a schedule to a cluster; driven by one thread."""

    def __init__(self, cluster: ChaosCluster, topic: str, seed: int) -> None:
        self.cluster = cluster
        self.topic = topic
        self.rng = random.Random(seed ^ 0x5EED)
        self.log = NemesisLog()
        self._started = time.monotonic()

    def _say(self, text: str) -> None:
        self.log.lines.append(f"{time.monotonic() - self._started:7.2f}s {text}")

    def run(self, faults: list[Fault]) -> NemesisLog:
        for fault in faults:
            # A node that exited by itself since the last heal (while it waited, say) is
            # found before a fault can kill it: ``Node.kill`` does nothing to an exited
            # process, the fault restarted it, and the crash was never reported (found by
            # an audit).
            if self.find_exits():
                self.cluster.wait_healthy(self.topic, HEAL_TIMEOUT_S)
            getattr(self, fault.kind)(fault)
            self.heal()
        return self.log

    # --- healing -------------------------------------------------------------------------

    def _exited_by_itself(self, name: str, node: Node, restart: bool) -> None:
        """``node`` is not running and no fault stopped it (every fault restarts what it
        stops): a crash of the product, which fails the run."""
        status = None if node.process is None else node.process.proc.returncode
        self.log.unexpected_exits.append(f"{name} exited by itself (status {status})")
        then = "restarted; " if restart else ""
        self._say(f"{name} exited by itself, status {status}: {then}the run fails")

    def find_exits(self, *, restart: bool = True) -> bool:
        """Records every node (etcd, controller, broker) that is not running, and starts
        it again if ``restart``: between faults, nothing stopped it but itself. True if
        one was found."""
        cluster = self.cluster
        found = False
        if not cluster.etcd.is_running():
            found = True
            then = "restarted; " if restart else ""
            self.log.unexpected_exits.append("etcd exited by itself")
            self._say(f"etcd exited by itself: {then}the run fails")
            if restart:
                cluster.etcd.start()
        for controller_id, node in cluster.controllers.items():
            node.resume()
            if not node.running:
                found = True
                self._exited_by_itself(f"controller {controller_id}", node, restart)
                if restart:
                    cluster.start_controller(controller_id)
        for broker_id, node in cluster.brokers.items():
            node.resume()
            if not node.running:
                found = True
                self._exited_by_itself(f"broker {broker_id}", node, restart)
                if restart:
                    cluster.start_broker(broker_id)
        return found

    def heal(self) -> None:
        cluster = self.cluster
        if cluster.network is not None:
            cluster.network.heal_all()
        self.find_exits()
        if not cluster.wait_healthy(self.topic, HEAL_TIMEOUT_S):
            self.log.unhealed += 1
            self._say("cluster did not regain full ISRs in time")

    # --- faults --------------------------------------------------------------------------

    def _leader(self, fault: Fault) -> int:
        leader = self.cluster.leader_of(self.topic, fault.partition)
        return leader if leader >= 0 else fault.broker

    def _kill_and_restart(self, fault: Fault, broker: int, role: str) -> None:
        self._say(f"kill -9 broker {broker} ({role} of partition {fault.partition})")
        self.cluster.brokers[broker].kill()
        time.sleep(fault.duration_s)
        self.cluster.start_broker(broker)
        self.log.applied[fault.kind] += 1

    def kill_leader(self, fault: Fault) -> None:
        self._kill_and_restart(fault, self._leader(fault), "leader")

    def kill_follower(self, fault: Fault) -> None:
        leader = self._leader(fault)
        follower = self.rng.choice([b for b in BROKER_IDS if b != leader])
        self._kill_and_restart(fault, follower, "follower")

    def kill_controller(self, fault: Fault) -> None:
        controller_id = self.cluster.active_controller_id()
        if controller_id is None:
            self.log.skipped[fault.kind] += 1
            return
        self._say(f"kill -9 active controller {controller_id}")
        self.cluster.controllers[controller_id].kill()
        time.sleep(fault.duration_s)
        self.cluster.start_controller(controller_id)
        self.log.applied[fault.kind] += 1

    def pause_broker(self, fault: Fault) -> None:
        self._say(f"SIGSTOP broker {fault.broker} for {SESSION_TTL_S + fault.duration_s:.1f} s")
        node = self.cluster.brokers[fault.broker]
        node.pause()
        time.sleep(SESSION_TTL_S + fault.duration_s)
        node.resume()
        self.log.applied[fault.kind] += 1

    def partition_broker(self, fault: Fault) -> None:
        network = self.cluster.network
        if network is None:
            self._say(f"no partition: {self.cluster.no_network_reason}")
            self.log.skipped[fault.kind] += 1
            return
        seconds = SESSION_TTL_S + fault.duration_s
        self._say(f"isolate broker {fault.broker} for {seconds:.1f} s")
        network.isolate(f"broker-{fault.broker}")
        time.sleep(seconds)
        network.heal(f"broker-{fault.broker}")
        self.log.applied[fault.kind] += 1

    def restart_etcd(self, fault: Fault) -> None:
        self._say(f"kill -9 etcd for {fault.duration_s:.1f} s")
        self.cluster.etcd.kill()
        time.sleep(fault.duration_s)
        self.cluster.etcd.start()
        self.log.applied[fault.kind] += 1

    def torn_tail(self, fault: Fault) -> None:
        broker = fault.broker
        self.cluster.brokers[broker].kill()
        data_dir = self.cluster.data_dir(broker)
        partitions = sorted(
            {fault.partition, self.rng.randrange(_partition_count(data_dir, self.topic))}
        )
        for partition in partitions:
            self._say(
                f"broker {broker} killed; {damage_tail(data_dir, self.topic, partition, self.rng)}"
            )
        self.cluster.start_broker(broker)
        self.log.applied[fault.kind] += 1

    def disk_error(self, fault: Fault) -> None:
        if shutil.which("strace") is None:
            self._say("no disk error: strace is not installed")
            self.log.skipped[fault.kind] += 1
            return
        broker = fault.broker
        node = self.cluster.brokers[broker]
        node.kill()
        wrapper = [
            "strace",
            "-f",
            "-qq",
            "--seccomp-bpf",
            "-o",
            "/dev/null",
            "-e",
            "trace=pwrite64,pwritev,pwritev2,fsync,fdatasync",
            # Only segment writes fail: start-up makes dozens of pwrite64s and fsyncs
            # (checkpoints, index rebuilds), so counts drawn over those made every
            # injection a failed start, never a disk failing under a running node. A
            # failing fsync is covered by tests/chaos/test_disk_failure.py.
            "-e",
            f"inject=pwritev,pwritev2:error=EIO:when={fault.number}+",
        ]
        self._say(
            f"broker {broker} restarted under strace: EIO from segment write {fault.number} on"
        )
        try:
            self.cluster.start_broker(broker, wrapper=wrapper)
        except (RuntimeError, TimeoutError) as exc:
            # Failing to start on a failing disk is a correct answer too.
            self._say(f"broker {broker} did not come up on the failing disk: {str(exc)[:80]}")
        deadline = time.monotonic() + max(SESSION_TTL_S + fault.duration_s, DISK_ERROR_WAIT_S)
        while node.running and time.monotonic() < deadline:
            time.sleep(0.1)
        # Counted only when the broker halted as a failed disk must make it (exit 3): one
        # still running never met its EIO, and was counted as injected all the same; any
        # other status is a wrong answer to a failing disk (found by an audit).
        status = None if node.process is None else node.process.proc.returncode
        if node.running:
            self._say(f"broker {broker} still running: its EIO never came; not counted")
            self.log.skipped[fault.kind] += 1
        elif status == EXIT_DISK_FAILURE:
            self._say(f"broker {broker} exited {status} (disk failure) on the failing disk")
            self.log.applied[fault.kind] += 1
        else:
            self.log.unexpected_exits.append(
                f"broker {broker} exited {status} on a failing disk, not {EXIT_DISK_FAILURE}"
            )
            self._say(f"broker {broker} exited {status} on the failing disk: the run fails")
        node.kill()
        self.cluster.start_broker(broker)

    def kill_all_brokers(self, fault: Fault) -> None:
        self._say("kill -9 every broker at once")
        for node in self.cluster.brokers.values():
            node.kill()
        time.sleep(fault.duration_s)
        for broker in self.cluster.brokers:
            self.cluster.start_broker(broker)
        self.log.applied[fault.kind] += 1

    def lose_leader(self, fault: Fault) -> None:
        leader = self._leader(fault)
        followers = [b for b in BROKER_IDS if b != leader]
        self._say(
            f"SIGSTOP brokers {followers}; leader {leader} of partition {fault.partition} alone"
        )
        for broker in followers:
            self.cluster.brokers[broker].pause()
        time.sleep(SESSION_TTL_S + 1.5 + fault.duration_s)
        self._say(f"kill -9 broker {leader}; SIGCONT {followers}")
        self.cluster.brokers[leader].kill()
        for broker in followers:
            self.cluster.brokers[broker].resume()
        time.sleep(SESSION_TTL_S + 2.0)
        self._say(f"restart broker {leader}")
        self.cluster.start_broker(leader)
        self.log.applied[fault.kind] += 1


def _partition_count(data_dir: Path, topic: str) -> int:
    return max(1, sum(1 for p in data_dir.glob(f"{topic}-*") if p.is_dir()))
