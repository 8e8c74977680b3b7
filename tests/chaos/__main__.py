"""``python -m tests.chaos``: many seeds, long schedules, figures for docs/RELIABILITY.md.

    python -m tests.chaos --seeds 1-20 --rounds 3 --negative-seeds 1-2 --write-docs

Each seed is a fresh cluster under a temporary directory (kept when a seed fails, and
named in the output, so its process logs can be read). Exit status 1 if any safe seed's
checker failed or any negative-control seed did *not* report a loss.
"""

from __future__ import annotations

import argparse
import platform
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from tests.chaos.run import RunReport, run_chaos

DOCS = Path(__file__).resolve().parents[2] / "docs" / "RELIABILITY.md"
BEGIN, END = "<!-- chaos:begin -->", "<!-- chaos:end -->"


def _seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        if "-" in part:
            first, last = part.split("-", 1)
            seeds.extend(range(int(first), int(last) + 1))
        elif part:
            seeds.append(int(part))
    return seeds


def _run(seed: int, rounds: int, negative: bool) -> tuple[RunReport | None, str]:
    base = Path(tempfile.mkdtemp(prefix=f"tidelog-chaos-{seed}-"))
    try:
        report = run_chaos(base, seed, rounds, negative_control=negative)
    except Exception as exc:  # a harness failure is reported, not hidden
        return None, f"seed {seed}: the run itself failed: {exc!r} (logs in {base})"
    failed = (report.verdict.lost == 0) if negative else not report.ok
    failed = failed or report.unhealed > 0  # worth reading why, too
    if not failed:
        shutil.rmtree(base, ignore_errors=True)
    return report, report.describe() + (f"\nlogs kept in {base}" if failed else "")


def _markdown(
    safe: list[RunReport], negative: list[RunReport], rounds: int, seconds: float, command: str
) -> str:
    faults: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    for report in safe:
        faults.update(report.faults)
        skipped.update(report.skipped)

    def total(attr: str, reports: list[RunReport]) -> int:
        return sum(getattr(r.verdict, attr) for r in reports)

    lines = [
        f"Last run: `{command}` on {platform.node() or 'this machine'} "
        f"({platform.processor() or platform.machine()}), {seconds / 60:.0f} min, "
        f"{rounds} round(s) of every fault kind per seed.",
        "",
        "| runs | seeds | acknowledged | lost | duplicated | divergent | gaps | reordered "
        "| vanished reads | failed sends (indeterminate) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, reports in (("safe (min.insync=2)", safe), ("negative control", negative)):
        if not reports:
            continue
        seeds = ", ".join(str(r.seed) for r in reports)
        lines.append(
            f"| {label} | {seeds} | {total('acked', reports):,} | {total('lost', reports):,} | "
            f"{total('duplicated', reports):,} | {total('divergent', reports):,} | "
            f"{total('gaps', reports):,} | {total('reordered', reports):,} | "
            f"{total('vanished_reads', reports):,} | {total('failed', reports):,} |"
        )
    lines += ["", "Faults injected (safe runs):", "", "| fault | injected | skipped |"]
    lines.append("|---|---:|---:|")
    for kind in sorted(set(faults) | set(skipped)):
        lines.append(f"| {kind} | {faults[kind]} | {skipped[kind]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--seeds", default="1-3", help="e.g. 1-20 or 4,7,9")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every fault per seed")
    parser.add_argument("--negative-seeds", default="1", help="negative-control seeds")
    parser.add_argument("--write-docs", action="store_true", help="update docs/RELIABILITY.md")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every cluster's processes, namespaces and bridge
    # are removed by their context managers instead of being left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    command = "python -m tests.chaos " + " ".join(argv if argv is not None else sys.argv[1:])
    started = time.monotonic()
    safe: list[RunReport] = []
    negative: list[RunReport] = []
    bad = 0
    for seed in _seeds(args.seeds):
        report, text = _run(seed, args.rounds, negative=False)
        print(text, flush=True)
        if report is None or not report.ok:
            bad += 1
        if report is not None:
            safe.append(report)
    for seed in _seeds(args.negative_seeds):
        report, text = _run(seed, 1, negative=True)
        print(text, flush=True)
        if report is None or report.verdict.lost == 0:
            bad += 1
        if report is not None:
            negative.append(report)
    table = _markdown(safe, negative, args.rounds, time.monotonic() - started, command)
    print(table)
    if args.write_docs:
        text = DOCS.read_text(encoding="utf-8")
        pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
        DOCS.write_text(pattern.sub(f"{BEGIN}\n{table}\n{END}", text), encoding="utf-8")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
