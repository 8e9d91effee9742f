"""The GPU gather kernel's addressing, run in Triton's CPU interpreter on real byte buffers.

The same kernel source compiles for the GPU (bench/gpu_transfer.py measures it there); here every named layout and
layout pair must move exactly the bytes torch indexing says, through segments and block ids alone.
"""

import numpy as np
import pytest
import torch

from kvbridge.errors import LayoutError
from kvbridge.gpu_gather import GatherKernel, _tile
from kvbridge.memory import NAMED_LAYOUTS, synthesize_memory
from kvbridge.segments import worker_segments
from kvbridge.topology import KVGeometry, ParallelLayout, WorkerRank
from test_descriptors import CASES, check_case, check_layouts  # tests/ is on sys.path (pytest's prepend import mode)


def move_by_kernel(plan, dw, dst, sources, src_blocks, dst_blocks) -> None:
    segments = worker_segments(plan, dw, dst.memory, {pw: w.memory for pw, w in sources.items()})
    for pw, seg in segments.items():
        src = sources[pw]
        kernel = GatherKernel(seg, src.memory.regions, [src.buffer], dst.memory.regions, [dst.buffer])
        kernel.launch(kernel.block_ids(src_blocks, dst_blocks))


@pytest.mark.parametrize("layout", sorted(NAMED_LAYOUTS))
@pytest.mark.parametrize(("prefill", "decode", "heads"), CASES)
def test_kernel_moves_the_bytes_torch_indexing_says(prefill, decode, heads, layout):
    check_case(prefill, decode, heads, layout, move=move_by_kernel, seed=1)


def test_kernel_with_mixed_layouts_and_long_runs():
    """HND prefill to NHD decode (short runs, masked tiles) and a block size whose pages exceed one tile."""
    small = KVGeometry(num_layers=4, num_kv_heads=4, head_size=8, dtype="float32", block_size=4)
    check_layouts(
        ParallelLayout(pp=2), ParallelLayout(tp=2), small, "LBHNC", "LBNHC", [3, 1, 7], [0, 5, 2], 8, move_by_kernel
    )
    big = KVGeometry(num_layers=2, num_kv_heads=2, head_size=64, dtype="float32", block_size=64)  # 64 KiB pages
    check_layouts(ParallelLayout(), ParallelLayout(), big, "LBNHC", "LBNHC", [2, 0], [1, 3], 4, move_by_kernel)


def test_tile_choice():
    assert _tile(np.array([4096, 8192])) == (4096, True)
    assert _tile(np.array([256, 512])) == (256, True)
    assert _tile(np.array([96])) == (128, False)  # 96 words: one masked step of 128
    assert _tile(np.array([8, 20000])) == (4096, False)


def test_region_and_tensor_mismatches_are_named():
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", block_size=4)
    layout = ParallelLayout()
    mem = synthesize_memory("LBHNC", geometry, [0, 1], 2, 4, 4096)
    from kvbridge.plan import make_plan

    seg = worker_segments(make_plan(layout, layout, geometry), WorkerRank(0, 0), mem, {WorkerRank(0, 0): mem})
    buf = torch.zeros(mem.regions[0].nbytes, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="regions but"):
        GatherKernel(seg[WorkerRank(0, 0)], mem.regions, [], mem.regions, [buf])
    with pytest.raises(LayoutError, match="does not cover"):
        GatherKernel(seg[WorkerRank(0, 0)], mem.regions, [buf[:16]], mem.regions, [buf])
