"""The etcd launcher and the MetaStore wrapper, against real etcd processes.

One etcd serves the module (each test gets its own cluster prefix, so tests cannot see
each other's keys); tests that kill or restart etcd start a private one.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import etcd3
import pytest

from services.metastore import (
    Compare,
    DeleteOp,
    DeleteResult,
    GetOp,
    GetResult,
    Guard,
    LeaseKeeper,
    LeaseLostError,
    MetaStore,
    MetaStoreError,
    MetaStoreRequestTooLargeError,
    MetaStoreUnavailableError,
    PutOp,
    PutResult,
    WatchCompactedError,
    WatchEvent,
    parse_endpoints,
)
from tidelog import etcd_launcher
from tidelog.errors import BrokerNotAvailableError
from tidelog.etcd_launcher import (
    NOT_FOUND_MESSAGE,
    EtcdNotFoundError,
    EtcdProcess,
    find_etcd_binary,
    free_port,
)

pytestmark = pytest.mark.timeout(120)


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    with EtcdProcess(tmp_path_factory.mktemp("etcd-shared")) as process:
        yield process


@pytest.fixture
def store(etcd: EtcdProcess, request: pytest.FixtureRequest) -> Iterator[MetaStore]:
    cluster = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)
    with MetaStore(etcd.endpoint, cluster=cluster, timeout_s=3.0) as meta:
        yield meta


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    process = EtcdProcess(tmp_path / "etcd").start()
    try:
        yield process
    finally:
        process.kill()


# ------------------------------------------------------------------ launcher


def test_launcher_start_stop_restart_keeps_data(tmp_path: Path) -> None:
    process = EtcdProcess(tmp_path / "etcd")
    with process:
        assert process.endpoint.startswith("http://127.0.0.1:")
        first_pid = process.pid
        with MetaStore(process.endpoint, cluster="c") as meta:
            meta.put("kept", b"across restarts")
            revision_before = meta.current_revision()
            process.restart()
            assert process.pid != first_pid
            # The same client object works again: same endpoint, gRPC reconnects.
            wait_until(lambda: _answers(meta), 10, "the client to reconnect after restart")
            kept = meta.get("kept")
            assert kept is not None and kept.value == b"across restarts"
            assert meta.current_revision() == revision_before
        # kill() then start() also recovers the data (crash recovery from the WAL).
        process.kill()
        assert not process.is_running()
        process.start()
        with MetaStore(process.endpoint, cluster="c") as meta:
            kept = meta.get("kept")
            assert kept is not None and kept.value == b"across restarts"
    assert not process.is_running()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{process.endpoint}/health", timeout=1)
    assert process.log_path.is_file() and process.log_path.stat().st_size > 0


def _answers(meta: MetaStore) -> bool:
    try:
        meta.current_revision()
    except MetaStoreUnavailableError:
        return False
    return True


def test_launcher_retries_when_a_port_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process grabs the probed port before etcd binds it: start() picks new ports.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        real_free_port = etcd_launcher.free_port
        probes = iter([taken, real_free_port()])
        monkeypatch.setattr(
            etcd_launcher,
            "free_port",
            lambda host="127.0.0.1": next(probes, None) or real_free_port(host),
        )
        with EtcdProcess(tmp_path / "etcd") as process:
            assert process.client_port != taken
            assert "address already in use" in process.log_tail(1000)


def test_launcher_reports_missing_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDELOG_ETCD_BIN", str(tmp_path / "no-such-etcd"))
    with pytest.raises(EtcdNotFoundError) as excinfo:
        EtcdProcess(tmp_path / "etcd")
    assert NOT_FOUND_MESSAGE in str(excinfo.value)
    assert "apt-get install -y etcd-server" in str(excinfo.value)
    with pytest.raises(EtcdNotFoundError):
        find_etcd_binary()


def test_launcher_error_includes_log_tail(tmp_path: Path) -> None:
    # An unknown flag makes etcd exit at once; the error must say why.
    process = EtcdProcess(tmp_path / "etcd", extra_args=["--no-such-flag"])
    with pytest.raises(RuntimeError) as excinfo:
        process.start()
    assert "exited with status" in str(excinfo.value)
    assert "no-such-flag" in str(excinfo.value)
    assert not process.is_running()


# ------------------------------------------------------------------ endpoints


def test_parse_endpoints() -> None:
    assert parse_endpoints("http://127.0.0.1:2379") == [("127.0.0.1", 2379)]
    assert parse_endpoints("etcd-0:2379, http://etcd-1:2380") == [
        ("etcd-0", 2379),
        ("etcd-1", 2380),
    ]
    for bad in ("", "https://h:1", "just-a-host", "h:port"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)


# ------------------------------------------------------------------ reads and writes


def test_get_put_delete_and_prefix(store: MetaStore, etcd: EtcdProcess) -> None:
    assert store.get("topics/a") is None
    revision = store.put("topics/a", b'{"partitions": 3}')
    got = store.get("topics/a")
    assert got is not None
    assert got.key == "topics/a"
    assert got.value == b'{"partitions": 3}'
    assert got.json() == {"partitions": 3}
    assert got.mod_revision == got.create_revision == revision
    assert got.version == 1

    store.put("topics/b", b"2")
    store.put("topics/a", b"1")
    store.put("topicsX", b"not under topics/")
    kvs = store.get_prefix("topics/")
    assert [(kv.key, kv.value) for kv in kvs] == [("topics/a", b"1"), ("topics/b", b"2")]
    updated = kvs[0]
    assert updated.create_revision == revision < updated.mod_revision
    assert updated.version == 2
    everything, at_revision = store.get_prefix_with_revision("")
    assert {kv.key for kv in everything} == {"topics/a", "topics/b", "topicsX"}
    assert at_revision == store.current_revision()

    assert store.delete("topics/a") is True
    assert store.delete("topics/a") is False
    assert store.get("topics/a") is None

    # Another cluster's store sees none of it: keys live under /tidelog/<cluster>/.
    with MetaStore(etcd.endpoint, cluster=store.cluster + "-other") as other:
        assert other.get_prefix("") == []
    assert store.full_key("topics/b") == f"/tidelog/{store.cluster}/topics/b".encode()


def test_get_prefix_pages_consistently(store: MetaStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("services.metastore.PREFIX_PAGE_KEYS", 3)
    for i in range(10):
        store.put(f"partitions/t/{i:02d}", str(i).encode())
    kvs = store.get_prefix("partitions/t/")
    assert [kv.value for kv in kvs] == [str(i).encode() for i in range(10)]


def test_get_prefix_reads_pages_larger_than_a_response_may_be(store: MetaStore) -> None:
    """A page of PREFIX_PAGE_KEYS keys is one gRPC answer, and the client takes at most
    64 MiB: 70 values of 1 MB (a group state may be that large) made every read of their
    prefix fail, reported as "too large for one etcd request" (found by an audit). A page
    too large is read again in halves."""
    value = b"x" * 1_000_000
    for i in range(70):
        store.put(f"big/{i:03d}", value)
    kvs = store.get_prefix("big/")
    assert [kv.key for kv in kvs] == [f"big/{i:03d}" for i in range(70)]
    assert all(kv.value == value for kv in kvs)


def test_an_ipv6_literal_endpoint_reaches_etcd(tmp_path: Path) -> None:
    """``http://[::1]:PORT``: the host was kept without its brackets, and etcd3 dialled
    "::1:PORT", which gRPC cannot read as a host and a port: every call failed as "etcd
    unreachable" although etcd answered there (found by an audit)."""
    try:
        free_port("::1")
    except OSError:
        pytest.skip("no IPv6 loopback")
    with EtcdProcess(tmp_path / "etcd", host="::1") as server:
        assert server.endpoint.startswith("http://[::1]:")
        with MetaStore(server.endpoint, cluster="v6", timeout_s=2.0) as meta:
            meta.put("k", b"v")
            kv = meta.get("k")
            assert kv is not None and kv.value == b"v"
            assert meta.endpoints == server.endpoint


