"""MLA (one latent head of 576 channels, no V, on every TP rank) in the pure core, and its geometry from vLLM's
KV-cache spec: plans read each (layer, block) of the latent once per decode worker, spread over the prefill TP
ranks; pages are one run per block; vLLM's specs give 1 head, not the config's KV heads."""

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge.core.descriptors import read_descriptors
from kvbridge.core.errors import ConfigError, LayoutError
from kvbridge.core.memory import layout_nbytes, synthesize_memory
from kvbridge.core.plan import make_plan
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank, distinct_kv_heads

MLA = KVGeometry(num_layers=4, num_kv_heads=1, head_size=576, dtype="float32", block_size=16, head_size_v=0)


def test_mla_geometry_is_one_plane_of_the_latent():
    assert MLA.is_latent and MLA.token_channels == 576
    assert MLA.kv_bytes_per_token() == 4 * 576 * 4  # one latent per layer, not K and V
    gqa = KVGeometry(4, 4, 32, "float32", 128)
    assert gqa.head_size_v == 32 and not gqa.is_latent and gqa.kv_bytes_per_token() == 4 * 4 * 64 * 4
    with pytest.raises(LayoutError, match="head_size_v"):
        KVGeometry(4, 1, 576, head_size_v=-1)


@pytest.mark.parametrize(
    ("rank_heads", "tp", "shards", "config_heads", "want"),
    [
        (1, 1, 1, 4, 1),  # MLA: one latent whatever the config says
        (1, 2, 1, 4, 1),
        (1, 8, 1, 128, 1),
        (2, 2, None, 4, 4),  # plain attention: the config's heads, split
        (1, 8, None, 4, 4),  # replicated when tp > heads
        (4, 1, None, 4, 4),
    ],
)
def test_distinct_kv_heads(rank_heads, tp, shards, config_heads, want):
    assert distinct_kv_heads(rank_heads, tp, shards, config_heads) == want


def test_distinct_kv_heads_refuses_a_spec_contradicting_the_config():
    with pytest.raises(LayoutError, match="gives a tp=2 rank 1 KV heads"):
        distinct_kv_heads(1, 2, None, 4)


def mla_plan(prefill: str, decode: str, layers: int = 4):
    geometry = KVGeometry(layers, 1, 576, "float32", 16, head_size_v=0)
    return make_plan(ParallelLayout.parse(prefill), ParallelLayout.parse(decode), geometry)


def simple(plan):
    return [(str(r.decode_worker), str(r.prefill_worker), r.layers) for r in plan]


def test_mla_tp2_to_tp1_reads_half_the_layers_from_each_prefill_rank():
    assert simple(mla_plan("tp=2", "tp=1")) == [("pp0/tp0", "pp0/tp0", (0, 1)), ("pp0/tp0", "pp0/tp1", (2, 3))]


def test_mla_tp2_to_pp2_gives_each_stage_one_prefill_rank():
    assert simple(mla_plan("tp=2", "pp=2")) == [("pp0/tp0", "pp0/tp0", (0, 1)), ("pp1/tp0", "pp0/tp1", (2, 3))]


def test_mla_pp2_to_tp2_every_decode_rank_reads_the_whole_latent():
    assert simple(mla_plan("pp=2", "tp=2")) == [
        ("pp0/tp0", "pp0/tp0", (0, 1)),
        ("pp0/tp0", "pp1/tp0", (2, 3)),
        ("pp0/tp1", "pp0/tp0", (0, 1)),
        ("pp0/tp1", "pp1/tp0", (2, 3)),
    ]


def test_mla_tp2_to_tp2_each_decode_rank_reads_its_own_prefill_rank():
    assert simple(mla_plan("tp=2", "tp=2")) == [
        ("pp0/tp0", "pp0/tp0", (0, 1, 2, 3)),
        ("pp0/tp1", "pp0/tp1", (0, 1, 2, 3)),
    ]


@st.composite
def mla_layouts(draw):
    layers = draw(st.integers(1, 40))

    def layout():
        return ParallelLayout(pp=draw(st.integers(1, min(6, layers))), tp=draw(st.sampled_from([1, 2, 3, 4, 8])))

    return layout(), layout(), layers


@given(mla_layouts())
def test_mla_latent_is_read_once_per_layer_and_decode_worker_spread_over_prefill_ranks(case):
    """Each decode worker reads each of its layers exactly once, from a prefill worker of that layer's stage; the
    prefill ranks of a stage serve equal shares (+-1 layer reads) when they outnumber the decode readers, and each
    decode rank has its own prefill rank when they do not."""
    prefill, decode, layers = case
    plan = make_plan(prefill, decode, KVGeometry(layers, 1, 576, "float32", 16, head_size_v=0))
    served: Counter = Counter()
    for dw in decode.workers():
        got = Counter()
        for read in plan.reads_of(dw):
            assert read.kv_heads == (0, 1)
            for layer in read.layers:
                assert layer in prefill.stage_layers(layers, read.prefill_worker.pp)
                got[layer] += 1
                served[read.prefill_worker] += 1
        assert got == Counter(decode.stage_layers(layers, dw.pp))
    for stage in range(prefill.pp):
        loads = [served[WorkerRank(stage, t)] for t in range(prefill.tp)]
        if decode.tp < prefill.tp:
            assert max(loads) - min(loads) <= 1, (stage, loads)
        else:
            assert min(loads) > 0 or len(prefill.stage_layers(layers, stage)) * decode.tp < prefill.tp


