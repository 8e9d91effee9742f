"""Who a worker is: the engine it belongs to, the engine's layout, its ranks, the model's KV geometry and the model's
fingerprint."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.core.model_identity import ModelFingerprint
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank


@dataclass(frozen=True)
class WorkerIdentity:
    engine_id: str
    layout: ParallelLayout
    dp_rank: int
    rank: WorkerRank
    geometry: KVGeometry
    kv_layout: str = "LBHNC"
    model: ModelFingerprint = field(default_factory=ModelFingerprint)
    """What shapes the KV beyond the geometry (`core.model_identity`); empty without a model (tests)."""

    def __post_init__(self) -> None:
        self.layout.check(self.geometry)
        self.layout.check_rank(self.rank)

    @property
    def agent_name(self) -> str:
        """Unique per worker of every engine: NIXL agents are looked up by this name."""
        return f"kvbridge-{self.engine_id}-dp{self.dp_rank}-pp{self.rank.pp}-tp{self.rank.tp}"

    def __str__(self) -> str:
        return f"{self.engine_id}/dp{self.dp_rank}/{self.rank}"
