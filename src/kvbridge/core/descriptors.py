"""From a plan's reads and one request's block ids to (source, destination, length) byte descriptors.

Each (layer, block pair) gives the bytes of its head range (`kvbridge.core.segments`): contiguous where the layout
allows (a head range of a (block, head)-page layout is one run; heads interleaved per token give one run per
token). Then all runs
are sorted and every run that continues the previous one on both sides is merged, so contiguous blocks, and
layers that lie back to back, cost one descriptor: each NIXL descriptor costs about 5 us, whatever its size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.core.arrays import ParallelArrays
from kvbridge.core.errors import RequestParamsError
from kvbridge.core.memory import WorkerMemory
from kvbridge.core.plan import Read, TransferPlan
from kvbridge.core.segments import Segments, check_blocks, layer_segments, worker_segments
from kvbridge.core.topology import WorkerRank


@dataclass(frozen=True, eq=False)
class Descriptors(ParallelArrays):
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
    """Every descriptor one decode worker posts for one request of a one-group model, grouped by the prefill
    worker it reads (`group_descriptors` with one list on each side)."""
    return group_descriptors(plan, decode_worker, dst, sources, (src_blocks,), (dst_blocks,), coalesce)


def group_descriptors(
    plan: TransferPlan,
    decode_worker: WorkerRank,
    dst: WorkerMemory,
    sources: dict[WorkerRank, WorkerMemory],
    src_groups: Sequence[Sequence[int] | np.ndarray],
    dst_groups: Sequence[Sequence[int] | np.ndarray],
    coalesce: bool = True,
    group_segments: Callable[[int | None], dict[WorkerRank, Segments]] | None = None,
) -> dict[WorkerRank, Descriptors]:
    """Every descriptor one decode worker posts for one request, grouped by the prefill worker it reads (plan
    order): per KV-cache group g, the segments of g's layers times the pairs (`src_groups[g][i]`,
    `dst_groups[g][i]`). A block id is only ever paired with its own group's layers (`core.groups`).
    RequestParamsError unless there is one list per group of `dst` on each side. `group_segments(g)`:
    `worker_segments` of group g (asked with None for an engine of one group), where the caller keeps them from
    one request to the next; made here if not given."""
    groups = dst.num_groups
    if len(src_groups) != groups or len(dst_groups) != groups:
        raise RequestParamsError(
            f"{len(src_groups)} source and {len(dst_groups)} destination block lists for {groups} KV-cache groups"
        )
    parts: dict[WorkerRank, list[Descriptors]] = {}
    for group, (s, d) in enumerate(zip(src_groups, dst_groups, strict=True)):
        key = group if groups > 1 else None
        if group_segments is not None:
            segments_of = group_segments(key)
        else:
            segments_of = worker_segments(plan, decode_worker, dst, sources, group=key)
        for pw, segments in segments_of.items():  # every peer read, in plan order (the same for every group)
            s_blocks, d_blocks = block_lists(s, d, sources[pw], dst)
            parts.setdefault(pw, []).append(expand(segments, s_blocks, d_blocks))
    out = {}
    for pw, got in parts.items():
        merged = got[0] if len(got) == 1 else Descriptors.concat(got)
        out[pw] = merged.coalesced() if coalesce else merged
    return out


MAX_PREPARED_ENTRIES = 1 << 26
"""The largest side of a prepared table kvbridge asks NIXL to prepare (about 64 M entries; NIXL indexes with int32)."""


@dataclass(frozen=True, eq=False)
class PreparedTable:
    """Every run the segments can name, for every block of each side, listed once so that a transport can prepare
    both lists once per peer and name a request's runs by index.

    Source entry `k * src_num_blocks + b` is run k of source block b (`length[k]` bytes at `src_addr[k] +
    b * src_block_stride[k]`), and likewise for the destination; `indices` gives a request's pairs of entries in
    `expand`'s order (segment-major), so the two lists, taken at those indices, are `expand`'s descriptors.
    """

    segments: Segments
    src_num_blocks: int
    dst_num_blocks: int

    def __post_init__(self) -> None:
        if self.src_num_blocks <= 0 or self.dst_num_blocks <= 0:
            raise ValueError(
                f"a prepared table needs blocks on both sides, got {self.src_num_blocks}, {self.dst_num_blocks}"
            )
        if not len(self.segments):
            raise ValueError("a prepared table needs at least one segment")
        if max(self.src_entries, self.dst_entries) > MAX_PREPARED_ENTRIES:
            raise ValueError(
                f"a prepared table of {len(self.segments)} segments x {max(self.src_num_blocks, self.dst_num_blocks)}"
                f" blocks exceeds {MAX_PREPARED_ENTRIES} entries"
            )

    @property
    def src_entries(self) -> int:
        return len(self.segments) * self.src_num_blocks

    @property
    def dst_entries(self) -> int:
        return len(self.segments) * self.dst_num_blocks

    def src_side(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(address, length, region) of every source entry."""
        s = self.segments
        return _side(s.src_addr, s.src_block_stride, s.length, s.src_region, self.src_num_blocks)

    def dst_side(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(address, length, region) of every destination entry."""
        s = self.segments
        return _side(s.dst_addr, s.dst_block_stride, s.length, s.dst_region, self.dst_num_blocks)

    def indices(
        self, src_blocks: Sequence[int] | np.ndarray, dst_blocks: Sequence[int] | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The (source, destination) int32 entry indices of one request's runs; RequestParamsError unless the
        block lists pair up and lie in the tables."""
        s_blocks, d_blocks = _int64(src_blocks), _int64(dst_blocks)
        if s_blocks.shape != d_blocks.shape or s_blocks.ndim != 1:
            raise RequestParamsError(
                f"block lists differ in length: {s_blocks.size} source blocks, {d_blocks.size} destination blocks"
            )
        check_blocks("source", s_blocks, self.src_num_blocks)
        check_blocks("destination", d_blocks, self.dst_num_blocks)
        k = np.arange(len(self.segments), dtype=np.int64)[:, None]
        src = (k * self.src_num_blocks + s_blocks[None, :]).ravel().astype(np.int32)
        dst = (k * self.dst_num_blocks + d_blocks[None, :]).ravel().astype(np.int32)
        return src, dst

    def nbytes(self, num_pairs: int) -> int:
        """Bytes a request of `num_pairs` block pairs moves."""
        return self.segments.block_bytes * num_pairs


def _side(addr, block_stride, length, region, num_blocks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    b = np.arange(num_blocks, dtype=np.int64)[None, :]
    return (
        (addr[:, None] + block_stride[:, None] * b).ravel(),
        np.repeat(length, num_blocks),
        np.repeat(region, num_blocks),
    )


def block_runs(src_blocks: np.ndarray, dst_blocks: np.ndarray) -> int:
    """How many runs of consecutive block pairs (both ids one more than the previous pair's) a request has."""
    s, d = _int64(src_blocks), _int64(dst_blocks)
    if not s.size:
        return 0
    return 1 + int(np.count_nonzero((np.diff(s) != 1) | (np.diff(d) != 1)))


def prefer_prepared(segments: Segments, src_blocks: np.ndarray, dst_blocks: np.ndarray, factor: int = 4) -> bool:
    """Whether a request should name its runs in a prepared table rather than post coalesced descriptors: a
    prepared table names every run of every block (no merging), so where consecutive blocks lie back to back on
    both sides (runs of whole blocks) coalescing posts `factor` times fewer descriptors or more, and wins.

    An estimate that reads only the block ids: each run of consecutive blocks coalesces into one descriptor per
    segment only if that segment's run is its whole block (length == block stride on both sides)."""
    n = len(src_blocks)
    if not n or not len(segments):
        return False
    whole = (segments.length == segments.src_block_stride) & (segments.length == segments.dst_block_stride)
    runs = block_runs(src_blocks, dst_blocks)
    coalesced = int(np.count_nonzero(whole)) * runs + int(np.count_nonzero(~whole)) * n
    return coalesced * factor > len(segments) * n
