"""Tests of the record batch codec (tidelog.records): round trips, damage, hostile bodies."""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence
from typing import Any

import lz4.frame
import pyarrow as pa
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidelog import formats as f
from tidelog.batch import check_batch, crc32c, stamp
from tidelog.errors import ConfigError, CorruptBatchError
from tidelog.records import (
    RECORD_OVERHEAD_BYTES,
    Record,
    arrow_record_bytes,
    arrow_schema,
    batch_cuts,
    batch_overhead_bytes,
    batches_to_arrow,
    decode_batches,
    encode_batch,
    encode_batch_arrow,
    record_bytes,
)

CODECS = ["none", "zstd", "lz4"]
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
HEADERS_TYPE = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))

nullable_bytes = st.none() | st.binary(max_size=24)


@st.composite
def batch_args(draw: st.DrawFn) -> dict[str, Any]:
    """Keyword arguments for encode_batch, with a fixed base timestamp (deterministic)."""
    n = draw(st.integers(1, 20))
    header = st.tuples(st.text(max_size=6), nullable_bytes)
    return {
        "values": draw(st.lists(nullable_bytes, min_size=n, max_size=n)),
        "keys": draw(st.none() | st.lists(nullable_bytes, min_size=n, max_size=n)),
        "headers": draw(st.none() | st.lists(st.lists(header, max_size=3), min_size=n, max_size=n)),
        "timestamps_ms": draw(
            st.none() | st.lists(st.integers(-(2**40), 2**45), min_size=n, max_size=n)
        ),
        "compression": draw(st.sampled_from(CODECS)),
        "producer_id": draw(st.integers(-1, 2**63 - 1)),
        "producer_epoch": draw(st.integers(-1, 2**15 - 1)),
        "base_sequence": draw(st.integers(-1, 2**31 - 1)),
        "base_timestamp_ms": draw(st.integers(0, 2**45)),
    }


def expected_records(args: dict[str, Any], base_offset: int = 0) -> list[Record]:
    n = len(args["values"])
    timestamps = args["timestamps_ms"] or [args["base_timestamp_ms"]] * n
    keys = args["keys"] or [None] * n
    headers = args["headers"] or [[]] * n
    return [
        Record(base_offset + i, timestamps[i], keys[i], args["values"][i], tuple(headers[i]))
        for i in range(n)
    ]


def as_rows(records: Sequence[Record]) -> list[dict[str, Any]]:
    """Records in the shape of RecordBatch.to_arrow().to_pylist()."""
    return [
        {
            "offset": r.offset,
            "timestamp_ms": r.timestamp_ms,
            "key": r.key,
            "value": r.value,
            "headers": [{"key": k, "value": v} for k, v in r.headers],
        }
        for r in records
    ]


def padded_slice(array: pa.Array, arrow_type: pa.DataType, filler: Any) -> pa.Array:
    """``array`` as a slice of a bigger array, so offsets and bitmaps start mid-buffer."""
    items = [filler] * 3 + array.to_pylist() + [filler] * 2
    return pa.array(items, arrow_type).slice(3, len(array))


def reseal(batch: bytes | bytearray) -> bytes:
    """Fix batch_length and both checksums after tampering, as a hostile producer would."""
    buf = bytearray(batch)
    f.I32.pack_into(buf, f.BATCH_LENGTH_OFFSET, len(buf) - f.LOG_OVERHEAD)
    f.U32.pack_into(buf, f.CRC_OFFSET, crc32c(buf[f.BODY_CRC_START :]))
    f.U32.pack_into(buf, f.HEADER_CRC_OFFSET, crc32c(buf[: f.HEADER_CRC_OFFSET]))
    return bytes(buf)


def i32s(*numbers: int) -> bytes:
    return struct.pack(f"<{len(numbers)}i", *numbers)


