"""Several KV-cache groups (vLLM's hybrid KV-cache manager): the block lists per group and the bytes they move.

Pure core (`kvbridge.core.groups`, `kvbridge.core.descriptors`), no vLLM: vLLM's sliding-window rule is restated
as a brute force over token positions, and copies are simulated on byte buffers laid out as vLLM 0.32 lays out a
hybrid model's KV cache (the i-th layer of every group shares the i-th tensor of one pool).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.core.descriptors import group_descriptors, worker_descriptors
from kvbridge.core.errors import IncompatiblePeerError, LayoutError, RequestParamsError
from kvbridge.core.groups import (
    MAX_GROUPS,
    NULL_BLOCK,
    CacheGroup,
    check_remote_lists,
    load_pairs,
    pair_lists,
    prefill_lists,
)
from kvbridge.core.leases import LeaseBook, blocks_digest, groups_digest
from kvbridge.core.memory import Region, WorkerMemory, layer_from_strides
from kvbridge.core.plan import make_plan
from kvbridge.core.segments import worker_segments
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.peers import Engine, Peer


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


PER_GROUP = st.lists(st.lists(st.integers(1, (1 << 31) - 1), max_size=6), min_size=1, max_size=5)


@given(PER_GROUP)
def test_pair_lists_keep_each_groups_lists_apart(groups):
    remote, local = pair_lists([(ids, ids[::-1]) for ids in groups])
    assert remote == tuple(map(tuple, groups)) and local == tuple(tuple(ids[::-1]) for ids in groups)


def test_pair_lists_refuse_unequal_lists_and_too_many_groups():
    with pytest.raises(RequestParamsError, match="group 1: 2 remote blocks for 1 local"):
        pair_lists([([1], [2]), ([3, 4], [5])])
    with pytest.raises(LayoutError):
        pair_lists([([1], [1])] * (MAX_GROUPS + 1))
    with pytest.raises(LayoutError):
        pair_lists([])


@given(PER_GROUP)
def test_the_digest_names_each_groups_list_and_one_groups_is_the_plain_digest(groups):
    assert groups_digest(groups[:1]) == blocks_digest(groups[0])  # what one-group peers always sent
    edits = [groups[::-1], [g[::-1] for g in groups], [*groups, []], [[], *groups]]
    if len(groups) > 1 and groups[0]:  # a block moved into the next group: the flat order is the same
        edits.append([groups[0][:-1], [groups[0][-1], *groups[1]], *groups[2:]])
    for edited in edits:
        if edited != groups and (len(edited) > 1 or len(groups) > 1):
            assert groups_digest(edited) != groups_digest(groups), edited


def test_negative_control_a_digest_of_the_flat_list_misses_a_block_moved_between_groups():
    """The oracle can fail: the concatenated ids (what a digest that forgot the groups would name) are the same
    for a block moved from group 0 to group 1; the per-group digest is not."""
    a, b = [[1, 2], [3]], [[1], [2, 3]]
    assert blocks_digest([x for g in a for x in g]) == blocks_digest([x for g in b for x in g])
    assert groups_digest(a) != groups_digest(b)


def test_a_claim_names_each_groups_blocks_in_that_group():
    book = LeaseBook(lease_s=10)
    held = ((21, 22, 23), (31, 32))
    book.hold("r", 0.0, token="tok", prompt_hash="h", blocks=held)
    order = groups_digest(held)
    assert book.claim("r", "tok", "h", ((31,), (21,)), "d", 5, now=1.0, order=order) == "mismatch"  # swapped
    assert book.claim("r", "tok", "h", ((21,), (31,), ()), "d", 5, now=1.0, order=order) == "mismatch"
    assert book.claim("r", "tok", "h", held[::-1], "d", 5, now=1.0, order=groups_digest(held[::-1])) == "mismatch"
    assert book.claim("r", "tok", "h", ((22, 23), (31, 32)), "d", 5, now=1.0, order=order) is None


# -- bytes: aliasing groups, different PP splits on the two sides ------------------------------------------------

HEADS, HEAD, BLOCK, ITEM = 2, 8, 4, 4
ROW = 2 * HEAD * ITEM  # K and V of one (head, token)
PAGE = HEADS * BLOCK * ROW


def hybrid_memory(
    layers: list[int], group_of: dict[int, int], num_blocks: int, base: int, alias: bool = True
) -> WorkerMemory:
    """One worker's KV as vLLM lays out a hybrid model: the i-th layer of every group in the i-th tensor (`alias`
    False: every layer in a tensor of its own, so that which blocks a layer got is seen layer by layer)."""
    by_group: dict[int, list[int]] = {}
    for n in layers:
        by_group.setdefault(group_of[n] if alias else 0, []).append(n)
    slots = max(len(v) for v in by_group.values())
    out = []
    for members in by_group.values():
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
                    group_of[n],
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
    src_ids, dst_ids = pair_lists(pairs)
    descs = group_descriptors(plan, WorkerRank(0, 0), dst, sources, src_ids, dst_ids)
    for rank, d in descs.items():
        copy(d, src_bufs[rank], bases[rank], dst_buf, dst_base)
    for layer in range(6):
        rank = WorkerRank(0 if layer < 3 else 1, 0)
        for r, d in zip(*pairs[group_of[layer]], strict=True):
            got = block_bytes(dst_buf, dst_base, dst, layer, d)
            assert got == block_bytes(src_bufs[rank], bases[rank], sources[rank], layer, r), (layer, r, d)
    moved = sum(d.nbytes for d in descs.values())
    assert moved == (3 * 2 + 3 * 3) * PAGE  # three sliding layers x 2 blocks + three full layers x 3 blocks


def test_a_peer_whose_layer_is_in_another_group_is_refused_and_lists_must_match_the_groups():
    geometry = KVGeometry(2, HEADS, HEAD, "float32", BLOCK)
    plan = make_plan(ParallelLayout(), ParallelLayout(), geometry)
    rank = WorkerRank(0, 0)
    dst = hybrid_memory([0, 1], {0: 0, 1: 1}, 4, 1 << 20)
    swapped = hybrid_memory([0, 1], {0: 1, 1: 0}, 4, 1 << 24)
    src_ids, dst_ids = pair_lists([([1], [2]), ([3], [1])])
    with pytest.raises(IncompatiblePeerError, match="KV-cache group"):
        group_descriptors(plan, rank, dst, {rank: swapped}, src_ids, dst_ids)
    with pytest.raises(RequestParamsError, match="3 source and 3 destination block lists for 2 KV-cache groups"):
        group_descriptors(plan, rank, dst, {rank: dst}, [*src_ids, [1]], [*dst_ids, [1]])
    with pytest.raises(RequestParamsError, match="for 2 KV-cache groups"):  # one flat list for a two-group engine
        worker_descriptors(plan, rank, dst, {rank: dst}, [1, 3], [2, 1])
    one = WorkerMemory(dst.regions, tuple(dataclass_replace_group(lk, 0) for lk in dst.layers))
    with pytest.raises(RequestParamsError, match="for 1 KV-cache groups"):  # a one-group engine reads one list
        group_descriptors(plan, rank, one, {rank: one}, src_ids, dst_ids)
    with pytest.raises(RequestParamsError, match="outside"):
        group_descriptors(plan, rank, dst, {rank: dst}, ([1], [4]), ([2], [1]))


GROUP_LISTS = st.lists(st.lists(st.tuples(st.integers(0, 11), st.integers(0, 11)), max_size=5), min_size=2, max_size=2)


@settings(max_examples=40)
@given(st.sampled_from((1, 2, 3, 6)), GROUP_LISTS)
def test_every_layer_gets_the_blocks_of_its_group_lists_under_any_pp_split(pp, lists):
    """6 layers alternating groups 0 and 1, the prefill in `pp` stages, the decode in one: per group, random
    (remote, local) pairs (a destination block written once per group); each layer's destination blocks hold
    the prefill's blocks of its own group's pairs. Layers alias no tensor here (the test above covers aliasing),
    so a wrong group's pairs show. Swapping the two groups' lists (negative control) is noticed whenever the
    groups' pairs differ."""
    group_of = {n: n % 2 for n in range(6)}
    lists = [list({d: (r, d) for r, d in pairs}.values()) for pairs in lists]  # one source per destination block
    geometry = KVGeometry(6, HEADS, HEAD, "float32", BLOCK)
    nb = 12
    prefill = ParallelLayout(pp=pp)
    plan = make_plan(prefill, ParallelLayout(pp=1), geometry)
    stage = {r: list(prefill.stage_layers(6, r.pp)) for r in prefill.workers()}
    bases = {r: (1 + r.pp) << 20 for r in stage}
    sources = {r: hybrid_memory(stage[r], group_of, nb, bases[r], alias=False) for r in stage}
    dst_base = 1 << 28
    dst = hybrid_memory(list(range(6)), group_of, nb, dst_base, alias=False)
    rng = np.random.default_rng(pp)
    src_bufs = {r: rng.integers(0, 256, m.regions[0].nbytes, dtype=np.uint8) for r, m in sources.items()}

    def wrong_layers(pairs) -> list[int]:
        src_ids, dst_ids = pair_lists([([r for r, _ in g], [d for _, d in g]) for g in pairs])
        dst_buf = np.zeros(dst.regions[0].nbytes, dtype=np.uint8)
        for rank, d in group_descriptors(plan, WorkerRank(0, 0), dst, sources, src_ids, dst_ids).items():
            copy(d, src_bufs[rank], bases[rank], dst_buf, dst_base)
        wrong = []
        for layer in range(6):
            rank = WorkerRank(prefill.stage_of_layer(6, layer), 0)
            for r, d in lists[group_of[layer]]:
                if block_bytes(dst_buf, dst_base, dst, layer, d) != block_bytes(
                    src_bufs[rank], bases[rank], sources[rank], layer, r
                ):
                    wrong.append(layer)
        return wrong

    assert wrong_layers(lists) == []
    if set(lists[0]) != set(lists[1]):
        assert wrong_layers(lists[::-1]), lists  # each group's pairs applied to the other group's layers


