"""A storage node in a cluster: registration in etcd, epochs, fencing, deregistration.

Real etcd, real ``tidelog storage`` processes, real gRPC. The controller side of these
interactions is tested in ``test_controller.py``; here the test plays the controller.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cluster_metadata import (
    CLUSTER_ID_KEY,
    CONTROLLER_KEY,
    broker_key,
    decode_broker,
    decode_cluster_id,
    encode_broker,
    encode_controller,
)
from services.controller.state import Broker
from services.metastore import MetaStore, MetaStoreError
from services.storage.meta_properties import MetaProperties, read_meta_properties
from services.storage.registration import BrokerRegistration
from tests.support.process import REPO_ROOT, StorageProcess, tidelog_env
from tidelog.etcd_launcher import EtcdProcess, EtcdTuning, free_port
from tidelog.records import encode_batch
from tidelog.v1 import common_pb2, storage_pb2, storage_pb2_grpc

TTL_S = 2


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    with EtcdProcess(tmp_path_factory.mktemp("etcd"), tuning=EtcdTuning()) as server:
        yield server


@pytest.fixture
def store(etcd: EtcdProcess, request: pytest.FixtureRequest) -> Iterator[MetaStore]:
    # A cluster name per test keeps tests independent on the shared etcd.
    cluster = request.node.name.replace("[", "-").replace("]", "")
    with MetaStore(etcd.endpoint, cluster=cluster) as meta:
        yield meta


def start_member(
    tmp_path: Path,
    etcd: EtcdProcess,
    store: MetaStore,
    broker_id: int = 1,
    name: str = "data",
    *,
    command_prefix: Sequence[str] = (),
) -> StorageProcess:
    return StorageProcess(
        tmp_path / name,
        broker_id=broker_id,
        command_prefix=command_prefix,
        extra_args=[
            "--etcd",
            etcd.endpoint,
            "--cluster",
            store.cluster,
            "--rack",
            "zone-a",
            "--session-ttl-s",
            str(TTL_S),
            "--controlled-shutdown-timeout-s",
            "1",
        ],
    ).start()


def port_of(node: StorageProcess) -> int:
    return int(node.address.rsplit(":", 1)[1])


def wait_for(condition: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def leader_and_isr(
    node: StorageProcess, *, controller_epoch: int, broker_epoch: int, leader_epoch: int = 0
) -> storage_pb2.LeaderAndIsrResponse:
    state = common_pb2.PartitionState(
        topic="members",
        partition=0,
        leader=node.broker_id,
        leader_epoch=leader_epoch,
        isr=[node.broker_id],
        replicas=[node.broker_id],
    )
    response: storage_pb2.LeaderAndIsrResponse = node.stub.LeaderAndIsr(
        storage_pb2.LeaderAndIsrRequest(
            controller_id=1,
            controller_epoch=controller_epoch,
            broker_epoch=broker_epoch,
            partitions=[storage_pb2.LeaderAndIsrPartition(state=state, is_new=True)],
        ),
        timeout=10,
    )
    return response


def error_code(exc: grpc.RpcError) -> str | None:
    for key, value in exc.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == "tidelog-error-code":
            return str(value)
    return None


def test_registers_with_lease_and_epoch(
    tmp_path: Path, etcd: EtcdProcess, store: MetaStore
) -> None:
    node = start_member(tmp_path, etcd, store)
    try:
        kv = store.get(broker_key(1))
        assert kv is not None
        broker = decode_broker(kv)
        assert (broker.host, broker.port, broker.rack) == (
            "127.0.0.1",
            port_of(node),
            "zone-a",
        )
        assert broker.epoch == kv.create_revision > 0
        assert kv.lease_id != 0
        assert kv.json()["broker_epoch"] == kv.create_revision  # recorded for people
        # The lease is kept alive well past its TTL.
        time.sleep(TTL_S * 2)
        again = store.get(broker_key(1))
        assert again is not None and again.create_revision == kv.create_revision
    finally:
        assert node.terminate() == 0
    # A clean stop deregisters at once (revoked lease), not after the TTL.
    assert store.get(broker_key(1)) is None


def test_kill_9_expires_and_restart_gets_a_newer_epoch(
    tmp_path: Path, etcd: EtcdProcess, store: MetaStore
) -> None:
    node = start_member(tmp_path, etcd, store)
    first = store.get(broker_key(1))
    assert first is not None
    node.kill()
    # The restarted incarnation waits for the old key to expire, then registers anew.
    restarted = start_member(tmp_path, etcd, store)
    try:
        second = store.get(broker_key(1))
        assert second is not None
        assert second.create_revision > first.create_revision
        assert decode_broker(second).port == port_of(restarted)
    finally:
        restarted.terminate()


def restart_waiting(
    tmp_path: Path, etcd: EtcdProcess, store: MetaStore
) -> tuple[StorageProcess, int]:
    """Broker 1 (killed) started again on its data and a new port, once it is waiting out
    its previous incarnation's registration (serving gRPC, not registered); and the port."""
    port = free_port()
    restarted = StorageProcess(
        tmp_path / "data",
        broker_id=1,
        extra_args=[
            *("--etcd", etcd.endpoint, "--cluster", store.cluster),
            *("--session-ttl-s", str(TTL_S), "--controlled-shutdown-timeout-s", "1"),
            *("--listen", f"127.0.0.1:{port}"),
        ],
    )
    try:
        wait_for(
            lambda: "waiting_for_previous_registration" in restarted.log_tail(50),
            10,
            "the wait for the old registration",
        )
    except BaseException:
        restarted.terminate()
        raise
    return restarted, port


