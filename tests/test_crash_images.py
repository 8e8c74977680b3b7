"""Crash images of the storage engine: a kill -9 or a power loss at every file-system step.

A seeded random workload drives the real ``Log`` on real files in ``tmp_path``: leader
appends (some from idempotent producers, some starting a new leader epoch), follower
appends, rolls, truncations, retention, ``truncate_fully_and_start_at``, flushes, the
maintenance pass, clean restarts and restarts after a kill -9. ``tests/support/fs_faults``
records every file-system step of it and says what a crash at that step would leave of
the partition directory:

- **kill -9**: the files as they are, plus a torn version of an interrupted write;
- **power loss**: only what fsyncs made durable, page by page, and names only up to the
  last directory fsync plus an in-order prefix of the later changes (one random image
  and the harshest one per step).

Each image is written to its own directory and opened with the recovery point a
checkpoint could hold at that moment: the last one the workload wrote, as a
``LogManager`` would (after flushes, maintenance, retention, a lowering truncation and
start-up), and, for power loss, also the log's live recovery point, since
``LogManager.checkpoint`` reads it from other threads at any time. After opening:

- every offset in ``[log start, log end)`` reads back, as contiguous whole batches;
- the leader-epoch cache is what the batch headers say; the producer state holds only
  batches the log holds, and ends at the log end;
- appends continue, and a second open that re-verifies everything repairs nothing;
- kill -9: the batches are the ones before the interrupted operation or after it, or in
  between in the only order that operation can leave them (an append a prefix of its
  batches, a truncation a prefix of the old log, retention a suffix...);
- power loss: every batch is one that was stored at that offset at some time, the log
  reaches the checkpointed recovery point, and every batch below it is intact (a
  truncation in progress may remove what is above its target, and
  ``truncate_fully_and_start_at`` everything).

``TIDELOG_CRASH_IMAGE_SEEDS=<n>`` runs seeds ``0..n-1`` of each model (the default is
sized for ``make test``); ``TIDELOG_CRASH_IMAGE_SEED=<n>`` replays one seed. A failure
names the seed, the operation, the step and the image, and keeps the image under the
test's ``tmp_path``.

The regression tests replay, as small deterministic scenarios on the harshest power-loss
image, the power-loss windows found so far: three by an audit's fuzzer (closed in
304b9f0) and one by this module (a truncation's hole); the negative controls show that
the checks fail when they should.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import ClassVar, NamedTuple

import pytest

from services.storage.log import LeaderEpochCache, Log, LogConfig
from services.storage.log.checkpoint import OffsetCheckpointFile
from services.storage.log_manager import RECOVERY_POINT_CHECKPOINT, LogManager
from tests.support.fs_faults import (
    FaultModelError,
    FileSystemRecorder,
    Image,
    Step,
    materialize,
    recording,
)
from tidelog.batch import iter_batches, parse_header, stamp
from tidelog.clock import ManualClock
from tidelog.errors import (
    DuplicateSequenceError,
    InvalidProducerEpochError,
    OutOfOrderSequenceError,
    StorageError,
)
from tidelog.formats import INT64_MAX
from tidelog.records import encode_batch

DEFAULT_SEEDS = 3
"""Per model; about 10 s each on a 2-core machine. Soak runs set many more."""
CHUNK = 1  # seeds per test item: a failure names its seed in the test id too
OPS_PER_SEED = 60
DAY_MS = 24 * 60 * 60 * 1000
READ_ALL_BYTES = 1 << 20  # a whole segment in one read: they are a few KiB here

PRODUCER_REFUSALS = (OutOfOrderSequenceError, InvalidProducerEpochError, DuplicateSequenceError)
"""What a leader append may answer when a truncation removed a producer's earlier
batches: the generator picked sequences as if every append stayed."""


def seeds_from_env(default: int) -> list[int]:
    """``TIDELOG_CRASH_IMAGE_SEED=<n>``: that seed; else ``TIDELOG_CRASH_IMAGE_SEEDS`` seeds."""
    one = os.environ.get("TIDELOG_CRASH_IMAGE_SEED")
    if one:
        return [int(one)]
    return list(range(int(os.environ.get("TIDELOG_CRASH_IMAGE_SEEDS", default))))


class InvariantError(AssertionError):
    """A recovered image breaks an invariant (the message says which)."""


class SeedFailedError(AssertionError):
    """A seed's run met a violation; the message says where and how to replay it."""


# --- what a log holds ----------------------------------------------------------------------


class Batch(NamedTuple):
    base_offset: int
    next_offset: int
    data: bytes  # as stored


@dataclass(frozen=True)
class LogState:
    """The offsets a log claims and the batches it serves for them."""

    start: int
    end: int
    batches: tuple[Batch, ...]

    def prefix(self, count: int) -> LogState:
        """The first ``count`` batches, as a truncation leaves them."""
        kept = self.batches[:count]
        return LogState(self.start, kept[-1].next_offset if kept else self.start, kept)

    def suffix(self, first: int) -> LogState:
        """The batches from index ``first`` on, as retention leaves them."""
        kept = self.batches[first:]
        return LogState(kept[0].base_offset if kept else self.end, self.end, kept)

    def describe(self) -> str:
        return f"[{self.start}, {self.end}) in {len(self.batches)} batches"


