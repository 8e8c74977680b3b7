"""The controller with real etcd, real storage nodes and real controller processes.

Two clusters, each shared by a group of tests (starting processes is the slow part):

- ``cluster``: 3 brokers, an active controller and a standby, automatic rebalancing off.
  Topic lifecycle, assignment, bad input, standby answers, broker failure and return,
  preferred election on demand, controlled shutdown.
- ``failover_cluster``: 3 brokers and controllers with a 1 s imbalance check. Automatic
  preferred election, controller failover, fencing of a deposed controller.

Session TTL is 2 s everywhere (etcd runs with fast test timings), so a kill -9 is noticed
within about 2.5 s. Tests that need a replica back in an ISR at once send the
AlterPartition its leader would (``expand_isr``) rather than wait for its fetchers.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import etcd3
import grpc
import pytest

import tidelog
from services.cluster_metadata import (
    CONTROLLER_KEY,
    PRODUCER_IDS_KEY,
    broker_key,
    decode_broker,
    decode_partition,
    decode_producer_ids,
    deletion_key,
    encode_broker,
    encode_partition,
    partition_key,
    topic_key,
)
from services.controller.controller import Controller, ControllerConfig, IsrProposal, NewTopic
from services.controller.election import ControllerElection
from services.controller.state import Broker, PartitionRecord
from services.metastore import Guard, KeyValue, MetaStore
from tests.support.cluster import (
    RPC_TIMEOUT_S,
    ControllerProcess,
    TestCluster,
    error_code,
    poll_records,
    rpc_error_code,
    trailer,
    wait_for,
)
from tidelog.errors import ErrorCode, RequestTimedOutError, StorageError
from tidelog.etcd_launcher import EtcdProcess, EtcdTuning
from tidelog.v1 import common_pb2, controller_pb2, storage_pb2

pytestmark = pytest.mark.timeout(180)

TTL_S = 2
FAILOVER_BUDGET_S = TTL_S + 2  # the bound: a new leader within lease TTL + 2 s


# --- fixtures and helpers -------------------------------------------------------------------


def _start(base: Path, imbalance_check_interval_s: float) -> TestCluster:
    cluster = TestCluster(
        base, session_ttl_s=TTL_S, imbalance_check_interval_s=imbalance_check_interval_s
    )
    try:
        for broker_id in (1, 2, 3):
            cluster.start_broker(broker_id, wait=False)
        for broker_id in (1, 2, 3):
            cluster.brokers[broker_id].start()
        cluster.start_controller(101)
        cluster.active_controller()  # 101 wins: it is the only candidate yet
        cluster.start_controller(102)
        cluster.wait_brokers([1, 2, 3])
    except BaseException:
        print(cluster.logs())
        cluster.close()
        raise
    return cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    started = _start(tmp_path_factory.mktemp("controller"), imbalance_check_interval_s=300)
    try:
        yield started
    finally:
        started.close()


@pytest.fixture(scope="module")
def failover_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    started = _start(tmp_path_factory.mktemp("failover"), imbalance_check_interval_s=1)
    try:
        yield started
    finally:
        started.close()


def controller_keys(cluster: TestCluster) -> dict[str, tuple[int, bytes]]:
    """Every key the controller owns, with its mod_revision and value."""
    return {
        kv.key: (kv.mod_revision, kv.value)
        for kv in cluster.store.get_prefix("")
        if not kv.key.startswith("brokers/")
    }


def leaders(cluster: TestCluster, topic: str) -> dict[int, int]:
    return {p.partition: p.leader for p in cluster.partitions(topic)}


def expand_isr(cluster: TestCluster, topic: str, broker_id: int) -> None:
    """Add ``broker_id`` to every ISR of ``topic`` it belongs in, as each leader would.

    The leaders run their own ISR passes too (replica fetchers catch up and rejoin), so a
    proposal may lose the partition-epoch race to the leader's own expansion: that loss
    (INVALID_UPDATE_VERSION) is retried from the state now in force.
    """
    deadline = time.monotonic() + 10
    while True:
        pending = [
            p
            for p in cluster.partitions(topic)
            if broker_id in p.replicas and broker_id not in p.isr
        ]
        if not pending:
            return
        try:
            _expand_isr_once(cluster, topic, broker_id, pending)
        except _IsrRaceLostError:
            assert time.monotonic() < deadline, "ISR expansion kept losing races"


class _IsrRaceLostError(Exception):
    pass


def _expand_isr_once(
    cluster: TestCluster, topic: str, broker_id: int, pending: list[common_pb2.PartitionState]
) -> None:
    for p in pending:
        response = cluster.api.AlterPartition(
            controller_pb2.AlterPartitionRequest(
                broker_id=p.leader,
                broker_epoch=cluster.broker_epoch(p.leader),
                partitions=[
                    controller_pb2.AlterPartitionItem(
                        topic=topic,
                        partition=p.partition,
                        leader_epoch=p.leader_epoch,
                        new_isr=[*p.isr, broker_id],
                        partition_epoch=p.partition_epoch,
                        # The incarnation that caught up (KIP-841): the one registered.
                        joining=[
                            controller_pb2.IsrMember(
                                broker_id=broker_id, broker_epoch=cluster.broker_epoch(broker_id)
                            )
                        ],
                    )
                ],
            ),
            timeout=RPC_TIMEOUT_S,
        )
        (result,) = response.partitions
        if error_code(result.error) == ErrorCode.INVALID_UPDATE_VERSION:
            raise _IsrRaceLostError
        assert error_code(result.error) == ErrorCode.NONE, result
        assert broker_id in result.state.isr
        assert result.state.partition_epoch == p.partition_epoch + 1
        assert result.state.leader_epoch == p.leader_epoch  # same leader, same epoch


def heal_isrs(cluster: TestCluster) -> None:
    """Every live replica back in every ISR (what replication will do by itself)."""
    live = [b.broker_id for b in cluster.describe_cluster().brokers]
    topics = cluster.api.Metadata(controller_pb2.MetadataRequest(), timeout=RPC_TIMEOUT_S).topics
    for topic in topics:
        for broker_id in live:
            expand_isr(cluster, topic.name, broker_id)


def isrs_settled(cluster: TestCluster) -> bool:
    """Every live replica is in its ISR: the leaders' own ISR passes have nothing left to
    propose, so the controller's keys stay as they are unless something writes them."""
    live = {b.broker_id for b in cluster.describe_cluster().brokers}
    topics = cluster.api.Metadata(controller_pb2.MetadataRequest(), timeout=RPC_TIMEOUT_S).topics
    return all(
        set(p.replicas) & live <= set(p.isr)
        for topic in topics
        for p in cluster.partitions(topic.name)
    )


def hosted_roles(cluster: TestCluster, broker_id: int, topic: str) -> dict[int, bool]:
    """partition -> is_leader, as the storage node itself reports (DescribeLogDirs)."""
    response = cluster.brokers[broker_id].stub.DescribeLogDirs(
        storage_pb2.DescribeLogDirsRequest(), timeout=RPC_TIMEOUT_S
    )
    return {
        log.partition: log.is_leader
        for log_dir in response.log_dirs
        for log in log_dir.partitions
        if log.topic == topic
    }


def kill_broker_and_check_failover(cluster: TestCluster, topic: str, victim: int) -> None:
    """kill -9 ``victim``; every partition it led gets an ISR leader within the budget."""
    before = {p.partition: p for p in cluster.partitions(topic)}
    led = [p for p in before.values() if p.leader == victim]
    assert led, f"broker {victim} leads nothing in {topic}"
    killed_at = time.monotonic()
    cluster.kill(cluster.brokers[victim])

    def moved() -> bool:
        now = {p.partition: p for p in cluster.partitions(topic)}
        return all(now[p.partition].leader not in (victim, -1) for p in led) and all(
            victim not in p.isr for p in now.values()
        )

    wait_for(moved, FAILOVER_BUDGET_S + 5, f"leaders of {topic} to leave broker {victim}")
    elapsed = time.monotonic() - killed_at
    assert elapsed <= FAILOVER_BUDGET_S, f"failover took {elapsed:.2f} s"
    after = {p.partition: p for p in cluster.partitions(topic)}
    for old in led:
        new = after[old.partition]
        assert new.leader in old.isr, (old, new)
        assert new.leader_epoch > old.leader_epoch
        assert new.partition_epoch > old.partition_epoch
    for p in after.values():
        assert victim not in p.isr
        assert p.leader != victim


# --- topics ----------------------------------------------------------------------------------


def test_a_controller_back_from_an_etcd_outage_does_not_wait_for_its_own_key(
    tmp_path: Path,
) -> None:
    """etcd away longer than the election lease's TTL: the controller resigns, and its
    revoke fails. etcd, back with its data, restores the lease and the controller key
    with it; the next campaign revokes that lease first instead of waiting a whole TTL
    for its own stale key, without any controller meanwhile (found by an audit)."""
    ttl_s = 8
    server = EtcdProcess(tmp_path / "etcd").start()
    try:
        meta = MetaStore(server.endpoint, cluster="outage", timeout_s=1.0)
        elected: list[int] = []
        resigned: list[bool] = []
        election = ControllerElection(
            meta,
            controller_id=1,
            address="127.0.0.1:1",
            ttl_s=ttl_s,
            on_elected=elected.append,
            on_resigned=lambda: resigned.append(True),
        ).start()
        try:
            wait_for(lambda: elected, 10, "the first election")
            server.kill()
            wait_for(lambda: resigned, ttl_s + 10, "the lease given up")
            server.start()
            back_at = time.monotonic()
            wait_for(lambda: len(elected) == 2, 3 * ttl_s, "the election after the outage")
            # Before the restored key's TTL ran out (its expiry is what the old code waited).
            assert time.monotonic() - back_at < ttl_s
        finally:
            election.stop()
            meta.close()
    finally:
        server.kill()


