"""Producer inputs that passed send()'s checks but broke the sender thread, which then
failed every record of the producer (other partitions' and other callers' too) and
refused every later send (found by an audit). Each is refused at the call now with
ConfigError, changing nothing, and the producer goes on."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

import tidelog
from tests.support.cluster import GatewayProcess
from tidelog.errors import ConfigError


def _topic(admin: tidelog.Admin, partitions: int) -> str:
    name = f"inputs-{uuid.uuid4().hex[:8]}"
    admin.create_topic(name, partitions=partitions, replication_factor=1)
    return name


@pytest.mark.parametrize(
    "bad_send",
    [
        lambda p, t: p.send(t, b"bad", partition=1.0),
        lambda p, t: p.send_batch(t, [b"a", b"b"], partition=1.0),
        lambda p, t: p.send(t.encode(), b"bad"),
        lambda p, t: p.send_batch(t.encode(), [b"bad"]),
    ],
    ids=["float-partition", "float-partition-batch", "bytes-topic", "bytes-topic-batch"],
)
def test_a_bad_send_argument_is_refused_at_the_call_not_in_the_sender(
    gateway: GatewayProcess,
    admin: tidelog.Admin,
    bad_send: Callable[[tidelog.Producer, str], Any],
) -> None:
    """A float partition passed the range check and killed the sender in the encoder; a
    bytes topic raised KeyError."""
    topic = _topic(admin, 2)
    with tidelog.Producer(gateway.address, linger_ms=50) as producer:
        good = producer.send(topic, b"good", partition=0)  # the same request as the bad one
        with pytest.raises(ConfigError):
            bad_send(producer, topic)
        assert good.result(15).offset == 0
        assert producer.send(topic, b"later", partition=0).result(15).offset == 1


@pytest.mark.parametrize(
    "options",
    [{"request_timeout_ms": 20_000.0}, {"client_id": 7}, {"linger_ms": True}],
    ids=["float-timeout", "int-client-id", "bool-linger"],
)
def test_a_producer_option_of_another_type_is_refused(
    gateway: GatewayProcess, options: dict[str, Any]
) -> None:
    """A float request_timeout_ms (``timeout_s * 1000``) or a non-str client_id was taken
    by the constructor, then killed the sender at the first request."""
    with pytest.raises(ConfigError, match="must be"):
        tidelog.Producer(gateway.address, **options)
