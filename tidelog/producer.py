"""``tidelog.Producer``: batch records per partition and send them through a gateway (or,
in direct mode, to the partition leaders).

Pieces (Kafka's producer, reduced to what a gateway client needs):

* **Accumulator** - per partition, a queue of ``_Batch``es. ``send`` appends a record to
  the partition's open batch; a batch closes when it reaches ``batch_bytes`` or has waited
  ``linger_ms`` - but not while its partition has a request in flight (or waits to retry):
  records keep joining it until the partition may send. ``send_batch`` cuts its values
  straight into closed batches.
* **Partitioner** - an explicit partition wins; else a key is hashed with Kafka's murmur2
  (``tidelog.partitioner``), so a key lands where Kafka would put it; records without a key
  stick to one partition until ``batch_bytes`` went there, counted across batches, then
  move to another (Kafka's uniform sticky partitioner, KIP-794: with small batches, as at
  linger 0, counting per batch would never move).
* **Sender** - one background thread drains ready batches into ProduceRequests (several
  partitions each, several batches per partition) on one ProduceStream, with up to
  ``max_in_flight_requests`` requests unanswered; a reader thread matches answers by
  correlation id and completes futures. A stream that ends (the gateway died) or stays
  silent past ``request_timeout_ms`` with a request unanswered (a stopped gateway, a
  black-holed network: ``STREAM_ANSWER_GRACE_S``) hands its requests back for a retry on
  a new stream.
* **Direct mode** (``direct=True``) - the sender sends each partition's batches in an
  ``Append`` to the partition's leader itself, as Kafka's producer does, instead of through
  the gateway (``tidelog.leaders``: the gateway still gives metadata and producer ids).
  The appends one pass of the sender makes to one leader count as one request against
  that leader's ``max_in_flight_requests``, as they would be one produce request on one
  connection in Kafka (counted one by one, a thousand partitions' acks=all appends went
  16 at a time; counted for all leaders together, a stopped broker's took every place and
  the healthy leaders' partitions waited for its timeout). Those of
  partitions with nothing else in flight, ``GROUP_MIN_PARTITIONS`` or more, go in one
  ``AppendMany`` call, answered per partition.
  An answer that says the leader moved, or a broker that cannot be reached, makes the
  batches retry after a metadata refresh, exactly as a gateway's retriable answer does.
* **Pipes** (direct mode) - requests go to a leader on one ``AppendStream`` per broker
  (``_Pipe``), which the leader appends in arrival order and answers in order. That order
  is what lets a partition keep up to ``max_in_flight_requests_per_partition`` requests
  in flight (Kafka's ``max.in.flight.requests.per.connection``, 5): a batch need not wait
  for the previous one's acknowledgement. A broker that refuses another stream (its
  ``max_append_streams``) gets unary ``Append`` calls instead, one request per partition
  in flight, for ``PIPE_REFUSED_BACKOFF_S``. A pipe whose oldest request goes unanswered
  past ``request_timeout_ms`` (and ``STREAM_ANSWER_GRACE_S``) is cancelled; one with
  nothing in flight for ``connections_max_idle_ms`` (Kafka's name and default, 9 min) is
  closed, so an idle producer does not hold one of the broker's streams.

Partition counts: a topic's count is looked up on first use and again once older than
``metadata_max_age_ms`` (Kafka's name and default, 5 min) or after an
UNKNOWN_TOPIC_OR_PARTITION answer, so keys and the sticky partition spread over
partitions added since (a key's partition changes with the count, as in Kafka).

Ordering and idempotence: a batch is encoded - given its producer id and sequence - only
when it is first sent, from the head of its partition's queue, so sequences follow send
order; each batch also has an ``ordinal``, its place in the partition's queue. A failed
request is retried with the same bytes (same sequence) until ``delivery_timeout_ms``; the
leader recognises a batch it already wrote and answers with the original offsets, so
retries neither duplicate nor reorder (``enable_idempotence``, the default).

Delivery timeout: ``delivery_timeout_ms`` counts from a batch's entry into the accumulator
(opened by ``send``, queued by ``send_batch``). A batch still queued or open by then -
behind requests that go unanswered, or waiting to be retried - fails without being sent
(Kafka's ``RecordAccumulator.expiredBatches``), with ``RequestTimedOutError``, or the
error of its last request if it waits to be retried: it is not sent late only to fail a
request timeout later. A batch in flight then fails once its request does
(``request_timeout_ms`` later at most, and a grace for a hung stream or pipe), and is not
retried. Batches expire in their partition's order; one never sent has no sequence number
yet, so its failure leaves no gap for the batches after it.

With several requests of a partition in flight, a failure is handled as Kafka does:

* the partition sends nothing more until every request it has in flight is answered
  (``blocked``); failed batches go back into the queue in ordinal order, and are resent
  request by request as first sent (a retry of a whole request is answered from the
  leader's memory of its last ``MAX_BATCHES_IN_FLIGHT_PER_PARTITION`` batches, so an
  idempotent producer never has more batches of a partition in flight than that);
* a request refused with OUT_OF_ORDER_SEQUENCE while an earlier batch of its partition is
  still unfinished was refused because that one was not written: it is retried after it;
* when a batch fails for good after having been sent, the producer takes a new producer
  id, since the old id's sequence state is then unknown; later batches that the leader
  refused as out of order (so nothing of them was written) are encoded again under it.

Without idempotence (acks 0 or 1) there are no sequences: as with Kafka, a retried
request may then land after a later one of its partition that succeeded first, when more
than one was in flight; ``max_in_flight_requests_per_partition=1`` keeps order there.

``metrics()`` reports Kafka's producer metrics (``tidelog.metrics``): ``batch-size-avg``
and ``-max`` (bytes of a record batch when first sent), ``records-per-request-avg`` and
``-max``, ``request-latency-avg`` and ``-max`` (ms from a request's queueing on the stream
to its answer), ``request-total``, ``record-send-total`` (records sent for the first time),
``record-retry-total`` and ``record-error-total``.

``buffer_bytes`` bounds the bytes waiting in the producer; ``send`` blocks up to
``max_block_ms`` for room, and so does ``send_batch`` for its first batch (raising with
nothing queued). A ``send_batch`` larger than the room then waits for the rest as long as
it takes: it never raises with part of its records queued. The first ``send`` to a topic
(and ``partitions_for``) looks its partition count up, waiting up to ``max_block_ms`` while
the gateway is unreachable (``RequestTimedOutError`` after); an unknown topic raises
``UnknownTopicOrPartitionError`` at once. Futures are ``concurrent.futures.Future``.

Thread-safety: ``send``/``send_batch``/``flush`` may be called from many threads.
``flush()`` waits for the records sent before it was called, not for those other threads
send meanwhile (Kafka's rule; waiting for "nothing unfinished" never ended under steady
load). ``close(timeout_s)`` first stops accepting sends (later ones raise ``ConfigError``),
then waits up to ``timeout_s`` for what was queued; when that runs out it closes
forcefully, as Kafka's ``close(Duration)``: every record not completed fails at once
(``RequestTimedOutError``, "the producer was closed before ..."), nothing more is sent,
and close returns (without raising) with every future done. Futures' done-callbacks run
on the producer's threads: there ``flush()`` raises ``ConfigError`` (it would wait for its
own thread, as Kafka refuses too) and ``close()`` stops accepting sends and returns at once
without waiting (Kafka closes with no wait there too), while what was queued is still sent
and a ``close()`` elsewhere waits for it. A future cancelled by its
caller (``asyncio.wait_for`` on a timeout cancels it) only loses its result; the record
is still sent. A producer not closed before the interpreter exits does not send what is
queued (its threads are daemons, as Java Kafka's); it logs a warning naming how many
batches were left.

Fork: a producer belongs to the process that made it (its threads and gRPC channels do not
exist in a child). In a child made by ``os.fork()``, ``send``, ``send_batch``, ``flush``
and ``partitions_for`` raise ``ConfigError`` at once (``tidelog.client.check_same_process``)
rather than wait for ever on threads that exist only in the parent, and ``close()`` marks
the child's copy closed without touching the parent's threads; make a producer after
forking (``multiprocessing``'s fork start method, Spark's Python workers). Kafka's clients
are not fork-safe either.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import operator
import queue
import random
import threading
import time
import weakref
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any, Final, TypeVar, cast, overload

import grpc

from tidelog import tracing
from tidelog.client import GatewayConnection, check_same_process, current_pid, error_from_rpc
from tidelog.errors import (
    BrokerNotAvailableError,
    ConfigError,
    DuplicateSequenceError,
    InconsistentTopicIdError,
    LeaderNotAvailableError,
    MessageTooLargeError,
    NetworkError,
    OutOfOrderSequenceError,
    RecordListTooLargeError,
    RequestTimedOutError,
    TidelogError,
    UnknownServerError,
    UnknownTopicOrPartitionError,
    error_for_code,
)
from tidelog.formats import INT32_MAX
from tidelog.leaders import Leader, LeaderDirectory, directory_for
from tidelog.metrics import ClientMetrics
from tidelog.partitioner import murmur2_partitions, partition_for_key
from tidelog.records import (
    RECORD_OVERHEAD_BYTES,
    Header,
    arrow_record_bytes,
    batch_cuts,
    batch_overhead_bytes,
    check_headers,
    encode_batch,
    encode_batch_arrow_parts,
    record_bytes,
)
from tidelog.v1 import common_pb2, gateway_pb2, storage_pb2
from tidelog.wire import (
    append_request_parts,
    encode_append_many_request,
    encode_produce_request,
)

_log = logging.getLogger(__name__)

ACKS: Final = {
    "all": common_pb2.ALL,
    "-1": common_pb2.ALL,
    "1": common_pb2.LEADER,
    "0": common_pb2.NONE_ACKS,
}
MAX_REQUEST_BYTES: Final = 8 * 1024 * 1024
"""Record bytes per ProduceRequest: big enough to amortise a round trip, far below the
gateway's limit."""
MAX_PARTITION_REQUEST_BYTES: Final = 4 * 1024 * 1024
"""Record bytes of one partition in one request (several batches)."""
RETRY_BACKOFF_S: Final = 0.1
METADATA_RETRY_S: Final = 1.0
"""After a failed refresh of a known partition count, how long until the next try."""
MAX_BATCHES_IN_FLIGHT_PER_PARTITION: Final = 5
"""An idempotent producer's batches of one partition unanswered at once (all requests in
flight together), which also bounds the batches of one request: the leader remembers a
producer's last five batches (``PRODUCER_BATCHES_RETAINED``), and a retried request is
answered with its original offsets only while every batch of it is among them."""
PIPE_REFUSED_BACKOFF_S: Final = 30.0
"""Direct mode: how long a broker that refused an AppendStream (it has
``max_append_streams`` open) gets unary appends before the producer asks again."""
GROUP_MIN_PARTITIONS: Final = 4
"""Direct mode: partitions of one leader, ready in one pass of the sender and with no
other request in flight, that go in one ``AppendMany`` call instead of an ``Append``
each (as the gateway's ``--produce-group-min-partitions``). A group is answered once its
slowest partition is, and its partitions send nothing more until then: with two or
three per leader that costs the tail more than the calls it saves (BENCHMARKS.md, "Scale:
where the time goes", item 5)."""
GROUP_MAX_PARTITIONS: Final = 1_000
"""Direct mode: partitions in one ``AppendMany`` at most; more go in several. Far below a
broker's ``max_partitions_per_request`` (10,000), which refuses a larger call whole."""
LEADER_WAIT_MARGIN_MS: Final = 100
"""Direct mode: an acks=all append asks the leader to wait this much less than the call's
deadline, so the leader's precise REQUEST_TIMED_OUT arrives rather than a bare deadline."""
STREAM_ANSWER_GRACE_S: Final = 1.0
"""Gateway mode: a produce stream whose oldest request went unanswered this long past
``request_timeout_ms`` (which the gateway is given as its own deadline, so it answers
REQUEST_TIMED_OUT by then if it can), and that answered nothing else for as long, means a
gateway hung or unreachable without the connection failing (a stopped process, a
black-holed network): the stream is cancelled and its requests are retried on a new one,
as Kafka's client closes a connection on ``request.timeout.ms``. A gateway that still
answers is left alone even when one answer is late (a busy machine during a failover):
cancelling strands every partition's request in flight, and their retries race the
originals the gateway is still carrying."""
CLOSE_FORCE_MARGIN_S: Final = 1.0
"""How long ``close(timeout_s)`` waits beyond ``timeout_s``, once it failed what was left, for
the producer's threads: one completing a future at that moment, and the sender ending (a
sender inside a blocking call, an InitProducerId or a metadata look-up, ends when the call
does, sending nothing more: close returns without it)."""
_STOP: Final = object()
_T = TypeVar("_T")
_ZERO_I32: Final = array("i", [0])
_ZERO_I64: Final = array("q", [0])


def _until_stop(requests: queue.SimpleQueue[Any]) -> Iterator[bytes]:
    """A stream call's requests: what is put on ``requests``, until ``_STOP``."""
    while (item := requests.get()) is not _STOP:
        yield item


