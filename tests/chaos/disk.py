"""Segment files of a stopped or running broker, read and damaged from outside.

``replica_batches`` reads a partition's batches straight from a broker's segment files
(for the checker's "replicas byte-identical below HW"); ``damage_tail`` tears or garbles
the end of the newest segment of a stopped broker, as a power loss or a torn write would
leave it, so the restart has to recover.
"""

from __future__ import annotations

import random
from pathlib import Path

from tidelog import formats as f
from tidelog.batch import check_batch
from tidelog.errors import CorruptBatchError
from tidelog.topics import partition_dir_name


def segment_files(data_dir: Path, topic: str, partition: int) -> list[Path]:
    directory = data_dir / partition_dir_name(topic, partition)
    return sorted(directory.glob("*.log"), key=lambda p: int(p.stem))


def replica_batches(data_dir: Path, topic: str, partition: int) -> list[tuple[int, int, bytes]]:
    """``(base offset, last offset, bytes)`` of every intact batch, in log order; reading
    a segment stops at its first damaged or partial batch (its writer may be mid-append)."""
    batches: list[tuple[int, int, bytes]] = []
    for path in segment_files(data_dir, topic, partition):
        data = path.read_bytes()
        position = 0
        while position + f.BATCH_HEADER_SIZE <= len(data):
            try:
                header = check_batch(data, position)
            except CorruptBatchError:
                break
            batches.append(
                (
                    header.base_offset,
                    header.last_offset,
                    data[position : position + header.size_bytes],
                )
            )
            position += header.size_bytes
    return batches


def damage_tail(data_dir: Path, topic: str, partition: int, rng: random.Random) -> str:
    """Tear or garble the newest segment's tail; returns what was done (for the report).

    Torn: cut 1..300 bytes off the end (mid-batch most of the time). Garbage: append
    1..300 random bytes, or overwrite the last bytes with them.
    """
    files = segment_files(data_dir, topic, partition)
    if not files:
        return f"{topic}-{partition}: no segment"
    path = files[-1]
    size = path.stat().st_size
    count = rng.randint(1, 300)
    mode = rng.choice(("torn", "append-garbage", "overwrite-garbage"))
    with path.open("r+b") as out:
        if mode == "torn":
            out.truncate(max(0, size - count))
        elif mode == "append-garbage":
            out.seek(size)
            out.write(rng.randbytes(count))
        else:
            out.seek(max(0, size - count))
            out.write(rng.randbytes(min(count, size)))
    return f"{mode} {count} bytes of {path.parent.name}/{path.name} ({size} bytes)"
