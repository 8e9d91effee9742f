"""kvbridge's transfer statistics in vLLM's KVConnectorStats form (pickled from workers, merged, logged)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvbridge.decode_worker import TransferStats

_COUNTERS = ("transfers", "failures", "bytes", "descriptors", "expired_leases")


def _empty() -> dict[str, Any]:
    return {**dict.fromkeys(_COUNTERS, 0), "seconds": []}


@dataclass
class KVBridgeStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=_empty)

    def record(self, stats: TransferStats) -> None:
        self.data["transfers"] += stats.transfers
        self.data["failures"] += stats.failures
        self.data["bytes"] += stats.bytes
        self.data["descriptors"] += stats.descriptors
        self.data["seconds"].extend(stats.seconds)

    def record_expired(self, count: int) -> None:
        self.data["expired_leases"] += count

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVBridgeStats:
        for key in _COUNTERS:
            self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        self.data["seconds"] = list(self.data.get("seconds", [])) + list(other.data.get("seconds", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = sorted(self.data.get("seconds", []))
        total_s = sum(seconds)
        out: dict[str, int | float] = {key: self.data.get(key, 0) for key in _COUNTERS}
        out["bytes_MB"] = round(out.pop("bytes") / 1e6, 3)
        if seconds:
            out["avg_transfer_ms"] = round(1000 * total_s / len(seconds), 3)
            out["p90_transfer_ms"] = round(1000 * seconds[int(0.9 * (len(seconds) - 1))], 3)
            out["throughput_GBps"] = round(self.data.get("bytes", 0) / total_s / 1e9, 3) if total_s else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in _COUNTERS)
