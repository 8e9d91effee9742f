"""The proxy's Prometheus metrics (`kvbridge_proxy_*`), in a registry of their own: several proxies may live in
one process (the tests), and prometheus_client is imported only here, when a proxy is made. Backends are labelled
by name (`prefill-0`, as in /health and errors): /metrics is as unauthenticated as /health, and backend URLs are
for the log (which prints each name's URL at start)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvbridge.serving.proxy.balancer import Balancer
from kvbridge.serving.proxy.router import Router


class ProxyMetrics:
    def __init__(self, balancer: Balancer) -> None:
        """`watch(router)` adds the router's gauges (threshold, learned costs, prefix index sizes)."""
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "kvbridge_proxy_requests",
            "Client requests by endpoint and the status returned",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.leg_requests = Counter(
            "kvbridge_proxy_leg_requests", "Legs sent, per leg and backend", ["leg", "backend"], registry=self.registry
        )
        self.leg_failures = Counter(
            "kvbridge_proxy_leg_failures",
            "Legs that failed, per leg, backend and reason (connect, timeout, broken, http_NNN, bad_reply)",
            ["leg", "backend", "reason"],
            registry=self.registry,
        )
        self.resent = Counter(
            "kvbridge_proxy_resent_on_new_connection",
            "Requests to backends sent again on a new connection: their kept connection closed before any answer",
            registry=self.registry,
        )
        self.client_disconnects = Counter(
            "kvbridge_proxy_client_disconnects",
            "Clients that went away before their reply ended",
            registry=self.registry,
        )
        self.prefill_releases = Counter(
            "kvbridge_proxy_prefill_releases",
            "Prefill KV released because its decode leg did not read it, by outcome (released, not_taken, error)",
            ["outcome"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "kvbridge_proxy_rejected",
            "Client requests refused before any leg, by reason (invalid, body_too_large, body_timeout, overloaded)",
            ["reason"],
            registry=self.registry,
        )
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
        self.leg_seconds = Histogram(
            "kvbridge_proxy_leg_seconds",
            "Duration of successful legs: prefill until its reply, decode until its last byte",
            ["leg"],
            buckets=buckets,
            registry=self.registry,
        )
        self.first_byte_seconds = Histogram(
            "kvbridge_proxy_first_byte_seconds",
            "From a client request's arrival to the first byte of the decode reply sent back (TTFT when streaming)",
            buckets=buckets,
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "kvbridge_proxy_request_seconds",
            "From a client request's arrival to the end of its reply",
            buckets=buckets,
            registry=self.registry,
        )
        self.decisions = Counter(
            "kvbridge_proxy_decisions",
            "Sub-requests by path (direct: straight to a decode instance; disaggregated: prefill then decode) and "
            "reason (below_threshold, decode_idle, no_prefill, at_or_above_threshold, always, prompt_logprobs)",
            ["path", "reason"],
            registry=self.registry,
        )
        self.routed = Counter(
            "kvbridge_proxy_routed",
            "Legs routed, per leg, backend and why that backend (prefix, least_loaded, overloaded, balancer)",
            ["leg", "backend", "why"],
            registry=self.registry,
        )
        self.held_tokens = Counter(
            "kvbridge_proxy_estimated_held_tokens",
            "Prompt tokens the chosen instance was estimated to hold already (its prefix index), per leg",
            ["leg"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "kvbridge_proxy_estimated_prompt_tokens",
            "Prompt tokens routed (estimated for text: 4 characters a token), per path",
            ["path"],
            registry=self.registry,
        )
        self.registry.register(_BalancerCollector(balancer))

    def watch(self, router: Router) -> None:
        self.registry.register(_RouterCollector(router))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _BalancerCollector:
    """Backend gauges read from the balancer at scrape time (it is the one source of truth)."""

    def __init__(self, balancer: Balancer) -> None:
        self.balancer = balancer

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        labels = ["leg", "backend"]
        up = GaugeMetricFamily("kvbridge_proxy_backend_up", "1 while a backend is in rotation", labels=labels)
        inflight = GaugeMetricFamily(
            "kvbridge_proxy_backend_inflight", "Outstanding requests per backend", labels=labels
        )
        for b in self.balancer.backends():
            up.add_metric([b.kind, b.name], 1.0 if b.up else 0.0)
            inflight.add_metric([b.kind, b.name], float(b.outstanding))
        yield up
        yield inflight


class _RouterCollector:
    """The router's state at scrape time: the threshold for an idle decode instance, the learned costs (NaN until
    measured) and each instance's prefix index size."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        costs = self.router.learner.costs
        threshold = self.router.threshold(0)
        nan = float("nan")
        for name, doc, value in (
            (
                "direct_threshold_tokens",
                "New tokens below which a request goes straight to a decode instance, no instance having a queue "
                "and the prefill instance holding the whole prompt (NaN: always disaggregated)",
                threshold,
            ),
            ("prefill_tokens_per_second", "Learned prefill throughput", costs.prefill_tokens_per_s),
            ("transfer_seconds_per_token", "Learned KV transfer time per token", costs.transfer_s_per_token),
            ("hop_seconds", "Learned cost of the prefill hop beyond its compute", costs.hop_s),
        ):
            yield GaugeMetricFamily(f"kvbridge_proxy_{name}", doc, value=nan if value is None else value)
        blocks = GaugeMetricFamily(
            "kvbridge_proxy_prefix_index_blocks",
            "Block keys in each instance's prefix index",
            labels=["leg", "backend"],
        )
        for b, index in self.router.indexes.items():
            blocks.add_metric([b.kind, b.name], float(len(index)))
        yield blocks
