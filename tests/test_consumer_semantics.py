"""Consumer semantics against Kafka's, on a real one-broker cluster whose controller expires
committed offsets fast (2 s): each test here failed on the code an audit found it in."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import tidelog
from tests.support.cluster import GatewayProcess, TestCluster, wait_for
from tests.support.tcp_proxy import DelayProxy

RETENTION_MS = 2_000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    base: Path = tmp_path_factory.mktemp("audit-cons")
    with TestCluster(base) as c:
        c.start_broker(0)
        c.start_controller(
            1,
            extra_args=(
                "--offsets-retention-ms",
                str(RETENTION_MS),
                "--offsets-retention-check-interval-s",
                "0.3",
            ),
        )
        c.wait_brokers([0])
        yield c


@pytest.fixture(scope="module")
def gateway(cluster: TestCluster) -> GatewayProcess:
    return cluster.start_gateway()


def _topic(gateway: GatewayProcess, prefix: str, **config: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    tidelog.Admin(gateway.address).create_topic(
        name, partitions=1, replication_factor=1, config=config or None
    )
    return name


def test_idle_standalone_consumer_keeps_its_committed_offsets_alive(
    gateway: GatewayProcess,
) -> None:
    """Kafka's auto-commit commits every consumed position each interval, changed or not
    (ConsumerCoordinator.maybeAutoCommitOffsetsAsync -> allConsumed()). That is what keeps
    a running standalone (assign()) consumer's offsets from expiring under
    offsets.retention.minutes while its topic is idle (KIP-211: a group without members
    expires a retention after its last commit). Here only *changed* positions are
    auto-committed, so a live consumer's offsets expired; restarted, it reset
    (re-reading everything with "earliest"). Found by an audit."""
    topic = _topic(gateway, "audit-cons-idle")
    group = f"g-{uuid.uuid4().hex[:6]}"
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [b"a", b"b", b"c"], partition=0).result(30)
    consumer = tidelog.Consumer(
        gateway.address,
        group,
        auto_offset_reset="earliest",
        auto_commit_interval_ms=200,
    )
    try:
        consumer.assign([(topic, 0)])
        got: list[int] = []
        deadline = time.monotonic() + 20
        while len(got) < 3 and time.monotonic() < deadline:
            got += [r.offset for r in consumer.poll(timeout_ms=200)]
        assert got == [0, 1, 2]
        # Idle, but alive and polling, for a few retention periods.
        end = time.monotonic() + 3 * RETENTION_MS / 1000
        while time.monotonic() < end:
            assert consumer.poll(timeout_ms=200) == []
        assert consumer.committed([(topic, 0)]) == {(topic, 0): 3}
    finally:
        consumer.close()


def test_subscribing_again_to_the_same_topics_keeps_the_positions(
    gateway: GatewayProcess,
) -> None:
    """Kafka's subscribe() with the subscription it already has changes nothing: no
    revocation, no rejoin, the positions stay (ConsumerCoordinator rejoins only when the
    subscription changed). It revoked every partition and joined again, and the
    positions were taken afresh from the group's commits: without auto-commit, the
    records read since the last commit were handed out a second time (found by an
    audit)."""
    topic = _topic(gateway, "audit-cons-resub")
    group = f"g-{uuid.uuid4().hex[:6]}"
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [f"{i}".encode() for i in range(10)], partition=0).result(30)
    revoked: list[list[tuple[str, int]]] = []
    consumer = tidelog.Consumer(
        gateway.address, group, auto_offset_reset="earliest", enable_auto_commit=False
    )
    try:
        consumer.subscribe([topic], on_partitions_revoked=revoked.append)
        got: list[int] = []
        deadline = time.monotonic() + 30
        while len(got) < 4 and time.monotonic() < deadline:
            got += [r.offset for r in consumer.poll(max_records=4 - len(got), timeout_ms=500)]
        assert got == [0, 1, 2, 3]
        consumer.subscribe([topic], on_partitions_revoked=revoked.append)
        after: list[int] = []
        deadline = time.monotonic() + 30
        while not after and time.monotonic() < deadline:
            after += [r.offset for r in consumer.poll(max_records=1, timeout_ms=500)]
        assert after == [4], f"after subscribing again to the same topic: {after}"
        assert revoked == []
    finally:
        consumer.close()


def test_seek_to_beginning_and_end_are_lazy_and_per_partition(gateway: GatewayProcess) -> None:
    """Kafka's seekToBeginning/seekToEnd only mark the partitions: the offsets are looked
    up by the next poll or position(), each partition on its own. They were looked up
    at once, all together: with one assigned topic deleted, seek_to_beginning() with no
    argument raised, and nothing moved (found by an audit). A seek() after the mark wins;
    a committed offset does not."""
    kept, gone = _topic(gateway, "lazy-seek-kept"), _topic(gateway, "lazy-seek-gone")
    group = f"g-{uuid.uuid4().hex[:6]}"
    with tidelog.Producer(gateway.address) as producer:
        for topic in (kept, gone):
            producer.send_batch(topic, [b"%d" % i for i in range(10)], partition=0).result(30)
    with tidelog.Consumer(
        gateway.address, group, auto_offset_reset="latest", enable_auto_commit=False
    ) as consumer:
        consumer.assign([(kept, 0), (gone, 0)])
        consumer.commit({(kept, 0): 7, (gone, 0): 7})
        assert consumer.position((kept, 0)) == 7  # from the commit
        consumer.seek_to_beginning([(kept, 0)])
        assert consumer.position((kept, 0)) == 0  # not the commit
        consumer.seek_to_end()
        consumer.seek((kept, 0), 3)  # the later seek wins
        assert consumer.position((kept, 0)) == 3
        assert consumer.position((gone, 0)) == 10
        tidelog.Admin(gateway.address).delete_topic(gone)
        consumer.seek_to_beginning()  # marks; the deleted topic fails nothing here
        records: list[int] = []
        deadline = time.monotonic() + 30
        while len(records) < 10 and time.monotonic() < deadline:
            records += [r.offset for r in consumer.poll(timeout_ms=500) if r.topic == kept]
        assert records == list(range(10))


def test_iterating_a_closed_consumer_raises(gateway: GatewayProcess) -> None:
    """The module docstring: once closed, every call but close(), wakeup() and metrics()
    raises ConfigError (Kafka's IllegalStateException). ``for r in consumer`` on a closed
    consumer ended at once, silently, as if there were nothing to read (found by an
    audit)."""
    topic = _topic(gateway, "audit-cons-iterclosed")
    consumer = tidelog.Consumer(gateway.address, auto_offset_reset="earliest")
    consumer.assign([(topic, 0)])
    consumer.close()
    with pytest.raises(tidelog.errors.ConfigError, match="closed"):
        next(iter(consumer))


def test_a_group_consumer_with_short_polls_reads_through_a_300ms_round_trip(
    gateway: GatewayProcess,
) -> None:
    """Each poll asked for a new assignment's committed offsets within its own timeout
    (at least 200 ms) and dropped the call then: behind a longer round trip, a loop of
    poll(timeout_ms=100) never got positions and never read a record, though it joined
    (found by an audit). The ask now stays in flight across polls, as Kafka's
    pendingCommittedOffsetRequest."""
    topic = _topic(gateway, "far-away")
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [b"%d" % i for i in range(10)], partition=0).result(30)
    proxy = DelayProxy(gateway.address, 0.15)  # a 300 ms round trip
    try:
        with tidelog.Consumer(
            proxy.address, f"g-{uuid.uuid4().hex[:6]}", auto_offset_reset="earliest"
        ) as consumer:
            consumer.subscribe([topic])
            got: list[int] = []
            deadline = time.monotonic() + 20
            while not got and time.monotonic() < deadline:
                got += [r.offset for r in consumer.poll(timeout_ms=100)]
            assert got, f"20 s of poll(timeout_ms=100) read nothing ({consumer.assignment()})"
    finally:
        proxy.close()


def test_close_of_a_group_member_keeps_to_default_api_timeout_while_the_gateway_is_down(
    cluster: TestCluster,
) -> None:
    """close() of a group member with auto-commit tried its commit twice (before the
    revocation and again in it), each retrying for default_api_timeout_ms while the
    gateway was down: 2 minutes with the defaults, past a pod's grace period (found by
    an audit). Kafka's close bounds the whole close."""
    gateway = cluster.start_gateway()
    topic = _topic(gateway, "closing")
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [b"a", b"b", b"c"], partition=0).result(30)
    consumer = tidelog.Consumer(
        gateway.address,
        f"g-{uuid.uuid4().hex[:6]}",
        auto_offset_reset="earliest",
        default_api_timeout_ms=8_000,
        request_timeout_ms=1_000,
        session_timeout_ms=6_000,
        heartbeat_interval_ms=500,
    )
    try:
        consumer.subscribe([topic])
        got: list[int] = []
        deadline = time.monotonic() + 30
        while len(got) < 3 and time.monotonic() < deadline:
            got += [r.offset for r in consumer.poll(timeout_ms=500)]
        assert got == [0, 1, 2]
        cluster.kill(gateway)
        started = time.monotonic()
    finally:
        consumer.close()
    assert time.monotonic() - started < 12, "close() tried its auto-commit twice"


