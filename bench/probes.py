"""Probes behind the hand-written passes of docs/BENCHMARKS.md (sixth pass on): one case at
a time on the ``tests/support`` cluster (etcd, controller, 3 brokers, gateway), with the CPU
each server process used over it (``/proc/PID/stat``) and how busy the whole machine was
(``/proc/stat``: the share of both cores not idle, and context switches per second), in
both SDK modes.

- ``half-rate``: ``bench.workloads.end_to_end_latency_batched`` on a new 6-partition topic
  (RF=3, or ``--replication-factor``) at ``--rate``, one ``send_batch`` every
  ``--tick-ms`` (the suite's 5 ms by default), e2e and acknowledgement quantiles;
  ``--dirty`` writes 1.4 GB to a file without syncing first (the state an earlier case
  leaves), else the case starts after ``sync``.
- ``rf1``: the gRPC ceiling, then ``bench.workloads.produce`` of ``--records`` 100-byte
  records on a new 6-partition RF=1 topic (acks=1); the client's CPU comes from
  ``getrusage``.
- ``acks-all``: ``bench.workloads.produce`` of ``--records`` 100-byte records on a new
  6-partition RF=3 topic with acks=all (the suite's RF=3 acks=all case).

``--pin-brokers`` pins every thread of broker N to CPU N modulo the CPU count, and the
gateway's to CPU 1 (BENCHMARKS item 59), once the cluster is up.

Command: ``PYTHONPATH=. .venv/bin/python -m bench.probes half-rate --rate 430000 --modes
direct,gateway`` (or ``rf1 --modes gateway,direct``).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import ceilings, workloads
from tests.support.cluster import running_cluster

DIRTY_MIB = 1400


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine() -> tuple[float, float, int]:
    """(busy jiffies, all jiffies, context switches) of the whole machine so far."""
    busy = total = 0.0
    switches = 0
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu "):
                jiffies = [int(v) for v in line.split()[1:]]
                total = float(sum(jiffies))
                busy = total - jiffies[3] - jiffies[4]  # idle, iowait
            elif line.startswith("ctxt "):
                switches = int(line.split()[1])
    return busy, total, switches


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _pin(pid: int, cpu: int) -> None:
    """Every thread of ``pid`` to ``cpu``; threads it starts later inherit it."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), {cpu})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=("half-rate", "rf1", "acks-all"))
    parser.add_argument("--modes", default="direct,gateway", help="e.g. direct,gateway,direct")
    parser.add_argument("--rate", type=int, default=430_000, help="half-rate: records/s")
    parser.add_argument("--seconds", type=float, default=10.0, help="half-rate: measured time")
    parser.add_argument("--tick-ms", type=float, default=5.0, help="half-rate: send_batch every")
    parser.add_argument("--dirty", action="store_true", help="half-rate: 1.4 GB dirty first")
    parser.add_argument(
        "--replication-factor", type=int, default=3, choices=(1, 2, 3), help="half-rate: RF"
    )
    parser.add_argument("--records", type=int, default=6_000_000, help="rf1 and acks-all: records")
    parser.add_argument("--pin-brokers", action="store_true", help="one CPU per broker")
    args = parser.parse_args(argv)
    # Deleted afterwards: a probe writes gigabytes, and kept runs fill the disk.
    with (
        tempfile.TemporaryDirectory(prefix="tidelog-probe-") as tmp,
        running_cluster(Path(tmp)) as cluster,
    ):
        base = Path(tmp)
        gateway = cluster.start_gateway()
        gw = gateway.address
        pids = {f"broker-{k}": p.pid for k, p in cluster.brokers.items()}
        pids["gateway"] = gateway.pid
        if args.pin_brokers:
            cpus = os.cpu_count() or 1
            for broker_id, process in cluster.brokers.items():
                _pin(process.pid, broker_id % cpus)
            _pin(gateway.pid, 1 % cpus)
        for i, mode in enumerate(args.modes.split(",")):
            topic = f"probe-{i}"
            direct = mode == "direct"
            rf = {"rf1": 1, "acks-all": 3}.get(args.probe, args.replication_factor)
            workloads.create_topic(gw, topic, 6, rf)
            workloads.settle(gw)
            ceiling = 0.0
            if args.probe == "rf1":
                ceiling = ceilings.grpc_put_mb_s(1024)
                workloads.settle(gw)
            elif args.dirty:
                chunk = os.urandom(1 << 20)
                with open(base / "dirty.bin", "wb") as f:
                    for _ in range(DIRTY_MIB):
                        f.write(chunk)
            before = {k: _cpu_s(p) for k, p in pids.items()}
            own_before, started = _own_cpu_s(), time.monotonic()
            machine_before = _machine()
            if args.probe == "half-rate":
                acks: list[float] = []
                result = workloads.end_to_end_latency_batched(
                    gw,
                    topic,
                    rate_per_s=args.rate,
                    seconds=args.seconds,
                    size=100,
                    direct=direct,
                    ack_latencies_ms=acks,
                    tick_s=args.tick_ms / 1000,
                )
                quantiles = [result.percentile_ms(q) or 0.0 for q in (0.5, 0.99, 0.999)]
                line = (
                    f"{result.records_s:,.0f} records/s, e2e p50/p99/p99.9 "
                    + " / ".join(f"{q:.1f}" for q in quantiles)
                    + " ms, ack p50/p99 "
                    + " / ".join(f"{np.quantile(acks, q):.1f}" for q in (0.5, 0.99))
                    + " ms"
                )
            elif args.probe == "acks-all":
                result = workloads.produce(
                    gw, topic, records=args.records, size=100, acks="all", direct=direct
                )
                line = f"{result.records_s:,.0f} records/s RF=3 acks=all"
            else:
                result = workloads.produce(
                    gw, topic, records=args.records, size=100, acks="1", direct=direct
                )
                line = (
                    f"{result.mb_s:,.0f} MB/s, ceiling {ceiling:,.0f} MB/s "
                    f"({result.mb_s / ceiling:.0%})"
                )
            elapsed = time.monotonic() - started
            busy_j, total_j, switches = (
                after - before for after, before in zip(_machine(), machine_before, strict=True)
            )
            cores = {k: (_cpu_s(p) - before[k]) / elapsed for k, p in pids.items()}
            cores["client"] = (_own_cpu_s() - own_before) / elapsed
            busy = ", ".join(f"{k} {v:.2f}" for k, v in cores.items())
            print(
                f"{args.probe} {mode}: {line}; cores: {busy}; machine {busy_j / total_j:.0%} "
                f"busy, {switches / elapsed:,.0f} context switches/s",
                flush=True,
            )
            workloads.delete_topic(gw, topic)
            (base / "dirty.bin").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
