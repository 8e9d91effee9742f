"""The staged path's pure parts and host copies: the cost model, the chunk layout, the run check, gather/scatter.

Properties: the model is monotonic (more descriptors for the same bytes never make direct more attractive; more
bytes in the same descriptors never make staging more attractive) and picks staging only for many small runs;
chunks hold every piece exactly once, in stream order, never over the chunk size; gather then scatter moves exactly
the request's runs (and a scatter in the wrong order is caught by the same oracle); a Stage naming a huge part
allocates nothing beyond the staging buffer fixed at start.
"""

import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge.core.memory import Region, synthesize_memory
from kvbridge.core.plan import make_plan
from kvbridge.core.segments import worker_segments
from kvbridge.core.staging import StageCostModel, StageLayout, runs_inside
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.staging import Stager
from kvbridge.transport.host_copy import HostViews, gather, scatter
from kvbridge.wire import messages as wire

MODEL = StageCostModel()
CHUNK = 8 << 20


@given(
    nbytes=st.integers(1 << 16, 1 << 32),
    descs=st.integers(2, 1 << 18),
    more=st.integers(1, 1 << 16),
    chunk=st.sampled_from([1 << 16, 1 << 20, 8 << 20]),
)
def test_the_model_is_monotonic(nbytes, descs, more, chunk):
    from kvbridge.core.staging import NETWORK_TCP

    for model in (MODEL, NETWORK_TCP):
        if model.prefers_staged(nbytes, descs, chunk):
            assert model.prefers_staged(nbytes, descs + more, chunk)  # more runs for the same bytes: still staged
        elif model is MODEL:  # (over tcp, staged reads outrun one large READ: more bytes can tip it to staged)
            assert not model.prefers_staged(nbytes + more * 4096, descs, chunk)  # bigger runs: still direct
        assert model.direct_s(nbytes, descs + more) > model.direct_s(nbytes, descs)


@given(nbytes=st.integers(1 << 20, 1 << 32), run=st.integers(1, 1 << 22))
def test_the_model_stages_only_small_runs(nbytes, run):
    descs = max(2, nbytes // run)
    if MODEL.prefers_staged(nbytes, descs, CHUNK):
        # staging pays only for runs shorter than the break-even length (37 KB with the fitted constants)
        assert nbytes / descs < MODEL.break_even_run_bytes() < 64 << 10


def test_the_model_on_the_fitted_cases():
    """From the fitted constants (host DRAM, UCX cma): the 4 KiB runs of an 8k request at TP 4:1, block 16 (57344
    descriptors) are staged, its 64 KiB runs at block 128 same TP (1792) are not; over tcp (much dearer
    descriptors) 64 KiB runs are staged too; one descriptor, or 1 MiB runs, never."""
    nbytes = 448 << 20
    assert MODEL.prefers_staged(nbytes, 57344, CHUNK)
    assert not MODEL.prefers_staged(nbytes, 1792, CHUNK)
    tcp = StageCostModel(desc_s=46e-6, link_bytes_per_s=0.4e9)
    assert tcp.prefers_staged(nbytes, 57344, CHUNK) and tcp.prefers_staged(nbytes, 7168, CHUNK)
    assert not tcp.prefers_staged(nbytes, 1, CHUNK)
    assert not tcp.prefers_staged(nbytes, 448, CHUNK)


def test_bad_constants_are_refused():
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        StageCostModel(link_bytes_per_s=0)


@given(
    lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=12),
    pairs=st.integers(1, 60),
    chunk=st.integers(5000, 40000),
)
def test_chunks_hold_every_piece_once_in_order(lengths, pairs, chunk):
    layout = StageLayout(np.array(lengths, dtype=np.int64), pairs, chunk)
    stream = []
    for c in layout.chunks():
        used = 0
        for p in c:
            assert p.offset == used
            used += (p.stop - p.first) * lengths[p.segment]
            stream += [(p.segment, i) for i in range(p.first, p.stop)]
        assert 0 < used <= chunk
    assert stream == [(k, i) for k in range(len(lengths)) for i in range(pairs)]
    assert sum(layout.chunk_sizes()) == layout.nbytes


