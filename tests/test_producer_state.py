"""Idempotent producers (``services.storage.log.producer_state``) through ``Log.append``.

Retried batches are answered with their original offsets and written once; gaps,
reorderings and fenced epochs are refused before anything is written; the state survives
clean restarts, crashes with and without snapshots, truncation and retention; followers
build the same state as their leader, so a new leader dedupes retries of what the old one
acknowledged. A hypothesis test drives a log and a plain dict model side by side.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.storage.log import AppendInfo, Log, LogConfig
from services.storage.log.errors import ProducerSnapshotCorruptError
from services.storage.log.producer_state import (
    BatchMetadata,
    ProducerStateEntry,
    ProducerStateManager,
    decode_snapshot,
    encode_snapshot,
    last_sequence,
    snapshot_path,
)
from tidelog import formats as f
from tidelog.batch import crc32c, stamp
from tidelog.clock import ManualClock
from tidelog.errors import (
    DuplicateSequenceError,
    InvalidProducerEpochError,
    InvalidRecordError,
    OutOfOrderSequenceError,
)
from tidelog.records import decode_batches, encode_batch

T0 = 1_700_000_000_000
BIG = 1 << 30
DAY_MS = 24 * 60 * 60 * 1000
MAX_SEQ = f.MAX_SEQUENCE


def idem(pid: int, epoch: int, seq: int, n: int = 2, tag: int = 0) -> bytes:
    values = [bytes([(tag + i) % 251]) * 20 for i in range(n)]
    return encode_batch(
        values,
        timestamps_ms=[T0] * n,
        producer_id=pid,
        producer_epoch=epoch,
        base_sequence=seq,
    )


def plain(n: int = 2) -> bytes:
    return encode_batch([b"x" * 20] * n, timestamps_ms=[T0] * n)


def open_log(directory: Path, config: LogConfig | None = None, **kwargs: object) -> Log:
    kwargs.setdefault("clock", ManualClock())
    kwargs.setdefault("rng", random.Random(0))
    return Log.open(directory, config or LogConfig(), **kwargs)  # type: ignore[arg-type]


def dir_state(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def read_all(log: Log) -> bytes:
    out, offset = [], log.log_start_offset
    while offset < log.log_end_offset:
        data = log.read(offset, BIG)
        out.append(data)
        offset = decode_batches(data)[-1].next_offset
    return b"".join(out)


def state_of(log: Log) -> dict[int, tuple[int, list[BatchMetadata]]]:
    """The comparable part of the producer state (not the last-update times)."""
    return {
        pid: (entry.producer_epoch, list(entry.batches))
        for pid, entry in log.producer_state.producers.items()
    }


def follower_copy(leader: Log, follower: Log) -> None:
    while follower.log_end_offset < leader.log_end_offset:
        follower.append(leader.read(follower.log_end_offset, BIG), assign_offsets=False)


def restamped(raw: bytes, offset: int, epoch: int = 0) -> bytes:
    """A batch as a leader would have stored it (for follower appends of crafted state)."""
    buf = bytearray(raw)
    stamp(buf, 0, offset, epoch)
    return bytes(buf)


# --- sequences, duplicates, epochs --------------------------------------------------------------


def test_in_sequence_batches_and_the_last_five(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    seq = 0
    for i in range(7):
        info = log.append(idem(1, 0, seq, n=2, tag=i))
        assert info == AppendInfo(2 * i, 2 * i + 1) and not info.duplicate
        seq += 2
    entry = log.producer_state.entry(1)
    assert entry is not None
    assert entry.producer_epoch == 0
    assert list(entry.batches) == [
        BatchMetadata(2 * i, 2 * i + 1, 2 * i, 2 * i + 1) for i in range(2, 7)
    ]
    assert (entry.last_sequence, entry.last_offset) == (13, 13)
    log.close()


def test_duplicates_return_the_original_offsets_and_write_nothing(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    log.append(plain(3))  # offsets 0-2 belong to someone else
    originals = [log.append(idem(7, 2, 3 * i, n=3, tag=i)) for i in range(6)]
    before, end = dir_state(log.dir), log.log_end_offset
    # The last five batches are remembered: each retry gets its own offsets back.
    for i in range(1, 6):
        retry = log.append(idem(7, 2, 3 * i, n=3, tag=i))
        assert retry == AppendInfo(originals[i].first_offset, originals[i].last_offset, True)
        assert retry.duplicate
    assert dir_state(log.dir) == before
    assert log.log_end_offset == end
    # The sixth-newest was forgotten: a duplicate at unknown offsets below the oldest
    # remembered batch, not written.
    assert log.append(idem(7, 2, 0, n=3)) == AppendInfo(-1, originals[1].first_offset - 1, True)
    # A retry as the leader of a later epoch is still a duplicate (the partition's epoch
    # has nothing to do with the producer's).
    assert log.append(idem(7, 2, 15, n=3, tag=5), leader_epoch=9).duplicate
    assert dir_state(log.dir) == before
    log.close()


def test_out_of_order_sequences(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    log.append(idem(1, 0, 0, n=3))  # sequences 0-2
    before = dir_state(log.dir)
    for seq in (4, 2, 1, 100, MAX_SEQ):
        with pytest.raises(OutOfOrderSequenceError, match="expected sequence 3"):
            log.append(idem(1, 0, seq, n=1))
    # A batch overlapping the last one without matching it exactly is not a duplicate.
    with pytest.raises(OutOfOrderSequenceError):
        log.append(idem(1, 0, 1, n=2))
    assert dir_state(log.dir) == before
    assert log.append(idem(1, 0, 3, n=1)) == AppendInfo(3, 3)
    log.close()


def test_an_unknown_producer_starts_at_any_sequence(tmp_path: Path) -> None:
    """KIP-360: a producer this partition does not know (never seen, expired, truncated
    away) is taken at whatever sequence it is at; from then on the usual rules hold."""
    log = open_log(tmp_path / "p-0")
    assert log.append(idem(5, 0, 9)) == AppendInfo(0, 1)
    assert log.append(idem(6, 3, 0)) == AppendInfo(2, 3)  # any epoch, any sequence
    with pytest.raises(OutOfOrderSequenceError, match="expected sequence 11"):
        log.append(idem(5, 0, 12))
    assert log.append(idem(5, 0, 11)) == AppendInfo(4, 5)
    log.close()


def test_producer_epochs(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    log.append(idem(1, 4, 0))
    log.append(idem(1, 4, 2))
    before = dir_state(log.dir)
    with pytest.raises(InvalidProducerEpochError):
        log.append(idem(1, 3, 4))  # a zombie of an older instance
    with pytest.raises(InvalidProducerEpochError):
        log.append(idem(1, 3, 0))  # even a duplicate-looking one
    with pytest.raises(OutOfOrderSequenceError, match="new epoch must start at sequence 0"):
        log.append(idem(1, 5, 4))
    assert dir_state(log.dir) == before
    # A newer epoch restarts the sequence at 0 and forgets the old epoch's batches.
    assert log.append(idem(1, 5, 0, n=1)) == AppendInfo(4, 4)
    entry = log.producer_state.entry(1)
    assert entry is not None
    assert entry.producer_epoch == 5
    assert list(entry.batches) == [BatchMetadata(0, 0, 4, 4)]
    with pytest.raises(InvalidProducerEpochError):
        log.append(idem(1, 4, 4))
    assert log.append(idem(1, 5, 0, n=1)).duplicate
    assert log.append(idem(1, 5, 1, n=1)) == AppendInfo(5, 5)
    log.close()


def test_sequence_wraparound(tmp_path: Path) -> None:
    assert last_sequence(MAX_SEQ - 2, 2) == MAX_SEQ
    assert last_sequence(MAX_SEQ - 1, 2) == 0
    assert last_sequence(MAX_SEQ, 3) == 2
    log = open_log(tmp_path / "p-0")
    # Reaching the top of the sequence space takes 2^31 records; a follower append (not
    # validated) puts the producer there.
    log.append(restamped(idem(3, 1, MAX_SEQ - 2, n=2), 0), assign_offsets=False)
    entry = log.producer_state.entry(3)
    assert entry is not None and entry.last_sequence == MAX_SEQ - 1
    # A batch across the wrap: sequences MAX, 0, 1.
    assert log.append(idem(3, 1, MAX_SEQ, n=3)) == AppendInfo(2, 4)
    assert log.producer_state.entry(3).last_sequence == 1  # type: ignore[union-attr]
    assert log.append(idem(3, 1, MAX_SEQ, n=3)).duplicate
    with pytest.raises(OutOfOrderSequenceError, match="expected sequence 2"):
        log.append(idem(3, 1, 3, n=1))
    assert log.append(idem(3, 1, 2, n=1)) == AppendInfo(5, 5)
    # Exactly at the top: MAX is followed by 0.
    other = open_log(tmp_path / "q-0")
    other.append(restamped(idem(4, 0, MAX_SEQ - 1, n=2), 0), assign_offsets=False)
    with pytest.raises(OutOfOrderSequenceError, match="expected sequence 0"):
        other.append(idem(4, 0, 1, n=1))
    assert other.append(idem(4, 0, 0, n=1)) == AppendInfo(2, 2)
    log.close()
    other.close()


def test_the_batch_after_the_wrap_is_written_not_taken_for_an_old_duplicate(
    tmp_path: Path,
) -> None:
    """A producer that started at sequence 0 and reached the top: its next batch, at 0,
    lies numerically below the remembered window (and not below its start sequence), but
    it is the next batch, not a resend of the first one. Taking it for a duplicate would
    drop it while telling the producer it was written."""
    log = open_log(tmp_path / "p-0")
    log.append(restamped(idem(3, 0, 0, n=1), 0), assign_offsets=False)
    for k in range(5):  # sequences MAX-9 .. MAX, as a follower copied them
        first = MAX_SEQ - 9 + 2 * k
        log.append(restamped(idem(3, 0, first, n=2), log.log_end_offset), assign_offsets=False)
    entry = log.producer_state.entry(3)
    assert entry is not None and entry.start_sequence == 0 and entry.last_sequence == MAX_SEQ
    assert log.append(idem(3, 0, 0, n=2)) == AppendInfo(11, 12)
    assert log.log_end_offset == 13
    log.close()


def test_a_follower_takes_even_an_older_epoch_from_its_leader(tmp_path: Path) -> None:
    """The leader validated the batch (it had forgotten the producer, KIP-360), so the
    follower mirrors it: the older epoch replaces the remembered one, as in Kafka."""
    follower = open_log(tmp_path / "p-0")
    for batch in (idem(7, 5, 0), idem(7, 3, 10)):
        follower.append(restamped(batch, follower.log_end_offset), assign_offsets=False)
    entry = follower.producer_state.entry(7)
    assert entry is not None
    assert (entry.producer_epoch, entry.start_sequence) == (3, 10)
    assert list(entry.batches) == [BatchMetadata(10, 11, 2, 3)]
    follower.close()


@pytest.mark.parametrize(("epoch", "seq"), [(-1, 0), (0, -1), (-1, -1)])
def test_idempotent_batch_needs_epoch_and_sequence(tmp_path: Path, epoch: int, seq: int) -> None:
    log = open_log(tmp_path / "p-0")
    with pytest.raises(InvalidRecordError):
        log.append(idem(1, epoch, seq))
    assert log.log_end_offset == 0
    log.close()


def test_non_idempotent_batches_are_not_tracked(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    for _ in range(3):
        log.append(plain())
    assert len(log.producer_state) == 0
    assert log.log_end_offset == 6
    log.close()


# --- requests of several batches ----------------------------------------------------------------


def test_multi_batch_requests(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    # Batches of one producer continue each other within a request; others mix in.
    info = log.append(idem(1, 0, 0) + plain(1) + idem(1, 0, 2) + idem(2, 0, 0))
    assert info == AppendInfo(0, 6)
    assert log.producer_state.entry(1).last_sequence == 3  # type: ignore[union-attr]
    before, end = dir_state(log.dir), log.log_end_offset
    # One bad batch anywhere: nothing is written, not even the good ones before it.
    bad_requests: list[tuple[bytes, type[Exception]]] = [
        (idem(1, 0, 4) + idem(1, 0, 7), OutOfOrderSequenceError),
        (idem(1, 0, 4) + idem(2, 0, 5), OutOfOrderSequenceError),
        (plain() + idem(2, 0, 2) + idem(1, 0, 4) + idem(1, 0, 9), OutOfOrderSequenceError),
        (idem(1, 0, 4) + idem(1, 0, 4), OutOfOrderSequenceError),  # repeated inside
        (idem(1, 1, 0) + idem(1, 0, 6), InvalidProducerEpochError),  # bump, then old epoch
        (idem(2, 0, 2) + idem(2, -1, 4), InvalidRecordError),
        # A retry mixed with a new batch: not answerable with one offset range.
        (idem(1, 0, 2) + idem(1, 0, 4), DuplicateSequenceError),
        (idem(1, 0, 2) + plain(), DuplicateSequenceError),
    ]
    for request, error in bad_requests:
        with pytest.raises(error):
            log.append(request)
        assert dir_state(log.dir) == before
        assert log.log_end_offset == end
    # A request of retried batches only: the span of the originals.
    assert log.append(idem(1, 0, 0) + idem(1, 0, 2)) == AppendInfo(0, 4, True)
    assert log.append(idem(1, 0, 2) + idem(2, 0, 0)) == AppendInfo(3, 6, True)
    # An epoch bump inside a request: the next batch continues the new epoch.
    assert log.append(idem(1, 1, 0) + idem(1, 1, 2, n=1)) == AppendInfo(7, 9)
    assert log.producer_state.entry(1).producer_epoch == 1  # type: ignore[union-attr]
    assert dir_state(log.dir) != before
    log.close()


# --- followers and failover -------------------------------------------------------------------


def test_follower_builds_the_leaders_state_and_dedupes_after_failover(tmp_path: Path) -> None:
    config = LogConfig(segment_bytes=700)
    leader = open_log(tmp_path / "leader-0", config)
    follower = open_log(tmp_path / "follower-0", config)
    acked: dict[tuple[int, int], AppendInfo] = {}
    seqs = {1: 0, 2: 0, 3: 0}
    rng = random.Random(5)
    for i in range(30):
        pid = rng.choice([1, 2, 3])
        n = rng.randint(1, 3)
        acked[(pid, seqs[pid])] = leader.append(idem(pid, 0, seqs[pid], n, tag=i), 1)
        seqs[pid] += n
        if rng.random() < 0.3:
            follower_copy(leader, follower)
    follower_copy(leader, follower)
    assert state_of(follower) == state_of(leader)
    assert read_all(follower) == read_all(leader)
    # The follower becomes leader (epoch 2); producers retry what the old leader acked.
    follower.assign_epoch_start_offset(2)
    end = follower.log_end_offset
    for pid in (1, 2, 3):
        entry = leader.producer_state.entry(pid)
        assert entry is not None
        for batch in entry.batches:
            n = batch.last_offset - batch.first_offset + 1
            retry = follower.append(idem(pid, 0, batch.first_sequence, n), 2)
            assert retry == AppendInfo(batch.first_offset, batch.last_offset, True)
            assert tuple(acked[(pid, batch.first_sequence)]) == tuple(retry)
    assert follower.log_end_offset == end
    # And the sequences continue where the old leader left them.
    with pytest.raises(OutOfOrderSequenceError):
        follower.append(idem(1, 0, seqs[1] + 1), 2)
    assert follower.append(idem(1, 0, seqs[1]), 2).first_offset == end
    # The restarted follower's state comes back from its snapshots and log.
    follower.close()
    again = open_log(tmp_path / "follower-0", config)
    assert again.log_end_offset == end + 2
    assert again.append(idem(1, 0, seqs[1]), 2) == AppendInfo(end, end + 1, True)
    leader.close()
    again.close()


# --- persistence --------------------------------------------------------------------------------


def populate(log: Log, rounds: int, seed: int = 0) -> None:
    """Idempotent batches of a few producers (with an epoch bump) plus plain ones."""
    rng = random.Random(seed)
    seqs: dict[int, list[int]] = {}
    for i in range(rounds):
        pid = rng.choice([10, 11, 12, 13])
        epoch, seq = seqs.setdefault(pid, [0, 0])
        if rng.random() < 0.05:
            epoch, seq = epoch + 1, 0
        n = rng.randint(1, 4)
        log.append(idem(pid, epoch, seq, n, tag=i) + (plain(1) if rng.random() < 0.3 else b""))
        seqs[pid] = [epoch, seq + n]


def snapshots(directory: Path) -> list[int]:
    return sorted(int(p.name.split(".")[0]) for p in directory.glob("*.snapshot"))


def test_clean_reopen_uses_the_close_snapshot(tmp_path: Path) -> None:
    directory = tmp_path / "p-0"
    log = open_log(directory)
    populate(log, 40)
    expected, end = state_of(log), log.log_end_offset
    log.close()
    assert end in snapshots(directory)
    reopened = open_log(directory, recovery_point=end)
    assert state_of(reopened) == expected
    # Replaying no headers: the state's times are the ones saved (not "now").
    assert reopened.producer_state.end_offset == end
    reopened.close()


def test_crash_without_any_snapshot_replays_the_log(tmp_path: Path) -> None:
    directory = tmp_path / "p-0"
    log = open_log(directory)  # one segment: no roll, so no snapshot
    populate(log, 40)
    expected = state_of(log)
    crashed = tmp_path / "crashed" / "p-0"
    shutil.copytree(directory, crashed)
    log.close()
    assert snapshots(crashed) == []
    reopened = open_log(crashed)
    assert state_of(reopened) == expected
    reopened.close()


def test_crash_with_snapshot_plus_tail(tmp_path: Path) -> None:
    config = LogConfig(segment_bytes=900)
    directory = tmp_path / "p-0"
    log = open_log(directory, config)
    populate(log, 80)
    assert log.segment_count > 3
    expected, end = state_of(log), log.log_end_offset
    crashed = tmp_path / "crashed" / "p-0"
    shutil.copytree(directory, crashed)
    log.close()
    taken = snapshots(crashed)
    assert taken and taken[-1] == log.segment_base_offsets[-1] < end
    # One snapshot per segment after the first (taken as each was rolled in).
    assert taken == log.segment_base_offsets[1:]
    reopened = open_log(crashed, config)
    assert state_of(reopened) == expected
    reopened.close()


def test_a_truncation_into_an_old_segment_after_retention_keeps_the_leaders_producers(
    tmp_path: Path,
) -> None:
    """Retention deleted every batch of a quiet producer; a replica then truncates into
    its oldest remaining segment (a divergence) and copies the leader again. Its state
    still knows that producer, as the leader's does, because a snapshot is kept at every
    segment base: rebuilt from the log start (only the two newest segments had one), it
    forgot it, and after a failover there a retry of its last batch was written twice
    (found by an audit)."""
    config = LogConfig(segment_bytes=600, retention_bytes=2000)
    leader = open_log(tmp_path / "leader" / "p-0", config)
    follower = open_log(tmp_path / "follower" / "p-0", config)
    assert not leader.append(idem(7, 0, 0), 1).duplicate  # then producer 7 goes quiet
    seq = 0
    for i in range(40):
        leader.append(idem(9, 0, seq, tag=i), 1)
        seq += 2
    follower_copy(leader, follower)
    for log in (leader, follower):
        log.delete_retention_segments(high_watermark=leader.log_end_offset)
    assert follower.log_start_offset > 1  # producer 7's batch is gone from both logs
    assert follower.segment_count > 3
    follower.truncate_to(follower.segment_base_offsets[0] + 2)
    follower_copy(leader, follower)
    assert state_of(follower) == state_of(leader)
    # The replica leads now: producer 7's retry of its batch is known as written.
    assert follower.append(idem(7, 0, 0), 2).duplicate
    leader.close()
    follower.close()


def test_snapshot_above_the_recovered_end_is_ignored_and_deleted(tmp_path: Path) -> None:
    config = LogConfig(segment_bytes=900)
    directory = tmp_path / "p-0"
    log = open_log(directory, config)
    populate(log, 60)
    active = log.segment_base_offsets[-1]
    log.flush()
    # State as of the active segment's base: replay a second log to it.
    reference = open_log(tmp_path / "reference-0")
    reference.append(log.read(0, BIG, max_offset=active), assign_offsets=False)
    while reference.log_end_offset < active:
        reference.append(log.read(reference.log_end_offset, BIG), assign_offsets=False)
    log.close()  # writes a snapshot at the log end
    end = log.log_end_offset
    assert end in snapshots(directory)
    # The active segment's data is lost (an unflushed tail after a power cut).
    with open(directory / f"{active:020d}.log", "r+b") as data:
        data.truncate(0)
    reopened = open_log(directory, config)
    assert reopened.log_end_offset == active
    assert end not in snapshots(directory)
    assert state_of(reopened) == state_of(reference)
    reopened.close()
    reference.close()


def test_corrupt_snapshots_fall_back(tmp_path: Path) -> None:
    config = LogConfig(segment_bytes=900)
    directory = tmp_path / "p-0"
    log = open_log(directory, config)
    populate(log, 60)
    expected = state_of(log)
    log.close()
    for offset in snapshots(directory):  # damage every snapshot in a different way
        path = directory / f"{offset:020d}.snapshot"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    reopened = open_log(directory, config)
    assert state_of(reopened) == expected  # rebuilt from the whole log
    assert snapshots(directory) == []  # the damaged ones were deleted
    reopened.close()
    assert snapshots(directory) == [reopened.log_end_offset]


def test_truncation_rebuilds_the_state(tmp_path: Path) -> None:
    config = LogConfig(segment_bytes=900)
    log = open_log(tmp_path / "p-0", config)
    reference = open_log(tmp_path / "reference-0")
    populate(log, 70)
    everything = read_all(log)
    batches = decode_batches(everything)
    for cut in (batches[-1].base_offset, batches[len(batches) // 2].base_offset + 1, 3, 0):
        log.truncate_to(cut)
        assert all(s <= log.log_end_offset for s in snapshots(log.dir))
        # The reference: a fresh log given exactly the surviving batches.
        reference.truncate_fully_and_start_at(0)
        follower_copy(log, reference)
        assert state_of(log) == state_of(reference), cut
    # A producer's batch lost by truncation is written again when retried.
    log.append(idem(10, 0, 0, 2))
    assert log.append(idem(10, 0, 0, 2)).duplicate
    log.truncate_to(0)
    assert not log.append(idem(10, 0, 0, 2)).duplicate
    log.close()
    reference.close()


def test_truncate_fully_clears_state_and_snapshots(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0", LogConfig(segment_bytes=900))
    populate(log, 50)
    assert snapshots(log.dir)
    log.truncate_fully_and_start_at(1000)
    assert len(log.producer_state) == 0
    assert snapshots(log.dir) == []
    # Forgotten with the log: taken again at whatever sequence it is at (KIP-360).
    assert log.append(idem(10, 0, 5)) == AppendInfo(1000, 1001)
    log.close()


def test_retention_keeps_producers_but_drops_old_snapshots(tmp_path: Path) -> None:
    config = LogConfig(segment_bytes=900, retention_bytes=1800)
    log = open_log(tmp_path / "p-0", config)
    populate(log, 60)
    expected = state_of(log)
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) > 0
    assert all(s >= log.log_start_offset for s in snapshots(log.dir))
    assert state_of(log) == expected  # forgotten by expiry only (KIP-360)
    log.close()
    reopened = open_log(tmp_path / "p-0", config)
    assert state_of(reopened) == expected
    reopened.close()


def test_expiry(tmp_path: Path) -> None:
    clock = ManualClock()
    log = open_log(tmp_path / "p-0", clock=clock)
    log.append(idem(1, 0, 0))
    clock.advance(DAY_MS // 2)
    log.append(idem(2, 0, 0))
    clock.advance(DAY_MS // 2 - 1)
    assert log.remove_expired_producers() == 0
    clock.advance(1)
    assert log.remove_expired_producers() == 1
    assert log.producer_state.entry(1) is None
    assert log.producer_state.entry(2) is not None
    # An expired producer is unknown: its next batch is taken at its sequence (KIP-360),
    # not refused for not starting at 0, which failed a quiet producer's next send.
    assert log.append(idem(1, 0, 2)) == AppendInfo(4, 5)
    assert log.append(idem(2, 0, 2)) == AppendInfo(6, 7)
    assert log.remove_expired_producers(expiration_ms=0) == 2
    log.close()


def test_expiry_counts_from_a_producers_latest_batch_not_its_first(tmp_path: Path) -> None:
    clock = ManualClock()
    log = open_log(tmp_path / "p-0", clock=clock)
    log.append(idem(1, 0, 0))
    clock.advance(DAY_MS - 1)
    log.append(idem(1, 0, 2))  # heard from again just before a day passed
    clock.advance(DAY_MS - 1)
    assert log.remove_expired_producers() == 0
    clock.advance(1)
    assert log.remove_expired_producers() == 1
    log.close()


def test_old_record_timestamps_do_not_expire_a_producer(tmp_path: Path) -> None:
    clock = ManualClock()
    log = open_log(tmp_path / "p-0", clock=clock)
    old = encode_batch(
        [b"v"], timestamps_ms=[T0 - 30 * DAY_MS], producer_id=1, producer_epoch=0, base_sequence=0
    )
    log.append(old)
    assert log.remove_expired_producers() == 0
    log.close()


# --- the snapshot format ---------------------------------------------------------------------


def sample_entries() -> list[ProducerStateEntry]:
    first = ProducerStateEntry(5, 2, T0, 0)
    first.batches.extend([BatchMetadata(0, 2, 10, 12), BatchMetadata(3, 3, 20, 20)])
    second = ProducerStateEntry(1, 0, T0 + 7, MAX_SEQ)
    second.batches.append(BatchMetadata(MAX_SEQ, 1, 30, 32))
    return [first, second]


def test_snapshot_round_trip() -> None:
    data = encode_snapshot(40, sample_entries())
    assert len(data) == 18 + 2 * 24 + 3 * 24
    decoded = decode_snapshot(data, 40)
    assert sorted(decoded) == [1, 5]
    assert list(decoded[5].batches) == list(sample_entries()[0].batches)
    assert (decoded[1].producer_epoch, decoded[1].last_update_ms) == (0, T0 + 7)
    assert (decoded[5].start_sequence, decoded[1].start_sequence) == (0, MAX_SEQ)
    assert decode_snapshot(encode_snapshot(0, []), 0) == {}


def test_every_bit_flip_in_a_snapshot_is_detected() -> None:
    data = encode_snapshot(40, sample_entries())
    for bit in range(len(data) * 8):
        damaged = bytearray(data)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ProducerSnapshotCorruptError):
            decode_snapshot(bytes(damaged), 40)


@pytest.mark.parametrize("cut", [0, 5, 17, 18, 30, -1])
def test_truncated_or_misnamed_snapshots_are_detected(cut: int) -> None:
    data = encode_snapshot(40, sample_entries())
    with pytest.raises(ProducerSnapshotCorruptError):
        decode_snapshot(data[:cut], 40)
    with pytest.raises(ProducerSnapshotCorruptError):
        decode_snapshot(data, 41)  # renamed: the offset inside disagrees


def resealed(data: bytes) -> bytes:
    """``data`` with its header checksum recomputed: a snapshot that is consistent as
    bytes, whatever it says."""
    header = f.PRODUCER_SNAPSHOT_HEADER
    version, _, offset, count = header.unpack_from(data)
    crc = crc32c(data[f.PRODUCER_SNAPSHOT_CRC_START :])
    return header.pack(version, crc, offset, count) + data[header.size :]


def entry_with(producer_id: int, *batches: BatchMetadata) -> ProducerStateEntry:
    entry = ProducerStateEntry(producer_id, 0, T0, 0)
    entry.batches.extend(batches)
    return entry


@pytest.mark.parametrize(
    "data",
    [
        # A batch reaching the snapshot's own offset: the state as of 40 covers offsets < 40.
        encode_snapshot(40, [entry_with(1, BatchMetadata(0, 1, 39, 40))]),
        # One producer twice.
        encode_snapshot(
            40, [entry_with(1, BatchMetadata(0, 0, 1, 1)), entry_with(1, BatchMetadata(1, 1, 2, 2))]
        ),
        # A producer without batches (an entry always has one).
        encode_snapshot(40, [entry_with(1)]),
        # Bytes after the last entry.
        resealed(encode_snapshot(40, sample_entries()) + bytes(24)),
    ],
    ids=["batch-at-offset", "duplicate-producer", "no-batches", "trailing-bytes"],
)
def test_a_checksummed_but_inconsistent_snapshot_is_refused(data: bytes) -> None:
    with pytest.raises(ProducerSnapshotCorruptError):
        decode_snapshot(data, 40)


def test_snapshot_entries_are_written_in_producer_id_order() -> None:
    entries = sample_entries()  # ids 5, 1
    assert encode_snapshot(40, entries) == encode_snapshot(40, entries[::-1])
    body = encode_snapshot(40, entries)[f.PRODUCER_SNAPSHOT_HEADER.size :]
    assert f.PRODUCER_SNAPSHOT_ENTRY.unpack_from(body)[0] == 1  # FORMAT.md 3.3: sorted by id


def test_a_snapshot_below_the_replay_start_is_not_loaded(tmp_path: Path) -> None:
    """Replay starts at ``min_offset`` (the log start): a snapshot below it describes
    data that is gone, and replaying from it is impossible."""
    manager = ProducerStateManager(tmp_path)
    manager.end_offset = 10
    manager.take_snapshot()
    assert manager.load_snapshot(15, 30) is None
    assert manager.end_offset == 15
    assert manager.load_snapshot(10, 30) == 10


def test_a_snapshot_taken_twice_at_one_offset_is_listed_once(tmp_path: Path) -> None:
    manager = ProducerStateManager(tmp_path)
    manager.end_offset = 10
    manager.take_snapshot()
    manager.take_snapshot()  # a close with nothing appended since the last snapshot
    assert manager.snapshot_offsets == [10]
    manager.retain_snapshots(keep=[])  # the newest is always kept
    assert snapshot_path(tmp_path, 10).exists()
    assert manager.snapshot_offsets == [10]


# --- model test -------------------------------------------------------------------------------


@dataclass
class Written:
    pid: int
    epoch: int
    first_seq: int
    count: int
    first_offset: int


class ModelState:
    """The reference: producer state folded from the batches below the log end, and the
    expected outcome of a request, written as plainly as possible."""

    def __init__(self) -> None:
        self.written: list[Written] = []
        self.end = 0

    def state(self) -> dict[int, tuple[int, list[BatchMetadata]]]:
        out: dict[int, tuple[int, list[BatchMetadata]]] = {}
        for w in self.written:
            epoch, batches = out.get(w.pid, (w.epoch, []))
            if epoch != w.epoch:
                epoch, batches = w.epoch, []
            last_seq = (w.first_seq + w.count - 1) % (MAX_SEQ + 1)
            meta = BatchMetadata(
                w.first_seq, last_seq, w.first_offset, w.first_offset + w.count - 1
            )
            out[w.pid] = (epoch, [*batches, meta][-5:])
        return out

    def start_sequences(self) -> dict[int, int]:
        """Per producer, the first sequence of its current epoch's first written batch:
        below it nothing is known to be written (a producer starts anywhere, KIP-360)."""
        out: dict[int, tuple[int, int]] = {}
        for w in self.written:
            if w.pid not in out or out[w.pid][0] != w.epoch:
                out[w.pid] = (w.epoch, w.first_seq)
        return {pid: start for pid, (_, start) in out.items()}

    def outcome(self, request: list[tuple[int, int, int, int]]) -> object:
        """AppendInfo for success/duplicate, or the exception class."""
        state = self.state()
        starts = self.start_sequences()
        pending: dict[int, tuple[int, int]] = {}
        dups: list[BatchMetadata] = []
        fresh = 0
        for pid, epoch, seq, count in request:
            if epoch < 0:
                return InvalidRecordError
            last = (seq + count - 1) % (MAX_SEQ + 1)
            if pid not in pending and pid in state and state[pid][0] == epoch:
                match = [
                    m for m in state[pid][1] if (m.first_sequence, m.last_sequence) == (seq, last)
                ]
                if match:
                    dups.append(match[0])
                    continue
                window = state[pid][1]
                oldest = window[0].first_sequence
                if (
                    starts[pid] <= seq <= last < oldest <= window[-1].last_sequence
                    and (oldest - last) % (MAX_SEQ + 1) <= (MAX_SEQ + 1) // 2
                ):
                    # Written long ago: a duplicate whose offsets are forgotten.
                    dups.append(BatchMetadata(seq, last, -1, window[0].first_offset - 1))
                    continue
            fresh += 1
            if pid in pending:
                cur = pending[pid]
            elif pid in state:
                cur = (state[pid][0], state[pid][1][-1].last_sequence)
            else:
                cur = None
            if cur is None:
                pass  # unknown: any sequence (KIP-360)
            elif epoch < cur[0]:
                return InvalidProducerEpochError
            elif epoch > cur[0]:
                if seq != 0:
                    return OutOfOrderSequenceError
            elif seq != (cur[1] + 1) % (MAX_SEQ + 1):
                return OutOfOrderSequenceError
            pending[pid] = (epoch, last)
        if dups and fresh:
            return DuplicateSequenceError
        if dups:
            if any(d.first_offset < 0 for d in dups):
                return AppendInfo(-1, max(d.last_offset for d in dups), True)
            return AppendInfo(dups[0].first_offset, dups[-1].last_offset, True)
        total = sum(count for *_, count in request)
        return AppendInfo(self.end, self.end + total - 1)

    def apply(self, request: list[tuple[int, int, int, int]]) -> None:
        for pid, epoch, seq, count in request:
            self.written.append(Written(pid, epoch, seq, count, self.end))
            self.end += count

    def truncate(self, offset: int) -> None:
        self.written = [w for w in self.written if w.first_offset + w.count - 1 < offset]
        self.end = self.written[-1].first_offset + self.written[-1].count if self.written else 0


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[str, object]]:
    ops: list[tuple[str, object]] = []
    for _ in range(draw(st.integers(5, 40))):
        kind = draw(st.sampled_from(["append"] * 8 + ["reopen", "crash", "truncate"]))
        if kind == "append":
            batches = []
            for _ in range(draw(st.integers(1, 3))):
                pid = draw(st.integers(1, 3))
                how = draw(
                    st.sampled_from(
                        ["next"] * 4 + ["retry", "retry", "gap", "epoch", "bump", "old", "ancient"]
                    )
                )
                batches.append((pid, how, draw(st.integers(1, 3)), draw(st.integers(0, 9))))
            ops.append(("append", batches))
        elif kind == "truncate":
            ops.append(("truncate", draw(st.floats(0, 1))))
        else:
            ops.append((kind, None))
    return ops


def concretize(
    model: ModelState, spec: list[tuple[int, str, int, int]]
) -> list[tuple[int, int, int, int]]:
    """Turn (pid, how, count, pick) into (pid, epoch, seq, count) from the model's state."""
    state = model.state()
    request = []
    pending: dict[int, tuple[int, int]] = {}
    for pid, how, count, pick in spec:
        epoch, last = pending.get(
            pid, (state[pid][0], state[pid][1][-1].last_sequence) if pid in state else (0, -1)
        )
        if how == "retry" and pid in state:
            meta = state[pid][1][pick % len(state[pid][1])]
            request.append(
                (pid, state[pid][0], meta.first_sequence, meta.last_offset - meta.first_offset + 1)
            )
            continue
        if how == "ancient" and pid in state:
            # A resend of something before the remembered batches: written (at or after
            # the producer's first sequence here) or never (before it).
            seq = max(0, state[pid][1][0].first_sequence - 1 - pick)
            request.append((pid, state[pid][0], seq, 1))
            continue
        if how == "gap":
            seq = (last + 1 + 1 + pick) % (MAX_SEQ + 1)
        elif how == "epoch":
            epoch = max(0, epoch + (pick % 3) - 1)  # older, same or newer
            seq = 0 if pick % 2 else (last + 1) % (MAX_SEQ + 1)
        elif how == "bump":
            epoch, seq = epoch + 1, 0
        elif how == "old":  # a fenced instance (epoch -1 when there is no older one)
            epoch, seq = epoch - 1, (last + 1) % (MAX_SEQ + 1)
        else:
            seq = (last + 1) % (MAX_SEQ + 1)
        request.append((pid, epoch, seq, count))
        pending[pid] = (epoch, (seq + count - 1) % (MAX_SEQ + 1))
    return request


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=operations(), segment_bytes=st.sampled_from([500, 1500, 1 << 30]))
def test_model(tmp_path: Path, ops: list[tuple[str, object]], segment_bytes: int) -> None:
    config = LogConfig(segment_bytes=segment_bytes)
    with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
        generation = 0
        directory = Path(scratch) / "g0" / "p-0"
        log = open_log(directory, config)
        model = ModelState()
        for kind, arg in ops:
            if kind == "append":
                request = concretize(model, arg)  # type: ignore[arg-type]
                expected = model.outcome(request)
                raw = b"".join(idem(pid, e, s, n) for pid, e, s, n in request)
                if isinstance(expected, type):
                    with pytest.raises(expected):
                        log.append(raw)
                else:
                    assert log.append(raw) == expected
                    if not expected.duplicate:
                        model.apply(request)
            elif kind == "reopen":
                log.close()
                log = open_log(directory, config)
            elif kind == "crash":
                generation += 1
                crashed = Path(scratch) / f"g{generation}" / "p-0"
                shutil.copytree(directory, crashed)
                log.close()
                directory = crashed
                log = open_log(directory, config)
            else:
                target = int(model.end * arg)  # type: ignore[operator]
                log.truncate_to(target)
                model.truncate(target)
            assert log.log_end_offset == model.end
            assert state_of(log) == model.state()
        log.close()


