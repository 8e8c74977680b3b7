"""Sparse indexes of one segment: ``.index`` (offset) and ``.timeindex`` (time).

Both are arrays of fixed-size little-endian entries (``tidelog.formats``), appended in
increasing key order and binary-searched with a floor lookup. Following Kafka's
``AbstractIndex``, the file of the active segment is preallocated to
``segment_index_bytes``; when the segment rolls or closes the file is trimmed to its
entries and memory-mapped (read-only) for lookups.

Unlike Kafka, entries are written with ``pwrite``, never stored into a mapping. A store
into a shared file mapping can page-fault (the first write to a page, and again after
writeback cleaned it), and Python takes that fault holding the GIL: the whole process
stops for it. With 100 partitions per broker the faults of index stores were 62% of a
broker's GIL time and the cluster ran at 2.4x less throughput (BENCHMARKS.md);
``pwrite`` does the same page-cache write inside a system call that releases the GIL.

An index is a cache derived from the ``.log``: a missing or damaged index is rebuilt from
the log, never trusted over it. ``IndexCorruptError`` tells the owner to rebuild.

File descriptors: one per index file, active or not (Python's ``mmap`` keeps a duplicate
of the descriptor it maps, so a mapped index with its own held two: five per segment with
the ``.log``, and an audit's brokers with 3,000 partitions ran out). The active index has
its own descriptor, for ``pwrite`` and ``fsync``, and no mapping: lookups read it with
``pread`` (one read for a key at or past the last entry, the log-end case followers and
tailing consumers ask; a binary search of reads otherwise), so its entries cost no
memory of their own and the page cache keeps them as for a mapping. An inactive one
(loaded read-only, or trimmed when its segment rolled) keeps only the mapping's
duplicate, and reopens the file by its path for the rare change (truncation, a rebuild,
becoming active again) and for ``flush``: an fsync through a new descriptor makes the
same pages durable (the page cache is the inode's) and reports a writeback error nobody
has seen yet (Linux >= 4.16), and nothing else fsyncs index files. Its path does not
change while it is open: segment files are renamed or unlinked, and log directories
renamed, only after closing.

Thread-safety: none. The owning segment (and ultimately the partition's lock) serializes
every call.
"""

from __future__ import annotations

import bisect
import errno
import functools
import mmap
import operator
import os
import struct
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Final

from tidelog import formats

from .errors import IndexCorruptError

_CHECK_CHUNK_ENTRIES = 1 << 16
"""Entries decoded per call by the load-time checks (``columns``)."""


def _increasing(values: tuple[int, ...], previous: int, *, strictly: bool) -> bool:
    """Whether ``previous, *values`` increase (strictly, or never decrease): a C-level
    pairwise compare, no Python loop per entry."""
    compare = operator.lt if strictly else operator.le
    return compare(previous, values[0]) and all(map(compare, values, islice(values, 1, None)))


_READ_WINDOW_ENTRIES: Final = 256
"""An active index's search reads single entries until this many remain, then all of
them at once (at most 3 KiB)."""


