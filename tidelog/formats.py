"""Every fixed byte layout tidelog writes, in one place.

The tables in ``docs/FORMAT.md`` describe these layouts for people; this module is the
one the code uses. Size relationships are asserted at import so a changed field cannot
silently shift its neighbours.

All integers are little-endian: the record body is laid out as Arrow-style columns
(offsets arrays of int32), and Arrow is little-endian, so decoding can hand buffers to
Arrow without swapping bytes. The header follows suit so the whole format has one byte
order.

Record batch header (65 bytes), in file order::

    base_offset             i64   rewritten by the broker on append
    batch_length            i32   bytes after this field: total size = 12 + batch_length
    partition_leader_epoch  i32   rewritten by the broker on append
    magic                   i8    BATCH_MAGIC
    crc                     u32   CRC32C of bytes [BODY_CRC_START, end): producer-owned part
    header_crc              u32   CRC32C of bytes [0, HEADER_CRC_OFFSET): broker-owned part
    attributes              i16   see ATTR_* bits
    last_offset_delta       i32   last offset - base offset (= record_count - 1)
    base_timestamp          i64   ms since epoch; record timestamps are deltas from it
    max_timestamp           i64   largest record timestamp in the batch
    producer_id             i64   -1 when not idempotent
    producer_epoch          i16   -1 when not idempotent
    base_sequence           i32   -1 when not idempotent
    record_count            i32

Why two checksums: the broker owns base_offset and partition_leader_epoch and rewrites
them on append. Kafka leaves those fields unprotected; here ``header_crc`` covers them
(and the body crc), so the broker recomputes a 21-byte checksum in O(1) while the
producer's body checksum stays end-to-end. Every single-bit flip anywhere in a batch
breaks one of the two.
"""

from __future__ import annotations

import struct
from typing import Final

# --- record batch header ---------------------------------------------------------------

BATCH_MAGIC: Final = 1
"""Format version of a tidelog record batch."""

BATCH_HEADER = struct.Struct("<qiibIIhiqqqhii")
"""The whole 65-byte header, fields in the order listed in the module docstring."""

BATCH_HEADER_SIZE: Final = BATCH_HEADER.size

# Byte offsets of individual fields, for O(1) peeks and rewrites without a full unpack.
BASE_OFFSET_OFFSET: Final = 0
BATCH_LENGTH_OFFSET: Final = 8
PARTITION_LEADER_EPOCH_OFFSET: Final = 12
MAGIC_OFFSET: Final = 16
CRC_OFFSET: Final = 17
HEADER_CRC_OFFSET: Final = 21
BODY_CRC_START: Final = 25  # attributes onward: what the producer wrote
ATTRIBUTES_OFFSET: Final = 25
LAST_OFFSET_DELTA_OFFSET: Final = 27
BASE_TIMESTAMP_OFFSET: Final = 31
MAX_TIMESTAMP_OFFSET: Final = 39
PRODUCER_ID_OFFSET: Final = 47
PRODUCER_EPOCH_OFFSET: Final = 55
BASE_SEQUENCE_OFFSET: Final = 57
RECORD_COUNT_OFFSET: Final = 61

LOG_OVERHEAD: Final = 12
"""base_offset + batch_length: the prefix read before the rest of a batch's size is known."""

LOG_PREFIX = struct.Struct("<qi")
"""base_offset, batch_length: enough to skip from one batch to the next."""

I64 = struct.Struct("<q")
I32 = struct.Struct("<i")
U32 = struct.Struct("<I")
I16 = struct.Struct("<h")

# attributes bits
ATTR_COMPRESSION_MASK: Final = 0x07
COMPRESSION_NONE: Final = 0
COMPRESSION_ZSTD: Final = 1
COMPRESSION_LZ4: Final = 2
COMPRESSION_CODECS: Final = {
    "none": COMPRESSION_NONE,
    "zstd": COMPRESSION_ZSTD,
    "lz4": COMPRESSION_LZ4,
}
ATTR_TIMESTAMP_LOG_APPEND: Final = 0x08  # 0 = CreateTime, 1 = LogAppendTime
ATTR_HAS_TIMESTAMPS: Final = 0x10  # per-record timestamp deltas present
ATTR_HAS_KEYS: Final = 0x20  # key column present (else every key is null)
ATTR_HAS_HEADERS: Final = 0x40  # header lists present
ATTR_KNOWN_BITS: Final = 0x7F

INT32_MAX: Final = (1 << 31) - 1
"""The largest value of an int32 field (protobuf or batch header)."""
INT64_MAX: Final = (1 << 63) - 1
"""The largest value of an int64 field (offsets, timestamps)."""
MAX_BATCH_BYTES: Final = INT32_MAX
"""Hard ceiling from the i32 length field; configured limits are far lower."""
DEFAULT_MAX_MESSAGE_BYTES: Final = 1_048_588
"""max.message.bytes when a topic does not set it (Kafka's default, 1 MiB + 12)."""
MAX_PRODUCE_REQUEST_BYTES: Final = 100 * 1024 * 1024
"""A gateway's default largest produce request (Kafka's socket.request.max.bytes); a
storage node takes messages somewhat larger (``REQUEST_OVERHEAD_BYTES``), so that a
partition's records of a request the gateway took reach its leader whole."""
REQUEST_OVERHEAD_BYTES: Final = 1024 * 1024
"""What a request's framing adds to the records it carries, at most."""
MAX_CLIENT_ID_CHARS: Final = 255
"""The longest client id a gateway takes (in produce, InitProducerId and group requests)."""
MAX_PARTITIONS_PER_REQUEST: Final = 10_000
"""The most partitions one client request to a gateway names (Produce, Fetch, ListOffsets,
CommitOffsets, FetchOffsets); the SDK splits larger asks."""
NO_TIMESTAMP: Final = -1
"""A batch timestamp meaning "none" (Kafka's RecordBatch.NO_TIMESTAMP)."""
MAX_TOPICS_PER_REQUEST: Final = 1_000
"""Topics one DescribeTopics request may name (the SDK splits longer lists)."""

