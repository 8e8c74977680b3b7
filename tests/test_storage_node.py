"""A real ``tidelog storage`` process over real gRPC on loopback: data path, errors, crashes.

Partitions are created the way the controller will create them: with LeaderAndIsr naming
this broker (id 1) leader. Most tests share one node (``storage_node``) and use their own
topics; restart and crash tests start their own processes on their own data directories.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.status import (
    STATUS_FOR_CODE,
    error_from_proto,
    error_from_rpc_error,
    to_error_proto,
)
from services.storage.node import EXIT_DISK_FAILURE
from tests.support.cluster import rpc_error_code, wait_for
from tests.support.page_cache import on_tmpfs, resident_pages
from tests.support.process import REPO_ROOT, StartStorage, StorageProcess, tidelog_env
from tidelog import formats
from tidelog.errors import (
    ErrorCode,
    NetworkError,
    RequestTimedOutError,
    TidelogError,
    UnknownServerError,
    error_for_code,
)
from tidelog.records import Record, decode_batches, encode_batch
from tidelog.topics import parse_partition_dir_name, partition_dir_name, validate_topic_name
from tidelog.v1 import common_pb2, storage_pb2, storage_pb2_grpc

BROKER_ID = 1
RPC_TIMEOUT_S = 10.0

# --- helpers ----------------------------------------------------------------------------


def make_leader(
    stub: storage_pb2_grpc.StorageStub,
    topic: str,
    partition: int = 0,
    *,
    epoch: int = 0,
    configs: dict[str, str] | None = None,
) -> storage_pb2.LeaderAndIsrResponse:
    """LeaderAndIsr making broker 1 the single-replica leader; asserts it succeeded."""
    response = leader_and_isr(stub, topic, partition, epoch=epoch, configs=configs)
    assert code(response.error) == ErrorCode.NONE, response
    assert [code(r.error) for r in response.partitions] == [ErrorCode.NONE], response
    return response


def leader_and_isr(
    stub: storage_pb2_grpc.StorageStub,
    topic: str,
    partition: int = 0,
    *,
    epoch: int = 0,
    configs: dict[str, str] | None = None,
) -> storage_pb2.LeaderAndIsrResponse:
    state = common_pb2.PartitionState(
        topic=topic,
        partition=partition,
        leader=BROKER_ID,
        leader_epoch=epoch,
        isr=[BROKER_ID],
        replicas=[BROKER_ID],
        partition_epoch=epoch,
    )
    entries = [common_pb2.ConfigEntry(name=k, value=v) for k, v in (configs or {}).items()]
    request = storage_pb2.LeaderAndIsrRequest(
        controller_id=0,
        controller_epoch=1,
        partitions=[storage_pb2.LeaderAndIsrPartition(state=state, configs=entries, is_new=True)],
    )
    response: storage_pb2.LeaderAndIsrResponse = stub.LeaderAndIsr(request, timeout=RPC_TIMEOUT_S)
    return response


def append(
    stub: storage_pb2_grpc.StorageStub, topic: str, records: bytes, partition: int = 0, **kw: Any
) -> storage_pb2.AppendResponse:
    kw.setdefault("acks", common_pb2.ALL)
    request = storage_pb2.AppendRequest(topic=topic, partition=partition, records=records, **kw)
    response: storage_pb2.AppendResponse = stub.Append(request, timeout=RPC_TIMEOUT_S)
    return response


def fetch_one(
    stub: storage_pb2_grpc.StorageStub,
    topic: str,
    offset: int,
    partition: int = 0,
    *,
    max_wait_ms: int = 0,
    **kw: Any,
) -> storage_pb2.FetchPartitionResult:
    request = storage_pb2.FetchRequest(
        replica_id=-1,
        max_wait_ms=max_wait_ms,
        partitions=[
            storage_pb2.FetchPartition(topic=topic, partition=partition, fetch_offset=offset)
        ],
        **kw,
    )
    response: storage_pb2.FetchResponse = stub.Fetch(
        request, timeout=RPC_TIMEOUT_S + max_wait_ms / 1000
    )
    assert len(response.partitions) == 1
    return response.partitions[0]


def read_all_raw(stub: storage_pb2_grpc.StorageStub, topic: str, partition: int = 0) -> bytes:
    """Every batch of the partition, as stored, by fetching until the high watermark."""
    chunks: list[bytes] = []
    offset = 0
    while True:
        result = fetch_one(stub, topic, offset, partition)
        assert code(result.error) == ErrorCode.NONE, result.error
        if not result.records:
            assert offset == result.high_watermark
            return b"".join(chunks)
        chunks.append(result.records)
        offset = decode_batches(result.records)[-1].next_offset


def read_all(stub: storage_pb2_grpc.StorageStub, topic: str, partition: int = 0) -> list[Record]:
    return [r for b in decode_batches(read_all_raw(stub, topic, partition)) for r in b.records]


def list_offset(
    stub: storage_pb2_grpc.StorageStub,
    topic: str,
    spec: common_pb2.OffsetSpec,
    timestamp_ms: int = 0,
) -> storage_pb2.ListOffsetsResult:
    request = storage_pb2.ListOffsetsRequest(
        replica_id=-1,
        partitions=[
            storage_pb2.ListOffsetsPartition(
                topic=topic,
                partition=0,
                spec=spec,
                timestamp_ms=timestamp_ms,
                current_leader_epoch=-1,
            )
        ],
    )
    (result,) = stub.ListOffsets(request, timeout=RPC_TIMEOUT_S).partitions
    assert isinstance(result, storage_pb2.ListOffsetsResult)
    return result


def log_description(
    stub: storage_pb2_grpc.StorageStub, topic: str, partition: int = 0
) -> storage_pb2.LogDescription | None:
    response = stub.DescribeLogDirs(
        storage_pb2.DescribeLogDirsRequest(
            partitions=[common_pb2.TopicPartition(topic=topic, partition=partition)]
        ),
        timeout=RPC_TIMEOUT_S,
    )
    (log_dir,) = response.log_dirs
    found = [d for d in log_dir.partitions if (d.topic, d.partition) == (topic, partition)]
    return found[0] if found else None


def expect_rpc_error(
    call: Callable[[], object], status: grpc.StatusCode, code: ErrorCode
) -> grpc.RpcError:
    """Run ``call``; assert it fails with ``status`` and ``tidelog-error-code: code``."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    assert error.code() == status, (error.code(), error.details())
    metadata: dict[str, object] = {item.key: item.value for item in error.trailing_metadata() or ()}
    assert metadata.get("tidelog-error-code") == code.name, metadata
    assert error.details(), "a failed call must say why"
    # The client side of the same table turns it back into the right exception.
    converted = error_from_rpc_error(error)
    assert converted.code == code
    assert converted.message == error.details()
    return error


def code(error: common_pb2.Error) -> ErrorCode:
    """The tidelog code of a per-partition error (the protobuf enum as ErrorCode)."""
    return ErrorCode(int(error.code))


def values_of(records: list[Record]) -> list[bytes | None]:
    return [r.value for r in records]


# --- data path --------------------------------------------------------------------------


def test_append_fetch_round_trip(storage_node: StorageProcess) -> None:
    stub = storage_node.stub
    make_leader(stub, "round-trip")
    sent = [[b"a", b"b", b"c"], [b"d"], [b"e" * 10_000, b"f"]]
    next_offset = 0
    for values in sent:
        response = append(stub, "round-trip", encode_batch(values, keys=[b"k"] * len(values)))
        assert code(response.error) == ErrorCode.NONE
        assert (response.base_offset, response.last_offset) == (
            next_offset,
            next_offset + len(values) - 1,
        )
        next_offset += len(values)
        assert response.high_watermark == next_offset  # single replica: HW = LEO
        assert response.log_append_time_ms == -1  # CreateTime: Kafka answers -1

    records = read_all(stub, "round-trip")
    assert [r.offset for r in records] == list(range(next_offset))
    assert values_of(records) == [v for values in sent for v in values]
    assert {r.key for r in records} == {b"k"}

    # A fetch from the middle of a batch returns the whole batch it lies in.
    middle = fetch_one(stub, "round-trip", 1)
    assert decode_batches(middle.records)[0].base_offset == 0
    assert (middle.high_watermark, middle.log_end_offset, middle.log_start_offset) == (6, 6, 0)

    # acks=0 still appends, but answers without offsets.
    no_acks = append(stub, "round-trip", encode_batch([b"g"]), acks=common_pb2.NONE_ACKS)
    assert (no_acks.base_offset, no_acks.last_offset) == (-1, -1)
    assert values_of(read_all(stub, "round-trip"))[-1] == b"g"


