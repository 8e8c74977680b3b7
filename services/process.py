"""Running a service as an OS process: start, announce, serve until SIGTERM/SIGINT/SIGHUP, stop.

Every ``tidelog <service>`` command (storage, controller, and the planes to come) runs
the same way, so it lives here once: the person at the terminal gets one line on failure,
never a traceback (the traceback goes to the JSON log), and a signal stops the node
cleanly from the main thread.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import resource
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from functools import partial
from types import FrameType
from typing import TYPE_CHECKING, Any, Final, Protocol

import grpc
import structlog

from services.allocator import retain_freed_memory
from services.status import abort
from tidelog.addresses import format_host_port
from tidelog.errors import InvalidRequestError, TidelogError
from tidelog.stop_flag import StopFlag

_log = structlog.get_logger("tidelog.process")

KEEPALIVE_SERVER_OPTIONS: Final = [
    # Clients (gateways, the SDK) ping idle channels every 10-30 s to notice dead peers.
    # gRPC servers by default allow one ping per 5 minutes and answer more with GOAWAY
    # "too_many_pings", which kills every stream on the connection; allow them instead.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]
"""Options every tidelog gRPC server adds."""


format_address = format_host_port
"""``host:port``, with an IPv6 host in brackets (the SDK's rule, shared)."""


HEALTH_CHECK_METHOD: Final = "/grpc.health.v1.Health/Check"
"""The one method exempt from the concurrency limit (see ``ConcurrencyLimiter``)."""

RESERVED_WORKERS: Final = 4
"""Threads of the reserve pool: health checks and refusals only, each done in microseconds."""

EXEMPT_HEADROOM: Final = 1_024
"""Calls beyond ``max_concurrent_rpcs`` that gRPC still admits (for health checks and for
the refusals the limiter answers); past that gRPC itself refuses, so the total of calls
held by a server stays bounded even under a flood of health checks."""


class CountingThreadPool(futures.ThreadPoolExecutor):
    """A thread pool that knows how many of the tasks submitted to it have not finished.

    gRPC submits one task per admitted call, so ``in_flight`` is the number of calls
    running or queued for a thread. Counted by future completion, so a call cancelled
    while queued (whose handler never runs) is released all the same.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._count_lock = threading.Lock()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future[Any]:
        with self._count_lock:
            self._in_flight += 1
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._release(None)
            raise
        future.add_done_callback(self._release)
        return future

    def _release(self, future: futures.Future[Any] | None) -> None:
        del future
        with self._count_lock:
            self._in_flight -= 1


def _on_pool(behavior: Callable[..., Any], pool: futures.ThreadPoolExecutor) -> Callable[..., Any]:
    """``behavior`` run on ``pool`` instead of the server's pool (gRPC looks for the
    attribute ``experimental_thread_pool`` on a handler's behavior)."""

    def run(request: Any, context: grpc.ServicerContext) -> Any:
        return behavior(request, context)

    run.experimental_thread_pool = pool  # type: ignore[attr-defined]
    return run


def _same_shape(
    handler: grpc.RpcMethodHandler[Any, Any],
    behavior: Callable[..., Any],
    *,
    parse_requests: bool = True,
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of ``handler``'s streaming shape that runs ``behavior``."""
    kwargs: dict[str, Any] = {
        "request_deserializer": handler.request_deserializer if parse_requests else None,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior, **kwargs)
    return grpc.unary_unary_rpc_method_handler(behavior, **kwargs)


def _parse_or_refuse(
    deserializer: Callable[[bytes], Any], method: str, context: grpc.ServicerContext, raw: bytes
) -> Any:
    """``raw`` parsed by ``deserializer``; bytes that do not parse end the call with
    INVALID_ARGUMENT (INVALID_REQUEST in the trailer) and a message naming the method."""
    try:
        return deserializer(raw)
    except Exception as exc:  # protobuf's DecodeError, or a custom parser's error
        reason = str(exc) or type(exc).__name__
        error = InvalidRequestError(
            f"the request to {method} is not a valid protobuf message of its type: {reason}"
        )
    abort(context, error)


def _parsing_in_behavior(
    handler: grpc.RpcMethodHandler[Any, Any], method: str
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` with its requests parsed inside its behavior instead of by gRPC.

    gRPC answers a request that does not parse (a truncated field, a string that is not
    UTF-8: what a client in another language or a broken proxy may send) with INTERNAL
    "Exception deserializing request!" and a logged traceback: no precise status, no
    error code, on every method (found by an audit). Parsed here, such a request is
    answered INVALID_ARGUMENT, as any other bad input is; a stream's bad message ends the
    stream the same way (on whichever thread reads it). The behavior's own pool
    (``experimental_thread_pool``) is kept."""
    deserializer = handler.request_deserializer
    behavior = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )
    if deserializer is None or behavior is None:
        return handler  # takes bytes as they are

    def run_streaming(raw_requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        # map and partial rather than a generator: one Python frame less per message of
        # a stream (a broker's AppendStream takes thousands a second).
        parse = partial(_parse_or_refuse, deserializer, method, context)
        return behavior(map(parse, raw_requests), context)

    def run_unary(raw: bytes, context: grpc.ServicerContext) -> Any:
        return behavior(_parse_or_refuse(deserializer, method, context, raw), context)

    run = run_streaming if handler.request_streaming else run_unary
    pool = getattr(behavior, "experimental_thread_pool", None)
    if pool is not None:
        run.experimental_thread_pool = pool  # type: ignore[union-attr]
    return _same_shape(handler, run, parse_requests=False)


if TYPE_CHECKING:  # generic only in the type stubs
    _ServerInterceptor = grpc.ServerInterceptor[Any, Any]
else:
    _ServerInterceptor = grpc.ServerInterceptor


class ConcurrencyLimiter(_ServerInterceptor):
    """At most ``limit`` calls in flight (running or queued for a thread); beyond that,
    RESOURCE_EXHAUSTED with a message - except health checks, which always answer.

    Why not gRPC's own ``maximum_concurrent_rpcs``: it counts health checks like any
    call, so a flood that fills the limit also fails the liveness probe, and an
    orchestrator then restarts a server that was only busy. Health checks also share the
    thread pool with everything else, so behind a queue of long polls they would wait
    for seconds even if admitted. Here ``Health/Check`` is never counted and runs on a
    small reserve pool of its own, and so do the refusals (cheap, so they never queue
    behind the calls they refuse). ``Health/Watch`` and reflection are streams that may
    stay open indefinitely, so they count like any call.

    Runs on gRPC's serving thread, before the call is handed to a pool: O(1) per call.
    """

    def __init__(
        self,
        *,
        role: str,
        limit: int,
        pool: CountingThreadPool,
        reserve: futures.ThreadPoolExecutor,
        method_pools: Sequence[CountingThreadPool] = (),
    ) -> None:
        if limit < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {limit}")
        self._role = role
        self._limit = limit
        self._pools = (pool, *method_pools)  # calls in flight are counted over all of them
        self._reserve = reserve
        # Method name -> its handler parsing requests itself (_parsing_in_behavior): made
        # once per method, as gRPC hands the same registered handler for every call.
        self._parsing: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # gRPC answers UNIMPLEMENTED
        if handler_call_details.method == HEALTH_CHECK_METHOD and handler.unary_unary:
            return _same_shape(handler, _on_pool(handler.unary_unary, self._reserve))
        in_flight = sum(pool.in_flight for pool in self._pools)
        if in_flight < self._limit:
            method = handler_call_details.method
            parsing = self._parsing.get(method)
            if parsing is None:
                parsing = self._parsing[method] = _parsing_in_behavior(handler, method)
            return parsing
        message = (
            f"{self._role} is busy: {in_flight} concurrent calls in progress, the limit is "
            f"{self._limit} (max_concurrent_rpcs); retry with backoff"
        )

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            del request
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

        # A refused request's bytes are never parsed.
        return _same_shape(handler, _on_pool(refuse, self._reserve), parse_requests=False)


def new_server(
    *,
    role: str,
    max_workers: int,
    max_message_bytes: int,
    max_concurrent_rpcs: int,
    method_pools: Sequence[CountingThreadPool] = (),
    max_send_message_bytes: int | None = None,
) -> grpc.Server:
    """A gRPC server as every tidelog service runs one: a bounded thread pool, a message
    size limit both ways (``max_send_message_bytes``: another for what it sends), one
    process per port, client keepalive pings allowed, and RESOURCE_EXHAUSTED beyond
    ``max_concurrent_rpcs`` calls in flight instead of an unbounded queue - health checks
    exempt (``ConcurrencyLimiter``). ``method_pools`` are the pools some methods run on
    instead (``add_servicer_answering_encoded``): their calls count toward the limit
    too."""
    pool = CountingThreadPool(max_workers=max_workers, thread_name_prefix=f"{role}-rpc")
    reserve = futures.ThreadPoolExecutor(
        max_workers=RESERVED_WORKERS, thread_name_prefix=f"{role}-reserve"
    )
    return grpc.server(
        pool,
        interceptors=[
            ConcurrencyLimiter(
                role=role,
                limit=max_concurrent_rpcs,
                pool=pool,
                reserve=reserve,
                method_pools=method_pools,
            )
        ],
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_send_message_bytes or max_message_bytes),
            # One port per process: a second process on the same port is a mistake.
            ("grpc.so_reuseport", 0),
            *KEEPALIVE_SERVER_OPTIONS,
        ],
        # The outer bound; the limiter refuses ordinary calls long before it.
        maximum_concurrent_rpcs=max_concurrent_rpcs + EXEMPT_HEADROOM,
    )


class _Registrations:
    """Stands in for a server to collect what a generated ``add_*Servicer_to_server``
    registers, so some handlers can be replaced before the real registration."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        del handlers  # the generated code registers the same handlers below

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self.service, self.handlers = service, dict(handlers)


def add_servicer_answering_encoded(
    add_generated: Callable[[Any, Any], None],
    servicer: object,
    server: grpc.Server,
    encoded: dict[str, tuple[Callable[..., bytes], Callable[[bytes], Any]]],
    pools: Mapping[str, futures.ThreadPoolExecutor] | None = None,
) -> None:
    """Register ``servicer`` as the generated ``add_generated`` does, except that the
    unary methods in ``encoded`` (name -> (behaviour, request deserializer)) answer bytes
    that are already their encoded response (tidelog.wire): gRPC sends them as they are,
    without protobuf's costly re-encoding of batch bytes. Those named in ``pools`` run on
    that pool instead of the server's (threads calls of other methods cannot take)."""
    registrations = _Registrations()
    add_generated(servicer, registrations)
    for name, (behaviour, deserializer) in encoded.items():
        pool = (pools or {}).get(name)
        registrations.handlers[name] = grpc.unary_unary_rpc_method_handler(
            behaviour if pool is None else _on_pool(behaviour, pool),
            request_deserializer=deserializer,
            response_serializer=None,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(registrations.service, registrations.handlers),)
    )
    # Registered methods are what generated client stubs call (the stubs in grpc-stubs
    # predate the method, hence the getattr).
    getattr(server, "add_registered_method_handlers")(  # noqa: B009
        registrations.service, registrations.handlers
    )


def bind(server: grpc.Server, host: str, port: int) -> int:
    """Listen on ``host:port`` (port 0: any free port); returns the port. OSError if not.

    A host name is resolved here and every address it has is bound, at one port: gRPC
    binds a name's addresses as one and succeeds if any of them is free, so a second node
    told ``localhost:P`` started while another held 127.0.0.1:P, serving ::1 only and
    announcing an address that reached the other (found by an audit)."""
    target = format_address(host, port)
    bound = port
    for address in _listen_addresses(host, target):
        try:
            bound = server.add_insecure_port(format_address(address, bound))
        except RuntimeError as exc:  # grpc raises RuntimeError("Failed to bind ...")
            raise OSError(f"cannot listen on {target}: {exc}") from exc
        if bound == 0:
            raise OSError(f"cannot listen on {target} (in use?)")
    return bound


def _listen_addresses(host: str, target: str) -> list[str]:
    """``host`` itself if it is an address or a wildcard, else the addresses it resolves
    to, in the resolver's order, each once."""
    if host in ("", "0.0.0.0", "::"):
        return [host]
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return [host]
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise OSError(f"cannot listen on {target}: {exc}") from exc
    return list(dict.fromkeys(str(info[4][0]) for info in found))


class ServiceNode(Protocol):
    """What ``serve_until_signal`` needs of a node."""

    @property
    def address(self) -> str: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit, as the JVM does for
    Kafka (-XX:+MaxFDLimit): a storage node holds about three descriptors per segment
    (docs/DEPLOY.md), and the soft limit a shell or container starts with (often 1,024)
    is used up by a few hundred partitions; running out halts a storage node. Returns
    the (soft, hard) limits now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Linux refuses an unlimited soft limit for files: at most the kernel's maximum.
    target = hard if hard != resource.RLIM_INFINITY else _nr_open()
    if soft != resource.RLIM_INFINITY and target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            _log.warning("open_files_limit_not_raised", soft=soft, hard=hard, error=str(exc))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open", encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1_048_576


def serve_until_signal(command: str, node: ServiceNode, announce: str) -> int:
    """Start ``node``, print ``announce`` (it must contain ``listening on {address}``),
    serve until SIGTERM, SIGINT or SIGHUP, then stop it. Returns the process exit status."""
    stop_requested = StopFlag()  # not a threading.Event: see tidelog.stop_flag

    def request_stop(signum: int, frame: FrameType | None) -> None:
        del frame
        stop_requested.set(signum)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    # A closed terminal or a dropped ssh session (the JVM runs Kafka's clean shutdown on
    # it too): by default SIGHUP ended a foreground node with no controlled shutdown and
    # no flush (found by an audit).
    signal.signal(signal.SIGHUP, request_stop)
    retain_freed_memory()  # before the first message buffer is allocated
    soft, hard = raise_open_files_limit()
    _log.info("open_files_limit", soft=soft, hard=hard)
    # A node whose start can wait (a storage node waiting out its previous registration)
    # gives up at a signal instead of finishing its start first and then stopping.
    watch_abort = getattr(node, "abort_start_on", None)
    if watch_abort is not None:
        watch_abort(stop_requested)
    try:
        node.start()
    except Exception as exc:
        if stop_requested.is_set():
            _log.info("stopped_while_starting", error=str(exc))
            node.stop()
            return 0
        expected = isinstance(exc, (OSError, ValueError, TidelogError))
        if expected:
            _log.error("start_failed", error=str(exc))
        else:  # a bug (e.g. met during recovery): keep the traceback in the log
            _log.exception("start_failed")
        detail = str(exc) if expected else f"{type(exc).__name__}: {exc}"
        print(f"tidelog {command}: error: {detail}", file=sys.stderr)
        node.stop()
        return 1
    try:
        print(announce.format(address=node.address), flush=True)
    except OSError as exc:
        # Nobody reads stdout: the supervisor that started this process is gone (killed
        # while it started). Stopped cleanly (deregistered, flushed) rather than ended by
        # the traceback, which left the registration for its TTL (found by an audit).
        _log.error("announce_failed", error=str(exc))
        with contextlib.suppress(OSError):  # the flush at exit would fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        node.stop()
        return 1
    # Short sleeps keep the main thread returning to the interpreter, where signal
    # handlers run.
    while not stop_requested.wait(1.0):
        pass
    first = stop_requested.first_signal
    _log.info("signal_received", signal=signal.Signals(first).name if first else None)
    node.stop()
    return 0
