"""Gateway + SDK benchmark: records/s through one gateway with the Python SDK.

Starts a real cluster the way the process-level tests do (``TestCluster``): a private
etcd, one controller, three storage nodes and one gateway, each its own ``python -m
tidelog`` process on 127.0.0.1; the benchmark (the SDK client) is one more process. All
share the machine's cores, so every figure includes the cost of the servers.

Cases (100-byte values, no keys, ``Producer.send_batch`` of ``--chunk`` values per call,
1 MiB batches, several calls in flight so the sender pipelines requests):

1. ``produce RF=1 acks=1``: topic with 3 partitions, replication factor 1;
2. ``produce RF=3 acks=all``: 3 partitions, RF=3, min.insync.replicas=2, idempotent;
3. ``consume``: ``Consumer.poll`` of the records the RF=3 case wrote, from the beginning.

Run: ``PYTHONPATH=. python -m bench.gateway [--records N] [--chunk N] [--write-docs]``.
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

from bench.storage_engine import cores, cpu_model, memory_gib
from bench.workloads import producing
from tests.support.cluster import TestCluster
from tidelog.admin import Admin
from tidelog.consumer import Consumer
from tidelog.producer import BatchMetadata, Producer

DOCS_PATH = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"
SECTION_TITLE = "## Gateway and SDK"
TARGETS = {"rf1": 300_000, "rf3": 200_000, "consume": 500_000}


def produce(address: str, topic: str, acks: str, records: int, chunk: int) -> float:
    values = [b"v" * 100] * chunk
    with producing(
        Producer(address, acks=acks, enable_idempotence=acks == "all", linger_ms=5)
    ) as producer:
        started = time.perf_counter()
        pending: list[Future[BatchMetadata]] = []
        for _ in range(records // chunk):
            pending.append(producer.send_batch(topic, values))
            if len(pending) >= 8:
                pending.pop(0).result(60)
        for future in pending:
            future.result(60)
        return (records // chunk) * chunk / (time.perf_counter() - started)


def consume(address: str, topic: str, records: int) -> float:
    with Consumer(address, auto_offset_reset="earliest", max_partition_fetch_bytes=8 << 20) as c:
        c.subscribe([topic])
        # Timed from the first poll: it resolves positions and its fetch brings the first
        # megabytes, which count.
        started = time.perf_counter()
        seen = 0
        while seen < records:
            batch = c.poll(max_records=1_000_000, timeout_ms=5_000)
            if not batch:
                break
            seen += len(batch)
        return seen / (time.perf_counter() - started)


def run(records: int, chunk: int) -> dict[str, float]:
    with (
        tempfile.TemporaryDirectory(prefix="tidelog-bench-gw-") as tmp,
        TestCluster(Path(tmp), session_ttl_s=10) as cluster,
    ):
        for broker_id in range(3):
            cluster.start_broker(broker_id)
        cluster.start_controller(1)
        cluster.wait_brokers([0, 1, 2])
        gateway = cluster.start_gateway()
        admin = Admin(gateway.address)
        admin.create_topic("bench-rf1", 3, 1)
        admin.create_topic("bench-rf3", 3, 3, {"min.insync.replicas": "2"})
        produce(gateway.address, "bench-rf1", "1", chunk * 4, chunk)  # warm-up
        results = {
            "rf1": produce(gateway.address, "bench-rf1", "1", records, chunk),
            "rf3": produce(gateway.address, "bench-rf3", "all", records, chunk),
        }
        results["consume"] = consume(gateway.address, "bench-rf3", records)
        return results


def report(results: dict[str, float], records: int, chunk: int) -> str:
    def row(name: str, key: str) -> str:
        value = results[key]
        ok = "yes" if value >= TARGETS[key] else "**no**"
        return f"| {name} | {value:,.0f} | {TARGETS[key]:,} | {ok} |"

    return "\n".join(
        [
            SECTION_TITLE,
            "",
            "`bench/gateway.py`: the Python SDK through one gateway to 3 storage nodes, all",
            "processes on this machine (etcd, controller, 3 brokers, gateway, client). 100-byte",
            f"values, no keys, `send_batch` of {chunk:,} values per call with up to 8 calls in",
            f"flight, {records:,} records per case, topics of 3 partitions; the consumer reads",
            "the RF=3 topic from the beginning with `poll`.",
            "",
            "Command: `PYTHONPATH=. .venv/bin/python -m bench.gateway "
            f"--records {records} --chunk {chunk} --write-docs`",
            "",
            f"- CPU: {cpu_model()}, {cores()} cores; memory {memory_gib():.1f} GiB",
            f"- Python {platform.python_version()}, Linux {platform.release()}",
            "",
            "| case | records/s | target | met |",
            "|---|---:|---:|---|",
            row("produce, RF=1, acks=1", "rf1"),
            row("produce, RF=3, acks=all, idempotent", "rf3"),
            row("consume (poll)", "consume"),
            "",
        ]
    )


def write_docs(section: str, path: Path = DOCS_PATH, title: str = SECTION_TITLE) -> None:
    """Replace (or append) the section headed ``title`` in docs/BENCHMARKS.md."""
    text = path.read_text()
    pattern = re.compile(rf"^{re.escape(title)}\n.*?(?=^## |\Z)", re.M | re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--chunk", type=int, default=50_000)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    results = run(args.records, args.chunk)
    section = report(results, args.records, args.chunk)
    print(section)
    if args.write_docs:
        write_docs(section)
        print(f"wrote {DOCS_PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
