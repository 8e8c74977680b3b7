"""services.allocator: a service keeps freed message buffers instead of faulting them in again.

Each case runs in a fresh interpreter, so the allocator settings of this test process
(and of every other test) stay glibc's defaults.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.allocator import (
    MMAP_THRESHOLD_BYTES,
    TRIM_THRESHOLD_BYTES,
    cgroup_limit_files,
    memory_limit_bytes,
    thresholds_for,
)

ROOT = Path(__file__).resolve().parent.parent
BUFFER_MIB = 40  # above glibc's largest dynamic mmap threshold (32 MiB): mmap'd by default
ROUNDS = 20

# Allocates, fills and frees the same large buffer ROUNDS times, in a thread as a server
# does, and prints whether the settings were applied and how many minor page faults each
# buffer's worth of pages cost on average.
_PROBE = f"""
import resource, sys, threading
from services.allocator import retain_freed_memory
applied = retain_freed_memory() if sys.argv[1] == "retain" else None
pages = {BUFFER_MIB} * 1024 * 1024 // resource.getpagesize()
result = []
def churn():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range({ROUNDS}):
        buffer = bytearray({BUFFER_MIB} * 1024 * 1024)  # zero-filled: every page touched
        del buffer
    result.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / pages)
thread = threading.Thread(target=churn)
thread.start()
thread.join()
print(applied, result[0])
"""


def _run(mode: str, **env: str) -> tuple[str, float]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environment.pop("GLIBC_TUNABLES", None)
    environment.update(env, PYTHONPATH=str(ROOT))
    out = (
        subprocess.run(
            [sys.executable, "-c", _PROBE, mode],
            capture_output=True,
            text=True,
            check=True,
            env=environment,
            timeout=60,
        )
        .stdout.splitlines()[-1]
        .split()
    )  # the lines before are the module's log events
    return out[0], float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_buffers_are_reused_without_faulting_their_pages_in_again() -> None:
    applied, faults_per_buffer = _run("retain")
    assert applied == "True"
    # The first buffer faults its pages in once; the other rounds reuse them.
    assert faults_per_buffer < 3, faults_per_buffer
    # The control: glibc's default mmaps and unmaps a buffer this size every round.
    _, default_faults = _run("default")
    assert default_faults > ROUNDS / 2, default_faults


def test_the_operators_malloc_settings_win() -> None:
    applied, faults_per_buffer = _run("retain", MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    assert applied == "False"
    assert faults_per_buffer > ROUNDS / 2, faults_per_buffer


def test_thresholds_shrink_under_a_memory_limit() -> None:
    assert thresholds_for(None) == (MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES)
    mib = 1024 * 1024
    # The dev overlay's gateway: 512 MiB, so at most 64 MiB stays free at a heap's top.
    assert thresholds_for(512 * mib) == (32 * mib, 64 * mib)
    # A large limit leaves the uncapped values.
    assert thresholds_for(64 * 1024 * mib) == (MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES)


def test_memory_limit_is_the_smallest_set_one(tmp_path: Path) -> None:
    v2, v1, unlimited, garbage = (tmp_path / n for n in ("v2", "v1", "unlimited", "garbage"))
    v2.write_text("max\n")  # cgroup v2: no limit
    unlimited.write_text("9223372036854771712\n")  # cgroup v1's "no limit"
    garbage.write_text("12 MiB\n")
    assert memory_limit_bytes([v2, unlimited, garbage, tmp_path / "missing"]) is None
    v1.write_text("536870912\n")
    v2.write_text("1073741824\n")
    assert memory_limit_bytes([v2, v1, unlimited]) == 536870912


def test_limit_files_follow_the_process_cgroup(tmp_path: Path) -> None:
    proc_cgroup = tmp_path / "cgroup"
    proc_cgroup.write_text("4:memory:/pod/abc\n3:cpu:/pod/abc\n0::/kubepods/pod1/c1\n")
    files = {str(f) for f in cgroup_limit_files(proc_cgroup)}
    assert files == {
        "/sys/fs/cgroup/memory.max",  # what a container sees through its cgroup namespace
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/kubepods/pod1/c1/memory.max",
        "/sys/fs/cgroup/memory/pod/abc/memory.limit_in_bytes",
    }
    assert {str(f) for f in cgroup_limit_files(tmp_path / "missing")} == {
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    }