def test_segments_kept_per_engine_give_the_descriptors_made_afresh():
    """A decode worker keeps each group's segments on its `Engine` (made once) and hands them to
    `group_descriptors`: the descriptors are those made from scratch, for every group's lists, and a second request
    reuses the same segments. Another memory, or a new `Engine` of the same name and agents (a restarted prefill
    engine whose memory moved), gets its own. Negative control: another group's segments give other descriptors."""
    group_of = {n: n % 2 for n in range(6)}
    geometry = KVGeometry(6, HEADS, HEAD, "float32", BLOCK)
    prefill = ParallelLayout(pp=2)
    plan = make_plan(prefill, ParallelLayout(pp=1), geometry)
    stage = {r: list(prefill.stage_layers(6, r.pp)) for r in prefill.workers()}

    def engine_at(base: int) -> tuple[Engine, dict]:
        sources = {r: hybrid_memory(stage[r], group_of, 12, base + (r.pp << 20), alias=False) for r in stage}
        peers = {r: Peer(f"agent-{r.pp}", m, "epoch") for r, m in sources.items()}
        return Engine(("p", "127.0.0.1", 1, 0), prefill, peers, plan), sources

    engine, sources = engine_at(1 << 20)
    dst = hybrid_memory(list(range(6)), group_of, 12, 1 << 28, alias=False)
    reader = WorkerRank(0, 0)
    src_ids, dst_ids = pair_lists([([1, 2], [9, 10]), ([3, 4, 5], [6, 7, 8])])

    kept = [engine.segments(reader, dst, g) for g in range(2)]
    assert engine.segments(reader, dst, 0) is kept[0] and engine.segments(reader, dst, 1) is kept[1]
    afresh = group_descriptors(plan, reader, dst, sources, src_ids, dst_ids)
    reused = group_descriptors(
        plan, reader, dst, sources, src_ids, dst_ids, group_segments=lambda g: engine.segments(reader, dst, g)
    )
    assert afresh.keys() == reused.keys()
    for rank, d in afresh.items():
        assert rows(d) == rows(reused[rank]), rank
    swapped = group_descriptors(plan, reader, dst, sources, src_ids, dst_ids, group_segments=lambda g: kept[1 - g])
    assert any(rows(d) != rows(swapped[rank]) for rank, d in afresh.items())

    other_dst = hybrid_memory(list(range(6)), group_of, 12, 1 << 29, alias=False)
    assert rows(engine.segments(reader, other_dst, 0)[WorkerRank(0, 0)]) != rows(kept[0][WorkerRank(0, 0)])
    restarted, _ = engine_at(1 << 24)
    assert rows(restarted.segments(reader, dst, 0)[WorkerRank(0, 0)]) != rows(kept[0][WorkerRank(0, 0)])


