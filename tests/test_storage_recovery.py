"""Crash recovery of the storage engine, modelled on Kafka's ``LogLoaderTest``.

Each test builds a log of several segments from random batches (remembering the bytes and
offsets of every batch as the log must hold them), damages the files the way a crash or a
bad disk would, reopens it (re-verifying everything, and trusting a checkpointed recovery
point where that means something) and checks that:

- everything before the first damage reads back byte for byte;
- the log end offset is exactly the end of the last intact batch;
- appends continue at that offset;
- a second reopen finds nothing more to repair.

Then the same for ``LogManager``: checkpoints at start-up and shutdown, corrupt checkpoint
files, interrupted deletions. Real files in ``tmp_path``; many seeds.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.storage.log import AppendInfo, Log, LogConfig
from services.storage.log import checkpoint as checkpoint_module
from services.storage.log.checkpoint import OffsetCheckpointFile
from services.storage.log.segment import LogSegment
from services.storage.log_manager import RECOVERY_POINT_CHECKPOINT, LogManager
from services.storage.node import _Every
from services.storage.partition import Partition, PartitionState
from services.storage.server import ReplicaManager
from tidelog import formats as f
from tidelog.batch import parse_header, stamp
from tidelog.clock import ManualClock
from tidelog.errors import StorageError, TidelogError
from tidelog.records import decode_batches, encode_batch

SEEDS = range(20)
T0 = 1_700_000_000_000
INDEX_BYTES = 64 * 1024  # preallocated index size: small, so crash copies stay cheap
BIG = 1 << 30


# --- building a log and remembering what it holds -------------------------------------------


@dataclass
class Appended:
    base_offset: int
    last_offset: int
    data: bytes  # stamped, exactly as on disk
    values: list[bytes]
    segment: int = -1  # base offset of the segment holding it
    position: int = -1  # byte position inside that segment's .log


@dataclass
class Built:
    config: LogConfig
    batches: list[Appended]
    segments: list[int]
    flushed_to: int = 0  # recovery point of a flush done mid-way (for crash copies)
    extra: list[Appended] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.batches[-1].last_offset + 1

    def in_segment(self, base: int) -> list[Appended]:
        return [b for b in self.batches if b.segment == base]

    @property
    def active(self) -> int:
        return self.segments[-1]


def seg_file(directory: Path, base: int, suffix: str) -> Path:
    return directory / f"{base:020d}{suffix}"


def random_batch(rng: random.Random) -> tuple[bytes, list[bytes]]:
    n = rng.randint(1, 10)
    values = [rng.randbytes(rng.randint(0, 300)) for _ in range(n)]
    timestamps = [T0 + rng.randint(-1000, 100_000) for _ in range(n)]
    compression = rng.choice(["none", "none", "zstd"])
    return encode_batch(values, timestamps_ms=timestamps, compression=compression), values


def build_log(directory: Path, rng: random.Random, *, close: bool = True) -> tuple[Built, Log]:
    """A log of 3+ segments from 40-70 random batches, appended 1-3 per request."""
    raws = [random_batch(rng) for _ in range(rng.randint(40, 70))]
    total = sum(len(raw) for raw, _ in raws)
    config = LogConfig(
        segment_bytes=max(2000, total // rng.randint(3, 6)),
        index_interval_bytes=rng.choice([0, 100, 1000, 4096]),
        segment_index_bytes=INDEX_BYTES,
    )
    log = Log.open(directory, config, clock=ManualClock(), rng=random.Random(0))
    batches: list[Appended] = []
    flush_at = rng.randrange(len(raws))
    i = 0
    while i < len(raws):
        group = raws[i : i + rng.randint(1, 3)]
        epoch = rng.randint(0, 5)
        info = log.append(b"".join(raw for raw, _ in group), epoch)
        offset = info.first_offset
        for raw, values in group:
            stamped = bytearray(raw)
            stamp(stamped, 0, offset, epoch)
            count = parse_header(raw).record_count
            batches.append(Appended(offset, offset + count - 1, bytes(stamped), values))
            offset += count
        assert offset == info.last_offset + 1
        if flush_at in range(i, i + len(group)):
            log.flush()
        i += len(group)
    built = Built(config, batches, log.segment_base_offsets, flushed_to=log.recovery_point)
    # Where each batch sits: segments hold consecutive batches from their base offset.
    bases = built.segments
    position, segment = 0, bases[0]
    for batch in batches:
        owner = max(b for b in bases if b <= batch.base_offset)
        if owner != segment:
            segment, position = owner, 0
        batch.segment, batch.position = segment, position
        position += len(batch.data)
    assert len(bases) >= 3, bases
    for base in bases:
        assert seg_file(directory, base, ".log").stat().st_size == sum(
            len(b.data) for b in built.in_segment(base)
        )
    if close:
        log.close()
    return built, log


def reopen(directory: Path, built: Built, recovery_point: int) -> Log:
    return Log.open(
        directory,
        built.config,
        recovery_point=recovery_point,
        clock=ManualClock(),
        rng=random.Random(1),
    )


# --- checking a recovered log ----------------------------------------------------------------


def read_all(log: Log) -> bytes:
    out = []
    offset = log.log_start_offset
    while data := log.read(offset, 1 << 20):
        out.append(data)
        offset = decode_batches(data)[-1].next_offset
    assert offset == log.log_end_offset
    return b"".join(out)


def check_intact(log: Log, kept: list[Appended]) -> None:
    """The log holds exactly ``kept``, byte for byte, and every offset reads right."""
    end = kept[-1].last_offset + 1 if kept else 0
    assert log.log_start_offset == 0
    assert log.log_end_offset == end
    assert log.recovery_point <= end
    everything = read_all(log)
    assert everything == b"".join(b.data for b in kept)
    decoded = decode_batches(everything)
    assert [[r.value for r in b.records] for b in decoded] == [b.values for b in kept]
    assert [r.offset for b in decoded for r in b.records] == list(range(end))
    for batch in kept:
        for offset in (batch.base_offset, batch.last_offset):
            assert log.read(offset, 1) == batch.data
    assert log.read(end, 1) == b""
    # Every segment file left on disk belongs to the log.
    logs = sorted(p.name for p in log.dir.iterdir() if p.name.endswith(".log"))
    assert logs == [f"{b:020d}.log" for b in log.segment_base_offsets]


def check_continues(directory: Path, built: Built, log: Log, kept: list[Appended]) -> None:
    """Appends go on at the log end; a second reopen is stable and sees them."""
    end = log.log_end_offset
    raw, values = random_batch(random.Random(end))
    count = parse_header(raw).record_count
    assert log.append(raw, 9) == AppendInfo(end, end + count - 1)
    stamped = bytearray(raw)
    stamp(stamped, 0, end, 9)
    now_kept = [*kept, Appended(end, end + count - 1, bytes(stamped), values)]
    check_intact(log, now_kept)
    bases = log.segment_base_offsets
    log.flush()
    recovery_point = log.recovery_point
    log.close()
    for point in (0, recovery_point):
        again = reopen(directory, built, point)
        assert again.truncated_on_recovery_bytes == 0
        assert again.segment_base_offsets == bases
        check_intact(again, now_kept)
        again.close()


def damaged_copy(pristine: Path, tmp_path: Path, name: str) -> Path:
    target = tmp_path / name / pristine.name
    shutil.copytree(pristine, target)
    return target


@pytest.fixture
def pristine(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Path, Built]:
    """A cleanly closed log built from the test's seed."""
    seed = request.node.callspec.params["seed"]
    directory = tmp_path / "pristine" / "t-0"
    built, _ = build_log(directory, random.Random(seed))
    return directory, built


