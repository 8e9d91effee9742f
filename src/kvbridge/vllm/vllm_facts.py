"""Facts kvbridge reads from vLLM's config and process groups, in one place."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import ConfigError, LayoutError
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank, distinct_kv_heads

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


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
    hybrid KV-cache manager) other than full-attention and sliding-window groups of one page format and Mamba
    state groups (`check_state_groups`), a cache of state only, cross-attention caches, several specs in one group.
    With several groups, the first attention group's spec.
    """
    if kv_cache_config is None:
        return None
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        CrossAttentionSpec,
        EncoderOnlyAttentionSpec,
        MambaSpec,
        UniformTypeKVCacheSpecs,
    )

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        _check_hybrid_groups(groups)
    attention = [g for g in groups if not isinstance(g.kv_cache_spec, MambaSpec)]
    if not attention:
        raise ConfigError("kvbridge: a KV cache of Mamba state only (no attention layers) is unsupported")
    spec = attention[0].kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        specs = {type(s).__name__ for s in spec.kv_cache_specs.values()}
        raise ConfigError(f"kvbridge: layers of one KV-cache group with different specs ({sorted(specs)}): unsupported")
    if not isinstance(spec, AttentionSpec) or isinstance(spec, CrossAttentionSpec | EncoderOnlyAttentionSpec):
        raise ConfigError(f"kvbridge: KV-cache spec {type(spec).__name__} is unsupported (attention caches only)")
    return spec


def _check_hybrid_groups(groups) -> None:
    """Several KV-cache groups (vLLM's hybrid KV-cache manager): kvbridge moves full-attention and sliding-window
    groups whose pages have one format (heads, head sizes, dtype, block size), and Mamba state groups, every group
    transferred; anything else is refused naming the groups."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from kvbridge.core.groups import MAX_GROUPS

    kinds = ", ".join(f"{type(g.kv_cache_spec).__name__} ({len(g.layer_names)} layers)" for g in groups)
    if len(groups) > MAX_GROUPS:
        raise ConfigError(f"kvbridge: {len(groups)} KV-cache groups ({kinds}): at most {MAX_GROUPS} are supported")
    odd = [
        type(g.kv_cache_spec).__name__
        for g in groups
        if type(g.kv_cache_spec) not in (FullAttentionSpec, SlidingWindowSpec, MambaSpec)
    ]
    if odd:
        raise ConfigError(
            f"kvbridge: KV-cache groups ({kinds}): {odd[0]} is unsupported with several groups "
            "(full-attention, sliding-window and Mamba groups only)"
        )
    for g in groups:
        if isinstance(g.kv_cache_spec, MambaSpec):
            _check_state_spec(g.kv_cache_spec)
    if not all(getattr(g, "enable_kv_transfer", True) for g in groups):
        raise ConfigError(f"kvbridge: KV-cache groups ({kinds}): a group vLLM does not transfer is unsupported")
    page = {
        (s.num_kv_heads, s.head_size, s.head_size_v, str(s.dtype), s.block_size)
        for s in (g.kv_cache_spec for g in groups)
        if not isinstance(s, MambaSpec)
    }
    if len(page) > 1:
        raise ConfigError(
            f"kvbridge: KV-cache groups ({kinds}) with different page formats (heads, head sizes, dtype, block size): "
            f"{sorted(page)}: unsupported"
        )


def _check_state_spec(spec) -> None:
    """A Mamba group kvbridge moves: one running-state block per request (`mamba_cache_mode` "none", vLLM's mode
    without prefix caching), its page opaque bytes (conv state, SSM state, padding)."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "none":
        raise ConfigError(
            f"kvbridge: Mamba state groups (MambaSpec) with mamba_cache_mode={mode!r} (prefix caching) are "
            "unsupported; use --no-enable-prefix-caching"
        )


def state_groups(kv_cache_config: KVCacheConfig | None) -> tuple[int, ...]:
    """Indexes of the engine's KV-cache groups of state pages (Mamba)."""
    if kv_cache_config is None:
        return ()
    from vllm.v1.kv_cache_interface import MambaSpec

    return tuple(i for i, g in enumerate(kv_cache_config.kv_cache_groups) if isinstance(g.kv_cache_spec, MambaSpec))