def test_kept_segments_are_each_readers_own_and_asked_only_for_a_well_formed_request():
    """Two decode workers of a pp2 decode reading one engine (the same memory object here): each gets its own
    layers' segments, as made afresh. A request with the wrong number of block lists is refused before any segments
    are asked for, and a one-group engine asks for group None."""
    group_of = {n: n % 2 for n in range(6)}
    geometry = KVGeometry(6, HEADS, HEAD, "float32", BLOCK)
    layout = ParallelLayout(pp=2)
    plan = make_plan(layout, layout, geometry)
    stage = {r: list(layout.stage_layers(6, r.pp)) for r in layout.workers()}
    sources = {r: hybrid_memory(stage[r], group_of, 12, (1 + r.pp) << 20, alias=False) for r in stage}
    engine = Engine(("p", "127.0.0.1", 1, 0), layout, {r: Peer(f"a{r.pp}", m, "e") for r, m in sources.items()}, plan)
    dst = hybrid_memory(list(range(6)), group_of, 12, 1 << 28, alias=False)
    first, second = WorkerRank(0, 0), WorkerRank(1, 0)
    for reader in (first, second, first):
        got = engine.segments(reader, dst, 0)
        fresh = worker_segments(plan, reader, dst, sources, group=0)
        assert got.keys() == fresh.keys() == {reader}, reader  # each stage reads its own stage's layers
        assert rows(got[reader]) == rows(fresh[reader])

    def never(group):
        raise AssertionError(f"segments asked for group {group} of a malformed request")

    with pytest.raises(RequestParamsError, match="3 source and 3 destination block lists for 2"):
        group_descriptors(plan, first, dst, sources, [[1], [2], [3]], [[1], [2], [3]], group_segments=never)
    one = {r: hybrid_memory(stage[r], dict.fromkeys(range(6), 0), 12, (1 + r.pp) << 20) for r in stage}
    one_dst = hybrid_memory(list(range(6)), dict.fromkeys(range(6), 0), 12, 1 << 28)
    asked = []
    group_descriptors(
        plan,
        first,
        one_dst,
        one,
        [[1]],
        [[2]],
        group_segments=lambda g: asked.append(g) or worker_segments(plan, first, one_dst, one, group=g),
    )
    assert asked == [None]


def rows(d) -> list[tuple[int, ...]]:
    return list(zip(*(getattr(d, f.name).tolist() for f in dataclasses.fields(d)), strict=True))
