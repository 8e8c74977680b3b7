"""Hostile input against every RPC of the gateway, the storage nodes and the controller.

One real cluster for the module (etcd, a controller, two storage nodes, a gateway: real
processes on loopback) with topics of known content. Three kinds of tests:

* explicit cases from issue 9 ("Hostile input"): bad topic names, negative and huge
  offsets, batch headers claiming huge lengths, CRC mismatches, fetch max_bytes of 2^31-1,
  a follower fetch claiming another broker's id - each asserting the precise status or
  per-item error code, a message for people, and that nothing changed;
* a request flood beyond the gateway's concurrency limit: RESOURCE_EXHAUSTED for the
  excess while ``grpc.health.v1.Health/Check`` keeps answering SERVING;
* property-based fuzzing (hypothesis) of every method of ``tidelog.v1.Gateway``,
  ``Storage`` and ``Controller``, enumerated from the service descriptors, with random
  and adversarial messages (``tests/support/fuzz.py``). After each call: the status is
  neither UNKNOWN nor INTERNAL, no per-item error is UNKNOWN_SERVER_ERROR, every process is
  alive and answers its health check, and a refused (or read-only) request left the
  observable state as it was: topics and partition states, each log's start, end and high
  watermark, consumer groups and their offsets.

Examples per RPC: ``TIDELOG_FUZZ_EXAMPLES`` (default 12, which keeps the module near a
minute on 2 cores); ``make chaos`` sets a large value. Runs are derandomized (the same
examples every time) unless ``TIDELOG_FUZZ_SEED`` is set, which hypothesis then uses and
prints on failure.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message as pb_message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from services.status import ERROR_CODE_METADATA_KEY, STATUS_FOR_CODE
from tests.support.cluster import GatewayProcess, TestCluster, wait_for
from tests.support.fuzz import (
    INT32_MAX,
    INT64_MAX,
    CallResult,
    Pools,
    all_methods,
    call,
    error_codes,
    message_strategy,
    valid_batch,
    with_batch_length,
    with_flipped_byte,
    with_record_count,
)
from tests.support.process import TidelogProcess
from tidelog import formats
from tidelog.errors import ErrorCode
from tidelog.v1 import (
    common_pb2,
    controller_pb2,
    gateway_pb2,
    storage_pb2,
)

RPC_TIMEOUT_S = 10.0
FUZZ_EXAMPLES = int(os.environ.get("TIDELOG_FUZZ_EXAMPLES", "12"))
FUZZ_SEED = os.environ.get("TIDELOG_FUZZ_SEED")

KNOWN = "known"  # 2 partitions, RF 2, records in both
SOLO = "solo"  # 1 partition, RF 1: the other broker is not a replica
SPOOF = "spoof"  # 1 partition, RF 2: the follower-id spoofing case
TOPICS = (KNOWN, SOLO, SPOOF)
GROUP = "known-group"
RECORDS_PER_PARTITION = 5

BAD_TOPIC_NAMES = {
    "empty": "",
    "dot": ".",
    "dotdot": "..",
    "parent-path": "../x",
    "slash": "a/b",
    "nul": "a\x00b",
    "250-chars": "x" * 250,
    "non-ascii": "tëma-名前",
}

GRPC_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
]


# --- the cluster --------------------------------------------------------------------------


@dataclass
class Env:
    """The module's cluster and channels to each of its processes."""

    cluster: TestCluster
    gateway: GatewayProcess
    channels: dict[str, grpc.Channel]  # "gateway", "controller", "storage-0", "storage-1"

    @property
    def expected(self) -> list[TidelogProcess]:
        return [
            self.gateway,
            self.cluster.active_controller(),
            *self.cluster.brokers.values(),
        ]

    def leader_of(self, topic: str, partition: int = 0) -> int:
        (state,) = [p for p in self.cluster.partitions(topic) if p.partition == partition]
        return int(state.leader)

    def storage(self, broker_id: int) -> grpc.Channel:
        return self.channels[f"storage-{broker_id}"]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    base: Path = tmp_path_factory.mktemp("hostile")
    # A longer session TTL than the tests' usual 2 s: a 2-core machine busy with a request
    # flood must not cost the controller its election (that is not what is tested here).
    with TestCluster(base, session_ttl_s=10) as cluster:
        for broker_id in (0, 1):
            cluster.start_broker(broker_id)
        cluster.start_controller(1)
        cluster.wait_brokers([0, 1])
        gateway = cluster.start_gateway()
        controller = cluster.active_controller()
        channels = {
            "gateway": grpc.insecure_channel(gateway.address, options=GRPC_CHANNEL_OPTIONS),
            "controller": grpc.insecure_channel(controller.address),
        }
        for broker_id, node in cluster.brokers.items():
            channels[f"storage-{broker_id}"] = grpc.insecure_channel(
                node.address, options=GRPC_CHANNEL_OPTIONS
            )
        api = gateway.stub
        response = api.CreateTopics(
            controller_pb2.CreateTopicsRequest(
                topics=[
                    controller_pb2.CreatableTopic(
                        name=KNOWN, num_partitions=2, replication_factor=2
                    ),
                    controller_pb2.CreatableTopic(
                        name=SOLO, num_partitions=1, replication_factor=1
                    ),
                    controller_pb2.CreatableTopic(
                        name=SPOOF, num_partitions=1, replication_factor=2
                    ),
                ],
                timeout_ms=20_000,
            ),
            timeout=30,
        )
        assert [r.error.code for r in response.topics] == [0, 0, 0], response
        for topic, partitions in ((KNOWN, 2), (SOLO, 1), (SPOOF, 1)):
            for p in range(partitions):
                _produce(api, topic, p, valid_batch(RECORDS_PER_PARTITION))
        commit = api.CommitOffsets(
            gateway_pb2.CommitOffsetsRequest(
                group_id=GROUP,
                offsets=[
                    gateway_pb2.CommitOffset(topic=KNOWN, partition=0, offset=3, leader_epoch=-1)
                ],
            ),
            timeout=RPC_TIMEOUT_S,
        )
        assert [r.error.code for r in commit.partitions] == [0], commit
        e = Env(cluster=cluster, gateway=gateway, channels=channels)
        # Everyone in sync before the first test: the ISRs are whole and the HWs at the end.
        wait_for(lambda: _in_sync(e), 30, "full ISRs and HW = LEO everywhere")
        try:
            yield e
        finally:
            for channel in channels.values():
                channel.close()


