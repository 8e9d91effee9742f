"""Mamba state groups (vLLM's `MambaSpec`, `mamba_cache_mode` "none"): the token accounting (N-1 prompt tokens move),
the one running-state block per request, state pages copied whole from the prefill worker of the same TP rank under
any PP pair, and the refusals (another TP size at startup and at the handshake, prefix caching, replicated heads).
The e2e proof through real servers is tests/e2e/test_e2e_mamba.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.core.config import BridgeConfig
from kvbridge.core.descriptors import group_descriptors
from kvbridge.core.errors import ConfigError, IncompatiblePeerError
from kvbridge.core.groups import CacheGroup, computed_tokens, load_pairs, pair_lists, prefill_lists
from kvbridge.core.memory import LayerKV, Region, WorkerMemory
from kvbridge.core.plan import make_plan
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.wire import messages as wire

STATE, ATTN = CacheGroup(1024, state=True), CacheGroup(128)
HEADS, HEAD, BLOCK, ITEM = 4, 8, 4, 4
ROW = 2 * HEAD * ITEM
NUM_LAYERS = 8  # M*M*M*M*: even layers Mamba (group 0), odd layers attention (group 1)


# -- token accounting and block lists -----------------------------------------------------------------------


@given(st.integers(1, 5000), st.integers(0, 3))
def test_a_state_group_moves_one_running_state_block_after_n_minus_1_tokens(num_prompt, spec_blocks):
    moved = computed_tokens((STATE, ATTN), num_prompt)
    assert moved == num_prompt - 1 and computed_tokens((ATTN,), num_prompt) == num_prompt
    assert STATE.num_blocks(moved) == (1 if moved else 0)
    held = [11, *range(40, 40 + spec_blocks)]  # vLLM's running-state block, then its speculative scratch blocks
    attention = list(range(100, 100 + ATTN.num_blocks(moved)))
    if moved:
        assert prefill_lists((STATE, ATTN), [held, attention], moved) == [[11], attention]
    # the state is loaded whole even when the decode holds a prefix of the prompt's attention blocks locally
    local = [5, *range(60, 60 + spec_blocks)]
    for cached in (0, moved // 2, moved):
        if moved:
            assert load_pairs(STATE, local, [11], moved, STATE.first_block(cached)) == ([11], [5])
    # negative control: under an attention group's rule the block at position 0 is not loaded once it is cached
    if moved >= 1024:
        plain = CacheGroup(1024)
        n = plain.num_blocks(moved)
        _, dst = load_pairs(plain, list(range(5, 5 + n)), list(range(11, 11 + n)), moved, plain.first_block(1024))
        assert 5 not in dst


# -- state pages across PP pairs ------------------------------------------------------------------------------


def state_bytes(tp: int) -> int:
    """One TP rank's state page (smaller than the attention page it is padded to): shrinks with TP."""
    return 96 // tp


def worker_memory(layout: ParallelLayout, rank: WorkerRank, num_blocks: int, base: int) -> WorkerMemory:
    """One worker's cache as vLLM lays out the hybrid: slot i holds the i-th Mamba layer's state pages and the i-th
    attention layer's KV (the groups alias), each block one page of the attention layer's size."""
    heads = len(layout.kv_heads(HEADS, rank.tp))
    page = heads * BLOCK * ROW
    layers = list(layout.stage_layers(NUM_LAYERS, rank.pp))
    out = []
    for kind in (0, 1):
        for slot, n in enumerate(x for x in layers if x % 2 == kind):
            addr = base + slot * num_blocks * page
            if kind == 0:
                row = state_bytes(layout.tp)
                out.append(LayerKV(n, 0, addr, num_blocks, 1, 1, row, page, row, row, group=0, state=True))
            else:
                out.append(LayerKV(n, 0, addr, num_blocks, heads, BLOCK, ROW, page, BLOCK * ROW, ROW, group=1))
    slots = max(sum(1 for x in layers if x % 2 == k) for k in (0, 1))
    region = Region(base, max(slots, 1) * num_blocks * page)
    return WorkerMemory((region,), tuple(sorted(out, key=lambda lk: lk.layer)), num_groups=2)


def read_block(buf, base, lk: LayerKV, block: int, head: int | None = None) -> bytes:
    """A state layer's page, or one KV head's bytes of an attention block."""
    start = lk.addr - base + block * lk.block_stride
    if lk.state:
        return bytes(buf[start : start + lk.row_bytes])
    start += head * lk.head_stride
    return bytes(buf[start : start + BLOCK * ROW])


