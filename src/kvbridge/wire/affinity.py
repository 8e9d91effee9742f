"""kvbridge's threads are not pinned to the cores vLLM pins its workers to.

vLLM pins a CPU worker process to its cores (VLLM_CPU_OMP_THREADS_BIND), where its threads spin between steps
(shm_broadcast's busy loop, OpenMP's spin-wait); every thread the process starts inherits that affinity. When a
prefill and a decode worker share a core, a side-channel thread pinned there waited seconds for it, and
handshakes and claims timed out (issue "Liveness"). kvbridge's own threads are light (they answer in
microseconds), so they run wherever a core is free: the threads call `unpin_this_thread`, and the ZMQ context
(whose I/O thread is started with its first socket) is made `unpinned`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import zmq

_lock = threading.Lock()
_context: zmq.Context | None = None


def _all_cores() -> range:
    return range(os.cpu_count() or 1)


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Let the calling thread, and the threads it starts meanwhile, run on every core; then restore it."""
    try:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, _all_cores())
    except (AttributeError, OSError):  # not Linux, or not allowed: stay where we are
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, before)


def unpin_this_thread() -> None:
    """Let the calling thread run on every core from now on."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, _all_cores())


def zmq_context() -> zmq.Context:
    """kvbridge's own ZMQ context (not the process-wide instance vLLM also uses), its I/O thread unpinned."""
    global _context
    with _lock:
        if _context is None or _context.closed:
            with unpinned():
                context = zmq.Context(io_threads=1)
                context.socket(zmq.PAIR).close(linger=0)  # starts the I/O and reaper threads now, unpinned
            _context = context
        return _context
