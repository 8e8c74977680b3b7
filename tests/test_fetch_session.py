"""Incremental fetch sessions (KIP-227): the pure bookkeeping of both ends
(``services/storage/fetch_session.py``). The wire behaviour is tested against a real
storage node in ``test_storage_node.py``, and every replication test runs through them."""

from __future__ import annotations

import pytest

from services.storage.fetch_session import (
    INITIAL_EPOCH,
    FetchSessionCache,
    FetchSessionHandler,
    SessionPartition,
    worth_answering,
)
from tidelog.errors import (
    FetchSessionIdNotFoundError,
    InvalidFetchSessionEpochError,
    InvalidRequestError,
)

A, B, C = ("a", 0), ("b", 0), ("c", 0)


def test_a_session_expects_its_epochs_in_order_and_only_from_its_follower() -> None:
    cache: FetchSessionCache[int] = FetchSessionCache()
    session, displaced = cache.open(2, [(A, 10), (B, 20)], now_s=0.0)
    assert displaced == [] and session.session_id > 0
    assert cache.resume(session.session_id, 1, 2, now_s=1.0) is session
    assert cache.resume(session.session_id, 2, 2, now_s=2.0) is session
    with pytest.raises(InvalidFetchSessionEpochError, match="expected epoch 3, got 2"):
        cache.resume(session.session_id, 2, 2, now_s=3.0)  # a retry of an answered fetch
    with pytest.raises(FetchSessionIdNotFoundError):
        cache.resume(session.session_id, 3, 3, now_s=3.0)  # another broker's session
    with pytest.raises(FetchSessionIdNotFoundError):
        cache.resume(session.session_id + 1, 1, 2, now_s=3.0)
    assert cache.close(session.session_id) is session
    with pytest.raises(FetchSessionIdNotFoundError):
        cache.resume(session.session_id, 3, 2, now_s=4.0)


def test_an_incremental_fetch_moves_named_partitions_and_drops_forgotten_ones() -> None:
    cache: FetchSessionCache[int] = FetchSessionCache()
    session, _ = cache.open(2, [(A, 10), (B, 20)], now_s=0.0)
    session.partitions[B].high_watermark = 20
    joined, left = session.update([(B, 21), (C, 30)], [A])
    assert (joined, left) == ([C], [A])
    assert {k: e.position for k, e in session.partitions.items()} == {B: 21, C: 30}
    # A moved partition keeps what was last answered for it.
    assert session.partitions[B].high_watermark == 20
    assert session.partitions[C].high_watermark == -1


def test_a_followers_new_session_replaces_its_old_one_and_idle_or_oldest_ones_go() -> None:
    cache: FetchSessionCache[int] = FetchSessionCache(max_sessions=2, idle_expiry_s=60.0)
    first, _ = cache.open(2, [(A, 1)], now_s=0.0)
    again, displaced = cache.open(2, [(A, 1)], now_s=1.0)  # broker 2 restarted its fetcher
    assert displaced == [first] and len(cache) == 1 and again.session_id != first.session_id
    other, _ = cache.open(3, [(A, 1)], now_s=2.0)
    third, displaced = cache.open(4, [(A, 1)], now_s=3.0)  # full: the least recent goes
    assert displaced == [again] and {s.session_id for s in cache.sessions()} == {
        other.session_id,
        third.session_id,
    }
    cache.resume(other.session_id, 1, 3, now_s=4.0)  # used: now the most recent
    _, displaced = cache.open(5, [(A, 1)], now_s=5.0)
    assert displaced == [third]
    _, displaced = cache.open(6, [(A, 1)], now_s=100.0)  # broker 3 silent for 96 s
    assert other in displaced


def test_a_session_holds_no_more_partitions_than_one_request_may_name() -> None:
    cache: FetchSessionCache[int] = FetchSessionCache(max_partitions=2)
    session, _ = cache.open(2, [(A, 1)], now_s=0.0)
    cache.check_size(session, [B], [])
    with pytest.raises(InvalidRequestError, match="more than 2 partitions"):
        cache.check_size(session, [B, C], [])
    cache.check_size(session, [B, C], [A])  # A leaves as they join
    cache.check_size(session, [A, B], [A])  # A leaves and joins again


def test_partitions_named_again_do_not_count_as_growth() -> None:
    """An incremental fetch names the partitions whose position moved, most of them
    already in the session; the size check counted every one as joining, so a large
    session's ordinary fetches were refused with INVALID_REQUEST though it would not
    grow at all."""
    cache: FetchSessionCache[int] = FetchSessionCache(max_partitions=3)
    session, _ = cache.open(2, [(A, 0), (B, 0), (C, 0)], now_s=0.0)
    resumed = cache.resume(session.session_id, 1, 2, now_s=1.0)
    named = [(A, 10), (B, 10)]
    cache.check_size(resumed, [key for key, _ in named], [])
    joined, left = resumed.update(named, ())
    assert (joined, left, len(resumed.partitions)) == ([], [], 3)


