"""Which logs on this broker belong to a topic incarnation that no longer exists.

A topic deleted while one of its replicas' brokers is down completes without that broker
(as in Kafka's KRaft mode): when the broker returns, its logs of the deleted topic are
"strays". Directories are named by topic name, so the topic id each log carries on disk
(``partition.metadata``) is what tells them apart from a topic created since under the
same name. Two moments reveal a stray, both for this broker *incarnation* (broker epoch):

* a LeaderAndIsr names the partition with another topic id: the controller built that
  request after it saw this incarnation register, so it names the topic as it was then or
  later, and the log on disk (created before this incarnation started) is of an earlier,
  deleted incarnation. Once a request of this incarnation has named the partition, the
  log is *confirmed*: a different id afterwards may come from an older request overtaken
  by a newer one (a retry), so it is refused (INCONSISTENT_TOPIC_ID), never obeyed, as
  Kafka's broker refuses such a LeaderAndIsr;
* an UpdateMetadata (the controller's complete view, built after the registration as
  well) gives the log's topic name no id or another id, and no request of this
  incarnation has named the log: its topic was deleted while the broker was away.

A log without an id (written before ``partition.metadata`` existed) cannot be judged: it
adopts the id the first LeaderAndIsr names (Kafka does the same for pre-KIP-516 logs) and
is never taken for a stray by the view.

Pure (DESIGN §7): functions of plain values; the replica manager calls them under its lock
and does the deleting.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Set

TopicPartitionKey = tuple[str, int]


class TopicIdVerdict(enum.Enum):
    """What a LeaderAndIsr naming ``named`` means for a hosted log whose id is ``on_disk``."""

    SAME = "same"  # the log is of the named incarnation (or the request names no id)
    ADOPT = "adopt"  # the log has no id yet (older code): it takes the named one
    STRAY = "stray"  # the log is of a deleted incarnation: delete it, create the new one
    REFUSE = "refuse"  # another id than this incarnation already confirmed: refuse


def leader_and_isr_verdict(*, on_disk: str, named: str, confirmed: bool) -> TopicIdVerdict:
    """See the module docstring; ``confirmed``: a request of this broker incarnation
    already named the partition."""
    if not named or on_disk == named:
        return TopicIdVerdict.SAME
    if not on_disk:
        return TopicIdVerdict.ADOPT
    if confirmed:
        return TopicIdVerdict.REFUSE
    return TopicIdVerdict.STRAY


def stop_replica_deletes(*, on_disk: str, named: str) -> bool:
    """Whether StopReplica(delete) of incarnation ``named`` deletes a log of ``on_disk``.

    Not when both are known and differ: the log is of a topic created since under the
    same name, and a deletion meant for the old one must never take its data.
    """
    return not named or not on_disk or on_disk == named


def strays_in_view(
    on_disk: Mapping[TopicPartitionKey, str],
    confirmed: Set[TopicPartitionKey],
    topic_ids: Mapping[str, str],
) -> list[TopicPartitionKey]:
    """The logs a complete cluster view (topic name -> id) shows to be strays: unconfirmed,
    with an id on disk, whose topic the view names with another id or not at all. A topic
    the view gives an empty id (created before topic ids existed) judges nothing."""
    return sorted(
        key
        for key, topic_id in on_disk.items()
        if topic_id and key not in confirmed and topic_ids.get(key[0], None) not in ("", topic_id)
    )
