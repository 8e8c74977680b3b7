"""The ``tidelog`` CLI through subprocesses, against a ``tidelog dev`` cluster: start, use,
stop with SIGTERM, restart on the same data directory with the data kept."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import tidelog as tidelog_sdk
from tests.support.cluster import wait_for
from tests.support.process import REPO_ROOT, tidelog_env
from tidelog.dev import DevProcess


def tidelog(
    *args: str, gateway: str, stdin: str | bytes = "", check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run the CLI; ``stdin`` as bytes for input that is not UTF-8."""
    ran = subprocess.run(
        [sys.executable, "-m", "tidelog", *args],
        input=stdin.encode() if isinstance(stdin, str) else stdin,
        capture_output=True,
        cwd=REPO_ROOT,
        env={**tidelog_env(), "TIDELOG_GATEWAY": gateway},
        timeout=60,
        check=False,
    )
    result = subprocess.CompletedProcess(
        ran.args,
        ran.returncode,
        ran.stdout.decode(errors="replace"),
        ran.stderr.decode(errors="replace"),
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevProcess]:
    cluster = DevProcess(tmp_path_factory.mktemp("dev") / "data", env=tidelog_env())
    try:
        yield cluster
    finally:
        # SIGTERM: `tidelog dev` stops its children (each in a session of its own). A
        # SIGKILL, as here before, left a whole cluster running after every run.
        try:
            cluster.stop(timeout_s=60)
        except subprocess.TimeoutExpired:
            cluster.kill()


def test_topics_produce_consume_groups_cluster(dev: DevProcess) -> None:
    g = dev.gateway
    tidelog(
        "topics",
        "create",
        "events",
        "--partitions",
        "3",
        "--replication-factor",
        "2",
        "--config",
        "retention.ms=3600000",
        gateway=g,
    )
    assert tidelog("topics", "list", gateway=g).stdout.split() == ["events"]
    produced = tidelog(
        "produce",
        "events",
        "--key-separator",
        ":",
        gateway=g,
        stdin="".join(f"k{i}:v{i}\n" for i in range(30)),
    )
    assert "produced 30 records" in produced.stderr
    # The same through the SDK's direct mode (to the leaders; the gateway for metadata).
    tidelog("topics", "create", "direct", "--partitions", "3", gateway=g)
    lines = "".join(f"d{i}\n" for i in range(20))
    assert (
        "produced 20 records"
        in tidelog("produce", "direct", "--direct", gateway=g, stdin=lines).stderr
    )
    read = tidelog("consume", "direct", "--from-beginning", "--direct", gateway=g).stdout
    assert sorted(read.split()) == sorted(lines.split())
    out = tidelog("consume", "events", "--from-beginning", "--group", "audit", gateway=g).stdout
    assert sorted(out.split()) == sorted(f"v{i}" for i in range(30))
    keyed = tidelog(
        "consume",
        "events",
        "--from-beginning",
        "--partition",
        "0",
        "--key-separator",
        "=",
        "--output",
        "json",
        gateway=g,
    ).stdout
    records = [json.loads(line) for line in keyed.splitlines()]
    assert records and all(
        r["partition"] == 0 and r["value"] == "v" + r["key"][1:] for r in records
    )
    first = tidelog("consume", "events", "--from-beginning", "--max-messages", "2", gateway=g)
    assert len(first.stdout.split()) == 2
    described = json.loads(
        tidelog("topics", "describe", "events", "--output", "json", gateway=g).stdout
    )
    (topic,) = described
    assert topic["configs"] == {"retention.ms": "3600000"}
    assert sum(p["high_watermark"] for p in topic["partitions"]) == 30
    assert all(len(p["isr"]) == 2 and not p["under_replicated"] for p in topic["partitions"])
    table = tidelog("topics", "describe", gateway=g).stdout
    assert table.splitlines()[0].split() == [
        "TOPIC",
        "PARTITION",
        "LEADER",
        "REPLICAS",
        "ISR",
        "HW",
        "LEO",
        "STATUS",
    ]
    assert "configs of events: retention.ms=3600000" in table.splitlines()
    described = json.loads(
        tidelog("groups", "describe", "audit", "--output", "json", gateway=g).stdout
    )
    assert (described["state"], described["members"]) == ("Empty", 0)
    lag = described["partitions"]
    assert sum(p["committed_offset"] for p in lag) == 30 and all(p["lag"] == 0 for p in lag)
    assert tidelog("groups", "list", gateway=g).stdout.split() == ["audit"]
    # The consume above was a member of the group while it ran, and left when it ended.
    members = json.loads(
        tidelog("groups", "members", "audit", "--output", "json", gateway=g).stdout
    )
    assert members["state"] == "Empty" and members["members"] == []
    cluster = json.loads(tidelog("cluster", "--output", "json", gateway=g).stdout)
    assert [b["broker_id"] for b in cluster["brokers"]] == [0, 1, 2]
    assert cluster["offline_partitions"] == [] and cluster["under_replicated_partitions"] == []
    assert "under-replicated partitions: 0" in tidelog("cluster", gateway=g).stdout


