"""Cluster metadata in etcd: the key layout and the value codecs, in one place.

``docs/METADATA.md`` describes the layout for people; this module is what the code uses.
Keys are relative to the cluster root that ``MetaStore`` adds (``/tidelog/<cluster>/``).
Values are UTF-8 JSON objects; readers ignore unknown fields.

Epochs that etcd assigns are taken from revisions, not from values: a broker's epoch is
its registration key's create revision, the controller epoch is the election key's create
revision. Both only grow, and a new incarnation always gets a larger one.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from services.controller.state import Broker, PartitionRecord, Topic
from services.metastore import KeyValue
from tidelog.errors import StorageError

_T = TypeVar("_T")

BROKERS_PREFIX: Final = "brokers/"
CONTROLLER_KEY: Final = "controller"
TOPICS_PREFIX: Final = "topics/"
PARTITIONS_PREFIX: Final = "partitions/"
GROUPS_PREFIX: Final = "groups/"
# Consumer group membership (services/gateway/group_coordinator.py): one state key per
# group, and one key per member bound to the member's session lease. Outside GROUPS_PREFIX,
# whose keys are all committed offsets.
GROUP_STATES_PREFIX: Final = "group-states/"
GROUP_SESSIONS_PREFIX: Final = "group-sessions/"
# Rewritten with a group's state whenever its members or generation change: commits
# compare it, so the many state writes of a rebalance (each member's join) do not fail them.
GROUP_FENCES_PREFIX: Final = "group-fences/"
# A rebalance's deadline: bound to a lease of the rebalance timeout, gone when it passed.
GROUP_REBALANCES_PREFIX: Final = "group-rebalances/"
# When the controller first saw a group without members (KIP-211: offsets expire a
# retention after the group emptied, not after its last commit). The gateway deletes it
# when a group empties again, so the next expiry pass marks the later time.
GROUP_EMPTIED_PREFIX: Final = "group-emptied/"
CLUSTER_ID_KEY: Final = "cluster_id"
PRODUCER_IDS_KEY: Final = "producer_ids"


def committed_offset_owner(kv: KeyValue) -> tuple[str, str | None] | None:
    """The topic name and topic id (None: written before offsets carried one) of a
    ``groups/<group>/<topic>/<p>`` key; None when the key or value is not one.
    The value format is the gateway's (``services/gateway/groups.py``); the controller
    reads this much of it to delete a deleted topic's offsets."""
    parts = kv.key.removeprefix(GROUPS_PREFIX).split("/")
    if not kv.key.startswith(GROUPS_PREFIX) or len(parts) != 3:
        return None
    try:
        topic_id = json.loads(kv.value).get("topic_id")
    except (ValueError, AttributeError):
        return None
    return parts[1], None if topic_id is None else str(topic_id)


def committed_offset_time_ms(kv: KeyValue) -> int | None:
    """When a ``groups/<group>/<topic>/<p>`` offset was committed (the gateway's wall
    clock, ms); None when the value has no time (written before commits carried one)."""
    try:
        value = json.loads(kv.value).get("commit_time_ms")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def group_of_offset_key(key: str) -> str:
    """The group part (percent-encoded, as in every group key) of an offset key."""
    return key.removeprefix(GROUPS_PREFIX).split("/", 1)[0]


def group_state_key(encoded_group: str) -> str:
    """A group's membership state key (1.8), from its percent-encoded id."""
    return f"{GROUP_STATES_PREFIX}{encoded_group}"


def group_fence_key(encoded_group: str) -> str:
    return f"{GROUP_FENCES_PREFIX}{encoded_group}"


def group_timer_key(encoded_group: str) -> str:
    return f"{GROUP_REBALANCES_PREFIX}{encoded_group}"


def group_emptied_key(encoded_group: str) -> str:
    return f"{GROUP_EMPTIED_PREFIX}{encoded_group}"


def group_of_session_key(key: str) -> str:
    """The group part (percent-encoded) of a ``group-sessions/<group>/<member>`` key."""
    return key.removeprefix(GROUP_SESSIONS_PREFIX).split("/", 1)[0]


def broker_key(broker_id: int) -> str:
    return f"{BROKERS_PREFIX}{broker_id}"


def topic_key(name: str) -> str:
    return f"{TOPICS_PREFIX}{name}"


def partitions_prefix(topic: str) -> str:
    """The exact prefix of one topic's partition keys (names never contain ``/``)."""
    return f"{PARTITIONS_PREFIX}{topic}/"


def partition_key(topic: str, partition: int) -> str:
    return f"{partitions_prefix(topic)}{partition}"


