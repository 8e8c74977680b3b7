"""Start a private, single-member etcd server for tests and ``tidelog dev``.

``EtcdProcess(data_dir)`` runs the etcd binary on free loopback ports with its own data
directory and waits until it answers ``GET /health``::

    with EtcdProcess(tmp_path / "etcd") as etcd:
        store = MetaStore(etcd.endpoint, cluster="test")
        ...
        etcd.kill()       # fault test: SIGKILL, as a crash would
        etcd.restart()    # same data dir, same ports: clients reconnect on their own

Layout of ``data_dir`` (owned by the process object)::

    data_dir/
      data/       etcd's own --data-dir (member/wal, member/snap); survives restart()
      etcd.log    etcd's stdout and stderr (zap JSON lines), appended across restarts

etcd's data lives one level down because etcd warns about every unknown entry in its data
directory, and the log file would be one.

The binary is ``$TIDELOG_ETCD_BIN`` when set (and nothing else then, so a typo fails loudly
instead of silently running another etcd), else ``/usr/bin/etcd`` (Debian's
``etcd-server``), else ``etcd`` on ``PATH``.

This module deliberately does not import the etcd client: readiness is checked over plain
HTTP, so the client library stays behind ``services.metastore`` alone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from tidelog import child_process

ETCD_BIN_ENV = "TIDELOG_ETCD_BIN"
DEFAULT_ETCD_PATH = "/usr/bin/etcd"
NOT_FOUND_MESSAGE = (
    "etcd not found: install it with `apt-get install -y etcd-server` (or set TIDELOG_ETCD_BIN)"
)
# Substring etcd prints (inside a Go net error) when a listener cannot bind its port.
_ADDRESS_IN_USE = "address already in use"
_LOOPBACK = "127.0.0.1"


class EtcdLaunchError(RuntimeError):
    """etcd could not be started, did not become healthy, or could not be stopped."""


class EtcdNotFoundError(EtcdLaunchError):
    """No etcd binary: neither ``$TIDELOG_ETCD_BIN``, ``/usr/bin/etcd`` nor PATH has one."""


@dataclass(frozen=True)
class EtcdTuning:
    """Raft timing and start-up limits for a private etcd.

    The defaults suit a single member on loopback: with a 10 ms heartbeat and a 100 ms
    election timeout the member elects itself in ~0.1 s. They are far too tight for a real
    multi-member cluster across machines (etcd's defaults there are 100 ms / 1000 ms).
    Note that etcd's minimum lease TTL is 1.5 election timeouts rounded up to whole
    seconds, so these settings also allow 1 s leases (etcd's defaults force at least 2 s).
    """

    # --heartbeat-interval: raft heartbeat period.
    heartbeat_interval_ms: int = 10
    # --election-timeout: a follower starts an election after this long without a leader.
    election_timeout_ms: int = 100
    # --max-txn-ops: the controller keeps its transactions within etcd's default (128;
    # TXN_CHUNK_OPS = 100 partition states each, services/controller/controller.py); the
    # headroom is for the gateway's group writes and for operators' own tools.
    max_txn_ops: int = 4096
    # --auto-compaction-retention (periodic mode): history kept for watches to resume
    # from. Without compaction a long-running dev cluster's history grows until etcd's
    # space quota raises the NOSPACE alarm and etcd refuses writes. None disables it.
    auto_compaction_retention: str | None = "1h"
    # Deadline for the process to answer GET /health after being started.
    start_timeout_s: float = 15.0
    # SIGTERM grace period in stop() before SIGKILL.
    stop_timeout_s: float = 10.0
    # Fresh port pairs to try when another process grabs a port between probe and bind.
    max_start_attempts: int = 5


def find_etcd_binary() -> str:
    """The etcd executable to run; raises EtcdNotFoundError if there is none."""
    configured = os.environ.get(ETCD_BIN_ENV)
    if configured:
        if os.path.isfile(configured) and os.access(configured, os.X_OK):
            return configured
        raise EtcdNotFoundError(
            f"{NOT_FOUND_MESSAGE}; {ETCD_BIN_ENV}={configured!r} is not an executable file"
        )
    if os.access(DEFAULT_ETCD_PATH, os.X_OK):
        return DEFAULT_ETCD_PATH
    found = shutil.which("etcd")
    if found:
        return found
    raise EtcdNotFoundError(NOT_FOUND_MESSAGE)


def free_port(host: str = _LOOPBACK) -> int:
    """A TCP port on ``host`` that was free a moment ago (bind to 0, read it, close).

    Another process may take it before etcd binds; EtcdProcess.start() detects that from
    etcd's exit and retries with new ports, which is why no reservation trick is needed.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # an IPv6 literal
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class EtcdProcess:
    """One single-member etcd server process on loopback, owned by this object.

    Invariants:
      * ``endpoint`` and the peer port are fixed by the first successful ``start()`` and
        reused by ``restart()``, so clients keep one endpoint across restarts and etcd's
        stored member URL keeps matching (a member's peer URL lives in its data dir).
      * While ``is_running()`` is true after ``start()`` returned, etcd has answered
        ``GET /health`` with ``{"health":"true"}`` at least once (it has a leader).
      * Signals go to the PID of the child this object spawned (``Popen`` keeps it), never
        to a process found by name.

    Thread-safety: none. One thread (a test, the ``tidelog dev`` supervisor) drives the
    lifecycle; ``endpoint``, ``pid`` and ``log_tail()`` may be read from anywhere.
    """

    def __init__(
        self,
        data_dir: Path | str,
        *,
        name: str = "tidelog-etcd",
        tuning: EtcdTuning | None = None,
        binary: str | None = None,
        extra_args: Sequence[str] = (),
        host: str = _LOOPBACK,
        end_with_parent: bool = False,
    ) -> None:
        self.data_dir = Path(data_dir)
        # SIGTERM to etcd when the thread that starts it ends (tidelog.child_process):
        # for a supervisor whose SIGKILL must not leave etcd running.
        self.end_with_parent = end_with_parent
        # The address etcd listens on; another than loopback lets processes in other
        # network namespaces reach it (tests/chaos puts storage nodes in their own).
        self.host = host
        self._netloc_host = f"[{host}]" if ":" in host else host  # in URLs: IPv6 bracketed
        self.name = name
        self.tuning = tuning or EtcdTuning()
        # Resolve eagerly: a missing binary is a set-up error worth reporting before anything
        # else happens (and before a test builds fixtures around it).
        self.binary = binary or find_etcd_binary()
        self.extra_args = list(extra_args)
        self.log_path = self.data_dir / "etcd.log"
        self._client_port: int | None = None
        self._peer_port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    # ----------------------------------------------------------------- properties

    @property
    def endpoint(self) -> str:
        """The client URL, ``http://HOST:PORT``; known once start() has succeeded."""
        if self._client_port is None:
            raise EtcdLaunchError("etcd has not been started")
        return f"http://{self._netloc_host}:{self._client_port}"

    @property
    def client_port(self) -> int:
        if self._client_port is None:
            raise EtcdLaunchError("etcd has not been started")
        return self._client_port

    @property
    def pid(self) -> int:
        """PID of the current etcd process (the last one started, even if it has died)."""
        if self._proc is None:
            raise EtcdLaunchError("etcd has not been started")
        return self._proc.pid

    @property
    def etcd_data_dir(self) -> Path:
        """etcd's own ``--data-dir``, inside ``data_dir``."""
        return self.data_dir / "data"

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> EtcdProcess:
        """Start etcd and wait until it is healthy; returns self.

        On the first start, ports are chosen fresh and re-chosen (up to
        ``tuning.max_start_attempts`` times) if etcd exits because one was taken in the
        meantime. A restart keeps its ports and fails rather than move them. Raises
        EtcdLaunchError, with the tail of etcd's log, if etcd exits or is not healthy by
        ``tuning.start_timeout_s``.
        """
        if self.is_running():
            raise EtcdLaunchError(f"etcd is already running (pid {self.pid})")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        keep_ports = self._client_port is not None
        attempts = 1 if keep_ports else max(1, self.tuning.max_start_attempts)
        last_error: EtcdLaunchError | None = None
        for _ in range(attempts):
            if not keep_ports:
                self._client_port = free_port(self.host)
                self._peer_port = free_port(self.host)
                while self._peer_port == self._client_port:
                    self._peer_port = free_port(self.host)
            log_offset = self._spawn()
            try:
                self._wait_healthy(log_offset)
                return self
            except EtcdLaunchError as exc:
                last_error = exc
                self._kill_and_reap()
                self._close_log()
                if _ADDRESS_IN_USE not in self._read_log(log_offset):
                    break
        if not keep_ports:
            # Never started: the next start() is a first start again, with fresh ports.
            self._client_port = self._peer_port = None
        assert last_error is not None
        raise last_error

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM, wait up to ``timeout_s`` (default ``tuning.stop_timeout_s``), then SIGKILL.

        Returns the exit status, or None if etcd was never started. Idempotent.
        """
        if self._proc is None:
            return None
        grace_s = self.tuning.stop_timeout_s if timeout_s is None else timeout_s
        if self._proc.poll() is None:
            self._signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
            self._signal(signal.SIGTERM)
            try:
                self._proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._kill_and_reap()
        self._close_log()
        return self._proc.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash would (fault tests); waits until the process is gone."""
        self._kill_and_reap()
        self._close_log()

    def restart(self) -> EtcdProcess:
        """Stop (gracefully) if running, then start again on the same data dir and ports."""
        self.stop()
        return self.start()

    def pause(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP: etcd keeps its sockets but answers nothing (a hung server). Returns
        once the kernel shows it stopped: a signal is delivered asynchronously, and a
        request sent at once could still be answered (seen on a loaded 2-core machine)."""
        self._signal(signal.SIGSTOP)
        if self._proc is None:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _process_state(self._proc.pid) not in ("T", "t", ""):
            time.sleep(0.005)

    def resume(self) -> None:
        """SIGCONT after pause()."""
        self._signal(signal.SIGCONT)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of etcd's log, for error messages."""
        return self._tail(self._read_log(0), lines)

    def __enter__(self) -> EtcdProcess:
        if not self.is_running():
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self._proc.pid}" if self.is_running() and self._proc else "stopped"
        port = self._client_port or "-"
        return f"EtcdProcess({str(self.data_dir)!r}, port={port}, {state})"

    # ----------------------------------------------------------------- internals

    def command(self) -> list[str]:
        """The full etcd command line for the current ports."""
        client_url = f"http://{self._netloc_host}:{self._client_port}"
        peer_url = f"http://{self._netloc_host}:{self._peer_port}"
        return [
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self.etcd_data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={self.name}={peer_url}",
            "--initial-cluster-state=new",
            f"--heartbeat-interval={self.tuning.heartbeat_interval_ms}",
            f"--election-timeout={self.tuning.election_timeout_ms}",
            f"--max-txn-ops={self.tuning.max_txn_ops}",
            *(
                [
                    "--auto-compaction-mode=periodic",
                    f"--auto-compaction-retention={self.tuning.auto_compaction_retention}",
                ]
                if self.tuning.auto_compaction_retention
                else []
            ),
            # zap writes one JSON object per line; 3.4's default capnslog logger also prints
            # a deprecation warning on every start.
            "--logger=zap",
            *self.extra_args,
        ]

    def _spawn(self) -> int:
        """Start the process with output appended to the log; returns the log offset."""
        self._close_log()
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()/kill()
        offset = self._log_file.tell()
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            # Own session: a Ctrl-C aimed at `tidelog dev` reaches only the supervisor,
            # which then stops etcd last, after the services that depend on it.
            start_new_session=True,
            # Only a prctl runs between fork and exec (see child_process).
            preexec_fn=child_process.end_with_parent() if self.end_with_parent else None,  # noqa: PLW1509
        )
        return offset

    def _wait_healthy(self, log_offset: int) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.tuning.start_timeout_s
        url = f"{self.endpoint}/health"
        while True:
            if self._proc.poll() is not None:
                raise EtcdLaunchError(
                    f"etcd exited with status {self._proc.returncode} while starting "
                    f"({' '.join(self.command())}); log {self.log_path}:\n"
                    f"{self._tail(self._read_log(log_offset))}"
                )
            if _healthy(url):
                return
            if time.monotonic() > deadline:
                raise EtcdLaunchError(
                    f"etcd (pid {self._proc.pid}) not healthy at {url} after "
                    f"{self.tuning.start_timeout_s} s; log {self.log_path}:\n"
                    f"{self._tail(self._read_log(log_offset))}"
                )
            time.sleep(0.02)

    def _signal(self, signum: signal.Signals) -> None:
        if self._proc is not None and self._proc.poll() is None:
            # The process may exit between poll() and the signal; that race is harmless.
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signum)

    def _kill_and_reap(self) -> None:
        if self._proc is None:
            return
        self._signal(signal.SIGKILL)
        try:
            self._proc.wait(self.tuning.stop_timeout_s)
        except subprocess.TimeoutExpired as exc:  # pragma: no cover - uninterruptible sleep
            raise EtcdLaunchError(f"etcd pid {self._proc.pid} survived SIGKILL") from exc

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _read_log(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                return log.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    @staticmethod
    def _tail(text: str, lines: int = 40) -> str:
        return "\n".join(text.splitlines()[-lines:])


def _healthy(url: str) -> bool:
    """True if etcd's ``GET /health`` says it has a leader and serves a quorum read."""
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            body: bytes = response.read()
    except (urllib.error.URLError, OSError):
        # Not listening yet (connection refused) or no leader yet (HTTP 503).
        return False
    return b'"health":"true"' in body


def _process_state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` ("T" once stopped), "" if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            # The name (2nd field) may hold spaces and parentheses: the state follows
            # the last ")".
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
