"""Options of the ``tidelog`` Spark data source, parsed and checked before any I/O.

The names and meanings are those of Spark's Kafka source (``subscribe``, ``assign``,
``startingOffsets``...), so a job moves from Kafka to tidelog by changing the format and
``kafka.bootstrap.servers`` to ``gateway``. Spark hands options over as a
case-insensitive string map; everything here takes a plain ``Mapping[str, str]`` whose
keys are already lower-cased (``normalize`` does it) and raises ``ConfigError`` with a
message naming the option for anything malformed. Nothing here talks to the cluster:
whether a topic exists is checked later, by the reader, against the gateway's metadata.

Unlike Spark's Kafka source, an option name this source does not know is refused (with
the closest known name): a misspelt ``startingOffset`` would otherwise silently read from
the default position. The names Spark itself puts in the map (``SPARK_OPTIONS``) pass.

Offsets in JSON follow Kafka's conventions: ``{"topicA": {"0": 23, "1": -2}}`` where
-2 means earliest and -1 latest.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from tidelog.errors import ConfigError, InvalidTopicError
from tidelog.topics import validate_topic_name

EARLIEST: Final = -2
"""Kafka's offset sentinel for the log start offset, in JSON offset specs."""
LATEST: Final = -1
"""Kafka's offset sentinel for the end of the log (the high watermark), in JSON specs."""

DEFAULT_GATEWAY: Final = "127.0.0.1:9094"
"""Where ``tidelog dev`` serves the gateway; used when neither option nor env is given."""

MAX_OFFSETS_PER_TRIGGER_LIMIT: Final = 2**62
"""Upper bound accepted for ``maxOffsetsPerTrigger`` (keeps offset arithmetic in int64)."""

MAX_MIN_PARTITIONS: Final = 100_000
"""Upper bound for ``minPartitions``: more splits than this only costs scheduling."""

READ_OPTIONS: Final = (
    "gateway",
    "subscribe",
    "subscribePattern",
    "assign",
    "startingOffsets",
    "endingOffsets",
    "startingTimestamp",
    "startingOffsetsByTimestamp",
    "startingOffsetsByTimestampStrategy",
    "maxOffsetsPerTrigger",
    "minPartitions",
    "failOnDataLoss",
    "includeHeaders",
    "groupId",
    "fetchMaxBytes",
    "requestTimeoutMs",
    "direct",
)
"""Every option a read takes (``parse_read_options``), as documented in docs/SPARK.md."""

WRITE_OPTIONS: Final = (
    "gateway",
    "topic",
    "acks",
    "batchBytes",
    "compression",
    "deliveryGuarantee",
    "requestTimeoutMs",
    "direct",
)
"""Every option a write takes (``parse_write_options``)."""

SPARK_OPTIONS: Final = frozenset({"path", "paths", "checkpointlocation", "queryname"})
"""Names Spark adds to a data source's options itself, lower-cased: ``path`` / ``paths``
from ``load(path)`` and ``save(path)``, ``checkpointLocation`` and ``queryName`` from
``writeStream`` (measured on Spark 4). They mean nothing to tidelog and are ignored."""

Selector = Literal["subscribe", "subscribePattern", "assign"]

# A per-partition spec: offsets (>= 0) or the EARLIEST / LATEST sentinels.
PartitionOffsets = dict[tuple[str, int], int]


@dataclass(frozen=True, slots=True)
class OffsetSpec:
    """Where to start or end: ``"earliest"``, ``"latest"``, or explicit per partition.

    ``per_partition`` is set only for ``kind == "json"``; it must name every partition
    read, starting and ending offsets alike, whatever the topic selector (Spark's Kafka
    source refuses a partial one for ``assign`` too): a partition left out would start
    somewhere the user did not say.
    """

    kind: Literal["earliest", "latest", "json"]
    per_partition: PartitionOffsets | None = None