def _produce(api: Any, topic: str, partition: int, records: bytes) -> None:
    response = api.Produce(
        gateway_pb2.ProduceRequest(
            acks=common_pb2.ALL,
            timeout_ms=10_000,
            partitions=[
                gateway_pb2.ProducePartitionData(topic=topic, partition=partition, records=records)
            ],
        ),
        timeout=RPC_TIMEOUT_S,
    )
    assert [r.error.code for r in response.partitions] == [0], response


def _in_sync(e: Env) -> bool:
    snap = snapshot(e)
    for (topic, _), (_, _, isr, _, replicas) in snap.partitions.items():
        if topic in TOPICS and sorted(isr) != sorted(replicas):
            return False
    for logs in snap.logs.values():
        for start, end, hw, _ in logs.values():
            del start
            if end != hw:
                return False
    return True


# --- observable state ---------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    # (topic, partition) -> (leader, leader_epoch, isr, partition_epoch, replicas)
    partitions: dict[tuple[str, int], tuple[int, int, tuple[int, ...], int, tuple[int, ...]]]
    # broker -> (topic, partition) -> (log_start, log_end, high_watermark, leader_epoch)
    logs: dict[int, dict[tuple[str, int], tuple[int, int, int, int]]]
    # group -> ((topic, partition, offset), ...)
    groups: dict[str, tuple[tuple[str, int, int], ...]]


def snapshot(e: Env) -> Snapshot:
    api = e.gateway.stub
    metadata = e.cluster.active_controller().stub.Metadata(
        controller_pb2.MetadataRequest(), timeout=RPC_TIMEOUT_S
    )
    partitions = {
        (t.name, p.partition): (
            p.leader,
            p.leader_epoch,
            tuple(p.isr),
            p.partition_epoch,
            tuple(p.replicas),
        )
        for t in metadata.topics
        for p in t.partitions
    }
    logs: dict[int, dict[tuple[str, int], tuple[int, int, int, int]]] = {}
    for broker_id, node in e.cluster.brokers.items():
        described = node.stub.DescribeLogDirs(
            storage_pb2.DescribeLogDirsRequest(), timeout=RPC_TIMEOUT_S
        )
        logs[broker_id] = {
            (d.topic, d.partition): (
                d.log_start_offset,
                d.log_end_offset,
                d.high_watermark,
                d.leader_epoch,
            )
            for log_dir in described.log_dirs
            for d in log_dir.partitions
        }
    groups = {}
    for group in api.ListGroups(gateway_pb2.ListGroupsRequest(), timeout=RPC_TIMEOUT_S).group_ids:
        fetched = api.FetchOffsets(
            gateway_pb2.FetchOffsetsRequest(group_id=group), timeout=RPC_TIMEOUT_S
        )
        groups[group] = tuple(sorted((o.topic, o.partition, o.offset) for o in fetched.offsets))
    return Snapshot(partitions=partitions, logs=logs, groups=groups)


def quiet_snapshot(e: Env, timeout_s: float = 10.0) -> Snapshot:
    """A snapshot once two in a row agree: effects of earlier accepted requests (a
    follower still copying an acks=1 batch) have settled."""
    deadline = time.monotonic() + timeout_s

    def take() -> Snapshot:
        try:
            return snapshot(e)
        except grpc.RpcError:  # e.g. the controller between terms: the test may say why
            return wait_for(lambda: snapshot(e), 30, "a snapshot of the cluster")

    previous = take()
    while True:
        time.sleep(0.02)
        current = take()
        if current == previous or time.monotonic() > deadline:
            return current
        previous = current


def assert_unchanged(before: Snapshot, after: Snapshot, what: str) -> None:
    assert after.partitions == before.partitions, f"{what} changed partition states"
    assert after.logs == before.logs, f"{what} changed log offsets or high watermarks"
    assert after.groups == before.groups, f"{what} changed consumer groups"


