"""Errors raised by the tidelog SDK and shared code, one class per stable error code.

Codes are Kafka's numbers where the concept is Kafka's, so operators can look them up in
Kafka's documentation; they are mirrored by the ``tidelog.v1.ErrorCode`` protobuf enum
(a test keeps the two identical).

Hierarchy::

    TidelogError                      code, retriable, message
    ├── (one subclass per ErrorCode, e.g. CorruptBatchError, NotLeaderOrFollowerError)
    ├── ConfigError                   bad arguments given to the SDK itself (INVALID_REQUEST)
    │   └── ConcurrentAccessError     a Consumer used by two threads at once (CONCURRENT_ACCESS)
    └── WakeupError                   Consumer.wakeup() interrupted a blocking call (WAKEUP)

Errors that only the SDK raises, for no server's answer, and that no wire code fits have a
``ClientErrorCode`` instead: never sent, so not in the protobuf enum.

``retriable`` says whether the same request may succeed if sent again later (after a
metadata refresh, a leader election or a backoff): a client retries those and surfaces the
rest at once.
"""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar, Final, cast


class ErrorCode(IntEnum):
    """Stable error codes shared by every service, the wire and the SDK."""

    NONE = 0
    UNKNOWN_SERVER_ERROR = -1
    OFFSET_OUT_OF_RANGE = 1
    CORRUPT_BATCH = 2
    UNKNOWN_TOPIC_OR_PARTITION = 3
    INVALID_FETCH_SIZE = 4
    LEADER_NOT_AVAILABLE = 5
    NOT_LEADER_OR_FOLLOWER = 6
    REQUEST_TIMED_OUT = 7
    BROKER_NOT_AVAILABLE = 8
    REPLICA_NOT_AVAILABLE = 9
    MESSAGE_TOO_LARGE = 10
    STALE_CONTROLLER_EPOCH = 11
    OFFSET_METADATA_TOO_LARGE = 12
    NETWORK_EXCEPTION = 13
    INVALID_TOPIC = 17
    RECORD_LIST_TOO_LARGE = 18
    NOT_ENOUGH_REPLICAS = 19
    NOT_ENOUGH_REPLICAS_AFTER_APPEND = 20
    INVALID_REQUIRED_ACKS = 21
    ILLEGAL_GENERATION = 22
    INVALID_GROUP_ID = 24
    UNKNOWN_MEMBER_ID = 25
    INVALID_SESSION_TIMEOUT = 26
    REBALANCE_IN_PROGRESS = 27
    INVALID_TIMESTAMP = 32
    TOPIC_ALREADY_EXISTS = 36
    INVALID_PARTITIONS = 37
    INVALID_REPLICATION_FACTOR = 38
    INVALID_REPLICA_ASSIGNMENT = 39
    INVALID_CONFIG = 40
    NOT_CONTROLLER = 41
    INVALID_REQUEST = 42
    POLICY_VIOLATION = 44
    OUT_OF_ORDER_SEQUENCE = 45
    DUPLICATE_SEQUENCE = 46
    INVALID_PRODUCER_EPOCH = 47
    STORAGE_ERROR = 56
    UNKNOWN_PRODUCER_ID = 59
    FENCED_LEADER_EPOCH = 74
    UNKNOWN_LEADER_EPOCH = 75
    NON_EMPTY_GROUP = 68
    GROUP_ID_NOT_FOUND = 69
    FETCH_SESSION_ID_NOT_FOUND = 70
    INVALID_FETCH_SESSION_EPOCH = 71
    STALE_BROKER_EPOCH = 77
    OFFSET_NOT_AVAILABLE = 78
    MEMBER_ID_REQUIRED = 79
    PREFERRED_LEADER_NOT_AVAILABLE = 80
    GROUP_MAX_SIZE_REACHED = 81
    FENCED_INSTANCE_ID = 82
    ELIGIBLE_LEADERS_NOT_AVAILABLE = 83
    ELECTION_NOT_NEEDED = 84
    INVALID_RECORD = 87
    INVALID_UPDATE_VERSION = 95
    INCONSISTENT_TOPIC_ID = 103


