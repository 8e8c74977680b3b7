"""A whole control plane for tests: etcd, storage nodes and controllers as real processes.

``TestCluster(base_dir)`` starts a private etcd (fast test timings) and then, on demand,
``tidelog storage --etcd ...`` and ``tidelog controller --etcd ...`` processes bound to
127.0.0.1 port 0. Helpers find the active controller, call the Controller API with a
deadline, wait for conditions with a deadline, and kill -9 / SIGTERM / restart processes.
``close()`` kills whatever still runs and stops etcd.

Nothing here sleeps for a fixed time to "let things settle": every wait polls a condition
until a deadline and fails with a description of what it waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc

from services.cluster_metadata import CONTROLLER_KEY, decode_controller
from services.metastore import MetaStore
from tests.support.process import (
    DEFAULT_START_TIMEOUT_S,
    StorageProcess,
    TidelogProcess,
    wait_healthy,
)
from tidelog.errors import ErrorCode
from tidelog.etcd_launcher import EtcdProcess
from tidelog.v1 import common_pb2, controller_pb2, controller_pb2_grpc, gateway_pb2_grpc

T = TypeVar("T")

RPC_TIMEOUT_S = 10.0
"""Deadline of every Controller call made by the helpers."""


def wait_for(predicate: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """Poll ``predicate`` until it returns something truthy (returned) or time runs out.

    Exceptions from ``predicate`` count as "not yet" (the process may be restarting); the
    last one is reported if the deadline passes.
    """
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (grpc.RpcError, AssertionError, KeyError, LookupError) as exc:
            last_error = exc
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error!r})" if last_error is not None else ""
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}{detail}")
        time.sleep(0.05)


def poll_records(consumer: Any, n: int, timeout_s: float = 30.0) -> list[tuple[int, bytes]]:
    """(offset, value) of what ``consumer`` (a ``tidelog.Consumer``) polls until it has
    ``n`` records or ``timeout_s`` passed."""
    got: list[tuple[int, bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += [(r.offset, r.value) for r in consumer.poll(timeout_ms=500)]
    return got


def error_code(error: common_pb2.Error) -> ErrorCode:
    return ErrorCode(int(error.code))


def rpc_error_code(exc: grpc.RpcError) -> ErrorCode | None:
    """The ``tidelog-error-code`` trailer of a failed call."""
    for key, value in exc.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == "tidelog-error-code":
            return ErrorCode[value]
    return None


def trailer(exc: grpc.RpcError, key: str) -> str | None:
    for name, value in exc.trailing_metadata() or ():  # type: ignore[attr-defined]
        if name == key:
            return str(value)
    return None


class ControllerProcess(TidelogProcess):
    """``tidelog controller`` on 127.0.0.1 port 0, with a channel and a Controller stub."""

    def __init__(
        self,
        etcd: str,
        *,
        controller_id: int,
        cluster: str,
        log_path: Path,
        session_ttl_s: int = 2,
        imbalance_check_interval_s: float = 300.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.controller_id = controller_id
        super().__init__(
            [
                "controller",
                "--etcd",
                etcd,
                "--listen",
                "127.0.0.1:0",
                "--controller-id",
                str(controller_id),
                "--cluster",
                cluster,
                "--session-ttl-s",
                str(session_ttl_s),
                "--imbalance-check-interval-s",
                str(imbalance_check_interval_s),
                *extra_args,
            ],
            log_path=log_path,
        )
        self._channel: grpc.Channel | None = None

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> ControllerProcess:
        self.wait_listening(timeout_s)
        wait_healthy(self.address, "tidelog.v1.Controller", timeout_s)
        return self

    @property
    def stub(self) -> controller_pb2_grpc.ControllerStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return controller_pb2_grpc.ControllerStub(self._channel)

    def wait(self, timeout_s: float) -> int:
        try:
            return super().wait(timeout_s)
        finally:
            if self._channel is not None:
                self._channel.close()
                self._channel = None


class GatewayProcess(TidelogProcess):
    """``tidelog gateway`` on 127.0.0.1 port 0, with a channel and a Gateway stub."""

    def __init__(
        self,
        etcd: str,
        *,
        cluster: str,
        log_path: Path,
        extra_args: Sequence[str] = (),
        command_prefix: Sequence[str] = (),
    ):
        super().__init__(
            [
                "gateway",
                "--etcd",
                etcd,
                "--listen",
                "127.0.0.1:0",
                "--cluster",
                cluster,
                *extra_args,
            ],
            log_path=log_path,
            command_prefix=command_prefix,
        )
        self._channel: grpc.Channel | None = None

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> GatewayProcess:
        self.wait_listening(timeout_s)
        wait_healthy(self.address, "tidelog.v1.Gateway", timeout_s)
        return self

    @property
    def stub(self) -> gateway_pb2_grpc.GatewayStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(
                self.address,
                options=[
                    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
                    ("grpc.max_send_message_length", 256 * 1024 * 1024),
                ],
            )
        return gateway_pb2_grpc.GatewayStub(self._channel)

    def wait(self, timeout_s: float) -> int:
        try:
            return super().wait(timeout_s)
        finally:
            if self._channel is not None:
                self._channel.close()
                self._channel = None


class TestCluster:
    """etcd + storage nodes + controllers under ``base_dir``; see the module docstring."""

    __test__ = False  # not a pytest test class, despite the name

    def __init__(
        self,
        base_dir: Path,
        *,
        cluster: str = "test",
        session_ttl_s: int = 2,
        imbalance_check_interval_s: float = 300.0,
        storage_args: Sequence[str] = (),
        etcd_args: Sequence[str] = (),
    ) -> None:
        self.base_dir = base_dir
        # Extra flags for every storage node (e.g. --replica-lag-time-max-ms).
        self.storage_args = list(storage_args)
        self.cluster = cluster
        self.session_ttl_s = session_ttl_s
        self.imbalance_check_interval_s = imbalance_check_interval_s
        self.etcd = EtcdProcess(base_dir / "etcd", extra_args=etcd_args).start()
        self.store = MetaStore(self.etcd.endpoint, cluster=cluster)
        self.brokers: dict[int, StorageProcess] = {}
        self.controllers: dict[int, ControllerProcess] = {}
        self.gateways: list[GatewayProcess] = []
        self._all: list[TidelogProcess] = []

    # --- processes ------------------------------------------------------------------------

    def data_dir(self, broker_id: int) -> Path:
        return self.base_dir / f"broker-{broker_id}"

    def start_broker(
        self,
        broker_id: int,
        *,
        rack: str | None = None,
        wait: bool = True,
        command_prefix: Sequence[str] = (),
    ) -> StorageProcess:
        """Start (or restart, on the same data dir) storage node ``broker_id``;
        ``command_prefix`` as ``TidelogProcess``'s. Each call starts a new process from
        its own arguments: a restart keeps nothing of the previous one's prefix (a broker
        restarted into its memory cgroup is given ``command_prefix`` again)."""
        extra = [
            "--etcd",
            self.etcd.endpoint,
            "--cluster",
            self.cluster,
            "--session-ttl-s",
            str(self.session_ttl_s),
        ]
        if rack is not None:
            extra += ["--rack", rack]
        extra += self.storage_args
        node = StorageProcess(
            self.data_dir(broker_id),
            broker_id=broker_id,
            log_path=self.base_dir / f"broker-{broker_id}-{len(self._all)}.stderr.log",
            extra_args=extra,
            command_prefix=command_prefix,
        )
        self._all.append(node)
        self.brokers[broker_id] = node
        if wait:
            node.start()
        return node

    def start_controller(
        self,
        controller_id: int,
        *,
        imbalance_check_interval_s: float | None = None,
        extra_args: Sequence[str] = (),
    ) -> ControllerProcess:
        interval = imbalance_check_interval_s or self.imbalance_check_interval_s
        process = ControllerProcess(
            self.etcd.endpoint,
            controller_id=controller_id,
            cluster=self.cluster,
            log_path=self.base_dir / f"controller-{controller_id}-{len(self._all)}.stderr.log",
            session_ttl_s=self.session_ttl_s,
            imbalance_check_interval_s=interval,
            extra_args=extra_args,
        )
        self._all.append(process)
        self.controllers[controller_id] = process
        return process.start()

    def start_gateway(
        self, extra_args: Sequence[str] = (), command_prefix: Sequence[str] = ()
    ) -> GatewayProcess:
        """Start a gateway (another one each call: gateways are stateless);
        ``command_prefix`` as ``TidelogProcess``'s."""
        process = GatewayProcess(
            self.etcd.endpoint,
            cluster=self.cluster,
            log_path=self.base_dir / f"gateway-{len(self._all)}.stderr.log",
            extra_args=extra_args,
            command_prefix=command_prefix,
        )
        self._all.append(process)
        self.gateways.append(process)
        return process.start()

    def kill(self, process: TidelogProcess) -> None:
        """kill -9 and reap."""
        process.kill()

    def close(self) -> None:
        for process in self._all:
            if process.proc.poll() is None:
                process.kill()
        self.store.close()
        self.etcd.stop()

    def __enter__(self) -> TestCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def logs(self) -> str:
        """The tails of every process log, for assertion messages."""
        return "\n".join(
            f"--- {' '.join(p.args[:2])} ({p.log_path.name})\n{p.log_tail(15)}" for p in self._all
        )

    # --- the active controller ------------------------------------------------------------

    def active_controller(self, timeout_s: float = 15.0) -> ControllerProcess:
        """The controller process that holds the election key and answers as active."""

        def find() -> ControllerProcess | None:
            kv = self.store.get(CONTROLLER_KEY)
            if kv is None:
                return None
            info = decode_controller(kv)
            process = self.controllers.get(info.controller_id)
            if process is None or process.proc.poll() is not None:
                return None
            process.stub.DescribeCluster(
                controller_pb2.DescribeClusterRequest(), timeout=RPC_TIMEOUT_S
            )
            return process

        return wait_for(find, timeout_s, "an active controller")

    def controller_epoch(self) -> int:
        kv = self.store.get(CONTROLLER_KEY)
        assert kv is not None, "no controller key"
        return kv.create_revision

    @property
    def api(self) -> controller_pb2_grpc.ControllerStub:
        return self.active_controller().stub

    def describe_cluster(self) -> controller_pb2.DescribeClusterResponse:
        response: controller_pb2.DescribeClusterResponse = self.api.DescribeCluster(
            controller_pb2.DescribeClusterRequest(), timeout=RPC_TIMEOUT_S
        )
        return response

    def wait_brokers(self, broker_ids: Sequence[int], timeout_s: float = 15.0) -> None:
        """Until the active controller lists exactly ``broker_ids`` as live."""
        wanted = sorted(broker_ids)
        wait_for(
            lambda: sorted(b.broker_id for b in self.describe_cluster().brokers) == wanted,
            timeout_s,
            f"the controller to see brokers {wanted}",
        )

    def broker_epoch(self, broker_id: int) -> int:
        for broker in self.describe_cluster().brokers:
            if broker.broker_id == broker_id:
                return int(broker.broker_epoch)
        raise LookupError(f"broker {broker_id} is not live")

    # --- topics ---------------------------------------------------------------------------

    def create_topic(
        self,
        name: str,
        partitions: int,
        replication_factor: int,
        configs: dict[str, str] | None = None,
    ) -> controller_pb2.CreateTopicResult:
        response = self.api.CreateTopics(
            controller_pb2.CreateTopicsRequest(
                topics=[
                    controller_pb2.CreatableTopic(
                        name=name,
                        num_partitions=partitions,
                        replication_factor=replication_factor,
                        configs=[
                            common_pb2.ConfigEntry(name=k, value=v)
                            for k, v in (configs or {}).items()
                        ],
                    )
                ],
                timeout_ms=10_000,
            ),
            timeout=RPC_TIMEOUT_S + 10,
        )
        (result,) = response.topics
        assert error_code(result.error) == ErrorCode.NONE, result
        return result  # type: ignore[no-any-return]

    def topic(self, name: str) -> common_pb2.TopicMetadata:
        response = self.api.Metadata(
            controller_pb2.MetadataRequest(topics=[name]), timeout=RPC_TIMEOUT_S
        )
        (topic,) = response.topics
        assert error_code(topic.error) == ErrorCode.NONE, topic
        return topic  # type: ignore[no-any-return]

    def partitions(self, name: str) -> list[common_pb2.PartitionState]:
        return list(self.topic(name).partitions)

    # --- producer ids ---------------------------------------------------------------------

    def allocate_producer_ids(
        self, broker_id: int = -1, broker_epoch: int = -1, timeout_s: float = 15.0
    ) -> controller_pb2.AllocateProducerIdsResponse:
        """AllocateProducerIds at the active controller, retried while there is none
        (NOT_CONTROLLER, unreachable) until ``timeout_s``; the response as it came."""

        def attempt() -> tuple[controller_pb2.AllocateProducerIdsResponse] | None:
            try:
                response: controller_pb2.AllocateProducerIdsResponse = self.active_controller(
                    timeout_s
                ).stub.AllocateProducerIds(
                    controller_pb2.AllocateProducerIdsRequest(
                        broker_id=broker_id, broker_epoch=broker_epoch
                    ),
                    timeout=RPC_TIMEOUT_S,
                )
            except grpc.RpcError as exc:
                if rpc_error_code(exc) in (None, ErrorCode.NOT_CONTROLLER):
                    return None  # no active controller right now (or it just died)
                raise
            return (response,)  # a tuple: always truthy, whatever the message

        (response,) = wait_for(attempt, timeout_s, "an AllocateProducerIds answer")
        return response


def running_cluster(
    base_dir: Path,
    brokers: int = 3,
    *,
    storage_args: Sequence[str] = (),
    etcd_args: Sequence[str] = (),
) -> TestCluster:
    """A cluster with ``brokers`` storage nodes (ids 0..n-1) and one controller, every
    broker registered; use it as a context manager. The arguments as ``TestCluster``'s."""
    cluster = TestCluster(base_dir, storage_args=storage_args, etcd_args=etcd_args)
    try:
        for broker_id in range(brokers):
            cluster.start_broker(broker_id)
        cluster.start_controller(1)
        cluster.wait_brokers(list(range(brokers)))
    except BaseException:
        cluster.close()
        raise
    return cluster


__all__ = [
    "ControllerProcess",
    "GatewayProcess",
    "StorageProcess",
    "TestCluster",
    "error_code",
    "poll_records",
    "rpc_error_code",
    "running_cluster",
    "trailer",
    "wait_for",
]
