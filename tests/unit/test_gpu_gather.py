"""The GPU gather kernel's addressing, run in Triton's CPU interpreter on real byte buffers.

The same kernel source compiles for the GPU (bench/gpu_transfer.py measures it there); here every named layout and
layout pair must move exactly the bytes torch indexing says, through segments and block ids alone.
"""

import numpy as np
import pytest
import torch

from kvbridge.core.errors import LayoutError
from kvbridge.core.memory import NAMED_LAYOUTS, synthesize_memory
from kvbridge.core.segments import worker_segments
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.transport.gpu_gather import PAIR_PAD, GatherKernel, _grouping, _tile, pack_ids
from support.layout_oracle import CASES, check_case, check_layouts


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
    assert _tile(np.array([16384, 8192]), max_tile=4096) == (4096, True)
    assert _tile(np.array([256, 512])) == (256, True)
    assert _tile(np.array([64, 64])) == (64, True)  # one length: one exact step, however short
    assert _tile(np.array([96])) == (128, False)  # 96 words: one masked step of 128
    assert _tile(np.array([8, 20000]), max_tile=4096) == (4096, False)  # not 2500 steps of 8


def test_grouping_fills_a_program_without_padding_rows():
    # 1 KiB runs (a token's heads when heads are split): 32 rows of 256 words fill 32 KiB; 448 rows divide by 32
    assert _grouping(np.full(448, 256), 256, 8192) == (32, 1)
    assert _grouping(np.full(14, 256), 256, 8192) == (2, 16)  # 14 rows: only pairs of rows divide them
    assert _grouping(np.full(7, 4096), 4096, 8192) == (1, 2)  # rows that do not divide: block pairs instead
    assert _grouping(np.array([256, 512]), 256, 8192) == (1, 16)  # two lengths: never grouped, pairs capped
    assert _grouping(np.full(28, 8192), 8192, 8192) == (1, 1)


def test_pack_ids_pads_with_the_last_pair():
    out = np.full(2 * PAIR_PAD + 4, -1, dtype=np.int32)
    assert pack_ids(out, [5, 7, 9], [1, 2, 3]) == PAIR_PAD
    assert out[:PAIR_PAD].tolist() == [5, 7] + [9] * (PAIR_PAD - 2)
    assert out[PAIR_PAD : 2 * PAIR_PAD].tolist() == [1, 2] + [3] * (PAIR_PAD - 2)
    assert (out[2 * PAIR_PAD :] == -1).all()
    assert pack_ids(out, list(range(PAIR_PAD)), list(range(PAIR_PAD))) == PAIR_PAD  # a full list: no padding
    assert pack_ids(out, [], []) == 0


def one_worker(dtype: str):
    """A one-worker layout's memory, its segments to itself and a buffer covering its one region."""
    from kvbridge.core.plan import make_plan

    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype=dtype, block_size=4)
    layout, rank = ParallelLayout(), WorkerRank(0, 0)
    mem = synthesize_memory("LBHNC", geometry, [0, 1], 2, 4, 4096)
    seg = worker_segments(make_plan(layout, layout, geometry), rank, mem, {rank: mem})[rank]
    return mem, seg, torch.zeros(mem.regions[0].nbytes, dtype=torch.uint8)


def test_unpadded_ids_are_refused():
    mem, seg, buf = one_worker("float32")
    kernel = GatherKernel(seg, mem.regions, [buf], mem.regions, [buf.clone()])
    with pytest.raises(ValueError, match="pack_ids"):
        kernel.launch(torch.tensor([0, 1, 2, 3], dtype=torch.int32))