def test_create_if_absent_has_exactly_one_winner(store: MetaStore) -> None:
    contenders = 8
    barrier = threading.Barrier(contenders)
    results: list[bool] = []
    lock = threading.Lock()

    def contend(i: int) -> None:
        barrier.wait()
        won = store.create_if_absent("controller", f"{i}".encode())
        with lock:
            results.append(won)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * (contenders - 1) + [True]
    winner = store.get("controller")
    assert winner is not None and winner.version == 1


def test_compare_and_swap(store: MetaStore) -> None:
    # Expected revision 0: the key must not exist yet.
    assert store.compare_and_swap("partitions/t/0", 0, b"v1")
    read = store.get("partitions/t/0")
    assert read is not None
    assert not store.compare_and_swap("partitions/t/0", 0, b"again")

    assert store.compare_and_swap("partitions/t/0", read.mod_revision, b"v2")
    # A writer still holding the old revision loses and changes nothing.
    assert not store.compare_and_swap("partitions/t/0", read.mod_revision, b"stale")
    current = store.get("partitions/t/0")
    assert current is not None and current.value == b"v2"

    # A concurrent write between read and CAS makes the CAS fail.
    store.put("partitions/t/0", b"concurrent")
    assert not store.compare_and_swap("partitions/t/0", current.mod_revision, b"v3")
    after = store.get("partitions/t/0")
    assert after is not None and after.value == b"concurrent"

    assert not store.compare_and_delete("partitions/t/0", current.mod_revision)
    assert store.compare_and_delete("partitions/t/0", after.mod_revision)
    assert store.get("partitions/t/0") is None


