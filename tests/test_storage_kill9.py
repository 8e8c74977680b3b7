"""A real process appending to a Log is killed with SIGKILL at random moments (written by
an audit); every append it saw return must read back, byte for byte, after the log is
reopened with the recovery point it last checkpointed (and again in the next round,
which continues the same directory)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.storage.log import Log, LogConfig
from services.storage.log.checkpoint import OffsetCheckpointFile
from tidelog.batch import parse_header
from tidelog.records import decode_batches

CHILD = r"""
import os, random, sys
from pathlib import Path
from services.storage.log import Log, LogConfig
from services.storage.log.checkpoint import OffsetCheckpointFile
from tidelog.records import encode_batch
d = Path(sys.argv[1]); seed = int(sys.argv[2])
rng = random.Random(seed)
cfg = LogConfig(segment_bytes=rng.choice([2000, 6000]), index_interval_bytes=rng.choice([0, 300]),
                segment_index_bytes=rng.choice([48, 4096]), retention_ms=-1,
                message_timestamp_before_max_ms=1 << 62)
ck = OffsetCheckpointFile(d.parent / "rp")
rp = ck.read().get(("p", 0), 0)
log = Log.open(d, cfg, recovery_point=rp)
out = os.fdopen(1, "w", buffering=1)
out.write(f"open {log.log_start_offset} {log.log_end_offset} {log.truncated_on_recovery_bytes}\n")
epoch = log.latest_epoch if log.latest_epoch >= 0 else 0
pid_seq = {}
for pid, e in log.producer_state.producers.items():
    pid_seq[pid] = e.batches[-1].last_sequence + 1
i = 0
while True:
    i += 1
    n = rng.randint(1, 5)
    pid = rng.choice([-1, 7, 9])
    now = 1_700_000_000_000 + rng.randint(-100, 100) * 1000
    values = [bytes([rng.randrange(256)]) * rng.randint(0, 300) for _ in range(n)]
    if pid >= 0:
        seq = pid_seq.get(pid, 0)
        raw = encode_batch(
            values, timestamps_ms=[now] * n, producer_id=pid, producer_epoch=0, base_sequence=seq
        )
        pid_seq[pid] = seq + n
    else:
        raw = encode_batch(values, timestamps_ms=[now] * n)
    if rng.random() < 0.05:
        epoch += 1
    info = log.append(raw, epoch)
    out.write(f"ack {info.first_offset} {info.last_offset} {raw.hex()}\n")
    if rng.random() < 0.1:
        log.flush()
        ck.write({("p", 0): log.recovery_point})
    if rng.random() < 0.1:
        log.flush_if_due()
        ck.write({("p", 0): log.recovery_point})
"""


@pytest.mark.parametrize("seed", range(3))
def test_kill9_keeps_every_returned_append(tmp_path: Path, seed: int) -> None:
    d = tmp_path / "p-0"
    rng = random.Random(seed)
    acked: dict[int, bytes] = {}  # base offset -> producer bytes (unstamped)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    for rnd in range(6):
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(d), str(seed * 100 + rnd)],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        try:
            time.sleep(rng.uniform(0.3, 1.2))
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
        lines = out.splitlines()
        assert lines and lines[0].startswith("open"), out[:500]
        _, _start, end, _truncated = lines[0].split()
        # what the child saw when it opened: every earlier ack survived
        if acked:
            assert int(end) >= max(acked) + 1 or int(end) > max(acked), (rnd, end, max(acked))
        for line in lines[1:]:
            parts = line.split()
            if len(parts) != 4 or parts[0] != "ack":
                continue  # torn last line
            acked[int(parts[1])] = bytes.fromhex(parts[3])
        rp = OffsetCheckpointFile(tmp_path / "rp").read().get(("p", 0), 0)
        copy = tmp_path / f"copy-{rnd}"
        shutil.copytree(d, copy)
        log = Log.open(copy, LogConfig(retention_ms=-1), recovery_point=rp)
        try:
            top = max(acked)
            assert log.log_end_offset > top, (rnd, log.log_end_offset, top)
            for base, raw in acked.items():
                data = log.read(base, 1)
                h = parse_header(data)
                assert h.base_offset == base
                want = decode_batches(raw)[0]
                got = decode_batches(data)[0]
                assert [r.value for r in got.records] == [r.value for r in want.records]
        finally:
            log.close()
