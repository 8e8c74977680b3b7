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
    ARENAS_UNDER_LIMIT,
    MMAP_THRESHOLD_BYTES,
    TRIM_THRESHOLD_BYTES,
    arena_max_for,
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


# Under a memory limit read from the file argv[1] names (none: "-"), THREADS live threads
# in turn fill and free a BUFFER_MIB - 20 buffer (below the limit's mmap threshold, so from
# an arena) and stay alive, as a server's threads do; prints the MiB still resident after.
THREADS = 16
_ARENA_PROBE = f"""
import sys, threading
from pathlib import Path
from services.allocator import retain_freed_memory
retain_freed_memory([Path(sys.argv[1])] if sys.argv[1] != "-" else [])
def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
turns = [threading.Event() for _ in range({THREADS} + 1)]
done = threading.Barrier({THREADS} + 1)
def work(i):
    turns[i].wait()
    buffer = bytearray(({BUFFER_MIB} - 20) * 1024 * 1024)
    del buffer
    turns[i + 1].set()
    done.wait()  # alive: a live thread keeps its arena
threads = [threading.Thread(target=work, args=(i,)) for i in range({THREADS})]
for thread in threads:
    thread.start()
before = rss_mib()
turns[0].set()
turns[-1].wait()
print(rss_mib() - before)
done.wait()
"""


def _last_line(probe: str, argument: str, **env: str) -> str:
    """Run ``probe`` in a fresh interpreter with glibc's malloc variables cleared (plus
    ``env``); its last line of output (the lines before are the module's log events)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environment.pop("GLIBC_TUNABLES", None)
    environment.update(env, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", probe, argument],
        capture_output=True,
        text=True,
        check=True,
        env=environment,
        timeout=60,
    ).stdout.splitlines()[-1]


def _run(mode: str, **env: str) -> tuple[str, float]:
    applied, faults = _last_line(_PROBE, mode, **env).split()
    return applied, float(faults)


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
    assert arena_max_for(None) is None
    mib = 1024 * 1024
    # The dev overlay's gateway: 512 MiB, so at most 64 MiB stays free at the heaps' tops,
    # 32 MiB in each of its two arenas.
    assert thresholds_for(512 * mib) == (32 * mib, 32 * mib)
    assert arena_max_for(512 * mib) == ARENAS_UNDER_LIMIT == 2
    # A large limit leaves the uncapped values.
    assert thresholds_for(64 * 1024 * mib) == (MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_threads_share_two_arenas_under_a_memory_limit(tmp_path: Path) -> None:
    """A gateway in a 512 MiB cgroup was OOM-killed by the benchmark suite while each of its
    threads kept its own arena's freed buffers (BENCHMARKS.md, eighth pass)."""
    limit = tmp_path / "memory.max"
    limit.write_text(str(512 * 1024 * 1024))

    def retained_mib(limit_file: str) -> float:
        return float(_last_line(_ARENA_PROBE, limit_file))

    buffer_mib = BUFFER_MIB - 20
    # Each thread after the first reuses a buffer freed in one of the two arenas.
    assert retained_mib(str(limit)) < 3 * buffer_mib
    # The control, without a limit: every thread keeps its freed buffer in its own arena.
    assert retained_mib("-") > THREADS / 2 * buffer_mib


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
