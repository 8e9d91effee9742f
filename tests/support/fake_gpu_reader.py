"""A fake `IpcReader` for the CUDA IPC path's tests on CPU: its kernels end when the test says.

`FakeReader.launch` returns (start, end) events like the real reader's; `end.synchronize` blocks until the test
sets `end.done` (`reader.ends` in launch order); the kernels' GPU time is 0.5 ms. `fail=True`: every launch
raises, as a failed launch does."""

from __future__ import annotations

import threading
from types import SimpleNamespace


class FakeKernels:
    """A launch's event: `synchronize` waits until the test finishes the kernels (`done.set()`)."""

    GPU_MS = 0.5

    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize(self) -> None:
        self.done.wait(30)

    def elapsed_time(self, end) -> float:
        return self.GPU_MS


class FakeReader:
    stream = SimpleNamespace(synchronize=lambda: None)

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.ends: list[FakeKernels] = []
        self.launched = threading.Event()  # set at the first launch

    def launch(self, live, remote, local):
        if self.fail:
            raise RuntimeError("launch failed")
        end = FakeKernels()
        self.ends.append(end)
        self.launched.set()
        return FakeKernels(), end
