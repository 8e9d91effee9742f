"""Transfer plans: every (layer, KV head) of every decode worker read exactly once, from a holder."""

from collections import Counter
from itertools import pairwise

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvbridge.core.errors import LayoutError
from kvbridge.core.plan import make_plan
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank


@st.composite
def layout_pairs(draw):
    heads = draw(st.sampled_from([1, 2, 4, 8, 16]))
    layers = draw(st.integers(1, 64))

    def layout():
        pp = draw(st.integers(1, min(8, layers)))
        tp = draw(st.sampled_from([t for t in (1, 2, 4, 8, 16) if heads % t == 0 or t % heads == 0]))
        partition = None
        if pp > 1 and draw(st.booleans()) and layers >= pp:
            cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1)))
            bounds = [0, *cuts, layers]
            partition = tuple(b - a for a, b in pairwise(bounds))
        return ParallelLayout(pp=pp, tp=tp, layer_partition=partition)

    prefill, decode = layout(), layout()
    assume(prefill.layer_partition is None or len(prefill.layer_partition) == prefill.pp)
    return prefill, decode, KVGeometry(layers, heads, 64)


def check_plan_covers_exactly_once(prefill, decode, geometry):
    plan = make_plan(prefill, decode, geometry)
    layers, heads = geometry.num_layers, geometry.num_kv_heads
    for dw in decode.workers():
        got = Counter()
        for read in plan.reads_of(dw):
            pw = read.prefill_worker
            held_layers = prefill.stage_layers(layers, pw.pp)
            held_heads = prefill.kv_heads(heads, pw.tp)
            assert read.num_heads >= 1 and read.layers
            for layer in read.layers:
                assert layer in held_layers, f"{read} reads layer {layer} that {pw} does not hold"
                for head in range(*read.kv_heads):
                    assert head in held_heads, f"{read} reads head {head} that {pw} does not hold"
                    got[(layer, head)] += 1
        wanted = {
            (layer, head) for layer in decode.stage_layers(layers, dw.pp) for head in decode.kv_heads(heads, dw.tp)
        }
        assert set(got) == wanted
        assert all(count == 1 for count in got.values())
    return plan


@given(layout_pairs())
def test_every_pair_is_covered_exactly_once(pair):
    check_plan_covers_exactly_once(*pair)


@pytest.mark.parametrize("p", [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4)])
@pytest.mark.parametrize("d", [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4)])
@pytest.mark.parametrize("heads", [1, 2, 4, 8])
def test_layout_grid_plans_are_exact(p, d, heads):
    """Every pp, tp in {1, 2, 4} on both sides, as the connector issue asks, with 1 to 8 KV heads."""
    geometry = KVGeometry(num_layers=10, num_kv_heads=heads, head_size=64)
    check_plan_covers_exactly_once(ParallelLayout(pp=p[0], tp=p[1]), ParallelLayout(pp=d[0], tp=d[1]), geometry)


@given(layout_pairs())
def test_replicated_heads_are_spread(pair):
    """Decode workers needing the same (layer, head) use min(#readers, #replicas) prefill replicas."""
    prefill, decode, geometry = pair
    plan = make_plan(prefill, decode, geometry)
    sources: dict[tuple[int, int], set[WorkerRank]] = {}
    readers: Counter = Counter()
    for read in plan:
        for layer in read.layers:
            for head in range(*read.kv_heads):
                sources.setdefault((layer, head), set()).add(read.prefill_worker)
                readers[(layer, head)] += 1
    replicas = prefill.head_replicas(geometry.num_kv_heads)
    for key, used in sources.items():
        assert len(used) == min(readers[key], replicas)


def test_pp2_to_tp2_example():
    plan = make_plan(ParallelLayout(pp=2), ParallelLayout(tp=2), KVGeometry(28, 4, 128))
    simple = [(r.decode_worker.tp, r.prefill_worker.pp, r.layers[0], r.layers[-1], r.kv_heads) for r in plan]
    assert simple == [
        (0, 0, 0, 13, (0, 2)),
        (0, 1, 14, 27, (0, 2)),
        (1, 0, 0, 13, (2, 4)),
        (1, 1, 14, 27, (2, 4)),
    ]
    assert plan.readers_of(WorkerRank(1, 0)) == (WorkerRank(0, 0), WorkerRank(0, 1))
    assert plan.peers_of(WorkerRank(0, 1)) == (WorkerRank(0, 0), WorkerRank(1, 0))


def test_unread_replicas_have_no_readers():
    # Prefill tp=4 over 2 heads holds every head twice; a tp=1 decode worker needs each head of its one layer
    # once: a layer is not cut, so one replica of each head is read and the other is not.
    plan = make_plan(ParallelLayout(tp=4), ParallelLayout(tp=1), KVGeometry(1, 2, 64))
    readers = {pw: plan.readers_of(pw) for pw in ParallelLayout(tp=4).workers()}
    assert sum(1 for r in readers.values() if r) == 2
    assert sum(len(r) for r in readers.values()) == 2


def test_a_single_reader_splits_its_layers_over_the_replicas():
    # The same layouts with 4 layers: each head's layers come half from each of its two replicas.
    plan = make_plan(ParallelLayout(tp=4), ParallelLayout(tp=1), KVGeometry(4, 2, 64))
    simple = [(r.prefill_worker.tp, r.layers, r.kv_heads) for r in plan]
    assert simple == [(0, (0, 1), (0, 1)), (1, (2, 3), (0, 1)), (2, (0, 1), (1, 2)), (3, (2, 3), (1, 2))]


def test_invalid_layouts_are_refused():
    with pytest.raises(LayoutError, match="tp=3"):
        make_plan(ParallelLayout(tp=3), ParallelLayout(), KVGeometry(4, 4, 64))
    with pytest.raises(LayoutError, match="pp=5 is larger than the model's 4 layers"):
        make_plan(ParallelLayout(), ParallelLayout(pp=5), KVGeometry(4, 4, 64))
