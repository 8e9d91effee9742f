"""`kvbridge proxy`: an OpenAI-compatible router in front of prefill and decode vLLM servers.

    kvbridge proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Each POST /v1/completions or /v1/chat/completions becomes two legs, speaking the `kv_transfer_params`
protocol of README.md:

1. prefill leg: the client's body with `max_tokens=1` (and `max_completion_tokens=1` for chat), `stream=false`
   and `kv_transfer_params={"do_remote_decode": true}`, sent to the prefill backend with the fewest
   outstanding requests;
2. decode leg: the client's body plus the prefill reply's top-level `kv_transfer_params`, sent to the decode
   backend with the fewest outstanding requests; its reply goes back to the client as it arrives (SSE
   passthrough when the client asked for `stream`, the JSON otherwise).

Failures come back as JSON `{"error": {"message", "type", "code", "backend"}}`: a backend that refuses or drops
the connection gives 502 (`bad_gateway`), a backend that does not answer in time 504 (`gateway_timeout`), no
backend of a kind up 503 (`service_unavailable`); a backend's own HTTP error is passed through unchanged.
A backend whose connection failed leaves the rotation; a background task polls its /health every
`health_interval_s` and puts it back when it answers 200. A slow backend (read timeout) stays in. A request
that could not connect is retried on another backend of the same kind (`connect_retries`), since nothing was
sent. A client that disconnects aborts the legs in flight: the upstream connection is closed, which makes vLLM
abort the request.

GET /health (200 when each kind has a backend up, else 503; JSON with every backend), GET /metrics
(Prometheus: `kvbridge_proxy_*`), GET /v1/models (from a decode backend).

The routing state is `Balancer`, pure bookkeeping with no I/O; `Proxy` is the HTTP shell (httpx, Starlette,
uvicorn) around it.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbridge.core.errors import ConfigError

if TYPE_CHECKING:  # imported where used: `kvbridge plan` must not need the HTTP stack
    import asyncio

    import httpx

log = logging.getLogger("kvbridge.serving.proxy")

PREFILL = "prefill"
DECODE = "decode"
KINDS = (PREFILL, DECODE)
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


# --- routing state (pure) ---------------------------------------------------------------------------------


class NoBackendError(Exception):
    """No backend of `kind` is in rotation."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        super().__init__(f"no {kind} backend is up")


@dataclass(eq=False)
class Backend:
    """One upstream server as the balancer sees it. Identity is the object: the same URL may be listed both
    as a prefill and as a decode backend (a kv_both server), and is then two backends."""

    url: str
    kind: str
    index: int
    up: bool = True
    outstanding: int = 0
    """Requests picked for this backend and not yet released."""
    picks: int = 0
    """Requests ever picked for it."""
    last_pick: int = -1
    """When it was last picked (the balancer's pick count then): ties go to the least recently picked."""
    last_error: str | None = None


class Balancer:
    """Which backend serves the next leg: the up backend of the kind with the fewest outstanding requests
    (ties: the least recently picked, so idle backends take turns). No I/O, no clock: the HTTP shell calls
    `acquire` / `release` around each leg and `mark_down` / `mark_up` on failures and recoveries."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        self._backends: dict[str, list[Backend]] = {}
        for kind, urls in ((PREFILL, prefill), (DECODE, decode)):
            normalized = [normalize_url(u) for u in urls]
            if not normalized:
                raise ConfigError(f"at least one {kind} backend is needed")
            dupes = sorted({u for u in normalized if normalized.count(u) > 1})
            if dupes:
                raise ConfigError(f"{kind} backend listed twice: {', '.join(dupes)}")
            self._backends[kind] = [Backend(url, kind, i) for i, url in enumerate(normalized)]
        self._picks = 0

    def backends(self, kind: str | None = None) -> list[Backend]:
        if kind is None:
            return [b for k in KINDS for b in self._backends[k]]
        return list(self._backends[kind])

    def up(self, kind: str) -> list[Backend]:
        return [b for b in self._backends[kind] if b.up]

    def down(self) -> list[Backend]:
        return [b for b in self.backends() if not b.up]

    def pick(self, kind: str) -> Backend:
        """The backend the next leg of `kind` should go to (does not count it: see `acquire`)."""
        candidates = self.up(kind)
        if not candidates:
            raise NoBackendError(kind)
        return min(candidates, key=lambda b: (b.outstanding, b.last_pick, b.index))

    def acquire(self, kind: str) -> Backend:
        """Pick a backend and count one outstanding request on it; pair with `release`."""
        backend = self.pick(kind)
        backend.outstanding += 1
        backend.picks += 1
        backend.last_pick = self._picks
        self._picks += 1
        return backend

    def release(self, backend: Backend) -> None:
        if backend.outstanding <= 0:
            raise ValueError(f"release of {backend.kind} backend {backend.url} with no outstanding request")
        backend.outstanding -= 1

    def mark_down(self, backend: Backend, reason: str) -> bool:
        """Take `backend` out of rotation; True if it was up (the caller then logs it)."""
        was_up = backend.up
        backend.up = False
        backend.last_error = reason
        return was_up

    def mark_up(self, backend: Backend) -> bool:
        """Put `backend` back in rotation; True if it was down."""
        was_down = not backend.up
        backend.up = True
        return was_down


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise ConfigError(f"backend URL must look like http://host:port, got {url!r}")
    return url


# --- request bodies (pure) --------------------------------------------------------------------------------


def prefill_body(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill leg's body: the client's, generating one token, not streamed, asking to keep the KV."""
    out = dict(body)
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if chat:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)  # vLLM refuses stream_options without stream
    out.pop("min_tokens", None)  # and min_tokens above max_tokens
    return out


