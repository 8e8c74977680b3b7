"""A model-based fuzz of the partition log (``services/storage/log``): a leader log and a
follower replicating it, driven through random appends with out-of-order timestamps,
leader epochs, idempotent producers and their retries, truncation, retention, rolls,
settings changed live, clean reopens and crash reopens (indexes left untrimmed, as after
kill -9), torn tails. After every step each batch reads back at its offsets, lookups by
time match a brute-force answer, and the epoch cache and producer state match a replay
(written by an audit; ``TIDELOG_LOG_FUZZ_SEEDS``/``_STEPS`` run more)."""

from __future__ import annotations

import itertools
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.storage.log import Log, LogConfig
from tidelog.batch import parse_header
from tidelog.clock import ManualClock
from tidelog.errors import OutOfOrderSequenceError
from tidelog.records import encode_batch

T0 = 1_700_000_000_000


@dataclass
class B:
    base: int
    last: int
    epoch: int
    stamps: list[int]
    pid: int
    pepoch: int
    seq: int
    retired: bool = False


def _resume(model: list[B], start: int) -> tuple[int, dict[int, tuple[int, int]]]:
    """After the model lost its tail: the log end, and each producer's (epoch, next
    sequence) to continue from (retry-safe)."""
    end = model[-1].last + 1 if model and not model[-1].retired else start
    seqs = {b.pid: (b.pepoch, b.seq + b.last - b.base + 1) for b in model if b.pid >= 0}
    return end, seqs


def crash(log: Log) -> None:
    """Drop the Log without trimming anything: close only the descriptors (kill -9)."""
    for seg in log._segments:
        for idx in (seg.offset_index, seg.time_index):
            if idx._mm is not None:
                idx._mm.close()
                idx._mm = None
            if idx._fd >= 0:
                os.close(idx._fd)
                idx._fd = -1
            idx._closed = True
        if seg._fd >= 0:
            os.close(seg._fd)
            seg._fd = -1


