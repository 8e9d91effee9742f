"""`core.run_bounds`: the runs a prefill worker sends are bounded by its own layout. The runs a decode worker
derives for any layout pair pass (the control); forged ones that would reach another block do not."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.core.memory import synthesize_memory
from kvbridge.core.plan import make_plan
from kvbridge.core.run_bounds import RunBounds
from kvbridge.core.segments import worker_segments
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank

GEOMETRY = KVGeometry(num_layers=4, num_kv_heads=4, head_size=16, dtype="float32", block_size=4)
BLOCKS = 32


def _segments(layout: str, tp_prefill: int, tp_decode: int):
    src_layout, dst_layout = ParallelLayout(tp=tp_prefill), ParallelLayout(tp=tp_decode)
    heads_src, heads_dst = 4 // tp_prefill, 4 // tp_decode
    plan = make_plan(src_layout, dst_layout, GEOMETRY)
    sources = {
        WorkerRank(0, t): synthesize_memory(layout, GEOMETRY, list(range(4)), heads_src, BLOCKS, (t + 1) << 32)
        for t in range(tp_prefill)
    }
    dst = synthesize_memory(layout, GEOMETRY, list(range(4)), heads_dst, BLOCKS, 1 << 40)
    return sources, worker_segments(plan, WorkerRank(0, 0), dst, sources)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "KV_NHD", "KV_HND"])
@pytest.mark.parametrize(("tp_prefill", "tp_decode"), [(1, 1), (1, 2), (2, 1), (1, 4)])
def test_the_runs_a_reader_derives_pass(layout, tp_prefill, tp_decode):
    sources, segments = _segments(layout, tp_prefill, tp_decode)
    for rank, seg in segments.items():
        bounds = RunBounds(sources[rank])
        assert bounds.check(0, seg.src_addr, seg.src_block_stride, seg.length) == ""


@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC", "BLHNC", "KV_NHD"])
def test_runs_reaching_past_their_block_are_refused(layout):
    sources, segments = _segments(layout, 1, 1)
    memory = sources[WorkerRank(0, 0)]
    seg = segments[WorkerRank(0, 0)]
    bounds = RunBounds(memory)
    stride = memory.layers[0].block_stride
    addr, strides, length = seg.src_addr, seg.src_block_stride, seg.length
    assert bounds.check(0, addr, strides, length) == ""  # the control
    forged = [
        (addr + 3 * stride, strides, length),  # block b reads block b + 3
        (addr, strides * 2, length),  # block b reads block 2b
        (addr, strides, length + 1),  # a byte past the run's span
        (addr, strides, length * 2),  # a run over two blocks
        (addr - 1, strides, length),  # a byte before the first layer
        (addr + stride // 2, strides, length),  # across a block's end
    ]
    for a, s, n in forged:
        assert bounds.check(0, a, s, n).startswith("run "), (a, s, n)
    assert bounds.check(1, addr, strides, length), "a group this worker does not have"


def test_a_layer_of_another_group_is_refused():
    memory = synthesize_memory("LBHNC", GEOMETRY, list(range(4)), 4, BLOCKS, 1 << 32)
    from dataclasses import replace

    layers = tuple(replace(lk, group=lk.layer % 2) for lk in memory.layers)
    grouped = replace(memory, layers=layers, num_groups=2)
    lk0, lk1 = grouped.layers[0], grouped.layers[1]
    one = (np.array([lk1.addr]), np.array([lk1.block_stride]), np.array([lk1.page_bytes]))
    assert RunBounds(grouped).check(1, *one) == ""
    assert RunBounds(grouped).check(0, *one).startswith("run "), "layer 1 is in group 1"
    assert RunBounds(grouped).check(0, np.array([lk0.addr]), np.array([lk0.block_stride]), np.array([8])) == ""
