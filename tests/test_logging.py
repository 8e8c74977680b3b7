"""Service logs (``tidelog.logging``): a sink that fails drops lines, never requests;
error lines carry tracebacks without the frames' local variables."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.cluster import TestCluster
from tests.support.process import REPO_ROOT, tidelog_env
from tidelog import logging as tidelog_logging
from tidelog.v1 import gateway_pb2


def test_a_gateway_whose_stderr_broke_still_issues_producer_ids(
    cluster: TestCluster, tmp_path: Path
) -> None:
    """A log write raised into its caller: once stderr's reader went away (a log
    shipper or a ``| tee`` that died; a full log disk alike) every call that logged
    failed - InitProducerId logs producer_id_issued - while the health check answered
    SERVING, so no probe restarted the process. Python's logging and log4j drop the line
    (found by an audit)."""
    fifo = tmp_path / "stderr.fifo"
    os.mkfifo(fifo)
    # Opened for reading first (non-blocking), so the gateway's open for writing succeeds.
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    drained: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(reader, 65536)
            except BlockingIOError:
                return
            if not chunk:
                return
            drained.append(chunk)

    gateway = cluster.start_gateway(
        command_prefix=["bash", "-c", f'exec "$@" 2>"{fifo}"', "gateway-with-a-pipe"]
    )
    try:
        drain()
        assert b"listening" in b"".join(drained)
        # Healthy: an InitProducerId works (it logs producer_id_issued).
        first = gateway.stub.InitProducerId(
            gateway_pb2.InitProducerIdRequest(client_id="piped"), timeout=10
        )
        assert first.producer_id >= 0
        # The log reader goes away.
        drain()
        os.close(reader)
        reader = -1
        failure = None
        try:
            second = gateway.stub.InitProducerId(
                gateway_pb2.InitProducerIdRequest(client_id="piped"), timeout=10
            )
        except grpc.RpcError as exc:
            failure = f"{exc.code().name}: {exc.details()}"
        with grpc.insecure_channel(gateway.address) as channel:
            status = (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(service="tidelog.v1.Gateway"), timeout=5)
                .status
            )
        if failure is not None:
            pytest.fail(
                "InitProducerId failed once the gateway's stderr broke "
                f"({failure}) while its health check answers "
                f"{health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
            )
        assert second.producer_id > first.producer_id
    finally:
        if reader >= 0:
            os.close(reader)
        gateway.kill()


def test_an_error_line_has_the_traceback_without_local_variables() -> None:
    """structlog's default rendered every frame's locals with repr(): a request of
    100 MiB of records in a failing handler's frame cost seconds and as large a string
    for one line."""
    stream = io.StringIO()
    log = tidelog_logging.configure("test", stream=stream)
    payload = b"x" * 1_000_000
    try:
        raise ValueError(f"failed on {len(payload)} bytes")
    except ValueError:
        log.exception("handler_failed")
    (line,) = stream.getvalue().splitlines()
    event = json.loads(line)
    assert event["event"] == "handler_failed" and event["exception"][0]["exc_type"] == "ValueError"
    assert "xxxx" not in line and len(line) < 10_000


_CRASHING = """
import logging, threading
from tidelog import logging as tidelog_logging
tidelog_logging.configure("test")
tidelog_logging.capture_process_output()
def crash():
    raise RuntimeError("a thread's bug")
t = threading.Thread(target=crash, name="worker-1")
t.start()
t.join()
logging.getLogger("grpc._server").warning("a %s from the standard library", "warning")
logging.getLogger("quiet").info("below the level")
"""


def test_a_service_logs_thread_crashes_and_library_warnings_as_json_lines() -> None:
    """Uncaught thread exceptions and the standard library's logging (gRPC's Python
    side) were plain multi-line text among a service's JSON lines (found by an audit)."""
    ran = subprocess.run(
        [sys.executable, "-c", _CRASHING], capture_output=True, text=True, timeout=60,
        cwd=REPO_ROOT, env=tidelog_env(), check=True,
    )  # fmt: skip
    events = [json.loads(line) for line in ran.stderr.splitlines()]  # every line is JSON
    crashed, warned = events
    assert crashed["event"] == "thread_crashed" and crashed["thread"] == "worker-1"
    assert crashed["exception"][0]["exc_value"] == "a thread's bug"
    assert warned["event"] == "a warning from the standard library"
    assert (warned["logger"], warned["level"]) == ("grpc._server", "warning")