def _dump(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def _decoder(decode: Callable[[KeyValue], _T]) -> Callable[[KeyValue], _T]:
    """Makes ``decode`` raise StorageError naming the key for any malformed value (a
    missing field, a string where a number belongs, a null list): one error type for
    callers, and a message that tells an operator which key to repair."""

    @functools.wraps(decode)
    def wrapper(kv: KeyValue) -> _T:
        try:
            return decode(kv)
        except StorageError:
            raise
        except KeyError as exc:
            raise StorageError(f"metadata key {kv.key!r} lacks the field {exc}") from None
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:
            # OverflowError: a JSON number past a float's range reads as inf, and int(inf)
            # raised out of here; one such broker key kept every controller from taking
            # office (found by an audit).
            raise StorageError(f"metadata key {kv.key!r} is malformed: {exc}") from None

    return wrapper


def _load(kv: KeyValue) -> dict[str, Any]:
    try:
        value = json.loads(kv.value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StorageError(f"metadata key {kv.key!r} does not hold JSON: {exc}") from None
    if not isinstance(value, dict):
        raise StorageError(f"metadata key {kv.key!r} does not hold a JSON object")
    return value


# --- brokers ------------------------------------------------------------------------------


def encode_broker(broker: Broker) -> bytes:
    return _dump(
        {
            "host": broker.host,
            "port": broker.port,
            "rack": broker.rack or None,
            "broker_epoch": broker.epoch,
        }
    )


@_decoder
def decode_broker(kv: KeyValue) -> Broker:
    value = _load(kv)
    broker_id = int(kv.key.removeprefix(BROKERS_PREFIX))
    # The create revision is the authority for the epoch (the field is for people).
    return Broker(
        broker_id=broker_id,
        host=str(value["host"]),
        port=int(value["port"]),
        rack=str(value.get("rack") or ""),
        epoch=kv.create_revision,
    )


# --- the controller election key ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ControllerInfo:
    """The active controller as its election key says: id, gRPC address and epoch."""

    controller_id: int
    address: str
    epoch: int


def encode_controller(controller_id: int, address: str) -> bytes:
    return _dump({"id": controller_id, "address": address})


@_decoder
def decode_controller(kv: KeyValue) -> ControllerInfo:
    value = _load(kv)
    return ControllerInfo(
        controller_id=int(value["id"]),
        address=str(value["address"]),
        epoch=kv.create_revision,
    )


# --- topics and partitions ------------------------------------------------------------------


def encode_topic(topic: Topic) -> bytes:
    return _dump(
        {
            "topic_id": topic.topic_id,
            "partitions": topic.partition_count,
            "replication_factor": topic.replication_factor,
            "configs": dict(topic.configs),
            "assignment": [list(replicas) for replicas in topic.assignment],
        }
    )


@_decoder
def decode_topic(kv: KeyValue) -> Topic:
    value = _load(kv)
    return Topic(
        name=kv.key.removeprefix(TOPICS_PREFIX),
        topic_id=str(value["topic_id"]),
        assignment=tuple(tuple(int(b) for b in replicas) for replicas in value["assignment"]),
        configs={str(k): str(v) for k, v in value.get("configs", {}).items()},
    )


def encode_partition(record: PartitionRecord) -> bytes:
    value: dict[str, object] = {
        "leader": record.leader,
        "leader_epoch": record.leader_epoch,
        "isr": list(record.isr),
        "partition_epoch": record.partition_epoch,
    }
    if record.isr_epochs:
        value["isr_epochs"] = list(record.isr_epochs)
    return _dump(value)


@_decoder
def decode_partition(kv: KeyValue) -> tuple[str, int, PartitionRecord]:
    """``(topic, partition, record)`` from a ``partitions/<topic>/<p>`` key."""
    topic, _, partition = kv.key.removeprefix(PARTITIONS_PREFIX).rpartition("/")
    value = _load(kv)
    isr = tuple(int(b) for b in value["isr"])
    epochs = tuple(int(e) for e in value.get("isr_epochs", ()))
    record = PartitionRecord(
        leader=int(value["leader"]),
        leader_epoch=int(value["leader_epoch"]),
        isr=isr,
        partition_epoch=int(value["partition_epoch"]),
        # Kept only when they pair with the ISR (absent in records written before).
        isr_epochs=epochs if len(epochs) == len(isr) else (),
    )
    return topic, int(partition), record


# --- pending topic deletions ----------------------------------------------------------------

DELETIONS_PREFIX: Final = "deletions/"


def deletion_key(topic: str) -> str:
    return f"{DELETIONS_PREFIX}{topic}"


@dataclass(frozen=True, slots=True)
class PendingDeletion:
    """A deleted topic whose replicas may still be on brokers' disks (``deletions/<t>``).

    Written in the same transaction that deletes the topic, removed once every replica on
    a registered broker acknowledged StopReplica(delete_partition=true); brokers that are
    down are not waited for (they delete their logs as strays when they return,
    ``services/storage/strays.py``). While it exists the name cannot be reused.
    """

    topic: str
    topic_id: str
    assignment: tuple[tuple[int, ...], ...]


def encode_deletion(deletion: PendingDeletion) -> bytes:
    return _dump(
        {
            "topic_id": deletion.topic_id,
            "assignment": [list(replicas) for replicas in deletion.assignment],
        }
    )


@_decoder
def decode_deletion(kv: KeyValue) -> PendingDeletion:
    value = _load(kv)
    return PendingDeletion(
        topic=kv.key.removeprefix(DELETIONS_PREFIX),
        topic_id=str(value["topic_id"]),
        assignment=tuple(tuple(int(b) for b in replicas) for replicas in value["assignment"]),
    )


# --- the cluster id ---------------------------------------------------------------------------


def encode_cluster_id(cluster_id: str) -> bytes:
    return _dump({"cluster_id": cluster_id})


@_decoder
def decode_cluster_id(kv: KeyValue) -> str:
    return str(_load(kv)["cluster_id"])


# --- producer id blocks ---------------------------------------------------------------------


def encode_producer_ids(next_block_start: int) -> bytes:
    """``producer_ids``: the first id not yet handed out in any block.

    Only the active controller writes it, in a guarded transaction that compares its
    mod_revision (compare-and-swap), and only ever forward: every block below it was given
    out (or lost to a write of unknown outcome), none is given out twice. Absent = 0.
    """
    return _dump({"next_block_start": next_block_start})


@_decoder
def decode_producer_ids(kv: KeyValue) -> int:
    value = int(_load(kv)["next_block_start"])
    if value < 0:
        raise StorageError(f"metadata key {kv.key!r} holds a negative next_block_start")
    return value