def test_append_stream_reports_errors_per_message_and_continues(
    storage_node: StorageProcess,
) -> None:
    stub = storage_node.stub
    make_leader(stub, "stream")
    bad = bytearray(encode_batch([b"bad"]))
    bad[-1] ^= 0xFF
    requests = [
        storage_pb2.AppendRequest(
            topic="stream",
            partition=0,
            records=encode_batch([b"1"]),
            correlation_id=1,
            current_leader_epoch=-1,
        ),
        storage_pb2.AppendRequest(
            topic="stream", partition=0, records=bytes(bad), correlation_id=2
        ),
        storage_pb2.AppendRequest(
            topic="stream", partition=9, records=encode_batch([b"x"]), correlation_id=3
        ),
        storage_pb2.AppendRequest(
            topic="stream", partition=0, records=encode_batch([b"2", b"3"]), correlation_id=4
        ),
    ]
    responses = list(stub.AppendStream(iter(requests), timeout=RPC_TIMEOUT_S))
    assert [r.correlation_id for r in responses] == [1, 2, 3, 4]
    assert [code(r.error) for r in responses] == [
        ErrorCode.NONE,
        ErrorCode.CORRUPT_BATCH,
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
        ErrorCode.NONE,
    ]
    assert (responses[3].base_offset, responses[3].last_offset) == (1, 2)
    assert values_of(read_all(stub, "stream")) == [b"1", b"2", b"3"]


def _lead_with_follower_2(
    stub: storage_pb2_grpc.StorageStub,
    topic: str,
    configs: dict[str, str] | None = None,
    epoch: int = 0,
) -> None:
    """Make this broker leader of ``topic``-0 with broker 2 (the test) in the ISR."""
    state = common_pb2.PartitionState(
        topic=topic,
        partition=0,
        leader=BROKER_ID,
        leader_epoch=epoch,
        isr=[BROKER_ID, 2],
        replicas=[BROKER_ID, 2],
        partition_epoch=epoch,
    )
    response = stub.LeaderAndIsr(
        storage_pb2.LeaderAndIsrRequest(
            controller_id=0,
            controller_epoch=1,
            partitions=[
                storage_pb2.LeaderAndIsrPartition(
                    state=state,
                    is_new=True,
                    configs=[
                        common_pb2.ConfigEntry(name=k, value=v) for k, v in (configs or {}).items()
                    ],
                )
            ],
        ),
        timeout=RPC_TIMEOUT_S,
    )
    assert [code(r.error) for r in response.partitions] == [ErrorCode.NONE]


def fetch_as_follower_2(
    stub: storage_pb2_grpc.StorageStub, topic: str, offset: int, max_bytes: int = 1 << 20
) -> storage_pb2.FetchPartitionResult:
    """A fetch in the name of broker 2 (the test plays the follower), answered at once."""
    request = storage_pb2.FetchRequest(
        replica_id=2,
        max_wait_ms=0,
        max_bytes=max_bytes,
        partitions=[
            storage_pb2.FetchPartition(
                topic=topic, partition=0, fetch_offset=offset, max_bytes=max_bytes
            )
        ],
    )
    answer: storage_pb2.FetchResponse = stub.Fetch(request, timeout=RPC_TIMEOUT_S)
    return answer.partitions[0]


def session_fetch(
    stub: storage_pb2_grpc.StorageStub,
    session_id: int,
    epoch: int,
    named: dict[str, int],
    *,
    forgotten: tuple[str, ...] = (),
    max_wait_ms: int = 0,
    min_bytes: int = 1,
    max_bytes: int = 1 << 20,
) -> storage_pb2.FetchResponse:
    """A fetch of broker 2's session (KIP-227) naming ``named`` (topic -> offset)."""
    request = storage_pb2.FetchRequest(
        replica_id=2,
        max_wait_ms=max_wait_ms,
        min_bytes=min_bytes,
        max_bytes=max_bytes,
        session_id=session_id,
        session_epoch=epoch,
        partitions=[
            storage_pb2.FetchPartition(topic=topic, partition=0, fetch_offset=offset)
            for topic, offset in named.items()
        ],
        forgotten=[common_pb2.TopicPartition(topic=topic, partition=0) for topic in forgotten],
    )
    answer: storage_pb2.FetchResponse = stub.Fetch(
        request, timeout=RPC_TIMEOUT_S + max_wait_ms / 1000
    )
    return answer


def answered(response: storage_pb2.FetchResponse) -> dict[str, tuple[int, list[bytes | None]]]:
    """topic -> (high watermark, values) of each partition a fetch answered."""
    return {
        r.topic: (r.high_watermark, [x.value for b in decode_batches(r.records) for x in b.records])
        for r in response.partitions
    }


def test_a_fetch_session_names_and_answers_only_partitions_that_changed(
    storage_node: StorageProcess,
) -> None:
    """KIP-227: after the full fetch that opens a session, the follower names only the
    partitions whose position moved, and the leader answers only those with something
    new (records, a moved HW); a partition forgotten is no longer answered. An idle
    follower of thousands of partitions named and was answered every one, twice a
    second, in both directions (BENCHMARKS.md, scale)."""
    stub = storage_node.stub
    topics = ["sess-a", "sess-b", "sess-c"]
    for topic in topics:
        _lead_with_follower_2(stub, topic)
        assert code(append(stub, topic, encode_batch([topic.encode()]), acks=1).error) == 0

    opened = session_fetch(stub, 0, 0, dict.fromkeys(topics, 0))
    assert opened.session_id > 0
    assert answered(opened) == {t: (0, [t.encode()]) for t in topics}
    sid = opened.session_id

    # Broker 2 has them all now: its next fetch moves every HW, which it is told.
    moved = session_fetch(stub, sid, 1, dict.fromkeys(topics, 1))
    assert answered(moved) == {t: (1, []) for t in topics}
    # Nothing new: nothing named, nothing answered (after the long poll).
    assert answered(session_fetch(stub, sid, 2, {}, max_wait_ms=100)) == {}

    # New data wakes the long poll, for that partition only.
    waiting = threading.Thread(
        target=lambda: (
            time.sleep(0.2),
            append(stub, "sess-b", encode_batch([b"b2"]), acks=1),
        )
    )
    waiting.start()
    assert answered(session_fetch(stub, sid, 3, {}, max_wait_ms=10_000)) == {"sess-b": (1, [b"b2"])}
    waiting.join()

    # Forgotten: no longer answered, though it has news.
    left = session_fetch(stub, sid, 4, {"sess-b": 2}, forgotten=("sess-c",))
    assert answered(left) == {"sess-b": (2, [])}
    assert code(append(stub, "sess-c", encode_batch([b"c2"]), acks=1).error) == 0
    assert answered(session_fetch(stub, sid, 5, {}, max_wait_ms=100)) == {}

    # Out of sequence (an answer the follower never got): refused, and the session is
    # gone, so the follower fetches in full again.
    with pytest.raises(grpc.RpcError) as refused:
        session_fetch(stub, sid, 5, {})
    assert rpc_error_code(refused.value) == ErrorCode.INVALID_FETCH_SESSION_EPOCH
    with pytest.raises(grpc.RpcError) as gone:
        session_fetch(stub, sid, 6, {})
    assert rpc_error_code(gone.value) == ErrorCode.FETCH_SESSION_ID_NOT_FOUND
    reopened = session_fetch(stub, 0, 0, {"sess-a": 1, "sess-c": 1})
    assert reopened.session_id not in (0, sid)
    assert answered(reopened) == {"sess-a": (1, []), "sess-c": (1, [b"c2"])}


def with_data(response: storage_pb2.FetchResponse) -> dict[str, int]:
    """topic -> the offset after the records of each partition a fetch brought data of."""
    return {
        r.topic: decode_batches(r.records)[-1].next_offset for r in response.partitions if r.records
    }


def test_a_session_reads_again_a_partition_whose_data_the_response_budget_left_out(
    storage_node: StorageProcess,
) -> None:
    """Once a session fetch's max_bytes is used up, the next partitions are read with no
    room (their data left for the next fetch). The leader drained their change notes all
    the same and answered nothing new for them, and their follower, whose position did
    not move, never named them again: the leader read them again only on a new append
    there, so a follower catching up on a backlog never got its end (and never rejoined
    the ISR) if nothing more was written. Kafka reads every session partition each time;
    here the leader notes what it left out and reads it on the next fetch."""
    stub = storage_node.stub
    topics = ["sess-budget-a", "sess-budget-b"]
    for topic in topics:
        _lead_with_follower_2(stub, topic)
        assert code(append(stub, topic, encode_batch([b"x" * 3000]), acks=1).error) == 0

    # A 4000-byte response budget: one 3000-byte batch fits, the other is left out.
    opened = session_fetch(stub, 0, 0, dict.fromkeys(topics, 0), max_bytes=4000)
    first = with_data(opened)
    assert list(first.values()) == [1], "exactly one partition fits the budget"
    (left_out,) = set(topics) - set(first)

    # The follower names only the partition it got; nothing new was appended anywhere.
    then = session_fetch(stub, opened.session_id, 1, first, max_bytes=4000)
    assert with_data(then) == {left_out: 1}


