"""Replica assignment: which brokers hold each partition, and which of them leads by default.

Pure functions, no I/O. An assignment is a ``list[list[int]]`` whose index is the partition
id and whose first replica is the partition's *preferred leader*. Leaders, the broker order
and the rack rule are Kafka's ``AdminUtils.assignReplicasToBrokers`` (the ZooKeeper-era
placer that KRaft's ``StripedReplicaPlacer`` descends from); which brokers follow is ours.

What is Kafka's
===============

Brokers are arranged in a list ``A`` of ``n`` brokers:

- rack-unaware: the broker ids sorted;
- rack-aware: *rack-alternated*: racks sorted by name, brokers of a rack sorted by id, and
  the list takes one broker from each rack in turn (A1, B1, C1, A2, B2, C2, ...), skipping
  racks that have run out. With ``{0: r1, 1: r3, 2: r3, 3: r2, 4: r2, 5: r1}`` that is
  ``[0, 3, 1, 5, 4, 2]``.

Two numbers are drawn at random (``random.Random(seed)``): a *start index* ``s`` and a
*replica shift* ``h``, both in ``[0, n)``. For partition ``p``:

- the leader is ``A[(p + s) % n]``: round-robin over the list, so per-broker leader counts
  differ by at most one (by zero when ``n`` divides the partition count);
- the shift in force is ``h + p // n``, growing by one each time the partition id wraps
  around the list (Kafka's ``nextReplicaShift``), and the j-th *candidate* follower is
  ``A[(f + 1 + (shift' + j) % (n - 1)) % n]``, ``f`` the leader's index and ``shift'`` the
  shift (rack-unaware) or the shift times the number of racks (rack-aware). The offset is
  never 0, so a candidate is never the leader; the n - 1 candidates are the other brokers
  in an order that moves every round;
- the *rack rule* (rack-aware): a candidate is skipped while some rack holds no replica of
  the partition and the candidate's rack already does; a broker never appears twice.

Kafka takes followers in candidate order: the j-th follower is the j-th usable candidate.

What we changed, and why
========================

Kafka balances leaders and, per full round of ``n`` partitions, replicas; the last partial
round is not balanced: 4 brokers, 2 partitions, RF 2 can give ``[[0, 1], [1, 2]]``, i.e.
1, 2, 1, 0 replicas. Our requirement is stronger: per-broker replica counts differ by at
most one whenever the totals divide evenly, and by the minimum possible (one) otherwise.
So followers are chosen by load instead of by position. For each partition in order,
each follower is the usable candidate (Kafka's rack rule still says which are usable)
with the smallest key, compared in this order:

1. rack-aware only: the load of its rack (replicas per broker of the rack); then, with
   equal racks and ``RF <= #racks``, whether the rack is *reserved* - the rule below one
   level up, racks as the units;
2. the broker's replica count so far (``existing`` partitions included);
3. whether the broker is reserved as an upcoming leader (below); then, rack-aware with
   ``RF <= #racks``, whether it is its rack's next leader while its rack might not use up
   its least-loaded brokers before then (``_Load._in_rack_reserved``);
4. how often it already follows this leader, so that a broker's partitions get varied
   followers (when it fails, its leadership then spreads over many brokers - the reason
   Kafka shifts candidates every round);
5. Kafka's candidate order: the random shift still decides between equals.

*Reservation* is what makes "fewest replicas first" work. Think of the brokers holding the
fewest replicas as a level being filled, ``RF`` replicas per partition. Leaders are not
chosen, they are forced: if the leader of an upcoming partition were used as a follower
while its level still has other brokers left, it would lead from one replica above them
and end two above one of them. So the leaders of the next ``w`` partitions are kept out
while others are available, ``w`` being exactly how many more partitions the current level
feeds before it is used up (``_window``; the partition that uses it up may have any leader).

Simpler greedy rules fail. Ranking by *projected* load (replicas so far plus leaderships
still to come) ends 4 brokers, 6 partitions, RF 2 at spread 2 for some shifts, because at
the end the least-loaded broker is the one leading. And any rule that looks only at the
partitions of the current call cannot keep a topic growable: ``[[0, 1]]`` on 4 brokers is
balanced, but partition 1 is led by broker 1 and every follower leaves a spread of two.
Hence placement is online and every prefix is balanced.

Guarantees (``T = partitions * RF``, ``c_b`` the replicas on broker ``b``)
=========================================================================

- Every partition holds ``RF`` distinct brokers, and leaders differ by at most one.
- Rack-unaware: ``max(c) - min(c) <= 1`` after *every* prefix of partitions, which is
  exactly "equal when ``n`` divides ``T``, within one otherwise". Sketch: the counts are a
  level ``m`` of ``L`` brokers and the rest at ``m + 1``; the partition takes the brokers at
  ``m`` first, so the spread stays at most one unless the leader is at ``m + 1`` while
  ``L >= RF``. The partitions that start with at least ``RF`` brokers left at ``m`` are the
  next ``(L - RF) // RF`` ones (or, when this partition finishes the level, the
  corresponding ones of the next level), exactly the window reserved, and while the level
  lasts ``L - 1 - (L - RF) // RF >= RF - 1`` unreserved brokers remain for followers, so a
  reserved leader is still at ``m`` at its turn. Exhaustively checked too: every
  ``n <= 12``, RF and shift, every prefix of 300 partitions.
- Rack-aware: a partition covers ``min(RF, #racks)`` racks (distinct racks when
  ``#racks >= RF``, every rack otherwise): losing a rack loses at most one replica of each
  partition when there are ``RF`` racks. This rule comes before balance.
- Rack-aware with equal racks: replicas within one after every prefix, leaders within one
  (and within one per rack). Rack totals follow the argument above one level up and each
  rack fills its own brokers like a small cluster; we have no proof of the combination,
  but it is checked exhaustively for every equal-rack layout of up to 12 brokers, every RF,
  shift and start index, over every prefix of 200 partitions.
- Rack-aware with unequal racks only leaders and rack coverage are promised: with racks of
  1, 1 and 5 brokers and RF 3 both lone brokers are in every partition, so they hold
  ``partitions`` replicas each while the other five share ``partitions`` between them.

The price: the layout is no longer Kafka's, even over full rounds. Kafka's commonest
pattern, follower = next leader, is exactly what the reservation forbids at the start of a
level. Followers still vary with the shift and across rounds (key 4): over every layout of
up to 12 brokers, a broker's partitions have on average at least as many distinct
followers as under Kafka, but fewer where balance leaves no choice (4 brokers on 2 racks,
RF 2: each leader always gets the same follower).

Adding partitions
=================

``extend_assignment`` (Kafka's CreatePartitions) keeps the leaders' round-robin going: new
partitions are numbered from ``len(existing)``, the start index is partition 0's leader's
position in ``A``, and loads and pairs start from the existing partitions. Placement is
online - partition ``p`` depends only on partitions ``< p`` - so when the existing
assignment is one this scheme produced over the current brokers (same brokers, same racks)
and its shift is recovered, the grown topic is a longer prefix of the same sequence and
every guarantee above holds for the whole topic. The shift is recovered by replaying the
placement for each shift modulo ``n - 1`` and keeping the first that reproduces
``existing`` (on a short topic two shifts may agree; either continues it soundly).

Otherwise (brokers or racks changed, or the assignment was given by hand) the shift is
drawn from ``seed`` and the new followers go to the least-loaded brokers; in our property
tests the topic's spread then ends no larger than the largest of the existing spread, the
spread the new leaders alone would leave, and one (not proven). Nothing simpler holds:
``[[0, 2], [1, 2]]`` on brokers 0-2 has spread one, but the next partition is led by broker
2, already the fullest, and ends the spread at two whichever follower it gets. Kafka takes
the start index from the *sorted* broker list even in rack-aware mode; here it is taken
from ``A``, which is the list the leaders actually rotate over.

Cost
====

Placing ``P`` partitions on ``n`` brokers takes ``O(P * n * RF)`` time (each follower is a
minimum over at most ``n - 1`` candidates) and ``O(n**2)`` memory for the pair counts:
100,000 partitions on 12 brokers take about 1 s rack-unaware and 4 s rack-aware, which is
fine for a controller creating a topic. Extending replays the existing partitions once per
shift, each replay stopping at the first partition that differs. A topic has at most
``MAX_PARTITIONS_PER_TOPIC`` partitions; asking for more raises InvalidPartitionsError.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence

from tidelog.errors import (
    InvalidPartitionsError,
    InvalidReplicaAssignmentError,
    InvalidReplicationFactorError,
)

Assignment = list[list[int]]
RackMap = Mapping[int, str | None]

MAX_PARTITIONS_PER_TOPIC = 100_000
"""Partition ids of a topic stay below this; placing beyond it raises InvalidPartitionsError."""


# --- public API ----------------------------------------------------------------------------


def assign_replicas(
    broker_ids: Iterable[int],
    partitions: int,
    replication_factor: int,
    racks: RackMap | None = None,
    seed: int | None = None,
    *,
    start_partition: int = 0,
    existing: Sequence[Sequence[int]] | None = None,
) -> Assignment:
    """Place ``partitions`` partitions of ``replication_factor`` replicas on ``broker_ids``.

    Returns one replica list per partition, in partition order; element 0 of each is the
    preferred leader. ``racks`` maps broker id -> rack name (or ``None`` for "no rack") and
    must cover every broker; when any broker has a rack, every broker must have one, and
    placement is rack-aware. Ids in ``racks`` that are not in ``broker_ids`` are ignored.
    ``seed`` fixes the random start index and shift (``None``: fresh randomness each call).

    ``start_partition`` numbers the placed partitions from that id, which moves where the
    shift grows (Kafka's ``startPartitionId``). ``existing`` is the topic's current
    assignment: the placed partitions then continue it (see the module docstring), are
    numbered from ``len(existing)`` (``start_partition`` must be 0 or that number) and
    ``replication_factor`` must equal its replication factor.

    Raises InvalidPartitionsError, InvalidReplicationFactorError or
    InvalidReplicaAssignmentError, with a message saying what is wrong; nothing else.
    """
    _check_partitions(partitions)
    brokers = _check_brokers(broker_ids, replication_factor)
    rack_of = _check_racks(brokers, racks)
    arranged = _rack_alternated(rack_of) if rack_of is not None else brokers
    rng = random.Random(seed)
    if existing is None:
        if start_partition < 0:
            raise InvalidPartitionsError(f"start partition must be >= 0, got {start_partition}")
        first = start_partition
    else:
        first = len(existing)
        if start_partition not in (0, first):
            raise InvalidPartitionsError(
                f"new partitions continue an assignment of {first} partitions, so they are "
                f"numbered from {first}, not {start_partition}"
            )
    if first + partitions > MAX_PARTITIONS_PER_TOPIC:
        raise InvalidPartitionsError(
            f"a topic can have at most {MAX_PARTITIONS_PER_TOPIC} partitions; this would "
            f"make {first + partitions}"
        )
    if existing is None:
        # Both draws mirror Kafka's rand.nextInt(brokers) for startIndex and nextReplicaShift.
        start_index = rng.randrange(len(arranged))
        shift_base = rng.randrange(len(arranged))
    else:
        start_index, shift_base = _continuation(
            existing, arranged, rack_of, replication_factor, rng
        )
    placed = _place(
        arranged,
        rack_of,
        count=partitions,
        replication_factor=replication_factor,
        start_index=start_index,
        shift_base=shift_base,
        first_partition=first,
        existing=existing or (),
    )
    return list(placed)


def extend_assignment(
    existing: Sequence[Sequence[int]],
    broker_ids: Iterable[int],
    new_total: int,
    racks: RackMap | None = None,
    seed: int | None = None,
) -> Assignment:
    """Replica lists for the partitions ``len(existing) .. new_total - 1`` of a growing topic.

    Returns **only the new partitions' lists** (the caller appends them to ``existing``);
    the replication factor is that of ``existing[0]``. See the module docstring for how the
    pattern of ``existing`` is continued; ``seed`` only matters when the existing follower
    shift cannot be recovered (brokers or racks changed, or a hand-made assignment), and
    then draws it as for a new topic. Existing partitions are not validated against
    ``broker_ids``: they may name brokers that are gone; only new ones are placed.

    Raises InvalidPartitionsError when ``new_total`` does not grow the topic, and the errors
    of ``assign_replicas`` for bad brokers or racks (e.g. RF larger than the brokers left).
    """
    if not existing:
        raise InvalidPartitionsError("the topic has no partitions to extend")
    current = len(existing)
    if new_total <= current:
        raise InvalidPartitionsError(
            f"topic already has {current} partitions; partition counts can only grow "
            f"(asked for {new_total})"
        )
    return assign_replicas(
        broker_ids, new_total - current, len(existing[0]), racks, seed, existing=existing
    )


def validate_assignment(
    assignment: Sequence[Sequence[int]],
    broker_ids: Iterable[int],
    replication_factor: int,
) -> None:
    """Check an explicit assignment given by a user; raise InvalidReplicaAssignmentError.

    Every partition must list exactly ``replication_factor`` replicas, all distinct, all
    among ``broker_ids``. Returns None when the assignment is valid.
    """
    if replication_factor < 1:
        raise InvalidReplicationFactorError(
            f"replication factor must be at least 1, got {replication_factor}"
        )
    known = set(_unique_brokers(broker_ids))
    if not assignment:
        raise InvalidReplicaAssignmentError("the replica assignment lists no partitions")
    for partition, replicas in enumerate(assignment):
        if len(replicas) != replication_factor:
            raise InvalidReplicaAssignmentError(
                f"partition {partition} has {len(replicas)} replicas {list(replicas)}, but "
                f"the replication factor is {replication_factor}; every partition needs "
                f"the same number"
            )
        seen: set[int] = set()
        for broker in replicas:
            if broker in seen:
                raise InvalidReplicaAssignmentError(
                    f"partition {partition} lists broker {broker} twice in {list(replicas)}"
                )
            seen.add(broker)
            if broker not in known:
                raise InvalidReplicaAssignmentError(
                    f"partition {partition} names broker {broker}, which is not one of the "
                    f"known brokers {sorted(known)}"
                )


# --- placement -----------------------------------------------------------------------------


def _place(
    arranged: Sequence[int],
    rack_of: Mapping[int, str] | None,
    *,
    count: int,
    replication_factor: int,
    start_index: int,
    shift_base: int,
    first_partition: int,
    existing: Sequence[Sequence[int]] = (),
) -> Iterator[list[int]]:
    """Yield the replica lists of partitions ``first_partition .. first_partition+count-1``.

    ``arranged`` is the broker list the leaders rotate over (sorted, or rack-alternated when
    ``rack_of`` is given); the shift in force for partition ``p`` is
    ``shift_base + p // len(arranged)``. ``existing`` partitions count as already placed.
    Followers are chosen as the module docstring says.
    """
    n = len(arranged)
    load = _Load(arranged, rack_of, existing)
    for partition in range(first_partition, first_partition + count):
        leader_index = (partition + start_index) % n
        # upcoming[k]: the leader of partition ``partition + 1 + k``.
        upcoming = [arranged[(leader_index + k) % n] for k in range(1, n)]
        shift = (shift_base + partition // n) * load.num_racks
        candidates = [arranged[_follower_index(leader_index, shift, j, n)] for j in range(n - 1)]
        yield load.place(arranged[leader_index], candidates, upcoming, replication_factor)


class _Load:
    """What is placed so far: replicas per broker and per rack, leader-follower pairs."""

    def __init__(
        self,
        arranged: Sequence[int],
        rack_of: Mapping[int, str] | None,
        existing: Sequence[Sequence[int]],
    ) -> None:
        self.counts = dict.fromkeys(arranged, 0)
        self.pairs: Counter[tuple[int, int]] = Counter()
        for replicas in existing:
            for broker in replicas:
                if broker in self.counts:  # brokers that are gone no longer count
                    self.counts[broker] += 1
            for follower in replicas[1:]:
                self.pairs[replicas[0], follower] += 1
        self.racked = rack_of is not None
        self.rack_of: Mapping[int, str] = rack_of or {}
        sizes = Counter(self.rack_of[b] for b in arranged) if self.racked else Counter()
        self.num_racks = max(1, len(sizes))
        self.equal_racks = len(set(sizes.values())) <= 1
        # A rack's load is its replicas per broker, scaled to integers so that racks of
        # different sizes compare exactly; equal racks compare by their replica totals.
        common = math.lcm(*sizes.values()) if sizes else 1
        self.scale = {rack: common // size for rack, size in sizes.items()}
        self.touches = dict.fromkeys(sizes, 0)
        if self.racked:
            for broker, held in self.counts.items():
                self.touches[self.rack_of[broker]] += held

    def place(
        self,
        leader: int,
        candidates: Sequence[int],
        upcoming: Sequence[int],
        replication_factor: int,
    ) -> list[int]:
        """The replicas of one partition, recorded as placed.

        ``candidates`` are the other brokers in Kafka's order; ``upcoming[k]`` leads the
        partition ``k + 1`` after this one. The keys are those of the module docstring.
        """
        reserved = _reserve(upcoming, _window(self.counts.values(), replication_factor))
        if not self.racked:
            self._add(leader, leader)
            # A stable sort: among equal keys, Kafka's candidate order.
            ranked = sorted(
                candidates,
                key=lambda b: (self.counts[b], reserved.get(b, 0), self.pairs[leader, b]),
            )
            followers = ranked[: replication_factor - 1]
            for broker in followers:
                self._add(broker, leader)
            return [leader, *followers]
        one_per_rack = replication_factor <= self.num_racks
        rack_reserved = self._rack_reserved(upcoming, replication_factor) if one_per_rack else {}
        self._add(leader, leader)
        in_rack_reserved = self._in_rack_reserved(upcoming) if one_per_rack else {}
        replicas = [leader]
        covered = {self.rack_of[leader]}
        while len(replicas) < replication_factor:
            # Kafka's rack rule says who may be picked; the key, who is. Picking one at a
            # time lets the rack loads count this partition's earlier picks.
            _, pick = min(
                (
                    (
                        self._rack_load(b),
                        rack_reserved.get(self.rack_of[b], 0),
                        self.counts[b],
                        reserved.get(b, 0),
                        in_rack_reserved.get(b, 0),
                        self.pairs[leader, b],
                        j,
                    ),
                    b,
                )
                for j, b in enumerate(candidates)
                if b not in replicas
                and (len(covered) == self.num_racks or self.rack_of[b] not in covered)
            )
            replicas.append(pick)
            covered.add(self.rack_of[pick])
            self._add(pick, leader)
        return replicas

    def _add(self, broker: int, leader: int) -> None:
        self.counts[broker] += 1
        if self.racked:
            self.touches[self.rack_of[broker]] += 1
        if broker != leader:
            self.pairs[leader, broker] += 1

    def _rack_load(self, broker: int) -> int:
        rack = self.rack_of[broker]
        return self.touches[rack] * self.scale[rack]

    def _rack_reserved(self, upcoming: Sequence[int], replication_factor: int) -> dict[str, int]:
        """The reservation one level up, racks as the units (equal racks, RF <= #racks).

        Each partition then adds one replica to each of ``RF`` distinct racks, so rack totals
        fill like broker counts do, and the racks of the next leaders are kept the same way.
        """
        if not self.equal_racks:
            return {}
        window = min(_window(self.touches.values(), replication_factor), self.num_racks - 1)
        reserved: dict[str, int] = {}
        for k, broker in enumerate(upcoming[:window]):
            reserved.setdefault(self.rack_of[broker], window - k)
        return reserved

    def _in_rack_reserved(self, upcoming: Sequence[int]) -> dict[int, int]:
        """Each rack's next leader, while its rack may not run out of least-loaded brokers.

        Inside a rack (RF <= #racks: at most one replica per partition), the brokers with
        the rack's fewest replicas, ``lows`` of them, are used one per partition touching the
        rack; the rack's next leader must still be one of them when it leads, unless the
        partitions before its turn use up the whole level, which takes ``lows`` of them at
        the very least. It is kept when it leads at most ``lows`` partitions after this one
        (a margin of one partition over that bound, for partitions that skip the rack: what
        the exhaustive checks need) and its rack has another low broker to use instead.
        """
        fewest: dict[str, int] = {}
        for broker, held in self.counts.items():
            rack = self.rack_of[broker]
            fewest[rack] = min(fewest.get(rack, held), held)
        lows = Counter(
            self.rack_of[b] for b, held in self.counts.items() if held == fewest[self.rack_of[b]]
        )
        kept: dict[int, int] = {}
        seen: set[str] = set()
        for k, broker in enumerate(upcoming):
            rack = self.rack_of[broker]
            if rack in seen:
                continue
            seen.add(rack)
            if lows[rack] >= 2 and k <= lows[rack]:
                kept[broker] = len(upcoming) - k
        return kept


def _window(loads: Iterable[int], per_partition: int) -> int:
    """How many upcoming partitions must find their leader among the least loaded.

    The ``low`` least loaded brokers (or racks) are filled ``per_partition`` at a time.
    After this partition takes its share, ``rest`` of them are left (or, when it takes them
    all, the ones a level up), enough for ``rest // per_partition`` more partitions; each of
    those must find its leader still among the least loaded, or that leader ends two above
    one left behind.
    """
    values = list(loads)
    low_value = min(values)
    low = values.count(low_value)
    if low > per_partition:
        rest = low - per_partition
    else:
        rest = sum(1 for v in values if v <= low_value + 1) - (per_partition - low)
    return rest // per_partition


def _reserve(upcoming: Sequence[int], window: int) -> dict[int, int]:
    """The leaders of the next ``window`` partitions, the sooner the more urgent."""
    return {broker: window - k for k, broker in enumerate(upcoming[:window])}


def _follower_index(leader_index: int, shift: int, j: int, n: int) -> int:
    """Kafka's ``replicaIndex``: an offset in ``[1, n)`` from the leader, never 0."""
    return (leader_index + 1 + (shift + j) % (n - 1)) % n


def _rack_alternated(rack_of: Mapping[int, str]) -> list[int]:
    """Brokers ordered one per rack in turn: racks by name, brokers of a rack by id."""
    by_rack: dict[str, list[int]] = {}
    for broker in sorted(rack_of):
        by_rack.setdefault(rack_of[broker], []).append(broker)
    queues = [by_rack[rack] for rack in sorted(by_rack)]
    result: list[int] = []
    depth = 0
    while len(result) < len(rack_of):
        result.extend(queue[depth] for queue in queues if depth < len(queue))
        depth += 1
    return result


def _continuation(
    existing: Sequence[Sequence[int]],
    arranged: Sequence[int],
    rack_of: Mapping[int, str] | None,
    replication_factor: int,
    rng: random.Random,
) -> tuple[int, int]:
    """The (start index, shift base) that continues ``existing`` over ``arranged``."""
    if not existing or not existing[0]:
        raise InvalidReplicaAssignmentError(
            "the existing assignment is empty, so there is no pattern to continue"
        )
    if len(existing[0]) != replication_factor:
        raise InvalidReplicationFactorError(
            f"new partitions must have the topic's replication factor {len(existing[0])}, "
            f"not {replication_factor}"
        )
    n = len(arranged)
    leader = existing[0][0]
    if leader in arranged:
        start_index = arranged.index(leader)
    else:
        # Partition 0's leader is gone: like Kafka, start at the next higher broker id.
        higher = [broker for broker in sorted(arranged) if broker >= leader]
        start_index = arranged.index(higher[0]) if higher else 0
        return start_index, rng.randrange(n)
    # Only the shift modulo n - 1 matters (it enters every offset as "% (n - 1)"), so these
    # are all the distinct patterns with this start index.
    for shift_base in range(max(1, n - 1)):
        produced = _place(
            arranged,
            rack_of,
            count=len(existing),
            replication_factor=replication_factor,
            start_index=start_index,
            shift_base=shift_base,
            first_partition=0,
        )
        if all(mine == list(theirs) for mine, theirs in zip(produced, existing, strict=True)):
            return start_index, shift_base
    return start_index, rng.randrange(n)


# --- validation ----------------------------------------------------------------------------


def _check_partitions(partitions: int) -> None:
    if partitions < 1:
        raise InvalidPartitionsError(f"number of partitions must be at least 1, got {partitions}")


def _unique_brokers(broker_ids: Iterable[int]) -> list[int]:
    """The broker ids sorted; duplicates or negative ids raise InvalidReplicaAssignmentError."""
    brokers = sorted(broker_ids)
    for previous, current in itertools.pairwise(brokers):
        if previous == current:
            raise InvalidReplicaAssignmentError(f"broker id {current} is listed more than once")
    if brokers and brokers[0] < 0:
        raise InvalidReplicaAssignmentError(f"broker ids must be >= 0, got {brokers[0]}")
    return brokers


def _check_brokers(broker_ids: Iterable[int], replication_factor: int) -> list[int]:
    brokers = _unique_brokers(broker_ids)
    if replication_factor < 1:
        raise InvalidReplicationFactorError(
            f"replication factor must be at least 1, got {replication_factor}"
        )
    if not brokers:
        raise InvalidReplicationFactorError("no brokers are available to hold replicas")
    if replication_factor > len(brokers):
        raise InvalidReplicationFactorError(
            f"replication factor {replication_factor} is larger than the {len(brokers)} "
            f"available brokers"
        )
    return brokers


def _check_racks(brokers: Sequence[int], racks: RackMap | None) -> dict[int, str] | None:
    """The rack of every broker, or None for rack-unaware placement.

    A broker mapped to None has no rack; if no broker has one, placement is rack-unaware
    (as in Kafka). A broker missing from ``racks``, or a mix of brokers with and without a
    rack, is an error here: placing replicas on racks one cannot see defeats rack
    awareness. (The controller does not pass such a mix: it places rack-unaware then,
    with a warning, ``controller._racks``.)
    """
    if racks is None:
        return None
    absent = [broker for broker in brokers if broker not in racks]
    if absent:
        raise InvalidReplicaAssignmentError(
            f"brokers {absent} are missing from the rack map; give every broker a rack "
            f"(or None for no rack)"
        )
    with_rack = {broker: rack for broker in brokers if (rack := racks[broker]) is not None}
    if not with_rack:
        return None
    if len(with_rack) < len(brokers):
        missing = [broker for broker in brokers if broker not in with_rack]
        raise InvalidReplicaAssignmentError(
            f"brokers {missing} have no rack while others do; rack-aware assignment needs "
            f"a rack for every broker"
        )
    return with_rack