def test_guards_fence_a_deposed_controller(store: MetaStore) -> None:
    assert store.create_if_absent("controller", b'{"id": 1}')
    controller = store.get("controller")
    assert controller is not None
    epoch = controller.create_revision
    guard = Guard("controller", create_revision=epoch)
    store.put("partitions/t/0", b"state-0")
    state = store.get("partitions/t/0")
    assert state is not None

    # Guard intact: the write applies.
    assert store.compare_and_swap("partitions/t/0", state.mod_revision, b"state-1", [guard])
    state = store.get("partitions/t/0")
    assert state is not None

    # The controller key is deleted (lease expired): the old controller's writes fail.
    store.delete("controller")
    assert not store.compare_and_swap("partitions/t/0", state.mod_revision, b"x", [guard])
    assert not store.create_if_absent("topics/new", b"{}", guards=[guard])

    # A successor re-creates the key: a new create revision, the old epoch stays fenced.
    assert store.create_if_absent("controller", b'{"id": 2}')
    assert not store.compare_and_swap("partitions/t/0", state.mod_revision, b"x", [guard])
    successor = store.get("controller")
    assert successor is not None and successor.create_revision != epoch
    new_guard = Guard("controller", create_revision=successor.create_revision)
    assert store.compare_and_swap("partitions/t/0", state.mod_revision, b"state-2", [new_guard])

    # mod_revision and value guards: any change to the guard key blocks the write.
    state = store.get("partitions/t/0")
    assert state is not None
    by_mod = Guard("controller", mod_revision=successor.mod_revision, value=b'{"id": 2}')
    store.put("controller", b'{"id": 2, "address": "moved"}')
    assert not store.compare_and_swap("partitions/t/0", state.mod_revision, b"x", [by_mod])
    final = store.get("partitions/t/0")
    assert final is not None and final.value == b"state-2"

    with pytest.raises(ValueError):
        Guard("controller")


def test_txn_branches_and_results(store: MetaStore) -> None:
    store.put("groups/g/t/0", b"10")
    store.put("groups/g/t/1", b"11")
    result = store.txn(
        [Compare.exists("groups/g/t/0"), Compare.value_is("groups/g/t/1", b"11")],
        success=[
            PutOp("groups/g/t/2", b"12"),
            GetOp("groups/g/", prefix=True),
            DeleteOp("groups/g/t/0"),
        ],
        failure=[GetOp("groups/g/t/0")],
    )
    assert result.succeeded
    assert isinstance(result.responses[0], PutResult)
    listing = result.responses[1]
    assert isinstance(listing, GetResult)
    assert [kv.key for kv in listing.kvs] == ["groups/g/t/0", "groups/g/t/1", "groups/g/t/2"]
    assert result.responses[2] == DeleteResult(deleted=1)
    written = store.get("groups/g/t/2")
    assert written is not None and written.mod_revision == result.revision

    failed = store.txn(
        [Compare.absent("groups/g/t/1")],
        success=[PutOp("groups/g/t/1", b"never")],
        failure=[GetOp("groups/g/t/1")],
    )
    assert not failed.succeeded
    only = failed.responses[0]
    assert isinstance(only, GetResult) and only.kvs[0].value == b"11"
    assert failed.revision == result.revision  # nothing was written

    deleted = store.txn([], success=[DeleteOp("groups/", prefix=True)])
    assert deleted.responses == [DeleteResult(deleted=2)]
    assert store.get_prefix("groups/") == []

    # One topic creation writes a state per partition atomically: more than etcd's default
    # limit of 128 ops per transaction, which the launcher raises.
    big = store.txn([], success=[PutOp(f"partitions/big/{i}", b"{}") for i in range(300)])
    assert big.succeeded and len(store.get_prefix("partitions/big/")) == 300


