"""Hostile-input fuzzing of tidelog's gRPC services: strategies and a generic caller.

Everything is derived from the protobuf descriptors, so a new RPC, message or field is
fuzzed without touching this module:

* ``all_methods()`` lists every method of ``tidelog.v1.Gateway``, ``Storage`` and
  ``Controller`` (with its streaming shape);
* ``message_strategy(descriptor, pools)`` builds random messages of any type, with
  adversarial values per field kind (strings from ``ADVERSARIAL_STRINGS`` and the
  cluster's real names, boundary ints, unknown enum numbers, random and damaged record
  batches in ``bytes`` fields);
* ``call(channel, method, requests, timeout_s)`` runs one call of any shape and returns
  the status, details, trailing metadata and responses (never raises ``RpcError``);
* ``error_codes(message)`` collects every ``tidelog.v1.Error`` code in a response, so a
  test can tell an accepted request from one refused item by item.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message as pb_message
from google.protobuf import message_factory
from hypothesis import strategies as st

from tidelog import formats
from tidelog.batch import crc32c
from tidelog.records import encode_batch
from tidelog.v1 import controller_pb2, gateway_pb2, storage_pb2

FieldDescriptor = pb_descriptor.FieldDescriptor

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

ADVERSARIAL_STRINGS: tuple[str, ...] = (
    "",
    ".",
    "..",
    "../x",
    "../../etc/passwd",
    "a/b",
    "a\\b",
    "a\x00b",
    "\x00",
    "x" * 249,
    "x" * 250,
    "y" * 10_000,
    "topic-ünïcødé",
    "тема",
    "名前",
    "emoji-\U0001f600",
    " ",
    "a b",
    "-",
    "_",
    "__consumer_offsets",
    "a\nb",
    "%s%n",
    "${jndi:ldap://x}",
    "DROP TABLE topics;",
)
"""Names that break the topic rule (1-249 of [a-zA-Z0-9._-], not "." or "..") or probe
for path, format-string and injection handling; "x" * 249 is the longest valid name."""

INT32_EDGES: tuple[int, ...] = (
    0,
    1,
    2,
    3,
    -1,
    -2,
    127,
    128,
    4000,
    4001,
    65_535,
    2**24,
    2**30,
    INT32_MAX - 1,
    INT32_MAX,
    INT32_MIN,
    INT32_MIN + 1,
)
INT64_EDGES: tuple[int, ...] = (
    *INT32_EDGES,
    2**31,
    2**32,
    2**53,
    2**62,
    INT64_MAX - 1,
    INT64_MAX,
    INT64_MIN,
    -(2**31) - 1,
)


def all_methods() -> list[pb_descriptor.MethodDescriptor]:
    """Every RPC of the three tidelog services, from their descriptors."""
    services = (
        gateway_pb2.DESCRIPTOR.services_by_name["Gateway"],
        storage_pb2.DESCRIPTOR.services_by_name["Storage"],
        controller_pb2.DESCRIPTOR.services_by_name["Controller"],
    )
    return [method for service in services for method in service.methods]


def method_path(method: pb_descriptor.MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def message_class(descriptor: pb_descriptor.Descriptor) -> type[pb_message.Message]:
    return message_factory.GetMessageClass(descriptor)


# --- record batches -------------------------------------------------------------------------


def _rewrite_header_crc(batch: bytearray) -> None:
    """Make the header checksum agree with a header we changed on purpose, so the server's
    length and count checks - not the checksum - are what must catch the lie."""
    crc = crc32c(memoryview(batch)[: formats.HEADER_CRC_OFFSET])
    formats.U32.pack_into(batch, formats.HEADER_CRC_OFFSET, crc)


def with_batch_length(batch: bytes, batch_length: int, *, fix_header_crc: bool = True) -> bytes:
    """``batch`` claiming ``batch_length`` bytes after the length field."""
    damaged = bytearray(batch)
    formats.I32.pack_into(damaged, formats.BATCH_LENGTH_OFFSET, batch_length)
    if fix_header_crc:
        _rewrite_header_crc(damaged)
    return bytes(damaged)


def with_flipped_byte(batch: bytes, position: int) -> bytes:
    damaged = bytearray(batch)
    damaged[position % len(damaged)] ^= 0xFF
    return bytes(damaged)


def with_record_count(batch: bytes, record_count: int) -> bytes:
    damaged = bytearray(batch)
    struct.pack_into("<i", damaged, formats.RECORD_COUNT_OFFSET, record_count)
    struct.pack_into("<i", damaged, formats.LAST_OFFSET_DELTA_OFFSET, record_count - 1)
    _rewrite_header_crc(damaged)
    return bytes(damaged)


def valid_batch(count: int = 1, value_bytes: int = 8, *, idempotent: bool = False) -> bytes:
    values = [bytes([65 + i % 26]) * value_bytes for i in range(count)]
    if idempotent:
        return encode_batch(values, producer_id=7, producer_epoch=0, base_sequence=0)
    return encode_batch(values)


def _damaged_batches(batch: bytes) -> list[bytes]:
    return [
        with_flipped_byte(batch, formats.CRC_OFFSET),  # body CRC
        with_flipped_byte(batch, formats.HEADER_CRC_OFFSET),  # header CRC
        with_flipped_byte(batch, len(batch) - 1),  # a body byte: body CRC mismatch
        with_flipped_byte(batch, formats.MAGIC_OFFSET),
        with_batch_length(batch, INT32_MAX),
        with_batch_length(batch, INT32_MAX, fix_header_crc=False),
        with_batch_length(batch, -1),
        with_batch_length(batch, INT32_MIN),
        with_batch_length(batch, 0),
        with_batch_length(batch, len(batch) - formats.LOG_OVERHEAD + 1),  # torn by one byte
        with_record_count(batch, INT32_MAX),
        with_record_count(batch, 0),
        with_record_count(batch, -5),
        batch[: formats.LOG_OVERHEAD],
        batch[:-1],
        batch + b"\x00" * 11,  # trailing bytes that are not a batch
        batch + batch[: formats.BATCH_HEADER_SIZE],  # a second, truncated batch
        batch + with_flipped_byte(batch, len(batch) - 1),  # one good, one bad: all refused
    ]


@st.composite
def records_strategy(draw: st.DrawFn) -> bytes:
    """``records`` payloads: valid batches, damaged copies of them, and noise."""
    batch = draw(
        st.sampled_from([valid_batch(), valid_batch(3, 100), valid_batch(1, 1, idempotent=True)])
    )
    return draw(
        st.one_of(
            st.just(batch),
            st.just(batch + batch),
            st.sampled_from(_damaged_batches(batch)),
            st.binary(max_size=256),
            st.just(b""),
        )
    )


# --- messages -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pools:
    """Real values of the running cluster, mixed into the random ones so that requests
    reach real partitions, groups and brokers (where the interesting code runs)."""

    strings: tuple[str, ...] = ()
    ints: tuple[int, ...] = ()
    # Per field name, extra values (e.g. "replica_id": the broker ids).
    by_field: dict[str, tuple[Any, ...]] = field(default_factory=dict)


def _string_strategy(pools: Pools) -> st.SearchStrategy[str]:
    options: list[st.SearchStrategy[str]] = [
        st.sampled_from(ADVERSARIAL_STRINGS),
        st.text(max_size=40),
    ]
    if pools.strings:
        options.insert(0, st.sampled_from(pools.strings))
    return st.one_of(*options)


def _int_strategy(lo: int, hi: int, edges: Sequence[int], pools: Pools) -> st.SearchStrategy[int]:
    values = [v for v in (*edges, *pools.ints) if lo <= v <= hi]
    return st.one_of(st.sampled_from(values), st.integers(lo, hi))


def _scalar_strategy(fd: pb_descriptor.FieldDescriptor, pools: Pools) -> st.SearchStrategy[Any]:
    extra = pools.by_field.get(fd.name)
    base = _base_scalar_strategy(fd, pools)
    if extra:
        return st.one_of(st.sampled_from(extra), base)
    return base


def _base_scalar_strategy(
    fd: pb_descriptor.FieldDescriptor, pools: Pools
) -> st.SearchStrategy[Any]:
    t = fd.type
    if t in (
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_SFIXED32,
    ):
        return _int_strategy(INT32_MIN, INT32_MAX, INT32_EDGES, pools)
    if t in (
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_SFIXED64,
    ):
        return _int_strategy(INT64_MIN, INT64_MAX, INT64_EDGES, pools)
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return _int_strategy(0, 2**32 - 1, INT32_EDGES, pools)
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return _int_strategy(0, 2**64 - 1, INT64_EDGES, pools)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if t == FieldDescriptor.TYPE_STRING:
        return _string_strategy(pools)
    if t == FieldDescriptor.TYPE_BYTES:
        return st.one_of(records_strategy(), st.binary(max_size=64))
    if t == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in fd.enum_type.values]
        # proto3 enums are open: numbers the server does not know must be refused too.
        return st.one_of(st.sampled_from(known), st.sampled_from([-1, 99, INT32_MAX, INT32_MIN]))
    raise NotImplementedError(f"no strategy for field {fd.full_name} of type {t}")


def message_strategy(
    descriptor: pb_descriptor.Descriptor, pools: Pools, depth: int = 0
) -> st.SearchStrategy[pb_message.Message]:
    """Random messages of type ``descriptor``: each field absent or set to a random value,
    repeated fields with 0-3 elements (nested messages down to depth 3)."""
    cls = message_class(descriptor)
    field_strategies: dict[str, st.SearchStrategy[Any]] = {}
    for fd in descriptor.fields:
        if fd.type == FieldDescriptor.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry:
            # A map field: a dict of 0-3 random keys and values.
            key_fd = fd.message_type.fields_by_name["key"]
            value_fd = fd.message_type.fields_by_name["value"]
            field_strategies[fd.name] = st.one_of(
                st.none(),
                st.dictionaries(
                    _scalar_strategy(key_fd, pools), _scalar_strategy(value_fd, pools), max_size=3
                ),
            )
            continue
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            if depth >= 3:
                continue
            value: st.SearchStrategy[Any] = st.deferred(
                lambda fd=fd: message_strategy(fd.message_type, pools, depth + 1)
            )
        else:
            value = _scalar_strategy(fd, pools)
        if fd.is_repeated:
            field_strategies[fd.name] = st.lists(value, max_size=3)
        else:
            field_strategies[fd.name] = st.one_of(st.none(), value)

    @st.composite
    def build(draw: st.DrawFn) -> pb_message.Message:
        kwargs = {}
        for name, strategy in field_strategies.items():
            drawn = draw(strategy, label=name)
            if drawn is not None and drawn not in ([], {}):
                kwargs[name] = drawn
        return cls(**kwargs)

    return build()


# --- calling ----------------------------------------------------------------------------------


@dataclass
class CallResult:
    """The outcome of one call, whatever its shape."""

    status: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, Any], ...]
    responses: list[pb_message.Message]

    def trailer(self, key: str) -> str | None:
        for name, value in self.trailing_metadata:
            if name == key:
                return value.decode() if isinstance(value, bytes) else str(value)
        return None


def _stub_callable(
    channel: grpc.Channel, method: pb_descriptor.MethodDescriptor
) -> Callable[..., Any]:
    path = method_path(method)
    response_cls = message_class(method.output_type)
    serializer = lambda m: m.SerializeToString()  # noqa: E731
    deserializer = response_cls.FromString
    if method.client_streaming and method.server_streaming:
        return channel.stream_stream(path, serializer, deserializer)
    if method.client_streaming:
        return channel.stream_unary(path, serializer, deserializer)
    if method.server_streaming:
        return channel.unary_stream(path, serializer, deserializer)
    return channel.unary_unary(path, serializer, deserializer)


def call(
    channel: grpc.Channel,
    method: pb_descriptor.MethodDescriptor,
    requests: Sequence[pb_message.Message],
    timeout_s: float,
    *,
    max_responses: int = 5,
) -> CallResult:
    """One call of ``method`` with ``requests`` (the first only, for unary requests).

    A server stream is read for at most ``max_responses`` messages, then cancelled (the
    result is then OK): a subscription never ends by itself.
    """
    stub = _stub_callable(channel, method)
    responses: list[pb_message.Message] = []
    rpc: Any = None
    try:
        if method.client_streaming:
            rpc = stub(iter(list(requests)), timeout=timeout_s)
        else:
            rpc = stub(requests[0], timeout=timeout_s)
        if method.server_streaming:
            for response in rpc:
                responses.append(response)
                if len(responses) >= max_responses:
                    rpc.cancel()
                    return CallResult(grpc.StatusCode.OK, "", (), responses)
            return CallResult(
                rpc.code(), rpc.details() or "", tuple(rpc.trailing_metadata() or ()), responses
            )
        return CallResult(grpc.StatusCode.OK, "", (), [rpc])
    except grpc.RpcError as exc:
        return CallResult(
            exc.code(),  # type: ignore[attr-defined]
            exc.details() or "",  # type: ignore[attr-defined]
            tuple(exc.trailing_metadata() or ()),  # type: ignore[attr-defined]
            responses,
        )


def error_codes(message: pb_message.Message) -> list[int]:
    """Every ``tidelog.v1.Error`` code inside ``message`` (depth first)."""
    found: list[int] = []

    def walk(m: pb_message.Message) -> None:
        if m.DESCRIPTOR.full_name == "tidelog.v1.Error":
            found.append(int(getattr(m, "code")))  # noqa: B009
            return
        for fd, value in m.ListFields():
            if fd.type != FieldDescriptor.TYPE_MESSAGE:
                continue
            for item in value if fd.is_repeated else [value]:
                walk(item)

    walk(message)
    return found


def iter_requests(method: pb_descriptor.MethodDescriptor, requests: Sequence[Any]) -> Iterator[Any]:
    yield from requests if method.client_streaming else requests[:1]
