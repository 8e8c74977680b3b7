"""The checker fails each way it claims to: doctored histories, one fault each. And the
harness around it (workload, nemesis, the drivers' verdicts) fails a run that lost data
or tested nothing: stand-in clients and processes, no cluster is started."""

from __future__ import annotations

import copy
import random
import subprocess
import sys
import tempfile
import time
import types
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar, cast

import pytest

import tests.chaos.__main__ as chaos_main
import tests.chaos.groups as chaos_groups
import tests.chaos.run as chaos_run
import tests.chaos.workload as chaos_workload
from services.storage.log import Log, LogConfig
from tests.chaos.checker import Verdict, check
from tests.chaos.cluster import Node
from tests.chaos.disk import replica_batches, segment_files
from tests.chaos.nemesis import Fault, Nemesis
from tests.chaos.run import MIN_ACKED, RunReport
from tests.chaos.workload import GATEWAY_BATCH, History, Workload, make_value, parse_value
from tests.support.load import SteadyLoad
from tidelog.clock import ManualClock
from tidelog.consumer import ConsumerRecord
from tidelog.errors import UnknownServerError
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


# --- consumers' reads: contiguous, and to the end --------------------------------------


def _log_of(values: list[bytes]) -> dict[int, list[tuple[int, bytes]]]:
    return {0: list(enumerate(values))}


def _acked_history(log: dict[int, list[tuple[int, bytes]]]) -> History:
    history = History()
    for partition, records in log.items():
        for offset, value in records:
            history.acked[value] = (partition, offset)
            history.sent += 1
    return history


def test_a_consumer_that_skips_a_committed_record_is_reported() -> None:
    """Partition 0 holds offsets 0, 1, 2 (all acknowledged, all committed). Consumer c0
    was handed 0 and then 2: record 1 never reached it (a consumer-side loss, e.g. a
    position advanced past a batch after a leader change). The topic has no compaction,
    no transactions and no retention in a run, and the reader starts at 0 and re-seeks to
    the next offset after each restart, so its reads of a partition must be contiguous.
    Strictly increasing offsets were all the checker asked for (found by an audit)."""
    values = [make_value(0, seq) for seq in range(3)]
    log = _log_of(values)
    history = _acked_history(log)
    history.reads["c0"] = [(0, 0, values[0]), (0, 2, values[2])]
    verdict = check(history, log, None, {0: 3}, in_sync=True)
    assert not verdict.ok, f"a consumer that skipped offset 1 passed: {verdict.summary()}"
    assert (verdict.skipped, verdict.stalled) == (1, 0), verdict.summary()
    # Nor may the first read be past the log's first offset.
    history.reads["c0"] = [(0, 1, values[1]), (0, 2, values[2])]
    assert check(history, log, None, {0: 3}).skipped == 1


def test_a_consumer_that_stalls_short_of_the_end_fails_the_run() -> None:
    """Consumer c1 stopped at offset 0 of 3 (a consumer hung after a failover, say) and
    never caught up. ``run._wait_consumers`` waited and returned quietly ("the checker
    then simply has fewer reads to check"), and the checker passed the run: a consumer
    that stops consuming for good was never reported (found by an audit)."""
    values = [make_value(0, seq) for seq in range(3)]
    log = _log_of(values)
    history = _acked_history(log)
    history.reads["c0"] = [(0, o, v) for o, v in log[0]]
    history.reads["c1"] = [(0, 0, values[0])]
    workload = types.SimpleNamespace(history=history)
    behind = chaos_run._wait_consumers(workload, {0: 3}, 0.3)  # type: ignore[arg-type]
    verdict = check(history, log, None, {0: 3}, in_sync=True)
    assert not verdict.ok, (
        f"consumer c1 read 1 of 3 records and stopped; the run passes: {verdict.summary()}"
    )
    assert behind == ["c1"]
    assert (verdict.stalled, verdict.skipped) == (1, 0), verdict.summary()
    # A run whose consumers are behind is not ok, whatever the checker found.
    report = RunReport(seed=1, rounds=1, negative_control=False, verdict=Verdict(acked=5000))
    report.faults["kill_leader"] = 1
    assert report.ok
    report.stalled_consumers = behind
    assert not report.ok


