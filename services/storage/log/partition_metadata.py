"""``partition.metadata``: the topic id of the incarnation a partition directory belongs to.

Kafka's ``PartitionMetadataFile`` (KIP-516), byte for byte the same text::

    version: 0
    topic_id: 3f1c9a0e6b2d4e0f9a7c5b1d2e3f4a5b

Directories are named ``<topic>-<partition>``, by name, and a name can be deleted and
created again; the id on disk is what tells a log of the current topic from one of an
earlier incarnation (a "stray", see ``services/storage/strays.py``). Written once, when
the log is created (or, for a log made by code older than this file, the first time a
controller names its topic id), through ``write_bytes_atomically``: ``.tmp``, fsync,
rename, fsync the directory. A crash therefore leaves no file or the whole file, plus
perhaps a ``partition.metadata.tmp`` that opening the log removes as debris.

Pure file I/O, no locks: the caller (``LogManager``) serializes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

from .checkpoint import write_bytes_atomically
from .errors import PartitionMetadataCorruptError

PARTITION_METADATA_FILE: Final = "partition.metadata"
VERSION: Final = 0
# The controller's ids are uuid4().hex (32 hex digits); Kafka's are 22 base64url
# characters. Anything else in the file is damage, not an id (and a newline or a space
# in an id would make the file ambiguous to parse).
_TOPIC_ID: Final = re.compile(r"[0-9A-Za-z_-]{1,64}")
# A valid file is two short lines; more is not this file (and is not read whole).
MAX_FILE_BYTES: Final = 256


def valid_topic_id(topic_id: str) -> bool:
    """Whether ``topic_id`` can be stored in (and read back from) the file."""
    return _TOPIC_ID.fullmatch(topic_id) is not None


def encode_partition_metadata(topic_id: str) -> bytes:
    if not valid_topic_id(topic_id):
        raise ValueError(f"not a topic id: {topic_id!r}")
    return f"version: {VERSION}\ntopic_id: {topic_id}\n".encode("ascii")


def decode_partition_metadata(data: bytes, *, source: str = PARTITION_METADATA_FILE) -> str:
    """The topic id in a file's content; PartitionMetadataCorruptError if malformed."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise PartitionMetadataCorruptError(f"{source}: not ASCII text") from None
    lines = text.split("\n")
    # Exactly "version: 0", "topic_id: <id>" and the final newline's empty remainder: a
    # torn write cannot happen (atomic rename), so any other shape is damage.
    if len(lines) != 3 or lines[2] != "":
        raise PartitionMetadataCorruptError(f"{source}: expected two lines, got {text!r}")
    version, topic_id = lines[0], lines[1]
    if version != f"version: {VERSION}":
        raise PartitionMetadataCorruptError(f"{source}: unknown version line {version!r}")
    if not topic_id.startswith("topic_id: ") or not valid_topic_id(topic_id[10:]):
        raise PartitionMetadataCorruptError(f"{source}: bad topic_id line {topic_id!r}")
    return topic_id[10:]


def read_topic_id(log_dir: Path) -> str:
    """The topic id stored in ``log_dir``; "" when the log has no file (older code)."""
    path = log_dir / PARTITION_METADATA_FILE
    try:
        with open(path, "rb") as source:
            data = source.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return ""
    if len(data) > MAX_FILE_BYTES:
        raise PartitionMetadataCorruptError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
    return decode_partition_metadata(data, source=str(path))


def write_topic_id(log_dir: Path, topic_id: str) -> None:
    """Store ``topic_id`` in ``log_dir`` durably (temp file, fsync, rename, fsync dir)."""
    write_bytes_atomically(log_dir / PARTITION_METADATA_FILE, encode_partition_metadata(topic_id))
