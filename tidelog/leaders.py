"""Partition leaders and storage-node channels for clients in direct mode.

Kafka's clients send produce and fetch requests straight to each partition's leader. The
gateway (DESIGN.md section 1) puts a hop in between so that a client needs to reach only
the gateway. In direct mode (``Producer(direct=True)``, ``Consumer(direct=True)``) the SDK
still asks the gateway for metadata, producer ids and group offsets, but sends its
``Append`` and ``Fetch`` calls to the leaders' ``tidelog.v1.Storage`` service itself: one
Python gRPC hop less for every byte and every round trip (docs/BENCHMARKS.md measures
both modes). The brokers' registered addresses (``BrokerInfo`` host:port, what the
brokers use to reach each other) must be reachable from the client.

``LeaderDirectory`` caches what the gateway last said: each live broker's address and each
partition's leader and leader epoch. It asks again when a partition it is asked about is
unknown (the lookup waits for the answer) or when a client reported that a leader moved
(``invalidate``; a background refresh, the cache answering meanwhile, as Kafka's clients
update metadata), at most once per ``min_refresh_interval_s``, so a dead leader does not
turn every retry into a metadata call, and an unreachable gateway does not hold up
partitions whose leaders are known. A leader that moved answers NOT_LEADER_OR_FOLLOWER
or FENCED_LEADER_EPOCH (the leader epoch goes with every append), so a stale entry costs
a retry, never a misplaced record.

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import grpc

from tidelog.addresses import format_host_port
from tidelog.client import GatewayConnection, client_channel, leaders_by_topic
from tidelog.errors import TidelogError
from tidelog.v1 import common_pb2, controller_pb2, storage_pb2, storage_pb2_grpc

RETIRED_CHANNEL_GRACE_S: Final = 60.0
"""How long a channel to an address no live broker has any more stays open before it is
closed: a caller may still hold its stub from a lookup just before (a closed channel
raises ValueError, not an RPC error its retry rules know)."""
MIN_REFRESH_INTERVAL_S: Final = 0.1
"""Least time between two metadata refreshes that a stale entry asks for (Kafka's
retry.backoff.ms)."""

TopicPartition = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Leader:
    """Where a partition's reads and writes go, as the gateway's metadata last said."""

    broker_id: int
    leader_epoch: int
    address: str  # host:port of the broker's Storage service


class _Broker:
    """The calls the SDK makes on one storage node, over one channel."""

    __slots__ = (
        "append_encoded",
        "append_many_encoded",
        "append_stream_encoded",
        "channel",
        "stub",
    )

    def __init__(self, address: str) -> None:
        self.channel = channel = client_channel(address)
        self.stub = storage_pb2_grpc.StorageStub(channel)
        # Append taking a request encoded by hand (tidelog.wire), as the gateway sends it.
        self.append_encoded: grpc.UnaryUnaryMultiCallable[bytes, storage_pb2.AppendResponse] = (
            channel.unary_unary(
                "/tidelog.v1.Storage/Append",
                request_serializer=None,
                response_deserializer=storage_pb2.AppendResponse.FromString,
            )
        )
        # AppendMany, the same way: one call for many partitions of this leader.
        self.append_many_encoded: grpc.UnaryUnaryMultiCallable[
            bytes, storage_pb2.AppendManyResponse
        ] = channel.unary_unary(
            "/tidelog.v1.Storage/AppendMany",
            request_serializer=None,
            response_deserializer=storage_pb2.AppendManyResponse.FromString,
        )
        # AppendStream on encoded requests: the producer's ordered pipe to this broker.
        self.append_stream_encoded: grpc.StreamStreamMultiCallable[
            bytes, storage_pb2.AppendResponse
        ] = channel.stream_stream(
            "/tidelog.v1.Storage/AppendStream",
            request_serializer=None,
            response_deserializer=storage_pb2.AppendResponse.FromString,
        )


class LeaderDirectory:
    """See the module docstring."""

    def __init__(
        self, conn: GatewayConnection, min_refresh_interval_s: float = MIN_REFRESH_INTERVAL_S
    ) -> None:
        self._conn = conn
        self._min_refresh_interval_s = min_refresh_interval_s
        self._lock = threading.Lock()
        self._addresses: dict[int, str] = {}  # live broker id -> host:port
        self._leaders: dict[TopicPartition, tuple[int, int]] = {}  # -> (broker id, epoch)
        self._topic_ids: dict[str, str] = {}  # topic -> the incarnation's id, as last said
        self._stale = False
        self._refreshing = False  # a background refresh is running
        self._invalidations = 0  # invalidate() calls so far
        self._refreshed_at_s = float("-inf")  # when the last refresh ended
        self._brokers: dict[str, _Broker] = {}  # by address: one channel per storage node
        # Channels to addresses no live broker has now (moved, or gone), with when they
        # were retired: closed after RETIRED_CHANNEL_GRACE_S (_store).
        self._retired: list[tuple[float, _Broker]] = []

    def refresh(self, topics: Sequence[str]) -> dict[str, list[int]]:
        """Ask the gateway again about ``topics``; returns each one's partition leaders
        (-1: none). Raises UnknownTopicOrPartitionError for a topic that does not exist."""
        with self._lock:
            invalidations = self._invalidations
        try:
            response = self._conn.metadata(topics)
            leaders = leaders_by_topic(response)  # raises before anything is replaced
        except TidelogError:
            with self._lock:
                self._refreshed_at_s = time.monotonic()  # failed attempts are spaced too
            raise
        with self._lock:
            # Still stale if a topic looked up before was left out of this answer.
            complete = {topic for topic, _ in self._leaders} <= set(topics)
            self._store(response, complete=complete, invalidations=invalidations)
        return leaders

    def _store(
        self, response: controller_pb2.MetadataResponse, *, complete: bool, invalidations: int
    ) -> None:
        """(lock held) Take a metadata answer in. The directory is no longer stale if the
        answer covers every topic looked up so far (``complete``) and nobody invalidated
        it since the question was asked (``invalidations`` then). A topic answered with
        an error (it was deleted) is forgotten, so that its next lookup asks the gateway
        and raises.

        A partition keeps a leader of a later epoch than the answer's, of the same topic
        incarnation (Kafka's clients the same, KIP-320): a background refresh answered
        late, after a foreground one had learned of an election, brought the old leader
        back, and the directory counted as fresh (found by an audit)."""
        now = time.monotonic()
        self._addresses = {b.broker_id: format_host_port(b.host, b.port) for b in response.brokers}
        self._retire_channels(now)
        for topic in response.topics:
            if topic.error.code != common_pb2.NONE:
                for key in [k for k in self._leaders if k[0] == topic.name]:
                    del self._leaders[key]
                self._topic_ids.pop(topic.name, None)
                continue
            same_topic = self._topic_ids.get(topic.name) == topic.topic_id
            self._topic_ids[topic.name] = topic.topic_id
            for state in topic.partitions:
                key = (topic.name, state.partition)
                known = self._leaders.get(key)
                if same_topic and known is not None and state.leader_epoch < known[1]:
                    continue
                self._leaders[key] = (state.leader, state.leader_epoch)
        if complete and invalidations == self._invalidations:
            self._stale = False
        self._refreshed_at_s = now

    def _retire_channels(self, now: float) -> None:
        """(lock held) Retire the channels to addresses no live broker has now, and close
        those retired more than RETIRED_CHANNEL_GRACE_S ago: a broker restarted at a new
        address (a pod's new IP) left its old channel open for the life of the process
        (found by an audit)."""
        live = set(self._addresses.values())
        for address in [a for a in self._brokers if a not in live]:
            self._retired.append((now, self._brokers.pop(address)))
        while self._retired and now - self._retired[0][0] > RETIRED_CHANNEL_GRACE_S:
            self._retired.pop(0)[1].channel.close()

    def _refresh_in_background(self, topics: list[str], invalidations: int) -> None:
        """Ask again about every topic looked up so far; a gateway that cannot be reached
        leaves the cache as it is, still stale."""
        response = None
        try:
            response = self._conn.metadata(topics)
        except TidelogError:
            pass
        finally:  # whatever happened, the next lookup after the interval may try again
            with self._lock:
                if response is None:
                    self._refreshed_at_s = time.monotonic()
                else:
                    self._store(response, complete=True, invalidations=invalidations)
                self._refreshing = False

    def topic_id(self, topic: str) -> str:
        """The topic's id as the last answer about it said ("" when none did)."""
        with self._lock:
            return self._topic_ids.get(topic, "")

    def invalidate(self) -> None:
        """A client saw a leader move or a broker fail: the next lookup asks again."""
        with self._lock:
            self._stale = True
            self._invalidations += 1

    def leader(self, tp: TopicPartition) -> Leader | None:
        """The partition's leader; None when it has no live leader right now.

        A partition never looked up waits for the gateway's answer (and raises its
        error). A stale directory is refreshed in the background, as Kafka's clients
        update metadata: the lookup answers from the cache meanwhile (a leader that moved
        costs a retry), so one moved partition does not make every other partition's
        sends wait for the gateway, or fail while it is unreachable. Attempts are
        ``min_refresh_interval_s`` apart, failed ones too."""
        with self._lock:
            entry = self._leaders.get(tp)
            due = time.monotonic() - self._refreshed_at_s >= self._min_refresh_interval_s
            background = entry is not None and self._stale and due and not self._refreshing
            if background:
                self._refreshing = True
                topics = sorted({topic for topic, _ in self._leaders})
                invalidations = self._invalidations
        if entry is None and due:
            self.refresh([tp[0]])
        elif background:
            threading.Thread(
                target=self._refresh_in_background,
                args=(topics, invalidations),
                name="tidelog-leaders-refresh",
                daemon=True,
            ).start()
        with self._lock:
            entry = self._leaders.get(tp)
            if entry is None or entry[0] < 0:
                return None
            address = self._addresses.get(entry[0])
        if address is None:
            return None  # the leader's registration is gone: it died or is restarting
        return Leader(broker_id=entry[0], leader_epoch=entry[1], address=address)

    def cached_address(self, tp: TopicPartition) -> str | None:
        """The address of the partition's leader as cached now, never asking the gateway
        (None when unknown): for choices that must not wait, as the producer's sender
        skipping partitions whose leader has its requests in flight at the limit."""
        with self._lock:
            entry = self._leaders.get(tp)
            if entry is None or entry[0] < 0:
                return None
            return self._addresses.get(entry[0])

    def address(self, broker_id: int) -> str | None:
        """A live broker's address as last known; None when it is not registered."""
        with self._lock:
            return self._addresses.get(broker_id)

    def _broker(self, address: str) -> _Broker:
        with self._lock:
            broker = self._brokers.get(address)
            if broker is None:
                broker = self._brokers[address] = _Broker(address)
            return broker

    def append_encoded(
        self, address: str
    ) -> grpc.UnaryUnaryMultiCallable[bytes, storage_pb2.AppendResponse]:
        """``Storage.Append`` on the broker at ``address``, taking an encoded request."""
        return self._broker(address).append_encoded

    def append_many_encoded(
        self, address: str
    ) -> grpc.UnaryUnaryMultiCallable[bytes, storage_pb2.AppendManyResponse]:
        """``Storage.AppendMany`` on the broker at ``address``, taking an encoded request."""
        return self._broker(address).append_many_encoded

    def append_stream_encoded(
        self, address: str
    ) -> grpc.StreamStreamMultiCallable[bytes, storage_pb2.AppendResponse]:
        """``Storage.AppendStream`` on the broker at ``address``, taking encoded requests."""
        return self._broker(address).append_stream_encoded

    def storage(self, address: str) -> storage_pb2_grpc.StorageStub:
        """The ``Storage`` stub of the broker at ``address``."""
        return self._broker(address).stub


_registry: dict[GatewayConnection, LeaderDirectory] = {}
_registry_lock = threading.Lock()


def directory_for(conn: GatewayConnection) -> LeaderDirectory:
    """The directory shared by the direct-mode clients of ``conn`` (connections are one per
    process and gateway address, so this is one per process and gateway too)."""
    with _registry_lock:
        directory = _registry.get(conn)
        if directory is None:
            directory = _registry[conn] = LeaderDirectory(conn)
        return directory