def test_a_session_shares_a_small_response_budget_among_backlogged_partitions_in_turn(
    storage_node: StorageProcess,
) -> None:
    """Partitions are read in turns, the last to bring data read last (Kafka rotates a
    session's partitions likewise): in a fixed read order the first backlogged
    partitions would take a full budget every time and the others wait for them all."""
    stub = storage_node.stub
    topics = ["sess-turns-a", "sess-turns-b", "sess-turns-c"]
    for topic in topics:
        _lead_with_follower_2(stub, topic)
        for _ in range(3):
            assert code(append(stub, topic, encode_batch([b"x" * 3000]), acks=1).error) == 0

    # Room for one 3000-byte batch per answer: nine answers, one partition each.
    answer = session_fetch(stub, 0, 0, dict.fromkeys(topics, 0), max_bytes=4000)
    sid = answer.session_id
    served: list[str] = []
    for epoch in range(1, 10):
        got = with_data(answer)
        assert len(got) == 1, got
        served += got
        answer = session_fetch(stub, sid, epoch, got, max_bytes=4000)
    assert with_data(answer) == {}
    rounds = [sorted(served[i : i + 3]) for i in range(0, 9, 3)]
    assert rounds == [topics] * 3, f"served in the order {served}"


def test_a_waiting_session_fetch_counts_a_partition_read_again_only_once(
    storage_node: StorageProcess,
) -> None:
    """A long poll reads a partition again when it changes; its previous read was still
    counted against the response's byte budget next to the new one, so the new read got
    less room than there was, brought less than min_bytes, and the fetch waited out
    max_wait_ms with data there to answer."""
    stub = storage_node.stub
    topic = "sess-reread"
    _lead_with_follower_2(stub, topic)
    sid = session_fetch(stub, 0, 0, {topic: 0}).session_id
    first, second = encode_batch([b"a" * 500]), encode_batch([b"b" * 500])
    both = len(first) + len(second)
    outcome: dict[str, Any] = {}

    def poll() -> None:
        outcome["response"] = session_fetch(
            stub, sid, 1, {}, max_wait_ms=8000, min_bytes=both, max_bytes=both + 100
        )
        outcome["answered_at"] = time.monotonic()

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.5)
    assert code(append(stub, topic, first, acks=1).error) == 0
    time.sleep(0.5)
    assert poller.is_alive(), "one batch is below min_bytes: the fetch keeps waiting"
    assert code(append(stub, topic, second, acks=1).error) == 0
    appended_at = time.monotonic()
    poller.join(15)
    assert not poller.is_alive()
    assert answered(outcome["response"]) == {topic: (0, [b"a" * 500, b"b" * 500])}
    assert outcome["answered_at"] - appended_at < 3.0


def test_a_diverging_follower_fetch_is_answered_without_waiting(
    storage_node: StorageProcess,
) -> None:
    """A fetch whose answer is a divergence (KIP-320) carries no records, and was held
    for the whole long poll as if it had nothing to say; the follower, which must
    truncate before it can fetch anything, lost max_wait_ms. Kafka answers it at once."""
    stub = storage_node.stub
    topic = "diverge-at-once"
    _lead_with_follower_2(stub, topic, epoch=0)
    assert code(append(stub, topic, encode_batch([b"e0"]), acks=1).error) == ErrorCode.NONE
    _lead_with_follower_2(stub, topic, epoch=1)  # epoch 0 now ends at offset 1 here
    assert code(append(stub, topic, encode_batch([b"e1"]), acks=1).error) == ErrorCode.NONE

    # Broker 2 claims it holds offsets 0..1 written in epoch 0: it diverged at 1.
    request = storage_pb2.FetchRequest(
        replica_id=2,
        max_wait_ms=3000,
        partitions=[
            storage_pb2.FetchPartition(
                topic=topic, partition=0, fetch_offset=2, last_fetched_epoch=0
            )
        ],
    )
    started = time.monotonic()
    (result,) = stub.Fetch(request, timeout=RPC_TIMEOUT_S).partitions
    took_s = time.monotonic() - started
    assert (result.diverging_epoch, result.diverging_end_offset) == (0, 1), result
    assert took_s < 1.0, f"the divergence was answered only after {took_s:.2f} s (max_wait_ms)"


@pytest.mark.parametrize(
    ("session_id", "epoch", "forgotten", "error"),
    [
        (5, 0, (), "carries session_id 0"),
        (0, 0, ("sess-x",), "no forgotten partitions"),
        (0, -2, (), "is not -1, 0 or positive"),
    ],
)
def test_a_malformed_session_fetch_is_refused(
    storage_node: StorageProcess,
    session_id: int,
    epoch: int,
    forgotten: tuple[str, ...],
    error: str,
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        session_fetch(storage_node.stub, session_id, epoch, {}, forgotten=forgotten)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error in str(refused.value.details())


def test_a_new_leader_answers_offsets_only_once_its_hw_reaches_its_epoch(
    storage_node: StorageProcess,
) -> None:
    """KIP-207: a leader's HW can lag what the previous leader had told consumers until
    its followers fetch in its epoch. Until the HW reaches the epoch's start, consumer
    ListOffsets (but EARLIEST) answer the retriable OFFSET_NOT_AVAILABLE rather than an
    end below the one consumers saw."""
    stub = storage_node.stub
    topic = "kip-207"
    _lead_with_follower_2(stub, topic)
    for value in (b"a", b"b", b"c"):
        result = append(stub, topic, encode_batch([value]), acks=common_pb2.LEADER)
        assert code(result.error) == ErrorCode.NONE
    _lead_with_follower_2(stub, topic, epoch=1)  # a new epoch starting at offset 3
    latest = list_offset(stub, topic, common_pb2.LATEST)
    assert code(latest.error) == ErrorCode.OFFSET_NOT_AVAILABLE, latest
    assert error_from_proto(latest.error).retriable  # type: ignore[union-attr]
    assert code(list_offset(stub, topic, common_pb2.EARLIEST).error) == ErrorCode.NONE
    fetch_as_follower_2(stub, topic, 3)
    latest = list_offset(stub, topic, common_pb2.LATEST)
    assert (code(latest.error), latest.offset) == (ErrorCode.NONE, 3)


def test_retention_never_retires_records_above_the_high_watermark(
    storage_node: StorageProcess,
) -> None:
    """Retention (retention.bytes=0 here, checked every 250 ms) deletes only segments wholly
    below the HW, as Kafka's does: records broker 2 has not fetched stay, so when it comes
    back it fetches them from offset 0, instead of being sent to a later log start while
    the HW jumps over records no replica but the leader ever held."""
    stub = storage_node.stub
    topic = "retention-above-hw"
    _lead_with_follower_2(stub, topic, {"segment.bytes": "1500", "retention.bytes": "0"})
    for i in range(6):  # ~1 KB each: a segment per batch
        result = append(stub, topic, encode_batch([bytes([65 + i]) * 1000]), acks=common_pb2.LEADER)
        assert code(result.error) == ErrorCode.NONE
    described = log_description(stub, topic)
    assert described is not None and described.log_end_offset == 6
    time.sleep(1.5)  # six maintenance passes
    described = log_description(stub, topic)
    assert described is not None
    assert (described.log_start_offset, described.high_watermark) == (0, 0)

    offset, values = 0, []
    while offset < 6:
        got = fetch_as_follower_2(stub, topic, offset)
        assert code(got.error) == ErrorCode.NONE, got.error
        batches = decode_batches(got.records)
        assert batches
        values += [r.value for b in batches for r in b.records]
        offset = batches[-1].last_offset + 1
    assert values == [bytes([65 + i]) * 1000 for i in range(6)]
    assert fetch_as_follower_2(stub, topic, 6).high_watermark == 6
    # Replicated now, so retention goes ahead: every segment, the active one too (Kafka's
    # rule), leaving an empty log at offset 6.
    wait_for(
        lambda: (d := log_description(stub, topic)) is not None and d.log_start_offset == 6,
        10,
        "retention below the HW",
    )


def test_append_stream_appends_each_request_as_it_arrives_and_answers_in_order(
    storage_node: StorageProcess,
) -> None:
    """An acks=all append waiting for its follower does not hold back the next request on
    the same stream (Kafka's requests in flight per partition): both are in the log before
    either is acknowledged; once the follower's fetch moves the HW past both, the answers
    come in request order."""
    stub = storage_node.stub
    topic = "stream-pipelined"
    _lead_with_follower_2(stub, topic)
    release = threading.Event()

    def requests() -> Iterator[storage_pb2.AppendRequest]:
        for i, value in enumerate((b"first", b"second"), start=1):
            yield storage_pb2.AppendRequest(
                topic=topic,
                partition=0,
                records=encode_batch([value]),
                acks=common_pb2.ALL,
                timeout_ms=30_000,
                correlation_id=i,
            )
        release.wait(30)  # the stream stays open until the answers are checked

    responses = stub.AppendStream(requests(), timeout=60)
    try:

        def both_written() -> storage_pb2.LogDescription | None:
            description = log_description(stub, topic)
            return description if description and description.log_end_offset == 2 else None

        described = wait_for(both_written, 10, "the second append before the first's ack")
        assert described.high_watermark == 0  # broker 2 has fetched nothing: none acked
        caught_up = stub.Fetch(
            storage_pb2.FetchRequest(
                replica_id=2,
                max_wait_ms=0,
                partitions=[storage_pb2.FetchPartition(topic=topic, partition=0, fetch_offset=2)],
            ),
            timeout=RPC_TIMEOUT_S,
        )
        assert caught_up.partitions[0].high_watermark == 2
        first, second = next(responses), next(responses)
    finally:
        release.set()
    assert [(r.correlation_id, code(r.error), r.base_offset) for r in (first, second)] == [
        (1, ErrorCode.NONE, 0),
        (2, ErrorCode.NONE, 1),
    ]
    assert list(responses) == []


def test_multi_partition_fetch_respects_byte_limits(storage_node: StorageProcess) -> None:
    stub = storage_node.stub
    for partition in (0, 1):
        make_leader(stub, "limits", partition)
        for i in range(3):
            append(stub, "limits", encode_batch([bytes([65 + i]) * 3000]), partition)
    request = storage_pb2.FetchRequest(
        replica_id=-1,
        max_wait_ms=0,
        max_bytes=5000,  # the whole response: the first partition takes it all
        partitions=[
            storage_pb2.FetchPartition(topic="limits", partition=p, fetch_offset=0, max_bytes=1)
            for p in (0, 1)
        ],
    )
    first, second = stub.Fetch(request, timeout=RPC_TIMEOUT_S).partitions
    # At least one batch even though it exceeds the partition's max_bytes...
    assert len(decode_batches(first.records)) == 1
    # ...but only for the first partition with data; the second only reports offsets.
    assert second.records == b""
    assert code(second.error) == ErrorCode.NONE
    assert second.high_watermark == 3


# --- long polling -----------------------------------------------------------------------


def test_long_poll_waits_about_max_wait_ms_when_there_is_no_data(
    storage_node: StorageProcess,
) -> None:
    stub = storage_node.stub
    make_leader(stub, "poll-empty")
    started = time.monotonic()
    result = fetch_one(stub, "poll-empty", 0, max_wait_ms=400)
    elapsed = time.monotonic() - started
    assert code(result.error) == ErrorCode.NONE
    assert result.records == b""
    assert 0.38 <= elapsed < 3.0, elapsed


def test_long_poll_returns_as_soon_as_data_arrives(storage_node: StorageProcess) -> None:
    stub = storage_node.stub
    make_leader(stub, "poll-wake", 0)
    make_leader(stub, "poll-wake", 1)
    outcome: dict[str, Any] = {}

    def poll() -> None:
        started = time.monotonic()
        request = storage_pb2.FetchRequest(
            replica_id=-1,
            max_wait_ms=10_000,
            partitions=[
                storage_pb2.FetchPartition(topic="poll-wake", partition=p, fetch_offset=0)
                for p in (0, 1)
            ],
        )
        outcome["response"] = stub.Fetch(request, timeout=30)
        outcome["elapsed"] = time.monotonic() - started

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.5)  # let the fetch start waiting
    assert poller.is_alive(), "the fetch must wait while there is no data"
    append(stub, "poll-wake", encode_batch([b"wake up"]), partition=1)
    poller.join(15)
    assert not poller.is_alive()
    assert 0.45 <= outcome["elapsed"] < 5.0, outcome["elapsed"]
    empty, woken = outcome["response"].partitions
    assert empty.records == b""
    assert values_of(list(decode_batches(woken.records)[0].records)) == [b"wake up"]


