"""A controller process: the Controller service, health, reflection, the election.

``ControllerNode(config, etcd=...).start()`` binds the gRPC server (``tidelog.v1.Controller``
plus the standard health and reflection services), then joins the election. The node
reports SERVING as soon as it serves, active or standby: a standby is healthy, it answers
NOT_CONTROLLER with the active controller's address. Like a storage node or a gateway,
it does not start when etcd cannot be reached (one line, exit status 1). ``stop()``
resigns first (revoking the election lease, so a standby takes over at once), then stops
serving.

``main(args)`` is what ``tidelog controller`` runs: logging, signal handling (SIGTERM /
SIGINT -> resign and exit 0) and the line ``tidelog controller <id> listening on
<host>:<port>`` on stdout once serving, with the real port when asked for port 0.
"""

from __future__ import annotations

import argparse
import random
import socket
import sys
from dataclasses import dataclass
from typing import Final

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.cluster_metadata import CONTROLLER_KEY
from services.controller.controller import Controller, ControllerConfig
from services.controller.offset_expiry import (
    OFFSETS_RETENTION_CHECK_INTERVAL_S,
    OFFSETS_RETENTION_MS,
)
from services.controller.server import ControllerServicer
from services.metastore import MetaStore
from services.process import bind, format_address, new_server, serve_until_signal
from tidelog import logging as tidelog_logging
from tidelog.errors import TidelogError
from tidelog.v1 import controller_pb2, controller_pb2_grpc

_log = structlog.get_logger("tidelog.controller.node")

CONTROLLER_SERVICE_NAME: Final[str] = controller_pb2.DESCRIPTOR.services_by_name[
    "Controller"
].full_name
MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
"""Largest request or response: Metadata of big clusters, explicit assignments."""
MAX_WORKERS: Final = 16
MAX_CONCURRENT_RPCS: Final = 256
"""Calls admitted at once; beyond it gRPC answers RESOURCE_EXHAUSTED instead of queueing."""
SHUTDOWN_GRACE_S: Final = 5.0
ETCD_TIMEOUT_S: Final = 5.0
"""Deadline of each etcd call; below the session TTL's default so a hung etcd is noticed."""


@dataclass(frozen=True, slots=True)
class ControllerNodeConfig:
    """How to run one controller process."""

    etcd: str
    controller_id: int
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    cluster: str = "default"
    session_ttl_s: int = 10
    imbalance_check_interval_s: float = 300.0
    offsets_retention_ms: int = OFFSETS_RETENTION_MS
    offsets_retention_check_interval_s: float = OFFSETS_RETENTION_CHECK_INTERVAL_S
    # The host standbys, gateways and brokers dial to reach this controller; None: the
    # listen host, or this machine's FQDN when listening on a wildcard.
    advertised_host: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.listen_port <= 65535:
            raise ValueError(f"port {self.listen_port} is out of range 0..65535")
        if self.session_ttl_s < 1:
            raise ValueError("--session-ttl-s must be >= 1")
        if self.imbalance_check_interval_s <= 0:
            raise ValueError("--imbalance-check-interval-s must be > 0")
        if self.offsets_retention_ms < 1 or self.offsets_retention_check_interval_s <= 0:
            raise ValueError("--offsets-retention-ms and its check interval must be > 0")


