"""The metadata store: the one module that talks to etcd (DESIGN §5).

Everything the control plane, storage nodes and gateways keep in etcd goes through
``MetaStore``; no other module imports ``etcd3``, so the client library can be swapped by
rewriting this file alone. Callers see plain dataclasses (``KeyValue``, ``WatchEvent``,
``Compare``, ``PutOp`` ...) and tidelog errors, never etcd3 or gRPC types.

Keys are relative to the cluster root ``/tidelog/<cluster>/``: ``store.put("brokers/1",
...)`` writes ``/tidelog/<cluster>/brokers/1``, and keys come back relative. The layout of
those keys is documented in ``docs/METADATA.md``.

Revisions: etcd stamps every write with the store-wide revision. ``mod_revision`` is the
revision of a key's last write, ``create_revision`` that of its creation (0 when absent).
Every state change compares the revision it read (``compare_and_swap``), and controller
writes also carry a ``Guard`` on the controller key, which is what fences a deposed
controller: a lease or an etcd lock alone is not mutual exclusion, because the holder may
be paused past its expiry and then act; the comparison happens inside etcd, atomically
with the write, so a stale actor's write simply does not apply.

Errors::

    tidelog.errors.BrokerNotAvailableError   (retriable)
    └── MetaStoreError                       anything this module raises
        ├── MetaStoreUnavailableError        etcd unreachable or deadline exceeded
        ├── LeaseLostError                   the lease expired or was revoked
        └── WatchCompactedError              a watch's start revision was compacted away

Every RPC has a deadline (``timeout_s``); a call never hangs on a dead etcd. A write that
failed with MetaStoreUnavailableError may or may not have been applied (the request can be
lost after etcd committed it): callers re-read and decide, which the compare-and-swap style
makes natural. Nothing is retried here.

python3-etcd3 0.13 quirks worked around here (see the call sites):

* ``Endpoint`` marks itself failed for ``time_retry`` (300 s) after one UNAVAILABLE, and a
  non-failover client then raises ``ValueError`` on every call for five minutes, so
  endpoints are built with ``time_retry=0`` and failover between endpoints is done here.
* ``Endpoint(opts=...)`` is typed as a dict but handed to gRPC, which needs a list of
  pairs.
* ``Watcher._run`` references ``six``, which it never imports: when a watch stream dies
  the NameError kills its thread and callbacks never hear of the failure. Watches are
  therefore run here on the raw ``etcdrpc.WatchStub``.
* ``transaction()`` drops the transaction's response header (its revision), and the
  lease keep-alive uses the client-wide timeout; both are called on the raw stubs.
* Unmapped gRPC codes (NOT_FOUND for a missing lease, ...) escape ``etcd3`` as raw
  ``grpc.RpcError``, so both families are translated in ``_translate``.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import etcd3
import etcd3.exceptions
import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import kv_pb2

from tidelog.errors import BrokerNotAvailableError, ErrorCode
from tidelog.logging import get_logger

_log = get_logger(component="metastore")

T = TypeVar("T")

ROOT_PREFIX = "/tidelog/"
# Deadline for every unary RPC unless the store is built with another.
DEFAULT_TIMEOUT_S = 5.0
# get_prefix pages through big ranges (all partitions of a big cluster) in chunks of this
# many keys, all read at the first page's revision so the result is one consistent view.
PREFIX_PAGE_KEYS = 1000
# Responses can carry whole topic assignments; gRPC's default 4 MiB cap is too low for a
# page of big values, and etcd itself caps requests at 1.5 MiB by default.
_MAX_RECEIVE_BYTES = 64 * 1024 * 1024
_GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", _MAX_RECEIVE_BYTES),
    # gRPC's default reconnect backoff grows to 120 s; after etcd restarts, calls would keep
    # failing fast (UNAVAILABLE) for up to that long although etcd is back. Cap it at 1 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Detect a silently dead peer under a long-lived watch stream. etcd rejects pings more
    # often than every 5 s (--grpc-keepalive-min-time) and pings without an open stream.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # What grpcio enforces as the ping's answer time (keepalive_timeout_ms alone is not:
    # a watch on a hung etcd failed only after the 60 s default, ~70 s in all).
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
]


class _AlwaysUsableEndpoint(etcd3.Endpoint):  # type: ignore[misc]
    """An endpoint etcd3 never refuses as "failed". With time_retry=0 it still compares
    wall-clock times: after the clock stepped back (NTP, a resumed VM) every call raised a
    raw ValueError('Trying to use a failed node') until the clock caught up, and a lease
    keeper's thread died on it without reporting the lease lost. There is one endpoint:
    gRPC's own reconnect backoff is the retry policy."""

    def is_failed(self) -> bool:
        return False


# gRPC codes meaning "etcd is not reachable or did not answer in time".
_UNAVAILABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
# What etcd says when a request names a lease that expired or was revoked.
_LEASE_NOT_FOUND = "requested lease not found"
# What etcd (or its gRPC server) says when it refuses a request for its size: more than
# --max-txn-ops operations, more than --max-request-bytes, past the gRPC receive limit.
_TOO_LARGE = ("too many operations in txn request", "request is too large", "larger than max")