def test_fetch_waits_for_min_bytes_then_answers_with_what_there_is(
    storage_node: StorageProcess,
) -> None:
    stub = storage_node.stub
    make_leader(stub, "min-bytes")
    append(stub, "min-bytes", encode_batch([b"small"]))
    started = time.monotonic()
    result = fetch_one(stub, "min-bytes", 0, max_wait_ms=300, min_bytes=1_000_000)
    assert time.monotonic() - started >= 0.28
    assert values_of(list(decode_batches(result.records)[0].records)) == [b"small"]


def test_waiting_fetch_keeps_what_each_wake_up_found(storage_node: StorageProcess) -> None:
    # A waiting fetch reads again only the partitions that changed; what the others
    # already brought still counts towards min_bytes and is still answered.
    stub = storage_node.stub
    for p in (0, 1, 2):
        make_leader(stub, "wake-keeps", p)
    first, second = encode_batch([b"a" * 500]), encode_batch([b"b" * 500])
    outcome: dict[str, Any] = {}

    def poll() -> None:
        outcome["response"] = stub.Fetch(
            storage_pb2.FetchRequest(
                replica_id=-1,
                max_wait_ms=30_000,
                min_bytes=len(first) + len(second),
                partitions=[
                    storage_pb2.FetchPartition(topic="wake-keeps", partition=p, fetch_offset=0)
                    for p in (0, 1, 2)
                ],
            ),
            timeout=20,  # the deadline is the check: waiting out max_wait_ms would miss it
        )

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.5)
    append(stub, "wake-keeps", first, partition=0)
    time.sleep(0.5)
    assert poller.is_alive(), "one batch is below min_bytes: the fetch keeps waiting"
    append(stub, "wake-keeps", second, partition=2)
    poller.join(25)
    assert not poller.is_alive()
    zero, one, two = outcome["response"].partitions
    assert values_of(list(decode_batches(zero.records)[0].records)) == [b"a" * 500]
    assert one.records == b"" and one.high_watermark == 0
    assert values_of(list(decode_batches(two.records)[0].records)) == [b"b" * 500]


def test_a_fetch_whose_byte_budget_left_data_out_answers_without_waiting(
    storage_node: StorageProcess,
) -> None:
    """Below min_bytes, but another partition's batch was left out only because the
    response's max_bytes had no room for it: waiting cannot change the answer, and Kafka
    answers at once. The fetch slept out its whole max_wait_ms (found by an audit)."""
    stub = storage_node.stub
    for topic in ("budget-a", "budget-b"):
        make_leader(stub, topic)
    assert code(append(stub, "budget-a", encode_batch([b"a" * 3000]), acks=1).error) == 0
    assert code(append(stub, "budget-b", encode_batch([b"b" * 9000]), acks=1).error) == 0
    request = storage_pb2.FetchRequest(
        replica_id=-1,
        max_wait_ms=20_000,
        min_bytes=5000,
        max_bytes=10_000,
        partitions=[
            storage_pb2.FetchPartition(topic=t, partition=0, fetch_offset=0)
            for t in ("budget-a", "budget-b")
        ],
    )
    started = time.monotonic()
    response = stub.Fetch(request, timeout=RPC_TIMEOUT_S)
    assert time.monotonic() - started < 10, "it waited out max_wait_ms with its answer ready"
    assert [code(r.error) for r in response.partitions] == [0, 0]
    assert response.partitions[0].records and not response.partitions[1].records


# --- bad input: precise status, nothing written ----------------------------------------


@pytest.fixture
def victim(storage_node: StorageProcess) -> Any:
    """A partition with known contents, and a check that it still has exactly them."""
    stub = storage_node.stub
    topic = f"victim-{time.monotonic_ns()}"
    make_leader(stub, topic, configs={"max.message.bytes": "4096"})
    append(stub, topic, encode_batch([b"keep-1", b"keep-2"]))
    before = log_description(stub, topic)
    assert before is not None
    expected = (before.log_end_offset, before.size_bytes)

    class Victim:
        name = topic

        @staticmethod
        def assert_unchanged() -> None:
            after = log_description(stub, topic)
            assert after is not None
            assert (after.log_end_offset, after.size_bytes) == expected
            assert values_of(read_all(stub, topic)) == [b"keep-1", b"keep-2"]

    return Victim


