"""OffsetIndex and TimeIndex: floor lookups, fullness, truncation, trim/reopen, corruption.

Real memory-mapped files in ``tmp_path``; the models are plain Python lists.
"""

from __future__ import annotations

import bisect
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.storage.log import Log, LogConfig
from services.storage.log.errors import IndexCorruptError
from services.storage.log.index import OffsetIndex, TimeIndex
from tidelog import formats
from tidelog.batch import iter_batches
from tidelog.records import encode_batch

OFFSET_ENTRY = formats.OFFSET_INDEX_ENTRY_SIZE
TIME_ENTRY = formats.TIME_INDEX_ENTRY_SIZE
HYPOTHESIS_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def offset_index(
    path: Path, base: int = 0, max_bytes: int = 1024, *, writable: bool = True
) -> OffsetIndex:
    return OffsetIndex(path, base, max_bytes, writable)


def time_index(
    path: Path, base: int = 0, max_bytes: int = 1200, *, writable: bool = True
) -> TimeIndex:
    return TimeIndex(path, base, max_bytes, writable)


def model_floor(keys: list[int], key: int) -> int:
    """Slot of the largest key <= ``key`` in sorted ``keys``, or -1."""
    return bisect.bisect_right(keys, key) - 1


# --- strategies ---------------------------------------------------------------------------


@st.composite
def offset_entries(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]]]:
    """A base offset and strictly increasing (offset, position) pairs, positions > 0."""
    base = draw(st.integers(0, 1 << 40))
    relatives = sorted(draw(st.sets(st.integers(0, 5000), min_size=0, max_size=60)))
    positions = sorted(draw(st.sets(st.integers(1, 1 << 30), min_size=len(relatives))))
    positions = positions[: len(relatives)]
    return base, [(base + r, p) for r, p in zip(relatives, positions, strict=True)]


@st.composite
def time_entries(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]]]:
    """A base offset and (timestamp, offset) pairs; both strictly increasing."""
    base = draw(st.integers(0, 1 << 40))
    timestamps = sorted(draw(st.sets(st.integers(-1000, 1 << 42), max_size=60)))
    relatives = sorted(draw(st.sets(st.integers(0, 5000), min_size=len(timestamps))))
    relatives = relatives[: len(timestamps)]
    return base, [(t, base + r) for t, r in zip(timestamps, relatives, strict=True)]


# --- OffsetIndex ----------------------------------------------------------------------------


@HYPOTHESIS_SETTINGS
@given(data=offset_entries(), queries=st.lists(st.integers(-10, 5100), max_size=40))
def test_offset_index_floor_lookup_matches_model(
    tmp_path: Path, data: tuple[int, list[tuple[int, int]]], queries: list[int]
) -> None:
    base, entries = data
    with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
        index = offset_index(Path(scratch) / "x.index", base, max_bytes=OFFSET_ENTRY * 64)
        for offset, position in entries:
            index.append(offset, position)
        offsets = [o for o, _ in entries]
        # Every stored key, its neighbours, and random probes.
        probes = [base + q for q in queries] + [o + d for o in offsets for d in (-1, 0, 1)]
        for probe in probes:
            slot = model_floor(offsets, probe)
            expected = (base, 0) if slot < 0 else entries[slot]
            assert index.lookup(probe) == expected, probe
        assert index.entries == len(entries)
        assert index.last_offset == (offsets[-1] if offsets else base)
        # The same answers after trimming and reopening read-only.
        index.close()
        reopened = offset_index(Path(scratch) / "x.index", base, writable=False)
        assert reopened.entries == len(entries)
        for probe in probes:
            slot = model_floor(offsets, probe)
            assert reopened.lookup(probe) == ((base, 0) if slot < 0 else entries[slot])
        reopened.close()


