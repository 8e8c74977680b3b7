"""Shared fixtures: real storage node processes on loopback, cleaned up after each test."""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

# Make ``tests.support`` importable however pytest was started (pytest, python -m pytest).
_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import tidelog  # noqa: E402
from services.cluster_metadata import TOPICS_PREFIX  # noqa: E402
from tests.support.cluster import GatewayProcess, TestCluster, running_cluster  # noqa: E402
from tests.support.process import StartStorage, StorageProcess  # noqa: E402
from tidelog.v1 import controller_pb2  # noqa: E402

LONGEST_MODULES_FIRST: tuple[str, ...] = (
    "test_spark.py",
    "test_gateway.py",
    "test_chaos.py",
    "test_direct.py",
    "test_replication.py",
    "test_hostile_input.py",
    "test_cli.py",
    "test_controller.py",
    "test_groups.py",
    "test_storage_recovery.py",
)
"""``make test`` runs two pytest-xdist workers, each taking whole modules in collection
order (``--dist loadfile``): the longest (a minute or two each, measured with
``--durations=0``) go first, so the run does not end with one worker alone on a long one."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_MODULES_FIRST)}
    # A stable sort: within a module (and among the others) the order is pytest's.
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Spark's JVM starts before any test opens a gRPC channel in this process (as
    ``make run``'s pipeline does, see ``tidelog.spark.start_jvm``): the Spark tests run
    after modules whose channels and servers leave gRPC threads behind."""
    wants_spark = any("spark" in getattr(item, "fixturenames", ()) for item in session.items)
    if wants_spark and importlib.util.find_spec("pyspark") is not None:
        from tidelog.spark import start_jvm

        start_jvm(driver_memory="2g")  # as tests/test_spark.py's session asks


# --- reruns ----------------------------------------------------------------------------
# ``make test`` runs a failed test once more (``--reruns 1``). A module's shared cluster
# keeps what the failed attempt made, so a rerun would meet its own topics and fail on
# TOPIC_ALREADY_EXISTS instead of showing whether the failure was real: the fixture below
# deletes them first. And -q prints nothing of a first attempt that failed when the rerun
# passed, so the summary prints the end of each such failure.

RERUN_REPORT_LINES = 40
_TOPICS_BEFORE: dict[str, frozenset[str]] = {}
"""The topics each test's first attempt started with, by node id."""


def _topic_names(cluster: TestCluster) -> frozenset[str]:
    return frozenset(
        kv.key.removeprefix(TOPICS_PREFIX) for kv in cluster.store.get_prefix(TOPICS_PREFIX)
    )


def _delete_topics(cluster: TestCluster, names: frozenset[str]) -> None:
    cluster.api.DeleteTopics(
        controller_pb2.DeleteTopicsRequest(names=sorted(names), timeout_ms=10_000), timeout=30
    )
    deadline = time.monotonic() + 30
    while _topic_names(cluster) & names and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def _a_rerun_starts_without_its_failed_attempts_topics(
    request: pytest.FixtureRequest,
) -> Iterator[None]:
    if "cluster" in request.fixturenames:
        cluster = request.getfixturevalue("cluster")
        if isinstance(cluster, TestCluster):
            node_id = request.node.nodeid
            before = _TOPICS_BEFORE.get(node_id)
            # Best effort: a cluster the test before left without etcd or a controller
            # only loses the clean-up, and the test goes on to say what is wrong.
            try:
                if before is not None and getattr(request.node, "execution_count", 1) > 1:
                    made = _topic_names(cluster) - before
                    if made:
                        _delete_topics(cluster, made)
                else:
                    _TOPICS_BEFORE[node_id] = _topic_names(cluster)
            except Exception as exc:
                print(f"rerun topic bookkeeping skipped: {exc!r}", file=sys.stderr)
    yield


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    reruns = terminalreporter.stats.get("rerun", [])
    if not reruns:
        return
    terminalreporter.section("first attempts of rerun tests (the end of each failure)")
    for report in reruns:
        lines = str(getattr(report, "longreprtext", "") or report.longrepr).splitlines()
        terminalreporter.write_line(f"--- {report.nodeid} ({report.when})")
        for line in lines[-RERUN_REPORT_LINES:]:
            terminalreporter.write_line(line)


@pytest.fixture
def start_storage(tmp_path: Path) -> Iterator[StartStorage]:
    """A factory for storage processes; any still running at teardown are killed.

    ``start_storage(data_dir=None, broker_id=1, extra_args=())`` returns a started
    StorageProcess (listening and SERVING). The default data dir is ``tmp_path/data``.
    """
    started: list[StorageProcess] = []

    def start(
        data_dir: Path | None = None, *, broker_id: int = 1, extra_args: Sequence[str] = ()
    ) -> StorageProcess:
        directory = data_dir or tmp_path / "data"
        node = StorageProcess(
            directory,
            broker_id=broker_id,
            log_path=tmp_path / f"storage-{broker_id}-{len(started)}.stderr.log",
            extra_args=extra_args,
        )
        started.append(node)
        return node.start()

    yield start
    for node in started:
        if node.proc.poll() is None:
            node.kill()


@pytest.fixture(scope="module")
def storage_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StorageProcess]:
    """One storage node shared by a module's tests (each test uses its own topics)."""
    base = tmp_path_factory.mktemp("storage-node")
    node = StorageProcess(base / "data", log_path=base / "storage.stderr.log")
    with node:
        node.start()
        yield node
        status = node.terminate()
        assert status == 0, f"storage node exited with {status}:\n{node.log_tail()}"


# A whole cluster (etcd, controller, 3 storage nodes) with one gateway, shared by a test
# module; modules that need another shape define their own ``cluster``/``gateway``.


@pytest.fixture(scope="module")
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TestCluster]:
    base: Path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    with running_cluster(base) as c:
        yield c


@pytest.fixture(scope="module")
def gateway(cluster: TestCluster) -> GatewayProcess:
    return cluster.start_gateway()


@pytest.fixture(scope="module")
def admin(gateway: GatewayProcess) -> tidelog.Admin:
    return tidelog.Admin(gateway.address)
