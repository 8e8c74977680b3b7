"""The gateway's view of the cluster: brokers, topics, partition leaders, the controller.

``MetadataView`` is the pure part: a snapshot built from etcd key-values and changed by
watch events, with no I/O. ``MetadataCache`` keeps one up to date: it reads the four
prefixes that routing needs (``brokers/``, ``topics/``, ``partitions/``, ``controller``)
and watches each from the revision it read, so every change the controller commits
reaches the gateway in order, without polling. Consumer-group keys are deliberately not
watched: commits are frequent and routing never needs them.

Staleness is safe, not just tolerated: every request the gateway routes carries the
leader epoch it believes current, and a storage node refuses a stale one
(FENCED_LEADER_EPOCH) or a mis-routed one (NOT_LEADER_OR_FOLLOWER). The router then waits
for the view to change (``wait_for_change``) and tries again.

When a watch fails (etcd restarted, history compacted) the cache reloads everything and
watches again from the new revision, retrying with a backoff until etcd answers; the last
view keeps serving meanwhile.

Admin calls wait for their change to reach the view by etcd revision, not by content: the
view keeps each topic key's create and mod revisions, and ``MetadataCache.read_topic_keys``
tells where etcd's keys stood once the controller answered. A view at that revision or past
it shows the change (or a later one); waiting for the exact state the call made instead
never ended when another change of the topic came right after.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple, TypeVar

from services.cluster_metadata import (
    BROKERS_PREFIX,
    CLUSTER_ID_KEY,
    CONTROLLER_KEY,
    DELETIONS_PREFIX,
    PARTITIONS_PREFIX,
    TOPICS_PREFIX,
    ControllerInfo,
    decode_broker,
    decode_cluster_id,
    decode_controller,
    decode_partition,
    decode_topic,
    topic_key,
)
from services.controller.state import Broker, PartitionRecord, Topic
from services.metastore import (
    GetOp,
    GetResult,
    KeyValue,
    MetaStore,
    MetaStoreError,
    MetaStoreUnavailableError,
    WatchEvent,
)
from tidelog.errors import (
    LeaderNotAvailableError,
    UnknownTopicOrPartitionError,
)
from tidelog.logging import get_logger
from tidelog.topics import validate_topic_name

_log = get_logger(component="gateway.metadata")

WATCHED_PREFIXES: Final = (
    BROKERS_PREFIX,
    TOPICS_PREFIX,
    PARTITIONS_PREFIX,
    CONTROLLER_KEY,
    # Written once by the first controller, possibly after this gateway started.
    CLUSTER_ID_KEY,
)
_T = TypeVar("_T")

RELOAD_BACKOFF_S: Final = (0.05, 0.1, 0.2, 0.5, 1.0)
"""Waits between attempts to reload after a watch failed; the last one repeats."""
TOPIC_KEYS_PER_READ: Final = 100
"""Topic keys read in one transaction by ``read_topic_keys``: below etcd's default
--max-txn-ops of 128, for etcds configured by others."""


@dataclass(frozen=True, slots=True)
class Leader:
    """Where to send a partition's requests: the leader broker and its epoch."""

    broker: Broker
    leader_epoch: int


class Revisions(NamedTuple):
    """Where one key of the view stands in etcd's history."""

    # The incarnation: new after a delete and re-create, larger than any earlier one's.
    create_revision: int
    # Its last write.
    mod_revision: int


@dataclass(frozen=True, slots=True)
class TopicKeyRead:
    """A topic key as etcd held it at ``revision``; its revisions are 0 if it was absent."""

    name: str
    create_revision: int
    mod_revision: int
    revision: int