class _MappedIndex:
    """Entries of ``_ENTRY`` layout whose first field is the search key.

    Invariant: entries ``[0, entries)`` are valid and strictly increasing in key and in
    relative offset; bytes past them are zero (preallocation) or absent (trimmed file).
    Writable: ``_fd`` is open and there is no mapping (reads are ``pread``s). Otherwise
    ``_fd`` is -1 and ``_mm`` maps the trimmed file (the mapping's own descriptor keeps it
    readable; an empty inactive index holds none).
    """

    _ENTRY: struct.Struct

    def __init__(self, path: Path, base_offset: int, max_index_bytes: int, writable: bool) -> None:
        self.path = path
        self.base_offset = base_offset
        self._entry_size = self._ENTRY.size
        # Round down so the preallocated size is a whole number of entries.
        self._max_bytes = max_index_bytes - max_index_bytes % self._entry_size
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._mm: mmap.mmap | None = None
        self._closed = False
        # Whether an fsync since the file was opened covers every change to it (False at
        # first: the previous process may have left changes in the page cache only).
        self._synced = False
        self.writable = False
        size = os.fstat(self._fd).st_size
        if size % self._entry_size:
            self._release_fd()
            raise IndexCorruptError(
                f"{path.name}: size {size} is not a multiple of {self._entry_size}"
            )
        self.entries = size // self._entry_size
        if writable:
            self.make_writable()
        else:
            self._map(size)
            self._release_fd()  # read-only: the mapping's descriptor is enough

    # --- mapping -------------------------------------------------------------------------

    def _open_fd(self) -> int:
        """The index's own descriptor, reopened by path if it was released."""
        if self._closed:  # as any call on a closed descriptor would fail
            raise OSError(errno.EBADF, f"{self.path.name} is closed")
        if self._fd < 0:
            # No O_CREAT: the file exists while the index is open (see the module
            # docstring); a file gone from under it fails here rather than reappearing.
            self._fd = os.open(self.path, os.O_RDWR)
        return self._fd

    def _release_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _map(self, size: int) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if size > 0:
            self._mm = mmap.mmap(self._open_fd(), size, prot=mmap.PROT_READ)

    def make_writable(self) -> None:
        """Preallocate to the maximum size (appends never grow the file) and drop the
        mapping: the active index is read through its own descriptor (module docstring)."""
        if self.writable:
            return
        fd = self._open_fd()
        self._map(0)
        os.ftruncate(fd, max(self._max_bytes, self.entries * self._entry_size))
        self._synced = False
        self.writable = True

    def trim(self) -> None:
        """Shrink the file to its entries: done when the segment stops being active."""
        size = self.entries * self._entry_size
        self._map(0)
        os.ftruncate(self._open_fd(), size)
        self._synced = False
        self._map(size)
        self.writable = False
        self._release_fd()  # not needed until a change or an fsync (module docstring)

    # --- reading -------------------------------------------------------------------------

    @classmethod
    @functools.cache
    def _keys_struct(cls, count: int) -> struct.Struct:
        """Unpacks the keys of ``count`` consecutive entries (skipping the other fields)."""
        key = cls._ENTRY.format.lstrip("<")[0]
        pad = cls._ENTRY.size - struct.calcsize("<" + key)
        return struct.Struct("<" + (key + f"{pad}x") * count)

    def _pread(self, position: int, size: int) -> bytes:
        """``size`` bytes of the active index's file at ``position``."""
        data = os.pread(self._fd, size, position)
        if len(data) != size:  # only another process could have shrunk the file
            raise IndexCorruptError(f"{self.path.name}: file ends before {position + size}")
        return data

    def entry(self, slot: int) -> tuple[int, int]:
        assert 0 <= slot < self.entries
        if self._mm is not None:
            key, value = self._ENTRY.unpack_from(self._mm, slot * self._entry_size)
        else:
            key, value = self._ENTRY.unpack(self._pread(slot * self._entry_size, self._entry_size))
        return int(key), int(value)

    def _zero_tail(self) -> bool:
        """Whether the last of several entries is all zeros: preallocated space of a file
        never trimmed (its segment was active at an unclean shutdown), which the ordering
        checks would refuse anyway, after decoding a whole chunk. Read first, it makes a
        restart after kill -9 check each active index with one small read: decoding the
        first 64K slots of both indexes cost ~3 ms per partition, 11 s for 3,000
        partitions (BENCHMARKS.md, scale)."""
        if self.entries < 2:
            return False
        last = (self.entries - 1) * self._entry_size
        if self._mm is not None:
            tail = self._mm[last : last + self._entry_size]
        else:
            tail = self._pread(last, self._entry_size)
        return not any(tail)

    def columns(self) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Keys and values of the entries, ``_CHECK_CHUNK_ENTRIES`` at a time.

        One ``unpack_from`` per chunk decodes many entries in C, so the load-time checks
        are a few milliseconds for a trimmed index of a full 1 GiB segment; chunks bound
        the memory (an int object per field) for a large preallocated file.
        """
        if not self.entries:
            return
        pair = self._ENTRY.format.lstrip("<")
        for first in range(0, self.entries, _CHECK_CHUNK_ENTRIES):
            count = min(_CHECK_CHUNK_ENTRIES, self.entries - first)
            position = first * self._entry_size
            if self._mm is not None:
                flat = struct.unpack_from("<" + pair * count, self._mm, position)
            else:
                chunk = self._pread(position, count * self._entry_size)
                flat = struct.unpack("<" + pair * count, chunk)
            yield flat[0::2], flat[1::2]

    @property
    def is_full(self) -> bool:
        return self.entries * self._entry_size >= self._max_bytes

    def _floor_slot(self, key: int) -> int:
        """Slot of the largest entry whose key is <= ``key``, or -1 if there is none."""
        lo, hi = 0, self.entries - 1
        if hi >= 0 and self.entry(hi)[0] <= key:
            # At or past the last entry: followers and consumers at the log end ask this
            # most, and the active index answers it with one read instead of a search.
            return hi
        found = -1  # slots before lo have keys <= key (found is the last), after hi > key
        while lo <= hi:
            if self._mm is None and hi - lo < _READ_WINDOW_ENTRIES:
                # The rest in one read, searched in memory: a read per probe cost ~4 us.
                count = hi - lo + 1
                chunk = self._pread(lo * self._entry_size, count * self._entry_size)
                below = bisect.bisect_right(self._keys_struct(count).unpack(chunk), key)
                return lo + below - 1 if below else found
            mid = (lo + hi) // 2
            if self.entry(mid)[0] <= key:
                found = mid
                lo = mid + 1
            else:
                hi = mid - 1
        return found

    # --- writing -------------------------------------------------------------------------

    def _append_entry(self, key: int, value: int) -> None:
        if not self.writable:
            raise RuntimeError(f"{self.path.name} is not the active segment's index")
        if self.is_full:
            raise RuntimeError(f"{self.path.name} is full; the segment should have rolled")
        # pwrite, not a store into the mapping: see the module docstring.
        os.pwrite(self._fd, self._ENTRY.pack(key, value), self.entries * self._entry_size)
        self._synced = False
        self.entries += 1

    def _truncate_entries(self, entries: int) -> None:
        """Keep the first ``entries`` entries, zeroing the rest in the file."""
        if entries >= self.entries:
            return
        start, end = entries * self._entry_size, self.entries * self._entry_size
        os.pwrite(self._open_fd(), bytes(end - start), start)
        self._synced = False
        self.entries = entries
        if not self.writable:
            self.trim()

    def reset(self) -> None:
        """Drop every entry (before a rebuild from the log)."""
        self._truncate_entries(0)

    def flush(self) -> None:
        """fsync the file (an inactive one through a descriptor opened for it)."""
        if self._synced and not self.writable:
            return  # inactive and unchanged since this process fsynced it
        os.fsync(self._open_fd())
        self._synced = True
        if not self.writable:
            self._release_fd()

    def close(self) -> None:
        """Trim (if active) and release the mapping and the file."""
        if self._closed:
            return
        if self.writable:
            self.trim()
        self._map(0)
        self._release_fd()
        self._closed = True


class OffsetIndex(_MappedIndex):
    """Maps relative offsets to byte positions of batches in the ``.log``.

    An entry ``(offset - base_offset, position)`` says the batch starting at ``position``
    has base offset ``offset``. Entries are added at most every ``index_interval_bytes``
    and never for position 0, where the segment's first batch always is; so a floor lookup
    that finds nothing means "scan from the start".
    """

    _ENTRY = formats.OFFSET_INDEX_ENTRY

    def append(self, offset: int, position: int) -> None:
        relative = offset - self.base_offset
        if not 0 <= relative <= formats.MAX_RELATIVE_OFFSET:
            raise RuntimeError(f"offset {offset} does not fit segment {self.base_offset}")
        if self.entries and relative <= self.entry(self.entries - 1)[0]:
            raise RuntimeError(f"index entries must grow: {offset} after {self.last_offset}")
        self._append_entry(relative, position)

    @property
    def last_offset(self) -> int:
        """Offset of the last entry, or the base offset when empty."""
        return self.base_offset + (self.entry(self.entries - 1)[0] if self.entries else 0)

    def lookup(self, offset: int) -> tuple[int, int]:
        """``(offset, position)`` of the last indexed batch starting at or before ``offset``.

        ``(base_offset, 0)`` when no entry is that low. The caller scans forward from there.
        """
        slot = self._floor_slot(offset - self.base_offset)
        if slot < 0:
            return self.base_offset, 0
        relative, position = self.entry(slot)
        return self.base_offset + relative, position

    def truncate_to(self, offset: int) -> None:
        """Remove entries for batches at or after ``offset``."""
        slot = self._floor_slot(offset - self.base_offset - 1)
        self._truncate_entries(slot + 1)

    def sanity_check(self, log_size_bytes: int, end_offset: int | None = None) -> None:
        """Checks at load, linear in the entries (never a read of the log): every position
        is inside the log with room for a batch header and not 0, positions and relative
        offsets strictly increase, and every offset is below ``end_offset`` (the next
        segment's base offset, when known).

        A zero position means preallocated space from an unclean shutdown was counted as
        entries. An entry that passes these but points at the wrong batch is caught at
        lookup, where every position is confirmed against the batch header found there.
        """
        if self._zero_tail():
            raise IndexCorruptError(f"{self.path.name}: ends in zero slots (not trimmed)")
        limit = (
            formats.MAX_RELATIVE_OFFSET if end_offset is None else end_offset - self.base_offset - 1
        )
        previous_relative, previous_position = -1, 0
        for relatives, positions in self.columns():
            if not _increasing(relatives, previous_relative, strictly=True) or not _increasing(
                positions, previous_position, strictly=True
            ):
                raise IndexCorruptError(f"{self.path.name}: entries do not increase")
            previous_relative, previous_position = relatives[-1], positions[-1]
        if previous_position + formats.BATCH_HEADER_SIZE > log_size_bytes and self.entries:
            raise IndexCorruptError(
                f"{self.path.name}: position {previous_position} is past the end of a log "
                f"of {log_size_bytes} bytes"
            )
        if previous_relative > limit:
            raise IndexCorruptError(
                f"{self.path.name}: offset {self.base_offset + previous_relative} is past "
                f"the segment's end offset {end_offset}"
            )


class TimeIndex(_MappedIndex):
    """Maps timestamps to offsets: entry ``(max timestamp so far, relative offset)``.

    Timestamps in entries strictly increase (an entry is added only when the segment's
    maximum timestamp grew), so a floor lookup finds where to start scanning for the first
    batch whose timestamp reaches a target.
    """

    _ENTRY = formats.TIME_INDEX_ENTRY

    def maybe_append(self, timestamp_ms: int, offset: int) -> None:
        if self.entries and timestamp_ms <= self.entry(self.entries - 1)[0]:
            return
        self._append_entry(timestamp_ms, offset - self.base_offset)

    @property
    def last_timestamp_ms(self) -> int:
        """Largest indexed timestamp, or -1 when empty."""
        return self.entry(self.entries - 1)[0] if self.entries else -1

    def lookup(self, timestamp_ms: int) -> tuple[int, int]:
        """``(timestamp, offset)`` of the last entry with timestamp <= target.

        ``(-1, base_offset)`` when every entry is later: the scan starts at the beginning.
        """
        slot = self._floor_slot(timestamp_ms)
        if slot < 0:
            return -1, self.base_offset
        timestamp, relative = self.entry(slot)
        return timestamp, self.base_offset + relative

    def truncate_to(self, offset: int) -> None:
        """Remove entries pointing at offsets >= ``offset`` (the log is truncated there)."""
        keep = self.entries
        while keep and self.base_offset + self.entry(keep - 1)[1] >= offset:
            keep -= 1
        self._truncate_entries(keep)

    def sanity_check(self, log_size_bytes: int, end_offset: int | None = None) -> None:
        """Checks at load, linear in the entries: timestamps strictly increase (an entry is
        added only when the maximum grew; a zero slot of an untrimmed file breaks this),
        offsets never decrease and are below ``end_offset`` (the next segment's base
        offset, when known), and there are no entries for an empty log.

        ``LogSegment`` also confirms the entry it relies on against the batch it names
        (``_time_entry_holds``), since a wrong but ordered entry passes these checks.
        """
        if self.entries and log_size_bytes == 0:
            raise IndexCorruptError(f"{self.path.name}: entries for an empty log")
        if self._zero_tail():
            raise IndexCorruptError(f"{self.path.name}: ends in zero slots (not trimmed)")
        limit = (
            formats.MAX_RELATIVE_OFFSET if end_offset is None else end_offset - self.base_offset - 1
        )
        previous_timestamp, previous_relative = -(1 << 63) - 1, 0
        for timestamps, relatives in self.columns():
            if not _increasing(timestamps, previous_timestamp, strictly=True):
                raise IndexCorruptError(f"{self.path.name}: timestamps do not increase")
            if not _increasing(relatives, previous_relative, strictly=False):
                raise IndexCorruptError(f"{self.path.name}: offsets decrease")
            previous_timestamp, previous_relative = timestamps[-1], relatives[-1]
        if previous_relative > limit:
            raise IndexCorruptError(
                f"{self.path.name}: offset {self.base_offset + previous_relative} is past "
                f"the segment's end offset {end_offset}"
            )
