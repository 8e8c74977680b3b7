"""The record batch codec: Python values and Arrow arrays to batch bytes, and back.

A batch is the 65-byte header of ``tidelog.formats`` followed by a *body* holding the
records as Arrow-style columns, so that encoding a Python list is a handful of C-level
calls and decoding to Arrow hands the body's own buffers to ``pa.Array.from_buffers``.
The byte tables are in ``docs/FORMAT.md``; this docstring is the normative summary.

Body layout. ``N`` is the header's record_count. Every *section* below is followed by
zero bytes up to the next multiple of 8 (relative to the start of the plain body), so
that every int32/int64 buffer is naturally aligned whenever the plain body is::

    timestamp deltas   N x i64               only if ATTR_HAS_TIMESTAMPS
    key column                               only if ATTR_HAS_KEYS
        validity       ceil(N/8) bytes       Arrow bitmap: LSB first, 1 = present
        offsets        (N+1) x i32
        data           offsets[N] bytes
    value column                             always (validity, offsets, data as above)
    header lists                             only if ATTR_HAS_HEADERS
        list offsets   (N+1) x i32           record i owns entries [lo[i], lo[i+1]); M = lo[N]
        key offsets    (M+1) x i32           header names: UTF-8, never null
        key data       key_offsets[M] bytes
        value validity ceil(M/8) bytes
        value offsets  (M+1) x i32
        value data     value_offsets[M] bytes

All integers are little-endian. In an uncompressed batch the body region (batch bytes
[65, end)) is 7 zero bytes and then the plain body, so the plain body starts at batch
offset 72 and every uncompressed batch is a multiple of 8 bytes long: a buffer of
concatenated uncompressed batches that starts 8-aligned keeps every batch aligned, and
``to_arrow`` is zero-copy. In a compressed batch the body region is exactly one zstd or
lz4 frame of the plain body, with its content size recorded in the frame header.

Invariants a decoder enforces (a hostile producer can compute valid CRCs, so each is
checked and a violation raises CorruptBatchError, never IndexError or garbage):

* every section fits in the body, and the sections consume the body exactly;
* padding bytes and the bitmap bits past the last element are zero;
* each offsets array starts at 0 and never decreases; its last entry is its data length;
* header names are valid UTF-8;
* 0 <= base_offset and last_offset fits in i64;
* max_timestamp equals the largest record timestamp, and every timestamp fits in i64
  (unless the log-append-time attribute is set: then every record's timestamp is
  max_timestamp, as in Kafka, and the deltas are ignored);
* a compressed body is a single frame with a declared content size, no trailing bytes,
  that decompresses to at most ``max_uncompressed_bytes``.

Data under a null slot is not an error (Arrow allows it) and is ignored. Encoding is
canonical: the same records, timestamps and options always produce the same bytes, from
Python lists and from Arrow arrays alike, except that ``encode_batch_arrow`` keeps
whatever bytes an input array holds under its null slots (``encode_batch`` writes
zero-length slots for nulls).
"""

from __future__ import annotations

import array
import functools
import operator
import re
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, compress, count, islice, repeat
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import crc32c as _crc32c
import lz4.frame
import zstandard

from tidelog import formats as f
from tidelog.batch import BatchHeader, check_batch, check_header, header_crc_of
from tidelog.errors import ConfigError, CorruptBatchError

if TYPE_CHECKING:
    import pyarrow

_TupleT = TypeVar("_TupleT", bound=tuple[Any, ...])

__all__ = [
    "DEFAULT_MAX_UNCOMPRESSED_BYTES",
    "Header",
    "InvalidBatch",
    "Record",
    "RecordBatch",
    "arrow_schema",
    "batches_to_arrow",
    "check_headers",
    "decode_batches",
    "decode_valid_batches",
    "encode_batch",
    "encode_batch_arrow",
    "encode_batch_arrow_parts",
]

Header = tuple[str, bytes | None]
"""One record header: a UTF-8 name and a nullable binary value."""

ALIGNMENT: Final = 8
"""Every body section starts at a multiple of this, relative to the plain body."""

UNCOMPRESSED_BODY_PAD: Final = -f.BATCH_HEADER_SIZE % ALIGNMENT
"""Zero bytes between the header and an uncompressed plain body (65 + 7 = 72)."""

DEFAULT_MAX_UNCOMPRESSED_BYTES: Final = (
    f.MAX_BATCH_BYTES - f.BATCH_HEADER_SIZE - UNCOMPRESSED_BODY_PAD
)
"""Largest plain body a compressed batch may inflate to: what fits in an uncompressed one."""

ZSTD_LEVEL: Final = 3

_ZEROS: Final = bytes(ALIGNMENT)
_I32_ZERO: Final = bytes(4)
_INT64_MIN: Final = -(1 << 63)
_ZERO_ONE_TO_ASCII: Final = bytes.maketrans(b"\x00\x01", b"01")
_LITTLE_ENDIAN: Final = sys.byteorder == "little"
_CONTINUATION_BYTE: Final = re.compile(rb"[\x80-\xbf]")
_POSITION_PREFIX: Final = re.compile(r"^batch at position \d+: ")

# array.array codes for the wire's i32 and i64; the format fixes the sizes, and a
# platform where they differ would decode garbage (so not an assert, which -O drops).
if (array.array("i").itemsize, array.array("q").itemsize) != (4, 8):
    raise ImportError("tidelog.records needs 4-byte 'i' and 8-byte 'q' array items")


# --- records and batches -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    """One decoded record. ``offset`` is the batch's base offset plus the record's index."""

    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[Header, ...] = ()


