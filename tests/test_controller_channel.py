"""The controller's per-broker mailboxes (services/controller/channel.py), against a broker
address nothing listens on: the sender retries while changes keep coming."""

from __future__ import annotations

import socket
import threading
from concurrent import futures
from typing import Any

import grpc

from services.controller.channel import (
    DEFAULT_RPC_TIMEOUT_S,
    MAX_WAITERS_PER_ENTRY,
    PER_PARTITION_TIMEOUT_S,
    Completion,
    ControllerChannelManager,
    PartitionAssignmentState,
)
from services.controller.state import Broker, PartitionRecord
from services.status import to_error_proto
from tests.support.cluster import wait_for
from tidelog.errors import StorageError
from tidelog.v1 import common_pb2, storage_pb2, storage_pb2_grpc


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends


def test_waiters_on_an_unreachable_broker_are_bounded() -> None:
    """Each UpdateMetadata carries on the waiters of the one it replaces. For a registered
    broker that never answers, the list grew with every change the controller made; now
    the oldest beyond MAX_WAITERS_PER_ENTRY are given up, failed. The oldest, whichever
    batch held them: the sender may have had the first ones in flight while the rest were
    queued, and a failed send puts its waiters back before the newer ones."""
    manager = ControllerChannelManager(1, 7, on_stale_controller=lambda error: None)
    broker = Broker(0, "127.0.0.1", _closed_port(), epoch=5)
    manager.add_broker(broker)
    try:
        completions = [Completion() for _ in range(MAX_WAITERS_PER_ENTRY + 40)]
        for completion in completions:
            manager.send_update_metadata([broker], completion)
        given_up = completions[:40]
        # (Any send in flight fails at once: nothing listens on the port.)
        wait_for(lambda: all(c.wait(0) for c in given_up), 10, "the 40 oldest given up")
        assert all(c.errors for c in given_up)
        assert not any(c.wait(0) for c in completions[40:])
    finally:
        manager.shutdown()


class _DeadlineRecorder(storage_pb2_grpc.StorageServicer):
    """A broker's Storage service that only notes how long each LeaderAndIsr had left
    when it arrived, and its request_version, and accepts every partition."""

    def __init__(self) -> None:
        self.remaining_s: list[tuple[int, float]] = []
        self.versions: list[int] = []

    def LeaderAndIsr(  # noqa: N802 - gRPC's method name
        self, request: storage_pb2.LeaderAndIsrRequest, context: grpc.ServicerContext
    ) -> storage_pb2.LeaderAndIsrResponse:
        remaining = context.time_remaining()
        assert remaining is not None
        self.remaining_s.append((len(request.partitions), remaining))
        self.versions.append(request.request_version)
        return storage_pb2.LeaderAndIsrResponse(
            partitions=[
                common_pb2.PartitionResult(topic=p.state.topic, partition=p.state.partition)
                for p in request.partitions
            ]
        )


def test_a_request_naming_many_partitions_gets_a_longer_deadline() -> None:
    """A broker creating a log directory (fsynced) per partition of a 1,000-partition
    LeaderAndIsr took longer than the 5 s deadline, and each retry was answered too late
    again (an audit saw 15 in a row): the deadline grows with the partitions named."""
    recorder = _DeadlineRecorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    storage_pb2_grpc.add_StorageServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    manager = ControllerChannelManager(1, 7, on_stale_controller=lambda error: None)
    broker = Broker(0, "127.0.0.1", port, epoch=5)
    manager.add_broker(broker)
    try:
        for count in (1, 1_000):
            completion = Completion()
            states = [
                PartitionAssignmentState(
                    f"wide-{count}", p, PartitionRecord(0, 0, (0,), 0), replicas=(0,)
                )
                for p in range(count)
            ]
            manager.send_leader_and_isr(0, states, completion)
            assert completion.wait(10) and not completion.errors
        (one, one_left_s), (many, many_left_s) = recorder.remaining_s
        assert (one, many) == (1, 1_000)
        # Far apart, so that the slack of gRPC's deadline header (a CI run saw 5.019 s
        # left of 5.01) does not matter: one partition gets about the default.
        assert one_left_s < DEFAULT_RPC_TIMEOUT_S + 100 * PER_PARTITION_TIMEOUT_S
        assert many_left_s > DEFAULT_RPC_TIMEOUT_S + 900 * PER_PARTITION_TIMEOUT_S
        # Numbered as sent, so a broker can tell a late one from its successor.
        assert 0 < recorder.versions[0] < recorder.versions[1]
    finally:
        manager.shutdown()
        server.stop(None)


class _DiskFullBroker(storage_pb2_grpc.StorageServicer):
    """Creating 'new-topic' fails (ENOSPC) every time; everything else succeeds."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.leader_and_isr_calls = 0
        self.stop_replica_calls: list[list[tuple[str, int]]] = []

    def LeaderAndIsr(self, request: Any, context: Any) -> Any:  # noqa: N802
        with self.lock:
            self.leader_and_isr_calls += 1
        return storage_pb2.LeaderAndIsrResponse(
            partitions=[
                common_pb2.PartitionResult(
                    topic=p.state.topic,
                    partition=p.state.partition,
                    error=to_error_proto(
                        StorageError("No space left on device")
                        if p.state.topic == "new-topic"
                        else None
                    ),
                )
                for p in request.partitions
            ]
        )

    def StopReplica(self, request: Any, context: Any) -> Any:  # noqa: N802
        with self.lock:
            self.stop_replica_calls.append([(p.topic, p.partition) for p in request.partitions])
        return storage_pb2.StopReplicaResponse(
            partitions=[
                common_pb2.PartitionResult(topic=p.topic, partition=p.partition)
                for p in request.partitions
            ]
        )

    def UpdateMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        return storage_pb2.UpdateMetadataResponse()


def test_stop_replica_is_not_starved_by_a_leader_and_isr_that_keeps_failing() -> None:
    """A partition whose LeaderAndIsr keeps failing with STORAGE_ERROR (retried: a full
    disk, a stray file where the log goes) kept the LeaderAndIsr mailbox full, and only
    UpdateMetadata got a turn: every StopReplica(delete) for that broker waited for good,
    the deletion that would free its disk included. After a failed batch the other kinds
    go first now. Scripted broker (the channel is what is tested). Found by an audit."""
    servicer = _DiskFullBroker()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    storage_pb2_grpc.add_StorageServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    acked: list[tuple[int, list[tuple[str, int]]]] = []
    manager = ControllerChannelManager(
        1,
        7,
        on_stale_controller=lambda error: None,
        on_stop_acked=lambda broker_id, parts: acked.append((broker_id, parts)),
    )
    manager.add_broker(Broker(0, "127.0.0.1", port, epoch=5))
    try:
        # The broker's disk is full: the new partition cannot be created (retried).
        manager.send_leader_and_isr(
            0, [PartitionAssignmentState("new-topic", 0, PartitionRecord(0, 0, (0,), 0), (0,))]
        )
        # The operator deletes an old topic to free space.
        deletion = Completion()
        manager.send_stop_replica(
            0, [("old-topic", 0)], delete=True, topic_id="old-id", completion=deletion
        )
        delivered = deletion.wait(15)
        assert delivered and not deletion.errors, "StopReplica(delete) never sent"
        assert acked == [(0, [("old-topic", 0)])]
    finally:
        manager.shutdown()
        server.stop(None)