# ===================================================================== errors


class MetaStoreError(BrokerNotAvailableError):
    """Base of the errors raised by the metadata store; retriable like its parent."""


class MetaStoreUnavailableError(MetaStoreError):
    """etcd could not be reached or did not answer within the deadline."""


class MetaStoreRequestTooLargeError(MetaStoreError):
    """etcd refused the request for its size, before applying any of it: the outcome is
    known (nothing changed), and asking again cannot succeed. Not retriable, unlike its
    parent: a client retried such a write for ever, each try costing a full resync."""

    code = ErrorCode.INVALID_REQUEST


class LeaseLostError(MetaStoreError):
    """The lease expired or was revoked; keys bound to it are gone. Grant a new one."""


class WatchCompactedError(MetaStoreError):
    """A watch could not start (or continue) from its revision: etcd compacted it away.

    The caller must re-read the prefix and watch again from the new read's revision.
    """

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


# ===================================================================== plain data


@dataclass(frozen=True)
class KeyValue:
    """One key as read from etcd. ``key`` is relative to the cluster root."""

    key: str
    value: bytes
    # Revision of the last write to this key; the token for compare_and_swap.
    mod_revision: int
    # Revision at which this incarnation of the key was created (stable across updates,
    # new after a delete and re-create); used as an epoch for lease-bound keys.
    create_revision: int
    # Number of writes since creation (1 right after creation).
    version: int
    # ID of the lease the key is bound to, 0 if none.
    lease_id: int

    def json(self) -> Any:
        """The value decoded as UTF-8 JSON (the encoding of every tidelog value)."""
        return json.loads(self.value.decode("utf-8"))


CompareTarget = Literal["mod_revision", "create_revision", "version", "value"]
CompareOp = Literal["==", "!=", "<", ">"]


@dataclass(frozen=True)
class Compare:
    """One condition of a transaction: ``<target of key> <op> <operand>``.

    etcd evaluates it against the key's current state: an absent key has mod_revision,
    create_revision and version 0, and fails every ``value`` comparison.
    """

    key: str
    target: CompareTarget
    op: CompareOp
    operand: int | bytes

    @classmethod
    def mod_revision_is(cls, key: str, revision: int) -> Compare:
        return cls(key, "mod_revision", "==", revision)

    @classmethod
    def create_revision_is(cls, key: str, revision: int) -> Compare:
        return cls(key, "create_revision", "==", revision)

    @classmethod
    def value_is(cls, key: str, value: bytes) -> Compare:
        return cls(key, "value", "==", value)

    @classmethod
    def absent(cls, key: str) -> Compare:
        return cls(key, "create_revision", "==", 0)

    @classmethod
    def exists(cls, key: str) -> Compare:
        return cls(key, "version", ">", 0)


@dataclass(frozen=True)
class Guard:
    """A precondition on another key that a write must also satisfy, e.g. the controller key.

    Every given field must match for the write to apply. A deleted key matches no revision
    or value, so a guard also blocks the write once its key is gone. The controller writes
    with ``Guard(CONTROLLER_KEY, create_revision=epoch)``: once its lease expires (the key
    is deleted) or a successor re-creates the key (new create revision), its writes fail.
    """

    key: str
    mod_revision: int | None = None
    create_revision: int | None = None
    value: bytes | None = None

    def __post_init__(self) -> None:
        if self.mod_revision is None and self.create_revision is None and self.value is None:
            raise ValueError(f"Guard on {self.key!r} checks nothing")

    def compares(self) -> list[Compare]:
        out: list[Compare] = []
        if self.mod_revision is not None:
            out.append(Compare.mod_revision_is(self.key, self.mod_revision))
        if self.create_revision is not None:
            out.append(Compare.create_revision_is(self.key, self.create_revision))
        if self.value is not None:
            out.append(Compare.value_is(self.key, self.value))
        return out


@dataclass(frozen=True)
class PutOp:
    """Transaction op: write ``value`` at ``key`` (bound to ``lease`` if given)."""

    key: str
    value: bytes
    lease: Lease | None = None


@dataclass(frozen=True)
class DeleteOp:
    """Transaction op: delete ``key``, or every key under it if ``prefix``."""

    key: str
    prefix: bool = False


@dataclass(frozen=True)
class GetOp:
    """Transaction op: read ``key``, or every key under it if ``prefix``."""

    key: str
    prefix: bool = False


TxnOp = PutOp | DeleteOp | GetOp


@dataclass(frozen=True)
class PutResult:
    pass


@dataclass(frozen=True)
class DeleteResult:
    deleted: int


@dataclass(frozen=True)
class GetResult:
    kvs: list[KeyValue]


OpResult = PutResult | DeleteResult | GetResult


@dataclass(frozen=True)
class TxnResult:
    """Outcome of ``MetaStore.txn``.

    ``responses`` answers the ops of the branch that ran (success ops if ``succeeded``,
    else failure ops), in order. ``revision`` is the store revision after the transaction:
    when it wrote anything, the new ``mod_revision`` of every key it put.
    """

    succeeded: bool
    responses: list[OpResult]
    revision: int