def read_state(log: Log) -> LogState:
    """Read the whole log; InvariantError unless ``[start, end)`` is served contiguously."""
    start, end = log.log_start_offset, log.log_end_offset
    batches: list[Batch] = []
    offset = start
    while offset < end:
        try:
            data = log.read(offset, READ_ALL_BYTES)
        except StorageError as exc:
            raise InvariantError(
                f"offset {offset} (below the log end {end}) is unreadable: {exc}"
            ) from exc
        if not data:
            raise InvariantError(f"offsets [{offset}, {end}) below the log end are not there")
        for position, header in iter_batches(data):
            if header.base_offset != offset:
                raise InvariantError(
                    f"the batch after offset {offset} starts at {header.base_offset}"
                )
            batch = data[position : position + header.size_bytes]
            batches.append(Batch(header.base_offset, header.next_offset, bytes(batch)))
            offset = header.next_offset
    if offset != end:
        raise InvariantError(f"the batches end at {offset}, the log at {end}")
    return LogState(start, end, tuple(batches))


def check_epoch_cache(log: Log, state: LogState) -> None:
    """The cache says what the headers say, and names offsets of the log only."""
    from_headers = LeaderEpochCache(None)
    for batch in state.batches:
        epoch = parse_header(batch.data).partition_leader_epoch
        if epoch >= 0:
            from_headers.assign(epoch, batch.base_offset, write=False)
    entries = log.leader_epoch_cache.entries
    # An empty log may keep the epoch it was written in at its start: nothing to compare.
    if state.batches and entries != from_headers.entries:
        raise InvariantError(f"epoch cache {entries}, batch headers {from_headers.entries}")
    for entry in entries:
        if not state.start <= entry.start_offset <= state.end:
            raise InvariantError(f"epoch cache entry {entry} is outside {state.describe()}")


def check_producer_state(log: Log, state: LogState) -> None:
    """Every batch a producer is remembered by is in the log (or below its start)."""
    producer_state = log.producer_state
    if producer_state.end_offset != state.end:
        raise InvariantError(
            f"producer state ends at {producer_state.end_offset}, log at {state.end}"
        )
    headers = {batch.base_offset: parse_header(batch.data) for batch in state.batches}
    for producer_id, entry in producer_state.producers.items():
        for remembered in entry.batches:
            if remembered.last_offset >= state.end:
                raise InvariantError(f"producer {producer_id}: {remembered} is past the log end")
            if remembered.first_offset < state.start:
                continue  # retention removed it; the producer is kept until it expires
            header = headers.get(remembered.first_offset)
            if (
                header is None
                or header.producer_id != producer_id
                or header.base_sequence != remembered.first_sequence
            ):
                raise InvariantError(f"producer {producer_id}: {remembered} is not in the log")


# --- the partition under test and its workload ---------------------------------------------


class Partition:
    """The log under test, and the recovery point a ``LogManager`` would have checkpointed
    for it (``checkpoint``): after flushes, maintenance, retention, a truncation that
    lowered it, and start-up."""

    def __init__(self, recorder: FileSystemRecorder, config: LogConfig) -> None:
        self.recorder = recorder
        self.config = config
        self.clock = ManualClock()
        self.checkpoint = 0
        self.restarts = 0
        self._opening = True
        self.log = self._open()

    def _open(self) -> Log:
        self._opening = True
        try:
            log = Log.open(
                self.recorder.directory,
                self.config,
                recovery_point=self.checkpoint,
                clock=self.clock,
                rng=random.Random(0),
            )
        finally:
            self._opening = False
        log.on_recovery_point_lowered = self.write_checkpoint
        self.log = log
        self.write_checkpoint()  # LogManager.startup checkpoints once its logs are open
        return log

    def write_checkpoint(self) -> None:
        self.checkpoint = self.log.recovery_point

    def live_recovery_point(self) -> int:
        """What a checkpoint written now, from another thread, would hold."""
        return self.checkpoint if self._opening else self.log.recovery_point

    def restart(self) -> None:
        """A clean restart: LogManager.shutdown (flush, checkpoint, close), then start-up."""
        self.log.flush()
        self.write_checkpoint()
        self.log.close()
        self._open()

    def kill_and_restart(self) -> None:
        """kill -9, then start-up on what it left (with the newest checkpoint it could
        have written just before)."""
        self.write_checkpoint()
        killed = self.log
        old_directory = self.recorder.directory
        self.restarts += 1
        self.recorder.restart_in(old_directory.parent / f"restart-{self.restarts}")
        killed.close()  # the killed process's files: no longer watched
        shutil.rmtree(old_directory)
        self._open()


class Effect(Enum):
    """What an operation does to a log's batches (what a kill -9 midway may leave)."""

    NONE = "leaves them as they are"
    APPENDS = "adds batches at the end"
    TRUNCATES = "removes batches from the end"
    RETIRES = "removes batches from the start"
    DISCARDS = "removes every batch"


@dataclass(frozen=True)
class Append:
    """A leader append of concatenated batches in leader epoch ``epoch`` (or the log's
    latest, if newer: a leader's epoch never goes back)."""

    batches: bytes
    epoch: int
    effect: ClassVar[Effect] = Effect.APPENDS

    def run(self, partition: Partition) -> None:
        log = partition.log
        with suppress(*PRODUCER_REFUSALS):
            log.append(self.batches, max(self.epoch, log.latest_epoch, 0))


