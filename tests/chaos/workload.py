"""The chaos workload: idempotent acks=all producers of unique, checksummed values, and
concurrent consumers, all with the SDK, recording a history. Writers and readers of even
index go through the gateway, those of odd index use the SDK's direct mode (appends to
and fetches from the partition leaders, ``tidelog.leaders``): every fault meets both
paths. Gateway writers send their values in keyed ``send_batch`` calls of
``GATEWAY_BATCH`` (spread over every partition), so that their requests name several
partitions, which the chaos gateway sends in one AppendMany per leader (``cluster.py``);
direct writers ``send`` keyless values one by one, and send a leader's partitions with
nothing in flight in one AppendMany however few there are (the SDK's minimum is 4, more
than the chaos topic has per leader), the rest down their pipes.

A value is ``w<writer>:<seq>:<crc32 of the first two fields, hex>`` padded with a filler
derived from the same fields, so the checker can tell a value it never wrote, a corrupted
one, and which writer and sequence number a value carries (for the order check).

The history is plain data (``History``) so the checker is a pure function of it and
can be tested on doctored histories. A thread of the workload that dies of anything, or
an answer the workload cannot record, is written into it too (``thread_errors``): the
run fails on it rather than going on with fewer writers or readers.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidelog.consumer import Consumer
from tidelog.errors import TidelogError
from tidelog.producer import Producer, RecordMetadata

VALUE_BYTES = 100
GATEWAY_BATCH = 8
"""Values of one gateway writer's ``send_batch`` (keyed: several partitions at once)."""


