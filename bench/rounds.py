"""What one replication-like round costs, by transport (docs/BENCHMARKS.md items 57, 58, 60).

A round is a follower's long poll: the client asks, the server holds the request until its
next tick (every ``TICK_S``) and then answers ``PAYLOAD_BYTES``, and the client asks again
as soon as it has the answer. The server runs in a process of its own. For each transport,
after a warm-up, the CPU each side used per round (``/proc/PID/stat`` for the server,
``getrusage`` for the client, every thread counted) and the context switches per round
(``/proc/PID/task/*/status``) are printed, with the server's threads by name:

- ``unary``: a gRPC unary call per round (how the replica fetcher asks today);
- ``stream``: one gRPC bidirectional stream, requests fed from a queue (grpcio's sync
  client reads the request iterator on a thread of its own);
- ``aio``: one gRPC bidirectional stream driven by ``grpc.aio`` on one event loop;
- ``tcp``: one plain TCP connection with length-prefixed frames, a server thread per
  connection.

The server's figures include its ticker thread in every transport.

Command: ``PYTHONPATH=. .venv/bin/python -m bench.rounds [transports] [rounds]``, e.g.
``-m bench.rounds unary,stream,aio,tcp 1000``.
"""

from __future__ import annotations

import asyncio
import collections
import glob
import json
import multiprocessing
import os
import queue
import resource
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

PAYLOAD_BYTES = 165_000
"""One 5 ms tick of the suite's half-rate case (330,000 records/s of 100 bytes)."""
TICK_S = 0.005
WARMUP_ROUNDS = 50
_SERVICE = "tidelog.bench.Rounds"
_FRAME = struct.Struct("!I")
_PAYLOAD = b"x" * PAYLOAD_BYTES


