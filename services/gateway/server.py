"""``tidelog.v1.Gateway``: the gRPC adapter over the gateway's parts.

Each method translates protobuf to the call of one part and back: ``ProduceHandler``
(produce), ``FetchHandler`` (fetch, subscribe, offsets), ``ControllerClient`` (admin),
``OffsetStore`` (consumer groups), ``ProducerIds`` (InitProducerId), and the
``MetadataCache`` (metadata, describe). Errors follow the convention of
``protos/tidelog/v1/common.proto``: a bad request as a whole is a gRPC status carrying the
``tidelog-error-code`` trailer; per-partition outcomes are in the response.

Admin calls answer only once this gateway's metadata shows their effect (a created topic
with leaders, a deleted topic gone), or a later change of the same topic, so a client can
produce to a topic the moment CreateTopics returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Final, TypeVar

import grpc

from services.controller.state import Broker
from services.gateway.controller_client import ControllerClient, ProducerIds
from services.gateway.fetch import FetchHandler
from services.gateway.group_coordinator import GroupCoordinator, check_member_id
from services.gateway.groups import Committed, OffsetStore, check_partition_count
from services.gateway.metadata_cache import MetadataCache, MetadataView, TopicKeyRead
from services.gateway.produce import ProduceHandler, check_client_id
from services.gateway.router import DEADLINE_MARGIN_S
from services.metastore import MetaStoreError
from services.process import add_servicer_answering_encoded
from services.status import abort, partition_results, to_error_proto, unary_errors
from tidelog.errors import (
    FencedInstanceIdError,
    InvalidRequestError,
    TidelogError,
    UnknownMemberIdError,
    UnknownServerError,
)
from tidelog.formats import MAX_TOPICS_PER_REQUEST
from tidelog.logging import get_logger
from tidelog.v1 import (
    common_pb2,
    controller_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    storage_pb2,
)

_log = get_logger(component="gateway.server")

ADMIN_TIMEOUT_S: Final = 30.0
"""Default budget of an admin call, including the wait for the metadata to show it."""
MAX_METADATA_TOPICS: Final = 10_000
"""Distinct topics one Metadata request may name (clients subscribed to many topics ask
for all of them at once, so this is above the admin limit)."""
CONTROLLER_ANSWER_MARGIN_S: Final = 1.0
"""Time (at most a quarter of the budget) left between the controller's wait and an admin
call's deadline, for its answer to get back through the gateway."""


def _broker_proto(broker: Broker) -> common_pb2.BrokerInfo:
    return common_pb2.BrokerInfo(
        broker_id=broker.broker_id,
        host=broker.host,
        port=broker.port,
        rack=broker.rack,
        broker_epoch=broker.epoch,
    )


def _topic_metadata(view: MetadataView, name: str) -> common_pb2.TopicMetadata:
    try:
        topic = view.topic(name)  # INVALID_TOPIC for a name no topic can have
    except TidelogError as exc:
        return common_pb2.TopicMetadata(name=name, error=to_error_proto(exc))
    partitions = []
    for index, replicas in enumerate(topic.assignment):
        record = view.partitions.get((name, index))
        partitions.append(
            common_pb2.PartitionState(
                topic=name,
                partition=index,
                leader=record.leader if record else -1,
                leader_epoch=record.leader_epoch if record else -1,
                isr=list(record.isr) if record else [],
                replicas=list(replicas),
                partition_epoch=record.partition_epoch if record else -1,
            )
        )
    return common_pb2.TopicMetadata(
        name=name,
        error=to_error_proto(None),
        partitions=partitions,
        configs=[common_pb2.ConfigEntry(name=k, value=v) for k, v in sorted(topic.configs.items())],
        replication_factor=topic.replication_factor,
        topic_id=topic.topic_id,
    )


def _by_partition_and_spec(
    asked: Sequence[storage_pb2.ListOffsetsPartition],
    answers: Sequence[storage_pb2.ListOffsetsResult],
) -> dict[tuple[str, int, int], storage_pb2.ListOffsetsResult]:
    return {(a.topic, a.partition, a.spec): r for a, r in zip(asked, answers, strict=True)}


