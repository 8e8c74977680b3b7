"""Error codes are a stable contract: the Python enum mirrors the wire enum exactly."""

from __future__ import annotations

import pytest

from tidelog import errors
from tidelog.v1 import common_pb2


def test_python_codes_mirror_proto_enum() -> None:
    wire = {value.name: value.number for value in common_pb2.ErrorCode.DESCRIPTOR.values}
    python = {code.name: code.value for code in errors.ErrorCode}
    assert python == wire


@pytest.mark.parametrize("code", [c for c in errors.ErrorCode if c is not errors.ErrorCode.NONE])
def test_every_code_has_a_class_with_that_code(code: errors.ErrorCode) -> None:
    exc = errors.error_for_code(code, "why it failed")
    assert isinstance(exc, errors.TidelogError)
    assert exc.code is code
    assert exc.message == "why it failed"
    assert code.name in str(exc)


def test_unknown_code_becomes_unknown_server_error() -> None:
    exc = errors.error_for_code(12345, "strange")
    assert isinstance(exc, errors.UnknownServerError)


def test_retriable_flags() -> None:
    assert errors.NotLeaderOrFollowerError().retriable
    assert errors.NotEnoughReplicasError().retriable
    assert not errors.InvalidTopicError().retriable
    assert not errors.MessageTooLargeError().retriable
    assert not errors.ConfigError("bad").retriable
