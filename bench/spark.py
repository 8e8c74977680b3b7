"""Spark data source benchmark: batch write and batch read rows/s on ``local[2]``.

A real cluster (etcd, controller, 3 storage nodes, gateway; ``TestCluster``) and a Spark
``local[2]`` session share the machine's cores. The write case is
``spark.range(N)`` turned into 100-byte binary values and written with
``df.write.format("tidelog")`` (no keys: sticky partitions, acks=all, RF=1,
``--partitions`` partitions, 4 by default); the read case reads the topic back with
``spark.read.format("tidelog")`` into Spark's ``noop`` sink, which materialises every
row (all columns of the Kafka source schema) and discards it. Each case is timed around
the Spark action, through the gateway and again with the connector's ``direct`` option.

Run: ``PYTHONPATH=. python -m bench.spark [--rows N] [--partitions N] [--write-docs]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

from bench.gateway import write_docs as _write_section
from bench.storage_engine import cores, cpu_model, memory_gib
from tests.support.cluster import running_cluster
from tidelog.admin import Admin

SECTION_TITLE = "## Spark data source"
TARGETS = {"write": 300_000, "read": 1_000_000}


MODES: Final = ("gateway", "direct")
"""Through the gateway (the connector's default), then with ``direct=true`` (tasks fetch
from and append to the partition leaders), each on a topic of its own."""


DRIVER_MEMORY: Final = "2g"

DEFAULT_PARTITIONS: Final = 4
"""The topics' partitions unless ``--partitions`` says otherwise (and in ``tidelog bench``)."""


def java_version() -> str:
    """The version of the Java PySpark starts (``$JAVA_HOME/bin/java``, else ``java`` on
    PATH), as ``java -version`` reports it, e.g. "21.0.5"; "unknown" if there is none. The
    docs said "Java 17" whatever ran (found by an audit)."""
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if not java:
        return "unknown"
    try:
        done = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    match = re.search(r'version "([^"]+)"', done.stderr + done.stdout)
    return match.group(1) if match else "unknown"


def run(rows: int, partitions: int) -> dict[str, float]:
    """rows/s of each case: ``write`` and ``read`` through the gateway, ``write direct`` and
    ``read direct`` with the ``direct`` option, in one Spark session and cluster."""
    from pyspark.sql import functions as F  # noqa: N812

    from tidelog.spark import local_session

    rates: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="tidelog-bench-spark-") as tmp:
        base = Path(tmp)
        with running_cluster(base / "cluster") as cluster:
            gateway = cluster.start_gateway().address
            spark = local_session("tidelog-bench", base / "spark", driver_memory=DRIVER_MEMORY)
            try:
                values = spark.range(rows, numPartitions=2).select(
                    F.concat(F.lpad(F.col("id").cast("string"), 20, "0"), F.lit("v" * 80))
                    .cast("binary")
                    .alias("value")
                )
                # Warm the JVM and the Python workers up first, so the first mode's write
                # does not pay for it (as each read does after a warm-up read).
                Admin(gateway).create_topic(
                    "bench-spark-warm-up", partitions=1, replication_factor=1
                )
                values.limit(rows // 10).write.format("tidelog").option("gateway", gateway).option(
                    "topic", "bench-spark-warm-up"
                ).mode("append").save()
                for mode in MODES:
                    topic = f"bench-spark-{mode}"
                    direct = "true" if mode == "direct" else "false"
                    suffix = "" if mode == "gateway" else f" {mode}"
                    Admin(gateway).create_topic(topic, partitions=partitions, replication_factor=1)
                    started = time.perf_counter()
                    values.write.format("tidelog").option("gateway", gateway).option(
                        "topic", topic
                    ).option("direct", direct).mode("append").save()
                    rates["write" + suffix] = rows / (time.perf_counter() - started)
                    reader = (
                        spark.read.format("tidelog")
                        .option("gateway", gateway)
                        .option("subscribe", topic)
                        .option("minPartitions", "4")
                        .option("direct", direct)
                        .load()
                    )
                    reader.write.format("noop").mode("overwrite").save()  # warm JVM, workers
                    started = time.perf_counter()
                    reader.write.format("noop").mode("overwrite").save()
                    rates["read" + suffix] = rows / (time.perf_counter() - started)
                    count = reader.count()
                    if count != rows:
                        raise RuntimeError(f"read {count} rows back from {topic}, wrote {rows}")
            finally:
                spark.stop()
    return rates


def report(results: dict[str, float], rows: int, partitions: int = DEFAULT_PARTITIONS) -> str:
    """The docs section. It names the partition count that ran and gives it in the
    command (it said 4 partitions and left ``--partitions`` out whatever ran; found by an
    audit)."""

    def row(name: str, key: str) -> str:
        value = results[key]
        target = TARGETS[key.split(maxsplit=1)[0]]
        met = "yes" if value >= target else "**no**"
        return f"| {name} | {value:,.0f} | {target:,} | {met} |"

    return "\n".join(
        [
            SECTION_TITLE,
            "",
            "`bench/spark.py`: Spark `local[2]` and a whole cluster (etcd, controller, 3",
            f"storage nodes, gateway) on the same {cores()} cores. Write: "
            '`df.write.format("tidelog")`',
            f"of {rows:,} rows with 100-byte values (acks=all, RF=1, {partitions} partitions). "
            "Read: the",
            "topic back in the Kafka source schema into Spark's `noop` sink (every row",
            "materialised), after one warm-up read; the writes after a warm-up write of a",
            "tenth of the rows. Each case through the gateway (the default), then with",
            "`direct=true` (tasks fetch from and append to the partition leaders), each on a",
            "topic of its own. Runs on this shared machine vary by 10-30%. Before the write",
            "warm-up (ninth pass), the first write paid for the JVM's and Python workers'",
            "start: 291k-313k rows/s written then, 988k-1.08M rows/s read.",
            "",
            "Command: `PYTHONPATH=. .venv/bin/python -m bench.spark "
            f"--rows {rows} --partitions {partitions} --write-docs`",
            "",
            f"- CPU: {cpu_model()}, {cores()} cores; memory {memory_gib():.1f} GiB",
            f"- Python {platform.python_version()}, Linux {platform.release()}, "
            f"Java {java_version()}",
            "",
            "| case | rows/s | target | met |",
            "|---|---:|---:|---|",
            row("batch write", "write"),
            row("batch read", "read"),
            row("batch write, direct=true", "write direct"),
            row("batch read, direct=true", "read direct"),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--partitions", type=int, default=DEFAULT_PARTITIONS)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    section = report(run(args.rows, args.partitions), args.rows, args.partitions)
    print(section)
    if args.write_docs:
        _write_section(section, title=SECTION_TITLE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
