"""One segment of a partition log: a ``.log`` file of batches plus its two sparse indexes.

Like Kafka's ``LogSegment``: a segment is named by its base offset (the offset of its first
batch), holds whole batches back to back, and adds an offset-index entry (and, when the
maximum timestamp grew, a time-index entry) once more than ``index_interval_bytes`` were
written since the last entry (seeds 000 and 002).

Invariants:
- ``[0, size_bytes)`` of the ``.log`` is a sequence of whole, checksummed batches whose
  offsets are contiguous from ``base_offset`` (established by ``recover`` or by appends).
- Every offset-index entry points at the first byte of a batch with that base offset;
  lookups confirm it against the batch header and fall back to a scan when it does not.
- Only the active (last) segment is written; its indexes are preallocated and mapped.

Thread-safety: none; the owning ``Log`` is serialized by its caller.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from tidelog import formats
from tidelog.batch import BatchHeader, check_batch, check_header
from tidelog.errors import CorruptBatchError, StorageError

from .config import LogConfig
from .errors import IndexCorruptError
from .index import OffsetIndex, TimeIndex
from .page_cache import CacheWindow

RECOVERY_CHUNK_BYTES = 8 << 20
"""How much of the log recovery reads at a time: large reads, few syscalls."""

_MAX_HEADER_WALK = 64
"""A read of more batches than this is cut after the pread instead (``_whole_batches``)."""


_IOV_MAX = 1024
"""Buffers one ``pwritev`` takes at most (Linux's IOV_MAX)."""


def _pwrite_all(fd: int, buffers: Sequence[bytes | bytearray | memoryview], offset: int) -> int:
    """Write ``buffers`` back to back at ``offset`` with as few ``pwritev`` calls as
    possible (a write may take less than asked: the rest follows). Returns bytes written."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    total = sum(len(v) for v in views)
    first = 0
    position = offset
    while first < len(views):
        written = os.pwritev(fd, views[first : first + _IOV_MAX], position)
        if written <= 0:
            raise OSError(f"pwritev wrote nothing at position {position}")
        position += written
        while written:  # drop what was written: whole buffers, then part of one
            if written >= len(views[first]):
                written -= len(views[first])
                first += 1
            else:
                views[first] = views[first][written:]
                written = 0
    return total


class BatchSpan(NamedTuple):
    """Where one validated batch sits inside the buffer handed to ``append``."""

    position: int  # within that buffer
    size_bytes: int
    base_offset: int
    last_offset: int
    max_timestamp_ms: int


class LogSegment:
    """A ``.log`` file with its ``.index`` and ``.timeindex``; see the module docstring."""

    def __init__(
        self,
        directory: Path,
        base_offset: int,
        config: LogConfig,
        *,
        created_ms: int,
        roll_jitter_ms: int = 0,
        active: bool = False,
        end_offset: int | None = None,
    ) -> None:
        """``end_offset`` is the next segment's base offset when there is one: the
        load-time index checks reject entries at or past it."""
        self.directory = directory
        self.base_offset = base_offset
        self.config = config
        self.created_ms = created_ms
        self.roll_jitter_ms = roll_jitter_ms
        self.log_path = directory / formats.segment_file_name(base_offset, formats.LOG_SUFFIX)
        self.index_path = directory / formats.segment_file_name(base_offset, formats.INDEX_SUFFIX)
        self.time_index_path = directory / formats.segment_file_name(
            base_offset, formats.TIME_INDEX_SUFFIX
        )
        self._fd = os.open(self.log_path, os.O_RDWR | os.O_CREAT, 0o644)
        self.size_bytes = os.fstat(self._fd).st_size
        self._cache = CacheWindow(self._fd, self.size_bytes)
        # True when an index was missing or failed its checks: the owner must recover().
        self.needs_rebuild = False
        # True when the indexes passed their checks but hold fewer entries than the data
        # needs (``_indexes_incomplete``): the owner rebuilds them from the batch headers.
        self.indexes_incomplete = False
        self.offset_index, self.time_index = self._open_indexes(active, end_offset)
        self._bytes_since_index_entry = 0
        # Tail state (next offset, largest timestamp) is loaded lazily for segments that
        # were opened from disk, because scanning every old segment at start-up is waste.
        self._next_offset: int | None = base_offset if self.size_bytes == 0 else None
        self._max_timestamp_ms = -1
        self._offset_of_max_timestamp = base_offset
        self._tail_loaded = self.size_bytes == 0
        # Kafka's rollingBasedTimestamp: the max timestamp of the first batch, which
        # segment.ms counts from (``should_roll``); None until read (one header) or known.
        self._first_batch_timestamp_ms: int | None = -1 if self.size_bytes == 0 else None

    def _open_indexes(self, active: bool, end_offset: int | None) -> tuple[OffsetIndex, TimeIndex]:
        max_bytes = self.config.segment_index_bytes
        if self.index_path.exists() and self.time_index_path.exists():
            opened: list[OffsetIndex | TimeIndex] = []
            try:
                offset_index = OffsetIndex(self.index_path, self.base_offset, max_bytes, active)
                opened.append(offset_index)
                time_index = TimeIndex(self.time_index_path, self.base_offset, max_bytes, active)
                opened.append(time_index)
                offset_index.sanity_check(self.size_bytes, end_offset)
                time_index.sanity_check(self.size_bytes, end_offset)
                self.indexes_incomplete = self._indexes_incomplete(offset_index, time_index)
                return offset_index, time_index
            except IndexCorruptError:
                for index in opened:
                    index.close()
        # Missing or damaged: start both afresh (writable until recover() fills them from
        # the log and the owner trims them).
        self.needs_rebuild = self.size_bytes > 0
        for path in (self.index_path, self.time_index_path):
            path.unlink(missing_ok=True)
        return (
            OffsetIndex(self.index_path, self.base_offset, max_bytes, True),
            TimeIndex(self.time_index_path, self.base_offset, max_bytes, True),
        )

    def _indexes_incomplete(self, offset_index: OffsetIndex, time_index: TimeIndex) -> bool:
        """Whether well-formed indexes lack entries the data must have produced: a file
        truncated to nothing (or at an entry boundary down to nothing) passes every
        ordering check, and an empty time index made ``largest_timestamp_ms`` come from
        the last few batches only (ListOffsets wrong, retention deleting early).

        - The offset index is empty although more than ``index_interval_bytes`` precede
          the last batch. Only the size is known here, so any segment over the interval
          counts; the legitimate cases (all but the last batch within the interval) are a
          few batch headers to re-read, never a long scan.
        - The time index is empty although the segment holds data: its first entry comes
          with the first offset-index entry, and a segment that stopped being active got
          a final entry, unless every timestamp is negative (then the segment is again at
          most the interval plus one batch).
        """
        if self.size_bytes == 0:
            return False
        return time_index.entries == 0 or (
            offset_index.entries == 0 and self.size_bytes > self.config.index_interval_bytes
        )

    # --- reading batch headers from the file ----------------------------------------------

    def _pread(self, size: int, position: int) -> bytes:
        data = os.pread(self._fd, size, position)
        if len(data) != size:
            raise StorageError(
                f"short read from {self.log_path.name}: {len(data)} of {size} bytes at {position}"
            )
        return data

    def _header_at(self, position: int) -> BatchHeader:
        """The verified header at ``position``; StorageError if the bytes there are bad."""
        if self.size_bytes - position < formats.BATCH_HEADER_SIZE:
            raise StorageError(f"{self.log_path.name}: torn batch header at position {position}")
        try:
            header = check_header(self._pread(formats.BATCH_HEADER_SIZE, position))
        except CorruptBatchError as exc:
            raise StorageError(f"{self.log_path.name}: corrupt data on disk: {exc}") from None
        if position + header.size_bytes > self.size_bytes:
            raise StorageError(f"{self.log_path.name}: torn batch at position {position}")
        return header

    def _scan_headers(self, position: int) -> Iterator[tuple[int, BatchHeader]]:
        """Headers from ``position`` (a batch start) to the end of the segment."""
        while position < self.size_bytes:
            header = self._header_at(position)
            yield position, header
            position += header.size_bytes

    def _scan_from(
        self, start: tuple[int, BatchHeader] | None
    ) -> Iterator[tuple[int, BatchHeader]]:
        """Headers from an index-confirmed start (or position 0) to the end of the segment.

        Optimisation (bench/storage_engine.py): ``_indexed_start`` has already read and
        verified the header at the start, so it is reused rather than read and checked a
        second time; that saves a pread and a header check on every lookup.
        """
        if start is None:
            yield from self._scan_headers(0)
            return
        position, header = start
        yield position, header
        yield from self._scan_headers(position + header.size_bytes)

    def _indexed_start(self, offset: int) -> tuple[int, BatchHeader] | None:
        """The index's floor entry for ``offset``, confirmed against the header it names.

        None when the index has no entry that low (scan from position 0). An entry that
        does not land on a batch with the expected base offset means the index is damaged:
        both indexes are rebuilt from the log on the spot and the lookup is repeated, so
        the damage costs one scan, not a scan on every later read.
        """
        for attempt in range(2):
            indexed_offset, position = self.offset_index.lookup(offset)
            if position == 0 and indexed_offset == self.base_offset:
                return None  # no entry that low: scan from the start
            # (An entry never points at position 0, so one that does is damage.)
            try:
                header = self._header_at(position)
            except StorageError:
                header = None
            if header is not None and header.base_offset == indexed_offset:
                return position, header
            if attempt == 0:
                self.rebuild_indexes()
        return None  # the rebuilt index still disagrees: data damage; scan and fail there

    def rebuild_indexes(self) -> None:
        """Rebuild both indexes from the batch headers in the log.

        Stops at the first damaged batch: entries before it are right, and reads past it
        fail as they must. Used when an entry proves wrong after the segment was opened.
        """
        was_writable = self.offset_index.writable
        self.offset_index.make_writable()
        self.time_index.make_writable()
        self.offset_index.reset()
        self.time_index.reset()
        self._bytes_since_index_entry = 0
        self._max_timestamp_ms, self._offset_of_max_timestamp = -1, self.base_offset
        next_offset = self.base_offset
        try:
            for position, header in self._scan_headers(0):
                self.append_index_entries(position, header)
                next_offset = header.next_offset
            self._next_offset, self._tail_loaded = next_offset, True
        except StorageError:
            self._tail_loaded = False
        if not was_writable:
            # As ``on_become_inactive`` does: without the final entry, a segment of one
            # small batch would be rebuilt again at every open (``_indexes_incomplete``).
            if self._max_timestamp_ms >= 0 and not self.time_index.is_full:
                self.time_index.maybe_append(self._max_timestamp_ms, self._offset_of_max_timestamp)
            self.offset_index.trim()
            self.time_index.trim()
        self.needs_rebuild = False
        self.indexes_incomplete = False

    def translate_offset(self, offset: int) -> tuple[int, BatchHeader] | None:
        """Position and header of the batch holding ``offset``; None if past this segment."""
        if self.size_bytes == 0:
            return None
        start = self._indexed_start(offset)
        for position, header in self._scan_from(start):
            if header.last_offset >= offset:
                return position, header
        return None

    def headers_from(self, offset: int) -> Iterator[tuple[int, BatchHeader]]:
        """Positions and verified headers of the batches from the one holding ``offset`` to
        the end of the segment (the leader-epoch and producer-state rebuilds use these:
        header fields only, one 65-byte read per batch). StorageError on damage."""
        if self.size_bytes == 0:
            return
        for position, header in self._scan_from(self._indexed_start(offset)):
            if header.last_offset >= offset:
                yield position, header

    # --- tail state ---------------------------------------------------------------------

    def _load_tail(self) -> None:
        """Next offset and largest timestamp, loaded on first use (see ``_scan_tail``).

        If the index's last entry proves wrong, the indexes are rebuilt (which also finds
        the tail); damage in the tail itself raises StorageError.
        """
        if self._tail_loaded:
            return
        try:
            self._scan_tail()
        except StorageError:
            self.rebuild_indexes()
            if not self._tail_loaded:
                self._scan_tail()

    def _scan_tail(self) -> None:
        """Last index entries plus a header scan of the batches after them.

        The time index's last entry is confirmed against the batch it names first
        (StorageError if wrong, and ``_load_tail`` rebuilds): it alone says what the
        largest timestamp before the scanned tail is, and retention deletes by it.
        """
        if self.time_index.entries:
            timestamp_ms, rel = self.time_index.entry(self.time_index.entries - 1)
            if not self._time_entry_holds(timestamp_ms, self.base_offset + rel):
                raise StorageError(
                    f"{self.time_index_path.name}: last entry ({timestamp_ms}, "
                    f"{self.base_offset + rel}) does not match its batch"
                )
            if self._tail_loaded:
                return  # the lookup found a wrong offset entry and rebuilt everything
        _, position = self.offset_index.lookup(self.base_offset + formats.MAX_RELATIVE_OFFSET)
        max_ts, offset_of_max = -1, self.base_offset
        if self.time_index.entries:
            max_ts, rel = self.time_index.entry(self.time_index.entries - 1)
            offset_of_max = self.base_offset + rel
        next_offset = self.base_offset
        for _, header in self._scan_headers(position):
            next_offset = header.next_offset
            if header.max_timestamp > max_ts:
                max_ts, offset_of_max = header.max_timestamp, header.last_offset
        self._next_offset = next_offset
        self._max_timestamp_ms, self._offset_of_max_timestamp = max_ts, offset_of_max
        self._bytes_since_index_entry = self.size_bytes - position
        self._tail_loaded = True

    def _time_entry_holds(self, timestamp_ms: int, offset: int) -> bool:
        """Whether the time-index entry ``(timestamp_ms, offset)`` is right: the batch
        holding ``offset`` carries that max timestamp (an entry names the batch that
        raised the segment's maximum to it). One index lookup and a few header reads.

        An entry of -1 (every timestamp so far negative) names no such batch and is not
        checked; nor is one whose batch cannot be read (the damage fails the reads that
        reach it).
        """
        if timestamp_ms < 0:
            return True
        try:
            found = self.translate_offset(offset)
        except StorageError:
            return True
        return found is not None and found[1].max_timestamp == timestamp_ms

    @property
    def next_offset(self) -> int:
        """One past the last offset in this segment (its base offset when empty)."""
        self._load_tail()
        assert self._next_offset is not None
        return self._next_offset

    @property
    def largest_timestamp_ms(self) -> int:
        """The newest record timestamp in the segment; -1 when empty."""
        self._load_tail()
        return self._max_timestamp_ms

    @property
    def known_max_timestamp_ms(self) -> int:
        """``largest_timestamp_ms``, or when the tail cannot be read (damage after the
        last index entry of a segment trusted at start-up), the largest of the time
        index's last entry and the batches readable before the damage: about what Kafka
        ages and searches segments by (its time index) without reading the log.
        Retention and lookups by time raised on such a segment at every pass: the
        partition was never trimmed again, and every ListOffsets by time failed, however
        new its answer (found by an audit). A read that reaches the damage still fails."""
        try:
            return self.largest_timestamp_ms
        except StorageError:
            known = -1
            if self.time_index.entries:
                known = self.time_index.entry(self.time_index.entries - 1)[0]
            _, position = self.offset_index.lookup(self.base_offset + formats.MAX_RELATIVE_OFFSET)
            try:
                for _, header in self._scan_headers(position):
                    known = max(known, header.max_timestamp)
            except StorageError:
                pass  # the damage: what is after it is unknown
            return known

    @property
    def retention_timestamp_ms(self) -> int:
        """What retention.ms ages the segment by: the newest record timestamp, or when no
        record has a non-negative one, the ``.log`` file's last-modified time in ms
        (Kafka's ``LogSegment.largestTimestamp``). Without the fallback a segment of
        negative timestamps was never old enough, and retention, which removes segments
        oldest first, stopped at it for good."""
        largest = self.known_max_timestamp_ms
        if largest >= 0:
            return largest
        return os.fstat(self._fd).st_mtime_ns // 1_000_000

    @property
    def first_batch_timestamp_ms(self) -> int:
        """The max timestamp of the first batch (-1 when empty or unreadable): what
        segment.ms counts from, so a restart does not reset a segment's age."""
        if self._first_batch_timestamp_ms is None:
            try:
                self._first_batch_timestamp_ms = self._header_at(0).max_timestamp
            except StorageError:
                self._first_batch_timestamp_ms = -1  # damage: age from creation instead
        return self._first_batch_timestamp_ms

    # --- writing --------------------------------------------------------------------------

    def should_roll(
        self, incoming_bytes: int, last_offset: int, max_timestamp_ms: int, now_ms: int
    ) -> bool:
        """Whether an append of ``incoming_bytes`` ending at ``last_offset``, whose largest
        timestamp is ``max_timestamp_ms``, needs a new segment.

        An empty segment never rolls: the caller (``Log``) hands a segment only batches
        whose offsets fit it, and every batch fits a fresh one.
        """
        if self.size_bytes == 0:
            return False
        return (
            self.size_bytes + incoming_bytes > self.config.segment_bytes
            or self.roll_age_ms(max_timestamp_ms, now_ms)
            > self.config.segment_ms - self.roll_jitter_ms
            or self.offset_index.is_full
            or self.time_index.is_full
            or last_offset - self.base_offset > formats.MAX_RELATIVE_OFFSET
        )

    def roll_age_ms(self, max_timestamp_ms: int, now_ms: int) -> int:
        """How old the segment is for segment.ms: Kafka's ``timeWaitedForRoll``.

        From the first batch's max timestamp to the incoming one, as Kafka measures it,
        so the age survives restarts (counting from when this process opened the segment
        reset it at each restart, and a broker restarted more often than segment.ms never
        rolled, so retention could never delete the active segment's data). When the
        first batch has no usable timestamp, from the segment's creation in this process.
        """
        first_ms = self.first_batch_timestamp_ms
        if first_ms >= 0:
            return max_timestamp_ms - first_ms
        return now_ms - self.created_ms

    def _index_entry_due(self) -> bool:
        """Whether the next batch gets an index entry: the interval has passed and both
        indexes have room.

        Fix (test_storage_log.py::test_multi_batch_append_fills_index): ``should_roll``
        checks ``is_full`` once per append, but one append of many batches can add several
        entries, and appending to a full index raised RuntimeError after the data had
        already been written (the segment's size and the log end were then left stale).
        The index is sparse, so skipping entries once it is full is harmless: lookups scan
        a little further, and the next append rolls. The same guard lets recovery rebuild
        a segment under a smaller ``segment_index_bytes`` than it was written with.
        """
        return (
            self._bytes_since_index_entry > self.config.index_interval_bytes
            and not self.offset_index.is_full
            and not self.time_index.is_full
        )

    def append(
        self, data: Sequence[bytes | bytearray | memoryview], spans: list[BatchSpan]
    ) -> None:
        """Write validated batches (offsets already assigned) at the end of the segment:
        the buffers of ``data`` back to back, ``spans`` giving the batches' places in
        their concatenation.

        Everything that could refuse the batches is checked before the first byte is
        written (the index appends below cannot fail then): a refusal after the write
        left bytes in the file that the segment's size did not count, later appends
        failed, and recovery served the refused batches after a restart.
        """
        self._load_tail()
        if spans[0].base_offset != self.next_offset:
            raise StorageError(
                f"{self.log_path.name}: append at offset {spans[0].base_offset}, "
                f"the segment ends at {self.next_offset}"
            )
        if spans[-1].last_offset - self.base_offset > formats.MAX_RELATIVE_OFFSET:
            raise StorageError(
                f"{self.log_path.name}: offset {spans[-1].last_offset} does not fit a "
                f"segment based at {self.base_offset}; the log should have rolled"
            )
        start = self.size_bytes
        size = _pwrite_all(self._fd, data, start)
        if start == 0:
            self._first_batch_timestamp_ms = spans[0].max_timestamp_ms
        for span in spans:
            if span.max_timestamp_ms > self._max_timestamp_ms:
                self._max_timestamp_ms = span.max_timestamp_ms
                self._offset_of_max_timestamp = span.last_offset
            if self._index_entry_due():
                self.offset_index.append(span.base_offset, start + span.position)
                self.time_index.maybe_append(self._max_timestamp_ms, self._offset_of_max_timestamp)
                self._bytes_since_index_entry = 0
            self._bytes_since_index_entry += span.size_bytes
        self.size_bytes = start + size
        self._next_offset = spans[-1].last_offset + 1
        self._cache.appended(self.size_bytes, self.config.page_cache_window_bytes)

    def read(self, offset: int, max_bytes: int, max_offset: int | None) -> bytes | None:
        """Whole, verified batches from the one holding ``offset``.

        At most ``max_bytes`` unless the first batch alone is larger (then exactly that
        batch, so a consumer can always make progress); only batches that end before
        ``max_offset``. None when ``offset`` is past this segment. Corrupt data is never
        served: a damaged first batch raises StorageError, a damaged later one ends the
        answer before it.
        """
        found = self.translate_offset(offset)
        if found is None:
            return None
        position, header = found
        if max_offset is not None and header.last_offset >= max_offset:
            return b""
        want = max(header.size_bytes, min(max_bytes, self.size_bytes - position))
        if want < self.size_bytes - position or max_offset is not None:
            want = self._whole_batches(position, header, want, max_offset)
        buf = self._pread(want, position)
        end = 0
        while end + formats.LOG_OVERHEAD <= len(buf):
            size = formats.LOG_OVERHEAD + formats.I32.unpack_from(buf, end + 8)[0]
            if size > len(buf) - end:
                break  # cut by max_bytes; the next read starts here
            try:
                batch = check_batch(buf, end)
            except CorruptBatchError as exc:
                if end == 0:
                    raise StorageError(
                        f"{self.log_path.name}: corrupt batch on disk at position {position}: {exc}"
                    ) from None
                break
            if max_offset is not None and batch.last_offset >= max_offset:
                break
            end += size
        return buf if end == len(buf) else buf[:end]

    def _whole_batches(
        self, position: int, header: BatchHeader, want: int, max_offset: int | None
    ) -> int:
        """The bytes of the whole batches from ``position`` that fit ``want`` (at least the
        first), found from their headers when there are few of them; else ``want``.

        Optimisation (bench/replication.py): a read cut by ``max_bytes`` would otherwise
        pread a part of the next batch and then copy the whole answer to drop it (8 MiB
        per replica fetch of 1 MiB batches). One small header read per batch costs far
        less than that copy while the batches are large; for many small batches reading
        the headers would cost more, so those keep the plain read and cut.
        """
        if want // header.size_bytes > _MAX_HEADER_WALK:
            return want
        end = header.size_bytes
        while position + end < self.size_bytes:
            try:
                header = self._header_at(position + end)
            except StorageError:
                break  # damage ends the answer here, as the checks in ``read`` would
            if end + header.size_bytes > want:
                break
            if max_offset is not None and header.last_offset >= max_offset:
                break
            end += header.size_bytes
        return end

    def find_by_timestamp(self, timestamp_ms: int) -> tuple[int, BatchHeader] | None:
        """Position and header of the first batch whose max timestamp >= ``timestamp_ms``."""
        if self.known_max_timestamp_ms < timestamp_ms:
            return None
        found: tuple[int, BatchHeader] | None = None
        for attempt in range(2):
            found, entry_holds = self._scan_by_timestamp(timestamp_ms)
            if entry_holds:
                break
            if attempt == 0:
                # A wrong entry sent the scan past the answer: rebuild, as for a wrong
                # offset-index entry (``_indexed_start``), and look again.
                self.rebuild_indexes()
        return found

    def _scan_by_timestamp(self, timestamp_ms: int) -> tuple[tuple[int, BatchHeader] | None, bool]:
        """The first batch reaching ``timestamp_ms`` from the time index's floor entry,
        and whether that entry proved right on the way.

        An entry ``(t, o)`` says the batch holding ``o`` has max timestamp ``t`` and every
        batch before it less (it was the first to raise the segment's maximum to ``t``).
        The scan starts at or before that batch, so an answer before it, or that batch
        with another timestamp, means the entry is wrong. Costs no extra reads.
        """
        entry_ms, offset = self.time_index.lookup(timestamp_ms)
        checked = entry_ms < 0  # no entry that low, or -1: nothing to confirm
        for position, header in self._scan_from(self._indexed_start(offset)):
            if not checked and header.last_offset >= offset:
                if header.base_offset > offset or header.max_timestamp != entry_ms:
                    return None, False
                checked = True
            if header.max_timestamp >= timestamp_ms:
                return (position, header), checked
        return None, checked

    def read_batch(self, position: int, header: BatchHeader) -> bytes:
        return self._pread(header.size_bytes, position)

    # --- recovery and truncation -----------------------------------------------------------

    def recover(self) -> int:
        """Rebuild both indexes from the log, truncating at the first invalid batch.

        A batch is valid when it is whole, both checksums match, and its base offset
        continues the previous batch (the first starts at ``base_offset``). Returns the
        number of bytes truncated. Like Kafka's ``LogSegment.recover``.
        """
        self.offset_index.make_writable()
        self.time_index.make_writable()
        self.offset_index.reset()
        self.time_index.reset()
        self._bytes_since_index_entry = 0
        self._max_timestamp_ms, self._offset_of_max_timestamp = -1, self.base_offset
        self._next_offset = self.base_offset
        self._tail_loaded = True
        valid_bytes = 0
        for position, header in self._recovery_scan():
            self.append_index_entries(position, header)
            valid_bytes = position + header.size_bytes
            self._next_offset = header.next_offset
        truncated = self.size_bytes - valid_bytes
        if truncated:
            os.ftruncate(self._fd, valid_bytes)
            self.size_bytes = valid_bytes
        self._first_batch_timestamp_ms = None if self.size_bytes else -1
        self.needs_rebuild = False
        self.indexes_incomplete = False
        return truncated

    def append_index_entries(self, position: int, header: BatchHeader) -> None:
        """Index bookkeeping for a batch already in the file (recovery's half of append)."""
        if header.max_timestamp > self._max_timestamp_ms:
            self._max_timestamp_ms = header.max_timestamp
            self._offset_of_max_timestamp = header.last_offset
        if self._index_entry_due():
            self.offset_index.append(header.base_offset, position)
            self.time_index.maybe_append(self._max_timestamp_ms, self._offset_of_max_timestamp)
            self._bytes_since_index_entry = 0
        self._bytes_since_index_entry += header.size_bytes

    def _recovery_scan(self) -> Iterator[tuple[int, BatchHeader]]:
        """Valid batches from the start, in chunks; stops at the first invalid one."""
        expected = self.base_offset
        position = 0
        buf, buf_start = b"", 0
        while position < self.size_bytes:
            rel = position - buf_start
            if len(buf) - rel < formats.LOG_OVERHEAD:
                buf, buf_start, rel = self._refill(position, formats.LOG_OVERHEAD), position, 0
                if len(buf) < formats.LOG_OVERHEAD:
                    return
            size = formats.LOG_OVERHEAD + formats.I32.unpack_from(buf, rel + 8)[0]
            if size < formats.BATCH_HEADER_SIZE or size > self.size_bytes - position:
                return  # torn or garbage length
            if len(buf) - rel < size:
                buf, buf_start, rel = self._refill(position, size), position, 0
            try:
                header = check_batch(memoryview(buf)[rel : rel + size])
            except CorruptBatchError:
                return
            if header.base_offset != expected:
                return
            yield position, header
            expected = header.next_offset
            position += size

    def _refill(self, position: int, at_least: int) -> bytes:
        size = min(max(RECOVERY_CHUNK_BYTES, at_least), self.size_bytes - position)
        return os.pread(self._fd, size, position)

    def truncate_to(self, offset: int, *, now_ms: int) -> int:
        """Remove the batch holding ``offset`` and everything after; returns bytes removed.

        Truncation happens at a batch boundary, so the segment's next offset afterwards is
        the base offset of the batch that held ``offset`` (or ``offset`` itself when it
        already starts a batch). Emptied, the segment is as new: its age counts from
        ``now_ms`` (Kafka's LogSegment.truncateTo; it kept its old age, and one refilled
        with batches without timestamps rolled at its second append; found by an audit).
        """
        found = self.translate_offset(offset)
        if found is None:
            return 0
        position, header = found
        self.offset_index.truncate_to(header.base_offset)
        self.time_index.truncate_to(header.base_offset)
        removed = self.size_bytes - position
        os.ftruncate(self._fd, position)
        self.size_bytes = position
        self._cache.truncated(position)
        self._tail_loaded = False
        self._next_offset = None
        if position == 0:
            self._next_offset, self._tail_loaded = self.base_offset, True
            # Both: a stale offset of the max timestamp went into the next time-index
            # entry (due before any timestamped batch came), naming an offset past the log
            # end, and lookups by time started their scan there (found by an audit).
            self._max_timestamp_ms, self._offset_of_max_timestamp = -1, self.base_offset
            self._bytes_since_index_entry = 0
            self._first_batch_timestamp_ms = -1
            self.created_ms = now_ms
        return removed

    # --- lifecycle -------------------------------------------------------------------------

    def make_active(self) -> None:
        """Prepare to take appends again (after a truncation made this the last segment)."""
        self._load_tail()
        self.offset_index.make_writable()
        self.time_index.make_writable()

    def on_become_inactive(self) -> None:
        """Called when a newer segment takes over: final time entry, trimmed indexes."""
        self._load_tail()
        # Fix (test_storage_log.py::test_roll_on_full_time_index): a segment often rolls
        # *because* its time index is full; if batches appended after it filled raised the
        # max timestamp, adding the final entry raised RuntimeError and the log could never
        # roll again. The final entry only saves a tail scan (``_load_tail`` and
        # ``find_by_timestamp`` scan past the last entry anyway), so a full index goes
        # without it.
        if self._max_timestamp_ms >= 0 and not self.time_index.is_full:
            self.time_index.maybe_append(self._max_timestamp_ms, self._offset_of_max_timestamp)
        self.offset_index.trim()
        self.time_index.trim()

    def release_cache(self) -> None:
        """Write back and drop this (retired) segment's pages from the page cache
        (``page_cache``); a no-op once closed."""
        if self._fd >= 0:
            self._cache.release(self.size_bytes)

    def flush(self) -> None:
        os.fsync(self._fd)
        self.offset_index.flush()
        self.time_index.flush()

    def close(self) -> None:
        if self._fd < 0:
            return
        self.offset_index.close()
        self.time_index.close()
        os.close(self._fd)
        self._fd = -1

    def files(self) -> list[Path]:
        return [self.log_path, self.index_path, self.time_index_path]

    def rename_to_deleted(self) -> list[Path]:
        """Close and rename every file to ``*.deleted``; the caller unlinks them later."""
        self.close()
        renamed = []
        for path in self.files():
            if path.exists():
                target = path.with_name(path.name + formats.DELETED_SUFFIX)
                path.rename(target)
                renamed.append(target)
        return renamed
