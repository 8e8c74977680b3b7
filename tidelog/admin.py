"""``tidelog.Admin``: topics, partitions, the cluster and consumer groups, through a gateway.

Every method is one or two gateway calls with a deadline; failures raise the
``tidelog.errors`` exception of their code (``TopicAlreadyExistsError``,
``UnknownTopicOrPartitionError``, ``InvalidReplicationFactorError`` ...). Arguments of the
wrong type raise ``ConfigError`` before anything is sent. Create and delete return once the
gateway's metadata shows the change, so the next call sees it; a create, delete or
create-partitions that times out (``RequestTimedOutError``) may have been made all the same.
An Admin made before ``os.fork()`` raises ConfigError for every call in the child: make
one there (``tidelog.client.check_same_process``).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, SupportsIndex

from tidelog.client import GatewayConnection, check_same_process, current_pid, raise_for
from tidelog.errors import (
    ConfigError,
    InvalidPartitionsError,
    InvalidReplicationFactorError,
    RequestTimedOutError,
    TidelogError,
)
from tidelog.formats import INT32_MAX, INT64_MAX, MAX_TOPICS_PER_REQUEST
from tidelog.v1 import common_pb2, controller_pb2, gateway_pb2

CHANGE_DEADLINE_MARGIN_S: Final = 5.0
"""How much longer than the ``timeout_ms`` it sends the SDK waits for a create, delete or
create-partitions answer. The gateway spends up to ``timeout_ms`` on the change (its call to
the controller, then the wait for its own metadata to show it) and answers after that: a
deadline no longer than that would cut off answers on their way and call a change that was
made a timeout."""


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
        """Partitions without a leader, or led by a broker not registered now (dead: until
        the controller moves its leaderships, which an etcd refusing its transactions
        could stop for good, `tidelog cluster` said "offline 0" of them; found by an
        audit)."""
        live = {b.broker_id for b in self.brokers}
        return [
            (t.name, p.partition)
            for t in self.topics
            for p in t.partitions
            if p.offline or p.leader not in live
        ]

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
    def lag(self) -> int | None:
        """HW minus the committed offset; None when either is unknown. Negative when the
        committed offset lies past the log end (set so, or the log truncated by an
        unclean election), as Kafka's consumer-groups tool shows it: a consumer there
        gets OFFSET_OUT_OF_RANGE and resets, it is not caught up."""
        if self.high_watermark < 0 or self.committed_offset < 0:
            return None
        return self.high_watermark - self.committed_offset


@dataclass(frozen=True, slots=True)
class GroupMemberDescription:
    member_id: str
    client_id: str
    topics: tuple[str, ...]
    assignment: tuple[tuple[str, int], ...]
    # A static member's group.instance.id ("" for a dynamic member), as Kafka's
    # MemberDescription.groupInstanceId: which instance holds which partitions.
    group_instance_id: str = ""


@dataclass(frozen=True, slots=True)
class GroupDescription:
    """A group's membership: Kafka's state name (Dead, Empty, PreparingRebalance, Stable), the
    generation (completed rebalances) and the members with their partitions."""

    group_id: str
    state: str
    generation: int
    members: tuple[GroupMemberDescription, ...]


def _text(what: str, value: object) -> str:
    """``value`` if it is a str the wire can carry (UTF-8), else ConfigError."""
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be a str, not {type(value).__name__}")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"{what} is not UTF-8 text ({exc.reason} at character {exc.start})"
        ) from None
    return value


def _integer(what: str, value: object) -> int:
    """``value`` as an int if it is one (a numpy integer too), else ConfigError: a float,
    a numeric str or a bool is a caller's bug, not a number to round or parse."""
    # bool is an int to Python, but True partitions is a bug, not a count of 1.
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise ConfigError(f"{what} must be an int, not {type(value).__name__}")
    return operator.index(value)


def _int32(what: str, value: object, out_of_range: type[TidelogError]) -> int:
    """``value`` if it is an int the wire's int32 can carry (else ConfigError, as
    ``_integer``); outside int32: ``out_of_range``, the error the server gives for a count
    it refuses, so callers catch one error for a bad count."""
    number = _integer(what, value)
    if not -INT32_MAX - 1 <= number <= INT32_MAX:
        raise out_of_range(f"{what} {number} is out of the int32 range the protocol carries")
    return number


