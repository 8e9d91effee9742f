"""When a request is cheaper served by its decode instance alone: the costs the proxy measures, and the threshold
they give (pure: samples in, numbers out).

A request's first token comes after the tokens queued ahead of it and its own are computed (`rate`: prefill tokens
per second). Served by its decode instance, that is the decode's queue (`queued_decode`: tokens routed to it and not
computed yet) and the `new` tokens it does not hold. Disaggregated, it is the prefill instance's queue
(`queued_prefill`) and what that instance lacks of the prompt (`prefill_new`: the prompt less the prefix it likely
holds), then the hop (`hop_s`: time to the first token beyond queues, compute and transfer, over the direct path's)
and the transfer of the `new` tokens (`transfer_s_per_token` each). So a request goes straight to the decode
instance when

    (queued_decode + new) / rate  <  (queued_prefill + prefill_new) / rate + hop_s + new * transfer_s_per_token

that is, when `new` is below

    threshold = (hop_s + ahead / rate) / (1 / rate - transfer_s_per_token),
    ahead = queued_prefill + prefill_new - queued_decode

(no limit when the transfer is not cheaper than computing): each request goes where its first token comes first,
and the two queues balance.

Where the numbers come from:
- prefill_tokens_per_s: the prefill instances' own /metrics, tokens computed
  (`vllm:prompt_tokens_by_source_total{source="local_compute"}`) over prefill time
  (`vllm:request_prefill_time_seconds_sum`), between two reads;
- transfer_s_per_token: the decode instances' `vllm:kvbridge_transfer_seconds` (mean per load) over the tokens one
  load brought (`...{source="external_kv_transfer"}` over `vllm:kvbridge_transfers_total`);
- hop_s: from the proxy's own streamed requests, the time to the first token beyond the compute of the tokens queued
  ahead and its own, and the transfer, the disaggregated path's less the direct one's (the KV's wait at the decode,
  the legs' HTTP; the direct one's counts as none until seen); until then, the prefill legs' duration beyond that
  compute.
- the queues: kept by the router, the tokens it routed to each instance whose compute has not ended (a prefill leg
  until it returns; a request sent straight to a decode instance until its first token, or its end).
The first read of a server counts everything since it started; then the difference between two reads.
Each is a moving average (`ALPHA`). Until the prefill throughput is known the threshold is the configured initial
one; a transfer time or a hop not measured yet counts as 0, a lower bound of what disaggregating costs, so that an
unmeasured cost never keeps a request from its prefill instance (whose requests then measure it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ALPHA = 0.3
"""Weight of a new measurement in the moving averages."""
SOURCE = "vllm:prompt_tokens_by_source_total"
PREFILL_TIME = "vllm:request_prefill_time_seconds_sum"
TRANSFER_SUM = "vllm:kvbridge_transfer_seconds_sum"
TRANSFER_COUNT = "vllm:kvbridge_transfer_seconds_count"
TRANSFERS = "vllm:kvbridge_transfers_total"
SERIES = (SOURCE, PREFILL_TIME, TRANSFER_SUM, TRANSFER_COUNT, TRANSFERS)
"""The series the costs are read from."""
MIN_TOKENS = 64
"""Fewer new tokens between two reads than this teach nothing (noise)."""


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


@dataclass
class Costs:
    prefill_tokens_per_s: float | None = None
    transfer_s_per_token: float | None = None
    hop_s: float | None = None

    def threshold(self, ahead: int = 0) -> float | None:
        """New tokens below which the decode instance computes a request itself, when the prefill instance would
        compute `ahead` tokens more than the decode before this request's first token (its queue and what it lacks
        of the prompt, less the decode's queue; may be negative). inf: always; None: the prefill throughput is not
        known yet."""
        rate = self.prefill_tokens_per_s
        if not rate:
            return None
        saved_per_token = 1 / rate - (self.transfer_s_per_token or 0.0)
        if saved_per_token <= 0:
            return float("inf")
        return ((self.hop_s or 0.0) + ahead / rate) / saved_per_token

    def describe(self) -> str:
        def show(value: float | None, scale: float, unit: str, digits: int) -> str:
            return "?" if value is None else f"{value * scale:.{digits}f} {unit}"

        return (
            f"prefill {show(self.prefill_tokens_per_s, 1, 'tok/s', 0)}, "
            f"transfer {show(self.transfer_s_per_token, 1e6, 'us/tok', 2)}, hop {show(self.hop_s, 1e3, 'ms', 1)}"
        )


Sample = tuple[str, Mapping[str, str], float]
"""One Prometheus sample: name, labels, value."""


def series(samples: Sequence[Sample], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for n, ls, v in samples if n == name and all(ls.get(k) == x for k, x in labels.items()))


class CostLearner:
    """Folds metric reads and prefill leg durations into `costs`. A backend's previous read is kept per name, so
    that each measurement is the difference between two reads of one server, the first read counting everything
    since the server started (restarts: a counter that went back is a fresh start, not a measurement)."""

    def __init__(self) -> None:
        self.costs = Costs()
        self._last: dict[str, dict[str, float]] = {}
        self.overhead_s: dict[str, float | None] = {"direct": None, "disaggregated": None}
        """Per path, a streamed request's time to its first token beyond its compute and transfer."""

    def _delta(self, backend: str, keys: Mapping[str, float]) -> dict[str, float] | None:
        last = self._last.get(backend, {})  # the first read: everything since the server started
        self._last[backend] = dict(keys)
        out = {k: keys[k] - last.get(k, 0.0) for k in keys}
        return None if any(v < 0 for v in out.values()) else out

    def prefill_read(self, backend: str, samples: Sequence[Sample]) -> None:
        keys = {
            "computed": series(samples, SOURCE, source="local_compute"),
            "seconds": series(samples, PREFILL_TIME),
        }
        d = self._delta(backend, keys)
        if d and d["computed"] >= MIN_TOKENS and d["seconds"] > 0:
            rate = d["computed"] / d["seconds"]
            self.costs.prefill_tokens_per_s = _ewma(self.costs.prefill_tokens_per_s, rate)

    def decode_read(self, backend: str, samples: Sequence[Sample]) -> None:
        keys = {
            "loaded": series(samples, SOURCE, source="external_kv_transfer"),
            "transfers": series(samples, TRANSFERS),
            "seconds": series(samples, TRANSFER_SUM),
            "loads": series(samples, TRANSFER_COUNT),
        }
        d = self._delta(backend, keys)
        if d and d["loaded"] >= MIN_TOKENS and d["transfers"] > 0 and d["loads"] > 0:
            per_load_s = d["seconds"] / d["loads"]
            tokens_per_transfer = d["loaded"] / d["transfers"]
            self.costs.transfer_s_per_token = _ewma(self.costs.transfer_s_per_token, per_load_s / tokens_per_transfer)

    def prefill_leg(self, seconds: float, computed: int) -> None:
        """A prefill leg took `seconds` for an estimated `computed` tokens (its own and those queued ahead of it):
        the rest is the hop, until a disaggregated request's first token has been seen (`first_token`)."""
        rate = self.costs.prefill_tokens_per_s
        if rate is None or self.overhead_s["disaggregated"] is not None:
            return
        self.costs.hop_s = _ewma(self.costs.hop_s, max(0.0, seconds - computed / rate))

    def first_token(self, path: str, seconds: float, computed: int, loaded: int) -> None:
        """A streamed request's first token came `seconds` after it was routed on `path` ("direct" or
        "disaggregated"), `computed` tokens computed before it (by the decode, or by the prefill: its own and those
        queued ahead of it) and `loaded` transferred. What is left after compute and transfer is the path's
        overhead; the hop is the disaggregated path's overhead beyond the direct one's (the KV's wait at the
        decode, the legs' HTTP)."""
        rate = self.costs.prefill_tokens_per_s
        if rate is None:
            return
        rest = (
            seconds - computed / rate - (loaded * (self.costs.transfer_s_per_token or 0.0) if path != "direct" else 0)
        )
        self.overhead_s[path] = _ewma(self.overhead_s.get(path), max(0.0, rest))
        direct, pd = self.overhead_s["direct"], self.overhead_s["disaggregated"]
        if pd is not None:  # no direct request seen yet: its overhead counts as none
            self.costs.hop_s = max(0.0, pd - (direct or 0.0))