@dataclass(frozen=True, slots=True)
class TimestampSpec:
    """Start (or end) at the first offset whose timestamp is >= a time, in ms since epoch.

    ``all_partitions_ms`` (``startingTimestamp``) wins over ``per_partition``
    (``startingOffsetsByTimestamp``), as in Spark's Kafka source ("1. global timestamp"):
    with both given only the first is kept. ``strategy`` says what happens when no
    record is that new:
    ``"error"`` fails the query, ``"latest"`` starts at the end (Kafka's names).
    """

    all_partitions_ms: int | None
    per_partition: dict[tuple[str, int], int] | None
    strategy: Literal["error", "latest"]


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """Everything a batch or streaming read needs, checked.

    Exactly one of ``topics`` (subscribe), ``pattern`` (subscribePattern) and
    ``assigned`` (assign) is set.
    """

    gateway: str
    selector: Selector
    topics: tuple[str, ...] | None
    pattern: re.Pattern[str] | None
    assigned: tuple[tuple[str, int], ...] | None
    starting: OffsetSpec
    ending: OffsetSpec
    starting_timestamp: TimestampSpec | None
    max_offsets_per_trigger: int | None
    min_partitions: int | None
    fail_on_data_loss: bool
    include_headers: bool
    group_id: str | None
    fetch_max_bytes: int
    request_timeout_ms: int
    # Tasks fetch from the partition leaders themselves, not through the gateway
    # (``tidelog.spark.direct``); planning still asks the gateway.
    direct: bool


@dataclass(frozen=True, slots=True)
class WriteOptions:
    """What a batch or streaming write needs, checked.

    ``topic`` is the default for rows without a ``topic`` column value; it may be None
    only if the data has a topic column (checked against the schema by the writer).
    ``exactly_once`` (streaming only) makes a replayed micro-batch add nothing.
    """

    gateway: str
    topic: str | None
    acks: Literal["0", "1", "all"]
    batch_bytes: int
    compression: str
    exactly_once: bool
    request_timeout_ms: int
    # Tasks append to the partition leaders themselves, not through the gateway
    # (``tidelog.spark.direct``); partition counts still come from the gateway.
    direct: bool


def normalize(options: Mapping[str, str]) -> dict[str, str]:
    """Lower-case the keys (Spark option names are case-insensitive)."""
    return {key.lower(): value for key, value in options.items()}