MAX_ADMIN_TIMEOUT_S: Final = 300.0
"""The longest an admin request waits for the controller and the brokers (each waiting one
holds a server thread); a larger timeout_ms is clamped, as the storage nodes clamp theirs."""


def _admin_budget_s(timeout_ms: int) -> float:
    """What an admin request's timeout_ms allows: itself (0: the default), at most
    MAX_ADMIN_TIMEOUT_S."""
    if timeout_ms < 0:
        raise InvalidRequestError(f"timeout_ms {timeout_ms} is negative")
    if 0 < timeout_ms <= DEADLINE_MARGIN_S * 1000:
        # Out of time before the controller was tried: it was answered "no controller is
        # active right now" of a healthy cluster, and the SDK added "the change may still
        # have been made" of a change never sent.
        raise InvalidRequestError(
            f"timeout_ms {timeout_ms} is too short: reaching the controller takes more "
            f"than {DEADLINE_MARGIN_S * 1000:.0f} ms"
        )
    return min(timeout_ms / 1000 if timeout_ms else ADMIN_TIMEOUT_S, MAX_ADMIN_TIMEOUT_S)


def _timeout_s(timeout_ms: int, context: grpc.ServicerContext) -> float:
    """An admin request's budget (``_admin_budget_s``), never past the client's own
    deadline: a client that gave up no longer holds a thread here while the controller
    is retried."""
    budget_s = _admin_budget_s(timeout_ms)
    time_remaining_s = context.time_remaining()
    if time_remaining_s is not None:
        budget_s = min(budget_s, max(0.0, time_remaining_s - DEADLINE_MARGIN_S))
    return budget_s


AdminRequest = TypeVar(
    "AdminRequest",
    controller_pb2.CreateTopicsRequest,
    controller_pb2.DeleteTopicsRequest,
    controller_pb2.CreatePartitionsRequest,
    controller_pb2.IncrementalAlterConfigsRequest,
)


