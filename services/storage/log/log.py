"""A partition log: an append-only sequence of record batches split into segments.

``Log`` is the storage engine's top noun (Kafka's ``UnifiedLog`` / ``LocalLog``): it
validates and appends batches, assigns offsets by rewriting only the header fields the
broker owns, rolls segments, reads whole batches by offset, flushes by policy, recovers
after a crash, truncates for replication, and applies retention. It is pure library code:
no threads, no RPC, no sleeping; time comes from an injected clock.

Two pieces of replication state live beside the segments and are kept consistent with
them by every operation here (append, truncation, retention, recovery):

- the leader epoch cache (``leader_epoch.LeaderEpochCache``, file
  ``leader-epoch-checkpoint``): where each leader epoch starts, for OffsetForLeaderEpoch
  (``end_offset_for_epoch``) and divergence truncation (KIP-101/KIP-279);
- the idempotent-producer state (``producer_state.ProducerStateManager``, files
  ``<offset>.snapshot``): the last batches of each producer id, so a leader append dedupes
  retries and rejects out-of-order or fenced batches before writing anything.

Invariants:
- offsets are contiguous: ``[log_start_offset, log_end_offset)`` are all present;
- ``log_start_offset`` is the first segment's base offset (retention removes whole
  segments, never the active one);
- ``recovery_point <= log_end_offset``, and every offset below the recovery point has been
  fsynced; recovery after a crash re-verifies everything from the segment holding the
  recovery point onwards;
- nothing damaged is ever returned by ``read``;
- the leader epoch cache only names offsets in ``[log_start_offset, log_end_offset]``,
  and its file is written before the batches that start a new epoch (so after a crash it
  covers the data; the excess is trimmed on open);
- the producer state reflects exactly the batches below ``log_end_offset``; every
  producer snapshot on disk is at or below it (snapshots above are deleted when the log
  shrinks, with a directory fsync, so a stale one cannot come back).

Disk failures: an ``OSError`` from any operation that touches the files is reported to
``on_disk_failure`` before it propagates (``is_disk_failure``: every errno but the few of a
path conflict, as Kafka treats every IOException; a short list of
"disk" errnos once let EUCLEAN, what ext4 and xfs answer on detected corruption, pass as
a per-request error after a failed fsync). After a failed write or fsync the state of the
files is unknown (Linux may even drop the dirty pages a failed fsync was about, so a later
fsync "succeeds" without the data), so the only safe answer is Kafka's: take the log
directory offline -- the storage node halts (``services/storage/node.py``) and recovers
from what is really on disk when it restarts, while the other replicas serve.

Thread-safety: none. One caller at a time; the partition layer holds a lock around every
call (reads included, because a read may rebuild a damaged index).
"""

from __future__ import annotations

import errno
import functools
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Concatenate, Final, ParamSpec, TypeVar

from tidelog import formats
from tidelog.batch import (
    LOG_APPEND_TIME_STAMPED_END,
    BatchHeader,
    check_batch,
    parse_header,
    stamp,
    stamp_log_append_time,
)
from tidelog.clock import SYSTEM_CLOCK, Clock
from tidelog.errors import (
    CorruptBatchError,
    InvalidFetchSizeError,
    InvalidRecordError,
    InvalidRequestError,
    InvalidTimestampError,
    MessageTooLargeError,
    OffsetOutOfRangeError,
    StorageError,
)
from tidelog.records import (
    ALIGNMENT,
    DEFAULT_MAX_UNCOMPRESSED_BYTES,
    UNCOMPRESSED_BODY_PAD,
    decode_batches,
)

from .checkpoint import fsync_dir
from .config import CREATE_TIME, LOG_APPEND_TIME, LogConfig
from .errors import CheckpointCorruptError
from .leader_epoch import LeaderEpochCache
from .producer_state import DEFAULT_PRODUCER_ID_EXPIRATION_MS, ProducerStateManager
from .segment import BatchSpan, LogSegment
from .segments import LogSegments

NOT_DISK_FAILURE_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EEXIST})
"""OSErrors of a path conflict, not of a failing disk: a path gone (a partition deleted
while a request read it) or taken by a stray file where a log directory goes (that
partition fails with STORAGE_ERROR and the controller sends it again). Every other
OSError from the files is a disk failure."""


TIMESTAMP_LOOKUP_MAX_UNCOMPRESSED_BYTES: Final = 16 * 1024 * 1024
"""What the one batch a lookup by time decodes may inflate to. With a consumer's limit (2
GiB), an 8 KB batch of zeros made every ListOffsets by time allocate hundreds of MiB in
the broker (found by an audit); past this the batch's header answers (its base offset and
largest timestamp: the answer within a batch is less exact, never wrong by more than it)."""


def is_disk_failure(error: OSError) -> bool:
    return error.errno not in NOT_DISK_FAILURE_ERRNOS


