"""Reading through the gateway: Fetch (long-poll over many partitions), Subscribe (follow
one partition), ListOffsets, and the offsets DescribeTopics reports.

Fetch groups the requested partitions by leader and asks every leader at once (one leader:
a blocking call; several: on the ``LeaderCalls`` event loop), passing
the leaders' encoded answers on without parsing them (see ``FetchHandler.fetch``). A leader
long poll answers at once when it has data, so with ``min_bytes`` 1 (the default) one
round of long polls is enough: the fetch answers as soon as any leader has data; the
leaders still waiting are cancelled and their partitions come back without records and
with offsets -1 ("not answered"): a consumer asks again at once and gets their data then.
A consumer therefore never waits on a quiet broker while another has data for it. With a
larger ``min_bytes`` that has to add up across leaders, the gateway first asks every
leader without waiting, and long-polls only if that found too little.

Batches pass through as bytes; the only thing the gateway reads in them is batch headers
(Subscribe needs the offset after the last batch it forwarded), O(1) per batch.

Memory: every answer is held whole until gRPC has sent it, so all fetches together draw on
one ``ByteBudget`` (``--queued-max-fetch-bytes``). A fetch asks the leaders for at most the
room it was granted; with less room than ``FETCH_GRANT_FLOOR_BYTES`` it waits for some,
within its own wait time, and answers "not answered" (no records, offsets -1) if none came:
a consumer then simply fetches again. Once the answer is built, what it did not use of
the grant goes back; the rest when gRPC has sent it (the call ends, or a Subscribe's
client takes the answer), so many consumers slow each other down instead of growing the
gateway past its memory limit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import grpc

from services.gateway.byte_budget import ByteBudget
from services.gateway.leader_calls import LeaderCalls
from services.gateway.metadata_cache import Leader
from services.gateway.router import DEADLINE_MARGIN_S, RETRY_WAIT_S, Router
from services.status import (
    error_code_from_metadata,
    error_from_proto,
    error_from_rpc_error,
    to_error_proto,
)
from tidelog.batch import last_whole_batch
from tidelog.errors import (
    REROUTE_CODES,
    BrokerNotAvailableError,
    ErrorCode,
    InvalidFetchSizeError,
    InvalidRequestError,
    TidelogError,
    UnknownTopicOrPartitionError,
)
from tidelog.formats import MAX_PARTITIONS_PER_REQUEST
from tidelog.v1 import common_pb2, gateway_pb2, storage_pb2

DEFAULT_MAX_WAIT_MS: Final = 500
MAX_WAIT_MS_LIMIT: Final = 30_000
"""Longest wait a fetch is given; a longer max_wait_ms is clamped to it."""
MIN_SUBSCRIBE_POLL_MS: Final = 100
"""Shortest long poll of a Subscribe step (see ``subscribe``)."""
DEFAULT_PARTITION_MAX_BYTES: Final = 1024 * 1024
EMPTY_RESULT_BYTES: Final = 80
"""Upper bound of the encoded size of a partition result without records, beyond its
topic name (varint offsets and epochs, -1s taking 10 bytes each): what a result's size
exceeds this by counts as record bytes for min_bytes. A batch is at least 65 bytes, so
any records count."""
SUBSCRIBE_POLL_SLICE_MS: Final = 1_000
"""Longest single long poll of a Subscribe step (see ``FetchHandler.subscribe``)."""
ANSWER_SLACK_S: Final = 5.0
"""Added to a long poll's own wait to make its gRPC deadline: the leader answers first."""
FETCH_GRANT_FLOOR_BYTES: Final = 256 * 1024
"""The least room a fetch starts with when others hold the fetch budget: a smaller grant
would make answers of a batch or two, more calls for the same bytes."""
FETCH_GRANT_SHARE: Final = 4
"""A fetch takes at most a quarter of the budget's room: a long poll holds its grant while
it waits, so one consumer asking for much must not leave nothing for the next."""
MIN_BUDGET_WAIT_S: Final = 0.1
"""How long a fetch waits for budget room at least, even one asked not to wait
(``max_wait_ms`` 0): answering "not answered" at once would turn a consumer's polls into a
busy loop against a full gateway."""


@dataclass(frozen=True, slots=True)
class FetchLimits:
    # Record bytes in one response (Kafka's fetch.max.bytes).
    max_fetch_bytes: int = 50 * 1024 * 1024
    # Bytes of fetch answers held at once, over every consumer (see the module docstring).
    queued_max_fetch_bytes: int = 256 * 1024 * 1024


Defer = Callable[[Callable[[], None]], bool]
"""Runs a callback when the call ends (``grpc.ServicerContext.add_callback``); False if it
ended already."""

CANCELLABLE_WAIT_MS: Final = 1_000
"""A one-leader Fetch that may wait longer than this runs on the ``LeaderCalls`` loop, where
its client going away cancels it; a shorter one is a blocking call (cheaper: see
``_fetch_granted``) that may outlive its client by its wait at most."""