def make_value(writer: int, seq: int) -> bytes:
    head = f"w{writer}:{seq}"
    crc = zlib.crc32(head.encode())
    text = f"{head}:{crc:08x}:"
    filler = (f"{crc:08x}" * (VALUE_BYTES // 8 + 1))[: max(0, VALUE_BYTES - len(text))]
    return (text + filler).encode()


def parse_value(value: bytes) -> tuple[int, int] | None:
    """``(writer, seq)`` of an intact value, None for anything this workload did not write."""
    try:
        writer_text, seq_text, crc_text, filler = value.decode().split(":", 3)
        writer, seq = int(writer_text[1:]), int(seq_text)
    except (UnicodeDecodeError, ValueError):
        return None
    if not writer_text.startswith("w") or make_value(writer, seq) != value:
        return None
    del crc_text, filler
    return writer, seq


@dataclass
class History:
    """What the clients saw. Offsets are per (topic) partition; one topic per run."""

    # value -> (partition, offset) as acknowledged to the producer
    acked: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    # values whose send failed (the write may or may not have happened)
    failed: dict[bytes, str] = field(default_factory=dict)
    sent: int = 0
    # consumer name -> [(partition, offset, value)] in the order polled
    reads: dict[str, list[tuple[int, int, bytes]]] = field(default_factory=dict)
    consumer_errors: int = 0
    # how many writers ran (w0..w<writers-1>): each must have had a value acknowledged
    writers: int = 0
    # a workload thread that died of an exception (an SDK bug; before, it went to stderr
    # and the run went on without it), an answer that could not be recorded, a thread
    # that did not stop: each fails the run (found by an audit)
    thread_errors: list[str] = field(default_factory=list)


def describe_error(exc: BaseException) -> str:
    """``exc`` and where it was raised, in a line."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{exc!r}{where}"


class Workload:
    """Producers and consumers on threads until ``stop()``; see the module docstring."""

    def __init__(
        self,
        gateway: str,
        topic: str,
        partitions: int,
        *,
        writers: int = 2,
        consumers: int = 2,
        rate_per_writer_s: float = 200.0,
    ) -> None:
        self.gateway = gateway
        self.topic = topic
        self.partitions = partitions
        self.history = History(writers=writers)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stop_consumers = threading.Event()
        self._rate_s = rate_per_writer_s
        self._producers: list[Producer] = []
        self._threads = [
            threading.Thread(target=self._write, args=(w,), name=f"chaos-writer-{w}", daemon=True)
            for w in range(writers)
        ] + [
            threading.Thread(
                target=self._read,
                args=(f"c{c}", c % 2 == 1),
                name=f"chaos-reader-{c}",
                daemon=True,
            )
            for c in range(consumers)
        ]

    def start(self) -> Workload:
        for thread in self._threads:
            thread.start()
        return self

    def stop_writers(self, flush_timeout_s: float) -> None:
        """Stop sending, then wait for every outstanding send to be answered."""
        self._stop.set()
        self._join("chaos-writer", flush_timeout_s + 10)
        for producer in self._producers:
            # What is still unanswered after the timeout stays neither acked nor failed.
            with contextlib.suppress(TidelogError):
                producer.close(flush_timeout_s)

    def stop_readers(self) -> None:
        self._stop_consumers.set()
        self._join("chaos-reader", 30)

    def _join(self, prefix: str, timeout_s: float) -> None:
        for thread in self._threads:
            if thread.name.startswith(prefix) and thread.ident is not None:
                thread.join(timeout_s)
                if thread.is_alive():
                    self._thread_error(thread.name, f"still running {timeout_s:.0f} s after stop")

    def _thread_error(self, name: str, text: str) -> None:
        with self._lock:
            self.history.thread_errors.append(f"{name}: {text}")

    # --- writers --------------------------------------------------------------------------

    def _write(self, writer: int) -> None:
        try:
            self._write_values(writer)
        except BaseException as exc:  # any way of dying fails the run
            self._thread_error(f"chaos-writer-{writer}", describe_error(exc))

    def _write_values(self, writer: int) -> None:
        direct = writer % 2 == 1
        producer = Producer(
            self.gateway,
            direct=direct,
            acks="all",
            enable_idempotence=True,
            linger_ms=5,
            delivery_timeout_ms=60_000,
            request_timeout_ms=5_000,
            max_block_ms=5_000,
        )
        # Like the chaos gateway's --produce-group-min-partitions 1: idle partitions go in
        # AppendMany groups, busy ones down the pipe, so faults meet both paths.
        producer._group_min_partitions = 1
        self._producers.append(producer)
        interval_s = 1.0 / self._rate_s
        next_at = time.monotonic()
        seq = 0
        while not self._stop.is_set():
            count = 1 if direct else GATEWAY_BATCH
            values = [make_value(writer, seq + i) for i in range(count)]
            seq += count
            try:
                if direct:
                    future: Future[Any] = producer.send(self.topic, values[0])
                else:
                    future = producer.send_batch(self.topic, values, keys=[v[:16] for v in values])
            except TidelogError as exc:
                with self._lock:
                    self.history.sent += count
                    for value in values:
                        self.history.failed[value] = f"send: {exc}"
            else:
                with self._lock:
                    self.history.sent += count
                future.add_done_callback(self._on_answer(values))
            # Paced whether the send was taken or refused: one that fails at once used to
            # skip this, and the writer spun at CPU speed (found by an audit).
            next_at += interval_s * count
            delay = next_at - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)
            else:
                next_at = time.monotonic()  # fell behind (a fault blocked send): no burst

    def _on_answer(self, values: list[bytes]) -> Callable[[Future[Any]], None]:
        """Records the answer of a ``send`` (one value) or a ``send_batch`` (a failure
        fails every value of it: each may or may not have been written). An answer that
        cannot be recorded (not one offset per value, say) fails every value and the run:
        an exception here went to ``concurrent.futures``' log, and the values were
        neither acknowledged nor failed (found by an audit)."""

        def record(future: Future[Any]) -> None:
            error = future.exception()
            with self._lock:
                if error is not None:
                    for value in values:
                        self.history.failed[value] = repr(error)
                    return
                result = future.result()
                metadata = [result] if isinstance(result, RecordMetadata) else list(result)
                if len(metadata) != len(values):
                    raise ValueError(f"{len(metadata)} offsets answered for {len(values)} values")
                for value, entry in zip(values, metadata, strict=True):
                    self.history.acked[value] = (entry.partition, entry.offset)

        def done(future: Future[Any]) -> None:
            try:
                record(future)
            except BaseException as exc:  # recorded: the run fails
                text = describe_error(exc)
                with self._lock:
                    self.history.thread_errors.append(f"answer to {len(values)} values: {text}")
                    for value in values:
                        if value not in self.history.acked:
                            self.history.failed[value] = f"unrecorded answer: {text}"

        return done

    # --- readers --------------------------------------------------------------------------

    def _read(self, name: str, direct: bool) -> None:
        """A reader from offset 0 of every partition to the end. After a failed poll it
        starts a new consumer at the offset after the last record it was handed (in
        ``positions``), so its reads of a partition are contiguous from the log start
        however often it restarts: the checker requires that."""
        reads: list[tuple[int, int, bytes]] = []
        with self._lock:
            self.history.reads[name] = reads
        try:
            self._read_records(reads, direct)
        except BaseException as exc:  # any way of dying fails the run
            self._thread_error(f"chaos-reader {name}", describe_error(exc))

    def _read_records(self, reads: list[tuple[int, int, bytes]], direct: bool) -> None:
        positions = dict.fromkeys(range(self.partitions), 0)
        while not self._stop_consumers.is_set():
            consumer = None
            try:
                consumer = Consumer(
                    self.gateway,
                    auto_offset_reset="earliest",
                    request_timeout_ms=5_000,
                    direct=direct,
                )
                consumer.assign([(self.topic, p) for p in range(self.partitions)])
                for partition, offset in positions.items():
                    consumer.seek((self.topic, partition), offset)
                while not self._stop_consumers.is_set():
                    for record in consumer.poll(timeout_ms=200):
                        reads.append((record.partition, record.offset, record.value or b""))
                        positions[record.partition] = record.offset + 1
            except TidelogError:
                # The gateway (or, direct, a leader) could not serve the fetch (a fault);
                # start over from the positions reached, as an application would.
                with self._lock:
                    self.history.consumer_errors += 1
                self._stop_consumers.wait(0.2)
            finally:
                if consumer is not None:
                    with contextlib.suppress(TidelogError):
                        consumer.close()


def read_all(
    gateway: str, topic: str, partitions: int, timeout_s: float
) -> dict[int, list[tuple[int, bytes]]]:
    """Every record of every partition from the beginning up to the end offsets (HW) as
    of the call, with a fresh consumer: the final log the checker compares against."""
    consumer = Consumer(gateway, auto_offset_reset="earliest", request_timeout_ms=10_000)
    try:
        tps = [(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(tps)
        ends = consumer.end_offsets(tps)
        log: dict[int, list[tuple[int, bytes]]] = {p: [] for p in range(partitions)}
        deadline = time.monotonic() + timeout_s
        remaining = {p for p in range(partitions) if ends[(topic, p)] > 0}
        while remaining:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"final read did not reach the end offsets {ends} in {timeout_s} s"
                )
            for record in consumer.poll(timeout_ms=500):
                if record.offset < ends[(topic, record.partition)]:
                    log[record.partition].append((record.offset, record.value or b""))
                if record.offset + 1 >= ends[(topic, record.partition)]:
                    remaining.discard(record.partition)
        return log
    finally:
        consumer.close()