def check_state_layout(vllm_config: VllmConfig, config: BridgeConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """At startup: `cache_spec`'s refusals, and for a cache with state (Mamba) the layouts kvbridge cannot move it
    between: a state page is one TP rank's shard of the conv and SSM states, copied as opaque bytes to the decode
    worker of the same TP rank, so both sides need the same TP size (`peer_tp`; PP may differ) and no KV head may be
    replicated over TP ranks (the attention plan could then read a stage from another rank). ConfigError naming the
    layout; resharding conv/SSM state across TP sizes is not built."""
    spec = cache_spec(kv_cache_config)
    if not state_groups(kv_cache_config):
        return
    layout, _ = engine_layout(vllm_config)
    if config.peer_tp is not None and config.peer_tp != layout.tp:
        raise ConfigError(
            f"kvbridge: Mamba state (MambaSpec) moves only between equal TP sizes: this engine is {layout}, its peers "
            f"tp={config.peer_tp} (peer_tp): unsupported (no conv/SSM state resharding)"
        )
    heads = vllm_config.model_config.get_total_num_kv_heads()
    if spec is not None and layout.tp > heads:
        raise ConfigError(
            f"kvbridge: Mamba state (MambaSpec) with tp={layout.tp} above the model's {heads} KV heads (replicated "
            "heads) is unsupported"
        )


def cache_groups(kv_cache_config: KVCacheConfig | None) -> tuple:
    """The engine's KV-cache groups as `core.groups.CacheGroup`s (block size, sliding window), in vLLM's order:
    one group without a KV-cache config. A sliding window counts only for a `SlidingWindowSpec` group (with the
    hybrid manager off, vLLM gives every layer full-attention blocks)."""
    from kvbridge.core.groups import CacheGroup

    if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) == 1:
        return (CacheGroup(1),) if kv_cache_config is None else (CacheGroup(cache_spec(kv_cache_config).block_size),)
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    cache_spec(kv_cache_config)
    return tuple(
        CacheGroup(g.kv_cache_spec.block_size, g.kv_cache_spec.sliding_window)
        if isinstance(g.kv_cache_spec, SlidingWindowSpec)
        else CacheGroup(g.kv_cache_spec.block_size, state=isinstance(g.kv_cache_spec, MambaSpec))
        for g in kv_cache_config.kv_cache_groups
    )


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


def kv_quantization(vllm_config: VllmConfig) -> dict:
    """For an FP8 cache, what decides how its bytes are read besides their format, as KVGeometry fields:
    `kv_scales` ((layer, k_scale, v_scale) of this worker's attention layers, the floats its kernel applies:
    1.0 unless the checkpoint has scales) and `kernel` (backend and variant, e.g. "CPU_ATTN/vec": vLLM's CPU
    backend picks the variant (ISA) per host, dtype, block and head size). Empty for an unquantized cache."""
    if str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto") not in FP8_CACHE_DTYPES:
        return {}
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.models.utils import extract_layer_index

    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    layers = {name: layer for name, layer in context.items() if isinstance(layer, AttentionLayerBase)}
    scales = sorted(
        (extract_layer_index(name), float(layer._k_scale_float), float(layer._v_scale_float))
        for name, layer in layers.items()
        if hasattr(layer, "_k_scale_float")
    )
    kernels = set()
    for layer in layers.values():
        backend = getattr(layer, "attn_backend", None)
        name = backend.get_name() if backend is not None else type(layer).__name__
        isa = getattr(layer, "isa", None)
        kernels.add(f"{name}/{isa}" if isa else name)
    found = {"kv_scales": tuple(scales), "kernel": ",".join(sorted(kernels))}
    distinct = sorted({(k, v) for _, k, v in scales})
    logger.info("kvbridge: FP8 KV cache: kernel %s, (k_scale, v_scale) %s", found["kernel"] or "?", distinct)
    return found


CPU_ATTN_ISAS = ("vec", "vec16")
"""vLLM CPU_ATTN kernel variants whose pages `core.token_runs.PAGE_CPU_ATTN` describes (checked against vLLM's
`cpu_attn_reshape_and_cache` in tests/unit/test_token_runs.py; amx, neon and the others are not)."""


def page_format(vllm_config: VllmConfig) -> str:
    """The KV pages' format (`core.token_runs`): PAGE_CPU_ATTN when every attention layer runs vLLM's CPU_ATTN
    backend with a checked kernel variant on an unquantized cache, else PAGE_ROWS (pages copied whole: equal
    block sizes only)."""
    from kvbridge.core.memory import PAGE_CPU_ATTN, PAGE_ROWS

    if str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto") != "auto":
        return PAGE_ROWS
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    layers = [layer for layer in context.values() if isinstance(layer, AttentionLayerBase)]
    kinds = set()
    for layer in layers:
        backend = getattr(layer, "attn_backend", None)
        kinds.add((backend.get_name() if backend is not None else "", getattr(layer, "isa", None)))
    if layers and all(name == "CPU_ATTN" and isa in CPU_ATTN_ISAS for name, isa in kinds):
        return PAGE_CPU_ATTN
    return PAGE_ROWS


def geometry(
    vllm_config: VllmConfig, dtype: str, block_size: int, kv_cache_config: KVCacheConfig | None = None
) -> KVGeometry:
    """The model's KV geometry, from vLLM's KV-cache spec where there is one (what the cache really holds:
    MLA's one latent head of 576 channels with no V, not the config's KV heads), else from the model config.
    `dtype` is the KV tensors' dtype; an FP8 cache is named by its format (`kv_dtype`), with its scales and
    kernel (`kv_quantization`)."""
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
            **kv_quantization(vllm_config),
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
        **kv_quantization(vllm_config),
    )


def advertised_host(config: BridgeConfig) -> str:
    if config.advertise_host:
        return config.advertise_host
    if config.side_channel_host not in ("0.0.0.0", "::", ""):
        return config.side_channel_host
    return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