@pytest.mark.parametrize("count", [255, 256, 257, 2_000])
def test_a_large_active_index_answers_like_its_mapped_copy(tmp_path: Path, count: int) -> None:
    """The active index is searched with reads (single entries, then the last window in
    one): past the window size the search takes both steps, which the small examples
    above never reach. Every key, its neighbours and the ends, active and reopened."""
    offsets_index = offset_index(tmp_path / "x.index", 100, max_bytes=OFFSET_ENTRY * count)
    times = time_index(tmp_path / "x.timeindex", 100, max_bytes=TIME_ENTRY * count)
    entries = [(100 + 3 * i + 1, 4096 * (i + 1)) for i in range(count)]
    stamps = [(1_000 + 7 * i, 100 + 3 * i + 1) for i in range(count)]
    for (offset, position), (timestamp, at) in zip(entries, stamps, strict=True):
        offsets_index.append(offset, position)
        times.maybe_append(timestamp, at)
    keys = [o for o, _ in entries]
    probes = [k + d for k in keys for d in (-1, 0, 1)] + [0, 99, 10**9]
    time_keys = [t for t, _ in stamps]
    time_probes = [t + d for t in time_keys for d in (-1, 0, 1)] + [-5, 10**12]

    def check(index: OffsetIndex, stamp_index: TimeIndex) -> None:
        for probe in probes:
            slot = model_floor(keys, probe)
            assert index.lookup(probe) == ((100, 0) if slot < 0 else entries[slot]), probe
        for probe in time_probes:
            slot = model_floor(time_keys, probe)
            assert stamp_index.lookup(probe) == ((-1, 100) if slot < 0 else stamps[slot]), probe

    check(offsets_index, times)
    active_answers = [times.lookup(p) for p in time_probes]
    offsets_index.close()
    times.close()
    reopened = offset_index(tmp_path / "x.index", 100, writable=False)
    reopened_times = time_index(tmp_path / "x.timeindex", 100, writable=False)
    check(reopened, reopened_times)
    assert [reopened_times.lookup(p) for p in time_probes] == active_answers
    reopened.close()
    reopened_times.close()


@HYPOTHESIS_SETTINGS
@given(data=offset_entries(), cut=st.integers(-5, 5100))
def test_offset_index_truncate_to_matches_model(
    tmp_path: Path, data: tuple[int, list[tuple[int, int]]], cut: int
) -> None:
    base, entries = data
    with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
        path = Path(scratch) / "x.index"
        index = offset_index(path, base, max_bytes=OFFSET_ENTRY * 64)
        for offset, position in entries:
            index.append(offset, position)
        index.truncate_to(base + cut)
        kept = [(o, p) for o, p in entries if o < base + cut]
        assert [index.entry(i) for i in range(index.entries)] == [(o - base, p) for o, p in kept]
        # Appending continues after the kept entries; a lookup past them finds the new one.
        next_offset = (kept[-1][0] + 1) if kept else base + 1
        next_position = (kept[-1][1] + 1) if kept else 1
        index.append(next_offset, next_position)
        assert index.lookup(next_offset + 100) == (next_offset, next_position)
        index.close()
        assert path.stat().st_size == (len(kept) + 1) * OFFSET_ENTRY


def test_offset_index_empty_lookup_is_scan_from_start(tmp_path: Path) -> None:
    index = offset_index(tmp_path / "a.index", base=100)
    assert index.entries == 0
    assert index.lookup(0) == (100, 0)
    assert index.lookup(100) == (100, 0)
    assert index.lookup(10**12) == (100, 0)
    assert index.last_offset == 100
    index.close()


def test_offset_index_rejects_bad_appends(tmp_path: Path) -> None:
    index = offset_index(tmp_path / "a.index", base=100)
    with pytest.raises(RuntimeError):
        index.append(99, 10)  # below the base offset
    with pytest.raises(RuntimeError):
        index.append(100 + formats.MAX_RELATIVE_OFFSET + 1, 10)  # relative offset overflow
    index.append(105, 10)
    with pytest.raises(RuntimeError):
        index.append(105, 20)  # not increasing
    with pytest.raises(RuntimeError):
        index.append(104, 20)
    assert index.entries == 1
    index.append(100 + formats.MAX_RELATIVE_OFFSET, 30)  # the largest relative offset fits
    assert index.lookup(10**15) == (100 + formats.MAX_RELATIVE_OFFSET, 30)
    index.close()


def test_offset_index_is_full_and_rounds_size_down(tmp_path: Path) -> None:
    # 50 bytes round down to 6 whole entries.
    index = offset_index(tmp_path / "a.index", max_bytes=50)
    assert (tmp_path / "a.index").stat().st_size == 48
    for i in range(6):
        assert not index.is_full
        index.append(i + 1, (i + 1) * 10)
    assert index.is_full
    with pytest.raises(RuntimeError):
        index.append(100, 1000)
    # Truncation frees room again.
    index.truncate_to(4)
    assert index.entries == 3
    assert not index.is_full
    index.append(4, 45)
    assert index.lookup(5) == (4, 45)
    index.close()


