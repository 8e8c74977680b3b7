"""Replica assignment: structure, balance, rack spread, determinism, extension, errors.

What is asserted (see the module docstring of ``services.controller.assignment``), with
``n`` brokers, ``P`` partitions, ``T = P * RF`` replicas and ``c_b`` the replicas on broker
``b``:

- always: every partition has ``RF`` distinct known brokers; leaders rotate round-robin,
  so leader counts differ by at most one;
- rack-unaware: ``max(c) - min(c) <= 1``, which is exactly "all equal when ``n`` divides
  ``T``, within one (the minimum possible) otherwise" - and it holds after every prefix of
  partitions, which is what lets a grown topic stay balanced;
- rack-aware: a partition covers ``min(RF, #racks)`` racks; with equal racks the replica
  bound above holds too; with unequal racks the rack rule wins and only leader balance is
  asserted (``test_unequal_racks_put_lone_brokers_in_every_partition`` shows why);
- extension: over existing + new partitions, leaders within one, and replicas within one
  when the existing partitions came from ``assign_replicas`` (rack-unaware, equal racks);
  for a hand-made existing assignment, the spread ends no larger than the largest of the
  existing spread, the spread the new leaders alone leave, and one (no better bound exists:
  ``test_extend_cannot_always_fix_a_hand_made_skew``).

``assignment_violations`` is the checker; the negative controls at the end prove it flags
skewed assignments, and ``kafka_place`` is Kafka's own layout, kept to show where ours
differs.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.controller.assignment import (
    MAX_PARTITIONS_PER_TOPIC,
    _follower_index,
    _place,
    _rack_alternated,
    assign_replicas,
    extend_assignment,
    validate_assignment,
)
from tidelog.errors import (
    InvalidPartitionsError,
    InvalidReplicaAssignmentError,
    InvalidReplicationFactorError,
)

PROPERTY_SETTINGS = settings(max_examples=300, deadline=None)


# --- the checker ---------------------------------------------------------------------------


def replica_counts(assignment: Sequence[Sequence[int]], brokers: Sequence[int]) -> list[int]:
    counts = Counter(b for replicas in assignment for b in replicas)
    return [counts.get(b, 0) for b in brokers]


def spread(assignment: Sequence[Sequence[int]], brokers: Sequence[int]) -> int:
    """Most replicas on a broker minus fewest."""
    values = replica_counts(assignment, brokers)
    return max(values) - min(values)


def _within_one(counts: Counter[int], brokers: Sequence[int], total: int) -> str | None:
    """None if every broker's count is floor or ceil of total / brokers, else a complaint."""
    q, r = divmod(total, len(brokers))
    values = {b: counts.get(b, 0) for b in brokers}
    bad = {b: c for b, c in values.items() if c not in (q, q + 1)}
    if bad or sum(1 for c in values.values() if c == q + 1) != r:
        return f"counts {values} are not all {q} or {q + 1}"
    return None


def assignment_violations(
    assignment: Sequence[Sequence[int]],
    brokers: Sequence[int],
    rf: int,
    *,
    racks: Mapping[int, str] | None = None,
    replica_balance: bool = True,
) -> list[str]:
    """Every broken invariant of ``assignment``, in words; empty when it is sound.

    Always: each partition has ``rf`` distinct known brokers, leaders within one, and with
    ``racks`` each partition covers ``min(rf, #racks)`` racks. With ``replica_balance``:
    per-broker replica counts within one of each other.
    """
    problems: list[str] = []
    known = set(brokers)
    for p, replicas in enumerate(assignment):
        if len(replicas) != rf:
            problems.append(f"partition {p} has {len(replicas)} replicas, expected {rf}")
        if len(set(replicas)) != len(replicas):
            problems.append(f"partition {p} repeats a broker: {list(replicas)}")
        if not set(replicas) <= known:
            problems.append(f"partition {p} names unknown brokers: {list(replicas)}")
        if racks is not None:
            want = min(rf, len(set(racks.values())))
            have = len({racks[b] for b in replicas})
            if have != want:
                problems.append(f"partition {p} covers {have} racks, expected {want}")
    leaders = Counter(replicas[0] for replicas in assignment if replicas)
    if (why := _within_one(leaders, brokers, len(assignment))) is not None:
        problems.append(f"leaders unbalanced: {why}")
    if replica_balance:
        counts = Counter(b for replicas in assignment for b in replicas)
        total = sum(len(replicas) for replicas in assignment)
        if (why := _within_one(counts, brokers, total)) is not None:
            problems.append(f"replica counts unbalanced: {why}")
    return problems


