"""Incremental fetch sessions (Kafka KIP-227): both ends' bookkeeping, pure.

A follower fetches every partition it follows from a leader in one long-polling Fetch,
twice a second when idle. Naming and answering all of them each time made an idle
broker's work grow with its partitions (BENCHMARKS.md, scale): parsing and building
thousands of entries per round on both sides, reading every one on the leader. A
session lets both sides remember the last round:

- The follower (``FetchSessionHandler``) names only the partitions whose position
  changed since the previous fetch of the session, and those leaving it (``forgotten``).
- The leader (``FetchSessionCache``, one ``FetchSession`` per follower) keeps every
  partition's last position and what it last answered (high watermark, log start), and
  answers only the partitions with something new (``worth_answering``). Not reading the
  others is safe only while the leader remembers what it owes: a partition whose data
  the response's byte budget left out is read again on the next fetch (its follower's
  position did not move, so the follower will not name it), and partitions are read in
  turns (``FetchSession.in_turn``) so that the budget goes round.

The wire rules are in ``storage.proto`` (``FetchRequest.session_epoch``). Epochs order a
session's requests: the leader expects exactly ``next_epoch``; anything else (a lost
answer, a retry) fails with INVALID_FETCH_SESSION_EPOCH, and an unknown or evicted
session with FETCH_SESSION_ID_NOT_FOUND. Either way the follower forgets its session and
fetches in full, which opens a new one: nothing is ever skipped on a guess.

Pure (DESIGN §7): no threads, no clock reads (callers pass ``now_s``), no gRPC. The
storage server guards the cache with its own lock and keeps the long-poll watchers; the
fetcher thread owns its handler. Positions are opaque to this module (the server keeps
each partition's ``FetchPartition``, the follower a comparable tuple).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

from tidelog.errors import (
    FetchSessionIdNotFoundError,
    InvalidFetchSessionEpochError,
    InvalidRequestError,
)

P = TypeVar("P")
Key = tuple[str, int]
"""(topic, partition)."""

INITIAL_EPOCH: Final = 0
"""``session_epoch`` of the full fetch that opens a session (with ``session_id`` 0)."""
FINAL_EPOCH: Final = -1
"""``session_epoch`` that closes ``session_id`` and fetches without a session."""
MAX_SESSIONS: Final = 1_000
"""Sessions one leader keeps (Kafka's max.incremental.fetch.session.cache.slots). Each
follower holds one per leader, so a cluster needs as many as it has other brokers."""
SESSION_IDLE_EXPIRY_S: Final = 120.0
"""A session unused this long goes (Kafka's min.incremental.fetch.session.eviction.ms):
its follower died or follows nothing here any more. Kafka keeps such a session until the
cache is full; here each holds a watcher on every partition it named, which every append
there would go on waking, so the storage node's maintenance pass drops it."""
_MAX_EPOCH: Final = 2**31 - 1


@dataclass(slots=True)
class SessionPartition(Generic[P]):
    """A partition of a session on the leader: the follower's last position and what the
    leader last answered for it (-1: never answered, so the next answer includes it)."""

    position: P
    high_watermark: int = -1
    log_start_offset: int = -1
    turn: int = 0
    """Its place in the session's read order (``FetchSession.in_turn``): lower first."""


@dataclass(slots=True)
class FetchSession(Generic[P]):
    """One follower's session on the leader. ``partitions`` keeps the order they joined;
    ``unread`` holds the partitions the next fetch reads whether or not anything
    changed there (``answered``)."""

    session_id: int
    replica_id: int
    next_epoch: int
    last_used_s: float
    partitions: dict[Key, SessionPartition[P]] = field(default_factory=dict)
    unread: set[Key] = field(default_factory=set)
    last_turn: int = 0

    def update(
        self, named: Iterable[tuple[Key, P]], forgotten: Iterable[Key]
    ) -> tuple[list[Key], list[Key]]:
        """Apply an incremental request: ``named`` partitions join or take their new
        position (keeping what was last answered), ``forgotten`` ones leave. Returns the
        keys that joined and those that left (for the caller's watchers)."""
        joined: list[Key] = []
        left: list[Key] = []
        for key in forgotten:
            if self.partitions.pop(key, None) is not None:
                self.unread.discard(key)
                left.append(key)
        for key, position in named:
            entry = self.partitions.get(key)
            if entry is None:
                self.last_turn += 1
                self.partitions[key] = SessionPartition(position, turn=self.last_turn)
                joined.append(key)
            else:
                entry.position = position
        return joined, left

    def in_turn(self, keys: Iterable[Key]) -> list[Key]:
        """The keys of ``keys`` this session holds, in the order to read them: the
        partitions whose data was answered longest ago first. A response's byte budget
        goes to the first partitions read; in a fixed order the same few backlogged
        partitions would take it every time and starve the others (Kafka moves a
        partition to the end of its session's order when it returns data, likewise)."""
        partitions = self.partitions
        return sorted((key for key in keys if key in partitions), key=lambda k: partitions[k].turn)

    def answered(self, served: Iterable[Key], unread: Iterable[Key]) -> None:
        """An answer was built: ``served`` (its data was in it) go to the end of the
        read order; ``unread`` (data there the response's byte budget left out) are read
        again by the next fetch. Nothing else would read them: their follower's position
        did not move, so it does not name them, and their watchers fire only on new
        data, which a follower catching up with a backlog may never get."""
        for key in served:
            entry = self.partitions.get(key)
            if entry is not None:
                self.last_turn += 1
                entry.turn = self.last_turn
        self.unread = {key for key in unread if key in self.partitions}


def worth_answering(
    entry: SessionPartition[P],
    *,
    high_watermark: int,
    log_start_offset: int,
    has_news: bool,
) -> bool:
    """Whether an incremental answer includes this partition: it has records, an error or
    a divergence (``has_news``), or its high watermark or log start moved since the last
    answer that included it. Records the values answered when it does."""
    if (
        not has_news
        and high_watermark == entry.high_watermark
        and log_start_offset == entry.log_start_offset
    ):
        return False
    entry.high_watermark = high_watermark
    entry.log_start_offset = log_start_offset
    return True


class FetchSessionCache(Generic[P]):
    """The leader's sessions, least recently used first.

    Invariants: at most ``max_sessions`` sessions; at most one per replica id (a
    follower's new session replaces its old one: it has one fetcher per leader); session
    ids are positive and never reused while the cache lives.
    """

    def __init__(
        self,
        *,
        max_sessions: int = MAX_SESSIONS,
        idle_expiry_s: float = SESSION_IDLE_EXPIRY_S,
        max_partitions: int = 10_000,
    ) -> None:
        self._max_sessions = max_sessions
        self._idle_expiry_s = idle_expiry_s
        self._max_partitions = max_partitions
        self._sessions: OrderedDict[int, FetchSession[P]] = OrderedDict()
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[FetchSession[P]]:
        return list(self._sessions.values())

    def open(
        self, replica_id: int, positions: Iterable[tuple[Key, P]], now_s: float
    ) -> tuple[FetchSession[P], list[FetchSession[P]]]:
        """A new session holding ``positions``, expecting epoch 1 next; and the sessions
        it displaced (the replica's previous one, idle ones, the least recently used when
        full), whose watchers the caller removes."""
        displaced = [s for s in self._sessions.values() if s.replica_id == replica_id]
        displaced += [
            s
            for s in self._sessions.values()
            if s.replica_id != replica_id and now_s - s.last_used_s > self._idle_expiry_s
        ]
        for old in displaced:
            del self._sessions[old.session_id]
        while len(self._sessions) >= self._max_sessions:
            _, oldest = self._sessions.popitem(last=False)
            displaced.append(oldest)
        session: FetchSession[P] = FetchSession(
            session_id=self._next_id,
            replica_id=replica_id,
            next_epoch=INITIAL_EPOCH + 1,
            last_used_s=now_s,
        )
        self._next_id = self._next_id + 1 if self._next_id < _MAX_EPOCH else 1
        while self._next_id in self._sessions:
            self._next_id += 1
        session.update(positions, ())
        self._sessions[session.session_id] = session
        return session, displaced

    def expire(self, now_s: float) -> list[FetchSession[P]]:
        """Drop the sessions unused for ``idle_expiry_s`` (their followers stopped
        following this leader, or died); returns them for the caller's watchers."""
        idle = [s for s in self._sessions.values() if now_s - s.last_used_s > self._idle_expiry_s]
        for session in idle:
            del self._sessions[session.session_id]
        return idle

    def resume(self, session_id: int, epoch: int, replica_id: int, now_s: float) -> FetchSession[P]:
        """The session an incremental fetch names, its epoch checked and advanced."""
        session = self._sessions.get(session_id)
        if session is None or session.replica_id != replica_id:
            raise FetchSessionIdNotFoundError(
                f"no fetch session {session_id} of broker {replica_id} on this leader "
                "(evicted, or the leader restarted): fetch in full to open a new one"
            )
        if epoch != session.next_epoch:
            # The follower starts over in full: an answer may have been lost, and its
            # idea of the session is not the leader's. (The caller closes this one.)
            raise InvalidFetchSessionEpochError(
                f"fetch session {session_id} expected epoch {session.next_epoch}, got {epoch}"
            )
        session.next_epoch = epoch + 1 if epoch < _MAX_EPOCH else 1
        session.last_used_s = now_s
        self._sessions.move_to_end(session_id)
        return session

    def check_size(
        self,
        session: FetchSession[P],
        named: Iterable[Key],
        forgotten: Iterable[Key],
        *,
        max_partitions: int | None = None,
    ) -> None:
        """Refuse an incremental request (``FetchSession.update``'s ``named`` and
        ``forgotten`` keys) that would grow a session past the partitions one request may
        name (``max_partitions``, default the cache's). Counts what the session would hold
        after it: a partition named again only moves (most of an incremental fetch names
        partitions already held), one named for the first time joins, a forgotten one
        held leaves (before the named join)."""
        limit = self._max_partitions if max_partitions is None else max_partitions
        held = session.partitions
        leaving = {key for key in forgotten if key in held}
        joining = {key for key in named if key not in held or key in leaving}
        if len(held) - len(leaving) + len(joining) > limit:
            raise InvalidRequestError(
                f"fetch session {session.session_id} would hold more than {limit} partitions"
            )

    def close(self, session_id: int) -> FetchSession[P] | None:
        """Forget a session (FINAL_EPOCH, or its fetch failed); returns it if it was held."""
        return self._sessions.pop(session_id, None)


@dataclass(frozen=True, slots=True)
class FetchPlan(Generic[P]):
    """What the next fetch of a session says: ``session_id``/``epoch`` for the request,
    the keys to name (``send``) and ``forgotten``; ``positions`` are all the wanted ones,
    the session's state once the answer arrives."""

    session_id: int
    epoch: int
    send: list[Key]
    forgotten: list[Key]
    positions: dict[Key, P]

    @property
    def full(self) -> bool:
        return self.epoch == INITIAL_EPOCH


class FetchSessionHandler(Generic[P]):
    """The follower's side of one session (Kafka's ``FetchSessionHandler``).

    ``plan`` the next fetch from the positions wanted now; ``answered`` once its answer
    arrived; ``reset`` after any failure (the next fetch is full and opens a new
    session). Invariant: ``_sent`` is what the leader's session holds, as of the last
    answered fetch.
    """

    def __init__(self) -> None:
        self.session_id = 0
        self._next_epoch = INITIAL_EPOCH
        self._sent: dict[Key, P] = {}

    def plan(self, wanted: dict[Key, P]) -> FetchPlan[P]:
        if self.session_id == 0:
            return FetchPlan(0, INITIAL_EPOCH, list(wanted), [], dict(wanted))
        sent = self._sent
        send = [key for key, position in wanted.items() if sent.get(key) != position]
        forgotten = [key for key in sent if key not in wanted]
        return FetchPlan(self.session_id, self._next_epoch, send, forgotten, dict(wanted))

    def answered(self, plan: FetchPlan[P], session_id: int) -> None:
        """The leader answered ``plan``'s fetch, naming ``session_id`` (0: none)."""
        if plan.full:
            self.session_id = session_id
            self._next_epoch = INITIAL_EPOCH + 1
        else:
            self._next_epoch = plan.epoch + 1 if plan.epoch < _MAX_EPOCH else 1
        self._sent = plan.positions if self.session_id else {}

    def reset(self) -> None:
        self.session_id = 0
        self._next_epoch = INITIAL_EPOCH
        self._sent = {}


__all__ = [
    "FINAL_EPOCH",
    "INITIAL_EPOCH",
    "FetchPlan",
    "FetchSession",
    "FetchSessionCache",
    "FetchSessionHandler",
    "SessionPartition",
    "worth_answering",
]