def test_a_node_waiting_for_its_previous_registration_is_not_serving(
    tmp_path: Path, etcd: EtcdProcess, store: MetaStore
) -> None:
    """Health says SERVING only once the node is in the cluster: while a restarted node
    waits out its killed incarnation's registration it has no broker epoch, and it used
    to be SERVING already, so readiness probes passed for it (found by an audit)."""
    first = start_member(tmp_path, etcd, store)
    first.kill()
    restarted, port = restart_waiting(tmp_path, etcd, store)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "tidelog.v1.Storage"):
                answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
        restarted.start()  # registered, then SERVING
        assert store.get(broker_key(1)) is not None
    finally:
        restarted.terminate()


def test_a_node_waiting_for_its_previous_registration_takes_no_controller_request(
    tmp_path: Path, etcd: EtcdProcess, store: MetaStore
) -> None:
    """A restarted node serves gRPC while it waits out its killed incarnation's
    registration, on the address the controller's sender for that incarnation still
    delivers to. It took those requests: a role meant for the old log (the followers then
    truncated to the new, shorter one: acknowledged records lost, test_restarted_broker), and
    any forged request, whose controller epoch then fenced out every real controller
    (found by an audit). Until it has registered it takes none, whatever epochs they
    carry; then requests for its new epoch go through as before."""
    first = start_member(tmp_path, etcd, store)
    kv = store.get(broker_key(1))
    assert kv is not None
    old_epoch = kv.create_revision
    first.kill()
    restarted, port = restart_waiting(tmp_path, etcd, store)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = storage_pb2_grpc.StorageStub(channel)
            calls: dict[str, Callable[[int, int], Any]] = {
                "LeaderAndIsr": lambda c, b: stub.LeaderAndIsr(
                    storage_pb2.LeaderAndIsrRequest(
                        controller_id=1, controller_epoch=c, broker_epoch=b
                    ),
                    timeout=5,
                ),
                "UpdateMetadata": lambda c, b: stub.UpdateMetadata(
                    storage_pb2.UpdateMetadataRequest(
                        controller_id=1, controller_epoch=c, broker_epoch=b
                    ),
                    timeout=5,
                ),
                "StopReplica": lambda c, b: stub.StopReplica(
                    storage_pb2.StopReplicaRequest(
                        controller_id=1, controller_epoch=c, broker_epoch=b
                    ),
                    timeout=5,
                ),
            }
            for name, call in calls.items():
                for broker_epoch in (old_epoch, -1, 123_456):
                    with pytest.raises(grpc.RpcError) as refused:
                        call(2**62, broker_epoch)
                    assert error_code(refused.value) == "STALE_BROKER_EPOCH", name
            assert "waiting_for_previous_registration" in restarted.log_tail(50)
        restarted.start()  # registered
        kv = store.get(broker_key(1))
        assert kv is not None and kv.create_revision != old_epoch
        # The refused requests' controller epoch (2**62) did not stick: a real one's passes.
        ok = leader_and_isr(restarted, controller_epoch=5, broker_epoch=kv.create_revision)
        assert ok.partitions[0].error.code == common_pb2.NONE
    finally:
        restarted.terminate()


