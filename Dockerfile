# One image for every tidelog role: `tidelog storage|controller|gateway|...`.
#   docker build -t tidelog:0.1.0 .                       services, SDK and CLI
#   docker build --target spark -t tidelog-spark:0.1.0 .  plus PySpark and a JRE, for jobs
# Stage 1 builds wheels (compilers and headers stay there); the runtime stages only
# install them, run as a non-root user and need nothing writable but their volumes.

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY tidelog ./tidelog
COPY services ./services
# Spark finds the `tidelog` format through this package's entry (SPARK.md).
COPY pyspark_tidelog ./pyspark_tidelog
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim-bookworm AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent tidelog
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
# Made here, owned by the user: a new Docker volume takes the image directory's owner
# (without it, root's, and `docker run -v data:/var/lib/tidelog ... storage` could not
# write). Kubernetes sets the volume's group through fsGroup instead.
RUN mkdir -p /var/lib/tidelog && chown 10001:10001 /var/lib/tidelog
USER 10001:10001
# Storage data lives on a volume mounted here; everything else is read-only.
VOLUME ["/var/lib/tidelog"]
EXPOSE 9092 9093 9094
ENTRYPOINT ["tidelog"]
CMD ["--help"]

FROM runtime AS spark
USER root
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
 && rm -rf /var/lib/apt/lists/* \
 && pip install --no-cache-dir "pyspark==4.3.0" "pyarrow>=26,<27"
COPY examples /opt/tidelog/examples
# Executor pods are started with the argument `executor` (see the script); other
# commands, the driver's spark-submit among them, run as given.
COPY deploy/docker/spark-entrypoint.sh /usr/local/bin/spark-entrypoint
ENV PYSPARK_PYTHON=/usr/local/bin/python PYTHONPATH=/opt/tidelog
USER 10001:10001
WORKDIR /opt/tidelog
ENTRYPOINT ["/usr/local/bin/spark-entrypoint"]
CMD ["python", "-m", "examples.nginx_pipeline.job", "--help"]
