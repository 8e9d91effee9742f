"""Facts kvbridge reads from vLLM's config and process groups, in one place."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import ConfigError, LayoutError
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank, distinct_kv_heads

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def engine_layout(vllm_config: VllmConfig) -> tuple[ParallelLayout, int]:
    """This engine's layout (with vLLM's VLLM_PP_LAYER_PARTITION, which vLLM itself reads) and DP rank."""
    from vllm import envs

    pc = vllm_config.parallel_config
    partition = envs.VLLM_PP_LAYER_PARTITION
    dp_rank = getattr(pc, "data_parallel_index", None)
    if dp_rank is None:
        dp_rank = pc.data_parallel_rank
    # vLLM runs each DP rank of a dense model as an independent engine and resets data_parallel_size to 1
    # there (reconfigure_for_independent_dp_rank); only data_parallel_index keeps the rank. Ports depend on
    # the rank alone, so the engine's own view of dp only needs to contain it.
    layout = ParallelLayout(
        pp=pc.pipeline_parallel_size,
        tp=pc.tensor_parallel_size,
        dp=max(pc.data_parallel_size, int(dp_rank) + 1),
        layer_partition=tuple(int(x) for x in partition.split(",")) if partition else None,
    )
    return layout, int(dp_rank)


def worker_rank() -> WorkerRank:
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return WorkerRank(get_pp_group().rank_in_group, get_tensor_model_parallel_rank())


def cache_spec(kv_cache_config: KVCacheConfig | None):
    """The attention spec of the engine's one KV-cache group, or None without a KV-cache config.

    ConfigError, naming what is unsupported, for anything kvbridge cannot move: several KV-cache groups (vLLM's
    hybrid KV-cache manager), state (Mamba) or cross-attention caches, several specs in one group.
    """
    if kv_cache_config is None:
        return None
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        CrossAttentionSpec,
        EncoderOnlyAttentionSpec,
        UniformTypeKVCacheSpecs,
    )

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        kinds = ", ".join(f"{type(g.kv_cache_spec).__name__} ({len(g.layer_names)} layers)" for g in groups)
        raise ConfigError(f"kvbridge: {len(groups)} KV-cache groups ({kinds}) are unsupported; it moves one group")
    spec = groups[0].kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        specs = {type(s).__name__ for s in spec.kv_cache_specs.values()}
        raise ConfigError(f"kvbridge: layers of one KV-cache group with different specs ({sorted(specs)}): unsupported")
    if not isinstance(spec, AttentionSpec) or isinstance(spec, CrossAttentionSpec | EncoderOnlyAttentionSpec):
        raise ConfigError(f"kvbridge: KV-cache spec {type(spec).__name__} is unsupported (attention caches only)")
    return spec


FP8_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
"""vLLM's `--kv-cache-dtype` FP8 names -> the format its bytes hold (vLLM's "fp8" is e4m3). The KV tensors of
an FP8 cache are uint8, so the tensor's dtype alone would let an e4m3 and an e5m2 engine exchange bytes."""


def kv_dtype(vllm_config: VllmConfig, tensor_dtype: str) -> str:
    """The KV cache's element format, as the handshake compares it (`dtype`): the tensors' dtype, or for an FP8
    cache its FP8 format; ConfigError for a quantized cache kvbridge cannot name."""
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    if cache_dtype in FP8_CACHE_DTYPES:
        return FP8_CACHE_DTYPES[cache_dtype]
    if cache_dtype not in ("auto", "float16", "bfloat16", "float32"):
        raise ConfigError(f"kvbridge: kv_cache_dtype {cache_dtype!r} is unsupported")
    return tensor_dtype


def geometry(
    vllm_config: VllmConfig, dtype: str, block_size: int, kv_cache_config: KVCacheConfig | None = None
) -> KVGeometry:
    """The model's KV geometry, from vLLM's KV-cache spec where there is one (what the cache really holds:
    MLA's one latent head of 576 channels with no V, not the config's KV heads), else from the model config.
    `dtype` is the KV tensors' dtype; an FP8 cache is named by its format (`kv_dtype`)."""
    mc = vllm_config.model_config
    dtype = kv_dtype(vllm_config, dtype)
    spec = cache_spec(kv_cache_config)
    if spec is None:
        return KVGeometry(
            num_layers=mc.get_total_num_hidden_layers(),
            num_kv_heads=mc.get_total_num_kv_heads(),
            head_size=mc.get_head_size(),
            dtype=dtype,
            block_size=block_size,
        )
    tp = vllm_config.parallel_config.tensor_parallel_size
    try:
        heads = distinct_kv_heads(spec.num_kv_heads, tp, spec.max_tp_shards, mc.get_total_num_kv_heads())
    except LayoutError as exc:
        raise ConfigError(f"kvbridge: {exc}") from None
    if spec.block_size != block_size:
        raise ConfigError(
            f"kvbridge: the KV-cache spec's block_size is {spec.block_size} but the KV tensors' is {block_size}"
        )
    return KVGeometry(
        num_layers=mc.get_total_num_hidden_layers(),
        num_kv_heads=heads,
        head_size=spec.head_size,
        dtype=dtype,
        block_size=block_size,
        head_size_v=spec.head_size_v,
    )


def advertised_host(config: BridgeConfig) -> str:
    if config.advertise_host:
        return config.advertise_host
    if config.side_channel_host not in ("0.0.0.0", "::", ""):
        return config.side_channel_host
    return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
