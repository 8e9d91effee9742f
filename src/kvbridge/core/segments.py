"""A read with the request left out: the byte runs of one block pair, as (address, block stride, length).

Every byte a decode worker reads for a request is `run k of block pair i`: `length[k]` bytes from
`src_addr[k] + src_block[i] * src_block_stride[k]` to `dst_addr[k] + dst_block[i] * dst_block_stride[k]`.
The segments depend only on the two workers' memory and the plan, so they are computed once per peer; a request
adds only its two block-id lists. `kvbridge.core.descriptors.expand` turns them into explicit descriptors (for
NIXL); a GPU kernel can take the segments and the block ids as they are and compute every address itself, so the
host does no per-block work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbridge.core.arrays import ParallelArrays
from kvbridge.core.errors import IncompatiblePeerError, RequestParamsError
from kvbridge.core.memory import LayerKV, WorkerMemory
from kvbridge.core.plan import TransferPlan
from kvbridge.core.topology import WorkerRank


@dataclass(frozen=True, eq=False)
class Segments(ParallelArrays):
    """Parallel int64 arrays, one entry per run of a block pair (see the module docstring)."""

    src_addr: np.ndarray
    dst_addr: np.ndarray
    src_block_stride: np.ndarray
    dst_block_stride: np.ndarray
    length: np.ndarray
    src_region: np.ndarray
    dst_region: np.ndarray

    def __len__(self) -> int:
        return len(self.length)

    @property
    def block_bytes(self) -> int:
        """Bytes moved per block pair."""
        return int(self.length.sum())


def check_pair(src: LayerKV, dst: LayerKV) -> None:
    """Raise IncompatiblePeerError if the two layers' pages cannot be copied byte for byte."""
    for field in ("block_size", "row_bytes", "num_planes"):
        if getattr(src, field) != getattr(dst, field):
            raise IncompatiblePeerError(f"layer {src.layer} {field}", getattr(dst, field), getattr(src, field))


def layer_segments(src: LayerKV, dst: LayerKV, src_head: int, dst_head: int, num_heads: int) -> Segments:
    """Runs copying heads [src_head, +num_heads) of a source block into [dst_head, ...) of a destination block:
    one run where the layout keeps that head range together, else one per plane, head or token."""
    check_pair(src, dst)
    if not (src_head >= 0 and src_head + num_heads <= src.num_heads):
        raise IncompatiblePeerError(f"layer {src.layer} heads", src.num_heads, (src_head, num_heads))
    if not (dst_head >= 0 and dst_head + num_heads <= dst.num_heads):
        raise IncompatiblePeerError(f"layer {dst.layer} heads", dst.num_heads, (dst_head, num_heads))
    # The logical dims of one block's head range, as (count, source stride, destination stride), innermost first.
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
            run *= count  # this dim continues the run on both sides
        else:
            loops.append((count, s_stride, d_stride))
    s_off = np.zeros(1, dtype=np.int64)
    d_off = np.zeros(1, dtype=np.int64)
    for count, s_stride, d_stride in loops:
        idx = np.arange(count, dtype=np.int64)
        s_off = (s_off[:, None] + idx * s_stride).ravel()
        d_off = (d_off[:, None] + idx * d_stride).ravel()
    n = s_off.size
    return Segments(
        src.addr + src_head * src.head_stride + s_off,
        dst.addr + dst_head * dst.head_stride + d_off,
        np.full(n, src.block_stride, dtype=np.int64),
        np.full(n, dst.block_stride, dtype=np.int64),
        np.full(n, run, dtype=np.int64),
        np.full(n, src.region, dtype=np.int64),
        np.full(n, dst.region, dtype=np.int64),
    )


def check_blocks(name: str, blocks: np.ndarray, num_blocks: int) -> None:
    """Raise RequestParamsError unless every block id is in [0, num_blocks)."""
    if blocks.size and (blocks.min() < 0 or blocks.max() >= num_blocks):
        bad = blocks[(blocks < 0) | (blocks >= num_blocks)][0]
        raise RequestParamsError(f"{name} block id {int(bad)} is outside [0, {num_blocks})")


def worker_segments(
    plan: TransferPlan,
    decode_worker: WorkerRank,
    dst: WorkerMemory,
    sources: dict[WorkerRank, WorkerMemory],
    group: int | None = None,
) -> dict[WorkerRank, Segments]:
    """Every segment one decode worker copies, grouped by the prefill worker it reads (plan order); with `group`,
    only those of the layers of that KV-cache group (IncompatiblePeerError if the peer's layer is in another).

    A state layer (Mamba) is no KV heads but one TP rank's state: its page is copied whole, once, from the prefill
    worker of the same TP rank (`state_segments`)."""
    heads = plan.geometry.num_kv_heads
    dst_first = plan.decode.kv_heads(heads, decode_worker.tp).start
    grouped: dict[WorkerRank, list[Segments]] = {}
    state = {lk.layer for lk in dst.layers if lk.state}
    reads = plan.reads_of(decode_worker)
    if state:
        reads = state_reads(plan, decode_worker, dst, sources, group, grouped)
    for read in reads:
        pw = read.prefill_worker
        src_first = plan.prefill.kv_heads(heads, pw.tp).start
        head = read.kv_heads[0]
        layers = read.layers
        if group is not None:
            layers = tuple(n for n in layers if dst.layer(n).group == group)
            for n in layers:
                if sources[pw].layer(n).group != group:
                    raise IncompatiblePeerError(f"layer {n} KV-cache group", group, sources[pw].layer(n).group)
        parts = grouped.setdefault(pw, [])
        parts.extend(
            layer_segments(
                sources[pw].layer(layer), dst.layer(layer), head - src_first, head - dst_first, read.num_heads
            )
            for layer in layers
        )
    return {pw: Segments.concat(parts) for pw, parts in grouped.items()}


def state_reads(
    plan: TransferPlan,
    decode_worker: WorkerRank,
    dst: WorkerMemory,
    sources: dict[WorkerRank, WorkerMemory],
    group: int | None,
    grouped: dict[WorkerRank, list[Segments]],
) -> tuple:
    """The plan's reads of `decode_worker` without its state layers, whose whole pages are put in `grouped` first
    (each under the read of the same TP rank that holds it; every prefill worker read keeps its place in plan order).
    IncompatiblePeerError unless both sides have equal TP sizes and every state layer has such a read."""
    from dataclasses import replace

    state = {lk.layer for lk in dst.layers if lk.state}
    if plan.prefill.tp != plan.decode.tp:
        raise IncompatiblePeerError("tp (Mamba state layers)", plan.decode.tp, plan.prefill.tp)
    reads = plan.reads_of(decode_worker)
    done: set[int] = set()
    for read in reads:
        pw = read.prefill_worker
        grouped.setdefault(pw, [])
        if pw.tp != decode_worker.tp:
            continue
        for n in read.layers:
            if n not in state or n in done:
                continue
            src, lk = sources[pw].layer(n), dst.layer(n)
            if not src.state:
                raise IncompatiblePeerError(f"layer {n} state", True, False)
            done.add(n)
            if group is None or lk.group == group:
                if src.group != lk.group:
                    raise IncompatiblePeerError(f"layer {n} KV-cache group", lk.group, src.group)
                grouped[pw].append(layer_segments(src, lk, 0, 0, 1))
    missing = sorted(n for r in reads for n in r.layers if n in state and n not in done)
    if missing:
        raise IncompatiblePeerError(f"layer {missing[0]} state: a read from tp rank {decode_worker.tp}", "one", "none")
    return tuple(replace(r, layers=tuple(n for n in r.layers if n not in state)) for r in reads)
