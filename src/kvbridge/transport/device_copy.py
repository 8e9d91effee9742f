"""Torch copies of the staged NIXL path, for KV in GPU memory: gather a request's runs into a staging chunk in VRAM,
scatter a chunk back into the KV blocks.

The same arguments and the same stream layout as `host_copy` (segments, a block-id list, the chunk's pieces from
`core.staging`); here each piece is one `index_select` (gather) or `index_copy_` (scatter) over a strided view of a
KV region, rows of `length` bytes moved as 8-, 4- or 2-byte words where every address, stride and length allows.
A chunk's copies run on the views' own CUDA stream and are synchronized before the call returns, so a NIXL READ
posted next sees the bytes (gather), and the slot can be reused and the load reported (scatter). On CPU tensors
the same code runs without a stream (the unit tests).

The KV regions are given as tensors (`torch_memory.region_tensors`): a GPU address cannot be viewed without the
tensor that owns it. Callers check every run against registered memory first (`core.staging.runs_inside`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.core.memory import Region
from kvbridge.core.staging import Piece

if TYPE_CHECKING:
    import torch

_WORDS = (8, 4, 2, 1)


class DeviceViews:
    """Strided views of memory regions held by tensors (no ownership: the tensors must outlive the views)."""

    def __init__(self, regions: Sequence[Region], tensors: Sequence[torch.Tensor]) -> None:
        import torch

        if len(regions) != len(tensors):
            raise ValueError(f"{len(regions)} regions but {len(tensors)} tensors")
        self._regions = tuple(regions)
        self._flat = []
        for r, t in zip(regions, tensors, strict=True):
            flat = t.reshape(-1).view(torch.uint8)
            if flat.data_ptr() != r.addr or flat.numel() < r.nbytes:
                raise ValueError(f"a tensor at {flat.data_ptr():#x} does not hold the region at {r.addr:#x}")
            self._flat.append(flat[: r.nbytes])
        self.device = self._flat[0].device if self._flat else torch.device("cpu")
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._words: dict[tuple[int, int], torch.Tensor] = {}  # (region, word) -> that region as words

    def _as_words(self, index: int, word: int) -> torch.Tensor:

        key = (index, word)
        if key not in self._words:
            flat = self._flat[index]
            self._words[key] = flat[: flat.numel() // word * word].view(_dtype(word))
        return self._words[key]

    def rows(self, addr: int, stride: int, length: int, count: int, word: int = 1) -> torch.Tensor:
        """A (count, length / word) view of the rows at `addr + b * stride`, b in [0, count), inside one region."""
        end = addr + (count - 1) * stride + length
        for i, r in enumerate(self._regions):
            if r.addr <= addr and end <= r.addr + r.nbytes:
                base = self._as_words(i, word)
                offset = base.storage_offset() + (addr - r.addr) // word
                return base.as_strided((count, length // word), (stride // word, 1), offset)
        raise ValueError(f"rows at {addr:#x} (+{count} x {stride}, {length} bytes) lie outside every region")

    def ids(self, blocks: np.ndarray) -> torch.Tensor:
        """A block-id list on the views' device (one upload per chunk)."""
        import torch

        ids = torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.int64))
        return ids if self.device.type == "cpu" else ids.to(self.device, non_blocking=False)

    def word(self, addr: np.ndarray, block_stride: np.ndarray, length: np.ndarray, chunk: torch.Tensor) -> int:
        """The widest word every run, stride, region and the chunk is aligned to."""
        bits = int(np.bitwise_or.reduce(np.concatenate([addr, block_stride, length]), initial=chunk.data_ptr()))
        bits |= 0 if not self._regions else int(np.bitwise_or.reduce([r.addr for r in self._regions]))
        return next(w for w in _WORDS if bits % w == 0)


def gather(
    views: DeviceViews,
    addr: np.ndarray,
    block_stride: np.ndarray,
    length: np.ndarray,
    blocks: np.ndarray,
    pieces: Sequence[Piece],
    out: torch.Tensor,
) -> int:
    """Copy the chunk's `pieces` (runs of segments `addr`/`block_stride`/`length` for `blocks`) into `out` (a uint8
    tensor on the views' device), back to back, and wait for the copies; returns the bytes copied."""
    import torch

    def copy(rows: torch.Tensor, ids: torch.Tensor, part: torch.Tensor) -> None:
        torch.index_select(rows, 0, ids, out=part)

    return _each_piece(views, addr, block_stride, length, blocks, pieces, out, copy)


def scatter(
    views: DeviceViews,
    addr: np.ndarray,
    block_stride: np.ndarray,
    length: np.ndarray,
    blocks: np.ndarray,
    pieces: Sequence[Piece],
    chunk: torch.Tensor,
) -> int:
    """The inverse of `gather`: copy the chunk's pieces from `chunk` to their runs for `blocks`, and wait."""

    def copy(rows: torch.Tensor, ids: torch.Tensor, part: torch.Tensor) -> None:
        rows.index_copy_(0, ids, part)

    return _each_piece(views, addr, block_stride, length, blocks, pieces, chunk, copy)


def _each_piece(views, addr, block_stride, length, blocks, pieces, chunk, copy) -> int:
    """`copy(KV rows, the piece's block ids, the piece's rows of the chunk)` for every piece, on the views' stream,
    then wait for the copies; returns the bytes copied."""
    copied = 0
    top = int(blocks.max()) + 1 if blocks.size else 0
    word = views.word(addr, block_stride, length, chunk)
    with _on(views):
        ids = views.ids(blocks)
        for p in pieces:
            n = int(length[p.segment])
            rows = views.rows(int(addr[p.segment]), int(block_stride[p.segment]), n, top, word)
            part = (
                chunk[p.offset : p.offset + (p.stop - p.first) * n].view(_dtype(word)).view(p.stop - p.first, n // word)
            )
            copy(rows, ids[p.first : p.stop], part)
            copied += (p.stop - p.first) * n
        _wait(views)
    return copied


def _dtype(word: int) -> torch.dtype:
    """The integer dtype of a `word`-byte word."""
    import torch

    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]


def _on(views: DeviceViews):
    """The views' stream as the current one (CUDA), or nothing (CPU)."""
    import torch

    return torch.cuda.stream(views.stream) if views.stream is not None else contextlib.nullcontext()


def _wait(views: DeviceViews) -> None:
    if views.stream is not None:
        views.stream.synchronize()


def staging_buffer(nbytes: int, like: torch.Tensor) -> tuple[torch.Tensor, Region]:
    """A zeroed uint8 staging buffer on `like`'s device, and its region (the caller registers it)."""
    import torch

    buffer = torch.zeros(nbytes, dtype=torch.uint8, device=like.device)
    device = like.device.index if like.device.type == "cuda" else 0
    return buffer, Region(buffer.data_ptr(), nbytes, device or 0)
