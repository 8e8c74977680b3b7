"""Topic ids on disk (``partition.metadata``) and stray logs of deleted topic incarnations.

The pure rules (``services/storage/strays.py``), the file format, and the replica manager
over real files: a restarted broker deletes its logs of a deleted incarnation when a
LeaderAndIsr names another topic id or an UpdateMetadata view leaves the topic out, and
never serves them as the new topic's. Crash tests kill -9 a process while it writes the
file or deletes a stray, and start a broker on what is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from services.storage.log import LogConfig
from services.storage.log.errors import PartitionMetadataCorruptError
from services.storage.log.partition_metadata import (
    PARTITION_METADATA_FILE,
    decode_partition_metadata,
    encode_partition_metadata,
    read_topic_id,
    write_topic_id,
)
from services.storage.log_manager import LogManager
from services.storage.meta_properties import (
    META_PROPERTIES_FILE,
    DataDirIdentityError,
    MetaProperties,
    check_identity,
    decode_meta_properties,
    read_meta_properties,
    write_meta_properties,
)
from services.storage.partition import PartitionState
from services.storage.server import ClusterMetadata, ReplicaManager, StopReplicaItem
from services.storage.strays import (
    TopicIdVerdict,
    leader_and_isr_verdict,
    stop_replica_deletes,
    strays_in_view,
)
from tests.support.process import StartStorage
from tidelog.errors import ErrorCode, InconsistentTopicIdError
from tidelog.records import decode_batches, encode_batch
from tidelog.v1 import common_pb2, storage_pb2

OLD = "0" * 31 + "1"
NEW = "0" * 31 + "2"
ROOT = Path(__file__).resolve().parents[1]

# --- the file format ------------------------------------------------------------------------


def test_the_file_is_kafkas_partition_metadata_text(tmp_path: Path) -> None:
    assert encode_partition_metadata(OLD) == f"version: 0\ntopic_id: {OLD}\n".encode()
    assert decode_partition_metadata(encode_partition_metadata(OLD)) == OLD
    assert read_topic_id(tmp_path) == ""  # no file: a log made by older code
    write_topic_id(tmp_path, NEW)
    assert read_topic_id(tmp_path) == NEW
    assert sorted(p.name for p in tmp_path.iterdir()) == [PARTITION_METADATA_FILE]


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"version: 0\n",
        b"version: 1\ntopic_id: abc\n",
        b"version: 0\ntopic_id: \n",
        b"version: 0\ntopic_id: a b\n",
        b"version: 0\ntopic_id: abc",
        b"version: 0\ntopic_id: abc\nextra\n",
        b"version: 0\ntopic_id: \xff\n",
        b"version: 0\ntopic_id: " + b"a" * 300 + b"\n",
    ],
)
def test_a_damaged_file_is_refused_not_guessed(tmp_path: Path, content: bytes) -> None:
    (tmp_path / PARTITION_METADATA_FILE).write_bytes(content)
    with pytest.raises(PartitionMetadataCorruptError):
        read_topic_id(tmp_path)


@pytest.mark.parametrize("bad", ["", "a b", "a\nb", "x" * 65, "é"])
def test_only_well_formed_ids_are_written(bad: str) -> None:
    with pytest.raises(ValueError):
        encode_partition_metadata(bad)


# --- the pure rules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("on_disk", "named", "confirmed", "verdict"),
    [
        (OLD, OLD, False, TopicIdVerdict.SAME),
        (OLD, "", False, TopicIdVerdict.SAME),  # an older controller names none
        ("", NEW, False, TopicIdVerdict.ADOPT),  # a log from before the file existed
        ("", NEW, True, TopicIdVerdict.ADOPT),
        (OLD, NEW, False, TopicIdVerdict.STRAY),
        (OLD, NEW, True, TopicIdVerdict.REFUSE),  # an overtaken request of this epoch
    ],
)
def test_leader_and_isr_verdicts(
    on_disk: str, named: str, confirmed: bool, verdict: TopicIdVerdict
) -> None:
    assert leader_and_isr_verdict(on_disk=on_disk, named=named, confirmed=confirmed) is verdict


def test_stop_replica_never_deletes_another_incarnations_log() -> None:
    assert stop_replica_deletes(on_disk=OLD, named=OLD)
    assert stop_replica_deletes(on_disk=OLD, named="")
    assert stop_replica_deletes(on_disk="", named=OLD)
    assert not stop_replica_deletes(on_disk=NEW, named=OLD)


def test_strays_in_a_view() -> None:
    on_disk = {("a", 0): OLD, ("b", 0): OLD, ("c", 0): OLD, ("d", 0): "", ("e", 0): OLD}
    view = {"a": OLD, "b": NEW, "e": ""}  # c: deleted; d: no id on disk; e: no id known
    assert strays_in_view(on_disk, frozenset(), view) == [("b", 0), ("c", 0)]
    assert strays_in_view(on_disk, frozenset({("c", 0)}), view) == [("b", 0)]
    assert strays_in_view(on_disk, frozenset(), {}) == [("a", 0), ("b", 0), ("c", 0), ("e", 0)]


# --- the replica manager over real files ----------------------------------------------------


def _state(
    topic_id: str, *, topic: str = "t", leader_epoch: int = 0, replicas: tuple[int, ...] = (1,)
) -> PartitionState:
    return PartitionState(
        topic=topic,
        partition=0,
        leader=1,
        leader_epoch=leader_epoch,
        isr=replicas,
        replicas=replicas,
        partition_epoch=0,
        topic_id=topic_id,
    )


def _manager(
    data_dir: Path, broker_epoch: int = 10, config: LogConfig | None = None
) -> ReplicaManager:
    config = config or LogConfig(flush_messages=1)
    manager = ReplicaManager(LogManager(data_dir, config), broker_id=1)
    manager.startup()
    manager.set_broker_epoch(broker_epoch)
    return manager


def _lead(manager: ReplicaManager, state: PartitionState) -> list[ErrorCode]:
    outcomes = manager.apply_leader_and_isr(1, [state], broker_epoch=manager.broker_epoch)
    return [ErrorCode.NONE if e is None else e.code for e in outcomes]


def _values(manager: ReplicaManager, topic: str = "t") -> list[bytes | None]:
    partition = manager.get_partition(topic, 0)
    data = partition.read(0, 1 << 20).records
    return [r.value for batch in decode_batches(data) for r in batch.records]


def _with_old_incarnation(data_dir: Path) -> None:
    """A broker that hosted incarnation OLD of t-0, with records, and stopped."""
    manager = _manager(data_dir, broker_epoch=5)
    assert _lead(manager, _state(OLD, leader_epoch=3)) == [ErrorCode.NONE]
    manager.get_partition("t", 0).append(encode_batch([b"old-1", b"old-2"]))
    assert read_topic_id(data_dir / "t-0") == OLD
    manager.shutdown()


def test_a_log_is_created_with_its_topic_id_on_disk(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    assert _lead(manager, _state(NEW)) == [ErrorCode.NONE]
    assert (tmp_path / "t-0" / PARTITION_METADATA_FILE).read_text() == (
        f"version: 0\ntopic_id: {NEW}\n"
    )
    manager.shutdown()
    restarted = _manager(tmp_path)
    assert restarted.get_partition("t", 0).topic_id == NEW  # known before any request
    restarted.shutdown()


def test_a_leader_and_isr_naming_a_new_incarnation_deletes_the_stray_log(tmp_path: Path) -> None:
    _with_old_incarnation(tmp_path)
    manager = _manager(tmp_path)
    # The new incarnation starts at leader epoch 0, below the old log's 3: not fenced.
    assert _lead(manager, _state(NEW)) == [ErrorCode.NONE]
    partition = manager.get_partition("t", 0)
    assert partition.topic_id == NEW
    assert _values(manager) == []  # fresh and empty: nothing of the old incarnation
    assert read_topic_id(tmp_path / "t-0") == NEW
    assert not list(tmp_path.glob("*-delete"))
    partition.append(encode_batch([b"new"]))
    assert _values(manager) == [b"new"]
    manager.shutdown()


def test_an_overtaken_request_naming_another_id_is_refused_not_obeyed(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    assert _lead(manager, _state(NEW)) == [ErrorCode.NONE]
    manager.get_partition("t", 0).append(encode_batch([b"new"]))
    # This incarnation of the broker was already told t is NEW: an OLD request is stale.
    assert _lead(manager, _state(OLD, leader_epoch=1)) == [ErrorCode.INCONSISTENT_TOPIC_ID]
    assert _values(manager) == [b"new"]
    # A new registration (broker epoch) makes the next request authoritative again.
    manager.set_broker_epoch(11)
    assert _lead(manager, _state(OLD, leader_epoch=1)) == [ErrorCode.NONE]
    assert _values(manager) == []
    manager.shutdown()


def test_a_view_without_the_topic_or_with_another_id_deletes_unconfirmed_strays(
    tmp_path: Path,
) -> None:
    _with_old_incarnation(tmp_path)
    manager = _manager(tmp_path)
    _lead(manager, _state(OLD, topic="kept"))  # named by this epoch: confirmed
    view = ClusterMetadata(controller_epoch=1, metadata_version=1, topic_ids={"t": NEW})
    manager.update_metadata(1, manager.broker_epoch, view)
    assert not (tmp_path / "t-0").exists()
    assert (tmp_path / "kept-0").exists()  # confirmed logs are never judged by a view
    with pytest.raises(Exception, match="does not host"):
        manager.get_partition("t", 0)
    manager.shutdown()


def test_a_view_without_topic_ids_judges_nothing(tmp_path: Path) -> None:
    _with_old_incarnation(tmp_path)
    manager = _manager(tmp_path)
    manager.update_metadata(1, manager.broker_epoch, ClusterMetadata(controller_epoch=1))
    assert read_topic_id(tmp_path / "t-0") == OLD
    manager.shutdown()


def test_a_log_without_an_id_adopts_the_first_one_named(tmp_path: Path) -> None:
    _with_old_incarnation(tmp_path)
    (tmp_path / "t-0" / PARTITION_METADATA_FILE).unlink()  # as older code left it
    manager = _manager(tmp_path)
    assert manager.get_partition("t", 0).topic_id == ""
    view = ClusterMetadata(controller_epoch=1, metadata_version=1, topic_ids={})
    manager.update_metadata(1, manager.broker_epoch, view)
    assert (tmp_path / "t-0").exists()  # no id: never taken for a stray
    assert _lead(manager, _state(NEW, leader_epoch=4)) == [ErrorCode.NONE]
    assert read_topic_id(tmp_path / "t-0") == NEW
    assert _values(manager) == [b"old-1", b"old-2"]  # adopted, as Kafka adopts
    manager.shutdown()


def test_stop_replica_for_the_old_incarnation_spares_the_new_ones_log(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    _lead(manager, _state(NEW))
    manager.get_partition("t", 0).append(encode_batch([b"new"]))
    stop = StopReplicaItem("t", 0, -1, True, OLD)
    assert manager.stop_replicas(1, [stop], broker_epoch=manager.broker_epoch) == [None]
    assert _values(manager) == [b"new"]
    stop = StopReplicaItem("t", 0, -1, True, NEW)
    assert manager.stop_replicas(1, [stop], broker_epoch=manager.broker_epoch) == [None]
    assert not (tmp_path / "t-0").exists()
    manager.shutdown()


def test_a_recreated_topics_log_does_not_inherit_the_deleted_ones_high_watermark(
    tmp_path: Path,
) -> None:
    """The HW checkpoint (replication-offset-checkpoint, no topic ids) kept the deleted
    incarnation's HW until the next periodic write (5 s): a crash in between gave the new
    incarnation's log that HW at restart (clamped to its log end), so records no follower
    had, never acknowledged to acks=all, were served to consumers as committed (found by
    an audit). A "crash" here is the manager abandoned without shutdown(): checkpoint
    writes are synchronous, so the files are as kill -9 leaves them."""
    manager = _manager(tmp_path)
    assert _lead(manager, _state(OLD)) == [ErrorCode.NONE]
    manager.get_partition("t", 0).append(encode_batch([b"old-%d" % i for i in range(10)]))
    assert manager.get_partition("t", 0).high_watermark == 10
    manager.maintenance(checkpoint=True)
    stop = StopReplicaItem("t", 0, -1, True, OLD)
    assert manager.stop_replicas(1, [stop], broker_epoch=manager.broker_epoch) == [None]
    # Created again with a follower, 2, that has fetched nothing: nothing is committed.
    assert _lead(manager, _state(NEW, replicas=(1, 2))) == [ErrorCode.NONE]
    manager.get_partition("t", 0).append(encode_batch([b"new-1", b"new-2", b"new-3"]))
    assert manager.get_partition("t", 0).high_watermark == 0
    restarted = _manager(tmp_path, broker_epoch=20)
    assert _lead(restarted, _state(NEW, replicas=(1, 2), leader_epoch=1)) == [ErrorCode.NONE]
    assert restarted.get_partition("t", 0).high_watermark == 0
    assert _values(restarted) == []
    restarted.shutdown()


def test_kill_9_right_after_a_topic_is_re_created_serves_nothing_uncommitted(
    start_storage: StartStorage, tmp_path: Path
) -> None:
    """The same with a real storage node killed -9 within the checkpoint interval."""
    node = start_storage()
    _rpc_lead(node.stub, OLD, replicas=[1], epoch=0)
    for _ in range(10):
        node.stub.Append(
            storage_pb2.AppendRequest(topic="t", partition=0, records=encode_batch([b"old"])),
            timeout=RPC_TIMEOUT_S,
        )
    checkpoint = tmp_path / "data" / "replication-offset-checkpoint"
    deadline = time.monotonic() + 15
    while "t 0 10" not in (checkpoint.read_text() if checkpoint.exists() else ""):
        assert time.monotonic() < deadline, "no HW checkpoint written"
        time.sleep(0.1)
    node.stub.StopReplica(
        storage_pb2.StopReplicaRequest(
            controller_epoch=1,
            partitions=[
                storage_pb2.StopReplicaPartition(
                    topic="t", partition=0, leader_epoch=-1, delete_partition=True, topic_id=OLD
                )
            ],
        ),
        timeout=RPC_TIMEOUT_S,
    )
    _rpc_lead(node.stub, NEW, replicas=[1, 2], epoch=0)  # follower 2 has fetched nothing
    node.stub.Append(
        storage_pb2.AppendRequest(
            topic="t", partition=0, records=encode_batch([b"n1", b"n2", b"n3"]),
            acks=common_pb2.LEADER,
        ),
        timeout=RPC_TIMEOUT_S,
    )  # fmt: skip
    assert _rpc_consume(node.stub) == (0, [])
    node.kill()
    node = start_storage()
    _rpc_lead(node.stub, NEW, replicas=[1, 2], epoch=1)
    assert _rpc_consume(node.stub) == (0, [])
    assert node.terminate() == 0


RPC_TIMEOUT_S = 10.0


def _rpc_lead(stub: Any, topic_id: str, *, replicas: list[int], epoch: int) -> None:
    state = common_pb2.PartitionState(
        topic="t", partition=0, leader=1, leader_epoch=epoch, isr=replicas, replicas=replicas,
        partition_epoch=epoch,
    )  # fmt: skip
    response = stub.LeaderAndIsr(
        storage_pb2.LeaderAndIsrRequest(
            controller_id=0,
            controller_epoch=1,
            partitions=[
                storage_pb2.LeaderAndIsrPartition(state=state, is_new=True, topic_id=topic_id)
            ],
        ),
        timeout=RPC_TIMEOUT_S,
    )
    assert [p.error.code for p in response.partitions] == [0], response


def _rpc_consume(stub: Any) -> tuple[int, list[bytes | None]]:
    response = stub.Fetch(
        storage_pb2.FetchRequest(
            replica_id=-1,
            partitions=[storage_pb2.FetchPartition(topic="t", partition=0, fetch_offset=0)],
        ),
        timeout=RPC_TIMEOUT_S,
    )
    (result,) = response.partitions
    assert result.error.code == 0, result.error
    values = [r.value for b in decode_batches(result.records) for r in b.records]
    return result.high_watermark, values


def test_a_damaged_partition_metadata_stops_the_start_up(tmp_path: Path) -> None:
    _with_old_incarnation(tmp_path)
    (tmp_path / "t-0" / PARTITION_METADATA_FILE).write_bytes(b"garbage")
    with pytest.raises(PartitionMetadataCorruptError):
        _manager(tmp_path)
    assert (tmp_path / "t-0").exists()  # nothing was changed or deleted


def test_inconsistent_topic_id_is_the_data_paths_code() -> None:
    assert InconsistentTopicIdError("x").code is ErrorCode.INCONSISTENT_TOPIC_ID


# --- kill -9 in the middle ------------------------------------------------------------------

_WRITER = """
import sys
from pathlib import Path
from services.storage.log.partition_metadata import write_topic_id
log_dir = Path(sys.argv[1])
ids = [sys.argv[2], sys.argv[3]]
print("ready", flush=True)
i = 0
while True:
    write_topic_id(log_dir, ids[i % 2])
    i += 1
