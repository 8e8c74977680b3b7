"""The client commands of the ``tidelog`` CLI: topics, produce, consume, groups, cluster.

Each ``cmd_*`` function takes the parsed arguments (see ``tidelog.cli``) and returns the
exit status. Output is a table for people, or JSON (``--output json``) for scripts.
Failures print one line, ``tidelog <command>: error: <message>``, and exit 1; the
wrapper ``run`` turns every tidelog error (and a gateway that cannot be reached) into that
line, never a traceback.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, Final

from tidelog.addresses import format_host_port
from tidelog.admin import Admin, GroupPartitionOffset, TopicDescription
from tidelog.cli import cut_echoes, echo
from tidelog.consumer import Consumer
from tidelog.errors import (
    ConfigError,
    GroupIdNotFoundError,
    NonEmptyGroupError,
    OffsetOutOfRangeError,
    RequestTimedOutError,
    TidelogError,
    UnknownMemberIdError,
    UnknownServerError,
    UnknownTopicOrPartitionError,
    error_for_code,
)
from tidelog.producer import Producer, RecordMetadata
from tidelog.records import BATCH_OVERHEAD_BYTES, record_bytes


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def _given(args: argparse.Namespace) -> Iterator[str]:
    """Every text the user gave on the command line (names, addresses, --config items)."""
    for value in vars(args).values():
        if isinstance(value, str):
            yield value
        elif isinstance(value, list):
            yield from (item for item in value if isinstance(item, str))


def run(name: str, fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return fn(args)
    except TidelogError as exc:
        # SDK and server messages repeat names in full; a huge one is cut, not printed.
        print(f"tidelog {name}: error: {cut_echoes(str(exc), _given(args))}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `tidelog consume ... | head`
        return 0
    except (UnicodeError, ValueError, OSError) as exc:
        # Input no request can carry (an argument that is not UTF-8, a number out of the
        # protocol's range) or output that cannot be written (a full disk): one line.
        message = cut_echoes(f"{type(exc).__name__}: {exc}", _given(args))
        print(f"tidelog {name}: error: {message}", file=sys.stderr)
        return 1


def _ids(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


# --- topics -----------------------------------------------------------------------------------


def _parse_configs(items: Sequence[str]) -> dict[str, str]:
    configs: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--config {echo(item)} is not NAME=VALUE")
        if name in configs and configs[name] != value:
            # The last one silently won: a typo in a long command line went unseen.
            raise ConfigError(
                f"--config {echo(name)} is given twice ({echo(configs[name])} and {echo(value)})"
            )
        configs[name] = value
    return configs


def _topic_rows(topics: Sequence[TopicDescription]) -> list[list[Any]]:
    rows = []
    for topic in topics:
        for p in topic.partitions:
            status = "OFFLINE" if p.offline else "UNDER-REPLICATED" if p.under_replicated else ""
            if p.error:
                # Its leader did not give the offsets: say why, where -1 stood unexplained.
                status = f"{status} {cut_echoes(p.error)}".strip()
            rows.append(
                [
                    topic.name,
                    p.partition,
                    p.leader,
                    _ids(p.replicas),
                    _ids(p.isr),
                    "-" if p.high_watermark < 0 else p.high_watermark,
                    "-" if p.log_end_offset < 0 else p.log_end_offset,
                    status,
                ]
            )
    return rows


def _topic_json(topic: TopicDescription) -> dict[str, Any]:
    return {
        "name": topic.name,
        "topic_id": topic.topic_id,
        "replication_factor": topic.replication_factor,
        "configs": dict(topic.configs),
        "partitions": [
            {
                "partition": p.partition,
                "leader": p.leader,
                "leader_epoch": p.leader_epoch,
                "replicas": list(p.replicas),
                "isr": list(p.isr),
                # null, and the error, when the leader did not give them
                "high_watermark": None if p.high_watermark < 0 else p.high_watermark,
                "log_start_offset": None if p.log_start_offset < 0 else p.log_start_offset,
                "log_end_offset": None if p.log_end_offset < 0 else p.log_end_offset,
                "error": p.error or None,
                "under_replicated": p.under_replicated,
                "offline": p.offline,
            }
            for p in topic.partitions
        ],
    }


def cmd_topics(args: argparse.Namespace) -> int:
    def body(args: argparse.Namespace) -> int:
        admin = Admin(args.gateway)
        if args.action == "create":
            admin.create_topic(
                args.name, args.partitions, args.replication_factor, _parse_configs(args.config)
            )
            if args.output == "json":
                _json({"created": args.name})
            else:
                print(f"created topic {args.name}")
        elif args.action == "alter":
            return _alter_topic(admin, args)
        elif args.action == "delete":
            admin.delete_topic(args.name)
            if args.output == "json":
                _json({"deleted": args.name})
            else:
                print(f"deleted topic {args.name}")
        elif args.action == "list":
            names = admin.list_topics()
            if args.output == "json":
                _json(names)
            else:
                for name in names:
                    print(name)
        else:  # describe
            topics = admin.describe_topics([args.name] if args.name is not None else [])
            if args.output == "json":
                _json([_topic_json(t) for t in topics])
            else:
                _print_table(
                    ["TOPIC", "PARTITION", "LEADER", "REPLICAS", "ISR", "HW", "LEO", "STATUS"],
                    _topic_rows(topics),
                )
                for topic in topics:  # the overrides (kafka-topics --describe's "Configs:")
                    if topic.configs:
                        overrides = ", ".join(f"{k}={v}" for k, v in sorted(topic.configs.items()))
                        print(f"configs of {topic.name}: {overrides}")
        return 0

    return run("topics", body, args)


def _alter_topic(admin: Admin, args: argparse.Namespace) -> int:
    """``tidelog topics alter``: partitions first (the one change that can be refused for
    the topic's state), then the config overrides, checked before anything changes; a
    config change refused after the partitions grew (a concurrent change) says so."""
    if args.partitions is None and not args.config and not args.delete_config:
        raise ConfigError("nothing to alter: give --partitions, --config or --delete-config")
    set_configs = _parse_configs(args.config)
    if args.config or args.delete_config:
        # Checked before the partitions grow, so a bad setting changes nothing at all.
        admin.alter_topic_config(args.name, set_configs, args.delete_config, validate_only=True)
    if args.partitions is not None:
        admin.create_partitions(args.name, args.partitions)
    configs = None
    if args.config or args.delete_config:
        try:
            configs = admin.alter_topic_config(args.name, set_configs, args.delete_config)
        except TidelogError as exc:
            if args.partitions is None:
                raise
            # Checked above, but a concurrent change can still refuse it: the one line
            # must not hide that the partitions did grow.
            raise error_for_code(
                exc.code,
                f"{exc.message} (the topic now has {args.partitions} partitions: that part "
                "of the change was made)",
            ) from None
    if args.output == "json":
        _json({"altered": args.name, "partitions": args.partitions, "configs": configs})
    else:
        changes = []
        if args.partitions is not None:
            changes.append(f"{args.partitions} partitions")
        if configs is not None:
            overrides = ", ".join(f"{k}={v}" for k, v in sorted(configs.items()))
            changes.append(f"config overrides: {overrides or 'none'}")
        print(f"altered topic {args.name}: {'; '.join(changes)}")
    return 0


# --- produce / consume ------------------------------------------------------------------------


# A line this long is sent alone, once every line before it is acknowledged: it is the kind
# of record a topic's max.message.bytes (1 MiB + 12 by default) refuses, and a refused
# request fails every batch of its partition in it, so sent along with others it would fail
# good lines too and the error could not say which line was at fault.
ALONE_LINE_BYTES: Final = 1024 * 1024
# Lines sent before produce waits for their acknowledgements: bounds the futures it holds.
SETTLE_EVERY_LINES: Final = 10_000
# How often produce looks whether a line it sent has failed, to stop reading early.
FAILURE_CHECK_EVERY_LINES: Final = 256
# consume without --follow fails after this long without a record short of the end.
CONSUME_STALL_TIMEOUT_MS: Final = 30_000


class _Delivery:
    """What became of the lines ``produce`` sent: how many were acknowledged, and the first
    that failed, told as the line it was.

    Lines are settled in order: ``written`` counts every line before the ones ``pending``
    holds, all of them acknowledged (a failure stops the input there).
    """

    def __init__(self, producer: Producer, acks: str) -> None:
        self._producer = producer
        # acks=0: the gateway answers at once, so a record counted was sent, not written.
        self._verb = "sent" if acks == "0" else "written"
        self.written = 0
        self._pending: list[tuple[int, Future[RecordMetadata]]] = []

    @property
    def pending(self) -> int:
        return len(self._pending)

    def failed(self) -> bool:
        """Whether a line sent has failed already (its answer came back meanwhile). Asks
        the producer's count of failed records rather than every future: a callback on
        each future made produce a third slower."""
        return self._producer.metrics()["record-error-total"] > 0

    def track(self, line_no: int, future: Future[RecordMetadata]) -> None:
        self._pending.append((line_no, future))

    def settle(self) -> None:
        """Wait for every line sent; raise the first one's failure as ``at_line`` tells it."""
        self._producer.flush()
        if not self.failed():  # all acknowledged: no need to ask each future
            self.written += len(self._pending)
            self._pending.clear()
            return
        outcomes = [(line_no, _failure(future)) for line_no, future in self._pending]
        bad = next(((n, exc) for n, exc in outcomes if exc is not None), None)
        if bad is not None:
            # Lines after the bad one were on their way too; some may have been written.
            after = sum(1 for n, exc in outcomes if n > bad[0] and exc is None)
            raise self.at_line(bad[0], bad[1], after)
        self.written += len(self._pending)
        self._pending.clear()

    def at_line(self, line_no: int, exc: BaseException, after: int = 0) -> TidelogError:
        """``exc`` as the failure of input line ``line_no``, with how many lines before it
        were written: they went out first, so a failure in the middle is not all or
        nothing, and whoever runs produce again needs to know where to start."""
        if not isinstance(exc, TidelogError):
            exc = UnknownServerError(f"{type(exc).__name__}: {exc}")
        before = self.written + sum(
            1 for n, f in self._pending if n < line_no and _failure(f) is None
        )
        told = f"line {line_no}: {exc.message}; {_records(before)} before it were {self._verb}"
        if after:
            told += f", and {after} after it"
        return type(exc)(told)


def _failure(future: Future[RecordMetadata]) -> BaseException | None:
    if future.cancelled():
        return UnknownServerError("the send was cancelled")
    return future.exception()


def _records(count: int) -> str:
    return "1 record" if count == 1 else f"{count} records"


def _produce_lines(producer: Producer, args: argparse.Namespace, lines: Iterable[bytes]) -> int:
    """Send each input line as a record; the number written. A line that cannot be written
    stops the input: the error names it and says how many lines before it were written."""
    delivery = _Delivery(producer, args.acks)
    # The topic and --partition are the arguments' fault, not the first line's: checked
    # before any line is read.
    count = len(producer.partitions_for(args.topic))
    if args.partition is not None and args.partition >= count:
        raise UnknownTopicOrPartitionError(
            f"topic {echo(args.topic)} has {count} partitions; "
            f"partition {args.partition} does not exist"
        )
    sep: bytes | None = None if args.key_separator is None else args.key_separator.encode()
    for line_no, raw in enumerate(lines, start=1):
        # A line already sent failed: stop sending. Checked now and then, as it is cheap
        # but not free; lines sent meanwhile and written are told as "after it".
        if line_no % FAILURE_CHECK_EVERY_LINES == 0 and delivery.failed():
            break
        value = raw.rstrip(b"\r\n")
        key: bytes | None = None
        if sep is not None:
            if sep not in value:
                delivery.settle()
                raise delivery.at_line(
                    line_no, ConfigError(f"no key separator {echo(args.key_separator)} in it")
                )
            key, value = value.split(sep, 1)
        # Its batch's size, framing included: a value a little under 1 MiB already
        # makes a batch over the default max.message.bytes.
        alone = record_bytes(value, key) + BATCH_OVERHEAD_BYTES >= ALONE_LINE_BYTES
        if alone:
            delivery.settle()
        try:
            future = producer.send(args.topic, value, key=key, partition=args.partition)
        except TidelogError as exc:  # e.g. a record larger than the producer's buffer
            delivery.settle()
            raise delivery.at_line(line_no, exc) from None
        delivery.track(line_no, future)
        if alone or delivery.pending >= SETTLE_EVERY_LINES:
            delivery.settle()
    delivery.settle()
    return delivery.written


def cmd_produce(args: argparse.Namespace) -> int:
    def body(args: argparse.Namespace) -> int:
        if args.key_separator == "":
            raise ConfigError("--key-separator must not be empty")
        if sys.stdin is None:  # started with stdin closed (`<&-`)
            raise ConfigError("stdin is closed: produce reads its records from stdin")
        acks = args.acks
        with Producer(
            args.gateway,
            acks=acks,
            enable_idempotence=acks in ("all", "-1"),
            linger_ms=5,
            direct=args.direct,
        ) as producer:
            count = _produce_lines(producer, args, sys.stdin.buffer)
        if args.output == "json":
            _json({"topic": args.topic, "records": count})
        else:
            noun = "record" if count == 1 else "records"
            print(f"produced {count} {noun} to {args.topic}", file=sys.stderr)
        return 0

    return run("produce", body, args)


def cmd_consume(args: argparse.Namespace) -> int:
    def body(args: argparse.Namespace) -> int:
        if sys.stdout is None:  # as produce checks its stdin
            raise ConfigError("stdout is closed: consume writes its records to stdout")
        # The group's offsets are committed here, after each poll's records are printed:
        # auto-commit (on close too) would commit records fetched but not printed when
        # --max-messages stops in a poll's middle or Ctrl-C interrupts one.
        consumer = Consumer(
            args.gateway,
            group_id=args.group,
            auto_offset_reset="earliest" if args.from_beginning else "latest",
            enable_auto_commit=False,
            direct=args.direct,
        )
        with consumer:
            if args.partition is not None:
                consumer.assign([(args.topic, args.partition)])
            else:
                if args.group is not None:
                    # A group member may subscribe to a topic not created yet; here a
                    # missing topic is a typo, said at once rather than waited for.
                    Admin(args.gateway).describe_topic(args.topic)
                consumer.subscribe([args.topic])
            if args.offset is not None:
                tp = (args.topic, args.partition)
                start = consumer.beginning_offsets([tp])[tp]
                end = consumer.end_offsets([tp])[tp]
                if not start <= args.offset <= end:
                    raise OffsetOutOfRangeError(
                        f"offset {args.offset} is outside {args.topic}-{args.partition}'s "
                        f"range [{start}, {end}]"
                    )
                consumer.seek(tp, args.offset)
            elif args.from_beginning and args.group is None:
                consumer.seek_to_beginning()
            # Without --follow, stop at the end each partition had when it was first
            # assigned (a group member gets its partitions at its first poll, and others
            # when the group rebalances).
            ends: dict[tuple[str, int], int] = {}
            shown = 0
            sep = args.key_separator
            # Table output is the records' bytes as they are, as Kafka's console consumer
            # writes them: decoded and re-encoded, bytes that are not UTF-8 came out as
            # U+FFFD, and `consume a | produce b` corrupted binary values (found by an audit).
            out = sys.stdout.buffer
            sep_bytes = sep.encode() if sep is not None else b""
            # The consumer retries a dead gateway for ever (as Kafka's does): without a
            # bound, a consume to the end whose gateway died waited silently for ever
            # (found by an audit).
            timeout_ms = args.timeout_ms
            if timeout_ms is None and not args.follow:
                timeout_ms = CONSUME_STALL_TIMEOUT_MS
            last_record_at = time.monotonic()
            committed: dict[tuple[str, int], int] = {}

            def commit_moved() -> None:
                """Commit the group's positions where they moved, with records or without:
                a member that read nothing (it started at the end) committed nothing,
                and its next run started at the end again, past what was written
                meanwhile (found by an audit; Kafka's console consumer commits its
                position whatever it read)."""
                if args.group is None:
                    return
                positions = {tp: consumer.position(tp) for tp in consumer.assignment()}
                moved = {tp: o for tp, o in positions.items() if committed.get(tp) != o}
                if moved:
                    consumer.commit(moved)
                    committed.update(moved)

            while args.max_messages is None or shown < args.max_messages:
                assigned = consumer.assignment()
                new = [tp for tp in assigned if tp not in ends]
                if new and not args.follow:
                    ends.update(consumer.end_offsets(new))
                if (
                    not args.follow
                    and assigned
                    and all(consumer.position(tp) >= ends[tp] for tp in assigned)
                ):
                    break
                joined = consumer.group_metadata()
                if not args.follow and not assigned and joined and joined.generation_id >= 0:
                    # The group gave this member nothing (others hold every partition).
                    print(
                        f"group {args.group}: the other members hold every partition of "
                        f"{args.topic}; nothing for this consumer",
                        file=sys.stderr,
                    )
                    break
                left = None if args.max_messages is None else args.max_messages - shown
                records = consumer.poll(max_records=left, timeout_ms=500)
                if records:
                    last_record_at = time.monotonic()
                elif (
                    timeout_ms is not None
                    and (time.monotonic() - last_record_at) * 1000 >= timeout_ms
                ):
                    if args.follow:
                        break  # Kafka's --timeout-ms: no record for that long, done
                    raise RequestTimedOutError(
                        f"no record for {timeout_ms} ms before the end of {args.topic} was "
                        "reached: is the gateway (or a partition's leader) reachable?"
                    )
                for record in records:
                    if args.output == "json":
                        print(
                            json.dumps(
                                {
                                    "topic": record.topic,
                                    "partition": record.partition,
                                    "offset": record.offset,
                                    "timestamp_ms": record.timestamp_ms,
                                    "key": _text(record.key),
                                    "value": _text(record.value),
                                    # [name, value] pairs in order: a name may repeat
                                    # (an object kept only its last value; found by an
                                    # audit).
                                    "headers": [[n, _text(v)] for n, v in record.headers],
                                }
                            )
                        )
                    elif sep is not None:
                        out.write(
                            b"%s%s%s\n" % (_shown(record.key), sep_bytes, _shown(record.value))
                        )
                    else:
                        out.write(b"%s\n" % _shown(record.value))
                    shown += 1
                sys.stdout.flush()
                out.flush()
                commit_moved()  # what was printed (positions follow poll's records)
            commit_moved()
        return 0

    return run("consume", body, args)


def _shown(value: bytes | None) -> bytes:
    """A key or value as the table output shows it: a missing one (a record without a key,
    a tombstone) as ``null``, as Kafka's console consumer prints it; it printed as an empty
    string, which reads (and produces back) as a key or value of zero bytes."""
    return b"null" if value is None else value


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8", errors="replace")


# --- groups / cluster -------------------------------------------------------------------------


def cmd_groups(args: argparse.Namespace) -> int:
    def body(args: argparse.Namespace) -> int:
        admin = Admin(args.gateway)
        if args.action == "list":
            groups = admin.list_groups()
            if args.output == "json":
                _json(groups)
            else:
                for group in groups:
                    print(group)
            return 0
        if args.action == "delete":
            deleted = admin.delete_group(args.group)
            if args.output == "json":
                _json({"group": args.group, "offsets_deleted": deleted})
            else:
                print(f"deleted group {args.group} ({deleted} committed offsets)")
            return 0
        if args.action == "reset-offsets":
            return _reset_offsets(admin, args)
        if args.action == "members":
            described = admin.describe_group_members(args.group)
            if not described.members and not admin.describe_group(args.group):
                raise _no_such_group(args.group)
            if args.output == "json":
                _json(
                    {
                        "state": described.state,
                        "generation": described.generation,
                        "members": [
                            {
                                "member_id": m.member_id,
                                "group_instance_id": m.group_instance_id or None,
                                "client_id": m.client_id,
                                "topics": list(m.topics),
                                "partitions": [list(tp) for tp in m.assignment],
                            }
                            for m in described.members
                        ],
                    }
                )
            else:
                print(
                    f"group {args.group}: {described.state}, generation "
                    f"{described.generation}, {len(described.members)} member(s)"
                )
                _print_table(
                    ["MEMBER", "INSTANCE", "CLIENT", "PARTITIONS"],
                    [
                        [
                            m.member_id,
                            m.group_instance_id or "-",
                            m.client_id,
                            ",".join(f"{t}-{p}" for t, p in m.assignment) or "-",
                        ]
                        for m in described.members
                    ],
                )
            return 0
        offsets = admin.describe_group(args.group)
        membership = admin.describe_group_members(args.group)
        if not offsets and not membership.members:
            raise _no_such_group(args.group)
        owner = {tp: m.member_id for m in membership.members for tp in m.assignment}
        # Partitions a member owns that the group never committed are shown too (as
        # kafka-consumer-groups does), with no committed offset and no lag.
        uncommitted = sorted(set(owner) - {(o.topic, o.partition) for o in offsets})
        try:  # best effort, per partition, as for the committed rows
            latest = admin.list_offsets(uncommitted, "latest", partial=True) if uncommitted else {}
        except TidelogError:
            latest = {}
        rows: list[tuple[str, int, int | None, int, int | None]] = [
            (o.topic, o.partition, o.committed_offset, o.high_watermark, o.lag) for o in offsets
        ]
        rows += [(t, p, None, latest.get((t, p), -1), None) for t, p in uncommitted]
        rows.sort(key=lambda row: (row[0], row[1]))
        if args.output == "json":
            # The state the table's first line gives too: a script must tell Empty from
            # Stable before a reset or a delete.
            _json(
                {
                    "group": args.group,
                    "state": membership.state,
                    "generation": membership.generation,
                    "members": len(membership.members),
                    "partitions": [
                        {
                            "topic": topic,
                            "partition": partition,
                            "committed_offset": committed,
                            "high_watermark": None if high_watermark < 0 else high_watermark,
                            "lag": lag,
                            "member_id": owner.get((topic, partition)),
                        }
                        for topic, partition, committed, high_watermark, lag in rows
                    ],
                }
            )
        else:
            print(
                f"group {args.group}: {membership.state}, generation {membership.generation}, "
                f"{len(membership.members)} member(s)"
            )
            _print_table(
                ["TOPIC", "PARTITION", "COMMITTED", "HW", "LAG", "MEMBER"],
                [
                    [
                        topic,
                        partition,
                        "-" if committed is None else committed,
                        "-" if high_watermark < 0 else high_watermark,  # leader unreachable
                        "-" if lag is None else lag,
                        owner.get((topic, partition), "-"),
                    ]
                    for topic, partition, committed, high_watermark, lag in rows
                ],
            )
        return 0

    return run("groups", body, args)


def _no_such_group(group: str) -> GroupIdNotFoundError:
    return GroupIdNotFoundError(f"group {echo(group)} has no committed offsets or members")


def _reset_offsets(admin: Admin, args: argparse.Namespace) -> int:
    """Kafka's kafka-consumer-groups --reset-offsets: the new offsets, clamped to each
    partition's [log start, high watermark], shown, and committed with --execute (which
    the gateway refuses while the group has members)."""
    members = admin.describe_group_members(args.group).members
    if members:
        # Refused before the dry run too, as Kafka's tool does: the offsets it would show
        # could never be committed while the group is active.
        raise NonEmptyGroupError(
            f"group {echo(args.group)} has {len(members)} member(s): offsets can be reset "
            "only while it is inactive; stop its consumers first"
        )
    committed = admin.describe_group(args.group)
    tps = _partitions_to_reset(admin, args, committed)
    earliest = admin.list_offsets(tps, "earliest")
    latest = admin.list_offsets(tps, "latest")
    current = {
        (o.topic, o.partition): o.committed_offset
        for o in committed
        if (o.topic, o.partition) in earliest
    }
    if args.to_earliest:
        wanted = dict(earliest)
    elif args.to_latest:
        wanted = dict(latest)
    elif args.to_current:
        # Kafka's --to-current: a partition without a commit goes to the end.
        wanted = {tp: current[tp] if current.get(tp, -1) >= 0 else latest[tp] for tp in tps}
    elif args.to_offset is not None:
        wanted = dict.fromkeys(tps, args.to_offset)
    elif args.to_datetime is not None or args.by_duration is not None:
        if args.to_datetime is not None:
            at_ms = _parse_datetime_ms(args.to_datetime)
        else:
            at_ms = max(0, int(time.time() * 1000) - args.by_duration)
        found = admin.list_offsets(tps, at_ms)
        # No record that recent: the end, as Kafka's --to-datetime and --by-duration.
        wanted = {tp: found[tp] if found[tp] >= 0 else latest[tp] for tp in tps}
    else:
        missing = [f"{t}-{p}" for t, p in tps if current.get((t, p), -1) < 0]
        if missing:
            raise ConfigError(
                f"group {echo(args.group)} has no committed offset to shift for "
                f"{', '.join(missing)}"
            )
        wanted = {tp: current[tp] + args.shift_by for tp in tps}
    new = {tp: min(max(wanted[tp], earliest[tp]), latest[tp]) for tp in tps}
    if args.execute:
        try:
            admin.alter_group_offsets(args.group, new)
        except UnknownMemberIdError:
            # The commit fencing's answer to an outsider: say what an operator must do.
            raise NonEmptyGroupError(
                f"group {echo(args.group)} has members: stop its consumers first"
            ) from None
    # No commit yet: null / "-", as `groups describe` shows it (it showed -1 here).
    rows = [(t, p, current.get((t, p)), new[(t, p)]) for t, p in tps]
    if args.output == "json":
        _json(
            {
                "group": args.group,
                "executed": bool(args.execute),
                "offsets": [
                    {"topic": t, "partition": p, "current": c, "new": n} for t, p, c, n in rows
                ],
            }
        )
    else:
        _print_table(
            ["TOPIC", "PARTITION", "CURRENT", "NEW"],
            [[t, p, "-" if c is None else c, n] for t, p, c, n in rows],
        )
        if not args.execute:
            print("(dry run: add --execute to commit these offsets)", file=sys.stderr)
    return 0


def _partitions_to_reset(
    admin: Admin, args: argparse.Namespace, committed: Sequence[GroupPartitionOffset]
) -> list[tuple[str, int]]:
    """The partitions --topic (``name`` or ``name:0,2``, repeatable) or --all-topics name,
    each checked to exist."""
    if args.all_topics:
        # Kafka's --all-topics: the partitions the group has committed offsets for.
        if args.partition is not None:
            raise ConfigError("--partition needs exactly one --topic (whose partition it is)")
        found = sorted({(o.topic, o.partition) for o in committed if o.committed_offset >= 0})
        if not found:
            raise _no_such_group(args.group)
        return found
    # Every topic named (--topic may repeat, as in Kafka's tool: the last one alone was
    # reset, silently, found by an audit). A topic's partitions: those listed after its
    # colon (in every mention), else --partition, else all of them.
    listed: dict[str, set[int] | None] = {}
    for topic, partitions in args.topic:
        if partitions is None or (topic in listed and listed[topic] is None):
            listed[topic] = None
        else:
            listed[topic] = (listed.get(topic) or set()) | set(partitions)
    if args.partition is not None:
        if len(listed) > 1 or any(named is not None for named in listed.values()):
            raise ConfigError(
                "--partition needs exactly one --topic (whose partition it is) with no "
                "partitions after a colon"
            )
        listed = {topic: {args.partition} for topic in listed}
    tps: list[tuple[str, int]] = []
    for topic, named in listed.items():
        partitions = [p.partition for p in admin.describe_topic(topic).partitions]
        missing = sorted((named or set()) - set(partitions))
        if missing:
            raise ConfigError(
                f"topic {echo(topic)} has {len(partitions)} partitions; partition "
                f"{', '.join(map(str, missing))} does not exist"
            )
        tps += [(topic, p) for p in partitions if named is None or p in named]
    return tps


_EPOCH: Final = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def _parse_datetime_ms(text: str) -> int:
    """An ISO 8601 time as ms since the epoch; with no zone, the local time, as Kafka's
    kafka-consumer-groups reads it (it was read as UTC)."""
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
        if moment.tzinfo is None:
            moment = moment.astimezone()  # the local zone (TZ), its offset on that date
    except (ValueError, OverflowError, OSError):  # (astimezone: years 1 and 9999)
        raise ConfigError(
            f"--to-datetime {echo(text)} is not an ISO 8601 time (e.g. 2026-11-26T10:00:00Z)"
        ) from None
    # Exact integer arithmetic: a float's rounding put some times 1 ms early.
    ms = (moment - _EPOCH) // datetime.timedelta(milliseconds=1)
    if ms < 0:
        raise ConfigError(f"--to-datetime {echo(text)} is before 1970")
    return ms


def cmd_cluster(args: argparse.Namespace) -> int:
    def body(args: argparse.Namespace) -> int:
        cluster = Admin(args.gateway).describe_cluster()
        if args.output == "json":
            _json(
                {
                    "cluster_id": cluster.cluster_id,
                    "controller_id": cluster.controller_id,
                    "controller_address": cluster.controller_address,
                    "brokers": [
                        {"broker_id": b.broker_id, "host": b.host, "port": b.port, "rack": b.rack}
                        for b in cluster.brokers
                    ],
                    "offline_partitions": [list(tp) for tp in cluster.offline_partitions],
                    "under_replicated_partitions": [
                        list(tp) for tp in cluster.under_replicated_partitions
                    ],
                }
            )
            return 0
        print(f"cluster {cluster.cluster_id}")
        print(f"controller {cluster.controller_id} at {cluster.controller_address or '-'}")
        _print_table(
            ["BROKER", "ADDRESS", "RACK"],
            [
                [b.broker_id, format_host_port(b.host, b.port), b.rack or "-"]
                for b in cluster.brokers
            ],
        )
        offline = cluster.offline_partitions
        under = cluster.under_replicated_partitions
        print(f"offline partitions: {len(offline)}")
        for topic, partition in offline:
            print(f"  {topic}-{partition}")
        print(f"under-replicated partitions: {len(under)}")
        for topic, partition in under:
            print(f"  {topic}-{partition}")
        return 0

    return run("cluster", body, args)