@dataclass(frozen=True)
class WatchEvent:
    """A change under a watched prefix. ``key`` is relative to the cluster root."""

    type: Literal["put", "delete"]
    key: str
    # The new value; empty for a delete.
    value: bytes
    # Revision of this change (for a delete: the revision of the deletion).
    mod_revision: int
    # Creation revision of the key's incarnation; 0 for a delete.
    create_revision: int
    # Writes since creation; 0 for a delete.
    version: int


# ===================================================================== endpoints


def parse_endpoints(endpoints: str) -> list[tuple[str, int]]:
    """``"http://h:p"``, ``"h:p"`` or a comma-separated list of them -> [(host, port)].

    Only plain-text endpoints are supported (``https`` is rejected: no TLS set-up yet).
    """
    out: list[tuple[str, int]] = []
    for raw in endpoints.split(","):
        item = raw.strip()
        if not item:
            continue
        parsed = urlsplit(item if "://" in item else f"http://{item}")
        if parsed.scheme != "http":
            raise ValueError(f"etcd endpoint {item!r}: only http:// is supported")
        try:
            port = parsed.port
        except ValueError as exc:
            raise ValueError(f"etcd endpoint {item!r}: bad port") from exc
        if not parsed.hostname or port is None:
            raise ValueError(f"etcd endpoint {item!r}: expected host:port")
        out.append((parsed.hostname, port))
    if not out:
        raise ValueError(f"no etcd endpoint in {endpoints!r}")
    return out


def _netloc_host(host: str) -> str:
    """``host`` as it goes before ``:port``: an IPv6 literal in brackets."""
    return f"[{host}]" if ":" in host else host


def _prefix_range_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix``."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"  # all 0xff: etcd reads range_end "\0" as "to the end of the keyspace"


# ===================================================================== the store


