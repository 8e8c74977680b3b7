"""services.gateway.byte_budget: the produce bytes a gateway holds at once, alone (the
gateway test below drives it through a real gateway)."""

from __future__ import annotations

import threading
import time

import pytest

from services.gateway.byte_budget import ByteBudget
from services.gateway.node import QUEUED_MAX_REQUEST_BYTES, queued_max_request_bytes_for


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


def test_a_request_larger_than_the_budget_passes_alone() -> None:
    budget = ByteBudget(100)
    assert budget.acquire(500, time.monotonic() + 1)  # nothing else held
    assert not budget.acquire(1, time.monotonic() + 0.1)  # now it is
    budget.release(500)
    assert budget.acquire(1, time.monotonic() + 0.1)


def test_a_budget_must_hold_something() -> None:
    with pytest.raises(ValueError, match=r"must be >= 1 byte"):
        ByteBudget(0)


def test_the_gateways_budget_shrinks_under_a_memory_limit() -> None:
    mib = 1024 * 1024
    assert queued_max_request_bytes_for(None) == QUEUED_MAX_REQUEST_BYTES == 256 * mib
    assert queued_max_request_bytes_for(512 * mib) == 64 * mib  # the dev overlay's gateway
    assert queued_max_request_bytes_for(64 * 1024 * mib) == QUEUED_MAX_REQUEST_BYTES