def craft(
    n: int,
    sections: Sequence[bytes],
    *,
    attributes: int = 0,
    compression: str = "none",
    base_timestamp: int = 1000,
    max_timestamp: int | None = None,
) -> bytes:
    """A checksum-valid batch from hand-made body sections, each padded to 8."""
    plain = b"".join(s + bytes(-len(s) % 8) for s in sections)
    if compression == "zstd":
        region = zstandard.ZstdCompressor().compress(plain)
    elif compression == "lz4":
        region = lz4.frame.compress(plain)
    else:
        region = bytes(7) + plain
    return with_region(
        n, region, attributes | f.COMPRESSION_CODECS[compression], base_timestamp, max_timestamp
    )


def with_region(
    n: int,
    region: bytes,
    attributes: int = 0,
    base_timestamp: int = 1000,
    max_timestamp: int | None = None,
) -> bytes:
    """A checksum-valid batch whose bytes after the header are exactly ``region``."""
    max_ts = base_timestamp if max_timestamp is None else max_timestamp
    header = f.BATCH_HEADER.pack(
        0, 0, -1, f.BATCH_MAGIC, 0, 0, attributes, n - 1, base_timestamp, max_ts, -1, -1, -1, n
    )
    return reseal(header + region)


def value_column(*values: bytes | None) -> list[bytes]:
    """validity, offsets, data sections of a well-formed column."""
    bits = sum(1 << i for i, v in enumerate(values) if v is not None)
    ends = [0]
    for v in values:
        ends.append(ends[-1] + len(v or b""))
    data = b"".join(v or b"" for v in values)
    return [bits.to_bytes((len(values) + 7) // 8, "little"), i32s(*ends), data]


# --- round trips -------------------------------------------------------------------------------


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(batch_args())
def test_round_trip(args: dict[str, Any]) -> None:
    data = encode_batch(**args)
    [batch] = decode_batches(data)
    assert batch.records == expected_records(args)
    assert batch.record_count == len(args["values"])
    assert batch.last_offset == batch.record_count - 1
    assert (batch.base_offset, batch.partition_leader_epoch) == (0, -1)
    assert batch.producer_id == args["producer_id"]
    assert batch.producer_epoch == args["producer_epoch"]
    assert batch.base_sequence == args["base_sequence"]
    assert batch.max_timestamp == max(r.timestamp_ms for r in batch.records)
    assert batch.header.compression == f.COMPRESSION_CODECS[args["compression"]]
    assert batch.size_bytes == len(data)
    if args["compression"] == "none":
        assert len(data) % 8 == 0
    assert batch.to_arrow().to_pylist() == as_rows(batch.records)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(batch_args())
def test_arrow_encoding_matches_python_encoding(args: dict[str, Any]) -> None:
    """Same records, same bytes: from sliced Arrow arrays as from Python lists."""
    values = padded_slice(pa.array(args["values"], pa.binary()), pa.binary(), b"junk")
    keys = args["keys"] and padded_slice(pa.array(args["keys"]), pa.binary(), None)
    headers = args["headers"] and padded_slice(
        pa.array(args["headers"], HEADERS_TYPE), HEADERS_TYPE, [{"key": "junk", "value": b"x"}]
    )
    timestamps = args["timestamps_ms"] and padded_slice(
        pa.array(args["timestamps_ms"], pa.int64()), pa.int64(), 7
    )
    from_arrow = encode_batch_arrow(
        values,
        keys,
        headers,
        timestamps,
        compression=args["compression"],
        producer_id=args["producer_id"],
        producer_epoch=args["producer_epoch"],
        base_sequence=args["base_sequence"],
        base_timestamp_ms=args["base_timestamp_ms"],
    )
    assert from_arrow == encode_batch(**args)


@pytest.mark.parametrize("compression", CODECS)
def test_nulls_empties_and_unicode(compression: str) -> None:
    headers: list[list[tuple[str, bytes | None]]] = [
        [("ключ", b""), ("", None), ("🌊", b"\x00")],
        [],
        [("a", b"b")],
    ]
    data = encode_batch(
        [None, b"", b"v"],
        keys=[b"", None, b"k"],
        headers=headers,
        compression=compression,
        base_timestamp_ms=5,
    )
    [batch] = decode_batches(data)
    assert [(r.key, r.value, r.headers) for r in batch.records] == [
        (b"", None, tuple(headers[0])),
        (None, b"", ()),
        (b"k", b"v", (("a", b"b"),)),
    ]
    assert batch.to_arrow().to_pylist() == as_rows(batch.records)


def test_optional_sections_are_left_out() -> None:
    data = encode_batch([b"x"], keys=[None], headers=[[]], timestamps_ms=[9], base_timestamp_ms=9)
    header = check_batch(data)
    assert header.attributes == 0
    # header + pad + validity(8) + offsets(8) + data(8)
    assert len(data) == 72 + 24
    both = check_batch(
        encode_batch([b"x"], keys=[b"k"], headers=[[("h", None)]], timestamps_ms=[1])
    )
    assert both.attributes & f.ATTR_HAS_KEYS
    assert both.attributes & f.ATTR_HAS_HEADERS
    assert not both.attributes & f.ATTR_HAS_TIMESTAMPS  # one record: delta 0


def test_timestamps_default_to_now_and_base() -> None:
    [batch] = decode_batches(encode_batch([b"a", b"b"]))
    assert batch.records[0].timestamp_ms == batch.records[1].timestamp_ms == batch.base_timestamp
    assert batch.base_timestamp > 1_600_000_000_000
    [batch] = decode_batches(encode_batch([b"a", b"b"], timestamps_ms=[10, 4]))
    # The smallest is the base: base and max bound every record (the broker checks them).
    assert (batch.base_timestamp, batch.max_timestamp) == (4, 10)
    assert [r.timestamp_ms for r in batch.records] == [10, 4]


def test_extreme_timestamps() -> None:
    data = encode_batch([b"a", b"b"], timestamps_ms=[INT64_MAX, INT64_MAX - 5])
    [batch] = decode_batches(data)
    assert [r.timestamp_ms for r in batch.records] == [INT64_MAX, INT64_MAX - 5]
    assert batch.to_arrow().column("timestamp_ms").to_pylist() == [INT64_MAX, INT64_MAX - 5]
    with pytest.raises(ConfigError):
        encode_batch([b"a", b"b"], timestamps_ms=[INT64_MIN, INT64_MAX])


def test_concatenated_batches() -> None:
    parts = [
        encode_batch([b"a"], compression="zstd"),
        encode_batch([b"b", b"c"], keys=[b"k", None]),
        encode_batch([b"d", None, b"f"], compression="lz4", headers=[[("x", b"y")], [], []]),
    ]
    batches = decode_batches(b"".join(parts))
    assert [b.record_count for b in batches] == [1, 2, 3]
    assert [r.value for b in batches for r in b.records] == [b"a", b"b", b"c", b"d", None, b"f"]
    assert decode_batches(b"") == []
    table = batches_to_arrow(batches)
    assert table.schema == arrow_schema()
    assert table.column("value").to_pylist() == [b"a", b"b", b"c", b"d", None, b"f"]


def test_stamp_rewrites_broker_fields_and_batch_still_verifies() -> None:
    data = encode_batch([b"a", b"b", b"c"], producer_id=7, producer_epoch=1, base_sequence=0)
    log = bytearray(encode_batch([b"first"]) + data)
    position = len(log) - len(data)
    stamp(log, position, base_offset=1234, partition_leader_epoch=9)
    assert log[position + f.CRC_OFFSET : position + f.HEADER_CRC_OFFSET] == data[17:21]
    _, batch = decode_batches(log)
    assert (batch.base_offset, batch.last_offset, batch.partition_leader_epoch) == (1234, 1236, 9)
    assert [r.offset for r in batch.records] == [1234, 1235, 1236]
    assert batch.to_arrow().column("offset").to_pylist() == [1234, 1235, 1236]
    assert (batch.producer_id, batch.producer_epoch, batch.base_sequence) == (7, 1, 0)


# --- Arrow ---------------------------------------------------------------------------------------


def test_to_arrow_is_zero_copy_when_aligned_and_correct_when_not() -> None:
    data = encode_batch([b"hello", b"world"], keys=[b"k1", b"k2"], headers=[[("h", b"v")], []])
    base = pa.py_buffer(data).address
    assert base % 8 == 0  # CPython bytes payloads are 8-aligned
    [batch] = decode_batches(data)
    value_data = batch.to_arrow().column("value").buffers()[2]
    assert base <= value_data.address < base + len(data)

    shifted = memoryview(b"\x00" + data)[1:]  # the same batch at an odd address
    [batch] = decode_batches(shifted)
    table = batch.to_arrow()
    assert table.column("value").buffers()[1].address % 8 == 0  # copied into aligned memory
    assert table.column("value").to_pylist() == [b"hello", b"world"]


def test_arrow_inputs_of_other_types() -> None:
    values = pa.chunked_array(
        [pa.array([b"a"], pa.large_binary()), pa.array([None, b"c"], pa.large_binary())]
    )
    keys = pa.array(["k", None, "é"], pa.large_string())
    timestamps = pa.array([5, 6, 7], pa.timestamp("ms"))
    headers = pa.array(
        [[("x", b"1")], None, []],
        pa.large_list(pa.struct([("key", pa.large_string()), ("value", pa.large_binary())])),
    )
    data = encode_batch_arrow(values, keys, headers, timestamps)
    assert data == encode_batch(
        [b"a", None, b"c"], [b"k", None, "é".encode()], [[("x", b"1")], [], []], [5, 6, 7]
    )
    view = pa.array([b"p", b"q"], pa.binary_view())
    assert encode_batch_arrow(view, base_timestamp_ms=1) == encode_batch(
        [b"p", b"q"], base_timestamp_ms=1
    )


@pytest.mark.parametrize("unit", ["s", "ms", "us", "ns"])
def test_arrow_timestamps_of_any_unit_are_stored_in_milliseconds(unit: str) -> None:
    """Found by an audit: a timestamp array was cast straight to int64, keeping its own
    unit, so a pandas datetime column (ns) was stored a million times too large."""
    when_ms = 1_704_067_200_123
    stamps = pa.chunked_array(
        [
            pa.array([when_ms], pa.timestamp("ms", tz="UTC")).cast(
                pa.timestamp(unit, tz="UTC"), safe=False
            )
        ]
    )
    expected = when_ms if unit != "s" else when_ms // 1000 * 1000
    [batch] = decode_batches(encode_batch_arrow(pa.array([b"x"]), timestamps_ms=stamps))
    assert batch.records[0].timestamp_ms == expected
    days = pa.array([19723], pa.date32())  # 2024-01-01
    [batch] = decode_batches(encode_batch_arrow(pa.array([b"x"]), timestamps_ms=days))
    assert batch.records[0].timestamp_ms == 1_704_067_200_000
    with pytest.raises(ConfigError, match="duration"):
        encode_batch_arrow(pa.array([b"x"]), timestamps_ms=pa.array([5], pa.duration("ms")))


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
@pytest.mark.parametrize("batch_bytes", [4 << 20, 16 << 20])
def test_a_compressed_batch_of_random_bytes_within_the_estimate_fits_batch_bytes(
    compression: str, batch_bytes: int
) -> None:
    """Found by an audit: a fixed reserve for the batch's overhead ran out for compression
    frames of large batches (lz4 adds 4 bytes per 64 KiB block, zstd 3 per 128 KiB) on
    data that does not compress, so a batch the producer sized to fit exceeded batch_bytes
    and the topic's max.message.bytes (batch_bytes + 12 by default)."""
    budget = batch_bytes - batch_overhead_bytes(batch_bytes)
    value = random.Random(1).randbytes(budget - RECORD_OVERHEAD_BYTES)
    assert record_bytes(value) == budget
    [(start, stop, _)] = batch_cuts(pa.array([record_bytes(value)]), batch_bytes)
    assert (start, stop) == (0, 1)
    encoded = encode_batch([value], compression=compression, base_timestamp_ms=1)
    assert len(encoded) <= batch_bytes, len(encoded) - batch_bytes


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"values": [b"a"]}, "pyarrow Array"),
        ({"values": pa.array([], pa.binary())}, "at least one record"),
        ({"values": pa.array([b"a"]), "keys": pa.array([b"a", b"b"])}, "keys has 2 items"),
        ({"values": pa.array([1])}, "cannot use int64"),
        ({"values": pa.array([b"a"]), "timestamps_ms": pa.array([None], pa.int64())}, "nulls"),
        (
            {"values": pa.array([b"a"]), "headers": pa.array([[None]], HEADERS_TYPE)},
            "entry is null",
        ),
        (
            {"values": pa.array([b"a"]), "headers": pa.array([[(None, b"v")]], HEADERS_TYPE)},
            "names must not be null",
        ),
        ({"values": pa.array([b"a"]), "compression": "gzip"}, "unknown compression"),
    ],
)
def test_encode_batch_arrow_rejects_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        encode_batch_arrow(**kwargs)


