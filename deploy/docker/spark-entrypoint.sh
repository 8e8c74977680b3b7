#!/bin/sh
# Entrypoint of the tidelog-spark image (Dockerfile, stage `spark`).
#
# Spark on Kubernetes starts each executor pod from the job's image with the single
# argument `executor` and describes the executor in environment variables (SPARK_DRIVER_URL,
# SPARK_EXECUTOR_ID, ..., one SPARK_JAVA_OPT_<n> per JVM option). Spark's own images answer
# that in their entrypoint; pip's pyspark ships the jars but no entrypoint, so this is
# ours. Any other command (the driver's `spark-submit ...`, `python -m ...`) runs as given.
set -eu

if [ "${1:-}" != executor ]; then
  exec "$@"
fi
shift

for name in SPARK_DRIVER_URL SPARK_EXECUTOR_ID SPARK_EXECUTOR_CORES SPARK_APPLICATION_ID \
  SPARK_EXECUTOR_POD_IP SPARK_EXECUTOR_POD_NAME SPARK_EXECUTOR_MEMORY; do
  eval "value=\${$name:-}"
  if [ -z "$value" ]; then
    echo "spark-entrypoint: executor: $name is not set (Spark sets it on executor pods)" >&2
    exit 2
  fi
done

# pip's pyspark is a Spark home: its jars/ hold the executor's classes.
if [ -z "${SPARK_HOME:-}" ]; then
  SPARK_HOME="$(python -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')" || {
    echo "spark-entrypoint: executor: no SPARK_HOME and python cannot import pyspark" >&2
    exit 2
  }
fi

# The JVM options the driver gave, in their order (SPARK_JAVA_OPT_0, _1, ...). Each is one
# argument even with spaces inside, so they are read into the positional parameters.
set --
for index in $(env | sed -n 's/^SPARK_JAVA_OPT_\([0-9][0-9]*\)=.*/\1/p' | sort -n); do
  eval "set -- \"\$@\" \"\${SPARK_JAVA_OPT_$index}\""
done

# Java 17 closes the JDK internals Spark uses; spark-submit opens them for the driver
# (the launcher's JavaModuleOptions), and executors need the same.
exec java \
  -XX:+IgnoreUnrecognizedVMOptions \
  --add-opens=java.base/java.lang=ALL-UNNAMED \
  --add-opens=java.base/java.lang.invoke=ALL-UNNAMED \
  --add-opens=java.base/java.lang.reflect=ALL-UNNAMED \
  --add-opens=java.base/java.io=ALL-UNNAMED \
  --add-opens=java.base/java.net=ALL-UNNAMED \
  --add-opens=java.base/java.nio=ALL-UNNAMED \
  --add-opens=java.base/java.util=ALL-UNNAMED \
  --add-opens=java.base/java.util.concurrent=ALL-UNNAMED \
  --add-opens=java.base/java.util.concurrent.atomic=ALL-UNNAMED \
  --add-opens=java.base/jdk.internal.ref=ALL-UNNAMED \
  --add-opens=java.base/sun.nio.ch=ALL-UNNAMED \
  --add-opens=java.base/sun.nio.cs=ALL-UNNAMED \
  --add-opens=java.base/sun.security.action=ALL-UNNAMED \
  --add-opens=java.base/sun.util.calendar=ALL-UNNAMED \
  -Dio.netty.tryReflectionSetAccessible=true \
  "$@" \
  -Xms"$SPARK_EXECUTOR_MEMORY" -Xmx"$SPARK_EXECUTOR_MEMORY" \
  -cp "$SPARK_HOME/jars/*" \
  org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend \
  --driver-url "$SPARK_DRIVER_URL" \
  --executor-id "$SPARK_EXECUTOR_ID" \
  --cores "$SPARK_EXECUTOR_CORES" \
  --app-id "$SPARK_APPLICATION_ID" \
  --hostname "$SPARK_EXECUTOR_POD_IP" \
  --resourceProfileId "${SPARK_RESOURCE_PROFILE_ID:-0}" \
  --podName "$SPARK_EXECUTOR_POD_NAME"