class MetaStore:
    """A connection to etcd scoped to one cluster's keys, ``/tidelog/<cluster>/``.

    Invariants:
      * Every RPC carries a deadline of ``timeout_s`` and fails with
        MetaStoreUnavailableError when etcd does not answer in time.
      * Reads are linearizable (etcd's default): a read sees every write acknowledged
        before it started.
      * Keys in and out are relative to the cluster root; a key never escapes the root.

    Thread-safety: all methods may be called from any thread concurrently (gRPC channels
    are thread-safe; the only mutable state, the current endpoint index and the set of
    live watches, is guarded by a lock). Watch callbacks run on the watch's own thread.
    """

    def __init__(
        self,
        endpoints: str,
        *,
        cluster: str = "default",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not cluster or "/" in cluster:
            raise ValueError(f"cluster name {cluster!r} must be non-empty and contain no '/'")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.root = f"{ROOT_PREFIX}{cluster}/"
        self._root_bytes = self.root.encode()
        self._addresses = parse_endpoints(endpoints)
        self.endpoints = ",".join(f"http://{_netloc_host(h)}:{p}" for h, p in self._addresses)
        # One single-endpoint etcd3 client per endpoint; failover is ours (see module doc).
        self._clients = [self._make_client(host, port) for host, port in self._addresses]
        self._lock = threading.Lock()
        self._current = 0
        self._watches: set[_Watch] = set()
        self._closed = False

    def _make_client(self, host: str, port: int) -> Any:
        endpoint = _AlwaysUsableEndpoint(
            # etcd3 dials "host:port": an IPv6 literal needs its brackets back, or gRPC read
            # "::1:2379" as a name and every call failed as "unreachable" (found by an
            # audit).
            _netloc_host(host),
            port,
            secure=False,
            # 0: never consider the endpoint "failed" (etcd3 would refuse it for 300 s).
            time_retry=0,
            # A list, not the dict etcd3's annotation claims: gRPC iterates it as pairs.
            opts=_GRPC_OPTIONS,
        )
        return etcd3.MultiEndpointEtcd3Client(
            endpoints=[endpoint], timeout=self.timeout_s, failover=False
        )

    # ------------------------------------------------------------- keys

    def full_key(self, key: str) -> bytes:
        """The absolute etcd key for a key relative to the cluster root."""
        return self._root_bytes + key.encode("utf-8")

    def _relative(self, key: bytes) -> str:
        if not key.startswith(self._root_bytes):  # pragma: no cover - ranges stay in root
            raise MetaStoreError(f"key {key!r} outside cluster root {self.root!r}")
        return key[len(self._root_bytes) :].decode("utf-8")

    def _kv(self, kv: Any) -> KeyValue:
        return KeyValue(
            key=self._relative(kv.key),
            value=bytes(kv.value),
            mod_revision=kv.mod_revision,
            create_revision=kv.create_revision,
            version=kv.version,
            lease_id=kv.lease,
        )

    # ------------------------------------------------------------- plumbing

    def _call(self, what: str, fn: Callable[[Any], T]) -> T:
        """Run ``fn(client)`` on the current endpoint, translating every failure.

        On unavailability the next call goes to the next endpoint (round robin); the
        failed call itself is not retried, because it may have been applied.
        """
        if self._closed:
            raise MetaStoreError(f"{what}: the metadata store is closed")
        with self._lock:
            index = self._current
        client = self._clients[index]
        try:
            return fn(client)
        except Exception as exc:
            host, port = self._addresses[index]
            error = self._translate(what, exc, f"http://{host}:{port}")
            if isinstance(error, MetaStoreUnavailableError) and len(self._clients) > 1:
                with self._lock:
                    if self._current == index:
                        self._current = (index + 1) % len(self._clients)
            raise error from exc

    def _translate(
        self, what: str, exc: BaseException, endpoint: str | None = None
    ) -> MetaStoreError:
        """A tidelog error for an etcd3 / gRPC failure (other exceptions are bugs: re-raised)."""
        where = f"etcd at {endpoint or self.endpoints}"
        if isinstance(exc, MetaStoreError):
            return exc
        if isinstance(exc, grpc.RpcError):
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
            if code in _UNAVAILABLE_CODES:
                return MetaStoreUnavailableError(
                    f"{what}: {where} unreachable or did not answer within "
                    f"{self.timeout_s} s ({code.name if code else '?'}: {details})"
                )
            if _LEASE_NOT_FOUND in details:
                return LeaseLostError(f"{what}: the lease expired or was revoked ({details})")
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED) and (
                any(marker in details for marker in _TOO_LARGE)
            ):
                return MetaStoreRequestTooLargeError(
                    f"{what}: too large for one etcd request ({code.name}: {details})"
                )
            return MetaStoreError(f"{what}: {where} failed ({code}: {details})")
        if isinstance(
            exc,
            etcd3.exceptions.ConnectionFailedError
            | etcd3.exceptions.ConnectionTimeoutError
            | etcd3.exceptions.NoServerAvailableError,
        ):
            return MetaStoreUnavailableError(
                f"{what}: {where} unreachable or did not answer within {self.timeout_s} s ({exc})"
            )
        if isinstance(exc, etcd3.exceptions.Etcd3Exception):
            return MetaStoreError(f"{what}: {where} failed ({type(exc).__name__}: {exc})")
        raise exc

    def _compare_message(self, compare: Compare) -> Any:
        message = etcdrpc.Compare(key=self.full_key(compare.key))
        message.result = {
            "==": etcdrpc.Compare.EQUAL,
            "!=": etcdrpc.Compare.NOT_EQUAL,
            "<": etcdrpc.Compare.LESS,
            ">": etcdrpc.Compare.GREATER,
        }[compare.op]
        operand = compare.operand
        if compare.target == "value":
            if not isinstance(operand, bytes):
                raise TypeError(f"{compare}: a value comparison needs bytes")
            message.target = etcdrpc.Compare.VALUE
            message.value = operand
            return message
        if not isinstance(operand, int):
            raise TypeError(f"{compare}: a {compare.target} comparison needs an int")
        if compare.target == "mod_revision":
            message.target = etcdrpc.Compare.MOD
            message.mod_revision = operand
        elif compare.target == "create_revision":
            message.target = etcdrpc.Compare.CREATE
            message.create_revision = operand
        else:
            message.target = etcdrpc.Compare.VERSION
            message.version = operand
        return message

    def _op_message(self, op: TxnOp) -> Any:
        if isinstance(op, PutOp):
            put = etcdrpc.PutRequest(key=self.full_key(op.key), value=op.value)
            if op.lease is not None:
                put.lease = op.lease.id
            return etcdrpc.RequestOp(request_put=put)
        key = self.full_key(op.key)
        range_end = _prefix_range_end(key) if op.prefix else b""
        if isinstance(op, DeleteOp):
            return etcdrpc.RequestOp(
                request_delete_range=etcdrpc.DeleteRangeRequest(key=key, range_end=range_end)
            )
        return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key, range_end=range_end))

    def _op_result(self, response: Any) -> OpResult:
        kind = response.WhichOneof("response")
        if kind == "response_put":
            return PutResult()
        if kind == "response_delete_range":
            return DeleteResult(deleted=response.response_delete_range.deleted)
        if kind == "response_range":
            return GetResult(kvs=[self._kv(kv) for kv in response.response_range.kvs])
        raise MetaStoreError(f"unexpected transaction response {kind!r}")  # pragma: no cover

    # ------------------------------------------------------------- reads

    def get(self, key: str) -> KeyValue | None:
        """The key's value and revisions, or None if it does not exist."""
        response = self._call(f"get {key}", lambda c: c.get_response(self.full_key(key)))
        if not response.kvs:
            return None
        return self._kv(response.kvs[0])

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key under ``prefix`` (relative; "" = the whole cluster), sorted by key."""
        return self.get_prefix_with_revision(prefix)[0]

    def get_prefix_with_revision(self, prefix: str) -> tuple[list[KeyValue], int]:
        """``get_prefix`` plus the store revision the result reflects.

        Read-then-watch without gaps: ``kvs, rev = get_prefix_with_revision(p)`` and then
        ``watch_prefix(p, ..., start_revision=rev + 1)`` sees every later change once.
        Pages of PREFIX_PAGE_KEYS keys are all read at the first page's revision. A page
        whose answer is larger than the client takes (``_MAX_RECEIVE_BYTES``: a thousand
        values of up to 1.5 MiB may be) is read again in halves: sixty-odd legal group
        states made every read of their prefix fail, for good (found by an audit).
        """
        start = self.full_key(prefix)
        end = _prefix_range_end(start)
        kvs: list[KeyValue] = []
        revision: int | None = None
        limit = PREFIX_PAGE_KEYS
        while True:

            def page(
                c: Any, start: bytes = start, revision: int | None = revision, limit: int = limit
            ) -> Any:
                return c.get_range_response(start, end, limit=limit, revision=revision)

            try:
                response = self._call(f"get prefix {prefix}", page)
            except MetaStoreRequestTooLargeError:
                if limit == 1:
                    raise
                limit //= 2
                continue
            if revision is None:
                revision = int(response.header.revision)
            kvs.extend(self._kv(kv) for kv in response.kvs)
            if not response.more or not response.kvs:
                return kvs, revision
            start = bytes(response.kvs[-1].key) + b"\0"

    def current_revision(self) -> int:
        """The store's current revision (also a cheap liveness probe)."""
        response = self._call(
            "current revision", lambda c: c.get_response(self._root_bytes, count_only=True)
        )
        return int(response.header.revision)

    # ------------------------------------------------------------- writes

    def put(self, key: str, value: bytes, lease: Lease | None = None) -> int:
        """Unconditional write; returns the new mod_revision. Prefer compare_and_swap."""
        lease_id = lease.id if lease is not None else 0
        response = self._call(
            f"put {key}", lambda c: c.put(self.full_key(key), value, lease=lease_id)
        )
        return int(response.header.revision)

    def delete(self, key: str) -> bool:
        """Unconditional delete; True if the key existed."""
        response = self._call(
            f"delete {key}", lambda c: c.delete(self.full_key(key), return_response=True)
        )
        return int(response.deleted) > 0

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[TxnOp] = (),
        failure: Sequence[TxnOp] = (),
        *,
        timeout_s: float | None = None,
    ) -> TxnResult:
        """Atomically: if every compare holds run ``success`` ops, else ``failure`` ops.

        etcd applies the whole transaction at one revision; no other write interleaves.
        A key may be written at most once per transaction (etcd rejects duplicates).
        ``timeout_s`` shortens the store's deadline for a caller with less time left.
        """
        deadline_s = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        request = etcdrpc.TxnRequest(
            compare=[self._compare_message(c) for c in compares],
            success=[self._op_message(op) for op in success],
            failure=[self._op_message(op) for op in failure],
        )
        # The raw stub, because etcd3's transaction() discards the response header.
        response = self._call("txn", lambda c: c.kvstub.Txn(request, deadline_s))
        return TxnResult(
            succeeded=bool(response.succeeded),
            responses=[self._op_result(r) for r in response.responses],
            revision=int(response.header.revision),
        )

    def create_if_absent(
        self,
        key: str,
        value: bytes,
        lease: Lease | None = None,
        guards: Sequence[Guard] = (),
    ) -> bool:
        """Create ``key`` only if it does not exist (and the guards hold); True if created.

        Among concurrent callers exactly one wins: etcd serializes the transactions.
        """
        compares = [Compare.absent(key), *_guard_compares(guards)]
        return self.txn(compares, [PutOp(key, value, lease)]).succeeded

    def compare_and_swap(
        self,
        key: str,
        expected_mod_revision: int,
        value: bytes,
        guards: Sequence[Guard] = (),
        lease: Lease | None = None,
    ) -> bool:
        """Write ``value`` only if the key's mod_revision is still the one read (and guards hold).

        ``expected_mod_revision=0`` means "the key must not exist". Returns False, having
        changed nothing, if anything wrote the key (or a guard key) since it was read.
        """
        compares = [Compare.mod_revision_is(key, expected_mod_revision), *_guard_compares(guards)]
        return self.txn(compares, [PutOp(key, value, lease)]).succeeded

    def compare_and_delete(
        self, key: str, expected_mod_revision: int, guards: Sequence[Guard] = ()
    ) -> bool:
        """Delete ``key`` only if its mod_revision is still the one read (and guards hold)."""
        compares = [Compare.mod_revision_is(key, expected_mod_revision), *_guard_compares(guards)]
        return self.txn(compares, [DeleteOp(key)]).succeeded

    # ------------------------------------------------------------- leases

    def grant_lease(self, ttl_s: int) -> Lease:
        """A new lease; keys bound to it vanish ``ttl_s`` after its last refresh.

        etcd raises a TTL below its minimum (1.5 election timeouts, rounded up to whole
        seconds: 2 s with etcd's default timing) to that minimum; ``Lease.ttl_s`` holds
        the TTL granted.
        """
        if ttl_s < 1:
            raise ValueError("lease TTL must be at least 1 s")
        asked_at = time.monotonic()
        granted = self._call(f"grant lease ttl={ttl_s}", lambda c: c.lease(ttl_s))
        return Lease(self, int(granted.id), int(granted.ttl), asked_at)

    def _refresh_lease(self, lease_id: int, timeout_s: float) -> int:
        def keepalive(c: Any) -> int:
            # Raw stub with our own deadline: etcd3's refresh_lease uses the client-wide
            # timeout, too long for a keeper racing a short TTL. One request, one response:
            # etcd closes the stream when the request side ends.
            request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
            ttl = 0
            for response in c.leasestub.LeaseKeepAlive(iter([request]), timeout_s):
                ttl = int(response.TTL)
            return ttl

        ttl = self._call(f"refresh lease {lease_id:x}", keepalive)
        if ttl <= 0:
            # etcd answers a keep-alive for an unknown lease with TTL 0, not an error.
            raise LeaseLostError(f"lease {lease_id:x} expired or was revoked")
        return ttl

    def _revoke_lease(self, lease_id: int) -> None:
        # Revoking a lease that is already gone succeeds: the goal state holds.
        with contextlib.suppress(LeaseLostError):
            self._call(f"revoke lease {lease_id:x}", lambda c: c.revoke_lease(lease_id))

    def _lease_ttl(self, lease_id: int) -> int | None:
        info = self._call(f"lease {lease_id:x} ttl", lambda c: c.get_lease_info(lease_id))
        ttl = int(info.TTL)
        # -1: no such lease. 0 is a live lease with under a second left (TTL truncates).
        return None if ttl < 0 else ttl

    def lease_remaining_s(self, lease_id: int) -> int | None:
        """Seconds left of a lease by ID (one another process may hold), None when it is
        gone."""
        return self._lease_ttl(lease_id)

    def refresh_lease_id(self, lease_id: int) -> int:
        """Refresh a lease by ID (one another process may have granted); the TTL it now
        has. Raises LeaseLostError when it expired or was revoked."""
        return self._refresh_lease(lease_id, self.timeout_s)

    def revoke_lease_id(self, lease_id: int) -> None:
        """Revoke a lease by ID (e.g. one another process holds, in fault tests)."""
        self._revoke_lease(lease_id)

    # ------------------------------------------------------------- watches

    def watch_prefix(
        self,
        prefix: str,
        callback: Callable[[WatchEvent], None],
        *,
        on_error: Callable[[MetaStoreError], None],
        start_revision: int | None = None,
    ) -> Callable[[], None]:
        """Call ``callback`` for every put and delete under ``prefix``; returns ``cancel``.

        Events arrive in revision order, one call each, on a thread owned by the watch;
        a slow callback delays later events (it does not drop them). The watch starts at
        ``start_revision`` (inclusive) or, if None, after the current revision.

        Returns once etcd has confirmed the watch; raises MetaStoreUnavailableError if it
        cannot within ``timeout_s``. Afterwards, if the stream fails, ``on_error`` is
        called once, on the watch thread, and the watch is over: the caller re-reads with
        ``get_prefix_with_revision`` and watches again from there. Failures are
        MetaStoreUnavailableError (etcd down), WatchCompactedError (``start_revision`` was
        compacted away: etcd 3.4 confirms such a watch first and cancels it right after,
        so this arrives here, not as an exception) and MetaStoreError (a callback raised).

        ``cancel()`` is idempotent; once it returns no callback is running or will run
        (unless called from a callback itself, which it may be).
        """
        if self._closed:
            raise MetaStoreError(f"watch {prefix}: the metadata store is closed")
        key = self.full_key(prefix)
        watch = _Watch(
            self, prefix, key, _prefix_range_end(key), start_revision, callback, on_error
        )
        with self._lock:
            index = self._current
            self._watches.add(watch)
        try:
            watch.start(self._clients[index].channel, self.timeout_s)
        except MetaStoreError:
            self._forget_watch(watch)
            raise
        return watch.cancel

    def _forget_watch(self, watch: _Watch) -> None:
        with self._lock:
            self._watches.discard(watch)

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Cancel every watch and close the connections. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            watches = list(self._watches)
        for watch in watches:
            watch.cancel()
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()

    def __enter__(self) -> MetaStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetaStore({self.endpoints!r}, cluster={self.cluster!r})"


