"""Spark finds Python data sources in top-level ``pyspark_*`` packages that define
``DefaultSource`` (Spark 4's static registration): with tidelog installed,
``spark.read.format("tidelog")`` works without ``tidelog.spark.register(spark)``."""

from tidelog.spark.source import TidelogDataSource as DefaultSource

__all__ = ["DefaultSource"]
