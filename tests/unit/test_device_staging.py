"""The staged path for KV in GPU memory, on CPU: the torch copies, the stager's device mode, and the dispatch.

`transport.device_copy` runs the same code on CPU tensors as on CUDA ones (no stream): its gather and scatter must
move exactly what `host_copy`'s do (the byte oracle of test_staging.py's round trip), widened to 8-byte words where
the runs allow it and bytes where they do not; a scatter in the wrong order is caught by the same oracle. The
dispatch: GPU memory stages only with the tensors that own it, host memory keeps the host copies, and the cost
model for GPU memory follows the transport. The GPU itself: tests/gpu/test_gpu_runtime.py (device machine).
"""

import numpy as np
import pytest

from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import Region, WorkerMemory, synthesize_memory
from kvbridge.core.plan import make_plan
from kvbridge.core.segments import worker_segments
from kvbridge.core.staging import GPU_EMULATED, GPU_LINK, HOST_MEMORY, StageLayout, cost_model
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.prefill_worker import staging_copies
from kvbridge.runtime.staging import Stager
from kvbridge.transport import device_copy, host_copy
from kvbridge.wire import messages as wire

torch = pytest.importorskip("torch")


class Side:
    """One worker's KV (LBHNC) in a torch uint8 tensor: the region and the tensor that owns it."""

    def __init__(self, layout_text, rank, geometry, num_blocks, seed):
        layout = ParallelLayout.parse(layout_text)
        layers = list(layout.stage_layers(geometry.num_layers, rank.pp))
        heads = len(layout.kv_heads(geometry.num_kv_heads, rank.tp))
        size = synthesize_memory("LBHNC", geometry, layers, heads, num_blocks, 0).regions[0].nbytes
        gen = torch.Generator().manual_seed(seed)
        self.tensor = (
            torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8)
            if seed
            else torch.zeros(size, dtype=torch.uint8)
        )
        self.memory = synthesize_memory("LBHNC", geometry, layers, heads, num_blocks, self.tensor.data_ptr())


def _pair(head_size: int, block_size: int = 16):
    g = KVGeometry(num_layers=3, num_kv_heads=4, head_size=head_size, dtype="bfloat16", block_size=block_size)
    plan = make_plan(ParallelLayout.parse("tp=4"), ParallelLayout.parse("tp=1"), g)
    prefill = {WorkerRank(0, t): Side("tp=4", WorkerRank(0, t), g, 40, seed=3 + t) for t in range(4)}
    dst = Side("tp=1", WorkerRank(0, 0), g, 40, seed=0)
    sources = {r: side.memory for r, side in prefill.items()}
    seg = worker_segments(plan, WorkerRank(0, 0), dst.memory, sources)[WorkerRank(0, 1)]
    return prefill[WorkerRank(0, 1)], dst, seg


def round_trip(head_size: int = 16, reverse: bool = False, block_size: int = 16) -> tuple[bool, int]:
    """Gather a tp=4 prefill worker's runs for a tp=1 decode with torch copies, chunk by chunk, scatter them; (the
    decode's bytes equal a direct copy of every run, the word the copies used)."""
    src, dst, seg = _pair(head_size, block_size)
    rng = np.random.default_rng(5)
    sb, db = rng.permutation(40)[:17], rng.permutation(40)[:17]
    chunk_bytes = int(seg.length.max()) * 3
    layout = StageLayout(seg.length, len(sb), chunk_bytes)
    sv = device_copy.DeviceViews(src.memory.regions, [src.tensor])
    dv = device_copy.DeviceViews(dst.memory.regions, [dst.tensor])
    chunk = torch.zeros(chunk_bytes, dtype=torch.uint8)
    word = sv.word(seg.src_addr, seg.src_block_stride, seg.length, chunk)
    for pieces in layout.chunks():
        device_copy.gather(sv, seg.src_addr, seg.src_block_stride, seg.length, sb, pieces, chunk)
        d = db[::-1].copy() if reverse else db
        device_copy.scatter(dv, seg.dst_addr, seg.dst_block_stride, seg.length, d, pieces, chunk)
    want = np.zeros(dst.tensor.numel(), np.uint8)
    s_np, s0, d0 = src.tensor.numpy(), src.tensor.data_ptr(), dst.tensor.data_ptr()
    for k in range(len(seg)):
        n = int(seg.length[k])
        for s, d in zip(sb.tolist(), db.tolist(), strict=True):
            a = int(seg.src_addr[k] + s * seg.src_block_stride[k]) - s0
            b = int(seg.dst_addr[k] + d * seg.dst_block_stride[k]) - d0
            want[b : b + n] = s_np[a : a + n]
    return np.array_equal(want, dst.tensor.numpy()), word