class ClientErrorCode(IntEnum):
    """Stable codes of errors the SDK raises itself and that are never on the wire.

    Negative and from -1000 down, as librdkafka numbers its client-local errors below the
    broker's: a wire code is 0 or more, or -1, so the two sets never meet (checked at
    import; equal IntEnum values compare equal). A number is never reused."""

    WAKEUP = -1000
    CONCURRENT_ACCESS = -1001


assert not {int(c) for c in ClientErrorCode} & {int(c) for c in ErrorCode}


# Codes whose failures can clear up by themselves: a retry after backoff or a metadata
# refresh may succeed. Everything else is a property of the request and is final.
RETRIABLE_CODES: frozenset[ErrorCode] = frozenset(
    {
        ErrorCode.CORRUPT_BATCH,  # corrupted in transit: resending the intact batch works
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,  # metadata may not have propagated yet
        ErrorCode.LEADER_NOT_AVAILABLE,
        ErrorCode.NOT_LEADER_OR_FOLLOWER,
        ErrorCode.REQUEST_TIMED_OUT,
        ErrorCode.BROKER_NOT_AVAILABLE,
        ErrorCode.REPLICA_NOT_AVAILABLE,
        ErrorCode.NETWORK_EXCEPTION,
        ErrorCode.NOT_ENOUGH_REPLICAS,
        ErrorCode.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        ErrorCode.NOT_CONTROLLER,
        ErrorCode.STORAGE_ERROR,
        ErrorCode.FENCED_LEADER_EPOCH,
        ErrorCode.UNKNOWN_LEADER_EPOCH,
        ErrorCode.OFFSET_NOT_AVAILABLE,
        ErrorCode.PREFERRED_LEADER_NOT_AVAILABLE,
        ErrorCode.ELIGIBLE_LEADERS_NOT_AVAILABLE,
    }
)


class TidelogError(Exception):
    """Base of every error the SDK raises. ``code`` is stable; ``message`` is for people."""

    code: ClassVar[ErrorCode] = ErrorCode.UNKNOWN_SERVER_ERROR

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.code.name)
        self.message = message or self.code.name

    @property
    def retriable(self) -> bool:
        return self.code in RETRIABLE_CODES

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class UnknownServerError(TidelogError):
    code = ErrorCode.UNKNOWN_SERVER_ERROR


class OffsetOutOfRangeError(TidelogError):
    code = ErrorCode.OFFSET_OUT_OF_RANGE


class CorruptBatchError(TidelogError):
    code = ErrorCode.CORRUPT_BATCH


class UnknownTopicOrPartitionError(TidelogError):
    code = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION


class InvalidFetchSizeError(TidelogError):
    code = ErrorCode.INVALID_FETCH_SIZE


class LeaderNotAvailableError(TidelogError):
    code = ErrorCode.LEADER_NOT_AVAILABLE


class NotLeaderOrFollowerError(TidelogError):
    code = ErrorCode.NOT_LEADER_OR_FOLLOWER


class RequestTimedOutError(TidelogError):
    code = ErrorCode.REQUEST_TIMED_OUT


class BrokerNotAvailableError(TidelogError):
    code = ErrorCode.BROKER_NOT_AVAILABLE


class ReplicaNotAvailableError(TidelogError):
    code = ErrorCode.REPLICA_NOT_AVAILABLE


class MessageTooLargeError(TidelogError):
    code = ErrorCode.MESSAGE_TOO_LARGE


class StaleControllerEpochError(TidelogError):
    code = ErrorCode.STALE_CONTROLLER_EPOCH


class OffsetMetadataTooLargeError(TidelogError):
    code = ErrorCode.OFFSET_METADATA_TOO_LARGE


class NetworkError(TidelogError):
    code = ErrorCode.NETWORK_EXCEPTION


class InvalidTopicError(TidelogError):
    code = ErrorCode.INVALID_TOPIC


class RecordListTooLargeError(TidelogError):
    code = ErrorCode.RECORD_LIST_TOO_LARGE


class NotEnoughReplicasError(TidelogError):
    code = ErrorCode.NOT_ENOUGH_REPLICAS


class NotEnoughReplicasAfterAppendError(TidelogError):
    code = ErrorCode.NOT_ENOUGH_REPLICAS_AFTER_APPEND


class InvalidRequiredAcksError(TidelogError):
    code = ErrorCode.INVALID_REQUIRED_ACKS