class _Ticker:
    """Wakes every waiter at each tick; ``wait_next`` returns at the first tick after it
    was called, as a long poll returns when the next data arrives."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._tick = 0
        threading.Thread(target=self._run, name="ticker", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(TICK_S)
            with self._cond:
                self._tick += 1
                self._cond.notify_all()

    def wait_next(self) -> None:
        with self._cond:
            seen = self._tick
            self._cond.wait_for(lambda: self._tick > seen)


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError("connection closed")
        got += n
    return buf


def _serve(ports: Any) -> None:
    """The server process: one gRPC server (unary and stream methods) and one TCP
    listener, both answering at the next tick; puts (grpc port, tcp port) on ``ports``."""
    ticker = _Ticker()

    def unary(_request: bytes, _context: Any) -> bytes:
        ticker.wait_next()
        return _PAYLOAD

    def stream(requests: Iterator[bytes], _context: Any) -> Iterator[bytes]:
        for _ in requests:
            ticker.wait_next()
            yield _PAYLOAD

    def threads(_request: bytes, _context: Any) -> bytes:
        """Python's names of this process's threads by native id (the OS calls them all
        "python")."""
        return json.dumps({t.native_id: t.name for t in threading.enumerate()}).encode()

    handler = grpc.method_handlers_generic_handler(
        _SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
            "Threads": grpc.unary_unary_rpc_method_handler(threads),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    server.add_generic_rpc_handlers((handler,))
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def connection(sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                (size,) = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
                _recv_exact(sock, size)
                ticker.wait_next()
                sock.sendall(_FRAME.pack(len(_PAYLOAD)) + _PAYLOAD)
        except (OSError, EOFError):
            sock.close()

    def accept() -> None:
        while True:
            sock, _ = listener.accept()
            threading.Thread(target=connection, args=(sock,), daemon=True).start()

    threading.Thread(target=accept, name="tcp-accept", daemon=True).start()
    ports.put((grpc_port, listener.getsockname()[1]))
    server.wait_for_termination()


def _unary(address: str, tcp_port: int) -> Callable[[int], None]:
    call = grpc.insecure_channel(address).unary_unary(f"/{_SERVICE}/Unary", None, None)

    def rounds(n: int) -> None:
        for _ in range(n):
            call(b"?", timeout=10)

    return rounds


def _stream(address: str, tcp_port: int) -> Callable[[int], None]:
    requests: queue.SimpleQueue[bytes] = queue.SimpleQueue()

    def feed() -> Iterator[bytes]:
        while True:
            yield requests.get()

    method = grpc.insecure_channel(address).stream_stream(f"/{_SERVICE}/Stream", None, None)
    answers: Iterator[bytes] = iter(method(feed()))

    def rounds(n: int) -> None:
        for _ in range(n):
            requests.put(b"?")
            next(answers)

    return rounds


def _aio(address: str, tcp_port: int) -> Callable[[int], None]:
    loop = asyncio.new_event_loop()

    async def open_call() -> Any:
        channel = grpc.aio.insecure_channel(address)
        return channel.stream_stream(f"/{_SERVICE}/Stream", None, None)(None)

    call = loop.run_until_complete(open_call())

    async def run(n: int) -> None:
        for _ in range(n):
            await call.write(b"?")
            await call.read()

    return lambda n: loop.run_until_complete(run(n))


def _tcp(address: str, tcp_port: int) -> Callable[[int], None]:
    sock = socket.create_connection(("127.0.0.1", tcp_port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def rounds(n: int) -> None:
        for _ in range(n):
            sock.sendall(_FRAME.pack(1) + b"?")
            (size,) = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
            _recv_exact(sock, size)

    return rounds


TRANSPORTS: dict[str, Callable[[str, int], Callable[[int], None]]] = {
    "unary": _unary,
    "stream": _stream,
    "aio": _aio,
    "tcp": _tcp,
}


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _switches_by_thread(pid: int, names: dict[str, str]) -> collections.Counter[str]:
    """Voluntary + involuntary context switches of each thread, keyed by its Python name
    (``names``, by native id) or else the OS's, with the thread id."""
    counts: collections.Counter[str] = collections.Counter()
    for task in glob.glob(f"/proc/{pid}/task/*"):
        tid = task.rsplit("/", 1)[1]
        try:
            with open(f"{task}/comm") as f:
                name = names.get(tid, f.read().strip())
            with open(f"{task}/status") as f:
                switches = sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except OSError:  # the thread ended in between
            continue
        counts[f"{name}:{tid}"] = switches
    return counts


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(transport: str, rounds: int, address: str, tcp_port: int, server_pid: int) -> str:
    run = TRANSPORTS[transport](address, tcp_port)
    run(WARMUP_ROUNDS)
    with grpc.insecure_channel(address) as channel:
        ask = channel.unary_unary(f"/{_SERVICE}/Threads", None, None)
        names: dict[str, str] = json.loads(ask(b"", timeout=10))
    server_cpu, client_cpu = _cpu_s(server_pid), _own_cpu_s()
    server_cs = _switches_by_thread(server_pid, names)
    client_cs = _switches_by_thread(os.getpid(), {})
    run(rounds)
    server_cpu, client_cpu = _cpu_s(server_pid) - server_cpu, _own_cpu_s() - client_cpu
    server_after = _switches_by_thread(server_pid, names)
    client_after = _switches_by_thread(os.getpid(), {})
    per_thread = {k: (v - server_cs.get(k, 0)) / rounds for k, v in server_after.items()}
    busiest = ", ".join(
        f"{k} {v:.1f}" for k, v in sorted(per_thread.items(), key=lambda kv: -kv[1]) if v >= 0.5
    )
    return (
        f"{transport}: CPU per round server {server_cpu / rounds * 1000:.2f} ms, client "
        f"{client_cpu / rounds * 1000:.2f} ms; context switches per round server "
        f"{sum(per_thread.values()):.1f}, client "
        f"{(sum(client_after.values()) - sum(client_cs.values())) / rounds:.1f} "
        f"(server threads: {busiest})"
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    transports = (args[0] if args else "unary,stream,aio,tcp").split(",")
    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown:
        print(f"unknown transport {unknown[0]!r}; choose from {', '.join(TRANSPORTS)}")
        return 2
    rounds = int(args[1]) if len(args) > 1 else 1000
    spawn = multiprocessing.get_context("spawn")  # no fork of this process's gRPC state
    ports: Any = spawn.Queue()
    server = spawn.Process(target=_serve, args=(ports,), daemon=True)
    server.start()
    try:
        grpc_port, tcp_port = ports.get(timeout=60)
        for transport in transports:
            line = measure(transport, rounds, f"127.0.0.1:{grpc_port}", tcp_port, server.pid or 0)
            print(line, flush=True)
    finally:
        server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
