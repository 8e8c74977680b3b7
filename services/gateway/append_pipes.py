"""Pipelined appends from one client ProduceStream to the partition leaders.

A producer may keep several requests of a partition in flight on its ProduceStream
(Kafka's ``max.in.flight.requests.per.connection``), and a batch must not wait for the
previous one's acknowledgement before it goes to the leader, or the gateway only moves
that wait from the client into itself (BENCHMARKS.md, items 47 and 53). The gateway keeps
a partition's order instead: a client stream's appends to one leader go down one
``AppendStream`` (an ``AppendPipe``) in the order the client stream brought them. The
leader appends a stream's requests in arrival order and answers them in that order
(``StorageServicer._pipelined_appends``).

Invariants:

* a pipe belongs to one client stream (``StreamPipes``) and one broker, and ends with
  that stream: the client's own request timeout, which cancels its stream when a leader
  goes silent, is what cancels a hung pipe;
* an answer is passed on as the leader gave it, errors included; a retriable one (the
  leader moved) goes back to the client, whose producer retries its batches in sequence
  order. The gateway does not re-route a pipelined append itself, because a retry here
  could overtake the requests already behind it on the pipe;
* a pipe that ends fails everything still pending on it with a retriable error, in the
  order sent;
* a broker out of append streams (``--max-append-streams``) refuses the pipe before any
  answer: ``RefusedBrokers`` remembers it for ``PIPE_REFUSED_BACKOFF_S``, and appends to
  it take the unary path meanwhile.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Final

import grpc

from services.controller.state import Broker
from services.gateway.channels import Channels, broker_address
from services.status import error_from_rpc_error
from tidelog.errors import BrokerNotAvailableError, NetworkError, TidelogError
from tidelog.v1 import storage_pb2

PIPE_REFUSED_BACKOFF_S: Final = 30.0
"""How long appends to a broker that refused a pipe take the unary path."""

_STOP: Final = object()


def _until_stop(requests: queue.SimpleQueue[Any]) -> Iterator[bytes]:
    """The pipe's request iterator, read by gRPC: encoded requests until ``_STOP``."""
    while (item := requests.get()) is not _STOP:
        yield item


class RefusedBrokers:
    """Brokers that refused an append pipe lately (module docstring). Thread-safe."""

    def __init__(self, backoff_s: float = PIPE_REFUSED_BACKOFF_S) -> None:
        self._lock = threading.Lock()
        self._until_s: dict[str, float] = {}
        self._backoff_s = backoff_s

    def refused(self, address: str) -> None:
        with self._lock:
            self._until_s[address] = time.monotonic() + self._backoff_s

    def is_refusing(self, address: str) -> bool:
        with self._lock:
            until_s = self._until_s.get(address)
            if until_s is not None and until_s <= time.monotonic():
                del self._until_s[address]
                until_s = None
            return until_s is not None


class AppendPipe:
    """One AppendStream to one broker for one client stream; see the module docstring.

    ``send`` queues an encoded ``AppendRequest`` and returns the future of its answer;
    a reader thread completes the futures as the answers come (in request order)."""

    def __init__(
        self,
        call: grpc.StreamStreamMultiCallable[bytes, storage_pb2.AppendResponse],
        address: str,
        refused: RefusedBrokers,
    ) -> None:
        self.address = address
        self.closed = False  # set once, by the reader, when the stream has ended
        self._refused = refused
        self._lock = threading.Lock()
        self._pending: dict[int, Future[storage_pb2.AppendResponse]] = {}  # in send order
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._call: Any = call(_until_stop(self._requests))
        threading.Thread(target=self._read, name="gateway-append-pipe", daemon=True).start()

    def send(
        self, encoded: bytes, correlation_id: int
    ) -> Future[storage_pb2.AppendResponse] | None:
        """The answer's future, or None when the pipe has ended (nothing was sent)."""
        future: Future[storage_pb2.AppendResponse] = Future()
        with self._lock:
            if self.closed:
                return None
            self._pending[correlation_id] = future
            self._requests.put(encoded)
        return future

    def close(self) -> None:
        """End the stream once the leader has answered what was sent."""
        self._requests.put(_STOP)

    def cancel(self) -> None:
        """End the stream now; what is pending fails (the client is gone)."""
        self._call.cancel()

    def _read(self) -> None:
        answered = 0
        error: TidelogError
        try:
            for response in self._call:
                answered += 1
                with self._lock:
                    future = self._pending.pop(response.correlation_id, None)
                if future is not None:
                    future.set_result(response)
            error = NetworkError(f"the append stream to {self.address} ended")
        except grpc.RpcError as exc:
            error = error_from_rpc_error(exc)
        with self._lock:
            self.closed = True
            stranded = list(self._pending.values())
            self._pending.clear()
        self._requests.put(_STOP)
        if answered == 0 and isinstance(error, BrokerNotAvailableError):
            self._refused.refused(self.address)
        if not error.retriable:
            # Whatever ended the stream, nothing of the stranded requests is known to be
            # written or not: the client retries them (idempotent producers safely).
            error = NetworkError(f"the append stream to {self.address} ended: {error.message}")
        for future in stranded:
            future.set_exception(error)


class StreamPipes:
    """One client stream's pipes, one per broker, opened on first use. Used by the
    stream's reader thread only, apart from ``cancel``."""

    def __init__(self, channels: Channels, refused: RefusedBrokers) -> None:
        self._channels = channels
        self._refused = refused
        self._lock = threading.Lock()
        self._pipes: dict[str, AppendPipe] = {}
        self._ended = False

    def pipe(self, broker: Broker) -> AppendPipe | None:
        """The open pipe to ``broker``, opened if need be; None while the broker refuses
        pipes, or once the stream is over."""
        address = broker_address(broker)
        with self._lock:
            if self._ended:
                return None
            pipe = self._pipes.get(address)
            if pipe is not None and not pipe.closed:
                return pipe
            if self._refused.is_refusing(address):
                return None
            pipe = self._pipes[address] = AppendPipe(
                self._channels.storage_append_stream_encoded(broker), address, self._refused
            )
            return pipe

    def close(self) -> None:
        """No more requests: every pipe ends once its answers are in."""
        self._end(AppendPipe.close)

    def cancel(self) -> None:
        """The client stream is gone: every pipe ends now."""
        self._end(AppendPipe.cancel)

    def _end(self, how: Callable[[AppendPipe], None]) -> None:
        with self._lock:
            self._ended = True
            pipes = list(self._pipes.values())
        for pipe in pipes:
            how(pipe)