class _ClientGone:
    """A Fetch's leader calls, cancelled when its client goes away (cancels, or its
    deadline passes): they used to run on for the whole max_wait_ms, each holding a
    gateway thread, its share of the fetch budget and one of the leader's places for
    waiting fetches, so a few consumers that cancelled long polls had every other consumer
    of that leader answered at once with a throttle (found by an audit). Called at the
    end of every call, answered ones too, where cancelling does nothing."""

    def __init__(self) -> None:
        self.gone = False
        self._cancel: Callable[[], object] | None = None

    def on_cancel(self, cancel: Callable[[], object]) -> None:
        self._cancel = cancel
        if self.gone:
            cancel()

    def __call__(self) -> None:
        self.gone = True
        cancel = self._cancel
        if cancel is not None:
            cancel()


def _fetch_error(
    fp: storage_pb2.FetchPartition, error: TidelogError
) -> storage_pb2.FetchPartitionResult:
    result = _result_without_records(fp)
    result.error.CopyFrom(to_error_proto(error))
    return result


def _result_without_records(fp: storage_pb2.FetchPartition) -> storage_pb2.FetchPartitionResult:
    """A result the gateway makes up (no leader's answer): no records, offsets unknown."""
    return storage_pb2.FetchPartitionResult(
        topic=fp.topic,
        partition=fp.partition,
        high_watermark=-1,
        log_start_offset=-1,
        log_end_offset=-1,
        leader_epoch=-1,
        diverging_epoch=-1,
        diverging_end_offset=-1,
    )