DiskFailureHandler = Callable[[Path, OSError], None]
"""Called with the failed directory and the error before a disk failure propagates (see
the module docstring); the storage node's handler halts the process."""

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _reports_disk_failure(
    method: Callable[Concatenate[Log, _P], _R],
) -> Callable[Concatenate[Log, _P], _R]:
    @functools.wraps(method)
    def wrapper(self: Log, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(self, *args, **kwargs)
        except OSError as exc:
            if is_disk_failure(exc) and self.on_disk_failure is not None:
                self.on_disk_failure(self.dir, exc)
            raise

    return wrapper


MAX_COMPRESSION_RATIO = {
    formats.COMPRESSION_ZSTD: 1 << 15,
    formats.COMPRESSION_LZ4: 255,
}
"""The most plain bytes one byte of a frame can stand for. zstd: a block holds at most
128 KiB and takes at least 4 bytes (3 of header and 1 for an RLE block). lz4: a match
longer than 19 bytes grows by at most 255 bytes per extra length byte. Measured on zeros:
32,617 and 254.8."""


def _padded(size: int) -> int:
    return size + -size % ALIGNMENT


def min_plain_body_bytes(record_count: int, attributes: int) -> int:
    """The smallest plain body that can hold ``record_count`` records with these
    attribute bits (docs/FORMAT.md 2.2): every section at its least, all data empty.

    About 4.1 bytes a record (value validity bit and offset), 8 more with timestamps.
    """
    n = record_count
    column = _padded((n + 7) // 8) + _padded(4 * (n + 1))  # validity and offsets
    size = column  # the value column is always there
    if attributes & formats.ATTR_HAS_TIMESTAMPS:
        size += _padded(8 * n)
    if attributes & formats.ATTR_HAS_KEYS:
        size += column
    if attributes & formats.ATTR_HAS_HEADERS:
        # list offsets, then name and value offsets for zero header entries
        size += _padded(4 * (n + 1)) + 2 * _padded(4)
    return size


def check_record_count(header: BatchHeader, position: int) -> None:
    """Refuse a batch whose header claims more records than its bytes can hold.

    The broker never decodes bodies, so ``record_count`` is taken on trust for the
    offsets it assigns; a batch of 100 bytes claiming 2^31 - 1 records took 2^31 offsets,
    and a few of them passed a segment's 2^32 relative offsets in one append. O(1): the
    claim is compared with what the body region could hold at the smallest encoding, for
    a compressed body at the codec's largest compression ratio and at most what a
    consumer inflates (``records.DEFAULT_MAX_UNCOMPRESSED_BYTES``).
    """
    region_bytes = header.size_bytes - formats.BATCH_HEADER_SIZE
    if header.compression == formats.COMPRESSION_NONE:
        plain_bytes = region_bytes - UNCOMPRESSED_BODY_PAD
    else:
        plain_bytes = min(
            region_bytes * MAX_COMPRESSION_RATIO[header.compression],
            DEFAULT_MAX_UNCOMPRESSED_BYTES,
        )
    needed = min_plain_body_bytes(header.record_count, header.attributes)
    if needed > plain_bytes:
        raise InvalidRecordError(
            f"batch at position {position} claims {header.record_count} records, but "
            f"{header.record_count} records take at least {needed} bytes of plain body "
            f"and its {header.size_bytes} bytes can hold at most {plain_bytes}"
        )


@dataclass(frozen=True, slots=True)
class AppendInfo:
    """Offsets of an append (inclusive). Unpacks as DESIGN.md's contract says, into the
    first and last offsets assigned (``first, last = log.append(batch)``); it used to be a
    tuple of all four fields, which that unpacking refused (found by an audit).

    ``duplicate`` is True when the request repeated idempotent batches already in the log
    (a producer retry): nothing was written and the offsets are the original ones, or
    ``first_offset`` is -1 when they are forgotten (a batch older than the five a
    producer's state remembers) and ``last_offset`` is an offset at or above the batch's
    last one, below which it is known to lie.
    """

    first_offset: int
    last_offset: int
    duplicate: bool = False
    # The time the batches were stamped with (message.timestamp.type LogAppendTime); -1
    # for CreateTime, as Kafka answers.
    log_append_time_ms: int = -1

    def __iter__(self) -> Iterator[int]:
        return iter((self.first_offset, self.last_offset))


def _fitting(base_offset: int, spans: list[BatchSpan], begin: int) -> int:
    """End of the longest run of ``spans`` from ``begin`` whose offsets fit a segment
    based at ``base_offset`` (relative offsets are u32 in the index files)."""
    end = begin
    while end < len(spans) and spans[end].last_offset - base_offset <= formats.MAX_RELATIVE_OFFSET:
        end += 1
    return end


class Log:
    """See the module docstring. Create with ``Log.open``."""

    def __init__(
        self, directory: Path, config: LogConfig, clock: Clock, rng: random.Random
    ) -> None:
        self.dir = directory
        self.config = config
        self._clock = clock
        self._rng = rng
        self._segments = LogSegments()
        self._log_end_offset = 0
        self._recovery_point = 0
        self._first_unflushed_ms: int | None = None
        self._dir_dirty = False  # a segment file was created since the last directory fsync
        # The segment rolled away from, whose newest bytes stay in the page cache until the
        # new active segment holds a window of its own (``page_cache``).
        self._cooling: LogSegment | None = None
        self._pending_deletes: list[tuple[int, list[Path]]] = []  # (due_ms, files)
        self._epochs = LeaderEpochCache(directory / formats.LEADER_EPOCH_CHECKPOINT)
        self._producer_state: ProducerStateManager | None = None  # made by _load
        self.truncated_on_recovery_bytes = 0
        self.last_flush_ms = clock.now_ms()
        self.on_disk_failure: DiskFailureHandler | None = None
        # Called when a truncation lowered the recovery point, before anything can be
        # appended above it: whoever checkpoints recovery points must write the lower
        # one now (Kafka's truncateTo does), or after a power loss the new data between
        # it and the stale checkpointed one would be trusted without being verified.
        self.on_recovery_point_lowered: Callable[[], None] | None = None

    # --- opening and recovery -----------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | Path,
        config: LogConfig | None = None,
        *,
        recovery_point: int = 0,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> Log:
        """Open (creating if needed) the log in ``path``, recovering from a crash.

        ``recovery_point`` is the offset below which data is known to be flushed (from the
        data directory's checkpoint); 0 re-verifies every segment.
        """
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        log = cls(directory, config or LogConfig(), clock or SYSTEM_CLOCK, rng or random.Random())
        log._load(recovery_point)
        return log

    def _new_segment(
        self, base_offset: int, *, active: bool, end_offset: int | None = None
    ) -> LogSegment:
        # Uniform below min(segment.jitter.ms, segment.ms), Kafka's randomSegmentJitter.
        # Drawn up to segment.jitter.ms and then capped at segment.ms - 1, a jitter larger
        # than segment.ms gave most segments a roll age of 1 ms: they rolled at their
        # second append (found by an audit).
        bound = min(self.config.segment_jitter_ms, self.config.segment_ms)
        jitter = self._rng.randrange(bound) if bound > 0 else 0
        return LogSegment(
            self.dir,
            base_offset,
            self.config,
            # The fallback age for segment.ms only: a segment with data counts its age
            # from its first batch's timestamp, which survives restarts.
            created_ms=self._clock.now_ms(),
            roll_jitter_ms=jitter,
            active=active,
            end_offset=end_offset,
        )

    def _load(self, recovery_point: int) -> None:
        bases = self._clean_directory()
        for i, base in enumerate(bases):
            following = bases[i + 1] if i + 1 < len(bases) else None
            self._segments.append(
                self._new_segment(base, active=following is None, end_offset=following)
            )
        if not self._segments:
            self._segments.append(self._new_segment(0, active=True))
        # Segments an earlier run created may never have had their directory entries
        # fsynced (it was killed before a flush): the first flush here does it, before
        # the recovery point it checkpoints can speak for them.
        self._dir_dirty = True
        self._recover_segments(recovery_point)
        for segment in list(self._segments)[:-1]:
            if segment.offset_index.writable:  # rebuilt: trim like a rolled segment
                segment.on_become_inactive()
        active = self._segments.last
        try:
            active.make_active()
        except StorageError:
            self.truncated_on_recovery_bytes += active.recover()
            active.make_active()
        self._log_end_offset = active.next_offset
        self._recovery_point = min(recovery_point, self._log_end_offset)
        self._recovery_point = max(self._recovery_point, self.log_start_offset)
        self._load_leader_epochs()
        self._load_producer_state()

    def _headers_from(self, offset: int) -> Iterator[BatchHeader]:
        """Verified headers of the batches from the one holding ``offset`` to the log end."""
        for i in range(self._segments.floor_index(offset), len(self._segments)):
            for _, header in self._segments[i].headers_from(offset):
                yield header

    def _last_batch_header(self) -> BatchHeader | None:
        if self._log_end_offset <= self.log_start_offset:
            return None
        last = self._log_end_offset - 1
        segment = self._segments[self._segments.floor_index(last)]
        found = segment.translate_offset(last)
        return None if found is None else found[1]

    def _load_leader_epochs(self) -> None:
        """Load ``leader-epoch-checkpoint`` and fit it to the recovered log, or rebuild it.

        The file is trimmed to ``[log_start_offset, log_end_offset]`` (it may name epochs
        for offsets the crash lost, since it is written before the data). It is rebuilt
        from the batch headers when it is missing, unreadable, empty for a non-empty log,
        or disagrees with the epoch of the last batch.
        """
        path = self.dir / formats.LEADER_EPOCH_CHECKPOINT
        try:
            cache: LeaderEpochCache | None = LeaderEpochCache.load(path)
        except CheckpointCorruptError:
            cache = None
        if cache is not None:
            changed = cache.truncate_from_end(self._log_end_offset, write=False)
            changed |= cache.truncate_from_start(self.log_start_offset, write=False)
            if not self._epochs_match_log(cache):
                cache = None
            elif changed:
                cache.write()
        if cache is None:
            cache = LeaderEpochCache(path)
            try:
                for header in self._headers_from(self.log_start_offset):
                    if header.partition_leader_epoch >= 0:
                        cache.assign(header.partition_leader_epoch, header.base_offset, write=False)
            except StorageError:
                pass  # damage below the recovery point: what precedes it is still right
            cache.write()
        self._epochs = cache

    def _epochs_match_log(self, cache: LeaderEpochCache) -> bool:
        """A cheap consistency check: the last batch's epoch is the cache's latest."""
        try:
            last = self._last_batch_header()
        except StorageError:
            return True  # unreadable tail below the recovery point: nothing to compare
        if last is None or last.partition_leader_epoch < 0:
            return True
        return cache.latest_epoch == last.partition_leader_epoch

    def _load_producer_state(self) -> None:
        state = ProducerStateManager(self.dir)
        self._producer_state = state
        # Snapshots above the log end summarize data the crash lost; below the log start,
        # data retention removed (so the batches after them cannot be replayed).
        if state.delete_snapshots(below=self.log_start_offset, above=self._log_end_offset):
            fsync_dir(self.dir)
        self._rebuild_producer_state()

    def _rebuild_producer_state(self) -> None:
        """The state as of the log end: the newest usable snapshot plus a header replay."""
        state = self.producer_state
        state.load_snapshot(self.log_start_offset, self._log_end_offset)
        now_ms = self._clock.now_ms()
        try:
            for header in self._headers_from(state.end_offset):
                state.update(header, header.base_offset, now_ms)
        except StorageError:
            # Damage below the recovery point ends the replay. Producers after it are then
            # unknown or behind, which only makes their next batches fail validation
            # (out of order), never lets a duplicate through.
            pass
        state.end_offset = self._log_end_offset

    def _clean_directory(self) -> list[int]:
        """Delete leftovers of interrupted operations; return the segment base offsets."""
        bases: list[int] = []
        names = {p.name for p in self.dir.iterdir()}
        for name in sorted(names):
            path = self.dir / name
            if name.endswith((formats.TMP_SUFFIX, formats.DELETED_SUFFIX, formats.SWAP_SUFFIX)):
                # *.tmp: a checkpoint write that never got renamed; *.deleted: retention that
                # did not finish unlinking; *.swap: no operation here produces them, so one
                # found is debris from a foreign or older tool and holds nothing we need.
                path.unlink(missing_ok=True)
                continue
            stem, dot, suffix = name.partition(".")
            if not (stem.isdigit() and len(stem) == formats.SEGMENT_NAME_DIGITS and dot):
                continue
            if "." + suffix == formats.LOG_SUFFIX:
                bases.append(int(stem))
            elif "." + suffix in (formats.INDEX_SUFFIX, formats.TIME_INDEX_SUFFIX) and (
                formats.segment_file_name(int(stem), formats.LOG_SUFFIX) not in names
            ):
                path.unlink()  # an index without its log indexes nothing
        return sorted(bases)

    def _recover_segments(self, recovery_point: int) -> None:
        """Re-verify segments from the one holding the recovery point, and any whose
        index is missing or damaged; drop everything after the first damage."""
        start = self._segments.floor_index(recovery_point)
        for i, segment in enumerate(list(self._segments)):
            if i < start and not segment.needs_rebuild:
                if segment.indexes_incomplete:
                    # Well-formed but missing entries (e.g. a truncated .timeindex): the
                    # batch headers rebuild them; the data below the recovery point is
                    # trusted, so it is not re-verified.
                    segment.rebuild_indexes()
                continue
            truncated = segment.recover()
            self.truncated_on_recovery_bytes += truncated
            following = i + 1 < len(self._segments)
            if following and (
                truncated or self._segments[i + 1].base_offset != segment.next_offset
            ):
                # Later segments would leave a gap in the offsets: they cannot be trusted.
                for later in self._segments.pop_from(i + 1):
                    self.truncated_on_recovery_bytes += later.size_bytes
                    later.close()
                    for path in later.files():
                        path.unlink(missing_ok=True)
                break

    # --- state ----------------------------------------------------------------------------

    @property
    def log_start_offset(self) -> int:
        return self._segments.first.base_offset

    @property
    def log_end_offset(self) -> int:
        return self._log_end_offset

    @property
    def recovery_point(self) -> int:
        return self._recovery_point

    @property
    def size_bytes(self) -> int:
        return sum(segment.size_bytes for segment in self._segments)

    @property
    def segment_count(self) -> int:
        return len(self._segments)

    @property
    def segment_base_offsets(self) -> list[int]:
        return self._segments.base_offsets

    def update_config(self, config: LogConfig) -> None:
        """Apply new settings; index sizes take effect from the next segment."""
        self.config = config
        for segment in self._segments:
            segment.config = config

    # --- appending --------------------------------------------------------------------------

    def _validate(
        self, view: memoryview, *, as_leader: bool
    ) -> tuple[list[BatchSpan], list[BatchHeader], str]:
        """Check every batch in a request; O(1) Python work per batch, checksums in C.
        ``as_leader``: also refuse CreateTime batches whose timestamps lie outside
        message.timestamp.before/after.max.ms of this clock, and say (the third value,
        else "") why a batch is over max.message.bytes: ``append`` refuses that only
        after its duplicate check, so a retry of a batch written before the limit was
        lowered is answered with its offsets; refused as too large, the producer split
        it into new batches and wrote its records twice (found by an audit). A follower
        copies what its leader took, whatever the limits are now, as Kafka's followers
        do: changing a limit must not stop replication for good."""
        if not len(view):
            raise InvalidRequestError("no record batches in the request")
        spans: list[BatchSpan] = []
        headers: list[BatchHeader] = []
        check_time = as_leader and self.config.message_timestamp_type == CREATE_TIME
        now_ms = self._clock.now_ms() if check_time else 0
        too_large = ""
        position = 0
        while position < len(view):
            if len(view) - position < formats.LOG_OVERHEAD:
                raise CorruptBatchError(
                    f"{len(view) - position} trailing bytes at position {position} are not a batch"
                )
            size = formats.LOG_OVERHEAD + formats.I32.unpack_from(view, position + 8)[0]
            if as_leader and size > self.config.max_message_bytes:
                message = (
                    f"batch at position {position} is {size} bytes; max.message.bytes "
                    f"is {self.config.max_message_bytes}"
                )
                if position + size > len(view):
                    # Not even all there (a length of 2^31): no retry of a written batch.
                    raise MessageTooLargeError(message)
                too_large = too_large or message
            header = check_batch(view, position)
            check_record_count(header, position)
            if check_time:
                self._check_timestamps(header, position, now_ms)
            headers.append(header)
            spans.append(
                BatchSpan(
                    position,
                    size,
                    header.base_offset,
                    header.last_offset,
                    header.max_timestamp,
                )
            )
            position += size
        return spans, headers, too_large

    def _stamped_time_ms(self, offset: int) -> int:
        """The LogAppendTime a retried request's original was stamped with (one time for
        the whole request), so the retry reports what the log holds, as Kafka answers a
        duplicate; -1 for CreateTime topics or offsets no longer known."""
        if self.config.message_timestamp_type != LOG_APPEND_TIME or offset < self.log_start_offset:
            return -1
        return parse_header(self.read(offset, 1)).max_timestamp

    def _check_timestamps(self, header: BatchHeader, position: int, now_ms: int) -> None:
        """The batch's first and largest timestamps against the window around ``now_ms``
        (the header's: records are opaque here). -1 is "no timestamp", as in Kafka."""
        earliest_ms = now_ms - self.config.message_timestamp_before_max_ms
        latest_ms = now_ms + self.config.message_timestamp_after_max_ms
        for timestamp_ms in (header.base_timestamp, header.max_timestamp):
            if timestamp_ms == formats.NO_TIMESTAMP:
                continue
            if timestamp_ms > latest_ms:
                raise InvalidTimestampError(
                    f"batch at position {position} has timestamp {timestamp_ms}, "
                    f"{timestamp_ms - now_ms} ms ahead of the broker's clock; "
                    "message.timestamp.after.max.ms is "
                    f"{self.config.message_timestamp_after_max_ms}"
                )
            if timestamp_ms < earliest_ms:
                raise InvalidTimestampError(
                    f"batch at position {position} has timestamp {timestamp_ms}, "
                    f"{now_ms - timestamp_ms} ms behind the broker's clock; "
                    "message.timestamp.before.max.ms is "
                    f"{self.config.message_timestamp_before_max_ms}"
                )

    @_reports_disk_failure
    def append(
        self,
        batch: bytes | bytearray | memoryview,
        leader_epoch: int = 0,
        *,
        assign_offsets: bool = True,
    ) -> AppendInfo:
        """Validate and append one or more concatenated batches.

        As leader (``assign_offsets``), offsets continue from the log end and each batch
        is stamped with ``leader_epoch``; idempotent batches are checked against the
        producer state first (InvalidProducerEpochError, OutOfOrderSequenceError,
        DuplicateSequenceError, InvalidRecordError), and a request that only repeats
        batches already written returns their original offsets with ``duplicate=True``.
        As follower, the batches keep the leader's offsets and epochs, must start exactly
        at the log end, and update the producer state without validation. Nothing is
        written unless every batch is valid.

        Leader epochs: each batch's epoch (``leader_epoch``, or the header's as follower)
        is assigned in the epoch cache at the batch's base offset; a new epoch is
        checkpointed before the data is written.
        """
        view = memoryview(batch).cast("B")
        spans, headers, too_large = self._validate(view, as_leader=assign_offsets)
        data: list[bytes | bytearray | memoryview] = [view]
        state = self.producer_state
        append_time_ms = -1
        if assign_offsets:
            duplicate = state.validate_append(headers)
            if duplicate is not None:
                return AppendInfo(
                    duplicate[0],
                    duplicate[1],
                    duplicate=True,
                    log_append_time_ms=self._stamped_time_ms(duplicate[0]),
                )
            if too_large:
                raise MessageTooLargeError(too_large)
            # Only a batch's broker-owned prefix changes (base offset, leader epoch and the
            # checksum over them): each prefix is rewritten in a copy of its 25 bytes and
            # the rest goes to the file straight from the request, rather than copying the
            # whole request to stamp it (one memcpy of every produced byte on the leader).
            # A LogAppendTime topic's prefix runs to max_timestamp (47 bytes), and its crc
            # is computed again over the whole batch.
            data = []
            next_offset = self._log_end_offset
            stamped_end = formats.BODY_CRC_START
            if self.config.message_timestamp_type == LOG_APPEND_TIME:
                append_time_ms = self._clock.now_ms()
                stamped_end = LOG_APPEND_TIME_STAMPED_END  # attributes and max_timestamp too
            for i, span in enumerate(spans):
                rest_start = span.position + stamped_end
                end = span.position + span.size_bytes
                prefix = bytearray(view[span.position : rest_start])
                max_timestamp_ms = span.max_timestamp_ms
                if append_time_ms >= 0:
                    stamp_log_append_time(prefix, view[rest_start:end], append_time_ms)
                    max_timestamp_ms = append_time_ms  # what the time index holds
                stamp(prefix, 0, next_offset, leader_epoch)
                data += (prefix, view[rest_start:end])
                count = span.last_offset - span.base_offset + 1
                spans[i] = span._replace(
                    base_offset=next_offset,
                    last_offset=next_offset + count - 1,
                    max_timestamp_ms=max_timestamp_ms,
                )
                next_offset += count
        else:
            expected = self._log_end_offset
            for span in spans:
                if span.base_offset != expected:
                    raise InvalidRequestError(
                        f"replicated batch starts at offset {span.base_offset}; "
                        f"the log ends at {expected}"
                    )
                expected = span.last_offset + 1
        first, last = spans[0].base_offset, spans[-1].last_offset

        def run_data(begin: int, end: int) -> list[bytes | bytearray | memoryview]:
            """The buffers of ``spans[begin:end]``: two per batch as leader, else one."""
            if begin == 0 and end == len(spans):
                return data
            if assign_offsets:
                return data[2 * begin : 2 * end]
            return [
                view[spans[begin].position : spans[end - 1].position + spans[end - 1].size_bytes]
            ]

        saved_epochs = self._assign_epochs(spans, headers, leader_epoch if assign_offsets else None)
        now_ms = self._clock.now_ms()
        try:
            self._write(spans, headers, run_data, now_ms)
        except BaseException:
            if saved_epochs is not None:  # the new epoch never got its data
                if self._log_end_offset == first:
                    self._epochs = LeaderEpochCache(self._epochs.path, saved_epochs.entries)
                    self._epochs.write()
                else:  # a segment's worth was written before the failure: keep its epochs
                    self._epochs.truncate_from_end(self._log_end_offset)
            raise
        assert self._log_end_offset == last + 1
        if self._first_unflushed_ms is None:
            self._first_unflushed_ms = now_ms
        if (
            self.config.flush_messages is not None
            and self._log_end_offset - self._recovery_point >= self.config.flush_messages
        ):
            self.flush()
        return AppendInfo(first, last, log_append_time_ms=append_time_ms)

    def _write(
        self,
        spans: list[BatchSpan],
        headers: list[BatchHeader],
        run_data: Callable[[int, int], list[bytes | bytearray | memoryview]],
        now_ms: int,
    ) -> None:
        """Write validated, offset-assigned batches, rolling as needed, and advance the log
        end and the producer state after each segment's share.

        Usually one share: the whole request goes to the active segment, or to a new one
        when the active one is due to roll. But offsets must stay within 2^32 of a
        segment's base offset, and one request (a follower's fetch above all) may span
        more: its batches are then split across segments, each started by a roll at the
        log end (a batch alone always fits a fresh segment: it holds fewer than 2^31
        records). The producer state is brought up to each roll first, since the roll
        snapshots it.
        """
        state = self.producer_state
        begin = 0
        while begin < len(spans):
            segment = self._segments.last
            end = _fitting(segment.base_offset, spans, begin)
            if end == begin or segment.should_roll(
                spans[end - 1].position + spans[end - 1].size_bytes - spans[begin].position,
                spans[end - 1].last_offset,
                max(span.max_timestamp_ms for span in spans[begin:end]),
                now_ms,
            ):
                segment = self.roll()
                end = _fitting(segment.base_offset, spans, begin)
            share = spans[begin:end]
            if begin:
                origin = share[0].position
                share = [span._replace(position=span.position - origin) for span in share]
            segment.append(run_data(begin, end), share)
            self._release_cooling(segment)
            self._log_end_offset = share[-1].last_offset + 1
            for span, header in zip(spans[begin:end], headers[begin:end], strict=True):
                if header.producer_id >= 0:
                    state.update(header, span.base_offset, now_ms)
            state.end_offset = self._log_end_offset
            begin = end

    def _assign_epochs(
        self, spans: list[BatchSpan], headers: list[BatchHeader], leader_epoch: int | None
    ) -> LeaderEpochCache | None:
        """Assign the request's epochs (O(1) per batch: a compare with the latest) and
        checkpoint them if they changed; returns the cache as it was then, else None."""
        cache = self._epochs
        latest = cache.latest_epoch
        before: LeaderEpochCache | None = None
        for span, header in zip(spans, headers, strict=True):
            epoch = header.partition_leader_epoch if leader_epoch is None else leader_epoch
            if epoch < 0 or epoch == latest:
                continue
            if before is None:
                before = LeaderEpochCache(None, cache.entries)
            cache.assign(epoch, span.base_offset, write=False)
            latest = epoch
        if before is not None:
            cache.write()
        return before

    @_reports_disk_failure
    def roll(self) -> LogSegment:
        """Start a new active segment at the log end (a no-op while the active one is empty).

        Snapshots the producer state at the new segment's base offset, as Kafka does, so a
        restart replays at most the active segment's headers.
        """
        active = self._segments.last
        if active.size_bytes == 0:
            return active
        active.on_become_inactive()
        if self._cooling is not None and self.config.page_cache_window_bytes > 0:
            self._cooling.release_cache()  # rolled again before the window filled
        self._cooling = active
        log_path = self.dir / formats.segment_file_name(self._log_end_offset, formats.LOG_SUFFIX)
        if log_path.exists() and log_path.stat().st_size:
            raise StorageError(f"cannot roll: {log_path.name} already exists with data")
        segment = self._new_segment(self._log_end_offset, active=True)
        self._segments.append(segment)
        self._dir_dirty = True
        self._take_producer_snapshot()
        return segment

    def _release_cooling(self, active: LogSegment) -> None:
        cooling = self._cooling
        window = self.config.page_cache_window_bytes
        if cooling is not None and (window <= 0 or active.size_bytes >= window):
            self._cooling = None
            if window > 0:
                cooling.release_cache()  # a no-op if retention closed it meanwhile

    def _take_producer_snapshot(self) -> None:
        """Snapshot the state, keeping one snapshot per segment base (and the newest), as
        Kafka does, until retention deletes the segment. A truncation into any segment
        then rebuilds from a snapshot at or below it, which still holds producers whose
        batches retention removed: rebuilt from the log start instead, a replica forgot
        them while its leader knew them, and after a failover to it a producer's retry
        of a batch already written was written again."""
        state = self.producer_state
        state.take_snapshot()
        state.retain_snapshots(self._segments.base_offsets)

    # --- reading ----------------------------------------------------------------------------

    @_reports_disk_failure
    def read(self, offset: int, max_bytes: int, max_offset: int | None = None) -> bytes:
        """Whole batches starting with the one that holds ``offset``.

        Returns at most ``max_bytes`` (but always the first batch, however large), only
        batches ending before ``max_offset`` (the high watermark for consumers), and only
        from one segment; ``b""`` at the log end. Batches are returned byte for byte as
        stored, so the first may begin before ``offset``.
        """
        if max_bytes < 0:
            raise InvalidFetchSizeError(f"max_bytes must be >= 0, got {max_bytes}")
        if not self.log_start_offset <= offset <= self._log_end_offset:
            raise OffsetOutOfRangeError(
                f"offset {offset} is outside the log's range "
                f"[{self.log_start_offset}, {self._log_end_offset}]"
            )
        if offset == self._log_end_offset or (max_offset is not None and offset >= max_offset):
            return b""
        for i in range(self._segments.floor_index(offset), len(self._segments)):
            data = self._segments[i].read(offset, max_bytes, max_offset)
            if data is not None:
                return data
        return b""

    def lookup(self, offset: int) -> tuple[int, int, int]:
        """Where the batch holding ``offset`` is: ``(segment base offset, position, batch
        base offset)``. The offset lookup of seed 000: bisect the segments, binary-search
        the sparse index, scan a few headers. OffsetOutOfRangeError outside
        ``[log_start_offset, log_end_offset)``.
        """
        if not self.log_start_offset <= offset < self._log_end_offset:
            raise OffsetOutOfRangeError(
                f"offset {offset} is outside the log's range "
                f"[{self.log_start_offset}, {self._log_end_offset})"
            )
        for i in range(self._segments.floor_index(offset), len(self._segments)):
            segment = self._segments[i]
            found = segment.translate_offset(offset)
            if found is not None:
                return segment.base_offset, found[0], found[1].base_offset
        raise StorageError(f"offset {offset} is below the log end but in no segment")

    def offset_for_timestamp(
        self, timestamp_ms: int, max_offset: int | None = None
    ) -> tuple[int, int] | None:
        """``(offset, timestamp)`` of the first record with timestamp >= ``timestamp_ms``.

        Found through the time index and batch headers; only the one batch that holds the
        answer is decoded (this is an admin lookup, not the data path). None when every
        record (below ``max_offset``) is older.
        """
        for segment in self._segments:
            if segment.known_max_timestamp_ms < timestamp_ms:
                continue
            found = segment.find_by_timestamp(timestamp_ms)
            if found is None:
                continue
            position, header = found
            if max_offset is not None and header.base_offset >= max_offset:
                return None
            try:
                records = decode_batches(
                    segment.read_batch(position, header),
                    max_uncompressed_bytes=TIMESTAMP_LOOKUP_MAX_UNCOMPRESSED_BYTES,
                )[0].records
            except CorruptBatchError:
                # Checksums hold (the broker verified them) but the body is malformed (a
                # producer bug), or inflates beyond what a lookup may (a hostile one):
                # the batch's own header still bounds the answer.
                return header.base_offset, header.max_timestamp
            for record in records:
                if record.timestamp_ms >= timestamp_ms:
                    if max_offset is not None and record.offset >= max_offset:
                        return None
                    return record.offset, record.timestamp_ms
        return None

    def max_timestamp(self) -> tuple[int, int] | None:
        """``(timestamp, offset)`` of the first record with the largest timestamp; None if
        empty. The record's own offset, not its batch's last one (KIP-734, as Kafka since
        KAFKA-16310): the segments say which timestamp is largest, and the one batch that
        holds it is decoded by ``offset_for_timestamp``."""
        stamps = [s.known_max_timestamp_ms for s in self._segments if s.size_bytes]
        if not stamps:
            return None
        largest = max(stamps)
        found = self.offset_for_timestamp(largest)
        return None if found is None else (largest, found[0])

    # --- durability ---------------------------------------------------------------------

    @_reports_disk_failure
    def flush(self) -> None:
        """fsync everything appended so far and move the recovery point to the log end."""
        if self._log_end_offset > self._recovery_point or self._dir_dirty:
            for i in range(self._segments.floor_index(self._recovery_point), len(self._segments)):
                self._segments[i].flush()
            self.producer_state.flush()
            if self._dir_dirty:
                fsync_dir(self.dir)
                self._dir_dirty = False
        self._recovery_point = self._log_end_offset
        self._first_unflushed_ms = None
        self.last_flush_ms = self._clock.now_ms()

    def maintenance_due(self) -> bool:
        """Whether ``flush_if_due`` or ``remove_deleted_files`` may have work now.

        Read without the caller's lock, so that a pass over thousands of idle logs need
        not lock each one: plain attributes, each replaced whole. An answer made stale
        by a concurrent append or roll only moves that work to the next pass.
        """
        if self._pending_deletes:
            return True
        if self._first_unflushed_ms is not None and self.config.flush_ms is not None:
            return True
        try:
            return self._recovery_point < self._segments.last.base_offset
        except IndexError:  # a truncation is replacing every segment right now
            return True

    @_reports_disk_failure
    def flush_if_due(self) -> bool:
        """Apply ``flush_ms``: flush when the oldest unflushed append is old enough.
        Otherwise flush the segments rolled since the last flush, up to the active one,
        as Kafka does after each roll: without it the recovery point moved only at a
        clean shutdown, and a restart after a crash re-checked every segment written
        since (out of the ISR all that time), not just the active one."""
        if (
            self.config.flush_ms is not None
            and self._first_unflushed_ms is not None
            and self._clock.now_ms() - self._first_unflushed_ms >= self.config.flush_ms
        ):
            self.flush()
            return True
        active_base = self._segments.last.base_offset
        if self._recovery_point >= active_base:
            return False
        for i in range(self._segments.floor_index(self._recovery_point), len(self._segments) - 1):
            self._segments[i].flush()
        self.producer_state.flush()
        if self._dir_dirty:
            fsync_dir(self.dir)
            self._dir_dirty = False
        self._recovery_point = active_base
        return True

    # --- truncation (replication) ---------------------------------------------------------

    @_reports_disk_failure
    def truncate_to(self, offset: int) -> None:
        """Remove every batch at or after ``offset`` (a follower diverged from its leader).

        Truncation is by whole batches: if ``offset`` falls inside a batch, that batch
        goes too and the log end becomes its base offset. The leader epoch cache loses
        the entries from the new log end on (even when no data goes: see below); the
        producer state is rebuilt as of it (from the newest snapshot at or below it plus a
        header replay), and snapshots above it are deleted and the directory fsynced
        before anything new can be appended.
        """
        if offset < 0:
            raise InvalidRequestError(f"cannot truncate to negative offset {offset}")
        if offset >= self._log_end_offset:
            # No data goes, but an epoch this replica assigned at its log end when it
            # became leader, without appending anything in it, conflicts with the new
            # leader's history; left in place, OffsetForLeaderEpoch would keep asking
            # about it (Kafka's truncateTo does the same).
            self._epochs.truncate_from_end(self._log_end_offset)
            return
        if offset < self.log_start_offset:
            self.truncate_fully_and_start_at(offset)
            return
        if self._recovery_point > offset:
            # Lowered, and checkpointed, before any file changes: a power loss part-way
            # (the removed segments back, the one holding ``offset`` already shrunk)
            # then recovers from here rather than trusting the shrunk segment below the
            # returned ones, whose offsets in between would be a hole.
            self._recovery_point = offset
            if self.on_recovery_point_lowered is not None:
                self.on_recovery_point_lowered()
        removed_files = False
        self._cooling = None  # it may be the active segment again below
        while len(self._segments) > 1 and self._segments.last.base_offset >= offset:
            self._delete_now(self._segments.pop_from(len(self._segments) - 1))
            removed_files = True
        active = self._segments.last
        active.truncate_to(offset, now_ms=self._clock.now_ms())
        # Made durable now: a later segment may be rolled at the new end, and flush()
        # fsyncs only from the recovery point's segment on, so a power loss could bring
        # this tail back under the new segment's offsets, served as if committed.
        active.flush()
        active.make_active()
        self._log_end_offset = active.next_offset
        lowered = self._recovery_point > self._log_end_offset
        self._recovery_point = min(self._recovery_point, self._log_end_offset)
        self._epochs.truncate_from_end(self._log_end_offset)
        state = self.producer_state
        removed_files |= state.delete_snapshots(above=self._log_end_offset)
        if removed_files:
            fsync_dir(self.dir)
        if state.end_offset != self._log_end_offset:
            self._rebuild_producer_state()
        if lowered and self.on_recovery_point_lowered is not None:
            self.on_recovery_point_lowered()

    @_reports_disk_failure
    def truncate_fully_and_start_at(self, offset: int) -> None:
        """Drop every segment and restart the log empty at ``offset``.

        The leader epoch cache and the producer state (with its snapshots) are cleared.
        """
        if self._recovery_point > offset:
            # Lowered, and checkpointed, before any file changes, as ``truncate_to``
            # does: left at its old value on disk, a power loss within a checkpoint
            # interval trusted the never-fsynced segments replicated below it, and the
            # log had a hole below its end (found by an audit).
            self._recovery_point = offset
            if self.on_recovery_point_lowered is not None:
                self.on_recovery_point_lowered()
        self._delete_now(self._segments.pop_from(0))
        self._cooling = None
        self._segments.append(self._new_segment(offset, active=True))
        self._dir_dirty = True
        self._log_end_offset = offset
        self._epochs.clear()
        state = self.producer_state
        state.delete_all_snapshots()
        state.clear(offset)
        fsync_dir(self.dir)
        # Only now (a checkpoint may be written from another thread at any time): with
        # the deletions not yet durable, a power loss could bring old segments back
        # below a recovery point that vouches for them.
        self._recovery_point = offset

    @staticmethod
    def _delete_now(segments: list[LogSegment]) -> None:
        for segment in segments:
            segment.close()
            for path in segment.files():
                path.unlink(missing_ok=True)

    # --- retention ----------------------------------------------------------------------

    @_reports_disk_failure
    def delete_retention_segments(self, *, high_watermark: int) -> int:
        """Retire whole oldest segments past retention.ms or retention.bytes.

        Only segments wholly below ``high_watermark`` may go (as in Kafka): a record above
        it may not be on any other replica yet, and retiring it would let the HW later
        pass offsets no replica holds -- acknowledged acks=all records lost. It also keeps
        ``log_start_offset <= high_watermark``. The active segment goes too once all its
        records qualify (Kafka's rule: an idle partition's records expire like any
        other's; kept, they stayed readable forever): a new empty segment at the log end
        takes over first, so the log end offset stays and the log start moves to it.
        Retired files are renamed ``*.deleted`` and unlinked by ``remove_deleted_files``
        after ``file_delete_delay_ms``. Returns the number of segments retired.
        """
        now_ms = self._clock.now_ms()
        retired = 0
        if self.config.retention_ms >= 0:
            while self._first_below(high_watermark):
                largest = self._segments.first.retention_timestamp_ms
                if now_ms - largest <= self.config.retention_ms:
                    break
                self._retire_first(now_ms)
                retired += 1
        if self.config.retention_bytes >= 0:
            excess = self.size_bytes - self.config.retention_bytes
            while self._first_below(high_watermark) and excess >= self._segments.first.size_bytes:
                excess -= self._segments.first.size_bytes
                self._retire_first(now_ms)
                retired += 1
        if retired:
            # The renames are durable before the recovery point is raised to the new log
            # start (a checkpoint may be written from another thread at any time): a
            # retired segment that a power loss brought back would otherwise lie below it
            # and be trusted without being verified.
            fsync_dir(self.dir)
            self._recovery_point = max(self._recovery_point, self.log_start_offset)
            # The epochs of removed offsets go; the producer state stays (as in Kafka since
            # KIP-360, a producer is forgotten only by expiry), but snapshots below the new
            # log start can no longer be replayed from.
            self._epochs.truncate_from_start(self.log_start_offset)
            self.producer_state.delete_snapshots(below=self.log_start_offset)
        return retired

    def _first_below(self, high_watermark: int) -> bool:
        """Whether the oldest segment holds records and ends at or below the HW: where
        the next segment begins or, for the active segment, at the log end."""
        if len(self._segments) > 1:
            return self._segments[1].base_offset <= high_watermark
        return self._segments.first.size_bytes > 0 and self._log_end_offset <= high_watermark

    def _retire_first(self, now_ms: int) -> None:
        if len(self._segments) == 1:
            self.roll()  # the active segment goes: an empty one at the log end takes over
        segment = self._segments.pop_first()
        self._pending_deletes.append(
            (now_ms + self.config.file_delete_delay_ms, segment.rename_to_deleted())
        )

    @_reports_disk_failure
    def remove_deleted_files(self) -> int:
        """Unlink retired segment files whose delay has passed; returns files removed."""
        now_ms = self._clock.now_ms()
        removed = 0
        keep = []
        for due_ms, paths in self._pending_deletes:
            if due_ms > now_ms:
                keep.append((due_ms, paths))
                continue
            for path in paths:
                path.unlink(missing_ok=True)
                removed += 1
        self._pending_deletes = keep
        return removed

    # --- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Release files and mappings (trimming the active indexes). Does not flush.

        Snapshots the producer state at the log end first (unless one is there), so a
        clean restart replays no headers.
        """
        try:
            state = self._producer_state
            if (
                state is not None
                and self._log_end_offset > self.log_start_offset
                and self._log_end_offset not in state.snapshot_offsets
            ):
                self._take_producer_snapshot()
        except OSError:
            pass  # (disk full, directory gone) the next open replays more headers instead
        finally:
            self._close_segments()

    def _close_segments(self) -> None:
        for segment in self._segments:
            segment.close()

    def delete(self) -> None:
        """Close and remove the whole partition directory."""
        self._close_segments()
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- leader epochs (replication) -------------------------------------------------------

    @property
    def leader_epoch_cache(self) -> LeaderEpochCache:
        """The epoch cache (read it; change it only through this Log)."""
        return self._epochs

    @property
    def latest_epoch(self) -> int:
        """The newest leader epoch in the log's cache; -1 when none is known."""
        return self._epochs.latest_epoch

    def epoch_for_offset(self, offset: int) -> int:
        """The leader epoch that wrote ``offset`` (-1 below the first known epoch)."""
        return self._epochs.epoch_for_offset(offset)

    def end_offset_for_epoch(self, epoch: int) -> tuple[int, int]:
        """OffsetForLeaderEpoch: ``(largest epoch <= epoch, where it ends)``.

        See ``LeaderEpochCache.end_offset_for``: the log end for the latest epoch,
        ``(-1, -1)`` for an unknown newer epoch or an empty cache.
        """
        return self._epochs.end_offset_for(epoch, self._log_end_offset)

    @_reports_disk_failure
    def assign_epoch_start_offset(self, epoch: int, start_offset: int | None = None) -> None:
        """Record that leader ``epoch`` starts at ``start_offset`` (default: the log end).

        A replica that becomes leader calls this with its new epoch before taking appends
        (Kafka's ``maybeAssignEpochStartOffset``), so OffsetForLeaderEpoch for the previous
        epoch answers with the log end at the moment of the change even before the first
        append of the new epoch. A no-op if ``epoch`` is already the latest or negative.
        """
        offset = self._log_end_offset if start_offset is None else start_offset
        if not self.log_start_offset <= offset <= self._log_end_offset:
            raise InvalidRequestError(
                f"epoch start offset {offset} is outside the log's range "
                f"[{self.log_start_offset}, {self._log_end_offset}]"
            )
        if epoch >= 0 and epoch != self._epochs.latest_epoch:
            self._epochs.assign(epoch, offset)

    # --- idempotent producers ---------------------------------------------------------------

    @property
    def producer_state(self) -> ProducerStateManager:
        """The producer id -> last batches map (read it; change it only through this Log)."""
        assert self._producer_state is not None, "the log is not loaded"
        return self._producer_state

    def remove_expired_producers(
        self, expiration_ms: int = DEFAULT_PRODUCER_ID_EXPIRATION_MS
    ) -> int:
        """Forget producers idle for ``expiration_ms`` (producer.id.expiration.ms);
        returns how many. Periodic maintenance, like retention."""
        return self.producer_state.remove_expired(self._clock.now_ms(), expiration_ms)
