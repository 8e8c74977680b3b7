"""Child processes that end with the process that started them (Linux's PR_SET_PDEATHSIG).

``tidelog dev`` starts etcd, a controller, storage nodes and a gateway, each in a session
of its own so that a Ctrl-C at the terminal reaches only the supervisor, which then stops
them in a safe order. A supervisor killed with SIGKILL (or by the OOM killer) never runs
that stop: its children used to run on, holding the ports and data directories the next
``tidelog dev`` needs. Started with ``preexec_fn=end_with_parent()``, a child gets SIGTERM
from the kernel when its parent ends, and stops as on a Ctrl-C (every role and etcd handle
SIGTERM).

The kernel sends the signal when the *thread* that started the child ends, not the
process: pass ``end_with_parent()`` only from a thread that lives as long as the process
(``tidelog dev`` starts every child from its main thread). Elsewhere than Linux it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable
from typing import Final

PR_SET_PDEATHSIG: Final = 1  # <linux/prctl.h>


def _prctl() -> Callable[[int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    function = ctypes.CDLL(name, use_errno=True).prctl
    function.argtypes = [ctypes.c_int, ctypes.c_ulong]
    function.restype = ctypes.c_int
    return function


def end_with_parent(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` asking the kernel to send ``signum`` to the child when this thread
    ends; None where that is not available (then the child simply outlives its parent).

    Everything is looked up here, before the fork: between fork and exec only the prctl
    call itself runs (a child of a threaded parent must not take locks there)."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent_pid = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signum)
        if os.getppid() != parent_pid:
            # The parent ended before the request took effect: nobody would signal us,
            # and nobody waits for this child. (A signal sent to ourselves here would
            # reach the handler copied from the parent, not end the program exec'd.)
            os._exit(1)

    return preexec


__all__ = ["end_with_parent"]
