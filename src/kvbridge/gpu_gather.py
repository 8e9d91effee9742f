"""Copy one request's KV pages from a peer's buffer into ours with one GPU kernel launch per region pair.

NIXL costs about 5 us per descriptor, and a request whose blocks are scattered needs one descriptor per block and
layer: 3-10 GB/s on NVLink, where the link does 390. This kernel takes the block-independent `Segments` (uploaded
once per peer) and the request's two block-id lists, and every thread block computes its own addresses: program
(i, k) copies run k of block pair i. The host uploads two short id lists and launches; no descriptors, no per-block
host work.

On one node the source tensor is the peer's buffer opened through CUDA IPC (`kvbridge.cuda_ipc`). On CPU tensors
the same kernel runs in Triton's interpreter, which is how the tests check its addressing without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.errors import LayoutError
from kvbridge.memory import Region
from kvbridge.segments import Segments

if TYPE_CHECKING:
    import torch

WORD = 4  # bytes per element the kernel moves (int32); Triton widens aligned runs to 16-byte accesses
MAX_TILE = 4096  # words per loop step of one program: 16 KiB


_COMPILED: dict[bool, object] = {}


def _kernel(interpret: bool):
    if interpret not in _COMPILED:
        from kvbridge.gather_kernel import compiled

        _COMPILED[interpret] = compiled(interpret)
    return _COMPILED[interpret]


@dataclass(frozen=True)
class _Launch:
    """The segments between one source region and one destination region, as a device table in words."""

    src: torch.Tensor  # int32 view of the source region
    dst: torch.Tensor  # int32 view of the destination region
    table: torch.Tensor  # [n, 5] int64: source offset, destination offset, the two block strides, length
    tile: int
    align: int
    even: bool


def _tile(lengths_words: np.ndarray) -> tuple[int, bool]:
    """The loop step: the largest power of two up to MAX_TILE dividing every run (no masks), else MAX_TILE."""
    g = int(np.gcd.reduce(lengths_words))
    tile = min(MAX_TILE, g & -g)
    if tile >= 256:
        return tile, True
    return min(MAX_TILE, 1 << int(lengths_words.max() - 1).bit_length()), False


class GatherKernel:
    """Copies a peer's runs into this worker's memory: built once per peer, `launch` once per request.

    `src_regions`/`dst_regions` are the regions the segments' addresses refer to (the peer's as it published
    them, and ours); `src_tensors`/`dst_tensors` are the same memory as tensors usable here (the peer's opened
    through IPC), any dtype, contiguous. The kernel runs on the source tensors' device.
    """

    def __init__(
        self,
        segments: Segments,
        src_regions: Sequence[Region],
        src_tensors: Sequence[torch.Tensor],
        dst_regions: Sequence[Region],
        dst_tensors: Sequence[torch.Tensor],
    ) -> None:
        import torch

        for name, regions, tensors in (("source", src_regions, src_tensors), ("destination", dst_regions, dst_tensors)):
            if len(regions) != len(tensors):
                raise LayoutError(f"{len(regions)} {name} regions but {len(tensors)} tensors")
            for region, t in zip(regions, tensors, strict=True):
                if t.numel() * t.element_size() < region.nbytes or not t.is_contiguous():
                    raise LayoutError(f"a {name} tensor does not cover its region of {region.nbytes} bytes")
        self.device = src_tensors[0].device if src_tensors else torch.device("cpu")
        self.interpret = self.device.type == "cpu"
        self.block_bytes = segments.block_bytes
        self._launches: list[_Launch] = []
        for sr, dr in sorted(set(zip(segments.src_region.tolist(), segments.dst_region.tolist(), strict=True))):
            pick = (segments.src_region == sr) & (segments.dst_region == dr)
            rows = np.stack(
                [
                    segments.src_addr[pick] - src_regions[sr].addr,
                    segments.dst_addr[pick] - dst_regions[dr].addr,
                    segments.src_block_stride[pick],
                    segments.dst_block_stride[pick],
                    segments.length[pick],
                ],
                axis=1,
            )
            # What the kernel may assume of every address it forms: the runs' offsets and strides, and the bases.
            bits = np.bitwise_or.reduce(rows.ravel(), initial=src_tensors[sr].data_ptr() | dst_tensors[dr].data_ptr())
            aligned = int(bits & -bits) if bits else 4096  # the largest power of two dividing them all
            if aligned < WORD:
                raise LayoutError(f"KV runs are only {aligned}-byte aligned; the GPU path needs {WORD}")
            align = min(4, aligned // WORD)  # in words; 4 words = 16 bytes is all one access can use
            rows //= WORD
            tile, even = _tile(rows[:, 4])
            self._launches.append(
                _Launch(
                    src=_words(src_tensors[sr]),
                    dst=_words(dst_tensors[dr]),
                    table=torch.from_numpy(np.ascontiguousarray(rows)).to(self.device),
                    tile=tile,
                    align=align,
                    even=even,
                )
            )

    def block_ids(self, src_blocks: Sequence[int] | np.ndarray, dst_blocks: Sequence[int] | np.ndarray) -> torch.Tensor:
        """A request's two block-id lists as one int32 tensor on the kernel's device, uploaded once and shared by
        every kernel of the request on that device (the workers of one prefill engine share block ids). Ids must
        already be checked against both buffers (`descriptors.block_lists`)."""
        import torch

        n = len(src_blocks)
        ids = np.empty(2 * n, dtype=np.int32)
        ids[:n], ids[n:] = src_blocks, dst_blocks
        out = torch.from_numpy(ids)
        if self.interpret:
            return out
        return out.pin_memory().to(self.device, non_blocking=True)

    def launch(self, ids: torch.Tensor, stream=None) -> None:
        """Enqueue the copies of every run of every block pair in `ids` (from `block_ids`), on `stream` or the
        current stream of the kernel's device; the caller waits on that stream (an event) for the bytes."""
        import torch

        n = ids.numel() // 2
        if n == 0 or not self._launches:
            return
        kernel = _kernel(self.interpret)
        if self.interpret:
            for lc in self._launches:
                grid = (n, lc.table.shape[0])
                kernel[grid](lc.src, lc.dst, ids, lc.table, n, TILE=lc.tile, ALIGN=lc.align, EVEN=lc.even)
            return
        with torch.cuda.device(self.device), torch.cuda.stream(stream or torch.cuda.current_stream(self.device)):
            for lc in self._launches:
                grid = (n, lc.table.shape[0])
                kernel[grid](lc.src, lc.dst, ids, lc.table, n, TILE=lc.tile, ALIGN=lc.align, EVEN=lc.even, num_warps=8)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words (a view)."""
    import torch

    flat = t.reshape(-1).view(torch.uint8)
    return flat[: flat.numel() // WORD * WORD].view(torch.int32)
