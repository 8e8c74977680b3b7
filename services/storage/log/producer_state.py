"""Idempotent-producer state of one partition (Kafka's ``ProducerStateManager``).

An idempotent producer stamps each batch with its producer id, producer epoch and the
sequence number of the batch's first record (``base_sequence``; the batch covers
``record_count`` consecutive sequences, wrapping from 2^31 - 1 to 0). Per producer id the
leader remembers the current epoch and the last ``PRODUCER_BATCHES_RETAINED`` (5) batches:
their first and last sequences and the offsets they were written at. With that it

- answers a retried batch it already wrote with the original offsets and writes nothing
  (a duplicate: same epoch, same first and last sequence as a remembered batch);
- rejects a batch from an older producer epoch (``InvalidProducerEpochError``: a zombie
  producer instance was fenced by a newer one);
- rejects a gap or a reordering (``OutOfOrderSequenceError``: the next batch must start at
  last sequence + 1; a new epoch must start at 0). A producer id this partition does not
  know (never seen, or forgotten by expiry or truncation) starts at any sequence, as in
  Kafka since KIP-360;
- answers a batch of the current epoch whose sequences lie wholly before the remembered
  batches, and at or after the first sequence this partition saw of that epoch
  (``start_sequence``), as a duplicate at unknown offsets (first offset -1, last offset
  just below the oldest remembered batch, so acks=all waits until the HW covers it): it
  was written long ago and its offsets are forgotten. Below ``start_sequence`` it may
  never have been written (the producer started here past it), so it is out of order.
  A producer that resends a whole old request (Spark's exactly-once writer replaying a
  micro-batch, a retry after more than five newer batches) learns that its batch is
  already in the log;
- refuses a request that mixes such retried batches with new ones
  (``DuplicateSequenceError``): one offset range cannot answer it, and nothing is
  written, so the producer resends the batches one by one.

Everything comes from batch header fields, O(1) per batch; records are never decoded.
Followers apply the leader's batches without validation (the leader validated them), so a
follower that becomes leader already knows every producer's state and dedupes retries of
batches the old leader acknowledged.

The state is a function of the log, rebuilt from it like Kafka does: snapshots
``<offset>.snapshot`` (docs/FORMAT.md 3.3) hold the state as of an offset (written when a
segment rolls and when the log closes); opening a log loads the newest snapshot at or
below the recovered log end and replays the batch headers after it. Snapshots are a
cache: each carries a CRC32C and its own offset, so a torn or stale one is detected and
skipped (then deleted), and a snapshot above the log end (the data it summarized was lost
or truncated) is deleted unread.

Expiry (Kafka's ``producer.id.expiration.ms``): a producer not heard from for that long is
forgotten by ``remove_expired``. The time used is the broker's clock when the batch was
applied (on replay: when the log was opened), not the producer's record timestamps, so a
producer that writes old timestamps is not expired on its first batch.

Thread-safety: none; the owning ``Log`` is serialized by its caller.
"""

from __future__ import annotations

import bisect
import os
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, NamedTuple

from tidelog import formats
from tidelog.batch import BatchHeader, crc32c
from tidelog.errors import (
    DuplicateSequenceError,
    InvalidProducerEpochError,
    InvalidRecordError,
    OutOfOrderSequenceError,
)

from .checkpoint import write_bytes_atomically
from .errors import ProducerSnapshotCorruptError

DEFAULT_PRODUCER_ID_EXPIRATION_MS: Final = 24 * 60 * 60 * 1000
"""producer.id.expiration.ms (Kafka's default, 1 day). A broker-level setting in Kafka,
so it is an argument of ``remove_expired`` rather than a topic config."""

SEQUENCE_MODULUS: Final = formats.MAX_SEQUENCE + 1


def last_sequence(base_sequence: int, last_offset_delta: int) -> int:
    """The sequence of a batch's last record, wrapping after 2^31 - 1 like Kafka."""
    return (base_sequence + last_offset_delta) % SEQUENCE_MODULUS


