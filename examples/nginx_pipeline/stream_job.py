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

import threading
from pathlib import Path
from typing import Any

from pyspark.sql import functions as F  # noqa: N812
from pyspark.sql.streaming import StreamingQueryListener

# Groups: 1 client, 2 time, 3 method, 4 path, 5 status, 6 bytes, 7 request time (s),
# 8 service.
LINE = (
    r'^(\S+) \S+ \S+ \[([^\]]+)\] "(\S+) (\S+) [^"]*" (\d{3}) (\d+) "[^"]*" "[^"]*" '
    r"rt=([\d.]+) svc=(\S+)$"
)


class _BatchCounter:
    """Counts a query's micro-batches that read data, from Spark's progress events:
    ``query.recentProgress`` keeps only the last 100 (found by an audit). Events come
    asynchronously, perhaps before the query's id is known here: each is kept with its
    query's id, and the count picks the query's when asked."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int, bool]] = set()  # (query id, batch id, read data)
        self._changed = threading.Condition()

    def on_progress(self, progress: Any) -> None:
        with self._changed:
            self._seen.add((str(progress.id), progress.batchId, progress.numInputRows > 0))
            self._changed.notify_all()

    def count(self, query: Any, timeout_s: float = 10.0) -> int:
        """The query's batches that read data, once the event of its last batch came."""
        query_id = str(query.id)
        last = query.lastProgress
        with self._changed:
            if last is not None:
                self._changed.wait_for(
                    lambda: any(q == query_id and b == last["batchId"] for q, b, _ in self._seen),
                    timeout_s,
                )
            return sum(1 for q, _, read in self._seen if q == query_id and read)


def run(
    spark: Any,
    gateway: str,
    source: str,
    target: str,
    *,
    checkpoint: Path,
    max_offsets: int,
    group: str = "nginx-stats-job",
) -> int:
    """Run until everything written so far is processed (AvailableNow); returns the
    number of micro-batches that read data."""
    lines = (
        spark.readStream.format("tidelog")
        .option("gateway", gateway)
        .option("subscribe", source)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", str(max_offsets))
        .option("groupId", group)
        .load()
        .select(F.col("value").cast("string").alias("line"))
    )
    # try_ forms, and rows without a time, status or latency dropped as the lines the
    # expression does not match are: a line that matched with a value the casts refuse
    # (rt=1.2.3, 31/Nov) failed its micro-batch, and every restart replayed the same
    # micro-batch from the checkpoint - the job could never pass it (found by an audit).
    parsed = lines.select(
        F.regexp_extract("line", LINE, 8).alias("service"),
        F.try_to_timestamp(
            F.regexp_extract("line", LINE, 2), F.lit("dd/MMM/yyyy:HH:mm:ss Z")
        ).alias("time"),
        F.regexp_extract("line", LINE, 5).try_cast("int").alias("status"),
        (F.regexp_extract("line", LINE, 7).try_cast("double") * 1000).alias("latency_ms"),
    ).where(
        (F.col("service") != "")
        & F.col("time").isNotNull()
        & F.col("status").isNotNull()
        & F.col("latency_ms").isNotNull()
    )
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

    counter = _BatchCounter()
    listener = _ProgressListener(counter.on_progress)
    spark.streams.addListener(listener)
    try:
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
        return counter.count(query)
    finally:
        spark.streams.removeListener(listener)


class _ProgressListener(StreamingQueryListener):
    """Hands each progress event to ``on_progress`` (the listener's other events are of
    no use here)."""

    def __init__(self, on_progress: Any) -> None:
        self._on_progress = on_progress

    def onQueryStarted(self, event: Any) -> None:  # noqa: N802 - Spark's method names
        pass

    def onQueryProgress(self, event: Any) -> None:  # noqa: N802
        self._on_progress(event.progress)

    def onQueryIdle(self, event: Any) -> None:  # noqa: N802
        pass

    def onQueryTerminated(self, event: Any) -> None:  # noqa: N802
        pass
