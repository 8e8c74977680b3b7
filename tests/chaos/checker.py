"""The history checker: a pure function from what the clients saw and what the cluster
holds at the end to a verdict. It must be able to fail (``test_checker.py`` feeds it
doctored histories; the negative control makes a real run fail it).

Checks (issue 9):

- every acknowledged value is in the final log exactly once, at its acknowledged offset,
  with identical bytes (``lost`` counts those that are not);
- no value appears twice in the final log (``duplicated``), acknowledged or not;
- offsets of every partition are contiguous from its first offset (``gaps``);
- within a partition, each writer's values are in the order it sent them (``reordered``);
- every value is one the workload wrote, intact (``corrupt``);
- every consumer's reads of a partition have strictly increasing offsets (``non_monotonic``)
  and each read is the record the final log has at that offset — a read can neither be
  of a record that later vanished nor disagree with the final log (``vanished_reads``);
- every consumer's reads of a partition are contiguous, from the final log's first
  offset on (``skipped``: a record it was never handed), and reach the high watermark
  (``stalled``: a consumer that stopped short of the end). The topic has no compaction,
  transactions or retention in a run, and a reader restarted after an error seeks to the
  offset after the last record it was handed (``workload.py``), so a record missing from
  a consumer's reads is a record the consumer lost;
- no thread of the workload died and every answer was recorded (``thread_errors``), and
  every writer had a value acknowledged (``idle_writers``);
- replicas hold byte-identical batches below the high watermark (``divergent``): all of
  them when every replica is in sync at the end; one that lags (outside the ISR) must
  hold a prefix of the longest's.

An acknowledgement from a fenced leader shows up as a loss: the fenced leader's copy is
truncated away when it rejoins, so the value is not in the final log at its offset.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tests.chaos.workload import History, parse_value

ReplicaBatches = list[tuple[int, int, bytes]]
"""One replica's batches of one partition: (base offset, last offset, batch bytes)."""


@dataclass
class Verdict:
    acked: int = 0
    sent: int = 0
    failed: int = 0
    final_records: int = 0
    reads: int = 0
    lost: int = 0
    duplicated: int = 0
    gaps: int = 0
    reordered: int = 0
    corrupt: int = 0
    non_monotonic: int = 0
    vanished_reads: int = 0
    divergent: int = 0
    # Consumers' reads that jumped past a record, (consumer, partition)s whose reads end
    # short of the HW, workload threads that died, writers never acknowledged: each
    # passed before (found by an audit).
    skipped: int = 0
    stalled: int = 0
    thread_errors: int = 0
    idle_writers: int = 0
    consumer_errors: int = 0  # polls that failed (under faults, expected): for the record
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.duplicated
            or self.gaps
            or self.reordered
            or self.corrupt
            or self.non_monotonic
            or self.vanished_reads
            or self.divergent
            or self.skipped
            or self.stalled
            or self.thread_errors
            or self.idle_writers
        )

    def note(self, text: str) -> None:
        if len(self.examples) < 20:
            self.examples.append(text)

    def summary(self) -> str:
        return (
            f"acked {self.acked} of {self.sent} sent ({self.failed} failed), final log "
            f"{self.final_records} records, {self.reads} consumer reads; lost {self.lost}, "
            f"duplicated {self.duplicated}, gaps {self.gaps}, reordered {self.reordered}, "
            f"corrupt {self.corrupt}, non-monotonic reads {self.non_monotonic}, vanished "
            f"reads {self.vanished_reads}, divergent replicas {self.divergent}, skipped reads "
            f"{self.skipped}, stalled consumers {self.stalled}, workload errors "
            f"{self.thread_errors}, writers never acknowledged {self.idle_writers} "
            f"({self.consumer_errors} failed polls)"
            + ("" if self.ok else "; e.g. " + "; ".join(self.examples[:8]))
        )


