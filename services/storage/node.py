"""A storage node process: the Storage service, health, reflection and housekeeping.

``StorageNode(config).start()`` loads (and recovers) the logs in the data directory,
serves ``tidelog.v1.Storage`` plus the standard gRPC health and reflection services, and
runs one maintenance thread (flush.ms flushes, retention, recovery-point checkpoints).
``stop()`` is the clean shutdown: stop taking calls, let calls in progress finish within
a grace period, then flush every log and write the checkpoints so the next start has
nothing to recover.

``main(args)`` is what ``tidelog storage`` runs: it adds logging and signal handling
(SIGTERM / SIGINT -> clean stop, exit status 0) and prints the line
``tidelog storage broker <id> listening on <host>:<port>`` on stdout once serving, with
the real port when asked for port 0.

A disk failure under the data directory (EIO, ENOSPC... from a write, fsync or read,
``services/storage/log/log.py``) halts the process at once with status
``EXIT_DISK_FAILURE``, as Kafka halts a broker whose only log directory went offline: no
acknowledgement can follow a write whose fate is unknown, leadership moves to the other
replicas when the registration lease expires, and the restart recovers from the disk.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import resource
import socket
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.cluster_metadata import (
    CLUSTER_ID_KEY,
    CONTROLLER_KEY,
    broker_key,
    decode_broker,
    decode_cluster_id,
    decode_controller,
    encode_cluster_id,
)
from services.controller.state import Broker
from services.metastore import MetaStore, MetaStoreError
from services.process import (
    CountingThreadPool,
    add_servicer_answering_encoded,
    bind,
    new_server,
    serve_until_signal,
)
from services.status import error_from_proto, error_from_rpc_error
from services.storage.log import LogConfig
from services.storage.log.log import is_disk_failure
from services.storage.log_manager import LogManager
from services.storage.meta_properties import (
    check_identity,
    read_meta_properties,
    write_meta_properties,
)
from services.storage.registration import BrokerRegistration
from services.storage.replication import IsrProposal
from services.storage.server import (
    IsrOutcomeView,
    ReplicaManager,
    ServerLimits,
    StorageServicer,
)
from tidelog import logging as tidelog_logging
from tidelog.addresses import format_host_port
from tidelog.clock import SYSTEM_CLOCK, Clock
from tidelog.errors import BrokerNotAvailableError, StorageError, TidelogError
from tidelog.formats import MAX_PRODUCE_REQUEST_BYTES, REQUEST_OVERHEAD_BYTES
from tidelog.stop_flag import StopFlag
from tidelog.v1 import controller_pb2, controller_pb2_grpc, storage_pb2, storage_pb2_grpc

_log = structlog.get_logger("tidelog.storage.node")

EXIT_DISK_FAILURE: Final = 3
"""Exit status of a storage node halted by a disk failure (see the module docstring)."""
EXIT_BROKER_ID_TAKEN: Final = 4
"""Exit status of a storage node that lost its registration (paused past its lease, or
cut off from etcd) while another live process registered its broker id: it halts, since
two brokers with one id would both answer for that id's partitions. Restarted, it waits
for the id as at any start, and fails while the other holds it."""

STORAGE_SERVICE_NAME: Final[str] = storage_pb2.DESCRIPTOR.services_by_name["Storage"].full_name

# gRPC's defaults (4 MiB in) are too small for batch traffic; both directions are set
# explicitly so a Fetch answer (ServerLimits.max_fetch_response_bytes) always fits, and so
# that an Append (or AppendMany) of a produce request the gateway took (up to
# MAX_PRODUCE_REQUEST_BYTES) does: at 64 MiB, 72 MB of a partition's records the gateway
# had accepted were refused here (found by an audit).
DEFAULT_MAX_MESSAGE_BYTES: Final = MAX_PRODUCE_REQUEST_BYTES + REQUEST_OVERHEAD_BYTES
ALTER_PARTITION_TIMEOUT_S: Final = 2.0
DATA_DIR_LOCK: Final = ".lock"
FETCH_SPARE_THREADS: Final = 8
"""Threads of the fetch pool beyond the fetches that may wait: they answer those that do
not (data already there, an error, the waiting places full)."""
"""The file a running storage node holds an exclusive flock on, in its data directory."""


@dataclass(frozen=True, slots=True)
class StorageNodeConfig:
    """How to run one storage node. Durations in ms, sizes in bytes."""

    broker_id: int
    data_dir: Path
    # Address to bind; port 0 lets the OS choose (see StorageNode.port).
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    # etcd endpoint(s): when set, the broker registers under brokers/<id> with a lease and
    # takes part in the cluster (controller, controlled shutdown). None: standalone.
    etcd: str | None = None
    cluster: str = "default"
    rack: str | None = None
    # The host other processes dial to reach this node (Kafka's advertised.listeners);
    # None: the listen host, or this machine's FQDN when listening on a wildcard.
    advertised_host: str | None = None
    # Registration lease TTL: a broker silent this long is declared dead by the controller.
    session_ttl_s: int = 10
    # How long SIGTERM waits for the controller to move this broker's leaderships away.
    controlled_shutdown_timeout_s: float = 30.0
    # Overrides every topic's replica.lag.time.max.ms (None: the topic's, else 30000).
    replica_lag_time_max_ms: int | None = None
    # Pool threads serving calls other than Fetch. Append streams and acks=all appends
    # waiting for the HW hold a thread each. Fetches run on a pool of their own
    # (ServerLimits.max_waiting_fetches + FETCH_SPARE_THREADS), so waiting appends can
    # never take the threads the followers' fetches need to move the HW.
    max_workers: int = 64
    # Calls admitted at once (running + queued for a thread); beyond this gRPC answers
    # RESOURCE_EXHAUSTED instead of queueing without bound.
    max_concurrent_rpcs: int = 1024
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # How often the maintenance pass runs (flush.ms flushes, the ISR pass), and how often
    # it also writes the recovery-point checkpoint (a restart re-verifies only data after
    # it), applies retention (Kafka's log.retention.check.interval.ms, 5 min) and forgets
    # expired producers (producer.id.expiration.check.interval.ms, 10 min). Retention and
    # producer expiry visit every log: at every 250 ms pass they cost a broker with
    # thousands of partitions a good part of a core while idle (BENCHMARKS.md, scale).
    maintenance_interval_ms: int = 250
    checkpoint_interval_ms: int = 5_000
    log_retention_check_interval_ms: int = 300_000
    producer_id_expiration_check_interval_ms: int = 600_000
    # How long calls in progress may run on after stop() before they are cancelled.
    shutdown_grace_ms: int = 5_000
    limits: ServerLimits = field(default_factory=ServerLimits)
    log_config: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        if self.broker_id < 0:
            raise ValueError(f"broker id must be >= 0, got {self.broker_id}")
        if not 0 <= self.listen_port <= 65535:
            raise ValueError(f"port {self.listen_port} is out of range 0..65535")
        if self.max_workers < self.limits.max_append_streams + 4:
            raise ValueError(
                "max_workers must exceed max_append_streams by at least 4, so that unary "
                "calls always find a thread"
            )
        for name in (
            "max_concurrent_rpcs",
            "max_message_bytes",
            "maintenance_interval_ms",
            "checkpoint_interval_ms",
            "log_retention_check_interval_ms",
            "producer_id_expiration_check_interval_ms",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.shutdown_grace_ms < 0:
            raise ValueError("shutdown_grace_ms must be >= 0")
        if self.session_ttl_s < 1:
            raise ValueError("session_ttl_s must be >= 1")
        if self.limits.max_fetch_response_bytes > self.max_message_bytes:
            raise ValueError("max_fetch_response_bytes must not exceed max_message_bytes")


class StorageNode:
    """One running storage node. ``start()`` once, ``stop()`` once (idempotent).

    Thread-safety: ``start``/``stop`` are called by the owner thread; the gRPC pool
    threads and the maintenance thread only reach shared state through ReplicaManager.
    """

    def __init__(self, config: StorageNodeConfig, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self._clock = clock
        self._server: grpc.Server | None = None
        self._health = health.HealthServicer()
        self._replicas: ReplicaManager | None = None
        self._servicer: StorageServicer | None = None
        self._fetch_pool: CountingThreadPool | None = None
        self._port = 0
        self._stopping = threading.Event()
        self._maintenance_thread: threading.Thread | None = None
        self._store: MetaStore | None = None
        self._start_abort: StopFlag | None = None
        self._registration: BrokerRegistration | None = None
        self._stopped = False
        self._dir_lock: IO[str] | None = None

    @property
    def port(self) -> int:
        """The bound port (the real one when the config asked for port 0)."""
        return self._port

    @property
    def address(self) -> str:
        return format_host_port(self.config.listen_host, self._port)

    @property
    def replicas(self) -> ReplicaManager:
        if self._replicas is None:
            raise RuntimeError("the node is not started")
        return self._replicas

    def fetch_sessions(self) -> int:
        """Followers' fetch sessions this node holds as leader (observability, tests)."""
        return self._servicer.fetch_sessions() if self._servicer is not None else 0

    def start(self) -> None:
        """Recover the logs, bind, serve, report SERVING. Raises OSError if it cannot bind,
        StorageError if another storage node holds the data directory."""
        config = self.config
        self._lock_data_dir()
        self._check_data_dir_identity()
        log_manager = LogManager(
            config.data_dir, config.log_config, clock=self._clock, on_disk_failure=_halt
        )
        replicas = ReplicaManager(
            log_manager,
            broker_id=config.broker_id,
            clock=self._clock,
            resolve=self._resolve_broker,
            alter_partition=self._send_alter_partition if config.etcd else None,
            replica_lag_time_max_ms=config.replica_lag_time_max_ms,
            requires_registration=bool(config.etcd),
        )
        started_ms = time.monotonic()
        replicas.startup()
        if self._start_aborted():
            replicas.shutdown()
            raise BrokerNotAvailableError("stopped while loading the logs")
        self._replicas = replicas
        _log.info(
            "logs_loaded",
            data_dir=str(config.data_dir),
            partitions=len(replicas.partitions()),
            elapsed_ms=round((time.monotonic() - started_ms) * 1000),
        )
        # Fetches have threads of their own: acks=all appends wait for the HW on pool
        # threads, and only followers' fetches move it. Sharing one pool, enough waiting
        # appends left no thread for those fetches, and every append waited out its
        # timeout. Waiting fetches are bounded by ServerLimits; the spare threads answer
        # the fetches that do not wait.
        self._fetch_pool = CountingThreadPool(
            max_workers=config.limits.max_waiting_fetches + FETCH_SPARE_THREADS,
            thread_name_prefix="storage-fetch",
        )
        server = new_server(
            role="storage",
            max_workers=config.max_workers,
            max_message_bytes=config.max_message_bytes,
            max_concurrent_rpcs=config.max_concurrent_rpcs,
            method_pools=(self._fetch_pool,),
        )
        self._servicer = StorageServicer(replicas, limits=config.limits, clock=self._clock)
        add_servicer_answering_encoded(
            storage_pb2_grpc.add_StorageServicer_to_server,
            self._servicer,
            server,
            {"Fetch": (self._servicer.Fetch, storage_pb2.FetchRequest.FromString)},
            pools={"Fetch": self._fetch_pool},
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (STORAGE_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        try:
            port = bind(server, config.listen_host, config.listen_port)
        except OSError:
            replicas.shutdown()
            raise
        self._port = port
        for service in ("", STORAGE_SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        server.start()
        self._server = server
        self._maintenance_thread = threading.Thread(
            target=self._maintenance_loop, name="storage-maintenance", daemon=True
        )
        self._maintenance_thread.start()
        _log.info("listening", address=self.address)
        if config.etcd:
            self._register(replicas)
        # SERVING once in the cluster: a node waiting out its previous incarnation's
        # registration (up to two TTLs) has no broker epoch yet, and readiness probes
        # passed for it while it was in no cluster at all.
        for service in ("", STORAGE_SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def _resolve_broker(self, broker_id: int) -> str | None:
        """A broker's address: the UpdateMetadata cache, else its registration in etcd."""
        replicas = self._replicas
        if replicas is not None:
            found = replicas.metadata.brokers.get(broker_id)
            if found is not None:
                return format_host_port(found.host, found.port)
        store = self._store
        if store is None:
            return None
        try:
            kv = store.get(broker_key(broker_id))
        except MetaStoreError:
            return None
        if kv is None:
            return None
        broker = decode_broker(kv)
        return format_host_port(broker.host, broker.port)

    def _send_alter_partition(
        self, broker_epoch: int, items: Sequence[tuple[str, int, IsrProposal]]
    ) -> list[IsrOutcomeView]:
        """AlterPartition to the active controller (found through etcd)."""
        store = self._store
        if store is None:
            raise BrokerNotAvailableError("not registered in a cluster")
        found = store.get(CONTROLLER_KEY)
        if found is None:
            raise BrokerNotAvailableError("no active controller")
        address = decode_controller(found).address
        request = controller_pb2.AlterPartitionRequest(
            broker_id=self.config.broker_id,
            broker_epoch=broker_epoch,
            partitions=[
                controller_pb2.AlterPartitionItem(
                    topic=topic,
                    partition=partition,
                    leader_epoch=proposal.leader_epoch,
                    new_isr=list(proposal.new_isr),
                    partition_epoch=proposal.partition_epoch,
                    joining=[
                        controller_pb2.IsrMember(broker_id=b, broker_epoch=e)
                        for b, e in proposal.joining
                    ],
                )
                for topic, partition, proposal in items
            ],
        )
        with grpc.insecure_channel(address) as channel:
            stub = controller_pb2_grpc.ControllerStub(channel)
            try:
                response = stub.AlterPartition(request, timeout=ALTER_PARTITION_TIMEOUT_S)
            except grpc.RpcError as exc:
                raise error_from_rpc_error(exc) from None
        outcomes: list[IsrOutcomeView] = []
        for result in response.partitions:
            error = error_from_proto(result.error)
            if result.HasField("state"):
                outcomes.append((error, tuple(result.state.isr), result.state.partition_epoch))
            else:
                outcomes.append((error, None, -1))
        return outcomes

    def abort_start_on(self, flag: StopFlag) -> None:
        """Give up starting once ``flag`` is set (``serve_until_signal``'s signal flag):
        a SIGTERM during the wait for a previous registration used to let the node
        register, then run a whole controlled shutdown, half a minute after the signal."""
        self._start_abort = flag

    def _check_data_dir_identity(self) -> None:
        """Refuse a data directory of another broker id or cluster before any log opens
        (``meta_properties``): its logs would all look like strays, and be deleted."""
        config = self.config
        cluster_id = ""
        if config.etcd:
            self._store = MetaStore(config.etcd, cluster=config.cluster)
            cluster_id = _cluster_id(self._store)
        try:
            found = read_meta_properties(config.data_dir)
            meta = check_identity(
                found, broker_id=config.broker_id, cluster_id=cluster_id, data_dir=config.data_dir
            )
            if meta != found:
                write_meta_properties(config.data_dir, meta)
        except OSError as exc:
            # The data directory's disk failed (ENOSPC, EIO): its exit status, as for the
            # checkpoints and logs; it was any start-up error's, 1 (found by an audit).
            if is_disk_failure(exc):
                _halt(Path(config.data_dir), exc)
            raise

    def _start_aborted(self) -> bool:
        """Whether a stop came during start-up (``abort_start_on``). Checked after the logs
        are loaded and before registering too, not only while waiting out a previous
        registration: a SIGTERM during a long recovery let the node register, then run a
        whole controlled shutdown (found by an audit)."""
        return self._start_abort is not None and self._start_abort.is_set()

    def _register(self, replicas: ReplicaManager) -> None:
        """Join the cluster: register in etcd (waiting out a previous incarnation)."""
        if self._start_aborted():
            self.stop()
            raise BrokerNotAvailableError("stopped before registering")
        config = self.config
        if self._store is None:
            self._store = MetaStore(config.etcd or "", cluster=config.cluster)
        host = config.advertised_host or config.listen_host
        if host in ("0.0.0.0", "::", ""):
            host = socket.getfqdn()  # a wildcard is not an address others can dial
        self._registration = BrokerRegistration(
            self._store,
            Broker(config.broker_id, host, self.port, config.rack or ""),
            ttl_s=config.session_ttl_s,
            on_epoch=replicas.set_broker_epoch,
            abort=self._start_abort,
            on_fatal=_halt_broker_id_taken,
        )
        try:
            self._registration.start()
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        """Clean shutdown: refuse new calls, drain, flush and checkpoint every log."""
        if self._stopped:
            return
        self._stopped = True
        _log.info("stopping")
        if self._registration is not None and self._registration.epoch > 0:
            # While still serving: leaderships move first, so producers fail over to
            # replicas that have everything instead of waiting out a session timeout.
            self._registration.controlled_shutdown(self.config.controlled_shutdown_timeout_s)
        if self._replicas is not None:
            # Leaderships moved (or will once the session ends): lead nothing more here,
            # rather than until a LeaderAndIsr that races the server's stop says so.
            resigned = self._replicas.stop_leading()
            if resigned:
                _log.info("stopped_leading", partitions=len(resigned))
        self._health.enter_graceful_shutdown()  # NOT_SERVING, so balancers move away first
        self._stopping.set()
        if self._server is not None:
            grace_s = self.config.shutdown_grace_ms / 1000
            drained = self._server.stop(grace_s)
            # Long-polls would otherwise sit out their max_wait_ms inside the grace period.
            if self._servicer is not None:
                self._servicer.begin_shutdown()
            drained.wait(grace_s + 1)
        if self._fetch_pool is not None:
            self._fetch_pool.shutdown(wait=False)  # gRPC stops using it with the server
        if self._registration is not None:
            self._registration.stop()  # deregister at once rather than after a TTL
        if self._store is not None:
            self._store.close()
        if self._maintenance_thread is not None:
            self._maintenance_thread.join()
        if self._replicas is not None:
            self._replicas.shutdown()
        if self._dir_lock is not None:
            self._dir_lock.close()  # releases the flock
            self._dir_lock = None
        _log.info("stopped")

    def _lock_data_dir(self) -> None:
        """Hold ``<data_dir>/.lock`` (flock, exclusive) while running, as Kafka's
        ``.lock``: a second node on the same directory would recover, trim and append to
        the logs the first is writing. The kernel drops the lock when the process dies,
        kill -9 included."""
        data_dir = self.config.data_dir
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            lock = open(data_dir / DATA_DIR_LOCK, "a")  # noqa: SIM115 - held until stop()
        except OSError as exc:
            # The first file a start touches: a disk remounted read-only (EROFS) fails
            # here, and ended the node with a configuration error's status 1 where every
            # later file gives the failed disk's 3 (found by an audit).
            if is_disk_failure(exc):
                _halt(Path(data_dir), exc)
            raise
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise StorageError(
                f"data directory {data_dir} is in use by another storage node"
            ) from None
        self._dir_lock = lock

    def _maintenance_loop(self) -> None:
        config = self.config
        interval_s = config.maintenance_interval_ms / 1000
        checkpoint_due = _Every(config.checkpoint_interval_ms)
        retention_due = _Every(config.log_retention_check_interval_ms)
        expiry_due = _Every(config.producer_id_expiration_check_interval_ms)
        while not self._stopping.wait(interval_s):
            now = time.monotonic()
            # Never let housekeeping die: a failed step is logged and retried next tick,
            # and on its own, so that retention failing every time never stops the ISR
            # shrinking (acks=all would wait on a dead follower for ever).
            try:
                self.replicas.maintenance(
                    checkpoint=checkpoint_due(now),
                    retention=retention_due(now),
                    expire_producers=expiry_due(now),
                )
            except Exception:
                _log.exception("maintenance_failed")
            try:
                self.replicas.isr_pass()
            except Exception:
                _log.exception("isr_pass_failed")
            try:
                servicer = self._servicer
                if servicer is not None and (expired := servicer.expire_fetch_sessions()):
                    _log.info("fetch_sessions_expired", sessions=expired)
            except Exception:
                _log.exception("fetch_session_expiry_failed")


class _Every:
    """True once per ``interval_ms`` (monotonic seconds in, the first time one interval
    after it is made): the maintenance loop's slower steps."""

    def __init__(self, interval_ms: int) -> None:
        self._interval_s = interval_ms / 1000
        self._next = time.monotonic() + self._interval_s

    def __call__(self, now: float) -> bool:
        if now < self._next:
            return False
        self._next = now + self._interval_s
        return True


def main(args: argparse.Namespace) -> int:
    """Run a storage node until SIGTERM/SIGINT; the ``tidelog storage`` command.

    ``args`` carries ``broker_id``, ``data_dir``, ``listen_host``, ``listen_port``,
    ``etcd``, ``rack`` and ``log_level`` (see ``tidelog.cli``). Returns the exit status.
    """
    tidelog_logging.configure("storage", level=args.log_level, broker_id=args.broker_id)
    tidelog_logging.capture_process_output()
    try:
        max_waiting_fetches = getattr(args, "max_waiting_fetches", 32)
        limits = ServerLimits(
            max_append_streams=getattr(args, "max_append_streams", 16),
            max_waiting_fetches=max_waiting_fetches,
            # A quarter kept for followers: 8 of the default 32, enough for a follower
            # fetcher per other broker in most clusters.
            replica_fetch_reserve=max_waiting_fetches // 4,
        )
        config = StorageNodeConfig(
            broker_id=args.broker_id,
            data_dir=Path(args.data_dir),
            listen_host=args.listen_host,
            listen_port=args.listen_port,
            etcd=args.etcd,
            cluster=args.cluster,
            rack=args.rack,
            advertised_host=getattr(args, "advertised_host", None),
            session_ttl_s=args.session_ttl_s,
            controlled_shutdown_timeout_s=args.controlled_shutdown_timeout_s,
            replica_lag_time_max_ms=getattr(args, "replica_lag_time_max_ms", None),
            log_retention_check_interval_ms=getattr(
                args, "log_retention_check_interval_ms", 300_000
            ),
            max_concurrent_rpcs=getattr(args, "max_concurrent_rpcs", 1024),
            limits=limits,
            # Each open append stream holds a pool thread (fetches have a pool of their own).
            max_workers=max(64, limits.max_append_streams + 16),
        )
    except (ValueError, TidelogError) as exc:
        print(f"tidelog storage: error: {exc}", file=sys.stderr)
        return 2
    return serve_until_signal(
        "storage",
        StorageNode(config),
        f"tidelog storage broker {config.broker_id} listening on {{address}}",
    )


def _cluster_id(store: MetaStore) -> str:
    """etcd's cluster id, made here if no controller has yet (as the first broker of a
    ZooKeeper-era Kafka cluster did); ``create_if_absent``: exactly one id is ever made."""
    found = store.get(CLUSTER_ID_KEY)
    if found is None:
        store.create_if_absent(CLUSTER_ID_KEY, encode_cluster_id(uuid.uuid4().hex))
        found = store.get(CLUSTER_ID_KEY)
    if found is None:
        raise BrokerNotAvailableError("the cluster id could not be read from etcd")
    return decode_cluster_id(found)


def _halt_broker_id_taken(error: TidelogError) -> None:
    """Another live process holds this node's broker id (``EXIT_BROKER_ID_TAKEN``). A
    halt, not a stop: a controlled shutdown would move the other broker's leaderships.
    Nothing acknowledged is lost: written records are in the page cache, recovered on
    restart as after a kill -9."""
    _log.critical("broker_id_taken", error=str(error))
    sys.stderr.flush()
    os._exit(EXIT_BROKER_ID_TAKEN)


def _halt(failed: Path, error: OSError) -> None:
    """The log directory failed: halt now (see the module docstring). ``os._exit`` and not
    ``sys.exit``: nothing may run after this -- no clean shutdown that flushes, writes
    checkpoints or answers waiting producers."""
    hint = ""
    if error.errno in (errno.EMFILE, errno.ENFILE):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        hint = (
            f"out of file descriptors (limit {soft}, hard {hard}): a storage node holds about "
            "three per segment; raise the hard limit (ulimit -Hn, LimitNOFILE=, the "
            "container's nofile) before restarting it"
        )
    _log.critical("log_dir_failed", log_dir=str(failed), error=str(error), hint=hint or None)
    sys.stderr.flush()
    os._exit(EXIT_DISK_FAILURE)
