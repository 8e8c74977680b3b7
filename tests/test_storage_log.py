"""The partition log (``services.storage.log``): append, read, roll, flush, retention,
truncation, timestamps, input validation and configuration.

Everything runs on real files in ``tmp_path`` with a ``ManualClock``. A small model keeps
the bytes every batch must have on disk after the broker stamped it, so reads are compared
byte for byte, not just decoded.
"""

from __future__ import annotations

import errno
import functools
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.storage.log import AppendInfo, Log, LogConfig
from services.storage.log.config import TOPIC_CONFIG_FIELDS
from services.storage.log.log import min_plain_body_bytes
from tidelog import formats as f
from tidelog.batch import crc32c, parse_header, stamp
from tidelog.clock import ManualClock
from tidelog.errors import (
    CorruptBatchError,
    InvalidConfigError,
    InvalidFetchSizeError,
    InvalidRecordError,
    InvalidRequestError,
    InvalidTimestampError,
    MessageTooLargeError,
    OffsetOutOfRangeError,
    StorageError,
)
from tidelog.records import decode_batches, encode_batch

T0 = 1_700_000_000_000  # ManualClock's default start
DAY_MS = 24 * 60 * 60 * 1000


# --- helpers ----------------------------------------------------------------------------------


def make_batch(
    n: int = 3, value_size: int = 40, *, ts: int | list[int] = T0, tag: int = 0
) -> bytes:
    """An encoded batch of ``n`` records; ``ts`` is one timestamp for all, or one per record."""
    values = [bytes([(tag + i) % 251]) * value_size for i in range(n)]
    timestamps = ts if isinstance(ts, list) else [ts] * n
    return encode_batch(values, timestamps_ms=timestamps)


def reseal(buf: bytearray, position: int = 0) -> bytearray:
    """Recompute both checksums of the batch at ``position`` after editing its fields."""
    size = f.LOG_OVERHEAD + f.I32.unpack_from(buf, position + f.BATCH_LENGTH_OFFSET)[0]
    body_crc = crc32c(memoryview(buf)[position + f.BODY_CRC_START : position + size])
    f.U32.pack_into(buf, position + f.CRC_OFFSET, body_crc)
    header_crc = crc32c(memoryview(buf)[position : position + f.HEADER_CRC_OFFSET])
    f.U32.pack_into(buf, position + f.HEADER_CRC_OFFSET, header_crc)
    return buf


def dir_state(directory: Path) -> dict[str, int]:
    """File name -> size: what a rejected append must leave untouched."""
    return {p.name: p.stat().st_size for p in sorted(directory.iterdir())}


def open_log(directory: Path, config: LogConfig | None = None, **kwargs: object) -> Log:
    kwargs.setdefault("clock", ManualClock())
    return Log.open(directory, config or LogConfig(), **kwargs)  # type: ignore[arg-type]


@dataclass
class Stored:
    base_offset: int
    last_offset: int
    data: bytes  # exactly as the log must hold it (stamped)
    max_timestamp: int
    timestamps: list[int]