def next_sequence(sequence: int) -> int:
    return (sequence + 1) % SEQUENCE_MODULUS


class BatchMetadata(NamedTuple):
    """One remembered batch of a producer (inclusive ranges)."""

    first_sequence: int
    last_sequence: int
    first_offset: int
    last_offset: int


@dataclass(slots=True)
class ProducerStateEntry:
    """What the partition knows about one producer id.

    Invariant: ``batches`` holds 1 to ``PRODUCER_BATCHES_RETAINED`` batches of
    ``producer_epoch``, oldest first, each continuing the previous one's sequence.
    ``start_sequence`` is the first sequence of the earliest batch of this epoch the
    partition applied: every sequence from it to ``last_sequence`` is in the log (or was,
    before retention). Below it nothing is known - a producer this partition did not know
    starts at any sequence (KIP-360), so batches before that one may never have been
    written.
    """

    producer_id: int
    producer_epoch: int
    last_update_ms: int
    start_sequence: int
    batches: deque[BatchMetadata] = field(
        default_factory=lambda: deque(maxlen=formats.PRODUCER_BATCHES_RETAINED)
    )

    @property
    def last_sequence(self) -> int:
        return self.batches[-1].last_sequence

    @property
    def last_offset(self) -> int:
        return self.batches[-1].last_offset

    def precedes_window(self, first_sequence: int, last_seq: int) -> bool:
        """Whether sequences ``first..last`` lie wholly before the oldest remembered batch,
        and at or after ``start_sequence``: written, at offsets now forgotten.

        Decided only away from the wrap at 2^31: the batch must precede the window both
        as plain numbers and modulo 2^31 by less than half the sequence space (else it
        may as well be ahead of the window, a gap ``validate_append`` reports as out of
        order).
        """
        if first_sequence < self.start_sequence:
            return False
        oldest = self.batches[0].first_sequence
        if not first_sequence <= last_seq < oldest <= self.batches[-1].last_sequence:
            return False
        return (oldest - last_seq) % SEQUENCE_MODULUS <= SEQUENCE_MODULUS // 2

    def find_duplicate(self, first_sequence: int, last_seq: int) -> BatchMetadata | None:
        for batch in self.batches:
            if batch.first_sequence == first_sequence and batch.last_sequence == last_seq:
                return batch
        return None


def snapshot_path(directory: Path, offset: int) -> Path:
    return directory / formats.segment_file_name(offset, formats.SNAPSHOT_SUFFIX)


def encode_snapshot(offset: int, producers: Iterable[ProducerStateEntry]) -> bytes:
    """The snapshot file for ``producers`` as of ``offset`` (entries sorted by id)."""
    entries = sorted(producers, key=lambda entry: entry.producer_id)
    parts = [b""]  # placeholder for the header, which needs the checksum of the rest
    for entry in entries:
        parts.append(
            formats.PRODUCER_SNAPSHOT_ENTRY.pack(
                entry.producer_id,
                entry.producer_epoch,
                entry.last_update_ms,
                entry.start_sequence,
                len(entry.batches),
            )
        )
        parts.extend(formats.PRODUCER_SNAPSHOT_BATCH.pack(*batch) for batch in entry.batches)
    body = b"".join(parts)
    covered = formats.I64.pack(offset) + formats.I32.pack(len(entries)) + body
    return (
        formats.PRODUCER_SNAPSHOT_HEADER.pack(
            formats.PRODUCER_SNAPSHOT_VERSION, crc32c(covered), offset, len(entries)
        )
        + body
    )