def test_a_lease_lost_during_activation_resigns_after_the_activation(tmp_path: Path) -> None:
    """The election's lease is lost while ``on_elected`` is still taking office. The
    term is given up when the activation returns, never concurrently with it: the
    keeper's thread used to call ``on_resigned`` at once, tearing down a term still being
    set up (the activation then went on to watch brokers for a term already gone, a
    watch nobody cancelled; found by an audit)."""
    ttl_s = 1
    with EtcdProcess(tmp_path / "etcd") as server, MetaStore(server.endpoint, cluster="x") as meta:
        events: list[str] = []
        activating = threading.Event()
        release = threading.Event()

        def on_elected(epoch: int) -> None:
            events.append("activation begins")
            activating.set()
            release.wait(30)
            events.append("activation ends")

        election = ControllerElection(
            meta,
            controller_id=1,
            address="127.0.0.1:1",
            ttl_s=ttl_s,
            on_elected=on_elected,
            on_resigned=lambda: events.append("resigned"),
        ).start()
        try:
            assert activating.wait(10)
            held = meta.get(CONTROLLER_KEY)
            assert held is not None
            meta.revoke_lease_id(held.lease_id)
            time.sleep(3 * ttl_s)  # the keeper refreshes every TTL/3 and finds it gone
            assert events == ["activation begins"]
            release.set()
            wait_for(lambda: "resigned" in events, 10, "the term given up")
            assert events[:3] == ["activation begins", "activation ends", "resigned"]
        finally:
            release.set()
            election.stop()


def test_a_stop_while_the_campaign_wins_releases_the_controller_key(tmp_path: Path) -> None:
    """stop() while the winning campaign's transaction is in flight: the term began by
    clearing the wake-up stop() had set, and its loop then waited for ever, the key held
    and its lease kept alive, so the standby waited a TTL or more (found by an audit)."""
    ttl_s = 1
    with EtcdProcess(tmp_path / "etcd") as server, MetaStore(server.endpoint, cluster="x") as meta:
        election = ControllerElection(
            meta,
            controller_id=1,
            address="127.0.0.1:1",
            ttl_s=ttl_s,
            on_elected=lambda epoch: None,
            on_resigned=lambda: None,
        )
        real_txn = meta.txn
        stopper: list[threading.Thread] = []

        def txn(compares: Any, success: Any, failure: Any = (), **kw: Any) -> Any:
            if not stopper and any(getattr(c, "key", None) == CONTROLLER_KEY for c in compares):
                # The owner stops the election while the campaign's transaction runs.
                stopping = threading.Thread(target=election.stop, kwargs={"timeout_s": 3.0})
                stopper.append(stopping)
                stopping.start()
                wait_for(election._stopping.is_set, 5, "stop() under way")
            return real_txn(compares, success, failure, **kw)

        meta.txn = txn  # type: ignore[method-assign]
        election.start()
        wait_for(lambda: stopper, 10, "the campaign")
        stopper[0].join(10)
        meta.txn = real_txn  # type: ignore[method-assign]
        wait_for(lambda: not election._thread.is_alive(), 3 * ttl_s, "the election's end")
        assert meta.get(CONTROLLER_KEY) is None


def test_a_standby_does_not_campaign_in_a_loop_once_the_terms_revision_is_compacted(
    tmp_path: Path,
) -> None:
    """etcd compacts its history (tidelog's etcd: every hour). A standby watched the
    controller key from the holder's own revision, the term's first: once compacted,
    every watch was cancelled at once, and the standby campaigned again, lost, and watched
    from the same revision, ten times a second while the active controller lived (lease
    grants, transactions, revokes, two log lines each). Found by an audit."""
    with EtcdProcess(tmp_path / "etcd") as server:
        active_meta = MetaStore(server.endpoint, cluster="c")
        standby_meta = MetaStore(server.endpoint, cluster="c")
        elected: list[int] = []
        active = ControllerElection(
            active_meta,
            controller_id=1,
            address="127.0.0.1:1",
            ttl_s=10,
            on_elected=elected.append,
            on_resigned=lambda: None,
        ).start()
        standby: ControllerElection | None = None
        try:
            wait_for(lambda: elected, 10, "the first election")
            for i in range(20):  # other cluster activity, then etcd's periodic compaction
                active_meta.put(f"brokers/{i}", b"{}")
            host, port = server.endpoint.removeprefix("http://").rsplit(":", 1)
            raw = etcd3.client(host=host, port=int(port))
            raw.compact(active_meta.current_revision())
            raw.close()
            grants: list[int] = []
            real_grant = standby_meta.grant_lease

            def counting_grant(ttl_s: int) -> Any:
                grants.append(ttl_s)
                return real_grant(ttl_s)

            standby_meta.grant_lease = counting_grant  # type: ignore[method-assign]
            standby = ControllerElection(
                standby_meta,
                controller_id=2,
                address="127.0.0.1:2",
                ttl_s=10,
                on_elected=lambda epoch: None,
                on_resigned=lambda: None,
            ).start()
            wait_for(lambda: grants or None, 10, "the standby's campaign")
            time.sleep(1.0)  # the span the old code campaigned in 10 times
            assert len(grants) == 1, f"the standby campaigned {len(grants)} times in 1 s"
            active.stop()  # its watch still sees the key go: it takes over
            wait_for(lambda: standby.epoch, 15, "the standby elected")
        finally:
            if standby is not None:
                standby.stop()
            active.stop()
            standby_meta.close()
            active_meta.close()


@pytest.mark.parametrize("ends_by", ["resync", "failover"])
def test_a_broker_restarted_unseen_mid_term_leaves_the_isr_after_a_later_isr_write(
    tmp_path: Path, ends_by: str
) -> None:
    """A broker restarts (perhaps with an empty disk) while the controller's broker watch
    is down; before the controller notices, the leader's ordinary AlterPartition (keeping
    it) rewrites the partition key. The resync (or a successor's take-office) told a
    restart by the registration being newer than the key's revision, so the new
    incarnation stayed in the ISR and was elected when the leader died: every
    acknowledged record could be lost. Records now name their ISR members' broker epochs
    (``isr_epochs``). In-process controller, real etcd, brokers as bare registrations;
    the watch outage is made by retiring the watch's generation. Found by an audit."""
    with EtcdProcess(tmp_path / "etcd") as server, MetaStore(server.endpoint, cluster="c") as meta:
        leases = {}
        for broker_id in (1, 2, 3):
            leases[broker_id] = meta.grant_lease(3600)
            assert meta.create_if_absent(
                broker_key(broker_id),
                encode_broker(Broker(broker_id, "127.0.0.1", 1)),
                leases[broker_id],
            )
        controller = Controller(
            meta,
            ControllerConfig(controller_id=1, advertised_address="127.0.0.1:1", session_ttl_s=2),
        ).start()
        try:
            wait_for(lambda: controller.is_active, 15, "the controller active")
            (created,) = controller.create_topics(
                [NewTopic("t", 0, 0, assignments=((0, (1, 2, 3)),))]
            )
            assert created.error is None, created.error

            def record() -> PartitionRecord:
                return decode_partition(meta.get(partition_key("t", 0)))[2]

            assert record().isr == (1, 2, 3) and record().leader == 1
            term = controller._term
            assert term is not None
            # The broker watch goes down: its events are no longer delivered.
            with controller._lock:
                term.watch_generation += 1
            old_epoch = meta.get(broker_key(3)).create_revision
            # Broker 3 restarts (say with an empty disk) while nobody watches.
            meta.revoke_lease_id(leases[3].id)
            leases[3] = meta.grant_lease(3600)
            assert meta.create_if_absent(
                broker_key(3), encode_broker(Broker(3, "127.0.0.1", 1)), leases[3]
            )
            new_epoch = meta.get(broker_key(3)).create_revision
            assert new_epoch > old_epoch
            # The leader shrinks the lagging broker 2 out (an ordinary AlterPartition).
            before = record()
            broker1_epoch = meta.get(broker_key(1)).create_revision
            (outcome,) = controller.alter_partition(
                1,
                broker1_epoch,
                [IsrProposal("t", 0, before.leader_epoch, (1, 3), before.partition_epoch)],
            )
            assert outcome.error is None, outcome.error
            if ends_by == "resync":
                # The watch failure is noticed: a resync re-reads the brokers.
                generation = term.watch_generation
                controller._schedule_resync(term)
                wait_for(
                    lambda: term.watch_generation > generation and not term.resync_needed,
                    15,
                    "the resync",
                )
            else:
                # The controller stops before noticing; a successor takes office.
                controller.stop()
                controller = Controller(
                    meta,
                    ControllerConfig(
                        controller_id=2, advertised_address="127.0.0.1:2", session_ttl_s=2
                    ),
                ).start()
                wait_for(lambda: controller.is_active, 15, "the successor active")
            time.sleep(0.5)
            after = record()
            # The consequence: the leader dies, and the restarted incarnation is elected.
            meta.revoke_lease_id(leases[1].id)
            wait_for(lambda: record().leader != 1, 15, "the leader's failure handled")
            elected = record()
            assert 3 not in after.isr and elected.leader != 3, (
                f"broker 3's new incarnation (epoch {new_epoch}, old {old_epoch}) stayed in "
                f"the ISR after the resync ({after}) and was elected when the leader died "
                f"({elected})"
            )
        finally:
            controller.stop()