def test_torch_gather_then_scatter_moves_exactly_the_runs_in_words():
    exact, word = round_trip(head_size=16)
    assert exact and word == 8


def test_runs_of_a_narrower_alignment_are_moved_in_narrower_words():
    exact, word = round_trip(head_size=3, block_size=1)  # runs of 1 token x 2 x 3 x 2 bytes: 4-byte words
    assert exact and word == 4


def test_a_torch_scatter_in_the_wrong_order_is_caught():
    """Negative control: the same oracle fails when the scatter pairs runs with the wrong blocks."""
    assert not round_trip(reverse=True)[0]


def test_torch_and_host_gathers_give_the_same_chunk():
    src, _, seg = _pair(16)
    blocks = np.array([7, 2, 30, 11, 0], dtype=np.int64)
    layout = StageLayout(seg.length, len(blocks), seg.block_bytes * len(blocks))
    (pieces,) = layout.chunks()
    out_t = torch.zeros(layout.nbytes, dtype=torch.uint8)
    out_h = np.zeros(layout.nbytes, np.uint8)
    a = device_copy.gather(device_copy.DeviceViews(src.memory.regions, [src.tensor]), *_seg(seg), blocks, pieces, out_t)
    b = host_copy.gather(host_copy.HostViews(src.memory.regions), *_seg(seg), blocks, pieces, out_h)
    assert a == b == layout.nbytes and np.array_equal(out_t.numpy(), out_h)


def _seg(seg):
    return seg.src_addr, seg.src_block_stride, seg.length


def test_views_refuse_a_tensor_that_does_not_hold_its_region():
    t = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not hold"):
        device_copy.DeviceViews([Region(t.data_ptr() + 8, 1016, 0)], [t])
    views = device_copy.DeviceViews([Region(t.data_ptr(), 1024, 0)], [t])
    with pytest.raises(ValueError, match="outside"):
        views.rows(t.data_ptr(), 512, 256, 3)  # the third row ends past the region


def test_a_stager_with_tensors_stages_in_their_memory():
    """Device mode (CPU tensors here): the buffer is a tensor, and a Stage gathers the same bytes as the host
    stager's."""
    g = KVGeometry(num_layers=2, num_kv_heads=1, head_size=16, dtype="float32", block_size=16)
    side = Side("tp=1", WorkerRank(0, 0), g, 64, seed=1)
    lk = side.memory.layers[0]
    msg = wire.Stage(
        request_id="r",
        engine_id="e",
        worker=wire.Worker(),
        block_ids=(1, 5, 9),
        src_addr=(lk.addr,),
        block_stride=(lk.block_stride,),
        length=(lk.block_stride,),
        chunk_bytes=1 << 14,
    )
    chunks = []
    for tensors in ([side.tensor], ()):
        stager = Stager(side.memory, 1 << 16, 1 << 14, tensors).start()
        try:
            assert isinstance(stager.buffer, torch.Tensor) == bool(tensors) and stager.mem_type == "DRAM"
            answer = stager.answer(msg, until=1e12, epoch="x")
            assert isinstance(answer, wire.Staged), answer
            buf = stager.buffer.numpy() if tensors else stager.buffer
            chunks.append(buf[answer.offset : answer.offset + answer.nbytes].copy())
        finally:
            stager.close()
    assert chunks[0].size == 3 * lk.block_stride and np.array_equal(chunks[0], chunks[1])


# -- dispatch -------------------------------------------------------------------------------------------------


def test_gpu_memory_stages_only_with_its_tensors():
    memory = WorkerMemory((Region(4096, 4096, 0),), ())
    t = torch.zeros(16)
    assert staging_copies("DRAM", (), memory) == ()  # host copies, as before
    assert staging_copies("DRAM", (t,), memory) == ()  # host memory never takes the torch path
    assert staging_copies("VRAM", (), memory) is None  # nothing can view GPU memory by address
    assert staging_copies("VRAM", (t,), memory) == (t,)
    assert staging_copies("VRAM", (t, t), memory) is None  # not one tensor per region


def _reads(mem_type: str, regions=(), **config):
    from kvbridge.runtime.nixl_reads import NixlReads

    g = KVGeometry(num_layers=2, num_kv_heads=1, head_size=16, dtype="float32", block_size=16)
    memory = synthesize_memory("LBHNC", g, [0, 1], 1, 8, 1 << 20)
    cfg = BridgeConfig(**{"nixl_staging_bytes": 1 << 18, "nixl_staging_chunk_bytes": 1 << 16, **config})
    ident = WorkerIdentity("d", ParallelLayout(), 0, WorkerRank(0, 0), g)
    none = lambda *a: None  # noqa: E731
    return NixlReads(ident, memory, cfg, mem_type, None, loaded=none, failed=none, tell=none, regions=regions)