@dataclass(frozen=True, slots=True)
class _Span:
    """Where a section's bytes sit in the plain body (padding excluded)."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size


@dataclass(frozen=True, slots=True)
class _Column:
    """A validated variable-length binary column: ``length`` items, offsets already checked."""

    length: int
    validity: _Span | None  # None for columns that cannot hold nulls (header names)
    offsets: array.array[int]
    offsets_span: _Span
    data: _Span


@dataclass(frozen=True, slots=True)
class _Headers:
    """The header-list section: per-record ranges into M (name, value) entries."""

    list_offsets: array.array[int]
    list_offsets_span: _Span
    names: _Column
    values: _Column


@dataclass(frozen=True, slots=True)
class _Body:
    """A parsed, validated plain body. Spans index into ``data``."""

    data: memoryview
    timestamp_deltas: array.array[int] | None
    timestamps_span: _Span | None
    keys: _Column | None
    values: _Column
    headers: _Headers | None


class RecordBatch:
    """A verified batch: header fields plus lazily materialised records.

    Construction (through ``decode_batches``) has already checked both CRCs and the body's
    structure, so ``records`` and ``to_arrow`` cannot fail on a hostile body. For an
    uncompressed batch the object shares memory with the buffer given to
    ``decode_batches``: do not mutate that buffer while the batch (or Arrow data built
    from it) is alive.
    """

    __slots__ = ("_body", "_records", "header")

    def __init__(self, header: BatchHeader, body: _Body) -> None:
        self.header = header
        self._body = body
        self._records: list[Record] | None = None

    @property
    def base_offset(self) -> int:
        return self.header.base_offset

    @property
    def last_offset(self) -> int:
        return self.header.last_offset

    @property
    def next_offset(self) -> int:
        return self.header.next_offset

    @property
    def record_count(self) -> int:
        return self.header.record_count

    @property
    def partition_leader_epoch(self) -> int:
        return self.header.partition_leader_epoch

    @property
    def producer_id(self) -> int:
        return self.header.producer_id

    @property
    def producer_epoch(self) -> int:
        return self.header.producer_epoch

    @property
    def base_sequence(self) -> int:
        return self.header.base_sequence

    @property
    def base_timestamp(self) -> int:
        return self.header.base_timestamp

    @property
    def max_timestamp(self) -> int:
        return self.header.max_timestamp

    @property
    def size_bytes(self) -> int:
        return self.header.size_bytes

    @property
    def records(self) -> list[Record]:
        """The records, decoded on first access and cached."""
        if self._records is None:
            self._records = _decode_records(self.header, self._body)
        return self._records

    def records_as(self, record_type: type[_TupleT], topic: str, partition: int) -> list[_TupleT]:
        """The records as ``record_type(topic, partition, offset, timestamp_ms, key, value,
        headers)`` each, built straight from the columns. ``record_type`` is a tuple
        subclass (a NamedTuple): its instances are made by ``tuple.__new__`` from zipped
        columns, with no Python call per record (a NamedTuple's own constructor is a Python
        function, which would cost more than the decoding). Not cached."""
        header, body = self.header, self._body
        n = header.record_count
        make = functools.partial(tuple.__new__, record_type)
        return list(
            map(
                make,
                zip(
                    repeat(topic, n),
                    repeat(partition, n),
                    range(header.base_offset, header.base_offset + n),
                    _record_timestamps(header, body),
                    repeat(None, n) if body.keys is None else _column_items(body.data, body.keys),
                    _column_items(body.data, body.values),
                    repeat((), n)
                    if body.headers is None
                    else _header_tuples(body.data, body.headers),
                    strict=False,
                ),
            )
        )

    def __len__(self) -> int:
        return self.header.record_count

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __repr__(self) -> str:
        return (
            f"RecordBatch(base_offset={self.base_offset}, record_count={self.record_count}, "
            f"partition_leader_epoch={self.partition_leader_epoch}, "
            f"producer_id={self.producer_id}, size_bytes={self.size_bytes})"
        )

    def to_arrow(self) -> pyarrow.RecordBatch:
        """The records as a ``pyarrow.RecordBatch`` with ``arrow_schema()``.

        Key, value and header columns are views over the body's buffers (copied once, as a
        whole, only if the body is not 8-byte aligned in memory); offsets and timestamps
        are computed by Arrow kernels. No Python code runs per record.
        """
        return _body_to_arrow(self.header, self._body)


# --- batch sizes, for cutting records into batches -------------------------------------------
# Upper bounds of what the body layout above costs, so a producer that keeps the sum of
# its records' estimates within ``batch_bytes - batch_overhead_bytes(batch_bytes)`` makes
# batches of at most ``batch_bytes`` (and a topic's max.message.bytes defaults to 1 MiB +
# 12, the producers' default batch size + 12).

RECORD_OVERHEAD_BYTES: Final = 17
"""Most a record costs beyond its key, value and header bytes: an i64 timestamp delta, an
i32 offset in the key and in the value column, and a validity bit in each (rounded up)."""
HEADER_OVERHEAD_BYTES: Final = 9
"""Most one header costs beyond its name's UTF-8 and its value: two i32 offsets and a
validity bit."""
HEADER_LIST_OVERHEAD_BYTES: Final = 4
"""Most a record's header list costs beyond its headers: its i32 list offset."""
BATCH_OVERHEAD_BYTES: Final = 256
"""Most a batch costs beyond its records' estimates, but for the part of a compression
frame's overhead that grows with the body (``batch_overhead_bytes``): the 65-byte header
and the 7 zero bytes before the body, the closing entry of each offsets array, each
section's padding to 8 bytes (~165 bytes in all), and a frame's fixed header and end."""
COMPRESSION_BLOCK_OVERHEAD_DIVISOR: Final = 8192
"""One byte reserved per this many bytes of batch for a compression frame's per-block
overhead on data that does not compress: lz4 adds 4 bytes per 64 KiB block, zstd 3 per
128 KiB block. A fixed reserve ran out at ~4 MiB batches (lz4) and ~16 MiB (zstd): a
batch the producer sized to fit then exceeded batch_bytes and the topic's
max.message.bytes (found by an audit). Twice lz4's rate, for margin."""


def batch_overhead_bytes(batch_bytes: int) -> int:
    """Most a batch of at most ``batch_bytes`` costs beyond its records' estimates."""
    return BATCH_OVERHEAD_BYTES + batch_bytes // COMPRESSION_BLOCK_OVERHEAD_DIVISOR


def record_bytes(
    value: bytes | bytearray | memoryview | None,
    key: bytes | bytearray | memoryview | None = None,
    headers: Sequence[Header] | None = None,
) -> int:
    """An upper bound of what one record adds to an uncompressed batch."""
    size = len(value or b"") + len(key or b"") + RECORD_OVERHEAD_BYTES
    if headers:
        size += HEADER_LIST_OVERHEAD_BYTES + sum(
            HEADER_OVERHEAD_BYTES + len(name.encode()) + len(v or b"") for name, v in headers
        )
    return size


def arrow_record_bytes(values: Any, keys: Any = None, headers: Any = None) -> Any:
    """``record_bytes`` of every row of binary-like Arrow arrays (and a
    list<struct<key, value>> ``headers`` array), as an int64 array, computed by Arrow
    kernels with no Python work per row."""
    pa, pc = _arrow()
    sizes = pc.add(_binary_lengths(values, pc), RECORD_OVERHEAD_BYTES)
    if keys is not None:
        sizes = pc.add(sizes, _binary_lengths(keys, pc))
    if headers is not None and len(headers):
        sizes = pc.add(sizes, _header_bytes(headers, pa, pc))
    return sizes.cast(pa.int64())


