"""kvbridge's transfer statistics in vLLM's KVConnectorStats form (pickled from workers, merged, logged)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from kvbridge.runtime.transfer_stats import TransferStats

_COUNTERS = (
    "transfers",
    "failures",
    "bytes",
    "descriptors",
    "expired_leases",
    "aborted_leases",
    "refused_messages",
    "claim_retries",
)
_REASONS = "rejected_params"  # {reason: count}: kv_transfer_params refused before any load (scheduler side)


_LISTS = ("seconds", "post_seconds")  # per load: to completion, and to the READs posted (kernels queued)
_PHASES = "phases"  # {phase: [seconds per load]}: a decode load's timeline (transfer_stats.PHASES)
_HOLD_PHASES = "hold_phases"  # {phase: [seconds per request]}: a prefill request's timeline (HOLD_PHASES)
HOLD_PHASES = ("hold", "claim", "release")
"""A held prefill request's timeline: request finished -> hold registered (`hold`) -> first claim answered
(`claim`) -> released (`release`: read, aborted or expired)."""
BUCKETS = [1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


def _empty() -> dict[str, Any]:
    return {**dict.fromkeys(_COUNTERS, 0), **{key: [] for key in _LISTS}, _REASONS: {}, _PHASES: {}, _HOLD_PHASES: {}}


def _merge_lists(into: dict[str, list[float]], more: dict[str, list[float]]) -> dict[str, list[float]]:
    out = {name: list(values) for name, values in into.items()}
    for name, values in more.items():
        out.setdefault(name, []).extend(values)
    return out


@dataclass
class KVBridgeStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=_empty)

    def record(self, stats: TransferStats) -> None:
        self.data["transfers"] += stats.transfers
        self.data["failures"] += stats.failures
        self.data["bytes"] += stats.bytes
        self.data["descriptors"] += stats.descriptors
        self.data["claim_retries"] = self.data.get("claim_retries", 0) + stats.claim_retries
        for key in _LISTS:
            self.data[key].extend(getattr(stats, key))
        self.data[_PHASES] = _merge_lists(self.data.get(_PHASES, {}), stats.phases)

    def record_holds(self, timelines: list[tuple[float, float, float]]) -> None:
        """Prefill side: each released request's (hold, claim, release) seconds."""
        if timelines:
            phases = {name: [t[i] for t in timelines] for i, name in enumerate(HOLD_PHASES)}
            self.data[_HOLD_PHASES] = _merge_lists(self.data.get(_HOLD_PHASES, {}), phases)

    def record_expired(self, count: int) -> None:
        self.data["expired_leases"] += count

    def record_leases(self, aborted: int, refused: int) -> None:
        self.data["aborted_leases"] += aborted
        self.data["refused_messages"] += refused

    def record_rejected(self, reason: str) -> None:
        reasons = self.data.setdefault(_REASONS, {})
        reasons[reason] = reasons.get(reason, 0) + 1

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVBridgeStats:
        for key in _COUNTERS:
            self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        for key in _LISTS:
            self.data[key] = list(self.data.get(key, [])) + list(other.data.get(key, []))
        for key in (_PHASES, _HOLD_PHASES):
            self.data[key] = _merge_lists(self.data.get(key, {}), other.data.get(key, {}))
        merged = dict(self.data.get(_REASONS, {}))
        for reason, count in other.data.get(_REASONS, {}).items():
            merged[reason] = merged.get(reason, 0) + count
        self.data[_REASONS] = merged
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
        posts = self.data.get("post_seconds", [])
        if posts:
            out["avg_post_ms"] = round(1000 * sum(posts) / len(posts), 3)
        for prefix, key in (("load", _PHASES), ("hold", _HOLD_PHASES)):
            for name, values in sorted(self.data.get(key, {}).items()):
                if values:
                    out[f"avg_{prefix}_{name}_ms"] = round(1000 * sum(values) / len(values), 3)
        for reason, count in sorted(self.data.get(_REASONS, {}).items()):
            out[f"rejected_params[{reason}]"] = count
        return out

    def is_empty(self) -> bool:
        return (
            not any(self.data.get(key) for key in _COUNTERS)
            and not self.data.get(_REASONS)
            and not any(self.data.get(_HOLD_PHASES, {}).values())
        )


