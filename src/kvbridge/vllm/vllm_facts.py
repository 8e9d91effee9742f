"""Facts kvbridge reads from vLLM's config and process groups, in one place."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvbridge.core.config import BridgeConfig
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank

if TYPE_CHECKING:
    from vllm.config import VllmConfig


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


def geometry(vllm_config: VllmConfig, dtype: str, block_size: int) -> KVGeometry:
    mc = vllm_config.model_config
    return KVGeometry(
        num_layers=mc.get_total_num_hidden_layers(),
        num_kv_heads=mc.get_total_num_kv_heads(),
        head_size=mc.get_head_size(),
        dtype=dtype,
        block_size=block_size,
    )


def advertised_host(config: BridgeConfig) -> str:
    if config.advertise_host:
        return config.advertise_host
    if config.side_channel_host not in ("0.0.0.0", "::", ""):
        return config.side_channel_host
    return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