@dataclass(frozen=True)
class FollowerAppend:
    """Batches a leader stamped, replicated at the log end; ``new_epoch``: the leader's
    epoch is one past the log's latest."""

    batches: int
    records: int
    new_epoch: bool
    effect: ClassVar[Effect] = Effect.APPENDS

    def run(self, partition: Partition) -> None:
        log = partition.log
        epoch = max(log.latest_epoch, 0) + int(self.new_epoch)
        offset = log.log_end_offset
        parts = []
        for i in range(self.batches):
            batch = bytearray(encode_batch([bytes([i]) * 10] * self.records))
            stamp(batch, 0, offset, epoch)
            parts.append(bytes(batch))
            offset += self.records
        log.append(b"".join(parts), assign_offsets=False)


@dataclass(frozen=True)
class Truncate:
    """A follower truncation to ``fraction`` of the way from the log start to its end."""

    fraction: float
    effect: ClassVar[Effect] = Effect.TRUNCATES

    def run(self, partition: Partition) -> None:
        log = partition.log
        span = log.log_end_offset - log.log_start_offset
        log.truncate_to(log.log_start_offset + int(span * self.fraction))


@dataclass(frozen=True)
class Retention:
    """A retention pass with retention.bytes at ``fraction`` of the log's size."""

    fraction: float
    effect: ClassVar[Effect] = Effect.RETIRES

    def run(self, partition: Partition) -> None:
        log = partition.log
        config = log.config
        log.update_config(
            dataclasses.replace(config, retention_bytes=int(log.size_bytes * self.fraction))
        )
        try:
            log.delete_retention_segments(high_watermark=log.log_end_offset)
            log.remove_deleted_files()
        finally:
            log.update_config(config)
        partition.write_checkpoint()


@dataclass(frozen=True)
class Flush:
    effect: ClassVar[Effect] = Effect.NONE

    def run(self, partition: Partition) -> None:
        partition.log.flush()
        partition.write_checkpoint()


@dataclass(frozen=True)
class Maintenance:
    """LogManager's periodic pass over the log (flushing rolled segments, unlinking
    retired files, expiring producers), then its checkpoint."""

    effect: ClassVar[Effect] = Effect.NONE

    def run(self, partition: Partition) -> None:
        log = partition.log
        LogManager.maintain_log("t", 0, log, high_watermark=log.log_end_offset)
        partition.write_checkpoint()


@dataclass(frozen=True)
class Roll:
    effect: ClassVar[Effect] = Effect.NONE

    def run(self, partition: Partition) -> None:
        partition.log.roll()


@dataclass(frozen=True)
class BecomeLeader:
    """Leader epoch ``epoch`` starts at the log end, before anything is appended in it."""

    epoch: int
    effect: ClassVar[Effect] = Effect.NONE

    def run(self, partition: Partition) -> None:
        if self.epoch > partition.log.latest_epoch:
            partition.log.assign_epoch_start_offset(self.epoch)


@dataclass(frozen=True)
class StartAt:
    """``truncate_fully_and_start_at`` ``gap`` offsets past the log end (a follower far
    behind its leader's log start)."""

    gap: int
    effect: ClassVar[Effect] = Effect.DISCARDS

    def run(self, partition: Partition) -> None:
        partition.log.truncate_fully_and_start_at(partition.log.log_end_offset + self.gap)


@dataclass(frozen=True)
class Restart:
    effect: ClassVar[Effect] = Effect.NONE

    def run(self, partition: Partition) -> None:
        partition.restart()


@dataclass(frozen=True)
class KillRestart:
    effect: ClassVar[Effect] = Effect.NONE

    def run(self, partition: Partition) -> None:
        partition.kill_and_restart()


@dataclass(frozen=True)
class Advance:
    """Time passes (segment.ms rolls, file.delete.delay.ms)."""

    ms: int
    effect: ClassVar[Effect] = Effect.NONE

    def run(self, partition: Partition) -> None:
        partition.clock.advance(self.ms)


Op = (
    Append
    | FollowerAppend
    | Truncate
    | Retention
    | Flush
    | Maintenance
    | Roll
    | BecomeLeader
    | StartAt
    | Restart
    | KillRestart
    | Advance
)


def make_config(rng: random.Random) -> LogConfig:
    return LogConfig(
        # The records carry wall-clock timestamps, the logs a ManualClock of 2023.
        message_timestamp_after_max_ms=INT64_MAX,
        segment_bytes=rng.choice((1500, 3000, 6000)),
        # 48 and 96 bytes fill the indexes within a segment, so full indexes roll it.
        segment_index_bytes=rng.choice((48, 96, 4096)),
        index_interval_bytes=rng.choice((0, 200, 1000)),
        segment_ms=rng.choice((7 * DAY_MS, 20_000)),
        retention_bytes=-1,  # retention runs only in Retention ops
        retention_ms=-1,
        flush_messages=rng.choice((None, None, 12)),
        file_delete_delay_ms=rng.choice((0, 5_000)),
        page_cache_window_bytes=rng.choice((0, 2048)),
    )


