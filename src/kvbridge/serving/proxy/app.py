"""The HTTP application: the Starlette routes, reading a client's body within its limits, and the Proxy object
that owns the httpx client and the health task (`start()` / `close()`, called by the app's lifespan)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from kvbridge.serving.proxy import fanout
from kvbridge.serving.proxy.balancer import DECODE, KINDS, Balancer, NoBackendError
from kvbridge.serving.proxy.call import CHAT_COMPLETIONS, COMPLETIONS, Call, watch_client
from kvbridge.serving.proxy.config import ProxyConfig
from kvbridge.serving.proxy.errors import InvalidRequest, error_json
from kvbridge.serving.proxy.flow import Flow
from kvbridge.serving.proxy.health import Health
from kvbridge.serving.proxy.inbound import parse_body, request_id
from kvbridge.serving.proxy.legs import Upstream
from kvbridge.serving.proxy.metrics import ProxyMetrics
from kvbridge.serving.proxy.releases import Releaser, read_auth_key
from kvbridge.serving.proxy.router import Router
from kvbridge.serving.proxy.scrape import CostScraper

if TYPE_CHECKING:
    import asyncio

    import httpx

log = logging.getLogger("kvbridge.serving.proxy")


class Proxy:
    """`start()` / `close()` own the httpx client and the health task; `app()` is the Starlette application,
    whose lifespan calls them."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.balancer = Balancer(config.prefill, config.decode)
        self.metrics = ProxyMetrics(self.balancer)
        self.health = Health(self.balancer, lambda: self.client, config.health_interval_s, config.health_timeout_s)
        self.upstream = Upstream(config, self.balancer, self.health, self.metrics, lambda: self.client)
        self.releaser = Releaser(self.metrics, config.release_timeout_s)
        self.router = Router(config, self.balancer)
        self.metrics.watch(self.router)
        self.flow = Flow(self.upstream, self.releaser, self.router)
        self.scraper = CostScraper(
            self.balancer, self.router.learner, lambda: self.client, config.metrics_interval_s, config.health_timeout_s
        )
        self.inflight = 0
        """Client completion requests being handled (from their arrival)."""
        self._key_loaded = False
        self._client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._scrape_task: asyncio.Task[None] | None = None

    # lifecycle

    def load_key(self) -> None:
        """Read `auth_key_file` (once; `start()` calls this, `run()` earlier for a clean error)."""
        if not self._key_loaded:
            self.releaser.key = read_auth_key(self.config.auth_key_file)
            self._key_loaded = True

    async def start(self) -> None:
        import asyncio

        import httpx

        self.load_key()
        cfg = self.config
        from kvbridge.serving.proxy.pool import backend_transport

        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.decode_timeout_s, connect=cfg.connect_timeout_s),
            transport=backend_transport(cfg.max_connections, cfg.backend_keepalive_s, self._resent),
            trust_env=False,  # backends are reached directly, never through an HTTP(S)_PROXY
        )
        self._health_task = asyncio.create_task(self.health.loop(), name="kvbridge-proxy-health")
        if self.learns_costs:
            self._scrape_task = asyncio.create_task(self.scraper.loop(), name="kvbridge-proxy-costs")

    def _resent(self, request: httpx.Request, exc: Exception) -> None:
        self.metrics.resent.inc()
        log.info(
            "%s %s: the kept connection closed before any answer (%s); sent again on a new one",
            request.method,
            request.url,
            type(exc).__name__,
        )

    @property
    def learns_costs(self) -> bool:
        """Selective disaggregation with a learned threshold reads the backends' /metrics."""
        cfg = self.config
        return cfg.disaggregation == "selective" and cfg.direct_below_tokens is None

    async def close(self) -> None:
        import asyncio
        import contextlib

        for task in (self._health_task, self._scrape_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._health_task = self._scrape_task = None
        await self.releaser.drain()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("Proxy.start() was not called")
        return self._client

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route

        @asynccontextmanager
        async def lifespan(_app: Any) -> AsyncIterator[None]:
            await self.start()
            try:
                yield
            finally:
                await self.close()

        return Starlette(
            routes=[
                Route(COMPLETIONS, _CompletionEndpoint(self, COMPLETIONS), methods=["POST"]),
                Route(CHAT_COMPLETIONS, _CompletionEndpoint(self, CHAT_COMPLETIONS), methods=["POST"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
            ],
            lifespan=lifespan,
        )

    # small endpoints

    async def _health(self, _request: Any) -> Any:
        """Up and down counts per kind only: which backends and why they failed is for the log."""
        from starlette.responses import JSONResponse

        ok = all(self.balancer.up(kind) for kind in KINDS)
        doc = {
            "status": "ok" if ok else "unavailable",
            "inflight": self.inflight,
            "backends": {
                kind: {"up": len(self.balancer.up(kind)), "total": len(self.balancer.backends(kind))} for kind in KINDS
            },
        }
        return JSONResponse(doc, status_code=200 if ok else 503)

    async def _metrics(self, _request: Any) -> Any:
        from starlette.responses import Response

        body, content_type = self.metrics.render()
        return Response(body, headers={"content-type": content_type})

    async def _models(self, _request: Any) -> Any:
        import httpx
        from starlette.responses import Response

        try:
            backend = self.balancer.pick(DECODE)
        except NoBackendError as exc:
            return Response(error_json(503, "service_unavailable", str(exc)), 503, media_type="application/json")
        try:
            resp = await self.client.get(backend.url + "/v1/models", timeout=self.config.health_timeout_s)
        except httpx.HTTPError as exc:
            log.warning("GET /v1/models from %s failed: %s: %s", backend.url, type(exc).__name__, exc)
            msg = f"{backend.name}: {type(exc).__name__}"
            return Response(error_json(502, "bad_gateway", msg, backend.name), 502, media_type="application/json")
        return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))

    # completions

    async def complete(self, scope: Mapping[str, Any], receive: Any, send: Any, path: str) -> None:
        """ASGI handler of one completion request."""
        cfg = self.config
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        forwarded = {"x-request-id": request_id(headers.get("x-request-id"), cfg.max_request_id_chars)}
        if "authorization" in headers:
            forwarded["authorization"] = headers["authorization"]
        call = Call(send, path, forwarded)
        try:
            if cfg.max_inflight and self.inflight >= cfg.max_inflight:  # before the body: it costs memory too
                msg = f"the proxy is handling {self.inflight} requests already (max_inflight)"
                await self._reject(call, "overloaded", 503, error_json(503, "overloaded", msg), close=True)
                return
            self.inflight += 1
            try:
                body = await self._read_body(call, receive)
                if body is None:
                    return
                call.body = body
                try:
                    plan = fanout.plan(body, call.chat, cfg.max_prompts_per_request, cfg.max_n)
                except InvalidRequest as exc:
                    await self._reject(call, "invalid", exc.status, exc.body())
                    return
                await self._run(call, receive, plan)
            finally:
                self.inflight -= 1
        finally:
            status = 499 if call.disconnected else call.status or 500
            if call.disconnected:
                self.metrics.client_disconnects.inc()
            self.metrics.requests.labels(path, str(status)).inc()
            self.metrics.request_seconds.observe(time.monotonic() - call.arrived)

    async def _reject(self, call: Call, reason: str, status: int, body: bytes, close: bool = False) -> None:
        """Refuse a request before any leg; `close`: its body may be unread, so the connection cannot be reused."""
        self.metrics.rejected.labels(reason).inc()
        await call.reply(status, body, close=close)

    async def _read_body(self, call: Call, receive: Any) -> dict[str, Any] | None:
        """The request's JSON object, or None when a reply (an error) was sent or the client went away."""
        import anyio

        cfg = self.config
        raw = bytearray()
        with anyio.move_on_after(cfg.body_timeout_s) as deadline:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    call.disconnected = True
                    return None
                raw += message.get("body", b"")
                if len(raw) > cfg.max_body_bytes:
                    msg = f"request body over {cfg.max_body_bytes} bytes"
                    error = error_json(413, "invalid_request_error", msg)
                    await self._reject(call, "body_too_large", 413, error, close=True)
                    return None
                if not message.get("more_body", False):
                    break
        if deadline.cancelled_caught:
            msg = f"the request body did not arrive within {cfg.body_timeout_s} s"
            await self._reject(call, "body_timeout", 408, error_json(408, "timeout", msg), close=True)
            return None
        try:
            return parse_body(bytes(raw), cfg.max_json_depth)
        except InvalidRequest as exc:
            await self._reject(call, "invalid", exc.status, exc.body())
            return None

    async def _run(self, call: Call, receive: Any, plan: fanout.Plan) -> None:
        """The PD flow, while watching for the client going away (which cancels the legs in flight)."""
        import anyio

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(watch_client, receive, call, tasks.cancel_scope)
            try:
                await self.flow.run(call, plan)
            finally:
                tasks.cancel_scope.cancel()


class _CompletionEndpoint:
    """An ASGI app for one completion path (Starlette routes objects that are not functions as ASGI apps)."""

    def __init__(self, proxy: Proxy, path: str) -> None:
        self.proxy = proxy
        self.path = path

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.proxy.complete(scope, receive, send, self.path)
