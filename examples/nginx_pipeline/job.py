"""The pipeline's Spark job against an existing cluster: topics, generator, streaming
aggregation, report. ``__main__`` runs it on a local ``tidelog dev`` cluster (``make
run``); on Kubernetes it is what ``spark-submit`` runs (``deploy/k8s/base/spark-job.yaml``)::

    python -m examples.nginx_pipeline.job --gateway tidelog-gateway:9094 \\
        --checkpoint /checkpoints/nginx-stats

Exit status 0 when the job read every generated line and the stats account for every
line it read.
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
    spark: Any,
    gateway: str,
    *,
    lines: int,
    checkpoint: Path,
    max_offsets: int,
    step: str = "",
    source: str = SOURCE_TOPIC,
    target: str = STATS_TOPIC,
    group: str = GROUP,
) -> int:
    """Generate, aggregate, report; returns the exit status."""
    admin = Admin(gateway)
    t0 = time.monotonic()
    written = generator.generate(spark, gateway, source, lines)
    print(f"{step}generator wrote {written:,} lines in {time.monotonic() - t0:.1f} s", flush=True)
    before = _committed(admin, group)
    t0 = time.monotonic()
    batches = stream_job.run(
        spark, gateway, source, target, checkpoint=checkpoint, max_offsets=max_offsets, group=group
    )
    print(
        f"    streaming job processed the log in {batches} micro-batches "
        f"(maxOffsetsPerTrigger={max_offsets:,}) in {time.monotonic() - t0:.1f} s",
        flush=True,
    )
    stats = report.latest_stats(spark, gateway, target)
    print(f"{'4/4 ' if step else ''}per-service, per-minute stats from {target}:", flush=True)
    report.print_table(stats)
    counted = sum(s["requests"] for s in stats)
    # What the stream read in all, as its group's offsets say (the job commits each
    # micro-batch's end): the lines generated now and before, and any another writer
    # added meanwhile. The generated lines plus the offsets before the run was
    # expected, and a second writer on the topic failed a correct run (found by an
    # audit).
    read = _committed(admin, group)
    lags = [p.lag for p in admin.describe_group(group)]
    lag = "unknown" if None in lags else f"{sum(lag or 0 for lag in lags):,}"
    print(
        f"stats account for {counted:,} of {read:,} lines; consumer group {group} lag {lag}",
        flush=True,
    )
    if read - before < written:
        print(f"error: the job read {read - before:,} new lines of {written:,}", file=sys.stderr)
        return 1
    if counted != read:
        print("error: the stats do not account for every line", file=sys.stderr)
        return 1
    return 0


def _committed(admin: Admin, group: str) -> int:
    return sum(p.committed_offset for p in admin.describe_group(group) if p.committed_offset > 0)


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
