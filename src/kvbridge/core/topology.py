"""Parallel layouts, worker ranks and the model's KV geometry, and how layers and KV heads are split.

Glossary (used across kvbridge):
- engine: one vLLM instance (one DP rank); it runs pp x tp workers.
- worker: one process of an engine, at (pp, tp); it holds its stage's layers and its TP rank's heads.
- stage: the workers sharing one pp rank; they hold a contiguous range of layers.
- block: vLLM's unit of KV memory, `block_size` tokens of one layer.
- prefill / decode: the side that computes the prompt's KV / the side that reads it and generates.

The splits are exactly vLLM's, so that both sides of a transfer agree on who holds what without asking:
layers as `vllm.distributed.utils.get_pp_indices` (with the VLLM_PP_LAYER_PARTITION override as an explicit
`layer_partition`), KV heads as `QKVParallelLinear` (contiguous ranges, replicated when tp > heads).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvbridge.core.errors import LayoutError

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, order=True)
class WorkerRank:
    """A worker's place inside one engine."""

    pp: int
    tp: int

    def __str__(self) -> str:
        return f"pp{self.pp}/tp{self.tp}"


@dataclass(frozen=True)
class KVGeometry:
    """What the model's KV cache looks like, independent of how it is split.

    `num_kv_heads` are the distinct KV heads the cache holds (what TP splits, or replicates when tp > heads);
    `head_size` and `head_size_v` the channels of one head's K and V per token, as in vLLM's attention spec
    (`head_size_v` defaults to `head_size`). MLA (DeepSeek-V2/V3) caches one latent per token instead: one head
    of `head_size` = kv_lora_rank + rope dim (576), `head_size_v` 0, held whole by every TP rank.
    `dtype` is the KV cache dtype's name as torch spells it without the prefix ("bfloat16").
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    block_size: int = 16
    head_size_v: int | None = None
    kv_scales: tuple[tuple[int, float, float], ...] = ()
    """A quantized (FP8) cache's (layer, k_scale, v_scale) for each layer the worker holds, as its attention kernel
    applies them (bytes quantized with one scale and read with another are other numbers); empty for an unquantized
    cache. Per worker, not per model: the handshake compares the layers both peers hold."""
    kernel: str = ""
    """A quantized cache's attention backend and kernel variant ("CPU_ATTN/vec"), which wrote its bytes; empty for
    an unquantized cache, whose bytes are plain numbers whatever kernel wrote them."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            _positive(name, getattr(self, name))
        if self.dtype not in DTYPE_SIZES:
            raise LayoutError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        v = self.head_size_v
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise LayoutError(f"head_size_v must be a non-negative integer, got {v!r}")
        for layer, k_scale, v_scale in self.kv_scales:
            if not 0 <= layer < self.num_layers or not all(math.isfinite(x) and x > 0 for x in (k_scale, v_scale)):
                raise LayoutError(f"kv_scales: layer {layer} has k_scale {k_scale!r}, v_scale {v_scale!r}")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def is_latent(self) -> bool:
        """One plane (MLA's latent): no separate V."""
        return self.head_size_v == 0

    @property
    def token_channels(self) -> int:
        """Channels one KV head holds per token: K and V (head_size + head_size_v), or MLA's latent."""
        return self.head_size + self.head_size_v  # type: ignore[operator]

    def kv_bytes_per_token(self, layers: int | None = None, heads: int | None = None) -> int:
        """Bytes of KV for one token over `layers` layers and `heads` KV heads (default: all)."""
        layers = self.num_layers if layers is None else layers
        heads = self.num_kv_heads if heads is None else heads
        return layers * heads * self.token_channels * self.itemsize


