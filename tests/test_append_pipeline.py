"""AppendPipeline: the bounds on how far an AppendStream's reader runs ahead of its answers."""

from __future__ import annotations

import threading

import pytest

from services.storage.append_pipeline import AppendPipeline


def _put_in_thread(
    pipeline: AppendPipeline[str], item: str, size_bytes: int, over: threading.Event
) -> tuple[threading.Thread, list[bool]]:
    result: list[bool] = []
    thread = threading.Thread(
        target=lambda: result.append(pipeline.put_unless(item, size_bytes, over)), daemon=True
    )
    thread.start()
    return thread, result


def test_items_come_out_in_order_with_the_end_marker_last() -> None:
    pipeline: AppendPipeline[str] = AppendPipeline(10, 1000)
    over = threading.Event()
    for item in ("a", "b", "c"):
        assert pipeline.put_unless(item, 10, over)
    assert pipeline.put_unless(None, 0, over)
    assert [pipeline.get() for _ in range(4)] == ["a", "b", "c", None]
    assert pipeline.size_bytes == 0


def test_the_count_bound_holds_the_reader_until_an_answer_is_taken() -> None:
    pipeline: AppendPipeline[str] = AppendPipeline(2, 1_000_000, poll_s=0.05)
    over = threading.Event()
    assert pipeline.put_unless("a", 1, over)
    assert pipeline.put_unless("b", 1, over)
    thread, result = _put_in_thread(pipeline, "c", 1, over)
    thread.join(0.3)
    assert thread.is_alive() and len(pipeline) == 2  # no room: the reader waits
    assert pipeline.get() == "a"
    thread.join(5)
    assert result == [True]
    assert [pipeline.get(), pipeline.get()] == ["b", "c"]


def test_the_byte_bound_holds_the_reader_but_an_empty_pipeline_takes_any_request() -> None:
    pipeline: AppendPipeline[str] = AppendPipeline(100, 1000, poll_s=0.05)
    over = threading.Event()
    assert pipeline.put_unless("huge", 5000, over)  # alone: taken, above the bound
    thread, result = _put_in_thread(pipeline, "small", 1, over)
    thread.join(0.3)
    assert thread.is_alive() and pipeline.size_bytes == 5000
    assert pipeline.get() == "huge"
    thread.join(5)
    assert result == [True] and pipeline.size_bytes == 1
    assert pipeline.put_unless("fits", 999, over)  # exactly at the bound
    assert pipeline.size_bytes == 1000


def test_the_end_marker_is_never_refused_for_room() -> None:
    pipeline: AppendPipeline[str] = AppendPipeline(1, 10)
    over = threading.Event()
    assert pipeline.put_unless("a", 10, over)
    assert pipeline.put_unless(None, 0, over)  # the pipeline is full, and it goes in
    assert [pipeline.get(), pipeline.get()] == ["a", None]


def test_a_waiting_reader_gives_up_once_the_stream_is_over() -> None:
    pipeline: AppendPipeline[str] = AppendPipeline(1, 10, poll_s=0.05)
    over = threading.Event()
    assert pipeline.put_unless("a", 1, over)
    thread, result = _put_in_thread(pipeline, "b", 1, over)
    over.set()
    thread.join(5)
    assert result == [False]
    assert not pipeline.put_unless(None, 0, over)  # nothing goes in once over
    assert pipeline.drain() == ["a"] and len(pipeline) == 0 and pipeline.size_bytes == 0


def test_bounds_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        AppendPipeline(0, 10)
    with pytest.raises(ValueError, match="must be >= 1"):
        AppendPipeline(1, 0)