@pytest.mark.parametrize(
    ("damage", "status", "code"),
    [
        pytest.param(
            lambda b: b[:-1] + bytes([b[-1] ^ 0xFF]),
            grpc.StatusCode.INVALID_ARGUMENT,
            ErrorCode.CORRUPT_BATCH,
            id="wrong-crc",
        ),
        pytest.param(
            lambda b: b[: formats.MAGIC_OFFSET] + b"\x07" + b[formats.MAGIC_OFFSET + 1 :],
            grpc.StatusCode.INVALID_ARGUMENT,
            ErrorCode.CORRUPT_BATCH,
            id="wrong-magic",
        ),
        pytest.param(
            lambda b: b[:-8],
            grpc.StatusCode.INVALID_ARGUMENT,
            ErrorCode.CORRUPT_BATCH,
            id="truncated-batch",
        ),
        pytest.param(
            lambda b: b[:30],
            grpc.StatusCode.INVALID_ARGUMENT,
            ErrorCode.CORRUPT_BATCH,
            id="truncated-header",
        ),
        pytest.param(
            # A valid batch followed by a damaged one: the request is all or nothing.
            lambda b: b + b[:-1] + bytes([b[-1] ^ 0x01]),
            grpc.StatusCode.INVALID_ARGUMENT,
            ErrorCode.CORRUPT_BATCH,
            id="second-batch-corrupt",
        ),
        pytest.param(
            lambda b: encode_batch([b"x" * 5000]),
            grpc.StatusCode.INVALID_ARGUMENT,
            ErrorCode.MESSAGE_TOO_LARGE,
            id="over-max-message-bytes",
        ),
        pytest.param(
            lambda b: b"",
            grpc.StatusCode.INVALID_ARGUMENT,
            ErrorCode.INVALID_REQUEST,
            id="no-records",
        ),
    ],
)
def test_bad_batches_are_refused_and_change_nothing(
    storage_node: StorageProcess,
    victim: Any,
    damage: Callable[[bytes], bytes],
    status: grpc.StatusCode,
    code: ErrorCode,
) -> None:
    records = damage(encode_batch([b"new-1", b"new-2"]))
    expect_rpc_error(lambda: append(storage_node.stub, victim.name, records), status, code)
    victim.assert_unchanged()


@pytest.mark.parametrize("topic", ["../x", "a/b", "", ".", "..", "t" * 250, "sp ace", "ü"])
def test_invalid_topic_names_are_refused_everywhere(
    storage_node: StorageProcess, topic: str
) -> None:
    stub = storage_node.stub

    def entries() -> list[str]:
        # A checkpoint being replaced (every 5 s) shows for a moment as ``<name>.tmp``.
        return sorted(
            p.name for p in storage_node.data_dir.iterdir() if not p.name.endswith(".tmp")
        )

    entries_before = entries()
    expect_rpc_error(
        lambda: append(stub, topic, encode_batch([b"x"])),
        grpc.StatusCode.INVALID_ARGUMENT,
        ErrorCode.INVALID_TOPIC,
    )
    response = leader_and_isr(stub, topic)
    assert [code(r.error) for r in response.partitions] == [ErrorCode.INVALID_TOPIC]
    assert response.partitions[0].error.message
    result = fetch_one(stub, topic, 0)
    assert code(result.error) == ErrorCode.INVALID_TOPIC
    # Nothing was created on disk, inside or outside the data directory.
    assert entries() == entries_before
    assert not (storage_node.data_dir.parent / "x-0").exists()


def test_topic_name_of_249_chars_is_fine(storage_node: StorageProcess) -> None:
    topic = "t" * 249
    make_leader(storage_node.stub, topic)
    append(storage_node.stub, topic, encode_batch([b"long name"]))
    assert values_of(read_all(storage_node.stub, topic)) == [b"long name"]


def test_request_level_errors_have_precise_statuses(
    storage_node: StorageProcess, victim: Any
) -> None:
    stub = storage_node.stub
    batch = encode_batch([b"x"])
    expect_rpc_error(
        lambda: append(stub, victim.name, batch, partition=7),
        grpc.StatusCode.NOT_FOUND,
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
    )
    expect_rpc_error(
        lambda: append(stub, "no-such-topic", batch),
        grpc.StatusCode.NOT_FOUND,
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
    )
    expect_rpc_error(
        lambda: append(stub, victim.name, batch, partition=-1),
        grpc.StatusCode.INVALID_ARGUMENT,
        ErrorCode.INVALID_REQUEST,
    )
    expect_rpc_error(
        lambda: append(stub, victim.name, batch, acks=9),
        grpc.StatusCode.INVALID_ARGUMENT,
        ErrorCode.INVALID_REQUIRED_ACKS,
    )
    expect_rpc_error(
        lambda: append(stub, victim.name, batch, current_leader_epoch=5),
        grpc.StatusCode.FAILED_PRECONDITION,
        ErrorCode.UNKNOWN_LEADER_EPOCH,
    )
    expect_rpc_error(
        lambda: fetch_one(stub, victim.name, 0, max_wait_ms=-1),
        grpc.StatusCode.INVALID_ARGUMENT,
        ErrorCode.INVALID_REQUEST,
    )
    expect_rpc_error(
        lambda: fetch_one(stub, victim.name, 0, max_bytes=0),
        grpc.StatusCode.INVALID_ARGUMENT,
        ErrorCode.INVALID_FETCH_SIZE,
    )
    victim.assert_unchanged()


def test_stale_leader_epoch_is_fenced(storage_node: StorageProcess) -> None:
    stub = storage_node.stub
    make_leader(stub, "epochs", epoch=3)
    expect_rpc_error(
        lambda: append(stub, "epochs", encode_batch([b"x"]), current_leader_epoch=2),
        grpc.StatusCode.FAILED_PRECONDITION,
        ErrorCode.FENCED_LEADER_EPOCH,
    )
    response = leader_and_isr(stub, "epochs", epoch=2)  # a delayed, older decision
    assert [code(r.error) for r in response.partitions] == [ErrorCode.FENCED_LEADER_EPOCH]
    ok = append(stub, "epochs", encode_batch([b"y"]), current_leader_epoch=3)
    assert ok.base_offset == 0
    (batch,) = decode_batches(read_all_raw(stub, "epochs"))
    assert batch.partition_leader_epoch == 3  # the leader stamps its epoch on every batch


def test_fetch_offsets_out_of_range_are_per_partition_errors(
    storage_node: StorageProcess, victim: Any
) -> None:
    stub = storage_node.stub
    for offset in (-1, 3, 1_000_000):
        result = fetch_one(stub, victim.name, offset)
        assert code(result.error) == ErrorCode.OFFSET_OUT_OF_RANGE, offset
        assert result.error.message
        assert result.records == b""
    at_end = fetch_one(stub, victim.name, 2)
    assert (code(at_end.error), at_end.records, at_end.high_watermark) == (ErrorCode.NONE, b"", 2)
    unknown = fetch_one(stub, victim.name, 0, partition=3)
    assert code(unknown.error) == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
    victim.assert_unchanged()


# --- ListOffsets, health, reflection, DescribeLogDirs ------------------------------------


def test_list_offsets(storage_node: StorageProcess) -> None:
    stub = storage_node.stub
    # Records of 1970: time retention would delete them all, the active segment too.
    make_leader(stub, "times", configs={"retention.ms": "-1"})
    append(stub, "times", encode_batch([b"a", b"b"], timestamps_ms=[1000, 1001]))  # 0, 1
    append(stub, "times", encode_batch([b"c"], timestamps_ms=[2000]))  # 2
    append(stub, "times", encode_batch([b"d", b"e"], timestamps_ms=[3000, 3005]))  # 3, 4

    assert list_offset(stub, "times", common_pb2.EARLIEST).offset == 0
    assert list_offset(stub, "times", common_pb2.LATEST).offset == 5
    by_time = {
        ts: (r.offset, r.timestamp_ms)
        for ts in (0, 1000, 1001, 1500, 2000, 3001, 3005, 3006)
        for r in [list_offset(stub, "times", common_pb2.BY_TIMESTAMP, ts)]
    }
    assert by_time == {
        0: (0, 1000),
        1000: (0, 1000),
        1001: (1, 1001),
        1500: (2, 2000),
        2000: (2, 2000),
        3001: (4, 3005),
        3005: (4, 3005),
        3006: (-1, -1),
    }
    newest = list_offset(stub, "times", common_pb2.MAX_TIMESTAMP)
    assert (newest.offset, newest.timestamp_ms) == (4, 3005)
    assert code(newest.error) == ErrorCode.NONE
    # The record's own offset, not its batch's last one (KIP-734, KAFKA-16310).
    append(stub, "times", encode_batch([b"f", b"g"], timestamps_ms=[4000, 3500]))  # 5, 6
    newest = list_offset(stub, "times", common_pb2.MAX_TIMESTAMP)
    assert (newest.offset, newest.timestamp_ms) == (5, 4000)

    bad_spec = list_offset(stub, "times", common_pb2.OFFSET_SPEC_UNSPECIFIED)
    assert code(bad_spec.error) == ErrorCode.INVALID_REQUEST
    unknown = list_offset(stub, "no-such-topic", common_pb2.LATEST)
    assert code(unknown.error) == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION


def test_health_and_reflection(storage_node: StorageProcess) -> None:
    health = health_pb2_grpc.HealthStub(storage_node.channel)
    for service in ("", "tidelog.v1.Storage"):
        response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(storage_node.channel)
    (answer,) = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for s in answer.list_services_response.service}
    assert {"tidelog.v1.Storage", "grpc.health.v1.Health"} <= names


def test_describe_log_dirs(storage_node: StorageProcess) -> None:
    stub = storage_node.stub
    make_leader(stub, "described")
    append(stub, "described", encode_batch([b"x" * 100]))
    response = stub.DescribeLogDirs(storage_pb2.DescribeLogDirsRequest(), timeout=RPC_TIMEOUT_S)
    (log_dir,) = response.log_dirs
    assert Path(log_dir.path) == storage_node.data_dir
    assert log_dir.total_bytes > 0 and 0 <= log_dir.usable_bytes <= log_dir.total_bytes
    described = log_description(stub, "described")
    assert described is not None
    assert described.is_leader
    assert (described.log_start_offset, described.log_end_offset) == (0, 1)
    assert described.high_watermark == 1
    assert described.size_bytes > 100
    assert described.segment_count == 1