def test_mla_page_is_one_run_per_block():
    """A latent page (1 head x 16 tokens x 576 floats) is contiguous: one descriptor per block, merged across
    contiguous blocks; K/V plane layouts cannot hold it."""
    read = mla_plan("tp=2", "tp=1").reads[0]
    src = synthesize_memory("LBNHC", MLA, read.layers, 1, 8, 1 << 30)
    dst = synthesize_memory("LBNHC", MLA, read.layers, 1, 8, 1 << 40)
    assert src.layers[0].page_bytes == 16 * 576 * 4 == layout_nbytes(MLA, 1, 1, 1)
    scattered = read_descriptors(read, src, 0, dst, 0, [1, 3, 5], [6, 4, 2])
    assert len(scattered) == 2 * 3 and set(scattered.length.tolist()) == {16 * 576 * 4}
    contiguous = read_descriptors(read, src, 0, dst, 0, np.arange(3), np.arange(3))
    assert len(contiguous) == 2  # each layer's 3 blocks in one run
    with pytest.raises(LayoutError, match="planes of one size"):
        synthesize_memory("KV_NHD", MLA, read.layers, 1, 8, 1 << 30)


# --- geometry from vLLM's KV-cache spec (real vLLM spec classes, no engine) ----------------------------------


def vllm_config(tp: int = 1, config_heads: int = 4, head_size: int = 576, cache_dtype: str = "auto"):
    model = SimpleNamespace(
        get_total_num_hidden_layers=lambda: 4,
        get_total_num_kv_heads=lambda: config_heads,
        get_head_size=lambda: head_size,
    )
    return SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
    )


def kv_cache_config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_geometry_of_an_mla_spec_is_one_latent_head(tp):
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from kvbridge.vllm.vllm_facts import geometry

    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32, max_tp_shards=1)
    got = geometry(vllm_config(tp), "float32", 16, kv_cache_config(spec))
    assert got == KVGeometry(4, 1, 576, "float32", 16, head_size_v=0)
    assert got.kv_bytes_per_token() == 4 * 576 * 4


def test_geometry_of_a_plain_spec_keeps_the_configs_heads():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvbridge.vllm.vllm_facts import geometry

    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32)
    got = geometry(vllm_config(2, 4, 32), "float32", 128, kv_cache_config(spec))
    assert got == KVGeometry(4, 4, 32, "float32", 128) and got.head_size_v == 32


def test_what_kvbridge_cannot_move_is_refused_naming_it():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from kvbridge.vllm.vllm_facts import geometry

    full = FullAttentionSpec(block_size=128, num_kv_heads=4, head_size=32, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=128, num_kv_heads=4, head_size=32, dtype=torch.float32, sliding_window=64)
    # full-attention + sliding-window groups of one page format are moved (HMA); other hybrids are refused
    assert geometry(vllm_config(1, 4, 32), "float32", 128, kv_cache_config(full, window)).num_kv_heads == 4
    narrow = SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)
    with pytest.raises(ConfigError, match=r"KV-cache groups \(FullAttentionSpec \(1 layers\), SlidingWindowSpec.*page"):
        geometry(vllm_config(1, 4, 32), "float32", 128, kv_cache_config(full, narrow))
    # Mamba state groups beside attention groups are moved (tests/unit/test_mamba_state.py); state alone is refused
    mamba = MambaSpec(block_size=1024, shapes=((3, 64),), dtypes=(torch.float32,))
    assert geometry(vllm_config(1, 4, 32), "float32", 128, kv_cache_config(mamba, full)).block_size == 128
    with pytest.raises(ConfigError, match="Mamba state only"):
        geometry(vllm_config(1, 4, 32), "float32", 1024, kv_cache_config(mamba))
    with pytest.raises(ConfigError, match="block_size is 128 but the KV tensors' is 16"):
        geometry(vllm_config(1, 4, 32), "float32", 16, kv_cache_config(full))


def test_an_fp8_cache_is_named_by_its_format_so_the_handshake_compares_it():
    """FP8 KV tensors are uint8 whatever the format: the geometry's dtype names e4m3 or e5m2 (the handshake refuses
    a peer whose `dtype` differs, naming the field)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvbridge.vllm.vllm_facts import geometry

    spec = FullAttentionSpec(block_size=128, num_kv_heads=4, head_size=32, dtype=torch.uint8)
    config = kv_cache_config(spec)
    for name, want in (("fp8", "float8_e4m3fn"), ("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")):
        got = geometry(vllm_config(1, 4, 32, cache_dtype=name), "uint8", 128, config)
        assert got.dtype == want and got.itemsize == 1
    with pytest.raises(ConfigError, match="kv_cache_dtype 'turboquant_k8v4' is unsupported"):
        geometry(vllm_config(1, 4, 32, cache_dtype="turboquant_k8v4"), "uint8", 128, config)


def test_peers_with_different_fp8_formats_are_refused_naming_dtype():
    from kvbridge.core.errors import IncompatiblePeerError
    from kvbridge.core.topology import ParallelLayout as Layout
    from kvbridge.wire import messages as wire

    def reply(dtype):
        g = KVGeometry(4, 4, 32, dtype, 128)
        memory = synthesize_memory("LBHNC", g, range(4), 4, 8, 1 << 30)
        return wire.HandshakeReply.build("e", Layout(), 0, WorkerRank(0, 0), g, "LBHNC", "agent", b"", memory)

    with pytest.raises(IncompatiblePeerError, match="dtype is 'float8_e4m3fn' here but 'float8_e5m2' on the peer"):
        wire.check_compatible(reply("float8_e4m3fn"), reply("float8_e5m2"))
