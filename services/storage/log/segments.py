"""The ordered set of a log's segments, searchable by offset.

Invariant: segments are sorted by base offset with no duplicates; the last one is the
active segment. Thread-safety: none (owned by ``Log``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from .segment import LogSegment


class LogSegments:
    def __init__(self) -> None:
        self._bases: list[int] = []
        self._segments: list[LogSegment] = []

    def append(self, segment: LogSegment) -> None:
        if self._bases and segment.base_offset <= self._bases[-1]:
            raise ValueError(f"segment {segment.base_offset} does not follow {self._bases[-1]}")
        self._bases.append(segment.base_offset)
        self._segments.append(segment)

    def floor_index(self, offset: int) -> int:
        """Index of the segment whose range holds ``offset`` (the last base <= offset).

        0 when ``offset`` is below every base offset.
        """
        return max(bisect.bisect_right(self._bases, offset) - 1, 0)

    def pop_from(self, index: int) -> list[LogSegment]:
        """Remove and return the segments at ``index`` and after."""
        removed = self._segments[index:]
        del self._segments[index:], self._bases[index:]
        return removed

    def pop_first(self) -> LogSegment:
        self._bases.pop(0)
        return self._segments.pop(0)

    @property
    def first(self) -> LogSegment:
        return self._segments[0]

    @property
    def last(self) -> LogSegment:
        return self._segments[-1]

    @property
    def base_offsets(self) -> list[int]:
        return list(self._bases)

    def __getitem__(self, index: int) -> LogSegment:
        return self._segments[index]

    def __len__(self) -> int:
        return len(self._segments)

    def __iter__(self) -> Iterator[LogSegment]:
        return iter(list(self._segments))
