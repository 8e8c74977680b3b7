"""Which consumer groups' committed offsets have expired (Kafka's offsets.retention.minutes).

Committed offsets (``groups/<group>/<topic>/<p>``, docs/METADATA.md 1.7) would otherwise stay
in etcd for ever, one key per partition for every group ever used (a CLI ``consume
--group`` tried once leaves its offsets too). Kafka (KIP-211) expires a group's offsets
once the group has had no members for ``offsets.retention.minutes`` (7 days), and a
standalone consumer's (one that only stores offsets) that long after its last commit.
Here a group has members while any of its session keys lives (1.8: each member's key
is on a lease of its session timeout). When is "since it emptied"? Each expiry pass
marks a group it sees without members and without a mark (``group-emptied/<group>``,
holding the pass's time); the gateway deletes the mark when a group's last member leaves,
so the next pass marks that later time. A group expires when it has no members and both
its latest commit and its mark are older than the retention: all its offsets go
together. A group that commits without ever having members (a standalone consumer) is
marked by the first pass that sees it, so its offsets last at least a retention after
its last commit, as in Kafka. (Members that never left, static ones or killed ones,
count until their sessions end; the controller then also deletes the group's stale
membership state.) Offsets written before commits carried their time never expire.

Pure (DESIGN §7): the controller reads the keys and deletes, with compares that keep the
decision true (no member joined, no commit landed since the read).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
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


@dataclass(frozen=True, slots=True)
class ExpiryDecision:
    """One pass's decision. Groups are key parts (percent-encoded)."""

    expired: dict[str, list[StoredOffset]]  # groups whose offsets all go now
    to_mark: set[str]  # memberless groups with offsets and no mark: mark them now
    stale_marks: set[str]  # marks of groups with members again, or without offsets


def decide_expiry(
    offsets: Iterable[StoredOffset],
    groups_with_members: Set[str],
    emptied_at_ms: Mapping[str, int],
    now_ms: int,
    retention_ms: int,
) -> ExpiryDecision:
    """Which groups expire, which to mark as empty, which marks to drop (module
    docstring). ``emptied_at_ms``: the groups' marks."""
    by_group: dict[str, list[StoredOffset]] = {}
    for offset in offsets:
        by_group.setdefault(offset.group, []).append(offset)
    expired: dict[str, list[StoredOffset]] = {}
    to_mark: set[str] = set()
    for group, stored in by_group.items():
        if group in groups_with_members:
            continue
        emptied_ms = emptied_at_ms.get(group)
        if emptied_ms is None:
            to_mark.add(group)
            continue
        times = [o.commit_time_ms for o in stored]
        if any(t is None for t in times):
            continue  # some offset of unknown age: keep the group whole
        newest_ms = max(emptied_ms, *(t for t in times if t is not None))
        if newest_ms + retention_ms <= now_ms:
            expired[group] = stored
    stale = {g for g in emptied_at_ms if g in groups_with_members or g not in by_group}
    return ExpiryDecision(expired, to_mark, stale)