# --- bad arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"values": []}, "at least one record"),
        ({"values": iter([b"a"])}, "values must be a sequence"),
        ({"values": [b"a", "text"]}, "values must hold bytes"),
        ({"values": [0]}, "values must hold bytes"),
        ({"values": [memoryview(b"abcd").cast("i")]}, "values must hold bytes"),
        ({"values": [b"a"], "keys": [b"a", b"b"]}, "keys has 2 items"),
        ({"values": [b"a"], "keys": [1]}, "keys must hold bytes"),
        ({"values": [b"a"], "headers": [[], []]}, "headers has 2 items"),
        ({"values": [b"a"], "headers": [[("k", b"v", b"x")]]}, "pair"),
        ({"values": [b"a"], "headers": [["kv"]]}, "pair"),
        ({"values": [b"a"], "headers": [{"k": b"v"}]}, "pair"),
        ({"values": [b"a"], "headers": [[(b"k", b"v")]]}, "names must be str"),
        ({"values": [b"a"], "headers": [[("\ud800", b"v")]]}, "names must be str"),
        ({"values": [b"a"], "headers": [[("k", "v")]]}, "header values must hold bytes"),
        ({"values": [b"a"], "headers": [None]}, "one sequence"),
        ({"values": [b"a"], "timestamps_ms": [1, 2]}, "timestamps_ms has 2 items"),
        ({"values": [b"a"], "timestamps_ms": [1.5]}, "smallest of timestamps_ms must be an int64"),
        ({"values": [b"a", b"b"], "timestamps_ms": [1, 1.5]}, "timestamps_ms must be ints"),
        ({"values": [b"a"], "timestamps_ms": [1 << 63]}, "timestamps_ms"),
        ({"values": [b"a"], "base_timestamp_ms": 1 << 63}, "base_timestamp_ms"),
        ({"values": [b"a"], "compression": "snappy"}, "unknown compression"),
        ({"values": [b"a"], "producer_id": 1 << 63}, "producer_id"),
        ({"values": [b"a"], "producer_epoch": 1 << 15}, "producer_epoch"),
        ({"values": [b"a"], "base_sequence": -(1 << 31) - 1}, "base_sequence"),
    ],
)
def test_encode_batch_rejects_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        encode_batch(**kwargs)