class Model:
    """A log plus the batches it must contain, in offset order."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.batches: list[Stored] = []

    def append(self, *raw: bytes, epoch: int = 0) -> AppendInfo:
        info = self.log.append(b"".join(raw), epoch)
        offset = info.first_offset
        for batch in raw:
            header = parse_header(batch)
            stamped = bytearray(batch)
            stamp(stamped, 0, offset, epoch)
            records = decode_batches(batch)[0].records
            self.batches.append(
                Stored(
                    offset,
                    offset + header.record_count - 1,
                    bytes(stamped),
                    header.max_timestamp,
                    [r.timestamp_ms for r in records],
                )
            )
            offset += header.record_count
        assert offset == info.last_offset + 1
        return info

    def truncate(self, offset: int) -> None:
        """Model of truncate_to: drop the batch holding ``offset`` and all after."""
        self.batches = [b for b in self.batches if b.last_offset < offset]

    def drop_below(self, offset: int) -> None:
        self.batches = [b for b in self.batches if b.base_offset >= offset]

    @property
    def end_offset(self) -> int:
        return self.batches[-1].last_offset + 1 if self.batches else 0

    def expected_read(self, offset: int, max_bytes: int, max_offset: int | None = None) -> bytes:
        """What ``read`` must return: whole batches from the one holding ``offset``, only
        from its segment, within ``max_bytes`` (but at least one), ending before
        ``max_offset``."""
        if max_offset is not None and offset >= max_offset:
            return b""
        index = next((i for i, b in enumerate(self.batches) if b.last_offset >= offset), None)
        if index is None:
            return b""
        first = self.batches[index]
        later_bases = [b for b in self.log.segment_base_offsets if b > first.base_offset]
        segment_end = later_bases[0] if later_bases else 1 << 63
        if max_offset is not None and first.last_offset >= max_offset:
            return b""
        out = [first.data]
        total = len(first.data)
        for batch in self.batches[index + 1 :]:
            if batch.base_offset >= segment_end or total + len(batch.data) > max_bytes:
                break
            if max_offset is not None and batch.last_offset >= max_offset:
                break
            out.append(batch.data)
            total += len(batch.data)
        return b"".join(out)

    def all_bytes(self) -> bytes:
        return b"".join(b.data for b in self.batches)


def read_all(log: Log, max_bytes: int = 1 << 20) -> bytes:
    """Everything from the log start to the log end, following segment boundaries."""
    out = []
    offset = log.log_start_offset
    while True:
        data = log.read(offset, max_bytes)
        if not data:
            break
        batches = decode_batches(data)
        assert batches[0].base_offset <= offset <= batches[0].last_offset or (
            batches[0].base_offset == offset
        )
        out.append(data)
        offset = batches[-1].next_offset
    assert offset == log.log_end_offset
    return b"".join(out)


def assert_segment_files(log: Log) -> None:
    """The .log files on disk are exactly the segments, named %020d of the base offsets."""
    logs = sorted(p.name for p in log.dir.iterdir() if p.name.endswith(".log"))
    assert logs == [f"{base:020d}.log" for base in log.segment_base_offsets]
    for base in log.segment_base_offsets:
        assert (log.dir / f"{base:020d}.index").exists()
        assert (log.dir / f"{base:020d}.timeindex").exists()


# --- appending and offsets -----------------------------------------------------------------


def test_append_assigns_contiguous_offsets(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    model = Model(log)
    assert (log.log_start_offset, log.log_end_offset) == (0, 0)
    assert model.append(make_batch(1)) == AppendInfo(0, 0)
    assert model.append(make_batch(5)) == AppendInfo(1, 5)
    # Several batches in one request get consecutive ranges.
    assert model.append(make_batch(2), make_batch(3), make_batch(1)) == AppendInfo(6, 11)
    # The producer's own base offset is ignored and rewritten.
    odd = bytearray(make_batch(4))
    stamp(odd, 0, 12345, 7)
    assert model.append(bytes(odd), epoch=3) == AppendInfo(12, 15)
    assert log.log_end_offset == 16

    data = read_all(log)
    assert data == model.all_bytes()
    batches = decode_batches(data)
    offsets = [r.offset for b in batches for r in b.records]
    assert offsets == list(range(16))
    assert [b.partition_leader_epoch for b in batches] == [0, 0, 0, 0, 0, 3]
    log.close()


def test_one_append_of_more_batches_than_one_pwritev_takes(tmp_path: Path) -> None:
    """A leader append writes two buffers a batch (the stamped prefix, then the rest from
    the request); 1,500 batches are 3,000 buffers, more than one pwritev takes (1,024)."""
    log = open_log(tmp_path / "p-0")
    model = Model(log)
    batches = [make_batch(1, value_size=i % 7, tag=i) for i in range(1_500)]
    assert model.append(*batches) == AppendInfo(0, 1_499)
    assert read_all(log) == model.all_bytes()
    assert [r.offset for b in decode_batches(read_all(log)) for r in b.records] == list(
        range(1_500)
    )
    log.close()


def test_append_accepts_bytearray_and_memoryview(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    raw = make_batch(2)
    assert log.append(bytearray(raw)) == AppendInfo(0, 1)
    assert log.append(memoryview(raw)) == AppendInfo(2, 3)
    assert raw == make_batch(2)  # the caller's buffer is not modified
    log.close()


def test_appended_batches_keep_producer_fields(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    raw = encode_batch(
        [b"a", None, b"c"],
        keys=[b"k", None, b"z"],
        headers=[[("h", b"1")], [], [("x", None)]],
        timestamps_ms=[T0, T0 + 5, T0 - 3],
        compression="zstd",
        producer_id=42,
        producer_epoch=1,
        # 0: an idempotent producer unknown to the partition must start at sequence 0
        # (producer-state validation, tests/test_producer_state.py).
        base_sequence=0,
    )
    log.append(make_batch(2))
    log.append(raw, 4)
    [batch] = decode_batches(log.read(2, 1 << 20))
    assert (batch.base_offset, batch.partition_leader_epoch) == (2, 4)
    assert (batch.producer_id, batch.producer_epoch, batch.base_sequence) == (42, 1, 0)
    assert [(r.offset, r.key, r.value, r.headers, r.timestamp_ms) for r in batch.records] == [
        (2, b"k", b"a", (("h", b"1"),), T0),
        (3, None, None, (), T0 + 5),
        (4, b"z", b"c", (("x", None),), T0 - 3),
    ]
    log.close()


# --- reading --------------------------------------------------------------------------------


def test_read_returns_whole_batches_from_the_one_holding_the_offset(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    model = Model(log)
    for n in (3, 1, 4, 2, 5):
        model.append(make_batch(n, tag=n))
    for offset in range(log.log_end_offset):
        data = log.read(offset, 1 << 20)
        assert data == model.expected_read(offset, 1 << 20)
        first = decode_batches(data)[0]
        assert first.base_offset <= offset <= first.last_offset
    # Offset 4 is inside the third batch [4, 7]: the answer starts at offset 4's batch.
    assert decode_batches(log.read(5, 1 << 20))[0].base_offset == 4
    log.close()


def test_read_honours_max_bytes_but_returns_at_least_one_batch(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    model = Model(log)
    for i in range(6):
        model.append(make_batch(2, value_size=100, tag=i))
    size = len(model.batches[0].data)
    assert all(len(b.data) == size for b in model.batches)
    for max_bytes in (0, 1, size - 1):
        assert log.read(0, max_bytes) == model.batches[0].data
    assert log.read(0, size) == model.batches[0].data
    assert log.read(0, size + 1) == model.batches[0].data
    assert log.read(0, 2 * size) == model.batches[0].data + model.batches[1].data
    assert log.read(0, 3 * size - 1) == model.batches[0].data + model.batches[1].data
    assert log.read(3, 3 * size) == b"".join(b.data for b in model.batches[1:4])
    assert log.read(0, 1 << 30) == model.all_bytes()
    with pytest.raises(InvalidFetchSizeError):
        log.read(0, -1)
    log.close()


def test_read_of_many_small_batches_honours_max_offset(tmp_path: Path) -> None:
    """More than 64 batches in one read take another path than a few do: it too stops
    before the high watermark, never handing out the uncommitted batch at it (a mutation
    letting that one through went unseen by the three-batch test above)."""
    log = open_log(tmp_path / "p-0")
    model = Model(log)
    for i in range(200):
        model.append(make_batch(1, tag=i))
    for high_watermark in (1, 63, 64, 65, 100, 150, 199, 200):
        for max_bytes in (1 << 20, 5000):
            data = log.read(0, max_bytes, max_offset=high_watermark)
            assert data == model.expected_read(0, max_bytes, high_watermark)
            offsets = [b.header.last_offset for b in decode_batches(data)]
            assert offsets and offsets[-1] < high_watermark
    log.close()


def test_read_honours_max_offset(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    model = Model(log)
    for n in (2, 3, 2):  # offsets [0,1] [2,4] [5,6]
        model.append(make_batch(n, tag=n))
    big = 1 << 20
    assert log.read(0, big, max_offset=7) == model.all_bytes()
    assert log.read(0, big, max_offset=5) == model.batches[0].data + model.batches[1].data
    # A batch is returned only if it ends before max_offset.
    assert log.read(0, big, max_offset=4) == model.batches[0].data
    assert log.read(0, big, max_offset=2) == model.batches[0].data
    assert log.read(0, big, max_offset=1) == b""
    assert log.read(2, big, max_offset=4) == b""
    assert log.read(3, big, max_offset=3) == b""
    assert log.read(5, big, max_offset=5) == b""
    for max_offset in range(8):
        for offset in range(7):
            assert log.read(offset, big, max_offset) == model.expected_read(offset, big, max_offset)
    log.close()


def test_read_at_end_and_out_of_range(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    assert log.read(0, 100) == b""  # empty log: the end is offset 0
    with pytest.raises(OffsetOutOfRangeError):
        log.read(1, 100)
    log.append(make_batch(3))
    assert log.read(3, 100) == b""
    with pytest.raises(OffsetOutOfRangeError):
        log.read(4, 100)
    with pytest.raises(OffsetOutOfRangeError):
        log.read(-1, 100)
    log.truncate_fully_and_start_at(50)
    assert log.read(50, 100) == b""
    for offset in (0, 49, 51):
        with pytest.raises(OffsetOutOfRangeError):
            log.read(offset, 100)
    log.close()


def test_read_across_segment_boundaries(tmp_path: Path) -> None:
    size = len(make_batch(3))
    config = LogConfig(segment_bytes=3 * size, index_interval_bytes=0)
    log = open_log(tmp_path / "p-0", config)
    model = Model(log)
    for i in range(10):
        model.append(make_batch(3, tag=i))
    assert log.segment_base_offsets == [0, 9, 18, 27]
    # One read never crosses a segment: reading from offset 6 with room for everything
    # stops at the end of the first segment.
    assert log.read(6, 1 << 20) == model.batches[2].data
    assert log.read(8, 1 << 20) == model.batches[2].data
    assert log.read(9, 1 << 20) == b"".join(b.data for b in model.batches[3:6])
    assert log.read(27, 1 << 20) == model.batches[9].data
    for offset in range(log.log_end_offset):
        for max_bytes in (1, size, 2 * size, 1 << 20):
            assert log.read(offset, max_bytes) == model.expected_read(offset, max_bytes)
    assert read_all(log) == model.all_bytes()
    assert read_all(log, max_bytes=1) == model.all_bytes()
    log.close()


@st.composite
def log_scenarios(draw: st.DrawFn) -> dict[str, object]:
    sizes = draw(
        st.lists(st.tuples(st.integers(1, 12), st.integers(0, 200)), min_size=1, max_size=35)
    )
    groups: list[int] = []
    remaining = len(sizes)
    while remaining:
        take = draw(st.integers(1, min(3, remaining)))
        groups.append(take)
        remaining -= take
    return {
        "sizes": sizes,
        "groups": groups,
        "index_interval_bytes": draw(st.integers(0, 3000)),
        "segment_bytes": draw(st.integers(300, 8000)),
        "max_bytes": draw(st.sampled_from([0, 1, 200, 1000, 4000, 1 << 20])),
    }


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(scenario=log_scenarios())
def test_random_offset_lookup_model(tmp_path: Path, scenario: dict[str, object]) -> None:
    """Random batch sizes and index intervals: every offset reads back the right batches."""
    sizes: list[tuple[int, int]] = scenario["sizes"]  # type: ignore[assignment]
    groups: list[int] = scenario["groups"]  # type: ignore[assignment]
    max_bytes: int = scenario["max_bytes"]  # type: ignore[assignment]
    config = LogConfig(
        segment_bytes=scenario["segment_bytes"],  # type: ignore[arg-type]
        index_interval_bytes=scenario["index_interval_bytes"],  # type: ignore[arg-type]
    )
    with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
        log = open_log(Path(scratch) / "p-0", config)
        model = Model(log)
        batches = [make_batch(n, size, tag=i) for i, (n, size) in enumerate(sizes)]
        position = 0
        for take in groups:
            model.append(*batches[position : position + take])
            position += take

        def check(current: Log) -> None:
            model.log = current
            for offset in range(current.log_end_offset):
                data = current.read(offset, max_bytes)
                assert data == model.expected_read(offset, max_bytes), offset
                first = decode_batches(data)[0]
                assert first.base_offset <= offset <= first.last_offset
                assert any(r.offset == offset for r in first.records)
            assert current.read(current.log_end_offset, max_bytes) == b""

        check(log)
        assert_segment_files(log)
        bases = log.segment_base_offsets
        log.close()
        # The indexes written while appending and the ones rebuilt on recovery agree with
        # the log.
        reopened = open_log(Path(scratch) / "p-0", config)
        assert reopened.segment_base_offsets == bases
        assert reopened.truncated_on_recovery_bytes == 0
        check(reopened)
        reopened.close()


# --- rolling ----------------------------------------------------------------------------------


def test_roll_on_segment_bytes(tmp_path: Path) -> None:
    size = len(make_batch(2))
    log = open_log(tmp_path / "p-0", LogConfig(segment_bytes=3 * size))
    model = Model(log)
    for i in range(8):
        model.append(make_batch(2, tag=i))
    # A segment rolls once the next batch would take it past segment_bytes.
    assert log.segment_base_offsets == [0, 6, 12]
    assert [(log.dir / f"{b:020d}.log").stat().st_size for b in (0, 6, 12)] == [
        3 * size,
        3 * size,
        2 * size,
    ]
    assert_segment_files(log)
    # Rolled segments have trimmed indexes; the active one is preallocated.
    assert (log.dir / f"{0:020d}.index").stat().st_size < LogConfig().segment_index_bytes
    assert (log.dir / f"{12:020d}.index").stat().st_size == LogConfig().segment_index_bytes
    assert read_all(log) == model.all_bytes()
    log.close()
    assert (log.dir / f"{12:020d}.index").stat().st_size < LogConfig().segment_index_bytes


def test_roll_on_segment_bytes_one_byte_short(tmp_path: Path) -> None:
    size = len(make_batch(2))
    log = open_log(tmp_path / "p-0", LogConfig(segment_bytes=3 * size - 1))
    for i in range(5):
        log.append(make_batch(2, tag=i))
    assert log.segment_base_offsets == [0, 4, 8]
    log.close()


def test_batch_larger_than_segment_goes_into_a_fresh_segment(tmp_path: Path) -> None:
    small, large = make_batch(1, 10), make_batch(4, 500)
    config = LogConfig(segment_bytes=len(large) // 2)
    log = open_log(tmp_path / "p-0", config)
    model = Model(log)
    model.append(small)
    model.append(large)  # does not fit with the small one: roll, then write it whole
    model.append(small)
    assert log.segment_base_offsets == [0, 1, 5]
    assert read_all(log) == model.all_bytes()
    log.close()


def test_roll_on_segment_ms(tmp_path: Path) -> None:
    clock = ManualClock()
    log = open_log(tmp_path / "p-0", LogConfig(segment_ms=1000), clock=clock)
    log.append(make_batch(1, ts=clock.now_ms()))
    clock.advance(1000)
    log.append(make_batch(1, ts=clock.now_ms()))  # exactly segment.ms old: not yet
    assert log.segment_base_offsets == [0]
    clock.advance(1)
    log.append(make_batch(1, ts=clock.now_ms()))
    assert log.segment_base_offsets == [0, 2]
    # The new segment's age counts from its first batch.
    clock.advance(1000)
    log.append(make_batch(1, ts=clock.now_ms()))
    assert log.segment_base_offsets == [0, 2]
    clock.advance(1)
    log.append(make_batch(1, ts=clock.now_ms()))
    assert log.segment_base_offsets == [0, 2, 4]
    log.close()


def test_segment_ms_age_survives_restarts(tmp_path: Path) -> None:
    """segment.ms counts from the first batch's max timestamp (Kafka's
    rollingBasedTimestamp), not from when this process opened the segment: a broker
    restarted every 3 days used to never roll a 7-day segment, so retention.ms (which
    never deletes the active segment) kept its data for ever."""
    clock = ManualClock()
    directory = tmp_path / "p-0"
    config = LogConfig(segment_ms=7 * DAY_MS, retention_ms=7 * DAY_MS)
    log = open_log(directory, config, clock=clock)
    log.append(make_batch(1, ts=clock.now_ms()))
    for day in range(1, 31):
        clock.advance(DAY_MS)
        if day % 3 == 0:  # a clean restart every 3 days
            log.flush()
            point = log.recovery_point
            log.close()
            log = open_log(directory, config, clock=clock, recovery_point=point)
        log.append(make_batch(1, ts=clock.now_ms()))
        log.delete_retention_segments(high_watermark=log.log_end_offset)
        if day == 7:
            assert log.segment_base_offsets == [0]  # exactly segment.ms: not yet
        if day == 8:
            assert log.segment_base_offsets == [0, 8]
    # As without restarts: a segment every 8 days, the oldest beyond retention deleted.
    assert log.segment_base_offsets == [16, 24]
    found = log.offset_for_timestamp(0)
    assert found is not None and clock.now_ms() - found[1] == 14 * DAY_MS
    log.close()


def test_create_time_batches_outside_the_timestamp_window_are_refused(tmp_path: Path) -> None:
    """message.timestamp.after/before.max.ms (Kafka's KIP-937): a leader refuses a
    CreateTime batch whose first or largest timestamp lies too far from its clock, and
    writes nothing. Unchecked, stepping producer timestamps forward by segment.ms rolled a
    segment per request (files without bound), and a far-future max_timestamp kept every
    later segment from time retention (found by an audit). Followers and LogAppendTime
    topics are not checked: the leader's clock decided, or stamps."""
    clock = ManualClock()
    config = LogConfig(segment_ms=1000, message_timestamp_before_max_ms=DAY_MS)
    directory = tmp_path / "p-0"
    log = open_log(directory, config, clock=clock)
    log.append(make_batch(1, ts=T0))
    before = dir_state(directory)
    hour_ms = 3_600_000
    for ts, word in (
        (T0 + hour_ms + 1, "ahead"),
        ([T0, T0 + hour_ms + 1], "ahead"),  # the largest timestamp is not the first
        (T0 - DAY_MS - 1, "behind"),
        (f.INT64_MAX, "ahead"),
    ):
        with pytest.raises(InvalidTimestampError, match=f"ms {word} "):
            log.append(make_batch(2 if isinstance(ts, list) else 1, ts=ts))
    assert dir_state(directory) == before and log.log_end_offset == 1
    log.append(make_batch(1, ts=T0 + hour_ms))  # the window's edges are inside
    log.append(make_batch(1, ts=T0 - DAY_MS))
    log.append(make_batch(1, ts=f.NO_TIMESTAMP))  # no timestamp at all: not checked
    assert log.log_end_offset == 4
    far = make_batch(1, ts=T0 + 100 * DAY_MS)
    follower = open_log(tmp_path / "f-0", config, clock=clock)
    while follower.log_end_offset < log.log_end_offset:  # a read stops at a segment's end
        follower.append(log.read(follower.log_end_offset, 1 << 20), assign_offsets=False)
    leader_batch = bytearray(far)
    f.I64.pack_into(leader_batch, 0, 4)  # as the leader would have placed it
    follower.append(reseal(leader_batch), assign_offsets=False)
    assert follower.log_end_offset == 5
    stamped = open_log(tmp_path / "s-0", LogConfig(message_timestamp_type="LogAppendTime"))
    assert stamped.append(far).log_append_time_ms == T0
    for opened in (log, follower, stamped):
        opened.close()


def test_segment_ms_age_is_by_record_time(tmp_path: Path) -> None:
    """As in Kafka, the age is the incoming batch's max timestamp minus the first batch's:
    records written late with their original timestamps (a backfill) roll segments by
    their own time rather than one segment per append, and the first batch's timestamp
    is read back from the file after a restart. A segment whose first batch has no
    usable (non-negative) timestamp falls back to its age in this process. (Timestamps
    far ahead of the clock are let in here: message.timestamp.after.max.ms has its own
    test.)"""
    clock = ManualClock()
    directory = tmp_path / "p-0"
    config = LogConfig(segment_ms=1000, message_timestamp_after_max_ms=f.INT64_MAX)
    log = open_log(directory, config, clock=clock)
    old = T0 - 30 * DAY_MS
    log.append(make_batch(1, ts=old))
    clock.advance(DAY_MS)
    log.append(make_batch(1, ts=old + 1000))  # a day later, but 1000 ms of record time
    assert log.segment_base_offsets == [0]
    log.close()
    log = open_log(directory, config, clock=clock)
    log.append(make_batch(1, ts=old + 1000))
    assert log.segment_base_offsets == [0]
    log.append(make_batch(1, ts=old + 1001))
    assert log.segment_base_offsets == [0, 3]
    log.close()

    negative = open_log(tmp_path / "p-1", config, clock=clock)
    negative.append(make_batch(1, ts=-5))
    negative.append(make_batch(1, ts=T0 + 100 * DAY_MS))
    assert negative.segment_base_offsets == [0]  # no first timestamp: age 0 in-process
    clock.advance(1001)
    negative.append(make_batch(1, ts=-5))
    assert negative.segment_base_offsets == [0, 2]
    negative.close()


def test_empty_active_segment_never_rolls_on_age(tmp_path: Path) -> None:
    clock = ManualClock()
    log = open_log(tmp_path / "p-0", LogConfig(segment_ms=10), clock=clock)
    clock.advance(1000)
    log.append(make_batch(1))
    assert log.segment_base_offsets == [0]
    assert log.roll() is log.roll()  # rolling an empty segment is a no-op
    log.close()


@pytest.mark.parametrize("seed", range(4))
def test_roll_on_segment_ms_with_jitter(tmp_path: Path, seed: int) -> None:
    segment_ms, jitter_ms = 10_000, 4_000
    clock = ManualClock()
    log = open_log(
        tmp_path / "p-0",
        LogConfig(segment_ms=segment_ms, segment_jitter_ms=jitter_ms),
        clock=clock,
        rng=random.Random(seed),
    )
    # Each new segment draws its jitter from the injected rng, in creation order.
    replica = random.Random(seed)
    thresholds = []
    for rolls in range(1, 6):
        jitter = replica.randrange(jitter_ms)
        thresholds.append(segment_ms - jitter)
        log.append(make_batch(1, ts=clock.now_ms()))
        clock.advance(segment_ms - jitter)
        log.append(make_batch(1, ts=clock.now_ms()))  # exactly at the threshold: not yet
        assert log.segment_count == rolls
        clock.advance(1)
        log.append(make_batch(1, ts=clock.now_ms()))
        assert log.segment_count == rolls + 1
    assert all(segment_ms - jitter_ms <= t <= segment_ms for t in thresholds)
    log.close()


def test_a_jitter_above_segment_ms_does_not_roll_segments_at_their_second_append(
    tmp_path: Path,
) -> None:
    """Kafka draws each segment's roll jitter uniformly below min(segment.jitter.ms,
    segment.ms). The draw here was up to segment.jitter.ms, then capped at segment.ms - 1:
    with a jitter above segment.ms, most segments got a roll age of 1 ms and rolled at
    their second append, and partitions created together all rolled at once (found by an
    audit)."""
    clock = ManualClock(1_700_000_000_000)
    config = LogConfig(segment_ms=600_000, segment_jitter_ms=3_600_000)  # 10 min, 1 h
    rng = random.Random(7)
    logs = [open_log(tmp_path / f"t-{p}", config, clock=clock, rng=rng) for p in range(10)]
    try:
        for _ in range(60):  # a minute of appends, one a second to each partition
            for log in logs:
                log.append(encode_batch([b"v" * 100], timestamps_ms=[clock.now_ms()]))
            clock.advance(1000)
        counts = [log.segment_count for log in logs]
        # Kafka: a segment rolls within a minute only if its jitter (uniform in
        # [0, 600 s)) exceeds 540 s: 10% of them; about one roll in these ten partitions.
        rolls = sum(counts) - len(logs)
        assert rolls <= 5, f"{rolls} rolls; segments per partition {counts}"
    finally:
        for log in logs:
            log.close()


def test_jitter_spreads_roll_times_across_logs(tmp_path: Path) -> None:
    segment_ms, jitter_ms = 10_000, 5_000
    roll_ages = set()
    for seed in range(8):
        clock = ManualClock()
        log = open_log(
            tmp_path / f"p-{seed}",
            LogConfig(segment_ms=segment_ms, segment_jitter_ms=jitter_ms),
            clock=clock,
            rng=random.Random(seed),
        )
        log.append(make_batch(1, ts=clock.now_ms()))
        age = 0
        while log.segment_count == 1:
            clock.advance(250)
            age += 250
            log.append(make_batch(1, ts=clock.now_ms()))
        assert segment_ms - jitter_ms < age <= segment_ms + 250
        roll_ages.add(age)
        log.close()
    assert len(roll_ages) > 1


@pytest.mark.parametrize("increasing_timestamps", [True, False])
def test_roll_on_full_index(tmp_path: Path, increasing_timestamps: bool) -> None:
    # 48 bytes: 6 offset-index entries, 4 time-index entries. With index_interval_bytes=0
    # every batch after a segment's first adds an offset entry; a time entry only when the
    # segment's max timestamp grew.
    config = LogConfig(segment_index_bytes=48, index_interval_bytes=0)
    log = open_log(tmp_path / "p-0", config)
    model = Model(log)
    for i in range(30):
        model.append(make_batch(1, ts=T0 + (i if increasing_timestamps else 0), tag=i))
    per_segment = 5 if increasing_timestamps else 7
    assert log.segment_base_offsets == list(range(0, 30, per_segment))
    assert_segment_files(log)
    assert read_all(log) == model.all_bytes()
    for offset in range(30):
        assert log.read(offset, 1) == model.batches[offset].data
    log.close()
    reopened = open_log(tmp_path / "p-0", config)
    assert reopened.segment_base_offsets == list(range(0, 30, per_segment))
    model.log = reopened
    for offset in range(30):
        assert reopened.read(offset, 1) == model.batches[offset].data
    reopened.close()


def test_roll_on_full_time_index(tmp_path: Path) -> None:
    """Regression: rolling *because* the time index is full used to fail while adding the
    segment's final time-index entry (RuntimeError: ... is full) when batches appended after
    the index filled had raised the segment's newest timestamp."""
    # Two batches per append, an entry every ~2 batches, timestamps growing with every
    # batch: the append that fills the time index carries one more, newer batch.
    size = len(make_batch(1, ts=T0))
    config = LogConfig(segment_index_bytes=48, index_interval_bytes=size + 1)
    log = open_log(tmp_path / "p-0", config)
    model = Model(log)
    for i in range(0, 40, 2):
        model.append(make_batch(1, ts=T0 + i, tag=i), make_batch(1, ts=T0 + i + 1, tag=i + 1))
    assert log.segment_count > 2
    assert read_all(log) == model.all_bytes()
    assert log.max_timestamp() == (T0 + 39, 39)
    for target in range(T0 - 1, T0 + 41):
        assert log.offset_for_timestamp(target) == offset_for_timestamp_model(model, target)
    log.close()
    reopened = open_log(tmp_path / "p-0", config)
    assert reopened.max_timestamp() == (T0 + 39, 39)
    for target in range(T0 - 1, T0 + 41):
        assert reopened.offset_for_timestamp(target) == offset_for_timestamp_model(model, target)
    reopened.close()


def test_multi_batch_append_fills_index(tmp_path: Path) -> None:
    """Regression: one append of many batches into a nearly full index used to raise
    RuntimeError after writing the data, leaving the log inconsistent."""
    config = LogConfig(segment_index_bytes=48, index_interval_bytes=0)
    log = open_log(tmp_path / "p-0", config)
    model = Model(log)
    batches = [make_batch(3, ts=T0 + 10 * i, tag=i) for i in range(10)]
    model.append(*batches)  # 10 batches > 4 time-index slots, all in one segment
    assert log.log_end_offset == 30
    model.append(*batches)  # the full index now rolls
    assert log.segment_base_offsets == [0, 30]
    assert log.log_end_offset == 60
    assert read_all(log) == model.all_bytes()
    for offset in range(60):
        assert log.read(offset, 1) == model.expected_read(offset, 1)
    log.close()
    reopened = open_log(tmp_path / "p-0", config)  # recovery rebuilds the same indexes
    assert reopened.log_end_offset == 60
    assert reopened.truncated_on_recovery_bytes == 0
    model.log = reopened
    assert read_all(reopened) == model.all_bytes()
    reopened.close()


def with_record_count(raw: bytes, record_count: int) -> bytes:
    """A batch whose header claims ``record_count`` records, with valid checksums.

    The broker never decodes bodies (O(1) per batch), so this is how a test reaches offsets
    near the 32-bit relative-offset limit without writing billions of records.
    """
    buf = bytearray(raw)
    f.I32.pack_into(buf, f.RECORD_COUNT_OFFSET, record_count)
    f.I32.pack_into(buf, f.LAST_OFFSET_DELTA_OFFSET, record_count - 1)
    return bytes(reseal(buf))


HUGE_RECORDS = 500_000_000
"""Records in a ``huge_batch``: 8 fill a segment's relative offsets (4e9 <= 2^32 - 1),
the 9th does not fit, and the plain body (about 2.06 GB) is below what a consumer
inflates (``records.DEFAULT_MAX_UNCOMPRESSED_BYTES``)."""


@functools.cache
def _zeros_zstd_frame(size: int) -> bytes:
    """One zstd frame of ``size`` zero bytes (about 63 KB for 2 GB), compressed in chunks."""
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=True).compressobj(size=size)
    chunk = bytes(1 << 24)
    parts = []
    for start in range(0, size, len(chunk)):
        parts.append(compressor.compress(chunk[: min(len(chunk), size - start)]))
    parts.append(compressor.flush())
    return b"".join(parts)


def huge_batch(record_count: int = HUGE_RECORDS, ts: int = T0) -> bytes:
    """A valid batch of ``record_count`` null values, small on the wire: its plain body
    (a validity bitmap and value offsets, all zero) is zstd-compressed zeros. This is how
    a test reaches offsets near the 32-bit relative-offset limit honestly."""
    validity, offsets = -(-record_count // 8), 4 * (record_count + 1)
    plain_bytes = validity + -validity % 8 + offsets + -offsets % 8  # sections 8-aligned
    region = _zeros_zstd_frame(plain_bytes)
    header = f.BATCH_HEADER.pack(
        0,
        f.BATCH_HEADER_SIZE + len(region) - f.LOG_OVERHEAD,
        -1,
        f.BATCH_MAGIC,
        0,
        0,
        f.COMPRESSION_ZSTD,
        record_count - 1,
        ts,
        ts,
        -1,
        -1,
        -1,
        record_count,
    )
    return bytes(reseal(bytearray(header + region)))


def test_huge_batch_helper_is_a_valid_batch() -> None:
    small = huge_batch(1001)
    (decoded,) = decode_batches(small)
    assert [r.value for r in decoded.records] == [None] * 1001
    assert len(huge_batch()) < 70_000


def test_roll_on_relative_offset_overflow(tmp_path: Path) -> None:
    huge, n = huge_batch(), HUGE_RECORDS
    log = open_log(tmp_path / "p-0", LogConfig(index_interval_bytes=0))
    for i in range(8):
        assert log.append(huge) == AppendInfo(i * n, (i + 1) * n - 1)
    assert log.segment_base_offsets == [0]  # relative offset 4e9 - 1 still fits
    assert log.append(huge) == AppendInfo(8 * n, 9 * n - 1)
    assert log.segment_base_offsets == [0, 8 * n]
    assert_segment_files(log)
    assert parse_header(log.read(8 * n + 5, 1)).base_offset == 8 * n
    assert parse_header(log.read(n, 1)).base_offset == n
    log.close()


@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("leader", [True, False])
def test_one_append_past_relative_offset_limit_is_split_across_segments(
    tmp_path: Path, leader: bool, prefix: int
) -> None:
    """One request whose offsets pass 2^32 - 1 relative to the active segment was
    written whole and then refused by the offset index (RuntimeError, a batch's base
    offset did not fit): the segment's size and the log end did not count the written
    bytes, every later append failed ("index entries must grow"), and after a restart
    recovery served the refused batches. Now the batches that fit go to the active
    segment and the rest to a new one, as leader and as follower (whose fetch responses
    carry many batches), whether the active segment is empty or not."""
    huge, n, count = huge_batch(), HUGE_RECORDS, 10
    directory = tmp_path / "p-0"
    config = LogConfig(index_interval_bytes=0)
    log = open_log(directory, config)
    if prefix:
        log.append(make_batch(prefix))
    end = prefix + count * n
    if leader:
        assert log.append(huge * count, 3) == AppendInfo(prefix, end - 1)
    else:
        request = bytearray(huge * count)
        for i in range(count):
            stamp(request, i * len(huge), prefix + i * n, 3)
        assert log.append(request, assign_offsets=False) == AppendInfo(prefix, end - 1)
    # Eight batches fit the first segment (relative offsets up to 4e9 - 1 + prefix).
    assert log.segment_base_offsets == [0, prefix + 8 * n]
    assert log.log_end_offset == end
    assert log.leader_epoch_cache.entries[-1].epoch == 3
    assert log.append(make_batch(2)) == AppendInfo(end, end + 1)
    for offset, base in (
        (prefix, prefix),
        (prefix + 4 * n - 1, prefix + 3 * n),
        (prefix + 4 * n, prefix + 4 * n),
        (prefix + 8 * n, prefix + 8 * n),
        (end - 1, prefix + 9 * n),
        (end + 1, end),
    ):
        assert parse_header(log.read(offset, 1)).base_offset == base
    log.flush()
    point = log.recovery_point
    log.close()
    for recovery_point in (point, 0):  # trusted, then fully re-verified
        again = open_log(directory, config, recovery_point=recovery_point)
        assert again.truncated_on_recovery_bytes == 0
        assert again.segment_base_offsets == [0, prefix + 8 * n]
        assert again.log_end_offset == end + 2
        assert parse_header(again.read(prefix + 8 * n - 1, 1)).base_offset == prefix + 7 * n
        again.close()


def test_impossible_record_count_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """The broker never decodes bodies, so the header's record_count is trusted for the
    offsets it assigns. A batch claiming more records than its bytes can hold (here 5 KB
    claiming 2^31 - 1) is refused with INVALID_RECORD (not retriable) and changes
    nothing; four of them in one request used to pass a segment's relative offsets and
    wedge the partition."""
    directory = tmp_path / "p-0"
    log = open_log(directory, LogConfig())
    log.append(make_batch(1))
    before = dir_state(directory)
    claims = with_record_count(make_batch(1, 5000), (1 << 31) - 1)
    for request in (claims * 4, make_batch(1) + claims, claims):
        with pytest.raises(InvalidRecordError) as excinfo:
            log.append(request)
        assert not excinfo.value.retriable
        assert "claims 2147483647 records" in str(excinfo.value)
        with pytest.raises(InvalidRecordError):
            log.append(request, assign_offsets=False)
        assert dir_state(directory) == before
        assert log.log_end_offset == 1
    assert log.append(make_batch(1)) == AppendInfo(1, 1)
    log.close()
    again = open_log(directory, LogConfig())
    assert again.truncated_on_recovery_bytes == 0
    assert again.log_end_offset == 2
    again.close()


@pytest.mark.parametrize("compression", ["none", "zstd", "lz4"])
@pytest.mark.parametrize("records", [1, 7, 8, 9, 1000, 200_000])
def test_record_count_bound_accepts_the_densest_real_batches(
    tmp_path: Path, compression: str, records: int
) -> None:
    """The bound is never below a real encoding: batches of empty values (the smallest
    records there are), with and without keys, timestamps and headers, are accepted, and
    for uncompressed ones the bound is exact: one record more is refused."""
    log = open_log(
        tmp_path / "p-0",
        LogConfig(
            max_message_bytes=f.MAX_BATCH_BYTES,
            message_timestamp_after_max_ms=f.INT64_MAX,  # wall-clock records, 2023's clock
        ),
    )
    shapes: list[dict[str, object]] = [
        {},
        {"keys": [b""] * records},
        {"timestamps_ms": [T0 + i for i in range(records)]},
        {"headers": [[("h", None)]] * records},
        {"keys": [None] * records, "headers": [[]] * records},
    ]
    for shape in shapes:
        raw = encode_batch([b""] * records, compression=compression, **shape)  # type: ignore[arg-type]
        info = log.append(raw)
        assert info.last_offset - info.first_offset + 1 == records
        header = parse_header(raw)
        bound = min_plain_body_bytes(records, header.attributes)
        if compression == "none":
            assert bound <= len(raw) - f.BATCH_HEADER_SIZE - 7
        if compression == "none" and not header.attributes & f.ATTR_HAS_HEADERS:
            assert bound == len(raw) - f.BATCH_HEADER_SIZE - 7
            more = with_record_count(raw, records + 8)  # one more byte of bitmap at least
            with pytest.raises(InvalidRecordError):
                log.append(more)
    log.close()


# --- flushing --------------------------------------------------------------------------------


def test_flush_messages_one_moves_recovery_point_on_every_append(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0", LogConfig(flush_messages=1))
    for n in (1, 3, 2):
        log.append(make_batch(n))
        assert log.recovery_point == log.log_end_offset
    log.close()


def test_flush_messages_counts_records(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0", LogConfig(flush_messages=5))
    log.append(make_batch(2))
    log.append(make_batch(2))
    assert log.recovery_point == 0
    log.append(make_batch(2))  # 6 unflushed records >= 5
    assert log.recovery_point == 6
    log.append(make_batch(4))
    assert log.recovery_point == 6
    log.append(make_batch(1))
    assert log.recovery_point == 11
    log.close()


def test_no_flush_policy_leaves_recovery_point(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0")
    log.append(make_batch(5))
    assert log.recovery_point == 0
    assert not log.flush_if_due()
    log.flush()
    assert log.recovery_point == 5
    log.close()


def test_flush_ms_via_flush_if_due(tmp_path: Path) -> None:
    clock = ManualClock()
    log = open_log(tmp_path / "p-0", LogConfig(flush_ms=1000), clock=clock)
    assert not log.flush_if_due()  # nothing unflushed
    log.append(make_batch(2))
    clock.advance(500)
    log.append(make_batch(2))  # the oldest unflushed append sets the deadline
    clock.advance(499)
    assert not log.flush_if_due()
    assert log.recovery_point == 0
    clock.advance(1)
    assert log.flush_if_due()
    assert log.recovery_point == 4
    assert log.last_flush_ms == clock.now_ms()
    clock.advance(5000)
    assert not log.flush_if_due()  # nothing new
    log.append(make_batch(1))
    clock.advance(999)
    assert not log.flush_if_due()
    clock.advance(1)
    assert log.flush_if_due()
    assert log.recovery_point == 5
    log.close()


def test_flush_covers_rolled_segments(tmp_path: Path) -> None:
    size = len(make_batch(2))
    log = open_log(tmp_path / "p-0", LogConfig(segment_bytes=2 * size))
    for i in range(7):
        log.append(make_batch(2, tag=i))
    assert log.segment_count == 4
    log.flush()
    assert log.recovery_point == 14
    log.close()
    reopened = open_log(tmp_path / "p-0", LogConfig(segment_bytes=2 * size), recovery_point=14)
    assert reopened.recovery_point == 14
    assert reopened.log_end_offset == 14
    reopened.close()


def test_rolled_segments_are_flushed_without_a_flush_policy(tmp_path: Path) -> None:
    """As Kafka flushes after each roll: the recovery point reaches the active segment's
    base offset at the next maintenance pass, so a restart after a crash re-checks only
    the active segment. It used to stay at 0 until a clean shutdown."""
    size = len(make_batch(2))
    log = open_log(tmp_path / "p-0", LogConfig(segment_bytes=2 * size))
    for i in range(7):
        log.append(make_batch(2, tag=i))
    assert log.segment_count == 4 and log.recovery_point == 0
    assert log.flush_if_due()
    assert log.recovery_point == 12  # the active segment's base offset
    assert not log.flush_if_due()  # nothing rolled since
    log.close()


def test_maintenance_is_due_exactly_when_flush_if_due_or_file_removal_has_work(
    tmp_path: Path,
) -> None:
    """The 250 ms pass skips a log whose ``maintenance_due`` is False without locking it:
    it must be True whenever ``flush_if_due`` or ``remove_deleted_files`` would act."""
    size = len(make_batch(2))
    clock = ManualClock()
    config = LogConfig(segment_bytes=2 * size, retention_bytes=0, file_delete_delay_ms=1000)
    log = open_log(tmp_path / "p-0", config, clock=clock)
    assert not log.maintenance_due()
    log.append(make_batch(2))
    assert not log.maintenance_due()  # no flush policy, nothing rolled
    for i in range(3):
        log.append(make_batch(2, tag=i))
    assert log.maintenance_due()  # rolled: those segments are to be flushed
    assert log.flush_if_due()
    assert not log.maintenance_due()
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) > 0
    assert log.maintenance_due()  # retired files wait for their removal
    clock.advance(1000)
    log.flush_if_due()  # retention rolled a new active segment: flush up to it
    assert log.remove_deleted_files() > 0
    assert not log.maintenance_due()
    log.close()

    timed = open_log(tmp_path / "p-1", LogConfig(flush_ms=1000), clock=clock)
    timed.append(make_batch(1))
    assert timed.maintenance_due()  # flush.ms: the unflushed append is to be timed
    clock.advance(1000)
    assert timed.flush_if_due()
    assert not timed.maintenance_due()
    timed.close()


@pytest.mark.parametrize(
    "name",
    [
        "append",
        "roll",
        "read",
        "flush",
        "flush_if_due",
        "truncate_to",
        "truncate_fully_and_start_at",
        "delete_retention_segments",
        "remove_deleted_files",
        "assign_epoch_start_offset",
    ],
)
def test_every_log_method_that_touches_files_reports_disk_failures(name: str) -> None:
    """Each goes through ``_reports_disk_failure`` (the storage node halts on a failed
    disk). A method added in front of one once took its decorator, silently."""
    assert hasattr(getattr(Log, name), "__wrapped__"), f"Log.{name} is not wrapped"


def test_a_failed_flush_of_the_maintenance_pass_is_reported_as_a_disk_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = len(make_batch(2))
    log = open_log(tmp_path / "p-0", LogConfig(segment_bytes=2 * size))
    for i in range(3):
        log.append(make_batch(2, tag=i))
    reported: list[OSError] = []
    log.on_disk_failure = lambda _directory, error: reported.append(error)

    def failing_fsync(_fd: int) -> None:
        raise OSError(errno.EIO, "injected: the disk is gone")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    monkeypatch.setattr(os, "fdatasync", failing_fsync)
    with pytest.raises(OSError):
        log.flush_if_due()
    assert [e.errno for e in reported] == [errno.EIO]


# --- retention --------------------------------------------------------------------------------


def test_retention_by_bytes(tmp_path: Path) -> None:
    size = len(make_batch(2))
    clock = ManualClock()
    config = LogConfig(segment_bytes=3 * size, retention_bytes=5 * size, file_delete_delay_ms=1000)
    log = open_log(tmp_path / "p-0", config, clock=clock)
    model = Model(log)
    for i in range(10):
        model.append(make_batch(2, tag=i))
    log.flush()
    assert log.segment_base_offsets == [0, 6, 12, 18]
    assert log.size_bytes == 10 * size
    # Excess is 5 batches; the oldest segment holds 3: one segment goes, a second would
    # take the log below retention.bytes.
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) == 1
    assert log.segment_base_offsets == [6, 12, 18]
    assert log.log_start_offset == 6
    assert log.size_bytes == 7 * size
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) == 0
    model.drop_below(6)
    assert read_all(log) == model.all_bytes()
    with pytest.raises(OffsetOutOfRangeError):
        log.read(5, 100)
    # The retired files wait as *.deleted for file.delete.delay.ms.
    deleted = sorted(p.name for p in log.dir.iterdir() if p.name.endswith(".deleted"))
    assert deleted == [f"{0:020d}{s}.deleted" for s in (".index", ".log", ".timeindex")]
    clock.advance(999)
    assert log.remove_deleted_files() == 0
    clock.advance(1)
    assert log.remove_deleted_files() == 3
    assert not any(p.name.endswith(".deleted") for p in log.dir.iterdir())
    assert_segment_files(log)
    log.close()


def test_retention_bytes_zero_empties_the_log_below_the_high_watermark(tmp_path: Path) -> None:
    """As in Kafka, the active segment goes too once wholly below the HW (a new empty
    one at the log end takes over); records above the HW stay."""
    size = len(make_batch(2))
    config = LogConfig(segment_bytes=2 * size, retention_bytes=0, file_delete_delay_ms=0)
    log = open_log(tmp_path / "p-0", config)
    model = Model(log)
    for i in range(7):
        model.append(make_batch(2, tag=i))
    assert log.segment_base_offsets == [0, 4, 8, 12]
    assert log.delete_retention_segments(high_watermark=12) == 3  # 12, 13: above the HW
    assert log.segment_base_offsets == [12]
    assert log.remove_deleted_files() == 9
    assert log.log_start_offset == 12
    assert log.recovery_point >= log.log_start_offset
    model.drop_below(12)
    assert read_all(log) == model.all_bytes()
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) == 1
    assert log.segment_base_offsets == [14] and log.log_start_offset == log.log_end_offset == 14
    with pytest.raises(OffsetOutOfRangeError):
        log.read(12, 1 << 20)
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) == 0  # empty
    # Appends continue in the new active segment, and survive a reopen.
    log.append(make_batch(1))
    log.close()
    log = open_log(tmp_path / "p-0", config)
    assert (log.log_start_offset, log.log_end_offset) == (14, 15)
    log.close()


