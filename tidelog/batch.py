"""Batch-level operations: everything a broker may do with a record batch.

A broker treats a batch as opaque bytes. It may read the 65-byte header, verify the two
checksums, and rewrite the fields it owns (base offset, partition leader epoch, and the
header checksum that covers them). All of it is O(1) Python work per batch; checksums run
in C. Decoding records is the client's business (``tidelog.records``).

Layout and field meanings: ``tidelog.formats`` and ``docs/FORMAT.md``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import crc32c as _crc32c

from tidelog import formats as f
from tidelog.errors import CorruptBatchError


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC32C (Castagnoli), the checksum of every batch."""
    return int(_crc32c.crc32c(data))


@dataclass(frozen=True, slots=True)
class BatchHeader:
    """A parsed batch header. ``size_bytes`` is the whole batch, header included."""

    base_offset: int
    batch_length: int
    partition_leader_epoch: int
    magic: int
    crc: int
    header_crc: int
    attributes: int
    last_offset_delta: int
    base_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    record_count: int

    @property
    def size_bytes(self) -> int:
        return f.LOG_OVERHEAD + self.batch_length

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.last_offset_delta

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.last_offset_delta + 1

    @property
    def compression(self) -> int:
        return self.attributes & f.ATTR_COMPRESSION_MASK

    @property
    def is_idempotent(self) -> bool:
        return self.producer_id >= 0


def parse_header(buf: bytes | bytearray | memoryview, position: int = 0) -> BatchHeader:
    """Unpack the header at ``position`` without checking anything but that it fits."""
    if len(buf) - position < f.BATCH_HEADER_SIZE:
        raise CorruptBatchError(
            f"truncated batch header: {len(buf) - position} bytes at position {position}, "
            f"a header needs {f.BATCH_HEADER_SIZE}"
        )
    return BatchHeader(*f.BATCH_HEADER.unpack_from(buf, position))


def header_crc_of(buf: bytes | bytearray | memoryview, position: int = 0) -> int:
    """The checksum that ``header_crc`` must hold for the batch at ``position``."""
    return crc32c(memoryview(buf)[position : position + f.HEADER_CRC_OFFSET])


def check_header(buf: bytes | bytearray | memoryview, position: int = 0) -> BatchHeader:
    """Parse and verify the header only: magic, header checksum, sane length and counts.

    Cheap (a 21-byte checksum), so it is used to confirm that a position found through an
    index really is the start of a batch before trusting it.
    """
    header = parse_header(buf, position)
    if header.magic != f.BATCH_MAGIC:
        raise CorruptBatchError(
            f"unknown batch magic {header.magic} at position {position} "
            f"(this broker reads magic {f.BATCH_MAGIC})"
        )
    if header.header_crc != header_crc_of(buf, position):
        raise CorruptBatchError(f"batch header checksum mismatch at position {position}")
    if header.size_bytes < f.BATCH_HEADER_SIZE:
        raise CorruptBatchError(
            f"batch_length {header.batch_length} at position {position} is shorter than a header"
        )
    if header.record_count < 1 or header.last_offset_delta != header.record_count - 1:
        raise CorruptBatchError(
            f"batch at position {position} has record_count {header.record_count} and "
            f"last_offset_delta {header.last_offset_delta}; expected count >= 1 and "
            "delta = count - 1"
        )
    if header.attributes & ~f.ATTR_KNOWN_BITS or header.compression not in (
        f.COMPRESSION_CODECS.values()
    ):
        raise CorruptBatchError(
            f"batch at position {position} has unknown attributes {header.attributes:#x}"
        )
    return header


def check_batch(buf: bytes | bytearray | memoryview, position: int = 0) -> BatchHeader:
    """Verify one whole batch at ``position``: header checks plus the body checksum.

    Raises CorruptBatchError when the batch is torn (shorter than its declared length),
    damaged, or of an unknown format.
    """
    header = check_header(buf, position)
    end = position + header.size_bytes
    if end > len(buf):
        raise CorruptBatchError(
            f"torn batch at position {position}: declares {header.size_bytes} bytes, "
            f"{len(buf) - position} present"
        )
    if crc32c(memoryview(buf)[position + f.BODY_CRC_START : end]) != header.crc:
        raise CorruptBatchError(f"batch body checksum mismatch at position {position}")
    return header


def iter_batches(buf: bytes | bytearray | memoryview) -> Iterator[tuple[int, BatchHeader]]:
    """Verify and yield ``(position, header)`` for each batch in a concatenation.

    Raises CorruptBatchError at the first damaged or partial batch; a producer's request
    must consist of whole, intact batches.
    """
    position = 0
    while position < len(buf):
        header = check_batch(buf, position)
        yield position, header
        position += header.size_bytes


def last_whole_batch(buf: bytes | bytearray | memoryview) -> BatchHeader | None:
    """The header of the last whole batch in ``buf`` (None when there is none).

    Reads batch headers only (no CRC check), O(1) per batch: for code that forwards or
    prefetches batches without decoding them.
    """
    view = memoryview(buf)
    position = 0
    last = None
    while position + f.BATCH_HEADER_SIZE <= len(view):
        header = parse_header(view, position)
        if header.size_bytes <= 0 or position + header.size_bytes > len(view):
            break
        last = header
        position += header.size_bytes
    return last


def next_offset_after(buf: bytes | bytearray | memoryview, fallback: int) -> int:
    """The offset after the last whole batch in ``buf`` (``fallback`` when there is none);
    headers only, as ``last_whole_batch``."""
    last = last_whole_batch(buf)
    return fallback if last is None else last.next_offset


LOG_APPEND_TIME_STAMPED_END = f.MAX_TIMESTAMP_OFFSET + 8
"""``stamp_log_append_time`` rewrites bytes up to here (attributes and max_timestamp)."""


def stamp_log_append_time(
    head: bytearray, rest: bytes | bytearray | memoryview, append_time_ms: int
) -> None:
    """Make a batch a LogAppendTime batch (a topic with message.timestamp.type
    LogAppendTime), as Kafka's leader does: set the timestamp-type attribute bit and
    ``max_timestamp`` to the append time, which every record then reads as its timestamp,
    and recompute ``crc``. ``head`` is the batch's first ``LOG_APPEND_TIME_STAMPED_END``
    bytes, rewritten in place; ``rest`` the bytes after them. ``crc`` covers the rewritten
    fields, so this is the one broker operation that reads the whole batch (in C, not per
    record); the caller has verified the old ``crc`` first, and ``stamp`` the header
    checksum after."""
    attributes = f.I16.unpack_from(head, f.ATTRIBUTES_OFFSET)[0] | f.ATTR_TIMESTAMP_LOG_APPEND
    f.I16.pack_into(head, f.ATTRIBUTES_OFFSET, attributes)
    f.I64.pack_into(head, f.MAX_TIMESTAMP_OFFSET, append_time_ms)
    crc = _crc32c.crc32c(rest, _crc32c.crc32c(memoryview(head)[f.BODY_CRC_START :]))
    f.U32.pack_into(head, f.CRC_OFFSET, crc)


def stamp(buf: bytearray, position: int, base_offset: int, partition_leader_epoch: int) -> None:
    """Rewrite the broker-owned fields of the batch at ``position`` and its header checksum."""
    f.I64.pack_into(buf, position + f.BASE_OFFSET_OFFSET, base_offset)
    f.I32.pack_into(buf, position + f.PARTITION_LEADER_EPOCH_OFFSET, partition_leader_epoch)
    f.U32.pack_into(buf, position + f.HEADER_CRC_OFFSET, header_crc_of(buf, position))
