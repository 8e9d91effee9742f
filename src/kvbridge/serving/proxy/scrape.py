"""Reading the backends' own /metrics for the costs selective disaggregation weighs (costs.py): each up backend
every `metrics_interval_s`, parsed with prometheus_client's parser. Only the lines of the series the costs read
are parsed: the parser is pure Python and runs on the event loop that relays every request, and a vLLM server's
/metrics is hundreds of lines of histogram buckets. A backend that does not answer, or answers
something that is not Prometheus text, teaches nothing this round (logged at debug: its health is health.py's)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvbridge.serving.proxy.balancer import PREFILL, Backend, Balancer
from kvbridge.serving.proxy.costs import SERIES, CostLearner, Sample

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("kvbridge.serving.proxy")


def parse_samples(text: str, names: Iterable[str] | None = None) -> list[Sample]:
    """The samples of Prometheus `text`; with `names`, only those of series so named (their lines are picked out
    before parsing)."""
    from prometheus_client.parser import text_string_to_metric_families

    if names is not None:
        starts = tuple(f"{name}{end}" for name in names for end in ("{", " "))
        text = "".join(line for line in text.splitlines(keepends=True) if line.startswith(starts))
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


class CostScraper:
    def __init__(
        self,
        balancer: Balancer,
        learner: CostLearner,
        client: Callable[[], httpx.AsyncClient],
        interval_s: float,
        timeout_s: float,
    ) -> None:
        self.balancer = balancer
        self.learner = learner
        self._client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s

    async def loop(self) -> None:
        while True:
            await self.once()
            await asyncio.sleep(self.interval_s)

    async def once(self) -> None:
        await asyncio.gather(*(self._read(b) for b in self.balancer.backends() if b.up))

    async def _read(self, backend: Backend) -> None:
        import httpx

        try:
            resp = await self._client().get(backend.url + "/metrics", timeout=self.timeout_s)
            resp.raise_for_status()
            samples = parse_samples(resp.text, SERIES)
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("no metrics from %s: %s: %s", backend.url, type(exc).__name__, exc)
            return
        if backend.kind == PREFILL:
            self.learner.prefill_read(backend.name, samples)
        else:
            self.learner.decode_read(backend.name, samples)
