"""The producer's per-partition queue (``tidelog.producer._PartitionQueue``): batches keep
their send order through retries, and a partition that saw a failure stays blocked until
every request it has in flight is answered. Also the threads of direct mode's unary
appends (``_Appenders``). Pure: no cluster."""

from __future__ import annotations

import threading

import pytest

from tidelog.producer import _Appenders, _Batch, _PartitionQueue

TP = ("t", 0)


def _queue_of(n: int) -> tuple[_PartitionQueue, list[_Batch]]:
    pq = _PartitionQueue()
    batches = [_Batch(TP) for _ in range(n)]
    for batch in batches:
        pq.enqueue(batch)
    return pq, batches


def test_enqueue_numbers_batches_in_order() -> None:
    pq, batches = _queue_of(4)
    assert [b.ordinal for b in pq.batches] == [0, 1, 2, 3]
    assert list(pq.batches) == batches


def test_requeued_batches_go_back_into_their_places() -> None:
    """Requests 1 and 2 were in flight while 3 and 4 queued; they fail and come back in
    any order, and the queue is in send order again."""
    pq, batches = _queue_of(5)
    for _ in range(3):
        pq.batches.popleft()  # sent: 0 in one request, 1-2 in another
    pq.requeue(batches[1:3])
    pq.requeue(batches[0:1])
    assert [b.ordinal for b in pq.batches] == [0, 1, 2, 3, 4]


def test_requeue_before_a_queue_of_later_batches_is_a_prepend() -> None:
    pq, batches = _queue_of(3)
    pq.batches.popleft()
    pq.requeue(batches[:1])
    assert list(pq.batches) == batches


def test_a_failure_blocks_until_every_request_in_flight_is_answered() -> None:
    pq, batches = _queue_of(3)
    for _ in batches:  # three single-batch requests in flight
        pq.batches.popleft()
        pq.in_flight += 1
        pq.in_flight_batches += 1
    pq.request_done(batches[:1], failed=True)
    assert pq.blocked
    pq.request_done(batches[1:2], failed=False)
    assert pq.blocked and pq.in_flight == 1
    pq.request_done(batches[2:], failed=False)
    assert not pq.blocked
    assert pq.in_flight == 0 and pq.in_flight_batches == 0
    assert pq.pipe is None


def test_appenders_run_calls_on_at_most_their_threads() -> None:
    """Six blocking calls on three threads: three run at once, the others wait for a
    thread, and every future completes; the threads end at shutdown."""
    appenders = _Appenders(3)
    release = threading.Event()
    lock = threading.Lock()
    running = most = 0

    def call(i: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        release.wait(10)
        with lock:
            running -= 1
        return i

    futures = [appenders.submit(lambda i=i: call(i)) for i in range(6)]
    threading.Timer(0.2, release.set).start()
    assert [f.result(10) for f in futures] == list(range(6))
    assert most == 3
    appenders.shutdown(cancel=False)
    for thread in threading.enumerate():
        if thread.name == "tidelog-append":
            thread.join(5)
    assert not [t for t in threading.enumerate() if t.name == "tidelog-append"]


def test_appenders_that_cannot_start_a_thread_leave_the_call_to_the_sender(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No thread can be started (out of threads; or an atexit handler's close() on
    Python 3.12+, which refuses new threads then): submit does not raise into the sender,
    which makes the queued call itself, the lock not held, in make_orphaned_calls."""
    appenders = _Appenders(2)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    future = appenders.submit(threading.current_thread)
    assert not future.done()
    appenders.make_orphaned_calls()
    assert future.result(0) is threading.current_thread()


def test_appenders_shut_down_with_cancel_drop_queued_calls() -> None:
    """A forced close: calls not started yet are cancelled (their callbacks see it)."""
    appenders = _Appenders(1)
    release = threading.Event()
    first = appenders.submit(lambda: release.wait(10))
    queued = appenders.submit(lambda: "never")
    appenders.shutdown(cancel=True)
    release.set()
    assert first.result(10) is True
    assert queued.cancelled()