def test_sigterm_of_consume_in_a_group_leaves_the_group(dev: DevProcess) -> None:
    """SIGTERM (`docker stop`, systemd, `timeout`) killed `consume --group` at once: the
    member stayed in the group for its whole session, and `groups reset-offsets` was
    refused meanwhile. It closes the consumer now, as Ctrl-C does and Kafka's console
    consumer on SIGTERM: status 143, nothing on stderr, the group left (found by an
    audit)."""
    g = dev.gateway
    tidelog("topics", "create", "terminated", "--partitions", "2", gateway=g)
    tidelog("produce", "terminated", gateway=g, stdin="a\nb\nc\n")
    consumer = subprocess.Popen(
        [sys.executable, "-m", "tidelog", "consume", "terminated", "--follow", "--group",
         "terminated-group", "--from-beginning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT,
        env={**tidelog_env(), "TIDELOG_GATEWAY": g},
    )  # fmt: skip
    try:
        wait_for(
            lambda: (
                "1 member(s)"
                in tidelog("groups", "members", "terminated-group", gateway=g, check=False).stdout
                or None
            ),
            60,
            "the consumer in the group",
        )
        consumer.send_signal(signal.SIGTERM)
        _, err = consumer.communicate(timeout=30)
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait()
    assert consumer.returncode == 143 and err == b"", (consumer.returncode, err)
    reset = tidelog(
        "groups", "reset-offsets", "terminated-group", "--topic", "terminated",
        "--to-earliest", "--execute", gateway=g, check=False,
    )  # fmt: skip
    assert reset.returncode == 0, reset.stderr


def test_consume_prints_the_values_produce_took_byte_for_byte(dev: DevProcess) -> None:
    """`produce` takes any bytes as a value, but `consume` decoded each one and printed
    text: bytes that are not UTF-8 came out as U+FFFD, and `consume a | produce b`
    corrupted binary data. Kafka's console consumer writes the bytes as they are; so does
    this now (found by an audit)."""
    g = dev.gateway
    tidelog("topics", "create", "raw-bytes", gateway=g)
    values = b"a\xff\xfeb\n\x80\x81\n"
    tidelog("produce", "raw-bytes", gateway=g, stdin=values)
    consumed = subprocess.run(
        [sys.executable, "-m", "tidelog", "consume", "raw-bytes", "--from-beginning"],
        capture_output=True, cwd=REPO_ROOT, env={**tidelog_env(), "TIDELOG_GATEWAY": g},
        timeout=60, check=False,
    )  # fmt: skip
    assert consumed.returncode == 0, consumed.stderr
    assert consumed.stdout == values


def test_consume_prints_a_missing_key_or_value_as_null(dev: DevProcess) -> None:
    """A record without a key and a tombstone (no value) printed as empty strings, which
    read, and produce back, as zero-byte keys and values. Kafka's console consumer prints
    ``null``; so does this now."""
    g = dev.gateway
    tidelog("topics", "create", "nulls", gateway=g)
    with tidelog_sdk.Producer(g) as producer:
        producer.send("nulls", b"no key", partition=0).result(30)
        producer.send("nulls", None, key=b"gone", partition=0).result(30)
        producer.send("nulls", b"", key=b"", partition=0).result(30)
    keyed = tidelog("consume", "nulls", "--from-beginning", "--key-separator", "=", gateway=g)
    assert keyed.stdout.splitlines() == ["null=no key", "gone=null", "="]
    plain = tidelog("consume", "nulls", "--from-beginning", gateway=g)
    assert plain.stdout.splitlines() == ["no key", "null", ""]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("topics", "describe", "missing"), "does not exist"),
        (("consume", "missing"), "does not exist"),
        (("topics", "create", "bad/name"), "INVALID_TOPIC"),
        (("topics", "create", "wide", "--replication-factor", "5"), "INVALID_REPLICATION_FACTOR"),
        (("topics", "create", "x", "--partitions", "0"), "must be >= 1"),
        (("topics", "create", "x", "--config", "novalue"), "NAME=VALUE"),
        (("topics", "create", "x", "--config", "a.b=1", "--config", "a.b=2"), "given twice"),
        (("consume", "events", "--partition", "0", "--offset", "999"), "outside"),
        (("consume", "events", "--partition", "9"), "partition 9 does not exist"),
        (("produce", "events", "--partition", "7"), "partition 7 does not exist"),
        (("groups", "describe", "nobody"), "GROUP_ID_NOT_FOUND"),
        (("groups", "members", "nobody"), "GROUP_ID_NOT_FOUND"),
        (("topics", "create", "x", "--partitions", "2147483648"), "must be <= 2147483647"),
        (("produce", "events", "--key-separator", ""), "must not be empty"),
        (("topics", "describe", "\udcff"), "is not UTF-8"),  # a non-UTF-8 argument
        (("topics", "describe", ""), "empty"),  # not "every topic"
        (("topics", "alter", "events"), "nothing to alter"),
        (("topics", "alter", "events", "--config", "retention.mss=1"), "unknown topic config"),
        (("topics", "alter", "missing", "--config", "retention.ms=1"), "does not exist"),
    ],
)
def test_errors_are_one_line_without_traceback(
    dev: DevProcess, args: tuple[str, ...], message: str
) -> None:
    result = tidelog(*args, gateway=dev.gateway, stdin="v\n", check=False)
    assert result.returncode != 0
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_topics_alter_grows_partitions_and_changes_configs_all_or_nothing(
    dev: DevProcess,
) -> None:
    g = dev.gateway
    tidelog("topics", "create", "alterable", "--config", "retention.ms=60000", gateway=g)
    refused = tidelog(
        "topics", "alter", "alterable", "--partitions", "3", "--config", "retention.ms=x",
        gateway=g, check=False,
    )  # fmt: skip
    assert "not an integer" in _one_line_failure(refused)
    altered = tidelog(
        "topics", "alter", "alterable", "--partitions", "3", "--config", "segment.ms=1000",
        "--delete-config", "retention.ms", gateway=g,
    )  # fmt: skip
    assert altered.stdout.strip() == (
        "altered topic alterable: 3 partitions; config overrides: segment.ms=1000"
    )
    described = json.loads(
        tidelog("topics", "describe", "alterable", "--output", "json", gateway=g).stdout
    )[0]
    assert len(described["partitions"]) == 3
    assert described["configs"] == {"segment.ms": "1000"}


