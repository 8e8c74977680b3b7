"""One tick of the end-to-end latency case, hop by hop (BENCHMARKS.md, ninth pass, item 41).

Runs ``bench.workloads.end_to_end_latency_batched`` (direct mode, or through the gateway
with ``--gateway``; acks=all, a new 6-partition RF=3 topic, a ``send_batch`` every 5 ms at
``--rate``) on the ``tests/support`` cluster with ``tidelog.tracing`` on in every process,
then follows each tick by its partition and base offset through the trace lines: client,
(gateway,) leader append, the slower follower's fetch answer, append and next fetch, the
HW, the acknowledgement, the consumer. Prints p50 / p90 / p99 of each hop in milliseconds,
and how many ticks found their partition's previous request still unanswered (head-of-line
blocking) and what that cost them.

Command: ``PYTHONPATH=. .venv/bin/python -m bench.trace_tick --rate 430000 [--gateway]``
"""

from __future__ import annotations

import argparse
import bisect
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tidelog.tracing import TRACE_DIR_ENV

MS_PER_NS = 1e-6
FOLLOWERS = 2
"""The traced topic's replication factor is 3."""
CLOCK_SLACK_MS = 1.0
"""A follower's fetch answer may be logged a moment before the leader's append handler
logs its return (the append wakes the waiting fetch first): answers this much earlier
still count."""


def _first_after(times: Sequence[float], since: float) -> float | None:
    """The first of ``times`` (sorted) at or after ``since``."""
    i = bisect.bisect_left(times, since)
    return times[i] if i < len(times) else None


@dataclass
class Trace:
    """Every event of one run, by name: (time ms, pid, fields), in time order."""

    events: dict[str, list[tuple[float, str, list[str]]]] = field(
        default_factory=lambda: defaultdict(list)
    )

    @classmethod
    def read(cls, directory: Path) -> Trace:
        trace = cls()
        for path in directory.glob("*.log"):
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) >= 3:
                    trace.events[parts[2]].append((int(parts[0]) * MS_PER_NS, path.stem, parts[3:]))
        for timeline in trace.events.values():
            timeline.sort()
        return trace

    def offsets(self, name: str) -> dict[tuple[int, int, int], list[float]]:
        """``f_in``/``f_out``: (replica, partition, fetch offset) -> times, in order (a
        long poll that answered empty is followed by another from the same offset)."""
        times: dict[tuple[int, int, int], list[float]] = defaultdict(list)
        for t, _, fields in self.events[name]:
            for item in fields[1].split(","):
                if item:
                    partition, offset = map(int, item.split(":"))
                    times[(int(fields[0]), partition, offset)].append(t)
        return times

    def per_follower(self, name: str) -> dict[tuple[int, int], list[float]]:
        """``fr_recv``/``fr_app``: (partition, offset) -> each follower's first time."""
        first: dict[tuple[str, int, int], float] = {}
        for t, pid, fields in self.events[name]:
            items = fields[0].split(",") if name == "fr_recv" else [":".join(fields)]
            for item in items:
                partition, offset, *size = map(int, item.split(":"))
                if not size or size[0] > 0:
                    first.setdefault((pid, partition, offset), t)
        by_offset: dict[tuple[int, int], list[float]] = defaultdict(list)
        for (_, partition, offset), t in first.items():
            by_offset[(partition, offset)].append(t)
        return by_offset


HOPS = (
    "send_batch call -> the Append leaves the client",
    "-> the leader's handler starts",
    "leader append",
    "-> the waiting follower fetch answers",
    "-> the follower has the answer",
    "follower append",
    "-> its next fetch reaches the leader",
    "-> HW moves",
    "-> the Append answers",
    "-> the client has the acknowledgement",
    "call -> acknowledgement",
    "HW moves -> the consumer's long poll answers",
    "-> the consumer has it",
    "call -> consumed (e2e)",
)


GATEWAY_HOPS = (
    "send_batch call -> the request leaves the client",
    "-> the gateway reads it",
    "-> the gateway's Append starts",
    "-> the leader's handler starts",
    *HOPS[2:9],
    "-> the gateway has the answer",
    "-> the gateway queues its answer",
    "-> the client has the acknowledgement",
    *HOPS[10:],
)
"""Through the gateway (``--gateway``): its own steps around the leader's."""