def test_the_decode_side_picks_its_copies_by_memory():
    """NixlReads (not started: nothing is allocated) builds a staged path with host copies for host memory, torch
    copies for GPU memory with its tensors, and none for GPU memory without them or with staging off."""
    t = torch.zeros(16)
    host = _reads("DRAM").staged
    assert host is not None and host._scatter is host_copy.scatter and host.mem_type == "DRAM"
    gpu = _reads("VRAM", (t,)).staged
    assert gpu is not None and gpu._scatter is device_copy.scatter
    assert _reads("VRAM").staged is None
    assert _reads("VRAM", (t,), nixl_staging_bytes=0).staged is None


def test_the_gpu_model_follows_the_transport():
    assert cost_model(True, "cuda_ipc,cuda_copy,sm,self,tcp", "VRAM") is GPU_LINK
    assert cost_model(False, "rc,cuda_copy", "VRAM") is GPU_LINK
    assert cost_model(True, None, "VRAM") is GPU_LINK  # UCX's choice: a GPU lane where it has one
    assert cost_model(True, "tcp,cuda_copy", "VRAM") is GPU_EMULATED  # cuda_copy alone: bounce buffers over tcp
    assert cost_model(True, "self,sm,cma,tcp", "DRAM") is HOST_MEMORY  # host memory unchanged


def test_the_emulated_model_on_the_measured_cells():
    """The emulated GPU model against the one-GPU run it was fitted to (bench/results/nixl-staged-vram-20261201-
    204323.json, per prefill worker read of an 8k request, 8 MiB chunks): it stages the TP 4:1, 2:1 and 1:2 parts at
    block 16 (8 and 16 KiB runs, where staged measured 0.83-0.91 of the anchor and direct 0.56-0.70) and reads every
    part of 32 KiB runs or longer directly (direct measured 0.80-1.00). The GPU link's model stages every part below
    about a megabyte a run."""
    chunk = 8 << 20
    mib = 1 << 20
    staged = [(112 * mib, 14336), (224 * mib, 14336)]  # block 16: 4:1 (8 KiB runs), 2:1 and 1:2 (16 KiB)
    direct = [(448 * mib, 14336), (448 * mib, 3584), (224 * mib, 3584), (112 * mib, 3584), (448 * mib, 1792)]
    assert all(GPU_EMULATED.prefers_staged(n, d, chunk) for n, d in staged)
    assert not any(GPU_EMULATED.prefers_staged(n, d, chunk) for n, d in direct)
    assert all(GPU_LINK.prefers_staged(n, d, chunk) for n, d in staged + direct[1:4])
    assert not GPU_LINK.prefers_staged(448 * mib, 28, chunk)  # contiguous blocks: one run per layer


def test_an_emulated_path_takes_the_emulated_model():
    assert cost_model(True, None, "VRAM", emulated=True) is GPU_EMULATED
    assert cost_model(True, "cuda_ipc,cuda_copy,tcp", "VRAM", emulated=True) is GPU_EMULATED
    assert cost_model(True, "self,sm,cma,tcp", "DRAM", emulated=True) is HOST_MEMORY  # host memory: no such thing


def test_a_slow_gpu_read_marks_its_engine_emulated():
    """The rate check that logs "UCX is emulating the GPU path" also tells the staged path's dispatch: loads from
    that engine are chosen with the emulated model from then on. A fast READ leaves the engine on the GPU link's."""
    import time
    from types import SimpleNamespace

    reads = _reads("VRAM", (torch.zeros(16),))
    peer = SimpleNamespace(same_host=True)
    for engine_id, seconds in (("slow", 1.0), ("fast", 1e-3)):
        engine = SimpleNamespace(key=(engine_id, "127.0.0.1", 1), peers={0: peer})
        load = SimpleNamespace(engine=engine, posted=time.monotonic() - seconds, nbytes=448 << 20)
        reads.emulation.by_rate(load)
    assert reads.emulation.emulated == {"slow"}
    tcp_only = _reads("VRAM", (torch.zeros(16),), ucx_tls="self,sm,tcp")
    tcp_only.transport.ucx_env["UCX_TLS"] = "self,sm,tcp"  # what start() would set
    tcp_only.emulation.at_handshake(SimpleNamespace(key=("e", "127.0.0.1", 1)))
    assert tcp_only.emulation.emulated == {"e"}
