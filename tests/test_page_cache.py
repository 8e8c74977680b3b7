"""Drop-behind (``services.storage.log.page_cache``, ``page.cache.window.bytes``): a log keeps
only its newest bytes in the page cache, writes older ones back and drops them, and every
byte still reads back - from the disk - unchanged.

Real files in ``tmp_path``; what the page cache holds is asked of the kernel (``mincore``).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from services.storage.log import Log, LogConfig, page_cache
from services.storage.log.page_cache import MIN_STEP_BYTES, CacheWindow
from tests.support.page_cache import on_tmpfs, resident_pages
from tidelog.clock import ManualClock
from tidelog.records import decode_batches, encode_batch

MIB = 1 << 20
pytestmark = pytest.mark.skipif(not page_cache.SUPPORTED, reason="no sync_file_range here")


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    if on_tmpfs(tmp_path):
        pytest.skip("tmpfs has no disk to drop pages to")
    return tmp_path / "t-0"


def _batch(i: int) -> bytes:
    """~256 KiB: 256 records of 1 KiB, each value naming its batch and place; stamped
    with the logs' ManualClock time (a wall-clock stamp is years ahead of it)."""
    values = [(f"{i}:{j}:".encode()).ljust(1024, b"v") for j in range(256)]
    return encode_batch(values, base_timestamp_ms=ManualClock().now_ms())


def _fill(log: Log, batches: int, first: int = 0) -> list[bytes | None]:
    values: list[bytes | None] = []
    for i in range(first, first + batches):
        batch = _batch(i)
        log.append(batch)
        values += [r.value for r in decode_batches(batch)[0].records]
    return values


def _read_values(log: Log) -> list[bytes | None]:
    out: list[bytes | None] = []
    offset = log.log_start_offset
    while offset < log.log_end_offset:
        data = log.read(offset, 4 * MIB)
        records = [r for b in decode_batches(data) for r in b.records]
        out += [r.value for r in records]
        offset = records[-1].offset + 1
    return out


def _fraction_resident(path: Path, start: int, end: int) -> float:
    resident, pages = resident_pages(path, start, end)
    return resident / pages


def test_pages_behind_the_window_are_dropped_and_still_read_back(log_dir: Path) -> None:
    window = 2 * MIB  # steps of 512 KiB
    log = Log.open(log_dir, LogConfig(page_cache_window_bytes=window), clock=ManualClock())
    values = _fill(log, 48)  # ~12 MiB in one segment
    (segment,) = log_dir.glob("*.log")
    size = segment.stat().st_size
    # Everything more than a window and two steps behind the end has been dropped...
    assert _fraction_resident(segment, 0, size - window - 2 * MIN_STEP_BYTES) == 0.0
    # ...while the newest bytes, what followers and tailing consumers read, stay.
    assert _fraction_resident(segment, size - window // 2, size) == 1.0
    assert _read_values(log) == values  # CRC-checked reads, from the disk
    log.close()


def test_a_zero_window_keeps_every_page_as_kafka_does(log_dir: Path) -> None:
    log = Log.open(log_dir, LogConfig(page_cache_window_bytes=0), clock=ManualClock())
    _fill(log, 48)
    (segment,) = log_dir.glob("*.log")
    assert _fraction_resident(segment, 0, segment.stat().st_size) == 1.0
    log.close()


def test_a_retired_segment_is_dropped_once_the_next_holds_a_window(log_dir: Path) -> None:
    window = 2 * MIB
    config = LogConfig(page_cache_window_bytes=window, segment_bytes=4 * MIB)
    log = Log.open(log_dir, config, clock=ManualClock())
    values = _fill(log, 16)  # 4 MiB: the second segment starts with the 16th batch
    first = sorted(log_dir.glob("*.log"))[0]
    # The retired segment's newest bytes are still the log's newest, so they stay cached.
    assert _fraction_resident(first, first.stat().st_size - MIB, first.stat().st_size) == 1.0
    values += _fill(log, 9, first=16)
    assert log.segment_count == 2
    assert _fraction_resident(first, 0, first.stat().st_size) == 0.0
    assert _read_values(log) == values
    log.close()


def test_truncation_pulls_the_window_back(log_dir: Path) -> None:
    log = Log.open(log_dir, LogConfig(page_cache_window_bytes=MIB), clock=ManualClock())
    _fill(log, 24)  # ~6 MiB, most of it dropped
    log.truncate_to(256 * 4)  # back to 4 batches (~1 MiB), below what was dropped
    values = [r.value for i in range(4) for r in decode_batches(_batch(i))[0].records]
    values += _fill(log, 24, first=4)
    (segment,) = log_dir.glob("*.log")
    size = segment.stat().st_size
    # Dropping went on from the truncation point, over bytes written after it.
    assert _fraction_resident(segment, 2 * MIB, size - 3 * MIB) == 0.0
    assert _read_values(log) == values  # (reading brings pages back)
    log.close()


def test_a_file_that_cannot_write_back_turns_the_window_off() -> None:
    # A socket answers sync_file_range with ESPIPE, as some file systems answer EINVAL:
    # the window goes off for that file instead of failing the append.
    left, right = socket.socketpair()
    with left, right:
        window = CacheWindow(left.fileno(), 0)
        window.appended(8 * MIB, MIB)
        assert not window.enabled
        window.appended(16 * MIB, MIB)  # and stays quiet


def test_a_disk_error_is_not_taken_for_an_unsupported_file(tmp_path: Path) -> None:
    # A closed descriptor gives EBADF: not "unsupported", so it propagates (as EIO would).
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    os.close(fd)
    window = CacheWindow(fd, 0)
    with pytest.raises(OSError):
        window.appended(8 * MIB, MIB)