def assert_sound(assignment: Sequence[Sequence[int]], brokers: Sequence[int], rf: int, **kw):
    problems = assignment_violations(assignment, brokers, rf, **kw)
    assert not problems, "\n".join(problems)


def first_unbalanced_prefix(
    assignment: Sequence[Sequence[int]], brokers: Sequence[int], start: int = 1
) -> int | None:
    """The smallest prefix length ``>= start`` whose replica spread exceeds one, or None."""
    counts = dict.fromkeys(brokers, 0)
    for length, replicas in enumerate(assignment, start=1):
        for b in replicas:
            counts[b] += 1
        if length >= start and max(counts.values()) - min(counts.values()) > 1:
            return length
    return None


# --- Kafka's own layout, for comparison ----------------------------------------------------


def kafka_place(
    arranged: Sequence[int],
    racks: Mapping[int, str] | None,
    *,
    count: int,
    rf: int,
    start_index: int,
    shift_base: int,
) -> Iterator[list[int]]:
    """``AdminUtils.assignReplicasToBrokers``: followers are the first usable candidates."""
    n = len(arranged)
    num_racks = len(set(racks.values())) if racks is not None else 1
    for p in range(count):
        leader_index = (p + start_index) % n
        shift = (shift_base + p // n) * num_racks
        replicas = [arranged[leader_index]]
        j = 0
        while len(replicas) < rf:
            broker = arranged[_follower_index(leader_index, shift, j, n)]
            j += 1
            if racks is not None:
                used = {racks[b] for b in replicas}
                if racks[broker] in used and len(used) < num_racks:
                    continue
            if broker not in replicas:
                replicas.append(broker)
        yield replicas


# --- strategies ----------------------------------------------------------------------------


@st.composite
def clusters(draw: st.DrawFn, max_brokers: int = 12) -> tuple[list[int], int]:
    """Distinct broker ids in arbitrary order, and a replication factor that fits them."""
    n = draw(st.integers(1, max_brokers))
    brokers = draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n, unique=True))
    rf = draw(st.integers(1, n))
    return brokers, rf


@st.composite
def racked_clusters(draw: st.DrawFn) -> tuple[list[int], dict[int, str], int]:
    """Brokers on racks of arbitrary (possibly very unequal) sizes."""
    brokers, rf = draw(clusters())
    num_racks = draw(st.integers(1, len(brokers)))
    names = [f"rack-{chr(ord('a') + i)}" for i in range(num_racks)]
    racks = {b: draw(st.sampled_from(names)) for b in brokers}
    return brokers, racks, rf


@st.composite
def balanced_racked_clusters(draw: st.DrawFn) -> tuple[list[int], dict[int, str], int]:
    """``num_racks`` racks of ``per_rack`` brokers each, ids shuffled across racks."""
    num_racks = draw(st.integers(1, 6))
    per_rack = draw(st.integers(1, 12 // num_racks))
    n = num_racks * per_rack
    brokers = draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n, unique=True))
    labels = draw(st.permutations([i % num_racks for i in range(n)]))
    racks = {b: f"rack-{label}" for b, label in zip(brokers, labels, strict=True)}
    rf = draw(st.integers(1, n))
    return brokers, racks, rf


partition_counts = st.integers(1, 200)
seeds = st.integers(0, 2**32)