def _values(topic: str, gateway: str) -> list[str]:
    out = tidelog("consume", topic, "--from-beginning", "--output", "json", gateway=gateway)
    return [json.loads(line)["value"] for line in out.stdout.splitlines()]


def _one_line_failure(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr[:2000]
    return result.stderr.strip()


def test_produce_stopped_by_a_bad_line_says_how_many_lines_before_it_were_written(
    dev: DevProcess,
) -> None:
    """The lines before a bad one are sent first: the error used to name the bad line but
    not say that those were written, so whoever ran it again could not know where to
    start. Bytes that are not UTF-8 are no bad line: values are bytes."""
    g = dev.gateway
    tidelog("topics", "create", "midway", gateway=g)
    lines = b"k1:v1\nk2:\xff\xfe not UTF-8\nno separator\nk4:v4\n"
    result = tidelog(
        "produce", "midway", "--key-separator", ":", gateway=g, stdin=lines, check=False
    )
    line = _one_line_failure(result)
    assert "line 3: no key separator ':'" in line, line
    assert line.endswith("; 2 records before it were written"), line
    assert _values("midway", g) == ["v1", "\ufffd\ufffd not UTF-8"]


def test_produce_names_the_line_too_large_for_the_topic_and_writes_the_lines_before_it(
    dev: DevProcess,
) -> None:
    """A line over max.message.bytes (1 MiB + 12) used to go out with the lines before it
    and fail them too, and the error named no line."""
    g = dev.gateway
    tidelog("topics", "create", "bigline", gateway=g)
    # 2 MB, and a value just under 1 MiB whose batch's framing takes it over the limit.
    for size in (2_000_000, 1_048_560):
        lines = b"a\nb\n" + b"x" * size + b"\nd\n"
        result = tidelog("produce", "bigline", gateway=g, stdin=lines, check=False)
        line = _one_line_failure(result)
        assert "MESSAGE_TOO_LARGE: line 3:" in line, line
        assert line.endswith("; 2 records before it were written"), line
    assert _values("bigline", g) == ["a", "b", "a", "b"]


LONG = "n" * 100_000


@pytest.mark.parametrize(
    "args",
    [
        ("topics", "create", LONG),  # the server's answer, with the SDK's context
        ("topics", "describe", LONG),
        ("topics", "delete", LONG),
        ("produce", LONG),
        ("consume", LONG),
        ("groups", "describe", LONG),
        ("groups", "describe", "a group " * 12_500),  # spaces inside
        ("topics", "create", "x", "--config", LONG),  # the CLI's own message
        ("consume", "events", "--offset", LONG),  # an argument type's message
        ("topics", LONG),  # argparse's own messages
        ("produce", "events", "--acks", LONG),
        ("topics", "list", "--gateway", LONG),  # gRPC's message
    ],
    ids=lambda args: " ".join(a[:12] for a in args),
)
def test_errors_cut_the_long_values_they_echo(dev: DevProcess, args: tuple[str, ...]) -> None:
    """A 100,000-character name used to be repeated in full, even twice, in the error."""
    result = tidelog(*args, gateway=dev.gateway, stdin="v\n", check=False)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1, line[:2000]
    assert len(line) <= 1_100, line[:2000]
    assert "... (100000 chars)" in line, line


def test_consume_with_a_group_commits_only_what_it_printed(dev: DevProcess) -> None:
    """--max-messages stopping in the middle of a poll used to commit the whole poll: the
    group's next consumer skipped records nobody had printed."""
    g = dev.gateway
    tidelog("topics", "create", "counted", gateway=g)
    tidelog("produce", "counted", gateway=g, stdin="".join(f"m{i}\n" for i in range(5)))
    first = tidelog(
        "consume",
        "counted",
        "--group",
        "counter",
        "--from-beginning",
        "--max-messages",
        "2",
        gateway=g,
    )
    assert first.stdout.split() == ["m0", "m1"]
    rest = tidelog("consume", "counted", "--group", "counter", gateway=g)
    assert rest.stdout.split() == ["m2", "m3", "m4"]


def test_groups_reset_offsets_and_delete(dev: DevProcess) -> None:
    """Kafka's kafka-consumer-groups --reset-offsets (a dry run unless --execute) and
    --delete, both refused in one line while the group has members."""
    g = dev.gateway
    tidelog("topics", "create", "resettable", "--partitions", "2", gateway=g)
    tidelog("produce", "resettable", "--partition", "0", gateway=g, stdin="a\nb\nc\nd\n")
    tidelog("consume", "resettable", "--group", "resetters", "--from-beginning", gateway=g)

    def committed() -> dict[int, int]:
        rows = json.loads(
            tidelog("groups", "describe", "resetters", "--output", "json", gateway=g).stdout
        )["partitions"]
        return {r["partition"]: r["committed_offset"] for r in rows}

    def reset(*how: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = ("groups", "reset-offsets", "resetters", "--topic", "resettable", *how)
        return tidelog(*command, gateway=g, check=check)

    assert committed() == {0: 4, 1: 0}
    shown = reset("--shift-by", "-3")
    assert "dry run" in shown.stderr and committed() == {0: 4, 1: 0}
    assert [line.split() for line in shown.stdout.splitlines()[1:]] == [
        ["resettable", "0", "4", "1"],
        ["resettable", "1", "0", "0"],
    ]
    # A partition without a commit shows none, as `groups describe` does (it showed -1).
    fresh = tidelog(
        "groups", "reset-offsets", "fresh-resetters", "--topic", "resettable", "--to-latest",
        gateway=g,
    )  # fmt: skip
    assert [line.split() for line in fresh.stdout.splitlines()[1:]] == [
        ["resettable", "0", "-", "4"],
        ["resettable", "1", "-", "0"],
    ]
    reset("--partition", "0", "--to-offset", "99", "--execute")
    assert committed() == {0: 4, 1: 0}  # clamped to the high watermark
    reset("--to-earliest", "--execute")
    assert committed() == {0: 0, 1: 0}
    again = tidelog("consume", "resettable", "--group", "resetters", gateway=g)
    assert again.stdout.split() == ["a", "b", "c", "d"]

    with tidelog_sdk.Consumer(g, group_id="resetters", session_timeout_ms=10_000) as member:
        member.subscribe(["resettable"])
        deadline = time.monotonic() + 30
        while not member.assignment() and time.monotonic() < deadline:
            member.poll(timeout_ms=100)
        for refused in (
            tidelog("groups", "delete", "resetters", gateway=g, check=False),
            reset("--to-latest", "--execute", check=False),
            reset("--to-latest", check=False),  # the dry run too, as Kafka's tool
        ):
            assert refused.returncode == 1, refused.args
            assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
            assert "member" in refused.stderr and "Traceback" not in refused.stderr
    deleted = tidelog("groups", "delete", "resetters", gateway=g)
    assert "deleted group resetters (2 committed offsets)" in deleted.stdout
    gone = tidelog("groups", "delete", "resetters", gateway=g, check=False)
    assert gone.returncode == 1 and "no committed offsets" in gone.stderr


def test_a_group_consume_that_read_nothing_records_its_position(dev: DevProcess) -> None:
    """A group reader that starts at the end and reads nothing commits its position, as
    Kafka's console consumer does: it committed only after printing records, so its next
    run reset to the end again and skipped what was written meanwhile (found by an
    audit)."""
    g = dev.gateway
    tidelog("topics", "create", "quiet", gateway=g)
    tidelog("produce", "quiet", gateway=g, stdin="old1\nold2\n")
    reader = ("consume", "quiet", "--group", "late-readers", "--follow", "--timeout-ms", "3000")
    assert tidelog(*reader, gateway=g).stdout == ""
    tidelog("produce", "quiet", gateway=g, stdin="new1\nnew2\n")
    tidelog("groups", "describe", "late-readers", gateway=g)  # it exists, with its lag
    assert tidelog(*reader, gateway=g).stdout.split() == ["new1", "new2"]


def test_consume_with_stdout_closed_fails_in_one_line(dev: DevProcess) -> None:
    """`tidelog consume ... >&-` (a unit or a script that closed stdout): one line and
    status 1, as produce with a closed stdin. It was an AttributeError traceback (found by
    an audit)."""
    g = dev.gateway
    tidelog("topics", "create", "closed-out", gateway=g)
    tidelog("produce", "closed-out", gateway=g, stdin="one\n")
    ran = subprocess.run(
        ["bash", "-c", f'exec "{sys.executable}" -m tidelog consume closed-out >&-'],
        stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
        env={**tidelog_env(), "TIDELOG_GATEWAY": g}, timeout=60, check=False,
    )  # fmt: skip
    assert ran.returncode == 1
    assert ran.stderr.count("\n") == 1 and "stdout is closed" in ran.stderr, ran.stderr


def test_reset_offsets_takes_several_topics(dev: DevProcess) -> None:
    """--topic may repeat, as in Kafka's kafka-consumer-groups, and every topic named is
    reset. Only the last was, silently, with status 0 (found by an audit)."""
    g = dev.gateway
    for topic in ("reset-a", "reset-b"):
        tidelog("topics", "create", topic, gateway=g)
        tidelog("produce", topic, gateway=g, stdin="1\n2\n3\n")
    with tidelog_sdk.Admin(g) as admin:
        admin.alter_group_offsets("two-topics", {("reset-a", 0): 3, ("reset-b", 0): 3})
        tidelog(
            "groups", "reset-offsets", "two-topics", "--topic", "reset-a", "--topic", "reset-b",
            "--to-earliest", "--execute", gateway=g,
        )  # fmt: skip
        committed = {
            (o.topic, o.partition): o.committed_offset for o in admin.describe_group("two-topics")
        }
    assert committed == {("reset-a", 0): 0, ("reset-b", 0): 0}
    refused = tidelog(
        "groups", "reset-offsets", "two-topics", "--topic", "reset-a", "--topic", "reset-b",
        "--partition", "0", "--to-latest", gateway=g, check=False,
    )  # fmt: skip
    assert refused.returncode == 1 and "--partition needs exactly one --topic" in refused.stderr


def test_reset_offsets_takes_kafkas_partition_lists_and_targets(dev: DevProcess) -> None:
    """Kafka's kafka-consumer-groups --reset-offsets forms: --topic name:0,2,
    --all-topics, --to-current (the end where there is no commit) and --by-duration
    (now minus an ISO 8601 duration; the end when no record is that recent)."""
    g = dev.gateway
    tidelog("topics", "create", "spans", "--partitions", "3", gateway=g)
    for partition in range(3):
        tidelog("produce", "spans", "--partition", str(partition), gateway=g, stdin="a\nb\nc\n")

    def reset(group: str, *how: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = ("groups", "reset-offsets", group, *how, "--output", "json")
        return tidelog(*command, gateway=g, check=check)

    def offsets(result: subprocess.CompletedProcess[str]) -> dict[tuple[str, int], object]:
        shown = json.loads(result.stdout)["offsets"]
        return {(o["topic"], o["partition"]): (o["current"], o["new"]) for o in shown}

    with tidelog_sdk.Admin(g) as admin:
        admin.alter_group_offsets("spanners", {("spans", 0): 1, ("spans", 1): 2})
        assert offsets(reset("spanners", "--topic", "spans:0,2", "--to-earliest")) == {
            ("spans", 0): (1, 0),
            ("spans", 2): (None, 0),
        }
        # Only the group's committed partitions; the colon lists merge across mentions.
        assert offsets(reset("spanners", "--all-topics", "--to-latest")) == {
            ("spans", 0): (1, 3),
            ("spans", 1): (2, 3),
        }
        merged = reset("spanners", "--topic", "spans:2", "--topic", "spans:0", "--to-current")
        assert offsets(merged) == {("spans", 0): (1, 1), ("spans", 2): (None, 3)}
        recent = reset("spanners", "--topic", "spans", "--by-duration", "PT1H", "--execute")
        assert offsets(recent) == {("spans", p): (c, 0) for p, c in ((0, 1), (1, 2), (2, None))}
        assert {
            (o.topic, o.partition): o.committed_offset for o in admin.describe_group("spanners")
        } == {("spans", 0): 0, ("spans", 1): 0, ("spans", 2): 0}
        assert offsets(reset("spanners", "--topic", "spans:1", "--by-duration", "PT0S")) == {
            ("spans", 1): (0, 3)
        }
    missing = reset("spanners", "--topic", "spans:1,7,9", "--to-earliest", check=False)
    assert "partition 7, 9 does not exist" in _one_line_failure(missing)
    both = reset("spanners", "--topic", "spans:1", "--partition", "0", "--to-earliest", check=False)
    assert "--partition needs exactly one --topic" in _one_line_failure(both)
    nothing = reset("never-committed", "--all-topics", "--to-earliest", check=False)
    assert "no committed offsets" in _one_line_failure(nothing)
    for bad in (("--by-duration", "30m"), ("--topic", "spans:x")):
        how = (*bad, "--to-earliest") if bad[0] == "--topic" else ("--all-topics", *bad)
        refused = reset("spanners", *how, check=False)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr


def test_reset_offsets_to_datetime_reads_a_time_without_a_zone_as_local(
    dev: DevProcess,
) -> None:
    """--to-datetime goes to the first record at or after the time, to the ms; a time
    with no zone is local time, as Kafka's tool reads it (it was read as UTC)."""
    g = dev.gateway
    tidelog("topics", "create", "dated", gateway=g)
    base_ms = 1_000_000_000_000  # 2001-09-09T01:46:40Z
    with tidelog_sdk.Producer(g) as producer:
        for i in range(4):
            producer.send("dated", b"v", partition=0, timestamp_ms=base_ms + i * 60_000)
        producer.flush()

    def new_offset(when: str, zone: str = "UTC") -> int:
        ran = subprocess.run(
            [sys.executable, "-m", "tidelog", "groups", "reset-offsets", "dated-readers",
             "--topic", "dated", "--to-datetime", when, "--output", "json"],
            capture_output=True, text=True, cwd=REPO_ROOT, timeout=60, check=True,
            env={**tidelog_env(), "TIDELOG_GATEWAY": g, "TZ": zone},
        )  # fmt: skip
        return int(json.loads(ran.stdout)["offsets"][0]["new"])

    assert new_offset("2001-09-09T01:46:40Z") == 0
    assert new_offset("2001-09-09T01:46:40.001Z") == 1  # the next record at or after
    assert new_offset("2001-09-09T03:48:40+02:00") == 2
    assert new_offset("2001-09-09T10:48:40", zone="JST-9") == 2  # local: UTC+9
    assert new_offset("2001-09-09T01:48:40", zone="UTC") == 2
    assert new_offset("2001-09-09T02:00:00Z") == 4  # no record that recent: the end
    for bad, why in (("yesterday", "not an ISO 8601 time"), ("1969-12-31T00:00:00Z", "1970")):
        refused = tidelog(
            "groups", "reset-offsets", "dated-readers", "--topic", "dated",
            "--to-datetime", bad, gateway=g, check=False,
        )  # fmt: skip
        assert why in _one_line_failure(refused)


def test_dev_with_a_file_for_its_data_directory_is_one_line(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "afile"
    not_a_dir.write_text("")
    result = tidelog("dev", "--data-dir", str(not_a_dir), gateway="", check=False)
    assert result.returncode == 1
    assert "cannot use --data-dir" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_dev_says_why_a_process_did_not_start(tmp_path: Path) -> None:
    """A gateway port in use: the cause, not only "did not start; see the log"."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = tidelog(
            "dev", "--data-dir", str(tmp_path / "data"), "--gateway-port", str(port),
            gateway="", check=False,
        )  # fmt: skip
    line = _one_line_failure(result)
    assert f"cannot listen on 127.0.0.1:{port}" in line and "gateway did not start" in line


def test_a_second_dev_on_the_same_directory_is_refused_at_once(dev: DevProcess) -> None:
    """It used to fail after 15 s with etcd's log (its db "flocked by another process")."""
    started = time.monotonic()
    result = tidelog("dev", "--data-dir", str(dev.data_dir), gateway="", check=False)
    assert result.returncode == 1
    assert "is in use by another tidelog dev" in _one_line_failure(result)
    assert time.monotonic() - started < 10


def test_unreachable_gateway_is_one_line() -> None:
    result = tidelog("topics", "list", gateway="127.0.0.1:1", check=False)
    assert result.returncode == 1
    assert "unreachable" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--offset", "1"), "argument --offset: needs --partition"),
        (("--offset", "1", "--partition", "0", "--from-beginning"), "not allowed with"),
    ],
)
def test_consume_argument_rules_are_usage_errors(args: tuple[str, ...], message: str) -> None:
    """Rules across consume's arguments exit 2 before anything is asked, as argparse's own
    refusals do (they used to exit 1 after connecting, and --help did not name them)."""
    result = tidelog("consume", "events", *args, gateway="127.0.0.1:1", check=False)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("127.0.0.1:99999", "port 99999 is out of range"),
        ("", "'' is not HOST:PORT"),
        ("127.0.0.1:0", "port 0 names no server"),
    ],
)
def test_a_gateway_address_no_connection_can_use_is_refused(address: str, message: str) -> None:
    """`--gateway` is checked like the servers' --listen: port 99999 used to be wrapped by
    the resolver to another port, and an empty value silently meant $TIDELOG_GATEWAY."""
    result = subprocess.run(
        [sys.executable, "-m", "tidelog", "topics", "list", "--gateway", address],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=tidelog_env(),
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("127.0.0.1:99999", "$TIDELOG_GATEWAY: port 99999 is out of range"),
        ("127.0.0.1", "$TIDELOG_GATEWAY: '127.0.0.1' is not HOST:PORT"),
    ],
)
def test_a_gateway_from_the_environment_is_checked_as_the_flag_is(
    address: str, message: str
) -> None:
    """The second CLI audit: port 99999 from $TIDELOG_GATEWAY reached the resolver (which
    connected elsewhere) and a bare host meant port 443."""
    result = tidelog("topics", "list", gateway=address, check=False)
    assert message in _one_line_failure(result)


