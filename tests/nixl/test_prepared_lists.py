"""Prepared descriptor lists: the table's math (every run of every block, named by index) and real NIXL READs
through `NixlTransport.prepare` / `read_prepared`, in one process and through the decode runtime's processes."""

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.core.descriptors import PreparedTable, block_runs, expand, prefer_prepared, worker_descriptors
from kvbridge.core.errors import RequestParamsError, TransferError
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.plan import make_plan
from kvbridge.core.segments import worker_segments
from kvbridge.core.topology import KVGeometry, ParallelLayout
from kvbridge.transport.backoff import Backoff
from kvbridge.transport.nixl import NixlTransport

GEOMETRY = KVGeometry(num_layers=4, num_kv_heads=4, head_size=8, dtype="float32", block_size=4)
VLLM_LAYOUTS = ["LBNHC", "LBHNC"]  # vLLM 0.32's GPU layouts (pages of one geometry: any pair copies)
PAIRS = [("pp=1", "pp=1"), ("pp=2", "tp=2"), ("tp=2", "pp=1"), ("pp=1,tp=2", "pp=2,tp=1"), ("tp=4", "tp=2")]


def memories(text: str, layout: str, num_blocks: int, base: int, device: int):
    parallel = ParallelLayout.parse(text)
    out = {}
    for i, rank in enumerate(parallel.workers()):
        layers = parallel.stage_layers(GEOMETRY.num_layers, rank.pp)
        heads = parallel.kv_heads(GEOMETRY.num_kv_heads, rank.tp)
        out[rank] = synthesize_memory(
            layout, GEOMETRY, list(layers), len(heads), num_blocks, base + i * (1 << 30), device
        )
    return parallel, out


def tables(pair, layouts, src_blocks_n, dst_blocks_n):
    """(decode rank, prefill rank) -> (segments, table, source memory, destination memory)."""
    (ptext, dtext), (lp, ld) = pair, layouts
    player, src = memories(ptext, lp, src_blocks_n, 1 << 40, 0)
    dlayer, dst = memories(dtext, ld, dst_blocks_n, 1 << 44, 1)
    plan = make_plan(player, dlayer, GEOMETRY)
    out = {}
    for dw, mem in dst.items():
        for pw, segments in worker_segments(plan, dw, mem, src).items():
            out[(dw, pw)] = (segments, PreparedTable(segments, src_blocks_n, dst_blocks_n), src, mem, plan)
    return out


def at(side, idx):
    addr, length, region = side
    return addr[idx], length[idx], region[idx]


@settings(max_examples=60)
@given(
    pair=st.sampled_from(PAIRS),
    layouts=st.tuples(st.sampled_from(VLLM_LAYOUTS), st.sampled_from(VLLM_LAYOUTS)),
    data=st.data(),
)
def test_the_tables_at_a_requests_indices_are_its_descriptors(pair, layouts, data):
    """Both prepared sides, taken at `indices`, are `expand`'s descriptors in its order; coalesced, they are the
    per-request path's descriptors (so either path moves the same bytes)."""
    src_n, dst_n = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12))
    n = data.draw(st.integers(0, min(src_n, dst_n)))
    sb = np.array(data.draw(st.permutations(range(src_n)))[:n], dtype=np.int64)
    db = np.array(data.draw(st.permutations(range(dst_n)))[:n], dtype=np.int64)
    for (dw, pw), (segments, table, src, dst, plan) in tables(pair, layouts, src_n, dst_n).items():
        src_idx, dst_idx = table.indices(sb, db)
        assert src_idx.dtype == dst_idx.dtype == np.int32
        assert len(src_idx) == len(dst_idx) == len(segments) * n
        want = expand(segments, sb, db)
        s_addr, s_len, s_region = at(table.src_side(), src_idx)
        d_addr, d_len, d_region = at(table.dst_side(), dst_idx)
        np.testing.assert_array_equal(s_addr, want.src_addr)
        np.testing.assert_array_equal(d_addr, want.dst_addr)
        np.testing.assert_array_equal(s_len, want.length)
        np.testing.assert_array_equal(d_len, want.length)
        np.testing.assert_array_equal(s_region, want.src_region)
        np.testing.assert_array_equal(d_region, want.dst_region)
        assert table.nbytes(n) == want.nbytes
        per_request = worker_descriptors(plan, dw, dst, src, sb, db)[pw]
        assert per_request.nbytes == want.nbytes
        assert len(table.src_side()[0]) == table.src_entries == len(segments) * src_n


