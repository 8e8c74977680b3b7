"""All partition logs of one data directory, and the directory's checkpoint files.

Like Kafka's ``LogManager``: at start-up it reads ``recovery-point-offset-checkpoint`` and
opens every ``<topic>-<partition>`` directory, each log recovering from its own recovery
point (seed 004: only segments that may not have reached the disk are re-verified), and
reads each one's topic id (``partition.metadata``; a damaged one stops the start-up, as
Kafka takes the directory offline: which topic the data belongs to is unknown). While
running it is driven by ``maintenance(now)`` — time-based flushes, retention and removal
of retired files — and ``checkpoint()``; ``shutdown()`` flushes everything and writes the
checkpoint at the log end offsets, so the next start has nothing to recover.

Pure library code: the storage node calls these from its own threads.
Thread-safety: none; the caller serializes calls (the node holds one lock around it, and
each ``Log`` is additionally guarded by its partition).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import threading
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Final

import structlog

from services.storage.log import Log, LogConfig
from services.storage.log.checkpoint import OffsetCheckpointFile, fsync_dir
from services.storage.log.errors import CheckpointCorruptError
from services.storage.log.log import DiskFailureHandler, is_disk_failure
from services.storage.log.partition_metadata import read_topic_id, write_topic_id
from tidelog.clock import SYSTEM_CLOCK, Clock
from tidelog.topics import parse_partition_dir_name, partition_dir_name

RECOVERY_POINT_CHECKPOINT = "recovery-point-offset-checkpoint"
REPLICATION_OFFSET_CHECKPOINT = "replication-offset-checkpoint"
DELETE_DIR_SUFFIX = "-delete"

log = structlog.get_logger("tidelog.storage.log_manager")

TopicPartitionKey = tuple[str, int]
MAX_FILE_NAME_BYTES: Final = 255
"""The longest file name ext4, xfs and most file systems take (topic names are ASCII)."""


class LogManager:
    """Owns the logs under ``data_dir``; see the module docstring."""

    def __init__(
        self,
        data_dir: str | Path,
        default_config: LogConfig | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        on_disk_failure: DiskFailureHandler | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        # Given to every log: what to do when the disk under this directory fails.
        self.on_disk_failure = on_disk_failure
        self.default_config = default_config or LogConfig()
        self._clock = clock or SYSTEM_CLOCK
        self._rng = rng or random.Random()
        self._logs: dict[TopicPartitionKey, Log] = {}
        # The topic id each log's partition.metadata holds; "" for a log without one.
        self._topic_ids: dict[TopicPartitionKey, str] = {}
        self._checkpoint_lock = threading.Lock()
        self._recovery_checkpoint = OffsetCheckpointFile(self.data_dir / RECOVERY_POINT_CHECKPOINT)
        self._replication_checkpoint = OffsetCheckpointFile(
            self.data_dir / REPLICATION_OFFSET_CHECKPOINT
        )

    @contextlib.contextmanager
    def _reporting_disk_failure(self) -> Iterator[None]:
        """Report a disk failure of the data directory's own files (checkpoints, a new
        log's directory) as a log's are reported: they go through the same disk. Failures
        here used to be logged and retried, a stale recovery point staying on disk and the
        HW checkpoint never written again, or a partition failing to be created over and
        over while this broker led it."""
        try:
            yield
        except OSError as exc:
            if is_disk_failure(exc) and self.on_disk_failure is not None:
                self.on_disk_failure(self.data_dir, exc)
            raise

    def startup(self) -> None:
        """Open (and where needed recover) every partition log in the data directory. A
        disk failure here is reported as one at run time is (the node halts with its exit
        status for a failed disk): it failed the start-up as any error, status 1 (found by
        an audit)."""
        with self._reporting_disk_failure():
            self._startup()

    def _startup(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            recovery_points = self._recovery_checkpoint.read()
        except CheckpointCorruptError as exc:
            # Without trustworthy recovery points every segment is re-verified: slower,
            # never wrong.
            log.warning("recovery_checkpoint_unreadable", error=str(exc))
            recovery_points = {}
        for path in sorted(self.data_dir.iterdir()):
            if not path.is_dir():
                continue
            if path.name.endswith(DELETE_DIR_SUFFIX):
                shutil.rmtree(path, ignore_errors=True)  # a deletion that was interrupted
                continue
            key = parse_partition_dir_name(path.name)
            if key is None:
                continue
            # Before the log opens: a damaged file fails the start-up with nothing changed.
            self._topic_ids[key] = read_topic_id(path)
            opened = Log.open(
                path,
                self.default_config,
                recovery_point=recovery_points.get(key, 0),
                clock=self._clock,
                rng=self._rng,
            )
            opened.on_disk_failure = self.on_disk_failure
            opened.on_recovery_point_lowered = self.checkpoint
            self._logs[key] = opened
            if opened.truncated_on_recovery_bytes:
                log.warning(
                    "log_truncated_on_recovery",
                    topic=key[0],
                    partition=key[1],
                    truncated_bytes=opened.truncated_on_recovery_bytes,
                    log_end_offset=opened.log_end_offset,
                )
        # Record the recovered state so a second crash does not repeat the work needlessly
        # and no checkpoint names a log that no longer exists.
        self.checkpoint()

    def get_log(self, topic: str, partition: int) -> Log | None:
        return self._logs.get((topic, partition))

    def topic_id(self, topic: str, partition: int) -> str:
        """The topic id on disk of a hosted log; "" if it has none (or is not hosted)."""
        return self._topic_ids.get((topic, partition), "")

    def set_topic_id(self, topic: str, partition: int, topic_id: str) -> None:
        """Give a hosted log without an id (made by older code) the id the controller
        names, durably: from then on it is that incarnation's log."""
        key = (topic, partition)
        hosted = self._logs[key]
        if self._topic_ids.get(key):
            raise ValueError(f"{topic}-{partition} already has topic id {self._topic_ids[key]}")
        with self._reporting_disk_failure():
            write_topic_id(hosted.dir, topic_id)
        self._topic_ids[key] = topic_id

    def get_or_create_log(
        self,
        topic: str,
        partition: int,
        config: LogConfig | None = None,
        topic_id: str = "",
    ) -> Log:
        """The partition's log, created empty if absent; ``config`` replaces its settings.

        A log created here carries ``topic_id`` on disk (``partition.metadata``) from the
        start; an existing log's id is not touched (``set_topic_id``).
        """
        key = (topic, partition)
        existing = self._logs.get(key)
        if existing is not None:
            if config is not None and config != existing.config:
                existing.update_config(config)
            return existing
        directory = self.data_dir / partition_dir_name(topic, partition)
        with self._reporting_disk_failure():
            if topic_id:
                # The id goes on disk before any segment: a crash in between leaves an
                # empty directory without an id (it adopts the next id named, harmlessly:
                # it holds nothing), never data without its id. The data directory is
                # fsynced so the new directory's entry survives a power loss with the file
                # inside it.
                directory.mkdir(parents=True, exist_ok=True)
                fsync_dir(self.data_dir)
                write_topic_id(directory, topic_id)
            created = Log.open(
                directory,
                config or self.default_config,
                clock=self._clock,
                rng=self._rng,
            )
        created.on_disk_failure = self.on_disk_failure
        created.on_recovery_point_lowered = self.checkpoint
        self._logs[key] = created
        self._topic_ids[key] = topic_id
        return created

    def delete_log(self, topic: str, partition: int) -> None:
        """Remove a partition's log from disk (topic deletion, replica moved away)."""
        removed = self._logs.get((topic, partition))
        if removed is None:
            return
        removed.close()
        # Rename first so a crash mid-delete leaves a directory start-up recognizes and
        # finishes deleting, never a half-deleted log that looks live. The new name must
        # fit a file name (255 bytes) when the topic's takes 249 of them: the topic part
        # is cut, as Kafka does (start-up removes any name ending in the suffix).
        # Forgotten only once renamed: a failed rename is retried by the controller,
        # where an already-forgotten log would leave its data for a re-created topic.
        suffix = f".{uuid.uuid4().hex}{DELETE_DIR_SUFFIX}"
        kept = removed.dir.name[: MAX_FILE_NAME_BYTES - len(suffix)]
        doomed = removed.dir.with_name(kept + suffix)
        with self._reporting_disk_failure():
            removed.dir.rename(doomed)
        self._logs.pop((topic, partition), None)
        self._topic_ids.pop((topic, partition), None)
        shutil.rmtree(doomed, ignore_errors=True)
        self.checkpoint()

    def all_logs(self) -> dict[TopicPartitionKey, Log]:
        return dict(self._logs)

    def all_topic_ids(self) -> dict[TopicPartitionKey, str]:
        """Every hosted log's topic id on disk ("" for one without)."""
        return {key: self._topic_ids.get(key, "") for key in self._logs}

    def maintenance(self, high_watermarks: Mapping[TopicPartitionKey, int]) -> None:
        """Periodic work for every log; see ``maintain_log``. A log with no entry in
        ``high_watermarks`` retires nothing (nothing of it is known to be replicated)."""
        for key, partition_log in list(self._logs.items()):
            hw = high_watermarks.get(key, partition_log.log_start_offset)
            self.maintain_log(key[0], key[1], partition_log, high_watermark=hw)

    @staticmethod
    def maintain_log(
        topic: str,
        partition: int,
        partition_log: Log,
        *,
        high_watermark: int,
        retention: bool = True,
        expire_producers: bool = True,
    ) -> None:
        """flush.ms flushes, retention below ``high_watermark`` (unless ``retention`` is
        False: not due, or the log's topic settings are not known yet), unlinking of
        retired segments, and producer expiry (unless ``expire_producers`` is False) for
        one log.

        Separate from ``maintenance`` so a caller that guards each log with its own lock
        can take one lock at a time instead of stopping every partition at once.
        """
        partition_log.flush_if_due()
        retired = (
            partition_log.delete_retention_segments(high_watermark=high_watermark)
            if retention
            else 0
        )
        if retired:
            log.info(
                "retention_deleted_segments",
                topic=topic,
                partition=partition,
                segments=retired,
                log_start_offset=partition_log.log_start_offset,
            )
        partition_log.remove_deleted_files()
        if expire_producers:
            # producer.id.expiration.ms: idempotence state of producers gone quiet for a
            # day would otherwise accumulate forever.
            partition_log.remove_expired_producers()

    def checkpoint(self) -> None:
        """Write every log's recovery point atomically.

        Called by the maintenance pass and by a log whose truncation lowered its recovery
        point (on a fetcher thread, holding only that partition's lock): the lock keeps
        two writers off the one temporary file. Recovery points are plain ints, read
        without their logs' locks."""
        with self._checkpoint_lock, self._reporting_disk_failure():
            self._recovery_checkpoint.write(
                {
                    key: partition_log.recovery_point
                    for key, partition_log in list(self._logs.items())
                }
            )

    def read_high_watermarks(self) -> dict[TopicPartitionKey, int]:
        """The last replication-offset-checkpoint (HW per partition); {} if none/unreadable."""
        try:
            with self._reporting_disk_failure():  # an EIO reading it: the disk failed
                return dict(self._replication_checkpoint.read())
        except CheckpointCorruptError as exc:
            # Without it a replica starts from HW = log start and relearns the HW from its
            # leader (or its followers): slower to serve, never wrong.
            log.warning("replication_checkpoint_unreadable", error=str(exc))
            return {}

    def write_high_watermarks(self, high_watermarks: dict[TopicPartitionKey, int]) -> None:
        """Write the replication-offset-checkpoint atomically (same format as recovery)."""
        with self._reporting_disk_failure():
            self._replication_checkpoint.write(high_watermarks)

    def flush_all(self) -> None:
        for partition_log in self._logs.values():
            partition_log.flush()

    def shutdown(self) -> None:
        """Clean shutdown: flush all, checkpoint at the log ends, close every file."""
        self.flush_all()
        self.checkpoint()
        for partition_log in self._logs.values():
            partition_log.close()
        self._logs.clear()
        self._topic_ids.clear()
