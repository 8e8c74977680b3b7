"""Topic config validation: Kafka's names, defaults, precise INVALID_CONFIG messages."""

from __future__ import annotations

import pytest

from services.controller.topic_config import (
    MAX_CONFIG_ENTRIES,
    TOPIC_CONFIG_DEFAULTS,
    effective_configs,
    validate_topic_configs,
)
from services.storage.log.config import TOPIC_CONFIG_FIELDS, LogConfig
from tidelog.errors import ErrorCode, InvalidConfigError


def test_every_log_setting_and_cluster_setting_has_a_default() -> None:
    assert set(TOPIC_CONFIG_FIELDS) <= set(TOPIC_CONFIG_DEFAULTS)
    assert TOPIC_CONFIG_DEFAULTS["min.insync.replicas"] == "1"
    assert TOPIC_CONFIG_DEFAULTS["unclean.leader.election.enable"] == "false"
    assert TOPIC_CONFIG_DEFAULTS["cleanup.policy"] == "delete"
    assert TOPIC_CONFIG_DEFAULTS["message.timestamp.type"] == "CreateTime"
    # Documented in docs/DEPLOY.md and read by leaders, once refused as unknown (audit).
    assert TOPIC_CONFIG_DEFAULTS["replica.lag.time.max.ms"] == "30000"
    assert TOPIC_CONFIG_DEFAULTS["message.timestamp.after.max.ms"] == "3600000"
    # The log defaults are LogConfig's own, so the two can never disagree.
    assert LogConfig.from_topic_config(TOPIC_CONFIG_DEFAULTS) == LogConfig()


def test_valid_overrides_are_returned_canonical() -> None:
    configs = validate_topic_configs(
        {
            "retention.ms": "-1",
            "segment.bytes": "1048576",
            "min.insync.replicas": "2",
            "unclean.leader.election.enable": "TRUE",
            "cleanup.policy": "delete",
            "message.timestamp.type": "LogAppendTime",
            "flush.messages": "9223372036854775807",
            "replica.lag.time.max.ms": "5000",
            "message.timestamp.after.max.ms": "60000",
        },
        replication_factor=3,
    )
    assert configs["unclean.leader.election.enable"] == "true"
    assert configs["retention.ms"] == "-1"
    assert configs["message.timestamp.type"] == "LogAppendTime"
    assert effective_configs(configs)["retention.bytes"] == "-1"  # default filled in
    assert effective_configs(configs)["segment.bytes"] == "1048576"


def test_pairs_are_accepted_and_empty_is_fine() -> None:
    assert validate_topic_configs([], replication_factor=1) == {}
    assert validate_topic_configs([("retention.ms", "5")], 1) == {"retention.ms": "5"}


@pytest.mark.parametrize(
    ("entries", "rf", "fragment"),
    [
        ({"retention.msec": "1"}, 1, "unknown topic config 'retention.msec'"),
        ({"retention.ms": "abc"}, 1, "not an integer"),
        ({"retention.ms": " 5"}, 1, "not an integer"),
        ({"retention.ms": "1_000"}, 1, "not an integer"),
        ({"retention.ms": "+5"}, 1, "not an integer"),
        ({"retention.ms": ""}, 1, "not an integer"),
        ({"min.insync.replicas": ""}, 3, "not an integer"),
        ({"retention.ms": "-2"}, 1, "retention.ms"),
        ({"segment.bytes": "0"}, 1, "segment.bytes"),
        # Each index file is preallocated to it: 10^12 made terabyte files, 2^63-2 none.
        ({"segment.index.bytes": "1000000000000"}, 1, "segment.index.bytes"),
        ({"segment.index.bytes": "9223372036854775806"}, 1, "between 48 and 2147483647"),
        ({"max.message.bytes": "1"}, 1, "max.message.bytes"),
        ({"page.cache.window.bytes": "-1"}, 1, "page.cache.window.bytes=-1: must be >= 0"),
        ({"retention.ms": "99999999999999999999"}, 1, "larger than"),
        ({"min.insync.replicas": "0"}, 3, "at least 1"),
        ({"min.insync.replicas": "4"}, 3, "larger than the replication factor 3"),
        ({"min.insync.replicas": "two"}, 3, "not an integer"),
        ({"unclean.leader.election.enable": "yes"}, 1, "true or false"),
        ({"replica.lag.time.max.ms": "0"}, 1, "must be an integer >= 1"),
        ({"replica.lag.time.max.ms": "soon"}, 1, "must be an integer >= 1"),
        ({"message.timestamp.after.max.ms": "-1"}, 1, "must be between 0 and"),
        ({"cleanup.policy": "compact"}, 1, "compaction is not supported"),
        ({"cleanup.policy": "compact,delete"}, 1, "compaction is not supported"),
        ({"cleanup.policy": "archive"}, 1, "only supported policy is delete"),
        ({"message.timestamp.type": "Whenever"}, 1, "must be one of CreateTime, LogAppendTime"),
        ({"message.timestamp.type": "logappendtime"}, 1, "must be one of"),  # Kafka's case
        ({"retention.ms": "1" * 2000}, 1, "too long"),
    ],
)
def test_bad_configs_are_rejected_with_a_precise_message(
    entries: dict[str, str], rf: int, fragment: str
) -> None:
    with pytest.raises(InvalidConfigError) as info:
        validate_topic_configs(entries, replication_factor=rf)
    assert info.value.code == ErrorCode.INVALID_CONFIG
    assert fragment in info.value.message


def test_duplicates_and_too_many_entries_are_rejected() -> None:
    with pytest.raises(InvalidConfigError, match="more than once"):
        validate_topic_configs([("retention.ms", "1"), ("retention.ms", "2")], 1)
    too_many = [("retention.ms", "1")] * (MAX_CONFIG_ENTRIES + 1)
    with pytest.raises(InvalidConfigError, match="at most"):
        validate_topic_configs(too_many, 1)


def test_cleanup_policy_delete_is_stored_canonical() -> None:
    for spelling in ("delete", " Delete ", "DELETE,delete"):
        assert validate_topic_configs({"cleanup.policy": spelling}, 1) == {
            "cleanup.policy": "delete"
        }
