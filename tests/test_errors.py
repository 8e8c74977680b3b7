"""Error codes are a stable contract: the Python enum mirrors the wire enum exactly."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from services.process import new_server
from services.status import error_from_rpc_error
from tidelog import errors
from tidelog.client import error_from_rpc
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


def test_a_busy_server_and_an_oversized_message_are_told_apart_by_the_sdk() -> None:
    """A tidelog server at its max_concurrent_rpcs answers a bare RESOURCE_EXHAUSTED: busy
    now, fine later, so the SDK's error is retriable (it used to say RECORD_LIST_TOO_LARGE,
    which is not, and a producer failed its records). gRPC's own message size limit says
    RESOURCE_EXHAUSTED too, and stays RECORD_LIST_TOO_LARGE. Real servers on loopback."""
    release = threading.Event()

    def slow(request: bytes, context: grpc.ServicerContext) -> bytes:
        release.wait(10)
        return b"ok"

    server = new_server(
        role="gateway", max_workers=4, max_message_bytes=1 << 10, max_concurrent_rpcs=1
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "t.T", {"M": grpc.unary_unary_rpc_method_handler(slow)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.T/M")
            first = call.future(b"a")
            time.sleep(0.3)  # the one admitted call is running
            with pytest.raises(grpc.RpcError) as busy:
                call(b"b", timeout=5)
            release.set()
            first.result(10)
            with pytest.raises(grpc.RpcError) as too_large:
                call(b"x" * (4 << 10), timeout=5)
    finally:
        release.set()
        server.stop(0)
    assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    busy_error = error_from_rpc(busy.value, "produce")
    assert isinstance(busy_error, errors.BrokerNotAvailableError) and busy_error.retriable
    assert isinstance(error_from_rpc_error(busy.value), errors.BrokerNotAvailableError)
    assert too_large.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    size_error = error_from_rpc(too_large.value, "produce")
    assert isinstance(size_error, errors.RecordListTooLargeError) and not size_error.retriable


def test_a_call_the_server_does_not_implement_says_the_address_may_be_wrong() -> None:
    """A client pointed at another kind of server (the CLI audit: a controller's address
    given as the gateway's) got "UNIMPLEMENTED: Method not found!" and no hint."""
    server = new_server(
        role="gateway", max_workers=2, max_message_bytes=1 << 10, max_concurrent_rpcs=4
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with (
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
            pytest.raises(grpc.RpcError) as missing,
        ):
            channel.unary_unary("/t.T/Nothing")(b"", timeout=5)
    finally:
        server.stop(0)
    error = error_from_rpc(missing.value, "list topics")
    assert isinstance(error, errors.InvalidRequestError) and not error.retriable
    assert "is the address a tidelog server of the right kind" in error.message