def test_truncating_a_trimmed_offset_index_shrinks_its_file(tmp_path: Path) -> None:
    """A sealed segment's index truncated (the log is truncated into it) stays trimmed:
    reopened, it has the kept entries, not zero slots counted as entries."""
    path = tmp_path / "a.index"
    index = offset_index(path, base=100)
    for i in range(1, 5):
        index.append(100 + 10 * i, 100 * i)
    index.trim()
    index.truncate_to(125)  # keeps 110 and 120
    assert path.stat().st_size == 2 * OFFSET_ENTRY
    index.close()
    reopened = offset_index(path, base=100, writable=False)
    assert reopened.entries == 2
    reopened.sanity_check(log_size_bytes=10_000)
    assert reopened.lookup(135) == (120, 200)
    reopened.close()


def test_an_index_larger_than_a_lowered_maximum_keeps_its_entries(tmp_path: Path) -> None:
    """segment.index.bytes lowered below an active segment's index: reopened writable, it
    keeps every entry (and is full, so the segment rolls) rather than being cut short."""
    path = tmp_path / "a.index"
    index = offset_index(path)
    for i in range(1, 11):
        index.append(i, 100 * i)
    index.close()
    smaller = offset_index(path, max_bytes=3 * OFFSET_ENTRY)
    assert smaller.entries == 10 and smaller.is_full
    assert smaller.lookup(7) == (7, 700)
    smaller.sanity_check(log_size_bytes=10_000)
    smaller.close()
    assert path.stat().st_size == 10 * OFFSET_ENTRY


def test_offset_index_trim_and_make_writable_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "a.index"
    index = offset_index(path, base=1000, max_bytes=4096)
    assert index.writable
    assert path.stat().st_size == 4096  # preallocated
    for i in range(1, 11):
        index.append(1000 + 10 * i, 100 * i)
    index.trim()
    assert not index.writable
    assert path.stat().st_size == 10 * OFFSET_ENTRY
    assert index.lookup(1055) == (1050, 500)
    with pytest.raises(RuntimeError):
        index.append(2000, 5000)  # a trimmed index takes no appends
    index.make_writable()
    assert index.writable
    assert path.stat().st_size == 4096
    index.append(2000, 5000)
    assert index.entries == 11
    assert index.lookup(3000) == (2000, 5000)
    assert index.lookup(1055) == (1050, 500)
    index.close()
    assert path.stat().st_size == 11 * OFFSET_ENTRY
    # Closing twice is harmless.
    index.close()


def test_offset_index_reopen_from_trimmed_file(tmp_path: Path) -> None:
    path = tmp_path / "a.index"
    index = offset_index(path, base=7, max_bytes=4096)
    for i in range(1, 6):
        index.append(7 + i * 3, i * 64)
    index.close()
    raw = path.read_bytes()
    assert len(raw) == 5 * OFFSET_ENTRY
    assert [formats.OFFSET_INDEX_ENTRY.unpack_from(raw, i * 8) for i in range(5)] == [
        (i * 3, i * 64) for i in range(1, 6)
    ]

    read_only = offset_index(path, base=7, max_bytes=4096, writable=False)
    assert read_only.entries == 5
    assert not read_only.writable
    assert not read_only.is_full
    assert read_only.lookup(16) == (16, 192)
    read_only.sanity_check(log_size_bytes=1000)
    read_only.close()
    assert path.stat().st_size == 5 * OFFSET_ENTRY  # a read-only open changes nothing

    writable = offset_index(path, base=7, max_bytes=4096, writable=True)
    assert path.stat().st_size == 4096
    assert writable.entries == 5
    writable.append(100, 2000)
    writable.close()
    assert path.stat().st_size == 6 * OFFSET_ENTRY


