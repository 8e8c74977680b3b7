"""A storage node whose disk fails halts instead of answering, and loses nothing it
acknowledged: the failure is real (strace injects EIO into the process's own writes -
pwrite64, pwritev, pwritev2 - or fsyncs), and the node's files are read back by a restart
without strace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

import grpc
import pytest

from services.storage.node import EXIT_DISK_FAILURE
from tests.chaos.cluster import descendants
from tests.support.process import TidelogProcess, wait_healthy
from tests.test_storage_node import append, code, leader_and_isr, make_leader, read_all
from tidelog.errors import ErrorCode
from tidelog.records import encode_batch
from tidelog.v1 import storage_pb2_grpc

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")

WRITES = "pwrite64,pwritev,pwritev2"
"""The system calls a storage node writes its files with (``os.pwrite``, ``os.pwritev``)."""


def _storage(data_dir: Path, log_path: Path, prefix: list[str]) -> TidelogProcess:
    process = TidelogProcess(
        ["storage", "--broker-id", "1", "--data-dir", str(data_dir), "--listen", "127.0.0.1:0"],
        log_path=log_path,
        command_prefix=prefix,
    )
    wait_healthy(process.wait_listening(), "tidelog.v1.Storage", 30)
    return process


@pytest.mark.parametrize(
    "inject",
    [
        # Writes fail from the 3rd on (the first ones are start-up's checkpoints): segments
        # are written with pwritev (glibc's pwritev2), indexes and checkpoints with pwrite.
        ["-e", f"trace={WRITES}", "-e", f"inject={WRITES}:error=EIO:when=3+"],
        # Writes go through, but flushing them fails (flush.messages=1 fsyncs every append).
        # (start-up makes two fsyncs; the first append's fails).
        ["-e", "trace=fsync", "-e", "inject=fsync:error=EIO:when=3+"],
        # What ext4 and xfs answer on detected corruption: not on a short list of "disk"
        # errnos, it used to fail the one request, the next fsync "succeeding" over
        # pages the failed one may have dropped (found by an audit).
        ["-e", "trace=fsync", "-e", "inject=fsync:error=EUCLEAN:when=3+"],
    ],
    ids=["write-eio", "fsync-eio", "fsync-euclean"],
)
def test_disk_failure_halts_the_node_and_acknowledged_records_survive(
    tmp_path: Path, inject: list[str]
) -> None:
    data_dir = tmp_path / "data"
    # Acknowledged before the failure, without strace.
    with _storage(data_dir, tmp_path / "first.log", []) as node:
        assert node.address
        stub = storage_pb2_grpc.StorageStub(grpc.insecure_channel(node.address))
        make_leader(stub, "t", configs={"flush.messages": "1"})
        acked = [f"before-{i}".encode() for i in range(5)]
        for value in acked:
            assert code(append(stub, "t", encode_batch([value])).error) == ErrorCode.NONE
        node.terminate()

    strace = ["strace", "-f", "-qq", "--seccomp-bpf", "-o", "/dev/null", *inject]
    failing = _storage(data_dir, tmp_path / "failing.log", strace)
    try:
        stub = storage_pb2_grpc.StorageStub(grpc.insecure_channel(failing.address))
        make_leader(stub, "t", configs={"flush.messages": "1"})
        answered = []
        for i in range(20):
            try:
                response = append(stub, "t", encode_batch([f"during-{i}".encode()]))
            except grpc.RpcError:
                break  # the node halted mid-call: no answer, so nothing was acknowledged
            if code(response.error) == ErrorCode.NONE:
                answered.append(f"during-{i}".encode())
        status = failing.wait(30)
    finally:
        # strace does not pass signals on: kill the traced node itself if it still runs.
        for pid in descendants(failing.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        failing.kill()
    assert status == EXIT_DISK_FAILURE, failing.log_tail()
    assert "log_dir_failed" in failing.log_path.read_text()

    with _storage(data_dir, tmp_path / "after.log", []) as node:
        stub = storage_pb2_grpc.StorageStub(grpc.insecure_channel(node.address))
        make_leader(stub, "t", epoch=1)
        values = [r.value for r in read_all(stub, "t")]
        # Everything acknowledged, in order, before anything written after it.
        assert values[: len(acked)] == acked
        assert set(answered) <= set(values)
        node.terminate()


def _halts(failing: TidelogProcess) -> int:
    """The traced node's exit status (30 s at most), every process of it killed after."""
    try:
        return failing.wait(30)
    finally:
        # strace does not pass signals on: kill the traced node itself if it still runs.
        for pid in descendants(failing.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        failing.kill()


def test_a_failed_checkpoint_write_halts_the_node_and_loses_nothing(tmp_path: Path) -> None:
    """The data directory's own files fail like a log's: EIO from the recovery-point
    checkpoint's fsync (start-up's passes; the next periodic one fails) halts the node.
    It used to be logged and retried every pass, a stale recovery point staying on disk
    and the HW checkpoint, written after it, never again (found by an audit)."""
    data_dir = tmp_path / "data"
    checkpoint = data_dir / "recovery-point-offset-checkpoint.tmp"
    strace = ["strace", "-f", "-qq", "-o", "/dev/null", "-P", str(checkpoint)]
    strace += ["-e", "trace=fsync", "-e", "inject=fsync:error=EIO:when=2+"]
    failing = _storage(data_dir, tmp_path / "failing.log", strace)
    acked = [f"acked-{i}".encode() for i in range(5)]
    try:
        stub = storage_pb2_grpc.StorageStub(grpc.insecure_channel(failing.address))
        make_leader(stub, "t", configs={"flush.messages": "1"})
        for value in acked:
            assert code(append(stub, "t", encode_batch([value])).error) == ErrorCode.NONE
    finally:
        status = _halts(failing)
    assert status == EXIT_DISK_FAILURE, failing.log_tail()
    assert "log_dir_failed" in failing.log_path.read_text()
    with _storage(data_dir, tmp_path / "after.log", []) as node:
        stub = storage_pb2_grpc.StorageStub(grpc.insecure_channel(node.address))
        make_leader(stub, "t", epoch=1)
        assert [r.value for r in read_all(stub, "t")] == acked
        node.terminate()


def test_a_partition_that_cannot_be_created_on_a_full_disk_halts_the_node(
    tmp_path: Path,
) -> None:
    """ENOSPC making a new partition's directory: the node halts, so the controller moves
    the partition's leadership to a replica that can serve it. The error used to be the
    LeaderAndIsr item's only; the controller resent it for ever and the partition had no
    working leader while the broker stayed up (found by an audit)."""
    data_dir = tmp_path / "data"
    strace = ["strace", "-f", "-qq", "-o", "/dev/null", "-P", str(data_dir / "t-0")]
    strace += ["-e", "trace=mkdir,mkdirat", "-e", "inject=mkdir,mkdirat:error=ENOSPC"]
    failing = _storage(data_dir, tmp_path / "failing.log", strace)
    try:
        stub = storage_pb2_grpc.StorageStub(grpc.insecure_channel(failing.address))
        with contextlib.suppress(grpc.RpcError):  # the node halts before it answers
            leader_and_isr(stub, "t")
    finally:
        status = _halts(failing)
    assert status == EXIT_DISK_FAILURE, failing.log_tail()
    assert "log_dir_failed" in failing.log_path.read_text()
