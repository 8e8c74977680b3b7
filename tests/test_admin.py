"""``tidelog.Admin`` against a real cluster (etcd, 3 storage nodes, a controller, gateways):
arguments checked before anything is sent, and admin changes that time out."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

import tidelog
import tidelog.client
from services.gateway.server import ADMIN_TIMEOUT_S, _admin_budget_s
from tests.support.cluster import GatewayProcess, TestCluster, running_cluster, wait_for
from tests.support.process import REPO_ROOT, tidelog_env
from tidelog.admin import (
    BrokerDescription,
    ClusterDescription,
    PartitionDescription,
    TopicDescription,
    change_deadline_s,
)
from tidelog.client import GatewayConnection
from tidelog.errors import (
    ConfigError,
    ErrorCode,
    InvalidConfigError,
    InvalidPartitionsError,
    InvalidReplicationFactorError,
    InvalidRequestError,
    InvalidTopicError,
    MessageTooLargeError,
    RequestTimedOutError,
    TidelogError,
    UnknownTopicOrPartitionError,
)
from tidelog.formats import INT32_MAX
from tidelog.v1 import common_pb2, controller_pb2, gateway_pb2_grpc

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
    # A str is a sequence: this would remove configs "r", "e", "t", ...
    ("alter delete a str", lambda a: a.alter_topic_config("t", None, "retention.ms"), ConfigError),
    ("alter set a list", lambda a: a.alter_topic_config("t", [("a", "b")]), ConfigError),
    ("alter name int", lambda a: a.alter_topic_config(3, {"retention.ms": "1"}), ConfigError),
    # A TypeError escaped (found by an audit); None is taken, as for set_configs.
    ("alter delete an int", lambda a: a.alter_topic_config("t", None, 5), ConfigError),
    # These escaped as TypeError or ValueError, or were coerced (1.9 and "1" became 1, None
    # the topic "None"); found by an audit.
    ("offset bool", lambda a: a.alter_group_offsets("g", {("t", 0): True}), ConfigError),
    ("offset str", lambda a: a.alter_group_offsets("g", {("t", 0): "5"}), ConfigError),
    ("offset > int64", lambda a: a.alter_group_offsets("g", {("t", 0): 2**63}), ConfigError),
    ("offset negative", lambda a: a.alter_group_offsets("g", {("t", 0): -1}), ConfigError),
    ("offsets a list", lambda a: a.alter_group_offsets("g", [(("t", 0), 1)]), ConfigError),
    ("offset partition str", lambda a: a.alter_group_offsets("g", {("t", "0"): 1}), ConfigError),
    ("list partition float", lambda a: a.list_offsets([("t", 1.9)], "latest"), ConfigError),
    ("list partition str", lambda a: a.list_offsets([("t", "1")], "latest"), ConfigError),
    ("list topic None", lambda a: a.list_offsets([(None, 0)], "latest"), ConfigError),
    ("list partition > int32", lambda a: a.list_offsets([("t", 2**40)], "latest"), ConfigError),
    ("list timestamp > int64", lambda a: a.list_offsets([("t", 0)], 2**70), ConfigError),
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


def test_group_lag_is_per_partition_and_negative_past_the_log_end(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """A group's lag comes per partition: one whose leader does not answer shows none
    while the others show theirs (one used to cost every partition its HW and lag, after
    30 s of retries), and an offset past the log end shows a negative lag, as Kafka's tool
    does (it was shown as 0, caught up). Found by an audit."""
    admin.create_topic("lagging", partitions=3, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        for p in range(3):
            producer.send_batch("lagging", [b"x"] * 4, partition=p)
        producer.flush()
    committed = {("lagging", 0): 1, ("lagging", 1): 2, ("lagging", 2): 9}
    admin.alter_group_offsets("laggards", committed)
    lags = {o.partition: o.lag for o in admin.describe_group("laggards")}
    assert lags == {0: 3, 1: 2, 2: -5}
    leaders = {p.partition: p.leader for p in admin.describe_topic("lagging").partitions}
    others = [p for p in (0, 2) if leaders[p] != leaders[1]]
    assert others  # three partitions spread over three brokers
    stopped = cluster.brokers[leaders[1]]
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        described = {o.partition: o for o in admin.describe_group("laggards")}
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    assert described[1].lag is None and described[1].high_watermark == -1
    assert {p: described[p].lag for p in others} == {p: lags[p] for p in others}


def test_topics_describe_says_why_a_partition_has_no_offsets(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """`tidelog topics describe` of a partition whose leader does not answer shows "-"
    and the leader's error (null and "error" in JSON); it showed -1 with no word why."""
    admin.create_topic("mute", partitions=3, replication_factor=1)
    leaders = {p.partition: p.leader for p in admin.describe_topic("mute").partitions}
    stopped = cluster.brokers[leaders[1]]

    def describe(*how: str) -> str:
        ran = subprocess.run(
            [sys.executable, "-m", "tidelog", "topics", "describe", "mute", *how],
            capture_output=True, text=True, timeout=60, check=True, cwd=REPO_ROOT,
            env={**tidelog_env(), "TIDELOG_GATEWAY": gateway.address},
        )  # fmt: skip
        return ran.stdout

    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        table = describe()
        (shown,) = json.loads(describe("--output", "json"))
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    row = next(line.split() for line in table.splitlines() if line.split()[:2] == ["mute", "1"])
    assert row[5:7] == ["-", "-"] and len(row) > 7, table
    partition = shown["partitions"][1]
    assert partition["high_watermark"] is None and partition["log_end_offset"] is None
    assert partition["error"], partition
    assert shown["partitions"][0]["error"] is None
    assert shown["partitions"][0]["high_watermark"] == 0