def decode_snapshot(data: bytes, expected_offset: int) -> dict[int, ProducerStateEntry]:
    """Parse and verify a snapshot; ProducerSnapshotCorruptError if anything is off."""
    header = formats.PRODUCER_SNAPSHOT_HEADER
    if len(data) < header.size:
        raise ProducerSnapshotCorruptError(f"{len(data)} bytes is shorter than the header")
    version, crc, offset, count = header.unpack_from(data)
    if version != formats.PRODUCER_SNAPSHOT_VERSION:
        raise ProducerSnapshotCorruptError(f"unknown snapshot version {version}")
    if crc32c(memoryview(data)[formats.PRODUCER_SNAPSHOT_CRC_START :]) != crc:
        raise ProducerSnapshotCorruptError("checksum mismatch")
    if offset != expected_offset:
        raise ProducerSnapshotCorruptError(f"holds offset {offset}, named {expected_offset}")
    producers: dict[int, ProducerStateEntry] = {}
    position = header.size
    entry_struct, batch_struct = formats.PRODUCER_SNAPSHOT_ENTRY, formats.PRODUCER_SNAPSHOT_BATCH
    try:
        for _ in range(count):
            producer_id, epoch, last_update_ms, start_sequence, batch_count = (
                entry_struct.unpack_from(data, position)
            )
            position += entry_struct.size
            if (
                producer_id < 0
                or epoch < 0
                or not 0 <= start_sequence <= formats.MAX_SEQUENCE
                or not 1 <= batch_count <= formats.PRODUCER_BATCHES_RETAINED
                or producer_id in producers
            ):
                raise ProducerSnapshotCorruptError(f"invalid entry for producer {producer_id}")
            entry = ProducerStateEntry(producer_id, epoch, last_update_ms, start_sequence)
            for _ in range(batch_count):
                batch = BatchMetadata(*batch_struct.unpack_from(data, position))
                position += batch_struct.size
                if not (
                    0 <= batch.first_sequence <= formats.MAX_SEQUENCE
                    and 0 <= batch.last_sequence <= formats.MAX_SEQUENCE
                    and 0 <= batch.first_offset <= batch.last_offset < offset
                ):
                    raise ProducerSnapshotCorruptError(f"invalid batch {batch}")
                entry.batches.append(batch)
            producers[producer_id] = entry
    except ProducerSnapshotCorruptError:
        raise
    except Exception as exc:  # struct.error: the count promised more than the file holds
        raise ProducerSnapshotCorruptError(f"truncated: {exc}") from None
    if position != len(data):
        raise ProducerSnapshotCorruptError(f"{len(data) - position} trailing bytes")
    return producers


