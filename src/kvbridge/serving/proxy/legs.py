"""Sending one leg to a backend: the POST, retries on another backend of the kind while no connection can be
made (nothing was sent, so it is safe), and what a transport failure means for the client (502 or 504) and for
the backend (out of rotation unless merely slow)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvbridge.serving.proxy.balancer import PREFILL, Backend, Balancer, NoBackendError
from kvbridge.serving.proxy.call import close_shielded
from kvbridge.serving.proxy.config import ProxyConfig
from kvbridge.serving.proxy.errors import LegFailed, error_json
from kvbridge.serving.proxy.health import Health
from kvbridge.serving.proxy.metrics import ProxyMetrics

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("kvbridge.serving.proxy")


class Upstream:
    """The backends as the PD flow uses them: `leg` sends, `prefill` sends a prefill leg and returns its
    kv_transfer_params."""

    def __init__(
        self,
        config: ProxyConfig,
        balancer: Balancer,
        health: Health,
        metrics: ProxyMetrics,
        client: Callable[[], httpx.AsyncClient],
    ) -> None:
        self.config = config
        self.balancer = balancer
        self.health = health
        self.metrics = metrics
        self._client = client

    async def prefill(
        self, first: Backend, path: str, headers: Mapping[str, str], body: dict[str, Any]
    ) -> dict[str, Any]:
        """The prefill leg's kv_transfer_params. Owns `first`'s count (released here, whatever happens)."""
        import httpx

        started = time.monotonic()
        timeout = self.config.prefill_timeout_s
        backend, resp = await self.leg(PREFILL, first, path, headers, body, timeout)
        try:
            content = await resp.aread()
        except httpx.TransportError as exc:
            raise self.transport_failure(PREFILL, backend, exc, timeout) from None
        finally:
            self.balancer.release(backend)
            await close_shielded(resp)
        self.metrics.leg_seconds.labels(PREFILL).observe(time.monotonic() - started)
        try:
            params = json.loads(content).get("kv_transfer_params")
        except (ValueError, AttributeError, RecursionError):
            params = None
        if not isinstance(params, dict) or not params:
            self.metrics.leg_failures.labels(PREFILL, backend.name, "bad_reply").inc()
            msg = (
                f"{backend.name} returned no kv_transfer_params: is it running KVBridgeConnector "
                "(or NixlConnector) with kv_role kv_producer or kv_both?"
            )
            log.warning("prefill backend %s: %s", backend.url, msg)
            raise LegFailed(502, error_json(502, "bad_gateway", msg, backend.name))
        return params

    async def leg(
        self,
        kind: str,
        first: Backend,
        path: str,
        headers: Mapping[str, str],
        body: dict[str, Any],
        timeout: float,
    ) -> tuple[Backend, httpx.Response]:
        """Send one leg; while no connection can be made, retry on other backends of the kind.

        Owns `first`'s count: on any failure (cancellation included) the count is released; on success the
        returned backend's count and the 2xx response (body unread) belong to the caller."""
        backend = first
        attempt = 0
        while True:
            try:
                return backend, await self._send(kind, backend, path, headers, body, timeout)
            except LegFailed as failure:
                self.balancer.release(backend)
                if not failure.retry or attempt >= self.config.connect_retries:
                    raise
                try:
                    backend = self.balancer.acquire(kind)
                except NoBackendError:
                    raise failure from None
                attempt += 1
                log.info("retrying the %s leg on %s", kind, backend.url)
            except BaseException:
                self.balancer.release(backend)
                raise

    async def _send(
        self,
        kind: str,
        backend: Backend,
        path: str,
        headers: Mapping[str, str],
        body: dict[str, Any],
        timeout: float,
    ) -> httpx.Response:
        import httpx

        client = self._client()
        request = client.build_request(
            "POST",
            backend.url + path,
            json=body,
            headers=dict(headers),
            timeout=httpx.Timeout(timeout, connect=self.config.connect_timeout_s),
        )
        self.metrics.leg_requests.labels(kind, backend.name).inc()
        try:
            resp = await client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise self.transport_failure(kind, backend, exc, timeout) from None
        if resp.status_code >= 300:  # the backend's own error: passed through
            try:
                content = await resp.aread()
            except httpx.TransportError as exc:
                raise self.transport_failure(kind, backend, exc, timeout) from None
            finally:
                await close_shielded(resp)
            self.metrics.leg_failures.labels(kind, backend.name, f"http_{resp.status_code}").inc()
            raise LegFailed(resp.status_code, content, resp.headers.get("content-type", "application/json"))
        return resp

    def transport_failure(self, kind: str, backend: Backend, exc: Exception, timeout: float) -> LegFailed:
        """Count a failed connection or read, take the backend out of rotation unless it is merely slow,
        and say what the client gets: 504 for a timeout, 502 otherwise. The client sees the backend's name
        (`prefill-0`), the log its URL."""
        import httpx

        name = type(exc).__name__
        log.warning("%s leg to %s failed: %s: %s", kind, backend.url, name, exc)
        connect = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
        if isinstance(exc, httpx.TimeoutException):
            if connect:
                self.health.mark_down(backend, f"{name} after {self.config.connect_timeout_s} s")
            self.metrics.leg_failures.labels(kind, backend.name, "connect_timeout" if connect else "timeout").inc()
            limit = self.config.connect_timeout_s if connect else timeout
            msg = f"{backend.name} did not answer within {limit} s ({name})"
            return LegFailed(504, error_json(504, "gateway_timeout", msg, backend.name), retry=connect)
        self.health.mark_down(backend, f"{name}: {exc}")
        self.metrics.leg_failures.labels(kind, backend.name, "connect" if connect else "broken").inc()
        what = "is unreachable" if connect else "broke the connection"
        msg = f"{backend.name} {what} ({name})"
        return LegFailed(502, error_json(502, "bad_gateway", msg, backend.name), retry=connect)