# ------------------------------------------------------------------ leases


def test_lease_expiry_removes_bound_key(store: MetaStore) -> None:
    lease = store.grant_lease(1)
    assert lease.ttl_s == 1
    assert store.create_if_absent("brokers/1", b'{"host": "h"}', lease=lease)
    registered = store.get("brokers/1")
    assert registered is not None and registered.lease_id == lease.id
    remaining = lease.remaining_ttl()
    assert remaining is not None and 0 <= remaining <= 1
    # etcd expires leases on its own clock (checked every 500 ms): allow a margin.
    wait_until(lambda: store.get("brokers/1") is None, 5, "the lease-bound key to vanish")
    assert lease.remaining_ttl() is None
    with pytest.raises(LeaseLostError):
        lease.refresh()
    with pytest.raises(LeaseLostError):
        store.put("brokers/1", b"{}", lease=lease)
    lease.revoke()  # already gone: still fine


def test_lease_keeper_keeps_alive_and_reports_loss(store: MetaStore, etcd: EtcdProcess) -> None:
    lease = store.grant_lease(1)
    store.put("brokers/2", b"{}", lease=lease)
    lost: list[MetaStoreError] = []
    keeper = LeaseKeeper(lease, on_lost=lost.append).start()
    try:
        time.sleep(3.5)  # more than three TTLs
        assert store.get("brokers/2") is not None
        assert not keeper.lost and lost == []
        # Another client (another process, in real life) revokes the lease.
        with MetaStore(etcd.endpoint, cluster=store.cluster) as other:
            other.revoke_lease_id(lease.id)
        assert keeper.wait_lost(3.0)
        assert len(lost) == 1 and isinstance(lost[0], LeaseLostError)
        assert store.get("brokers/2") is None
    finally:
        keeper.stop()


def test_lease_keeper_reports_loss_when_etcd_is_unreachable(private_etcd: EtcdProcess) -> None:
    meta = MetaStore(private_etcd.endpoint, cluster="keeper", timeout_s=1.0)
    lease = meta.grant_lease(1)
    lost: list[MetaStoreError] = []
    keeper = LeaseKeeper(lease, on_lost=lost.append).start()
    try:
        time.sleep(0.5)
        assert not keeper.lost
        private_etcd.kill()
        killed_at = time.monotonic()
        # Reported once a whole TTL has passed without a successful refresh: from then on
        # etcd may have expired the lease, so the holder must stop relying on it.
        assert keeper.wait_lost(5.0)
        assert time.monotonic() - killed_at < 2.5
        assert len(lost) == 1 and isinstance(lost[0], LeaseLostError)
        assert "may have expired" in str(lost[0])
    finally:
        keeper.stop()
        meta.close()


# ------------------------------------------------------------------ watches


def test_watch_delivers_puts_and_deletes_in_order(store: MetaStore) -> None:
    events: list[WatchEvent] = []
    errors: list[MetaStoreError] = []
    store.put("brokers/0", b"before the watch")
    cancel = store.watch_prefix("brokers/", events.append, on_error=errors.append)
    store.put("elsewhere", b"not watched")
    store.put("brokers/1", b"a")
    store.put("brokers/2", b"b")
    store.put("brokers/1", b"a2")
    store.delete("brokers/1")
    wait_until(lambda: len(events) >= 4, 5, "four watch events")
    assert [(e.type, e.key, e.value) for e in events] == [
        ("put", "brokers/1", b"a"),
        ("put", "brokers/2", b"b"),
        ("put", "brokers/1", b"a2"),
        ("delete", "brokers/1", b""),
    ]
    revisions = [e.mod_revision for e in events]
    assert revisions == sorted(revisions) and len(set(revisions)) == 4
    assert events[2].version == 2 and events[2].create_revision == events[0].mod_revision

    cancel()
    cancel()  # idempotent
    store.put("brokers/3", b"after cancel")
    time.sleep(0.3)
    assert len(events) == 4
    assert errors == []


