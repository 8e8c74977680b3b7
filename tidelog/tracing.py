"""Hop-by-hop timestamps of a record's way through the cluster, for latency work.

Off unless the environment names a directory in ``TIDELOG_TRACE_DIR`` when this module is
first imported; every process started with it (the SDK's, storage nodes') then appends
one line per event to ``<dir>/<pid>.log``:

    <unix time ns> <thread id> <event> <fields...>

Wall-clock nanoseconds, so lines of processes on one machine compare. Events and their
fields (partition numbers and offsets tie them together; ``bench/trace_tick.py`` reads
them):

- ``c_call``: ``Producer.send_batch`` called (the timestamp its records carry);
- ``c_send cid partition``: a direct-mode Append, or a ProduceRequest to the gateway
  (its first partition), handed to gRPC; ``c_ack cid base last``: its answer (the first
  partition's offsets); ``c_fail partition error retry|fail message``: a request
  for the partition failed, and whether its batches go back to be retried;
- ``g_in cid`` / ``g_out cid``: a gateway read a ProduceRequest from its stream / queued
  the answer; ``g_ap_in partition`` / ``g_ap_out partition base last``: the gateway's
  Append to the partition's leader started / was answered;
- ``ap_in partition`` / ``ap_done partition base last`` / ``ap_out partition base last``:
  a storage node's Append handler started, appended, answered (after acks=all);
- ``f_in replica p:offset,...`` / ``f_out replica p:offset,... bytes``: a Fetch handler
  started / answered (replica -1: a consumer);
- ``fr_recv p:offset:bytes,...`` / ``fr_app partition offset``: a follower's fetch answer
  arrived / one partition's records appended;
- ``hw partition offset``: a leader's high watermark moved;
- ``k_recv p:offset,...``: a consumer's fetch answered.

Lines are buffered and written by a thread every ``FLUSH_INTERVAL_S`` and at exit, so a
process killed with SIGKILL loses its last half second. Callers check ``ENABLED`` before building
fields, so a process that does not trace pays one attribute read per hop.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Final

TRACE_DIR_ENV: Final = "TIDELOG_TRACE_DIR"
FLUSH_INTERVAL_S: Final = 0.5
MAX_BUFFERED_LINES: Final = 1_000_000
"""Lines held while the trace file cannot be written (about 100 MB); older ones go."""

_directory = os.environ.get(TRACE_DIR_ENV) or None
ENABLED: Final = _directory is not None


_lock = threading.Lock()
_lines: list[str] = []


def event(name: str, *fields: object) -> None:
    """Record ``name`` with ``fields`` now (nothing unless ``ENABLED``)."""
    if not ENABLED:
        return
    line = f"{time.time_ns()} {threading.get_ident()} {name} {' '.join(map(str, fields))}\n"
    with _lock:
        _lines.append(line)


def flush() -> None:
    """Write the buffered lines (also at exit). Lines a failed write could not take stay
    buffered for the next try, up to ``MAX_BUFFERED_LINES`` (the oldest go first)."""
    if _directory is None:
        return
    with _lock:
        taken = list(_lines)
        _lines.clear()
    if not taken:
        return
    try:
        with open(Path(_directory) / f"{os.getpid()}.log", "a") as f:
            f.write("".join(taken))
    except OSError:
        with _lock:
            _lines[:0] = taken
            del _lines[: max(0, len(_lines) - MAX_BUFFERED_LINES)]
        raise


def _flush_every_interval() -> None:
    # A failed write (the directory gone, a full disk) must not end the thread: every
    # event after it was held in memory for ever (found by an audit).
    while True:
        time.sleep(FLUSH_INTERVAL_S)
        _flush_quietly()


def _flush_quietly() -> None:
    with contextlib.suppress(OSError):
        flush()


if ENABLED:
    atexit.register(_flush_quietly)
    # A thread of its own, so the hops being timed never wait for the file.
    threading.Thread(target=_flush_every_interval, name="tidelog-trace", daemon=True).start()

__all__ = ["ENABLED", "TRACE_DIR_ENV", "event", "flush"]
