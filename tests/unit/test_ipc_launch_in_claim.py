"""A CUDA IPC load whose kernels go out while its claim is on the wire (`IpcReads.launch(load, claim_open=True)`)
is reported once both are done: loaded only if the claim was granted, and never, granted or refused, while its
kernels may still write its blocks. A fake reader stands for the GPU: its events complete when the test says."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from kvbridge.runtime.ipc_reads import IpcReads
from kvbridge.runtime.load import Load, LoadJob
from support.fake_gpu_reader import FakeReader


class _Reports:
    def __init__(self) -> None:
        self.loaded: list[Load] = []
        self.failed: list[tuple[Load, str]] = []
        self.any = threading.Event()

    def on_loaded(self, load, gpu_s):
        self.loaded.append(load)
        self.any.set()

    def on_failed(self, load, error):
        self.failed.append((load, error))
        self.any.set()

    def settle(self, wait_s: float = 0.2) -> None:
        self.any.wait(wait_s)


@pytest.fixture
def ipc():
    reports = _Reports()
    reads = IpcReads(None, None, (), loaded=reports.on_loaded, failed=reports.on_failed)
    reader = FakeReader()
    reads.start(reader)
    yield reads, reader, reports
    for end in reader.ends:
        end.done.set()
    reads.close()


def a_load() -> Load:
    load = Load(LoadJob("r", None, ((1, 2),), ((3, 4),)), queued=1.0, deadline=1e12)
    load.engine = SimpleNamespace(kernels={"w0": SimpleNamespace(block_bytes=64)}, peers={})
    load.block_arrays = ((1, 2), (3, 4))  # checked (the checks are test_load_durations' part)
    return load


def test_kernels_done_before_the_grant_wait_for_it(ipc):
    reads, reader, reports = ipc
    load = a_load()
    reads.launch(load, claim_open=True)
    reader.ends[0].done.set()
    reports.settle()
    assert not reports.loaded and not reports.failed  # the claim is still on the wire
    reads.claim_done(load)
    assert reports.loaded == [load] and not reports.failed
    assert load.gpu_s == pytest.approx(0.5e-3)


def test_a_grant_before_the_kernels_finish_waits_for_them(ipc):
    reads, reader, reports = ipc
    load = a_load()
    reads.launch(load, claim_open=True)
    reads.claim_done(load)
    reports.settle()
    assert not reports.loaded and not reports.failed  # the kernels may still write its blocks
    reader.ends[0].done.set()
    reports.settle(5)
    assert reports.loaded == [load]


def test_a_refused_claim_fails_the_load_only_once_its_kernels_are_done(ipc):
    reads, reader, reports = ipc
    load = a_load()
    reads.launch(load, claim_open=True)
    reads.claim_done(load, "prefill worker 0 refused the read: not_held")
    reports.settle()
    assert not reports.failed and not reports.loaded  # refused, but its kernels still run
    reader.ends[0].done.set()
    reports.settle(5)
    assert reports.failed == [(load, "prefill worker 0 refused the read: not_held")] and not reports.loaded


def test_a_failed_launch_during_the_claim_is_reported_once_after_it():
    reports = _Reports()
    reads = IpcReads(None, None, (), loaded=reports.on_loaded, failed=reports.on_failed)
    reads.start(FakeReader(fail=True))
    try:
        load = a_load()
        reads.launch(load, claim_open=True)
        assert not reports.failed  # the claim is still on the wire
        reads.claim_done(load)  # granted, but nothing was read
        assert [error for _, error in reports.failed] == ["launch failed"] and not reports.loaded
    finally:
        reads.close()


def test_without_a_claim_the_kernels_end_reports_the_load(ipc):
    """The control: a load launched with no claim open is reported when its kernels finish, no claim_done."""
    reads, reader, reports = ipc
    load = a_load()
    reads.launch(load)
    reader.ends[0].done.set()
    reports.settle(5)
    assert reports.loaded == [load]
