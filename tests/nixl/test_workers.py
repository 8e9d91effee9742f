"""The worker runtimes' side-channel duties with a real PrefillWorker (real NIXL agent, real ZMQ side channel)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.prefill_worker import PrefillWorker
from kvbridge.serving.launcher import free_base_port
from kvbridge.wire import messages as wire
from kvbridge.wire.side_channel_client import exchange, fetch_handshake

pytestmark = pytest.mark.nixl

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)


def make_prefill(lock=None) -> PrefillWorker:
    """A started prefill worker; `lock` (if given) replaces its lock, and the condition built on it, before
    any thread exists."""
    layout = ParallelLayout()
    kv = torch.zeros(1 << 16, dtype=torch.uint8)
    memory = synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, 16, kv.data_ptr())
    config = BridgeConfig(side_channel_port=free_base_port(1), lease_s=30)
    worker = PrefillWorker(WorkerIdentity("p", layout, 0, WorkerRank(0, 0), GEOMETRY), memory, config)
    worker._kv = kv  # the registered memory lives as long as the worker
    if lock is not None:
        worker._lock = lock
        worker._changed = threading.Condition(lock)
    return worker.start()


@pytest.fixture
def prefill():
    worker = make_prefill()
    try:
        yield worker
    finally:
        worker.close()


def wait_finished(worker: PrefillWorker, timeout: float = 10.0) -> tuple[set[str], int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ids, expired = worker.finished()
        if ids:
            return ids, expired
        time.sleep(0.01)
    return set(), 0


def test_a_side_channel_notification_frees_a_held_request_at_once(prefill):
    """What a CUDA IPC reader sends after its kernel: acknowledged, and the blocks are freed, not expired."""
    prefill.hold("req-1", ((3, 4),), token="tok-1")
    note = wire.Notify(request_id="req-1", engine_id="d", worker=wire.Worker(), expected=1, token="tok-1")
    assert isinstance(exchange("127.0.0.1", prefill.port, note, timeout_s=5), wire.Ack)
    again = exchange("127.0.0.1", prefill.port, note, timeout_s=5)  # repeat: no-op
    assert again == wire.Ack(request_id="req-1", epoch=prefill.epoch)
    assert wait_finished(prefill) == ({"req-1"}, 0)


def test_a_notification_without_the_token_frees_nothing(prefill):
    """A forged Notify (anyone who knows a request id) is refused, says nothing, and frees nothing."""
    prefill.hold("req-3", ((2,),), token="secret")
    for token in ("", "guess"):
        note = wire.Notify(request_id="req-3", engine_id="x", worker=wire.Worker(), expected=1, token=token)
        assert exchange("127.0.0.1", prefill.port, note, timeout_s=5) == wire.ErrorReply(
            message="refused", reason=wire.Refusal.REFUSED
        )
        abort = wire.Abort(request_id="req-3", engine_id="x", worker=wire.Worker(), token=token)
        assert exchange("127.0.0.1", prefill.port, abort, timeout_s=5) == wire.ErrorReply(
            message="refused", reason=wire.Refusal.REFUSED
        )
    assert wait_finished(prefill, timeout=0.5) == (set(), 0)
    assert prefill.lease_counts()["refused"] == 4 and prefill.lease_counts()["held"] == 1
    # the control: the right token frees it at once
    abort = wire.Abort(request_id="req-3", engine_id="x", worker=wire.Worker(), token="secret")
    assert isinstance(exchange("127.0.0.1", prefill.port, abort, timeout_s=5), wire.Ack)
    assert wait_finished(prefill) == ({"req-3"}, 0)


def test_a_request_waits_for_every_expected_reader(prefill):
    prefill.hold("req-2", ((1,),))
    for tp in range(2):
        note = wire.Notify(request_id="req-2", engine_id="d", worker=wire.Worker(tp=tp), expected=2)
        assert prefill.finished() == (set(), 0)
        assert isinstance(exchange("127.0.0.1", prefill.port, note, timeout_s=5), wire.Ack)
    assert wait_finished(prefill) == ({"req-2"}, 0)


def test_a_cpu_worker_shares_no_cuda_ipc_handles(prefill):
    request = wire.HandshakeRequest.build(
        "d",
        ParallelLayout(),
        0,
        WorkerRank(0, 0),
        GEOMETRY,
        "LBHNC",
        synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, 16, 1 << 20),
        target=(0, WorkerRank(0, 0)),
    )
    reply = fetch_handshake("127.0.0.1", prefill.port, request, timeout_s=5)
    assert reply.ipc == () and reply.host_id


class _OwnedLock:
    """A lock that knows which thread holds it (`threading.Lock` only knows that some thread does). Supports
    `threading.Condition` (its wait releases and retakes the lock through `_release_save`/`_acquire_restore`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self.owner = threading.get_ident()
        return got

    def release(self) -> None:
        self.owner = None
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc_info) -> None:
        self.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def _is_owned(self) -> bool:
        return self.owner == threading.get_ident()

    def _release_save(self) -> None:
        self.release()

    def _acquire_restore(self, state) -> None:
        self.acquire()


class _Guarded:
    """The lease book, recording every access made by a thread that does not hold the worker's lock (a race with
    vLLM's step): the lock free, or held by another thread."""

    def __init__(self, book, lock: _OwnedLock) -> None:
        object.__setattr__(self, "_book", book)
        object.__setattr__(self, "_lock", lock)
        object.__setattr__(self, "unlocked", [])

    def __getattr__(self, name):
        if self._lock.owner != threading.get_ident():
            self.unlocked.append((name, threading.current_thread().name))
        return getattr(self._book, name)


def test_the_lease_book_is_only_touched_under_the_lock():
    """Reading `_leases.held` outside the lock while the step thread mutates the dict kills the background thread
    (`dictionary changed size during iteration`). Every access holds the lock, taken by the thread that makes
    it."""
    lock = _OwnedLock()
    prefill = make_prefill(lock)
    try:
        guarded = _Guarded(prefill._leases, lock)
        with lock:  # no thread is inside the book while it is swapped
            prefill._leases = guarded
        for i in range(50):
            prefill.hold(f"r{i}", ((1,),), token="t")
            prefill.finished()  # the step thread's path
            prefill.finished(wait_s=0.001)  # an idle step: waits on the condition built on the lock
            time.sleep(0.002)  # let the background thread run rounds
        time.sleep(0.2)
        assert prefill._thread.is_alive()
        assert guarded.unlocked == []
        # the controls: an access without the lock is noticed ...
        guarded.held  # noqa: B018
        assert guarded.unlocked == [("held", threading.current_thread().name)]
        # ... and so is one made while another thread holds the lock (what `lock.locked()` could not tell)
        taken, done = threading.Event(), threading.Event()

        def hold_the_lock() -> None:
            with lock:
                taken.set()
                done.wait(5)

        other = threading.Thread(target=hold_the_lock, name="other")
        other.start()
        assert taken.wait(5) and lock.locked()
        guarded.held  # noqa: B018
        done.set()
        other.join(5)
        assert guarded.unlocked == [("held", threading.current_thread().name)] * 2
    finally:
        prefill.close()