def check(
    history: History,
    final_log: dict[int, list[tuple[int, bytes]]],
    replicas: dict[int, dict[int, ReplicaBatches]] | None = None,
    high_watermarks: dict[int, int] | None = None,
    *,
    in_sync: bool = False,
) -> Verdict:
    """``final_log``: partition -> [(offset, value)] read from the beginning to the HW.
    ``replicas``: partition -> broker id -> batches on its disk; ``high_watermarks``:
    partition -> HW, below which the replicas must agree. ``in_sync``: every replica is
    in its ISR at the end (the run healed), so each holds all that is below the HW; else
    a lagging one may hold a prefix."""
    verdict = Verdict(
        acked=len(history.acked),
        sent=history.sent,
        failed=len(history.failed),
        final_records=sum(len(records) for records in final_log.values()),
        reads=sum(len(reads) for reads in history.reads.values()),
        thread_errors=len(history.thread_errors),
        consumer_errors=history.consumer_errors,
    )
    for error in history.thread_errors:
        verdict.note(f"workload: {error}")
    at: dict[tuple[int, int], bytes] = {}
    counts: Counter[bytes] = Counter()
    for partition, records in final_log.items():
        previous: int | None = None
        last_seq: dict[int, int] = {}
        for offset, value in records:
            at[(partition, offset)] = value
            counts[value] += 1
            if previous is not None and offset != previous + 1:
                verdict.gaps += 1
                verdict.note(f"gap in partition {partition}: {previous} then {offset}")
            previous = offset
            parsed = parse_value(value)
            if parsed is None:
                verdict.corrupt += 1
                verdict.note(f"corrupt value at {partition}@{offset}: {value[:40]!r}")
                continue
            writer, seq = parsed
            if seq <= last_seq.get(writer, -1):
                verdict.reordered += 1
                verdict.note(
                    f"writer {writer} seq {seq} after {last_seq[writer]} in {partition}@{offset}"
                )
            last_seq[writer] = max(seq, last_seq.get(writer, -1))
    for value, count in counts.items():
        if count > 1:
            verdict.duplicated += count - 1
            verdict.note(f"{value[:24]!r} {count} times")
    for value, (partition, offset) in history.acked.items():
        if at.get((partition, offset)) != value:
            verdict.lost += 1
            found = "absent" if counts[value] == 0 else "elsewhere"
            verdict.note(f"acked {value[:24]!r} at {partition}@{offset} is {found}")
    acked_writers = {parsed[0] for value in history.acked if (parsed := parse_value(value))}
    for writer in range(history.writers):
        if writer not in acked_writers:
            verdict.idle_writers += 1
            verdict.note(f"writer {writer} had no value acknowledged")
    # Where each partition's reads must start (the final log's first offset) and reach
    # (the HW the consumers were waited for; without one, the final log's end).
    starts: dict[int, int] = {}
    ends: dict[int, int] = {}
    for partition in sorted(set(final_log) | set(high_watermarks or {})):
        records = final_log.get(partition, [])
        end = records[-1][0] + 1 if records else 0
        if high_watermarks is not None and partition in high_watermarks:
            end = high_watermarks[partition]
        starts[partition] = records[0][0] if records else end
        ends[partition] = end
    for name, reads in history.reads.items():
        last_offset: dict[int, int] = {}
        for partition, offset, value in reads:
            expected = last_offset.get(partition, starts.get(partition, 0) - 1) + 1
            if offset < expected and partition in last_offset:
                verdict.non_monotonic += 1
                verdict.note(
                    f"consumer {name} read {partition}@{offset} after {last_offset[partition]}"
                )
            elif offset > expected:
                verdict.skipped += offset - expected
                verdict.note(
                    f"consumer {name} read {partition}@{offset} next, not {partition}@{expected}"
                )
            last_offset[partition] = offset
            if at.get((partition, offset)) != value:
                verdict.vanished_reads += 1
                verdict.note(
                    f"consumer {name} read {value[:24]!r} at {partition}@{offset}; "
                    "the final log differs"
                )
        for partition, end in ends.items():
            reached = last_offset.get(partition, starts[partition] - 1) + 1
            if reached < end:
                verdict.stalled += 1
                verdict.note(f"consumer {name} read {partition} up to {reached}, not {end}")
    for partition, by_broker in (replicas or {}).items():
        hw = (high_watermarks or {}).get(partition, 0)
        below = {b: [x for x in batches if x[1] < hw] for b, batches in by_broker.items()}
        # The longest is the reference: every other must be a prefix of it (then every
        # two are consistent); in sync, each must be all of it. Comparing each with the
        # lowest broker id's only, up to the shorter length, passed two replicas that
        # differed past a short third, and any replica holding a part of what is below
        # the HW at the end of a healed run (found by an audit).
        reference_broker = max(sorted(below), key=lambda b: len(below[b]), default=-1)
        reference = below.get(reference_broker, [])
        for broker_id, batches in sorted(below.items()):
            if broker_id == reference_broker:
                continue
            if batches != reference[: len(batches)]:
                verdict.divergent += 1
                verdict.note(
                    f"partition {partition}: broker {broker_id} differs from broker "
                    f"{reference_broker} below HW {hw}"
                )
            elif in_sync and len(batches) < len(reference):
                verdict.divergent += 1
                verdict.note(
                    f"partition {partition}: broker {broker_id} in sync holds "
                    f"{len(batches)} of the {len(reference)} batches below HW {hw}"
                )
    return verdict
