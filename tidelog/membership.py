"""A consumer's membership in its group: Kafka's ``ConsumerCoordinator``, client side.

A consumer with a ``group_id`` that ``subscribe``s is a member of its group: the gateway
splits the subscribed topics' partitions among the members (Kafka's range assignor) and
moves them when members come, go or die, or a topic's partition count changes. The
protocol is Kafka's eager one (docs/SDK.md, consumer groups):

1. ``JoinGroup`` until it answers NONE with this member's partitions. A rebalance waits
   until every member joined again (or its rebalance timeout passed), so a partition's
   previous owner has given it up, and committed its position, before the next owner
   reads the committed offset.
2. A heartbeat thread sends ``Heartbeat`` every ``heartbeat_interval_ms``. An answer of
   REBALANCE_IN_PROGRESS, ILLEGAL_GENERATION or UNKNOWN_MEMBER_ID makes the next
   ``poll`` give up every partition (committing first with auto-commit) and join again.
   No heartbeat for ``session_timeout_ms`` (a dead process) ends the membership.
3. A ``poll`` more than ``max_poll_interval_ms`` after the previous one means the
   application is stuck: the heartbeat thread leaves the group, as Kafka's does, so the
   partitions move on; the next ``poll`` joins again. Time in a rebalance callback counts
   too, though the poll calls it: a poll's own waits (for records, for a JoinGroup
   answer) do not.
4. ``close`` and ``unsubscribe`` leave the group at once. A membership left is done
   for good: it never joins nor heartbeats again (the consumer makes a new one to join
   again). A join or heartbeat thread started after the leave used to put a member
   back in the group that nobody polled for, holding partitions: a zombie.

Static membership (``group_instance_id``, Kafka's group.instance.id, KIP-345): the member
keeps its place across restarts. It never sends LeaveGroup (not on ``close``, nor past
``max_poll_interval_ms``: it stops heartbeating and its session ends); a consumer joining
with the same instance id while the place is held takes it over with its partitions and
no rebalance, and the previous one is fenced (``FencedInstanceIdError``, fatal). A
rolling restart of static members within their session timeout moves no partition.

Commits name the member and its generation; the gateway refuses those of a member that
is no longer in the generation that owns the partitions (Kafka's commit fencing).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Final

from tidelog.client import GatewayConnection
from tidelog.errors import (
    ErrorCode,
    RebalanceInProgressError,
    TidelogError,
    UnknownMemberIdError,
    error_for_code,
)
from tidelog.v1 import gateway_pb2

_log = logging.getLogger(__name__)

TopicPartition = tuple[str, int]

REJOIN_CODES: Final = frozenset(
    {
        ErrorCode.REBALANCE_IN_PROGRESS,
        ErrorCode.ILLEGAL_GENERATION,
        ErrorCode.UNKNOWN_MEMBER_ID,
    }
)
"""Answers that mean "your partitions may be someone else's now: join again"."""
JOIN_RETRY_BACKOFF_S: Final = 0.1


class GroupMembership:
    """Join, heartbeat and leave for one consumer. ``join`` and ``leave`` run on the
    consumer's thread; the heartbeat thread only sends heartbeats (and, past
    ``max_poll_interval_ms``, a leave) and raises the rejoin flag.

    Invariant: after ``leave()`` nothing restarts the heartbeat thread and ``join`` joins
    no more (returns None); a join answered after a leave that raced it is left at once.
    ``_left`` is written under ``_lock``, as are the member id and generation."""

    def __init__(
        self,
        conn: GatewayConnection,
        group_id: str,
        *,
        client_id: str,
        session_timeout_ms: int,
        rebalance_timeout_ms: int,
        heartbeat_interval_ms: int,
        max_poll_interval_ms: int,
        wake: Callable[[], None],
        instance_id: str = "",
    ) -> None:
        self._conn = conn
        self.instance_id = instance_id
        self.group_id = group_id
        self._client_id = client_id
        self._session_timeout_ms = session_timeout_ms
        self._rebalance_timeout_ms = rebalance_timeout_ms
        self._heartbeat_s = heartbeat_interval_ms / 1000
        self._max_poll_interval_s = max_poll_interval_ms / 1000
        self._wake = wake
        self._lock = threading.Lock()
        self._member_id = ""
        self._generation = -1
        self._joined = False  # the current generation's assignment is in use
        # The partitions may be someone else's already (ILLEGAL_GENERATION,
        # UNKNOWN_MEMBER_ID, or left for max_poll_interval_ms): Kafka's "partitions lost".
        self._lost = False
        self._last_poll = time.monotonic()
        # Inside a poll (Kafka counts the time a poll waits as polling: an idle consumer
        # in a long poll is not stuck, and one that left must not leave again at once).
        self._in_poll = False
        self._fenced: TidelogError | None = None  # FENCED_INSTANCE_ID: fatal
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._left = False  # leave() was called: no join, no heartbeats, ever again

    # --- the consumer's thread ------------------------------------------------------------

    @property
    def member_id(self) -> str:
        with self._lock:
            return self._member_id

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    def needs_join(self) -> bool:
        with self._lock:
            return not self._joined

    def raise_if_fenced(self) -> None:
        """Raise FencedInstanceIdError once another consumer took this static member's
        place: it must stop (joining again would take the place back and forth)."""
        with self._lock:
            fenced = self._fenced
        if fenced is not None:
            raise fenced

    def partitions_lost(self) -> bool:
        """Whether the partitions held may already be another member's (not only about
        to move): their buffered records must not be handed out, nor commits tried."""
        with self._lock:
            return self._lost

    def request_rejoin(self) -> None:
        with self._lock:
            self._joined = False

    def polled(self) -> None:
        self._last_poll = time.monotonic()

    @contextmanager
    def polling(self) -> Iterator[None]:
        """Around a poll's wait: max_poll_interval_ms is time between polls, not in them."""
        self._in_poll = True
        try:
            yield
        finally:
            self._last_poll = time.monotonic()
            self._in_poll = False

    @contextmanager
    def in_callback(self) -> Iterator[None]:
        """Around a rebalance callback: its time is the application's, so it counts
        against max_poll_interval_ms even inside a poll, as in Kafka (the poll timer is
        reset when poll starts and a join completes, not while listeners run). Counted as
        polling, a callback hung past it kept this member's partitions, heartbeating, for
        ever: nobody read them (found by an audit)."""
        was_in_poll = self._in_poll
        if was_in_poll:
            # The poll's wait up to here was polling: the interval starts now. (Set before
            # the flag drops: the heartbeat thread must not see the poll's start time.)
            self._last_poll = time.monotonic()
        self._in_poll = False
        try:
            yield
        finally:
            # (Outside a poll, as in subscribe or close, the time since the last poll goes
            # on counting; inside one, the rest of the poll is polling again.)
            self._in_poll = was_in_poll

    def commit_identity(self) -> tuple[str, int]:
        """The member id and generation ("" and -1 when not joined), for
        ``group_metadata``; commits use ``generation_for_commit``, which refuses them."""
        with self._lock:
            if not self._member_id:
                return "", -1
            return self._member_id, self._generation

    def generation_for_commit(self) -> tuple[str, int]:
        """The member id and generation a commit names, or the error that refuses it
        (Kafka's ConsumerCoordinator commits only in a generation). Read under one lock
        with the fenced and lost flags: the heartbeat thread changes them together, and
        a commit must not name a member id read before a change with a flag read after.

        Raises FencedInstanceIdError once fenced; UnknownMemberIdError (Kafka's
        CommitFailedException) when the partitions may be another member's already, or
        when the membership was left; RebalanceInProgressError while it (re)joins without
        a generation: before its first join completes, or after a JoinGroup answered
        UNKNOWN_MEMBER_ID. Such commits used to go as an outsider's (member "",
        generation -1), which the gateway takes whenever the group is empty: an offset
        the partition's last owner committed went backwards (found by an audit)."""
        with self._lock:
            if self._fenced is not None:
                raise self._fenced
            if self._lost:
                raise UnknownMemberIdError(
                    "this consumer's partitions may belong to another member now (it left "
                    "or was dropped from the group); it joins again at its next poll"
                )
            if self._member_id and self._generation >= 0:
                return self._member_id, self._generation
            if self._left:
                raise UnknownMemberIdError(
                    f"this consumer left group {self.group_id!r}: it is no member to commit as"
                )
        raise RebalanceInProgressError(
            f"this consumer is joining group {self.group_id!r} and has no generation yet: "
            "its commits wait until a poll completes the join (they would go as an "
            "outsider's and could overwrite what the partitions' last owner committed)"
        )

    def join(
        self,
        topics: Sequence[str],
        deadline: float,
        check_interrupt: Callable[[], None] = lambda: None,
    ) -> list[TopicPartition] | None:
        """Join (again) with ``topics``; this member's partitions, or None when
        ``deadline`` (monotonic) came first (the next call goes on with the same member id)
        or the membership was left. Raises the gateway's error for a request it refuses (a
        bad topic name), and whatever ``check_interrupt`` raises before each request
        (Consumer.wakeup())."""
        self._start_heartbeats()
        while True:
            with self._lock:
                if self._left:
                    return None
            check_interrupt()
            request = gateway_pb2.JoinGroupRequest(
                group_id=self.group_id,
                member_id=self.member_id,
                topics=list(topics),
                session_timeout_ms=self._session_timeout_ms,
                rebalance_timeout_ms=self._rebalance_timeout_ms,
                client_id=self._client_id,
                max_wait_ms=max(0, int((deadline - time.monotonic()) * 1000)),
                group_instance_id=self.instance_id,
            )
            try:
                response: gateway_pb2.JoinGroupResponse = self._conn.call(
                    self._conn.stub.JoinGroup, request, f"join group {self.group_id!r}"
                )
            except TidelogError as exc:
                # An unreachable gateway, or a group changing too fast to write: ask again.
                if exc.code == ErrorCode.FENCED_INSTANCE_ID:
                    self._fence(exc)
                if not (exc.retriable or exc.code == ErrorCode.REBALANCE_IN_PROGRESS):
                    raise
                if time.monotonic() + JOIN_RETRY_BACKOFF_S >= deadline:
                    return None
                time.sleep(JOIN_RETRY_BACKOFF_S)
                continue
            code = _code_of(response.error.code)
            if code == ErrorCode.NONE:
                with self._lock:
                    left = self._left
                    if not left:
                        self._member_id = response.member_id
                        self._generation = response.generation_id
                        self._joined = True
                        self._lost = False
                if left:
                    # leave() ran while this join waited: the member it made is no one's.
                    if not self.instance_id:
                        self._send_leave(response.member_id)
                    return None
                assignment = [(tp.topic, tp.partition) for tp in response.assignment]
                _log.info(
                    "joined group %r as %s in generation %d: %d partition(s)",
                    self.group_id,
                    response.member_id,
                    response.generation_id,
                    len(assignment),
                )
                return assignment
            if code == ErrorCode.UNKNOWN_MEMBER_ID:
                with self._lock:
                    self._member_id = ""  # join as a new member
                    self._generation = -1
            elif code in (ErrorCode.REBALANCE_IN_PROGRESS, ErrorCode.MEMBER_ID_REQUIRED):
                with self._lock:
                    self._member_id = response.member_id
                if code == ErrorCode.MEMBER_ID_REQUIRED:
                    continue  # join again at once, naming it (KIP-394)
            else:
                raise error_for_code(
                    code, f"join group {self.group_id!r}: {response.error.message}"
                )
            if time.monotonic() + JOIN_RETRY_BACKOFF_S >= deadline:
                return None
            if code == ErrorCode.UNKNOWN_MEMBER_ID:
                time.sleep(JOIN_RETRY_BACKOFF_S)

    def _fence(self, error: TidelogError) -> None:
        with self._lock:
            self._fenced = error
            self._joined = False
            self._lost = True
            self._member_id, self._generation = "", -1
        self._stopped.set()  # no more heartbeats for a place another consumer holds

    def on_commit_error(self, error: TidelogError) -> None:
        """A commit was refused by the group: its partitions may be gone; join again."""
        if error.code == ErrorCode.FENCED_INSTANCE_ID:
            self._fence(error)
            return
        if error.code in REJOIN_CODES:
            with self._lock:
                self._joined = False
                if error.code != ErrorCode.REBALANCE_IN_PROGRESS:
                    self._lost = True
                if error.code == ErrorCode.UNKNOWN_MEMBER_ID:
                    self._member_id = ""
                    self._generation = -1

    def leave(self) -> None:
        """Leave the group now (best effort: a gateway that cannot be reached lets the
        session end by itself) and stop heartbeating, for good (class docstring)."""
        with self._lock:
            self._left = True  # before the stop: _start_heartbeats checks it under the lock
        self._stopped.set()
        with self._lock:
            member_id, self._member_id = self._member_id, ""
            self._generation = -1
            self._joined = False
        if member_id and not self.instance_id:
            # A static member does not leave: its place (and partitions) wait for it to
            # come back until its session ends (KIP-345).
            self._send_leave(member_id)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._conn.timeout_s)

    def _send_leave(self, member_id: str) -> None:
        try:
            self._conn.call(
                self._conn.stub.LeaveGroup,
                gateway_pb2.LeaveGroupRequest(
                    group_id=self.group_id,
                    member_id=member_id,
                    group_instance_id=self.instance_id,
                ),
                f"leave group {self.group_id!r}",
            )
        except TidelogError as exc:
            _log.warning("could not leave group %r (%s); its session will end", self.group_id, exc)

    # --- the heartbeat thread -------------------------------------------------------------

    def _start_heartbeats(self) -> None:
        with self._lock:
            # Never after leave(): clearing _stopped there restarted the heartbeats of a
            # member that had left (a join racing a close), and kept it in the group.
            if self._left or (self._thread is not None and self._thread.is_alive()):
                return
            self._stopped.clear()
            self._thread = threading.Thread(
                target=self._heartbeat_loop,
                name=f"tidelog-heartbeat-{self.group_id}",
                daemon=True,
            )
            self._thread.start()

    def _heartbeat_loop(self) -> None:
        while not self._stopped.wait(self._heartbeat_s):
            with self._lock:
                member_id, generation = self._member_id, self._generation
            if not member_id:
                continue
            if not self._in_poll and time.monotonic() - self._last_poll > self._max_poll_interval_s:
                _log.warning(
                    "no poll for over max_poll_interval_ms (%d ms): leaving group %r so its "
                    "partitions move on; the next poll joins again",
                    int(self._max_poll_interval_s * 1000),
                    self.group_id,
                )
                with self._lock:
                    if self._member_id == member_id:
                        self._member_id, self._generation, self._joined = "", -1, False
                        self._lost = True
                if not self.instance_id:
                    self._send_leave(member_id)  # (a static member's session just ends)
                self._wake()
                continue
            try:
                response: gateway_pb2.HeartbeatResponse = self._conn.call(
                    self._conn.stub.Heartbeat,
                    gateway_pb2.HeartbeatRequest(
                        group_id=self.group_id,
                        member_id=member_id,
                        generation_id=generation,
                        group_instance_id=self.instance_id,
                    ),
                    f"heartbeat to group {self.group_id!r}",
                )
            except TidelogError as exc:
                # The gateway is unreachable or busy: try again at the next interval (the
                # session outlives a few missed heartbeats).
                _log.debug("heartbeat failed: %s", exc)
                continue
            code = _code_of(response.error.code)
            if code == ErrorCode.NONE:
                continue
            if code == ErrorCode.FENCED_INSTANCE_ID:
                self._fence(error_for_code(code, response.error.message))
                self._wake()
                return
            with self._lock:
                if (self._member_id, self._generation) != (member_id, generation):
                    continue  # answered about a generation the consumer already left
                self._joined = False
                if code != ErrorCode.REBALANCE_IN_PROGRESS:
                    self._lost = True
                if code == ErrorCode.UNKNOWN_MEMBER_ID:
                    self._member_id, self._generation = "", -1
            _log.info("group %r: %s; joining again", self.group_id, response.error.message)
            self._wake()


def _code_of(code: int) -> ErrorCode:
    """The wire code as an ErrorCode; one this client does not know (a newer gateway's)
    is UNKNOWN_SERVER_ERROR. ``ErrorCode(code)`` raised ValueError on it, which ended the
    heartbeat thread silently: the session then expired while the consumer went on
    handing out records of partitions already another member's (found by an audit)."""
    return ErrorCode.NONE if code == 0 else error_for_code(code).code