def _guard_compares(guards: Sequence[Guard]) -> list[Compare]:
    return [compare for guard in guards for compare in guard.compares()]


# ===================================================================== leases


class Lease:
    """An etcd lease: keys bound to it are deleted when it expires or is revoked.

    A lease is a liveness signal, not a lock: its holder may believe it still holds it
    after etcd expired it (GC pause, partition). Fencing comes from comparing revisions in
    transactions (see Guard), never from holding a lease.

    Thread-safety: safe from any thread (each method is one RPC).
    """

    def __init__(self, store: MetaStore, lease_id: int, ttl_s: int, confirmed_at: float) -> None:
        self._store = store
        self.id = lease_id
        # The TTL etcd granted (may exceed the one asked for; see grant_lease).
        self.ttl_s = ttl_s
        # time.monotonic() just before the last grant or refresh that etcd confirmed. etcd
        # handled that request later, so the lease lives at least until confirmed_at +
        # ttl_s: a safe (early) bound for "may have expired" on the holder's clock.
        self.confirmed_at = confirmed_at

    def refresh(self, timeout_s: float | None = None) -> int:
        """Reset the TTL; returns it. Raises LeaseLostError if the lease is gone."""
        asked_at = time.monotonic()
        ttl = self._store._refresh_lease(self.id, timeout_s or self._store.timeout_s)
        self.confirmed_at = asked_at
        return ttl

    def may_have_expired(self) -> bool:
        """True once a whole TTL has passed since the last confirmed grant or refresh."""
        return time.monotonic() - self.confirmed_at >= self.ttl_s

    def revoke(self) -> None:
        """End the lease now, deleting its keys. Succeeds if it is already gone."""
        self._store._revoke_lease(self.id)

    def remaining_ttl(self) -> int | None:
        """Whole seconds left (0 = under one), or None if the lease no longer exists."""
        return self._store._lease_ttl(self.id)

    def __repr__(self) -> str:
        return f"Lease(id={self.id:x}, ttl_s={self.ttl_s})"


