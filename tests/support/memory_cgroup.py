"""A memory cgroup for one test process: the kernel's own limit and accounting, so an
out-of-memory kill in a test is the one a pod's limit would cause.

cgroup v2 where its memory controller is enabled at ``/sys/fs/cgroup``, else v1's memory
hierarchy at ``/sys/fs/cgroup/memory``; ``memory_cgroup`` returns None where neither is
writable (no root, a read-only cgroupfs), and the tests that need one skip.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

V2_ROOT = Path("/sys/fs/cgroup")
V1_ROOT = Path("/sys/fs/cgroup/memory")


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path
    version: int

    @property
    def command_prefix(self) -> list[str]:
        """Runs a command inside the cgroup: the shell joins it, then execs the command
        (same PID, so signals still reach the process itself)."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path)]

    def peak_bytes(self) -> int:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        return int((self.path / name).read_text())

    def reset_peak(self) -> None:
        """Start the peak over (v1; v2's ``memory.peak`` keeps the peak so far)."""
        if self.version == 1:
            (self.path / "memory.max_usage_in_bytes").write_text("0")

    def oom_kills(self) -> int:
        text = self.path / ("memory.events" if self.version == 2 else "memory.oom_control")
        fields = dict(line.split() for line in text.read_text().splitlines())
        return int(fields.get("oom_kill", 0))

    def stat(self) -> dict[str, int]:
        """``memory.stat``: bytes (and event counts) by name, v1's or v2's names."""
        lines = (self.path / "memory.stat").read_text().splitlines()
        return {name: int(value) for name, value in (line.split() for line in lines)}

    def anon_bytes(self) -> int:
        """Anonymous memory charged to the cgroup now (heaps, stacks: what the kernel can
        only take back by killing), as opposed to page cache, which it reclaims at the
        limit."""
        return self.stat()["rss" if self.version == 1 else "anon"]

    def pids(self) -> list[int]:
        """The processes in the cgroup now."""
        return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]

    def remove(self) -> None:
        """Once its processes have exited."""
        with contextlib.suppress(OSError):  # a leftover empty cgroup harms nothing
            self.path.rmdir()


def memory_cgroup(limit_bytes: int) -> MemoryCgroup | None:
    """A new cgroup limited to ``limit_bytes`` of memory, or None where none can be made."""
    name = f"tidelog-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        controllers = (V2_ROOT / "cgroup.subtree_control").read_text().split()
    except OSError:
        controllers = []
    candidates = [(V2_ROOT, 2, "memory.max")] if "memory" in controllers else []
    candidates.append((V1_ROOT, 1, "memory.limit_in_bytes"))
    for root, version, limit_file in candidates:
        path = root / name
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            (path / limit_file).write_text(str(limit_bytes))
        except OSError:
            path.rmdir()
            continue
        return MemoryCgroup(path, version)
    return None