def test_a_batch_older_than_the_window_is_a_duplicate_at_unknown_offsets(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    for i in range(8):  # sequences 0..15 in 8 batches of 2; the last 5 are remembered
        log.append(idem(1, 0, 2 * i, n=2))
    before = dir_state(log.dir)
    # A resend of batch 0 (sequences 0-1): written, but its offsets are forgotten. It is
    # answered as a duplicate below the oldest remembered batch (offsets 6-7), so an
    # acks=all producer waits for the HW to pass offset 5 before it is told.
    assert log.append(idem(1, 0, 0, n=2)) == AppendInfo(-1, 5, duplicate=True)
    # So are several old batches, and old ones with remembered ones after them.
    assert log.append(idem(1, 0, 0, n=2) + idem(1, 0, 2, n=2)) == AppendInfo(-1, 5, True)
    assert log.append(idem(1, 0, 4, n=2) + idem(1, 0, 6, n=2)) == AppendInfo(-1, 7, True)
    # Mixed with a new batch, nothing can answer the request: refused, nothing written.
    with pytest.raises(DuplicateSequenceError, match="mixes batches already written"):
        log.append(idem(1, 0, 0, n=2) + idem(1, 0, 16, n=1))
    # Inside the window but not a remembered batch: still out of order, as in Kafka.
    with pytest.raises(OutOfOrderSequenceError):
        log.append(idem(1, 0, 7, n=2))
    # An older epoch is fenced, whatever its sequences.
    assert dir_state(log.dir) == before
    assert log.append(idem(1, 0, 16, n=1)) == AppendInfo(16, 16)
    log.close()


def test_a_batch_before_a_producers_first_sequence_here_is_not_taken_for_written(
    tmp_path: Path,
) -> None:
    """A producer this partition did not know starts at any sequence (KIP-360): here at 3,
    because its batch at 0 was refused up front (NOT_ENOUGH_REPLICAS) while the next one,
    pipelined, got in. The retry of sequence 0 lies before every remembered batch but was
    never written: it must be refused as out of order, not answered as written. What the
    partition knows survives a reopen (the snapshot keeps the start sequence)."""
    log = open_log(tmp_path / "p-0")
    for i in range(7):  # sequences 3..9, one batch each; 5..9 are remembered
        log.append(idem(1, 0, 3 + i, n=1))
    before = dir_state(log.dir)
    with pytest.raises(OutOfOrderSequenceError):
        log.append(idem(1, 0, 0, n=1))
    # Sequence 3, at the start, was written: a duplicate at unknown offsets.
    assert log.append(idem(1, 0, 3, n=1)) == AppendInfo(-1, 1, duplicate=True)
    assert dir_state(log.dir) == before
    log.close()
    log = open_log(tmp_path / "p-0")
    with pytest.raises(OutOfOrderSequenceError):
        log.append(idem(1, 0, 0, n=1))
    assert log.append(idem(1, 0, 4, n=1)) == AppendInfo(-1, 1, duplicate=True)
    log.close()


def test_a_new_epoch_first_seen_past_sequence_0_starts_its_window_there(tmp_path: Path) -> None:
    """A follower copies epoch 0 from sequence 0, then epoch 1 from sequence 50 (its
    leader had forgotten the producer: KIP-360 took it at 50). The new epoch's window
    starts at 50: a later request at sequences 10-12 was never written, and must be
    refused as out of order, not answered as a duplicate at unknown offsets and lost
    (a mutation keeping epoch 0's start went unseen)."""
    follower = open_log(tmp_path / "p-0")
    batches = [idem(7, 0, 0)] + [idem(7, 1, 50 + 2 * k) for k in range(6)]
    for batch in batches:
        copy = bytearray(batch)
        stamp(copy, 0, follower.log_end_offset, 1)
        follower.append(bytes(copy), assign_offsets=False)
    entry = follower.producer_state.entry(7)
    assert entry is not None and entry.producer_epoch == 1 and entry.start_sequence == 50
    follower.assign_epoch_start_offset(2)  # it leads now
    with pytest.raises(OutOfOrderSequenceError):
        follower.append(idem(7, 1, 10, n=3), 2)
    follower.close()
