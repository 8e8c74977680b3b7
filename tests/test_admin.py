"""``tidelog.Admin`` against a real cluster (etcd, 3 storage nodes, a controller, gateways):
arguments checked before anything is sent, and admin changes that time out."""

from __future__ import annotations

import inspect
import os
import signal
from collections.abc import Callable
from typing import Any

import pytest

import tidelog
from services.gateway.server import ADMIN_TIMEOUT_S, _timeout_s
from tests.support.cluster import GatewayProcess, TestCluster
from tidelog.admin import change_deadline_s
from tidelog.errors import (
    ConfigError,
    InvalidPartitionsError,
    InvalidReplicationFactorError,
    RequestTimedOutError,
    TidelogError,
)
from tidelog.formats import INT32_MAX

BAD_CALLS: list[tuple[str, Callable[[tidelog.Admin], Any], type[TidelogError]]] = [
    ("name not a str", lambda a: a.create_topic(5), ConfigError),
    # bytes used to be sent as if they were the name.
    ("name bytes", lambda a: a.create_topic(b"typed-bytes"), ConfigError),
    ("name not UTF-8", lambda a: a.create_topic("typed-\udcff"), ConfigError),
    ("partitions str", lambda a: a.create_topic("typed", "3"), ConfigError),
    ("partitions float", lambda a: a.create_topic("typed", 3.0), ConfigError),
    ("partitions bool", lambda a: a.create_topic("typed", True), ConfigError),
    ("partitions > int32", lambda a: a.create_topic("typed", 2**31), InvalidPartitionsError),
    (
        "replication factor None",
        lambda a: a.create_topic("typed", 1, None),
        ConfigError,
    ),
    (
        "replication factor > int32",
        lambda a: a.create_topic("typed", 1, 2**40),
        InvalidReplicationFactorError,
    ),
    ("config a str", lambda a: a.create_topic("typed", config="a=b"), ConfigError),
    ("config key int", lambda a: a.create_topic("typed", config={1: "x"}), ConfigError),
    ("config value float", lambda a: a.create_topic("typed", config={"x": 1.5}), ConfigError),
    ("delete None", lambda a: a.delete_topic(None), ConfigError),
    ("count str", lambda a: a.create_partitions("typed", "4"), ConfigError),
    ("grow name int", lambda a: a.create_partitions(7, 4), ConfigError),
    # A str is a sequence: this used to ask for topics "o", "r", "d", ...
    ("describe a str", lambda a: a.describe_topics("orders"), ConfigError),
    ("describe int names", lambda a: a.describe_topics([1]), ConfigError),
    ("describe_topic int", lambda a: a.describe_topic(1), ConfigError),
    ("group int", lambda a: a.describe_group(3), ConfigError),
]


@pytest.mark.parametrize(
    ("call", "error"), [(c, e) for _, c, e in BAD_CALLS], ids=[n for n, _, _ in BAD_CALLS]
)
def test_arguments_of_the_wrong_type_raise_the_sdk_error_before_anything_is_sent(
    admin: tidelog.Admin, call: Callable[[tidelog.Admin], Any], error: type[TidelogError]
) -> None:
    """These used to escape as TypeError or ValueError from protobuf, or be sent as
    something else than meant."""
    with pytest.raises(error) as raised:
        call(admin)
    assert type(raised.value) is error
    assert not [name for name in admin.list_topics() if name.startswith("typed")]


@pytest.mark.parametrize("timeout_ms", [0, -1, "30000", 30.0, True, 2**31])
def test_admin_timeout_out_of_range_or_of_the_wrong_type(timeout_ms: Any) -> None:
    """timeout_ms=0 made every call time out at once; the others escaped as TypeError."""
    with pytest.raises(ConfigError, match="timeout_ms"):
        tidelog.Admin("127.0.0.1:1", timeout_ms=timeout_ms)


def test_good_arguments_still_go_through_numbers_in_configs_as_text(
    admin: tidelog.Admin,
) -> None:
    admin.create_topic("checked", partitions=2, config={"retention.ms": 3_600_000})
    assert admin.describe_topic("checked").configs == {"retention.ms": "3600000"}
    admin.create_partitions("checked", 3)
    assert len(admin.describe_topics(("checked",))[0].partitions) == 3
    admin.delete_topic("checked")


def test_the_sdk_waits_longer_for_an_admin_change_than_the_gateway_spends_on_it() -> None:
    """The SDK sends its timeout_ms as the gateway's budget for the change: were its own
    deadline no longer, the gateway's answer (the change made) could arrive just after it,
    and the caller be told of a timeout."""
    for timeout_ms in (1, 1_000, 30_000, 120_000, INT32_MAX):
        assert change_deadline_s(timeout_ms) >= _timeout_s(timeout_ms) + 1.0
    default_ms = inspect.signature(tidelog.Admin).parameters["timeout_ms"].default
    assert change_deadline_s(default_ms) >= ADMIN_TIMEOUT_S + 1.0


def test_a_change_that_times_out_in_the_sdk_says_it_may_have_been_made(
    cluster: TestCluster,
) -> None:
    """A gateway that does not answer in time (stopped here) may still have passed the
    change on: the timeout must not read as "nothing happened"."""
    paused = cluster.start_gateway()
    admin = tidelog.Admin(paused.address, timeout_ms=1_000)
    admin.list_topics()  # connected: the timeout is the call's, not the connection's
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        with pytest.raises(RequestTimedOutError, match="the change may still have been made"):
            admin.create_topic("late")
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    paused.terminate()


def test_a_create_whose_replicas_do_not_answer_succeeds_within_the_timeout(
    cluster: TestCluster, gateway: GatewayProcess
) -> None:
    """With a replica that does not acknowledge its new partition (its broker stopped), the
    controller makes the topic, then waits for the replicas. The gateway gives it less
    than its own budget, so the controller answers in time and the call succeeds. It used
    to pass the same timeout_ms on, give up first, and answer REQUEST_TIMED_OUT for a
    topic that existed."""
    admin = tidelog.Admin(gateway.address, timeout_ms=2_000)
    broker = cluster.brokers[2]
    os.kill(broker.pid, signal.SIGSTOP)
    try:
        # Replication factor 2 of 3 brokers on 3 partitions: broker 2 hosts some.
        admin.create_topic("unacknowledged", partitions=3, replication_factor=2)
    finally:
        os.kill(broker.pid, signal.SIGCONT)
    assert "unacknowledged" in admin.list_topics()
    cluster.wait_brokers([0, 1, 2])


def test_a_bool_config_value_is_sent_as_kafka_writes_it(admin: tidelog.Admin) -> None:
    admin.create_topic("bool-config", config={"unclean.leader.election.enable": True})
    assert admin.describe_topic("bool-config").configs["unclean.leader.election.enable"] == "true"
