"""Ceilings measured on this machine in the same run as the benchmarks they bound.

- ``grpc_put_mb_s``: a trivial Python gRPC service that accepts 1 MiB byte messages and
  answers with their length, called from one Python client with several calls in flight:
  what moving bytes through one Python gRPC hop costs, with no storage behind it.
- ``disk_write_mb_s``: sequential 1 MiB writes to a file in the benchmark's directory,
  with or without an ``fdatasync`` after every write.
- ``loopback_tcp_mb_s``: one TCP connection on 127.0.0.1, 1 MiB sends, a reader thread.
- ``grpc_crossings_ms``: the latency floor of the end-to-end case. Every tick, two calls
  in a row to a trivial Python gRPC echo service in another process, each carrying a
  tick's bytes both ways: four process crossings with nothing behind them, as many as a
  record makes from producer to consumer (producer -> leader -> follower -> leader ->
  consumer; three of those carry the tick's bytes, the follower's next fetch does not).
  What the machine's scheduling and Python gRPC alone cost at that cadence.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

CHUNK_BYTES = 1024 * 1024
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * CHUNK_BYTES),
    ("grpc.max_send_message_length", 64 * CHUNK_BYTES),
]


def _bytes_server(service: str, method: str, behaviour: Any) -> tuple[grpc.Server, int]:
    """A started Python gRPC server on a loopback port whose one unary method takes and
    gives raw bytes (no protobuf), and the port."""
    handler = grpc.method_handlers_generic_handler(
        service,
        {
            method: grpc.unary_unary_rpc_method_handler(
                behaviour, request_deserializer=None, response_serializer=None
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=_CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def grpc_put_mb_s(total_mib: int = 512, in_flight: int = 8) -> float:
    """MB/s of 1 MiB unary puts to a Python gRPC server that does nothing with them."""

    def put(request: bytes, context: Any) -> bytes:
        return len(request).to_bytes(8, "little")

    server, port = _bytes_server("bench.Put", "Put", put)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=_CHANNEL_OPTIONS) as channel:
            call = channel.unary_unary("/bench.Put/Put")
            payload = os.urandom(CHUNK_BYTES)
            call(payload, timeout=10)  # connect and warm up
            started = time.perf_counter()
            pending: list[Any] = []
            for _ in range(total_mib):
                pending.append(call.future(payload, timeout=30))
                if len(pending) >= in_flight:
                    pending.pop(0).result()
            for future in pending:
                future.result()
            elapsed = time.perf_counter() - started
    finally:
        server.stop(0)
    return total_mib * CHUNK_BYTES / elapsed / 1e6


def disk_write_mb_s(directory: Path, total_mib: int = 512, *, sync: bool) -> float:
    """MB/s of sequential 1 MiB writes (each followed by fdatasync when ``sync``)."""
    path = directory / f"ceiling-{os.getpid()}.bin"
    payload = os.urandom(CHUNK_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        started = time.perf_counter()
        for _ in range(total_mib):
            os.write(fd, payload)
            if sync:
                os.fdatasync(fd)
        if not sync:
            os.fdatasync(fd)  # the data reaches the disk in both cases
        elapsed = time.perf_counter() - started
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return total_mib * CHUNK_BYTES / elapsed / 1e6


def loopback_tcp_mb_s(total_mib: int = 1024) -> float:
    """MB/s through one loopback TCP connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    received = [0]

    def drain() -> None:
        connection, _ = listener.accept()
        with connection:
            buffer = bytearray(CHUNK_BYTES)
            while True:
                n = connection.recv_into(buffer)
                if not n:
                    return
                received[0] += n

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    payload = os.urandom(CHUNK_BYTES)
    with socket.create_connection(("127.0.0.1", port)) as sender:
        started = time.perf_counter()
        for _ in range(total_mib):
            sender.sendall(payload)
        sender.shutdown(socket.SHUT_WR)
        reader.join()
        elapsed = time.perf_counter() - started
    listener.close()
    return received[0] / elapsed / 1e6


ECHO_SERVICE = "bench.Echo"


def _echo_server(port_out: Any, stop: Any) -> None:
    """A Python gRPC server answering every call with its request's bytes, until ``stop``
    is set; runs in a spawned process (``grpc_crossings_ms``)."""

    def echo(request: bytes, context: Any) -> bytes:
        return request

    server, port = _bytes_server(ECHO_SERVICE, "Echo", echo)
    port_out.put(port)
    stop.wait()
    server.stop(0)


def grpc_crossings_ms(
    payload_bytes: int, *, seconds: float, tick_s: float = 0.005, calls_per_tick: int = 2
) -> list[float]:
    """Milliseconds per tick of ``calls_per_tick`` echo calls in a row (two calls: four
    process crossings), one tick every ``tick_s`` for ``seconds``, each call carrying
    ``payload_bytes`` to a server in another process and back (module docstring)."""
    spawn = multiprocessing.get_context("spawn")  # no fork of this process's gRPC state
    port_out, stop = spawn.Queue(), spawn.Event()
    server = spawn.Process(target=_echo_server, args=(port_out, stop), daemon=True)
    server.start()
    latencies_ms: list[float] = []
    try:
        port = port_out.get(timeout=60)
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=_CHANNEL_OPTIONS) as channel:
            call = channel.unary_unary(f"/{ECHO_SERVICE}/Echo")
            payload = os.urandom(payload_bytes)
            for _ in range(50):  # connect, warm up both processes
                call(payload, timeout=10)
            next_tick = time.perf_counter()
            for _ in range(max(1, int(seconds / tick_s))):
                # From when the tick was due, as the latency cases count (a late tick's
                # wait is part of what its records would see).
                due = next_tick
                next_tick += tick_s
                for _ in range(calls_per_tick):
                    call(payload, timeout=10)
                latencies_ms.append((time.perf_counter() - due) * 1000)
                time.sleep(max(0.0, next_tick - time.perf_counter()))
    finally:
        stop.set()
        server.join(10)
        if server.is_alive():
            server.kill()
    return latencies_ms


if __name__ == "__main__":
    # A look at the floor alone: python -m bench.ceilings [tick bytes] [seconds]
    import sys

    tick_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 230_000
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    tick_s = 0.005
    ordered = sorted(grpc_crossings_ms(tick_bytes, seconds=seconds, tick_s=tick_s))
    print(
        f"four crossings of {tick_bytes:,} B every {tick_s * 1000:.0f} ms, "
        "ms p50 / p99 / p99.9: "
        + " / ".join(f"{ordered[int(q * (len(ordered) - 1))]:.2f}" for q in (0.5, 0.99, 0.999))
    )
