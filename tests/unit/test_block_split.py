"""vLLM 0.32's kernel-block split is refused at startup, with the views vLLM itself builds.

When the attention backend's kernel block is smaller than the manager's block, vLLM hands the connector layer
tensors of `num_blocks * ratio` kernel blocks; reading manager block b as kernel block b would load other
requests' KV. The worker side compares the tensors' block count with the KV-cache config's.
"""

from __future__ import annotations

import pytest

from kvbridge.core.errors import ConfigError
from kvbridge.transport.torch_memory import memory_from_tensors
from kvbridge.vllm.worker_side import check_block_split

torch = pytest.importorskip("torch")
kv_interface = pytest.importorskip("vllm.v1.kv_cache_interface")

NUM_BLOCKS = 8


def layer_tensor(kernel_block_size: int | None) -> torch.Tensor:
    spec = kv_interface.FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=32, dtype=torch.float32)
    shape = kv_interface.compute_layer_kv_cache_shape_bytes(spec, NUM_BLOCKS, kernel_block_size)
    return torch.zeros(shape, dtype=torch.uint8)


def blocks_seen(tensor: torch.Tensor) -> list[int]:
    memory = memory_from_tensors({"model.layers.0.self_attn.attn": tensor}, lambda name: 0)
    return [lk.num_blocks for lk in memory.layers]


def test_a_split_cache_is_refused_naming_both_counts():
    seen = blocks_seen(layer_tensor(kernel_block_size=16))
    assert seen == [NUM_BLOCKS * 4]
    with pytest.raises(ConfigError, match=f"hold {NUM_BLOCKS * 4} blocks but .* has {NUM_BLOCKS}"):
        check_block_split(seen, NUM_BLOCKS, 64)


def test_negative_control_an_unsplit_cache_passes():
    seen = blocks_seen(layer_tensor(kernel_block_size=None))
    assert seen == [NUM_BLOCKS]
    check_block_split(seen, NUM_BLOCKS, 64)
