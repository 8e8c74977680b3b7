"""A tour of one storage node: start it, create a partition, append, fetch, stop.

(``make run`` runs the nginx pipeline, ``examples/nginx_pipeline``.) It starts a real
``tidelog storage`` process (``python -m tidelog storage``) on a temporary data
directory and a free port, waits for its gRPC health check to say SERVING, creates
partition ``demo-0`` the way the controller will (LeaderAndIsr naming this broker
leader), appends a few record batches encoded with ``tidelog.records``, fetches them
back, decodes and prints them, then stops the node with SIGTERM and checks that it
exited cleanly (status 0).

Run: ``python -m examples.storage_demo [--keep-data]``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tidelog.records import decode_batches, encode_batch
from tidelog.v1 import common_pb2, storage_pb2, storage_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
BROKER_ID = 1
TOPIC = "demo"
START_TIMEOUT_S = 30.0
RPC_TIMEOUT_S = 10.0


def start_node(data_dir: Path, log_path: Path) -> tuple[subprocess.Popen[str], str]:
    """Start ``tidelog storage`` on port 0; return the process and its address."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "tidelog", "storage",
                "--broker-id", str(BROKER_ID),
                "--data-dir", str(data_dir),
                "--listen", "127.0.0.1:0",
            ],
            stdout=subprocess.PIPE,
            stderr=log_file,
            stdin=subprocess.DEVNULL,
            cwd=REPO_ROOT,
            env=env,
            text=True,
        )  # fmt: skip
    address: list[str] = []
    found = threading.Event()

    def read_stdout() -> None:
        # Keep draining stdout so the child never blocks on a full pipe.
        assert proc.stdout is not None
        for line in proc.stdout:
            match = re.search(r"listening on (\S+)", line)
            if match and not address:
                print(f"  node says: {line.strip()}")
                address.append(match[1])
                found.set()
        found.set()

    threading.Thread(target=read_stdout, daemon=True).start()
    if not found.wait(START_TIMEOUT_S) or not address:
        proc.kill()
        raise SystemExit(f"the storage node did not start; its log:\n{log_path.read_text()}")
    return proc, address[0]


def wait_serving(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            status = health.Check(
                health_pb2.HealthCheckRequest(service="tidelog.v1.Storage"), timeout=1
            ).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the storage node never reported SERVING")
        time.sleep(0.05)


def run(data_dir: Path) -> int:
    log_path = data_dir.with_name("storage.stderr.log")
    print(f"starting: python -m tidelog storage --data-dir {data_dir} --listen 127.0.0.1:0")
    proc, address = start_node(data_dir, log_path)
    try:
        with grpc.insecure_channel(address) as channel:
            wait_serving(channel)
            print(f"health: {address} is SERVING")
            stub = storage_pb2_grpc.StorageStub(channel)

            state = common_pb2.PartitionState(
                topic=TOPIC,
                partition=0,
                leader=BROKER_ID,
                leader_epoch=0,
                isr=[BROKER_ID],
                replicas=[BROKER_ID],
            )
            created = stub.LeaderAndIsr(
                storage_pb2.LeaderAndIsrRequest(
                    controller_epoch=1,
                    partitions=[
                        storage_pb2.LeaderAndIsrPartition(
                            state=state,
                            is_new=True,
                            configs=[common_pb2.ConfigEntry(name="segment.bytes", value="1048576")],
                        )
                    ],
                ),
                timeout=RPC_TIMEOUT_S,
            )
            error = created.partitions[0].error
            if error.code != common_pb2.NONE:
                raise SystemExit(f"LeaderAndIsr failed: {error.message}")
            print(f"created partition {TOPIC}-0, broker {BROKER_ID} leads at epoch 0")

            batches: list[tuple[list[bytes | None], list[bytes | None]]] = [
                ([b"hello", b"tidelog"], [b"greeting", b"greeting"]),
                ([b"the tide", b"line", b"is the high watermark"], [None, None, None]),
                ([b"bye"], [b"greeting"]),
            ]
            for values, keys in batches:
                response = stub.Append(
                    storage_pb2.AppendRequest(
                        topic=TOPIC,
                        partition=0,
                        records=encode_batch(values, keys=keys),
                        acks=common_pb2.ALL,
                    ),
                    timeout=RPC_TIMEOUT_S,
                )
                print(
                    f"appended {len(values)} records at offsets "
                    f"[{response.base_offset}, {response.last_offset}], "
                    f"high watermark now {response.high_watermark}"
                )

            fetched = stub.Fetch(
                storage_pb2.FetchRequest(
                    replica_id=-1,
                    max_wait_ms=100,
                    partitions=[
                        storage_pb2.FetchPartition(topic=TOPIC, partition=0, fetch_offset=0)
                    ],
                ),
                timeout=RPC_TIMEOUT_S,
            ).partitions[0]
            print(
                f"fetched {len(fetched.records)} bytes from offset 0 "
                f"(high watermark {fetched.high_watermark}, "
                f"log end offset {fetched.log_end_offset}):"
            )
            for batch in decode_batches(fetched.records):
                for record in batch.records:
                    key = record.key.decode() if record.key is not None else None
                    value = record.value.decode() if record.value is not None else None
                    print(f"  offset {record.offset}: key={key!r} value={value!r}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            status = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            status = proc.wait()
    print(f"sent SIGTERM; the node exited with status {status}")
    files = sorted(p.name for p in (data_dir / f"{TOPIC}-0").iterdir())
    print(f"on disk in {data_dir / (TOPIC + '-0')}: {', '.join(files)}")
    return 0 if status == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--keep-data", action="store_true", help="leave the data directory")
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="tidelog-demo-"))
    try:
        return run(base / "data")
    finally:
        if args.keep_data:
            print(f"data kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
