"""Real tidelog processes for tests: start, wait until healthy, stop, kill.

Everything runs as ``python -m tidelog ...`` from this checkout (``PYTHONPATH`` points at
the repository root), bound to 127.0.0.1 port 0; the chosen port is read from the
``listening on HOST:PORT`` line the process prints on stdout. stderr (JSON log lines) goes
to a file next to the data directory so a failing test can show it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tidelog.v1 import storage_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
_LISTENING = re.compile(r"listening on (?P<address>\S+)")
# Generous: a cold interpreter importing grpc on a busy 2-core machine.
DEFAULT_START_TIMEOUT_S = 30.0


def tidelog_env() -> dict[str, str]:
    """The environment a child ``python -m tidelog`` needs to import this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def wait_healthy(address: str, service: str = "", timeout_s: float = 10.0) -> None:
    """Poll the gRPC health service at ``address`` until it reports SERVING."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} did not become healthy in {timeout_s} s")
            time.sleep(0.02)


class TidelogProcess:
    """One ``python -m tidelog <args>`` child process that prints a listening line."""

    def __init__(
        self, args: Sequence[str], *, log_path: Path, command_prefix: Sequence[str] = ()
    ) -> None:
        """``command_prefix`` runs the interpreter through another program that execs it
        (``ip netns exec NS``, or ``MemoryCgroup.command_prefix``'s shell: each keeps the
        PID, so signals still reach tidelog itself)."""
        self.args = list(args)
        self.log_path = log_path
        self._log_file = open(log_path, "ab")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            [*command_prefix, sys.executable, "-m", "tidelog", *self.args],
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            stdin=subprocess.DEVNULL,
            cwd=REPO_ROOT,
            env=tidelog_env(),
            text=True,
        )
        self.stdout_lines: list[str] = []
        self._address: str | None = None
        self._listening = threading.Event()
        # Drain stdout for the life of the process, so it can never block on a full pipe.
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> str:
        if self._address is None:
            raise RuntimeError("the process has not reported its address")
        return self._address

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_lines.append(line.rstrip("\n"))
            match = _LISTENING.search(line)
            if match and self._address is None:
                self._address = match["address"]
                self._listening.set()
        self._listening.set()  # EOF: the process ended; wake wait_listening

    def wait_listening(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> str:
        """The address from the ``listening on`` line; raises if the process dies first."""
        if not self._listening.wait(timeout_s) or self._address is None:
            self.kill()
            raise RuntimeError(
                f"tidelog {' '.join(self.args)} did not report listening "
                f"(exit status {self.proc.poll()}):\n{self.log_tail()}"
            )
        return self._address

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def terminate(self, timeout_s: float = 20.0) -> int:
        """SIGTERM and wait; returns the exit status (kills it if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout_s)

    def kill(self) -> int:
        """SIGKILL (kill -9) and reap; returns the exit status (-9)."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.wait(10.0)

    def wait(self, timeout_s: float) -> int:
        try:
            status = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            status = self.proc.wait(10.0)
            raise RuntimeError(
                f"tidelog {' '.join(self.args)} did not exit within {timeout_s} s; killed:\n"
                f"{self.log_tail()}"
            ) from None
        finally:
            self._reader.join(5.0)
            self._log_file.close()
        return status

    def __enter__(self) -> TidelogProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc.poll() is None:
            self.kill()


class StorageProcess(TidelogProcess):
    """``tidelog storage`` on 127.0.0.1 port 0, with a channel and a Storage stub."""

    def __init__(
        self,
        data_dir: Path,
        *,
        broker_id: int = 1,
        log_path: Path | None = None,
        extra_args: Sequence[str] = (),
        command_prefix: Sequence[str] = (),
    ) -> None:
        """``command_prefix`` as ``TidelogProcess``'s (e.g. ``MemoryCgroup.command_prefix``)."""
        self.data_dir = data_dir
        self.broker_id = broker_id
        super().__init__(
            [
                "storage",
                "--broker-id",
                str(broker_id),
                "--data-dir",
                str(data_dir),
                "--listen",
                "127.0.0.1:0",
                # Retention within a maintenance pass (the default checks every 5 min, as
                # Kafka's): tests of retention wait seconds, not minutes.
                "--log-retention-check-interval-ms",
                "250",
                *extra_args,
            ],
            log_path=log_path or data_dir.with_name(data_dir.name + ".stderr.log"),
            command_prefix=command_prefix,
        )
        self._channel: grpc.Channel | None = None

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> StorageProcess:
        """Wait for the listening line and for health SERVING; returns self."""
        self.wait_listening(timeout_s)
        wait_healthy(self.address, "tidelog.v1.Storage", timeout_s)
        return self

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(
                self.address,
                options=[
                    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                    ("grpc.max_send_message_length", 64 * 1024 * 1024),
                ],
            )
        return self._channel

    @property
    def stub(self) -> storage_pb2_grpc.StorageStub:
        return storage_pb2_grpc.StorageStub(self.channel)

    def wait(self, timeout_s: float) -> int:
        try:
            return super().wait(timeout_s)
        finally:
            if self._channel is not None:
                self._channel.close()
                self._channel = None


def start_storage(
    data_dir: Path, *, broker_id: int = 1, extra_args: Sequence[str] = ()
) -> StorageProcess:
    """Start ``tidelog storage`` on ``data_dir`` and wait until it serves."""
    return StorageProcess(data_dir, broker_id=broker_id, extra_args=extra_args).start()


StartStorage = Callable[..., StorageProcess]
"""The ``start_storage`` fixture: ``(data_dir=None, *, broker_id=1, extra_args=())``."""
