"""The byte oracle for moving KV between workers: each worker's KV in a real byte buffer in a named layout, moved
by descriptors (or by any `move` given, e.g. the GPU gather kernel), then checked against torch indexing of the
sources, with every byte outside the request unchanged. `CASES`: the layout pairs every mover is checked on."""

import numpy as np
import torch

from kvbridge.core.descriptors import Descriptors, worker_descriptors
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.plan import make_plan
from kvbridge.core.topology import KVGeometry, ParallelLayout


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
