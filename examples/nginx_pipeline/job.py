"""The pipeline's Spark job against an existing cluster: topics, generator, streaming
aggregation, report. ``__main__`` runs it on a local ``tidelog dev`` cluster (``make
run``); on Kubernetes it is what ``spark-submit`` runs (``deploy/k8s/base/spark-job.yaml``)::

    python -m examples.nginx_pipeline.job --gateway tidelog-gateway:9094 \\
        --checkpoint /checkpoints/nginx-stats

Exit status 0 when the stats account for every generated line.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from examples.nginx_pipeline import generator, report, stream_job
from tidelog.admin import Admin
from tidelog.errors import TidelogError, TopicAlreadyExistsError
from tidelog.spark import register

SOURCE_TOPIC = "nginx_services"
STATS_TOPIC = "nginx_stats"
GROUP = "nginx-stats-job"


def ensure_topics(admin: Admin, replication_factor: int) -> None:
    """The seed notes' topic (16 partitions) and the stats topic; existing ones are kept."""
    for name, partitions in ((SOURCE_TOPIC, 16), (STATS_TOPIC, 4)):
        with contextlib.suppress(TopicAlreadyExistsError):
            admin.create_topic(name, partitions=partitions, replication_factor=replication_factor)


def run_pipeline(
    spark: Any, gateway: str, *, lines: int, checkpoint: Path, max_offsets: int, step: str = ""
) -> int:
    """Generate, aggregate, report; returns the exit status."""
    admin = Admin(gateway)
    t0 = time.monotonic()
    written = generator.generate(spark, gateway, SOURCE_TOPIC, lines)
    print(f"{step}generator wrote {written:,} lines in {time.monotonic() - t0:.1f} s", flush=True)
    before = sum(p.committed_offset for p in admin.describe_group(GROUP) if p.committed_offset > 0)
    t0 = time.monotonic()
    batches = stream_job.run(
        spark, gateway, SOURCE_TOPIC, STATS_TOPIC, checkpoint=checkpoint, max_offsets=max_offsets
    )
    print(
        f"    streaming job processed the log in {batches} micro-batches "
        f"(maxOffsetsPerTrigger={max_offsets:,}) in {time.monotonic() - t0:.1f} s",
        flush=True,
    )
    stats = report.latest_stats(spark, gateway, STATS_TOPIC)
    print(f"{'4/4 ' if step else ''}per-service, per-minute stats from {STATS_TOPIC}:", flush=True)
    report.print_table(stats)
    counted = sum(s["requests"] for s in stats)
    group = admin.describe_group(GROUP)
    expected = before + written
    print(
        f"stats account for {counted:,} of {expected:,} lines; consumer group {GROUP} lag "
        f"{sum(p.lag for p in group)}",
        flush=True,
    )
    if counted != expected:
        print("error: the stats do not account for every line", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", required=True, metavar="HOST:PORT")
    parser.add_argument("--checkpoint", required=True, type=Path, help="streaming checkpoint dir")
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--max-offsets-per-trigger", type=int, default=50_000)
    parser.add_argument("--replication-factor", type=int, default=2)
    args = parser.parse_args(argv)
    spark = SparkSession.builder.appName("nginx-pipeline").getOrCreate()
    register(spark)
    try:
        ensure_topics(Admin(args.gateway), args.replication_factor)
        return run_pipeline(
            spark,
            args.gateway,
            lines=args.lines,
            checkpoint=args.checkpoint,
            max_offsets=args.max_offsets_per_trigger,
        )
    except TidelogError as exc:
        print(f"nginx pipeline: error: {exc}", file=sys.stderr)
        return 1
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
