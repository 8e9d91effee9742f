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
from kvbridge.core.memory import Region, WorkerMemory

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


_TABLES: dict[int, tuple[Sequence[Region], tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
"""Region tables by the identity of their regions' tuple (a worker's `WorkerMemory.regions`, the same object for
every READ), each kept with that tuple so that its id cannot be reused while it is here."""
_MAX_TABLES = 64


def _region_table(regions: Sequence[Region]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, device id) of each region, as read-only int64 arrays; made once per sequence of regions."""
    hit = _TABLES.get(id(regions))
    if hit is not None and hit[0] is regions:
        return hit[1]
    addr = np.array([r.addr for r in regions], dtype=np.int64)
    end = addr + np.array([r.nbytes for r in regions], dtype=np.int64)
    dev = np.array([r.device_id for r in regions], dtype=np.int64)
    for a in (addr, end, dev):
        a.flags.writeable = False
    if isinstance(regions, tuple):  # immutable: its table cannot go stale
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        _TABLES[id(regions)] = (regions, (addr, end, dev))
    return addr, end, dev


def side_array(side: str, addrs: np.ndarray, length: np.ndarray, idx: np.ndarray, regions: Sequence[Region]):
    if not regions:
        raise TransferError(f"{side} side has no memory regions")
    start, end, dev = _region_table(regions)
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
    descriptors: Descriptors, local: Sequence[Region], remote: Sequence[Region]
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
