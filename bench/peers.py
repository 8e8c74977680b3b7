"""Peers measured on this machine in the same run: NATS JetStream and Redis Streams.

- NATS JetStream: three ``nats-server`` processes (Debian's ``nats-server``) forming a
  JetStream cluster, one stream with file storage replicated 3 times; the ``nats-py``
  client publishes asynchronously, keeping ``window`` publishes awaiting their acks.
  A publish ack means the stream's replicas stored the message (R3: a quorum).
- Redis Streams: one ``redis-server`` (Debian's), no persistence and no replication -
  reported as such; ``XADD`` pipelined in batches, then ``XREAD`` in batches.

Each returns records/s; servers run in a temporary directory and are stopped after.
"""

from __future__ import annotations

import asyncio
import importlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

from tidelog.etcd_launcher import free_port

NATS_BIN = "nats-server"
REDIS_BIN = "redis-server"


def _wait_port(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout_s} s")


MISSING: Final = {
    "nats": f"{NATS_BIN} or the nats-py client",
    "redis": f"{REDIS_BIN} or the redis client",
}
"""What a peer needs, named when it is skipped."""


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def available() -> dict[str, bool]:
    """Which peers can run: the server on PATH and its Python client importable. With the
    server but not its client (the ``bench`` extra), the peer's import raised and ended
    the whole run at the peers stage (found by an audit)."""
    return {
        "nats": shutil.which(NATS_BIN) is not None and _importable("nats"),
        "redis": shutil.which(REDIS_BIN) is not None and _importable("redis"),
    }


@contextmanager
def nats_cluster(directory: Path) -> Iterator[list[str]]:
    """Three JetStream servers clustered on loopback; yields their client URLs."""
    client_ports = [free_port() for _ in range(3)]
    cluster_ports = [free_port() for _ in range(3)]
    routes = ",".join(f"nats://127.0.0.1:{p}" for p in cluster_ports)
    processes = []
    try:
        for i in range(3):
            store = directory / f"nats-{i}"
            store.mkdir(parents=True, exist_ok=True)
            processes.append(
                subprocess.Popen(
                    [
                        NATS_BIN,
                        "-js",
                        "-n",
                        f"bench-{i}",
                        "-sd",
                        str(store),
                        "-a",
                        "127.0.0.1",
                        "-p",
                        str(client_ports[i]),
                        "--cluster_name",
                        "bench",
                        "--cluster",
                        f"nats://127.0.0.1:{cluster_ports[i]}",
                        "--routes",
                        routes,
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=open(directory / f"nats-{i}.log", "wb"),  # noqa: SIM115
                )
            )
        for port in client_ports:
            _wait_port(port)
        yield [f"nats://127.0.0.1:{p}" for p in client_ports]
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(20)


def nats_jetstream_r3(directory: Path, records: int, size: int, window: int = 2000) -> float:
    """records/s published to an R3 file stream, each publish acknowledged."""
    import nats  # a benchmark-only dependency

    async def run(urls: list[str]) -> float:
        nc = await nats.connect(servers=urls)
        js = nc.jetstream()
        deadline = time.monotonic() + 30
        while True:  # the cluster needs a meta leader before it takes a stream
            try:
                await js.add_stream(
                    name="BENCH", subjects=["bench"], num_replicas=3, storage="file"
                )
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        payload = b"x" * size
        await js.publish("bench", payload)
        started = time.perf_counter()
        sent = 0
        while sent < records:
            n = min(window, records - sent)
            await asyncio.gather(*(js.publish("bench", payload) for _ in range(n)))
            sent += n
        elapsed = time.perf_counter() - started
        await nc.close()
        return records / elapsed

    with nats_cluster(directory) as urls:
        return asyncio.run(run(urls))


@contextmanager
def redis_server(directory: Path) -> Iterator[int]:
    port = free_port()
    process = subprocess.Popen(
        [
            REDIS_BIN,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_port(port)
        yield port
    finally:
        process.terminate()
        process.wait(20)


def redis_streams(
    directory: Path, records: int, size: int, batch: int = 1000
) -> tuple[float, float]:
    """(XADD records/s, XREAD records/s) on a single unreplicated, unpersisted node."""
    import redis  # a benchmark-only dependency

    with redis_server(directory) as port:
        client = redis.Redis(port=port)
        payload = b"x" * size
        started = time.perf_counter()
        sent = 0
        while sent < records:
            n = min(batch, records - sent)
            pipe = client.pipeline(transaction=False)
            for _ in range(n):
                pipe.xadd("bench", {"v": payload})
            pipe.execute()
            sent += n
        write_rate = records / (time.perf_counter() - started)
        started = time.perf_counter()
        last = "0-0"
        read = 0
        while read < records:
            answer = client.xread({"bench": last}, count=10_000)
            if not answer:
                break
            entries = answer[0][1]
            read += len(entries)
            last = entries[-1][0]
        read_rate = read / (time.perf_counter() - started)
        client.close()
        return write_rate, read_rate