def _header_bytes(headers: Any, pa: Any, pc: Any) -> Any:
    """Each row's header list cost: its entries' name and value bytes and framing, summed
    per row through the list offsets (a running total over all entries, differenced)."""
    if isinstance(headers, pa.ChunkedArray):
        headers = headers.combine_chunks()
    entries = headers.flatten()  # the entries of these rows only, also for a slice
    entry_sizes = pc.add(
        pc.add(_binary_lengths(entries.field(0), pc), _binary_lengths(entries.field(1), pc)),
        HEADER_OVERHEAD_BYTES,
    )
    totals = pa.concat_arrays(
        [pa.array([0], pa.int64()), pc.cumulative_sum(entry_sizes).cast(pa.int64())]
    )
    offsets = pc.subtract(headers.offsets, headers.offsets[0]).cast(pa.int64())
    ends = pc.take(totals, offsets.slice(1))
    starts = pc.take(totals, offsets.slice(0, len(headers)))
    return pc.add(pc.subtract(ends, starts), HEADER_LIST_OVERHEAD_BYTES)


def _binary_lengths(array: Any, pc: Any) -> Any:
    """Each item's byte length (0 for null). The view types the encoder takes (Polars and
    DuckDB hand them out) have no ``binary_length`` kernel: their lengths come from a
    cast, which raised ArrowNotImplementedError out of ``send_batch`` (found by an
    audit)."""
    pa, _ = _arrow()
    if pa.types.is_dictionary(array.type):  # as Parquet reads often give: decoded
        array = array.cast(array.type.value_type)
    if pa.types.is_binary_view(array.type):
        array = array.cast(pa.large_binary())
    elif pa.types.is_string_view(array.type):
        array = array.cast(pa.large_string())
    try:
        lengths = pc.binary_length(array)
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
        # The encoder's rule, said at the call (Arrow's own error escaped send_batch).
        raise ConfigError(f"expected a binary or string array, not {array.type}") from None
    return pc.fill_null(lengths, 0).cast("int64")


def batch_cuts(row_bytes: Any, batch_bytes: int) -> list[tuple[int, int, int]]:
    """Cut rows into consecutive runs of at most ``batch_bytes`` as encoded batches, given
    each row's ``record_bytes`` (an Arrow integer array); ``(start, stop, bytes)`` each.
    A row too large for any batch goes alone. O(batches x log rows) Python steps: a
    binary search over the running total for each cut, not a loop over rows."""
    _, pc = _arrow()
    n = len(row_bytes)
    if not n:
        return []
    totals = pc.cumulative_sum(row_bytes.cast("int64"))
    budget = max(1, batch_bytes - batch_overhead_bytes(batch_bytes))
    cuts: list[tuple[int, int, int]] = []
    start, before = 0, 0
    while start < n:
        # The largest stop with totals[stop - 1] - before <= budget (at least start + 1).
        low, high = start + 1, n
        while low < high:
            middle = (low + high + 1) // 2
            if totals[middle - 1].as_py() - before <= budget:
                low = middle
            else:
                high = middle - 1
        stop = low
        after = totals[stop - 1].as_py()
        cuts.append((start, stop, after - before))
        start, before = stop, after
    return cuts


# --- public functions ------------------------------------------------------------------------


def encode_batch(  # noqa: PLR0917 - DESIGN.md §6 fixes this signature
    values: Sequence[bytes | None],
    keys: Sequence[bytes | None] | None = None,
    headers: Sequence[Sequence[Header]] | None = None,
    timestamps_ms: Sequence[int] | None = None,
    compression: str = "none",
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    *,
    base_timestamp_ms: int | None = None,
) -> bytes:
    """Encode one batch from Python sequences.

    ``values[i]``, ``keys[i]`` (None: no key), ``headers[i]`` (a sequence of
    ``(str, bytes | None)`` pairs) and ``timestamps_ms[i]`` describe record ``i``. Without
    ``timestamps_ms`` every record gets ``base_timestamp_ms`` (default: now); with it the
    base timestamp defaults to the smallest (every delta >= 0). The result has base_offset 0 and
    partition_leader_epoch -1: the broker stamps both on append.

    Raises ConfigError for an empty batch, mismatched lengths, wrongly typed items, an
    unknown codec, out-of-range fields, or a batch larger than ``formats.MAX_BATCH_BYTES``.
    """
    n = _sequence_length(values, "values")
    _check_record_count(n)
    options = _BatchOptions.checked(compression, producer_id, producer_epoch, base_sequence)
    body = _BodyWriter()
    attributes = options.codec

    base, max_ts, deltas = _timestamps_from_python(n, timestamps_ms, base_timestamp_ms)
    if deltas is not None:
        attributes |= f.ATTR_HAS_TIMESTAMPS
        body.section(_little_endian(deltas))
    if keys is not None:
        _sequence_length(keys, "keys", n)
        if _any_present(keys):  # all-null keys cost nothing: the section is left out
            attributes |= f.ATTR_HAS_KEYS
            _write_python_column(body, keys, "keys", nullable=True)
    _write_python_column(body, values, "values", nullable=True)
    if headers is not None:
        _sequence_length(headers, "headers", n)
        if _write_python_headers(body, headers):
            attributes |= f.ATTR_HAS_HEADERS
    return _seal(body, options, n=n, attributes=attributes, base_ts=base, max_ts=max_ts)


def encode_batch_arrow(values: Any, *args: Any, **kwargs: Any) -> bytes:
    """``encode_batch_arrow_parts`` (same arguments) joined into one ``bytes``."""
    return b"".join(encode_batch_arrow_parts(values, *args, **kwargs))


def encode_batch_arrow_parts(
    values: Any,
    keys: Any = None,
    headers: Any = None,
    timestamps_ms: Any = None,
    *,
    compression: str = "none",
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    base_timestamp_ms: int | None = None,
) -> list[Any]:
    """Encode one batch from pyarrow arrays, with O(1) Python operations per batch, as
    buffers whose concatenation is the batch: the header, then the body's sections, most
    of them zero-copy views of the arrays' own buffers (bytes-like: ``bytes.join`` and
    ``pwritev`` take them). A caller that joins them with other bytes anyway (a request)
    saves one copy of every record byte.

    ``values`` and ``keys`` are binary-like arrays (binary, large_binary, binary_view;
    chunked arrays are combined), ``headers`` a list<struct<key: string, value: binary>>
    array (large variants accepted; a null list means no headers), ``timestamps_ms`` an
    integer array (milliseconds) or a timestamp or date array (any unit, converted to
    milliseconds). Arrays may be slices: offsets are rebased. Produces the
    same bytes as ``encode_batch`` given the same records. Raises ConfigError like it.
    """
    pa, _ = _arrow()
    value_array = _arrow_input(values, pa.binary(), "values")
    n = len(value_array)
    _check_record_count(n)
    options = _BatchOptions.checked(compression, producer_id, producer_epoch, base_sequence)
    body = _BodyWriter()
    attributes = options.codec

    base, max_ts, deltas = _timestamps_from_arrow(n, timestamps_ms, base_timestamp_ms)
    if deltas is not None:
        attributes |= f.ATTR_HAS_TIMESTAMPS
        body.section(deltas)
    if keys is not None:
        key_array = _arrow_input(keys, pa.binary(), "keys", n)
        if key_array.null_count < n:
            attributes |= f.ATTR_HAS_KEYS
            _write_arrow_column(body, key_array, nullable=True)
    _write_arrow_column(body, value_array, nullable=True)
    if headers is not None:
        header_array = _arrow_input(headers, _headers_type(pa), "headers", n)
        if _write_arrow_headers(body, header_array):
            attributes |= f.ATTR_HAS_HEADERS
    return _seal_parts(body, options, n=n, attributes=attributes, base_ts=base, max_ts=max_ts)


