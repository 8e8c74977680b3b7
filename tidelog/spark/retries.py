"""Retrying the connector's calls through a failure that passes (a gateway restarting, a
leader moving), as Spark's Kafka source rides through a broker bounce.

Read tasks retry their fetches in ``reader``; this is for the driver's planning calls
(partitions, bounds, topic ids, group commits) and the write tasks' produce requests,
which each failed the query or the job at the first refused connection: a gateway's
rolling restart killed running streaming queries (found by an audit).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final, TypeVar

from tidelog.errors import TidelogError, UnknownTopicOrPartitionError

T = TypeVar("T")

FIRST_BACKOFF_S: Final = 0.1
MAX_BACKOFF_S: Final = 1.0


def retrying(call: Callable[[], T], timeout_s: float) -> T:
    """``call()``, made again after a retriable failure with a growing back-off, for up to
    ``timeout_s`` from the first failure; its last error is raised then. A missing topic
    is raised at once (retriable in Kafka's terms, but here the planner's and writer's
    own rules decide what a topic gone means)."""
    give_up_at: float | None = None
    backoff_s = FIRST_BACKOFF_S
    while True:
        try:
            return call()
        except UnknownTopicOrPartitionError:
            raise
        except TidelogError as exc:
            if not exc.retriable:
                raise
            now = time.monotonic()
            give_up_at = give_up_at or now + timeout_s
            if now + backoff_s >= give_up_at:
                raise
        time.sleep(backoff_s)
        backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)
