"""Copy one request's KV pages from a peer's buffer into ours with one GPU kernel launch per region pair.

NIXL costs about 5 us per descriptor, and a request whose blocks are scattered needs one descriptor per block and
layer: 3-10 GB/s on NVLink, where the link does 390. This kernel takes the block-independent `Segments` (uploaded
once per peer) and the request's two block-id lists, and every thread block computes its own addresses: program
(i, k) copies run k of block pair i. The host uploads two short id lists and launches; no descriptors, no per-block
host work.

On one node the source tensor is the peer's buffer opened through CUDA IPC (`kvbridge.transport.cuda_ipc`). On CPU
tensors the same kernel runs in Triton's interpreter, which is how the tests check its addressing without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.core.errors import LayoutError
from kvbridge.core.memory import Region
from kvbridge.core.segments import Segments

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

WORD = 4  # bytes per element the kernel moves (int32); Triton widens aligned runs to 16-byte accesses
PROGRAM_BYTES = 32768  # what one program moves per loop step, by default (docs/benchmarks/gpu-one-node.md)
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (the row groups of one launch)
PAIR_PAD = 16  # a request's block pairs are padded to a multiple of this, so no program needs a mask for them


_COMPILED: dict[bool, object] = {}


def _kernel(interpret: bool):
    if interpret not in _COMPILED:
        from kvbridge.transport.gather_kernel import compiled

        _COMPILED[interpret] = compiled(interpret)
    return _COMPILED[interpret]


def _tile(lengths_words: np.ndarray, max_tile: int = PROGRAM_BYTES // WORD) -> tuple[int, bool]:
    """The loop step: the largest power of two up to max_tile dividing every run (no masks) unless that makes
    long runs take many short steps, else a masked step up to max_tile."""
    g = int(np.gcd.reduce(lengths_words))
    tile = min(max_tile, g & -g)
    if tile >= 256 or tile == lengths_words.max():
        return tile, True
    return min(max_tile, 1 << int(lengths_words.max() - 1).bit_length()), False


def _grouping(lengths_words: np.ndarray, tile: int, program_words: int) -> tuple[int, int]:
    """(rows, pairs) per program: powers of two such that one step moves up to `program_words`; rows only when
    every run has one length and their number divides the table (no padding rows), pairs up to PAIR_PAD."""
    rows = 1
    if (lengths_words == lengths_words[0]).all():
        while 2 * rows * tile <= program_words and len(lengths_words) % (2 * rows) == 0:
            rows *= 2
    pairs = 1
    while 2 * pairs * rows * tile <= program_words and 2 * pairs <= PAIR_PAD:
        pairs *= 2
    return rows, pairs


def padded_pairs(n: int) -> int:
    """How many block pairs a request of `n` occupies in the kernel's id list."""
    return -(-n // PAIR_PAD) * PAIR_PAD


def pack_ids(out: np.ndarray, src_blocks, dst_blocks) -> int:
    """Write a request's two block-id lists into `out` (int32, at least 2 * padded_pairs(n) long) as the kernel
    reads them: sources, then destinations, each padded with the last pair (copied twice: the same bytes). Returns
    the padded count, the kernel's `num_pairs`."""
    n = len(src_blocks)
    m = padded_pairs(n)
    out[:n], out[m : m + n] = src_blocks, dst_blocks
    if m > n:
        out[n:m], out[m + n : 2 * m] = out[n - 1], out[m + n - 1]
    return m


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
        program_bytes: int = PROGRAM_BYTES,
        group_runs: bool = True,
        compiled_launcher: bool = True,
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
        self._fast = compiled_launcher
        self._compiled = None  # the compiled kernel, once the JIT entry has launched it
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
        program_words = max(program_bytes // WORD, 1)
        tile, even = _tile(rows[:, 4], program_words)
        group, pairs = _grouping(rows[:, 4], tile, program_words) if group_runs else (1, 1)
        self._args = dict(TILE=tile, ALIGN=align, EVEN=even, BLOCKS=pairs, ROWS=group)
        self._constexprs = (tile, align, even, pairs, group)  # in gather_runs' order, for the compiled launcher
        if not self.interpret:  # at least four words (one 16-byte access) per thread
            self._args["num_warps"] = max(1, min(num_warps, pairs * group * tile // (4 * 32)))
        self._keep = (tuple(src_tensors), tuple(dst_tensors))  # IPC mappings must outlive the kernel
        self._src_words, self._dst_words = _words(src), _words(dst)
        table = torch.from_numpy(np.ascontiguousarray(rows)).to(self.device)
        step = MAX_GRID_Y * group
        self._tables = [table[k : k + step] for k in range(0, len(table), step)]

    def block_ids(self, src_blocks: Sequence[int] | np.ndarray, dst_blocks: Sequence[int] | np.ndarray) -> torch.Tensor:
        """A request's two block-id lists as one int32 tensor on the kernel's device, uploaded once and shared by
        every kernel of the request on that device (the workers of one prefill engine share block ids). Ids must
        already be checked against both buffers (`descriptors.block_lists`)."""
        import torch

        ids = np.empty(2 * padded_pairs(len(src_blocks)), dtype=np.int32)
        pack_ids(ids, src_blocks, dst_blocks)
        out = torch.from_numpy(ids)
        if self.interpret:
            return out
        return out.pin_memory().to(self.device, non_blocking=True)

    def launch(self, ids: torch.Tensor, stream=None) -> None:
        """Enqueue the copies of every run of every block pair in `ids` (from `block_ids` or `pack_ids`), on
        `stream` or the current stream of the kernel's device; the caller waits on that stream (an event) for the
        bytes."""
        import torch

        n = ids.numel() // 2
        if n == 0 or not self._tables:
            return
        if n % PAIR_PAD:  # programs copy whole groups of pairs: unpadded ids would lose the last ones
            raise ValueError(f"{n} block pairs: the ids must be packed by pack_ids (a multiple of {PAIR_PAD})")
        if self._compiled is not None and stream is not None:
            try:
                self._enqueue_compiled(ids, n, stream.cuda_stream)
                return
            except Exception as exc:  # a Triton whose launcher differs: its JIT entry always works
                logger.warning("kvbridge gather kernel: compiled launcher failed (%r); using the JIT entry", exc)
                self._compiled = None
                self._fast = False
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
        pairs, rows = self._args["BLOCKS"], self._args["ROWS"]
        for table in self._tables:
            grid = (n // pairs, table.shape[0] // rows)
            compiled = kernel[grid](self._src_words, self._dst_words, ids, table, n, **self._args)
        if self._fast and not self.interpret:
            self._compiled = compiled  # later launches skip the JIT entry's argument binding and cache lookup

    def _enqueue_compiled(self, ids: torch.Tensor, n: int, stream: int) -> None:
        """Launch through the compiled kernel's own launcher (about 60 us less host work per request than the JIT
        entry). Its runner takes a 3-dimensional grid and every argument in order, constexprs included."""
        pairs, rows = self._args["BLOCKS"], self._args["ROWS"]
        for table in self._tables:
            runner = self._compiled[(n // pairs, table.shape[0] // rows, 1)]
            runner(self._src_words, self._dst_words, ids, table, n, *self._constexprs, stream=stream)

    @property
    def launches(self) -> int:
        """Kernel launches per request (one, unless a peer has more than 65535 runs per block pair)."""
        return len(self._tables)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words (a view)."""
    import torch

    flat = t.reshape(-1).view(torch.uint8)
    return flat[: flat.numel() // WORD * WORD].view(torch.int32)