def test_indices_refuse_blocks_outside_the_tables():
    (segments, table, *_), *_ = tables(PAIRS[0], ("LBNHC", "LBNHC"), 8, 6).values()
    with pytest.raises(RequestParamsError, match="destination block id 6"):
        table.indices([0, 1], [2, 6])
    with pytest.raises(RequestParamsError, match="differ in length"):
        table.indices([0, 1], [2])
    with pytest.raises(ValueError, match="blocks on both sides"):
        PreparedTable(segments, 0, 4)


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30))
def test_block_runs_counts_breaks(pairs):
    sb = np.array([p[0] for p in pairs], dtype=np.int64)
    db = np.array([p[1] for p in pairs], dtype=np.int64)
    runs = 0
    for i in range(len(pairs)):
        if i == 0 or not (sb[i] == sb[i - 1] + 1 and db[i] == db[i - 1] + 1):
            runs += 1
    assert block_runs(sb, db) == runs


def test_contiguous_blocks_keep_coalescing_scattered_ones_are_prepared():
    """Whole-block runs (LBNHC, same TP) of consecutive blocks coalesce 1 per layer: the per-request path; the
    same blocks scattered, or 1-run-per-token layouts, go through the prepared table."""
    (segments, *_), *_ = tables(PAIRS[0], ("LBNHC", "LBNHC"), 64, 64).values()
    contiguous = np.arange(1, 33), np.arange(2, 34)
    scattered = np.arange(0, 64, 2), np.arange(1, 64, 2)
    assert not prefer_prepared(segments, *contiguous)
    assert prefer_prepared(segments, *scattered)
    for segments, *_rest in tables(("pp=1", "tp=2"), ("LBNHC", "LBNHC"), 64, 64).values():
        assert prefer_prepared(segments, *contiguous)  # heads interleaved per token: nothing coalesces


# -- real NIXL in one process: two agents, DRAM --------------------------------------------------------------


def wait(reader, target, transfer, got, timeout_s=20.0):
    """Poll the READ; the target's progress (collected into `got`) lets the connection complete."""
    backoff, deadline = Backoff(), time.monotonic() + timeout_s
    while not reader.poll(transfer):
        got += [m for msgs in target.notifications().values() for m in msgs]
        assert time.monotonic() < deadline, "READ not done"
        backoff.sleep()


