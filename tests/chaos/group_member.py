"""One consumer group member in a process of its own, for ``tests.chaos.groups``.

``python -m tests.chaos.group_member GATEWAY GROUP TOPIC OUT manual|auto``. Every record
it processes is written to OUT (``R <partition> <offset> <value>``), line-buffered, so a
SIGKILL loses no line written; in manual mode it commits after writing a poll's records.
Errors are written as lines too (``POLLERR`` / ``COMMITERR``): the run decides what they
mean.
"""

from __future__ import annotations

import os
import sys
import time

import tidelog
from tidelog.errors import TidelogError


def main(argv: list[str]) -> int:
    address, group, topic, out, mode = argv
    auto = mode == "auto"
    consumer = tidelog.Consumer(
        address,
        group_id=group,
        auto_offset_reset="earliest",
        session_timeout_ms=2_000,
        heartbeat_interval_ms=300,
        max_poll_interval_ms=10_000,
        enable_auto_commit=auto,
        auto_commit_interval_ms=300,
        request_timeout_ms=5_000,
    )
    consumer.subscribe([topic])
    with open(out, "a", buffering=1) as sink:
        sink.write(f"START {os.getpid()} {time.time():.3f}\n")
        while True:
            try:
                records = consumer.poll(timeout_ms=200)
            except TidelogError as exc:
                sink.write(f"POLLERR {type(exc).__name__} {str(exc)[:150]!r}\n")
                time.sleep(0.2)
                continue
            for r in records:
                value = r.value.decode() if r.value is not None else ""
                sink.write(f"R {r.partition} {r.offset} {value}\n")
            if records and not auto:
                try:
                    consumer.commit()
                except TidelogError as exc:
                    sink.write(f"COMMITERR {type(exc).__name__} {str(exc)[:150]!r}\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