@pytest.mark.parametrize("size", [1, 7, 9, 4095])
def test_offset_index_bad_size_is_corrupt(tmp_path: Path, size: int) -> None:
    path = tmp_path / "a.index"
    path.write_bytes(bytes(size))
    with pytest.raises(IndexCorruptError):
        offset_index(path, writable=False)
    with pytest.raises(IndexCorruptError):
        offset_index(path, writable=True)
    assert path.stat().st_size == size  # the owner decides what to do with it


def test_offset_index_sanity_check(tmp_path: Path) -> None:
    def build(name: str, raw_entries: list[tuple[int, int]]) -> OffsetIndex:
        path = tmp_path / name
        path.write_bytes(b"".join(formats.OFFSET_INDEX_ENTRY.pack(*e) for e in raw_entries))
        return offset_index(path, writable=False)

    good = build("good.index", [(1, 100), (5, 900)])
    good.sanity_check(log_size_bytes=1000)
    with pytest.raises(IndexCorruptError):
        good.sanity_check(log_size_bytes=900)  # last position at the end of the log
    good.close()

    empty = build("empty.index", [])
    empty.sanity_check(log_size_bytes=0)
    empty.close()

    zero_position = build("zero.index", [(0, 0)])
    with pytest.raises(IndexCorruptError):
        zero_position.sanity_check(log_size_bytes=1000)
    zero_position.close()

    not_increasing = build("dec.index", [(5, 100), (3, 200)])
    with pytest.raises(IndexCorruptError):
        not_increasing.sanity_check(log_size_bytes=1000)
    not_increasing.close()

    not_increasing_positions = build("decpos.index", [(3, 200), (5, 100)])
    with pytest.raises(IndexCorruptError):
        not_increasing_positions.sanity_check(log_size_bytes=1000)
    not_increasing_positions.close()


def test_offset_index_preallocated_after_crash_fails_sanity_check(tmp_path: Path) -> None:
    """An untrimmed file (process died while the segment was active) counts zero slots as
    entries; the sanity check must notice so the owner rebuilds."""
    path = tmp_path / "a.index"
    index = offset_index(path, max_bytes=4096)
    index.append(3, 100)
    index.append(8, 300)
    index.flush()
    crashed = tmp_path / "copy.index"
    crashed.write_bytes(path.read_bytes())  # as it is on disk while still open
    index.close()
    assert crashed.stat().st_size == 4096
    reopened = offset_index(crashed, writable=False)
    assert reopened.entries == 4096 // OFFSET_ENTRY
    with pytest.raises(IndexCorruptError):
        reopened.sanity_check(log_size_bytes=10_000)
    reopened.close()


def test_offset_index_reset_drops_every_entry(tmp_path: Path) -> None:
    path = tmp_path / "a.index"
    index = offset_index(path)
    for i in range(1, 5):
        index.append(i, i * 10)
    index.reset()
    assert index.entries == 0
    assert index.lookup(3) == (0, 0)
    index.append(2, 20)
    index.close()
    assert path.read_bytes() == formats.OFFSET_INDEX_ENTRY.pack(2, 20)


def test_index_writes_go_through_the_file_and_the_mapping_is_read_only(tmp_path: Path) -> None:
    """Appends are pwrite calls and lookups read the mapping (one page cache): a store into
    the mapping could page-fault while holding the GIL (module docstring), so the mapping
    refuses stores."""
    path = tmp_path / "a.index"
    index = offset_index(path, max_bytes=64 * 1024)
    for i in range(1, 600):  # past the first 4 KiB page of the mapping
        index.append(i, i * 10)
    assert index.lookup(599) == (599, 5_990) and index.lookup(300) == (300, 3_000)
    with open(path, "rb") as raw:
        raw.seek(598 * formats.OFFSET_INDEX_ENTRY.size)
        assert raw.read(formats.OFFSET_INDEX_ENTRY.size) == formats.OFFSET_INDEX_ENTRY.pack(
            599, 5_990
        )
    with pytest.raises(TypeError):
        index._mm[0:1] = b"x"  # type: ignore[index]
    index.truncate_to(400)
    assert index.entries == 399 and index.lookup(599) == (399, 3_990)
    index.close()
    assert path.stat().st_size == 399 * formats.OFFSET_INDEX_ENTRY.size


# --- TimeIndex ------------------------------------------------------------------------------


