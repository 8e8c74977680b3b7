"""Calls from the gateway to several leaders at once, made on one asyncio event loop.

Why not ``future()`` of the sync API: grpc's sync channel starts a thread (its "spin
thread", which polls the channel) whenever a call begins on a channel with no call in
flight, and at moderate rates that is nearly every call. A Fetch spanning several leaders
asks each of them at once, so with ``future()`` it started a thread per leader; py-spy of
the gateway at 500 records/s put a third of its busy samples in starting and running those
threads. grpc.aio channels on one event loop share the loop's poller: a call costs a
coroutine, and cancelling the leaders that lost a long-poll race is cheap.

Callers on other threads (gRPC's handler pool) hand a coroutine to ``run`` and block on
its result. The aio channels are created and used on the loop thread only.

Thread-safety: ``run`` and ``close`` may be called from any thread but the loop's own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Collection, Coroutine
from typing import Any, Final, TypeVar

import grpc
import grpc.aio

from services.controller.state import Broker
from services.gateway.channels import CHANNEL_OPTIONS, broker_address
from tidelog.errors import BrokerNotAvailableError
from tidelog.v1 import storage_pb2

T = TypeVar("T")

CLOSE_TIMEOUT_S: Final = 5.0


class LeaderCalls:
    """An event loop thread with one grpc.aio channel per storage node; see the module
    docstring."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._channels: dict[str, grpc.aio.Channel] = {}  # touched on the loop thread only
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="gateway-leader-calls", daemon=True
        )
        self._thread.start()

    def run(
        self,
        coroutine: Coroutine[Any, Any, T],
        on_cancel: Callable[[Callable[[], object]], None] | None = None,
    ) -> T:
        """Run ``coroutine`` on the loop and wait for its result (it must end by itself:
        every call it makes has a deadline). ``on_cancel`` is given the function that
        cancels it (its calls with it), for a caller whose own client may go away. Raises
        BrokerNotAvailableError when the gateway is stopping or it was cancelled."""
        with self._lock:
            if self._closed:
                coroutine.close()
                raise BrokerNotAvailableError("the gateway is stopping")
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        if on_cancel is not None:
            on_cancel(future.cancel)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise BrokerNotAvailableError("the gateway is stopping") from None

    def fetch_encoded(
        self, broker: Broker
    ) -> grpc.aio.UnaryUnaryMultiCallable[storage_pb2.FetchRequest, bytes]:
        """``Storage.Fetch`` on ``broker`` answering the encoded response, unparsed (for
        pass-through). Loop thread only."""
        address = broker_address(broker)
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
        return channel.unary_unary(
            "/tidelog.v1.Storage/Fetch",
            request_serializer=storage_pb2.FetchRequest.SerializeToString,
            response_deserializer=None,
        )

    def retain(self, addresses: Collection[str]) -> None:
        """Close the channels to every address not in ``addresses`` (on the loop, soon;
        a call still running on one fails as a network error)."""

        async def close_others() -> None:
            gone = [address for address in self._channels if address not in addresses]
            for address in gone:
                await self._channels.pop(address).close(grace=None)

        with self._lock:
            if not self._closed:
                asyncio.run_coroutine_threadsafe(close_others(), self._loop)

    def close(self) -> None:
        """Cancel what is running (its callers get BrokerNotAvailableError), close the
        channels and stop the loop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True

        async def shut() -> None:
            current = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not current:
                    task.cancel()
            channels, self._channels = list(self._channels.values()), {}
            for channel in channels:
                await channel.close(grace=None)

        try:
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(CLOSE_TIMEOUT_S)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(CLOSE_TIMEOUT_S)
            if not self._thread.is_alive():
                self._loop.close()