@dataclass(slots=True)
class MetadataView:
    """Brokers, topics and partition states as etcd last said. Not thread-safe by itself:
    ``MetadataCache`` guards it with its lock.

    Invariants: ``version`` grows by one with every applied change, so a reader that saw
    version v can wait for anything newer. ``topic_revisions`` has the same names as
    ``topics``, ``partition_revisions`` the same keys as ``partitions``.
    """

    cluster_id: str = ""
    brokers: dict[int, Broker] = field(default_factory=dict)
    topics: dict[str, Topic] = field(default_factory=dict)
    partitions: dict[tuple[str, int], PartitionRecord] = field(default_factory=dict)
    controller: ControllerInfo | None = None
    version: int = 0
    # The etcd revisions of each topic's key: what tells an admin call that its write
    # reached the view (``shows``).
    topic_revisions: dict[str, Revisions] = field(default_factory=dict)
    # The mod revision of each partition's key: a record written before its topic's
    # create revision is an earlier incarnation's (``ready``).
    partition_revisions: dict[tuple[str, int], int] = field(default_factory=dict)
    # The revision ``topics/`` is applied through: the read's on a load, the latest
    # event's since. Events of one revision come one by one, so the topic keys of that
    # very revision may not all be applied yet; those of every earlier one are.
    topics_revision: int = 0

    def load(self, prefix: str, kvs: list[KeyValue], revision: int) -> None:
        """Replace everything under ``prefix`` with ``kvs``, a fresh read at ``revision``."""
        if prefix == BROKERS_PREFIX:
            self.brokers = {}
        elif prefix == TOPICS_PREFIX:
            self.topics = {}
            self.topic_revisions = {}
            self.topics_revision = revision
        elif prefix == PARTITIONS_PREFIX:
            self.partitions = {}
            self.partition_revisions = {}
        elif prefix == CONTROLLER_KEY:
            self.controller = None
        elif prefix == CLUSTER_ID_KEY:
            self.cluster_id = ""
        for kv in kvs:
            self._put(kv)
        self.version += 1

    def apply(self, event: WatchEvent) -> None:
        """One watched change."""
        if event.key.startswith(TOPICS_PREFIX):
            self.topics_revision = max(self.topics_revision, event.mod_revision)
        if event.type == "delete":
            self._delete(event.key)
        else:
            self._put(
                KeyValue(
                    key=event.key,
                    value=event.value,
                    mod_revision=event.mod_revision,
                    create_revision=event.create_revision,
                    version=event.version,
                    lease_id=0,
                )
            )
        self.version += 1

    def _put(self, kv: KeyValue) -> None:
        try:
            if kv.key.startswith(BROKERS_PREFIX):
                broker = decode_broker(kv)
                self.brokers[broker.broker_id] = broker
            elif kv.key.startswith(TOPICS_PREFIX):
                topic = decode_topic(kv)
                self.topics[topic.name] = topic
                self.topic_revisions[topic.name] = Revisions(kv.create_revision, kv.mod_revision)
            elif kv.key.startswith(PARTITIONS_PREFIX):
                name, index, record = decode_partition(kv)
                self.partitions[(name, index)] = record
                self.partition_revisions[(name, index)] = kv.mod_revision
            elif kv.key == CONTROLLER_KEY:
                self.controller = decode_controller(kv)
            elif kv.key == CLUSTER_ID_KEY:
                self.cluster_id = decode_cluster_id(kv)
        except Exception as exc:
            # One unreadable key must not blind the gateway to the rest of the cluster,
            # whatever its decoding trips on (a "configs": null once raised AttributeError,
            # which ended the watch and the reloads with it).
            _log.error("bad_metadata_key", key=kv.key, error=f"{type(exc).__name__}: {exc}")

    def _delete(self, key: str) -> None:
        if key.startswith(BROKERS_PREFIX):
            broker_id = key.removeprefix(BROKERS_PREFIX)
            if broker_id.isdigit():
                self.brokers.pop(int(broker_id), None)
        elif key.startswith(TOPICS_PREFIX):
            name = key.removeprefix(TOPICS_PREFIX)
            self.topics.pop(name, None)
            self.topic_revisions.pop(name, None)
        elif key.startswith(PARTITIONS_PREFIX):
            name, _, index = key.removeprefix(PARTITIONS_PREFIX).rpartition("/")
            if index.isdigit():
                self.partitions.pop((name, int(index)), None)
                self.partition_revisions.pop((name, int(index)), None)
        elif key == CONTROLLER_KEY:
            self.controller = None

    # --- questions the router asks ----------------------------------------------------------

    def topic(self, name: str) -> Topic:
        topic = self.topics.get(name)
        if topic is None:
            # A name no topic could have is INVALID_TOPIC, not "does not exist" (the
            # storage and controller services answer the same).
            validate_topic_name(name)
            raise UnknownTopicOrPartitionError(f"topic {name!r} does not exist")
        return topic

    def check_partition(self, name: str, partition: int) -> Topic:
        topic = self.topic(name)
        if not 0 <= partition < topic.partition_count:
            raise UnknownTopicOrPartitionError(
                f"topic {name!r} has {topic.partition_count} partitions; "
                f"partition {partition} does not exist"
            )
        return topic

    def leader(self, name: str, partition: int) -> Leader:
        """The partition's leader, or why there is none to route to."""
        self.check_partition(name, partition)
        record = self.partitions.get((name, partition))
        if record is None or record.leader < 0:
            raise LeaderNotAvailableError(
                f"partition {name}-{partition} has no leader right now (all of its in-sync "
                "replicas are down or an election is in progress)"
            )
        broker = self.brokers.get(record.leader)
        if broker is None:
            raise LeaderNotAvailableError(
                f"the leader of {name}-{partition}, broker {record.leader}, is not registered "
                "(it may have just failed; a new leader is being elected)"
            )
        return Leader(broker, record.leader_epoch)

    def ready(self, name: str) -> bool:
        """The topic exists with a leader for every partition, each from a record of this
        incarnation of the topic: a delete removes the topic and partition keys together,
        but the two prefixes are watched apart, so right after a re-create the view can
        still hold the old incarnation's records."""
        topic = self.topics.get(name)
        revisions = self.topic_revisions.get(name)
        if topic is None or revisions is None:
            return False
        for index in range(topic.partition_count):
            record = self.partitions.get((name, index))
            if (
                record is None
                or record.leader < 0
                or record.leader not in self.brokers
                or self.partition_revisions.get((name, index), 0) < revisions.create_revision
            ):
                return False
        return True

    # --- questions admin calls ask ----------------------------------------------------------

    def shows(self, read: TopicKeyRead) -> bool:
        """Whether the view has reached the topic key's state in ``read`` or a later one.

        Never an exact state: another change of the topic committed right after (an alter
        of another key, a delete, a re-create) moves the view past it, maybe before the
        caller looks, and then it would never be seen.
        """
        held = self.topic_revisions.get(read.name)
        if read.mod_revision == 0:
            # Absent from etcd: no incarnation from before the read may be left here.
            return held is None or held.create_revision > read.revision
        if held is not None:
            return held.mod_revision >= read.mod_revision
        # Gone since: only once ``topics/`` is applied past the read's write; up to it the
        # view may not have seen the key yet.
        return self.topics_revision > read.mod_revision

    def shows_ready(self, read: TopicKeyRead) -> bool:
        """``shows(read)`` and, while the view holds the incarnation ``read`` found, that it
        is ``ready``: what a created or grown topic waits for. A later incarnation, or
        none, is someone else's change, and not waited on."""
        if not self.shows(read):
            return False
        held = self.topic_revisions.get(read.name)
        if held is None or held.create_revision != read.create_revision:
            return True
        return self.ready(read.name)


