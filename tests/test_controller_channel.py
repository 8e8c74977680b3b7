"""The controller's per-broker mailboxes (services/controller/channel.py), against a broker
address nothing listens on: the sender retries while changes keep coming."""

from __future__ import annotations

import socket

from services.controller.channel import (
    MAX_WAITERS_PER_ENTRY,
    Completion,
    ControllerChannelManager,
)
from services.controller.state import Broker


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends


def test_waiters_on_an_unreachable_broker_are_bounded() -> None:
    """Each UpdateMetadata carries on the waiters of the one it replaces. For a registered
    broker that never answers, the list grew with every change the controller made; now
    the oldest beyond MAX_WAITERS_PER_ENTRY are given up, failed."""
    manager = ControllerChannelManager(1, 7, on_stale_controller=lambda error: None)
    broker = Broker(0, "127.0.0.1", _closed_port(), epoch=5)
    manager.add_broker(broker)
    try:
        completions = [Completion() for _ in range(MAX_WAITERS_PER_ENTRY + 40)]
        for completion in completions:
            manager.send_update_metadata([broker], completion)
        given_up = completions[:40]
        assert all(c.wait(0) for c in given_up)
        assert all(c.errors for c in given_up)
        assert not any(c.wait(0) for c in completions[40:])
    finally:
        manager.shutdown()
