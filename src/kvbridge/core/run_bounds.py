"""Which runs a prefill worker sends for a block, derived from its own KV layout, not from what a reader names.

A reader of kvbridge's KV channel names its part of a request as runs (`src_addr[k]`, `block_stride[k]`,
`length[k]`) repeated for every block of its claim. A claim names blocks, not bytes, so the runs themselves must
be bounded by the worker's layout: run k of block b must be bytes of block b of one layer of the group that names
b. `RunBounds` holds, per KV-cache group, the byte spans of block 0 of each of its layers (one per plane and head:
its tokens' rows; adjacent spans merged), with that layer's block stride. A run is taken only if its address lies
in one such span, its length ends inside that span, and its stride is that layer's block stride: then at block b
it reads only bytes of block b of that layer, whatever the reader asked.
"""

from __future__ import annotations

import numpy as np

from kvbridge.core.memory import LayerKV, WorkerMemory


def _block_spans(lk: LayerKV) -> list[tuple[int, int]]:
    """[start, end) absolute byte spans of block 0 of `lk` (per plane and head), adjacent ones merged."""
    tokens = (lk.block_size - 1) * lk.token_stride + lk.row_bytes
    starts = sorted(
        lk.addr + p * lk.plane_stride + h * lk.head_stride for p in range(lk.num_planes) for h in range(lk.num_heads)
    )
    spans = [(start, start + tokens) for start in starts]
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


class RunBounds:
    """Per KV-cache group, the spans its runs may start in (sorted), where each ends, and its layer's stride."""

    def __init__(self, memory: WorkerMemory) -> None:
        self._groups: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for g in range(memory.num_groups):
            rows = sorted(
                (start, end, lk.block_stride)
                for lk in memory.layers
                if memory.num_groups == 1 or lk.group == g
                for start, end in _block_spans(lk)
            )
            table = np.array(rows, dtype=np.int64).reshape(-1, 3)
            self._groups.append((table[:, 0].copy(), table[:, 1].copy(), table[:, 2].copy()))

    def check(self, group: int, addr: np.ndarray, stride: np.ndarray, length: np.ndarray) -> str:
        """ "" if every run k lies in one block of a layer of `group` (its start in a span of block 0 of that layer,
        its end inside the same span, its stride that layer's block stride), else the first run that does not."""
        if not 0 <= group < len(self._groups):
            return f"group {group} of {len(self._groups)}"
        starts, ends, strides = self._groups[group]
        at = np.searchsorted(starts, addr, side="right") - 1
        ok = at >= 0
        at = np.maximum(at, 0)
        ok &= addr + length <= ends[at]
        ok &= stride == strides[at]
        if ok.all():
            return ""
        k = int(np.argmin(ok))
        return f"run {k} ({int(addr[k]):#x}, stride {int(stride[k])}, {int(length[k])} B) is not within one block"