def test_a_failing_resync_backs_off_while_etcd_is_down(tmp_path: Path) -> None:
    """etcd down: the broker watch fails, a resync is scheduled and fails, and the failed
    step scheduled the next at once; the housekeeping loop skipped its back-off for the
    resync step, so it spun a core (thousands of attempts a second) for the lease's TTL
    (found by an audit)."""
    server = EtcdProcess(tmp_path / "etcd").start()
    meta = MetaStore(server.endpoint, cluster="spin", timeout_s=1.0)
    controller = Controller(
        meta, ControllerConfig(controller_id=1, advertised_address="127.0.0.1:1", session_ttl_s=10)
    )
    attempts: list[float] = []
    resync = controller._resync

    def counting(term: Any) -> None:
        attempts.append(time.monotonic())
        resync(term)

    controller._resync = counting  # type: ignore[method-assign]
    try:
        controller.start()
        wait_for(lambda: controller.is_active, 15, "the controller active")
        server.kill()
        time.sleep(0.5)
        before = len(attempts)
        time.sleep(3.0)  # well inside the 10 s TTL: still active
        during = len(attempts) - before
        # The back-off after a failure is min(1.0, ttl / 4) = 1 s: about 3 attempts.
        assert during <= 10, f"{during} resync attempts in 3 s with etcd down"
    finally:
        controller.stop()
        meta.close()
        server.kill()


def test_a_malformed_metadata_key_holds_activation_back_until_repaired(tmp_path: Path) -> None:
    """A topic key without its assignment: taking office would build the cluster's state
    without that topic (its logs then strays to delete), so the controller does not
    activate. It says which key is at fault in one line, retries at a calm pace (it used
    to re-elect itself and re-read the cluster in a hot loop), and activates once an
    operator repairs the key."""
    with EtcdProcess(tmp_path / "etcd") as server, MetaStore(server.endpoint, cluster="m") as meta:
        meta.put(topic_key("broken"), b'{"topic_id": "t1"}')
        controller = ControllerProcess(
            server.endpoint, controller_id=1, cluster="m", log_path=tmp_path / "controller.log"
        ).start()
        try:
            wanted = "metadata key 'topics/broken' lacks the field 'assignment'"
            wait_for(lambda: wanted in controller.log_tail(50), 15, "the failed activation")
            time.sleep(2.0)
            attempts = controller.log_tail(10_000).count("activation_failed")
            assert 1 <= attempts <= 8, f"{attempts} activations in about 2 s"
            with pytest.raises(grpc.RpcError) as refused:
                controller.stub.DescribeCluster(
                    controller_pb2.DescribeClusterRequest(), timeout=RPC_TIMEOUT_S
                )
            assert rpc_error_code(refused.value) == ErrorCode.NOT_CONTROLLER
            meta.delete(topic_key("broken"))
            wait_for(
                lambda: controller.stub.DescribeCluster(
                    controller_pb2.DescribeClusterRequest(), timeout=RPC_TIMEOUT_S
                ),
                15,
                "the activation after the repair",
            )
        finally:
            controller.terminate()


@pytest.mark.parametrize(
    ("key", "value", "decode"),
    [
        (broker_key(7), b'{"host":"h","port":1e400,"rack":null,"broker_epoch":1}', decode_broker),
        (
            partition_key("t", 0),
            b'{"leader":1,"leader_epoch":1e400,"isr":[1],"partition_epoch":0}',
            decode_partition,
        ),
    ],
)
def test_a_number_past_a_floats_range_is_a_malformed_key(
    key: str, value: bytes, decode: Callable[[KeyValue], object]
) -> None:
    """The decoders promise one error, StorageError naming the key, for any malformed
    value. A JSON number past a float's range (Python's json reads ``1e400`` as inf)
    escaped as OverflowError from ``int(inf)`` (found by an audit)."""
    with pytest.raises(StorageError, match=key):
        decode(KeyValue(key, value, 1, 1, 1, 0))


def test_one_broker_registration_past_a_floats_range_does_not_keep_controllers_out(
    tmp_path: Path,
) -> None:
    """A broker key the controller cannot decode is skipped with a warning. One whose
    number overflowed (above) made every take-office raise: no controller ever became
    active (found by an audit)."""
    with EtcdProcess(tmp_path / "etcd") as server, MetaStore(server.endpoint, cluster="w") as meta:
        lease = meta.grant_lease(3600)
        assert meta.create_if_absent(broker_key(1), encode_broker(Broker(1, "127.0.0.1", 1)), lease)
        meta.put(broker_key(2), b'{"host":"127.0.0.1","port":1e400,"rack":null}', lease)
        controller = Controller(
            meta,
            ControllerConfig(controller_id=1, advertised_address="127.0.0.1:1", session_ttl_s=2),
        ).start()
        try:
            wait_for(lambda: controller.is_active, 15, "a controller active")
        finally:
            controller.stop()


def test_brokers_with_and_without_a_rack_get_rack_unaware_placement(tmp_path: Path) -> None:
    """While some brokers have a rack and others none (a cluster mid-way through enabling
    zone labels), new topics are placed rack-unaware, not refused (DEPLOY.md said they
    were refused; an audit found the document wrong)."""
    with EtcdProcess(tmp_path / "etcd") as server, MetaStore(server.endpoint, cluster="r") as meta:
        lease = meta.grant_lease(3600)
        for broker_id, rack in ((1, "zone-a"), (2, "zone-b"), (3, "")):
            broker = Broker(broker_id, "127.0.0.1", broker_id, rack)
            assert meta.create_if_absent(broker_key(broker_id), encode_broker(broker), lease)
        controller = Controller(
            meta,
            ControllerConfig(controller_id=1, advertised_address="127.0.0.1:1", session_ttl_s=10),
        ).start()
        try:
            wait_for(lambda: controller.is_active, 15, "the controller active")
            (created,) = controller.create_topics([NewTopic("mixed", 3, 3)], timeout_ms=100)
            assert created.error is None, created.error
            assert created.topic is not None
            assert all(sorted(r) == [1, 2, 3] for r in created.topic.assignment)
        finally:
            controller.stop()


def test_an_admin_change_waits_for_a_busy_controller_no_longer_than_its_timeout(
    tmp_path: Path,
) -> None:
    """One admin change holds the controller's lock while it writes to etcd, up to the
    store's timeout when etcd does not answer; another waited behind it past its own
    timeout (found by an audit). It gets REQUEST_TIMED_OUT within its timeout now, having
    changed nothing."""
    with EtcdProcess(tmp_path / "etcd") as server:
        meta = MetaStore(server.endpoint, cluster="busy", timeout_s=5.0)
        lease = meta.grant_lease(3600)
        assert meta.create_if_absent(broker_key(1), encode_broker(Broker(1, "127.0.0.1", 1)), lease)
        controller = Controller(
            meta,
            ControllerConfig(controller_id=1, advertised_address="127.0.0.1:1", session_ttl_s=10),
        ).start()
        stuck = threading.Thread(
            target=lambda: controller.create_topics([NewTopic("slow", 1, 1)], timeout_ms=100)
        )
        try:
            wait_for(lambda: controller.is_active, 15, "the controller active")
            os.kill(server.pid, signal.SIGSTOP)  # etcd hangs: the create holds the lock
            stuck.start()
            time.sleep(0.5)
            started = time.monotonic()
            with pytest.raises(RequestTimedOutError, match="busy"):
                controller.delete_topics(["other"], timeout_ms=300)
            assert time.monotonic() - started < 2.0
        finally:
            os.kill(server.pid, signal.SIGCONT)
            stuck.join(30)
            controller.stop()
            meta.close()


def test_decisions_over_more_partitions_than_one_etcd_transaction_takes_are_split(
    tmp_path: Path,
) -> None:
    """A decision is written in transactions of at most TXN_CHUNK_OPS (100) partitions, so
    that an etcd at its default --max-txn-ops (128) takes them: creating a
    topic of 300 partitions, the failure of a broker leading about half of them, and a
    new controller taking office all succeed. Each used to be one transaction, which
    etcd refused every time: at 4,096 partitions (tidelog's own etcd limit) a broker's
    failure left its partitions led by the dead broker and no controller could take
    office (found by an audit). Brokers here are registrations only: the controller's
    pushes to them fail and are retried, which the etcd side does not wait for."""
    tuning = EtcdTuning(max_txn_ops=128)  # etcd's default (the chunk was 1,000 before)
    with (
        EtcdProcess(tmp_path / "etcd", tuning=tuning) as server,
        MetaStore(server.endpoint, cluster="wide") as meta,
    ):
        leases = {}
        for broker_id in (1, 2):
            leases[broker_id] = meta.grant_lease(3600)
            registered = Broker(broker_id, "127.0.0.1", 1)
            assert meta.create_if_absent(
                broker_key(broker_id), encode_broker(registered), leases[broker_id]
            )

        def start(controller_id: int) -> Controller:
            config = ControllerConfig(
                controller_id=controller_id,
                advertised_address=f"127.0.0.1:{controller_id}",
                session_ttl_s=2,
            )
            return Controller(meta, config).start()

        def leaders() -> Counter[int]:
            records = [decode_partition(kv)[2] for kv in meta.get_prefix("partitions/")]
            return Counter(record.leader for record in records)

        first = start(1)
        try:
            wait_for(lambda: first.is_active, 15, "the first controller")
            (created,) = first.create_topics([NewTopic("wide", 300, 2)])
            assert created.error is None, created.error
            assert sum(leaders().values()) == 300 and leaders()[1] > 100
            meta.revoke_lease_id(leases[1].id)  # broker 1 fails
            wait_for(lambda: leaders()[1] == 0, 15, "broker 1's leaderships moved")
            assert leaders() == Counter({2: 300})
        finally:
            first.stop()
        meta.put(broker_key(1), encode_broker(Broker(1, "127.0.0.1", 1)), leases[2])
        second = start(2)  # takes office with broker 1 back: 300 partitions to reconcile
        try:
            wait_for(lambda: second.is_active, 15, "the second controller")
        finally:
            second.stop()