class MetadataCache:
    """A ``MetadataView`` kept current by etcd watches; see the module docstring.

    Thread-safety: every method may be called from any thread. ``snapshot`` callers get
    the live view under no lock and must only read it through ``read`` (which holds the
    lock) when they need several consistent answers.
    """

    def __init__(self, store: MetaStore) -> None:
        self._store = store
        self._view = MetadataView()
        self._changed = threading.Condition()
        self._cancels: list[Callable[[], None]] = []
        self._failed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()

    # --- lifecycle ------------------------------------------------------------------------

    def start(self, timeout_s: float) -> None:
        """Load the view and start watching; raises MetaStoreError if etcd does not answer
        within ``timeout_s``. Afterwards a background thread repairs failed watches."""
        self._load_and_watch()
        self._thread = threading.Thread(
            target=self._supervise, name="gateway-metadata", daemon=True
        )
        self._thread.start()
        del timeout_s  # the store's own per-call deadline bounds the first load

    def stop(self) -> None:
        self._stop.set()
        self._failed.set()
        self._cancel_watches()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._changed:
            self._changed.notify_all()

    def _cancel_watches(self) -> None:
        cancels, self._cancels = self._cancels, []
        for cancel in cancels:
            cancel()

    def _load_and_watch(self) -> None:
        for prefix in WATCHED_PREFIXES:
            # The controller key is read as a prefix too: one read gives the value and the
            # revision it reflects, so the watch resumes exactly after it.
            kvs, revision = self._store.get_prefix_with_revision(prefix)
            with self._changed:
                self._view.load(prefix, kvs, revision)
                self._changed.notify_all()
            self._cancels.append(
                self._store.watch_prefix(
                    prefix,
                    self._on_event,
                    on_error=self._on_watch_error,
                    start_revision=revision + 1,
                )
            )
        self._loaded.set()

    def _on_event(self, event: WatchEvent) -> None:
        with self._changed:
            self._view.apply(event)
            self._changed.notify_all()

    def _on_watch_error(self, error: MetaStoreError) -> None:
        _log.warning("watch_failed", error=str(error))
        self._failed.set()

    def _supervise(self) -> None:
        while not self._stop.is_set():
            self._failed.wait()
            if self._stop.is_set():
                return
            self._cancel_watches()
            attempt = 0
            while not self._stop.is_set():
                self._failed.clear()
                try:
                    self._load_and_watch()
                    _log.info("metadata_reloaded", version=self.version)
                    break
                except Exception as exc:  # the supervisor must outlive any one failure
                    self._cancel_watches()
                    delay = RELOAD_BACKOFF_S[min(attempt, len(RELOAD_BACKOFF_S) - 1)]
                    attempt += 1
                    _log.warning("metadata_reload_failed", error=str(exc), retry_in_s=delay)
                    self._stop.wait(delay)

    # --- reading --------------------------------------------------------------------------

    @property
    def version(self) -> int:
        with self._changed:
            return self._view.version

    def read(self, fn: Callable[[MetadataView], _T]) -> _T:
        """``fn(view)`` under the lock: several answers from one consistent view."""
        with self._changed:
            return fn(self._view)

    def leader(self, topic: str, partition: int) -> Leader:
        with self._changed:
            return self._view.leader(topic, partition)

    def read_topic_keys(self, names: Sequence[str], deadline: float) -> list[TopicKeyRead]:
        """Where etcd's keys of the topics ``names`` stand now (read from etcd, not the
        view), in read-only transactions of TOPIC_KEYS_PER_READ keys, each at one revision
        and within ``deadline`` (``time.monotonic()``). Raises MetaStoreError."""
        reads: list[TopicKeyRead] = []
        for start in range(0, len(names), TOPIC_KEYS_PER_READ):
            chunk = names[start : start + TOPIC_KEYS_PER_READ]
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise MetaStoreUnavailableError("no time left to read the topic keys")
            result = self._store.txn(
                [], [GetOp(topic_key(name)) for name in chunk], timeout_s=remaining_s
            )
            for name, response in zip(chunk, result.responses, strict=True):
                kv = response.kvs[0] if isinstance(response, GetResult) and response.kvs else None
                reads.append(
                    TopicKeyRead(
                        name,
                        create_revision=kv.create_revision if kv else 0,
                        mod_revision=kv.mod_revision if kv else 0,
                        revision=result.revision,
                    )
                )
        return reads

    def pending_deletions(self, deadline: float) -> set[str]:
        """The topics whose deletion the controller has not completed (``deletions/<t>``:
        replicas on live brokers not yet deleted, or their groups' offsets), read from
        etcd within ``deadline`` (``time.monotonic()``). Raises MetaStoreError."""
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise MetaStoreUnavailableError("no time left to read the pending deletions")
        result = self._store.txn([], [GetOp(DELETIONS_PREFIX, prefix=True)], timeout_s=remaining_s)
        (response,) = result.responses
        kvs = response.kvs if isinstance(response, GetResult) else []
        return {kv.key.removeprefix(DELETIONS_PREFIX) for kv in kvs}

    @property
    def stopped(self) -> bool:
        """Whether ``stop`` was called: the view changes no more."""
        return self._stop.is_set()

    def wait_for_change(self, seen_version: int, timeout_s: float) -> int:
        """Block until the view is newer than ``seen_version`` or ``timeout_s`` passes;
        returns the version now current."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._view.version != seen_version or self._stop.is_set(),
                timeout=max(timeout_s, 0.0),
            )
            return self._view.version