class FetchHandler:
    """Fetch, Subscribe, ListOffsets. Thread-safe; a Fetch's calls to several leaders run
    on the ``LeaderCalls`` loop, everything else (a Fetch from one leader included) on the
    caller's thread."""

    def __init__(self, router: Router, limits: FetchLimits, calls: LeaderCalls) -> None:
        self._router = router
        self._calls = calls
        self.limits = limits
        self.budget = ByteBudget(limits.queued_max_fetch_bytes)

    # --- Fetch ----------------------------------------------------------------------------

    def _validate(self, request: storage_pb2.FetchRequest) -> None:
        if request.replica_id != -1:
            raise InvalidRequestError(
                f"replica_id {request.replica_id}: clients fetch with replica_id -1; followers "
                "fetch from storage nodes directly"
            )
        if len(request.partitions) > MAX_PARTITIONS_PER_REQUEST:
            raise InvalidRequestError(
                f"{len(request.partitions)} partitions in one fetch; the limit is "
                f"{MAX_PARTITIONS_PER_REQUEST}"
            )
        if request.HasField("max_bytes") and request.max_bytes <= 0:
            raise InvalidFetchSizeError(f"max_bytes {request.max_bytes} must be positive")
        if request.HasField("max_wait_ms") and request.max_wait_ms < 0:
            raise InvalidRequestError(f"max_wait_ms {request.max_wait_ms} is negative")
        if request.HasField("min_bytes") and request.min_bytes < 0:
            raise InvalidRequestError(f"min_bytes {request.min_bytes} is negative")
        seen: set[tuple[str, int]] = set()
        for fp in request.partitions:
            if (fp.topic, fp.partition) in seen:
                raise InvalidRequestError(
                    f"partition {fp.topic}-{fp.partition} appears twice in one fetch"
                )
            seen.add((fp.topic, fp.partition))
            if fp.HasField("max_bytes") and fp.max_bytes <= 0:
                raise InvalidFetchSizeError(
                    f"max_bytes {fp.max_bytes} of {fp.topic}-{fp.partition} must be positive"
                )
            if fp.fetch_offset < 0:
                raise InvalidRequestError(
                    f"fetch_offset {fp.fetch_offset} of {fp.topic}-{fp.partition} is negative"
                )

    def fetch(
        self,
        request: storage_pb2.FetchRequest,
        time_remaining_s: float | None,
        defer: Defer | None = None,
    ) -> bytes:
        """A client's Fetch, answered as an encoded ``FetchResponse``.

        The leaders' answers are never parsed when they carry data: a ``FetchResponse`` is
        one repeated field, so the encodings of several concatenate into one response
        (results grouped by leader rather than in request order), and the batch bytes
        cross the gateway without a protobuf copy.

        The answer's bytes are held in the fetch budget until ``defer`` runs its callback
        (when gRPC has sent the answer); without ``defer``, until this returns.
        """
        self._validate(request)
        wait_ms = request.max_wait_ms if request.HasField("max_wait_ms") else DEFAULT_MAX_WAIT_MS
        # A longer wait is clamped, not refused, as the storage nodes (and Kafka) do: a
        # client cannot know every gateway's limit.
        wait_ms = min(wait_ms, MAX_WAIT_MS_LIMIT)
        if time_remaining_s is not None:
            wait_ms = max(0, min(wait_ms, int((time_remaining_s - DEADLINE_MARGIN_S) * 1000)))
        # Like Kafka's broker-side fetch.max.bytes, the gateway's limit caps what a client
        # asks for rather than refusing it: a client cannot know every gateway's setting.
        wanted = min(
            request.max_bytes if request.HasField("max_bytes") else self.limits.max_fetch_bytes,
            self.limits.max_fetch_bytes,
            # What the leaders may answer at most (beyond a whole first batch): an idle
            # consumer's long poll then holds only its partitions' worth of the budget.
            sum(
                fp.max_bytes if fp.HasField("max_bytes") else DEFAULT_PARTITION_MAX_BYTES
                for fp in request.partitions
            )
            + EMPTY_RESULT_BYTES * len(request.partitions),
        )
        budget_wait_s = max(wait_ms / 1000, MIN_BUDGET_WAIT_S)
        if time_remaining_s is not None:
            budget_wait_s = min(budget_wait_s, max(0.0, time_remaining_s - DEADLINE_MARGIN_S))
        started_s = time.monotonic()
        granted = self.budget.acquire_up_to(
            max(1, wanted),
            FETCH_GRANT_FLOOR_BYTES,
            started_s + budget_wait_s,
            share=FETCH_GRANT_SHARE,
        )
        client_gone = _ClientGone()
        if granted == 0 or (defer is not None and not defer(client_gone)):
            # Every byte of the budget is another consumer's answer (or the client has gone
            # already): nothing asked, nothing held; the client fetches again (results say
            # "not answered").
            self.budget.release(granted)
            return storage_pb2.FetchResponse(
                partitions=[_result_without_records(fp) for fp in request.partitions]
            ).SerializeToString()
        held = granted
        try:
            # The wait for room came out of the long poll's time.
            waited_ms = int((time.monotonic() - started_s) * 1000)
            # A leader call ends by the client's deadline too (a stopped leader then
            # answers REQUEST_TIMED_OUT per partition, not a bare DEADLINE_EXCEEDED with
            # the gateway working on for 5 s more; found by an audit).
            client_deadline = (
                None
                if time_remaining_s is None
                else started_s + time_remaining_s - DEADLINE_MARGIN_S
            )
            try:
                encoded = self._fetch_granted(
                    request,
                    granted,
                    max(0, wait_ms - waited_ms),
                    client_deadline=client_deadline,
                    client_gone=client_gone,
                )
            except BrokerNotAvailableError:
                if not client_gone.gone:
                    raise
                encoded = b""  # nobody to answer
            # Until gRPC has sent it, only the answer stays held (see ``subscribe``).
            held = self._hold_exactly(granted, len(encoded))
        except BaseException:
            self.budget.release(held)
            raise
        if defer is None or not defer(lambda: self.budget.release(held)):
            self.budget.release(held)
        return encoded

    def _hold_exactly(self, granted_bytes: int, answer_bytes: int) -> int:
        """Make a grant of ``granted_bytes`` the size of its answer: give back what the
        answer did not use, or charge a first batch larger than asked. Returns the bytes
        now held."""
        if answer_bytes > granted_bytes:
            self.budget.take(answer_bytes - granted_bytes)
        elif answer_bytes < granted_bytes:
            self.budget.release(granted_bytes - answer_bytes)
        return answer_bytes

    def _fetch_granted(
        self,
        request: storage_pb2.FetchRequest,
        max_bytes: int,
        wait_ms: int,
        *,
        client_deadline: float | None = None,
        client_gone: _ClientGone | None = None,
    ) -> bytes:
        """``fetch`` once its budget is granted: ``max_bytes`` for the whole answer. Calls
        on the ``LeaderCalls`` loop are cancelled through ``client_gone``."""
        local_errors: list[storage_pb2.FetchPartitionResult] = []
        by_leader: dict[int, tuple[Leader, list[storage_pb2.FetchPartition]]] = {}
        for fp in request.partitions:
            try:
                leader = self._router.cache.leader(fp.topic, fp.partition)
            except TidelogError as exc:
                local_errors.append(_fetch_error(fp, exc))
                continue
            by_leader.setdefault(leader.broker.broker_id, (leader, []))[1].append(fp)
        min_bytes = request.min_bytes if request.HasField("min_bytes") else 1
        answers: dict[int, bytes] = {}
        # The grant bounds the whole answer, so leaders asked together share it (the SDK's
        # consumer asks one leader per fetch, and gets all of it).
        max_bytes = max(1, max_bytes // max(1, len(by_leader)))
        limits: dict[str, Any] = {
            "max_bytes": max_bytes,
            "min_bytes": min_bytes,
            "client_deadline": client_deadline,
        }
        on_cancel = None if client_gone is None else client_gone.on_cancel

        def run(coroutine: Coroutine[Any, Any, tuple[int, bool]]) -> tuple[int, bool]:
            return self._calls.run(coroutine, on_cancel)

        if len(by_leader) == 1 and (
            wait_ms <= CANCELLABLE_WAIT_MS or local_errors or client_gone is None
        ):
            # One leader - every fetch of the SDK's consumer, which groups its partitions
            # by leader: a blocking call from this handler thread. Handing it to the
            # LeaderCalls loop and waiting there cost ~0.25 ms more CPU and ~0.3 ms more
            # latency per call (BENCHMARKS.md, fifth pass); the loop is for fan-outs, and
            # for long polls, which its client going away can cancel there.
            [(leader, partitions)] = by_leader.values()
            answers[leader.broker.broker_id] = self._fetch_one(
                leader, partitions, wait_ms=0 if local_errors else wait_ms, **limits
            )
        elif len(by_leader) == 1:
            # A long poll of one leader, cancellable: the leader waits for min_bytes.
            run(self._round(by_leader, wait_ms=wait_ms, answers=answers, **limits))
        elif local_errors or wait_ms == 0 or min_bytes == 0:
            # A partition that failed here needs its client's attention now: no waiting.
            # min_bytes 0 asks for whatever each partition has now (Kafka's
            # fetch.min.bytes=0): a round with a wait ended on the first leader's answer
            # (0 bytes is enough) and cancelled the others, whose partitions came back
            # "not answered" although they had records (found by an audit).
            run(self._round(by_leader, wait_ms=0, answers=answers, **limits))
        elif min_bytes <= 1:
            # Every leader's long poll answers at once when it has data (or an error), so a
            # first round without waiting would only cost an RPC per leader.
            run(self._round(by_leader, wait_ms=wait_ms, answers=answers, **limits))
        else:
            found, failed = run(self._round(by_leader, wait_ms=0, answers=answers, **limits))
            if found < min_bytes and not failed:
                # min_bytes is for the whole answer: each leader answers as soon as it has
                # anything, and the round ends once their answers add up to min_bytes.
                run(
                    self._round(
                        by_leader,
                        wait_ms=wait_ms,
                        answers=answers,
                        max_bytes=max_bytes,
                        min_bytes=1,
                        enough_bytes=min_bytes,
                        client_deadline=client_deadline,
                    )
                )
        encoded = storage_pb2.FetchResponse(partitions=local_errors).SerializeToString()
        return encoded + b"".join(_within_grant(answers, by_leader, max_bytes))

    def _fetch_one(
        self,
        leader: Leader,
        partitions: list[storage_pb2.FetchPartition],
        *,
        max_bytes: int,
        min_bytes: int,
        wait_ms: int,
        client_deadline: float | None = None,
    ) -> bytes:
        """One leader's encoded answer (a failed call becomes an error per partition)."""
        fetch = self._router.channels.storage_fetch_encoded(leader.broker)
        try:
            encoded: bytes = fetch(
                _leader_request(partitions, max_bytes, min_bytes, wait_ms),
                timeout=_call_timeout_s(wait_ms, client_deadline),
            )
        except grpc.RpcError as exc:
            return _failed_answer(exc, partitions)
        return encoded

    async def _round(
        self,
        by_leader: dict[int, tuple[Leader, list[storage_pb2.FetchPartition]]],
        *,
        max_bytes: int,
        min_bytes: int,
        wait_ms: int,
        answers: dict[int, bytes],
        enough_bytes: int | None = None,
        client_deadline: float | None = None,
    ) -> tuple[int, bool]:
        """One fetch to every leader, run on the ``LeaderCalls`` loop; each leader's
        encoded answer goes into ``answers``. Returns (record bytes found, whether some
        partition failed or diverged).

        With ``wait_ms`` > 0 it returns once the leaders' answers hold ``enough_bytes``
        of records (default ``min_bytes``), or one failed or diverged, or all answered;
        the calls still running are cancelled and their leaders keep the answer
        ``answers`` already held, or get a "not answered" one (no records, offsets -1).

        With ``enough_bytes`` (the client's min_bytes over several leaders), a leader that
        answers short of it while time is left is asked again, to wait for what is still
        missing: its early answer used to end its part of the round, so a fetch whose
        leaders each had a little answered at once whatever min_bytes said, and records
        reaching such a leader later were not seen until max_wait_ms (found by an audit).
        Only a leader that answered with what it was asked for is asked again: one that
        answered short of its own min_bytes said waiting would not help (its reads were cut
        short by max_bytes, it was throttled, or its wait ran out), and asking it again at
        once spun thousands of calls a second until max_wait_ms (found by an audit).
        """
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + wait_ms / 1000
        # Each call: its partitions, its leader, and the min_bytes it asked for.
        calls: dict[asyncio.Future[bytes], tuple[list[storage_pb2.FetchPartition], int, int]] = {}

        def ask(broker_id: int, at_least: int, wait: int) -> None:
            leader, partitions = by_leader[broker_id]
            call = self._calls.fetch_encoded(leader.broker)(
                _leader_request(partitions, max_bytes, at_least, wait),
                timeout=_call_timeout_s(wait, client_deadline),
            )
            calls[asyncio.ensure_future(call)] = (partitions, broker_id, at_least)

        for broker_id in by_leader:
            ask(broker_id, min_bytes, wait_ms)
        target = min_bytes if enough_bytes is None else enough_bytes
        found = 0
        failed = False
        held: dict[int, int] = {}  # record bytes of each leader's answer in ``answers``
        pending: set[asyncio.Future[bytes]] = set(calls)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                short: list[int] = []
                for call_done in done:
                    partitions, broker_id, asked = calls[call_done]
                    encoded, data, error = _leader_answer(call_done, partitions)
                    answers[broker_id] = encoded
                    found += data - held.get(broker_id, 0)
                    held[broker_id] = data
                    failed = failed or error
                    if not error and asked <= data < max_bytes:
                        short.append(broker_id)
                # A leader's error (or divergence) needs its client's attention now, as
                # Kafka's delayed fetch completes on either: no waiting for the quiet others.
                if wait_ms > 0 and (failed or found >= target):
                    break
                left_ms = int((ends_at - loop.time()) * 1000)
                if enough_bytes is not None and left_ms > 0:
                    before = set(calls)
                    for broker_id in short:
                        ask(broker_id, max(1, target - (found - held[broker_id])), left_ms)
                    pending |= set(calls) - before
        finally:
            for call_pending in pending:
                call_pending.cancel()
                partitions, broker_id, _ = calls[call_pending]
                if broker_id not in answers:
                    answers[broker_id] = storage_pb2.FetchResponse(
                        partitions=[_result_without_records(fp) for fp in partitions]
                    ).SerializeToString()
        return found, failed

    # --- Subscribe ------------------------------------------------------------------------

    def subscribe(
        self, request: gateway_pb2.SubscribeRequest, context: grpc.ServicerContext
    ) -> Iterator[storage_pb2.FetchPartitionResult]:
        max_bytes = (
            request.max_bytes if request.HasField("max_bytes") else DEFAULT_PARTITION_MAX_BYTES
        )
        if max_bytes <= 0:
            raise InvalidFetchSizeError(f"max_bytes {max_bytes} must be positive")
        # Capped by the gateway's limit, not refused, as Fetch does (a client cannot know
        # every gateway's setting): a max_bytes above it was refused, even the default a
        # client did not set, on a gateway whose --max-fetch-bytes is under 1 MiB (found
        # by an audit).
        max_bytes = min(max_bytes, self.limits.max_fetch_bytes)
        wait_ms = request.max_wait_ms if request.HasField("max_wait_ms") else DEFAULT_MAX_WAIT_MS
        if wait_ms < 0:
            raise InvalidRequestError(f"max_wait_ms {wait_ms} is negative")
        # The incarnation and the epoch of what was forwarded go with every step: a topic
        # deleted and created again (while a slow reader held the stream) went on from the
        # old offset in the new topic, and an unclean election's new leader was read on
        # from past its log's divergence, skipping its records (found by an audit).
        topic_id = self._router.cache.read(
            lambda view: view.check_partition(request.topic, request.partition).topic_id
        )
        offset = self._start_offset(request)
        last_epoch: int | None = None
        # Each long poll to the leader lasts at most SUBSCRIBE_POLL_SLICE_MS, so a
        # subscription whose client went away gives back its thread (and its place under
        # the gateway's max_concurrent_rpcs) within that, not after a whole max_wait_ms.
        # At least MIN_SUBSCRIBE_POLL_MS: a stream has nothing to return to, so a step that
        # did not wait (max_wait_ms 0) would only send the leader the next call at once,
        # spinning a gateway thread for as long as the subscription lasts.
        poll_ms = max(MIN_SUBSCRIBE_POLL_MS, min(wait_ms, SUBSCRIBE_POLL_SLICE_MS))
        while context.is_active():
            # Each step's answer draws on the fetch budget like a Fetch's, until gRPC has
            # taken it (the generator resumes after the yield).
            granted = self.budget.acquire_up_to(
                max_bytes + EMPTY_RESULT_BYTES,
                FETCH_GRANT_FLOOR_BYTES,
                time.monotonic() + max(poll_ms / 1000, MIN_BUDGET_WAIT_S),
                share=FETCH_GRANT_SHARE,
            )
            if granted == 0:
                continue  # no room within a poll's time: as if the poll found nothing
            try:
                answer = self._subscribe_step(
                    request, offset, granted, poll_ms, topic_id=topic_id, last_epoch=last_epoch
                )
                if answer is None:
                    continue
                # Only the answer stays held while it waits in gRPC (a client that does not
                # read stops the stream at the yield, perhaps for good): the rest of the
                # grant goes back now. Four unread subscriptions holding their whole
                # grants took a 1 MiB budget and starved every Fetch (found by an audit).
                granted = self._hold_exactly(granted, answer.ByteSize())
                if answer.diverging_end_offset >= 0:
                    # The leader's epoch there is the one to name from now on (naming the
                    # old one, the next step would diverge again).
                    last_epoch = answer.diverging_epoch
                    if answer.diverging_end_offset >= offset:
                        # It ends at or past the offset reached: as far as the leader's
                        # epochs tell, nothing forwarded is gone, and the offset stays, as
                        # Kafka's consumer and the SDK's (``_on_truncation``) keep their
                        # position, with nothing for the client to act on. Jumping to its
                        # end skipped the leader's records in between (found by an audit).
                        continue
                    # The leader's log parts from what was forwarded there (an unclean
                    # election): go on from where they agree, as Kafka's consumer resets
                    # to the divergence; the client is told by this answer (no records).
                    offset = answer.diverging_end_offset
                else:
                    last = last_whole_batch(answer.records)
                    if last is not None:
                        offset, last_epoch = last.next_offset, last.partition_leader_epoch
                yield answer
            finally:
                self.budget.release(granted)

    def _subscribe_step(
        self,
        request: gateway_pb2.SubscribeRequest,
        offset: int,
        max_bytes: int,
        poll_ms: int,
        *,
        topic_id: str,
        last_epoch: int | None,
    ) -> storage_pb2.FetchPartitionResult | None:
        """One long poll of a Subscribe from ``offset`` of incarnation ``topic_id``, whose
        batch before it had ``last_epoch``: the leader's answer if it has records or
        reports a divergence, else None."""
        fetch_partition = storage_pb2.FetchPartition(
            topic=request.topic,
            partition=request.partition,
            fetch_offset=offset,
            max_bytes=max_bytes,
            topic_id=topic_id,
        )
        if last_epoch is not None:
            fetch_partition.last_fetched_epoch = last_epoch

        def call(
            stub: Any,
            leader: Leader,
            timeout_s: float,
            fetch_partition: storage_pb2.FetchPartition = fetch_partition,
        ) -> storage_pb2.FetchResponse:
            try:
                response: storage_pb2.FetchResponse = stub.Fetch(
                    storage_pb2.FetchRequest(
                        replica_id=-1,
                        max_wait_ms=poll_ms,
                        min_bytes=1,
                        max_bytes=max_bytes,
                        partitions=[fetch_partition],
                    ),
                    timeout=min(timeout_s, poll_ms / 1000 + ANSWER_SLACK_S),
                )
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or error_code_from_metadata(
                    exc.trailing_metadata()
                ):
                    raise
                # The leader did not answer its long poll (stopped, or cut off): ask again,
                # the new leader if the metadata names one meanwhile, within the step's
                # deadline. Ending the subscription here used to look to the client like
                # its own deadline.
                raise BrokerNotAvailableError(
                    f"broker {leader.broker.broker_id} did not answer a long poll of "
                    f"{request.topic}-{request.partition}"
                ) from None
            error = response.partitions[0].error
            if error.code != common_pb2.NONE:
                # Raised so the router re-routes leadership errors; others end the stream.
                raise error_from_proto(error) or InvalidRequestError(error.message)
            return response

        # A subscription outlives leader changes: each step may take as long as a new
        # election needs.
        deadline = time.monotonic() + 30.0
        result = self._router.call_leader(request.topic, request.partition, deadline, call)
        answer: storage_pb2.FetchPartitionResult = result.partitions[0]
        if answer.records or answer.diverging_end_offset >= 0:
            return answer
        if result.throttle_time_ms > 0:
            # The leader could not hold the poll waiting: wait here what it would have,
            # or the next step would ask it again at once, spinning this thread.
            time.sleep(min(result.throttle_time_ms, poll_ms) / 1000)
        return None

    def _start_offset(self, request: gateway_pb2.SubscribeRequest) -> int:
        spec = request.start_spec
        if spec == common_pb2.OFFSET_SPEC_UNSPECIFIED:
            if request.start_offset < 0:
                raise InvalidRequestError(
                    f"start_offset {request.start_offset} is negative; use start_spec "
                    "EARLIEST or LATEST"
                )
            return request.start_offset
        if spec not in (common_pb2.EARLIEST, common_pb2.LATEST, common_pb2.BY_TIMESTAMP):
            raise InvalidRequestError(f"start_spec {spec} must be EARLIEST, LATEST or BY_TIMESTAMP")
        answer = self._resolve(request, spec, request.start_timestamp_ms)
        if answer < 0:
            # No record at or after the timestamp: follow from the end, as Kafka does. Its
            # error is raised too: unchecked, a failed look-up (e.g. right after a leader
            # change) started the subscription at offset 0, replaying the whole partition
            # (found by an audit).
            answer = self._resolve(request, common_pb2.LATEST, -1)
        return max(answer, 0)

    def _resolve(
        self,
        request: gateway_pb2.SubscribeRequest,
        spec: common_pb2.OffsetSpec,
        timestamp_ms: int,
    ) -> int:
        """``spec`` of the subscribed partition, as its leader answers; raises its error."""
        item = storage_pb2.ListOffsetsPartition(
            topic=request.topic,
            partition=request.partition,
            spec=spec,
            timestamp_ms=timestamp_ms,
        )
        response = self.list_offsets(
            storage_pb2.ListOffsetsRequest(replica_id=-1, partitions=[item])
        )
        answer = response.partitions[0]
        if answer.error.code != common_pb2.NONE:
            raise error_from_proto(answer.error) or InvalidRequestError(answer.error.message)
        return int(answer.offset)

    # --- ListOffsets ----------------------------------------------------------------------

    def list_offsets(
        self, request: storage_pb2.ListOffsetsRequest, timeout_s: float = 10.0
    ) -> storage_pb2.ListOffsetsResponse:
        """Forward to each leader; answers in request order, errors per partition.

        A partition whose leader moved (or has none yet, or has not heard of its role) is
        asked again until the deadline, together with every other such partition: in
        passes, each asking the leaders the metadata names then, with a short wait for the
        metadata to change between them. They used to be asked again one after another,
        each waiting for a leader up to the shared deadline, so one offline partition took
        all of it and those after it were answered REQUEST_TIMED_OUT without being asked
        again, although they had a leader within seconds (found by an audit).
        """
        if len(request.partitions) > MAX_PARTITIONS_PER_REQUEST:
            raise InvalidRequestError(
                f"{len(request.partitions)} partitions in one request; the limit is "
                f"{MAX_PARTITIONS_PER_REQUEST}"
            )
        # One deadline for every pass (the second used to get a whole timeout of its own
        # after the first, so a stopped leader cost twice the timeout).
        deadline = time.monotonic() + timeout_s
        cache = self._router.cache
        version = cache.version
        results, final = self._offsets_pass(request.replica_id, request.partitions, timeout_s)
        # A partition the client named an epoch for is the client's to re-route.
        pinned = {
            i for i, lp in enumerate(request.partitions) if lp.HasField("current_leader_epoch")
        }
        while True:
            again = [
                i
                for i, result in enumerate(results)
                if i not in final
                and i not in pinned
                and ErrorCode(int(result.error.code)) in REROUTE_CODES
            ]
            remaining_s = deadline - time.monotonic()
            if not again or cache.stopped or remaining_s <= DEADLINE_MARGIN_S:
                # Past the deadline a partition keeps its last error, as the router's
                # calls raise theirs.
                break
            cache.wait_for_change(version, min(RETRY_WAIT_S, remaining_s - DEADLINE_MARGIN_S))
            remaining_s = deadline - time.monotonic()
            if remaining_s <= DEADLINE_MARGIN_S:
                break
            version = cache.version
            answers, final_now = self._offsets_pass(
                request.replica_id, [request.partitions[i] for i in again], remaining_s
            )
            for place, (i, answer) in enumerate(zip(again, answers, strict=True)):
                results[i] = answer
                if place in final_now:
                    final.add(i)
        return storage_pb2.ListOffsetsResponse(partitions=results)

    def offsets_by_leader(
        self,
        replica_id: int,
        partitions: Sequence[storage_pb2.ListOffsetsPartition],
        timeout_s: float,
        *,
        leader_as_replica: bool = False,
    ) -> list[storage_pb2.ListOffsetsResult]:
        """ListOffsets on every leader concurrently; one answer per item, in order (a
        partition asked twice, e.g. by two timestamps, gets an answer for each: keyed by
        partition and spec, the later one answered both).

        ``leader_as_replica`` asks as the leader itself, which answers LATEST with the log
        end offset instead of the high watermark (for DescribeTopics).
        """
        results, _ = self._offsets_pass(
            replica_id, partitions, timeout_s, leader_as_replica=leader_as_replica
        )
        return results

    def _offsets_pass(
        self,
        replica_id: int,
        partitions: Sequence[storage_pb2.ListOffsetsPartition],
        timeout_s: float,
        *,
        leader_as_replica: bool = False,
    ) -> tuple[list[storage_pb2.ListOffsetsResult], set[int]]:
        """``offsets_by_leader``, and the places of the items the metadata itself answers
        (the topic or partition does not exist): final, however their code reads.

        A leader's items go in calls of at most ``MAX_PARTITIONS_PER_REQUEST``, all at
        once: in one call, more than a storage node takes in a request (DescribeTopics
        asks two items a partition, so a leader of more than 5,000 described partitions)
        failed every offset of that leader with INVALID_REQUEST (found by an audit).
        """
        results: list[storage_pb2.ListOffsetsResult | None] = [None] * len(partitions)
        final: set[int] = set()
        # Per leader broker: the items' places and, for each, the epoch its own leader has.
        groups: dict[int, tuple[Leader, list[tuple[int, int]]]] = {}
        for i, lp in enumerate(partitions):
            try:
                leader = self._router.cache.leader(lp.topic, lp.partition)
            except UnknownTopicOrPartitionError as exc:
                results[i] = _offset_error(lp, exc)
                final.add(i)
                continue
            except TidelogError as exc:
                results[i] = _offset_error(lp, exc)
                continue
            epoch = (
                lp.current_leader_epoch
                if lp.HasField("current_leader_epoch")
                else leader.leader_epoch
            )
            groups.setdefault(leader.broker.broker_id, (leader, []))[1].append((i, epoch))
        calls = []
        for broker_id, (leader, all_pairs) in groups.items():
            stub = self._router.channels.storage(leader.broker)
            for start in range(0, len(all_pairs), MAX_PARTITIONS_PER_REQUEST):
                pairs = all_pairs[start : start + MAX_PARTITIONS_PER_REQUEST]
                asked = [
                    storage_pb2.ListOffsetsPartition(
                        topic=partitions[i].topic,
                        partition=partitions[i].partition,
                        spec=partitions[i].spec,
                        timestamp_ms=partitions[i].timestamp_ms,
                        current_leader_epoch=epoch,
                    )
                    for i, epoch in pairs
                ]
                calls.append(
                    (
                        stub.ListOffsets.future(
                            storage_pb2.ListOffsetsRequest(
                                replica_id=broker_id if leader_as_replica else replica_id,
                                partitions=asked,
                            ),
                            timeout=timeout_s,
                        ),
                        [i for i, _ in pairs],
                    )
                )
        for future, places in calls:
            try:
                response: storage_pb2.ListOffsetsResponse = future.result()
            except grpc.RpcError as exc:
                error = error_from_rpc_error(exc)
                for i in places:
                    results[i] = _offset_error(partitions[i], error)
                continue
            for i, answer in zip(places, response.partitions, strict=True):
                results[i] = answer
        answered = [r for r in results if r is not None]
        assert len(answered) == len(results)  # every item is an error or in a group answered
        return answered, final


def _offset_error(
    lp: storage_pb2.ListOffsetsPartition, error: TidelogError
) -> storage_pb2.ListOffsetsResult:
    return storage_pb2.ListOffsetsResult(
        topic=lp.topic,
        partition=lp.partition,
        error=to_error_proto(error),
        offset=-1,
        timestamp_ms=-1,
        leader_epoch=-1,
    )


def _needs_attention(results: Iterable[storage_pb2.FetchPartitionResult]) -> bool:
    """Whether a partition has an error or a divergence (KIP-320). Like a storage node
    (and Kafka's delayed fetch), a fetch then answers at once, so the client can act on it
    (re-route, reset its offset) instead of waiting for nothing: neither changes by
    waiting. A divergence used to count as an empty answer, so a fetch across leaders
    waited out max_wait_ms for the quiet others (found by an audit)."""
    return any(r.error.code != common_pb2.NONE or r.diverging_end_offset >= 0 for r in results)


def _call_timeout_s(wait_ms: int, client_deadline: float | None) -> float:
    """A leader call's gRPC timeout: its long poll's wait and ``ANSWER_SLACK_S``, but never
    past the client's own deadline (monotonic; None: the client set none)."""
    timeout_s = wait_ms / 1000 + ANSWER_SLACK_S
    if client_deadline is not None:
        timeout_s = min(timeout_s, client_deadline - time.monotonic())
    return max(0.001, timeout_s)


def _leader_request(
    partitions: list[storage_pb2.FetchPartition], max_bytes: int, min_bytes: int, wait_ms: int
) -> storage_pb2.FetchRequest:
    """What the gateway asks one leader for on a client's behalf (a consumer's fetch)."""
    return storage_pb2.FetchRequest(
        replica_id=-1,
        max_wait_ms=wait_ms,
        min_bytes=min_bytes,
        max_bytes=max_bytes,
        partitions=partitions,
    )


def _within_grant(
    answers: dict[int, bytes],
    by_leader: dict[int, tuple[Leader, list[storage_pb2.FetchPartition]]],
    share_bytes: int,
) -> list[bytes]:
    """The leaders' answers a fetch sends, in the order they came, at most one of them
    larger than its leader's share of the grant; a later such answer is left for the
    next fetch (its partitions "not answered"), as a leader leaves out partitions its
    max_bytes has no room for. Each leader answers its first batch whole even beyond its
    share, so joined, several leaders' large first batches passed the gateway's send
    limit: the fetch failed RESOURCE_EXHAUSTED every time and its consumer was stuck
    (found by an audit). Answers within their share always go."""
    sent: list[bytes] = []
    oversized = False
    for broker_id, answer in answers.items():
        _, partitions = by_leader[broker_id]
        framing = sum(EMPTY_RESULT_BYTES + 8 + len(fp.topic) for fp in partitions)
        if len(answer) > share_bytes + framing:
            if oversized:
                sent.append(
                    storage_pb2.FetchResponse(
                        partitions=[_result_without_records(fp) for fp in partitions]
                    ).SerializeToString()
                )
                continue
            oversized = True
        sent.append(answer)
    return sent


def _failed_answer(exc: grpc.RpcError, partitions: list[storage_pb2.FetchPartition]) -> bytes:
    """The encoded answer for a leader call that failed: its error for every partition."""
    error = error_from_rpc_error(exc)
    return storage_pb2.FetchResponse(
        partitions=[_fetch_error(fp, error) for fp in partitions]
    ).SerializeToString()


def _leader_answer(
    call: asyncio.Future[bytes], partitions: list[storage_pb2.FetchPartition]
) -> tuple[bytes, int, bool]:
    """(encoded answer, record bytes in it, whether a partition failed or diverged) of a
    finished leader fetch; a failed call becomes an encoded error result per partition."""
    try:
        encoded = call.result()
    except grpc.RpcError as exc:
        return _failed_answer(exc, partitions), 0, True
    # Results without records are small: only then parse, to see errors and to count a
    # few bytes of records exactly (taking them for none made a fetch across leaders
    # wait out max_wait_ms with a small record in hand).
    overhead = sum(EMPTY_RESULT_BYTES + 8 + len(fp.topic) for fp in partitions)
    if len(encoded) > overhead:
        return encoded, len(encoded) - overhead, False
    response = storage_pb2.FetchResponse.FromString(encoded)
    records = sum(len(result.records) for result in response.partitions)
    return encoded, records, _needs_attention(response.partitions)
