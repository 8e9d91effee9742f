"""Backends out of rotation, and back: a backend whose connection failed is marked down (the reason goes to the
log), a background task probes every down backend's /health each `health_interval_s` and puts it back when it
answers 200. A slow backend (read timeout) stays in: slow is not dead."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvbridge.serving.proxy.balancer import Backend, Balancer

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("kvbridge.serving.proxy")


class Health:
    def __init__(
        self, balancer: Balancer, client: Callable[[], httpx.AsyncClient], interval_s: float, timeout_s: float
    ) -> None:
        self.balancer = balancer
        self._client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s

    def mark_down(self, backend: Backend, reason: str) -> None:
        if self.balancer.mark_down(backend, reason):
            log.warning("%s backend %s taken out of rotation: %s", backend.kind, backend.url, reason)

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            down = self.balancer.down()
            if down:
                await asyncio.gather(*(self._probe(b) for b in down))

    async def _probe(self, backend: Backend) -> None:
        import httpx

        try:
            resp = await self._client().get(backend.url + "/health", timeout=self.timeout_s)
        except httpx.HTTPError:
            return
        if resp.status_code == 200 and self.balancer.mark_up(backend):
            log.warning("%s backend %s is healthy again: back in rotation", backend.kind, backend.url)