def make_ops(rng: random.Random, count: int) -> list[Op]:
    ops: list[Op] = []
    epoch = 0
    next_sequence = {1: 0, 2: 0}  # producer id -> next sequence
    for _ in range(count):
        r = rng.random()
        if r < 0.50:
            batches = []
            for _ in range(rng.randint(1, 3)):
                values = [rng.randbytes(rng.randint(0, 120)) for _ in range(rng.randint(1, 6))]
                if rng.random() < 0.4:
                    producer = rng.choice((1, 2))
                    batches.append(
                        encode_batch(
                            values,
                            producer_id=producer,
                            producer_epoch=0,
                            base_sequence=next_sequence[producer],
                        )
                    )
                    next_sequence[producer] += len(values)
                else:
                    batches.append(encode_batch(values))
            epoch += rng.random() < 0.15
            ops.append(Append(b"".join(batches), epoch))
        elif r < 0.57:
            ops.append(Truncate(rng.random()))
        elif r < 0.63:
            ops.append(Retention(rng.random()))
        elif r < 0.68:
            ops.append(Flush())
        elif r < 0.72:
            ops.append(Maintenance())
        elif r < 0.75:
            ops.append(Roll())
        elif r < 0.78:
            epoch += 1
            ops.append(BecomeLeader(epoch))
        elif r < 0.80:
            ops.append(StartAt(rng.randint(1, 50)))
        elif r < 0.84:
            ops.append(Restart())
        elif r < 0.88:
            ops.append(KillRestart())
        elif r < 0.95:
            ops.append(FollowerAppend(rng.randint(1, 3), rng.randint(1, 4), rng.random() < 0.3))
        else:
            ops.append(Advance(rng.randint(1, 10_000)))
    return ops


# --- recovering an image ---------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """An image to recover, and the recovery point its checkpoint holds."""

    label: str
    image: Image
    recovery_point: int

    def key(self) -> tuple[bytes, int]:
        digest = hashlib.sha1(usedforsecurity=False)
        for name in sorted(self.image):
            digest.update(name.encode() + b"\0" + hashlib.sha1(self.image[name]).digest())
        return digest.digest(), self.recovery_point


def recover(candidate: Candidate, config: LogConfig, directory: Path) -> LogState:
    """Open the image as a restarted broker would and check what holds for any image;
    return what the log serves. InvariantError otherwise (the directory is left for study)."""
    materialize(candidate.image, directory)
    try:
        log = Log.open(
            directory,
            config,
            recovery_point=candidate.recovery_point,
            clock=ManualClock(),
            rng=random.Random(1),
        )
    except Exception as exc:
        raise InvariantError(f"opening failed: {exc!r}") from exc
    try:
        state = read_state(log)
        check_epoch_cache(log, state)
        check_producer_state(log, state)
        log.append(encode_batch([b"appended after recovery"]), max(log.latest_epoch, 0))
    finally:
        log.close()
    again = Log.open(directory, config, recovery_point=0, clock=ManualClock(), rng=random.Random(1))
    try:
        if again.truncated_on_recovery_bytes:
            raise InvariantError(
                f"a second recovery from offset 0 cut {again.truncated_on_recovery_bytes} "
                "bytes: the first one trusted damaged data"
            )
        later = read_state(again)
        if later.start != state.start or later.batches[:-1] != state.batches:
            raise InvariantError(
                f"a second recovery changed {state.describe()} to {later.describe()}"
            )
    finally:
        again.close()
    shutil.rmtree(directory)
    return state


# --- the two models -----------------------------------------------------------------------


@dataclass
class OpContext:
    """What an image taken during one operation is checked against."""

    op: Op
    before: LogState
    after: LogState
    history: dict[int, set[bytes]]  # offset -> every batch ever stored there


class KillModel:
    """kill -9 before every step that changes a file, and inside every write."""

    name = "kill-9"

    def images(
        self, step: Step, recorder: FileSystemRecorder, partition: Partition, rng: random.Random
    ) -> Iterator[Candidate]:
        if not step.kind.changes_files:
            return
        where = f"step {step.number} ({step.kind.value} {step.name})"
        # Only the active segment can be torn by a kill -9, and it is always re-verified:
        # the most trusting recovery point costs nothing and is the strictest test.
        recovery_point = partition.live_recovery_point()
        yield Candidate(f"kill -9 before {where}", self.image(recorder), recovery_point)
        write = step.write
        if write is not None and len(write.data) > 1:
            written = rng.randrange(1, len(write.data))
            torn = recorder.torn_image(write, written)
            label = f"kill -9 after {written} of {len(write.data)} bytes of {where}"
            yield Candidate(label, torn, recovery_point)

    def image(self, recorder: FileSystemRecorder) -> Image:
        return recorder.crash_image()

    def check(self, recovered: LogState, context: OpContext) -> None:
        before, after = context.before, context.after
        effect = context.op.effect
        if effect is Effect.DISCARDS and not recovered.batches:
            return  # the new empty log, or an empty one at 0 if its segment was not made yet
        if effect is Effect.APPENDS:
            allowed = [after.prefix(n) for n in range(len(before.batches), len(after.batches) + 1)]
        elif effect is Effect.TRUNCATES:
            allowed = [before.prefix(n) for n in range(len(after.batches), len(before.batches) + 1)]
        elif effect is Effect.RETIRES:
            removed = len(before.batches) - len(after.batches)
            allowed = [before.suffix(n) for n in range(removed + 1)]
        elif effect is Effect.DISCARDS:
            allowed = [before.suffix(n) for n in range(len(before.batches) + 1)]
        else:
            allowed = [before]
        if recovered not in allowed:
            raise InvariantError(
                f"recovered {recovered.describe()}; an operation that {effect.value} leaves "
                f"{before.describe()} before and {after.describe()} after, or between them"
            )


