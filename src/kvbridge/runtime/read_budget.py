"""How long a decode worker's load may take: `transfer_timeout_s` plus the time its bytes, and those queued before
them, need at a floor rate (`ReadBudget`)."""

from __future__ import annotations

import threading

from kvbridge.core.config import BridgeConfig
from kvbridge.core.leases import MAX_READ_S
from kvbridge.core.memory import WorkerMemory
from kvbridge.runtime.load import LoadJob

FLOOR_BYTES_PER_S = 0.1e9
"""The slowest rate a load's bytes are assumed to move at when its deadline is set: below the 0.2-0.5 GB/s that
UCX's software emulation of GPU memory reaches on one GPU (docs/benchmarks/gpu-worker-runtime.md), so that a slow
transport gives slow loads, not failed ones."""

MAX_EXTRA_S = 300.0
"""The most a load's bytes add to `transfer_timeout_s` (a stuck load still fails in bounded time)."""


def block_bytes(memory: WorkerMemory) -> int:
    """Bytes one block carries into this worker (every layer, plane and head it holds)."""
    return sum(layer.page_bytes for layer in memory.layers)


class ReadBudget:
    """How long a load may take: `transfer_timeout_s` plus the bytes in flight at this worker when it is queued
    (its own and those of the loads queued before it and not yet reported, which share the link) at
    `floor_bytes_per_s`, the extra capped at `max_extra_s` and the whole at the prefill side's longest pin
    (`core.leases.MAX_READ_S`). The claim's `read_timeout_s` is what is left of it, so the prefill side pins the
    request as long. Thread-safe; `end` for every job `begin` counted (unknown jobs are ignored)."""

    def __init__(
        self,
        config: BridgeConfig,
        bytes_per_block: int,
        floor_bytes_per_s: float = FLOOR_BYTES_PER_S,
        max_extra_s: float = MAX_EXTRA_S,
    ) -> None:
        self.config = config
        self.bytes_per_block = bytes_per_block
        self.floor_bytes_per_s = floor_bytes_per_s
        self.max_extra_s = max_extra_s
        self._lock = threading.Lock()
        self._bytes: dict[int, int] = {}  # id(job) -> bytes, for jobs queued and not yet reported
        self._total = 0

    def seconds(self, nbytes: int) -> float:
        """The budget of a load when `nbytes` are in flight, its own included."""
        extra = min(nbytes / self.floor_bytes_per_s, self.max_extra_s) if self.floor_bytes_per_s > 0 else 0.0
        return min(self.config.transfer_timeout_s + extra, MAX_READ_S)

    def begin(self, job: LoadJob) -> float:
        """Count a job that will be read (`LoadJob.reads`) and has blocks; returns its budget in seconds."""
        nbytes = job.num_blocks * self.bytes_per_block
        if not (job.reads and nbytes):
            return self.config.transfer_timeout_s
        with self._lock:
            self._total += nbytes
            self._bytes[id(job)] = nbytes
            in_flight = self._total
        return self.seconds(in_flight)

    def end(self, job: LoadJob) -> None:
        with self._lock:
            self._total -= self._bytes.pop(id(job), 0)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._total
