"""The storage node's fetch path under races, from an audit of it (they passed: kept as
regression tests): a follower's fetch session with lost answers and small budgets still
reaches every log end; a consumer's long poll wakes when a session fetch moves the HW;
consumer reads racing appends, rolls and retention get only the records at their
position."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from services.storage.fetch_session import FetchSessionHandler
from tests.support.process import StorageProcess
from tests.test_storage_node import (
    RPC_TIMEOUT_S,
    _lead_with_follower_2,
    append,
    code,
    fetch_one,
    list_offset,
    make_leader,
    session_fetch,
)
from tidelog.errors import ErrorCode
from tidelog.records import decode_batches, encode_batch
from tidelog.v1 import common_pb2, storage_pb2


@pytest.mark.parametrize("seed", range(6))
def test_a_session_follower_with_lost_answers_and_small_budgets_catches_up(
    storage_node: StorageProcess, seed: int
) -> None:
    """A follower (FetchSessionHandler, KIP-227) with budgets down to 200 bytes, answers
    lost on the way and partitions leaving and rejoining its session reaches every log
    end once appends stop, and never gets records from another offset."""
    stub = storage_node.stub
    rng = random.Random(seed)
    topics = [f"session-live-{seed}-{i}" for i in range(5)]
    for topic in topics:
        _lead_with_follower_2(stub, topic)
    ends = dict.fromkeys(topics, 0)
    stop = threading.Event()
    problems: list[str] = []

    def produce() -> None:
        prng = random.Random(seed + 100)
        try:
            for _ in range(150):
                topic = prng.choice(topics)
                value = b"v" * prng.randint(100, 3000)
                r = append(stub, topic, encode_batch([value]), acks=common_pb2.LEADER)
                if code(r.error) != 0:
                    problems.append(f"append to {topic}: {r.error}")
                    return
                ends[topic] = r.base_offset + 1
        finally:
            stop.set()  # (the fetch loop ends 200 rounds after this)

    producer = threading.Thread(target=produce)
    producer.start()
    handler: FetchSessionHandler[tuple[int]] = FetchSessionHandler()
    position = dict.fromkeys(topics, 0)
    away: dict[str, int] = {}  # topic -> rounds left out of the session
    rounds_after_stop = 0
    while rounds_after_stop < 200:
        if stop.is_set():
            rounds_after_stop += 1
            if all(position[t] == ends[t] for t in topics):
                break
        for topic in list(away):
            away[topic] -= 1
            if away[topic] <= 0:
                del away[topic]
        if rng.random() < 0.05:
            away[rng.choice(topics)] = rng.randint(1, 3)
        wanted = {(t, 0): (position[t],) for t in topics if t not in away}
        plan = handler.plan(wanted)
        request = storage_pb2.FetchRequest(
            replica_id=2,
            max_wait_ms=rng.choice([0, 0, 20]),
            min_bytes=1,
            max_bytes=rng.choice([200, 4000, 8000, 1 << 20]),
            session_id=plan.session_id,
            session_epoch=plan.epoch,
            partitions=[
                storage_pb2.FetchPartition(
                    topic=t, partition=p, fetch_offset=plan.positions[(t, p)][0]
                )
                for t, p in plan.send
            ],
            forgotten=[common_pb2.TopicPartition(topic=t, partition=p) for t, p in plan.forgotten],
        )
        try:
            response = stub.Fetch(request, timeout=RPC_TIMEOUT_S)
        except grpc.RpcError:
            handler.reset()
            continue
        if rng.random() < 0.05:
            continue  # the answer was lost on its way: the follower never saw it
        handler.answered(plan, response.session_id)
        for result in response.partitions:
            if ErrorCode(int(result.error.code)) != ErrorCode.NONE:
                problems.append(f"{result.topic}: {result.error}")
                continue
            if not result.records:
                continue
            batches = decode_batches(result.records)
            at = plan.positions[(result.topic, 0)][0]
            if batches[0].base_offset != at:
                problems.append(f"{result.topic}: got {batches[0].base_offset} at {at}")
                continue
            position[result.topic] = batches[-1].next_offset
    producer.join(30)
    assert not problems, problems[:5]
    behind = {t: (position[t], ends[t]) for t in topics if position[t] != ends[t]}
    assert not behind, f"follower stuck behind the log end: {behind}"


def test_a_consumer_long_poll_wakes_when_a_session_fetch_moves_the_hw(
    storage_node: StorageProcess,
) -> None:
    """A consumer waiting at the HW (RF=2) is answered when the follower's session fetch
    moves the HW, not at the end of its max_wait_ms."""
    stub = storage_node.stub
    topic = "hw-wake"
    _lead_with_follower_2(stub, topic)
    sid = session_fetch(stub, 0, 0, {topic: 0}).session_id
    assert code(append(stub, topic, encode_batch([b"x"]), acks=common_pb2.LEADER).error) == 0
    got = session_fetch(stub, sid, 1, {})  # the follower reads the record (HW still 0)
    assert got.partitions and got.partitions[0].records
    out: dict[str, object] = {}

    def poll() -> None:
        out["r"] = fetch_one(stub, topic, 0, max_wait_ms=60_000)

    t = threading.Thread(target=poll)
    t.start()
    time.sleep(0.5)
    session_fetch(stub, sid, 2, {topic: 1})  # the follower reports it holds offset 0
    t.join(20)
    assert not t.is_alive(), "the long poll did not wake when the HW moved"
    assert out["r"].records, out["r"]  # type: ignore[attr-defined]


def test_consumer_reads_during_roll_and_retention_serve_only_right_records(
    storage_node: StorageProcess,
) -> None:
    """Consumers reading at random offsets near the end while appends roll 1.5 KB
    segments and retention deletes them get whole batches at their offset, below the HW,
    with the values written there."""
    stub = storage_node.stub
    topic = "roll-and-retention"
    make_leader(
        stub,
        topic,
        configs={"segment.bytes": "1500", "retention.bytes": "4000", "file.delete.delay.ms": "0"},
    )
    written: dict[int, bytes] = {}
    lock = threading.Lock()
    stop = threading.Event()
    problems: list[str] = []
    served: list[int] = []  # (a reader that died of an exception would serve nothing)

    def producer() -> None:
        i = 0
        while not stop.is_set():
            n = random.randint(1, 4)
            values = [f"{i}-{k}".encode() * 10 for k in range(n)]
            r = append(stub, topic, encode_batch(values), acks=common_pb2.LEADER)
            if code(r.error) != ErrorCode.NONE:
                problems.append(f"append {r.error}")
                return
            with lock:
                for k, v in enumerate(values):
                    written[r.base_offset + k] = v
            i += 1

    def consumer() -> None:
        while not stop.is_set():
            with lock:
                hi = max(written, default=0)
            offset = random.randint(max(0, hi - 200), hi + 1)
            res = fetch_one(stub, topic, offset, max_wait_ms=random.choice([0, 50]))
            ec = code(res.error)
            if ec == ErrorCode.OFFSET_OUT_OF_RANGE:
                continue
            if ec != ErrorCode.NONE:
                problems.append(f"fetch {offset}: {res.error}")
                continue
            if not res.records:
                continue
            batches = decode_batches(res.records)
            served.append(offset)
            if not batches[0].base_offset <= offset <= batches[0].next_offset - 1:
                problems.append(f"fetch {offset}: first batch {batches[0].base_offset}")
            expect = batches[0].base_offset
            for b in batches:
                if b.base_offset != expect:
                    problems.append(f"gap at {expect}")
                expect = b.next_offset
                for rec in b.records:
                    with lock:
                        want = written.get(rec.offset)
                    if want is not None and rec.value != want:
                        problems.append(f"offset {rec.offset}: {rec.value!r} != {want!r}")
                if b.next_offset > res.high_watermark:
                    problems.append(f"batch past HW {b.next_offset} > {res.high_watermark}")
            if res.log_start_offset > offset:
                problems.append(f"served {offset} below log start {res.log_start_offset}")

    threads = [threading.Thread(target=producer)] + [
        threading.Thread(target=consumer) for _ in range(3)
    ]
    for t in threads:
        t.start()
    time.sleep(4)
    stop.set()
    for t in threads:
        t.join(30)
    assert not problems, problems[:10]
    assert len(served) > 10 and not any(t.is_alive() for t in threads)
    # The log did move its start (retention ran).
    assert list_offset(stub, topic, common_pb2.EARLIEST).offset > 0
