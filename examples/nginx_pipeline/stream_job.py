"""Step 2: a Structured Streaming job from ``nginx_services`` to ``nginx_stats``.

It reads with ``maxOffsetsPerTrigger`` (admission control), parses each line with regular
expressions, and aggregates per service per minute: requests, the 5xx rate and the 95th
percentile of latency. In ``update`` mode every micro-batch emits the (service, minute)
rows it changed, as JSON values keyed ``service|minute``; the newest record of a key is
its current value (a compacted-topic convention). Spark's Python data source sinks take
append mode only, so the rows go through ``foreachBatch`` with a batch write; a replayed
micro-batch rewrites the same values under the same keys, which readers of the newest
value per key do not notice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyspark.sql import functions as F  # noqa: N812

# Groups: 1 client, 2 time, 3 method, 4 path, 5 status, 6 bytes, 7 request time (s),
# 8 service.
LINE = (
    r'^(\S+) \S+ \S+ \[([^\]]+)\] "(\S+) (\S+) [^"]*" (\d{3}) (\d+) "[^"]*" "[^"]*" '
    r"rt=([\d.]+) svc=(\S+)$"
)


def run(
    spark: Any, gateway: str, source: str, target: str, *, checkpoint: Path, max_offsets: int
) -> int:
    """Run until everything written so far is processed (AvailableNow); returns the
    number of micro-batches that read data."""
    lines = (
        spark.readStream.format("tidelog")
        .option("gateway", gateway)
        .option("subscribe", source)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", str(max_offsets))
        .option("groupId", "nginx-stats-job")
        .load()
        .select(F.col("value").cast("string").alias("line"))
    )
    parsed = lines.select(
        F.regexp_extract("line", LINE, 8).alias("service"),
        F.to_timestamp(F.regexp_extract("line", LINE, 2), "dd/MMM/yyyy:HH:mm:ss Z").alias("time"),
        F.regexp_extract("line", LINE, 5).cast("int").alias("status"),
        (F.regexp_extract("line", LINE, 7).cast("double") * 1000).alias("latency_ms"),
    ).where(F.col("service") != "")
    stats = parsed.groupBy("service", F.window("time", "1 minute").alias("window")).agg(
        F.count(F.lit(1)).alias("requests"),
        F.avg((F.col("status") >= 500).cast("double")).alias("error_rate_5xx"),
        F.percentile_approx("latency_ms", 0.95).alias("p95_latency_ms"),
    )
    # In UTC, as the lines' times are, whatever the session's (the machine's) zone.
    minute = F.date_format(
        F.to_utc_timestamp(F.col("window.start"), F.current_timezone()), "yyyy-MM-dd HH:mm"
    )
    out = stats.select(
        F.concat_ws("|", "service", minute).cast("binary").alias("key"),
        F.to_json(
            F.struct(
                "service",
                minute.alias("minute"),
                "requests",
                F.round("error_rate_5xx", 4).alias("error_rate_5xx"),
                F.round("p95_latency_ms", 1).alias("p95_latency_ms"),
            )
        )
        .cast("binary")
        .alias("value"),
    )

    def write_batch(batch: Any, batch_id: int) -> None:
        del batch_id
        batch.write.format("tidelog").option("gateway", gateway).option("topic", target).mode(
            "append"
        ).save()

    query = (
        out.writeStream.outputMode("update")
        .foreachBatch(write_batch)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"the streaming job failed: {query.exception()}")
    return sum(1 for p in query.recentProgress if p["numInputRows"] > 0)
