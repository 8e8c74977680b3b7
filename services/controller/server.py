"""The gRPC face of the controller: ``tidelog.v1.Controller`` <-> ``Controller``'s dataclasses.

This is the one place where controller protobufs are read and built. Conventions
(``protos/tidelog/v1/common.proto``):

- A request wrong as a whole (too many topics, a negative timeout) fails with a gRPC status
  and the ``tidelog-error-code`` trailer; nothing is changed.
- Requests about several topics or partitions answer per item; one bad item does not fail
  the others.
- A standby controller answers every call with NOT_CONTROLLER (gRPC FAILED_PRECONDITION),
  the active controller's address in the message and in the trailer ``tidelog-controller``
  (absent when no controller is active), so clients can go there directly.

Thread-safety: the servicer is stateless; every method may run on any pool thread.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Final, TypeVar

import grpc
import structlog

from services.controller.controller import (
    ConfigChange,
    Controller,
    IsrProposal,
    NewPartitions,
    NewTopic,
    PartitionView,
    StandbyError,
)
from services.controller.state import Broker, ElectionType
from services.status import (
    ERROR_CODE_METADATA_KEY,
    partition_results,
    status_for,
    to_error_proto,
)
from tidelog.errors import (
    InvalidRequestError,
    StaleBrokerEpochError,
    TidelogError,
    UnknownServerError,
)
from tidelog.v1 import common_pb2, controller_pb2, controller_pb2_grpc

_log = structlog.get_logger("tidelog.controller.server")

CONTROLLER_METADATA_KEY: Final = "tidelog-controller"
"""Trailing metadata of NOT_CONTROLLER answers: ``host:port`` of the active controller."""

MAX_ASSIGNMENT_ENTRIES: Final = 100_000
"""Replica ids in one request's explicit assignments (sum over topics)."""

_ELECTION_TYPES: Final = {
    controller_pb2.PREFERRED: ElectionType.PREFERRED,
    controller_pb2.UNCLEAN: ElectionType.UNCLEAN,
}

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


def _rpc(
    method: Callable[[ControllerServicer, _Request, grpc.ServicerContext], _Response],
) -> Callable[[ControllerServicer, _Request, grpc.ServicerContext], _Response]:
    """Turn raised errors into statuses; NOT_CONTROLLER also carries the active address."""

    @functools.wraps(method)
    def wrapper(
        self: ControllerServicer, request: _Request, context: grpc.ServicerContext
    ) -> _Response:
        error: TidelogError
        metadata: list[tuple[str, str]] = []
        try:
            return method(self, request, context)
        except StandbyError as exc:
            error = exc
            if exc.active is not None:
                metadata.append((CONTROLLER_METADATA_KEY, exc.active.address))
        except TidelogError as exc:
            error = exc
        except Exception as exc:
            _log.exception("rpc_failed", method=method.__name__)
            error = UnknownServerError(f"{type(exc).__name__}: {exc}")
        # Outside the except blocks: abort raises, and must not be caught by them.
        context.set_trailing_metadata(((ERROR_CODE_METADATA_KEY, error.code.name), *metadata))
        context.abort(status_for(error.code), error.message)

    return wrapper


def _broker_proto(broker: Broker) -> common_pb2.BrokerInfo:
    return common_pb2.BrokerInfo(
        broker_id=broker.broker_id,
        host=broker.host,
        port=broker.port,
        rack=broker.rack,
        broker_epoch=broker.epoch,
    )


def _partition_proto(view: PartitionView) -> common_pb2.PartitionState:
    return common_pb2.PartitionState(
        topic=view.topic,
        partition=view.partition,
        leader=view.record.leader,
        leader_epoch=view.record.leader_epoch,
        isr=list(view.record.isr),
        replicas=list(view.replicas),
        partition_epoch=view.record.partition_epoch,
    )


def _config_protos(configs: dict[str, str]) -> list[common_pb2.ConfigEntry]:
    return [common_pb2.ConfigEntry(name=k, value=v) for k, v in sorted(configs.items())]


def _assignments(
    entries: Iterable[controller_pb2.ReplicaAssignment],
) -> tuple[tuple[int, tuple[int, ...]], ...]:
    return tuple((entry.partition, tuple(entry.broker_ids)) for entry in entries)


def _require_broker_epoch(method: str, broker_epoch: int) -> None:
    """Requests only brokers send carry the sender's registration epoch as its proof of
    identity. The state machine reads a negative epoch as "not known, skip the check"
    (its own callers may not know it); on the wire, that would let any client move a
    broker's leaderships or ISRs away by naming it with epoch -1 (issue 9)."""
    if broker_epoch < 0:
        raise InvalidRequestError(
            f"{method} must carry the broker's registration epoch; got broker_epoch {broker_epoch}"
        )


