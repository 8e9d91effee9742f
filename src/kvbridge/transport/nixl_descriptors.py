"""What a NIXL agent is handed and hands back, checked without NIXL itself: memory types (`MemType`), the Nx3
descriptor arrays of a READ checked against their regions (`descriptor_arrays`, `side_array`), a posted READ
(`Transfer`), and the TransferError a NIXL failure becomes (`nixl_error`). The agent is `nixl.NixlTransport`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvbridge.core.descriptors import Descriptors
from kvbridge.core.errors import TransferError
from kvbridge.core.memory import Region, WorkerMemory, region_table

MemType = Literal["DRAM", "VRAM"]


@dataclass(eq=False)
class Transfer:
    """A posted READ: poll it with `NixlTransport.poll` until done, then `release` it."""

    peer: str
    nbytes: int
    num_descriptors: int
    notification: bytes
    posted_at: float
    state: Literal["PROC", "DONE", "RELEASED"] = "PROC"
    _xfer: Any = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.state != "PROC"


def regions_of(memory: WorkerMemory | Sequence[Region]) -> tuple[Region, ...]:
    """The regions of a worker's memory, or the given regions as a tuple."""
    return memory.regions if isinstance(memory, WorkerMemory) else tuple(memory)


def side_array(
    side: str, addrs: np.ndarray, length: np.ndarray, idx: np.ndarray, memory: WorkerMemory | Sequence[Region]
):
    """NIXL's Nx3 array of one side, each descriptor checked to lie in the region it names (a worker's memory
    keeps its regions' table; bare regions get one made here)."""
    regions = regions_of(memory)
    if not regions:
        raise TransferError(f"{side} side has no memory regions")
    start, end, dev = memory.region_table if isinstance(memory, WorkerMemory) else region_table(regions)
    if idx.size and (idx.min() < 0 or idx.max() >= len(regions)):
        bad = int(idx[(idx < 0) | (idx >= len(regions))][0])
        raise TransferError(f"{side} descriptor names region {bad}, but there are {len(regions)} regions")
    outside = (addrs < start[idx]) | (addrs + length > end[idx])
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        raise TransferError(
            f"{side} descriptor {i} [{int(addrs[i]):#x}, +{int(length[i])}) lies outside its region "
            f"{int(idx[i])} [{int(start[idx[i]]):#x}, {int(end[idx[i]]):#x})"
        )
    return np.stack([addrs, length, dev[idx]], axis=1).astype(np.uint64)


def descriptor_arrays(
    descriptors: Descriptors, local: WorkerMemory | Sequence[Region], remote: WorkerMemory | Sequence[Region]
) -> tuple[np.ndarray, np.ndarray]:
    """NIXL's Nx3 (addr, len, device id) arrays for a READ: the local (decode) side is `dst`, the remote
    (prefill) side is `src`. Each descriptor's device id is that of the region it points into, never a rank:
    a worker's rank and its device need not match (CUDA_VISIBLE_DEVICES, several engines per node)."""
    length = descriptors.length.astype(np.int64)
    local_arr = side_array("local", descriptors.dst_addr.astype(np.int64), length, descriptors.dst_region, local)
    remote_arr = side_array("remote", descriptors.src_addr.astype(np.int64), length, descriptors.src_region, remote)
    return local_arr, remote_arr


def nixl_error(what: str, exc: BaseException) -> TransferError:
    return TransferError(f"{what}: {type(exc).__name__}: {exc}")