# --- rack-unaware --------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(clusters(), partition_counts, seeds)
def test_rack_unaware_is_balanced(cluster: tuple[list[int], int], partitions: int, seed: int):
    """Replicas within one of each other, equal when n divides T, after every prefix."""
    brokers, rf = cluster
    assignment = assign_replicas(brokers, partitions, rf, seed=seed)
    assert len(assignment) == partitions
    assert_sound(assignment, brokers, rf)
    assert first_unbalanced_prefix(assignment, brokers) is None
    values = replica_counts(assignment, brokers)
    assert max(values) - min(values) <= 1
    if partitions * rf % len(brokers) == 0:
        assert set(values) == {partitions * rf // len(brokers)}


@PROPERTY_SETTINGS
@given(clusters(), partition_counts, seeds)
def test_leaders_rotate_round_robin_over_sorted_brokers(
    cluster: tuple[list[int], int], partitions: int, seed: int
):
    brokers, rf = cluster
    ordered = sorted(brokers)
    leaders = [r[0] for r in assign_replicas(brokers, partitions, rf, seed=seed)]
    start = ordered.index(leaders[0])
    assert leaders == [ordered[(p + start) % len(ordered)] for p in range(partitions)]


def test_beats_kafka_on_four_brokers_two_partitions() -> None:
    """4 brokers, 2 partitions, RF 2: Kafka can give 1, 2, 1, 0 replicas; we give 1 each."""
    kafka = list(kafka_place([0, 1, 2, 3], None, count=2, rf=2, start_index=0, shift_base=0))
    assert kafka == [[0, 1], [1, 2]]
    assert replica_counts(kafka, [0, 1, 2, 3]) == [1, 2, 1, 0]
    assert assignment_violations(kafka, [0, 1, 2, 3], 2) == [
        "replica counts unbalanced: counts {0: 1, 1: 2, 2: 1, 3: 0} are not all 1 or 2"
    ]
    ours = list(
        _place(
            [0, 1, 2, 3],
            None,
            count=2,
            replication_factor=2,
            start_index=0,
            shift_base=0,
            first_partition=0,
        )
    )
    assert [r[0] for r in ours] == [0, 1]  # the same leaders
    assert replica_counts(ours, [0, 1, 2, 3]) == [1, 1, 1, 1]
    for seed in range(50):
        assert replica_counts(assign_replicas(range(4), 2, 2, seed=seed), range(4)) == [1] * 4


def test_balanced_wherever_kafka_is_not() -> None:
    """Every small case, every shift: ours is always within one, Kafka's often is not."""
    kafka_failures = 0
    for n in range(2, 8):
        brokers = list(range(n))
        for rf in range(1, n + 1):
            for partitions in range(1, 2 * n + 1):
                for shift_base in range(n - 1):
                    kafka = kafka_place(
                        brokers,
                        None,
                        count=partitions,
                        rf=rf,
                        start_index=0,
                        shift_base=shift_base,
                    )
                    kafka_failures += spread(list(kafka), brokers) > 1
                    ours = _place(
                        brokers,
                        None,
                        count=partitions,
                        replication_factor=rf,
                        start_index=0,
                        shift_base=shift_base,
                        first_partition=0,
                    )
                    assert spread(list(ours), brokers) <= 1, (n, rf, partitions, shift_base)
    assert kafka_failures > 100


@PROPERTY_SETTINGS
@given(st.integers(4, 12), st.data(), seeds)
def test_followers_vary_across_rounds(n: int, data: st.DataObject, seed: int):
    """Kafka shifts followers every round so that a broker's partitions have varied
    followers (when it fails, its leadership spreads); ours vary too, over four rounds."""
    rf = data.draw(st.integers(2, n - 2))  # RF = n - 1 leaves one possible follower set
    assignment = assign_replicas(range(n), 4 * n, rf, seed=seed)
    for leader in range(n):
        follower_sets = {frozenset(r[1:]) for r in assignment if r[0] == leader}
        assert len(follower_sets) > 1, (leader, assignment)


def test_shift_still_decides_between_equals() -> None:
    for n in range(3, 13):
        layouts = set()
        for shift_base in range(n - 1):
            placed = _place(
                list(range(n)),
                None,
                count=n,
                replication_factor=2,
                start_index=0,
                shift_base=shift_base,
                first_partition=0,
            )
            layouts.add(tuple(map(tuple, placed)))
        assert len(layouts) > 1, n


def test_seed_notes_two_brokers_sixteen_partitions() -> None:
    """seeds/001: ``kafka-topics --describe`` shows Replicas 1,0 / 0,1 / 1,0 / ..."""
    expected = [[1, 0] if p % 2 == 0 else [0, 1] for p in range(16)]
    assert assign_replicas([0, 1], 16, 2, seed=0) == expected
    for seed in range(50):
        assignment = assign_replicas([1, 0], 16, 2, seed=seed)
        assert assignment in (expected, [[b, a] for a, b in expected])


# --- rack-aware ----------------------------------------------------------------------------


def test_rack_alternated_list_and_kafka_example() -> None:
    """The worked example in Kafka's AdminUtils scaladoc, start index 0, shift 0."""
    racks = {0: "rack1", 1: "rack3", 2: "rack3", 3: "rack2", 4: "rack2", 5: "rack1"}
    arranged = _rack_alternated(racks)
    assert arranged == [0, 3, 1, 5, 4, 2]
    kafka = list(kafka_place(arranged, racks, count=7, rf=3, start_index=0, shift_base=0))
    assert kafka == [
        [0, 3, 1],
        [3, 1, 5],
        [1, 5, 4],
        [5, 4, 2],
        [4, 2, 0],
        [2, 0, 3],
        [0, 4, 2],  # second round: followers shifted instead of repeating 0, 3, 1
    ]
    ours = list(
        _place(
            arranged,
            racks,
            count=7,
            replication_factor=3,
            start_index=0,
            shift_base=0,
            first_partition=0,
        )
    )
    assert [r[0] for r in ours] == [r[0] for r in kafka]
    assert_sound(ours, arranged, 3, racks=racks)
    assert first_unbalanced_prefix(ours, arranged) is None
    assert first_unbalanced_prefix(kafka, arranged) == 2  # 0, 3, 1 then 3, 1, 5


@PROPERTY_SETTINGS
@given(racked_clusters(), partition_counts, seeds)
def test_rack_aware_covers_racks(
    cluster: tuple[list[int], dict[int, str], int], partitions: int, seed: int
):
    """Distinct racks when #racks >= RF, every rack otherwise; leaders within one.

    Replica balance is not asserted: with unequal racks the rack rule can make it
    impossible (see ``test_unequal_racks_put_lone_brokers_in_every_partition``).
    """
    brokers, racks, rf = cluster
    assignment = assign_replicas(brokers, partitions, rf, racks, seed)
    assert len(assignment) == partitions
    assert_sound(assignment, brokers, rf, racks=racks, replica_balance=False)
    if len(set(racks.values())) >= rf:
        for replicas in assignment:
            assert len({racks[b] for b in replicas}) == rf


@PROPERTY_SETTINGS
@given(balanced_racked_clusters(), partition_counts, seeds)
def test_rack_aware_with_equal_racks_is_balanced(
    cluster: tuple[list[int], dict[int, str], int], partitions: int, seed: int
):
    """Equal racks: replicas within one after every prefix; leaders spread over racks."""
    brokers, racks, rf = cluster
    assignment = assign_replicas(brokers, partitions, rf, racks, seed)
    assert_sound(assignment, brokers, rf, racks=racks)
    assert first_unbalanced_prefix(assignment, brokers) is None
    rack_names = sorted(set(racks.values()))
    leader_racks = Counter(racks[r[0]] for r in assignment)
    q, rem = divmod(partitions, len(rack_names))
    per_rack = [leader_racks.get(name, 0) for name in rack_names]
    assert all(c in (q, q + 1) for c in per_rack)
    assert per_rack.count(q + 1) == rem


def test_equal_racks_exhaustively() -> None:
    """Every equal-rack layout of up to 10 brokers, every RF and shift: two rounds.

    Start indexes ``s`` and ``s + #racks`` give the same layout up to renaming brokers within
    their racks (the rack-alternated list repeats the racks), so ``s < #racks`` covers all.
    """
    for n in range(2, 11):
        for num_racks in [k for k in range(2, n + 1) if n % k == 0]:
            racks = {b: f"r{b % num_racks}" for b in range(n)}
            arranged = _rack_alternated(racks)
            for rf in range(1, n + 1):
                for shift_base in range(n - 1):
                    for start_index in range(num_racks):
                        placed = list(
                            _place(
                                arranged,
                                racks,
                                count=2 * n + 1,
                                replication_factor=rf,
                                start_index=start_index,
                                shift_base=shift_base,
                                first_partition=0,
                            )
                        )
                        case = (n, num_racks, rf, shift_base, start_index)
                        assert first_unbalanced_prefix(placed, arranged) is None, case
                        assert not assignment_violations(
                            placed, arranged, rf, racks=racks, replica_balance=False
                        ), case


def test_unequal_racks_put_lone_brokers_in_every_partition() -> None:
    """The rack rule wins over replica balance, as documented.

    Racks of 1, 1 and 5 brokers with RF 3: every partition needs all three racks, so
    brokers 0 and 1 hold a replica of each of the 70 partitions while the five brokers of
    rack c share 70 replicas (14 each). No placement can balance that.
    """
    racks = {0: "a", 1: "b", 2: "c", 3: "c", 4: "c", 5: "c", 6: "c"}
    assignment = assign_replicas(list(racks), 70, 3, racks, seed=3)
    assert_sound(assignment, list(racks), 3, racks=racks, replica_balance=False)
    assert all(0 in r and 1 in r for r in assignment)
    assert replica_counts(assignment, list(racks)) == [70, 70, 14, 14, 14, 14, 14]
    assert assignment_violations(assignment, list(racks), 3, racks=racks)  # not balanced


def test_racks_all_none_means_rack_unaware() -> None:
    brokers = [3, 1, 2]
    no_racks: dict[int, str | None] = dict.fromkeys(brokers)
    assert assign_replicas(brokers, 10, 2, no_racks, seed=5) == assign_replicas(
        brokers, 10, 2, None, seed=5
    )


# --- determinism ---------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(racked_clusters(), partition_counts, seeds, st.booleans(), st.randoms())
def test_same_seed_same_assignment(
    cluster: tuple[list[int], dict[int, str], int],
    partitions: int,
    seed: int,
    use_racks: bool,
    shuffler: random.Random,
):
    brokers, racks, rf = cluster
    rack_map = racks if use_racks else None
    first = assign_replicas(brokers, partitions, rf, rack_map, seed)
    assert assign_replicas(brokers, partitions, rf, rack_map, seed) == first
    shuffled = list(brokers)
    shuffler.shuffle(shuffled)
    # Broker order in the input does not matter: the list is sorted (or rack-alternated).
    assert assign_replicas(shuffled, partitions, rf, rack_map, seed) == first


def test_seed_none_is_still_sound() -> None:
    brokers = list(range(5))
    assert_sound(assign_replicas(brokers, 23, 3), brokers, 3)


def test_different_seeds_vary_start() -> None:
    leaders = {assign_replicas(range(6), 1, 1, seed=s)[0][0] for s in range(100)}
    assert leaders == set(range(6))


# --- extension (CreatePartitions) ----------------------------------------------------------


@PROPERTY_SETTINGS
@given(clusters(), partition_counts, st.integers(1, 100), seeds, seeds)
def test_extend_rack_unaware_keeps_balance(
    cluster: tuple[list[int], int], before: int, added: int, seed: int, other_seed: int
):
    """Same brokers: the grown topic is balanced, and so is every prefix of it."""
    brokers, rf = cluster
    existing = assign_replicas(brokers, before, rf, seed=seed)
    new = extend_assignment(existing, brokers, before + added, seed=other_seed)
    assert len(new) == added
    union = existing + new
    assert_sound(union, brokers, rf)
    assert first_unbalanced_prefix(union, brokers) is None


@PROPERTY_SETTINGS
@given(clusters(), partition_counts, st.integers(1, 100), seeds)
def test_extend_continues_the_sequence(
    cluster: tuple[list[int], int], before: int, added: int, seed: int
):
    """Placement is online: a grown topic is a prefix of some fresh topic's sequence."""
    brokers, rf = cluster
    full = assign_replicas(brokers, before + added, rf, seed=seed)
    new = extend_assignment(full[:before], brokers, before + added, seed=seed + 1)
    union = full[:before] + new
    # The recovered shift may differ from the drawn one when both reproduce the existing
    # partitions; then the continuation differs too, but is still one of the sequences.
    start = sorted(brokers).index(full[0][0])

    def sequence(shift_base: int) -> Iterator[list[int]]:
        return _place(
            sorted(brokers),
            None,
            count=before + added,
            replication_factor=rf,
            start_index=start,
            shift_base=shift_base,
            first_partition=0,
        )

    assert any(
        all(mine == theirs for mine, theirs in zip(sequence(h), union, strict=True))
        for h in range(max(1, len(brokers) - 1))
    )


@PROPERTY_SETTINGS
@given(racked_clusters(), partition_counts, st.integers(1, 100), seeds)
def test_extend_rack_aware_keeps_properties(
    cluster: tuple[list[int], dict[int, str], int], before: int, added: int, seed: int
):
    brokers, racks, rf = cluster
    existing = assign_replicas(brokers, before, rf, racks, seed)
    union = existing + extend_assignment(existing, brokers, before + added, racks, seed)
    assert len(union) == before + added
    assert_sound(union, brokers, rf, racks=racks, replica_balance=False)


@PROPERTY_SETTINGS
@given(balanced_racked_clusters(), partition_counts, st.integers(1, 100), seeds)
def test_extend_equal_racks_keeps_balance(
    cluster: tuple[list[int], dict[int, str], int], before: int, added: int, seed: int
):
    brokers, racks, rf = cluster
    existing = assign_replicas(brokers, before, rf, racks, seed)
    union = existing + extend_assignment(existing, brokers, before + added, racks, seed)
    assert_sound(union, brokers, rf, racks=racks)
    assert first_unbalanced_prefix(union, brokers) is None


@PROPERTY_SETTINGS
@given(clusters(), partition_counts, st.integers(1, 100), seeds, st.booleans())
def test_extend_foreign_assignment(
    cluster: tuple[list[int], int], before: int, added: int, seed: int, skewed: bool
):
    """Followers placed by hand: the leader rotation continues and imbalance shrinks.

    The spread ends no larger than the largest of: the existing spread, the spread the new
    leaders alone would leave (they are forced), and one.
    """
    brokers, rf = cluster
    ordered = sorted(brokers)
    rng = random.Random(seed)
    start = rng.randrange(len(ordered))
    existing = []
    for p in range(before):
        leader = ordered[(p + start) % len(ordered)]
        others = [b for b in ordered if b != leader]
        # Skewed: always the same few followers, so the existing spread is large.
        followers = others[: rf - 1] if skewed else rng.sample(others, rf - 1)
        existing.append([leader, *followers])
    new = extend_assignment(existing, brokers, before + added, seed=seed)
    union = existing + new
    leaders = Counter(r[0] for r in union)
    assert max(leaders.values()) - min(leaders.get(b, 0) for b in brokers) <= 1
    for replicas in new:
        assert len(replicas) == rf and len(set(replicas)) == rf
    leaders_only = existing + [[r[0]] for r in new]
    assert spread(union, brokers) <= max(
        spread(existing, brokers), spread(leaders_only, brokers), 1
    )


def test_extend_cannot_always_fix_a_hand_made_skew() -> None:
    """Why the bound above is not simply max(existing spread, 1).

    ``[[0, 2], [1, 2]]`` has spread 1 (1, 1, 2). Partition 2 is led by broker 2, already the
    fullest: whichever follower it gets, the counts are 2, 1, 3 or 1, 2, 3.
    """
    existing = [[0, 2], [1, 2]]
    new = extend_assignment(existing, [0, 1, 2], 3, seed=0)
    assert new[0][0] == 2
    assert spread(existing + new, [0, 1, 2]) == 2
    for follower in (0, 1):
        assert spread([*existing, [2, follower]], [0, 1, 2]) == 2


def test_extend_after_adding_brokers() -> None:
    """Partition 0's leader keeps its place; new brokers join the rotation."""
    existing = assign_replicas([0, 1, 2], 6, 2, seed=1)
    new = extend_assignment(existing, [0, 1, 2, 3, 4], 11, seed=1)
    assert len(new) == 5
    assert {r[0] for r in new} == {0, 1, 2, 3, 4}
    validate_assignment(new, [0, 1, 2, 3, 4], 2)
    # New brokers start empty, so every new follower goes to them: 0-2 only gain their one
    # leadership each. That is the best possible (0-2 hold at least 5, 3-4 share the rest).
    assert replica_counts(existing + new, [0, 1, 2, 3, 4]) == [5, 5, 5, 3, 4]


def test_extend_when_partition_zero_leader_is_gone() -> None:
    existing = [[2, 0], [0, 1], [1, 2]]
    new = extend_assignment(existing, [0, 1, 3], 6, seed=4)
    assert [r[0] for r in new] == [3, 0, 1]  # next id above 2 is 3, then round-robin
    validate_assignment(new, [0, 1, 3], 2)


def test_extend_via_assign_replicas_existing() -> None:
    existing = assign_replicas([0, 1, 2], 4, 3, seed=9)
    assert assign_replicas([0, 1, 2], 2, 3, existing=existing) == extend_assignment(
        existing, [0, 1, 2], 6
    )
    assert (
        assign_replicas([0, 1, 2], 2, 3, existing=existing, start_partition=4)
        == (assign_replicas([0, 1, 2], 6, 3, seed=9)[4:])
    )
    with pytest.raises(InvalidPartitionsError, match="numbered from 4"):
        assign_replicas([0, 1, 2], 2, 3, existing=existing, start_partition=2)
    with pytest.raises(InvalidReplicationFactorError, match="replication factor 3"):
        assign_replicas([0, 1, 2], 2, 2, existing=existing)


def test_extend_must_grow() -> None:
    existing = assign_replicas([0, 1, 2], 4, 2, seed=1)
    for total in (4, 3, 0):
        with pytest.raises(InvalidPartitionsError) as err:
            extend_assignment(existing, [0, 1, 2], total)
        assert "topic already has 4 partitions; partition counts can only grow" in str(err.value)
    with pytest.raises(InvalidPartitionsError, match="no partitions"):
        extend_assignment([], [0, 1, 2], 3)
    with pytest.raises(InvalidReplicationFactorError, match="2 is larger than the 1 available"):
        extend_assignment(existing, [0], 6)


# --- bad input -----------------------------------------------------------------------------


def test_bad_input_raises_the_right_errors() -> None:
    with pytest.raises(InvalidReplicationFactorError) as rf_err:
        assign_replicas([0, 1, 2], 3, 4)
    assert "replication factor 4 is larger than the 3 available brokers" in str(rf_err.value)
    with pytest.raises(InvalidReplicationFactorError, match="at least 1"):
        assign_replicas([0, 1, 2], 3, 0)
    with pytest.raises(InvalidReplicationFactorError, match="no brokers"):
        assign_replicas([], 3, 1)
    with pytest.raises(InvalidPartitionsError, match="at least 1, got 0"):
        assign_replicas([0, 1, 2], 0, 1)
    with pytest.raises(InvalidPartitionsError):
        assign_replicas([0, 1, 2], -5, 1)
    with pytest.raises(InvalidReplicaAssignmentError, match="broker id 1 is listed more"):
        assign_replicas([0, 1, 1, 2], 3, 2)
    with pytest.raises(InvalidReplicaAssignmentError, match=">= 0"):
        assign_replicas([-1, 0], 3, 2)
    with pytest.raises(InvalidReplicaAssignmentError, match=r"brokers \[2\] are missing"):
        assign_replicas([0, 1, 2], 3, 2, {0: "a", 1: "b"})
    with pytest.raises(InvalidReplicaAssignmentError, match=r"brokers \[1\] have no rack"):
        assign_replicas([0, 1, 2], 3, 2, {0: "a", 1: None, 2: "b"})
    with pytest.raises(InvalidPartitionsError, match="start partition"):
        assign_replicas([0, 1], 3, 2, start_partition=-1)
    # Extra entries in the rack map (brokers not taking part) are ignored.
    assert len(assign_replicas([0, 1], 3, 2, {0: "a", 1: "b", 9: "c"}, seed=1)) == 3


def test_partition_limit() -> None:
    limit = MAX_PARTITIONS_PER_TOPIC
    assert limit == 100_000
    message = f"at most {limit} partitions; this would make {limit + 1}"
    with pytest.raises(InvalidPartitionsError, match=message):
        assign_replicas([0, 1, 2], limit + 1, 1)
    with pytest.raises(InvalidPartitionsError, match=message):
        assign_replicas([0, 1, 2], 2, 1, start_partition=limit - 1)
    assert len(assign_replicas([0, 1, 2], 1, 1, start_partition=limit - 1, seed=0)) == 1
    existing = assign_replicas([0, 1, 2], 3, 2, seed=0)
    with pytest.raises(InvalidPartitionsError, match=message):
        extend_assignment(existing, [0, 1, 2], limit + 1)


def test_errors_carry_stable_codes() -> None:
    try:
        assign_replicas([0], 1, 2)
    except InvalidReplicationFactorError as err:
        assert err.code.name == "INVALID_REPLICATION_FACTOR"
        assert not err.retriable
    else:
        pytest.fail("expected InvalidReplicationFactorError")


def test_validate_assignment() -> None:
    brokers = [0, 1, 2, 3]
    validate_assignment([[0, 1], [1, 2], [3, 0]], brokers, 2)
    with pytest.raises(InvalidReplicaAssignmentError, match="partition 1 has 3 replicas"):
        validate_assignment([[0, 1], [1, 2, 3]], brokers, 2)
    with pytest.raises(InvalidReplicaAssignmentError, match="partition 0 has 1 replicas"):
        validate_assignment([[0], [1, 2]], brokers, 2)
    with pytest.raises(InvalidReplicaAssignmentError, match="broker 2 twice"):
        validate_assignment([[0, 1], [2, 2]], brokers, 2)
    with pytest.raises(InvalidReplicaAssignmentError, match="broker 7, which is not one"):
        validate_assignment([[0, 7]], brokers, 2)
    with pytest.raises(InvalidReplicaAssignmentError, match="no partitions"):
        validate_assignment([], brokers, 2)
    with pytest.raises(InvalidReplicationFactorError):
        validate_assignment([[]], brokers, 0)
    with pytest.raises(InvalidReplicaAssignmentError, match="listed more than once"):
        validate_assignment([[0, 1]], [0, 1, 1], 2)


@PROPERTY_SETTINGS
@given(racked_clusters(), partition_counts, seeds)
def test_generated_assignments_validate(
    cluster: tuple[list[int], dict[int, str], int], partitions: int, seed: int
):
    brokers, racks, rf = cluster
    validate_assignment(assign_replicas(brokers, partitions, rf, racks, seed), brokers, rf)


# --- negative controls: the checker can fail -----------------------------------------------


def test_checker_flags_skewed_leaders() -> None:
    skewed = [[0, 1], [0, 2], [0, 1], [1, 2], [2, 0], [0, 2]]
    problems = assignment_violations(skewed, [0, 1, 2], 2)
    assert any(p.startswith("leaders unbalanced") for p in problems)


def test_checker_flags_skewed_replicas_with_balanced_leaders() -> None:
    skewed = [[0, 1], [1, 0], [2, 0], [3, 0]]  # leaders 1 each; broker 0 in every partition
    problems = assignment_violations(skewed, [0, 1, 2, 3], 2)
    assert not any(p.startswith("leaders") for p in problems)
    assert any(p.startswith("replica counts unbalanced") for p in problems)


def test_checker_flags_structure_and_racks() -> None:
    problems = assignment_violations([[0, 0], [1], [5, 2]], [0, 1, 2], 2, replica_balance=False)
    assert any("repeats" in p for p in problems)
    assert any("has 1 replicas" in p for p in problems)
    assert any("unknown" in p for p in problems)
    racks = {0: "a", 1: "a", 2: "b"}
    problems = assignment_violations([[0, 1], [2, 0], [1, 2]], [0, 1, 2], 2, racks=racks)
    assert problems == ["partition 0 covers 1 racks, expected 2"]


def test_prefix_checker_flags_a_skewed_middle() -> None:
    """Balanced at the end, not along the way: after two partitions broker 0 holds 2, 3 none."""
    assignment = [[0, 1], [2, 0], [1, 3], [3, 2]]
    assert spread(assignment, [0, 1, 2, 3]) == 0
    assert first_unbalanced_prefix(assignment, [0, 1, 2, 3]) == 2


def test_checker_accepts_our_output() -> None:
    """The control's other half: the real algorithm passes the same checker."""
    assert not assignment_violations(assign_replicas(range(4), 10, 3, seed=2), range(4), 3)