def test_partitions_are_read_in_turns_and_what_an_answer_left_out_is_read_next() -> None:
    """The first partitions read take a response's byte budget: those that brought data
    go to the end of the order, so backlogged partitions share it in turns, and those the
    budget left out are read again by the next fetch (their follower, whose position did
    not move, does not name them)."""
    cache: FetchSessionCache[int] = FetchSessionCache()
    session, _ = cache.open(2, [(A, 0), (B, 0), (C, 0)], now_s=0.0)
    assert session.in_turn({C, B, A, ("gone", 0)}) == [A, B, C]  # the order they joined
    session.answered(served=[A], unread=[B, C])
    assert session.unread == {B, C}
    assert session.in_turn({A, B, C}) == [B, C, A]
    session.answered(served=[B, C], unread=[A])
    assert session.in_turn({A, B, C}) == [A, B, C] and session.unread == {A}
    session.update([], [A])  # forgotten: nothing more owed to it
    assert session.unread == set() and session.in_turn({A, B, C}) == [B, C]
    joined, _ = session.update([(A, 5)], [])
    assert joined == [A] and session.in_turn({A, B, C}) == [B, C, A]
    session.answered(served=[], unread=[("gone", 0)])
    assert session.unread == set()


def test_only_partitions_with_news_or_a_moved_hw_or_log_start_are_answered() -> None:
    entry = SessionPartition(position=5)
    # Never answered: answered whatever it has.
    assert worth_answering(entry, high_watermark=5, log_start_offset=0, has_news=False)
    assert not worth_answering(entry, high_watermark=5, log_start_offset=0, has_news=False)
    assert worth_answering(entry, high_watermark=5, log_start_offset=0, has_news=True)
    assert worth_answering(entry, high_watermark=6, log_start_offset=0, has_news=False)
    assert worth_answering(entry, high_watermark=6, log_start_offset=3, has_news=False)
    assert not worth_answering(entry, high_watermark=6, log_start_offset=3, has_news=False)


def test_the_follower_names_only_what_changed_and_starts_over_after_a_failure() -> None:
    handler: FetchSessionHandler[int] = FetchSessionHandler()
    plan = handler.plan({A: 1, B: 2})
    assert plan.full and plan.epoch == INITIAL_EPOCH and plan.send == [A, B]
    handler.answered(plan, session_id=7)

    plan = handler.plan({A: 1, B: 3, C: 9})
    assert (plan.session_id, plan.epoch, plan.send, plan.forgotten) == (7, 1, [B, C], [])
    handler.answered(plan, session_id=7)
    plan = handler.plan({B: 3, C: 9})
    assert (plan.epoch, plan.send, plan.forgotten) == (2, [], [A])
    # Not answered (the call failed): the leader's session is not what we think.
    handler.reset()
    plan = handler.plan({B: 3, C: 9})
    assert plan.full and plan.session_id == 0 and plan.send == [B, C]


def test_a_leader_that_keeps_no_session_gets_full_fetches() -> None:
    handler: FetchSessionHandler[int] = FetchSessionHandler()
    plan = handler.plan({A: 1})
    handler.answered(plan, session_id=0)  # sessionless answer
    plan = handler.plan({A: 1})
    assert plan.full and plan.send == [A]


def test_a_plan_answered_late_does_not_count_positions_never_sent() -> None:
    """A pipelined fetch is planned before the previous answer is handled: each plan is
    answered in order, and the session then holds exactly what that plan named."""
    handler: FetchSessionHandler[int] = FetchSessionHandler()
    handler.answered(handler.plan({A: 1, B: 1}), session_id=3)
    first = handler.plan({A: 2, B: 1})
    handler.answered(first, session_id=3)
    second = handler.plan({A: 2, B: 5})
    assert second.send == [B] and second.epoch == 2


def test_sessions_unused_for_the_expiry_go() -> None:
    """A follower that stops following this leader leaves its session (and, on the
    server, a watcher on every partition it named): the maintenance pass drops it."""
    cache: FetchSessionCache[int] = FetchSessionCache(idle_expiry_s=60.0)
    quiet, _ = cache.open(2, [(A, 1)], now_s=0.0)
    busy, _ = cache.open(3, [(A, 1)], now_s=0.0)
    cache.resume(busy.session_id, 1, 3, now_s=50.0)
    assert cache.expire(now_s=59.0) == []
    assert cache.expire(now_s=61.0) == [quiet]
    assert cache.sessions() == [busy]
    with pytest.raises(FetchSessionIdNotFoundError):
        cache.resume(quiet.session_id, 1, 2, now_s=62.0)