@dataclass(frozen=True, slots=True)
class RecordMetadata:
    """Where a record was written. ``offset`` is -1 for acks=0 (no answer was awaited)."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int


_BINARY_ITEM_TYPES: Final = frozenset({bytes, bytearray, memoryview, type(None)})


def _binary_items(items: Sequence[Any], name: str) -> Sequence[bytes | None]:
    """``items`` with every bytearray or memoryview copied to bytes (the input itself when
    there are none: a C-speed check for a list); ConfigError unless every item is
    bytes-like or None. Copied at the call, as ``send`` copies: a buffer reused after
    the call changed the record written, and a memoryview of wider items (``len``
    counts items) passed the check and failed the whole request in the encoder (found
    by an audit)."""
    kinds = set(map(type, items))
    wrong = kinds - _BINARY_ITEM_TYPES
    if wrong:
        names = ", ".join(sorted(t.__name__ for t in wrong))
        raise ConfigError(f"{name} must hold bytes or None, not {names}")
    if kinds <= {bytes, type(None)}:
        return items
    return [item if item is None or type(item) is bytes else bytes(item) for item in items]


def _as_bytes(item: Any, name: str) -> bytes | None:
    """One value or key as ``_binary_items`` takes each item."""
    if item is None or type(item) is bytes:
        return item
    if isinstance(item, bytes | bytearray | memoryview):
        return bytes(item)
    raise ConfigError(f"{name} must be bytes or None, not {type(item).__name__}")


def _int_option(name: str, value: Any) -> int:
    """``value`` as an int (numpy's too), or ConfigError: a float or a bool is refused."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an int, not {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be an int, not {value!r}") from None


def _check_topic(topic: Any) -> str:
    """A topic name given to a send: a non-empty str (a bytes name raised KeyError)."""
    if not isinstance(topic, str) or not topic:
        raise ConfigError(f"topic must be a non-empty str, not {topic!r}")
    return topic


def _timestamp(timestamp_ms: int | None) -> int:
    """The records' timestamp: now, or the one given if it is a non-negative int64
    (Kafka's ProducerRecord rule), checked at the call: found when the sender encodes, it
    would fail every batch of the request. Negative ones were taken, and two in one batch
    further apart than an int64 (-2**63 and now) failed the encoding in the sender: every
    batch of the request, other partitions' too, whose spent sequences then made their
    next batch OUT_OF_ORDER_SEQUENCE (found by an audit)."""
    if timestamp_ms is None:
        return int(time.time() * 1000)
    try:
        ts = int(timestamp_ms)
    except (TypeError, ValueError):
        raise ConfigError(f"timestamp_ms must be an int, got {timestamp_ms!r}") from None
    if not 0 <= ts < 2**63:
        raise ConfigError(
            f"timestamp_ms must be a non-negative int64 (ms since the epoch), got {timestamp_ms!r}"
        )
    return ts


def _is_arrow(values: Any) -> bool:
    """A pyarrow array (checked without importing pyarrow for list input)."""
    return type(values).__module__.startswith("pyarrow")


class BatchMetadata(Sequence[RecordMetadata]):
    """The result of ``send_batch``: one ``RecordMetadata`` per value, built on access.

    A batch's offsets are consecutive, so each answered batch is kept as a run
    (first index, end index, base offset) and written out into the ``offsets`` array
    only when someone reads them: the producer's answer path does no work per record,
    which at millions of records a second was half of its Python time."""

    __slots__ = ("_append_times", "_offsets", "_partitions", "_runs", "_timestamp_ms", "topic")

    def __init__(
        self,
        topic: str,
        partitions: array[int],
        offsets: array[int],
        ts: int,
        runs: list[tuple[int, int, int]] | None = None,
        *,
        append_times: array[int] | None = None,
    ) -> None:
        self.topic = topic
        self._partitions = partitions
        self._offsets = offsets
        self._timestamp_ms = ts
        self._runs = runs or []
        # Per value, the broker's stamp where the topic is LogAppendTime (-1: CreateTime,
        # ``ts``); None when no answer carried one.
        self._append_times = append_times

    def __len__(self) -> int:
        return len(self._offsets)

    @overload
    def __getitem__(self, index: int) -> RecordMetadata: ...
    @overload
    def __getitem__(self, index: slice) -> list[RecordMetadata]: ...
    def __getitem__(self, index: int | slice) -> RecordMetadata | list[RecordMetadata]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        offsets = self.offsets
        timestamp_ms = self._timestamp_ms
        if self._append_times is not None and self._append_times[index] >= 0:
            # The broker's time, as send()'s RecordMetadata gives on a LogAppendTime
            # topic: the producer's own stamp matched no record written (found by an
            # audit).
            timestamp_ms = self._append_times[index]
        return RecordMetadata(self.topic, self._partitions[index], offsets[index], timestamp_ms)

    @property
    def offsets(self) -> array[int]:
        """Offsets per value, in input order (a compact array; -1 for acks=0)."""
        runs = self._runs
        if runs:
            # Idempotent, so two threads reading at once both return the whole array.
            for start, stop, base in runs:
                self._offsets[start:stop] = array("q", range(base, base + stop - start))
            self._runs = []
        return self._offsets

    @property
    def partitions(self) -> array[int]:
        return self._partitions


class _Group:
    """The records of one ``send_batch`` call, spread over one or more batches."""

    __slots__ = (
        "append_times",
        "error",
        "future",
        "offsets",
        "partitions",
        "pending",
        "runs",
        "timestamp_ms",
        "topic",
    )

    def __init__(self, topic: str, n: int, timestamp_ms: int, pending: int) -> None:
        self.topic = topic
        self.future: Future[BatchMetadata] = Future()
        self.partitions = _ZERO_I32 * n
        self.offsets = _ZERO_I64 * n
        # (first index, end index, base offset) of answered batches whose offsets are not
        # written into ``offsets`` yet (``BatchMetadata.offsets`` does that on demand).
        self.runs: list[tuple[int, int, int]] = []
        self.timestamp_ms = timestamp_ms
        # Made at the first answer with a LogAppendTime stamp (``BatchMetadata``).
        self.append_times: array[int] | None = None
        self.pending = pending
        self.error: BaseException | None = None


class _Batch:
    """Records bound for one partition, sent as one record batch."""

    __slots__ = (
        "alone",
        "arrow_keys",
        "arrow_values",
        "attempts",
        "created_s",
        "encoded",
        "encoded_bytes",
        "finished",
        "generation",
        "group_slots",
        "headers",
        "keys",
        "last_error",
        "maybe_written",
        "ordinal",
        "ordinal_room",
        "producer_id",
        "record_futures",
        "request_key",
        "reserved_bytes",
        "sent",
        "size_bytes",
        "timestamps",
        "topic_id",
        "tp",
        "values",
    )

    def __init__(self, tp: tuple[str, int]) -> None:
        self.tp = tp
        self.values: list[bytes | None] = []
        self.keys: list[bytes | None] | None = None
        self.headers: list[Sequence[Header]] | None = None
        self.timestamps: list[int] = []
        self.size_bytes = 0
        # What it holds of buffer_bytes, given back when it finishes (``_finish``): may
        # be less than ``size_bytes`` (a send_batch batch larger than the buffer).
        self.reserved_bytes = 0
        # When it entered the accumulator (opened, or queued by send_batch): its linger
        # and its delivery timeout count from here. Never decreases along a partition's
        # queue, so its head is the first to expire (Producer._expire).
        self.created_s = time.monotonic()
        # Buffers whose concatenation is the encoded batch (Arrow input: mostly views of
        # the arrays), joined only into the request that carries them.
        self.encoded: list[Any] | None = None
        self.encoded_bytes = 0
        self.attempts = 0
        self.sent = False
        # A request carrying it ended with no word on whether the leader wrote it (a
        # retriable error: the stream cut, a timeout): it is never cut in two (new
        # batches under a new producer id would write its records again, if they were).
        self.maybe_written = False
        # Sent in a request of its own (no other partition's batches): a retry whose
        # request the gateway refused as too large with others in it.
        self.alone = False
        # Why its last request failed, while it waits to be retried: what it fails with
        # if its delivery timeout passes first (Producer._fail_expired).
        self.last_error: TidelogError | None = None
        self.finished = False  # its futures are set (_finishing)
        # Place in its partition's queue (``_PartitionQueue.enqueue``); halves of a split
        # batch (``Producer._halves``) take places between it and the next one's.
        self.ordinal: float = 0
        self.ordinal_room = 1.0  # the gap to the next batch's ordinal
        self.generation = 0  # the flush generation it was created in (Producer.flush)
        # The topic incarnation its records are for ("" unknown): requests name it, so a
        # topic deleted and created again refuses them (INCONSISTENT_TOPIC_ID).
        self.topic_id = ""
        self.producer_id = -1  # the producer id it was encoded under
        # Names the request that first carried it: a retry resends exactly that request.
        self.request_key = 0
        # send(): (index in batch, future); send_batch(): (group, indices in the group).
        self.record_futures: list[tuple[int, Future[RecordMetadata]]] = []
        self.group_slots: list[tuple[_Group, range | list[int]]] = []
        # send_batch of Arrow arrays: zero-copy slices, encoded with encode_batch_arrow.
        self.arrow_values: Any = None
        self.arrow_keys: Any = None

    def __len__(self) -> int:
        return len(self.values) if self.arrow_values is None else len(self.arrow_values)


class _Stream:
    """One ProduceStream to the gateway: its request queue (read by gRPC), the call (to
    cancel), and what the hung-stream check needs. Fields change under the producer's
    lock; the producer's current stream is the one its sender queues on."""

    __slots__ = ("call", "heard_s", "requests", "timed_out")

    def __init__(self) -> None:
        self.requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.call: Any = None  # set once gRPC has the call
        self.heard_s = time.monotonic()  # opened, or last answered
        self.timed_out = False  # cancelled by the producer for that


class _Pipe:
    """Direct mode: one AppendStream to a broker. The broker appends its requests in the
    order sent and answers them in that order (``StorageServicer._pipelined_appends``).
    Fields change under the producer's lock; ``closed`` is set once, by its reader, when
    the stream has ended, and nothing is queued on a closed pipe."""

    __slots__ = (
        "address",
        "call",
        "closed",
        "heard_s",
        "pending",
        "requests",
        "timed_out",
        "where",
    )

    def __init__(self, leader: Leader) -> None:
        self.address = leader.address
        self.where = f"broker {leader.broker_id} ({leader.address})"  # for error messages
        self.requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.call: Any = None
        self.closed = False
        self.timed_out = False
        self.heard_s = time.monotonic()
        self.pending: deque[int] = deque()  # correlation ids sent and not answered, in order


class _PartitionQueue:
    """One partition's batches waiting to be sent, and its requests in flight.

    Invariants: batches are in ordinal order; requests in flight are on one pipe (``pipe``)
    when there is more than one; a blocked partition sends nothing until ``in_flight`` is
    back to 0."""

    __slots__ = (
        "acknowledged_id",
        "batches",
        "blocked",
        "in_flight",
        "in_flight_batches",
        "next_ordinal",
        "next_sequence",
        "pipe",
        "producer_id",
        "retry_at_s",
    )

    def __init__(self) -> None:
        self.batches: deque[_Batch] = deque()
        self.in_flight = 0  # requests sent and not answered
        self.in_flight_batches = 0
        self.pipe: _Pipe | None = None  # where its requests in flight went (None: unary)
        self.blocked = False  # a request failed: wait for the others before sending more
        self.retry_at_s = 0.0
        self.producer_id = -1
        self.next_sequence = 0
        self.next_ordinal = 0
        # The producer id a batch of this partition was last acknowledged under: one the
        # leader knows (``Producer._may_send``).
        self.acknowledged_id = -1

    def enqueue(self, batch: _Batch) -> None:
        """A new batch goes last, numbered after every batch before it."""
        batch.ordinal = self.next_ordinal
        self.next_ordinal += 1
        self.batches.append(batch)

    def requeue(self, batches: Sequence[_Batch]) -> None:
        """Batches back from a request (to retry) go into their ordinal places."""
        if not self.batches or batches[-1].ordinal < self.batches[0].ordinal:
            self.batches.extendleft(reversed(batches))
        else:
            self.batches = deque(sorted([*batches, *self.batches], key=lambda b: b.ordinal))

    def request_done(self, batches: Sequence[_Batch], *, failed: bool) -> None:
        self.in_flight -= 1
        self.in_flight_batches -= len(batches)
        if failed:
            self.blocked = True
        if self.in_flight == 0:
            self.pipe = None
            self.blocked = False


class _Appenders:
    """Direct mode: the threads that make the producer's unary ``Append`` and
    ``AppendMany`` calls, each a blocking call on a thread of its own (grpc's ``future()``
    instead starts a thread per channel whenever the channel's calls go from none to one,
    which a producer with a few partitions per leader does on nearly every request:
    measured ~10% of direct RF=1 throughput). At most ``max_threads``, started as calls
    need them; calls beyond that wait in order for a thread to be free.

    The producer's own threads, not a ``concurrent.futures.ThreadPoolExecutor``: at the
    interpreter's exit, concurrent.futures' exit hook (which ``threading`` runs before
    atexit handlers) makes every pool refuse new work, so a ``close()`` called from an
    atexit handler killed the sender on its first unary append and failed every record.
    Daemons, as the producer's other threads: an idle one never holds up the interpreter's
    exit (a producer not closed by then sends nothing more: module docstring).

    Thread-safety: ``submit`` and ``shutdown`` are called by the sender (their one user);
    the workers take calls under the condition's lock."""

    __slots__ = ("_calls", "_cond", "_max_threads", "_shut", "_threads", "_waiting")

    def __init__(self, max_threads: int) -> None:
        self._max_threads = max_threads
        self._cond = threading.Condition(threading.Lock())
        self._calls: deque[tuple[Future[Any], Callable[[], Any]]] = deque()
        self._threads = 0  # started and not ended
        self._waiting = 0  # threads waiting for a call
        self._shut = False

    def submit(self, call: Callable[[], _T]) -> Future[_T]:
        """Make ``call`` on a worker thread; its future is completed (and its callbacks
        run) there."""
        future: Future[_T] = Future()
        with self._cond:
            self._calls.append((future, call))
            # More calls queued than threads waiting to take them: one more thread.
            start = len(self._calls) > self._waiting and self._threads < self._max_threads
            if start:
                self._threads += 1
            else:
                self._cond.notify()
        if start:
            try:
                threading.Thread(target=self._work, name="tidelog-append", daemon=True).start()
            except RuntimeError:
                # No new thread: the process is out of them, or exits on Python 3.12+
                # (no thread starts once atexit handlers run). A thread already running
                # takes the call in its turn; with none, the sender makes it
                # (make_orphaned_calls) rather than die or leave it queued for ever.
                with self._cond:
                    self._threads -= 1
        return future

    def make_orphaned_calls(self) -> None:
        """(the sender, the producer's lock not held: they block) Make the queued calls
        on this thread while no worker is left to (none could be started)."""
        while True:
            with self._cond:
                if self._threads or not self._calls:
                    return
                taken = self._calls.popleft()
            self._run(*taken)

    def shutdown(self, *, cancel: bool) -> None:
        """No more calls: the threads end once the queued ones are made, or (``cancel``)
        at once after their current one, the queued ones' futures cancelled."""
        with self._cond:
            self._shut = True
            dropped = list(self._calls) if cancel else []
            if cancel:
                self._calls.clear()
            self._cond.notify_all()
        for future, _ in dropped:
            future.cancel()  # its callback sees it cancelled: never sent

    def _take(self) -> tuple[Future[Any], Callable[[], Any]] | None:
        """(a worker) The next call queued, waiting for one; None once shut down and
        none is left: the thread ends."""
        with self._cond:
            while not self._calls and not self._shut:
                self._waiting += 1
                self._cond.wait()
                self._waiting -= 1
            if self._calls:
                return self._calls.popleft()
            self._threads -= 1
            return None

    def _work(self) -> None:
        while taken := self._take():
            self._run(*taken)

    @staticmethod
    def _run(future: Future[Any], call: Callable[[], Any]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = call()
        except BaseException as exc:  # the future carries it, as an executor's does
            future.set_exception(exc)
        else:
            future.set_result(result)


def _cancel(calls: Sequence[Any]) -> None:
    """Cancel gRPC calls (None: a stream or pipe not opened yet). Outside the producer's
    lock: a cancel may run the call's done callbacks, which take it."""
    for call in calls:
        if call is not None:
            call.cancel()


def _warn_unsent_at_exit(ref: weakref.ref[Producer]) -> None:
    producer = ref()
    # A child made by fork that exits normally inherited the registration and the parent's
    # counts: the batches are the parent's to send, not the child's to warn about.
    if producer is not None and producer._unfinished and producer._pid == current_pid():
        _log.warning(
            "a tidelog Producer was not closed before exit: %d batches of records were "
            "never sent or never answered (call close() or flush() first)",
            producer._unfinished,
        )


class Producer:
    """See the module docstring. Parameters named as Kafka's producer configs mean what
    those do; beyond them:

    - ``partitioner``: ``partitioner(key, count) -> int`` picks the partition of a record
      sent without one (a keyless ``send`` too, but not a keyless ``send_batch``, which
      goes to the sticky partition); an answer outside ``0..count-1`` raises
      UnknownTopicOrPartitionError at the call.
    - ``max_in_flight_requests_per_partition`` applies to direct mode: through the gateway
      a partition has one request in flight (the gateway keeps each partition's order).
    - ``enable_idempotence`` (True) needs ``acks="all"``: a Producer with another ``acks``
      must pass ``enable_idempotence=False`` (Kafka turns it off silently instead).
    """

    def __init__(
        self,
        gateway: str | None = None,
        *,
        acks: str | int = "all",
        linger_ms: int = 5,
        batch_bytes: int = 1024 * 1024,
        compression: str = "none",
        enable_idempotence: bool = True,
        retries: int = 2**31 - 1,
        delivery_timeout_ms: int = 120_000,
        request_timeout_ms: int = 30_000,
        max_in_flight_requests: int = 16,
        max_in_flight_requests_per_partition: int = 5,
        buffer_bytes: int = 64 * 1024 * 1024,
        max_block_ms: int = 60_000,
        partitioner: Any = None,
        client_id: str = "tidelog-producer",
        direct: bool = False,
        connections_max_idle_ms: int = 540_000,
        metadata_max_age_ms: int = 300_000,
    ) -> None:
        # Its threads and channels exist in this process only (check_same_process).
        self._pid = current_pid()
        # Ints, checked here: a float request_timeout_ms (timeout_s * 1000) or a non-str
        # client_id was taken, then killed the sender at the first request, failing every
        # record (found by an audit).
        linger_ms = _int_option("linger_ms", linger_ms)
        batch_bytes = _int_option("batch_bytes", batch_bytes)
        retries = _int_option("retries", retries)
        delivery_timeout_ms = _int_option("delivery_timeout_ms", delivery_timeout_ms)
        request_timeout_ms = _int_option("request_timeout_ms", request_timeout_ms)
        max_in_flight_requests = _int_option("max_in_flight_requests", max_in_flight_requests)
        max_in_flight_requests_per_partition = _int_option(
            "max_in_flight_requests_per_partition", max_in_flight_requests_per_partition
        )
        buffer_bytes = _int_option("buffer_bytes", buffer_bytes)
        max_block_ms = _int_option("max_block_ms", max_block_ms)
        connections_max_idle_ms = _int_option("connections_max_idle_ms", connections_max_idle_ms)
        metadata_max_age_ms = _int_option("metadata_max_age_ms", metadata_max_age_ms)
        if not isinstance(client_id, str):
            raise ConfigError(f"client_id must be a str, not {type(client_id).__name__}")
        acks_key = str(acks).lower()
        if acks_key not in ACKS:
            raise ConfigError(f"acks {acks!r} must be 'all' (-1), 1 or 0")
        for name, value in (
            ("batch_bytes", batch_bytes),
            ("max_in_flight_requests", max_in_flight_requests),
            ("max_in_flight_requests_per_partition", max_in_flight_requests_per_partition),
            ("buffer_bytes", buffer_bytes),
            ("delivery_timeout_ms", delivery_timeout_ms),
            ("request_timeout_ms", request_timeout_ms),
            ("connections_max_idle_ms", connections_max_idle_ms),
            ("metadata_max_age_ms", metadata_max_age_ms),
        ):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, not {value}")
        if linger_ms < 0 or retries < 0 or max_block_ms < 0:
            raise ConfigError("linger_ms, retries and max_block_ms must be >= 0")
        if request_timeout_ms > INT32_MAX:
            # Requests carry it as an int32 (found by an audit: 2**31 arrived negative).
            raise ConfigError(
                f"request_timeout_ms must be <= {INT32_MAX}, not {request_timeout_ms}"
            )
        if enable_idempotence and max_in_flight_requests_per_partition > (
            MAX_BATCHES_IN_FLIGHT_PER_PARTITION
        ):
            # Kafka's rule too: the leader dedupes retries against its last five batches.
            raise ConfigError(
                f"max_in_flight_requests_per_partition {max_in_flight_requests_per_partition} "
                f"must be <= {MAX_BATCHES_IN_FLIGHT_PER_PARTITION} with enable_idempotence "
                "(a leader remembers a producer's last five batches to answer its retries)"
            )
        if enable_idempotence and ACKS[acks_key] != common_pb2.ALL:
            # Kafka's rule: idempotence needs acks=all, else a lost leader loses sequences.
            raise ConfigError("enable_idempotence needs acks='all'; pass enable_idempotence=False")
        encode_batch([b""], compression=compression)  # validates the codec name now
        self._conn = GatewayConnection.get(gateway, request_timeout_ms)
        # Direct mode (module docstring): appends go to the leaders, found through here.
        self._leaders: LeaderDirectory | None = directory_for(self._conn) if direct else None
        # Direct mode's unary appends: blocking calls on these threads, as many as
        # requests may be in flight.
        self._appenders = _Appenders(max_in_flight_requests) if direct else None
        self._acks = ACKS[acks_key]
        self._linger_s = linger_ms / 1000
        self._batch_bytes = batch_bytes
        # What a batch's records may add up to (records.record_bytes) for the encoded batch
        # to stay within batch_bytes.
        self._records_budget = max(1, batch_bytes - batch_overhead_bytes(batch_bytes))
        self._compression = compression
        self._idempotent = enable_idempotence
        self._retries = retries
        self._delivery_timeout_s = delivery_timeout_ms / 1000
        self._request_timeout_ms = request_timeout_ms
        self._max_in_flight = max_in_flight_requests
        # Several requests of a partition in flight need the order a pipe keeps (direct
        # mode). Through the gateway a partition has one: the gateway's answers to a
        # stream's requests come in any order.
        self._per_partition = max_in_flight_requests_per_partition if direct else 1
        # Batches of a partition in flight, and so of one request (the constant's reason).
        self._max_batches = MAX_BATCHES_IN_FLIGHT_PER_PARTITION if enable_idempotence else 2**31
        self._buffer_bytes = buffer_bytes
        self._max_block_s = max_block_ms / 1000
        self._partitioner = partitioner
        self._client_id = client_id

        self._lock = threading.Condition()
        self._queues: dict[tuple[str, int], _PartitionQueue] = {}
        self._open: dict[tuple[str, int], _Batch] = {}
        # Topic -> (partition count, when it was looked up, topic id): looked up again once older
        # than metadata_max_age_ms (Kafka's metadata.max.age.ms), and at once after an
        # UNKNOWN_TOPIC_OR_PARTITION answer, so partitions added to a topic (or a topic
        # re-created with fewer) are seen; before, the first count was kept for good.
        self._counts: dict[str, tuple[int, float, str]] = {}
        self._metadata_max_age_s = metadata_max_age_ms / 1000
        self._refresh_lock = threading.Lock()
        self._refreshing: set[str] = set()  # topics whose count a thread is looking up
        self._sticky: dict[str, int] = {}
        self._sticky_bytes: dict[str, int] = {}  # sent to the topic's sticky partition
        self._buffered_bytes = 0
        self._unfinished = 0  # batches created and not yet completed
        # No queued or open batch reaches its delivery timeout before this (_expire): the
        # sender looks for expired batches only then, not on every pass.
        self._next_expiry_s = float("inf")
        # Flush generations: each flush() starts a new one and waits only for batches of
        # its own and earlier generations (unfinished counts by generation, none at 0).
        self._generation = 0
        self._unfinished_by_generation: dict[int, int] = {}
        self._flushing = 0
        self._closing = False
        # Set by close() when its timeout ran out (why, for the records' errors): nothing is
        # sent or retried any more, and what was unfinished has failed (_force_close).
        self._aborted: str | None = None
        # Set on a thread while it completes futures, so flush() and close() called from
        # a done-callback know (module docstring).
        self._completing = threading.local()
        # Set when the sender thread failed (_sender_failed): every send raises it.
        self._broken: TidelogError | None = None
        self._sending: list[tuple[_PartitionQueue, list[_Batch]]] = []  # picked, not dispatched
        self._in_flight: dict[int, list[tuple[_PartitionQueue, list[_Batch]]]] = {}
        # Direct mode: what max_in_flight_requests counts. A request there names one
        # partition, so the partitions one sender pass sends to one leader count as one
        # request, as they make one produce request in Kafka (correlation id -> its
        # dispatch; dispatch -> its requests unanswered).
        self._dispatch_of: dict[int, int] = {}
        self._dispatch_left: dict[int, int] = {}
        # Direct mode: dispatches unanswered per leader address, and each one's address.
        # max_in_flight_requests bounds each leader's, as Kafka's per connection: one
        # bound for all let a stopped broker's unanswered requests take every place, and
        # nothing went to the healthy leaders until they timed out (found by an audit).
        self._dispatches_by_address: dict[str, int] = {}
        self._dispatch_address: dict[int, str] = {}
        self._dispatches = itertools.count(1)
        # GROUP_MIN_PARTITIONS, per producer: the chaos workload sets 1, as its gateway
        # runs with --produce-group-min-partitions 1, so that groups meet its faults.
        self._group_min_partitions = GROUP_MIN_PARTITIONS
        self._correlation = itertools.count(1)
        self._producer_id = -1
        self._producer_epoch = -1
        self._stream: _Stream | None = None  # gateway mode: the current produce stream
        self._pipes: dict[str, _Pipe] = {}  # direct mode: open pipes by broker address
        self._pipe_max_idle_s = connections_max_idle_ms / 1000
        self._pipe_refused_until_s: dict[str, float] = {}
        self._request_keys = itertools.count(1)
        self._metrics = ClientMetrics(
            counters=(
                "request-total",
                "record-send-total",
                "record-retry-total",
                "record-error-total",
            ),
            sensors=("batch-size", "records-per-request", "request-latency"),
        )
        self._sent_at_s: dict[int, float] = {}  # correlation id -> when it was queued
        self._sender = threading.Thread(target=self._run_sender, name="tidelog-sender", daemon=True)
        self._sender.start()
        # Bound to a weak reference: the registration must not keep the producer alive.
        self._warn_at_exit = partial(_warn_unsent_at_exit, weakref.ref(self))
        atexit.register(self._warn_at_exit)

    # --- metadata -------------------------------------------------------------------------

    def _partition_count(self, topic: str, at_least: int = 0) -> int:
        """The topic's partition count (more than ``at_least``): looked up on the caller's
        thread when unknown; when known but old, the known one, while a thread looks it
        up again (as Kafka's sender refreshes metadata: a send never waits on a refresh,
        and a hung gateway made every send of direct mode wait its request timeout)."""
        known = self._counts.get(topic)
        if known is not None and known[0] > at_least:
            if time.monotonic() - known[1] >= self._metadata_max_age_s:
                self._refresh_count_later(topic)
            return known[0]
        return self._wait_for_count(topic)

    def _wait_for_count(self, topic: str) -> int:
        """Look the topic's partition count up on the caller's thread, retrying failures
        that may clear up (the gateway unreachable, busy or slow) for up to max_block_ms,
        as Kafka's send waits for metadata: a producer started while its gateway restarts
        (a rollout) raised NetworkError at its first send (found by an audit). An unknown
        topic raises at once: tidelog creates no topic on first use, and a misspelt name
        is better told now than after max_block_ms (Kafka waits for it too)."""
        deadline = time.monotonic() + self._max_block_s
        backoff_s = RETRY_BACKOFF_S
        while True:
            left_s = deadline - time.monotonic()
            try:
                count, topic_id = self._conn.partition_counts_and_ids(
                    [topic], timeout_s=max(0.001, min(left_s, self._request_timeout_ms / 1000))
                )[topic]
            except UnknownTopicOrPartitionError:
                raise
            except TidelogError as exc:
                if not exc.retriable:
                    raise
                left_s = deadline - time.monotonic()
                if left_s <= 0 or self._closing:
                    raise RequestTimedOutError(
                        f"the partitions of topic {topic!r} could not be looked up within "
                        f"max_block_ms ({round(self._max_block_s * 1000)} ms): {exc}"
                    ) from None
                time.sleep(min(left_s, backoff_s))
                backoff_s = min(backoff_s * 2, METADATA_RETRY_S)
                continue
            self._counts[topic] = (count, time.monotonic(), topic_id)
            return count

    def _refresh_count_later(self, topic: str) -> None:
        with self._refresh_lock:
            if topic in self._refreshing:
                return
            self._refreshing.add(topic)
        threading.Thread(
            target=self._refresh_count, args=(topic,), name="tidelog-metadata", daemon=True
        ).start()

    def _refresh_count(self, topic: str) -> None:
        try:
            self._look_up_count(topic, time.monotonic())
        except UnknownTopicOrPartitionError:
            self._counts.pop(topic, None)  # deleted: the next send looks it up, and raises
        except TidelogError:
            known = self._counts.get(topic)
            if known is not None:
                # The gateway is unreachable or busy: the known count stays (the leaders
                # may well be reachable), asked for again after a pause, not every send.
                retry_at = time.monotonic() - self._metadata_max_age_s + METADATA_RETRY_S
                self._counts[topic] = (known[0], retry_at, known[2])
        finally:
            with self._refresh_lock:
                self._refreshing.discard(topic)

    def _look_up_count(self, topic: str, now: float) -> int:
        count, topic_id = self._conn.partition_counts_and_ids([topic])[topic]
        self._counts[topic] = (count, now, topic_id)
        return count

    def _topic_id(self, topic: str) -> str:
        """(lock held or not) The id of the topic incarnation last looked up ("" if none)."""
        known = self._counts.get(topic)
        return known[2] if known is not None else ""

    def metrics(self) -> dict[str, float]:
        """Kafka's producer metrics by name (module docstring), cumulative since start."""
        return self._metrics.snapshot()

    def partitions_for(self, topic: str) -> list[int]:
        check_same_process(self._pid, "Producer")
        topic = _check_topic(topic)
        return list(range(self._partition_count(topic)))

    def _check_partition(self, topic: str, partition: int) -> int:
        """``partition`` as an int that ``topic`` has, or an error. A float passed the range
        check and killed the sender thread in the encoder (found by an audit)."""
        partition = _int_option("partition", partition)
        count = self._partition_count(topic, at_least=partition)
        if not 0 <= partition < count:
            raise UnknownTopicOrPartitionError(
                f"topic {topic!r} has {count} partitions; partition {partition} does not exist"
            )
        return partition

    def _choose(self, topic: str, key: bytes | None) -> int:
        count = self._partition_count(topic)
        if self._partitioner is not None:
            return self._partitioned(topic, key, count)
        if key is not None:
            return partition_for_key(key, count)
        return self._sticky_partition(topic, count)

    def _partitioned(self, topic: str, key: bytes | None, count: int) -> int:
        """The custom partitioner's answer, checked as an explicit partition is: out of
        range it went out and failed only delivery_timeout_ms later, as "sent, and may have
        been written" (found by an audit); Kafka refuses it in send()."""
        assert self._partitioner is not None
        partition = int(self._partitioner(key, count))
        if not 0 <= partition < count:
            raise UnknownTopicOrPartitionError(
                f"the partitioner chose partition {partition} of topic {topic!r}, which has "
                f"{count} partitions (it must return 0..{count - 1})"
            )
        return partition

    def _sticky_partition(self, topic: str, count: int) -> int:
        partition = self._sticky.get(topic)
        if partition is None or partition >= count:
            partition = self._sticky[topic] = random.randrange(count)
        return partition

    def _stick(self, topic: str, partition: int, size: int, count: int) -> None:
        """Count ``size`` bytes sent to ``topic``'s sticky partition (when ``partition`` is
        it) and move on once a batch's worth went there (KIP-794). Counted the same for
        ``send`` and ``send_batch``: a pipeline's small micro-batches stay on one partition
        (one leader and its followers at work, requests merging while one is in flight)
        instead of each landing somewhere else."""
        if self._sticky.get(topic) != partition:
            return
        went = self._sticky_bytes.get(topic, 0) + size
        self._sticky_bytes[topic] = went
        if went >= self._records_budget:
            self._next_sticky(topic, count)

    def _next_sticky(self, topic: str, count: int) -> None:
        self._sticky_bytes[topic] = 0
        current = self._sticky.get(topic, -1)
        if count > 1:
            choice = random.randrange(count - 1)
            self._sticky[topic] = choice + (choice >= current)
        else:
            self._sticky[topic] = 0

    # --- sending --------------------------------------------------------------------------

    def send(  # noqa: PLR0917 - Kafka's send(topic, value, key, partition, ...) order
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None = None,
        partition: int | None = None,
        headers: Sequence[Header] | None = None,
        timestamp_ms: int | None = None,
    ) -> Future[RecordMetadata]:
        """Queue one record; the future gives where it was written."""
        started_s = time.monotonic()
        check_same_process(self._pid, "Producer")
        topic = _check_topic(topic)
        # Copied to bytes before anything looks at them: the key's partition is the hash
        # of the bytes written (a memoryview of wider items hashed item by item went to
        # another partition than its bytes; found by an audit).
        value = _as_bytes(value, "value")
        key = _as_bytes(key, "key")
        # Headers and timestamp are checked here, not when the sender encodes the batch: a
        # bad one found there would fail every batch of its request, other partitions'
        # too (as send_batch's values are checked).
        headers = check_headers(headers) if headers else None
        ts = _timestamp(timestamp_ms)
        sticky = partition is None and key is None and self._partitioner is None
        if partition is None:
            partition = self._choose(topic, key)
        else:
            partition = self._check_partition(topic, partition)
        size = record_bytes(value, key, headers)
        if size > self._buffer_bytes:
            raise ConfigError(f"a record of {size} bytes exceeds buffer_bytes {self._buffer_bytes}")
        future: Future[RecordMetadata] = Future()
        tp = (topic, partition)
        with self._lock:
            self._reserve(size, started_s=started_s)
            batch = self._open.get(tp)
            if batch is not None and batch.size_bytes + size > self._records_budget:
                # Close before the record would take the batch past batch_bytes (Kafka's
                # rule): a batch that overshoots can pass the topic's max.message.bytes.
                self._close_open(tp)
                self._lock.notify_all()
                batch = None
            opened = batch is None
            if batch is None:
                batch = self._open[tp] = _Batch(tp)
                batch.topic_id = self._topic_id(topic)
                self._count_unfinished(batch)
                self._watch_expiry((batch,))
            index = len(batch.values)
            batch.values.append(value)
            if key is not None or batch.keys is not None:
                if batch.keys is None:
                    batch.keys = [None] * index
                batch.keys.append(key)
            if headers or batch.headers is not None:
                if batch.headers is None:
                    batch.headers = [()] * index
                batch.headers.append(tuple(headers or ()))
            batch.timestamps.append(ts)
            batch.size_bytes += size
            batch.reserved_bytes += size
            batch.record_futures.append((index, future))
            if sticky:
                self._stick(topic, partition, size, self._counts.get(topic, (1, 0.0, ""))[0])
            if batch.size_bytes >= self._records_budget:
                self._close_open(tp)
                self._lock.notify_all()
            elif opened:
                # The sender learns of a new batch (and its linger deadline). A record
                # joining an open batch changes nothing it decides on, so it is not
                # woken for each one: at 20,000 sends/s that was 20,000 wake-ups.
                self._lock.notify_all()
        return future

    def send_batch(
        self,
        topic: str,
        values: Sequence[bytes | None],
        keys: Sequence[bytes | None] | None = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
    ) -> Future[BatchMetadata]:
        """Queue many records at once (cut into batches without a per-record send);
        the future gives a ``BatchMetadata`` with each value's partition and offset.

        ``values`` (and ``keys``) may be lists of bytes or pyarrow binary arrays; Arrow
        input without keys is cut into zero-copy slices and encoded by Arrow kernels,
        with no Python work per record. Without keys or ``partition``, records go to the
        sticky partition as ``send``'s do, moving on after each ``batch_bytes`` worth.
        """
        started_s = time.monotonic()  # max_block_ms counts from here (``_reserve``)
        check_same_process(self._pid, "Producer")
        topic = _check_topic(topic)
        if tracing.ENABLED:
            tracing.event("c_call", topic)
        if _is_arrow(values) and keys is None:
            return self._send_arrow(topic, values, partition, timestamp_ms, started_s)
        if _is_arrow(values):
            values = cast(Any, values).to_pylist()
        if keys is not None and _is_arrow(keys):
            keys = cast(Any, keys).to_pylist()
        n = len(values)
        if keys is not None and len(keys) != n:
            raise ConfigError(f"{len(keys)} keys for {n} values")
        # Checked here, not when the sender encodes: a bad item found there would fail
        # every batch of its request and spend sequence numbers of other partitions.
        values = _binary_items(values, "values")
        if keys is not None:
            keys = _binary_items(keys, "keys")
        ts = _timestamp(timestamp_ms)
        # (partition, record indices, bytes) of each batch to make, in order.
        chunks: list[tuple[int, range | list[int], int]] = []
        plan: list[tuple[int, range | list[int]]] = []
        if partition is not None:
            partition = self._check_partition(topic, partition)
            plan = [(partition, range(n))]
        elif keys is not None and self._partitioner is None:
            count = self._partition_count(topic)
            sticky = self._sticky_partition(topic, count)
            chosen = murmur2_partitions(keys, count, default=sticky)
            by_partition: dict[int, list[int]] = {}
            for index, p in enumerate(chosen):
                by_partition.setdefault(p, []).append(index)
            plan = list(by_partition.items())
            # None keys went to the sticky partition: counted, so that it moves on after
            # a batch's worth as for keyless sends; uncounted, every None-keyed record of
            # every keyed send_batch landed on one partition for good (found by an audit).
            unkeyed = sum(
                record_bytes(values[i], None, None) for i, k in enumerate(keys) if k is None
            )
            if unkeyed:
                self._stick(topic, sticky, unkeyed, count)
        elif keys is not None:
            count = self._partition_count(topic)
            by_partition = {}
            for index, key in enumerate(keys):
                by_partition.setdefault(self._partitioned(topic, key, count), []).append(index)
            plan = list(by_partition.items())
        else:
            # Keyless: each batch goes to the sticky partition of the moment, which moves
            # on after a batch's worth (a chunk cut short of the end is one by construction).
            count = self._partition_count(topic)
            start = 0
            while start < n:
                end, size = self._chunk(values, None, range(n), start)
                target = self._sticky_partition(topic, count)
                chunks.append((target, range(start, end), size))
                self._stick(topic, target, size if end == n else self._records_budget, count)
                start = end
        # Cut each planned partition's records into batches of at most batch_bytes.
        for p, indices in plan:
            position = 0
            while position < len(indices):
                end, size = self._chunk(values, keys, indices, position)
                chunks.append((p, indices[position:end], size))
                position = end
        group = _Group(topic, n, ts, len(chunks))
        if not chunks:
            group.future.set_result(BatchMetadata(topic, group.partitions, group.offsets, ts))
            return group.future
        topic_id = self._topic_id(topic)

        def batches() -> Iterator[_Batch]:
            for p, indices, size in chunks:
                batch = _Batch((topic, p))
                batch.topic_id = topic_id
                if isinstance(indices, range):
                    batch.values = list(values[indices.start : indices.stop])
                    if keys is not None:
                        batch.keys = list(keys[indices.start : indices.stop])
                else:
                    batch.values = [values[i] for i in indices]
                    if keys is not None:
                        batch.keys = [keys[i] for i in indices]
                batch.timestamps = [ts] * len(batch.values)
                batch.size_bytes = size
                batch.group_slots.append((group, indices))
                yield batch

        self._queue_group(group, batches(), len(chunks), started_s)
        return group.future

    def _send_arrow(
        self,
        topic: str,
        values: Any,
        partition: int | None,
        timestamp_ms: int | None,
        started_s: float,
    ) -> Future[BatchMetadata]:
        n = len(values)
        ts = _timestamp(timestamp_ms)
        if partition is not None:
            partition = self._check_partition(topic, partition)
        count = self._partition_count(topic)
        # Cut by the running total of the records' sizes (Arrow kernels and a binary
        # search per batch): slices stay zero-copy, and a run of large records after
        # small ones cannot make a batch past batch_bytes.
        cuts = batch_cuts(arrow_record_bytes(values), self._batch_bytes)
        group = _Group(topic, n, ts, len(cuts))
        if not n:
            group.future.set_result(BatchMetadata(topic, group.partitions, group.offsets, ts))
            return group.future
        topic_id = self._topic_id(topic)

        def batches() -> Iterator[_Batch]:
            for start, stop, size in cuts:
                target = (
                    partition if partition is not None else self._sticky_partition(topic, count)
                )
                batch = _Batch((topic, target))
                batch.topic_id = topic_id
                batch.arrow_values = values.slice(start, stop - start)
                batch.timestamps = [ts]
                batch.size_bytes = size
                batch.group_slots.append((group, range(start, stop)))
                yield batch  # queued before the partition moves on
                if partition is None:
                    # A slice cut short of the end is a batch's worth by construction.
                    went = self._records_budget if stop < n else batch.size_bytes
                    self._stick(topic, target, went, count)

        self._queue_group(group, batches(), len(cuts), started_s)
        return group.future

    def _chunk(
        self,
        values: Sequence[bytes | None],
        keys: Sequence[bytes | None] | None,
        indices: range | list[int],
        position: int,
    ) -> tuple[int, int]:
        """(end, bytes) of the run of ``indices`` from ``position`` whose batch fits
        ``batch_bytes`` (at least one record)."""
        budget = self._records_budget
        size = 0
        end = position
        total = len(indices)
        while end < total:
            i = indices[end]
            # record_bytes inlined: this loop runs once per record of a list.
            record = len(values[i] or b"") + RECORD_OVERHEAD_BYTES
            if keys is not None:
                record += len(keys[i] or b"")
            if size + record > budget and end > position:
                break
            size += record
            end += 1
        return end, size

    def _queue(self, tp: tuple[str, int]) -> _PartitionQueue:
        pq = self._queues.get(tp)
        if pq is None:
            pq = self._queues[tp] = _PartitionQueue()
        return pq

    def _close_open(self, tp: tuple[str, int]) -> None:
        batch = self._open.pop(tp, None)
        if batch is not None:
            self._queue(tp).enqueue(batch)

    def _reserve(self, size: int, *, bounded: bool = True, started_s: float | None = None) -> None:
        """Wait (lock held) for ``size`` bytes of buffer room: when ``bounded``, until
        ``max_block_ms`` after ``started_s`` (the send's start: its metadata wait counts
        too, as Kafka's max.block.ms bounds both; each had a whole one, found by an
        audit), else until batches queued before finish (each does by its delivery
        timeout at the latest). A sender that fails meanwhile fails the wait: the room
        its failure frees must not queue a record no sender will take (found by an
        audit: its future never completed)."""
        if self._broken is not None:
            raise self._broken
        start = time.monotonic() if started_s is None else started_s
        deadline = start + self._max_block_s if bounded else float("inf")
        while self._buffered_bytes + size > self._buffer_bytes and self._buffered_bytes > 0:
            if self._broken is not None:
                raise self._broken
            if self._closing:
                raise ConfigError("the producer is closed")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimedOutError(
                    f"the producer's buffer ({self._buffer_bytes} bytes) stayed full for "
                    f"max_block_ms; the gateway is not keeping up or unreachable"
                )
            self._lock.wait(min(remaining, 1.0))
        if self._broken is not None:
            raise self._broken
        if self._closing:
            raise ConfigError("the producer is closed")
        self._buffered_bytes += size

    def _queue_group(
        self, group: _Group, batches: Iterator[_Batch], count: int, started_s: float
    ) -> None:
        """Queue a send_batch's ``count`` batches, made one at a time by ``batches``.

        Only the first waits for buffer room until ``max_block_ms`` after ``started_s``
        (the call's start), and raises
        (nothing queued) when it finds none. Once a batch is queued the call cannot fail
        without having written part of the records (a caller that retried would write
        them twice), so the others wait as long as room takes to free up. A producer
        closed meanwhile fails the group's future with the batches not queued."""
        for queued, batch in enumerate(batches):
            with self._lock:
                try:
                    reserved = min(batch.size_bytes, self._buffer_bytes)
                    self._reserve(reserved, bounded=not queued, started_s=started_s)
                    batch.reserved_bytes = reserved
                except TidelogError as exc:  # closed (or the sender failed) meanwhile
                    if not queued:
                        raise
                    group.error = exc
                    group.pending -= count - queued - 1  # this batch's share: _group_done
                    abandoned = True
                else:
                    abandoned = False
                    self._close_open(batch.tp)  # keep order with earlier send()s
                    # Its delivery timeout counts from here, not from before the wait for
                    # room (as Kafka's from the append to its accumulator): the queue's
                    # batches then stay in the order they expire in.
                    batch.created_s = time.monotonic()
                    self._queue(batch.tp).enqueue(batch)
                    self._count_unfinished(batch)
                    self._watch_expiry((batch,))
                    self._lock.notify_all()
            if abandoned:
                self._group_done(group)
                return

    def _count_unfinished(self, batch: _Batch) -> None:
        """(lock held) A new batch: unfinished until ``_finish``."""
        self._unfinished += 1
        batch.generation = self._generation
        counts = self._unfinished_by_generation
        counts[batch.generation] = counts.get(batch.generation, 0) + 1

    def _in_callback(self) -> bool:
        return bool(getattr(self._completing, "active", False))

    def flush(self, timeout_s: float | None = None) -> None:
        """Send everything queued now and wait until every record sent before this call
        has completed (records other threads send meanwhile are not waited for)."""
        check_same_process(self._pid, "Producer")
        if self._in_callback():
            raise ConfigError(
                "flush() in a future's done-callback would wait for the thread running the "
                "callback; flush from another thread"
            )
        with self._lock:
            generation = self._generation
            self._generation += 1
            self._flushing += 1
            self._lock.notify_all()
            counts = self._unfinished_by_generation
            try:
                if not self._lock.wait_for(
                    lambda: not any(g <= generation for g in counts), timeout_s
                ):
                    raise RequestTimedOutError(f"flush did not complete in {timeout_s} s")
            finally:
                self._flushing -= 1

    def close(self, timeout_s: float | None = None) -> None:
        """Stop accepting sends (later ones raise ConfigError), then wait up to
        ``timeout_s`` (None: as long as it takes, each record failing by its
        ``delivery_timeout_ms`` at the latest, or as its request in flight then fails: module
        docstring) for every record queued or in flight to complete, and stop the
        producer's threads. Kafka's ``close(Duration)``:

        * when ``timeout_s`` runs out first, the producer is closed forcefully: every
          record not completed yet fails at once with ``RequestTimedOutError`` ("the
          producer was closed before ... was acknowledged"; one that was sent may have
          been written, one never sent was not), nothing more is sent or retried, and
          close returns without raising, within ``timeout_s`` plus at most
          ``CLOSE_FORCE_MARGIN_S``. ``close(0)`` fails whatever is unfinished at once;
        * on return every future is done, and no thread of the producer completes one
          later (one still inside a blocking call ends with it and sends nothing).

        Every call waits so (a second close() from another thread too). In a
        done-callback: stop accepting sends and return at once; a close() elsewhere
        still waits, and at exit without one the warning names what was left. In a child
        made by ``os.fork()``: mark this copy closed and return, touching nothing of the
        parent's (which its own close() sends and stops)."""
        if self._pid != current_pid():
            # Not under the lock: a thread of the parent may have held it at the fork.
            self._closing = True
            return
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if self._in_callback():
            return  # no wait (Kafka's close(0) there): it would wait for this very thread
        with self._lock:
            done = self._lock.wait_for(lambda: self._unfinished == 0, timeout_s)
        margin_end_s = time.monotonic() + CLOSE_FORCE_MARGIN_S
        if not done:
            self._force_close(f"close(timeout_s={timeout_s}) ran out")
            with self._lock:
                # Batches another thread was completing as close failed the rest.
                self._lock.wait_for(lambda: self._unfinished == 0, CLOSE_FORCE_MARGIN_S)
        # The sender shuts the unary appenders' pool down as it ends: it is the pool's
        # only user.
        self._sender.join(timeout=max(0.0, margin_end_s - time.monotonic()))
        if self._unfinished == 0:
            atexit.unregister(self._warn_at_exit)

    def _force_close(self, why: str) -> None:
        """Fail every unfinished batch now, send nothing more (the streams are cancelled,
        so requests queued on them are not sent) and retry nothing (``_aborted``)."""
        with self._lock:
            if self._aborted is None:
                self._aborted = why
            batches, calls = self._take_unfinished()
        _cancel(calls)
        for batch in batches:
            self._fail(batch, self._closed_error(batch))

    def _take_unfinished(self) -> tuple[list[_Batch], list[Any]]:
        """(lock held; called once the producer sends no more: ``_aborted`` or ``_broken``
        set) Take every unfinished batch out of the producer's tables, in send order (each
        partition's earliest first), with the calls of the streams and pipes. Answers still
        coming find nothing to complete. The caller cancels the calls outside the lock
        (their queued requests are not sent, and their readers end) and fails the
        batches."""
        batches = [b for picked in self._in_flight.values() for _, bs in picked for b in bs]
        batches += [b for _, taken in self._sending for b in taken]
        for pq in self._queues.values():
            batches += pq.batches
            pq.batches.clear()
        batches += self._open.values()
        self._open.clear()
        self._sending = []
        self._in_flight.clear()
        self._sent_at_s.clear()
        self._dispatch_of.clear()
        self._dispatch_left.clear()
        self._dispatches_by_address.clear()
        self._dispatch_address.clear()
        calls = [self._stream.call] if self._stream is not None else []
        calls += [pipe.call for pipe in self._pipes.values()]
        self._lock.notify_all()
        return batches, calls

    def _closed_error(self, batch: _Batch) -> TidelogError:
        """The error of a batch that close() failed (``_aborted`` is set)."""
        topic, partition = batch.tp
        fate = (
            "it was sent, and may have been written"
            if batch.sent
            else "it was never sent, and was not written"
        )
        return RequestTimedOutError(
            f"the producer was closed before this record batch of {topic}-{partition} was "
            f"acknowledged ({self._aborted}): {fate}"
        )

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- the sender -----------------------------------------------------------------------

    def _may_send(self, pq: _PartitionQueue) -> bool:
        """(lock held) Whether the partition may send a request now, retry backoff aside:
        when nothing of it is in flight, or (pipelining) when its requests in flight went
        down a pipe that is still open, none failed, the producer id is the one its
        batches were encoded under and one the leader has acknowledged a batch of, and
        there is room for another batch.

        A leader takes any sequence from a producer id it does not know (KIP-360): a
        second request pipelined under a new id (after a split for max.message.bytes, or
        any failure that takes a new id) was written when the first was refused, ahead
        of its records (found by an audit)."""
        if pq.in_flight == 0:
            return True
        return (
            pq.in_flight < self._per_partition
            and pq.in_flight_batches < self._max_batches
            and not pq.blocked
            and pq.pipe is not None
            and not pq.pipe.closed
            and pq.producer_id == self._producer_id
            and (not self._idempotent or pq.acknowledged_id == self._producer_id)
        )

    def _ready(self, now: float) -> tuple[list[tuple[_PartitionQueue, list[_Batch]]], float]:
        """(lock held) Batches to send now, and how long until more may be ready."""
        wait_s = 1.0
        full = {
            address
            for address, count in self._dispatches_by_address.items()
            if count >= self._max_in_flight
        }
        for tp, batch in list(self._open.items()):
            if self._flushing or self._closing:
                self._close_open(tp)
                continue
            pq = self._queues.get(tp)
            if pq is not None and (
                not self._may_send(pq) or pq.retry_at_s > now or self._leader_full(tp, full)
            ):
                # The partition cannot send now: later records keep joining this batch
                # (as in Kafka's accumulator) instead of each wake-up closing a batch of
                # a few records, which the leader, followers and consumers would then
                # handle one by one. It closes when the partition may send again.
                continue
            due = batch.created_s + self._linger_s
            if due <= now:
                self._close_open(tp)
            else:
                wait_s = min(wait_s, due - now)
        picked: list[tuple[_PartitionQueue, list[_Batch]]] = []
        request_bytes = 0
        for pq in self._queues.values():
            if not pq.batches or not self._may_send(pq):
                continue
            if self._leader_full(pq.batches[0].tp, full):
                continue  # its leader's places are taken: the others' partitions go on
            if pq.retry_at_s > now:
                wait_s = min(wait_s, pq.retry_at_s - now)
                continue
            if pq.batches[0].alone and picked:
                wait_s = 0.0  # first in the next request, which it has to itself
                continue
            taken: list[_Batch] = []
            size = 0
            room = self._max_batches - pq.in_flight_batches
            # A retry resends exactly the batches of the request that failed (they share
            # its request_key): the leader answers a request of batches it already wrote
            # with their offsets, but refuses one that mixes them with new batches
            # (DUPLICATE_SEQUENCE_NUMBER), or with batches of another request that it
            # may not have written. New batches (key 0) go together, within the limits.
            while pq.batches and (
                not taken
                or (
                    pq.batches[0].request_key == taken[0].request_key
                    and (
                        taken[0].sent
                        or (
                            len(taken) < room
                            and size + pq.batches[0].size_bytes <= MAX_PARTITION_REQUEST_BYTES
                        )
                    )
                )
            ):
                batch = pq.batches.popleft()
                taken.append(batch)
                size += batch.size_bytes
            if request_bytes and request_bytes + size > MAX_REQUEST_BYTES:
                pq.batches.extendleft(reversed(taken))
                wait_s = 0.0
                break
            pq.in_flight += 1
            pq.in_flight_batches += len(taken)
            picked.append((pq, taken))
            request_bytes += size
            if taken[0].alone:
                break
        return picked, wait_s

    def _watch_expiry(self, batches: Sequence[_Batch]) -> None:
        """(lock held) ``batches`` were opened or queued (again): the sender looks for
        expired batches by the earliest of their delivery deadlines at the latest."""
        for batch in batches:
            self._next_expiry_s = min(
                self._next_expiry_s, batch.created_s + self._delivery_timeout_s
            )

    def _expire(self, now: float) -> list[_Batch]:
        """(lock held) Take out the queued and open batches past their delivery timeout,
        to be failed without being sent (Kafka's ``RecordAccumulator.expiredBatches``):
        retries of a request only ever fail as it is answered, so a batch waiting
        behind requests in flight was sent once it had expired and failed a request
        timeout later, and one waiting behind many of them outlasted its delivery timeout
        several times over. Requests in flight are not touched (they fail as answered).

        Only when something may have expired (``_next_expiry_s``), and then by each
        partition's queue head: a queue's batches expire in queue order (``created_s``),
        so an expired batch never leaves an earlier one of its partition queued to be
        written after its failure. A batch never sent has no sequence number yet (it gets
        one when first sent), so failing it leaves no gap before the partition's next;
        one sent before failing for good makes the producer take a new producer id, as in
        ``_complete_failed``."""
        if now < self._next_expiry_s:
            return []
        timeout_s = self._delivery_timeout_s
        expired: list[_Batch] = []
        next_expiry_s = float("inf")
        for pq in self._queues.values():
            batches = pq.batches
            while batches and batches[0].created_s + timeout_s <= now:
                expired.append(batches.popleft())
            if batches:
                next_expiry_s = min(next_expiry_s, batches[0].created_s + timeout_s)
        for tp, batch in list(self._open.items()):
            # Opened after every queued batch of its partition, it expires after them.
            if batch.created_s + timeout_s <= now:
                del self._open[tp]
                expired.append(batch)
            else:
                next_expiry_s = min(next_expiry_s, batch.created_s + timeout_s)
        self._next_expiry_s = next_expiry_s
        # Encoded means given a sequence (sent, or about to be when its request failed to
        # build): the leader's sequence state for this id is unknown now.
        if self._idempotent and any(b.sent or b.encoded is not None for b in expired):
            self._producer_id = -1
        return expired

    def _fail_expired(self, expired: list[_Batch], now: float) -> None:
        """Fail batches ``_expire`` took out. One waiting for a retry fails with its last
        request's error, as it would have failed had its deadline passed as that request
        failed (how a delivery timeout fails a batch in flight); one never sent, with
        RequestTimedOutError."""
        timeout_ms = round(self._delivery_timeout_s * 1000)
        for batch in expired:
            topic, partition = batch.tp
            waited = f"{(now - batch.created_s) * 1000:.0f} ms"
            last = batch.last_error
            error: TidelogError
            if last is None:
                error = RequestTimedOutError(
                    f"a record batch of {topic}-{partition} expired after {waited} in the "
                    f"producer, past its delivery_timeout_ms ({timeout_ms} ms): it was never "
                    "sent, and was not written"
                )
            else:
                fate = "it was sent, and may have been written" if batch.sent else "not written"
                error = type(last)(
                    f"{last.message} (not retried: the record batch of {topic}-{partition} "
                    f"expired after {waited}, past its delivery_timeout_ms ({timeout_ms} ms); "
                    f"{fate})"
                )
            self._fail(batch, error)

    def _run_sender(self) -> None:
        try:
            self._send_until_closed()
        except BaseException as exc:
            # A bug, or the process out of threads or memory: without a sender nothing
            # would ever complete what is queued, and flush() and futures would wait for
            # ever. Everything unfinished fails instead, and so does every later send.
            self._sender_failed(exc)
            raise

    def _sender_failed(self, exc: BaseException) -> None:
        error = UnknownServerError(
            f"the producer's sender thread failed ({exc!r}); this producer sends no more "
            "(a record batch it had sent may have been written)"
        )
        with self._lock:
            self._broken = error
            # Requests in flight fail now too, as close() fails them when forced: their
            # answers may never come, since a hung stream or pipe is cancelled by the
            # sender's checks, which no longer run.
            stranded, calls = self._take_unfinished()
        _cancel(calls)
        if self._appenders is not None:
            self._appenders.shutdown(cancel=True)  # their futures' callbacks find nothing
        for batch in stranded:
            self._fail(batch, error)

    def _send_until_closed(self) -> None:
        while True:
            with self._lock:
                self._sending = []  # the last ones were dispatched
                calls: list[Any] | None = None  # set once closed: the streams' calls
                while True:
                    if self._closing and (self._unfinished == 0 or self._aborted is not None):
                        calls = self._end_streams()
                        break
                    now = time.monotonic()
                    expired = self._expire(now)
                    if expired:
                        break
                    wait_s = 0.5
                    self._close_idle_pipes(time.monotonic())
                    hung = self._hung_stream(time.monotonic())
                    if hung is None:
                        hung = self._hung_pipe(time.monotonic())
                    if hung is not None:
                        break
                    if self._leaders is not None or len(self._in_flight) < self._max_in_flight:
                        # (Direct mode: bounded per leader, in ``_ready``.)
                        picked, wait_s = self._ready(time.monotonic())
                        if picked:
                            self._sending = picked  # for _sender_failed, until dispatched
                            break
                    self._lock.wait(min(wait_s, 0.5, self._next_expiry_s - time.monotonic()))
                stream = self._stream
                aborted = self._aborted is not None
            if calls is not None:
                break
            if expired:
                # Failed before the next pass sends anything more of their partitions.
                self._fail_expired(expired, now)
                continue
            if hung is not None:
                hung.cancel()  # its reader strands what was in flight, for a retry
                continue
            if self._leaders is not None:
                self._send_direct(picked, self._leaders)
                continue
            try:
                if stream is None:
                    stream = self._open_stream()
                correlation_id, request = self._build(picked)
            except TidelogError as exc:
                self._complete_failed(picked, exc)
                continue
            with self._lock:
                # Registered and queued under the lock the reader takes when its stream
                # ends, so a request is either stranded with the stream (and retried) or
                # never put on a dead one.
                if self._stream is stream and self._aborted is None:
                    self._in_flight[correlation_id] = picked
                    self._sent_at_s[correlation_id] = time.monotonic()
                    if tracing.ENABLED:
                        tracing.event("c_send", correlation_id, picked[0][1][0].tp[1])
                    stream.requests.put(request)
                    continue
            self._complete_failed(picked, NetworkError("the produce stream ended"))
        if aborted:
            # Forced by close(): their queued requests are not sent, and a black-holed
            # gateway's streams would never end by themselves.
            _cancel(calls or ())
        if self._appenders is not None:
            # Calls not started yet are dropped when forced: close() failed their batches.
            self._appenders.shutdown(cancel=aborted)

    def _leader_full(self, tp: tuple[str, int], full: set[str]) -> bool:
        """(lock held, direct mode) Whether the partition's leader, as cached, has
        ``max_in_flight_requests`` dispatches unanswered (``full``)."""
        if not full or self._leaders is None:
            return False
        return self._leaders.cached_address(tp) in full

    def _put_in_flight(
        self,
        correlation_id: int,
        picked: list[tuple[_PartitionQueue, list[_Batch]]],
        leader: Leader,
        dispatch_of_leader: dict[str, int],
    ) -> None:
        """(lock held, direct mode) A request sent to ``leader``; it counts towards this
        sender pass's one request to that leader (``dispatch_of_leader``)."""
        self._in_flight[correlation_id] = picked
        self._sent_at_s[correlation_id] = time.monotonic()
        dispatch = dispatch_of_leader.get(leader.address)
        if dispatch is None:
            dispatch = dispatch_of_leader[leader.address] = next(self._dispatches)
            self._dispatch_address[dispatch] = leader.address
            by_address = self._dispatches_by_address
            by_address[leader.address] = by_address.get(leader.address, 0) + 1
        self._dispatch_of[correlation_id] = dispatch
        self._dispatch_left[dispatch] = self._dispatch_left.get(dispatch, 0) + 1

    def _take_in_flight(
        self, correlation_id: int
    ) -> tuple[list[tuple[_PartitionQueue, list[_Batch]]] | None, float | None]:
        """(lock held, direct mode) A request answered or given up: its picked batches
        (None if already taken) and when it was sent; its dispatch counts one less."""
        picked = self._in_flight.pop(correlation_id, None)
        sent_at_s = self._sent_at_s.pop(correlation_id, None)
        dispatch = self._dispatch_of.pop(correlation_id, None)
        if dispatch is not None:
            left = self._dispatch_left.get(dispatch, 1) - 1
            if left > 0:
                self._dispatch_left[dispatch] = left
            else:
                self._dispatch_left.pop(dispatch, None)
                address = self._dispatch_address.pop(dispatch, None)
                if address is not None:
                    count = self._dispatches_by_address.get(address, 1) - 1
                    if count > 0:
                        self._dispatches_by_address[address] = count
                    else:
                        self._dispatches_by_address.pop(address, None)
                self._lock.notify_all()  # the sender may send again
        return picked, sent_at_s

    def _end_streams(self) -> list[Any]:
        """(lock held) End the produce stream and the pipes after their last requests;
        returns their calls (to cancel when the close is forced)."""
        calls: list[Any] = []
        if self._stream is not None:
            self._stream.requests.put(_STOP)
            calls.append(self._stream.call)
        for pipe in self._pipes.values():
            pipe.requests.put(_STOP)
            calls.append(pipe.call)
        return calls

    def _close_idle_pipes(self, now: float) -> None:
        """(lock held) End the pipes with nothing in flight for ``connections_max_idle_ms``.
        Closed here, under the lock, so nothing is queued on one after its end."""
        for address, pipe in list(self._pipes.items()):
            if not pipe.pending and now - pipe.heard_s >= self._pipe_max_idle_s:
                pipe.closed = True
                del self._pipes[address]
                pipe.requests.put(_STOP)

    def _hung_pipe(self, now: float) -> Any:
        """(lock held) A pipe's call to cancel: its oldest request went unanswered past the
        request timeout and grace, and it answered nothing for as long; else None."""
        limit_s = self._request_timeout_ms / 1000 + STREAM_ANSWER_GRACE_S
        for pipe in self._pipes.values():
            if pipe.call is None or pipe.timed_out or not pipe.pending:
                continue
            sent_s = self._sent_at_s.get(pipe.pending[0])
            if sent_s is not None and now - max(sent_s, pipe.heard_s) >= limit_s:
                pipe.timed_out = True
                return pipe.call
        return None

    def _hung_stream(self, now: float) -> Any:
        """(lock held) The produce stream to cancel: its oldest request went unanswered
        past the request timeout and grace (``STREAM_ANSWER_GRACE_S``); else None."""
        stream = self._stream
        if stream is None or stream.call is None or stream.timed_out or not self._sent_at_s:
            return None
        oldest_s = next(iter(self._sent_at_s.values()))  # insertion order: the oldest first
        silent_since_s = max(oldest_s, stream.heard_s)
        if now - silent_since_s < self._request_timeout_ms / 1000 + STREAM_ANSWER_GRACE_S:
            return None
        stream.timed_out = True
        return stream.call

    def _open_stream(self) -> _Stream:
        """Open a produce stream and start its reader; returns it.

        The stream is the producer's current one before the reader starts: a stream that
        fails at once (the gateway is gone) must find itself current to retire itself,
        or the sender would go on queueing requests that nothing sends or answers."""
        stream = _Stream()
        with self._lock:
            self._stream = stream

        try:
            responses = self._conn.produce_stream_encoded(_until_stop(stream.requests))
        except BaseException:
            with self._lock:
                if self._stream is stream:
                    self._stream = None
            raise
        with self._lock:
            stream.call = responses
        reader = threading.Thread(
            target=self._read_responses,
            args=(responses, stream),
            name="tidelog-producer-reader",
            daemon=True,
        )
        reader.start()
        return stream

    def _read_responses(self, responses: Any, stream: _Stream) -> None:
        try:
            for response in responses:
                if tracing.ENABLED and response.partitions:
                    first = response.partitions[0]
                    tracing.event(
                        "c_ack", response.correlation_id, first.base_offset, first.last_offset
                    )
                with self._lock:
                    picked = self._in_flight.pop(response.correlation_id, None)
                    sent_at_s = self._sent_at_s.pop(response.correlation_id, None)
                    stream.heard_s = time.monotonic()
                if sent_at_s is not None:
                    self._metrics.record("request-latency", (time.monotonic() - sent_at_s) * 1000)
                if picked is not None:
                    self._complete(picked, list(response.partitions))
        except grpc.RpcError as exc:
            error: TidelogError = error_from_rpc(exc, f"produce stream to {self._conn.address}")
        else:
            error = NetworkError("the gateway closed the produce stream")
        # The stream is over: everything in flight on it goes back to its queue. Its end
        # says nothing of each request, so they are failed retriably, to be sent again:
        # failed with the stream's own status, they failed for good, written ones
        # included, or were split and written twice (found by an audit). But a request
        # over the gateway's message limit ends the stream (RESOURCE_EXHAUSTED) and would
        # again and again: the largest in flight, which is one such, takes that error
        # (and is split); the others go again.
        oversized = error if isinstance(error, RecordListTooLargeError) else None
        if not error.retriable:
            error = NetworkError(f"the produce stream ended ({error}); its requests go again")
        with self._lock:
            if stream.timed_out:
                error = RequestTimedOutError(
                    f"produce stream to {self._conn.address}: no answer within "
                    f"request_timeout_ms ({self._request_timeout_ms} ms)"
                )
                oversized = None
            if self._stream is stream:
                self._stream = None
            stranded = list(self._in_flight.values())
            self._in_flight.clear()
            self._sent_at_s.clear()
        stream.requests.put(_STOP)
        largest = None
        if oversized is not None and stranded:
            largest = max(
                stranded, key=lambda picked: sum(b.encoded_bytes for _, bs in picked for b in bs)
            )
        for picked in stranded:
            if oversized is not None and picked is largest:
                self._complete_failed(picked, oversized)
            else:
                self._complete_failed(picked, error)

    def _prepare(self, picked: list[tuple[_PartitionQueue, list[_Batch]]]) -> list[list[Any]]:
        """Encode the batches sent for the first time (which gives them their sequence) and
        count the attempt; returns each picked partition's encoded batches."""
        if self._idempotent and self._producer_id < 0:
            self._init_producer_id()
        encoded: list[list[Any]] = []
        # Each partition's next sequence before this call encoded its batches: should one
        # fail to encode (every input is checked at the call, so only a bug would), the
        # batches encoded before it are never sent, and the sequences they took would
        # leave a gap the leader refuses (OUT_OF_ORDER_SEQUENCE) for the partition's next
        # batch. They are given back with their encodings.
        sequences_before: dict[int, tuple[_PartitionQueue, int, int]] = {}
        fresh: list[_Batch] = []
        try:
            for pq, batches in picked:
                parts: list[Any] = []
                if not batches[0].sent:
                    key = next(self._request_keys)
                    for batch in batches:
                        batch.request_key = key
                for batch in batches:
                    if batch.encoded is None:
                        sequences_before.setdefault(id(pq), (pq, pq.producer_id, pq.next_sequence))
                        self._encode(pq, batch)
                        fresh.append(batch)
                        if not batch.attempts:  # not a refused batch encoded again
                            self._metrics.record("batch-size", batch.encoded_bytes)
                            self._metrics.add("record-send-total", len(batch))
                    parts += batch.encoded or ()
                encoded.append(parts)
        except BaseException:
            for batch in fresh:
                batch.encoded = None
            for pq, producer_id, sequence in sequences_before.values():
                pq.producer_id, pq.next_sequence = producer_id, sequence
            raise
        for _, batches in picked:
            for batch in batches:
                batch.attempts += 1
                batch.sent = True
        return encoded

    def _count_request(self, picked: list[tuple[_PartitionQueue, list[_Batch]]]) -> int:
        """Count one request of the picked batches; returns its correlation id."""
        self._metrics.add("request-total")
        self._metrics.record("records-per-request", sum(len(b) for _, bs in picked for b in bs))
        return next(self._correlation)

    def _build(self, picked: list[tuple[_PartitionQueue, list[_Batch]]]) -> tuple[int, bytes]:
        """(correlation id, the encoded ProduceRequest) for the picked batches."""
        encoded = self._prepare(picked)
        correlation_id = self._count_request(picked)
        return correlation_id, encode_produce_request(
            acks=self._acks,
            timeout_ms=self._request_timeout_ms,
            # A partition's batches name the topic id of its first: a topic re-created
            # between two batches of one request fails the later one too (it is rare, and
            # the failure is precise: INCONSISTENT_TOPIC_ID).
            partitions=[
                (batches[0].tp[0], batches[0].tp[1], chunks, batches[0].topic_id)
                for (_, batches), chunks in zip(picked, encoded, strict=True)
            ],
            correlation_id=correlation_id,
            client_id=self._client_id,
        )

    # --- direct mode ----------------------------------------------------------------------

    def _send_direct(
        self, picked: list[tuple[_PartitionQueue, list[_Batch]]], leaders: LeaderDirectory
    ) -> None:
        """One ``Append`` per picked partition, to its leader: down the leader's pipe, or
        as a unary call answered on a pool thread."""
        routed: list[tuple[tuple[_PartitionQueue, list[_Batch]], Leader, _Pipe | None]] = []
        for item in picked:
            pq, batches = item
            topic, partition = batches[0].tp
            try:
                leader = leaders.leader((topic, partition))
            except TidelogError as exc:  # the topic is gone, or the gateway is unreachable
                self._complete_failed([item], exc)
                continue
            if leader is None:
                leaders.invalidate()
                self._complete_failed(
                    [item],
                    LeaderNotAvailableError(f"{topic}-{partition} has no live leader right now"),
                )
                continue
            pipe = self._pipe_for(leader) if self._per_partition > 1 else None
            with self._lock:
                if pq.in_flight > 1 and (pipe is None or pipe is not pq.pipe):
                    # Its other requests went another way (the leader moved, or the pipe
                    # ended): this one would not be ordered after them. It waits for them.
                    pq.in_flight -= 1
                    pq.in_flight_batches -= len(batches)
                    pq.blocked = True
                    pq.requeue(batches)
                    self._watch_expiry(batches)
                    continue
                pq.pipe = pipe
            routed.append((item, leader, pipe))
        if not routed:
            return
        try:
            encoded = self._prepare([item for item, _, _ in routed])
        except TidelogError as exc:
            self._complete_failed([item for item, _, _ in routed], exc)
            return
        # The leader waits for acks=all a little less than the call may take (see the
        # constant), as the gateway asks of it.
        wait_ms = max(1, self._request_timeout_ms - LEADER_WAIT_MARGIN_MS)
        dispatch_of_leader: dict[str, int] = {}
        groups = self._groups(routed)
        grouped = {index for indexes in groups for index in indexes}
        for indexes in groups:
            self._send_group(
                [routed[i] for i in indexes],
                [encoded[i] for i in indexes],
                wait_ms,
                dispatch_of_leader,
                leaders,
            )
        for index, ((item, leader, pipe), chunks) in enumerate(zip(routed, encoded, strict=True)):
            if index in grouped:
                continue
            topic, partition = item[1][0].tp
            correlation_id = self._count_request([item])
            request = b"".join(
                append_request_parts(
                    topic=topic,
                    partition=partition,
                    batches=chunks,
                    acks=self._acks,
                    timeout_ms=wait_ms,
                    current_leader_epoch=leader.leader_epoch,
                    correlation_id=correlation_id,
                    topic_id=item[1][0].topic_id,
                )
            )
            if tracing.ENABLED:
                tracing.event("c_send", correlation_id, partition)
            future = None
            append = leaders.append_encoded(leader.address) if pipe is None else None
            with self._lock:
                # close() gave up (and failed these batches): nothing more is sent.
                given_up = self._aborted is not None
                if given_up:
                    closed = False
                elif pipe is not None and pipe.closed:
                    closed = True
                else:
                    closed = False
                    self._put_in_flight(correlation_id, [item], leader, dispatch_of_leader)
                    if pipe is not None:
                        # Under the lock its reader takes to end it: a request is either
                        # stranded with the pipe (and retried) or never put on a dead one.
                        pipe.pending.append(correlation_id)
                        pipe.requests.put(request)
                    else:
                        # Under the lock close() takes to give up, as the pipe's put: once
                        # it has, nothing more is sent.
                        assert self._appenders is not None and append is not None
                        future = self._appenders.submit(
                            partial(append, request, timeout=self._request_timeout_ms / 1000)
                        )
            if given_up:
                self._complete_failed([item], NetworkError("the producer was closed"))
                continue
            if closed:
                # The pipe ended before this request was queued on it: on a channel already
                # failing (the broker died) a new pipe ends at once, so this is how every
                # retry to a dead leader ends. The directory is asked again, as when a pipe
                # strands its requests; otherwise nothing would tell it the leader moved
                # and the retries would go to the dead broker until the delivery timeout.
                leaders.invalidate()
                ended = NetworkError(f"the append stream to {leader.address} ended")
                self._complete_failed([item], ended)
                continue
            if future is not None:
                # Outside the lock: a call already answered runs the callback here.
                future.add_done_callback(partial(self._append_answered, correlation_id, leader))
        if self._appenders is not None:
            # Calls that no thread could be started for are made here, the lock not held.
            self._appenders.make_orphaned_calls()

    def _groups(
        self, routed: list[tuple[tuple[_PartitionQueue, list[_Batch]], Leader, _Pipe | None]]
    ) -> list[list[int]]:
        """Indexes into ``routed`` that go in one AppendMany each: partitions of a leader
        with no other request in flight, if at least ``GROUP_MIN_PARTITIONS`` of them, in
        groups of at most ``GROUP_MAX_PARTITIONS``."""
        by_leader: dict[str, list[int]] = {}
        with self._lock:
            for index, ((pq, _), leader, _) in enumerate(routed):
                if pq.in_flight == 1:  # only this request: nothing to keep in order behind
                    by_leader.setdefault(leader.address, []).append(index)
        return [
            indexes[start : start + GROUP_MAX_PARTITIONS]
            for indexes in by_leader.values()
            if len(indexes) >= self._group_min_partitions
            for start in range(0, len(indexes), GROUP_MAX_PARTITIONS)
        ]

    def _send_group(
        self,
        routed: list[tuple[tuple[_PartitionQueue, list[_Batch]], Leader, _Pipe | None]],
        encoded: list[list[Any]],
        wait_ms: int,
        dispatch_of_leader: dict[str, int],
        leaders: LeaderDirectory,
    ) -> None:
        """One ``AppendMany`` to a leader for ``routed`` (one request of each partition,
        none with another in flight), answered on a pool thread."""
        items = [item for item, _, _ in routed]
        leader = routed[0][1]
        correlation_id = self._count_request(items)
        request = encode_append_many_request(
            [
                append_request_parts(
                    topic=batches[0].tp[0],
                    partition=batches[0].tp[1],
                    batches=chunks,
                    acks=self._acks,
                    timeout_ms=wait_ms,
                    current_leader_epoch=entry_leader.leader_epoch,
                    correlation_id=correlation_id,
                    topic_id=batches[0].topic_id,
                )
                for ((_, batches), entry_leader, _), chunks in zip(routed, encoded, strict=True)
            ]
        )
        if tracing.ENABLED:
            tracing.event("c_send", correlation_id, items[0][1][0].tp[1])
        append_many = leaders.append_many_encoded(leader.address)
        future = None
        with self._lock:
            # close() gave up (and failed these batches): nothing more is sent.
            given_up = self._aborted is not None
            if not given_up:
                for pq, _ in items:
                    pq.pipe = None  # nothing of these is pipelined behind the group
                self._put_in_flight(correlation_id, items, leader, dispatch_of_leader)
                assert self._appenders is not None
                future = self._appenders.submit(
                    partial(append_many, request, timeout=self._request_timeout_ms / 1000)
                )
        if future is None:
            self._complete_failed(items, NetworkError("the producer was closed"))
            return
        future.add_done_callback(partial(self._group_answered, correlation_id, leader))

    def _group_answered(self, correlation_id: int, leader: Leader, future: Any) -> None:
        picked = self._unary_answered(correlation_id, future)
        if picked is None:
            return
        where = f"broker {leader.broker_id} ({leader.address})"
        try:
            response: storage_pb2.AppendManyResponse = future.result()
        except grpc.RpcError as exc:
            error = error_from_rpc(exc, f"append to {len(picked)} partitions on {where}")
            if error.retriable and self._leaders is not None:
                self._leaders.invalidate()  # moved, fenced or unreachable: ask again
            self._complete_failed(picked, error)
            return
        answers = list(response.responses)
        if len(answers) < len(picked):  # no broker answers so: retried as a lost reply
            self._complete_failed(
                picked[len(answers) :],
                NetworkError(f"{len(answers)} answers to an append of {len(picked)} partitions"),
            )
        for item, answer in zip(picked, answers, strict=False):
            if answer.error.code == common_pb2.NONE:
                self._complete([item], [answer])
                continue
            topic, partition = item[1][0].tp
            error = error_for_code(
                int(answer.error.code),
                f"append to {topic}-{partition} on {where}: {answer.error.message}",
            )
            if error.retriable and self._leaders is not None:
                self._leaders.invalidate()  # moved or fenced: ask again
            self._complete_failed([item], error)

    def _pipe_for(self, leader: Leader) -> _Pipe | None:
        """The open pipe to the broker at ``address``, opened if need be; None while the
        broker refuses streams (``PIPE_REFUSED_BACKOFF_S``)."""
        address = leader.address
        with self._lock:
            pipe = self._pipes.get(address)
            if pipe is not None and not pipe.closed:
                return pipe
            if self._pipe_refused_until_s.get(address, 0.0) > time.monotonic():
                return None
            pipe = self._pipes[address] = _Pipe(leader)
        assert self._leaders is not None

        responses = self._leaders.append_stream_encoded(address)(_until_stop(pipe.requests))
        with self._lock:
            pipe.call = responses
        threading.Thread(
            target=self._read_pipe,
            args=(responses, pipe),
            name="tidelog-pipe-reader",
            daemon=True,
        ).start()
        return pipe

    def _read_pipe(self, responses: Any, pipe: _Pipe) -> None:
        answered = 0
        error: TidelogError
        try:
            for response in responses:
                answered += 1
                with self._lock:
                    if pipe.pending and pipe.pending[0] == response.correlation_id:
                        pipe.pending.popleft()  # answers come in request order
                    elif response.correlation_id in pipe.pending:
                        pipe.pending.remove(response.correlation_id)
                    picked, sent_at_s = self._take_in_flight(response.correlation_id)
                    pipe.heard_s = time.monotonic()
                if sent_at_s is not None:
                    self._metrics.record("request-latency", (time.monotonic() - sent_at_s) * 1000)
                if picked is None:
                    continue
                if tracing.ENABLED:
                    tracing.event(
                        "c_ack", response.correlation_id, response.base_offset, response.last_offset
                    )
                if response.error.code == common_pb2.NONE:
                    self._complete(picked, [response])
                    continue
                topic, partition = picked[0][1][0].tp
                error = error_for_code(
                    int(response.error.code),
                    f"append to {topic}-{partition} on {pipe.where}: {response.error.message}",
                )
                if error.retriable and self._leaders is not None:
                    self._leaders.invalidate()  # moved or fenced: ask again
                self._complete_failed(picked, error)
        except grpc.RpcError as exc:
            error = error_from_rpc(exc, f"append stream to {pipe.where}")
        else:
            error = NetworkError(f"the append stream to {pipe.where} ended")
        if not error.retriable:  # says nothing of each request: as the gateway stream's
            error = NetworkError(f"the append stream ended ({error}); its requests go again")
        with self._lock:
            pipe.closed = True
            if self._pipes.get(pipe.address) is pipe:
                del self._pipes[pipe.address]
            if pipe.timed_out:
                error = RequestTimedOutError(
                    f"append stream to {pipe.where}: no answer within request_timeout_ms "
                    f"({self._request_timeout_ms} ms)"
                )
            elif answered == 0 and isinstance(error, BrokerNotAvailableError):
                # Refused (the broker has max_append_streams open): unary appends until
                # PIPE_REFUSED_BACKOFF_S has passed.
                self._pipe_refused_until_s[pipe.address] = time.monotonic() + PIPE_REFUSED_BACKOFF_S
            stranded = []
            for correlation_id in pipe.pending:
                picked, _ = self._take_in_flight(correlation_id)
                if picked is not None:
                    stranded.append(picked)
            pipe.pending.clear()
        # gRPC's thread sending this stream's requests waits on the queue: told to stop,
        # as the gateway stream's is. Left waiting, every pipe that ended on its own (a
        # dead or hung broker, a refused stream) kept a thread for the life of the
        # process, close() too (found by an audit).
        pipe.requests.put(_STOP)
        if stranded and self._leaders is not None and error.retriable:
            self._leaders.invalidate()  # the broker may be gone: ask where leaders are
        for picked in stranded:  # in send order, so retries keep it
            self._complete_failed(picked, error)

    def _unary_answered(
        self, correlation_id: int, future: Any
    ) -> list[tuple[_PartitionQueue, list[_Batch]]] | None:
        """A unary append's (or AppendMany's) call ended: its picked batches, taken off the
        requests in flight, or None when there is nothing more to do (already taken, or
        never sent and failed here)."""
        with self._lock:
            picked, sent_at_s = self._take_in_flight(correlation_id)
        if picked is None:
            return None
        if future.cancelled():  # never sent: dropped by the sender's end (a forced close)
            self._complete_failed(picked, NetworkError("the producer was closed"))
            return None
        exc = future.exception()
        if exc is not None and not isinstance(exc, grpc.RpcError):
            # Not an answer: grpc raised something else (a bug). Failed here, since the
            # answer handlers expect RpcError only and their batches would never complete.
            self._complete_failed(picked, UnknownServerError(f"the append call raised {exc!r}"))
            return None
        if sent_at_s is not None:
            self._metrics.record("request-latency", (time.monotonic() - sent_at_s) * 1000)
        return picked

    def _append_answered(self, correlation_id: int, leader: Leader, future: Any) -> None:
        picked = self._unary_answered(correlation_id, future)
        if picked is None:
            return
        try:
            response: storage_pb2.AppendResponse = future.result()
            if tracing.ENABLED:
                tracing.event("c_ack", correlation_id, response.base_offset, response.last_offset)
        except grpc.RpcError as exc:
            topic, partition = picked[0][1][0].tp
            where = f"broker {leader.broker_id} ({leader.address})"
            error = error_from_rpc(exc, f"append to {topic}-{partition} on {where}")
            if error.retriable and self._leaders is not None:
                self._leaders.invalidate()  # moved, fenced or unreachable: ask again
            self._complete_failed(picked, error)
            return
        self._complete(picked, [response])

    def _encode(self, pq: _PartitionQueue, batch: _Batch) -> None:
        producer_id, epoch, sequence = -1, -1, -1
        if self._idempotent:
            if pq.producer_id != self._producer_id:
                pq.producer_id, pq.next_sequence = self._producer_id, 0
            producer_id, epoch, sequence = self._producer_id, self._producer_epoch, pq.next_sequence
        batch.producer_id = producer_id
        options: dict[str, Any] = {
            "compression": self._compression,
            "producer_id": producer_id,
            "producer_epoch": epoch,
            "base_sequence": sequence,
        }
        if batch.arrow_values is not None:
            batch.encoded = encode_batch_arrow_parts(
                batch.arrow_values,
                batch.arrow_keys,
                base_timestamp_ms=batch.timestamps[0],
                **options,
            )
        else:
            batch.encoded = [
                encode_batch(batch.values, batch.keys, batch.headers, batch.timestamps, **options)
            ]
        batch.encoded_bytes = sum(memoryview(part).nbytes for part in batch.encoded)
        if self._idempotent:
            # Only once encoded: a batch that failed to encode must not spend sequences,
            # or the partition's next batch would be refused as out of order.
            pq.next_sequence = (sequence + len(batch)) % 2**31

    def _init_producer_id(self) -> None:
        response: gateway_pb2.InitProducerIdResponse = self._conn.call(
            self._conn.stub.InitProducerId,
            gateway_pb2.InitProducerIdRequest(client_id=self._client_id),
            "init producer id",
        )
        self._producer_id = response.producer_id
        self._producer_epoch = response.producer_epoch

    # --- completion -----------------------------------------------------------------------

    def _complete(
        self,
        picked: list[tuple[_PartitionQueue, list[_Batch]]],
        results: Sequence[gateway_pb2.ProducePartitionResult | storage_pb2.AppendResponse],
    ) -> None:
        if len(results) < len(picked):
            # An answer without a result for some partitions (no server sends one): treat
            # those as unanswered - retried like a lost reply - rather than leave their
            # futures, and flush(), waiting forever.
            self._complete_failed(
                picked[len(results) :],
                NetworkError(f"{len(results)} results answered {len(picked)} partitions"),
            )
        for (pq, batches), result in zip(picked, results, strict=False):
            if result.error.code == common_pb2.NONE:
                offset = result.base_offset
                for batch in batches:
                    self._succeed(batch, offset, result.log_append_time_ms)
                    if offset >= 0:
                        offset += len(batch)
                with self._lock:
                    pq.request_done(batches, failed=False)
                    pq.acknowledged_id = batches[-1].producer_id
                    self._lock.notify_all()
            else:
                error = error_for_code(int(result.error.code), result.error.message)
                self._complete_failed([(pq, batches)], error)

    def _refused_after_predecessor(self, pq: _PartitionQueue, batches: list[_Batch]) -> bool:
        """(lock held) Whether an OUT_OF_ORDER_SEQUENCE refusal of ``batches`` is explained
        by an earlier batch of the partition: one still unfinished (queued for a retry or
        in flight), or one that failed for good, after which the producer id changed. The
        refusal means nothing of the request was written, so the batches may be retried -
        under the new producer id in the second case (``_retry``)."""
        first = batches[0].ordinal
        if any(b.ordinal < first for b in pq.batches):
            return True
        for items in self._in_flight.values():
            for other, others in items:
                if other is pq and others[0].ordinal < first:
                    return True
        return batches[0].producer_id != self._producer_id

    def _complete_failed(
        self, picked: list[tuple[_PartitionQueue, list[_Batch]]], error: TidelogError
    ) -> None:
        now = time.monotonic()
        for pq, answered in picked:
            batches = answered  # what the request carried (its in-flight count)
            with self._lock:
                refused = isinstance(
                    error, OutOfOrderSequenceError
                ) and self._refused_after_predecessor(pq, batches)
            # A request of several batches refused as DUPLICATE_SEQUENCE mixes batches the
            # leader has with ones it has not: a new leader that had replicated only the
            # first of them (a fetch ends on a batch boundary). Nothing was written, so
            # each is retried in a request of its own, where a written one is answered
            # with its offsets and the rest are appended.
            split = isinstance(error, DuplicateSequenceError) and len(batches) > 1
            if split:
                with self._lock:
                    for batch in batches:
                        batch.request_key = next(self._request_keys)
            if error.retriable:
                for batch in batches:
                    batch.maybe_written = batch.maybe_written or batch.sent
            # The gateway's RECORD_LIST_TOO_LARGE is about the whole request, which
            # carried other partitions' batches too, and says nothing of whether an
            # earlier attempt wrote these (the leader's MESSAGE_TOO_LARGE comes after its
            # duplicate check: then they are not written). Batches that may be written
            # are sent again unchanged, in a request of their own; cut in two, as new
            # batches under a new producer id, their records were written twice (found
            # by an audit).
            unsure = isinstance(error, RecordListTooLargeError) and any(
                b.maybe_written for b in batches
            )
            alone_now = unsure and not all(b.alone for b in batches)
            if alone_now:
                for batch in batches:
                    batch.alone = True
            if (
                not unsure
                and isinstance(error, MessageTooLargeError | RecordListTooLargeError)
                and (len(batches) > 1 or len(batches[0]) > 1)
            ):
                # Kafka's splitAndReenqueue: records that each fit max.message.bytes but
                # not together (a topic's limit below batch_bytes) all failed here. Each
                # batch of several records goes back as two halves, each batch in a
                # request of its own (a request's batches share the partition's error).
                with self._lock:
                    batches = [half for batch in batches for half in self._halves(batch)]
                    for batch in batches:
                        batch.request_key = next(self._request_keys)
                split = True
            # A split batch is no retry (Kafka splits "regardless of retries"): with
            # retries=0, records that each fit a topic's max.message.bytes but not
            # together all failed (found by an audit).
            retry = [
                b
                for b in batches
                if self._broken is None
                and (error.retriable or refused or split or alone_now)
                and (split or alone_now or b.attempts <= self._retries)
                and now - b.created_s < self._delivery_timeout_s
            ]
            if tracing.ENABLED:
                tracing.event(
                    "c_fail",
                    batches[0].tp[1],
                    type(error).__name__,
                    "retry" if retry and len(retry) == len(batches) else "fail",
                    str(error)[:200].replace("\n", " "),
                )
            if isinstance(error, UnknownTopicOrPartitionError | InconsistentTopicIdError):
                # The topic was deleted, or re-created with fewer partitions: the next
                # records are placed by a count looked up again.
                self._counts.pop(batches[0].tp[0], None)
            closed = False
            if retry and len(retry) == len(batches):
                with self._lock:
                    # Checked again under the lock close() (and a failed sender) takes to
                    # fail what is queued: a batch requeued after that would never complete.
                    closed = self._aborted is not None
                    broken = self._broken is not None
                    if not closed and not broken:
                        if refused and batches[0].producer_id != self._producer_id:
                            # Encoded under a producer id given up since: not written (the
                            # leader refused it), so it is sent again as new under the next
                            # id.
                            for batch in batches:
                                batch.encoded = None
                                batch.sent = False
                                batch.request_key = 0
                        for batch in batches:
                            batch.last_error = error
                        pq.requeue(batches)
                        self._watch_expiry(batches)
                        pq.retry_at_s = now + RETRY_BACKOFF_S
                        pq.request_done(answered, failed=True)
                        self._lock.notify_all()
                if not closed and not broken:
                    self._metrics.add("record-retry-total", sum(len(b) for b in batches))
                    continue
            for batch in batches:
                # A batch close() stopped from being retried fails as close() fails the rest.
                self._fail(batch, self._closed_error(batch) if closed else error)
            with self._lock:
                if self._idempotent and any(b.sent for b in answered):
                    # The leader's sequence state for this id is unknown now: start afresh.
                    self._producer_id = -1
                pq.request_done(answered, failed=True)
                self._lock.notify_all()

    def _halves(self, batch: _Batch) -> list[_Batch]:
        """(lock held) ``batch`` cut in two, to be sent again as new batches (``[batch]``
        as it is when it holds one record). Its sequence numbers were spent and not
        written: with idempotence the producer takes a new producer id, as after any
        failed batch, under which the halves and what follows them are numbered anew."""
        n = len(batch)
        if n < 2:
            return [batch]
        middle = n // 2
        halves = [_Batch(batch.tp), _Batch(batch.tp)]
        for half, (lo, hi) in zip(halves, ((0, middle), (middle, n)), strict=True):
            half.topic_id = batch.topic_id
            half.created_s = batch.created_s  # its delivery timeout still counts from here
            half.attempts = batch.attempts  # (not counted as first sends again)
            half.generation = batch.generation
            half.last_error = batch.last_error
            if batch.arrow_values is not None:
                half.arrow_values = batch.arrow_values.slice(lo, hi - lo)
                if batch.arrow_keys is not None:
                    half.arrow_keys = batch.arrow_keys.slice(lo, hi - lo)
                half.timestamps = list(batch.timestamps)
            else:
                half.values = batch.values[lo:hi]
                if batch.keys is not None:
                    half.keys = batch.keys[lo:hi]
                if batch.headers is not None:
                    half.headers = batch.headers[lo:hi]
                half.timestamps = batch.timestamps[lo:hi]
            half.record_futures = [(i - lo, f) for i, f in batch.record_futures if lo <= i < hi]
            # A send_batch slice: its group indices follow the batch's records in order.
            half.group_slots = [(group, indices[lo:hi]) for group, indices in batch.group_slots]
        first, second = halves
        first.size_bytes = batch.size_bytes * middle // n
        second.size_bytes = batch.size_bytes - first.size_bytes
        # Between them they hold what the batch held of the buffer, no more: each giving
        # back a share of its size over-released a batch larger than the buffer, and the
        # buffer bound weakened by that much at every such split (found by an audit).
        first.reserved_bytes = batch.reserved_bytes * middle // n
        second.reserved_bytes = batch.reserved_bytes - first.reserved_bytes
        first.ordinal_room = second.ordinal_room = batch.ordinal_room / 2
        first.ordinal, second.ordinal = batch.ordinal, batch.ordinal + first.ordinal_room
        # One unfinished batch more, in the same flush generation, and one more batch for
        # each send_batch group to wait for; the original is done with, completed by none.
        self._unfinished += 1
        self._unfinished_by_generation[batch.generation] += 1
        for group, _ in batch.group_slots:
            group.pending += 1
        batch.finished = True
        batch.record_futures, batch.group_slots = [], []
        if self._idempotent and batch.sent:
            self._producer_id = -1
        return halves

    def _finishing(self, batch: _Batch) -> bool:
        """Whether ``batch`` is yet to be completed, marking it completed. Only a failed
        sender (``_sender_failed``) can complete a batch that a request in flight will
        complete again."""
        with self._lock:
            if batch.finished:
                return False
            batch.finished = True
            return True

    def _finish(self, batch: _Batch) -> None:
        with self._lock:
            self._buffered_bytes -= batch.reserved_bytes
            self._unfinished -= 1
            counts = self._unfinished_by_generation
            left = counts[batch.generation] - 1
            if left:
                counts[batch.generation] = left
            else:
                del counts[batch.generation]
            self._lock.notify_all()

    def _resolve(self, future: Future[Any], result: Any, error: BaseException | None) -> None:
        """Complete a future, marking this thread as running callbacks meanwhile. A
        future its caller cancelled is done already: set_result would raise
        InvalidStateError and kill the thread that completes batches, and every later
        request of the producer would wait for ever."""
        self._completing.active = True
        try:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        except InvalidStateError:
            pass  # cancelled: nobody wants the result
        except BaseException as exc:  # a caller's callback, not ours
            # concurrent.futures catches a callback's Exception, not SystemExit (a
            # sys.exit() in a callback): it killed this thread, and the producer hung for
            # good (found by an audit). The future is done; its later callbacks are lost.
            _log.error("a callback of a send's future raised %r; ignored", exc)
        finally:
            self._completing.active = False

    def _succeed(self, batch: _Batch, base_offset: int, log_append_time_ms: int = -1) -> None:
        """``log_append_time_ms``: the broker's stamp on a LogAppendTime topic (-1 for
        CreateTime, and for acks=0), which is every record's timestamp there, as in
        Kafka's RecordMetadata."""
        if not self._finishing(batch):
            return
        topic, partition = batch.tp
        for index, future in batch.record_futures:
            offset = base_offset + index if base_offset >= 0 else -1
            timestamp_ms = (
                log_append_time_ms if log_append_time_ms >= 0 else batch.timestamps[index]
            )
            self._resolve(future, RecordMetadata(topic, partition, offset, timestamp_ms), None)
        for group, indices in batch.group_slots:
            n = len(indices)
            if log_append_time_ms >= 0:
                if group.append_times is None:
                    group.append_times = array("q", [-1]) * len(group.offsets)
                if isinstance(indices, range):
                    stamps = array("q", [log_append_time_ms]) * n
                    group.append_times[indices.start : indices.stop] = stamps
                else:
                    for i in indices:
                        group.append_times[i] = log_append_time_ms
            if isinstance(indices, range):
                group.partitions[indices.start : indices.stop] = array("i", [partition]) * n
                if base_offset >= 0:
                    group.runs.append((indices.start, indices.stop, base_offset))
                else:
                    group.offsets[indices.start : indices.stop] = array("q", [-1]) * n
            else:
                for j, i in enumerate(indices):
                    group.partitions[i] = partition
                    group.offsets[i] = base_offset + j if base_offset >= 0 else -1
            self._group_done(group)
        self._finish(batch)

    def _fail(self, batch: _Batch, error: TidelogError) -> None:
        if not self._finishing(batch):
            return
        self._metrics.add("record-error-total", len(batch))
        for _, future in batch.record_futures:
            self._resolve(future, None, error)
        for group, _ in batch.group_slots:
            group.error = group.error or error
            self._group_done(group)
        self._finish(batch)

    def _group_done(self, group: _Group) -> None:
        with self._lock:
            group.pending -= 1
            if group.pending:
                return
        if group.error is not None:
            self._resolve(group.future, None, group.error)
        else:
            self._resolve(
                group.future,
                BatchMetadata(
                    group.topic,
                    group.partitions,
                    group.offsets,
                    group.timestamp_ms,
                    group.runs,
                    append_times=group.append_times,
                ),
                None,
            )