def test_watch_from_revision_replays_history(store: MetaStore) -> None:
    store.put("topics/a", b"1")
    _, revision = store.get_prefix_with_revision("topics/")
    store.put("topics/b", b"2")  # written between the read and the watch
    events: list[WatchEvent] = []
    cancel = store.watch_prefix(
        "topics/", events.append, on_error=lambda e: None, start_revision=revision + 1
    )
    try:
        wait_until(lambda: len(events) == 1, 5, "the replayed event")
        assert events[0].key == "topics/b"
    finally:
        cancel()


def test_watch_callback_failure_ends_watch_and_reports(store: MetaStore) -> None:
    errors: list[MetaStoreError] = []

    def explode(event: WatchEvent) -> None:
        raise RuntimeError("bug in the caller")

    cancel = store.watch_prefix("x/", explode, on_error=errors.append)
    store.put("x/1", b"boom")
    wait_until(lambda: len(errors) == 1, 5, "the error report")
    assert "bug in the caller" in str(errors[0])
    cancel()


def test_a_failed_watch_leaves_no_thread_behind(private_etcd: EtcdProcess) -> None:
    """A watch ended by its stream failing (etcd gone) ends the request stream too: gRPC's
    thread consuming it waited for ever, one per failed watch and etcd blip (found by an
    audit)."""
    meta = MetaStore(private_etcd.endpoint, cluster="leak", timeout_s=1.0)
    meta.put("k", b"v")
    before = threading.active_count()
    errors: list[MetaStoreError] = []
    cancels = [meta.watch_prefix("", lambda e: None, on_error=errors.append) for _ in range(3)]
    private_etcd.kill()
    wait_until(lambda: len(errors) == 3, 10, "the three watches failing")
    for cancel in cancels:
        cancel()
    wait_until(lambda: threading.active_count() <= before, 10, "the watch threads ending")
    meta.close()


def test_a_wall_clock_step_back_does_not_make_etcd_unusable(store: MetaStore) -> None:
    """etcd3 refuses an endpoint it marked failed until time_retry has passed by the wall
    clock; after the clock stepped back (NTP, a resumed VM) every call raised a raw
    ValueError('Trying to use a failed node'), and a lease keeper's thread died on it
    without reporting its lease lost (found by an audit). The store's endpoint is never
    refused: gRPC's reconnect backoff is the retry policy."""
    store.put("k", b"v")
    for client in store._clients:
        endpoint = client.endpoint_in_use
        # What etcd3 does on an UNAVAILABLE answer (_manage_grpc_errors), then the step.
        endpoint.fail()
        client._clear_old_stubs()
        endpoint.last_failed = time.time() + 3600  # as if the clock went an hour back
    got = store.get("k")
    assert got is not None and got.value == b"v"


# ------------------------------------------------------------------ unavailability