class ControllerServicer(controller_pb2_grpc.ControllerServicer):  # type: ignore[misc]
    """Serves ``tidelog.v1.Controller`` from a ``Controller`` (active or standby)."""

    def __init__(self, controller: Controller) -> None:
        self._controller = controller

    def _check_assignment_size(self, total: int) -> None:
        if total > MAX_ASSIGNMENT_ENTRIES:
            raise InvalidRequestError(
                f"{total} replica ids in explicit assignments; the limit is "
                f"{MAX_ASSIGNMENT_ENTRIES}"
            )

    @_rpc
    def CreateTopics(  # noqa: N802 - gRPC's method name
        self, request: controller_pb2.CreateTopicsRequest, context: grpc.ServicerContext
    ) -> controller_pb2.CreateTopicsResponse:
        self._check_assignment_size(
            sum(len(a.broker_ids) for t in request.topics for a in t.assignments)
        )
        topics = [
            NewTopic(
                name=t.name,
                num_partitions=t.num_partitions,
                replication_factor=t.replication_factor,
                configs=tuple((c.name, c.value) for c in t.configs),
                assignments=_assignments(t.assignments),
            )
            for t in request.topics
        ]
        results = self._controller.create_topics(
            topics, validate_only=request.validate_only, timeout_ms=request.timeout_ms
        )
        return controller_pb2.CreateTopicsResponse(
            topics=[
                controller_pb2.CreateTopicResult(
                    name=result.name,
                    error=to_error_proto(result.error),
                    topic_id=result.topic.topic_id if result.topic else "",
                    num_partitions=result.topic.partition_count if result.topic else 0,
                    replication_factor=result.topic.replication_factor if result.topic else 0,
                    configs=_config_protos(result.effective_configs),
                )
                for result in results
            ]
        )

    @_rpc
    def DeleteTopics(  # noqa: N802 - gRPC's method name
        self, request: controller_pb2.DeleteTopicsRequest, context: grpc.ServicerContext
    ) -> controller_pb2.DeleteTopicsResponse:
        results = self._controller.delete_topics(list(request.names), timeout_ms=request.timeout_ms)
        return controller_pb2.DeleteTopicsResponse(
            topics=[
                controller_pb2.TopicResult(name=r.name, error=to_error_proto(r.error))
                for r in results
            ]
        )

    @_rpc
    def CreatePartitions(  # noqa: N802 - gRPC's method name
        self, request: controller_pb2.CreatePartitionsRequest, context: grpc.ServicerContext
    ) -> controller_pb2.CreatePartitionsResponse:
        self._check_assignment_size(
            sum(len(a.broker_ids) for t in request.topics for a in t.assignments)
        )
        increases = [
            NewPartitions(name=t.name, count=t.count, assignments=_assignments(t.assignments))
            for t in request.topics
        ]
        results = self._controller.create_partitions(
            increases, validate_only=request.validate_only, timeout_ms=request.timeout_ms
        )
        return controller_pb2.CreatePartitionsResponse(
            topics=[
                controller_pb2.TopicResult(name=r.name, error=to_error_proto(r.error))
                for r in results
            ]
        )

    @_rpc
    def IncrementalAlterConfigs(  # noqa: N802 - gRPC's method name
        self,
        request: controller_pb2.IncrementalAlterConfigsRequest,
        context: grpc.ServicerContext,
    ) -> controller_pb2.IncrementalAlterConfigsResponse:
        changes = [
            ConfigChange(
                name=t.name,
                set=tuple((c.name, c.value) for c in t.set),
                delete=tuple(t.delete),
            )
            for t in request.topics
        ]
        results = self._controller.alter_topic_configs(
            changes, validate_only=request.validate_only, timeout_ms=request.timeout_ms
        )
        return controller_pb2.IncrementalAlterConfigsResponse(
            topics=[
                controller_pb2.AlterConfigsResult(
                    name=r.name,
                    error=to_error_proto(r.error),
                    configs=_config_protos(dict(r.configs)),
                )
                for r in results
            ]
        )

    @_rpc
    def DescribeCluster(  # noqa: N802 - gRPC's method name
        self, request: controller_pb2.DescribeClusterRequest, context: grpc.ServicerContext
    ) -> controller_pb2.DescribeClusterResponse:
        view = self._controller.describe_cluster()
        return controller_pb2.DescribeClusterResponse(
            cluster_id=view.cluster_id,
            controller_id=view.controller_id,
            controller_address=view.controller_address,
            controller_epoch=view.controller_epoch,
            brokers=[_broker_proto(b) for b in view.brokers],
        )

    @_rpc
    def Metadata(  # noqa: N802 - gRPC's method name
        self, request: controller_pb2.MetadataRequest, context: grpc.ServicerContext
    ) -> controller_pb2.MetadataResponse:
        cluster, topics = self._controller.metadata(list(request.topics))
        return controller_pb2.MetadataResponse(
            cluster_id=cluster.cluster_id,
            controller_id=cluster.controller_id,
            controller_epoch=cluster.controller_epoch,
            brokers=[_broker_proto(b) for b in cluster.brokers],
            topics=[
                common_pb2.TopicMetadata(
                    name=view.name,
                    error=to_error_proto(view.error),
                    partitions=[_partition_proto(p) for p in view.partitions],
                    configs=_config_protos(dict(view.topic.configs)) if view.topic else [],
                    replication_factor=view.topic.replication_factor if view.topic else 0,
                    topic_id=view.topic.topic_id if view.topic else "",
                )
                for view in topics
            ],
        )

    @_rpc
    def AlterPartition(  # noqa: N802 - gRPC's method name
        self, request: controller_pb2.AlterPartitionRequest, context: grpc.ServicerContext
    ) -> controller_pb2.AlterPartitionResponse:
        _require_broker_epoch("AlterPartition", request.broker_epoch)
        proposals = [
            IsrProposal(
                topic=item.topic,
                partition=item.partition,
                leader_epoch=item.leader_epoch,
                new_isr=tuple(item.new_isr),
                partition_epoch=item.partition_epoch,
                joining=tuple((m.broker_id, m.broker_epoch) for m in item.joining),
            )
            for item in request.partitions
        ]
        outcomes = self._controller.alter_partition(
            request.broker_id, request.broker_epoch, proposals
        )
        return controller_pb2.AlterPartitionResponse(
            partitions=[
                controller_pb2.AlterPartitionResult(
                    topic=o.topic,
                    partition=o.partition,
                    error=to_error_proto(o.error),
                    state=_partition_proto(o.view) if o.view is not None else None,
                )
                for o in outcomes
            ]
        )

    @_rpc
    def ControlledShutdown(  # noqa: N802 - gRPC's method name
        self, request: controller_pb2.ControlledShutdownRequest, context: grpc.ServicerContext
    ) -> controller_pb2.ControlledShutdownResponse:
        _require_broker_epoch("ControlledShutdown", request.broker_epoch)
        remaining = self._controller.controlled_shutdown(request.broker_id, request.broker_epoch)
        return controller_pb2.ControlledShutdownResponse(
            error=to_error_proto(None),
            remaining_partitions=[
                common_pb2.TopicPartition(topic=topic, partition=p) for topic, p in remaining
            ],
        )

    @_rpc
    def ElectLeaders(  # noqa: N802 - gRPC's method name
        self, request: controller_pb2.ElectLeadersRequest, context: grpc.ServicerContext
    ) -> controller_pb2.ElectLeadersResponse:
        election = _ELECTION_TYPES.get(request.election_type)
        if election is None:
            raise InvalidRequestError(f"unknown election type {request.election_type}")
        outcomes = self._controller.elect_leaders(
            election,
            [(tp.topic, tp.partition) for tp in request.partitions],
            timeout_ms=request.timeout_ms,
        )
        return controller_pb2.ElectLeadersResponse(
            partitions=partition_results(outcomes, [o.error for o in outcomes])
        )

    @_rpc
    def AllocateProducerIds(  # noqa: N802 - gRPC's method name
        self, request: controller_pb2.AllocateProducerIdsRequest, context: grpc.ServicerContext
    ) -> controller_pb2.AllocateProducerIdsResponse:
        try:
            block = self._controller.allocate_producer_ids(request.broker_id, request.broker_epoch)
        except StaleBrokerEpochError as exc:
            # About the asking broker, not the request: answered in the response, as Kafka.
            return controller_pb2.AllocateProducerIdsResponse(
                error=to_error_proto(exc), producer_id_start=-1, producer_id_len=0
            )
        return controller_pb2.AllocateProducerIdsResponse(
            error=to_error_proto(None),
            producer_id_start=block.start,
            producer_id_len=block.length,
        )


__all__ = ["CONTROLLER_METADATA_KEY", "ControllerServicer"]
