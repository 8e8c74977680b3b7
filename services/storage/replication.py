"""Leader-side replication state of one partition: follower progress, HW and ISR decisions.

Pure (DESIGN §7): no threads, no RPC, no clock reads — every method takes ``now_ms``. The
partition layer feeds it appends and follower fetches, and acts on what it returns: a
moved high watermark completes waiting produce requests and fetches; an ISR proposal
becomes an AlterPartition request to the controller.

Rules (Kafka's ``Partition`` / ``Replica``, seeds 000 and 004):

- A follower's log end offset (LEO) is the offset it asks to fetch from: everything
  before it has been written to its log. A follower that pipelines its fetches
  (``fetcher.py``: it asks for the next range while appending the previous answer) says
  how far its log is written (``written_offset``), and that is what counts here.
- A follower's fetch session (KIP-227, ``fetch_session.py``) names a partition only when
  its position moves; the leader counts the session's fetches as reports of the
  unchanged position for the others (at most every 250 ms), so they feed this state as
  if every fetch named every partition.
- A follower is *caught up* at time t if at t it had fetched up to the leader's LEO as it
  was at its previous fetch (Kafka's ``lastCaughtUpTimeMs``); it falls out of sync once it
  has not been caught up for ``replica_lag_time_max_ms``. "Fetched up to" is the fetch
  offset, not the written offset: a pipelining follower's written offset is always one
  answer behind, so under steady load it never reached the leader's LEO of its previous
  fetch and was dropped from the ISR though it kept pace. Its lag stays bounded by one
  answer: it sends no further fetch until that answer is written.
- The high watermark is the smallest LEO over the ISR (leader included) and never moves
  backwards. While an ISR change is in flight the *maximal* ISR is used — the union of
  the current and the proposed ISR — so a pending shrink cannot advance the HW past a
  replica that may still be counted on, and a pending expansion already waits for the
  joining replica (Kafka KIP-497's "maximal ISR"). A proposal that failed still counts
  until the controller's next committed state: the failure may be a lost reply to an
  expansion the controller applied (an unreachable controller, a timeout), and
  acknowledging records a new ISR member lacks would let it be elected without them.
  A proposal the controller answered with an error was not applied and does not count.
- A follower may join the ISR only once its LEO reaches the HW *and* the start of the
  leader's current epoch, so a new member holds everything committed (KIP-101).
- The HW also waits for a *joiner*: a follower outside the ISR that is caught up (by
  fetches of its own since it was last out, within the lag limit) and fetched within
  ``JOINER_FETCH_WINDOW_MS`` (Kafka's ``shouldWaitForReplicaToJoinIsr``, which asks for
  a live broker instead). Under steady load the HW is the leader's LEO once the ISR is
  the leader alone, and a follower's LEO, one round behind, never reached it: a follower
  that returned could not rejoin until producers paused. Waiting for it lets its LEO
  reach the HW; it costs acks=all at most the window after a joiner stops fetching.
  Only inputs that carry a time (fetches, appends, ISR passes) move the state's clock,
  and joiners count once an ISR pass has told it the lag limit.

Invariants: ``log_start_offset <= high_watermark <= leader LEO``; the leader is always in
the ISR it proposes; at most one ISR proposal is pending at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

JOINER_FETCH_WINDOW_MS: Final = 2_000
"""A follower outside the ISR holds back the HW only if it fetched this recently: twice
the replica fetch long poll (500 ms) and more, so a live one always qualifies, and a
dead one stalls acks=all this long at most (instead of the whole lag limit)."""


@dataclass(slots=True)
class FollowerProgress:
    """What the leader knows about one follower."""

    broker_id: int
    log_end_offset: int = -1  # unknown until its first fetch
    # The registration epoch its fetches carry (-1: not known). ``log_end_offset`` speaks
    # for that incarnation only; an ISR join names it (KIP-841).
    broker_epoch: int = -1
    last_caught_up_ms: int = -1
    last_fetch_ms: int = -1
    leader_end_offset_at_last_fetch: int = -1

    def forget(self) -> None:
        """Drop what its fetches showed (it left the ISR, or was refused as a joiner).

        The fetch time and the leader's LEO at that fetch go too: with them, the first
        fetch of a follower that died and came back far behind counted as "caught up" at
        its previous life's last fetch, which made it a joiner holding back the HW at its
        log end for up to the lag limit.
        """
        self.log_end_offset = -1
        self.last_caught_up_ms = -1
        self.last_fetch_ms = -1
        self.leader_end_offset_at_last_fetch = -1


@dataclass(frozen=True, slots=True)
class IsrProposal:
    """An ISR change to send to the controller (AlterPartition)."""

    new_isr: tuple[int, ...]
    leader_epoch: int
    partition_epoch: int
    # (broker id, broker epoch) of each member joining: the incarnation that caught up.
    joining: tuple[tuple[int, int], ...] = ()


class LeaderReplicationState:
    """See the module docstring. Created when this broker becomes leader."""

    def __init__(
        self,
        *,
        local_broker_id: int,
        replicas: Iterable[int],
        isr: Iterable[int],
        leader_epoch: int,
        partition_epoch: int,
        high_watermark: int,
        log_end_offset: int,
        leader_epoch_start_offset: int,
        now_ms: int,
    ) -> None:
        self.local_broker_id = local_broker_id
        self.replicas = tuple(replicas)
        self.isr = tuple(isr)
        self.leader_epoch = leader_epoch
        self.partition_epoch = partition_epoch
        self._leader_end_offset = log_end_offset
        # A new leader never lowers the HW it inherited, but also never claims more than
        # it has: offsets it does not hold cannot be committed by it.
        self.high_watermark = min(high_watermark, log_end_offset)
        self.leader_epoch_start_offset = leader_epoch_start_offset
        self.pending: IsrProposal | None = None
        # Members of failed proposals whose outcome the controller has not confirmed: they
        # may be in its ISR, so the HW waits for them until a committed state says.
        self.unresolved: frozenset[int] = frozenset()
        # ISR followers start as caught up "now": a new leader gives them one full lag
        # window before it considers removing them; the others have to show it (Kafka
        # resets lastCaughtUpTime on election the same way).
        isr_members = set(self.isr)
        self.followers = {
            broker_id: FollowerProgress(
                broker_id, last_caught_up_ms=now_ms if broker_id in isr_members else -1
            )
            for broker_id in self.replicas
            if broker_id != local_broker_id
        }
        # The latest time an input carried, and the lag limit of the latest ISR pass
        # (None: none yet), for the joiner rule (module docstring).
        self._now_ms = now_ms
        self._lag_ms: int | None = None

    # --- inputs -------------------------------------------------------------------------

    @property
    def maximal_isr(self) -> tuple[int, ...]:
        """The ISR the HW is computed over: committed, pending and unresolved members."""
        if self.pending is None and not self.unresolved:
            return self.isr
        members = set(self.isr) | self.unresolved
        if self.pending is not None:
            members |= set(self.pending.new_isr)
        return tuple(sorted(members))

    def on_leader_append(self, log_end_offset: int, now_ms: int | None = None) -> bool:
        """The leader's log grew; returns True if the HW moved (RF 1 / ISR of one)."""
        self._leader_end_offset = log_end_offset
        self._tick(now_ms)
        return self._advance_high_watermark()

    def _tick(self, now_ms: int | None) -> None:
        if now_ms is not None and now_ms > self._now_ms:
            self._now_ms = now_ms

    def on_follower_fetch(
        self,
        broker_id: int,
        fetch_offset: int,
        now_ms: int,
        broker_epoch: int = -1,
        *,
        written_offset: int | None = None,
    ) -> bool:
        """A follower asked for ``fetch_offset``, its log written up to ``written_offset``
        (a pipelined fetch) or else up to ``fetch_offset``: its LEO, as of the incarnation
        ``broker_epoch``. Returns True if the HW moved."""
        progress = self.followers.get(broker_id)
        if progress is None:
            raise KeyError(f"broker {broker_id} is not a replica")
        if broker_epoch != progress.broker_epoch and min(broker_epoch, progress.broker_epoch) >= 0:
            # Another incarnation (it restarted): the old one's fetches say nothing of the
            # log this one has, which may be shorter (KIP-903); the controller takes it out
            # of the ISR for the same reason.
            progress.forget()
        progress.broker_epoch = broker_epoch
        if fetch_offset >= self._leader_end_offset:
            progress.last_caught_up_ms = now_ms
        elif fetch_offset >= progress.leader_end_offset_at_last_fetch >= 0:
            progress.last_caught_up_ms = max(progress.last_caught_up_ms, progress.last_fetch_ms)
        progress.log_end_offset = (
            fetch_offset if written_offset is None else min(fetch_offset, written_offset)
        )
        self._tick(now_ms)
        progress.last_fetch_ms = now_ms
        progress.leader_end_offset_at_last_fetch = self._leader_end_offset
        return self._advance_high_watermark()

    def _leo_of(self, broker_id: int) -> int:
        if broker_id == self.local_broker_id:
            return self._leader_end_offset
        return self.followers[broker_id].log_end_offset

    def joiners(self) -> list[int]:
        """Followers outside the ISR the HW waits for (module docstring)."""
        if self._lag_ms is None:
            return []
        members = set(self.maximal_isr)
        now_ms = self._now_ms
        return [
            b
            for b, p in sorted(self.followers.items())
            if b not in members
            and p.log_end_offset >= 0
            and p.last_caught_up_ms >= 0
            and now_ms - p.last_caught_up_ms <= self._lag_ms
            and now_ms - p.last_fetch_ms <= JOINER_FETCH_WINDOW_MS
        ]

    def _advance_high_watermark(self) -> bool:
        members = self.maximal_isr
        candidate = min(self._leo_of(b) for b in members)
        if len(members) <= len(self.followers):  # a follower is outside: maybe a joiner
            candidate = min((candidate, *(self._leo_of(b) for b in self.joiners())))
        if candidate > self.high_watermark:
            self.high_watermark = candidate
            return True
        return False

    # --- ISR decisions ------------------------------------------------------------------

    def out_of_sync(self, now_ms: int, replica_lag_time_max_ms: int) -> list[int]:
        """ISR followers that have not been caught up for the lag limit."""
        return [
            b
            for b in self.isr
            if b != self.local_broker_id
            and now_ms - self.followers[b].last_caught_up_ms > replica_lag_time_max_ms
        ]

    def ready_to_join(self) -> list[int]:
        """Followers outside the ISR that hold everything committed and this epoch's start."""
        if len(self.isr) == len(self.replicas):
            return []  # everyone is in (the usual case, asked four times a second)
        threshold = max(self.high_watermark, self.leader_epoch_start_offset)
        return [
            b
            for b, progress in sorted(self.followers.items())
            if b not in self.isr and progress.log_end_offset >= threshold
        ]

    def propose_isr_change(self, now_ms: int, replica_lag_time_max_ms: int) -> IsrProposal | None:
        """The next AlterPartition to send, or None (nothing to change, or one pending).

        Shrinks take precedence: a lagging member holds back the HW for everyone.
        """
        self._tick(now_ms)
        self._lag_ms = replica_lag_time_max_ms
        if self.pending is not None:
            return None
        shrink = set(self.out_of_sync(now_ms, replica_lag_time_max_ms))
        grow = set(self.ready_to_join())
        if not shrink and not grow:
            return None
        members = (set(self.isr) - shrink) if shrink else (set(self.isr) | grow)
        new_isr = tuple(b for b in self.replicas if b in members)
        joining = tuple((b, self.followers[b].broker_epoch) for b in new_isr if b not in self.isr)
        self.pending = IsrProposal(new_isr, self.leader_epoch, self.partition_epoch, joining)
        return self.pending

    def on_isr_committed(self, isr: Iterable[int], partition_epoch: int) -> bool:
        """The controller accepted (or reported) the ISR in force; returns True if HW moved.

        A follower that left the ISR has its log end forgotten: a dead one's frozen log
        end would otherwise keep it "ready to join", proposed again every pass, and a
        restarted one's would speak for a log it may no longer have (KIP-903). It is
        ready again once a fetch reports where its log ends, and a joiner the HW waits
        for once fetches of its own show it caught up: its caught-up time as a member
        would otherwise make a follower that died and came back far behind a joiner.
        """
        new_isr = tuple(isr)
        for broker_id in set(self.isr) - set(new_isr):
            if broker_id in self.followers:
                self.followers[broker_id].forget()
        self.isr = new_isr
        self.partition_epoch = partition_epoch
        self.pending = None
        self.unresolved = frozenset()  # the controller's word on who is in the ISR
        return self._advance_high_watermark()

    def on_isr_rejected(self) -> None:
        """No answer to the proposal (an unreachable controller, a timeout): retry later.

        Its joining members keep counting toward the HW (``unresolved``) until the next
        committed state: a lost reply looks like a failure, yet the controller may have
        applied the expansion (Kafka keeps such a proposal pending for the same reason).
        """
        if self.pending is not None:
            self.unresolved |= set(self.pending.new_isr) - set(self.isr)
        self.pending = None

    def on_isr_refused(self, committed_partition_epoch: int = -1) -> bool:
        """The controller answered the proposal with an error (a member not live, a stale
        epoch): it applied nothing, so the proposal is dropped without counting its
        members (as Kafka on INELIGIBLE_REPLICA). Counting them, as after a lost reply,
        froze the HW at a dead follower's log end until the controller spoke again.

        A refused joiner's log end is forgotten until it fetches again: the refusal may
        say it is down, or came back as another incarnation (KIP-841), and its old log
        end would have it proposed again every pass meanwhile.

        When the answer's state is at this leader's partition epoch, the controller's ISR
        is the one held here: the members of earlier proposals whose replies were lost
        (``unresolved``) are not in it, and no longer hold back the HW. (Left counted, a
        joiner that died meanwhile froze the HW for good: its registration gone, no ISR
        change was ever pushed to resolve it.) Returns True if the HW moved."""
        if self.pending is not None:
            for broker_id, _ in self.pending.joining:
                if broker_id in self.followers:
                    self.followers[broker_id].forget()
        self.pending = None
        if committed_partition_epoch == self.partition_epoch and self.unresolved:
            self.unresolved = frozenset()
            return self._advance_high_watermark()
        return False
