"""A member's commits stay in order when one of them is given up on by its client: a
commit the gateway finishes after the call's deadline is not written (found by an audit of
consumer groups under faults). Real processes: etcd (paused to be slow), gateways (one
paused), a broker."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import grpc

import tidelog
from tests.support.cluster import running_cluster
from tidelog.errors import ErrorCode
from tidelog.v1 import gateway_pb2, gateway_pb2_grpc


def _join_raw(stub: gateway_pb2_grpc.GatewayStub, group: str, topic: str) -> tuple[str, int]:
    request = gateway_pb2.JoinGroupRequest(
        group_id=group, topics=[topic], session_timeout_ms=30_000,
        rebalance_timeout_ms=30_000, client_id="late", max_wait_ms=3_000,
    )  # fmt: skip
    response = stub.JoinGroup(request, timeout=30)
    assert response.error.code == ErrorCode.MEMBER_ID_REQUIRED
    request.member_id = response.member_id
    response = stub.JoinGroup(request, timeout=30)
    assert response.error.code == 0, response.error
    return response.member_id, response.generation_id


def _commit_raw(  # noqa: PLR0917 - the request's fields, in order
    stub: gateway_pb2_grpc.GatewayStub,
    group: str,
    member: str,
    generation: int,
    topic: str,
    offset: int,
    timeout: float,
) -> gateway_pb2.CommitOffsetsResponse:
    return stub.CommitOffsets(
        gateway_pb2.CommitOffsetsRequest(
            group_id=group,
            member_id=member,
            generation_id=generation,
            offsets=[gateway_pb2.CommitOffset(topic=topic, partition=0, offset=offset)],
        ),
        timeout=timeout,
    )


def test_a_commit_given_up_on_does_not_land_after_a_newer_one(tmp_path: Path) -> None:
    """A commit the client gave up on landed late, over the member's newer commit made
    through another gateway: the gateway checked the call's deadline once, before the
    guard's etcd reads and the transaction, and a gateway stalled (GC, a paused VM) after
    that check wrote the older offsets long after the deadline; the group's committed
    offset moved backwards (found by an audit)."""
    with running_cluster(tmp_path / "c", brokers=1) as cluster:
        g1 = cluster.start_gateway()
        g2 = cluster.start_gateway()
        admin = tidelog.Admin(g2.address)
        topic = f"late-{uuid.uuid4().hex[:6]}"
        group = f"g-{uuid.uuid4().hex[:6]}"
        admin.create_topic(topic, partitions=1, replication_factor=1)
        ch1, ch2 = grpc.insecure_channel(g1.address), grpc.insecure_channel(g2.address)
        s1, s2 = gateway_pb2_grpc.GatewayStub(ch1), gateway_pb2_grpc.GatewayStub(ch2)
        member, generation = _join_raw(s2, group, topic)
        first = _commit_raw(s2, group, member, generation, topic, 10, 10)
        assert first.partitions[0].error.code == 0
        # Warm g1's channel (a call that connects), so the commit below reaches it at once.
        s1.DescribeGroup(gateway_pb2.DescribeGroupRequest(group_id=group), timeout=10)

        cluster.etcd.pause()  # etcd slow: the commit through g1 waits in its guard's reads
        future = s1.CommitOffsets.future(
            gateway_pb2.CommitOffsetsRequest(
                group_id=group,
                member_id=member,
                generation_id=generation,
                offsets=[gateway_pb2.CommitOffset(topic=topic, partition=0, offset=50)],
            ),
            timeout=1.0,
        )
        time.sleep(0.4)  # past g1's deadline check, waiting on etcd
        os.kill(g1.pid, signal.SIGSTOP)  # and g1 stalls (GC, a paused VM)
        try:
            cluster.etcd.resume()
            try:
                future.result()
                raise AssertionError("the commit through the stalled gateway was answered")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # The client gave up on offset 50; it commits 80 (the retry reaches g2).
            newer = _commit_raw(s2, group, member, generation, topic, 80, 10)
            assert newer.partitions[0].error.code == 0
            assert admin.describe_group(group)[0].committed_offset == 80
        finally:
            os.kill(g1.pid, signal.SIGCONT)
        time.sleep(2.0)  # g1 goes on with the commit it had begun
        committed = admin.describe_group(group)[0].committed_offset
        ch1.close()
        ch2.close()
        assert committed == 80, (
            f"the group's committed offset went back from 80 to {committed}: a commit "
            "whose client had given up (deadline exceeded) was written after a newer one"
        )


def test_one_gateway_and_a_slow_etcd_keep_a_members_commits_in_order(tmp_path: Path) -> None:
    """The same with one gateway, etcd slow for a second (an fsync stall, a
    leader election). The auto-commit of offset 50 is given up on by the client; its
    commit of 80 goes to the same gateway; both wait on etcd, and once it answers they
    race: the committed offset ends at 50 in some of the rounds."""
    with running_cluster(tmp_path / "c", brokers=1) as cluster:
        gw = cluster.start_gateway()
        admin = tidelog.Admin(gw.address)
        topic = f"late-{uuid.uuid4().hex[:6]}"
        admin.create_topic(topic, partitions=1, replication_factor=1)
        ch = grpc.insecure_channel(gw.address)
        stub = gateway_pb2_grpc.GatewayStub(ch)
        backwards = []
        for round_ in range(8):
            group = f"g-{uuid.uuid4().hex[:6]}"
            member, generation = _join_raw(stub, group, topic)
            assert (
                _commit_raw(stub, group, member, generation, topic, 10, 10).partitions[0].error.code
                == 0
            )
            cluster.etcd.pause()
            try:
                older = stub.CommitOffsets.future(
                    gateway_pb2.CommitOffsetsRequest(
                        group_id=group,
                        member_id=member,
                        generation_id=generation,
                        offsets=[gateway_pb2.CommitOffset(topic=topic, partition=0, offset=50)],
                    ),
                    timeout=0.5,
                )
                try:
                    older.result()
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                newer = stub.CommitOffsets.future(
                    gateway_pb2.CommitOffsetsRequest(
                        group_id=group,
                        member_id=member,
                        generation_id=generation,
                        offsets=[gateway_pb2.CommitOffset(topic=topic, partition=0, offset=80)],
                    ),
                    timeout=10,
                )
                time.sleep(0.3)
            finally:
                cluster.etcd.resume()
            assert newer.result().partitions[0].error.code == 0
            time.sleep(0.5)
            committed = admin.describe_group(group)[0].committed_offset
            if committed != 80:
                backwards.append((round_, committed))
        ch.close()
        assert not backwards, f"rounds whose committed offset ended below 80: {backwards}"