# --- damage ------------------------------------------------------------------------------------


def small_batch(compression: str) -> bytes:
    return encode_batch(
        [b"v1", None, b"value-3"],
        keys=[b"k", None, b""],
        headers=[[("h", b"x")], [], [("é", None)]],
        timestamps_ms=[100, 90, 120],
        compression=compression,
        producer_id=5,
        producer_epoch=0,
        base_sequence=10,
    )


@pytest.mark.parametrize("compression", CODECS)
def test_every_single_bit_flip_is_detected(compression: str) -> None:
    data = small_batch(compression)
    decode_batches(data)
    for index in range(len(data)):
        for bit in range(8):
            damaged = bytearray(data)
            damaged[index] ^= 1 << bit
            with pytest.raises(CorruptBatchError):
                decode_batches(damaged)


@pytest.mark.parametrize("compression", CODECS)
def test_every_truncation_is_detected(compression: str) -> None:
    first = encode_batch([b"first"])
    data = first + small_batch(compression)
    for length in range(1, len(data)):
        if length == len(first):
            continue  # a whole first batch, legitimately
        with pytest.raises(CorruptBatchError):
            decode_batches(data[:length])


def test_craft_helper_matches_encoder() -> None:
    """The hand-made batches below are only meaningful if the helper speaks the format."""
    crafted = craft(2, value_column(b"ab", None), base_timestamp=7)
    assert crafted == encode_batch([b"ab", None], base_timestamp_ms=7)
    assert craft(1, value_column(b"x"), compression="zstd", base_timestamp=7) == encode_batch(
        [b"x"], compression="zstd", base_timestamp_ms=7
    )