def decode_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]) -> dict[str, Any]:
    """The decode leg's body: the client's, plus what the prefill leg returned."""
    return {**body, "kv_transfer_params": dict(kv_transfer_params)}


def error_json(status: int, kind: str, message: str, backend: str | None = None) -> bytes:
    error: dict[str, Any] = {"message": message, "type": kind, "code": status}
    if backend is not None:
        error["backend"] = backend
    return json.dumps({"error": error}).encode()


# --- configuration ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProxyConfig:
    prefill: tuple[str, ...]
    """Prefill backends' base URLs (http://host:port)."""
    decode: tuple[str, ...]
    """Decode backends' base URLs."""
    connect_timeout_s: float = 5.0
    """Connecting to a backend; past it the backend is taken out of rotation (504)."""
    prefill_timeout_s: float = 300.0
    """Longest wait for the prefill leg's reply (504 after it)."""
    decode_timeout_s: float = 600.0
    """Longest wait for the decode backend's next bytes: the whole reply when not streaming, the gap
    between chunks when streaming (504, or an error event in the stream)."""
    health_interval_s: float = 1.0
    """How often backends out of rotation are probed on /health."""
    health_timeout_s: float = 2.0
    connect_retries: int = 1
    """Further backends of the same kind to try when a connection cannot be made."""
    max_inflight: int = 0
    """Client requests handled at once; more get 503 (`overloaded`). 0: no limit."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body accepted (413 above)."""
    max_connections: int = 1000
    """Connections to all backends together (httpx pool)."""
    backend_keepalive_s: float = 0.0
    """How long a connection to a backend may idle to be reused; 0: a new connection per leg (nginx's default
    towards upstreams). Reuse races the backend's own keep-alive timeout (uvicorn: 5 s, vLLM's
    VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a backend whose event loop stalls past it closes a reused connection with the
    request already in it, and the client gets a 502. Seen in CI under load on 2 cores; on loopback a new
    connection costs well under a millisecond."""

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "prefill_timeout_s", "decode_timeout_s", "health_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.health_timeout_s > 0:
            raise ConfigError(f"health_timeout_s must be positive, got {self.health_timeout_s}")
        if self.connect_retries < 0:
            raise ConfigError(f"connect_retries must be >= 0, got {self.connect_retries}")
        if self.max_inflight < 0:
            raise ConfigError(f"max_inflight must be >= 0, got {self.max_inflight}")
        if self.backend_keepalive_s < 0:
            raise ConfigError(f"backend_keepalive_s must be >= 0, got {self.backend_keepalive_s}")
        if self.max_body_bytes < 1 or self.max_connections < 1:
            raise ConfigError("max_body_bytes and max_connections must be positive")
        Balancer(self.prefill, self.decode)  # validates the URLs


# --- metrics ----------------------------------------------------------------------------------------------