@HYPOTHESIS_SETTINGS
@given(data=time_entries(), queries=st.lists(st.integers(-2000, (1 << 42) + 10), max_size=40))
def test_time_index_floor_lookup_matches_model(
    tmp_path: Path, data: tuple[int, list[tuple[int, int]]], queries: list[int]
) -> None:
    base, entries = data
    with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
        index = time_index(Path(scratch) / "x.timeindex", base, max_bytes=TIME_ENTRY * 64)
        for timestamp, offset in entries:
            index.maybe_append(timestamp, offset)
            # A timestamp that did not grow adds nothing.
            index.maybe_append(timestamp, offset + 1)
            index.maybe_append(timestamp - 1, offset + 1)
        assert index.entries == len(entries)
        timestamps = [t for t, _ in entries]
        probes = queries + [t + d for t in timestamps for d in (-1, 0, 1)]
        for probe in probes:
            slot = model_floor(timestamps, probe)
            assert index.lookup(probe) == ((-1, base) if slot < 0 else entries[slot]), probe
        assert index.last_timestamp_ms == (timestamps[-1] if timestamps else -1)
        index.close()
        reopened = time_index(Path(scratch) / "x.timeindex", base, writable=False)
        for probe in probes:
            slot = model_floor(timestamps, probe)
            assert reopened.lookup(probe) == ((-1, base) if slot < 0 else entries[slot])
        reopened.close()


@HYPOTHESIS_SETTINGS
@given(data=time_entries(), cut=st.integers(-5, 5100))
def test_time_index_truncate_to_matches_model(
    tmp_path: Path, data: tuple[int, list[tuple[int, int]]], cut: int
) -> None:
    base, entries = data
    with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
        path = Path(scratch) / "x.timeindex"
        index = time_index(path, base, max_bytes=TIME_ENTRY * 64)
        for timestamp, offset in entries:
            index.maybe_append(timestamp, offset)
        index.truncate_to(base + cut)
        kept = [(t, o) for t, o in entries if o < base + cut]
        assert [index.entry(i) for i in range(index.entries)] == [(t, o - base) for t, o in kept]
        assert index.last_timestamp_ms == (kept[-1][0] if kept else -1)
        index.close()
        assert path.stat().st_size == len(kept) * TIME_ENTRY


def test_time_index_full_trim_reopen(tmp_path: Path) -> None:
    path = tmp_path / "a.timeindex"
    index = time_index(path, base=50, max_bytes=50)  # rounds down to 4 entries
    assert path.stat().st_size == 48
    for i in range(4):
        assert not index.is_full
        index.maybe_append(1000 + i, 50 + i)
    assert index.is_full
    with pytest.raises(RuntimeError):
        index.maybe_append(5000, 60)
    index.maybe_append(1003, 60)  # not newer: ignored even when full
    index.trim()
    assert path.stat().st_size == 48
    index.make_writable()
    index.truncate_to(52)
    assert index.entries == 2
    index.maybe_append(2000, 70)
    assert index.lookup(1500) == (1001, 51)
    assert index.lookup(2500) == (2000, 70)
    index.close()
    assert path.stat().st_size == 3 * TIME_ENTRY
    reopened = time_index(path, base=50, writable=False)
    assert [reopened.entry(i) for i in range(3)] == [(1000, 0), (1001, 1), (2000, 20)]
    reopened.sanity_check(log_size_bytes=100)
    reopened.close()


@pytest.mark.parametrize("size", [1, 8, 13, 100])
def test_time_index_bad_size_is_corrupt(tmp_path: Path, size: int) -> None:
    path = tmp_path / "a.timeindex"
    path.write_bytes(bytes(size))
    with pytest.raises(IndexCorruptError):
        time_index(path, writable=False)


def test_time_index_sanity_check(tmp_path: Path) -> None:
    def build(name: str, raw_entries: list[tuple[int, int]]) -> TimeIndex:
        path = tmp_path / name
        path.write_bytes(b"".join(formats.TIME_INDEX_ENTRY.pack(*e) for e in raw_entries))
        return time_index(path, writable=False)

    good = build("good.timeindex", [(10, 1), (20, 5)])
    good.sanity_check(log_size_bytes=100)
    with pytest.raises(IndexCorruptError):
        good.sanity_check(log_size_bytes=0)  # entries for an empty log
    good.close()

    not_increasing = build("dec.timeindex", [(20, 1), (10, 5)])
    with pytest.raises(IndexCorruptError):
        not_increasing.sanity_check(log_size_bytes=100)
    not_increasing.close()

    # A preallocated, untrimmed file: trailing zero slots end with timestamp 0.
    crashed = build("crash.timeindex", [(1_700_000_000_000, 3), (0, 0), (0, 0)])
    with pytest.raises(IndexCorruptError):
        crashed.sanity_check(log_size_bytes=100)
    crashed.close()

    empty = build("empty.timeindex", [])
    empty.sanity_check(log_size_bytes=0)
    empty.close()