def run_pair(prefill: ParallelLayout, decode: ParallelLayout, swap_tp: bool = False) -> list[str]:
    """Copy one request (state block 3 -> 6, attention blocks 1, 2 -> 4, 5) to every decode worker; the problems
    found comparing each decode worker's blocks with the prefill's (empty: every byte right)."""
    geometry = KVGeometry(NUM_LAYERS, HEADS, HEAD, "float32", BLOCK)
    plan = make_plan(prefill, decode, geometry)
    nb = 8
    rng = np.random.default_rng(11)
    bases = {r: (1 + i) << 24 for i, r in enumerate(prefill.workers())}
    sources = {r: worker_memory(prefill, r, nb, bases[r]) for r in prefill.workers()}
    bufs = {r: rng.integers(0, 256, m.regions[0].nbytes, dtype=np.uint8) for r, m in sources.items()}
    src_ids, dst_ids = pair_lists([([3], [6]), ([1, 2], [4, 5])])
    problems = []
    for dw in decode.workers():
        dst_base = 1 << 30
        dst = worker_memory(decode, dw, nb, dst_base)
        given_sources = sources
        if swap_tp:  # negative control: each prefill rank's memory named as the other rank's
            given_sources = {r: sources[WorkerRank(r.pp, 1 - r.tp)] for r in sources}
        dst_buf = np.zeros(dst.regions[0].nbytes, dtype=np.uint8)
        descs = group_descriptors(plan, dw, dst, given_sources, src_ids, dst_ids)
        for rank, d in descs.items():
            src_rank = WorkerRank(rank.pp, 1 - rank.tp) if swap_tp else rank
            for s, t, n in zip(d.src_addr.tolist(), d.dst_addr.tolist(), d.length.tolist(), strict=True):
                dst_buf[t - dst_base : t - dst_base + n] = bufs[src_rank][s - bases[src_rank] : s - bases[src_rank] + n]
        moved = sum(d.nbytes for d in descs.values())
        layers = decode.stage_layers(NUM_LAYERS, dw.pp)
        heads = decode.kv_heads(HEADS, dw.tp)
        want = sum(state_bytes(decode.tp) if n % 2 == 0 else 2 * len(heads) * BLOCK * ROW for n in layers)
        if moved != want:
            problems.append(f"{dw}: moved {moved} bytes, want {want}")
        for n in layers:
            pw = WorkerRank(prefill.stage_of_layer(NUM_LAYERS, n), dw.tp)
            src, lk = sources[pw].layer(n), dst.layer(n)
            if lk.state:
                if read_block(dst_buf, dst_base, lk, 6) != read_block(bufs[pw], bases[pw], src, 3):
                    problems.append(f"{dw}: state layer {n}")
                continue
            for h in heads:
                holder = WorkerRank(pw.pp, prefill.holders_of_head(HEADS, h)[0])
                first = prefill.kv_heads(HEADS, holder.tp).start
                theirs = sources[holder].layer(n)
                for r, d in ((1, 4), (2, 5)):
                    got = read_block(dst_buf, dst_base, lk, d, h - heads.start)
                    if got != read_block(bufs[holder], bases[holder], theirs, r, h - first):
                        problems.append(f"{dw}: layer {n} head {h} block {d}")
    return problems


LAYOUTS = [ParallelLayout(pp=p, tp=t) for p in (1, 2, 4) for t in (1, 2)]


@settings(max_examples=30)
@given(st.sampled_from(LAYOUTS), st.sampled_from((1, 2, 4)))
def test_state_pages_are_copied_whole_from_the_same_tp_rank_under_any_pp_pair(prefill, decode_pp):
    assert run_pair(prefill, ParallelLayout(pp=decode_pp, tp=prefill.tp)) == []


def test_negative_control_state_from_the_other_tp_rank_is_noticed():
    """The oracle can fail: each prefill rank's memory given as the other's (its state shard, its heads)."""
    problems = run_pair(ParallelLayout(pp=2, tp=2), ParallelLayout(pp=1, tp=2), swap_tp=True)
    assert any("state layer" in p for p in problems), problems


