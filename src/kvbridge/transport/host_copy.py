"""Host-memory copies of the staged NIXL path: gather a request's runs into a staging chunk, scatter a chunk back.

Both are the same copy as the GPU gather kernel's (`gpu_gather`): segments (address, block stride, length) and a
block-id list on the KV side, the staging chunk on the other (`core.staging`: pieces of consecutive block pairs of
one segment, back to back). Here each piece is one numpy `take` (gather) or fancy assignment (scatter) over a
strided view of the KV memory, rows of `length` bytes: a C loop of row copies, no per-run Python. A GPU version
swaps these two functions for a kernel launch over the same arguments.

The views are made from raw addresses (the KV memory belongs to vLLM's tensors, the staging buffer to its pool):
callers check every run against registered memory first (`core.staging.runs_inside`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from kvbridge.core.memory import Region
from kvbridge.core.staging import Piece


class HostViews:
    """uint8 views of host memory regions by address (no ownership: the regions must outlive the views)."""

    def __init__(self, regions: Sequence[Region]) -> None:
        self._regions = tuple(regions)
        self._views = [np.ctypeslib.as_array((ctypes.c_uint8 * r.nbytes).from_address(r.addr)) for r in regions]

    def rows(self, addr: int, stride: int, length: int, count: int) -> np.ndarray:
        """A (count, length) view of the rows at `addr + b * stride`, b in [0, count), inside one region."""
        for r, view in zip(self._regions, self._views, strict=True):
            end = addr + (count - 1) * stride + length
            if r.addr <= addr and end <= r.addr + r.nbytes:
                base = view[addr - r.addr :]
                return np.lib.stride_tricks.as_strided(base, shape=(count, length), strides=(stride, 1), writeable=True)
        raise ValueError(f"rows at {addr:#x} (+{count} x {stride}, {length} bytes) lie outside every region")


def gather(
    views: HostViews,
    addr: np.ndarray,
    block_stride: np.ndarray,
    length: np.ndarray,
    blocks: np.ndarray,
    pieces: Sequence[Piece],
    out: np.ndarray,
) -> int:
    """Copy the chunk's `pieces` (runs of segments `addr`/`block_stride`/`length` for `blocks`) into `out`, back
    to back; returns the bytes copied."""
    copied = 0
    top = int(blocks.max()) + 1 if blocks.size else 0
    torch = _torch()
    for p in pieces:
        n = int(length[p.segment])
        rows = views.rows(int(addr[p.segment]), int(block_stride[p.segment]), n, top)
        dst = out[p.offset : p.offset + (p.stop - p.first) * n].reshape(p.stop - p.first, n)
        if torch is not None:  # index_select copies rows 2-6x faster than np.take (bench/nixl_staged.py notes)
            torch.index_select(
                torch.from_numpy(rows), 0, torch.from_numpy(blocks[p.first : p.stop]), out=torch.from_numpy(dst)
            )
        else:
            np.take(rows, blocks[p.first : p.stop], axis=0, out=dst)
        copied += dst.size
    return copied


def warm() -> None:
    """Import what the copies use (torch, where installed) now rather than inside the first chunk's copy: the
    import takes seconds on a loaded host, which a KV channel reader would take for a silent peer
    (`kv_stream_stall_s`). Inside vLLM torch is loaded already."""
    _torch()


def _torch():
    try:
        import torch
    except ImportError:  # numpy alone does it, slower
        return None
    return torch


def scatter(
    views: HostViews,
    addr: np.ndarray,
    block_stride: np.ndarray,
    length: np.ndarray,
    blocks: np.ndarray,
    pieces: Sequence[Piece],
    chunk: np.ndarray,
) -> int:
    """The inverse of `gather`: copy the chunk's pieces from `chunk` to their runs for `blocks`."""
    copied = 0
    top = int(blocks.max()) + 1 if blocks.size else 0
    for p in pieces:
        n = int(length[p.segment])
        rows = views.rows(int(addr[p.segment]), int(block_stride[p.segment]), n, top)
        src = chunk[p.offset : p.offset + (p.stop - p.first) * n].reshape(p.stop - p.first, n)
        rows[blocks[p.first : p.stop]] = src
        copied += src.size
    return copied