def test_describe_topics_of_more_names_than_a_request_takes(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Kafka's describeTopics takes any number of names: a list over the gateway's
    1,000 per request failed whole with INVALID_REQUEST (found by an audit). It is asked
    in several, each name once, in the order named."""
    admin.create_topic("described-a", 1, 1)
    admin.create_topic("described-b", 1, 1)
    names = ["described-b", "described-a"] * 600  # 1,200 names, two topics
    assert [t.name for t in admin.describe_topics(names)] == ["described-b", "described-a"]


def test_a_topic_deleted_can_be_created_again_at_once(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """delete_topic answered once the topic's key was gone, but the controller's pending
    deletion record (replicas on live brokers, then every group's offsets scanned) went
    later, and a create of the name meanwhile was refused TOPIC_ALREADY_EXISTS "is being
    deleted", not retriable: with a few thousand committed offsets in the cluster, every
    time (found by an audit). DeleteTopics now answers once the deletion completed."""
    admin.create_topic("recreation-offsets", partitions=4, replication_factor=1)
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda i: admin.alter_group_offsets(
                    f"recreation-group-{i}", {("recreation-offsets", p): i for p in range(4)}
                ),
                range(1_000),
            )
        )
    for attempt in range(5):
        admin.create_topic("recreated", partitions=2, replication_factor=1)
        admin.delete_topic("recreated")
        assert "recreated" not in admin.list_topics(), attempt
    admin.create_topic("recreated", partitions=2, replication_factor=1)


@pytest.mark.parametrize("timeout_ms", [0, -1, "30000", 30.0, True, 2**31])
def test_admin_timeout_out_of_range_or_of_the_wrong_type(timeout_ms: Any) -> None:
    """timeout_ms=0 made every call time out at once; the others escaped as TypeError."""
    with pytest.raises(ConfigError, match="timeout_ms"):
        tidelog.Admin("127.0.0.1:1", timeout_ms=timeout_ms)


def test_an_admin_change_given_too_little_time_says_so(gateway: GatewayProcess) -> None:
    """With timeout_ms 50 the gateway ran out of its budget before it tried the controller:
    the caller read "no controller is active right now" of a healthy cluster, and "the
    change may still have been made" of a change never sent. It is refused now, as bad
    input that changes nothing."""
    tiny = tidelog.Admin(gateway.address, timeout_ms=50)
    with pytest.raises(InvalidRequestError, match="timeout_ms 50 is too short") as raised:
        tiny.create_topic("hurried")
    assert "may still have been made" not in str(raised.value)
    assert "hurried" not in tidelog.Admin(gateway.address).list_topics()
    assert tidelog.Admin(gateway.address, timeout_ms=51).list_topics() is not None


def test_more_partitions_than_a_request_takes_are_asked_in_several(
    gateway: GatewayProcess, admin: tidelog.Admin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway takes at most MAX_PARTITIONS_PER_REQUEST partitions per ListOffsets or
    CommitOffsets; the SDK sent any number in one, so a Spark read over more than 10,000
    partitions could not be planned (found by an audit). The limit is lowered to 2 here
    so that 5 partitions take three requests."""
    admin.create_topic("many-asks", partitions=5, replication_factor=1)
    with tidelog.Producer(gateway.address) as producer:
        for p in range(5):
            producer.send_batch("many-asks", [b"v"] * (p + 1), partition=p).result(30)
    connection = GatewayConnection.get(gateway.address, 10_000)
    indexes = range(5)
    tps = [("many-asks", p) for p in indexes]
    whole = connection.bounds(tps)
    monkeypatch.setattr(tidelog.client, "MAX_PARTITIONS_PER_REQUEST", 2)
    asked: list[int] = []
    call = connection.call

    def counting(method: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(len(getattr(request, "partitions", getattr(request, "offsets", []))))
        return call(method, request, *args, **kwargs)

    monkeypatch.setattr(connection, "call", counting)
    assert connection.bounds(tps) == whole
    assert {b.latest for b in whole.values()} == {1, 2, 3, 4, 5}
    assert connection.commit_offsets("many-asks-group", {tp: 1 for tp in tps}) == []
    assert asked == [2, 2, 1, 2, 2, 1, 2, 2, 1]  # earliest, latest, commit
    monkeypatch.undo()
    committed = admin.describe_group("many-asks-group")
    assert sorted((c.partition, c.committed_offset) for c in committed) == [
        (p, 1) for p in range(5)
    ]


def test_a_partition_led_by_a_broker_not_registered_is_offline() -> None:
    """Until the controller moves a dead broker's leaderships (which an etcd refusing its
    transactions stopped for good), its partitions still named it leader: `tidelog
    cluster` counted them healthy (found by an audit)."""
    partition = PartitionDescription(
        partition=0, leader=3, leader_epoch=1, replicas=(1, 3), isr=(1, 3),
        high_watermark=-1, log_start_offset=-1, log_end_offset=-1,
    )  # fmt: skip
    topic = TopicDescription(
        name="t", topic_id="", replication_factor=2, configs={}, partitions=(partition,)
    )
    broker = BrokerDescription(1, "127.0.0.1", 9092, None, 7)
    cluster = ClusterDescription("c", 1, "127.0.0.1:9093", (broker,), (topic,))
    assert cluster.offline_partitions == [("t", 0)]
    live = ClusterDescription("c", 1, "127.0.0.1:9093", (broker,), ())
    assert live.offline_partitions == []


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
    for timeout_ms in (51, 1_000, 30_000, 120_000, INT32_MAX):
        assert change_deadline_s(timeout_ms) >= _admin_budget_s(timeout_ms) + 1.0
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


def test_topic_configs_are_altered_live_and_brokers_apply_them_at_once(
    cluster: TestCluster, gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Kafka's incrementalAlterConfigs: SET and DELETE of overrides on a live topic. The
    brokers take the change without a restart: a lowered max.message.bytes refuses the
    batch it accepted before, and removing the override accepts it again."""
    cluster.wait_brokers([0, 1, 2], 30)  # (an earlier test stopped one for a while)
    admin.create_topic(
        "altered", partitions=2, replication_factor=2, config={"retention.ms": 60_000}
    )
    big = b"x" * 50_000
    # Retried sends (the default): the broker the test before paused may lose its session
    # only now, and a leader moving away from it is not what this test is about.
    with tidelog.Producer(gateway.address, acks="all", delivery_timeout_ms=30_000) as producer:
        producer.send("altered", big, partition=0).result(30)
        configs = admin.alter_topic_config(
            "altered", {"max.message.bytes": 10_000, "min.insync.replicas": "2"}, ["retention.ms"]
        )
        assert configs == {"max.message.bytes": "10000", "min.insync.replicas": "2"}
        assert admin.describe_topic("altered").configs == configs
        with pytest.raises(MessageTooLargeError):
            producer.send("altered", big, partition=0).result(30)
        assert admin.alter_topic_config("altered", delete_configs=["max.message.bytes"]) == {
            "min.insync.replicas": "2"
        }
        assert admin.alter_topic_config("altered", {"min.insync.replicas": 2}, None) == {
            "min.insync.replicas": "2"
        }
        # acks=all now needs both replicas in sync: a broker the test before stopped may
        # have been evicted from the ISR when the controller saw it register again (a
        # new epoch), after this topic was made; it rejoins once it fetches.
        wait_for(
            lambda: len(admin.describe_topic("altered").partitions[0].isr) == 2,
            30,
            "both replicas of altered-0 in sync",
        )
        producer.send("altered", big, partition=0).result(30)
        # Setting what is set changes nothing and says so.
        assert admin.alter_topic_config("altered", {"min.insync.replicas": "2"}) == {
            "min.insync.replicas": "2"
        }
    admin.delete_topic("altered")


@pytest.mark.parametrize(
    ("change", "error", "fragment"),
    [
        ({"set_configs": {"retention.mss": "1"}}, InvalidConfigError, "unknown topic config"),
        ({"delete_configs": ["retention.mss"]}, InvalidConfigError, "unknown topic config"),
        ({"set_configs": {"min.insync.replicas": "2"}}, InvalidConfigError, "replication factor"),
        ({"set_configs": {"retention.ms": "soon"}}, InvalidConfigError, "not an integer"),
        ({"set_configs": {"cleanup.policy": "compact"}}, InvalidConfigError, "compaction"),
        (
            {"set_configs": {"retention.ms": "1"}, "delete_configs": ["retention.ms"]},
            InvalidRequestError,
            "more than once",
        ),
        (
            {"delete_configs": [f"x{i}" for i in range(100)]},
            InvalidRequestError,
            "the limit is 64",
        ),
    ],
)
def test_a_bad_config_change_is_refused_whole_and_changes_nothing(
    admin: tidelog.Admin, change: dict[str, Any], error: type[TidelogError], fragment: str
) -> None:
    if "refused" not in admin.list_topics():
        admin.create_topic("refused", replication_factor=1, config={"retention.ms": 60_000})
    with pytest.raises(error, match=fragment):
        # The good half of a change goes no further than the bad half.
        admin.alter_topic_config("refused", **{"set_configs": {"segment.ms": "1000"}, **change})
    assert admin.describe_topic("refused").configs == {"retention.ms": "60000"}
    # validate_only answers what the overrides would be, and changes nothing either.
    assert admin.alter_topic_config(
        "refused", {"segment.ms": "1000"}, ["retention.ms"], validate_only=True
    ) == {"segment.ms": "1000"}
    assert admin.describe_topic("refused").configs == {"retention.ms": "60000"}


def test_altering_a_topic_that_does_not_exist(admin: tidelog.Admin) -> None:
    with pytest.raises(UnknownTopicOrPartitionError):
        admin.alter_topic_config("no-such-topic", {"retention.ms": "1"})
    with pytest.raises(InvalidTopicError):
        admin.alter_topic_config("bad/name", {"retention.ms": "1"})


def test_a_request_naming_a_topic_twice_changes_nothing(
    gateway: GatewayProcess, admin: tidelog.Admin
) -> None:
    """Every entry of a duplicated name is refused (Kafka's INVALID_REQUEST), not the
    second one only after the first was applied."""
    admin.create_topic("twice", partitions=2)
    with grpc.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        new = controller_pb2.CreatableTopic(
            name="twice-new", num_partitions=1, replication_factor=1
        )
        answers = [
            stub.CreateTopics(controller_pb2.CreateTopicsRequest(topics=[new, new]), timeout=30),
            stub.DeleteTopics(controller_pb2.DeleteTopicsRequest(names=["twice"] * 2), timeout=30),
            stub.CreatePartitions(
                controller_pb2.CreatePartitionsRequest(
                    topics=[controller_pb2.PartitionIncrease(name="twice", count=c) for c in (3, 4)]
                ),
                timeout=30,
            ),
            stub.IncrementalAlterConfigs(
                controller_pb2.IncrementalAlterConfigsRequest(
                    topics=[
                        controller_pb2.AlterableTopicConfig(
                            name="twice", set=[common_pb2.ConfigEntry(name="segment.ms", value=v)]
                        )
                        for v in ("1000", "2000")
                    ]
                ),
                timeout=30,
            ),
        ]
    for answer in answers:
        assert [(r.error.code, "more than once" in r.error.message) for r in answer.topics] == [
            (ErrorCode.INVALID_REQUEST, True)
        ] * 2
    assert "twice-new" not in admin.list_topics()
    described = admin.describe_topic("twice")
    assert (len(described.partitions), described.configs) == (2, {})
    admin.delete_topic("twice")


def test_names_equal_but_for_dot_and_underscore_collide(admin: tidelog.Admin) -> None:
    """Kafka refuses a topic whose name differs from an existing one only in '.' versus
    '_' (the CLI audit found both created)."""
    admin.create_topic("metric.name_x")
    with pytest.raises(InvalidTopicError, match=r"collides with existing topic 'metric\.name_x'"):
        admin.create_topic("metric_name.x")
    assert "metric_name.x" not in admin.list_topics()
    admin.delete_topic("metric.name_x")
    admin.create_topic("metric_name.x")  # free once the other is gone
    admin.delete_topic("metric_name.x")


def test_list_offsets_keeps_to_the_admins_timeout_while_the_leader_is_stopped(
    tmp_path: Path,
) -> None:
    """Found by an audit: ListOffsets retries (a leader not answering) gave each attempt a
    whole request timeout, so one begun just before the deadline doubled the call (and
    bounds(), two such calls, four times). Each attempt now gets what is left. A cluster
    of its own: a SIGSTOPped broker would disturb the module's."""
    with running_cluster(tmp_path, brokers=1) as cluster:
        gateway = cluster.start_gateway()
        with tidelog.Admin(gateway.address, timeout_ms=20_000) as setup:
            setup.create_topic("slow", partitions=1, replication_factor=1)
        broker = cluster.brokers[0]
        admin = tidelog.Admin(gateway.address, timeout_ms=2_000)
        os.kill(broker.pid, signal.SIGSTOP)  # the leader stops answering
        try:
            started = time.monotonic()
            with pytest.raises(TidelogError):
                admin.list_offsets([("slow", 0)], "latest")
            elapsed = time.monotonic() - started
        finally:
            os.kill(broker.pid, signal.SIGCONT)
        assert elapsed < 3.0, f"list_offsets took {elapsed:.2f} s with timeout_ms=2000"


def test_list_offsets_of_a_missing_topic_or_partition_fails_at_once(
    gateway: GatewayProcess,
) -> None:
    """The gateway answers UNKNOWN_TOPIC_OR_PARTITION at once, but the SDK asked again
    until the admin's timeout and then raised REQUEST_TIMED_OUT "no answer before the
    deadline", the real error lost. Kafka's Admin.listOffsets fails such a partition at
    once (KAFKA-12879); so does this now (found by an audit)."""
    admin = tidelog.Admin(gateway.address, timeout_ms=5_000)
    admin.create_topic("offsets-of-one", 1)
    for asked in ([("no-such-topic", 0)], [("offsets-of-one", 3)]):
        started = time.monotonic()
        with pytest.raises(UnknownTopicOrPartitionError):
            admin.list_offsets(asked, "latest")
        assert time.monotonic() - started < 2.0


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1:99999",
        "",
        "no-port",
        "127.0.0.1:0",
        # Spaces (a quoted YAML value) and digits of other scripts passed the check, and
        # every call then failed as a retriable network error, like an outage (found by
        # an audit).
        " 127.0.0.1:9094",
        "127.0.0.1 :9094",
        "gateway host:9094",
        "127.0.0.1:" + "".join(chr(0x0660 + int(d)) for d in "9094"),
    ],
)
def test_a_gateway_address_no_connection_can_use_is_refused(address: str) -> None:
    """The CLI checked --gateway and the SDK $TIDELOG_GATEWAY, but an address given to
    the SDK was taken as it was: gRPC wrapped port 99999 round to 34463 and connected
    there, and "" meant the default gateway (found by an audit)."""
    for make in (
        lambda: tidelog.Admin(address, timeout_ms=1_000),
        lambda: tidelog.Producer(address),
        lambda: tidelog.Consumer(address),
    ):
        with pytest.raises(ConfigError, match="gateway address"):
            make()