# --- damage kinds ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_garbage_appended_to_active_log(
    tmp_path: Path, seed: int, pristine: tuple[Path, Built]
) -> None:
    source, built = pristine
    rng = random.Random(seed * 7 + 1)
    garbage = rng.randbytes(rng.randint(1, 1024))
    for point in (0, built.end):
        directory = damaged_copy(source, tmp_path, f"rp{point}")
        with open(seg_file(directory, built.active, ".log"), "ab") as out:
            out.write(garbage)
        log = reopen(directory, built, point)
        assert log.truncated_on_recovery_bytes == len(garbage)
        assert log.segment_base_offsets == built.segments
        check_intact(log, built.batches)
        check_continues(directory, built, log, built.batches)


@pytest.mark.parametrize("seed", SEEDS)
def test_garbage_appended_to_active_indexes(
    tmp_path: Path, seed: int, pristine: tuple[Path, Built]
) -> None:
    source, built = pristine
    rng = random.Random(seed * 7 + 2)
    for point in (0, built.end):
        directory = damaged_copy(source, tmp_path, f"rp{point}")
        for suffix in (".index", ".timeindex"):
            # Whole entries half the time (the size check alone cannot catch those).
            unit = {".index": 8, ".timeindex": 12}[suffix]
            size = rng.randint(1, 64) * unit if rng.random() < 0.5 else rng.randint(1, 1024)
            with open(seg_file(directory, built.active, suffix), "ab") as out:
                out.write(rng.randbytes(size))
        log = reopen(directory, built, point)
        assert log.truncated_on_recovery_bytes == 0
        check_intact(log, built.batches)
        check_continues(directory, built, log, built.batches)


@pytest.mark.parametrize("seed", SEEDS)
def test_garbage_appended_to_old_offset_index(
    tmp_path: Path, seed: int, pristine: tuple[Path, Built]
) -> None:
    """A trusted (below the recovery point) index with bogus whole entries: lookups confirm
    positions against batch headers, so reads stay right."""
    source, built = pristine
    rng = random.Random(seed * 7 + 3)
    directory = damaged_copy(source, tmp_path, "old-index")
    old = rng.choice(built.segments[:-1])
    log_size = seg_file(directory, old, ".log").stat().st_size
    index = seg_file(directory, old, ".index")
    last_relative = index.read_bytes()[-8:-4]
    start = f.U32.unpack(last_relative)[0] if index.stat().st_size else 0
    # Increasing entries with positions inside the log: they pass the O(1) sanity check.
    entries = [(start + 1 + i, rng.randrange(1, log_size)) for i in range(rng.randint(1, 5))]
    entries.sort(key=lambda e: e[1])
    with open(index, "ab") as out:
        out.write(b"".join(f.OFFSET_INDEX_ENTRY.pack(rel, pos) for rel, pos in entries))
    log = reopen(directory, built, built.end)
    check_intact(log, built.batches)
    check_continues(directory, built, log, built.batches)


@pytest.mark.parametrize("seed", SEEDS)
def test_active_log_truncated_mid_batch(
    tmp_path: Path, seed: int, pristine: tuple[Path, Built]
) -> None:
    source, built = pristine
    rng = random.Random(seed * 7 + 4)
    victim = rng.choice(built.in_segment(built.active))
    cut = victim.position + rng.randint(1, len(victim.data) - 1)
    kept = [b for b in built.batches if b.base_offset < victim.base_offset]
    for point in (0, built.end):
        directory = damaged_copy(source, tmp_path, f"rp{point}")
        os.truncate(seg_file(directory, built.active, ".log"), cut)
        log = reopen(directory, built, point)
        assert log.truncated_on_recovery_bytes == cut - victim.position
        assert log.log_end_offset == victim.base_offset
        assert log.segment_base_offsets == built.segments
        check_intact(log, kept)
        check_continues(directory, built, log, kept)


@pytest.mark.parametrize("seed", SEEDS)
def test_index_files_deleted(tmp_path: Path, seed: int, pristine: tuple[Path, Built]) -> None:
    source, built = pristine
    rng = random.Random(seed * 7 + 5)
    old = rng.choice(built.segments[:-1])
    for point in (0, built.end):
        for victims in ([old], [built.active], [old, built.active], built.segments):
            directory = damaged_copy(source, tmp_path, f"rp{point}-{len(victims)}-{victims[0]}")
            which = rng.choice([(".index",), (".timeindex",), (".index", ".timeindex")])
            for base in victims:
                for suffix in which:
                    seg_file(directory, base, suffix).unlink()
            log = reopen(directory, built, point)
            assert log.truncated_on_recovery_bytes == 0
            for base in built.segments:  # rebuilt
                assert seg_file(directory, base, ".index").exists()
                assert seg_file(directory, base, ".timeindex").exists()
            # Rebuilt indexes of old segments are trimmed like rolled ones.
            assert seg_file(directory, old, ".index").stat().st_size < INDEX_BYTES
            check_intact(log, built.batches)
            check_continues(directory, built, log, built.batches)


def flip_byte(path: Path, position: int) -> None:
    with open(path, "r+b") as file:
        file.seek(position)
        byte = file.read(1)[0]
        file.seek(position)
        file.write(bytes([byte ^ (1 << random.Random(position).randrange(8))]))


@pytest.mark.parametrize("seed", SEEDS)
def test_flipped_byte_in_old_segment_full_recovery(
    tmp_path: Path, seed: int, pristine: tuple[Path, Built]
) -> None:
    """recovery_point=0: the log is cut at the damaged batch; later segments are dropped."""
    source, built = pristine
    rng = random.Random(seed * 7 + 6)
    victim = rng.choice([b for b in built.batches if b.segment != built.active])
    where = victim.position + rng.randrange(len(victim.data))
    directory = damaged_copy(source, tmp_path, "flip")
    flip_byte(seg_file(directory, victim.segment, ".log"), where)
    log = reopen(directory, built, 0)
    kept = [b for b in built.batches if b.base_offset < victim.base_offset]
    assert log.log_end_offset == victim.base_offset
    total = sum(len(b.data) for b in built.batches)
    assert log.truncated_on_recovery_bytes == total - sum(len(b.data) for b in kept)
    assert log.segment_base_offsets == [b for b in built.segments if b <= victim.segment]
    for base in built.segments:
        if base > victim.segment:
            assert not seg_file(directory, base, ".log").exists()
            assert not seg_file(directory, base, ".index").exists()
            assert not seg_file(directory, base, ".timeindex").exists()
    check_intact(log, kept)
    check_continues(directory, built, log, kept)