def test_unreachable_etcd_raises_within_deadline(private_etcd: EtcdProcess) -> None:
    meta = MetaStore(private_etcd.endpoint, cluster="down", timeout_s=1.0)
    meta.put("k", b"v")
    lease = meta.grant_lease(5)
    watch_errors: list[MetaStoreError] = []
    cancel = meta.watch_prefix("", lambda e: None, on_error=watch_errors.append)
    private_etcd.kill()

    operations: list[tuple[str, Callable[[], object]]] = [
        ("get", lambda: meta.get("k")),
        ("get_prefix", lambda: meta.get_prefix("")),
        ("put", lambda: meta.put("k", b"v2")),
        ("delete", lambda: meta.delete("k")),
        ("create_if_absent", lambda: meta.create_if_absent("n", b"v")),
        ("compare_and_swap", lambda: meta.compare_and_swap("k", 1, b"v")),
        ("grant_lease", lambda: meta.grant_lease(2)),
        ("refresh", lease.refresh),
        ("current_revision", meta.current_revision),
    ]
    for name, operation in operations:
        started = time.monotonic()
        with pytest.raises(MetaStoreUnavailableError) as excinfo:
            operation()
        elapsed = time.monotonic() - started
        assert elapsed < 1.0 + 1.5, f"{name} took {elapsed:.2f} s"
        assert private_etcd.endpoint in str(excinfo.value)
        assert isinstance(excinfo.value, BrokerNotAvailableError)
        assert excinfo.value.retriable

    # The live watch hears about it (the caller then re-reads and re-watches).
    wait_until(lambda: len(watch_errors) == 1, 5, "the watch error report")
    assert isinstance(watch_errors[0], MetaStoreUnavailableError)
    started = time.monotonic()
    with pytest.raises(MetaStoreUnavailableError):
        meta.watch_prefix("", lambda e: None, on_error=lambda e: None)
    assert time.monotonic() - started < 2.5
    cancel()

    # A fresh store, whose first connection attempt is refused, behaves the same.
    with (
        MetaStore(private_etcd.endpoint, cluster="down", timeout_s=0.5) as fresh,
        pytest.raises(MetaStoreUnavailableError),
    ):
        fresh.get("k")

    # And once etcd is back, the same store works again without being rebuilt.
    private_etcd.start()
    wait_until(lambda: _answers(meta), 10, "the store to reconnect")
    got = meta.get("k")
    assert got is not None and got.value == b"v"
    meta.close()


def test_hung_etcd_hits_the_deadline(private_etcd: EtcdProcess) -> None:
    meta = MetaStore(private_etcd.endpoint, cluster="hung", timeout_s=0.5)
    meta.put("k", b"v")
    private_etcd.pause()  # sockets stay open, nothing answers
    try:
        started = time.monotonic()
        with pytest.raises(MetaStoreUnavailableError):
            meta.get("k")
        assert time.monotonic() - started < 2.0
    finally:
        private_etcd.resume()
    wait_until(lambda: _answers(meta), 10, "the store to answer after SIGCONT")
    meta.close()


def test_failover_to_a_live_endpoint(private_etcd: EtcdProcess) -> None:
    # The first endpoint never answers; after one failure the store moves on.
    dead = "http://127.0.0.1:1"
    meta = MetaStore(f"{dead},{private_etcd.endpoint}", cluster="fo", timeout_s=1.0)
    outcomes = []
    for _ in range(2):
        try:
            meta.put("k", b"v")
            outcomes.append("ok")
        except MetaStoreUnavailableError:
            outcomes.append("unavailable")
    assert "ok" in outcomes
    assert meta.get("k") is not None
    meta.close()


