"""kvbridge's threads are not pinned to the cores vLLM pins its workers to.

vLLM pins a CPU worker process to its cores (VLLM_CPU_OMP_THREADS_BIND), where its threads spin between steps
(shm_broadcast's busy loop, OpenMP's spin-wait); every thread the process starts inherits that affinity. When a
prefill and a decode worker share a core, a side-channel thread pinned there waited seconds for it, and
handshakes and claims timed out (docs/benchmarks/shared-cores.md). kvbridge's own threads are light (they answer in
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


BOOST = -5
"""Nice value for kvbridge's threads: a higher scheduler weight than vLLM's spinning workers (nice 0), so that
an answer that needs microseconds of CPU is not queued behind them. Best effort (needs CAP_SYS_NICE)."""


def _boost(tid: int) -> None:
    with contextlib.suppress(AttributeError, OSError, PermissionError):
        if os.getpriority(os.PRIO_PROCESS, tid) > BOOST:
            os.setpriority(os.PRIO_PROCESS, tid, BOOST)


def unpin_this_thread() -> None:
    """Let the calling thread run on every core from now on, at a higher scheduler weight."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, _all_cores())
    _boost(threading.get_native_id())


def zmq_context() -> zmq.Context:
    """kvbridge's own ZMQ context (not the process-wide instance vLLM also uses), its I/O thread unpinned."""
    global _context
    with _lock:
        if _context is None or _context.closed:
            before = _thread_ids()
            with unpinned():
                context = zmq.Context(io_threads=1)
                context.socket(zmq.PAIR).close(linger=0)  # starts the I/O and reaper threads now, unpinned
            for tid in _thread_ids() - before:
                _boost(tid)
            _context = context
        return _context


def _thread_ids() -> set[int]:
    """Native ids of this process's threads (Linux /proc; empty elsewhere): the ones that appear while the ZMQ
    context starts are its I/O and reaper threads (they name themselves only later)."""
    with contextlib.suppress(OSError):
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    return set()
