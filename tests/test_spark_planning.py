"""The Spark source's option checking and offset planning (pure: no Spark, no cluster)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidelog.client import GatewayConnection
from tidelog.errors import ConfigError, OffsetOutOfRangeError
from tidelog.spark.options import (
    EARLIEST,
    LATEST,
    READ_OPTIONS,
    WRITE_OPTIONS,
    OffsetSpec,
    parse_read_options,
    parse_write_options,
)
from tidelog.spark.planning import (
    Bounds,
    DataLoss,
    OffsetRange,
    check_start_offsets,
    end_offsets,
    from_json_offsets,
    mark_initial,
    min_partitions_of,
    planned_start,
    ranges_between,
    rate_limit,
    resolve_offsets,
    resume_offsets,
    split_ranges,
    to_json_offsets,
    topic_ids_of,
    with_min_partitions,
)

GW = {"gateway": "127.0.0.1:9094"}


def test_exactly_one_topic_selector() -> None:
    with pytest.raises(ConfigError, match="exactly one of"):
        parse_read_options(GW, streaming=False)
    with pytest.raises(ConfigError, match=r"found: subscribe, assign"):
        parse_read_options({**GW, "subscribe": "a", "assign": '{"a": [0]}'}, streaming=False)


def test_option_names_are_case_insensitive_and_defaults_follow_spark() -> None:
    batch = parse_read_options({**GW, "SUBSCRIBE": "a,b, a"}, streaming=False)
    assert batch.topics == ("a", "b")
    assert batch.starting.kind == "earliest"
    assert batch.ending.kind == "latest"
    assert batch.fail_on_data_loss is True
    assert batch.include_headers is False
    stream = parse_read_options({**GW, "subscribe": "a"}, streaming=True)
    assert stream.starting.kind == "latest"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"subscribe": ""}, "comma-separated list"),
        ({"subscribe": "a,,b"}, "comma-separated list"),
        ({"subscribe": "bad/name"}, "subscribe: topic name"),
        ({"subscribePattern": "(unclosed"}, "not a valid regex"),
        ({"assign": "{not json"}, "assign is not valid JSON"),
        ({"assign": '{"a": []}'}, "non-empty list"),
        ({"assign": '{"a": [-1]}'}, "is not >= 0"),
        ({"subscribe": "a", "startingOffsets": "{bad"}, "startingOffsets is not valid JSON"),
        ({"subscribe": "a", "startingOffsets": '{"a": {"x": 1}}'}, "not an integer"),
        ({"subscribe": "a", "startingOffsets": '{"a": {"0": -3}}'}, "integer >= -2"),
        ({"subscribe": "a", "startingOffsets": "newest"}, "'earliest', 'latest' or JSON"),
        ({"subscribe": "a", "startingOffsets": "latest"}, "not allowed in a batch query"),
        ({"subscribe": "a", "startingOffsets": '{"a": {"0": -1}}'}, "not allowed in a batch"),
        ({"subscribe": "a", "endingOffsets": "earliest"}, "'earliest' is not allowed"),
        ({"subscribe": "a", "endingOffsets": '{"a": {"0": -2}}'}, r"-2 \(earliest\)"),
        ({"subscribe": "a", "minPartitions": "0"}, "minPartitions must be between"),
        ({"subscribe": "a", "failOnDataLoss": "yes"}, "true or false"),
        ({"subscribe": "a", "maxOffsetsPerTrigger": "10"}, "streaming queries only"),
        ({"subscribe": "a", "gateway": "nohost"}, "HOST:PORT"),
        ({"subscribe": "a", "groupId": "bad group"}, "groupId"),
    ],
)
def test_bad_read_options_name_the_option(options: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_read_options({**GW, **options}, streaming=False)


@pytest.mark.parametrize("streaming", [False, True], ids=["batch", "streaming"])
def test_direct_option_is_a_case_insensitive_boolean(streaming: bool) -> None:
    reads = {"subscribe": "a"}
    if streaming:
        reads["maxOffsetsPerTrigger"] = "10"
    for parse, base in (
        (parse_read_options, {**GW, **reads}),
        (parse_write_options, {**GW, "topic": "a"}),
    ):
        assert parse(base, streaming=streaming).direct is False  # the default
        for text, expected in (("true", True), ("TRUE", True), (" True ", True), ("False", False)):
            assert parse({**base, "direct": text}, streaming=streaming).direct is expected
            assert parse({**base, "DIRECT": text}, streaming=streaming).direct is expected
        for bad in ("yes", "1", "", "on", "truee"):
            with pytest.raises(ConfigError, match=rf"direct must be true or false, not '{bad}'$"):
                parse({**base, "direct": bad}, streaming=streaming)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (
            "startingOffset",
            r"unknown option 'startingOffset' for a tidelog read; did you mean "
            r"'startingOffsets'\?$",
        ),
        ("failondataloss ", r"did you mean 'failOnDataLoss'\?$"),
        ("maxOffsetPerTrigger", r"did you mean 'maxOffsetsPerTrigger'\?$"),
        ("SUBSCRIBEPATERN", r"did you mean 'subscribePattern'\?$"),
        ("topic", r"option 'topic' is for writes, not reads$"),
        ("kafka.bootstrap.servers", r"no 'kafka\.' options \(the address goes in .*'gateway'\)$"),
        ("zzz", r"unknown option 'zzz' for a tidelog read; the read options are gateway, "),
    ],
)
def test_unknown_read_option_names_are_refused_with_the_close_match(
    option: str, message: str
) -> None:
    """A misspelt option used to be ignored: the read went on from the default offsets."""
    for streaming in (False, True):
        with pytest.raises(ConfigError, match=message):
            parse_read_options({**GW, "subscribe": "a", option: "1"}, streaming=streaming)


def test_unknown_write_option_names_are_refused_and_sparks_own_pass() -> None:
    with pytest.raises(ConfigError, match=r"unknown option 'batchByte' .*'batchBytes'\?$"):
        parse_write_options({**GW, "topic": "t", "batchByte": "1"}, streaming=False)
    with pytest.raises(ConfigError, match=r"option 'subscribe' is for reads, not writes$"):
        parse_write_options({**GW, "topic": "t", "subscribe": "t"}, streaming=True)
    # What Spark itself puts in the options (load(path), save(path), writeStream's
    # checkpointLocation and queryName; keys as Spark passes them, lower-cased).
    spark_own = {
        "path": "/p",
        "paths": '["/a"]',
        "checkpointlocation": "/c",
        "queryname": "q",
    }
    parse_write_options({**GW, "topic": "t", **spark_own}, streaming=True)
    parse_read_options({**GW, "subscribe": "t", **spark_own}, streaming=True)
    # Every option of either kind is known, in any case (a value of "x" may be refused).
    for parse, base, names in (
        (parse_read_options, {"subscribe": "a"}, READ_OPTIONS),
        (parse_write_options, {"topic": "a"}, WRITE_OPTIONS),
    ):
        for name in names:
            for spelt in (name, name.upper()):
                try:
                    parse({**GW, **base, spelt: "x"}, streaming=True)
                except ConfigError as exc:
                    assert not exc.message.startswith(("unknown option", "option ")), exc


def test_streaming_only_and_batch_only_options() -> None:
    with pytest.raises(ConfigError, match="batch queries only"):
        parse_read_options({**GW, "subscribe": "a", "endingOffsets": "latest"}, streaming=True)
    stream = parse_read_options(
        {**GW, "subscribe": "a", "maxOffsetsPerTrigger": "100"}, streaming=True
    )
    assert stream.max_offsets_per_trigger == 100


def test_json_offsets_and_timestamps_parse() -> None:
    options = parse_read_options(
        {
            **GW,
            "assign": '{"a": [0, 1], "b": [3]}',
            "startingOffsets": '{"a": {"0": 5, "1": -2}, "b": {"3": 7}}',
            "startingOffsetsByTimestamp": '{"a": {"0": 1000}}',
            "startingTimestamp": "2000",
        },
        streaming=False,
    )
    assert options.assigned == (("a", 0), ("a", 1), ("b", 3))
    assert options.starting == OffsetSpec("json", {("a", 0): 5, ("a", 1): EARLIEST, ("b", 3): 7})
    # startingTimestamp wins over startingOffsetsByTimestamp, as in Spark's Kafka source
    # (an audit found the per-partition one winning).
    assert options.starting_timestamp is not None
    assert options.starting_timestamp.per_partition is None
    assert options.starting_timestamp.all_partitions_ms == 2000
    by_partition = parse_read_options(
        {**GW, "assign": '{"a": [0]}', "startingOffsetsByTimestamp": '{"a": {"0": 1000}}'},
        streaming=False,
    ).starting_timestamp
    assert by_partition is not None and by_partition.per_partition == {("a", 0): 1000}
    # Past int64 (a protobuf ValueError naming no option, before).
    with pytest.raises(ConfigError, match=r"startingOffsetsByTimestamp: a-0 must be an integer"):
        parse_read_options(
            {
                **GW,
                "assign": '{"a": [0]}',
                "startingOffsetsByTimestamp": '{"a": {"0": 99999999999999999999999}}',
            },
            streaming=False,
        )


def test_write_options() -> None:
    options = parse_write_options({**GW, "topic": "t", "acks": "-1"}, streaming=False)
    assert options.acks == "all"
    assert not options.exactly_once
    with pytest.raises(ConfigError, match="acks must be"):
        parse_write_options({**GW, "acks": "2"}, streaming=False)
    with pytest.raises(ConfigError, match="streaming writes only"):
        parse_write_options({**GW, "deliveryGuarantee": "exactly-once"}, streaming=False)
    with pytest.raises(ConfigError, match="needs acks=all"):
        parse_write_options(
            {**GW, "deliveryGuarantee": "exactly-once", "acks": "1"}, streaming=True
        )


BOUNDS = {("a", 0): Bounds(10, 100), ("a", 1): Bounds(0, 5)}


def test_resolve_offsets_rules() -> None:
    assert resolve_offsets(OffsetSpec("earliest"), BOUNDS, option="s") == {
        ("a", 0): 10,
        ("a", 1): 0,
    }
    assert resolve_offsets(OffsetSpec("latest"), BOUNDS, option="s") == {
        ("a", 0): 100,
        ("a", 1): 5,
    }
    spec = OffsetSpec("json", {("a", 0): 50, ("a", 1): LATEST})
    assert resolve_offsets(spec, BOUNDS, option="s") == {
        ("a", 0): 50,
        ("a", 1): 5,
    }
    partial = OffsetSpec("json", {("a", 0): 50})
    with pytest.raises(ConfigError, match="missing: a-1"):
        resolve_offsets(partial, BOUNDS, option="s")
    with pytest.raises(ConfigError, match="not being read: b-0"):
        resolve_offsets(OffsetSpec("json", {("b", 0): 1}), BOUNDS, option="s")


def test_start_offsets_below_earliest_are_data_loss() -> None:
    with pytest.raises(
        OffsetOutOfRangeError,
        match=r"a-0: some data may have been lost: offsets \[3, 10\) were deleted "
        r"\(retention\) before they were read; set the option failOnDataLoss=false",
    ):
        check_start_offsets({("a", 0): 3}, BOUNDS, fail_on_data_loss=True)
    starts, losses = check_start_offsets({("a", 0): 3}, BOUNDS, fail_on_data_loss=False)
    assert starts == {("a", 0): 10}
    assert [(x.topic, x.partition, x.resume_at) for x in losses] == [("a", 0, 10)]
    assert (
        losses[0]
        .message(fail_on_data_loss=False)
        .endswith("failOnDataLoss=false: reading goes on from offset 10")
    )


@pytest.mark.parametrize("fail_on_data_loss", [True, False])
def test_start_offsets_past_latest_are_refused(fail_on_data_loss: bool) -> None:
    """They used to be moved down to the latest offset, so the query read records it had
    asked to skip; refused as an ending offset past the latest is (not data loss, so
    failOnDataLoss does not matter)."""
    with pytest.raises(
        ConfigError, match=r"a-0: the starting offset 500 is past the latest offset 100$"
    ):
        check_start_offsets(
            {("a", 0): 500, ("a", 1): 0}, BOUNDS, fail_on_data_loss=fail_on_data_loss
        )
    assert check_start_offsets({("a", 0): 100}, BOUNDS, fail_on_data_loss=True) == (
        {("a", 0): 100},
        [],
    )


def test_resume_offsets_without_loss() -> None:
    """Where the checkpoint is within the bounds, reading resumes there; a partition new
    since the checkpoint resumes at 0."""
    starts, losses = resume_offsets({("a", 0): 10, ("a", 1): 5}, BOUNDS, fail_on_data_loss=True)
    assert (starts, losses) == ({("a", 0): 10, ("a", 1): 5}, [])
    starts, losses = resume_offsets({("a", 0): 50}, BOUNDS, fail_on_data_loss=True)
    assert (starts, losses) == ({("a", 0): 50, ("a", 1): 0}, [])


@pytest.mark.parametrize(
    ("checkpoint", "message", "resumed"),
    [
        # The latest offset fell below the checkpoint (topic deleted and re-created, log
        # truncated): the query used to wait, silently, until the new log passed it.
        (
            {("a", 0): 500, ("a", 1): 5},
            r"a-0: some data may have been lost: its latest offset 100 is below the offset "
            r"500 already reached \(topic deleted and re-created, or log truncated\?\)",
            {("a", 0): 100, ("a", 1): 5},
        ),
        # Retention deleted records before they were read.
        (
            {("a", 0): 4, ("a", 1): 5},
            r"a-0: some data may have been lost: offsets \[4, 10\) were deleted",
            {("a", 0): 10, ("a", 1): 5},
        ),
        # A new partition's first records were deleted before the query saw it.
        (
            {("a", 1): 5},
            r"a-0: some data may have been lost: offsets \[0, 10\) were deleted",
            {("a", 0): 10, ("a", 1): 5},
        ),
        # A partition of the checkpoint is gone.
        (
            {("a", 0): 10, ("a", 1): 5, ("b", 0): 7},
            r"b-0: some data may have been lost: the partition no longer exists",
            {("a", 0): 10, ("a", 1): 5},
        ),
    ],
    ids=["latest-below-checkpoint", "retention", "new-partition-retention", "gone"],
)
def test_resume_offsets_report_data_loss(
    checkpoint: dict[tuple[str, int], int], message: str, resumed: dict[tuple[str, int], int]
) -> None:
    with pytest.raises(
        OffsetOutOfRangeError, match=f"{message}.*; set the option failOnDataLoss=false"
    ):
        resume_offsets(checkpoint, BOUNDS, fail_on_data_loss=True)
    starts, losses = resume_offsets(checkpoint, BOUNDS, fail_on_data_loss=False)
    assert starts == resumed
    assert len(losses) == 1
    assert losses[0].message(fail_on_data_loss=False).startswith(message.replace("\\", ""))


def test_several_losses_fail_in_one_line() -> None:
    with pytest.raises(OffsetOutOfRangeError, match=r"a-0: .*\(and 1 more partitions\)$"):
        resume_offsets({("a", 0): 500, ("a", 1): 9}, BOUNDS, fail_on_data_loss=True)
    gone = DataLoss("b", 0, "the partition no longer exists (topic deleted?)", None)
    assert gone.message(fail_on_data_loss=False).endswith("reading goes on without this partition")


def test_rate_limit_shares_by_backlog_and_never_starves() -> None:
    starts = {("a", 0): 0, ("a", 1): 0, ("a", 2): 0}
    latest = {("a", 0): 1000, ("a", 1): 100, ("a", 2): 1}
    ends = rate_limit(starts, latest, 110)
    assert ends == {("a", 0): 99, ("a", 1): 9, ("a", 2): 1}
    assert rate_limit(starts, latest, 10_000) == latest


@given(
    st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 1000)), min_size=1, max_size=8),
    st.integers(1, 5000),
)
def test_rate_limit_properties(pairs: list[tuple[int, int]], limit: int) -> None:
    starts = {("t", i): start for i, (start, _) in enumerate(pairs)}
    latest = {("t", i): start + extra for i, (start, extra) in enumerate(pairs)}
    ends = rate_limit(starts, latest, limit)
    for tp, end in ends.items():
        assert starts[tp] <= end <= latest[tp]
        if latest[tp] > starts[tp]:
            assert end > starts[tp]  # every lagging partition progresses
    assert sum(ends[tp] - starts[tp] for tp in ends) <= limit + len(pairs)


@given(
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 10**5)), min_size=1, max_size=6),
    st.integers(1, 64),
)
def test_split_ranges_covers_exactly(pairs: list[tuple[int, int]], min_partitions: int) -> None:
    ranges = [OffsetRange("t", i, s, s + n) for i, (s, n) in enumerate(pairs)]
    pieces = split_ranges(ranges, min_partitions)
    assert len(pieces) >= min(min_partitions, sum(r.size for r in ranges))
    for r in ranges:
        mine = [p for p in pieces if p.partition == r.partition]
        assert mine[0].start == r.start and mine[-1].end == r.end
        assert all(a.end == b.start for a, b in itertools.pairwise(mine))
        assert all(p.size > 0 for p in mine)


def test_ranges_and_json_offsets_round_trip() -> None:
    starts = {("a", 0): 5, ("b", 2): 7}
    ends = {("a", 0): 9, ("b", 2): 7, ("b", 3): 4}
    assert ranges_between(starts, ends) == [OffsetRange("a", 0, 5, 9), OffsetRange("b", 3, 0, 4)]
    assert to_json_offsets(ends) == {"a": {"0": 9}, "b": {"2": 7, "3": 4}}
    assert from_json_offsets(to_json_offsets(ends)) == ends


def test_each_request_timeout_gets_its_own_gateway_connection() -> None:
    """A task's requestTimeoutMs holds even when an earlier task in the same worker asked
    for another: the per-process connection cache is keyed by the timeout too."""
    address = "127.0.0.1:1"  # never dialled: a connection connects on its first call
    short = GatewayConnection.get(address, 1_000)
    long = GatewayConnection.get(address, 60_000)
    assert (short.timeout_s, long.timeout_s) == (1.0, 60.0)
    assert GatewayConnection.get(address, 1_000) is short


def test_a_topic_created_again_since_the_checkpoint_is_data_loss_whatever_its_size() -> None:
    """The checkpoint names each topic's id: a topic deleted and created again is
    detected even when the new one has grown past the checkpoint's offsets (Spark's
    Kafka source reads on from there, skipping the new topic's first records)."""
    checkpoint = to_json_offsets({("a", 0): 50, ("a", 1): 3}, {"a": "id-1", "gone": "id-9"})
    assert checkpoint == {"a": {"0": 50, "1": 3}, "$topicIds": {"a": "id-1"}}
    assert from_json_offsets(checkpoint) == {("a", 0): 50, ("a", 1): 3}
    assert topic_ids_of(checkpoint) == {"a": "id-1"}
    assert topic_ids_of({"a": {"0": 1}}) == {}  # a checkpoint from before topic ids

    same = resume_offsets(
        from_json_offsets(checkpoint),
        BOUNDS,
        fail_on_data_loss=True,
        checkpoint_ids={"a": "id-1"},
        topic_ids={"a": "id-1"},
    )
    assert same == ({("a", 0): 50, ("a", 1): 3}, [])
    with pytest.raises(OffsetOutOfRangeError, match="deleted and created again"):
        resume_offsets(
            from_json_offsets(checkpoint),
            BOUNDS,
            fail_on_data_loss=True,
            checkpoint_ids={"a": "id-1"},
            topic_ids={"a": "id-2"},
        )
    starts, losses = resume_offsets(
        from_json_offsets(checkpoint),
        BOUNDS,
        fail_on_data_loss=False,
        checkpoint_ids={"a": "id-1"},
        topic_ids={"a": "id-2"},
    )
    # The new topic is read from its earliest offset: none of it was read.
    assert starts == {("a", 0): 10, ("a", 1): 0}
    assert [(loss.partition, loss.resume_at) for loss in losses] == [(0, 10), (1, 0)]
    # Unknown on either side (an old checkpoint, a topic gone): not judged by id.
    assert resume_offsets(
        {("a", 0): 50}, BOUNDS, fail_on_data_loss=True, checkpoint_ids={}, topic_ids={"a": "x"}
    ) == ({("a", 0): 50, ("a", 1): 0}, [])