class LeaseKeeper:
    """A daemon thread that keeps a lease alive and reports when it is lost.

    It refreshes every ``interval_s`` (default TTL/3, so two refreshes may fail before the
    lease is at risk). It reports loss, by calling ``on_lost`` once from its thread and then
    stopping, when etcd says the lease is gone, or when no refresh has succeeded for a whole
    TTL (etcd unreachable): from then on the lease may have expired, and the holder must
    act as if it had (stop acting as controller, re-register, ...).

    Thread-safety: ``start``/``stop`` from any one thread; ``lost`` may be read anywhere.
    """

    def __init__(
        self,
        lease: Lease,
        interval_s: float | None = None,
        on_lost: Callable[[MetaStoreError], None] | None = None,
    ) -> None:
        self.lease = lease
        self.interval_s = interval_s if interval_s is not None else lease.ttl_s / 3
        if self.interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"lease-keeper-{lease.id:x}", daemon=True
        )

    @property
    def lost(self) -> bool:
        """True once the keeper has given up on the lease and on_lost has returned."""
        return self._lost.is_set()

    def wait_lost(self, timeout_s: float | None = None) -> bool:
        """Block until the loss was reported and on_lost returned (True), or timeout (False)."""
        return self._lost.wait(timeout_s)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop refreshing (the lease then expires unless revoked). Idempotent."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> LeaseKeeper:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _run(self) -> None:
        lease = self.lease
        delay = self.interval_s
        while not self._stop.wait(delay):
            # Never wait longer for one refresh than the lease has left.
            remaining = lease.ttl_s - (time.monotonic() - lease.confirmed_at)
            try:
                lease.refresh(timeout_s=max(0.1, min(lease._store.timeout_s, remaining)))
            except LeaseLostError as exc:
                self._report(exc)
                return
            except MetaStoreError as exc:
                if lease.may_have_expired():
                    self._report(
                        LeaseLostError(
                            f"lease {self.lease.id:x}: no successful refresh for "
                            f"{self.lease.ttl_s} s, it may have expired ({exc.message})"
                        )
                    )
                    return
                # Retry soon: the lease is still alive but the clock runs.
                delay = min(self.interval_s, 0.2)
                _log.warning("lease_refresh_failed", lease=f"{self.lease.id:x}", error=str(exc))
                continue
            except Exception as exc:
                # A bug or a client surprise must not end the keeper silently: its holder
                # would go on believing it holds the lease, and never register again.
                _log.exception("lease_refresh_crashed", lease=f"{self.lease.id:x}")
                self._report(LeaseLostError(f"lease {self.lease.id:x}: refresh failed ({exc!r})"))
                return
            delay = self.interval_s

    def _report(self, error: MetaStoreError) -> None:
        _log.warning("lease_lost", lease=f"{self.lease.id:x}", error=str(error))
        try:
            if self._on_lost is not None:
                self._on_lost(error)
        except Exception:
            _log.exception("lease_lost_callback_failed", lease=f"{self.lease.id:x}")
        finally:
            # Set after the callback, so wait_lost() returns to a world it has updated.
            self._lost.set()