"""

_DELETER = """
import sys
from pathlib import Path
from services.storage.log import LogConfig
from services.storage.log_manager import LogManager
from services.storage.server import ClusterMetadata, ReplicaManager
manager = ReplicaManager(LogManager(Path(sys.argv[1]), LogConfig()), broker_id=1)
manager.startup()
manager.set_broker_epoch(99)
print("ready", flush=True)
sys.stdin.readline()
view = ClusterMetadata(controller_epoch=1, metadata_version=1, topic_ids={"t": sys.argv[2]})
manager.update_metadata(1, 99, view)
print("done", flush=True)
"""


def _spawn(script: str, *args: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    for line in process.stdout:  # the log lines (structlog writes to stdout) come first
        if line.strip() == "ready":
            return process
    raise AssertionError(f"the child process ended before it was ready: {process.wait()}")


@pytest.mark.parametrize("delay_s", [0.0, 0.003, 0.01, 0.03])
def test_kill_9_while_writing_partition_metadata_leaves_one_id_or_the_other(
    tmp_path: Path, delay_s: float
) -> None:
    _with_old_incarnation(tmp_path)
    writer = _spawn(_WRITER, str(tmp_path / "t-0"), OLD, NEW)
    time.sleep(delay_s)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    manager = _manager(tmp_path)  # starts: the file is whole, a .tmp is debris
    assert manager.get_partition("t", 0).topic_id in (OLD, NEW)
    assert not list((tmp_path / "t-0").glob("*.tmp"))
    manager.shutdown()


@pytest.mark.parametrize("delay_s", [0.0, 0.005, 0.02, 0.05, 0.2])
def test_kill_9_while_deleting_a_stray_leaves_a_state_the_broker_starts_from(
    tmp_path: Path, delay_s: float
) -> None:
    _with_old_incarnation(tmp_path)
    # Many segments (three files each): the removal takes a while.
    manager = _manager(tmp_path, broker_epoch=6, config=LogConfig(segment_bytes=16 * 1024))
    _lead(manager, _state(OLD, leader_epoch=4))
    partition = manager.get_partition("t", 0)
    for _ in range(300):
        partition.append(encode_batch([b"x" * 2000] * 10))
    manager.shutdown()
    deleter = _spawn(_DELETER, str(tmp_path), NEW)
    assert deleter.stdin is not None and deleter.stdout is not None
    deleter.stdin.write("go\n")
    deleter.stdin.flush()
    time.sleep(delay_s)
    deleter.send_signal(signal.SIGKILL)
    deleter.wait()
    manager = _manager(tmp_path)
    # Either the stray is still whole (killed before the rename) and still a stray, or
    # it is gone; a half-removed *-delete directory was finished by the start-up.
    assert not list(tmp_path.glob("*-delete"))
    if (tmp_path / "t-0").exists():
        assert read_topic_id(tmp_path / "t-0") == OLD
    assert _lead(manager, _state(NEW)) == [ErrorCode.NONE]
    assert _values(manager) == []
    manager.shutdown()


# --- meta.properties: whose data directory this is -------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"version=1\nbroker.id=1\n",
        b"version=0\n",
        b"version=0\nbroker.id=one\n",
        b"version=0\nbroker.id=1\nbroker.id=2\n",
        b"version=0\nbroker.id=1\ncluster.id=a b\n",
        b"version=0\nbroker.id=1\nno equals sign\n",
        b"version=0\nbroker.id=\xff\n",
        b"version=0\nbroker.id=1\n#" + b"x" * 2000 + b"\n",
    ],
)
def test_a_damaged_meta_properties_is_refused_not_guessed(tmp_path: Path, content: bytes) -> None:
    (tmp_path / META_PROPERTIES_FILE).write_bytes(content)
    with pytest.raises(DataDirIdentityError):
        read_meta_properties(tmp_path)


def test_meta_properties_round_trip_and_identity_rules(tmp_path: Path) -> None:
    assert read_meta_properties(tmp_path) is None
    write_meta_properties(tmp_path, MetaProperties(3, "abc"))
    # Kafka's own file (a date comment, any key order) reads the same.
    assert read_meta_properties(tmp_path) == MetaProperties(3, "abc")
    kafka = b"#\n#Thu Nov 26 12:00:00 UTC 2026\ncluster.id=abc\nversion=0\nbroker.id=3\n"
    assert decode_meta_properties(kafka) == MetaProperties(3, "abc")
    found = MetaProperties(3, "")
    assert check_identity(None, broker_id=3, cluster_id="c", data_dir=tmp_path) == MetaProperties(
        3, "c"
    )
    assert check_identity(found, broker_id=3, cluster_id="c", data_dir=tmp_path).cluster_id == "c"
    kept = check_identity(MetaProperties(3, "c"), broker_id=3, cluster_id="", data_dir=tmp_path)
    assert kept == MetaProperties(3, "c")  # a node started outside a cluster keeps it
    with pytest.raises(DataDirIdentityError, match="belongs to broker 3"):
        check_identity(found, broker_id=4, cluster_id="c", data_dir=tmp_path)
    with pytest.raises(DataDirIdentityError, match="belongs to cluster c"):
        check_identity(MetaProperties(3, "c"), broker_id=3, cluster_id="d", data_dir=tmp_path)
