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
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.errors import LayoutError
from kvbridge.memory import Region
from kvbridge.segments import Segments

if TYPE_CHECKING:
    import torch

WORD = 4  # bytes per element the kernel moves (int32); Triton widens aligned runs to 16-byte accesses
MAX_TILE = 4096  # words per loop step of one program: 16 KiB
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (the runs of one launch)


_COMPILED: dict[bool, object] = {}


def _kernel(interpret: bool):
    if interpret not in _COMPILED:
        from kvbridge.gather_kernel import compiled

        _COMPILED[interpret] = compiled(interpret)
    return _COMPILED[interpret]


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
        num_warps: int = 8,
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
        self._tables: list[torch.Tensor] = []
        if not len(segments):
            return
        # One launch for every region pair: each run's addresses become word offsets from one base tensor per
        # side (the regions are separate allocations, but all in this process's address space), so vLLM's
        # per-layer tensors cost one launch per peer rather than one per layer.
        sr, dr = segments.src_region, segments.dst_region
        src_ptr = np.array([t.data_ptr() - r.addr for t, r in zip(src_tensors, src_regions, strict=True)], np.int64)
        dst_ptr = np.array([t.data_ptr() - r.addr for t, r in zip(dst_tensors, dst_regions, strict=True)], np.int64)
        src, dst = src_tensors[int(sr[0])], dst_tensors[int(dr[0])]  # the base tensors
        src_base, dst_base = src.data_ptr(), dst.data_ptr()
        rows = np.stack(
            [
                segments.src_addr + src_ptr[sr] - src_base,
                segments.dst_addr + dst_ptr[dr] - dst_base,
                segments.src_block_stride,
                segments.dst_block_stride,
                segments.length,
            ],
            axis=1,
        )
        # What the kernel may assume of every address it forms: the offsets, strides and lengths, and the bases.
        bits = int(np.bitwise_or.reduce(rows.ravel(), initial=src_base | dst_base))
        aligned = bits & -bits if bits else 4096  # the largest power of two dividing them all
        if aligned < WORD:
            raise LayoutError(f"KV runs are only {aligned}-byte aligned; the GPU path needs {WORD}")
        align = min(4, aligned // WORD)  # in words; 4 words = 16 bytes is all one access can use
        rows //= WORD
        tile, even = _tile(rows[:, 4])
        self._args = dict(TILE=tile, ALIGN=align, EVEN=even)
        if not self.interpret:
            self._args["num_warps"] = num_warps
        self._keep = (tuple(src_tensors), tuple(dst_tensors))  # IPC mappings must outlive the kernel
        self._src_words, self._dst_words = _words(src), _words(dst)
        table = torch.from_numpy(np.ascontiguousarray(rows)).to(self.device)
        self._tables = [table[k : k + MAX_GRID_Y] for k in range(0, len(table), MAX_GRID_Y)]

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
        if n == 0 or not self._tables:
            return
        if self.interpret or (
            torch.cuda.current_device() == self.device.index
            and (stream is None or stream == torch.cuda.current_stream())  # as IpcReader binds its thread
        ):
            self._enqueue(ids, n)
            return
        with torch.cuda.device(self.device), torch.cuda.stream(stream or torch.cuda.current_stream(self.device)):
            self._enqueue(ids, n)

    def _enqueue(self, ids: torch.Tensor, n: int) -> None:
        kernel = _kernel(self.interpret)
        for table in self._tables:
            kernel[(n, table.shape[0])](self._src_words, self._dst_words, ids, table, n, **self._args)

    @property
    def launches(self) -> int:
        """Kernel launches per request (one, unless a peer has more than 65535 runs per block pair)."""
        return len(self._tables)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words (a view)."""
    import torch

    flat = t.reshape(-1).view(torch.uint8)
    return flat[: flat.numel() // WORD * WORD].view(torch.int32)