class KillCheckOfPowerImages(KillModel):
    """Negative control: kill -9's checks on power-loss images, which lose unsynced data."""

    def image(self, recorder: FileSystemRecorder) -> Image:
        return recorder.power_loss_image()


class PowerLossModel:
    """Power loss at every step, fsyncs included: one random image and the harshest."""

    name = "power-loss"

    def __init__(self, *, vouch_for_log_end: bool = False) -> None:
        # Negative control: a checkpoint claiming the whole log is durable.
        self.vouch_for_log_end = vouch_for_log_end

    def images(
        self, step: Step, recorder: FileSystemRecorder, partition: Partition, rng: random.Random
    ) -> Iterator[Candidate]:
        if self.vouch_for_log_end:
            recovery_points = {partition.log.log_end_offset}
        else:
            recovery_points = {partition.checkpoint, partition.live_recovery_point()}
        where = f"step {step.number} ({step.kind.value} {step.name})"
        for kind, image in (
            ("random", recorder.power_loss_image(rng)),
            ("harshest", recorder.power_loss_image()),
        ):
            for recovery_point in sorted(recovery_points):
                yield Candidate(f"power loss before {where}, {kind} image", image, recovery_point)

    def check(self, recovered: LogState, context: OpContext, recovery_point: int) -> None:
        for batch in recovered.batches:
            if batch.data not in context.history.get(batch.base_offset, ()):
                raise InvariantError(f"the batch at {batch.base_offset} was never stored there")
        effect = context.op.effect
        if effect is Effect.DISCARDS:
            return
        durable_end = recovery_point
        if effect is Effect.TRUNCATES:  # what it removes may go, checkpointed or not
            durable_end = min(durable_end, context.after.end)
        if recovered.end < durable_end:
            raise InvariantError(
                f"the log ends at {recovered.end}, below the checkpointed recovery point "
                f"{recovery_point}"
            )
        served = {batch.base_offset: batch.data for batch in recovered.batches}
        for batch in context.after.batches:
            if batch.next_offset > durable_end:
                break
            if batch.base_offset >= recovered.start and served.get(batch.base_offset) != batch.data:
                raise InvariantError(
                    f"the batch at {batch.base_offset}, below the checkpointed recovery point "
                    f"{recovery_point}, is lost or changed"
                )


Model = KillModel | PowerLossModel


def check_candidate(
    model: Model, candidate: Candidate, context: OpContext, config: LogConfig, directory: Path
) -> None:
    recovered = recover(candidate, config, directory)
    if isinstance(model, PowerLossModel):
        model.check(recovered, context, candidate.recovery_point)
    else:
        model.check(recovered, context)


# --- running a seed ---------------------------------------------------------------------------


@dataclass
class SeedStats:
    ops: int = 0
    steps: int = 0
    images: int = 0
    checked: int = 0
    op_counts: dict[str, int] = field(default_factory=dict)

    def count(self, op: Op, steps: int, images: int) -> None:
        self.ops += 1
        self.steps += steps
        self.images += images
        name = type(op).__name__
        self.op_counts[name] = self.op_counts.get(name, 0) + 1


def remember(history: dict[int, set[bytes]], state: LogState) -> None:
    for batch in state.batches:
        history.setdefault(batch.base_offset, set()).add(batch.data)


@contextmanager
def watched_partition(
    directory: Path, config: LogConfig
) -> Iterator[tuple[FileSystemRecorder, Partition]]:
    """A partition log opened in ``directory`` under a recorder; closed at the end."""
    with recording(directory) as recorder:
        partition = Partition(recorder, config)
        try:
            yield recorder, partition
        finally:
            partition.log.close()


def run_seed(seed: int, model: Model, workdir: Path, ops: int = OPS_PER_SEED) -> SeedStats:
    """Run ``seed``'s workload under ``model``, checking every image of every step;
    SeedFailedError at the first violation."""
    rng = random.Random(seed)
    config = make_config(rng)
    workload = make_ops(rng, ops)
    image_rng = random.Random(f"{model.name}-{seed}")
    stats = SeedStats()
    history: dict[int, set[bytes]] = {}
    with watched_partition(workdir / "log" / "t-0", config) as (recorder, partition):
        for index, op in enumerate(workload):
            candidates: list[Candidate] = []

            def on_step(step: Step, into: list[Candidate] = candidates) -> None:
                into.extend(model.images(step, recorder, partition, image_rng))

            where = f"{model.name} seed {seed}, op #{index} {op!r:.120}"
            replay = f"replay: TIDELOG_CRASH_IMAGE_SEED={seed} pytest tests/test_crash_images.py"
            steps_before = recorder.steps
            try:
                context = run_op(op, partition, on_step, history)
            except Exception as exc:  # the live log failed: no crash needed
                raise SeedFailedError(f"{where}: {exc!r}\n  {replay}") from exc
            stats.count(op, recorder.steps - steps_before, len(candidates))
            for number, candidate in enumerate(unique(candidates)):
                image_dir = workdir / f"op{index}-image{number}" / "t-0"
                stats.checked += 1
                try:
                    check_candidate(model, candidate, context, config, image_dir)
                except Exception as exc:  # InvariantError, or recovery raised
                    raise SeedFailedError(
                        f"{where}: {candidate.label} with recovery point "
                        f"{candidate.recovery_point}: {exc!s:.2000}\n  image files: "
                        f"{sorted(candidate.image)}\n  recovered directory: {image_dir}\n  "
                        f"{replay}"
                    ) from exc
    return stats