K, T, H = f.ATTR_HAS_KEYS, f.ATTR_HAS_TIMESTAMPS, f.ATTR_HAS_HEADERS
GOOD_VALUES = value_column(b"ab", b"c")  # n = 2


def header_sections(list_ends: list[int], name_ends: list[int], names: bytes) -> list[bytes]:
    m = len(name_ends) - 1
    return [i32s(*list_ends), i32s(*name_ends), names, *value_column(*[b"v"] * m)]


MALFORMED: dict[str, bytes] = {
    "offsets do not start at 0": craft(2, [b"\x03", i32s(1, 2, 3), b"abc"]),
    "offsets decrease": craft(2, [b"\x03", i32s(0, 3, 1), b"a"]),
    "offsets run past the body": craft(2, [b"\x03", i32s(0, 1, 500), b"abc"]),
    "negative data length": craft(2, [b"\x03", i32s(0, 0, -8), b""]),
    "trailing bytes": craft(2, [*GOOD_VALUES, bytes(8)]),
    "nonzero padding": with_region(
        2, bytes(7) + b"\x03" + bytes(7) + i32s(0, 2, 3) + bytes(4) + b"abc\x00\x00\x00\x00\x01"
    ),
    "bitmap bits past the end": craft(2, [b"\x07", *GOOD_VALUES[1:]]),
    "record count beyond the sections": craft(1000, GOOD_VALUES),
    "keys attribute without a key column": craft(2, GOOD_VALUES, attributes=K),
    "empty body": craft(2, []),
    "timestamps section missing a delta": craft(
        2, [struct.pack("<q", 0), *GOOD_VALUES], attributes=T
    ),
    "max_timestamp lies": craft(
        2, [struct.pack("<2q", 0, 5), *GOOD_VALUES], attributes=T, max_timestamp=1000
    ),
    "max_timestamp lies without deltas": craft(2, GOOD_VALUES, max_timestamp=1001),
    "timestamp overflows int64": craft(
        2,
        [struct.pack("<2q", 0, 1), *GOOD_VALUES],
        attributes=T,
        base_timestamp=INT64_MAX,
        max_timestamp=INT64_MIN,
    ),
    "header list offsets decrease": craft(
        2, [*GOOD_VALUES, *header_sections([0, 2, 1], [0, 1], b"a")], attributes=H
    ),
    "header lists claim more entries than exist": craft(
        2, [*GOOD_VALUES, *header_sections([0, 1, 9], [0, 1], b"a")], attributes=H
    ),
    "header name is not UTF-8": craft(
        2, [*GOOD_VALUES, *header_sections([0, 1, 1], [0, 1], b"\xff")], attributes=H
    ),
    "header names split a character": craft(
        2, [*GOOD_VALUES, *header_sections([0, 1, 2], [0, 1, 2], "é".encode())], attributes=H
    ),
    "zstd codec, garbage body": with_region(2, b"\x01" * 40, f.COMPRESSION_ZSTD),
    "zstd frame with trailing bytes": reseal(
        craft(2, GOOD_VALUES, compression="zstd") + b"\x00" * 8
    ),
    "zstd frame without content size": with_region(
        2,
        zstandard.ZstdCompressor(write_content_size=False).compress(b"".join(GOOD_VALUES)),
        f.COMPRESSION_ZSTD,
    ),
    "zstd frame of a malformed body": craft(2, [b"\x03", i32s(0, 3, 1), b"a"], compression="zstd"),
    "lz4 codec, garbage body": with_region(2, b"\x02" * 40, f.COMPRESSION_LZ4),
    "lz4 frame with trailing bytes": reseal(craft(2, GOOD_VALUES, compression="lz4") + b"\x00"),
    "lz4 frame without content size": with_region(
        2, lz4.frame.compress(b"".join(GOOD_VALUES), store_size=False), f.COMPRESSION_LZ4
    ),
    "lz4 frame of a malformed body": craft(2, [b"\x03", i32s(1, 2, 3), b"a"], compression="lz4"),
    "no header padding": with_region(2, bytes(5)),
    "nonzero header padding": with_region(2, b"\x01" * 7 + b"".join(GOOD_VALUES)),
    "values padded but header padding missing": with_region(
        2, b"".join(s + bytes(-len(s) % 8) for s in GOOD_VALUES)
    ),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_checksum_valid_but_malformed_bodies_are_rejected(name: str) -> None:
    data = MALFORMED[name]
    check_batch(data)  # both CRCs are valid: only the body checks can catch it
    with pytest.raises(CorruptBatchError):
        decode_batches(data)


def test_negative_base_offset_is_rejected() -> None:
    buf = bytearray(encode_batch([b"a"]))
    stamp(buf, 0, base_offset=-5, partition_leader_epoch=0)
    with pytest.raises(CorruptBatchError, match="offsets"):
        decode_batches(buf)
    stamp(buf, 0, base_offset=INT64_MAX, partition_leader_epoch=0)
    decode_batches(buf)  # last offset = base offset: still fits


def test_decompression_limit() -> None:
    data = encode_batch([bytes(100_000)], compression="zstd")
    assert len(decode_batches(data)[0].records[0].value or b"") == 100_000
    with pytest.raises(CorruptBatchError, match="decompress to"):
        decode_batches(data, max_uncompressed_bytes=50_000)
    data = encode_batch([bytes(100_000)], compression="lz4")
    with pytest.raises(CorruptBatchError, match="decompress to"):
        decode_batches(data, max_uncompressed_bytes=50_000)


def test_log_append_time_gives_every_record_max_timestamp() -> None:
    data = craft(
        2,
        [struct.pack("<2q", 0, 5), *GOOD_VALUES],
        attributes=T | f.ATTR_TIMESTAMP_LOG_APPEND,
        max_timestamp=777,
    )
    [batch] = decode_batches(data)
    assert [r.timestamp_ms for r in batch.records] == [777, 777]
    assert batch.to_arrow().column("timestamp_ms").to_pylist() == [777, 777]


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch_args(),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    st.data(),
)
def test_hostile_bodies_never_escape_as_other_errors(
    args: dict[str, Any], edits: list[tuple[int, int]], data: st.DataObject
) -> None:
    """Any checksum-valid tampering with a body: a consistent batch or CorruptBatchError."""
    compression = args.pop("compression")
    original = encode_batch(**args)
    header, plain = bytearray(original[:65]), bytearray(original[72:])
    for position, byte in edits:
        plain[position % len(plain)] = byte
    if data.draw(st.booleans()):  # also tamper with the header fields that describe the body
        f.I16.pack_into(header, f.ATTRIBUTES_OFFSET, data.draw(st.integers(0, 0x7F)) & ~0x07)
        count = data.draw(st.integers(1, 64))
        f.I32.pack_into(header, f.RECORD_COUNT_OFFSET, count)
        f.I32.pack_into(header, f.LAST_OFFSET_DELTA_OFFSET, count - 1)
    attributes = f.I16.unpack_from(header, f.ATTRIBUTES_OFFSET)[0]
    f.I16.pack_into(header, f.ATTRIBUTES_OFFSET, attributes | f.COMPRESSION_CODECS[compression])
    if compression == "zstd":
        region = zstandard.ZstdCompressor().compress(bytes(plain))
    elif compression == "lz4":
        region = lz4.frame.compress(bytes(plain))
    else:
        region = bytes(7) + plain
    try:
        [batch] = decode_batches(reseal(header + region))
    except CorruptBatchError:
        return
    assert batch.to_arrow().to_pylist() == as_rows(batch.records)


