"""Topic names and the partition directory names derived from them.

The naming rule is Kafka's: 1 to 249 characters of ``[a-zA-Z0-9._-]``, and neither ``.`` nor
``..``. The rule matters beyond cosmetics: a partition's directory is ``<topic>-<partition>``
under the data directory, so a name with ``/`` or one equal to ``..`` would escape it, and
the recovery-point checkpoint stores names separated by spaces. Every service validates
names with ``validate_topic_name`` before the name reaches the filesystem.

249 is Kafka's limit: 255 (the usual file-name limit) minus room for ``-<partition>`` and
the suffixes used while a directory is being deleted.
"""

from __future__ import annotations

import re
from typing import Final

from tidelog.errors import InvalidRequestError, InvalidTopicError
from tidelog.formats import INT32_MAX

MAX_TOPIC_NAME_LENGTH: Final = 249
MAX_PARTITION: Final = INT32_MAX
"""Partition ids travel as int32 on the wire."""

_LEGAL_TOPIC_NAME: Final = re.compile(r"[a-zA-Z0-9._-]+")
# The partition part of a directory name: a canonical non-negative decimal (no sign, no
# leading zeros), so that parse(name) -> format(topic, partition) gives back name exactly.
_CANONICAL_PARTITION: Final = re.compile(r"0|[1-9][0-9]*")


def validate_topic_name(name: str) -> None:
    """Raise InvalidTopicError unless ``name`` is a legal topic name (see module docstring)."""
    if not name:
        raise InvalidTopicError("topic name is empty")
    if len(name) > MAX_TOPIC_NAME_LENGTH:
        raise InvalidTopicError(
            f"topic name is {len(name)} characters long; the limit is {MAX_TOPIC_NAME_LENGTH}"
        )
    if name in (".", ".."):
        raise InvalidTopicError(f"topic name cannot be {name!r}")
    if _LEGAL_TOPIC_NAME.fullmatch(name) is None:
        raise InvalidTopicError(
            f"topic name {name!r} contains characters other than ASCII letters, digits, "
            "'.', '_' and '-'"
        )


def validate_partition(partition: int) -> None:
    """Raise InvalidRequestError unless ``partition`` is a partition id (0..2^31-1)."""
    if not 0 <= partition <= MAX_PARTITION:
        raise InvalidRequestError(f"partition {partition} is out of range 0..{MAX_PARTITION}")


def partition_dir_name(topic: str, partition: int) -> str:
    """``orders-3`` for partition 3 of ``orders``; validates both parts."""
    validate_topic_name(topic)
    validate_partition(partition)
    return f"{topic}-{partition}"


def parse_partition_dir_name(name: str) -> tuple[str, int] | None:
    """The ``(topic, partition)`` a directory name stands for, or None if it is not one.

    The split is at the last ``-`` (topic names may themselves contain ``-``). Names that do
    not round-trip through ``partition_dir_name`` (``t-01``, ``t--1``, ``../x-0``, a
    directory being deleted such as ``t-0.abc-delete``) are not partition directories.
    """
    topic, sep, digits = name.rpartition("-")
    if not sep or _CANONICAL_PARTITION.fullmatch(digits) is None:
        return None
    partition = int(digits)
    try:
        validate_topic_name(topic)
        validate_partition(partition)
    except (InvalidTopicError, InvalidRequestError):
        return None
    return topic, partition
