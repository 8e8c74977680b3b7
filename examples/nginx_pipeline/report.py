"""Step 3: read ``nginx_stats`` (a Spark batch read) and print the current stats table:
for each (service, minute) key, the newest value."""

from __future__ import annotations

import json
from typing import Any

from pyspark.sql import Window
from pyspark.sql import functions as F  # noqa: N812


def latest_stats(spark: Any, gateway: str, topic: str) -> list[dict[str, Any]]:
    records = (
        spark.read.format("tidelog").option("gateway", gateway).option("subscribe", topic).load()
    )
    # The newest write of a key: micro-batches write one after another, so by time; by
    # offset among writes of one ms. The offset alone was wrong once partitions were
    # added to the topic: a key's new values then land on another partition, at lower
    # offsets than its old ones (found by an audit).
    newest = Window.partitionBy("key").orderBy(F.col("timestamp").desc(), F.col("offset").desc())
    rows = (
        records.withColumn("rank", F.row_number().over(newest))
        .where("rank = 1")
        .select(F.col("value").cast("string").alias("json"))
        .collect()
    )
    stats = [json.loads(r["json"]) for r in rows]
    return sorted(stats, key=lambda s: (s["service"], s["minute"]))


def print_table(stats: list[dict[str, Any]]) -> None:
    headers = ("service", "minute", "requests", "5xx rate", "p95 latency ms")
    rows = [
        (
            s["service"],
            s["minute"],
            f"{s['requests']:,}",
            f"{s['error_rate_5xx']:.2%}",
            f"{s['p95_latency_ms']:.1f}",
        )
        for s in stats
    ]
    if not rows:
        print("(no stats yet)")
        return
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