def run_op(
    op: Op,
    partition: Partition,
    on_step: Callable[[Step], None],
    history: dict[int, set[bytes]],
) -> OpContext:
    """Run ``op`` with ``on_step`` seeing each of its steps; what its images are checked
    against."""
    before = read_state(partition.log)
    remember(history, before)
    recorder = partition.recorder
    recorder.on_step = on_step
    try:
        op.run(partition)
    finally:
        recorder.on_step = None
    recorder.check_namespace()
    after = read_state(partition.log)
    remember(history, after)
    return OpContext(op, before, after, history)


def unique(candidates: list[Candidate]) -> Iterator[Candidate]:
    """Each image once per recovery point (the harshest one changes only at fsyncs)."""
    seen: set[tuple[bytes, int]] = set()
    for candidate in candidates:
        key = candidate.key()
        if key not in seen:
            seen.add(key)
            yield candidate


SEEDS = seeds_from_env(DEFAULT_SEEDS)
CHUNKS = [SEEDS[i : i + CHUNK] for i in range(0, len(SEEDS), CHUNK)]
CHUNK_IDS = [f"seeds{chunk[0]}-{chunk[-1]}" for chunk in CHUNKS]


@pytest.mark.parametrize("seeds", CHUNKS, ids=CHUNK_IDS)
def test_kill_images_recover(seeds: list[int], tmp_path: Path) -> None:
    for seed in seeds:
        stats = run_seed(seed, KillModel(), tmp_path / f"seed{seed}")
        assert stats.checked > 100, stats  # not vacuous: the workload did touch the files


@pytest.mark.parametrize("seeds", CHUNKS, ids=CHUNK_IDS)
def test_power_loss_images_recover(seeds: list[int], tmp_path: Path) -> None:
    for seed in seeds:
        stats = run_seed(seed, PowerLossModel(), tmp_path / f"seed{seed}")
        assert stats.checked > 100, stats


# --- regression tests: the power-loss windows closed in 304b9f0 --------------------------------

SCENARIO_CONFIG = LogConfig(
    segment_index_bytes=4096,
    retention_ms=-1,
    file_delete_delay_ms=0,
    page_cache_window_bytes=0,
    message_timestamp_after_max_ms=INT64_MAX,  # wall-clock records, a ManualClock log
)


def records(tag: bytes, count: int = 5) -> bytes:
    return encode_batch([tag] * count)


def harshest_candidates(
    partition: Partition, run: Callable[[], None], *, checkpoint: Callable[[], int]
) -> list[Candidate]:
    """Run ``run``, taking the harshest power-loss image before each of its steps, with
    the recovery point ``checkpoint()`` says the checkpoint holds then."""
    recorder = partition.recorder
    candidates: list[Candidate] = []

    def on_step(step: Step) -> None:
        label = f"power loss before step {step.number} ({step.kind.value} {step.name})"
        candidates.append(Candidate(label, recorder.power_loss_image(), checkpoint()))

    recorder.on_step = on_step
    try:
        run()
    finally:
        recorder.on_step = None
    return candidates


def test_power_loss_after_truncate_roll_flush_serves_the_flushed_records(tmp_path: Path) -> None:
    """A truncation is fsynced before a segment can be rolled at the new log end.

    It used not to be, and ``flush`` fsyncs only from the recovery point's segment on:
    after truncate, roll, append, flush and a power loss, the old leader's records came
    back below the checkpointed recovery point, unverified, hiding the flushed ones.
    """
    with watched_partition(tmp_path / "log", SCENARIO_CONFIG) as (recorder, partition):
        log = partition.log
        log.append(records(b"committed"), 0)  # offsets 0-4
        log.append(records(b"old leader, diverged"), 0)  # 5-9
        Flush().run(partition)
        log.truncate_to(5)  # a follower of the new leader; checkpoints 5
        log.roll()
        log.append(records(b"new leader, acknowledged"), 1)  # 5-9 again
        Flush().run(partition)
        assert partition.checkpoint == 10
        flushed = read_state(log)
        image = recorder.power_loss_image()
    recovered = recover(Candidate("harshest", image, 10), SCENARIO_CONFIG, tmp_path / "image")
    assert recovered == flushed


def test_power_loss_keeps_a_segment_rolled_before_a_restart(tmp_path: Path) -> None:
    """The first flush after opening a log fsyncs its directory.

    It used to fsync only the entries of segments this process created: a segment
    rolled just before a kill -9 had a directory entry nobody fsynced, and after the
    restart, a flush and a power loss, the offsets it held vanished below the
    checkpointed recovery point.
    """
    with watched_partition(tmp_path / "log", SCENARIO_CONFIG) as (recorder, partition):
        partition.log.append(records(b"before the roll"), 0)  # offsets 0-4
        Flush().run(partition)
        partition.log.roll()  # segment 5 created; the directory is not fsynced
        partition.kill_and_restart()
        partition.log.append(records(b"after the restart"), 0)  # 5-9, into segment 5
        Flush().run(partition)
        assert partition.checkpoint == 10
        flushed = read_state(partition.log)
        image = recorder.power_loss_image()
    recovered = recover(Candidate("harshest", image, 10), SCENARIO_CONFIG, tmp_path / "image")
    assert recovered == flushed


