"""Pure replication rules a replica applies around its ``Log``: truncation, divergence,
follower high watermark, and the acks=all durability rule.

Pure (DESIGN §7): plain functions of integers and a lookup callable; no locks, no I/O, no
clock. ``partition.py`` and ``fetcher.py`` call them under their locks with values read
from the Log; the deterministic simulation (``tests/sim``) calls the very same functions
with its in-memory logs, so what it checks is the product's rule, not a copy.

The lookup ``end_offset_for(epoch) -> (epoch, end_offset)`` is a replica's
OffsetForLeaderEpoch answer about its own log (``LeaderEpochCache.end_offset_for`` with
the log end filled in): ``(-1, -1)`` when it knows nothing about the epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

EndOffsetFor = Callable[[int], tuple[int, int]]
"""``epoch -> (largest known epoch <= epoch, its end offset)`` on this replica's log."""


class TruncationStep(NamedTuple):
    """Where a follower truncates its log, and whether reconciliation is finished.

    ``done`` False: the follower cut back to the end of an earlier epoch of its own and
    must ask the leader again about that epoch (KIP-279's iteration).
    """

    target: int
    done: bool


def follower_truncation(
    *,
    log_end_offset: int,
    high_watermark: int,
    leader_epoch: int,
    leader_end_offset: int,
    own_end_offset_for: EndOffsetFor,
) -> TruncationStep:
    """One KIP-101/KIP-279 reconciliation step of a follower with its leader's answer.

    The follower asked its leader about its own latest epoch and got ``(leader_epoch,
    leader_end_offset)`` (the largest epoch the leader knows at or below it, and where
    that epoch ends on the leader).

    - The leader knows no such epoch (``leader_end_offset < 0``: its log starts later):
      keep what is committed (Kafka's fallback), ``min(HW, LEO)``; done.
    - The follower has the leader's epoch too: the logs agree up to where that epoch
      ends on *both*: ``min(own end, leader end, LEO)``; done.
    - The follower lacks the leader's epoch but has an earlier one: cut back to the end
      of its largest epoch at or below it and ask again (not done).
    - The follower knows no epoch at or below it: the leader's end offset; done.

    Invariant: the target never exceeds ``log_end_offset`` (truncation never extends a
    log), and never goes below an offset both logs hold from the same epoch.
    """
    if leader_end_offset < 0:
        return TruncationStep(min(high_watermark, log_end_offset), True)
    own_epoch, own_end = own_end_offset_for(leader_epoch)
    if own_epoch == leader_epoch:
        return TruncationStep(min(own_end, leader_end_offset, log_end_offset), True)
    if own_end >= 0:
        return TruncationStep(min(own_end, log_end_offset), False)
    return TruncationStep(min(leader_end_offset, log_end_offset), True)


def fetch_divergence(
    *, last_fetched_epoch: int, fetch_offset: int, leader_end_offset_for: EndOffsetFor
) -> tuple[int, int] | None:
    """KIP-320, on the leader: ``(epoch, end offset)`` the follower must truncate to, or None.

    A follower names the epoch of its last fetched batch; when that epoch ends on the
    leader before ``fetch_offset`` (or the leader's largest epoch at or below it is a
    different one), the follower's log diverged from the leader's. An unknown end (-1:
    the epoch predates the leader's cache) proves nothing. A negative
    ``last_fetched_epoch`` (not sent) never diverges.
    """
    if last_fetched_epoch < 0:
        return None
    epoch, end_offset = leader_end_offset_for(last_fetched_epoch)
    if end_offset >= 0 and (epoch != last_fetched_epoch or end_offset < fetch_offset):
        return epoch, end_offset
    return None


def follower_high_watermark(current: int, leader_high_watermark: int, log_end_offset: int) -> int:
    """A follower's HW after a fetch: ``min(leader HW, own LEO)``, never moving backwards.

    The follower cannot call committed what it does not hold, and a leader's HW it has
    already learned stays learned (a new leader may report a lower HW for a while).
    """
    return max(current, min(leader_high_watermark, log_end_offset))


def clamp_high_watermark(high_watermark: int, log_end_offset: int) -> int:
    """A replica's HW after its log end moved down (truncation, role change): never above it."""
    return min(high_watermark, log_end_offset)


def leader_and_isr_supersedes(partition_epoch: int, known_partition_epoch: int) -> bool:
    """Whether a LeaderAndIsr at the leader's current leader epoch changes its ISR.

    Only a strictly newer partition epoch does. The controller resends a state it already
    pushed (retries until acknowledged, resyncs); applying that copy as "the ISR in force"
    would also forget a pending AlterPartition, and the leader would compute its HW over
    the old ISR while the controller may already have committed the proposed one: after
    an expansion, records would be acknowledged that an ISR member (electable at once)
    does not hold (found by tests/sim).
    """
    return partition_epoch > known_partition_epoch


def has_min_insync_replicas(isr_size: int, min_insync_replicas: int) -> bool:
    """Kafka's acks=all durability rule, used twice on the leader.

    Before the append: fewer in-sync replicas than ``min.insync.replicas`` refuses the
    request (NOT_ENOUGH_REPLICAS), so nothing is written. When the high watermark passes
    a waiting request: if the ISR has meanwhile shrunk below the minimum, the record is
    committed but *not* acknowledged (NOT_ENOUGH_REPLICAS_AFTER_APPEND): the HW may have
    moved precisely because replicas left the ISR, which is not the durability asked for.
    """
    return isr_size >= min_insync_replicas


def ack_is_due(high_watermark: int, required_offset: int) -> bool:
    """An acks=all append whose last offset is ``required_offset - 1`` is committed once
    the high watermark reaches ``required_offset`` (every ISR member holds it)."""
    return high_watermark >= required_offset


__all__ = [
    "EndOffsetFor",
    "TruncationStep",
    "ack_is_due",
    "clamp_high_watermark",
    "fetch_divergence",
    "follower_high_watermark",
    "follower_truncation",
    "has_min_insync_replicas",
    "leader_and_isr_supersedes",
]
