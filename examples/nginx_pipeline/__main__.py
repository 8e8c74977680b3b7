"""``python -m examples.nginx_pipeline``: the whole pipeline, end to end (``make run``).

1. ``tidelog dev`` starts a local cluster (etcd, controller, 3 storage nodes, gateway) on
   a fresh data directory and a free gateway port;
2. topics ``nginx_services`` (16 partitions, replication factor 2, as in the seed notes)
   and ``nginx_stats`` are created;
3. in one Spark ``local[2]`` session (started first, before any gRPC channel exists in
   this process): the generator writes the access log (batch write),
   the streaming job aggregates it (``maxOffsetsPerTrigger``, AvailableNow) into
   ``nginx_stats``, and the report prints the per-service, per-minute table;
4. the cluster is stopped with SIGTERM and must exit cleanly.

Exit status 0 when every step worked and the stats account for every generated line.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from examples.nginx_pipeline import job
from tidelog.admin import Admin
from tidelog.dev import DevProcess
from tidelog.errors import TidelogError
from tidelog.spark import local_session


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000, help="log lines to generate")
    parser.add_argument("--max-offsets-per-trigger", type=int, default=50_000)
    parser.add_argument("--keep-data", action="store_true", help="keep the data directory")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tidelog-nginx-"))
    cluster: DevProcess | None = None
    started = time.monotonic()
    # The JVM first: PySpark starts it with a fork() that runs Python in the child, and a
    # fork while gRPC's threads run (the SDK's channels) can break either side - once in a
    # few runs the JVM died before answering ("Java gateway process exited").
    spark = local_session("nginx-pipeline", work / "spark", shuffle_partitions=4)
    try:
        print("1/4 starting the local cluster (tidelog dev)", flush=True)
        cluster = DevProcess(
            work / "cluster", on_line=lambda line: print(f"  [cluster] {line}", flush=True)
        )
        gateway = cluster.gateway
        job.ensure_topics(Admin(gateway), replication_factor=2)
        print(
            f"2/4 topics {job.SOURCE_TOPIC} (16 partitions, RF 2) and {job.STATS_TOPIC} created",
            flush=True,
        )
        return job.run_pipeline(
            spark,
            gateway,
            lines=args.lines,
            checkpoint=work / "checkpoint",
            max_offsets=args.max_offsets_per_trigger,
            step="3/4 ",
        )
    finally:
        spark.stop()
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