def test_batch_0s_end_records_its_start_and_later_ends_do_not() -> None:
    """Spark checkpoints ends only and asks initialOffset() again for a replay of batch 0,
    which ``latest`` answers differently by then: batch 0's end carries the start it was
    computed from, and the plan of batch 0 reads from it."""
    initial = mark_initial(to_json_offsets({("a", 0): 100}, {"a": "id-1"}))
    assert from_json_offsets(initial) == {("a", 0): 100}
    assert topic_ids_of(initial) == {"a": "id-1"}
    end_0 = end_offsets(initial, to_json_offsets({("a", 0): 150}, {"a": "id-1"}))
    assert end_0 == {
        "a": {"0": 150},
        "$topicIds": {"a": "id-1"},
        "$start": {"a": {"0": 100}, "$topicIds": {"a": "id-1"}},
    }
    assert from_json_offsets(end_0) == {("a", 0): 150}
    # A replay's initialOffset() has moved on; batch 0 still reads from its own start.
    later_initial = mark_initial(to_json_offsets({("a", 0): 180}, {"a": "id-1"}))
    assert planned_start(later_initial, end_0) == end_0["$start"]
    # Batch 0 checkpointed before ends recorded a start: read from initialOffset().
    legacy = to_json_offsets({("a", 0): 150}, {"a": "id-1"})
    assert planned_start(later_initial, legacy) == later_initial
    # Later batches start at the previous end, whatever it records.
    assert planned_start(end_0, legacy) == end_0
    # Batch 1: its end carries no start, unless nothing moved: then batch 0's end comes
    # back unchanged, so Spark sees no new data rather than a different JSON.
    end_1 = to_json_offsets({("a", 0): 180}, {"a": "id-1"})
    assert end_offsets(end_0, end_1) == end_1
    assert end_offsets(end_0, legacy) == end_0
    assert end_offsets(end_1, to_json_offsets({("a", 0): 200})) == {"a": {"0": 200}}


