"""``GroupChanges`` against a real etcd: a waiting join wakes on its own group's keys only,
and falls back to polling while the watch is down, then watches again."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.gateway import group_changes
from services.gateway.group_changes import GroupChanges, group_of_key
from services.metastore import MetaStore, MetaStoreUnavailableError
from tidelog.etcd_launcher import EtcdProcess

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    with EtcdProcess(tmp_path / "etcd") as process:
        yield process


def test_group_of_key_reads_every_membership_prefix_and_nothing_else() -> None:
    assert group_of_key("group-states/a%2Fb") == "a/b"
    assert group_of_key("group-sessions/g/member-1") == "g"
    assert group_of_key("group-fences/g") == "g"
    assert group_of_key("group-rebalances/g") == "g"
    assert group_of_key("groups/g/topic/0") is None  # committed offsets: not watched
    assert group_of_key("group-states/") is None


def test_a_wait_wakes_on_its_groups_changes_only(etcd: EtcdProcess) -> None:
    with MetaStore(etcd.endpoint, cluster="c", timeout_s=3.0) as store:
        changes = GroupChanges(store)
        changes.start()
        try:
            ticket = changes.ticket("g")
            seen = ticket.version
            # Another group's keys and the offsets of this one do not count; a wait
            # times out with the version unchanged (a short timeout: no change comes).
            store.put("group-states/other", b"x")
            store.put("groups/g/t/0", b"{}")
            changes.wait(ticket, 0.3)
            assert ticket.version == seen
            # A change that lands before the wait (after the ticket) is not missed.
            store.put("group-sessions/g/m1", b"1")
            changes.wait(ticket, 30)
            assert ticket.version > seen
            # One from another thread while this one waits wakes it.
            seen = ticket.version
            timer = threading.Timer(0.2, lambda: store.delete("group-sessions/g/m1"))
            timer.start()
            changes.wait(ticket, 30)
            timer.join()
            assert ticket.version > seen
            changes.done(ticket)
            assert changes._versions == {}  # nobody waits: nothing kept for the group
        finally:
            changes.stop()


def test_waits_poll_while_etcd_is_down_and_the_watch_comes_back(
    etcd: EtcdProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(group_changes, "RESTART_BACKOFF_S", 0.0)
    with MetaStore(etcd.endpoint, cluster="c", timeout_s=3.0) as store:
        changes = GroupChanges(store)
        changes.start()
        try:
            etcd.kill()
            ticket = changes.ticket("g")
            for _ in range(100):  # the watch notices the lost stream
                changes.wait(ticket, 0.1)
                if not changes._healthy:
                    break
            assert not changes._healthy
            etcd.start()
            for _ in range(100):  # a later waiter starts the watch again
                changes.done(ticket)
                ticket = changes.ticket("g")
                if changes._healthy:
                    break
                changes.wait(ticket, 0.1)
            assert changes._healthy
            seen = ticket.version
            store.put("group-states/g", b"x")
            changes.wait(ticket, 30)
            assert ticket.version > seen
            changes.done(ticket)
        finally:
            changes.stop()


class _WatchFailsAtOnce(MetaStore):
    """A real store whose first prefix watch fails right after etcd confirmed it, before
    ``watch_prefix`` returns to the caller (the window a stream broken at once opens)."""

    failures_left = 1

    def watch_prefix(self, *args: Any, **kwargs: Any) -> Callable[[], None]:
        cancel = super().watch_prefix(*args, **kwargs)
        if self.failures_left:
            self.failures_left -= 1
            cancel()  # the stream is over, as after a real failure
            kwargs["on_error"](MetaStoreUnavailableError("injected: the stream broke"))
        return cancel


def test_a_watch_that_fails_before_it_is_adopted_is_restarted(
    etcd: EtcdProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failure came before ``_restart`` adopted the watch, which then marked it
    healthy: nothing ever restarted it, and every wait ran to its one-second cap with
    its group's changes unseen (found by an audit)."""
    monkeypatch.setattr(group_changes, "RESTART_BACKOFF_S", 0.0)
    with _WatchFailsAtOnce(etcd.endpoint, cluster="c", timeout_s=3.0) as store:
        changes = GroupChanges(store)
        changes.start()
        try:
            ticket = changes.ticket("g")  # restarts the failed watch
            seen = ticket.version
            store.put("group-sessions/g/m1", b"1")
            changes.wait(ticket, 0.9)  # below the cap: only the event can wake it
            assert ticket.version > seen
            changes.done(ticket)
        finally:
            changes.stop()