def test_log_append_time_stamps_each_batch_with_the_leaders_clock(tmp_path: Path) -> None:
    """message.timestamp.type=LogAppendTime: the leader sets the batch's timestamp type and
    max_timestamp to its clock (the crc follows), every record then reads that time, and
    the time index, time lookups and retention go by it. A follower keeps the bytes."""
    clock = ManualClock(start_ms=T0)
    config = LogConfig(message_timestamp_type="LogAppendTime", retention_ms=10_000)
    log = open_log(tmp_path / "p-0", config, clock=clock)
    old = T0 - 5 * DAY_MS  # a producer's timestamps, long past
    info = log.append(make_batch(3, ts=[old, old + 1, old + 2]) + make_batch(2, ts=old, tag=1))
    assert info.log_append_time_ms == T0
    clock.advance(1_000)
    log.append(make_batch(2, ts=old, tag=2))
    data = read_all(log)
    stamped = decode_batches(data)  # checks both checksums
    assert [b.header.max_timestamp for b in stamped] == [T0, T0, T0 + 1_000]
    assert all(b.header.attributes & f.ATTR_TIMESTAMP_LOG_APPEND for b in stamped)
    assert [r.timestamp_ms for b in stamped for r in b.records] == [T0] * 5 + [T0 + 1_000] * 2
    assert [r.value for b in stamped for r in b.records] == [
        r.value
        for raw in (make_batch(3), make_batch(2, tag=1), make_batch(2, tag=2))
        for r in decode_batches(raw)[0].records
    ]
    assert log.offset_for_timestamp(T0 + 1) == (5, T0 + 1_000)
    assert log.offset_for_timestamp(old) == (0, T0)  # the producer's times are gone
    # Retention by append time: 5 days old by the producer's clock, not expired.
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) == 0
    # A follower appends the leader's bytes as they are (its config is the topic's too).
    follower = open_log(tmp_path / "p-0-follower", config, clock=clock)
    follower.append(data, assign_offsets=False)
    assert read_all(follower) == data
    # A producer's retry, answered as a duplicate, reports the original's stamp, not -1
    # (the SDK then reported the producer's own times for records stamped otherwise).
    idempotent = encode_batch(
        [b"x"], timestamps_ms=[old], producer_id=7, producer_epoch=0, base_sequence=0
    )
    first = log.append(idempotent)
    clock.advance(1_000)
    retry = log.append(idempotent)
    assert retry.duplicate and retry.log_append_time_ms == first.log_append_time_ms == T0 + 1_000
    # CreateTime (the default) keeps the producer's timestamps and answers -1.
    plain = open_log(tmp_path / "q-0", clock=clock)
    assert plain.append(make_batch(2, ts=old)).log_append_time_ms == -1
    assert [r.timestamp_ms for r in decode_batches(read_all(plain))[0].records] == [old] * 2
    for each in (log, follower, plain):
        each.close()
    # Recovery rebuilds the time index from the stamped headers.
    reopened = open_log(tmp_path / "p-0", config, clock=clock)
    assert reopened.offset_for_timestamp(T0 + 1) == (5, T0 + 1_000)
    reopened.close()