def test_a_group_member_polling_with_timeout_zero_joins_and_reads(
    gateway: GatewayProcess,
) -> None:
    """A poll(timeout_ms=0) loop (an event loop's) joins its group and reads: the join
    and the committed offsets' ask carry over from poll to poll (checked by an audit)."""
    topic = _topic(gateway, "zero-polls")
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [b"a", b"b"], partition=0).result(30)
    with tidelog.Consumer(
        gateway.address, f"g-{uuid.uuid4().hex[:6]}", auto_offset_reset="earliest"
    ) as consumer:
        consumer.subscribe([topic])
        got: list[bytes | None] = []
        deadline = time.monotonic() + 20
        while len(got) < 2 and time.monotonic() < deadline:
            got += [r.value for r in consumer.poll(timeout_ms=0)]
            time.sleep(0.01)
        assert got == [b"a", b"b"]


def test_a_stale_committed_offsets_answer_is_not_taken_by_a_later_membership(
    gateway: GatewayProcess,
) -> None:
    """The committed-offsets ask kept in flight across polls was keyed by partitions and
    generation number only; generation numbers restart when a group empties, so a later
    membership took its previous membership's answer, from before others committed, and
    read records below the group's commit again (found by an audit; Kafka keys it by the
    whole Generation, member id included)."""
    admin = tidelog.Admin(gateway.address)
    topic = f"gfp-{uuid.uuid4().hex[:6]}"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [b"%d" % i for i in range(20)], partition=0).result(30)
    group = f"g-{uuid.uuid4().hex[:6]}"
    proxy = DelayProxy(gateway.address, 0.15)  # a 300 ms round trip (another region)
    far = tidelog.Consumer(
        proxy.address, group_id=group, auto_offset_reset="earliest",
        enable_auto_commit=False, session_timeout_ms=2_000, heartbeat_interval_ms=300,
    )  # fmt: skip
    try:
        far.subscribe([topic])
        # Poll until the join completes: that poll asks for the committed offsets and,
        # behind the long round trip, ends before the answer (it stays in flight).
        deadline = time.monotonic() + 30
        while not far.assignment() and time.monotonic() < deadline:
            assert far.poll(timeout_ms=100) == []
        assert far.assignment() == [(topic, 0)]
        far.unsubscribe()  # leaves: the group is empty (its state key deleted)
        time.sleep(1.0)  # the ask is answered meanwhile: nothing committed then

        # Another consumer reads everything and commits it, then leaves.
        with tidelog.Consumer(
            gateway.address, group_id=group, auto_offset_reset="earliest",
            enable_auto_commit=False, session_timeout_ms=2_000, heartbeat_interval_ms=300,
        ) as near:  # fmt: skip
            near.subscribe([topic])
            got: list[int] = []
            wait_for(
                lambda: (
                    (got.extend(r.offset for r in near.poll(timeout_ms=200)), len(got) >= 20)[1]
                    or None
                ),
                30,
                "the other consumer reading all 20",
            )
            near.commit()
        assert admin.describe_group(group)[0].committed_offset == 20

        # The far consumer subscribes again: a new membership, generation 1 again.
        far.subscribe([topic])
        again: list[int] = []
        end = time.monotonic() + 6
        while time.monotonic() < end:
            again += [r.offset for r in far.poll(timeout_ms=200)]
        assert far.assignment() == [(topic, 0)]
        assert again == [], (
            f"re-read offsets {again[:5]}..{again[-1:]} below the group's commit at 20 "
            "(a stale committed-offsets answer from the previous membership)"
        )
    finally:
        far.close()
        proxy.close()


