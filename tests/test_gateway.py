"""The gateway and the SDK end to end: real etcd, 3 storage nodes, a controller and
gateways as processes, talked to over gRPC by the SDK and by raw stubs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from array import array
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import tidelog
from services.cluster_metadata import (
    GROUPS_PREFIX,
    broker_key,
    deletion_key,
    encode_broker,
    encode_partition,
    encode_topic,
    partition_key,
    partitions_prefix,
    topic_key,
)
from services.controller.state import Broker, PartitionRecord, Topic
from services.gateway.channels import Channels, ChannelSweeper, broker_address
from services.gateway.fetch import FetchHandler, FetchLimits
from services.gateway.groups import offset_key
from services.gateway.leader_calls import LeaderCalls
from services.gateway.metadata_cache import Leader, MetadataCache, MetadataView, TopicKeyRead
from services.gateway.node import GatewayNode, GatewayNodeConfig
from services.gateway.produce import ProduceHandler, ProduceLimits
from services.gateway.router import Router
from services.gateway.server import GatewayServicer
from services.metastore import DeleteOp, KeyValue, MetaStore, PutOp, WatchEvent
from services.status import to_error_proto
from tests.support.cluster import (
    GatewayProcess,
    TestCluster,
    poll_records,
    rpc_error_code,
    running_cluster,
    wait_for,
)
from tests.support.process import REPO_ROOT, tidelog_env
from tidelog.consumer import MAX_FETCHES_IN_FLIGHT
from tidelog.errors import (
    BrokerNotAvailableError,
    ConfigError,
    ErrorCode,
    InconsistentTopicIdError,
    InvalidGroupIdError,
    MessageTooLargeError,
    NetworkError,
    NotLeaderOrFollowerError,
    OffsetOutOfRangeError,
    RequestTimedOutError,
    TopicAlreadyExistsError,
    UnknownServerError,
    UnknownTopicOrPartitionError,
)
from tidelog.formats import INT32_MAX, MAX_PRODUCE_REQUEST_BYTES
from tidelog.partitioner import partition_for_key
from tidelog.producer import BatchMetadata
from tidelog.records import (
    BATCH_OVERHEAD_BYTES,
    RECORD_OVERHEAD_BYTES,
    batch_overhead_bytes,
    decode_batches,
    encode_batch,
)
from tidelog.v1 import common_pb2, controller_pb2, gateway_pb2, gateway_pb2_grpc, storage_pb2


def _consume_all(address: str, topic: str, expected: int, group: str | None = None) -> list:
    with tidelog.Consumer(address, group_id=group, auto_offset_reset="earliest") as consumer:
        consumer.subscribe([topic])
        records: list = []
        deadline = time.monotonic() + 30
        while len(records) < expected and time.monotonic() < deadline:
            records.extend(consumer.poll(max_records=10_000, timeout_ms=500))
        if group is not None:
            consumer.commit()
        return records


@pytest.mark.parametrize("acks", ["0", "1", "all"])
def test_produce_each_acks_level_and_consume_back(
    gateway: GatewayProcess, admin: tidelog.Admin, acks: str
) -> None:
    topic = f"acks-{acks}"
    admin.create_topic(topic, partitions=3, replication_factor=3)
    sent = [f"{acks}-{i}".encode() for i in range(2_000)]
    keys = [f"k{i % 37}".encode() for i in range(2_000)]
    with tidelog.Producer(
        gateway.address, acks=acks, enable_idempotence=acks == "all", linger_ms=2
    ) as producer:
        futures = [producer.send(topic, v, key=k) for v, k in zip(sent[:1000], keys, strict=False)]
        batch = producer.send_batch(topic, sent[1000:], keys=keys[1000:]).result(30)
        metadata = [f.result(30) for f in futures] + list(batch)
    records = _consume_all(gateway.address, topic, len(sent))
    assert sorted(r.value for r in records) == sorted(sent)
    # The same key always lands on the partition Kafka's partitioner picks for it.
    by_value = {r.value: r for r in records}
    for value, key in zip(sent, keys, strict=True):
        assert by_value[value].partition == partition_for_key(key, 3)
        assert by_value[value].key == key
    if acks == "0":
        assert all(m.offset == -1 for m in metadata)
    else:
        # Every acknowledged offset holds exactly the record acknowledged there.
        for value, m in zip(sent, metadata, strict=True):
            record = by_value[value]
            assert (record.partition, record.offset) == (m.partition, m.offset)


def test_headers_null_keys_and_values_survive(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    admin.create_topic("shapes", partitions=1, replication_factor=2)
    with tidelog.Producer(gateway.address) as producer:
        producer.send("shapes", b"v1", headers=[("h", b"x"), ("n", None)]).result(30)
        producer.send("shapes", None, key=b"tombstone").result(30)
    records = _consume_all(gateway.address, "shapes", 2)
    assert [(r.key, r.value, r.headers) for r in records] == [
        (None, b"v1", (("h", b"x"), ("n", None))),
        (b"tombstone", None, ()),
    ]


@pytest.mark.parametrize("direct", [False, True])
def test_a_log_append_time_topic_gives_records_the_leaders_time(
    gateway: GatewayProcess, admin: tidelog.Admin, direct: bool
) -> None:
    """message.timestamp.type=LogAppendTime (Kafka's): the producer's timestamps are
    replaced by the leader's clock at the append, which RecordMetadata reports and every
    replica serves (the replicas hold the leader's bytes)."""
    topic = f"append-time-{direct}"
    admin.create_topic(
        topic,
        partitions=1,
        replication_factor=3,
        config={"message.timestamp.type": "LogAppendTime"},
    )
    old_ms = int(time.time() * 1000) - 3 * 24 * 3600 * 1000
    before_ms = int(time.time() * 1000)
    with tidelog.Producer(gateway.address, acks="all", direct=direct) as producer:
        metadata = [producer.send(topic, f"v{i}".encode(), timestamp_ms=old_ms) for i in range(5)]
        stamps = [m.result(30).timestamp_ms for m in metadata]
    assert all(stamp >= before_ms for stamp in stamps)
    records = _consume_all(gateway.address, topic, 5)
    assert [(r.offset, r.timestamp_ms) for r in records] == list(enumerate(stamps))
    assert admin.describe_topic(topic).configs["message.timestamp.type"] == "LogAppendTime"


def _consume_records(consumer: tidelog.Consumer, expected: int) -> list:
    records: list = []
    deadline = time.monotonic() + 30
    while len(records) < expected and time.monotonic() < deadline:
        records.extend(consumer.poll(timeout_ms=500))
    return records


def test_groups_commit_and_fetch_through_two_gateways(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    admin.create_topic("grouped", partitions=2, replication_factor=3)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch("grouped", [b"x"] * 100).result(30)
    _consume_all(gateway.address, "grouped", 100, group="readers/1")
    other = cluster.start_gateway()
    described = tidelog.Admin(other.address).describe_group("readers/1")
    assert sum(p.committed_offset for p in described) == 100
    assert all(p.lag == 0 for p in described)
    assert "readers/1" in tidelog.Admin(other.address).list_groups()
    # A new consumer in the group resumes where the group left off: nothing to read.
    with tidelog.Consumer(other.address, group_id="readers/1") as consumer:
        consumer.subscribe(["grouped"])
        assert consumer.poll(timeout_ms=300) == []
        assert sum(consumer.position(("grouped", p)) for p in range(2)) == 100


def test_a_recreated_topic_starts_without_the_old_topics_offsets(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Offsets belong to one incarnation of a topic (its topic id), as Kafka deletes a
    deleted topic's offsets: a group must not resume a re-created topic at the old
    topic's position and skip the new records below it."""
    admin.create_topic("reborn", partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch("reborn", [b"old"] * 50).result(30)
    _consume_all(gateway.address, "reborn", 50, group="rebirth")
    assert [p.committed_offset for p in admin.describe_group("rebirth")] == [50]
    admin.delete_topic("reborn")
    assert admin.describe_group("rebirth") == []  # the topic is gone, and its offsets
    _create_once_deleted(admin, "reborn", partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch("reborn", [b"new"] * 10).result(30)
    assert admin.describe_group("rebirth") == []
    with tidelog.Consumer(gateway.address, group_id="rebirth") as consumer:
        consumer.subscribe(["reborn"])
        assert consumer.committed([("reborn", 0)]) == {("reborn", 0): -1}
    # auto_offset_reset applies again: every new record is read, none skipped.
    records = _consume_all(gateway.address, "reborn", 10, group="rebirth")
    assert [r.value for r in records] == [b"new"] * 10
    assert [p.committed_offset for p in admin.describe_group("rebirth")] == [10]


def _poll_up_to(consumer: tidelog.Consumer, n: int, timeout_s: float) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got.extend(consumer.poll(timeout_ms=300))
    return got


def test_a_stale_position_is_not_committed_into_a_recreated_topic(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A consumer that has not noticed its topic was deleted and created again commits
    (here: close's auto-commit) its position in the old topic. The gateway tagged it with
    the new topic's id, and the group resumed the new topic at the old position, skipping
    the new records below it. A commit names the incarnation its offsets were read in
    now, and another one is refused INCONSISTENT_TOPIC_ID. Found by an audit."""
    topic, group = "reborn-stale", "reborn-stale-group"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [b"old"] * 5, partition=0).result(30)
    old = tidelog.Consumer(gateway.address, group_id=group, auto_offset_reset="earliest")
    old.assign([(topic, 0)])
    assert len(_poll_up_to(old, 5, 20)) == 5
    admin.delete_topic(topic)
    _create_once_deleted(admin, topic, partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [b"new%d" % i for i in range(10)], partition=0).result(30)
    with pytest.raises(InconsistentTopicIdError, match="deleted and created again"):
        old.commit()  # position 5, in the old topic
    old.close()  # its auto-commit is refused the same way
    with tidelog.Consumer(gateway.address, group_id=group, auto_offset_reset="earliest") as c:
        c.assign([(topic, 0)])
        assert c.committed([(topic, 0)]) == {(topic, 0): -1}
        records = _poll_up_to(c, 10, 20)
    assert [r.value for r in records] == [b"new%d" % i for i in range(10)]


def test_a_group_member_resumes_a_recreated_topic_from_its_start(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """The same through subscribe: the member's auto-commit in its next poll, before a
    fetch tells it the topic is new, wrote its old position under the new topic id, and
    the member itself then resumed the new topic there (found by an audit)."""
    topic, group = "reborn-member", "reborn-member-group"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [b"old"] * 5, partition=0).result(30)
    with tidelog.Consumer(
        gateway.address,
        group_id=group,
        auto_offset_reset="earliest",
        auto_commit_interval_ms=1_000,
        session_timeout_ms=10_000,
        heartbeat_interval_ms=500,
    ) as consumer:
        consumer.subscribe([topic])
        assert len(_poll_up_to(consumer, 5, 20)) == 5
        # The application is busy; meanwhile the topic is deleted and created again.
        admin.delete_topic(topic)
        _create_once_deleted(admin, topic, partitions=1, replication_factor=1)
        with tidelog.Producer(gateway.address) as producer:
            producer.send_batch(topic, [b"new%d" % i for i in range(10)], partition=0).result(30)
        time.sleep(1.2)  # an auto-commit is due at the next poll
        records = _poll_up_to(consumer, 10, 20)
    assert [r.value for r in records] == [b"new%d" % i for i in range(10)]


def test_a_deleted_topics_offsets_are_deleted_with_it(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Kafka deletes a deleted topic's committed offsets; they used to stay in etcd for
    ever, and a group that had only them stayed listed. Offsets of other topics stay, and
    so does one tagged with another incarnation's topic id (a commit for a topic created
    since under the same name must never be lost to the clean-up)."""
    admin.create_topic("doomed", partitions=2, replication_factor=3)
    admin.create_topic("spared", partitions=1, replication_factor=3)
    for group, topics in (("both", ("doomed", "spared")), ("only-doomed", ("doomed",))):
        with tidelog.Consumer(gateway.address, group_id=group) as consumer:
            consumer.commit({(t, p): 7 for t in topics for p in range(2 if t == "doomed" else 1)})
    other_incarnation = offset_key("stranger", "doomed", 0)
    cluster.store.put(other_incarnation, b'{"offset": 3, "topic_id": "another-topic-id"}')
    assert {"both", "only-doomed"} <= set(admin.list_groups())
    admin.delete_topic("doomed")
    wait_for(
        lambda: cluster.store.get(deletion_key("doomed")) is None,
        60,
        "the deletion to complete",
    )
    left = [kv.key for kv in cluster.store.get_prefix(GROUPS_PREFIX)]
    assert [k for k in left if "/doomed/" in k] == [other_incarnation]
    assert "only-doomed" not in admin.list_groups()
    assert [(p.topic, p.committed_offset) for p in admin.describe_group("both")] == [("spared", 7)]
    cluster.store.delete(other_incarnation)


def test_iterating_moves_the_position_one_record_at_a_time(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """`for record in consumer` left with break, then closed with auto-commit on, commits
    the record after the last one the loop was given (as kafka-python's iterator does),
    and a poll resumes right there. It used to commit past the whole poll's worth (500
    records) taken before the first was handed out: the rest were lost to the group."""
    admin.create_topic("iterated", partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch("iterated", [b"r%d" % i for i in range(100)], partition=0).result(30)
    with tidelog.Consumer(
        gateway.address, group_id="iterating", auto_offset_reset="earliest"
    ) as consumer:
        consumer.assign([("iterated", 0)])
        for record in consumer:
            if record.offset == 9:
                break
        assert consumer.position(("iterated", 0)) == 10
        assert [r.offset for r in consumer.poll(max_records=5)] == [10, 11, 12, 13, 14]
        for record in consumer:
            if record.offset == 19:
                break
    assert admin.describe_group("iterating")[0].committed_offset == 20
    with tidelog.Consumer(gateway.address, group_id="iterating") as consumer:
        consumer.assign([("iterated", 0)])
        assert [r.value for r in _consume_records(consumer, 80)] == [
            b"r%d" % i for i in range(20, 100)
        ]
        consumer.unsubscribe()
        with pytest.raises(ConfigError, match="not subscribed to any topic or assigned"):
            consumer.poll(timeout_ms=10)


def test_reassigning_commits_the_progress_of_what_it_drops(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """With auto-commit on, assign() and subscribe() commit the positions of the partitions
    they drop, as Kafka's do: those positions used to be forgotten, and whoever read the
    partition next re-read everything since the last auto-commit."""
    admin.create_topic("reassigned", partitions=2, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        for p in range(2):
            producer.send_batch("reassigned", [b"x"] * 20, partition=p).result(30)
    with tidelog.Consumer(
        gateway.address,
        group_id="reassigning",
        auto_offset_reset="earliest",
        auto_commit_interval_ms=600_000,  # only the reassignments can commit
    ) as consumer:
        consumer.assign([("reassigned", 0)])
        assert len(_consume_records(consumer, 20)) == 20
        consumer.assign([("reassigned", 1)])
        assert consumer.committed([("reassigned", 0)]) == {("reassigned", 0): 20}
        assert len(_consume_records(consumer, 20)) == 20
        consumer.subscribe(["reassigned"])
        assert consumer.committed([("reassigned", 1)]) == {("reassigned", 1): 20}


def test_a_subscription_reads_on_when_one_of_its_topics_is_deleted(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A subscribed topic deleted: the consumer goes on with the others (Kafka's does).
    Its next leader look-up used to raise UNKNOWN_TOPIC_OR_PARTITION from every poll, at
    once and for ever, delivering nothing of the other topics."""
    admin.create_topic("sub-kept", partitions=1, replication_factor=1)
    admin.create_topic("sub-deleted", partitions=1, replication_factor=1)
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.subscribe(["sub-kept", "sub-deleted"])
        with tidelog.Producer(gateway.address) as producer:
            producer.send("sub-kept", b"before", partition=0).result(30)
            producer.send("sub-deleted", b"before", partition=0).result(30)
            assert len(_consume_records(consumer, 2)) == 2
            admin.delete_topic("sub-deleted")
            producer.send("sub-kept", b"after", partition=0).result(30)
        assert [r.value for r in _consume_records(consumer, 1)] == [b"after"]
        wait_for(
            lambda: (
                (consumer.poll(timeout_ms=100) == [] and consumer.assignment() == [("sub-kept", 0)])
                or None
            ),
            30,
            "the deleted topic's partition to leave the assignment",
        )


def _delete_and_create_again(admin: tidelog.Admin, topic: str, partitions: int = 1) -> None:
    """Delete ``topic`` and create it again (a new topic id) once its deletion is done."""
    admin.delete_topic(topic)
    _create_once_deleted(admin, topic, partitions=partitions)


def _create_once_deleted(admin: tidelog.Admin, topic: str, **options: Any) -> None:
    """Create ``topic`` again once the deletion of its last incarnation is done (until the
    brokers confirm it, creating is refused, as in Kafka)."""

    def created() -> bool:
        try:
            admin.create_topic(topic, **options)
        except TopicAlreadyExistsError:  # the deletion is not complete yet
            return False
        return True

    wait_for(created, 30, f"{topic} created again")


def _produce_batch(
    gateway: GatewayProcess,
    topic: str,
    records: bytes,
    *,
    partition: int = 0,
    acks: common_pb2.Acks.ValueType = common_pb2.LEADER,
    timeout_ms: int = 0,
    deadline_s: float = 10,
) -> gateway_pb2.ProducePartitionResult:
    """One encoded batch produced through the gateway's unary Produce; its one result.
    ``timeout_ms`` is the request's (0: the gateway's default), ``deadline_s`` the call's."""
    response = gateway.stub.Produce(
        gateway_pb2.ProduceRequest(
            acks=acks,
            timeout_ms=timeout_ms,
            partitions=[
                gateway_pb2.ProducePartitionData(topic=topic, partition=partition, records=records)
            ],
        ),
        timeout=deadline_s,
    )
    result: gateway_pb2.ProducePartitionResult = response.partitions[0]
    return result


@pytest.mark.parametrize("reset", ["none", "earliest"])
def test_records_buffered_before_an_offset_retention_deleted_are_handed_out_first(
    gateway: GatewayProcess, admin: tidelog.Admin, reset: str
) -> None:
    """A fetch reading ahead of the position (records 2-3 buffered, the fetch asks from
    4) finds retention has deleted its offset (the log starts at 6): records 2 and 3 are
    still handed out, and only then does the fetch at the position apply
    auto_offset_reset, as Kafka's consumer resets only a fetch at its position. Before,
    "none" raised with records 2 and 3 still undelivered, and "earliest" dropped them."""
    topic = f"read-ahead-gone-{reset}"
    # Retention by time, 5 s after the records' timestamps (now): by size it could run
    # before the consumer's first fetch and move the log start under it.
    admin.create_topic(topic, config={"segment.bytes": "1500", "retention.ms": "5000"})
    small = encode_batch([b"a" * 10, b"b" * 10])  # timestamps: now
    large = encode_batch([b"c" * 300, b"d" * 300])
    # The last record is stamped ten minutes ahead so that it outlives the rest: the
    # active segment expires too once all its records have (Kafka's rule).
    later_ms = int(time.time() * 1000) + 600_000
    last = encode_batch([b"e" * 1000], base_timestamp_ms=later_ms)
    for records in [small, large] + [encode_batch([b"e" * 1000])] * 2 + [last]:
        assert ErrorCode(_produce_batch(gateway, topic, records).error.code) == ErrorCode.NONE
    # The first fetch brings exactly the first two batches, which fill the buffer: no
    # fetch reads ahead until the first batch is handed out.
    with tidelog.Consumer(
        gateway.address, auto_offset_reset=reset, fetch_max_bytes=len(small) + len(large)
    ) as consumer:
        consumer.assign([(topic, 0)])
        consumer.seek((topic, 0), 0)
        got = [r.value for r in consumer.poll(max_records=1, timeout_ms=10_000)]
        wait_for(
            lambda: admin.describe_topics([topic])[0].partitions[0].log_start_offset == 6,
            30,
            "retention up to the active segment (offset 6)",
        )
        got += [r.value for r in consumer.poll(max_records=1, timeout_ms=10_000)]
        # Record 1 freed the buffer: this poll sends the fetch reading ahead from offset 4
        # (out of range now) and hands out record 2.
        got += [r.value for r in consumer.poll(max_records=1, timeout_ms=10_000)]
        wait_for(lambda: not consumer._answered.empty(), 10, "the read-ahead's answer")
        got += [r.value for r in consumer.poll(max_records=1, timeout_ms=10_000)]
        assert got == [b"a" * 10, b"b" * 10, b"c" * 300, b"d" * 300]
        if reset == "none":
            with pytest.raises(OffsetOutOfRangeError):
                consumer.poll(timeout_ms=10_000)
        else:
            after = consumer.poll(timeout_ms=10_000)
            assert [(r.offset, r.value) for r in after] == [(6, b"e" * 1000)]


@pytest.mark.parametrize("direct", [False, True])
def test_producers_spread_over_partitions_added_to_a_topic(
    gateway: GatewayProcess, admin: tidelog.Admin, direct: bool
) -> None:
    """Found by an audit: a producer looked a topic's partition count up once and kept it,
    so after create_partitions every keyed and keyless record still went to the old
    partitions (and after a re-create with fewer partitions, keys of the missing ones
    failed for good). The count is looked up again after metadata_max_age_ms."""
    topic = f"growing-{direct}"
    admin.create_topic(topic, partitions=1)
    keys = [b"k%d" % i for i in range(64)]
    with tidelog.Producer(gateway.address, direct=direct, metadata_max_age_ms=200) as producer:
        assert producer.partitions_for(topic) == [0]
        before = {producer.send(topic, b"v", key=k).result(30).partition for k in keys}
        assert before == {0}
        admin.create_partitions(topic, 4)
        wait_for(lambda: len(admin.describe_topic(topic).partitions) == 4, 10, "4 partitions")
        # Past metadata_max_age_ms a send (or this) starts a look-up, answering from the
        # count known meanwhile, as Kafka's producer does.
        wait_for(lambda: producer.partitions_for(topic) == [0, 1, 2, 3], 10, "the new count")
        after = [producer.send(topic, b"v", key=k).result(30).partition for k in keys]
        assert after == [partition_for_key(k, 4) for k in keys]
        assert set(after) == {0, 1, 2, 3}


def test_a_producer_places_keys_by_the_count_of_a_topic_re_created_smaller(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """The other half of the audit's finding: after a topic was re-created with 2
    partitions instead of 4, a key of partition 3 failed for good. Now the
    UNKNOWN_TOPIC_OR_PARTITION answer makes the producer look the count up again, so the
    record in flight fails (its partition is gone, as in Kafka) and the next one with
    that key lands on the new count's partition."""
    topic = "shrunk"
    admin.create_topic(topic, partitions=4)
    key = next(b"k%d" % i for i in range(100) if partition_for_key(b"k%d" % i, 4) == 3)
    with tidelog.Producer(gateway.address, delivery_timeout_ms=3_000) as producer:
        assert producer.send(topic, b"first", key=key).result(30).partition == 3
        _delete_and_create_again(admin, topic, partitions=2)
        with pytest.raises(UnknownTopicOrPartitionError):
            producer.send(topic, b"lost", key=key).result(30)
        again = producer.send(topic, b"again", key=key).result(30)
        assert again.partition == partition_for_key(key, 2)


def test_a_cancelled_future_does_not_stop_the_producer(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Found by an audit: a future its caller cancelled (asyncio.wait_for on a timeout
    does) made set_result raise InvalidStateError on the thread completing batches; it
    died, and flush(), close() and every later send waited for ever. Now the cancelled
    future only loses its result: the record is written and the rest go on."""
    admin.create_topic("cancelled")
    with tidelog.Producer(gateway.address, linger_ms=300) as producer:
        futures = [producer.send("cancelled", b"v%d" % i, partition=0) for i in range(5)]
        assert futures[0].cancel()

        async def give_up() -> None:
            sent = asyncio.wrap_future(producer.send("cancelled", b"waited", partition=0))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(sent, 0.01)

        asyncio.run(give_up())
        producer.flush(timeout_s=30)
        assert [f.result(0).offset for f in futures[1:]] == [1, 2, 3, 4]
        assert producer.send("cancelled", b"later", partition=0).result(30).offset == 6


def test_flush_and_close_in_a_done_callback_do_not_deadlock(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Found by an audit: done-callbacks run on the producer's threads, so flush() in
    one waited for its own thread (every completion stalled until its timeout) and
    close() in one never returned. Now flush() there raises ConfigError (as Kafka's
    does) and close() stops accepting sends and returns at once (Kafka's close(0))."""
    admin.create_topic("callbacks")
    seen: list[BaseException | None] = []
    closed = threading.Event()
    with tidelog.Producer(gateway.address) as producer:

        def flush_in_callback(_: Any) -> None:
            try:
                producer.flush(timeout_s=30)
            except BaseException as exc:
                seen.append(exc)
            else:
                seen.append(None)

        future = producer.send("callbacks", b"a")
        future.add_done_callback(flush_in_callback)
        future.result(30)
        assert producer.send("callbacks", b"b").result(30).offset == 1
        wait_for(lambda: seen, 10, "the callback")
        assert isinstance(seen[0], ConfigError)

        def close_in_callback(_: Any) -> None:
            producer.close()
            closed.set()

        last = producer.send("callbacks", b"c")
        last.add_done_callback(close_in_callback)
        assert last.result(30).offset == 2
        assert closed.wait(10)
        with pytest.raises(ConfigError, match="closed"):
            producer.send("callbacks", b"d")


def test_flush_and_close_do_not_wait_for_other_threads_later_sends(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Found by an audit: flush() waited until nothing at all was unfinished, so while
    another thread kept sending it returned only when that thread stopped; close()
    flushed before it stopped accepting sends, so it could not end either. Now flush()
    waits for what was sent before it, and close() refuses sends first."""
    admin.create_topic("busy", partitions=2)
    stop = threading.Event()
    outcome: list[BaseException] = []
    with tidelog.Producer(gateway.address, linger_ms=0) as producer:

        def keep_sending() -> None:
            deadline = time.monotonic() + 120
            try:
                while not stop.is_set() and time.monotonic() < deadline:
                    producer.send("busy", b"other", partition=1)
            except BaseException as exc:
                outcome.append(exc)

        sender = threading.Thread(target=keep_sending)
        sender.start()
        try:
            mine = producer.send("busy", b"mine", partition=0)
            producer.flush(timeout_s=60)
            assert mine.done() and sender.is_alive()  # the other thread still sending
            producer.close(timeout_s=60)
            sender.join(10)
            assert not sender.is_alive()
            assert isinstance(outcome[0], ConfigError)  # refused once close() began
        finally:
            stop.set()
            sender.join(10)


@pytest.mark.parametrize("direct", [False, True])
def test_records_queued_for_a_deleted_topic_never_land_in_its_successor(
    gateway: GatewayProcess, admin: tidelog.Admin, direct: bool
) -> None:
    """Found by an audit: batches were addressed by topic name only, so a batch queued
    for a topic that was then deleted and created again (a retry, or a producer with the
    old metadata) was written into the new topic and acknowledged. Requests now name the
    topic id the producer looked up, and the leader refuses another incarnation's
    (INCONSISTENT_TOPIC_ID, final); the producer looks the topic up again for the next
    records."""
    topic = f"reborn-{direct}"
    admin.create_topic(topic)
    with tidelog.Producer(gateway.address, direct=direct) as producer:
        assert producer.send(topic, b"old").result(30).offset == 0
        _delete_and_create_again(admin, topic)
        with pytest.raises(InconsistentTopicIdError):
            producer.send(topic, b"meant for the old topic").result(30)
        assert producer.send(topic, b"new").result(30).offset == 0
    assert [r.value for r in _consume_all(gateway.address, topic, 1)] == [b"new"]


def test_a_second_close_waits_for_what_a_callbacks_close_left(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Found by an audit: close() in a done-callback returns at once (Kafka's close(0)),
    and a later close() on the main thread returned at once too, as the producer was
    already closing: at exit the records still queued were dropped without a word. Every
    close() outside a callback now waits for what was queued, and the sender's end."""
    # Its own name per run: a rerun (pytest --reruns) shares the module's cluster.
    topic = f"second-close-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic)
    closed_in_callback = threading.Event()
    # Generous timeouts: 30 MB through one gateway on a loaded 2-core machine; what is
    # tested is that close() waits, not how fast.
    producer = tidelog.Producer(
        gateway.address, linger_ms=500, request_timeout_ms=120_000, delivery_timeout_ms=300_000
    )
    first = producer.send(topic, b"first")

    def close_in_callback(_: Any) -> None:
        producer.close()
        closed_in_callback.set()

    first.add_done_callback(close_in_callback)
    big = producer.send_batch(topic, [b"x" * 100] * 300_000)  # ~30 MB, still queued
    assert closed_in_callback.wait(60)
    producer.close()
    assert big.done() and len(big.result(0).offsets) == 300_000
    assert not producer._sender.is_alive()


def test_a_stale_partition_count_is_looked_up_without_holding_up_sends(
    cluster: TestCluster, admin: tidelog.Admin
) -> None:
    """Found by an audit: once a topic's count was older than metadata_max_age_ms, each
    send() looked it up on the caller's thread, so with the gateway hung (SIGSTOP) every
    send of a direct producer, whose leaders were fine, waited out request_timeout_ms.
    Sends now use the known count while a thread looks it up (as Kafka's sender does)."""
    topic = "stale-count"
    hung = cluster.start_gateway()
    admin.create_topic(topic)
    with tidelog.Producer(
        hung.address, direct=True, metadata_max_age_ms=100, request_timeout_ms=20_000
    ) as producer:
        producer.send(topic, b"warm").result(30)  # count, producer id, leaders known
        time.sleep(0.2)  # the count is stale now
        os.kill(hung.pid, signal.SIGSTOP)
        done = threading.Event()
        offsets: list[int] = []

        def send_some() -> None:
            for i in range(3):
                offsets.append(producer.send(topic, b"v%d" % i).result(60).offset)
            done.set()

        worker = threading.Thread(target=send_some)
        worker.start()
        try:
            # Each look-up on the caller's thread took the 20 s request timeout.
            assert done.wait(10), "sends waited for the hung gateway"
        finally:
            os.kill(hung.pid, signal.SIGCONT)
            worker.join(60)
        assert offsets == [1, 2, 3]


@pytest.mark.parametrize("direct", [False, True])
def test_a_consumer_starts_over_in_a_re_created_topic(
    gateway: GatewayProcess, admin: tidelog.Admin, direct: bool
) -> None:
    """A consumer at offset 10 of a topic that is deleted and created again: its fetches
    name the old topic id, the leader answers INCONSISTENT_TOPIC_ID (or the metadata
    shows the new id first), and the position is set again by auto_offset_reset. Before,
    it carried over and the new topic's first 10 records were skipped without a word."""
    topic = f"reborn-read-{direct}"
    admin.create_topic(topic)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [b"old-%d" % i for i in range(10)]).result(30)

    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest", direct=direct) as c:
        c.assign([(topic, 0)])
        assert poll_records(c, 10) == [(i, b"old-%d" % i) for i in range(10)]
        _delete_and_create_again(admin, topic)
        with tidelog.Producer(gateway.address) as producer:
            producer.send_batch(topic, [b"new-%d" % i for i in range(20)]).result(30)
        assert poll_records(c, 20) == [(i, b"new-%d" % i) for i in range(20)]


def test_a_partition_twice_in_one_commit_keeps_the_last_offset(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """etcd refuses a transaction writing one key twice, which used to come back as a
    retriable BROKER_NOT_AVAILABLE for the whole commit (a raw client retried forever):
    a partition named twice is committed once, at the last offset given for it."""
    admin.create_topic("commit-twice", partitions=2, replication_factor=1)
    response = gateway.stub.CommitOffsets(
        gateway_pb2.CommitOffsetsRequest(
            group_id="twice",
            offsets=[
                gateway_pb2.CommitOffset(topic="commit-twice", partition=1, offset=0),
                gateway_pb2.CommitOffset(topic="commit-twice", partition=0, offset=1),
                gateway_pb2.CommitOffset(topic="commit-twice", partition=0, offset=2),
            ],
        ),
        timeout=10,
    )
    assert [p.error.code for p in response.partitions] == [common_pb2.NONE] * 3
    committed = {p.partition: p.committed_offset for p in admin.describe_group("twice")}
    assert committed == {0: 2, 1: 0}


def test_consumer_settings_out_of_range_fail_at_construction_and_long_waits_are_clamped(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Values a fetch cannot carry (int32 fields) are refused when the consumer is made,
    not by every poll; a max_wait_ms past the gateway's 30 s limit is clamped, as the
    storage nodes and Kafka do, instead of failing every poll."""
    for setting in ("fetch_max_bytes", "max_partition_fetch_bytes", "fetch_max_wait_ms"):
        with pytest.raises(ConfigError, match=setting):
            tidelog.Consumer(gateway.address, **{setting: 2**31})
    with pytest.raises(ConfigError, match="fetch_min_bytes"):
        tidelog.Consumer(gateway.address, fetch_min_bytes=-1)
    admin.create_topic("long-waits", partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        producer.send("long-waits", b"x").result(30)
    answer = gateway.stub.Fetch(
        storage_pb2.FetchRequest(
            replica_id=-1,
            max_wait_ms=60_000,
            partitions=[storage_pb2.FetchPartition(topic="long-waits", partition=0)],
        ),
        timeout=10,
    )
    assert [p.error.code for p in answer.partitions] == [common_pb2.NONE]
    records = _consume_all(gateway.address, "long-waits", 1)
    assert [r.value for r in records] == [b"x"]
    with tidelog.Consumer(
        gateway.address, fetch_max_wait_ms=60_000, auto_offset_reset="earliest"
    ) as consumer:
        consumer.assign([("long-waits", 0)])
        for bad in (0, -1, 1.5):
            with pytest.raises(ConfigError, match="max_records must be an int >= 1"):
                consumer.poll(max_records=bad)  # type: ignore[arg-type]
        assert [r.value for r in consumer.poll(timeout_ms=10_000)] == [b"x"]


def test_a_commit_written_in_part_says_which_partitions_failed(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A commit of 200 partitions is written in two etcd transactions; when the second
    fails (here: etcd refuses its 400 KB over a 200 KB --max-request-bytes), the first 100
    answer NONE and are committed, the other 100 carry the error and are not. Before, the
    whole call failed though half of it was written."""
    base = tmp_path_factory.mktemp("partial-commit")
    with running_cluster(base, 1, etcd_args=["--max-request-bytes", "200000"]) as cluster:
        gateway = cluster.start_gateway()
        admin = tidelog.Admin(gateway.address)
        admin.create_topic("wide", partitions=200)
        offsets = [
            gateway_pb2.CommitOffset(
                topic="wide", partition=p, offset=p, metadata="" if p < 100 else "m" * 4000
            )
            for p in range(200)
        ]
        response = gateway.stub.CommitOffsets(
            gateway_pb2.CommitOffsetsRequest(group_id="g", offsets=offsets), timeout=30
        )
        codes = [ErrorCode(r.error.code) for r in response.partitions]
        assert codes[:100] == [ErrorCode.NONE] * 100
        # Refused for its size: final (not a retriable outage), nothing of it written.
        assert codes[100:] == [ErrorCode.INVALID_REQUEST] * 100
        assert "too large" in response.partitions[100].error.message
        fetched = gateway.stub.FetchOffsets(
            gateway_pb2.FetchOffsetsRequest(group_id="g"), timeout=10
        )
        assert [(o.partition, o.offset) for o in fetched.offsets] == [(p, p) for p in range(100)]


def test_commit_bad_input_changes_nothing(gateway: GatewayProcess, admin: tidelog.Admin) -> None:
    admin.create_topic("commits", partitions=1, replication_factor=1)
    stub = gateway.stub
    with pytest.raises(grpc.RpcError) as raised:
        stub.CommitOffsets(
            gateway_pb2.CommitOffsetsRequest(
                group_id="",
                offsets=[gateway_pb2.CommitOffset(topic="commits", partition=0, offset=1)],
            ),
            timeout=10,
        )
    assert rpc_error_code(raised.value) == ErrorCode.INVALID_GROUP_ID
    response = stub.CommitOffsets(
        gateway_pb2.CommitOffsetsRequest(
            group_id="g-bad",
            offsets=[
                gateway_pb2.CommitOffset(topic="commits", partition=7, offset=1),
                gateway_pb2.CommitOffset(
                    topic="commits", partition=0, offset=1, metadata="m" * 5000
                ),
                gateway_pb2.CommitOffset(topic="commits", partition=0, offset=-5),
            ],
        ),
        timeout=10,
    )
    codes = [ErrorCode(p.error.code) for p in response.partitions]
    assert codes == [
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
        ErrorCode.OFFSET_METADATA_TOO_LARGE,
        ErrorCode.INVALID_REQUEST,
    ]
    fetched = stub.FetchOffsets(gateway_pb2.FetchOffsetsRequest(group_id="g-bad"), timeout=10)
    assert list(fetched.offsets) == []
    with pytest.raises(InvalidGroupIdError):
        tidelog.Consumer(gateway.address, group_id="x" * 300).committed([("commits", 0)])


@pytest.mark.parametrize("min_bytes", [1, 300])
def test_a_fetch_across_leaders_answers_once_it_has_min_bytes(
    gateway: GatewayProcess, admin: tidelog.Admin, min_bytes: int
) -> None:
    """A raw client's fetch over partitions of several leaders long-polls them all; it
    answers as soon as the records found add up to min_bytes, counted over every leader.
    It used to wait out max_wait_ms when the only record was small (an answer that small
    was taken for one without records), or when min_bytes was only reached by two
    leaders' answers together (each leader was asked for all of it)."""
    topic = f"across-leaders-{min_bytes}"
    admin.create_topic(topic, partitions=3, replication_factor=1)
    leaders = {p.partition: p.leader for p in admin.describe_topic(topic).partitions}
    assert len(set(leaders.values())) == 3
    value = b"x" if min_bytes == 1 else b"y" * 200

    def produce_later() -> None:
        time.sleep(0.5)
        with tidelog.Producer(gateway.address) as producer:
            producer.send(topic, value, partition=0).result(30)
            if min_bytes > 1:
                producer.send(topic, value, partition=1).result(30)

    writer = threading.Thread(target=produce_later)
    writer.start()
    answer = gateway.stub.Fetch(
        storage_pb2.FetchRequest(
            replica_id=-1,
            max_wait_ms=25_000,
            min_bytes=min_bytes,
            partitions=[
                storage_pb2.FetchPartition(topic=topic, partition=p, fetch_offset=0)
                for p in range(3)
            ],
        ),
        # Well before max_wait_ms (25 s): a fetch waiting it out fails on this deadline.
        timeout=15,
    )
    writer.join()
    got = [r.value for p in answer.partitions for b in decode_batches(p.records) for r in b.records]
    assert value in got


def test_produce_and_fetch_bad_input(cluster: TestCluster, admin: tidelog.Admin) -> None:
    small = cluster.start_gateway(["--max-request-bytes", "2000", "--max-fetch-bytes", "100000"])
    admin.create_topic("bad-input", partitions=1, replication_factor=1)
    stub = small.stub
    batch = encode_batch([b"v"])
    # Unknown topic and partition: per-partition errors, the rest of the request proceeds.
    response = stub.Produce(
        gateway_pb2.ProduceRequest(
            acks=common_pb2.LEADER,
            partitions=[
                gateway_pb2.ProducePartitionData(topic="nope", partition=0, records=batch),
                gateway_pb2.ProducePartitionData(topic="bad-input", partition=3, records=batch),
                gateway_pb2.ProducePartitionData(topic="bad-input", partition=0, records=batch),
            ],
        ),
        timeout=10,
    )
    assert [ErrorCode(p.error.code) for p in response.partitions] == [
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
        ErrorCode.NONE,
    ]
    assert "does not exist" in response.partitions[1].error.message
    # Whole-request problems: a status with the code, and nothing is written.
    for request, code in [
        (
            gateway_pb2.ProduceRequest(
                acks=common_pb2.LEADER,
                partitions=[
                    gateway_pb2.ProducePartitionData(
                        topic="bad-input", partition=0, records=encode_batch([b"x" * 5000])
                    )
                ],
            ),
            ErrorCode.RECORD_LIST_TOO_LARGE,
        ),
        (
            gateway_pb2.ProduceRequest(
                acks=common_pb2.Acks.ValueType(9),
                partitions=[gateway_pb2.ProducePartitionData(topic="bad-input", records=batch)],
            ),
            ErrorCode.INVALID_REQUIRED_ACKS,
        ),
    ]:
        with pytest.raises(grpc.RpcError) as raised:
            stub.Produce(request, timeout=10)
        assert rpc_error_code(raised.value) == code, raised.value.details()
    # A corrupt batch is refused by the leader, per partition.
    corrupt = bytearray(batch)
    corrupt[-1] ^= 0xFF
    response = stub.Produce(
        gateway_pb2.ProduceRequest(
            acks=common_pb2.LEADER,
            partitions=[
                gateway_pb2.ProducePartitionData(
                    topic="bad-input", partition=0, records=bytes(corrupt)
                )
            ],
        ),
        timeout=10,
    )
    assert ErrorCode(response.partitions[0].error.code) == ErrorCode.CORRUPT_BATCH
    # Fetch: out of range per partition; a non-positive max_bytes as a whole.
    fetched = stub.Fetch(
        storage_pb2.FetchRequest(
            replica_id=-1,
            max_wait_ms=0,
            partitions=[
                storage_pb2.FetchPartition(topic="bad-input", partition=0, fetch_offset=99)
            ],
        ),
        timeout=10,
    )
    assert ErrorCode(fetched.partitions[0].error.code) == ErrorCode.OFFSET_OUT_OF_RANGE
    with pytest.raises(grpc.RpcError) as raised:
        stub.Fetch(storage_pb2.FetchRequest(replica_id=-1, max_bytes=0), timeout=10)
    assert rpc_error_code(raised.value) == ErrorCode.INVALID_FETCH_SIZE
    assert "positive" in raised.value.details()
    # Above the gateway's --max-fetch-bytes, a fetch is capped (as Kafka's broker does).
    with tidelog.Producer(admin.gateway, batch_bytes=1000) as producer:
        producer.send_batch("bad-input", [b"y" * 900] * 300, partition=0).result(30)
    capped = stub.Fetch(
        storage_pb2.FetchRequest(
            replica_id=-1,
            max_bytes=10**7,
            partitions=[
                storage_pb2.FetchPartition(
                    topic="bad-input", partition=0, fetch_offset=0, max_bytes=10**7
                )
            ],
        ),
        timeout=10,
    )
    assert 0 < len(capped.partitions[0].records) <= 100_000
    # Only the good records were written.
    records = _consume_all(small.address, "bad-input", 301)
    assert [r.value for r in records] == [b"v"] + [b"y" * 900] * 300


def test_every_request_of_a_produce_stream_is_answered_before_it_ends(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """The gateway ends a ProduceStream once the client has stopped sending and nothing is
    in flight. It counted a request out before queueing its answer, so a stream could end
    in between, and the client's last request was never answered (a CI run of the
    dropped-pools test saw 39 answers to 40). Short streams whose last answer races the
    end of their requests, many times."""
    topic = f"stream-ends-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, partitions=2, replication_factor=1)

    def request(i: int) -> gateway_pb2.ProduceRequest:
        return gateway_pb2.ProduceRequest(
            acks=common_pb2.LEADER,
            correlation_id=i,
            partitions=[
                gateway_pb2.ProducePartitionData(
                    topic=topic, partition=i % 2, records=encode_batch([b"v%d" % i])
                )
            ],
        )

    wait_for(
        lambda: (
            gateway.stub.Produce(request(0), timeout=30).partitions[0].error.code == common_pb2.NONE
            or None
        ),
        15,
        "the topic writable",
    )
    for n in range(300):
        count = 1 + n % 3
        answers = list(gateway.stub.ProduceStream(iter(map(request, range(count))), timeout=30))
        assert sorted(a.correlation_id for a in answers) == list(range(count)), n
        assert {a.partitions[0].error.code for a in answers} == {common_pb2.NONE}


def test_produce_stream_in_flight_limit(cluster: TestCluster, admin: tidelog.Admin) -> None:
    """A client with more requests unanswered than --max-in-flight-per-stream is read no
    further until one is answered (flow control), and every request is answered. The
    gateway used to end the stream with INVALID_REQUEST, failing every request in flight
    on it, records written among them: a producer whose pipeline was deeper than the
    gateway's limit failed for good what it had written (found by an audit)."""
    limited = cluster.start_gateway(["--max-in-flight-per-stream", "2"])
    admin.create_topic("streamed", partitions=1, replication_factor=3)
    wait_for(
        lambda: len(admin.describe_topic("streamed").partitions[0].isr) == 3 or None, 30, "ISR"
    )

    def requests() -> Iterator[gateway_pb2.ProduceRequest]:
        for i in range(50):
            yield gateway_pb2.ProduceRequest(
                acks=common_pb2.ALL,
                correlation_id=i,
                partitions=[
                    gateway_pb2.ProducePartitionData(
                        topic="streamed", partition=0, records=encode_batch([b"x" * 100_000])
                    )
                ],
            )

    answers = list(limited.stub.ProduceStream(requests(), timeout=60))
    assert sorted(a.correlation_id for a in answers) == list(range(50))
    assert {a.partitions[0].error.code for a in answers} == {common_pb2.NONE}
    offsets = sorted(a.partitions[0].base_offset for a in answers)
    assert offsets == list(range(50))  # each written once, in order


def test_idle_produce_streams_do_not_hold_up_other_calls(
    cluster: TestCluster, admin: tidelog.Admin
) -> None:
    """Each ProduceStream holds a server thread for as long as it is open (an SDK producer
    keeps one while it lives). With 64 threads and 1,024 admitted calls, 64 idle producers
    left every other call queued for a thread: Metadata and Produce timed out. Every
    admitted call now has a thread."""
    own = cluster.start_gateway()
    admin.create_topic("beside-idle-streams", partitions=1, replication_factor=1)
    release = threading.Event()

    def idle() -> Iterator[gateway_pb2.ProduceRequest]:
        release.wait(60)
        return
        yield  # a generator that sends nothing until released

    streams = [own.stub.ProduceStream(idle(), timeout=60) for _ in range(80)]
    try:
        wait_for(
            lambda: len(os.listdir(f"/proc/{own.pid}/task")) >= 64 + 8 or None,
            30,
            "the gateway to serve the streams on threads of their own",
        )
        own.stub.Metadata(controller_pb2.MetadataRequest(topics=["beside-idle-streams"]), timeout=5)
        with tidelog.Producer(own.address) as producer:
            assert producer.send("beside-idle-streams", b"v", partition=0).result(10).offset == 0
    finally:
        release.set()
        for stream in streams:
            stream.cancel()
        cluster.kill(own)


def test_init_producer_id_callers_get_an_answer_within_their_deadline_without_a_controller(
    cluster: TestCluster, admin: tidelog.Admin
) -> None:
    """With no controller to hand out a block of producer ids, concurrent InitProducerId
    calls each get the gateway's error before their deadline. They used to queue on the
    block request without a deadline, the k-th answered after k controller timeouts
    (10 s each), long after its client had given up."""
    own = cluster.start_gateway()  # a gateway without a block of ids yet
    controller = cluster.active_controller()
    controller_id = next(i for i, p in cluster.controllers.items() if p is controller)
    cluster.kill(controller)
    outcomes: list[str] = []

    def init() -> None:
        try:
            own.stub.InitProducerId(gateway_pb2.InitProducerIdRequest(), timeout=25)
            outcomes.append("an id")
        except grpc.RpcError as exc:
            outcomes.append(exc.details() or "")  # type: ignore[attr-defined]

    callers = [threading.Thread(target=init) for _ in range(4)]
    try:
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(60)
        assert len(outcomes) == 4
        assert "Deadline Exceeded" not in outcomes, outcomes  # the client's own deadline
    finally:
        cluster.start_controller(controller_id)
        cluster.active_controller()
        cluster.kill(own)


def test_admin_requests_answer_within_the_clients_deadline_without_a_controller(
    cluster: TestCluster,
) -> None:
    """An admin request retries the controller for at most its client's deadline (and
    timeout_ms, at most 300 s), then answers REQUEST_TIMED_OUT naming the reason. It used
    to retry for the whole timeout_ms (up to 24 days), holding a server thread after the
    client gave up, which then saw only its own bare deadline (found by an audit)."""
    own = cluster.start_gateway()
    controller = cluster.active_controller()
    controller_id = next(i for i, p in cluster.controllers.items() if p is controller)
    cluster.kill(controller)
    try:
        with pytest.raises(grpc.RpcError) as raised:
            own.stub.CreateTopics(
                controller_pb2.CreateTopicsRequest(
                    topics=[
                        controller_pb2.CreatableTopic(
                            name="never", num_partitions=1, replication_factor=1
                        )
                    ],
                    timeout_ms=600_000,
                ),
                timeout=2,
            )
        assert rpc_error_code(raised.value) == ErrorCode.REQUEST_TIMED_OUT, raised.value
        assert "no active controller answered in time" in (raised.value.details() or "")
    finally:
        cluster.start_controller(controller_id)
        cluster.active_controller()
        cluster.kill(own)


def test_one_malformed_topic_key_does_not_blind_the_metadata_view() -> None:
    """A topic value whose decoding trips on something unexpected ("configs": null raised
    AttributeError) is skipped like any unreadable key: it used to escape the view's
    load, so the topics after it were missing, and the watch and its reloads ended for
    good (found by an audit)."""

    def kv(key: str, value: bytes) -> KeyValue:
        return KeyValue(key, value, mod_revision=1, create_revision=1, version=1, lease_id=0)

    good = b'{"topic_id": "id-t", "assignment": [[1]], "configs": {}}'
    view = MetadataView()
    view.load(
        "topics/",
        [
            kv("topics/a-bad", b'{"topic_id": "x", "assignment": [[1]], "configs": null}'),
            kv("topics/b-listed", b'{"topic_id": "x", "assignment": [[1]], "configs": []}'),
            kv("topics/t", good),
        ],
        revision=1,
    )
    assert set(view.topics) == {"t"}


def test_the_metadata_view_shows_a_topic_key_read_once_at_or_past_its_revision() -> None:
    """What admin calls wait for: the topic key as etcd held it after the controller
    answered, or anything later (a later write, a delete, a re-create), never an exact
    state; and leaders from partition records of that incarnation, not an earlier one's."""

    def put(key: str, value: bytes, create: int, mod: int) -> WatchEvent:
        return WatchEvent("put", key, value, mod_revision=mod, create_revision=create, version=1)

    topic = b'{"topic_id": "id-t", "assignment": [[1]], "configs": {}}'
    led = encode_partition(PartitionRecord(leader=1, leader_epoch=0, isr=(1,), partition_epoch=0))
    view = MetadataView()
    view.load("topics/", [], revision=10)
    view.load("brokers/", [KeyValue("brokers/1", encode_broker(Broker(1, "h", 1)), 2, 2, 1, 0)], 10)
    read = TopicKeyRead("t", create_revision=11, mod_revision=12, revision=13)
    assert not view.shows(read)  # not seen yet
    view.apply(put("topics/t", topic, 11, 11))
    assert not view.shows(read)  # an earlier write only
    view.apply(put("topics/t", topic, 11, 14))
    assert view.shows(read)  # a later one
    view.apply(WatchEvent("delete", "topics/t", b"", 15, 0, 0))
    assert view.shows(read)  # gone since
    gone = TopicKeyRead("t", create_revision=0, mod_revision=0, revision=16)
    assert view.shows(gone)
    view.apply(put("partitions/t/0", led, 9, 9))  # left by an earlier incarnation
    view.apply(put("topics/t", topic, 17, 17))
    assert view.shows(gone)  # a later incarnation
    again = TopicKeyRead("t", create_revision=17, mod_revision=17, revision=17)
    assert view.shows(again) and not view.shows_ready(again)
    view.apply(put("partitions/t/0", led, 17, 17))
    assert view.shows_ready(again)
    stale = MetadataView()
    stale.load("topics/", [KeyValue("topics/t", topic, 11, 11, 1, 0)], revision=12)
    assert not stale.shows(gone)  # still holds the incarnation deleted before the read


def test_channels_to_addresses_out_of_use_for_a_whole_sweep_are_closed() -> None:
    """A broker that comes back on another address leaves a channel behind; the sweeper
    closes it (and the fetch loop's) once no broker or controller has had the address
    for a whole interval, not at the first look without it. Old channels used to stay,
    reconnecting to dead addresses for ever (found by an audit: 200 after 200 moves)."""
    channels, calls = Channels(), LeaderCalls()
    old, new = Broker(1, "127.0.0.1", 1), Broker(1, "127.0.0.1", 2)
    in_use = {broker_address(old)}

    async def fetch_channels(*brokers: Broker) -> set[str]:
        for broker in brokers:
            calls.fetch_encoded(broker)
        return set(calls._channels)

    try:
        stub = channels.storage(old)
        assert calls.run(fetch_channels(old)) == {"127.0.0.1:1"}
        sweeper = ChannelSweeper(
            lambda: set(in_use), (channels.retain, calls.retain), interval_s=3600
        )
        sweeper.start()
        in_use = {broker_address(new)}  # the broker moved
        channels.storage(new)
        sweeper.sweep()  # gone at one look: kept (it may be back at once)
        assert channels.storage(old) is stub
        sweeper.sweep()  # gone for a whole interval: closed
        sweeper.stop()
        with pytest.raises(ValueError, match="closed channel"):
            stub.DescribeLogDirs(storage_pb2.DescribeLogDirsRequest(), timeout=1)
        assert channels.storage(old) is not stub  # a new one if it is ever used again
        assert calls.run(fetch_channels()) == set()  # the fetch loop's is closed too
    finally:
        calls.close()
        channels.close()


def _pool_threads(broker_id: int) -> list[str]:
    prefix = f"gateway-produce-{broker_id}_"
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def test_the_produce_pool_of_a_broker_gone_from_the_metadata_is_dropped(
    cluster: TestCluster, admin: tidelog.Admin
) -> None:
    """A gateway kept a worker pool (up to 64 threads) for every broker id that ever led
    a partition, retired and replaced ids included (found by an audit). The sweeper now
    drops the pool of an id gone from the metadata for a whole interval; appends queued
    on a dropped pool finish, and later ones get a fresh pool."""
    # Its own topic name per run: a rerun (pytest --reruns) shares the module's cluster.
    retired, topic = 7, f"pools-of-gone-brokers-{uuid.uuid4().hex[:8]}"
    broker = cluster.start_broker(retired)
    node = GatewayNode(GatewayNodeConfig(etcd=cluster.etcd.endpoint, cluster=cluster.cluster))
    try:
        cluster.wait_brokers([*(b for b in cluster.brokers if b != retired), retired])
        node.start()
        admin.create_topic(topic, partitions=8, replication_factor=1)
        leaders = {p.partition: p.leader for p in admin.describe_topic(topic).partitions}
        assert retired in leaders.values()
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(node.address))

        def request(i: int) -> gateway_pb2.ProduceRequest:
            return gateway_pb2.ProduceRequest(
                acks=common_pb2.ALL,
                correlation_id=i,
                partitions=[
                    gateway_pb2.ProducePartitionData(
                        topic=topic, partition=p, records=encode_batch([b"v%d" % i])
                    )
                    for p in sorted(leaders)
                ],
            )

        def all_written(response: gateway_pb2.ProduceResponse) -> bool:
            return {r.error.code for r in response.partitions} == {common_pb2.NONE}

        # Every leader's pool in use (the gateway's cache may lag the topic a moment).
        wait_for(lambda: all_written(stub.Produce(request(0), timeout=30)) or None, 15, "a write")
        assert _pool_threads(retired)
        produce = node._produce
        assert produce is not None
        # Pools dropped under a stream in flight: what was queued on them is answered,
        # what comes later runs on fresh pools.
        answers = []
        for i, response in enumerate(stub.ProduceStream(iter(map(request, range(40))), timeout=60)):
            answers.append(all_written(response))
            if i == 5:
                produce.retain_brokers(())
        assert answers == [True] * 40
        admin.delete_topic(topic)
        wait_for(lambda: cluster.store.get(deletion_key(topic)) is None, 30, "the deletion")
        broker.terminate()
        cache = node._cache
        assert cache is not None
        wait_for(
            lambda: cache.read(lambda view: retired not in view.brokers) or None,
            15,
            "the metadata to drop the broker",
        )
        sweeper = node._sweeper
        assert sweeper is not None
        sweeper.sweep()
        sweeper.sweep()  # gone for a whole interval
        wait_for(lambda: not _pool_threads(retired), 10, "the pool's threads to end")
        assert retired not in produce.pool_broker_ids()
        assert set(produce.pool_broker_ids()) <= set(cache.read(lambda view: set(view.brokers)))
    finally:
        node.stop()
        if broker.proc.poll() is None:
            cluster.kill(broker)
        del cluster.brokers[retired]  # the later tests' cluster is the one they had


def test_partitions_sharing_a_leader_go_in_one_append_many(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A produce request's acks=1/all partitions are sent one AppendMany per leader (as
    Kafka's produce request names all of a broker's partitions), each answered on its
    own, in order on a stream. A leader stopped under a group (SIGSTOP, then replaced) is
    given up once the metadata names its successor: the group's partitions go alone to
    their new leaders, and nothing acknowledged is lost."""
    cluster.wait_brokers([0, 1, 2], 30)
    topic = f"grouped-{uuid.uuid4().hex[:8]}"
    n = 12  # 4 per leader: the default --produce-group-min-partitions
    admin.create_topic(topic, partitions=n, replication_factor=3)
    node = GatewayNode(GatewayNodeConfig(etcd=cluster.etcd.endpoint, cluster=cluster.cluster))
    node.start()
    try:
        produce = node._produce
        assert produce is not None
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(node.address))

        def request(i: int, timeout_ms: int = 0) -> gateway_pb2.ProduceRequest:
            return gateway_pb2.ProduceRequest(
                acks=common_pb2.ALL,
                timeout_ms=timeout_ms,
                correlation_id=i,
                partitions=[
                    gateway_pb2.ProducePartitionData(
                        topic=topic, partition=p, records=encode_batch([b"v%d-%d" % (i, p)])
                    )
                    for p in range(n)
                ],
            )

        # (The gateway's cache may lag the new topic a moment.)
        first = wait_for(
            lambda: (
                (r := stub.Produce(request(0), timeout=30)).partitions[0].error.code
                == common_pb2.NONE
                and r
            ),
            15,
            "a first write",
        )
        assert [(r.error.code, r.base_offset) for r in first.partitions] == [(0, 0)] * n
        leaders = {p.partition: p.leader for p in admin.describe_topic(topic).partitions}
        shared = {b for b in leaders.values() if list(leaders.values()).count(b) >= 4}
        calls, alone = produce.group_counts()
        assert calls >= len(shared) >= 1 and alone == 0, (leaders, calls, alone)
        # Fewer than --produce-group-min-partitions of a leader: one Append each.
        pair = [p for p, b in sorted(leaders.items()) if b == next(iter(shared))][:2]
        few = request(0)
        del few.partitions[:]
        few.partitions.extend(
            gateway_pb2.ProducePartitionData(topic=topic, partition=p, records=encode_batch([b"x"]))
            for p in pair
        )
        assert [r.error.code for r in stub.Produce(few, timeout=30).partitions] == [0, 0]
        assert produce.group_counts() == (calls, 0)

        # A stream: each partition's appends stay in request order.
        answers = list(stub.ProduceStream(iter(map(request, range(1, 21))), timeout=60))
        offsets = {
            a.correlation_id: [(r.partition, r.error.code, r.base_offset) for r in a.partitions]
            for a in answers
        }
        assert offsets == {i: [(p, 0, i + (p in pair)) for p in range(n)] for i in range(1, 21)}

        # A leader of several partitions stops answering, and is replaced.
        stopped = next(iter(shared))
        os.kill(cluster.brokers[stopped].pid, signal.SIGSTOP)
        try:
            moved = stub.Produce(request(21, timeout_ms=20_000), timeout=60)
        finally:
            os.kill(cluster.brokers[stopped].pid, signal.SIGCONT)
        assert [(r.error.code, r.base_offset) for r in moved.partitions] == [
            (0, 21 + (p in pair)) for p in range(n)
        ]
        assert produce.group_counts()[1] >= 4  # its partitions went alone to their successors
        now = {p.partition: p.leader for p in admin.describe_topic(topic).partitions}
        assert stopped not in now.values()
    finally:
        node.stop()
    for p in range(n):
        with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
            consumer.assign([(topic, p)])
            got = poll_records(consumer, 22 + (p in pair))
        expected = [b"v%d-%d" % (i, p) for i in range(22)]
        if p in pair:
            expected.insert(1, b"x")
        assert got == list(enumerate(expected)), p
    cluster.wait_brokers([0, 1, 2], 30)
    wait_for(
        lambda: all(len(p.isr) == 3 for p in admin.describe_topic(topic).partitions) or None,
        60,
        "the stopped broker back in every ISR",
    )


def test_a_produce_timeout_above_the_limit_is_clamped_not_refused(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A produce timeout_ms above 300 s is clamped, as the storage nodes clamp theirs: a
    producer (or a Spark write, requestTimeoutMs) configured with a longer request
    timeout used to have every request refused (found by an audit)."""
    admin.create_topic("long-timeout", partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address, request_timeout_ms=600_000) as producer:
        assert producer.send("long-timeout", b"v").result(30).offset == 0


def test_offset_fetches_and_list_offsets_keep_their_limits_and_entries(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """FetchOffsets names at most 10,000 partitions, as CommitOffsets (a 20 MB request
    took 16 s of CPU and 420 MB); ListOffsets answers each entry, a partition asked at two
    timestamps included (the later answer was given for both). Found by an audit."""
    too_many = [common_pb2.TopicPartition(topic="t", partition=p) for p in range(10_001)]
    with pytest.raises(grpc.RpcError) as raised:
        gateway.stub.FetchOffsets(
            gateway_pb2.FetchOffsetsRequest(group_id="g", partitions=too_many), timeout=10
        )
    assert rpc_error_code(raised.value) == ErrorCode.INVALID_REQUEST
    assert "10001 partitions in one offset fetch; the limit is 10000" in (
        raised.value.details() or ""
    )
    # Records of 1970: time retention would delete them all, the active segment too.
    admin.create_topic("stamped", partitions=1, replication_factor=1, config={"retention.ms": "-1"})
    with tidelog.Producer(gateway.address) as producer:
        for stamp in (1000, 2000, 3000):
            producer.send("stamped", b"v", partition=0, timestamp_ms=stamp).result(30)

    def at(timestamp_ms: int) -> storage_pb2.ListOffsetsPartition:
        return storage_pb2.ListOffsetsPartition(
            topic="stamped", partition=0, spec=common_pb2.BY_TIMESTAMP, timestamp_ms=timestamp_ms
        )

    answers = gateway.stub.ListOffsets(
        storage_pb2.ListOffsetsRequest(replica_id=-1, partitions=[at(1500), at(2500)]),
        timeout=10,
    )
    assert [(a.offset, a.timestamp_ms) for a in answers.partitions] == [(1, 2000), (2, 3000)]


def test_a_dead_broker_does_not_hold_up_produce_to_the_others(
    cluster: TestCluster, admin: tidelog.Admin
) -> None:
    """A request for 70 partitions led by a dead broker waits out its timeout on the
    gateway's workers. They used to be one pool of 64 for every broker: a request for
    partitions on the healthy brokers then queued behind it and timed out with nothing
    written. Each broker's partitions now have workers of their own."""
    own = cluster.start_gateway()  # fresh worker pools
    admin.create_topic("on-dead-broker", partitions=240, replication_factor=1)
    admin.create_topic("on-live-brokers", partitions=6, replication_factor=1)
    victim = 0
    slow = [
        p.partition for p in admin.describe_topic("on-dead-broker").partitions if p.leader == victim
    ][:70]
    fast = [
        p.partition
        for p in admin.describe_topic("on-live-brokers").partitions
        if p.leader != victim
    ][:2]
    assert len(slow) == 70 and len(fast) == 2

    def request(topic: str, partitions: list[int], timeout_ms: int) -> gateway_pb2.ProduceRequest:
        return gateway_pb2.ProduceRequest(
            acks=common_pb2.LEADER,
            timeout_ms=timeout_ms,
            partitions=[
                gateway_pb2.ProducePartitionData(
                    topic=topic, partition=p, records=encode_batch([b"v"])
                )
                for p in partitions
            ],
        )

    threads_before = len(os.listdir(f"/proc/{own.pid}/task"))
    cluster.kill(cluster.brokers[victim])
    try:
        stuck = own.stub.Produce.future(request("on-dead-broker", slow, 10_000), timeout=30)
        wait_for(
            lambda: len(os.listdir(f"/proc/{own.pid}/task")) >= threads_before + 64 or None,
            10,
            "the dead broker's appends to take 64 workers",
        )
        answer = own.stub.Produce(request("on-live-brokers", fast, 3_000), timeout=30)
        assert [(r.error.code, r.base_offset) for r in answer.partitions] == [
            (common_pb2.NONE, 0),
            (common_pb2.NONE, 0),
        ]
        assert {r.error.code for r in stuck.result().partitions} != {common_pb2.NONE}
    finally:
        cluster.start_broker(victim)
        cluster.kill(own)


class _ScriptedStorage:
    """Stands in for a storage node's Append and AppendMany, on loopback gRPC, where a
    test needs timing a real node does not give on cue. Appends count offsets per
    partition; a partition in ``moved`` (this broker is its follower now) is answered
    NOT_LEADER_OR_FOLLOWER. An AppendMany appends, then waits ``acks_all_wait_s`` (acks=all
    held up by a slow in-sync follower) and answers a partition that moved meanwhile
    NOT_LEADER_OR_FOLLOWER, as a real leader's partition fails its acks=all waiters when
    it becomes a follower."""

    def __init__(self, *, acks_all_wait_s: float = 0.0) -> None:
        self.acks_all_wait_s = acks_all_wait_s
        self.moved: set[int] = set()
        self.appended: list[int] = []  # the partitions appended, in order
        self.appended_many = threading.Event()  # an AppendMany appended, and waits
        self.lock = threading.Lock()
        self.server = grpc.server(ThreadPoolExecutor(max_workers=16))
        handlers = {
            "Append": grpc.unary_unary_rpc_method_handler(
                self._append,
                request_deserializer=storage_pb2.AppendRequest.FromString,
                response_serializer=storage_pb2.AppendResponse.SerializeToString,
            ),
            "AppendMany": grpc.unary_unary_rpc_method_handler(
                self._append_many,
                request_deserializer=storage_pb2.AppendManyRequest.FromString,
                response_serializer=storage_pb2.AppendManyResponse.SerializeToString,
            ),
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("tidelog.v1.Storage", handlers),)
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @staticmethod
    def _not_leader(partition: int) -> storage_pb2.AppendResponse:
        return storage_pb2.AppendResponse(
            error=to_error_proto(NotLeaderOrFollowerError(f"{partition} moved")),
            base_offset=-1,
            last_offset=-1,
        )

    def _one(self, request: storage_pb2.AppendRequest) -> storage_pb2.AppendResponse:
        with self.lock:
            if request.partition in self.moved:
                return self._not_leader(request.partition)
            offset = self.appended.count(request.partition)
            self.appended.append(request.partition)
        return storage_pb2.AppendResponse(base_offset=offset, last_offset=offset)

    def _append(self, request: storage_pb2.AppendRequest, context: Any) -> Any:
        return self._one(request)

    def _append_many(self, request: storage_pb2.AppendManyRequest, context: Any) -> Any:
        answers = [self._one(append) for append in request.appends]
        self.appended_many.set()
        time.sleep(self.acks_all_wait_s)
        with self.lock:
            answers = [
                self._not_leader(append.partition) if append.partition in self.moved else answer
                for append, answer in zip(request.appends, answers, strict=True)
            ]
        return storage_pb2.AppendManyResponse(responses=answers)

    def stop(self) -> None:
        self.server.stop(0)


class _ScriptedLeaders:
    """Stands in for the gateway's ``MetadataCache``: a real ``MetadataView`` of topic
    ``t`` whose partition leaders a test moves (``move``) while appends wait."""

    def __init__(self, brokers: list[Broker], leaders: dict[int, int]) -> None:
        self._view = MetadataView(
            brokers={b.broker_id: b for b in brokers},
            topics={"t": Topic("t", uuid.uuid4().hex, tuple((1, 2) for _ in leaders))},
            partitions={("t", p): PartitionRecord(b, 1, (b,), 1) for p, b in leaders.items()},
        )
        self._changed = threading.Condition()

    stopped = False  # the router stops retrying once the cache has stopped

    @property
    def version(self) -> int:
        with self._changed:
            return self._view.version

    def read(self, fn: Callable[[MetadataView], Any]) -> Any:
        with self._changed:
            return fn(self._view)

    def leader(self, topic: str, partition: int) -> Leader:
        with self._changed:
            return self._view.leader(topic, partition)

    def move(self, partition: int, broker_id: int) -> None:
        with self._changed:
            old = self._view.partitions[("t", partition)]
            self._view.partitions[("t", partition)] = PartitionRecord(
                broker_id, old.leader_epoch + 1, (broker_id,), 1
            )
            self._view.version += 1
            self._changed.notify_all()

    def wait_for_change(self, seen_version: int, timeout_s: float) -> int:
        with self._changed:
            self._changed.wait_for(
                lambda: self._view.version != seen_version, timeout=max(0.0, timeout_s)
            )
            return self._view.version


def _scripted_produce(
    acks: common_pb2.Acks, partitions: list[int], timeout_ms: int
) -> gateway_pb2.ProduceRequest:
    return gateway_pb2.ProduceRequest(
        acks=acks,
        timeout_ms=timeout_ms,
        partitions=[
            gateway_pb2.ProducePartitionData(
                topic="t", partition=p, records=encode_batch([b"v%d" % p])
            )
            for p in partitions
        ],
    )


def test_a_group_whose_one_partition_moved_writes_the_others_once() -> None:
    """One partition of an AppendMany group changes leader while the call waits (acks=all
    held up by a slow follower). The gateway used to cancel the whole call and append
    every partition again, alone: those whose leader never changed had been appended
    already, and a non-idempotent producer's batches were written twice (the client got
    the duplicates' offsets). As Kafka does, the old leader now answers them, and only
    the moved partition (answered NOT_LEADER_OR_FOLLOWER) goes alone to its new leader.
    Found by an audit."""
    old, new = _ScriptedStorage(acks_all_wait_s=1.5), _ScriptedStorage()
    b1, b2 = Broker(1, "127.0.0.1", old.port), Broker(2, "127.0.0.1", new.port)
    leaders = _ScriptedLeaders([b1, b2], {p: 1 for p in range(4)})
    channels = Channels()
    handler = ProduceHandler(Router(cast(Any, leaders), channels), ProduceLimits())

    def move_partition_0() -> None:
        old.appended_many.wait(10)
        with old.lock:
            old.moved.add(0)  # broker 1 follows partition 0 now ...
        leaders.move(0, 2)  # ... and the metadata names broker 2 its leader

    mover = threading.Thread(target=move_partition_0)
    try:
        mover.start()
        response = handler.produce(_scripted_produce(common_pb2.ALL, [0, 1, 2, 3], 10_000))
        mover.join()
        assert [(r.error.code, r.base_offset) for r in response.partitions] == [
            (common_pb2.NONE, 0)
        ] * 4
        assert handler.group_counts() == (1, 1)  # one AppendMany; partition 0 went alone
        assert new.appended == [0]
        assert sorted(old.appended) == [0, 1, 2, 3], "partitions 1-3 written twice"
    finally:
        mover.join()
        handler.close()
        channels.close()
        old.stop()
        new.stop()


def test_acks0_to_a_healthy_leader_is_not_held_up_by_a_stopped_one(
    cluster: TestCluster, admin: tidelog.Admin
) -> None:
    """acks=0 appends waiting on a stopped leader hold their slot until their deadline
    (or the leader moves). The bound on them (``--max-background-appends``) was one for
    the whole gateway: once a stopped broker's appends took every slot, acks=0 requests
    for partitions on healthy brokers waited out their timeout and failed "too many acks=0
    appends are queued". It is per leader broker now, as the worker pools are; the byte
    budget still bounds the memory of them all. Found by an audit. Real processes: a
    gateway with 4 slots per broker, one leader stopped (SIGSTOP) for less than its
    session, so that it stays the leader and writes what waited once it goes on."""
    own = cluster.start_gateway(["--max-background-appends", "4"])
    admin.create_topic("acks0-slots", partitions=3, replication_factor=1)
    leaders = {p.partition: p.leader for p in admin.describe_topic("acks0-slots").partitions}
    stopped_p = 0
    healthy_p = next(p for p, leader in leaders.items() if leader != leaders[stopped_p])
    stopped_broker = leaders[stopped_p]

    def produce(partition: int, timeout_ms: int) -> gateway_pb2.ProducePartitionResult:
        return _produce_batch(
            own,
            "acks0-slots",
            encode_batch([b"v%d" % partition]),
            partition=partition,
            acks=common_pb2.NONE_ACKS,
            timeout_ms=timeout_ms,
        )

    for p in leaders:  # channels to every leader open before the clock starts
        assert produce(p, 10_000).error.code == common_pb2.NONE
    wait_for(
        lambda: all(_end_offset(own, "acks0-slots", p) == 1 for p in leaders) or None,
        10,
        "the warm-up records",
    )
    pid = cluster.brokers[stopped_broker].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: _process_state(pid) == "T", 10, "the leader stopped")
        for _ in range(4):  # answered at once, as acks=0 is, each holding a slot
            assert produce(stopped_p, 20_000).error.code == common_pb2.NONE
        started = time.monotonic()
        answer = produce(healthy_p, 2_000)
        waited_s = time.monotonic() - started
        assert (answer.error.code, answer.error.message) == (common_pb2.NONE, "")
        assert waited_s < 1.0, f"acks=0 to a healthy broker waited {waited_s:.1f} s"
        wait_for(
            lambda: _end_offset(own, "acks0-slots", healthy_p) == 2 or None,
            10,
            "the healthy leader's append",
        )
        # The stopped broker's own slots are full: its next acks=0 waits, and is refused.
        refused = produce(stopped_p, 300)
        assert refused.error.code == ErrorCode.REQUEST_TIMED_OUT
        assert f"for broker {stopped_broker}" in refused.error.message, refused.error.message
    finally:
        os.kill(pid, signal.SIGCONT)
    # What waited is written once the leader goes on; the refused one is not.
    wait_for(
        lambda: _end_offset(own, "acks0-slots", stopped_p) == 5 or None,
        20,
        "the stopped leader's queued appends",
    )
    assert _end_offset(own, "acks0-slots", stopped_p) == 5  # the refused one never went


def _end_offset(gateway: GatewayProcess, topic: str, partition: int) -> int:
    """The partition's log end offset, as its leader answers through ``gateway``."""
    answer = gateway.stub.ListOffsets(
        storage_pb2.ListOffsetsRequest(
            replica_id=-1,
            partitions=[
                storage_pb2.ListOffsetsPartition(
                    topic=topic, partition=partition, spec=common_pb2.LATEST
                )
            ],
        ),
        timeout=10,
    )
    return int(answer.partitions[0].offset)


def test_appends_waiting_for_a_leader_hold_no_worker_and_end_by_their_deadline() -> None:
    """Appends to partitions without a leader waited on workers of one shared pool for
    their whole timeout: a client writing to offline partitions filled it, and an append
    to a partition merely between leaders (elected a moment later) queued behind them
    and failed long after its leader was known. They wait holding no worker now
    (``leader_waits``), start once the metadata names a leader, and are answered by
    their deadline. Scripted storage and metadata (the moment between two leaders cannot
    be held on cue with real processes); 2 workers per pool. Found by an audit."""
    storage = _ScriptedStorage()
    leaders = _ScriptedLeaders([Broker(1, "127.0.0.1", storage.port)], {p: -1 for p in range(6)})
    channels = Channels()
    handler = ProduceHandler(Router(cast(Any, leaders), channels), ProduceLimits(workers=2))
    offline: list[tuple[float, gateway_pb2.ProduceResponse]] = []

    def produce_offline(partitions: list[int]) -> None:
        response = handler.produce(_scripted_produce(common_pb2.ALL, partitions, 2_500))
        offline.append((time.monotonic(), response))

    blockers = [
        threading.Thread(target=produce_offline, args=(parts,), daemon=True)
        for parts in ([0, 1], [2, 3])
    ]
    try:
        started = time.monotonic()
        for thread in blockers:
            thread.start()
        wait_for(lambda: handler.leader_waits.waiting() == 4 or None, 5, "the offline appends")
        elect = threading.Timer(0.3, lambda: (leaders.move(4, 1), leaders.move(5, 1)))
        elect.start()
        asked = time.monotonic()
        response = handler.produce(_scripted_produce(common_pb2.ALL, [4, 5], 2_000))
        took_s = time.monotonic() - asked
        assert [r.error.code for r in response.partitions] == [common_pb2.NONE] * 2, response
        assert took_s < 1.5, took_s
        assert sorted(storage.appended) == [4, 5]
        for thread in blockers:
            thread.join(10)
        for answered_at, answer in offline:  # at their deadline, not a worker's later
            assert answered_at - started < 2.5 + 1.0
            codes = {ErrorCode(r.error.code) for r in answer.partitions}
            assert codes == {ErrorCode.LEADER_NOT_AVAILABLE}, answer
        assert handler.leader_waits.waiting() == 0
        elect.join()
    finally:
        handler.close()
        channels.close()
        storage.stop()


@contextlib.contextmanager
def _silent_leader(cluster: TestCluster, admin: tidelog.Admin, topic: str) -> Iterator[int]:
    """A new one-partition topic whose leader is stopped (SIGSTOP) inside the block,
    which must be shorter than the leader's session so that it stays the leader."""
    admin.create_topic(topic, partitions=1, replication_factor=1)
    leader = admin.describe_topic(topic).partitions[0].leader
    pid = cluster.brokers[leader].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        # Stopped once /proc says so: every thread of it stops in its own time, and a CI
        # rerun saw the leader still answer a ListOffsets sent right after the kill.
        wait_for(lambda: _process_state(pid) == "T", 10, "the leader stopped")
        yield leader
    finally:
        os.kill(cluster.brokers[leader].pid, signal.SIGCONT)


def test_a_produce_ends_by_its_client_deadline_and_writes_nothing_after_it(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A unary Produce with a 1 s gRPC deadline and timeout_ms unset (the gateway's 30 s)
    to a stopped leader: the gateway ignored the client's deadline, held the request (a
    thread, a concurrency slot, its bytes) and appended it once the leader went on, after
    the client had been told DEADLINE_EXCEEDED: a client that retried wrote it twice. It
    now ends by the client's deadline, answering REQUEST_TIMED_OUT, as the other calls
    do (found by an audit)."""
    with _silent_leader(cluster, admin, "client-deadline"):
        result = _produce_batch(
            gateway, "client-deadline", encode_batch([b"once"]), timeout_ms=0, deadline_s=1.0
        )
        time.sleep(0.5)  # the leader stays stopped past the client's deadline
    assert ErrorCode(result.error.code) == ErrorCode.REQUEST_TIMED_OUT, result.error
    time.sleep(0.5)  # the leader goes on: what it was sent it would write now
    assert _end_offset(gateway, "client-deadline", 0) == 0


def test_a_leader_that_does_not_answer_is_named_in_the_timeout(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A produce whose leader is stopped times out at the gateway with a message naming
    the leader that did not answer, not gRPC's bare "Deadline Exceeded"."""
    with _silent_leader(cluster, admin, "silent-leader") as leader:
        result = _produce_batch(
            gateway, "silent-leader", encode_batch([b"v"]), timeout_ms=800, deadline_s=30
        )
    error = result.error
    assert ErrorCode(error.code) == ErrorCode.REQUEST_TIMED_OUT
    assert f"silent-leader-0, broker {leader} (" in error.message, error.message
    assert "did not answer before the deadline" in error.message


def test_acks0_records_accepted_under_a_short_client_deadline_are_written(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """acks=0 is answered at once and appended in the background, which took the client's
    gRPC deadline (the fix above, right for acks=1/all) as its own: with a deadline of 80
    ms, ample for an answer that comes at once, every request was answered "accepted" and
    none written, to a healthy leader. The background append has the request's timeout,
    as Kafka appends acks=0 whatever the client's timeouts (found by an audit)."""
    topic = "acks0-short-deadline"
    admin.create_topic(topic, partitions=1, replication_factor=1)

    def request(acks: int) -> gateway_pb2.ProduceRequest:
        data = gateway_pb2.ProducePartitionData(
            topic=topic, partition=0, records=encode_batch([b"v"])
        )
        return gateway_pb2.ProduceRequest(acks=acks, partitions=[data])

    assert (
        gateway.stub.Produce(request(common_pb2.LEADER), timeout=10).partitions[0].error.code == 0
    )
    before = _end_offset(gateway, topic, 0)
    accepted = 0
    for _ in range(20):
        with contextlib.suppress(grpc.RpcError):  # not answered in time: nothing promised
            answer = gateway.stub.Produce(request(common_pb2.NONE_ACKS), timeout=0.08)
            accepted += answer.partitions[0].error.code == common_pb2.NONE
    assert accepted >= 10, accepted
    wait_for(
        lambda: _end_offset(gateway, topic, 0) - before >= accepted or None,
        10,
        f"{accepted} accepted acks=0 records written",
    )


def test_a_partitions_records_the_gateway_takes_are_taken_by_its_leader(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """The gateway takes produce requests up to 100 MiB, and a storage node's gRPC server
    took messages up to 64 MiB: 72 MB of one partition's valid batches were refused
    RECORD_LIST_TOO_LARGE by the leader (found by an audit)."""
    topic = "big-request"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    records = encode_batch([b"x" * 1000] * 1000) * 72  # ~1 MB batches, 72 MB in all
    assert 64 * 1024 * 1024 < len(records) < MAX_PRODUCE_REQUEST_BYTES
    data = gateway_pb2.ProducePartitionData(topic=topic, partition=0, records=records)
    result = gateway.stub.Produce(
        gateway_pb2.ProduceRequest(acks=common_pb2.LEADER, timeout_ms=30_000, partitions=[data]),
        timeout=60,
    ).partitions[0]
    assert (result.error.code, result.base_offset) == (common_pb2.NONE, 0), result.error.message


def test_client_ids_are_bounded(gateway: GatewayProcess) -> None:
    """InitProducerId and Produce took a client id of any length (4 million characters
    were taken, and InitProducerId logged it on every call); JoinGroup's are bounded
    (found by an audit)."""
    for call, request in (
        (gateway.stub.InitProducerId, gateway_pb2.InitProducerIdRequest(client_id="c" * 256)),
        (gateway.stub.Produce, gateway_pb2.ProduceRequest(acks=1, client_id="c" * 256)),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            call(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "client id of 256 characters" in (refused.value.details() or "")


def test_events_of_loggers_made_at_import_reach_the_json_log(gateway: GatewayProcess) -> None:
    """Loggers made at import with bound fields (``get_logger(component=...)``) were built
    before ``tidelog.logging.configure`` ran: their events (producer ids issued, group and
    metadata events) went to stdout as console text, not to the JSON log on stderr (found
    by an audit)."""
    answer = gateway.stub.InitProducerId(
        gateway_pb2.InitProducerIdRequest(client_id="json-log"), timeout=10
    )

    def logged() -> bool | None:
        lines = gateway.log_path.read_text().splitlines()
        events = [json.loads(line) for line in lines if line.startswith("{")]
        return (
            any(
                e.get("event") == "producer_id_issued"
                and e.get("producer_id") == answer.producer_id
                for e in events
            )
            or None
        )

    wait_for(logged, 10, "producer_id_issued in the JSON log")
    assert not [line for line in gateway.stdout_lines if "producer_id_issued" in line]


def test_list_offsets_answers_within_the_clients_deadline_when_a_leader_is_silent(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """ListOffsets gives a silent (stopped) leader the client's own deadline, not a fixed
    10 s, so the client gets the partition's REQUEST_TIMED_OUT rather than its bare
    deadline."""
    with _silent_leader(cluster, admin, "silent-offsets"):
        answer = gateway.stub.ListOffsets(
            storage_pb2.ListOffsetsRequest(
                replica_id=-1,
                partitions=[
                    storage_pb2.ListOffsetsPartition(
                        topic="silent-offsets", partition=0, spec=common_pb2.LATEST
                    )
                ],
            ),
            timeout=1.0,
        )
    assert [ErrorCode(p.error.code) for p in answer.partitions] == [ErrorCode.REQUEST_TIMED_OUT]


def test_an_offline_partition_does_not_fail_the_list_offsets_of_one_with_a_leader(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Found by an audit: ListOffsets asked the partitions to re-route one after another,
    each waiting for a leader up to the shared deadline. A broker dies that leads an RF=1
    partition A (offline from then on) and an RF=3 partition B (a new leader within
    seconds); a ListOffsets of [A, B] sent right after failed both on the dead broker, A's
    re-route took the whole deadline, and B was answered REQUEST_TIMED_OUT without being
    asked again. They are asked again together now, until the deadline, as Kafka's
    clients retry each partition on its own."""
    admin.create_topic("offsets-offline-single", partitions=3, replication_factor=1)
    admin.create_topic("offsets-offline-triple", partitions=3, replication_factor=3)
    single = {p: leader for (_, p), leader in _leaders(admin, "offsets-offline-single").items()}
    triple = {p: leader for (_, p), leader in _leaders(admin, "offsets-offline-triple").items()}
    victim = single[0]
    b_partition = next((p for p, leader in triple.items() if leader == victim), None)
    assert b_partition is not None, (single, triple)
    with tidelog.Producer(gateway.address) as producer:
        producer.send("offsets-offline-triple", b"x", partition=b_partition).result(30)
    cluster.brokers[victim].kill()
    try:
        response = gateway.stub.ListOffsets(
            storage_pb2.ListOffsetsRequest(
                replica_id=-1,
                partitions=[
                    storage_pb2.ListOffsetsPartition(
                        topic="offsets-offline-single", partition=0, spec=common_pb2.LATEST
                    ),
                    storage_pb2.ListOffsetsPartition(
                        topic="offsets-offline-triple",
                        partition=b_partition,
                        spec=common_pb2.LATEST,
                    ),
                ],
            ),
            timeout=30,
        )
    finally:
        cluster.start_broker(victim)
    a, b = response.partitions
    assert ErrorCode(a.error.code) == ErrorCode.LEADER_NOT_AVAILABLE, a
    assert (ErrorCode(b.error.code), b.offset) == (ErrorCode.NONE, 1), b
    wait_for(
        lambda: (
            all(len(p.isr) == 3 for p in admin.describe_topic("offsets-offline-triple").partitions)
            or None
        ),
        60,
        "the restarted broker to rejoin the ISR",
    )


def test_a_subscription_moves_on_from_a_leader_that_stopped_answering(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A Subscribe's long poll to a leader that stops answering (SIGSTOP, then replaced
    by a new leader) asks again, the new leader once the metadata names it. The stream
    used to end when the poll's own deadline passed, with a status clients read as their
    own deadline."""
    topic = "subscribed-through-a-stop"
    admin.create_topic(topic, partitions=1, replication_factor=3)
    with tidelog.Producer(gateway.address) as producer:
        producer.send(topic, b"before", partition=0).result(30)
    stream = gateway.stub.Subscribe(
        gateway_pb2.SubscribeRequest(topic=topic, partition=0, start_offset=0), timeout=120
    )
    assert [r.value for b in decode_batches(next(stream).records) for r in b.records] == [b"before"]
    old = admin.describe_topic(topic).partitions[0].leader
    os.kill(cluster.brokers[old].pid, signal.SIGSTOP)
    # Stopped once /proc says so (see _silent_leader: a CI rerun saw the leader answer a
    # request sent right after the kill).
    wait_for(lambda: _process_state(cluster.brokers[old].pid) == "T", 10, "the leader stopped")
    try:
        wait_for(
            lambda: admin.describe_topic(topic).partitions[0].leader not in (old, -1) or None,
            30,
            "a new leader while the old one is stopped",
        )
        with tidelog.Producer(gateway.address) as producer:
            producer.send(topic, b"after", partition=0).result(30)
        later = next(stream)
    finally:
        os.kill(cluster.brokers[old].pid, signal.SIGCONT)
        stream.cancel()
    assert [r.value for b in decode_batches(later.records) for r in b.records] == [b"after"]
    wait_for(
        lambda: len(admin.describe_topic(topic).partitions[0].isr) == 3 or None,
        60,
        "the stopped broker to rejoin the ISR",
    )


def _slow_subscription(gateway: GatewayProcess, topic: str) -> tuple[Any, grpc.Channel]:
    """A Subscribe from offset 0 over a channel with a small receive window (no BDP
    probing): the gateway's stream stays blocked in its send while the test does not
    read, as a slow reader's does."""
    channel = grpc.insecure_channel(
        gateway.address,
        options=[("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 64 << 20)],
    )
    stream = gateway_pb2_grpc.GatewayStub(channel).Subscribe(
        gateway_pb2.SubscribeRequest(topic=topic, partition=0, start_offset=0, max_bytes=500_000),
        timeout=120,
    )
    return stream, channel


def _offsets_and_values(message: Any) -> list[tuple[int, bytes]]:
    return [(r.offset, r.value[:8]) for b in decode_batches(message.records) for r in b.records]


def test_a_subscription_does_not_run_on_into_its_topic_created_again(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A Subscribe step named no topic id: a subscription held by a slow reader while its
    topic was deleted and created again went on in the new topic from the old offset,
    skipping the new topic's first records and handing out the rest as if they followed
    the old ones. It ends with INCONSISTENT_TOPIC_ID now (found by an audit)."""
    topic = "subscribed-reborn"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        for i in range(8):  # about 400 KB each: more than the stream's window
            producer.send_batch(topic, [b"old%03d" % i + b"x" * 400_000], partition=0).result(30)
    stream, channel = _slow_subscription(gateway, topic)
    seen = _offsets_and_values(next(stream))
    time.sleep(2)  # the reader is slow
    _delete_and_create_again(admin, topic)
    with tidelog.Producer(gateway.address) as producer:
        for i in range(16):  # one batch each: offsets show where it would resume
            producer.send_batch(topic, [b"new%03d" % i], partition=0).result(30)
    with pytest.raises(grpc.RpcError) as ended:
        try:
            for message in stream:
                seen += _offsets_and_values(message)
        finally:
            channel.close()
    assert rpc_error_code(ended.value) == ErrorCode.INCONSISTENT_TOPIC_ID
    assert all(value.startswith(b"old") for _, value in seen), seen


def test_a_subscription_past_an_unclean_election_reads_the_new_leaders_records(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A Subscribe step named no last fetched epoch: a subscription that had forwarded
    records an unclean leader does not have went on from its offset in the new leader's
    log, skipping the records the new leader wrote below it, without a word. It goes on
    from where the logs agree now, as Kafka's consumer (KIP-320), told by an answer
    carrying the divergence (found by an audit)."""
    topic = "subscribed-unclean"
    admin.create_topic(
        topic, partitions=1, replication_factor=2, config={"unclean.leader.election.enable": "true"}
    )
    wait_for(lambda: len(admin.describe_topic(topic).partitions[0].isr) == 2 or None, 15, "ISR 2")
    state = admin.describe_topic(topic).partitions[0]
    leader = state.leader
    (follower,) = [b for b in state.replicas if b != leader]
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [b"both-%d" % i for i in range(10)], partition=0).result(30)
    cluster.brokers[follower].kill()
    wait_for(lambda: admin.describe_topic(topic).partitions[0].isr == (leader,) or None, 20, "ISR")
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [b"lost-%d" % i for i in range(10)], partition=0).result(30)
        for i in range(4):  # 20..23, about 400 KB each: more than the stream's window
            big = [b"lostbig-%d" % i + b"x" * 400_000]
            producer.send_batch(topic, big, partition=0).result(30)
    stream, channel = _slow_subscription(gateway, topic)
    try:
        seen = _offsets_and_values(next(stream))
        time.sleep(2)  # the reader is slow
        cluster.brokers[leader].kill()
        cluster.start_broker(follower)
        wait_for(
            lambda: admin.describe_topic(topic).partitions[0].leader == follower or None,
            30,
            "an unclean election",
        )
        with tidelog.Producer(gateway.address) as producer:
            for i in range(25):  # the new leader's 10..34, one batch each
                producer.send_batch(topic, [b"new-%d" % i], partition=0).result(30)
        diverged = False
        while not any(value.startswith(b"new") for _, value in seen):
            message = next(stream)
            diverged = diverged or message.diverging_end_offset == 10
            seen += _offsets_and_values(message)
    finally:
        stream.cancel()
        channel.close()
        cluster.start_broker(leader)
    new = [(offset, value) for offset, value in seen if value.startswith(b"new")]
    assert diverged and new[0] == (10, b"new-0"), new[:3]
    wait_for(lambda: len(admin.describe_topic(topic).partitions[0].isr) == 2 or None, 60, "ISR 2")


def _restart_if_dead(cluster: TestCluster, *broker_ids: int) -> None:
    for broker_id in broker_ids:
        if cluster.brokers[broker_id].proc.poll() is not None:
            cluster.start_broker(broker_id)


def test_a_subscription_does_not_skip_records_on_a_divergence_ending_past_its_offset(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Found by an audit: a Subscribe step told of a divergence moved its offset to the
    divergence's end even when that was beyond the offset reached, skipping the leader's
    records in between. Replicas L and F, unclean elections allowed: 0..9 on both; L
    dies, F leads and writes 10..49 alone; F dies, L is elected uncleanly and writes
    10..14. A subscription reads 0..14 from L (offset 15). L dies, F is elected uncleanly:
    its log ends the epoch it wrote 10..49 in at 50, so it answers the step with the
    divergence (that epoch, 50), and the subscription jumped to 50, never delivering F's
    15..49. Kafka's consumer keeps its position when the divergence ends at or past it, as
    the SDK's Consumer does (``_on_truncation``), and so does Subscribe now (without a
    word to the client: it has nothing to act on)."""
    topic = "subscribed-diverging-ahead"
    admin.create_topic(
        topic, partitions=1, replication_factor=2, config={"unclean.leader.election.enable": "true"}
    )
    wait_for(lambda: len(admin.describe_topic(topic).partitions[0].isr) == 2 or None, 20, "ISR 2")
    state = admin.describe_topic(topic).partitions[0]
    lead = state.leader
    (follow,) = [b for b in state.replicas if b != lead]

    def leader_is(broker_id: int, what: str) -> None:
        wait_for(
            lambda: admin.describe_topic(topic).partitions[0].leader == broker_id or None, 30, what
        )

    stream = None
    after: list[tuple[int, bytes]] = []
    divergences: list[tuple[int, int]] = []
    try:
        with tidelog.Producer(gateway.address) as producer:
            producer.send_batch(topic, [b"both-%d" % i for i in range(10)], partition=0).result(30)
        cluster.brokers[lead].kill()  # F leads cleanly and writes 10..49 alone
        leader_is(follow, "F leads")
        with tidelog.Producer(gateway.address) as producer:
            # Two batches, so that a fetch from 15 starts with f-15 (batches go whole).
            producer.send_batch(topic, [b"f-%d" % i for i in range(10, 15)], partition=0).result(30)
            producer.send_batch(topic, [b"f-%d" % i for i in range(15, 50)], partition=0).result(30)
        cluster.brokers[follow].kill()  # L comes back, elected uncleanly, writes 10..14
        cluster.start_broker(lead)
        leader_is(lead, "L elected uncleanly")
        with tidelog.Producer(gateway.address) as producer:
            producer.send_batch(topic, [b"l-%d" % i for i in range(10, 15)], partition=0).result(30)
        stream = gateway.stub.Subscribe(
            gateway_pb2.SubscribeRequest(topic=topic, partition=0, start_offset=0), timeout=120
        )
        seen: list[tuple[int, bytes]] = []
        while not seen or seen[-1][0] < 14:
            seen += _offsets_and_values(next(stream))
        cluster.brokers[lead].kill()  # F is elected uncleanly, its log still f-10..f-49
        cluster.start_broker(follow)
        leader_is(follow, "F elected uncleanly")
        with tidelog.Producer(gateway.address) as producer:
            producer.send_batch(topic, [b"new-%d" % i for i in range(5)], partition=0).result(30)
        while not any(value.startswith(b"new") for _, value in after):
            message = next(stream)
            if message.diverging_end_offset >= 0:
                divergences.append((message.diverging_epoch, message.diverging_end_offset))
            after += _offsets_and_values(message)
    finally:
        if stream is not None:
            stream.cancel()
        _restart_if_dead(cluster, lead, follow)
    from_f = [offset for offset, value in after if value.startswith(b"f-")]
    assert from_f == list(range(15, 50)), f"divergences {divergences}; after 14: {after[:3]}"
    wait_for(lambda: len(admin.describe_topic(topic).partitions[0].isr) == 2 or None, 60, "ISR 2")


def test_a_produce_waiting_on_a_stopped_leader_moves_to_its_successor(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A produce sent to a leader that then stops answering (SIGSTOP, and a new leader is
    elected) is given up and sent to the new leader once the metadata names it. It used
    to wait out its whole timeout and answer REQUEST_TIMED_OUT."""
    topic = "produce-past-a-stop"
    admin.create_topic(topic, partitions=1, replication_factor=3)
    with tidelog.Producer(gateway.address) as producer:
        producer.send(topic, b"before", partition=0).result(30)
    old = admin.describe_topic(topic).partitions[0].leader
    os.kill(cluster.brokers[old].pid, signal.SIGSTOP)
    # Stopped once /proc says so (see _silent_leader: a CI rerun saw the leader answer a
    # request sent right after the kill).
    wait_for(lambda: _process_state(cluster.brokers[old].pid) == "T", 10, "the leader stopped")
    try:
        result = _produce_batch(
            gateway, topic, encode_batch([b"after"]), timeout_ms=20_000, deadline_s=60
        )
    finally:
        os.kill(cluster.brokers[old].pid, signal.SIGCONT)
    assert (ErrorCode(result.error.code), result.base_offset) == (ErrorCode.NONE, 1)
    assert admin.describe_topic(topic).partitions[0].leader != old
    wait_for(
        lambda: len(admin.describe_topic(topic).partitions[0].isr) == 3 or None,
        60,
        "the stopped broker to rejoin the ISR",
    )


def test_describe_subscribe_and_list_offsets(gateway: GatewayProcess, admin: tidelog.Admin) -> None:
    admin.create_topic(
        "described", partitions=2, replication_factor=3, config={"retention.ms": "3600000"}
    )
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch("described", [b"a"] * 10, partition=1).result(30)
    topic = admin.describe_topic("described")
    assert topic.configs == {"retention.ms": "3600000"}
    p1 = topic.partitions[1]
    assert (p1.high_watermark, p1.log_end_offset, p1.log_start_offset) == (10, 10, 0)
    assert sorted(p1.isr) == sorted(p1.replicas) and len(p1.replicas) == 3
    cluster_info = admin.describe_cluster()
    assert sorted(b.broker_id for b in cluster_info.brokers) == [0, 1, 2]
    assert cluster_info.controller_id == 1 and cluster_info.cluster_id
    # Subscribe follows new data as it is written.
    stream = gateway.stub.Subscribe(
        gateway_pb2.SubscribeRequest(topic="described", partition=1, start_offset=8), timeout=30
    )
    first = next(stream)
    assert [
        r.offset for b in decode_batches(first.records) for r in b.records if r.offset >= 8
    ] == [8, 9]
    with tidelog.Producer(gateway.address) as producer:
        producer.send("described", b"late", partition=1).result(30)
    second = next(stream)
    assert [r.value for b in decode_batches(second.records) for r in b.records] == [b"late"]
    stream.cancel()
    with pytest.raises(grpc.RpcError) as raised:
        next(
            gateway.stub.Subscribe(
                gateway_pb2.SubscribeRequest(topic="nope", partition=0), timeout=10
            )
        )
    assert rpc_error_code(raised.value) == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
    offsets = gateway.stub.ListOffsets(
        storage_pb2.ListOffsetsRequest(
            replica_id=-1,
            partitions=[
                storage_pb2.ListOffsetsPartition(
                    topic="described", partition=1, spec=common_pb2.LATEST
                ),
                storage_pb2.ListOffsetsPartition(topic="nope", partition=0, spec=common_pb2.LATEST),
            ],
        ),
        timeout=10,
    )
    assert offsets.partitions[0].offset == 11
    assert ErrorCode(offsets.partitions[1].error.code) == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION


def test_describe_topics_offsets_survive_more_than_5000_partitions_on_one_leader(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Found by an audit: DescribeTopics asks each leader for EARLIEST and LATEST of every
    partition it leads, and asked them in ONE ListOffsets, so past 5,000 described
    partitions on one leader the storage node refused the whole call (10,000 items a
    request at most) and every partition of that leader was described with offsets -1 and
    INVALID_REQUEST. A leader's items go in calls of at most 10,000 now. (The real trigger
    is a broker leading more than 5,000 of the described partitions; the same count is
    reached here by naming one 18-partition topic 1,000 times.)"""
    topic = "described-many-times"
    admin.create_topic(topic, partitions=18, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        producer.send(topic, b"v", partition=0).result(30)
    response = gateway.stub.DescribeTopics(
        gateway_pb2.DescribeTopicsRequest(names=[topic] * 1000), timeout=30
    )
    errors = {
        (p.error.code, p.error.message)
        for t in response.topics
        for p in t.partitions
        if p.error.code != common_pb2.NONE
    }
    assert not errors, errors
    assert response.topics[0].partitions[0].high_watermark == 1


def test_sdk_errors_are_precise(gateway: GatewayProcess, admin: tidelog.Admin) -> None:
    admin.create_topic("errs", partitions=1, replication_factor=1)
    with pytest.raises(TopicAlreadyExistsError):
        admin.create_topic("errs", partitions=1, replication_factor=1)
    with pytest.raises(UnknownTopicOrPartitionError):
        admin.describe_topic("missing")
    with tidelog.Producer(gateway.address) as producer:
        with pytest.raises(UnknownTopicOrPartitionError):
            producer.send("missing", b"v")
        with pytest.raises(UnknownTopicOrPartitionError, match="partition 5"):
            producer.send("errs", b"v", partition=5)
    with pytest.raises(ConfigError, match="acks"):
        tidelog.Producer(gateway.address, acks="2")
    with pytest.raises(ConfigError, match="must be <= 5 with enable_idempotence"):
        tidelog.Producer(gateway.address, direct=True, max_in_flight_requests_per_partition=6)
    with pytest.raises(ConfigError, match="max_in_flight_requests_per_partition must be >= 1"):
        tidelog.Producer(gateway.address, max_in_flight_requests_per_partition=0)
    with tidelog.Consumer(gateway.address) as consumer, pytest.raises(UnknownTopicOrPartitionError):
        consumer.assign([("errs", 3)])
    admin.delete_topic("errs")
    assert "errs" not in admin.list_topics()


def test_health_and_reflection_list_every_service(gateway: GatewayProcess) -> None:
    with grpc.insecure_channel(gateway.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"tidelog.v1.Gateway", "grpc.health.v1.Health"} <= names


def test_produce_rides_through_a_leader_kill(cluster: TestCluster, gateway: GatewayProcess) -> None:
    """kill -9 a partition leader during acks=all production: every acknowledged record is
    read back exactly once, through the gateway's re-routing and idempotent retries."""
    admin = tidelog.Admin(gateway.address)
    admin.create_topic(
        "failover", partitions=1, replication_factor=3, config={"min.insync.replicas": "2"}
    )
    acked: list[tuple[int, bytes]] = []
    with tidelog.Producer(gateway.address, linger_ms=1, delivery_timeout_ms=60_000) as producer:
        for i in range(300):
            if i == 100:
                leader = admin.describe_topic("failover").partitions[0].leader
                cluster.kill(cluster.brokers[leader])
            value = f"r{i}".encode()
            acked.append((producer.send("failover", value).result(60).offset, value))
    cluster.start_broker(leader)
    records = _consume_all(gateway.address, "failover", len(acked))
    assert [(r.offset, r.value) for r in records] == sorted(acked)
    wait_for(
        lambda: len(admin.describe_topic("failover").partitions[0].isr) == 3,
        30,
        "the restarted broker to rejoin the ISR",
    )


def test_a_killed_gateway_fails_every_send_within_the_delivery_timeout(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """kill -9 of the gateway under a producer's stream: every send completes (acknowledged
    or failed) within delivery_timeout_ms, and every acknowledged record is in the log at
    its offset. A stream that failed at once used to be left as the producer's current
    one, so later requests were queued on it forever and flush never returned."""
    topic = "gateway-killed"
    doomed = cluster.start_gateway()
    admin.create_topic(topic, partitions=3, replication_factor=3)
    producer = tidelog.Producer(doomed.address, linger_ms=1, delivery_timeout_ms=3_000)
    futures = [producer.send_batch(topic, [f"{i}".encode()] * 100) for i in range(20)]
    for future in futures:
        future.result(30)  # the stream is up and answering
    cluster.kill(doomed)
    futures += [producer.send_batch(topic, [f"{i}".encode()] * 100) for i in range(20, 60)]
    producer.flush(30)  # raises if any send is still unanswered (it used to hang forever)
    producer.close()
    acked: dict[tuple[int, int], bytes] = {}
    failed = 0
    for i, future in enumerate(futures):
        try:
            metadata = future.result(0)
        except (NetworkError, RequestTimedOutError):
            failed += 1
            continue
        for partition, offset in zip(metadata.partitions, metadata.offsets, strict=True):
            assert (partition, offset) not in acked  # two acknowledged there: one is lost
            acked[(partition, offset)] = f"{i}".encode()
    assert failed >= 40  # nothing after the kill could be acknowledged
    records = _consume_all(gateway.address, topic, len(acked))
    assert {(r.partition, r.offset): r.value for r in records} == acked


def test_a_stopped_gateway_times_out_the_stream_and_the_retry_lands_once(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A gateway stopped (SIGSTOP) past request_timeout_ms keeps its connection open, so
    nothing fails by itself: the producer cancels the stream, retries on a new one, and
    once the gateway runs again every record lands exactly once, in order (idempotence)."""
    topic = "gateway-stopped"
    paused = cluster.start_gateway()
    admin.create_topic(topic, partitions=1, replication_factor=3)
    with tidelog.Producer(
        paused.address, linger_ms=1, request_timeout_ms=1_000, delivery_timeout_ms=60_000
    ) as producer:
        producer.send(topic, b"first").result(30)  # producer id and stream in place
        os.kill(paused.pid, signal.SIGSTOP)
        try:
            futures = [producer.send(topic, f"v{i}".encode()) for i in range(50)]
            # Past the request timeout and grace: the first stream was cancelled.
            wait_for(
                lambda: producer.metrics()["record-retry-total"] > 0 or None,
                30,
                "the producer to give up on the stopped gateway's stream and retry",
            )
        finally:
            os.kill(paused.pid, signal.SIGCONT)
        offsets = [f.result(60).offset for f in futures]
    assert offsets == list(range(1, 51))
    records = _consume_all(gateway.address, topic, 51)
    assert [r.value for r in records] == [b"first"] + [f"v{i}".encode() for i in range(50)]


@pytest.mark.parametrize(
    "holder_acks", [common_pb2.LEADER, common_pb2.NONE_ACKS], ids=["acks=1", "acks=0"]
)
def test_a_request_that_finds_the_produce_budget_full_fails_alone_and_writes_nothing(
    cluster: TestCluster, admin: tidelog.Admin, holder_acks: common_pb2.Acks
) -> None:
    """--queued-max-request-bytes bounds the produce bytes a gateway holds over all
    clients: with a 1 MiB budget held by a request to a stopped leader, another request
    waits, and answers REQUEST_TIMED_OUT at its own timeout with nothing written; once
    the budget frees up the same request goes through. An acks=0 request holds its bytes
    until its append is over, after its answer (it used to give them back at the answer,
    and acks=0 requests to a stopped leader held gigabytes the budget did not count)."""
    topic = f"produce-budget-{holder_acks}"
    small = cluster.start_gateway(["--queued-max-request-bytes", str(1024 * 1024)])
    admin.create_topic(topic, partitions=3, replication_factor=1)
    leaders = {p.partition: p.leader for p in admin.describe_topic(topic).partitions}
    stuck = 0
    free = next(p for p, leader in leaders.items() if leader != leaders[stuck])
    batch = encode_batch([b"x" * 1000] * 900)  # ~900 KiB: two do not fit

    def produce(
        partition: int, timeout_ms: int, acks: common_pb2.Acks = common_pb2.LEADER
    ) -> gateway_pb2.ProduceResponse:
        return small.stub.Produce(
            gateway_pb2.ProduceRequest(
                acks=acks,
                timeout_ms=timeout_ms,
                partitions=[
                    gateway_pb2.ProducePartitionData(
                        topic=topic, partition=partition, records=batch
                    )
                ],
            ),
            timeout=30,
        )

    stopped = cluster.brokers[leaders[stuck]]
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        holder = threading.Thread(target=produce, args=(stuck, 4_000, holder_acks))
        holder.start()
        time.sleep(0.5)  # the holder's bytes are in the budget, waiting on the leader
        refused = produce(free, 1_000).partitions[0]
        assert ErrorCode(refused.error.code) == ErrorCode.REQUEST_TIMED_OUT
        assert "--queued-max-request-bytes" in refused.error.message
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    holder.join(30)
    accepted = produce(free, 10_000).partitions[0]
    assert ErrorCode(accepted.error.code) == ErrorCode.NONE
    assert accepted.base_offset == 0  # the refused attempt wrote nothing
    wait_for(
        lambda: admin.describe_topic(topic).partitions[stuck].leader >= 0 or None,
        30,
        "the stopped broker to lead its partition again",
    )
    # A producer's stream with more in flight than the budget holds is slowed, not failed.
    values = [b"y" * 1000] * 5_000
    with tidelog.Producer(small.address, linger_ms=5) as producer:
        metadata = producer.send_batch(topic, values, partition=free).result(60)
    assert list(metadata.offsets) == list(range(900, 5_900))


def test_fetches_share_the_fetch_budget_and_wait_for_room_instead_of_growing(
    cluster: TestCluster, admin: tidelog.Admin
) -> None:
    """--queued-max-fetch-bytes bounds the fetch answers a gateway holds over all
    consumers: a fetch asks the leaders for at most a quarter of the room left; long polls
    that hold the whole budget make the next fetch wait and answer "not answered" (no
    records, offsets -1) within its own wait time; once they end, it gets its data, and
    every record is read."""
    topic = "fetch-budget"
    mib = 1024 * 1024
    small = cluster.start_gateway(["--queued-max-fetch-bytes", str(mib)])
    admin.create_topic(topic, partitions=2, replication_factor=1)
    values = [f"{i:04d}".encode() * 250 for i in range(2_000)]  # 1000-byte values, ~2 MB
    with tidelog.Producer(small.address, batch_bytes=100_000) as producer:
        producer.send_batch(topic, values, partition=0).result(30)

    def fetch(partition: int, wait_ms: int) -> storage_pb2.FetchPartitionResult:
        response = small.stub.Fetch(
            storage_pb2.FetchRequest(
                replica_id=-1,
                max_wait_ms=wait_ms,
                partitions=[
                    storage_pb2.FetchPartition(
                        topic=topic, partition=partition, fetch_offset=0, max_bytes=mib
                    )
                ],
            ),
            timeout=30,
        )
        result: storage_pb2.FetchPartitionResult = response.partitions[0]
        assert ErrorCode(result.error.code) == ErrorCode.NONE
        return result

    alone = fetch(0, 0)  # a quarter of the budget, of the 1 MiB it asked for
    assert 0 < len(alone.records) <= mib // 4
    assert alone.high_watermark == 2_000
    # Four long polls of the empty partition take 256 KiB each: the whole budget.
    polls = [threading.Thread(target=fetch, args=(1, 6_000)) for _ in range(4)]
    for poll in polls:
        poll.start()
    time.sleep(1.0)
    started = time.monotonic()
    starved = fetch(0, 500)
    assert time.monotonic() - started >= 0.4  # it waited for room
    assert starved.records == b""
    assert starved.high_watermark == -1  # "not answered": the client asks again
    for poll in polls:
        poll.join(30)
    fed = fetch(0, 500)
    assert 0 < len(fed.records) <= mib // 4
    records = _consume_all(small.address, topic, 2_000)
    assert sorted(r.value for r in records) == sorted(values)


class _ActiveCall:
    """The servicer context of a call whose client is still there, with no deadline;
    callbacks (gRPC's "the call ended") are kept to be run by the test."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> float | None:
        return None

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self.callbacks.append(callback)
        return True


def test_an_answer_waiting_to_be_sent_holds_only_its_own_bytes_of_the_fetch_budget(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """While gRPC holds an answer (a client that does not read stops a Subscribe at its
    yield, for good if it never reads again), only the answer's bytes stay in the fetch
    budget. The whole grant (1 MiB for a 10 KB answer) used to stay held: a few hundred
    subscribers of quiet partitions that stopped reading took a whole budget, and every
    Fetch of the gateway answered "not answered" while they stayed connected (found by
    an audit). The handler runs here in-process, on a real cluster, to see its budget."""
    topic = f"held-answers-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address, linger_ms=50) as producer:
        producer.send_batch(topic, [b"h" * 1000] * 10, partition=0).result(30)
    store = MetaStore(cluster.etcd.endpoint, cluster=cluster.cluster)
    cache = MetadataCache(store)
    channels, calls = Channels(), LeaderCalls()
    try:
        cache.start(10)
        handler = FetchHandler(Router(cache, channels), FetchLimits(), calls)
        subscription = handler.subscribe(
            gateway_pb2.SubscribeRequest(topic=topic, partition=0, start_spec=common_pb2.EARLIEST),
            cast(Any, _ActiveCall()),
        )
        answer = next(subscription)  # now "in gRPC": the generator waits at its yield
        assert answer.high_watermark == 10 and 10_000 < len(answer.records) < 11_000
        assert handler.budget.in_use_bytes == answer.ByteSize()
        subscription.close()
        assert handler.budget.in_use_bytes == 0

        context = _ActiveCall()  # a Fetch's answer is held until its call has ended
        encoded = handler.fetch(
            storage_pb2.FetchRequest(
                replica_id=-1,
                partitions=[storage_pb2.FetchPartition(topic=topic, partition=0)],
            ),
            None,
            context.add_callback,
        )
        assert len(encoded) > 10_000
        assert handler.budget.in_use_bytes == len(encoded)
        for callback in context.callbacks:
            callback()
        assert handler.budget.in_use_bytes == 0
    finally:
        calls.close()
        channels.close()
        cache.stop()
        store.close()


def test_admin_calls_reach_the_controller(gateway: GatewayProcess) -> None:
    response = gateway.stub.CreateTopics(
        controller_pb2.CreateTopicsRequest(
            topics=[
                controller_pb2.CreatableTopic(
                    name="bad/name", num_partitions=1, replication_factor=1
                )
            ]
        ),
        timeout=30,
    )
    assert ErrorCode(response.topics[0].error.code) == ErrorCode.INVALID_TOPIC
    response = gateway.stub.CreateTopics(
        controller_pb2.CreateTopicsRequest(
            topics=[
                controller_pb2.CreatableTopic(
                    name="too-wide", num_partitions=1, replication_factor=9
                )
            ]
        ),
        timeout=30,
    )
    assert ErrorCode(response.topics[0].error.code) == ErrorCode.INVALID_REPLICATION_FACTOR


def test_concurrent_alters_of_one_topic_answer_promptly(
    gateway: GatewayProcess, request: pytest.FixtureRequest
) -> None:
    """Alters of different keys of one topic from three threads each answer at once. The
    gateway waited until its metadata showed exactly the configs the controller answered;
    the next alter, committed right after, moved the view past that state before the
    waiting thread looked, and two of the three calls waited out their whole timeout
    every time (found by an audit)."""
    admin = tidelog.Admin(gateway.address, timeout_ms=8_000)
    request.addfinalizer(admin.close)
    admin.create_topic("alter-race", partitions=1, replication_factor=3)
    took_s: dict[tuple[int, str], float] = {}
    errors: list[BaseException] = []

    def alter(round_: int, key: str) -> None:
        started = time.monotonic()
        try:
            admin.alter_topic_config("alter-race", {key: str(100_000 + round_)})
        except BaseException as exc:
            errors.append(exc)
        took_s[(round_, key)] = time.monotonic() - started

    for round_ in range(3):
        threads = [
            threading.Thread(target=alter, args=(round_, key))
            for key in ("retention.ms", "segment.ms", "file.delete.delay.ms")
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors, errors
    worst_s = max(took_s.values())
    # Each alter is one etcd write and one LeaderAndIsr round: well under a second here.
    assert worst_s < 4.0, f"an alter_topic_config took {worst_s:.1f} s (its whole timeout)"
    assert admin.describe_topic("alter-race").configs["segment.ms"] == "100002"


class _EtcdController:
    """Stands in for the gateway's ``ControllerClient`` and for the controller: makes a
    topic change in etcd as the controller does (topic and partition keys in one
    transaction, leaders on broker 1), runs ``before_answer`` (what else commits before
    the answer is back), and answers success."""

    def __init__(self, store: MetaStore) -> None:
        self._store = store
        self.before_answer: Callable[[], None] = lambda: None
        store.put(broker_key(1), encode_broker(Broker(1, "localhost", 1)))

    def call(self, timeout_s: float, fn: Callable[[Any, float], Any]) -> Any:
        return fn(self, timeout_s)

    def create(self, name: str) -> None:
        topic = Topic(name, uuid.uuid4().hex, ((1,),))
        record = PartitionRecord(leader=1, leader_epoch=0, isr=(1,), partition_epoch=0)
        self._store.txn(
            [],
            [
                PutOp(topic_key(name), encode_topic(topic)),
                PutOp(partition_key(name, 0), encode_partition(record)),
            ],
        )

    def CreateTopics(  # noqa: N802 - the stub's method name
        self, request: controller_pb2.CreateTopicsRequest, timeout: float
    ) -> controller_pb2.CreateTopicsResponse:
        for topic in request.topics:
            self.create(topic.name)
        self._answer_next()
        return controller_pb2.CreateTopicsResponse(
            topics=[controller_pb2.CreateTopicResult(name=t.name) for t in request.topics]
        )

    def DeleteTopics(  # noqa: N802 - the stub's method name
        self, request: controller_pb2.DeleteTopicsRequest, timeout: float
    ) -> controller_pb2.DeleteTopicsResponse:
        for name in request.names:
            self._store.txn(
                [], [DeleteOp(topic_key(name)), DeleteOp(partitions_prefix(name), prefix=True)]
            )
        self._answer_next()
        return controller_pb2.DeleteTopicsResponse(
            topics=[controller_pb2.TopicResult(name=name) for name in request.names]
        )

    def _answer_next(self) -> None:
        before_answer, self.before_answer = self.before_answer, lambda: None
        before_answer()


class _NoDeadline:
    """The servicer context of a client that set no deadline."""

    def time_remaining(self) -> float | None:
        return None


@pytest.fixture
def scripted_gateway(
    cluster: TestCluster,
) -> Iterator[tuple[GatewayServicer, _EtcdController, MetadataCache]]:
    """A gateway servicer whose metadata watches its own keys in the cluster's etcd,
    before an ``_EtcdController``."""
    store = MetaStore(cluster.etcd.endpoint, cluster=f"scripted-{uuid.uuid4().hex[:8]}")
    cache = MetadataCache(store)
    try:
        controller = _EtcdController(store)
        cache.start(10)
        unused: Any = None  # admin calls use only the metadata and the controller
        servicer = GatewayServicer(
            cache=cache,
            produce=unused,
            fetch=unused,
            controller=cast(Any, controller),
            offsets=unused,
            groups=unused,
            producer_ids=unused,
            max_in_flight_per_stream=1,
        )
        yield servicer, controller, cache
    finally:
        cache.stop()
        store.close()


def _in_another_thread(fn: Callable[[], object]) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()


def test_a_delete_answers_promptly_when_the_name_is_re_created_at_once(
    scripted_gateway: tuple[GatewayServicer, _EtcdController, MetadataCache],
) -> None:
    """DeleteTopics waited until the name was gone from the gateway's metadata; when another
    client re-created it before the delete's answer came back, the name never went, and the
    delete waited out its whole timeout. It waits for the deletion or anything newer."""
    servicer, controller, cache = scripted_gateway
    controller.create("again")
    old_id = wait_for(
        lambda: cache.read(lambda view: view.topics["again"].topic_id), 10, "the topic"
    )
    create = controller_pb2.CreateTopicsRequest(
        topics=[controller_pb2.CreatableTopic(name="again", num_partitions=1)], timeout_ms=5_000
    )
    controller.before_answer = lambda: _in_another_thread(
        lambda: servicer.CreateTopics(create, _NoDeadline())
    )
    started = time.monotonic()
    response = servicer.DeleteTopics(
        controller_pb2.DeleteTopicsRequest(names=["again"], timeout_ms=5_000), _NoDeadline()
    )
    took_s = time.monotonic() - started
    assert [r.error.code for r in response.topics] == [common_pb2.NONE]
    assert took_s < 2.5, f"the delete took {took_s:.1f} s (its whole timeout)"
    # The re-create is what the metadata shows, ready: it answered once it was.
    assert cache.read(lambda view: view.topics["again"].topic_id) != old_id
    assert cache.read(lambda view: view.ready("again"))


def test_a_create_answers_promptly_when_the_topic_is_deleted_at_once(
    scripted_gateway: tuple[GatewayServicer, _EtcdController, MetadataCache],
) -> None:
    """CreateTopics waited until the gateway's metadata showed the topic with leaders; when
    another client deleted it before the create's answer came back, that never happened,
    and the create waited out its whole timeout."""
    servicer, controller, cache = scripted_gateway
    delete = controller_pb2.DeleteTopicsRequest(names=["brief"], timeout_ms=5_000)
    controller.before_answer = lambda: _in_another_thread(
        lambda: servicer.DeleteTopics(delete, _NoDeadline())
    )
    started = time.monotonic()
    response = servicer.CreateTopics(
        controller_pb2.CreateTopicsRequest(
            topics=[controller_pb2.CreatableTopic(name="brief", num_partitions=1)],
            timeout_ms=5_000,
        ),
        _NoDeadline(),
    )
    took_s = time.monotonic() - started
    assert [r.error.code for r in response.topics] == [common_pb2.NONE]
    assert took_s < 2.5, f"the create took {took_s:.1f} s (its whole timeout)"
    assert "brief" not in cache.read(lambda view: set(view.topics))


def test_create_partitions_and_consumer_positioning(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    admin.create_topic("growing", partitions=1, replication_factor=2)
    admin.create_partitions("growing", 3)
    assert len(admin.describe_topic("growing").partitions) == 3
    with tidelog.Producer(gateway.address) as producer:
        for p in range(3):
            producer.send_batch(
                "growing", [f"p{p}-{i}".encode() for i in range(5)], partition=p
            ).result(30)
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.subscribe(["growing"])
        assert sorted(consumer.assignment()) == [("growing", 0), ("growing", 1), ("growing", 2)]
        consumer.seek_to_end([("growing", 0)])
        consumer.seek(("growing", 1), 3)
        assert consumer.position(("growing", 0)) == 5
        assert consumer.end_offsets([("growing", 2)]) == {("growing", 2): 5}
        seen = []
        for record in consumer:
            seen.append(record.value)
            if len(seen) == 7:
                break
        assert sorted(seen) == sorted([b"p1-3", b"p1-4"] + [f"p2-{i}".encode() for i in range(5)])
        assert consumer.position(("growing", 1)) == 5


def test_records_sent_while_a_request_is_in_flight_share_one_batch(
    cluster: TestCluster, admin: tidelog.Admin
) -> None:
    # Kafka's accumulator: while a partition waits for an answer, later records join one
    # open batch, instead of each wake-up of the sender closing a batch of a record or
    # two that the leader, the followers and every consumer then handle one by one.
    # A stopped gateway holds the producer's request in flight.
    topic = "in-flight-batching"
    paused = cluster.start_gateway()
    admin.create_topic(topic, partitions=1, replication_factor=1)
    later_values = [f"later-{i}".encode() for i in range(30)]
    with tidelog.Producer(paused.address, linger_ms=0) as producer:
        producer.send(topic, b"first").result(30)  # producer id and stream in place
        os.kill(paused.pid, signal.SIGSTOP)
        try:
            # Stopped for certain before "held" goes out: a gateway still running for a
            # moment answered it, and "later-0" then went alone (seen on a loaded machine).
            wait_for(lambda: _process_state(paused.pid) == "T", 10, "the gateway to stop")
            held = producer.send(topic, b"held")
            time.sleep(0.3)  # sent: the request sits in the stopped gateway's socket
            later = []
            for value in later_values:
                later.append(producer.send(topic, value))
                time.sleep(0.005)  # the sender thread wakes between sends
        finally:
            os.kill(paused.pid, signal.SIGCONT)
        offsets = [f.result(30).offset for f in [held, *later]]
    assert offsets == list(range(1, 32))
    response = paused.stub.Fetch(
        storage_pb2.FetchRequest(
            replica_id=-1,
            partitions=[storage_pb2.FetchPartition(topic=topic, partition=0, fetch_offset=0)],
        ),
        timeout=30,
    )
    batches = [[r.value for r in b.records] for b in decode_batches(response.partitions[0].records)]
    assert batches == [[b"first"], [b"held"], later_values]


def test_keyless_records_move_on_after_a_batch_worth_even_in_small_batches(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    # Kafka's uniform sticky partitioner (KIP-794): the bytes sent to the sticky partition
    # are counted across batches. Here every record is its own batch (each waits for its
    # answer), which never fills one: counting per batch would never move.
    topic = "sticky-moves"
    admin.create_topic(topic, partitions=6, replication_factor=1)
    value = b"v" * 100
    batch_bytes = 8 * (len(value) + RECORD_OVERHEAD_BYTES) + BATCH_OVERHEAD_BYTES  # 8 records
    with tidelog.Producer(gateway.address, batch_bytes=batch_bytes, linger_ms=0) as producer:
        partitions = [producer.send(topic, value).result(30).partition for _ in range(80)]
    assert _runs(partitions) == [8] * 10, partitions


def test_a_producer_batch_of_random_bytes_sized_to_fit_passes_max_message_bytes(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Found by an audit: the producer's budget for a batch's records left a fixed reserve
    for the batch's overhead, which an lz4 frame of incompressible data outgrows from ~4
    MiB batches: a record the producer had sized to fit was refused MESSAGE_TOO_LARGE by
    a topic whose max.message.bytes is batch_bytes + 12 (the defaults' relation)."""
    batch_bytes = 8 << 20
    topic = "lz4-random-fits"
    admin.create_topic(
        topic,
        partitions=1,
        replication_factor=1,
        config={"max.message.bytes": str(batch_bytes + 12)},
    )
    budget = batch_bytes - batch_overhead_bytes(batch_bytes)
    value = random.Random(2).randbytes(budget - RECORD_OVERHEAD_BYTES)
    with tidelog.Producer(
        gateway.address, batch_bytes=batch_bytes, compression="lz4", linger_ms=0
    ) as producer:
        assert producer.send(topic, value, partition=0).result(60).offset == 0


@pytest.mark.parametrize("answer", [7, -1])
def test_a_partitioners_answer_out_of_range_is_refused_at_the_call(
    gateway: GatewayProcess, admin: tidelog.Admin, answer: int
) -> None:
    """Found by an audit: a custom partitioner's answer was used as it came, so one out of
    range went out and failed only delivery_timeout_ms later, said to be "sent, and may
    have been written". It is refused at the call, as an explicit partition is (Kafka's
    producer refuses it in send())."""
    topic = f"partitioner-{answer + 10}"
    admin.create_topic(topic, partitions=3, replication_factor=1)
    with tidelog.Producer(
        gateway.address, partitioner=lambda key, count: answer, delivery_timeout_ms=20_000
    ) as producer:
        with pytest.raises(UnknownTopicOrPartitionError, match=f"partition {answer} of"):
            producer.send(topic, b"v", key=b"k")
        with pytest.raises(UnknownTopicOrPartitionError, match=f"partition {answer} of"):
            producer.send_batch(topic, [b"v"], keys=[b"k"])


def _process_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc (``T``: stopped by a signal)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _runs(partitions: list[int]) -> list[int]:
    """Lengths of the runs of equal neighbours: [1, 1, 4, 4, 4] -> [2, 3]."""
    runs: list[int] = []
    for i, p in enumerate(partitions):
        if i and p == partitions[i - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def test_small_keyless_send_batches_stay_on_the_sticky_partition_for_a_batch_worth(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """send_batch counts toward the sticky partition like send (KIP-794): a pipeline's
    micro-batches, each far below batch_bytes, go to one partition until a batch's worth
    went there, list and Arrow input alike, instead of each call moving on (which put
    every leader and follower to work on every round). A call of several batches' worth
    moves on after each full batch."""
    pa = pytest.importorskip("pyarrow")
    topic = "sticky-batches"
    admin.create_topic(topic, partitions=6, replication_factor=1)
    value = b"v" * 100
    batch_bytes = 8 * (len(value) + RECORD_OVERHEAD_BYTES) + BATCH_OVERHEAD_BYTES  # 8 records
    arrow_pair = pa.array([value] * 2, pa.binary())
    with tidelog.Producer(gateway.address, batch_bytes=batch_bytes, linger_ms=0) as producer:
        from_lists = [
            producer.send_batch(topic, [value] * 2).result(30).partitions[0] for _ in range(40)
        ]
        from_arrow = [
            producer.send_batch(topic, arrow_pair).result(30).partitions[0] for _ in range(40)
        ]
        large = producer.send_batch(topic, [value] * 32).result(30)
    assert _runs(from_lists) == [4] * 10, from_lists
    assert _runs(from_arrow) == [4] * 10, from_arrow
    assert _runs(list(large.partitions)) == [8] * 4, list(large.partitions)


def test_default_batches_stay_within_the_default_max_message_bytes(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """With every default (batch_bytes 1 MiB; the topic's max.message.bytes 1 MiB + 12),
    full batches pass the leader's size check however the records come: keyed records
    with their own timestamps (the most framing per record), a large record after many
    small ones (a batch closes before a record would take it past batch_bytes), and an
    Arrow array whose rows grow large after small ones (cut by the running size, not the
    average). Each of these used to make a batch the leader refused as MESSAGE_TOO_LARGE."""
    pa = pytest.importorskip("pyarrow")
    topic = "full-batches"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    keyed = [(f"k{i:08d}".encode(), bytes([i % 251]) * 100) for i in range(20_000)]
    small_then_large = [b"s" * 1000] * 1000 + [b"L" * 600_000]
    skewed = pa.array([b"t" * 10] * 20_000 + [b"W" * 2000] * 2_000, pa.binary())
    # Recent timestamps: retention.ms (7 days) retires segments by their records' times,
    # and segment.ms rolls by them, so 2023's would be deleted (as Kafka would).
    now_ms = int(time.time() * 1000)
    with tidelog.Producer(gateway.address, linger_ms=50) as producer:
        futures = [
            producer.send(topic, value, key=key, timestamp_ms=now_ms + i)
            for i, (key, value) in enumerate(keyed)
        ]
        futures += [producer.send(topic, value) for value in small_then_large]
        arrow = producer.send_batch(topic, skewed)
        written = [f.result(60) for f in futures]
        assert len(arrow.result(60)) == len(skewed)
    assert [m.offset for m in written] == list(range(len(written)))
    records = _consume_all(gateway.address, topic, len(written) + len(skewed))
    assert len(records) == len(written) + len(skewed)
    assert [(r.key, r.value) for r in records[: len(keyed)]] == keyed


def test_send_batch_checks_its_items_before_queueing_anything(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A value, key, header or timestamp that cannot be sent fails the call at once,
    before anything is queued: found only when the sender encoded, it failed every batch
    of its request and spent other partitions' sequence numbers (their next batches then
    failed too)."""
    topic = "checked-items"
    admin.create_topic(topic, partitions=2, replication_factor=1)
    with tidelog.Producer(gateway.address, linger_ms=20) as producer:
        good = producer.send(topic, b"first", partition=1)
        with pytest.raises(ConfigError, match="values must hold bytes or None, not str"):
            producer.send_batch(topic, [b"ok", "text"], partition=0)  # type: ignore[list-item]
        with pytest.raises(ConfigError, match="keys must hold bytes or None, not int"):
            producer.send_batch(topic, [b"ok"], keys=[7])  # type: ignore[list-item]
        # send's headers and timestamps too (they used to fail the request at encoding).
        with pytest.raises(ConfigError, match="header values must hold bytes or None"):
            producer.send(topic, b"x", partition=0, headers=[("k", "text")])  # type: ignore[list-item]
        with pytest.raises(ConfigError, match="each header must be a"):
            producer.send(topic, b"x", partition=0, headers=[("k",)])  # type: ignore[list-item]
        with pytest.raises(ConfigError, match="header names must be str"):
            producer.send(topic, b"x", partition=0, headers=[(b"k", b"v")])  # type: ignore[list-item]
        with pytest.raises(ConfigError, match="timestamp_ms must be a non-negative int64"):
            producer.send(topic, b"x", partition=0, timestamp_ms=2**63)
        with pytest.raises(ConfigError, match="timestamp_ms must be an int"):
            producer.send_batch(topic, [b"x"], timestamp_ms="soon")  # type: ignore[arg-type]
        assert good.result(30).offset == 0
        after = producer.send_batch(topic, [b"a", b"b"], partition=1).result(30)
        assert [m.offset for m in after] == [1, 2]
        assert producer.send(topic, b"zero", partition=0).result(30).offset == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failed_sender_fails_every_send_instead_of_leaving_it_pending(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Should the sender thread ever fail (a bug: here the batch encoder is made to raise
    what it never raises), nothing may wait for it for ever: what was queued fails,
    flush() returns, and later sends raise at once."""
    admin.create_topic("failed-sender", partitions=2, replication_factor=1)
    producer = tidelog.Producer(gateway.address, linger_ms=50)
    assert producer.send("failed-sender", b"before", partition=0).result(30).offset == 0

    def broken_encoder(*_: object) -> None:
        raise RuntimeError("a bug in the sender")

    producer._encode = broken_encoder  # type: ignore[method-assign,assignment]
    queued = [producer.send("failed-sender", b"v", partition=p % 2) for p in range(10)]
    for future in queued:
        with pytest.raises(UnknownServerError, match="sender thread failed"):
            future.result(30)
    producer.flush(30)
    with pytest.raises(UnknownServerError, match="sends no more"):
        producer.send("failed-sender", b"after", partition=0)
    with pytest.raises(UnknownServerError, match="sends no more"):
        producer.send_batch("failed-sender", [b"after"], partition=0)
    producer.close(30)


def test_send_batch_of_arrow_values(gateway: GatewayProcess, admin: tidelog.Admin) -> None:
    pa = pytest.importorskip("pyarrow")
    admin.create_topic("arrow-in", partitions=2, replication_factor=3)
    values = pa.array([f"a{i}".encode() for i in range(5_000)], pa.binary())
    with tidelog.Producer(gateway.address, batch_bytes=4096) as producer:
        result = producer.send_batch("arrow-in", values).result(30)
        pinned = producer.send_batch("arrow-in", values.slice(0, 10), partition=1).result(30)
    assert len(result) == 5_000 and {m.partition for m in pinned} == {1}
    records = _consume_all(gateway.address, "arrow-in", 5_010)
    by_value = {}
    for r in records:
        by_value.setdefault(r.value, []).append((r.partition, r.offset))
    for i, m in enumerate(result):
        assert (m.partition, m.offset) in by_value[f"a{i}".encode()]
    assert sorted(r.value for r in records) == sorted(
        [f"a{i}".encode() for i in range(5_000)] + [f"a{i}".encode() for i in range(10)]
    )


def test_batch_metadata_writes_each_batch_offsets_when_first_read() -> None:
    """send_batch's answer keeps each batch as (first index, end, base offset) and writes
    the offsets out on first read: whichever way they are read, every value gets its own
    offset, and values answered one by one (keyed records) keep theirs."""
    offsets = array("q", bytes(8 * 7))
    offsets[6] = 99  # a value placed on its own
    partitions = array("i", [0, 0, 0, 1, 1, 1, 2])
    runs = [(3, 6, 40), (0, 3, 10)]  # batches answer in any order
    by_index = BatchMetadata("t", partitions, array("q", offsets), 5, list(runs))
    assert [m.offset for m in by_index] == [10, 11, 12, 40, 41, 42, 99]
    assert by_index[4] == tidelog.RecordMetadata("t", 1, 41, 5)
    whole = BatchMetadata("t", partitions, array("q", offsets), 5, list(runs))
    assert list(whole.offsets) == [10, 11, 12, 40, 41, 42, 99] == list(whole.offsets)
    assert len(whole) == 7 and list(whole.partitions) == list(partitions)


def test_client_metrics_count_batches_requests_and_records(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Kafka's producer and consumer metrics by name, counted once per batch, request or
    fetch answer: what the benchmarks report as batch and fetch sizes."""
    admin.create_topic(
        "metered", partitions=2, replication_factor=2, config={"max.message.bytes": "4096"}
    )
    with tidelog.Producer(gateway.address, batch_bytes=1024, linger_ms=0) as producer:
        assert producer.metrics()["record-send-total"] == 0
        assert producer.metrics()["batch-size-avg"] == 0.0
        producer.send_batch("metered", [b"v" * 40] * 300, partition=0).result(30)
        sent = producer.metrics()
        # One batch over the topic's max.message.bytes: the leader refuses it for good.
        with pytest.raises(MessageTooLargeError):
            producer.send("metered", b"x" * 8_000, partition=1).result(30)
        failed = producer.metrics()
    assert sent["record-send-total"] == 300
    # batch_bytes 1024 cuts the 300 records (56 estimated bytes each) into batches of
    # 18 records, ~0.8 KiB encoded, several per request.
    assert 512 <= sent["batch-size-avg"] <= sent["batch-size-max"] <= 1024 + 128, sent
    assert 1 <= sent["request-total"] <= 17, sent
    assert sent["records-per-request-max"] <= 300
    assert sent["records-per-request-avg"] == 300 / sent["request-total"]
    assert sent["record-error-total"] == sent["record-retry-total"] == 0
    assert sent["request-latency-max"] >= sent["request-latency-avg"] > 0
    assert failed["record-send-total"] == 301 and failed["record-error-total"] == 1
    assert failed["batch-size-max"] > 8_000 and failed["record-retry-total"] == 0

    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.assign([("metered", 0)])
        records: list[Any] = []
        while len(records) < 300:
            got = consumer.poll(max_records=100, timeout_ms=5_000)
            assert got, "no records within 5 s"
            records.extend(got)
        read = consumer.metrics()
    assert [r.value for r in records] == [b"v" * 40] * 300
    assert read["records-consumed-total"] == 300
    assert read["fetch-total"] >= 1
    # Every fetched batch was handed out whole, once: consumed = fetched.
    fetched_bytes = read["fetch-size-avg"] * read["fetch-total"]
    assert read["bytes-consumed-total"] == pytest.approx(fetched_bytes)
    assert read["bytes-consumed-total"] > 300 * 40
    assert read["fetch-size-max"] >= read["fetch-size-avg"] > 0
    assert read["records-per-request-max"] <= 300
    assert read["records-per-request-avg"] * read["fetch-total"] == pytest.approx(300)


def test_fetch_across_leaders_answers_as_soon_as_one_has_data(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    # Three partitions on three leaders, all at their log end. A long poll over all of
    # them must answer when one leader gets data, not wait for the quiet two; their
    # partitions come back without records, offsets -1 ("not answered").
    topic = "fetch-first-leader"
    admin.create_topic(topic, partitions=3, replication_factor=1)
    leaders = {p.partition: p.leader for p in admin.describe_topic(topic).partitions}
    assert len(set(leaders.values())) == 3
    stub = gateway.stub

    def fetch(offsets: dict[int, int], wait_ms: int) -> dict[int, Any]:
        response = stub.Fetch(
            storage_pb2.FetchRequest(
                replica_id=-1,
                max_wait_ms=wait_ms,
                partitions=[
                    storage_pb2.FetchPartition(topic=topic, partition=p, fetch_offset=o)
                    for p, o in offsets.items()
                ],
            ),
            # Far below the long poll's wait: waiting for every leader would fail this.
            timeout=20,
        )
        assert len(response.partitions) == len(offsets)
        assert all(r.error.code == common_pb2.NONE for r in response.partitions)
        return {r.partition: r for r in response.partitions}

    answer: dict[str, dict[int, Any]] = {}
    waiting = threading.Thread(
        target=lambda: answer.update(first=fetch({0: 0, 1: 0, 2: 0}, wait_ms=30_000))
    )
    waiting.start()
    time.sleep(0.5)  # let the long polls reach the leaders
    with tidelog.Producer(gateway.address) as producer:
        producer.send(topic, b"one", partition=1).result(30)
    waiting.join(30)
    assert not waiting.is_alive()
    first = answer["first"]
    assert [r.value for b in decode_batches(first[1].records) for r in b.records] == [b"one"]
    assert first[1].high_watermark == 1
    for quiet in (0, 2):
        assert not first[quiet].records
        assert first[quiet].high_watermark == -1
    # Data already at two leaders: whatever one answer leaves out, the next brings, and
    # neither waits.
    with tidelog.Producer(gateway.address) as producer:
        producer.send(topic, b"zero", partition=0).result(30)
        producer.send(topic, b"two", partition=2).result(30)
    offsets = {0: 0, 1: 1, 2: 0}
    seen: list[bytes] = []
    for _ in range(2):
        for partition, result in fetch(offsets, wait_ms=30_000).items():
            for batch in decode_batches(result.records):
                seen.extend(r.value for r in batch.records)
                offsets[partition] = batch.next_offset
        if len(seen) == 2:
            break
    assert sorted(seen) == [b"two", b"zero"]


def test_fetch_across_leaders_answers_at_once_when_one_leader_answers_an_error(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A long poll over several leaders answers at once when one leader answers an error
    (here an offset past its log end), as Kafka's delayed fetch completes on a partition
    error, rather than waiting out max_wait_ms for the quiet ones. (An audit suspected it
    waited; an error answer's bytes counted as records, so it did not, by accident.)"""
    topic = "fetch-leader-error"
    admin.create_topic(topic, partitions=3, replication_factor=1)
    leaders = {p.partition: p.leader for p in admin.describe_topic(topic).partitions}
    assert len(set(leaders.values())) == 3
    response = gateway.stub.Fetch(
        storage_pb2.FetchRequest(
            replica_id=-1,
            max_wait_ms=60_000,
            partitions=[
                storage_pb2.FetchPartition(topic=topic, partition=p, fetch_offset=o)
                for p, o in {0: 0, 1: 5, 2: 0}.items()
            ],
        ),
        timeout=20,  # far below the long poll's wait
    )
    codes = {r.partition: r.error.code for r in response.partitions}
    assert codes == {0: common_pb2.NONE, 1: ErrorCode.OFFSET_OUT_OF_RANGE, 2: common_pb2.NONE}


def test_fetch_min_bytes_adds_up_across_leaders(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    # min_bytes counts the bytes of every leader together (Kafka's fetch.min.bytes, for a
    # fetch that spans brokers): data at two leaders that only together reach it answers at
    # once with both; more than there is waits max_wait_ms and answers with what there is.
    topic = "fetch-min-bytes"
    admin.create_topic(topic, partitions=3, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        for partition in (0, 2):
            producer.send_batch(topic, [b"v" * 1000] * 10, partition=partition).result(30)

    def fetch(min_bytes: int, wait_ms: int) -> list[bytes]:
        response = gateway.stub.Fetch(
            storage_pb2.FetchRequest(
                replica_id=-1,
                max_wait_ms=wait_ms,
                min_bytes=min_bytes,
                partitions=[
                    storage_pb2.FetchPartition(topic=topic, partition=p, fetch_offset=0)
                    for p in range(3)
                ],
            ),
            timeout=20,  # far below a 30 s wait
        )
        assert sorted(r.partition for r in response.partitions) == [0, 1, 2]
        return [
            r.value
            for result in response.partitions
            for batch in decode_batches(result.records)
            for r in batch.records
        ]

    assert len(fetch(min_bytes=15_000, wait_ms=30_000)) == 20
    assert len(fetch(min_bytes=10**6, wait_ms=300)) == 20


def test_fetch_min_bytes_zero_across_leaders_answers_every_partition(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Found by an audit: min_bytes 0 asks for an answer at once with whatever each
    partition has (Kafka's fetch.min.bytes=0), but across several leaders with a
    max_wait_ms the round ended on the first leader's answer (0 bytes were enough) and
    cancelled the others, which were answering at once too: their partitions came back
    "not answered" (no records, offsets -1) although they had records."""
    topic = "fetch-min-bytes-zero"
    admin.create_topic(topic, partitions=3, replication_factor=1)
    leaders = {p.partition: p.leader for p in admin.describe_topic(topic).partitions}
    assert len(set(leaders.values())) == 3
    with tidelog.Producer(gateway.address) as producer:
        for p in range(3):
            producer.send(topic, b"p%d" % p, partition=p).result(30)
    misses = []
    for attempt in range(5):
        response = gateway.stub.Fetch(
            storage_pb2.FetchRequest(
                replica_id=-1,
                max_wait_ms=2_000,
                min_bytes=0,
                partitions=[
                    storage_pb2.FetchPartition(topic=topic, partition=p, fetch_offset=0)
                    for p in range(3)
                ],
            ),
            timeout=10,
        )
        by_partition = {r.partition: r for r in response.partitions}
        for p in range(3):
            values = [r.value for b in decode_batches(by_partition[p].records) for r in b.records]
            if values != [b"p%d" % p]:
                misses.append((attempt, p, by_partition[p].high_watermark))
    assert not misses, f"partitions answered without their records (attempt, p, hw): {misses}"


def test_fetch_across_leaders_answers_at_once_when_one_partition_diverged(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Found by an audit (suspected, then shown): a long poll over several leaders waited
    out max_wait_ms for the quiet ones when a leader answered a divergence (KIP-320: the
    fetch's last fetched epoch ends before its offset there), which the gateway counted
    as an empty answer. The client must act on it (move its position back), so it is
    answered at once, as an error is and as Kafka's delayed fetch completes on either."""
    topic = "fetch-leader-divergence"
    admin.create_topic(topic, partitions=3, replication_factor=1)
    leaders = {p.partition: p.leader for p in admin.describe_topic(topic).partitions}
    assert len(set(leaders.values())) == 3
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [b"a", b"b", b"c"], partition=0).result(30)
    first = gateway.stub.Fetch(
        storage_pb2.FetchRequest(
            replica_id=-1,
            max_wait_ms=0,
            partitions=[storage_pb2.FetchPartition(topic=topic, partition=0, fetch_offset=0)],
        ),
        timeout=10,
    )
    (batch,) = decode_batches(first.partitions[0].records)
    # The batch's epoch ends at offset 3 on the leader: a fetch from 5 naming it diverged.
    diverged = storage_pb2.FetchPartition(
        topic=topic, partition=0, fetch_offset=5, last_fetched_epoch=batch.partition_leader_epoch
    )
    started = time.monotonic()
    response = gateway.stub.Fetch(
        storage_pb2.FetchRequest(
            replica_id=-1,
            max_wait_ms=10_000,
            partitions=[
                diverged,
                *(
                    storage_pb2.FetchPartition(topic=topic, partition=p, fetch_offset=0)
                    for p in (1, 2)
                ),
            ],
        ),
        timeout=20,
    )
    took = time.monotonic() - started
    by_partition = {r.partition: r for r in response.partitions}
    assert (by_partition[0].error.code, by_partition[0].diverging_end_offset) == (
        common_pb2.NONE,
        3,
    ), by_partition[0]
    assert took < 5, f"answered after {took:.1f}s"


@pytest.fixture(scope="module")
def small_gateway(cluster: TestCluster) -> GatewayProcess:
    """A gateway with --max-request-bytes and --max-fetch-bytes far below their defaults
    (1 MB and 100 kB): below a Subscribe's default max_bytes, and below a batch a topic
    may hold."""
    return cluster.start_gateway(["--max-request-bytes", "1000000", "--max-fetch-bytes", "100000"])


def _first_values(stream: Any) -> list[bytes]:
    """The values of a Subscribe's first answer; the stream is cancelled."""
    try:
        first = next(stream)
    except grpc.RpcError as exc:
        pytest.fail(f"Subscribe refused: {rpc_error_code(exc)} {exc.details()}")
    finally:
        stream.cancel()
    return [r.value for b in decode_batches(first.records) for r in b.records]


def test_subscribe_caps_max_bytes_at_the_gateways_limit_as_fetch_does(
    gateway: GatewayProcess, small_gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Found by an audit: Fetch caps a max_bytes above the gateway's --max-fetch-bytes (a
    client cannot know every gateway's setting), but Subscribe refused it, even the
    default 1 MiB a client did not set: on a gateway whose --max-fetch-bytes is under
    1 MiB every Subscribe without max_bytes failed INVALID_FETCH_SIZE. It is capped now;
    only a max_bytes that is not positive is refused."""
    topic = "subscribe-capped"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        producer.send(topic, b"hello", partition=0).result(30)
    for max_bytes in (None, 60 * 1024 * 1024, INT32_MAX):
        request = gateway_pb2.SubscribeRequest(topic=topic, partition=0, start_offset=0)
        if max_bytes is not None:
            request.max_bytes = max_bytes
        assert _first_values(small_gateway.stub.Subscribe(request, timeout=10)) == [b"hello"]
    for bad in (0, -1):
        stream = small_gateway.stub.Subscribe(
            gateway_pb2.SubscribeRequest(topic=topic, partition=0, start_offset=0, max_bytes=bad),
            timeout=10,
        )
        with pytest.raises(grpc.RpcError) as refused:
            next(stream)
        assert rpc_error_code(refused.value) == ErrorCode.INVALID_FETCH_SIZE
        assert f"max_bytes {bad} must be positive" in (refused.value.details() or "")


def test_a_batch_larger_than_the_gateways_limits_is_still_fetched(
    gateway: GatewayProcess, small_gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Found by an audit: a fetch answers the first batch whole even beyond max_bytes (as
    Kafka does, so a consumer always makes progress), but the gateway's gRPC send limit
    was sized from --max-request-bytes and --max-fetch-bytes (their larger + 4 MiB). A
    topic allowing 8 MiB batches holds a 6 MB one, written through a default gateway;
    through a gateway with those limits lowered, every Fetch and Subscribe of it failed
    RESOURCE_EXHAUSTED and a consumer could never read past it. The send limit has room
    for the largest batch a topic may hold now (the receive limit is unchanged)."""
    topic = "fetched-past-the-request-limit"
    admin.create_topic(
        topic, partitions=1, replication_factor=1, config={"max.message.bytes": str(8 << 20)}
    )
    with tidelog.Producer(gateway.address, batch_bytes=8 << 20) as producer:
        producer.send(topic, b"z" * 6_000_000, partition=0).result(60)
        producer.send(topic, b"after", partition=0).result(60)
    try:
        fetched = small_gateway.stub.Fetch(
            storage_pb2.FetchRequest(
                replica_id=-1,
                max_wait_ms=0,
                partitions=[storage_pb2.FetchPartition(topic=topic, partition=0, fetch_offset=0)],
            ),
            timeout=30,
        )
    except grpc.RpcError as exc:
        pytest.fail(f"fetch failed: {exc.code()} {rpc_error_code(exc)} {exc.details()}")
    values = [r.value for b in decode_batches(fetched.partitions[0].records) for r in b.records]
    assert [len(v) for v in values] == [6_000_000]
    stream = small_gateway.stub.Subscribe(
        gateway_pb2.SubscribeRequest(topic=topic, partition=0, start_offset=0), timeout=30
    )
    assert [len(v) for v in _first_values(stream)] == [6_000_000]
    # What an application sees: the SDK's consumer polling through that gateway.
    with tidelog.Consumer(small_gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.assign([(topic, 0)])
        got = poll_records(consumer, 2, timeout_s=30)
    assert [(offset, len(value)) for offset, value in got] == [(0, 6_000_000), (1, 5)]


def test_leader_calls_stop_cleanly() -> None:
    # The gateway's event loop for leader calls: a caller waiting on it when the gateway
    # stops gets BROKER_NOT_AVAILABLE (not a hang), and later callers get it at once.
    calls = LeaderCalls()

    async def answer() -> int:
        return 42

    assert calls.run(answer()) == 42
    outcome: dict[str, BaseException] = {}

    def wait_long() -> None:
        try:
            calls.run(asyncio.sleep(60))
        except BaseException as exc:
            outcome["error"] = exc

    waiter = threading.Thread(target=wait_long)
    waiter.start()
    time.sleep(0.2)
    calls.close()
    waiter.join(10)
    assert not waiter.is_alive()
    assert isinstance(outcome["error"], BrokerNotAvailableError)
    with pytest.raises(BrokerNotAvailableError):
        calls.run(answer())


def test_poll_arrow_and_poll_agree(gateway: GatewayProcess, admin: tidelog.Admin) -> None:
    admin.create_topic("arrow-out", partitions=2, replication_factor=2)
    with tidelog.Producer(gateway.address) as producer:
        for i in range(300):
            producer.send(
                "arrow-out",
                f"v{i}".encode(),
                key=None if i % 5 == 0 else f"k{i % 7}".encode(),
                headers=[("n", str(i).encode())] if i % 3 == 0 else None,
            )
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.subscribe(["arrow-out"])
        # Mixed on purpose: a partial record take, then Arrow for the rest.
        first = consumer.poll(max_records=7, timeout_ms=5_000)
        rows = [(r.topic, r.partition, r.offset, r.key, r.value, r.headers) for r in first]
        while len(rows) < 300:
            table = consumer.poll_arrow(max_records=50, timeout_ms=5_000)
            assert table.num_rows <= 50
            assert table.column_names[:3] == ["topic", "partition", "offset"]
            for r in table.to_pylist():
                headers = tuple((h["key"], h["value"]) for h in r["headers"])
                rows.append(
                    (r["topic"], r["partition"], r["offset"], r["key"], r["value"], headers)
                )
        assert consumer.poll_arrow(timeout_ms=200).num_rows == 0
    assert len({(r[1], r[2]) for r in rows}) == 300  # no record twice
    by_value = {r[4]: r for r in rows}
    for i in range(300):
        r = by_value[f"v{i}".encode()]
        assert r[3] == (None if i % 5 == 0 else f"k{i % 7}".encode())
        assert r[5] == ((("n", str(i).encode()),) if i % 3 == 0 else ())


def test_cancelled_subscriptions_free_their_places_under_max_concurrent_rpcs(
    cluster: TestCluster,
) -> None:
    # A subscription long-polls its leader for up to max_wait_ms; when its client goes
    # away, the gateway must stop waiting at once, or the abandoned calls keep counting
    # against --max-concurrent-rpcs and ordinary calls are refused meanwhile.
    limited = cluster.start_gateway(["--max-concurrent-rpcs", "4"])
    # Created through this gateway, so its metadata cache knows the topic at once.
    tidelog.Admin(limited.address).create_topic(
        "quiet-subscriptions", partitions=1, replication_factor=1
    )
    channel = grpc.insecure_channel(limited.address)
    subscribe = channel.unary_stream(
        "/tidelog.v1.Gateway/Subscribe",
        request_serializer=gateway_pb2.SubscribeRequest.SerializeToString,
        response_deserializer=storage_pb2.FetchPartitionResult.FromString,
    )
    request = gateway_pb2.SubscribeRequest(
        topic="quiet-subscriptions",
        partition=0,
        start_spec=common_pb2.LATEST,
        max_wait_ms=30_000,
    )
    calls: list[Any] = []

    def saturated() -> bool:
        # A probe admitted while the subscriptions connect may take the 4th place and get
        # one of them refused: replace any that ended until all 4 wait and a probe is not
        # admitted.
        calls[:] = [call for call in calls if call.is_active()]
        while len(calls) < 4:
            calls.append(subscribe(request, timeout=120))
        time.sleep(0.2)
        if not all(call.is_active() for call in calls):
            return False
        try:
            limited.stub.ListGroups(gateway_pb2.ListGroupsRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        return False

    try:
        wait_for(saturated, 30, "4 subscriptions waiting and a fifth call refused")
    finally:
        for call in calls:
            call.cancel()
    # Well before the 30 s the leaders would otherwise have held the subscriptions.
    wait_for(
        lambda: limited.stub.ListGroups(gateway_pb2.ListGroupsRequest(), timeout=5),
        20,
        "calls admitted again after the subscriptions were cancelled",
    )
    channel.close()


def _leaders(admin: tidelog.Admin, topic: str) -> dict[tuple[str, int], int]:
    return {(topic, p.partition): p.leader for p in admin.describe_topic(topic).partitions}


def _groups_in_flight(consumer: tidelog.Consumer) -> list[set[tuple[str, int]]]:
    return [set(fetch.offsets) for fetch in consumer._fetches.values()]


def test_consumer_keeps_one_fetch_in_flight_per_leader(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Each leader's partitions are fetched by a long poll of their own, so one leader's
    data never waits for a round with another (Kafka's fetcher); every record is read
    once, in order per partition."""
    admin.create_topic("per-leader", partitions=6, replication_factor=1)
    leaders = _leaders(admin, "per-leader")
    assert len(set(leaders.values())) == 3, leaders  # spread over the three brokers
    with tidelog.Producer(gateway.address) as producer:
        for p in range(6):
            producer.send_batch(
                "per-leader", [f"{p}-{i}".encode() for i in range(20)], partition=p
            ).result(30)
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.subscribe(["per-leader"])
        seen: dict[int, list[int]] = {p: [] for p in range(6)}
        deadline = time.monotonic() + 30
        while sum(map(len, seen.values())) < 120 and time.monotonic() < deadline:
            for record in consumer.poll(max_records=7, timeout_ms=500):
                seen[record.partition].append(record.offset)
        assert seen == {p: list(range(20)) for p in range(6)}
        consumer.poll(timeout_ms=0)  # at the log end: every group long-polls
        groups = _groups_in_flight(consumer)
        assert len(groups) == 3, groups
        for group in groups:
            assert len({leaders[tp] for tp in group}) == 1, (group, leaders)
        assert set().union(*groups) == set(leaders)


def test_consumer_seek_during_fetches_reads_from_the_new_offset(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A seek drops what was fetched for the partition (buffered or in flight): the next
    records come from the new offset, and the other partitions lose and repeat nothing."""
    admin.create_topic("seek-inflight", partitions=3, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        for p in range(3):
            for i in range(5):  # several batches per partition
                producer.send_batch(
                    "seek-inflight",
                    [f"{p}-{i * 10 + j}".encode() for j in range(10)],
                    partition=p,
                ).result(30)
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.subscribe(["seek-inflight"])
        first = []
        while not first:
            first = consumer.poll(max_records=3, timeout_ms=1000)
        seen: dict[int, list[int]] = {p: [] for p in range(3)}
        for record in first:
            seen[record.partition].append(record.offset)
        # Data for every partition is buffered or on its way; move partition 0 back.
        consumer.seek(("seek-inflight", 0), 7)
        seen[0] = []
        deadline = time.monotonic() + 30
        while sum(map(len, seen.values())) < 43 + 100 and time.monotonic() < deadline:
            for record in consumer.poll(max_records=4, timeout_ms=500):
                seen[record.partition].append(record.offset)
        assert seen[0] == list(range(7, 50))
        assert seen[1] == list(range(50))
        assert seen[2] == list(range(50))


def test_consumer_buffers_at_most_about_fetch_max_bytes(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Fetching ahead stops once ``fetch_max_bytes`` are buffered: a consumer whose
    application is slow does not pull the whole log into memory."""
    admin.create_topic("slow-reader", partitions=3, replication_factor=1)
    values = [b"v" * 1000] * 100  # ~100 kB batches
    with tidelog.Producer(gateway.address) as producer:
        for _ in range(20):
            for p in range(3):
                producer.send_batch("slow-reader", values, partition=p).result(30)
    limit = 150_000
    with tidelog.Consumer(
        gateway.address,
        auto_offset_reset="earliest",
        fetch_max_bytes=limit,
        max_partition_fetch_bytes=limit,
    ) as consumer:
        consumer.subscribe(["slow-reader"])
        read = 0
        peak = 0
        deadline = time.monotonic() + 60
        while read < 1_500 and time.monotonic() < deadline:
            read += len(consumer.poll(max_records=50, timeout_ms=500))
            peak = max(peak, consumer._buffered_bytes)
            time.sleep(0.02)  # the application's own work
        assert read == 1_500
        # At most the limit plus what the three leaders' fetches in flight then bring
        # (each at most about one fetch's worth: the limit or a single batch above it);
        # the topic holds ~6 MB.
        assert 0 < peak <= 4 * limit, peak


def test_consumer_regroups_after_a_leader_dies(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """kill -9 the leader of partitions a consumer is long-polling: the consumer notices
    the leader change in its fetch answers, regroups by the new leaders, and reads every
    acknowledged record exactly once."""
    admin.create_topic(
        "consumer-failover", partitions=3, replication_factor=3, config={"min.insync.replicas": "2"}
    )
    with tidelog.Consumer(gateway.address, auto_offset_reset="earliest") as consumer:
        consumer.subscribe(["consumer-failover"])
        consumer.poll(timeout_ms=200)  # fetches in flight at the (empty) log end
        victim = _leaders(admin, "consumer-failover")[("consumer-failover", 0)]
        cluster.kill(cluster.brokers[victim])
        acked: dict[tuple[int, int], bytes] = {}
        with tidelog.Producer(gateway.address, linger_ms=1, delivery_timeout_ms=60_000) as producer:
            sent = [(p, f"{p}-{i}".encode()) for i in range(50) for p in range(3)]
            futures = [producer.send("consumer-failover", v, partition=p) for p, v in sent]
            for (p, value), future in zip(sent, futures, strict=True):
                offset = future.result(60).offset
                assert (p, offset) not in acked  # two acknowledged there: one is lost
                acked[(p, offset)] = value
        got: list[tuple[int, int, bytes | None]] = []
        deadline = time.monotonic() + 60
        while len(got) < len(acked) and time.monotonic() < deadline:
            got.extend((r.partition, r.offset, r.value) for r in consumer.poll(timeout_ms=500))
        assert sorted(got) == sorted((p, o, v) for (p, o), v in acked.items())
        for p in range(3):
            offsets = [o for q, o, _ in got if q == p]
            assert offsets == sorted(offsets)
        consumer.poll(timeout_ms=0)
        leaders = _leaders(admin, "consumer-failover")
        assert victim not in leaders.values()
        # The victim's group is gone: its partition joined its new leader's group.
        assert victim % MAX_FETCHES_IN_FLIGHT not in consumer._fetches
        groups = _groups_in_flight(consumer)
        assert len(groups) == len(set(leaders.values())), (groups, leaders)
        for group in groups:
            assert len({leaders[tp] for tp in group}) == 1, (group, leaders)
    cluster.start_broker(victim)
    wait_for(
        lambda: all(len(p.isr) == 3 for p in admin.describe_topic("consumer-failover").partitions),
        60,
        "the restarted broker to rejoin every ISR",
    )


def test_a_metadata_request_naming_too_many_topics_is_refused(gateway: GatewayProcess) -> None:
    """Every name gets an entry in the answer, unknown ones too: 200,000 names made a 7 MB
    answer (the CLI audit). Repeats count once."""
    with grpc.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Metadata(
                controller_pb2.MetadataRequest(topics=[f"t{i}" for i in range(10_001)]), timeout=30
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the limit is 10000" in (refused.value.details() or "")
        answer = stub.Metadata(controller_pb2.MetadataRequest(topics=["same"] * 20_000), timeout=30)
        assert [t.name for t in answer.topics] == ["same"]


def test_consume_to_the_end_fails_in_one_line_when_its_gateway_dies(
    cluster: TestCluster,
) -> None:
    """`consume` without --follow stops at the end offsets; its gateway killed mid-read,
    it waited silently for ever (the consumer retries a dead gateway, as Kafka's does).
    With no record for --timeout-ms (30 s by default) short of the end, it now fails in
    one line, status 1 (found by an audit)."""
    own = cluster.start_gateway()
    tidelog.Admin(own.address).create_topic("dying-gateway", partitions=1)
    with tidelog.Producer(own.address) as producer:  # 8 MB: more than consume buffers
        producer.send_batch("dying-gateway", [b"%d" % i + b"x" * 1000 for i in range(8_000)])
    consume = subprocess.Popen(
        [sys.executable, "-m", "tidelog", "consume", "dying-gateway", "--from-beginning",
         "--timeout-ms", "2000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT,
        env={**tidelog_env(), "TIDELOG_GATEWAY": own.address},
    )  # fmt: skip
    try:
        assert consume.stdout is not None
        consume.stdout.read(100_000)  # it is reading; unread, the pipe holds it back now
        cluster.kill(own)
        _, err = consume.communicate(timeout=60)
        assert consume.returncode == 1
        (line,) = err.decode().strip().splitlines()
        assert "no record for 2000 ms before the end of dying-gateway" in line, line
    finally:
        if consume.poll() is None:
            consume.kill()
            consume.wait()


def _timed_fetch(
    gateway: GatewayProcess,
    topic: str,
    partitions: list[int],
    min_bytes: int,
    wait_ms: int,
    *,
    partition_max_bytes: int | None = None,
) -> tuple[float, int]:
    """(seconds the gateway took, record bytes) of one raw Fetch from offset 0."""
    started = time.monotonic()
    response = gateway.stub.Fetch(
        storage_pb2.FetchRequest(
            replica_id=-1,
            max_wait_ms=wait_ms,
            min_bytes=min_bytes,
            partitions=[
                storage_pb2.FetchPartition(topic=topic, partition=p, fetch_offset=0)
                if partition_max_bytes is None
                else storage_pb2.FetchPartition(
                    topic=topic, partition=p, fetch_offset=0, max_bytes=partition_max_bytes
                )
                for p in partitions
            ],
        ),
        timeout=20,
    )
    return time.monotonic() - started, sum(len(r.records) for r in response.partitions)


def _two_leader_topic(admin: tidelog.Admin, topic: str) -> None:
    admin.create_topic(topic, partitions=2, replication_factor=1)
    leaders = {p.partition: p.leader for p in admin.describe_topic(topic).partitions}
    assert len(set(leaders.values())) == 2, leaders


def test_min_bytes_over_several_leaders_waits_as_over_one(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """min_bytes is for the whole answer (Kafka's fetch.min.bytes). Over one leader the
    leader waits for it; over several, each leader that had a little answered at once
    and the round ended: a fetch across leaders ignored min_bytes. Each is asked again
    now for what is still missing, until max_wait_ms. Found by an audit."""
    topic = "min-bytes-two-leaders"
    _two_leader_topic(admin, topic)
    with tidelog.Producer(gateway.address) as producer:
        for partition in (0, 1):
            producer.send(topic, b"v" * 100, partition=partition).result(30)
    took_s, got = _timed_fetch(gateway, topic, [0, 1], min_bytes=1_000_000, wait_ms=2_000)
    assert got > 0
    assert took_s >= 1.8, f"answered after {took_s:.3f} s with {got} bytes < min_bytes"


def test_min_bytes_across_leaders_whose_reads_max_bytes_cut_short_answers_at_once(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A leader answers a read its partition max_bytes cut short at once (waiting cannot
    add to it; Kafka's rule too). Over several leaders the gateway took that answer for
    "short of min_bytes" and asked the same leader again at once, for the whole
    max_wait_ms: thousands of leader calls a second, and an answer only at the end of
    the wait. A leader that answered short of what it was asked is not asked again now
    (found by an audit)."""
    topic = "min-bytes-cut-short"
    _two_leader_topic(admin, topic)
    with tidelog.Producer(gateway.address) as producer:
        for partition in (0, 1):
            for _ in range(10):  # ten batches of about 1 KB each
                producer.send_batch(topic, [b"v" * 1000], partition=partition).result(30)
    one_s, one_bytes = _timed_fetch(gateway, topic, [0], 1_000_000, 3_000, partition_max_bytes=1500)
    took_s, got = _timed_fetch(gateway, topic, [0, 1], 1_000_000, 3_000, partition_max_bytes=1500)
    assert one_bytes > 0 and got > one_bytes
    # A whole max_wait_ms (3 s) was the old answer; over one leader it is at once.
    assert took_s < 2.0 and one_s < 2.0, (took_s, one_s)


def test_min_bytes_reached_later_at_a_leader_that_answered_early_is_answered_then(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A leader that answered a little early was never asked again: records reaching it
    afterwards were not seen, and the fetch waited out max_wait_ms though min_bytes was
    there. It is asked again for what is missing, so the fetch answers when the records
    come (found by an audit)."""
    topic = "min-bytes-later"
    _two_leader_topic(admin, topic)
    with tidelog.Producer(gateway.address) as producer:
        producer.send(topic, b"v" * 100, partition=0).result(30)

    def produce_later() -> None:
        time.sleep(0.5)
        with tidelog.Producer(gateway.address) as producer:
            producer.send_batch(topic, [b"w" * 1000] * 20, partition=0).result(30)

    writer = threading.Thread(target=produce_later)
    writer.start()
    took_s, got = _timed_fetch(gateway, topic, [0, 1], min_bytes=5_000, wait_ms=8_000)
    writer.join()
    assert got >= 5_000 and took_s < 4, f"answered after {took_s:.3f} s with {got} bytes"


def test_fetches_their_clients_cancelled_do_not_keep_the_leaders_long_polls(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A gateway Fetch's leader call was never tied to its own call: a client cancelling
    (a consumer's seek, new assignment or close) left the leader's long poll running for
    the whole max_wait_ms, holding one of the leader's places for waiting fetches (24 for
    consumers). With them taken by abandoned polls, other consumers of that leader were
    answered at once with a throttle. The calls are cancelled with their client's now
    (found by an audit)."""
    topic = "fetches-cancelled"
    admin.create_topic(topic, partitions=1, replication_factor=1)

    def request(wait_ms: int) -> storage_pb2.FetchRequest:
        return storage_pb2.FetchRequest(
            replica_id=-1,
            max_wait_ms=wait_ms,
            partitions=[storage_pb2.FetchPartition(topic=topic, partition=0, fetch_offset=0)],
        )

    channel = grpc.insecure_channel(gateway.address)
    try:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        abandoned = [stub.Fetch.future(request(20_000), timeout=30) for _ in range(30)]
        time.sleep(1.5)
        for future in abandoned:
            future.cancel()
        time.sleep(1.0)
        started = time.monotonic()
        answer = gateway.stub.Fetch(request(2_000), timeout=10)
    finally:
        channel.close()
    assert answer.throttle_time_ms == 0 and time.monotonic() - started >= 1.5


def test_a_fetch_answers_within_the_clients_deadline_when_its_leader_is_silent(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A leader call of a Fetch got the long poll's wait plus 5 s, whatever the client's
    deadline: a stopped leader gave the client a bare DEADLINE_EXCEEDED and held the
    gateway's thread and budget 5 s past it. It ends by the client's deadline now, a
    REQUEST_TIMED_OUT per partition, as Produce and ListOffsets (found by an audit)."""
    with _silent_leader(cluster, admin, "fetch-silent"):
        answer = gateway.stub.Fetch(
            storage_pb2.FetchRequest(
                replica_id=-1,
                max_wait_ms=100,
                partitions=[
                    storage_pb2.FetchPartition(topic="fetch-silent", partition=0, fetch_offset=0)
                ],
            ),
            timeout=2.0,
        )
    assert [ErrorCode(p.error.code) for p in answer.partitions] == [ErrorCode.REQUEST_TIMED_OUT]
