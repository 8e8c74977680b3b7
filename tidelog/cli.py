"""The ``tidelog`` command line: one entry point, one subcommand per role or tool.

``main(argv)`` parses the arguments and dispatches to the module that implements the
chosen command, importing it only then, so ``tidelog --help`` stays fast and one
command's heavy dependencies (gRPC servers, PySpark) never load for another.

Adding a command group: write ``_add_<name>(subparsers)`` that declares its arguments and
sets ``handler`` to a ``"module:function"`` string, then list it in ``_COMMANDS``. The
function receives the parsed ``argparse.Namespace`` and returns the exit status.

Bad input prints one line (``tidelog: error: ...``) and exits with status 2, never a
traceback; failures at run time are the handler's to report in one line with status 1.
"""

from __future__ import annotations

import argparse
import decimal
import importlib
import ipaddress
import math
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Final, NoReturn

from tidelog.addresses import check_connectable, parse_host_port
from tidelog.formats import INT32_MAX, INT64_MAX, MAX_PRODUCE_REQUEST_BYTES

ECHO_MAX_CHARS: Final = 80
"""How much of a value the user gave (a topic or group name, an argument) an error line
repeats: a 100,000-character name would fill the terminal and make the line no clearer.
A longer value shows its start, "..." and its length."""
MAX_ERROR_CHARS: Final = 1_000
"""Cap on one error line, for long text ``cut_echoes`` cannot tell is the user's (a long
value with spaces inside a message it was not given the value for)."""
# A run this long without a space or a quote is an echoed value, not words: cut it even
# when the value was not named to cut_echoes (argparse's own messages). Quotes end it so
# that the length told is the value's. Well above ECHO_MAX_CHARS, so that values already
# cut, and ordinary addresses or paths, are left alone.
_LONG_RUN = re.compile(r"[^\s'\"]{201,}")


def shorten(text: str, limit: int = ECHO_MAX_CHARS) -> str:
    """``text`` when at most ``limit`` characters, else its start, "..." and its length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"


def echo(value: str) -> str:
    """``value`` quoted (its repr) for an error message, cut like ``shorten``."""
    if len(value) <= ECHO_MAX_CHARS:
        return repr(value)
    return f"{value[:ECHO_MAX_CHARS]!r}... ({len(value)} chars)"


def cut_echoes(message: str, values: Iterable[str] = ()) -> str:
    """``message`` made fit for one line of stderr: each long value of ``values`` cut where it
    appears (quoted as ``echo`` does, or bare as ``shorten`` does), any other long run
    without spaces cut too, line breaks made spaces, and the whole capped at
    ``MAX_ERROR_CHARS``. Messages from the SDK and the servers repeat names in full."""
    # Longest first: a long value may contain a shorter one.
    for value in sorted({v for v in values if len(v) > ECHO_MAX_CHARS}, key=len, reverse=True):
        message = message.replace(repr(value), echo(value)).replace(value, shorten(value))
    message = _LONG_RUN.sub(lambda match: shorten(match[0]), message)
    return shorten(" ".join(message.splitlines()), MAX_ERROR_CHARS)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        # argparse's own messages repeat a bad value in full (invalid choice, unrecognized
        # arguments): cut_echoes keeps the line short.
        self.exit(2, f"{self.prog}: error: {cut_echoes(message)} (see --help)\n")


def _host_port(text: str) -> tuple[str, int]:
    try:
        return parse_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _gateway_address(text: str) -> str:
    """A gateway to connect to: HOST:PORT with a port a connection can use (1..65535).
    An empty or malformed value used to be taken as given (an empty one silently meant
    $TIDELOG_GATEWAY; port 99999 was wrapped by the resolver to another port)."""
    try:
        return check_connectable(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _broker_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{echo(text)} is not an integer") from None
    if not 0 <= value < 2**31:
        raise argparse.ArgumentTypeError(f"broker id {value} must be between 0 and 2^31-1")
    return value


def _add_logging(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="JSON log lines on stderr at this level and above (default: info)",
    )


def _add_advertised_host(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--advertised-host",
        metavar="HOST",
        type=_advertised_host,
        default=None,
        help=(
            "host other processes use to reach this one (Kafka's advertised.listeners); "
            "default: the --listen host, or this machine's FQDN for 0.0.0.0"
        ),
    )


_LABEL: Final = r"[A-Za-z0-9](?:[A-Za-z0-9_-]*[A-Za-z0-9])?"
_HOST_NAME: Final = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?", re.ASCII)


def _advertised_host(text: str) -> str:
    """A host others can dial: an IP address (IPv6 with or without brackets) or a host
    name - no port. One with a space, or a HOST:PORT, was registered, and no gateway or
    follower could reach the broker (found by audits)."""
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    if bare is text and _HOST_NAME.fullmatch(text) and len(text) <= 253:
        return text
    raise argparse.ArgumentTypeError(
        f"{echo(text)} is not a host name or IP address (give the port in --listen)"
    )


def _add_cluster_membership(
    parser: argparse.ArgumentParser,
    *,
    etcd_help: str,
    session_help: str | None,
    etcd_required: bool = False,
) -> None:
    """--etcd, --cluster and --session-ttl-s: how a service finds and joins its cluster.

    ``session_help`` None: the service holds no lease (the gateway), so no --session-ttl-s.
    """
    parser.add_argument(
        "--etcd", type=_etcd_endpoints, metavar="URL", required=etcd_required, help=etcd_help
    )
    parser.add_argument(
        "--cluster",
        type=_cluster_name,
        default="default",
        metavar="NAME",
        help="cluster name: the etcd key prefix /tidelog/NAME/ (default: default)",
    )
    if session_help is not None:
        parser.add_argument(
            "--session-ttl-s", type=_session_ttl_s, default=10, metavar="S", help=session_help
        )


MAX_SESSION_TTL_S: Final = 9_000_000_000
"""etcd's largest lease TTL (its MaxLeaseTTL): a longer one is refused at every grant."""


