"""Kafka's default key partitioner, so a key lands on the partition Kafka would choose.

Kafka's producer (``BuiltInPartitioner.partitionForKey``) hashes the serialized key with
``Utils.murmur2`` - MurmurHash2, 32-bit, seed ``0x9747b28c`` - and picks
``toPositive(hash) % numPartitions`` where ``toPositive(x) = x & 0x7fffffff``. Matching it
exactly matters to users who move a keyed topic between Kafka and tidelog, or who join a
tidelog topic with a Kafka one partition by partition: the same key must meet itself.

Java's ``int`` arithmetic wraps at 32 bits and ``>>>`` shifts in zeros; here every step
is masked to 32 bits and the result converted back to a signed value at the end, which is
exactly what Java's two's-complement ints do. Records without a key are not hashed: the
caller's sticky partition (``default``) is used, as in Kafka since KIP-480.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

SEED: Final = 0x9747B28C
_M: Final = 0x5BD1E995
_R: Final = 24
_MASK: Final = 0xFFFFFFFF
_WORDS: Final = struct.Struct("<I")


def murmur2(data: bytes) -> int:
    """Kafka's ``Utils.murmur2``: the signed 32-bit hash of ``data``."""
    length = len(data)
    h = (SEED ^ length) & _MASK
    whole = length & ~3
    # Four little-endian bytes at a time, as Java assembles them from the byte array.
    for (word,) in _WORDS.iter_unpack(data[:whole]) if whole else ():
        k = (word * _M) & _MASK
        k ^= k >> _R
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    # The tail: Java's switch falls through from case 3 to 2 to 1.
    tail = length & 3
    if tail == 3:
        h ^= data[whole + 2] << 16
    if tail >= 2:
        h ^= data[whole + 1] << 8
    if tail >= 1:
        h ^= data[whole]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def to_positive(value: int) -> int:
    """Kafka's ``Utils.toPositive``: clear the sign bit (not ``abs``: abs(MIN_INT) < 0)."""
    return value & 0x7FFFFFFF


def partition_for_key(key: bytes, num_partitions: int) -> int:
    """The partition Kafka's default partitioner picks for ``key``."""
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, not {num_partitions}")
    return to_positive(murmur2(key)) % num_partitions


def murmur2_partitions(
    keys: Sequence[bytes | None], num_partitions: int, *, default: int
) -> list[int]:
    """``partition_for_key`` for each key; ``None`` keys get ``default`` (the sticky one).

    Repeated keys (the usual case for keyed data) are hashed once per call.
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, not {num_partitions}")
    if not 0 <= default < num_partitions:
        raise ValueError(f"default partition {default} is outside 0..{num_partitions - 1}")
    seen: dict[bytes, int] = {}
    out: list[int] = []
    append = out.append
    for key in keys:
        if key is None:
            append(default)
            continue
        # A bytearray or memoryview is no dict key (found by an audit).
        hashable = key if isinstance(key, bytes) else bytes(key)
        partition = seen.get(hashable)
        if partition is None:
            partition = seen[hashable] = to_positive(murmur2(hashable)) % num_partitions
        append(partition)
    return out