def test_a_stale_committed_offsets_answer_is_not_taken_after_a_reassign(
    gateway: GatewayProcess,
) -> None:
    """The same after assign([]) and assign again (generation -1 both times): the ask is
    dropped whenever the assignment changes (found by an audit)."""
    """The same for a consumer that assigns itself partitions (generation -1 always):
    asked in flight, the answer outlives a seek, a commit and a new assignment of the
    same partition, and sends the consumer back below its own commit."""
    admin = tidelog.Admin(gateway.address)
    topic = f"gfp-{uuid.uuid4().hex[:6]}"
    admin.create_topic(topic, partitions=1, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(topic, [b"%d" % i for i in range(20)], partition=0).result(30)
    group = f"g-{uuid.uuid4().hex[:6]}"
    proxy = DelayProxy(gateway.address, 0.15)
    far = tidelog.Consumer(
        proxy.address, group_id=group, auto_offset_reset="earliest", enable_auto_commit=False
    )
    try:
        far.assign([(topic, 0)])
        assert far.poll(timeout_ms=0) == []  # asks for the committed offset; not answered yet
        far.seek((topic, 0), 15)
        got: list[int] = []
        wait_for(
            lambda: (
                (got.extend(r.offset for r in far.poll(timeout_ms=200)), len(got) >= 5)[1] or None
            ),
            30,
            "reading 15..19",
        )
        assert got == [15, 16, 17, 18, 19]
        far.commit()
        assert far.committed([(topic, 0)]) == {(topic, 0): 20}
        far.assign([])
        far.assign([(topic, 0)])
        again: list[int] = []
        end = time.monotonic() + 4
        while time.monotonic() < end:
            again += [r.offset for r in far.poll(timeout_ms=200)]
        assert again == [], f"re-read {again[:3]}.. below its own commit at 20"
    finally:
        far.close()
        proxy.close()
