"""Calls from the gateway to the active controller, and producer ids handed out from blocks.

The active controller's address is the ``controller`` election key, which the metadata
cache watches. A call that reaches a standby (NOT_CONTROLLER) or no one (the controller
just died) waits for the key to change and tries again until its deadline, so admin calls
ride through a controller fail-over. Admin requests are safe to resend: creating an
existing topic answers TOPIC_ALREADY_EXISTS, deleting a missing one
UNKNOWN_TOPIC_OR_PARTITION, and the caller sees that answer.

``ProducerIds`` serves InitProducerId: it takes a block of ids from the controller
(AllocateProducerIds with broker_id -1) and hands them out one by one; ids are unique
cluster-wide because blocks are (the controller advances ``producer_ids`` in etcd with a
compare-and-swap). Ids left in a block when the gateway stops are never used, which is
fine: there are 2^63 of them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Final, TypeVar

import grpc

from services.gateway.channels import Channels
from services.gateway.metadata_cache import MetadataCache
from services.gateway.router import DEADLINE_MARGIN_S
from services.status import error_from_proto, error_from_rpc_error
from tidelog.errors import (
    ErrorCode,
    RequestTimedOutError,
    TidelogError,
)
from tidelog.v1 import controller_pb2, controller_pb2_grpc

R = TypeVar("R")

RETRY_CODES: Final = frozenset(
    {ErrorCode.NOT_CONTROLLER, ErrorCode.NETWORK_EXCEPTION, ErrorCode.BROKER_NOT_AVAILABLE}
)
RETRY_WAIT_S: Final = 0.2


class ControllerClient:
    """Sends requests to whichever controller is active. Thread-safe."""

    def __init__(self, cache: MetadataCache, channels: Channels) -> None:
        self._cache = cache
        self._channels = channels

    def call(
        self,
        timeout_s: float,
        fn: Callable[[controller_pb2_grpc.ControllerStub, float], R],
    ) -> R:
        """``fn(stub, remaining_s)`` on the active controller, retried across fail-overs."""
        deadline = time.monotonic() + timeout_s
        last: TidelogError | None = None  # why the latest try failed
        first = True
        while True:
            version = self._cache.version
            remaining_s = deadline - time.monotonic()
            if remaining_s <= DEADLINE_MARGIN_S:
                # Every retried failure means the same to the caller: no controller took
                # the request in time (gRPC's own "failed to connect to all addresses"
                # says less). Out of time before the first try, the time given was the
                # reason: it read "no controller is active" to a client whose timeout
                # was 50 ms.
                if first:
                    raise RequestTimedOutError(
                        f"a timeout of {timeout_s * 1000:.0f} ms is too short to reach the "
                        f"controller (it takes more than {DEADLINE_MARGIN_S * 1000:.0f} ms)"
                    )
                raise RequestTimedOutError(
                    f"no active controller answered in time: {last or 'none is active'}"
                )
            first = False
            controller = self._cache.read(lambda view: view.controller)
            if controller is not None:
                try:
                    return fn(self._channels.controller(controller.address), remaining_s)
                except grpc.RpcError as exc:
                    error = error_from_rpc_error(exc)
                    if error.code not in RETRY_CODES:
                        raise error from None
                    last = error
            self._cache.wait_for_change(version, min(RETRY_WAIT_S, remaining_s))


class ProducerIds:
    """Producer ids for InitProducerId, from controller blocks. Thread-safe."""

    def __init__(self, controller: ControllerClient, timeout_s: float = 10.0) -> None:
        self._controller = controller
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._next = 0
        self._end = 0

    def next_id(self, timeout_s: float | None = None) -> int:
        """The next id; a new block from the controller when this one is used up. Waits
        at most ``timeout_s`` (the caller's deadline; at most the configured timeout) in
        all, for another caller's block request included: callers used to queue on it
        without a deadline, the k-th for k controller timeouts while the controller was
        down, each holding a server thread long after its client had given up."""
        timeout_s = min(self._timeout_s, self._timeout_s if timeout_s is None else timeout_s)
        deadline = time.monotonic() + timeout_s
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            raise RequestTimedOutError(
                "no producer id within the deadline: the controller has not answered "
                "another InitProducerId's request for a block yet"
            )
        try:
            if self._next >= self._end:
                response = self._controller.call(
                    max(0.0, deadline - time.monotonic()),
                    lambda stub, t: stub.AllocateProducerIds(
                        controller_pb2.AllocateProducerIdsRequest(broker_id=-1), timeout=t
                    ),
                )
                error = error_from_proto(response.error)
                if error is not None:
                    raise error
                self._next = response.producer_id_start
                self._end = response.producer_id_start + response.producer_id_len
            producer_id = self._next
            self._next += 1
            return producer_id
        finally:
            self._lock.release()
