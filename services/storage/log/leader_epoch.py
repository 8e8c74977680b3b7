"""The leader epoch cache: which leader epoch wrote which offsets (Kafka's
``LeaderEpochFileCache``, KIP-101 and KIP-279).

Every batch carries the epoch of the leader that appended it (``partition_leader_epoch``).
The cache remembers only where each epoch *starts*: an ordered list of
``(epoch, start_offset)``, one entry per epoch change, so that a replica can answer
"where does my log stop being written by epoch E?" (``end_offset_for``) without reading the
log. A follower that asks its leader that question for its own latest epoch learns where
the two logs diverge and truncates there, instead of truncating blindly to its high
watermark (which loses acknowledged data or keeps divergent data, KIP-101).

Invariants:
- epochs and start offsets both strictly increase along the list;
- every entry names an epoch some batch at or after ``start_offset`` carries (the owning
  ``Log`` keeps the cache within ``[log_start_offset, log_end_offset]``: truncation and
  retention trim it, and opening a log trims it to the recovered log end);
- the file ``leader-epoch-checkpoint`` (docs/FORMAT.md 3.2) is rewritten atomically on
  every change when the cache has a path.

Ordering with the data (why a checkpoint never lies about what survives a crash): the
owning log writes a new entry *before* the batches that start the epoch, so the file always
covers the data; an entry for offsets that a crash then lost is removed on the next open by
``truncate_from_end(log_end_offset)``. A missing or unreadable file is rebuilt from the
batch headers of the log.

Thread-safety: none; the owning ``Log`` is serialized by its caller.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from pathlib import Path
from typing import Final, NamedTuple

from .checkpoint import VERSION, write_atomically
from .errors import CheckpointCorruptError

UNDEFINED_EPOCH: Final = -1
UNDEFINED_EPOCH_OFFSET: Final = -1
"""What ``end_offset_for`` answers when it knows nothing about the requested epoch."""


class EpochEntry(NamedTuple):
    """Leader ``epoch`` wrote its first batch at ``start_offset``."""

    epoch: int
    start_offset: int


class LeaderEpochCache:
    """See the module docstring. ``path`` None keeps the cache in memory only (tests)."""

    def __init__(self, path: Path | None, entries: Iterable[EpochEntry] = ()) -> None:
        self.path = path
        self._epochs: list[int] = []
        self._starts: list[int] = []
        for entry in entries:
            self._check_follows(entry)
            self._epochs.append(entry.epoch)
            self._starts.append(entry.start_offset)

    def _check_follows(self, entry: EpochEntry) -> None:
        if entry.epoch < 0 or entry.start_offset < 0:
            raise ValueError(f"invalid leader epoch entry {entry}")
        if self._epochs and (
            entry.epoch <= self._epochs[-1] or entry.start_offset <= self._starts[-1]
        ):
            raise ValueError(f"entry {entry} does not follow {self.entries[-1]}")

    # --- persistence --------------------------------------------------------------------

    @classmethod
    def load(cls, path: Path) -> LeaderEpochCache:
        """The cache stored in ``path``; empty when the file does not exist.

        Raises CheckpointCorruptError when the file exists but is not a valid checkpoint
        (bad version, count, syntax, or entries that do not strictly increase).
        """
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return cls(path)
        except UnicodeDecodeError as exc:
            raise CheckpointCorruptError(f"{path}: not UTF-8 text: {exc}") from None
        lines = text.splitlines()
        try:
            if int(lines[0]) != VERSION:
                raise CheckpointCorruptError(f"{path}: unknown version {lines[0]!r}")
            count = int(lines[1])
            body = lines[2:]
            if len(body) != count:
                raise CheckpointCorruptError(f"{path}: expected {count} entries, found {len(body)}")
            entries = []
            for line in body:
                epoch, start_offset = line.split(" ")
                entries.append(EpochEntry(int(epoch), int(start_offset)))
            return cls(path, entries)
        except (IndexError, ValueError) as exc:
            raise CheckpointCorruptError(f"{path}: malformed: {exc}") from None

    def write(self) -> None:
        """Replace the checkpoint file with the current entries (atomically, fsynced)."""
        if self.path is None:
            return
        lines = [str(VERSION), str(len(self._epochs))]
        lines += [f"{e} {s}" for e, s in zip(self._epochs, self._starts, strict=True)]
        write_atomically(self.path, "\n".join(lines) + "\n")

    def _changed(self, write: bool) -> bool:
        if write:
            self.write()
        return True

    # --- queries ------------------------------------------------------------------------

    @property
    def entries(self) -> list[EpochEntry]:
        return [EpochEntry(e, s) for e, s in zip(self._epochs, self._starts, strict=True)]

    @property
    def latest_epoch(self) -> int:
        """The newest epoch, or -1 (``UNDEFINED_EPOCH``) when the cache is empty."""
        return self._epochs[-1] if self._epochs else UNDEFINED_EPOCH

    @property
    def earliest_entry(self) -> EpochEntry | None:
        return EpochEntry(self._epochs[0], self._starts[0]) if self._epochs else None

    def __len__(self) -> int:
        return len(self._epochs)

    def end_offset_for(self, requested_epoch: int, log_end_offset: int) -> tuple[int, int]:
        """``(epoch, end_offset)``: the OffsetForLeaderEpoch answer (Kafka's semantics).

        - the latest epoch: ``(latest, log_end_offset)`` (it is still being written);
        - an epoch between the first and the latest: the largest known epoch <= requested,
          and the start offset of the next higher epoch (where that epoch's batches end);
        - an epoch below the first entry: ``(requested_epoch, first start offset)``. The
          data of earlier epochs was removed (retention), so the best this replica can say
          is that its log for those epochs ends where its first known epoch starts; a
          follower then truncates no further than that (KIP-279);
        - -1, an epoch above the latest, or an empty cache: ``(-1, -1)``.
        """
        if requested_epoch == UNDEFINED_EPOCH or not self._epochs:
            return UNDEFINED_EPOCH, UNDEFINED_EPOCH_OFFSET
        if requested_epoch == self._epochs[-1]:
            return requested_epoch, log_end_offset
        higher = bisect.bisect_right(self._epochs, requested_epoch)
        if higher == len(self._epochs):
            return UNDEFINED_EPOCH, UNDEFINED_EPOCH_OFFSET
        if higher == 0:
            return requested_epoch, self._starts[0]
        return self._epochs[higher - 1], self._starts[higher]

    def epoch_for_offset(self, offset: int) -> int:
        """The epoch that wrote ``offset`` as far as the cache knows; -1 below the first."""
        index = bisect.bisect_right(self._starts, offset) - 1
        return self._epochs[index] if index >= 0 else UNDEFINED_EPOCH

    # --- updates --------------------------------------------------------------------------

    def assign(self, epoch: int, start_offset: int, *, write: bool = True) -> bool:
        """Record that ``epoch`` wrote a batch at ``start_offset``; True if the cache changed.

        O(1) in the common case (the batch continues the latest epoch: nothing to do, or a
        newer epoch: one entry appended). Like Kafka, an entry that would break
        monotonicity (an older epoch, or the latest one at an earlier offset) first
        removes every entry at or after it in epoch or offset: the log has just been
        overwritten from there, so those entries are stale.
        """
        if epoch < 0 or start_offset < 0:
            raise ValueError(f"invalid leader epoch entry ({epoch}, {start_offset})")
        if self._epochs and epoch == self._epochs[-1] and start_offset >= self._starts[-1]:
            return False
        while self._epochs and (self._epochs[-1] >= epoch or self._starts[-1] >= start_offset):
            self._epochs.pop()
            self._starts.pop()
        self._epochs.append(epoch)
        self._starts.append(start_offset)
        return self._changed(write)

    def truncate_from_end(self, end_offset: int, *, write: bool = True) -> bool:
        """Remove entries starting at or after ``end_offset`` (the log was truncated there)."""
        if not self._starts or self._starts[-1] < end_offset:
            return False
        keep = bisect.bisect_left(self._starts, end_offset)
        del self._epochs[keep:], self._starts[keep:]
        return self._changed(write)

    def truncate_from_start(self, start_offset: int, *, write: bool = True) -> bool:
        """Forget offsets below ``start_offset`` (retention moved the log start there).

        Entries wholly below it go; the last of them is kept with its start moved up to
        ``start_offset``, since its epoch still wrote the batches from there on.
        """
        if not self._starts or self._starts[0] >= start_offset:
            return False
        last_below = bisect.bisect_right(self._starts, start_offset) - 1
        del self._epochs[:last_below], self._starts[:last_below]
        self._starts[0] = start_offset
        return self._changed(write)

    def clear(self, *, write: bool = True) -> bool:
        if not self._epochs:
            return False
        self._epochs.clear()
        self._starts.clear()
        return self._changed(write)