class _RestartingConsumer:
    """A consumer over a fixed log that fails every third poll (as under a fault), and
    reads from where it was ``seek``-ed, a few records a poll."""

    log: ClassVar[dict[int, list[tuple[int, bytes]]]] = {}
    polls = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.positions: dict[int, int] = {}

    def assign(self, tps: Any) -> None:
        pass

    def seek(self, tp: tuple[str, int], offset: int) -> None:
        self.positions[tp[1]] = offset

    def poll(self, timeout_ms: int = 0) -> list[ConsumerRecord]:
        _RestartingConsumer.polls += 1
        if _RestartingConsumer.polls % 3 == 0:
            raise UnknownServerError("the leader went away")
        records = []
        for partition, position in self.positions.items():
            batch = self.log[partition][position : position + 2]
            for offset, value in batch:
                records.append(ConsumerRecord("t", partition, offset, 0, None, value, ()))
            self.positions[partition] = position + len(batch)
        return records

    def close(self) -> None:
        pass


def test_a_restarted_reader_reads_on_contiguously_and_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The workload's reader as it runs: its consumer fails every third poll, and it starts
    a new one at the offset after the last record it was handed. Its reads are contiguous
    and reach the end: the checker's new rules hold for a legitimate history."""
    log = {p: [(o, make_value(p, o)) for o in range(20)] for p in (0, 1)}
    _RestartingConsumer.log = log
    _RestartingConsumer.polls = 0
    monkeypatch.setattr(chaos_workload, "Consumer", _RestartingConsumer)
    workload = Workload("127.0.0.1:1", "t", 2, writers=0, consumers=2).start()
    ends = {p: len(records) for p, records in log.items()}
    assert chaos_run._wait_consumers(workload, ends, 20.0) == []
    workload.stop_readers()
    history = workload.history
    assert history.consumer_errors > 0  # it did restart
    for value, where in ((value, (p, o)) for p, records in log.items() for o, value in records):
        history.acked[value] = where
    verdict = check(history, log, None, ends, in_sync=True)
    assert verdict.ok, verdict.summary()
    assert verdict.reads == 2 * 40


# --- the workload's threads --------------------------------------------------------------


class _BrokenProducer:
    """A producer whose sender thread has died (the SDK's ``_sender_failed``): every
    ``send``/``send_batch`` raises ``UnknownServerError`` at once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._group_min_partitions = 4

    def send(self, *args: Any, **kwargs: Any) -> Future[Any]:
        raise UnknownServerError("the producer's sender thread failed (RuntimeError('bug'))")

    def send_batch(self, *args: Any, **kwargs: Any) -> Future[Any]:
        raise UnknownServerError("the producer's sender thread failed (RuntimeError('bug'))")

    def close(self, timeout_s: float | None = None) -> None:
        pass


def test_a_writer_whose_sends_fail_at_once_keeps_to_its_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The writer loop ``continue``d past its rate limiter when ``send`` raised, so a
    producer that fails every send at once (broken for good) made the writer spin at CPU
    speed, filling ``history.failed`` with millions of "indeterminate" values (on a
    2-core chaos machine, starving the very cluster under test), and the run still
    passed: failed sends are never a failure (found by an audit). Now it keeps to its
    rate, and a writer that never had a value acknowledged fails the run."""
    monkeypatch.setattr(chaos_workload, "Producer", _BrokenProducer)
    workload = Workload("127.0.0.1:1", "t", 3, writers=1, consumers=0, rate_per_writer_s=200)
    workload.start()
    time.sleep(0.5)
    workload.stop_writers(flush_timeout_s=0)
    history = workload.history
    verdict = check(history, {p: [] for p in range(3)}, None, dict.fromkeys(range(3), 0))
    print(verdict.summary())
    # 200 values/s for 0.5 s is ~100 values (+ one batch of slack).
    assert history.sent <= 200 + GATEWAY_BATCH, (
        f"{history.sent} sends in 0.5 s at 200/s, {len(history.failed)} recorded failed; "
        f"the checker says ok={verdict.ok}"
    )
    assert history.sent > 0 and len(history.failed) == history.sent
    assert not verdict.ok and verdict.idle_writers == 1, verdict.summary()


