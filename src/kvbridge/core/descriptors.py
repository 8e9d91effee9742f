"""From a plan's reads and one request's block ids to (source, destination, length) byte descriptors.

Each (layer, block pair) gives the bytes of its head range (`kvbridge.core.segments`): contiguous where the layout
allows (a head range of a (block, head)-page layout is one run; heads interleaved per token give one run per
token). Then all runs
are sorted and every run that continues the previous one on both sides is merged, so contiguous blocks, and
layers that lie back to back, cost one descriptor: each NIXL descriptor costs about 5 us, whatever its size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.core.errors import RequestParamsError
from kvbridge.core.memory import WorkerMemory
from kvbridge.core.plan import Read, TransferPlan
from kvbridge.core.segments import Segments, check_blocks, layer_segments, worker_segments
from kvbridge.core.topology import WorkerRank


@dataclass(frozen=True, eq=False)
class Descriptors:
    """Parallel arrays: copy `length[i]` bytes from `src_addr[i]` (in source region `src_region[i]`) to
    `dst_addr[i]` (in destination region `dst_region[i]`)."""

    src_addr: np.ndarray
    dst_addr: np.ndarray
    length: np.ndarray
    src_region: np.ndarray
    dst_region: np.ndarray

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    @classmethod
    def empty(cls) -> Descriptors:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z, z, z)

    @classmethod
    def concat(cls, parts: Sequence[Descriptors]) -> Descriptors:
        if not parts:
            return cls.empty()
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in _FIELDS))

    def coalesced(self) -> Descriptors:
        """Merge runs that continue each other on both sides (same regions), after sorting by source."""
        if len(self) <= 1:
            return self
        order = np.lexsort((self.src_addr, self.src_region))
        s, d, n = self.src_addr[order], self.dst_addr[order], self.length[order]
        sr, dr = self.src_region[order], self.dst_region[order]
        joins = (s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1]) & (sr[1:] == sr[:-1]) & (dr[1:] == dr[:-1])
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        return Descriptors(s[starts], d[starts], np.add.reduceat(n, starts), sr[starts], dr[starts])


_FIELDS = ("src_addr", "dst_addr", "length", "src_region", "dst_region")


def expand(segments: Segments, src_blocks: np.ndarray, dst_blocks: np.ndarray) -> Descriptors:
    """Every run of every block pair (segment-major), uncoalesced."""
    s = np.asarray(src_blocks, dtype=np.int64)
    d = np.asarray(dst_blocks, dtype=np.int64)
    if not (len(segments) and s.size):
        return Descriptors.empty()
    return Descriptors(
        (segments.src_addr[:, None] + segments.src_block_stride[:, None] * s[None, :]).ravel(),
        (segments.dst_addr[:, None] + segments.dst_block_stride[:, None] * d[None, :]).ravel(),
        np.repeat(segments.length, s.size),
        np.repeat(segments.src_region, s.size),
        np.repeat(segments.dst_region, s.size),
    )


def block_lists(
    src_blocks: Sequence[int] | np.ndarray,
    dst_blocks: Sequence[int] | np.ndarray,
    src: WorkerMemory,
    dst: WorkerMemory,
) -> tuple[np.ndarray, np.ndarray]:
    """The two block-id lists as int64 arrays; RequestParamsError unless they pair up and lie in both buffers."""
    s_blocks, d_blocks = _int64(src_blocks), _int64(dst_blocks)
    if s_blocks.shape != d_blocks.shape or s_blocks.ndim != 1:
        raise RequestParamsError(
            f"block lists differ in length: {s_blocks.size} source blocks, {d_blocks.size} destination blocks"
        )
    check_blocks("source", s_blocks, src.num_blocks)
    check_blocks("destination", d_blocks, dst.num_blocks)
    return s_blocks, d_blocks


def _int64(blocks: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block ids as an int64 array (from vLLM's lists: fromiter is about a third faster than asarray)."""
    if isinstance(blocks, np.ndarray):
        return blocks.astype(np.int64, copy=False)
    return np.fromiter(blocks, dtype=np.int64, count=len(blocks))


def read_descriptors(
    read: Read,
    src: WorkerMemory,
    src_first_head: int,
    dst: WorkerMemory,
    dst_first_head: int,
    src_blocks: Sequence[int] | np.ndarray,
    dst_blocks: Sequence[int] | np.ndarray,
    coalesce: bool = True,
) -> Descriptors:
    """Descriptors of one planned read for one request.

    `src_first_head`/`dst_first_head` are the global ids of each worker's local head 0; the block lists pair
    up position by position (the decode side passes only the blocks it is missing, and their sources).
    """
    s_blocks, d_blocks = block_lists(src_blocks, dst_blocks, src, dst)
    head = read.kv_heads[0]
    segments = Segments.concat(
        [
            layer_segments(src.layer(n), dst.layer(n), head - src_first_head, head - dst_first_head, read.num_heads)
            for n in read.layers
        ]
    )
    out = expand(segments, s_blocks, d_blocks)
    return out.coalesced() if coalesce else out


def worker_descriptors(
    plan: TransferPlan,
    decode_worker: WorkerRank,
    dst: WorkerMemory,
    sources: dict[WorkerRank, WorkerMemory],
    src_blocks: Sequence[int] | np.ndarray,
    dst_blocks: Sequence[int] | np.ndarray,
    coalesce: bool = True,
) -> dict[WorkerRank, Descriptors]:
    """Every descriptor one decode worker posts for one request, grouped by the prefill worker it reads."""
    out = {}
    for pw, segments in worker_segments(plan, decode_worker, dst, sources).items():
        s_blocks, d_blocks = block_lists(src_blocks, dst_blocks, sources[pw], dst)
        merged = expand(segments, s_blocks, d_blocks)
        out[pw] = merged.coalesced() if coalesce else merged
    return out
