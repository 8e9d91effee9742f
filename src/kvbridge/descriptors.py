"""From a plan's reads and one request's block ids to (source, destination, length) byte descriptors.

Each (layer, block pair) gives the bytes of its head range: contiguous where the layout allows (a head range
of a (block, head)-page layout is one run; heads interleaved per token give one run per token). Then all runs
are sorted and every run that continues the previous one on both sides is merged, so contiguous blocks, and
layers that lie back to back, cost one descriptor: each NIXL descriptor costs about 5 us, whatever its size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import IncompatiblePeerError, RequestParamsError
from kvbridge.memory import LayerKV, WorkerMemory
from kvbridge.plan import Read, TransferPlan
from kvbridge.topology import WorkerRank


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


def check_pair(src: LayerKV, dst: LayerKV) -> None:
    """Raise IncompatiblePeerError if the two layers' pages cannot be copied byte for byte."""
    for field in ("block_size", "row_bytes", "num_planes"):
        if getattr(src, field) != getattr(dst, field):
            raise IncompatiblePeerError(f"layer {src.layer} {field}", getattr(dst, field), getattr(src, field))


def _check_blocks(name: str, blocks: np.ndarray, num_blocks: int) -> None:
    if blocks.size and (blocks.min() < 0 or blocks.max() >= num_blocks):
        bad = blocks[(blocks < 0) | (blocks >= num_blocks)][0]
        raise RequestParamsError(f"{name} block id {int(bad)} is outside [0, {num_blocks})")


def layer_descriptors(
    src: LayerKV,
    dst: LayerKV,
    src_head: int,
    dst_head: int,
    num_heads: int,
    src_blocks: np.ndarray,
    dst_blocks: np.ndarray,
) -> Descriptors:
    """Runs copying heads [src_head, +num_heads) of `src_blocks` into [dst_head, ...) of `dst_blocks`."""
    check_pair(src, dst)
    if not (src_head >= 0 and src_head + num_heads <= src.num_heads):
        raise IncompatiblePeerError(f"layer {src.layer} heads", src.num_heads, (src_head, num_heads))
    if not (dst_head >= 0 and dst_head + num_heads <= dst.num_heads):
        raise IncompatiblePeerError(f"layer {dst.layer} heads", dst.num_heads, (dst_head, num_heads))
    # The logical dims of one block's head range, as (count, source stride, destination stride).
    dims = [
        (src.num_planes, src.plane_stride, dst.plane_stride),
        (num_heads, src.head_stride, dst.head_stride),
        (src.block_size, src.token_stride, dst.token_stride),
    ]
    dims = sorted((d for d in dims if d[0] > 1), key=lambda d: d[1])
    run = src.row_bytes
    loops: list[tuple[int, int, int]] = []
    for count, s_stride, d_stride in dims:
        if not loops and s_stride == run and d_stride == run:
            run *= count
        else:
            loops.append((count, s_stride, d_stride))
    s_off = np.zeros(1, dtype=np.int64)
    d_off = np.zeros(1, dtype=np.int64)
    for count, s_stride, d_stride in loops:
        idx = np.arange(count, dtype=np.int64)
        s_off = (s_off[:, None] + idx * s_stride).ravel()
        d_off = (d_off[:, None] + idx * d_stride).ravel()
    s_base = src.addr + src_head * src.head_stride + src_blocks * src.block_stride
    d_base = dst.addr + dst_head * dst.head_stride + dst_blocks * dst.block_stride
    s_addr = (s_base[:, None] + s_off[None, :]).ravel()
    d_addr = (d_base[:, None] + d_off[None, :]).ravel()
    count = s_addr.size
    return Descriptors(
        s_addr,
        d_addr,
        np.full(count, run, dtype=np.int64),
        np.full(count, src.region, dtype=np.int64),
        np.full(count, dst.region, dtype=np.int64),
    )


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
    s_blocks = np.asarray(src_blocks, dtype=np.int64)
    d_blocks = np.asarray(dst_blocks, dtype=np.int64)
    if s_blocks.shape != d_blocks.shape or s_blocks.ndim != 1:
        raise RequestParamsError(
            f"block lists differ in length: {s_blocks.size} source blocks, {d_blocks.size} destination blocks"
        )
    _check_blocks("source", s_blocks, src.num_blocks)
    _check_blocks("destination", d_blocks, dst.num_blocks)
    head = read.kv_heads[0]
    parts = [
        layer_descriptors(
            src.layer(layer),
            dst.layer(layer),
            head - src_first_head,
            head - dst_first_head,
            read.num_heads,
            s_blocks,
            d_blocks,
        )
        for layer in read.layers
    ]
    out = Descriptors.concat(parts)
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
    heads = plan.geometry.num_kv_heads
    dst_first = plan.decode.kv_heads(heads, decode_worker.tp).start
    grouped: dict[WorkerRank, list[Descriptors]] = {}
    for read in plan.reads_of(decode_worker):
        pw = read.prefill_worker
        src_first = plan.prefill.kv_heads(heads, pw.tp).start
        grouped.setdefault(pw, []).append(
            read_descriptors(read, sources[pw], src_first, dst, dst_first, src_blocks, dst_blocks, False)
        )
    out = {}
    for pw, parts in grouped.items():
        merged = Descriptors.concat(parts)
        out[pw] = merged.coalesced() if coalesce else merged
    return out
