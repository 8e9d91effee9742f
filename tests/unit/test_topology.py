"""Layer and KV-head partitions: exactly vLLM's, and clear errors for invalid layouts."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge.core.errors import LayoutError
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank


def vllm_pp_indices(num_layers: int, rank: int, size: int) -> tuple[int, int]:
    """vLLM's get_pp_indices, from the installed vLLM when there is one (skipped without vLLM; a vLLM whose
    module or function moved fails, since kvbridge must then follow it)."""
    pytest.importorskip("vllm", reason="needs vLLM")
    from vllm.distributed.utils import get_pp_indices

    return get_pp_indices(num_layers, rank, size)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("num_layers", [8, 9, 10, 11, 24, 28, 30, 61, 80])
def test_stage_layers_match_vllm(num_layers, pp):
    layout = ParallelLayout(pp=pp)
    for stage in range(pp):
        got = layout.stage_layers(num_layers, stage)
        assert (got.start, got.stop) == vllm_pp_indices(num_layers, stage, pp)


def test_stage_layers_known_values():
    # 28 layers over 3 stages: the remainder goes to the stage before the last.
    layout = ParallelLayout(pp=3)
    assert [layout.stage_layers(28, s).start for s in range(3)] == [0, 9, 19]
    assert [len(layout.stage_layers(28, s)) for s in range(3)] == [9, 10, 9]


@given(
    num_layers=st.integers(1, 200),
    pp=st.integers(1, 16),
)
def test_stages_tile_the_layers(num_layers, pp):
    layout = ParallelLayout(pp=pp)
    if pp > num_layers:
        with pytest.raises(LayoutError, match="larger than"):
            layout.check(KVGeometry(num_layers, 1, 64))
        return
    covered = [layer for stage in range(pp) for layer in layout.stage_layers(num_layers, stage)]
    assert covered == list(range(num_layers))
    for layer in range(num_layers):
        assert layer in layout.stage_layers(num_layers, layout.stage_of_layer(num_layers, layer))


def test_layer_partition_override():
    layout = ParallelLayout(pp=3, layer_partition=(2, 5, 3))
    assert [list(layout.stage_layers(10, s)) for s in range(3)] == [[0, 1], [2, 3, 4, 5, 6], [7, 8, 9]]
    with pytest.raises(LayoutError, match="sums to 10 but the model has 12"):
        layout.check(KVGeometry(12, 2, 64))
    with pytest.raises(LayoutError, match="3 entries but pp=2"):
        ParallelLayout(pp=2, layer_partition=(1, 2, 3))


@pytest.mark.parametrize(
    ("heads", "tp", "expected"),
    [
        (8, 1, [(0, 8)]),
        (8, 2, [(0, 4), (4, 8)]),
        (8, 8, [(i, i + 1) for i in range(8)]),
        (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),
        (1, 4, [(0, 1)] * 4),
        (4, 8, [(0, 1), (0, 1), (1, 2), (1, 2), (2, 3), (2, 3), (3, 4), (3, 4)]),
    ],
)
def test_kv_heads_like_vllm_qkv_linear(heads, tp, expected):
    layout = ParallelLayout(tp=tp)
    got = [(r.start, r.stop) for r in (layout.kv_heads(heads, rank) for rank in range(tp))]
    assert got == expected
    for head in range(heads):
        holders = layout.holders_of_head(heads, head)
        assert all(head in layout.kv_heads(heads, rank) for rank in holders)
        assert len(holders) == layout.head_replicas(heads)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pp=0", "pp must be a positive integer"),
        ("tp=-1", "cannot parse"),
        ("pp=2,pp=3", "pp given twice"),
        ("xx=2", "cannot parse 'xx=2'"),
        ("pp=2,partition=3", "1 entries but pp=2"),
    ],
)
def test_bad_layout_text(text, message):
    with pytest.raises(LayoutError, match=message):
        ParallelLayout.parse(text)


def test_tp_must_fit_heads():
    with pytest.raises(LayoutError, match="tp=3 must divide the 4 KV heads"):
        ParallelLayout(tp=3).check(KVGeometry(4, 4, 64))
    ParallelLayout(tp=8).check(KVGeometry(4, 4, 64))


def test_parse_round_trip():
    layout = ParallelLayout.parse("tp=2, pp=3, dp=2, partition=1:2:1")
    assert layout == ParallelLayout(pp=3, tp=2, dp=2, layer_partition=(1, 2, 1))
    assert ParallelLayout.parse(str(layout)) == layout
    assert layout.workers()[:3] == (WorkerRank(0, 0), WorkerRank(0, 1), WorkerRank(1, 0))


def test_a_bad_geometry_is_refused_naming_the_field():
    with pytest.raises(LayoutError, match="num_kv_heads must be a positive integer"):
        KVGeometry(4, 0, 64)
    with pytest.raises(LayoutError, match="dtype 'float64' is not one of"):
        KVGeometry(4, 2, 64, dtype="float64")
    assert KVGeometry(28, 4, 128).kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2