def _etcd_endpoints(text: str) -> str:
    """Checked here, not when the node starts: an empty value used to make a storage node
    run outside any cluster, and a bad one failed only after the data directory was
    locked or the port bound. Exits 2 with one line, as every other bad flag."""
    from services.metastore import parse_endpoints  # noqa: PLC0415 - service commands only

    try:
        parse_endpoints(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _data_dir(text: str) -> str:
    """A directory path, not empty or blank: "" is the working directory to the OS, where
    a storage node deleted every directory named like an interrupted topic deletion
    (``*-delete``) and wrote log files into those named like partitions, from an unset
    ``--data-dir "$DATA"`` (found by an audit). Exits 2 with one line."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "must name a directory (an empty value would be the working directory)"
        )
    return text


def _cluster_name(text: str) -> str:
    if not text or "/" in text:
        raise argparse.ArgumentTypeError(f"{echo(text)} must be non-empty and contain no '/'")
    return text


def _session_ttl_s(text: str) -> int:
    return _int_at_least(text, 1, MAX_SESSION_TTL_S)


MAX_MESSAGE_BYTES: Final = INT32_MAX - 8 * 1024 * 1024
"""The largest request or fetch size a gateway takes: gRPC's message limits are C ints,
and the gateway adds its framing allowance (4 MiB) to them; a larger value failed at
start with an OverflowError."""


def _message_bytes(text: str) -> int:
    return _int_at_least(text, 1, MAX_MESSAGE_BYTES)


def _add_max_concurrent_rpcs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-concurrent-rpcs",
        type=_positive_int,
        default=1024,
        metavar="N",
        help="calls in flight at once (running or queued for a thread); beyond that, "
        "RESOURCE_EXHAUSTED, except health checks (default: 1024)",
    )


def _add_storage(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    parser = subparsers.add_parser(
        "storage",
        help="run a storage node (broker)",
        description=(
            "Run a storage node: serves tidelog.v1.Storage (plus gRPC health and "
            "reflection) for the partition logs under --data-dir. Prints "
            "'tidelog storage broker N listening on HOST:PORT' once serving; "
            "SIGTERM or SIGINT stops it cleanly (exit status 0)."
        ),
    )
    parser.add_argument("--broker-id", type=_broker_id, required=True, help="unique id, >= 0")
    parser.add_argument(
        "--data-dir",
        type=_data_dir,
        required=True,
        help="directory of partition logs (created if missing)",
    )
    parser.add_argument(
        "--listen",
        type=_host_port,
        default=("127.0.0.1", 9092),
        metavar="HOST:PORT",
        help="address to serve on; port 0 picks a free port (default: 127.0.0.1:9092)",
    )
    _add_cluster_membership(
        parser,
        etcd_help="etcd endpoint(s), comma-separated: the broker registers there and takes "
        "part in the cluster; without it the node runs alone (partitions made by LeaderAndIsr)",
        session_help="lease TTL of the broker's registration: a broker silent this long is "
        "considered dead (default: 10)",
    )
    parser.add_argument(
        "--rack",
        metavar="R",
        help="failure domain (e.g. zone), for rack-aware replica placement",
    )
    parser.add_argument(
        "--controlled-shutdown-timeout-s",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, how long to wait for the controller to move this broker's "
        "leaderships away before stopping anyway (default: 30)",
    )
    parser.add_argument(
        "--replica-lag-time-max-ms",
        type=_positive_int,
        default=None,
        metavar="MS",
        help="override every topic's replica.lag.time.max.ms: a follower not caught up "
        "for this long leaves the ISR (default: the topic's, else 30000)",
    )
    parser.add_argument(
        "--log-retention-check-interval-ms",
        type=_positive_int,
        default=300_000,
        metavar="MS",
        help="how often retention.ms and retention.bytes are applied to every log "
        "(Kafka's log.retention.check.interval.ms; default: 300000)",
    )
    parser.add_argument(
        "--max-append-streams",
        type=_positive_int,
        default=16,
        metavar="N",
        help="AppendStream calls open at once (a direct-mode producer keeps one per broker); "
        "beyond that a producer is refused and uses unary appends (default: 16)",
    )
    parser.add_argument(
        "--max-waiting-fetches",
        type=_positive_int,
        default=32,
        metavar="N",
        help="long-poll fetches that may wait for data at once, each holding a thread; a "
        "quarter is kept for followers, and a consumer's fetch beyond the rest is answered "
        "at once with a throttle time (default: 32)",
    )
    _add_max_concurrent_rpcs(parser)
    _add_advertised_host(parser)
    _add_logging(parser)
    parser.set_defaults(handler="services.storage.node:main")


def _controller_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{echo(text)} is not an integer") from None
    if not 1 <= value < 2**31:
        raise argparse.ArgumentTypeError(f"controller id {value} must be between 1 and 2^31-1")
    return value


def _int_at_least(text: str, minimum: int, maximum: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{echo(text)} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise argparse.ArgumentTypeError(f"{value} must be <= {maximum}")
    return value


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def _positive_int32(text: str) -> int:
    """A count the protocol carries as int32 (partitions, replication factor)."""
    return _int_at_least(text, 1, INT32_MAX)


def _non_negative_int32(text: str) -> int:
    """A partition index (int32 on the wire)."""
    return _int_at_least(text, 0, INT32_MAX)


def _topic_partitions(text: str) -> tuple[str, tuple[int, ...] | None]:
    """Kafka's --topic of kafka-consumer-groups: ``name`` or ``name:0,2`` (a topic name
    cannot hold a colon, so the first one splits)."""
    name, colon, listed = text.partition(":")
    if not colon:
        return name, None
    partitions: list[int] = []
    for item in listed.split(","):
        try:
            partitions.append(_non_negative_int32(item.strip()))
        except argparse.ArgumentTypeError as error:
            raise argparse.ArgumentTypeError(
                f"{echo(text)}: the partitions after the colon must be indexes, e.g. "
                f"orders:0,2 ({error})"
            ) from None
    return name, tuple(dict.fromkeys(partitions))


# Java's Duration.parse form, which Kafka's --by-duration takes: days, hours, minutes and
# (fractional) seconds, each optional, at least one present.
_DURATION: Final = re.compile(
    r"P(?:(?P<d>\d+)D)?(?:T(?:(?P<h>\d+)H)?(?:(?P<m>\d+)M)?(?:(?P<s>\d+(?:\.\d{1,9})?)S)?)?",
    re.IGNORECASE,
)


def _duration_ms(text: str) -> int:
    """An ISO 8601 duration (PnDTnHnMnS) in whole milliseconds."""
    match = _DURATION.fullmatch(text.strip())
    if (
        match is None
        or not any(match.group(unit) for unit in "dhms")
        or text.strip().upper().endswith("T")
    ):
        raise argparse.ArgumentTypeError(
            f"{echo(text)} is not an ISO 8601 duration such as PT30M, PT1H or P1DT12H"
        )
    seconds = decimal.Decimal(match.group("s") or 0)
    ms = (
        (int(match.group("d") or 0) * 86_400 + int(match.group("h") or 0) * 3_600)
        + int(match.group("m") or 0) * 60
    ) * 1_000 + int(seconds * 1_000)
    if ms > INT64_MAX:
        raise argparse.ArgumentTypeError(f"{echo(text)} is too long a duration")
    return ms


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{echo(text)} is not a number") from None
    if not value > 0:  # (nan too)
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    if math.isinf(value):
        raise argparse.ArgumentTypeError(f"{value} must be finite")
    return value


def _add_controller(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    parser = subparsers.add_parser(
        "controller",
        help="run a controller (one active, the others standby)",
        description=(
            "Run a controller: takes part in the election in etcd; the active one manages "
            "topics, replica assignment, leaders and ISRs and pushes them to the brokers, "
            "standbys answer NOT_CONTROLLER with the active one's address. Serves "
            "tidelog.v1.Controller (plus gRPC health and reflection). Prints "
            "'tidelog controller ID listening on HOST:PORT' once serving; SIGTERM or SIGINT "
            "resigns (a standby takes over at once) and exits with status 0."
        ),
    )
    _add_cluster_membership(
        parser,
        etcd_required=True,
        etcd_help="etcd endpoint(s), comma-separated",
        session_help="lease TTL of the election key: a silent active controller is replaced "
        "after this long (default: 10)",
    )
    parser.add_argument(
        "--listen",
        type=_host_port,
        default=("127.0.0.1", 9093),
        metavar="HOST:PORT",
        help="address to serve on; port 0 picks a free port (default: 127.0.0.1:9093)",
    )
    parser.add_argument(
        "--controller-id",
        type=_controller_id,
        default=None,
        metavar="N",
        help="id of this controller, unique among controllers (default: a random positive int)",
    )
    parser.add_argument(
        "--imbalance-check-interval-s",
        type=_positive_float,
        default=300.0,
        metavar="S",
        help="how often to restore preferred leaders where a broker's leadership imbalance "
        "exceeds 10%% (Kafka's leader.imbalance.check.interval.seconds; default: 300)",
    )
    parser.add_argument(
        "--offsets-retention-ms",
        type=_positive_int,
        default=7 * 24 * 3600 * 1000,
        metavar="MS",
        help="a consumer group without members loses its committed offsets this long after "
        "its last commit (Kafka's offsets.retention.minutes; default: 7 days)",
    )
    parser.add_argument(
        "--offsets-retention-check-interval-s",
        type=_positive_float,
        default=600.0,
        metavar="S",
        help="how often to look for expired group offsets "
        "(Kafka's offsets.retention.check.interval.ms; default: 600)",
    )
    _add_advertised_host(parser)
    _add_logging(parser)
    parser.set_defaults(handler="services.controller.node:main")


def _add_gateway(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    parser = subparsers.add_parser(
        "gateway",
        help="run a gateway (the stateless front door for clients)",
        description=(
            "Run a gateway: serves tidelog.v1.Gateway (plus gRPC health and reflection) to "
            "the SDK, the CLI and Spark executors, routing produce and fetch requests to "
            "partition leaders from a metadata cache fed by etcd. Stateless: run as many as "
            "needed. Prints 'tidelog gateway listening on HOST:PORT' once serving; SIGTERM "
            "or SIGINT stops it cleanly (exit status 0)."
        ),
    )
    _add_cluster_membership(
        parser,
        etcd_required=True,
        etcd_help="etcd endpoint(s), comma-separated",
        session_help=None,
    )
    parser.add_argument(
        "--listen",
        type=_host_port,
        default=("127.0.0.1", 9094),
        metavar="HOST:PORT",
        help="address to serve on; port 0 picks a free port (default: 127.0.0.1:9094)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=_message_bytes,
        default=MAX_PRODUCE_REQUEST_BYTES,
        metavar="N",
        help="largest produce request accepted (default: 104857600, 100 MiB)",
    )
    parser.add_argument(
        "--max-fetch-bytes",
        type=_message_bytes,
        default=None,
        metavar="N",
        help=(
            "cap on the record bytes of one fetch response (default: 52428800, 50 MiB, or "
            "1/32 of the cgroup memory limit when that is less)"
        ),
    )
    parser.add_argument(
        "--max-in-flight-per-stream",
        type=_positive_int,
        default=64,
        metavar="N",
        help="produce requests one ProduceStream may have unanswered (default: 64)",
    )
    parser.add_argument(
        "--queued-max-request-bytes",
        type=_positive_int,
        default=None,
        metavar="N",
        help=(
            "record bytes of produce requests held at once, over all clients; a stream "
            "is read no further until its next request fits (default: 268435456, 256 MiB, "
            "or an eighth of the cgroup memory limit when that is less)"
        ),
    )
    parser.add_argument(
        "--produce-group-min-partitions",
        type=_positive_int,
        default=4,
        metavar="N",
        help=(
            "partitions of one leader in one produce request that go to it in one "
            "AppendMany call; fewer are sent one Append each (default: 4)"
        ),
    )
    parser.add_argument(
        "--max-background-appends",
        type=_positive_int,
        default=1024,
        metavar="N",
        help=(
            "acks=0 appends the gateway has answered but a leader broker has not, per "
            "broker; beyond it an acks=0 request waits for a slot until its timeout "
            "(default: 1024)"
        ),
    )
    parser.add_argument(
        "--queued-max-fetch-bytes",
        type=_positive_int,
        default=None,
        metavar="N",
        help=(
            "bytes of fetch answers held at once, over all consumers; a fetch asks the "
            "leaders for no more than the room left (default: 268435456, 256 MiB, or a "
            "sixteenth of the cgroup memory limit when that is less)"
        ),
    )
    _add_max_concurrent_rpcs(parser)
    _add_logging(parser)
    parser.set_defaults(handler="services.gateway.node:main")


def _add_client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway",
        type=_gateway_address,
        metavar="HOST:PORT",
        default=None,
        help="gateway address (default: $TIDELOG_GATEWAY, else 127.0.0.1:9094)",
    )
    parser.add_argument(
        "--output",
        choices=("table", "json"),
        default="table",
        help="tables for people (default) or JSON for scripts",
    )


def _add_topics(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    parser = subparsers.add_parser("topics", help="create, alter, list, describe and delete topics")
    actions = parser.add_subparsers(
        dest="action", required=True, metavar="ACTION", parser_class=_Parser
    )
    create = actions.add_parser("create", help="create a topic")
    create.add_argument("name", metavar="NAME")
    create.add_argument("--partitions", type=_positive_int32, default=1, metavar="P")
    create.add_argument("--replication-factor", type=_positive_int32, default=1, metavar="R")
    create.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a topic setting, e.g. retention.ms=3600000 (repeatable)",
    )
    alter = actions.add_parser(
        "alter", help="change a topic: grow its partitions, set or remove config overrides"
    )
    alter.add_argument("name", metavar="NAME")
    alter.add_argument(
        "--partitions", type=_positive_int32, default=None, metavar="P", help="the new total"
    )
    alter.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a topic setting, e.g. retention.ms=3600000 (repeatable)",
    )
    alter.add_argument(
        "--delete-config",
        action="append",
        default=[],
        metavar="NAME",
        help="remove an override: the setting returns to its default (repeatable)",
    )
    actions.add_parser("list", help="list topic names")
    describe = actions.add_parser(
        "describe", help="leader, replicas, ISR, HW and LEO of every partition"
    )
    describe.add_argument("name", nargs="?", metavar="NAME", help="one topic (default: all)")
    delete = actions.add_parser("delete", help="delete a topic and its data")
    delete.add_argument("name", metavar="NAME")
    for sub in (create, alter, describe, delete, actions.choices["list"]):
        _add_client_options(sub)
    parser.set_defaults(handler="tidelog.commands:cmd_topics")


def _add_produce(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    parser = subparsers.add_parser(
        "produce", help="write lines from stdin as records (one record per line)"
    )
    parser.add_argument("topic", metavar="TOPIC")
    parser.add_argument("--acks", choices=("0", "1", "all"), default="all")
    parser.add_argument(
        "--key-separator",
        metavar="SEP",
        default=None,
        help="split each line at the first SEP into key and value",
    )
    parser.add_argument("--partition", type=_non_negative_int32, default=None, metavar="P")
    parser.add_argument(
        "--direct",
        action="store_true",
        help="append to the partition leaders, not through the gateway (the brokers' "
        "addresses must be reachable)",
    )
    _add_client_options(parser)
    parser.set_defaults(handler="tidelog.commands:cmd_produce")


def _add_consume(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    parser = subparsers.add_parser(
        "consume", help="print records (values, one per line) from a topic"
    )
    parser.add_argument("topic", metavar="TOPIC")
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--from-beginning",
        action="store_true",
        help="start at the oldest record (with --group, only where the group has no "
        "committed offset, as Kafka's console consumer)",
    )
    start.add_argument(
        "--offset",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help="start at offset N of the partition --partition names (required with it)",
    )
    parser.add_argument(
        "--partition",
        type=_non_negative_int32,
        default=None,
        metavar="P",
        help="read partition P only (default: every partition)",
    )
    parser.add_argument("--group", default=None, metavar="G", help="consumer group to commit to")
    parser.add_argument("--max-messages", type=_positive_int, default=None, metavar="N")
    parser.add_argument(
        "--follow",
        action="store_true",
        help="keep waiting for new records (default: stop at the end)",
    )
    parser.add_argument("--key-separator", metavar="SEP", default=None, help="print KEY SEP VALUE")
    parser.add_argument(
        "--timeout-ms",
        type=_positive_int,
        default=None,
        metavar="MS",
        help="with --follow, stop (status 0) after MS ms without a record, as Kafka's "
        "console consumer; without it, fail (status 1) when MS ms pass without a record "
        "before the end is reached (default: 30000 then, none with --follow)",
    )
    parser.add_argument(
        "--direct",
        action="store_true",
        help="fetch from the partition leaders, not through the gateway (the brokers' "
        "addresses must be reachable)",
    )
    _add_client_options(parser)
    parser.set_defaults(handler="tidelog.commands:cmd_consume", check=(parser, _check_consume))


def _check_consume(args: argparse.Namespace) -> str | None:
    if args.offset is not None and args.partition is None:
        return "argument --offset: needs --partition (an offset is a place in one partition)"
    return None


def _add_groups(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    parser = subparsers.add_parser("groups", help="consumer groups: committed offsets and lag")
    actions = parser.add_subparsers(
        dest="action", required=True, metavar="ACTION", parser_class=_Parser
    )
    listing = actions.add_parser("list", help="groups with committed offsets or members")
    describe = actions.add_parser(
        "describe", help="state, members, and committed offset and lag per partition"
    )
    describe.add_argument("group", metavar="GROUP")
    members = actions.add_parser(
        "members", help="the group's state, generation, members and their partitions"
    )
    members.add_argument("group", metavar="GROUP")
    delete = actions.add_parser(
        "delete", help="delete a group's committed offsets (it must have no members)"
    )
    delete.add_argument("group", metavar="GROUP")
    reset = actions.add_parser(
        "reset-offsets",
        help="set a group's committed offsets of a topic (dry run unless --execute; the "
        "group must have no members)",
    )
    reset.add_argument("group", metavar="GROUP")
    which = reset.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--topic",
        action="append",
        type=_topic_partitions,
        metavar="TOPIC[:P,...]",
        help="a topic whose offsets to set, or only the partitions listed after a colon, "
        "e.g. orders:0,2 (repeat for several, as Kafka's tool)",
    )
    which.add_argument(
        "--all-topics",
        action="store_true",
        help="every partition the group has a committed offset for",
    )
    reset.add_argument(
        "--partition",
        type=_non_negative_int32,
        default=None,
        metavar="N",
        help="only this partition (default: every partition of the topic)",
    )
    to = reset.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-earliest", action="store_true", help="the log start")
    to.add_argument("--to-latest", action="store_true", help="the end (the high watermark)")
    to.add_argument(
        "--to-offset",
        type=_non_negative_int,
        metavar="N",
        help="this offset (clamped to the partition's range)",
    )
    to.add_argument(
        "--to-datetime",
        metavar="ISO8601",
        help="the first record at or after this time, e.g. 2026-11-26T10:00:00Z (with no "
        "zone: local time)",
    )
    to.add_argument(
        "--to-current",
        action="store_true",
        help="the committed offset (the end for a partition without one), as Kafka's tool",
    )
    to.add_argument(
        "--by-duration",
        type=_duration_ms,
        metavar="PnDTnHnMnS",
        help="the first record at or after now minus this ISO 8601 duration, e.g. PT30M",
    )
    to.add_argument(
        "--shift-by",
        type=int,
        metavar="N",
        help="the committed offset plus N (negative: back), clamped to the range",
    )
    reset.add_argument(
        "--execute", action="store_true", help="commit the new offsets (else only show them)"
    )
    for sub in (listing, describe, members, delete, reset):
        _add_client_options(sub)
    parser.set_defaults(handler="tidelog.commands:cmd_groups")


def _add_cluster(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    parser = subparsers.add_parser(
        "cluster", help="brokers, the controller, offline and under-replicated partitions"
    )
    _add_client_options(parser)
    parser.set_defaults(handler="tidelog.commands:cmd_cluster")


def _add_dev(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    parser = subparsers.add_parser(
        "dev",
        help="run a whole local cluster: etcd, controller, storage nodes, gateway",
        description=(
            "Run a local cluster in one command. Prints a line containing 'ready' and the "
            "gateway address; Ctrl-C or SIGTERM stops everything. Running it again on the "
            "same data directory keeps all data."
        ),
    )
    parser.add_argument(
        "--data-dir",
        type=_data_dir,
        default=".tidelog",
        metavar="DIR",
        help="(default: ./.tidelog)",
    )
    parser.add_argument(
        "--brokers", type=_positive_int, default=3, metavar="N", help="(default: 3)"
    )
    parser.add_argument(
        "--gateway-port",
        type=_port,
        default=9094,
        metavar="P",
        help="(default: 9094; 0 = any free port)",
    )
    parser.set_defaults(handler="tidelog.dev:main")


def _add_bench(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark tidelog against its peers and the machine's ceilings (from a checkout)",
        description=(
            "Start a whole cluster, NATS JetStream and Redis on this machine and measure "
            "them with the same record sizes (bench/suite.py; needs the repository checkout "
            "and `make bench-deps`)."
        ),
    )
    parser.add_argument("--quick", action="store_true", help="small volumes: under 2 minutes")
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="write docs/BENCHMARKS.md (Versus peers) and docs/bench-peers.png",
    )
    parser.set_defaults(handler="bench.suite:main")


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _port(text: str) -> int:
    value = _non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"port {value} is out of range 0..65535")
    return value


_COMMANDS: tuple[Callable[[argparse._SubParsersAction[_Parser]], None], ...] = (
    _add_storage,
    _add_controller,
    _add_gateway,
    _add_dev,
    _add_topics,
    _add_produce,
    _add_consume,
    _add_groups,
    _add_cluster,
    _add_bench,
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tidelog",
        description="tidelog: a replicated, partitioned commit log.",
    )
    subparsers = parser.add_subparsers(
        title="commands", dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    for add in _COMMANDS:
        add(subparsers)
    return parser


def _load_handler(spec: str) -> Callable[[argparse.Namespace], int]:
    module_name, _, function_name = spec.partition(":")
    handler: Callable[[argparse.Namespace], int] = getattr(
        importlib.import_module(module_name), function_name
    )
    return handler


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C is, so that the command's ``with``
    blocks close: a consumer leaves its group, a producer flushes what it read. The
    default action killed the process at once: `docker stop`, systemd or `timeout` left a
    `consume --group` member registered for its whole session, and `groups reset-offsets`
    and `groups delete` were refused meanwhile (found by an audit). Kafka's console tools
    close on SIGTERM too. Services install their own handler (``serve_until_signal``)."""


def _raise_terminated(signum: int, frame: object) -> NoReturn:
    raise _Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, return its status.
    Ctrl-C exits 130 and SIGTERM 143 (128 + the signal, as a shell reports them) without
    a traceback wherever they land, the imports included."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _main(argv)
    except _Terminated:
        return 143
    except KeyboardInterrupt:
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    # Rules across arguments, refused as argparse refuses a single one (status 2).
    if (check := getattr(args, "check", None)) is not None:
        parser, rule = check
        if (problem := rule(args)) is not None:
            parser.error(problem)
    # Commands get flat, typed fields rather than tuples.
    if isinstance(getattr(args, "listen", None), tuple):
        args.listen_host, args.listen_port = args.listen
    try:
        handler = _load_handler(args.handler)
    except ImportError as exc:
        module = args.handler.partition(":")[0]
        if exc.name and module.startswith(exc.name.partition(".")[0]) and exc.name in module:
            # `bench` lives in the repository checkout, not in the installed package.
            why = "this command needs the repository checkout (run it from there)"
        else:  # a broken install: say what is missing, not "run from the checkout"
            why = f"cannot import {module}: {exc}"
        print(f"tidelog: error: {exc.name or module}: {why}", file=sys.stderr)
        return 1
    return handler(args)