@pytest.mark.parametrize("seed", SEEDS)
def test_flipped_byte_in_old_segment_past_recovery_point(
    tmp_path: Path, seed: int, pristine: tuple[Path, Built]
) -> None:
    """Recovery trusts flushed segments, so the damage is found only when read: the damaged
    batch is never served, batches before it are, and the rest of the log is unaffected."""
    source, built = pristine
    rng = random.Random(seed * 7 + 7)
    victim = rng.choice([b for b in built.batches if b.segment != built.active])
    where = victim.position + rng.randrange(len(victim.data))
    directory = damaged_copy(source, tmp_path, "flip")
    flip_byte(seg_file(directory, victim.segment, ".log"), where)
    log = reopen(directory, built, built.end)
    assert log.truncated_on_recovery_bytes == 0
    assert log.log_end_offset == built.end
    assert log.segment_base_offsets == built.segments
    by_offset = {b.base_offset: b for b in built.batches}
    for batch in built.batches:
        later = [b for b in built.batches if b.base_offset >= batch.base_offset]
        expected = b"".join(b.data for b in later if b.segment == batch.segment)
        for max_bytes in (1, BIG):
            for offset in (batch.base_offset, batch.last_offset):
                if batch is victim:
                    with pytest.raises(StorageError):
                        log.read(offset, max_bytes)
                    continue
                try:
                    data = log.read(offset, max_bytes)
                except StorageError:
                    # Allowed only for a batch that a scan must cross the damage to reach.
                    assert batch.segment == victim.segment
                    assert batch.base_offset > victim.base_offset
                    continue
                # Whatever is served is intact and in place: a prefix of what was stored.
                assert data
                assert expected.startswith(data)
                served = decode_batches(data)
                assert served[0].base_offset == batch.base_offset
                assert victim.base_offset not in {b.base_offset for b in served}
                assert all(by_offset[b.base_offset].values == [r.value for r in b] for b in served)
    # Batches before the damage, and every other segment, read back in full.
    for batch in built.batches:
        if batch.segment != victim.segment or batch.base_offset < victim.base_offset:
            assert log.read(batch.base_offset, 1) == batch.data
    # Appends and a second reopen (still trusting the recovery point) are unaffected.
    end = log.log_end_offset
    raw, _ = random_batch(random.Random(seed))
    assert log.append(raw).first_offset == end
    log.flush()
    point = log.recovery_point
    log.close()
    again = reopen(directory, built, point)
    assert again.truncated_on_recovery_bytes == 0
    assert again.log_end_offset == point
    with pytest.raises(StorageError):
        again.read(victim.base_offset, 1)
    again.close()
    # A full recovery then cuts the log at the damage, as in the recovery_point=0 case.
    full = reopen(directory, built, 0)
    assert full.log_end_offset == victim.base_offset
    check_intact(full, [b for b in built.batches if b.base_offset < victim.base_offset])
    full.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_leftover_files_removed_on_open(
    tmp_path: Path, seed: int, pristine: tuple[Path, Built]
) -> None:
    source, built = pristine
    rng = random.Random(seed * 7 + 8)
    directory = damaged_copy(source, tmp_path, "leftovers")
    old = built.segments[0]
    retired = 10**9 + rng.randrange(1000)  # a segment retention retired, not yet unlinked
    leftovers = [
        "leader-epoch-checkpoint.tmp",
        f"{old:020d}.log.swap",
        f"{old:020d}.index.swap",
        f"{built.active:020d}.timeindex.swap",
        f"{retired:020d}.log.deleted",
        f"{retired:020d}.index.deleted",
        f"{retired:020d}.timeindex.deleted",
        f"{built.active:020d}.log.tmp",
    ]
    for name in leftovers:
        (directory / name).write_bytes(rng.randbytes(rng.randint(0, 300)))
    # An index whose log is gone indexes nothing either.
    orphan = retired + 5
    (directory / f"{orphan:020d}.index").write_bytes(bytes(16))
    for point in (0, built.end):
        log = reopen(directory, built, point)
        names = {p.name for p in directory.iterdir()}
        assert not names & set(leftovers)
        assert f"{orphan:020d}.index" not in names
        assert log.truncated_on_recovery_bytes == 0
        check_intact(log, built.batches)
        log.close()
    log = reopen(directory, built, 0)
    check_continues(directory, built, log, built.batches)


@pytest.mark.parametrize("seed", SEEDS)
def test_crash_with_untrimmed_preallocated_indexes(tmp_path: Path, seed: int) -> None:
    """Copy the files while the log is open, as a crash would leave them: the active
    indexes are preallocated and full of zero slots."""
    rng = random.Random(seed)
    live_dir = tmp_path / "live" / "t-0"
    built, live = build_log(live_dir, rng, close=False)
    crashed = tmp_path / "crashed" / "t-0"
    shutil.copytree(live_dir, crashed)
    live.close()
    assert seg_file(crashed, built.active, ".index").stat().st_size == INDEX_BYTES
    assert seg_file(crashed, built.active, ".timeindex").stat().st_size == (
        INDEX_BYTES - INDEX_BYTES % 12
    )
    for point in sorted({0, built.flushed_to, built.end}):
        directory = damaged_copy(crashed, tmp_path, f"rp{point}")
        log = reopen(directory, built, point)
        assert log.truncated_on_recovery_bytes == 0
        assert log.recovery_point == point
        check_intact(log, built.batches)
        check_continues(directory, built, log, built.batches)


@pytest.mark.parametrize("seed", SEEDS)
def test_crash_mid_append_and_untrimmed_indexes(tmp_path: Path, seed: int) -> None:
    """A crash copy whose active log also ends in a torn batch (a write cut short)."""
    rng = random.Random(seed + 100)
    live_dir = tmp_path / "live" / "t-0"
    built, live = build_log(live_dir, rng, close=False)
    crashed = tmp_path / "crashed" / "t-0"
    shutil.copytree(live_dir, crashed)
    live.close()
    raw, _ = random_batch(rng)
    torn = raw[: rng.randint(1, len(raw) - 1)]
    with open(seg_file(crashed, built.active, ".log"), "ab") as out:
        out.write(torn)
    log = reopen(crashed, built, built.flushed_to)
    assert log.truncated_on_recovery_bytes == len(torn)
    check_intact(log, built.batches)
    check_continues(crashed, built, log, built.batches)


def test_old_segment_with_bad_base_offset_is_cut(tmp_path: Path) -> None:
    """A segment whose batches do not continue from its file name's base offset (e.g. a
    file renamed by hand) is not trusted: recovery cuts the log there."""
    built, _ = build_log(tmp_path / "t-0", random.Random(99))
    second = built.segments[1]
    os.rename(
        seg_file(tmp_path / "t-0", second, ".log"),
        seg_file(tmp_path / "t-0", second + 1, ".log"),
    )
    for suffix in (".index", ".timeindex"):
        seg_file(tmp_path / "t-0", second, suffix).unlink()
    log = reopen(tmp_path / "t-0", built, 0)
    assert log.log_end_offset == second
    check_intact(log, built.in_segment(built.segments[0]))
    log.close()


# --- index entries that prove wrong after the segment was opened -------------------------

# Seeds whose logs have offset-index entries in the active segment and 2+ in old ones.
REBUILD_SEEDS = (1, 2, 3, 4)


def index_entries(path: Path) -> list[tuple[int, int]]:
    """``(relative offset, position)`` entries of an ``.index`` file, without the zero slots
    a preallocated (active) file ends in (no entry has position 0)."""
    entries = []
    for relative, position in f.OFFSET_INDEX_ENTRY.iter_unpack(path.read_bytes()):
        if position == 0:
            break
        entries.append((relative, position))
    return entries


def check_index_consistent(path: Path, built: Built, base: int, batches: list[Appended]) -> None:
    """Every entry points at the first byte of a batch with that base offset."""
    starts = {b.position: b.base_offset for b in batches if b.segment == base}
    for relative, position in index_entries(path):
        assert starts.get(position) == base + relative, (path.name, relative, position)