def test_an_untrimmed_index_is_refused_from_its_last_slot(tmp_path: Path) -> None:
    """Each active index of a broker killed with thousands of partitions is a preallocated
    file ending in zero slots: the check refuses it from its last slot, before decoding
    any chunk (a restart after kill -9 spent ~3 ms per partition decoding zeros). A
    single entry of zeros is a real one for a time index (a record of 1970 at offset 0)."""
    path = tmp_path / "a.index"
    index = offset_index(path, max_bytes=1 << 20)
    index.append(3, 100)
    index.flush()
    crashed = tmp_path / "copy.index"
    crashed.write_bytes(path.read_bytes())
    index.close()
    reopened = offset_index(crashed, writable=False)
    with pytest.raises(IndexCorruptError, match="ends in zero slots"):
        reopened.sanity_check(log_size_bytes=10_000)
    reopened.close()

    timed = tmp_path / "a.timeindex"
    timed.write_bytes(formats.TIME_INDEX_ENTRY.pack(1_700_000_000_000, 3) + bytes(12 * 1000))
    untrimmed = time_index(timed, writable=False)
    with pytest.raises(IndexCorruptError, match="ends in zero slots"):
        untrimmed.sanity_check(log_size_bytes=100)
    untrimmed.close()
    timed.write_bytes(formats.TIME_INDEX_ENTRY.pack(0, 0))
    of_1970 = time_index(timed, writable=False)
    of_1970.sanity_check(log_size_bytes=100)
    of_1970.close()


def test_offset_index_sanity_check_reads_every_entry(tmp_path: Path) -> None:
    """Every entry is checked at load, not just the first and last: one out of order in
    the middle, an offset at or past the next segment's base offset, or a last position
    with no room for a batch header is damage (the owner rebuilds from the log)."""

    def build(name: str, raw_entries: list[tuple[int, int]]) -> OffsetIndex:
        path = tmp_path / name
        path.write_bytes(b"".join(formats.OFFSET_INDEX_ENTRY.pack(*e) for e in raw_entries))
        return offset_index(path, writable=False)

    middle = build("middle.index", [(1, 100), (9, 500), (5, 700), (12, 900)])
    with pytest.raises(IndexCorruptError):
        middle.sanity_check(log_size_bytes=1000)
    middle.close()
    middle_position = build("midpos.index", [(1, 100), (5, 800), (9, 700), (12, 900)])
    with pytest.raises(IndexCorruptError):
        middle_position.sanity_check(log_size_bytes=1000)
    middle_position.close()

    good = build("good.index", [(1, 100), (5, 500), (9, 900)])
    good.sanity_check(log_size_bytes=900 + formats.BATCH_HEADER_SIZE, end_offset=10)
    with pytest.raises(IndexCorruptError):
        good.sanity_check(log_size_bytes=900 + formats.BATCH_HEADER_SIZE - 1)
    with pytest.raises(IndexCorruptError):
        good.sanity_check(log_size_bytes=1000, end_offset=9)  # 9 is the next segment's
    good.close()


def test_time_index_sanity_check_reads_every_entry(tmp_path: Path) -> None:
    def build(name: str, raw_entries: list[tuple[int, int]]) -> TimeIndex:
        path = tmp_path / name
        path.write_bytes(b"".join(formats.TIME_INDEX_ENTRY.pack(*e) for e in raw_entries))
        return time_index(path, writable=False)

    middle = build("middle.timeindex", [(10, 1), (30, 2), (20, 3), (40, 4)])
    with pytest.raises(IndexCorruptError):
        middle.sanity_check(log_size_bytes=100)
    middle.close()
    offsets_decrease = build("offsets.timeindex", [(10, 1), (20, 15), (30, 3), (40, 4)])
    with pytest.raises(IndexCorruptError):
        offsets_decrease.sanity_check(log_size_bytes=100)
    offsets_decrease.close()

    # Offsets may repeat (never decrease); they must stay below the next segment's base.
    good = build("good.timeindex", [(-1, 0), (10, 1), (20, 4), (30, 4)])
    good.sanity_check(log_size_bytes=100, end_offset=5)
    with pytest.raises(IndexCorruptError):
        good.sanity_check(log_size_bytes=100, end_offset=4)
    good.close()