def test_an_answer_the_workload_cannot_record_is_not_dropped_silently() -> None:
    """A ``send_batch`` answered with fewer metadata than values (an SDK bug the harness
    exists to catch): ``zip(strict=True)`` raised inside the future's done-callback,
    which ``concurrent.futures`` logs and swallows. The values ended up neither
    acknowledged nor failed and nothing told the run: the checker passed (found by an
    audit)."""
    workload = Workload("127.0.0.1:1", "t", 3, writers=0, consumers=0)
    values = [make_value(0, seq) for seq in range(GATEWAY_BATCH)]
    future: Future[Any] = Future()
    future.add_done_callback(workload._on_answer(values))
    future.set_result([RecordMetadata("t", 0, i, 0) for i in range(GATEWAY_BATCH - 1)])
    history = workload.history
    unaccounted = [v for v in values if v not in history.acked and v not in history.failed]
    assert not unaccounted, f"{len(unaccounted)} answered values neither acked nor failed"
    # None of them is taken as acknowledged on a wrong answer, and the run fails.
    assert not history.acked and len(history.thread_errors) == 1
    verdict = check(history, {0: []}, None, {0: 0})
    assert not verdict.ok and verdict.thread_errors == 1, verdict.summary()


class _Acking:
    """Gateway-path producer stand-in: acknowledges at once, at consecutive offsets of
    partition 0, and keeps what it 'wrote'; the direct one raises a non-SDK error (an SDK
    bug, e.g. a TypeError in a failover path)."""

    written: ClassVar[list[bytes]] = []

    def __init__(self, *args: Any, direct: bool = False, **kwargs: Any) -> None:
        self.direct = direct
        self._group_min_partitions = 4

    def send(self, topic: str, value: bytes, *args: Any, **kwargs: Any) -> Future[Any]:
        raise TypeError("'NoneType' object is not subscriptable")  # the bug

    def send_batch(self, topic: str, values: list[bytes], **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        metadata = []
        for value in values:
            metadata.append(RecordMetadata(topic, 0, len(_Acking.written), 0))
            _Acking.written.append(value)
        future.set_result(metadata)
        return future

    def close(self, timeout_s: float | None = None) -> None:
        pass


class _FailingConsumer:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def assign(self, tps: Any) -> None:
        pass

    def seek(self, tp: Any, offset: int) -> None:
        pass

    def poll(self, timeout_ms: int = 0) -> list[Any]:
        raise AttributeError("'NoneType' object has no attribute 'records'")  # the bug

    def close(self) -> None:
        pass


def test_a_workload_thread_killed_by_an_unexpected_error_fails_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The direct writer and both readers die at once of non-TidelogError exceptions (SDK
    bugs): the threads ended, the exception went to ``threading.excepthook`` (stderr) and
    nowhere else. Driven as ``run.py`` drives it, the run passed: the gateway writer's
    acknowledgements were all found, there were no reads to contradict anything, and
    ``acked > 1000`` in test_chaos.py held from the one surviving writer (found by an
    audit)."""
    _Acking.written = []
    monkeypatch.setattr(chaos_workload, "Producer", _Acking)
    monkeypatch.setattr(chaos_workload, "Consumer", _FailingConsumer)
    workload = Workload("127.0.0.1:1", "t", 1, writers=2, consumers=2, rate_per_writer_s=2000)
    workload.start()
    time.sleep(0.5)
    raised = None
    try:
        workload.stop_writers(flush_timeout_s=0)
        workload.stop_readers()
    except Exception as exc:  # any way of telling the run counts
        raised = exc
    final = {0: list(enumerate(_Acking.written))}
    verdict = check(workload.history, final, None, {0: len(_Acking.written)}, in_sync=True)
    print(verdict.summary())
    assert raised is not None or not verdict.ok, (
        f"the direct writer and both readers died of errors; the run passes: {verdict.summary()}"
    )
    errors = workload.history.thread_errors
    assert len(errors) == 3 and verdict.thread_errors == 3, errors
    assert any("chaos-writer-1" in e and "TypeError" in e for e in errors), errors


# --- the drivers' verdicts: a run that tested nothing ------------------------------------


def test_make_chaos_fails_a_safe_run_that_acknowledged_nothing_and_injected_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``python -m tests.chaos`` (``make chaos``, whose table goes into RELIABILITY.md)
    counted a safe seed bad only when ``report.ok`` was false: a seed whose writers never
    got an acknowledgement (e.g. every send failed) and whose faults were all skipped
    was a pass, "0 lost". Only ``test_chaos.py`` guarded the same run with ``acked >
    1000`` and ``faults >= 8``; the long runs had no such floor (found by an audit)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def vacuous(base: Path, seed: int, rounds: int, **kwargs: Any) -> RunReport:
        verdict = Verdict(acked=0, sent=50_000, failed=50_000)
        report = RunReport(seed=seed, rounds=rounds, negative_control=False, verdict=verdict)
        report.skipped.update({"partition_broker": rounds, "disk_error": rounds})
        return report

    monkeypatch.setattr(chaos_main, "run_chaos", vacuous)
    status = chaos_main.main(["--seeds", "1", "--negative-seeds", ""])
    assert status == 1, "a chaos run with 0 acknowledged records and 0 faults passed"


def test_a_run_report_holds_the_floors() -> None:
    """Each floor on its own: enough acknowledged, at least ``min_faults`` applied."""
    report = RunReport(seed=1, rounds=1, negative_control=False, verdict=Verdict(acked=MIN_ACKED))
    report.min_faults = 2
    report.faults["kill_leader"] = 2
    assert report.ok, report.describe()
    report.faults["kill_leader"] = 1
    assert not report.ok
    report.faults["kill_leader"] = 2
    report.verdict.acked = MIN_ACKED - 1
    assert not report.ok


def test_group_chaos_fails_a_run_that_acknowledged_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``python -m tests.chaos.groups`` (``make chaos``'s group runs) likewise: a run whose
    producer thread died at once (0 acknowledged, so nothing can be "unprocessed") and
    whose commit history could not be replayed (0 commits) printed ok and exited 0
    (found by an audit)."""

    def vacuous(*args: Any, **kwargs: Any) -> chaos_groups.GroupChaosReport:
        return chaos_groups.GroupChaosReport(acked=0, commits_replayed=0, convergence_s=[0.5])

    monkeypatch.setattr(chaos_groups, "run_group_chaos", vacuous)
    status = chaos_groups.main(["--base", str(tmp_path), "--seeds", "1", "--mode", "manual"])
    assert status == 1, "a group chaos run with 0 acknowledged records passed"
    full = chaos_groups.GroupChaosReport(acked=10, commits_replayed=3, convergence_s=[0.5])
    full.faults["members"] = 1
    assert full.ok
    for acked, commits in ((0, 3), (10, 0)):
        report = chaos_groups.GroupChaosReport(
            acked=acked, commits_replayed=commits, convergence_s=[0.5]
        )
        report.faults["members"] = 1
        assert not report.ok
    full.faults["members"] = 0
    assert not full.ok


# --- a node that crashed by itself, then killed by the next fault ------------------------


class _Proc:
    """The part of ``TidelogProcess`` that ``Node`` uses, over a trivial real process."""

    def __init__(self, code: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", code])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(10)


class _Etcd:
    def is_running(self) -> bool:
        return True


class _Cluster:
    """Three broker ``Node``s over stand-in processes; healthy whenever asked."""

    network = None

    def __init__(self, tmp: Path) -> None:
        self.etcd = _Etcd()
        self.controllers: dict[int, Node] = {}
        self.brokers = {b: Node(f"broker-{b}", [], tmp, None) for b in (0, 1, 2)}
        for b in self.brokers:
            self.start_broker(b)

    def start_broker(self, broker_id: int, wrapper: Any = ()) -> None:
        self.brokers[broker_id].process = _Proc("import time; time.sleep(120)")  # type: ignore[assignment]

    def wait_healthy(self, topic: str, timeout_s: float) -> bool:
        return True

    def leader_of(self, topic: str, partition: int) -> int:
        return 1

    def close(self) -> None:
        for node in self.brokers.values():
            node.kill()


@pytest.mark.parametrize("kind", ["kill_all_brokers", "kill_leader"])
def test_a_broker_that_crashed_before_a_fault_killing_it_fails_the_run(
    tmp_path: Path, kind: str
) -> None:
    """Broker 1 exits by itself (status 1: a crash of the product), e.g. while the last
    heal waited (that heal then just counts "not healed in time", which fails nothing).
    The next fault kills it: ``Node.kill`` does nothing to an exited process, the fault
    restarted it, and ``heal()`` found it running. The crash was never recorded, and the
    run passed: only a crash found after the fault (by ``heal``) failed the run (found by
    an audit)."""
    cluster = _Cluster(tmp_path)
    try:
        crashed = cluster.brokers[1]
        crashed.kill()
        exited = _Proc("raise SystemExit(1)")
        exited.proc.wait(10)
        crashed.process = exited  # type: ignore[assignment]
        assert not crashed.running
        nemesis = Nemesis(cluster, "chaos", 1)  # type: ignore[arg-type]
        log = nemesis.run([Fault(kind, partition=0, broker=1, duration_s=0.0, number=20)])
        assert log.applied[kind] == 1
        assert log.unexpected_exits, (
            f"broker 1 exited 1 by itself before {kind}; the run records no crash: {log.lines}"
        )
        assert log.unexpected_exits == ["broker 1 exited by itself (status 1)"], log.lines
        assert all(node.running for node in cluster.brokers.values())
    finally:
        cluster.close()


def test_a_group_member_that_crashed_before_a_fault_killing_it_fails_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The group runs' ``members`` fault likewise: a member that had exited by itself was
    sent SIGKILL, "waited for" and restarted, and its crash never seen; a gateway or etcd
    the same way (found by an audit)."""
    run = object.__new__(chaos_groups._Run)
    sleeping = "import time; time.sleep(120)"
    run.members = {i: subprocess.Popen([sys.executable, "-c", sleeping]) for i in (1, 2)}
    run.members[0] = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    run.members[0].wait(10)  # member 0 crashed (status 1)
    run.gateways = []
    run.cluster = types.SimpleNamespace(etcd=_Etcd())  # type: ignore[assignment]
    run.unexpected_exits = []
    started: list[int] = []

    def start_member(i: int) -> None:
        started.append(i)
        run.members[i] = subprocess.Popen([sys.executable, "-c", sleeping])

    monkeypatch.setattr(run, "start_member", start_member)
    try:
        run.inject("members", _Draws(0))  # the fault hits member 0
        assert run.unexpected_exits == ["member 0 (status 1)"], run.unexpected_exits
        assert started == [0, 0]  # found and restarted, then killed and restarted
        assert all(p.poll() is None for p in run.members.values())
    finally:
        for process in run.members.values():
            process.kill()
            process.wait(10)


class _Draws(random.Random):
    """A ``Random`` whose ``randrange`` answers ``value``, and ``uniform`` 0 (no waits)."""

    def __init__(self, value: int) -> None:
        super().__init__(0)
        self.value = value

    def randrange(self, *args: Any, **kwargs: Any) -> int:
        return self.value

    def uniform(self, a: float, b: float) -> float:
        return 0.0
