"""The producer's per-partition queue (``tidelog.producer._PartitionQueue``): batches keep
their send order through retries, and a partition that saw a failure stays blocked until
every request it has in flight is answered. Pure: no cluster."""

from __future__ import annotations

from tidelog.producer import _Batch, _PartitionQueue

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