@pytest.mark.parametrize("retire", [Retention(0.0), StartAt(10)], ids=["retention", "start-at"])
def test_power_loss_while_segments_are_retired_trusts_none_of_them(
    retire: Retention | StartAt, tmp_path: Path
) -> None:
    """The recovery point rises only once the retired segments' renames (retention) or
    unlinks (``truncate_fully_and_start_at``) are durable.

    It used to rise first, and ``LogManager.checkpoint`` reads it from other threads at
    any time: a power loss could bring the retired segments back, never fsynced, below a
    checkpointed recovery point that had them skipped by recovery.
    """
    with watched_partition(tmp_path / "log", SCENARIO_CONFIG) as (_, partition):
        log = partition.log
        # Each new epoch's checkpoint fsyncs the directory: the segments' names are
        # durable, their data never fsynced.
        log.append(records(b"segment 0"), 0)
        log.roll()
        log.append(records(b"segment 5"), 1)
        candidates = harshest_candidates(
            partition, lambda: retire.run(partition), checkpoint=partition.live_recovery_point
        )
    assert len(candidates) > 3
    for number, candidate in enumerate(candidates):
        recovered = recover(candidate, SCENARIO_CONFIG, tmp_path / f"image{number}")
        assert recovered.end >= candidate.recovery_point, candidate.label


def test_power_loss_during_a_truncation_leaves_no_hole(tmp_path: Path) -> None:
    """A truncation lowers the recovery point, and has it checkpointed, before it
    changes any file.

    It used to lower it last: ``truncate_to`` unlinked the segments above the target,
    shrank and fsynced the one holding it, fsynced the directory, and only then lowered
    the recovery point. A power loss between the two fsyncs brought the unlinked
    segments back above the shrunk one; recovery, starting at the old checkpointed
    recovery point in a returned segment, trusted the shrunk one below it: the offsets
    between were a hole below the log end, and the removed batches were served again.
    Found by ``test_power_loss_images_recover``.
    """
    with watched_partition(tmp_path / "log", SCENARIO_CONFIG) as (_, partition):
        log = partition.log
        log.append(records(b"kept", 2), 0)  # offsets 0-1
        log.append(records(b"truncated", 2), 0)  # 2-3
        log.roll()
        log.append(records(b"removed segment", 2), 0)  # 4-5
        Flush().run(partition)
        candidates = harshest_candidates(
            partition, lambda: log.truncate_to(2), checkpoint=lambda: partition.checkpoint
        )
    assert len(candidates) > 5
    for number, candidate in enumerate(candidates):
        recovered = recover(candidate, SCENARIO_CONFIG, tmp_path / f"image{number}")
        assert recovered.end >= min(candidate.recovery_point, 2), candidate.label


# --- negative controls: the checks can fail -------------------------------------------------


def test_negative_control_kill_checks_report_lost_writes(tmp_path: Path) -> None:
    """kill -9's checks on power-loss images: unsynced writes are lost, which kill -9
    never does, and the checks say so."""
    with pytest.raises(SeedFailedError, match=r"recovered \[\d+, \d+\) in \d+ batches; an op"):
        run_seed(0, KillCheckOfPowerImages(), tmp_path)


def test_negative_control_power_checks_report_a_checkpoint_vouching_for_unsynced_data(
    tmp_path: Path,
) -> None:
    """A checkpoint claiming the whole log durable at every step: the power-loss images
    lose some of it, and the checks say so."""
    with pytest.raises(SeedFailedError, match="below the checkpointed recovery point"):
        run_seed(0, PowerLossModel(vouch_for_log_end=True), tmp_path)