def check(log: Log, model: list[B], start: int, end: int) -> None:
    assert log.log_start_offset == start
    assert log.log_end_offset == end
    live = [b for b in model if not b.retired]
    assert (live[0].base if live else end) == start or not live
    # every offset
    for b in live:
        for off in {b.base, b.last, (b.base + b.last) // 2}:
            data = log.read(off, 1)
            h = parse_header(data)
            assert (h.base_offset, h.last_offset, h.partition_leader_epoch) == (
                b.base,
                b.last,
                b.epoch,
            ), off
    # timestamps
    probes = set()
    for b in live:
        for t in b.stamps:
            probes |= {t - 1, t, t + 1}
    for t in sorted(probes):
        want = None
        for b in live:
            for i, ts in enumerate(b.stamps):
                if ts >= t:
                    want = (b.base + i, ts)
                    break
            if want:
                break
        assert log.offset_for_timestamp(t) == want, (t, want)
    if live:
        big = max(max(b.stamps) for b in live)
        first = next(b.base + b.stamps.index(big) for b in live if big in b.stamps)
        assert log.max_timestamp() == (big, first)
    # epochs
    entries = []
    for b in live:
        if not entries or entries[-1][0] != b.epoch:
            entries.append((b.epoch, b.base))
    got_e = [tuple(e) for e in log.leader_epoch_cache.entries]
    if not live and len(got_e) == 1 and got_e[0][1] == start:
        got_e = []  # retention emptied the log: the last epoch kept at the log start
    assert got_e == entries
    # producers
    want_p: dict[int, tuple[int, list[tuple[int, int, int, int]]]] = {}
    for b in model:
        if b.pid < 0:
            continue
        n = b.last - b.base + 1
        meta = (b.seq, b.seq + n - 1, b.base, b.last)
        if b.pid not in want_p or want_p[b.pid][0] != b.pepoch:
            want_p[b.pid] = (b.pepoch, [])
        want_p[b.pid][1].append(meta)
        del want_p[b.pid][1][:-5]
    got = {
        pid: (e.producer_epoch, [tuple(m) for m in e.batches])
        for pid, e in log.producer_state.producers.items()
    }
    assert got == want_p


@pytest.mark.parametrize("seed", range(int(os.environ.get("TIDELOG_LOG_FUZZ_SEEDS", "30"))))
def test_engine_fuzz(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    clock = ManualClock()
    cfg = LogConfig(
        segment_bytes=rng.choice([400, 900, 3000]),
        index_interval_bytes=rng.choice([0, 100, 500]),
        segment_index_bytes=rng.choice([48, 96, 4096]),
        retention_ms=-1,
        file_delete_delay_ms=0,
        message_timestamp_before_max_ms=1 << 62,
        segment_ms=rng.choice([7 * 86400_000, 20_000, 60_000]),
        segment_jitter_ms=rng.choice([0, 5000]),
        message_timestamp_type=rng.choice(["CreateTime", "CreateTime", "LogAppendTime"]),
    )
    d = tmp_path / "p-0"
    log = Log.open(d, cfg, clock=clock)
    fcfg = _replace(
        cfg,
        segment_bytes=rng.choice([300, 700, 5000]),
        index_interval_bytes=rng.choice([0, 200]),
        segment_index_bytes=rng.choice([48, 4096]),
    )
    fd_ = tmp_path / "f-0"
    flog = Log.open(fd_, fcfg, clock=clock)
    model: list[B] = []
    start = end = 0
    epoch = 0
    seqs: dict[int, tuple[int, int]] = {}
    trace = []
    for step in range(int(os.environ.get("TIDELOG_LOG_FUZZ_STEPS", "60"))):
        op = rng.choices(
            [
                "append",
                "truncate",
                "retain",
                "reopen",
                "crash",
                "full",
                "epoch",
                "tear",
                "garbage",
                "flush",
                "tret",
                "reconf",
                "retry",
            ],
            [12, 2, 1, 1, 2, 0.3, 1, 1, 1, 1, 1, 1, 3],
        )[0]
        trace.append(op)
        if op == "append":
            raw = []
            for _ in range(rng.randint(1, 3)):
                n = rng.randint(1, 4)
                stamps = [T0 + rng.randint(-50, 50) * 1000 for _ in range(n)]
                pid = rng.choice([-1, 1, 2])
                if pid >= 0:
                    pe, s = seqs.get(pid, (0, 0))
                    raw.append(
                        (
                            encode_batch(
                                [b"x" * rng.randint(0, 60)] * n,
                                timestamps_ms=stamps,
                                producer_id=pid,
                                producer_epoch=pe,
                                base_sequence=s,
                            ),
                            stamps,
                            pid,
                            pe,
                            s,
                        )
                    )
                    seqs[pid] = (pe, s + n)
                else:
                    raw.append(
                        (
                            encode_batch([b"y" * rng.randint(0, 60)] * n, timestamps_ms=stamps),
                            stamps,
                            -1,
                            -1,
                            -1,
                        )
                    )
            info = log.append(b"".join(r[0] for r in raw), epoch)
            if log.config.message_timestamp_type == "LogAppendTime":
                raw = [(r[0], [clock.now_ms()] * len(r[1]), *r[2:]) for r in raw]
            clock.advance(rng.choice([0, 0, 10, 1000, 7000]))
            off = info.first_offset
            assert off == end
            for _, stamps, pid, pe, s in raw:
                n = len(stamps)
                model.append(B(off, off + n - 1, epoch, stamps, pid, pe, s))
                off += n
            end = off
        elif op == "truncate" and end > start:
            target = rng.randint(start, end)
            log.truncate_to(target)
            keep = []
            for b in model:
                if b.last < target or b.retired:
                    keep.append(b)
            model = keep
            end, seqs = _resume(model, start)
        elif op == "retain":
            keep_bytes = rng.randint(0, 2000)
            log.update_config(_replace(cfg, retention_bytes=keep_bytes))
            log.delete_retention_segments(high_watermark=end)
            log.update_config(cfg)
            start = log.log_start_offset
            for b in model:
                if b.last < start:
                    b.retired = True
        elif op in ("reopen", "crash"):
            rp = log.recovery_point
            if op == "reopen":
                log.close()
            else:
                crash(log)
            log = Log.open(d, cfg, clock=clock, recovery_point=rp)
            assert log.truncated_on_recovery_bytes == 0, trace
        elif op == "full":
            target = end + rng.randint(0, 5)
            log.truncate_fully_and_start_at(target)
            model = []
            start = end = target
            seqs = {}
        elif op == "tret":
            clock.advance(rng.randint(0, 3) * 1000)
            ret = rng.randint(0, 120) * 1000
            bounds = [*log.segment_base_offsets, end]
            log.update_config(_replace(cfg, retention_ms=ret))
            log.delete_retention_segments(high_watermark=end)
            log.update_config(cfg)
            new_start = log.log_start_offset
            now = clock.now_ms()

            def seg_max(lo: int, hi: int, model: list[B] = model) -> int:
                return max(
                    (max(b.stamps) for b in model if not b.retired and lo <= b.base < hi),
                    default=-1,
                )

            for lo, hi in itertools.pairwise(bounds):
                if hi <= new_start and hi > lo:
                    assert now - seg_max(lo, hi) > ret, ("retired too early", lo, hi)
                elif lo >= new_start or (lo < new_start < hi):
                    if hi > lo and lo == new_start:
                        assert now - seg_max(lo, hi) <= ret, ("kept an expired segment", lo, hi)
                    break
            start = new_start
            for b in model:
                if b.last < start:
                    b.retired = True
        elif op == "reconf":
            cfg = _replace(
                cfg,
                segment_bytes=rng.choice([400, 900, 3000]),
                index_interval_bytes=rng.choice([0, 100, 500]),
                segment_index_bytes=rng.choice([48, 96, 4096]),
                message_timestamp_type=rng.choice(["CreateTime", "LogAppendTime"]),
            )
            if rng.random() < 0.5:
                log.update_config(cfg)
            else:
                rp = log.recovery_point
                if rng.random() < 0.5:
                    log.close()
                else:
                    crash(log)
                log = Log.open(d, cfg, clock=clock, recovery_point=rp)
                assert log.truncated_on_recovery_bytes == 0, trace
        elif op == "retry":
            pid = rng.choice([1, 2])
            mine = [b for b in model if b.pid == pid]
            if mine:
                k = rng.randint(0, min(8, len(mine) - 1))
                b = mine[-1 - k]
                n = b.last - b.base + 1
                raw = encode_batch(
                    [b"z"] * n,
                    timestamps_ms=[T0] * n,
                    producer_id=pid,
                    producer_epoch=b.pepoch,
                    base_sequence=b.seq,
                )
                before = log.log_end_offset
                try:
                    info = log.append(raw, epoch)
                except OutOfOrderSequenceError:
                    assert k >= 5, (k, trace)
                else:
                    assert info.duplicate, (k, info, trace)
                    if k < 5:
                        assert (info.first_offset, info.last_offset) == (b.base, b.last), (k, trace)
                    else:
                        assert info.first_offset == -1 and info.last_offset >= b.last, (k, info)
                assert log.log_end_offset == before
        elif op == "flush":
            if rng.random() < 0.5:
                log.flush()
            else:
                log.flush_if_due()
        elif op in ("tear", "garbage"):
            rp = log.recovery_point
            active = log._segments.last
            path = active.log_path
            crash(log)
            size = path.stat().st_size
            dropped = False
            if op == "garbage":
                with open(path, "ab") as out:
                    out.write(bytes(rng.randrange(256) for _ in range(rng.randint(1, 90))))
            elif size and model and not model[-1].retired and model[-1].base >= active.base_offset:
                os.truncate(path, size - rng.randint(1, 20))  # into the last batch
                dropped = True
            log = Log.open(d, cfg, clock=clock, recovery_point=rp)
            if dropped:
                model.pop()
                end, seqs = _resume(model, start)
        elif op == "epoch":
            epoch += 1
        check(log, model, start, end)
        fds = 0
        for fdn in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fdn}")
            except OSError:
                continue
            if target.startswith(str(d) + "/"):
                fds += 1
        with open("/proc/self/maps") as mapped:
            maps = sum(1 for line in mapped if str(d) + "/" in line)
        assert fds <= 3 * log.segment_count, (fds, log.segment_count, trace)
        assert maps <= 2 * log.segment_count, (maps, log.segment_count, trace)
        if rng.random() < 0.3:
            copy = tmp_path / f"copy-{step}"
            shutil.copytree(d, copy)
            other = Log.open(
                copy, cfg, clock=clock, recovery_point=rng.choice([0, log.recovery_point])
            )
            assert other.truncated_on_recovery_bytes == 0, trace
            check(other, model, start, end)
            assert other.leader_epoch_cache.entries == log.leader_epoch_cache.entries or not [
                b for b in model if not b.retired
            ], trace
            other.close()
            shutil.rmtree(copy)
        # --- the follower mirrors the leader
        if rng.random() < 0.1:
            rp = flog.recovery_point
            crash(flog)
            flog = Log.open(fd_, fcfg, clock=clock, recovery_point=rp)
        if flog.log_end_offset > log.log_end_offset or op in ("truncate", "tear"):
            flog.truncate_to(
                max(min(flog.log_end_offset, log.log_end_offset), flog.log_start_offset)
            )
        if op == "full" or flog.log_end_offset < log.log_start_offset:
            flog.truncate_fully_and_start_at(log.log_start_offset)
        while flog.log_end_offset < log.log_end_offset:
            data = log.read(flog.log_end_offset, rng.choice([1, 500, 1 << 20]))
            flog.append(data, assign_offsets=False)
        fstart = flog.log_start_offset
        fentries = []
        for b in model:
            if b.base >= fstart and (not fentries or fentries[-1][0] != b.epoch):
                fentries.append((b.epoch, b.base))
        got_f = [tuple(e) for e in flog.leader_epoch_cache.entries]
        if not fentries and len(got_f) == 1 and got_f[0][1] == fstart:
            got_f = []
        assert got_f == fentries, trace
        fp = {
            pid: (e.producer_epoch, e.start_sequence, [tuple(m) for m in e.batches])
            for pid, e in flog.producer_state.producers.items()
        }
        lp = {
            pid: (e.producer_epoch, e.start_sequence, [tuple(m) for m in e.batches])
            for pid, e in log.producer_state.producers.items()
        }
        assert fp == lp, trace
    log.close()
    flog.close()


def _replace(cfg: LogConfig, **kw: object) -> LogConfig:
    import dataclasses

    return dataclasses.replace(cfg, **kw)  # type: ignore[arg-type]
