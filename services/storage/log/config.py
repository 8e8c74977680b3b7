"""Per-log configuration, named as Kafka names the topic-level settings."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from tidelog import formats
from tidelog.errors import InvalidConfigError

DAY_MS: Final = 24 * 60 * 60 * 1000
CREATE_TIME: Final = "CreateTime"
LOG_APPEND_TIME: Final = "LogAppendTime"
TIMESTAMP_TYPES: Final = (CREATE_TIME, LOG_APPEND_TIME)
MAX_INDEX_BYTES: Final = (1 << 31) - 1
"""Largest segment.index.bytes (Kafka's bound too): each index file is preallocated to it,
and a larger one made terabyte files, or failed to be created at all."""


@dataclass(frozen=True, slots=True)
class LogConfig:
    """How one partition log is segmented, indexed, flushed and retained.

    Invariants (checked in ``__post_init__``): sizes are positive and segments fit the
    index entry's 31-bit position; ``-1`` means "unlimited" for retention; ``None`` means
    "never" for the flush triggers.
    """

    # segment.bytes: roll to a new segment once the active one would exceed this.
    segment_bytes: int = 1 << 30
    # segment.index.bytes: preallocated size of each .index / .timeindex; a full index rolls.
    segment_index_bytes: int = 10 << 20
    # index.interval.bytes: bytes of log between sparse index entries (seed 000: 4 KiB).
    index_interval_bytes: int = 4096
    # segment.ms: roll once the active segment is this old, even if not full (7 days).
    segment_ms: int = 7 * DAY_MS
    # segment.jitter.ms: a random amount below this (and below segment.ms) is subtracted
    # from segment.ms per segment, so partitions created together do not all roll in the
    # same second (seed 002).
    segment_jitter_ms: int = 0
    # retention.bytes: delete oldest segments while the log exceeds this; -1 = no limit.
    retention_bytes: int = -1
    # retention.ms: delete segments whose newest record is older than this; -1 = forever.
    retention_ms: int = 7 * DAY_MS
    # flush.messages: fsync once this many records are unflushed; 1 = fsync every append.
    flush_messages: int | None = None
    # flush.ms: fsync once the oldest unflushed append is this old.
    flush_ms: int | None = None
    # max.message.bytes: the largest single batch accepted (Kafka's default, 1 MiB + 12).
    max_message_bytes: int = formats.DEFAULT_MAX_MESSAGE_BYTES
    # file.delete.delay.ms: how long a retired segment stays as *.deleted before unlinking.
    file_delete_delay_ms: int = 60_000
    # page.cache.window.bytes (tidelog's own): bytes of the newest log kept in the OS page
    # cache; older bytes are written back as appends go and dropped from it (page_cache.py).
    # 0 keeps everything until the kernel reclaims it, as Kafka does.
    page_cache_window_bytes: int = 64 << 20
    # message.timestamp.type: "CreateTime" keeps the producer's record timestamps;
    # "LogAppendTime" makes the leader stamp each batch with its clock at the append
    # (tidelog.batch.stamp_log_append_time), for the time index, retention and readers.
    message_timestamp_type: str = CREATE_TIME
    # message.timestamp.before.max.ms / message.timestamp.after.max.ms (Kafka's KIP-937):
    # how far a CreateTime batch's timestamps may lie behind / ahead of the leader's
    # clock. Refused otherwise (INVALID_TIMESTAMP): a producer's clock drives segment.ms
    # rolls and time retention, and stepping it forward rolled a segment per request (an
    # unbounded number of files) or made segments that retention.ms never deletes. The
    # defaults are Kafka 4.0's: any age, at most one hour ahead.
    message_timestamp_before_max_ms: int = formats.INT64_MAX
    message_timestamp_after_max_ms: int = 60 * 60 * 1000

    def __post_init__(self) -> None:
        def require(ok: bool, key: str, value: object, why: str) -> None:
            if not ok:
                raise InvalidConfigError(f"invalid {key}={value}: {why}")

        require(
            14 <= self.segment_bytes <= formats.MAX_SEGMENT_POSITION,
            "segment.bytes",
            self.segment_bytes,
            f"must be between 14 and {formats.MAX_SEGMENT_POSITION}",
        )
        require(
            4 * formats.TIME_INDEX_ENTRY_SIZE <= self.segment_index_bytes <= MAX_INDEX_BYTES,
            "segment.index.bytes",
            self.segment_index_bytes,
            f"must be between {4 * formats.TIME_INDEX_ENTRY_SIZE} and {MAX_INDEX_BYTES}",
        )
        require(
            self.index_interval_bytes >= 0,
            "index.interval.bytes",
            self.index_interval_bytes,
            "must be >= 0",
        )
        require(self.segment_ms >= 1, "segment.ms", self.segment_ms, "must be >= 1")
        require(
            self.segment_jitter_ms >= 0,
            "segment.jitter.ms",
            self.segment_jitter_ms,
            "must be >= 0",
        )
        require(
            self.retention_bytes >= -1,
            "retention.bytes",
            self.retention_bytes,
            "must be >= 0, or -1 for no limit",
        )
        require(
            self.retention_ms >= -1,
            "retention.ms",
            self.retention_ms,
            "must be >= 0, or -1 to keep forever",
        )
        require(
            self.flush_messages is None or self.flush_messages >= 1,
            "flush.messages",
            self.flush_messages,
            "must be >= 1",
        )
        require(
            self.flush_ms is None or self.flush_ms >= 0,
            "flush.ms",
            self.flush_ms,
            "must be >= 0",
        )
        require(
            formats.BATCH_HEADER_SIZE <= self.max_message_bytes <= formats.MAX_BATCH_BYTES,
            "max.message.bytes",
            self.max_message_bytes,
            f"must be between {formats.BATCH_HEADER_SIZE} and {formats.MAX_BATCH_BYTES}",
        )
        require(
            self.file_delete_delay_ms >= 0,
            "file.delete.delay.ms",
            self.file_delete_delay_ms,
            "must be >= 0",
        )
        require(
            self.message_timestamp_type in TIMESTAMP_TYPES,
            "message.timestamp.type",
            self.message_timestamp_type,
            f"must be one of {', '.join(TIMESTAMP_TYPES)}",
        )
        for key, value in (
            ("message.timestamp.before.max.ms", self.message_timestamp_before_max_ms),
            ("message.timestamp.after.max.ms", self.message_timestamp_after_max_ms),
        ):
            require(
                0 <= value <= formats.INT64_MAX,
                key,
                value,
                f"must be between 0 and {formats.INT64_MAX}",
            )
        require(
            self.page_cache_window_bytes >= 0,
            "page.cache.window.bytes",
            self.page_cache_window_bytes,
            "must be >= 0 (0 keeps every written byte in the page cache)",
        )

    @classmethod
    def from_topic_config(
        cls, entries: Mapping[str, str], base: LogConfig | None = None
    ) -> LogConfig:
        """Apply Kafka-named topic settings (``{"retention.ms": "1000"}``) over ``base``.

        Keys this class does not own but the cluster does (``min.insync.replicas``,
        ``unclean.leader.election.enable``, ...) are ignored here; unknown keys are the
        controller's to reject. A value that is not an integer raises InvalidConfigError.
        """
        changes: dict[str, int | str | None] = {}
        for key, raw in entries.items():
            field = TOPIC_CONFIG_FIELDS.get(key)
            if field is None:
                continue
            if field in STRING_FIELDS:
                changes[field] = raw  # checked by __post_init__
                continue
            try:
                value = int(raw)
            except ValueError:
                raise InvalidConfigError(f"invalid {key}={raw!r}: not an integer") from None
            # Kafka's "Long.MAX_VALUE means never" for the flush settings.
            if field in ("flush_messages", "flush_ms") and value >= (1 << 63) - 1:
                changes[field] = None
            else:
                changes[field] = value
        return dataclasses.replace(base or cls(), **changes)  # type: ignore[arg-type]


TOPIC_CONFIG_FIELDS: Final[dict[str, str]] = {
    "segment.bytes": "segment_bytes",
    "segment.index.bytes": "segment_index_bytes",
    "index.interval.bytes": "index_interval_bytes",
    "segment.ms": "segment_ms",
    "segment.jitter.ms": "segment_jitter_ms",
    "retention.bytes": "retention_bytes",
    "retention.ms": "retention_ms",
    "flush.messages": "flush_messages",
    "flush.ms": "flush_ms",
    "max.message.bytes": "max_message_bytes",
    "file.delete.delay.ms": "file_delete_delay_ms",
    "page.cache.window.bytes": "page_cache_window_bytes",
    "message.timestamp.type": "message_timestamp_type",
    "message.timestamp.before.max.ms": "message_timestamp_before_max_ms",
    "message.timestamp.after.max.ms": "message_timestamp_after_max_ms",
}
"""Kafka topic-config name -> LogConfig field."""
STRING_FIELDS: Final = frozenset({"message_timestamp_type"})
"""Fields whose topic-config values are names, not integers."""