def _for_controller(request: AdminRequest, remaining_s: float) -> AdminRequest:
    """``request`` with the controller's wait for its replicas cut short of this call's
    own deadline. The controller makes the change, then waits up to ``timeout_ms`` for the
    replicas to take it; given this call's whole budget, it answered after the deadline,
    and a change that was made came back as REQUEST_TIMED_OUT."""
    margin_s = min(CONTROLLER_ANSWER_MARGIN_S, remaining_s / 4)
    forwarded = type(request)()
    forwarded.CopyFrom(request)
    forwarded.timeout_ms = max(1, int((remaining_s - margin_s) * 1000))  # 0 means "default"
    return forwarded


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):  # type: ignore[misc]
    """Serves ``tidelog.v1.Gateway``; see the module docstring."""

    def __init__(
        self,
        *,
        cache: MetadataCache,
        produce: ProduceHandler,
        fetch: FetchHandler,
        controller: ControllerClient,
        offsets: OffsetStore,
        groups: GroupCoordinator,
        producer_ids: ProducerIds,
        max_in_flight_per_stream: int,
    ) -> None:
        self._cache = cache
        self._produce = produce
        self._fetch = fetch
        self._controller = controller
        self._offsets = offsets
        self._groups = groups
        self._producer_ids = producer_ids
        self._max_in_flight = max_in_flight_per_stream

    # --- produce --------------------------------------------------------------------------

    @unary_errors
    def Produce(  # noqa: N802 - gRPC's method name
        self, request: gateway_pb2.ProduceRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.ProduceResponse:
        remaining_s = context.time_remaining()
        client_deadline = (
            None
            if remaining_s is None
            else time.monotonic() + max(0.0, remaining_s - DEADLINE_MARGIN_S)
        )
        return self._produce.produce(request, client_deadline)

    def ProduceStream(  # noqa: N802 - gRPC's method name
        self, request_iterator: Iterator[gateway_pb2.ProduceRequest], context: grpc.ServicerContext
    ) -> Iterator[gateway_pb2.ProduceResponse]:
        try:
            yield from self._produce.stream(
                request_iterator, self._max_in_flight, context.is_active
            )
        except TidelogError as exc:
            abort(context, exc)

    # --- consume --------------------------------------------------------------------------

    @unary_errors
    def Fetch(  # noqa: N802 - gRPC's method name
        self, request: storage_pb2.FetchRequest, context: grpc.ServicerContext
    ) -> bytes:
        """Answers the encoded ``FetchResponse`` (see ``FetchHandler.fetch``); served by
        ``encoded_fetch_handler``, whose response serializer passes bytes through."""
        return self._fetch.fetch(request, context.time_remaining(), context.add_callback)

    def Subscribe(  # noqa: N802 - gRPC's method name
        self, request: gateway_pb2.SubscribeRequest, context: grpc.ServicerContext
    ) -> Iterator[storage_pb2.FetchPartitionResult]:
        error: TidelogError | None = None
        try:
            yield from self._fetch.subscribe(request, context)
        except TidelogError as exc:
            error = exc
        except Exception as exc:
            _log.exception("subscribe_failed", topic=request.topic, partition=request.partition)
            error = UnknownServerError(f"{type(exc).__name__}: {exc}")
        if error is not None and context.is_active():
            abort(context, error)

    @unary_errors
    def ListOffsets(  # noqa: N802 - gRPC's method name
        self, request: storage_pb2.ListOffsetsRequest, context: grpc.ServicerContext
    ) -> storage_pb2.ListOffsetsResponse:
        if request.replica_id != -1:
            raise InvalidRequestError("clients list offsets with replica_id -1")
        return self._fetch.list_offsets(request, _budget_s(context, LEADER_CALL_TIMEOUT_S))

    # --- metadata -------------------------------------------------------------------------

    @unary_errors
    def Metadata(  # noqa: N802 - gRPC's method name
        self, request: controller_pb2.MetadataRequest, context: grpc.ServicerContext
    ) -> controller_pb2.MetadataResponse:
        asked = list(dict.fromkeys(request.topics))
        if len(asked) > MAX_METADATA_TOPICS:
            # An answer names every topic asked for (unknown ones with an error): without a
            # bound, 200,000 names made a 7 MB answer.
            raise InvalidRequestError(
                f"{len(asked)} topics in one metadata request; the limit is "
                f"{MAX_METADATA_TOPICS} (ask for none to get every topic)"
            )

        def build(view: MetadataView) -> controller_pb2.MetadataResponse:
            names = asked or sorted(view.topics)
            return controller_pb2.MetadataResponse(
                cluster_id=view.cluster_id,
                controller_id=view.controller.controller_id if view.controller else -1,
                controller_epoch=view.controller.epoch if view.controller else -1,
                brokers=[_broker_proto(b) for _, b in sorted(view.brokers.items())],
                topics=[_topic_metadata(view, name) for name in names],
            )

        return self._cache.read(build)

    @unary_errors
    def DescribeCluster(  # noqa: N802 - gRPC's method name
        self, request: controller_pb2.DescribeClusterRequest, context: grpc.ServicerContext
    ) -> controller_pb2.DescribeClusterResponse:
        def build(view: MetadataView) -> controller_pb2.DescribeClusterResponse:
            return controller_pb2.DescribeClusterResponse(
                cluster_id=view.cluster_id,
                controller_id=view.controller.controller_id if view.controller else -1,
                controller_address=view.controller.address if view.controller else "",
                controller_epoch=view.controller.epoch if view.controller else -1,
                brokers=[_broker_proto(b) for _, b in sorted(view.brokers.items())],
            )

        return self._cache.read(build)

    @unary_errors
    def DescribeTopics(  # noqa: N802 - gRPC's method name
        self, request: gateway_pb2.DescribeTopicsRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.DescribeTopicsResponse:
        if len(request.names) > MAX_TOPICS_PER_REQUEST:
            raise InvalidRequestError(
                f"{len(request.names)} topics in one request; the limit is {MAX_TOPICS_PER_REQUEST}"
            )
        metadata = self._cache.read(
            lambda view: [
                _topic_metadata(view, name) for name in (list(request.names) or sorted(view.topics))
            ]
        )
        asked = [
            storage_pb2.ListOffsetsPartition(topic=t.name, partition=p.partition, spec=spec)
            for t in metadata
            if t.error.code == common_pb2.NONE
            for p in t.partitions
            for spec in (common_pb2.EARLIEST, common_pb2.LATEST)
        ]
        # Both passes within one budget (each used to get 10 s of its own, whatever the
        # client's deadline).
        deadline = time.monotonic() + _budget_s(context, LEADER_CALL_TIMEOUT_S)
        as_consumer = self._fetch.offsets_by_leader(-1, asked, deadline - time.monotonic())
        latest = [a for a in asked if a.spec == common_pb2.LATEST]
        as_replica = self._fetch.offsets_by_leader(
            -1, latest, max(0.0, deadline - time.monotonic()), leader_as_replica=True
        )
        consumer = _by_partition_and_spec(asked, as_consumer)
        replica = _by_partition_and_spec(latest, as_replica)
        topics = []
        for t in metadata:
            described = []
            for p in t.partitions:
                start = consumer.get((t.name, p.partition, common_pb2.EARLIEST))
                hw = consumer.get((t.name, p.partition, common_pb2.LATEST))
                leo = replica.get((t.name, p.partition, common_pb2.LATEST))
                error = next(
                    (
                        r.error
                        for r in (start, hw, leo)
                        if r is not None and r.error.code != common_pb2.NONE
                    ),
                    to_error_proto(None),
                )
                described.append(
                    gateway_pb2.DescribedPartition(
                        state=p,
                        high_watermark=hw.offset if hw and hw.error.code == 0 else -1,
                        log_start_offset=start.offset if start and start.error.code == 0 else -1,
                        log_end_offset=leo.offset if leo and leo.error.code == 0 else -1,
                        error=error,
                    )
                )
            topics.append(
                gateway_pb2.DescribedTopic(
                    name=t.name,
                    error=t.error,
                    topic_id=t.topic_id,
                    replication_factor=t.replication_factor,
                    configs=t.configs,
                    partitions=described,
                )
            )
        return gateway_pb2.DescribeTopicsResponse(topics=topics)

    # --- admin, forwarded -----------------------------------------------------------------

    @unary_errors
    def CreateTopics(  # noqa: N802 - gRPC's method name
        self, request: controller_pb2.CreateTopicsRequest, context: grpc.ServicerContext
    ) -> controller_pb2.CreateTopicsResponse:
        timeout_s = _timeout_s(request.timeout_ms, context)
        deadline = time.monotonic() + timeout_s
        response: controller_pb2.CreateTopicsResponse = self._controller.call(
            timeout_s, lambda stub, t: stub.CreateTopics(_for_controller(request, t), timeout=t)
        )
        if not request.validate_only:
            created = [r.name for r in response.topics if r.error.code == common_pb2.NONE]
            self._await_topic_keys(deadline, created, MetadataView.shows_ready)
        return response

    @unary_errors
    def DeleteTopics(  # noqa: N802 - gRPC's method name
        self, request: controller_pb2.DeleteTopicsRequest, context: grpc.ServicerContext
    ) -> controller_pb2.DeleteTopicsResponse:
        timeout_s = _timeout_s(request.timeout_ms, context)
        deadline = time.monotonic() + timeout_s
        response: controller_pb2.DeleteTopicsResponse = self._controller.call(
            timeout_s, lambda stub, t: stub.DeleteTopics(_for_controller(request, t), timeout=t)
        )
        deleted = [r.name for r in response.topics if r.error.code == common_pb2.NONE]
        self._await_topic_keys(deadline, deleted, MetadataView.shows)
        self._await_deletions(deadline, deleted)
        return response

    @unary_errors
    def CreatePartitions(  # noqa: N802 - gRPC's method name
        self, request: controller_pb2.CreatePartitionsRequest, context: grpc.ServicerContext
    ) -> controller_pb2.CreatePartitionsResponse:
        timeout_s = _timeout_s(request.timeout_ms, context)
        deadline = time.monotonic() + timeout_s
        response: controller_pb2.CreatePartitionsResponse = self._controller.call(
            timeout_s, lambda stub, t: stub.CreatePartitions(_for_controller(request, t), timeout=t)
        )
        if not request.validate_only:
            grown = [r.name for r in response.topics if r.error.code == common_pb2.NONE]
            self._await_topic_keys(deadline, grown, MetadataView.shows_ready)
        return response

    @unary_errors
    def IncrementalAlterConfigs(  # noqa: N802 - gRPC's method name
        self,
        request: controller_pb2.IncrementalAlterConfigsRequest,
        context: grpc.ServicerContext,
    ) -> controller_pb2.IncrementalAlterConfigsResponse:
        timeout_s = _timeout_s(request.timeout_ms, context)
        deadline = time.monotonic() + timeout_s
        response: controller_pb2.IncrementalAlterConfigsResponse = self._controller.call(
            timeout_s,
            lambda stub, t: stub.IncrementalAlterConfigs(_for_controller(request, t), timeout=t),
        )
        if not request.validate_only:
            altered = [r.name for r in response.topics if r.error.code == common_pb2.NONE]
            # Answered once this gateway's metadata (DescribeTopics) shows the new settings.
            self._await_topic_keys(deadline, altered, MetadataView.shows)
        return response

    def _await_topic_keys(
        self,
        deadline: float,
        names: Sequence[str],
        shown: Callable[[MetadataView, TopicKeyRead], bool],
    ) -> None:
        """Wait (bounded, like ``_await``) until ``shown`` says this gateway's metadata has
        reached the keys of the topics ``names`` as etcd holds them now, after the
        controller answered: this call's change or a later one. It waited for the exact
        state the call made instead (the configs the controller answered, the name gone),
        which a change of the same topic right after (an alter of another key, a
        re-create) took away, often before this thread looked; the call then waited out
        its whole timeout (found by an audit)."""
        if not names:
            return
        try:
            # Where etcd stands now tells the revision to wait for: one read per call (of
            # up to TOPIC_KEYS_PER_READ topics), nothing per record.
            reads = self._cache.read_topic_keys(list(dict.fromkeys(names)), deadline)
        except MetaStoreError as exc:
            _log.warning("admin_change_not_checked", error=str(exc))
            return
        self._await(deadline, lambda view: all(shown(view, read) for read in reads))

    def _await_deletions(self, deadline: float, names: Sequence[str]) -> None:
        """Wait (bounded) until the controller has completed these topics' deletions, so
        that the next call may create the names again: the controller refuses a name
        whose deletion is pending (the replicas on live brokers, then the groups'
        offsets), and a delete followed at once by a create of the same name was refused
        (found by an audit; Kafka's KRaft takes the name back at once). Out of time, the
        answer comes first: the deletion completes on its own."""
        pause_s = DELETION_POLL_FIRST_S
        while names and not self._cache.stopped:
            try:
                pending = self._cache.pending_deletions(deadline)
            except MetaStoreError as exc:
                _log.warning("topic_deletion_not_checked", error=str(exc))
                return
            names = [name for name in names if name in pending]
            remaining_s = deadline - time.monotonic()
            if not names or remaining_s <= 0:
                if names:
                    _log.warning("topic_deletion_not_yet_complete", topics=names[:10])
                return
            # Woken early by any metadata change; the deletion record itself is not in
            # the view, so it is polled, backing off (the controller completes a deletion
            # within a few of its housekeeping ticks of 0.25 s).
            self._cache.wait_for_change(self._cache.version, min(pause_s, remaining_s))
            pause_s = min(pause_s * 2, DELETION_POLL_MAX_S)

    def _await(self, deadline: float, condition: Callable[[MetadataView], bool]) -> None:
        """Wait (bounded) until this gateway's metadata shows an admin change. The change
        is made either way; running out of time here only means the answer comes first."""
        while True:
            version = self._cache.version
            if self._cache.read(condition):
                return
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                _log.warning("admin_change_not_yet_visible")
                return
            self._cache.wait_for_change(version, remaining_s)

    # --- consumer groups ------------------------------------------------------------------

    @unary_errors
    def CommitOffsets(  # noqa: N802 - gRPC's method name
        self, request: gateway_pb2.CommitOffsetsRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.CommitOffsetsResponse:
        group_id, member_id, generation = request.group_id, request.member_id, request.generation_id
        instance_id = request.group_instance_id
        check_member_id(member_id)  # the request's, not a partition's, fault
        outcomes = self._offsets.commit(
            group_id,
            [
                Committed(
                    o.topic, o.partition, o.offset, o.metadata, o.leader_epoch, topic_id=o.topic_id
                )
                for o in request.offsets
            ],
            guard=lambda: self._groups.commit_guard(group_id, member_id, generation, instance_id),
            deadline=time.monotonic() + _budget_s(context, COMMIT_TIMEOUT_S),
        )
        return gateway_pb2.CommitOffsetsResponse(
            partitions=partition_results(outcomes, [o.error for o in outcomes])
        )

    @unary_errors
    def FetchOffsets(  # noqa: N802 - gRPC's method name
        self, request: gateway_pb2.FetchOffsetsRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.FetchOffsetsResponse:
        # Before the request's entries become objects: a 100 MB request holds millions.
        check_partition_count(len(request.partitions), "offset fetch")
        committed = self._offsets.fetch(
            request.group_id, [(tp.topic, tp.partition) for tp in request.partitions]
        )
        return gateway_pb2.FetchOffsetsResponse(
            offsets=[
                gateway_pb2.CommittedOffset(
                    topic=c.topic,
                    partition=c.partition,
                    error=to_error_proto(c.error),
                    offset=c.offset,
                    metadata=c.metadata,
                    leader_epoch=c.leader_epoch,
                )
                for c in committed
            ]
        )

    @unary_errors
    def ListGroups(  # noqa: N802 - gRPC's method name
        self, request: gateway_pb2.ListGroupsRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.ListGroupsResponse:
        names = set(self._offsets.list_groups()) | set(self._groups.list_groups())
        return gateway_pb2.ListGroupsResponse(group_ids=sorted(names))

    @unary_errors
    def JoinGroup(  # noqa: N802 - gRPC's method name
        self, request: gateway_pb2.JoinGroupRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.JoinGroupResponse:
        try:
            outcome = self._groups.join(
                request.group_id,
                request.member_id,
                topics=list(request.topics),
                session_timeout_ms=request.session_timeout_ms,
                rebalance_timeout_ms=request.rebalance_timeout_ms,
                client_id=request.client_id,
                max_wait_ms=request.max_wait_ms,
                instance_id=request.group_instance_id,
            )
        except UnknownMemberIdError as exc:
            return gateway_pb2.JoinGroupResponse(error=to_error_proto(exc))
        return gateway_pb2.JoinGroupResponse(
            error=to_error_proto(outcome.error),
            member_id=outcome.member_id,
            generation_id=outcome.generation,
            assignment=[
                common_pb2.TopicPartition(topic=t, partition=p) for t, p in outcome.assignment
            ],
            session_timeout_ms=outcome.session_timeout_ms,
        )

    @unary_errors
    def Heartbeat(  # noqa: N802 - gRPC's method name
        self, request: gateway_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.HeartbeatResponse:
        error = self._groups.heartbeat(
            request.group_id,
            request.member_id,
            request.generation_id,
            request.group_instance_id,
        )
        return gateway_pb2.HeartbeatResponse(error=to_error_proto(error))

    @unary_errors
    def LeaveGroup(  # noqa: N802 - gRPC's method name
        self, request: gateway_pb2.LeaveGroupRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.LeaveGroupResponse:
        try:
            self._groups.leave(request.group_id, request.member_id, request.group_instance_id)
        except (UnknownMemberIdError, FencedInstanceIdError) as exc:
            return gateway_pb2.LeaveGroupResponse(error=to_error_proto(exc))
        return gateway_pb2.LeaveGroupResponse()

    @unary_errors
    def DeleteGroup(  # noqa: N802 - gRPC's method name
        self, request: gateway_pb2.DeleteGroupRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.DeleteGroupResponse:
        group_id = request.group_id
        deleted = self._offsets.delete_group(
            group_id, lambda: self._groups.inactive_guard(group_id)
        )
        return gateway_pb2.DeleteGroupResponse(offsets_deleted=deleted)

    @unary_errors
    def DescribeGroup(  # noqa: N802 - gRPC's method name
        self, request: gateway_pb2.DescribeGroupRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.DescribeGroupResponse:
        state = self._groups.describe(request.group_id)
        name = _KAFKA_GROUP_STATES[state.phase]
        if (
            not state.members
            and not self._groups.has_sessions(request.group_id)
            and not self._offsets.fetch(request.group_id, [])
        ):
            # Kafka's state of a group it does not know (never used, or deleted): "Empty"
            # is a group without members that has offsets (or a member about to join),
            # and a script could not tell the two apart (found by an audit).
            name = "Dead"
        return gateway_pb2.DescribeGroupResponse(
            group_id=request.group_id,
            state=name,
            generation_id=state.generation,
            members=[
                gateway_pb2.GroupMember(
                    member_id=m.member_id,
                    client_id=m.client_id,
                    group_instance_id=m.instance_id,
                    topics=list(m.topics),
                    assignment=[
                        common_pb2.TopicPartition(topic=t, partition=p)
                        for t, p in state.assignment.get(m.member_id, ())
                    ],
                )
                for m in sorted(state.members.values(), key=lambda m: m.member_id)
            ],
        )

    # --- producers ------------------------------------------------------------------------

    @unary_errors
    def InitProducerId(  # noqa: N802 - gRPC's method name
        self, request: gateway_pb2.InitProducerIdRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.InitProducerIdResponse:
        check_client_id(request.client_id)
        producer_id = self._producer_ids.next_id(context.time_remaining())
        _log.info("producer_id_issued", producer_id=producer_id, client_id=request.client_id)
        return gateway_pb2.InitProducerIdResponse(producer_id=producer_id, producer_epoch=0)


_KAFKA_GROUP_STATES: Final = {
    "empty": "Empty",
    "preparing": "PreparingRebalance",
    "stable": "Stable",
}

COMMIT_TIMEOUT_S: Final = 30.0
"""The longest a CommitOffsets keeps starting transactions (or less: the call's deadline)."""

DELETION_POLL_FIRST_S: Final = 0.02
DELETION_POLL_MAX_S: Final = 0.25
"""How often DeleteTopics looks whether the controller completed the deletions."""

LEADER_CALL_TIMEOUT_S: Final = 10.0
"""The longest a ListOffsets or DescribeTopics waits for the leaders' answers."""


def _budget_s(context: grpc.ServicerContext, limit_s: float) -> float:
    """``limit_s``, or less when the client's deadline comes sooner (minus the time its
    answer needs to travel back), so that the client gets the leaders' errors rather
    than its own bare deadline."""
    remaining_s = context.time_remaining()
    if remaining_s is None:
        return limit_s
    return max(0.0, min(limit_s, remaining_s - DEADLINE_MARGIN_S))


def add_gateway_to_server(servicer: GatewayServicer, server: grpc.Server) -> None:
    """Register ``tidelog.v1.Gateway`` like the generated code does, except that Fetch
    answers bytes that are already an encoded ``FetchResponse`` (no re-encoding)."""
    add_servicer_answering_encoded(
        gateway_pb2_grpc.add_GatewayServicer_to_server,
        servicer,
        server,
        {"Fetch": (servicer.Fetch, storage_pb2.FetchRequest.FromString)},
    )


__all__ = ["GatewayServicer", "add_gateway_to_server"]
