"""``tidelog.Admin``: topics, partitions, the cluster and consumer groups, through a gateway.

Every method is one or two gateway calls with a deadline; failures raise the
``tidelog.errors`` exception of their code (``TopicAlreadyExistsError``,
``UnknownTopicOrPartitionError``, ``InvalidReplicationFactorError`` ...). Create and delete
return once the gateway's metadata shows the change, so the next call sees it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType

from tidelog.client import GatewayConnection, raise_for
from tidelog.errors import TidelogError
from tidelog.v1 import common_pb2, controller_pb2, gateway_pb2


@dataclass(frozen=True, slots=True)
class PartitionDescription:
    """One partition: its replication state and offsets (-1 when the leader was not asked
    successfully; ``error`` then says why)."""

    partition: int
    leader: int
    leader_epoch: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]
    high_watermark: int
    log_start_offset: int
    log_end_offset: int
    error: str = ""

    @property
    def offline(self) -> bool:
        return self.leader < 0

    @property
    def under_replicated(self) -> bool:
        return len(self.isr) < len(self.replicas)


@dataclass(frozen=True, slots=True)
class TopicDescription:
    name: str
    topic_id: str
    replication_factor: int
    configs: Mapping[str, str]
    partitions: tuple[PartitionDescription, ...]


@dataclass(frozen=True, slots=True)
class BrokerDescription:
    broker_id: int
    host: str
    port: int
    rack: str
    broker_epoch: int


@dataclass(frozen=True, slots=True)
class ClusterDescription:
    """Brokers, the active controller, and every topic's partitions."""

    cluster_id: str
    controller_id: int
    controller_address: str
    brokers: tuple[BrokerDescription, ...]
    topics: tuple[TopicDescription, ...] = field(default=())

    @property
    def offline_partitions(self) -> list[tuple[str, int]]:
        return [(t.name, p.partition) for t in self.topics for p in t.partitions if p.offline]

    @property
    def under_replicated_partitions(self) -> list[tuple[str, int]]:
        return [
            (t.name, p.partition) for t in self.topics for p in t.partitions if p.under_replicated
        ]


@dataclass(frozen=True, slots=True)
class GroupPartitionOffset:
    """A group's committed offset on one partition and how far behind the HW it is."""

    topic: str
    partition: int
    committed_offset: int
    high_watermark: int
    metadata: str = ""

    @property
    def lag(self) -> int:
        if self.high_watermark < 0 or self.committed_offset < 0:
            return -1
        return max(self.high_watermark - self.committed_offset, 0)


def _describe(topic: gateway_pb2.DescribedTopic) -> TopicDescription:
    return TopicDescription(
        name=topic.name,
        topic_id=topic.topic_id,
        replication_factor=topic.replication_factor,
        configs={c.name: c.value for c in topic.configs},
        partitions=tuple(
            PartitionDescription(
                partition=p.state.partition,
                leader=p.state.leader,
                leader_epoch=p.state.leader_epoch,
                replicas=tuple(p.state.replicas),
                isr=tuple(p.state.isr),
                high_watermark=p.high_watermark,
                log_start_offset=p.log_start_offset,
                log_end_offset=p.log_end_offset,
                error=p.error.message,
            )
            for p in topic.partitions
        ),
    )