def test_every_end_records_the_min_partitions_its_batch_is_split_by() -> None:
    """A replay splits its ranges as the first attempt did (an exactly-once write's
    producer ids are its task ids), whatever minPartitions says by then; an end written
    before the split was recorded is split by the option; a changed option alone is no
    new data (found by an audit: see test_spark's replay test)."""
    end = with_min_partitions(to_json_offsets({("a", 0): 150}), 4)
    assert end == {"a": {"0": 150}, "$minPartitions": 4}
    assert from_json_offsets(end) == {("a", 0): 150}
    assert min_partitions_of(end, 9) == 4
    assert min_partitions_of(with_min_partitions(end, None), 9) is None
    assert min_partitions_of(to_json_offsets({("a", 0): 150}), 9) == 9  # written before
    assert end_offsets(end, with_min_partitions(to_json_offsets({("a", 0): 150}), 2)) == end
    moved = with_min_partitions(to_json_offsets({("a", 0): 160}), 2)
    assert end_offsets(end, moved) == moved


@pytest.mark.parametrize(
    ("name", "value", "wrong_hint"),
    [
        ("endingTimestamp", "1700000000000", "startingTimestamp"),
        ("endingOffsetsByTimestamp", '{"t": {"0": 1700000000000}}', "startingOffsetsByTimestamp"),
        ("minOffsetsPerTrigger", "1000", "maxOffsetsPerTrigger"),
    ],
)
def test_a_kafka_option_tidelog_lacks_is_named_so_not_a_misspelling_of_its_opposite(
    name: str, value: str, wrong_hint: str
) -> None:
    """Spark's Kafka source takes endingTimestamp, endingOffsetsByTimestamp (batch reads)
    and minOffsetsPerTrigger (streaming); tidelog refuses them. The refusal said "did you
    mean <the opposite option>?": following it turned an end bound into a start bound (or
    a minimum into a maximum), a different query that ran without complaint (found by an
    audit)."""
    streaming = name == "minOffsetsPerTrigger"
    with pytest.raises(ConfigError, match=r"Spark's Kafka option .* is not supported") as caught:
        parse_read_options({"subscribe": "t", name: value}, streaming=streaming)
    assert wrong_hint not in str(caught.value), str(caught.value)


def test_a_bad_timestamp_strategy_is_refused_without_a_timestamp_option_too() -> None:
    """startingOffsetsByTimestampStrategy was checked only with a timestamp option: a
    misspelt value ('lastest') passed silently until someone added startingTimestamp to
    the job (found by an audit). Spark's Kafka source checks it whenever given."""
    with pytest.raises(ConfigError, match="startingOffsetsByTimestampStrategy"):
        parse_read_options(
            {"subscribe": "t", "startingOffsetsByTimestampStrategy": "lastest"}, streaming=False
        )