def assert_all_healthy(e: Env) -> None:
    for process in e.expected:
        assert process.proc.poll() is None, (
            f"{' '.join(process.args[:2])} died (status {process.proc.returncode}):\n"
            f"{process.log_tail()}"
        )
        with grpc.insecure_channel(process.address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        assert response.status == health_pb2.HealthCheckResponse.SERVING, process.args


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise LookupError(f"no VmRSS for {pid}")


# --- calling and judging ------------------------------------------------------------------


def method(service: str, name: str) -> pb_descriptor.MethodDescriptor:
    (found,) = [m for m in all_methods() if m.containing_service.name == service and m.name == name]
    return found


def rpc(channel: grpc.Channel, service: str, name: str, request: pb_message.Message) -> CallResult:
    return call(channel, method(service, name), [request], RPC_TIMEOUT_S)


def outcome(result: CallResult) -> tuple[grpc.StatusCode, ErrorCode, str]:
    """(status, tidelog code, message): the status's trailer when the call failed as a
    whole, else the single per-item error of the response."""
    if result.status != grpc.StatusCode.OK:
        name = result.trailer(ERROR_CODE_METADATA_KEY)
        return result.status, ErrorCode[name] if name else ErrorCode.NONE, result.details
    errors: list[tuple[int, str]] = []
    for response in result.responses:
        collect_errors(response, errors)
    codes = {code for code, _ in errors}
    assert len(codes) == 1, f"expected one error code, got {errors}"
    code = codes.pop()
    return grpc.StatusCode.OK, ErrorCode(code), next(m for _, m in errors)


def collect_errors(message: pb_message.Message, out: list[tuple[int, str]]) -> None:
    if message.DESCRIPTOR.full_name == "tidelog.v1.Error":
        out.append((int(getattr(message, "code")), str(getattr(message, "message"))))  # noqa: B009
        return
    for fd, value in message.ListFields():
        if fd.type == pb_descriptor.FieldDescriptor.TYPE_MESSAGE:
            for item in value if fd.is_repeated else [value]:
                collect_errors(item, out)


def assert_refused(result: CallResult, code: ErrorCode | set[ErrorCode], what: str) -> None:
    """Refused with ``code`` (or one of a set) - as a status (with the mapped gRPC code)
    or as the per-item error of a multi-item call - and a message a person can act on."""
    status, got, message = outcome(result)
    codes = code if isinstance(code, set) else {code}
    assert got in codes, f"{what}: expected {codes}, got {status.name}/{got.name}: {message}"
    if status != grpc.StatusCode.OK:
        assert status == STATUS_FOR_CODE[got], f"{what}: {got.name} came as {status.name}"
    assert len(message) >= 10, f"{what}: message {message!r} is not for people"


# --- explicit cases: topic names ----------------------------------------------------------


def _name_requests(name: str) -> list[tuple[str, str, str, pb_message.Message]]:
    """(channel, service, method, request) naming topic ``name`` on every surface."""
    batch = valid_batch()
    tp = {"topic": name, "partition": 0}
    return [
        (
            "gateway",
            "Gateway",
            "CreateTopics",
            controller_pb2.CreateTopicsRequest(
                topics=[
                    controller_pb2.CreatableTopic(name=name, num_partitions=1, replication_factor=1)
                ]
            ),
        ),
        (
            "controller",
            "Controller",
            "CreateTopics",
            controller_pb2.CreateTopicsRequest(
                topics=[
                    controller_pb2.CreatableTopic(name=name, num_partitions=1, replication_factor=1)
                ]
            ),
        ),
        ("gateway", "Gateway", "DeleteTopics", controller_pb2.DeleteTopicsRequest(names=[name])),
        (
            "controller",
            "Controller",
            "DeleteTopics",
            controller_pb2.DeleteTopicsRequest(names=[name]),
        ),
        (
            "gateway",
            "Gateway",
            "CreatePartitions",
            controller_pb2.CreatePartitionsRequest(
                topics=[controller_pb2.PartitionIncrease(name=name, count=3)]
            ),
        ),
        (
            "gateway",
            "Gateway",
            "Produce",
            gateway_pb2.ProduceRequest(
                acks=common_pb2.LEADER,
                partitions=[gateway_pb2.ProducePartitionData(records=batch, **tp)],
            ),
        ),
        (
            "gateway",
            "Gateway",
            "Fetch",
            storage_pb2.FetchRequest(
                replica_id=-1,
                max_wait_ms=0,
                partitions=[storage_pb2.FetchPartition(fetch_offset=0, **tp)],
            ),
        ),
        (
            "gateway",
            "Gateway",
            "ListOffsets",
            storage_pb2.ListOffsetsRequest(
                replica_id=-1,
                partitions=[storage_pb2.ListOffsetsPartition(spec=common_pb2.LATEST, **tp)],
            ),
        ),
        (
            "gateway",
            "Gateway",
            "Subscribe",
            gateway_pb2.SubscribeRequest(start_spec=common_pb2.EARLIEST, max_wait_ms=0, **tp),
        ),
        (
            "gateway",
            "Gateway",
            "CommitOffsets",
            gateway_pb2.CommitOffsetsRequest(
                group_id=GROUP, offsets=[gateway_pb2.CommitOffset(offset=1, **tp)]
            ),
        ),
        (
            "gateway",
            "Gateway",
            "FetchOffsets",
            gateway_pb2.FetchOffsetsRequest(
                group_id=GROUP, partitions=[common_pb2.TopicPartition(**tp)]
            ),
        ),
        ("gateway", "Gateway", "Metadata", controller_pb2.MetadataRequest(topics=[name])),
        (
            "gateway",
            "Gateway",
            "IncrementalAlterConfigs",
            controller_pb2.IncrementalAlterConfigsRequest(
                topics=[
                    controller_pb2.AlterableTopicConfig(
                        name=name, set=[common_pb2.ConfigEntry(name="retention.ms", value="1")]
                    )
                ]
            ),
        ),
        (
            "gateway",
            "Gateway",
            "DescribeTopics",
            gateway_pb2.DescribeTopicsRequest(names=[name]),
        ),
        (
            "storage-0",
            "Storage",
            "Append",
            storage_pb2.AppendRequest(records=batch, acks=common_pb2.LEADER, **tp),
        ),
        (
            "storage-0",
            "Storage",
            "AppendMany",
            storage_pb2.AppendManyRequest(
                appends=[storage_pb2.AppendRequest(records=batch, acks=common_pb2.LEADER, **tp)]
            ),
        ),
        (
            "storage-0",
            "Storage",
            "Fetch",
            storage_pb2.FetchRequest(
                replica_id=-1,
                max_wait_ms=0,
                partitions=[storage_pb2.FetchPartition(fetch_offset=0, **tp)],
            ),
        ),
        (
            "storage-0",
            "Storage",
            "ListOffsets",
            storage_pb2.ListOffsetsRequest(
                replica_id=-1,
                partitions=[storage_pb2.ListOffsetsPartition(spec=common_pb2.EARLIEST, **tp)],
            ),
        ),
        (
            "storage-0",
            "Storage",
            "OffsetForLeaderEpoch",
            storage_pb2.OffsetForLeaderEpochRequest(
                replica_id=-1,
                partitions=[storage_pb2.OffsetForLeaderEpochPartition(leader_epoch=0, **tp)],
            ),
        ),
        (
            "controller",
            "Controller",
            "ElectLeaders",
            controller_pb2.ElectLeadersRequest(
                election_type=controller_pb2.PREFERRED,
                partitions=[common_pb2.TopicPartition(**tp)],
            ),
        ),
    ]


@pytest.mark.parametrize("label", sorted(BAD_TOPIC_NAMES))
def test_bad_topic_names_are_refused_everywhere_with_invalid_topic(env: Env, label: str) -> None:
    name = BAD_TOPIC_NAMES[label]
    before = quiet_snapshot(env)
    for channel, service, name_of_method, request in _name_requests(name):
        result = rpc(env.channels[channel], service, name_of_method, request)
        what = f"{service}.{name_of_method}({label})"
        assert_refused(result, ErrorCode.INVALID_TOPIC, what)
    assert_unchanged(before, quiet_snapshot(env), f"topic name {label}")
    assert_all_healthy(env)


# --- explicit cases: offsets --------------------------------------------------------------


@pytest.mark.parametrize(
    ("offset", "gateway_code", "storage_code"),
    [
        # A negative offset is never a position: the gateway refuses the request as a
        # whole; the storage node answers per partition, as for any offset off the log.
        (-1, ErrorCode.INVALID_REQUEST, ErrorCode.OFFSET_OUT_OF_RANGE),
        (-(2**63), ErrorCode.INVALID_REQUEST, ErrorCode.OFFSET_OUT_OF_RANGE),
        (RECORDS_PER_PARTITION + 1, ErrorCode.OFFSET_OUT_OF_RANGE, ErrorCode.OFFSET_OUT_OF_RANGE),
        (INT64_MAX, ErrorCode.OFFSET_OUT_OF_RANGE, ErrorCode.OFFSET_OUT_OF_RANGE),
    ],
)
def test_negative_and_huge_fetch_offsets(
    env: Env, offset: int, gateway_code: ErrorCode, storage_code: ErrorCode
) -> None:
    before = quiet_snapshot(env)
    leader = env.leader_of(SOLO)
    request = storage_pb2.FetchRequest(
        replica_id=-1,
        max_wait_ms=0,
        partitions=[storage_pb2.FetchPartition(topic=SOLO, partition=0, fetch_offset=offset)],
    )
    assert_refused(
        rpc(env.channels["gateway"], "Gateway", "Fetch", request), gateway_code, "gateway"
    )
    assert_refused(rpc(env.storage(leader), "Storage", "Fetch", request), storage_code, "storage")
    # A subscription from there, and a commit of it.
    subscribe = gateway_pb2.SubscribeRequest(
        topic=SOLO, partition=0, start_offset=offset, max_wait_ms=0
    )
    result = call(env.channels["gateway"], method("Gateway", "Subscribe"), [subscribe], 3.0)
    assert_refused(result, gateway_code, "subscribe")
    assert_unchanged(before, quiet_snapshot(env), f"fetch offset {offset}")
    assert_all_healthy(env)


@pytest.mark.parametrize("offset", [-1, -(2**63)])
def test_negative_committed_offsets_are_refused(env: Env, offset: int) -> None:
    before = quiet_snapshot(env)
    result = rpc(
        env.channels["gateway"],
        "Gateway",
        "CommitOffsets",
        gateway_pb2.CommitOffsetsRequest(
            group_id=GROUP,
            offsets=[gateway_pb2.CommitOffset(topic=KNOWN, partition=0, offset=offset)],
        ),
    )
    assert_refused(result, ErrorCode.INVALID_REQUEST, "commit")
    assert_unchanged(before, quiet_snapshot(env), f"commit of offset {offset}")


@pytest.mark.parametrize("partition", [-1, INT32_MAX, 2])
def test_negative_and_huge_partition_numbers(env: Env, partition: int) -> None:
    before = quiet_snapshot(env)
    expected = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION if partition >= 0 else ErrorCode.INVALID_REQUEST
    produce = gateway_pb2.ProduceRequest(
        acks=common_pb2.LEADER,
        partitions=[
            gateway_pb2.ProducePartitionData(
                topic=KNOWN, partition=partition, records=valid_batch()
            )
        ],
    )
    status, code, message = outcome(rpc(env.channels["gateway"], "Gateway", "Produce", produce))
    assert code in (expected, ErrorCode.UNKNOWN_TOPIC_OR_PARTITION), (status, code, message)
    append = storage_pb2.AppendRequest(
        topic=KNOWN, partition=partition, records=valid_batch(), acks=common_pb2.LEADER
    )
    assert_refused(rpc(env.storage(0), "Storage", "Append", append), expected, "append")
    assert_unchanged(before, quiet_snapshot(env), f"partition {partition}")


# --- explicit cases: damaged batches ------------------------------------------------------

DAMAGED_BATCHES = {
    # name -> (records, expected code)
    "body-crc-flipped": (
        with_flipped_byte(valid_batch(3), formats.CRC_OFFSET),
        ErrorCode.CORRUPT_BATCH,
    ),
    "header-crc-flipped": (
        with_flipped_byte(valid_batch(3), formats.HEADER_CRC_OFFSET),
        ErrorCode.CORRUPT_BATCH,
    ),
    "body-byte-flipped": (
        with_flipped_byte(valid_batch(3), -1),
        ErrorCode.CORRUPT_BATCH,
    ),
    # Refused on the length alone, before anything is read or allocated for it.
    "length-2^31-1": (with_batch_length(valid_batch(), INT32_MAX), ErrorCode.MESSAGE_TOO_LARGE),
    "length-2^31-1-bad-header-crc": (
        with_batch_length(valid_batch(), INT32_MAX, fix_header_crc=False),
        ErrorCode.MESSAGE_TOO_LARGE,
    ),
    "length-negative": (with_batch_length(valid_batch(), -1), ErrorCode.CORRUPT_BATCH),
    "length-int32-min": (with_batch_length(valid_batch(), -(2**31)), ErrorCode.CORRUPT_BATCH),
    "length-zero": (with_batch_length(valid_batch(), 0), ErrorCode.CORRUPT_BATCH),
    "torn-by-one-byte": (valid_batch(3)[:-1], ErrorCode.CORRUPT_BATCH),
    "record-count-2^31-1": (with_record_count(valid_batch(), INT32_MAX), ErrorCode.CORRUPT_BATCH),
    "good-then-bad": (
        valid_batch(2) + with_flipped_byte(valid_batch(2), -1),
        ErrorCode.CORRUPT_BATCH,
    ),
    "trailing-garbage": (valid_batch() + b"\x00" * 11, ErrorCode.CORRUPT_BATCH),
}


@pytest.mark.parametrize("label", sorted(DAMAGED_BATCHES))
def test_damaged_batches_are_refused_and_change_nothing(env: Env, label: str) -> None:
    records, expected = DAMAGED_BATCHES[label]
    leader = env.leader_of(KNOWN, 0)
    node = env.cluster.brokers[leader]
    before = quiet_snapshot(env)
    rss_before = rss_bytes(node.pid)
    append = storage_pb2.AppendRequest(
        topic=KNOWN, partition=0, records=records, acks=common_pb2.ALL, timeout_ms=5_000
    )
    assert_refused(rpc(env.storage(leader), "Storage", "Append", append), expected, "append")
    stream = call(env.storage(leader), method("Storage", "AppendStream"), [append, append], 10.0)
    assert stream.status == grpc.StatusCode.OK, stream
    assert [ErrorCode(c) for r in stream.responses for c in error_codes(r)] == [expected] * 2
    many = storage_pb2.AppendManyRequest(appends=[append])
    assert_refused(rpc(env.storage(leader), "Storage", "AppendMany", many), expected, "many")
    produce = gateway_pb2.ProduceRequest(
        acks=common_pb2.ALL,
        partitions=[gateway_pb2.ProducePartitionData(topic=KNOWN, partition=0, records=records)],
    )
    assert_refused(rpc(env.channels["gateway"], "Gateway", "Produce", produce), expected, "produce")
    assert_unchanged(before, quiet_snapshot(env), f"batch {label}")
    # A 2 GiB claim allocated would show here; the limit leaves room for ordinary noise.
    assert rss_bytes(node.pid) - rss_before < 64 * 1024 * 1024
    assert_all_healthy(env)


# --- explicit cases: fetch sizes ----------------------------------------------------------


TRUNCATED_FIELD = b"\x0a\x10abc"  # field 1, length-delimited: claims 16 bytes, has 3
NOT_UTF8_STRING = b"\x0a\x02\xff\xfe"  # field 1, a string in these messages: not UTF-8


@pytest.mark.parametrize(
    ("channel", "service", "name", "payload"),
    [
        ("gateway", "Gateway", "Metadata", NOT_UTF8_STRING),
        ("gateway", "Gateway", "Produce", TRUNCATED_FIELD),
        ("gateway", "Gateway", "Fetch", TRUNCATED_FIELD),
        ("gateway", "Gateway", "ProduceStream", TRUNCATED_FIELD),
        ("storage-0", "Storage", "Append", NOT_UTF8_STRING),
        ("storage-0", "Storage", "Fetch", TRUNCATED_FIELD),  # parsed by tidelog.wire's path
        ("storage-0", "Storage", "AppendStream", TRUNCATED_FIELD),
        ("controller", "Controller", "CreateTopics", TRUNCATED_FIELD),
    ],
)
def test_request_bytes_that_do_not_parse_get_invalid_argument(
    env: Env, channel: str, service: str, name: str, payload: bytes
) -> None:
    """Bytes that are not a valid protobuf message (a truncated field; a string that is
    not UTF-8, which clients in other languages can send) were answered INTERNAL
    "Exception deserializing request!" by gRPC itself, with a traceback logged and no
    error code, on every method, streams included (found by an audit). They are bad input
    like any other: INVALID_ARGUMENT, INVALID_REQUEST in the trailer, a message naming the
    method, and nothing changed."""
    before = quiet_snapshot(env)
    m = method(service, name)
    path = f"/{m.containing_service.full_name}/{m.name}"
    if m.client_streaming:
        call: Any = env.channels[channel].stream_stream(path)
        with pytest.raises(grpc.RpcError) as caught:
            list(call(iter([payload]), timeout=RPC_TIMEOUT_S))
    else:
        call = env.channels[channel].unary_unary(path)
        with pytest.raises(grpc.RpcError) as caught:
            call(payload, timeout=RPC_TIMEOUT_S)
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert dict(error.trailing_metadata() or ())[ERROR_CODE_METADATA_KEY] == "INVALID_REQUEST"
    assert f"{path} is not a valid protobuf message" in (error.details() or "")
    assert_unchanged(before, quiet_snapshot(env), f"{service}/{name} with unparsable bytes")
    assert_all_healthy(env)


def test_fetch_max_bytes_of_2_31_is_capped_not_allocated(env: Env) -> None:
    """max_bytes is int32: 2^31 - 1 is the largest a request can carry. It is capped by
    the server's limit (the data is small), never used to size a buffer."""
    leader = env.leader_of(KNOWN, 0)
    node = env.cluster.brokers[leader]
    rss_before = rss_bytes(node.pid)
    gateway_rss_before = rss_bytes(env.gateway.pid)
    request = storage_pb2.FetchRequest(
        replica_id=-1,
        max_wait_ms=0,
        max_bytes=INT32_MAX,
        partitions=[
            storage_pb2.FetchPartition(
                topic=KNOWN, partition=p, fetch_offset=0, max_bytes=INT32_MAX
            )
            for p in (0, 1)
        ],
    )
    for channel in (env.channels["gateway"], env.storage(leader)):
        result = rpc(
            channel,
            "Storage" if channel is not env.channels["gateway"] else "Gateway",
            "Fetch",
            request,
        )
        assert result.status == grpc.StatusCode.OK, result
        (response,) = result.responses
        assert isinstance(response, storage_pb2.FetchResponse)
        ok = [p for p in response.partitions if p.error.code == 0]
        assert ok and all(p.records for p in ok), response
    subscribe = gateway_pb2.SubscribeRequest(
        topic=KNOWN, partition=0, start_spec=common_pb2.EARLIEST, max_bytes=INT32_MAX
    )
    # Capped at the gateway's limit, as Fetch is (it was refused: a client cannot know
    # every gateway's --max-fetch-bytes); the stream ends by its deadline.
    result = call(env.channels["gateway"], method("Gateway", "Subscribe"), [subscribe], 3.0)
    assert result.responses and any(
        isinstance(r, storage_pb2.FetchPartitionResult) and r.records for r in result.responses
    ), result
    for bad in (0, -1, -(2**31)):
        request.max_bytes = bad
        assert_refused(
            rpc(env.channels["gateway"], "Gateway", "Fetch", request),
            ErrorCode.INVALID_FETCH_SIZE,
            f"gateway max_bytes {bad}",
        )
        assert_refused(
            rpc(env.storage(leader), "Storage", "Fetch", request),
            ErrorCode.INVALID_FETCH_SIZE,
            f"storage max_bytes {bad}",
        )
    assert rss_bytes(node.pid) - rss_before < 64 * 1024 * 1024
    assert rss_bytes(env.gateway.pid) - gateway_rss_before < 64 * 1024 * 1024


# --- explicit cases: a follower fetch claiming another broker's id -------------------------


def _follower_fetch(
    e: Env, leader: int, topic: str, replica_id: int, *, broker_epoch: int, offset: int
) -> CallResult:
    return rpc(
        e.storage(leader),
        "Storage",
        "Fetch",
        storage_pb2.FetchRequest(
            replica_id=replica_id,
            broker_epoch=broker_epoch,
            max_wait_ms=0,
            partitions=[storage_pb2.FetchPartition(topic=topic, partition=0, fetch_offset=offset)],
        ),
    )


def test_a_fetch_naming_a_later_leader_epoch_than_the_leaders_is_refused(env: Env) -> None:
    """A consumer fetch whose last_fetched_epoch is later than the leader's own epoch:
    the fetcher read records of a successor this broker has not heard of (it was routed
    by stale metadata). It was answered as a divergence, and a consumer moved its
    position back and read records twice; it is UNKNOWN_LEADER_EPOCH now (retriable),
    with nothing changed (found by an audit)."""
    leader = env.leader_of(KNOWN, 0)
    (state,) = [p for p in env.cluster.partitions(KNOWN) if p.partition == 0]
    before = quiet_snapshot(env)
    result = rpc(
        env.storage(leader),
        "Storage",
        "Fetch",
        storage_pb2.FetchRequest(
            replica_id=-1,
            max_wait_ms=0,
            partitions=[
                storage_pb2.FetchPartition(
                    topic=KNOWN,
                    partition=0,
                    fetch_offset=RECORDS_PER_PARTITION,
                    last_fetched_epoch=state.leader_epoch + 3,
                )
            ],
        ),
    )
    assert_refused(result, ErrorCode.UNKNOWN_LEADER_EPOCH, "last_fetched_epoch past the leader's")
    (answer,) = [p for r in result.responses for p in r.partitions]  # type: ignore[attr-defined]
    assert answer.diverging_end_offset in (-1, 0), answer
    assert_unchanged(before, quiet_snapshot(env), "a fetch naming a later leader epoch")


def test_follower_fetch_from_a_broker_that_is_not_a_replica_is_refused(env: Env) -> None:
    leader = env.leader_of(SOLO)
    other = 1 - leader
    before = quiet_snapshot(env)
    end = before.logs[leader][(SOLO, 0)][1]
    not_a_replica = ErrorCode.NOT_LEADER_OR_FOLLOWER
    for replica_id, epoch, expected in (
        (other, env.cluster.broker_epoch(other), not_a_replica),  # live, but not a replica
        (other, 0, ErrorCode.STALE_BROKER_EPOCH),  # and not even its epoch
        (leader, env.cluster.broker_epoch(leader), not_a_replica),  # the leader itself
        (999, 0, ErrorCode.STALE_BROKER_EPOCH),  # no such broker: no epoch to check
        (INT32_MAX, -1, ErrorCode.STALE_BROKER_EPOCH),
    ):
        result = _follower_fetch(env, leader, SOLO, replica_id, broker_epoch=epoch, offset=end)
        assert_refused(result, expected, f"replica_id {replica_id} epoch {epoch}")
    assert_unchanged(before, quiet_snapshot(env), "follower fetch from a non-replica")


def test_follower_fetch_with_a_followers_id_but_not_its_epoch_cannot_move_the_hw(
    env: Env,
) -> None:
    """The follower is paused, so the leader's HW lags its LEO; a fetch claiming to be
    the follower at the LEO would commit records no follower has. Without the follower's
    registered epoch it is refused, and the HW and ISR stay where they were."""
    leader = env.leader_of(SPOOF)
    follower = 1 - leader
    follower_process = env.cluster.brokers[follower]
    real_epoch = env.cluster.broker_epoch(follower)
    os.kill(follower_process.pid, signal.SIGSTOP)
    try:
        _produce_acks_1(env, SPOOF)

        def lagging() -> tuple[int, int] | None:
            described = env.cluster.brokers[leader].stub.DescribeLogDirs(
                storage_pb2.DescribeLogDirsRequest(
                    partitions=[common_pb2.TopicPartition(topic=SPOOF, partition=0)]
                ),
                timeout=RPC_TIMEOUT_S,
            )
            (d,) = described.log_dirs[0].partitions
            return (
                (d.high_watermark, d.log_end_offset)
                if d.high_watermark < d.log_end_offset
                else None
            )

        hw, end = wait_for(lagging, 5, "the leader's HW behind its LEO")
        state_before = env.cluster.partitions(SPOOF)[0]
        for epoch in (0, -1, real_epoch + 1, real_epoch - 1, INT64_MAX):
            result = _follower_fetch(env, leader, SPOOF, follower, broker_epoch=epoch, offset=end)
            assert_refused(result, ErrorCode.STALE_BROKER_EPOCH, f"spoofed epoch {epoch}")
            assert lagging() == (hw, end), f"a fetch with epoch {epoch} moved the HW"
        state_after = env.cluster.partitions(SPOOF)[0]
        assert (state_after.isr, state_after.leader_epoch) == (
            state_before.isr,
            state_before.leader_epoch,
        )
    finally:
        os.kill(follower_process.pid, signal.SIGCONT)
    wait_for(lambda: _in_sync(env), 30, "the follower caught up again")


def _produce_acks_1(e: Env, topic: str) -> None:
    response = e.gateway.stub.Produce(
        gateway_pb2.ProduceRequest(
            acks=common_pb2.LEADER,
            partitions=[
                gateway_pb2.ProducePartitionData(topic=topic, partition=0, records=valid_batch(2))
            ],
        ),
        timeout=RPC_TIMEOUT_S,
    )
    assert [r.error.code for r in response.partitions] == [0], response


# --- explicit cases: control-plane requests without the broker's epoch -------------------

HUGE_CONTROLLER_EPOCH = 2**62


def _control_requests(leader: int) -> list[tuple[str, pb_message.Message]]:
    """Requests only the controller sends, from "a controller" with a huge epoch that
    does not name the broker's registration epoch (each would, if accepted, fence the real
    controller out of this broker; the StopReplica would also delete a partition)."""
    partition = common_pb2.PartitionState(
        topic=KNOWN,
        partition=0,
        leader=1 - leader,
        leader_epoch=1_000,
        isr=[0, 1],
        replicas=[0, 1],
        partition_epoch=1_000,
    )
    requests: list[tuple[str, pb_message.Message]] = []
    for broker_epoch in (0, -1):
        common: dict[str, Any] = {
            "controller_id": 7,
            "controller_epoch": HUGE_CONTROLLER_EPOCH,
            "broker_epoch": broker_epoch,
        }
        requests += [
            (
                "StopReplica",
                storage_pb2.StopReplicaRequest(
                    partitions=[
                        storage_pb2.StopReplicaPartition(
                            topic=KNOWN, partition=0, leader_epoch=-1, delete_partition=True
                        )
                    ],
                    **common,
                ),
            ),
            (
                "LeaderAndIsr",
                storage_pb2.LeaderAndIsrRequest(
                    partitions=[storage_pb2.LeaderAndIsrPartition(state=partition)], **common
                ),
            ),
            ("UpdateMetadata", storage_pb2.UpdateMetadataRequest(topic_ids={KNOWN: "x"}, **common)),
        ]
    return requests


def test_controller_requests_without_the_brokers_epoch_are_refused(env: Env) -> None:
    leader = env.leader_of(KNOWN, 0)
    before = quiet_snapshot(env)
    for name, request in _control_requests(leader):
        result = rpc(env.storage(leader), "Storage", name, request)
        epoch = getattr(request, "broker_epoch")  # noqa: B009
        assert_refused(result, ErrorCode.STALE_BROKER_EPOCH, f"{name} broker_epoch {epoch}")
    assert_unchanged(before, quiet_snapshot(env), "control requests without a broker epoch")
    # The real controller still manages the broker: a new topic gets its leaders there.
    topic = "after-hostile-control"
    env.cluster.create_topic(topic, partitions=2, replication_factor=2)
    wait_for(
        lambda: (
            all(p.leader >= 0 for p in env.cluster.partitions(topic))
            and all((topic, p) in snapshot(env).logs[b] for b in (0, 1) for p in (0, 1))
        ),
        30,
        "the new topic's logs on both brokers",
    )
    delete = env.gateway.stub.DeleteTopics(
        controller_pb2.DeleteTopicsRequest(names=[topic]), timeout=30
    )
    assert [r.error.code for r in delete.topics] == [0]


@pytest.mark.parametrize("name", ["ControlledShutdown", "AlterPartition"])
def test_broker_requests_to_the_controller_need_the_brokers_epoch(env: Env, name: str) -> None:
    """Epoch -1 reads as "unknown, skip the check" inside the state machine; on the wire it
    would let anyone take broker 0's leaderships away (ControlledShutdown) or rewrite an
    ISR in its name."""
    state = env.cluster.partitions(KNOWN)[0]
    before = quiet_snapshot(env)
    request: pb_message.Message
    if name == "ControlledShutdown":
        request = controller_pb2.ControlledShutdownRequest(broker_id=state.leader, broker_epoch=-1)
    else:
        request = controller_pb2.AlterPartitionRequest(
            broker_id=state.leader,
            broker_epoch=-1,
            partitions=[
                controller_pb2.AlterPartitionItem(
                    topic=KNOWN,
                    partition=0,
                    leader_epoch=state.leader_epoch,
                    new_isr=[state.leader],
                    partition_epoch=state.partition_epoch,
                )
            ],
        )
    result = rpc(env.channels["controller"], "Controller", name, request)
    assert_refused(result, ErrorCode.INVALID_REQUEST, f"{name} with broker_epoch -1")
    assert_unchanged(before, quiet_snapshot(env), f"{name} with broker_epoch -1")


# --- flood --------------------------------------------------------------------------------

GATEWAY_MAX_CONCURRENT_RPCS = 1024  # services/gateway/node.py GatewayConfig default


def test_flood_beyond_the_concurrency_limit_gets_resource_exhausted_and_health_answers(
    env: Env,
) -> None:
    """Subscriptions to a quiet partition hold their call open; more of them than the
    gateway admits must be answered RESOURCE_EXHAUSTED (with a message), while the health
    check - exempt from the limit, served by threads of its own - keeps answering.

    On a busy machine a few refused calls reach this client as a bare CANCELLED instead:
    the server answers before the client's HTTP/2 stream has finished sending, and the
    client's transport then reports the reset, not the status. gRPC's own
    ``maximum_concurrent_rpcs`` refusal does the same (1 in 3 runs of a 1,174-call flood
    with two busy loops on the cores), so the test counts a CANCELLED that arrives while
    the flood stands as a refusal, and asks for most refusals to be seen whole."""
    flood = GATEWAY_MAX_CONCURRENT_RPCS + 150
    channel = grpc.insecure_channel(env.gateway.address)
    end = quiet_snapshot(env).logs[env.leader_of(SOLO)][(SOLO, 0)][1]
    subscribe = channel.unary_stream(
        "/tidelog.v1.Gateway/Subscribe",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=storage_pb2.FetchPartitionResult.FromString,
    )
    request = gateway_pb2.SubscribeRequest(
        topic=SOLO, partition=0, start_offset=end, max_wait_ms=200
    )
    calls = [subscribe(request, timeout=60) for _ in range(flood)]
    refused = flood - GATEWAY_MAX_CONCURRENT_RPCS
    exhausted: list[str] = []
    reset: list[str] = []  # CANCELLED while the flood stood (see above)
    others: list[str] = []  # any other end while the flood stood: none should
    lock = threading.Lock()

    def watch(c: Any) -> None:
        try:
            for _ in c:
                pass
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            with lock:
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    exhausted.append(exc.details() or "")  # type: ignore[attr-defined]
                elif flood_over.is_set():
                    return
                elif code == grpc.StatusCode.CANCELLED:
                    reset.append(exc.debug_error_string())  # type: ignore[attr-defined]
                else:
                    others.append(f"{code}: {exc.debug_error_string()}")  # type: ignore[attr-defined]

    flood_over = threading.Event()
    threads = [threading.Thread(target=watch, args=(c,), daemon=True) for c in calls]
    for t in threads:
        t.start()
    try:
        try:
            wait_for(
                lambda: len(exhausted) + len(reset) >= refused,
                30,
                f"{refused} calls refused",
            )
        except AssertionError as exc:
            with lock:
                seen = (
                    f"{len(exhausted)} RESOURCE_EXHAUSTED, {len(reset)} CANCELLED, "
                    f"{len(others)} ended otherwise: {others[:3]}"
                )
            raise AssertionError(f"{exc} ({seen})") from None
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(20):
            # The deadline is the check: behind the flood's queue it would not be met.
            response = health.Check(health_pb2.HealthCheckRequest(), timeout=2)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
            response = health.Check(
                health_pb2.HealthCheckRequest(service="tidelog.v1.Gateway"), timeout=2
            )
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        with lock:
            # Exactly the calls beyond the limit ended; the admitted ones are still open.
            assert len(exhausted) + len(reset) == refused, (len(exhausted), len(reset))
            assert len(exhausted) >= refused // 2, (len(exhausted), reset[:3])
            assert all("concurrent" in d for d in exhausted), exhausted[:3]
            assert not others, others[:3]
    finally:
        flood_over.set()
        for c in calls:
            c.cancel()
        joined_by = time.monotonic() + 30
        for t in threads:
            t.join(max(0.0, joined_by - time.monotonic()))
        channel.close()
    # Once the flood is gone, ordinary calls are admitted again.
    wait_for(
        lambda: env.gateway.stub.ListGroups(gateway_pb2.ListGroupsRequest(), timeout=5),
        60,
        "the gateway admitting calls again",
    )
    assert_all_healthy(env)


# --- fuzzing every RPC --------------------------------------------------------------------

READ_ONLY = {
    ("Gateway", "Metadata"),
    ("Gateway", "DescribeTopics"),
    ("Gateway", "DescribeCluster"),
    ("Gateway", "ListOffsets"),
    ("Gateway", "Fetch"),
    ("Gateway", "Subscribe"),
    ("Gateway", "FetchOffsets"),
    ("Gateway", "ListGroups"),
    ("Gateway", "InitProducerId"),
    ("Storage", "ListOffsets"),
    ("Storage", "OffsetForLeaderEpoch"),
    ("Storage", "DescribeLogDirs"),
    ("Controller", "DescribeCluster"),
    ("Controller", "Metadata"),
    ("Controller", "AllocateProducerIds"),
}
"""Methods that must change no observable state whatever they are asked (producer id
blocks are not part of the snapshot)."""

CONTROL_PLANE = {
    ("Storage", "LeaderAndIsr"),
    ("Storage", "UpdateMetadata"),
    ("Storage", "StopReplica"),
    ("Controller", "AlterPartition"),
    ("Controller", "ControlledShutdown"),
}
"""Requests that carry a broker's registration epoch as their credential. One with the
right epoch is indistinguishable from the real sender (tidelog has no authentication, see
docs/RELIABILITY.md), so the fuzzer only sends wrong epochs to these."""

FUZZ_METHODS = all_methods()


def _pools(e: Env) -> Pools:
    snap = quiet_snapshot(e)
    offsets = {v for logs in snap.logs.values() for state in logs.values() for v in state}
    epochs = {p[1] for p in snap.partitions.values()} | {p[3] for p in snap.partitions.values()}
    return Pools(
        strings=(
            *TOPICS,
            GROUP,
            "no-such-topic",
            "retention.ms",
            "min.insync.replicas",
            "cleanup.policy",
            "unclean.leader.election.enable",
            "segment.bytes",
            "1",
            "-1",
            "true",
            "compact",
            "9" * 30,
            "127.0.0.1",
        ),
        ints=tuple(sorted(offsets | epochs)),
        by_field={
            "replica_id": (-1, 0, 1, 999),
            "broker_id": (0, 1, 999),
            "partition": (0, 1, 2),
            "acks": (common_pb2.NONE_ACKS, common_pb2.LEADER, common_pb2.ALL),
            "broker_epoch": tuple(b.broker_epoch for b in e.cluster.describe_cluster().brokers),
        },
    )


def _channel_for(e: Env, service: str, broker: int) -> grpc.Channel:
    if service == "Gateway":
        return e.channels["gateway"]
    if service == "Controller":
        return e.channels["controller"]
    return e.storage(broker)


def _tame(e: Env, m: pb_descriptor.MethodDescriptor, request: Any) -> None:
    """Keep an accepted random request from costing minutes or wrecking the fixtures the
    other examples need, without making it less hostile where it is refused."""
    key = (m.containing_service.name, m.name)
    for field_name in ("max_wait_ms", "timeout_ms"):
        # Long polls and acks waits are exercised elsewhere; here they would only cost time.
        if (
            field_name in m.input_type.fields_by_name
            and 100 < getattr(request, field_name) <= 60_000
        ):
            setattr(request, field_name, 100)
    if m.name in ("CreateTopics", "CreatePartitions"):
        # Thousands of real partitions on 2 cores would slow every later example; big
        # counts still go through full validation.
        sizes = [getattr(t, "num_partitions", 0) or getattr(t, "count", 0) for t in request.topics]
        if any(size > 4 for size in sizes):
            request.validate_only = True
    if m.name == "IncrementalAlterConfigs" and any(t.name in TOPICS for t in request.topics):
        # A retention of 1 ms (say) on a fixture topic would delete what later examples
        # compare; the change is still fully validated.
        request.validate_only = True
    if m.name == "DeleteTopics":
        names = [n for n in request.names if n not in TOPICS]
        del request.names[:]
        request.names.extend(names)
    if key in CONTROL_PLANE:
        real = {(b.broker_id, b.broker_epoch) for b in e.cluster.describe_cluster().brokers}
        epochs = {epoch for _, epoch in real}
        if m.containing_service.name == "Storage":
            assume(request.broker_epoch not in epochs)
        else:
            assume((request.broker_id, request.broker_epoch) not in real)


_FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=FUZZ_SEED is None,
    database=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)


