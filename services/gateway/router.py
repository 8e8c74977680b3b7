"""Calling a partition's leader from the gateway, re-routing when leadership moves.

``Router.call_leader(topic, partition, deadline, call)`` looks the leader up in the
metadata cache, makes the call with the leader epoch the cache knows, and when the answer
says the routing was wrong (not the leader, a fenced or unknown epoch, no leader yet, the
broker unreachable) waits for the metadata to change and tries again, until the request's
deadline. Errors that are about the request itself (bad batch, not enough replicas, a
duplicate sequence ...) are returned at once: retrying them is the client's decision.

The produce path also gives up a call whose leader stops answering once the metadata
names another leader (``ProduceHandler._answer_unless_moved``), which re-routes it here.

Retrying an append is safe for idempotent producers (the leader recognises the batch's
sequence and returns the original offsets); for others it has Kafka's at-least-once
semantics: an append whose answer was lost may be written twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final, TypeVar

import grpc

from services.gateway.channels import Channels
from services.gateway.metadata_cache import Leader, MetadataCache
from services.status import error_code_from_metadata, error_from_rpc_error
from tidelog.errors import (
    REROUTE_CODES,
    BrokerNotAvailableError,
    LeaderNotAvailableError,
    RequestTimedOutError,
    TidelogError,
)
from tidelog.v1 import storage_pb2_grpc

T = TypeVar("T")

RETRY_WAIT_S: Final = 0.1
"""Longest wait for a metadata change before retrying anyway (the leader may have been
reachable again, or the same leader may have just learnt its role)."""

DEADLINE_MARGIN_S: Final = 0.05
"""Time kept back from a downstream call's deadline so the answer can travel back."""


class Router:
    """Leader lookup + call + re-route; see the module docstring. Thread-safe."""

    def __init__(self, cache: MetadataCache, channels: Channels) -> None:
        self.cache = cache
        self.channels = channels

    def call_leader(
        self,
        topic: str,
        partition: int,
        deadline: float,
        call: Callable[[storage_pb2_grpc.StorageStub, Leader, float], T],
    ) -> T:
        """``call(stub, leader, timeout_s)`` on the partition's leader, re-routed as needed.

        Raises the last TidelogError when the deadline passes or the error is final;
        UnknownTopicOrPartitionError from the cache (the topic or partition does not exist)
        is final at once.
        """
        last: TidelogError | None = None
        while True:
            if self.cache.stopped:
                # The view changes no more, and wait_for_change returns at once: waiting
                # on for a leader spun a core until the deadline and held the gateway's
                # exit behind it (found by an audit).
                raise BrokerNotAvailableError(
                    f"the gateway is stopping; {topic}-{partition} was not called"
                )
            version = self.cache.version
            remaining_s = deadline - time.monotonic()
            if remaining_s <= DEADLINE_MARGIN_S:
                if last is not None:
                    raise last
                raise RequestTimedOutError(f"no answer for {topic}-{partition} before the deadline")
            try:
                leader = self.cache.leader(topic, partition)
            except LeaderNotAvailableError as exc:
                last = exc
                self.cache.wait_for_change(version, min(RETRY_WAIT_S * 5, remaining_s))
                continue
            try:
                return call(self.channels.storage(leader.broker), leader, remaining_s)
            except grpc.RpcError as exc:
                error = error_from_rpc_error(exc)
                if error_code_from_metadata(exc.trailing_metadata()) is None and (
                    exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                ):
                    # The deadline gRPC enforced: the leader sent nothing, and gRPC's own
                    # text ("Deadline Exceeded") names neither side.
                    raise RequestTimedOutError(
                        f"the leader of {topic}-{partition}, broker {leader.broker.broker_id} "
                        f"({leader.broker.host}:{leader.broker.port}), did not answer before "
                        "the deadline (stopped, overloaded or cut off?)"
                    ) from None
            except TidelogError as exc:
                error = exc
            if error.code not in REROUTE_CODES:
                raise error
            last = error
            self.cache.wait_for_change(version, min(RETRY_WAIT_S, deadline - time.monotonic()))