def test_a_run_larger_than_a_chunk_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        StageLayout(np.array([4096], dtype=np.int64), 3, 1024)


def test_runs_inside_names_a_run_outside():
    regions = (Region(1000, 1000, 0),)
    a, s, n = (np.array([v], dtype=np.int64) for v in (1000, 100, 50))
    assert runs_inside(regions, a, s, n, np.array([0, 9])) == ""
    assert "outside" in runs_inside(regions, a, s, n, np.array([0, 10]))  # block 10 ends past the region
    assert "negative" in runs_inside(regions, a, s, n, np.array([-1]))


class Side:
    """One worker's KV in a real buffer (LBHNC), for host-copy round trips."""

    def __init__(self, layout_text, rank, geometry, num_blocks, seed):
        layout = ParallelLayout.parse(layout_text)
        layers = list(layout.stage_layers(geometry.num_layers, rank.pp))
        heads = len(layout.kv_heads(geometry.num_kv_heads, rank.tp))
        size = synthesize_memory("LBHNC", geometry, layers, heads, num_blocks, 0).regions[0].nbytes
        rng = np.random.default_rng(seed)
        self.buffer = rng.integers(0, 256, size, dtype=np.uint8) if seed else np.zeros(size, np.uint8)
        self.memory = synthesize_memory("LBHNC", geometry, layers, heads, num_blocks, self.buffer.ctypes.data)


def round_trip(reverse_pieces: bool = False) -> bool:
    """Gather a tp=4 prefill worker's runs for a tp=1 decode (16-token blocks, scattered), chunk by chunk, scatter
    them; True if the decode's bytes equal a direct copy of every run (the byte oracle)."""
    g = KVGeometry(num_layers=3, num_kv_heads=4, head_size=16, dtype="float32", block_size=16)
    plan = make_plan(ParallelLayout.parse("tp=4"), ParallelLayout.parse("tp=1"), g)
    prefill = {WorkerRank(0, t): Side("tp=4", WorkerRank(0, t), g, 40, seed=3 + t) for t in range(4)}
    src = prefill[WorkerRank(0, 1)]
    dst = Side("tp=1", WorkerRank(0, 0), g, 40, seed=0)
    sources = {r: side.memory for r, side in prefill.items()}
    seg = worker_segments(plan, WorkerRank(0, 0), dst.memory, sources)[WorkerRank(0, 1)]
    rng = np.random.default_rng(5)
    sb, db = rng.permutation(40)[:17], rng.permutation(40)[:17]
    layout = StageLayout(seg.length, len(sb), 3000)
    sv, dv = HostViews(src.memory.regions), HostViews(dst.memory.regions)
    chunk = np.zeros(3000, np.uint8)
    for pieces in layout.chunks():
        gather(sv, seg.src_addr, seg.src_block_stride, seg.length, sb, pieces, chunk)
        if reverse_pieces:  # a wrong order: the chunk's pieces scattered with the block pairs reversed
            scatter(dv, seg.dst_addr, seg.dst_block_stride, seg.length, db[::-1].copy(), pieces, chunk)
        else:
            scatter(dv, seg.dst_addr, seg.dst_block_stride, seg.length, db, pieces, chunk)
    want = np.zeros_like(dst.buffer)
    s0, d0 = src.buffer.ctypes.data, dst.buffer.ctypes.data
    for k in range(len(seg)):
        n = int(seg.length[k])
        for s, d in zip(sb.tolist(), db.tolist(), strict=True):
            a = int(seg.src_addr[k] + s * seg.src_block_stride[k]) - s0
            b = int(seg.dst_addr[k] + d * seg.dst_block_stride[k]) - d0
            want[b : b + n] = src.buffer[a : a + n]
    return np.array_equal(want, dst.buffer)