def test_a_housekeeping_step_that_always_fails_does_not_stop_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finishing deletions fails at every pass here (as a deletion whose writes etcd
    refused did): offset expiry still runs, and marks a group found without members.
    The housekeeping steps shared one guard: the first failing step skipped the ones
    after it at every pass, for as long as it kept failing (found by an audit)."""

    def always_fails(self: Controller, term: object) -> None:
        raise RuntimeError("injected: finishing deletions fails")

    monkeypatch.setattr(Controller, "_finish_deletions", always_fails)
    with (
        EtcdProcess(tmp_path / "etcd") as server,
        MetaStore(server.endpoint, cluster="steps") as meta,
    ):
        # Committed by a group that has no members: the first expiry pass marks it empty.
        meta.put("groups/idle/t/0", b'{"offset": 3, "commit_time_ms": 1}')
        config = ControllerConfig(
            controller_id=1,
            advertised_address="127.0.0.1:1",
            session_ttl_s=2,
            offsets_retention_check_interval_s=0.2,
        )
        controller = Controller(meta, config).start()
        try:
            wait_for(lambda: controller.is_active, 15, "the controller")
            wait_for(lambda: meta.get("group-emptied/idle"), 15, "offset expiry's empty mark")
        finally:
            controller.stop()


def test_a_cluster_on_ipv6_loopback_serves_both_sdk_modes(tmp_path: Path) -> None:
    """Every process listens on [::1]: brokers register "::1" as their host. Whoever
    dials a broker must put it in brackets: the controller (and direct-mode clients)
    dialled "::1:PORT", which gRPC's resolver took for a name, so no topic was ever
    created (found by an audit)."""
    with TestCluster(tmp_path, storage_args=["--listen", "[::1]:0"]) as cluster:
        cluster.start_broker(0)
        cluster.start_controller(1, extra_args=["--listen", "[::1]:0"])
        cluster.wait_brokers([0])
        gateway = cluster.start_gateway(extra_args=["--listen", "[::1]:0"])
        assert gateway.address.startswith("[::1]:")
        cluster.create_topic("v6", 1, 1)
        for direct in (False, True):
            with tidelog.Producer(gateway.address, direct=direct) as producer:
                producer.send("v6", b"direct" if direct else b"gateway").result(30)
        with tidelog.Consumer(gateway.address, direct=True) as consumer:
            consumer.assign([("v6", 0)])
            consumer.seek(("v6", 0), 0)
            assert [v for _, v in poll_records(consumer, 2)] == [b"gateway", b"direct"]


def test_create_describe_delete_topic(cluster: TestCluster) -> None:
    result = cluster.create_topic("orders", 6, 3, {"retention.ms": "3600000"})
    assert result.num_partitions == 6 and result.replication_factor == 3
    assert len(result.topic_id) == 32
    effective = {c.name: c.value for c in result.configs}
    assert effective["retention.ms"] == "3600000"
    assert effective["min.insync.replicas"] == "1"  # a default, reported as effective

    topic = cluster.topic("orders")
    assert topic.topic_id == result.topic_id
    assert {c.name: c.value for c in topic.configs} == {"retention.ms": "3600000"}
    assert [p.partition for p in topic.partitions] == list(range(6))
    for p in topic.partitions:
        assert sorted(p.replicas) == [1, 2, 3]
        assert p.leader == p.replicas[0]  # the preferred replica leads a new partition
        assert list(p.isr) == list(p.replicas)
        assert p.leader_epoch == 0 and p.partition_epoch == 0
    # Every broker got its LeaderAndIsr: the logs exist, with the roles decided.
    for broker_id in (1, 2, 3):
        roles = wait_for(
            lambda b=broker_id: (r := hosted_roles(cluster, b, "orders")) and len(r) == 6 and r,
            10,
            f"broker {broker_id} to host orders",
        )
        assert {p for p, leads in roles.items() if leads} == {
            p.partition for p in topic.partitions if p.leader == broker_id
        }
    assert cluster.store.get(topic_key("orders")) is not None

    response = cluster.api.DeleteTopics(
        controller_pb2.DeleteTopicsRequest(names=["orders"], timeout_ms=10_000),
        timeout=RPC_TIMEOUT_S + 10,
    )
    assert [error_code(t.error) for t in response.topics] == [ErrorCode.NONE]
    for broker_id in (1, 2, 3):
        wait_for(
            lambda b=broker_id: (
                not any(d.name.startswith("orders-") for d in cluster.data_dir(b).iterdir())
            ),
            10,
            f"broker {broker_id} to delete the partition directories",
        )
    wait_for(
        lambda: cluster.store.get(deletion_key("orders")) is None,
        10,
        "the deletion record to be cleared",
    )
    assert cluster.store.get_prefix("partitions/orders/") == []
    metadata = cluster.api.Metadata(
        controller_pb2.MetadataRequest(topics=["orders"]), timeout=RPC_TIMEOUT_S
    )
    assert error_code(metadata.topics[0].error) == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
    # The name is free again, for a new incarnation.
    again = cluster.create_topic("orders", 1, 1)
    assert again.topic_id != result.topic_id
    cluster.api.DeleteTopics(
        controller_pb2.DeleteTopicsRequest(names=["orders"]), timeout=RPC_TIMEOUT_S
    )


def test_assignment_is_even_across_live_brokers(cluster: TestCluster) -> None:
    cluster.create_topic("even", 9, 2)
    partitions = cluster.partitions("even")
    leader_counts = {b: sum(p.leader == b for p in partitions) for b in (1, 2, 3)}
    replica_counts = {b: sum(b in p.replicas for p in partitions) for b in (1, 2, 3)}
    assert leader_counts == {1: 3, 2: 3, 3: 3}
    assert replica_counts == {1: 6, 2: 6, 3: 6}
    for p in partitions:
        assert len(set(p.replicas)) == 2

    # CreatePartitions continues the pattern: 12 partitions, 4 leaders each.
    response = cluster.api.CreatePartitions(
        controller_pb2.CreatePartitionsRequest(
            topics=[controller_pb2.PartitionIncrease(name="even", count=12)], timeout_ms=10_000
        ),
        timeout=RPC_TIMEOUT_S + 10,
    )
    assert [error_code(t.error) for t in response.topics] == [ErrorCode.NONE]
    partitions = cluster.partitions("even")
    assert len(partitions) == 12
    assert {b: sum(p.leader == b for p in partitions) for b in (1, 2, 3)} == {1: 4, 2: 4, 3: 4}
    wait_for(
        (cluster.data_dir(partitions[11].replicas[0]) / "even-11").is_dir,
        10,
        "the new partition's log to be created",
    )


# --- bad input -------------------------------------------------------------------------------


def _create(
    cluster: TestCluster,
    name: str,
    *,
    partitions: int = 1,
    rf: int = 1,
    configs: dict[str, str] | None = None,
    assignments: list[list[int]] | None = None,
    validate_only: bool = False,
) -> ErrorCode:
    response = cluster.api.CreateTopics(
        controller_pb2.CreateTopicsRequest(
            topics=[
                controller_pb2.CreatableTopic(
                    name=name,
                    num_partitions=partitions,
                    replication_factor=rf,
                    configs=[
                        common_pb2.ConfigEntry(name=k, value=v) for k, v in (configs or {}).items()
                    ],
                    assignments=[
                        controller_pb2.ReplicaAssignment(partition=i, broker_ids=replicas)
                        for i, replicas in enumerate(assignments or [])
                    ],
                )
            ],
            validate_only=validate_only,
        ),
        timeout=RPC_TIMEOUT_S,
    )
    (result,) = response.topics
    code = error_code(result.error)
    if code != ErrorCode.NONE:
        assert result.error.message  # every refusal says why
    return code


def _status(call: object) -> tuple[grpc.StatusCode, ErrorCode | None, str]:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code(), rpc_error_code(exc), exc.details() or ""  # type: ignore[attr-defined]
    raise AssertionError("the call succeeded")


def test_bad_input_gets_the_right_error_and_changes_nothing(cluster: TestCluster) -> None:
    cluster.create_topic("existing", 3, 3)
    api = cluster.api
    before = controller_keys(cluster)

    # CreateTopics, per topic.
    for bad_name in ("", "a/b", "..", "x" * 250, "spaces are bad"):
        assert _create(cluster, bad_name) == ErrorCode.INVALID_TOPIC, bad_name
    assert _create(cluster, "p0", partitions=0) == ErrorCode.INVALID_PARTITIONS
    assert _create(cluster, "pbig", partitions=100_000) == ErrorCode.INVALID_PARTITIONS
    assert _create(cluster, "rf0", rf=0) == ErrorCode.INVALID_REPLICATION_FACTOR
    assert _create(cluster, "rf4", rf=4) == ErrorCode.INVALID_REPLICATION_FACTOR
    assert _create(cluster, "cfg", configs={"retention.msec": "1"}) == ErrorCode.INVALID_CONFIG
    assert _create(cluster, "cfg", configs={"retention.ms": "soon"}) == ErrorCode.INVALID_CONFIG
    assert (
        _create(cluster, "cfg", rf=3, configs={"min.insync.replicas": "4"})
        == ErrorCode.INVALID_CONFIG
    )
    assert (
        _create(cluster, "cfg", configs={"cleanup.policy": "compact"}) == ErrorCode.INVALID_CONFIG
    )
    assert _create(cluster, "existing", partitions=3, rf=3) == ErrorCode.TOPIC_ALREADY_EXISTS
    assert (
        _create(cluster, "asg", partitions=0, rf=0, assignments=[[1, 1]])
        == ErrorCode.INVALID_REPLICA_ASSIGNMENT
    )
    assert (
        _create(cluster, "asg", partitions=0, rf=0, assignments=[[1, 9]])
        == ErrorCode.INVALID_REPLICA_ASSIGNMENT
    )
    assert (
        _create(cluster, "asg", partitions=0, rf=0, assignments=[[1, 2], [3]])
        == ErrorCode.INVALID_REPLICA_ASSIGNMENT
    )
    assert _create(cluster, "dry", partitions=3, rf=3, validate_only=True) == ErrorCode.NONE
    # Duplicates within one request: every entry refused (Kafka's rule), not the first
    # judged (and, without validate_only, applied) and only the repeat refused.
    response = api.CreateTopics(
        controller_pb2.CreateTopicsRequest(
            topics=[
                controller_pb2.CreatableTopic(
                    name="existing", num_partitions=1, replication_factor=1
                )
            ]
            * 2,
            validate_only=True,
        ),
        timeout=RPC_TIMEOUT_S,
    )
    assert [error_code(t.error) for t in response.topics] == [ErrorCode.INVALID_REQUEST] * 2
    # Wrong as a whole: too many topics, a negative timeout.
    status, code, _ = _status(
        lambda: api.CreateTopics(
            controller_pb2.CreateTopicsRequest(
                topics=[controller_pb2.CreatableTopic(name=f"t{i}") for i in range(1001)]
            ),
            timeout=RPC_TIMEOUT_S,
        )
    )
    assert (status, code) == (grpc.StatusCode.INVALID_ARGUMENT, ErrorCode.INVALID_REQUEST)
    # More new partitions than one request may place, in topics each within its own limit
    # (placing 1,000 x 4,000 partitions held the controller's lock for 40 s; audit).
    status, code, message = _status(
        lambda: api.CreateTopics(
            controller_pb2.CreateTopicsRequest(
                topics=[
                    controller_pb2.CreatableTopic(
                        name=f"wide{i}", num_partitions=4_000, replication_factor=1
                    )
                    for i in range(3)
                ],
                validate_only=True,
            ),
            timeout=RPC_TIMEOUT_S,
        )
    )
    assert (status, code) == (grpc.StatusCode.INVALID_ARGUMENT, ErrorCode.INVALID_REQUEST)
    assert "12000 new partitions in one request; the limit is 10000" in message
    status, code, message = _status(
        lambda: api.CreatePartitions(
            controller_pb2.CreatePartitionsRequest(
                topics=[
                    controller_pb2.PartitionIncrease(name=name, count=4_000)
                    for name in ("existing", "nope1", "nope2")
                ],
                validate_only=True,
            ),
            timeout=RPC_TIMEOUT_S,
        )
    )
    assert (status, code) == (grpc.StatusCode.INVALID_ARGUMENT, ErrorCode.INVALID_REQUEST)
    assert "11997 new partitions in one request" in message  # "existing" has 3
    status, code, _ = _status(
        lambda: api.DeleteTopics(
            controller_pb2.DeleteTopicsRequest(names=["existing"], timeout_ms=-1),
            timeout=RPC_TIMEOUT_S,
        )
    )
    assert (status, code) == (grpc.StatusCode.INVALID_ARGUMENT, ErrorCode.INVALID_REQUEST)

    # DeleteTopics.
    response_d = api.DeleteTopics(
        controller_pb2.DeleteTopicsRequest(names=["nope", "a/b"]), timeout=RPC_TIMEOUT_S
    )
    assert [error_code(t.error) for t in response_d.topics] == [
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
        ErrorCode.INVALID_TOPIC,
    ]

    # CreatePartitions: shrinking, the same count, an unknown topic; a dry run.
    response_p = api.CreatePartitions(
        controller_pb2.CreatePartitionsRequest(
            topics=[
                controller_pb2.PartitionIncrease(name="existing", count=2),
                controller_pb2.PartitionIncrease(name="nope", count=5),
            ]
        ),
        timeout=RPC_TIMEOUT_S,
    )
    assert [error_code(t.error) for t in response_p.topics] == [
        ErrorCode.INVALID_PARTITIONS,
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
    ]
    response_p = api.CreatePartitions(
        controller_pb2.CreatePartitionsRequest(
            topics=[controller_pb2.PartitionIncrease(name="existing", count=3)]
        ),
        timeout=RPC_TIMEOUT_S,
    )
    assert error_code(response_p.topics[0].error) == ErrorCode.INVALID_PARTITIONS
    response_p = api.CreatePartitions(
        controller_pb2.CreatePartitionsRequest(
            topics=[controller_pb2.PartitionIncrease(name="existing", count=5)],
            validate_only=True,
        ),
        timeout=RPC_TIMEOUT_S,
    )
    assert error_code(response_p.topics[0].error) == ErrorCode.NONE

    # AlterPartition: every fencing rule, per partition.
    p0 = cluster.partitions("existing")[0]
    leader_epoch_of = cluster.broker_epoch(p0.leader)
    follower = next(b for b in p0.replicas if b != p0.leader)

    def alter(
        *,
        broker_id: int = p0.leader,
        broker_epoch: int = leader_epoch_of,
        topic: str = "existing",
        leader_epoch: int = p0.leader_epoch,
        partition_epoch: int = p0.partition_epoch,
        new_isr: tuple[int, ...] = (p0.leader,),
    ) -> ErrorCode:
        response = api.AlterPartition(
            controller_pb2.AlterPartitionRequest(
                broker_id=broker_id,
                broker_epoch=broker_epoch,
                partitions=[
                    controller_pb2.AlterPartitionItem(
                        topic=topic,
                        partition=0,
                        leader_epoch=leader_epoch,
                        new_isr=list(new_isr),
                        partition_epoch=partition_epoch,
                    )
                ],
            ),
            timeout=RPC_TIMEOUT_S,
        )
        (result,) = response.partitions
        if topic == "existing":  # the state in force comes back with every answer
            assert result.state.partition_epoch == p0.partition_epoch
        return error_code(result.error)

    assert alter(leader_epoch=p0.leader_epoch - 1) == ErrorCode.FENCED_LEADER_EPOCH
    # Newer than the controller's: only a stale controller sees that (KRaft's answer).
    assert alter(leader_epoch=p0.leader_epoch + 1) == ErrorCode.NOT_CONTROLLER
    assert alter(partition_epoch=p0.partition_epoch - 1) == ErrorCode.INVALID_UPDATE_VERSION
    assert alter(broker_epoch=leader_epoch_of - 1) == ErrorCode.STALE_BROKER_EPOCH
    assert (
        alter(broker_id=follower, broker_epoch=cluster.broker_epoch(follower))
        == ErrorCode.NOT_LEADER_OR_FOLLOWER
    )
    assert alter(topic="nope") == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
    assert alter(new_isr=(p0.leader, 99)) == ErrorCode.INVALID_REQUEST
    # A partition named twice: every entry refused, the valid shrink in it not applied.
    shrink = controller_pb2.AlterPartitionItem(
        topic="existing",
        partition=0,
        leader_epoch=p0.leader_epoch,
        new_isr=[p0.leader],
        partition_epoch=p0.partition_epoch,
    )
    response_a = api.AlterPartition(
        controller_pb2.AlterPartitionRequest(
            broker_id=p0.leader, broker_epoch=leader_epoch_of, partitions=[shrink, shrink]
        ),
        timeout=RPC_TIMEOUT_S,
    )
    assert [error_code(r.error) for r in response_a.partitions] == [ErrorCode.INVALID_REQUEST] * 2

    # ElectLeaders.
    response_e = api.ElectLeaders(
        controller_pb2.ElectLeadersRequest(
            election_type=controller_pb2.PREFERRED,
            partitions=[
                common_pb2.TopicPartition(topic="existing", partition=0),
                common_pb2.TopicPartition(topic="nope", partition=0),
            ],
        ),
        timeout=RPC_TIMEOUT_S,
    )
    assert [error_code(p.error) for p in response_e.partitions] == [
        ErrorCode.ELECTION_NOT_NEEDED,
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
    ]
    response_e = api.ElectLeaders(
        controller_pb2.ElectLeadersRequest(
            election_type=controller_pb2.UNCLEAN,
            partitions=[common_pb2.TopicPartition(topic="existing", partition=0)],
        ),
        timeout=RPC_TIMEOUT_S,
    )
    assert [error_code(p.error) for p in response_e.partitions] == [ErrorCode.ELECTION_NOT_NEEDED]
    status, code, _ = _status(
        lambda: api.ElectLeaders(
            controller_pb2.ElectLeadersRequest(election_type=7), timeout=RPC_TIMEOUT_S
        )
    )
    assert code == ErrorCode.INVALID_REQUEST
    # An unclean election of "every partition" is refused: it must name them.
    status, code, _ = _status(
        lambda: api.ElectLeaders(
            controller_pb2.ElectLeadersRequest(election_type=controller_pb2.UNCLEAN),
            timeout=RPC_TIMEOUT_S,
        )
    )
    assert (status, code) == (grpc.StatusCode.INVALID_ARGUMENT, ErrorCode.INVALID_REQUEST)

    # ControlledShutdown: an unknown broker, a stale incarnation.
    status, code, _ = _status(
        lambda: api.ControlledShutdown(
            controller_pb2.ControlledShutdownRequest(broker_id=42, broker_epoch=1),
            timeout=RPC_TIMEOUT_S,
        )
    )
    assert code == ErrorCode.BROKER_NOT_AVAILABLE
    status, code, _ = _status(
        lambda: api.ControlledShutdown(
            controller_pb2.ControlledShutdownRequest(broker_id=1, broker_epoch=1),
            timeout=RPC_TIMEOUT_S,
        )
    )
    assert (status, code) == (grpc.StatusCode.FAILED_PRECONDITION, ErrorCode.STALE_BROKER_EPOCH)

    # Metadata of an unknown topic.
    metadata = api.Metadata(controller_pb2.MetadataRequest(topics=["nope"]), timeout=RPC_TIMEOUT_S)
    assert error_code(metadata.topics[0].error) == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION

    assert controller_keys(cluster) == before, "a refused request changed etcd"
    assert len(cluster.partitions("existing")) == 3


def test_standby_answers_not_controller_with_the_active_address(cluster: TestCluster) -> None:
    active = cluster.active_controller()
    standby = next(c for c in cluster.controllers.values() if c is not active)
    calls = [
        lambda: standby.stub.DescribeCluster(
            controller_pb2.DescribeClusterRequest(), timeout=RPC_TIMEOUT_S
        ),
        lambda: standby.stub.CreateTopics(
            controller_pb2.CreateTopicsRequest(
                topics=[
                    controller_pb2.CreatableTopic(
                        name="via-standby", num_partitions=1, replication_factor=1
                    )
                ]
            ),
            timeout=RPC_TIMEOUT_S,
        ),
        lambda: standby.stub.Metadata(controller_pb2.MetadataRequest(), timeout=RPC_TIMEOUT_S),
    ]
    for call in calls:
        try:
            call()
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
            assert rpc_error_code(exc) == ErrorCode.NOT_CONTROLLER
            assert trailer(exc, "tidelog-controller") == active.address
            assert active.address in (exc.details() or "")  # type: ignore[attr-defined]
        else:
            raise AssertionError("a standby answered")
    assert cluster.store.get(topic_key("via-standby")) is None


# --- producer ids (AllocateProducerIds, KIP-730) ----------------------------------------------


def allocate(cluster: TestCluster, broker_id: int = -1, broker_epoch: int = -1) -> range:
    """One block from the active controller, as the range of ids it covers."""
    response = cluster.allocate_producer_ids(broker_id, broker_epoch)
    assert error_code(response.error) == ErrorCode.NONE, response
    assert response.producer_id_start >= 0 and response.producer_id_len > 0, response
    return range(response.producer_id_start, response.producer_id_start + response.producer_id_len)


def stored_next_block_start(cluster: TestCluster) -> int:
    kv = cluster.store.get(PRODUCER_IDS_KEY)
    return decode_producer_ids(kv) if kv is not None else 0


def assert_disjoint_and_increasing(blocks: list[range]) -> None:
    for earlier, later in itertools.pairwise(blocks):
        assert earlier.stop <= later.start, (earlier, later)


def test_producer_id_blocks_are_disjoint_and_increasing(cluster: TestCluster) -> None:
    first = stored_next_block_start(cluster)
    blocks = [allocate(cluster) for _ in range(5)]
    # A registered broker asks with its own epoch.
    blocks.append(allocate(cluster, 1, cluster.broker_epoch(1)))
    assert blocks[0].start == first
    assert_disjoint_and_increasing(blocks)
    assert all(len(b) == len(blocks[0]) for b in blocks)
    assert stored_next_block_start(cluster) == blocks[-1].stop  # the etcd key moved with them

    # Concurrent requests: every block distinct, no id handed out twice.
    found: list[range] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(4):
                found.append(allocate(cluster))
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert len(found) == 32
    ordered = sorted(found, key=lambda r: r.start)
    assert ordered[0].start >= blocks[-1].stop
    assert_disjoint_and_increasing(ordered)
    assert stored_next_block_start(cluster) == ordered[-1].stop

    # A broker that is not the registered incarnation gets STALE_BROKER_EPOCH, no block.
    before = stored_next_block_start(cluster)
    for broker_id, epoch in ((1, cluster.broker_epoch(1) + 1000), (99, 1)):
        response = cluster.allocate_producer_ids(broker_id, epoch)
        assert error_code(response.error) == ErrorCode.STALE_BROKER_EPOCH, response
        assert (response.producer_id_start, response.producer_id_len) == (-1, 0)
    status, code, _ = _status(
        lambda: cluster.api.AllocateProducerIds(
            controller_pb2.AllocateProducerIdsRequest(broker_id=-2), timeout=RPC_TIMEOUT_S
        )
    )
    assert (status, code) == (grpc.StatusCode.INVALID_ARGUMENT, ErrorCode.INVALID_REQUEST)
    # A standby hands out nothing: NOT_CONTROLLER with the active controller's address.
    active = cluster.active_controller()
    standby = next(c for c in cluster.controllers.values() if c is not active)
    try:
        standby.stub.AllocateProducerIds(
            controller_pb2.AllocateProducerIdsRequest(broker_id=-1), timeout=RPC_TIMEOUT_S
        )
    except grpc.RpcError as exc:
        assert rpc_error_code(exc) == ErrorCode.NOT_CONTROLLER
        assert trailer(exc, "tidelog-controller") == active.address
    else:
        raise AssertionError("a standby allocated producer ids")
    assert stored_next_block_start(cluster) == before


# --- broker failure, return, preferred election ------------------------------------------------


def test_broker_failure_moves_leaders_and_return_waits_for_preferred_election(
    cluster: TestCluster,
) -> None:
    cluster.create_topic("failover", 6, 3)
    victim = 2
    kill_broker_and_check_failover(cluster, "failover", victim)
    cluster.wait_brokers([1, 3])

    # The broker returns: it leads nothing, and is not in any ISR (it has to catch up).
    cluster.start_broker(victim)
    cluster.wait_brokers([1, 2, 3])
    assert victim not in leaders(cluster, "failover").values()
    roles = wait_for(
        lambda: (r := hosted_roles(cluster, victim, "failover")) and len(r) == 6 and r,
        10,
        "the returning broker to get its partitions back (as follower)",
    )
    assert not any(roles.values())

    # Its leaders re-admit it to the ISR (AlterPartition), which still moves no leader.
    expand_isr(cluster, "failover", victim)
    assert victim not in leaders(cluster, "failover").values()

    # A preferred election on demand gives it back what it is preferred for.
    before = {p.partition: p for p in cluster.partitions("failover")}
    elected: set[int] = set()
    deadline = time.monotonic() + 30
    while True:
        response = cluster.api.ElectLeaders(
            controller_pb2.ElectLeadersRequest(
                election_type=controller_pb2.PREFERRED, timeout_ms=10_000
            ),
            timeout=RPC_TIMEOUT_S + 10,
        )
        # "Every partition": results for those elected, and for those that could not be
        # (the other topics' partitions it is preferred for, unless its own replica
        # fetchers caught it up and their leaders re-admitted it to those ISRs meanwhile).
        mine = {
            p.partition: error_code(p.error) for p in response.partitions if p.topic == "failover"
        }
        elected |= {p for p, code in mine.items() if code == ErrorCode.NONE}
        others = {error_code(p.error) for p in response.partitions if p.topic != "failover"}
        assert others <= {ErrorCode.PREFERRED_LEADER_NOT_AVAILABLE, ErrorCode.NONE}
        refused = {p: c for p, c in mine.items() if p not in elected}
        if not refused:
            break
        # On a loaded machine (make test runs two workers) the returning broker can fall
        # out of an ISR again before the election: re-admit it and ask again.
        assert set(refused.values()) == {ErrorCode.PREFERRED_LEADER_NOT_AVAILABLE}, refused
        assert time.monotonic() < deadline, f"never eligible: {refused}"
        expand_isr(cluster, "failover", victim)
    preferred_by_victim = {p for p, state in before.items() if state.replicas[0] == victim}
    assert elected == preferred_by_victim
    after = {p.partition: p for p in cluster.partitions("failover")}
    for p, state in after.items():
        assert state.leader == state.replicas[0]
        if p in preferred_by_victim:
            assert state.leader_epoch == before[p].leader_epoch + 1
    wait_for(
        lambda: (
            {p for p, leads in hosted_roles(cluster, victim, "failover").items() if leads}
            == preferred_by_victim
        ),
        10,
        "the storage node to take the leaderships",
    )


def test_controlled_shutdown_moves_leaders_before_the_broker_stops(cluster: TestCluster) -> None:
    cluster.create_topic("graceful", 3, 3)
    # Earlier failures left partitions whose only in-sync replica is broker 3; those could
    # not move (ControlledShutdown would report them remaining). Heal them first.
    heal_isrs(cluster)
    stopping = 3
    led = [p for p in cluster.partitions("graceful") if p.leader == stopping]
    assert led
    node = cluster.brokers[stopping]
    assert node.terminate() == 0
    assert "controlled_shutdown_done" in node.log_path.read_text()
    after = {p.partition: p for p in cluster.partitions("graceful")}
    for old in led:
        assert after[old.partition].leader not in (stopping, -1)
        assert after[old.partition].leader_epoch == old.leader_epoch + 1
    cluster.start_broker(stopping)
    cluster.wait_brokers([1, 2, 3])


def test_turning_unclean_election_on_elects_a_leader_for_an_offline_partition(
    cluster: TestCluster,
) -> None:
    """A partition whose last ISR member died while its other replica was out of the ISR
    stays offline, until unclean.leader.election.enable is turned on for its topic: then
    the live out-of-sync replica is elected at once, as Kafka does on that config change.
    Before, nothing ran an election until a broker registered or a controller took
    office (found by an audit)."""
    cluster.create_topic("unclean-later", 1, 2)
    (p0,) = cluster.partitions("unclean-later")
    first, second = p0.leader, next(b for b in p0.replicas if b != p0.leader)
    cluster.kill(cluster.brokers[second])
    wait_for(
        lambda: cluster.partitions("unclean-later")[0].isr == [first],
        15,
        "the dead follower out of the ISR",
    )
    cluster.kill(cluster.brokers[first])
    wait_for(
        lambda: cluster.partitions("unclean-later")[0].leader == -1, 15, "the partition offline"
    )
    cluster.start_broker(second)
    cluster.wait_brokers([b for b in (1, 2, 3) if b != first])
    offline = cluster.partitions("unclean-later")[0]
    assert (offline.leader, list(offline.isr)) == (-1, [first])  # registering changes nothing

    response = cluster.api.IncrementalAlterConfigs(
        controller_pb2.IncrementalAlterConfigsRequest(
            topics=[
                controller_pb2.AlterableTopicConfig(
                    name="unclean-later",
                    set=[
                        common_pb2.ConfigEntry(name="unclean.leader.election.enable", value="true")
                    ],
                )
            ],
            timeout_ms=10_000,
        ),
        timeout=RPC_TIMEOUT_S + 10,
    )
    assert error_code(response.topics[0].error) == ErrorCode.NONE
    elected = cluster.partitions("unclean-later")[0]
    assert (elected.leader, list(elected.isr)) == (second, [second])
    assert elected.leader_epoch == offline.leader_epoch + 1

    cluster.start_broker(first)
    cluster.wait_brokers([1, 2, 3])
    heal_isrs(cluster)


def test_deleting_a_topic_while_a_replica_is_down_finishes_without_it(
    cluster: TestCluster,
) -> None:
    """The deletion completes once the live replicas are deleted (Kafka's KRaft mode),
    not when the dead broker returns: it used to keep ``deletions/<t>`` and refuse the
    name (TOPIC_ALREADY_EXISTS) for as long as the broker stayed away, for ever if it
    never came back. The returning broker deletes its logs as strays."""
    cluster.create_topic("doomed", 3, 3)
    heal_isrs(cluster)  # so that broker 1 can stop at once (nothing left only to it)
    away = 1
    assert cluster.brokers[away].terminate() == 0
    cluster.wait_brokers([2, 3])
    response = cluster.api.DeleteTopics(
        controller_pb2.DeleteTopicsRequest(names=["doomed"], timeout_ms=10_000),
        timeout=RPC_TIMEOUT_S + 10,
    )
    assert [error_code(t.error) for t in response.topics] == [ErrorCode.NONE]
    wait_for(
        lambda: cluster.store.get(deletion_key("doomed")) is None,
        10,
        "the deletion to complete without broker 1",
    )
    for broker_id in (2, 3):
        assert not list(cluster.data_dir(broker_id).glob("doomed-*"))
    assert list(cluster.data_dir(away).glob("doomed-*"))  # it was away
    cluster.start_broker(away)
    wait_for(
        lambda: not list(cluster.data_dir(away).glob("doomed-*")),
        10,
        "the returning broker to delete its stray replicas",
    )
    assert _create(cluster, "doomed", partitions=1, rf=1) == ErrorCode.NONE
    cluster.wait_brokers([1, 2, 3])


def test_a_deletion_completes_without_a_dead_broker_whose_strays_go_when_it_returns(
    tmp_path: Path,
) -> None:
    """A replica's broker killed for good (kill -9, not back for the deletion): the
    deletion completes without it, the name is created again at once with fresh, empty
    partitions, and when the broker returns on its old data directory it deletes its logs
    of the old incarnations - one re-created under the same name (another topic id, found
    by the UpdateMetadata view) and one never re-created - and never serves them."""
    cluster = TestCluster(tmp_path, session_ttl_s=TTL_S)
    try:
        for broker_id in (1, 2, 3):
            cluster.start_broker(broker_id)
        cluster.start_controller(1)
        cluster.wait_brokers([1, 2, 3])
        gateway = cluster.start_gateway()
        old_id = cluster.create_topic("reborn", 2, 3).topic_id
        cluster.create_topic("gone", 1, 3)
        with tidelog.Producer(gateway.address, acks="all") as producer:
            for topic, partitions in (("reborn", 2), ("gone", 1)):
                for p in range(partitions):
                    producer.send_batch(topic, [b"old-%d" % i for i in range(20)], partition=p)
            producer.flush()
        dead = 1
        strays = {"reborn-0", "reborn-1", "gone-0"}
        assert strays <= {d.name for d in cluster.data_dir(dead).iterdir()}
        cluster.kill(cluster.brokers[dead])
        cluster.wait_brokers([2, 3])
        response = cluster.api.DeleteTopics(
            controller_pb2.DeleteTopicsRequest(names=["reborn", "gone"], timeout_ms=10_000),
            timeout=RPC_TIMEOUT_S + 10,
        )
        assert [error_code(t.error) for t in response.topics] == [ErrorCode.NONE] * 2
        for name in ("reborn", "gone"):
            wait_for(
                lambda n=name: cluster.store.get(deletion_key(n)) is None,
                10,
                f"the deletion of {name} to complete without broker {dead}",
            )
        assert (cluster.data_dir(dead) / "reborn-0" / "partition.metadata").read_text() == (
            f"version: 0\ntopic_id: {old_id}\n"
        )
        metadata = cluster.api.Metadata(controller_pb2.MetadataRequest(), timeout=RPC_TIMEOUT_S)
        assert {t.name for t in metadata.topics} == set()
        new_id = cluster.create_topic("reborn", 2, 2).topic_id
        assert new_id != old_id
        assert [
            p.high_watermark
            for p in tidelog.Admin(gateway.address).describe_topic("reborn").partitions
        ] == [0, 0]
        with tidelog.Producer(gateway.address, acks="all") as producer:
            for p in range(2):
                producer.send_batch("reborn", [b"new-%d" % i for i in range(5)], partition=p)
            producer.flush()
        # Still away: its logs of the old incarnations are all there.
        assert strays <= {d.name for d in cluster.data_dir(dead).iterdir()}
        cluster.start_broker(dead)
        cluster.wait_brokers([1, 2, 3])
        wait_for(
            lambda: (
                not any(
                    d.name in strays or d.name.endswith("-delete")
                    for d in cluster.data_dir(dead).iterdir()
                )
            ),
            15,
            "the returning broker to delete its stray logs",
        )
        assert "stray_log_deleted" in cluster.brokers[dead].log_path.read_text()
        # The new incarnation reads back exactly what was written to it.
        with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
            consumer.assign([("reborn", p) for p in range(2)])
            records: list = []
            deadline = time.monotonic() + 30
            while len(records) < 10 and time.monotonic() < deadline:
                records.extend(consumer.poll(timeout_ms=500))
            records.extend(consumer.poll(timeout_ms=500))
        assert sorted((r.partition, r.value) for r in records) == sorted(
            (p, b"new-%d" % i) for p in range(2) for i in range(5)
        )
        assert _create(cluster, "gone", partitions=1, rf=3) == ErrorCode.NONE
        assert not list(cluster.data_dir(dead).glob("*-delete"))
    finally:
        cluster.close()


# --- automatic rebalance, controller failover, fencing ------------------------------------------


def test_automatic_preferred_election_after_broker_returns(failover_cluster: TestCluster) -> None:
    cluster = failover_cluster
    cluster.create_topic("auto", 3, 3)
    victim = next(p.leader for p in cluster.partitions("auto"))
    kill_broker_and_check_failover(cluster, "auto", victim)
    cluster.start_broker(victim)
    cluster.wait_brokers([1, 2, 3])
    # Out of the ISR it is not eligible; its replica fetchers catch it up and its leaders
    # add it back to the ISR (expand_isr does it for any they have not yet), and only then
    # may it lead again.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        for p in cluster.partitions("auto"):
            assert p.leader != victim or victim in p.isr
        time.sleep(0.1)
    expand_isr(cluster, "auto", victim)
    # In sync again: the next check (every 1 s) restores the preferred leader (one of
    # three partitions misplaced is above Kafka's 10% threshold).
    wait_for(
        lambda: all(p.leader == p.replicas[0] for p in cluster.partitions("auto")),
        5,
        "the automatic preferred election",
    )


def test_standby_takes_over_and_handles_the_next_failure(failover_cluster: TestCluster) -> None:
    cluster = failover_cluster
    cluster.create_topic("takeover", 6, 3)
    old_active = cluster.active_controller()
    old_epoch = cluster.controller_epoch()
    killed_at = time.monotonic()
    cluster.kill(old_active)
    new_active = wait_for(
        lambda: (c := cluster.active_controller()) is not old_active and c,
        FAILOVER_BUDGET_S + 5,
        "the standby to take over",
    )
    assert time.monotonic() - killed_at <= FAILOVER_BUDGET_S
    view = cluster.describe_cluster()
    assert view.controller_id == new_active.controller_id
    assert view.controller_epoch > old_epoch
    assert view.controller_epoch == cluster.controller_epoch()
    assert sorted(b.broker_id for b in view.brokers) == [1, 2, 3]
    # The new controller handles the next broker failure.
    victim = next(p.leader for p in cluster.partitions("takeover"))
    kill_broker_and_check_failover(cluster, "takeover", victim)
    cluster.start_broker(victim)
    cluster.wait_brokers([1, 2, 3])
    # A fresh standby for the next test.
    cluster.start_controller(103)


def test_deposed_controller_cannot_write_and_brokers_reject_its_epoch(
    failover_cluster: TestCluster,
) -> None:
    cluster = failover_cluster
    cluster.create_topic("fenced", 3, 3)
    deposed = cluster.active_controller()
    old_epoch = cluster.controller_epoch()
    lease_id = cluster.store.get(CONTROLLER_KEY).lease_id  # type: ignore[union-attr]
    # Freeze it, then take its lease away: it cannot notice, as a GC pause would not.
    deposed.proc.send_signal(signal.SIGSTOP)
    try:
        cluster.store.revoke_lease_id(lease_id)
        successor: ControllerProcess = wait_for(
            lambda: (c := cluster.active_controller()) is not deposed and c,
            FAILOVER_BUDGET_S + 5,
            "a standby to take over",
        )
        assert cluster.controller_epoch() > old_epoch
        # The successor has pushed its epoch to every broker.
        wait_for(
            lambda: all(
                _leader_and_isr_status(cluster, b, old_epoch) == ErrorCode.STALE_CONTROLLER_EPOCH
                for b in (1, 2, 3)
            ),
            10,
            "brokers to reject the old controller epoch",
        )
        # Earlier tests' partitions may still be regaining replicas: a legitimate write by
        # the successor after the snapshot would look like one by the deposed controller.
        wait_for(lambda: isrs_settled(cluster), 30, "every live replica back in its ISR")
        before = controller_keys(cluster)
    finally:
        deposed.proc.send_signal(signal.SIGCONT)
    # Woken up, it still believes it may be active; whatever it tries is fenced.
    try:
        deposed.stub.CreateTopics(
            controller_pb2.CreateTopicsRequest(
                topics=[
                    controller_pb2.CreatableTopic(
                        name="from-deposed", num_partitions=1, replication_factor=1
                    )
                ]
            ),
            timeout=RPC_TIMEOUT_S,
        )
    except grpc.RpcError as exc:
        assert rpc_error_code(exc) == ErrorCode.NOT_CONTROLLER
        assert trailer(exc, "tidelog-controller") == successor.address
    else:
        raise AssertionError("the deposed controller accepted a write")
    wait_for(
        lambda: (
            _status(
                lambda: deposed.stub.DescribeCluster(
                    controller_pb2.DescribeClusterRequest(), timeout=RPC_TIMEOUT_S
                )
            )[1]
            == ErrorCode.NOT_CONTROLLER
        ),
        10,
        "the deposed controller to step down",
    )
    assert cluster.store.get(topic_key("from-deposed")) is None
    assert controller_keys(cluster) == before
    # The guard itself: any transaction carrying the old epoch fails and changes nothing.
    kv = cluster.store.get(partition_key("fenced", 0))
    assert kv is not None
    assert not cluster.store.compare_and_swap(
        kv.key,
        kv.mod_revision,
        encode_partition(PartitionRecord(leader=-1, leader_epoch=99, isr=(1,), partition_epoch=99)),
        guards=[Guard(CONTROLLER_KEY, create_revision=old_epoch)],
    )
    assert cluster.store.get(kv.key) == kv


def _leader_and_isr_status(cluster: TestCluster, broker_id: int, epoch: int) -> ErrorCode:
    """What a broker answers to an (empty) LeaderAndIsr stamped with controller ``epoch``."""
    try:
        response = cluster.brokers[broker_id].stub.LeaderAndIsr(
            storage_pb2.LeaderAndIsrRequest(controller_id=1, controller_epoch=epoch),
            timeout=RPC_TIMEOUT_S,
        )
    except grpc.RpcError as exc:
        return rpc_error_code(exc) or ErrorCode.UNKNOWN_SERVER_ERROR
    return error_code(response.error)


def test_sigterm_resigns_so_a_standby_takes_over_at_once(failover_cluster: TestCluster) -> None:
    cluster = failover_cluster
    active = cluster.active_controller()
    old_epoch = cluster.controller_epoch()
    signalled_at = time.monotonic()
    active.proc.send_signal(signal.SIGTERM)
    # Resigning revokes the election lease: the key goes now, not a TTL later.
    wait_for(
        lambda: (
            (kv := cluster.store.get(CONTROLLER_KEY)) is not None and kv.create_revision > old_epoch
        ),
        FAILOVER_BUDGET_S + 5,
        "a standby to take over",
    )
    assert time.monotonic() - signalled_at < TTL_S
    assert active.wait(20) == 0
    successor = cluster.active_controller()
    assert successor is not active
    cluster.create_topic("after-sigterm", 1, 3)


def test_producer_id_blocks_stay_disjoint_across_controller_failover(
    failover_cluster: TestCluster,
) -> None:
    cluster = failover_cluster
    cluster.start_controller(110)  # a standby, whatever the earlier tests left running
    old_active = cluster.active_controller()
    before = [allocate(cluster) for _ in range(3)]
    cluster.kill(old_active)  # kill -9: its in-memory counter dies with it
    after = []
    for _ in range(3):
        after.append(allocate(cluster))  # retried until the standby took office
    assert cluster.active_controller() is not old_active
    assert_disjoint_and_increasing(before + after)
    assert after[0].start >= before[-1].stop
    assert stored_next_block_start(cluster) == after[-1].stop
    # And once more: a second failover, the third controller continues from etcd.
    cluster.start_controller(111)
    second = cluster.active_controller()
    cluster.kill(second)
    last = allocate(cluster)
    assert cluster.active_controller() is not second
    assert_disjoint_and_increasing([*before, *after, last])
    cluster.start_controller(112)  # leave a standby behind


def test_a_broker_back_with_an_empty_disk_while_no_controller_ran_is_not_elected(
    tmp_path: Path,
) -> None:
    """The controller dies; a follower is killed and comes back with an empty disk (it
    registers again, unseen); the leader dies. The next controller must take the
    follower out of the ISR it was in before restarting, not keep it there and elect
    it when the leader's lease ends: every acknowledged record would be gone, and the
    old leader, back, would truncate to the empty log. The partition waits offline for
    the only replica that has the data, as Kafka's would."""
    cluster = TestCluster(tmp_path)
    try:
        for broker_id in (1, 2, 3):
            cluster.start_broker(broker_id)
        cluster.start_controller(1)
        cluster.wait_brokers([1, 2, 3])
        gateway = cluster.start_gateway()
        cluster.create_topic("t", 1, 2)
        (state,) = cluster.partitions("t")
        leader = state.leader
        (follower,) = [b for b in state.replicas if b != leader]
        with tidelog.Producer(gateway.address, acks="all") as producer:
            producer.send_batch("t", [f"v{i}".encode() for i in range(100)], partition=0)
            producer.flush()

        def registration() -> int | None:
            found = cluster.store.get(f"brokers/{follower}")  # no controller to ask
            return None if found is None else found.create_revision

        old_epoch = registration()
        cluster.kill(cluster.controllers[1])
        cluster.kill(cluster.brokers[follower])
        shutil.rmtree(cluster.data_dir(follower))
        cluster.start_broker(follower)  # registers once its old lease has expired
        wait_for(lambda: registration() not in (None, old_epoch), 20, "the re-registration")
        cluster.kill(cluster.brokers[leader])  # its lease lives on for a moment
        cluster.start_controller(2)
        cluster.active_controller()
        (state,) = cluster.partitions("t")
        assert follower not in state.isr, state
        wait_for(lambda: cluster.partitions("t")[0].leader == -1, 20, "the partition offline")
        assert cluster.partitions("t")[0].isr == [leader]
        cluster.start_broker(leader)
        wait_for(lambda: cluster.partitions("t")[0].leader == leader, 20, "the old leader back")
        with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
            consumer.assign([("t", 0)])
            records: list = []
            deadline = time.monotonic() + 30
            while len(records) < 100 and time.monotonic() < deadline:
                records.extend(consumer.poll(timeout_ms=500))
        assert [r.value for r in records] == [f"v{i}".encode() for i in range(100)]
    finally:
        cluster.close()


def test_a_leader_and_isr_the_broker_failed_with_a_storage_error_is_sent_again(
    tmp_path: Path,
) -> None:
    """A partition whose LeaderAndIsr failed on the broker with STORAGE_ERROR (here a
    stray file where its log directory goes; a full disk halts the broker instead, see
    tests/chaos/test_disk_failure.py) used to be dropped by the controller: once the
    cause was gone, the broker still did not host it, and its leader served nothing. It
    is sent again, with backoff, until the broker takes the role."""
    cluster = TestCluster(tmp_path)
    try:
        cluster.start_broker(1)
        cluster.start_controller(1)
        cluster.wait_brokers([1])
        gateway = cluster.start_gateway()
        stray = cluster.data_dir(1) / "t-0"
        stray.write_text("not a directory")
        cluster.create_topic("t", 1, 1)
        time.sleep(1.0)  # a few refusals
        # The retried partition does not hold back the broker's metadata, which admin
        # calls wait for: another topic is created as usual meanwhile.
        cluster.create_topic("unblocked", 1, 1)
        stray.unlink()

        def hosted() -> bool:
            answer = cluster.brokers[1].stub.DescribeLogDirs(
                storage_pb2.DescribeLogDirsRequest(), timeout=RPC_TIMEOUT_S
            )
            return ("t", 0) in {
                (p.topic, p.partition) for d in answer.log_dirs for p in d.partitions
            }

        wait_for(hosted, 30, "the broker to host t-0")
        with tidelog.Producer(gateway.address) as producer:
            assert producer.send("t", b"x", partition=0).result(30).offset == 0
    finally:
        cluster.close()
