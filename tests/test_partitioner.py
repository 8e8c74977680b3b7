"""Kafka's default partitioner, checked against values Kafka itself publishes.

The hashes are those of Apache Kafka's ``UtilsTest.testMurmur2``
(clients/src/test/java/org/apache/kafka/common/utils/UtilsTest.java), copied from the
published test, not produced by this code; partitions follow from them by Kafka's rule
``toPositive(hash) % numPartitions``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidelog.partitioner import murmur2, murmur2_partitions, partition_for_key, to_positive

KAFKA_MURMUR2 = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


@pytest.mark.parametrize(("key", "expected"), sorted(KAFKA_MURMUR2.items()))
def test_murmur2_matches_kafkas_published_values(key: bytes, expected: int) -> None:
    assert murmur2(key) == expected


def test_partition_follows_kafkas_rule() -> None:
    # toPositive(-790332482) = 1357151166; 1357151166 % 50 = 16, worked by hand.
    assert partition_for_key(b"foobar", 50) == 16
    for key, expected in KAFKA_MURMUR2.items():
        for count in (1, 3, 12, 16, 100):
            assert partition_for_key(key, count) == (expected & 0x7FFFFFFF) % count


def test_to_positive_clears_the_sign_bit_rather_than_negating() -> None:
    assert to_positive(-(2**31)) == 0
    assert to_positive(-1) == 2**31 - 1
    assert to_positive(5) == 5


def test_null_keys_take_the_sticky_default_and_empty_keys_are_hashed() -> None:
    keys = [None, b"foobar", b"", None, b"foobar"]
    got = murmur2_partitions(keys, 50, default=7)
    assert got == [7, 16, partition_for_key(b"", 50), 7, 16]


def test_bad_partition_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="num_partitions"):
        partition_for_key(b"k", 0)
    with pytest.raises(ValueError, match="default partition"):
        murmur2_partitions([None], 4, default=4)


@given(st.lists(st.one_of(st.none(), st.binary(max_size=40)), max_size=50), st.integers(1, 500))
def test_every_partition_is_in_range(keys: list[bytes | None], count: int) -> None:
    partitions = murmur2_partitions(keys, count, default=0)
    assert len(partitions) == len(keys)
    assert all(0 <= p < count for p in partitions)
    assert all(-(2**31) <= murmur2(k) < 2**31 for k in keys if k is not None)


def test_a_negative_default_partition_is_refused() -> None:
    with pytest.raises(ValueError, match="default partition"):
        murmur2_partitions([None, b"k"], 4, default=-1)
