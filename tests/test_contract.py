"""The public contract of DESIGN.md §6: names and call shapes that tests, tools and users
write against. Each check reads a signature, so a renamed parameter or a default that
changed fails here rather than in a user's code (a keyword call with the old name is a
TypeError)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tidelog
from services.controller.assignment import assign_replicas
from services.storage.log import Log, LogConfig
from tidelog import records
from tidelog.producer import RecordMetadata

_EMPTY = inspect.Parameter.empty
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def leading_parameters(function: Callable[..., Any]) -> list[tuple[str, Any]]:
    """The parameters a positional call can fill, in order, as (name, default), without
    ``self``."""
    return [
        (p.name, p.default)
        for p in inspect.signature(function).parameters.values()
        if p.kind in _POSITIONAL and p.name != "self"
    ]


def parameters(function: Callable[..., Any]) -> dict[str, Any]:
    """Every parameter by name, with its default."""
    return {p.name: p.default for p in inspect.signature(function).parameters.values()}


CONTRACT: list[tuple[str, Callable[..., Any], list[tuple[str, Any]]]] = [
    (
        "encode_batch",
        records.encode_batch,
        [
            ("values", _EMPTY),
            ("keys", None),
            ("headers", None),
            ("timestamps_ms", None),
            ("compression", "none"),
            ("producer_id", -1),
            ("producer_epoch", -1),
            ("base_sequence", -1),
        ],
    ),
    ("decode_batches", records.decode_batches, [("data", _EMPTY)]),
    ("Log.open", Log.open, [("path", _EMPTY), ("config", _EMPTY)]),
    ("Log.append", Log.append, [("batch", _EMPTY), ("leader_epoch", 0)]),
    (
        "Log.read",
        Log.read,
        [("offset", _EMPTY), ("max_bytes", _EMPTY), ("max_offset", None)],
    ),
    ("Log.truncate_to", Log.truncate_to, [("offset", _EMPTY)]),
    (
        "assign_replicas",
        assign_replicas,
        [
            ("broker_ids", _EMPTY),
            ("partitions", _EMPTY),
            ("replication_factor", _EMPTY),
            ("racks", None),
            ("seed", None),
        ],
    ),
    (
        "Producer.send",
        tidelog.Producer.send,
        [
            ("topic", _EMPTY),
            ("value", _EMPTY),
            ("key", None),
            ("partition", None),
            ("headers", None),
            ("timestamp_ms", None),
        ],
    ),
    (
        "Producer.send_batch",
        tidelog.Producer.send_batch,
        [("topic", _EMPTY), ("values", _EMPTY), ("keys", None), ("partition", None)],
    ),
    ("Consumer", tidelog.Consumer, [("gateway", None), ("group_id", None)]),
    ("Consumer.assign", tidelog.Consumer.assign, [("partitions", _EMPTY)]),
    ("Consumer.subscribe", tidelog.Consumer.subscribe, [("topics", _EMPTY)]),
    ("Consumer.seek", tidelog.Consumer.seek, [("tp", _EMPTY), ("offset", _EMPTY)]),
    ("Consumer.seek_to_beginning", tidelog.Consumer.seek_to_beginning, [("tps", None)]),
    ("Consumer.seek_to_end", tidelog.Consumer.seek_to_end, [("tps", None)]),
    ("Consumer.position", tidelog.Consumer.position, [("tp", _EMPTY)]),
    (
        "Admin.create_topic",
        tidelog.Admin.create_topic,
        [
            ("name", _EMPTY),
            ("partitions", _EMPTY),
            ("replication_factor", _EMPTY),
            ("config", None),
        ],
    ),
    ("Admin.delete_topic", tidelog.Admin.delete_topic, [("name", _EMPTY)]),
    ("Admin.describe_topic", tidelog.Admin.describe_topic, [("name", _EMPTY)]),
]


@pytest.mark.parametrize(
    ("function", "expected"), [(f, e) for _, f, e in CONTRACT], ids=[n for n, _, _ in CONTRACT]
)
def test_positional_parameters_are_the_contracts(
    function: Callable[..., Any], expected: list[tuple[str, Any]]
) -> None:
    """The names in order; a default where the contract gives one (a required parameter
    of the contract may have a default here)."""
    actual = leading_parameters(function)[: len(expected)]
    assert [name for name, _ in actual] == [name for name, _ in expected]
    for (name, default), (_, expected_default) in zip(actual, expected, strict=True):
        if expected_default is not _EMPTY:
            assert default == expected_default, name


def test_sdk_keyword_parameters_and_defaults() -> None:
    producer = parameters(tidelog.Producer)
    assert next(iter(producer)) == "gateway"
    assert producer["acks"] == "all"
    assert producer["enable_idempotence"] is True
    assert {"linger_ms", "batch_bytes"} <= producer.keys()
    poll = parameters(tidelog.Consumer.poll)
    assert {"max_records", "timeout_ms"} <= poll.keys()
    assert all(
        v is not _EMPTY for k, v in parameters(tidelog.Consumer.commit).items() if k != "self"
    )
    assert leading_parameters(tidelog.Admin)[:1] == [("gateway", None)]
    for method in ("flush", "close", "__enter__", "__exit__"):
        assert callable(getattr(tidelog.Producer, method))
    for method in ("list_topics", "describe_cluster"):
        assert callable(getattr(tidelog.Admin, method))


def test_record_types_have_the_contracts_fields() -> None:
    assert [f.name for f in dataclasses.fields(RecordMetadata)][:4] == [
        "topic",
        "partition",
        "offset",
        "timestamp_ms",
    ]
    batch = records.decode_batches(records.encode_batch([b"v"], [b"k"], [[("h", b"x")]]))[0]
    assert (batch.base_offset, batch.last_offset) == (0, 0)
    (record,) = batch.records
    assert (record.offset, record.key, record.value, list(record.headers)) == (
        0,
        b"k",
        b"v",
        [("h", b"x")],
    )
    assert isinstance(record.timestamp_ms, int)


def test_log_config_has_the_contracts_fields() -> None:
    names = {f.name for f in dataclasses.fields(LogConfig)}
    assert {
        "segment_bytes",
        "index_interval_bytes",
        "segment_ms",
        "segment_jitter_ms",
        "retention_bytes",
        "retention_ms",
        "flush_messages",
        "flush_ms",
        "max_message_bytes",
    } <= names


def test_log_append_returns_the_first_and_last_offsets_assigned(tmp_path: Path) -> None:
    """DESIGN.md section 6: ``append`` returns the first and last offsets assigned. It
    returned a tuple of four fields, which ``first, last = log.append(batch)`` refused
    (found by an audit); the named fields stay readable as attributes."""
    log = Log.open(tmp_path / "t-0", LogConfig())
    try:
        first, last = log.append(records.encode_batch([b"a", b"b"]))
        assert (first, last) == (0, 1)
        info = log.append(records.encode_batch([b"c"]), leader_epoch=0)
        assert (info.first_offset, info.last_offset, info.duplicate) == (2, 2, False)
    finally:
        log.close()
