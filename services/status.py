"""The one mapping between tidelog errors and gRPC statuses, for servers and clients.

Convention (``protos/tidelog/v1/common.proto``): a unary call that fails as a whole ends
with a gRPC status code from ``STATUS_FOR_CODE``, a message for people, and the
``ErrorCode`` *name* in the trailing metadata key ``tidelog-error-code``. The status code
lets generic gRPC tooling react sensibly (retry UNAVAILABLE, give up on INVALID_ARGUMENT);
the metadata carries the precise, stable tidelog code the SDK turns back into an
exception. Multi-partition calls answer per partition with ``to_error_proto``.

Servers: raise a ``TidelogError`` inside a handler wrapped by ``unary_errors`` (or call
``abort`` directly). Clients: ``error_from_rpc_error(exc)`` turns any ``grpc.RpcError`` -
ours, or one made by gRPC itself such as DEADLINE_EXCEEDED - into a ``TidelogError``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, NoReturn, Protocol, TypeVar

import grpc
import structlog

from tidelog.client import bare_status_error
from tidelog.errors import (
    ErrorCode,
    TidelogError,
    UnknownServerError,
    error_for_code,
)
from tidelog.v1 import common_pb2

ERROR_CODE_METADATA_KEY: Final = "tidelog-error-code"

_S = grpc.StatusCode

STATUS_FOR_CODE: Final[Mapping[ErrorCode, grpc.StatusCode]] = {
    ErrorCode.NONE: _S.OK,
    ErrorCode.UNKNOWN_SERVER_ERROR: _S.INTERNAL,
    ErrorCode.OFFSET_OUT_OF_RANGE: _S.OUT_OF_RANGE,
    # A batch damaged in transit is the request's fault; resending an intact copy works.
    ErrorCode.CORRUPT_BATCH: _S.INVALID_ARGUMENT,
    ErrorCode.UNKNOWN_TOPIC_OR_PARTITION: _S.NOT_FOUND,
    ErrorCode.INVALID_FETCH_SIZE: _S.INVALID_ARGUMENT,
    ErrorCode.LEADER_NOT_AVAILABLE: _S.UNAVAILABLE,
    # Routing errors: the request is fine but this server is the wrong one (right now).
    ErrorCode.NOT_LEADER_OR_FOLLOWER: _S.FAILED_PRECONDITION,
    ErrorCode.REQUEST_TIMED_OUT: _S.DEADLINE_EXCEEDED,
    ErrorCode.BROKER_NOT_AVAILABLE: _S.UNAVAILABLE,
    ErrorCode.REPLICA_NOT_AVAILABLE: _S.UNAVAILABLE,
    ErrorCode.MESSAGE_TOO_LARGE: _S.INVALID_ARGUMENT,
    ErrorCode.STALE_CONTROLLER_EPOCH: _S.FAILED_PRECONDITION,
    ErrorCode.OFFSET_METADATA_TOO_LARGE: _S.INVALID_ARGUMENT,
    ErrorCode.NETWORK_EXCEPTION: _S.UNAVAILABLE,
    ErrorCode.INVALID_TOPIC: _S.INVALID_ARGUMENT,
    ErrorCode.RECORD_LIST_TOO_LARGE: _S.INVALID_ARGUMENT,
    # Not enough in-sync replicas is a transient state of the cluster, like a server outage.
    ErrorCode.NOT_ENOUGH_REPLICAS: _S.UNAVAILABLE,
    ErrorCode.NOT_ENOUGH_REPLICAS_AFTER_APPEND: _S.UNAVAILABLE,
    ErrorCode.INVALID_REQUIRED_ACKS: _S.INVALID_ARGUMENT,
    ErrorCode.INVALID_GROUP_ID: _S.INVALID_ARGUMENT,
    # Group membership: the member's view is out of date; it must join again.
    ErrorCode.ILLEGAL_GENERATION: _S.FAILED_PRECONDITION,
    ErrorCode.UNKNOWN_MEMBER_ID: _S.FAILED_PRECONDITION,
    ErrorCode.INVALID_SESSION_TIMEOUT: _S.INVALID_ARGUMENT,
    ErrorCode.REBALANCE_IN_PROGRESS: _S.ABORTED,
    ErrorCode.GROUP_MAX_SIZE_REACHED: _S.RESOURCE_EXHAUSTED,
    ErrorCode.FENCED_INSTANCE_ID: _S.FAILED_PRECONDITION,
    ErrorCode.MEMBER_ID_REQUIRED: _S.FAILED_PRECONDITION,
    ErrorCode.NON_EMPTY_GROUP: _S.FAILED_PRECONDITION,
    ErrorCode.GROUP_ID_NOT_FOUND: _S.NOT_FOUND,
    ErrorCode.INVALID_TIMESTAMP: _S.INVALID_ARGUMENT,
    ErrorCode.TOPIC_ALREADY_EXISTS: _S.ALREADY_EXISTS,
    ErrorCode.INVALID_PARTITIONS: _S.INVALID_ARGUMENT,
    ErrorCode.INVALID_REPLICATION_FACTOR: _S.INVALID_ARGUMENT,
    ErrorCode.INVALID_REPLICA_ASSIGNMENT: _S.INVALID_ARGUMENT,
    ErrorCode.INVALID_CONFIG: _S.INVALID_ARGUMENT,
    ErrorCode.NOT_CONTROLLER: _S.FAILED_PRECONDITION,
    ErrorCode.INVALID_REQUEST: _S.INVALID_ARGUMENT,
    ErrorCode.POLICY_VIOLATION: _S.FAILED_PRECONDITION,
    ErrorCode.OUT_OF_ORDER_SEQUENCE: _S.FAILED_PRECONDITION,
    ErrorCode.DUPLICATE_SEQUENCE: _S.ALREADY_EXISTS,
    ErrorCode.INVALID_PRODUCER_EPOCH: _S.FAILED_PRECONDITION,
    # Corruption found on disk is never served; gRPC's name for it is DATA_LOSS.
    ErrorCode.STORAGE_ERROR: _S.DATA_LOSS,
    ErrorCode.UNKNOWN_PRODUCER_ID: _S.FAILED_PRECONDITION,
    ErrorCode.FENCED_LEADER_EPOCH: _S.FAILED_PRECONDITION,
    ErrorCode.UNKNOWN_LEADER_EPOCH: _S.FAILED_PRECONDITION,
    ErrorCode.STALE_BROKER_EPOCH: _S.FAILED_PRECONDITION,
    ErrorCode.FETCH_SESSION_ID_NOT_FOUND: _S.NOT_FOUND,
    ErrorCode.INVALID_FETCH_SESSION_EPOCH: _S.FAILED_PRECONDITION,
    ErrorCode.OFFSET_NOT_AVAILABLE: _S.UNAVAILABLE,
    ErrorCode.INCONSISTENT_TOPIC_ID: _S.FAILED_PRECONDITION,
    ErrorCode.PREFERRED_LEADER_NOT_AVAILABLE: _S.UNAVAILABLE,
    ErrorCode.ELIGIBLE_LEADERS_NOT_AVAILABLE: _S.UNAVAILABLE,
    ErrorCode.ELECTION_NOT_NEEDED: _S.FAILED_PRECONDITION,
    ErrorCode.INVALID_RECORD: _S.INVALID_ARGUMENT,
    # A lost compare-and-swap is gRPC's ABORTED: "a concurrency conflict; retry higher up".
    ErrorCode.INVALID_UPDATE_VERSION: _S.ABORTED,
}

# Every code has a status, so adding an ErrorCode without deciding its status fails at import.
assert set(STATUS_FOR_CODE) == set(ErrorCode), set(ErrorCode) - set(STATUS_FOR_CODE)


def status_for(code: ErrorCode) -> grpc.StatusCode:
    """The gRPC status code that carries ``code``."""
    return STATUS_FOR_CODE[code]


def abort(context: grpc.ServicerContext, error: TidelogError) -> NoReturn:
    """End the current RPC with ``error``: its status, its message, its code in metadata.

    Raises (as ``context.abort`` does), so it must not be called inside a ``try`` that
    catches ``Exception``: gRPC's abort signal is a plain Exception.
    """
    context.set_trailing_metadata(((ERROR_CODE_METADATA_KEY, error.code.name),))
    context.abort(status_for(error.code), error.message)


def to_error_proto(exc: BaseException | None) -> common_pb2.Error:
    """A per-partition ``Error`` message: NONE for None, the code and message otherwise.

    Exceptions that are not TidelogErrors become UNKNOWN_SERVER_ERROR; their text is kept
    so the person reading the response can find the server log line.
    """
    if exc is None:
        return common_pb2.Error()
    # Enum fields accept the value's name; the names are identical by construction.
    if isinstance(exc, TidelogError):
        return common_pb2.Error(code=exc.code.name, message=exc.message)
    return common_pb2.Error(
        code=ErrorCode.UNKNOWN_SERVER_ERROR.name, message=f"{type(exc).__name__}: {exc}"
    )


class NamedPartition(Protocol):
    """An entry of a multi-partition request or its outcome: names one partition."""

    @property
    def topic(self) -> str: ...

    @property
    def partition(self) -> int: ...


def partition_results(
    items: Sequence[NamedPartition], outcomes: Sequence[BaseException | None]
) -> list[common_pb2.PartitionResult]:
    """One PartitionResult per item of a multi-partition request, with its outcome."""
    return [
        common_pb2.PartitionResult(
            topic=item.topic, partition=item.partition, error=to_error_proto(outcome)
        )
        for item, outcome in zip(items, outcomes, strict=True)
    ]


def error_from_proto(error: common_pb2.Error) -> TidelogError | None:
    """The exception a per-partition ``Error`` stands for, or None when it is NONE."""
    code = int(error.code)
    if code == ErrorCode.NONE:
        return None
    return error_for_code(code, error.message)


def error_code_from_metadata(metadata: Iterable[Any] | None) -> ErrorCode | None:
    """The tidelog code in trailing metadata (key/value pairs), if any."""
    if not metadata:
        return None
    for item in metadata:
        key, value = item[0], item[1]
        if key == ERROR_CODE_METADATA_KEY:
            name = value.decode() if isinstance(value, bytes) else str(value)
            try:
                return ErrorCode[name]
            except KeyError:
                return ErrorCode.UNKNOWN_SERVER_ERROR
    return None


def error_from_rpc_error(exc: grpc.RpcError) -> TidelogError:
    """The ``TidelogError`` a failed call stands for (client side).

    Uses the ``tidelog-error-code`` metadata when the server set it; otherwise derives a
    code from the bare status (a deadline gRPC enforced, a refused connection, ...).
    The original RpcError is chained as ``__cause__`` by callers that ``raise ... from``.
    """
    code_fn = getattr(exc, "code", None)
    status = code_fn() if callable(code_fn) else _S.UNKNOWN
    details_fn = getattr(exc, "details", None)
    details = (details_fn() if callable(details_fn) else None) or ""
    metadata_fn = getattr(exc, "trailing_metadata", None)
    metadata = metadata_fn() if callable(metadata_fn) else None
    code = error_code_from_metadata(metadata)
    if code is not None:
        return error_for_code(code, details)
    message = f"{status.name}: {details}" if details else status.name
    return bare_status_error(status, message, details)


_Self = TypeVar("_Self")
_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


def unary_errors(
    method: Callable[[_Self, _Request, grpc.ServicerContext], _Response],
) -> Callable[[_Self, _Request, grpc.ServicerContext], _Response]:
    """Decorate a unary servicer method so raised errors become proper statuses.

    A ``TidelogError`` aborts with its mapped status and code; any other exception is
    logged with its traceback and aborts INTERNAL / UNKNOWN_SERVER_ERROR instead of gRPC's
    opaque "Exception calling application". The wrapped method must not call
    ``context.abort`` itself; it raises instead.
    """

    @functools.wraps(method)
    def wrapper(self: _Self, request: _Request, context: grpc.ServicerContext) -> _Response:
        error: TidelogError
        try:
            return method(self, request, context)
        except TidelogError as exc:
            error = exc
        except Exception as exc:
            structlog.get_logger().exception("rpc_failed", method=method.__name__)
            error = UnknownServerError(f"{type(exc).__name__}: {exc}")
        # Outside the except blocks: abort raises, and must not be caught by them.
        abort(context, error)

    return wrapper
