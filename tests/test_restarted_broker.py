"""A storage node restarted after a kill -9 while its previous incarnation is still
registered: the durability side of the registration wait (the node side, every controller
request refused until it registers, is in ``test_storage_membership.py``).

Broker 0 leads t-0 (ISR 0,1,2, min.insync.replicas 2) with 1,000 records acknowledged with
acks=all. It is killed, its segment gets a torn tail (a fault RELIABILITY.md promises to
survive), and an AlterConfigs of the topic while it is down leaves "0 leads t-0 at epoch 0"
in the controller's mailbox for it. Restarted on the same address, it waits up to a TTL for
the old lease; it used to take that request meanwhile and lead with its short log, and the
followers, still following 0 at epoch 0, truncated to it: once the old lease expired broker
1 led with half the acknowledged records gone (found by an audit). Kafka serves no
controller request before the broker has registered (KIP-380); neither does tidelog now.

A TTL of 8 s: the window is the registration wait, and with shorter ones the old code
lost nothing in this schedule (the controller's sender had not retried within it).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import grpc

from services.cluster_metadata import broker_key
from tests.support.cluster import TestCluster, error_code, wait_for
from tests.support.fuzz import valid_batch
from tidelog.errors import ErrorCode
from tidelog.etcd_launcher import free_port
from tidelog.records import decode_batches, encode_batch
from tidelog.v1 import common_pb2, controller_pb2, storage_pb2

TOPIC = "t"
TTL_S = 8


def _state(cluster: TestCluster) -> common_pb2.PartitionState:
    (state,) = cluster.partitions(TOPIC)
    return state


def _describe(cluster: TestCluster, broker_id: int) -> storage_pb2.LogDescription | None:
    response = cluster.brokers[broker_id].stub.DescribeLogDirs(
        storage_pb2.DescribeLogDirsRequest(), timeout=10
    )
    for p in response.log_dirs[0].partitions:
        if p.topic == TOPIC:
            return p
    return None


def _read_all(cluster: TestCluster, broker_id: int) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    offset = 0
    while True:
        response = cluster.brokers[broker_id].stub.Fetch(
            storage_pb2.FetchRequest(
                replica_id=-1,
                max_wait_ms=0,
                partitions=[
                    storage_pb2.FetchPartition(topic=TOPIC, partition=0, fetch_offset=offset)
                ],
            ),
            timeout=10,
        )
        (result,) = response.partitions
        assert error_code(result.error) == ErrorCode.NONE, result
        got = [
            (r.offset, bytes(r.value or b""))
            for b in decode_batches(bytes(result.records))
            for r in b.records
        ]
        if not got:
            return out
        out.update(got)
        offset = got[-1][0] + 1


def test_a_restarted_broker_takes_no_role_meant_for_its_previous_incarnation(
    tmp_path: Path,
) -> None:
    port = free_port()
    cluster = TestCluster(
        tmp_path,
        session_ttl_s=TTL_S,
        storage_args=["--replica-lag-time-max-ms", "60000"],
    )
    try:
        fixed = ["--listen", f"127.0.0.1:{port}"]
        cluster.storage_args = [*cluster.storage_args, *fixed]
        cluster.start_broker(0)
        cluster.storage_args = cluster.storage_args[: -len(fixed)]
        cluster.start_broker(1)
        cluster.start_broker(2)
        cluster.start_controller(1)
        cluster.wait_brokers([0, 1, 2])

        response = cluster.api.CreateTopics(
            controller_pb2.CreateTopicsRequest(
                topics=[
                    controller_pb2.CreatableTopic(
                        name=TOPIC,
                        assignments=[
                            controller_pb2.ReplicaAssignment(partition=0, broker_ids=[0, 1, 2])
                        ],
                        configs=[common_pb2.ConfigEntry(name="min.insync.replicas", value="2")],
                    )
                ],
                timeout_ms=10_000,
            ),
            timeout=20,
        )
        assert error_code(response.topics[0].error) == ErrorCode.NONE, response
        wait_for(lambda: len(_state(cluster).isr) == 3 and _state(cluster).leader == 0, 15, "ISR")

        acknowledged: dict[int, bytes] = {}
        for i in range(10):
            values = [f"r{i}-{j}".encode() * 4 for j in range(100)]
            reply = cluster.brokers[0].stub.Append(
                storage_pb2.AppendRequest(
                    topic=TOPIC,
                    partition=0,
                    records=encode_batch(values),
                    acks=common_pb2.ALL,
                    timeout_ms=5_000,
                ),
                timeout=10,
            )
            assert error_code(reply.error) == ErrorCode.NONE, reply
            for k, v in enumerate(values):
                acknowledged[reply.base_offset + k] = v
        assert len(acknowledged) == 1000

        def settled() -> bool:
            for b in (0, 1, 2):
                d = _describe(cluster, b)
                if d is None or (d.log_end_offset, d.high_watermark) != (1000, 1000):
                    return False
            return True

        wait_for(settled, 15, "every replica at HW = LEO = 1000")

        # Broker 0 dies; its newest segment is cut mid-batch (torn tail).
        cluster.brokers[0].kill()
        (segment,) = sorted((cluster.data_dir(0) / f"{TOPIC}-0").glob("*.log"))
        size = segment.stat().st_size
        with open(segment, "r+b") as f:
            f.truncate(size // 2 + 7)

        # While it is down (but still registered), the topic's config changes: the
        # controller pushes t-0's unchanged state, "0 leads at epoch 0", to 0, 1 and 2.
        alter = cluster.api.IncrementalAlterConfigs(
            controller_pb2.IncrementalAlterConfigsRequest(
                topics=[
                    controller_pb2.AlterableTopicConfig(
                        name=TOPIC,
                        set=[common_pb2.ConfigEntry(name="retention.ms", value="86400000")],
                    )
                ],
                timeout_ms=500,
            ),
            timeout=10,
        )
        assert error_code(alter.topics[0].error) == ErrorCode.NONE, alter

        # Restart broker 0 on the same port and data dir; it registers only once its
        # previous lease has expired.
        cluster.storage_args = [*cluster.storage_args, *fixed]
        cluster.start_broker(0, wait=False).wait_listening()
        cluster.storage_args = cluster.storage_args[: -len(fixed)]

        # The old lease expires: leadership moves off broker 0; then 0 registers again.
        wait_for(lambda: _state(cluster).leader not in (-1, 0), 3 * TTL_S, "a new leader")
        wait_for(
            lambda: 0 in [b.broker_id for b in cluster.describe_cluster().brokers],
            3 * TTL_S,
            "broker 0 registered again",
        )
        time.sleep(2)  # let replication settle
        leader = _state(cluster).leader
        final = _read_all(cluster, leader)
        lost = {o: v for o, v in acknowledged.items() if final.get(o) != v}
        assert not lost, (
            f"{len(lost)} of {len(acknowledged)} acknowledged records lost on leader {leader} "
            f"(its log now ends at {max(final, default=-1) + 1})"
        )
    except grpc.RpcError:
        print(cluster.logs())
        raise
    finally:
        cluster.close()


WINDOW_TOPIC = "window"


def _window_log(stub: object) -> tuple[int, int]:
    response = stub.DescribeLogDirs(  # type: ignore[attr-defined]
        storage_pb2.DescribeLogDirsRequest(
            partitions=[common_pb2.TopicPartition(topic=WINDOW_TOPIC, partition=0)]
        ),
        timeout=10,
    )
    (d,) = response.log_dirs[0].partitions
    return int(d.high_watermark), int(d.log_end_offset)


def test_a_spoofed_follower_fetch_before_the_first_update_metadata_cannot_move_the_hw(
    tmp_path: Path,
) -> None:
    """The controller sends a (re)registered broker its LeaderAndIsr before its first
    UpdateMetadata. In between, the leader had no broker list, and its follower-epoch
    check was skipped: anyone naming a follower's id with any broker epoch was taken for
    it, and the HW moved over records no follower held (acks=all acknowledged, lost if the
    real follower was then elected). A clustered node now refuses follower fetches until
    it has a broker list (STALE_BROKER_EPOCH; a real follower retries). Made deterministic:
    a registered node and no controller process; the test sends the LeaderAndIsr the
    controller would, and no UpdateMetadata. Found by an audit."""
    with TestCluster(tmp_path, session_ttl_s=10) as cluster:
        node = cluster.start_broker(0)

        def registered_epoch() -> int | None:
            kv = cluster.store.get(broker_key(0))
            if kv is None:
                return None
            epoch = int(json.loads(kv.value).get("broker_epoch", 0))
            return epoch if epoch > 0 else None

        epoch = wait_for(registered_epoch, 15, "broker 0's registration with its epoch")
        stub = node.stub
        # What the controller sends a broker that (re)registered, first: its roles.
        state = common_pb2.PartitionState(
            topic=WINDOW_TOPIC,
            partition=0,
            leader=0,
            leader_epoch=0,
            isr=[0, 1],
            replicas=[0, 1],
            partition_epoch=0,
        )

        def leader_and_isr() -> storage_pb2.LeaderAndIsrResponse | None:
            try:
                return stub.LeaderAndIsr(
                    storage_pb2.LeaderAndIsrRequest(
                        controller_id=1,
                        controller_epoch=1,
                        broker_epoch=epoch,
                        partitions=[
                            storage_pb2.LeaderAndIsrPartition(
                                state=state, is_new=True, topic_id=uuid.uuid4().hex
                            )
                        ],
                    ),
                    timeout=10,
                )
            except grpc.RpcError:
                return None  # the node has not taken its registration epoch yet

        response = wait_for(leader_and_isr, 15, "the LeaderAndIsr to be taken")
        assert [p.error.code for p in response.partitions] == [0], response
        appended = stub.Append(
            storage_pb2.AppendRequest(
                topic=WINDOW_TOPIC, partition=0, records=valid_batch(5), acks=common_pb2.LEADER
            ),
            timeout=10,
        )
        assert appended.error.code == 0, appended
        hw, end = _window_log(stub)
        assert (hw, end) == (0, 5)  # broker 1, in the ISR, has fetched nothing

        # Anyone: "I am broker 1" with a made-up broker epoch, at the leader's log end.
        try:
            stub.Fetch(
                storage_pb2.FetchRequest(
                    replica_id=1,
                    broker_epoch=123_456_789,
                    max_wait_ms=0,
                    partitions=[
                        storage_pb2.FetchPartition(
                            topic=WINDOW_TOPIC, partition=0, fetch_offset=end
                        )
                    ],
                ),
                timeout=10,
            )
            refused = None
        except grpc.RpcError as exc:
            refused = exc.code()
        hw_after, _ = _window_log(stub)
        assert hw_after == hw, (
            f"a follower fetch claiming broker 1 with a made-up epoch was "
            f"{'refused' if refused else 'accepted'} and moved the HW {hw} -> {hw_after} "
            "over records no follower holds"
        )
        assert refused == grpc.StatusCode.FAILED_PRECONDITION  # STALE_BROKER_EPOCH