def _partition_key(value: object) -> tuple[str, int]:
    """A (topic, partition) pair as the wire carries it, else ConfigError."""
    if not isinstance(value, tuple) or len(value) != 2:
        raise ConfigError(f"a partition must be a (topic, partition) tuple, not {value!r}")
    topic, partition = value
    number = _integer("partition", partition)
    if not 0 <= number <= INT32_MAX:
        raise ConfigError(f"partition {number} is outside 0..{INT32_MAX}")
    return _text("topic", topic), number


def _topic_names(values: object) -> list[str]:
    # A str is a sequence of one-character strs: "orders" would ask for "o", "r", ...
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise ConfigError(f"names must be a list of topic names, not {type(values).__name__}")
    return [_text("topic name", value) for value in values]


def _configs(config: object) -> list[common_pb2.ConfigEntry]:
    if config is None:
        return []
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"config must be a mapping of names to values, not {type(config).__name__}"
        )
    entries = []
    for key, value in config.items():
        name = _text("a config name", key)
        # Integers (retention.ms=3600000) and bools (unclean.leader.election.enable=True)
        # are welcome and sent as text, a bool as Kafka writes it: "true" / "false".
        if isinstance(value, bool):
            text = "true" if value else "false"
        else:
            text = value if isinstance(value, str) else str(_integer(f"config {name!r}", value))
        entries.append(common_pb2.ConfigEntry(name=name, value=_text(f"config {name!r}", text)))
    return entries


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


def change_deadline_s(timeout_ms: int) -> float:
    """The SDK's deadline for an admin change it sends with ``timeout_ms``."""
    return timeout_ms / 1000 + CHANGE_DEADLINE_MARGIN_S


