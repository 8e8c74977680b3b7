"""The checker fails each way it claims to: doctored histories, one fault each."""

from __future__ import annotations

import copy
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import pytest

from services.storage.log import Log, LogConfig
from tests.chaos.checker import Verdict, check
from tests.chaos.disk import replica_batches, segment_files
from tests.chaos.workload import History, make_value, parse_value
from tests.support.load import SteadyLoad
from tidelog.clock import ManualClock
from tidelog.producer import RecordMetadata
from tidelog.records import encode_batch


def _clean() -> tuple[
    History, dict[int, list[tuple[int, bytes]]], dict[int, dict[int, list[tuple[int, int, bytes]]]]
]:
    """Two writers, two partitions, every value acknowledged, read and replicated."""
    history = History()
    log: dict[int, list[tuple[int, bytes]]] = {0: [], 1: []}
    for seq in range(6):
        for writer in (0, 1):
            value = make_value(writer, seq)
            partition = (seq + writer) % 2
            offset = len(log[partition])
            log[partition].append((offset, value))
            history.acked[value] = (partition, offset)
            history.sent += 1
    history.reads["c0"] = [(p, o, v) for p, records in log.items() for o, v in records]
    replicas = {
        p: {b: [(o, o, v) for o, v in records] for b in (0, 1, 2)} for p, records in log.items()
    }
    return history, log, replicas


def _hw(log: dict[int, list[tuple[int, bytes]]]) -> dict[int, int]:
    return {p: len(records) for p, records in log.items()}


def test_values_round_trip_and_reject_damage() -> None:
    value = make_value(3, 41)
    assert parse_value(value) == (3, 41)
    assert parse_value(value[:-1] + b"x") is None
    assert parse_value(b"w3:41:00000000:") is None


def test_a_clean_history_passes() -> None:
    history, log, replicas = _clean()
    verdict = check(history, log, replicas, _hw(log))
    assert verdict.ok, verdict.summary()
    assert verdict.acked == 12 and verdict.reads == 12


def _damaged(kind: str) -> Verdict:
    history, log, replicas = _clean()
    log = copy.deepcopy(log)
    if kind == "lost":
        # The last record of partition 0 vanished (a truncated acknowledged write).
        log[0].pop()
        history.reads["c0"] = [r for r in history.reads["c0"] if (r[0], r[1]) != (0, 5)]
    elif kind == "duplicated":
        offset = len(log[1])
        log[1].append((offset, log[0][0][1]))
    elif kind == "gaps":
        offset, value = log[1][-1]
        log[1][-1] = (offset + 1, value)
    elif kind == "reordered":
        (o1, v1), (o2, v2) = log[0][0], log[0][2]  # same writer, two sequences apart
        log[0][0], log[0][2] = (o1, v2), (o2, v1)
    elif kind == "corrupt":
        offset, value = log[1][0]
        log[1][0] = (offset, value[:-1] + b"#")
    elif kind == "non_monotonic":
        history.reads["c1"] = [(0, 1, log[0][1][1]), (0, 0, log[0][0][1])]
    elif kind == "vanished_reads":
        history.reads["c1"] = [(1, 0, make_value(9, 9))]
    elif kind == "divergent":
        base, last, value = replicas[0][2][1]
        replicas[0][2][1] = (base, last, make_value(7, 7))
    return check(history, log, replicas, _hw(log))


@pytest.mark.parametrize(
    "kind",
    [
        "lost",
        "duplicated",
        "gaps",
        "reordered",
        "corrupt",
        "non_monotonic",
        "vanished_reads",
        "divergent",
    ],
)
def test_each_damage_is_reported(kind: str) -> None:
    verdict = _damaged(kind)
    assert not verdict.ok
    assert getattr(verdict, kind) > 0, verdict.summary()


def test_a_lagging_replica_is_a_prefix_not_a_divergence() -> None:
    history, log, replicas = _clean()
    replicas[0][1] = replicas[0][1][:2]
    assert check(history, log, replicas, _hw(log)).ok
    # In sync at the end (the run healed), it must hold all that is below the HW: a
    # replica that lost committed batches passed as "lagging" (found by an audit).
    assert check(history, log, replicas, _hw(log), in_sync=True).divergent == 1


def test_replicas_are_compared_with_the_longest_not_the_lowest_broker_id() -> None:
    """Brokers 1 and 2 differ below the HW; broker 0, the only reference before, holds
    nothing (or a short prefix), and an empty list is a prefix of anything (found by an
    audit)."""
    for kept in (0, 1):
        history, log, replicas = _clean()
        replicas[0][0] = replicas[0][0][:kept]
        base, last, _ = replicas[0][2][2]
        replicas[0][2][2] = (base, last, make_value(7, 7))
        assert check(history, log, replicas, _hw(log)).divergent == 1


def _write_segment(directory: Path, batches: int) -> None:
    log = Log.open(directory, LogConfig(), clock=ManualClock())
    try:
        for i in range(batches):
            log.append(encode_batch([make_value(0, i)], base_timestamp_ms=0))
        log.flush()
    finally:
        log.close()


def test_garbage_in_the_middle_of_an_in_sync_replica_is_divergence(tmp_path: Path) -> None:
    """Through ``replica_batches``, as the run reads replicas: three brokers' segments hold
    the same 6 batches; broker 2's batch at offset 2 is overwritten with garbage (what a
    recovery that wrongly kept a torn write would leave). Reading stops at the damage;
    the rest passed as a lagging prefix (found by an audit)."""
    for broker in (0, 1, 2):
        _write_segment(tmp_path / f"broker-{broker}" / "chaos-0", 6)
    (segment,) = segment_files(tmp_path / "broker-2", "chaos", 0)
    batches = replica_batches(tmp_path / "broker-0", "chaos", 0)
    assert [b[0] for b in batches] == list(range(6))
    data = bytearray(segment.read_bytes())
    start = sum(len(b[2]) for b in batches[:2])
    data[start + 20 : start + 40] = b"\xff" * 20  # inside batch 2
    segment.write_bytes(bytes(data))
    replicas = {0: {b: replica_batches(tmp_path / f"broker-{b}", "chaos", 0) for b in (0, 1, 2)}}
    assert len(replicas[0][2]) == 2  # only the batches before the damage
    history = History()
    log = {0: [(b[0], make_value(0, b[0])) for b in batches]}
    for offset, value in log[0]:
        history.acked[value] = (0, offset)
    verdict = check(history, log, replicas, {0: 6}, in_sync=True)
    assert verdict.divergent == 1, verdict.summary()


def test_the_e2e_load_does_not_collapse_two_acknowledgements_at_one_offset() -> None:
    """tests/support/load.py keyed acknowledgements by (partition, offset): a record
    acknowledged by a fenced leader and its successor's record acknowledged at the same
    offset became one entry, and the lost one was invisible (found by an audit)."""
    load = SteadyLoad(cast(Any, None), "t", 1)
    acked_at_0: list[Future[RecordMetadata]] = [Future(), Future()]
    for future in acked_at_0:
        future.set_result(RecordMetadata("t", 0, 0, 0))
    load.sent = [(0, b"0:A", acked_at_0[0]), (0, b"0:B", acked_at_0[1])]
    with pytest.raises(AssertionError, match="both acknowledged at"):
        load.acknowledged()