class ControllerNode:
    """One running controller process. ``start()`` once, ``stop()`` once (idempotent).

    Thread-safety: ``start``/``stop`` from the owner thread; everything else runs on gRPC
    pool threads and the Controller's own threads.
    """

    def __init__(self, config: ControllerNodeConfig) -> None:
        self.config = config
        self._health = health.HealthServicer()
        self._server: grpc.Server | None = None
        self._store: MetaStore | None = None
        self._controller: Controller | None = None
        self._port = 0
        self._stopped = False

    @property
    def address(self) -> str:
        host = self.config.advertised_host or self.config.listen_host
        if host in ("0.0.0.0", "::", ""):
            # A wildcard is not an address others can dial; advertise the host name.
            host = socket.getfqdn()
        return format_address(host, self._port)

    @property
    def controller(self) -> Controller:
        if self._controller is None:
            raise RuntimeError("the node is not started")
        return self._controller

    def start(self) -> None:
        config = self.config
        store = MetaStore(config.etcd, cluster=config.cluster, timeout_s=ETCD_TIMEOUT_S)
        try:
            # Fail like a storage node or a gateway: a controller that cannot reach etcd
            # at start-up is misconfigured (or etcd is not up yet, and its supervisor
            # restarts it); serving, it would report SERVING while campaigning in vain.
            store.get(CONTROLLER_KEY)
        except BaseException:
            store.close()
            raise
        self._store = store
        server = new_server(
            role="controller",
            max_workers=MAX_WORKERS,
            max_message_bytes=MAX_MESSAGE_BYTES,
            max_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        )
        port = bind(server, config.listen_host, config.listen_port)
        self._port = port
        self._controller = Controller(
            store,
            ControllerConfig(
                controller_id=config.controller_id,
                advertised_address=self.address,
                session_ttl_s=config.session_ttl_s,
                imbalance_check_interval_s=config.imbalance_check_interval_s,
                offsets_retention_ms=config.offsets_retention_ms,
                offsets_retention_check_interval_s=config.offsets_retention_check_interval_s,
            ),
        )
        controller_pb2_grpc.add_ControllerServicer_to_server(
            ControllerServicer(self._controller), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (CONTROLLER_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        server.start()
        self._server = server
        self._controller.start()
        for service in ("", CONTROLLER_SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        _log.info("listening", address=self.address, controller_id=config.controller_id)

    def stop(self) -> None:
        """Resign (a standby takes over now), then stop serving and close etcd."""
        if self._stopped:
            return
        self._stopped = True
        _log.info("stopping")
        self._health.enter_graceful_shutdown()
        if self._controller is not None:
            self._controller.stop()
        if self._server is not None:
            self._server.stop(SHUTDOWN_GRACE_S).wait(SHUTDOWN_GRACE_S + 1)
        if self._store is not None:
            self._store.close()
        _log.info("stopped")


def main(args: argparse.Namespace) -> int:
    """Run a controller until SIGTERM/SIGINT; the ``tidelog controller`` command.

    ``args`` carries ``etcd``, ``listen_host``, ``listen_port``, ``controller_id`` (None:
    a random positive id), ``cluster``, ``session_ttl_s``, ``imbalance_check_interval_s``
    and ``log_level`` (see ``tidelog.cli``). Returns the exit status.
    """
    # A random id distinguishes controllers in logs and in the election key; ids only need
    # to differ between processes, and 2^31 makes a clash vanishingly unlikely.
    controller_id = (
        args.controller_id if args.controller_id is not None else random.randint(1, 2**31 - 1)
    )
    tidelog_logging.configure("controller", level=args.log_level, controller_id=controller_id)
    tidelog_logging.capture_process_output()
    try:
        config = ControllerNodeConfig(
            etcd=args.etcd,
            controller_id=controller_id,
            listen_host=args.listen_host,
            listen_port=args.listen_port,
            cluster=args.cluster,
            session_ttl_s=args.session_ttl_s,
            imbalance_check_interval_s=args.imbalance_check_interval_s,
            offsets_retention_ms=args.offsets_retention_ms,
            offsets_retention_check_interval_s=args.offsets_retention_check_interval_s,
            advertised_host=getattr(args, "advertised_host", None),
        )
    except (ValueError, TidelogError) as exc:
        print(f"tidelog controller: error: {exc}", file=sys.stderr)
        return 2
    return serve_until_signal(
        "controller",
        ControllerNode(config),
        f"tidelog controller {controller_id} listening on {{address}}",
    )
