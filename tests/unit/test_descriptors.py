"""Descriptors: applying them to real buffers moves exactly the bytes torch indexing says, and no others."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.core.descriptors import Descriptors, read_descriptors, worker_descriptors
from kvbridge.core.errors import IncompatiblePeerError, RequestParamsError
from kvbridge.core.memory import NAMED_LAYOUTS, LayerKV, WorkerMemory, layer_from_strides, synthesize_memory
from kvbridge.core.plan import Read, make_plan
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank


class Worker:
    """A worker's KV in a real byte buffer, in a named layout, with a torch view per layer."""

    def __init__(self, layout, geometry, layers, num_heads, num_blocks, fill):
        size = synthesize_memory(layout, geometry, layers, num_heads, num_blocks, 0).regions[0].nbytes
        self.buffer = torch.empty(size, dtype=torch.uint8)
        if fill == "random":
            self.buffer.random_(0, 256, generator=torch.Generator().manual_seed(size + len(layers)))
        else:
            self.buffer.fill_(fill)
        self.memory = synthesize_memory(layout, geometry, layers, num_heads, num_blocks, self.buffer.data_ptr())

    def view(self, layer: int) -> torch.Tensor:
        """[planes, blocks, heads, tokens, row bytes] of one layer, by its strides."""
        lk = self.memory.layer(layer)
        return self.buffer.as_strided(
            (lk.num_planes, lk.num_blocks, lk.num_heads, lk.block_size, lk.row_bytes),
            (lk.plane_stride, lk.block_stride, lk.head_stride, lk.token_stride, 1),
            lk.addr - self.buffer.data_ptr(),
        )


def apply(descs: Descriptors, src: Worker, dst: Worker) -> None:
    s0, d0 = src.buffer.data_ptr(), dst.buffer.data_ptr()
    for s, d, n in zip(descs.src_addr.tolist(), descs.dst_addr.tolist(), descs.length.tolist(), strict=True):
        assert s - s0 >= 0 and s - s0 + n <= src.buffer.numel(), "source descriptor outside the source buffer"
        assert d - d0 >= 0 and d - d0 + n <= dst.buffer.numel(), "destination descriptor outside the buffer"
        dst.buffer[d - d0 : d - d0 + n] = src.buffer[s - s0 : s - s0 + n]


def move_by_descriptors(plan, dw, dst, sources, src_blocks, dst_blocks) -> None:
    """Copy one decode worker's reads byte by byte, as the explicit descriptors say."""
    per_peer = worker_descriptors(
        plan, dw, dst.memory, {pw: w.memory for pw, w in sources.items()}, src_blocks, dst_blocks
    )
    for pw, descs in per_peer.items():
        apply(descs, sources[pw], dst)


def check_layouts(
    prefill, decode, geometry, layout_p, layout_d, src_blocks, dst_blocks, num_blocks, move=move_by_descriptors
):
    """Every decode worker's request bytes after `move` equal torch indexing of the sources; nothing else changed."""
    plan = make_plan(prefill, decode, geometry)
    heads, layers = geometry.num_kv_heads, geometry.num_layers
    sources = {
        pw: Worker(
            layout_p,
            geometry,
            prefill.stage_layers(layers, pw.pp),
            len(prefill.kv_heads(heads, pw.tp)),
            num_blocks,
            "random",
        )
        for pw in prefill.workers()
    }
    for dw in decode.workers():
        my_layers = decode.stage_layers(layers, dw.pp)
        my_heads = decode.kv_heads(heads, dw.tp)
        dst = Worker(layout_d, geometry, my_layers, len(my_heads), num_blocks, 0xAB)
        before = dst.buffer.clone()
        move(plan, dw, dst, sources, src_blocks, dst_blocks)
        sb = torch.tensor(src_blocks, dtype=torch.long)
        db = torch.tensor(dst_blocks, dtype=torch.long)
        touched = torch.zeros_like(dst.buffer, dtype=torch.bool)
        for layer in my_layers:
            for head in my_heads:
                pw = next(
                    r.prefill_worker
                    for r in plan.reads_of(dw)
                    if layer in r.layers and r.kv_heads[0] <= head < r.kv_heads[1]
                )
                src = sources[pw]
                sh = head - prefill.kv_heads(heads, pw.tp).start
                dh = head - my_heads.start
                want = src.view(layer)[:, sb, sh]
                assert torch.equal(dst.view(layer)[:, db, dh], want), f"{dw} layer {layer} head {head}"
            # Mark every byte the request should have written, to check nothing else changed.
            flags = touched.as_strided(
                dst.view(layer).shape,
                dst.view(layer).stride(),
                dst.memory.layer(layer).addr - dst.buffer.data_ptr(),
            )
            flags[:, db] = True
        assert torch.equal(dst.buffer[~touched], before[~touched]), "bytes outside the request changed"


CASES = [
    ("pp=2,tp=1", "pp=1,tp=2", 4),
    ("pp=1,tp=2", "pp=2,tp=1", 4),
    ("pp=2,tp=2", "pp=2,tp=1", 4),
    ("pp=1,tp=4", "pp=1,tp=1", 2),
    ("pp=4,tp=1", "pp=2,tp=4", 8),
    ("pp=1,tp=1", "pp=1,tp=1", 4),
]


def check_case(prefill: str, decode: str, heads: int, layout: str, move=move_by_descriptors, seed: int = 0) -> None:
    """One CASES row in one named layout: 5 scattered blocks of 12, small geometry."""
    geometry = KVGeometry(num_layers=5, num_kv_heads=heads, head_size=8, dtype="float16", block_size=4)
    rng = np.random.default_rng(seed)
    src_blocks = rng.permutation(12)[:5].tolist()
    dst_blocks = rng.permutation(12)[:5].tolist()
    p, d = ParallelLayout.parse(prefill), ParallelLayout.parse(decode)
    check_layouts(p, d, geometry, layout, layout, src_blocks, dst_blocks, 12, move)


@pytest.mark.parametrize("layout", sorted(NAMED_LAYOUTS))
@pytest.mark.parametrize(("prefill", "decode", "heads"), CASES)
def test_bytes_match_torch_indexing(prefill, decode, heads, layout):
    check_case(prefill, decode, heads, layout)


def test_mixed_layouts_still_correct():
    """A prefill side in HND and a decode side in NHD: more descriptors, same bytes."""
    geometry = KVGeometry(num_layers=4, num_kv_heads=4, head_size=8, dtype="float32", block_size=4)
    check_layouts(ParallelLayout(pp=2), ParallelLayout(tp=2), geometry, "LBHNC", "LBNHC", [3, 1, 7], [0, 5, 2], 8)


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(sorted(NAMED_LAYOUTS)),
    data=st.data(),
)
def test_random_requests(layout, data):
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


def test_memory_validation():
    with pytest.raises(ValueError, match="outside its region"):
        lk = LayerKV(0, 0, 100, 5, 1, 4, 8, 32, 32, 8)  # 5 blocks in room for 4
        WorkerMemory((synthesize_memory("LBHNC", KVGeometry(1, 1, 2, "float32", 4), [0], 1, 2, 100).regions), (lk,))
