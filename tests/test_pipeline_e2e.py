"""The example pipeline (``make run``: examples/nginx_pipeline) end to end, in a real Spark
``local[2]`` session against a real cluster: its stats are compared with an independent
computation (the SDK consumer reading every source line, parsed in Python), across a
second run, many partitions, records arriving meanwhile, the driver killed (kill -9)
mid-stream and mid-write, and session time zones off UTC. From an audit; slow (each
scenario gets its own cluster, the pipeline's default topic and group names)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tidelog
from tests.support.cluster import GatewayProcess, TestCluster, running_cluster

pyspark = pytest.importorskip("pyspark")

from examples.nginx_pipeline import job, report, stream_job  # noqa: E402
from tidelog.spark import local_session  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
MONTHS = {
    m: i
    for i, m in enumerate(
        ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"], 1
    )
}
LINE = re.compile(
    r'^\S+ - - \[(\d\d)/(\w{3})/(\d{4}):(\d\d):(\d\d):\d\d \+0000\] "GET \S+ HTTP/1\.1" '
    r'(\d{3}) \d+ "-" "curl/8\.5" rt=([\d.]+) svc=(\S+)$'
)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[TestCluster]:
    with running_cluster(tmp_path / "cluster") as c:
        yield c


@pytest.fixture
def gateway(cluster: TestCluster) -> GatewayProcess:
    return cluster.start_gateway()


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # As __main__ builds it (4 shuffle partitions); the JVM was started by conftest (2g).
    session = local_session(
        "pipeline-e2e",
        tmp_path_factory.mktemp("spark-local"),
        shuffle_partitions=4,
        driver_memory="2g",
    )
    try:
        yield session
    finally:
        session.stop()


def _source_lines(address: str, topic: str = job.SOURCE_TOPIC) -> list[str]:
    """Every line of ``topic`` below the high watermarks, read with the SDK consumer."""
    admin = tidelog.Admin(address)
    count = len(admin.describe_topic(topic).partitions)
    tps = [(topic, p) for p in range(count)]
    ends = admin.list_offsets(tps, "latest")
    want = sum(ends.values())
    got: list[str] = []
    with tidelog.Consumer(address, auto_offset_reset="earliest") as consumer:
        consumer.assign(tps)
        consumer.seek_to_beginning(tps)
        deadline = time.monotonic() + 60
        while len(got) < want and time.monotonic() < deadline:
            got += [r.value.decode() for r in consumer.poll(timeout_ms=500)]
    assert len(got) == want, (len(got), want)
    return got


def _expected_stats(lines: list[str]) -> dict[tuple[str, str], dict[str, Any]]:
    groups: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for line in lines:
        m = LINE.match(line)
        assert m, line
        day, mon, year, hh, mm, status, rt, svc = m.groups()
        minute = f"{year}-{MONTHS[mon]:02d}-{day} {hh}:{mm}"
        groups.setdefault((svc, minute), []).append((int(status), float(rt) * 1000))
    result = {}
    for key, rows in groups.items():
        lat = sorted(r[1] for r in rows)
        n = len(rows)
        result[key] = {
            "requests": n,
            "error_rate_5xx": sum(1 for r in rows if r[0] >= 500) / n,
            "p95_range": (lat[max(0, int(0.93 * n) - 1)], lat[min(n - 1, int(0.97 * n) + 1)]),
        }
    return result


def _check_stats(spark: Any, address: str) -> list[dict[str, Any]]:
    """The pipeline's stats (``report.latest_stats``) equal the independent computation."""
    stats = report.latest_stats(spark, address, job.STATS_TOPIC)
    expected = _expected_stats(_source_lines(address))
    got = {(s["service"], s["minute"]): s for s in stats}
    assert sorted(got) == sorted(expected)
    wrong = []
    for key, want in expected.items():
        s = got[key]
        lo, hi = want["p95_range"]
        if (
            s["requests"] != want["requests"]
            or abs(s["error_rate_5xx"] - want["error_rate_5xx"]) > 0.00011
            or not (lo - 0.06 <= s["p95_latency_ms"] <= hi + 0.06)
        ):
            wrong.append((key, s, want))
    assert not wrong, wrong[:5]
    return stats