class ProducerStateManager:
    """Producer id -> ``ProducerStateEntry`` for one partition, plus its snapshot files.

    ``end_offset`` is the log offset the in-memory state reflects: every batch below it
    has been applied. The owning ``Log`` keeps it equal to its log end offset.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._producers: dict[int, ProducerStateEntry] = {}
        self.end_offset = 0
        self._snapshots: list[int] = sorted(self._list_snapshot_files())
        self._unsynced: list[Path] = []  # snapshots renamed into place but not yet fsynced

    def _list_snapshot_files(self) -> list[int]:
        offsets = []
        for path in self.directory.iterdir():
            stem, dot, suffix = path.name.partition(".")
            if (
                dot + suffix == formats.SNAPSHOT_SUFFIX
                and stem.isdigit()
                and len(stem) == formats.SEGMENT_NAME_DIGITS
            ):
                offsets.append(int(stem))
        return offsets

    # --- queries -----------------------------------------------------------------------

    def entry(self, producer_id: int) -> ProducerStateEntry | None:
        return self._producers.get(producer_id)

    @property
    def producers(self) -> dict[int, ProducerStateEntry]:
        """A copy of the map (entries are live objects: do not modify them)."""
        return dict(self._producers)

    def __len__(self) -> int:
        return len(self._producers)

    @property
    def snapshot_offsets(self) -> list[int]:
        return list(self._snapshots)

    # --- the append path -----------------------------------------------------------------

    def validate_append(self, headers: Sequence[BatchHeader]) -> tuple[int, int] | None:
        """Check a leader append of ``headers`` (in request order) before anything is written.

        Returns None when every batch may be written, or ``(first_offset, last_offset)``
        of the original when the whole request repeats batches already written (a retry:
        the caller writes nothing and answers with those offsets; ``first_offset`` is -1
        when a batch's offsets are forgotten, and ``last_offset`` then bounds them). Raises
        InvalidProducerEpochError, OutOfOrderSequenceError, InvalidRecordError (an
        idempotent batch without epoch or sequence), or DuplicateSequenceError when a
        request mixes retried and new batches (a producer resends whole requests, so that
        is not a retry this broker can answer with one offset range). Batches of one
        producer later in the request are checked against those before them.
        """
        pending: dict[int, tuple[int, int]] = {}  # producer id -> (epoch, last sequence)
        duplicates: list[BatchMetadata] = []
        fresh = False
        for header in headers:
            producer_id = header.producer_id
            if producer_id < 0:
                fresh = True
                continue
            epoch, first = header.producer_epoch, header.base_sequence
            if epoch < 0 or first < 0:
                raise InvalidRecordError(
                    f"batch of producer {producer_id} has producer epoch {epoch} and base "
                    f"sequence {first}; an idempotent batch needs both >= 0"
                )
            last = last_sequence(first, header.last_offset_delta)
            entry = self._producers.get(producer_id)
            known = pending.get(producer_id)
            if known is None and entry is not None:
                if epoch == entry.producer_epoch:
                    duplicate = entry.find_duplicate(first, last)
                    if duplicate is not None:
                        duplicates.append(duplicate)
                        continue
                    if entry.precedes_window(first, last):
                        # Sequences are never reused within an epoch, so a batch wholly
                        # before the remembered ones, and not before the epoch's first
                        # batch here, was written earlier, below the oldest remembered.
                        # Its offsets are forgotten: answered as a duplicate at unknown
                        # offsets, committed once the HW passes that batch (Kafka's
                        # producer takes DUPLICATE_SEQUENCE_NUMBER as success at unknown
                        # offsets; answering it here lets acks=all wait for the HW
                        # first, which an error answer cannot).
                        oldest = entry.batches[0].first_offset
                        duplicates.append(BatchMetadata(first, last, -1, oldest - 1))
                        continue
                known = entry.producer_epoch, entry.last_sequence
            fresh = True
            if known is None:
                # Unknown here (never seen, expired, or its batches truncated or deleted):
                # any sequence starts it, as in Kafka since KIP-360. Requiring 0 failed a
                # producer's first send after a day's silence, or after a failover to a
                # replica that started over.
                pass
            elif epoch < known[0]:
                raise InvalidProducerEpochError(
                    f"producer {producer_id} epoch {epoch} is older than the current "
                    f"epoch {known[0]}"
                )
            elif epoch > known[0]:
                if first != 0:
                    raise OutOfOrderSequenceError(
                        f"producer {producer_id} started epoch {epoch} at sequence {first}; "
                        "a new epoch must start at sequence 0"
                    )
            elif first != next_sequence(known[1]):
                raise OutOfOrderSequenceError(
                    f"producer {producer_id} epoch {epoch} sent sequence {first}; "
                    f"expected sequence {next_sequence(known[1])}"
                )
            pending[producer_id] = epoch, last
        if duplicates and fresh:
            raise DuplicateSequenceError(
                "the request mixes batches already written (retries) with new ones; "
                "resend retried batches in their original requests"
            )
        if duplicates:
            if any(d.first_offset < 0 for d in duplicates):
                # Offsets counted from a known first batch would be wrong for the others.
                return -1, max(d.last_offset for d in duplicates)
            return duplicates[0].first_offset, duplicates[-1].last_offset
        return None

    def update(self, header: BatchHeader, first_offset: int, now_ms: int) -> None:
        """Apply one written batch (leader after validation, follower, or replay).

        No validation: a follower trusts its leader. Batches without a producer id, and
        idempotent-looking ones without epoch or sequence, leave the state unchanged. A
        different epoch (newer, or on a follower even older) replaces the remembered
        batches, as in Kafka.
        """
        producer_id = header.producer_id
        if producer_id < 0 or header.producer_epoch < 0 or header.base_sequence < 0:
            return
        batch = BatchMetadata(
            header.base_sequence,
            last_sequence(header.base_sequence, header.last_offset_delta),
            first_offset,
            first_offset + header.last_offset_delta,
        )
        entry = self._producers.get(producer_id)
        if entry is None:
            entry = ProducerStateEntry(
                producer_id, header.producer_epoch, now_ms, header.base_sequence
            )
            self._producers[producer_id] = entry
        elif entry.producer_epoch != header.producer_epoch:
            entry.producer_epoch = header.producer_epoch
            entry.start_sequence = header.base_sequence
            entry.batches.clear()
        entry.batches.append(batch)
        entry.last_update_ms = now_ms

    def remove_expired(self, now_ms: int, expiration_ms: int) -> int:
        """Forget producers not heard from for ``expiration_ms``; returns how many."""
        expired = [
            producer_id
            for producer_id, entry in self._producers.items()
            if now_ms - entry.last_update_ms >= expiration_ms
        ]
        for producer_id in expired:
            del self._producers[producer_id]
        return len(expired)

    def clear(self, end_offset: int) -> None:
        """Forget every producer; the (empty) state is as of ``end_offset``."""
        self._producers.clear()
        self.end_offset = end_offset

    # --- snapshots -----------------------------------------------------------------------

    def take_snapshot(self) -> Path:
        """Write the state as of ``end_offset`` to ``<end_offset>.snapshot``.

        Not fsynced here (``flush`` does it): a snapshot is a checksummed cache of the log,
        and a lost or torn one only means a longer replay.
        """
        offset = self.end_offset
        path = snapshot_path(self.directory, offset)
        write_bytes_atomically(path, encode_snapshot(offset, self._producers.values()), sync=False)
        self._unsynced.append(path)
        if offset not in self._snapshots:
            bisect.insort(self._snapshots, offset)
        return path

    def flush(self) -> None:
        """fsync snapshots written since the last flush (the caller fsyncs the directory)."""
        for path in self._unsynced:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # pruned since
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._unsynced.clear()

    def load_snapshot(self, min_offset: int, max_offset: int) -> int | None:
        """Load the newest valid snapshot in ``[min_offset, max_offset]``; its offset.

        Damaged snapshots met on the way are deleted. None (and an empty state) when there
        is none: the caller replays from ``min_offset``.
        """
        for offset in reversed(list(self._snapshots)):
            if offset > max_offset:
                continue
            if offset < min_offset:
                break
            path = snapshot_path(self.directory, offset)
            try:
                producers = decode_snapshot(path.read_bytes(), offset)
            except (OSError, ProducerSnapshotCorruptError):
                self._delete(offset)
                continue
            self._producers = producers
            self.end_offset = offset
            return offset
        self._producers = {}
        self.end_offset = min_offset
        return None

    def delete_snapshots(self, *, below: int | None = None, above: int | None = None) -> bool:
        """Delete snapshots at offsets < ``below`` and > ``above``; True if any were."""
        doomed = [
            offset
            for offset in self._snapshots
            if (below is not None and offset < below) or (above is not None and offset > above)
        ]
        for offset in doomed:
            self._delete(offset)
        return bool(doomed)

    def delete_all_snapshots(self) -> bool:
        doomed = list(self._snapshots)
        for offset in doomed:
            self._delete(offset)
        return bool(doomed)

    def retain_snapshots(self, keep: Iterable[int]) -> None:
        """Delete every snapshot except the newest one and those at offsets in ``keep``."""
        wanted = set(keep)
        for offset in self._snapshots[:-1]:
            if offset not in wanted:
                self._delete(offset)

    def _delete(self, offset: int) -> None:
        snapshot_path(self.directory, offset).unlink(missing_ok=True)
        self._snapshots.remove(offset)