@pytest.mark.nixl
@pytest.mark.parametrize(("pair", "layout"), [(("pp=1", "pp=1"), "LBNHC"), (("pp=1", "tp=2"), "LBNHC")])
def test_prepared_reads_move_exactly_the_requests_bytes(pair, layout):
    ptext, dtext = pair
    nb = 16
    player, dlayer = ParallelLayout.parse(ptext), ParallelLayout.parse(dtext)
    size = synthesize_memory(layout, GEOMETRY, list(range(4)), 4, nb, 0).regions[0].nbytes
    src_buf = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    src = {r: synthesize_memory(layout, GEOMETRY, list(range(4)), 4, nb, src_buf.data_ptr()) for r in player.workers()}
    dst_bufs, dst = {}, {}
    for rank in dlayer.workers():
        heads = len(dlayer.kv_heads(4, rank.tp))
        n = synthesize_memory(layout, GEOMETRY, list(range(4)), heads, nb, 0).regions[0].nbytes
        dst_bufs[rank] = torch.zeros(n, dtype=torch.uint8)
        dst[rank] = synthesize_memory(layout, GEOMETRY, list(range(4)), heads, nb, dst_bufs[rank].data_ptr())
    want_bufs = {r: torch.zeros_like(b) for r, b in dst_bufs.items()}
    plan = make_plan(player, dlayer, GEOMETRY)
    sb, db = np.array([3, 9, 0, 14, 7]), np.array([11, 2, 5, 6, 15])
    (prank,) = player.workers()
    got: list[bytes] = []
    with NixlTransport("prep-target") as target, NixlTransport("prep-reader") as reader:
        target.register(src[prank])
        for rank in dlayer.workers():
            reader.register(dst[rank])
        peer = reader.add_peer(target.agent_metadata())
        for dw in dlayer.workers():
            segments = worker_segments(plan, dw, dst[dw], src)[prank]
            prepared = reader.prepare(peer, PreparedTable(segments, nb, nb), dst[dw], src[prank])
            src_idx, dst_idx = prepared.table.indices(sb, db)
            for _ in range(2):  # the same prepared lists serve several requests
                dst_bufs[dw].zero_()
                transfer = reader.read_prepared(prepared, src_idx, dst_idx, b"done-" + str(dw).encode())
                assert transfer.nbytes == segments.block_bytes * len(sb)
                wait(reader, target, transfer, got)
                reader.release(transfer)
            # the reference: the per-request descriptors applied by hand
            descs = worker_descriptors(plan, dw, dst[dw], src, sb, db)[prank]
            s0, d0 = src_buf.data_ptr(), dst_bufs[dw].data_ptr()
            for s, d, n in zip(descs.src_addr.tolist(), descs.dst_addr.tolist(), descs.length.tolist(), strict=True):
                want_bufs[dw][d - d0 : d - d0 + n] = src_buf[s - s0 : s - s0 + n]
            assert torch.equal(dst_bufs[dw], want_bufs[dw])
        deadline = time.monotonic() + 10
        while len(got) < 2 * len(dst) and time.monotonic() < deadline:
            got += [m for msgs in target.notifications().values() for m in msgs]
            time.sleep(0.01)
        assert sorted(got) == sorted(b"done-" + str(dw).encode() for dw in dst for _ in range(2))
        reader.remove_peer(peer)
        assert prepared.released
        with pytest.raises(TransferError, match="released"):
            reader.read_prepared(prepared, src_idx, dst_idx, b"x")


# -- the decode runtime with prepared lists on: real worker processes ---------------------------------------


@pytest.mark.nixl
@pytest.mark.parametrize(
    ("prefill", "decode", "heads"),
    [
        ("pp=2,tp=1", "pp=1,tp=2", 4),
        pytest.param("pp=1,tp=1", "pp=2,tp=2", 4, marks=pytest.mark.matrix),
        pytest.param("pp=1", "pp=1", 2, marks=pytest.mark.matrix),
    ],
)
def test_the_decode_runtime_reads_through_prepared_lists(prefill, decode, heads, monkeypatch, transfers_forked):
    """The same checks as test_transfer_processes, with KVBRIDGE_NIXL_PREPARED_LISTS=1 in every worker process
    (scattered blocks: each read goes through its peer's prepared lists; two requests reuse them)."""
    from kvbridge.runtime.prepared_reads import PREPARED_LISTS_ENV
    from kvbridge.testing.transfer_scenario import Scenario, release_problems, run_transfer

    monkeypatch.setenv(PREPARED_LISTS_ENV, "1")
    scenario = Scenario(
        ParallelLayout.parse(prefill),
        ParallelLayout.parse(decode),
        KVGeometry(num_layers=4, num_kv_heads=heads, head_size=32, dtype="float32", block_size=16),
        num_blocks=48,
        request_blocks=9,
        seed=7,
        repeats=2,
    )
    result = run_transfer(scenario, timeout_s=150)
    assert len(result["decode"]) == scenario.decode.workers_per_engine
    for worker in result["decode"]:
        assert worker["ok"] and not worker["failed"], worker
        assert worker["exact"] and worker["untouched_clean"], worker
    assert release_problems(scenario, result) == []


def test_the_switch_is_off_unless_asked_for(monkeypatch):
    from kvbridge.core.config import BridgeConfig
    from kvbridge.runtime.prepared_reads import PREPARED_LISTS_ENV, prepared_lists

    monkeypatch.delenv(PREPARED_LISTS_ENV, raising=False)
    assert not prepared_lists(BridgeConfig())
    monkeypatch.setenv(PREPARED_LISTS_ENV, "1")
    assert prepared_lists(BridgeConfig())
    monkeypatch.setenv(PREPARED_LISTS_ENV, "0")
    assert not prepared_lists(BridgeConfig())