def test_sanity_checks_of_many_entries_span_chunks(tmp_path: Path) -> None:
    """The checks decode entries in chunks: a fault right after a chunk boundary counts."""
    count = (1 << 16) + 5
    entries = [(i + 1, 10 * (i + 1)) for i in range(count)]
    path = tmp_path / "many.index"
    path.write_bytes(b"".join(formats.OFFSET_INDEX_ENTRY.pack(*e) for e in entries))
    index = offset_index(path, writable=False)
    index.sanity_check(log_size_bytes=10 * count + 100)
    index.close()
    entries[1 << 16] = (entries[(1 << 16) - 1][0], entries[1 << 16][1])  # repeats the last
    path.write_bytes(b"".join(formats.OFFSET_INDEX_ENTRY.pack(*e) for e in entries))
    index = offset_index(path, writable=False)
    with pytest.raises(IndexCorruptError):
        index.sanity_check(log_size_bytes=10 * count + 100)
    index.close()


# --- file descriptors -----------------------------------------------------------------------


def open_fds(*paths: Path) -> dict[str, int]:
    """File name -> descriptors of this process open on it (mmaps hold one each)."""
    counts = dict.fromkeys((p.name for p in paths), 0)
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed since
        name = os.path.basename(target)
        if name in counts and os.path.dirname(target) == str(paths[0].parent):
            counts[name] += 1
    return counts


def test_a_segment_holds_one_descriptor_per_file_active_or_rolled(tmp_path: Path) -> None:
    """The index kept its own descriptor next to the one Python's mmap duplicates, so
    every segment held five for its lifetime (found by an audit; brokers with 3,000
    partitions ran out). The active index has only its own and no mapping; an inactive
    one keeps only the mapping's, and reopens the file for a change or an fsync."""
    config = LogConfig(index_interval_bytes=0)
    log = Log.open(tmp_path / "p-0", config)
    for i in range(5):
        log.append(encode_batch([b"v%d" % i]))
    files = [
        log.dir / formats.segment_file_name(0, suffix)
        for suffix in (formats.LOG_SUFFIX, formats.INDEX_SUFFIX, formats.TIME_INDEX_SUFFIX)
    ]
    assert open_fds(*files) == dict.fromkeys((f.name for f in files), 1)
    assert next(h.base_offset for _, h in iter_batches(log.read(3, 1 << 20))) == 3
    assert log.offset_for_timestamp(0) is not None
    log.roll()
    log.append(encode_batch([b"next"]))
    assert open_fds(*files) == dict.fromkeys((f.name for f in files), 1)
    log.flush()  # fsyncs the rolled indexes through descriptors opened for it
    assert open_fds(*files) == dict.fromkeys((f.name for f in files), 1)
    assert next(h.base_offset for _, h in iter_batches(log.read(3, 1 << 20))) == 3
    log.close()
    assert open_fds(*files) == dict.fromkeys((f.name for f in files), 0)
    # Loaded from disk, an old segment's indexes are read-only from the start.
    log = Log.open(tmp_path / "p-0", config, recovery_point=6)
    assert open_fds(*files) == dict.fromkeys((f.name for f in files), 1)
    assert log.offset_for_timestamp(0) is not None
    # Truncated into the old segment, it becomes the active one and writes again.
    log.truncate_to(2)
    assert log.log_end_offset == 2 and log.segment_base_offsets == [0]
    log.append(encode_batch([b"again"]))
    log.roll()
    log.append(encode_batch([b"after"]))
    log.flush()
    assert open_fds(*files) == dict.fromkeys((f.name for f in files), 1)
    assert [h.base_offset for _, h in iter_batches(log.read(0, 1 << 20))] == [0, 1, 2]
    log.close()