def test_stop_replica_with_delete_removes_the_log(storage_node: StorageProcess) -> None:
    stub = storage_node.stub
    make_leader(stub, "doomed")
    append(stub, "doomed", encode_batch([b"x"]))
    assert (storage_node.data_dir / "doomed-0").is_dir()
    request = storage_pb2.StopReplicaRequest(
        controller_epoch=1,
        partitions=[
            storage_pb2.StopReplicaPartition(
                topic="doomed", partition=0, leader_epoch=-1, delete_partition=True
            )
        ],
    )
    response = stub.StopReplica(request, timeout=RPC_TIMEOUT_S)
    assert [code(r.error) for r in response.partitions] == [ErrorCode.NONE]
    assert not (storage_node.data_dir / "doomed-0").exists()
    expect_rpc_error(
        lambda: append(stub, "doomed", encode_batch([b"y"])),
        grpc.StatusCode.NOT_FOUND,
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
    )
    # Deleting again is not an error: a retrying controller must not be told otherwise.
    again = stub.StopReplica(request, timeout=RPC_TIMEOUT_S)
    assert [code(r.error) for r in again.partitions] == [ErrorCode.NONE]


# --- process lifecycle: clean stop, crashes ---------------------------------------------


def test_sigterm_exits_zero_and_restart_keeps_data(
    start_storage: StartStorage, tmp_path: Path
) -> None:
    node = start_storage()
    make_leader(node.stub, "durable", epoch=1)
    for i in range(5):
        append(node.stub, "durable", encode_batch([f"v{i}".encode()] * 2))
    before = read_all_raw(node.stub, "durable")
    assert node.terminate() == 0

    checkpoint = (tmp_path / "data" / "recovery-point-offset-checkpoint").read_text()
    assert "durable 0 10" in checkpoint.splitlines()  # a clean stop leaves nothing to recover

    node = start_storage()
    # Hosted on disk, but not served until the controller says who leads.
    described = log_description(node.stub, "durable")
    assert described is not None and described.log_end_offset == 10
    expect_rpc_error(
        lambda: append(node.stub, "durable", encode_batch([b"too early"])),
        grpc.StatusCode.FAILED_PRECONDITION,
        ErrorCode.NOT_LEADER_OR_FOLLOWER,
    )
    make_leader(node.stub, "durable", epoch=2)
    assert read_all_raw(node.stub, "durable") == before
    assert append(node.stub, "durable", encode_batch([b"after"])).base_offset == 10
    assert node.terminate() == 0


def test_sighup_stops_a_node_cleanly(start_storage: StartStorage, tmp_path: Path) -> None:
    """A closed terminal or a dropped ssh session sends SIGHUP: the node stops as on
    SIGTERM (exit 0, logs checkpointed), as Kafka's JVM runs its clean shutdown. By
    default SIGHUP ended it at once, with no flush (found by an audit)."""
    node = start_storage()
    make_leader(node.stub, "hangup", epoch=1)
    append(node.stub, "hangup", encode_batch([b"v"] * 3))
    os.kill(node.pid, signal.SIGHUP)
    assert node.wait(30) == 0
    checkpoint = (tmp_path / "data" / "recovery-point-offset-checkpoint").read_text()
    assert "hangup 0 3" in checkpoint.splitlines()


def test_sigterm_ends_waiting_long_polls_promptly(start_storage: StartStorage) -> None:
    node = start_storage()
    make_leader(node.stub, "waiting")
    outcome: dict[str, Any] = {}

    def poll() -> None:
        try:
            outcome["result"] = fetch_one(node.stub, "waiting", 0, max_wait_ms=20_000)
        except grpc.RpcError as exc:
            outcome["error"] = exc

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.3)
    started = time.monotonic()
    assert node.terminate() == 0
    # Well inside the 5 s grace period: the wait is cut short, not sat out.
    assert time.monotonic() - started < 4.0
    poller.join(5)
    assert not poller.is_alive()
    if "result" in outcome:  # answered (empty) before the server went away
        assert outcome["result"].records == b""


def _append_until_killed(
    node: StorageProcess, topic: str, first_index: int, acked: list[tuple[int, list[bytes]]]
) -> None:
    """Append 3-record batches one by one until the node dies; record each acknowledged."""
    stub = node.stub
    index = first_index
    while True:
        values = [f"{topic}-{index}-{j}".encode() for j in range(3)]
        try:
            response = append(stub, topic, encode_batch(values))
        except grpc.RpcError:
            return
        acked.append((response.base_offset, values))
        index += 1


def _crash_and_recover(
    start_storage: StartStorage, topic: str, configs: dict[str, str]
) -> tuple[list[tuple[int, list[bytes]]], bytes, StorageProcess, storage_pb2.LogDescription]:
    """Append (first quietly, then while being killed with SIGKILL), restart, re-lead."""
    node = start_storage()
    make_leader(node.stub, topic, configs=configs)
    acked: list[tuple[int, list[bytes]]] = []
    for i in range(20):
        values = [f"{topic}-{i}-{j}".encode() for j in range(3)]
        acked.append((append(node.stub, topic, encode_batch(values)).base_offset, values))
    quiet_raw = read_all_raw(node.stub, topic)
    described = log_description(node.stub, topic)
    assert described is not None

    writer = threading.Thread(target=_append_until_killed, args=(node, topic, 20, acked))
    writer.start()
    deadline = time.monotonic() + 10
    while len(acked) < 60 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert node.kill() == -9
    writer.join(10)
    assert not writer.is_alive()

    restarted = start_storage()
    make_leader(restarted.stub, topic, epoch=1)
    return acked, quiet_raw, restarted, described


def _check_recovered(
    node: StorageProcess, topic: str, acked: list[tuple[int, list[bytes]]], quiet_raw: bytes
) -> None:
    raw = read_all_raw(node.stub, topic)
    # Everything decodes (both CRCs of every batch are checked) and offsets are contiguous.
    records = [r for b in decode_batches(raw) for r in b.records]
    assert [r.offset for r in records] == list(range(len(records)))
    # The batches written before the crash window read back byte for byte.
    assert raw.startswith(quiet_raw)
    # Every acknowledged batch is there, at the offsets it was acknowledged with.
    for base_offset, values in acked:
        assert values_of(records[base_offset : base_offset + len(values)]) == values
    acked_end = acked[-1][0] + len(acked[-1][1])
    # At most the one append in flight at the kill may have landed beyond that.
    assert acked_end <= len(records) <= acked_end + 3
    end = list_offset(node.stub, topic, common_pb2.LATEST).offset
    assert end == len(records)


def test_kill_9_with_fsync_on_every_append_loses_no_acknowledged_batch(
    start_storage: StartStorage,
) -> None:
    topic = "fsynced"
    acked, quiet_raw, node, described = _crash_and_recover(
        start_storage, topic, {"flush.messages": "1"}
    )
    # flush.messages=1 really flushed: the recovery point had reached the log end.
    assert described.recovery_point == described.log_end_offset == 60
    _check_recovered(node, topic, acked, quiet_raw)
    assert node.terminate() == 0


def test_kill_9_without_fsync_recovers_a_valid_prefix(start_storage: StartStorage) -> None:
    topic = "unflushed"
    acked, quiet_raw, node, described = _crash_and_recover(start_storage, topic, {})
    assert described.recovery_point < described.log_end_offset  # nothing forced to disk
    # On one machine the page cache outlives a killed process, so even unflushed data is
    # all there; what this proves is that recovery accepts it and serves it intact.
    _check_recovered(node, topic, acked, quiet_raw)
    assert node.terminate() == 0


def _append_big_until_killed(
    node: StorageProcess, topic: str, first_index: int, acked: list[tuple[int, list[bytes]]]
) -> None:
    index = first_index
    while True:
        values = [f"{topic}-{index}-{j}".encode().ljust(1024, b".") for j in range(64)]
        try:
            response = append(node.stub, topic, encode_batch(values))
        except grpc.RpcError:
            return
        acked.append((response.base_offset, values))
        index += 1