def test_another_tp_size_is_refused_when_state_is_planned():
    plan = make_plan(ParallelLayout(pp=2, tp=1), ParallelLayout(tp=2), KVGeometry(NUM_LAYERS, HEADS, HEAD, "float32"))
    dst = worker_memory(ParallelLayout(tp=2), WorkerRank(0, 0), 8, 1 << 30)
    sources = {r: worker_memory(ParallelLayout(pp=2), r, 8, (1 + r.pp) << 24) for r in ParallelLayout(pp=2).workers()}
    with pytest.raises(IncompatiblePeerError, match=r"tp \(Mamba state layers\) is 2 here but 1 on the peer"):
        group_descriptors(plan, WorkerRank(0, 0), dst, sources, ([0], []), ([0], []))


# -- the handshake --------------------------------------------------------------------------------------------


def reply(layout: ParallelLayout, rank: WorkerRank, state_tp: int | None = None) -> wire.HandshakeReply:
    geometry = KVGeometry(NUM_LAYERS, HEADS, HEAD, "float32", BLOCK)
    memory = worker_memory(layout, rank, 8, 1 << 24)
    if state_tp is not None:  # the state pages of another TP size's rank
        memory = dataclasses.replace(
            memory,
            layers=tuple(
                dataclasses.replace(lk, row_bytes=state_bytes(state_tp)) if lk.state else lk for lk in memory.layers
            ),
        )
    return wire.HandshakeReply.build("e", layout, 0, rank, geometry, "LBHNC", "agent", b"", memory)


def test_the_handshake_compares_state_pages_and_carries_them():
    ours = reply(ParallelLayout(), WorkerRank(0, 0))
    wire.check_compatible(ours, reply(ParallelLayout(pp=2), WorkerRank(1, 0)))  # PP may differ
    back = wire.decode(wire.encode(ours))
    assert back.state_format() == state_bytes(1) and sum(x.state for x in back.memory.layers) == 4
    with pytest.raises(IncompatiblePeerError, match="state_bytes is 96 here but 48 on the peer"):
        wire.check_compatible(ours, reply(ParallelLayout(), WorkerRank(0, 0), state_tp=2))
    request = wire.HandshakeRequest.build(
        "d", ParallelLayout(), 0, WorkerRank(0, 0), ours.geometry.to_core(), "LBHNC", ours.memory.to_core()
    )
    assert request.state_bytes == state_bytes(1)
    wire.check_compatible(ours, request)


# -- startup refusals (vLLM's specs) ----------------------------------------------------------------------------


def vllm_config(tp: int = 1, pp: int = 1, heads: int = 4):
    model = SimpleNamespace(
        get_total_num_hidden_layers=lambda: NUM_LAYERS, get_total_num_kv_heads=lambda: heads, get_head_size=lambda: 32
    )
    parallel = SimpleNamespace(
        pipeline_parallel_size=pp, tensor_parallel_size=tp, data_parallel_size=1, data_parallel_rank=0
    )
    return SimpleNamespace(model_config=model, parallel_config=parallel, cache_config=SimpleNamespace())


def hybrid_config(mode: str = "none", tp: int = 1):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    mamba = MambaSpec(block_size=1024, shapes=((3, 384 // tp), (8 // tp, 32, 16)), dtypes=(torch.float32,) * 2)
    mamba = dataclasses.replace(mamba, mamba_cache_mode=mode)
    full = FullAttentionSpec(block_size=128, num_kv_heads=4 // tp, head_size=32, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["model.layers.0.mixer"], mamba), KVCacheGroupSpec(["model.layers.1.mixer"], full)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_startup_accepts_equal_tp_and_refuses_other_layouts_naming_them():
    from kvbridge.vllm.vllm_facts import cache_groups, check_state_layout

    config = BridgeConfig(peer_tp=2)
    check_state_layout(vllm_config(tp=2, pp=2), config, hybrid_config(tp=2))
    check_state_layout(vllm_config(tp=2), BridgeConfig(), hybrid_config(tp=2))  # unknown peers: the handshake
    assert cache_groups(hybrid_config()) == (STATE, ATTN)
    with pytest.raises(ConfigError, match=r"equal TP sizes: this engine is pp=1,tp=1, its peers tp=2 \(peer_tp\)"):
        check_state_layout(vllm_config(tp=1), config, hybrid_config())
    with pytest.raises(ConfigError, match="mamba_cache_mode='align'"):
        check_state_layout(vllm_config(), BridgeConfig(), hybrid_config("align"))
    with pytest.raises(ConfigError, match="tp=8 above the model's 4 KV heads"):
        check_state_layout(vllm_config(tp=8), BridgeConfig(), hybrid_config())