def test_retention_by_time(tmp_path: Path) -> None:
    clock = ManualClock(start_ms=T0)
    size = len(make_batch(2, ts=T0)) + len(make_batch(2, ts=[T0, T0 + 1]))
    config = LogConfig(segment_bytes=size, retention_ms=10_000, file_delete_delay_ms=500)
    log = open_log(tmp_path / "p-0", config, clock=clock)
    model = Model(log)
    # Segment k holds batches stamped T0 + 1000*k and T0 + 1000*k + 1 (record timestamps,
    # not append times, decide).
    for k in range(5):
        model.append(make_batch(2, ts=T0 + 1000 * k, tag=k))
        model.append(make_batch(2, ts=[T0 + 1000 * k, T0 + 1000 * k + 1], tag=k))
    assert log.segment_base_offsets == [0, 4, 8, 12, 16]
    clock.advance(10_001)  # now - newest of segment 0 = 10_000: not older than retention
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) == 0
    clock.advance(1)
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) == 1
    assert log.segment_base_offsets == [4, 8, 12, 16]
    clock.advance(2000)  # segments 1 and 2 expire
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) == 2
    assert log.log_start_offset == 12
    assert log.recovery_point >= 12
    clock.advance(100_000)  # everything expired, the active segment too (as in Kafka)
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) == 2
    assert log.segment_base_offsets == [20]
    assert (log.log_start_offset, log.log_end_offset) == (20, 20)
    model.drop_below(20)
    assert read_all(log) == model.all_bytes() == b""
    assert log.remove_deleted_files() == 9  # the first three retirements are due
    clock.advance(499)
    assert log.remove_deleted_files() == 0
    clock.advance(1)
    assert log.remove_deleted_files() == 6
    log.close()