# --- offset and time indexes -----------------------------------------------------------

OFFSET_INDEX_ENTRY = struct.Struct("<II")
"""relative offset (offset - segment base offset), position in the .log file."""

TIME_INDEX_ENTRY = struct.Struct("<qI")
"""max timestamp so far in the segment, relative offset of the batch that carried it."""

OFFSET_INDEX_ENTRY_SIZE: Final = OFFSET_INDEX_ENTRY.size
TIME_INDEX_ENTRY_SIZE: Final = TIME_INDEX_ENTRY.size

MAX_RELATIVE_OFFSET: Final = (1 << 32) - 1
MAX_SEGMENT_POSITION: Final = (1 << 31) - 1
"""Segments stay below 2 GiB so a position fits comfortably in an index entry."""

# --- producer state snapshots (<offset>.snapshot) ------------------------------------------
# The idempotent-producer state of a partition as of an offset (docs/FORMAT.md 3.3): a
# header, then per producer an entry followed by its cached batches (up to
# PRODUCER_BATCHES_RETAINED). Written by services/storage/log/producer_state.py.

PRODUCER_SNAPSHOT_VERSION: Final = 2

PRODUCER_SNAPSHOT_HEADER = struct.Struct("<hIqi")
"""version, crc (CRC32C of every byte after this field), snapshot offset, producer count."""

PRODUCER_SNAPSHOT_ENTRY = struct.Struct("<qhqih")
"""producer id, producer epoch, last update time (ms), start sequence, number of cached
batches."""

PRODUCER_SNAPSHOT_BATCH = struct.Struct("<iiqq")
"""first sequence, last sequence, first offset, last offset of one cached batch."""

PRODUCER_SNAPSHOT_CRC_START: Final = 6
"""The snapshot checksum covers bytes [6, end): everything after version and crc."""

PRODUCER_BATCHES_RETAINED: Final = 5
"""Batches remembered per producer for duplicate detection: Kafka's limit on
max.in.flight.requests.per.connection with idempotence, so every batch a producer may
retry is still known."""

MAX_SEQUENCE: Final = (1 << 31) - 1
"""Sequence numbers are non-negative i32s; after MAX_SEQUENCE the next one is 0."""

# --- file names -------------------------------------------------------------------------

LOG_SUFFIX: Final = ".log"
INDEX_SUFFIX: Final = ".index"
TIME_INDEX_SUFFIX: Final = ".timeindex"
DELETED_SUFFIX: Final = ".deleted"
SWAP_SUFFIX: Final = ".swap"
TMP_SUFFIX: Final = ".tmp"
SNAPSHOT_SUFFIX: Final = ".snapshot"
LEADER_EPOCH_CHECKPOINT: Final = "leader-epoch-checkpoint"
SEGMENT_NAME_DIGITS: Final = 20


def segment_file_name(base_offset: int, suffix: str) -> str:
    """``00000000000000000042.log`` for base offset 42."""
    return f"{base_offset:0{SEGMENT_NAME_DIGITS}d}{suffix}"


# --- import-time checks of size relationships --------------------------------------------

assert BATCH_HEADER_SIZE == 65, BATCH_HEADER_SIZE
assert LOG_PREFIX.size == LOG_OVERHEAD
assert struct.calcsize("<qii") == MAGIC_OFFSET
assert MAGIC_OFFSET + 1 == CRC_OFFSET
assert CRC_OFFSET + 4 == HEADER_CRC_OFFSET
assert HEADER_CRC_OFFSET + 4 == BODY_CRC_START == ATTRIBUTES_OFFSET
assert ATTRIBUTES_OFFSET + 2 == LAST_OFFSET_DELTA_OFFSET
assert LAST_OFFSET_DELTA_OFFSET + 4 == BASE_TIMESTAMP_OFFSET
assert BASE_TIMESTAMP_OFFSET + 8 == MAX_TIMESTAMP_OFFSET
assert MAX_TIMESTAMP_OFFSET + 8 == PRODUCER_ID_OFFSET
assert PRODUCER_ID_OFFSET + 8 == PRODUCER_EPOCH_OFFSET
assert PRODUCER_EPOCH_OFFSET + 2 == BASE_SEQUENCE_OFFSET
assert BASE_SEQUENCE_OFFSET + 4 == RECORD_COUNT_OFFSET
assert RECORD_COUNT_OFFSET + 4 == BATCH_HEADER_SIZE
assert OFFSET_INDEX_ENTRY_SIZE == 8
assert TIME_INDEX_ENTRY_SIZE == 12
assert PRODUCER_SNAPSHOT_HEADER.size == 18
assert struct.calcsize("<hI") == PRODUCER_SNAPSHOT_CRC_START
assert PRODUCER_SNAPSHOT_ENTRY.size == 24
assert PRODUCER_SNAPSHOT_BATCH.size == 24