def test_a_sigterm_while_waiting_for_the_previous_registration_stops_at_once(
    tmp_path: Path, etcd: EtcdProcess, store: MetaStore
) -> None:
    """A stop requested during start-up ends it: the node waiting out its killed
    incarnation's registration (10 s TTL here) exits at once with status 0, never
    registered. The signal used to be read only after the start: the node registered,
    then ran a whole controlled shutdown (found by an audit)."""

    def member() -> StorageProcess:
        return StorageProcess(
            tmp_path / "data",
            broker_id=1,
            extra_args=[
                *("--etcd", etcd.endpoint, "--cluster", store.cluster),
                *("--session-ttl-s", "10", "--controlled-shutdown-timeout-s", "5"),
            ],
        )

    first = member().start()
    registered = store.get(broker_key(1))
    assert registered is not None
    first.kill()
    registrations = first.log_path.read_text().count('"event": "registered"')
    restarted = member()
    try:
        wait_for(
            lambda: "waiting_for_previous_registration" in restarted.log_tail(50),
            10,
            "the wait for the old registration",
        )
        stopped_at = time.monotonic()
        restarted.proc.send_signal(signal.SIGTERM)
        assert restarted.wait(20) == 0
        assert time.monotonic() - stopped_at < 8  # the old registration lives 10 s
        assert restarted.log_path.read_text().count('"event": "registered"') == registrations
        still = store.get(broker_key(1))
        assert still is None or still.create_revision == registered.create_revision
    finally:
        restarted.kill()


def test_expiry_without_restart_removes_the_key(
    tmp_path: Path, etcd: EtcdProcess, store: MetaStore
) -> None:
    node = start_member(tmp_path, etcd, store)
    node.kill()
    wait_for(lambda: store.get(broker_key(1)) is None, TTL_S + 3, "the lease to expire")


def test_controller_and_broker_epoch_fencing(
    tmp_path: Path, etcd: EtcdProcess, store: MetaStore
) -> None:
    node = start_member(tmp_path, etcd, store)
    try:
        kv = store.get(broker_key(1))
        assert kv is not None
        epoch = kv.create_revision
        ok = leader_and_isr(node, controller_epoch=5, broker_epoch=epoch)
        assert ok.partitions[0].error.code == common_pb2.NONE
        # A deposed controller (older epoch) changes nothing.
        with pytest.raises(grpc.RpcError) as stale:
            leader_and_isr(node, controller_epoch=4, broker_epoch=epoch, leader_epoch=1)
        assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_code(stale.value) == "STALE_CONTROLLER_EPOCH"
        # A request meant for an earlier incarnation of the broker changes nothing either.
        with pytest.raises(grpc.RpcError) as old_broker:
            leader_and_isr(node, controller_epoch=6, broker_epoch=epoch - 1, leader_epoch=1)
        assert error_code(old_broker.value) == "STALE_BROKER_EPOCH"
        # The partition is still at leader epoch 0: a current-epoch append is accepted and
        # an epoch-1 append is refused as unknown.
        append = storage_pb2.AppendRequest(
            topic="members", partition=0, records=encode_batch([b"x"]), current_leader_epoch=0
        )
        assert node.stub.Append(append, timeout=10).last_offset == 0
        with pytest.raises(grpc.RpcError) as newer:
            node.stub.Append(
                storage_pb2.AppendRequest(
                    topic="members",
                    partition=0,
                    records=encode_batch([b"y"]),
                    current_leader_epoch=1,
                ),
                timeout=10,
            )
        assert error_code(newer.value) == "UNKNOWN_LEADER_EPOCH"
        # UpdateMetadata is fenced the same way and accepted when current.
        update = storage_pb2.UpdateMetadataRequest(
            controller_id=1,
            controller_epoch=6,
            broker_epoch=epoch,
            brokers=[common_pb2.BrokerInfo(broker_id=1, host="127.0.0.1", port=port_of(node))],
        )
        assert node.stub.UpdateMetadata(update, timeout=10).error.code == common_pb2.NONE
        update.controller_epoch = 2
        with pytest.raises(grpc.RpcError) as stale_update:
            node.stub.UpdateMetadata(update, timeout=10)
        assert error_code(stale_update.value) == "STALE_CONTROLLER_EPOCH"
    finally:
        node.terminate()