def test_kill_9_with_pages_dropped_behind_a_small_window_loses_no_acknowledged_batch(
    start_storage: StartStorage,
) -> None:
    # page.cache.window.bytes at 1 MiB with 2 MiB segments: while being killed, the node
    # writes back and drops pages of the active segment and whole retired segments, so
    # the acknowledged data lives on the disk, not in the cache, when recovery reads it.
    topic = "dropped"
    node = start_storage()
    configs = {"page.cache.window.bytes": str(1 << 20), "segment.bytes": str(2 << 20)}
    make_leader(node.stub, topic, configs=configs)
    acked: list[tuple[int, list[bytes]]] = []
    before_kill = 80  # batches of 64 KiB: ~5 MiB, two segments rolled
    writer = threading.Thread(target=_append_big_until_killed, args=(node, topic, 0, acked))
    writer.start()
    deadline = time.monotonic() + 20
    while len(acked) < before_kill and time.monotonic() < deadline:
        time.sleep(0.01)
    segments = sorted((node.data_dir / f"{topic}-0").glob("*.log"))
    assert len(segments) >= 2
    if not on_tmpfs(segments[0]):
        resident, pages = resident_pages(segments[0], 0, segments[0].stat().st_size)
        assert resident <= pages // 4, (resident, pages)  # retired and dropped
    assert node.kill() == -9
    writer.join(10)
    assert not writer.is_alive()

    restarted = start_storage()
    make_leader(restarted.stub, topic, epoch=1, configs=configs)
    records = [r for b in decode_batches(read_all_raw(restarted.stub, topic)) for r in b.records]
    assert [r.offset for r in records] == list(range(len(records)))
    for base_offset, values in acked:
        assert values_of(records[base_offset : base_offset + len(values)]) == values
    acked_end = acked[-1][0] + len(acked[-1][1])
    assert acked_end <= len(records) <= acked_end + 64
    assert restarted.terminate() == 0


# --- the command line ---------------------------------------------------------------------


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m tidelog *argv`` from the checkout, to its end (30 s at most)."""
    return subprocess.run(
        [sys.executable, "-m", "tidelog", *argv],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=tidelog_env(),
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["storage", "--broker-id", "-1", "--data-dir", "{tmp}"],
        ["storage", "--broker-id", "x", "--data-dir", "{tmp}"],
        ["storage", "--broker-id", "1"],
        ["storage", "--broker-id", "1", "--data-dir", "{tmp}", "--listen", "nohost"],
        ["storage", "--broker-id", "1", "--data-dir", "{tmp}", "--listen", "h:70000"],
        ["no-such-command"],
    ],
)
def test_cli_rejects_bad_input_in_one_line(tmp_path: Path, args: list[str]) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    done = run_cli(*argv)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_cli_reports_a_port_in_use(start_storage: StartStorage, tmp_path: Path) -> None:
    node = start_storage()
    done = run_cli(
        "storage",
        "--broker-id",
        "2",
        "--data-dir",
        str(tmp_path / "other"),
        "--listen",
        node.address,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "cannot listen" in done.stderr


def test_a_port_in_use_on_one_address_of_a_host_name_is_refused(
    start_storage: StartStorage, tmp_path: Path
) -> None:
    """``--listen localhost:P`` while 127.0.0.1:P is another node's: gRPC resolves the
    name to ::1 and 127.0.0.1 (whatever /etc/hosts says) and succeeded if it bound
    either, so the second node
    started, serving ::1 only, and announced an address that could reach the first (found
    by an audit). Every address of the name is bound now, or the start fails."""
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback")
    node = start_storage()
    port = int(node.address.rsplit(":", 1)[1])
    done = run_cli(
        "storage", "--broker-id", "2", "--data-dir", str(tmp_path / "other"),
        "--listen", f"localhost:{port}",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout
    assert "listening on" not in done.stdout
    assert f"cannot listen on localhost:{port}" in done.stderr


def test_a_second_storage_node_on_a_data_directory_in_use_refuses_to_start(
    start_storage: StartStorage, tmp_path: Path
) -> None:
    """As Kafka's ``.lock``: a second process on the same directory would recover, trim
    and write the logs the running node is writing (it used to start, and trimmed the
    running node's indexes when it stopped)."""
    node = start_storage()
    make_leader(node.stub, "locked")
    append(node.stub, "locked", encode_batch([b"kept"]))
    done = run_cli(
        "storage", "--broker-id", "2", "--data-dir", str(node.data_dir), "--listen", "127.0.0.1:0"
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "is in use by another storage node" in done.stderr
    assert values_of(read_all(node.stub, "locked")) == [b"kept"]
    node.kill()  # kill -9: the kernel releases the lock
    start_storage(node.data_dir)


# --- the shared pieces under the service: status table, topic names ------------------------


def test_every_error_code_has_a_status_and_round_trips_through_error_protos() -> None:
    assert set(STATUS_FOR_CODE) == set(ErrorCode)
    assert STATUS_FOR_CODE[ErrorCode.NONE] == grpc.StatusCode.OK
    assert error_from_proto(to_error_proto(None)) is None
    for error_code in ErrorCode:
        if error_code is ErrorCode.NONE:
            continue
        back = error_from_proto(to_error_proto(error_for_code(error_code, "why")))
        assert back is not None
        assert (back.code, back.message) == (error_code, "why")
    unexpected = error_from_proto(to_error_proto(ValueError("boom")))
    assert isinstance(unexpected, UnknownServerError)
    assert "boom" in unexpected.message


def test_statuses_without_a_tidelog_code_still_become_tidelog_errors() -> None:
    # Nothing listens on port 1: gRPC itself fails the call with UNAVAILABLE.
    with grpc.insecure_channel("127.0.0.1:1") as channel:
        stub = storage_pb2_grpc.StorageStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.DescribeLogDirs(storage_pb2.DescribeLogDirsRequest(), timeout=2)
    error = error_from_rpc_error(info.value)
    assert isinstance(error, NetworkError)
    assert error.retriable


def test_deadline_enforced_by_grpc_becomes_request_timed_out(storage_node: StorageProcess) -> None:
    # An append stream whose client sends nothing: the call outlives its deadline.
    def silent() -> Iterator[storage_pb2.AppendRequest]:
        time.sleep(1.0)
        yield from ()

    with pytest.raises(grpc.RpcError) as info:
        list(storage_node.stub.AppendStream(silent(), timeout=0.2))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    error: TidelogError = error_from_rpc_error(info.value)
    assert isinstance(error, RequestTimedOutError)
    assert error.retriable


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("orders-0", ("orders", 0)),
        ("my-topic-12", ("my-topic", 12)),
        ("a.b_c-2147483647", ("a.b_c", 2147483647)),
        ("orders-01", None),  # not canonical: would not round-trip
        ("orders--1", ("orders-", 1)),  # "orders-" is a legal topic name
        ("orders-", None),
        ("orders", None),
        ("-0", None),
        ("..-0", None),  # topic ".." would escape the data directory
        ("orders-0.abcdef-delete", None),  # a directory being deleted
        ("orders-2147483648", None),
        ("recovery-point-offset-checkpoint", None),
    ],
)
def test_partition_dir_names(name: str, parsed: tuple[str, int] | None) -> None:
    assert parse_partition_dir_name(name) == parsed
    if parsed is not None:
        assert partition_dir_name(*parsed) == name


def test_topic_name_rule() -> None:
    for good in ("a", "A-z_0.9", "t" * 249, "...", "-"):
        validate_topic_name(good)
    for bad in ("", ".", "..", "t" * 250, "a/b", "../x", "a b", "é", "a\x00"):
        with pytest.raises(TidelogError) as info:
            validate_topic_name(bad)
        assert info.value.code == ErrorCode.INVALID_TOPIC
    with pytest.raises(TidelogError) as negative:
        partition_dir_name("t", -1)
    assert negative.value.code == ErrorCode.INVALID_REQUEST


def test_a_pipelined_follower_fetch_counts_only_what_the_follower_has_written(
    storage_node: StorageProcess,
) -> None:
    """``written_offset`` below ``fetch_offset`` (the follower asked for the next range
    before writing the last answer) moves the HW only to what is written, and is answered
    at once rather than long-polled."""
    stub = storage_node.stub
    topic = "pipelined-follower"
    _lead_with_follower_2(stub, topic)
    for i in range(3):
        result = append(stub, topic, encode_batch([f"v{i}".encode()]), acks=common_pb2.LEADER)
        assert code(result.error) == ErrorCode.NONE

    def follower_fetch(
        max_wait_ms: int = 20_000, **fields: int
    ) -> storage_pb2.FetchPartitionResult:
        request = storage_pb2.FetchRequest(
            replica_id=2,
            max_wait_ms=max_wait_ms,
            partitions=[storage_pb2.FetchPartition(topic=topic, partition=0, **fields)],
        )
        answer: storage_pb2.FetchResponse = stub.Fetch(request, timeout=30)
        return answer.partitions[0]

    started = time.monotonic()
    pipelined = follower_fetch(fetch_offset=3, written_offset=1)
    # Not long-polled: nothing to send, yet answered well before max_wait_ms (20 s).
    assert time.monotonic() - started < 10
    assert code(pipelined.error) == ErrorCode.NONE and pipelined.records == b""
    assert pipelined.high_watermark == 1  # written 1, not 3
    # The next fetch reports the write: now the HW reaches 3.
    assert follower_fetch(max_wait_ms=0, fetch_offset=3).high_watermark == 3


