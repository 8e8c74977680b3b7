"""``meta.properties``: whose data directory this is -- the broker id and the cluster id.

Kafka's file of the same name (``BrokerMetadataCheckpoint``), the same keys::

    version=0
    broker.id=1
    cluster.id=5c1f0e2a9b8d4c7e8f6a3b2c1d0e9f8a

Why it exists: a broker deletes logs of topics the cluster does not know (strays, see
``services/storage/strays.py``). A volume mounted on the wrong broker, or a data
directory copied into another cluster, is then not recognised as such -- it is "all
strays", and the first UpdateMetadata deleted every log on it. With the file, a node
refuses to start on a directory of another broker id or another cluster, and deletes
nothing (Kafka's InconsistentBrokerIdException / InconsistentClusterIdException).

Rules (``check_identity``, pure):
- no file: a new directory, or one written by code older than this file -- adopted, and
  the file written before any log is opened;
- ``broker.id`` differs from the node's: refused;
- ``cluster.id`` differs from the cluster's (etcd's ``cluster_id`` key): refused; a file
  without one (a node that ran outside a cluster) takes the cluster's.

Written atomically (``write_bytes_atomically``: ``.tmp``, fsync, rename, fsync the
directory), so a crash leaves the old file or the new one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from services.storage.log.checkpoint import write_bytes_atomically
from tidelog.errors import StorageError

META_PROPERTIES_FILE: Final = "meta.properties"
VERSION: Final = 0
MAX_FILE_BYTES: Final = 1024
"""A valid file is three short lines; a larger one is not this file."""
_CLUSTER_ID: Final = re.compile(r"[0-9A-Za-z_-]{1,64}")


class DataDirIdentityError(StorageError):
    """The data directory belongs to another broker or cluster (or its file is damaged)."""


@dataclass(frozen=True, slots=True)
class MetaProperties:
    broker_id: int
    cluster_id: str = ""  # "" until the node first runs in a cluster


def encode_meta_properties(meta: MetaProperties) -> bytes:
    lines = [f"version={VERSION}", f"broker.id={meta.broker_id}"]
    if meta.cluster_id:
        if not _CLUSTER_ID.fullmatch(meta.cluster_id):
            raise ValueError(f"not a cluster id: {meta.cluster_id!r}")
        lines.append(f"cluster.id={meta.cluster_id}")
    return ("\n".join(lines) + "\n").encode("ascii")


def decode_meta_properties(data: bytes, *, source: str = META_PROPERTIES_FILE) -> MetaProperties:
    """The file's content; DataDirIdentityError naming the fault when it is malformed."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise DataDirIdentityError(f"{source}: not ASCII text") from None
    entries: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue  # Kafka writes a comment with the date
        key, sep, value = line.partition("=")
        if not sep or key.strip() in entries:
            raise DataDirIdentityError(f"{source}: bad line {line!r}")
        entries[key.strip()] = value.strip()
    if entries.get("version") != str(VERSION):
        raise DataDirIdentityError(f"{source}: unknown version {entries.get('version')!r}")
    broker_id = entries.get("broker.id", "")
    if not re.fullmatch(r"[0-9]{1,10}", broker_id):
        raise DataDirIdentityError(f"{source}: bad broker.id {broker_id!r}")
    cluster_id = entries.get("cluster.id", "")
    if cluster_id and not _CLUSTER_ID.fullmatch(cluster_id):
        raise DataDirIdentityError(f"{source}: bad cluster.id {cluster_id!r}")
    return MetaProperties(int(broker_id), cluster_id)


def read_meta_properties(data_dir: Path) -> MetaProperties | None:
    """The data directory's identity; None when it has no file yet."""
    path = data_dir / META_PROPERTIES_FILE
    try:
        with open(path, "rb") as source:
            data = source.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(data) > MAX_FILE_BYTES:
        raise DataDirIdentityError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
    return decode_meta_properties(data, source=str(path))


def write_meta_properties(data_dir: Path, meta: MetaProperties) -> None:
    write_bytes_atomically(data_dir / META_PROPERTIES_FILE, encode_meta_properties(meta))


def check_identity(
    found: MetaProperties | None, *, broker_id: int, cluster_id: str, data_dir: Path
) -> MetaProperties:
    """The identity the directory must record from now on; raises DataDirIdentityError
    when it belongs to another broker or cluster. ``cluster_id`` "": not in a cluster."""
    if found is not None and found.broker_id != broker_id:
        raise DataDirIdentityError(
            f"data directory {data_dir} belongs to broker {found.broker_id} "
            f"({META_PROPERTIES_FILE}), not to broker {broker_id}; refusing to start "
            "(nothing was changed)"
        )
    if found is not None and found.cluster_id and cluster_id and found.cluster_id != cluster_id:
        raise DataDirIdentityError(
            f"data directory {data_dir} belongs to cluster {found.cluster_id} "
            f"({META_PROPERTIES_FILE}), but this cluster's id is {cluster_id}; refusing to "
            "start (nothing was changed)"
        )
    return MetaProperties(broker_id, cluster_id or (found.cluster_id if found else ""))


__all__ = [
    "META_PROPERTIES_FILE",
    "DataDirIdentityError",
    "MetaProperties",
    "check_identity",
    "decode_meta_properties",
    "encode_meta_properties",
    "read_meta_properties",
    "write_meta_properties",
]