def ticks(trace: Trace) -> tuple[list[dict[str, float]], list[tuple[bool, float]]]:
    """Each traced tick's hop durations (ms, keyed by ``HOPS``, or ``GATEWAY_HOPS`` when
    the trace went through a gateway), and for every request sent (whether its
    partition's previous request was unanswered at the call, the wait from the call
    until it left the client)."""
    ev = trace.events
    through_gateway = bool(ev["g_in"])
    gateway_in = {int(f[0]): t for t, _, f in ev["g_in"]}
    gateway_out = {int(f[0]): t for t, _, f in ev["g_out"]}
    gateway_call: dict[int, list[float]] = defaultdict(list)
    for t, _, f in ev["g_ap_in"]:
        gateway_call[int(f[0])].append(t)
    gateway_answered = {(int(f[0]), int(f[1])): t for t, _, f in ev["g_ap_out"]}
    calls = [t for t, _, _ in ev["c_call"]]
    sends = {int(f[0]): (t, int(f[1])) for t, _, f in ev["c_send"]}
    acks = {int(f[0]): (t, int(f[1]), int(f[2])) for t, _, f in ev["c_ack"]}
    appended = {(int(f[0]), int(f[1])): t for t, _, f in ev["ap_done"]}
    answered = {(int(f[0]), int(f[1])): t for t, _, f in ev["ap_out"]}
    started: dict[int, list[float]] = defaultdict(list)
    for t, _, f in ev["ap_in"]:
        started[int(f[0])].append(t)
    hw: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for t, _, f in ev["hw"]:
        hw[int(f[0])].append((t, int(f[1])))
    fetch_out, fetch_in = trace.offsets("f_out"), trace.offsets("f_in")
    received, follower_appended = trace.per_follower("fr_recv"), trace.per_follower("fr_app")
    consumed: dict[tuple[int, int], float] = {}
    for t, _, f in ev["k_recv"]:
        for item in f[0].split(","):
            partition, offset = map(int, item.split(":"))
            consumed.setdefault((partition, offset), t)
    rows: list[dict[str, float]] = []
    waits: list[tuple[bool, float]] = []
    previous: dict[int, int] = {}
    for cid, (t_send, p) in sorted(sends.items(), key=lambda item: item[1][0]):
        t_call = calls[bisect.bisect_right(calls, t_send) - 1]
        before = previous.get(p)
        blocked = before is not None and before in acks and acks[before][0] > t_call
        waits.append((blocked, t_send - t_call))
        previous[p] = cid
        if cid not in acks or acks[cid][1] < 0:
            continue
        t_ack, base, last = acks[cid]
        t_appended = appended.get((p, base))
        t_answered = answered.get((p, base))
        if t_appended is None or t_answered is None:
            continue
        starts = started[p]
        t_start = starts[bisect.bisect_right(starts, t_appended) - 1]
        gateway_times: tuple[float, ...] = ()
        if through_gateway:
            t_gin, t_gout = gateway_in.get(cid), gateway_out.get(cid)
            t_gcall = _first_after(gateway_call[p], t_gin) if t_gin is not None else None
            t_ganswered = gateway_answered.get((p, base))
            if t_gin is None or t_gout is None or t_gcall is None or t_ganswered is None:
                continue
            gateway_times = (t_gin, t_gcall, t_ganswered, t_gout)
        since = t_appended - CLOCK_SLACK_MS
        followers = [r for r in range(FOLLOWERS + 1) if (r, p, base) in fetch_out]
        outs = [_first_after(fetch_out[(r, p, base)], since) for r in followers]
        ins = [_first_after(fetch_in.get((r, p, last + 1), []), since) for r in followers]
        recv, app = received.get((p, base), []), follower_appended.get((p, base), [])
        t_hw = next((t for t, v in hw[p] if v > last and t >= since), None)
        t_out_consumer = _first_after(fetch_out.get((-1, p, base), []), since)
        t_consumed = consumed.get((p, base))
        if len(followers) != FOLLOWERS or None in outs or None in ins or t_hw is None:
            continue
        if len(recv) < FOLLOWERS or len(app) < FOLLOWERS:
            continue
        if t_out_consumer is None or t_consumed is None:
            continue
        t_fout = max(t for t in outs if t is not None)
        t_fin = max(t for t in ins if t is not None)
        if gateway_times:
            t_gin, t_gcall, t_ganswered, t_gout = gateway_times
            before_leader: tuple[float, ...] = (
                t_send - t_call,
                t_gin - t_send,
                t_gcall - t_gin,
                t_start - t_gcall,
            )
            after_answer: tuple[float, ...] = (
                t_ganswered - t_answered,
                t_gout - t_ganswered,
                t_ack - t_gout,
            )
        else:
            before_leader = (t_send - t_call, t_start - t_send)
            after_answer = (t_ack - t_answered,)
        durations = (
            *before_leader,
            t_appended - t_start,
            t_fout - t_appended,
            max(recv) - t_fout,
            max(app) - max(recv),
            t_fin - max(app),
            t_hw - t_fin,
            t_answered - t_hw,
            *after_answer,
            t_ack - t_call,
            t_out_consumer - t_hw,
            t_consumed - t_out_consumer,
            t_consumed - t_call,
        )
        rows.append(dict(zip(GATEWAY_HOPS if gateway_times else HOPS, durations, strict=True)))
    return rows, waits