def decode_batches(
    data: bytes | bytearray | memoryview,
    *,
    max_uncompressed_bytes: int = DEFAULT_MAX_UNCOMPRESSED_BYTES,
) -> list[RecordBatch]:
    """Verify and decode a concatenation of whole batches (a produce or fetch payload).

    Checks both CRCs of every batch (``tidelog.batch.check_batch``), decompresses and
    validates every body's structure. Raises CorruptBatchError for any damage, including
    a trailing partial batch; an empty input yields no batches. Records themselves are
    materialised lazily (``RecordBatch.records``, ``RecordBatch.to_arrow``).
    ``max_uncompressed_bytes`` bounds the memory a compressed body may inflate to.
    """
    batches, bad = decode_valid_batches(data, max_uncompressed_bytes=max_uncompressed_bytes)
    if bad is not None:
        # Without the traceback of where it was first raised: its frames held the
        # inflated body in a cycle only the cyclic GC freed (a broker kept 512 MiB per
        # hostile batch decoded; found by an audit).
        error = bad.error
        error.__traceback__ = None
        raise error
    return batches


@dataclass(frozen=True, slots=True)
class InvalidBatch:
    """The first batch of a payload that does not decode (``decode_valid_batches``).

    ``header`` is None when the header itself cannot be trusted (its checksum, magic or
    counts are wrong, or it is cut short): the batch's offsets and length are then
    unknown, and nothing after it can be found either."""

    position: int
    header: BatchHeader | None
    error: CorruptBatchError

    @property
    def reason(self) -> str:
        """What is wrong, without the byte position in the payload (meaningless to
        whoever reads it: they know the batch by its offsets)."""
        return _POSITION_PREFIX.sub("", self.error.message, count=1)


def decode_valid_batches(
    data: bytes | bytearray | memoryview,
    *,
    max_uncompressed_bytes: int = DEFAULT_MAX_UNCOMPRESSED_BYTES,
) -> tuple[list[RecordBatch], InvalidBatch | None]:
    """``decode_batches`` one batch at a time: the batches before the first invalid one,
    and that one (None when every batch is valid). Batches are opaque to brokers, so a
    fetch answer may hold a checksum-valid batch that breaks a body invariant; a consumer
    hands out the valid batches before it and then reports exactly which batch is bad
    (``tidelog.consumer``), instead of losing the whole answer to one error."""
    view = memoryview(data).cast("B")
    batches: list[RecordBatch] = []
    position = 0
    while position < len(view):
        try:
            header = check_batch(view, position)
        except CorruptBatchError as exc:
            try:
                trusted: BatchHeader | None = check_header(view, position)
            except CorruptBatchError:
                trusted = None  # the header itself is damaged
            return batches, InvalidBatch(position, trusted, exc)
        try:
            body = _parse_body(
                header,
                view[position : position + header.size_bytes],
                position,
                max_uncompressed_bytes,
            )
        except CorruptBatchError as exc:
            return batches, InvalidBatch(position, header, exc)
        batches.append(RecordBatch(header, body))
        position += header.size_bytes
    return batches, None


def arrow_schema() -> pyarrow.Schema:
    """Schema of ``RecordBatch.to_arrow``: offset, timestamp_ms, key, value, headers."""
    pa, _ = _arrow()
    return pa.schema(
        [
            pa.field("offset", pa.int64(), nullable=False),
            pa.field("timestamp_ms", pa.int64(), nullable=False),
            pa.field("key", pa.binary()),
            pa.field("value", pa.binary()),
            pa.field("headers", _headers_type(pa), nullable=False),
        ]
    )


def batches_to_arrow(batches: Iterable[RecordBatch]) -> pyarrow.Table:
    """All records of ``batches`` as one ``pyarrow.Table`` (one chunk per batch)."""
    pa, _ = _arrow()
    return pa.Table.from_batches([batch.to_arrow() for batch in batches], schema=arrow_schema())


# --- encoding: shared ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _BatchOptions:
    """Batch-level arguments, validated before any record work."""

    codec: int
    producer_id: int
    producer_epoch: int
    base_sequence: int

    @classmethod
    def checked(
        cls, compression: str, producer_id: int, producer_epoch: int, base_sequence: int
    ) -> _BatchOptions:
        codec = f.COMPRESSION_CODECS.get(compression)
        if codec is None:
            raise ConfigError(
                f"unknown compression {compression!r}; expected one of "
                f"{sorted(f.COMPRESSION_CODECS)}"
            )
        _check_int_range("producer_id", producer_id, 64)
        _check_int_range("producer_epoch", producer_epoch, 16)
        _check_int_range("base_sequence", base_sequence, 32)
        return cls(codec, producer_id, producer_epoch, base_sequence)


