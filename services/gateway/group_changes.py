"""``GroupChanges``: wakes JoinGroup calls waiting for their group to change.

A member waiting in a rebalance has to notice when the others have joined, left, or the
rebalance's deadline passed, all of which are writes or deletions of the group's keys in
etcd (``group_coordinator``'s module docstring). Re-reading the group every 100 ms cost
three etcd reads per waiting member per tick (a 500-member rebalance: 15,000 reads a
second) and up to a tick of delay per step. Instead one etcd watch per gateway covers
every group's membership keys (``group-`` prefixes: states, sessions, fences, rebalance
timers, empty marks; not ``groups/``, the committed offsets), and a waiter sleeps until a change of
its own group arrives.

Invariants:
- A waiter takes a ``ticket`` before it reads the group, and ``wait`` returns at once if
  the group changed since: a change that lands between the read and the wait is never
  missed.
- Versions are counted only for groups with a waiter, so the table is bounded by the
  concurrent JoinGroup calls, not by the number of groups.
- While the watch is down (etcd restarted, history compacted) ``wait`` sleeps at most
  ``POLL_FALLBACK_S``, as the old polling did, and the next waiter past
  ``RESTART_BACKOFF_S`` starts the watch again. Even when healthy a wait is capped by
  ``MAX_WAIT_S``: a missed event costs a second, never a stuck join.
- Each watch attempt has a number; a failure reported for an attempt counts only for that
  attempt, and an attempt that failed before ``watch_prefix`` returned is never marked
  healthy (it used to be, and then nothing restarted it: every wait ran to its cap).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Final
from urllib.parse import unquote

from services.metastore import MetaStore, MetaStoreError, WatchEvent
from tidelog.logging import get_logger

_log = get_logger(component="gateway.group_changes")

GROUP_KEYS_PREFIX: Final = "group-"
"""Covers group-states/, group-sessions/, group-fences/ and group-rebalances/ (the second
path segment is the percent-encoded group id in each)."""
POLL_FALLBACK_S: Final = 0.1
MAX_WAIT_S: Final = 1.0
RESTART_BACKOFF_S: Final = 5.0


def group_of_key(key: str) -> str | None:
    """The group id a ``group-<kind>/<encoded group>[/...]`` key belongs to."""
    parts = key.split("/", 2)
    if len(parts) < 2 or not parts[0].startswith(GROUP_KEYS_PREFIX) or not parts[1]:
        return None
    return unquote(parts[1])


class Ticket:
    """What a waiter saw of its group's version before reading the group."""

    __slots__ = ("group_id", "version")

    def __init__(self, group_id: str, version: int) -> None:
        self.group_id = group_id
        self.version = version


class GroupChanges:
    """See the module docstring. Thread-safe."""

    def __init__(self, store: MetaStore) -> None:
        self._store = store
        self._cond = threading.Condition()
        self._waiters: Counter[str] = Counter()
        self._versions: dict[str, int] = {}
        self._cancel: Callable[[], None] | None = None  # the watch's, while it runs
        self._healthy = False
        self._restart_after = 0.0
        self._starting = False
        self._stopped = False
        self._attempt = 0  # the number of the latest watch attempt
        self._failed_attempt = -1  # the latest attempt whose watch reported a failure

    def start(self) -> None:
        """Start the watch; if etcd does not answer, waits poll until a later restart."""
        self._restart()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            cancel, self._cancel = self._cancel, None
            self._healthy = False
            self._cond.notify_all()
        if cancel is not None:
            cancel()

    # --- waiting --------------------------------------------------------------------------

    def ticket(self, group_id: str) -> Ticket:
        """Register a waiter for ``group_id``; pair with ``done``."""
        self._maybe_restart()
        with self._cond:
            self._waiters[group_id] += 1
            return Ticket(group_id, self._versions.get(group_id, 0))

    def wait(self, ticket: Ticket, timeout_s: float) -> None:
        """Sleep until the group changed after ``ticket`` was taken (or renewed), or
        ``timeout_s`` passed; then renew the ticket to the version seen."""
        with self._cond:
            limit = min(timeout_s, MAX_WAIT_S if self._healthy else POLL_FALLBACK_S)
            self._cond.wait_for(
                lambda: (
                    self._versions.get(ticket.group_id, 0) != ticket.version
                    or not self._healthy
                    or self._stopped
                ),
                timeout=max(0.0, limit),
            )
            ticket.version = self._versions.get(ticket.group_id, 0)
        if not self._healthy:
            # Woken by the watch's failure (or never watching): poll, not spin.
            time.sleep(max(0.0, min(timeout_s, POLL_FALLBACK_S)))

    def done(self, ticket: Ticket) -> None:
        with self._cond:
            self._waiters[ticket.group_id] -= 1
            if self._waiters[ticket.group_id] <= 0:
                del self._waiters[ticket.group_id]
                self._versions.pop(ticket.group_id, None)

    # --- the watch ------------------------------------------------------------------------

    def _on_event(self, event: WatchEvent) -> None:
        group_id = group_of_key(event.key)
        if group_id is None:
            return
        with self._cond:
            if group_id in self._waiters:
                self._versions[group_id] = self._versions.get(group_id, 0) + 1
                self._cond.notify_all()

    def _on_error(self, attempt: int, error: MetaStoreError) -> None:
        _log.warning("group_watch_failed", error=str(error), attempt=attempt)
        with self._cond:
            if attempt != self._attempt:
                return  # an older watch's late report: the current one is not affected
            self._failed_attempt = attempt
            self._healthy = False
            self._cancel = None
            self._restart_after = time.monotonic() + RESTART_BACKOFF_S
            self._cond.notify_all()

    def _maybe_restart(self) -> None:
        with self._cond:
            due = (
                not self._healthy
                and not self._starting
                and not self._stopped
                and time.monotonic() >= self._restart_after
            )
        if due:
            self._restart()

    def _restart(self) -> None:
        with self._cond:
            if self._starting or self._stopped:
                return
            self._starting = True
            self._attempt += 1
            attempt = self._attempt

        def on_error(error: MetaStoreError) -> None:
            self._on_error(attempt, error)

        try:
            cancel = self._store.watch_prefix(GROUP_KEYS_PREFIX, self._on_event, on_error=on_error)
        except MetaStoreError as exc:
            _log.warning("group_watch_unavailable", error=str(exc))
            with self._cond:
                self._starting = False
                self._restart_after = time.monotonic() + RESTART_BACKOFF_S
            return
        with self._cond:
            self._starting = False
            if self._stopped or self._failed_attempt == attempt:
                # Stopped meanwhile, or this watch already failed (``_on_error`` set the
                # restart backoff): do not call it healthy.
                stale: Callable[[], None] | None = cancel
            else:
                stale = None
                self._cancel = cancel
                self._healthy = True
                # Whatever changed before the watch began was not seen: wake everyone.
                for group_id in self._waiters:
                    self._versions[group_id] = self._versions.get(group_id, 0) + 1
                self._cond.notify_all()
        if stale is not None:
            stale()