def corrupt_index_entry(
    path: Path,
    slots: list[int],
    batches: list[Appended],
    kind: str,
    rng: random.Random,
    *,
    pass_open_checks: bool = True,
) -> int:
    """Overwrite the position of one of the entries ``slots`` with a wrong but plausible
    one: the start of another batch of the segment, or a position inside a batch. With
    ``pass_open_checks`` the index still passes the checks at open (positions strictly
    increasing, inside the log with room for a header). Returns the slot."""
    entries = index_entries(path)
    log_size = sum(len(b.data) for b in batches)
    for slot in rng.sample(slots, len(slots)):
        relative, right = entries[slot]
        low, high = 0, log_size  # exclusive bounds
        if pass_open_checks:
            low = entries[slot - 1][1] if slot else 0
            high = (
                entries[slot + 1][1]
                if slot + 1 < len(entries)
                else log_size - f.BATCH_HEADER_SIZE + 1
            )
        other = [b.position for b in batches]
        inside = [b.position + rng.randrange(1, len(b.data)) for b in batches]
        candidates = [c for c in other if low < c < high and c != right]
        if kind == "inside batch" or not candidates:
            # Ordered entries leave no other batch start for this slot when every batch
            # is indexed: a position inside a batch is the wrong-but-plausible one there.
            candidates = [c for c in inside if low < c < high and c != right]
        if candidates:
            with open(path, "r+b") as out:
                out.seek(slot * f.OFFSET_INDEX_ENTRY.size)
                out.write(f.OFFSET_INDEX_ENTRY.pack(relative, rng.choice(candidates)))
            return slot
    raise AssertionError(f"no plausible wrong position for slots {slots} of {entries}")


