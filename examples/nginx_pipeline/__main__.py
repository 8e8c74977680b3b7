"""``python -m examples.nginx_pipeline``: the whole pipeline, end to end (``make run``).

1. ``tidelog dev`` starts a local cluster (etcd, controller, 3 storage nodes, gateway) on
   a fresh data directory and a free gateway port;
2. topics ``nginx_services`` (16 partitions, replication factor 2, as in the seed notes)
   and ``nginx_stats`` are created;
3. in one Spark ``local[2]`` session: the generator writes the access log (batch write),
   the streaming job aggregates it (``maxOffsetsPerTrigger``, AvailableNow) into
   ``nginx_stats``, and the report prints the per-service, per-minute table;
4. the cluster is stopped with SIGTERM and must exit cleanly.

Exit status 0 when every step worked and the stats account for every generated line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from pyspark.sql import SparkSession

from examples.nginx_pipeline import generator, report, stream_job
from tidelog.admin import Admin
from tidelog.dev import DevProcess
from tidelog.errors import TidelogError
from tidelog.spark import register

SOURCE_TOPIC = "nginx_services"
STATS_TOPIC = "nginx_stats"


def spark_session(local_dir: Path) -> SparkSession:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("nginx-pipeline")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.driver.memory", "1g")
        .config("spark.local.dir", str(local_dir))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000, help="log lines to generate")
    parser.add_argument("--max-offsets-per-trigger", type=int, default=50_000)
    parser.add_argument("--keep-data", action="store_true", help="keep the data directory")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tidelog-nginx-"))
    cluster: DevProcess | None = None
    started = time.monotonic()
    try:
        print("1/4 starting the local cluster (tidelog dev)", flush=True)
        cluster = DevProcess(
            work / "cluster", on_line=lambda line: print(f"  [cluster] {line}", flush=True)
        )
        gateway = cluster.gateway
        admin = Admin(gateway)
        admin.create_topic(SOURCE_TOPIC, partitions=16, replication_factor=2)
        admin.create_topic(STATS_TOPIC, partitions=4, replication_factor=2)
        print(
            f"2/4 topics {SOURCE_TOPIC} (16 partitions, RF 2) and {STATS_TOPIC} created", flush=True
        )
        spark = spark_session(work / "spark")
        try:
            t0 = time.monotonic()
            written = generator.generate(spark, gateway, SOURCE_TOPIC, args.lines)
            print(
                f"3/4 generator wrote {written:,} lines in {time.monotonic() - t0:.1f} s",
                flush=True,
            )
            t0 = time.monotonic()
            batches = stream_job.run(
                spark,
                gateway,
                SOURCE_TOPIC,
                STATS_TOPIC,
                checkpoint=work / "checkpoint",
                max_offsets=args.max_offsets_per_trigger,
            )
            print(
                f"    streaming job processed the log in {batches} micro-batches "
                f"(maxOffsetsPerTrigger={args.max_offsets_per_trigger:,}) in "
                f"{time.monotonic() - t0:.1f} s",
                flush=True,
            )
            stats = report.latest_stats(spark, gateway, STATS_TOPIC)
            print("4/4 per-service, per-minute stats from nginx_stats:", flush=True)
            report.print_table(stats)
        finally:
            spark.stop()
        counted = sum(s["requests"] for s in stats)
        lag = admin.describe_group("nginx-stats-job")
        print(
            f"stats account for {counted:,} of {written:,} lines; consumer group "
            f"nginx-stats-job lag {sum(p.lag for p in lag)}",
            flush=True,
        )
        if counted != written:
            print("error: the stats do not account for every line", file=sys.stderr)
            return 1
        return 0
    finally:
        if cluster is not None:
            status = cluster.stop()
            print(
                f"cluster stopped (exit status {status}) after {time.monotonic() - started:.0f} s"
            )
        if not args.keep_data:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TidelogError as exc:
        print(f"nginx pipeline: error: {exc}", file=sys.stderr)
        sys.exit(1)
