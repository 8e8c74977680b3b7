"""The ``tidelog`` data source for Spark (batch and streaming reads and writes).

``tidelog.spark.register(spark)`` registers it; then
``spark.read.format("tidelog").option("gateway", ...).option("subscribe", ...)``.
"""

from __future__ import annotations

from typing import Any


def register(spark: Any) -> None:
    """Register the ``tidelog`` format in ``spark`` (a SparkSession)."""
    from tidelog.spark.source import TidelogDataSource  # noqa: PLC0415  # pyspark is heavy

    spark.dataSource.register(TidelogDataSource)
