"""services.gateway.byte_budget: the produce and fetch bytes a gateway holds at once, alone (the
gateway test below drives it through a real gateway)."""

from __future__ import annotations

import threading
import time

import pytest

from services.gateway.byte_budget import ByteBudget
from services.gateway.node import (
    QUEUED_MAX_FETCH_BYTES,
    QUEUED_MAX_REQUEST_BYTES,
    queued_max_fetch_bytes_for,
    queued_max_request_bytes_for,
)


def test_requests_that_fit_pass_at_once_and_others_wait_for_a_release() -> None:
    budget = ByteBudget(100)
    assert budget.acquire(60, time.monotonic() + 1)
    assert budget.acquire(40, time.monotonic() + 1)
    assert budget.in_use_bytes == 100
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(budget.acquire(50, time.monotonic() + 10)))
    waiter.start()
    time.sleep(0.2)
    assert got == []  # still waiting: 100 + 50 > 100
    budget.release(60)
    waiter.join(5)
    assert got == [True]
    assert budget.in_use_bytes == 90


def test_a_request_that_finds_no_room_before_its_deadline_takes_nothing() -> None:
    budget = ByteBudget(100)
    assert budget.acquire(80, time.monotonic() + 1)
    started = time.monotonic()
    assert not budget.acquire(30, started + 0.2)
    assert time.monotonic() - started >= 0.2
    assert budget.in_use_bytes == 80


def test_requests_waiting_for_room_are_bounded_and_the_rest_refused_at_once() -> None:
    """A waiting request is in memory already (gRPC read it whole): 40 requests of 3 MB
    waiting for a 4 MB budget grew the gateway by 326 MB (found by an audit). Requests may
    wait up to ``max_waiting_bytes``; one more is refused at once, taking nothing."""
    budget = ByteBudget(100, max_waiting_bytes=100)
    assert budget.acquire(100, time.monotonic() + 1)
    got: list[bool] = []
    waiters = [
        threading.Thread(target=lambda: got.append(budget.acquire(50, time.monotonic() + 10)))
        for _ in range(2)
    ]
    for waiter in waiters:
        waiter.start()
    wait_until = time.monotonic() + 5
    while budget._waiting_bytes < 100 and time.monotonic() < wait_until:
        time.sleep(0.01)
    started = time.monotonic()
    assert not budget.acquire(1, started + 10)  # 100 bytes wait already: refused at once
    assert time.monotonic() - started < 1.0 and budget.in_use_bytes == 100
    budget.release(100)
    for waiter in waiters:
        waiter.join(5)
    assert got == [True, True] and budget.in_use_bytes == 100
    assert budget._waiting_bytes == 0


def test_a_request_larger_than_the_budget_passes_alone() -> None:
    budget = ByteBudget(100)
    assert budget.acquire(500, time.monotonic() + 1)  # nothing else held
    assert not budget.acquire(1, time.monotonic() + 0.1)  # now it is
    budget.release(500)
    assert budget.acquire(1, time.monotonic() + 0.1)


def test_a_request_of_no_bytes_passes_even_beside_one_larger_than_the_budget() -> None:
    """Nothing to hold always fits: a request without record bytes waited behind one
    larger than the whole budget, let through alone (found by an audit)."""
    budget = ByteBudget(100)
    assert budget.acquire(150, time.monotonic())  # alone, past the limit
    assert budget.acquire(0, time.monotonic())  # at once, not after a wait or a refusal
    budget.release(150)
    assert budget.in_use_bytes == 0


def test_a_budget_must_hold_something() -> None:
    with pytest.raises(ValueError, match=r"must be >= 1 byte"):
        ByteBudget(0)


def test_the_gateways_budget_shrinks_under_a_memory_limit() -> None:
    mib = 1024 * 1024
    assert queued_max_request_bytes_for(None) == QUEUED_MAX_REQUEST_BYTES == 256 * mib
    assert queued_max_request_bytes_for(512 * mib) == 64 * mib  # the dev overlay's gateway
    assert queued_max_request_bytes_for(64 * 1024 * mib) == QUEUED_MAX_REQUEST_BYTES


def test_a_fetch_grant_is_a_share_of_the_room_and_at_least_the_floor() -> None:
    budget = ByteBudget(1000)
    deadline = time.monotonic() + 1
    assert budget.acquire_up_to(2000, 100, deadline, share=4) == 250  # a quarter of 1000
    assert budget.acquire_up_to(50, 100, deadline, share=4) == 50  # less than the floor asked
    assert budget.acquire_up_to(2000, 100, deadline, share=4) == 175  # a quarter of 700
    assert budget.acquire_up_to(2000, 100, deadline, share=4) == 131
    assert budget.acquire_up_to(2000, 100, deadline, share=4) == 100  # the floor, not 98
    assert budget.in_use_bytes == 706
    assert budget.acquire_up_to(2000, 100, deadline) == 294  # share 1: all the room left


def test_a_fetch_grant_waits_for_the_floor_and_gives_up_at_its_deadline() -> None:
    budget = ByteBudget(1000)
    assert budget.acquire(950, time.monotonic() + 1)
    started = time.monotonic()
    assert budget.acquire_up_to(500, 100, started + 0.2) == 0  # 50 < the floor of 100
    assert time.monotonic() - started >= 0.2
    assert budget.in_use_bytes == 950
    got: list[int] = []
    waiter = threading.Thread(
        target=lambda: got.append(budget.acquire_up_to(500, 100, time.monotonic() + 10))
    )
    waiter.start()
    time.sleep(0.2)
    assert got == []
    budget.release(450)
    waiter.join(5)
    assert got == [500]


def test_take_charges_bytes_already_in_memory_beyond_the_limit() -> None:
    budget = ByteBudget(100)
    assert budget.acquire_up_to(100, 10, time.monotonic() + 1) == 100
    budget.take(40)  # a leader answered a whole first batch larger than the grant
    assert budget.in_use_bytes == 140
    assert budget.acquire_up_to(10, 10, time.monotonic() + 0.1) == 0
    budget.release(140)
    assert budget.in_use_bytes == 0


def test_the_gateways_fetch_budget_shrinks_under_a_memory_limit() -> None:
    mib = 1024 * 1024
    assert queued_max_fetch_bytes_for(None) == QUEUED_MAX_FETCH_BYTES == 256 * mib
    assert queued_max_fetch_bytes_for(512 * mib) == 32 * mib  # the dev overlay's gateway
    assert queued_max_fetch_bytes_for(8 * mib) == mib  # never below 1 MiB