@pytest.mark.parametrize("by", ["bytes", "time"])
def test_retention_stops_below_the_high_watermark(tmp_path: Path, by: str) -> None:
    """A segment goes only once every record of it is below the HW (its end is the next
    segment's base offset), whichever limit it is past: a record above the HW may exist
    on no other replica yet. The log start never passes the HW."""
    clock = ManualClock(start_ms=T0)
    size = len(make_batch(2, ts=T0))
    limits = {"retention_bytes": 0} if by == "bytes" else {"retention_ms": 1000}
    config = LogConfig(segment_bytes=2 * size, file_delete_delay_ms=0, **limits)
    log = open_log(tmp_path / "p-0", config, clock=clock)
    for k in range(6):
        log.append(make_batch(2, ts=T0, tag=k))
    assert log.segment_base_offsets == [0, 4, 8]
    clock.advance(5000)  # every segment past retention.ms too
    assert log.delete_retention_segments(high_watermark=0) == 0
    assert log.delete_retention_segments(high_watermark=3) == 0  # inside segment 0
    assert log.segment_base_offsets == [0, 4, 8]
    assert log.delete_retention_segments(high_watermark=4) == 1  # segment 0 ends at 4
    assert (log.segment_base_offsets, log.log_start_offset) == ([4, 8], 4)
    assert log.delete_retention_segments(high_watermark=7) == 0
    assert log.delete_retention_segments(high_watermark=11) == 1  # the active ends at 12
    assert log.segment_base_offsets == [8]
    assert log.delete_retention_segments(high_watermark=12) == 1  # now it goes as well
    assert (log.segment_base_offsets, log.log_start_offset) == ([12], 12)
    log.close()


def test_retention_by_time_stops_at_first_unexpired_segment(tmp_path: Path) -> None:
    clock = ManualClock(start_ms=T0)
    size = len(make_batch(1, ts=T0))
    config = LogConfig(segment_bytes=size, retention_ms=1000)
    log = open_log(tmp_path / "p-0", config, clock=clock)
    for ts in (T0 - 5000, T0, T0 - 5000, T0 - 5000):
        log.append(make_batch(1, ts=ts))
    assert log.segment_count == 4
    assert (
        log.delete_retention_segments(high_watermark=log.log_end_offset) == 1
    )  # the second segment is recent
    assert log.segment_base_offsets == [1, 2, 3]
    log.close()


def test_retention_ms_minus_one_keeps_forever(tmp_path: Path) -> None:
    clock = ManualClock(start_ms=T0)
    size = len(make_batch(1, ts=0))
    log = open_log(tmp_path / "p-0", LogConfig(segment_bytes=size, retention_ms=-1), clock=clock)
    for _ in range(3):
        log.append(make_batch(1, ts=0))
    clock.advance(100 * DAY_MS)
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) == 0
    assert log.segment_count == 3
    log.close()


def test_retention_ms_ages_negative_timestamp_segments_by_file_mtime(tmp_path: Path) -> None:
    """A segment whose records all have negative timestamps has no largest timestamp
    (-1). Retention used to stop at it for good, keeping every later segment past
    retention.ms; like Kafka it now ages such a segment by its ``.log`` file's mtime."""
    clock = ManualClock(start_ms=T0)
    size = len(make_batch(1, ts=-5))
    config = LogConfig(segment_bytes=size, retention_ms=60_000)
    log = open_log(tmp_path / "p-0", config, clock=clock)
    log.append(make_batch(1, ts=-5))
    for i in range(3):
        log.append(make_batch(1, ts=T0 + i))
    assert log.segment_base_offsets == [0, 1, 2, 3]
    first_log = tmp_path / "p-0" / f"{0:020d}.log"
    # Written an hour before T0 (file times are wall-clock; the log's clock is manual).
    mtime_ms = T0 - 3_600_000
    os.utime(first_log, ns=(mtime_ms * 1_000_000, mtime_ms * 1_000_000))
    clock.advance(30_000)  # the file is 3630 s old, every record 30 s or less
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) == 1
    assert log.segment_base_offsets == [1, 2, 3]
    clock.advance(31_000)  # records past 60 s: the rest goes, the active segment too
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) == 3
    assert log.segment_base_offsets == [4]
    log.close()


def test_retention_ms_keeps_a_recent_negative_timestamp_segment(tmp_path: Path) -> None:
    clock = ManualClock(start_ms=T0)
    size = len(make_batch(1, ts=-5))
    config = LogConfig(segment_bytes=size, retention_ms=60_000)
    log = open_log(tmp_path / "p-0", config, clock=clock)
    log.append(make_batch(1, ts=-5))
    log.append(make_batch(1, ts=T0))
    mtime_ms = T0 + 100 * DAY_MS  # modified after the clock's now: not expired
    os.utime(log.dir / f"{0:020d}.log", ns=(mtime_ms * 1_000_000, mtime_ms * 1_000_000))
    clock.advance(DAY_MS)
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) == 0
    assert log.segment_base_offsets == [0, 1]
    log.close()


def _damaged_oldest_segment_log(directory: Path, clock: ManualClock, config: LogConfig) -> Log:
    """Seven 2-record batches in segments [0, 6, 12], flushed; then bit rot in the
    header of the oldest segment's last batch (after its last index entry), and the log
    reopened with that segment trusted (below the recovery point)."""
    size = len(make_batch(2))
    log = Log.open(directory, config, clock=clock)
    for i in range(7):
        log.append(make_batch(2, ts=T0 + 1000 * i, tag=i))
    assert log.segment_base_offsets == [0, 6, 12]
    log.flush()
    end = log.log_end_offset
    log.close()
    first = directory / f"{0:020d}.log"
    data = bytearray(first.read_bytes())
    data[2 * size + 20] ^= 0xFF
    first.write_bytes(bytes(data))
    return Log.open(directory, config, recovery_point=end, clock=clock)


def test_a_damaged_tail_in_an_old_segment_does_not_stop_time_retention(tmp_path: Path) -> None:
    """Retention aged a segment by reading its tail: damage there raised at every
    retention pass, so the partition was never trimmed again (by retention.ms nor
    retention.bytes, checked after it). Kafka ages a segment by its time index's last
    entry and never reads the log for it; so does this now. Found by an audit."""
    clock = ManualClock(start_ms=T0)
    config = LogConfig(
        segment_bytes=3 * len(make_batch(2)), retention_ms=DAY_MS, file_delete_delay_ms=0
    )
    log = _damaged_oldest_segment_log(tmp_path / "p-0", clock, config)
    clock.advance(2 * DAY_MS)
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) >= 1
    assert log.log_start_offset >= 6
    log.close()


def test_a_damaged_tail_in_an_old_segment_does_not_fail_lookups_in_later_ones(
    tmp_path: Path,
) -> None:
    """ListOffsets by time walks the segments oldest first, and asked each for its
    largest timestamp by reading its tail: one damaged old segment failed every lookup
    by time (and MAX_TIMESTAMP), even when the answer was in a healthy later segment
    (found by an audit)."""
    config = LogConfig(segment_bytes=3 * len(make_batch(2)))
    log = _damaged_oldest_segment_log(tmp_path / "p-0", ManualClock(start_ms=T0), config)
    assert log.offset_for_timestamp(T0 + 5000) == (10, T0 + 5000)
    assert log.max_timestamp() == (T0 + 6000, 12)
    assert log.offset_for_timestamp(T0 + 500) == (2, T0 + 1000)  # before the damage
    with pytest.raises(StorageError):
        log.read(4, 1 << 20)  # the damaged batch itself still fails its reads
    log.close()


def test_deleted_files_left_at_close_are_removed_on_open(tmp_path: Path) -> None:
    size = len(make_batch(1))
    config = LogConfig(segment_bytes=size, retention_bytes=0)
    log = open_log(tmp_path / "p-0", config)
    for _ in range(3):
        log.append(make_batch(1))
    assert log.delete_retention_segments(high_watermark=log.log_end_offset) == 3
    log.close()  # before file.delete.delay.ms passed
    assert sum(p.name.endswith(".deleted") for p in (tmp_path / "p-0").iterdir()) == 9
    reopened = open_log(tmp_path / "p-0", config)
    assert not any(p.name.endswith(".deleted") for p in reopened.dir.iterdir())
    assert reopened.segment_base_offsets == [3]
    assert (reopened.log_start_offset, reopened.log_end_offset) == (3, 3)
    reopened.close()


# --- truncation --------------------------------------------------------------------------


def build_truncation_log(directory: Path) -> tuple[Log, Model, LogConfig]:
    size = len(make_batch(3))
    config = LogConfig(segment_bytes=3 * size, index_interval_bytes=0)
    log = open_log(directory, config)
    model = Model(log)
    for i in range(8):  # segments [0, 9) [9, 18) [18, 24)
        model.append(make_batch(3, tag=i))
    assert log.segment_base_offsets == [0, 9, 18]
    return log, model, config


def check_state(log: Log, model: Model) -> None:
    model.log = log
    assert log.log_end_offset == model.end_offset
    assert read_all(log) == model.all_bytes()
    for offset in range(log.log_start_offset, log.log_end_offset):
        assert log.read(offset, 1) == model.expected_read(offset, 1)
    assert_segment_files(log)


def check_reopen(log: Log, model: Model, config: LogConfig) -> None:
    """Close and reopen (full recovery and trusting a recovery point): same state."""
    bases, end = log.segment_base_offsets, log.log_end_offset
    log.flush()
    log.close()
    for recovery_point in (0, end):
        reopened = open_log(log.dir, config, recovery_point=recovery_point)
        assert reopened.truncated_on_recovery_bytes == 0
        assert reopened.segment_base_offsets == bases
        check_state(reopened, model)
        reopened.close()