def _ensure(address: str, partitions: int | None = None) -> None:
    admin = tidelog.Admin(address)
    if partitions is not None:
        admin.create_topic(job.SOURCE_TOPIC, partitions=partitions, replication_factor=2)
    job.ensure_topics(admin, replication_factor=2)


def _group_lag(address: str) -> tuple[int, int]:
    parts = tidelog.Admin(address).describe_group(job.GROUP)
    return sum(p.committed_offset for p in parts), sum(p.lag for p in parts)


def test_pipeline_stats_match_an_independent_computation_and_a_second_run(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """A run with the make-run shape (16 partitions, several micro-batches), then the
    same job again with the same checkpoint (job.py on Kubernetes reruns so)."""
    _ensure(gateway.address)
    checkpoint = tmp_path / "checkpoint"
    status = job.run_pipeline(
        spark, gateway.address, lines=3000, checkpoint=checkpoint, max_offsets=700
    )
    assert status == 0
    stats = _check_stats(spark, gateway.address)
    assert sum(s["requests"] for s in stats) == 3000
    assert _group_lag(gateway.address) == (3000, 0)
    # Run twice: the generator appends the same 3000 lines again; the stats (newest per
    # key) must account for all 6000, the group must have reached the end.
    status = job.run_pipeline(
        spark, gateway.address, lines=3000, checkpoint=checkpoint, max_offsets=700
    )
    assert status == 0
    stats = _check_stats(spark, gateway.address)
    assert sum(s["requests"] for s in stats) == 6000
    assert _group_lag(gateway.address) == (6000, 0)


def test_pipeline_with_many_partitions_and_a_small_trigger(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """A source topic of 48 partitions (created before the job, which keeps it) and
    a small maxOffsetsPerTrigger (many micro-batches, a few records per partition each)."""
    _ensure(gateway.address, partitions=48)
    status = job.run_pipeline(
        spark, gateway.address, lines=2500, checkpoint=tmp_path / "checkpoint", max_offsets=600
    )
    assert status == 0
    stats = _check_stats(spark, gateway.address)
    assert sum(s["requests"] for s in stats) == 2500
    assert _group_lag(gateway.address) == (2500, 0)


def test_stream_job_with_records_arriving_while_it_runs(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """A producer keeps appending lines while the streaming job runs (AvailableNow): the
    run reads up to where the log was when it started; a second run the rest. The stats
    then account for every line, once."""
    from examples.nginx_pipeline import generator

    _ensure(gateway.address)
    generator.generate(spark, gateway.address, job.SOURCE_TOPIC, 2000)
    sample = _source_lines(gateway.address)[:200]
    stop = threading.Event()
    sent = [0]

    def produce() -> None:
        with tidelog.Producer(gateway.address) as producer:
            i = 0
            while not stop.is_set():
                line = sample[i % len(sample)]
                svc = LINE.match(line).group(8)  # type: ignore[union-attr]
                producer.send(job.SOURCE_TOPIC, line.encode(), key=svc.encode())
                i += 1
                if i % 50 == 0:
                    producer.flush()
                    sent[0] = i
                    time.sleep(0.05)
            producer.flush()
            sent[0] = i

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    checkpoint = tmp_path / "checkpoint"
    try:
        stream_job.run(
            spark,
            gateway.address,
            job.SOURCE_TOPIC,
            job.STATS_TOPIC,
            checkpoint=checkpoint,
            max_offsets=500,
        )
    finally:
        stop.set()
        thread.join(30)
    assert sent[0] > 0
    stream_job.run(
        spark,
        gateway.address,
        job.SOURCE_TOPIC,
        job.STATS_TOPIC,
        checkpoint=checkpoint,
        max_offsets=500,
    )
    stats = _check_stats(spark, gateway.address)
    assert sum(s["requests"] for s in stats) == 2000 + sent[0]
    assert _group_lag(gateway.address) == (2000 + sent[0], 0)


DRIVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from tidelog.spark import local_session
    spark = local_session("audit-killed", Path(sys.argv[3]), shuffle_partitions=4)
    from examples.nginx_pipeline import job, stream_job
    stream_job.run(spark, sys.argv[1], job.SOURCE_TOPIC, job.STATS_TOPIC,
                   checkpoint=Path(sys.argv[2]), max_offsets=int(sys.argv[4]))
    print("FINISHED", flush=True)
    """
)


def _batches(checkpoint: Path, sub: str) -> list[int]:
    d = checkpoint / sub
    if not d.is_dir():
        return []
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit())


def test_stream_job_killed_mid_way_and_resumed_from_its_checkpoint(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """The driver (Python and its JVM: the whole process group) is killed with SIGKILL
    in the middle of the streaming job; the job started again on the same checkpoint
    must end with stats accounting for every line exactly once (the checkpointed state
    plus a replay of the interrupted micro-batch, whose stats are written again)."""
    from examples.nginx_pipeline import generator

    _ensure(gateway.address)
    generator.generate(spark, gateway.address, job.SOURCE_TOPIC, 3000)
    checkpoint = tmp_path / "checkpoint"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    log = (tmp_path / "driver.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, gateway.address, str(checkpoint), str(tmp_path), "200"],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    killed_at: tuple[list[int], list[int]] | None = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            offsets, commits = _batches(checkpoint, "offsets"), _batches(checkpoint, "commits")
            # Mid-way: a few micro-batches done, one planned and not committed.
            if len(commits) >= 3 and offsets and offsets[-1] not in commits:
                os.killpg(proc.pid, signal.SIGKILL)
                killed_at = (offsets, commits)
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        log.close()
    assert killed_at is not None, (tmp_path / "driver.log").read_text()[-3000:]
    # SPARK.md: the group is at most one micro-batch behind the checkpoint.
    offsets, commits = killed_at
    group = _group_lag(gateway.address)[0]
    allowed = {_planned_ends(checkpoint, b) for b in commits[-2:]}
    assert group in allowed, (group, allowed, killed_at)
    stream_job.run(
        spark,
        gateway.address,
        job.SOURCE_TOPIC,
        job.STATS_TOPIC,
        checkpoint=checkpoint,
        max_offsets=200,
    )
    stats = _check_stats(spark, gateway.address)
    assert sum(s["requests"] for s in stats) == 3000, killed_at
    assert _group_lag(gateway.address) == (3000, 0)
    # What job.run_pipeline would compute for a rerun now: the group's committed sum is
    # its "before"; it must equal what the checkpointed state counted.
    print("killed at offsets/commits", killed_at, json.dumps(_group_lag(gateway.address)))


COPY_DRIVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from tidelog.spark import local_session
    gateway, source, target, checkpoint, local, guarantee = sys.argv[1:7]
    spark = local_session("audit-copy", Path(local))
    query = (
        spark.readStream.format("tidelog").option("gateway", gateway)
        .option("subscribe", source).option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", "1500").load()
        .select("key", "value")
        .writeStream.format("tidelog").option("gateway", gateway).option("topic", target)
        .option("deliveryGuarantee", guarantee).option("batchBytes", "2048")
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True).start()
    )
    query.awaitTermination()
    print("FINISHED", query.exception(), flush=True)
    """
)


def _planned_ends(checkpoint: Path, batch: int) -> int:
    text = (checkpoint / "offsets" / str(batch)).read_text().strip().splitlines()[-1]
    data = json.loads(text)
    return sum(int(o) for t, parts in data.items() if not t.startswith("$") for o in parts.values())


@pytest.mark.parametrize("guarantee", ["exactly-once", "at-least-once"])
def test_stream_write_killed_mid_write_and_resumed(
    spark: Any, gateway: GatewayProcess, tmp_path: Path, guarantee: str
) -> None:
    """SPARK.md: exactly-once (a restart from the checkpoint after a crash sends the same
    batches, recognised as written) and at-least-once (duplicates possible, no loss). The
    driver's process group is killed with SIGKILL while a micro-batch's rows are being
    written (the target holds more than the committed batches wrote, less than the
    planned one), then the query is started again on its checkpoint."""
    admin = tidelog.Admin(gateway.address)
    source, target = f"kill-in-{guarantee}", f"kill-out-{guarantee}"
    admin.create_topic(source, partitions=3, replication_factor=2)
    admin.create_topic(target, partitions=3, replication_factor=2)
    sent = [f"row-{i:05d}-".encode() * 8 for i in range(6000)]
    keys = [None if i % 5 == 0 else f"k{i % 11}".encode() for i in range(6000)]
    with tidelog.Producer(gateway.address) as producer:
        producer.send_batch(source, sent, keys=keys).result(60)
    checkpoint = tmp_path / "checkpoint"
    out_tps = [(target, p) for p in range(3)]
    log = (tmp_path / "driver.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-c", COPY_DRIVER, gateway.address, source, target, str(checkpoint),
         str(tmp_path / "local"), guarantee],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    killed: tuple[int, int, int] | None = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            offsets, commits = _batches(checkpoint, "offsets"), _batches(checkpoint, "commits")
            if offsets and offsets[-1] not in commits and offsets[-1] >= 1:
                done = _planned_ends(checkpoint, commits[-1]) if commits else 0
                planned = _planned_ends(checkpoint, offsets[-1])
                written = sum(admin.list_offsets(out_tps, "latest").values())
                if done < written < planned:
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed = (done, written, planned)
                    break
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        log.close()
    if killed is None:
        pytest.skip("no kill mid-write: " + (tmp_path / "driver.log").read_text()[-2000:])
    query = (
        spark.readStream.format("tidelog").option("gateway", gateway.address)
        .option("subscribe", source).option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", "1500").load()
        .select("key", "value")
        .writeStream.format("tidelog").option("gateway", gateway.address).option("topic", target)
        .option("deliveryGuarantee", guarantee).option("batchBytes", "2048")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True).start()
    )  # fmt: skip
    query.awaitTermination(180)
    assert query.exception() is None, query.exception()
    rows = (
        spark.read.format("tidelog").option("gateway", gateway.address)
        .option("subscribe", target).load().select("value").collect()
    )  # fmt: skip
    got = sorted(bytes(r["value"]) for r in rows)
    assert set(got) == set(sent), ("lost", len(set(sent) - set(got)), killed)
    if guarantee == "exactly-once":
        assert len(got) == len(sent), ("duplicates", len(got) - len(sent), killed)


@pytest.mark.parametrize("zone", ["Asia/Kathmandu", "America/St_Johns"])
def test_pipeline_in_a_session_time_zone_off_utc(
    spark: Any, gateway: GatewayProcess, tmp_path: Path, zone: str
) -> None:
    """The machine's zone (the session's) must change neither the lines nor the minutes
    of the stats (zones off UTC by a fraction of an hour)."""
    _ensure(gateway.address)
    before = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", zone)
    try:
        status = job.run_pipeline(
            spark, gateway.address, lines=1200, checkpoint=tmp_path / "checkpoint", max_offsets=700
        )
        assert status == 0
        stats = _check_stats(spark, gateway.address)
    finally:
        spark.conf.set("spark.sql.session.timeZone", before)
    assert {s["minute"][:13] for s in stats} == {"2026-11-23 00"}


def test_the_stream_job_counts_every_micro_batch(
    spark: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """stream_job.run answered "the number of micro-batches that read data" from
    ``query.recentProgress``, which holds only the last 100
    (spark.sql.streaming.numRecentProgressUpdates): a run of more micro-batches printed a
    wrong count (found by an audit)."""
    from examples.nginx_pipeline import generator

    _ensure(gateway.address)
    generator.generate(spark, gateway.address, job.SOURCE_TOPIC, 700)
    checkpoint = tmp_path / "checkpoint"
    batches = stream_job.run(
        spark,
        gateway.address,
        job.SOURCE_TOPIC,
        job.STATS_TOPIC,
        checkpoint=checkpoint,
        max_offsets=6,
    )
    # Batch ids run from 0 (Spark keeps only the last 100 batches' files); a batch that
    # read nothing (AvailableNow's last, with a stateful query) is not counted.
    last = max(int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit())
    assert batches > 100 and last <= batches <= last + 1, (batches, last)