class IllegalGenerationError(TidelogError):
    """A group member named a generation that is not the group's current one: the
    group rebalanced since it joined, and its partitions may be someone else's."""

    code = ErrorCode.ILLEGAL_GENERATION


class InvalidGroupIdError(TidelogError):
    code = ErrorCode.INVALID_GROUP_ID


class UnknownMemberIdError(TidelogError):
    """The member is not in the group: it left, or its session ended (no heartbeat
    within the session timeout) and the group went on without it."""

    code = ErrorCode.UNKNOWN_MEMBER_ID


class InvalidSessionTimeoutError(TidelogError):
    code = ErrorCode.INVALID_SESSION_TIMEOUT


class RebalanceInProgressError(TidelogError):
    """The group is rebalancing: its members give up their partitions and join again."""

    code = ErrorCode.REBALANCE_IN_PROGRESS


class GroupMaxSizeReachedError(TidelogError):
    code = ErrorCode.GROUP_MAX_SIZE_REACHED


class NonEmptyGroupError(TidelogError):
    """The group has members: an operation that needs it inactive (deleting it,
    resetting its offsets) waits until they stop."""

    code = ErrorCode.NON_EMPTY_GROUP


class GroupIdNotFoundError(TidelogError):
    code = ErrorCode.GROUP_ID_NOT_FOUND


class MemberIdRequiredError(TidelogError):
    """A first JoinGroup's answer: join again naming the member id it carries (KIP-394)."""

    code = ErrorCode.MEMBER_ID_REQUIRED


class FencedInstanceIdError(TidelogError):
    """Another consumer with the same ``group_instance_id`` joined the group and took this
    one's place (Kafka's FencedInstanceIdException): fatal for this consumer."""

    code = ErrorCode.FENCED_INSTANCE_ID


class InvalidTimestampError(TidelogError):
    code = ErrorCode.INVALID_TIMESTAMP


class TopicAlreadyExistsError(TidelogError):
    code = ErrorCode.TOPIC_ALREADY_EXISTS


class InvalidPartitionsError(TidelogError):
    code = ErrorCode.INVALID_PARTITIONS


class InvalidReplicationFactorError(TidelogError):
    code = ErrorCode.INVALID_REPLICATION_FACTOR


class InvalidReplicaAssignmentError(TidelogError):
    code = ErrorCode.INVALID_REPLICA_ASSIGNMENT


class InvalidConfigError(TidelogError):
    code = ErrorCode.INVALID_CONFIG


class NotControllerError(TidelogError):
    code = ErrorCode.NOT_CONTROLLER


class InvalidRequestError(TidelogError):
    code = ErrorCode.INVALID_REQUEST


class PolicyViolationError(TidelogError):
    code = ErrorCode.POLICY_VIOLATION


class OutOfOrderSequenceError(TidelogError):
    code = ErrorCode.OUT_OF_ORDER_SEQUENCE


class DuplicateSequenceError(TidelogError):
    code = ErrorCode.DUPLICATE_SEQUENCE


class InvalidProducerEpochError(TidelogError):
    code = ErrorCode.INVALID_PRODUCER_EPOCH


class StorageError(TidelogError):
    code = ErrorCode.STORAGE_ERROR


class UnknownProducerIdError(TidelogError):
    code = ErrorCode.UNKNOWN_PRODUCER_ID


class FencedLeaderEpochError(TidelogError):
    code = ErrorCode.FENCED_LEADER_EPOCH


class UnknownLeaderEpochError(TidelogError):
    code = ErrorCode.UNKNOWN_LEADER_EPOCH


class StaleBrokerEpochError(TidelogError):
    code = ErrorCode.STALE_BROKER_EPOCH


class FetchSessionIdNotFoundError(TidelogError):
    """The leader holds no fetch session of that id (evicted, or the leader restarted):
    the follower fetches in full again, opening a new one (KIP-227)."""

    code = ErrorCode.FETCH_SESSION_ID_NOT_FOUND


class InvalidFetchSessionEpochError(TidelogError):
    """A fetch session's request is not the one the leader expects next (a lost answer,
    or two fetches at once): the follower fetches in full again (KIP-227)."""

    code = ErrorCode.INVALID_FETCH_SESSION_EPOCH