@pytest.mark.parametrize(("program_bytes", "group_runs"), [(128, True), (2048, True), (65536, True), (65536, False)])
def test_every_program_shape_moves_the_same_bytes(program_bytes, group_runs):
    """Grouped rows and block pairs, padded pairs, short and long runs: the bytes torch indexing says."""

    def move(plan, dw, dst, sources, src_blocks, dst_blocks) -> None:
        segments = worker_segments(plan, dw, dst.memory, {pw: w.memory for pw, w in sources.items()})
        for pw, seg in segments.items():
            src = sources[pw]
            kernel = GatherKernel(
                seg, src.memory.regions, [src.buffer], dst.memory.regions, [dst.buffer],
                program_bytes=program_bytes, group_runs=group_runs,
            )  # fmt: skip
            kernel.launch(kernel.block_ids(src_blocks, dst_blocks))

    small = KVGeometry(num_layers=4, num_kv_heads=4, head_size=8, dtype="float32", block_size=4)
    blocks = list(range(19))  # 19 pairs: padded to 32
    for p, d, src_layout, dst_layout in (("pp=2", "tp=2", "LBNHC", "LBNHC"), ("tp=2", "pp=2", "LBHNC", "LBNHC")):
        check_layouts(
            ParallelLayout.parse(p), ParallelLayout.parse(d), small, src_layout, dst_layout,
            blocks[::-1], [(3 * b + 1) % 40 for b in blocks], 40, move,
        )  # fmt: skip


def test_region_and_tensor_mismatches_are_named():
    mem, seg, buf = one_worker("float16")
    with pytest.raises(LayoutError, match="regions but"):
        GatherKernel(seg, mem.regions, [], mem.regions, [buf])
    with pytest.raises(LayoutError, match="does not cover"):
        GatherKernel(seg, mem.regions, [buf[:16]], mem.regions, [buf])


@pytest.mark.parametrize(("prefill", "decode"), [("pp=1", "pp=1"), ("pp=2", "tp=2"), ("tp=2", "pp=2")])
def test_one_launch_spans_per_layer_tensors(prefill, decode):
    """vLLM's per-layer KV tensors are separate allocations (regions): one launch per peer still reaches all of
    them, through offsets from one base tensor, some of them negative."""
    from kvbridge.core.plan import make_plan
    from kvbridge.transport.torch_memory import memory_from_tensors, region_tensors

    geometry = KVGeometry(num_layers=4, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)
    p, d = ParallelLayout.parse(prefill), ParallelLayout.parse(decode)
    plan, blocks, gen = make_plan(p, d, geometry), 6, torch.Generator().manual_seed(3)

    def worker(layout, rank, fill):
        heads = len(layout.kv_heads(2, rank.tp))
        layers = layout.stage_layers(4, rank.pp)
        tensors = [torch.empty(blocks, heads, 4, 16, dtype=torch.float32) for _ in layers]
        tensors.sort(key=lambda t: -t.data_ptr())  # the first layer (the base) highest: later offsets negative
        caches = {}
        for layer, t in zip(layers, tensors, strict=True):
            caches[f"layers.{layer}"] = t.normal_(generator=gen) if fill else t.zero_()
        memory = memory_from_tensors(caches, lambda name: int(name.split(".")[1]))
        return caches, memory, region_tensors(caches, memory)

    sources = {pw: worker(p, pw, True) for pw in p.workers()}
    sb, db = [4, 0, 2], [1, 5, 3]
    for dw in d.workers():
        caches, memory, regions = worker(d, dw, False)
        assert len(memory.regions) > 1
        for pw, seg in worker_segments(plan, dw, memory, {r: s[1] for r, s in sources.items()}).items():
            kernel = GatherKernel(seg, sources[pw][1].regions, sources[pw][2], memory.regions, regions)
            assert kernel.launches == 1
            kernel.launch(kernel.block_ids(sb, db))
        my_heads = d.kv_heads(2, dw.tp)
        for name, t in caches.items():
            layer = int(name.split(".")[1])
            for head in my_heads:
                holds = (pw for pw in p.workers() if layer in p.stage_layers(4, pw.pp) and head in p.kv_heads(2, pw.tp))
                pw = next(holds)
                src = sources[pw][0][name][:, head - p.kv_heads(2, pw.tp).start]
                assert torch.equal(t[db, head - my_heads.start], src[sb])
            untouched = [b for b in range(blocks) if b not in db]
            assert not t[untouched].any()