class _BodyWriter:
    """Collects the plain body as buffers, padding each section to ``ALIGNMENT``."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[Any] = []  # bytes-like objects, pyarrow Buffers included
        self.size = 0

    def section(self, *buffers: Any) -> None:
        """Append one section made of ``buffers`` back to back, then its padding."""
        size = 0
        for buffer in buffers:
            size += memoryview(buffer).nbytes
            self.parts.append(buffer)
        pad = -size % ALIGNMENT
        if pad:
            self.parts.append(_ZEROS[:pad])
        self.size += size + pad


def _seal(
    body: _BodyWriter, options: _BatchOptions, *, n: int, attributes: int, base_ts: int, max_ts: int
) -> bytes:
    """``_seal_parts`` joined."""
    return b"".join(
        _seal_parts(body, options, n=n, attributes=attributes, base_ts=base_ts, max_ts=max_ts)
    )


def _seal_parts(
    body: _BodyWriter, options: _BatchOptions, *, n: int, attributes: int, base_ts: int, max_ts: int
) -> list[Any]:
    """Compress the body if asked, then prepend the header with both checksums."""
    if options.codec == f.COMPRESSION_NONE:
        region: list[Any] = [_ZEROS[:UNCOMPRESSED_BODY_PAD], *body.parts]
        region_size = UNCOMPRESSED_BODY_PAD + body.size
    else:
        if body.size > DEFAULT_MAX_UNCOMPRESSED_BYTES:
            # What a consumer decodes by default: a larger body compressed small (zeros)
            # made a batch every default consumer refused as corrupt (found by an audit).
            raise ConfigError(
                f"a batch body of {body.size} bytes exceeds the {DEFAULT_MAX_UNCOMPRESSED_BYTES}"
                "-byte limit even compressed (consumers refuse to inflate more)"
            )
        region = [_compress(options.codec, b"".join(body.parts))]
        region_size = len(region[0])
    total = f.BATCH_HEADER_SIZE + region_size
    if total > f.MAX_BATCH_BYTES:
        raise ConfigError(f"batch of {total} bytes exceeds the {f.MAX_BATCH_BYTES}-byte limit")
    header = bytearray(
        f.BATCH_HEADER.pack(
            0,  # base_offset: stamped by the broker
            total - f.LOG_OVERHEAD,
            -1,  # partition_leader_epoch: stamped by the broker
            f.BATCH_MAGIC,
            0,  # crc and header_crc: filled in below
            0,
            attributes,
            n - 1,
            base_ts,
            max_ts,
            options.producer_id,
            options.producer_epoch,
            options.base_sequence,
            n,
        )
    )
    # A running CRC over the parts avoids joining the body twice.
    crc = _crc32c.crc32c(header[f.BODY_CRC_START :])
    for part in region:
        crc = _crc32c.crc32c(part, crc)
    f.U32.pack_into(header, f.CRC_OFFSET, crc)
    f.U32.pack_into(header, f.HEADER_CRC_OFFSET, header_crc_of(header))
    return [bytes(header), *region]


def _compress(codec: int, plain: bytes) -> bytes:
    """One frame with its content size recorded, which the decoder requires."""
    if codec == f.COMPRESSION_ZSTD:
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(plain)
    return bytes(lz4.frame.compress(plain, store_size=True))


def _check_record_count(n: int) -> None:
    if n == 0:
        raise ConfigError("a batch needs at least one record")
    if n > f.INT32_MAX:
        raise ConfigError(f"a batch holds fewer than 2**31 records, got {n}")


def _check_int_range(name: str, value: int, bits: int) -> None:
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name} must be an int{bits} ({low}..{high}), got {value!r}")


def _sequence_length(items: object, name: str, expected: int | None = None) -> int:
    try:
        n = len(items)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{name} must be a sequence, got {type(items).__name__}") from None
    if expected is not None and n != expected:
        raise ConfigError(f"{name} has {n} items but there are {expected} values")
    return n


def _little_endian(numbers: array.array[int]) -> array.array[int]:
    """``numbers`` in wire byte order (a copy on big-endian hosts only)."""
    if _LITTLE_ENDIAN:
        return numbers
    swapped = array.array(numbers.typecode, numbers)
    swapped.byteswap()
    return swapped


def _validity_bitmap(present: bytes) -> bytes:
    """Arrow bitmap (bit i of the little-endian integer = item i) from 0/1 bytes."""
    digits = present.translate(_ZERO_ONE_TO_ASCII)[::-1]  # most significant item first
    return int(digits, 2).to_bytes((len(present) + 7) // 8, "little")


# --- encoding from Python ---------------------------------------------------------------------


def _any_present(items: Sequence[object]) -> bool:
    return any(map(operator.is_not, items, repeat(None)))


def _timestamps_from_python(
    n: int, timestamps_ms: Sequence[int] | None, base_timestamp_ms: int | None
) -> tuple[int, int, array.array[int] | None]:
    """(base, max, deltas or None when every record has the base timestamp)."""
    if timestamps_ms is None:
        base = _now_ms() if base_timestamp_ms is None else base_timestamp_ms
        _check_int_range("base_timestamp_ms", base, 64)
        return base, base, None
    _sequence_length(timestamps_ms, "timestamps_ms", n)
    if base_timestamp_ms is None:
        # The smallest, so that every delta is >= 0: the broker checks only a batch's
        # base and max timestamps against message.timestamp.before/after.max.ms, and with
        # the first record's as the base an older record after it passed unchecked
        # (found by an audit).
        try:
            base = min(timestamps_ms)
        except TypeError:
            raise ConfigError("timestamps_ms must hold ints") from None
        _check_int_range("the smallest of timestamps_ms", base, 64)
    else:
        base = base_timestamp_ms
        _check_int_range("base_timestamp_ms", base, 64)
    try:
        deltas = array.array("q", map(operator.sub, timestamps_ms, repeat(base)))
    except (TypeError, OverflowError) as exc:
        raise ConfigError(
            f"timestamps_ms must be ints within int64 of the base timestamp: {exc}"
        ) from None
    _check_int_range("smallest timestamp", base + min(deltas), 64)
    _check_int_range("largest timestamp", base + max(deltas), 64)
    return base, base + max(deltas), None if deltas.count(0) == n else deltas


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _write_python_column(
    body: _BodyWriter, items: Sequence[bytes | None], name: str, *, nullable: bool
) -> None:
    """validity (if nullable), offsets, data; nulls become zero-length slots."""
    present = bytes(map(operator.is_not, items, repeat(None)))
    if nullable:
        body.section(_validity_bitmap(present))
    elif present.count(0):
        raise ConfigError(f"{name} must not contain None")
    try:
        # length_hint is len() for bytes and 0 for None: the offsets in one C-level pass.
        offsets = array.array("i", accumulate(map(operator.length_hint, items), initial=0))
        data = b"".join(cast("Iterator[bytes]", compress(items, present)))  # Nones dropped
    except OverflowError:
        raise ConfigError(f"{name}: column data exceeds 2 GiB") from None
    except TypeError:
        raise ConfigError(f"{name} must hold bytes{' or None' if nullable else ''}") from None
    if len(data) != offsets[-1]:  # e.g. a memoryview of non-byte items: len != nbytes
        raise ConfigError(f"{name} must hold bytes{' or None' if nullable else ''}")
    body.section(_little_endian(offsets))
    body.section(data)


def check_headers(headers: Any) -> tuple[Header, ...]:
    """One record's headers as a tuple of (name, bytes | None) pairs, or ConfigError with
    the rule ``encode_batch`` would apply: (str name encodable as UTF-8, bytes-like or
    None value) pairs. For callers that queue a record and encode it later (the
    producer), so that a bad header is refused at the call instead of failing the batch
    it was put in. Values are copied to ``bytes`` here, as the producer copies a value
    and a key: a buffer the caller reuses after the call changed the header written, and
    a memoryview of wider items (``len`` counts items, not bytes) passed here and failed
    the whole batch in the encoder (found by an audit)."""
    try:
        pairs = tuple(headers)
    except TypeError:
        raise ConfigError("headers must be a sequence of (name, value) pairs") from None
    checked: list[Header] = []
    for pair in pairs:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise ConfigError("each header must be a (str name, bytes | None value) pair")
        name, value = pair
        try:
            name.encode()
        except (AttributeError, UnicodeEncodeError):
            raise ConfigError("header names must be str encodable as UTF-8") from None
        if value is not None and type(value) is not bytes:
            if not isinstance(value, bytes | bytearray | memoryview):
                raise ConfigError("header values must hold bytes or None")
            value = bytes(value)
        checked.append((name, value))
    return tuple(checked)


def _write_python_headers(body: _BodyWriter, headers: Sequence[Sequence[Header]]) -> bool:
    """Write the header-list section; False (nothing written) if no record has headers."""
    try:
        list_offsets = array.array("i", accumulate(map(len, headers), initial=0))
    except TypeError:
        raise ConfigError("headers must hold one sequence of (name, value) per record") from None
    if list_offsets[-1] == 0:
        return False
    entries = list(chain.from_iterable(headers))
    if not all(map(isinstance, entries, repeat((tuple, list)))) or set(map(len, entries)) != {2}:
        raise ConfigError("each header must be a (str name, bytes | None value) pair")
    try:
        names = list(map(str.encode, map(operator.itemgetter(0), entries)))
    except (TypeError, UnicodeEncodeError):
        raise ConfigError("header names must be str encodable as UTF-8") from None
    body.section(_little_endian(list_offsets))
    _write_python_column(body, names, "header names", nullable=False)
    header_values = list(map(operator.itemgetter(1), entries))
    _write_python_column(body, header_values, "header values", nullable=True)
    return True


# --- encoding from Arrow ----------------------------------------------------------------------


def _arrow() -> tuple[Any, Any]:
    """pyarrow and pyarrow.compute, imported on first use: pyarrow is optional."""
    try:
        import pyarrow as pa  # noqa: PLC0415
        import pyarrow.compute as pc  # noqa: PLC0415
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "Arrow support needs pyarrow: pip install 'tidelog[arrow]'", name=exc.name
        ) from exc
    if not _LITTLE_ENDIAN:
        raise ConfigError("Arrow views of batches need a little-endian host; use .records")
    return pa, pc


def _headers_type(pa: Any) -> Any:
    # Names are never null, but a nullable field spares users a cast of their arrays.
    entry = pa.struct([("key", pa.string()), ("value", pa.binary())])
    return pa.list_(entry)


def _arrow_input(array_like: Any, arrow_type: Any, name: str, expected: int | None = None) -> Any:
    """``array_like`` as a single pyarrow Array of ``arrow_type`` (cast if needed)."""
    pa, _ = _arrow()
    if isinstance(array_like, pa.ChunkedArray):
        array_like = array_like.combine_chunks()
    if not isinstance(array_like, pa.Array):
        raise ConfigError(
            f"{name} must be a pyarrow Array, got {type(array_like).__name__} "
            "(use encode_batch for Python sequences)"
        )
    if array_like.type != arrow_type:
        try:
            array_like = array_like.cast(arrow_type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            raise ConfigError(
                f"{name}: cannot use {array_like.type} as {arrow_type}: {exc}"
            ) from None
    if expected is not None and len(array_like) != expected:
        raise ConfigError(f"{name} has {len(array_like)} items but there are {expected} values")
    return array_like


def _epoch_ms(timestamps: Any) -> Any:
    """A timestamp or date array as milliseconds since the epoch; anything else as given.
    A plain cast to int64 keeps the array's own unit: a pandas datetime column (ns) was
    stored a million times too large (found by an audit). Sub-millisecond digits are
    dropped (record timestamps are milliseconds, as Kafka's)."""
    pa, _ = _arrow()
    if isinstance(timestamps, pa.ChunkedArray):
        timestamps = timestamps.combine_chunks()
    if not isinstance(timestamps, pa.Array):
        return timestamps  # refused by _arrow_input
    kind = timestamps.type
    if pa.types.is_duration(kind):
        raise ConfigError(f"timestamps_ms: {kind} is a duration, not a point in time")
    if pa.types.is_timestamp(kind) or pa.types.is_date(kind):
        tz = kind.tz if pa.types.is_timestamp(kind) else None
        # Unsafe casts only drop sub-millisecond digits (us, ns); from seconds (or days)
        # they wrapped on overflow: 2**62 s was stored as 0 ms (found by an audit).
        coarse = (pa.types.is_timestamp(kind) and kind.unit == "s") or pa.types.is_date(kind)
        try:
            as_ms = timestamps.cast(pa.timestamp("ms", tz=tz), safe=coarse)
        except pa.ArrowInvalid as exc:
            raise ConfigError(f"timestamps_ms: {exc}") from None
        return as_ms.cast(pa.int64())
    return timestamps


def _timestamps_from_arrow(
    n: int, timestamps_ms: Any, base_timestamp_ms: int | None
) -> tuple[int, int, Any]:
    """Like ``_timestamps_from_python``; deltas come back as a pyarrow Buffer."""
    if timestamps_ms is None:
        return _timestamps_from_python(n, None, base_timestamp_ms)
    pa, pc = _arrow()
    stamps = _arrow_input(_epoch_ms(timestamps_ms), pa.int64(), "timestamps_ms", n)
    if stamps.null_count:
        raise ConfigError("timestamps_ms must not contain nulls")
    # The smallest, as ``_timestamps_from_python``'s.
    base = pc.min(stamps).as_py() if base_timestamp_ms is None else base_timestamp_ms
    _check_int_range("base_timestamp_ms", base, 64)
    try:
        deltas = pc.subtract_checked(stamps, pa.scalar(base, pa.int64()))
    except pa.ArrowInvalid as exc:
        raise ConfigError(
            f"timestamps_ms must be within int64 of the base timestamp: {exc}"
        ) from None
    low, high = pc.min_max(deltas).values()
    if low.as_py() == high.as_py() == 0:
        return base, base, None
    return base, base + high.as_py(), deltas.buffers()[1].slice(deltas.offset * 8, n * 8)


def _write_arrow_column(body: _BodyWriter, column: Any, *, nullable: bool) -> None:
    """Write a binary/string Array's buffers, rebasing offsets if it is a slice."""
    pa, pc = _arrow()
    n = len(column)
    validity, offsets_buffer, data_buffer = column.buffers()
    if nullable:
        body.section(_arrow_validity_bitmap(validity, column.offset, n, column.null_count))
    offsets = pa.Array.from_buffers(pa.int32(), n + 1, [None, offsets_buffer], offset=column.offset)
    first, last = offsets[0].as_py(), offsets[n].as_py()
    if first:
        offsets = pc.subtract(offsets, pa.scalar(first, pa.int32()))
    body.section(offsets.buffers()[1].slice(offsets.offset * 4, (n + 1) * 4))
    body.section(data_buffer.slice(first, last - first) if last > first else b"")


def _write_arrow_headers(body: _BodyWriter, headers: Any) -> bool:
    """Write the header-list section; False (nothing written) if no record has headers.

    A null list counts as an empty one. List offsets are recomputed from the list
    lengths, which rebases a sliced array and drops entries hidden under null lists,
    exactly as ``flatten`` does for the entries themselves.
    """
    pa, pc = _arrow()
    entries = headers.flatten()
    if not len(entries):
        return False
    if entries.null_count:
        raise ConfigError("headers: a header entry is null; use an empty list instead")
    names = entries.field("key")
    if names.null_count:
        raise ConfigError("headers: header names must not be null")
    lengths = pc.fill_null(pc.list_value_length(headers), 0)
    ends = pc.cumulative_sum(lengths).cast(pa.int32())
    body.section(_I32_ZERO, ends.buffers()[1].slice(ends.offset * 4, len(headers) * 4))
    _write_arrow_column(body, names, nullable=False)
    _write_arrow_column(body, entries.field("value"), nullable=True)
    return True


def _arrow_validity_bitmap(bitmap: Any, bit_offset: int, n: int, null_count: int) -> bytes:
    """The canonical bitmap: shifted to bit 0, trailing bits zero, all ones if no nulls."""
    all_present = (1 << n) - 1
    if bitmap is None or null_count == 0:
        return all_present.to_bytes((n + 7) // 8, "little")
    # Only the bytes covering this slice's bits, so a small slice of a big array is cheap.
    covering = bitmap.slice(bit_offset // 8, (bit_offset % 8 + n + 7) // 8)
    bits = int.from_bytes(covering, "little") >> (bit_offset % 8)
    return (bits & all_present).to_bytes((n + 7) // 8, "little")


# --- decoding: structure -------------------------------------------------------------------------


def _parse_body(
    header: BatchHeader, batch: memoryview, position: int, max_uncompressed_bytes: int
) -> _Body:
    """Locate and validate every section of a CRC-verified batch's body."""
    where = f"batch at position {position}"
    if not 0 <= header.base_offset <= header.last_offset <= f.INT64_MAX:
        # The broker-owned fields are covered only by a CRC anyone can compute.
        raise CorruptBatchError(f"{where}: offsets {header.base_offset}.. do not fit in int64")
    region = batch[f.BATCH_HEADER_SIZE :]
    if header.compression == f.COMPRESSION_NONE:
        if region[:UNCOMPRESSED_BODY_PAD] != _ZEROS[:UNCOMPRESSED_BODY_PAD]:
            raise CorruptBatchError(f"{where}: missing or nonzero padding after the header")
        plain = region[UNCOMPRESSED_BODY_PAD:]
    else:
        plain = memoryview(_decompress(header.compression, region, max_uncompressed_bytes, where))
    reader = _BodyReader(plain, where)
    n = header.record_count

    deltas = timestamps_span = None
    if header.attributes & f.ATTR_HAS_TIMESTAMPS:
        deltas, timestamps_span = reader.numbers("q", n, "timestamp deltas")
    _check_timestamps(header, deltas, where)
    keys = reader.column(n, "key", nullable=True) if header.attributes & f.ATTR_HAS_KEYS else None
    values = reader.column(n, "value", nullable=True)
    headers = None
    if header.attributes & f.ATTR_HAS_HEADERS:
        list_offsets, list_span = reader.offsets(n, "header list")
        m = list_offsets[-1]
        names = reader.column(m, "header name", nullable=False)
        _check_utf8_names(plain, names, where)
        headers = _Headers(
            list_offsets, list_span, names, reader.column(m, "header value", nullable=True)
        )
    reader.finish()
    return _Body(plain, deltas, timestamps_span, keys, values, headers)


def _decompress(codec: int, region: memoryview, limit: int, where: str) -> bytes:
    """Exactly one frame, declared size within ``limit``, nothing after it."""
    try:
        if codec == f.COMPRESSION_ZSTD:
            size = zstandard.frame_content_size(region)
            _check_declared_size(size, limit, where)
            return zstandard.ZstdDecompressor().decompress(region, allow_extra_data=False)
        size = lz4.frame.get_frame_info(region)["content_size"]
        _check_declared_size(size or -1, limit, where)  # lz4 reports 0 for "not recorded"
        decompressor = lz4.frame.LZ4FrameDecompressor()
        plain = bytes(decompressor.decompress(region, max_length=size))
        if not decompressor.eof or decompressor.unused_data or len(plain) != size:
            raise CorruptBatchError(f"{where}: lz4 body is not exactly one frame of {size} bytes")
        return plain
    except (zstandard.ZstdError, RuntimeError) as exc:  # lz4 reports damage as RuntimeError
        raise CorruptBatchError(f"{where}: cannot decompress body: {exc}") from None


def _check_declared_size(size: int, limit: int, where: str) -> None:
    if size < 0:
        raise CorruptBatchError(f"{where}: compressed body does not declare its size")
    if size > limit:
        raise CorruptBatchError(
            f"{where}: body would decompress to {size} bytes, more than the {limit} allowed"
        )


def _check_utf8_names(plain: memoryview, names: _Column, where: str) -> None:
    """Every header name is valid UTF-8, checked without creating a str per name.

    UTF-8 is self-synchronising: if the concatenated names are valid UTF-8 and no name
    starts with a continuation byte (0b10xxxxxx), no character straddles two names, so
    each name is valid on its own.
    """
    data = bytes(plain[names.data.start : names.data.end])
    try:
        data.decode()
    except UnicodeDecodeError:
        raise CorruptBatchError(f"{where}: a header name is not valid UTF-8") from None
    starts = bytes(map(data.__getitem__, filter(len(data).__gt__, names.offsets)))
    if _CONTINUATION_BYTE.search(starts):
        raise CorruptBatchError(f"{where}: a header name is not valid UTF-8")


def _check_timestamps(header: BatchHeader, deltas: array.array[int] | None, where: str) -> None:
    """max_timestamp is honest and base + every delta fits in int64."""
    if header.attributes & f.ATTR_TIMESTAMP_LOG_APPEND:
        return  # every record's timestamp is the broker's append time, max_timestamp
    low, high = (min(deltas), max(deltas)) if deltas is not None else (0, 0)
    base = header.base_timestamp
    if not _INT64_MIN <= base + low <= base + high <= f.INT64_MAX:
        raise CorruptBatchError(f"{where}: a record timestamp overflows int64")
    if header.max_timestamp != base + high:
        raise CorruptBatchError(
            f"{where}: max_timestamp {header.max_timestamp} is not the largest record "
            f"timestamp {base + high}"
        )


class _BodyReader:
    """Walks the plain body section by section, bounds-checking before every slice."""

    __slots__ = ("body", "position", "where")

    def __init__(self, body: memoryview, where: str) -> None:
        self.body = body
        self.position = 0
        self.where = where

    def take(self, size: int, what: str) -> _Span:
        """The next section of ``size`` bytes; its padding must be present and zero."""
        end = self.position + size
        padded_end = end + (-size % ALIGNMENT)
        if padded_end > len(self.body):
            raise CorruptBatchError(
                f"{self.where}: {what} needs {size} bytes (plus padding) at body offset "
                f"{self.position}, the body has {len(self.body) - self.position} left"
            )
        if self.body[end:padded_end] != _ZEROS[: padded_end - end]:
            raise CorruptBatchError(f"{self.where}: nonzero padding after {what}")
        span = _Span(self.position, size)
        self.position = padded_end
        return span

    def numbers(self, typecode: str, n: int, what: str) -> tuple[array.array[int], _Span]:
        numbers = array.array(typecode)
        span = self.take(n * numbers.itemsize, what)
        numbers.frombytes(self.body[span.start : span.end])
        if not _LITTLE_ENDIAN:
            numbers.byteswap()
        return numbers, span

    def offsets(self, n: int, what: str) -> tuple[array.array[int], _Span]:
        """n+1 int32 offsets that start at 0 and never decrease."""
        offsets, span = self.numbers("i", n + 1, f"{what} offsets")
        if offsets[0] != 0:
            raise CorruptBatchError(f"{self.where}: {what} offsets start at {offsets[0]}, not 0")
        if not all(map(operator.le, offsets, islice(offsets, 1, None))):
            raise CorruptBatchError(f"{self.where}: {what} offsets decrease")
        return offsets, span

    def column(self, n: int, what: str, *, nullable: bool) -> _Column:
        validity = None
        if nullable:
            validity = self.take((n + 7) // 8, f"{what} validity")
            if n % 8 and self.body[validity.end - 1] >> (n % 8):
                raise CorruptBatchError(f"{self.where}: {what} validity has bits past item {n}")
        offsets, offsets_span = self.offsets(n, what)
        data = self.take(offsets[-1], f"{what} data")
        return _Column(n, validity, offsets, offsets_span, data)

    def finish(self) -> None:
        if self.position != len(self.body):
            raise CorruptBatchError(
                f"{self.where}: {len(self.body) - self.position} unexpected bytes after the "
                "last section of the body"
            )


# --- decoding: Python records ---------------------------------------------------------------


def _decode_records(header: BatchHeader, body: _Body) -> list[Record]:
    n = header.record_count
    base = header.base_offset
    return list(
        map(
            Record,
            range(base, base + n),
            _record_timestamps(header, body),
            repeat(None, n) if body.keys is None else _column_items(body.data, body.keys),
            _column_items(body.data, body.values),
            repeat((), n) if body.headers is None else _header_tuples(body.data, body.headers),
        )
    )


def _record_timestamps(header: BatchHeader, body: _Body) -> Iterable[int]:
    if header.attributes & f.ATTR_TIMESTAMP_LOG_APPEND:
        return repeat(header.max_timestamp, header.record_count)
    if body.timestamp_deltas is None:
        return repeat(header.base_timestamp, header.record_count)
    return map(operator.add, body.timestamp_deltas, repeat(header.base_timestamp))


def _column_slices(plain: memoryview, column: _Column) -> list[bytes]:
    data = bytes(plain[column.data.start : column.data.end])
    offsets = column.offsets
    return list(map(data.__getitem__, map(slice, offsets, islice(offsets, 1, None))))


def _column_items(plain: memoryview, column: _Column) -> list[bytes | None]:
    items: list[bytes | None] = list(_column_slices(plain, column))
    if column.validity is not None:
        for index in _null_positions(
            plain[column.validity.start : column.validity.end], len(items)
        ):
            items[index] = None
    return items


def _null_positions(bitmap: memoryview, n: int) -> Iterator[int]:
    """Indices of the zero bits among the first n bits (LSB first)."""
    bits = int.from_bytes(bitmap, "little")
    if bits == (1 << n) - 1:
        return iter(())
    digits = format(bits, f"0{n}b")[::-1]  # digits[i] is item i's bit
    return compress(count(), map("0".__eq__, digits))


def _header_tuples(plain: memoryview, headers: _Headers) -> list[tuple[Header, ...]]:
    names = list(map(bytes.decode, _column_slices(plain, headers.names)))  # UTF-8 checked
    entries = list(zip(names, _column_items(plain, headers.values), strict=True))
    bounds = headers.list_offsets
    per_record = map(entries.__getitem__, map(slice, bounds, islice(bounds, 1, None)))
    return list(map(tuple, per_record))


# --- decoding: Arrow -----------------------------------------------------------------------------


def _body_to_arrow(header: BatchHeader, body: _Body) -> Any:
    pa, pc = _arrow()
    n = header.record_count
    buffer = _aligned_buffer(pa, body.data)

    def section(span: _Span) -> Any:
        return buffer.slice(span.start, span.size)

    def binary(arrow_type: Any, column: _Column) -> Any:
        validity = None if column.validity is None else section(column.validity)
        buffers = [validity, section(column.offsets_span), section(column.data)]
        return pa.Array.from_buffers(arrow_type, column.length, buffers, null_count=-1)

    base = header.base_offset
    offsets = pa.Array.from_buffers(
        pa.int64(), n, [None, pa.py_buffer(_little_endian(array.array("q", range(base, base + n))))]
    )
    if header.attributes & f.ATTR_TIMESTAMP_LOG_APPEND:
        timestamps = pa.repeat(pa.scalar(header.max_timestamp, pa.int64()), n)
    elif body.timestamps_span is None:
        timestamps = pa.repeat(pa.scalar(header.base_timestamp, pa.int64()), n)
    else:
        deltas = pa.Array.from_buffers(pa.int64(), n, [None, section(body.timestamps_span)])
        timestamps = pc.add(deltas, pa.scalar(header.base_timestamp, pa.int64()))  # range checked
    keys = pa.nulls(n, pa.binary()) if body.keys is None else binary(pa.binary(), body.keys)
    values = binary(pa.binary(), body.values)
    headers_type = _headers_type(pa)
    if body.headers is None:
        list_offsets = pa.py_buffer(bytes(4 * (n + 1)))
        entries = pa.array([], type=headers_type.value_type)
    else:
        list_offsets = section(body.headers.list_offsets_span)
        entries = pa.StructArray.from_arrays(
            [binary(pa.string(), body.headers.names), binary(pa.binary(), body.headers.values)],
            fields=list(headers_type.value_type),
        )
    headers = pa.Array.from_buffers(headers_type, n, [None, list_offsets], children=[entries])
    batch = pa.RecordBatch.from_arrays(
        [offsets, timestamps, keys, values, headers], schema=arrow_schema()
    )
    # _parse_body checked everything already; this ~1 ms per 200k records guards the
    # guarantee that no malformed Arrow data ever reaches the caller.
    try:
        batch.validate(full=True)
    except pa.ArrowInvalid as exc:
        raise CorruptBatchError(f"batch at offset {base}: invalid record data: {exc}") from None
    return batch


def _aligned_buffer(pa: Any, plain: memoryview) -> Any:
    """``plain`` as a pyarrow Buffer, copied once into aligned memory if it is misaligned."""
    buffer = pa.py_buffer(plain)
    if buffer.address % ALIGNMENT == 0:
        return buffer
    copy = pa.allocate_buffer(len(plain))
    memoryview(copy).cast("B")[:] = plain
    return copy
