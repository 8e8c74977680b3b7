"""A gateway process: the Gateway service, health and reflection, over a metadata cache.

``GatewayNode(config).start()`` connects to etcd, loads and watches the cluster metadata,
then serves ``tidelog.v1.Gateway`` plus the standard gRPC health and reflection services
(so ``grpcurl`` can list and call every method). The gateway keeps no state of its own
beyond caches: run as many as needed, stop any at any time.

``main(args)`` is what ``tidelog gateway`` runs: logging, SIGTERM/SIGINT handling and the
line ``tidelog gateway listening on HOST:PORT`` on stdout once serving.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Collection
from dataclasses import dataclass
from typing import Final

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.allocator import cgroup_limit_files, memory_limit_bytes
from services.gateway.channels import Channels, ChannelSweeper, broker_address
from services.gateway.controller_client import ControllerClient, ProducerIds
from services.gateway.fetch import FetchHandler, FetchLimits
from services.gateway.group_changes import GroupChanges
from services.gateway.group_coordinator import GroupCoordinator
from services.gateway.groups import OffsetStore
from services.gateway.leader_calls import LeaderCalls
from services.gateway.metadata_cache import MetadataCache
from services.gateway.produce import (
    MAX_BACKGROUND_APPENDS,
    MIN_GROUP_PARTITIONS,
    ProduceHandler,
    ProduceLimits,
)
from services.gateway.router import Router
from services.gateway.server import GatewayServicer, add_gateway_to_server
from services.metastore import MetaStore
from services.process import bind, format_address, new_server, serve_until_signal
from tidelog import logging as tidelog_logging
from tidelog.errors import TidelogError
from tidelog.formats import INT32_MAX, MAX_PRODUCE_REQUEST_BYTES, REQUEST_OVERHEAD_BYTES
from tidelog.v1 import gateway_pb2

_log = structlog.get_logger("tidelog.gateway.node")

GATEWAY_SERVICE_NAME: Final[str] = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
ETCD_TIMEOUT_S: Final = 5.0
SHUTDOWN_GRACE_S: Final = 5.0
MESSAGE_OVERHEAD_BYTES: Final = 4 * 1024 * 1024
"""Room above the record-byte limits for protobuf framing, so our own limit errors (with
their precise messages) fire before gRPC's generic size check."""
LARGEST_BATCH_BYTES: Final = MAX_PRODUCE_REQUEST_BYTES + REQUEST_OVERHEAD_BYTES
"""The largest batch a leader may hold, and so answer a fetch with: what a storage node
takes in one message by default (``services/storage/node.py``), a produce request's
records and their framing."""


def send_limit_bytes(max_request_bytes: int, max_fetch_bytes: int) -> int:
    """The gateway server's gRPC limit on a message it sends.

    A fetch (or a Subscribe step) answers the first batch whole even beyond its
    max_bytes, as Kafka does, so a consumer always makes progress: the answer may be the
    largest batch a topic may hold (up to what a storage node takes; more if this
    gateway takes larger produce requests, which such storage nodes must take too) with
    the rest of the fetch's budget beside it. Sized from --max-request-bytes and
    --max-fetch-bytes alone, as the receive limit is, a gateway with those lowered could
    never send a valid batch larger than them: the call failed RESOURCE_EXHAUSTED every
    time and the consumer was stuck before the batch for good (found by an audit). The
    limit is a check only: the bytes sent are held in the fetch budget.
    """
    batch_bytes = max(max_request_bytes + REQUEST_OVERHEAD_BYTES, LARGEST_BATCH_BYTES)
    # Above the receive limit (max(the two limits) + MESSAGE_OVERHEAD_BYTES) whatever
    # they are; gRPC takes an int32.
    return min(INT32_MAX, batch_bytes + max_fetch_bytes + MESSAGE_OVERHEAD_BYTES)


