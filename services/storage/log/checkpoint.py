"""Checkpoint files: small text files of offsets, replaced atomically.

Format (Kafka's ``OffsetCheckpointFile``, see docs/FORMAT.md)::

    0                      version
    2                      number of entries
    orders 0 1200          topic partition offset
    orders 1 1187

Writes go to ``<name>.tmp``, are fsynced, renamed over the old file, and the directory is
fsynced, so a crash leaves either the old or the new file, never a mix.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from tidelog import formats

from .errors import CheckpointCorruptError

VERSION = 0


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` durably: temp file, fsync, rename, fsync directory."""
    write_bytes_atomically(path, text.encode("utf-8"))


def write_bytes_atomically(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Replace ``path`` with ``data`` through ``<name>.tmp`` and a rename.

    With ``sync`` the file and the directory are fsynced, so after a crash ``path`` holds
    either the old or the new content. Without it (producer-state snapshots, which carry
    their own checksum and are only a cache of the log) a crash may leave the new name
    with incomplete content, which the reader must detect.
    """
    tmp = path.with_name(path.name + formats.TMP_SUFFIX)
    with open(tmp, "wb") as out:
        out.write(data)
        if sync:
            out.flush()
            os.fsync(out.fileno())
    os.replace(tmp, path)
    if sync:
        fsync_dir(path.parent)


class OffsetCheckpointFile:
    """``(topic, partition) -> offset`` for one data directory."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, offsets: Mapping[tuple[str, int], int]) -> None:
        lines = [str(VERSION), str(len(offsets))]
        lines += [f"{topic} {partition} {offset}" for (topic, partition), offset in offsets.items()]
        write_atomically(self.path, "\n".join(lines) + "\n")

    def read(self) -> dict[tuple[str, int], int]:
        """The stored offsets; empty when the file does not exist."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except UnicodeDecodeError as exc:
            # Fix (test_storage_recovery.py::test_log_manager_corrupt_checkpoint_means_full_
            # recovery): binary garbage (a torn or zeroed file) escaped as UnicodeDecodeError
            # and failed start-up instead of falling back to full recovery.
            raise CheckpointCorruptError(f"{self.path}: not UTF-8 text: {exc}") from None
        lines = text.splitlines()
        try:
            if int(lines[0]) != VERSION:
                raise CheckpointCorruptError(f"{self.path}: unknown version {lines[0]!r}")
            count = int(lines[1])
            entries = lines[2:]
            if len(entries) != count:
                raise CheckpointCorruptError(
                    f"{self.path}: expected {count} entries, found {len(entries)}"
                )
            result: dict[tuple[str, int], int] = {}
            for line in entries:
                topic, partition, offset = line.split(" ")
                result[(topic, int(partition))] = int(offset)
        except (IndexError, ValueError) as exc:
            raise CheckpointCorruptError(f"{self.path}: malformed: {exc}") from None
        return result