def parse_read_options(
    options: Mapping[str, str], *, streaming: bool, env_gateway: str | None = None
) -> ReadOptions:
    """Check the options of a read; ``streaming`` changes the defaults as Spark's does."""
    _check_names(options, READ_OPTIONS, WRITE_OPTIONS, "read")
    opts = normalize(options)
    selectors = [name for name in ("subscribe", "subscribepattern", "assign") if name in opts]
    if len(selectors) != 1:
        found = ", ".join(selectors) if selectors else "none"
        raise ConfigError(
            "exactly one of the options 'subscribe', 'subscribePattern' or 'assign' must be "
            f"set (found: {found})"
        )
    topics: tuple[str, ...] | None = None
    pattern: re.Pattern[str] | None = None
    assigned: tuple[tuple[str, int], ...] | None = None
    selector: Selector
    if selectors[0] == "subscribe":
        selector = "subscribe"
        topics = _topic_list(opts["subscribe"])
    elif selectors[0] == "subscribepattern":
        selector = "subscribePattern"
        pattern = _pattern(opts["subscribepattern"])
    else:
        selector = "assign"
        assigned = _assignment(opts["assign"])

    starting = _offset_spec(
        opts.get("startingoffsets", "latest" if streaming else "earliest"), "startingOffsets"
    )
    if not streaming and starting.kind == "latest":
        raise ConfigError("startingOffsets 'latest' is not allowed in a batch query")
    if not streaming and starting.per_partition is not None:
        for tp, offset in starting.per_partition.items():
            if offset == LATEST:
                raise ConfigError(
                    f"startingOffsets for {tp[0]}-{tp[1]} is -1 (latest), which is not allowed "
                    "in a batch query"
                )
    if "endingoffsets" in opts and streaming:
        raise ConfigError("endingOffsets is for batch queries only")
    ending = _offset_spec(opts.get("endingoffsets", "latest"), "endingOffsets")
    if ending.kind == "earliest":
        raise ConfigError("endingOffsets 'earliest' is not allowed")
    if ending.per_partition is not None:
        for tp, offset in ending.per_partition.items():
            if offset == EARLIEST:
                raise ConfigError(
                    f"endingOffsets for {tp[0]}-{tp[1]} is -2 (earliest), which is not allowed"
                )

    max_per_trigger = _optional_int(
        opts, "maxoffsetspertrigger", "maxOffsetsPerTrigger", 1, MAX_OFFSETS_PER_TRIGGER_LIMIT
    )
    if max_per_trigger is not None and not streaming:
        raise ConfigError("maxOffsetsPerTrigger is for streaming queries only")
    return ReadOptions(
        gateway=_gateway(opts, env_gateway),
        selector=selector,
        topics=topics,
        pattern=pattern,
        assigned=assigned,
        starting=starting,
        ending=ending,
        starting_timestamp=_timestamp_spec(opts),
        max_offsets_per_trigger=max_per_trigger,
        min_partitions=_optional_int(opts, "minpartitions", "minPartitions", 1, MAX_MIN_PARTITIONS),
        fail_on_data_loss=_bool(opts, "failondataloss", "failOnDataLoss", default=True),
        include_headers=_bool(opts, "includeheaders", "includeHeaders", default=False),
        group_id=_group_id(opts.get("groupid")),
        fetch_max_bytes=_optional_int(
            opts, "fetchmaxbytes", "fetchMaxBytes", 1024, 64 * 1024 * 1024
        )
        or 16 * 1024 * 1024,
        request_timeout_ms=_optional_int(
            opts, "requesttimeoutms", "requestTimeoutMs", 100, 3_600_000
        )
        or 30_000,
        direct=_bool(opts, "direct", "direct", default=False),
    )


def parse_write_options(
    options: Mapping[str, str], *, streaming: bool, env_gateway: str | None = None
) -> WriteOptions:
    """Check the options of a write."""
    _check_names(options, WRITE_OPTIONS, READ_OPTIONS, "write")
    opts = normalize(options)
    topic = opts.get("topic")
    if topic is not None:
        _checked_topic(topic, "topic")
    acks = opts.get("acks", "all").strip().lower()
    if acks == "-1":
        acks = "all"
    if acks not in ("0", "1", "all"):
        raise ConfigError(f"acks must be 0, 1 or all, not {opts['acks']!r}")
    compression = opts.get("compression", "none").strip().lower()
    if compression not in ("none", "zstd", "lz4"):
        raise ConfigError(f"compression must be none, zstd or lz4, not {compression!r}")
    exactly_once = opts.get("deliveryguarantee", "at-least-once").strip().lower()
    if exactly_once not in ("at-least-once", "exactly-once"):
        raise ConfigError(
            "deliveryGuarantee must be 'at-least-once' or 'exactly-once', not "
            f"{opts['deliveryguarantee']!r}"
        )
    if exactly_once == "exactly-once" and not streaming:
        raise ConfigError("deliveryGuarantee 'exactly-once' is for streaming writes only")
    if exactly_once == "exactly-once" and acks != "all":
        raise ConfigError("deliveryGuarantee 'exactly-once' needs acks=all")
    return WriteOptions(
        gateway=_gateway(opts, env_gateway),
        topic=topic,
        acks=acks,  # type: ignore[arg-type]  # checked just above
        batch_bytes=_optional_int(opts, "batchbytes", "batchBytes", 1024, 64 * 1024 * 1024)
        or 1024 * 1024,
        compression=compression,
        exactly_once=exactly_once == "exactly-once",
        request_timeout_ms=_optional_int(
            opts, "requesttimeoutms", "requestTimeoutMs", 100, 3_600_000
        )
        or 30_000,
        direct=_bool(opts, "direct", "direct", default=False),
    )


# --- helpers -----------------------------------------------------------------------------------


