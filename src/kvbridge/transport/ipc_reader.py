"""A decode worker's same-host GPU path: read a prefill engine's KV through CUDA IPC with one kernel per worker.

Per prefill engine, once: open every worker's exported regions (`kvbridge.transport.cuda_ipc`) for this worker's GPU,
and build a `GatherKernel` from the plan's segments. Per request: upload the two block-id lists, launch, record a
blocking-sync event; the decode worker's waiter thread sleeps on it, then the prefill workers are told over the
side channel.
The kernel runs on this worker's GPU and pulls the pages over NVLink (peer access, enabled lazily by the IPC
mapping), so the prefill GPU runs nothing and this process makes no context on it.

Anything that fails while connecting (handles missing, another host, expandable segments, no peer access) makes
`connect` raise; the decode worker then reads that engine through NIXL.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.core.errors import TransferError
from kvbridge.core.memory import WorkerMemory
from kvbridge.core.plan import TransferPlan
from kvbridge.core.segments import worker_segments
from kvbridge.core.topology import WorkerRank
from kvbridge.transport.cuda_ipc import IpcHandle, open_region
from kvbridge.transport.gpu_gather import GatherKernel, pack_ids, padded_pairs

if TYPE_CHECKING:
    import torch


class IpcReader:
    """The GPU side of one decode worker: its KV regions as tensors, one CUDA stream for its copies, and a small
    ring of pinned buffers for the requests' block ids."""

    RING = 8  # requests whose id uploads may be in flight at once; a ninth waits for the first

    def __init__(self, memory: WorkerMemory, regions: Sequence[torch.Tensor]) -> None:
        import torch

        if not regions or regions[0].device.type != "cuda":
            raise TransferError("the CUDA IPC path needs this worker's KV in GPU memory")
        self.memory = memory
        self.regions = tuple(regions)
        self.device = regions[0].device
        self.stream = torch.cuda.Stream(self.device)
        self._ring: list[_IdBuffer | None] = [None] * self.RING
        self._next = 0
        self._bound = threading.local()

    def connect(
        self,
        plan: TransferPlan,
        rank: WorkerRank,
        peers: dict[WorkerRank, tuple[WorkerMemory, Sequence[IpcHandle]]],
    ) -> dict[WorkerRank, GatherKernel]:
        """Kernels for every prefill worker this worker reads from; TransferError if any handle cannot be used."""
        sources = {pw: mem for pw, (mem, _) in peers.items()}
        kernels = {}
        for pw, segments in worker_segments(plan, rank, self.memory, sources).items():
            memory, handles = peers[pw]
            if len(handles) != len(memory.regions):
                raise TransferError(
                    f"prefill worker {pw} shares {len(handles)} CUDA IPC handles for {len(memory.regions)} regions"
                )
            try:
                tensors = [open_region(h, self.device.index) for h in handles]
            except Exception as exc:  # a CUDA or PyTorch error: this engine is read through NIXL
                raise TransferError(f"cannot open prefill worker {pw}'s CUDA IPC handles: {exc}") from exc
            kernels[pw] = GatherKernel(segments, memory.regions, tensors, self.memory.regions, self.regions)
        return kernels

    def launch(
        self, kernels: dict[WorkerRank, GatherKernel], remote_blocks: np.ndarray, local_blocks: np.ndarray
    ) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Enqueue one request's copies from every worker in `kernels` (block ids already checked); returns two
        events around them on the stream: `end` completes with the copies (blocking sync: a waiting thread sleeps
        rather than spins on a core) and `start.elapsed_time(end)` is the copies' time on the GPU."""
        import torch

        if not getattr(self._bound, "done", False):
            # Once per calling thread (both are thread-local): Triton launches on the current device and stream,
            # and entering torch's context managers per request costs more than the launch itself.
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.stream)
            self._bound.done = True
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True, blocking=True)
        start.record(self.stream)
        if kernels:
            ids = self._upload(remote_blocks, local_blocks)
            for kernel in kernels.values():
                kernel.launch(ids, self.stream)
        end.record(self.stream)
        return start, end

    def _upload(self, remote_blocks: np.ndarray, local_blocks: np.ndarray) -> torch.Tensor:
        """The two id lists in one int32 device tensor, through the next pinned buffer of the ring."""
        slot = self._next % self.RING
        self._next += 1
        size = 2 * padded_pairs(len(remote_blocks))
        buf = self._ring[slot]
        if buf is None or buf.capacity < size:
            buf = self._ring[slot] = _IdBuffer(max(size, 4096), self.device)
        else:
            buf.uploaded.synchronize()  # its last upload must have left the pinned memory (done, but for a backlog)
        pack_ids(buf.host, remote_blocks, local_blocks)
        ids = buf.device[:size]
        ids.copy_(buf.pinned[:size], non_blocking=True)
        buf.uploaded.record(self.stream)
        return ids


class _IdBuffer:
    """Pinned host memory and device memory for one request's block ids. The device copy is reused by later
    requests on the same stream, so after this request's kernels (stream order)."""

    def __init__(self, capacity: int, device) -> None:
        import torch

        self.capacity = capacity
        self.pinned = torch.empty(capacity, dtype=torch.int32, pin_memory=True)
        self.host = self.pinned.numpy()
        self.device = torch.empty(capacity, dtype=torch.int32, device=device)
        self.uploaded = torch.cuda.Event()  # after its last host-to-device copy (never recorded: no wait)