class Admin:
    """Administrative calls through one gateway. Thread-safe; ``close()`` is a no-op kept
    for symmetry (the connection is shared per process)."""

    def __init__(self, gateway: str | None = None, *, timeout_ms: int = 30_000) -> None:
        if gateway is not None:
            _text("gateway", gateway)
        # Sent as int32 with admin changes; 0 would mean "no time at all" to gRPC here but
        # "the server's default" to the gateway.
        timeout_ms = _integer("timeout_ms", timeout_ms)
        if not 1 <= timeout_ms <= INT32_MAX:
            raise ConfigError(f"timeout_ms must be between 1 and {INT32_MAX}, not {timeout_ms}")
        self._pid = current_pid()
        self._connection = GatewayConnection.get(gateway, timeout_ms)
        self._timeout_ms = timeout_ms

    @property
    def _conn(self) -> GatewayConnection:
        """The connection, for a call: refused (ConfigError) in a child made by os.fork()
        after this Admin was made. Its channel is the parent's there, and a call on it hung
        whenever another thread of the parent was in a call at the fork."""
        check_same_process(self._pid, "Admin")
        return self._connection

    @property
    def gateway(self) -> str:
        return self._connection.address

    # --- topics ---------------------------------------------------------------------------

    def _change(self, method: Any, request: Any, what: str) -> Any:
        """Send an admin change (``timeout_ms`` is the gateway's budget for it) and raise
        the error of its first topic that failed.

        A timeout, of the gateway's call to the controller or of our own deadline, does not
        mean nothing happened: the controller may have made the change and still been
        waiting for the replicas, or its answer may have been on its way. Kafka says the
        same ("the operation may have been completed on the broker").
        """
        try:
            response = self._conn.call(
                method, request, what, timeout_s=change_deadline_s(self._timeout_ms)
            )
            for result in response.topics:
                raise_for(result.error, what)
            return response
        except RequestTimedOutError as exc:
            raise RequestTimedOutError(
                f"{exc.message}; the change may still have been made: check before retrying"
            ) from None

    def create_topic(
        self,
        name: str,
        partitions: int = 1,
        replication_factor: int = 1,
        config: Mapping[str, str] | None = None,
    ) -> None:
        topic = controller_pb2.CreatableTopic(
            name=_text("topic name", name),
            num_partitions=_int32("partitions", partitions, InvalidPartitionsError),
            replication_factor=_int32(
                "replication_factor", replication_factor, InvalidReplicationFactorError
            ),
            configs=_configs(config),
        )
        self._change(
            self._conn.stub.CreateTopics,
            controller_pb2.CreateTopicsRequest(topics=[topic], timeout_ms=self._timeout_ms),
            f"create topic {name!r}",
        )

    def delete_topic(self, name: str) -> None:
        self._change(
            self._conn.stub.DeleteTopics,
            controller_pb2.DeleteTopicsRequest(
                names=[_text("topic name", name)], timeout_ms=self._timeout_ms
            ),
            f"delete topic {name!r}",
        )

    def create_partitions(self, name: str, count: int) -> None:
        """Grow ``name`` to ``count`` partitions in total."""
        increase = controller_pb2.PartitionIncrease(
            name=_text("topic name", name), count=_int32("count", count, InvalidPartitionsError)
        )
        self._change(
            self._conn.stub.CreatePartitions,
            controller_pb2.CreatePartitionsRequest(topics=[increase], timeout_ms=self._timeout_ms),
            f"create partitions of {name!r}",
        )

    def alter_topic_config(
        self,
        name: str,
        set_configs: Mapping[str, str] | None = None,
        delete_configs: Sequence[str] | None = (),
        *,
        validate_only: bool = False,
    ) -> dict[str, str]:
        """Set (``set_configs``) and remove (``delete_configs``) config overrides of topic
        ``name`` (Kafka's ``incrementalAlterConfigs`` SET and DELETE): a removed setting
        returns to its default. The change is checked as a whole and made all or nothing;
        brokers apply it to the topic's logs at once. Returns the topic's overrides
        afterwards (with ``validate_only``, what they would be; nothing changes)."""
        if delete_configs is None:  # as set_configs takes None
            delete_configs = ()
        if isinstance(delete_configs, str | bytes) or not isinstance(delete_configs, Iterable):
            raise ConfigError(
                "delete_configs must be a sequence of config names, not "
                f"{type(delete_configs).__name__}"
            )
        change = controller_pb2.AlterableTopicConfig(
            name=_text("topic name", name),
            set=_configs(set_configs),
            delete=[_text("config name", d) for d in delete_configs],
        )
        what = f"alter the config of topic {name!r}"
        request = controller_pb2.IncrementalAlterConfigsRequest(
            topics=[change], validate_only=validate_only, timeout_ms=self._timeout_ms
        )
        response = self._change(self._conn.stub.IncrementalAlterConfigs, request, what)
        return {c.name: c.value for c in response.topics[0].configs}

    def list_topics(self) -> list[str]:
        return sorted(self._conn.partition_counts())

    def describe_topics(self, names: Sequence[str] = ()) -> list[TopicDescription]:
        """``names`` (all topics when empty; each once, in the order named), with offsets
        from each partition's leader. A list longer than a request takes is asked in
        several (it failed whole with INVALID_REQUEST; found by an audit)."""
        wanted = list(dict.fromkeys(_topic_names(names)))
        chunks = [
            wanted[start : start + MAX_TOPICS_PER_REQUEST]
            for start in range(0, len(wanted), MAX_TOPICS_PER_REQUEST)
        ] or [[]]
        described: list[TopicDescription] = []
        for chunk in chunks:
            response: gateway_pb2.DescribeTopicsResponse = self._conn.call(
                self._conn.stub.DescribeTopics,
                gateway_pb2.DescribeTopicsRequest(names=chunk),
                "describe topics",
            )
            for topic in response.topics:
                raise_for(topic.error, f"describe topic {topic.name!r}")
            described += [_describe(t) for t in response.topics]
        return described

    def describe_topic(self, name: str) -> TopicDescription:
        (topic,) = self.describe_topics([_text("topic name", name)])
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
            gateway_pb2.FetchOffsetsRequest(group_id=_text("group_id", group_id)),
            f"offsets of group {group_id!r}",
        )
        committed = list(response.offsets)
        latest: dict[tuple[str, int], int] = {}
        if committed:
            known = set(self._conn.partition_counts())
            asked = [(c.topic, c.partition) for c in committed if c.topic in known]
            try:
                # Best effort, per partition: an offline one shows no HW (Kafka's "-"),
                # the others theirs. One failing used to cost the whole answer 30 s of
                # retries and every partition its HW and lag.
                found = self._conn.list_offsets(asked, common_pb2.LATEST, partial=True)
                latest = {tp: offset for tp, (offset, _) in found.items()}
            except TidelogError:  # the offsets still show
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

    def describe_group_members(self, group_id: str) -> GroupDescription:
        """The group's membership (members whose session ended are left out)."""
        response: gateway_pb2.DescribeGroupResponse = self._conn.call(
            self._conn.stub.DescribeGroup,
            gateway_pb2.DescribeGroupRequest(group_id=_text("group_id", group_id)),
            f"describe group {group_id!r}",
        )
        return GroupDescription(
            group_id=response.group_id,
            state=response.state,
            generation=response.generation_id,
            members=tuple(
                GroupMemberDescription(
                    member_id=m.member_id,
                    client_id=m.client_id,
                    topics=tuple(m.topics),
                    assignment=tuple((tp.topic, tp.partition) for tp in m.assignment),
                    group_instance_id=m.group_instance_id,
                )
                for m in response.members
            ),
        )

    def list_offsets(
        self, partitions: Iterable[tuple[str, int]], spec: str | int, *, partial: bool = False
    ) -> dict[tuple[str, int], int]:
        """Kafka's listOffsets: per partition, the offset for ``spec``: "earliest" (log
        start), "latest" (high watermark), or a timestamp in ms (the first record at or
        after it; -1 where no record is that recent). With ``partial``, partitions whose
        offset could not be read now (no leader, say) are left out instead of failing the
        call after the request timeout."""
        if isinstance(partitions, str | bytes) or not isinstance(partitions, Iterable):
            raise ConfigError("partitions must be an iterable of (topic, partition) tuples")
        tps = [_partition_key(tp) for tp in partitions]
        # A missing topic or partition fails at once, as in Kafka's Admin (KAFKA-12879):
        # retried, a typo cost the whole timeout and ended in REQUEST_TIMED_OUT.
        ask = functools.partial(
            self._conn.list_offsets, tps, partial=partial, retry_unknown_topic=False
        )
        if spec == "earliest":
            found = ask(common_pb2.EARLIEST)
        elif spec == "latest":
            found = ask(common_pb2.LATEST)
        elif isinstance(spec, int) and not isinstance(spec, bool) and 0 <= spec <= INT64_MAX:
            found = ask(common_pb2.BY_TIMESTAMP, spec)
        else:
            raise ConfigError(
                f"spec {spec!r} must be 'earliest', 'latest' or a timestamp in 0..{INT64_MAX}"
            )
        return {tp: offset for tp, (offset, _) in found.items()}

    def delete_group(self, group_id: str) -> int:
        """Delete a group's committed offsets (Kafka's deleteConsumerGroups); how many.
        NonEmptyGroupError while it has members, GroupIdNotFoundError when it has none."""
        response: gateway_pb2.DeleteGroupResponse = self._conn.call(
            self._conn.stub.DeleteGroup,
            gateway_pb2.DeleteGroupRequest(group_id=_text("group_id", group_id)),
            f"delete group {group_id!r}",
        )
        return int(response.offsets_deleted)

    def alter_group_offsets(self, group_id: str, offsets: Mapping[tuple[str, int], int]) -> None:
        """Set a group's committed offsets (Kafka's alterConsumerGroupOffsets): refused
        while the group has members (UnknownMemberIdError: only they may commit)."""
        if not isinstance(offsets, Mapping):
            raise ConfigError("offsets must be a mapping of (topic, partition) to offset")
        checked: dict[tuple[str, int], int] = {}
        for tp, offset in offsets.items():
            number = _integer("offset", offset)
            if not 0 <= number <= INT64_MAX:
                raise ConfigError(f"offset {number} is outside 0..{INT64_MAX}")
            checked[_partition_key(tp)] = number
        self._conn.commit_offsets(_text("group_id", group_id), checked)

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
