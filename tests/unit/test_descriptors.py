"""Descriptors: applying them to real buffers moves exactly the bytes torch indexing says, and no others."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.core.descriptors import read_descriptors, worker_descriptors
from kvbridge.core.errors import IncompatiblePeerError, RequestParamsError
from kvbridge.core.memory import NAMED_LAYOUTS, LayerKV, WorkerMemory, layer_from_strides, synthesize_memory
from kvbridge.core.plan import Read, make_plan
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from support.layout_oracle import CASES, check_case, check_layouts


@pytest.mark.parametrize("layout", sorted(NAMED_LAYOUTS))
@pytest.mark.parametrize(("prefill", "decode", "heads"), CASES)
def test_bytes_match_torch_indexing(prefill, decode, heads, layout):
    check_case(prefill, decode, heads, layout)


def test_mixed_layouts_still_correct():
    """A prefill side in HND and a decode side in NHD: more descriptors, same bytes."""
    geometry = KVGeometry(num_layers=4, num_kv_heads=4, head_size=8, dtype="float32", block_size=4)
    check_layouts(ParallelLayout(pp=2), ParallelLayout(tp=2), geometry, "LBHNC", "LBNHC", [3, 1, 7], [0, 5, 2], 8)


@settings(max_examples=40)
@given(
    layout=st.sampled_from(sorted(NAMED_LAYOUTS)),
    data=st.data(),
)
def test_random_requests_move_exactly_their_bytes(layout, data):
    num_blocks = 10
    count = data.draw(st.integers(0, num_blocks))
    src_blocks = data.draw(st.permutations(range(num_blocks)))[:count]
    dst_blocks = data.draw(st.permutations(range(num_blocks)))[:count]
    pair = data.draw(st.sampled_from(CASES))
    geometry = KVGeometry(num_layers=4, num_kv_heads=pair[2], head_size=4, dtype="bfloat16", block_size=2)
    check_layouts(
        ParallelLayout.parse(pair[0]),
        ParallelLayout.parse(pair[1]),
        geometry,
        layout,
        layout,
        src_blocks,
        dst_blocks,
        num_blocks,
    )


GEOMETRY = KVGeometry(num_layers=28, num_kv_heads=4, head_size=128, dtype="bfloat16", block_size=16)


def descriptor_count(layout, prefill, decode, src_blocks, dst_blocks):
    plan = make_plan(prefill, decode, GEOMETRY)
    layers = GEOMETRY.num_layers
    sources = {
        pw: synthesize_memory(
            layout,
            GEOMETRY,
            prefill.stage_layers(layers, pw.pp),
            len(prefill.kv_heads(4, pw.tp)),
            4096,
            (1 + pw.pp * 4 + pw.tp) << 36,
        )
        for pw in prefill.workers()
    }
    dw = WorkerRank(0, 0)
    dst = synthesize_memory(layout, GEOMETRY, decode.stage_layers(layers, 0), len(decode.kv_heads(4, 0)), 4096, 1 << 44)
    return sum(len(d) for d in worker_descriptors(plan, dw, dst, sources, src_blocks, dst_blocks).values())


def test_contiguous_blocks_coalesce_to_one_descriptor_per_layer():
    blocks = list(range(100, 164))
    same = ParallelLayout()
    # (block, head) pages back to back: one run per layer.
    assert descriptor_count("LBHNC", same, same, blocks, blocks) == 28
    # Block-outer layouts put all layers of a block together: one run for everything.
    assert descriptor_count("BLHNC", same, same, blocks, blocks) == 1
    # Older K/V-separate layouts: one run per layer and plane.
    assert descriptor_count("KV_NHD", same, same, blocks, blocks) == 56


def test_scattered_blocks_cost_one_descriptor_per_block_and_layer():
    rng = np.random.default_rng(1)
    src = (rng.permutation(2048)[:64] * 2).tolist()  # even ids: never adjacent
    dst = (rng.permutation(2048)[:64] * 2).tolist()
    same = ParallelLayout()
    assert descriptor_count("LBNHC", same, same, src, dst) == 28 * 64
    # Half the heads of each block: a run per block when heads are outer, per token when interleaved.
    assert descriptor_count("LBHNC", same, ParallelLayout(tp=2), src, dst) == 28 * 64
    assert descriptor_count("LBNHC", same, ParallelLayout(tp=2), src, dst) == 28 * 64 * 16


def test_vllm_cpu_tensor_strides():
    """A vLLM CPU KV tensor [num_blocks, heads, block_size, 2*head_size] maps to an LBHNC page layout."""
    kv = torch.zeros(6, 2, 16, 2 * 32, dtype=torch.bfloat16)
    lk = layer_from_strides(3, 0, kv.data_ptr(), "BHNC", kv.shape, kv.stride(), kv.element_size())
    assert (lk.block_stride, lk.head_stride, lk.token_stride, lk.row_bytes) == (
        2 * 16 * 128,
        16 * 128,
        128,
        128,
    )
    gpu = torch.zeros(2, 6, 16, 2, 32, dtype=torch.float16)  # older [2, blocks, tokens, heads, head_size]
    lk = layer_from_strides(0, 0, gpu.data_ptr(), "KBNHC", gpu.shape, gpu.stride(), gpu.element_size())
    assert (lk.num_planes, lk.plane_stride, lk.head_stride, lk.row_bytes) == (2, 6 * 16 * 2 * 32 * 2, 64, 64)


def test_bad_inputs_name_the_problem():
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)
    mem = synthesize_memory("LBHNC", geometry, [0, 1], 2, 8, 1 << 30)
    read = Read(WorkerRank(0, 0), WorkerRank(0, 0), (0, 1), (0, 2))
    with pytest.raises(RequestParamsError, match="source block id 8 is outside"):
        read_descriptors(read, mem, 0, mem, 0, [8], [0])
    with pytest.raises(RequestParamsError, match="differ in length"):
        read_descriptors(read, mem, 0, mem, 0, [1, 2], [0])
    other = synthesize_memory("LBHNC", KVGeometry(2, 2, 8, "float32", block_size=8), [0, 1], 2, 8, 1 << 31)
    with pytest.raises(IncompatiblePeerError, match="block_size"):
        read_descriptors(read, mem, 0, other, 0, [1], [0])


def test_a_layer_outside_its_region_is_refused():
    with pytest.raises(ValueError, match="outside its region"):
        lk = LayerKV(0, 0, 100, 5, 1, 4, 8, 32, 32, 8)  # 5 blocks in room for 4
        WorkerMemory((synthesize_memory("LBHNC", KVGeometry(1, 1, 2, "float32", 4), [0], 1, 2, 100).regions), (lk,))
