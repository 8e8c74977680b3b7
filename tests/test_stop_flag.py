"""Stopping on signals that arrive while the previous one is being handled.

A ``threading.Event`` set in a signal handler deadlocked a process that got a second
SIGTERM while handling the first (``tidelog dev`` killed outright: every child gets
SIGTERM from the kernel while its own stop is under way): the nested handler waited for
the Event's lock, held by the frame it interrupted. Found as an intermittent
``tests/test_cli.py::test_dev_killed_outright_leaves_no_child_running`` timeout; py-spy
showed the storage node's main thread in ``request_stop`` -> ``Event.set`` nested three
deep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.support.process import StartStorage
from tidelog.stop_flag import StopFlag


def test_a_flag_set_in_nested_handlers_stops_the_wait() -> None:
    """A child process whose handler is interrupted by more signals, mid-set, still
    stops: the flag takes no lock."""
    script = textwrap.dedent(
        """
        import os, signal, sys, time
        from tidelog.stop_flag import StopFlag
        flag = StopFlag()
        def handler(signum, frame):
            flag.set(signum)
            time.sleep(0.01)  # more signals arrive inside the handler
        signal.signal(signal.SIGTERM, handler)
        print("ready", flush=True)
        while not flag.wait(1.0):
            pass
        print("stopped", flag.first_signal, flush=True)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    for _ in range(200):
        if child.poll() is not None:
            break
        child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 0
    assert out.strip() == f"stopped {int(signal.SIGTERM)}"


def test_a_service_stops_under_a_burst_of_sigterms(start_storage: StartStorage) -> None:
    node = start_storage()
    for _ in range(300):
        if node.proc.poll() is not None:
            break
        node.proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert node.proc.wait(60) == 0
    assert time.monotonic() - started < 60


def test_wait_times_out_and_reports() -> None:
    flag = StopFlag()
    assert not flag.wait(0.05) and flag.first_signal is None
    flag.set(15)
    flag.set(2)
    assert flag.wait(5) and flag.is_set() and flag.first_signal == 15
