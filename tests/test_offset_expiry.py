"""Expiry of committed offsets (Kafka's offsets.retention.minutes): the pure rule, and
a real cluster whose controller expires them fast."""

from __future__ import annotations

import time
from pathlib import Path

import tidelog
from services.controller.offset_expiry import (
    OFFSETS_RETENTION_CHECK_INTERVAL_S,
    OFFSETS_RETENTION_MS,
    StoredOffset,
    decide_expiry,
)
from tests.support.cluster import GatewayProcess, TestCluster, wait_for

RETENTION_MS = 2_000


def offset(group: str, time_ms: int | None, key: str = "") -> StoredOffset:
    return StoredOffset(
        key=key or f"groups/{group}/t/0", group=group, commit_time_ms=time_ms, mod_revision=1
    )


def _fast_expiry(cluster: TestCluster) -> GatewayProcess:
    """One broker, a controller expiring offsets after RETENTION_MS (looking every
    0.3 s), a gateway."""
    cluster.start_broker(0)
    cluster.start_controller(
        1,
        extra_args=(
            "--offsets-retention-ms",
            str(RETENTION_MS),
            "--offsets-retention-check-interval-s",
            "0.3",
        ),
    )
    cluster.wait_brokers([0])
    return cluster.start_gateway()


def test_a_group_expires_whole_a_retention_after_it_emptied_and_last_committed() -> None:
    offsets = [
        offset("old", 1_000, "groups/old/t/0"),
        offset("old", 2_000, "groups/old/t/1"),
        offset("recent", 1_000, "groups/recent/t/0"),
        offset("recent", 9_500, "groups/recent/t/1"),  # one recent commit keeps all
        offset("active", 0),
        offset("legacy", None),  # written before commits carried a time
        offset("late-empty", 0),  # committed long ago, but had members until 9,000
        offset("new", 0),  # never seen without members before: marked, not expired
    ]
    marks = {"old": 1_500, "recent": 0, "legacy": 0, "late-empty": 9_000, "gone": 0, "active": 0}
    got = decide_expiry(offsets, {"active"}, marks, now_ms=10_000, retention_ms=8_000)
    assert sorted(got.expired) == ["old"]
    assert [o.key for o in got.expired["old"]] == ["groups/old/t/0", "groups/old/t/1"]
    assert got.to_mark == {"new"}
    assert got.stale_marks == {"gone", "active"}  # no offsets; members again
    assert decide_expiry(offsets, {"active"}, marks, 9_999, 8_000).expired == {}
    later = decide_expiry(offsets, set(), marks, now_ms=17_000, retention_ms=8_000)
    assert sorted(later.expired) == ["active", "late-empty", "old"]


def test_a_group_with_any_offset_of_unknown_age_is_kept_whole() -> None:
    """One offset written before commits carried a time keeps the whole group, even when
    its other offsets and its mark are long past the retention."""
    offsets = [
        offset("mixed", None, "groups/mixed/t/0"),
        offset("mixed", 1_000, "groups/mixed/t/1"),
    ]
    got = decide_expiry(offsets, set(), {"mixed": 0}, now_ms=1_000_000, retention_ms=8_000)
    assert got.expired == {}
    assert got.to_mark == set() and got.stale_marks == set()


def test_the_retention_defaults_are_kafkas() -> None:
    assert OFFSETS_RETENTION_MS == 10_080 * 60 * 1000  # offsets.retention.minutes=10080
    assert OFFSETS_RETENTION_CHECK_INTERVAL_S == 600.0  # ...check.interval.ms=600000


def test_the_controller_expires_memberless_groups_and_keeps_the_others(tmp_path: Path) -> None:
    cluster = TestCluster(tmp_path)
    try:
        gateway = _fast_expiry(cluster)
        admin = tidelog.Admin(gateway.address)
        admin.create_topic("kept", partitions=2)
        tp = ("kept", 0)
        # A standalone consumer that committed once: expires.
        with tidelog.Consumer(gateway.address, group_id="once") as once:
            once.assign([tp])
            once.commit({tp: 3})
        # A member of a live group that committed once, long enough ago: kept while the
        # group has members (the session key says so).
        member = tidelog.Consumer(
            gateway.address,
            group_id="alive",
            enable_auto_commit=False,
            session_timeout_ms=2_000,
            heartbeat_interval_ms=300,
        )
        member.subscribe(["kept"])
        wait_for(lambda: (member.poll(timeout_ms=100), member.assignment())[1] or None, 30, "join")
        member.commit({tp: 5})
        # A standalone consumer that keeps committing: kept.
        busy = tidelog.Consumer(gateway.address, group_id="busy")
        busy.assign([tp])
        deadline = time.monotonic() + 3 * RETENTION_MS / 1000
        while time.monotonic() < deadline:
            busy.commit({tp: 7})
            member.poll(timeout_ms=300)

        assert "once" not in admin.list_groups()
        assert admin.describe_group("once") == []
        assert member.committed([tp]) == {tp: 5}
        assert busy.committed([tp]) == {tp: 7}
        assert cluster.controllers[1].log_path.read_text().count("group_offsets_expired") >= 1

        member.close()  # the group is empty now: its offsets go a retention later
        # Not at the next pass, though its last commit is three retentions old (KIP-211:
        # from when the group emptied; the group audit found them gone at the next pass).
        # That pass marks when it saw the group empty; the offsets outlive it.
        wait_for(lambda: cluster.store.get("group-emptied/alive"), 30, "the empty mark")
        assert member_offsets(admin, "alive") == [(tp, 5)]
        wait_for(lambda: admin.describe_group("alive") == [] or None, 30, "alive's expiry")
        busy.close()
    finally:
        cluster.close()


def test_groups_whose_members_never_left_expire_once_their_sessions_ended(
    tmp_path: Path,
) -> None:
    """Static members do not leave (nor do killed ones): the group keeps a membership
    state nobody touches again. The third group audit found such groups' offsets kept
    for ever; the controller now counts members by live sessions and clears the stale
    state too."""
    cluster = TestCluster(tmp_path)
    try:
        gateway = _fast_expiry(cluster)
        admin = tidelog.Admin(gateway.address)
        admin.create_topic("statics", partitions=1)
        tp = ("statics", 0)
        member = tidelog.Consumer(
            gateway.address,
            group_id="static-group",
            group_instance_id="s1",
            session_timeout_ms=2_000,
            heartbeat_interval_ms=300,
        )
        member.subscribe(["statics"])
        wait_for(lambda: (member.poll(timeout_ms=100), member.assignment())[1] or None, 30, "join")
        member.commit({tp: 2})
        member.close()  # a static member: no LeaveGroup
        assert cluster.store.get("group-states/static-group") is not None
        wait_for(
            lambda: admin.describe_group("static-group") == [] or None,
            30,
            "the static group's offsets to expire",
        )
        assert cluster.store.get("group-states/static-group") is None
        assert "static-group" not in admin.list_groups()
    finally:
        cluster.close()


def member_offsets(admin: tidelog.Admin, group: str) -> list[tuple[tuple[str, int], int]]:
    return [((o.topic, o.partition), o.committed_offset) for o in admin.describe_group(group)]