class Admin:
    """Administrative calls through one gateway. Thread-safe; ``close()`` is a no-op kept
    for symmetry (the connection is shared per process)."""

    def __init__(self, gateway: str | None = None, *, timeout_ms: int = 30_000) -> None:
        self._conn = GatewayConnection.get(gateway, timeout_ms)
        self._timeout_ms = timeout_ms

    @property
    def gateway(self) -> str:
        return self._conn.address

    # --- topics ---------------------------------------------------------------------------

    def create_topic(
        self,
        name: str,
        partitions: int = 1,
        replication_factor: int = 1,
        config: Mapping[str, str] | None = None,
    ) -> None:
        response: controller_pb2.CreateTopicsResponse = self._conn.call(
            self._conn.stub.CreateTopics,
            controller_pb2.CreateTopicsRequest(
                topics=[
                    controller_pb2.CreatableTopic(
                        name=name,
                        num_partitions=partitions,
                        replication_factor=replication_factor,
                        configs=[
                            common_pb2.ConfigEntry(name=k, value=str(v))
                            for k, v in (config or {}).items()
                        ],
                    )
                ],
                timeout_ms=self._timeout_ms,
            ),
            f"create topic {name!r}",
            timeout_s=self._timeout_ms / 1000 + 5,
        )
        for result in response.topics:
            raise_for(result.error, f"create topic {name!r}")

    def delete_topic(self, name: str) -> None:
        response: controller_pb2.DeleteTopicsResponse = self._conn.call(
            self._conn.stub.DeleteTopics,
            controller_pb2.DeleteTopicsRequest(names=[name], timeout_ms=self._timeout_ms),
            f"delete topic {name!r}",
            timeout_s=self._timeout_ms / 1000 + 5,
        )
        for result in response.topics:
            raise_for(result.error, f"delete topic {name!r}")

    def create_partitions(self, name: str, count: int) -> None:
        """Grow ``name`` to ``count`` partitions in total."""
        response: controller_pb2.CreatePartitionsResponse = self._conn.call(
            self._conn.stub.CreatePartitions,
            controller_pb2.CreatePartitionsRequest(
                topics=[controller_pb2.PartitionIncrease(name=name, count=count)],
                timeout_ms=self._timeout_ms,
            ),
            f"create partitions of {name!r}",
            timeout_s=self._timeout_ms / 1000 + 5,
        )
        for result in response.topics:
            raise_for(result.error, f"create partitions of {name!r}")

    def list_topics(self) -> list[str]:
        return sorted(self._conn.partition_counts())

    def describe_topics(self, names: Sequence[str] = ()) -> list[TopicDescription]:
        """``names`` (all topics when empty), with offsets from each partition's leader."""
        response: gateway_pb2.DescribeTopicsResponse = self._conn.call(
            self._conn.stub.DescribeTopics,
            gateway_pb2.DescribeTopicsRequest(names=list(names)),
            "describe topics",
        )
        for topic in response.topics:
            raise_for(topic.error, f"describe topic {topic.name!r}")
        return [_describe(t) for t in response.topics]

    def describe_topic(self, name: str) -> TopicDescription:
        (topic,) = self.describe_topics([name])
        return topic

    def describe_cluster(self) -> ClusterDescription:
        response: controller_pb2.DescribeClusterResponse = self._conn.call(
            self._conn.stub.DescribeCluster,
            controller_pb2.DescribeClusterRequest(),
            "describe cluster",
        )
        return ClusterDescription(
            cluster_id=response.cluster_id,
            controller_id=response.controller_id,
            controller_address=response.controller_address,
            brokers=tuple(
                BrokerDescription(b.broker_id, b.host, b.port, b.rack, b.broker_epoch)
                for b in response.brokers
            ),
            topics=tuple(self.describe_topics()),
        )

    # --- consumer groups ------------------------------------------------------------------

    def list_groups(self) -> list[str]:
        response: gateway_pb2.ListGroupsResponse = self._conn.call(
            self._conn.stub.ListGroups, gateway_pb2.ListGroupsRequest(), "list groups"
        )
        return list(response.group_ids)

    def describe_group(self, group_id: str) -> list[GroupPartitionOffset]:
        """Committed offset and lag of every partition the group committed."""
        response: gateway_pb2.FetchOffsetsResponse = self._conn.call(
            self._conn.stub.FetchOffsets,
            gateway_pb2.FetchOffsetsRequest(group_id=group_id),
            f"offsets of group {group_id!r}",
        )
        committed = list(response.offsets)
        latest: dict[tuple[str, int], int] = {}
        if committed:
            known = set(self._conn.partition_counts())
            asked = [(c.topic, c.partition) for c in committed if c.topic in known]
            try:
                found = self._conn.list_offsets(asked, common_pb2.LATEST)
                latest = {tp: offset for tp, (offset, _) in found.items()}
            except TidelogError:  # lag is best effort; the offsets still show
                latest = {}
        return [
            GroupPartitionOffset(
                topic=c.topic,
                partition=c.partition,
                committed_offset=c.offset,
                high_watermark=latest.get((c.topic, c.partition), -1),
                metadata=c.metadata,
            )
            for c in committed
        ]

    # --- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        pass

    def __enter__(self) -> Admin:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
