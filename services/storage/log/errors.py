"""The storage engine's errors: damaged files it finds on disk.

These never cross a gRPC boundary. Each names a file kind the engine can recover from
without it, and the module that catches it says how (rebuild, replay, or refuse to
start); requests fail with ``tidelog.errors`` codes instead (STORAGE_ERROR and others).

    CorruptFileError                  a log-directory file is torn, damaged or foreign
    ├── IndexCorruptError             an offset or time index (rebuilt from its segment)
    ├── CheckpointCorruptError        an offset or leader-epoch checkpoint
    ├── ProducerSnapshotCorruptError  a producer-state snapshot (skipped; the log replayed)
    └── PartitionMetadataCorruptError a partition.metadata file (the broker refuses to start)
"""

from __future__ import annotations


class CorruptFileError(Exception):
    """A file of a log directory is torn, damaged, or not what its name says."""


class IndexCorruptError(CorruptFileError):
    """The index file is not a valid index of its segment; rebuild it from the log."""


class CheckpointCorruptError(CorruptFileError):
    """The checkpoint file exists but cannot be parsed."""


class ProducerSnapshotCorruptError(CorruptFileError):
    """A snapshot file is torn, damaged or not for the offset its name says."""


class PartitionMetadataCorruptError(CorruptFileError):
    """A ``partition.metadata`` file is not a valid one: which topic incarnation the log
    belongs to is unknown, so it is neither served nor deleted (as Kafka takes its log
    directory offline)."""