def test_gather_then_scatter_moves_exactly_the_runs():
    assert round_trip()


def test_a_scatter_in_the_wrong_order_is_caught():
    """Negative control: the same oracle fails when the scatter pairs runs with the wrong blocks."""
    assert not round_trip(reverse_pieces=True)


def test_a_huge_stage_allocates_nothing_beyond_the_buffer():
    """A peer names the largest Stage the wire allows (65536 block ids, 4096 runs of 1 MiB each): the stager refuses
    it before building anything (a part cannot read more than this worker's KV), and no more than a few MiB are
    allocated while it answers; the staging buffer stays the one allocated at start."""
    g = KVGeometry(num_layers=2, num_kv_heads=1, head_size=16, dtype="float32", block_size=16)
    side = Side("tp=1", WorkerRank(0, 0), g, 64, seed=1)
    stager = Stager(side.memory, 1 << 20, 1 << 18).start()
    try:
        base = side.memory.layers[0].addr
        msg = wire.Stage(
            request_id="r",
            engine_id="e",
            worker=wire.Worker(),
            block_ids=(0,) * 65536,
            src_addr=(base,) * 4096,
            block_stride=(1,) * 4096,
            length=(1 << 10,) * 4096,
            chunk_bytes=1 << 18,
        )
        tracemalloc.start()
        answer = stager.answer(msg, until=1e12, epoch="x")
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert (
            isinstance(answer, wire.ErrorReply)
            and answer.message.endswith("too_large")
            and answer.reason is wire.Refusal.STAGE
        ), answer
        assert peak < 8 << 20, peak
        assert stager.buffer.nbytes == 1 << 20 and stager.sessions == 0 and stager.free_slots == stager.num_slots
    finally:
        stager.close()


def test_sessions_are_bounded_by_the_slots():
    """Every session takes its slots at its first chunk or none: the third reader of a two-session buffer is told
    "busy" (it then reads directly), and a finished session gives its slots back."""
    g = KVGeometry(num_layers=2, num_kv_heads=1, head_size=16, dtype="float32", block_size=16)
    side = Side("tp=1", WorkerRank(0, 0), g, 64, seed=1)
    seg_len = side.memory.layers[0].block_stride
    stager = Stager(side.memory, 4 * 4096, 4096).start()  # 4 slots: two sessions of DEPTH 2

    def stage(worker: int) -> wire.Message:
        lk = side.memory.layers[0]
        return stager.answer(
            wire.Stage(
                request_id="r",
                engine_id="e",
                worker=wire.Worker(tp=worker),
                block_ids=(1, 5, 9),
                src_addr=(lk.addr,),
                block_stride=(lk.block_stride,),
                length=(seg_len,),
                chunk_bytes=4096,
            ),
            until=1e12,
            epoch="x",
        )

    try:
        assert isinstance(stage(0), wire.Staged) and isinstance(stage(1), wire.Staged)
        third = stage(2)
        assert isinstance(third, wire.ErrorReply) and third.reason is wire.Refusal.BUSY, third
        stager.finish("r", "e", str(wire.Worker(tp=0)))
        assert isinstance(stage(2), wire.Staged)
        assert stager.drop({"r"}, now=0.0) == 2 and stager.free_slots == 4
    finally:
        stager.close()


def test_the_model_follows_the_path():
    from kvbridge.core.staging import HOST_MEMORY, NETWORK_TCP, cost_model

    assert cost_model(True, "self,sm,cma,tcp") is HOST_MEMORY
    assert cost_model(False, "self,sm,cma,tcp") is NETWORK_TCP  # another host: only tcp reaches it
    assert cost_model(True, "tcp") is NETWORK_TCP
    assert cost_model(False, "rc,tcp") is HOST_MEMORY  # RDMA: not measured, descriptors cheap
    assert cost_model(False, None) is HOST_MEMORY
    assert NETWORK_TCP.desc_s > HOST_MEMORY.desc_s
