"""``tidelog dev``: a whole local cluster in one command.

Starts, in order: a private etcd, one controller, N storage nodes and a gateway, each a
child process of this one, all on loopback. Prints one line containing ``ready`` and the
gateway address once the gateway answers; runs until SIGINT (Ctrl-C) or SIGTERM, then
stops everything in reverse order and exits 0.

Layout of the data directory (``./.tidelog`` by default)::

    etcd/            the etcd member (its data survives restarts)
    broker-<id>/     each storage node's partition logs
    logs/<role>.log  each process's JSON log lines

Running ``tidelog dev`` again on the same directory keeps every topic and record: etcd and
the brokers recover from their data. Children run in their own session, so a Ctrl-C at the
terminal reaches only this supervisor, which then stops them in a safe order (gateway,
brokers, controller, etcd) rather than all at once. A supervisor killed outright (SIGKILL,
the OOM killer) cannot do that; the kernel then sends every child SIGTERM
(``tidelog.child_process``), so none outlives it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import IO, Final

import grpc

from tidelog.admin import Admin
from tidelog.child_process import end_with_parent
from tidelog.errors import TidelogError
from tidelog.etcd_launcher import EtcdLaunchError, EtcdProcess
from tidelog.stop_flag import StopFlag
from tidelog.v1 import controller_pb2, controller_pb2_grpc

_LISTENING: Final = re.compile(r"listening on (?P<address>\S+)")
START_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 20.0
CLUSTER: Final = "dev"


class _Child:
    """One ``python -m tidelog <role>`` child with its log file and announced address."""

    def __init__(self, name: str, args: list[str], log_dir: Path, lock: IO[bytes]) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log: IO[bytes] = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        # Where this run's lines start: an earlier run's process may still be writing to
        # the same file as it stops, and its errors are not this child's.
        self._log_start = self.log_path.stat().st_size
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tidelog", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            start_new_session=True,
            # The data directory's lock goes with every child (a flock belongs to the open
            # file, shared across fork): it is held until the last of them has exited,
            # not only while this supervisor lives (_lock_data_dir).
            pass_fds=(lock.fileno(),),
            # A SIGKILLed supervisor cannot stop its children: the kernel then sends them
            # SIGTERM (every child is started from the main thread, which lives as long).
            preexec_fn=end_with_parent(),  # noqa: PLW1509 - only a prctl runs (its docstring)
        )
        self.address: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            match = _LISTENING.search(line)
            if match and self.address is None:
                self.address = match["address"]
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout_s: float, stop: StopFlag) -> str | None:
        """The child's address once it announced it; None when ``stop`` was set first
        (a SIGTERM during start-up must not wait for every child to be ready)."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if stop.is_set():
                return None
            if time.monotonic() >= deadline:
                break
        if not self._ready.is_set() or self.address is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(1.0)  # its output ended: it is exiting (a status, not None)
            cause = self._last_error_line()
            raise RuntimeError(
                f"{self.name} did not start (exit status {self.proc.poll()})"
                + (f": {cause}" if cause else "")
                + f"; see {self.log_path}"
            )
        return self.address

    def _last_error_line(self) -> str:
        """The last line of the log that names an error (a port in use, say), cut short:
        the cause belongs in the one line ``tidelog dev`` prints."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                lines = log.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            if "error" in line.lower():
                text = line.strip()
                return text if len(text) <= 300 else f"{text[:300]}..."
        return ""

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def _python_path_env() -> None:
    # Children import this checkout (or the installed package) the way this process did.
    root = str(Path(__file__).resolve().parents[1])
    paths = os.environ.get("PYTHONPATH", "")
    if root not in paths.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, paths) if p)


def main(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir).resolve()
    brokers = int(args.brokers)
    log_dir = data_dir / "logs"
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"tidelog dev: error: cannot use --data-dir {data_dir}: {exc}", file=sys.stderr)
        return 1
    stop = StopFlag()  # not a threading.Event: see tidelog.stop_flag

    def request_stop(signum: int, frame: FrameType | None) -> None:
        del frame
        stop.set(signum)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGHUP, request_stop)  # its terminal closed: stop in order
    lock = _lock_data_dir(data_dir, stop)
    if lock is None:
        if stop.is_set():
            return 0
        print(
            f"tidelog dev: error: data directory {data_dir} is in use by another tidelog dev",
            file=sys.stderr,
        )
        return 1
    _python_path_env()

    etcd: EtcdProcess | None = None
    children: list[_Child] = []
    try:
        try:
            etcd = EtcdProcess(data_dir / "etcd", end_with_parent=True).start()
        except EtcdLaunchError as exc:
            # One line, as every CLI error: the message's first line names etcd's log,
            # whose tail the rest of it repeats (up to 40 lines of JSON).
            first = str(exc).splitlines()[0].rstrip(":") if str(exc) else repr(exc)
            print(f"tidelog dev: error: {first}", file=sys.stderr)
            return 1
        common = ["--etcd", etcd.endpoint, "--cluster", CLUSTER]
        controller = _Child(
            "controller",
            ["controller", *common, "--listen", "127.0.0.1:0", "--controller-id", "1"],
            log_dir,
            lock,
        )
        children.append(controller)
        for broker_id in range(brokers):
            children.append(
                _Child(
                    f"broker-{broker_id}",
                    [
                        "storage",
                        *common,
                        "--broker-id",
                        str(broker_id),
                        "--data-dir",
                        str(data_dir / f"broker-{broker_id}"),
                        "--listen",
                        "127.0.0.1:0",
                        "--session-ttl-s",
                        "5",
                        "--controlled-shutdown-timeout-s",
                        "5",
                    ],
                    log_dir,
                    lock,
                )
            )
        gateway = _Child(
            "gateway",
            ["gateway", *common, "--listen", f"127.0.0.1:{args.gateway_port}"],
            log_dir,
            lock,
        )
        children.append(gateway)
        for child in children:
            if child.wait_ready(START_TIMEOUT_S, stop) is None:
                return 0  # stopped while starting
        address = gateway.address
        assert address is not None
        if not _wait_usable(address, brokers, stop):
            return 0  # stopped while starting
        print(
            f"tidelog dev ready: gateway {address} (etcd {etcd.endpoint}, {brokers} brokers, "
            f"data in {data_dir}); export TIDELOG_GATEWAY={address}",
            flush=True,
        )
        while not stop.wait(0.5):
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                print(
                    f"tidelog dev: error: {dead[0].name} exited with status "
                    f"{dead[0].proc.returncode}; see {dead[0].log_path}",
                    file=sys.stderr,
                )
                return 1
            if not etcd.is_running():
                # Watched like the other children: without it nothing works, and a dead
                # etcd used to leave dev running, silent, every request timing out.
                print(
                    f"tidelog dev: error: etcd exited; see {data_dir / 'etcd'}",
                    file=sys.stderr,
                )
                return 1
        return 0
    except RuntimeError as exc:
        print(f"tidelog dev: error: {exc}", file=sys.stderr)
        return 1
    finally:
        _stop_all(children, etcd)
        print("tidelog dev stopped", flush=True)


def _lock_data_dir(data_dir: Path, stop: StopFlag) -> IO[bytes] | None:
    """An exclusive flock on ``<data_dir>/.dev.lock``, held until this process and every
    child it starts have ended (the kernel drops it however they end); None when another
    running dev holds it, or ``stop`` was set while waiting. A second dev on the same
    directory used to fail after 15 s with etcd's log (its db "flocked by another
    process"), or worse, get as far as its brokers.

    The file names the dev holding it. Held by a dev no longer running, the lock is its
    children's, still stopping: a dev killed outright (SIGKILL, the OOM killer) leaves
    them SIGTERMed, and a broker takes up to its controlled-shutdown timeout to stop,
    holding its data directory meanwhile. A new dev waits for them (up to
    STOP_TIMEOUT_S): it used to start at once and fail on its brokers' locks (found by
    an audit)."""
    lock = open(data_dir / ".dev.lock", "a+b")  # noqa: SIM115 - held for the process's life
    deadline = time.monotonic() + STOP_TIMEOUT_S
    told = False
    while True:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            pass
        if _holder_running(lock) or time.monotonic() >= deadline or stop.is_set():
            lock.close()
            return None
        if not told:
            print(
                "tidelog dev: waiting for the processes of a stopped tidelog dev to exit",
                file=sys.stderr,
                flush=True,
            )
            told = True
        time.sleep(0.1)
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n".encode())
    lock.flush()
    return lock


def _holder_running(lock: IO[bytes]) -> bool:
    """Whether the dev the lock file names is running (an unreadable file counts as so:
    refusing is the safe answer)."""
    lock.seek(0)
    try:
        pid = int(lock.read().decode().strip())
        os.kill(pid, 0)
    except (ValueError, UnicodeDecodeError):
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # a process of another user has that pid
    return True


def _wait_usable(address: str, brokers: int, stop: StopFlag) -> bool:
    """Until every broker is registered and every partition has a leader that knows it
    (on a restart, elections and recovery take a moment after the processes are up).

    Partitions with no in-sync replica among the brokers started (a data directory made
    with more ``--brokers``) can never have a leader (a clean election needs one): they
    are not waited for, and named in a warning. Waited for, they held the start for its
    whole timeout and then failed it with no word of why (found by an audit); Kafka runs
    with offline partitions too."""
    admin = Admin(address, timeout_ms=5_000)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not stop.is_set():
        try:
            cluster = admin.describe_cluster()
            offline = set(cluster.offline_partitions)
            stranded = {
                (t.name, p.partition): p.isr
                for t in cluster.topics
                for p in t.partitions
                if (t.name, p.partition) in offline and not any(0 <= r < brokers for r in p.isr)
            }
            if (
                len(cluster.brokers) == brokers
                and _controller_sees(cluster.controller_address) == brokers
                and cluster.controller_id >= 0
                and not offline - set(stranded)
                and all(
                    p.high_watermark >= 0
                    for t in cluster.topics
                    for p in t.partitions
                    if (t.name, p.partition) not in stranded
                )
            ):
                if stranded:
                    _warn_stranded(stranded, brokers)
                return True
        except TidelogError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the cluster did not become usable; see the logs directory")
        time.sleep(0.2)
    return False


def _warn_stranded(stranded: dict[tuple[str, int], tuple[int, ...]], brokers: int) -> None:
    needed = sorted({r for replicas in stranded.values() for r in replicas})
    names = [f"{topic}-{partition}" for topic, partition in sorted(stranded)]
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    print(
        f"tidelog dev: warning: {len(names)} partition(s) have no in-sync replica among "
        f"the {brokers} broker(s) started and stay offline: {shown} (their data needs "
        f"brokers {', '.join(map(str, needed))}; start with --brokers {max(needed) + 1})",
        flush=True,
    )


def _controller_sees(address: str) -> int:
    """How many live brokers the active controller counts (it places replicas on those;
    its view follows etcd a moment after the gateway's)."""
    if not address:
        return -1
    with grpc.insecure_channel(address) as channel:
        try:
            response = controller_pb2_grpc.ControllerStub(channel).DescribeCluster(
                controller_pb2.DescribeClusterRequest(), timeout=5
            )
        except grpc.RpcError:
            return -1
    return len(response.brokers)


def _stop_all(children: list[_Child], etcd: EtcdProcess | None) -> None:
    """Gateway first (no new requests), then brokers together (each hands its leaderships
    to the controller's care), then the controller, then etcd."""
    gateways = [c for c in children if c.name == "gateway"]
    brokers = [c for c in children if c.name.startswith("broker-")]
    controllers = [c for c in children if c.name == "controller"]
    for group in (gateways, brokers, controllers):
        for child in group:
            child.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in group:
            child.wait(max(0.1, deadline - time.monotonic()))
    if etcd is not None:
        etcd.stop()


_READY_LINE: Final = re.compile(r"tidelog dev ready: gateway (?P<gateway>\S+) ")
"""The line ``run`` prints once the cluster is usable (``DevProcess`` reads it)."""


class DevProcess:
    """``tidelog dev`` as a child process, for programs and tests that need a cluster:
    starts it, waits for the ``ready`` line and reads the gateway address from it.

    ``on_line`` sees every line the cluster prints (default: kept in ``lines`` only).
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        gateway_port: int = 0,
        timeout_s: float = 180.0,
        env: dict[str, str] | None = None,
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        _python_path_env()
        self.data_dir = data_dir
        self.lines: list[str] = []
        self.gateway = ""
        self._on_line = on_line
        self._ready = threading.Event()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tidelog",
                "dev",
                "--data-dir",
                str(data_dir),
                "--gateway-port",
                str(gateway_port),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
        )
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout_s) or not self.gateway:
            self.proc.kill()
            raise RuntimeError("tidelog dev did not get ready:\n" + "".join(self.lines[-30:]))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if self._on_line is not None:
                self._on_line(line.rstrip("\n"))
            # Only dev's own ready line: an error line naming a data directory with
            # "ready" in its path was taken for it (the gateway "did", or the reader died
            # on an IndexError and the constructor waited its whole timeout; found by an
            # audit).
            match = _READY_LINE.match(line)
            if match and not self.gateway:
                self.gateway = match["gateway"]
                self._ready.set()
        self._ready.set()

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