def test_groups_describe_shows_owned_partitions_the_group_never_committed(
    dev: DevProcess,
) -> None:
    """As kafka-consumer-groups: a member's partitions show before its first commit (the
    CLI audit found "1 member(s)" over an empty table)."""
    g = dev.gateway
    tidelog("topics", "create", "owned", "--partitions", "2", gateway=g)
    member = tidelog_sdk.Consumer(g, group_id="owners", enable_auto_commit=False)
    try:
        member.subscribe(["owned"])
        wait_for(lambda: (member.poll(timeout_ms=100), member.assignment())[1] or None, 30, "join")
        out = tidelog("groups", "describe", "owners", "--output", "json", gateway=g).stdout
        member_id = member.group_metadata().member_id  # type: ignore[union-attr]
        described = json.loads(out)
        assert (described["state"], described["members"]) == ("Stable", 1)
        rows = [(r["partition"], r["committed_offset"], r["lag"]) for r in described["partitions"]]
        assert rows == [(0, None, None), (1, None, None)]
        assert {r["member_id"] for r in described["partitions"]} == {member_id}
    finally:
        member.close()


def test_produce_with_stdin_closed_is_one_line(dev: DevProcess) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tidelog", "produce", "events", "--gateway", dev.gateway],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=tidelog_env(),
        preexec_fn=lambda: os.close(0),  # `tidelog produce events <&-`
        timeout=60,
        check=False,
    )
    assert "stdin is closed" in _one_line_failure(result)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--replica-lag-time-max-ms", "0", "must be >= 1"),
        ("--replica-lag-time-max-ms", "-1", "must be >= 1"),
        ("--controlled-shutdown-timeout-s", "nan", "must be > 0"),
        ("--controlled-shutdown-timeout-s", "-5", "must be > 0"),
        ("--controlled-shutdown-timeout-s", "inf", "must be finite"),
    ],
)
def test_storage_durations_out_of_range_are_refused(
    tmp_path: Path, flag: str, value: str, message: str
) -> None:
    """A lag of 0 took every follower out of the ISR; an infinite shutdown wait never
    stopped; nan and negative ones skipped the controlled shutdown (the CLI audit)."""
    result = subprocess.run(
        [sys.executable, "-m", "tidelog", "storage", "--broker-id", "9", "--data-dir",
         str(tmp_path), "--listen", "127.0.0.1:0", flag, value],
        capture_output=True, text=True, cwd=REPO_ROOT, env=tidelog_env(), timeout=60,
        check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_dev_stops_cleanly_and_restarts_with_data_kept(dev: DevProcess) -> None:
    tidelog(
        "topics",
        "create",
        "kept",
        "--partitions",
        "2",
        "--replication-factor",
        "3",
        gateway=dev.gateway,
    )
    tidelog("produce", "kept", gateway=dev.gateway, stdin="".join(f"r{i}\n" for i in range(50)))
    started = time.monotonic()
    assert dev.stop() == 0
    assert time.monotonic() - started < 60
    assert any("stopped" in line for line in dev.lines)
    again = DevProcess(dev.data_dir, env=tidelog_env())
    try:
        out = tidelog("consume", "kept", "--from-beginning", gateway=again.gateway).stdout
        assert sorted(out.split()) == sorted(f"r{i}" for i in range(50))
    finally:
        assert again.stop() == 0


def _children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended while we looked
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_dev_stopped_while_starting_does_not_wait_for_its_children(tmp_path: Path) -> None:
    """A SIGTERM while a child is still starting stops the others at once. Here a broker
    is frozen (SIGSTOP) before it announced itself: dev used to wait for it for its whole
    start timeout (60 s) before stopping anything, and a slow start ignored Ctrl-C."""
    dev = subprocess.Popen(
        [sys.executable, "-m", "tidelog", "dev", "--data-dir", str(tmp_path / "data")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        text=True, cwd=REPO_ROOT, env=tidelog_env(),
    )  # fmt: skip
    children: list[int] = []
    try:

        def roles() -> dict[int, list[bytes]] | None:
            # Each child's command line, once all six have theirs: a child read between
            # its fork and its exec still shows dev's own (a CI rerun).
            found = {}
            for pid in _children_of(dev.pid):
                with contextlib.suppress(OSError):
                    found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            wanted = (b"storage", b"gateway")
            if len(found) == 6 and all(any(w in a for a in found.values()) for w in wanted):
                return found
            return None

        by_pid = wait_for(roles, 60, "children")
        children = list(by_pid)
        broker = next(pid for pid, argv in by_pid.items() if b"storage" in argv)
        gateway = next(pid for pid, argv in by_pid.items() if b"gateway" in argv)
        os.kill(broker, signal.SIGSTOP)
        dev.send_signal(signal.SIGTERM)
        wait_for(lambda: not _running(gateway), 30, "the gateway stopped")
        os.kill(broker, signal.SIGCONT)
        output, _ = dev.communicate(timeout=60)
        assert dev.returncode == 0, output
        assert "tidelog dev stopped" in output and "ready" not in output, output
    finally:
        for pid in [*children, dev.pid]:
            if _running(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        dev.wait(10)


def test_dev_killed_outright_leaves_no_child_running(tmp_path: Path) -> None:
    """SIGKILL gives `tidelog dev` no chance to stop its children (each runs in a session
    of its own); the kernel sends them SIGTERM (PR_SET_PDEATHSIG) and every one ends,
    etcd included, instead of holding its ports and data directory.

    A dev started again at once on the same directory waits for them (they hold its
    lock), then comes up. It used to start at once, its brokers failing on the data
    directories the old ones held as they stopped, and it printed the old broker's last
    error from the shared log file as the cause (found by an audit)."""
    dev = DevProcess(tmp_path / "data", env=tidelog_env())
    children = _children_of(dev.proc.pid)
    assert len(children) == 6, children  # etcd, a controller, three brokers, a gateway
    dev.kill()
    again: DevProcess | None = None
    try:
        again = DevProcess(tmp_path / "data", env=tidelog_env(), timeout_s=120)
        assert not any(_running(pid) for pid in children)  # it waited for every one
    finally:
        if again is not None:
            again.stop(timeout_s=60)
        for pid in filter(_running, children):  # a failed run leaves no cluster behind
            os.kill(pid, signal.SIGKILL)


def test_the_readme_quick_start_works_as_written(tmp_path: Path) -> None:
    """The README's quick-start commands, run as a script against ``tidelog dev`` once
    it is ready. The block used to start dev in the background and run the next command
    at once: pasted into a shell, ``topics create`` ran while the cluster was starting,
    failed "unreachable", and every later command failed on the missing topic (found by
    an audit)."""
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    start, commands = [block.split("```", 1)[0] for block in section.split("```sh\n")[1:3]]
    python = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert start.startswith(".venv/bin/tidelog dev "), start
    (tmp_path / ".venv").symlink_to(REPO_ROOT / ".venv")
    (tmp_path / "quick.sh").write_text("set -e\n" + commands)
    dev = DevProcess(tmp_path / "data", env=tidelog_env())
    # The Python example names the default gateway address; this dev's port is its own.
    (tmp_path / "quick.py").write_text(python.replace('"127.0.0.1:9094"', repr(dev.gateway)))
    env = {**tidelog_env(), "TIDELOG_GATEWAY": dev.gateway}

    def run(*command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True,
            stdin=subprocess.DEVNULL, timeout=240, check=False,
        )  # fmt: skip

    try:
        shell = run("bash", "quick.sh")
        example = run(sys.executable, "quick.py")
    finally:
        dev.stop()
    assert shell.returncode == 0, shell.stderr[-1500:]
    assert "hello" in shell.stdout and "world" in shell.stdout
    assert example.returncode == 0, example.stderr[-1500:]


def test_dev_started_again_with_fewer_brokers_is_ready_and_names_what_stays_offline(
    tmp_path: Path,
) -> None:
    """``tidelog dev --brokers 1`` on a directory made with three: the partitions with no
    in-sync replica on broker 0 can never have a leader. Dev waited for them its whole start
    timeout (60 s), then failed with "the cluster did not become usable" and nothing in
    the logs said why (found by an audit). It is ready once the rest is, after a warning
    naming them and the brokers their data needs."""
    data = tmp_path / "data"
    dev = DevProcess(data, env=tidelog_env())
    try:
        admin = tidelog_sdk.Admin(dev.gateway)
        admin.create_topic("events", partitions=3, replication_factor=2)
        partitions = admin.describe_topic("events").partitions
        admin.close()
        assert dev.stop(60) == 0
    finally:
        dev.kill()
    stranded = [p.partition for p in partitions if 0 not in p.replicas]
    assert stranded  # RF 2 over 3 brokers: one partition has none on broker 0
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidelog", "dev", "--data-dir", str(data), "--brokers", "1",
         "--gateway-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        cwd=REPO_ROOT, env=tidelog_env(),
    )  # fmt: skip
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("tidelog dev ready"):
                break
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(60)
    assert time.monotonic() - started < 45, "".join(lines)
    assert lines and lines[-1].startswith("tidelog dev ready"), "".join(lines)
    # At least those: others may have had broker 0 out of their ISR when dev stopped.
    (warning,) = [line for line in lines if "warning" in line]
    assert "have no in-sync replica among the 1 broker(s) started" in warning
    assert all(f"events-{p}" in warning for p in stranded), warning


def test_dev_whose_etcd_does_not_start_says_so_in_one_line(tmp_path: Path) -> None:
    """An etcd that exits at once: dev's error is one line naming etcd's log (it printed
    the log's last 40 lines of JSON with it; found by an audit)."""
    fake = tmp_path / "etcd"
    fake.write_text('#!/bin/sh\necho \'{"level":"fatal","msg":"no"}\'\nexit 3\n')
    fake.chmod(0o755)
    result = subprocess.run(
        [sys.executable, "-m", "tidelog", "dev", "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False,
        env={**tidelog_env(), "TIDELOG_ETCD_BIN": str(fake)},
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert "etcd exited with status 3" in result.stderr and "log " in result.stderr


def test_a_failed_dev_whose_data_dir_path_contains_ready_is_not_taken_for_ready(
    tmp_path: Path,
) -> None:
    """DevProcess reads only dev's own ready line. It took any line containing "ready",
    and the word after "gateway " in it for the gateway address: here dev fails (its
    gateway port is in use) with one line naming its data directory, whose path contains
    "already", and DevProcess returned as if the cluster were up, with the gateway "did"
    (from "gateway did not start"), while dev had exited with status 1 (found by an
    audit)."""
    data_dir = tmp_path / "already-used" / "data"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        dev: DevProcess | None = None
        try:
            with pytest.raises(RuntimeError, match="did not get ready"):
                dev = DevProcess(data_dir, gateway_port=port, env=tidelog_env(), timeout_s=90)
        finally:
            if dev is not None:
                dev.kill()


@pytest.mark.parametrize(
    ("command", "flag", "value", "message"),
    [
        ("storage", "--etcd", "", "no etcd endpoint"),
        ("storage", "--etcd", " , ", "no etcd endpoint"),
        ("controller", "--etcd", "https://127.0.0.1:2379", "only http:// is supported"),
        ("gateway", "--etcd", "127.0.0.1:99999", "bad port"),
        ("controller", "--cluster", "a/b", "contain no '/'"),
        ("storage", "--cluster", "", "must be non-empty"),
        # "" is the working directory to the OS: a node deleted its *-delete directories
        # and wrote logs into its NAME-N ones (found by an audit).
        ("storage", "--data-dir", "", "must name a directory"),
        ("storage", "--data-dir", "  ", "must name a directory"),
        ("dev", "--data-dir", "", "must name a directory"),
        ("controller", "--session-ttl-s", "99999999999", "must be <= 9000000000"),
        ("gateway", "--max-request-bytes", "3000000000", "must be <= 2139095039"),
        ("gateway", "--max-fetch-bytes", "3000000000", "must be <= 2139095039"),
        # Registered as it was: nobody could dial the broker (found by an audit).
        ("storage", "--advertised-host", "broker 0", "is not a host name or IP address"),
        ("storage", "--advertised-host", "", "is not a host name or IP address"),
        ("storage", "--advertised-host", "10.0.0.5:9092", "give the port in --listen"),
        ("controller", "--advertised-host", "broker-0:9092", "is not a host name or IP"),
    ],
)
def test_service_cluster_flags_are_checked_by_the_parser(
    tmp_path: Path, command: str, flag: str, value: str, message: str
) -> None:
    """Refused before anything starts, with one line and status 2. An empty --etcd made a
    storage node run outside any cluster (healthy, and ignoring --cluster); the others
    failed only after the data directory was locked or the port bound, with status 1 (a
    gateway's huge message size with an OverflowError; found by an audit)."""
    args = {
        "storage": ["--broker-id", "9", "--data-dir", str(tmp_path / "data")],
        "controller": ["--controller-id", "1"],
        "gateway": [],
        "dev": [],
    }[command]
    if command != "dev":
        args += ["--listen", "127.0.0.1:0"]
        if flag != "--etcd":
            args += ["--etcd", "127.0.0.1:2379"]
    cwd = tmp_path / "cwd"  # where an empty --data-dir would go: never the checkout
    cwd.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "tidelog", command, *args, flag, value],
        capture_output=True, text=True, cwd=cwd, env=tidelog_env(), timeout=60,
        check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not (tmp_path / "data").exists()
    assert not any(cwd.iterdir())


@pytest.mark.parametrize("command", ["storage", "controller", "gateway"])
def test_a_service_that_cannot_reach_etcd_at_start_up_exits_with_one_line(
    tmp_path: Path, command: str
) -> None:
    """Each service refuses to start without etcd: one line naming it, status 1. The
    controller used to serve, SERVING to health checks, while campaigning in vain for
    ever (found by an audit)."""
    args = {
        "storage": ["--broker-id", "9", "--data-dir", str(tmp_path / "data")],
        "controller": ["--controller-id", "1"],
        "gateway": [],
    }[command]
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        args += ["--etcd", f"127.0.0.1:{closed.getsockname()[1]}"]
    result = subprocess.run(
        [sys.executable, "-m", "tidelog", command, *args, "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, cwd=REPO_ROOT, env=tidelog_env(), timeout=60,
        check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("tidelog ")]
    assert len(errors) == 1 and "unreachable" in errors[0], result.stderr
    assert "listening on" not in result.stdout and "Traceback" not in result.stderr


def test_dev_reports_its_etcd_exiting(tmp_path: Path) -> None:
    """etcd is watched like the other children: it used to die unseen, dev staying up and
    silent with every request timing out (found by an audit)."""
    dev = DevProcess(tmp_path / "data", env=tidelog_env())
    try:
        (etcd,) = [
            pid
            for pid in _children_of(dev.proc.pid)
            if b"etcd" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        ]
        os.kill(etcd, signal.SIGKILL)
        assert dev.proc.wait(30) == 1
        wait_for(
            lambda: any("tidelog dev: error: etcd exited" in line for line in dev.lines),
            10,
            "the report of etcd's exit",
        )
    finally:
        dev.kill()
