"""Share a worker's GPU KV buffer with another process on the same node, through CUDA IPC (via PyTorch).

The prefill worker exports one `IpcHandle` per KV region (a few hundred bytes, plain fields, so it can travel in a
msgspec message); a decode worker on the same node opens it as a tensor and lets `kvbridge.transport.gpu_gather`
read it. `open_region(handle, device)` opens the mapping for `device`: the decode worker's own GPU (the kernel
then pulls the pages over NVLink with peer access) or the prefill GPU (the kernel runs there and pushes);
bench/gpu_transfer.py measures both.

Limits: legacy CUDA IPC handles do not cover memory from PyTorch's expandable segments
(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), and PyTorch opens a handle once per process (a second
`open_region` of the same handle returns the first mapping, whatever `device` it asks for).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbridge.core.errors import LayoutError
from kvbridge.core.memory import IpcHandle

if TYPE_CHECKING:
    import torch


def storage_view(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under `tensor` as a flat uint8 tensor (a `kvbridge.transport.torch_memory` region)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def export_region(tensor: torch.Tensor) -> IpcHandle:
    """The handle of a CUDA tensor's memory (the whole tensor is the region)."""
    if tensor.device.type != "cuda":
        raise LayoutError(f"CUDA IPC needs a CUDA tensor, got one on {tensor.device}")
    storage = tensor.untyped_storage()
    dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()
    return IpcHandle(
        device=int(dev),
        handle=bytes(handle),
        storage_bytes=int(size),
        storage_offset=int(offset),
        ref_counter_handle=bytes(rc_handle),
        ref_counter_offset=int(rc_offset),
        event_handle=bytes(ev_handle) if ev_handle else b"",
        event_sync_required=bool(ev_sync),
        region_offset=tensor.data_ptr() - storage.data_ptr(),
        region_bytes=tensor.numel() * tensor.element_size(),
    )


def open_region(handle: IpcHandle, device: int) -> torch.Tensor:
    """The exported region as a uint8 tensor in this process, mapped for CUDA device `device` (this process's
    numbering)."""
    import torch

    storage = torch.UntypedStorage._new_shared_cuda(
        device,
        handle.handle,
        handle.storage_bytes,
        handle.storage_offset,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle,
        handle.event_sync_required,
    )
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage)
    return flat[handle.region_offset : handle.region_offset + handle.region_bytes]
