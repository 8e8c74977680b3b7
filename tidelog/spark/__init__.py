"""The ``tidelog`` data source for Spark (batch and streaming reads and writes).

``tidelog.spark.register(spark)`` registers it; then
``spark.read.format("tidelog").option("gateway", ...).option("subscribe", ...)``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def register(spark: Any) -> None:
    """Register the ``tidelog`` format in ``spark`` (a SparkSession)."""
    from tidelog.spark.source import TidelogDataSource  # noqa: PLC0415  # pyspark is heavy

    spark.dataSource.register(TidelogDataSource)


def activate(spark: Any) -> None:
    """Make ``spark`` the active session of the calling thread, so ``format("tidelog")``
    is found there.

    Spark registers Python data sources per session and looks a format name up through
    the active session of the JVM thread that runs the call. PySpark sets it on the thread
    that built the session only: in any other Python thread ``format("tidelog")`` fails
    with DATA_SOURCE_NOT_FOUND until this is called there (``SparkSession.builder
    .getOrCreate()`` in the thread does not set it)."""
    # PySpark has no public call for this (private attributes, stable since Spark 2).
    spark._jvm.SparkSession.setActiveSession(spark._jsparkSession)


def _use_this_python() -> None:
    """Spark's Python workers run this interpreter (``PYSPARK_PYTHON``)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable


def start_jvm(driver_memory: str = "1g") -> None:
    """Launch Spark's JVM now if this process has none yet; a later ``local_session`` (or
    any SparkSession) here uses it.

    Call it before the process opens gRPC channels or servers: PySpark starts the JVM
    with a ``fork()`` that runs Python in the child (a ``preexec_fn``), and a fork while
    gRPC's threads run can break either side - the JVM dies before answering ("Java
    gateway process exited") or gRPC's poller loses its descriptor. ``driver_memory`` is
    fixed when the JVM starts, so pass what the session will ask for."""
    from pyspark import SparkConf, SparkContext  # noqa: PLC0415  # pyspark is heavy

    # The JVM keeps the environment it starts with: Python it launches itself (the lookup
    # of installed ``pyspark_*`` data sources) must be this interpreter, as tasks' are.
    _use_this_python()
    SparkContext._ensure_initialized(conf=SparkConf().set("spark.driver.memory", driver_memory))


def local_session(
    app_name: str,
    local_dir: Path,
    *,
    shuffle_partitions: int = 2,
    driver_memory: str = "1g",
) -> Any:
    """A ``local[2]`` SparkSession with the ``tidelog`` format registered: Python workers
    run this interpreter (``PYSPARK_PYTHON``), no UI, quiet logs. For examples, tests and
    benchmarks; on a cluster, build the session as ``spark-submit`` configures it."""
    from pyspark.sql import SparkSession  # noqa: PLC0415  # pyspark is heavy

    _use_this_python()
    spark = (
        SparkSession.builder.master("local[2]")
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.driver.memory", driver_memory)
        .config("spark.local.dir", str(local_dir))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark
