"""FP8 KV caches at the handshake: what decides how the bytes are read (format, kernel variant, each layer's k and
v scale) is compared, and a mismatch is refused naming the field; `vllm_facts.kv_quantization` reads the scales and
the kernel from vLLM's attention layers (the e2e proof through real servers is tests/e2e/test_e2e_fp8.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbridge.core.errors import IncompatiblePeerError, LayoutError
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.wire import messages as wire

ONES = tuple((layer, 1.0, 1.0) for layer in range(4))


def fp8(kv_scales=ONES, kernel="CPU_ATTN/vec", dtype="float8_e4m3fn") -> KVGeometry:
    return KVGeometry(4, 4, 32, dtype, 128, kv_scales=kv_scales, kernel=kernel)


def reply(geometry: KVGeometry, layout: ParallelLayout | None = None, rank: WorkerRank | None = None):
    layout, rank = layout or ParallelLayout(), rank or WorkerRank(0, 0)
    layers = layout.stage_layers(geometry.num_layers, rank.pp)
    heads = len(layout.kv_heads(geometry.num_kv_heads, rank.tp))
    memory = synthesize_memory("LBHNC", geometry, layers, heads, 8, 1 << 30)
    return wire.HandshakeReply.build("e", layout, 0, rank, geometry, "LBHNC", "agent", b"", memory)


def test_equal_fp8_peers_are_compatible_and_the_fields_cross_the_wire():
    ours = reply(fp8())
    wire.check_compatible(ours, reply(fp8()))
    back = wire.decode(wire.encode(ours))
    assert back.geometry.to_core() == fp8()


def test_a_stage_is_compared_on_the_layers_it_holds():
    """A pp=2 prefill stage 1 holds layers 2-3 (and only their scales): a pp=1 decode with scales for 0-3 agrees."""
    stage = reply(fp8(kv_scales=ONES[2:]), ParallelLayout(pp=2), WorkerRank(1, 0))
    wire.check_compatible(reply(fp8()), stage)
    other = reply(fp8(kv_scales=((2, 1.0, 1.0), (3, 1.0, 0.5))), ParallelLayout(pp=2), WorkerRank(1, 0))
    with pytest.raises(IncompatiblePeerError, match=r"v_scale is 'layer 3: 1.0' here but 'layer 3: 0.5' on the peer"):
        wire.check_compatible(reply(fp8()), other)


@pytest.mark.parametrize(
    ("theirs", "message"),
    [
        (fp8(dtype="float8_e5m2"), "dtype is 'float8_e4m3fn' here but 'float8_e5m2' on the peer"),
        (fp8(kernel="CPU_ATTN/amx"), "kernel is 'CPU_ATTN/vec' here but 'CPU_ATTN/amx' on the peer"),
        (fp8(kv_scales=((0, 0.25, 1.0), *ONES[1:])), "k_scale is 'layer 0: 1.0' here but 'layer 0: 0.25' on the peer"),
        (fp8(kv_scales=()), "kv_scales is 4 here but 0 on the peer"),  # e.g. a kvbridge without FP8 checks
        (KVGeometry(4, 4, 32, "float32", 128), "dtype is 'float8_e4m3fn' here but 'float32' on the peer"),
    ],
)
def test_a_mismatch_is_refused_naming_the_field(theirs, message):
    with pytest.raises(IncompatiblePeerError, match=message):
        wire.check_compatible(reply(fp8()), reply(theirs))
    memory = synthesize_memory("LBHNC", fp8(), range(4), 4, 8, 1 << 30)
    ask = wire.HandshakeRequest.build("d", ParallelLayout(), 0, WorkerRank(0, 0), fp8(), "LBHNC", memory)
    refused = wire.answer_handshake(reply(theirs), ask)
    assert isinstance(refused, wire.HandshakeRefused) and refused.field == message.split()[0]


def test_an_older_peer_without_the_fields_reads_as_unquantized():
    old = wire.Geometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32", block_size=128)
    decoded = wire.msgspec.msgpack.decode(wire.msgspec.msgpack.encode(old), type=wire.Geometry)
    assert decoded.kv_scales == () and decoded.kernel == ""


def test_scales_must_be_positive_and_of_the_models_layers():
    with pytest.raises(LayoutError, match="kv_scales: layer 4"):
        fp8(kv_scales=((4, 1.0, 1.0),))
    with pytest.raises(LayoutError, match=r"kv_scales: layer 0 has k_scale 0\.0"):
        fp8(kv_scales=((0, 0.0, 1.0),))


def fake_config(cache_dtype: str, layers: dict):
    return SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        compilation_config=SimpleNamespace(static_forward_context=layers),
    )


def test_kv_quantization_reads_vllms_attention_layers():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    from kvbridge.vllm.vllm_facts import kv_quantization

    class Layer(AttentionLayerBase):
        def __init__(self, k: float, v: float, isa: str | None):
            self._k_scale_float, self._v_scale_float, self.isa = k, v, isa
            self.attn_backend = SimpleNamespace(get_name=lambda: "CPU_ATTN")

        def get_attn_backend(self):
            return None

        def get_kv_cache_spec(self, vllm_config):
            return None

    layers = {
        "model.layers.3.self_attn.attn": Layer(0.5, 2.0, "vec"),
        "model.layers.2.self_attn.attn": Layer(1, 1, "vec"),
    }
    layers["model.layers.2.mlp"] = object()  # not an attention layer
    got = kv_quantization(fake_config("fp8", layers))
    assert got == {"kv_scales": ((2, 1.0, 1.0), (3, 0.5, 2.0)), "kernel": "CPU_ATTN/vec"}
    assert kv_quantization(fake_config("auto", layers)) == {}
    layers["model.layers.3.self_attn.attn"].isa = None
    assert kv_quantization(fake_config("fp8_e5m2", layers))["kernel"] == "CPU_ATTN,CPU_ATTN/vec"
