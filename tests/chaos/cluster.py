"""The cluster the chaos tests break: etcd, 2 controllers, 3 storage nodes, a gateway.

Every part is a real process. With network namespaces available (``netns.py``), each
storage node runs in a namespace of its own so it can be cut off from everyone; etcd and
the controllers listen on the bridge address so the namespaced brokers can reach them,
and the gateway and the test itself run in the root namespace. Without namespaces
everything runs on loopback and the nemesis skips partitions (and says so).

The helpers here only start, stop, signal and describe processes; what to break and when
is ``nemesis.py``'s business, and whether anything was lost is ``checker.py``'s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from services.cluster_metadata import CONTROLLER_KEY, decode_controller
from services.metastore import MetaStore
from tests.chaos.netns import Host, Network, namespaces_available
from tests.support.cluster import RPC_TIMEOUT_S, error_code, wait_for
from tests.support.process import DEFAULT_START_TIMEOUT_S, TidelogProcess, wait_healthy
from tidelog.errors import ErrorCode
from tidelog.etcd_launcher import EtcdProcess
from tidelog.v1 import common_pb2, controller_pb2, controller_pb2_grpc

SESSION_TTL_S = 2
"""Brokers' and controllers' etcd lease TTL: a silent process is dead after this long."""

REPLICA_LAG_TIME_MAX_MS = 2_000
"""A follower not caught up for this long leaves the ISR (Kafka's default is 30 s; the
chaos runs want ISR changes within a fault's few seconds)."""

BROKER_IDS = (0, 1, 2)
CONTROLLER_IDS = (100, 101)


def descendants(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                found += [int(child), *descendants(int(child))]
    return found


class Node:
    """One tidelog process of the chaos cluster that can be killed, paused and restarted."""

    def __init__(self, name: str, args: Sequence[str], log_dir: Path, host: Host | None) -> None:
        self.name = name
        self.args = list(args)
        self.log_dir = log_dir
        self.host = host
        self.process: TidelogProcess | None = None
        self.paused = False
        self.starts = 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, *, health: str, wrapper: Sequence[str] = ()) -> None:
        """Start (again) and wait until healthy. ``wrapper`` runs it under e.g. strace."""
        self.starts += 1
        prefix = [*(self.host.command_prefix if self.host else []), *wrapper]
        self.process = TidelogProcess(
            self.args,
            log_path=self.log_dir / f"{self.name}-{self.starts}.stderr.log",
            command_prefix=prefix,
        )
        self.paused = False
        self.process.wait_listening(DEFAULT_START_TIMEOUT_S)
        wait_healthy(self.process.address, health, DEFAULT_START_TIMEOUT_S)

    def kill(self) -> None:
        """kill -9 (a paused process is killed too) and reap.

        Descendants die too: under strace the tidelog process is strace's child, and a
        tracee whose tracer is killed is detached and left running."""
        if self.process is not None and self.process.proc.poll() is None:
            for pid in descendants(self.process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.process.kill()
        self.paused = False

    def pause(self) -> None:
        if self.running and not self.paused:
            os.kill(self.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.running and self.paused:
            os.kill(self.pid, signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        if self.process is not None and self.process.proc.poll() is None:
            self.resume()
            # RuntimeError: hung on shutdown, and terminate() has killed it.
            with contextlib.suppress(RuntimeError):
                self.process.terminate(10.0)


class ChaosCluster:
    """See the module docstring. Driven by one thread (the nemesis or the test)."""

    def __init__(
        self,
        base_dir: Path,
        *,
        use_namespaces: bool = True,
        cluster: str = "chaos",
    ) -> None:
        self.base_dir = base_dir
        self.cluster = cluster
        self.network: Network | None = None
        self.no_network_reason: str | None = None
        if use_namespaces:
            self.no_network_reason = namespaces_available()
            if self.no_network_reason is None:
                self.network = Network()
        else:
            self.no_network_reason = "namespaces disabled for this run"
        listen_host = self.network.gateway_address if self.network else "127.0.0.1"
        self.etcd = EtcdProcess(base_dir / "etcd", host=listen_host)
        self.store: MetaStore | None = None
        self.brokers: dict[int, Node] = {}
        self.controllers: dict[int, Node] = {}
        self.gateway: Node | None = None
        self._listen_host = listen_host

    # --- life cycle ---------------------------------------------------------------------

    def start(self) -> ChaosCluster:
        self.etcd.start()
        self.store = MetaStore(self.etcd.endpoint, cluster=self.cluster)
        common = ["--etcd", self.etcd.endpoint, "--cluster", self.cluster]
        for controller_id in CONTROLLER_IDS:
            node = Node(
                f"controller-{controller_id}",
                [
                    "controller",
                    *common,
                    "--listen",
                    f"{self._listen_host}:0",
                    "--controller-id",
                    str(controller_id),
                    "--session-ttl-s",
                    str(SESSION_TTL_S),
                ],
                self.base_dir,
                None,
            )
            self.controllers[controller_id] = node
            node.start(health="tidelog.v1.Controller")
        for broker_id in BROKER_IDS:
            host = self.network.add_host(f"broker-{broker_id}") if self.network else None
            listen = host.address if host else "127.0.0.1"
            node = Node(
                f"broker-{broker_id}",
                [
                    "storage",
                    *common,
                    "--broker-id",
                    str(broker_id),
                    "--data-dir",
                    str(self.data_dir(broker_id)),
                    "--listen",
                    f"{listen}:0",
                    "--session-ttl-s",
                    str(SESSION_TTL_S),
                    "--replica-lag-time-max-ms",
                    str(REPLICA_LAG_TIME_MAX_MS),
                    # Debug: per-partition fetch errors, to explain a replica that lags.
                    "--log-level",
                    "debug",
                ],
                self.base_dir,
                host,
            )
            self.brokers[broker_id] = node
            node.start(health="tidelog.v1.Storage")
        self.gateway = Node(
            "gateway",
            # Every multi-partition request through AppendMany (the workload's gateway
            # writers name several partitions per request; the default groups only 4+
            # partitions of a leader, which 3 partitions never have).
            ["gateway", *common, "--listen", "127.0.0.1:0", "--produce-group-min-partitions", "1"],
            self.base_dir,
            None,
        )
        self.gateway.start(health="tidelog.v1.Gateway")
        self.wait_brokers_live(BROKER_IDS)
        return self

    def close(self) -> None:
        nodes = [*self.brokers.values(), *self.controllers.values()]
        if self.gateway is not None:
            nodes.append(self.gateway)
        for node in nodes:
            node.kill()
        if self.store is not None:
            self.store.close()
        self.etcd.stop()
        if self.network is not None:
            self.network.close()

    def __enter__(self) -> ChaosCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def data_dir(self, broker_id: int) -> Path:
        return self.base_dir / f"broker-{broker_id}"

    @property
    def gateway_address(self) -> str:
        assert self.gateway is not None and self.gateway.process is not None
        return self.gateway.process.address

    def start_broker(self, broker_id: int, wrapper: Sequence[str] = ()) -> None:
        self.brokers[broker_id].start(health="tidelog.v1.Storage", wrapper=wrapper)

    def start_controller(self, controller_id: int) -> None:
        self.controllers[controller_id].start(health="tidelog.v1.Controller")

    # --- what the cluster says --------------------------------------------------------------

    def active_controller_id(self) -> int | None:
        assert self.store is not None
        kv = self.store.get(CONTROLLER_KEY)
        return None if kv is None else decode_controller(kv).controller_id

    def _controller_stub(self, timeout_s: float = 15.0) -> controller_pb2_grpc.ControllerStub:
        def find() -> controller_pb2_grpc.ControllerStub | None:
            controller_id = self.active_controller_id()
            node = self.controllers.get(controller_id) if controller_id is not None else None
            if node is None or not node.running or node.paused:
                return None
            assert node.process is not None
            channel = grpc.insecure_channel(node.process.address)
            stub = controller_pb2_grpc.ControllerStub(channel)
            stub.DescribeCluster(controller_pb2.DescribeClusterRequest(), timeout=RPC_TIMEOUT_S)
            return stub

        return wait_for(find, timeout_s, "an active controller")

    def live_brokers(self) -> list[int]:
        response = self._controller_stub().DescribeCluster(
            controller_pb2.DescribeClusterRequest(), timeout=RPC_TIMEOUT_S
        )
        return sorted(b.broker_id for b in response.brokers)

    def wait_brokers_live(self, broker_ids: Sequence[int], timeout_s: float = 30.0) -> None:
        wanted = sorted(broker_ids)
        wait_for(lambda: self.live_brokers() == wanted, timeout_s, f"brokers {wanted} live")

    def create_topic(self, name: str, partitions: int, configs: dict[str, str]) -> None:
        response = self._controller_stub().CreateTopics(
            controller_pb2.CreateTopicsRequest(
                topics=[
                    controller_pb2.CreatableTopic(
                        name=name,
                        num_partitions=partitions,
                        replication_factor=len(BROKER_IDS),
                        configs=[
                            common_pb2.ConfigEntry(name=k, value=v) for k, v in configs.items()
                        ],
                    )
                ],
                timeout_ms=10_000,
            ),
            timeout=RPC_TIMEOUT_S + 10,
        )
        (result,) = response.topics
        assert error_code(result.error) == ErrorCode.NONE, result

    def partition_states(self, topic: str) -> list[common_pb2.PartitionState]:
        response = self._controller_stub().Metadata(
            controller_pb2.MetadataRequest(topics=[topic]), timeout=RPC_TIMEOUT_S
        )
        (metadata,) = response.topics
        return list(metadata.partitions)

    def leader_of(self, topic: str, partition: int) -> int:
        for state in self.partition_states(topic):
            if state.partition == partition:
                return int(state.leader)
        raise LookupError(f"{topic}-{partition} not found")

    def wait_healthy(self, topic: str, timeout_s: float) -> bool:
        """Until every broker is live and every partition has a leader and a full ISR;
        False (not an error) if that does not happen by ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        wanted = sorted(BROKER_IDS)
        while time.monotonic() < deadline:
            try:
                if self.live_brokers() == wanted and all(
                    s.leader >= 0 and sorted(s.isr) == wanted for s in self.partition_states(topic)
                ):
                    return True
            except (grpc.RpcError, AssertionError, LookupError):
                pass
            time.sleep(0.2)
        return False