class ProxyMetrics:
    """Prometheus metrics in a registry of their own (several proxies may live in one process)."""

    def __init__(self, balancer: Balancer) -> None:
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
        self.client_disconnects = Counter(
            "kvbridge_proxy_client_disconnects",
            "Clients that went away before their reply ended",
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
        self.registry.register(_BalancerCollector(balancer))

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
            up.add_metric([b.kind, b.url], 1.0 if b.up else 0.0)
            inflight.add_metric([b.kind, b.url], float(b.outstanding))
        yield up
        yield inflight


# --- the HTTP shell ---------------------------------------------------------------------------------------


class _LegFailed(Exception):
    """A leg failed in a way that ends the client request with `status` and `body`. `retry`: nothing reached
    the backend (no connection), so another backend of the kind may be tried."""

    def __init__(self, status: int, body: bytes, content_type: str = "application/json", retry: bool = False):
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status
        self.body = body
        self.content_type = content_type
        self.retry = retry


class _Call:
    """One client completion request in flight, and the state of the reply sent to it."""

    def __init__(self, send: Any, path: str, headers: dict[str, str]) -> None:
        self._send = send
        self.path = path
        self.chat = path == CHAT_COMPLETIONS
        self.body: dict[str, Any] = {}
        """The client's request, once read."""
        self.headers = headers
        """Forwarded to both legs (x-request-id, authorization)."""
        self.arrived = time.monotonic()
        self.status = 0
        """Status sent to the client (0: nothing sent yet)."""
        self.done = False
        """The reply is complete."""
        self.disconnected = False
        """The client went away before the reply was complete."""

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def request_id(self) -> str:
        return self.headers["x-request-id"]

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif not message.get("more_body", False):
            self.done = True
        await self._send(message)

    async def reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        await _reply(self.send, status, body, self.request_id, content_type)


class Proxy:
    """The HTTP shell around a `Balancer`. `start()` / `close()` own the httpx client and the health task;
    `app()` is the Starlette application, whose lifespan calls them."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.balancer = Balancer(config.prefill, config.decode)
        self.metrics = ProxyMetrics(self.balancer)
        self.inflight = 0
        """Client completion requests being handled."""
        self._client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task[None] | None = None

    # lifecycle

    async def start(self) -> None:
        import asyncio

        import httpx

        cfg = self.config
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.decode_timeout_s, connect=cfg.connect_timeout_s),
            limits=httpx.Limits(
                max_connections=cfg.max_connections,
                max_keepalive_connections=min(cfg.max_connections, 100) if cfg.backend_keepalive_s else 0,
                keepalive_expiry=cfg.backend_keepalive_s or None,
            ),
            trust_env=False,  # backends are reached directly, never through an HTTP(S)_PROXY
        )
        self._health_task = asyncio.create_task(self._health_loop(), name="kvbridge-proxy-health")

    async def close(self) -> None:
        import asyncio
        import contextlib

        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
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

    # backends out of rotation

    async def _health_loop(self) -> None:
        import asyncio

        while True:
            await asyncio.sleep(self.config.health_interval_s)
            down = self.balancer.down()
            if down:
                await asyncio.gather(*(self._probe(b) for b in down))

    async def _probe(self, backend: Backend) -> None:
        import httpx

        try:
            resp = await self.client.get(backend.url + "/health", timeout=self.config.health_timeout_s)
        except httpx.HTTPError:
            return
        if resp.status_code == 200 and self.balancer.mark_up(backend):
            log.warning("%s backend %s is healthy again: back in rotation", backend.kind, backend.url)

    def _mark_down(self, backend: Backend, reason: str) -> None:
        if self.balancer.mark_down(backend, reason):
            log.warning("%s backend %s taken out of rotation: %s", backend.kind, backend.url, reason)

    # small endpoints

    async def _health(self, _request: Any) -> Any:
        from starlette.responses import JSONResponse

        ok = all(self.balancer.up(kind) for kind in KINDS)
        doc = {
            "status": "ok" if ok else "unavailable",
            "inflight": self.inflight,
            "backends": [
                {"kind": b.kind, "url": b.url, "up": b.up, "outstanding": b.outstanding, "last_error": b.last_error}
                for b in self.balancer.backends()
            ],
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
            msg = f"decode backend {backend.url}: {type(exc).__name__}"
            return Response(error_json(502, "bad_gateway", msg, backend.url), 502, media_type="application/json")
        return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))

    # completions

    async def complete(self, scope: Mapping[str, Any], receive: Any, send: Any, path: str) -> None:
        """ASGI handler of one completion request."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        forwarded = {"x-request-id": headers.get("x-request-id") or uuid.uuid4().hex}
        if "authorization" in headers:
            forwarded["authorization"] = headers["authorization"]
        call = _Call(send, path, forwarded)
        try:
            body = await self._read_body(call, receive)
            if body is not None:
                call.body = body
                await self._run(call, receive)
        finally:
            status = 499 if call.disconnected else call.status or 500
            if call.disconnected:
                self.metrics.client_disconnects.inc()
            self.metrics.requests.labels(path, str(status)).inc()
            self.metrics.request_seconds.observe(time.monotonic() - call.arrived)

    async def _read_body(self, call: _Call, receive: Any) -> dict[str, Any] | None:
        """The request's JSON object, or None when a reply (an error) was sent or the client went away."""
        raw = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                call.disconnected = True
                return None
            raw += message.get("body", b"")
            if len(raw) > self.config.max_body_bytes:
                msg = f"request body over {self.config.max_body_bytes} bytes"
                await call.reply(413, error_json(413, "invalid_request_error", msg))
                return None
            if not message.get("more_body", False):
                break
        try:
            body = json.loads(raw)
        except ValueError as exc:
            await call.reply(400, error_json(400, "invalid_request_error", f"the body is not JSON: {exc}"))
            return None
        if not isinstance(body, dict):
            await call.reply(400, error_json(400, "invalid_request_error", "the body must be a JSON object"))
            return None
        return body

    async def _run(self, call: _Call, receive: Any) -> None:
        """Both legs, while watching for the client going away (which cancels the leg in flight)."""
        import anyio

        if self.config.max_inflight and self.inflight >= self.config.max_inflight:
            msg = f"the proxy is handling {self.inflight} requests already (max_inflight)"
            await call.reply(503, error_json(503, "overloaded", msg))
            return
        self.inflight += 1
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_watch_client, receive, call, tasks.cancel_scope)
                try:
                    await self._two_legs(call)
                finally:
                    tasks.cancel_scope.cancel()
        finally:
            self.inflight -= 1

    async def _two_legs(self, call: _Call) -> None:
        try:
            prefill = self.balancer.acquire(PREFILL)
        except NoBackendError as exc:
            await call.reply(503, error_json(503, "service_unavailable", str(exc)))
            return
        try:
            decode = self.balancer.acquire(DECODE)
        except NoBackendError as exc:
            self.balancer.release(prefill)
            await call.reply(503, error_json(503, "service_unavailable", str(exc)))
            return
        try:
            try:
                params = await self._prefill_leg(call, prefill)
            except BaseException:
                self.balancer.release(decode)
                raise
            started = time.monotonic()
            body = decode_body(call.body, params)
            backend, resp = await self._leg(DECODE, decode, call, body, self.config.decode_timeout_s)
            try:
                await self._relay(call, backend, resp)
            finally:
                self.balancer.release(backend)
                await _close_shielded(resp)
            if call.done and call.status < 300:
                self.metrics.leg_seconds.labels(DECODE).observe(time.monotonic() - started)
        except _LegFailed as failure:
            await call.reply(failure.status, failure.body, failure.content_type)

    async def _prefill_leg(self, call: _Call, first: Backend) -> dict[str, Any]:
        """The prefill leg's kv_transfer_params. Owns `first`'s count (released here, whatever happens)."""
        import httpx

        started = time.monotonic()
        body = prefill_body(call.body, call.chat)
        backend, resp = await self._leg(PREFILL, first, call, body, self.config.prefill_timeout_s)
        try:
            content = await resp.aread()
        except httpx.TransportError as exc:
            raise self._transport_failure(PREFILL, backend, exc, self.config.prefill_timeout_s) from None
        finally:
            self.balancer.release(backend)
            await _close_shielded(resp)
        self.metrics.leg_seconds.labels(PREFILL).observe(time.monotonic() - started)
        try:
            params = json.loads(content).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict) or not params:
            self.metrics.leg_failures.labels(PREFILL, backend.url, "bad_reply").inc()
            msg = (
                f"prefill backend {backend.url} returned no kv_transfer_params: is it running KVBridgeConnector "
                "(or NixlConnector) with kv_role kv_producer or kv_both?"
            )
            raise _LegFailed(502, error_json(502, "bad_gateway", msg, backend.url))
        return params

    async def _leg(
        self, kind: str, first: Backend, call: _Call, body: dict[str, Any], timeout: float
    ) -> tuple[Backend, httpx.Response]:
        """Send one leg; while no connection can be made, retry on other backends of the kind.

        Owns `first`'s count: on any failure (cancellation included) the count is released; on success the
        returned backend's count and the 2xx response (body unread) belong to the caller."""
        backend = first
        attempt = 0
        while True:
            try:
                return backend, await self._send(kind, backend, call, body, timeout)
            except _LegFailed as failure:
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
        self, kind: str, backend: Backend, call: _Call, body: dict[str, Any], timeout: float
    ) -> httpx.Response:
        import httpx

        request = self.client.build_request(
            "POST",
            backend.url + call.path,
            json=body,
            headers=call.headers,
            timeout=httpx.Timeout(timeout, connect=self.config.connect_timeout_s),
        )
        self.metrics.leg_requests.labels(kind, backend.url).inc()
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise self._transport_failure(kind, backend, exc, timeout) from None
        if resp.status_code >= 300:  # the backend's own error: passed through
            try:
                content = await resp.aread()
            except httpx.TransportError as exc:
                raise self._transport_failure(kind, backend, exc, timeout) from None
            finally:
                await _close_shielded(resp)
            self.metrics.leg_failures.labels(kind, backend.url, f"http_{resp.status_code}").inc()
            raise _LegFailed(resp.status_code, content, resp.headers.get("content-type", "application/json"))
        return resp

    def _transport_failure(self, kind: str, backend: Backend, exc: Exception, timeout: float) -> _LegFailed:
        """Count a failed connection or read, take the backend out of rotation unless it is merely slow,
        and say what the client gets: 504 for a timeout, 502 otherwise."""
        import httpx

        name = type(exc).__name__
        connect = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
        if isinstance(exc, httpx.TimeoutException):
            if connect:
                self._mark_down(backend, f"{name} after {self.config.connect_timeout_s} s")
            self.metrics.leg_failures.labels(kind, backend.url, "connect_timeout" if connect else "timeout").inc()
            limit = self.config.connect_timeout_s if connect else timeout
            msg = f"{kind} backend {backend.url} did not answer within {limit} s ({name})"
            return _LegFailed(504, error_json(504, "gateway_timeout", msg, backend.url), retry=connect)
        self._mark_down(backend, f"{name}: {exc}")
        self.metrics.leg_failures.labels(kind, backend.url, "connect" if connect else "broken").inc()
        what = "is unreachable" if connect else "broke the connection"
        msg = f"{kind} backend {backend.url} {what} ({name}: {exc})"
        return _LegFailed(502, error_json(502, "bad_gateway", msg, backend.url), retry=connect)

    async def _relay(self, call: _Call, backend: Backend, resp: httpx.Response) -> None:
        """The decode reply to the client: chunk by chunk when streaming, whole otherwise."""
        import anyio
        import httpx

        content_type = resp.headers.get("content-type", "application/json")
        timeout = self.config.decode_timeout_s
        if not call.stream:
            try:
                content = await resp.aread()
            except httpx.TransportError as exc:
                raise self._transport_failure(DECODE, backend, exc, timeout) from None
            self.metrics.first_byte_seconds.observe(time.monotonic() - call.arrived)
            await call.reply(resp.status_code, content, content_type)
            return
        headers = [
            (b"content-type", content_type.encode("latin-1")),
            (b"cache-control", b"no-cache"),
            (b"x-request-id", call.request_id.encode("latin-1")),
        ]
        chunks = resp.aiter_raw()
        try:
            try:  # the first chunk before the status: a decode leg failing this early still gets a proper error
                first = await anext(chunks)
            except StopAsyncIteration:
                first = b""
            except httpx.TransportError as exc:
                raise self._transport_failure(DECODE, backend, exc, timeout) from None
            await call.send({"type": "http.response.start", "status": resp.status_code, "headers": headers})
            self.metrics.first_byte_seconds.observe(time.monotonic() - call.arrived)
            try:
                await call.send({"type": "http.response.body", "body": first, "more_body": True})
                async for chunk in chunks:
                    await call.send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.TransportError as exc:  # the reply has begun: end it with an error event
                failure = self._transport_failure(DECODE, backend, exc, timeout)
                await call.send({"type": "http.response.body", "body": b"data: " + failure.body + b"\n\n"})
                return
            await call.send({"type": "http.response.body", "body": b""})
        finally:
            with anyio.CancelScope(shield=True):
                await chunks.aclose()


