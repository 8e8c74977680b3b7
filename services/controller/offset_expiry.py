"""Which consumer groups' committed offsets have expired (Kafka's offsets.retention.minutes).

Committed offsets (``groups/<group>/<topic>/<p>``, docs/METADATA.md 1.7) would otherwise stay
in etcd for ever, one key per partition for every group ever used (a CLI ``consume
--group`` tried once leaves its offsets too). Kafka (KIP-211) expires a group's offsets
once the group has had no members for ``offsets.retention.minutes`` (7 days), and a
standalone consumer's (one that only stores offsets) that long after its last commit.
Here a group has members while any of its session keys lives (1.8: each member's key
is on a lease of its session timeout), and a group whose members leave commits its
positions as they go, so both rules come to one: a group without a live session whose
latest commit is older than the retention loses all its offsets together. (Members that
never left, static ones or killed ones, count until their sessions end; the controller
then also deletes the group's stale membership state.) Offsets written before commits
carried their time never expire.

Pure (DESIGN §7): the controller reads the keys and deletes, with compares that keep the
decision true (no member joined, no commit landed since the read).
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import dataclass
from typing import Final

OFFSETS_RETENTION_MS: Final = 7 * 24 * 3600 * 1000
"""Kafka's offsets.retention.minutes (10080)."""
OFFSETS_RETENTION_CHECK_INTERVAL_S: Final = 600.0
"""Kafka's offsets.retention.check.interval.ms (10 minutes)."""


@dataclass(frozen=True, slots=True)
class StoredOffset:
    """One committed offset's key, as read: its group's key part (percent-encoded), its
    commit time (None: written before commits carried one) and its revision."""

    key: str
    group: str
    commit_time_ms: int | None
    mod_revision: int


def expired_groups(
    offsets: Iterable[StoredOffset],
    groups_with_members: Set[str],
    now_ms: int,
    retention_ms: int,
) -> dict[str, list[StoredOffset]]:
    """Groups (key part) whose offsets all expire now, with those offsets."""
    by_group: dict[str, list[StoredOffset]] = {}
    for offset in offsets:
        by_group.setdefault(offset.group, []).append(offset)
    expired: dict[str, list[StoredOffset]] = {}
    for group, stored in by_group.items():
        if group in groups_with_members:
            continue
        times = [o.commit_time_ms for o in stored]
        if any(t is None for t in times):
            continue  # some offset of unknown age: keep the group whole
        if max(t for t in times if t is not None) + retention_ms <= now_ms:
            expired[group] = stored
    return expired