KAFKA_ONLY_OPTIONS: Final = frozenset(
    name.lower()
    for name in (
        "endingTimestamp",
        "endingOffsetsByTimestamp",
        "endingOffsetsByTimestampStrategy",
        "minOffsetsPerTrigger",
        "maxTriggerDelay",
        "maxRecordsPerPartition",
        "groupIdPrefix",
        "fetchOffset.numRetries",
        "fetchOffset.retryIntervalMs",
        "kafkaConsumer.pollTimeoutMs",
        "includeTimestamp",
    )
)
"""Options of Spark's Kafka source and sink that tidelog does not take (named as such)."""


def _check_names(
    options: Mapping[str, str], known: tuple[str, ...], other: tuple[str, ...], kind: str
) -> None:
    """ConfigError for the first option name that is neither ``known`` nor Spark's own,
    with the known name closest to it (option names are case-insensitive)."""
    names = {name.lower(): name for name in known}
    for given in options:
        key = given.lower()
        if key in names or key in SPARK_OPTIONS:
            continue
        if key in {name.lower() for name in other}:
            opposite = "writes" if kind == "read" else "reads"
            raise ConfigError(f"option {given!r} is for {opposite}, not {kind}s")
        if key in KAFKA_ONLY_OPTIONS:
            # No "did you mean": the closest name is often the opposite option
            # (endingTimestamp -> startingTimestamp), a different query that runs without
            # complaint (found by an audit).
            raise ConfigError(
                f"Spark's Kafka option {given!r} is not supported by tidelog "
                f"(docs/SPARK.md lists the options a {kind} takes)"
            )
        if key.startswith("kafka."):
            # Kafka's source passes kafka.* to its consumer; tidelog has no such layer, and
            # a job moved from Kafka most likely still carries kafka.bootstrap.servers.
            raise ConfigError(
                f"unknown option {given!r}: tidelog takes no 'kafka.' options (the address "
                "goes in the option 'gateway')"
            )
        close = difflib.get_close_matches(key, list(names), n=1)
        hint = (
            f"did you mean {names[close[0]]!r}?"
            if close
            else f"the {kind} options are {', '.join(known)}"
        )
        raise ConfigError(f"unknown option {given!r} for a tidelog {kind}; {hint}")


def _gateway(opts: Mapping[str, str], env_gateway: str | None) -> str:
    address = opts.get("gateway") or env_gateway or DEFAULT_GATEWAY
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ConfigError(f"gateway must be HOST:PORT, not {address!r}")
    return address.strip()


def _checked_topic(name: str, option: str) -> str:
    try:
        validate_topic_name(name)
    except InvalidTopicError as exc:
        raise ConfigError(f"{option}: {exc.message}") from None
    return name


def _topic_list(text: str) -> tuple[str, ...]:
    names = [name.strip() for name in text.split(",")]
    if not any(names) or not all(names):
        raise ConfigError(f"subscribe must be a comma-separated list of topics, not {text!r}")
    return tuple(dict.fromkeys(_checked_topic(name, "subscribe") for name in names))


def _pattern(text: str) -> re.Pattern[str]:
    if not text:
        raise ConfigError("subscribePattern must not be empty")
    try:
        return re.compile(text)
    except re.error as exc:
        raise ConfigError(f"subscribePattern {text!r} is not a valid regex: {exc}") from None