def test_fetches_beyond_the_waiting_places_are_throttled_and_followers_keep_theirs(
    start_storage: StartStorage,
) -> None:
    """Each waiting fetch holds a server thread, so only --max-waiting-fetches may wait
    (4 here, one of them kept for followers). A consumer's fetch beyond the others' three
    is answered at once and used to carry nothing else, so its client asked again at
    once, spinning; now it carries a throttle_time_ms of its max_wait. A follower's fetch
    still gets the reserved place and waits for data, and the waiting fetches are
    answered when it comes."""
    node = start_storage(extra_args=["--max-waiting-fetches", "4"])
    stub = node.stub
    topic = "throttled"
    _lead_with_follower_2(stub, topic)

    def long_poll(replica_id: int) -> Any:
        return stub.Fetch.future(
            storage_pb2.FetchRequest(
                replica_id=replica_id,
                max_wait_ms=20_000,
                partitions=[storage_pb2.FetchPartition(topic=topic, partition=0, fetch_offset=0)],
            ),
            timeout=RPC_TIMEOUT_S + 20,
        )

    waiting = [long_poll(-1) for _ in range(3)]
    time.sleep(0.5)  # the three are waiting
    assert not any(f.done() for f in waiting)
    extra = stub.Fetch(
        storage_pb2.FetchRequest(
            replica_id=-1,
            max_wait_ms=5_000,
            partitions=[storage_pb2.FetchPartition(topic=topic, partition=0, fetch_offset=0)],
        ),
        timeout=RPC_TIMEOUT_S + 5,
    )
    assert extra.throttle_time_ms == 5_000, extra
    assert code(extra.partitions[0].error) == ErrorCode.NONE and not extra.partitions[0].records
    follower = long_poll(2)
    time.sleep(0.5)
    assert not follower.done(), "the follower's fetch was answered instead of waiting"
    assert code(append(stub, topic, encode_batch([b"x"]), acks=common_pb2.LEADER).error) == (
        ErrorCode.NONE
    )
    answer = follower.result(RPC_TIMEOUT_S)
    assert answer.throttle_time_ms == 0 and answer.partitions[0].records
    fetch_as_follower_2(stub, topic, 1)  # the follower has it: the HW moves to 1
    for future in waiting:
        answer = future.result(RPC_TIMEOUT_S)
        assert answer.throttle_time_ms == 0 and answer.partitions[0].records, answer


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (make sysdeps)")
@pytest.mark.parametrize("error", ["EROFS", "EIO"])
def test_a_failed_disk_refusing_the_lock_file_exits_3(tmp_path: Path, error: str) -> None:
    """A failing disk is typically remounted read-only (ext4's errors=remount-ro): opening
    ``.lock``, the first file a start touches, then fails with EROFS, and the node exited
    1 (a configuration error's status) without ``log_dir_failed``, where every later file
    gives the failed disk's 3 (found by an audit). strace injects the error into that one
    open of the real process."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / ".lock").touch()
    (data_dir / "meta.properties").write_text("version=0\nbroker.id=1\n")
    done = subprocess.run(
        ["strace", "-f", "-qq", "-o", "/dev/null", "-P", str(data_dir / ".lock"),
         "-e", "trace=openat", "-e", f"inject=openat:error={error}",
         sys.executable, "-m", "tidelog", "storage", "--broker-id", "1",
         "--data-dir", str(data_dir), "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, cwd=REPO_ROOT, env=tidelog_env(), timeout=60,
        check=False,
    )  # fmt: skip
    assert "log_dir_failed" in done.stderr and ".lock" in done.stderr, done.stderr[-2000:]
    assert done.returncode == EXIT_DISK_FAILURE, done.stderr[-2000:]


def _start_storage_on(data_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tidelog", "storage", "--broker-id", "1",
         "--data-dir", str(data_dir), "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, cwd=REPO_ROOT, env=tidelog_env(), timeout=30,
        check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("broken", "target", "error"),
    [
        ("meta.properties.tmp", "/dev/full", "No space left on device"),
        ("replication-offset-checkpoint", "/proc/self/mem", "Input/output error"),
        ("recovery-point-offset-checkpoint", "/proc/self/mem", "Input/output error"),
    ],
)
def test_a_disk_failure_on_the_data_dirs_own_files_at_start_exits_3(
    tmp_path: Path, broken: str, target: str, error: str
) -> None:
    """ENOSPC writing meta.properties and EIO reading the replication-offset checkpoint
    at start-up ended the node with status 1 (a configuration error's) instead of the
    failed disk's 3, which the recovery checkpoint already had (found by an audit). Real
    errors without privileges: /dev/full fails writes with ENOSPC, and /proc/self/mem
    read at offset 0 with EIO."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    if not broken.startswith("meta.properties"):
        (data_dir / "meta.properties").write_text("version=0\nbroker.id=1\n")
    (data_dir / broken).symlink_to(target)
    done = _start_storage_on(data_dir)
    assert error in done.stderr, done.stderr[-2000:]
    assert done.returncode == EXIT_DISK_FAILURE, done.stderr[-2000:]


def idem(seq: int, n: int = 3, tag: str = "") -> bytes:
    """An idempotent batch of producer 11, epoch 0, from sequence ``seq``."""
    return encode_batch(
        [f"{tag}{seq}-{i}".encode() * 20 for i in range(n)],
        producer_id=11,
        producer_epoch=0,
        base_sequence=seq,
    )


def test_duplicates_after_kill_9_are_answered_not_written(start_storage: StartStorage) -> None:
    """Idempotent duplicates are still recognised by a real node after kill -9, across
    segment rolls (producer snapshot + replay): the last five with their offsets, an older
    one at unknown offsets, nothing written again (checked by an audit; a regression
    test)."""
    node = start_storage()
    topic = "idem"
    make_leader(node.stub, topic, configs={"segment.bytes": "2000"})
    sent = []
    for i in range(20):
        r = append(node.stub, topic, idem(3 * i))
        sent.append((3 * i, r.base_offset, r.last_offset))
    assert node.kill() == -9
    node = start_storage()
    make_leader(node.stub, topic, epoch=1, configs={"segment.bytes": "2000"})
    before = len(read_all(node.stub, topic))
    for seq, base, last in sent[-5:]:
        r = append(node.stub, topic, idem(seq))
        assert (r.base_offset, r.last_offset) == (base, last)
    r = append(node.stub, topic, idem(0))
    assert r.base_offset == -1 and r.last_offset >= 2
    assert len(read_all(node.stub, topic)) == before
    r = append(node.stub, topic, idem(60))
    assert r.base_offset == 60
    assert node.terminate() == 0


def test_flush_ms_moves_the_recovery_point_of_an_idle_partition(
    start_storage: StartStorage,
) -> None:
    """flush.ms flushes an idle partition: its recovery point reaches its log end (checked
    by an audit; a regression test)."""
    node = start_storage()
    make_leader(node.stub, "fms", configs={"flush.ms": "300"})
    append(node.stub, "fms", idem(0), acks=common_pb2.LEADER)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        d = log_description(node.stub, "fms")
        if d is not None and d.recovery_point == d.log_end_offset == 3:
            break
        time.sleep(0.1)
    d = log_description(node.stub, "fms")
    assert d is not None and d.recovery_point == 3, d
    assert node.terminate() == 0


def test_append_many_isolates_each_entrys_error(start_storage: StartStorage) -> None:
    """In one AppendMany an unhosted partition, a sequence gap and a corrupt batch each
    fail alone; the other entries are written (checked by an audit; a regression test)."""
    node = start_storage()
    for t in ("ma", "mb", "mc", "md"):
        make_leader(node.stub, t)
    append(node.stub, "mb", idem(0))
    bad = bytearray(encode_batch([b"bad"]))
    bad[-1] ^= 0xFF

    def entry(topic: str, records: bytes, partition: int = 0) -> storage_pb2.AppendRequest:
        return storage_pb2.AppendRequest(
            topic=topic, partition=partition, records=records, acks=common_pb2.ALL
        )

    response = node.stub.AppendMany(
        storage_pb2.AppendManyRequest(
            appends=[
                entry("ma", encode_batch([b"a"])),
                entry("ma", encode_batch([b"x"]), partition=1),  # not hosted
                entry("mb", idem(7)),  # a sequence gap
                entry("mc", bytes(bad)),  # corrupt
                entry("md", encode_batch([b"d"])),
            ]
        ),
        timeout=10,
    )
    assert [code(r.error) for r in response.responses] == [
        ErrorCode.NONE,
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
        ErrorCode.OUT_OF_ORDER_SEQUENCE,
        ErrorCode.CORRUPT_BATCH,
        ErrorCode.NONE,
    ]
    assert [r.value for r in read_all(node.stub, "ma")] == [b"a"]
    assert [r.value for r in read_all(node.stub, "md")] == [b"d"]
    assert read_all(node.stub, "mc") == []
    assert len(read_all(node.stub, "mb")) == 3
    assert node.terminate() == 0
