"""Running a service as an OS process: start, announce, serve until SIGTERM/SIGINT, stop.

Every ``tidelog <service>`` command (storage, controller, and the planes to come) runs
the same way, so it lives here once: the person at the terminal gets one line on failure,
never a traceback (the traceback goes to the JSON log), and a signal stops the node
cleanly from the main thread.
"""

from __future__ import annotations

import signal
import sys
import threading
from concurrent import futures
from types import FrameType
from typing import Final, Protocol

import grpc
import structlog

from tidelog.errors import TidelogError

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


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def new_server(
    *, role: str, max_workers: int, max_message_bytes: int, max_concurrent_rpcs: int
) -> grpc.Server:
    """A gRPC server as every tidelog service runs one: a bounded thread pool, a message
    size limit both ways, one process per port, client keepalive pings allowed, and
    RESOURCE_EXHAUSTED beyond ``max_concurrent_rpcs`` instead of an unbounded queue."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"{role}-rpc"),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # One port per process: a second process on the same port is a mistake.
            ("grpc.so_reuseport", 0),
            *KEEPALIVE_SERVER_OPTIONS,
        ],
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )


def bind(server: grpc.Server, host: str, port: int) -> int:
    """Listen on ``host:port`` (port 0: any free port); returns the port. OSError if not."""
    target = format_address(host, port)
    try:
        bound = server.add_insecure_port(target)
    except RuntimeError as exc:  # grpc raises RuntimeError("Failed to bind ...")
        raise OSError(f"cannot listen on {target}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot listen on {target}")
    return bound


class ServiceNode(Protocol):
    """What ``serve_until_signal`` needs of a node."""

    @property
    def address(self) -> str: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


def serve_until_signal(command: str, node: ServiceNode, announce: str) -> int:
    """Start ``node``, print ``announce`` (it must contain ``listening on {address}``),
    serve until SIGTERM or SIGINT, then stop it. Returns the process exit status."""
    stop_requested = threading.Event()
    received: list[int] = []

    def request_stop(signum: int, frame: FrameType | None) -> None:
        # Only set flags here: the handler may interrupt the main thread anywhere, even
        # inside a write of a log line.
        del frame
        received.append(signum)
        stop_requested.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        node.start()
    except Exception as exc:
        expected = isinstance(exc, (OSError, ValueError, TidelogError))
        if expected:
            _log.error("start_failed", error=str(exc))
        else:  # a bug (e.g. met during recovery): keep the traceback in the log
            _log.exception("start_failed")
        detail = str(exc) if expected else f"{type(exc).__name__}: {exc}"
        print(f"tidelog {command}: error: {detail}", file=sys.stderr)
        node.stop()
        return 1
    print(announce.format(address=node.address), flush=True)
    # A timeout keeps the main thread returning to the interpreter, where signal
    # handlers run.
    while not stop_requested.wait(1.0):
        pass
    _log.info("signal_received", signal=signal.Signals(received[0]).name if received else None)
    node.stop()
    return 0