def distinct_kv_heads(rank_heads: int, tp: int, max_tp_shards: int | None, config_heads: int) -> int:
    """How many distinct KV heads the model's cache holds, from what one TP rank's KV-cache spec says.

    `rank_heads` is the spec's per-rank head count, `max_tp_shards` its "distinct shards across TP" (None when
    the spec does not say) and `config_heads` the model config's KV heads. MLA's spec says 1 shard of 1 head:
    one latent, the same on every rank, whatever the config's head count. Without `max_tp_shards` the heads
    are the config's, split as vLLM splits them; LayoutError if the rank's count contradicts that.
    """
    _positive("rank_heads", rank_heads)
    _positive("tp", tp)
    if max_tp_shards is not None:
        _positive("max_tp_shards", max_tp_shards)
        return rank_heads * min(tp, max_tp_shards)
    _positive("config_heads", config_heads)
    expected = max(1, config_heads // tp)
    if rank_heads != expected:
        raise LayoutError(
            f"the KV-cache spec gives a tp={tp} rank {rank_heads} KV heads, the model's {config_heads} split "
            f"over tp={tp} give {expected}"
        )
    return config_heads


@dataclass(frozen=True)
class ParallelLayout:
    """An engine's parallel layout: `dp` engines, each of `pp` stages of `tp` workers.

    `layer_partition` is vLLM's VLLM_PP_LAYER_PARTITION: the number of layers of each stage, or None for
    vLLM's default split. The layout is checked against a geometry with `check(geometry)`.
    """

    pp: int = 1
    tp: int = 1
    dp: int = 1
    layer_partition: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "dp"):
            _positive(name, getattr(self, name))
        if self.layer_partition is not None:
            object.__setattr__(self, "layer_partition", tuple(self.layer_partition))
            if len(self.layer_partition) != self.pp:
                raise LayoutError(f"layer_partition has {len(self.layer_partition)} entries but pp={self.pp}")
            for count in self.layer_partition:
                if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                    raise LayoutError(f"layer_partition entries must be positive, got {self.layer_partition}")

    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """Parse `pp=2,tp=1[,dp=1][,partition=10:18]` (any order, missing keys default to 1)."""
        values: dict[str, object] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            match = re.fullmatch(r"(pp|tp|dp|partition)=([0-9:]+)", part)
            if match is None:
                raise LayoutError(f"cannot parse {part!r} in layout {text!r}: expected pp=N, tp=N, dp=N")
            key, value = match.groups()
            if key in values:
                raise LayoutError(f"{key} given twice in layout {text!r}")
            try:
                values[key] = tuple(int(v) for v in value.split(":")) if key == "partition" else int(value)
            except ValueError:
                raise LayoutError(f"cannot parse {part!r} in layout {text!r}") from None
        partition = values.pop("partition", None)
        return cls(**values, layer_partition=partition)  # type: ignore[arg-type]

    def __str__(self) -> str:
        text = f"pp={self.pp},tp={self.tp}" + (f",dp={self.dp}" if self.dp > 1 else "")
        if self.layer_partition is not None:
            text += ",partition=" + ":".join(map(str, self.layer_partition))
        return text

    @property
    def workers_per_engine(self) -> int:
        return self.pp * self.tp

    def workers(self) -> tuple[WorkerRank, ...]:
        """Every worker of one engine, stage-major."""
        return tuple(WorkerRank(p, t) for p in range(self.pp) for t in range(self.tp))

    def check_rank(self, rank: WorkerRank) -> None:
        if not (0 <= rank.pp < self.pp and 0 <= rank.tp < self.tp):
            raise LayoutError(f"worker {rank} is outside layout {self}")

    def check(self, geometry: KVGeometry) -> None:
        """Raise LayoutError if this layout cannot run a model of this geometry in vLLM."""
        if self.layer_partition is not None:
            if sum(self.layer_partition) != geometry.num_layers:
                raise LayoutError(
                    f"layer_partition {self.layer_partition} sums to {sum(self.layer_partition)} "
                    f"but the model has {geometry.num_layers} layers"
                )
        elif self.pp > geometry.num_layers:
            raise LayoutError(f"pp={self.pp} is larger than the model's {geometry.num_layers} layers")
        heads = geometry.num_kv_heads
        if heads % self.tp and self.tp % heads:
            raise LayoutError(f"tp={self.tp} must divide the {heads} KV heads or be a multiple of them (vLLM's rule)")

    def stage_layers(self, num_layers: int, stage: int) -> range:
        """Global layer ids of pipeline stage `stage` (vLLM's get_pp_indices)."""
        if not 0 <= stage < self.pp:
            raise LayoutError(f"stage {stage} is outside pp={self.pp}")
        if self.layer_partition is not None:
            sizes = list(self.layer_partition)
        else:
            sizes = [num_layers // self.pp] * self.pp
            # vLLM gives the remainder to the stages before the last, counting backwards from the
            # second-to-last (the last stage also runs the LM head).
            for i in range(2, num_layers % self.pp + 2):
                sizes[-i] += 1
        start = sum(sizes[:stage])
        return range(start, start + sizes[stage])

    def kv_heads(self, num_kv_heads: int, tp_rank: int) -> range:
        """Global KV-head ids held by TP rank `tp_rank` (one replicated head when tp > heads)."""
        if not 0 <= tp_rank < self.tp:
            raise LayoutError(f"tp rank {tp_rank} is outside tp={self.tp}")
        if self.tp >= num_kv_heads:
            replicas = self.tp // num_kv_heads
            head = tp_rank // replicas
            return range(head, head + 1)
        per_rank = num_kv_heads // self.tp
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)

    def head_replicas(self, num_kv_heads: int) -> int:
        """How many TP ranks hold each KV head."""
        return max(1, self.tp // num_kv_heads)

    def holders_of_head(self, num_kv_heads: int, head: int) -> range:
        """TP ranks holding global KV head `head`."""
        if self.tp >= num_kv_heads:
            replicas = self.tp // num_kv_heads
            return range(head * replicas, (head + 1) * replicas)
        per_rank = num_kv_heads // self.tp
        return range(head // per_rank, head // per_rank + 1)

    def stage_of_layer(self, num_layers: int, layer: int) -> int:
        for stage in range(self.pp):
            if layer in self.stage_layers(num_layers, stage):
                return stage
        raise LayoutError(f"layer {layer} is outside the model's {num_layers} layers")
