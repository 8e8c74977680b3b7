"""A gateway's memory under a real memory limit: ``python -m bench.memory``.

The gateway starts inside a new memory cgroup (``tests.support.memory_cgroup``: v2 or v1,
needs root) limited to ``--limit-mib``, on the ``tests/support`` cluster (etcd, controller,
3 brokers), and the suite's cases run through it one after another: produce RF=1, RF=3
acks=1, RF=3 acks=all (``--records`` 100-byte records each, 6 partitions), a consume of
the acks=all topic, and the OMB case (100 partitions, RF=3, 300,000 1 KiB records). After
each case: the cgroup's peak memory since the previous one, and whether the kernel
OOM-killed the gateway (then the run stops). Figures: docs/BENCHMARKS.md, eighth pass.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench import workloads
from tests.support.cluster import running_cluster
from tests.support.memory_cgroup import memory_cgroup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-mib", type=int, default=512, help="the gateway's limit")
    parser.add_argument("--records", type=int, default=3_000_000, help="per produce case")
    args = parser.parse_args(argv)
    cgroup = memory_cgroup(args.limit_mib * 1024 * 1024)
    if cgroup is None:
        print("no writable memory cgroup here (needs root and cgroupfs)", file=sys.stderr)
        return 2
    n = args.records
    try:
        with (
            tempfile.TemporaryDirectory(prefix="tidelog-memory-") as tmp,
            running_cluster(Path(tmp)) as cluster,
        ):
            gateway = cluster.start_gateway(command_prefix=cgroup.command_prefix)
            gw = gateway.address
            cases: list[tuple[str, str, int, int, Callable[[str], object]]] = [
                (
                    "produce RF=1",
                    "m-rf1",
                    6,
                    1,
                    lambda t: workloads.produce(gw, t, records=n, size=100, acks="1"),
                ),
                (
                    "produce RF=3 acks=1",
                    "m-acks1",
                    6,
                    3,
                    lambda t: workloads.produce(gw, t, records=n, size=100, acks="1"),
                ),
                (
                    "produce RF=3 acks=all",
                    "m-all",
                    6,
                    3,
                    lambda t: workloads.produce(gw, t, records=n, size=100, acks="all"),
                ),
                (
                    "consume (Arrow)",
                    "m-all",
                    0,
                    0,
                    lambda t: workloads.consume(gw, t, records=n, size=100, arrow=True),
                ),
                (
                    "OMB: 100 partitions, 1 KiB, acks=all",
                    "m-omb",
                    100,
                    3,
                    lambda t: workloads.produce(
                        gw, t, records=300_000, size=1024, acks="all", chunk=5_000
                    ),
                ),
            ]
            since = "since the previous case" if cgroup.version == 1 else "so far"
            print(f"gateway in {cgroup.path}, limit {args.limit_mib} MiB")
            print(f"| case | cgroup peak MiB ({since}) | gateway |")
            print("|---|---:|---|")
            for name, topic, partitions, rf, run in cases:
                if partitions:
                    workloads.create_topic(gw, topic, partitions, rf)
                try:
                    run(topic)
                    outcome = "alive"
                except Exception as exc:  # the gateway died under it, most likely
                    outcome = f"failed: {type(exc).__name__}"
                if cgroup.oom_kills():
                    outcome = "OOM-killed"
                print(f"| {name} | {cgroup.peak_bytes() >> 20} | {outcome} |", flush=True)
                cgroup.reset_peak()
                if outcome != "alive":
                    break
            cluster.kill(gateway)
    finally:
        cgroup.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