def flip_a_body_byte(content: bytes) -> bytes:
    """Damage the first batch's body (caught by its checksum when read)."""
    damaged = bytearray(content)
    damaged[len(damaged) // 4] ^= 0x40
    return bytes(damaged)


def lose_the_tail(content: bytes) -> bytes:
    """Lose the last batch, as a power loss would if it was never fsynced."""
    ends = [position + header.size_bytes for position, header in iter_batches(content)]
    return content[: ends[-2]]


@pytest.mark.parametrize("damage", [flip_a_body_byte, lose_the_tail])
def test_negative_control_recovery_that_trusts_damage_is_reported(
    damage: Callable[[bytes], bytes], tmp_path: Path
) -> None:
    """A first segment damaged below a checkpoint that vouches for it: recovery trusts
    it (only the last segment is re-verified), and the checks report it."""
    with watched_partition(tmp_path / "log", SCENARIO_CONFIG) as (recorder, partition):
        log = partition.log
        for tag in (b"a", b"b", b"c"):
            log.append(records(tag), 0)
        log.roll()
        log.append(records(b"d"), 0)
        Flush().run(partition)
        image = recorder.crash_image()
    first = f"{0:020d}.log"
    intact = Candidate("intact", image, partition.checkpoint)
    assert len(recover(intact, SCENARIO_CONFIG, tmp_path / "intact").batches) == 4
    damaged = Candidate("damaged", {**image, first: damage(image[first])}, partition.checkpoint)
    with pytest.raises(InvariantError):
        recover(damaged, SCENARIO_CONFIG, tmp_path / "damaged")


# --- the file-system models themselves ------------------------------------------------------


def test_power_loss_keeps_only_what_fsyncs_made_durable(tmp_path: Path) -> None:
    directory = tmp_path / "d"
    with recording(directory) as recorder:
        fd = os.open(directory / "a", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, b"one", 0)
            os.fsync(fd)
            # The content is durable, the name is not until the directory is fsynced.
            assert recorder.power_loss_image() == {}
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            assert recorder.power_loss_image() == {"a": b"one"}
            os.pwrite(fd, b"two", 3)
        finally:
            os.close(fd)
        os.rename(directory / "a", directory / "b")
        assert recorder.crash_image() == {"b": b"onetwo"}
        assert recorder.power_loss_image() == {"a": b"one"}
        rng = random.Random(0)
        seen = {tuple(sorted(recorder.power_loss_image(rng).items())) for _ in range(200)}
        # Either name (the rename may have reached the journal); the old content, the
        # new, or the new size without the new page (unwritten blocks read as zeros).
        assert seen == {
            ((name, content),)
            for name in ("a", "b")
            for content in (b"one", b"onetwo", b"one\0\0\0")
        }
        recorder.check_namespace()


def test_a_torn_write_keeps_a_prefix(tmp_path: Path) -> None:
    directory = tmp_path / "d"
    with recording(directory) as recorder:
        torn: list[Image] = []

        def on_step(step: Step) -> None:
            if step.write is not None:
                torn.append(recorder.torn_image(step.write, 2))

        recorder.on_step = on_step
        fd = os.open(directory / "a", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, b"abc", 0)
            os.pwritev(fd, [b"de", b"f"], 3)
        finally:
            os.close(fd)
    assert torn == [{"a": b"ab"}, {"a": b"abcde"}]


def test_a_change_the_recorder_missed_is_reported(tmp_path: Path) -> None:
    directory = tmp_path / "d"
    with recording(directory) as recorder:
        (directory / "a").write_bytes(b"seen")  # pathlib's open is intercepted
        recorder.check_namespace()
        os.link(directory / "a", directory / "b")  # a hard link is not
        with pytest.raises(FaultModelError, match="missed a change"):
            recorder.check_namespace()


def test_truncation_below_log_start_checkpoints_the_lowered_recovery_point(
    tmp_path: Path,
) -> None:
    """A follower truncating below its log start (``truncate_fully_and_start_at``)
    lowered the recovery point without checkpointing it, unlike every other lowering
    truncation: the checkpoint kept vouching for offsets the new, never-fsynced segments
    hold (found by an audit; Kafka checkpoints the recovery offsets at once)."""
    with watched_partition(tmp_path / "log", SCENARIO_CONFIG) as (_, partition):
        log = partition.log
        log.truncate_fully_and_start_at(20)  # far behind a leader whose log starts at 20
        log.append(records(b"old history"), 1)  # 20-24
        log.append(records(b"old history"), 1)  # 25-29
        Flush().run(partition)
        assert partition.checkpoint == 30
        # An unclean leader whose log ends at 5: the follower truncates below its start.
        log.truncate_to(5)
        assert log.log_start_offset == log.log_end_offset == 5
        assert log.recovery_point == 5
        # The lowered recovery point must reach the checkpoint before anything is
        # appended above it (as ``truncate_to`` within the log does).
        assert partition.checkpoint <= 5, (
            f"the checkpoint still says {partition.checkpoint} after the recovery point "
            "was lowered to 5"
        )


def test_power_loss_after_truncation_below_log_start_leaves_no_hole(tmp_path: Path) -> None:
    """The consequence: a power loss then left the log claiming offsets it could not
    serve (a hole below its end, never fetched again)."""
    with watched_partition(tmp_path / "log", SCENARIO_CONFIG) as (recorder, partition):
        log = partition.log
        log.truncate_fully_and_start_at(20)
        log.append(records(b"old history"), 1)  # 20-24
        log.append(records(b"old history"), 1)  # 25-29
        Flush().run(partition)
        log.truncate_to(5)  # below the log start: the log restarts empty at 5
        # The new leader's records, replicated (each new epoch's checkpoint fsyncs the
        # directory: the segments' names are durable, their data never fsynced).
        log.append(records(b"new leader"), 2)  # 5-9
        log.roll()
        log.append(records(b"new leader"), 3)  # 10-14
        log.roll()
        log.append(records(b"new leader"), 4)  # 15-19
        image = recorder.power_loss_image()
        checkpoint = partition.checkpoint
    # recover() raises InvariantError when [log start, log end) is not served contiguously.
    recovered = recover(
        Candidate("harshest, checkpoint on disk", image, checkpoint),
        SCENARIO_CONFIG,
        tmp_path / "image",
    )
    assert recovered.end >= recovered.start


def test_log_manager_checkpoint_on_disk_after_truncation_below_log_start(tmp_path: Path) -> None:
    """The same through a real ``LogManager``: the recovery-point checkpoint file still
    vouches for the old log after the follower restarted its log below it."""
    manager = LogManager(tmp_path / "data", SCENARIO_CONFIG, clock=ManualClock())
    manager.startup()
    log = manager.get_or_create_log("t", 0)
    log.truncate_fully_and_start_at(20)
    log.append(records(b"old history"), 1)  # 20-24
    log.append(records(b"old history"), 1)  # 25-29
    log.flush()
    manager.checkpoint()
    checkpoint = OffsetCheckpointFile(tmp_path / "data" / RECOVERY_POINT_CHECKPOINT)
    assert checkpoint.read() == {("t", 0): 30}
    log.truncate_to(5)  # below the log start (an unclean leader's shorter log)
    assert log.recovery_point == 5
    assert checkpoint.read()[("t", 0)] <= 5, checkpoint.read()
    manager.shutdown()