_PROM_COUNTERS = {
    "transfers": "Requests whose KV this decode instance read through kvbridge.",
    "bytes": "Bytes of KV read through kvbridge.",
    "descriptors": "NIXL descriptors posted for those reads (after coalescing).",
    "failures": "Loads that failed (handshake, transfer or timeout) and followed kv_load_failure_policy.",
    "expired_leases": "Prefill requests whose blocks were freed because their lease expired before all readers.",
    "aborted_leases": "Prefill requests freed at once because their reader (or the proxy) aborted the read.",
    "refused_messages": "Claims, notifications and aborts refused: a wrong token, or no room to keep an early one.",
    "claim_retries": "Claims answered as not held and sent again (a claim waits for its hold half its deadline).",
}


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """kvbridge's counters and histograms on vLLM's /metrics, per engine:

    vllm:kvbridge_transfers_total, vllm:kvbridge_bytes_total, vllm:kvbridge_descriptors_total,
    vllm:kvbridge_failures_total, vllm:kvbridge_expired_leases_total, vllm:kvbridge_claim_retries_total,
    vllm:kvbridge_transfer_seconds (a load's KV hop: claim sent -> data landed),
    vllm:kvbridge_load_phase_seconds{phase} (decode: handshake, claim, queue, post, wire, report, hop, total; a
    CUDA IPC load also checks and post_launch, parts of post) and
    vllm:kvbridge_hold_phase_seconds{phase} (prefill: hold, claim, release).
    """

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvbridge_{key}_total", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for key, doc in _PROM_COUNTERS.items()
        }
        self.seconds = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:kvbridge_transfer_seconds",
                documentation="A load's KV hop, per decode worker: from its claim sent to its data landed in its "
                "blocks (a load without a claim: from its handshake done).",
                buckets=BUCKETS,
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        self._rejected = self._counter_cls(
            name="vllm:kvbridge_rejected_params_total",
            documentation="kv_transfer_params refused before any connection or read, by reason (the request was "
            "prefilled locally, or failed under kv_load_failure_policy=fail).",
            labelnames=[*labelnames, "reason"],
        )
        self._phases = self._histogram_cls(
            name="vllm:kvbridge_load_phase_seconds",
            documentation="A decode load's timeline, per phase: handshake (queued -> handshake done, claim sent), "
            "claim (-> granted), queue (-> taken by its path), post (-> READs posted or kernels queued: the host's "
            "work; with CMA the copy itself), wire (-> data landed), report (-> handed to vLLM); hop (claim sent -> "
            "data landed), total (queued -> handed to vLLM); a CUDA IPC load also checks (its block ids checked, "
            "in its post) and post_launch (the post after the checks); a CUDA IPC load launched while its claim "
            "was on the wire counts as claim only what the claim took beyond its kernels.",
            buckets=BUCKETS,
            labelnames=[*labelnames, "phase"],
        )
        self._hold_phases = self._histogram_cls(
            name="vllm:kvbridge_hold_phase_seconds",
            documentation="A held prefill request's timeline, per phase: hold (request finished -> hold "
            "registered on the worker), claim (-> first claim answered), release (-> blocks freed).",
            buckets=BUCKETS,
            labelnames=[*labelnames, "phase"],
        )
        self._engine_labels = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, metric in self.counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                metric[engine_idx].inc(value)
        for seconds in transfer_stats_data.get(_PHASES, {}).get("hop", ()):
            self.seconds[engine_idx].observe(seconds)
        labels = self._engine_labels[engine_idx]
        for key, metric in ((_PHASES, self._phases), (_HOLD_PHASES, self._hold_phases)):
            for phase, values in transfer_stats_data.get(key, {}).items():
                child = metric.labels(*labels, phase)
                for seconds in values:
                    child.observe(seconds)
        for reason, count in transfer_stats_data.get(_REASONS, {}).items():
            self._rejected.labels(*self._engine_labels[engine_idx], reason).inc(count)
