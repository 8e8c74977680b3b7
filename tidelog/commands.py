"""The client commands of the ``tidelog`` CLI: topics, produce, consume, groups, cluster.

Each ``cmd_*`` function takes the parsed arguments (see ``tidelog.cli``) and returns the
exit status. Output is a table for people, or JSON (``--output json``) for scripts.
Failures print one line, ``tidelog <command>: error: <message>``, and exit 1; the
wrapper ``run`` turns every tidelog error (and a gateway that cannot be reached) into that
line, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tidelog.admin import Admin, TopicDescription
from tidelog.consumer import Consumer
from tidelog.errors import ConfigError, OffsetOutOfRangeError, TidelogError
from tidelog.producer import Producer


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def run(name: str, fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return fn(args)
    except TidelogError as exc:
        print(f"tidelog {name}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `tidelog consume ... | head`
        return 0
    except (UnicodeError, ValueError, OSError) as exc:
        # Input no request can carry (an argument that is not UTF-8, a number out of the
        # protocol's range) or output that cannot be written (a full disk): one line.
        print(f"tidelog {name}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _ids(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


# --- topics -----------------------------------------------------------------------------------


def _parse_configs(items: Sequence[str]) -> dict[str, str]:
    configs: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--config {item!r} is not NAME=VALUE")
        configs[name] = value
    return configs


def _topic_rows(topics: Sequence[TopicDescription]) -> list[list[Any]]:
    rows = []
    for topic in topics:
        for p in topic.partitions:
            status = "OFFLINE" if p.offline else "UNDER-REPLICATED" if p.under_replicated else ""
            rows.append(
                [
                    topic.name,
                    p.partition,
                    p.leader,
                    _ids(p.replicas),
                    _ids(p.isr),
                    p.high_watermark,
                    p.log_end_offset,
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
                "high_watermark": p.high_watermark,
                "log_start_offset": p.log_start_offset,
                "log_end_offset": p.log_end_offset,
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
            topics = admin.describe_topics([args.name] if args.name else [])
            if args.output == "json":
                _json([_topic_json(t) for t in topics])
            else:
                _print_table(
                    ["TOPIC", "PARTITION", "LEADER", "REPLICAS", "ISR", "HW", "LEO", "STATUS"],
                    _topic_rows(topics),
                )
        return 0

    return run("topics", body, args)


# --- produce / consume ------------------------------------------------------------------------


def cmd_produce(args: argparse.Namespace) -> int:
    def body(args: argparse.Namespace) -> int:
        acks = args.acks
        count = 0
        with Producer(
            args.gateway,
            acks=acks,
            enable_idempotence=acks in ("all", "-1"),
            linger_ms=5,
            direct=args.direct,
        ) as producer:
            futures = []
            if args.key_separator == "":
                raise ConfigError("--key-separator must not be empty")
            for raw in sys.stdin.buffer:
                line = raw.rstrip(b"\r\n")
                key: bytes | None = None
                if args.key_separator is not None:
                    sep = args.key_separator.encode()
                    if sep not in line:
                        raise ConfigError(
                            f"line {count + 1} has no key separator {args.key_separator!r}"
                        )
                    key, line = line.split(sep, 1)
                futures.append(producer.send(args.topic, line, key=key, partition=args.partition))
                count += 1
                if len(futures) >= 10_000:
                    for future in futures:
                        future.result()
                    futures.clear()
            producer.flush()
            for future in futures:
                future.result()
        if args.output == "json":
            _json({"topic": args.topic, "records": count})
        else:
            print(f"produced {count} records to {args.topic}", file=sys.stderr)
        return 0

    return run("produce", body, args)


def cmd_consume(args: argparse.Namespace) -> int:
    def body(args: argparse.Namespace) -> int:
        if args.from_beginning and args.offset is not None:
            raise ConfigError("--from-beginning and --offset exclude each other")
        if args.offset is not None and args.partition is None:
            raise ConfigError("--offset needs --partition")
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
            # Without --follow, stop at the end the log had when we started.
            ends = {} if args.follow else consumer.end_offsets(consumer.assignment())
            shown = 0
            sep = args.key_separator
            while args.max_messages is None or shown < args.max_messages:
                if not args.follow and all(
                    consumer.position(tp) >= end for tp, end in ends.items()
                ):
                    break
                left = None if args.max_messages is None else args.max_messages - shown
                records = consumer.poll(max_records=left, timeout_ms=500)
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
                                    "headers": {n: _text(v) for n, v in record.headers},
                                }
                            )
                        )
                    elif sep is not None:
                        print(f"{_text(record.key) or ''}{sep}{_text(record.value) or ''}")
                    else:
                        print(_text(record.value) or "")
                    shown += 1
                sys.stdout.flush()
                if records and args.group is not None:
                    consumer.commit()  # what was printed (positions follow poll's records)
        return 0

    return run("consume", body, args)


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
        offsets = admin.describe_group(args.group)
        if not offsets:
            raise ConfigError(f"group {args.group!r} has no committed offsets")
        if args.output == "json":
            _json(
                [
                    {
                        "topic": o.topic,
                        "partition": o.partition,
                        "committed_offset": o.committed_offset,
                        "high_watermark": o.high_watermark,
                        "lag": o.lag,
                    }
                    for o in offsets
                ]
            )
        else:
            _print_table(
                ["TOPIC", "PARTITION", "COMMITTED", "HW", "LAG"],
                [
                    [o.topic, o.partition, o.committed_offset, o.high_watermark, o.lag]
                    for o in offsets
                ],
            )
        return 0

    return run("groups", body, args)


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
            [[b.broker_id, f"{b.host}:{b.port}", b.rack or "-"] for b in cluster.brokers],
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