def _json_object(text: str, option: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{option} is not valid JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{option} must be a non-empty JSON object, not {text!r}")
    return value


def _partition_index(text: str, option: str, topic: str) -> int:
    try:
        partition = int(text)
    except ValueError:
        raise ConfigError(f"{option}: partition {text!r} of {topic!r} is not an integer") from None
    if partition < 0:
        raise ConfigError(f"{option}: partition {partition} of {topic!r} is negative")
    return partition


def _assignment(text: str) -> tuple[tuple[str, int], ...]:
    parsed = _json_object(text, "assign")
    result: list[tuple[str, int]] = []
    for topic, partitions in parsed.items():
        _checked_topic(topic, "assign")
        if not isinstance(partitions, list) or not partitions:
            raise ConfigError(f"assign: {topic!r} must map to a non-empty list of partitions")
        for partition in partitions:
            if isinstance(partition, bool) or not isinstance(partition, int) or partition < 0:
                raise ConfigError(f"assign: partition {partition!r} of {topic!r} is not >= 0")
            result.append((topic, partition))
    return tuple(dict.fromkeys(result))


def _per_partition_ints(
    text: str, option: str, minimum: int, maximum: int = 2**63 - 1
) -> dict[tuple[str, int], int]:
    parsed = _json_object(text, option)
    result: dict[tuple[str, int], int] = {}
    for topic, partitions in parsed.items():
        _checked_topic(topic, option)
        if not isinstance(partitions, dict) or not partitions:
            raise ConfigError(
                f'{option}: {topic!r} must map to an object like {{"0": 23}}, not {partitions!r}'
            )
        for key, value in partitions.items():
            partition = _partition_index(key, option, topic)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not minimum <= value <= maximum
            ):
                # Past int64 it failed later as a protobuf ValueError naming no option.
                bound = f"<= {maximum}" if isinstance(value, int) and value > 0 else f">= {minimum}"
                raise ConfigError(
                    f"{option}: {topic}-{partition} must be an integer {bound}, not {value!r}"
                )
            result[(topic, partition)] = value
    return result


def _offset_spec(text: str, option: str) -> OffsetSpec:
    word = text.strip().lower()
    if word in ("earliest", "latest"):
        return OffsetSpec(word)  # type: ignore[arg-type]  # one of the two literals
    if not word.startswith("{"):
        raise ConfigError(f"{option} must be 'earliest', 'latest' or JSON, not {text!r}")
    return OffsetSpec("json", _per_partition_ints(text, option, minimum=EARLIEST))


def _timestamp_spec(opts: Mapping[str, str]) -> TimestampSpec | None:
    per_partition: dict[tuple[str, int], int] | None = None
    all_ms: int | None = None
    if "startingoffsetsbytimestamp" in opts:
        per_partition = _per_partition_ints(
            opts["startingoffsetsbytimestamp"], "startingOffsetsByTimestamp", minimum=0
        )
    if "startingtimestamp" in opts:
        all_ms = _optional_int(opts, "startingtimestamp", "startingTimestamp", 0, 2**63 - 1)
    # Checked whenever given, as Spark's Kafka source does: a misspelt value passed until
    # someone added a timestamp option to the job (found by an audit).
    strategy = opts.get("startingoffsetsbytimestampstrategy", "error").strip().lower()
    if strategy not in ("error", "latest"):
        raise ConfigError(
            f"startingOffsetsByTimestampStrategy must be 'error' or 'latest', not {strategy!r}"
        )
    if per_partition is None and all_ms is None:
        return None
    if all_ms is not None:
        per_partition = None  # startingTimestamp wins (class docstring)
    return TimestampSpec(all_ms, per_partition, strategy)  # type: ignore[arg-type]


def _optional_int(
    opts: Mapping[str, str], key: str, name: str, minimum: int, maximum: int
) -> int | None:
    if key not in opts:
        return None
    text = opts[key].strip()
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, not {opts[key]!r}") from None
    if not minimum <= value <= maximum:
        raise ConfigError(f"{name} must be between {minimum} and {maximum}, not {value}")
    return value


def _bool(opts: Mapping[str, str], key: str, name: str, *, default: bool) -> bool:
    if key not in opts:
        return default
    text = opts[key].strip().lower()
    if text not in ("true", "false"):
        raise ConfigError(f"{name} must be true or false, not {opts[key]!r}")
    return text == "true"


_GROUP_ID = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


def _group_id(text: str | None) -> str | None:
    if text is None:
        return None
    if not _GROUP_ID.match(text):
        raise ConfigError(
            f"groupId {text!r} must be 1-249 characters of letters, digits, '.', '_' or '-'"
        )
    return text
