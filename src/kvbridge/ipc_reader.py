"""A decode worker's same-host GPU path: read a prefill engine's KV through CUDA IPC with one kernel per worker.

Per prefill engine, once: open every worker's exported regions (`kvbridge.cuda_ipc`) for this worker's GPU, and
build a `GatherKernel` from the plan's segments. Per request: upload the two block-id lists, launch, record a
blocking-sync event; the decode worker's waiter thread sleeps on it, then the prefill workers are told over the
side channel.
The kernel runs on this worker's GPU and pulls the pages over NVLink (peer access, enabled lazily by the IPC
mapping), so the prefill GPU runs nothing and this process makes no context on it.

Anything that fails while connecting (handles missing, another host, expandable segments, no peer access) makes
`connect` raise; the decode worker then reads that engine through NIXL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvbridge.cuda_ipc import IpcHandle, open_region
from kvbridge.errors import TransferError
from kvbridge.gpu_gather import GatherKernel
from kvbridge.memory import WorkerMemory
from kvbridge.plan import TransferPlan
from kvbridge.segments import worker_segments
from kvbridge.topology import WorkerRank

if TYPE_CHECKING:
    import torch


class IpcReader:
    """The GPU side of one decode worker: its KV regions as tensors and one CUDA stream for its copies."""

    def __init__(self, memory: WorkerMemory, regions: Sequence[torch.Tensor]) -> None:
        import torch

        if not regions or regions[0].device.type != "cuda":
            raise TransferError("the CUDA IPC path needs this worker's KV in GPU memory")
        self.memory = memory
        self.regions = tuple(regions)
        self.device = regions[0].device
        self.stream = torch.cuda.Stream(self.device)

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
        self, kernels: dict[WorkerRank, GatherKernel], remote_blocks: Sequence[int], local_blocks: Sequence[int]
    ) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Enqueue one request's copies from every worker in `kernels`; returns two events around them on the
        stream: `end` completes with the copies (blocking sync: a waiting thread sleeps rather than spins on a core)
        and `start.elapsed_time(end)` is the copies' time on the GPU."""
        import torch

        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True, blocking=True)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            start.record(self.stream)
            if kernels:
                first = next(iter(kernels.values()))
                ids = first.block_ids(remote_blocks, local_blocks)
                for kernel in kernels.values():
                    kernel.launch(ids, self.stream)
            end.record(self.stream)
        return start, end
