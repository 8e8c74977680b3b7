"""Ceilings measured on this machine in the same run as the benchmarks they bound.

- ``grpc_put_mb_s``: a trivial Python gRPC service that accepts 1 MiB byte messages and
  answers with their length, called from one Python client with several calls in flight:
  what moving bytes through one Python gRPC hop costs, with no storage behind it.
- ``disk_write_mb_s``: sequential 1 MiB writes to a file in the benchmark's directory,
  with or without an ``fdatasync`` after every write.
- ``loopback_tcp_mb_s``: one TCP connection on 127.0.0.1, 1 MiB sends, a reader thread.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

CHUNK_BYTES = 1024 * 1024


def grpc_put_mb_s(total_mib: int = 512, in_flight: int = 8) -> float:
    """MB/s of 1 MiB unary puts to a Python gRPC server that does nothing with them."""

    def put(request: bytes, context: Any) -> bytes:
        return len(request).to_bytes(8, "little")

    handler = grpc.method_handlers_generic_handler(
        "bench.Put",
        {
            "Put": grpc.unary_unary_rpc_method_handler(
                put, request_deserializer=None, response_serializer=None
            )
        },
    )
    options = [
        ("grpc.max_receive_message_length", 8 * CHUNK_BYTES),
        ("grpc.max_send_message_length", 8 * CHUNK_BYTES),
    ]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=options)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
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
