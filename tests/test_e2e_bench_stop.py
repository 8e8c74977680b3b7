"""What `tidelog bench` leaves running when it is stopped (SIGTERM, or Ctrl-C to its process
group), in its main phase and in its Spark phase (``bench.suite._spark_rates``: a spawned
child that starts a cluster and a JVM of its own), and how soon it stops. Found by an
audit: the Spark child's whole cluster (or its JVM) kept running, and a Ctrl-C during a
produce case took two minutes. Slow (``make chaos``): each case runs the real bench.

The child process runs ``tidelog bench --quick`` through the real CLI entry point
(``tidelog.cli.main``, which turns SIGTERM into a KeyboardInterrupt so ``with`` blocks
close), with ``bench.suite.run`` cut down to the Spark phase so the test does not run the
whole suite. TMPDIR points into the test's directory: every process the bench starts has
it in its command line, which is how leftovers are found (and killed, by pid, after).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import sys
    from bench import suite

    def run(quick):
        suite._spark_rates(200_000)
        return {}

    suite.run = run
    suite.report = lambda results, quick: ""
    from tidelog.cli import main
    sys.exit(main(["bench", "--quick"]))
    """
)


def _processes_with(marker: str) -> dict[int, str]:
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmd:
            found[int(entry)] = cmd
    return found


def _kill_all(markers: list[str]) -> None:
    for marker in markers:
        for pid in _processes_with(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


MAIN_PHASE_CHILD = (
    "import sys\nfrom tidelog.cli import main\nsys.exit(main(['bench', '--quick']))\n"
)


def _stop_bench(tmp_path: Path, how: str, script: str = CHILD) -> dict[int, str]:
    tmpdir = tmp_path / "t"
    tmpdir.mkdir()
    marker = str(tmpdir)
    env = dict(os.environ, TMPDIR=marker, PYTHONPATH=str(REPO))
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        start_new_session=True,  # its own process group: a "Ctrl-C" reaches only it
        stdout=open(tmp_path / "bench.out", "wb"),  # noqa: SIM115
        stderr=open(tmp_path / "bench.log", "wb"),  # noqa: SIM115
    )
    markers = [marker]
    leftovers: dict[int, str] = {}
    try:
        # The Spark child's cluster is up once its three storage nodes run; the controller
        # and the gateway have no directory in their command line, only etcd's address.
        def brokers() -> list[str]:
            return [c for c in _processes_with(marker).values() if " storage " in c]

        started = _wait_for(lambda: len(brokers()) == 3 and brokers(), 120, "the Spark cluster")
        etcd = started[0].split("--etcd ", 1)[1].split()[0]
        markers.append(f"--etcd {etcd} ")
        time.sleep(2.0)
        if how == "SIGTERM":  # `kill PID`, `timeout`, systemd, docker stop
            child.send_signal(signal.SIGTERM)
        else:  # Ctrl-C in a terminal: SIGINT to the foreground process group
            os.killpg(child.pid, signal.SIGINT)
        child.wait(60)
        time.sleep(5)  # let anything shutting down finish
        for m in markers:
            leftovers.update(_processes_with(m))
        return leftovers
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        _kill_all(markers)  # only processes this test started


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_bench_stopped_in_spark_phase_leaves_nothing_running(tmp_path: Path, how: str) -> None:
    pytest.importorskip("pyspark")
    leftovers = _stop_bench(tmp_path, how)
    assert not leftovers, (
        f"after {how} to `tidelog bench` during its Spark phase, "
        f"{len(leftovers)} processes still run:\n"
        + "\n".join(f"{pid}: {cmd[:160]}" for pid, cmd in leftovers.items())
    )


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_bench_stopped_in_main_phase_leaves_nothing_running(tmp_path: Path, how: str) -> None:
    """The same, stopped while the main tidelog cluster runs (for comparison: fine)."""
    leftovers = _stop_bench(tmp_path, how, MAIN_PHASE_CHILD)
    assert not leftovers, "\n".join(f"{pid}: {cmd[:160]}" for pid, cmd in leftovers.items())


def test_ctrl_c_during_an_acks_all_case_stops_the_bench_promptly(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the foreground process group) while a produce case runs: the
    cluster's processes get it too and stop, and the bench should end, not wait on a
    producer whose records can no longer be acknowledged."""
    tmpdir = tmp_path / "t"
    tmpdir.mkdir()
    log = tmp_path / "bench.log"
    env = dict(os.environ, TMPDIR=str(tmpdir), PYTHONPATH=str(REPO))
    child = subprocess.Popen(
        [sys.executable, "-c", MAIN_PHASE_CHILD],
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=open(tmp_path / "bench.out", "wb"),  # noqa: SIM115
        stderr=open(log, "wb"),  # noqa: SIM115
    )
    markers = [str(tmpdir)]
    try:
        # tqdm's bar for the case is drawn just before the case's producer starts.
        _wait_for(lambda: b"produce RF=3 acks=all" in log.read_bytes(), 180, "the acks=all case")
        for cmd in _processes_with(str(tmpdir)).values():
            if " storage " in cmd:
                markers.append(f"--etcd {cmd.split('--etcd ', 1)[1].split()[0]} ")
                break
        time.sleep(0.3)
        os.killpg(child.pid, signal.SIGINT)
        interrupted = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(200)
        took = time.monotonic() - interrupted
        assert took < 30, f"`tidelog bench` took {took:.0f} s to stop after Ctrl-C"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        _kill_all(markers)
