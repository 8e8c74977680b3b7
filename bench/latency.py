"""Where produce and end-to-end latency go: ``python -m bench.latency``.

A real cluster on this machine (etcd, one controller, 3 storage nodes, one gateway, each
its own process, as the process-level tests start them). 100-byte records.

Sequential cases send one record at a time and wait for its answer, layer by layer: a
storage ``Append`` straight to the partition leader, the gateway's ``Produce``, and the
SDK's ``Producer.send(...).result()``. Their difference is what each hop costs.

Rate cases send one record per ``Producer.send`` (acks=all, linger 0) at a fixed rate
while a ``Consumer`` polls the same topic in another thread; ack = ``send`` to its future
done, e2e = the record's timestamp to the consumer's hand. Each rate case also reports
the CPU every process of the cluster used, as a share of one core. The benchmark process
freezes its garbage collector's view before sending (``workloads.end_to_end_latency``);
one case runs without that, to show what the client's own full collections cost. The
last two cases repeat the 6-partition ones after a 100-partition topic (idle) is
created, as the suite's OMB topic is: what idle partitions cost every replication round.

Prints markdown tables; ``docs/BENCHMARKS.md`` quotes them with this command.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from bench import workloads
from bench.replication import cpu_seconds
from bench.storage_engine import percentile
from bench.workloads import producing
from tests.support.cluster import TestCluster, running_cluster
from tidelog.admin import Admin
from tidelog.producer import Producer
from tidelog.records import encode_batch
from tidelog.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, storage_pb2, storage_pb2_grpc

VALUE = b"x" * 100
SEQUENTIAL_CALLS = 400
IDLE_PARTITIONS = 100
IDLE_LABEL = f"6 partitions, another RF=3 topic of {IDLE_PARTITIONS} idle partitions"
GC_NOT_FROZEN = "the client's GC not frozen"
PAUSE_S = 0.002  # between sequential calls, so each finds the cluster idle


def _percentile(samples: list[float], q: float) -> float:
    """The nearest-rank percentile (``ordered[int(q * n)]`` was one rank high; found by an
    audit)."""
    return percentile(sorted(samples), q)


def _produced(
    gateway_stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.ProduceRequest
) -> gateway_pb2.ProduceResponse:
    """``Produce``, raising unless every partition was acknowledged: the gateway answers
    a refusal (NOT_LEADER_OR_FOLLOWER, NOT_ENOUGH_REPLICAS) in the message, not as a gRPC
    status, and a run of refusals was timed as produce latency (found by an audit)."""
    response: gateway_pb2.ProduceResponse = gateway_stub.Produce(request, timeout=10)
    if len(response.partitions) != len(request.partitions):
        raise RuntimeError(
            f"Produce answered {len(response.partitions)} partitions of {len(request.partitions)}"
        )
    for result in response.partitions:
        if result.error.code != common_pb2.NONE:
            raise RuntimeError(
                f"Produce to {result.topic}[{result.partition}] refused: "
                f"{common_pb2.ErrorCode.Name(result.error.code)} {result.error.message}"
            )
    return response


def _time_calls(call: Callable[[], object]) -> tuple[float, float]:
    samples: list[float] = []
    for _ in range(SEQUENTIAL_CALLS):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
        time.sleep(PAUSE_S)
    return _percentile(samples, 0.5) * 1000, _percentile(samples, 0.99) * 1000


def sequential(gateway: str) -> list[tuple[str, float, float]]:
    admin = Admin(gateway)
    addresses = {b.broker_id: f"{b.host}:{b.port}" for b in admin.describe_cluster().brokers}
    gateway_stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gateway))
    rows: list[tuple[str, float, float]] = []
    for topic, rf in (("lat-seq-rf1", 1), ("lat-seq-rf3", 3)):
        leader = admin.describe_topic(topic).partitions[0].leader
        storage = storage_pb2_grpc.StorageStub(grpc.insecure_channel(addresses[leader]))
        rows += _sequential_layers(gateway, gateway_stub, storage, topic, rf)
    return rows


def _sequential_layers(
    gateway: str,
    gateway_stub: gateway_pb2_grpc.GatewayStub,
    storage: storage_pb2_grpc.StorageStub,
    topic: str,
    rf: int,
) -> list[tuple[str, float, float]]:
    batch = encode_batch([VALUE])
    acks_name, acks = ("1", common_pb2.LEADER) if rf == 1 else ("all", common_pb2.ALL)
    append = storage_pb2.AppendRequest(topic=topic, partition=0, records=batch, acks=acks)
    produce = gateway_pb2.ProduceRequest(
        acks=acks,
        partitions=[gateway_pb2.ProducePartitionData(topic=topic, partition=0, records=batch)],
    )
    label = f"RF={rf} acks={acks_name}"
    rows = [
        (
            f"storage Append to the leader, {label}",
            *_time_calls(lambda: storage.Append(append, timeout=10)),
        ),
        (
            f"gateway Produce, {label}",
            *_time_calls(lambda: _produced(gateway_stub, produce)),
        ),
    ]
    with producing(
        Producer(gateway, acks=acks_name, linger_ms=0, enable_idempotence=acks_name == "all")
    ) as producer:
        rows.append(
            (
                f"SDK send().result(), {label}",
                *_time_calls(lambda: producer.send(topic, VALUE, partition=0).result()),
            )
        )
    return rows


def at_rate(
    cluster: TestCluster,
    gateway: str,
    topic: str,
    rate_per_s: int,
    seconds: float,
    *,
    freeze_gc: bool = True,
) -> tuple[list[float], list[float], dict[str, float]]:
    """(ack latencies ms, e2e latencies ms, CPU share of a core by cluster process)."""
    processes = {f"broker-{b}": p.pid for b, p in cluster.brokers.items()}
    processes.update({f"gateway-{i}": g.pid for i, g in enumerate(cluster.gateways)})
    processes.update({f"controller-{c}": p.pid for c, p in cluster.controllers.items()})
    processes["etcd"] = cluster.etcd.pid
    acks: list[float] = []
    cpu_before = {name: cpu_seconds(pid) for name, pid in processes.items()}
    started = time.perf_counter()
    result = workloads.end_to_end_latency(
        gateway,
        topic,
        rate_per_s=rate_per_s,
        seconds=seconds,
        size=len(VALUE),
        ack_latencies_ms=acks,
        freeze_gc=freeze_gc,
    )
    elapsed = time.perf_counter() - started
    cpu = {name: (cpu_seconds(pid) - cpu_before[name]) / elapsed for name, pid in processes.items()}
    return acks, result.latencies_ms, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per rate case")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="tidelog-latency-bench-") as tmp,
        running_cluster(Path(tmp)) as cluster,
    ):
        gateway = cluster.start_gateway().address
        for topic, partitions, rf in (
            ("lat-seq-rf1", 1, 1),
            ("lat-seq-rf3", 1, 3),
            ("lat-1p", 1, 3),
            ("lat-6p", 6, 3),
        ):
            workloads.create_topic(gateway, topic, partitions, rf)
        workloads.wait_replicated(gateway)
        print("| sequential, one record at a time | p50 ms | p99 ms |")
        print("|---|---:|---:|")
        for name, p50, p99 in sequential(gateway):
            print(f"| {name} | {p50:.2f} | {p99:.2f} |", flush=True)
        print()
        print(
            "| rate case (RF=3, acks=all) | ack p50 / p99 ms | e2e p50 / p99 ms "
            "| cores busy (cluster; client not counted) | busiest process |"
        )
        print("|---|---:|---:|---:|---|")
        created: set[str] = set()
        for topic, label, rate, freeze_gc in (
            ("lat-1p", "one partition", 500, True),
            ("lat-6p", "6 partitions", 500, True),
            ("lat-6p", "6 partitions", 20_000, True),
            ("lat-6p", f"6 partitions, {GC_NOT_FROZEN}", 20_000, False),
            ("lat-6p", IDLE_LABEL, 500, True),
            ("lat-6p", IDLE_LABEL, 20_000, True),
        ):
            if label == IDLE_LABEL and "idle" not in created:
                # Every follower fetch now also names the idle partitions its leader has.
                workloads.create_topic(gateway, "idle", IDLE_PARTITIONS, 3)
                created.add("idle")
            workloads.wait_replicated(gateway)
            acks, e2e, cpu = at_rate(
                cluster, gateway, topic, rate, args.seconds, freeze_gc=freeze_gc
            )
            busiest = max(cpu, key=lambda name: cpu[name])
            print(
                f"| {rate:,}/s, {label} "
                f"| {_percentile(acks, 0.5):.1f} / {_percentile(acks, 0.99):.1f} "
                f"| {_percentile(e2e, 0.5):.1f} / {_percentile(e2e, 0.99):.1f} "
                f"| {sum(cpu.values()):.2f} | {busiest} {cpu[busiest] * 100:.0f}% |",
                flush=True,
            )


if __name__ == "__main__":
    main()
