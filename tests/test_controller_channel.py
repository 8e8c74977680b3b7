"""The controller's per-broker mailboxes (services/controller/channel.py), against a broker
address nothing listens on: the sender retries while changes keep coming."""

from __future__ import annotations

import socket
from concurrent import futures

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
from tests.support.cluster import wait_for
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
