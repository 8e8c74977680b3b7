"""The leader epoch cache (``services.storage.log.leader_epoch``) and its use by ``Log``.

The semantics tables follow Kafka's ``LeaderEpochFileCacheTest``; then persistence
(``leader-epoch-checkpoint``), rebuilding a missing, corrupt or stale file from the batch
headers, keeping the cache consistent through truncation, retention and crashes,
follower appends that carry the leader's epochs, and divergence: replicas that diverged
across leader changes find their truncation offsets with OffsetForLeaderEpoch (the
KIP-279 loop a replica fetcher runs) and end byte-identical.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from services.storage.log import EpochEntry, LeaderEpochCache, Log, LogConfig
from services.storage.log.checkpoint import OffsetCheckpointFile
from services.storage.log.errors import CheckpointCorruptError
from tidelog import formats as f
from tidelog.clock import ManualClock
from tidelog.errors import InvalidRequestError
from tidelog.records import decode_batches, encode_batch

T0 = 1_700_000_000_000
BIG = 1 << 30
E = EpochEntry


def cache_of(*entries: tuple[int, int]) -> LeaderEpochCache:
    cache = LeaderEpochCache(None)
    for epoch, start in entries:
        cache.assign(epoch, start)
    return cache


def batch(n: int = 2, tag: int = 0) -> bytes:
    return encode_batch([bytes([tag % 251]) * 30] * n, timestamps_ms=[T0] * n)


def open_log(directory: Path, config: LogConfig | None = None, **kwargs: object) -> Log:
    kwargs.setdefault("clock", ManualClock())
    kwargs.setdefault("rng", random.Random(0))
    return Log.open(directory, config or LogConfig(), **kwargs)  # type: ignore[arg-type]


def read_all(log: Log) -> bytes:
    out, offset = [], log.log_start_offset
    while offset < log.log_end_offset:
        data = log.read(offset, BIG)
        out.append(data)
        offset = decode_batches(data)[-1].next_offset
    return b"".join(out)


def epochs_in_log(log: Log) -> list[tuple[int, int]]:
    """(epoch, base offset) of every batch, from the bytes."""
    return [(b.partition_leader_epoch, b.base_offset) for b in decode_batches(read_all(log))]


def expected_entries(log: Log) -> list[EpochEntry]:
    """What the cache must hold: one entry where the batch epochs change (they increase)."""
    entries: list[EpochEntry] = []
    for epoch, base in epochs_in_log(log):
        if not entries or entries[-1].epoch != epoch:
            entries.append(E(epoch, base))
    return entries


def checkpoint_text(log: Log) -> str:
    return (log.dir / f.LEADER_EPOCH_CHECKPOINT).read_text()


def file_entries(log: Log) -> list[EpochEntry]:
    return LeaderEpochCache.load(log.dir / f.LEADER_EPOCH_CHECKPOINT).entries


# --- semantics (Kafka's LeaderEpochFileCacheTest) ---------------------------------------------


def test_assign_and_latest_epoch() -> None:
    cache = LeaderEpochCache(None)
    assert cache.latest_epoch == -1
    assert cache.assign(2, 10)
    assert cache.latest_epoch == 2
    assert cache.end_offset_for(2, 11) == (2, 11)


def test_latest_epoch_answers_with_the_log_end() -> None:
    cache = cache_of((2, 5), (3, 6), (4, 7))
    assert cache.end_offset_for(4, 0) == (4, 0)
    assert cache.end_offset_for(4, 123) == (4, 123)


def test_undefined_epoch_and_empty_cache() -> None:
    assert LeaderEpochCache(None).end_offset_for(0, 0) == (-1, -1)
    assert LeaderEpochCache(None).end_offset_for(-1, 0) == (-1, -1)
    assert cache_of((2, 5)).end_offset_for(-1, 10) == (-1, -1)


def test_epoch_above_the_latest_is_unknown() -> None:
    cache = cache_of((2, 100))
    assert cache.end_offset_for(3, 100) == (-1, -1)


def test_epoch_below_the_first_returns_the_first_start_offset() -> None:
    # Kafka (KIP-279): the requested epoch with the first known epoch's start offset.
    cache = cache_of((5, 11), (6, 12), (7, 13))
    assert cache.end_offset_for(4, 0) == (4, 11)
    assert cache.end_offset_for(0, 0) == (0, 11)


def test_largest_epoch_at_or_below_and_next_start() -> None:
    cache = cache_of((0, 10), (2, 13), (4, 17))
    table = {0: (0, 13), 1: (0, 13), 2: (2, 17), 3: (2, 17), 4: (4, 20), 5: (-1, -1)}
    for requested, answer in table.items():
        assert cache.end_offset_for(requested, 20) == answer, requested


def test_epochs_need_not_start_at_zero() -> None:
    cache = cache_of((2, 6))
    assert cache.end_offset_for(2, 7) == (2, 7)
    assert cache.end_offset_for(1, 7) == (1, 6)


def test_same_epoch_later_offset_changes_nothing() -> None:
    cache = cache_of((2, 6))
    assert not cache.assign(2, 7)
    assert not cache.assign(2, 6)
    assert cache.entries == [E(2, 6)]


def test_same_epoch_earlier_offset_truncates_later_entries() -> None:
    cache = cache_of((5, 11), (6, 12), (7, 13))
    assert cache.assign(7, 12)
    assert cache.entries == [E(5, 11), E(7, 12)]
    assert cache.end_offset_for(5, 20) == (5, 12)
    assert cache.end_offset_for(6, 20) == (5, 12)


def test_older_epoch_removes_newer_entries_to_stay_monotonic() -> None:
    cache = cache_of((1, 5), (2, 6))
    assert cache.assign(1, 7)
    assert cache.latest_epoch == 1
    assert cache.entries == [E(1, 7)]
    assert cache.end_offset_for(1, 8) == (1, 8)
    assert cache.end_offset_for(2, 8) == (-1, -1)
    # A new epoch at an earlier offset than the latest entry also wins.
    cache = cache_of((2, 6), (3, 9))
    assert cache.assign(4, 8)
    assert cache.entries == [E(2, 6), E(4, 8)]


def test_negative_entries_are_refused() -> None:
    with pytest.raises(ValueError):
        LeaderEpochCache(None).assign(-1, 0)
    with pytest.raises(ValueError):
        LeaderEpochCache(None).assign(0, -1)
    with pytest.raises(ValueError):
        LeaderEpochCache(None, [E(2, 5), E(2, 6)])  # entries must strictly increase


def test_truncate_from_end() -> None:
    cache = cache_of((2, 6), (3, 8), (4, 11))
    assert not cache.truncate_from_end(12)  # beyond every start: nothing to do
    assert cache.truncate_from_end(11)
    assert cache.entries == [E(2, 6), E(3, 8)]
    assert not cache.truncate_from_end(9)  # epoch 3 still starts below 9
    assert cache.entries == [E(2, 6), E(3, 8)]
    assert cache.truncate_from_end(8)
    assert cache.entries == [E(2, 6)]
    assert cache.truncate_from_end(0)
    assert cache.entries == []
    assert cache.latest_epoch == -1


@pytest.mark.parametrize(
    ("start", "expected"),
    [
        (5, [E(2, 6), E(3, 8), E(4, 11)]),
        (6, [E(2, 6), E(3, 8), E(4, 11)]),
        (7, [E(2, 7), E(3, 8), E(4, 11)]),
        (8, [E(3, 8), E(4, 11)]),
        (9, [E(3, 9), E(4, 11)]),
        (11, [E(4, 11)]),
        (12, [E(4, 12)]),
    ],
)
def test_truncate_from_start(start: int, expected: list[EpochEntry]) -> None:
    cache = cache_of((2, 6), (3, 8), (4, 11))
    before = cache.entries
    assert cache.truncate_from_start(start) == (expected != before)
    assert cache.entries == expected


def test_epoch_for_offset() -> None:
    cache = cache_of((2, 6), (3, 8), (4, 11))
    assert [cache.epoch_for_offset(o) for o in (0, 5, 6, 7, 8, 10, 11, 99)] == [
        -1,
        -1,
        2,
        2,
        3,
        3,
        4,
        4,
    ]


# --- persistence -------------------------------------------------------------------------------


def test_checkpoint_round_trip_and_format(tmp_path: Path) -> None:
    path = tmp_path / f.LEADER_EPOCH_CHECKPOINT
    cache = LeaderEpochCache(path)
    assert not path.exists()
    cache.assign(3, 0)
    assert path.read_text() == "0\n1\n3 0\n"
    cache.assign(5, 1187)
    assert path.read_text() == "0\n2\n3 0\n5 1187\n"  # the example in docs/FORMAT.md
    assert LeaderEpochCache.load(path).entries == [E(3, 0), E(5, 1187)]
    cache.truncate_from_end(1187)
    assert LeaderEpochCache.load(path).entries == [E(3, 0)]
    cache.clear()
    assert path.read_text() == "0\n0\n"
    assert LeaderEpochCache.load(tmp_path / "missing").entries == []
    assert not list(tmp_path.glob("*.tmp"))


def test_assign_without_write_leaves_the_file(tmp_path: Path) -> None:
    path = tmp_path / f.LEADER_EPOCH_CHECKPOINT
    cache = LeaderEpochCache(path)
    cache.assign(1, 0, write=False)
    assert not path.exists()
    cache.write()
    assert LeaderEpochCache.load(path).entries == [E(1, 0)]


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"1\n1\n3 0\n",  # unknown version
        b"0\n2\n3 0\n",  # count says 2
        b"0\n1\n3\n",  # missing field
        b"0\n1\n3 0 1\n",
        b"0\n1\nx 0\n",
        b"0\n2\n5 10\n3 20\n",  # epochs go down
        b"0\n2\n3 10\n5 10\n",  # start offsets do not increase
        b"0\n1\n-1 0\n",
        b"\xff\xfe\x00garbage",
    ],
)
def test_corrupt_checkpoint_is_detected(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / f.LEADER_EPOCH_CHECKPOINT
    path.write_bytes(content)
    with pytest.raises(CheckpointCorruptError):
        LeaderEpochCache.load(path)


def test_offset_checkpoint_round_trip_and_format(tmp_path: Path) -> None:
    """The recovery-point and replication-offset checkpoints (``OffsetCheckpointFile``)."""
    checkpoint = OffsetCheckpointFile(tmp_path / "recovery-point-offset-checkpoint")
    assert checkpoint.read() == {}  # no file yet: nothing checkpointed
    offsets = {("orders", 0): 1200, ("orders", 1): 1187}
    checkpoint.write(offsets)
    assert checkpoint.path.read_text() == "0\n2\norders 0 1200\norders 1 1187\n"  # FORMAT.md
    assert checkpoint.read() == offsets
    checkpoint.write({})
    assert checkpoint.read() == {}
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.path.name]  # no .tmp left


def test_an_offset_checkpoint_is_replaced_not_rewritten_in_place(tmp_path: Path) -> None:
    """A new inode renamed over the old name: a reader (or a crash) sees the old file or
    the new one, never a half-written one."""
    checkpoint = OffsetCheckpointFile(tmp_path / "replication-offset-checkpoint")
    checkpoint.write({("orders", 0): 1})
    old = tmp_path / "old-inode"
    os.link(checkpoint.path, old)
    checkpoint.write({("orders", 0): 2, ("orders", 1): 3})
    assert OffsetCheckpointFile(old).read() == {("orders", 0): 1}
    assert checkpoint.read() == {("orders", 0): 2, ("orders", 1): 3}


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"1\n1\norders 0 5\n",  # unknown version
        b"0\n2\norders 0 5\n",  # count says 2
        b"0\n0\norders 0 5\n",  # count says 0
        b"0\n1\norders 0\n",  # missing field
        b"0\n1\norders x 5\n",
        b"0\n1\norders 0 5 6\n",
        b"\xff\xfe\x00garbage",  # a torn or zeroed file: not text
    ],
)
def test_corrupt_offset_checkpoint_is_detected(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "recovery-point-offset-checkpoint"
    path.write_bytes(content)
    with pytest.raises(CheckpointCorruptError):
        OffsetCheckpointFile(path).read()


# --- Log integration ---------------------------------------------------------------------------


def build(log: Log, epochs: list[int]) -> None:
    for i, epoch in enumerate(epochs):
        log.append(batch(1 + i % 3, tag=i), epoch)


def test_leader_appends_assign_epochs(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    assert log.latest_epoch == -1
    assert log.end_offset_for_epoch(0) == (-1, -1)
    build(log, [0, 0, 3, 3, 3, 5])
    assert log.leader_epoch_cache.entries == expected_entries(log) == [E(0, 0), E(3, 3), E(5, 9)]
    assert file_entries(log) == log.leader_epoch_cache.entries
    assert log.latest_epoch == 5
    assert log.end_offset_for_epoch(5) == (5, log.log_end_offset)
    assert log.end_offset_for_epoch(4) == (3, 9)
    assert log.end_offset_for_epoch(0) == (0, 3)
    assert log.end_offset_for_epoch(6) == (-1, -1)
    # Several batches of a new epoch in one request: one entry at the first.
    log.append(batch(2) + batch(1), 7)
    assert log.leader_epoch_cache.entries[-1] == E(7, 12)
    log.close()
    reopened = open_log(tmp_path / "p-0")
    assert reopened.leader_epoch_cache.entries == expected_entries(reopened)
    assert reopened.end_offset_for_epoch(5) == (5, 12)
    reopened.close()


def test_rejected_append_writes_no_epoch(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    build(log, [1])
    before = checkpoint_text(log)
    damaged = bytearray(batch(2))
    damaged[-1] ^= 1
    with pytest.raises(Exception, match="checksum"):
        log.append(batch(1) + bytes(damaged), 4)
    assert checkpoint_text(log) == before
    assert log.latest_epoch == 1
    log.close()


def test_follower_appends_carry_the_leaders_epochs(tmp_path: Path) -> None:
    leader = open_log(tmp_path / "leader-0")
    follower = open_log(tmp_path / "follower-0")
    build(leader, [1, 1, 2, 4, 4, 4, 9])
    # One fetch of everything; the follower's own leader_epoch argument is ignored.
    follower.append(leader.read(0, BIG), 77, assign_offsets=False)
    assert follower.leader_epoch_cache.entries == leader.leader_epoch_cache.entries
    assert file_entries(follower) == file_entries(leader)
    build(leader, [9, 10])
    follower.append(leader.read(follower.log_end_offset, BIG), assign_offsets=False)
    assert follower.leader_epoch_cache.entries == leader.leader_epoch_cache.entries
    assert read_all(follower) == read_all(leader)
    leader.close()
    follower.close()


def test_missing_checkpoint_is_rebuilt_from_the_log(tmp_path: Path) -> None:
    config = LogConfig(segment_bytes=600)  # several segments
    log = open_log(tmp_path / "p-0", config)
    build(log, [0, 0, 1, 1, 1, 2, 2, 6, 6, 6, 6, 8])
    entries = log.leader_epoch_cache.entries
    assert log.segment_count > 2
    log.close()
    (tmp_path / "p-0" / f.LEADER_EPOCH_CHECKPOINT).unlink()
    reopened = open_log(tmp_path / "p-0", config, recovery_point=BIG)
    assert reopened.leader_epoch_cache.entries == entries == expected_entries(reopened)
    assert file_entries(reopened) == entries  # and written back
    reopened.close()


@pytest.mark.parametrize(
    "content",
    [
        b"garbage",
        b"0\n5\n1 0\n",
        b"0\n0\n",  # empty, for a log that has batches
        b"0\n1\n0 0\n",  # stale: misses the later epochs
        b"0\n2\n0 0\n42 3\n",  # names an epoch no batch carries
    ],
)
def test_corrupt_or_stale_checkpoint_is_rebuilt(tmp_path: Path, content: bytes) -> None:
    log = open_log(tmp_path / "p-0")
    build(log, [0, 0, 3, 3, 5])
    entries = log.leader_epoch_cache.entries
    log.close()
    (tmp_path / "p-0" / f.LEADER_EPOCH_CHECKPOINT).write_bytes(content)
    reopened = open_log(tmp_path / "p-0", recovery_point=BIG)
    assert reopened.leader_epoch_cache.entries == entries
    assert file_entries(reopened) == entries
    reopened.close()


def test_checkpoint_ahead_of_the_data_is_trimmed_on_open(tmp_path: Path) -> None:
    """The checkpoint is written before the batches of a new epoch. A crash that loses
    those batches leaves it naming offsets that no longer exist: opening trims them."""
    directory = tmp_path / "p-0"
    log = open_log(directory)
    build(log, [1, 1, 2])
    log.flush()
    end = log.log_end_offset
    size = (directory / f"{0:020d}.log").stat().st_size
    log.append(batch(3), 4)  # new epoch: checkpoint first, then data
    assert file_entries(log)[-1] == E(4, end)
    crashed = tmp_path / "crashed" / "p-0"
    shutil.copytree(directory, crashed)
    log.close()
    with open(crashed / f"{0:020d}.log", "r+b") as data:
        data.truncate(size)  # the epoch-4 batch never reached the disk
    reopened = open_log(crashed)
    assert reopened.log_end_offset == end
    assert reopened.latest_epoch == 2
    assert file_entries(reopened) == [E(1, 0), E(2, 3)]
    # The partition layer assigns its epoch again and appends continue.
    reopened.assign_epoch_start_offset(4)
    assert reopened.end_offset_for_epoch(2) == (2, end)
    reopened.append(batch(1), 4)
    assert reopened.leader_epoch_cache.entries == [E(1, 0), E(2, 3), E(4, end)]
    reopened.close()


def test_truncation_keeps_the_cache_consistent(tmp_path: Path) -> None:
    config = LogConfig(segment_bytes=600)
    log = open_log(tmp_path / "p-0", config)
    build(log, [0, 0, 1, 1, 1, 2, 2, 6, 6, 6, 6, 8])
    for offset in (20, 19, 12, 11, 5, 1):
        log.truncate_to(offset)
        assert log.leader_epoch_cache.entries == expected_entries(log)
        assert file_entries(log) == expected_entries(log)
    log.truncate_to(0)
    assert log.leader_epoch_cache.entries == []
    build(log, [3])
    assert file_entries(log) == [E(3, 0)]
    log.truncate_fully_and_start_at(100)
    assert log.leader_epoch_cache.entries == []
    assert file_entries(log) == []
    build(log, [4])
    assert log.leader_epoch_cache.entries == [E(4, 100)]
    log.close()


def test_retention_moves_the_first_epoch_start(tmp_path: Path) -> None:
    size = len(batch(1))
    config = LogConfig(segment_bytes=2 * size, retention_bytes=2 * size)
    log = open_log(tmp_path / "p-0", config)
    for epoch in (1, 1, 1, 2, 2, 3):
        log.append(batch(1), epoch)
    assert log.leader_epoch_cache.entries == [E(1, 0), E(2, 3), E(3, 5)]
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) == 2
    assert log.log_start_offset == 4
    assert log.leader_epoch_cache.entries == [E(2, 4), E(3, 5)]
    assert file_entries(log) == [E(2, 4), E(3, 5)]
    log.close()


def test_assign_epoch_start_offset(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    build(log, [1, 1])
    end = log.log_end_offset
    log.assign_epoch_start_offset(3)  # becoming leader, before any append
    assert log.leader_epoch_cache.entries == [E(1, 0), E(3, end)]
    assert log.end_offset_for_epoch(1) == (1, end)
    assert log.end_offset_for_epoch(2) == (1, end)
    log.assign_epoch_start_offset(3)  # again: nothing changes
    log.append(batch(2), 3)
    assert log.leader_epoch_cache.entries == [E(1, 0), E(3, end)]
    with pytest.raises(InvalidRequestError):
        log.assign_epoch_start_offset(5, log.log_end_offset + 1)
    log.close()


# --- divergence ---------------------------------------------------------------------------------


def reconcile(follower: Log, leader: Log) -> int:
    """What a replica fetcher does on becoming a follower (KIP-101 with KIP-279): ask the
    leader where the follower's latest epoch ends, and truncate there; when the leader
    answers with an epoch the follower does not have, truncate to where the follower's
    own largest earlier epoch ends and ask again. Returns the final truncation offset."""
    for _ in range(100):
        epoch = follower.latest_epoch
        if epoch < 0:
            follower.truncate_to(min(follower.log_end_offset, leader.log_end_offset))
            return follower.log_end_offset
        leader_epoch, leader_end = leader.end_offset_for_epoch(epoch)
        assert leader_end >= 0, "the leader knows every epoch up to its own"
        own_epoch, own_end = follower.end_offset_for_epoch(leader_epoch)
        if own_epoch != leader_epoch:
            follower.truncate_to(min(own_end, follower.log_end_offset))
            continue
        target = min(own_end, leader_end, follower.log_end_offset)
        follower.truncate_to(target)
        return target
    raise AssertionError("no convergence")


def catch_up(follower: Log, leader: Log, max_bytes: int = BIG) -> None:
    while follower.log_end_offset < leader.log_end_offset:
        follower.append(leader.read(follower.log_end_offset, max_bytes), assign_offsets=False)


def assert_identical(*logs: Log) -> None:
    first = logs[0]
    for other in logs[1:]:
        assert read_all(other) == read_all(first)
        assert other.leader_epoch_cache.entries == first.leader_epoch_cache.entries
        assert other.log_end_offset == first.log_end_offset


@pytest.mark.parametrize("segment_bytes", [1 << 30, 500])
def test_divergence_after_a_leader_change(tmp_path: Path, segment_bytes: int) -> None:
    """KIP-101's case: the old leader appended (acks=1) data nobody copied, then lost
    leadership; the new leader wrote other data at those offsets in the next epoch."""
    config = LogConfig(segment_bytes=segment_bytes)
    a = open_log(tmp_path / "a-0", config)
    b = open_log(tmp_path / "b-0", config)
    a.assign_epoch_start_offset(1)
    for i in range(4):
        a.append(batch(2, tag=i), 1)
    catch_up(b, a)
    for i in range(3):
        a.append(batch(3, tag=10 + i), 1)  # never replicated
    # b becomes leader in epoch 2 and writes different data at the same offsets.
    b.assign_epoch_start_offset(2)
    change = b.log_end_offset
    for i in range(2):
        b.append(batch(1, tag=20 + i), 2)
    assert read_all(a)[: len(read_all(b))] != read_all(b)  # the logs diverge
    # a returns as a follower.
    assert b.end_offset_for_epoch(1) == (1, change)
    assert reconcile(a, b) == change
    assert a.log_end_offset == change
    catch_up(a, b, max_bytes=1)
    assert_identical(a, b)
    # Reconciling again changes nothing: the logs agree.
    assert reconcile(a, b) == a.log_end_offset
    a.close()
    b.close()


def test_divergence_needs_two_rounds_kip_279(tmp_path: Path) -> None:
    """The follower's latest epoch is unknown to the leader, and the leader's answer names
    an epoch the follower never saw: one round of OffsetForLeaderEpoch is not enough."""
    a = open_log(tmp_path / "a-0")
    b = open_log(tmp_path / "b-0")
    # Epoch 1, a leads: a writes [0, 50), b copies only [0, 40).
    for i in range(5):
        a.append(encode_batch([bytes([i])] * 10, timestamps_ms=[T0] * 10), 1)
    b.append(a.read(0, BIG, max_offset=40), assign_offsets=False)
    assert (a.log_end_offset, b.log_end_offset) == (50, 40)
    # Epoch 2, b leads and writes [40, 60); a copies nothing.
    b.assign_epoch_start_offset(2)
    b.append(encode_batch([b"b2"] * 20, timestamps_ms=[T0] * 20), 2)
    # Epoch 3, a leads again (unclean) and writes [50, 70); b copies nothing.
    a.assign_epoch_start_offset(3)
    a.append(encode_batch([b"a3"] * 20, timestamps_ms=[T0] * 20), 3)
    # Epoch 4, b leads (unclean) and writes [60, 80).
    b.assign_epoch_start_offset(4)
    b.append(encode_batch([b"b4"] * 20, timestamps_ms=[T0] * 20), 4)
    assert a.leader_epoch_cache.entries == [E(1, 0), E(3, 50)]
    assert b.leader_epoch_cache.entries == [E(1, 0), E(2, 40), E(4, 60)]
    # Round 1: b answers epoch 3 with (2, 60); a has no epoch 2, so it truncates to the
    # end of its epoch 1 (50) and asks again. Round 2: (1, 40).
    assert b.end_offset_for_epoch(3) == (2, 60)
    assert a.end_offset_for_epoch(2) == (1, 50)
    assert reconcile(a, b) == 40
    catch_up(a, b)
    assert_identical(a, b)
    assert epochs_in_log(a)[-2:] == [(2, 40), (4, 60)]
    a.close()
    b.close()


def test_follower_that_is_a_prefix_keeps_everything(tmp_path: Path) -> None:
    a = open_log(tmp_path / "a-0")
    b = open_log(tmp_path / "b-0")
    build(a, [1, 1, 2, 2, 3])
    b.append(a.read(0, BIG, max_offset=5), assign_offsets=False)
    end = b.log_end_offset
    assert reconcile(b, a) == end
    catch_up(b, a)
    assert_identical(a, b)
    a.close()
    b.close()


@pytest.mark.parametrize("seed", range(25))
def test_random_leader_changes_converge(tmp_path: Path, seed: int) -> None:
    """Three replicas; leadership moves at random (clean or not), leaders append, followers
    reconcile with each new leader and copy part of its log, replicas restart from disk.
    Whatever happened, after a last reconcile-and-catch-up every replica is
    byte-identical to the leader, and each cache matches the epochs in its bytes."""
    rng = random.Random(seed)
    config = LogConfig(segment_bytes=rng.choice([400, 1500, 1 << 30]))
    dirs = [tmp_path / f"r{i}" / "t-0" for i in range(3)]
    logs = [open_log(d, config) for d in dirs]
    leader, epoch = 0, 0
    logs[leader].assign_epoch_start_offset(epoch)
    for _ in range(rng.randint(5, 25)):
        action = rng.random()
        if action < 0.45:
            for _ in range(rng.randint(1, 3)):
                logs[leader].append(batch(rng.randint(1, 4), tag=rng.randrange(250)), epoch)
        elif action < 0.75:
            follower = rng.choice([i for i in range(3) if i != leader])
            reconcile(logs[follower], logs[leader])
            room = logs[leader].log_end_offset - logs[follower].log_end_offset
            if room > 0:
                upto = logs[follower].log_end_offset + rng.randint(1, room)
                while logs[follower].log_end_offset < upto:
                    data = logs[leader].read(logs[follower].log_end_offset, rng.choice([1, BIG]))
                    logs[follower].append(data, assign_offsets=False)
        elif action < 0.9:
            leader = rng.randrange(3)
            epoch += 1
            logs[leader].assign_epoch_start_offset(epoch)
        else:
            victim = rng.randrange(3)
            logs[victim].close()
            logs[victim] = open_log(dirs[victim], config)
            if victim == leader:  # the partition layer assigns its epoch on every start
                logs[leader].assign_epoch_start_offset(epoch)
        for log in logs:
            check_cache(log)
    for i in range(3):
        if i != leader:
            reconcile(logs[i], logs[leader])
            catch_up(logs[i], logs[leader])
    leader_bytes = read_all(logs[leader])
    for log in logs:
        assert read_all(log) == leader_bytes
        check_cache(log)
        log.close()


def check_cache(log: Log) -> None:
    """The cache is the epochs of the bytes, plus possibly the entry a new leader assigned
    at its log end before appending anything in its epoch."""
    entries = log.leader_epoch_cache.entries
    expected = expected_entries(log)
    if entries[-1:] and entries[-1].start_offset == log.log_end_offset:
        assert not expected or expected[-1].epoch < entries[-1].epoch
        entries = entries[:-1]
    assert entries == expected