@pytest.mark.parametrize("offset", [12, 4, 1, 0])
def test_truncate_to_inside_segments(tmp_path: Path, offset: int) -> None:
    log, model, config = build_truncation_log(tmp_path / "p-0")
    log.flush()
    log.truncate_to(offset)
    model.truncate(offset)
    assert log.log_end_offset == offset - offset % 3  # whole batches only
    assert log.recovery_point <= log.log_end_offset
    check_state(log, model)
    model.append(make_batch(2, tag=99))
    model.append(make_batch(3, tag=98))
    check_state(log, model)
    check_reopen(log, model, config)


def test_truncate_to_at_segment_boundary(tmp_path: Path) -> None:
    log, model, config = build_truncation_log(tmp_path / "p-0")
    log.truncate_to(18)
    model.truncate(18)
    assert log.segment_base_offsets == [0, 9]
    assert not (log.dir / f"{18:020d}.log").exists()
    check_state(log, model)
    log.truncate_to(9)
    model.truncate(9)
    assert log.segment_base_offsets == [0]
    assert log.log_end_offset == 9
    check_state(log, model)
    # The old first segment is active again and takes appends (it is full, so it rolls).
    model.append(make_batch(3, tag=50))
    assert log.segment_base_offsets == [0, 9]
    check_state(log, model)
    check_reopen(log, model, config)


def test_truncate_to_inside_a_batch_removes_the_whole_batch(tmp_path: Path) -> None:
    log, model, config = build_truncation_log(tmp_path / "p-0")
    log.truncate_to(20)  # inside [18, 20]
    model.truncate(20)
    assert log.log_end_offset == 18
    assert log.segment_base_offsets == [0, 9, 18]
    assert (log.dir / f"{18:020d}.log").stat().st_size == 0
    check_state(log, model)
    log.truncate_to(13)  # inside [12, 14], in the middle segment
    model.truncate(13)
    assert log.log_end_offset == 12
    assert log.segment_base_offsets == [0, 9]
    check_state(log, model)
    model.append(make_batch(1, tag=3))
    assert log.log_end_offset == 13
    check_state(log, model)
    check_reopen(log, model, config)


def test_truncate_to_at_or_past_end_is_a_no_op(tmp_path: Path) -> None:
    log, model, _ = build_truncation_log(tmp_path / "p-0")
    before = dir_state(log.dir)
    log.truncate_to(24)
    log.truncate_to(1000)
    assert dir_state(log.dir) == before
    check_state(log, model)
    with pytest.raises(InvalidRequestError):
        log.truncate_to(-1)
    log.close()


def test_truncate_below_log_start_truncates_fully(tmp_path: Path) -> None:
    size = len(make_batch(3))
    config = LogConfig(segment_bytes=3 * size, retention_bytes=0, file_delete_delay_ms=0)
    log = open_log(tmp_path / "p-0", config)
    model = Model(log)
    for i in range(8):
        model.append(make_batch(3, tag=i))
    log.delete_retention_segments(high_watermark=log.log_end_offset)
    log.remove_deleted_files()
    assert log.log_start_offset == 24
    log.truncate_to(10)
    assert log.segment_base_offsets == [10]
    assert (log.log_start_offset, log.log_end_offset, log.recovery_point) == (10, 10, 10)
    assert [p.name for p in log.dir.iterdir() if p.name.endswith(".log")] == [f"{10:020d}.log"]
    model.batches = []
    assert model.append(make_batch(2)) == AppendInfo(10, 11)
    assert read_all(log) == model.all_bytes()
    log.flush()
    log.close()
    reopened = open_log(tmp_path / "p-0", config)
    assert (reopened.log_start_offset, reopened.log_end_offset) == (10, 12)
    check_state(reopened, model)
    reopened.close()


def test_truncate_fully_and_start_at(tmp_path: Path) -> None:
    log, _, config = build_truncation_log(tmp_path / "p-0")
    log.truncate_fully_and_start_at(1000)
    assert log.segment_base_offsets == [1000]
    assert (log.log_start_offset, log.log_end_offset) == (1000, 1000)
    assert read_all(log) == b""
    model = Model(log)
    assert model.append(make_batch(4)) == AppendInfo(1000, 1003)
    check_state(log, model)
    check_reopen(log, model, config)


def test_truncation_then_retention_then_reopen(tmp_path: Path) -> None:
    """Mixed history: the reopened log equals the live one."""
    log, model, config = build_truncation_log(tmp_path / "p-0")
    log.truncate_to(15)
    model.truncate(15)
    for i in range(5):
        model.append(make_batch(3, tag=i + 20))
    log.update_config(LogConfig(segment_bytes=config.segment_bytes, retention_bytes=0))
    log.delete_retention_segments(high_watermark=log.log_end_offset - 1)  # the active stays
    model.drop_below(log.log_start_offset)
    check_state(log, model)
    check_reopen(log, model, config)


# --- timestamps -------------------------------------------------------------------------------


def offset_for_timestamp_model(model: Model, target: int) -> tuple[int, int] | None:
    """Kafka's ListOffsets: the first batch whose max timestamp reaches the target, then the
    first record in it that does."""
    for batch in model.batches:
        if batch.max_timestamp >= target:
            for i, ts in enumerate(batch.timestamps):
                if ts >= target:
                    return batch.base_offset + i, ts
    return None


def max_timestamp_model(model: Model) -> tuple[int, int] | None:
    """The first record with the largest timestamp: its timestamp and its own offset."""
    best: tuple[int, int] | None = None
    for batch in model.batches:
        for i, ts in enumerate(batch.timestamps):
            if best is None or ts > best[0]:
                best = ts, batch.base_offset + i
    return best


def test_offset_for_timestamp_and_max_timestamp_monotonic(tmp_path: Path) -> None:
    size = len(make_batch(3, ts=[T0, T0 + 10, T0 + 20]))
    config = LogConfig(segment_bytes=4 * size, index_interval_bytes=size)
    log = open_log(tmp_path / "p-0", config)
    assert log.offset_for_timestamp(0) is None
    assert log.max_timestamp() is None
    model = Model(log)
    for i in range(20):
        model.append(make_batch(3, ts=[T0 + 30 * i, T0 + 30 * i + 10, T0 + 30 * i + 20]))
    assert log.segment_count == 5
    assert log.offset_for_timestamp(0) == (0, T0)
    assert log.offset_for_timestamp(T0) == (0, T0)
    assert log.offset_for_timestamp(T0 + 1) == (1, T0 + 10)
    assert log.offset_for_timestamp(T0 + 300) == (30, T0 + 300)
    assert log.offset_for_timestamp(T0 + 585) == (59, T0 + 590)
    assert log.offset_for_timestamp(T0 + 591) is None
    assert log.offset_for_timestamp(T0 + 300, max_offset=30) is None
    assert log.offset_for_timestamp(T0 + 300, max_offset=31) == (30, T0 + 300)
    assert log.max_timestamp() == (T0 + 590, 59)  # the last record of the last batch
    assert log.max_timestamp() == max_timestamp_model(model)
    for target in range(T0 - 5, T0 + 600, 7):
        assert log.offset_for_timestamp(target) == offset_for_timestamp_model(model, target)
    log.close()