class _CompletionEndpoint:
    """An ASGI app for one completion path (Starlette routes objects that are not functions as ASGI apps)."""

    def __init__(self, proxy: Proxy, path: str) -> None:
        self.proxy = proxy
        self.path = path

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.proxy.complete(scope, receive, send, self.path)


async def _watch_client(receive: Any, call: _Call, cancel_scope: Any) -> None:
    """Wait for the client to go away; if the reply is not complete then, cancel the legs in flight."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
    if not call.done:
        call.disconnected = True
        cancel_scope.cancel()


async def _reply(send: Any, status: int, body: bytes, request_id: str, content_type: str = "application/json") -> None:
    headers = [
        (b"content-type", content_type.encode("latin-1")),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode("latin-1")),
    ]
    if status == 503:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _close_shielded(resp: httpx.Response) -> None:
    """Close an upstream response, also while being cancelled (the client went away): closing a response
    whose body is unread drops its connection, and vLLM then aborts the request."""
    import anyio

    with anyio.CancelScope(shield=True):
        await resp.aclose()


# --- running it -------------------------------------------------------------------------------------------


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ProxyConfig(prefill=("http://x",), decode=("http://y",))
    p.add_argument("--prefill", action="append", required=True, metavar="URL", help="a prefill backend (repeat)")
    p.add_argument("--decode", action="append", required=True, metavar="URL", help="a decode backend (repeat)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    p.add_argument(
        "--connect-timeout", type=float, default=d.connect_timeout_s, metavar="S", help="connecting to a backend"
    )
    p.add_argument("--prefill-timeout", type=float, default=d.prefill_timeout_s, metavar="S", help="whole prefill leg")
    p.add_argument(
        "--decode-timeout",
        type=float,
        default=d.decode_timeout_s,
        metavar="S",
        help="longest wait for the decode backend's next bytes (the whole reply when not streaming)",
    )
    p.add_argument(
        "--health-interval", type=float, default=d.health_interval_s, metavar="S", help="probing backends that are down"
    )
    p.add_argument("--health-timeout", type=float, default=d.health_timeout_s, metavar="S", help="one /health probe")
    p.add_argument(
        "--connect-retries",
        type=int,
        default=d.connect_retries,
        metavar="N",
        help="other backends of the kind to try when connecting fails",
    )
    p.add_argument(
        "--max-inflight", type=int, default=d.max_inflight, metavar="N", help="client requests at once (0: no limit)"
    )
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, metavar="N", help="largest request body")
    p.add_argument(
        "--max-connections", type=int, default=d.max_connections, metavar="N", help="to all backends together"
    )
    p.add_argument(
        "--backend-keepalive",
        type=float,
        default=d.backend_keepalive_s,
        metavar="S",
        help="reuse idle backend connections for up to S seconds (0: a connection per leg; keep S well under the"
        " backends' keep-alive timeout)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every request")


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    def urls(values: list[str]) -> tuple[str, ...]:
        return tuple(u for v in values for u in v.split(",") if u.strip())

    return ProxyConfig(
        prefill=urls(args.prefill),
        decode=urls(args.decode),
        connect_timeout_s=args.connect_timeout,
        prefill_timeout_s=args.prefill_timeout,
        decode_timeout_s=args.decode_timeout,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        connect_retries=args.connect_retries,
        max_inflight=args.max_inflight,
        max_body_bytes=args.max_body_bytes,
        max_connections=args.max_connections,
        backend_keepalive_s=args.backend_keepalive,
    )


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C / SIGTERM (uvicorn handles both and shuts down gracefully)."""
    import uvicorn

    config = config_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    proxy = Proxy(config)
    sock = bind_socket(args.host, args.port)
    server = uvicorn.Server(
        uvicorn.Config(
            proxy.app(),
            log_level=args.log_level,
            access_log=args.access_log,
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
    )
    print(f"kvbridge proxy listening on {socket_url(sock)}", flush=True)
    for kind in KINDS:
        print(f"  {kind}: {', '.join(b.url for b in proxy.balancer.backends(kind))}", flush=True)
    try:
        server.run(sockets=[sock])  # after a graceful shutdown on a signal, uvicorn raises that signal again
    except KeyboardInterrupt:
        return 130
    finally:
        sock.close()
    return 0