@dataclass(frozen=True, slots=True)
class GatewayNodeConfig:
    """How to run one gateway process."""

    etcd: str
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    cluster: str = "default"
    max_request_bytes: int = MAX_PRODUCE_REQUEST_BYTES
    # None: max_fetch_bytes_for() of the cgroup memory limit.
    max_fetch_bytes: int | None = None
    max_in_flight_per_stream: int = 64
    # Record bytes of produce requests held at once; None: queued_max_request_bytes_for()
    # of the cgroup memory limit.
    queued_max_request_bytes: int | None = None
    # Bytes of fetch answers held at once; None: queued_max_fetch_bytes_for() of the cgroup
    # memory limit.
    queued_max_fetch_bytes: int | None = None
    # Calls admitted at once; beyond it the server answers RESOURCE_EXHAUSTED.
    max_concurrent_rpcs: int = 1024
    # Pool threads serving calls (started as needed); None: one per admitted call. Streams
    # and long polls hold a thread each for as long as they last (an SDK producer keeps its
    # ProduceStream open while it lives), so with fewer threads than admitted calls, that
    # many idle producers left every other call queued for a thread, health checks aside.
    max_workers: int | None = None
    # Partitions of one leader in one produce request sent in one AppendMany.
    produce_group_min_partitions: int = MIN_GROUP_PARTITIONS
    # acks=0 appends unanswered per leader broker (MAX_BACKGROUND_APPENDS).
    max_background_appends: int = MAX_BACKGROUND_APPENDS

    def __post_init__(self) -> None:
        if not 0 <= self.listen_port <= 65535:
            raise ValueError(f"port {self.listen_port} is out of range 0..65535")
        for name in (
            "max_request_bytes",
            "max_fetch_bytes",
            "max_in_flight_per_stream",
            "queued_max_request_bytes",
            "queued_max_fetch_bytes",
            "produce_group_min_partitions",
            "max_background_appends",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")


QUEUED_MAX_REQUEST_BYTES: Final = 256 * 1024 * 1024
"""Record bytes of produce requests a gateway holds at once, when no memory limit says less."""
LIMIT_SHARE_QUEUED: Final = 8
"""Under a memory limit, the produce budget is at most limit / this: each byte held costs
about three (the request as received, as forwarded, gRPC's buffers), and the rest of the
limit is for fetches, the allocator's retained memory and the interpreter."""


MAX_FETCH_BYTES: Final = 50 * 1024 * 1024
"""Record bytes of one fetch answer (Kafka's fetch.max.bytes), when no memory limit says
less."""
LIMIT_SHARE_FETCH: Final = 32
"""Under a memory limit, one fetch answer is at most limit / this: the gateway holds an
answer about three times over (the leaders' answers, the joined answer, gRPC's buffer),
and a consumer keeps a fetch in flight per leader (tidelog.consumer)."""


QUEUED_MAX_FETCH_BYTES: Final = 256 * 1024 * 1024
"""Bytes of fetch answers a gateway holds at once, when no memory limit says less."""
LIMIT_SHARE_QUEUED_FETCH: Final = 16
"""Under a memory limit, the fetch budget is at most limit / this: an answer is held two or
three times over (the leaders' answers, the joined answer, gRPC's buffer), next to the
produce budget's share."""


def queued_max_fetch_bytes_for(limit_bytes: int | None) -> int:
    """The default fetch budget of a gateway under ``limit_bytes`` (None: no limit)."""
    if limit_bytes is None:
        return QUEUED_MAX_FETCH_BYTES
    return max(1024 * 1024, min(QUEUED_MAX_FETCH_BYTES, limit_bytes // LIMIT_SHARE_QUEUED_FETCH))


def queued_max_request_bytes_for(limit_bytes: int | None) -> int:
    """The default produce budget of a gateway under ``limit_bytes`` (None: no limit)."""
    if limit_bytes is None:
        return QUEUED_MAX_REQUEST_BYTES
    return max(1, min(QUEUED_MAX_REQUEST_BYTES, limit_bytes // LIMIT_SHARE_QUEUED))


def max_fetch_bytes_for(limit_bytes: int | None) -> int:
    """The default cap on one fetch answer of a gateway under ``limit_bytes``."""
    if limit_bytes is None:
        return MAX_FETCH_BYTES
    return max(1024 * 1024, min(MAX_FETCH_BYTES, limit_bytes // LIMIT_SHARE_FETCH))


class GatewayNode:
    """One running gateway. ``start()`` once, ``stop()`` once (idempotent).

    Thread-safety: ``start``/``stop`` from the owner thread; requests run on gRPC pool
    threads and the produce workers.
    """

    def __init__(self, config: GatewayNodeConfig) -> None:
        self.config = config
        self._health = health.HealthServicer()
        self._server: grpc.Server | None = None
        self._store: MetaStore | None = None
        self._cache: MetadataCache | None = None
        self._group_changes: GroupChanges | None = None
        self._channels = Channels()
        self._leader_calls = LeaderCalls()
        self._sweeper: ChannelSweeper | None = None
        self._produce: ProduceHandler | None = None
        self._port = 0
        self._stopped = False

    @property
    def address(self) -> str:
        host = self.config.listen_host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return format_address(host, self._port)

    def start(self) -> None:
        config = self.config
        self._store = MetaStore(config.etcd, cluster=config.cluster, timeout_s=ETCD_TIMEOUT_S)
        self._cache = MetadataCache(self._store)
        self._cache.start(ETCD_TIMEOUT_S)
        self._group_changes = GroupChanges(self._store)
        self._group_changes.start()
        router = Router(self._cache, self._channels)
        limit = memory_limit_bytes(cgroup_limit_files())
        budget_bytes = config.queued_max_request_bytes or queued_max_request_bytes_for(limit)
        fetch_bytes = config.max_fetch_bytes or max_fetch_bytes_for(limit)
        fetch_budget_bytes = config.queued_max_fetch_bytes or queued_max_fetch_bytes_for(limit)
        _log.info(
            "memory_limits",
            memory_limit_bytes=limit,
            queued_max_request_bytes=budget_bytes,
            max_fetch_bytes=fetch_bytes,
            queued_max_fetch_bytes=fetch_budget_bytes,
        )
        self._produce = ProduceHandler(
            router,
            ProduceLimits(
                max_request_bytes=config.max_request_bytes,
                queued_max_request_bytes=budget_bytes,
                min_group_partitions=config.produce_group_min_partitions,
                max_background_appends=config.max_background_appends,
            ),
        )
        controller = ControllerClient(self._cache, self._channels)
        servicer = GatewayServicer(
            cache=self._cache,
            produce=self._produce,
            fetch=FetchHandler(
                router,
                FetchLimits(max_fetch_bytes=fetch_bytes, queued_max_fetch_bytes=fetch_budget_bytes),
                self._leader_calls,
            ),
            controller=controller,
            offsets=OffsetStore(self._store, self._cache),
            groups=GroupCoordinator(self._store, self._cache, changes=self._group_changes),
            producer_ids=ProducerIds(controller),
            max_in_flight_per_stream=config.max_in_flight_per_stream,
        )
        # What a client may send: the limits' own errors (precise messages) fire first.
        receive_limit = max(config.max_request_bytes, fetch_bytes) + MESSAGE_OVERHEAD_BYTES
        server = new_server(
            role="gateway",
            max_workers=config.max_workers or config.max_concurrent_rpcs,
            max_message_bytes=receive_limit,
            max_send_message_bytes=send_limit_bytes(config.max_request_bytes, fetch_bytes),
            max_concurrent_rpcs=config.max_concurrent_rpcs,
        )
        port = bind(server, config.listen_host, config.listen_port)
        self._port = port
        add_gateway_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (GATEWAY_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        cache = self._cache

        def addresses_in_use() -> set[str]:
            return cache.read(
                lambda view: (
                    {broker_address(b) for b in view.brokers.values()}
                    | ({view.controller.address} if view.controller is not None else set())
                )
            )

        produce = self._produce
        broker_ids_seen: list[set[int]] = [cache.read(lambda view: set(view.brokers))]

        def retain_produce_pools(_addresses: Collection[str]) -> None:
            # As the channels: the produce pools of broker ids gone from the metadata at
            # two looks in a row (a whole interval: a broker re-registering keeps its
            # pool). Every broker id that ever led kept up to 64 threads for ever.
            current = cache.read(lambda view: set(view.brokers))
            produce.retain_brokers(current | broker_ids_seen[0])
            broker_ids_seen[0] = current

        self._sweeper = ChannelSweeper(
            addresses_in_use,
            (self._channels.retain, self._leader_calls.retain, retain_produce_pools),
        )
        self._sweeper.start()
        server.start()
        self._server = server
        for service in ("", GATEWAY_SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        _log.info("listening", address=self.address)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        _log.info("stopping")
        self._health.enter_graceful_shutdown()
        if self._server is not None:
            self._server.stop(SHUTDOWN_GRACE_S).wait(SHUTDOWN_GRACE_S + 1)
        if self._produce is not None:
            self._produce.close()
        if self._group_changes is not None:
            self._group_changes.stop()
        if self._sweeper is not None:
            self._sweeper.stop()
        if self._cache is not None:
            self._cache.stop()
        self._leader_calls.close()
        self._channels.close()
        if self._store is not None:
            self._store.close()
        _log.info("stopped")


def main(args: argparse.Namespace) -> int:
    """Run a gateway until SIGTERM/SIGINT; the ``tidelog gateway`` command."""
    tidelog_logging.configure("gateway", level=args.log_level)
    tidelog_logging.capture_process_output()
    try:
        config = GatewayNodeConfig(
            etcd=args.etcd,
            listen_host=args.listen_host,
            listen_port=args.listen_port,
            cluster=args.cluster,
            max_request_bytes=args.max_request_bytes,
            max_fetch_bytes=args.max_fetch_bytes,
            max_in_flight_per_stream=args.max_in_flight_per_stream,
            queued_max_request_bytes=getattr(args, "queued_max_request_bytes", None),
            queued_max_fetch_bytes=getattr(args, "queued_max_fetch_bytes", None),
            max_concurrent_rpcs=getattr(args, "max_concurrent_rpcs", 1024),
            produce_group_min_partitions=getattr(
                args, "produce_group_min_partitions", MIN_GROUP_PARTITIONS
            ),
            max_background_appends=getattr(args, "max_background_appends", MAX_BACKGROUND_APPENDS),
        )
    except (ValueError, TidelogError) as exc:
        print(f"tidelog gateway: error: {exc}", file=sys.stderr)
        return 2
    return serve_until_signal(
        "gateway", GatewayNode(config), "tidelog gateway listening on {address}"
    )
