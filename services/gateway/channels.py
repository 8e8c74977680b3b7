"""gRPC channels from the gateway to storage nodes and to the active controller.

One channel per address, created on first use and kept while the address is in use:
gRPC multiplexes every concurrent call over it, so the gateway never needs a pool per
broker. A broker that re-registers on a new address (a restart on another port, a new
pod IP) gets a new channel; ``ChannelSweeper`` closes the old one once no registered
broker or controller has had its address for a whole sweep interval (a closed channel
kept reconnecting to the dead address for ever).

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from typing import Final

import grpc
import structlog

from services.controller.state import Broker
from tidelog.addresses import format_host_port
from tidelog.v1 import controller_pb2_grpc, storage_pb2, storage_pb2_grpc

_log = structlog.get_logger("tidelog.gateway.channels")

CHANNEL_OPTIONS: Final = [
    # Produce requests and fetch responses carry many megabytes of batches.
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    # Notice a dead broker on an idle channel within seconds, not minutes.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # Reconnect quickly after a broker restarts on the same address.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


def broker_address(broker: Broker) -> str:
    return format_host_port(broker.host, broker.port)


class Channels:
    """Address -> channel, plus typed stubs; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        # Per address, made on first use (a racing second one is harmless, and dict
        # assignment is atomic): what the hot paths call.
        self._stubs: dict[str, storage_pb2_grpc.StorageStub] = {}
        self._appends: dict[
            str, grpc.UnaryUnaryMultiCallable[bytes, storage_pb2.AppendResponse]
        ] = {}
        self._append_manys: dict[
            str, grpc.UnaryUnaryMultiCallable[bytes, storage_pb2.AppendManyResponse]
        ] = {}
        self._fetches: dict[str, grpc.UnaryUnaryMultiCallable[storage_pb2.FetchRequest, bytes]] = {}
        self._closed = False

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if self._closed:
                raise RuntimeError("the gateway is stopping")
            channel = self._channels.get(address)
            if channel is None:
                channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                self._channels[address] = channel
            return channel

    def storage(self, broker: Broker) -> storage_pb2_grpc.StorageStub:
        # Kept per address: a stub makes a callable per method, too much for every call.
        address = broker_address(broker)
        stub = self._stubs.get(address)
        if stub is None:
            stub = self._stubs[address] = storage_pb2_grpc.StorageStub(self._channel(address))
        return stub

    def storage_append_encoded(
        self, broker: Broker
    ) -> grpc.UnaryUnaryMultiCallable[bytes, storage_pb2.AppendResponse]:
        """``Storage.Append`` taking a request already encoded (``tidelog.wire``): protobuf's
        own building and encoding of a request full of batches costs ~2 ms per MB."""
        address = broker_address(broker)
        append = self._appends.get(address)
        if append is None:
            append = self._appends[address] = self._channel(address).unary_unary(
                "/tidelog.v1.Storage/Append",
                request_serializer=None,
                response_deserializer=storage_pb2.AppendResponse.FromString,
            )
        return append

    def storage_append_many_encoded(
        self, broker: Broker
    ) -> grpc.UnaryUnaryMultiCallable[bytes, storage_pb2.AppendManyResponse]:
        """``Storage.AppendMany`` taking a request already encoded (``tidelog.wire``)."""
        address = broker_address(broker)
        append_many = self._append_manys.get(address)
        if append_many is None:
            append_many = self._append_manys[address] = self._channel(address).unary_unary(
                "/tidelog.v1.Storage/AppendMany",
                request_serializer=None,
                response_deserializer=storage_pb2.AppendManyResponse.FromString,
            )
        return append_many

    def storage_fetch_encoded(
        self, broker: Broker
    ) -> grpc.UnaryUnaryMultiCallable[storage_pb2.FetchRequest, bytes]:
        """``Storage.Fetch`` answering the encoded response, unparsed (for pass-through)."""
        address = broker_address(broker)
        fetch = self._fetches.get(address)
        if fetch is None:
            fetch = self._fetches[address] = self._channel(address).unary_unary(
                "/tidelog.v1.Storage/Fetch",
                request_serializer=storage_pb2.FetchRequest.SerializeToString,
                response_deserializer=None,
            )
        return fetch

    def controller(self, address: str) -> controller_pb2_grpc.ControllerStub:
        return controller_pb2_grpc.ControllerStub(self._channel(address))

    def retain(self, addresses: Collection[str]) -> list[str]:
        """Close the channels to every address not in ``addresses``; the addresses closed.
        A call still running on one fails as a network error (retried elsewhere)."""
        with self._lock:
            gone = [address for address in self._channels if address not in addresses]
            closing = [self._channels.pop(address) for address in gone]
            for address in gone:
                self._stubs.pop(address, None)
                self._appends.pop(address, None)
                self._append_manys.pop(address, None)
                self._fetches.pop(address, None)
        for channel in closing:
            channel.close()
        return gone

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
            self._stubs.clear()
            self._appends.clear()
            self._append_manys.clear()
            self._fetches.clear()
        for channel in channels:
            channel.close()


CHANNEL_SWEEP_INTERVAL_S: Final = 60.0
"""How often ``ChannelSweeper`` looks; an address unused for a whole interval is closed."""


class ChannelSweeper:
    """Every ``interval_s``, keeps the channels to the addresses in use now or at the last
    look (``addresses()``: the registered brokers' and the controller's) and closes the
    others, through each of ``retainers`` (``Channels.retain`` and the like). Looking twice
    means an address that disappears for a moment (a broker re-registering on the same
    port) is not closed under calls about to use it again.

    Thread-safety: ``start``/``stop`` from the owner; ``sweep`` from its thread (or a test).
    """

    def __init__(
        self,
        addresses: Callable[[], set[str]],
        retainers: Sequence[Callable[[Collection[str]], object]],
        *,
        interval_s: float = CHANNEL_SWEEP_INTERVAL_S,
    ) -> None:
        self._addresses = addresses
        self._retainers = retainers
        self._interval_s = interval_s
        self._previous: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sweep(self) -> None:
        current = self._addresses()
        keep = current | self._previous
        for retain in self._retainers:
            retain(keep)
        self._previous = current

    def start(self) -> None:
        self._previous = self._addresses()
        self._thread = threading.Thread(target=self._run, name="gateway-channel-sweeper")
        self._thread.daemon = True
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.sweep()
            except Exception:  # a sweep must never end the sweeper
                _log.exception("channel_sweep_failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