@pytest.fixture
def rebuilds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Base offsets of the segments whose indexes ``rebuild_indexes`` rebuilt, in order."""
    calls: list[int] = []
    original = LogSegment.rebuild_indexes

    def spy(self: LogSegment) -> None:
        calls.append(self.base_offset)
        original(self)

    monkeypatch.setattr(LogSegment, "rebuild_indexes", spy)
    return calls


def read_every_offset(log: Log, batches: list[Appended]) -> None:
    for batch in batches:
        for offset in range(batch.base_offset, batch.last_offset + 1):
            assert log.read(offset, 1) == batch.data
            assert log.lookup(offset) == (batch.segment, batch.position, batch.base_offset)


def append_batches(log: Log, rng: random.Random, count: int) -> list[Appended]:
    appended = []
    for _ in range(count):
        raw, values = random_batch(rng)
        info = log.append(raw, 3)
        stamped = bytearray(raw)
        stamp(stamped, 0, info.first_offset, 3)
        appended.append(Appended(info.first_offset, info.last_offset, bytes(stamped), values))
    return appended


@pytest.mark.parametrize("kind", ["other batch", "inside batch"])
@pytest.mark.parametrize("seed", REBUILD_SEEDS)
def test_wrong_entry_in_trusted_old_index_is_rebuilt_on_the_spot(
    tmp_path: Path, seed: int, kind: str, pristine: tuple[Path, Built], rebuilds: list[int]
) -> None:
    """An old segment below the recovery point is trusted at open, so a wrong index entry
    is found by the first lookup through it: both indexes are rebuilt then (not reset to
    empty, which made every later read scan the segment from position 0)."""
    source, built = pristine
    rng = random.Random(seed * 7 + 9)
    directory = damaged_copy(source, tmp_path, "old")
    old = rng.choice(
        [b for b in built.segments[:-1] if index_entries(seg_file(source, b, ".index"))]
    )
    index = seg_file(directory, old, ".index")
    good = index.read_bytes()
    slots = list(range(len(index_entries(index))))
    corrupt_index_entry(index, slots, built.in_segment(old), kind, rng)
    damaged = index.read_bytes()
    log = reopen(directory, built, built.end)
    assert log.truncated_on_recovery_bytes == 0
    assert index.read_bytes() == damaged  # trusted: not re-verified at open
    assert rebuilds == []
    read_every_offset(log, built.batches)
    assert rebuilds == [old]  # once, by the first lookup through the wrong entry
    # Rebuilt and trimmed: the entries the appends wrote, every one pointing at its batch.
    assert index.read_bytes() == good
    assert index_entries(index)
    check_index_consistent(index, built, old, built.batches)
    read_every_offset(log, built.batches)
    assert rebuilds == [old]  # the second pass trusts the rebuilt index
    check_intact(log, built.batches)
    check_continues(directory, built, log, built.batches)
    assert rebuilds == [old]


@pytest.mark.parametrize("seed", REBUILD_SEEDS)
def test_wrong_entry_in_active_index_is_rebuilt_on_the_spot(
    tmp_path: Path, seed: int, pristine: tuple[Path, Built], rebuilds: list[int]
) -> None:
    source, built = pristine
    rng = random.Random(seed * 7 + 10)
    directory = damaged_copy(source, tmp_path, "active")
    active = built.active
    index = seg_file(directory, active, ".index")
    good = index_entries(index)
    batches = built.in_segment(active)
    # Damaged on disk after a clean close: the active segment holds the recovery point
    # (the log end), so the open re-verifies it and rebuilds its indexes from the log.
    slots = list(range(len(good)))
    corrupt_index_entry(index, slots, batches, "other batch", rng, pass_open_checks=False)
    log = reopen(directory, built, built.end)
    assert log.truncated_on_recovery_bytes == 0
    assert index_entries(index) == good
    read_every_offset(log, built.batches)
    assert rebuilds == []
    # Damaged while open (the file is mapped, so the write shows through): the first
    # lookup through the entry rebuilds the indexes, which stay preallocated and writable.
    for kind in ("other batch", "inside batch"):
        rebuilds.clear()
        corrupt_index_entry(index, slots, batches, kind, rng, pass_open_checks=False)
        read_every_offset(log, built.batches)
        assert rebuilds == [active]
        assert index_entries(index) == good
        assert index.stat().st_size == INDEX_BYTES
        check_index_consistent(index, built, active, built.batches)
        read_every_offset(log, built.batches)
        assert rebuilds == [active]
    # Appends go on from the rebuilt state: the files left at close are what a full
    # recovery builds, and a trusting reopen reads everything back.
    more = append_batches(log, rng, 12)
    kept = [*built.batches, *more]
    check_intact(log, kept)
    log.flush()
    point, bases = log.recovery_point, log.segment_base_offsets
    log.close()
    files = {
        (base, suffix): seg_file(directory, base, suffix).read_bytes()
        for base in bases
        for suffix in (".index", ".timeindex")
    }
    again = reopen(directory, built, point)
    assert again.truncated_on_recovery_bytes == 0
    assert again.segment_base_offsets == bases
    check_intact(again, kept)
    again.close()
    full = reopen(directory, built, 0)
    assert full.truncated_on_recovery_bytes == 0
    full.close()
    for (base, suffix), content in files.items():
        assert seg_file(directory, base, suffix).read_bytes() == content, (base, suffix)
    assert rebuilds == [active]
    log = reopen(directory, built, point)
    check_continues(directory, built, log, kept)


@pytest.mark.parametrize("where", ["header", "body"])
@pytest.mark.parametrize("seed", REBUILD_SEEDS)
def test_rebuild_after_wrong_entry_stops_at_damaged_batch(
    tmp_path: Path, seed: int, where: str, pristine: tuple[Path, Built], rebuilds: list[int]
) -> None:
    """A trusted old segment with a damaged batch in the middle and a wrong index entry
    after it: the rebuild keeps the entries before the damage (all of them when only the
    body is damaged, since the rebuild reads headers), the damaged batch is never served."""
    source, built = pristine
    rng = random.Random(seed * 7 + 11)
    choices = []
    for base in built.segments[:-1]:
        entries = index_entries(seg_file(source, base, ".index"))
        if len(entries) >= 2:
            first, last = entries[0][1], entries[-1][1]
            choices += [b for b in built.in_segment(base) if first < b.position < last]
    victim = rng.choice(choices)
    old = victim.segment
    directory = damaged_copy(source, tmp_path, "damaged")
    index = seg_file(directory, old, ".index")
    good = index_entries(index)
    if where == "header":  # bytes covered by the header checksum
        where_at = rng.randrange(f.HEADER_CRC_OFFSET + 4)
    else:
        where_at = rng.randrange(f.BATCH_HEADER_SIZE, len(victim.data))
    flip_byte(seg_file(directory, old, ".log"), victim.position + where_at)
    after = [slot for slot, (_, position) in enumerate(good) if position > victim.position]
    corrupt_index_entry(index, after, built.in_segment(old), "other batch", rng)
    damaged = index.read_bytes()
    log = reopen(directory, built, built.end)
    assert log.truncated_on_recovery_bytes == 0
    assert index.read_bytes() == damaged
    for _ in range(2):  # the second pass finds the rebuilt index right: no new rebuild
        for batch in built.batches:
            for offset in range(batch.base_offset, batch.last_offset + 1):
                if batch is victim:
                    with pytest.raises(StorageError):
                        log.read(offset, 1)
                elif batch.segment == old and batch.base_offset > victim.base_offset:
                    # Past the damage in its segment: served right, or refused when the
                    # scan to it must cross a damaged header (the rebuild stopped there).
                    try:
                        assert log.read(offset, 1) == batch.data
                    except StorageError:
                        assert where == "header"
                else:
                    assert log.read(offset, 1) == batch.data
                    assert log.lookup(offset) == (
                        old if batch.segment == old else batch.segment,
                        batch.position,
                        batch.base_offset,
                    )
        assert rebuilds == [old]
        rebuilt = index_entries(index)
        if where == "header":
            assert rebuilt == [e for e in good if e[1] < victim.position]
        else:
            assert rebuilt == good
        assert rebuilt  # the entries before the damage are kept
        check_index_consistent(index, built, old, built.batches)
    log.close()


# --- time index damage that passes a first/last check ---------------------------------------


def one_record(ts: int, value_bytes: int = 200) -> bytes:
    return encode_batch([b"x" * value_bytes], timestamps_ms=[ts])


def late_first_batch_log(directory: Path, clock: ManualClock) -> tuple[Log, LogConfig]:
    """Two segments; the first opens with its newest record (T0 + 5000), so its time
    index is one entry and every offset-index entry is later: the largest timestamp
    comes from the time index alone, not from the batches a tail scan reads."""
    config = LogConfig(index_interval_bytes=100, segment_bytes=2000, retention_ms=10_000)
    log = Log.open(directory, config, clock=clock, rng=random.Random(0))
    log.append(one_record(T0 + 5000))
    for i in range(5):
        log.append(one_record(T0 + i))
    while log.segment_count < 2:
        log.append(one_record(T0 + 10))
    log.append(one_record(T0 + 20))
    return log, config


def check_late_first_batch_retention(log: Log, clock: ManualClock) -> None:
    # The active segment's last record is above the HW here: segment 0 alone is judged.
    high_watermark = log.log_end_offset - 1
    clock.advance(13_000 - (clock.now_ms() - T0))  # the newest record of segment 0 is 8 s old
    assert log.delete_retention_segments(high_watermark=high_watermark) == 0
    assert log.log_start_offset == 0
    clock.advance(2001)  # now 10.001 s old: past retention.ms
    assert log.delete_retention_segments(high_watermark=high_watermark) == 1


@pytest.mark.parametrize(
    "damage", ["time index emptied", "offset index emptied", "last timestamp lowered"]
)
def test_incomplete_or_wrong_time_index_of_trusted_segment_is_rebuilt(
    tmp_path: Path, damage: str, rebuilds: list[int]
) -> None:
    """Indexes of a segment below the recovery point are trusted at open, but not blindly:
    a ``.timeindex`` truncated to nothing made the segment's largest timestamp that of
    its last few batches (ListOffsets by timestamp answered None, and retention deleted
    the segment 5 s early); so did a last entry with a lower timestamp, which still
    passes the ordering checks. Both are rebuilt from the batch headers (not a full
    re-verification), and so is an emptied ``.index`` of a segment over the interval."""
    clock = ManualClock(T0)
    directory = tmp_path / "t-0"
    log, config = late_first_batch_log(directory, clock)
    log.flush()
    point = log.recovery_point
    log.close()
    time_index, offset_index = (
        seg_file(directory, 0, ".timeindex"),
        seg_file(directory, 0, ".index"),
    )
    good = {path: path.read_bytes() for path in (time_index, offset_index)}
    assert len(good[time_index]) == f.TIME_INDEX_ENTRY.size  # the one entry at offset 0
    assert len(good[offset_index]) > 0
    if damage == "time index emptied":
        time_index.write_bytes(b"")
    elif damage == "offset index emptied":
        offset_index.write_bytes(b"")
    else:
        time_index.write_bytes(f.TIME_INDEX_ENTRY.pack(T0 + 1, 0))
    log = Log.open(directory, config, recovery_point=point, clock=clock, rng=random.Random(0))
    assert log.truncated_on_recovery_bytes == 0
    assert log.offset_for_timestamp(T0 + 3000) == (0, T0 + 5000)
    assert log.max_timestamp() == (T0 + 5000, 0)
    assert rebuilds == [0]
    for path, content in good.items():
        assert path.read_bytes() == content, path.name
    check_late_first_batch_retention(log, clock)
    log.close()


@pytest.mark.parametrize("damage", ["out of order", "ordered but wrong"])
def test_wrong_time_index_entry_does_not_skip_the_answer(
    tmp_path: Path, damage: str, rebuilds: list[int]
) -> None:
    """A time-index entry names the batch that raised the segment's maximum timestamp.
    One pointing too far sent the ListOffsets scan past the answer. Out of order, the
    check at open catches it; in order, the lookup does (the batch it names has another
    timestamp) and rebuilds both indexes, as a wrong offset-index entry does."""
    clock = ManualClock(T0)
    directory = tmp_path / "t-0"
    config = LogConfig(index_interval_bytes=100, segment_bytes=100_000)
    log = Log.open(directory, config, clock=clock, rng=random.Random(0))
    for i in range(20):
        log.append(one_record(T0 + 10 * i))
    log.roll()
    log.append(one_record(T0 + 1000, 10))
    log.flush()
    point = log.recovery_point
    log.close()
    path = seg_file(directory, 0, ".timeindex")
    good = path.read_bytes()
    entries = list(f.TIME_INDEX_ENTRY.iter_unpack(good))
    assert entries[2] == (T0 + 30, 3)
    damaged = bytearray(good)
    f.TIME_INDEX_ENTRY.pack_into(
        damaged, 2 * f.TIME_INDEX_ENTRY.size, T0 + 30, 15 if damage == "out of order" else 4
    )
    path.write_bytes(damaged)
    log = Log.open(directory, config, recovery_point=point, clock=clock, rng=random.Random(0))
    assert rebuilds == []  # out of order: re-verified at open (recover), not rebuilt
    for i in range(20):
        assert log.offset_for_timestamp(T0 + 10 * i) == (i, T0 + 10 * i)
        assert log.offset_for_timestamp(T0 + 10 * i - 5) == (i, T0 + 10 * i)
    assert rebuilds == ([0] if damage == "ordered but wrong" else [])
    assert path.read_bytes() == good
    log.close()


@pytest.mark.parametrize("seed", REBUILD_SEEDS)
def test_clean_reopen_rebuilds_no_index(
    tmp_path: Path, seed: int, pristine: tuple[Path, Built], rebuilds: list[int]
) -> None:
    """The checks at open read only the index files: a cleanly closed log rebuilds
    nothing, and every lookup trusts the indexes."""
    source, built = pristine
    log = reopen(source, built, built.end)
    read_every_offset(log, built.batches)
    for batch in built.batches[:: max(1, len(built.batches) // 8)]:
        log.offset_for_timestamp(parse_header(batch.data).max_timestamp)
    assert log.max_timestamp() is not None
    assert rebuilds == []
    log.close()


# --- LogManager ---------------------------------------------------------------------------


def fill(manager: LogManager, topic: str, partition: int, batches: int, seed: int) -> Log:
    log = manager.get_or_create_log(topic, partition)
    rng = random.Random(seed)
    for _ in range(batches):
        log.append(random_batch(rng)[0])
    return log


def manager_config() -> LogConfig:
    return LogConfig(segment_bytes=4000, index_interval_bytes=500, segment_index_bytes=4096)


def new_manager(data_dir: Path, clock: ManualClock | None = None) -> LogManager:
    return LogManager(data_dir, manager_config(), clock or ManualClock(), random.Random(0))


def test_a_truncation_below_the_recovery_point_checkpoints_it_at_once(tmp_path: Path) -> None:
    """As Kafka's truncateTo: the lowered recovery point is on disk before anything new is
    appended. Left to the next periodic checkpoint, a power loss in between would leave
    the old, higher one, and the data written after the truncation below it would be
    trusted on restart without being verified."""
    manager = new_manager(tmp_path)
    manager.startup()
    log = fill(manager, "orders", 0, 30, 0)
    other = fill(manager, "orders", 1, 10, 1)
    log.flush()
    other.flush()
    manager.checkpoint()
    checkpoint = OffsetCheckpointFile(tmp_path / RECOVERY_POINT_CHECKPOINT)
    end = log.log_end_offset
    assert checkpoint.read()[("orders", 0)] == end
    log.truncate_to(end)  # nothing goes: the recovery point stays, no write needed
    assert checkpoint.read()[("orders", 0)] == end
    cut = decode_batches(log.read(end // 2, 1))[0].base_offset
    log.truncate_to(cut)
    assert log.recovery_point == cut
    assert checkpoint.read() == {
        ("orders", 0): cut,
        ("orders", 1): other.log_end_offset,
    }
    manager.shutdown()


def test_deleting_the_log_of_a_topic_with_the_longest_name_leaves_nothing(
    tmp_path: Path,
) -> None:
    """A 249-character topic (Kafka's limit) makes a directory name of 251: the rename to
    ``*.<id>-delete`` used to pass the file system's 255 bytes and fail after the log was
    already forgotten, so its data stayed for a topic created again with that name."""
    manager = new_manager(tmp_path)
    manager.startup()
    topic = "t" * 249
    log = fill(manager, topic, 0, 5, 0)
    assert log.log_end_offset > 0
    manager.delete_log(topic, 0)
    assert not any(p.name.startswith("ttt") for p in tmp_path.iterdir())
    again = manager.get_or_create_log(topic, 0)
    assert (again.log_start_offset, again.log_end_offset) == (0, 0)
    manager.shutdown()


def test_log_manager_shutdown_checkpoints_at_log_end(tmp_path: Path) -> None:
    manager = new_manager(tmp_path)
    manager.startup()
    ends = {}
    for topic, partition in (("orders", 0), ("orders", 1), ("nginx-logs", 3)):
        ends[(topic, partition)] = fill(manager, topic, partition, 30, partition).log_end_offset
    contents = {key: read_all(log) for key, log in manager.all_logs().items()}
    manager.shutdown()
    assert OffsetCheckpointFile(tmp_path / RECOVERY_POINT_CHECKPOINT).read() == ends

    again = new_manager(tmp_path)
    again.startup()
    assert set(again.all_logs()) == set(ends)
    for key, log in again.all_logs().items():
        assert log.truncated_on_recovery_bytes == 0
        assert log.recovery_point == log.log_end_offset == ends[key]
        assert read_all(log) == contents[key]
    again.shutdown()


def flip_in_first_segment(log_dir: Path) -> None:
    first = seg_file(log_dir, 0, ".log")
    flip_byte(first, first.stat().st_size // 2)


def test_a_disk_failure_while_loading_logs_is_reported_as_a_disk_failure(tmp_path: Path) -> None:
    """An OSError opening a log at start-up goes to the disk-failure handler (the node then
    exits with its failed-disk status, 3, as RELIABILITY.md says of a failed read); it
    failed the start-up as any error, status 1 (found by an audit). Here the segment is a
    directory: EISDIR."""
    (tmp_path / "t-0" / "00000000000000000000.log").mkdir(parents=True)
    reported: list[OSError] = []
    manager = LogManager(
        tmp_path, LogConfig(), on_disk_failure=lambda where, error: reported.append(error)
    )
    with pytest.raises(OSError):
        manager.startup()
    assert [error.errno for error in reported] == [errno.EISDIR]


def test_log_manager_startup_uses_recovery_point_checkpoint(tmp_path: Path) -> None:
    manager = new_manager(tmp_path)
    manager.startup()
    log = fill(manager, "orders", 0, 40, 1)
    assert log.segment_count >= 3
    end = log.log_end_offset
    manager.shutdown()
    # Damage a flushed segment behind the recovery point: start-up trusts the checkpoint
    # and does not re-verify it (what seed 004 describes), so nothing is truncated.
    flip_in_first_segment(tmp_path / "orders-0")
    trusting = new_manager(tmp_path)
    trusting.startup()
    opened = trusting.get_log("orders", 0)
    assert opened is not None
    assert opened.truncated_on_recovery_bytes == 0
    assert opened.log_end_offset == end
    trusting.shutdown()
    # Without the checkpoint every segment is re-verified and the damage is cut off.
    (tmp_path / RECOVERY_POINT_CHECKPOINT).unlink()
    full = new_manager(tmp_path)
    full.startup()
    opened = full.get_log("orders", 0)
    assert opened is not None
    assert opened.truncated_on_recovery_bytes > 0
    assert opened.log_end_offset < end
    full.shutdown()


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"garbage\n",
        b"1\n1\norders 0 5\n",  # unknown version
        b"0\n2\norders 0 5\n",  # wrong count
        b"0\n1\norders zero 5\n",
        b"0\n1\norders 0\n",
        b"\x00\xff\xfe" * 50,
    ],
)
def test_log_manager_corrupt_checkpoint_means_full_recovery(tmp_path: Path, garbage: bytes) -> None:
    manager = new_manager(tmp_path)
    manager.startup()
    end = fill(manager, "orders", 0, 40, 2).log_end_offset
    manager.shutdown()
    flip_in_first_segment(tmp_path / "orders-0")
    (tmp_path / RECOVERY_POINT_CHECKPOINT).write_bytes(garbage)
    again = new_manager(tmp_path)
    again.startup()  # does not fail
    opened = again.get_log("orders", 0)
    assert opened is not None
    assert opened.truncated_on_recovery_bytes > 0  # proves segment 0 was re-verified
    assert opened.log_end_offset < end
    # Start-up rewrote a valid checkpoint.
    assert OffsetCheckpointFile(tmp_path / RECOVERY_POINT_CHECKPOINT).read() == {
        ("orders", 0): opened.recovery_point
    }
    again.shutdown()


def test_log_manager_crash_recovers_from_last_checkpoint(tmp_path: Path) -> None:
    """Copy the data directory while the manager runs (a crash), tear the active segment."""
    live = tmp_path / "live"
    manager = new_manager(live)
    manager.startup()
    log = fill(manager, "orders", 0, 25, 3)
    log.flush()
    manager.checkpoint()
    flushed = log.log_end_offset
    fill(manager, "orders", 0, 10, 4)  # appended after the checkpoint, not flushed
    contents = read_all(log)
    crashed = tmp_path / "crashed"
    shutil.copytree(live, crashed)
    manager.shutdown()
    assert OffsetCheckpointFile(crashed / RECOVERY_POINT_CHECKPOINT).read() == {
        ("orders", 0): flushed
    }
    active = max((crashed / "orders-0").glob("*.log"))
    with open(active, "ab") as out:
        out.write(b"\x00" * 100)
    again = new_manager(crashed)
    again.startup()
    opened = again.get_log("orders", 0)
    assert opened is not None
    assert opened.truncated_on_recovery_bytes == 100
    assert read_all(opened) == contents
    again.shutdown()


def test_log_manager_removes_interrupted_deletions(tmp_path: Path) -> None:
    doomed = tmp_path / "orders-0.0123456789abcdef-delete"
    doomed.mkdir(parents=True)
    (doomed / f"{0:020d}.log").write_bytes(b"x" * 100)
    unrelated = tmp_path / "not a partition"
    unrelated.mkdir()
    manager = new_manager(tmp_path)
    manager.startup()
    assert not doomed.exists()
    assert unrelated.exists()  # not ours to touch
    assert manager.all_logs() == {}
    manager.shutdown()


def test_log_manager_delete_log(tmp_path: Path) -> None:
    manager = new_manager(tmp_path)
    manager.startup()
    fill(manager, "orders", 0, 5, 5)
    fill(manager, "orders", 1, 5, 6)
    manager.delete_log("orders", 0)
    assert not (tmp_path / "orders-0").exists()
    assert not any(p.name.endswith("-delete") for p in tmp_path.iterdir())
    assert manager.get_log("orders", 0) is None
    assert set(OffsetCheckpointFile(tmp_path / RECOVERY_POINT_CHECKPOINT).read()) == {("orders", 1)}
    manager.delete_log("orders", 0)  # already gone: no-op
    fresh = manager.get_or_create_log("orders", 0)
    assert (fresh.log_start_offset, fresh.log_end_offset) == (0, 0)
    manager.shutdown()
    again = new_manager(tmp_path)
    again.startup()
    assert set(again.all_logs()) == {("orders", 0), ("orders", 1)}
    again.shutdown()


def test_log_manager_maintenance_applies_flush_and_retention(tmp_path: Path) -> None:
    clock = ManualClock(start_ms=T0)
    manager = LogManager(tmp_path, manager_config(), clock, random.Random(0))
    manager.startup()
    config = LogConfig(
        segment_bytes=4000,
        retention_ms=60_000,
        flush_ms=1000,
        file_delete_delay_ms=5000,
    )
    log = manager.get_or_create_log("orders", 0, config)
    assert log.config == config
    rng = random.Random(7)
    for _ in range(30):
        log.append(encode_batch([rng.randbytes(200)] * 3, timestamps_ms=[T0] * 3))
    assert log.segment_count > 2
    clock.advance(1000)
    manager.maintenance({("orders", 0): log.log_end_offset})
    assert log.recovery_point == log.log_end_offset  # flush.ms
    assert log.log_start_offset == 0
    clock.advance(60_000)
    manager.maintenance(
        {("orders", 0): log.log_end_offset}
    )  # every record is T0, now T0 + 61s: all but the active go
    assert log.segment_count == 1
    deleted = [p for p in (tmp_path / "orders-0").iterdir() if p.name.endswith(".deleted")]
    assert deleted
    clock.advance(5000)
    manager.maintenance({("orders", 0): log.log_end_offset})
    assert not any(p.name.endswith(".deleted") for p in (tmp_path / "orders-0").iterdir())
    manager.shutdown()


def sole_leader(topic: str, configs: dict[str, str]) -> PartitionState:
    """``topic``-0 led by broker 1, the only replica."""
    return PartitionState(
        topic=topic,
        partition=0,
        leader=1,
        leader_epoch=0,
        isr=(1,),
        replicas=(1,),
        partition_epoch=0,
        configs=configs,
    )


def test_a_restarted_broker_runs_no_retention_until_its_topic_settings_arrive(
    tmp_path: Path,
) -> None:
    """Logs load with the broker's defaults (retention.ms 7 days); a topic's own settings
    come with the controller's LeaderAndIsr. Retention waits for them: a restarted broker
    used to delete a retention.ms=-1 topic's month-old records in its first maintenance
    pass, before the controller had spoken (found by an audit)."""
    clock = ManualClock(start_ms=T0)
    state = sole_leader("archive", {"retention.ms": "-1", "segment.bytes": "2000"})

    def start() -> ReplicaManager:
        manager = ReplicaManager(LogManager(tmp_path, LogConfig(), clock=clock), broker_id=1)
        manager.startup()
        return manager

    manager = start()
    manager.apply_leader_and_isr(1, [state])
    partition = manager.get_partition("archive", 0)
    month_old_ms = T0 - 30 * 24 * 3600 * 1000
    for i in range(5):  # one segment each
        partition.append(encode_batch([b"%d" % i * 1500], timestamps_ms=[month_old_ms]))
    manager.maintenance(checkpoint=True)
    assert partition.high_watermark == 5
    manager.shutdown()

    manager = start()  # no LeaderAndIsr yet: the broker's 7 days would delete everything
    partition = manager.get_partition("archive", 0)
    manager.maintenance(checkpoint=True)
    assert partition.info().log_start_offset == 0
    manager.apply_leader_and_isr(1, [state])
    manager.maintenance(checkpoint=True)
    assert partition.info().log_start_offset == 0
    values = [r.value for b in decode_batches(partition.read(0, 1 << 20).records) for r in b]
    assert values[0] == b"0" * 1500
    # The settings are what retention runs by once known: the broker's default deletes.
    manager.apply_leader_and_isr(1, [dataclasses.replace(state, configs={}, leader_epoch=1)])
    manager.maintenance(checkpoint=True)
    assert partition.info().log_start_offset == 5
    manager.shutdown()


@pytest.mark.parametrize(
    "configs",
    [{"max.message.bytes": "1000"}, {"message.timestamp.type": "LogAppendTime"}],
    ids=["max.message.bytes", "LogAppendTime"],
)
def test_a_restarted_leader_takes_no_append_before_its_topic_settings(
    tmp_path: Path, configs: dict[str, str]
) -> None:
    """Found by an audit: a log loaded at start-up (the broker's defaults) became leader on
    the first LeaderAndIsr before the topic's settings reached it, the partition lock
    released in between: appends racing in were taken under the defaults (a batch over
    the topic's max.message.bytes acknowledged; a LogAppendTime topic's batch kept with
    the producer's timestamps). Settings now come first, under the same lock. The race is
    widened with a tiny GIL switch interval and tried over many restarts."""
    batch = encode_batch([b"x" * 4000], timestamps_ms=[1_000])

    def wrong(result_time_ms: int) -> bool:
        # Taken at all (over the limit), or taken unstamped (LogAppendTime).
        return "max.message.bytes" in configs or result_time_ms < 0

    def start() -> ReplicaManager:
        manager = ReplicaManager(LogManager(tmp_path, LogConfig()), broker_id=1)
        manager.startup()
        return manager

    manager = start()
    manager.apply_leader_and_isr(1, [sole_leader("t", configs)])
    manager.shutdown()
    taken_wrongly: list[int] = []
    switch_interval_s = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for restart in range(1, 100):
            manager = start()
            partition = manager.get_partition("t", 0)
            stop = threading.Event()

            def hammer(partition: Partition, stop: threading.Event, restart: int) -> None:
                while not stop.is_set():
                    try:
                        result = partition.append(batch)
                    except TidelogError:
                        continue  # not leading yet, or refused by the topic's limit
                    if wrong(result.log_append_time_ms):
                        taken_wrongly.append(restart)

            thread = threading.Thread(target=hammer, args=(partition, stop, restart))
            thread.start()
            state = dataclasses.replace(sole_leader("t", configs), leader_epoch=restart)
            manager.apply_leader_and_isr(restart + 1, [state])
            stop.set()
            thread.join()
            manager.shutdown()
            if taken_wrongly:
                break
    finally:
        sys.setswitchinterval(switch_interval_s)
    assert not taken_wrongly, f"appends taken under the broker's defaults: {taken_wrongly}"


def test_a_leader_and_isr_older_than_the_one_applied_brings_nothing_back(
    tmp_path: Path,
) -> None:
    """Found by an audit: a LeaderAndIsr the controller gave up on (the broker busy past
    its timeout) could be applied after the one it sent next; a topic's configuration
    changes with no epoch moving, so an old retention.ms came back on that replica. Each
    request now carries its number (request_version) and an older one of the same
    controller epoch is skipped; a newer controller's requests count afresh."""
    manager = ReplicaManager(LogManager(tmp_path, LogConfig()), broker_id=1)
    manager.startup()
    month, day = 30 * 24 * 3600 * 1000, 24 * 3600 * 1000
    newer = sole_leader("kept", {"retention.ms": str(month)})
    older = sole_leader("kept", {"retention.ms": str(day)})

    def retention_ms() -> int:
        log = manager._log_manager.get_log("kept", 0)
        assert log is not None
        return log.config.retention_ms

    assert manager.apply_leader_and_isr(1, [newer], request_version=5) == [None]
    assert manager.apply_leader_and_isr(1, [older], request_version=3) == [None]
    assert retention_ms() == month
    assert manager.apply_leader_and_isr(1, [older], request_version=6) == [None]
    assert retention_ms() == day
    assert manager.apply_leader_and_isr(2, [newer], request_version=1) == [None]
    assert retention_ms() == month
    manager.shutdown()


def test_one_log_failing_its_maintenance_does_not_stop_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass over the logs goes on past a log whose maintenance raises: the logs after
    it still have retention run and the recovery points are still checkpointed. The
    first failing log used to end the pass, at every pass while it kept failing."""
    clock = ManualClock(start_ms=T0)
    manager = ReplicaManager(LogManager(tmp_path, LogConfig(), clock=clock), broker_id=1)
    manager.startup()
    configs = {"retention.ms": "1000", "segment.bytes": "2000"}
    states = [sole_leader(topic, configs) for topic in ("a-failing", "b-healthy")]
    manager.apply_leader_and_isr(1, states)
    for topic in ("a-failing", "b-healthy"):
        for i in range(3):  # one segment each
            batch = encode_batch([b"%d" % i * 1500], timestamps_ms=[T0])
            manager.get_partition(topic, 0).append(batch)

    def broken() -> None:
        raise RuntimeError("injected: this log's maintenance fails")

    with manager.get_partition("a-failing", 0).locked() as failing_log:
        assert failing_log is not None
        monkeypatch.setattr(failing_log, "flush_if_due", broken)
    clock.advance(5_000)  # every segment but the active one is past retention.ms
    manager.maintenance(checkpoint=True)
    assert manager.get_partition("b-healthy", 0).info().log_start_offset == 3
    assert manager.get_partition("a-failing", 0).info().log_start_offset == 0
    checkpoint = OffsetCheckpointFile(tmp_path / RECOVERY_POINT_CHECKPOINT).read()
    assert checkpoint[("b-healthy", 0)] == 3
    manager.shutdown()


@pytest.mark.parametrize("shift", [5, -2])
def test_recovery_stops_at_a_batch_whose_offsets_do_not_continue(
    tmp_path: Path, shift: int
) -> None:
    """A batch with valid checksums whose base offset does not continue the one before
    it (stale bytes in the file, say) is where the log ends on recovery: trusted, it made
    offsets skip or repeat (a mutation trusting it went unseen)."""
    directory = tmp_path / "p-0"
    log = Log.open(directory, LogConfig(), clock=ManualClock(start_ms=T0))
    batches = [encode_batch([b"v%d" % i] * 2, timestamps_ms=[T0] * 2) for i in range(3)]
    for batch in batches:
        log.append(batch)
    log.flush()
    log.close()
    segment = seg_file(directory, 0, ".log")
    data = bytearray(segment.read_bytes())
    third = 2 * len(batches[0])  # every batch is the same size
    header = parse_header(data, third)
    stamp(data, third, header.base_offset + shift, header.partition_leader_epoch)
    segment.write_bytes(bytes(data))
    recovered = Log.open(directory, LogConfig(), clock=ManualClock(start_ms=T0), recovery_point=0)
    assert recovered.log_end_offset == 4
    assert recovered.truncated_on_recovery_bytes == len(batches[2])
    recovered.close()


def test_an_atomic_write_syncs_the_new_file_before_renaming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order that makes a checkpoint, partition.metadata or meta.properties "old or
    new, never torn" after a power loss: the new file's data is on disk before the
    rename makes it the name, and the directory after (a mutation dropping the file's
    fsync went unseen: only the directory's was checked)."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(f"fsync {Path(os.readlink(f'/proc/self/fd/{fd}')).name}")
        real_fsync(fd)

    def replace(src: str | Path, dst: str | Path) -> None:
        events.append(f"rename {Path(src).name} -> {Path(dst).name}")
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint_module.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint_module.os, "replace", replace)
    target = tmp_path / "state"
    checkpoint_module.write_bytes_atomically(target, b"new")
    assert events == [
        "fsync state.tmp",
        "rename state.tmp -> state",
        f"fsync {tmp_path.name}",
    ]
    assert target.read_bytes() == b"new"


def test_retention_and_producer_expiry_run_only_on_their_own_passes(tmp_path: Path) -> None:
    """The 250 ms pass flushes and removes retired files; retention and producer expiry
    visit every log too, and run only when the node says they are due (Kafka's
    log.retention.check.interval.ms, 5 min, and producer.id.expiration.check.interval.ms,
    10 min). Every pass used to run them: a broker with thousands of idle partitions
    spent a good part of a core on it."""
    clock = ManualClock(start_ms=T0)
    manager = ReplicaManager(LogManager(tmp_path, LogConfig(), clock=clock), broker_id=1)
    manager.startup()
    state = sole_leader("aged", {"retention.ms": "1000", "segment.bytes": "2000"})
    manager.apply_leader_and_isr(1, [state])
    partition = manager.get_partition("aged", 0)
    for i in range(3):  # one segment each
        batch = encode_batch(
            [b"%d" % i * 1500], timestamps_ms=[T0], producer_id=7, producer_epoch=0, base_sequence=i
        )
        partition.append(batch)
    clock.advance(2 * 24 * 3600 * 1000)  # past retention.ms and producer.id.expiration.ms

    manager.maintenance(checkpoint=True, retention=False, expire_producers=False)
    assert partition.info().log_start_offset == 0
    # The rolled segments were flushed all the same (the pass only skips logs with
    # nothing to flush or remove), and the checkpoint says so.
    checkpoint = OffsetCheckpointFile(tmp_path / RECOVERY_POINT_CHECKPOINT).read()
    assert checkpoint[("aged", 0)] == 2
    with partition.locked() as log:
        assert log is not None and log.producer_state.entry(7) is not None

    manager.maintenance(checkpoint=False, retention=True, expire_producers=False)
    assert partition.info().log_start_offset == 3
    with partition.locked() as log:
        assert log is not None and log.producer_state.entry(7) is not None

    manager.maintenance(checkpoint=False, retention=False, expire_producers=True)
    with partition.locked() as log:
        assert log is not None and log.producer_state.entry(7) is None
    manager.shutdown()


def test_a_slower_maintenance_step_is_due_once_per_interval() -> None:
    every = _Every(1_000)
    start = time.monotonic()
    assert not every(start)
    assert every(start + 1.0)
    assert not every(start + 1.5)  # counted from when it last ran
    assert every(start + 2.1)