def _quantiles(values: Sequence[float]) -> str:
    p50, p90, p99 = np.quantile(values, (0.5, 0.9, 0.99))
    return f"{p50:.2f} / {p90:.2f} / {p99:.2f}"


def report(trace: Trace) -> str:
    rows, waits = ticks(trace)
    if not rows:
        return "no tick could be followed through the trace"
    lines = [f"{len(rows):,} ticks followed", "", "| hop | ms p50 / p90 / p99 |", "|---|---:|"]
    hops = GATEWAY_HOPS if GATEWAY_HOPS[1] in rows[0] else HOPS
    lines += [f"| {hop} | {_quantiles([r[hop] for r in rows])} |" for hop in hops]
    blocked = [w for b, w in waits if b]
    free = [w for b, w in waits if not b]
    lines.append("")
    # With one request per partition in flight the first group waited for the previous
    # acknowledgement; with several (direct mode since BENCHMARKS item 46) it need not.
    labels = ("sent while its partition's previous request was unanswered", "the others")
    for label, values in zip(labels, (blocked, free), strict=True):
        if values:
            lines.append(
                f"{label}: {len(values):,} of {len(waits):,} Appends, "
                f"call -> sent ms p50 / p90 / p99 {_quantiles(values)}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=430_000, help="records/s")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured time")
    parser.add_argument("--gateway", action="store_true", help="through the gateway")
    args = parser.parse_args(argv)
    if not os.environ.get(TRACE_DIR_ENV):
        # Tracing is decided at import time, in this process and in every one it starts:
        # run again with the directory in the environment.
        os.environ[TRACE_DIR_ENV] = tempfile.mkdtemp(prefix="tidelog-trace-")
        os.execv(sys.executable, [sys.executable, "-m", "bench.trace_tick", *sys.argv[1:]])
    # Imported only now, after tracing is on.
    from bench import workloads
    from tests.support.cluster import running_cluster
    from tidelog import tracing

    directory = Path(os.environ[TRACE_DIR_ENV])
    with running_cluster(directory / "cluster") as cluster:
        gateway = cluster.start_gateway().address
        workloads.create_topic(gateway, "trace", 6, 3)
        workloads.settle(gateway)
        result = workloads.end_to_end_latency_batched(
            gateway,
            "trace",
            rate_per_s=args.rate,
            seconds=args.seconds,
            size=100,
            direct=not args.gateway,
        )
        time.sleep(3 * tracing.FLUSH_INTERVAL_S)  # written before the cluster's kill -9
    tracing.flush()
    shutil.rmtree(directory / "cluster", ignore_errors=True)  # gigabytes of logs; traces stay
    quantiles = [result.percentile_ms(q) or 0.0 for q in (0.5, 0.99)]
    print(
        f"{result.records_s:,.0f} records/s, e2e p50 / p99 {quantiles[0]:.1f} / "
        f"{quantiles[1]:.1f} ms (traced); trace in {directory}"
    )
    print(report(Trace.read(directory)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
