"""The vLLM edge of several KV-cache groups: the layer -> group map from vLLM's KV-cache config, aliasing tensors
kept layer by layer (not de-duplicated by address), and the groups kvbridge reads from the specs."""

from __future__ import annotations

import pytest

from kvbridge.core.errors import ConfigError
from kvbridge.core.groups import CacheGroup


def hybrid_config_and_tensors(num_blocks: int = 6):
    """4 layers alternating sliding (group 0) / full (group 1), as vLLM 0.32 allocates them with HMA on: layer i of
    each group is a view of tensor i of one buffer (layers 0 and 1 alias, so do 2 and 3)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    spec = dict(block_size=32, num_kv_heads=4, head_size=32, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec(
            ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"],
            SlidingWindowSpec(**spec, sliding_window=64),
        ),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"], FullAttentionSpec(**spec)),
    ]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    pool = torch.zeros(2, num_blocks, 4, 32, 64)
    tensors = {f"model.layers.{n}.self_attn.attn": pool[n // 2] for n in range(4)}
    return config, tensors


def test_aliasing_layers_are_each_kept_with_their_group():
    from vllm.model_executor.models.utils import extract_layer_index

    from kvbridge.transport.torch_memory import memory_from_tensors
    from kvbridge.vllm.worker_side import grouped_memory

    config, tensors = hybrid_config_and_tensors()
    memory = grouped_memory(tensors, config, extract_layer_index)
    assert memory.num_groups == 2 and memory.layer_ids() == (0, 1, 2, 3)
    assert [lk.group for lk in memory.layers] == [0, 1, 0, 1]
    assert memory.layer(0).addr == memory.layer(1).addr != memory.layer(2).addr == memory.layer(3).addr
    assert len(memory.regions) == 1 and memory.num_blocks == 6
    # what de-duplicating by address does: layers 1 and 3 vanish
    assert memory_from_tensors(tensors, extract_layer_index).layer_ids() == (0, 2)


def test_a_kv_tensor_of_no_group_is_refused():
    from vllm.model_executor.models.utils import extract_layer_index

    from kvbridge.vllm.worker_side import grouped_memory

    config, tensors = hybrid_config_and_tensors()
    tensors["model.layers.4.self_attn.attn"] = tensors["model.layers.0.self_attn.attn"]
    with pytest.raises(ConfigError, match="in no KV-cache group"):
        grouped_memory(tensors, config, extract_layer_index)


def test_the_groups_are_read_from_the_specs():
    from kvbridge.vllm.vllm_facts import cache_groups

    config, _ = hybrid_config_and_tensors()
    assert cache_groups(config) == (CacheGroup(32, 64), CacheGroup(32))


def sides(config):
    """A prefill and a decode `SchedulerSide` of one hybrid model (vLLM's configs as plain namespaces)."""
    from types import SimpleNamespace

    from kvbridge.core.config import BridgeConfig
    from kvbridge.vllm.scheduler_side import SchedulerSide

    def vllm_config(role: str):
        kv = SimpleNamespace(
            engine_id=f"engine-{role}",
            is_kv_producer=role == "producer",
            is_kv_consumer=role == "consumer",
            kv_load_failure_policy="fail",
        )
        parallel = SimpleNamespace(
            pipeline_parallel_size=1, tensor_parallel_size=1, data_parallel_size=1, data_parallel_index=0
        )
        return SimpleNamespace(
            kv_transfer_config=kv, parallel_config=parallel, cache_config=SimpleNamespace(block_size=32)
        )

    bridge = BridgeConfig.from_extra({"keyless_exposes_kv_to_local_processes": True})
    return SchedulerSide(vllm_config("producer"), bridge, config), SchedulerSide(
        vllm_config("consumer"), bridge, config
    )


def test_scheduler_sides_publish_live_blocks_and_queue_one_load_of_per_group_lists():
    """300 tokens at block 32, window 64: the prefill publishes the sliding group's 3 live blocks and all 10 of the
    full group, holds them per group as decode workers will claim them; the decode pairs its own live blocks
    position by position in one load of per-group lists."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    config, _ = hybrid_config_and_tensors(64)
    prefill, decode = sides(config)
    prompt = list(range(1, 301))
    sliding = [0] * 7 + [21, 22, 23]
    full = list(range(31, 41))
    req = SimpleNamespace(
        request_id="p1",
        kv_transfer_params={"do_remote_decode": True},
        prompt_token_ids=prompt,
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
        num_computed_tokens=300,
    )
    delay, params = prefill.request_finished_all_groups(req, (sliding, full))
    assert delay and params["remote_group_block_ids"] == [[21, 22, 23], full] and params["remote_block_ids"] == []
    ((_, held, _, _, _finished_at),) = prefill.build_connector_meta().holds
    assert held == ((21, 22, 23), tuple(full))

    dreq = SimpleNamespace(request_id="d1", kv_transfer_params=dict(params), prompt_token_ids=prompt)
    assert decode.get_num_new_matched_tokens(dreq, 0) == (300, True)
    local = SimpleNamespace(get_block_ids=lambda: ([0] * 7 + [51, 52, 53], list(range(61, 71))))
    decode.update_state_after_alloc(dreq, local, 300)
    (job,) = decode.build_connector_meta().loads
    assert job.remote_blocks == held
    assert job.local_blocks == ((51, 52, 53), tuple(range(61, 71)))


def test_scheduler_side_refuses_params_lacking_an_in_window_block():
    from types import SimpleNamespace

    from kvbridge.wire.params import prompt_hash

    config, _ = hybrid_config_and_tensors(64)
    _, decode = sides(config)
    prompt = list(range(1, 301))
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_block_ids": [[22, 23], list(range(31, 41))],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_layout": "pp=1,tp=1",
        "remote_num_tokens": 300,
        "remote_prompt_hash": prompt_hash(prompt),
    }
    dreq = SimpleNamespace(request_id="d1", kv_transfer_params=params, prompt_token_ids=prompt)
    decode.get_num_new_matched_tokens(dreq, 0)
    assert decode._refused["d1"].reason == "blocks"  # under policy fail: the request fails, nothing is read
