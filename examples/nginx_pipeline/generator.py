r"""Step 1: synthetic nginx access-log lines, written to ``nginx_services`` by a Spark batch
write (the key is the service, so one service's lines stay in one partition, in order).

A line looks like nginx's ``combined`` format plus the two fields operators add most:
``$request_time`` and the upstream service::

    10.0.3.7 - - [22/Nov/2026:10:15:03 +0000] "GET /api/cart HTTP/1.1" 200 5120 "-" \
        "curl/8.5" rt=0.043 svc=checkout
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import functions as F  # noqa: N812

SERVICES = ("checkout", "search", "catalog", "payments", "auth", "recommendations")
PATHS = ("/api/cart", "/api/items", "/api/search", "/api/pay", "/login", "/api/recs", "/health")
START_EPOCH_S = 1_795_392_000  # 2026-11-23 00:00 UTC: fixed, so runs are comparable


def generate(spark: Any, gateway: str, topic: str, lines: int, minutes: int = 10) -> int:
    """Write ``lines`` log lines spread over ``minutes`` minutes; returns the count."""
    n = F.col("id")
    df = spark.range(lines).select(
        F.pmod(F.hash(n, F.lit(1)), F.lit(len(SERVICES))).alias("svc_index"),
        F.pmod(F.hash(n, F.lit(2)), F.lit(len(PATHS))).alias("path_index"),
        F.pmod(F.hash(n, F.lit(3)), F.lit(1000)).alias("roll"),
        F.pmod(F.hash(n, F.lit(4)), F.lit(2000)).alias("latency_roll"),
        F.pmod(F.hash(n, F.lit(5)), F.lit(20000)).alias("bytes"),
        (F.lit(START_EPOCH_S) + (n * F.lit(minutes * 60)) / F.lit(lines)).cast("long").alias("ts"),
        F.concat_ws(".", F.lit("10.0"), F.pmod(n, F.lit(250)), F.pmod(n, F.lit(7))).alias("ip"),
    )
    services = F.array(*map(F.lit, SERVICES))
    paths = F.array(*map(F.lit, PATHS))
    # Services differ, so the stats have something to show: later services in SERVICES
    # fail more often and answer more slowly.
    svc = F.col("svc_index")
    status = (
        F.when(F.col("roll") < 5 + svc * 12, F.lit(503))
        .when(F.col("roll") < 10 + svc * 14, F.lit(500))
        .when(F.col("roll") < 60 + svc * 14, F.lit(404))
        .otherwise(F.lit(200))
    )
    latency_s = (F.col("latency_roll") / 20000 + 0.002) * (1 + svc * 0.6)
    line = F.format_string(
        '%s - - [%s +0000] "GET %s HTTP/1.1" %d %d "-" "curl/8.5" rt=%.3f svc=%s',
        F.col("ip"),
        # UTC wall time, as "+0000" says: date_format shows the session's zone (the
        # machine's), and off UTC the lines carried local time marked UTC (found by an
        # audit).
        F.date_format(
            F.to_utc_timestamp(F.timestamp_seconds(F.col("ts")), F.current_timezone()),
            "dd/MMM/yyyy:HH:mm:ss",
        ),
        F.element_at(paths, F.col("path_index").cast("int") + 1),
        status,
        F.col("bytes"),
        latency_s,
        F.element_at(services, F.col("svc_index").cast("int") + 1),
    )
    out = df.select(
        F.element_at(services, F.col("svc_index").cast("int") + 1).cast("binary").alias("key"),
        line.cast("binary").alias("value"),
    )
    out.write.format("tidelog").option("gateway", gateway).option("topic", topic).mode(
        "append"
    ).save()
    return lines