def _with_seed(test: Any) -> Any:
    return hypothesis_seed(int(FUZZ_SEED))(test) if FUZZ_SEED is not None else test


@pytest.fixture(scope="module")
def pools(env: Env) -> Pools:
    return _pools(env)


@pytest.mark.parametrize(
    "m",
    FUZZ_METHODS,
    ids=[f"{m.containing_service.name}.{m.name}" for m in FUZZ_METHODS],
)
@_with_seed
@_FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_every_rpc(
    env: Env, pools: Pools, m: pb_descriptor.MethodDescriptor, data: Any
) -> None:
    service = m.containing_service.name
    key = (service, m.name)
    strategy = message_strategy(m.input_type, pools)
    count = data.draw(st.integers(1, 3), label="messages") if m.client_streaming else 1
    requests = [data.draw(strategy, label="request") for _ in range(count)]
    for request in requests:
        _tame(env, m, request)
    broker = data.draw(st.sampled_from(sorted(env.cluster.brokers)), label="broker")
    before = quiet_snapshot(env)
    timeout_s = 2.0 if m.server_streaming else 15.0
    result = call(_channel_for(env, service, broker), m, requests, timeout_s, max_responses=3)
    assert result.status not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (
        f"{service}.{m.name} answered {result.status.name}: {result.details}\n{env.cluster.logs()}"
    )
    if result.status not in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED):
        assert result.details, f"{service}.{m.name} {result.status.name} without a message"
    codes = [c for r in result.responses for c in error_codes(r)]
    assert ErrorCode.UNKNOWN_SERVER_ERROR not in codes, (
        f"{service}.{m.name}: {result.responses}\n{env.cluster.logs()}"
    )
    assert_all_healthy(env)
    refused = result.status != grpc.StatusCode.OK or (
        bool(codes) and all(c != ErrorCode.NONE for c in codes)
    )
    if refused or key in READ_ONLY:
        assert_unchanged(before, quiet_snapshot(env), f"{service}.{m.name} ({result.status.name})")


def test_fuzz_covers_every_rpc() -> None:
    """The fuzz list comes from the descriptors; this pins that it sees all three services
    (a new RPC is fuzzed automatically; a missing service would be silent)."""
    services = {m.containing_service.name for m in FUZZ_METHODS}
    assert services == {"Gateway", "Storage", "Controller"}
    assert len(FUZZ_METHODS) >= 33