def test_the_cluster_view_is_accepted_whatever_its_size(
    tmp_path: Path, etcd: EtcdProcess, store: MetaStore
) -> None:
    """UpdateMetadata is the whole cluster's view, one request: a cluster of more topics
    than one data request may name partitions (10,000) must still reach its brokers. It
    was refused as INVALID_REQUEST at every change once the cluster had more than 10,000
    partitions (the view then listed every partition), and the controller gave up."""
    node = start_member(tmp_path, etcd, store)
    try:
        kv = store.get(broker_key(1))
        assert kv is not None
        update = storage_pb2.UpdateMetadataRequest(
            controller_id=1,
            controller_epoch=1,
            broker_epoch=kv.create_revision,
            brokers=[common_pb2.BrokerInfo(broker_id=1, host="127.0.0.1", port=port_of(node))],
            topic_ids={f"topic-{i}": f"id-{i}" for i in range(12_000)},
            topic_ids_complete=True,
        )
        assert node.stub.UpdateMetadata(update, timeout=30).error.code == common_pb2.NONE
    finally:
        node.terminate()


def _open_files_limits(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open files limit")


def test_a_storage_node_raises_its_open_files_limit_to_the_hard_one(
    tmp_path: Path, etcd: EtcdProcess, store: MetaStore
) -> None:
    """A storage node holds a few descriptors per segment: started with a shell's soft
    limit of 1,024, it used that, and a few hundred partitions halted it (EMFILE is a
    disk failure) in a loop at every restart (found by an audit at 3,000 partitions)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard limit here ({hard}) leaves nothing to raise")
    lowered = ["sh", "-c", 'ulimit -Sn 1024 && exec "$@"', "sh"]  # exec keeps the PID
    node = start_member(tmp_path, etcd, store, command_prefix=lowered)
    try:
        soft, node_hard = _open_files_limits(node.proc.pid)
        assert soft == node_hard and soft > 1024
    finally:
        node.terminate()


def test_a_registration_etcd_restores_after_an_outage_is_kept(tmp_path: Path) -> None:
    """etcd away longer than the lease's TTL: the broker's keeper reports the lease lost,
    but etcd, back with its data, restores the lease with a fresh TTL and the key with
    it. The registration is taken up again under the same epoch. A new registration used
    to wait that TTL out, the broker dropping out of the cluster and re-registering under
    a new epoch (found by an audit)."""
    server = EtcdProcess(tmp_path / "etcd").start()
    try:
        meta = MetaStore(server.endpoint, cluster="outage", timeout_s=1.0)
        epochs: list[int] = []
        registration = BrokerRegistration(
            meta, Broker(1, "127.0.0.1", 9999), ttl_s=TTL_S, on_epoch=epochs.append
        )
        first = registration.start()
        server.kill()
        time.sleep(TTL_S + 1.5)  # the keeper gives the lease up
        server.start()
        # Past two of the restored lease's TTLs: a lease nobody refreshed would be gone.
        time.sleep(2 * TTL_S + 1)
        kept = meta.get(broker_key(1))
        assert kept is not None and kept.create_revision == first
        assert epochs == [first]
        registration.stop()
        meta.close()
    finally:
        server.kill()


class _StopDuringCreate(MetaStore):
    """A real store whose next ``create_if_absent`` first runs ``before_create``: a stop
    arriving while a re-registration is in flight, at the point the race is narrowest."""

    before_create: Callable[[], None] | None = None

    def create_if_absent(self, *args: Any, **kwargs: Any) -> bool:
        hook, self.before_create = self.before_create, None
        if hook is not None:
            hook()
        return super().create_if_absent(*args, **kwargs)


def test_a_stop_during_a_reregistration_leaves_no_registration(
    etcd: EtcdProcess, store: MetaStore
) -> None:
    """The lease is lost (revoked from outside) and the broker registers again; stop()
    lands between that re-registration's lease grant and its create. Nothing may stay
    registered: the re-registration used to adopt its lease after stop() had revoked the
    old one and keep it alive, a stopped broker looking alive to the controller (found by
    an audit)."""
    with _StopDuringCreate(etcd.endpoint, cluster=store.cluster) as meta:
        registration = BrokerRegistration(
            meta, Broker(1, "127.0.0.1", 9999), ttl_s=TTL_S, on_epoch=lambda epoch: None
        )
        registration.start()
        first = meta.get(broker_key(1))
        assert first is not None
        meta.before_create = registration.stop
        store.revoke_lease_id(first.lease_id)  # the keeper finds its lease gone
        wait_for(lambda: meta.before_create is None, TTL_S + 3, "the re-registration")
        # Past the TTL of any lease the re-registration granted: only a kept one remains.
        time.sleep(TTL_S + 1)
        assert meta.get(broker_key(1)) is None


def test_a_data_directory_of_another_cluster_or_broker_is_refused_and_kept(
    tmp_path: Path, etcd: EtcdProcess, store: MetaStore
) -> None:
    """meta.properties (Kafka's) records whose directory it is. A volume copied into
    another cluster, or mounted on another broker id, is refused at start with one line
    and nothing on it changes: it used to be adopted, every log a stray to the new
    cluster's controller, and deleted by its first UpdateMetadata (found by an audit)."""
    node = start_member(tmp_path, etcd, store)
    try:
        registered = store.get(broker_key(1))
        assert registered is not None
        epoch = registered.create_revision
        assert leader_and_isr(node, controller_epoch=1, broker_epoch=epoch).error.code == 0
    finally:
        assert node.terminate() == 0
    data_dir = tmp_path / "data"
    cluster_id = store.get(CLUSTER_ID_KEY)
    assert cluster_id is not None
    assert read_meta_properties(data_dir) == MetaProperties(1, decode_cluster_id(cluster_id))
    before = sorted(p.name for p in data_dir.iterdir())
    assert "members-0" in before
    for broker_id, cluster, refusal in (
        (1, "elsewhere", "belongs to cluster"),
        (2, store.cluster, "belongs to broker 1"),
    ):
        refused = StorageProcess(
            data_dir,
            broker_id=broker_id,
            extra_args=["--etcd", etcd.endpoint, "--cluster", cluster, "--session-ttl-s", "2"],
        )
        assert refused.wait(30) == 1
        assert refusal in refused.log_tail(20)
        assert sorted(p.name for p in data_dir.iterdir()) == before
    again = start_member(tmp_path, etcd, store)  # its own broker id and cluster: fine
    assert again.terminate() == 0


def test_duplicate_broker_id_is_refused(
    tmp_path: Path, etcd: EtcdProcess, store: MetaStore
) -> None:
    first = start_member(tmp_path, etcd, store, name="one")
    try:
        second = StorageProcess(
            tmp_path / "two",
            broker_id=1,
            extra_args=[
                "--etcd",
                etcd.endpoint,
                "--cluster",
                store.cluster,
                "--session-ttl-s",
                "1",
            ],
        )
        # It waits two TTLs for the key to go away, then gives up with one clear line.
        assert second.wait(30) != 0
        assert "broker id 1 is registered" in second.log_tail(200)
    finally:
        first.terminate()


def test_a_node_whose_broker_id_was_taken_while_it_was_away_halts(
    tmp_path: Path, etcd: EtcdProcess, store: MetaStore
) -> None:
    """A node loses its registration (its lease ends as when it is paused past its TTL),
    and another live process registers its broker id meanwhile. The node waits as at a
    start (two TTLs), then halts with exit status 4 and ``broker_id_taken``. It used to
    re-register for ever, silently (old epoch, still serving), and took the id back the
    moment the other deregistered, whose restart then failed (found by an audit)."""
    node = start_member(tmp_path, etcd, store)
    other = BrokerRegistration(
        store, Broker(1, "10.0.0.2", 9002), ttl_s=TTL_S, on_epoch=lambda epoch: None
    )
    try:
        first = store.get(broker_key(1))
        assert first is not None
        store.revoke_lease_id(first.lease_id)
        other.start()  # the replacement: the key is its own now
        assert node.wait(2 * TTL_S + 15) == 4
        assert "broker_id_taken" in node.log_tail(50)
        other.stop()
        time.sleep(1.0)  # a node still trying would have taken the id back by now
        assert store.get(broker_key(1)) is None
    finally:
        other.stop()
        node.kill()


def test_a_node_whose_stdout_is_gone_stops_cleanly(
    tmp_path: Path, etcd: EtcdProcess, store: MetaStore
) -> None:
    """The supervisor that started a node died while it started: nobody reads its stdout.
    Its listening line raised BrokenPipeError, the process ended with a traceback and
    status 1, and node.stop() never ran: its registration stayed in etcd for its TTL (the
    controller counted a dead broker alive, its next start waited it out; found by an
    audit). It stops cleanly now, deregistering, and says why in its log."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads
    with open(tmp_path / "storage.err", "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tidelog", "storage", "--etcd", etcd.endpoint,
             "--cluster", store.cluster, "--broker-id", "0", "--data-dir", str(tmp_path / "b0"),
             "--listen", "127.0.0.1:0", "--session-ttl-s", "30",
             "--controlled-shutdown-timeout-s", "1"],
            stdout=write_end, stderr=stderr, stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
            env=tidelog_env(),
        )  # fmt: skip
    os.close(write_end)
    try:
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    err = (tmp_path / "storage.err").read_text(errors="replace")
    assert "Traceback" not in err, err[-800:]
    assert "announce_failed" in err
    assert store.get(broker_key(0)) is None, "the registration outlived the node"


def test_a_late_update_metadata_does_not_undo_a_newer_view(
    tmp_path: Path, etcd: EtcdProcess, store: MetaStore
) -> None:
    """The controller gives up on an UpdateMetadata after its deadline and sends the next
    view; the first can still reach the broker afterwards. Its older broker epochs must not
    replace the newer ones: here a follower that registered again (epoch 20, after 10)
    would have its fetches refused as an earlier incarnation until the next view."""
    node = start_member(tmp_path, etcd, store)
    try:
        kv = store.get(broker_key(1))
        assert kv is not None
        epoch = kv.create_revision

        def view(version: int, follower_epoch: int) -> storage_pb2.UpdateMetadataRequest:
            return storage_pb2.UpdateMetadataRequest(
                controller_id=1,
                controller_epoch=6,
                broker_epoch=epoch,
                metadata_version=version,
                brokers=[
                    common_pb2.BrokerInfo(
                        broker_id=1, host="127.0.0.1", port=port_of(node), broker_epoch=epoch
                    ),
                    common_pb2.BrokerInfo(
                        broker_id=2, host="127.0.0.1", port=1, broker_epoch=follower_epoch
                    ),
                ],
            )

        def fetch_as_2(broker_epoch: int) -> str | None:
            try:
                node.stub.Fetch(
                    storage_pb2.FetchRequest(
                        replica_id=2,
                        broker_epoch=broker_epoch,
                        max_wait_ms=0,
                        partitions=[storage_pb2.FetchPartition(topic="members", fetch_offset=0)],
                    ),
                    timeout=10,
                )
            except grpc.RpcError as exc:
                return error_code(exc)
            return None

        assert leader_and_isr(node, controller_epoch=6, broker_epoch=epoch).partitions[0]
        assert node.stub.UpdateMetadata(view(2, 20), timeout=10).error.code == common_pb2.NONE
        assert fetch_as_2(10) == "STALE_BROKER_EPOCH"
        # The late one is acknowledged (the controller stopped waiting for it anyway) and
        # changes nothing.
        assert node.stub.UpdateMetadata(view(1, 10), timeout=10).error.code == common_pb2.NONE
        assert fetch_as_2(20) is None
        assert fetch_as_2(10) == "STALE_BROKER_EPOCH"
        # A newer view, and a new controller's first, apply as before.
        assert node.stub.UpdateMetadata(view(3, 30), timeout=10).error.code == common_pb2.NONE
        assert fetch_as_2(30) is None
        newer_controller = view(1, 40)
        newer_controller.controller_epoch = 7
        assert node.stub.UpdateMetadata(newer_controller, timeout=10).error.code == (
            common_pb2.NONE
        )
        assert fetch_as_2(40) is None
    finally:
        node.terminate()


def test_a_sigterm_during_log_loading_ends_the_start_without_registering(
    tmp_path: Path, etcd: EtcdProcess, store: MetaStore
) -> None:
    """A SIGTERM while the node loads its logs ends the start-up there, as one during the
    wait for a previous registration does: it used to be noted only, the node registered
    once loaded and then ran a whole controlled shutdown (found by an audit)."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(1500):  # enough empty partition directories for loading to take a while
        (data / f"slow-{i}").mkdir()
    node = StorageProcess(
        data,
        broker_id=1,
        extra_args=[
            *("--etcd", etcd.endpoint, "--cluster", store.cluster),
            *("--session-ttl-s", str(TTL_S), "--controlled-shutdown-timeout-s", "2"),
        ],
    )
    try:
        wait_for(lambda: "open_files_limit" in node.log_tail(50), 20, "the start-up under way")
        node.proc.send_signal(signal.SIGTERM)
        assert node.wait(60) == 0
        log = node.log_path.read_text()
        assert '"event": "registered"' not in log
        assert '"event": "controlled_shutdown' not in log
        assert store.get(broker_key(1)) is None
    finally:
        node.kill()


def test_a_controlled_shutdown_keeps_to_its_timeout_with_a_hung_controller(
    etcd: EtcdProcess, store: MetaStore
) -> None:
    """The controller's key names a process that accepts connections and never answers
    (paused, hung): each ControlledShutdown call gets what is left of the shutdown's
    time. A fixed 5 s per call made a 1 s shutdown take 5 s, past a supervisor's kill
    limit, and the node was then killed before it flushed (found by an audit)."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)  # the kernel completes connections; nothing ever answers
        store.put(CONTROLLER_KEY, encode_controller(9, f"127.0.0.1:{hung.getsockname()[1]}"))
        registration = BrokerRegistration(
            store, Broker(1, "127.0.0.1", 1, ""), ttl_s=TTL_S, on_epoch=lambda _epoch: None
        )
        registration.start()
        try:
            started = time.monotonic()
            assert not registration.controlled_shutdown(timeout_s=1.0)
            elapsed = time.monotonic() - started
        finally:
            registration.stop()
    assert elapsed < 2.0, f"a 1 s controlled shutdown took {elapsed:.2f} s"


def test_a_registration_that_fails_after_its_key_was_made_leaves_no_live_key(
    etcd: EtcdProcess, store: MetaStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key is made, then a later step fails (etcd's answer lost, say): the lease, kept
    alive by nobody, is revoked at once. It stayed for a TTL, a registered broker the
    controller counted on while the node had given up (found by an audit)."""
    registration = BrokerRegistration(
        store, Broker(1, "127.0.0.1", 1, ""), ttl_s=30, on_epoch=lambda _epoch: None
    )

    def lost(*args: Any, **kwargs: Any) -> Any:
        raise MetaStoreError("the answer was lost")

    monkeypatch.setattr(store, "compare_and_swap", lost)
    with pytest.raises(MetaStoreError):
        registration.start()
    assert store.get(broker_key(1)) is None


def test_a_restart_with_a_shorter_session_ttl_waits_out_the_old_longer_lease(
    etcd: EtcdProcess, store: MetaStore
) -> None:
    """A node killed with a 6 s session TTL restarts with 1 s: the wait for its previous
    registration counted 2 x the NEW TTL (4 s) and failed the restart ("registered by
    another live process") while its own old key lived on (found by an audit). It waits
    for what is left of the old lease."""
    old = store.grant_lease(6)  # a killed incarnation's: never refreshed again
    assert store.create_if_absent(
        broker_key(1), encode_broker(Broker(1, "127.0.0.1", 1, "")), lease=old
    )
    registration = BrokerRegistration(
        store, Broker(1, "127.0.0.1", 2, ""), ttl_s=1, on_epoch=lambda _epoch: None
    )
    try:
        assert registration.start() > 0
        kv = store.get(broker_key(1))
        assert kv is not None and decode_broker(kv).port == 2
    finally:
        registration.stop()