@pytest.mark.parametrize("seed", range(6))
def test_batches_cut_by_record_bytes_stay_within_the_batch_size(seed: int) -> None:
    """``record_bytes`` / ``arrow_record_bytes`` are upper bounds of what a record adds to
    a batch, so runs cut by ``batch_cuts`` encode to at most the batch size whatever the
    skew of values, keys and headers (one large header among small rows used to be
    counted at the column's average, and the batch passed max.message.bytes)."""
    rng = random.Random(seed)
    n = 400
    sizes = [rng.choice([0, 3, 50, 2_000, 20_000]) for _ in range(n)]
    values = pa.array([None if s == 0 else rng.randbytes(s) for s in sizes], pa.binary())
    keys = pa.array([rng.choice([None, b"k", rng.randbytes(300)]) for _ in range(n)], pa.binary())
    headers = pa.array(
        [
            None
            if rng.random() < 0.3
            else [
                (
                    "h" * rng.randrange(1, 20),
                    rng.choice([None, rng.randbytes(rng.choice([1, 5_000]))]),
                )
                for _ in range(rng.randrange(0, 4))
            ]
            for _ in range(n)
        ],
        HEADERS_TYPE,
    )
    start, stop = rng.randrange(0, 50), n - rng.randrange(0, 50)
    values, keys, headers = (a.slice(start, stop - start) for a in (values, keys, headers))
    per_row = arrow_record_bytes(values, keys, headers).to_pylist()
    for i in range(len(values)):  # the Arrow sizes bound the per-record rule
        listed = [(h["key"], h["value"]) for h in headers[i].as_py() or ()]
        assert per_row[i] >= record_bytes(values[i].as_py(), keys[i].as_py(), listed or None)
    batch_bytes = 64 * 1024
    for first, end, _ in batch_cuts(arrow_record_bytes(values, keys, headers), batch_bytes):
        count = end - first
        encoded = encode_batch_arrow(
            values.slice(first, count), keys.slice(first, count), headers.slice(first, count)
        )
        assert count == 1 or len(encoded) <= batch_bytes, (first, end, len(encoded))


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_a_compressed_batch_larger_inflated_than_consumers_take_is_refused(
    compression: str,
) -> None:
    """A body over DEFAULT_MAX_UNCOMPRESSED_BYTES compresses small (zeros: ~32,000:1 with
    zstd), passed the broker, and every consumer with the default limit refused the batch
    as corrupt; the encoder refuses it now, as it refuses an uncompressed batch over
    MAX_BATCH_BYTES (found by an audit). The zero pages are never touched."""
    value = bytes(1 << 30)  # as key and value: 2 GiB + 32 bytes of plain body
    with pytest.raises(ConfigError, match="even compressed"):
        encode_batch([value], [value], compression=compression, base_timestamp_ms=0)


def test_arrow_timestamps_in_seconds_past_int64_milliseconds_are_refused() -> None:
    """timestamp('s') values beyond int64 milliseconds wrapped in the cast (2**62 s was
    stored as 0 ms); refused now, as int64 input out of range is (found by an audit)."""
    stamps = pa.array([2**62, 2**62 + 1], pa.timestamp("s"))
    with pytest.raises(ConfigError, match="timestamps_ms"):
        encode_batch_arrow(pa.array([b"a", b"b"]), timestamps_ms=stamps)
    fine = pa.array([1_700_000_000, 1_700_000_001], pa.timestamp("s"))
    batch = encode_batch_arrow(pa.array([b"a", b"b"]), timestamps_ms=fine)
    assert [r.timestamp_ms for r in decode_batches(batch)[0].records] == [
        1_700_000_000_000,
        1_700_000_001_000,
    ]
