"""Replica fetchers: the follower side of replication (a thin adapter over ``Partition``).

One ``ReplicaFetcherThread`` per source leader broker pulls every partition this broker
follows from that leader in one long-polling Fetch loop (seed 000: ``min_bytes=1``,
``max_wait_ms=500``), identifying itself as the registered broker it is (``replica_id``,
``broker_epoch``). ``ReplicaFetcherManager`` maps partitions to threads as LeaderAndIsr
changes roles, and stops a thread once no partition is left to fetch from its leader.

A partition that becomes follower first *truncates* (Kafka KIP-101 with KIP-279), never
blindly to its own high watermark: the fetcher asks the leader (OffsetForLeaderEpoch)
where the follower's latest epoch ends there, and truncates to the smaller of that and
its own end of the same epoch; when the leader answers with an epoch the follower does
not have, the follower truncates to the end of its own largest earlier epoch and asks
again. Then it fetches from its log end offset and appends the leader's batches as they
are (``assign_offsets=False``), setting its HW to min(leader HW, own LEO).

Large answers are pipelined (``ReplicaFetcherThread._fetch``): once an answer of at
least ``PIPELINE_MIN_BYTES`` is verified (every batch whole, checksums right, offsets
contiguous from the log end), the next Fetch goes out from the log end the append will
reach, and the answer is appended while the leader reads and sends the next range. That
Fetch also says where the written log ends (``written_offset``): the leader counts only
that toward the HW, so no acks=all acknowledgement depends on data still in this
process's memory, and it answers such a fetch at once instead of long-polling, so the
next fetch reports the write. A pipelined answer is used only if the log end and epoch
turned out as predicted; errors, divergence, truncation and role changes fall back to
the serial fetch -> append -> fetch loop, and so do small answers, for which the
pipeline's extra round before the HW moves would cost more latency than the overlap
saves.

Every RPC has a deadline; errors back off (``FETCH_BACKOFF_S``) instead of spinning.
Thread-safety: ``ReplicaFetcherManager`` methods may be called from any thread; each
fetcher thread owns its RPC channel, and its partition map is guarded by its lock.
Partitions are only touched through their own (locked) methods, which fence on the
leader epoch the fetcher was given, so a fetch answered after a role change is dropped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NamedTuple

import grpc
import structlog

from services.status import error_from_proto, error_from_rpc_error
from services.storage.fetch_session import FetchPlan, FetchSessionHandler, Key
from services.storage.partition import Partition
from services.storage.replica_rules import follower_truncation
from tidelog import tracing
from tidelog.batch import iter_batches
from tidelog.errors import (
    CorruptBatchError,
    ErrorCode,
    FetchSessionIdNotFoundError,
    InvalidFetchSessionEpochError,
    NotLeaderOrFollowerError,
    TidelogError,
)
from tidelog.formats import MAX_PRODUCE_REQUEST_BYTES, REQUEST_OVERHEAD_BYTES
from tidelog.v1 import common_pb2, storage_pb2, storage_pb2_grpc

_log = structlog.get_logger("tidelog.storage.fetcher")

FETCH_MAX_WAIT_MS: Final = 500  # seed 000: replica.fetch.wait.max.ms
FETCH_MIN_BYTES: Final = 1  # seed 000: replica.fetch.min.bytes
FETCH_MAX_BYTES: Final = 32 * 1024 * 1024  # whole response (replica.fetch.response.max.bytes)
PARTITION_FETCH_MAX_BYTES: Final = 8 * 1024 * 1024  # replica.fetch.max.bytes
RPC_SLACK_S: Final = 5.0  # deadline beyond the long-poll for the transfer itself
FETCH_BACKOFF_S: Final = 0.2  # replica.fetch.backoff.ms
MAX_MESSAGE_BYTES: Final = MAX_PRODUCE_REQUEST_BYTES + REQUEST_OVERHEAD_BYTES + FETCH_MAX_BYTES
"""A fetch answer a follower takes: a whole first batch as large as a leader's Append can
carry (a leader answers it whatever the budget, as Kafka does), or the budget's worth. At
64 MiB, a larger batch the leader had taken was never replicated, and the partitions
fetched after it in the same session stopped too (found by an audit)."""
PIPELINE_MIN_BYTES: Final = 512 * 1024
"""A smaller answer is appended before the next Fetch goes out (see ``_predict``)."""

AddressResolver = Callable[[int], str | None]
"""Broker id -> "host:port" (metadata cache first, etcd second), None when unknown."""


@dataclass(slots=True)
class _FetchState:
    partition: Partition
    leader_epoch: int
    truncating: bool = True  # KIP-279 reconciliation still to do
    delayed_until: float = 0.0  # monotonic; back off this partition after an error
    stale: bool = False  # a pipelined answer did not fit: end the pipeline (see _fetch)
    # (log end offset, latest epoch) as this thread last left the log, None until asked
    # (``follower_state``) or after anything but a clean append: this thread is the one
    # writer of a followed log, and asking every partition under its lock each round
    # cost a round O(partitions) even when few had data.
    known: tuple[int, int] | None = None


if TYPE_CHECKING:
    _FetchFuture = grpc.Future[storage_pb2.FetchResponse]


class _Fetched(NamedTuple):
    """One partition of a Fetch: the offset it was sent with and the latest epoch then."""

    state: _FetchState
    offset: int
    epoch: int

    @property
    def key(self) -> Key:
        return (self.state.partition.topic, self.state.partition.partition)


_Position = tuple[int, int, int | None, int, str]
"""What a fetch says about one partition (fetch offset, last fetched epoch, written
offset, leader epoch, topic id): a fetch session names it again only when it changed."""


def _end_after(records: bytes, offset: int) -> tuple[int, int] | None:
    """``(log end offset, latest batch epoch)`` after appending ``records`` at ``offset``.

    None unless every batch is whole and intact (checksums included) and the batches are
    contiguous from ``offset``: the follower's append would then not fail on the data.
    """
    epoch = -1
    try:
        for _, header in iter_batches(records):
            if header.base_offset != offset:
                return None
            offset = header.last_offset + 1
            epoch = max(epoch, header.partition_leader_epoch)
    except CorruptBatchError:
        return None
    return offset, epoch


class ReplicaFetcherThread(threading.Thread):
    """Pulls every partition this broker follows from one leader broker."""

    def __init__(
        self,
        *,
        local_broker_id: int,
        source_broker_id: int,
        broker_epoch: Callable[[], int],
        resolve: AddressResolver,
    ) -> None:
        super().__init__(name=f"replica-fetcher-{source_broker_id}", daemon=True)
        self.local_broker_id = local_broker_id
        self.source_broker_id = source_broker_id
        self._broker_epoch = broker_epoch
        self._resolve = resolve
        self._lock = threading.Lock()
        self._partitions: dict[tuple[str, int], _FetchState] = {}
        self._changed = threading.Event()
        self._stopping = threading.Event()
        # Fetches sent before the previous answer was appended (observability and tests).
        self.pipelined_fetches = 0
        self._channel: grpc.Channel | None = None
        self._channel_stub: storage_pb2_grpc.StorageStub | None = None
        self._address: str | None = None
        # The incremental fetch session with the leader (KIP-227): after the first full
        # fetch, only partitions whose position changed are named, and only those with
        # something new are answered. Forgotten with the channel and after any failure.
        self._session: FetchSessionHandler[_Position] = FetchSessionHandler()

    # --- membership (any thread) ----------------------------------------------------------

    def add(self, partition: Partition, leader_epoch: int) -> None:
        with self._lock:
            key = (partition.topic, partition.partition)
            self._partitions[key] = _FetchState(partition, leader_epoch)
        _log.debug(
            "fetcher_partition_added",
            topic=partition.topic,
            partition=partition.partition,
            source_broker=self.source_broker_id,
            epoch=leader_epoch,
        )
        self._changed.set()

    def remove(self, key: tuple[str, int]) -> bool:
        with self._lock:
            removed = self._partitions.pop(key, None) is not None
        if removed:
            _log.debug(
                "fetcher_partition_removed",
                topic=key[0],
                partition=key[1],
                source_broker=self.source_broker_id,
            )
        self._changed.set()
        return removed

    def is_empty(self) -> bool:
        with self._lock:
            return not self._partitions

    def stop(self) -> None:
        self._stopping.set()
        self._changed.set()
        channel = self._channel
        if channel is not None:
            # Cancels a long-poll in flight, so shutdown does not wait out max_wait_ms.
            channel.close()

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._changed.clear()
                now = time.monotonic()
                with self._lock:
                    states = [s for s in self._partitions.values() if s.delayed_until <= now]
                    nothing = not self._partitions
                if nothing or not states:
                    self._changed.wait(FETCH_BACKOFF_S)
                    continue
                try:
                    stub = self._stub()
                    if stub is None:  # the leader's address is not known yet
                        self._stopping.wait(FETCH_BACKOFF_S)
                        continue
                    truncating = [s for s in states if s.truncating]
                    if truncating:
                        self._truncate(stub, truncating)
                    ready = [s for s in states if not s.truncating]
                    if ready:
                        throttle_s = self._fetch(stub, ready)
                        if throttle_s > 0:
                            # The leader had no place to hold the fetch waiting: asking
                            # again at once would spin until one frees.
                            self._changed.wait(throttle_s)
                except (FetchSessionIdNotFoundError, InvalidFetchSessionEpochError) as exc:
                    # The leader no longer holds our session (it restarted, or evicted
                    # it) or lost track of it: fetch in full at once, opening a new one.
                    _log.info(
                        "replica_fetch_session_reset",
                        source_broker=self.source_broker_id,
                        error=str(exc),
                    )
                    self._session.reset()
                except TidelogError as exc:
                    # The leader is unreachable or refused the whole request: back off, and
                    # re-resolve its address (it may have moved after a restart).
                    _log.info(
                        "replica_fetch_failed",
                        source_broker=self.source_broker_id,
                        error=str(exc),
                    )
                    self._close_channel()
                    self._stopping.wait(FETCH_BACKOFF_S)
                except Exception:
                    # A bug or a local disk error must not end replication of every
                    # partition from this leader: log it, back off, go on.
                    if self._stopping.is_set():
                        break
                    _log.exception("replica_fetch_error", source_broker=self.source_broker_id)
                    self._close_channel()
                    self._stopping.wait(FETCH_BACKOFF_S)
        finally:
            self._close_channel()

    def _stub(self) -> storage_pb2_grpc.StorageStub | None:
        address = self._resolve(self.source_broker_id)
        if address is None:
            return None
        if self._channel is None or address != self._address:
            self._close_channel()
            self._channel = grpc.insecure_channel(
                address,
                options=[
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ],
            )
            self._address = address
            # Made once per channel: binding every method of the service again for
            # each fetch round was ~6% of a follower's Python time.
            self._channel_stub = storage_pb2_grpc.StorageStub(self._channel)
        return self._channel_stub

    def _close_channel(self) -> None:
        self._session.reset()
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            self._address = None
            self._channel_stub = None

    def _drop(self, state: _FetchState) -> None:
        key = (state.partition.topic, state.partition.partition)
        with self._lock:
            if self._partitions.get(key) is state:
                del self._partitions[key]
        _log.debug(
            "fetcher_partition_dropped", topic=key[0], partition=key[1], epoch=state.leader_epoch
        )

    def _delay(self, state: _FetchState) -> None:
        state.delayed_until = time.monotonic() + FETCH_BACKOFF_S

    # --- KIP-279 truncation -----------------------------------------------------------------

    def _truncate(self, stub: storage_pb2_grpc.StorageStub, states: list[_FetchState]) -> None:
        asks: list[tuple[_FetchState, int, int]] = []  # state, own LEO, own latest epoch
        for state in states:
            try:
                leo, epoch = state.partition.follower_state(state.leader_epoch)
            except TidelogError:
                self._drop(state)  # no longer following at this epoch
                continue
            if epoch < 0:
                # No epochs in the log: nothing written by any leader here (empty, or
                # recovered down to nothing); fetch from the log end.
                state.truncating = False
                continue
            asks.append((state, leo, epoch))
        if not asks:
            return
        request = storage_pb2.OffsetForLeaderEpochRequest(
            replica_id=self.local_broker_id,
            partitions=[
                storage_pb2.OffsetForLeaderEpochPartition(
                    topic=s.partition.topic,
                    partition=s.partition.partition,
                    current_leader_epoch=s.leader_epoch,
                    leader_epoch=epoch,
                )
                for s, _, epoch in asks
            ],
        )
        try:
            response = stub.OffsetForLeaderEpoch(request, timeout=RPC_SLACK_S)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from None
        for (state, leo, epoch), result in zip(asks, response.partitions, strict=True):
            if int(result.error.code) != ErrorCode.NONE:
                _log.debug(
                    "offset_for_leader_epoch_error",
                    topic=state.partition.topic,
                    partition=state.partition.partition,
                    epoch=state.leader_epoch,
                    error=str(error_from_proto(result.error)),
                )
                self._delay(state)  # e.g. the leader has not applied its LeaderAndIsr yet
                continue
            _log.debug(
                "offset_for_leader_epoch",
                topic=state.partition.topic,
                partition=state.partition.partition,
                epoch=state.leader_epoch,
                log_end_offset=leo,
                asked_epoch=epoch,
                leader_answer=(result.leader_epoch, result.end_offset),
            )
            try:
                self._truncate_one(state, leo, result.leader_epoch, result.end_offset)
            except NotLeaderOrFollowerError:
                self._drop(state)

    def _truncate_one(
        self, state: _FetchState, leo: int, leader_epoch: int, leader_end: int
    ) -> None:
        partition = state.partition
        # The decision is replica_rules.follower_truncation (KIP-101/279, shared with the
        # simulation tests); the partition only answers about its own epochs.
        target, done = follower_truncation(
            log_end_offset=leo,
            high_watermark=partition.high_watermark,
            leader_epoch=leader_epoch,
            leader_end_offset=leader_end,
            own_end_offset_for=lambda epoch: partition.follower_end_offset_for_epoch(
                state.leader_epoch, epoch
            ),
        )
        state.known = None
        new_leo = partition.follower_truncate(state.leader_epoch, target)
        if new_leo < leo:
            _log.info(
                "follower_truncated",
                topic=partition.topic,
                partition=partition.partition,
                epoch=state.leader_epoch,
                from_offset=leo,
                to_offset=new_leo,
            )
        state.truncating = not done

    # --- fetching -------------------------------------------------------------------------

    def _fetch(self, stub: storage_pb2_grpc.StorageStub, states: list[_FetchState]) -> float:
        """Fetch and append, pipelined while every partition's answer is clean. Returns
        how long the leader asked not to be fetched from (its last answer's throttle).

        A response whose batches are all valid and start at the log end (checked here,
        before anything is written) tells exactly what the log end and latest epoch will
        be once it is appended. The next Fetch is then sent with those, and the response
        is appended while the leader reads and sends the next one: the leader's half of a
        round (read, serialize, send) overlaps the follower's half (parse, check, write).
        A pipelined answer is only used for a partition whose log end and epoch turned out
        as expected; anything else (a failed append, a truncation, a role change) drops it
        and the loop fetches afresh from the real log end.
        """
        items: list[_Fetched] = []
        for state in states:
            known = state.known
            if known is None:
                try:
                    known = state.known = state.partition.follower_state(state.leader_epoch)
                except TidelogError:
                    self._drop(state)
                    continue
            items.append(_Fetched(state, *known))
        if not items:
            return 0.0
        # The first round is a blocking call: grpc's ``future()`` starts a thread per
        # call whenever none of the channel's calls is in flight, which at moderate rates
        # is every call; only a pipelined round needs a call running in the background.
        plan = self._plan(items)
        response = self._call(stub, plan, items)
        future: _FetchFuture | None = None
        pipelined = False
        try:
            while True:
                self._session.answered(plan, response.session_id)
                # In a session only partitions with something new are answered; the
                # others have nothing to append. Each one's records are read once:
                # every access copies them.
                results = {(r.topic, r.partition): r for r in response.partitions}
                records = {key: result.records for key, result in results.items()}
                following = self._predict(items, results, records)
                if following is not None:
                    self.pipelined_fetches += 1
                    # The next round goes out before this one is written, saying how far
                    # the log is written (``written_offset``): the leader must not count
                    # the rest before the append below has happened.
                    written = [w.offset for w in items]
                    plan = self._plan(following, written)
                    future = self._send(stub, plan, following, written)
                if tracing.ENABLED:
                    tracing.event(
                        "fr_recv",
                        ",".join(
                            f"{i.state.partition.partition}:{i.offset}:{len(records[i.key])}"
                            for i in items
                            if i.key in records
                        ),
                    )
                for item in items:
                    result = results.get(item.key)
                    if result is None:
                        continue
                    if pipelined and not self._still_expected(item):
                        item.state.stale = True  # ends the pipeline: _predict declines
                        continue
                    data = records[item.key]
                    self._handle(item.state, item.offset, result, data)
                    if tracing.ENABLED and data:
                        tracing.event("fr_app", item.state.partition.partition, item.offset)
                if following is None or future is None:
                    return response.throttle_time_ms / 1000
                items, pipelined = following, True
                response = self._receive(future)
                future = None
        finally:
            for item in items:
                item.state.stale = False
            if future is not None:
                future.cancel()  # an exception left a pipelined fetch unanswered

    def _plan(
        self, items: list[_Fetched], written: list[int] | None = None
    ) -> FetchPlan[_Position]:
        """The session's next fetch for ``items`` (``written``: pipelined, see _fetch)."""
        wanted: dict[Key, _Position] = {}
        for index, item in enumerate(items):
            state = item.state
            done = written[index] if written is not None else None
            wanted[item.key] = (
                item.offset,
                item.epoch,
                done if done is not None and done < item.offset else None,
                state.leader_epoch,
                state.partition.topic_id,
            )
        return self._session.plan(wanted)

    def _parts(
        self, plan: FetchPlan[_Position], items: list[_Fetched], written: list[int] | None
    ) -> list[storage_pb2.FetchPartition]:
        """The partitions ``plan`` names, as FetchPartitions."""
        send = set(plan.send)
        return [
            self._fetch_partition(
                item.state,
                item.offset,
                item.epoch,
                written=written[index] if written is not None else None,
            )
            for index, item in enumerate(items)
            if item.key in send
        ]

    @staticmethod
    def _fetch_partition(
        state: _FetchState, offset: int, epoch: int, *, written: int | None = None
    ) -> storage_pb2.FetchPartition:
        part = storage_pb2.FetchPartition(
            topic=state.partition.topic,
            partition=state.partition.partition,
            fetch_offset=offset,
            max_bytes=PARTITION_FETCH_MAX_BYTES,
            current_leader_epoch=state.leader_epoch,
            # The incarnation this replica's log belongs to: a leader holding another one
            # (the topic deleted and created again) answers INCONSISTENT_TOPIC_ID, and
            # nothing is copied until the controller settles which log is a stray.
            topic_id=state.partition.topic_id,
        )
        if epoch >= 0:
            part.last_fetched_epoch = epoch
        if written is not None and written < offset:
            part.written_offset = written
        return part

    def _send(
        self,
        stub: storage_pb2_grpc.StorageStub,
        plan: FetchPlan[_Position],
        items: list[_Fetched],
        written: list[int],
    ) -> _FetchFuture:
        future: _FetchFuture = stub.Fetch.future(
            self._request(plan, self._parts(plan, items, written)),
            timeout=FETCH_MAX_WAIT_MS / 1000 + RPC_SLACK_S,
        )
        return future

    def _request(
        self, plan: FetchPlan[_Position], parts: list[storage_pb2.FetchPartition]
    ) -> storage_pb2.FetchRequest:
        return storage_pb2.FetchRequest(
            replica_id=self.local_broker_id,
            broker_epoch=self._broker_epoch(),
            max_wait_ms=FETCH_MAX_WAIT_MS,
            min_bytes=FETCH_MIN_BYTES,
            max_bytes=FETCH_MAX_BYTES,
            partitions=parts,
            session_id=plan.session_id,
            session_epoch=plan.epoch,
            forgotten=[
                common_pb2.TopicPartition(topic=topic, partition=partition)
                for topic, partition in plan.forgotten
            ],
        )

    def _call(
        self, stub: storage_pb2_grpc.StorageStub, plan: FetchPlan[_Position], items: list[_Fetched]
    ) -> storage_pb2.FetchResponse:
        try:
            response: storage_pb2.FetchResponse = stub.Fetch(
                self._request(plan, self._parts(plan, items, None)),
                timeout=FETCH_MAX_WAIT_MS / 1000 + RPC_SLACK_S,
            )
        except grpc.RpcError as exc:
            self._session.reset()
            raise error_from_rpc_error(exc) from None
        return response

    @staticmethod
    def _receive(future: _FetchFuture) -> storage_pb2.FetchResponse:
        try:
            response: storage_pb2.FetchResponse = future.result()
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from None
        return response

    def _predict(
        self,
        items: list[_Fetched],
        results: dict[Key, storage_pb2.FetchPartitionResult],
        records: dict[Key, bytes],
    ) -> list[_Fetched] | None:
        """Where each partition will be once ``response`` is appended, when that is certain.

        None (fetch again only after appending) when there is nothing to overlap (no
        data, or less than ``PIPELINE_MIN_BYTES``), when membership changed or the thread
        is stopping, when any partition has left the plain fetch state (dropped,
        truncating, backing off, a pipelined answer that no longer fitted), or when any
        partition's answer is an error, a divergence, or batches that would not append
        cleanly: those take the serial path.
        """
        if self._changed.is_set() or self._stopping.is_set():
            return None
        now = time.monotonic()
        following: list[_Fetched] = []
        # Pipelining makes the HW trail by one extra round trip (the pipelined Fetch
        # reports the write only on the round after it). That pays when appending the
        # answer takes about as long as the leader's next read and send; a small answer
        # appends in far less than a round trip, so fetching after it keeps acks=all and
        # consumer latency low at moderate rates and loses no throughput.
        if sum(len(batches) for batches in records.values()) < PIPELINE_MIN_BYTES:
            return None
        data = False
        for item in items:
            state = item.state
            if state.truncating or state.stale or state.delayed_until > now:
                return None
            result = results.get(item.key)
            if result is None:  # not answered (a session's partition with nothing new)
                following.append(item)
                continue
            if int(result.error.code) != ErrorCode.NONE or result.diverging_end_offset >= 0:
                return None
            batches = records[item.key]
            if not batches:
                following.append(item)
                continue
            after = _end_after(batches, item.offset)
            if after is None:
                return None
            following.append(_Fetched(state, after[0], max(item.epoch, after[1])))
            data = True
        if not data:
            return None
        with self._lock:
            for item in following:
                key = (item.state.partition.topic, item.state.partition.partition)
                if self._partitions.get(key) is not item.state:
                    return None
        return following

    def _still_expected(self, item: _Fetched) -> bool:
        """Whether a pipelined fetch's offset and epoch are still the partition's own."""
        state = item.state
        if state.truncating or state.delayed_until > time.monotonic():
            return False
        with self._lock:
            key = (state.partition.topic, state.partition.partition)
            if self._partitions.get(key) is not state:
                return False
        try:
            return state.partition.follower_state(state.leader_epoch) == (item.offset, item.epoch)
        except TidelogError:
            self._drop(state)
            return False

    def _leader_offset(
        self,
        stub: storage_pb2_grpc.StorageStub,
        state: _FetchState,
        spec: common_pb2.OffsetSpec,
    ) -> storage_pb2.ListOffsetsResult:
        """The leader's EARLIEST (log start) or LATEST (log end, asked as a replica)."""
        request = storage_pb2.ListOffsetsRequest(
            replica_id=self.local_broker_id,
            partitions=[
                storage_pb2.ListOffsetsPartition(
                    topic=state.partition.topic,
                    partition=state.partition.partition,
                    spec=spec,
                    current_leader_epoch=state.leader_epoch,
                )
            ],
        )
        try:
            response: storage_pb2.ListOffsetsResponse = stub.ListOffsets(
                request, timeout=RPC_SLACK_S
            )
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from None
        (result,) = response.partitions
        return result

    def _reset_if_behind_log_start(self, state: _FetchState, leo: int) -> None:
        stub = self._stub()
        if stub is None:
            return
        result = self._leader_offset(stub, state, common_pb2.EARLIEST)
        if int(result.error.code) != ErrorCode.NONE:
            return
        if result.offset <= leo:
            self._truncate_if_past_leader_end(stub, state, leo)
            return
        offset = result.offset

        def start_at(epoch: int) -> int:
            state.partition.follower_start_at(epoch, offset)
            return offset

        self._move_log(state, leo, "follower_reset_to_leader_log_start", start_at)

    def _truncate_if_past_leader_end(
        self, stub: storage_pb2_grpc.StorageStub, state: _FetchState, leo: int
    ) -> None:
        """Out of range, and not behind the leader's log start: past its log end. With
        epochs, the reconciliation (``_truncate``) finds where the logs part; a log without
        any (it restarted empty at another leader's log start) truncates to the leader's
        end, as Kafka's fetchOffsetAndTruncate does. It used to ask for the same offset
        every back-off until the leader's log grew past it, and then go on from there
        without the records in between (found by an audit)."""
        result = self._leader_offset(stub, state, common_pb2.LATEST)
        if int(result.error.code) != ErrorCode.NONE or result.offset >= leo:
            return
        offset = result.offset
        self._move_log(
            state,
            leo,
            "follower_truncated_to_leader_end",
            lambda epoch: state.partition.follower_truncate(epoch, offset),
        )

    def _move_log(
        self, state: _FetchState, leo: int, event: str, move: Callable[[int], int]
    ) -> None:
        """Apply ``move`` (given the leader epoch; returns the new log end) and fetch on
        from there, reconciled; a partition no longer followed at that epoch is dropped."""
        try:
            new_end = move(state.leader_epoch)
        except NotLeaderOrFollowerError:
            self._drop(state)
            return
        state.truncating = False
        _log.info(
            event,
            topic=state.partition.topic,
            partition=state.partition.partition,
            from_offset=leo,
            to_offset=new_end,
        )

    def _handle(
        self,
        state: _FetchState,
        leo: int,
        result: storage_pb2.FetchPartitionResult,
        records: bytes,
    ) -> None:
        partition = state.partition
        state.known = None  # unless the append below succeeds
        code = int(result.error.code)
        if code == ErrorCode.NONE and result.diverging_end_offset >= 0:
            # KIP-320: our last epoch ends earlier (or not at all) on the leader; redo the
            # epoch-based reconciliation, which truncates exactly where the logs part.
            _log.debug(
                "fetch_diverging",
                topic=partition.topic,
                partition=partition.partition,
                fetch_offset=leo,
                diverging=(result.diverging_epoch, result.diverging_end_offset),
            )
            state.truncating = True
            return
        if code == ErrorCode.NONE:
            try:
                state.known = partition.follower_append(
                    state.leader_epoch, records, result.high_watermark
                )
            except NotLeaderOrFollowerError:
                self._drop(state)
            except TidelogError as exc:
                # E.g. the batches do not start at our LEO (a concurrent truncation): redo
                # the reconciliation rather than write anything out of place.
                _log.warning(
                    "replica_append_failed",
                    topic=partition.topic,
                    partition=partition.partition,
                    error=str(exc),
                )
                state.truncating = True
                self._delay(state)
            return
        if code == ErrorCode.OFFSET_OUT_OF_RANGE:
            # Our log end is before the leader's log start (retention deleted what we
            # lack: restart there), or past its end (reconcile by epochs again).
            state.truncating = True
            self._reset_if_behind_log_start(state, leo)
        error = error_from_proto(result.error) if result.error.code else None
        _log.debug(
            "replica_fetch_partition_error",
            topic=partition.topic,
            partition=partition.partition,
            error=str(error),
            fetch_offset=leo,
        )
        self._delay(state)


class ReplicaFetcherManager:
    """Which fetcher thread (by source leader) follows which partition.

    Invariants: ``_threads`` holds only threads that follow at least one partition once
    ``add``/``remove`` return: a thread left with none (every partition it followed moved
    to another leader, became led here, or was stopped or deleted) is stopped at once and
    moved to ``_retired`` until ``join_retired`` (or ``shutdown``) joins it, as Kafka's
    ``AbstractFetcherManager.shutdownIdleFetcherThreads`` does. A later ``add`` for that
    leader starts a fresh thread. Without this a broker kept one idle thread per leader
    id it had ever followed (retired and replaced broker ids never come back).

    Thread-safety: every method may be called from any thread. ``_lock`` guards the
    maps; lock order: ``_lock`` before a fetcher thread's own lock (a fetcher thread
    never takes ``_lock``). Stopping a thread never blocks (it sets events and closes the
    channel, which cancels a long-poll in flight); joining does, so ``join_retired``
    joins outside ``_lock``, and callers call it outside their own locks too (the
    thread may be waiting for a partition lock, or for the disk, to finish an append).
    """

    def __init__(
        self, *, local_broker_id: int, broker_epoch: Callable[[], int], resolve: AddressResolver
    ) -> None:
        self.local_broker_id = local_broker_id
        self._broker_epoch = broker_epoch
        self._resolve = resolve
        self._lock = threading.Lock()
        self._threads: dict[int, ReplicaFetcherThread] = {}
        # Stopped for having no partitions left, not joined yet (join_retired).
        self._retired: list[ReplicaFetcherThread] = []
        # pipelined_fetches of the threads already joined, so the total never goes down.
        self._joined_pipelined_fetches = 0
        self._closed = False

    def add(self, partition: Partition, leader: int, leader_epoch: int) -> None:
        """Follow ``partition`` from ``leader`` (re-reconciling from scratch)."""
        key = (partition.topic, partition.partition)
        with self._lock:
            if self._closed:
                return
            for source, other in self._threads.items():
                if source != leader:
                    other.remove(key)
            thread = self._threads.get(leader)
            if thread is None or not thread.is_alive():
                thread = ReplicaFetcherThread(
                    local_broker_id=self.local_broker_id,
                    source_broker_id=leader,
                    broker_epoch=self._broker_epoch,
                    resolve=self._resolve,
                )
                self._threads[leader] = thread
                thread.start()
            thread.add(partition, leader_epoch)
            # The partition may have been the last one another leader's thread followed.
            self._retire_idle_locked()

    def remove(self, key: tuple[str, int]) -> None:
        with self._lock:
            for thread in self._threads.values():
                thread.remove(key)
            self._retire_idle_locked()

    def _retire_idle_locked(self) -> None:
        # _lock held. Only add (under _lock) gives a thread partitions, so a thread found
        # empty here stays empty: it can be stopped without losing anything.
        for source, thread in list(self._threads.items()):
            if thread.is_empty():
                del self._threads[source]
                thread.stop()
                self._retired.append(thread)
                _log.info(
                    "replica_fetcher_retired",
                    broker=self.local_broker_id,
                    source_broker=source,
                )

    def join_retired(self) -> None:
        """Join the fetcher threads stopped for being idle. Call with no lock held that a
        fetcher thread may need (a partition's, or the caller's own state lock)."""
        with self._lock:
            retired = list(self._retired)
        self._join(retired)
        with self._lock:
            # Kept listed while joining, so pipelined_fetches never misses them; a
            # concurrent call may have counted one already.
            for thread in retired:
                if thread in self._retired:
                    self._retired.remove(thread)
                    self._joined_pipelined_fetches += thread.pipelined_fetches

    @staticmethod
    def _join(threads: list[ReplicaFetcherThread]) -> None:
        for thread in threads:
            thread.join(timeout=FETCH_MAX_WAIT_MS / 1000 + RPC_SLACK_S + 1)
            if thread.is_alive():
                # Stopped all the same: it ends after the call it is in (a daemon thread).
                _log.warning("replica_fetcher_join_timeout", source_broker=thread.source_broker_id)

    def fetcher_sources(self) -> list[int]:
        """The leader broker ids a fetcher thread runs for (observability and tests)."""
        with self._lock:
            return sorted(self._threads)

    def pipelined_fetches(self) -> int:
        """Fetches, over every fetcher thread this manager ran, sent before the previous
        answer was appended."""
        with self._lock:
            return (
                self._joined_pipelined_fetches
                + sum(thread.pipelined_fetches for thread in self._threads.values())
                + sum(thread.pipelined_fetches for thread in self._retired)
            )

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads.values())
            self._threads.clear()
            retired, self._retired = self._retired, []
        for thread in threads:
            thread.stop()
        self._join(threads + retired)


__all__ = ["AddressResolver", "ReplicaFetcherManager", "ReplicaFetcherThread"]
