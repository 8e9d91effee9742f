"""Several KV-cache groups (vLLM's hybrid KV-cache manager): the block lists per group and the bytes they move.

Pure core (`kvbridge.core.groups`, `kvbridge.core.descriptors`), no vLLM: vLLM's sliding-window rule is restated
as a brute force over token positions, and copies are simulated on byte buffers laid out as vLLM 0.32 lays out a
hybrid model's KV cache (the i-th layer of every group shares the i-th tensor of one pool).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.core.descriptors import worker_descriptors
from kvbridge.core.errors import IncompatiblePeerError, LayoutError, RequestParamsError
from kvbridge.core.groups import (
    GROUP_SHIFT,
    NULL_BLOCK,
    CacheGroup,
    check_remote_lists,
    load_pairs,
    prefill_lists,
    tag,
    tagged_lists,
    untag,
)
from kvbridge.core.memory import Region, WorkerMemory, layer_from_strides
from kvbridge.core.plan import make_plan
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank


def brute_skipped(num_tokens: int, window: int, block: int) -> int:
    """Blocks all of whose tokens lie before the window of the next token (position num_tokens attends to
    positions num_tokens - window + 1 .. num_tokens, as vLLM's SlidingWindowManager says)."""
    first_needed = num_tokens - window + 1
    return sum(1 for b in range(-(-num_tokens // block)) if (b + 1) * block - 1 < first_needed)


@given(st.integers(1, 3000), st.integers(1, 600), st.sampled_from([1, 16, 32, 128]))
def test_skipped_blocks_follow_vllms_sliding_window_rule(num_tokens, window, block):
    group = CacheGroup(block, window)
    assert group.skipped_blocks(num_tokens) == brute_skipped(num_tokens, window, block)
    assert group.live_blocks(num_tokens) == group.num_blocks(num_tokens) - group.skipped_blocks(num_tokens)
    assert CacheGroup(block).live_blocks(num_tokens) == group.num_blocks(num_tokens)


def table(group: CacheGroup, num_tokens: int, ids: list[int], extra: int = 0) -> list[int]:
    """A request's block table as vLLM's manager holds it: null blocks for the skipped ones, then live ids."""
    n = group.num_blocks(num_tokens) + extra
    skipped = group.skipped_blocks(num_tokens)
    return [NULL_BLOCK] * skipped + ids[: n - skipped]


@settings(max_examples=300)
@given(
    st.integers(1, 2000),
    st.integers(1, 400),
    st.sampled_from([16, 32, 128]),
    st.integers(0, 1),
    st.data(),
)
def test_the_decode_loads_exactly_the_blocks_its_manager_holds_from_the_same_positions(
    num_tokens, window, block, extra, data
):
    """For a full and a sliding-window group: the prefill publishes its live blocks; the decode pairs each of its
    live blocks (from its first uncached position) with the prefill's block at the same position."""
    groups = (CacheGroup(block), CacheGroup(block, window))
    nb = groups[0].num_blocks(num_tokens) + 1
    pool = data.draw(st.permutations(range(1, 4 * nb + 1)))
    prefill_tables = [table(g, num_tokens, pool[i * nb : (i + 1) * nb], extra) for i, g in enumerate(groups)]
    decode_tables = [table(g, num_tokens, pool[(2 + i) * nb : (3 + i) * nb]) for i, g in enumerate(groups)]
    published = prefill_lists(groups, prefill_tables, num_tokens)
    check_remote_lists(groups, published, num_tokens)
    first = data.draw(st.integers(0, groups[0].num_blocks(num_tokens)))
    for g, group in enumerate(groups):
        assert len(published[g]) == group.live_blocks(num_tokens)
        src, dst = load_pairs(group, decode_tables[g], published[g], num_tokens, first)
        want = [
            (prefill_tables[g][pos], decode_tables[g][pos])
            for pos in range(first, group.num_blocks(num_tokens))
            if decode_tables[g][pos] != NULL_BLOCK
        ]
        assert list(zip(src, dst, strict=True)) == want
        assert NULL_BLOCK not in src + dst


def test_a_block_the_decode_needs_but_the_prefill_freed_is_refused():
    group = CacheGroup(32, 64)
    local = table(group, 300, list(range(1, 20)))  # 7 null, 3 live
    with pytest.raises(RequestParamsError, match="needed here but the prefill holds only blocks 8-9"):
        load_pairs(group, local, [11, 12], 300, 0)
    with pytest.raises(RequestParamsError, match="group 1: 2 remote blocks, the prompt needs 3 to 10"):
        check_remote_lists((CacheGroup(32), group), [list(range(1, 11)), [11, 12]], 300)
    with pytest.raises(RequestParamsError, match="2 KV-cache groups"):
        check_remote_lists((CacheGroup(32), group, group), [[1], [2]], 300)
    with pytest.raises(RequestParamsError, match="null block after a live one"):
        prefill_lists((group,), [[0, 5, 0, 6, 7, 8, 9, 10, 11, 12]], 300)


@given(st.lists(st.tuples(st.lists(st.integers(0, (1 << GROUP_SHIFT) - 1), max_size=8)), max_size=5))
def test_tagged_ids_round_trip_and_group_0_is_untouched(groups):
    pairs = [(ids[0], ids[0][::-1]) for ids in groups]
    src, dst = tagged_lists(pairs)
    g, ids = untag(np.asarray(src, dtype=np.int64))
    assert ids.tolist() == [b for s, _ in pairs for b in s]
    assert g.tolist() == [i for i, (s, _) in enumerate(pairs) for _ in s]
    assert len(dst) == len(src)
    assert tag(0, [5, 7]) == [5, 7]
    with pytest.raises(RequestParamsError):
        tag(1, [1 << GROUP_SHIFT])
    with pytest.raises(LayoutError):
        tag(64, [1])


# -- bytes: aliasing groups, different PP splits on the two sides ------------------------------------------------

HEADS, HEAD, BLOCK, ITEM = 2, 8, 4, 4
ROW = 2 * HEAD * ITEM  # K and V of one (head, token)
PAGE = HEADS * BLOCK * ROW


def hybrid_memory(layers: list[int], group_of: dict[int, int], num_blocks: int, base: int) -> WorkerMemory:
    """One worker's KV as vLLM lays out a hybrid model: the i-th layer of every group in the i-th tensor."""
    by_group: dict[int, list[int]] = {}
    for n in layers:
        by_group.setdefault(group_of[n], []).append(n)
    slots = max(len(v) for v in by_group.values())
    out = []
    for g, members in by_group.items():
        for i, n in enumerate(members):
            out.append(
                dataclass_replace_group(
                    layer_from_strides(
                        n,
                        0,
                        base + i * num_blocks * PAGE,
                        "BHNC",
                        (num_blocks, HEADS, BLOCK, 2 * HEAD),
                        (HEADS * BLOCK * 2 * HEAD, BLOCK * 2 * HEAD, 2 * HEAD, 1),
                        ITEM,
                    ),
                    g,
                )
            )
    groups = len(set(group_of.values()))
    return WorkerMemory(
        (Region(base, slots * num_blocks * PAGE),), tuple(sorted(out, key=lambda lk: lk.layer)), num_groups=groups
    )


def dataclass_replace_group(lk, group):
    import dataclasses

    return dataclasses.replace(lk, group=group)


def copy(descs, src_buf, src_base, dst_buf, dst_base) -> None:
    for s, d, n in zip(descs.src_addr.tolist(), descs.dst_addr.tolist(), descs.length.tolist(), strict=True):
        dst_buf[d - dst_base : d - dst_base + n] = src_buf[s - src_base : s - src_base + n]


def block_bytes(buf, base, memory: WorkerMemory, layer: int, block: int) -> bytes:
    lk = memory.layer(layer)
    start = lk.addr - base + block * lk.block_stride
    return bytes(buf[start : start + PAGE])


def test_each_layer_is_copied_with_its_own_groups_blocks_across_pp_splits():
    """6 layers alternating sliding (group 0) and full (group 1), prefill pp=2 -> decode pp=1: the tensors the
    layers share differ on the two sides (prefill stage 1 pairs layer 3 with 4, the decode pairs 2 with 3, 4 with
    5), so only a per-layer copy with each layer's group's blocks gives the decode the prefill's KV."""
    group_of = {n: n % 2 for n in range(6)}
    geometry = KVGeometry(6, HEADS, HEAD, "float32", BLOCK)
    plan = make_plan(ParallelLayout(pp=2), ParallelLayout(pp=1), geometry)
    nb = 12
    bases = {WorkerRank(0, 0): 1 << 20, WorkerRank(1, 0): 1 << 24}
    sources = {
        WorkerRank(0, 0): hybrid_memory([0, 1, 2], group_of, nb, bases[WorkerRank(0, 0)]),
        WorkerRank(1, 0): hybrid_memory([3, 4, 5], group_of, nb, bases[WorkerRank(1, 0)]),
    }
    dst_base = 1 << 28
    dst = hybrid_memory(list(range(6)), group_of, nb, dst_base)
    rng = np.random.default_rng(7)
    src_bufs = {r: rng.integers(0, 256, m.regions[0].nbytes, dtype=np.uint8) for r, m in sources.items()}
    dst_buf = np.zeros(dst.regions[0].nbytes, dtype=np.uint8)
    # a block id belongs to one group at a time, on each side
    pairs = [([1, 2], [9, 10]), ([3, 4, 5], [6, 7, 8])]  # group 0 (sliding, in-window), group 1 (full)
    src_ids, dst_ids = tagged_lists(pairs)
    descs = worker_descriptors(plan, WorkerRank(0, 0), dst, sources, src_ids, dst_ids)
    for rank, d in descs.items():
        copy(d, src_bufs[rank], bases[rank], dst_buf, dst_base)
    for layer in range(6):
        rank = WorkerRank(0 if layer < 3 else 1, 0)
        for r, d in zip(*pairs[group_of[layer]], strict=True):
            got = block_bytes(dst_buf, dst_base, dst, layer, d)
            assert got == block_bytes(src_bufs[rank], bases[rank], sources[rank], layer, r), (layer, r, d)
    moved = sum(d.nbytes for d in descs.values())
    assert moved == (3 * 2 + 3 * 3) * PAGE  # three sliding layers x 2 blocks + three full layers x 3 blocks


def test_a_peer_whose_layer_is_in_another_group_is_refused_and_untagged_ids_stay_plain():
    geometry = KVGeometry(2, HEADS, HEAD, "float32", BLOCK)
    plan = make_plan(ParallelLayout(), ParallelLayout(), geometry)
    rank = WorkerRank(0, 0)
    dst = hybrid_memory([0, 1], {0: 0, 1: 1}, 4, 1 << 20)
    swapped = hybrid_memory([0, 1], {0: 1, 1: 0}, 4, 1 << 24)
    src_ids, dst_ids = tagged_lists([([1], [2]), ([3], [1])])
    with pytest.raises(IncompatiblePeerError, match="KV-cache group"):
        worker_descriptors(plan, rank, dst, {rank: swapped}, src_ids, dst_ids)
    with pytest.raises(RequestParamsError, match="outside"):
        worker_descriptors(plan, rank, dst, {rank: dst}, [2 << GROUP_SHIFT], [2 << GROUP_SHIFT])
    one = WorkerMemory(dst.regions, tuple(dataclass_replace_group(lk, 0) for lk in dst.layers))
    with pytest.raises(RequestParamsError, match="outside"):  # a one-group engine never reads a tagged id
        worker_descriptors(plan, rank, one, {rank: one}, src_ids, dst_ids)


# -- kv_transfer_params ----------------------------------------------------------------------------------------


def test_params_carry_one_list_per_group_signed_and_in_nixls_format_too():
    from kvbridge.wire.params import PrefillDone, parse_prefill_done

    done = PrefillDone(
        remote_engine_id="e",
        remote_request_id="r",
        remote_block_ids=[],
        remote_group_block_ids=[[7, 8, 9], [1, 2, 3, 4, 5]],
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_layout="pp=1,tp=1",
    ).signed(b"k" * 32)
    back = parse_prefill_done(done.to_dict())
    assert back == done and back.group_block_ids == ([7, 8, 9], [1, 2, 3, 4, 5]) and back.verify(b"k" * 32)
    tampered = parse_prefill_done(dict(done.to_dict(), remote_group_block_ids=[[9, 8, 7], [1, 2, 3, 4, 5]]))
    assert not tampered.verify(b"k" * 32)
    nixl = dict(done.to_dict(), remote_block_ids=[[7, 8, 9], [1, 2, 3, 4, 5]], remote_group_block_ids=[])
    assert parse_prefill_done(nixl).group_block_ids == ([7, 8, 9], [1, 2, 3, 4, 5])
    assert parse_prefill_done(dict(nixl, remote_block_ids=[[4, 5]])).group_block_ids == ([4, 5],)  # one group
    with pytest.raises(RequestParamsError):
        parse_prefill_done(dict(done.to_dict(), remote_block_ids=[1]))  # both set
