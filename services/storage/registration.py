"""A storage node's registration in etcd, and its controlled shutdown.

The broker's liveness, as the controller sees it, is the key ``brokers/<id>`` bound to a
lease the broker keeps alive (refresh every TTL/3). If the process dies or hangs, the
lease expires, etcd deletes the key, and the controller moves the broker's leaderships.

The broker epoch is the key's create revision: each incarnation gets a new, larger one,
so requests meant for an older incarnation (from the controller) or sent by one (to the
controller) can be told apart and refused (Kafka's KIP-380).

Rules:
- A registration is created only if the key is absent: a previous incarnation's key
  (still alive until its lease runs out after a kill -9) is waited for, never
  overwritten; a key held by another live process past that wait is an error.
- After losing the lease (etcd unreachable for a TTL, or the process paused past it),
  the broker registers again as a new incarnation, with a new epoch. If another live
  process took the id meanwhile (a replacement started while this one was paused), the
  same wait as at start applies, and past it ``on_fatal`` is told: the node halts rather
  than keep trying for ever and take the id back when the other restarts.

Thread-safety: ``start``/``stop`` from the owner thread; the keepalive and re-register
work happens on the LeaseKeeper's thread and one re-registration thread. ``_lock`` makes
"adopt a lease" and "stop" exclusive, so a re-registration finishing while the node stops
either is revoked by ``stop`` or sees the stop and revokes its own lease: no registration
outlives ``stop`` (it used to stay alive, kept by a fresh keeper, until the process left).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable

import grpc
import structlog

from services.cluster_metadata import (
    CONTROLLER_KEY,
    broker_key,
    decode_broker,
    decode_controller,
    encode_broker,
)
from services.controller.state import Broker
from services.metastore import Lease, LeaseKeeper, LeaseLostError, MetaStore, MetaStoreError
from services.status import error_from_rpc_error
from tidelog.errors import BrokerNotAvailableError, TidelogError
from tidelog.stop_flag import StopFlag
from tidelog.v1 import common_pb2, controller_pb2, controller_pb2_grpc

_log = structlog.get_logger("tidelog.storage.registration")

CONTROLLED_SHUTDOWN_TIMEOUT_S = 30.0
"""How long a stopping broker keeps asking the controller to move its leaderships."""
CONTROLLED_SHUTDOWN_RPC_TIMEOUT_S = 5.0
RETRY_BACKOFF_S = 0.25


class _HolderWait:
    """How long a registration waits for the key's holder to go: two TTLs, or what is
    left of the holder's lease if longer (a previous incarnation may have had a longer
    TTL: --session-ttl-s lowered between restarts), looked up at the first try."""

    def __init__(self, store: MetaStore, ttl_s: int) -> None:
        self._store = store
        self._deadline = time.monotonic() + 2 * ttl_s + 2
        self._looked_at_holder = False

    def expired(self, key: str, broker_id: int) -> BrokerNotAvailableError | None:
        """None while the wait goes on; the error to report once it is over."""
        holder = self._store.get(key)
        if holder is not None and not self._looked_at_holder:
            self._looked_at_holder = True
            left_s = self._store.lease_remaining_s(holder.lease_id)
            if left_s is not None:
                self._deadline = max(self._deadline, time.monotonic() + left_s + 2)
        if time.monotonic() <= self._deadline:
            return None
        where = ""
        if holder is not None:
            other = decode_broker(holder)
            where = f" by {other.host}:{other.port}"
        return BrokerNotAvailableError(
            f"broker id {broker_id} is registered{where} by another live process; broker "
            "ids must be unique"
        )


class BrokerRegistration:
    """Keeps ``brokers/<id>`` registered while the node runs; see the module docstring."""

    def __init__(
        self,
        store: MetaStore,
        broker: Broker,
        *,
        ttl_s: int,
        on_epoch: Callable[[int], None],
        abort: StopFlag | None = None,
        on_fatal: Callable[[TidelogError], None] | None = None,
    ) -> None:
        self._store = store
        self._broker = broker
        self._ttl_s = ttl_s
        self._on_epoch = on_epoch
        self._on_fatal = on_fatal  # the id is another live process's (see the module doc)
        self._abort = abort  # set by a signal handler: ``start`` gives up waiting
        self._lease: Lease | None = None
        self._keeper: LeaseKeeper | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # guards _lease/_keeper against stop(); see module doc
        self._reregister_thread: threading.Thread | None = None
        self.epoch = -1

    @property
    def key(self) -> str:
        return broker_key(self._broker.broker_id)

    def start(self) -> int:
        """Register, waiting up to two TTLs for a previous incarnation's key to expire."""
        wait = _HolderWait(self._store, self._ttl_s)
        while not self._register_once():
            error = wait.expired(self.key, self._broker.broker_id)
            if error is not None:
                raise error
            _log.info("waiting_for_previous_registration", broker_id=self._broker.broker_id)
            if self._abort is not None:  # a StopFlag: its wait lets signal handlers run
                stopped = self._abort.wait(RETRY_BACKOFF_S) or self._stopping.is_set()
            else:
                stopped = self._stopping.wait(RETRY_BACKOFF_S)
            if stopped:
                raise BrokerNotAvailableError("stopped while registering")
        return self.epoch

    def _register_once(self) -> bool:
        lease = self._store.grant_lease(self._ttl_s)
        if not self._store.create_if_absent(self.key, encode_broker(self._broker), lease=lease):
            lease.revoke()
            return False
        try:
            created = self._store.get(self.key)
            if created is None or created.lease_id != lease.id:
                lease.revoke()  # expired between the create and the read: try again
                return False
            self.epoch = created.create_revision
            # Record the epoch in the value for people reading etcd; the create revision
            # stays the authority, so losing this write changes nothing.
            self._store.compare_and_swap(
                self.key,
                created.mod_revision,
                encode_broker(dataclasses.replace(self._broker, epoch=self.epoch)),
                lease=lease,
            )
        except BaseException:
            # Not kept alive by anyone: revoked now, or the key of a registration that
            # failed stayed live for a TTL, a broker the controller counted on (found by
            # an audit). If etcd is away the revoke fails too, and the TTL ends it.
            with contextlib.suppress(MetaStoreError):
                lease.revoke()
            raise
        with self._lock:
            if self._stopping.is_set():
                # stop() came while this registration was being made: undo it, and report
                # done so that no caller tries again.
                with contextlib.suppress(MetaStoreError):
                    lease.revoke()
                return True
            self._lease = lease
            self._keeper = LeaseKeeper(lease, on_lost=self._lease_lost).start()
        self._on_epoch(self.epoch)
        _log.info("registered", broker_id=self._broker.broker_id, broker_epoch=self.epoch)
        return True

    def _lease_lost(self, error: MetaStoreError) -> None:
        if self._stopping.is_set():
            return
        _log.warning(
            "registration_lost",
            broker_id=self._broker.broker_id,
            broker_epoch=self.epoch,
            error=str(error),
        )
        self._reregister_thread = threading.Thread(
            target=self._reregister, name="broker-reregister", daemon=True
        )
        self._reregister_thread.start()

    def _reregister(self) -> None:
        old = self._lease
        wait: _HolderWait | None = None
        while not self._stopping.is_set():
            try:
                if old is not None:
                    if self._keep(old):
                        return
                    old = None  # gone for good: register anew
                if self._register_once():
                    return
                # Held by another lease: a previous incarnation's is waited out as at
                # start; past that the id is another live process's. Trying on for ever,
                # silently, this node took the id back when that one restarted (found by
                # an audit).
                if wait is None:
                    wait = _HolderWait(self._store, self._ttl_s)
                    _log.warning("reregister_waiting", broker_id=self._broker.broker_id)
                error = wait.expired(self.key, self._broker.broker_id)
                if error is not None:
                    _log.error(
                        "broker_id_taken", broker_id=self._broker.broker_id, error=str(error)
                    )
                    if self._on_fatal is not None:
                        self._on_fatal(error)
                    return
            except MetaStoreError as exc:
                _log.warning("reregister_failed", error=str(exc))
            except Exception:
                # Anything else must not end this thread silently: the node would stay
                # out of the cluster for good, serving nothing it is asked to lead.
                _log.exception("reregister_failed")
            self._stopping.wait(RETRY_BACKOFF_S)

    def _keep(self, lease: Lease) -> bool:
        """Whether the registration under ``lease`` is still in force (then kept alive
        again, same epoch). A lease "lost" because etcd was away longer than its TTL is
        restored by etcd when it comes back, with a fresh TTL, and the key with it: a new
        registration would first have waited that TTL out, and then dropped this broker
        and re-registered it under a new epoch. Raises MetaStoreError while etcd is away."""
        try:
            lease.refresh()
        except LeaseLostError:
            return False
        holder = self._store.get(self.key)
        if holder is None or holder.lease_id != lease.id:
            with contextlib.suppress(MetaStoreError):
                lease.revoke()
            return False
        with self._lock:
            if self._stopping.is_set():
                with contextlib.suppress(MetaStoreError):
                    lease.revoke()
                return True  # stopping: deregistered, nothing to keep alive
            self._keeper = LeaseKeeper(lease, on_lost=self._lease_lost).start()
        _log.info("registration_kept", broker_id=self._broker.broker_id, broker_epoch=self.epoch)
        return True

    def controlled_shutdown(self, timeout_s: float = CONTROLLED_SHUTDOWN_TIMEOUT_S) -> bool:
        """Ask the active controller to move this broker's leaderships away first.

        Retries (the controller may be changing, or still electing leaders) until the
        controller reports nothing left or ``timeout_s`` passes. True when nothing is left.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                remaining = self._ask_controller(deadline)
            except (TidelogError, grpc.RpcError) as exc:
                _log.info("controlled_shutdown_retry", error=str(exc))
            else:
                if not remaining:
                    _log.info("controlled_shutdown_done", broker_id=self._broker.broker_id)
                    return True
                _log.info("controlled_shutdown_pending", remaining=len(remaining))
            time.sleep(max(0.0, min(RETRY_BACKOFF_S, deadline - time.monotonic())))
        _log.warning("controlled_shutdown_timed_out", broker_id=self._broker.broker_id)
        return False

    def _ask_controller(self, deadline: float) -> list[common_pb2.TopicPartition]:
        # Each call gets what is left of the shutdown's time: a fixed 5 s for one to a
        # controller that accepts and never answers made a 1 s shutdown take 5 s, past a
        # supervisor's kill limit (found by an audit).
        found = self._store.get(CONTROLLER_KEY)
        if found is None:
            raise BrokerNotAvailableError("no active controller")
        address = decode_controller(found).address
        with grpc.insecure_channel(address) as channel:
            stub = controller_pb2_grpc.ControllerStub(channel)
            try:
                response = stub.ControlledShutdown(
                    controller_pb2.ControlledShutdownRequest(
                        broker_id=self._broker.broker_id, broker_epoch=self.epoch
                    ),
                    timeout=max(
                        0.001, min(CONTROLLED_SHUTDOWN_RPC_TIMEOUT_S, deadline - time.monotonic())
                    ),
                )
            except grpc.RpcError as exc:
                raise error_from_rpc_error(exc) from None
        if response.error.code:
            raise BrokerNotAvailableError(response.error.message)
        return list(response.remaining_partitions)

    def stop(self) -> None:
        """Deregister now (revoke the lease) so the controller reacts at once."""
        with self._lock:
            self._stopping.set()
            keeper, lease = self._keeper, self._lease
        if keeper is not None:
            keeper.stop()
        if lease is not None:
            try:
                lease.revoke()
            except MetaStoreError as exc:
                # Unreachable etcd: the lease expires by itself within a TTL.
                _log.warning("deregister_failed", error=str(exc))