@pytest.mark.parametrize("seed", range(5))
def test_offset_for_timestamp_random_model(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    config = LogConfig(
        segment_bytes=rng.randrange(600, 3000), index_interval_bytes=rng.randrange(0, 1000)
    )
    log = open_log(tmp_path / "p-0", config)
    model = Model(log)
    for i in range(40):
        n = rng.randrange(1, 6)
        timestamps = [T0 + rng.randrange(-500, 2000) for _ in range(n)]
        model.append(make_batch(n, rng.randrange(0, 100), ts=timestamps, tag=i))
    assert log.segment_count > 1

    def check(current: Log) -> None:
        for target in range(T0 - 600, T0 + 2100, 13):
            assert current.offset_for_timestamp(target) == offset_for_timestamp_model(
                model, target
            ), target
        assert current.max_timestamp() == max_timestamp_model(model)

    check(log)
    log.close()
    reopened = open_log(tmp_path / "p-0", config)  # from trimmed indexes
    check(reopened)
    reopened.close()
    reopened = open_log(tmp_path / "p-0", config, recovery_point=model.end_offset)
    check(reopened)
    reopened.close()


def test_max_timestamp_after_truncation(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p-0", LogConfig(index_interval_bytes=0))
    model = Model(log)
    for ts in (T0 + 5, T0 + 50, T0 + 7, T0 + 60, T0 + 1):
        model.append(make_batch(2, ts=ts))
    assert log.max_timestamp() == (T0 + 60, 6)  # the batch's first record has it
    log.truncate_to(6)
    model.truncate(6)
    assert log.max_timestamp() == (T0 + 50, 2)
    assert log.offset_for_timestamp(T0 + 51) is None
    log.truncate_to(0)
    assert log.max_timestamp() is None
    log.close()


def test_a_truncation_to_a_segments_start_leaves_no_time_entry_past_the_log_end(
    tmp_path: Path,
) -> None:
    """Found by an audit: truncating a segment to its start reset its max timestamp but
    not that timestamp's offset. A time-index entry due before the next timestamped batch
    (records without timestamps, -1) then named that stale offset, past the log end, and
    a lookup by time started its scan there, skipping the record it should answer."""
    log = open_log(tmp_path / "p-0", LogConfig(index_interval_bytes=0))
    for i in range(20):  # offsets 0..19: the offset of the max timestamp is 19
        log.append(encode_batch([b"v" * 40], timestamps_ms=[T0 + i]))
    log.truncate_to(0)  # e.g. a follower diverging at the segment's start
    for ts in (-1, -1, *range(T0 + 100, T0 + 108)):  # offsets 0..9; an entry due at 1
        log.append(encode_batch([b"v" * 40], timestamps_ms=[ts]))
    segment = log._segments.last
    entries = [segment.time_index.entry(i) for i in range(segment.time_index.entries)]
    assert all(segment.base_offset + relative < log.log_end_offset for _, relative in entries)
    assert log.offset_for_timestamp(T0 + 50) == (2, T0 + 100)
    log.close()


# --- rejected input ------------------------------------------------------------------------------


def corrupt_variants() -> dict[str, tuple[bytes, type[Exception]]]:
    good = make_batch(3)
    bad_body = bytearray(good)
    bad_body[-1] ^= 0x01
    bad_header_crc = bytearray(good)
    bad_header_crc[f.BASE_OFFSET_OFFSET] ^= 0x80
    wrong_magic = bytearray(good)
    wrong_magic[f.MAGIC_OFFSET] = 2
    reseal(wrong_magic)  # checksums valid, magic unknown
    bad_count = bytearray(good)
    f.I32.pack_into(bad_count, f.RECORD_COUNT_OFFSET, 0)
    reseal(bad_count)
    return {
        "wrong body crc": (bytes(bad_body), CorruptBatchError),
        "wrong header crc": (bytes(bad_header_crc), CorruptBatchError),
        "wrong magic": (bytes(wrong_magic), CorruptBatchError),
        "record count 0": (bytes(bad_count), CorruptBatchError),
        "truncated batch": (good[:-8], CorruptBatchError),
        "only a header": (good[: f.BATCH_HEADER_SIZE], CorruptBatchError),
        "only a prefix": (good[:5], CorruptBatchError),
        "garbage trailer": (good + b"\x01\x02\x03", CorruptBatchError),
        "garbage trailer of a prefix's length": (good + bytes(12), CorruptBatchError),
        "good then damaged": (good + bytes(bad_body), CorruptBatchError),
        "damaged then good": (bytes(bad_body) + good, CorruptBatchError),
        "empty": (b"", InvalidRequestError),
    }


@pytest.mark.parametrize("name", list(corrupt_variants()))
def test_bad_input_writes_nothing(tmp_path: Path, name: str) -> None:
    payload, error = corrupt_variants()[name]
    log = open_log(tmp_path / "p-0", LogConfig(index_interval_bytes=0))
    model = Model(log)
    model.append(make_batch(2))
    model.append(make_batch(2))
    before = dir_state(log.dir)
    with pytest.raises(error):
        log.append(payload)
    assert dir_state(log.dir) == before
    assert log.log_end_offset == 4
    assert read_all(log) == model.all_bytes()
    assert model.append(make_batch(1)) == AppendInfo(4, 4)  # the log is still usable
    assert read_all(log) == model.all_bytes()
    log.close()


def test_batch_over_max_message_bytes_is_rejected(tmp_path: Path) -> None:
    big = make_batch(10, 200)
    log = open_log(tmp_path / "p-0", LogConfig(max_message_bytes=len(big) - 1))
    log.append(make_batch(1))
    before = dir_state(log.dir)
    with pytest.raises(MessageTooLargeError):
        log.append(big)
    with pytest.raises(MessageTooLargeError):
        log.append(make_batch(1) + big)  # all or nothing
    assert dir_state(log.dir) == before
    assert log.log_end_offset == 1
    # Exactly max.message.bytes is allowed; the limit is per batch, not per request.
    log.update_config(LogConfig(max_message_bytes=len(big)))
    assert log.append(big + big) == AppendInfo(1, 20)
    log.close()


# --- follower appends ---------------------------------------------------------------------------


def test_follower_append_keeps_leader_offsets_and_bytes(tmp_path: Path) -> None:
    leader = open_log(tmp_path / "leader-0")
    model = Model(leader)
    model.append(make_batch(2), epoch=1)
    model.append(make_batch(3), make_batch(1), epoch=2)
    follower = open_log(tmp_path / "follower-0")
    fetched = leader.read(0, 1 << 20)
    assert follower.append(fetched, assign_offsets=False) == AppendInfo(0, 5)
    assert read_all(follower) == read_all(leader) == model.all_bytes()
    assert [b.partition_leader_epoch for b in decode_batches(read_all(follower))] == [1, 2, 2]
    # Continuing from the follower's end works batch by batch too.
    model.append(make_batch(4), epoch=3)
    assert follower.append(leader.read(6, 1 << 20), 99, assign_offsets=False) == AppendInfo(6, 9)
    assert read_all(follower) == model.all_bytes()
    leader.close()
    follower.close()


def test_follower_append_requires_contiguous_offsets(tmp_path: Path) -> None:
    leader = open_log(tmp_path / "leader-0")
    for n in (2, 3, 1):
        leader.append(make_batch(n))
    follower = open_log(tmp_path / "follower-0")
    first, second = leader.read(0, 1), leader.read(2, 1)
    before = dir_state(follower.dir)
    with pytest.raises(InvalidRequestError):
        follower.append(second, assign_offsets=False)  # gap: log ends at 0
    with pytest.raises(InvalidRequestError):
        follower.append(first + leader.read(5, 1), assign_offsets=False)  # gap inside
    assert dir_state(follower.dir) == before
    follower.append(first, assign_offsets=False)
    with pytest.raises(InvalidRequestError):
        follower.append(first, assign_offsets=False)  # overlap
    follower.append(second, assign_offsets=False)
    assert follower.log_end_offset == 5
    with pytest.raises(CorruptBatchError):
        damaged = bytearray(leader.read(5, 1))
        damaged[-1] ^= 1
        follower.append(bytes(damaged), assign_offsets=False)
    assert follower.log_end_offset == 5
    leader.close()
    follower.close()


# --- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("segment_bytes", 13),
        ("segment_bytes", f.MAX_SEGMENT_POSITION + 1),
        ("segment_index_bytes", 4 * f.TIME_INDEX_ENTRY_SIZE - 1),
        ("index_interval_bytes", -1),
        ("segment_ms", 0),
        ("segment_jitter_ms", -1),
        ("retention_bytes", -2),
        ("retention_ms", -2),
        ("flush_messages", 0),
        ("flush_ms", -1),
        ("max_message_bytes", f.BATCH_HEADER_SIZE - 1),
        ("max_message_bytes", f.MAX_BATCH_BYTES + 1),
        ("file_delete_delay_ms", -1),
        ("page_cache_window_bytes", -1),
    ],
)
def test_log_config_rejects_bad_values(field: str, value: int) -> None:
    with pytest.raises(InvalidConfigError) as excinfo:
        LogConfig(**{field: value})
    kafka_name = next(k for k, v in TOPIC_CONFIG_FIELDS.items() if v == field)
    assert kafka_name in str(excinfo.value)


def test_log_config_accepts_limits() -> None:
    LogConfig(
        segment_bytes=14,
        segment_index_bytes=48,
        index_interval_bytes=0,
        segment_ms=1,
        retention_bytes=-1,
        retention_ms=-1,
        flush_messages=1,
        flush_ms=0,
        max_message_bytes=f.BATCH_HEADER_SIZE,
        file_delete_delay_ms=0,
        page_cache_window_bytes=0,
    )
    LogConfig(segment_bytes=f.MAX_SEGMENT_POSITION, max_message_bytes=f.MAX_BATCH_BYTES)


def test_log_config_from_topic_config() -> None:
    config = LogConfig.from_topic_config(
        {
            "segment.bytes": "2048",
            "segment.index.bytes": "4096",
            "index.interval.bytes": "128",
            "segment.ms": "60000",
            "segment.jitter.ms": "500",
            "retention.bytes": "-1",
            "retention.ms": "3600000",
            "flush.messages": "10",
            "flush.ms": "1000",
            "max.message.bytes": "100000",
            "file.delete.delay.ms": "0",
            "page.cache.window.bytes": "1048576",
            "message.timestamp.type": "LogAppendTime",
            "min.insync.replicas": "2",  # the cluster's, not the log's: ignored here
            "cleanup.policy": "delete",
        }
    )
    assert config == LogConfig(
        segment_bytes=2048,
        segment_index_bytes=4096,
        index_interval_bytes=128,
        segment_ms=60000,
        segment_jitter_ms=500,
        retention_bytes=-1,
        retention_ms=3_600_000,
        flush_messages=10,
        flush_ms=1000,
        max_message_bytes=100_000,
        file_delete_delay_ms=0,
        page_cache_window_bytes=1 << 20,
        message_timestamp_type="LogAppendTime",
    )
    assert set(TOPIC_CONFIG_FIELDS.values()) == set(LogConfig.__dataclass_fields__)


def test_log_config_from_topic_config_over_base_and_never() -> None:
    base = LogConfig(segment_bytes=4096, flush_messages=3, flush_ms=10)
    never = str((1 << 63) - 1)  # Kafka's Long.MAX_VALUE: "never flush"
    config = LogConfig.from_topic_config(
        {"retention.ms": "1000", "flush.messages": never, "flush.ms": never}, base
    )
    assert config.segment_bytes == 4096
    assert config.retention_ms == 1000
    assert config.flush_messages is None
    assert config.flush_ms is None
    assert LogConfig.from_topic_config({}) == LogConfig()


@pytest.mark.parametrize(
    "entries",
    [
        {"retention.ms": "abc"},
        {"segment.bytes": "1.5"},
        {"segment.bytes": ""},
        {"segment.bytes": "1"},
        {"retention.bytes": "-5"},
        {"flush.messages": "0"},
        {"max.message.bytes": str(1 << 40)},
    ],
)
def test_log_config_from_topic_config_rejects_bad_values(entries: dict[str, str]) -> None:
    with pytest.raises(InvalidConfigError) as excinfo:
        LogConfig.from_topic_config(entries)
    assert next(iter(entries)) in str(excinfo.value)


@pytest.mark.parametrize("delta", [0, 1, 10])
def test_a_batch_whose_offset_delta_disagrees_with_its_record_count_is_refused(
    tmp_path: Path, delta: int
) -> None:
    """Offsets are assigned from last_offset_delta, records decoded by record_count: a
    batch of 3 records claiming a delta of 0 would share offsets with the next batch, one
    claiming 10 would skip seven. Refused whole, nothing written (a mutation accepting
    them went unseen: the test helpers always set both together)."""
    directory = tmp_path / "p-0"
    log = open_log(directory)
    log.append(make_batch(1))
    before = dir_state(directory)
    buf = bytearray(make_batch(3))
    f.I32.pack_into(buf, f.LAST_OFFSET_DELTA_OFFSET, delta)
    with pytest.raises(CorruptBatchError, match="last_offset_delta"):
        log.append(bytes(reseal(buf)))
    assert dir_state(directory) == before and log.log_end_offset == 1
    log.close()


def test_truncation_to_empty_restarts_the_segment_age(tmp_path: Path) -> None:
    """Kafka's LogSegment.truncateTo resets a segment emptied by a truncation as new; its
    old age was kept, and one refilled with batches without timestamps (its age then
    counts from its creation) rolled at its second append (found by an audit)."""
    clock = ManualClock()
    log = Log.open(tmp_path / "p-0", LogConfig(segment_ms=DAY_MS, retention_ms=-1), clock=clock)
    log.append(encode_batch([b"a"], timestamps_ms=[-1]))
    clock.advance(2 * DAY_MS)
    log.truncate_to(0)  # a follower diverged from its first batch on: the segment is empty
    assert log.log_end_offset == 0 and log.segment_base_offsets == [0]
    log.append(encode_batch([b"b"], timestamps_ms=[-1]))
    log.append(encode_batch([b"c"], timestamps_ms=[-1]))
    # The refilled segment is seconds old: Kafka would not roll it.
    assert log.segment_base_offsets == [0]
    log.close()
