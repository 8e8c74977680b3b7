"""tidelog.wire writes byte for byte what protobuf writes for the same message."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tidelog
from tidelog import wire
from tidelog.errors import ConfigError
from tidelog.v1 import common_pb2, gateway_pb2, storage_pb2

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
# Edge values first: 0 (left out), -1 (ten bytes), varint length boundaries.
EDGY_INT32 = st.sampled_from([0, 1, -1, 127, 128, 16_383, 16_384, 2**31 - 1, -(2**31)]) | INT32
EDGY_INT64 = st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63), 2**35]) | INT64
TEXT = st.text(max_size=20)
CHUNKS = st.lists(st.binary(max_size=300), max_size=4)
ACKS = st.sampled_from(list(common_pb2.Acks.values()))
CODES = st.sampled_from(list(common_pb2.ErrorCode.values()))


@settings(max_examples=300, deadline=None)
@given(
    acks=ACKS,
    timeout_ms=EDGY_INT32,
    partitions=st.lists(st.tuples(TEXT, EDGY_INT32, CHUNKS, TEXT), max_size=4),
    correlation_id=EDGY_INT64,
    client_id=TEXT,
)
def test_produce_request(
    acks: int,
    timeout_ms: int,
    partitions: list[tuple[str, int, list[bytes], str]],
    correlation_id: int,
    client_id: str,
) -> None:
    expected = gateway_pb2.ProduceRequest(
        acks=acks,  # type: ignore[arg-type]
        timeout_ms=timeout_ms,
        partitions=[
            gateway_pb2.ProducePartitionData(topic=t, partition=p, records=b"".join(c), topic_id=i)
            for t, p, c, i in partitions
        ],
        correlation_id=correlation_id,
        client_id=client_id,
    )
    encoded = wire.encode_produce_request(
        acks=acks,
        timeout_ms=timeout_ms,
        partitions=partitions,
        correlation_id=correlation_id,
        client_id=client_id,
    )
    assert encoded == expected.SerializeToString()


@settings(max_examples=300, deadline=None)
@given(
    topic=TEXT,
    partition=EDGY_INT32,
    records=st.binary(max_size=300),
    acks=ACKS,
    timeout_ms=EDGY_INT32,
    current_leader_epoch=st.none() | EDGY_INT32,
    correlation_id=EDGY_INT64,
    topic_id=TEXT,
)
def test_append_request(  # noqa: PLR0917 - one argument per field
    topic: str,
    partition: int,
    records: bytes,
    acks: int,
    timeout_ms: int,
    current_leader_epoch: int | None,
    correlation_id: int,
    topic_id: str,
) -> None:
    expected = storage_pb2.AppendRequest(
        topic=topic,
        partition=partition,
        records=records,
        acks=acks,  # type: ignore[arg-type]
        timeout_ms=timeout_ms,
        correlation_id=correlation_id,
        topic_id=topic_id,
    )
    if current_leader_epoch is not None:
        expected.current_leader_epoch = current_leader_epoch
    encoded = b"".join(
        wire.append_request_parts(
            topic=topic,
            partition=partition,
            batches=(memoryview(records[:3]), records[3:]),
            acks=acks,
            timeout_ms=timeout_ms,
            current_leader_epoch=current_leader_epoch,
            correlation_id=correlation_id,
            topic_id=topic_id,
        )
    )
    assert encoded == expected.SerializeToString()


@settings(max_examples=100, deadline=None)
@given(
    appends=st.lists(
        st.tuples(TEXT, EDGY_INT32, st.binary(max_size=100), ACKS, st.none() | EDGY_INT32),
        max_size=4,
    )
)
def test_append_many_request(appends: list[tuple[str, int, bytes, int, int | None]]) -> None:
    expected = storage_pb2.AppendManyRequest()
    for topic, partition, records, acks, epoch in appends:
        entry = expected.appends.add(
            topic=topic, partition=partition, records=records, acks=acks, timeout_ms=7
        )  # type: ignore[arg-type]
        if epoch is not None:
            entry.current_leader_epoch = epoch
    encoded = wire.encode_append_many_request(
        [
            wire.append_request_parts(
                topic=topic,
                partition=partition,
                batches=(records,),
                acks=acks,
                timeout_ms=7,
                current_leader_epoch=epoch,
            )
            for topic, partition, records, acks, epoch in appends
        ]
    )
    assert encoded == expected.SerializeToString()


RESULT = st.fixed_dictionaries(
    {
        "topic": TEXT,
        "partition": EDGY_INT32,
        "error_code": CODES,
        "error_message": TEXT,
        "high_watermark": EDGY_INT64,
        "log_start_offset": EDGY_INT64,
        "log_end_offset": EDGY_INT64,
        "records": st.binary(max_size=300),
        "leader_epoch": EDGY_INT32,
        "diverging_epoch": EDGY_INT32,
        "diverging_end_offset": EDGY_INT64,
    }
)


@settings(max_examples=300, deadline=None)
@given(results=st.lists(RESULT, max_size=4), throttle_time_ms=EDGY_INT32, session_id=EDGY_INT32)
def test_fetch_response(
    results: list[dict[str, object]], throttle_time_ms: int, session_id: int
) -> None:
    expected = storage_pb2.FetchResponse(
        throttle_time_ms=throttle_time_ms,
        session_id=session_id,
        partitions=[
            storage_pb2.FetchPartitionResult(
                error=common_pb2.Error(
                    code=r["error_code"],  # type: ignore[arg-type]
                    message=r["error_message"],  # type: ignore[arg-type]
                ),
                **{k: v for k, v in r.items() if not k.startswith("error")},  # type: ignore[arg-type]
            )
            for r in results
        ],
    )
    encoded = wire.encode_fetch_response(
        [wire.encode_fetch_partition_result(**r) for r in results],  # type: ignore[arg-type]
        throttle_time_ms,
        session_id,
    )
    assert encoded == expected.SerializeToString()
    # An empty error is still present, as the servers always set one.
    for result in storage_pb2.FetchResponse.FromString(encoded).partitions:
        assert result.HasField("error")


def test_int32_fields_out_of_range_are_refused_as_protobuf_does() -> None:
    """The hand encoders wrote an int32 field of 2**31 as a wider varint, which the
    receiver read as -2**31 (a producer's 2**31 ms timeout arrived negative, 2**32 + 5
    as 5 ms); they refuse it now, as protobuf's own encoder (found by an audit)."""
    with pytest.raises(ValueError):
        gateway_pb2.ProduceRequest(timeout_ms=2**31)
    for timeout_ms in (2**31, 2**32 + 5, -(2**31) - 1):
        with pytest.raises(ValueError, match="int32"):
            wire.encode_produce_request(
                acks=common_pb2.ALL, timeout_ms=timeout_ms, partitions=[],
                correlation_id=1, client_id="c",
            )  # fmt: skip
        with pytest.raises(ValueError, match="int32"):
            wire.append_request_parts(
                topic="t", partition=0, batches=[b"x"], acks=common_pb2.ALL,
                timeout_ms=timeout_ms, current_leader_epoch=None,
            )  # fmt: skip
    with pytest.raises(ConfigError, match="request_timeout_ms"):
        tidelog.Producer("127.0.0.1:1", request_timeout_ms=2**31)
