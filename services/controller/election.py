"""Controller election through etcd: one active controller, any number of standbys.

Every candidate runs the same loop (Kafka's ZooKeeper-era ``/controller`` znode, here an
etcd key bound to a lease):

1. Grant a lease (TTL = the session TTL) and try ``create_if_absent("controller", {id,
   address}, lease)`` as one transaction. Exactly one candidate wins: etcd serializes
   transactions.
2. The winner's **controller epoch** is the key's create revision (the transaction's
   revision). It keeps the lease alive with a ``LeaseKeeper`` and calls
   ``on_elected(epoch)``.
3. The others revoke their unused lease and watch the key; when it is deleted (the active
   controller's lease expired, or it resigned by revoking it) they go back to 1.
4. The active controller steps down at once when its lease is lost (the keeper reports it),
   when ``resign()`` is called (it learned it was deposed: a fenced write or a broker
   answering STALE_CONTROLLER_EPOCH) or at ``stop()``: it calls ``on_resigned()``, revokes
   the lease (so the key disappears now rather than after a TTL) and, unless stopping,
   campaigns again.

Holding the lease is not what makes a controller safe - it may be paused past the lease's
expiry and act believing it still holds it. Safety comes from the epoch checks the
receivers make (docs/METADATA.md §4): every controller write carries
``Guard("controller", create_revision=epoch)``, brokers reject older controller epochs.

Thread-safety: ``start``, ``stop`` from the owner thread; ``resign``, ``epoch``,
``known_controller`` from any thread. ``on_elected`` and ``on_resigned`` both run on the
election thread, so ``on_resigned`` never runs concurrently with itself or with
``on_elected``, and always after the matching ``on_elected`` returned or raised: a lease
lost during a long activation is acted on when the activation is over (the keeper's
thread used to call ``on_resigned`` at once, tearing down a term still being set up).
Epoch fencing keeps the activation's late writes harmless. Callbacks must not call
``stop()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Final

import structlog

from services.cluster_metadata import (
    CONTROLLER_KEY,
    ControllerInfo,
    decode_controller,
    encode_controller,
)
from services.metastore import (
    Compare,
    GetOp,
    GetResult,
    KeyValue,
    Lease,
    LeaseKeeper,
    MetaStore,
    MetaStoreError,
    PutOp,
    WatchEvent,
)
from tidelog.errors import TidelogError

_log = structlog.get_logger("tidelog.controller.election")

RETRY_BACKOFF_S: Final = 0.5
"""Pause after a failed campaign (etcd unreachable) before trying again."""
_POLL_S: Final = 0.1
"""How often a waiting standby re-checks whether it is being stopped."""


class ControllerElection:
    """Campaigns for the controller key until stopped; see the module docstring.

    Invariants: at most one term is active at a time; ``on_resigned`` is called exactly
    once per ``on_elected``; while a term is active its lease is kept alive, and after it
    ends the lease is revoked (best effort: an unreachable etcd expires it after a TTL).
    """

    def __init__(
        self,
        store: MetaStore,
        *,
        controller_id: int,
        address: str,
        ttl_s: int,
        on_elected: Callable[[int], None],
        on_resigned: Callable[[], None],
    ) -> None:
        if ttl_s < 1:
            raise ValueError("the session TTL must be at least 1 s")
        self._store = store
        self.controller_id = controller_id
        self.address = address
        self.ttl_s = ttl_s
        self._on_elected = on_elected
        self._on_resigned = on_resigned
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        # Set whenever the active term must end (lease lost, resign, stop).
        self._wake = threading.Event()
        self._term = 0
        self._active_term: int | None = None
        self._epoch: int | None = None
        self._resign_requested: int | None = None
        # The term whose lease the keeper reported lost, and why.
        self._lost_term: int | None = None
        self._lost_reason = ""
        # The holder of the key as last seen (from a lost campaign or the watch).
        self._holder: ControllerInfo | None = None
        # A term's lease whose revoke failed (etcd away). Back from an outage longer than
        # the TTL, etcd restores it, and with it our own election key: revoked before the
        # next campaign, it no longer makes us wait a whole TTL for ourselves.
        self._unrevoked: Lease | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"controller-election-{controller_id}", daemon=True
        )

    # --- queries ------------------------------------------------------------------------

    @property
    def epoch(self) -> int | None:
        """This process's controller epoch while it is active, else None."""
        with self._lock:
            return self._epoch

    def known_controller(self) -> ControllerInfo | None:
        """The active controller: this one, the holder last seen, or (if none) etcd's answer."""
        with self._lock:
            if self._epoch is not None:
                return ControllerInfo(self.controller_id, self.address, self._epoch)
            holder = self._holder
        if holder is not None:
            return holder
        try:
            kv = self._store.get(CONTROLLER_KEY)
        except MetaStoreError:
            return None
        return decode_controller(kv) if kv is not None else None

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> ControllerElection:
        self._thread.start()
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """Resign (revoking the lease, so a standby takes over now) and stop campaigning."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s if timeout_s is not None else 2 * self._store.timeout_s + 2)

    def resign(self, epoch: int) -> None:
        """Step down from the term with ``epoch`` (if still in it) and campaign again.

        Asynchronous: the election thread calls ``on_resigned`` and revokes the lease, so
        this may be called with the caller's own locks held. A stale epoch is ignored.
        """
        with self._lock:
            if self._active_term is None or self._epoch != epoch:
                return
            self._resign_requested = self._active_term
        self._wake.set()

    # --- the campaign loop ----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._campaign_once()
            except (MetaStoreError, TidelogError) as exc:
                _log.warning("campaign_failed", controller_id=self.controller_id, error=str(exc))
                self._stopping.wait(RETRY_BACKOFF_S)
            except Exception:
                _log.exception("campaign_crashed", controller_id=self.controller_id)
                self._stopping.wait(RETRY_BACKOFF_S)

    def _campaign_once(self) -> None:
        if self._unrevoked is not None:
            self._unrevoked.revoke()  # MetaStoreError while etcd is away: try again later
            self._unrevoked = None
        lease = self._store.grant_lease(self.ttl_s)
        try:
            result = self._store.txn(
                [Compare.absent(CONTROLLER_KEY)],
                [PutOp(CONTROLLER_KEY, encode_controller(self.controller_id, self.address), lease)],
                [GetOp(CONTROLLER_KEY)],
            )
        except MetaStoreError:
            self._revoke(lease)
            raise
        if not result.succeeded:
            self._revoke(lease)
            found = result.responses[0]
            holder = found.kvs[0] if isinstance(found, GetResult) and found.kvs else None
            self._wait_for_vacancy(holder, result.revision)
            return
        # The transaction created the key, so its revision is the key's create revision.
        self._serve_term(lease, epoch=result.revision)

    def _serve_term(self, lease: Lease, epoch: int) -> None:
        with self._lock:
            self._term += 1
            term = self._term
            self._active_term = term
            self._epoch = epoch
            self._resign_requested = None
            self._holder = None
            # Not when stopping: a stop() between the campaign and here set _wake for the
            # loop below, and clearing it left that loop waiting for ever with the key
            # held and its lease kept alive (found by an audit).
            if not self._stopping.is_set():
                self._wake.clear()
        _log.info("elected", controller_id=self.controller_id, epoch=epoch, lease=f"{lease.id:x}")
        keeper = LeaseKeeper(
            lease, on_lost=lambda error: self._lease_lost(term, f"lease lost: {error}")
        ).start()
        activated = False
        try:
            if not self._stopping.is_set():
                self._on_elected(epoch)
            activated = True
        except (MetaStoreError, TidelogError) as exc:
            # Expected failures (etcd away, a malformed metadata key): one line naming it.
            _log.error(
                "activation_failed", controller_id=self.controller_id, epoch=epoch, error=str(exc)
            )
            self._step_down(term, "activation failed")
        except Exception:
            _log.exception("activation_failed", controller_id=self.controller_id, epoch=epoch)
            self._step_down(term, "activation failed")
        while True:
            self._wake.wait()
            with self._lock:
                if (
                    self._stopping.is_set()
                    or self._active_term != term
                    or term in (self._resign_requested, self._lost_term)
                ):
                    break
                self._wake.clear()
        if self._stopping.is_set():
            reason = "stopping"
        elif self._lost_term == term:
            reason = self._lost_reason
        else:
            reason = "resigned"
        self._step_down(term, reason)
        keeper.stop()
        # Delete the key now instead of after a TTL, so a standby takes over at once.
        self._revoke(lease)
        if not activated:
            # What failed the activation (a malformed key) usually fails the next one too:
            # pause rather than re-elect and re-read the whole cluster in a hot loop.
            self._stopping.wait(RETRY_BACKOFF_S)

    def _lease_lost(self, term: int, reason: str) -> None:
        """The keeper's report (on its thread): the election thread steps down."""
        with self._lock:
            if self._active_term != term:
                return
            self._lost_term = term
            self._lost_reason = reason
        self._wake.set()

    def _step_down(self, term: int, reason: str) -> None:
        with self._lock:
            if self._active_term != term:
                return
            epoch = self._epoch
            self._active_term = None
            self._epoch = None
        _log.info("resigned", controller_id=self.controller_id, epoch=epoch, reason=reason)
        try:
            self._on_resigned()
        except Exception:
            _log.exception("resign_callback_failed", controller_id=self.controller_id)
        self._wake.set()

    def _wait_for_vacancy(self, holder: KeyValue | None, read_revision: int) -> None:
        """Block until the controller key read as ``holder`` at ``read_revision`` is
        deleted (or we stop).

        The watch starts after ``read_revision``, not after the holder's own revision: the
        key is written once, so that is the term's first revision, which etcd's periodic
        compaction removes an hour or so into the term. Every watch from it was then
        cancelled at once (compacted), and a standby campaigned again ten times a second
        for as long as the active controller lived: lease grants, revokes and log lines
        (found by an audit)."""
        if holder is None:
            return  # deleted between the transaction's compare and its read: try again
        info = decode_controller(holder)
        with self._lock:
            self._holder = info
        _log.info(
            "standing_by",
            controller_id=self.controller_id,
            active_controller=info.controller_id,
            active_address=info.address,
            epoch=info.epoch,
        )
        vacated = threading.Event()

        def on_event(event: WatchEvent) -> None:
            if event.key != CONTROLLER_KEY:
                return  # another key under the same prefix ("controller..." names)
            if event.type == "delete":
                with self._lock:
                    self._holder = None
                vacated.set()

        failed: list[MetaStoreError] = []

        def on_error(error: MetaStoreError) -> None:
            # The watch is over; campaigning again re-reads the key and watches anew.
            failed.append(error)
            vacated.set()

        cancel = self._store.watch_prefix(
            CONTROLLER_KEY,
            on_event,
            on_error=on_error,
            start_revision=read_revision + 1,
        )
        try:
            while not vacated.wait(_POLL_S):
                if self._stopping.is_set():
                    return
        finally:
            cancel()
        if failed:
            # Whatever broke the watch may break the next one: pause, not a hot loop.
            self._stopping.wait(RETRY_BACKOFF_S)

    def _revoke(self, lease: Lease) -> None:
        try:
            lease.revoke()
        except MetaStoreError as exc:
            # Unreachable etcd: the lease expires by itself within a TTL of etcd's return,
            # unless the next campaign revokes it first.
            _log.warning("lease_revoke_failed", lease=f"{lease.id:x}", error=str(exc))
            self._unrevoked = lease