class OffsetNotAvailableError(TidelogError):
    code = ErrorCode.OFFSET_NOT_AVAILABLE


class PreferredLeaderNotAvailableError(TidelogError):
    """A preferred election's preferred replica is not live and in sync (Kafka's code 80;
    retriable: it may catch up and rejoin the ISR)."""

    code = ErrorCode.PREFERRED_LEADER_NOT_AVAILABLE


class EligibleLeadersNotAvailableError(TidelogError):
    code = ErrorCode.ELIGIBLE_LEADERS_NOT_AVAILABLE


class ElectionNotNeededError(TidelogError):
    code = ErrorCode.ELECTION_NOT_NEEDED


class InvalidRecordError(TidelogError):
    code = ErrorCode.INVALID_RECORD


class InvalidUpdateVersionError(TidelogError):
    code = ErrorCode.INVALID_UPDATE_VERSION


class InconsistentTopicIdError(TidelogError):
    """The request names an incarnation of the topic other than the one the broker hosts:
    the topic was deleted and created again since the records were queued. Final: the
    records belong to a topic that is gone."""

    code = ErrorCode.INCONSISTENT_TOPIC_ID


class ConfigError(InvalidRequestError):
    """Bad arguments given to an SDK call; raised before anything is sent."""


class WakeupError(TidelogError):
    """``Consumer.wakeup()`` (from another thread or a signal handler) interrupted the
    consumer's blocking call, as Kafka's WakeupException: nothing failed, the caller
    asked to stop waiting. The consumer stays usable. Never on the wire."""

    # Typed as the base's ErrorCode so that the servers' error helpers (services.status,
    # which only ever see wire errors) keep their exact types: this error never reaches
    # them, and error_for_code never makes it (_CLIENT_ONLY).
    code = cast(ErrorCode, ClientErrorCode.WAKEUP)


class ConcurrentAccessError(ConfigError):
    """A call on a Consumer from a second thread while another thread is in a call on it
    (Kafka's ConcurrentModificationException): refused at once, nothing changed. A
    ConfigError, as it is a misuse of the SDK; its own code says which. Never on the
    wire."""

    code = cast(ErrorCode, ClientErrorCode.CONCURRENT_ACCESS)  # as WakeupError's


# SDK-side refinements: no wire code maps to them.
_CLIENT_ONLY: Final = (TidelogError, ConfigError, WakeupError, ConcurrentAccessError)


def _build_registry() -> dict[ErrorCode, type[TidelogError]]:
    registry: dict[ErrorCode, type[TidelogError]] = {}
    pending: list[type[TidelogError]] = [TidelogError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        # The first class found for a code is its canonical one; client-only classes are
        # refinements.
        if cls not in _CLIENT_ONLY:
            registry.setdefault(cls.code, cls)
    return registry


_BY_CODE = _build_registry()


REROUTE_CODES: Final = frozenset(
    {
        ErrorCode.NOT_LEADER_OR_FOLLOWER,
        ErrorCode.FENCED_LEADER_EPOCH,
        ErrorCode.UNKNOWN_LEADER_EPOCH,
        ErrorCode.LEADER_NOT_AVAILABLE,
        # The leader named by the metadata has not heard of its new role yet.
        ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
        ErrorCode.NETWORK_EXCEPTION,
        ErrorCode.BROKER_NOT_AVAILABLE,
        ErrorCode.REPLICA_NOT_AVAILABLE,
        ErrorCode.OFFSET_NOT_AVAILABLE,
    }
)
"""A leader's answers that mean "ask again, maybe elsewhere": the request itself was fine.
The gateway's router re-routes exactly these, and so do clients that call leaders
themselves (the Spark connector's ``direct`` mode)."""


def error_for_code(code: int, message: str = "") -> TidelogError:
    """The exception for a wire error code; unknown codes become UnknownServerError."""
    try:
        cls = _BY_CODE[ErrorCode(code)]
    except (ValueError, KeyError):
        return UnknownServerError(message or f"unknown error code {code}")
    return cls(message)


# Every code except NONE has exactly one canonical class.
assert set(_BY_CODE) == set(ErrorCode) - {ErrorCode.NONE}, set(ErrorCode) - set(_BY_CODE)