def test_a_watch_on_a_member_without_a_leader_fails_instead_of_going_silent(
    tmp_path: Path,
) -> None:
    """In a 3-member etcd, the member a watch is on loses the other two (stopped here; a
    network partition does the same while they keep a quorum and delete expired keys).
    Without etcd's "hasleader" metadata the watch stayed open and told nothing, so a
    controller never heard of brokers dying; now it is cancelled and on_error runs (the
    owners re-read and watch again)."""
    ports = [(free_port(), free_port()) for _ in range(3)]
    members = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
    binary = find_etcd_binary()
    processes = []
    try:
        for i, (client, peer) in enumerate(ports):
            log = (tmp_path / f"m{i}.log").open("wb")
            processes.append(
                subprocess.Popen(
                    [
                        binary,
                        f"--name=m{i}",
                        f"--data-dir={tmp_path / f'm{i}'}",
                        f"--listen-client-urls=http://127.0.0.1:{client}",
                        f"--advertise-client-urls=http://127.0.0.1:{client}",
                        f"--listen-peer-urls=http://127.0.0.1:{peer}",
                        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                        f"--initial-cluster={members}",
                        "--initial-cluster-state=new",
                        "--heartbeat-interval=20",
                        "--election-timeout=200",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        with MetaStore(f"127.0.0.1:{ports[0][0]}", cluster="leaderless", timeout_s=3.0) as meta:

            def answers() -> bool:
                try:
                    meta.current_revision()
                except Exception:
                    return False
                return True

            wait_until(answers, 30, "the 3-member etcd to answer")
            errors: list[Exception] = []
            meta.watch_prefix("brokers/", lambda event: None, on_error=errors.append)
            for process in processes[1:]:
                os.kill(process.pid, signal.SIGSTOP)
            wait_until(lambda: bool(errors), 30, "the watch to fail on a member without leader")
    finally:
        for process in processes:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
            process.wait()


def test_a_request_etcd_refuses_for_its_size_is_a_final_error_and_changes_nothing(
    store: MetaStore,
) -> None:
    """More operations than --max-txn-ops, or more bytes than etcd takes in one request:
    refused whole, so the outcome is known and retrying cannot help. It used to be a
    retriable BROKER_NOT_AVAILABLE, retried by clients for ever, and taken by the
    controller for an unknown outcome (a full re-read each time; found by an audit)."""
    too_many = [PutOp(f"many/{i}", b"x") for i in range(5_000)]  # the limit is 4,096
    too_big = [PutOp(f"big/{i}", b"x" * 200_000) for i in range(10)]  # 2 MB
    for ops in (too_many, too_big):
        with pytest.raises(MetaStoreRequestTooLargeError) as refused:
            store.txn([], ops)
        assert not refused.value.retriable
        assert "too large for one etcd request" in str(refused.value)
    assert store.get_prefix("many/") == [] and store.get_prefix("big/") == []


def test_a_watch_from_a_compacted_revision_reports_it(private_etcd: EtcdProcess) -> None:
    """A watch from a compacted revision reports WatchCompactedError with etcd's compact
    revision and delivers nothing (checked by an audit; a regression test)."""
    etcd = private_etcd
    with MetaStore(etcd.endpoint, cluster="w", timeout_s=3.0) as meta:
        first = meta.put("k/a", b"1")
        for i in range(5):
            meta.put("k/a", str(i).encode())
        current = meta.current_revision()
        raw = etcd3.client("127.0.0.1", etcd.client_port)
        raw.compact(current, physical=True)
        errors: list[MetaStoreError] = []
        done = threading.Event()
        events: list[WatchEvent] = []

        def on_error(error: MetaStoreError) -> None:
            errors.append(error)
            done.set()

        try:
            cancel = meta.watch_prefix("k/", events.append, on_error=on_error, start_revision=first)
        except WatchCompactedError as exc:
            errors.append(exc)
            done.set()
            cancel = None
        assert done.wait(5), "no report of the compacted revision"
        assert isinstance(errors[0], WatchCompactedError), errors
        assert errors[0].compact_revision == current
        assert events == []
        if cancel:
            cancel()
        raw.close()


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_watch_reports_etcd_going_away_and_a_new_one_resumes_exactly(
    private_etcd: EtcdProcess, how: str
) -> None:
    """etcd killed (or stopped) under a watch: the watch reports it unavailable, and one
    made after the restart from the last revision seen gets every later event once
    (checked by an audit; a regression test)."""
    etcd = private_etcd
    with MetaStore(etcd.endpoint, cluster="w", timeout_s=2.0) as meta:
        meta.put("k/a", b"0")
        _, revision = meta.get_prefix_with_revision("k/")
        errors: list[MetaStoreError] = []
        failed = threading.Event()
        seen: list[WatchEvent] = []

        def on_error(error: MetaStoreError) -> None:
            errors.append(error)
            failed.set()

        meta.watch_prefix("k/", seen.append, on_error=on_error, start_revision=revision + 1)
        meta.put("k/a", b"1")
        time.sleep(0.3)
        if how == "kill":
            etcd.kill()
        else:
            etcd.stop()
        assert failed.wait(10), "the watch did not report etcd going away"
        assert isinstance(errors[0], MetaStoreUnavailableError), errors
        etcd.start()
        # After the restart: write, then re-read and re-watch from the last seen revision.
        deadline = time.monotonic() + 10
        while True:
            try:
                meta.put("k/a", b"2")
                break
            except MetaStoreError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        last = seen[-1].mod_revision
        again: list[WatchEvent] = []
        cancel = meta.watch_prefix("k/", again.append, on_error=on_error, start_revision=last + 1)
        meta.put("k/a", b"3")
        deadline = time.monotonic() + 5
        while len(again) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        cancel()
        assert [e.value for e in seen] == [b"1"]
        assert [e.value for e in again] == [b"2", b"3"]