# ===================================================================== watches


@dataclass(eq=False)
class _Watch:
    """One etcd watch stream (its own gRPC call and thread) feeding one callback.

    Run on the raw WatchStub because etcd3's Watcher loses stream errors (module doc).
    ``_delivering`` is held while a callback runs, so cancel() can wait for it to finish.
    """

    store: MetaStore
    prefix: str
    key: bytes
    range_end: bytes
    start_revision: int | None
    callback: Callable[[WatchEvent], None]
    on_error: Callable[[MetaStoreError], None]
    _requests: queue.Queue[Any] = field(default_factory=queue.Queue)
    _created: threading.Event = field(default_factory=threading.Event)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _state_lock: threading.Lock = field(default_factory=threading.Lock)
    _delivering: threading.Lock = field(default_factory=threading.Lock)
    _call: Any = None
    _thread: threading.Thread | None = None
    _start_error: MetaStoreError | None = None

    def start(self, channel: Any, timeout_s: float) -> None:
        create = etcdrpc.WatchCreateRequest(key=self.key, range_end=self.range_end)
        if self.start_revision is not None:
            create.start_revision = self.start_revision
        self._requests.put(etcdrpc.WatchRequest(create_request=create))
        try:
            # "hasleader" (clientv3's WithRequireLeader): a member cut off from its
            # cluster's leader cancels the watch rather than keep it open and silent
            # while the others go on (deleting an expired broker's key, say).
            call = etcdrpc.WatchStub(channel).Watch(
                self._request_iter(), metadata=[("hasleader", "true")]
            )
        except grpc.RpcError as exc:  # pragma: no cover - stream calls fail lazily
            raise self.store._translate(f"watch {self.prefix}", exc) from exc
        with self._state_lock:
            self._call = call
        self._thread = threading.Thread(
            target=self._run, args=(call,), name=f"metastore-watch-{self.prefix}", daemon=True
        )
        self._thread.start()
        if not self._created.wait(timeout_s):
            self.cancel()
            raise MetaStoreUnavailableError(
                f"watch {self.prefix}: etcd at {self.store.endpoints} did not confirm the "
                f"watch within {timeout_s} s"
            )
        if self._start_error is not None:
            self.cancel()
            raise self._start_error

    def cancel(self) -> None:
        with self._state_lock:
            if self._cancelled.is_set():
                return
            self._cancelled.set()
            call = self._call
        self._requests.put(None)  # ends the request stream (half-close)
        if call is not None:
            call.cancel()
        self.store._forget_watch(self)
        if threading.current_thread() is not self._thread:
            # Wait out a callback in progress, so none runs after cancel() returns.
            with self._delivering:
                pass

    def _request_iter(self) -> Iterator[Any]:
        while True:
            request = self._requests.get()
            if request is None:
                return
            yield request

    def _run(self, call: Any) -> None:
        error: MetaStoreError | None = None
        try:
            for response in call:
                if response.compact_revision:
                    error = WatchCompactedError(
                        f"watch {self.prefix}: revision {self.start_revision} was compacted "
                        f"(compact revision {response.compact_revision}); re-read and re-watch",
                        int(response.compact_revision),
                    )
                    break
                if response.canceled:
                    error = MetaStoreError(
                        f"watch {self.prefix}: cancelled by etcd "
                        f"({response.cancel_reason or 'no reason given'})"
                    )
                    break
                if response.created:
                    self._created.set()
                if not self._deliver(response.events):
                    return
            else:
                error = MetaStoreUnavailableError(f"watch {self.prefix}: etcd ended the stream")
        except grpc.RpcError as exc:
            if self._cancelled.is_set():
                return
            error = self.store._translate(f"watch {self.prefix}", exc)
        finally:
            self.store._forget_watch(self)
            # End the request stream whatever ended the watch: gRPC's request-consumer
            # thread otherwise waits in _request_iter for ever (one per failed watch).
            self._requests.put(None)
        if self._cancelled.is_set() or error is None:
            return
        if not self._created.is_set():
            self._start_error = error  # start() raises it
            self._created.set()
            return
        _log.warning("watch_failed", prefix=self.prefix, error=str(error))
        with self._delivering:
            if not self._cancelled.is_set():
                self._safe(self.on_error, error)
        with self._state_lock:
            self._cancelled.set()

    def _deliver(self, events: Any) -> bool:
        """Run the callback per event; False if the watch is over (cancelled or failed)."""
        for raw in events:
            with self._delivering:
                if self._cancelled.is_set():
                    return False
                kv = raw.kv
                event = WatchEvent(
                    type="delete" if raw.type == kv_pb2.Event.DELETE else "put",
                    key=self.store._relative(bytes(kv.key)),
                    value=bytes(kv.value),
                    mod_revision=int(kv.mod_revision),
                    create_revision=int(kv.create_revision),
                    version=int(kv.version),
                )
                try:
                    self.callback(event)
                except Exception as exc:
                    # The caller's view may now be inconsistent; end the watch so it
                    # re-reads instead of continuing from a half-applied state.
                    _log.exception("watch_callback_failed", prefix=self.prefix)
                    self._cancel_from_inside()
                    self._safe(
                        self.on_error,
                        MetaStoreError(f"watch {self.prefix}: callback raised {exc!r}"),
                    )
                    return False
        return True

    def _cancel_from_inside(self) -> None:
        with self._state_lock:
            self._cancelled.set()
            call = self._call
        self._requests.put(None)
        if call is not None:
            call.cancel()
        self.store._forget_watch(self)

    def _safe(self, fn: Callable[[MetaStoreError], None], error: MetaStoreError) -> None:
        try:
            fn(error)
        except Exception:
            _log.exception("watch_error_callback_failed", prefix=self.prefix)
