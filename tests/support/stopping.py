"""Stopping a process (SIGSTOP) for a test of a silent peer, and knowing it has stopped.

kill() returns once the signal is queued, before every thread of the target has stopped: a thread running on
another core, or woken by a request meanwhile, can still answer it. A test that sends a request right after
SIGSTOP and expects no answer waits here until every thread is in the stopped state."""

from __future__ import annotations

import os
import signal
import time


def stop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP `pid`, then wait until each of its threads is stopped (AssertionError after `timeout_s`)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not all_stopped(pid):
        assert time.monotonic() < deadline, f"process {pid} not stopped {timeout_s} s after SIGSTOP"
        time.sleep(0.001)


def all_stopped(pid: int) -> bool:
    """Whether every thread of `pid` is stopped (state T or t in /proc)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
        if state not in ("T", "t"):
            return False
    return True
